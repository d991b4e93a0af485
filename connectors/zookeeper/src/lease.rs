//! One lease per shard-partition: a Curator-compatible lock whose node's creation zxid is the
//! owner epoch.
//!
//! The epoch is a fencing token: zxids only grow across the ensemble, so every new grant of a
//! lease carries a larger epoch than any earlier one, and a write guarded by
//! `owner_epoch <= epoch` refuses a stale owner once the new owner has written.

use std::time::Duration;

use crate::paths::ClusterPaths;
use crate::{directory_options, zk};

/// The Curator `InterProcessMutex` lock name.
const LOCK_NAME: &str = "lock-";

/// A held lease. Dropping it deletes the lock node in the background; [`Lease::release`]
/// deletes it and waits for the server.
#[derive(Debug)]
pub struct Lease {
    lock: zk::OwnedLockClient,
    /// The lock node's creation zxid.
    pub epoch: i64,
}

impl Lease {
    /// The lock node's path.
    pub fn path(&self) -> &str {
        self.lock.lock_path()
    }

    /// Whether the lock node still exists with this epoch (it can vanish with the session or
    /// by an operator's hand).
    pub async fn still_held(&self) -> Result<bool, zk::Error> {
        match self.lock.client().check_stat(self.lock.lock_path()).await? {
            Some(stat) => Ok(stat.czxid == self.epoch),
            None => Ok(false),
        }
    }

    /// Deletes the lock node, so the next contender may take the stream.
    pub async fn release(self) -> Result<(), zk::Error> {
        match self.lock.client().delete(self.lock.lock_path(), None).await {
            Ok(()) | Err(zk::Error::NoNode) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// The current holder of a stream's lease, as `status` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub instance: String,
    pub epoch: i64,
}

/// Tries to take the lease of `stream`, waiting at most `wait` behind another contender.
/// `Ok(None)`: someone else holds it (our contender node is removed again).
pub async fn acquire(
    client: &zk::Client,
    paths: &ClusterPaths,
    stream: &str,
    instance: &str,
    wait: Duration,
) -> Result<Option<Lease>, zk::Error> {
    let dir = paths.lease(stream);
    let prefix = zk::LockPrefix::new_curator(&dir, LOCK_NAME)?;
    let options = zk::LockOptions::new(zk::Acls::anyone_all()).with_ancestor_options(directory_options())?;
    let lock = match tokio::time::timeout(wait, client.lock(prefix, instance.as_bytes(), options)).await {
        Ok(lock) => lock?.into_owned(),
        Err(_) => return Ok(None),
    };
    // Taken from a read, not from the create: servers before 3.7.2/3.8.2/3.9.0 return an
    // invalid Stat for a create inside a multi (ZOOKEEPER-4026).
    let (_, stat) = lock.client().get_data(lock.lock_path()).await?;
    Ok(Some(Lease { lock, epoch: stat.czxid }))
}

/// Whether nobody holds or waits for `stream`'s lease.
pub async fn is_free(client: &zk::Client, paths: &ClusterPaths, stream: &str) -> Result<bool, zk::Error> {
    match client.list_children(&paths.lease(stream)).await {
        Ok(children) => Ok(!children.iter().any(|c| c.contains(LOCK_NAME))),
        Err(zk::Error::NoNode) => Ok(true),
        Err(e) => Err(e),
    }
}

/// Who holds `stream`'s lease now: the contender with the lowest sequence.
pub async fn holder(client: &zk::Client, paths: &ClusterPaths, stream: &str) -> Result<Option<Holder>, zk::Error> {
    let dir = paths.lease(stream);
    let mut children = match client.list_children(&dir).await {
        Ok(children) => children,
        Err(zk::Error::NoNode) => return Ok(None),
        Err(e) => return Err(e),
    };
    children.retain(|c| c.contains(LOCK_NAME));
    children.sort_by_key(|c| sequence(c));
    for child in children {
        match client.get_data(&format!("{dir}/{child}")).await {
            Ok((data, stat)) => {
                return Ok(Some(Holder { instance: String::from_utf8_lossy(&data).into_owned(), epoch: stat.czxid }));
            }
            Err(zk::Error::NoNode) => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(None)
}

/// How many contenders (the holder included) are queued for `stream`'s lease.
pub async fn contenders(client: &zk::Client, paths: &ClusterPaths, stream: &str) -> Result<usize, zk::Error> {
    match client.list_children(&paths.lease(stream)).await {
        Ok(children) => Ok(children.iter().filter(|c| c.contains(LOCK_NAME)).count()),
        Err(zk::Error::NoNode) => Ok(0),
        Err(e) => Err(e),
    }
}

/// Offers `stream` to `successor`: a yielding owner keeps streaming until the successor queues
/// for the lease, then gives it up, so the stream changes hands without an idle gap.
pub async fn offer(client: &zk::Client, paths: &ClusterPaths, stream: &str, successor: &str) -> Result<(), zk::Error> {
    let dir = paths.offers(successor);
    client.mkdir(&dir, &directory_options()).await?;
    match client.create(&format!("{dir}/{stream}"), b"", &directory_options()).await {
        Ok(_) | Err(zk::Error::NodeExists) => Ok(()),
        Err(e) => Err(e),
    }
}

/// The streams offered to `instance`.
pub async fn offers(client: &zk::Client, paths: &ClusterPaths, instance: &str) -> Result<Vec<String>, zk::Error> {
    match client.list_children(&paths.offers(instance)).await {
        Ok(streams) => Ok(streams),
        Err(zk::Error::NoNode) => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

/// Removes the offer of `stream` to `instance` (taken, or given up).
pub async fn withdraw(
    client: &zk::Client,
    paths: &ClusterPaths,
    instance: &str,
    stream: &str,
) -> Result<(), zk::Error> {
    match client.delete(&format!("{}/{stream}", paths.offers(instance)), None).await {
        Ok(()) | Err(zk::Error::NoNode) => Ok(()),
        Err(e) => Err(e),
    }
}

/// The ten-digit sequence suffix ZooKeeper appends to a sequential node's name.
fn sequence(name: &str) -> i64 {
    name.rsplit(LOCK_NAME).next().and_then(|s| s.parse().ok()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_sequence_is_read_after_the_lock_name() {
        assert_eq!(super::sequence("_c_0f1e2d3c-aaaa-bbbb-cccc-0123456789ab-lock-0000000042"), 42);
        assert_eq!(super::sequence("garbage"), i64::MAX);
    }
}
