//! The wire format of links: messages are rkyv archives (validated with bytecheck when read, so
//! bad bytes are an error, never undefined behaviour), carried in length-prefixed envelopes:
//!
//! ```text
//! u32 LE  length of the rest (at most MAX_ENVELOPE_BYTES)
//! u8      kind: 0 tell, 1 ask, 2 reply, 3 error reply
//! u64 LE  correlation id (asks and their replies; 0 for tells)
//! u16 LE  length of the target actor's name, then the name (UTF-8)
//! ...     body: the rkyv archive (or, for an error reply, the UTF-8 reason)
//! ```

use rkyv::api::high::{HighDeserializer, HighSerializer, HighValidator};
use rkyv::bytecheck::CheckBytes;
use rkyv::rancor;
use rkyv::ser::allocator::ArenaHandle;
use rkyv::util::AlignedVec;

use crate::error::{ActorError, Result};

/// Largest envelope a link accepts (control messages are small; tensors travel on collectives).
pub const MAX_ENVELOPE_BYTES: usize = 16 << 20;

/// Envelope kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Tell = 0,
    Ask = 1,
    Reply = 2,
    ErrorReply = 3,
}

/// A decoded envelope.
#[derive(Debug)]
pub(crate) struct Envelope {
    pub(crate) kind: Kind,
    pub(crate) correlation: u64,
    pub(crate) to: String,
    pub(crate) body: Vec<u8>,
}

const FIXED: usize = 1 + 8 + 2;

/// Archives `value` with rkyv.
pub fn encode<T>(value: &T) -> Result<Vec<u8>>
where
    T: for<'a> rkyv::Serialize<HighSerializer<AlignedVec, ArenaHandle<'a>, rancor::Error>>,
{
    rkyv::to_bytes::<rancor::Error>(value).map(|v| v.to_vec()).map_err(|e| ActorError::Codec(e.to_string()))
}

/// Validates and deserializes an rkyv archive of `T` (any alignment of `bytes`).
pub fn decode<T>(bytes: &[u8]) -> Result<T>
where
    T: rkyv::Archive,
    T::Archived: for<'a> CheckBytes<HighValidator<'a, rancor::Error>> + rkyv::Deserialize<T, HighDeserializer<rancor::Error>>,
{
    let mut aligned = AlignedVec::<16>::with_capacity(bytes.len());
    aligned.extend_from_slice(bytes);
    rkyv::from_bytes::<T, rancor::Error>(&aligned).map_err(|e| ActorError::Codec(e.to_string()))
}

impl Envelope {
    /// The envelope's bytes, length prefix included.
    pub(crate) fn to_bytes(&self) -> Result<Vec<u8>> {
        let name = self.to.as_bytes();
        let name_len = u16::try_from(name.len()).map_err(|_| ActorError::Codec(format!("actor name of {} bytes", name.len())))?;
        let rest = FIXED + name.len() + self.body.len();
        if rest > MAX_ENVELOPE_BYTES {
            return Err(ActorError::Codec(format!("envelope of {rest} bytes over the {MAX_ENVELOPE_BYTES}-byte cap")));
        }
        let mut out = Vec::with_capacity(4 + rest);
        out.extend_from_slice(&(rest as u32).to_le_bytes());
        out.push(self.kind as u8);
        out.extend_from_slice(&self.correlation.to_le_bytes());
        out.extend_from_slice(&name_len.to_le_bytes());
        out.extend_from_slice(name);
        out.extend_from_slice(&self.body);
        Ok(out)
    }

    /// Checks a length prefix before the rest is read.
    pub(crate) fn check_len(len: u32) -> std::result::Result<usize, String> {
        let len = len as usize;
        if len < FIXED {
            return Err(format!("envelope length {len} below the {FIXED}-byte minimum"));
        }
        if len > MAX_ENVELOPE_BYTES {
            return Err(format!("envelope length {len} over the {MAX_ENVELOPE_BYTES}-byte cap"));
        }
        Ok(len)
    }

    /// Parses the bytes after the length prefix.
    pub(crate) fn parse(rest: Vec<u8>) -> std::result::Result<Envelope, String> {
        if rest.len() < FIXED {
            return Err(format!("envelope of {} bytes is truncated", rest.len()));
        }
        let kind = match rest[0] {
            0 => Kind::Tell,
            1 => Kind::Ask,
            2 => Kind::Reply,
            3 => Kind::ErrorReply,
            other => return Err(format!("unknown envelope kind {other}")),
        };
        let correlation = u64::from_le_bytes(rest[1..9].try_into().map_err(|_| "truncated correlation id".to_string())?);
        let name_len = u16::from_le_bytes([rest[9], rest[10]]) as usize;
        let name_end = FIXED + name_len;
        if name_end > rest.len() {
            return Err(format!("actor name of {name_len} bytes runs past the envelope"));
        }
        let to = std::str::from_utf8(&rest[FIXED..name_end]).map_err(|_| "actor name is not UTF-8".to_string())?.to_string();
        let body = rest[name_end..].to_vec();
        Ok(Envelope { kind, correlation, to, body })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, PartialEq)]
    struct Hello {
        name: String,
        step: u64,
        losses: Vec<f64>,
    }

    #[test]
    fn messages_round_trip_and_garbage_is_an_error() {
        let hello = Hello { name: "worker-1".into(), step: 42, losses: vec![1.5, 0.25] };
        let bytes = encode(&hello).unwrap();
        assert_eq!(decode::<Hello>(&bytes).unwrap(), hello);
        // Misaligned copies decode too.
        let mut shifted = vec![0u8];
        shifted.extend_from_slice(&bytes);
        assert_eq!(decode::<Hello>(&shifted[1..]).unwrap(), hello);
        // Truncations and bit flips never panic; most are refused.
        for cut in 0..bytes.len() {
            let _ = decode::<Hello>(&bytes[..cut]);
        }
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0xff;
            let _ = decode::<Hello>(&bad);
        }
        assert!(decode::<Hello>(&[0xff; 3]).is_err());
    }

    #[test]
    fn envelopes_round_trip_and_bad_ones_are_refused() {
        let env = Envelope { kind: Kind::Ask, correlation: 7, to: "supervisor".into(), body: vec![1, 2, 3] };
        let bytes = env.to_bytes().unwrap();
        let len = u32::from_le_bytes(bytes[..4].try_into().unwrap());
        let parsed = Envelope::parse(bytes[4..4 + Envelope::check_len(len).unwrap()].to_vec()).unwrap();
        assert_eq!((parsed.kind, parsed.correlation, parsed.to.as_str(), parsed.body.as_slice()), (Kind::Ask, 7, "supervisor", &[1u8, 2, 3][..]));
        assert!(Envelope::check_len(3).is_err());
        assert!(Envelope::check_len(u32::MAX).is_err());
        let mut bad_kind = bytes[4..].to_vec();
        bad_kind[0] = 9;
        assert!(Envelope::parse(bad_kind).unwrap_err().contains("unknown envelope kind"));
        let mut long_name = bytes[4..].to_vec();
        long_name[9] = 200;
        assert!(Envelope::parse(long_name).unwrap_err().contains("runs past"));
    }
}
