//! Polling: the classic outbox loop — oldest rows by id, publish, delete — as a [`Source`].
//!
//! It is the baseline every CDC figure is compared with, and the catch-up path when a slot or
//! binlog position is lost: rows stay in the table until they are published, so reading the
//! table is always enough.
//!
//! # Reads
//!
//! ```text
//!  rescan     SELECT … WHERE id > low_water ORDER BY id LIMIT batch   nothing in flight
//!  pipelined  SELECT … WHERE id > last_read ORDER BY id LIMIT batch   catch-up drain, last batch full
//! ```
//!
//! There is no stored id cursor. Ids are taken before commit, so a transaction that commits
//! late can make a row with a *lower* id visible after higher ones were read; a stored cursor
//! would skip it for ever. Instead every read starts again from the low-water mark once what
//! was read has been deleted (lock-step, like the classic pollers). Reading on from the last id
//! while a batch is in flight would be faster, but a row skipped that way and found by the next
//! rescan arrives after later rows — even rows of the same writer, committed after it — so it
//! is done only in a catch-up drain, where the bound is fixed and order across the catch-up is
//! already documented as a window (see `docs/polling.md`), and for at most [`RESCAN_EVERY`].
//!
//! # The low-water mark
//!
//! Deleted rows stay in the index as dead entries while any transaction may still see them
//! (a long-running transaction holds them all), and an index scan from the lowest id walks
//! every one of them: the classic polling slowdown. The low-water mark lets rescans skip them.
//! After a rescan that read up to id `B`, the source notes the transactions then writing into
//! the table ([`PollTable::writers`]). Every id at or below `B` was handed out before that
//! moment, so once all of those transactions have ended, every row at or below `B` that will
//! ever be committed is visible; the next rescan reads them all, and after it the mark may move
//! to `B`. A transaction that stays open and wrote a row holds the mark below its row — exactly
//! what must not be skipped — but readers, however long, do not. Databases that do not show
//! their writers to the streamer's role keep the mark below every id (always correct, slower under
//! long transactions).
//!
//! # Order
//!
//! Id order is not commit order across concurrent transactions: two transactions that commit
//! in the other order than they took their ids are published in id order, or — if the first to
//! take an id commits after a batch was read — later. Within one transaction rows keep their
//! order. The benchmark counts these out-of-commit-order deliveries.

mod quiet;

pub(crate) use quiet::{ConnectProbe, QuietTable, QuietWatch, TableProbe, Watched, exists_each};

/// The PostgreSQL polling query, public for the test that checks its plan with stale
/// statistics; the polling table itself is in `db/postgres/poll.rs`.
pub mod postgres {
    pub use crate::db::postgres::poll::{PLANNER_SETTINGS, oldest_sql};
}

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use tokio::sync::mpsc;

use crate::error::Error;
use crate::record::{InvalidRow, OutboxRecord};
use crate::source::{self, Source, SourceEvent};

/// The longest a run of pipelined reads may go on before a rescan from the low-water mark.
pub const RESCAN_EVERY: Duration = Duration::from_secs(1);

/// How often a polling session maintains the stream's log position ([`PollTable::maintain`]).
pub const MAINTAIN_EVERY: Duration = Duration::from_secs(5);

/// How often a rescan starts from the lowest id instead of the low-water mark: a row can get
/// an id below the mark without ever showing up as a writer (an explicit id, an identity
/// restarted lower, ids cached per session by a sequence, a prepared transaction), and this
/// bounds how long it can wait. With the primary key it reads only what is still there.
pub const FULL_RESCAN_EVERY: Duration = Duration::from_secs(10);

/// The mark below every id: ids are whatever the table's key holds, zero and negative ids
/// included (an explicit `OVERRIDING SYSTEM VALUE`, a sequence with a negative start), and a
/// read from here reads them all.
const BEFORE_EVERY_ID: i64 = i64::MIN;

/// A row read by polling: a record, or why it cannot be one.
pub type PolledRow = Result<OutboxRecord, InvalidRow>;

/// What a database must offer to be polled. Each instance owns one connection.
pub trait PollTable: Send + 'static {
    /// Up to `limit` rows with `after < id <= upto`, lowest id first.
    fn oldest(
        &mut self,
        after: i64,
        upto: i64,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<PolledRow>, Error>> + Send;

    /// Deletes `ids`; returns how many rows were deleted.
    fn delete(&mut self, ids: &[i64]) -> impl Future<Output = Result<u64, Error>> + Send;

    /// Which of `ids` are still in the table, ascending.
    fn existing(&mut self, ids: &[i64]) -> impl Future<Output = Result<Vec<i64>, Error>> + Send;

    /// The rows `ids` as they are now (ids not in the table are left out), ascending.
    fn rows(&mut self, ids: &[i64]) -> impl Future<Output = Result<Vec<PolledRow>, Error>> + Send;

    /// Opaque ids of the transactions that may still commit rows into the table.
    fn writers(&mut self) -> impl Future<Output = Result<Writers, Error>> + Send;

    /// Whether any of `writers` is still running.
    fn any_running(&mut self, writers: &[String]) -> impl Future<Output = Result<bool, Error>> + Send;

    /// The database history this table's server writes ([`Source::history`]).
    fn history(&mut self) -> impl Future<Output = Result<String, Error>> + Send;

    /// Housekeeping of the stream's log position while polling, called every
    /// [`MAINTAIN_EVERY`] by the session that owns the stream (PostgreSQL: its unused slot is
    /// moved to the current WAL position, so it does not hold WAL).
    fn maintain(&mut self) -> impl Future<Output = ()> + Send {
        async {}
    }
}

/// The transactions writing the table, as far as the database shows them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Writers {
    /// Every transaction that may still commit rows into the table, by opaque id.
    Known(Vec<String>),
    /// This role cannot see them (MySQL/MariaDB without `PROCESS`): rescans start below every id.
    Hidden,
    /// The database could not give a fresh answer this time; ask again at the next rescan.
    Unknown,
}

/// How a polling source runs.
#[derive(Debug, Clone)]
pub struct PollSettings {
    /// Rows per read (`poll_batch`).
    pub batch: u32,
    /// The longest wait after a read that was not full (`poll_interval_ms`).
    pub interval: Duration,
    /// How often a rescan starts from the lowest id ([`FULL_RESCAN_EVERY`]).
    pub full_rescan_every: Duration,
    /// The bytes one read may bring (`max_in_flight_bytes`): rows are read by count, so the
    /// count is lowered to what this allows at the size of the rows last read.
    pub max_batch_bytes: usize,
    /// Catch-up: read only rows with `id <= upto`, and end the session (with
    /// [`SourceEvent::Drained`]) at the first rescan that finds none.
    pub drain_upto: Option<i64>,
    /// Catch-up whose reader holds one snapshot for all its reads (MariaDB's consistent
    /// snapshot, the one the new position was taken from): it holds exactly the rows committed
    /// before that position, and rows deleted since stay visible in it. So reads go forward
    /// from the last id read, never back to the low-water mark, without waiting for deletes,
    /// and the first that finds nothing ends the drain.
    pub in_snapshot: bool,
    /// Rows deleted after publishing, for the caller's report.
    pub rows_sent: Arc<AtomicU64>,
    /// `source`, `shard`, `partition` for the query-time histogram.
    pub metric_labels: [(&'static str, String); 3],
    /// The source's watch of quiet tables (see [`quiet`]): after a rescan that found nothing,
    /// this source waits for it instead of reading its table every `interval`. `None` (a
    /// catch-up's drain) reads every `interval`.
    pub quiet: Option<QuietTable>,
}

/// A polling position: how many rows this session had read when a batch ended. Nothing is
/// stored; the table itself is the position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PollPosition {
    pub batch: u64,
    pub rows_through: u64,
}

/// The position before the first batch (batches count from 1).
const BEFORE_READING: PollPosition = PollPosition { batch: 0, rows_through: 0 };

impl fmt::Display for PollPosition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "poll batch {}", self.batch)
    }
}

#[derive(Debug)]
struct Request {
    after: i64,
    upto: i64,
    limit: u32,
    rescan: bool,
    /// Writers of an earlier probe, to check whether they have all ended (before reading).
    settle: Option<Vec<String>>,
    /// Read the current writers after reading (a new probe).
    probe: bool,
    /// A rescan from the lowest id although the low-water mark is above it.
    below_mark: Option<i64>,
}

#[derive(Debug)]
struct Response {
    rows: Vec<PolledRow>,
    rescan: bool,
    below_mark: Option<i64>,
    settled: bool,
    /// `Some` when the request asked for a probe.
    writers: Option<Writers>,
}

/// Ids at or below `bound` are settled once `writers` have all ended.
#[derive(Debug)]
struct Probe {
    bound: i64,
    writers: Vec<String>,
}

/// One shard-partition read by polling. Reads run on their own connection in a worker task,
/// so [`Source::next`] stays cancellation-safe; deletes run on a second connection.
#[derive(Debug)]
pub struct PollSource<T: PollTable> {
    /// Deletes beside reading (see [`Source::finish`]); the sweep's reads wait for it.
    cleaner: Arc<tokio::sync::Mutex<T>>,
    requests: mpsc::Sender<Request>,
    responses: mpsc::Receiver<Result<Response, Error>>,
    worker: tokio::task::JoinHandle<()>,
    settings: PollSettings,
    request_out: bool,
    queued: VecDeque<SourceEvent<PollPosition>>,
    low_water: i64,
    last_read: i64,
    emitted: u64,
    finished: u64,
    batches: u64,
    last_full: bool,
    /// The average size of the rows last read (see [`PollSettings::max_batch_bytes`]).
    row_bytes: usize,
    last_rescan: Instant,
    /// The last rescan from the lowest id (see [`FULL_RESCAN_EVERY`]).
    last_full_rescan: Instant,
    next_poll_at: Instant,
    probe: Option<Probe>,
    sees_writers: bool,
    /// The last rescan found nothing: the next waits for the quiet-table watch.
    quiet: bool,
    /// [`PollSettings::in_snapshot`]: rows finished before this session read anything (an
    /// earlier session's acknowledged prefix, rows a committed Kafka transaction holds). They
    /// are deleted, but the snapshot still shows them: reads leave them out.
    finished_unread: std::collections::HashSet<i64>,
}

impl<T: PollTable> PollSource<T> {
    /// `reader` and `cleaner` are two connections to the same table.
    pub fn new(reader: T, cleaner: T, settings: PollSettings) -> Self {
        let (requests, mut rx) = mpsc::channel::<Request>(1);
        let (tx, responses) = mpsc::channel(1);
        let settings_labels = settings.metric_labels.clone();
        let worker = tokio::spawn(async move {
            let mut reader = reader;
            let labels = settings_labels;
            let mut maintained: Option<Instant> = None;
            while let Some(req) = rx.recv().await {
                if maintained.is_none_or(|at| at.elapsed() >= MAINTAIN_EVERY) {
                    reader.maintain().await;
                    maintained = Some(Instant::now());
                }
                let result = serve(&mut reader, req, &labels).await;
                let failed = result.is_err();
                if tx.send(result).await.is_err() || failed {
                    break;
                }
            }
        });
        let now = Instant::now();
        Self {
            cleaner: Arc::new(tokio::sync::Mutex::new(cleaner)),
            requests,
            responses,
            worker,
            settings,
            request_out: false,
            queued: VecDeque::new(),
            low_water: BEFORE_EVERY_ID,
            last_read: BEFORE_EVERY_ID,
            emitted: 0,
            finished: 0,
            batches: 0,
            last_full: false,
            row_bytes: 0,
            last_rescan: now,
            last_full_rescan: now,
            next_poll_at: now,
            probe: None,
            sees_writers: true,
            quiet: false,
            finished_unread: std::collections::HashSet::new(),
        }
    }

    fn outstanding(&self) -> u64 {
        self.emitted - self.finished
    }

    /// Rows per read: `poll_batch`, fewer when the rows last read were large.
    fn limit(&self) -> u32 {
        rows_that_fit(self.settings.batch, self.settings.max_batch_bytes, self.row_bytes)
    }

    /// Sends the next read if one is due; `false` means wait for deletes first.
    async fn send_read(&mut self) -> Result<bool, Error> {
        let upto = self.settings.drain_upto.unwrap_or(i64::MAX);
        let limit = self.limit();
        let req = if self.settings.in_snapshot {
            let after = self.last_read;
            Request { after, upto, limit, rescan: true, settle: None, probe: false, below_mark: None }
        } else if self.outstanding() > 0 {
            let drain = self.settings.drain_upto.is_some();
            if !(drain && self.last_full && self.last_rescan.elapsed() < RESCAN_EVERY) {
                return Ok(false);
            }
            Request { after: self.last_read, upto, limit, rescan: false, settle: None, probe: false, below_mark: None }
        } else {
            self.wait_for_rescan().await;
            self.last_rescan = Instant::now();
            let below_mark = (self.low_water > BEFORE_EVERY_ID
                && self.last_full_rescan.elapsed() >= self.settings.full_rescan_every)
                .then_some(self.low_water);
            if below_mark.is_some() {
                self.last_full_rescan = Instant::now();
            }
            Request {
                after: if below_mark.is_some() { BEFORE_EVERY_ID } else { self.low_water },
                below_mark,
                upto,
                limit,
                rescan: true,
                settle: self.probe.as_ref().map(|p| p.writers.clone()),
                probe: self.probe.is_none() && self.sees_writers,
            }
        };
        self.requests.send(req).await.map_err(|_| Error::transient("the polling reader stopped"))?;
        self.request_out = true;
        Ok(true)
    }

    /// Waits until the next rescan is due: `interval` after a read that found rows; after one
    /// that found none, until the quiet-table watch sees rows (or [`quiet::QUIET_READ_EVERY`],
    /// or `interval` if longer, has passed since this source last read; or the watch does not
    /// work). Cancel-safe.
    async fn wait_for_rescan(&self) {
        let registered = match &self.settings.quiet {
            Some(table) if self.quiet => table.quiet(self.low_water),
            _ => None,
        };
        match registered {
            Some(mut quiet) => {
                let read_by = self.last_rescan + quiet::QUIET_READ_EVERY.max(self.settings.interval);
                tokio::select! {
                    () = quiet.rows() => {}
                    () = tokio::time::sleep_until(read_by) => {}
                }
            }
            None => tokio::time::sleep_until(self.next_poll_at).await,
        }
    }

    fn on_response(&mut self, mut resp: Response) -> Option<SourceEvent<PollPosition>> {
        let now = Instant::now();
        let full = resp.rows.len() as u64 >= u64::from(self.limit());
        let read_none = resp.rows.is_empty();
        let read_one = resp.rows.len() == 1;
        let read_upto = resp.rows.last().map(row_id);
        if !self.finished_unread.is_empty() {
            resp.rows.retain(|r| !self.finished_unread.contains(&row_id(r)));
        }
        if !resp.rows.is_empty() {
            let bytes: usize = resp.rows.iter().map(|r| r.as_ref().map_or(64, OutboxRecord::weight)).sum();
            self.row_bytes = bytes / resp.rows.len();
        }
        self.last_full = full;
        self.next_poll_at = if full { now } else { now + self.settings.interval };
        let last_id = resp.rows.last().map(row_id);
        if let Some(mark) = resp.below_mark {
            let below = resp.rows.iter().filter(|r| row_id(r) <= mark).count();
            if below > 0 {
                // Start again from the lowest id until a probe settles a new mark.
                self.low_water = BEFORE_EVERY_ID;
                self.probe = None;
                metrics::counter!(crate::metrics::POLL_ROWS_BELOW_MARK, &self.settings.metric_labels)
                    .increment(below as u64);
                tracing::warn!(
                    rows = below,
                    mark,
                    "rows appeared below the polling low-water mark (an explicit id, an identity restarted lower, ids cached per session, a prepared transaction); publishing them now"
                );
            }
        }
        if resp.rescan {
            // A drain ends at its first empty rescan instead; a snapshot never shows new rows.
            // A quiet table woken for one row goes back to the watch once that row is deleted,
            // without a read that would find nothing (the watch asks as often); one woken for
            // more is read again after its interval, so a table getting busy does not ride the
            // watch.
            let stays_quiet = self.quiet && read_one && !full;
            self.quiet = (read_none || stays_quiet) && self.settings.drain_upto.is_none() && !self.settings.in_snapshot;
            self.move_low_water(resp.settled, full, last_id);
            match resp.writers {
                Some(Writers::Known(writers)) if self.probe.is_none() => {
                    if let Some(bound) = last_id {
                        self.probe = Some(Probe { bound, writers });
                    }
                }
                Some(Writers::Hidden) => {
                    self.sees_writers = false;
                    tracing::info!(
                        "this database role cannot see which transactions write the outbox table; polling rescans from the lowest id (see docs/polling.md)"
                    );
                }
                _ => {}
            }
            if read_none && self.settings.drain_upto.is_some() {
                return Some(SourceEvent::Drained);
            }
        }
        if resp.rows.is_empty() {
            // Only rows finished before reading: read on past them.
            self.last_read = read_upto.unwrap_or(self.last_read).max(self.last_read);
            return None;
        }
        self.batches += 1;
        let n = resp.rows.len() as u64;
        self.last_read = read_upto.unwrap_or(self.last_read);
        self.queued.push_back(SourceEvent::Begin { label: format!("batch-{}", self.batches) });
        self.queued.extend(resp.rows.into_iter().map(SourceEvent::Row));
        self.emitted += n;
        self.queued.push_back(SourceEvent::Commit(PollPosition { batch: self.batches, rows_through: self.emitted }));
        self.queued.pop_front()
    }

    /// After a rescan: if the probe's writers have all ended, every row at or below its bound
    /// was visible to this rescan; the rows it returned are all of them (up to its last id, if
    /// it was full), and the next rescan may start above.
    fn move_low_water(&mut self, settled: bool, full: bool, last_id: Option<i64>) {
        if !settled {
            return;
        }
        let Some(probe) = &self.probe else { return };
        match last_id {
            Some(last) if full && last < probe.bound => self.low_water = self.low_water.max(last),
            _ => {
                self.low_water = self.low_water.max(probe.bound);
                self.probe = None;
            }
        }
    }
}

/// At most `batch` rows, and no more than `max_bytes` at `row_bytes` each (at least one row).
/// Before any row was read (`row_bytes` 0) the size is unknown: the first read takes
/// [`FIRST_READ_ROWS`], and the next ones know.
fn rows_that_fit(batch: u32, max_bytes: usize, row_bytes: usize) -> u32 {
    match max_bytes.checked_div(row_bytes) {
        None => batch.min(FIRST_READ_ROWS),
        Some(fits) => batch.min(u32::try_from(fits.max(1)).unwrap_or(u32::MAX)),
    }
}

/// Rows read before their size is known.
const FIRST_READ_ROWS: u32 = 16;

fn row_id(row: &PolledRow) -> i64 {
    match row {
        Ok(r) => r.id,
        Err(e) => e.id.unwrap_or(0),
    }
}

async fn serve<T: PollTable>(
    table: &mut T,
    req: Request,
    labels: &[(&'static str, String); 3],
) -> Result<Response, Error> {
    let settled = match &req.settle {
        Some(writers) => !table.any_running(writers).await?,
        None => false,
    };
    let started = Instant::now();
    let rows = table.oldest(req.after, req.upto, req.limit).await?;
    metrics::histogram!(crate::metrics::POLL_QUERY_SECONDS, labels).record(started.elapsed().as_secs_f64());
    // A read that found nothing sets no mark: the writers are asked at the next that finds rows.
    let writers = if req.probe && !rows.is_empty() { Some(table.writers().await?) } else { None };
    Ok(Response { rows, rescan: req.rescan, below_mark: req.below_mark, settled, writers })
}

impl<T: PollTable> Source for PollSource<T> {
    type Position = PollPosition;
    const POSITION_HEADER: &'static str = "outbox-poll-batch";
    /// Polling reads the table itself: nothing can be in it that polling does not see.
    const SWEEPS: bool = false;

    async fn next(&mut self) -> Result<Option<SourceEvent<PollPosition>>, Error> {
        loop {
            if let Some(event) = self.queued.pop_front() {
                return Ok(Some(event));
            }
            if !self.request_out && !self.send_read().await? {
                // Wait for the session to delete what is in flight; it calls `next` again.
                std::future::pending::<()>().await;
            }
            let resp = self.responses.recv().await.ok_or_else(|| Error::transient("the polling reader stopped"))?;
            self.request_out = false;
            if let Some(event) = self.on_response(resp?) {
                return Ok(Some(event));
            }
        }
    }

    fn finish(
        &mut self,
        ids: Arc<[i64]>,
        upto: PollPosition,
    ) -> impl Future<Output = Result<u64, Error>> + Send + 'static + use<T> {
        if self.settings.in_snapshot && self.emitted == 0 {
            self.finished_unread.extend(ids.iter().copied());
        }
        let (cleaner, rows_sent) = (self.cleaner.clone(), self.settings.rows_sent.clone());
        async move {
            let deleted = if ids.is_empty() { 0 } else { cleaner.lock().await.delete(&ids).await? };
            // Rows an earlier session's Kafka transactions hold are deleted, not sent.
            if upto != BEFORE_READING {
                rows_sent.fetch_add(ids.len() as u64, Ordering::Relaxed);
            }
            Ok(deleted)
        }
    }

    fn finished(&mut self, upto: PollPosition) {
        // A prefix an earlier session left carries that session's count: never past ours.
        self.finished = self.finished.max(upto.rows_through.min(self.emitted));
    }

    fn confirm_idle(&mut self, _position: PollPosition) {}

    async fn close(self) {
        self.worker.abort();
    }

    async fn history(&mut self) -> Result<String, Error> {
        self.cleaner.lock().await.history().await
    }

    async fn current_rows(&mut self, ids: &[i64]) -> Result<Vec<PolledRow>, Error> {
        self.cleaner.lock().await.rows(ids).await
    }

    async fn existing(&mut self, ids: &[i64]) -> Result<Vec<i64>, Error> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        self.cleaner.lock().await.existing(ids).await
    }

    async fn probe(&mut self, _below: Option<i64>, _limit: usize) -> Result<source::Probe<PollPosition>, Error> {
        Ok(source::Probe { candidates: Vec::new(), max_id: None, mark: PollPosition { batch: 0, rows_through: 0 } })
    }

    fn reached(_done: &PollPosition, _mark: &PollPosition) -> bool {
        false
    }

    fn before_reading(&self) -> Option<PollPosition> {
        Some(BEFORE_READING)
    }

    fn skips(&self, _id: Option<i64>, _message: bool, _label: &str) -> bool {
        // A row to skip in polling mode is simply deleted by `outbox-streamer skip`.
        false
    }
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
