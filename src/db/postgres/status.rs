//! `status` of a PostgreSQL source: each slot's state, position and lag, and each table's
//! pending rows and catch-up state.

use anyhow::Context;
use outbox_postgres::setup::ident;
use outbox_postgres::slot;

use crate::config::{SourceConfig, Storage};
use crate::db::{PENDING_COUNT_CAP, SlotProblem, StreamStatus};
use crate::names::{all_streams, checkpoint_table};

/// Every shard-partition's status (see [`crate::db::Database::status`]).
pub(super) async fn status(source: &SourceConfig) -> anyhow::Result<Vec<StreamStatus>> {
    let mut rows = Vec::new();
    let target = super::connect::pg_target(source, None)?;
    let client = target.connect().await.with_context(|| format!("connecting to {}", target.display()))?;
    let checkpoint = checkpoint_table(&source.table_prefix);
    let keep_size: Option<String> = client.query_one("SHOW max_slot_wal_keep_size", &[]).await.ok().map(|r| r.get(0));
    for id in all_streams(source.shards, source.partitions) {
        let names = source.stream_names(id);
        let st = slot::state(&client, &names.slot).await?;
        let mut row = StreamStatus::new(id);
        row.rows_pending =
            client.query_one(&crate::db::count_sql(&ident(&names.table)), &[]).await.ok().map(|r| r.get(0));
        let catchup = client
            .query_opt(
                &format!(
                    "SELECT catchup_pending, last_catchup_at::text, last_catchup_rows FROM {} WHERE stream = $1",
                    ident(&checkpoint)
                ),
                &[&names.table],
            )
            .await
            .ok()
            .flatten();
        if let Some(c) = &catchup {
            (row.catchup_pending, row.last_catchup_at, row.last_catchup_rows) = (c.get(0), c.get(1), c.get(2));
        }
        row.state = match (&st.other_database, st.exists) {
            (Some(db), _) => format!("other-db:{db}"),
            (None, true) => st.wal_status.clone().unwrap_or_else(|| "unknown".into()),
            (None, false) => "missing".into(),
        };
        match (&st.other_database, st.exists) {
            (Some(db), _) => row.slot_problem = Some(SlotProblem::OtherDatabase(db.clone())),
            (None, false) => row.slot_problem = Some(SlotProblem::Missing),
            (None, true) if row.state == "lost" => row.slot_problem = Some(SlotProblem::Lost),
            (None, true) => {}
        }
        row.checkpoint_found = catchup.is_some();
        row.position = st.confirmed_flush.map(|l| l.to_string());
        row.slot = Some(names.slot.clone());
        row.active_pid = st.active_pid;
        row.lag_bytes = st.lag_bytes;
        if source.settings_for(id).storage == Storage::Wal {
            row.warning = keep_size.as_deref().and_then(outbox_postgres::setup::wal_retention_risk);
            // A peek needs the slot free; a running streamer's lag is in lag_bytes.
            if st.exists && st.active_pid.is_none() && row.slot_problem.is_none() {
                let objects = super::objects(names.clone(), true);
                row.messages_pending =
                    outbox_postgres::teardown::count_waiting(&client, &objects, Some(PENDING_COUNT_CAP)).await.ok();
            }
        }
        rows.push(row);
    }
    Ok(rows)
}
