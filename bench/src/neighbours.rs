//! Other databases' work on the bench's database server during the measured window.
//!
//! "DB CPU s/1k" is the CPU time of every process of the server, so work in other databases
//! (another engineer's tests, an application) is in it. The report names those databases so the
//! number is not read as the streamer's cost alone. PostgreSQL counts transactions per database
//! (`pg_stat_database`, flushed by each backend at most a second late — but only once it has
//! touched a table: a session running nothing but `SELECT 1` is not counted): the difference
//! over the window is exact up to that. MariaDB counts none per database, so its sessions are
//! sampled about once a second and a database counts as active when a sample caught one at work.

use std::collections::BTreeMap;

use super::db::BenchDb;

/// What was seen of other databases since [`Neighbours::start`].
#[derive(Debug, Default)]
pub(super) struct Neighbours {
    /// PostgreSQL: each other database's transactions at the start.
    transactions: BTreeMap<String, i64>,
    /// MariaDB: in how many samples each other database was at work.
    busy: BTreeMap<String, usize>,
    samples: usize,
}

impl Neighbours {
    /// Starts watching; a database that cannot be read is watched as having no neighbours.
    pub(super) async fn start(db: &BenchDb) -> Self {
        let transactions = db.other_databases_transactions().await.unwrap_or_else(|e| {
            tracing::warn!(error = %format!("{e:#}"), "cannot read other databases' activity");
            BTreeMap::new()
        });
        Self { transactions, ..Self::default() }
    }

    /// Takes one sample (MariaDB; nothing to do for PostgreSQL).
    pub(super) async fn sample(&mut self, db: &BenchDb) {
        if let Ok(busy) = db.other_databases_busy().await {
            self.samples += 1;
            for name in busy {
                *self.busy.entry(name).or_default() += 1;
            }
        }
    }

    /// The other databases that were active, busiest first, with how much
    /// (`"app (1520 transactions)"`).
    pub(super) async fn finish(self, db: &BenchDb) -> Vec<String> {
        let now = db.other_databases_transactions().await.unwrap_or_default();
        let mut active = active_since(&self.transactions, &now);
        let mut busy: Vec<(&String, &usize)> = self.busy.iter().collect();
        busy.sort_by_key(|(_, n)| std::cmp::Reverse(**n));
        active.extend(busy.iter().map(|(name, n)| format!("{name} (at work in {n} of {} samples)", self.samples)));
        active
    }
}

/// The databases whose transaction count grew from `before` to `after` (a database created
/// meanwhile counts from zero), most transactions first.
fn active_since(before: &BTreeMap<String, i64>, after: &BTreeMap<String, i64>) -> Vec<String> {
    let mut grown: Vec<(&String, i64)> = after
        .iter()
        .map(|(name, &n)| (name, n - before.get(name).copied().unwrap_or(0)))
        .filter(|(_, g)| *g > 0)
        .collect();
    grown.sort_by_key(|(_, g)| std::cmp::Reverse(*g));
    grown.into_iter().map(|(name, g)| format!("{name} ({g} transactions)")).collect()
}

/// How many databases a note names; the rest are counted.
const NAMED: usize = 5;

/// The note under a report whose DB CPU includes `others`' work (the busiest first).
pub(super) fn note(others: &[String]) -> String {
    let mut named = others.iter().take(NAMED).cloned().collect::<Vec<_>>().join(", ");
    if others.len() > NAMED {
        named.push_str(&format!(" and {} more", others.len() - NAMED));
    }
    format!(
        "DB CPU s/1k is the CPU of every process of the database server; other databases were active during the run ({named}), so it includes their work"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_databases_that_worked_are_named() {
        let before = BTreeMap::from([("a".to_string(), 10), ("b".to_string(), 5)]);
        let after = BTreeMap::from([("a".to_string(), 10), ("b".to_string(), 9), ("c".to_string(), 2)]);
        assert_eq!(active_since(&before, &after), ["b (4 transactions)", "c (2 transactions)"]);
        assert!(
            note(&["b (4 transactions)".into()])
                .contains("other databases were active during the run (b (4 transactions))")
        );
        let many: Vec<String> = (0..7).map(|i| format!("d{i}")).collect();
        assert!(note(&many).contains("(d0, d1, d2, d3, d4 and 2 more)"), "{}", note(&many));
    }
}
