//! Writes messages as tw-tkms stores them, for benchmarks and tests on the Rust side. (The
//! drop-in tests write with tw-tkms's own Java libraries instead: `tests/tw-tkms-writer`.)

use std::io::Write;

use prost::Message as _;

use crate::Compression;
use crate::compression::{LZ4_CHECKSUM_SEED, LZ4_MAGIC, SNAPPY_JAVA_MAGIC};
use crate::message::{StoredMessage, Wire, WireHeader, WireHeaders};

/// The `message` column value tw-tkms would store for `m` with `compression`.
pub fn encode(m: &StoredMessage, compression: Compression) -> Vec<u8> {
    let plain = Wire {
        topic: m.topic.clone(),
        partition: m.partition,
        key: m.key.clone().unwrap_or_default(),
        timestamp: m.timestamp_ms,
        value: m.value.clone(),
        headers: (!m.headers.is_empty()).then(|| WireHeaders {
            headers: m.headers.iter().map(|(k, v)| WireHeader { key: k.clone(), value: v.clone() }).collect(),
        }),
        insert_timestamp: m.insert_timestamp_ms,
    }
    .encode_to_vec();
    let mut out = vec![0, 0, compression.header_byte()];
    match compression {
        Compression::None => out.extend(plain),
        Compression::SnappyFramed => {
            let mut w = snap::write::FrameEncoder::new(out);
            w.write_all(&plain).expect("writing to memory");
            out = w.into_inner().expect("writing to memory");
        }
        Compression::Snappy => {
            out.extend(SNAPPY_JAVA_MAGIC);
            out.extend(1i32.to_be_bytes());
            out.extend(1i32.to_be_bytes());
            for block in plain.chunks(32 * 1024) {
                let c = snap::raw::Encoder::new().compress_vec(block).expect("a block within snappy's limit");
                out.extend((c.len() as i32).to_be_bytes());
                out.extend(c);
            }
        }
        Compression::Zstd => out.extend(zstd::stream::encode_all(&plain[..], 3).expect("writing to memory")),
        Compression::Lz4 => {
            const LEVEL: u8 = 6; // 64 KiB blocks, tw-tkms's default
            let header = |out: &mut Vec<u8>, token: u8, c: usize, o: usize, check: u32| {
                lz4_block_header(out, token | LEVEL, (c, o), check);
            };
            for block in plain.chunks(1 << (10 + LEVEL)) {
                let check = twox_hash::XxHash32::oneshot(LZ4_CHECKSUM_SEED, block) & 0x0fff_ffff;
                let c = lz4_flex::block::compress(block);
                header(&mut out, 0x20, c.len(), block.len(), check);
                out.extend(c);
            }
            header(&mut out, 0x10, 0, 0, 0);
        }
        Compression::Gzip => {
            let mut w = flate2::write::GzEncoder::new(out, flate2::Compression::default());
            w.write_all(&plain).expect("writing to memory");
            out = w.finish().expect("writing to memory");
        }
    }
    out
}

/// One lz4-java block header: magic, token (method | level), compressed and original lengths,
/// checksum.
pub(crate) fn lz4_block_header(out: &mut Vec<u8>, token: u8, (compressed, original): (usize, usize), check: u32) {
    out.extend(LZ4_MAGIC);
    out.push(token);
    out.extend((compressed as i32).to_le_bytes());
    out.extend((original as i32).to_le_bytes());
    out.extend(check.to_le_bytes());
}
