//! The slot-lag gauge: how much WAL each slot of a source still holds.

use metrics::gauge;
use outbox_postgres::connect::PgTarget;
use tokio::sync::watch;

use crate::db::LAG_POLL_INTERVAL;
use crate::metrics as m;

/// Publishes each slot's lag in bytes every few seconds. (The slot of a shard-partition in
/// polling mode is moved along by its own polling session, that is by its owner only.)
pub(super) async fn run(source: String, target: PgTarget, slots: Vec<String>, mut stop: watch::Receiver<bool>) {
    let mut client = None;
    loop {
        if client.is_none() {
            client = target.connect().await.ok();
        }
        if let Some(c) = &client {
            for name in &slots {
                match outbox_postgres::slot::state(c, name).await {
                    Ok(st) => {
                        if let Some(lag) = st.lag_bytes {
                            gauge!(m::REPLICATION_LAG_BYTES, "source" => source.clone(), "slot" => name.clone())
                                .set(lag as f64);
                        }
                    }
                    Err(_) => {
                        client = None;
                        break;
                    }
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(LAG_POLL_INTERVAL) => {}
            _ = stop.changed() => return,
        }
    }
}
