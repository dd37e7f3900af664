//! Fixed-point quantisation of float updates into Z_{2^32}, and back. A value is clipped to
//! `[-clip, clip]`, scaled by `2^scale_bits`, rounded to the nearest integer and stored as the two's
//! complement `u32` of that integer. Sums wrap mod 2^32; they decode exactly (as an `i32`) as long as
//! the true integer sum stays in `[-(2^31 - 1), 2^31 - 1]`, which `QuantConfig::new` guarantees for up
//! to `max_clients` summands: `max_clients * round(clip * 2^scale_bits) <= 2^31 - 1`.

use crate::error::{FedError, Result};

/// Largest magnitude of an integer sum that still decodes unambiguously from Z_{2^32} as an `i32`.
pub const SUM_MAGNITUDE_MAX: u64 = (1 << 31) - 1;

/// How floats map to fixed point, and for how many summands the sum provably does not overflow.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct QuantConfig {
    /// Values are clipped to `[-clip, clip]` before quantisation.
    pub clip: f32,
    /// The fixed-point scale is `2^scale_bits`.
    pub scale_bits: u32,
    /// The most clients whose quantised updates may be summed.
    pub max_clients: u64,
}

impl QuantConfig {
    /// Checks that `max_clients` quantised values of magnitude at most `clip * 2^scale_bits` sum to
    /// at most `2^31 - 1` in magnitude, so the wrapped sum in Z_{2^32} decodes exactly.
    pub fn new(clip: f32, scale_bits: u32, max_clients: u64) -> Result<Self> {
        if !(clip.is_finite() && clip > 0.0) {
            return Err(config_err("secagg.clip", format!("must be finite and > 0, got {clip}")));
        }
        if scale_bits > 30 {
            return Err(config_err("secagg.scale_bits", format!("must be <= 30, got {scale_bits}")));
        }
        if max_clients == 0 {
            return Err(config_err("secagg.max_clients", "must be >= 1".to_string()));
        }
        let quant = QuantConfig { clip, scale_bits, max_clients };
        let level_max = quant.level_max();
        match level_max.checked_mul(max_clients) {
            Some(bound) if bound <= SUM_MAGNITUDE_MAX => Ok(quant),
            _ => Err(config_err(
                "secagg.scale_bits",
                format!("{max_clients} clients x level {level_max} (clip {clip} x 2^{scale_bits}) exceeds 2^31 - 1: the sum in Z_2^32 would overflow"),
            )),
        }
    }

    /// The finest scale (most `scale_bits`) for which `max_clients` updates clipped to `clip` cannot
    /// overflow.
    pub fn finest(clip: f32, max_clients: u64) -> Result<Self> {
        let mut best = None;
        for bits in 0..=30 {
            if let Ok(q) = Self::new(clip, bits, max_clients) {
                best = Some(q);
            }
        }
        best.ok_or_else(|| config_err("secagg.max_clients", format!("{max_clients} clients with clip {clip} overflow Z_2^32 even at scale 1")))
    }

    /// The fixed-point scale `2^scale_bits`.
    pub fn scale(&self) -> f64 {
        (1u64 << self.scale_bits) as f64
    }

    /// The largest quantised magnitude one value can have: `round(clip * 2^scale_bits)`.
    pub fn level_max(&self) -> u64 {
        (f64::from(self.clip) * self.scale()).round() as u64
    }

    /// Quantises one finite value (clipped to `[-clip, clip]`) to its two's-complement word.
    pub fn quantize(&self, value: f32) -> u32 {
        debug_assert!(value.is_finite());
        let level_max = self.level_max() as i64;
        let level = (f64::from(value) * self.scale()).round() as i64;
        level.clamp(-level_max, level_max) as i32 as u32
    }

    /// Decodes a (wrapped) sum of quantised values back to a float.
    pub fn decode(&self, word: u32) -> f32 {
        (f64::from(word as i32) / self.scale()) as f32
    }
}

fn config_err(field: &str, reason: String) -> FedError {
    FedError::Config { field: field.to_string(), reason }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bound_is_enforced_and_round_trip_is_exact() {
        // Goal: the overflow bound refuses configs that could wrap, and values round-trip to the grid.
        assert!(QuantConfig::new(1.0, 17, 10_000).is_ok());
        assert!(QuantConfig::new(1.0, 18, 10_000).is_err());
        let q = QuantConfig::finest(1.0, 10_000).unwrap();
        assert_eq!(q.scale_bits, 17);
        assert_eq!(q.decode(q.quantize(0.5)), 0.5);
        assert_eq!(q.decode(q.quantize(-7.0)), -1.0);
        let sum = (0..10_000).fold(0u32, |acc, _| acc.wrapping_add(q.quantize(-3.0)));
        assert_eq!(q.decode(sum), -10_000.0);
    }
}
