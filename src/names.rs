//! The one place where a shard-partition's object names are derived.
//!
//! Table, publication and slot share one name, `<prefix>_<shard>_<partition>` (they live in
//! separate namespaces), so an operator who sees any of them knows the other two.
//!
//! Tables and publications belong to one database, but replication slots are **cluster-wide**:
//! two databases of one PostgreSQL cluster that both keep the default prefix would both want
//! the slot `outbox_0_0`. The first database's `setup` creates it; the second's refuses and
//! suggests a `slot_prefix` ([`suggested_slot_prefix`]) for its own slots. Default names never
//! change, so an existing deployment keeps the slots it has (a slot nobody reads would retain
//! WAL for ever).

use std::fmt;

/// One shard-partition of a source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct StreamId {
    pub shard: u32,
    pub partition: u32,
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.shard, self.partition)
    }
}

/// The names of one shard-partition's objects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StreamNames {
    pub table: String,
    pub publication: String,
    pub slot: String,
}

/// The names of shard-partition `id`: table and publication from `table_prefix`, the slot from
/// `slot_prefix` when one is set (a second database of the cluster), else from `table_prefix`.
pub(crate) fn stream_names(table_prefix: &str, slot_prefix: Option<&str>, id: StreamId) -> StreamNames {
    let suffix = format!("{}_{}", id.shard, id.partition);
    let base = format!("{table_prefix}_{suffix}");
    let slot = match slot_prefix {
        Some(prefix) => format!("{prefix}_{suffix}"),
        None => base.clone(),
    };
    StreamNames { table: base.clone(), publication: base, slot }
}

/// The longest table or slot prefix: `<prefix>_<shard>_<partition>` stays well within
/// PostgreSQL's 63-byte names.
pub(crate) const MAX_PREFIX_LEN: usize = 40;

/// Whether `prefix` can start table and slot names: lowercase letters, digits and `_` (all a
/// slot name may contain), not starting with a digit, at most [`MAX_PREFIX_LEN`] bytes.
pub(crate) fn valid_prefix(prefix: &str) -> bool {
    prefix.chars().next().is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && prefix.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && prefix.len() <= MAX_PREFIX_LEN
}

/// A `slot_prefix` for a source whose default slot names are taken by another database:
/// `<table_prefix>_<database>`, made a valid prefix.
pub(crate) fn suggested_slot_prefix(table_prefix: &str, database: &str) -> String {
    let db: String =
        database.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '_' }).collect();
    let db = if db.trim_matches('_').is_empty() { "db2".to_string() } else { db };
    let mut prefix = format!("{table_prefix}_{db}");
    prefix.truncate(MAX_PREFIX_LEN);
    prefix
}

/// The MySQL/MariaDB table holding every shard-partition's stored binlog position.
pub(crate) fn checkpoint_table(prefix: &str) -> String {
    format!("{prefix}_checkpoint")
}

/// Every shard-partition of a source, shard-major.
pub(crate) fn all_streams(shards: u32, partitions: u32) -> impl Iterator<Item = StreamId> {
    (0..shards).flat_map(move |shard| (0..partitions).map(move |partition| StreamId { shard, partition }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        let n = stream_names("outbox", None, StreamId { shard: 1, partition: 2 });
        assert_eq!(n.table, "outbox_1_2");
        assert_eq!(n.slot, "outbox_1_2");
        assert_eq!(all_streams(2, 2).count(), 4);
    }

    #[test]
    fn a_slot_prefix_renames_only_the_slot() {
        let n = stream_names("outbox", Some("outbox_billing"), StreamId { shard: 0, partition: 1 });
        assert_eq!((n.table.as_str(), n.publication.as_str()), ("outbox_0_1", "outbox_0_1"));
        assert_eq!(n.slot, "outbox_billing_0_1");
    }

    #[test]
    fn suggested_slot_prefixes_are_valid() {
        assert_eq!(suggested_slot_prefix("outbox", "billing"), "outbox_billing");
        assert_eq!(suggested_slot_prefix("outbox", "Billing-EU"), "outbox_billing_eu");
        assert_eq!(suggested_slot_prefix("outbox", "--"), "outbox_db2");
        let long = suggested_slot_prefix("outbox", &"x".repeat(100));
        assert_eq!(long.len(), MAX_PREFIX_LEN);
        for p in ["outbox_billing", "outbox_billing_eu", "outbox_db2", long.as_str()] {
            assert!(valid_prefix(p), "{p}");
        }
        assert!(!valid_prefix("Outbox") && !valid_prefix("1x") && !valid_prefix("a-b") && !valid_prefix(""));
    }
}
