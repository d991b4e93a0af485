//! Named scenarios and suites: the comparisons `docs/benchmarks.md` reports, runnable by name.
//!
//! A scenario fixes the database, the mode, the rate, the payload size, the number of
//! shard-partitions and whether it is a backlog drain; the rest of the flags keep their
//! values, and an explicit `--backlog` sets the rows of a backlog scenario (it was overridden
//! by the preset's 1,000,000 until 2026-12-07). Names read `<db>-<mode>-<load>[-2kb][-4p]`, for example `pg-cdc-1k`,
//! `mariadb-polling-max` or `pg-cdc-backlog`.

use super::{BenchArgs, BenchMode, DbKind};

/// Rows of a backlog drain.
pub(crate) const BACKLOG_ROWS: usize = 1_000_000;

/// One named scenario.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Scenario {
    pub name: String,
    pub db: DbKind,
    pub mode: BenchMode,
    /// Messages per second; 0 for as fast as possible.
    pub rate: u64,
    pub payload_bytes: usize,
    pub partitions: u32,
    pub backlog: Option<usize>,
}

impl Scenario {
    /// Sets the scenario's values on `args` (and names the run after it).
    pub(crate) fn apply(&self, args: &mut BenchArgs) {
        args.scenario = self.name.clone();
        args.db = self.db;
        args.mode = self.mode;
        args.rate = self.rate;
        args.payload_bytes = self.payload_bytes;
        args.partitions = self.partitions;
        args.backlog = match (self.backlog, args.backlog) {
            (Some(_), Some(rows)) => Some(rows),
            (preset, _) => preset,
        };
    }
}

/// Every named scenario, in the order a suite runs them.
pub(crate) fn all() -> Vec<Scenario> {
    let mut out = Vec::new();
    for (db, prefix) in [(DbKind::Postgres, "pg"), (DbKind::Mariadb, "mariadb")] {
        let s = |mode: BenchMode, load: &str, rate: u64, payload_bytes: usize, partitions: u32, backlog| {
            let mode_name = match mode {
                BenchMode::Cdc => "cdc",
                BenchMode::Polling => "polling",
                BenchMode::Ceiling => "ceiling",
            };
            let mut name = format!("{prefix}-{mode_name}-{load}");
            if payload_bytes != 200 {
                name.push_str("-2kb");
            }
            if partitions != 1 {
                name.push_str(&format!("-{partitions}p"));
            }
            Scenario { name, db, mode, rate, payload_bytes, partitions, backlog }
        };
        out.push(s(BenchMode::Ceiling, "max", 0, 200, 1, None));
        for mode in [BenchMode::Cdc, BenchMode::Polling] {
            out.push(s(mode, "1k", 1000, 200, 1, None));
            out.push(s(mode, "5k", 5000, 200, 1, None));
            out.push(s(mode, "max", 0, 200, 1, None));
            out.push(s(mode, "1k", 1000, 2048, 1, None));
            out.push(s(mode, "1k", 1000, 200, 4, None));
            out.push(s(mode, "backlog", 0, 200, 1, Some(BACKLOG_ROWS)));
        }
    }
    out
}

pub(crate) fn find(name: &str) -> Option<Scenario> {
    all().into_iter().find(|s| s.name == name)
}

/// The scenarios of a suite: `pg`, `mariadb` or `all`.
pub(crate) fn suite(name: &str) -> Option<Vec<Scenario>> {
    let prefix = match name {
        "pg" => "pg-",
        "mariadb" => "mariadb-",
        "all" => "",
        _ => return None,
    };
    Some(all().into_iter().filter(|s| s.name.starts_with(prefix)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_describe_the_scenario() {
        let all = all();
        let names: std::collections::HashSet<&str> = all.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names.len(), all.len());
        let s = find("pg-cdc-1k-4p").expect("named");
        assert_eq!((s.db, s.mode, s.rate, s.partitions), (DbKind::Postgres, BenchMode::Cdc, 1000, 4));
        assert_eq!(find("mariadb-polling-1k-2kb").expect("named").payload_bytes, 2048);
        assert_eq!(find("pg-cdc-backlog").expect("named").backlog, Some(BACKLOG_ROWS));
        assert_eq!(suite("pg").expect("suite").len(), 13);
        assert!(suite("nope").is_none());
    }

    #[test]
    fn an_explicit_backlog_sets_the_rows_of_a_backlog_scenario() {
        use clap::Parser;
        let parse = |args: &[&str]| BenchArgs::try_parse_from([&["outbox-bench"], args].concat()).unwrap();
        let preset = find("pg-cdc-backlog").expect("named");
        let mut args = parse(&["--backlog", "300000"]);
        preset.apply(&mut args);
        assert_eq!(args.backlog, Some(300_000), "the flag says how many rows");
        let mut args = parse(&[]);
        preset.apply(&mut args);
        assert_eq!(args.backlog, Some(BACKLOG_ROWS), "the preset's size without the flag");
        let mut args = parse(&["--backlog", "300000"]);
        find("pg-cdc-1k").expect("named").apply(&mut args);
        assert_eq!(args.backlog, None, "a fixed-rate scenario drains no backlog");
    }
}
