//! The one place where a shard-partition's object names are derived.
//!
//! Table, publication and slot share one name, `<prefix>_<shard>_<partition>` (they live in
//! separate namespaces), so an operator who sees any of them knows the other two.

use std::fmt;

/// One shard-partition of a source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId {
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
pub struct StreamNames {
    pub table: String,
    pub publication: String,
    pub slot: String,
}

pub fn stream_names(prefix: &str, id: StreamId) -> StreamNames {
    let base = format!("{prefix}_{}_{}", id.shard, id.partition);
    StreamNames { table: base.clone(), publication: base.clone(), slot: base }
}

/// The MySQL/MariaDB table holding every shard-partition's stored binlog position.
pub fn checkpoint_table(prefix: &str) -> String {
    format!("{prefix}_checkpoint")
}

/// Every shard-partition of a source, shard-major.
pub fn all_streams(shards: u32, partitions: u32) -> impl Iterator<Item = StreamId> {
    (0..shards).flat_map(move |shard| (0..partitions).map(move |partition| StreamId { shard, partition }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        let n = stream_names("outbox", StreamId { shard: 1, partition: 2 });
        assert_eq!(n.table, "outbox_1_2");
        assert_eq!(n.slot, "outbox_1_2");
        assert_eq!(all_streams(2, 2).count(), 4);
    }
}
