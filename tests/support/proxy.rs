//! A TCP proxy between the streamer and a server, to break the link on purpose.
//!
//! `freeze` stops forwarding in both directions while keeping every connection open — what a
//! dead network path looks like to both ends (no FIN, no RST, just silence); `thaw` resumes.
//! Dropping the proxy closes everything.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub struct Proxy {
    pub addr: SocketAddr,
    frozen: watch::Sender<bool>,
    acceptor: JoinHandle<()>,
    pumps: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Proxy {
    /// Listens on an ephemeral loopback port and forwards every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("binding the proxy");
        let addr = listener.local_addr().unwrap();
        let (frozen, watcher) = watch::channel(false);
        let pumps: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let registry = pumps.clone();
        let acceptor = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(upstream).await else { continue };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                let mut pumps = registry.lock().unwrap();
                pumps.push(tokio::spawn(pump(cr, sw, watcher.clone())));
                pumps.push(tokio::spawn(pump(sr, cw, watcher.clone())));
            }
        });
        Self { addr, frozen, acceptor, pumps }
    }

    /// Closes every connection open now (new ones are accepted as before).
    pub fn reset(&self) {
        for pump in self.pumps.lock().unwrap().drain(..) {
            pump.abort();
        }
    }

    /// Stops forwarding; connections stay open and silent.
    pub fn freeze(&self) {
        self.frozen.send_replace(true);
    }

    pub fn thaw(&self) {
        self.frozen.send_replace(false);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.acceptor.abort();
        self.reset();
    }
}

/// Copies `from` to `to` whenever not frozen; ends when either side closes.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut frozen: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if frozen.wait_for(|f| !*f).await.is_err() {
            return;
        }
        tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    // Bytes read just before a freeze are held until the thaw.
                    if frozen.wait_for(|f| !*f).await.is_err() || to.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            },
            _ = frozen.changed() => {}
        }
    }
}
