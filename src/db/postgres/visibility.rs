//! Waiting until a transaction that logical decoding already sent is visible to queries.
//!
//! PostgreSQL writes and flushes a commit record, and only then marks the transaction as
//! ended for other sessions' snapshots. The walsender may decode and send the transaction in
//! between, so a query right after the commit arrives can still miss its rows: a `DELETE`
//! deletes nothing and an existence check finds nothing. The transaction holds the lock on its
//! own id until after it has become visible, so once that lock is gone, so is the gap.

use std::time::Duration;

use tokio_postgres::Client;

use crate::error::Error;
use crate::source::within;

/// How long one wait lasts. A transaction can stay invisible for longer (its session waits
/// for a synchronous standby): then the session restarts and reads it again later, rather
/// than skip a row or confirm a position with the row left in the table.
const LIMIT: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(2);

/// Returns once none of `xids` still holds its transaction lock; a transient error after
/// [`LIMIT`].
pub(super) async fn wait(sql: &Client, xids: &[u32]) -> Result<(), Error> {
    if xids.is_empty() {
        return Ok(());
    }
    let ids: Vec<String> = xids.iter().map(u32::to_string).collect();
    let deadline = tokio::time::Instant::now() + LIMIT;
    loop {
        let running: i64 = within(
            "waiting for a committed transaction to become visible",
            sql.query_one(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'transactionid' AND transactionid::text = ANY($1)",
                &[&ids],
            ),
        )
        .await?
        .get(0);
        if running == 0 {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::transient(format!(
                "transactions {xids:?} are committed in the WAL but still not visible after {LIMIT:?} (waiting for a synchronous standby?); reading them again later"
            )));
        }
        tokio::time::sleep(POLL).await;
    }
}
