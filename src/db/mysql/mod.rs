//! MySQL/MariaDB: the binlog of the source's server (one reader per shard-partition), or polling.
//!
//! Everything that knows MySQL/MariaDB is in this folder:
//!
//! ```text
//!  cdc.rs       the CDC source: a table's binlog rows turned into outbox records
//!  checkpoint.rs every statement on the checkpoint row (position, epoch, catch-up, skips)
//!  xa.rs        XA transactions held between prepare and commit
//!  xa_scan.rs   where a catch-up resumes so that XA transactions prepared before it are kept
//!  poll.rs      the polling table (polling mode and the catch-up drain)
//!  catchup.rs   catching up when the binlog position is lost, or when a stream returns from polling
//!  lag.rs       the binlog-lag gauge
//!  setup.rs     `setup`: the server and account checks, then the tables, checkpoints and grants
//!  status.rs    `status`: each stream's stored position and binlog lag, each table's pending rows
//!  teardown.rs  `teardown`: what `setup` created, dropped by the rules in `db/teardown.rs`
//!  connect.rs   a source's URL, password and TLS turned into mysql_async options
//! ```

mod api;
mod catchup;
pub(crate) mod cdc;
mod checkpoint;
pub(crate) mod connect;
mod keyed;
mod lag;
mod poll;
mod setup;
mod skip;
mod status;
mod teardown;
mod wal;
mod xa;
mod xa_scan;

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use outbox_mysql::mysql_async::{Opts as MyOpts, OptsBuilder};
use tokio::sync::watch;

use super::teardown::Section;
use super::{Database, JobContext, SetupRequest, StreamStatus, TeardownRequest};
use crate::catchup::CatchUp;
use crate::config::{Mode, SourceConfig};
use crate::dberror::{self, Backend};
use crate::job::{JobParts, StreamJob, poll_settings, stream_plans};
use crate::lease::OwnerLease;
use crate::names::{StreamId, checkpoint_table};
use crate::poll::PollSource;
use crate::skip::What;
use cdc::MySource;
use poll::MyPollTable;

/// MariaDB ends a session whose transaction sat idle this long (the executable comment runs
/// on MariaDB 10.3+ only; MySQL sees `SET @outbox_streamer = 1`). The streamer's own
/// transactions never idle; a paused owner's cleanup transaction would otherwise hold the
/// checkpoint row's lock, and with it the next owner, until the paused process resumed.
const IDLE_TXN_LIMIT: &str = "SET @outbox_streamer = 1 /*M!100300 , SESSION idle_transaction_timeout = 5 */";

/// MySQL and MariaDB behind the [`Database`] seam.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mysql;

impl Database for Mysql {
    fn jobs(&self, source: &SourceConfig, ctx: &JobContext<'_>) -> anyhow::Result<Vec<StreamJob>> {
        jobs(source, ctx)
    }

    /// The binlog-lag poller over every stream of the source.
    fn background(
        &self,
        source: &SourceConfig,
        _ctx: &JobContext<'_>,
        stop: watch::Receiver<bool>,
    ) -> anyhow::Result<Vec<BoxFuture<'static, ()>>> {
        let opts = streamer_opts(source)?;
        Ok(vec![lag::run(source.name.clone(), opts, checkpoint_table(&source.table_prefix), stop).boxed()])
    }

    fn setup<'a>(&'a self, source: &'a SourceConfig, how: &'a SetupRequest<'a>) -> BoxFuture<'a, anyhow::Result<bool>> {
        setup::setup(source, how).boxed()
    }

    fn teardown<'a>(
        &'a self,
        source: &'a SourceConfig,
        how: &'a TeardownRequest<'a>,
    ) -> BoxFuture<'a, anyhow::Result<Section>> {
        teardown::tear_down(source, how.admin, how.options, how.members).boxed()
    }

    fn status<'a>(&'a self, source: &'a SourceConfig) -> BoxFuture<'a, anyhow::Result<Vec<StreamStatus>>> {
        status::status(source).boxed()
    }

    fn skip<'a>(
        &'a self,
        source: &'a SourceConfig,
        id: StreamId,
        what: &'a What,
    ) -> BoxFuture<'a, anyhow::Result<String>> {
        Box::pin(skip::skip(source, id, what))
    }

    fn identify<'a>(&'a self, source: &'a SourceConfig) -> BoxFuture<'a, anyhow::Result<String>> {
        Box::pin(connect::identify(source))
    }

    fn message_store(
        &self,
        source: &SourceConfig,
        api: &crate::config::ApiConfig,
    ) -> anyhow::Result<Arc<dyn crate::api::MessageStore>> {
        let opts = streamer_opts(source)?;
        Ok(api::MyMessages::new(opts, &source.table_prefix, api.db_connections, api.request_timeout_ms)?)
    }
}

/// The streamer's options of `source`: every session it opens limits idle transactions.
fn streamer_opts(source: &SourceConfig) -> anyhow::Result<MyOpts> {
    let opts = connect::mysql_opts(source, None)?;
    Ok(OptsBuilder::from_opts(opts).init(vec![IDLE_TXN_LIMIT]).into())
}

/// The jobs of a MySQL/MariaDB source.
fn jobs(source: &SourceConfig, ctx: &JobContext<'_>) -> anyhow::Result<Vec<StreamJob>> {
    let opts = streamer_opts(source)?;
    let checkpoint = checkpoint_table(&source.table_prefix);
    let mut jobs = Vec::new();
    let (login, database) =
        (opts.user().unwrap_or_default().to_string(), opts.db_name().unwrap_or_default().to_string());
    // One watch of the quiet tables for all polling shard-partitions of the source.
    let quiet = crate::poll::QuietWatch::new(&source.name, poll::quiet_probe(opts.clone(), source.layout()));
    for (labels, settings, names) in stream_plans(source) {
        let scope = dberror::Scope::of_stream(source, Backend::MySql, &login, &database, &names.table);
        let broker = crate::sink::broker_settings(ctx, &settings, &labels);
        let catch_up: Arc<dyn CatchUp> = Arc::new(catchup::MyCatchUp {
            opts: opts.clone(),
            names: names.clone(),
            checkpoint: checkpoint.clone(),
            layout: source.layout(),
        });
        let message_timeout_ms = ctx.kafka.message_timeout_ms;
        let layout = source.layout();
        if settings.mode == Mode::Polling {
            let (opts, checkpoint, mut poll) = (opts.clone(), checkpoint.clone(), poll_settings(&settings, &labels));
            poll.quiet = Some(quiet.table(&names.table, poll.interval));
            let table = names.table.clone();
            let connect = move |lease: OwnerLease| {
                let (opts, table, checkpoint, poll) = (opts.clone(), table.clone(), checkpoint.clone(), poll.clone());
                async move {
                    let mut reader = MyPollTable::connect(&opts, &table, layout).await?;
                    catchup::mark_pending(reader.conn(), &checkpoint, &table, lease.db_epoch()).await?;
                    let cleaner =
                        MyPollTable::connect(&opts, &table, layout).await?.fenced_by(&checkpoint, lease.db_epoch());
                    Ok(PollSource::new(reader, cleaner, poll))
                }
            };
            jobs.push(
                JobParts { labels, scope, settings, names, connect, catch_up, broker, message_timeout_ms }.into_job(),
            );
        } else {
            let heartbeat = Duration::from_millis(settings.status_interval_ms.max(1000));
            // The job's keys: what one session leaves to finish by key, the next deletes.
            let stored = cdc::Stored { storage: settings.storage, layout, keys: crate::row_keys::RowKeys::default() };
            let (opts, checkpoint, task_labels, stream_names) =
                (opts.clone(), checkpoint.clone(), labels.clone(), names.clone());
            let connect = move |lease: OwnerLease| {
                let (opts, names, checkpoint, labels, stored) =
                    (opts.clone(), stream_names.clone(), checkpoint.clone(), task_labels.clone(), stored.clone());
                async move {
                    MySource::connect(&labels, &opts, &names, &checkpoint, lease.db_epoch(), heartbeat, stored).await
                }
            };
            jobs.push(
                JobParts { labels, scope, settings, names, connect, catch_up, broker, message_timeout_ms }.into_job(),
            );
        }
    }
    Ok(jobs)
}
