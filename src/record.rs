//! The outbox record: one row of `outbox_<shard>_<partition>`, as it goes to Kafka.

/// A row ready to publish. Built by a source from its column values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxRecord {
    /// The row's primary key; unique within its table and increasing in insert order.
    pub id: i64,
    pub topic: String,
    pub key: Option<Vec<u8>>,
    /// `None` publishes a tombstone.
    pub payload: Option<Vec<u8>>,
    /// The row's own headers, sorted by name.
    pub headers: Vec<(String, Vec<u8>)>,
    /// An explicit Kafka partition; otherwise the key decides (murmur2, like the Java client).
    pub kafka_partition: Option<i32>,
    /// When the row was inserted (the database clock), for the end-to-end latency metric.
    pub created_at_micros: Option<i64>,
}

impl OutboxRecord {
    /// Bytes this record holds in memory while in flight (for the in-flight budget).
    pub fn weight(&self) -> usize {
        64 + self.topic.len()
            + self.key.as_ref().map_or(0, Vec::len)
            + self.payload.as_ref().map_or(0, Vec::len)
            + self.headers.iter().map(|(k, v)| k.len() + v.len() + 16).sum::<usize>()
    }
}

/// A row that cannot become a Kafka record. Names the row and the column, and says why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("row id={} column {column}: {reason}", id.map_or_else(|| "?".to_string(), |i| i.to_string()))]
pub struct InvalidRow {
    pub id: Option<i64>,
    pub column: &'static str,
    pub reason: String,
}

/// Checks the `topic` column of row `id`: present, UTF-8, a legal Kafka topic length.
pub fn topic_value(id: i64, topic: Option<&[u8]>) -> Result<String, InvalidRow> {
    let bad = |reason: String| InvalidRow { id: Some(id), column: "topic", reason };
    let Some(bytes) = topic else { return Err(bad("is NULL; every row needs a Kafka topic".into())) };
    let topic = String::from_utf8(bytes.to_vec()).map_err(|_| bad("is not UTF-8".into()))?;
    if topic.is_empty() || topic.len() > 249 {
        return Err(bad(format!("{topic:?} is not a valid Kafka topic name (1 to 249 characters)")));
    }
    Ok(topic)
}

/// Checks the `headers` column of row `id` (NULL means no headers).
pub fn headers_value(id: i64, json: Option<&[u8]>) -> Result<Vec<(String, Vec<u8>)>, InvalidRow> {
    match json {
        None => Ok(Vec::new()),
        Some(json) => parse_headers(json).map_err(|reason| InvalidRow { id: Some(id), column: "headers", reason }),
    }
}

/// Checks the `kafka_partition` column of row `id` (NULL means "by key").
pub fn partition_value(id: i64, partition: Option<i64>) -> Result<Option<i32>, InvalidRow> {
    match partition {
        None => Ok(None),
        Some(p) if (0..=i64::from(i32::MAX)).contains(&p) => Ok(Some(p as i32)),
        Some(p) => Err(InvalidRow {
            id: Some(id),
            column: "kafka_partition",
            reason: format!("{p} is not a partition number (0 or more)"),
        }),
    }
}

/// Parses the `headers` column: a JSON object whose values are strings (or null, skipped).
pub fn parse_headers(json: &[u8]) -> Result<Vec<(String, Vec<u8>)>, String> {
    let value: serde_json::Value = serde_json::from_slice(json).map_err(|e| format!("is not valid JSON ({e})"))?;
    let serde_json::Value::Object(map) = value else {
        return Err("must be a JSON object of string values, e.g. {\"trace-id\": \"abc\"}".into());
    };
    let mut headers = Vec::with_capacity(map.len());
    for (k, v) in map {
        match v {
            serde_json::Value::String(s) => headers.push((k, s.into_bytes())),
            serde_json::Value::Null => {}
            other => {
                return Err(format!("value of {k:?} must be a string, found {other}; quote it in the JSON"));
            }
        }
    }
    Ok(headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers() {
        assert_eq!(parse_headers(br#"{"a":"1","b":null}"#).unwrap(), vec![("a".into(), b"1".to_vec())]);
        assert!(parse_headers(br#"{"a":1}"#).unwrap_err().contains("\"a\""));
        assert!(parse_headers(b"[1]").is_err());
        assert!(parse_headers(b"{").is_err());
    }

    #[test]
    fn invalid_row_names_row_and_column() {
        let e = InvalidRow { id: Some(7), column: "topic", reason: "is NULL".into() };
        assert_eq!(e.to_string(), "row id=7 column topic: is NULL");
    }
}
