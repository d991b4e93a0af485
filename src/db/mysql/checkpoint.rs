//! A MySQL/MariaDB shard-partition's row in `<prefix>_checkpoint`: every statement the streamer,
//! the catch-up, `skip`, `status` and the lag gauge run against it, in one place.
//!
//! The row holds what the binlog cannot: the position to resume from (`gtid`, or
//! `binlog_file` + `binlog_pos` without GTIDs), `done_gtid` when the resume position is held
//! back behind a prepared XA transaction (what lies between was handled; a replay skips it),
//! the owner epoch that fences a previous owner's writes, the catch-up state and the
//! operator's skip lists. The table, its columns and the first row of each stream are created
//! by `outbox_mysql::setup` (and removed by `outbox_mysql::teardown`); nothing here creates
//! or alters it.
//!
//! Every write that an owner makes is guarded by `owner_epoch <= ?` (its own epoch): once a
//! newer owner claimed the row, the old one's writes match no row and it stops as fenced.

use outbox_mysql::setup::ident;

/// The statements of one checkpoint table (its name quoted once).
#[derive(Debug, Clone)]
pub(super) struct Checkpoint {
    quoted: String,
}

/// What a CDC session reads when it starts: gtid, binlog_file, binlog_pos, owner_epoch,
/// catchup_pending, done_gtid, skip_ids, skip_transactions.
pub(super) type SessionRow =
    (Option<String>, Option<String>, Option<u64>, i64, bool, Option<String>, Option<String>, Option<String>);

/// What `status` shows: gtid, binlog_file, binlog_pos, catchup_pending, last catch-up time
/// (as text) and rows.
pub(super) type StatusRow = (Option<String>, Option<String>, Option<u64>, bool, Option<String>, Option<i64>);

impl Checkpoint {
    pub(super) fn new(table: &str) -> Self {
        Self { quoted: ident(table) }
    }

    /// Reads a stream's [`SessionRow`]; binds the stream.
    pub(super) fn read_session(&self) -> String {
        format!(
            "SELECT gtid, binlog_file, binlog_pos, owner_epoch, catchup_pending, done_gtid, skip_ids, skip_transactions
             FROM {} WHERE stream = ?",
            self.quoted
        )
    }

    /// Takes the row for a newer owner; binds epoch, stream, epoch. No row changed: fenced.
    pub(super) fn claim(&self) -> String {
        format!("UPDATE {} SET owner_epoch = ? WHERE stream = ? AND owner_epoch <= ?", self.quoted)
    }

    /// Stores the position after a cleanup, in the delete's transaction; binds gtid, file,
    /// offset, done_gtid, epoch, stream, epoch. No row changed: fenced.
    pub(super) fn store(&self) -> String {
        format!(
            "UPDATE {} SET gtid = ?, binlog_file = ?, binlog_pos = ?, done_gtid = ?, owner_epoch = ?
             WHERE stream = ? AND owner_epoch <= ?",
            self.quoted
        )
    }

    /// Polling's fence, inside its delete's transaction: the stored owner epoch, locked
    /// against a claim until the delete commits; binds the stream.
    pub(super) fn lock_epoch(&self) -> String {
        format!("SELECT owner_epoch FROM {} WHERE stream = ? LOCK IN SHARE MODE", self.quoted)
    }

    /// Marks a catch-up as needed before the stream streams again; binds stream, epoch.
    pub(super) fn mark_catchup_pending(&self) -> String {
        format!(
            "UPDATE {} SET catchup_pending = 1, catchup_started_at = NOW(6) WHERE stream = ? AND owner_epoch <= ?",
            self.quoted
        )
    }

    /// A catch-up's new position, stored before it drains the table; binds gtid, file,
    /// offset, done_gtid (the snapshot's position when the stream resumes before it, behind an
    /// XA prepare), stream, epoch.
    pub(super) fn restart_at(&self) -> String {
        format!(
            "UPDATE {} SET gtid = ?, binlog_file = ?, binlog_pos = ?, done_gtid = ?, catchup_pending = 1,
                 catchup_started_at = NOW(6)
             WHERE stream = ? AND owner_epoch <= ?",
            self.quoted
        )
    }

    /// A catch-up that drained the table; binds rows, stream, epoch.
    pub(super) fn catchup_done(&self) -> String {
        format!(
            "UPDATE {} SET catchup_pending = 0, last_catchup_at = NOW(6), last_catchup_rows = ?
             WHERE stream = ? AND owner_epoch <= ?",
            self.quoted
        )
    }

    /// `skip`: the skip lists, locked until the command's transaction ends; binds the stream.
    pub(super) fn read_skips(&self) -> String {
        format!("SELECT skip_ids, skip_transactions FROM {} WHERE stream = ? FOR UPDATE", self.quoted)
    }

    /// `skip`: the new skip lists; binds ids, transactions, stream.
    pub(super) fn write_skips(&self) -> String {
        format!("UPDATE {} SET skip_ids = ?, skip_transactions = ? WHERE stream = ?", self.quoted)
    }

    /// `skip --backlog`: the position after the backlog it deleted; binds gtid, file, offset,
    /// stream.
    pub(super) fn skip_to(&self) -> String {
        format!(
            "UPDATE {} SET gtid = ?, binlog_file = ?, binlog_pos = ?, done_gtid = NULL WHERE stream = ?",
            self.quoted
        )
    }

    /// Reads a stream's [`StatusRow`]; binds the stream.
    pub(super) fn read_status(&self) -> String {
        format!(
            "SELECT gtid, binlog_file, binlog_pos, catchup_pending, CAST(last_catchup_at AS CHAR), last_catchup_rows
             FROM {} WHERE stream = ?",
            self.quoted
        )
    }

    /// Every stream's stored file and offset, for the lag gauge.
    pub(super) fn read_offsets(&self) -> String {
        format!("SELECT stream, binlog_file, binlog_pos FROM {}", self.quoted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_owner_write_is_guarded_by_the_epoch() {
        let c = Checkpoint::new("outbox_checkpoint");
        for sql in [c.claim(), c.store(), c.mark_catchup_pending(), c.restart_at(), c.catchup_done()] {
            assert!(sql.contains("`outbox_checkpoint`"), "{sql}");
            assert!(sql.trim_end().ends_with("AND owner_epoch <= ?"), "{sql}");
        }
    }
}
