//! How a shard-partition's table holds its messages: outbox-streamer's own columns, the table
//! of another outbox read as it is (`layout = "tw-tkms"`, `"debezium"`), or any table whose
//! columns the config maps (`layout = "columns"`), so a team switching keeps its application
//! unchanged.
//!
//! A layout says which of its columns carry each [`Field`] (readers select and decode by it)
//! and turns the values read into a record ([`Layout::record`]). Whatever the layout, a row is
//! identified by an increasing integer column (`id`, or the mapping's `id` when the table's
//! own `id` is, say, Debezium's uuid) and deleted once published.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::record::{InvalidRow, OutboxRecord, RESERVED_HEADER_PREFIX, RawRow};

/// The `layout` setting of a source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum LayoutKind {
    #[default]
    OutboxStreamer,
    TwTkms,
    /// Debezium's outbox event router table, mapped by `[source.columns]` defaults.
    Debezium,
    /// Any table, mapped by `[source.columns]`.
    Columns,
}

impl LayoutKind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            LayoutKind::OutboxStreamer => "outbox-streamer",
            LayoutKind::TwTkms => "tw-tkms",
            LayoutKind::Debezium => "debezium",
            LayoutKind::Columns => "columns",
        }
    }

    /// The `table_prefix` a source of this layout has unless it sets one.
    pub(crate) fn default_table_prefix(self) -> &'static str {
        match self {
            LayoutKind::TwTkms => "outgoing_message",
            _ => crate::config::DEFAULT_TABLE_PREFIX,
        }
    }
}

/// `[source.columns]`: which column carries what (`layout = "columns"` or `"debezium"`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Mapping {
    /// The row's identity: an increasing integer column with a unique index (default `id`).
    /// Rows are read, ordered, acknowledged and deleted by it; a table whose `id` is a uuid
    /// gains one (`seq bigint GENERATED ALWAYS AS IDENTITY UNIQUE`) and names it here.
    pub id: Option<String>,
    /// The column naming each row's topic (or exchange), with `topic_prefix` put before it.
    pub topic: Option<String>,
    pub topic_prefix: Option<String>,
    /// One topic for every row, instead of a `topic` column.
    pub fixed_topic: Option<String>,
    /// The record key: a text, `bytea`/blob or uuid column.
    pub key: Option<String>,
    /// The record value: a `bytea`/blob, text or JSON column.
    pub payload: Option<String>,
    /// A JSON object of string values, sent as headers.
    pub headers: Option<String>,
    /// An explicit partition (integer column).
    pub partition: Option<String>,
    /// When the row was inserted (`timestamptz`/`TIMESTAMP`), for the latency metric.
    pub created_at: Option<String>,
    /// Columns sent as headers: header name = column (the value as text).
    #[serde(default)]
    pub header_columns: BTreeMap<String, String>,
}

impl Mapping {
    /// Debezium's outbox event router defaults: topic `outbox.event.<aggregatetype>`, key
    /// `aggregateid`, value `payload`, header `id`. Set values win.
    pub(crate) fn with_debezium_defaults(mut self) -> Self {
        if self.fixed_topic.is_none() {
            self.topic.get_or_insert_with(|| "aggregatetype".into());
            self.topic_prefix.get_or_insert_with(|| "outbox.event.".into());
        }
        self.key.get_or_insert_with(|| "aggregateid".into());
        self.payload.get_or_insert_with(|| "payload".into());
        if self.header_columns.is_empty() {
            self.header_columns.insert("id".into(), "id".into());
        }
        self
    }
}

/// How a source's tables hold messages; the mapping of a `columns` layout lives as long as
/// the process (a config is read once, see `Config::load`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Layout {
    /// `id, topic, msg_key, payload, headers, kafka_partition, created_at` (see `setup`).
    #[default]
    OutboxStreamer,
    /// tw-tkms's `outgoing_message_<shard>_<partition>`: `id` and `message`, a compressed
    /// protobuf holding topic, key, value, headers, partition and timestamps.
    TwTkms,
    /// A mapped table (`layout = "columns"` or `"debezium"`).
    Columns(&'static Mapping),
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
            Layout::Columns(_) => "columns",
        }
    }

    /// Whether `setup` creates the tables (and the enqueue function) of this layout. Another
    /// outbox's tables belong to its application: `setup` only checks them.
    pub(crate) fn owns_tables(self) -> bool {
        self == Layout::OutboxStreamer
    }

    /// The mapping of a `columns` layout.
    pub(crate) fn mapping(self) -> Option<&'static Mapping> {
        match self {
            Layout::Columns(m) => Some(m),
            _ => None,
        }
    }

    /// The row identity column: an increasing integer with a unique index.
    pub(crate) fn id_column(self) -> &'static str {
        self.column(Field::Id).unwrap_or("id")
    }

    /// The columns sent as headers (header name, column), in name order. Allocates nothing:
    /// readers walk it once per row.
    pub(crate) fn header_columns(self) -> impl Iterator<Item = (&'static str, &'static str)> {
        self.mapping().into_iter().flat_map(|m| m.header_columns.iter().map(|(h, c)| (h.as_str(), c.as_str())))
    }

    /// The column holding `field`, if the layout has one.
    pub(crate) fn column(self, field: Field) -> Option<&'static str> {
        if let Layout::Columns(m) = self {
            let column = match field {
                Field::Id => Some(m.id.as_deref().unwrap_or("id")),
                Field::Topic => m.topic.as_deref(),
                Field::Key => m.key.as_deref(),
                Field::Payload => m.payload.as_deref(),
                Field::Headers => m.headers.as_deref(),
                Field::Partition => m.partition.as_deref(),
                Field::CreatedAt => m.created_at.as_deref(),
            };
            return column;
        }
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
            (Layout::Columns(_), _) => None,
        }
    }

    /// The record of row `id` from the values read by [`Self::column`]; a value that cannot
    /// become one names the row and column, and keeps the values for a dead-letter copy.
    pub(crate) fn record(self, id: i64, mut raw: RawRow) -> Result<OutboxRecord, InvalidRow> {
        match self {
            Layout::OutboxStreamer => raw.into_record(id),
            Layout::Columns(m) => {
                if let Some(fixed) = &m.fixed_topic {
                    raw.topic = Some(fixed.clone().into_bytes());
                } else if let (Some(prefix), Some(topic)) = (&m.topic_prefix, raw.topic.as_mut()) {
                    topic.splice(0..0, prefix.bytes());
                }
                raw.into_record(id)
            }
            Layout::TwTkms => tw_tkms_record(id, &raw).map_err(|mut invalid| {
                invalid.raw = Some(Box::new(raw));
                invalid
            }),
        }
    }
}

/// A column a table of a layout must have: its name and the `information_schema` data types
/// it may have on PostgreSQL and on MySQL/MariaDB (empty: any type).
type Required = (&'static str, &'static [&'static str], &'static [&'static str]);

const INTEGER: (&[&str], &[&str]) = (&["bigint", "integer"], &["bigint", "int"]);

impl Layout {
    /// The columns `setup` checks in a table it does not own (see [`Self::owns_tables`]).
    fn required_columns(self) -> Vec<Required> {
        match self {
            Layout::OutboxStreamer => Vec::new(),
            Layout::TwTkms => vec![
                ("id", INTEGER.0, INTEGER.1),
                ("message", &["bytea"], &["blob", "mediumblob", "longblob", "tinyblob", "varbinary"]),
            ],
            Layout::Columns(_) => {
                let fields =
                    [Field::Topic, Field::Key, Field::Payload, Field::Headers, Field::Partition, Field::CreatedAt];
                let mut required: Vec<Required> = vec![(self.id_column(), INTEGER.0, INTEGER.1)];
                required.extend(fields.into_iter().filter_map(|f| self.column(f)).map(|c| (c, &[][..], &[][..])));
                required.extend(self.header_columns().map(|(_, c)| (c, &[][..], &[][..])));
                required
            }
        }
    }

    /// What is wrong with the row identity column of `tables` where it exists (in `found`, as
    /// for [`Self::check_tables`]), each as (what, fix): it needs a unique index of its own
    /// (`unique`: the tables that have one), since rows are deleted and looked up by it, and
    /// its values must come from the database's sequence (`generated`: the tables where they
    /// do — an identity, `serial` or `AUTO_INCREMENT`), since polling and the catch-up read
    /// rows in its order and an application-chosen value could fall behind the rows read.
    pub(crate) fn id_column_problems(
        self,
        tables: &[String],
        found: &[(String, String, String)],
        unique: &[String],
        generated: &[String],
        postgres: bool,
    ) -> Vec<(String, String)> {
        let id = self.id_column();
        let q = |name: &str| quote(name, postgres);
        let mut problems = Vec::new();
        for table in tables.iter().filter(|t| found.iter().any(|(ft, c, _)| ft == *t && c == id)) {
            if !unique.contains(table) {
                problems.push((
                    format!(
                        "column {table}.{id}, which identifies rows, has no unique index of its own (each delete would scan the table)"
                    ),
                    format!("CREATE UNIQUE INDEX {} ON {} ({});", q(&format!("{table}_{id}_key")), q(table), q(id)),
                ));
            }
            // Of a column that is no integer, check_tables says what to do instead.
            let integers = if postgres { INTEGER.0 } else { INTEGER.1 };
            let integer = found
                .iter()
                .any(|(t, c, ty)| t == table && c == id && integers.contains(&ty.to_ascii_lowercase().as_str()));
            if integer && !generated.contains(table) {
                let fix = if postgres {
                    format!(
                        "ALTER TABLE {t} ALTER COLUMN {c} DROP DEFAULT, ALTER COLUMN {c} SET NOT NULL, ALTER COLUMN {c} ADD GENERATED BY DEFAULT AS IDENTITY; \
                         SELECT setval(pg_get_serial_sequence({tl}, {cl}), (SELECT coalesce(max({c}), 0) + 1 FROM {t}), false);",
                        t = q(table),
                        c = q(id),
                        tl = pg_literal(&q(table)),
                        cl = pg_literal(id)
                    )
                } else {
                    format!("ALTER TABLE {} MODIFY {} BIGINT NOT NULL AUTO_INCREMENT;", q(table), q(id))
                };
                problems.push((
                    format!(
                        "column {table}.{id}, which orders rows, is not numbered by the database (no identity, serial or AUTO_INCREMENT): a value the application picks can fall behind the rows already read, and polling would never send that row"
                    ),
                    format!("have the database number it (after its unique index): {fix}"),
                ));
            }
        }
        problems
    }

    /// The table as the layout's own application documents it, for an operator (or
    /// `setup --create-tables`) to create; `None` when there is no such document.
    pub(crate) fn create_table(self, table: &str, postgres: bool) -> Option<String> {
        match (self, postgres) {
            (Layout::OutboxStreamer | Layout::Columns(_), _) => None,
            (Layout::TwTkms, true) => {
                Some(format!("CREATE TABLE {table} (id BIGSERIAL PRIMARY KEY, message BYTEA NOT NULL)"))
            }
            (Layout::TwTkms, false) => Some(format!(
                "CREATE TABLE {table} (id BIGINT AUTO_INCREMENT PRIMARY KEY, message MEDIUMBLOB NOT NULL) ENGINE=InnoDB"
            )),
        }
    }

    /// What is wrong with the tables `tables` of this layout, from their columns as
    /// `information_schema.columns` lists them (`found`: table, column, data type), each as
    /// (what, fix). Empty for a layout whose tables `setup` creates. With `uuid_ids`, a mapped
    /// table's id column may be a key (a PostgreSQL uuid, a MariaDB `CHAR`/`VARCHAR`): CDC reads
    /// such a table by key.
    pub(crate) fn check_tables(
        self,
        tables: &[String],
        found: &[(String, String, String)],
        postgres: bool,
        uuid_ids: bool,
    ) -> Vec<(String, String)> {
        let mut problems = Vec::new();
        let required = self.required_columns();
        let shape = |table: &str| match self.create_table(table, postgres) {
            Some(create) => format!("{} tables are: {create}", self.as_str()),
            None => "correct [source.columns] in the config, or the table".to_string(),
        };
        for table in tables {
            let columns: Vec<&(String, String, String)> = found.iter().filter(|(t, _, _)| t == table).collect();
            if columns.is_empty() && !required.is_empty() {
                let fix = match self.create_table(table, postgres) {
                    Some(create) => format!(
                        "the application creates its tables; if it has not yet, create it as {} does (or run setup --create-tables): {create}",
                        self.as_str()
                    ),
                    None => "the application creates its table; check the table name and table_prefix".to_string(),
                };
                problems.push((format!("table {table} (layout = \"{}\") does not exist", self.as_str()), fix));
                continue;
            }
            for (name, pg_types, my_types) in &required {
                let types = if postgres { pg_types } else { my_types };
                match columns.iter().find(|(_, c, _)| c == name) {
                    None if columns.iter().any(|(_, c, _)| c.eq_ignore_ascii_case(name)) => {
                        let (_, actual, _) = columns.iter().find(|(_, c, _)| c.eq_ignore_ascii_case(name)).unwrap();
                        problems.push((
                            format!("table {table} has a column {actual}, not {name}: the streamer reads columns by their exact name"),
                            format!("write it as the table does ({actual:?}) in [source.columns]"),
                        ));
                    }
                    None => problems.push((
                        format!("table {table} has no column {name} (layout = \"{}\")", self.as_str()),
                        match self {
                            Layout::Columns(m) if m.id.is_some() && *name == self.id_column() => {
                                format!(
                                    "add it (this copies the table under a lock: first delete rows already sent): {}",
                                    add_id_column(table, name, postgres)
                                )
                            }
                            _ => shape(table),
                        },
                    )),
                    Some((_, _, t))
                        if uuid_ids
                            && *name == self.id_column()
                            && is_key_type(t, postgres)
                            && self.mapping().is_some() => {}
                    Some((_, _, t)) if !types.is_empty() && !types.contains(&t.to_ascii_lowercase().as_str()) => {
                        let fix = match self {
                            // Debezium's default event id is a uuid.
                            Layout::Columns(m) if *name == self.id_column() && m.id.is_none() => {
                                id_column_fix(table, t, postgres)
                            }
                            Layout::Columns(_) if *name == self.id_column() => {
                                "set id in [source.columns] to an increasing integer column with a unique index".into()
                            }
                            _ => shape(table),
                        };
                        problems.push((
                            format!("column {table}.{name} has type {t}, which is not one of {}", types.join(", ")),
                            fix,
                        ));
                    }
                    Some(_) => {}
                }
            }
        }
        problems
    }
}

/// The tables of `tables` a mapped layout reads by key in CDC: their id column is a key (in
/// `found`, as for [`Layout::check_tables`]; see [`is_key_type`]).
pub(crate) fn uuid_keyed(
    layout: Layout,
    tables: &[String],
    found: &[(String, String, String)],
    postgres: bool,
) -> Vec<String> {
    if layout.mapping().is_none() {
        return Vec::new();
    }
    let id = layout.id_column();
    let keyed = |t: &String| found.iter().any(|(ft, c, ty)| ft == t && c == id && is_key_type(ty, postgres));
    tables.iter().filter(|t| keyed(t)).cloned().collect()
}

/// Whether an id column of `data_type` (as `information_schema` names it) is read as a key:
/// PostgreSQL's `uuid`; MariaDB's `char`/`varchar` (Debezium's uuid in a `CHAR(36)`).
fn is_key_type(data_type: &str, postgres: bool) -> bool {
    if postgres { data_type == "uuid" } else { matches!(data_type.to_ascii_lowercase().as_str(), "char" | "varchar") }
}

/// The fix for a mapped table whose identity column has type `found` (Debezium's uuid `id`):
/// add an increasing integer column and name it as the mapping's `id` — the application's
/// inserts do not change, and the uuid still travels as the `id` header.
fn id_column_fix(table: &str, found: &str, postgres: bool) -> String {
    format!(
        "rows are read, ordered and deleted by an increasing integer column, and a {found} is not one: add one (this copies the table under a lock: first delete rows already sent) with {} then set id = \"seq\" in [source.columns] (the application's inserts do not change; the uuid still goes out as the id header)",
        add_id_column(table, "seq", postgres)
    )
}

/// The statement adding the increasing integer identity column `column` to `table`; existing
/// rows are numbered, and the application's inserts need not name it.
fn add_id_column(table: &str, column: &str, postgres: bool) -> String {
    let (t, c) = (quote(table, postgres), quote(column, postgres));
    if postgres {
        format!("ALTER TABLE {t} ADD COLUMN {c} bigint GENERATED ALWAYS AS IDENTITY UNIQUE;")
    } else {
        format!("ALTER TABLE {t} ADD COLUMN {c} BIGINT NOT NULL AUTO_INCREMENT UNIQUE;")
    }
}

/// `text` as a PostgreSQL string literal.
fn pg_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// `name` quoted as an identifier of PostgreSQL (`"…"`) or MySQL/MariaDB (`` `…` ``), for the
/// statements a message prints.
fn quote(name: &str, postgres: bool) -> String {
    if postgres { format!("\"{}\"", name.replace('"', "\"\"")) } else { format!("`{}`", name.replace('`', "``")) }
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
