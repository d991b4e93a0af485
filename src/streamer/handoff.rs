//! Handing records to the sink: offers in order behind those waiting for room, the wait for
//! room as a `select!` branch, the streamer's own headers, and each delivery future wrapped
//! with what it was for.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use futures::StreamExt;

use super::{Delivered, Kind, Meta, OWNER_EPOCH_HEADER, Session};
use crate::config::BadRowPolicy;
use crate::error::Error;
use crate::record::OutboxRecord;
use crate::sink::{Failure, Offer, Outgoing, Sink};

/// A sink's delivery future with what it was for: one allocation-free wrapper per record.
pub(super) struct InFlight<F> {
    pub(super) delivery: F,
    pub(super) meta: Option<Meta>,
}

impl<F: Future<Output = Result<(), Failure>> + Unpin> Future for InFlight<F> {
    type Output = Delivered;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Delivered> {
        let result = ready!(Pin::new(&mut self.delivery).poll(cx));
        let meta = self.meta.take().expect("an InFlight is not polled after it completed");
        Poll::Ready(Delivered { meta, result })
    }
}

/// A record on its way to the sink.
pub(super) struct Pending {
    pub(super) meta: Meta,
    pub(super) body: Body,
    /// The position label stamped on it once it had to wait for room (until then the
    /// session's current one).
    pub(super) label: Option<String>,
}

pub(super) enum Body {
    Row(OutboxRecord),
    /// A dead-letter copy: its topic, raw key and payload, and headers.
    Copy {
        topic: String,
        key: Option<Vec<u8>>,
        payload: Option<Vec<u8>>,
        headers: Vec<(String, Vec<u8>)>,
    },
}

/// What became of one offer to the sink.
pub(super) enum Offered {
    Sent,
    /// No room: offer it again when the sink is ready.
    Full(Pending),
    /// The sink refused the row before sending it: its verdict, to settle.
    Refused(Delivered),
}

impl<P: Clone + std::fmt::Display + Send + Sync + 'static, K: Sink> Session<'_, P, K> {
    /// Offers a record to the sink behind those already waiting for room. `Some` is a row the
    /// sink refused before sending it (its verdict, for the caller to settle).
    pub(super) fn offer(&mut self, pending: Pending) -> Result<Option<Delivered>, Error> {
        self.counted();
        if !self.waiting.is_empty() {
            self.waiting.push_back(pending);
            return Ok(None);
        }
        match self.try_offer(pending)? {
            Offered::Sent => Ok(None),
            Offered::Full(pending) => {
                self.waiting.push_back(pending);
                Ok(None)
            }
            Offered::Refused(d) => Ok(Some(d)),
        }
    }

    /// The sink has room again: offers the waiting records in order until it is full again.
    pub(super) async fn flush_waiting(&mut self) -> Result<(), Error> {
        while let Some(pending) = self.waiting.pop_front() {
            match self.try_offer(pending)? {
                Offered::Sent => {}
                Offered::Full(pending) => {
                    self.waiting.push_front(pending);
                    break;
                }
                Offered::Refused(d) => self.settle_one(d).await?,
            }
        }
        self.update_gauges();
        Ok(())
    }

    /// One attempt to hand a record over, right after checking the lease (a wait for room can
    /// outlast the right to publish).
    pub(super) fn try_offer(&mut self, mut pending: Pending) -> Result<Offered, Error> {
        self.labels.lease.check().map_err(Error::fenced)?;
        self.begin_kafka_txn()?;
        let sent = {
            let id = pending.meta.id;
            // A WAL-only message's id is its log position, never a surrogate.
            let keyed = self.keys.as_ref().filter(|_| pending.meta.kind != Kind::Message);
            let id_text = match keyed {
                None => id.to_string(),
                // A surrogate with no key would go out as a number another row may carry too.
                Some(keys) => keys.key_of(id).ok_or_else(|| lost_key(id))?,
            };
            let label = pending.label.as_deref().unwrap_or(&self.label);
            let stamp = self.stamp(&id_text, label);
            let out = match &pending.body {
                Body::Row(r) => Outgoing {
                    topic: &r.topic,
                    key: r.key.as_deref(),
                    payload: r.payload.as_deref(),
                    partition: r.kafka_partition,
                    headers: &r.headers,
                    stamp: &stamp,
                    timestamp_ms: r.timestamp_ms,
                },
                Body::Copy { topic, key, payload, headers } => Outgoing {
                    topic,
                    key: key.as_deref(),
                    payload: payload.as_deref(),
                    partition: None,
                    headers,
                    stamp: &stamp,
                    timestamp_ms: None,
                },
            };
            self.sink.send(&out)
        };
        // The record itself is kept only for a possible dead-letter copy.
        let keep = self.settings.on_bad_row == BadRowPolicy::DeadLetter;
        match sent {
            Ok(delivery) => {
                let mut meta = pending.meta;
                if let Body::Row(record) = pending.body
                    && keep
                {
                    meta.record = Some(Box::new(record));
                }
                self.deliveries.push(InFlight { delivery, meta: Some(meta) });
                Ok(Offered::Sent)
            }
            Err(Offer::Full) => {
                self.hot.full_waits.increment(1);
                if pending.label.is_none() {
                    pending.label = Some(self.label.clone());
                }
                Ok(Offered::Full(pending))
            }
            Err(Offer::Refused(failure)) => match pending.body {
                // Refused before it was sent (for example larger than the broker takes): it
                // travelled alone, so the verdict is final.
                Body::Row(record) => {
                    let mut meta = pending.meta;
                    meta.alone = true;
                    meta.confirms_topic = None;
                    meta.record = keep.then(|| Box::new(record));
                    Ok(Offered::Refused(Delivered { meta, result: Err(failure) }))
                }
                Body::Copy { .. } => Err(self.halt(
                    Some(pending.meta.id),
                    &format!("its dead-letter record was refused: {failure}; the row stays in the table"),
                    "raise kafka.properties.\"message.max.bytes\" (and the dead-letter topic's max.message.bytes) to fit it, or delete the row, then restart",
                )),
            },
        }
    }

    /// The streamer's own headers, sent after the row's: id, shard-partition, position,
    /// epoch — borrowed from values formatted once per session (`id` is the row's, formatted
    /// by the caller; `label` its transaction's position).
    pub(super) fn stamp<'s>(&'s self, id: &'s str, label: &'s str) -> Vec<(&'static str, &'s [u8])> {
        let mut stamp = Vec::with_capacity(5);
        stamp.push(("outbox-id", id.as_bytes()));
        stamp.push(("outbox-shard", self.stamp_values.shard.as_bytes()));
        stamp.push(("outbox-partition", self.stamp_values.partition.as_bytes()));
        stamp.push((self.position_header, label.as_bytes()));
        if let Some(epoch) = &self.stamp_values.epoch {
            stamp.push((OWNER_EPOCH_HEADER, epoch.as_bytes()));
        }
        stamp
    }

    /// Waits until nothing is in flight or waiting for room (dead-letter copies included).
    pub(super) async fn settle_all(&mut self) -> Result<(), Error> {
        while !self.deliveries.is_empty() || !self.waiting.is_empty() {
            let sink = self.sink;
            tokio::select! {
                biased;
                Some(d) = self.deliveries.next(), if !self.deliveries.is_empty() => self.settle_one(d).await?,
                _ = sink.ready(), if !self.waiting.is_empty() => self.flush_waiting().await?,
            }
        }
        Ok(())
    }
}

/// A row of a table read by key whose key the job no longer knows: a bug, not the row's fault.
/// The session restarts and reads the row again from the log, which gives it a key again.
pub(super) fn lost_key(id: i64) -> Error {
    Error::transient(format!("the key of row {id} (a surrogate) is no longer known; reading it again from the log"))
}
