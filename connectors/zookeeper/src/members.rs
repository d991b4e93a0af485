//! Membership: one ephemeral-sequential node per live instance.

use crate::paths::ClusterPaths;
use crate::{directory_options, zk};

const PREFIX: &str = "member-";

/// A live instance as seen in ZooKeeper.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// The node's sequence: lower joined earlier.
    pub seq: i64,
    pub instance: String,
    /// The member node's name.
    pub node: String,
}

/// Registers this instance; returns its node name. The node lives as long as the session.
pub async fn register(client: &zk::Client, paths: &ClusterPaths, instance: &str) -> Result<String, zk::Error> {
    let dir = paths.members();
    client.mkdir(&dir, &directory_options()).await?;
    let options = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
    let prefix = format!("{dir}/{PREFIX}");
    let (_, seq) = client.create(&prefix, instance.as_bytes(), &options).await?;
    Ok(format!("{PREFIX}{seq}"))
}

/// The live members, oldest first, and a watcher that fires when the set changes.
pub async fn watch(client: &zk::Client, paths: &ClusterPaths) -> Result<(Vec<Member>, zk::OneshotWatcher), zk::Error> {
    let dir = paths.members();
    client.mkdir(&dir, &directory_options()).await?;
    let (names, watcher) = client.list_and_watch_children(&dir).await?;
    Ok((read(client, &dir, names).await?, watcher))
}

/// The live members, oldest first.
pub async fn list(client: &zk::Client, paths: &ClusterPaths) -> Result<Vec<Member>, zk::Error> {
    let dir = paths.members();
    match client.list_children(&dir).await {
        Ok(names) => read(client, &dir, names).await,
        Err(zk::Error::NoNode) => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

async fn read(client: &zk::Client, dir: &str, names: Vec<String>) -> Result<Vec<Member>, zk::Error> {
    let mut members = Vec::with_capacity(names.len());
    for node in names {
        let Some(seq) = node.strip_prefix(PREFIX).and_then(|s| s.parse::<i64>().ok()) else { continue };
        match client.get_data(&format!("{dir}/{node}")).await {
            Ok((data, _)) => members.push(Member { seq, instance: String::from_utf8_lossy(&data).into_owned(), node }),
            // Left between the listing and the read.
            Err(zk::Error::NoNode) => {}
            Err(e) => return Err(e),
        }
    }
    members.sort_by_key(|m| m.seq);
    Ok(members)
}
