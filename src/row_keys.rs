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
//! Surrogates increase in the order keys are first read, which is commit order; a finish
//! covers a prefix of what was read, so once it committed every key numbered at or below its
//! highest surrogate is either deleted or will never be finished, and is forgotten.

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

    /// Forgets every key numbered at or below `id` (a finish through it committed).
    pub(crate) fn forget_through(&self, id: i64) {
        let mut inner = self.inner.lock().expect("row keys lock");
        let kept = inner.by_id.split_off(&(id.saturating_add(1)));
        let gone = std::mem::replace(&mut inner.by_id, kept);
        for scoped in gone.into_values() {
            inner.by_key.remove(&scoped);
        }
    }

    /// How many keys are remembered (for tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner.lock().expect("row keys lock").by_id.len()
    }
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
        keys.forget_through(a);
        assert_eq!(keys.key_of(a), None);
        assert_eq!(keys.key_of(b).as_deref(), Some("b"));
        let again = keys.id_of("t1", "a");
        assert!(again > reused, "a forgotten key read again is a new row: surrogates are never reused");
        keys.forget_through(i64::MAX);
        assert_eq!(keys.len(), 0);
    }
}
