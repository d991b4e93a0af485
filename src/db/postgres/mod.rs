//! PostgreSQL: logical replication from one slot per shard-partition (pgoutput), or polling.
//!
//! Everything that knows PostgreSQL is in this folder:
//!
//! ```text
//!  cdc.rs          the CDC source: a slot's pgoutput stream turned into outbox records
//!  checkpoint.rs   the checkpoint row: published-up-to mark, skip list, catch-up state
//!  visibility.rs   waiting until the transactions a change names are visible
//!  poll.rs         the polling table (polling mode and the catch-up drain)
//!  catchup.rs      catching up when a slot is lost, or when a stream returns from polling
//!  heartbeat.rs    the WAL heartbeat that keeps idle slots moving
//!  lag.rs          the slot-lag gauge
//!  setup.rs        `setup`: the server checks, then the schema, slots and grants
//!  status.rs       `status`: each slot's state and lag, each table's pending rows
//!  teardown.rs     `teardown`: what `setup` created, dropped by the rules in `db/teardown.rs`
//!  connect.rs      a source's URL, password and TLS turned into a `PgTarget`
//!  api.rs          the message API's table: setup's statements and its `MessageStore`
//! ```

mod api;
mod catchup;
mod cdc;
mod checkpoint;
mod columns;
pub(crate) mod connect;
mod envelope;
mod heartbeat;
mod keyed;
mod lag;
pub(crate) mod poll;
mod setup;
mod skip;
mod snapshot;
mod status;
mod teardown;
mod visibility;

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use outbox_postgres::connect::PgTarget;
use tokio::sync::watch;

use super::teardown::Section;
use super::{Database, JobContext, SetupRequest, StreamStatus, TeardownRequest};
use crate::catchup::CatchUp;
use crate::config::{Mode, SourceConfig};
use crate::dberror::{self, Backend};
use crate::error::Error;
use crate::job::{JobParts, StreamJob, poll_settings, stream_plans};
use crate::lease::OwnerLease;
use crate::names::{StreamId, checkpoint_table};
use crate::poll::PollSource;
use crate::skip::What;
use cdc::PgSource;
use poll::PgPollTable;

/// PostgreSQL behind the [`Database`] seam.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Postgres;

impl Database for Postgres {
    fn jobs(&self, source: &SourceConfig, ctx: &JobContext<'_>) -> anyhow::Result<Vec<StreamJob>> {
        jobs(source, ctx)
    }

    /// The heartbeat (when `heartbeat_interval_ms` is set) and the slot-lag poller, over every
    /// slot of the source: CDC slots first, then those of shard-partitions in polling mode.
    fn background(
        &self,
        source: &SourceConfig,
        ctx: &JobContext<'_>,
        stop: watch::Receiver<bool>,
    ) -> anyhow::Result<Vec<BoxFuture<'static, ()>>> {
        let target = target(source, ctx)?;
        let mut tasks = Vec::new();
        if let Some(ms) = source.heartbeat_interval_ms {
            tasks.push(heartbeat::run(target.clone(), Duration::from_millis(ms), stop.clone()).boxed());
        }
        let (mut slots, mut polled_slots) = (Vec::new(), Vec::new());
        for (_, settings, names) in stream_plans(source) {
            match settings.mode {
                Mode::Polling => polled_slots.push(names.slot),
                Mode::Cdc => slots.push(names.slot),
            }
        }
        slots.extend(polled_slots);
        tasks.push(lag::run(source.name.clone(), target, slots, stop).boxed());
        Ok(tasks)
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
        let target = connect::pg_target(source, None)?;
        Ok(api::PgMessages::new(target, &source.table_prefix, api.db_connections, api.request_timeout_ms))
    }
}

/// The streamer's target of `source`, named after this instance under coordination.
fn target(source: &SourceConfig, ctx: &JobContext<'_>) -> anyhow::Result<PgTarget> {
    let mut target = connect::pg_target(source, None)?;
    if let Some(instance) = ctx.instance {
        target = target.with_instance(instance);
    }
    Ok(target)
}

/// The jobs of a PostgreSQL source.
fn jobs(source: &SourceConfig, ctx: &JobContext<'_>) -> anyhow::Result<Vec<StreamJob>> {
    let target = target(source, ctx)?;
    let checkpoint = checkpoint_table(&source.table_prefix);
    let mut jobs = Vec::new();
    // One watch of the quiet tables for all polling shard-partitions of the source.
    let quiet =
        crate::poll::QuietWatch::new(&source.name, poll::quiet_probe(target.clone(), source.layout().id_column()));
    for (labels, settings, names) in stream_plans(source) {
        let scope =
            dberror::Scope::of_stream(source, Backend::Postgres, target.user(), target.database(), &names.table);
        let broker = crate::sink::broker_settings(ctx, &settings, &labels);
        let catch_up: Arc<dyn CatchUp> = Arc::new(catchup::PgCatchUp {
            target: target.clone(),
            names: names.clone(),
            checkpoint: checkpoint.clone(),
            storage: settings.storage,
            layout: source.layout(),
        });
        let message_timeout_ms = ctx.kafka.message_timeout_ms;
        let layout = source.layout();
        if settings.mode == Mode::Polling {
            let (target, checkpoint, mut poll) =
                (target.clone(), checkpoint.clone(), poll_settings(&settings, &labels));
            poll.quiet = Some(quiet.table(&names.table, poll.interval));
            let (table, slot, stream_names) = (names.table.clone(), names.slot.clone(), names.clone());
            let connect = move |lease: OwnerLease| {
                let (target, table, checkpoint, poll, slot, names) = (
                    target.clone(),
                    table.clone(),
                    checkpoint.clone(),
                    poll.clone(),
                    slot.clone(),
                    stream_names.clone(),
                );
                async move {
                    // Streaming from the slot again later must first send what polling left.
                    let client = target
                        .connect()
                        .await
                        .map_err(|e| Error::from_db(&format!("connecting to {}", target.display()), e))?;
                    if layout.mapping().is_some() && keyed::is_uuid(&client, &table, layout.id_column()).await? {
                        return Err(keyed::no_order(&table, layout.id_column(), "cannot poll"));
                    }
                    let epoch = lease.db_epoch();
                    poll::refuse_past_messages(&client, &checkpoint, &names).await?;
                    catchup::mark_pending(&client, &checkpoint, &table, epoch).await?;
                    let reader = PgPollTable::connect(&target, &table, layout).await?.moving_slot(&slot);
                    let cleaner = PgPollTable::connect(&target, &table, layout).await?.fenced_by(&checkpoint, epoch);
                    Ok(PollSource::new(reader, cleaner, poll))
                }
            };
            jobs.push(
                JobParts { labels, scope, settings, names, connect, catch_up, broker, message_timeout_ms }.into_job(),
            );
        } else {
            let status_interval = Duration::from_millis(settings.status_interval_ms);
            let silence_limit =
                source.heartbeat_interval_ms.map(|ms| Duration::from_millis(ms * 3).max(status_interval * 3));
            let (target, checkpoint, stream_names) = (target.clone(), checkpoint.clone(), names.clone());
            let metric_labels = labels.metric_labels();
            let options =
                cdc::CdcOptions { status_interval, silence_limit, storage: settings.storage, layout: source.layout() };
            // The job's: what one session leaves to finish by key, the next deletes.
            let keys = crate::row_keys::RowKeys::default();
            let connect = move |lease: OwnerLease| {
                let (target, names, checkpoint) = (target.clone(), stream_names.clone(), checkpoint.clone());
                let (metric_labels, keys) = (metric_labels.clone(), keys.clone());
                async move { PgSource::connect(&target, &names, &checkpoint, options, &lease, metric_labels, &keys).await }
            };
            jobs.push(
                JobParts { labels, scope, settings, names, connect, catch_up, broker, message_timeout_ms }.into_job(),
            );
        }
    }
    Ok(jobs)
}

/// The connector's names of a shard-partition's objects, from the core's.
fn objects(names: crate::names::StreamNames, wal: bool) -> outbox_postgres::setup::StreamObjects {
    outbox_postgres::setup::StreamObjects { table: names.table, publication: names.publication, slot: names.slot, wal }
}
