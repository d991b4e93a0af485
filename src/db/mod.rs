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

use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::watch;

use crate::config::{KafkaConfig, SourceConfig, SourceKind};
use crate::job::StreamJob;
use crate::source::SourceError;

/// How often the background lag pollers publish a source's lag.
pub(crate) const LAG_POLL_INTERVAL: Duration = Duration::from_secs(5);

/// What `run` tells a database about the instance its jobs run in.
#[derive(Debug, Clone, Copy)]
pub(crate) struct JobContext<'a> {
    /// The producer settings every shard-partition's producer starts from.
    pub kafka: &'a KafkaConfig,
    /// Under ZooKeeper ownership, this instance's name (PostgreSQL shows it as the sessions'
    /// `application_name`).
    pub instance: Option<&'a str>,
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
}

/// The implementation of a source's database: the only `match` on [`SourceKind`].
pub(crate) fn of(kind: SourceKind) -> &'static dyn Database {
    match kind {
        SourceKind::Postgres => &postgres::Postgres,
        SourceKind::Mysql => &mysql::Mysql,
    }
}

/// This instance no longer owns `table`: a newer owner epoch is stored in its checkpoint row.
pub(crate) fn fenced(table: &str, epoch: i64) -> SourceError {
    SourceError::Fenced(format!(
        "the checkpoint of {table} carries a newer owner epoch than this instance's ({epoch}): another instance owns it"
    ))
}
