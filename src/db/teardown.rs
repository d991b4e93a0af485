//! What every database's `teardown` shares: the decisions, apart from any I/O — which objects
//! go, which stay, and why — and the report it hands back ([`Section`]), which `cli/teardown`
//! prints.
//!
//! The rules:
//! * a shard-partition's objects (table, publication, slot, checkpoint row, grants) go or stay
//!   together, so a stream is never left half removed;
//! * nothing of a source is touched while a streamer runs for it, and nothing of a
//!   shard-partition whose slot a session reads or that a registered instance serves;
//! * a table that still holds rows stays unless `--drop-pending` is given: its rows were never
//!   published;
//! * the source's shared objects (checkpoint table, enqueue function) stay while any of its
//!   tables does — a table left behind still needs them;
//! * objects named like the source's but outside its configured shard-partitions are reported,
//!   never dropped: the config does not say they are this source's.

use std::fmt;

/// How teardown runs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Options {
    /// `--yes`: drop; otherwise only say what would be dropped.
    pub act: bool,
    pub drop_pending: bool,
}

/// What teardown did (or, in a dry run, would do) with one group of objects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Line {
    Drop(Vec<Object>),
    Leave(Vec<Object>, String),
    /// Something seen and not touched that the operator should know of.
    Note(String),
}

/// The lines of one source, or of the cluster's ZooKeeper nodes.
#[derive(Debug)]
pub(crate) struct Section {
    pub title: String,
    pub lines: Vec<Line>,
}

impl Section {
    pub(crate) fn new(title: String) -> Self {
        Self { title, lines: Vec::new() }
    }

    /// Adds a group's verdict as a line.
    pub(crate) fn verdict(&mut self, objects: Vec<Object>, verdict: Verdict) {
        self.lines.push(match verdict {
            Verdict::Drop => Line::Drop(objects),
            Verdict::Leave(why) => Line::Leave(objects, why),
        });
    }
}

/// Which registered instances serve a shard-partition (ZooKeeper's members, read once when
/// teardown starts): what they serve is left.
pub(crate) trait Members: Sync {
    /// The instances serving `key` (`<source>.<table>`).
    fn serving(&self, key: &str) -> Vec<String>;
}

/// Why a shard-partition served by `instances` is left.
pub(crate) fn served_reason(instances: &[String]) -> String {
    format!("instance(s) {} serve it: a streamer is running; stop it first", quoted(instances))
}

fn quoted(names: &[String]) -> String {
    names.iter().map(|n| format!("{n:?}")).collect::<Vec<_>>().join(", ")
}

/// A failed database call in one line, with the server's code, for a "left …" line.
pub(crate) fn db_reason<E: crate::dberror::Classify + fmt::Display>(e: &E) -> String {
    match e.server_error() {
        Some(server) => server.describe(),
        None => e.to_string(),
    }
}

/// One object `setup` creates (or something named like one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Object {
    /// An outbox table, with the rows it held when counted (`None`: not counted).
    Table {
        name: String,
        rows: Option<i64>,
    },
    Publication(String),
    Slot(String),
    /// A shard-partition's row in the checkpoint table.
    CheckpointRow(String),
    CheckpointTable(String),
    /// A PostgreSQL function, `schema.name(argument types)`.
    Function(String),
    /// A MySQL/MariaDB stored routine: `procedure` or `function`, and its name.
    Routine {
        kind: String,
        name: String,
    },
    /// MySQL/MariaDB table privileges of `grantee` (`'user'@'host'`) on `table`.
    Grants {
        grantee: String,
        table: String,
    },
    /// The message API's table, with the messages still prepared in it.
    MessageTable {
        name: String,
        prepared: i64,
    },
    /// A ZooKeeper node and everything below it.
    ZooKeeper {
        path: String,
        nodes: usize,
    },
}

impl fmt::Display for Object {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Object::Table { name, rows: Some(0) } => write!(f, "table {name:?} (empty)"),
            Object::Table { name, rows: Some(1) } => write!(f, "table {name:?} (1 row never published)"),
            Object::Table { name, rows: Some(n) } => write!(f, "table {name:?} ({n} rows never published)"),
            Object::Table { name, rows: None } => write!(f, "table {name:?}"),
            Object::Publication(name) => write!(f, "publication {name:?}"),
            Object::Slot(name) => write!(f, "replication slot {name:?}"),
            Object::CheckpointRow(stream) => write!(f, "checkpoint row {stream:?}"),
            Object::CheckpointTable(name) => write!(f, "checkpoint table {name:?}"),
            Object::Function(signature) => write!(f, "function {signature}"),
            Object::Routine { kind, name } => write!(f, "{} {name:?}", kind.to_lowercase()),
            Object::Grants { grantee, table } => write!(f, "grants to {grantee} on {table:?}"),
            Object::MessageTable { name, prepared: 0 } => write!(f, "message API table {name:?} (none prepared)"),
            Object::MessageTable { name, prepared: 1 } => {
                write!(f, "message API table {name:?} (1 message still prepared)")
            }
            Object::MessageTable { name, prepared } => {
                write!(f, "message API table {name:?} ({prepared} messages still prepared)")
            }
            Object::ZooKeeper { path, nodes: 1 } => write!(f, "ZooKeeper node {path}"),
            Object::ZooKeeper { path, nodes } => write!(f, "ZooKeeper node {path} and the {} below it", nodes - 1),
        }
    }
}

/// What exists of one configured shard-partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StreamFound {
    pub table: String,
    /// Rows in its table; `None` when there is no table.
    pub rows: Option<i64>,
    /// Its other objects that exist (publication, slot, checkpoint row, grants).
    pub others: Vec<Object>,
    /// Why it must not be touched now: its slot is read, an instance serves it.
    pub busy: Option<String>,
}

impl StreamFound {
    /// Every object of the shard-partition that exists, its table first.
    pub(crate) fn objects(&self) -> Vec<Object> {
        let table = self.rows.map(|rows| Object::Table { name: self.table.clone(), rows: Some(rows) });
        table.into_iter().chain(self.others.iter().cloned()).collect()
    }
}

/// Whether a group of objects goes, or stays and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    Drop,
    Leave(String),
}

/// The verdict on a shard-partition's objects; `None` when nothing of it exists.
/// `source_busy` says why nothing of the source may be touched (a streamer runs).
pub(crate) fn stream_verdict(stream: &StreamFound, source_busy: Option<&str>, drop_pending: bool) -> Option<Verdict> {
    if stream.rows.is_none() && stream.others.is_empty() {
        return None;
    }
    // The shard-partition's own reason (its slot is read) names more than the source's.
    Some(match (stream.busy.as_deref().or(source_busy), stream.rows) {
        (Some(why), _) => Verdict::Leave(why.to_string()),
        (None, Some(rows)) if rows > 0 && !drop_pending => Verdict::Leave(PENDING_REASON.into()),
        _ => Verdict::Drop,
    })
}

/// `objects` with the table's row count replaced by `rows` (counted again under the lock).
pub(crate) fn recounted(objects: Vec<Object>, rows: i64) -> Vec<Object> {
    objects
        .into_iter()
        .map(|o| match o {
            Object::Table { name, .. } => Object::Table { name, rows: Some(rows) },
            other => other,
        })
        .collect()
}

/// Why a table that holds rows stays (the table's line says how many).
pub(crate) const PENDING_REASON: &str = "its rows were never published; run the streamer until they are sent \
     (`status` shows them pending), or add --drop-pending to discard them";

/// The verdict on the message API's table holding `prepared` undecided messages: like an
/// outbox table's, it stays while a streamer (which serves the API) runs, or while it holds
/// prepared messages unless `--drop-pending`. While it stays, so does the enqueue routine a
/// commit calls.
pub(crate) fn message_table_verdict(prepared: i64, source_busy: Option<&str>, drop_pending: bool) -> Verdict {
    match source_busy {
        Some(why) => Verdict::Leave(why.to_string()),
        None if prepared > 0 && !drop_pending => Verdict::Leave(PREPARED_REASON.into()),
        None => Verdict::Drop,
    }
}

/// Why a message API table with prepared messages stays.
pub(crate) const PREPARED_REASON: &str = "its prepared messages are not decided yet; run the streamer and commit or \
     roll them back (or let the check-back decide them), or add --drop-pending to discard them";

/// The verdict on the source's shared objects (checkpoint table, enqueue function), given the
/// tables that remain after this run (left shard-partitions' and strays).
pub(crate) fn shared_verdict(remaining_tables: &[String], source_busy: Option<&str>) -> Verdict {
    if let Some(why) = source_busy {
        return Verdict::Leave(why.to_string());
    }
    match remaining_tables {
        [] => Verdict::Drop,
        [one] => Verdict::Leave(format!("table {one:?} remains and still needs them")),
        many => Verdict::Leave(format!(
            "tables {} remain and still need them",
            many.iter().map(|t| format!("{t:?}")).collect::<Vec<_>>().join(", ")
        )),
    }
}

/// Why an object named like the source's, outside its shard-partitions, stays.
pub(crate) fn stray_reason(shards: u32, partitions: u32) -> String {
    format!(
        "named like this source's objects but outside its {shards} shard(s) × {partitions} partition(s): not touched; \
         raise shards/partitions to cover it and run teardown again, or drop it by hand"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(rows: Option<i64>, others: Vec<Object>) -> StreamFound {
        StreamFound { table: "outbox_0_0".into(), rows, others, busy: None }
    }

    #[test]
    fn an_empty_stream_goes_whole_and_a_missing_one_is_not_mentioned() {
        let s = stream(Some(0), vec![Object::Slot("outbox_0_0".into())]);
        assert_eq!(stream_verdict(&s, None, false), Some(Verdict::Drop));
        assert_eq!(s.objects()[0], Object::Table { name: "outbox_0_0".into(), rows: Some(0) });
        assert_eq!(stream_verdict(&stream(None, vec![]), None, false), None);
        // What a half-finished earlier run left (a slot without its table) goes too.
        assert_eq!(stream_verdict(&stream(None, vec![Object::Slot("s".into())]), None, false), Some(Verdict::Drop));
    }

    #[test]
    fn pending_rows_keep_the_stream_unless_dropped_on_purpose() {
        let s = stream(Some(3), vec![Object::Publication("outbox_0_0".into())]);
        assert_eq!(stream_verdict(&s, None, false), Some(Verdict::Leave(PENDING_REASON.into())));
        assert!(PENDING_REASON.contains("--drop-pending"));
        assert_eq!(stream_verdict(&s, None, true), Some(Verdict::Drop));
    }

    #[test]
    fn a_running_streamer_keeps_everything_even_with_drop_pending() {
        let mut s = stream(Some(0), vec![]);
        assert_eq!(stream_verdict(&s, Some("a streamer runs"), true), Some(Verdict::Leave("a streamer runs".into())));
        s.busy = Some("slot read by pid 7".into());
        assert_eq!(stream_verdict(&s, None, true), Some(Verdict::Leave("slot read by pid 7".into())));
        assert_eq!(
            stream_verdict(&s, Some("a streamer runs"), false),
            Some(Verdict::Leave("slot read by pid 7".into()))
        );
        assert_eq!(shared_verdict(&[], Some("a streamer runs")), Verdict::Leave("a streamer runs".into()));
    }

    #[test]
    fn shared_objects_stay_while_a_table_does() {
        assert_eq!(shared_verdict(&[], None), Verdict::Drop);
        let Verdict::Leave(why) = shared_verdict(&["outbox_1_0".into()], None) else { panic!() };
        assert_eq!(why, "table \"outbox_1_0\" remains and still needs them");
        let Verdict::Leave(why) = shared_verdict(&["a".into(), "b".into()], None) else { panic!() };
        assert_eq!(why, "tables \"a\", \"b\" remain and still need them");
    }

    #[test]
    fn objects_name_themselves() {
        let t = |rows| Object::Table { name: "t".into(), rows }.to_string();
        assert_eq!(t(Some(0)), "table \"t\" (empty)");
        assert_eq!(t(None), "table \"t\"");
        assert_eq!(t(Some(1)), "table \"t\" (1 row never published)");
        assert_eq!(t(Some(5)), "table \"t\" (5 rows never published)");
        assert_eq!(
            Object::ZooKeeper { path: "/o/c".into(), nodes: 4 }.to_string(),
            "ZooKeeper node /o/c and the 3 below it"
        );
        assert_eq!(
            Object::Routine { kind: "PROCEDURE".into(), name: "outbox_enqueue".into() }.to_string(),
            "procedure \"outbox_enqueue\""
        );
    }
}
