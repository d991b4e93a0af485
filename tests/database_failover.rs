//! The primary database dies under load and a standby is promoted (issue "Database crash,
//! restart and failover"). Checked from outside: every row the promoted server holds (its
//! ledger, see `support::load`) reaches Kafka, nothing that was never inserted does, per-key
//! commit order holds; the history change is counted.
//!
//! - Synchronous standby (PostgreSQL `synchronous_commit = on` for the writer's sessions,
//!   MariaDB semi-sync): every commit the writer saw is on the promoted server.
//! - A standby cut off before the crash while the writer and the streamer went on: the promoted
//!   server lacks acknowledged commits (the database's loss, counted, some already in Kafka)
//!   and gives their ids to new rows, which must all be sent (nothing remembered by id from
//!   the old primary is applied to it).
//! - PostgreSQL: the streamer's URL names both servers (`host1:port1,host2:port2`); the
//!   promoted standby has no logical slot (PostgreSQL 15 copies none), so the stream finds it
//!   missing and the catch-up publishes from the table.
//! - MariaDB: the streamer and the writer reach the database through one address that moves to
//!   the replica (a proxy here; a virtual IP or a DNS name in production). The checkpoint came
//!   along with the data; with `log_slave_updates` the replica's binlog holds the primary's
//!   GTIDs and the stream resumes by GTID, without it the position is not there and the
//!   catch-up runs.

use std::time::Instant;

use crate::support::load::{self, Outcome, Target, Writer, wait_published_more, wait_unreachable};
use crate::support::metrics::{sample, try_get};
use crate::support::mysql::MyDb;
use crate::support::proxy::Proxy;
use crate::support::world::{ARRIVAL, World, WorldBuilder};
use crate::support::{RestoreServices, env, services, wait_until};

/// `host:port` of a `scheme://user:password@host:port/database` URL.
fn host_port(url: &str) -> &str {
    let after = url.rsplit_once('@').expect("a URL with a user").1;
    after.split('/').next().expect("host:port")
}

/// The world's config with the database address `from` replaced by `to` in its URL.
fn repoint_config<D>(w: &World<D>, from: &str, to: &str) {
    let text = std::fs::read_to_string(&w.config).expect("reading the config");
    let moved = text.replace(&format!("@{from}/"), &format!("@{to}/"));
    assert_ne!(text, moved, "the config names {from}");
    std::fs::write(&w.config, moved).expect("writing the config");
}

/// How the standby (replica) kept up with the primary until the primary died.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Standby {
    /// Every commit of the writer waited for it (PostgreSQL `synchronous_commit = on`,
    /// MariaDB semi-sync).
    Synchronous,
    /// Cut off from the primary (PostgreSQL: its `primary_conninfo` emptied; MariaDB: its IO
    /// thread stopped) while the writer and the streamer went on: the promoted server lacks
    /// what the primary committed since, some of it already in Kafka, and gives the ids of
    /// those rows to new ones.
    Behind,
}

/// The counter of sessions that found another database history (a failover) than the last.
async fn history_changes(streamer: &crate::support::streamer::Running) -> f64 {
    let text = try_get(streamer.metrics_addr(), "/metrics").await.unwrap_or_default();
    sample(&text, "outbox_database_history_changes_total", &[]).unwrap_or(0.0)
}

/// Checks the run: everything the promoted server holds reached Kafka (ledger-checked, see
/// `support::load`); with a standby that was behind, the database itself lost acknowledged
/// commits (not ours to send), otherwise none.
async fn finish(
    writer: Writer,
    target: &Target,
    table: &str,
    w_topic: &str,
    partitions: i32,
    standby: Standby,
) -> Outcome {
    let outcome = load::finish_and_check_any_loss(writer, target, table, w_topic, partitions).await;
    match standby {
        Standby::Synchronous => assert_eq!(outcome.lost_by_database, 0, "synchronous commits: {outcome}"),
        Standby::Behind => assert!(outcome.lost_by_database > 0, "the cut-off standby lacks commits: {outcome}"),
    }
    outcome
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_failover_to_a_promoted_standby_loses_nothing() {
    postgres_failover("pfo", Standby::Synchronous).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_failover_to_a_standby_behind_sends_all_it_holds() {
    postgres_failover("pfb", Standby::Behind).await;
}

/// Crash the primary under load and promote the standby; checked from outside. A standby
/// `Behind` loses acknowledged commits (the database's loss, counted); everything the promoted
/// server holds still reaches Kafka.
async fn postgres_failover(name: &str, standby_kind: Standby) {
    let w = World::postgres(name).exclusive().build().await;
    // Whatever happens: the promoted standby is thrown away and the old primary runs again.
    let _restore = RestoreServices::new(&[&["down", "postgres-standby"], &["up", "postgres"]]);
    services(&["up", "postgres-standby"]);
    let primary = host_port(&w.db.admin_url).to_string();
    let standby = format!("127.0.0.1:{}", env("OUTBOX_PG_STANDBY_PORT"));
    let admin = crate::support::pg::connect(&w.db.admin_url).await;
    wait_until("the standby to stream synchronously", ARRIVAL, || async {
        let row = admin
            .query_opt("SELECT 1 FROM pg_stat_replication WHERE state = 'streaming' AND sync_state = 'sync'", &[])
            .await
            .ok()?;
        row.map(|_| ())
    })
    .await;
    let both = format!("{primary},{standby}");
    repoint_config(&w, &primary, &both);
    let admin_both = w.db.admin_url.replace(&format!("@{primary}/"), &format!("@{both}/"));
    let synchronous = standby_kind == Standby::Synchronous;
    let target = Target::Postgres { url: format!("{admin_both}?target_session_attrs=read-write"), synchronous };
    let table = w.table(0, 0);

    let streamer = w.start("streamer.log");
    streamer.wait_for_state("streaming", ARRIVAL).await;
    let writer = Writer::start(target.clone(), &table, &w.topic).await;
    streamer.wait_for_metric("outbox_published_records_total", &[], 300.0, ARRIVAL).await;
    if standby_kind == Standby::Behind {
        let standby_url = w.db.admin_url.replace(&format!("@{primary}/"), &format!("@{standby}/"));
        let on_standby = crate::support::pg::connect(&standby_url).await;
        on_standby.batch_execute("ALTER SYSTEM SET primary_conninfo = ''").await.unwrap();
        on_standby.batch_execute("SELECT pg_reload_conf()").await.unwrap();
        wait_until("the standby to stop receiving", ARRIVAL, || async {
            let row = admin
                .query_opt("SELECT 1 FROM pg_stat_replication WHERE application_name = 'outbox_standby'", &[])
                .await
                .ok()?;
            row.is_none().then_some(())
        })
        .await;
        // What the primary commits and the streamer publishes from now on is not on the standby.
        wait_published_more(&streamer, 200.0).await;
    }
    drop(admin);

    services(&["crash", "postgres"]);
    let fault = Instant::now();
    wait_unreachable(&streamer).await;
    let before = load::published(&streamer).await;
    services(&["promote", "postgres-standby"]);
    streamer.wait_for_metric("outbox_published_records_total", &[], before + 1.0, ARRIVAL).await;
    let first_after = fault.elapsed();
    // The slot is missing on the promoted standby: the catch-up ran, then streaming resumed.
    streamer.wait_for_metric("outbox_catchups_total", &[], 1.0, ARRIVAL).await;
    streamer.wait_for_state("streaming", ARRIVAL).await;
    wait_published_more(&streamer, 200.0).await;
    let outcome = finish(writer, &target, &table, &w.topic, w.kafka_partitions, standby_kind).await;
    eprintln!(
        "postgres failover to a promoted standby ({standby_kind:?}): {outcome}; first record {first_after:?} after the crash"
    );
    // A new timeline: nothing remembered by id from the old one was applied to it.
    assert!(history_changes(&streamer).await >= 1.0, "the promotion was seen as another history");
    assert!(streamer.stop(), "the streamer stopped cleanly");
}

/// How the promoted replica kept the primary's transactions in its binlog.
#[derive(Clone, Copy, Debug)]
enum ReplicaBinlog {
    /// `log_slave_updates = ON`: the stored GTID is in its binlog; the stream resumes by it.
    Kept,
    /// `log_slave_updates = OFF`: only the replica's own writes are; the server refuses the
    /// stored GTID as not in its binlog, so the catch-up publishes from the table.
    Own,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_failover_to_a_promoted_replica_loses_nothing() {
    let world = World::mysql("mfo").start_first("mariadb-replica");
    mariadb_failover(world, ReplicaBinlog::Kept, Standby::Synchronous).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_failover_to_a_replica_without_the_position_catches_up() {
    let off: &'static [(&str, &str)] = &[("OUTBOX_MYSQL_REPLICA_LOG_UPDATES", "OFF")];
    let world = World::mysql("mfc").start_first_with("mariadb-replica", off);
    mariadb_failover(world, ReplicaBinlog::Own, Standby::Synchronous).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_failover_to_a_replica_behind_sends_all_it_holds() {
    let world = World::mysql("mfb").start_first("mariadb-replica");
    mariadb_failover(world, ReplicaBinlog::Kept, Standby::Behind).await;
}

/// Crash the primary under load, move the address to the replica, promote it; checked from
/// outside, and the catch-ups counted against what `binlog` lets the stream do.
async fn mariadb_failover(world: WorldBuilder<MyDb>, binlog: ReplicaBinlog, standby: Standby) {
    // The replica starts before the world's database exists, so it replicates all of it.
    let w = world.build().await;
    // Whatever happens: the promoted replica is thrown away and the old primary runs again
    // (a restart also ends the semi-sync switched on below).
    let _restore = RestoreServices::new(&[&["down", "mariadb-replica"], &["crash", "mariadb"], &["up", "mariadb"]]);
    let primary = host_port(&w.db.admin_url).to_string();
    let replica = format!("127.0.0.1:{}", env("OUTBOX_MYSQL_REPLICA_PORT"));
    let replica_url = w.db.admin_url.replace(&format!("@{primary}/"), &format!("@{replica}/"));
    if standby == Standby::Synchronous {
        use mysql_async::prelude::Queryable;
        let mut admin = w.admin().await;
        admin
            .query_drop(
                "SET GLOBAL rpl_semi_sync_master_wait_point = AFTER_SYNC, rpl_semi_sync_master_timeout = 600000, \
                 rpl_semi_sync_master_enabled = ON",
            )
            .await
            .unwrap();
        // The replica's receiver registers as semi-sync when it connects: reconnect it.
        let mut r = mysql_async::Conn::new(mysql_async::Opts::from_url(&replica_url).unwrap()).await.unwrap();
        r.query_drop("STOP SLAVE IO_THREAD; START SLAVE IO_THREAD").await.unwrap();
        r.disconnect().await.unwrap();
        admin.disconnect().await.unwrap();
        wait_until("the primary to commit semi-synchronously", ARRIVAL, || async {
            let mut c = w.admin().await;
            let on: Option<(String, String)> =
                c.query_first("SHOW GLOBAL STATUS WHERE Variable_name = 'Rpl_semi_sync_master_status'").await.ok()?;
            let _ = c.disconnect().await;
            (on?.1 == "ON").then_some(())
        })
        .await;
    }
    let proxy = Proxy::start(primary.parse().unwrap()).await;
    let via_proxy = proxy.addr.to_string();
    repoint_config(&w, &primary, &via_proxy);
    let target = Target::MariaDb { url: w.db.admin_url.replace(&format!("@{primary}/"), &format!("@{via_proxy}/")) };
    let table = w.table(0, 0);

    let streamer = w.start("streamer.log");
    streamer.wait_for_state("streaming", ARRIVAL).await;
    let writer = Writer::start(target.clone(), &table, &w.topic).await;
    streamer.wait_for_metric("outbox_published_records_total", &[], 300.0, ARRIVAL).await;
    if standby == Standby::Behind {
        use mysql_async::prelude::Queryable;
        let mut r = mysql_async::Conn::new(mysql_async::Opts::from_url(&replica_url).unwrap()).await.unwrap();
        r.query_drop("STOP SLAVE IO_THREAD").await.unwrap();
        r.disconnect().await.unwrap();
        // What the primary commits and the streamer publishes from now on is not on the replica.
        wait_published_more(&streamer, 200.0).await;
    }

    services(&["crash", "mariadb"]);
    let fault = Instant::now();
    wait_unreachable(&streamer).await;
    let before = load::published(&streamer).await;
    // The address moves before the promotion, as it may under pressure: a read-only replica
    // refuses the streamer's writes, which it retries.
    proxy.retarget(replica.parse().unwrap());
    services(&["promote", "mariadb-replica"]);
    streamer.wait_for_metric("outbox_published_records_total", &[], before + 1.0, ARRIVAL).await;
    let first_after = fault.elapsed();
    wait_published_more(&streamer, 200.0).await;
    let outcome = finish(writer, &target, &table, &w.topic, w.kafka_partitions, standby).await;
    let text = try_get(streamer.metrics_addr(), "/metrics").await.unwrap_or_default();
    let catchups = sample(&text, "outbox_catchups_total", &[]).unwrap_or(0.0);
    eprintln!(
        "mariadb failover to a promoted replica ({binlog:?}, {standby:?}): {outcome}; first record {first_after:?} after the crash; catch-ups: {catchups}"
    );
    assert!(history_changes(&streamer).await >= 1.0, "another server_id: another history");
    match binlog {
        ReplicaBinlog::Kept => {
            assert_eq!(catchups, 0.0, "the stream resumed by GTID on the replica, without a catch-up")
        }
        ReplicaBinlog::Own => {
            assert!(catchups >= 1.0, "the position was not in the replica's binlog: a catch-up ran");
            let log = streamer.wait_for_log("catching up by polling", ARRIVAL).await;
            assert!(log.contains("promoted replica that did not log"), "the reason names a failover: {log}");
        }
    }
    assert!(streamer.stop(), "the streamer stopped cleanly");
    drop(proxy);
}
