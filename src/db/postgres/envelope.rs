//! A WAL-only outbox message (`storage = "wal"`) as a record: the connector reads the envelope
//! ([`outbox_postgres::envelope`]), and its values are checked as a table row's are.

use outbox_postgres::envelope::Envelope;

use crate::record::{InvalidRow, OutboxRecord, RawRow};

/// The record of the message at `lsn`, whose identity is `id`. A malformed envelope or a bad
/// value is a bad row naming the message's position and the field, with the raw bytes kept as
/// the payload of a dead-letter copy.
pub(crate) fn decode(id: i64, lsn: &str, content: &[u8]) -> Result<OutboxRecord, InvalidRow> {
    let envelope = Envelope::decode(content).map_err(|e| {
        let mut invalid = InvalidRow::new(Some(id), e.field, e.reason).at_message(format!("LSN {lsn}"));
        invalid.raw = Some(Box::new(RawRow { payload: Some(content.to_vec()), ..RawRow::default() }));
        invalid
    })?;
    let raw = RawRow {
        topic: Some(envelope.topic.to_vec()),
        key: envelope.key.map(<[u8]>::to_vec),
        payload: envelope.payload.map(<[u8]>::to_vec),
        headers: envelope.headers.map(<[u8]>::to_vec),
        kafka_partition: envelope.kafka_partition.map(i64::from),
        created_at_micros: Some(envelope.created_at_micros),
        extra_headers: Vec::new(),
    };
    let mut record = raw.into_record(id).map_err(|e| e.at_message(format!("LSN {lsn}")))?;
    record.in_table = false;
    Ok(record)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(topic: &str, key: Option<&[u8]>, payload: Option<&[u8]>, headers: Option<&str>) -> Vec<u8> {
        let headers = headers.map(str::as_bytes);
        Envelope { topic: topic.as_bytes(), key, payload, headers, kafka_partition: None, created_at_micros: 1_000_000 }
            .encode()
    }

    #[test]
    fn a_message_becomes_a_record_with_nothing_to_delete() {
        let mut bytes = Envelope {
            topic: b"orders",
            key: Some(b"k"),
            payload: Some(b"{}"),
            headers: Some(br#"{"h":"v"}"#),
            kafka_partition: Some(3),
            created_at_micros: 1_000_000,
        }
        .encode();
        let r = decode(42, "0/2A", &bytes).unwrap();
        assert_eq!((r.id, r.topic.as_str(), r.in_table), (42, "orders", false));
        assert_eq!((r.key.as_deref(), r.payload.as_deref()), (Some(&b"k"[..]), Some(&b"{}"[..])));
        assert_eq!(r.headers, vec![("h".to_string(), b"v".to_vec())]);
        assert_eq!((r.kafka_partition, r.created_at_micros), (Some(3), Some(1_000_000)));
        let tombstone = decode(1, "0/1", &encode("t", None, None, None)).unwrap();
        assert_eq!((tombstone.key, tombstone.payload, tombstone.kafka_partition), (None, None, None));
        bytes.push(0);
        assert_eq!(decode(42, "0/2A", &bytes).unwrap_err().column, "envelope");
    }

    #[test]
    fn malformed_envelopes_name_the_message_and_the_field() {
        let good = encode("orders", Some(b"k"), Some(b"p"), None);
        let cases: [(&[u8], &str); 4] = [
            (b"", "version"),
            (b"\x02rest", "version"),
            (&good[..5], "topic"),
            (&good[..good.len() - 3], "created_at"),
        ];
        for (bytes, field) in cases {
            let e = decode(7, "0/7", bytes).unwrap_err();
            assert_eq!((e.id, e.column), (Some(7), field), "{e}");
            assert!(e.to_string().starts_with("message at LSN 0/7 (outbox-id 7) field"), "{e}");
            assert_eq!(e.raw.as_ref().and_then(|r| r.payload.as_deref()), Some(bytes), "kept for a dead-letter copy");
        }
        // A bad value in a well-formed envelope is checked like a row's.
        let e = decode(8, "0/8", &encode("t", None, None, Some(r#"{"outbox-id":"1"}"#))).unwrap_err();
        assert_eq!(e.column, "headers");
        assert!(e.to_string().starts_with("message at LSN 0/8"), "{e}");
        assert_eq!(decode(9, "0/9", &encode("", None, None, None)).unwrap_err().column, "topic");
        let bad_partition = Envelope { kafka_partition: Some(-2), ..Envelope::decode(&good).unwrap() }.encode();
        assert_eq!(decode(10, "0/A", &bad_partition).unwrap_err().column, "kafka_partition");
    }
}
