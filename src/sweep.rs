//! The sweep: the table as the safety net of the log.
//!
//! A row can be in the table without being in the log the stream reads: a session that logs
//! statements instead of rows (`binlog_format=STATEMENT`), one with `sql_log_bin=0`, rows
//! written before the slot existed. The stream never sees them, and nothing else would ever
//! send them. The sweep finds them without trusting timing:
//!
//! ```text
//!  probe k     ids still in the table at or below max_{k-1}  → candidates C_k
//!              then max id → max_k, then the log's end → mark L_k
//!  (wait)      until the stream has handled everything up to L_k
//!  check k     the ids of C_k still in the table are stranded: every one was committed
//!              before L_k (it was visible when C_k was read, and a commit is logged before it
//!              becomes visible), and the stream passed L_k without deleting it
//! ```
//!
//! Only rows older than the previous probe are candidates, so in steady state the candidate
//! query finds nothing (one index probe per interval). A stranded row is found two or three
//! intervals after it was written and published then, after rows committed later: the sweep
//! cannot restore an order the log never had.

/// Candidates read per probe; more are found by the next one.
pub(crate) const CANDIDATE_LIMIT: usize = 10_000;

/// What the sweep does at its next tick.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Step {
    /// Read the candidates at or below `below`, the highest id and the log's end.
    Probe { below: Option<i64> },
    /// The stream passed the mark: these candidates still in the table are stranded.
    Check(Vec<i64>),
    /// The stream has not reached the mark yet.
    Wait,
}

/// One stream's sweep state, for one session (positions are compared within a session).
#[derive(Debug)]
pub(crate) struct Sweep<P> {
    /// The highest id of the last probe.
    below: Option<i64>,
    /// Candidates of the last probe and the mark the stream must pass first.
    waiting: Option<(Vec<i64>, P)>,
}

impl<P> Default for Sweep<P> {
    fn default() -> Self {
        Self { below: None, waiting: None }
    }
}

impl<P> Sweep<P> {
    /// The next step, given what the stream has handled (`done`) and how positions compare.
    pub(crate) fn step(&self, done: Option<&P>, reached: impl Fn(&P, &P) -> bool) -> Step {
        match &self.waiting {
            None => Step::Probe { below: self.below },
            Some((candidates, mark)) => match done {
                Some(done) if reached(done, mark) => Step::Check(candidates.clone()),
                _ => Step::Wait,
            },
        }
    }

    /// Records a probe's answer.
    pub(crate) fn probed(&mut self, probe: crate::source::Probe<P>) {
        if probe.max_id.is_some() {
            self.below = probe.max_id;
        }
        if !probe.candidates.is_empty() {
            self.waiting = Some((probe.candidates, probe.mark));
        }
    }

    /// The candidates were checked; the next step probes again.
    pub(crate) fn checked(&mut self) {
        self.waiting = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::Probe;

    fn reached(done: &u64, mark: &u64) -> bool {
        done >= mark
    }

    #[test]
    fn a_row_is_stranded_only_after_the_stream_passed_the_mark() {
        let mut s = Sweep::<u64>::default();
        assert_eq!(s.step(None, reached), Step::Probe { below: None });
        // The first probe has nothing to compare with: only the highest id is noted.
        s.probed(Probe { candidates: vec![], max_id: Some(10), mark: 100 });
        assert_eq!(s.step(Some(&50), reached), Step::Probe { below: Some(10) });
        // Rows 4 and 9 are still there one interval later.
        s.probed(Probe { candidates: vec![4, 9], max_id: Some(20), mark: 200 });
        assert_eq!(s.step(Some(&150), reached), Step::Wait, "the stream has not reached the mark");
        assert_eq!(s.step(None, reached), Step::Wait);
        assert_eq!(s.step(Some(&200), reached), Step::Check(vec![4, 9]));
        s.checked();
        assert_eq!(s.step(Some(&200), reached), Step::Probe { below: Some(20) });
    }

    #[test]
    fn an_empty_table_keeps_the_last_bound() {
        let mut s = Sweep::<u64>::default();
        s.probed(Probe { candidates: vec![], max_id: Some(10), mark: 1 });
        s.probed(Probe { candidates: vec![], max_id: None, mark: 2 });
        assert_eq!(s.step(None, reached), Step::Probe { below: Some(10) });
    }
}
