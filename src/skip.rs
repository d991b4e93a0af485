//! What an operator told a shard-partition to skip (`outbox-streamer skip`), as stored in its
//! checkpoint row: row ids, and transactions whose rows have no readable id.
//!
//! A row id is skipped only in transactions that committed before the command ran: each id
//! carries the log position of that moment (its *bound*), because ids can be handed out again
//! (MariaDB's `TRUNCATE` resets `AUTO_INCREMENT`) and a later row with the same id must still
//! be published. Only the source can tell whether a transaction is before a bound, so it
//! answers [`crate::source::Source::skips`] with [`SkipList::bound_of`].

use std::collections::{BTreeMap, BTreeSet};

/// The stored skip lists of one shard-partition.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct SkipList {
    /// Row id → the log position (as the source writes it) before which it is skipped.
    ids: BTreeMap<i64, String>,
    transactions: BTreeSet<String>,
    /// WAL-only messages by identity (their log position), stored as `m<id>` in `skip_ids`.
    messages: BTreeSet<i64>,
    /// Rows of a table identified by a key (see `crate::row_keys`), by key → bound, stored as
    /// `k<key>@bound` in `skip_ids`.
    keys: BTreeMap<String, String>,
}

impl SkipList {
    /// Reads the stored columns: `id@bound;id@bound…` and comma-separated transaction labels
    /// (NULL = none).
    pub(crate) fn parse(ids: Option<&str>, transactions: Option<&str>) -> Result<Self, String> {
        let mut list = Self::default();
        for part in ids.unwrap_or_default().split(';').map(str::trim).filter(|p| !p.is_empty()) {
            if let Some(message) = part.strip_prefix('m') {
                let id = message.parse().map_err(|_| format!("skip_ids holds {part:?}, which is not m<message id>"))?;
                list.messages.insert(id);
                continue;
            }
            if let Some(keyed) = part.strip_prefix('k') {
                let (key, bound) = keyed
                    .split_once('@')
                    .ok_or_else(|| format!("skip_ids holds {part:?}, which is not k<key>@position"))?;
                list.keys.insert(key.to_string(), bound.trim().to_string());
                continue;
            }
            let (id, bound) =
                part.split_once('@').ok_or_else(|| format!("skip_ids holds {part:?}, which is not id@position"))?;
            let id = id.trim().parse().map_err(|_| format!("skip_ids holds {part:?}, whose id is not a number"))?;
            list.ids.insert(id, bound.trim().to_string());
        }
        for part in transactions.unwrap_or_default().split(',').map(str::trim).filter(|p| !p.is_empty()) {
            list.transactions.insert(part.to_string());
        }
        Ok(list)
    }

    /// The bound of row `id`, if it is to be skipped in transactions committed before it.
    pub(crate) fn bound_of(&self, id: i64) -> Option<&str> {
        self.ids.get(&id).map(String::as_str)
    }

    /// The bound of the row with key `key` (see [`Self::bound_of`]).
    pub(crate) fn bound_of_key(&self, key: &str) -> Option<&str> {
        self.keys.get(key).map(String::as_str)
    }

    /// Whether rows without a readable id in transaction `label` are to be skipped.
    pub(crate) fn skips_transaction(&self, label: &str) -> bool {
        self.transactions.contains(label)
    }

    /// Whether the WAL-only message `id` is to be skipped.
    pub(crate) fn skips_message(&self, id: i64) -> bool {
        self.messages.contains(&id)
    }

    pub(crate) fn add_id(&mut self, id: i64, bound: &str) {
        self.ids.insert(id, bound.to_string());
    }

    pub(crate) fn add_transaction(&mut self, label: &str) {
        self.transactions.insert(label.to_string());
    }

    /// The `skip_ids` column's text (`None` when empty).
    pub(crate) fn ids_text(&self) -> Option<String> {
        let rows = self.ids.iter().map(|(id, bound)| format!("{id}@{bound}"));
        let messages = self.messages.iter().map(|id| format!("m{id}"));
        let keys = self.keys.iter().map(|(key, bound)| format!("k{key}@{bound}"));
        let all: Vec<String> = rows.chain(messages).chain(keys).collect();
        (!all.is_empty()).then(|| all.join(";"))
    }

    /// The `skip_transactions` column's text (`None` when empty).
    pub(crate) fn transactions_text(&self) -> Option<String> {
        (!self.transactions.is_empty()).then(|| self.transactions.iter().cloned().collect::<Vec<_>>().join(","))
    }
}

/// What to skip.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum What {
    Id(i64),
    /// A row of a table identified by a key (a uuid), by that key.
    Key(String),
    Transaction(String),
    /// A WAL-only message, by its log position as the halt message names it (`0/1A2B3C8`)
    /// and its identity (the `outbox-id` it would carry).
    Message {
        at: String,
        id: i64,
    },
    Backlog,
}

impl What {
    /// `--id 42`, or `--id 0f8e…` (the key of a row of a table identified by one). A key is
    /// stored in the skip list as it is, so it may not hold what separates its entries.
    pub(crate) fn row(id: &str) -> anyhow::Result<Self> {
        let id = id.trim();
        if let Ok(n) = id.parse() {
            return Ok(Self::Id(n));
        }
        if id.is_empty()
            || id.len() > 255
            || id.chars().any(|c| matches!(c, ';' | '@' | ',' | '\'') || c.is_whitespace())
        {
            anyhow::bail!(
                "--id {id:?}: expected the row id or key the halt message names (a number, or a uuid such as 0f8e…)"
            );
        }
        Ok(Self::Key(id.to_string()))
    }

    /// `--message 0/1A2B3C8` (a PostgreSQL LSN, the message's identity as a number) or
    /// `--message 42` (the `outbox-id` the halt names).
    pub(crate) fn message(at: &str) -> anyhow::Result<Self> {
        let parse = || -> Option<i64> {
            let Some((hi, lo)) = at.trim().split_once('/') else {
                return at.trim().parse().ok().filter(|id: &i64| *id >= 0);
            };
            let (hi, lo) = (u32::from_str_radix(hi, 16).ok(), u32::from_str_radix(lo, 16).ok());
            i64::try_from((u64::from(hi?) << 32) | u64::from(lo?)).ok()
        };
        let id = parse().ok_or_else(|| {
            anyhow::anyhow!(
                "--message {at:?}: expected what the halt message names: an LSN such as 0/1A2B3C8, or an outbox-id"
            )
        })?;
        Ok(Self::Message { at: at.trim().to_string(), id })
    }
}

/// Adds `what` to `list`; a row id is bounded by `end`, the log's end now (see `crate::skip`).
pub(crate) fn add(list: &mut SkipList, what: &What, end: &str) {
    match what {
        What::Id(id) => list.add_id(*id, end),
        What::Key(key) => {
            list.keys.insert(key.clone(), end.to_string());
        }
        What::Transaction(label) => list.add_transaction(label),
        What::Message { id, .. } => {
            list.messages.insert(*id);
        }
        What::Backlog => {}
    }
}

pub(crate) fn done_message(what: &What, deleted: u64) -> String {
    match what {
        What::Id(id) if deleted > 0 => format!("row id={id} will not be published; it was deleted from the table"),
        What::Id(id) => format!("row id={id} will not be published (it was not in the table)"),
        What::Key(key) if deleted > 0 => format!("row id='{key}' will not be published; it was deleted from the table"),
        What::Key(key) => format!("row id='{key}' will not be published (it was not in the table)"),
        What::Transaction(label) => {
            format!("rows without a readable id in transaction {label} will not be published")
        }
        What::Message { at, id } => {
            format!("the message {at} (outbox-id {id}) will not be published")
        }
        What::Backlog => {
            format!("{deleted} rows discarded; the stream resumes at the end of the log")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let mut l = SkipList::parse(Some("7@0/16B3A50; 3@0-1-9,1-2-3"), Some("0/16B3A50")).unwrap();
        assert_eq!(l.bound_of(3), Some("0-1-9,1-2-3"));
        assert_eq!(l.bound_of(4), None);
        assert!(l.skips_transaction("0/16B3A50") && !l.skips_transaction("0/1"));
        l.add_id(5, "0/1");
        assert_eq!(l.ids_text().as_deref(), Some("3@0-1-9,1-2-3;5@0/1;7@0/16B3A50"));
        assert_eq!(SkipList::parse(l.ids_text().as_deref(), None).unwrap().bound_of(5), Some("0/1"));
        assert_eq!(SkipList::parse(None, None).unwrap().ids_text(), None);
        assert!(SkipList::parse(Some("x@1"), None).unwrap_err().contains("\"x@1\""));
        assert!(SkipList::parse(Some("12"), None).unwrap_err().contains("id@position"));
        let mut k = SkipList::parse(Some("k0f8e-1@0/5;3@0/1"), None).unwrap();
        assert_eq!((k.bound_of_key("0f8e-1"), k.bound_of(3)), (Some("0/5"), Some("0/1")));
        add(&mut k, &What::row("abc-2").unwrap(), "0/9");
        assert_eq!(k.ids_text().as_deref(), Some("3@0/1;k0f8e-1@0/5;kabc-2@0/9"));
        assert_eq!(What::row(" 42 ").unwrap(), What::Id(42));
        assert!(What::row("a;b").is_err() && What::row("a@b").is_err() && What::row("").is_err());
        let mut l = SkipList::parse(Some("m77;3@0/1"), None).unwrap();
        assert!(l.skips_message(77) && !l.skips_message(3) && l.bound_of(77).is_none());
        add(&mut l, &What::Message { at: "0/4D".into(), id: 77 }, "0/9");
        add(&mut l, &What::Message { at: "0/50".into(), id: 80 }, "0/9");
        assert_eq!(l.ids_text().as_deref(), Some("3@0/1;m77;m80"));
        assert!(SkipList::parse(Some("mx"), None).unwrap_err().contains("m<message id>"));
    }
}
