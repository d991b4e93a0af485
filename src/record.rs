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
    /// The row's own headers: sorted by name from a `headers` column; in stored order (names
    /// may repeat) from a tw-tkms message.
    pub headers: Vec<(String, Vec<u8>)>,
    /// An explicit Kafka partition; otherwise the key decides (murmur2, like the Java client).
    pub kafka_partition: Option<i32>,
    /// When the row was inserted (the database clock), for the end-to-end latency metric.
    pub created_at_micros: Option<i64>,
    /// The broker record's timestamp (milliseconds since the epoch) when the row sets one (a
    /// tw-tkms message may); otherwise the producer's clock.
    pub timestamp_ms: Option<i64>,
    /// A row of the outbox table, deleted once published; `false` for a WAL-only message
    /// (`storage = "wal"`), which has nothing to delete and whose `id` is its log position.
    pub in_table: bool,
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

/// A row that cannot become a Kafka record. Names the row and the column, and says why — never
/// with the row's values, which are application data (logs and `/readyz` show this text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidRow {
    pub id: Option<i64>,
    /// The column of a row, or the envelope field of a WAL-only message.
    pub column: &'static str,
    pub reason: String,
    /// The row's values as read, for a dead-letter copy (`None` when they could not be read).
    pub raw: Option<Box<RawRow>>,
    /// Set for a WAL-only message: its place in the log (`LSN 0/1A2B`, `GTID 0-1-42 row 3`).
    /// Such a message is not in any table: nothing can fix it in place or delete it.
    pub message_at: Option<String>,
    /// The row's key as SQL names it (`'0f8e…'`) when the table identifies rows by a key that
    /// is not an integer; `id` is then its surrogate (see [`crate::row_keys`]).
    pub key: Option<String>,
}

impl std::error::Error for InvalidRow {}

impl std::fmt::Display for InvalidRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let id = match (&self.key, self.id) {
            (Some(key), _) => key.clone(),
            (None, id) => id.map_or_else(|| "?".to_string(), |i| i.to_string()),
        };
        match &self.message_at {
            None => write!(f, "row id={id} column {}: {}", self.column, self.reason),
            Some(at) => write!(f, "message at {at} (outbox-id {id}) field {}: {}", self.column, self.reason),
        }
    }
}

impl InvalidRow {
    /// A bad value in `column` of row `id` (or of a row whose id cannot be read).
    pub fn new(id: Option<i64>, column: &'static str, reason: impl Into<String>) -> Self {
        Self { id, column, reason: reason.into(), raw: None, message_at: None, key: None }
    }

    /// Names the row by its key (see [`Self::key`]).
    pub(crate) fn keyed(mut self, key: String) -> Self {
        self.key = Some(key);
        self
    }

    /// Marks this as a WAL-only message at `place` in the log (see [`Self::message_at`]).
    pub(crate) fn at_message(mut self, place: String) -> Self {
        self.message_at = Some(place);
        self
    }
}

/// Header names starting with this are the streamer's own (`outbox-id`, `outbox-lsn`, …); a row
/// may not set them, or it could forge them.
pub(crate) const RESERVED_HEADER_PREFIX: &str = "outbox-";

/// A row's values as the database holds them, before they are checked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawRow {
    pub topic: Option<Vec<u8>>,
    pub key: Option<Vec<u8>>,
    pub payload: Option<Vec<u8>>,
    /// The `headers` column's JSON text.
    pub headers: Option<Vec<u8>>,
    pub kafka_partition: Option<i64>,
    pub created_at_micros: Option<i64>,
    /// Headers read from columns of their own (a mapped layout's `header_columns`), sent
    /// after the `headers` column's.
    pub extra_headers: Vec<(String, Vec<u8>)>,
}

impl RawRow {
    /// Checks the values of row `id`; a bad one keeps the raw values for a dead-letter copy.
    pub fn into_record(self, id: i64) -> Result<OutboxRecord, InvalidRow> {
        let checked = (|| -> Result<_, InvalidRow> {
            Ok((
                topic_value(id, self.topic.as_deref())?,
                headers_value(id, self.headers.as_deref())?,
                partition_value(id, self.kafka_partition)?,
            ))
        })();
        match checked {
            Ok((topic, mut headers, kafka_partition)) => Ok(OutboxRecord {
                id,
                topic,
                key: self.key,
                payload: self.payload,
                headers: {
                    headers.extend(self.extra_headers);
                    headers
                },
                kafka_partition,
                created_at_micros: self.created_at_micros,
                timestamp_ms: None,
                in_table: true,
            }),
            Err(mut invalid) => {
                invalid.raw = Some(Box::new(self));
                Err(invalid)
            }
        }
    }
}

/// Checks the `topic` column of row `id`: present, UTF-8, a legal Kafka topic length.
pub(crate) fn topic_value(id: i64, topic: Option<&[u8]>) -> Result<String, InvalidRow> {
    let bad = |reason: String| InvalidRow::new(Some(id), "topic", reason);
    let Some(bytes) = topic else { return Err(bad("is NULL; every row needs a Kafka topic".into())) };
    let topic = String::from_utf8(bytes.to_vec()).map_err(|_| bad("is not UTF-8".into()))?;
    if topic.is_empty() || topic.len() > 249 {
        // The reason is logged and shown on /readyz: the topic's length, never its text.
        return Err(bad(format!("is {} bytes long; a Kafka topic name has 1 to 249 characters", topic.len())));
    }
    Ok(topic)
}

/// Checks the `headers` column of row `id` (NULL means no headers).
pub(crate) fn headers_value(id: i64, json: Option<&[u8]>) -> Result<Vec<(String, Vec<u8>)>, InvalidRow> {
    match json {
        None => Ok(Vec::new()),
        Some(json) => parse_headers(json).map_err(|reason| InvalidRow::new(Some(id), "headers", reason)),
    }
}

/// Checks the `kafka_partition` column of row `id` (NULL means "by key").
pub(crate) fn partition_value(id: i64, partition: Option<i64>) -> Result<Option<i32>, InvalidRow> {
    match partition {
        None => Ok(None),
        Some(p) if (0..=i64::from(i32::MAX)).contains(&p) => Ok(Some(p as i32)),
        Some(p) => {
            Err(InvalidRow::new(Some(id), "kafka_partition", format!("{p} is not a partition number (0 or more)")))
        }
    }
}

/// Parses the `headers` column: a JSON object whose values are strings (or null, skipped).
/// Names starting with [`RESERVED_HEADER_PREFIX`] are refused.
pub(crate) fn parse_headers(json: &[u8]) -> Result<Vec<(String, Vec<u8>)>, String> {
    let value: serde_json::Value = serde_json::from_slice(json)
        .map_err(|e| format!("is not valid JSON (at line {} column {})", e.line(), e.column()))?;
    let serde_json::Value::Object(map) = value else {
        return Err("must be a JSON object of string values, e.g. {\"trace-id\": \"abc\"}".into());
    };
    let mut headers = Vec::with_capacity(map.len());
    for (k, v) in map {
        // `get`, not slicing: a name may start with a multi-byte character.
        if k.get(..RESERVED_HEADER_PREFIX.len()).is_some_and(|p| p.eq_ignore_ascii_case(RESERVED_HEADER_PREFIX)) {
            return Err(format!(
                "header {:?} starts with \"{RESERVED_HEADER_PREFIX}\", which is reserved for the streamer's own headers; rename it",
                header_name_for_log(&k)
            ));
        }
        match v {
            serde_json::Value::String(s) => headers.push((k, s.into_bytes())),
            serde_json::Value::Null => {}
            other => {
                // Name the header and the JSON type, never the value (it is application data).
                let kind = match other {
                    serde_json::Value::Bool(_) => "a boolean",
                    serde_json::Value::Number(_) => "a number",
                    serde_json::Value::Array(_) => "an array",
                    _ => "an object",
                };
                return Err(format!(
                    "the value of header {:?} must be a string, found {kind}; quote it in the JSON",
                    header_name_for_log(&k)
                ));
            }
        }
    }
    Ok(headers)
}

/// A header name as errors show it: at most 64 characters, then `…`.
fn header_name_for_log(name: &str) -> String {
    const SHOWN: usize = 64;
    match name.char_indices().nth(SHOWN) {
        Some((cut, _)) => format!("{}…", &name[..cut]),
        None => name.to_string(),
    }
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

    /// Reasons are logged and shown on the unauthenticated /readyz: they name the column, the
    /// header and the type or length, never a header value or the topic's text.
    #[test]
    fn reasons_never_quote_row_data() {
        let e = parse_headers(br#"{"trace-id":"ok","card":{"number":"4111-secret"}}"#).unwrap_err();
        assert!(e.contains("\"card\"") && e.contains("an object") && !e.contains("4111-secret"), "{e}");
        let e = parse_headers(br#"{"n":12345678}"#).unwrap_err();
        assert!(e.contains("a number") && !e.contains("12345678"), "{e}");
        let long = "h".repeat(100);
        let e = parse_headers(format!(r#"{{"{long}":true}}"#).as_bytes()).unwrap_err();
        assert!(e.contains(&format!("\"{}…\"", "h".repeat(64))) && !e.contains(&long), "{e}");
        let topic = format!("secret-{}", "t".repeat(250));
        let e = topic_value(7, Some(topic.as_bytes())).unwrap_err().to_string();
        assert!(!e.contains("secret") && e.contains("257 bytes"), "{e}");
    }

    #[test]
    fn reserved_header_names_are_refused() {
        assert!(parse_headers("{\"ñoutbox-x\": \"1\", \"é\": \"2\"}".as_bytes()).is_ok(), "multi-byte names");
        for name in ["outbox-id", "OUTBOX-Owner-Epoch", "outbox-"] {
            let json = format!("{{\"{name}\": \"1\"}}");
            assert!(parse_headers(json.as_bytes()).unwrap_err().contains("reserved"), "{name}");
        }
        assert!(parse_headers(br#"{"outboxer": "1"}"#).is_ok());
    }

    #[test]
    fn reasons_never_carry_the_row_values() {
        let secret = "s3cr3t-value";
        let reasons = [
            parse_headers(format!(r#"{{"a": {{"x": "{secret}"}}}}"#).as_bytes()).unwrap_err(),
            parse_headers(format!(r#"{{"a": "{secret}""#).as_bytes()).unwrap_err(),
            topic_value(1, Some(format!("{secret}{}", "x".repeat(300)).as_bytes())).unwrap_err().to_string(),
        ];
        for r in reasons {
            assert!(!r.contains(secret), "{r}");
        }
    }

    #[test]
    fn invalid_row_names_row_and_column_and_keeps_the_raw_values() {
        let e = InvalidRow::new(Some(7), "topic", "is NULL");
        assert_eq!(e.to_string(), "row id=7 column topic: is NULL");
        let raw = RawRow {
            key: Some(b"k".to_vec()),
            payload: Some(b"p".to_vec()),
            headers: Some(b"{\"a\":1}".to_vec()),
            ..RawRow::default()
        };
        let e = RawRow { topic: Some(b"t".to_vec()), ..raw.clone() }.into_record(9).unwrap_err();
        assert_eq!((e.id, e.column), (Some(9), "headers"));
        assert_eq!(e.raw.as_deref().and_then(|r| r.payload.as_deref()), Some(&b"p"[..]));
        let ok = RawRow { topic: Some(b"t".to_vec()), headers: None, ..raw }.into_record(9).unwrap();
        assert_eq!((ok.topic.as_str(), ok.key.as_deref()), ("t", Some(&b"k"[..])));
    }
}
