//! Key derivation and mask expansion. A 32-byte secret (a Diffie-Hellman shared secret or a self-mask
//! seed) is hashed with SHA-256 under a domain label and the round number into a ChaCha20 key, and
//! ChaCha20's keystream, read as little-endian words, is the mask vector over Z_{2^32}. Both ends of
//! a pair derive the same key, so one adds the mask and the other subtracts it.

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha20Rng;
use sha2::{Digest, Sha256};

/// Domain label of the self-mask PRG key.
pub(crate) const DOMAIN_SELF_MASK: &[u8] = b"rtx-secagg/v1/self-mask";
/// Domain label of the pairwise-mask PRG key.
pub(crate) const DOMAIN_PAIR_MASK: &[u8] = b"rtx-secagg/v1/pair-mask";
/// Domain label of the key that encrypts shares between two clients.
pub(crate) const DOMAIN_SHARE_KEY: &[u8] = b"rtx-secagg/v1/share-key";

/// Whether a mask is added to or subtracted from the vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MaskSign {
    /// `out += mask`.
    Add,
    /// `out -= mask`.
    Subtract,
}

/// SHA-256 of `domain || round || secret`: a 32-byte key bound to its use and round.
pub(crate) fn derive_key(domain: &[u8], round: u64, secret: &[u8; 32]) -> [u8; 32] {
    let mut hasher = Sha256::new();
    hasher.update((domain.len() as u64).to_le_bytes());
    hasher.update(domain);
    hasher.update(round.to_le_bytes());
    hasher.update(secret);
    hasher.finalize().into()
}

/// Adds (or subtracts) the mask expanded from `key` to `out`, word by word, mod 2^32.
pub(crate) fn apply_mask(out: &mut [u32], key: [u8; 32], sign: MaskSign) {
    let mut rng = ChaCha20Rng::from_seed(key);
    let mut buffer = [0u8; 4096];
    for chunk in out.chunks_mut(buffer.len() / 4) {
        let bytes = &mut buffer[..chunk.len() * 4];
        rng.fill_bytes(bytes);
        for (word, b) in chunk.iter_mut().zip(bytes.chunks_exact(4)) {
            let mask = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            *word = match sign {
                MaskSign::Add => word.wrapping_add(mask),
                MaskSign::Subtract => word.wrapping_sub(mask),
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_then_subtract_cancels_and_keys_separate_domains() {
        // Goal: a mask cancels exactly against itself, and differs across domains and rounds.
        let secret = [9u8; 32];
        let mut v: Vec<u32> = (0..5000).collect();
        let key = derive_key(DOMAIN_PAIR_MASK, 3, &secret);
        apply_mask(&mut v, key, MaskSign::Add);
        assert_ne!(v, (0..5000).collect::<Vec<u32>>());
        apply_mask(&mut v, key, MaskSign::Subtract);
        assert_eq!(v, (0..5000).collect::<Vec<u32>>());
        assert_ne!(key, derive_key(DOMAIN_SELF_MASK, 3, &secret));
        assert_ne!(key, derive_key(DOMAIN_PAIR_MASK, 4, &secret));
    }
}
