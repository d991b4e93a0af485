//! The MySQL/MariaDB CDC source: one table's binlog rows turned into outbox records.
//!
//! # Positions
//!
//! The stored position is the GTID position after a transaction (a MariaDB GTID state or a
//! MySQL GTID set) plus its binlog file and offset, in `<prefix>_checkpoint`; with `gtid` NULL
//! the stream resumes by file and offset instead (see `outbox_mysql::gtid::Position`). For each fully acknowledged prefix, ONE database
//! transaction deletes the rows and stores the position, guarded by the owner epoch:
//! `UPDATE … WHERE stream = ? AND owner_epoch <= ?` matching no row means another owner with a
//! newer epoch took the stream, and this one stops.
//!
//! # Columns
//!
//! Values are matched by column name (`binlog_row_metadata=FULL`), so added columns are
//! ignored; a missing required column halts this shard-partition naming the column.

use std::time::{Duration, Instant};

use outbox_mysql::binlog::{BinlogChange, BinlogError, BinlogReader, BinlogTarget, Cell, Flavor, Position};
use outbox_mysql::mysql_async::prelude::Queryable;
use outbox_mysql::mysql_async::{Conn, IsolationLevel, Opts, OptsBuilder, TxOpts};
use outbox_mysql::setup::ident;

use crate::names::StreamNames;
use crate::record::{InvalidRow, OutboxRecord, headers_value, partition_value, topic_value};
use crate::source::{DELETE_CHUNK, Source, SourceError, SourceEvent, within};

/// An idle stream stores its position at most this often: every store is itself a binlog
/// transaction, which must not keep the stream busy.
const IDLE_STORE_INTERVAL: Duration = Duration::from_secs(5);

/// A replica `server_id` derived from the stream's database and table (FNV-1a), in a range
/// servers rarely use. Two readers of one stream share it, and the server keeps only the newer.
pub fn server_id_for(database: &str, table: &str) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in database.bytes().chain([b'.']).chain(table.bytes()) {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    0x4000_0000 | (h & 0x3fff_ffff)
}

/// A checkpoint row: gtid, binlog_file, binlog_pos, owner_epoch.
type StoredCheckpoint = (Option<String>, Option<String>, Option<u64>, i64, bool);

/// One shard-partition's binlog session plus an SQL session for deletes and checkpoints.
#[derive(Debug)]
pub struct MySource {
    reader: BinlogReader,
    sql: Conn,
    table: String,
    checkpoint_table: String,
    epoch: i64,
    last_stored: Instant,
    metric_labels: [(&'static str, String); 3],
}

impl MySource {
    /// Reads the stored position and starts the binlog after it.
    pub async fn connect(
        labels: &crate::streamer::StreamLabels,
        opts: &Opts,
        names: &StreamNames,
        checkpoint_table: &str,
        epoch: i64,
        heartbeat: Duration,
    ) -> Result<Self, SourceError> {
        let sql_opts: Opts = OptsBuilder::from_opts(opts.clone()).client_found_rows(true).into();
        let mut sql = Conn::new(sql_opts).await.map_err(|e| SourceError::from_db("connecting to MySQL/MariaDB", &e))?;
        let version: Option<String> = sql
            .query_first("SELECT @@version")
            .await
            .map_err(|e| SourceError::from_db("reading the server version", &e))?;
        let flavor = Flavor::from_version(&version.unwrap_or_default());
        let row: Option<StoredCheckpoint> = sql
            .exec_first(
                format!(
                    "SELECT gtid, binlog_file, binlog_pos, owner_epoch, catchup_pending FROM {} WHERE stream = ?",
                    ident(checkpoint_table)
                ),
                (&names.table,),
            )
            .await
            .map_err(|e| SourceError::from_db(&format!("reading {checkpoint_table}"), &e))?;
        let Some((gtid, file, offset, stored_epoch, pending)) = row else {
            return Err(SourceError::Definite {
                message: format!("no checkpoint for {} in {checkpoint_table}", names.table),
                fix: "run `outbox-streamer setup`".into(),
            });
        };
        if stored_epoch > epoch {
            return Err(fenced(&names.table, epoch));
        }
        if stored_epoch < epoch {
            // Claim the stream: from here on the previous owner's guarded writes match no row.
            let claim =
                format!("UPDATE {} SET owner_epoch = ? WHERE stream = ? AND owner_epoch <= ?", ident(checkpoint_table));
            sql.exec_drop(claim, (epoch, &names.table, epoch))
                .await
                .map_err(|e| SourceError::from_db("claiming the checkpoint", &e))?;
            if sql.affected_rows() == 0 {
                return Err(fenced(&names.table, epoch));
            }
        }
        if pending {
            return Err(SourceError::PositionLost(format!(
                "a catch-up of {} is pending (interrupted, or the stream ran in polling mode)",
                names.table
            )));
        }
        let position = Position::from_stored(
            flavor,
            gtid.as_deref(),
            file.as_deref().unwrap_or_default(),
            offset.unwrap_or_default(),
        )
        .map_err(|e| SourceError::Definite {
            message: format!("the checkpoint of {} in {checkpoint_table} is unusable: {e}", names.table),
            fix: match flavor {
                Flavor::MariaDb => format!(
                    "set {checkpoint_table}.gtid to a MariaDB GTID position such as 0-1-42 (SELECT BINLOG_GTID_POS(file, offset) converts a file offset), or set gtid to NULL with binlog_file and binlog_pos"
                ),
                Flavor::MySql => format!(
                    "set {checkpoint_table}.gtid to a MySQL GTID set such as <server_uuid>:1-42, or set gtid to NULL with binlog_file and binlog_pos"
                ),
            },
        })?;
        let database = opts.db_name().unwrap_or_default().to_string();
        let target = BinlogTarget {
            opts: opts.clone(),
            flavor,
            server_id: server_id_for(&database, &names.table),
            database,
            table: names.table.clone(),
            heartbeat,
        };
        let reader = BinlogReader::start(target, position).await.map_err(binlog_error)?;
        Ok(Self {
            reader,
            sql,
            table: names.table.clone(),
            checkpoint_table: checkpoint_table.to_string(),
            epoch,
            last_stored: Instant::now(),
            metric_labels: [
                ("source", labels.source.clone()),
                ("shard", labels.id.shard.to_string()),
                ("partition", labels.id.partition.to_string()),
            ],
        })
    }
}

/// This instance no longer owns `table`: a newer owner epoch is stored.
pub(crate) fn fenced(table: &str, epoch: i64) -> SourceError {
    SourceError::Fenced(format!(
        "the checkpoint of {table} carries a newer owner epoch than this instance's ({epoch}): another instance owns it"
    ))
}

fn binlog_error(e: BinlogError) -> SourceError {
    match e {
        BinlogError::Purged(position) => {
            SourceError::PositionLost(format!("the stored binlog position {position} was purged from the server"))
        }
        BinlogError::Malformed(m) => SourceError::Definite {
            message: format!("malformed binlog event: {m}"),
            fix: "check binlog_format=ROW and log_bin_compress=OFF; report it with the server version".into(),
        },
        other => crate::dberror::source_error("reading the binlog", &other, crate::dberror::Channel::Replication),
    }
}

/// Builds the record of one inserted row from its values by name. The outer error is a
/// missing column (the stream cannot go on); the inner one a bad row.
pub fn record(values: &[(String, Cell)]) -> Result<Result<OutboxRecord, InvalidRow>, SourceError> {
    let mut cells: [&Cell; 7] = [&Cell::Null; 7];
    for (slot, name) in COLUMNS.iter().enumerate() {
        cells[slot] = values.iter().find(|(n, _)| n == name).map(|(_, c)| c).ok_or_else(|| SourceError::Definite {
            message: format!(
                "rows of the outbox table carry no column {name:?} (dropped, renamed, or binlog_row_metadata is not FULL)"
            ),
            fix: format!("restore {name} as `outbox-streamer setup --dry-run` shows, and set binlog_row_metadata=FULL"),
        })?;
    }
    Ok(checked_record(&cells))
}

/// The columns [`record`] reads, in the order `checked_record` takes them.
const COLUMNS: [&str; 7] = ["id", "topic", "msg_key", "payload", "headers", "kafka_partition", "created_at"];

fn checked_record(cells: &[&Cell; 7]) -> Result<OutboxRecord, InvalidRow> {
    let id = match cells[0] {
        Cell::Int(i) => *i,
        other => return Err(InvalidRow { id: None, column: "id", reason: format!("is not an integer: {other:?}") }),
    };
    let bytes = |slot: usize| match cells[slot] {
        Cell::Null => Ok(None),
        Cell::Bytes(b) => Ok(Some(b.as_slice())),
        other => Err(InvalidRow {
            id: Some(id),
            column: COLUMNS[slot],
            reason: format!("has an unexpected type: {other:?}"),
        }),
    };
    let partition = match cells[5] {
        Cell::Null => None,
        Cell::Int(p) => Some(*p),
        other => {
            return Err(InvalidRow {
                id: Some(id),
                column: "kafka_partition",
                reason: format!("{other:?} is not a partition number (0 or more)"),
            });
        }
    };
    Ok(OutboxRecord {
        id,
        topic: topic_value(id, bytes(1)?)?,
        key: bytes(2)?.map(<[u8]>::to_vec),
        payload: bytes(3)?.map(<[u8]>::to_vec),
        headers: headers_value(id, bytes(4)?)?,
        kafka_partition: partition_value(id, partition)?,
        created_at_micros: match cells[6] {
            Cell::Micros(m) => Some(*m),
            _ => None,
        },
    })
}

/// `1,2,3` for an SQL `IN` list.
pub(crate) fn id_list(ids: &[i64]) -> String {
    ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",")
}

impl Source for MySource {
    type Position = Position;
    const POSITION_HEADER: &'static str = "outbox-gtid";

    async fn next(&mut self) -> Result<Option<SourceEvent<Position>>, SourceError> {
        let change = self.reader.next().await.map_err(binlog_error)?;
        metrics::gauge!(crate::metrics::BINLOG_LAG_SECONDS, &self.metric_labels).set(self.reader.lag_seconds());
        Ok(Some(match change {
            BinlogChange::Begin { txn } => SourceEvent::Begin { label: txn.to_string() },
            BinlogChange::Insert { values } => SourceEvent::Row(record(&values)?),
            BinlogChange::Commit { position } => SourceEvent::Commit(position),
        }))
    }

    async fn existing(&mut self, ids: &[i64]) -> Result<Vec<i64>, SourceError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let sql = format!("SELECT id FROM {} WHERE id IN ({}) ORDER BY id", ident(&self.table), id_list(ids));
        within("checking replayed rows", self.sql.query(sql)).await
    }

    async fn finish(&mut self, ids: Vec<i64>, upto: Position) -> Result<u64, SourceError> {
        if ids.is_empty() && self.last_stored.elapsed() < IDLE_STORE_INTERVAL {
            return Ok(0);
        }
        // READ COMMITTED: InnoDB then locks only the rows deleted, no gaps, so the cleanup can
        // never deadlock with the application's inserts into the same table (under the default
        // REPEATABLE READ it can, and InnoDB may pick the application's transaction as victim).
        let mut opts = TxOpts::default();
        opts.with_isolation_level(IsolationLevel::ReadCommitted);
        let mut tx = within("starting the cleanup transaction", self.sql.start_transaction(opts)).await?;
        let mut deleted = 0;
        for chunk in ids.chunks(DELETE_CHUNK) {
            within("deleting published rows", tx.query_drop(outbox_mysql::cleanup::delete_by_ids(&self.table, chunk)))
                .await?;
            deleted += tx.affected_rows();
        }
        let update = format!(
            "UPDATE {} SET gtid = ?, binlog_file = ?, binlog_pos = ?, owner_epoch = ? WHERE stream = ? AND owner_epoch <= ?",
            ident(&self.checkpoint_table)
        );
        let params = (upto.gtid_text(), upto.file(), upto.offset(), self.epoch, &self.table, self.epoch);
        within("storing the position", tx.exec_drop(update, params)).await?;
        if tx.affected_rows() == 0 {
            let _ = tx.rollback().await;
            return Err(fenced(&self.table, self.epoch));
        }
        within("committing delete and position", tx.commit()).await?;
        self.last_stored = Instant::now();
        Ok(deleted)
    }

    fn confirm_idle(&mut self, _position: Position) {
        // The binlog is kept by the server's own retention, not by readers: nothing to confirm.
    }

    async fn close(self) {
        self.reader.close().await;
        let _ = self.sql.disconnect().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(topic: Cell) -> Vec<(String, Cell)> {
        vec![
            ("id".into(), Cell::Int(3)),
            ("topic".into(), topic),
            ("msg_key".into(), Cell::Bytes(b"k".to_vec())),
            ("payload".into(), Cell::Null),
            ("headers".into(), Cell::Bytes(br#"{"a":"b"}"#.to_vec())),
            ("kafka_partition".into(), Cell::Null),
            ("created_at".into(), Cell::Micros(5)),
            ("extra".into(), Cell::Int(1)),
        ]
    }

    #[test]
    fn maps_by_name() {
        let r = record(&row(Cell::Bytes(b"orders".to_vec()))).unwrap().unwrap();
        assert_eq!((r.id, r.topic.as_str(), r.key.as_deref()), (3, "orders", Some(&b"k"[..])));
        assert_eq!(r.payload, None);
        assert_eq!(r.headers, vec![("a".into(), b"b".to_vec())]);
        assert_eq!(r.created_at_micros, Some(5));
    }

    #[test]
    fn null_topic_is_a_bad_row_and_a_missing_column_halts() {
        let e = record(&row(Cell::Null)).unwrap().unwrap_err();
        assert_eq!((e.id, e.column), (Some(3), "topic"));
        let mut r = row(Cell::Bytes(b"t".to_vec()));
        r.retain(|(n, _)| n != "payload");
        assert!(record(&r).unwrap_err().to_string().contains("\"payload\""));
    }

    #[test]
    fn server_ids_are_stable_and_spread() {
        assert_eq!(server_id_for("app", "outbox_0_0"), server_id_for("app", "outbox_0_0"));
        assert_ne!(server_id_for("app", "outbox_0_0"), server_id_for("app", "outbox_0_1"));
        assert!(server_id_for("a", "b") >= 0x4000_0000);
    }
}
