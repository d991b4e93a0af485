//! `--tw-tkms <compression>`: the shard-partition is a tw-tkms table (`layout = "tw-tkms"`)
//! and every message is stored as tw-tkms stores it, compressed so, by the bench's writers.
//! The message is the same as in our own layout (topic, key `b…`/`k…`, a payload of `x`), so
//! runs of both layouts compare directly; encoding it costs the writers, not the streamer.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use anyhow::Context;
use clap::ValueEnum;
use outbox_mysql::mysql_async::prelude::Queryable;
use outbox_mysql::mysql_async::{self, TxOpts};
use outbox_postgres::connect::PgTarget;
use outbox_tw_tkms::{Compression, StoredMessage};
use serde::{Deserialize, Serialize};

use crate::db::{BenchDb, DbKind, my_connect};
use crate::load::{Committed, WriterPlan, ticker};

/// tw-tkms's compression of the stored messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum TkmsCompression {
    None,
    SnappyFramed,
    Snappy,
    Zstd,
    Lz4,
    Gzip,
}

impl TkmsCompression {
    fn of(self) -> Compression {
        match self {
            TkmsCompression::None => Compression::None,
            TkmsCompression::SnappyFramed => Compression::SnappyFramed,
            TkmsCompression::Snappy => Compression::Snappy,
            TkmsCompression::Zstd => Compression::Zstd,
            TkmsCompression::Lz4 => Compression::Lz4,
            TkmsCompression::Gzip => Compression::Gzip,
        }
    }

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            TkmsCompression::None => "none",
            TkmsCompression::SnappyFramed => "snappy-framed",
            TkmsCompression::Snappy => "snappy",
            TkmsCompression::Zstd => "zstd",
            TkmsCompression::Lz4 => "lz4",
            TkmsCompression::Gzip => "gzip",
        }
    }
}

/// The stored `message` of one bench message.
fn message(c: TkmsCompression, topic: &str, key: &[u8], payload: &[u8]) -> Vec<u8> {
    let m = StoredMessage {
        topic: topic.to_string(),
        partition: None,
        key: Some(String::from_utf8_lossy(key).into_owned()),
        timestamp_ms: None,
        value: payload.to_vec(),
        headers: Vec::new(),
        insert_timestamp_ms: Some(
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64),
        ),
    };
    outbox_tw_tkms::encode(&m, c.of())
}

/// Creates the tables as tw-tkms documents them, before `setup` checks them.
pub(super) async fn create_tables(db: &BenchDb, tables: &[String]) -> anyhow::Result<()> {
    for table in tables {
        match db.kind {
            DbKind::Postgres => {
                let c = PgTarget::from_url(&db.admin_url, None)?.connect().await?;
                let t = outbox_postgres::setup::ident(table);
                c.batch_execute(&format!("CREATE TABLE {t} (id BIGSERIAL PRIMARY KEY, message BYTEA NOT NULL)"))
                    .await?;
            }
            DbKind::Mariadb => {
                let mut c = my_connect(&db.admin_url).await?;
                let t = outbox_mysql::setup::ident(table);
                c.query_drop(format!(
                    "CREATE TABLE {t} (id BIGINT AUTO_INCREMENT PRIMARY KEY, message MEDIUMBLOB NOT NULL) ENGINE=InnoDB"
                ))
                .await?;
                c.disconnect().await?;
            }
        }
    }
    Ok(())
}

/// A session inserting stored messages, one transaction per call.
enum Inserter {
    Postgres(tokio_postgres::Client, tokio_postgres::Statement),
    Mariadb(mysql_async::Conn, String),
}

impl Inserter {
    async fn open(db: &BenchDb, table: &str) -> anyhow::Result<Self> {
        Ok(match db.kind {
            DbKind::Postgres => {
                let c = PgTarget::from_url(&db.admin_url, None)?.connect().await?;
                let sql = format!(
                    "INSERT INTO {} (message) SELECT m FROM unnest($1::bytea[]) WITH ORDINALITY AS u(m, o) ORDER BY o RETURNING id",
                    outbox_postgres::setup::ident(table)
                );
                let insert = c.prepare(&sql).await?;
                Inserter::Postgres(c, insert)
            }
            DbKind::Mariadb => Inserter::Mariadb(my_connect(&db.admin_url).await?, table.to_string()),
        })
    }

    /// Inserts `messages` in one transaction; their ids.
    async fn insert(&mut self, messages: Vec<Vec<u8>>) -> anyhow::Result<Vec<i64>> {
        match self {
            Inserter::Postgres(c, insert) => {
                Ok(c.query(&*insert, &[&messages]).await?.iter().map(|r| r.get::<_, i64>(0)).collect())
            }
            Inserter::Mariadb(c, table) => {
                let n = messages.len() as i64;
                let values = vec!["(?)"; messages.len()].join(",");
                let sql = format!("INSERT INTO {} (message) VALUES {values}", outbox_mysql::setup::ident(table));
                let mut tx = c.start_transaction(TxOpts::default()).await?;
                let params: Vec<mysql_async::Value> = messages.into_iter().map(Into::into).collect();
                tx.exec_drop(sql, params).await?;
                let first = tx.last_insert_id().context("no LAST_INSERT_ID after INSERT")? as i64;
                tx.commit().await?;
                Ok((first..first + n).collect())
            }
        }
    }
}

/// A backlog of `rows` messages (keys `b0`…`b15`), in transactions of 1,000.
pub(super) async fn insert_backlog(
    db: &BenchDb,
    c: TkmsCompression,
    (table, topic): (&str, &str),
    rows: usize,
    payload: &[u8],
    progress: &AtomicUsize,
) -> anyhow::Result<Committed> {
    let mut inserter = Inserter::open(db, table).await?;
    let mut committed = Vec::with_capacity(rows);
    let mut done = 0;
    while done < rows {
        let n = (rows - done).min(1000);
        let messages =
            (done..done + n).map(|g| message(c, topic, format!("b{}", g % 16).as_bytes(), payload)).collect();
        let ids = inserter.insert(messages).await?;
        let at = Instant::now();
        committed.extend(ids.into_iter().map(|id| (id, at)));
        done += n;
        progress.fetch_add(n, Ordering::Relaxed);
    }
    Ok(committed)
}

/// One message outside any measurement (the warm-up).
pub(super) async fn insert_one(
    db: &BenchDb,
    c: TkmsCompression,
    table: &str,
    topic: &str,
    key: &str,
) -> anyhow::Result<()> {
    Inserter::open(db, table).await?.insert(vec![message(c, topic, key.as_bytes(), b"warm-up")]).await?;
    Ok(())
}

/// One writer of the plan, storing tw-tkms messages.
pub(super) async fn run_writer(
    db: &BenchDb,
    c: TkmsCompression,
    plan: WriterPlan,
    progress: Arc<AtomicUsize>,
) -> anyhow::Result<Committed> {
    let mut inserter = Inserter::open(db, &plan.table).await?;
    let payload = plan.payload.clone();
    let mut committed = Vec::new();
    let mut ticker = ticker(&plan);
    let end = Instant::now() + plan.duration;
    let mut n = 0usize;
    while Instant::now() < end {
        if let Some(t) = ticker.as_mut() {
            t.tick().await;
        }
        let messages = (0..plan.rows_per_txn).map(|i| message(c, &plan.topic, &plan.key(n, i), &payload)).collect();
        n += plan.rows_per_txn;
        let ids = inserter.insert(messages).await?;
        let at = Instant::now();
        progress.fetch_add(ids.len(), Ordering::Relaxed);
        committed.extend(ids.into_iter().map(|id| (id, at)));
    }
    Ok(committed)
}
