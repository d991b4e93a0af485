//! The streamer loop against a fake source and a fake sink: order, cleanup, shutdown inside a
//! transaction, backpressure, dead letters, halts, failures mid-batch and what the next session
//! does about them. Time is paused (and advances by itself whenever every task waits), so the
//! loop's timers cost nothing.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::FutureExt;
use futures::future::Map;
use tokio::sync::oneshot::error::RecvError;
use tokio::sync::{Notify, mpsc, oneshot, watch};

use super::*;
use crate::config::BadRowPolicy;
use crate::error::Error;
use crate::error::Kind;
use crate::lease::OwnerLease;
use crate::names::StreamId;
use crate::poll::PolledRow;
use crate::record::InvalidRow;
use crate::sink::{Offer, Outgoing};
use crate::source::Probe;

const TOPIC: &str = "orders";
const DLQ: &str = "dead";

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

// ---- the fake sink ----------------------------------------------------------------------

/// A record as the sink received it.
#[derive(Debug, Clone)]
struct Received {
    topic: String,
    id: i64,
    label: String,
    headers: Vec<(String, Vec<u8>)>,
}

#[derive(Default)]
struct SinkState {
    /// At most this many records unsettled; more are [`Offer::Full`].
    capacity: Option<usize>,
    /// Acknowledge every record as it is handed over.
    auto_ack: bool,
    /// Every record handed over, in order.
    received: Vec<Received>,
    /// Records handed over and not settled yet, in order.
    open: VecDeque<(i64, oneshot::Sender<Result<(), Failure>>)>,
    /// Refused before sending, by (topic, id).
    refuse: HashMap<(String, i64), Verdict>,
    /// Failed once on delivery, by (topic, id) (a resend goes through).
    fail_once: HashMap<(String, i64), Verdict>,
    /// Topics the broker does not show ready.
    missing: HashSet<String>,
    /// How many offers found the sink full.
    full: usize,
    /// Exactly-once: records go in transactions.
    transactional: bool,
    in_txn: bool,
    /// Where the open transaction's records start in `received`.
    txn_from: usize,
    /// Records of committed transactions, in order.
    committed: Vec<Received>,
    /// The last committed progress record.
    progress: Option<Vec<u8>>,
    commits: usize,
}

#[derive(Default)]
struct FakeSink {
    state: Mutex<SinkState>,
    room: Notify,
}

type Report = Result<Result<(), Failure>, RecvError>;

fn failure(verdict: Verdict, topic: &str) -> Failure {
    Failure {
        verdict,
        topic: Some(topic.to_string()),
        error: Box::new(std::io::Error::other("refused by the fake sink")),
        fix: "the fake's fix",
    }
}

fn header<'a>(headers: &'a [(&str, &[u8])], name: &str) -> &'a [u8] {
    headers.iter().find(|(k, _)| *k == name).map(|(_, v)| *v).unwrap_or_default()
}

impl Sink for FakeSink {
    fn name(&self) -> &'static str {
        "Fake"
    }
    type Delivery = Map<oneshot::Receiver<Result<(), Failure>>, fn(Report) -> Result<(), Failure>>;

    fn send(&self, r: &Outgoing<'_>) -> Result<Self::Delivery, Offer> {
        let mut s = lock(&self.state);
        let id: i64 = std::str::from_utf8(header(r.stamp, "outbox-id")).unwrap().parse().unwrap();
        let key = (r.topic.to_string(), id);
        if let Some(verdict) = s.refuse.get(&key) {
            return Err(Offer::Refused(failure(*verdict, r.topic)));
        }
        if s.capacity.is_some_and(|c| s.open.len() >= c) {
            s.full += 1;
            return Err(Offer::Full);
        }
        let mut headers: Vec<(String, Vec<u8>)> = r.headers.to_vec();
        headers.extend(r.stamp.iter().map(|(k, v)| (k.to_string(), v.to_vec())));
        let label = String::from_utf8(header(r.stamp, "outbox-lsn").to_vec()).unwrap();
        s.received.push(Received { topic: r.topic.to_string(), id, label, headers });
        let (tx, rx) = oneshot::channel();
        if let Some(verdict) = s.fail_once.remove(&key) {
            let _ = tx.send(Err(failure(verdict, r.topic)));
        } else if s.auto_ack {
            let _ = tx.send(Ok(()));
        } else {
            s.open.push_back((id, tx));
        }
        Ok(rx.map((|r: Report| r.unwrap_or_else(|_| Err(failure(Verdict::Transient, "?")))) as fn(Report) -> _))
    }

    async fn ready(&self) {
        self.room.notified().await;
    }

    async fn topic_ready(&self, topic: &str) -> Option<bool> {
        Some(!lock(&self.state).missing.contains(topic))
    }

    async fn recheck(&self, mut f: Failure) -> Failure {
        if f.verdict == Verdict::Unsure {
            f.verdict = Verdict::Transient;
        }
        f
    }

    fn transactional(&self) -> bool {
        lock(&self.state).transactional
    }

    async fn resume(&self) -> Result<Option<Vec<u8>>, Error> {
        Ok(lock(&self.state).progress.clone())
    }

    fn begin(&self) -> Result<(), Error> {
        let mut s = lock(&self.state);
        assert!(!s.in_txn, "a transaction began inside another");
        s.in_txn = true;
        s.txn_from = s.received.len();
        Ok(())
    }

    async fn commit(&self, progress: Vec<u8>) -> Result<(), Error> {
        let mut s = lock(&self.state);
        assert!(s.in_txn, "a commit without a transaction");
        assert!(s.open.is_empty(), "a commit with records unacknowledged");
        s.in_txn = false;
        let from = s.txn_from;
        let records: Vec<Received> = s.received[from..].to_vec();
        s.committed.extend(records);
        s.progress = Some(progress);
        s.commits += 1;
        Ok(())
    }

    async fn abort(&self) -> Result<(), Error> {
        let mut s = lock(&self.state);
        s.in_txn = false;
        Ok(())
    }
}

impl FakeSink {
    fn with(f: impl FnOnce(&mut SinkState)) -> Arc<Self> {
        let sink = Arc::new(FakeSink::default());
        f(&mut lock(&sink.state));
        sink
    }

    /// Acknowledges the `n` oldest unsettled records.
    fn ack(&self, n: usize) {
        let mut s = lock(&self.state);
        for _ in 0..n {
            let (_, tx) = s.open.pop_front().expect("a record to acknowledge");
            let _ = tx.send(Ok(()));
        }
        drop(s);
        self.room.notify_one();
    }

    fn ids(&self) -> Vec<i64> {
        lock(&self.state).received.iter().map(|r| r.id).collect()
    }

    fn received(&self) -> Vec<Received> {
        lock(&self.state).received.clone()
    }

    fn open(&self) -> usize {
        lock(&self.state).open.len()
    }
}

// ---- the fake source --------------------------------------------------------------------

#[derive(Debug, Default)]
struct SourceLog {
    /// Events handed to the loop.
    read: usize,
    /// `finish` calls: the rows deleted and the position stored.
    finished: Vec<(Vec<i64>, u64)>,
    /// `finish` calls to fail before one succeeds.
    fail_finish: usize,
    /// Each finish waits for a notification first (a slow database).
    hold_finish: Option<Arc<Notify>>,
    /// Positions passed to `finished`, in order.
    confirmed: Vec<u64>,
    finishes_started: usize,
    /// The database history the source reads (`history` when `None`).
    history: Option<&'static str>,
}

struct FakeSource {
    events: mpsc::UnboundedReceiver<SourceEvent<u64>>,
    /// The position of the transaction last begun (its label is `L<position>`).
    begun: u64,
    log: Arc<Mutex<SourceLog>>,
    /// The SQL session: a finish holds it while it runs, and reading rows back waits for it.
    session: Arc<tokio::sync::Mutex<()>>,
}

impl Source for FakeSource {
    type Position = u64;
    const POSITION_HEADER: &'static str = "outbox-lsn";
    const SWEEPS: bool = false;

    async fn next(&mut self) -> Result<Option<SourceEvent<u64>>, Error> {
        let event = self.events.recv().await;
        lock(&self.log).read += 1;
        if let Some(SourceEvent::Begin { label }) = &event {
            self.begun = label.trim_start_matches('L').parse().unwrap_or(0);
        }
        Ok(event)
    }

    fn finish(
        &mut self,
        ids: Arc<[i64]>,
        upto: u64,
    ) -> impl Future<Output = Result<u64, Error>> + Send + 'static + use<> {
        let (log, session) = (self.log.clone(), self.session.clone());
        async move {
            let _session = session.lock().await;
            let hold = {
                let mut log = lock(&log);
                log.finishes_started += 1;
                log.hold_finish.clone()
            };
            if let Some(hold) = hold {
                hold.notified().await;
            }
            let mut log = lock(&log);
            if log.fail_finish > 0 {
                log.fail_finish -= 1;
                return Err(Error::transient("the fake database is away"));
            }
            log.finished.push((ids.to_vec(), upto));
            Ok(ids.len() as u64)
        }
    }

    fn finished(&mut self, upto: u64) {
        lock(&self.log).confirmed.push(upto);
    }

    fn confirm_idle(&mut self, _position: u64) {}

    async fn close(self) {}

    async fn history(&mut self) -> Result<String, Error> {
        Ok(lock(&self.log).history.unwrap_or("history").to_string())
    }

    async fn current_rows(&mut self, _ids: &[i64]) -> Result<Vec<PolledRow>, Error> {
        let _session = self.session.lock().await;
        Ok(Vec::new())
    }

    async fn existing(&mut self, _ids: &[i64]) -> Result<Vec<i64>, Error> {
        Ok(Vec::new())
    }

    async fn probe(&mut self, _below: Option<i64>, _limit: usize) -> Result<Probe<u64>, Error> {
        Ok(Probe { candidates: Vec::new(), max_id: None, mark: 0 })
    }

    fn reached(done: &u64, mark: &u64) -> bool {
        done >= mark
    }

    fn progress_mark(position: &u64) -> Option<String> {
        Some(position.to_string())
    }

    fn begun_within(&self, mark: &str) -> Result<bool, Error> {
        Ok(self.begun <= mark.parse::<u64>().map_err(|e| Error::transient(e.to_string()))?)
    }

    fn skips(&self, _id: Option<i64>, _message: bool, _label: &str) -> bool {
        false
    }
}

// ---- a session under test ---------------------------------------------------------------

type Ended = (Result<(), Error>, StreamMemory<u64>);

struct Session {
    events: mpsc::UnboundedSender<SourceEvent<u64>>,
    log: Arc<Mutex<SourceLog>>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<Ended>,
}

fn settings() -> StreamSettings {
    StreamSettings { cleanup_interval_ms: 20, ..StreamSettings::default() }
}

fn start(sink: &Arc<FakeSink>, settings: StreamSettings, memory: StreamMemory<u64>) -> Session {
    start_with(sink, settings, memory, SourceLog::default())
}

fn start_with(
    sink: &Arc<FakeSink>,
    settings: StreamSettings,
    mut memory: StreamMemory<u64>,
    log: SourceLog,
) -> Session {
    let (events, rx) = mpsc::unbounded_channel();
    let log = Arc::new(Mutex::new(log));
    let (stop, mut stop_rx) = watch::channel(false);
    let source = FakeSource { events: rx, begun: 0, log: log.clone(), session: Arc::default() };
    let sink = sink.clone();
    let task = tokio::spawn(async move {
        let labels = StreamLabels {
            source: "fake".into(),
            id: StreamId { shard: 0, partition: 0 },
            table: "outbox".into(),
            id_column: "id",
            quote: '"',
            lease: OwnerLease::embedded(),
        };
        let result =
            run_session(&labels, &settings, source, &*sink, Duration::from_secs(5), &mut stop_rx, &mut memory).await;
        (result, memory)
    });
    Session { events, log, stop, task }
}

fn record(id: i64, topic: &str) -> OutboxRecord {
    OutboxRecord {
        id,
        topic: topic.into(),
        key: Some(format!("k{id}").into_bytes()),
        payload: Some(format!("p{id}").into_bytes()),
        headers: vec![("app".into(), b"v".to_vec())],
        kafka_partition: None,
        created_at_micros: None,
        timestamp_ms: None,
        in_table: true,
    }
}

impl Session {
    fn send(&self, event: SourceEvent<u64>) {
        self.events.send(event).expect("the session reads");
    }

    /// One transaction with `ids`, committed at `position`.
    fn txn(&self, position: u64, ids: &[i64]) {
        self.begin(position);
        for id in ids {
            self.row(*id);
        }
        self.send(SourceEvent::Commit(position));
    }

    fn begin(&self, position: u64) {
        self.send(SourceEvent::Begin { label: format!("L{position}") });
    }

    fn row(&self, id: i64) {
        self.send(SourceEvent::Row(Ok(record(id, TOPIC))));
    }

    fn finished(&self) -> Vec<(Vec<i64>, u64)> {
        lock(&self.log).finished.clone()
    }

    fn deleted(&self) -> Vec<i64> {
        self.finished().into_iter().flat_map(|(ids, _)| ids).collect()
    }

    fn read(&self) -> usize {
        lock(&self.log).read
    }

    async fn stop(self) -> Ended {
        let _ = self.stop.send(true);
        self.ended().await
    }

    async fn ended(self) -> Ended {
        tokio::time::timeout(Duration::from_secs(60), self.task).await.expect("the session ends").expect("no panic")
    }
}

/// Waits (in paused time) until `done` holds; fails with `what` after a minute.
async fn until(what: &str, done: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

// ---- the tests --------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn records_go_out_in_order_and_complete_transactions_are_deleted() {
    let sink = FakeSink::with(|s| s.auto_ack = true);
    let session = start(&sink, settings(), StreamMemory::default());
    session.txn(10, &[1, 2, 3]);
    session.txn(20, &[4]);
    until("a complete prefix is deleted", || session.deleted().len() == 4).await;
    let (result, _) = session.stop().await;
    result.unwrap();
    assert_eq!(sink.ids(), [1, 2, 3, 4]);
    let got = sink.received();
    assert_eq!(got[0].label, "L10");
    assert_eq!(got[3].label, "L20", "each record carries its own transaction's position");
    let names: Vec<&str> = got[0].headers.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(names, ["app", "outbox-id", "outbox-shard", "outbox-partition", "outbox-lsn"]);
}

#[tokio::test(start_paused = true)]
async fn nothing_is_deleted_before_every_record_of_a_transaction_is_acknowledged() {
    let sink = FakeSink::default().into();
    let session = start(&sink, settings(), StreamMemory::default());
    session.txn(10, &[1, 2]);
    session.txn(20, &[3]);
    until("all three are sent", || sink.ids().len() == 3).await;
    sink.ack(1);
    // The loop runs its cleanup timer many times over while the clock advances.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(session.deleted().is_empty(), "transaction 10 is not complete: nothing deleted");
    sink.ack(2);
    until("both transactions are deleted", || session.deleted() == [1, 2, 3]).await;
    assert_eq!(session.finished().last().unwrap().1, 20, "the position stored is the last complete commit");
    session.stop().await.0.unwrap();
}

#[tokio::test(start_paused = true)]
async fn shutdown_inside_a_transaction_reads_on_to_its_commit() {
    let sink = FakeSink::with(|s| s.auto_ack = true);
    let session = start(&sink, settings(), StreamMemory::default());
    session.begin(10);
    session.row(1);
    session.row(2);
    until("both rows are sent", || sink.ids().len() == 2).await;
    let _ = session.stop.send(true);
    session.row(3);
    session.send(SourceEvent::Commit(10));
    let log = session.log.clone();
    let (result, _) = session.ended().await;
    result.unwrap();
    assert_eq!(sink.ids(), [1, 2, 3]);
    assert_eq!(lock(&log).finished, [(vec![1, 2, 3], 10)], "the transaction is deleted, not left to the next owner");
}

#[tokio::test(start_paused = true)]
async fn shutdown_inside_a_transaction_whose_commit_never_comes_deletes_nothing() {
    let sink = FakeSink::with(|s| s.auto_ack = true);
    let session = start(&sink, settings(), StreamMemory::default());
    session.txn(5, &[1]);
    session.begin(10);
    session.row(2);
    until("both rows are sent", || sink.ids().len() == 2).await;
    let log = session.log.clone();
    let started = tokio::time::Instant::now();
    let (result, _) = session.stop().await;
    result.unwrap();
    assert!(started.elapsed() >= FINISH_OPEN_TXN, "the session waited for the commit");
    let finished = lock(&log).finished.clone();
    assert_eq!(finished, [(vec![1], 5)], "only the committed transaction is deleted");
}

#[tokio::test(start_paused = true)]
async fn a_full_sink_stops_reading_while_acknowledgements_and_shutdown_are_served() {
    let sink = FakeSink::with(|s| s.capacity = Some(2));
    let session = start(&sink, settings(), StreamMemory::default());
    session.txn(10, &[1, 2, 3, 4, 5]);
    session.txn(20, &[6]);
    until("the sink is full", || lock(&sink.state).full > 0).await;
    let read = session.read();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(sink.ids(), [1, 2], "nothing more is handed over without room");
    assert_eq!(session.read(), read, "nothing more is read while a record waits for room");
    assert_eq!(read, 4, "begin and three rows: the third found no room");
    // Acknowledgements are served meanwhile, and each one makes room for the next record.
    for sent in 3..=6 {
        sink.ack(1);
        until("the next record goes out", || sink.ids().len() == sent).await;
    }
    sink.ack(2);
    until("everything is deleted", || session.deleted() == [1, 2, 3, 4, 5, 6]).await;
    assert_eq!(sink.ids(), [1, 2, 3, 4, 5, 6], "order kept across the waits");
    // Full again inside an open transaction: shutdown still ends the session.
    session.begin(30);
    for id in 7..=9 {
        session.row(id);
    }
    until("the sink is full again", || sink.ids().len() == 8).await;
    let log = session.log.clone();
    let stopping = tokio::spawn(session.stop());
    until("the session stops after its grace for the commit", || stopping.is_finished() || sink.open() == 0).await;
    sink.ack(2);
    let (result, _) = stopping.await.unwrap();
    result.unwrap();
    assert_eq!(sink.ids(), [1, 2, 3, 4, 5, 6, 7, 8], "row 9 never got room and was never sent");
    assert_eq!(lock(&log).finished.last().unwrap().1, 20, "the open transaction is not deleted");
}

#[tokio::test(start_paused = true)]
async fn a_row_the_sink_refuses_halts_at_that_row_after_deleting_what_came_before() {
    let sink = FakeSink::with(|s| {
        s.auto_ack = true;
        s.refuse.insert((TOPIC.into(), 2), Verdict::Record);
    });
    let session = start(&sink, settings(), StreamMemory::default());
    session.txn(10, &[1]);
    session.txn(20, &[2, 3]);
    let log = session.log.clone();
    let (result, mut memory) = session.ended().await;
    let Some(message) = result.as_ref().err().filter(|e| e.kind() == Kind::Definite).map(Error::to_string) else {
        panic!("a halt, not {result:?}")
    };
    assert!(message.starts_with("at row id=2 of outbox: Fake refused it: refused by the fake sink"), "{message}");
    assert!(message.ends_with("fix: the fake's fix"), "{message}");
    assert_eq!(memory.take_halt_point().row, Some(2));
    assert_eq!(sink.ids(), [1], "nothing after the refused row is sent");
    assert_eq!(lock(&log).finished, [(vec![1], 10)]);
}

#[tokio::test(start_paused = true)]
async fn a_missing_topic_halts_with_the_topic_to_wait_for() {
    let sink = FakeSink::with(|s| {
        s.auto_ack = true;
        s.missing.insert("nowhere".into());
        s.refuse.insert(("nowhere".into(), 2), Verdict::MissingTopic);
    });
    let session = start(&sink, settings(), StreamMemory::default());
    session.txn(10, &[1]);
    session.begin(20);
    session.send(SourceEvent::Row(Ok(record(2, "nowhere"))));
    session.send(SourceEvent::Commit(20));
    let (result, mut memory) = session.ended().await;
    assert!(matches!(&result, Err(e) if e.kind() == Kind::Definite), "{result:?}");
    let point = memory.take_halt_point();
    assert_eq!((point.row, point.missing_topic.as_deref()), (Some(2), Some("nowhere")));
}

#[tokio::test(start_paused = true)]
async fn bad_rows_go_to_the_dead_letter_topic_and_complete_their_transaction() {
    let sink = FakeSink::with(|s| {
        s.auto_ack = true;
        s.refuse.insert((TOPIC.into(), 2), Verdict::Record);
    });
    let settings =
        StreamSettings { on_bad_row: BadRowPolicy::DeadLetter, dead_letter_topic: Some(DLQ.into()), ..settings() };
    let session = start(&sink, settings, StreamMemory::default());
    session.begin(10);
    session.row(1);
    session.row(2);
    session.send(SourceEvent::Row(Err(InvalidRow::new(Some(3), "topic", "is empty"))));
    session.row(4);
    session.send(SourceEvent::Commit(10));
    until("the transaction is deleted", || session.deleted().len() == 4).await;
    session.stop().await.0.unwrap();
    let got: Vec<(String, i64)> = sink.received().into_iter().map(|r| (r.topic, r.id)).collect();
    let expect = [(TOPIC, 1), (DLQ, 2), (DLQ, 3), (TOPIC, 4)].map(|(t, id)| (t.to_string(), id));
    assert_eq!(got, expect);
    let copy = &sink.received()[1];
    let reason = copy.headers.iter().find(|(k, _)| k == "outbox-dead-letter-reason").expect("a reason");
    assert_eq!(reason.1, b"Fake refused it: refused by the fake sink");
    assert!(copy.headers.iter().any(|(k, v)| k == "outbox-original-topic" && v == TOPIC.as_bytes()));
}

#[tokio::test(start_paused = true)]
async fn a_refusal_in_a_batch_is_retried_alone_by_the_next_session() {
    // Row 2 fails while travelling with others: the session ends (transient), and the next
    // one — replaying from the last stored position — sends it alone.
    let sink = FakeSink::with(|s| {
        s.auto_ack = true;
        s.fail_once.insert((TOPIC.into(), 2), Verdict::Record);
    });
    let first = start(&sink, settings(), StreamMemory::default());
    first.txn(10, &[1, 2, 3]);
    let (result, memory) = first.ended().await;
    assert!(
        matches!(&result, Err(e) if e.kind() == Kind::Transient && e.to_string().contains("row id=2")),
        "{result:?}"
    );
    assert!(memory.suspects.contains(&2));
    lock(&sink.state).received.clear();
    lock(&sink.state).auto_ack = false;
    let second = start(&sink, settings(), memory);
    second.txn(10, &[1, 2, 3]);
    until("row 1 is sent", || sink.ids() == [1]).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(sink.ids(), [1], "the suspect waits until everything before it settled");
    sink.ack(1);
    until("the suspect is sent alone", || sink.ids() == [1, 2]).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(sink.ids(), [1, 2], "nothing goes with the suspect");
    sink.ack(1);
    until("row 3 follows", || sink.ids() == [1, 2, 3]).await;
    sink.ack(1);
    until("the transaction is deleted", || second.deleted() == [1, 2, 3]).await;
    let (result, memory) = second.stop().await;
    result.unwrap();
    assert!(memory.suspects.is_empty(), "a deleted suspect is forgotten");
}

#[tokio::test(start_paused = true)]
async fn an_acknowledged_prefix_whose_delete_failed_is_finished_first_by_the_next_session() {
    let sink = FakeSink::with(|s| s.auto_ack = true);
    let log = SourceLog { fail_finish: 1, ..SourceLog::default() };
    let first = start_with(&sink, settings(), StreamMemory::default(), log);
    first.txn(10, &[1, 2]);
    let (result, memory) = first.ended().await;
    assert!(matches!(&result, Err(e) if e.kind() == Kind::Transient), "{result:?}");
    assert_eq!(sink.ids(), [1, 2]);
    let second = start(&sink, settings(), memory);
    until("the prefix is finished", || second.deleted() == [1, 2]).await;
    assert_eq!(second.read(), 0, "finished before anything is read");
    assert_eq!(second.finished()[0].1, 10);
    let (result, _) = second.stop().await;
    result.unwrap();
    assert_eq!(sink.ids(), [1, 2], "what was acknowledged is not sent again");
}

/// A failover between the sessions: the promoted server may have given ids 1 and 2 to other
/// rows, so the prefix is not deleted by id there; rows it holds are read and sent again.
#[tokio::test(start_paused = true)]
async fn an_unfinished_prefix_is_not_deleted_by_id_in_another_database_history() {
    let sink = FakeSink::with(|s| s.auto_ack = true);
    let log = SourceLog { fail_finish: 1, history: Some("primary"), ..SourceLog::default() };
    let first = start_with(&sink, settings(), StreamMemory::default(), log);
    first.txn(10, &[1, 2]);
    let (result, memory) = first.ended().await;
    assert!(result.is_err());
    assert!(memory.unfinished.is_some());
    let log = SourceLog { history: Some("promoted standby"), ..SourceLog::default() };
    let second = start_with(&sink, settings(), memory, log);
    second.txn(5, &[1, 3]);
    until("the new history's rows are deleted", || second.deleted() == [1, 3]).await;
    assert_eq!(second.finished()[0], (vec![1, 3], 5), "nothing of the old prefix, no position of it");
    assert_eq!(lock(&second.log).confirmed, [5], "the old history's position is never confirmed");
    let (result, memory) = second.stop().await;
    result.unwrap();
    assert_eq!(sink.ids(), [1, 2, 1, 3], "this server's row 1 is sent: its id is not proof it was");
    assert_eq!(memory.history.as_deref(), Some("promoted standby"));
}

#[tokio::test(start_paused = true)]
async fn a_transient_delivery_failure_mid_batch_ends_the_session_after_settling_the_rest() {
    let sink = FakeSink::with(|s| {
        s.fail_once.insert((TOPIC.into(), 3), Verdict::Transient);
    });
    let session = start(&sink, settings(), StreamMemory::default());
    session.txn(10, &[1]);
    session.txn(20, &[2, 3, 4]);
    until("three records are sent", || sink.ids().len() == 3).await;
    // The failure settles first; the records before it are still acknowledged in the drain.
    sink.ack(2);
    let log = session.log.clone();
    let (result, memory) = session.ended().await;
    let Some(message) = result.as_ref().err().filter(|e| e.kind() == Kind::Transient).map(Error::to_string) else {
        panic!("transient, not {result:?}")
    };
    assert!(message.contains("row id=3") && message.contains("refused by the fake sink"), "{message}");
    assert!(memory.suspects.is_empty(), "a transient failure makes no suspect");
    assert_eq!(lock(&log).finished, [(vec![1], 10)], "only the complete prefix is deleted");
    assert_eq!(sink.ids(), [1, 2, 3], "nothing is read after the failure settled");
}

#[tokio::test(start_paused = true)]
async fn a_drained_catch_up_ends_once_everything_is_deleted() {
    let sink = FakeSink::default().into();
    let session = start(&sink, settings(), StreamMemory::default());
    session.txn(10, &[1, 2]);
    session.send(SourceEvent::Drained);
    until("both are sent", || sink.ids().len() == 2).await;
    sink.ack(2);
    let log = session.log.clone();
    let (result, _) = session.ended().await;
    result.unwrap();
    assert_eq!(lock(&log).finished, [(vec![1, 2], 10)]);
}

// ---- cleanup beside reading -------------------------------------------------------------

/// A session whose database answers a finish only when `notify_one` says so, with the
/// finish of transaction 10 (row 1) running.
async fn with_a_slow_finish_running(settings: StreamSettings) -> (Arc<FakeSink>, Arc<Notify>, Session) {
    let sink = FakeSink::with(|s| s.auto_ack = true);
    let hold = Arc::new(Notify::new());
    let log = SourceLog { hold_finish: Some(hold.clone()), ..SourceLog::default() };
    let session = start_with(&sink, settings, StreamMemory::default(), log);
    session.txn(10, &[1]);
    until("the first finish runs", || lock(&session.log).finishes_started == 1).await;
    (sink, hold, session)
}

#[tokio::test(start_paused = true)]
async fn reading_goes_on_while_a_slow_finish_runs_and_finishes_stay_in_order() {
    let (sink, hold, session) = with_a_slow_finish_running(settings()).await;
    session.txn(20, &[2]);
    session.txn(30, &[3]);
    session.send(SourceEvent::Idle(40));
    until("later transactions are published meanwhile", || sink.ids() == [1, 2, 3]).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    {
        let log = lock(&session.log);
        assert_eq!(log.finishes_started, 1, "one finish at a time");
        assert!(log.finished.is_empty() && log.confirmed.is_empty(), "no position passes the running delete");
    }
    hold.notify_one();
    until("the first prefix is finished", || session.finished() == [(vec![1], 10)]).await;
    hold.notify_one();
    until("the rest follows in one finish", || session.finished().len() == 2).await;
    assert_eq!(session.finished()[1], (vec![2, 3], 30));
    assert_eq!(lock(&session.log).confirmed, [10, 30], "positions confirmed in order, each after its delete");
    session.stop().await.0.unwrap();
}

#[tokio::test(start_paused = true)]
async fn shutdown_waits_for_a_running_finish_then_finishes_the_rest() {
    let (sink, hold, session) = with_a_slow_finish_running(settings()).await;
    session.txn(20, &[2]);
    until("the second row is sent", || sink.ids() == [1, 2]).await;
    let _ = session.stop.send(true);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!session.task.is_finished(), "the session waits for its delete");
    hold.notify_one();
    until("the first prefix is finished", || session.finished().len() == 1).await;
    hold.notify_one();
    let log = session.log.clone();
    let (result, memory) = session.ended().await;
    result.unwrap();
    assert_eq!(lock(&log).finished, [(vec![1], 10), (vec![2], 20)]);
    assert!(memory.unfinished.is_none());
}

#[tokio::test(start_paused = true)]
async fn reading_pauses_while_acknowledged_rows_pile_up_behind_a_slow_finish() {
    let limit = 2 * READY_ROWS_PER_CLEANUP_ROWS;
    let (sink, hold, session) = with_a_slow_finish_running(StreamSettings { cleanup_max_rows: 2, ..settings() }).await;
    for id in 2..=30 {
        session.txn(10 + id as u64, &[id]);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let sent = sink.ids().len();
    assert!(sent < 30, "reading paused behind the running finish ({sent} rows sent)");
    assert!(sent > limit, "{sent} rows sent: reading went on up to the limit");
    until("everything is deleted once the database answers", || {
        hold.notify_one();
        session.deleted().len() == 30
    })
    .await;
    assert_eq!(session.deleted(), (1..=30).collect::<Vec<i64>>(), "in order");
    session.stop().await.0.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_bad_row_read_back_while_a_finish_holds_the_sql_session_waits_for_it() {
    let (sink, hold, session) = with_a_slow_finish_running(settings()).await;
    session.begin(20);
    session.send(SourceEvent::Row(Err(InvalidRow::new(Some(2), "topic", "is NULL"))));
    session.row(3);
    session.send(SourceEvent::Commit(20));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(sink.ids(), [1], "the bad row waits for the table, which waits for the delete");
    // The finish runs on its own: once the database answers it, the row is read back (gone
    // from the table: skipped) and the stream goes on.
    hold.notify_one();
    until("the stream goes on", || sink.ids() == [1, 3]).await;
    hold.notify_one();
    until("both prefixes are finished", || session.deleted() == [1, 3]).await;
    session.stop().await.0.unwrap();
}

// ---- exactly-once -----------------------------------------------------------------------

fn transactional(progress: Option<crate::progress::Progress>) -> Arc<FakeSink> {
    FakeSink::with(|s| {
        s.auto_ack = true;
        s.transactional = true;
        s.progress = progress.map(|p| p.encode());
    })
}

fn committed_ids(sink: &FakeSink) -> Vec<i64> {
    lock(&sink.state).committed.iter().map(|r| r.id).collect()
}

fn last_progress(sink: &FakeSink) -> crate::progress::Progress {
    let value = lock(&sink.state).progress.clone().expect("a progress record");
    crate::progress::Progress::decode(&value, "t", "k").unwrap()
}

#[tokio::test(start_paused = true)]
async fn exactly_once_deletes_rows_only_once_a_kafka_transaction_holding_them_committed() {
    let sink = transactional(None);
    let eo = StreamSettings { delivery: crate::config::Delivery::ExactlyOnce, ..settings() };
    let session = start(&sink, eo, StreamMemory::default());
    session.txn(10, &[1, 2]);
    session.txn(20, &[3]);
    until("the rows are deleted", || session.deleted().len() == 3).await;
    assert_eq!(committed_ids(&sink), [1, 2, 3], "deleted only once committed in Kafka");
    assert_eq!(last_progress(&sink).mark.as_deref(), Some("20"));
    assert_eq!(last_progress(&sink).partial, None);
    let (result, _) = session.stop().await;
    result.unwrap();
    assert!(!lock(&sink.state).in_txn, "no transaction left open");
}

#[tokio::test(start_paused = true)]
async fn a_restart_deletes_what_the_last_progress_record_covers_and_sends_the_rest() {
    // Kafka holds transactions 10 and 20 and the first two rows of 30; the database deleted
    // none of them (the streamer died between the Kafka commit and the delete).
    let progress = crate::progress::Progress::new(
        "outbox-lsn",
        Some("20".into()),
        Some(crate::progress::Partial { transaction: "L30".into(), rows: 2 }),
    );
    let sink = transactional(Some(progress));
    let eo = StreamSettings { delivery: crate::config::Delivery::ExactlyOnce, ..settings() };
    let session = start(&sink, eo, StreamMemory::default());
    session.txn(10, &[1, 2]);
    session.txn(20, &[3]);
    session.txn(30, &[4, 5, 6]);
    session.txn(40, &[7]);
    until("every row is deleted", || session.deleted().len() == 7).await;
    let (result, _) = session.stop().await;
    result.unwrap();
    assert_eq!(sink.ids(), [6, 7], "only what Kafka did not hold is sent");
    assert_eq!(committed_ids(&sink), [6, 7]);
    assert_eq!(last_progress(&sink).mark.as_deref(), Some("40"));
}

/// The database failed over since the progress record was written: its positions may name
/// other transactions on the promoted server, so it covers nothing; every record written
/// names the history it was written in.
#[tokio::test(start_paused = true)]
async fn a_progress_record_of_another_database_history_covers_nothing() {
    let progress = crate::progress::Progress::new("outbox-lsn", Some("20".into()), None).in_history("old primary");
    let sink = transactional(Some(progress));
    let eo = StreamSettings { delivery: crate::config::Delivery::ExactlyOnce, ..settings() };
    let log = SourceLog { history: Some("promoted standby"), ..SourceLog::default() };
    let session = start_with(&sink, eo, StreamMemory::default(), log);
    session.txn(10, &[1]);
    session.txn(20, &[2]);
    until("every row is deleted", || session.deleted().len() == 2).await;
    session.stop().await.0.unwrap();
    assert_eq!(committed_ids(&sink), [1, 2], "both sent: the old history's mark covers neither");
    assert_eq!(last_progress(&sink).history.as_deref(), Some("promoted standby"));
}

/// A record of the same history (a restart, a crash of the server) still covers its mark.
#[tokio::test(start_paused = true)]
async fn a_progress_record_of_the_same_history_still_covers_its_mark() {
    let progress = crate::progress::Progress::new("outbox-lsn", Some("10".into()), None).in_history("history");
    let sink = transactional(Some(progress));
    let eo = StreamSettings { delivery: crate::config::Delivery::ExactlyOnce, ..settings() };
    let session = start(&sink, eo, StreamMemory::default());
    session.txn(10, &[1]);
    session.txn(20, &[2]);
    until("every row is deleted", || session.deleted().len() == 2).await;
    session.stop().await.0.unwrap();
    assert_eq!(committed_ids(&sink), [2]);
}

#[tokio::test(start_paused = true)]
async fn a_source_transaction_larger_than_a_kafka_transaction_is_split_with_its_rows_counted() {
    let sink = transactional(None);
    let eo =
        StreamSettings { delivery: crate::config::Delivery::ExactlyOnce, transaction_max_records: 2, ..settings() };
    let session = start(&sink, eo, StreamMemory::default());
    session.begin(10);
    for id in 1..=5 {
        session.row(id);
    }
    until("the first split commits", || lock(&sink.state).commits >= 1).await;
    let split = last_progress(&sink);
    assert_eq!(split.mark, None);
    let partial = split.partial.expect("the open source transaction is named");
    assert_eq!(partial.transaction, "L10");
    assert!(partial.rows >= 2, "{partial:?}");
    assert!(session.deleted().is_empty(), "nothing is deleted before the source transaction commits");
    session.send(SourceEvent::Commit(10));
    until("the rows are deleted", || session.deleted().len() == 5).await;
    assert_eq!(committed_ids(&sink), [1, 2, 3, 4, 5]);
    let (result, _) = session.stop().await;
    result.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_failed_record_aborts_the_kafka_transaction_and_the_next_session_resends_it() {
    let sink = transactional(None);
    lock(&sink.state).fail_once.insert((TOPIC.into(), 2), Verdict::Transient);
    let eo = StreamSettings { delivery: crate::config::Delivery::ExactlyOnce, ..settings() };
    let session = start(&sink, eo.clone(), StreamMemory::default());
    session.txn(10, &[1, 2]);
    let (result, memory) = session.ended().await;
    assert_eq!(result.unwrap_err().kind(), Kind::Transient);
    assert!(committed_ids(&sink).is_empty(), "the aborted transaction's records count for nothing");
    let session = start(&sink, eo, memory);
    session.txn(10, &[1, 2]);
    until("the rows are deleted", || session.deleted().len() == 2).await;
    let (result, _) = session.stop().await;
    result.unwrap();
    assert_eq!(committed_ids(&sink), [1, 2]);
}
