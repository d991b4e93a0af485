//! Row identities for a table whose rows are identified by a key that is not an increasing
//! integer (Debezium's `id uuid PRIMARY KEY`, with no column the database numbers).
//!
//! The core names rows by an `i64` (ordered acks, the rows a finish deletes, what a session
//! remembers for the next). For such a table the source hands out a *surrogate*: the first time
//! it reads a key in a transaction, the next number; the same key of the same transaction read
//! again (a session replaying from its slot) gets the same number for as long as it is
//! remembered. A key reused by a later transaction (its row deleted, a new one inserted with
//! it) is another row, with another number. The map belongs to the shard-partition's
//! job, so it outlives a session — what one session leaves to finish, the next deletes by key.
//! It is forgotten with the process: nothing stores a surrogate (no skip list by id, no catch-up
//! or sweep by id, which such a table cannot have — see `docs/drop-in.md`).
//!
//! Surrogates increase in the order keys are first read. A finish covers a prefix of what was
//! published; once it committed its own keys are forgotten, and so is every other key numbered
//! below its highest surrogate — a row of a transaction the replay filter skipped, a rolled-back
//! one — except a *pinned* one: a row read before it is published (MariaDB holds an XA
//! transaction's rows from its prepare to its `XA COMMIT`, and transactions committed meanwhile
//! are numbered after it and finished first).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

/// The job-wide map between keys (as their text) and surrogate ids. Clones share it.
#[derive(Debug, Clone, Default)]
pub(crate) struct RowKeys {
    inner: Arc<Mutex<Inner>>,
}

/// Two handles are equal when they share one map.
impl PartialEq for RowKeys {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Eq for RowKeys {}

#[derive(Debug, Default)]
struct Inner {
    next: i64,
    /// (transaction, key) → surrogate.
    by_key: HashMap<(String, String), i64>,
    /// surrogate → (transaction, key).
    by_id: BTreeMap<i64, (String, String)>,
    /// Surrogates read but not yet published, kept until their own finish.
    pinned: std::collections::HashSet<i64>,
}

impl RowKeys {
    /// The surrogate of `key` as transaction `txn` (its position label) wrote it: the one it
    /// was given before, or the next.
    pub(crate) fn id_of(&self, txn: &str, key: &str) -> i64 {
        let mut inner = self.inner.lock().expect("row keys lock");
        let scoped = (txn.to_string(), key.to_string());
        if let Some(&id) = inner.by_key.get(&scoped) {
            return id;
        }
        inner.next += 1;
        let id = inner.next;
        inner.by_key.insert(scoped.clone(), id);
        inner.by_id.insert(id, scoped);
        id
    }

    /// The key of surrogate `id`, while it is remembered.
    pub(crate) fn key_of(&self, id: i64) -> Option<String> {
        self.inner.lock().expect("row keys lock").by_id.get(&id).map(|(_, k)| k.clone())
    }

    /// The keys of `ids` that are remembered, each with its surrogate, in the order of `ids`.
    pub(crate) fn keys_of(&self, ids: &[i64]) -> Vec<(i64, String)> {
        let inner = self.inner.lock().expect("row keys lock");
        ids.iter().filter_map(|id| inner.by_id.get(id).map(|(_, k)| (*id, k.clone()))).collect()
    }

    /// Keeps surrogate `id` until it is finished itself (see the module docs).
    pub(crate) fn pin(&self, id: i64) {
        self.inner.lock().expect("row keys lock").pinned.insert(id);
    }

    /// A finish of `ids` committed: forgets them, and every key numbered below the highest of
    /// them that is not pinned.
    pub(crate) fn finished(&self, ids: &[i64]) {
        let mut inner = self.inner.lock().expect("row keys lock");
        for id in ids {
            inner.pinned.remove(id);
        }
        let Some(&through) = ids.iter().max() else { return };
        let kept = inner.by_id.split_off(&(through.saturating_add(1)));
        let gone = std::mem::replace(&mut inner.by_id, kept);
        for (id, scoped) in gone {
            if inner.pinned.contains(&id) {
                inner.by_id.insert(id, scoped);
            } else {
                inner.by_key.remove(&scoped);
            }
        }
    }

    /// Forgets `ids`, which will never be published (an XA transaction rolled back).
    pub(crate) fn forget(&self, ids: &[i64]) {
        let mut inner = self.inner.lock().expect("row keys lock");
        for id in ids {
            inner.pinned.remove(id);
            if let Some(scoped) = inner.by_id.remove(id) {
                inner.by_key.remove(&scoped);
            }
        }
    }

    /// How many keys are remembered (for tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner.lock().expect("row keys lock").by_id.len()
    }
}

/// The keys of published rows `ids`, to delete them by. A key the job no longer knows is an
/// invariant broken (see the module docs): said at ERROR, and that row stays in the table —
/// failing the finish instead would fail it again in every later session.
pub(crate) fn keys_to_delete(keys: &RowKeys, ids: &[i64], table: &str) -> Vec<String> {
    let known = keys.keys_of(ids);
    if known.len() < ids.len() {
        tracing::error!(
            table,
            rows = ids.len() - known.len(),
            "published rows whose key is no longer known stay in the table (a bug: please report it); delete them once their records are seen in the broker"
        );
    }
    known.into_iter().map(|(_, key)| key).collect()
}

/// Rows whose key the job no longer knows: never a silent skip or a row left behind. The
/// session restarts and reads them again from the log, which gives them keys again.
pub(crate) fn unknown(rows: usize) -> crate::error::Error {
    crate::error::Error::transient(format!(
        "the keys of {rows} rows of a table read by key are no longer known; reading them again from the log"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_read_again_keeps_its_surrogate_until_forgotten() {
        let keys = RowKeys::default();
        let (a, b) = (keys.id_of("t1", "a"), keys.id_of("t1", "b"));
        assert!(a < b, "numbered in the order first read");
        assert_eq!(keys.clone().id_of("t1", "a"), a, "a clone shares the map: the next session sees it");
        let reused = keys.id_of("t2", "a");
        assert!(reused > b && keys.key_of(reused).as_deref() == Some("a"), "a key reused later is another row");
        assert_eq!(keys.keys_of(&[b, 99, a]), vec![(b, "b".to_string()), (a, "a".to_string())]);
        keys.finished(&[a]);
        assert_eq!(keys.key_of(a), None);
        assert_eq!(keys.key_of(b).as_deref(), Some("b"));
        let again = keys.id_of("t1", "a");
        assert!(again > reused, "a forgotten key read again is a new row: surrogates are never reused");
        keys.finished(&[i64::MAX]);
        assert_eq!(keys.len(), 0);
    }

    #[test]
    fn a_pinned_key_outlives_finishes_of_later_rows_until_its_own() {
        let keys = RowKeys::default();
        let held = keys.id_of("xa", "h");
        keys.pin(held);
        let (later, skipped) = (keys.id_of("t2", "l"), keys.id_of("t0", "s"));
        keys.finished(&[skipped + 1, later]);
        assert_eq!(keys.key_of(held).as_deref(), Some("h"), "held across a later finish");
        assert_eq!(keys.key_of(later), None);
        keys.finished(&[held]);
        assert_eq!(keys.len(), 0);
        let rolled_back = keys.id_of("xa2", "r");
        keys.pin(rolled_back);
        keys.forget(&[rolled_back]);
        assert_eq!(keys.len(), 0);
    }
}
