//! `status` of a MySQL/MariaDB source: each stream's stored position and binlog lag, and each
//! table's pending rows and catch-up state.

use anyhow::Context;
use outbox_mysql::mysql_async::Row as MyRow;
use outbox_mysql::mysql_async::prelude::Queryable;

use super::checkpoint::{Checkpoint, StatusRow};
use crate::config::{SourceConfig, Storage};
use crate::db::StreamStatus;
use crate::names::{all_streams, checkpoint_table};

/// Every shard-partition's status (see [`crate::db::Database::status`]).
pub(super) async fn status(source: &SourceConfig) -> anyhow::Result<Vec<StreamStatus>> {
    let mut rows = Vec::new();
    let opts = super::connect::mysql_opts(source, None)?;
    let mut conn = super::connect::mysql_connect(&opts).await.with_context(|| format!("source {:?}", source.name))?;
    let checkpoint = Checkpoint::new(&checkpoint_table(&source.table_prefix));
    // MySQL 8 adds an Encrypted column: take name and size by position.
    let logs: Vec<(String, u64)> = conn
        .query::<MyRow, _>("SHOW BINARY LOGS")
        .await
        .map(|rows| rows.iter().filter_map(|r| Some((r.get::<String, _>(0)?, r.get::<u64, _>(1)?))).collect())
        .unwrap_or_default();
    let expire_s: Option<u64> = conn.query_first("SELECT @@binlog_expire_logs_seconds").await.ok().flatten();
    let retention = expire_s.and_then(|s| super::wal::retention_risk(s, source.log_retention_min_hours));
    for id in all_streams(source.shards, source.partitions) {
        let names = source.stream_names(id);
        let mut row = StreamStatus::new(id);
        if source.settings_for(id).storage == Storage::Wal {
            row.warning.clone_from(&retention);
        }
        let quoted = outbox_mysql::setup::ident(&names.table);
        row.rows_pending = conn.query_first::<i64, _>(crate::db::count_sql(&quoted)).await.ok().flatten();
        let stored: Option<StatusRow> = conn.exec_first(checkpoint.read_status(), (&names.table,)).await.ok().flatten();
        let stored_found = stored.is_some();
        match stored {
            Some((gtid, file, offset, pending, last_at, last_rows)) => {
                row.state = "checkpoint".into();
                if let (Some(file), Some(offset), false) = (&file, offset, logs.is_empty()) {
                    row.lag_bytes = Some(super::lag::binlog_bytes_after(&logs, file, offset) as i64);
                }
                row.position = Some(match gtid {
                    Some(g) => g,
                    None => format!("{}:{}", file.unwrap_or_default(), offset.unwrap_or_default()),
                });
                (row.catchup_pending, row.last_catchup_at, row.last_catchup_rows) = (Some(pending), last_at, last_rows);
            }
            None => row.state = "missing".into(),
        }
        row.checkpoint_found = stored_found;
        rows.push(row);
    }
    let _ = conn.disconnect().await;
    Ok(rows)
}
