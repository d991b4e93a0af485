//! The compressions tw-tkms writes, each read the way its Java library writes it.

use std::fmt;
use std::io::Read;

use crate::{DecodeError, MAX_DECOMPRESSED};

/// The compression type in the low three bits of a stored message's third byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// 0: the protobuf as is.
    None,
    /// 1: snappy-java's `SnappyFramedOutputStream`, the framing format of the Snappy project.
    /// Chunk checksums are not verified: tw-tkms does not either (its 0.4 wrote none).
    SnappyFramed,
    /// 2: snappy-java's `SnappyOutputStream` (a `\x82SNAPPY\0` header, then length-prefixed
    /// blocks), or one raw Snappy block without the header, as `SnappyInputStream` reads.
    Snappy,
    /// 3: zstd-jni's `ZstdOutputStream`: standard zstd frames.
    Zstd,
    /// 4: lz4-java's `LZ4BlockOutputStream`: `LZ4Block` blocks with an xxHash32 checksum.
    Lz4,
    /// 5: `java.util.zip.GZIPOutputStream`.
    Gzip,
}

impl fmt::Display for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Compression::None => "none",
            Compression::SnappyFramed => "snappy (framed)",
            Compression::Snappy => "snappy (snappy-java stream)",
            Compression::Zstd => "zstd",
            Compression::Lz4 => "lz4 (lz4-java block stream)",
            Compression::Gzip => "gzip",
        })
    }
}

impl Compression {
    /// Reads the type from the header's third byte (tw-tkms reads its low three bits).
    pub fn from_header(byte: u8) -> Result<Self, DecodeError> {
        Ok(match byte & 0b111 {
            0 => Compression::None,
            1 => Compression::SnappyFramed,
            2 => Compression::Snappy,
            3 => Compression::Zstd,
            4 => Compression::Lz4,
            5 => Compression::Gzip,
            other => return Err(DecodeError::UnknownCompression(other)),
        })
    }

    /// The header byte tw-tkms writes for this compression.
    pub fn header_byte(self) -> u8 {
        match self {
            Compression::None => 0,
            Compression::SnappyFramed => 1,
            Compression::Snappy => 2,
            Compression::Zstd => 3,
            Compression::Lz4 => 4,
            Compression::Gzip => 5,
        }
    }

    /// Decompresses `body` (the bytes after the header), at most [`MAX_DECOMPRESSED`] of them.
    pub(crate) fn decompress(self, body: &[u8]) -> Result<Vec<u8>, DecodeError> {
        let fail = |reason: String| DecodeError::Decompress { compression: self, reason };
        match self {
            Compression::None => Ok(body.to_vec()),
            Compression::SnappyFramed => snappy_framed(body).map_err(fail),
            Compression::Snappy => snappy_stream(body).map_err(fail),
            Compression::Lz4 => lz4_blocks(body).map_err(fail),
            Compression::Zstd => {
                let decoder = zstd::stream::read::Decoder::with_buffer(body).map_err(|e| fail(e.to_string()))?;
                read_bounded(decoder).map_err(|e| e.map_or(DecodeError::TooLarge, fail))
            }
            Compression::Gzip => {
                read_bounded(flate2::read::MultiGzDecoder::new(body)).map_err(|e| e.map_or(DecodeError::TooLarge, fail))
            }
        }
    }
}

/// Reads all of `r`; `Err(None)` past [`MAX_DECOMPRESSED`] bytes.
fn read_bounded(r: impl Read) -> Result<Vec<u8>, Option<String>> {
    let mut out = Vec::new();
    r.take(MAX_DECOMPRESSED as u64 + 1).read_to_end(&mut out).map_err(|e| Some(e.to_string()))?;
    if out.len() > MAX_DECOMPRESSED {
        return Err(None);
    }
    Ok(out)
}

/// Grows `out` by one decompressed block, keeping the total within [`MAX_DECOMPRESSED`].
fn room(out: &[u8], more: usize) -> Result<(), String> {
    if out.len().saturating_add(more) > MAX_DECOMPRESSED {
        return Err(format!("it decompresses to more than {MAX_DECOMPRESSED} bytes"));
    }
    Ok(())
}

fn raw_snappy(block: &[u8], out: &mut Vec<u8>) -> Result<(), String> {
    let len = snap::raw::decompress_len(block).map_err(|e| e.to_string())?;
    room(out, len)?;
    let start = out.len();
    out.resize(start + len, 0);
    snap::raw::Decoder::new().decompress(block, &mut out[start..]).map_err(|e| e.to_string())?;
    Ok(())
}

/// Splits `n` bytes off the front of `rest`, or says the data ends early.
fn take<'a>(rest: &mut &'a [u8], n: usize, what: &str) -> Result<&'a [u8], String> {
    if rest.len() < n {
        return Err(format!("it ends inside {what} ({} of {n} bytes)", rest.len()));
    }
    let (head, tail) = rest.split_at(n);
    *rest = tail;
    Ok(head)
}

/// The Snappy framing format: chunks of a type byte and a 3-byte little-endian length.
fn snappy_framed(mut rest: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    let mut identified = false;
    while !rest.is_empty() {
        let head = take(&mut rest, 4, "a chunk header")?;
        let len = usize::from(head[1]) | usize::from(head[2]) << 8 | usize::from(head[3]) << 16;
        let chunk = take(&mut rest, len, "a chunk")?;
        match head[0] {
            0xff if chunk == b"sNaPpY" => identified = true,
            0xff => return Err("its stream identifier is not sNaPpY".into()),
            _ if !identified => return Err("it does not start with the sNaPpY stream identifier".into()),
            0x00 if len >= 4 => raw_snappy(&chunk[4..], &mut out)?,
            0x01 if len >= 4 => {
                room(&out, len - 4)?;
                out.extend_from_slice(&chunk[4..]);
            }
            0x00 | 0x01 => return Err("a data chunk is shorter than its checksum".into()),
            0x02..=0x7f => return Err(format!("it has a chunk of reserved type {:#04x}", head[0])),
            _ => {} // padding and skippable chunks
        }
    }
    if !identified {
        return Err("it is empty".into());
    }
    Ok(out)
}

pub(crate) const SNAPPY_JAVA_MAGIC: &[u8] = b"\x82SNAPPY\x00";

/// snappy-java's stream: the magic, two big-endian version words, then blocks each prefixed
/// with its big-endian compressed length. Without the magic, one raw Snappy block.
fn snappy_stream(body: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    let Some(mut rest) = body.strip_prefix(SNAPPY_JAVA_MAGIC) else {
        raw_snappy(body, &mut out)?;
        return Ok(out);
    };
    take(&mut rest, 8, "the stream header's version words")?;
    while !rest.is_empty() {
        let len = take(&mut rest, 4, "a block length")?;
        let len = i32::from_be_bytes(len.try_into().expect("4 bytes"));
        let len = usize::try_from(len).map_err(|_| format!("a block has the negative length {len}"))?;
        raw_snappy(take(&mut rest, len, "a block")?, &mut out)?;
    }
    Ok(out)
}

pub(crate) const LZ4_MAGIC: &[u8] = b"LZ4Block";
/// The seed of lz4-java's block checksum (xxHash32).
pub(crate) const LZ4_CHECKSUM_SEED: u32 = 0x9747_b28c;

/// lz4-java's block stream: blocks of `LZ4Block`, a token (method in the high nibble: 0x10
/// stored, 0x20 LZ4; log2 of the block size less 10 in the low one), compressed and original
/// lengths and a checksum (little-endian), then the data; an empty block ends the stream.
fn lz4_blocks(mut rest: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let head = take(&mut rest, 21, "a block header")?;
        if &head[..8] != LZ4_MAGIC {
            return Err("a block does not start with LZ4Block".into());
        }
        let word = |at: usize| i32::from_le_bytes(head[at..at + 4].try_into().expect("4 bytes"));
        let (token, compressed, original, check) = (head[8], word(9), word(13), word(17));
        let block_size = 1i64 << (10 + (token & 0x0f));
        if compressed < 0 || original < 0 || i64::from(original) > block_size {
            return Err(format!("a block header has impossible lengths ({compressed}, {original})"));
        }
        let (compressed, original) = (compressed as usize, original as usize);
        if original == 0 {
            if compressed != 0 {
                return Err("the end block is not empty".into());
            }
            return Ok(out);
        }
        let data = take(&mut rest, compressed, "a block")?;
        room(&out, original)?;
        let block = match token & 0xf0 {
            0x10 if compressed == original => data.to_vec(),
            0x10 => return Err("a stored block's lengths differ".into()),
            0x20 => lz4_flex::block::decompress(data, original).map_err(|e| e.to_string())?,
            method => return Err(format!("a block has the unknown method {method:#04x}")),
        };
        if block.len() != original {
            return Err("a block decompresses to another length than its header says".into());
        }
        // lz4-java's checksum keeps the low 28 bits of the hash.
        let hash = twox_hash::XxHash32::oneshot(LZ4_CHECKSUM_SEED, &block) & 0x0fff_ffff;
        if hash as i32 != check {
            return Err("a block's checksum does not match its data".into());
        }
        out.extend_from_slice(&block);
    }
}

#[cfg(test)]
mod tests;
