//! Ordered acknowledgements: which transactions are fully published, as a prefix.
//!
//! Records are produced without waiting for each other, so Kafka acknowledges them in any
//! order across partitions. A transaction is *complete* when it has committed at the source and
//! every one of its records is acknowledged; only a *prefix* of complete transactions may be
//! deleted and checkpointed, so a crash can never leave an unpublished row behind a position
//! that was already confirmed. This module is that rule, without I/O.

use std::collections::VecDeque;

/// Sequence number of a transaction within one streamer session.
pub(crate) type TxnSeq = u64;

#[derive(Debug)]
struct Txn<P> {
    ids: Vec<i64>,
    outstanding: usize,
    /// Set at the source's commit; `None` while rows are still arriving.
    position: Option<P>,
}

/// Transactions in commit order with their outstanding acknowledgements.
#[derive(Debug)]
pub(crate) struct AckTracker<P> {
    txns: VecDeque<Txn<P>>,
    /// Sequence number of `txns[0]`.
    front: TxnSeq,
    ready_ids: Vec<i64>,
    ready_position: Option<P>,
}

impl<P> Default for AckTracker<P> {
    fn default() -> Self {
        Self::new()
    }
}

impl<P> AckTracker<P> {
    pub(crate) fn new() -> Self {
        Self { txns: VecDeque::new(), front: 0, ready_ids: Vec::new(), ready_position: None }
    }

    /// Opens the next transaction and returns its sequence number.
    pub(crate) fn begin(&mut self) -> TxnSeq {
        self.txns.push_back(Txn { ids: Vec::new(), outstanding: 0, position: None });
        self.front + self.txns.len() as TxnSeq - 1
    }

    /// Notes a record of the open transaction that was handed to the producer, with the id
    /// of the row to delete once it is acknowledged (`None` for a WAL-only message).
    pub(crate) fn sent(&mut self, seq: TxnSeq, delete: Option<i64>) {
        let txn = self.txn_mut(seq);
        txn.ids.extend(delete);
        txn.outstanding += 1;
    }

    /// Notes a row of the open transaction that needs no publishing but must be deleted
    /// (a dead-lettered row, once its dead-letter record is acknowledged, uses `sent`).
    pub(crate) fn skipped(&mut self, seq: TxnSeq) {
        let _ = self.txn_mut(seq);
    }

    /// The source committed transaction `seq` at `position`.
    pub(crate) fn commit(&mut self, seq: TxnSeq, position: P) {
        self.txn_mut(seq).position = Some(position);
        self.collect();
    }

    /// Kafka acknowledged one record of transaction `seq`.
    pub(crate) fn acked(&mut self, seq: TxnSeq) {
        let txn = self.txn_mut(seq);
        assert!(txn.outstanding > 0, "more acks than records for transaction {seq}");
        txn.outstanding -= 1;
        self.collect();
    }

    fn txn_mut(&mut self, seq: TxnSeq) -> &mut Txn<P> {
        let index = seq.checked_sub(self.front).expect("transaction already completed") as usize;
        &mut self.txns[index]
    }

    /// Moves complete transactions at the front into the ready set.
    fn collect(&mut self) {
        while let Some(txn) = self.txns.front() {
            if txn.outstanding > 0 || txn.position.is_none() {
                break;
            }
            let mut txn = self.txns.pop_front().expect("front exists");
            self.front += 1;
            self.ready_ids.append(&mut txn.ids);
            self.ready_position = txn.position;
        }
    }

    /// Rows of complete transactions not yet taken.
    pub(crate) fn ready_rows(&self) -> usize {
        self.ready_ids.len()
    }

    /// True when a complete prefix waits to be deleted and checkpointed.
    pub(crate) fn has_ready(&self) -> bool {
        self.ready_position.is_some()
    }

    /// Takes the complete prefix: its row ids and the position of its last transaction.
    pub(crate) fn take_ready(&mut self) -> Option<(Vec<i64>, P)> {
        let position = self.ready_position.take()?;
        Some((std::mem::take(&mut self.ready_ids), position))
    }

    /// True when no transaction is open or waiting and nothing is ready: every change seen
    /// so far is published, deleted and checkpointed.
    pub(crate) fn is_idle(&self) -> bool {
        self.txns.is_empty() && self.ready_position.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_complete_prefix_is_ready() {
        let mut t = AckTracker::<u64>::new();
        let a = t.begin();
        t.sent(a, Some(1));
        t.sent(a, Some(2));
        t.commit(a, 100);
        let b = t.begin();
        t.sent(b, Some(3));
        t.commit(b, 200);
        // b's record is acknowledged first: nothing may be released yet.
        t.acked(b);
        assert!(!t.has_ready());
        t.acked(a);
        assert!(!t.has_ready());
        t.acked(a);
        assert_eq!(t.take_ready(), Some((vec![1, 2, 3], 200)));
        assert!(t.is_idle());
    }

    #[test]
    fn an_open_transaction_holds_back_later_ones() {
        let mut t = AckTracker::<u64>::new();
        let a = t.begin();
        t.sent(a, Some(1));
        t.acked(a);
        assert!(!t.has_ready(), "not committed yet");
        t.commit(a, 10);
        assert_eq!(t.take_ready(), Some((vec![1], 10)));
        let b = t.begin();
        t.skipped(b);
        t.commit(b, 20);
        assert_eq!(t.take_ready(), Some((vec![], 20)), "an empty transaction still moves the position");
    }

    #[test]
    fn a_message_without_a_row_moves_the_position_and_deletes_nothing() {
        let mut t = AckTracker::<u64>::new();
        let a = t.begin();
        t.sent(a, None);
        t.sent(a, Some(5));
        t.commit(a, 10);
        t.acked(a);
        assert!(!t.has_ready(), "one record still outstanding");
        t.acked(a);
        assert_eq!(t.take_ready(), Some((vec![5], 10)));
    }

    #[test]
    fn randomised_acks_never_release_an_unacked_row() {
        // A tiny deterministic PRNG keeps the test reproducible without a dependency.
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..200 {
            let mut t = AckTracker::<u64>::new();
            let mut pending: Vec<(TxnSeq, i64)> = Vec::new();
            let mut id = 0;
            let mut released: Vec<i64> = Vec::new();
            for pos in 0..20u64 {
                let s = t.begin();
                for _ in 0..(next() % 4) {
                    id += 1;
                    t.sent(s, Some(id));
                    pending.push((s, id));
                }
                t.commit(s, pos);
                while !pending.is_empty() && next() % 3 == 0 {
                    let i = (next() as usize) % pending.len();
                    let (s, _) = pending.swap_remove(i);
                    t.acked(s);
                }
                if let Some((ids, _)) = t.take_ready() {
                    released.extend(ids);
                }
                // Every released id is smaller than every id still pending (commit order).
                let min_pending = pending.iter().map(|p| p.1).min().unwrap_or(i64::MAX);
                assert!(released.iter().all(|&r| r < min_pending));
            }
        }
    }
}
