//! `outbox-streamer skip` on MariaDB/MySQL: adds to the stream's skip list (or discards its backlog) in
//! its checkpoint row, refused while the stream is being read (see `crate::cli::skip`).

use anyhow::{Context, bail};
use outbox_mysql::mysql_async::prelude::Queryable;
use outbox_mysql::mysql_async::{IsolationLevel, Transaction, TxOpts};

use super::checkpoint::Checkpoint;
use super::connect::mysql_opts;
use crate::config::SourceConfig;
use crate::names::{StreamId, checkpoint_table};
use crate::skip::{SkipList, What, add, done_message};

pub(super) async fn skip(source: &SourceConfig, id: StreamId, what: &What) -> anyhow::Result<String> {
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
    let table = outbox_mysql::setup::ident(&names.table);
    let layout = source.layout();
    let keyed =
        layout.mapping().is_some() && super::keyed::is_text(&mut conn, &names.table, layout.id_column()).await?;
    // A text key may look like a number: it is the key then.
    let what = &match what {
        What::Id(id) if keyed => What::Key(id.to_string()),
        What::Key(key) if !keyed => bail!(
            "--id {key:?}: {} is identified by the integer {}; give --id the number the halt message names",
            names.table,
            layout.id_column()
        ),
        what => what.clone(),
    };
    let cp = Checkpoint::new(&checkpoint);
    let mut opts_tx = TxOpts::default();
    opts_tx.with_isolation_level(IsolationLevel::RepeatableRead).with_consistent_snapshot(true);
    let mut tx = conn.start_transaction(opts_tx).await?;
    let row: Option<(Option<String>, Option<String>)> = tx
        .exec_first(cp.read_skips(), (&names.table,))
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
            let id = outbox_mysql::setup::ident(layout.id_column());
            let mut deleted = 0;
            if keyed {
                let keys: Vec<String> = tx.query(format!("SELECT {id} FROM {table}")).await?;
                for chunk in keys.chunks(crate::source::DELETE_CHUNK) {
                    tx.exec_drop(
                        super::keyed::delete_sql(&names.table, layout.id_column(), chunk.len()),
                        chunk.to_vec(),
                    )
                    .await?;
                    deleted += tx.affected_rows();
                }
            } else {
                let ids: Vec<i64> = tx.query(format!("SELECT {id} FROM {table}")).await?;
                for chunk in ids.chunks(crate::source::DELETE_CHUNK) {
                    tx.query_drop(outbox_mysql::cleanup::delete_by_ids(&names.table, layout.id_column(), chunk))
                        .await?;
                    deleted += tx.affected_rows();
                }
            }
            let gtid: Option<Option<String>> = tx.exec_first("SELECT BINLOG_GTID_POS(?, ?)", (&file, offset)).await?;
            tx.exec_drop(cp.skip_to(), (gtid.flatten(), &file, offset, &names.table)).await?;
            tx.commit().await?;
            return Ok(done_message(what, deleted));
        }
        What::Key(key) => {
            tx.exec_drop(super::keyed::delete_sql(&names.table, layout.id_column(), 1), (key,)).await?;
            tx.affected_rows()
        }
        What::Id(row_id) => {
            let id = outbox_mysql::setup::ident(layout.id_column());
            tx.exec_drop(format!("DELETE FROM {table} WHERE {id} = ?"), (row_id,)).await?;
            tx.affected_rows()
        }
        What::Transaction(_) => 0,
        What::Message { id, .. } => {
            wal_message_exists(&mut tx, &names.table, *id).await?;
            0
        }
    };
    let version: Option<String> = tx.query_first("SELECT @@version").await?;
    let mariadb = outbox_mysql::binlog::Flavor::from_version(&version.unwrap_or_default())
        == outbox_mysql::binlog::Flavor::MariaDb;
    let end: Option<String> =
        tx.query_first(if mariadb { "SELECT @@gtid_binlog_pos" } else { "SELECT @@gtid_executed" }).await?;
    add(&mut list, what, &end.unwrap_or_default());
    tx.exec_drop(cp.write_skips(), (list.ids_text(), list.transactions_text(), &names.table)).await?;
    tx.commit().await?;
    conn.disconnect().await.ok();
    Ok(done_message(what, deleted))
}

/// Refuses `--message` for a shard-partition whose table is not a BLACKHOLE (`storage =
/// "wal"`) table, and an `outbox-id` whose transaction (GTID sequence × 2^24 + place, see
/// `super::wal`) cannot exist: one the server has not reached yet is a typo.
async fn wal_message_exists(tx: &mut Transaction<'_>, table: &str, id: i64) -> anyhow::Result<()> {
    let engine: Option<String> = tx
        .exec_first(
            "SELECT ENGINE FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?",
            (table,),
        )
        .await?;
    if !engine.is_some_and(|e| e.eq_ignore_ascii_case("BLACKHOLE")) {
        bail!(
            "--message names a WAL-only message, but {table} is not a BLACKHOLE table (storage = \"table\"); skip a row with --id, as its halt message says"
        );
    }
    let executed: Option<String> = tx.query_first("SELECT @@gtid_binlog_pos").await?;
    let newest = executed
        .unwrap_or_default()
        .split(',')
        .filter_map(|gtid| gtid.trim().rsplit('-').next()?.parse::<i64>().ok())
        .max()
        .unwrap_or(0);
    if id < 0 || id >> 24 > newest {
        bail!(
            "--message {id}: no transaction of this server has GTID sequence number {} yet (its newest is {newest}), so no message of {table} has that outbox-id; nothing changed. Use the outbox-id the halt message names",
            id >> 24
        );
    }
    Ok(())
}
