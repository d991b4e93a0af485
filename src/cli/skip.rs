//! `outbox-streamer skip`: an operator's explicit decision not to publish something.
//!
//! * `--id N` — row N is not published: it is added to the shard-partition's skip list
//!   (`skip_ids` in its checkpoint row, read when a session starts) and deleted from the table.
//! * `--transaction LABEL` — rows of that transaction whose id cannot be read (logged while the
//!   `id` column was dropped or retyped) are not published; LABEL is the `outbox-lsn` /
//!   `outbox-gtid` the halt message names.
//! * `--backlog` — everything committed so far is discarded: the rows in the table are deleted
//!   and the stored position moves to the end of the log, in one step. A transaction that
//!   committed while this ran is either deleted and skipped, or kept and published; a row the
//!   position passed but the delete did not see is published by the sweep.
//!
//! Each is refused while the shard-partition is being streamed (the PostgreSQL slot is held,
//! or a MariaDB session holds the stream's named lock): stop it first, or let it halt.

use std::process::ExitCode;

use anyhow::{Context, bail};
use outbox_mysql::mysql_async::prelude::Queryable;
use outbox_mysql::mysql_async::{IsolationLevel, TxOpts};

use crate::config::{Config, SourceConfig, SourceKind};
use crate::db::mysql::connect::mysql_opts;
use crate::db::postgres::connect::pg_target;
use crate::names::{StreamId, checkpoint_table};
use crate::skip::SkipList;

/// What to skip.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum What {
    Id(i64),
    Transaction(String),
    Backlog,
}

/// Parses `<source>/<shard>/<partition>` against the configuration.
fn stream<'c>(config: &'c Config, text: &str) -> anyhow::Result<(&'c SourceConfig, StreamId)> {
    let parts: Vec<&str> = text.split('/').collect();
    let [source, shard, partition] = parts[..] else {
        bail!("--stream {text:?}: expected <source>/<shard>/<partition>, for example app/0/0");
    };
    let Some(source) = config.sources.iter().find(|s| s.name == source) else {
        let names: Vec<&str> = config.sources.iter().map(|s| s.name.as_str()).collect();
        bail!("--stream {text:?}: no source named {source:?} in the configuration (sources: {})", names.join(", "));
    };
    let shard: u32 = shard.parse().with_context(|| format!("--stream {text:?}: shard {shard:?} is not a number"))?;
    let partition: u32 =
        partition.parse().with_context(|| format!("--stream {text:?}: partition {partition:?} is not a number"))?;
    if shard >= source.shards || partition >= source.partitions {
        bail!(
            "--stream {text:?}: source {:?} has shards 0..{} and partitions 0..{}",
            source.name,
            source.shards,
            source.partitions
        );
    }
    Ok((source, StreamId { shard, partition }))
}

pub(super) async fn skip(config: &Config, stream_text: &str, what: What) -> anyhow::Result<ExitCode> {
    let (source, id) = stream(config, stream_text)?;
    let message = match source.kind {
        SourceKind::Postgres => postgres(source, id, &what).await?,
        SourceKind::Mysql => mysql(source, id, &what).await?,
    };
    println!("{stream_text}: {message}");
    Ok(ExitCode::SUCCESS)
}

/// Adds `what` to `list`; a row id is bounded by `end`, the log's end now (see `crate::skip`).
fn add(list: &mut SkipList, what: &What, end: &str) {
    match what {
        What::Id(id) => list.add_id(*id, end),
        What::Transaction(label) => list.add_transaction(label),
        What::Backlog => {}
    }
}

fn done_message(what: &What, deleted: u64) -> String {
    match what {
        What::Id(id) if deleted > 0 => format!("row id={id} will not be published; it was deleted from the table"),
        What::Id(id) => format!("row id={id} will not be published (it was not in the table)"),
        What::Transaction(label) => {
            format!("rows without a readable id in transaction {label} will not be published")
        }
        What::Backlog => {
            format!("{deleted} rows discarded; the stream resumes at the end of the log")
        }
    }
}

async fn postgres(source: &SourceConfig, id: StreamId, what: &What) -> anyhow::Result<String> {
    let names = source.stream_names(id);
    let checkpoint = checkpoint_table(&source.table_prefix);
    let target = pg_target(source, None)?;
    let mut client = target.connect().await.with_context(|| format!("connecting to {}", target.display()))?;
    let state = outbox_postgres::slot::state(&client, &names.slot).await?;
    if let Some(pid) = state.active_pid {
        bail!(
            "the stream is running: slot {:?} is held by backend {pid}; stop its streamer (or wait until it halts), then run this again",
            names.slot
        );
    }
    let (table, cp) = (outbox_postgres::setup::ident(&names.table), outbox_postgres::setup::ident(&checkpoint));
    let tx = client.build_transaction().isolation_level(tokio_postgres::IsolationLevel::RepeatableRead).start().await?;
    let row = tx
        .query_opt(
            &format!("SELECT skip_ids, skip_transactions FROM {cp} WHERE stream = $1 FOR UPDATE"),
            &[&names.table],
        )
        .await
        .with_context(|| format!("reading {checkpoint} (run `outbox-streamer setup` if a column is missing)"))?
        .with_context(|| format!("{checkpoint} has no row for {}; run `outbox-streamer setup`", names.table))?;
    let mut list = SkipList::parse(row.get(0), row.get(1)).map_err(anyhow::Error::msg)?;
    let deleted = match what {
        What::Backlog => {
            // The snapshot is taken by this statement, and the WAL position read after it:
            // every transaction the delete sees committed before that position.
            let end: String = tx.query_one("SELECT pg_current_wal_insert_lsn()::text", &[]).await?.get(0);
            let deleted = tx.execute(&format!("DELETE FROM {table}"), &[]).await?;
            tx.execute(
                &format!("UPDATE {cp} SET published_lsn = $2::text::pg_lsn, updated_at = now() WHERE stream = $1"),
                &[&names.table, &end],
            )
            .await?;
            tx.commit().await?;
            client
                .execute(
                    "SELECT pg_replication_slot_advance($1, $2::text::pg_lsn) FROM pg_replication_slots
                     WHERE slot_name = $1 AND confirmed_flush_lsn < $2::text::pg_lsn",
                    &[&names.slot, &end],
                )
                .await
                .with_context(|| format!("moving slot {} to {end}", names.slot))?;
            return Ok(done_message(what, deleted));
        }
        What::Id(row_id) => tx.execute(&format!("DELETE FROM {table} WHERE id = $1"), &[row_id]).await?,
        What::Transaction(_) => 0,
    };
    let end: String = tx.query_one("SELECT pg_current_wal_insert_lsn()::text", &[]).await?.get(0);
    add(&mut list, what, &end);
    tx.execute(
        &format!("UPDATE {cp} SET skip_ids = $2, skip_transactions = $3, updated_at = now() WHERE stream = $1"),
        &[&names.table, &list.ids_text(), &list.transactions_text()],
    )
    .await?;
    tx.commit().await?;
    Ok(done_message(what, deleted))
}

async fn mysql(source: &SourceConfig, id: StreamId, what: &What) -> anyhow::Result<String> {
    let names = source.stream_names(id);
    let checkpoint = checkpoint_table(&source.table_prefix);
    let opts = mysql_opts(source, None)?;
    let database = opts.db_name().unwrap_or_default().to_string();
    let mut conn = crate::db::mysql::connect::mysql_connect(&opts).await?;
    let lock = crate::db::mysql::cdc::stream_lock(&database, &names.table);
    let holder: Option<Option<u64>> = conn.exec_first("SELECT IS_USED_LOCK(?)", (&lock,)).await?;
    if let Some(Some(connection)) = holder {
        bail!(
            "the stream is running: connection {connection} holds its lock {lock:?}; stop its streamer (or wait until it halts), then run this again"
        );
    }
    let (table, cp) = (outbox_mysql::setup::ident(&names.table), outbox_mysql::setup::ident(&checkpoint));
    let mut opts_tx = TxOpts::default();
    opts_tx.with_isolation_level(IsolationLevel::RepeatableRead).with_consistent_snapshot(true);
    let mut tx = conn.start_transaction(opts_tx).await?;
    let row: Option<(Option<String>, Option<String>)> = tx
        .exec_first(
            format!("SELECT skip_ids, skip_transactions FROM {cp} WHERE stream = ? FOR UPDATE"),
            (&names.table,),
        )
        .await
        .with_context(|| format!("reading {checkpoint} (run `outbox-streamer setup` if a column is missing)"))?;
    let Some((ids, transactions)) = row else {
        bail!("{checkpoint} has no row for {}; run `outbox-streamer setup`", names.table);
    };
    let mut list = SkipList::parse(ids.as_deref(), transactions.as_deref()).map_err(anyhow::Error::msg)?;
    let deleted = match what {
        What::Backlog => {
            let version: Option<String> = tx.query_first("SELECT @@version").await?;
            if outbox_mysql::binlog::Flavor::from_version(&version.unwrap_or_default())
                != outbox_mysql::binlog::Flavor::MariaDb
            {
                bail!(
                    "--backlog needs MariaDB's binlog snapshot position, which MySQL does not report; delete the rows and set the checkpoint's gtid to @@gtid_executed by hand while the stream is stopped"
                );
            }
            // The snapshot names the binlog position it corresponds to: the rows it sees are
            // exactly those committed before that position.
            let status: Vec<(String, String)> = tx.query("SHOW STATUS LIKE 'binlog_snapshot_%'").await?;
            let value = |name: &str| status.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.clone());
            let file = value("Binlog_snapshot_file").context("the server reports no binlog snapshot position")?;
            let offset: u64 = value("Binlog_snapshot_position").and_then(|v| v.parse().ok()).unwrap_or(4);
            let ids: Vec<i64> = tx.query(format!("SELECT id FROM {table}")).await?;
            let mut deleted = 0;
            for chunk in ids.chunks(crate::source::DELETE_CHUNK) {
                tx.query_drop(outbox_mysql::cleanup::delete_by_ids(&names.table, chunk)).await?;
                deleted += tx.affected_rows();
            }
            let gtid: Option<Option<String>> = tx.exec_first("SELECT BINLOG_GTID_POS(?, ?)", (&file, offset)).await?;
            tx.exec_drop(
                format!("UPDATE {cp} SET gtid = ?, binlog_file = ?, binlog_pos = ?, done_gtid = NULL WHERE stream = ?"),
                (gtid.flatten(), &file, offset, &names.table),
            )
            .await?;
            tx.commit().await?;
            return Ok(done_message(what, deleted));
        }
        What::Id(row_id) => {
            tx.exec_drop(format!("DELETE FROM {table} WHERE id = ?"), (row_id,)).await?;
            tx.affected_rows()
        }
        What::Transaction(_) => 0,
    };
    let version: Option<String> = tx.query_first("SELECT @@version").await?;
    let mariadb = outbox_mysql::binlog::Flavor::from_version(&version.unwrap_or_default())
        == outbox_mysql::binlog::Flavor::MariaDb;
    let end: Option<String> =
        tx.query_first(if mariadb { "SELECT @@gtid_binlog_pos" } else { "SELECT @@gtid_executed" }).await?;
    add(&mut list, what, &end.unwrap_or_default());
    tx.exec_drop(
        format!("UPDATE {cp} SET skip_ids = ?, skip_transactions = ? WHERE stream = ?"),
        (list.ids_text(), list.transactions_text(), &names.table),
    )
    .await?;
    tx.commit().await?;
    conn.disconnect().await.ok();
    Ok(done_message(what, deleted))
}
