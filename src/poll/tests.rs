//! The polling source against an in-memory table whose transactions commit when told to.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use super::*;

#[derive(Debug, Default)]
struct Db {
    /// id → (committed, writing transaction)
    rows: BTreeMap<i64, (bool, &'static str)>,
    running: BTreeSet<&'static str>,
    /// `after` of every read, in order.
    reads: Vec<i64>,
    /// Reads see one snapshot: deleted rows stay visible.
    snapshot: bool,
}

#[derive(Debug, Clone, Default)]
struct Fake(Arc<Mutex<Db>>);

impl Fake {
    fn insert(&self, txn: &'static str, id: i64) {
        let mut db = self.0.lock().unwrap();
        db.running.insert(txn);
        db.rows.insert(id, (false, txn));
    }

    fn commit(&self, txn: &'static str) {
        let mut db = self.0.lock().unwrap();
        db.running.remove(txn);
        for (committed, t) in db.rows.values_mut() {
            if *t == txn {
                *committed = true;
            }
        }
    }

    fn reads(&self) -> Vec<i64> {
        self.0.lock().unwrap().reads.clone()
    }
}

fn record(id: i64) -> OutboxRecord {
    OutboxRecord {
        id,
        topic: "t".into(),
        key: None,
        payload: None,
        headers: Vec::new(),
        kafka_partition: None,
        created_at_micros: None,
        timestamp_ms: None,
        in_table: true,
    }
}

impl PollTable for Fake {
    async fn oldest(&mut self, after: i64, upto: i64, limit: u32) -> Result<Vec<PolledRow>, Error> {
        let mut db = self.0.lock().unwrap();
        db.reads.push(after);
        if after >= upto {
            return Ok(Vec::new());
        }
        Ok(db
            .rows
            .range(after + 1..=upto)
            .filter(|(_, (committed, _))| *committed)
            .take(limit as usize)
            .map(|(id, _)| Ok(record(*id)))
            .collect())
    }

    async fn delete(&mut self, ids: &[i64]) -> Result<u64, Error> {
        let mut db = self.0.lock().unwrap();
        if db.snapshot {
            return Ok(ids.iter().filter(|id| db.rows.contains_key(id)).count() as u64);
        }
        Ok(ids.iter().filter(|id| db.rows.remove(id).is_some()).count() as u64)
    }

    async fn existing(&mut self, ids: &[i64]) -> Result<Vec<i64>, Error> {
        let db = self.0.lock().unwrap();
        Ok(ids.iter().copied().filter(|id| db.rows.contains_key(id)).collect())
    }

    async fn rows(&mut self, ids: &[i64]) -> Result<Vec<PolledRow>, Error> {
        Ok(self.existing(ids).await?.into_iter().map(|id| Ok(record(id))).collect())
    }

    async fn writers(&mut self) -> Result<Writers, Error> {
        Ok(Writers::Known(self.0.lock().unwrap().running.iter().map(|t| t.to_string()).collect()))
    }

    async fn any_running(&mut self, writers: &[String]) -> Result<bool, Error> {
        let db = self.0.lock().unwrap();
        Ok(writers.iter().any(|w| db.running.contains(w.as_str())))
    }

    async fn history(&mut self) -> Result<String, Error> {
        Ok("fake".into())
    }
}

fn source(db: &Fake, batch: u32, drain_upto: Option<i64>) -> PollSource<Fake> {
    source_rescanning_every(db, batch, drain_upto, Duration::from_secs(3600))
}

fn source_rescanning_every(db: &Fake, batch: u32, drain_upto: Option<i64>, every: Duration) -> PollSource<Fake> {
    let settings = PollSettings {
        batch,
        interval: Duration::from_millis(1),
        full_rescan_every: every,
        max_batch_bytes: usize::MAX,
        drain_upto,
        in_snapshot: false,
        rows_sent: Arc::default(),
        metric_labels: [("source", "s".into()), ("shard", "0".into()), ("partition", "0".into())],
        quiet: None,
    };
    PollSource::new(db.clone(), db.clone(), settings)
}

/// A catch-up's drain whose reads all see one snapshot.
fn snapshot_source(db: &Fake, batch: u32, upto: i64) -> PollSource<Fake> {
    db.0.lock().unwrap().snapshot = true;
    let mut src = source(db, batch, Some(upto));
    src.settings.in_snapshot = true;
    src
}

#[tokio::test]
async fn a_drain_in_a_snapshot_reads_forward_past_deleted_rows_and_skips_rows_finished_before_reading() {
    let db = Fake::default();
    for id in 1..=5 {
        db.insert("t", id);
    }
    db.commit("t");
    let mut src = snapshot_source(&db, 2, 5);
    // An earlier session's acknowledged prefix, finished before anything is read.
    finish(&mut src, &[2], PollPosition { batch: 7, rows_through: 1 }).await;
    assert_eq!(next_batch(&mut src).await, vec![1], "row 2 read, and left out");
    assert_eq!(next_batch(&mut src).await, vec![3, 4]);
    assert_eq!(next_batch(&mut src).await, vec![5]);
    let end = tokio::time::timeout(Duration::from_secs(5), batch(&mut src)).await.expect("an answer");
    assert_eq!(end, None, "drained at the first read that finds nothing");
    assert_eq!(db.reads(), [BEFORE_EVERY_ID, 2, 4, 5], "forward only: deleted rows are still in the snapshot");
}

/// Reads one batch and deletes it, as the session does once Kafka acknowledged it. Returns the
/// ids, or `None` when the source reported the drain complete.
/// Finishes a prefix as the streamer loop does: the delete, then `finished`.
async fn finish(src: &mut PollSource<Fake>, ids: &[i64], position: PollPosition) {
    src.finish(ids.into(), position).await.unwrap();
    src.finished(position);
}

async fn batch(src: &mut PollSource<Fake>) -> Option<Vec<i64>> {
    let mut ids = Vec::new();
    loop {
        match src.next().await.unwrap().unwrap() {
            SourceEvent::Begin { .. } | SourceEvent::Idle(_) => {}
            SourceEvent::Row(row) => ids.push(row.unwrap().id),
            SourceEvent::Commit(position) => {
                finish(src, &ids, position).await;
                return Some(ids);
            }
            SourceEvent::Drained => return None,
        }
    }
}

/// Reads one batch without deleting it.
async fn read_batch(src: &mut PollSource<Fake>) -> (Vec<i64>, PollPosition) {
    let mut ids = Vec::new();
    loop {
        match src.next().await.unwrap().unwrap() {
            SourceEvent::Row(row) => ids.push(row.unwrap().id),
            SourceEvent::Commit(position) => return (ids, position),
            _ => {}
        }
    }
}

/// Waits for the next non-empty batch (empty polls are retried by the source itself).
async fn next_batch(src: &mut PollSource<Fake>) -> Vec<i64> {
    tokio::time::timeout(Duration::from_secs(5), batch(src)).await.expect("a batch within 5 s").expect("not drained")
}

#[tokio::test]
async fn a_row_whose_transaction_commits_late_is_still_read() {
    let db = Fake::default();
    db.insert("slow", 1);
    db.insert("fast", 2);
    db.insert("fast", 3);
    db.commit("fast");
    let mut src = source(&db, 100, None);
    assert_eq!(next_batch(&mut src).await, vec![2, 3]);
    db.insert("later", 4);
    db.commit("later");
    assert_eq!(next_batch(&mut src).await, vec![4]);
    db.commit("slow");
    assert_eq!(next_batch(&mut src).await, vec![1], "id 1 committed last and is read after 2, 3 and 4");
    assert!(
        db.reads().iter().all(|&after| after == BEFORE_EVERY_ID),
        "no rescan skipped past the open transaction's id"
    );
}

#[tokio::test]
async fn the_low_water_mark_moves_once_writers_have_ended() {
    let db = Fake::default();
    for id in 1..=5 {
        db.insert("a", id);
    }
    db.commit("a");
    let mut src = source(&db, 100, None);
    assert_eq!(next_batch(&mut src).await, vec![1, 2, 3, 4, 5]);
    db.insert("b", 6);
    db.commit("b");
    assert_eq!(next_batch(&mut src).await, vec![6], "this rescan finds the first probe (up to id 5) settled");
    db.insert("c", 7);
    db.commit("c");
    assert_eq!(next_batch(&mut src).await, vec![7]);
    let reads = db.reads();
    assert_eq!(reads[..2], [BEFORE_EVERY_ID, BEFORE_EVERY_ID]);
    assert_eq!(*reads.last().unwrap(), 5, "later rescans start above id 5: {reads:?}");
    for id in 8..=12 {
        db.insert("d", id);
        db.commit("d");
        assert_eq!(next_batch(&mut src).await, vec![id]);
    }
    let last = *db.reads().last().unwrap();
    assert!(last >= 9, "the mark keeps moving, probe after probe: {:?}", db.reads());
}

/// A row can get an id below the mark without ever being a writer the probe saw (an explicit
/// id, an identity restarted lower, ids cached per session): the periodic rescan from the
/// lowest id finds it (zero and negative ids too), and the mark starts over.
#[tokio::test]
async fn a_row_below_the_low_water_mark_is_found_by_a_full_rescan() {
    let db = Fake::default();
    for id in 10..=15 {
        db.insert("a", id);
    }
    db.commit("a");
    let mut src = source_rescanning_every(&db, 100, None, Duration::from_millis(200));
    assert_eq!(next_batch(&mut src).await, (10..=15).collect::<Vec<_>>());
    for id in [16, 17] {
        db.insert("b", id);
        db.commit("b");
        assert_eq!(next_batch(&mut src).await, vec![id]);
    }
    assert_eq!(*db.reads().last().unwrap(), 15, "the mark moved above 15");
    // Ids 3, 0 and -5 appear without ever having been seen as writers; ids at or below zero
    // are ids like any other.
    for id in [3, 0, -5] {
        db.insert("explicit", id);
    }
    db.commit("explicit");
    assert_eq!(next_batch(&mut src).await, vec![-5, 0, 3], "found by the rescan from the lowest id");
    db.insert("c", 18);
    db.commit("c");
    assert_eq!(next_batch(&mut src).await, vec![18]);
}

/// Rows are read by count; large rows lower the count so a read stays within the in-flight
/// budget (60 rows of 800 kB with a 2 MB budget read 2 at a time, not 60).
#[test]
fn large_rows_lower_the_rows_per_read() {
    assert_eq!(rows_that_fit(1024, 2_000_000, 0), FIRST_READ_ROWS, "nothing read yet: a small first read");
    assert_eq!(rows_that_fit(4, 2_000_000, 0), 4);
    assert_eq!(rows_that_fit(1024, 2_000_000, 800_000), 2);
    assert_eq!(rows_that_fit(1024, 2_000_000, 5_000_000), 1, "always at least one row");
    assert_eq!(rows_that_fit(1024, 64 * 1024 * 1024, 100), 1024);
}

#[tokio::test]
async fn a_drain_reads_full_batches_on_from_the_last_id() {
    let db = Fake::default();
    for id in 1..=10 {
        db.insert("a", id);
    }
    db.commit("a");
    let mut src = source(&db, 4, Some(100));
    // Nothing is deleted until three batches were read, as when acks are slower.
    let mut held = Vec::new();
    for want in [vec![1, 2, 3, 4], vec![5, 6, 7, 8], vec![9, 10]] {
        let (ids, position) = read_batch(&mut src).await;
        assert_eq!(ids, want);
        held.push((ids, position));
    }
    for (ids, position) in held {
        finish(&mut src, &ids, position).await;
    }
    assert!(db.0.lock().unwrap().rows.is_empty());
    assert_eq!(db.reads()[..3], [BEFORE_EVERY_ID, 4, 8], "reads went on from the last id");
}

/// Outside a drain a full batch is not followed by a read from its last id: a row of a
/// transaction that commits meanwhile with a lower id would be skipped and arrive late.
#[tokio::test]
async fn polling_reads_in_lock_step() {
    let db = Fake::default();
    db.insert("slow", 1);
    for id in 2..=9 {
        db.insert("a", id);
    }
    db.commit("a");
    let mut src = source(&db, 4, None);
    let (ids, position) = read_batch(&mut src).await;
    assert_eq!(ids, vec![2, 3, 4, 5]);
    db.commit("slow");
    let waited = tokio::time::timeout(Duration::from_millis(200), src.next()).await;
    assert!(waited.is_err(), "no read while the first batch is not deleted");
    finish(&mut src, &ids, position).await;
    assert_eq!(next_batch(&mut src).await, vec![1, 6, 7, 8], "the late row first, in id order");
}

#[tokio::test]
async fn a_drain_stops_at_its_bound_and_reports_drained() {
    let db = Fake::default();
    for id in 1..=5 {
        db.insert("a", id);
    }
    db.commit("a");
    let mut src = source(&db, 2, Some(3));
    assert_eq!(next_batch(&mut src).await, vec![1, 2]);
    assert_eq!(next_batch(&mut src).await, vec![3]);
    let end = tokio::time::timeout(Duration::from_secs(5), batch(&mut src)).await.unwrap();
    assert_eq!(end, None, "drained");
    assert_eq!(src.settings.rows_sent.load(Ordering::Relaxed), 3);
    assert_eq!(db.0.lock().unwrap().rows.len(), 2, "rows above the bound stay for the stream");
}

/// The quiet-table watch of the tests: answers from the fake table, counts its statements, and
/// fails while told to.
#[derive(Clone, Default)]
struct Watch {
    probes: Arc<AtomicU64>,
    failing: Arc<std::sync::atomic::AtomicBool>,
}

struct FakeProbe {
    db: Fake,
    watch: Watch,
}

impl TableProbe for FakeProbe {
    fn holding<'a>(&'a mut self, tables: &'a [Watched]) -> futures::future::BoxFuture<'a, Result<Vec<bool>, Error>> {
        Box::pin(async move {
            if self.watch.failing.load(Ordering::SeqCst) {
                return Err(Error::transient("the watch's server is down"));
            }
            self.watch.probes.fetch_add(1, Ordering::SeqCst);
            let db = self.db.0.lock().unwrap();
            Ok(tables.iter().map(|w| db.rows.range(w.above.saturating_add(1)..).any(|(_, (c, _))| *c)).collect())
        })
    }
}

impl Watch {
    fn source(&self, db: &Fake) -> PollSource<Fake> {
        let (db2, watch) = (db.clone(), self.clone());
        let connect: ConnectProbe = Arc::new(move || {
            let (db, watch) = (db2.clone(), watch.clone());
            Box::pin(async move {
                if watch.failing.load(Ordering::SeqCst) {
                    return Err(Error::transient("the watch's server is down"));
                }
                Ok(Box::new(FakeProbe { db, watch }) as Box<dyn TableProbe>)
            })
        });
        let mut src = source(db, 100, None);
        src.settings.quiet = Some(QuietWatch::new("s", connect).table("outbox_0_0", src.settings.interval));
        src
    }

    fn probes(&self) -> u64 {
        self.probes.load(Ordering::SeqCst)
    }
}

/// Runs the source for `d` of (paused, auto-advancing) time, expecting nothing to read.
async fn quiet_for(src: &mut PollSource<Fake>, d: Duration) {
    assert!(tokio::time::timeout(d, src.next()).await.is_err(), "nothing to read");
}

/// An idle table is not read every interval: the watch asks about it, and a commit wakes the
/// source at the next probe.
#[tokio::test(start_paused = true)]
async fn a_quiet_table_is_watched_not_read_and_a_commit_wakes_its_source() {
    let db = Fake::default();
    let watch = Watch::default();
    let mut src = watch.source(&db);
    quiet_for(&mut src, Duration::from_secs(1)).await;
    assert_eq!(db.reads().len(), 1, "one rescan found nothing, then the watch took over");
    assert!(watch.probes() >= 100, "the watch probed every 1 ms interval: {}", watch.probes());
    db.insert("a", 1);
    db.commit("a");
    assert_eq!(next_batch(&mut src).await, vec![1]);
    assert_eq!(db.reads().len(), 2, "one read, for the row the watch saw");
}

/// A quiet table woken for one row goes back to the watch once the row is deleted, with no read
/// in between; one woken for several rows is read again after its interval.
#[tokio::test(start_paused = true)]
async fn a_table_woken_for_one_row_goes_back_to_the_watch_without_another_read() {
    let db = Fake::default();
    let watch = Watch::default();
    let mut src = watch.source(&db);
    quiet_for(&mut src, Duration::from_millis(100)).await;
    db.insert("a", 1);
    db.commit("a");
    assert_eq!(next_batch(&mut src).await, vec![1]);
    let reads = db.reads().len();
    quiet_for(&mut src, Duration::from_secs(1)).await;
    assert_eq!(db.reads().len(), reads, "no read after the single row: {:?}", db.reads());
    db.insert("b", 2);
    db.commit("b");
    assert_eq!(next_batch(&mut src).await, vec![2], "the watch still wakes it");
    let reads = db.reads().len();
    db.insert("c", 3);
    db.insert("c", 4);
    db.commit("c");
    assert_eq!(next_batch(&mut src).await, vec![3, 4]);
    quiet_for(&mut src, Duration::from_secs(1)).await;
    assert_eq!(db.reads().len(), reads + 2, "the woken read, then one after the interval: {:?}", db.reads());
}

/// A quiet source still reads its own table every `QUIET_READ_EVERY` (its slot is maintained
/// then, and rows below the mark, which the watch does not look at, are found).
#[tokio::test(start_paused = true)]
async fn a_quiet_source_still_reads_its_table_every_few_seconds() {
    let db = Fake::default();
    let watch = Watch::default();
    let mut src = watch.source(&db);
    quiet_for(&mut src, quiet::QUIET_READ_EVERY * 2 + Duration::from_millis(500)).await;
    assert_eq!(db.reads().len(), 3, "the first rescan and one per QUIET_READ_EVERY: {:?}", db.reads());
}

/// A watch that fails wakes its sources and lets them poll on their own (nothing is late) until
/// it works again; then they are quiet again.
#[tokio::test(start_paused = true)]
async fn while_the_watch_fails_sources_poll_on_their_own() {
    let db = Fake::default();
    let watch = Watch::default();
    watch.failing.store(true, Ordering::SeqCst);
    let mut src = watch.source(&db);
    quiet_for(&mut src, Duration::from_millis(200)).await;
    let polled = db.reads().len();
    assert!(polled > 50, "polled every 1 ms interval while the watch failed: {polled}");
    db.insert("a", 1);
    db.commit("a");
    assert_eq!(next_batch(&mut src).await, vec![1], "found by the source's own read");
    watch.failing.store(false, Ordering::SeqCst);
    quiet_for(&mut src, Duration::from_secs(6)).await;
    let settled = db.reads().len();
    quiet_for(&mut src, Duration::from_secs(1)).await;
    assert!(db.reads().len() - settled <= 1, "quiet again once the watch works: {} reads", db.reads().len() - settled);
    assert!(watch.probes() > 100, "the watch probes again: {}", watch.probes());
}

/// Two quiet tables of one source are asked about in one statement, each above its own mark.
#[tokio::test(start_paused = true)]
async fn quiet_tables_of_a_source_are_probed_together() {
    let seen: Arc<Mutex<Vec<Vec<Watched>>>> = Arc::default();
    let seen2 = seen.clone();
    struct Recording(Arc<Mutex<Vec<Vec<Watched>>>>);
    impl TableProbe for Recording {
        fn holding<'a>(
            &'a mut self,
            tables: &'a [Watched],
        ) -> futures::future::BoxFuture<'a, Result<Vec<bool>, Error>> {
            self.0.lock().unwrap().push(tables.to_vec());
            Box::pin(async move { Ok(vec![false; tables.len()]) })
        }
    }
    let connect: ConnectProbe = Arc::new(move || {
        let seen = seen2.clone();
        Box::pin(async move { Ok(Box::new(Recording(seen)) as Box<dyn TableProbe>) })
    });
    let watch = QuietWatch::new("s", connect);
    // A table with a long interval, quiet alone, is asked about every shortest interval of the
    // source's tables, whether the table with the short one is quiet or not.
    let (a, b) = (watch.table("t_a", Duration::from_secs(60)), watch.table("t_b", Duration::from_millis(10)));
    let qa = a.quiet(7).expect("the watch works");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let alone = seen.lock().unwrap().len();
    assert!((5..=12).contains(&alone), "every 10 ms although the quiet table polls every 60 s: {alone}");
    let qb = b.quiet(-3).expect("the watch works");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let probes = seen.lock().unwrap().clone();
    let both = vec![Watched { table: "t_a".into(), above: 7 }, Watched { table: "t_b".into(), above: -3 }];
    assert_eq!(probes.last().unwrap(), &both, "both tables in one statement, each above its own mark");
    drop((qa, qb));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let after = seen.lock().unwrap().len();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(seen.lock().unwrap().len(), after, "no statement while no table is quiet");
}
