//! Removing a cluster's nodes (`<root>/<cluster>` and everything below it) once no instance
//! uses them.
//!
//! A live instance owns ephemeral nodes there — its member node and the lock nodes of the
//! leases it holds — so a tree with an ephemeral node is in use and [`delete`] is not to be
//! called on it. Deleting goes children first; a node created meanwhile (an instance starting)
//! makes its parent's delete fail with `NotEmpty`, which the caller reports.

use crate::paths::ClusterPaths;
use crate::zk;

/// One node of the tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    pub path: String,
    /// The session owning it, for an ephemeral node (a live instance's); 0 otherwise.
    pub ephemeral_owner: i64,
    /// Its data as text (a lock node holds its holder's instance name).
    pub data: String,
}

/// A cluster's nodes, children before their parents (the order to delete them in).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tree {
    pub nodes: Vec<Node>,
}

impl Tree {
    /// The ephemeral nodes: owned by live sessions.
    pub fn ephemerals(&self) -> impl Iterator<Item = &Node> {
        self.nodes.iter().filter(|n| n.ephemeral_owner != 0)
    }
}

/// The cluster's tree, or `None` when its base node does not exist.
pub async fn walk(client: &zk::Client, paths: &ClusterPaths) -> Result<Option<Tree>, zk::Error> {
    let base = paths.base().to_string();
    // Depth first with an explicit stack; a node is emitted after all its children.
    let mut stack: Vec<(String, bool)> = vec![(base.clone(), false)];
    let mut nodes = Vec::new();
    while let Some((path, expanded)) = stack.pop() {
        if expanded {
            match client.get_data(&path).await {
                Ok((data, stat)) => nodes.push(Node {
                    path,
                    ephemeral_owner: stat.ephemeral_owner,
                    data: String::from_utf8_lossy(&data).into_owned(),
                }),
                Err(zk::Error::NoNode) => {}
                Err(e) => return Err(e),
            }
            continue;
        }
        match client.list_children(&path).await {
            Ok(children) => {
                stack.push((path.clone(), true));
                for child in children {
                    stack.push((format!("{path}/{child}"), false));
                }
            }
            Err(zk::Error::NoNode) if path == base => return Ok(None),
            Err(zk::Error::NoNode) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(Some(Tree { nodes }))
}

/// Deletes the tree's nodes, children first; a node already gone is fine. Returns how many
/// this call deleted.
pub async fn delete(client: &zk::Client, tree: &Tree) -> Result<usize, zk::Error> {
    let mut deleted = 0;
    for node in &tree.nodes {
        match client.delete(&node.path, None).await {
            Ok(()) => deleted += 1,
            Err(zk::Error::NoNode) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(deleted)
}
