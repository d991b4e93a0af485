//! Balanced assignment, computed by every instance from the same member list: no instance
//! tells another what to do, each takes or gives up leases to reach its own quota.

/// How many of `total` shard-partitions the member at `rank` (0 = oldest) of `members`
/// should own: `total / members`, plus one for the oldest `total % members` members.
pub fn quota(total: usize, members: usize, rank: usize) -> usize {
    if members == 0 {
        return 0;
    }
    total / members + usize::from(rank < total % members)
}

/// The order in which the member at `rank` prefers shard-partitions: its own stripe
/// (`i % members == rank`) first, so instances rarely contend for the same free lease, and
/// gives up the least preferred first.
pub fn preference(total: usize, members: usize, rank: usize) -> Vec<usize> {
    let members = members.max(1);
    let mut order: Vec<usize> = (0..total).collect();
    order.sort_by_key(|&i| ((i % members + members - rank % members) % members, i));
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotas_add_up_and_differ_by_at_most_one() {
        for total in 0..20 {
            for members in 1..8 {
                let quotas: Vec<usize> = (0..members).map(|r| quota(total, members, r)).collect();
                assert_eq!(quotas.iter().sum::<usize>(), total, "{total} over {members}");
                assert!(quotas.iter().max().unwrap() - quotas.iter().min().unwrap() <= 1);
            }
        }
        assert_eq!(quota(6, 3, 2), 2);
        assert_eq!((0..4).map(|r| quota(6, 4, r)).collect::<Vec<_>>(), vec![2, 2, 1, 1]);
        assert_eq!(quota(6, 0, 0), 0);
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
