//! A TCP proxy between the streamer and a server, to break the link on purpose.
//!
//! `freeze` stops forwarding in both directions while keeping every connection open — what a
//! dead network path looks like to both ends (no FIN, no RST, just silence); `thaw` resumes.
//! `held_bytes` says how much a freeze has kept from the other side, so a test can wait until
//! an end has really met the silence. `retarget` moves it to another server (a failover).
//! Dropping the proxy closes everything.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub(crate) struct Proxy {
    pub addr: SocketAddr,
    /// Where new connections go (see [`Proxy::retarget`]).
    upstream: Arc<Mutex<SocketAddr>>,
    frozen: watch::Sender<bool>,
    /// Bytes read since the last freeze and not forwarded.
    held: Arc<AtomicUsize>,
    acceptor: JoinHandle<()>,
    pumps: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Proxy {
    /// Listens on an ephemeral loopback port and forwards every connection to `upstream`.
    pub(crate) async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("binding the proxy");
        let addr = listener.local_addr().unwrap();
        let (frozen, watcher) = watch::channel(false);
        let pumps: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let registry = pumps.clone();
        let held: Arc<AtomicUsize> = Arc::default();
        let counter = held.clone();
        let upstream = Arc::new(Mutex::new(upstream));
        let target = upstream.clone();
        let acceptor = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let to = *target.lock().unwrap();
                let Ok(server) = TcpStream::connect(to).await else { continue };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                let mut pumps = registry.lock().unwrap();
                pumps.push(tokio::spawn(pump(cr, sw, watcher.clone(), counter.clone())));
                pumps.push(tokio::spawn(pump(sr, cw, watcher.clone(), counter.clone())));
            }
        });
        Self { addr, upstream, frozen, held, acceptor, pumps }
    }

    /// Sends new connections to `upstream` from now on and closes the open ones: what a
    /// virtual IP or a DNS name moved to a promoted server looks like to the clients.
    pub(crate) fn retarget(&self, upstream: SocketAddr) {
        *self.upstream.lock().unwrap() = upstream;
        self.reset();
    }

    /// Closes every connection open now (new ones are accepted as before).
    pub(crate) fn reset(&self) {
        for pump in self.pumps.lock().unwrap().drain(..) {
            pump.abort();
        }
    }

    /// Stops forwarding; connections stay open and silent.
    pub(crate) fn freeze(&self) {
        self.held.store(0, Ordering::SeqCst);
        self.frozen.send_replace(true);
    }

    /// Bytes read from either end since the last `freeze` and held back.
    pub(crate) fn held_bytes(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }

    pub(crate) fn thaw(&self) {
        self.frozen.send_replace(false);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.acceptor.abort();
        self.reset();
    }
}

/// Copies `from` to `to`; while frozen, what was read is held (and counted) until the thaw.
/// Ends when either side closes.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut frozen: watch::Receiver<bool>,
    held: Arc<AtomicUsize>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if *frozen.borrow() {
            held.fetch_add(n, Ordering::SeqCst);
        }
        if frozen.wait_for(|f| !*f).await.is_err() || to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
