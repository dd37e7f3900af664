//! NCCL between GPUs, bootstrapped over our own control plane.
//!
//! This module is always compiled: the **unique id exchange** ([`exchange_unique_id`]) runs on any
//! host [`Communicator`] (in-process, shared memory, QUIC), so CI tests it without a GPU. The
//! device communicator itself, `NcclCommunicator`, lives in `comm.rs` behind the `nccl` feature
//! (which turns on `rtx-kernels/cuda`).
//!
//! The exchange: group rank 0 makes a 128-byte `ncclUniqueId` (with `ncclGetUniqueId`, or whatever
//! the caller passes in tests) and broadcasts it over the host communicator as one message of
//! 32-bit words, [`ID_MESSAGE_WORDS`] long: magic, format version, status, group size, id length,
//! the id's 32 words, and a CRC-32 of everything before it. Every rank checks the message and gets
//! the identical id, or a typed error: [`Error::InvalidNcclId`] for a malformed message (wrong
//! length, magic, version, size or checksum), [`Error::NcclIdUnavailable`] when rank 0 could not
//! make an id. Rank 0 broadcasts a failure status instead of staying silent, so the other ranks
//! fail at once rather than after the operation timeout. The host communicator's generation
//! guards the exchange like any other collective.

#[cfg(feature = "nccl")]
mod comm;

use tracing::Instrument;

use crate::communicator::Communicator;
use crate::error::{Error, Result};

#[cfg(feature = "nccl")]
pub use comm::{nccl_unique_id, probe_nccl, NcclCommunicator, NcclElement, NcclOptions, NCCL_MIN_VERSION};

/// Bytes in an NCCL unique id (`NCCL_UNIQUE_ID_BYTES` in `nccl.h`).
pub const NCCL_UNIQUE_ID_BYTES: usize = 128;

/// 32-bit words in the control-plane message carrying a unique id (see the module doc).
pub const ID_MESSAGE_WORDS: usize = HEADER_WORDS + ID_WORDS + 1;

const ID_WORDS: usize = NCCL_UNIQUE_ID_BYTES / 4;
const HEADER_WORDS: usize = 5;
/// "NCID", little-endian.
const ID_MAGIC: u32 = u32::from_le_bytes(*b"NCID");
const ID_FORMAT_VERSION: u32 = 1;
const STATUS_OK: u32 = 0;
const STATUS_NCCL_NOT_FOUND: u32 = 1;
const STATUS_ROOT_FAILED: u32 = 2;

const _: () = assert!(NCCL_UNIQUE_ID_BYTES % 4 == 0);
const _: () = assert!(ID_MESSAGE_WORDS == 38);

/// An NCCL unique id: the 128 opaque bytes that name one NCCL communicator to all its ranks.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclUniqueId([u8; NCCL_UNIQUE_ID_BYTES]);

impl NcclUniqueId {
    /// The id from exactly [`NCCL_UNIQUE_ID_BYTES`] bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let array: [u8; NCCL_UNIQUE_ID_BYTES] =
            bytes.try_into().map_err(|_| Error::InvalidNcclId { reason: "unique id must be 128 bytes", len: bytes.len() })?;
        Ok(NcclUniqueId(array))
    }

    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8; NCCL_UNIQUE_ID_BYTES] {
        &self.0
    }
}

impl std::fmt::Debug for NcclUniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclUniqueId(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "..)")
    }
}

/// The message group rank 0 broadcasts: `id`, or the status saying why there is none.
pub fn encode_id_message(id: std::result::Result<&NcclUniqueId, &Error>, n_ranks: usize) -> [u32; ID_MESSAGE_WORDS] {
    let mut words = [0u32; ID_MESSAGE_WORDS];
    let status = match id {
        Ok(_) => STATUS_OK,
        Err(Error::NcclNotFound) => STATUS_NCCL_NOT_FOUND,
        Err(_) => STATUS_ROOT_FAILED,
    };
    words[0] = ID_MAGIC;
    words[1] = ID_FORMAT_VERSION;
    words[2] = status;
    words[3] = u32::try_from(n_ranks).unwrap_or(u32::MAX);
    words[4] = NCCL_UNIQUE_ID_BYTES as u32;
    if let Ok(id) = id {
        for (word, bytes) in words[HEADER_WORDS..HEADER_WORDS + ID_WORDS].iter_mut().zip(id.0.chunks_exact(4)) {
            *word = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        }
    }
    words[ID_MESSAGE_WORDS - 1] = checksum(&words[..ID_MESSAGE_WORDS - 1]);
    words
}

/// Checks a received message and returns the id it carries (see the module doc for the errors).
pub fn decode_id_message(words: &[u32], n_ranks: usize) -> Result<NcclUniqueId> {
    let len = words.len();
    if len != ID_MESSAGE_WORDS {
        return Err(Error::InvalidNcclId { reason: "message has the wrong length", len });
    }
    if words[ID_MESSAGE_WORDS - 1] != checksum(&words[..ID_MESSAGE_WORDS - 1]) {
        return Err(Error::InvalidNcclId { reason: "checksum mismatch", len });
    }
    if words[0] != ID_MAGIC {
        return Err(Error::InvalidNcclId { reason: "bad magic", len });
    }
    if words[1] != ID_FORMAT_VERSION {
        return Err(Error::InvalidNcclId { reason: "unknown format version", len });
    }
    if u32::try_from(n_ranks).ok() != Some(words[3]) {
        return Err(Error::InvalidNcclId { reason: "made for a group of another size", len });
    }
    if words[4] as usize != NCCL_UNIQUE_ID_BYTES {
        return Err(Error::InvalidNcclId { reason: "declared id length is not 128 bytes", len });
    }
    match words[2] {
        STATUS_OK => {}
        STATUS_NCCL_NOT_FOUND => return Err(Error::NcclIdUnavailable { reason: "NCCL library not found on rank 0" }),
        STATUS_ROOT_FAILED => return Err(Error::NcclIdUnavailable { reason: "ncclGetUniqueId failed on rank 0" }),
        _ => return Err(Error::InvalidNcclId { reason: "unknown status", len }),
    }
    let mut id = [0u8; NCCL_UNIQUE_ID_BYTES];
    for (bytes, word) in id.chunks_exact_mut(4).zip(&words[HEADER_WORDS..HEADER_WORDS + ID_WORDS]) {
        bytes.copy_from_slice(&word.to_le_bytes());
    }
    Ok(NcclUniqueId(id))
}

/// Collective over `host`: group rank 0 calls `make_id` and broadcasts the result; every rank
/// returns the same id, or the same error kind (rank 0 returns its own error from `make_id`).
/// Other ranks never call `make_id`.
pub async fn exchange_unique_id<F>(host: &Communicator, make_id: F) -> Result<NcclUniqueId>
where
    F: FnOnce() -> Result<NcclUniqueId>,
{
    let n_ranks = host.size();
    let span = tracing::debug_span!("nccl_id_exchange", group = host.group_id(), generation = host.generation(), rank = host.rank(), n_ranks);
    let mut words = [0u32; ID_MESSAGE_WORDS];
    let made = if host.rank() == 0 {
        let made = make_id();
        words = encode_id_message(made.as_ref(), n_ranks);
        Some(made)
    } else {
        None
    };
    host.broadcast(&mut words, 0).instrument(span).await?;
    match made {
        Some(made) => {
            let id = made?;
            // The root checks its own message too: what it sent is what every rank decodes.
            let decoded = decode_id_message(&words, n_ranks)?;
            debug_assert_eq!(decoded, id);
            Ok(id)
        }
        None => decode_id_message(&words, n_ranks),
    }
}

/// CRC-32 of the words' little-endian bytes.
fn checksum(words: &[u32]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    for w in words {
        hasher.update(&w.to_le_bytes());
    }
    hasher.finalize()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    // Goal: encode/decode round-trip, and every single-bit flip of the message is refused.
    #[test]
    fn message_round_trip_and_bit_flips() {
        let id = NcclUniqueId::from_bytes(&(0..128u8).map(|i| i.wrapping_mul(37)).collect::<Vec<_>>()).unwrap();
        let words = encode_id_message(Ok(&id), 4);
        assert_eq!(decode_id_message(&words, 4).unwrap(), id);
        for word in 0..ID_MESSAGE_WORDS {
            for bit in 0..32 {
                let mut bad = words;
                bad[word] ^= 1 << bit;
                assert!(matches!(decode_id_message(&bad, 4), Err(Error::InvalidNcclId { .. })), "flip {word}:{bit} accepted");
            }
        }
    }
}
