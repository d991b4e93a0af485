//! Fencing under ZooKeeper ownership: an owner that lost its lease — paused past its session,
//! cut from ZooKeeper, its lease node deleted by hand — never publishes after the new owner
//! (on PostgreSQL by the slot, on MariaDB by the epoch stored in the checkpoint row); a
//! non-owner never moves a stream's slot; an epoch from another ensemble halts with the reset.
//! The cluster and its checks: `tests/support/cluster.rs`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use outbox_zookeeper::lease;
use outbox_zookeeper::paths::ClusterPaths;
use tokio::sync::watch;

use crate::support::cluster::{
    Cluster, SESSION_MS, SETTLE, TAKEOVER_MARGIN, Writer, check, config_with, coordination, overlap_sampler,
    polling_config, read_all, scrape,
};
use crate::support::kafka;
use crate::support::metrics::free_addr;
use crate::support::proxy::Proxy;
use crate::support::streamer::Running;
use crate::support::world::{ARRIVAL, World};
use crate::support::{env, unique, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_paused_past_its_session_never_publishes_after_the_new_owner() {
    let duplicates = owner_paused_past_its_session("zs", false).await;
    eprintln!("pause past the session: {duplicates} duplicate records");
}

/// The same pause under exactly-once delivery. Both instances produce under the
/// shard-partition's one transactional id: when the new owner registers it, the broker aborts
/// whatever the paused owner had open and fences its producer, so what the paused owner had
/// handed to Kafka never becomes visible. A `read_committed` reader sees every row once, in
/// order, and the owner epoch never goes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_an_owner_paused_past_its_session_adds_no_duplicate() {
    let duplicates = owner_paused_past_its_session("ze", true).await;
    assert_eq!(duplicates, 0, "a read_committed reader sees each row once");
}

/// Two instances, the owner paused (SIGSTOP) past its ZooKeeper session while rows flow: the
/// other takes the lease with a larger epoch, takes the slot from the paused one's backend and
/// publishes; resumed, the paused one loses its session and owns nothing. Returns the
/// duplicates a reader saw ([`Cluster::finish`] checks that nothing is lost or out of order).
async fn owner_paused_past_its_session(name: &str, exactly_once: bool) -> usize {
    let mut c = Cluster::new(name, 1, 1, false).await;
    let config = if exactly_once {
        config_with(
            &c.w.config,
            "status_interval_ms = 100",
            &format!("status_interval_ms = 100\n{}", crate::postgres_faults::EXACTLY_ONCE),
            "exactly-once.toml",
        )
    } else {
        c.w.config.clone()
    };
    let writer = Writer::start(&c.w.db.admin_url, &c.tables, &c.w.topic);
    let a = c.start_with(&config);
    let held = c.wait_for_counts(&[1], SETTLE).await;
    let old_epoch = held[0].1;
    kafka::wait_for_header(&c.w.topic, 3, "outbox-owner-epoch", &old_epoch.to_string(), ARRIVAL).await;
    let b = c.start_with(&config);
    c.wait_for_counts(&[1, 0], SETTLE).await;

    // Listed at zero before any loss, so an alert on its increase has a series to start from.
    c.instance(a).run.wait_for_metric("outbox_zookeeper_sessions_lost_total", &[], 0.0, SETTLE).await;
    c.instance(a).run.freeze();
    let held = c.wait_for_counts(&[0, 1], Duration::from_millis(SESSION_MS) + TAKEOVER_MARGIN).await;
    let new_epoch = held[0].1;
    assert!(new_epoch > old_epoch, "a new lease has a larger epoch");
    // The new owner took the slot from the frozen one's backend and publishes.
    kafka::wait_for_header(&c.w.topic, 3, "outbox-owner-epoch", &new_epoch.to_string(), ARRIVAL).await;

    c.instance(a).run.resume();
    c.instance(a).run.wait_for_metric("outbox_zookeeper_sessions_lost_total", &[], 1.0, SETTLE).await;
    // It joins again and owns nothing: the stream stays with the newer owner.
    c.wait_for_counts(&[0, 1], SETTLE).await;
    let log = c.instance(b).run.log_text();
    assert!(log.contains("terminating its backend"), "the new owner took the slot from the paused one:\n{log}");
    if exactly_once {
        assert!(
            log.contains("resuming after the last committed Kafka transaction"),
            "the new owner resumed from the progress record:\n{log}"
        );
    }
    c.finish(writer).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_reset_or_cut_zookeeper_link_never_makes_two_owners() {
    let mut c = Cluster::new("zl", 1, 2, false).await;
    let zk: SocketAddr = env("OUTBOX_ZK_CONNECT").parse().expect("OUTBOX_ZK_CONNECT is host:port");
    let proxy = Proxy::start(zk).await;
    let proxied = config_with(&c.w.config, &zk.to_string(), &proxy.addr.to_string(), "through-proxy.toml");
    let writer = Writer::start(&c.w.db.admin_url, &c.tables, &c.w.topic);
    let a = c.start_with(&proxied);
    c.wait_for_counts(&[2], SETTLE).await;
    let _b = c.start();
    let before = c.wait_for_counts(&[1, 1], SETTLE).await;
    let c = Arc::new(tokio::sync::RwLock::new(c));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = overlap_sampler(c.clone(), stop.clone());

    // Delay: a silence shorter than the session keeps the lease. The link stays frozen until
    // the proxy held a message from one end (a ping comes at least every third of a session).
    proxy.freeze();
    wait_until("a message held by the frozen link", Duration::from_millis(SESSION_MS / 2), || async {
        (proxy.held_bytes() > 0).then_some(())
    })
    .await;
    proxy.thaw();
    // Reset: the connection drops; the client reconnects within the same session.
    proxy.reset();
    let after = c.read().await.wait_for_counts(&[1, 1], SETTLE).await;
    assert_eq!(before, after, "a short delay and a reset keep every lease where it was");

    // Cut: silence past the session timeout; the other instance takes over.
    proxy.freeze();
    c.read().await.wait_for_counts(&[0, 2], Duration::from_millis(SESSION_MS) + TAKEOVER_MARGIN).await;
    proxy.thaw();
    c.read().await.instance(a).run.wait_for_metric("outbox_zookeeper_sessions_lost_total", &[], 1.0, SETTLE).await;
    c.read().await.wait_for_counts(&[1, 1], SETTLE).await;

    stop.store(true, Ordering::SeqCst);
    let overlaps = sampler.await.expect("sampler");
    assert!(overlaps.is_empty(), "two owners at once: {overlaps:?}");
    let c = Arc::into_inner(c).expect("sampler ended").into_inner();
    let duplicates = c.finish(writer).await;
    eprintln!("cut ZooKeeper link: {duplicates} duplicate records");
}

/// An owner's lease node deleted by hand (an operator, a ZooKeeper restore) while its session
/// lives: the owner stops at once, the lease is granted again, and no record of the old epoch
/// lands after one of the new — in PostgreSQL polling too, which has no slot to fence it.
/// Before, the old owner never noticed and both published for as long as the test ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_lease_node_stops_its_owner_before_the_lease_is_granted_again() {
    let mut c = Cluster::new("zd", 1, 1, false).await;
    let polling = polling_config(&c.w.config);
    let writer = Writer::start(&c.w.db.admin_url, &c.tables, &c.w.topic);
    c.start_with(&polling);
    c.start_with(&polling);
    let held = c.wait_for_balance(SETTLE).await;
    let (owner, epoch) = held[0];
    kafka::wait_for_header(&c.w.topic, 3, "outbox-owner-epoch", &epoch.to_string(), ARRIVAL).await;
    let dir = c.paths.lease(&c.keys[0]);
    let children = c.zk.list_children(&dir).await.expect("lease directory");
    let node = children.iter().find(|n| n.contains("lock-")).expect("the lock node");
    c.zk.delete(&format!("{dir}/{node}"), None).await.expect("deleting the lock node by hand");
    let (_, new_epoch) = wait_until("the lease to be granted again", SETTLE, || async {
        c.owners().await[0].filter(|(_, e)| *e != epoch)
    })
    .await;
    kafka::wait_for_header(&c.w.topic, 3, "outbox-owner-epoch", &new_epoch.to_string(), ARRIVAL).await;
    let duplicates = c.finish(writer).await;
    eprintln!("lease node deleted: {duplicates} duplicates");
    let log = c.instance(owner).run.log_text();
    assert!(log.contains("the lease node was deleted while this instance held it"), "{log}");
}

/// An instance that does not own a stream never moves that stream's slot, even when its own
/// configuration says the stream polls: only the owner's polling session moves it. Before, the
/// lag poller of every instance advanced every slot its own config had in polling mode
/// whenever the slot was idle, and rows in between were never streamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_owner_moves_a_polling_streams_slot() {
    let mut c = Cluster::new("zs", 1, 1, false).await;
    // Someone else holds the lease (a member of another deployment, or one about to stream).
    let other = lease::acquire(&c.zk, &c.paths, &c.keys[0], "another-instance", Duration::from_secs(5))
        .await
        .expect("taking the lease by hand")
        .expect("the lease was free");
    let polling = polling_config(&c.w.config);
    let a = c.start_with(&polling);
    let metrics = c.instance(a).metrics;
    let table = c.tables[0].clone();
    let insert = format!(
        "INSERT INTO {table} (topic, payload) SELECT $1, convert_to('p' || i, 'UTF8') FROM generate_series(1, 200) i"
    );
    c.w.db.admin.execute(&insert, &[&c.w.topic]).await.unwrap();
    // The instance's lag poller runs every few seconds; once it reports the slot behind by
    // the rows just written, it has looked at the slot after they were written — and, not
    // owning the stream, left it where it was.
    let slot = table.clone();
    wait_until("the non-owner to report the slot behind the new rows", ARRIVAL, || async {
        let text = scrape(metrics).await?;
        let line = text
            .lines()
            .find(|l| l.starts_with("outbox_replication_lag_bytes") && l.contains(&format!("slot=\"{slot}\"")))?;
        let lag: f64 = line.rsplit(' ').next()?.parse().ok()?;
        (lag > 10_000.0).then_some(())
    })
    .await;
    let owners = c.owners().await;
    assert_eq!(owners, vec![None], "the lease stays with the other holder");
    other.release().await.unwrap();
    // Now the instance owns the stream and polls it: every row arrives.
    let records = kafka::read_distinct(&c.w.topic, 3, 200, ARRIVAL).await;
    assert_eq!(records.len(), 200);
}

/// MariaDB has no single-reader slot: the epoch in the checkpoint row is the fence. An owner
/// paused past its session resumes to find a newer epoch stored and stops; no record of its
/// epoch follows the new owner's, and nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_an_owner_paused_past_its_session_is_fenced_by_the_stored_epoch() {
    use mysql_async::prelude::Queryable;
    let cluster = unique("zm");
    let w =
        World::mysql("zm").kafka_partitions(3).config(&coordination(&cluster, &env("OUTBOX_ZK_CONNECT"))).build().await;
    let table = w.table(0, 0);
    let zk = outbox_zookeeper::connect(&outbox_zookeeper::SessionSettings::new(env("OUTBOX_ZK_CONNECT")))
        .await
        .expect("ZooKeeper session for the test");
    let paths = ClusterPaths::new("/outbox-streamer", &cluster);
    let key = format!("test.{table}");
    let holder = || async { lease::holder(&zk, &paths, &key).await.expect("reading the lease") };
    let start = |n: usize| {
        Running::start_with_env(
            &w.config,
            &w.dir.join(format!("instance-{n}.log")),
            &[("OUTBOX_METRICS_LISTEN", free_addr().to_string())],
        )
    };

    // The writer: payloads <table>:1, 2, 3, … in their own transactions.
    let (stop, mut stopped) = watch::channel(false);
    let (admin_url, insert_table, topic) = (w.db.admin_url.clone(), table.clone(), w.topic.clone());
    let writer = tokio::spawn(async move {
        let mut conn = mysql_async::Conn::new(mysql_async::Opts::from_url(&admin_url).unwrap()).await.unwrap();
        let insert = format!("INSERT INTO {insert_table} (topic, msg_key, payload) VALUES (?, ?, ?)");
        let mut n = 0u64;
        let mut pace = tokio::time::interval(Duration::from_millis(4));
        while !*stopped.borrow() {
            tokio::select! {
                _ = pace.tick() => {}
                _ = stopped.changed() => break,
            }
            n += 1;
            conn.exec_drop(&insert, (&topic, insert_table.as_bytes(), format!("{insert_table}:{n}").into_bytes()))
                .await
                .expect("insert");
        }
        BTreeMap::from([(insert_table, n)])
    });

    let a = start(0);
    let first = wait_until("the first instance to hold the lease", SETTLE, || async {
        holder().await.filter(|h| h.instance.ends_with(&format!("-{}", a.pid())))
    })
    .await;
    kafka::wait_for_header(&w.topic, 3, "outbox-owner-epoch", &first.epoch.to_string(), ARRIVAL).await;
    let b = start(1);
    a.freeze();
    let second = wait_until(
        "the second instance to take the lease",
        Duration::from_millis(SESSION_MS) + TAKEOVER_MARGIN,
        || async { holder().await.filter(|h| h.instance.ends_with(&format!("-{}", b.pid()))) },
    )
    .await;
    assert!(second.epoch > first.epoch, "a new lease has a larger epoch");
    kafka::wait_for_header(&w.topic, 3, "outbox-owner-epoch", &second.epoch.to_string(), ARRIVAL).await;
    let mut admin = w.admin().await;
    let stored: Option<i64> = admin
        .exec_first(format!("SELECT owner_epoch FROM {}_checkpoint WHERE stream = ?", w.prefix), (&table,))
        .await
        .unwrap();
    assert_eq!(stored, Some(second.epoch), "the new owner claimed the checkpoint with its epoch");

    a.resume();
    a.wait_for_metric("outbox_zookeeper_sessions_lost_total", &[], 1.0, SETTLE).await;
    let _ = stop.send(true);
    let sent = writer.await.expect("writer");
    let records = read_all(&w.topic, &sent).await;
    let duplicates = check(&records, &sent);
    eprintln!("MariaDB pause past the session: {duplicates} duplicate records");
    w.wait_drained(&w.table(0, 0)).await;
    assert!(b.stop(), "the new owner exits 0 on SIGTERM");
}

/// The checkpoint holds an owner epoch from another ZooKeeper ensemble (ZooKeeper replaced,
/// or restored from an older backup: its zxids are lower): the owner holding the lease now
/// halts once, saying what happened and how to reset it, instead of being fenced again every
/// half second for ever; the documented reset brings the stream back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_an_epoch_from_another_ensemble_halts_with_the_reset() {
    use mysql_async::prelude::Queryable;
    let cluster = unique("ze");
    let w = World::mysql("ze").config(&coordination(&cluster, &env("OUTBOX_ZK_CONNECT"))).build().await;
    let table = w.table(0, 0);
    let mut admin = w.admin().await;
    let checkpoint = format!("{}_checkpoint", w.prefix);
    admin
        .exec_drop(format!("UPDATE {checkpoint} SET owner_epoch = ? WHERE stream = ?"), (1i64 << 50, &table))
        .await
        .unwrap();
    let first = Running::start(&w.config, &w.dir.join("first.log"));
    let log = first.wait_for_halt(SETTLE).await;
    assert!(log.contains("another ZooKeeper ensemble") && log.contains("SET owner_epoch = 0"), "{log}");
    assert_eq!(log.matches("ERROR").count(), 1, "one ERROR, not a retry loop:\n{log}");
    assert!(first.stop());
    admin.exec_drop(format!("UPDATE {checkpoint} SET owner_epoch = 0 WHERE stream = ?"), (&table,)).await.unwrap();
    let second = Running::start(&w.config, &w.dir.join("second.log"));
    admin
        .exec_drop(format!("INSERT INTO {table} (topic, payload) VALUES (?, 'after the reset')"), (&w.topic,))
        .await
        .unwrap();
    let records = kafka::read_at_least(&w.topic, 1, 1, ARRIVAL).await;
    assert_eq!(records[0].payload_str(), "after the reset");
    assert!(second.stop());
    admin.disconnect().await.unwrap();
}
