//! The message a failing test panicked with, kept so that a helper dropped while the test
//! unwinds can print it again after what it prints itself.
//!
//! A failing test's captured output begins with the panic message and ends with the streamers'
//! log tails ([`super::streamer::Running`] prints them on drop). CI summaries keep the beginning
//! and the end of a long output and cut the middle, which is where the message lands once two
//! instances' logs follow it; repeated at the very end, it survives the cut.

use std::cell::RefCell;
use std::sync::Once;

thread_local! {
    /// The last panic on this thread: its location and message.
    static LAST: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Installs (once per test binary) a panic hook that remembers each panic on its thread, then
/// runs the hook that was there before (libtest's output capture is not affected).
pub(crate) fn remember_panics() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let message = info
                .payload()
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| info.payload().downcast_ref::<&str>().copied())
                .unwrap_or("(a panic without a text message)");
            let at = info.location().map(|l| format!("{}:{}", l.file(), l.line())).unwrap_or_default();
            LAST.with(|last| *last.borrow_mut() = Some(format!("{at} ({}): {message}", utc_now())));
            previous(info);
        }));
    });
}

/// The last panic on this thread, if [`remember_panics`] was installed before it.
pub(crate) fn last_panic() -> Option<String> {
    LAST.with(|last| last.borrow().clone())
}

/// The time of day in UTC, as the streamer's log lines write it (`hh:mm:ss.mmm`), to place the
/// failure among their lines.
fn utc_now() -> String {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let (s, ms) = (since.as_secs() % 86_400, since.subsec_millis());
    format!("{:02}:{:02}:{:02}.{ms:03} UTC", s / 3600, s / 60 % 60, s % 60)
}
