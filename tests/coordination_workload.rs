//! The randomised workload of ZooKeeper ownership, seeded like `tests/workload.rs`. The
//! cluster and its checks: `tests/support/cluster.rs`.

use crate::support::cluster::{Cluster, SETTLE, Writer, config_with, polling_config};
use crate::support::{env, services, wait_until};

/// The randomised workload of ownership, seeded like `tests/workload.rs`: instances join with
/// different configurations (fewer shards, polling mode), leave, are killed, and lose their
/// lease or member node to an operator's hand, and ZooKeeper restarts once, while a writer
/// commits. After every step each
/// shard-partition gets a live owner again; at the end every row arrived, each table's first
/// deliveries kept commit order, and no record of an older owner follows a newer one's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomised_ownership_workload() {
    let (seed, ops) = crate::workload::settings();
    let steps = (ops / 15).max(6);
    eprintln!("ownership workload: OUTBOX_WORKLOAD_SEED={seed} OUTBOX_WORKLOAD_OPS={ops} ({steps} steps)");
    let mut rng = crate::workload::Rng(seed);
    // Exclusive: one step restarts ZooKeeper under every other test's feet.
    let mut c = Cluster::new("zw", 3, 1, true).await;
    let two = config_with(&c.w.config, "shards = 3", "shards = 2", "two-shards.toml");
    let polling = polling_config(&c.w.config);
    let writer = Writer::start(&c.w.db.admin_url, &c.tables, &c.w.topic);
    // Per instance: whether it serves every shard (the two-shard one does not serve shard 2).
    let mut serves_all = vec![true];
    // ZooKeeper restarts once per run, at a step the seed chooses.
    let restart_at = rng.below(steps as u64) as usize;
    c.start();
    for step in 0..steps {
        let running: Vec<usize> = (0..c.instances.len()).filter(|i| c.instances[*i].is_some()).collect();
        let pick = running[rng.below(running.len() as u64) as usize];
        let what = match if step == restart_at { 7 } else { rng.below(7) } {
            0 | 1 if running.len() < 4 => {
                let (config, all) = match rng.below(3) {
                    0 => (c.w.config.clone(), true),
                    1 => (two.clone(), false),
                    _ => (polling.clone(), true),
                };
                let n = c.start_with(&config);
                serves_all.push(all);
                format!("instance {n} joins with {}", config.display())
            }
            2 if running.len() > 1 => {
                let gone = c.instances[pick].take().expect("running");
                // Before `run` starts, the process only parses its configuration: a signal then
                // ends it without a clean exit code.
                gone.run.wait_for_log("outbox-streamer running", SETTLE).await;
                assert!(gone.run.stop(), "instance {pick} exits 0 on SIGTERM");
                format!("instance {pick} leaves")
            }
            3 if running.len() > 1 => {
                c.instances[pick].take().expect("running").run.kill();
                format!("instance {pick} is killed")
            }
            4 => {
                let dir = c.paths.lease(&c.keys[rng.below(c.keys.len() as u64) as usize]);
                let children = c.zk.list_children(&dir).await.unwrap_or_default();
                match children.iter().find(|n| n.contains("lock-")) {
                    Some(node) => {
                        let _ = c.zk.delete(&format!("{dir}/{node}"), None).await;
                        format!("lease node {dir}/{node} deleted")
                    }
                    None => "no lease node to delete".to_string(),
                }
            }
            5 => {
                let members = c.paths.members();
                let nodes = c.zk.list_children(&members).await.unwrap_or_default();
                match nodes.get(rng.below(nodes.len().max(1) as u64) as usize) {
                    Some(node) => {
                        let _ = c.zk.delete(&format!("{members}/{node}"), None).await;
                        format!("member node {node} deleted")
                    }
                    None => "no member node to delete".to_string(),
                }
            }
            7 => {
                services(&["down", "zookeeper"]);
                services(&["up", "zookeeper"]);
                // The test's own session may have expired with the restart.
                c.zk = outbox_zookeeper::connect(&outbox_zookeeper::SessionSettings::new(env("OUTBOX_ZK_CONNECT")))
                    .await
                    .expect("ZooKeeper session after the restart");
                "ZooKeeper restarts".to_string()
            }
            _ => "writes only".to_string(),
        };
        // Some running member must serve every shard, or shard 2 rightly has no owner.
        if !(0..c.instances.len()).any(|i| c.instances[i].is_some() && serves_all[i]) {
            c.start();
            serves_all.push(true);
        }
        eprintln!("ownership workload step {step}: {what}");
        wait_until(&format!("every shard-partition owned after step {step} ({what})"), SETTLE, || async {
            c.owners().await.iter().all(Option::is_some).then_some(())
        })
        .await;
    }
    c.finish(writer).await;
    for instance in c.instances.iter_mut().filter_map(Option::take) {
        instance.run.wait_for_log("outbox-streamer running", SETTLE).await;
        assert!(instance.run.stop(), "every remaining instance exits 0 on SIGTERM");
    }
}
