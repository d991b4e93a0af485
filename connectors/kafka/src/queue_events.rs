//! The one place that calls librdkafka's C API directly (rdkafka 0.39 does not wrap it): a
//! callback when the client's main queue gets an event, so that delivery reports are served by
//! a task woken for them instead of a thread that polls (see `producer`).
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

use rdkafka::bindings as rdsys;
use tokio::sync::Notify;

/// A handle on the client's main queue (delivery reports and client errors) that wakes
/// `wake` whenever the queue goes from empty to non-empty. Dropped before the client. The
/// callback belongs to the queue, not to the handle: one `MainQueue` per client (a second one
/// would replace the first one's callback, and remove it when dropped).
pub(crate) struct MainQueue {
    queue: NonNull<rdsys::rd_kafka_queue_t>,
    /// What the callback's opaque pointer points at; kept until the registration is gone.
    _wake: Arc<Notify>,
}

// librdkafka's queue handles are thread-safe; the pointer is only used through its API.
unsafe impl Send for MainQueue {}
unsafe impl Sync for MainQueue {}

/// Called by librdkafka under the queue's lock, on whichever thread puts an event on the empty
/// main queue (its own threads, or the application's, as in a purge): only wakes the serving
/// task (no call back into librdkafka).
unsafe extern "C" fn on_queue_event(_client: *mut rdsys::rd_kafka_t, opaque: *mut c_void) {
    // SAFETY: `opaque` is the `Notify` of the `MainQueue` that registered this callback, which
    // unregisters it (under the same lock) before releasing that `Notify`.
    let wake = unsafe { &*(opaque as *const Notify) };
    wake.notify_one();
}

impl MainQueue {
    pub(crate) fn open(client: *mut rdsys::rd_kafka_t, wake: Arc<Notify>) -> Option<Self> {
        // SAFETY: `client` is a live client; the handle holds its own reference to the queue.
        let queue = NonNull::new(unsafe { rdsys::rd_kafka_queue_get_main(client) })?;
        let opaque = Arc::as_ptr(&wake) as *mut c_void;
        // SAFETY: the callback only reads `opaque`, which `self._wake` keeps alive until `drop`
        // has unregistered it.
        unsafe { rdsys::rd_kafka_queue_cb_event_enable(queue.as_ptr(), Some(on_queue_event), opaque) };
        Some(Self { queue, _wake: wake })
    }

    /// Events waiting to be served.
    pub(crate) fn len(&self) -> usize {
        // SAFETY: a live queue handle.
        unsafe { rdsys::rd_kafka_queue_length(self.queue.as_ptr()) }
    }
}

impl Drop for MainQueue {
    fn drop(&mut self) {
        // SAFETY: unregistering takes the queue's lock, so no callback runs past this call and
        // `self._wake` may go; then the handle is released.
        unsafe {
            rdsys::rd_kafka_queue_cb_event_enable(self.queue.as_ptr(), None, std::ptr::null_mut());
            rdsys::rd_kafka_queue_destroy(self.queue.as_ptr());
        }
    }
}
