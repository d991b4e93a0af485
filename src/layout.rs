//! How a shard-partition's table holds its messages: outbox-streamer's own columns, or the
//! table of another outbox read as it is (`layout = "tw-tkms"`), so a team switching keeps its
//! application unchanged.
//!
//! A layout says which of its columns carry each [`Field`] (readers select and decode by it)
//! and turns the values read into a record ([`Layout::record`]). Whatever the layout, a row is
//! identified by its integer `id` and deleted once published.

use serde::{Deserialize, Serialize};

use crate::record::{InvalidRow, OutboxRecord, RESERVED_HEADER_PREFIX, RawRow};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Layout {
    /// `id, topic, msg_key, payload, headers, kafka_partition, created_at` (see `setup`).
    #[default]
    OutboxStreamer,
    /// tw-tkms's `outgoing_message_<shard>_<partition>`: `id` and `message`, a compressed
    /// protobuf holding topic, key, value, headers, partition and timestamps.
    TwTkms,
}

/// What a reader reads from a row, whatever the layout calls the column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Field {
    Id,
    Topic,
    Key,
    /// The row's payload; for tw-tkms, the whole stored `message`.
    Payload,
    Headers,
    Partition,
    CreatedAt,
}

impl Layout {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Layout::OutboxStreamer => "outbox-streamer",
            Layout::TwTkms => "tw-tkms",
        }
    }

    /// The `table_prefix` a source of this layout has unless it sets one.
    pub(crate) fn default_table_prefix(self) -> &'static str {
        match self {
            Layout::OutboxStreamer => crate::config::DEFAULT_TABLE_PREFIX,
            Layout::TwTkms => "outgoing_message",
        }
    }

    /// Whether `setup` creates the tables (and the enqueue function) of this layout. Another
    /// outbox's tables belong to its application: `setup` only checks them.
    pub(crate) fn owns_tables(self) -> bool {
        self == Layout::OutboxStreamer
    }

    /// The column holding `field`, if the layout has one.
    pub(crate) fn column(self, field: Field) -> Option<&'static str> {
        match (self, field) {
            (_, Field::Id) => Some("id"),
            (Layout::OutboxStreamer, Field::Topic) => Some("topic"),
            (Layout::OutboxStreamer, Field::Key) => Some("msg_key"),
            (Layout::OutboxStreamer, Field::Payload) => Some("payload"),
            (Layout::OutboxStreamer, Field::Headers) => Some("headers"),
            (Layout::OutboxStreamer, Field::Partition) => Some("kafka_partition"),
            (Layout::OutboxStreamer, Field::CreatedAt) => Some("created_at"),
            (Layout::TwTkms, Field::Payload) => Some("message"),
            (Layout::TwTkms, _) => None,
        }
    }

    /// The record of row `id` from the values read by [`Self::column`]; a value that cannot
    /// become one names the row and column, and keeps the values for a dead-letter copy.
    pub(crate) fn record(self, id: i64, raw: RawRow) -> Result<OutboxRecord, InvalidRow> {
        match self {
            Layout::OutboxStreamer => raw.into_record(id),
            Layout::TwTkms => tw_tkms_record(id, &raw).map_err(|mut invalid| {
                invalid.raw = Some(Box::new(raw));
                invalid
            }),
        }
    }
}

/// A column a table of a layout must have: its name and the `information_schema` data types
/// it may have on PostgreSQL and on MySQL/MariaDB.
type Required = (&'static str, &'static [&'static str], &'static [&'static str]);

impl Layout {
    /// The columns `setup` checks in a table it does not own (see [`Self::owns_tables`]).
    fn required_columns(self) -> &'static [Required] {
        match self {
            Layout::OutboxStreamer => &[],
            Layout::TwTkms => &[
                ("id", &["bigint", "integer"], &["bigint", "int"]),
                ("message", &["bytea"], &["blob", "mediumblob", "longblob", "tinyblob", "varbinary"]),
            ],
        }
    }

    /// The table as the layout's own application documents it, for an operator (or
    /// `setup --create-tables`) to create.
    pub(crate) fn create_table(self, table: &str, postgres: bool) -> String {
        match (self, postgres) {
            (Layout::OutboxStreamer, _) => format!("run setup for {table}"),
            (Layout::TwTkms, true) => {
                format!("CREATE TABLE {table} (id BIGSERIAL PRIMARY KEY, message BYTEA NOT NULL)")
            }
            (Layout::TwTkms, false) => format!(
                "CREATE TABLE {table} (id BIGINT AUTO_INCREMENT PRIMARY KEY, message MEDIUMBLOB NOT NULL) ENGINE=InnoDB"
            ),
        }
    }

    /// What is wrong with the tables `tables` of this layout, from their columns as
    /// `information_schema.columns` lists them (`found`: table, column, data type), each as
    /// (what, fix). Empty for a layout whose tables `setup` creates.
    pub(crate) fn check_tables(
        self,
        tables: &[String],
        found: &[(String, String, String)],
        postgres: bool,
    ) -> Vec<(String, String)> {
        let mut problems = Vec::new();
        for table in tables {
            let columns: Vec<&(String, String, String)> = found.iter().filter(|(t, _, _)| t == table).collect();
            if columns.is_empty() && !self.required_columns().is_empty() {
                problems.push((
                    format!("table {table} (layout = \"{}\") does not exist", self.as_str()),
                    format!(
                        "the application creates its tables; if it has not yet, create it as {} does (or run setup --create-tables): {}",
                        self.as_str(),
                        self.create_table(table, postgres)
                    ),
                ));
                continue;
            }
            for (name, pg_types, my_types) in self.required_columns() {
                let types = if postgres { pg_types } else { my_types };
                match columns.iter().find(|(_, c, _)| c == name) {
                    None => problems.push((
                        format!("table {table} has no column {name} (layout = \"{}\")", self.as_str()),
                        format!("{} tables are: {}", self.as_str(), self.create_table(table, postgres)),
                    )),
                    Some((_, _, t)) if !types.contains(&t.to_ascii_lowercase().as_str()) => problems.push((
                        format!("column {table}.{name} has type {t}, which is not one of {}", types.join(", ")),
                        format!("{} tables are: {}", self.as_str(), self.create_table(table, postgres)),
                    )),
                    Some(_) => {}
                }
            }
        }
        problems
    }
}

/// Decodes row `id`'s tw-tkms `message` (carried in [`RawRow::payload`]) as tw-tkms's proxy
/// would send it: explicit partition and timestamp honoured, an empty key sent as none.
fn tw_tkms_record(id: i64, raw: &RawRow) -> Result<OutboxRecord, InvalidRow> {
    let bad = |reason: String| InvalidRow::new(Some(id), "message", reason);
    let stored = raw.payload.as_deref().ok_or_else(|| bad("is NULL".into()))?;
    let m = outbox_tw_tkms::decode(stored).map_err(|e| bad(e.to_string()))?;
    if m.topic.is_empty() || m.topic.len() > 249 {
        return Err(bad(format!(
            "names a topic {} bytes long; a Kafka topic name has 1 to 249 characters",
            m.topic.len()
        )));
    }
    let kafka_partition = match m.partition.map(i32::try_from) {
        None => None,
        Some(Ok(p)) => Some(p),
        Some(Err(_)) => return Err(bad("names a partition above 2147483647".into())),
    };
    let timestamp_ms = match m.timestamp_ms.map(i64::try_from) {
        None => None,
        Some(Ok(t)) => Some(t),
        Some(Err(_)) => return Err(bad("has a timestamp past the year 292 million".into())),
    };
    if let Some((name, _)) = m.headers.iter().find(|(name, _)| {
        name.get(..RESERVED_HEADER_PREFIX.len()).is_some_and(|p| p.eq_ignore_ascii_case(RESERVED_HEADER_PREFIX))
    }) {
        return Err(bad(format!(
            "has header {:?}, whose prefix \"{RESERVED_HEADER_PREFIX}\" is reserved for the streamer's own headers; rename it in the application",
            name.chars().take(64).collect::<String>()
        )));
    }
    Ok(OutboxRecord {
        id,
        topic: m.topic,
        key: m.key.map(String::into_bytes),
        payload: Some(m.value),
        headers: m.headers,
        kafka_partition,
        created_at_micros: m.insert_timestamp_ms.and_then(|ms| i64::try_from(ms).ok()?.checked_mul(1000)),
        timestamp_ms,
        in_table: true,
    })
}

#[cfg(test)]
mod tests;
