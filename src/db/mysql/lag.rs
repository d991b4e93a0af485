//! The binlog-lag gauge: how much binlog each stream of a source has still to read.

use std::time::Duration;

use metrics::gauge;
use outbox_mysql::mysql_async::{Conn as MyConn, Error as MyError, Opts as MyOpts, Row as MyRow};
use tokio::sync::watch;

use super::checkpoint::Checkpoint;
use crate::db::LAG_POLL_INTERVAL;
use crate::metrics as m;

/// Publishes each MySQL/MariaDB stream's lag in bytes every few seconds: the binlog written
/// after its stored checkpoint position (`SHOW BINARY LOGS`, which REPLICATION CLIENT allows).
pub(super) async fn run(source: String, opts: MyOpts, checkpoint: String, mut stop: watch::Receiver<bool>) {
    use outbox_mysql::mysql_async::prelude::Queryable;
    let mut conn: Option<MyConn> = None;
    loop {
        if conn.is_none() {
            conn = MyConn::new(opts.clone()).await.ok();
        }
        if let Some(c) = conn.as_mut() {
            let sql = Checkpoint::new(&checkpoint).read_offsets();
            let polled = async {
                // MySQL 8 adds an Encrypted column: take the first two by position.
                let rows: Vec<MyRow> = c.query("SHOW BINARY LOGS").await?;
                let logs: Vec<(String, u64)> =
                    rows.iter().filter_map(|r| Some((r.get::<String, _>(0)?, r.get::<u64, _>(1)?))).collect();
                let stored: Vec<(String, Option<String>, Option<u64>)> = c.query(sql).await?;
                Ok::<_, MyError>((logs, stored))
            };
            match tokio::time::timeout(Duration::from_secs(10), polled).await {
                Ok(Ok((logs, stored))) => {
                    for (stream, file, offset) in stored {
                        let (Some(file), Some(offset)) = (file, offset) else { continue };
                        gauge!(m::BINLOG_LAG_BYTES, "source" => source.clone(), "table" => stream)
                            .set(binlog_bytes_after(&logs, &file, offset) as f64);
                    }
                }
                _ => conn = None,
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(LAG_POLL_INTERVAL) => {}
            _ = stop.changed() => return,
        }
    }
}

/// Bytes in `logs` (name, size, in order) after `offset` in `file`.
pub(crate) fn binlog_bytes_after(logs: &[(String, u64)], file: &str, offset: u64) -> u64 {
    let Some(at) = logs.iter().position(|(name, _)| name == file) else { return 0 };
    logs[at].1.saturating_sub(offset) + logs[at + 1..].iter().map(|(_, size)| size).sum::<u64>()
}

#[cfg(test)]
mod tests {
    #[test]
    fn binlog_bytes_after_a_position() {
        let logs = vec![("b.1".to_string(), 1000), ("b.2".to_string(), 500), ("b.3".to_string(), 200)];
        assert_eq!(super::binlog_bytes_after(&logs, "b.2", 100), 600);
        assert_eq!(super::binlog_bytes_after(&logs, "b.3", 200), 0);
        assert_eq!(super::binlog_bytes_after(&logs, "gone.9", 4), 0);
    }
}
