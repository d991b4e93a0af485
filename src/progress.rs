//! Exactly-once delivery's progress record: what a shard-partition's committed Kafka
//! transactions hold, written in the same Kafka transaction as the records.
//!
//! The record's key is the shard-partition's transactional id ([`transactional_id`]); its value
//! is JSON, versioned:
//!
//! ```json
//! {"v":1,"source":"outbox-lsn","mark":"0/1A2B3C8","partial":{"transaction":"0/1A2B400","rows":10000}}
//! ```
//!
//! * `mark`: every record of every source transaction up to this position (the source's
//!   [`progress_mark`](crate::source::Source::progress_mark)) is in Kafka; `null` when none is.
//! * `partial`: a source transaction split across Kafka transactions (it outgrew one): its
//!   label (`outbox-lsn` / `outbox-gtid`) and how many of its rows, in log order, are in Kafka.
//! * `source`: the position header of the source that wrote it; a record of another kind of
//!   source (a catch-up's, a polling stream's) covers nothing.
//!
//! A restarted session reads the last committed record (`read_committed`) and treats the
//! records it covers as published: their rows are deleted, not sent again.

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// The progress record's value.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Progress {
    pub v: u32,
    pub source: String,
    pub mark: Option<String>,
    pub partial: Option<Partial>,
}

/// Part of a source transaction that is in Kafka.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Partial {
    /// The transaction's label (its position header's value).
    pub transaction: String,
    /// Its first rows, in log order, that are in Kafka.
    pub rows: u64,
}

const VERSION: u32 = 1;

impl Progress {
    pub(crate) fn new(source: &str, mark: Option<String>, partial: Option<Partial>) -> Self {
        Self { v: VERSION, source: source.to_string(), mark, partial }
    }

    pub(crate) fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a progress record serialises")
    }

    /// Reads a stored value; `topic` and `key` name it in the error.
    pub(crate) fn decode(value: &[u8], topic: &str, key: &str) -> Result<Self, Error> {
        let progress: Progress = serde_json::from_slice(value).map_err(|e| {
            Error::definite(
                format!("the progress record of {key} in topic {topic} is not readable: {e}"),
                format!(
                    "the progress topic holds records only outbox-streamer writes; if another tool wrote it, delete the key (produce a tombstone for {key}) and accept at-least-once for the records in flight, or point kafka.progress_topic at a topic of its own"
                ),
            )
        })?;
        if progress.v != VERSION {
            return Err(Error::definite(
                format!(
                    "the progress record of {key} in topic {topic} has version {}, this build reads {VERSION}",
                    progress.v
                ),
                "run the outbox-streamer version that wrote it, or a newer one",
            ));
        }
        Ok(progress)
    }
}

/// The transactional id of a shard-partition, also its progress record's key:
/// `<prefix>.<cluster>.<source>.<shard>-<partition>`. A new owner on another instance gets
/// the same id, so the cluster fences the old owner's producer.
pub(crate) fn transactional_id(prefix: &str, cluster: &str, source: &str, id: crate::names::StreamId) -> String {
    format!("{prefix}.{cluster}.{source}.{}-{}", id.shard, id.partition)
}

/// A progress mark the source cannot read.
pub(crate) fn unreadable(mark: &str, why: &str) -> Error {
    Error::definite(
        format!("the progress record's position {mark:?} is not one this source can read: {why}"),
        "the progress record belongs to another stream or database (two configs share kafka.transactional_id_prefix and a cluster name?); give each its own prefix, or delete the key from the progress topic and accept at-least-once for the records in flight",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_refusals() {
        let p = Progress::new(
            "outbox-lsn",
            Some("0/16B3748".into()),
            Some(Partial { transaction: "0/16B3800".into(), rows: 3 }),
        );
        assert_eq!(Progress::decode(&p.encode(), "t", "k").unwrap(), p);
        let e = Progress::decode(b"{\"v\":2,\"source\":\"x\",\"mark\":null,\"partial\":null}", "t", "k").unwrap_err();
        assert!(e.to_string().contains("version 2"), "{e}");
        let e = Progress::decode(b"junk", "progress", "key").unwrap_err();
        assert!(e.to_string().contains("topic progress"), "{e}");
    }
}
