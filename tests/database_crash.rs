//! The database itself crashes under load (issue "Database crash, restart and failover"):
//! PostgreSQL ends by its immediate shutdown (no checkpoint: the next start recovers, and the
//! slot's persisted position can be older than what the streamer confirmed); MariaDB is
//! SIGKILLed (`sync_binlog=1`, so a commit the client saw is in the binlog). The streamer
//! reconnects and resumes; checked from outside: every row whose commit the writer saw
//! succeed reaches Kafka, and so does every row whose commit answer the crash cut off but that
//! the database holds (its ledger says, see `support::load`); nothing reaches it that was
//! never inserted; per-key commit order holds.

use std::time::Instant;

use crate::support::database::Database;
use crate::support::load::{self, Target, Writer, published, wait_published_more, wait_unreachable};
use crate::support::world::{ARRIVAL, World};
use crate::support::{RestoreServices, services};

/// Three crashes of the database (`scripts/services crash <service>`, then `up`) and one fast
/// shutdown (`down`, then `up`) at seed-dependent moments while a writer inserts, then one
/// crash while the streamer is stopped: nothing lost, nothing invented, per-key order kept;
/// the duplicates and the time from each restart to the next published record are printed
/// (docs/operations.md keeps the numbers).
async fn crash_restart_under_load<D: Database>(w: World<D>, service: &'static str, target: Target) {
    // Whatever happens, the server runs again for the next test.
    let _restore = RestoreServices::new(&[&["up", service]]);
    let table = w.table(0, 0);
    let streamer = w.start("streamer-0.log");
    streamer.wait_for_state("streaming", ARRIVAL).await;
    let writer = Writer::start(target.clone(), &table, &w.topic).await;

    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    let mut recoveries = Vec::new();
    for how in ["crash", "crash", "down", "crash"] {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let at = published(&streamer).await + 100.0 + (seed % 300) as f64;
        streamer.wait_for_metric("outbox_published_records_total", &[], at, ARRIVAL).await;
        services(&[how, service]);
        // While the server is away, `/readyz` says so (not ready, and why).
        wait_unreachable(&streamer).await;
        services(&["up", service]);
        let restarted = Instant::now();
        wait_published_more(&streamer, 1.0).await;
        recoveries.push((how, restarted.elapsed()));
    }
    // The server crashes while the streamer is stopped; the next one starts after it is back.
    assert!(streamer.stop(), "the streamer stopped cleanly");
    services(&["crash", service]);
    services(&["up", service]);
    let streamer = w.start("streamer-1.log");
    wait_published_more(&streamer, 200.0).await;
    let outcome = load::finish_and_check(writer, &target, &table, &w.topic, w.kafka_partitions).await;
    eprintln!("{service} crashes and restarts: {outcome}; first record after each restart: {recoveries:?}");
    assert!(streamer.stop(), "the streamer stopped cleanly");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_crash_restart_under_load_loses_nothing() {
    let w = World::postgres("pcr").exclusive().build().await;
    let target = Target::Postgres { url: w.db.admin_url.clone(), synchronous: false };
    crash_restart_under_load(w, "postgres", target).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_crash_restart_under_load_loses_nothing() {
    let w = World::mysql("mcr").exclusive().build().await;
    let target = Target::MariaDb { url: w.db.admin_url.clone() };
    crash_restart_under_load(w, "mariadb", target).await;
}
