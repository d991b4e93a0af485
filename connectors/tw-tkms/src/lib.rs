//! Reads the messages [tw-tkms](https://github.com/transferwise/tw-tkms) stores in its
//! `outgoing_message_<shard>_<partition>` tables, so outbox-streamer can publish them in place
//! of tw-tkms's polling proxy without any change to the application.
//!
//! A stored `message` is a 3-byte header — two reserved bytes, then the compression type in the
//! low three bits of the third — followed by a protobuf `Message` (see [`StoredMessage`]),
//! compressed as the header says ([`Compression`]).
//!
//! Decoding never trusts the bytes: a truncated or corrupt message, an unknown compression type
//! or a message that would decompress past [`MAX_DECOMPRESSED`] is a [`DecodeError`] that says
//! which, and never echoes the message's content (it is application data).

mod compression;
mod encode;
mod message;

pub use compression::Compression;
pub use encode::encode;
pub use message::StoredMessage;

/// The largest decompressed message accepted (a message larger than any broker takes; it keeps
/// a corrupt or hostile length from allocating without bound).
pub const MAX_DECOMPRESSED: usize = 256 * 1024 * 1024;

/// Why a stored message cannot be read. The text never contains the message's bytes.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("is {0} bytes long; a tw-tkms message has a 3-byte header")]
    TooShort(usize),
    #[error("has compression type {0} in its header, which tw-tkms does not write (0 to 5)")]
    UnknownCompression(u8),
    #[error("does not decompress as {compression}: {reason}")]
    Decompress { compression: Compression, reason: String },
    #[error("decompresses to more than {MAX_DECOMPRESSED} bytes")]
    TooLarge,
    #[error("is not a tw-tkms StoredMessage.Message after {compression} decompression: {reason}")]
    Protobuf { compression: Compression, reason: String },
}

/// Decodes one stored `message` column value.
pub fn decode(stored: &[u8]) -> Result<StoredMessage, DecodeError> {
    let [_, _, header, body @ ..] = stored else { return Err(DecodeError::TooShort(stored.len())) };
    let compression = Compression::from_header(*header)?;
    let plain = compression.decompress(body)?;
    StoredMessage::parse(&plain).map_err(|reason| DecodeError::Protobuf { compression, reason })
}
