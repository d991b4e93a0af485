//! Round trips through encoders of the Rust ecosystem, and the ways a message can be broken.
//! (That Java's libraries write what these read is tested against the real writer in
//! `tests/tw_tkms.rs`.)

use std::io::Write;

use super::*;
use crate::{StoredMessage, decode, encode};

fn encode_for_tests(m: &StoredMessage) -> Vec<u8> {
    encode(m, Compression::None)[3..].to_vec()
}

fn sample() -> StoredMessage {
    StoredMessage {
        topic: "orders".into(),
        partition: Some(3),
        key: Some("customer-1".into()),
        timestamp_ms: Some(1_700_000_000_123),
        value: b"{\"total\": 12}".repeat(40),
        headers: vec![("trace".into(), b"abc".to_vec()), ("trace".into(), Vec::new())],
        insert_timestamp_ms: Some(1_700_000_000_456),
    }
}

fn stored(compression: Compression, body: Vec<u8>) -> Vec<u8> {
    let mut out = vec![0, 0, compression.header_byte()];
    out.extend(body);
    out
}

fn snappy_java(plain: &[u8], block: usize) -> Vec<u8> {
    let mut out = SNAPPY_JAVA_MAGIC.to_vec();
    out.extend(1i32.to_be_bytes());
    out.extend(1i32.to_be_bytes());
    for chunk in plain.chunks(block) {
        let c = snap::raw::Encoder::new().compress_vec(chunk).unwrap();
        out.extend((c.len() as i32).to_be_bytes());
        out.extend(c);
    }
    out
}

fn lz4_java(plain: &[u8], block: usize, corrupt_checksum: bool) -> Vec<u8> {
    let level = (block.trailing_zeros() - 10) as u8;
    let mut out = Vec::new();
    let header = |out: &mut Vec<u8>, token: u8, c: usize, o: usize, check: u32| {
        encode::lz4_block_header(out, token | level, (c, o), check);
    };
    for (i, chunk) in plain.chunks(block).enumerate() {
        let mut check = twox_hash::XxHash32::oneshot(LZ4_CHECKSUM_SEED, chunk) & 0x0fff_ffff;
        if corrupt_checksum {
            check ^= 1;
        }
        if i % 2 == 0 {
            let c = lz4_flex::block::compress(chunk);
            header(&mut out, 0x20, c.len(), chunk.len(), check);
            out.extend(c);
        } else {
            header(&mut out, 0x10, chunk.len(), chunk.len(), check);
            out.extend(chunk);
        }
    }
    header(&mut out, 0x10, 0, 0, 0);
    out
}

fn every_compression(plain: &[u8]) -> Vec<(Compression, Vec<u8>)> {
    let mut framed = snap::write::FrameEncoder::new(Vec::new());
    framed.write_all(plain).unwrap();
    let mut gzip = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gzip.write_all(plain).unwrap();
    vec![
        (Compression::None, plain.to_vec()),
        (Compression::SnappyFramed, framed.into_inner().unwrap()),
        (Compression::Snappy, snappy_java(plain, 256)),
        (Compression::Snappy, snap::raw::Encoder::new().compress_vec(plain).unwrap()),
        (Compression::Zstd, zstd::stream::encode_all(plain, 3).unwrap()),
        (Compression::Lz4, lz4_java(plain, 1024, false)),
        (Compression::Gzip, gzip.finish().unwrap()),
    ]
}

#[test]
fn every_compression_decodes_to_the_same_message() {
    let m = sample();
    for (compression, body) in every_compression(&encode_for_tests(&m)) {
        assert_eq!(decode(&stored(compression, body)).unwrap(), m, "{compression}");
    }
}

#[test]
fn what_encode_writes_decodes() {
    let m = sample();
    for c in [
        Compression::None,
        Compression::SnappyFramed,
        Compression::Snappy,
        Compression::Zstd,
        Compression::Lz4,
        Compression::Gzip,
    ] {
        assert_eq!(decode(&encode(&m, c)).unwrap(), m, "{c}");
    }
}

#[test]
fn empty_fields_read_as_tw_tkms_sends_them() {
    let m = StoredMessage {
        topic: "t".into(),
        partition: None,
        key: None,
        timestamp_ms: None,
        value: Vec::new(),
        headers: Vec::new(),
        insert_timestamp_ms: None,
    };
    assert_eq!(decode(&stored(Compression::None, encode_for_tests(&m))).unwrap(), m);
    // Partition 0 is a set wrapper, not "no partition".
    let zero = StoredMessage { partition: Some(0), ..m };
    assert_eq!(decode(&stored(Compression::None, encode_for_tests(&zero))).unwrap().partition, Some(0));
}

#[test]
fn broken_messages_say_what_is_wrong() {
    let plain = encode_for_tests(&sample());
    assert_eq!(decode(&[0, 0]), Err(DecodeError::TooShort(2)));
    assert_eq!(decode(&[0, 0, 6, 1]), Err(DecodeError::UnknownCompression(6)));
    for (compression, body) in every_compression(&plain).into_iter().skip(1) {
        let cut = stored(compression, body[..body.len() / 2].to_vec());
        let e = decode(&cut).unwrap_err();
        assert!(
            matches!(e, DecodeError::Decompress { .. } | DecodeError::Protobuf { .. }),
            "{compression} cut in half: {e}"
        );
    }
    let e = decode(&stored(Compression::Lz4, lz4_java(&plain, 1024, true))).unwrap_err();
    assert!(e.to_string().contains("checksum"), "{e}");
    let e = decode(&stored(Compression::None, b"\xff\xff\xff".to_vec())).unwrap_err();
    assert!(matches!(e, DecodeError::Protobuf { .. }), "{e}");
    let e = decode(&stored(Compression::Gzip, b"not gzip".to_vec())).unwrap_err();
    assert!(e.to_string().starts_with("does not decompress as gzip"), "{e}");
}

#[test]
fn a_message_decompressing_past_the_limit_is_refused_without_reading_it_all() {
    let zeros = vec![0u8; 1 << 20];
    let mut enc = zstd::stream::write::Encoder::new(Vec::new(), 19).unwrap();
    for _ in 0..=(MAX_DECOMPRESSED >> 20) {
        enc.write_all(&zeros).unwrap();
    }
    let bomb = enc.finish().unwrap();
    assert!(bomb.len() < 1 << 20);
    assert_eq!(decode(&stored(Compression::Zstd, bomb)), Err(DecodeError::TooLarge));
}

#[test]
fn a_utf8_violation_in_the_topic_is_a_protobuf_error() {
    // Field 1 (topic), length 2, bytes that are not UTF-8.
    let e = decode(&[0, 0, 0, 0x0a, 2, 0xff, 0xfe]).unwrap_err();
    assert!(matches!(e, DecodeError::Protobuf { .. }), "{e}");
}
