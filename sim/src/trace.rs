//! The trace hash: an order-sensitive 64-bit digest of everything the network did (who sent how
//! many bytes with which content to whom, and when, in virtual nanoseconds). Equal seeds must give
//! equal hashes; a difference pinpoints nondeterminism.

/// An order-sensitive FNV-1a digest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceHash(u64);

impl Default for TraceHash {
    fn default() -> Self {
        TraceHash(0xcbf2_9ce4_8422_2325)
    }
}

impl TraceHash {
    /// Folds `bytes` in: eight bytes (a little-endian word) per FNV round, then the tail byte by
    /// byte, then the length (so `[1]` and `[1, 0]` differ). Word rounds keep tracing whole
    /// gradient frames cheap.
    pub fn absorb(&mut self, bytes: &[u8]) {
        let mut words = bytes.chunks_exact(8);
        for word in &mut words {
            let mut w = [0u8; 8];
            w.copy_from_slice(word);
            self.0 = (self.0 ^ u64::from_le_bytes(w)).wrapping_mul(0x100_0000_01b3);
        }
        for &b in words.remainder() {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
        self.0 = (self.0 ^ bytes.len() as u64).wrapping_mul(0x100_0000_01b3);
    }

    /// Folds a number in.
    pub fn absorb_u64(&mut self, v: u64) {
        self.absorb(&v.to_le_bytes());
    }

    /// The digest so far.
    pub fn value(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_matters() {
        let (mut a, mut b) = (TraceHash::default(), TraceHash::default());
        a.absorb_u64(1);
        a.absorb_u64(2);
        b.absorb_u64(2);
        b.absorb_u64(1);
        assert_ne!(a, b);
    }

    // Goal: every byte counts, in words and in the tail, and trailing zeros too.
    #[test]
    fn every_byte_counts() {
        let digest = |bytes: &[u8]| {
            let mut h = TraceHash::default();
            h.absorb(bytes);
            h.value()
        };
        let base: Vec<u8> = (0..19).collect();
        for i in 0..base.len() {
            let mut changed = base.clone();
            changed[i] ^= 1;
            assert_ne!(digest(&base), digest(&changed), "byte {i}");
        }
        assert_ne!(digest(&[1]), digest(&[1, 0]));
    }
}
