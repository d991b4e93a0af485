//! The WAL heartbeat: a logical message written at a fixed interval, so every slot of the
//! database sees a recent position even when the whole server is idle (a slot whose tables
//! see no writes would otherwise hold WAL back).

use std::time::Duration;

use outbox_postgres::connect::PgTarget;
use tokio::sync::watch;

/// The prefix of heartbeat messages in the WAL.
pub(crate) const HEARTBEAT_PREFIX: &str = "outbox-streamer-heartbeat";

/// Writes a non-transactional logical message every `interval`, so every slot of the database
/// sees a recent position even when the whole server is idle. Failures are logged once per
/// streak and retried; they never stop streaming.
pub(super) async fn run(target: PgTarget, interval: Duration, mut stop: watch::Receiver<bool>) {
    let mut client = None;
    let mut failing = false;
    let mut tick = tokio::time::interval(interval);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        if client.is_none() {
            client = target.connect().await.ok();
        }
        let result = match &client {
            Some(c) => c
                .execute(
                    // The bytea overload: the one `setup --restrict-emit` grants the streamer.
                    "SELECT pg_logical_emit_message(false, $1, convert_to(now()::text, 'UTF8'))",
                    &[&HEARTBEAT_PREFIX],
                )
                .await
                .map(|_| ())
                .map_err(|e| outbox_postgres::setup::describe(&e)),
            None => Err(format!("cannot connect to {}", target.display())),
        };
        match result {
            Ok(()) if failing => {
                failing = false;
                tracing::info!("heartbeat restored");
            }
            Ok(()) => {}
            Err(e) => {
                client = None;
                if !failing {
                    failing = true;
                    tracing::warn!(error = %e, "heartbeat failed; retrying every interval");
                }
            }
        }
    }
}
