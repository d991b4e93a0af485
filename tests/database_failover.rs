//! The primary database dies under load and a standby is promoted (issue "Database crash,
//! restart and failover"). The writer commits synchronously to the standby (PostgreSQL
//! `synchronous_commit = on` for its sessions, MariaDB semi-sync), so every commit it saw is on
//! the promoted server; the streamer follows the new primary without a restart and is checked
//! from outside: every row the new primary holds (its ledger, see `support::load`) reaches
//! Kafka, nothing that was never inserted does, per-key commit order holds.
//!
//! - PostgreSQL: the streamer's URL names both servers (`host1:port1,host2:port2`); the
//!   promoted standby has no logical slot (PostgreSQL 15 copies none), so the stream finds it
//!   missing and the catch-up publishes from the table.
//! - MariaDB: the streamer and the writer reach the database through one address that moves to
//!   the replica (a proxy here; a virtual IP or a DNS name in production). The checkpoint came
//!   along with the data and the replica's binlog holds the primary's GTIDs, so the stream
//!   resumes by GTID.

use std::time::Instant;

use crate::support::load::{self, Target, Writer, wait_published_more, wait_unreachable};
use crate::support::metrics::{sample, try_get};
use crate::support::proxy::Proxy;
use crate::support::world::{ARRIVAL, World};
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_failover_to_a_promoted_standby_loses_nothing() {
    let w = World::postgres("pfo").exclusive().build().await;
    // Whatever happens: the promoted standby is thrown away and the old primary runs again.
    let _restore = RestoreServices::new(&[&["down", "postgres-standby"], &["up", "postgres"]]);
    services(&["up", "postgres-standby"]);
    let primary = host_port(&w.db.admin_url).to_string();
    let standby = format!("127.0.0.1:{}", env("OUTBOX_PG_STANDBY_PORT"));
    {
        let admin = crate::support::pg::connect(&w.db.admin_url).await;
        wait_until("the standby to stream synchronously", ARRIVAL, || async {
            let row = admin
                .query_opt("SELECT 1 FROM pg_stat_replication WHERE state = 'streaming' AND sync_state = 'sync'", &[])
                .await
                .ok()?;
            row.map(|_| ())
        })
        .await;
    }
    let both = format!("{primary},{standby}");
    repoint_config(&w, &primary, &both);
    let admin_both = w.db.admin_url.replace(&format!("@{primary}/"), &format!("@{both}/"));
    let target = Target::Postgres { url: format!("{admin_both}?target_session_attrs=read-write"), synchronous: true };
    let table = w.table(0, 0);

    let streamer = w.start("streamer.log");
    streamer.wait_for_state("streaming", ARRIVAL).await;
    let writer = Writer::start(target.clone(), &table, &w.topic).await;
    streamer.wait_for_metric("outbox_published_records_total", &[], 300.0, ARRIVAL).await;

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
    // Synchronous commits: none the writer saw is missing on the promoted standby.
    let outcome = load::finish_and_check(writer, &target, &table, &w.topic, w.kafka_partitions).await;
    eprintln!("postgres failover to a promoted standby: {outcome}; first record {first_after:?} after the crash");
    assert!(streamer.stop(), "the streamer stopped cleanly");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_failover_to_a_promoted_replica_loses_nothing() {
    // The replica starts before the world's database exists, so it replicates all of it.
    let w = World::mysql("mfo").start_first("mariadb-replica").build().await;
    // Whatever happens: the promoted replica is thrown away and the old primary runs again
    // (a restart also ends the semi-sync switched on below).
    let _restore = RestoreServices::new(&[&["down", "mariadb-replica"], &["crash", "mariadb"], &["up", "mariadb"]]);
    let primary = host_port(&w.db.admin_url).to_string();
    let replica = format!("127.0.0.1:{}", env("OUTBOX_MYSQL_REPLICA_PORT"));
    {
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
        let replica_url = w.db.admin_url.replace(&format!("@{primary}/"), &format!("@{replica}/"));
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
    // Semi-sync commits: none the writer saw is missing on the promoted replica.
    let outcome = load::finish_and_check(writer, &target, &table, &w.topic, w.kafka_partitions).await;
    let text = try_get(streamer.metrics_addr(), "/metrics").await.unwrap_or_default();
    let catchups = sample(&text, "outbox_catchups_total", &[]).unwrap_or(0.0);
    eprintln!(
        "mariadb failover to a promoted replica: {outcome}; first record {first_after:?} after the crash; catch-ups: {catchups}"
    );
    assert_eq!(catchups, 0.0, "the stream resumed by GTID on the replica, without a catch-up");
    assert!(streamer.stop(), "the streamer stopped cleanly");
    drop(proxy);
}
