//! A PostgreSQL snapshot (`pg_current_snapshot()`), for the catch-up's drain: which
//! transactions it saw committed.
//!
//! The catch-up drains the table inside one `REPEATABLE READ` snapshot taken after its slot's
//! start, so it sends every row of the transactions that snapshot sees committed — some of
//! which committed after the slot's start and are in the stream too. The stream skips exactly
//! those (see `cdc`): a transaction whose commit precedes the WAL position read right after
//! the snapshot and whose id the snapshot sees committed was drained. Pure: parsing and the
//! visibility rule, unit-tested.

use outbox_postgres::Lsn;

/// `xmin:xmax:xip,…` as `pg_snapshot` prints it: 64-bit transaction ids (epoch and xid).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PgSnapshot {
    xmin: u64,
    xmax: u64,
    xip: Vec<u64>,
}

impl PgSnapshot {
    /// Parses `pg_snapshot`'s text form.
    pub(crate) fn parse(text: &str) -> Result<Self, String> {
        let mut parts = text.trim().splitn(3, ':');
        let mut number = |what: &str| -> Result<u64, String> {
            let part = parts.next().ok_or_else(|| format!("{text:?} has no {what}"))?;
            part.parse().map_err(|_| format!("{text:?}: {what} {part:?} is not a transaction id"))
        };
        let (xmin, xmax) = (number("xmin")?, number("xmax")?);
        let xip = match parts.next() {
            None | Some("") => Vec::new(),
            Some(list) => list
                .split(',')
                .map(|x| x.parse().map_err(|_| format!("{text:?}: {x:?} is not a transaction id")))
                .collect::<Result<_, _>>()?,
        };
        if xmin > xmax {
            return Err(format!("{text:?}: xmin is above xmax"));
        }
        Ok(Self { xmin, xmax, xip })
    }

    /// Whether the snapshot sees top-level transaction `xid` (32 bits, as logical decoding
    /// names it) committed. Its epoch is the one that puts it nearest `xmax`, as PostgreSQL
    /// compares transaction ids: a transaction the stream reads near the snapshot is never
    /// 2^31 transactions away from it.
    pub(crate) fn sees_committed(&self, xid: u32) -> bool {
        const EPOCH: u64 = 1 << 32;
        const HALF: u64 = 1 << 31;
        let mut full = (self.xmax & !(EPOCH - 1)) | u64::from(xid);
        if full > self.xmax.saturating_add(HALF) {
            match full.checked_sub(EPOCH) {
                Some(earlier) => full = earlier,
                None => return false,
            }
        } else if full.saturating_add(HALF) < self.xmax {
            full += EPOCH;
        }
        full < self.xmin || (full < self.xmax && !self.xip.contains(&full))
    }
}

/// What the last catch-up drained: its snapshot, and the WAL position read right after it
/// (no transaction committing at or after it is in the snapshot).
#[derive(Debug, Clone)]
pub(crate) struct Drained {
    pub snapshot: PgSnapshot,
    pub upto: Lsn,
}

impl Drained {
    /// Whether the transaction `xid` committing at `commit` was sent by the drain.
    pub(crate) fn covers(&self, commit: Lsn, xid: u32) -> bool {
        commit < self.upto && self.snapshot.sees_committed(xid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_text_form_and_refuses_what_is_not_one() {
        let s = PgSnapshot::parse("100:105:101,103").unwrap();
        assert_eq!(s, PgSnapshot { xmin: 100, xmax: 105, xip: vec![101, 103] });
        assert_eq!(PgSnapshot::parse("7:7:").unwrap().xip, Vec::<u64>::new());
        for bad in ["", "1", "a:2:", "5:4:", "1:2:x"] {
            assert!(PgSnapshot::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn sees_what_ended_before_it_and_not_what_ran_or_came_after() {
        let s = PgSnapshot::parse("100:105:101,103").unwrap();
        let seen: Vec<u32> = (95..110).filter(|x| s.sees_committed(*x)).collect();
        assert_eq!(seen, [95, 96, 97, 98, 99, 100, 102, 104]);
    }

    #[test]
    fn thirty_two_bit_ids_take_the_snapshots_epoch() {
        // Epoch 3; xmax just past a wraparound of the 32-bit counter.
        let epoch = 3u64 << 32;
        let s = PgSnapshot { xmin: epoch - 10, xmax: epoch + 5, xip: vec![epoch - 2, epoch + 1] };
        assert!(s.sees_committed(u32::MAX - 5), "before the wrap, in the previous epoch");
        assert!(!s.sees_committed(u32::MAX - 1), "running at the snapshot");
        assert!(s.sees_committed(0) && !s.sees_committed(1) && s.sees_committed(4));
        assert!(!s.sees_committed(5) && !s.sees_committed(6), "at or after xmax");
        let first = PgSnapshot { xmin: 3, xmax: 10, xip: vec![] };
        assert!(!first.sees_committed(20) && first.sees_committed(9));
        assert!(!first.sees_committed(u32::MAX), "no epoch before the first");
        let late = PgSnapshot { xmin: epoch + (1 << 31) + 10, xmax: epoch + (1 << 31) + 20, xip: vec![] };
        assert!(late.sees_committed(25), "less than 2^31 behind: seen");
        assert!(!late.sees_committed(4), "more than 2^31 behind counts as ahead, as PostgreSQL compares");
    }

    #[test]
    fn the_drain_covers_only_what_committed_before_its_position() {
        let d = Drained { snapshot: PgSnapshot::parse("100:105:").unwrap(), upto: Lsn(1000) };
        assert!(d.covers(Lsn(999), 104));
        assert!(!d.covers(Lsn(1000), 104), "committed after the snapshot was read");
        assert!(!d.covers(Lsn(999), 105), "not seen by the snapshot");
    }
}
