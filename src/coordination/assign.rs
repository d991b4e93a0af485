//! Balanced assignment, computed by every instance from the same member list: no instance
//! tells another what to do, each takes or gives up leases to reach its own quota.

/// The order in which the member at `rank` prefers shard-partitions: its own stripe
/// (`i % members == rank`) first, so instances rarely contend for the same free lease, and
/// gives up the least preferred first.
pub(crate) fn preference(total: usize, members: usize, rank: usize) -> Vec<usize> {
    let members = members.max(1);
    let mut order: Vec<usize> = (0..total).collect();
    order.sort_by_key(|&i| ((i % members + members - rank % members) % members, i));
    order
}

/// How many shard-partitions each member should own when members may serve different sets
/// (a rolling change of `shards`, a source added on some instances first). `serves[r]` lists
/// the union indexes member `r` (in member order, oldest first) can serve; every index of
/// `0..total` that some member serves is assigned to exactly one of them. Streams with the
/// fewest candidates go first, each to the candidate with the fewest so far (the oldest on a
/// tie), so the counts are as even as the sets allow and every quota can be met. Returns the
/// targets of each member.
pub(crate) fn plan(total: usize, serves: &[Vec<usize>]) -> Vec<Vec<usize>> {
    let mut candidates: Vec<Vec<usize>> = vec![Vec::new(); total];
    for (member, indexes) in serves.iter().enumerate() {
        for &i in indexes {
            if i < total {
                candidates[i].push(member);
            }
        }
    }
    let mut order: Vec<usize> = (0..total).filter(|&i| !candidates[i].is_empty()).collect();
    order.sort_by_key(|&i| (candidates[i].len(), i));
    let mut targets: Vec<Vec<usize>> = vec![Vec::new(); serves.len()];
    for i in order {
        let &member = candidates[i].iter().min_by_key(|&&m| (targets[m].len(), m)).expect("has candidates");
        targets[member].push(i);
    }
    for t in &mut targets {
        t.sort_unstable();
    }
    targets
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_covers_every_served_stream_as_evenly_as_the_sets_allow() {
        // Everyone serves everything: the plain quotas.
        let all: Vec<usize> = (0..6).collect();
        let p = plan(6, &[all.clone(), all.clone(), all]);
        assert_eq!(p.iter().map(Vec::len).collect::<Vec<_>>(), vec![2, 2, 2]);
        // A rolling change of shards: one member still serves 2 of 3 streams.
        let p = plan(3, &[vec![0, 1], vec![0, 1, 2]]);
        assert_eq!(p.iter().map(Vec::len).sum::<usize>(), 3, "every stream has an owner: {p:?}");
        assert!(p[1].contains(&2), "only member 1 serves stream 2: {p:?}");
        // One member serves a single stream the other serves too.
        let p = plan(4, &[vec![0], vec![0, 1, 2, 3]]);
        assert_eq!(p, vec![vec![0], vec![1, 2, 3]]);
        // Nobody serves stream 2: it is left out rather than given to the wrong member.
        let p = plan(3, &[vec![0], vec![1]]);
        assert_eq!(p, vec![vec![0], vec![1]]);
        // Deterministic: the same sets give the same plan.
        let sets = [vec![0, 2, 4, 5], vec![1, 2, 3, 4, 5], vec![0, 1, 5]];
        assert_eq!(plan(6, &sets), plan(6, &sets));
        let sizes: Vec<usize> = plan(6, &sets).iter().map(Vec::len).collect();
        assert_eq!(sizes.iter().sum::<usize>(), 6);
        assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1, "{sizes:?}");
    }

    #[test]
    fn each_member_prefers_its_own_stripe() {
        assert_eq!(preference(6, 3, 0), vec![0, 3, 1, 4, 2, 5]);
        assert_eq!(preference(6, 3, 1), vec![1, 4, 2, 5, 0, 3]);
        assert_eq!(preference(6, 3, 2), vec![2, 5, 0, 3, 1, 4]);
        let mut all = preference(7, 1, 0);
        all.sort_unstable();
        assert_eq!(all, (0..7).collect::<Vec<_>>());
    }
}
