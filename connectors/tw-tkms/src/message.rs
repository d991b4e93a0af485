//! The protobuf message tw-tkms stores (its `stored_message.proto`, proto3).

use prost::Message as _;

/// What tw-tkms stores for one Kafka record, as the proxy turned it into one: an empty key is
/// no key; partition and timestamp are set only when the application gave them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredMessage {
    pub topic: String,
    pub partition: Option<u32>,
    pub key: Option<String>,
    /// The record's timestamp, milliseconds since the epoch.
    pub timestamp_ms: Option<u64>,
    pub value: Vec<u8>,
    /// In stored order; names may repeat, as Kafka allows.
    pub headers: Vec<(String, Vec<u8>)>,
    /// When the application stored it, milliseconds since the epoch.
    pub insert_timestamp_ms: Option<u64>,
}

impl StoredMessage {
    pub(crate) fn parse(bytes: &[u8]) -> Result<Self, String> {
        let m = Wire::decode(bytes).map_err(|e| e.to_string())?;
        Ok(Self {
            topic: m.topic,
            partition: m.partition,
            key: Some(m.key).filter(|k| !k.is_empty()),
            timestamp_ms: m.timestamp,
            value: m.value,
            headers: m.headers.map(|h| h.headers.into_iter().map(|h| (h.key, h.value)).collect()).unwrap_or_default(),
            insert_timestamp_ms: m.insert_timestamp,
        })
    }
}

/// `message Message`; the `google.protobuf.UInt32Value`/`UInt64Value` wrappers are messages
/// whose field 1 is the value, which prost reads as an optional integer.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Wire {
    #[prost(string, tag = "1")]
    pub(crate) topic: String,
    #[prost(message, optional, tag = "2")]
    pub(crate) partition: Option<u32>,
    #[prost(string, tag = "3")]
    pub(crate) key: String,
    #[prost(message, optional, tag = "4")]
    pub(crate) timestamp: Option<u64>,
    #[prost(bytes = "vec", tag = "5")]
    pub(crate) value: Vec<u8>,
    #[prost(message, optional, tag = "6")]
    pub(crate) headers: Option<WireHeaders>,
    #[prost(message, optional, tag = "7")]
    pub(crate) insert_timestamp: Option<u64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct WireHeaders {
    #[prost(message, repeated, tag = "1")]
    pub(crate) headers: Vec<WireHeader>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct WireHeader {
    #[prost(string, tag = "1")]
    pub(crate) key: String,
    #[prost(bytes = "vec", tag = "2")]
    pub(crate) value: Vec<u8>,
}
