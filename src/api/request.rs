//! The body of `POST /v1/messages`, read and checked: one message, or `{"messages": [...]}`.
//! Every refusal says which message (by its place in the batch) and which field is wrong, and
//! what would be right; none quotes a payload.

use std::collections::BTreeMap;

use base64::Engine;
use serde::Deserialize;

use super::store::NewMessage;
use super::tokens::Token;

/// Longest topic (Kafka's limit; also the outbox table's column).
const MAX_TOPIC: usize = 249;
/// Longest key in bytes (the MariaDB outbox table's `msg_key` column).
const MAX_KEY: usize = 2048;
const MAX_BUSINESS_KEY: usize = 256;
const MAX_IDEMPOTENCY_KEY: usize = 200;
const MAX_URL: usize = 2048;
const MAX_HEADERS: usize = 64;
const MAX_HEADER_NAME: usize = 256;

/// A refused request: the HTTP status and what to tell the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refusal {
    pub status: u16,
    pub message: String,
}

impl Refusal {
    pub(crate) fn new(status: u16, message: impl Into<String>) -> Self {
        Self { status, message: message.into() }
    }
}

/// One message as the caller writes it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MessageBody {
    topic: Option<String>,
    /// RabbitMQ's word for the topic.
    exchange: Option<String>,
    key: Option<String>,
    key_base64: Option<String>,
    /// RabbitMQ's word for the key.
    routing_key: Option<String>,
    /// Sent exactly as written: its JSON text, unparsed (no key reordered, no number rounded).
    payload: Option<Box<serde_json::value::RawValue>>,
    payload_base64: Option<String>,
    headers: Option<BTreeMap<String, String>>,
    shard: Option<u32>,
    business_key: Option<String>,
    checkback_url: Option<String>,
    idempotency_key: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchBody {
    messages: Vec<Box<serde_json::value::RawValue>>,
}

/// Reads `body` as one message or a batch; `batch` tells which it was, for the answer's shape.
pub(crate) fn parse(
    body: &[u8],
    token: &Token,
    shards: u32,
    max_batch: usize,
) -> Result<(Vec<NewMessage>, bool), Refusal> {
    let value: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| Refusal::new(400, format!("the body is not JSON ({e}); send a JSON object")))?;
    let Some(object) = value.as_object() else {
        return Err(Refusal::new(400, "the body must be a JSON object: one message, or {\"messages\": [...]}"));
    };
    if object.contains_key("messages") {
        let batch: BatchBody = serde_json::from_value(value).map_err(|e| {
            Refusal::new(400, format!("{e}; a batch is {{\"messages\": [message, ...]}} and nothing else"))
        })?;
        if batch.messages.is_empty() || batch.messages.len() > max_batch {
            return Err(Refusal::new(
                if batch.messages.len() > max_batch { 413 } else { 400 },
                format!("a batch holds 1 to {max_batch} messages (api.max_batch), not {}", batch.messages.len()),
            ));
        }
        let mut messages = Vec::with_capacity(batch.messages.len());
        for (i, m) in batch.messages.iter().enumerate() {
            messages.push(
                message(m.get().as_bytes(), token, shards)
                    .map_err(|r| Refusal::new(r.status, format!("messages[{i}]: {}", r.message)))?,
            );
        }
        let mut keys = std::collections::HashSet::new();
        if let Some(twice) = messages.iter().filter_map(|m| m.idempotency_key.as_deref()).find(|k| !keys.insert(*k)) {
            return Err(Refusal::new(400, format!("idempotency_key {twice:?} is given to two messages of the batch")));
        }
        Ok((messages, true))
    } else {
        Ok((vec![message(body, token, shards)?], false))
    }
}

/// One message, checked against the token's grant.
fn message(text: &[u8], token: &Token, shards: u32) -> Result<NewMessage, Refusal> {
    let bad = |message: String| Refusal::new(400, message);
    let m: MessageBody =
        serde_json::from_slice(text).map_err(|e| bad(format!("{e}; see docs/api.md for the fields")))?;
    let topic = match (m.topic, m.exchange) {
        (Some(t), None) => t,
        (None, Some(e)) => e,
        (Some(_), Some(_)) => return Err(bad("give topic or exchange, not both".into())),
        (None, None) => return Err(bad("topic is missing (or exchange, for a RabbitMQ shard-partition)".into())),
    };
    if topic.is_empty() || topic.len() > MAX_TOPIC || topic.contains(|c: char| c.is_control()) {
        return Err(bad(format!("topic must be 1 to {MAX_TOPIC} bytes without control characters")));
    }
    let key = match (m.key, m.key_base64, m.routing_key) {
        (Some(k), None, None) | (None, None, Some(k)) => Some(k.into_bytes()),
        (None, Some(b), None) => Some(
            base64::engine::general_purpose::STANDARD
                .decode(b)
                .map_err(|e| bad(format!("key_base64 is not base64 ({e})")))?,
        ),
        (None, None, None) => None,
        _ => return Err(bad("give one of key, key_base64 and routing_key".into())),
    };
    if key.as_ref().is_some_and(|k| k.len() > MAX_KEY) {
        return Err(bad(format!("the key is longer than {MAX_KEY} bytes")));
    }
    let payload = match (m.payload, m.payload_base64) {
        (Some(_), Some(_)) => return Err(bad("give payload or payload_base64, not both".into())),
        (None, None) => None,
        (Some(json), None) => Some(json.get().as_bytes().to_vec()),
        (None, Some(b)) => Some(
            base64::engine::general_purpose::STANDARD
                .decode(b)
                .map_err(|e| bad(format!("payload_base64 is not base64 ({e})")))?,
        ),
    };
    let headers = match m.headers {
        None => None,
        Some(h) if h.is_empty() => None,
        Some(h) => {
            if h.len() > MAX_HEADERS {
                return Err(bad(format!("at most {MAX_HEADERS} headers, not {}", h.len())));
            }
            for name in h.keys() {
                if name.is_empty() || name.len() > MAX_HEADER_NAME || name.contains(|c: char| c.is_control()) {
                    return Err(bad(format!(
                        "header names are 1 to {MAX_HEADER_NAME} bytes without control characters"
                    )));
                }
                if name.to_ascii_lowercase().starts_with("outbox-") {
                    return Err(bad(format!(
                        "header {name:?}: names starting with outbox- are the streamer's own (outbox-id, outbox-shard, …); rename it"
                    )));
                }
            }
            if let Some(name) = h.iter().find(|(_, v)| v.contains('\0')).map(|(k, _)| k) {
                return Err(bad(format!("header {name:?}: a value may not hold a NUL character (\\u0000)")));
            }
            Some(serde_json::to_string(&h).map_err(|e| bad(format!("headers: {e}")))?)
        }
    };
    let shard = m.shard.unwrap_or(0);
    if shard >= shards {
        return Err(bad(format!("shard {shard} does not exist: the source has shards 0..{}", shards - 1)));
    }
    if !token.allows_shard(shard) {
        return Err(Refusal::new(403, format!("token {:?} may not prepare to shard {shard}", token.name)));
    }
    if !token.allows_topic(&topic) {
        return Err(Refusal::new(
            403,
            format!("token {:?} may not prepare to topic {topic:?} (see its topics in [[api.token]])", token.name),
        ));
    }
    let text = |field: &str, value: Option<String>, max: usize| -> Result<Option<String>, Refusal> {
        match value {
            Some(v) if v.is_empty() || v.len() > max || v.contains(|c: char| c.is_control()) => {
                Err(Refusal::new(400, format!("{field} must be 1 to {max} bytes without control characters")))
            }
            v => Ok(v),
        }
    };
    let business_key = text("business_key", m.business_key, MAX_BUSINESS_KEY)?;
    let idempotency_key = text("idempotency_key", m.idempotency_key, MAX_IDEMPOTENCY_KEY)?;
    let checkback_url = text("checkback_url", m.checkback_url, MAX_URL)?;
    if let Some(url) = &checkback_url {
        if business_key.is_none() {
            return Err(bad("checkback_url needs a business_key: the check-back asks about it".into()));
        }
        if !token.allows_checkback(url) {
            return Err(Refusal::new(
                403,
                format!(
                    "checkback_url is outside what token {:?} may use: it must start with one of its checkback_urls",
                    token.name
                ),
            ));
        }
    }
    Ok(NewMessage {
        token: token.name.clone(),
        idempotency_key,
        shard,
        topic,
        key,
        payload,
        headers,
        business_key,
        checkback_url,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token() -> Token {
        Token::for_test("svc", &["orders", "pay.*"], Some(vec![0, 1]), &["https://svc.internal/cb/"])
    }

    fn one(body: &str) -> Result<NewMessage, Refusal> {
        parse(body.as_bytes(), &token(), 2, 10).map(|(mut m, batch)| {
            assert!(!batch);
            m.remove(0)
        })
    }

    #[test]
    fn a_message_is_read_with_its_defaults() {
        let m = one(r#"{"topic": "orders", "key": "alice", "payload": {"total": 42}, "headers": {"trace": "t1"}}"#)
            .unwrap();
        assert_eq!(m.topic, "orders");
        assert_eq!(m.key.as_deref(), Some(&b"alice"[..]));
        assert_eq!(m.payload.as_deref(), Some(&br#"{"total": 42}"#[..]), "the payload's text as sent");
        assert_eq!(m.headers.as_deref(), Some(r#"{"trace":"t1"}"#));
        assert_eq!((m.shard, m.token.as_str()), (0, "svc"));
        let m = one(r#"{"exchange": "pay.eu", "routing_key": "r", "payload_base64": "AAEC", "shard": 1}"#).unwrap();
        assert_eq!(
            (m.topic.as_str(), m.key.as_deref(), m.payload.as_deref()),
            ("pay.eu", Some(&b"r"[..]), Some(&[0u8, 1, 2][..]))
        );
        assert_eq!(one(r#"{"topic": "orders", "payload": null}"#).unwrap().payload, None);
        let exact = r#"{"z":1,"a":2,"big":12345678901234567890123,"e":1e2}"#;
        let m = one(&format!(r#"{{"topic": "orders", "payload": {exact}}}"#)).unwrap();
        assert_eq!(m.payload.as_deref(), Some(exact.as_bytes()), "no key reordered, no number rounded");
    }

    #[test]
    fn every_bad_field_is_named() {
        let cases: &[(&str, u16, &str)] = &[
            ("[1]", 400, "JSON object"),
            ("{", 400, "not JSON"),
            (r#"{"payload": 1}"#, 400, "topic is missing"),
            (r#"{"topic": "orders", "colour": 1}"#, 400, "unknown field `colour`"),
            (r#"{"topic": "orders", "topic": "pay.x"}"#, 400, "duplicate field `topic`"),
            (r#"{"topic": "orders", "exchange": "orders"}"#, 400, "not both"),
            (r#"{"topic": ""}"#, 400, "topic must be"),
            (r#"{"topic": "orders", "key": "a", "key_base64": "YQ=="}"#, 400, "one of key"),
            (r#"{"topic": "orders", "key_base64": "%%"}"#, 400, "key_base64 is not base64"),
            (r#"{"topic": "orders", "payload": 1, "payload_base64": "YQ=="}"#, 400, "not both"),
            (r#"{"topic": "orders", "headers": {"outbox-id": "1"}}"#, 400, "streamer's own"),
            (r#"{"topic": "orders", "headers": {"a": 1}}"#, 400, "invalid type"),
            (r#"{"topic": "orders", "headers": {"a": "x\u0000y"}}"#, 400, "NUL"),
            (r#"{"topic": "orders", "shard": 2}"#, 400, "shard 2 does not exist"),
            (r#"{"topic": "orders", "shard": -1}"#, 400, "invalid value"),
            (r#"{"topic": "payments"}"#, 403, "may not prepare to topic"),
            (r#"{"topic": "orders", "business_key": ""}"#, 400, "business_key must be"),
            (r#"{"topic": "orders", "checkback_url": "https://svc.internal/cb/x"}"#, 400, "needs a business_key"),
            (r#"{"topic": "orders", "business_key": "b", "checkback_url": "https://evil/cb/"}"#, 403, "checkback_urls"),
            (
                r#"{"topic": "orders", "business_key": "b", "checkback_url": "https://svc.internal/cb/../admin"}"#,
                403,
                "checkback_urls",
            ),
            (
                r#"{"topic": "orders", "business_key": "b", "checkback_url": "https://svc.internal/cb/%2e%2e/admin"}"#,
                403,
                "checkback_urls",
            ),
        ];
        for (body, status, words) in cases {
            let r = one(body).unwrap_err();
            assert_eq!(r.status, *status, "{body}: {}", r.message);
            assert!(r.message.contains(words), "{body}: {}", r.message);
        }
        let key = format!(r#"{{"topic": "orders", "key": "{}"}}"#, "k".repeat(MAX_KEY + 1));
        assert!(one(&key).unwrap_err().message.contains("longer than"));
    }

    #[test]
    fn a_shard_outside_the_grant_is_forbidden() {
        let t = Token::for_test("svc", &["*"], Some(vec![1]), &[]);
        let r = parse(br#"{"topic": "orders"}"#, &t, 2, 10).unwrap_err();
        assert_eq!(r.status, 403);
        assert!(r.message.contains("shard 0"), "{}", r.message);
    }

    #[test]
    fn a_batch_names_its_bad_message_and_is_bounded() {
        let (m, batch) =
            parse(br#"{"messages": [{"topic": "orders"}, {"topic": "pay.x", "shard": 1}]}"#, &token(), 2, 10).unwrap();
        assert!(batch);
        assert_eq!(m.len(), 2);
        let r = parse(br#"{"messages": [{"topic": "orders"}, {"topic": "x"}]}"#, &token(), 2, 10).unwrap_err();
        assert_eq!(r.status, 403);
        assert!(r.message.starts_with("messages[1]: "), "{}", r.message);
        let r = parse(br#"{"messages": []}"#, &token(), 2, 10).unwrap_err();
        assert_eq!(r.status, 400);
        let r = parse(br#"{"messages": [{"topic": "orders"}, {"topic": "orders"}]}"#, &token(), 2, 1).unwrap_err();
        assert_eq!(r.status, 413);
        let twice = br#"{"messages": [{"topic": "orders", "idempotency_key": "k"}, {"topic": "orders", "idempotency_key": "k"}]}"#;
        assert!(parse(twice, &token(), 2, 10).unwrap_err().message.contains("two messages"));
        let r = parse(br#"{"messages": [], "topic": "orders"}"#, &token(), 2, 10).unwrap_err();
        assert!(r.message.contains("unknown field"), "{}", r.message);
    }
}
