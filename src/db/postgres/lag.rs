//! The slot-lag gauge: how much WAL each slot of a source still holds.

use metrics::gauge;
use outbox_postgres::connect::PgTarget;
use outbox_postgres::prepared::Prepared;
use outbox_postgres::slot;
use tokio::sync::watch;

use crate::db::LAG_POLL_INTERVAL;
use crate::metrics as m;

/// Publishes each slot's lag in bytes every few seconds, all slots in one statement. (The slot
/// of a shard-partition in polling mode is moved along by its own polling session, that is by
/// its owner only.)
pub(super) async fn run(source: String, target: PgTarget, slots: Vec<String>, mut stop: watch::Receiver<bool>) {
    let mut session = None;
    loop {
        if session.is_none() {
            session = target.connect().await.ok().map(|c| (c, Prepared::new(slot::LAGS)));
        }
        if let Some((client, statement)) = &mut session {
            match slot::lags(client, statement, &slots).await {
                Ok(lags) => {
                    for (name, lag) in lags {
                        if let Some(lag) = lag {
                            gauge!(m::REPLICATION_LAG_BYTES, "source" => source.clone(), "slot" => name)
                                .set(lag as f64);
                        }
                    }
                }
                Err(_) => session = None,
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(LAG_POLL_INTERVAL) => {}
            _ = stop.changed() => return,
        }
    }
}
