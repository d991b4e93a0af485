//! The PostgreSQL CDC source: one slot's pgoutput stream turned into outbox records.
//!
//! # Positions
//!
//! A transaction's position is its commit *end* LSN: confirming it tells the server every
//! change before it was handled, so a restart resumes with the next transaction. Records are
//! stamped with the commit LSN (`outbox-lsn`), known from `Begin` before the first insert.
//!
//! # Columns
//!
//! Columns are found by name in each Relation message, so `ALTER TABLE … ADD COLUMN` while
//! running keeps working; a required column dropped or retyped halts this shard-partition
//! with an error naming the column.

mod visibility;

use std::time::Duration;

use outbox_postgres::connect::PgTarget;
use outbox_postgres::pgoutput::{Relation, Value, oid};
use outbox_postgres::stream::{Change, ReplicationStream, StreamError};
use outbox_postgres::{Lsn, cleanup, slot, values};
use tokio_postgres::Client;

use crate::lease::OwnerLease;
use crate::names::StreamNames;
use crate::record::{InvalidRow, OutboxRecord, headers_value, partition_value, topic_value};
use crate::source::{DELETE_CHUNK, Source, SourceError, SourceEvent, within};

/// A required column and the types it may have.
const COLUMNS: [(&str, &[u32]); 7] = [
    ("id", &[oid::INT8]),
    ("topic", &[oid::TEXT, oid::VARCHAR]),
    ("msg_key", &[oid::BYTEA]),
    ("payload", &[oid::BYTEA]),
    ("headers", &[oid::JSONB, oid::JSON]),
    ("kafka_partition", &[oid::INT4, oid::INT2]),
    ("created_at", &[oid::TIMESTAMPTZ]),
];

/// Where each required column sits in the relation's tuples.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColumnMap {
    relation_id: u32,
    index: [usize; 7],
    /// Each required column's type, which decides how a binary value is read.
    types: [u32; 7],
}

impl ColumnMap {
    /// Checks a Relation message against the required columns.
    pub fn new(rel: &Relation) -> Result<Self, SourceError> {
        let mut index = [0; 7];
        let mut found = [0; 7];
        for (slot, (name, types)) in COLUMNS.iter().enumerate() {
            let Some(pos) = rel.columns.iter().position(|c| c.name == *name) else {
                return Err(SourceError::Definite {
                    message: format!("table {} has no column {name:?} (dropped or renamed?)", rel.name),
                    fix: format!(
                        "restore the column as created by `outbox-streamer setup` (ALTER TABLE {} ADD COLUMN {name} …), then restart",
                        rel.name
                    ),
                });
            };
            let type_oid = rel.columns[pos].type_oid;
            if !types.contains(&type_oid) {
                return Err(SourceError::Definite {
                    message: format!(
                        "column {}.{name} has type oid {type_oid}, which the streamer cannot read",
                        rel.name
                    ),
                    fix: format!(
                        "change {name} back to the type `outbox-streamer setup --dry-run` shows, then restart"
                    ),
                });
            }
            index[slot] = pos;
            found[slot] = type_oid;
        }
        Ok(Self { relation_id: rel.id, index, types: found })
    }

    /// Builds the record of one inserted tuple; a bad value names the row and column. Values
    /// come in text or binary format (see [`PgSource::connect`]); both read the same.
    pub fn record(&self, values: &[Value]) -> Result<OutboxRecord, InvalidRow> {
        let value = |slot: usize| values.get(self.index[slot]);
        let bad =
            |id: Option<i64>, column: &'static str, reason: &str| InvalidRow { id, column, reason: reason.into() };
        let int = |slot: usize| -> Result<Option<i64>, &'static str> {
            match value(slot) {
                Some(Value::Text(t)) => values::int(t).map(Some),
                Some(Value::Binary(b)) => values::binary_int(b).map(Some),
                _ => Ok(None),
            }
        };
        let bytea = |slot: usize| -> Result<Option<Vec<u8>>, &'static str> {
            match value(slot) {
                Some(Value::Text(t)) => values::bytea(t).map(Some),
                Some(Value::Binary(b)) => Ok(Some(b.to_vec())),
                _ => Ok(None),
            }
        };
        // text, varchar and json are their own binary format; jsonb has a version byte.
        let text = |slot: usize| -> Result<Option<&[u8]>, &'static str> {
            match value(slot) {
                Some(Value::Text(t)) => Ok(Some(t)),
                Some(Value::Binary(b)) if self.types[slot] == oid::JSONB => values::binary_jsonb(b).map(Some),
                Some(Value::Binary(b)) => Ok(Some(b)),
                _ => Ok(None),
            }
        };
        let id = int(0).map_err(|e| bad(None, "id", e))?.ok_or_else(|| bad(None, "id", "is NULL"))?;
        let id_some = Some(id);
        let topic = topic_value(id, text(1).map_err(|e| bad(id_some, "topic", e))?)?;
        let key = bytea(2).map_err(|e| bad(id_some, "msg_key", e))?;
        let payload = bytea(3).map_err(|e| bad(id_some, "payload", e))?;
        let headers = headers_value(id, text(4).map_err(|e| bad(id_some, "headers", e))?)?;
        let partition = int(5).map_err(|e| bad(id_some, "kafka_partition", e))?;
        let kafka_partition = partition_value(id, partition)?;
        let created_at_micros = match value(6) {
            Some(Value::Text(t)) => values::timestamptz_micros(t).ok(),
            Some(Value::Binary(b)) => values::binary_timestamptz_micros(b).ok(),
            _ => None,
        };
        Ok(OutboxRecord { id, topic, key, payload, headers, kafka_partition, created_at_micros })
    }
}

/// One shard-partition's logical replication session plus an SQL session for deletes.
#[derive(Debug)]
pub struct PgSource {
    stream: ReplicationStream,
    sql: Client,
    names: StreamNames,
    columns: Option<ColumnMap>,
    /// With a heartbeat configured the server speaks at least that often, so a replication
    /// link silent for this long is presumed dead. Without one, an idle server may rightly be
    /// silent for ever, and the server's `wal_sender_timeout` is the only deadline.
    silence_limit: Option<Duration>,
    /// Counted from the last message, not per call: `next` is cancelled and called again.
    last_heard: tokio::time::Instant,
    /// Transactions read and not yet confirmed: (xid, commit LSN). See [`visibility`].
    xids: std::collections::VecDeque<(u32, Lsn)>,
    deleter: cleanup::RowDeleter,
}

impl PgSource {
    /// Opens the SQL session and starts streaming from the slot's confirmed position.
    pub async fn connect(
        target: &PgTarget,
        names: &StreamNames,
        checkpoint_table: &str,
        status_interval: Duration,
        silence_limit: Option<Duration>,
        lease: &OwnerLease,
    ) -> Result<Self, SourceError> {
        let sql = target
            .connect()
            .await
            .map_err(|e| SourceError::from_db(&format!("connecting to {}", target.display()), &e))?;
        let pending = crate::catchup::postgres::pending(&sql, checkpoint_table, &names.table).await?;
        if pending {
            return Err(SourceError::PositionLost(format!(
                "a catch-up of {} is pending (interrupted, or the stream ran in polling mode)",
                names.table
            )));
        }
        let state = slot::state(&sql, &names.slot)
            .await
            .map_err(|e| SourceError::from_db(&format!("reading slot {}", names.slot), &e))?;
        if let Some(database) = &state.other_database {
            return Err(crate::dberror::slot_elsewhere(&names.slot, database));
        }
        if !state.exists {
            return Err(SourceError::PositionLost(format!(
                "replication slot {:?} does not exist in {} (dropped?)",
                names.slot,
                target.display()
            )));
        }
        if state.wal_status.as_deref() == Some("lost") {
            return Err(SourceError::PositionLost(format!(
                "replication slot {:?} was invalidated (wal_status=lost): the WAL it needed is gone",
                names.slot
            )));
        }
        if state.active_pid.is_some() {
            take_slot_from_dead_owner(&sql, &names.slot, lease).await?;
        }
        // pgoutput's binary option exists from PostgreSQL 14 on.
        let binary = sql
            .query_one("SELECT current_setting('server_version_num')::int >= 140000", &[])
            .await
            .map_err(|e| SourceError::from_db("reading the server version", &e))?
            .get::<_, bool>(0);
        let cfg = target.replication(&names.slot, &names.publication, status_interval, binary);
        let stream = ReplicationStream::start(cfg).await.map_err(|e| stream_error(&names.slot, e))?;
        Ok(Self {
            stream,
            sql,
            names: names.clone(),
            columns: None,
            silence_limit,
            last_heard: tokio::time::Instant::now(),
            xids: std::collections::VecDeque::new(),
            deleter: cleanup::RowDeleter::new(&names.table),
        })
    }
}

/// The slot is held by another session. Under ZooKeeper ownership this instance holds the
/// lease; if the holder is an instance that is no longer a live member (killed, paused past
/// its session, cut off), its backend would keep the slot until `wal_sender_timeout`, so it
/// is terminated. A live member's session (a previous owner still closing) or a session that
/// is not a coordinated streamer's is never touched: the caller retries.
async fn take_slot_from_dead_owner(sql: &Client, slot_name: &str, lease: &OwnerLease) -> Result<(), SourceError> {
    let Some(me) = lease.instance() else { return Ok(()) };
    let holder = slot::holder(sql, slot_name).await.map_err(|e| SourceError::from_db("reading the slot holder", &e))?;
    let Some(holder) = holder else { return Ok(()) };
    let Some(owner) = outbox_postgres::connect::instance_of(&holder.application_name) else {
        return Err(SourceError::Busy(format!(
            "slot {slot_name:?} is held by backend {} ({:?}), which is not a coordinated outbox-streamer; it is left alone",
            holder.pid, holder.application_name
        )));
    };
    if owner == me || lease.is_live_member(owner) {
        return Err(SourceError::Busy(format!(
            "slot {slot_name:?} is still held by live instance {owner:?} (backend {})",
            holder.pid
        )));
    }
    tracing::warn!(slot = %slot_name, pid = holder.pid, previous_owner = %owner, "the slot is held by an instance that is no longer a member; terminating its backend");
    slot::terminate(sql, holder.pid)
        .await
        .map_err(|e| SourceError::from_db("terminating the stale slot holder", &e))?;
    Err(SourceError::Busy(format!("slot {slot_name:?}: terminated the backend of departed instance {owner:?}")))
}

fn stream_error(slot: &str, e: StreamError) -> SourceError {
    if e.slot_in_use() {
        SourceError::Busy(format!("slot {slot:?} is in use by another session (another streamer owns it?): {e}"))
    } else if e.slot_missing() {
        SourceError::PositionLost(format!("replication slot {slot:?} does not exist (dropped?)"))
    } else if e.slot_invalidated() {
        SourceError::PositionLost(format!("replication slot {slot:?} can no longer stream: {e}"))
    } else {
        match e {
            StreamError::Decode(_) | StreamError::UnknownRelation(_) => SourceError::Definite {
                message: format!("slot {slot:?}: {e}"),
                fix: "report this as a bug with the PostgreSQL version; restarting replays from the slot".into(),
            },
            other => {
                crate::dberror::source_error(&format!("slot {slot:?}"), &other, crate::dberror::Channel::Replication)
            }
        }
    }
}

impl Source for PgSource {
    type Position = Lsn;
    const POSITION_HEADER: &'static str = "outbox-lsn";

    async fn next(&mut self) -> Result<Option<SourceEvent<Lsn>>, SourceError> {
        loop {
            let next = self.stream.next();
            let received = match self.silence_limit {
                Some(limit) => match tokio::time::timeout_at(self.last_heard + limit, next).await {
                    Ok(r) => r,
                    Err(_) => {
                        return Err(SourceError::Transient(format!(
                            "slot {:?}: nothing heard for {limit:?} although a heartbeat is configured; the connection is presumed dead",
                            self.names.slot
                        )));
                    }
                },
                None => next.await,
            };
            self.last_heard = tokio::time::Instant::now();
            let change = match received {
                Ok(Some(c)) => c,
                Ok(None) => return Ok(None),
                Err(e) => return Err(stream_error(&self.names.slot, e)),
            };
            let event = match change {
                Change::Begin { final_lsn, xid } => {
                    self.xids.push_back((xid, final_lsn));
                    SourceEvent::Begin { label: final_lsn.to_string() }
                }
                Change::Relation(rel) => {
                    if rel.name == self.names.table {
                        self.columns = Some(ColumnMap::new(&rel)?);
                    }
                    continue;
                }
                Change::Insert { relation, values } => {
                    let map = match &self.columns {
                        Some(m) if m.relation_id == relation.id => m,
                        _ => {
                            tracing::warn!(table = %relation.name, "insert into a table outside this stream's publication; ignored");
                            continue;
                        }
                    };
                    SourceEvent::Row(map.record(&values))
                }
                Change::Commit { end_lsn, .. } => SourceEvent::Commit(end_lsn),
                Change::KeepAlive { wal_end } => SourceEvent::Idle(wal_end),
                // A logical message (our heartbeat or anyone's) is a point in the stream: when
                // nothing is in flight, everything before it has been handled.
                Change::Message { lsn, .. } => SourceEvent::Idle(lsn),
                Change::Unexpected { tag } => {
                    tracing::warn!(
                        %tag,
                        publication = %self.names.publication,
                        "an update, delete or truncate reached the stream; the publication should be publish = 'insert'"
                    );
                    continue;
                }
            };
            return Ok(Some(event));
        }
    }

    async fn existing(&mut self, ids: &[i64]) -> Result<Vec<i64>, SourceError> {
        let found = within("checking replayed rows", cleanup::existing_ids(&self.sql, &self.names.table, ids)).await?;
        if found.len() == ids.len() {
            return Ok(found);
        }
        // A missing row is usually one published and deleted before the restart, but it may
        // belong to the transaction being read, committed yet not visible: ask again once
        // that transaction is visible, or the row would be skipped and never published.
        let Some(&(xid, _)) = self.xids.back() else { return Ok(found) };
        visibility::wait(&self.sql, &[xid]).await?;
        within("checking replayed rows", cleanup::existing_ids(&self.sql, &self.names.table, ids)).await
    }

    async fn finish(&mut self, ids: Vec<i64>, upto: Lsn) -> Result<u64, SourceError> {
        let what = format!("deleting published rows from {}", self.names.table);
        let mut deleted = 0;
        for chunk in ids.chunks(DELETE_CHUNK) {
            deleted += within(&what, self.deleter.delete(&self.sql, chunk)).await?;
        }
        let covered: Vec<u32> = self.xids.iter().take_while(|(_, lsn)| *lsn < upto).map(|(x, _)| *x).collect();
        if (deleted as usize) < ids.len() {
            // Rows of a transaction committed but not yet visible are not deleted: wait until
            // it is, then delete again (rows already gone are simply not counted).
            visibility::wait(&self.sql, &covered).await?;
            for chunk in ids.chunks(DELETE_CHUNK) {
                deleted += within(&what, self.deleter.delete(&self.sql, chunk)).await?;
            }
            if (deleted as usize) < ids.len() {
                tracing::debug!(
                    published = ids.len(),
                    deleted,
                    "some published rows were already gone (deleted by someone else)"
                );
            }
        }
        self.xids.drain(..covered.len());
        // Only now, with the delete committed, may the slot forget these transactions.
        self.stream.confirm(upto);
        Ok(deleted)
    }

    fn confirm_idle(&mut self, position: Lsn) {
        self.xids.retain(|(_, lsn)| *lsn >= position);
        self.stream.confirm(position);
    }

    async fn close(self) {
        let confirmed = self.stream.confirmed();
        self.stream.shutdown().await;
        if confirmed.as_u64() == 0 {
            return;
        }
        // The replication protocol has no final status on CopyDone; record the position now
        // so a restart does not replay what was already confirmed. The walsender may hold the
        // slot for a moment after the session closed.
        for _ in 0..50 {
            match slot::advance(&self.sql, &self.names.slot, confirmed).await {
                Ok(()) => return,
                Err(e) if e.to_string().contains("is active for PID") => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "could not advance the slot on close; the server replays from its last status");
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use outbox_postgres::pgoutput::Column;

    fn relation() -> Relation {
        let col = |name: &str, type_oid| Column { name: name.into(), type_oid };
        Relation {
            id: 1,
            namespace: "public".into(),
            name: "outbox_0_0".into(),
            columns: vec![
                col("id", oid::INT8),
                col("topic", oid::TEXT),
                col("msg_key", oid::BYTEA),
                col("payload", oid::BYTEA),
                col("headers", oid::JSONB),
                col("kafka_partition", oid::INT4),
                col("created_at", oid::TIMESTAMPTZ),
                col("added_later", oid::TEXT),
            ],
        }
    }

    fn t(s: &str) -> Value {
        Value::Text(Bytes::copy_from_slice(s.as_bytes()))
    }

    #[test]
    fn maps_a_row() {
        let map = ColumnMap::new(&relation()).unwrap();
        let rec = map
            .record(&[
                t("7"),
                t("orders"),
                t("\\x6b"),
                t("\\x7b7d"),
                t(r#"{"h": "v"}"#),
                Value::Null,
                t("1970-01-01 00:00:01+00"),
                Value::Null,
            ])
            .unwrap();
        assert_eq!(rec.id, 7);
        assert_eq!(rec.topic, "orders");
        assert_eq!(rec.key.as_deref(), Some(&b"k"[..]));
        assert_eq!(rec.payload.as_deref(), Some(&b"{}"[..]));
        assert_eq!(rec.headers, vec![("h".to_string(), b"v".to_vec())]);
        assert_eq!(rec.kafka_partition, None);
        assert_eq!(rec.created_at_micros, Some(1_000_000));
    }

    fn b(bytes: &[u8]) -> Value {
        Value::Binary(Bytes::copy_from_slice(bytes))
    }

    #[test]
    fn maps_a_binary_row_as_its_text_twin() {
        let map = ColumnMap::new(&relation()).unwrap();
        let mut jsonb = vec![1u8];
        jsonb.extend_from_slice(br#"{"h": "v"}"#);
        let one_second_after_unix_epoch = 1_000_000i64 - 946_684_800_000_000;
        let rec = map
            .record(&[
                b(&7i64.to_be_bytes()),
                b(b"orders"),
                b(b"k"),
                b(b"{}"),
                b(&jsonb),
                b(&2i32.to_be_bytes()),
                b(&one_second_after_unix_epoch.to_be_bytes()),
                b(b"ignored"),
            ])
            .unwrap();
        assert_eq!(rec.id, 7);
        assert_eq!(rec.topic, "orders");
        assert_eq!(rec.key.as_deref(), Some(&b"k"[..]));
        assert_eq!(rec.payload.as_deref(), Some(&b"{}"[..]));
        assert_eq!(rec.headers, vec![("h".to_string(), b"v".to_vec())]);
        assert_eq!(rec.kafka_partition, Some(2));
        assert_eq!(rec.created_at_micros, Some(1_000_000));
        let e = map.record(&[b(&[0, 1, 2]), b(b"x"), Value::Null, Value::Null, Value::Null, Value::Null, Value::Null]);
        assert_eq!(e.unwrap_err().column, "id");
    }

    #[test]
    fn bad_values_name_row_and_column() {
        let map = ColumnMap::new(&relation()).unwrap();
        let e = map
            .record(&[t("7"), Value::Null, Value::Null, Value::Null, Value::Null, Value::Null, Value::Null])
            .unwrap_err();
        assert_eq!((e.id, e.column), (Some(7), "topic"));
        let e =
            map.record(&[t("8"), t("x"), Value::Null, Value::Null, t("[1]"), Value::Null, Value::Null]).unwrap_err();
        assert_eq!((e.id, e.column), (Some(8), "headers"));
        let e = map.record(&[t("9"), t("x"), Value::Null, Value::Null, Value::Null, t("-1"), Value::Null]).unwrap_err();
        assert_eq!((e.id, e.column), (Some(9), "kafka_partition"));
    }

    #[test]
    fn dropped_or_retyped_columns_are_named() {
        let mut rel = relation();
        rel.columns.retain(|c| c.name != "payload");
        assert!(ColumnMap::new(&rel).unwrap_err().to_string().contains("\"payload\""));
        let mut rel = relation();
        rel.columns[1].type_oid = oid::INT4;
        assert!(ColumnMap::new(&rel).unwrap_err().to_string().contains("topic"));
    }
}
