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
    /// Folds `bytes` in.
    pub fn absorb(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
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
}
