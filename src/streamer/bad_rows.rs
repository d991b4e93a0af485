//! Rows that cannot be published as they are: a bad row the log holds (checked against the
//! table first under `halt`, copied to the dead-letter topic under `dead-letter`), and the
//! halt that names the row and the fix.

use metrics::counter;

use super::handoff::{Body, Pending};
use super::{Kind, Meta, Session, kind_labels};
use crate::ack::TxnSeq;
use crate::config::BadRowPolicy;
use crate::error::Error;
use crate::halt::HaltPoint;
use crate::metrics as m;
use crate::record::{InvalidRow, OutboxRecord};
use crate::sink::Sink;
use crate::source::Source;

/// A row to copy to the dead-letter topic: its raw values and why.
pub(super) struct DeadLetter {
    seq: TxnSeq,
    id: i64,
    reason: String,
    topic: Option<Vec<u8>>,
    key: Option<Vec<u8>>,
    payload: Option<Vec<u8>>,
    /// The row's headers when they were valid.
    headers: Vec<(String, Vec<u8>)>,
    /// The `headers` column's text when it was not.
    raw_headers: Option<Vec<u8>>,
}

impl DeadLetter {
    /// The copy of a well-formed record the broker refused.
    pub(super) fn of(seq: TxnSeq, reason: String, record: OutboxRecord) -> Self {
        Self {
            seq,
            id: record.id,
            reason,
            topic: Some(record.topic.into_bytes()),
            key: record.key,
            payload: record.payload,
            headers: record.headers,
            raw_headers: None,
        }
    }
}

impl<P: Clone + std::fmt::Display + Send + Sync + 'static, K: Sink> Session<'_, P, K> {
    /// A row the log holds in a form that cannot be published. Under `halt` the table decides
    /// first — the operator's fix is made there: a row deleted since is skipped, a row fixed
    /// since is published with its current values, a row still bad halts the stream.
    pub(super) async fn on_invalid_row<S: Source<Position = P>>(
        &mut self,
        source: &mut S,
        seq: TxnSeq,
        invalid: InvalidRow,
    ) -> Result<(), Error> {
        counter!(m::ERRORS, &kind_labels(&self.metric_labels, "bad_row")).increment(1);
        if let (Some(id), Some(at)) = (invalid.id, &invalid.message_at)
            && self.settings.on_bad_row == BadRowPolicy::Halt
        {
            // A WAL-only message is in no table: it cannot be fixed in place, only discarded.
            // PostgreSQL's halt names the LSN; `skip --message` takes it, or the outbox-id.
            let target = at.strip_prefix("LSN ").map_or_else(|| id.to_string(), str::to_string);
            return Err(self.halt_at(
                Some(id),
                "",
                &format!("{invalid} (a WAL-only message of {})", self.labels.table),
                &format!(
                    "discard it with `outbox-streamer skip --stream {}/{} --message {target}` (it is not published), or set on_bad_row = \"dead-letter\"; a message written by hand must follow the envelope in docs/configure-postgres.md",
                    self.labels.source, self.labels.id
                ),
            ));
        }
        let Some(id) = invalid.id else {
            // Rows logged before the mapped id column existed: a table read by key given `seq`.
            let switched = if invalid.column == self.labels.id_column {
                format!(
                    "; if {column} was just added (a table read by its uuid given an order), the rows logged before it cannot carry it: run once with mode = \"polling\" until {table} is empty, then without (the next run catches up and streams again)",
                    column = self.labels.id_column,
                    table = self.labels.table
                )
            } else {
                String::new()
            };
            return Err(self.halt(
                None,
                &format!("in transaction {}: {invalid}", self.label),
                &format!(
                    "restore the table's columns as `outbox-streamer setup --dry-run` shows; rows logged without a readable id cannot be published: discard them with `outbox-streamer skip --stream {}/{} --transaction {}`{switched}",
                    self.labels.source, self.labels.id, self.label
                ),
            ));
        };
        match self.settings.on_bad_row {
            BadRowPolicy::Halt => match source.current_rows(&[id]).await?.pop() {
                None => {
                    counter!(m::SKIPPED_ROWS, &kind_labels(&self.metric_labels, "deleted_bad_row")).increment(1);
                    tracing::warn!(
                        row_id = id,
                        column = invalid.column,
                        "a row the log holds in a form that cannot be published is no longer in the table; skipped"
                    );
                    self.tracker.skipped(seq);
                    self.memory.past_halted_row(self.labels, Some(id));
                    Ok(())
                }
                Some(Ok(current)) => {
                    tracing::warn!(
                        row_id = id,
                        column = invalid.column,
                        "a row the log holds in a form that cannot be published was fixed in the table; publishing its current values"
                    );
                    self.publish(seq, current).await
                }
                Some(Err(still)) => {
                    let (table, column) =
                        (self.labels.sql_name(&self.labels.table), self.labels.sql_name(self.labels.id_column));
                    // A row identified by a key is named, and skipped, by it (see `row_keys`).
                    let (value, skip) = match self.keys.as_ref().and_then(|k| k.key_of(id)) {
                        // `skip --id` takes a key it can store; others only the DELETE discards.
                        Some(key) => {
                            (self.labels.sql_literal(&key), crate::skip::What::row(&key).is_ok().then_some(key))
                        }
                        None => (id.to_string(), Some(id.to_string())),
                    };
                    let skip = skip.map_or_else(String::new, |skip| {
                        format!(
                            "; or discard it with `outbox-streamer skip --stream {}/{} --id {skip}`",
                            self.labels.source, self.labels.id
                        )
                    });
                    Err(self.halt(
                        Some(id),
                        &still.to_string(),
                        &format!(
                            "fix the row (UPDATE {table} SET … WHERE {column} = {value}) or delete it (DELETE FROM {table} WHERE {column} = {value}), then restart{skip}; or set on_bad_row = \"dead-letter\"",
                        ),
                    ))
                }
            },
            BadRowPolicy::DeadLetter => {
                self.tracker.sent(seq, invalid.message_at.is_none().then_some(id));
                let raw = invalid.raw.as_deref().cloned().unwrap_or_default();
                let copy = DeadLetter {
                    seq,
                    id,
                    reason: invalid.to_string(),
                    topic: raw.topic,
                    key: raw.key,
                    payload: raw.payload,
                    headers: Vec::new(),
                    raw_headers: raw.headers,
                };
                self.dead_letter(copy).await
            }
        }
    }

    /// Sends a bad row to the dead-letter topic with its raw key and payload, its original
    /// topic and the reason; the copy's acknowledgement completes the row. A copy the sink
    /// refuses halts the stream with the row left in the table.
    pub(super) async fn dead_letter(&mut self, copy: DeadLetter) -> Result<(), Error> {
        let topic = self.settings.dead_letter_topic.clone().expect("validated: dead-letter policy names a topic");
        tracing::warn!(row_id = copy.id, dead_letter_topic = %topic, "bad row sent to the dead-letter topic");
        let mut headers = copy.headers;
        headers.push(("outbox-dead-letter-reason".into(), copy.reason.into_bytes()));
        if let Some(original) = copy.topic {
            headers.push(("outbox-original-topic".into(), original));
        }
        if let Some(raw) = copy.raw_headers {
            headers.push(("outbox-original-headers".into(), raw));
        }
        let weight = 64 + copy.key.as_ref().map_or(0, Vec::len) + copy.payload.as_ref().map_or(0, Vec::len);
        let meta = Meta {
            seq: copy.seq,
            id: copy.id,
            weight,
            created_at_micros: None,
            kind: Kind::DeadLetter,
            alone: true,
            confirms_topic: None,
            record: None,
        };
        self.in_flight_bytes += weight;
        let body = Body::Copy { topic, key: copy.key, payload: copy.payload, headers };
        // A copy the sink refuses halts in `try_offer`; only a row comes back refused.
        self.offer(Pending { meta, body, label: None })?;
        self.update_gauges();
        Ok(())
    }

    /// A halt at row `id` (if the halt is about one): the message, and where the next
    /// session picks up (see [`StreamMemory::take_halt_point`]).
    pub(super) fn halt(&mut self, id: Option<i64>, reason: &str, fix: &str) -> Error {
        let row = id.map_or_else(String::new, |id| {
            let name = self.key_sql(id).unwrap_or_else(|| id.to_string());
            format!("at row id={name} of {}: ", self.labels.table)
        });
        self.halt_at(id, &row, reason, fix)
    }

    /// Row `id`'s key as an SQL literal, for a table identified by a key (see
    /// [`Source::row_keys`]).
    pub(super) fn key_sql(&self, id: i64) -> Option<String> {
        Some(self.labels.sql_literal(&self.keys.as_ref()?.key_of(id)?))
    }

    /// [`Self::halt`] with the place (`at row id=… of …: `) said by the caller.
    pub(super) fn halt_at(&mut self, id: Option<i64>, place: &str, reason: &str, fix: &str) -> Error {
        self.memory.last_halt = Some(HaltPoint { row: id, ..HaltPoint::default() });
        Error::definite(format!("{place}{reason}"), fix)
    }
}
