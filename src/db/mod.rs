//! The database seam: what a database implements once, and the one place that maps a source's
//! `kind` to its implementation.
//!
//! ```text
//!   run.rs ──────┐                      ┌─▶ db/postgres/  slot CDC, polling, catch-up, checkpoint,
//!   cli/setup ───┤  db::of(kind)        │                 heartbeat, slot lag, setup, status, …
//!   cli/status ──┼──▶ &dyn Database ────┤
//!   cli/teardown ┘                      └─▶ db/mysql/     binlog CDC, polling, catch-up, checkpoint,
//!                                                         binlog lag, setup, status, …
//! ```
//!
//! Each folder holds everything that knows its database: its CDC [`crate::source::Source`], its
//! polling table, its catch-up ([`crate::catchup::CatchUp`]), its checkpoint store (the only
//! place its checkpoint SQL is written), its background tasks, and its connection settings.
//! Adding a database means adding a folder and one arm to [`of`]. Inside a job the streamer loop
//! stays generic over the source's position type; the jobs a database hands out are already
//! type-erased ([`StreamJob`]), so this trait needs no associated types.

pub(crate) mod mysql;
pub(crate) mod postgres;
pub(crate) mod teardown;

use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::watch;

use crate::config::{KafkaConfig, SourceConfig, SourceKind};
use crate::error::Error;
use crate::job::StreamJob;
use crate::names::StreamId;
use crate::skip::What;
use teardown::{Members, Options, Section};

/// How often the background lag pollers publish a source's lag.
pub(crate) const LAG_POLL_INTERVAL: Duration = Duration::from_secs(5);

/// What `run` tells a database about the instance its jobs run in.
#[derive(Debug, Clone, Copy)]
pub(crate) struct JobContext<'a> {
    /// The producer settings every shard-partition's producer starts from.
    pub kafka: &'a KafkaConfig,
    /// `[rabbitmq]` resolved (password read, CA loaded): what a RabbitMQ shard-partition's
    /// publisher starts from.
    pub rabbitmq: Option<&'a outbox_rabbitmq::PublisherSettings>,
    /// Under ZooKeeper ownership, this instance's name (PostgreSQL shows it as the sessions'
    /// `application_name`).
    pub instance: Option<&'a str>,
    /// The coordination cluster's name (`default` without coordination): part of each
    /// shard-partition's transactional id.
    pub cluster: &'a str,
}

/// A database the streamer can read an outbox from.
///
/// # Contract
///
/// * [`jobs`](Self::jobs) returns one [`StreamJob`] per shard-partition of the source, in
///   `all_streams` order, and touches no server: a job connects when its owner starts it, under
///   the owner's lease, and every write it makes to the checkpoint (positions, deletes,
///   `catchup_pending`) is guarded by that lease's epoch, so an older owner is fenced
///   ([`fenced`]). The job's source deletes rows and stores the position only after every Kafka
///   record up to it is acknowledged (see [`crate::source::Source`]).
/// * [`background`](Self::background) returns tasks that run beside the jobs for as long as the
///   instance runs, whoever owns the shard-partitions (PostgreSQL's heartbeat and slot-lag
///   gauge, the binlog-lag gauge). They end when `stop` turns true; their failures are logged or
///   retried and never stop streaming.
///
/// An `Err` from either is a configuration error: `run` stops before streaming anything.
///
/// The commands:
///
/// * [`setup`](Self::setup) checks the server first and creates nothing when a check fails
///   (it prints each failure with its fix and returns `Ok(false)`); otherwise it creates what is
///   missing, idempotently, and returns whether everything is ready. A dry run only prints the
///   statements. `Err` is a failure to talk to the server or to apply the plan.
/// * [`teardown`](Self::teardown) removes what `setup` created, by the rules in [`teardown`]:
///   a shard-partition's objects go together, nothing a running streamer uses goes, a table
///   with rows stays unless `drop_pending`. Without `act` it only says what it would do. The
///   returned [`Section`] names every object dropped or left, with why.
/// * [`status`](Self::status) reads one [`StreamStatus`] per shard-partition, in `all_streams`
///   order, and changes nothing.
pub(crate) trait Database: Send + Sync {
    /// One job per shard-partition: how to open its CDC or polling source and its catch-up.
    fn jobs(&self, source: &SourceConfig, ctx: &JobContext<'_>) -> anyhow::Result<Vec<StreamJob>>;

    /// Tasks that run beside the jobs while the instance runs (heartbeats, lag gauges).
    fn background(
        &self,
        source: &SourceConfig,
        ctx: &JobContext<'_>,
        stop: watch::Receiver<bool>,
    ) -> anyhow::Result<Vec<BoxFuture<'static, ()>>>;

    /// `outbox-streamer setup` for this source: checks, then creates.
    fn setup<'a>(&'a self, source: &'a SourceConfig, how: &'a SetupRequest<'a>) -> BoxFuture<'a, anyhow::Result<bool>>;

    /// `outbox-streamer teardown` for this source.
    fn teardown<'a>(
        &'a self,
        source: &'a SourceConfig,
        how: &'a TeardownRequest<'a>,
    ) -> BoxFuture<'a, anyhow::Result<Section>>;

    /// What `outbox-streamer status` reads from the database about each shard-partition.
    fn status<'a>(&'a self, source: &'a SourceConfig) -> BoxFuture<'a, anyhow::Result<Vec<StreamStatus>>>;

    /// `outbox-streamer skip` on one shard-partition (see [`crate::skip`]): refused while the
    /// stream is being read; returns what was done, for the operator.
    fn skip<'a>(
        &'a self,
        source: &'a SourceConfig,
        id: StreamId,
        what: &'a What,
    ) -> BoxFuture<'a, anyhow::Result<String>>;

    /// Who the server is and which of its databases the source uses, as text that is equal for
    /// two sources exactly when they reach the same database ([`crate::same_database`]).
    fn identify<'a>(&'a self, source: &'a SourceConfig) -> BoxFuture<'a, anyhow::Result<String>>;

    /// The message API's store (`[api] source` names this source): its table, which `setup`
    /// creates, reached through at most `api.db_connections` sessions of the source's login,
    /// opened when first needed.
    fn message_store(
        &self,
        source: &SourceConfig,
        api: &crate::config::ApiConfig,
    ) -> anyhow::Result<std::sync::Arc<dyn crate::api::MessageStore>>;
}

/// The login `setup` runs the DDL as, instead of each source's own: a URL, and the password
/// when it comes from an environment variable rather than the URL.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AdminLogin<'a> {
    pub url: &'a str,
    pub password: Option<&'a str>,
}

/// How `setup` runs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SetupRequest<'a> {
    /// Only print the statements.
    pub dry_run: bool,
    /// `--admin-url`: the login the DDL runs as; without it, the source's own.
    pub admin: Option<AdminLogin<'a>>,
    /// `--app-role`: granted what enqueuing needs.
    pub app_roles: &'a [String],
    /// `--restrict-emit` (PostgreSQL, `storage = "wal"`): only the streamer and the
    /// application roles may call `pg_logical_emit_message`.
    pub restrict_emit: bool,
    /// `--create-tables`: create the missing tables of another outbox's layout.
    pub create_tables: bool,
    /// `--prepared-wait` (PostgreSQL): how long to wait for prepared transactions to be decided.
    pub prepared_wait: Duration,
    /// `[api]`: the source it names also gets the message API's table and grants.
    pub api: Option<&'a crate::config::ApiConfig>,
}

impl SetupRequest<'_> {
    /// Whether `source` keeps the message API's messages.
    pub(crate) fn serves_api(&self, source: &SourceConfig) -> bool {
        self.api.is_some_and(|a| a.source == source.name)
    }
}

/// How `teardown` runs.
#[derive(Clone, Copy)]
pub(crate) struct TeardownRequest<'a> {
    /// `--admin-url`: the login that drops; without it, the source's own.
    pub admin: Option<AdminLogin<'a>>,
    pub options: Options,
    /// Under coordination, the registered instances (what they serve is left).
    pub members: Option<&'a dyn Members>,
}

/// Pending rows are counted up to this many; more shows as this number and `+`.
pub(crate) const PENDING_COUNT_CAP: i64 = 1_000_000;

/// Counts the rows of `quoted_table` up to [`PENDING_COUNT_CAP`].
fn count_sql(quoted_table: &str) -> String {
    format!("SELECT count(*) FROM (SELECT 1 FROM {quoted_table} LIMIT {PENDING_COUNT_CAP}) t")
}

/// What a database says about one shard-partition, for `status`.
#[derive(Debug, Clone)]
pub(crate) struct StreamStatus {
    pub id: StreamId,
    /// PostgreSQL: the slot's `wal_status`, `missing`, or `other-db:<database>` when the name is
    /// another database's slot; MySQL: `checkpoint` or `missing`.
    pub state: String,
    /// PostgreSQL: the slot's confirmed LSN; MySQL: the stored GTID position (or file:offset).
    pub position: Option<String>,
    pub slot: Option<String>,
    /// The session reading the slot, if any.
    pub active_pid: Option<i32>,
    pub lag_bytes: Option<i64>,
    /// Rows in the table, counted up to [`PENDING_COUNT_CAP`]; `None`: the table is unreadable.
    pub rows_pending: Option<i64>,
    /// `storage = "wal"`: WAL-only messages waiting in the slot (PostgreSQL, counted while no
    /// session holds the slot, up to [`PENDING_COUNT_CAP`]); `None` when they cannot be
    /// counted (a held slot; MariaDB's binlog) or the storage is `table`.
    pub messages_pending: Option<i64>,
    /// Whether the checkpoint table has the shard-partition's row.
    pub checkpoint_found: bool,
    pub catchup_pending: Option<bool>,
    pub last_catchup_at: Option<String>,
    pub last_catchup_rows: Option<i64>,
    /// What is wrong with the slot (PostgreSQL only).
    pub slot_problem: Option<SlotProblem>,
    /// A setting that could lose this shard-partition's messages (`storage = "wal"` only):
    /// shown, without making the status unhealthy.
    pub warning: Option<String>,
}

impl StreamStatus {
    fn new(id: StreamId) -> Self {
        Self {
            id,
            state: String::new(),
            position: None,
            slot: None,
            active_pid: None,
            lag_bytes: None,
            rows_pending: None,
            messages_pending: None,
            checkpoint_found: false,
            catchup_pending: None,
            last_catchup_at: None,
            last_catchup_rows: None,
            slot_problem: None,
            warning: None,
        }
    }
}

/// A replication slot that cannot be streamed from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SlotProblem {
    /// The name is taken by a slot of this other database.
    OtherDatabase(String),
    Missing,
    /// `wal_status = lost`: the slot was invalidated.
    Lost,
}

/// The implementation of a source's database: the only `match` on [`SourceKind`].
pub(crate) fn of(kind: SourceKind) -> &'static dyn Database {
    match kind {
        SourceKind::Postgres => &postgres::Postgres,
        SourceKind::Mysql => &mysql::Mysql,
    }
}

/// This instance no longer owns `table`: a newer owner epoch is stored in its checkpoint row.
pub(crate) fn fenced(table: &str, epoch: i64) -> Error {
    Error::fenced(format!(
        "the checkpoint of {table} carries a newer owner epoch than this instance's ({epoch}): another instance owns it"
    ))
}

/// `setup --create-tables`: the statements creating each of `tables` (quoted for the database)
/// that does not exist yet, as the layout's own application documents it; an error when the
/// layout documents none (the application creates its table).
pub(crate) fn create_missing_tables(
    source: &SourceConfig,
    tables: &[String],
    postgres: bool,
) -> anyhow::Result<Vec<String>> {
    tables
        .iter()
        .map(|table| match source.layout().create_table(table, postgres) {
            Some(create) => Ok(create.replacen("CREATE TABLE", "CREATE TABLE IF NOT EXISTS", 1)),
            None => Err(anyhow::anyhow!(
                "source {:?}: --create-tables: layout = \"{}\" has no documented table to create; the application creates it",
                source.name,
                source.layout.as_str()
            )),
        })
        .collect()
}
