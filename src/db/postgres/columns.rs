//! Where each outbox column sits in a pgoutput relation's tuples, and a tuple turned into a
//! record.
//!
//! Columns are found by name in each Relation message, so `ALTER TABLE … ADD COLUMN` while
//! running keeps working; a required column dropped or retyped halts the shard-partition
//! with an error naming the column.

use outbox_postgres::pgoutput::{Relation, Value, oid};
use outbox_postgres::{Lsn, values};

use crate::layout::{Field, Layout};
use crate::record::{InvalidRow, OutboxRecord, RawRow};
use crate::row_keys::RowKeys;

/// The fields a record is built from and the types each column may have. `created_at` only
/// feeds the latency metric: without it (or with another type) a row is still published.
const COLUMNS: [(Field, &[u32]); 7] = [
    (Field::Id, &[oid::INT8, oid::INT4]),
    (Field::Topic, &[oid::TEXT, oid::VARCHAR]),
    (Field::Key, &[oid::BYTEA]),
    (Field::Payload, &[oid::BYTEA]),
    (Field::Headers, &[oid::JSONB, oid::JSON]),
    (Field::Partition, &[oid::INT4, oid::INT2]),
    (Field::CreatedAt, &[oid::TIMESTAMPTZ]),
];
const CREATED_AT: usize = 6;

/// The types a mapped layout's column of `field` may have (read in text format, see
/// [`super::cdc::PgSource::connect`]): keys and payloads also from text, JSON or uuid columns.
fn accepted(layout: Layout, slot: usize) -> &'static [u32] {
    match (layout, COLUMNS[slot].0) {
        (Layout::Columns(_), Field::Key) => &[oid::BYTEA, oid::TEXT, oid::VARCHAR, oid::UUID],
        (Layout::Columns(_), Field::Payload) => &[oid::BYTEA, oid::TEXT, oid::VARCHAR, oid::JSON, oid::JSONB],
        (Layout::Columns(_), Field::Topic) => &[oid::TEXT, oid::VARCHAR, oid::BPCHAR],
        (Layout::Columns(_), Field::Id) => &[oid::INT8, oid::INT4, oid::UUID],
        _ => COLUMNS[slot].1,
    }
}

/// Where each column sits in the relation's tuples, or why it cannot be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ColumnMap {
    /// The relation these positions are for: another relation id needs a new map.
    pub(super) relation_id: u32,
    /// Per field: its column's position and type (`None`: the layout has no such column), or
    /// what is wrong with it.
    columns: [Result<Option<(usize, u32)>, String>; 7],
    /// A mapped layout's header columns: header name and the column's position, or what is
    /// wrong with it. Read as text, whatever their type.
    headers: Vec<(&'static str, Result<usize, String>)>,
    layout: Layout,
    /// Set when the session reads the table by key (see the module docs).
    keys: Option<RowKeys>,
}

impl ColumnMap {
    /// Maps a Relation message. A missing or retyped column does not stop the stream here:
    /// each row of the relation is then a bad row naming the column (see [`Self::record`]), so
    /// the bad-row policy — and the table, where the operator restores the column — decide.
    pub(crate) fn new(rel: &Relation, layout: Layout) -> Self {
        let mut slot = 0;
        let columns = COLUMNS.map(|(field, _)| {
            let types = accepted(layout, slot);
            slot += 1;
            let Some(name) = layout.column(field) else { return Ok(None) };
            match rel.columns.iter().position(|c| c.name == name) {
                None => Err(format!("the table {} has no column {name:?} (dropped or renamed?)", rel.name)),
                Some(pos) if types.contains(&rel.columns[pos].type_oid) => Ok(Some((pos, rel.columns[pos].type_oid))),
                Some(pos) => Err(format!(
                    "column {}.{name} has type oid {}, which the streamer cannot read",
                    rel.name, rel.columns[pos].type_oid
                )),
            }
        });
        let headers = layout
            .header_columns()
            .map(|(header, name)| {
                let pos = rel.columns.iter().position(|c| c.name == name);
                (
                    header,
                    pos.ok_or_else(|| format!("the table {} has no column {name:?} (dropped or renamed?)", rel.name)),
                )
            })
            .collect();
        Self { relation_id: rel.id, columns, headers, layout, keys: None }
    }

    /// Reads ids as uuids, each given its surrogate from `keys` (see the module docs).
    pub(crate) fn keyed(mut self, keys: Option<RowKeys>) -> Self {
        self.keys = keys;
        self
    }

    /// What is wrong with the relation's columns, if anything (for one warning per Relation).
    pub(crate) fn problems(&self) -> Vec<&str> {
        let fields = self.columns[..CREATED_AT].iter().filter_map(|c| c.as_ref().err());
        fields.chain(self.headers.iter().filter_map(|(_, c)| c.as_ref().err())).map(String::as_str).collect()
    }

    /// Builds the record of one inserted tuple of the transaction at `txn`; a bad value or
    /// column names the row and column. Values come in text or binary format (see
    /// [`super::cdc::PgSource::connect`]); both read the same.
    pub(crate) fn record(&self, values: &[Value], txn: Lsn) -> Result<OutboxRecord, InvalidRow> {
        let id = match &self.columns[0] {
            Ok(Some((pos, type_oid))) => values.get(*pos).map(|v| (v, *type_oid)),
            _ => None,
        };
        match (id, &self.keys) {
            (Some((Value::Text(t), oid::UUID)), Some(keys)) => {
                let key = String::from_utf8_lossy(t);
                let id = keys.id_of(&txn.to_string(), &key);
                self.record_as(values, Some(id)).map_err(|e| e.keyed(format!("'{key}'")))
            }
            (Some((_, type_oid)), keys) if (type_oid == oid::UUID) != keys.is_some() => Err(InvalidRow::new(
                None,
                self.layout.id_column(),
                "changed type between uuid and integer while this session read the table; restart the streamer to read it as it is now",
            )),
            _ => self.record_as(values, None),
        }
    }

    /// [`Self::record`] with the row's `surrogate` id, or its id column's when `None`.
    fn record_as(&self, values: &[Value], surrogate: Option<i64>) -> Result<OutboxRecord, InvalidRow> {
        let value = |slot: usize| -> Result<Option<(&Value, u32)>, &str> {
            match &self.columns[slot] {
                Ok(Some((pos, type_oid))) => Ok(values.get(*pos).map(|v| (v, *type_oid))),
                Ok(None) => Ok(None),
                Err(problem) => Err(problem.as_str()),
            }
        };
        let int = |slot: usize| -> Result<Option<i64>, &str> {
            match value(slot)? {
                Some((Value::Text(t), _)) => values::int(t).map(Some),
                Some((Value::Binary(b), _)) => values::binary_int(b).map(Some),
                _ => Ok(None),
            }
        };
        // bytea in text format is hex; a mapped text, JSON or uuid column is its text.
        let bytea = |slot: usize| -> Result<Option<Vec<u8>>, &str> {
            match value(slot)? {
                Some((Value::Text(t), oid::BYTEA)) => values::bytea(t).map(Some),
                Some((Value::Text(t), _)) => Ok(Some(t.to_vec())),
                Some((Value::Binary(b), oid::JSONB)) => values::binary_jsonb(b).map(|j| Some(j.to_vec())),
                Some((Value::Binary(b), _)) => Ok(Some(b.to_vec())),
                _ => Ok(None),
            }
        };
        // text, varchar and json are their own binary format; jsonb has a version byte.
        let text = |slot: usize| -> Result<Option<Vec<u8>>, &str> {
            match value(slot)? {
                Some((Value::Text(t), _)) => Ok(Some(t.to_vec())),
                Some((Value::Binary(b), oid::JSONB)) => values::binary_jsonb(b).map(|j| Some(j.to_vec())),
                Some((Value::Binary(b), _)) => Ok(Some(b.to_vec())),
                _ => Ok(None),
            }
        };
        let id_column = self.layout.id_column();
        let id = match surrogate {
            Some(id) => id,
            None => int(0)
                .map_err(|e| InvalidRow::new(None, id_column, e))?
                .ok_or_else(|| InvalidRow::new(None, id_column, "is NULL"))?,
        };
        let bad = |slot: usize| {
            let column = self.layout.column(COLUMNS[slot].0).unwrap_or("?");
            move |e: &str| InvalidRow::new(Some(id), column, e)
        };
        let raw = RawRow {
            topic: text(1).map_err(bad(1))?,
            key: bytea(2).map_err(bad(2))?,
            payload: bytea(3).map_err(bad(3))?,
            headers: text(4).map_err(bad(4))?,
            kafka_partition: int(5).map_err(bad(5))?,
            created_at_micros: match value(CREATED_AT) {
                Ok(Some((Value::Text(t), _))) => values::timestamptz_micros(t).ok(),
                Ok(Some((Value::Binary(b), _))) => values::binary_timestamptz_micros(b).ok(),
                _ => None,
            },
            extra_headers: Vec::new(),
        };
        let mut raw = raw;
        for (header, column) in &self.headers {
            match column {
                Err(problem) => {
                    let columns = self.layout.header_columns();
                    let name = columns.into_iter().find(|(h, _)| h == header).map_or("?", |(_, c)| c);
                    return Err(InvalidRow::new(Some(id), name, problem.clone()));
                }
                Ok(pos) => match values.get(*pos) {
                    Some(Value::Text(t)) => raw.extra_headers.push((header.to_string(), t.to_vec())),
                    Some(Value::Binary(b)) => raw.extra_headers.push((header.to_string(), b.to_vec())),
                    _ => {}
                },
            }
        }
        self.layout.record(id, raw)
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
        let map = ColumnMap::new(&relation(), Layout::OutboxStreamer);
        let rec = map
            .record(
                &[
                    t("7"),
                    t("orders"),
                    t("\\x6b"),
                    t("\\x7b7d"),
                    t(r#"{"h": "v"}"#),
                    Value::Null,
                    t("1970-01-01 00:00:01+00"),
                    Value::Null,
                ],
                Lsn(0),
            )
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
        let map = ColumnMap::new(&relation(), Layout::OutboxStreamer);
        let mut jsonb = vec![1u8];
        jsonb.extend_from_slice(br#"{"h": "v"}"#);
        let one_second_after_unix_epoch = 1_000_000i64 - 946_684_800_000_000;
        let rec = map
            .record(
                &[
                    b(&7i64.to_be_bytes()),
                    b(b"orders"),
                    b(b"k"),
                    b(b"{}"),
                    b(&jsonb),
                    b(&2i32.to_be_bytes()),
                    b(&one_second_after_unix_epoch.to_be_bytes()),
                    b(b"ignored"),
                ],
                Lsn(0),
            )
            .unwrap();
        assert_eq!(rec.id, 7);
        assert_eq!(rec.topic, "orders");
        assert_eq!(rec.key.as_deref(), Some(&b"k"[..]));
        assert_eq!(rec.payload.as_deref(), Some(&b"{}"[..]));
        assert_eq!(rec.headers, vec![("h".to_string(), b"v".to_vec())]);
        assert_eq!(rec.kafka_partition, Some(2));
        assert_eq!(rec.created_at_micros, Some(1_000_000));
        let e = map
            .record(&[b(&[0, 1, 2]), b(b"x"), Value::Null, Value::Null, Value::Null, Value::Null, Value::Null], Lsn(0));
        assert_eq!(e.unwrap_err().column, "id");
    }

    #[test]
    fn bad_values_name_row_and_column() {
        let map = ColumnMap::new(&relation(), Layout::OutboxStreamer);
        let e = map
            .record(&[t("7"), Value::Null, Value::Null, Value::Null, Value::Null, Value::Null, Value::Null], Lsn(0))
            .unwrap_err();
        assert_eq!((e.id, e.column), (Some(7), "topic"));
        let e = map
            .record(&[t("8"), t("x"), Value::Null, Value::Null, t("[1]"), Value::Null, Value::Null], Lsn(0))
            .unwrap_err();
        assert_eq!((e.id, e.column), (Some(8), "headers"));
        let e = map
            .record(&[t("9"), t("x"), Value::Null, Value::Null, Value::Null, t("-1"), Value::Null], Lsn(0))
            .unwrap_err();
        assert_eq!((e.id, e.column), (Some(9), "kafka_partition"));
    }

    #[test]
    fn dropped_or_retyped_columns_make_bad_rows_naming_them() {
        let mut rel = relation();
        rel.columns.retain(|c| c.name != "payload");
        let map = ColumnMap::new(&rel, Layout::OutboxStreamer);
        assert!(map.problems()[0].contains("\"payload\""));
        let row = [t("7"), t("orders"), Value::Null, Value::Null, Value::Null, Value::Null, Value::Null];
        let e = map.record(&row, Lsn(0)).unwrap_err();
        assert_eq!((e.id, e.column), (Some(7), "payload"));
        assert!(e.reason.contains("dropped or renamed"));
        let mut rel = relation();
        rel.columns[1].type_oid = oid::INT4;
        let map = ColumnMap::new(&rel, Layout::OutboxStreamer);
        assert!(map.problems()[0].contains("topic"));
        assert_eq!(map.record(&row, Lsn(0)).unwrap_err().column, "topic");
        // Without created_at a row is still a record (it only feeds the latency metric).
        let mut rel = relation();
        rel.columns.retain(|c| c.name != "created_at");
        let map = ColumnMap::new(&rel, Layout::OutboxStreamer);
        assert!(map.problems().is_empty());
        let row = [t("7"), t("orders"), Value::Null, Value::Null, Value::Null, Value::Null, Value::Null];
        assert_eq!(map.record(&row, Lsn(0)).unwrap().created_at_micros, None);
    }
}
