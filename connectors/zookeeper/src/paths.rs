//! Where a cluster keeps its members and leases.

/// The znode paths of one cluster (`<root>/<cluster>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterPaths {
    base: String,
}

impl ClusterPaths {
    /// `root` is absolute (`/outbox-streamer`); `cluster` is one path segment.
    pub fn new(root: &str, cluster: &str) -> Self {
        Self { base: format!("{}/{}", root.trim_end_matches('/'), segment(cluster)) }
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    /// The directory of member nodes.
    pub fn members(&self) -> String {
        format!("{}/members", self.base)
    }

    /// The lock directory of one stream (`<source>.<table>`).
    pub fn lease(&self, stream: &str) -> String {
        format!("{}/leases/{}", self.base, segment(stream))
    }

    /// The streams offered to `instance` by yielding owners: one child per stream.
    pub fn offers(&self, instance: &str) -> String {
        format!("{}/offers/{}", self.base, segment(instance))
    }
}

/// A znode name made of `s`: `/` would start a child, so it becomes `_`.
fn segment(s: &str) -> String {
    s.replace('/', "_")
}

#[cfg(test)]
mod tests {
    use super::ClusterPaths;

    #[test]
    fn paths_are_under_the_cluster() {
        let p = ClusterPaths::new("/outbox-streamer/", "prod");
        assert_eq!(p.members(), "/outbox-streamer/prod/members");
        assert_eq!(p.lease("pg.outbox_0_1"), "/outbox-streamer/prod/leases/pg.outbox_0_1");
        assert_eq!(p.lease("a/b"), "/outbox-streamer/prod/leases/a_b");
    }
}
