//! ZooKeeper ownership with several real `outbox-streamer` processes against real ZooKeeper,
//! PostgreSQL and Kafka: leases spread evenly as instances join and leave, a killed owner is
//! replaced within the session timeout, streaming goes on across a ZooKeeper restart, leases
//! move when yielded, a deleted member node registers again, members with different shards
//! leave nothing unowned, and a clashing instance name, deployment or chroot is refused or
//! named. The cluster and its checks: `tests/support/cluster.rs`.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use outbox_zookeeper::lease;

use crate::support::cluster::{Cluster, SESSION_MS, SETTLE, TAKEOVER_MARGIN, Writer, config_with, overlap_sampler};
use crate::support::kafka;
use crate::support::world::ARRIVAL;
use crate::support::{env, services, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_share_shard_partitions_evenly_as_they_join_and_leave() {
    let mut c = Cluster::new("zb", 3, 2, false).await;
    let writer = Writer::start(&c.w.db.admin_url, &c.tables, &c.w.topic);
    for _ in 0..3 {
        c.start();
    }
    let held = c.wait_for_balance(SETTLE).await;
    c.status_shows(&held);
    let c = Arc::new(tokio::sync::RwLock::new(c));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = overlap_sampler(c.clone(), stop.clone());

    let fourth = c.write().await.start();
    assert_eq!(fourth, 3);
    c.read().await.wait_for_balance(SETTLE).await;

    // The third leaves (SIGTERM): its shard-partitions move to the others, evenly.
    let third = c.write().await.instances[2].take().expect("third instance");
    assert!(third.run.stop(), "a leaving instance exits 0 on SIGTERM");
    c.read().await.wait_for_balance(SETTLE).await;

    stop.store(true, Ordering::SeqCst);
    let overlaps = sampler.await.expect("sampler");
    assert!(overlaps.is_empty(), "two owners at once: {overlaps:?}");
    let c = Arc::into_inner(c).expect("sampler ended").into_inner();
    let duplicates = c.finish(writer).await;
    assert_eq!(duplicates, 0, "a graceful handover drains before it releases: no duplicates");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_owner_is_replaced_within_the_session_timeout() {
    let mut c = Cluster::new("zk", 2, 2, false).await;
    let writer = Writer::start(&c.w.db.admin_url, &c.tables, &c.w.topic);
    let a = c.start();
    c.wait_for_counts(&[4], SETTLE).await;
    let b = c.start();
    let held = c.wait_for_counts(&[2, 2], SETTLE).await;
    let b_before: Vec<i64> = held.iter().filter(|(o, _)| *o == b).map(|(_, e)| *e).collect();

    let killed_at = Instant::now();
    c.instances[a].take().expect("instance a").run.kill();
    let held = c.wait_for_counts(&[0, 4], Duration::from_millis(SESSION_MS) + TAKEOVER_MARGIN).await;
    let takeover = killed_at.elapsed();
    // The first record of each lease taken over: when streaming really resumed.
    let new_epochs: Vec<i64> = held.iter().map(|(_, e)| *e).filter(|e| !b_before.contains(e)).collect();
    assert_eq!(new_epochs.len(), 2, "two leases taken over");
    for epoch in &new_epochs {
        kafka::wait_for_header(&c.w.topic, 3, "outbox-owner-epoch", &epoch.to_string(), ARRIVAL).await;
    }
    let resumed = killed_at.elapsed();
    eprintln!(
        "failover after SIGKILL: leases taken over in {takeover:?}, records of the new owner in Kafka after {resumed:?}"
    );

    let duplicates = c.finish(writer).await;
    eprintln!("failover after SIGKILL: {duplicates} duplicate records");
    assert!(c.instances[b].take().expect("instance b").run.stop(), "survivor exits 0 on SIGTERM");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_continues_across_a_zookeeper_restart() {
    let mut c = Cluster::new("zr", 1, 2, true).await;
    let writer = Writer::start(&c.w.db.admin_url, &c.tables, &c.w.topic);
    let a = c.start();
    c.wait_for_counts(&[2], SETTLE).await;
    services(&["down", "zookeeper"]);
    services(&["up", "zookeeper"]);
    // The test's own session may have expired with the restart.
    c.zk = outbox_zookeeper::connect(&outbox_zookeeper::SessionSettings::new(env("OUTBOX_ZK_CONNECT")))
        .await
        .expect("ZooKeeper session after the restart");
    c.wait_for_counts(&[2], SETTLE).await;
    // Rows written during and after the restart must arrive too.
    c.finish(writer).await;
    assert!(c.instances[a].take().expect("instance").run.stop(), "exits 0 on SIGTERM");
}

/// With `yield_interval_s`, every lease is given up after that long and taken by another
/// instance: ownership moves again and again, and nothing is lost or reordered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn yielding_moves_leases_over_time_without_loss() {
    let mut c = Cluster::new("zy", 1, 2, false).await;
    let config = config_with(&c.w.config, "[coordination]", "[coordination]\nyield_interval_s = 1", "yielding.toml");
    let writer = Writer::start(&c.w.db.admin_url, &c.tables, &c.w.topic);
    c.start_with(&config);
    c.start_with(&config);
    let epochs = std::sync::Mutex::new(HashSet::<i64>::new());
    wait_until("each lease to be granted three times", SETTLE, || async {
        let seen = c.owners().await.into_iter().flatten().map(|(_, e)| e);
        let mut epochs = epochs.lock().unwrap();
        epochs.extend(seen);
        (epochs.len() >= 3 * c.keys.len()).then_some(())
    })
    .await;
    let epochs = epochs.into_inner().unwrap();
    let duplicates = c.finish(writer).await;
    eprintln!("yielding: {} grants, {duplicates} duplicate records", epochs.len());
    // Each yield hands the lease to a member already queued for it (before, the yielded
    // lease sat free for seconds while every other member was at its quota).
    let logs: String = (0..2).map(|i| c.instance(i).run.log_text()).collect();
    assert!(logs.contains("yielding: handed over to the member waiting for the lease"), "{logs}");
    assert!(logs.contains("took over a lease yielded to this instance"), "{logs}");
}

/// A member node deleted by hand while its session lives: the instance registers again and
/// keeps (and keeps serving) its leases. Before, rebalancing stopped for good: no task was
/// ever restarted, and a WARN repeated every 500 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_member_node_registers_again() {
    let mut c = Cluster::new("zm", 2, 1, false).await;
    let writer = Writer::start(&c.w.db.admin_url, &c.tables, &c.w.topic);
    let n = c.start();
    c.wait_for_counts(&[2], SETTLE).await;
    let members = c.paths.members();
    let nodes = c.zk.list_children(&members).await.expect("members");
    assert_eq!(nodes.len(), 1);
    c.zk.delete(&format!("{members}/{}", nodes[0]), None).await.expect("deleting the member node by hand");
    wait_until("the instance to register again", SETTLE, || async {
        let now = c.zk.list_children(&members).await.ok()?;
        (now.len() == 1 && now[0] != nodes[0]).then_some(())
    })
    .await;
    c.instance(n).run.wait_for_log("registered again as a cluster member", SETTLE).await;
    c.wait_for_counts(&[2], SETTLE).await;
    c.finish(writer).await;
}

/// Members whose configurations differ — a rolling change of `shards`, half the instances
/// restarted — balance over the union of what they serve: no shard-partition that some member
/// serves is left without an owner. Before, each computed its quota from its own list, and a
/// shard stayed unowned while both ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_with_different_shards_leave_no_shard_partition_unowned() {
    let mut c = Cluster::new("zu", 3, 1, false).await;
    let two = config_with(&c.w.config, "shards = 3", "shards = 2", "two-shards.toml");
    let writer = Writer::start(&c.w.db.admin_url, &c.tables, &c.w.topic);
    c.start_with(&two);
    c.start();
    let held = wait_until("every shard-partition to have an owner", SETTLE, || async {
        let owners = c.owners().await;
        owners.iter().all(Option::is_some).then_some(owners)
    })
    .await;
    assert_eq!(held[2].map(|(o, _)| o), Some(1), "only the instance with 3 shards serves shard 2");
    c.finish(writer).await;
}

/// Two instances configured with the same name: the younger refuses to join, loudly, and owns
/// nothing; the older owns everything. Before, both joined, and a frozen one was mistaken for
/// "me" when its slot had to be taken over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_instance_name_is_refused() {
    let mut c = Cluster::new("zn", 2, 1, false).await;
    let named = config_with(
        &c.w.config,
        "session_timeout_ms = 3000",
        "session_timeout_ms = 3000\ninstance = \"same-name\"",
        "named.toml",
    );
    let first = c.start_with(&named);
    c.instance(first).run.wait_for_log("registered as a cluster member", SETTLE).await;
    let second = c.start_with(&named);
    let log = c.instance(second).run.wait_for_log("has this instance name", SETTLE).await;
    assert!(log.contains("ERROR"), "{log}");
    let held = wait_until("the first instance to hold both leases", SETTLE, || async {
        let mut holders = Vec::new();
        for key in &c.keys {
            holders.push(lease::holder(&c.zk, &c.paths, key).await.ok()??);
        }
        Some(holders)
    })
    .await;
    assert!(held.iter().all(|h| h.instance == "same-name"));
    let members = c.zk.list_children(&c.paths.members()).await.expect("members");
    assert_eq!(members.len(), 1, "only one member with the name: {members:?}");
}

/// Two deployments with different sources under one cluster name: the younger refuses to join,
/// loudly, instead of splitting the work so that some shard-partitions stay unowned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_deployment_under_the_same_cluster_name_is_refused() {
    let mut c = Cluster::new("zx", 1, 1, false).await;
    let first = c.start();
    c.wait_for_counts(&[1], SETTLE).await;
    let other = config_with(&c.w.config, "name = \"test\"", "name = \"billing\"", "other.toml");
    let second = c.start_with(&other);
    let log = c.instance(second).run.wait_for_log("another deployment shares this cluster", SETTLE).await;
    assert!(log.contains("ERROR") && log.contains("cluster_name"), "{log}");
    let members = c.zk.list_children(&c.paths.members()).await.expect("members");
    assert_eq!(members.len(), 1, "the other deployment's instance is not a member");
    let _ = first;
}

/// A connect string whose chroot does not exist: registration fails with a message naming the
/// path, and is retried with growing backoff. Before, about 150 sessions a second were opened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_chroot_is_named_and_retried_with_backoff() {
    let mut c = Cluster::new("zc", 1, 1, false).await;
    let connect = env("OUTBOX_ZK_CONNECT");
    let missing = config_with(&c.w.config, &connect, &format!("{connect}/no-such-chroot"), "chroot.toml");
    let n = c.start_with(&missing);
    let run = &c.instance(n).run;
    let log = wait_until("three failed registrations", SETTLE, || async {
        let log = run.log_text();
        (log.matches("cannot register as a cluster member").count() >= 3).then_some(log)
    })
    .await;
    let failures: Vec<&str> = log.lines().filter(|l| l.contains("cannot register as a cluster member")).collect();
    assert!(failures[0].contains("/members") && failures[0].contains("chroot"), "{}", failures[0]);
    let at = |line: &str| -> f64 {
        let t = line.split_whitespace().next().unwrap_or_default();
        let time = t.split('T').nth(1).unwrap_or_default().trim_end_matches('Z');
        let mut parts = time.split(':').map(|p| p.parse::<f64>().unwrap_or(0.0));
        parts.next().unwrap_or(0.0) * 3600.0 + parts.next().unwrap_or(0.0) * 60.0 + parts.next().unwrap_or(0.0)
    };
    assert!(at(failures[2]) - at(failures[0]) >= 2.5, "backoff between attempts:\n{}", failures.join("\n"));
}
