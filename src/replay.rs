//! The replay filter of a CDC source: which transactions of a restarted log this stream already
//! published.
//!
//! A log restarts from the stored position, which can lie before what this stream published
//! and deleted (a slot's status update lost in a crash; a MariaDB resume position held back
//! behind a prepared XA transaction; a prefix finished before anything was read). The source
//! keeps a *mark* — stored in the same database transaction as the delete — and the filter
//! skips the rows of every transaction the mark covers. Commits arrive in commit order, so
//! the first transaction the mark does not cover ends the replay for the session.
//!
//! Pure: the source says whether the mark covers a transaction (`final_lsn < mark`, a GTID
//! set containing the GTID) and counts the metric; nothing here reads the database.

/// See the module docs. `M` is the source's mark (an LSN, a GTID position).
#[derive(Debug)]
pub(crate) struct ReplayFilter<M> {
    mark: Option<M>,
    /// The transaction being read is a replay.
    replaying: bool,
    /// Rows skipped since the session started.
    skipped: u64,
    /// A transaction began in this session.
    read_any: bool,
}

impl<M> ReplayFilter<M> {
    /// `mark`: what the stored checkpoint says this stream published (none: nothing to skip).
    pub(crate) fn new(mark: Option<M>) -> Self {
        Self { mark, replaying: false, skipped: 0, read_any: false }
    }

    /// A transaction begins; `covers` says whether the mark covers it. Returns whether it is
    /// a replay (its rows are skipped). The first transaction not covered ends the replay.
    pub(crate) fn begin(&mut self, covers: impl FnOnce(&M) -> bool) -> bool {
        self.read_any = true;
        self.replaying = self.mark.as_ref().is_some_and(covers);
        if !self.replaying && self.mark.take().is_some() && self.skipped > 0 {
            tracing::info!(
                skipped = self.skipped,
                "replay done: rows of transactions this stream had already published were not sent again"
            );
        }
        self.replaying
    }

    /// A row of the transaction being read: true (and counted) when it is skipped.
    pub(crate) fn skip_row(&mut self) -> bool {
        if self.replaying {
            self.skipped += 1;
        }
        self.replaying
    }

    /// A finish stored `mark` before this session read anything (the prefix a failed session
    /// left): the log restarted before it, so what it covers is skipped too. Once reading
    /// began, a finish covers only what was read, and the mark is not needed.
    pub(crate) fn finished(&mut self, mark: M) {
        if !self.read_any {
            self.mark = Some(mark);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn below(lsn: u64) -> impl FnOnce(&u64) -> bool {
        move |mark| lsn < *mark
    }

    #[test]
    fn skips_covered_transactions_until_the_first_new_one() {
        let mut f = ReplayFilter::new(Some(100));
        assert!(f.begin(below(10)));
        assert!(f.skip_row() && f.skip_row());
        assert!(f.begin(below(50)));
        assert!(!f.begin(below(100)));
        assert!(!f.skip_row());
        // The replay is over: nothing later is skipped, whatever the source says.
        assert!(!f.begin(|_| true));
        assert_eq!(f.skipped, 2);
    }

    #[test]
    fn without_a_mark_nothing_is_skipped() {
        let mut f = ReplayFilter::<u64>::new(None);
        assert!(!f.begin(|_| true));
        assert!(!f.skip_row());
    }

    #[test]
    fn a_finish_before_reading_sets_the_mark_and_one_after_does_not() {
        let mut f = ReplayFilter::new(Some(5));
        f.finished(40);
        assert!(f.begin(below(20)));
        let mut g = ReplayFilter::<u64>::new(None);
        assert!(!g.begin(below(1)));
        g.finished(40);
        assert!(!g.begin(below(20)));
    }
}
