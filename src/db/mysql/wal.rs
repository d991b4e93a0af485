//! `storage = "wal"` on MySQL/MariaDB: the shard-partition's table is a `BLACKHOLE` table, so
//! the server writes each inserted row to the binlog and stores nothing. A row's `id` means
//! nothing there (BLACKHOLE's AUTO_INCREMENT restarts with every statement), so a message's
//! identity is its transaction's GTID sequence number and its place among the transaction's
//! rows of this table: `outbox-id = seq × 2^24 + place`, unique within a GTID domain and stable
//! across replays; `outbox-gtid` names the transaction.

use outbox_mysql::binlog::TxnId;

use crate::error::Error;
use crate::poll::PolledRow;
use crate::record::InvalidRow;

/// Rows of one transaction a `wal` shard-partition can identify.
const PLACES: u64 = 1 << 24;

/// Turns the record of the `place`-th row of `txn` into a WAL-only message.
pub(super) fn message(row: PolledRow, txn: &TxnId, place: u64) -> PolledRow {
    let at = format!("GTID {txn} row {place}");
    let seq = match txn {
        TxnId::MariaDb(gtid) => Some(gtid.seq),
        TxnId::MySql { gno, .. } => Some(*gno),
        TxnId::Anonymous => None,
    };
    let id = match seq {
        None => {
            return Err(InvalidRow::new(
                None,
                "id",
                "the transaction has no GTID (gtid_mode=OFF), so a WAL-only message has no identity; enable GTIDs",
            )
            .at_message(at));
        }
        Some(seq) if place >= PLACES || seq >= 1 << 39 => {
            return Err(InvalidRow::new(
                None,
                "id",
                format!("a transaction may hold at most {} WAL-only messages of one shard-partition", PLACES - 1),
            )
            .at_message(at));
        }
        Some(seq) => ((seq << 24) | place) as i64,
    };
    match row {
        Ok(mut record) => {
            record.id = id;
            record.in_table = false;
            Ok(record)
        }
        Err(mut invalid) => {
            invalid.id = Some(id);
            Err(invalid.at_message(at))
        }
    }
}

/// A statement-logged insert into a BLACKHOLE table: the binlog holds SQL text, not the row,
/// and the table stores nothing, so the message cannot be read — the shard-partition halts.
pub(super) fn statement_write(table: &str, txn: &str, stream: &str) -> Error {
    Error::definite(
        format!(
            "transaction {txn} inserted into the BLACKHOLE table {table} with binlog_format=STATEMENT or MIXED: the binlog holds the statement, not the rows, and the table stores nothing, so its messages cannot be published"
        ),
        format!(
            "set binlog_format=ROW for every session that writes the outbox (SET GLOBAL binlog_format=ROW, and reconnect them); then discard that transaction's messages with `outbox-streamer skip --stream {stream} --transaction {txn}` after telling its writer"
        ),
    )
}

/// The stored binlog position of a `wal` shard-partition was purged: the messages after it
/// are gone with the binlog (the table holds none), so the stream halts — never a silent
/// catch-up to the current position.
pub(super) fn position_purged(position: &str, stream: &str) -> Error {
    Error::definite(
        format!(
            "the stored binlog position {position} is not in the server's binlog (purged, or a promoted replica that did not log what it replicated); with storage = \"wal\" the messages committed after it could not be read and are not in any table: they may be lost"
        ),
        format!(
            "find out what was lost (the applications' logs, a replica's or a backup's binlog), then resume at the current position with `outbox-streamer skip --stream {stream} --backlog`; keep binlogs longer than any outage (binlog_expire_logs_seconds) and log_slave_updates = ON on every replica that may be promoted"
        ),
    )
}

/// What binlog expiry (`binlog_expire_logs_seconds`, 0 = never) risks for `storage = "wal"`
/// below `min_hours` (`log_retention_min_hours`).
pub(super) fn retention_risk(expire_s: u64, min_hours: u64) -> Option<String> {
    (expire_s > 0 && expire_s < min_hours * 3600).then(|| {
        format!(
            "binlog_expire_logs_seconds = {expire_s} ({:.1} h) is below log_retention_min_hours = {min_hours}: a streamer stopped longer than that finds its position purged, and the WAL-only messages after it are lost; raise it (SET GLOBAL binlog_expire_logs_seconds = {}, and in the server's configuration)",
            expire_s as f64 / 3600.0,
            min_hours * 3600
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::RawRow;
    use outbox_mysql::gtid::Gtid;

    fn row() -> PolledRow {
        RawRow { topic: Some(b"t".to_vec()), ..RawRow::default() }.into_record(1)
    }

    #[test]
    fn identity_is_the_gtid_sequence_and_the_place() {
        let txn = TxnId::MariaDb(Gtid { domain: 0, server: 1, seq: 42 });
        let first = message(row(), &txn, 0).unwrap();
        let second = message(row(), &txn, 1).unwrap();
        assert_eq!((first.id, second.id), (42 << 24, (42 << 24) + 1));
        assert!(!first.in_table);
        let bad = message(RawRow::default().into_record(1), &txn, 2).unwrap_err();
        assert_eq!(bad.id, Some((42 << 24) + 2));
        assert!(bad.to_string().starts_with("message at GTID 0-1-42 row 2"), "{bad}");
        let too_many = message(row(), &txn, PLACES).unwrap_err();
        assert!(too_many.reason.contains("at most"), "{too_many}");
        assert!(message(row(), &TxnId::Anonymous, 0).unwrap_err().reason.contains("no GTID"));
    }

    #[test]
    fn binlog_expiry_below_the_margin_is_a_risk() {
        assert_eq!(retention_risk(0, 168), None, "never expires");
        assert_eq!(retention_risk(168 * 3600, 168), None);
        let risk = retention_risk(86_400, 168).unwrap();
        assert!(risk.contains("24.0 h") && risk.contains("604800"), "{risk}");
    }
}
