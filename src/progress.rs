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
//! * `ids`: for a source whose positions mean nothing outside their session (polling, a
//!   catch-up's drain), the ids of the rows that committed Kafka transactions hold and that
//!   were not known to be deleted when it was written, as inclusive ranges
//!   (`"ids":[[1,40],[42,42]]`); absent when empty. For a source with positions, the same for
//!   the rows the sweep published (rows the log never carried: no position covers them).
//! * `source`: the position header of the source that wrote it; the `mark` and `partial` of a
//!   record of another kind of source (a catch-up's, a polling stream's) cover nothing.
//! * `history`: the database history it was written in ([`Source::history`]); a record of
//!   another history (the database failed over since) covers nothing: its positions and ids
//!   may name other transactions and rows there. Absent in records of earlier builds.
//!
//! [`Source::history`]: crate::source::Source::history
//!
//! A restarted session reads the last committed record (`read_committed`) and treats the
//! records it covers as published: their rows are deleted, not sent again.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// The progress record's value.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Progress {
    pub v: u32,
    pub source: String,
    pub mark: Option<String>,
    pub partial: Option<Partial>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ids: Vec<[i64; 2]>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history: Option<String>,
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

/// The most row ids a progress record may name: a record this build writes names one Kafka
/// transaction's rows and those of the few before it not yet deleted, far fewer.
const MAX_IDS: u64 = 10_000_000;

impl Progress {
    pub(crate) fn new(source: &str, mark: Option<String>, partial: Option<Partial>) -> Self {
        Self { v: VERSION, source: source.to_string(), mark, partial, ids: Vec::new(), history: None }
    }

    /// The same record, written in `history`.
    pub(crate) fn in_history(mut self, history: &str) -> Self {
        self.history = Some(history.to_string());
        self
    }

    /// The same record naming `ids` (see the module docs).
    pub(crate) fn with_ids(mut self, ids: &BTreeSet<i64>) -> Self {
        let mut ranges: Vec<[i64; 2]> = Vec::new();
        for &id in ids {
            match ranges.last_mut() {
                Some(r) if r[1].checked_add(1) == Some(id) => r[1] = id,
                _ => ranges.push([id, id]),
            }
        }
        self.ids = ranges;
        self
    }

    /// The row ids the record names, ascending.
    pub(crate) fn id_list(&self) -> Vec<i64> {
        self.ids.iter().flat_map(|[a, b]| *a..=*b).collect()
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
        let mut total: u64 = 0;
        for [a, b] in &progress.ids {
            total = total.saturating_add(b.abs_diff(*a).saturating_add(1));
            if a > b || total > MAX_IDS {
                return Err(Error::definite(
                    format!(
                        "the progress record of {key} in topic {topic} names row ids no outbox-streamer writes (range {a}..{b}, more than {MAX_IDS} ids, or reversed)"
                    ),
                    format!(
                        "the progress topic holds records only outbox-streamer writes; delete the key (produce a tombstone for {key}) and accept at-least-once for the records in flight"
                    ),
                ));
            }
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

    #[test]
    fn ids_are_stored_as_ranges_and_absent_when_none() {
        let none = Progress::new("outbox-poll-batch", None, None);
        assert!(!String::from_utf8(none.encode()).unwrap().contains("ids"));
        let ids: BTreeSet<i64> = [-3, -2, 1, 2, 3, 7, i64::MAX].into_iter().collect();
        let p = none.with_ids(&ids);
        assert_eq!(p.ids, vec![[-3, -2], [1, 3], [7, 7], [i64::MAX, i64::MAX]]);
        let back = Progress::decode(&p.encode(), "t", "k").unwrap();
        assert_eq!(back.id_list(), ids.into_iter().collect::<Vec<_>>());
        // A record without the field (written before it existed) names none.
        let old = Progress::decode(b"{\"v\":1,\"source\":\"x\",\"mark\":null,\"partial\":null}", "t", "k").unwrap();
        assert!(old.ids.is_empty());
    }

    #[test]
    fn a_forged_range_is_refused_before_it_is_expanded() {
        for forged in [r#"[[0,9223372036854775807]]"#, r#"[[5,1]]"#, r#"[[-9223372036854775808,9223372036854775807]]"#]
        {
            let value = format!(r#"{{"v":1,"source":"x","mark":null,"partial":null,"ids":{forged}}}"#);
            let e = Progress::decode(value.as_bytes(), "t", "key").unwrap_err();
            assert!(e.to_string().contains("names row ids"), "{forged}: {e}");
        }
    }
}
