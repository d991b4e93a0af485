//! Decoding of the pgoutput messages that pgwire-replication hands over as raw `XLogData`.
//!
//! pgwire-replication already parses Begin, Commit and logical Message; everything else of
//! protocol version 1 arrives here. We decode what an insert-only outbox needs — Relation and
//! Insert — and name the rest so the caller can decide (Update, Delete and Truncate cannot come
//! from a `publish = 'insert'` publication; Type and Origin carry nothing for us).
//!
//! Values stay in pgoutput's text format; [`crate::values`] turns them into bytes and numbers.

use bytes::{Buf, Bytes};

/// Type OIDs of the columns an outbox table may use (from `pg_type`).
pub mod oid {
    pub const BOOL: u32 = 16;
    pub const BYTEA: u32 = 17;
    pub const INT8: u32 = 20;
    pub const INT2: u32 = 21;
    pub const INT4: u32 = 23;
    pub const TEXT: u32 = 25;
    pub const JSON: u32 = 114;
    pub const VARCHAR: u32 = 1043;
    pub const TIMESTAMP: u32 = 1114;
    pub const TIMESTAMPTZ: u32 = 1184;
    pub const JSONB: u32 = 3802;
    pub const UUID: u32 = 2950;
    pub const BPCHAR: u32 = 1042;
}

/// One column of a relation as announced by a Relation message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    pub name: String,
    pub type_oid: u32,
}

/// A table's shape as of the last Relation message for it. The server sends one before the
/// first change of a table in a session and again after any DDL touching it, so caching by
/// `id` and replacing on every Relation message keeps the cache right across `ALTER TABLE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    pub id: u32,
    pub namespace: String,
    pub name: String,
    pub columns: Vec<Column>,
}

/// A column value of a tuple, in pgoutput's text format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    Null,
    /// An unchanged TOASTed value; only updates carry it.
    Unchanged,
    Text(Bytes),
    Binary(Bytes),
}

/// A decoded pgoutput message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Relation(Relation),
    Insert {
        relation_id: u32,
        values: Vec<Value>,
    },
    /// An update, delete or truncate: never published for `publish = 'insert'`.
    OtherChange {
        tag: u8,
    },
    /// Type, Origin and the like.
    Ignored {
        tag: u8,
    },
}

/// A malformed message: the server and we disagree on the protocol.
#[derive(Debug, thiserror::Error)]
#[error("malformed pgoutput message {tag:?}: {reason}")]
pub struct DecodeError {
    pub tag: char,
    pub reason: &'static str,
}

/// Decodes one pgoutput message (protocol version 1).
pub fn decode(mut data: Bytes) -> Result<Message, DecodeError> {
    if data.is_empty() {
        return Err(DecodeError { tag: '?', reason: "empty message" });
    }
    let tag = data.get_u8();
    let mut r = Reader { data, tag };
    match tag {
        b'R' => {
            let id = r.u32()?;
            let namespace = r.cstring()?;
            let name = r.cstring()?;
            let _replica_identity = r.u8()?;
            let count = r.u16()?;
            let mut columns = Vec::with_capacity(count as usize);
            for _ in 0..count {
                let _flags = r.u8()?;
                let name = r.cstring()?;
                let type_oid = r.u32()?;
                let _type_modifier = r.u32()?;
                columns.push(Column { name, type_oid });
            }
            Ok(Message::Relation(Relation { id, namespace, name, columns }))
        }
        b'I' => {
            let relation_id = r.u32()?;
            if r.u8()? != b'N' {
                return Err(r.error("insert without a new tuple"));
            }
            let values = r.tuple()?;
            Ok(Message::Insert { relation_id, values })
        }
        b'U' | b'D' | b'T' => Ok(Message::OtherChange { tag }),
        _ => Ok(Message::Ignored { tag }),
    }
}

struct Reader {
    data: Bytes,
    tag: u8,
}

impl Reader {
    fn error(&self, reason: &'static str) -> DecodeError {
        DecodeError { tag: self.tag as char, reason }
    }

    fn need(&self, n: usize) -> Result<(), DecodeError> {
        if self.data.remaining() < n { Err(self.error("truncated")) } else { Ok(()) }
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        self.need(1)?;
        Ok(self.data.get_u8())
    }

    fn u16(&mut self) -> Result<u16, DecodeError> {
        self.need(2)?;
        Ok(self.data.get_u16())
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        self.need(4)?;
        Ok(self.data.get_u32())
    }

    fn cstring(&mut self) -> Result<String, DecodeError> {
        let end = self.data.iter().position(|&b| b == 0).ok_or_else(|| self.error("unterminated string"))?;
        let s = self.data.split_to(end);
        self.data.advance(1);
        String::from_utf8(s.to_vec()).map_err(|_| self.error("string is not UTF-8"))
    }

    fn tuple(&mut self) -> Result<Vec<Value>, DecodeError> {
        let count = self.u16()?;
        let mut values = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let value = match self.u8()? {
                b'n' => Value::Null,
                b'u' => Value::Unchanged,
                kind @ (b't' | b'b') => {
                    let len = self.u32()? as usize;
                    self.need(len)?;
                    let bytes = self.data.split_to(len);
                    if kind == b't' { Value::Text(bytes) } else { Value::Binary(bytes) }
                }
                _ => return Err(self.error("unknown tuple value kind")),
            };
            values.push(value);
        }
        Ok(values)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::{BufMut, BytesMut};

    fn relation_bytes() -> Bytes {
        let mut b = BytesMut::new();
        b.put_u8(b'R');
        b.put_u32(16384);
        b.put_slice(b"public\0outbox_0_0\0");
        b.put_u8(b'd');
        b.put_u16(2);
        b.put_u8(1);
        b.put_slice(b"id\0");
        b.put_u32(oid::INT8);
        b.put_i32(-1);
        b.put_u8(0);
        b.put_slice(b"topic\0");
        b.put_u32(oid::TEXT);
        b.put_i32(-1);
        b.freeze()
    }

    #[test]
    fn decodes_relation() {
        let Message::Relation(rel) = decode(relation_bytes()).unwrap() else { panic!("not a relation") };
        assert_eq!(rel.id, 16384);
        assert_eq!(rel.namespace, "public");
        assert_eq!(rel.name, "outbox_0_0");
        assert_eq!(
            rel.columns,
            vec![
                Column { name: "id".into(), type_oid: oid::INT8 },
                Column { name: "topic".into(), type_oid: oid::TEXT }
            ]
        );
    }

    #[test]
    fn decodes_insert_with_null_and_text() {
        let mut b = BytesMut::new();
        b.put_u8(b'I');
        b.put_u32(16384);
        b.put_u8(b'N');
        b.put_u16(3);
        b.put_u8(b't');
        b.put_u32(2);
        b.put_slice(b"42");
        b.put_u8(b'n');
        b.put_u8(b't');
        b.put_u32(0);
        let msg = decode(b.freeze()).unwrap();
        assert_eq!(
            msg,
            Message::Insert {
                relation_id: 16384,
                values: vec![Value::Text(Bytes::from_static(b"42")), Value::Null, Value::Text(Bytes::new())]
            }
        );
    }

    #[test]
    fn truncated_messages_are_errors_not_panics() {
        let full = relation_bytes();
        for cut in 1..full.len() {
            assert!(decode(full.slice(..cut)).is_err(), "cut at {cut} decoded");
        }
        assert!(decode(Bytes::new()).is_err());
    }

    #[test]
    fn other_changes_are_named() {
        assert_eq!(decode(Bytes::from_static(b"D\0\0\0\x01")).unwrap(), Message::OtherChange { tag: b'D' });
        assert_eq!(decode(Bytes::from_static(b"Yxyz")).unwrap(), Message::Ignored { tag: b'Y' });
    }
}
