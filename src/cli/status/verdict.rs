//! What makes a shard-partition unhealthy, and the exit code of `status`: pure decisions over
//! what the databases and the instances said, tested without either.

use std::fmt;

use serde::{Serialize, Serializer};

use super::streamer::Seen;

/// Exit codes of `status` (also in `status --help` and docs/operations.md).
pub(crate) mod exit {
    /// Every shard-partition is healthy.
    pub(crate) const HEALTHY: u8 = 0;
    /// A shard-partition needs attention: not running while rows wait, beyond a limit, or its
    /// slot, checkpoint or catch-up is not as it should be.
    pub(crate) const UNHEALTHY: u8 = 1;
    /// A shard-partition is halted: an operator must act (the reason says how).
    pub(crate) const HALTED: u8 = 2;
    /// `status` could not tell: the configuration, a database or ZooKeeper failed.
    pub(crate) const UNKNOWN: u8 = 3;
}

/// Why one shard-partition is not healthy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Problem {
    /// Its streamer halted and waits for an operator.
    Halted,
    /// No instance runs it while this many rows wait in its table.
    NotRunning { rows: i64 },
    /// Rows waiting beyond `--max-pending-rows`.
    PendingRows { rows: i64, limit: i64 },
    /// Lag beyond `--max-lag-bytes`.
    LagBytes { bytes: i64, limit: i64 },
    /// The PostgreSQL slot does not exist.
    SlotMissing,
    /// The PostgreSQL slot was invalidated (`wal_status=lost`).
    SlotLost,
    /// The slot's name belongs to another database's slot.
    SlotOfOtherDatabase(String),
    /// No checkpoint row for the shard-partition.
    CheckpointMissing,
    /// Its outbox table could not be counted.
    TableUnreadable,
    /// A catch-up by polling is owed before streaming (CDC mode only).
    CatchUpPending,
}

impl Problem {
    pub(super) fn exit_code(&self) -> u8 {
        match self {
            Problem::Halted => exit::HALTED,
            _ => exit::UNHEALTHY,
        }
    }

    /// A limit was exceeded (shown as `LAGGING`).
    pub(super) fn is_lag(&self) -> bool {
        matches!(self, Problem::PendingRows { .. } | Problem::LagBytes { .. })
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::Halted => write!(f, "halted"),
            Problem::NotRunning { rows } => write!(f, "not running with {} waiting", count_rows(*rows)),
            Problem::PendingRows { rows, limit } => {
                write!(f, "{} waiting, more than --max-pending-rows {limit}", count_rows(*rows))
            }
            Problem::LagBytes { bytes, limit } => write!(f, "{bytes} bytes behind, more than --max-lag-bytes {limit}"),
            Problem::SlotMissing => write!(f, "slot missing (run setup)"),
            Problem::SlotLost => write!(f, "slot lost (invalidated by max_slot_wal_keep_size)"),
            Problem::SlotOfOtherDatabase(db) => write!(f, "the slot name is taken by database {db} (set slot_prefix)"),
            Problem::CheckpointMissing => write!(f, "checkpoint row missing (run setup)"),
            Problem::TableUnreadable => write!(f, "the outbox table cannot be read"),
            Problem::CatchUpPending => write!(f, "catch-up pending"),
        }
    }
}

/// `1 row`, `3 rows`.
fn count_rows(n: i64) -> String {
    if n == 1 { "1 row".into() } else { format!("{n} rows") }
}

impl Serialize for Problem {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Thresholds beyond which a shard-partition counts as lagging (unhealthy).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Limits {
    pub max_lag_bytes: Option<i64>,
    pub max_pending_rows: Option<i64>,
}

/// The problems of a shard-partition's streamer (`seen`, with `pending` rows in its table and
/// `lag_bytes` behind) against `limits`. Retrying, starting or catching up is no problem by
/// itself — those states pass, and one that lasts shows in the limits; a state that cannot be
/// known is none either (the output says why it is unknown).
pub(super) fn streamer_problems(
    seen: Seen,
    pending: Option<i64>,
    lag_bytes: Option<i64>,
    limits: Limits,
) -> Vec<Problem> {
    let mut problems = Vec::new();
    match seen {
        Seen::Halted => problems.push(Problem::Halted),
        Seen::NotRunning => {
            if let Some(rows) = pending.filter(|rows| *rows > 0) {
                problems.push(Problem::NotRunning { rows });
            }
        }
        _ => {}
    }
    if let (Some(rows), Some(limit)) = (pending, limits.max_pending_rows)
        && rows > limit
    {
        problems.push(Problem::PendingRows { rows, limit });
    }
    if let (Some(bytes), Some(limit)) = (lag_bytes, limits.max_lag_bytes)
        && bytes > limit
    {
        problems.push(Problem::LagBytes { bytes, limit });
    }
    problems
}

/// The exit code for all problems of all shard-partitions: the worst one's.
pub(super) fn exit_code<'a>(problems: impl IntoIterator<Item = &'a Problem>) -> u8 {
    problems.into_iter().map(Problem::exit_code).max().unwrap_or(exit::HEALTHY)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONE: Limits = Limits { max_lag_bytes: None, max_pending_rows: None };

    #[test]
    fn a_halt_is_exit_2_whatever_waits() {
        for pending in [None, Some(0), Some(5)] {
            let p = streamer_problems(Seen::Halted, pending, None, NONE);
            assert_eq!(exit_code(&p), exit::HALTED, "{pending:?}");
        }
    }

    #[test]
    fn not_running_counts_only_while_rows_wait() {
        assert_eq!(streamer_problems(Seen::NotRunning, Some(1458), None, NONE), [Problem::NotRunning { rows: 1458 }]);
        assert!(streamer_problems(Seen::NotRunning, Some(0), None, NONE).is_empty());
        assert!(
            streamer_problems(Seen::NotRunning, None, None, NONE).is_empty(),
            "an unreadable table is its own problem"
        );
    }

    #[test]
    fn passing_states_are_healthy_until_a_limit_is_exceeded() {
        let limits = Limits { max_lag_bytes: Some(100), max_pending_rows: Some(3) };
        for seen in [Seen::Streaming, Seen::CaughtUp, Seen::Retrying, Seen::Starting, Seen::CatchingUp, Seen::Unknown] {
            assert!(streamer_problems(seen, Some(3), Some(100), limits).is_empty(), "{seen:?} at the limits");
            let over = streamer_problems(seen, Some(4), Some(101), limits);
            assert_eq!(
                over,
                [Problem::PendingRows { rows: 4, limit: 3 }, Problem::LagBytes { bytes: 101, limit: 100 }]
            );
            assert!(over.iter().all(Problem::is_lag));
            assert_eq!(exit_code(&over), exit::UNHEALTHY);
        }
    }

    #[test]
    fn the_worst_problem_decides_the_exit_code() {
        assert_eq!(exit_code(&[]), exit::HEALTHY);
        assert_eq!(exit_code(&[Problem::SlotMissing, Problem::Halted, Problem::CatchUpPending]), exit::HALTED);
        assert_eq!(exit_code(&[Problem::CheckpointMissing]), exit::UNHEALTHY);
        assert_eq!(Problem::NotRunning { rows: 3 }.to_string(), "not running with 3 rows waiting");
        assert_eq!(Problem::NotRunning { rows: 1 }.to_string(), "not running with 1 row waiting");
    }
}
