//! Membership: one ephemeral-sequential node per live instance, whose data says what the
//! instance is and serves (so members that disagree can balance over the union of what they
//! serve, and notice when two deployments share a cluster name).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::paths::ClusterPaths;
use crate::{directory_options, zk};

const PREFIX: &str = "member-";

/// What a member node holds: the instance name, the shard-partitions it can serve
/// (`<source>.<table>`), a fingerprint of each source (which database it is), and where its
/// metrics endpoint answers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberView {
    pub instance: String,
    /// `None` for a member of an older version, whose node holds only its name.
    #[serde(default)]
    pub streams: Option<Vec<String>>,
    #[serde(default)]
    pub sources: Option<BTreeMap<String, String>>,
    /// `host:port` of the instance's metrics endpoint, whose `GET /streams` says what each of
    /// its shard-partitions is doing; `None` without one (or from an older member).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<String>,
}

impl MemberView {
    /// Reads a member node's data: this JSON, or an older member's bare instance name.
    pub fn parse(data: &[u8]) -> Self {
        serde_json::from_slice(data)
            .unwrap_or_else(|_| Self { instance: String::from_utf8_lossy(data).into_owned(), ..Self::default() })
    }
}

/// A live instance as seen in ZooKeeper.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// The node's sequence: lower joined earlier.
    pub seq: i64,
    pub instance: String,
    /// The member node's name.
    pub node: String,
    pub view: MemberView,
}

/// Registers this instance; returns its node name. The node lives as long as the session.
pub async fn register(client: &zk::Client, paths: &ClusterPaths, view: &MemberView) -> Result<String, zk::Error> {
    let dir = paths.members();
    client.mkdir(&dir, &directory_options()).await?;
    let options = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
    let prefix = format!("{dir}/{PREFIX}");
    let data = serde_json::to_vec(view).expect("a member view serialises");
    let (_, seq) = client.create(&prefix, &data, &options).await?;
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
            Ok((data, _)) => {
                let view = MemberView::parse(&data);
                members.push(Member { seq, instance: view.instance.clone(), node, view });
            }
            // Left between the listing and the read.
            Err(zk::Error::NoNode) => {}
            Err(e) => return Err(e),
        }
    }
    members.sort_by_key(|m| m.seq);
    Ok(members)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_round_trip_and_older_members_are_read_by_name() {
        let view = MemberView {
            instance: "a".into(),
            streams: Some(vec!["app.outbox_0_0".into()]),
            sources: Some(BTreeMap::from([("app".into(), "postgres db@h:5432".into())])),
            metrics: Some("10.0.0.7:9187".into()),
        };
        assert_eq!(MemberView::parse(&serde_json::to_vec(&view).unwrap()), view);
        let old = MemberView::parse(b"host-1234");
        assert_eq!((old.instance.as_str(), old.streams, old.sources), ("host-1234", None, None));
        let without_metrics = br#"{"instance":"a","streams":["app.outbox_0_0"],"sources":{}}"#;
        assert_eq!(MemberView::parse(without_metrics).metrics, None, "a member of the version before");
    }
}
