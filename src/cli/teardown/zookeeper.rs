//! The cluster's ZooKeeper nodes: which instances run (and which shard-partitions they serve),
//! and removing `<root>/<cluster>` once none does. The root itself, shared by every cluster,
//! is left alone.

use anyhow::Context;
use outbox_zookeeper::members::{self, Member, MemberView};
use outbox_zookeeper::paths::ClusterPaths;
use outbox_zookeeper::teardown as zt;
use outbox_zookeeper::zk;

use crate::config::CoordinationConfig;
use crate::db::teardown::{Line, Object, Options, Section};

/// A session with the cluster's ensemble and the members registered when teardown started.
pub(super) struct Cluster {
    client: zk::Client,
    paths: ClusterPaths,
    members: Vec<Member>,
}

impl Cluster {
    pub(super) async fn open(config: &CoordinationConfig) -> anyhow::Result<Self> {
        let settings = crate::coordination::session_settings(config);
        let client = outbox_zookeeper::connect(&settings).await.context("coordination.connect")?;
        let paths = ClusterPaths::new(&config.root, &config.cluster_name);
        let members = members::list(&client, &paths).await.context("reading the cluster's members")?;
        Ok(Self { client, paths, members })
    }
}

impl crate::db::teardown::Members for Cluster {
    /// The registered instances that serve `key` (`<source>.<table>`); an instance of an older
    /// version, whose node does not list its shard-partitions, serves them all.
    fn serving(&self, key: &str) -> Vec<String> {
        let serves = |m: &&Member| m.view.streams.as_ref().is_none_or(|streams| streams.iter().any(|s| s == key));
        self.members.iter().filter(serves).map(|m| m.instance.clone()).collect()
    }
}

fn quoted(names: &[String]) -> String {
    names.iter().map(|n| format!("{n:?}")).collect::<Vec<_>>().join(", ")
}

/// Removes the cluster's nodes unless a live session owns one of them.
pub(super) async fn tear_down(
    config: &CoordinationConfig,
    cluster: anyhow::Result<Cluster>,
    options: Options,
) -> Section {
    let base = ClusterPaths::new(&config.root, &config.cluster_name).base().to_string();
    let mut section = Section::new(format!("ZooKeeper cluster {:?} at {}", config.cluster_name, config.connect));
    let cluster = match cluster {
        Ok(cluster) => cluster,
        Err(e) => {
            section.lines.push(Line::Leave(
                vec![Object::ZooKeeper { path: base, nodes: 1 }],
                format!("{e:#}; without ZooKeeper teardown cannot tell whether instances run"),
            ));
            return section;
        }
    };
    // Walked now, after the sources: an instance that started meanwhile shows here.
    let tree = match zt::walk(&cluster.client, &cluster.paths).await {
        Ok(Some(tree)) => tree,
        Ok(None) => return section,
        Err(e) => {
            let object = Object::ZooKeeper { path: base, nodes: 1 };
            section.lines.push(Line::Leave(vec![object], format!("reading the nodes failed: {e}")));
            return section;
        }
    };
    let object = Object::ZooKeeper { path: base, nodes: tree.nodes.len() };
    let members_dir = format!("{}/", cluster.paths.members());
    let (members, others): (Vec<&zt::Node>, Vec<&zt::Node>) =
        tree.ephemerals().partition(|n| n.path.starts_with(&members_dir));
    if !members.is_empty() {
        let instances: Vec<String> = members.iter().map(|n| MemberView::parse(n.data.as_bytes()).instance).collect();
        section.lines.push(Line::Leave(
            vec![object],
            format!("instance(s) {} are registered: they are running; stop them first", quoted(&instances)),
        ));
        return section;
    }
    if !others.is_empty() {
        let held: Vec<String> = others.iter().map(|n| format!("{} (held by {:?})", n.path, n.data)).collect();
        section.lines.push(Line::Leave(
            vec![object],
            format!(
                "live sessions hold {}: an instance is still stopping; try again after coordination.session_timeout_ms",
                held.join(", ")
            ),
        ));
        return section;
    }
    if !options.act {
        section.lines.push(Line::Drop(vec![object]));
        return section;
    }
    section.lines.push(match zt::delete(&cluster.client, &tree).await {
        Ok(_) => Line::Drop(vec![object]),
        Err(zk::Error::NotEmpty) => {
            Line::Leave(vec![object], "a node was created meanwhile (an instance starting?); run teardown again".into())
        }
        Err(e) => Line::Leave(vec![object], format!("deleting the nodes failed: {e}")),
    });
    section
}
