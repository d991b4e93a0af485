//! The payload every bench message carries.
//!
//! `repeated` (the default, and every measurement before 2026-12-07) is one byte repeated: it
//! compresses to almost nothing, which flatters any layout that compresses messages
//! (tw-tkms). `json` is an order event as an application would write it — ids, names, amounts,
//! a list of items — whose entropy gives the compression ratios of real JSON (a few times,
//! not a hundred). Each run uses one payload for every message, so the two shapes differ only
//! in what a compressor can do with them.

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

/// What a message's payload looks like.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum PayloadShape {
    #[default]
    Repeated,
    Json,
}

impl PayloadShape {
    pub(crate) fn is_repeated(&self) -> bool {
        *self == PayloadShape::Repeated
    }
}

/// A payload of about `bytes` bytes (exactly `bytes` for `repeated`; for `json`, the first
/// complete document at or past `bytes`, at least one item long).
pub(crate) fn payload(bytes: usize, shape: PayloadShape) -> Vec<u8> {
    match shape {
        PayloadShape::Repeated => vec![b'x'; bytes],
        PayloadShape::Json => order_event(bytes).into_bytes(),
    }
}

/// A deterministic pseudo-random order event (xorshift; the same document on every run).
fn order_event(bytes: usize) -> String {
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    const WORDS: [&str; 12] =
        ["blue", "steel", "organic", "cotton", "large", "compact", "wireless", "classic", "eco", "pro", "mini", "set"];
    let mut doc = format!(
        "{{\"eventId\":\"{:016x}{:016x}\",\"type\":\"OrderPlaced\",\"orderId\":\"ord-{}\",\"customer\":{{\"id\":\"cus-{}\",\"country\":\"DE\",\"tier\":\"gold\"}},\"currency\":\"EUR\",\"createdAt\":\"2026-12-07T10:{:02}:{:02}.{:03}Z\",\"items\":[",
        next(),
        next(),
        next() % 10_000_000,
        next() % 1_000_000,
        next() % 60,
        next() % 60,
        next() % 1000
    );
    let mut item = 0;
    while item == 0 || doc.len() + 2 < bytes {
        if item > 0 {
            doc.push(',');
        }
        let (a, b) = (WORDS[(next() % 12) as usize], WORDS[(next() % 12) as usize]);
        doc.push_str(&format!(
            "{{\"sku\":\"SKU-{:06}\",\"name\":\"{a} {b}\",\"qty\":{},\"unitPrice\":\"{}.{:02}\",\"warehouse\":\"wh-{}\"}}",
            next() % 1_000_000,
            1 + next() % 5,
            1 + next() % 300,
            next() % 100,
            next() % 8
        ));
        item += 1;
    }
    doc.push_str("]}");
    doc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_is_one_document_of_about_the_size_asked() {
        let p = payload(1024, PayloadShape::Json);
        assert!((1024..1024 + 160).contains(&p.len()), "{}", p.len());
        let text = String::from_utf8(p).unwrap();
        assert!(text.starts_with("{\"eventId\":") && text.ends_with("]}"), "{text}");
        assert_eq!(text.matches('{').count(), text.matches('}').count());
        assert_eq!(payload(1024, PayloadShape::Json), payload(1024, PayloadShape::Json), "deterministic");
        assert_eq!(payload(5, PayloadShape::Repeated), b"xxxxx");
    }
}
