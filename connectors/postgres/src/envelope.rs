//! The envelope of a WAL-only outbox message (`storage = "wal"`): the bytes `outbox_emit`
//! passes to `pg_logical_emit_message(true, <table name>, envelope)` and the stream reads back.
//!
//! # Format, version 1 (all integers big-endian)
//!
//! | field | encoding |
//! |---|---|
//! | version | 1 byte, `0x01` |
//! | topic | `u16` length, then the bytes (UTF-8) |
//! | key | `i32` length (`-1` = NULL), then bytes |
//! | payload | `i32` length (`-1` = NULL: a tombstone), then bytes |
//! | headers | `i32` length (`-1` = NULL), then a JSON object of strings, as the table's `headers` column |
//! | kafka_partition | `i32`, `-1` = by key |
//! | created_at | `i64` microseconds since the Unix epoch (the latency metric only) |
//!
//! Nothing may follow. A reader refuses a version it does not know, so an older streamer
//! halts (naming the message) instead of misreading a newer envelope. The SQL that writes it
//! is [`crate::setup::emit_function`]; the values are checked by the core as a row's are.

/// The version written and read.
pub const VERSION: u8 = 1;

/// A message's fields as the envelope holds them, unchecked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope<'a> {
    pub topic: &'a [u8],
    pub key: Option<&'a [u8]>,
    pub payload: Option<&'a [u8]>,
    pub headers: Option<&'a [u8]>,
    pub kafka_partition: Option<i32>,
    pub created_at_micros: i64,
}

/// Why bytes are not an envelope: the field and the reason (never the bytes themselves).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("field {field}: {reason}")]
pub struct EnvelopeError {
    pub field: &'static str,
    pub reason: String,
}

impl<'a> Envelope<'a> {
    /// Reads an envelope.
    pub fn decode(bytes: &'a [u8]) -> Result<Self, EnvelopeError> {
        let bad = |field: &'static str, reason: String| EnvelopeError { field, reason };
        let mut r = Reader { rest: bytes };
        let version = r.take(1).ok_or_else(|| bad("version", "the message is empty".into()))?[0];
        if version != VERSION {
            return Err(bad(
                "version",
                format!(
                    "envelope version {version} is not one this streamer reads (it reads {VERSION}); upgrade the streamer"
                ),
            ));
        }
        let topic_len = r.u16().ok_or_else(|| bad("topic", truncated()))?;
        let topic = r.take(usize::from(topic_len)).ok_or_else(|| bad("topic", truncated()))?;
        let key = r.optional().map_err(|e| bad("key", e))?;
        let payload = r.optional().map_err(|e| bad("payload", e))?;
        let headers = r.optional().map_err(|e| bad("headers", e))?;
        let partition = r.i32().ok_or_else(|| bad("kafka_partition", truncated()))?;
        let created_at_micros = r.i64().ok_or_else(|| bad("created_at", truncated()))?;
        if !r.rest.is_empty() {
            return Err(bad("envelope", format!("{} bytes follow the last field", r.rest.len())));
        }
        let kafka_partition = (partition != -1).then_some(partition);
        Ok(Self { topic, key, payload, headers, kafka_partition, created_at_micros })
    }

    /// Writes the envelope (the bench and tests emit with it; applications call `outbox_emit`).
    pub fn encode(&self) -> Vec<u8> {
        let len = |b: Option<&[u8]>| b.map_or(0, <[u8]>::len);
        let mut out = Vec::with_capacity(23 + self.topic.len() + len(self.key) + len(self.payload) + len(self.headers));
        out.push(VERSION);
        out.extend_from_slice(&(self.topic.len() as u16).to_be_bytes());
        out.extend_from_slice(self.topic);
        for field in [self.key, self.payload, self.headers] {
            match field {
                None => out.extend_from_slice(&(-1i32).to_be_bytes()),
                Some(b) => {
                    out.extend_from_slice(&(b.len() as i32).to_be_bytes());
                    out.extend_from_slice(b);
                }
            }
        }
        out.extend_from_slice(&self.kafka_partition.unwrap_or(-1).to_be_bytes());
        out.extend_from_slice(&self.created_at_micros.to_be_bytes());
        out
    }
}

fn truncated() -> String {
    "the envelope ends inside this field (truncated or not written by outbox_emit)".into()
}

struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.rest.len() < n {
            return None;
        }
        let (head, rest) = self.rest.split_at(n);
        self.rest = rest;
        Some(head)
    }

    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }

    fn i32(&mut self) -> Option<i32> {
        self.take(4).map(|b| i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn i64(&mut self) -> Option<i64> {
        self.take(8).map(|b| i64::from_be_bytes(b.try_into().expect("8 bytes")))
    }

    /// An `i32` length (`-1` = NULL), then that many bytes.
    fn optional(&mut self) -> Result<Option<&'a [u8]>, String> {
        match self.i32().ok_or_else(truncated)? {
            -1 => Ok(None),
            n if n < 0 => Err(format!("has length {n}; only -1 (NULL) or 0 and more are valid")),
            n => self.take(n as usize).map(Some).ok_or_else(truncated),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_truncation_at_every_byte() {
        let e = Envelope {
            topic: b"orders",
            key: Some(b"k"),
            payload: None,
            headers: Some(br#"{"a":"b"}"#),
            kafka_partition: Some(2),
            created_at_micros: 7,
        };
        let bytes = e.encode();
        assert_eq!(Envelope::decode(&bytes), Ok(e));
        for cut in 0..bytes.len() {
            assert!(Envelope::decode(&bytes[..cut]).is_err(), "{cut} bytes");
        }
        let e = Envelope::decode(&[1, 0, 0, 0xff, 0xff, 0xff, 0xfe]).unwrap_err();
        assert_eq!(e.field, "key");
    }
}
