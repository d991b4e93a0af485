//! Quiet tables watched together: one statement per interval for every idle polling table of
//! a source, instead of one read per table.
//!
//! A polling shard-partition whose last rescan found nothing is *quiet*. Reading its table every
//! `poll_interval_ms` for nothing is most of what polling costs when traffic is low (16 idle
//! tables at 25 ms: 640 queries a second, each a round trip and a few wake-ups). Instead a
//! quiet source registers its table with its source's [`QuietWatch`] and waits; the watch's task
//! asks, in one statement per interval, which of the registered tables hold a row above their
//! low-water mark, and wakes the sources of those. They then read as before.
//!
//! ```text
//!   PollSource (quiet) ──register(table, mark)──▶ QuietWatch ──one SELECT per interval──▶ database
//!          ▲                                           │  EXISTS(t0 > m0), EXISTS(t1 > m1), …
//!          └──────────── wake (rows in the table) ─────┘
//! ```
//!
//! # Why nothing is missed
//!
//! A row stays in its table until it is published and deleted, so every probe after its commit
//! sees it. A wake-up lost while its source was reading (or re-registering) is repeated by the
//! next probe: a quiet source learns of a commit within two intervals at worst, one in the
//! usual case. The interval is the shortest `poll_interval_ms` of all the source's polling
//! tables, quiet or not, so a table with a long interval never slows the others. Rows below the
//! low-water mark (which the probe does not look at) are found by the source's own reads: a
//! quiet source still reads its table itself at least every [`QUIET_READ_EVERY`] (or its own
//! interval, if longer), and a read from the lowest id is due every [`super::FULL_RESCAN_EVERY`].
//!
//! # When it does not work
//!
//! Its connection lost, its statement failed or timed out, a table locked (the session waits
//! for no lock longer than a moment, see the probes): the watch wakes every waiting source and
//! refuses new ones until a statement works again on a new connection, so sources poll on their
//! own at their interval meanwhile. A broken watch costs CPU, never messages or latency. It
//! holds one connection per source while any table is quiet, and gives it back after
//! [`CLOSE_IDLE_AFTER`] with none.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::{Notify, watch};

use crate::error::Error;

/// The longest a quiet source waits for the watch before it reads its table itself (its slot is
/// maintained then too, see [`super::MAINTAIN_EVERY`]).
pub(crate) const QUIET_READ_EVERY: Duration = super::MAINTAIN_EVERY;

/// How long the watch keeps its connection with no quiet table.
pub(crate) const CLOSE_IDLE_AFTER: Duration = Duration::from_secs(60);

/// A statement that fails sooner than this is tried once more on a new connection (a connection
/// the server closed answers at once); a slower failure (a timeout) is not.
const FAST_FAILURE: Duration = Duration::from_secs(1);

/// The first wait before the watch connects again after a failure; it doubles up to
/// [`RETRY_MAX`].
const RETRY_MIN: Duration = Duration::from_millis(250);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// A table the watch asks about: does it hold a row with an id above `above`?
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Watched {
    pub table: Arc<str>,
    pub above: i64,
}

/// `SELECT EXISTS (<one(t0)>), EXISTS (<one(t1)>), …`: the one statement a [`TableProbe`] runs,
/// `one` writing a table's subquery in its database's dialect (given its place in `tables`,
/// from 0, for a database that binds the marks as parameters).
pub(crate) fn exists_each<T>(tables: &[T], one: impl Fn(usize, &T) -> String) -> String {
    let probes: Vec<String> = tables.iter().enumerate().map(|(i, w)| format!("EXISTS ({})", one(i, w))).collect();
    format!("SELECT {}", probes.join(", "))
}

/// One connection that answers, in one statement, which of some tables hold rows.
pub(crate) trait TableProbe: Send {
    /// For each of `tables`, in order, whether it holds a committed row with an id above its
    /// mark. An empty list runs a trivial statement (the connection works or not).
    fn holding<'a>(&'a mut self, tables: &'a [Watched]) -> BoxFuture<'a, Result<Vec<bool>, Error>>;
}

/// Opens the watch's connection (to the database of the source's tables).
pub(crate) type ConnectProbe = Arc<dyn Fn() -> BoxFuture<'static, Result<Box<dyn TableProbe>, Error>> + Send + Sync>;

/// The quiet tables of one source, watched by one task on one connection. Cheap to clone; the
/// task starts when the first table goes quiet and ends when the last clone is dropped.
#[derive(Clone)]
pub(crate) struct QuietWatch {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for QuietWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuietWatch").field("source", &self.shared.source).finish_non_exhaustive()
    }
}

struct Shared {
    connect: ConnectProbe,
    /// The source's name, for the probe metric and logs.
    source: String,
    state: Mutex<State>,
    /// A table went quiet (the task may be waiting for the first one).
    registered: Arc<Notify>,
    /// `false` from a failure until a connection works again: new quiet sources poll on their own.
    working: AtomicBool,
    next_token: AtomicU64,
    /// The shortest poll interval of the source's polling tables, in nanoseconds.
    interval_ns: AtomicU64,
}

#[derive(Default)]
struct State {
    tables: HashMap<Arc<str>, Entry>,
    started: bool,
}

struct Entry {
    /// Counts the probes that found rows in the table; its waiters wake on every change.
    found: watch::Sender<u64>,
    /// Registered waiters: token, low-water mark.
    waiters: Vec<(u64, i64)>,
}

impl QuietWatch {
    pub(crate) fn new(source: &str, connect: ConnectProbe) -> Self {
        Self {
            shared: Arc::new(Shared {
                connect,
                source: source.to_string(),
                state: Mutex::new(State::default()),
                registered: Arc::new(Notify::new()),
                working: AtomicBool::new(true),
                next_token: AtomicU64::new(0),
                interval_ns: AtomicU64::new(u64::MAX),
            }),
        }
    }

    /// The handle a polling source of `table`, polled every `interval`, waits with. The watch
    /// asks every shortest interval of its tables.
    pub(crate) fn table(&self, table: &str, interval: Duration) -> QuietTable {
        let ns = u64::try_from(interval.as_nanos()).unwrap_or(u64::MAX).max(1);
        self.shared.interval_ns.fetch_min(ns, Ordering::Relaxed);
        QuietTable { watch: self.clone(), table: Arc::from(table) }
    }

    fn register(&self, table: &Arc<str>, above: i64) -> Option<Quiet> {
        if !self.shared.working.load(Ordering::Acquire) {
            return None;
        }
        let token = self.shared.next_token.fetch_add(1, Ordering::Relaxed);
        let (found, start) = {
            let mut state = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
            let entry = state
                .tables
                .entry(table.clone())
                .or_insert_with(|| Entry { found: watch::Sender::new(0), waiters: Vec::new() });
            entry.waiters.push((token, above));
            let found = entry.found.subscribe();
            let start = !std::mem::replace(&mut state.started, true);
            (found, start)
        };
        if start {
            tokio::spawn(run(Arc::downgrade(&self.shared)));
        }
        self.shared.registered.notify_one();
        Some(Quiet { shared: self.shared.clone(), table: table.clone(), token, found })
    }
}

/// A polling source's table under its source's [`QuietWatch`].
#[derive(Debug, Clone)]
pub struct QuietTable {
    watch: QuietWatch,
    table: Arc<str>,
}

impl QuietTable {
    /// Registers the table as quiet above `above` (the source's low-water mark); `None` while
    /// the watch does not work (the source polls on its own).
    pub(crate) fn quiet(&self, above: i64) -> Option<Quiet> {
        self.watch.register(&self.table, above)
    }
}

/// A quiet source's registration: dropping it ends the wait (and the table's probing, once no
/// other waiter has it).
pub(crate) struct Quiet {
    shared: Arc<Shared>,
    table: Arc<str>,
    token: u64,
    found: watch::Receiver<u64>,
}

impl Quiet {
    /// Returns once a probe found rows in the table, or the watch stopped working. Cancel-safe.
    pub(crate) async fn rows(&mut self) {
        if self.found.changed().await.is_err() {
            // The entry outlives every registration; a closed channel only means shutdown.
            std::future::pending::<()>().await;
        }
    }
}

impl Drop for Quiet {
    fn drop(&mut self) {
        let mut state = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = state.tables.get_mut(&self.table) {
            entry.waiters.retain(|(token, ..)| *token != self.token);
            if entry.waiters.is_empty() {
                state.tables.remove(&self.table);
            }
        }
    }
}

impl Shared {
    /// The tables to probe, each at its lowest registered mark.
    fn waiting(&self) -> Vec<Watched> {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let mut tables: Vec<Watched> = state
            .tables
            .iter()
            .filter_map(|(table, entry)| {
                let above = entry.waiters.iter().map(|w| w.1).min()?;
                Some(Watched { table: table.clone(), above })
            })
            .collect();
        tables.sort_by(|a, b| a.table.cmp(&b.table));
        tables
    }

    /// How often the watch asks: the shortest interval of the source's polling tables.
    fn interval(&self) -> Duration {
        match self.interval_ns.load(Ordering::Relaxed) {
            u64::MAX => RETRY_MIN,
            ns => Duration::from_nanos(ns),
        }
    }

    /// Wakes the waiters of `tables` (every table when `None`).
    fn wake(&self, tables: Option<&[Arc<str>]>) {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        for (table, entry) in &state.tables {
            if tables.is_none_or(|t| t.contains(table)) {
                entry.found.send_modify(|n| *n = n.wrapping_add(1));
            }
        }
    }
}

/// The watch's task: probes the quiet tables every interval while there are any, and wakes
/// the sources of those holding rows. Ends when the [`QuietWatch`] is gone.
async fn run(shared: Weak<Shared>) {
    let mut probe: Option<Box<dyn TableProbe>> = None;
    let mut retry = RETRY_MIN;
    let mut last_failure = String::new();
    loop {
        let Some(strong) = shared.upgrade() else { return };
        let (tables, interval) = (strong.waiting(), strong.interval());
        let working = strong.working.load(Ordering::Acquire);
        if tables.is_empty() && working {
            let registered = strong.registered.clone();
            drop(strong);
            // A registration since `waiting` stored a permit (`notify_one`): this returns at once.
            if tokio::time::timeout(CLOSE_IDLE_AFTER, registered.notified()).await.is_err() {
                probe = None;
            }
            continue;
        }
        let (connect, source) = (strong.connect.clone(), strong.source.clone());
        drop(strong);
        let outcome = probe_once(&mut probe, &connect, &tables).await;
        let Some(strong) = shared.upgrade() else { return };
        match outcome {
            Ok(found) => {
                let holding: Vec<Arc<str>> =
                    tables.iter().zip(found).filter(|(_, rows)| *rows).map(|(w, _)| w.table.clone()).collect();
                if !holding.is_empty() {
                    strong.wake(Some(&holding));
                }
                if !working {
                    // A statement worked on a new connection: quiet tables may register again.
                    strong.working.store(true, Ordering::Release);
                }
                drop(strong);
                if !tables.is_empty() {
                    metrics::counter!(crate::metrics::POLL_WATCH_PROBES, "source" => source, "outcome" => "ok")
                        .increment(1);
                    if !last_failure.is_empty() {
                        tracing::info!(
                            "the quiet-table watch works again; idle polling tables are asked about together"
                        );
                    }
                    // Only a statement about tables proves a failure over (a dropped table is not).
                    retry = RETRY_MIN;
                    last_failure.clear();
                }
                tokio::time::sleep(interval).await;
            }
            Err(e) => {
                probe = None;
                strong.working.store(false, Ordering::Release);
                // Every waiter reads its table itself until the watch works again.
                strong.wake(None);
                drop(strong);
                metrics::counter!(crate::metrics::POLL_WATCH_PROBES, "source" => source, "outcome" => "failed")
                    .increment(1);
                let text = e.to_string();
                if text != last_failure {
                    tracing::warn!(error = %e, retry_in = ?retry, "the quiet-table watch failed; idle polling tables are read one by one until it works again");
                    last_failure = text;
                }
                tokio::time::sleep(retry).await;
                retry = (retry * 2).min(RETRY_MAX);
            }
        }
    }
}

/// One probe, connecting first if needed. A quick failure on a connection that had worked is
/// tried once more on a new one (a server's idle timeout closes a watch's connection); a slow
/// one (a statement timed out) is not: it would only wait as long again.
async fn probe_once(
    probe: &mut Option<Box<dyn TableProbe>>,
    connect: &ConnectProbe,
    tables: &[Watched],
) -> Result<Vec<bool>, Error> {
    if let Some(open) = probe.as_mut() {
        let started = tokio::time::Instant::now();
        match open.holding(tables).await {
            Ok(found) => return Ok(found),
            Err(e) if started.elapsed() >= FAST_FAILURE => {
                *probe = None;
                return Err(e);
            }
            Err(e) => tracing::debug!(error = %e, "the quiet-table watch's connection failed; connecting again"),
        }
        *probe = None;
    }
    let mut fresh = connect().await?;
    let found = fresh.holding(tables).await?;
    *probe = Some(fresh);
    Ok(found)
}
