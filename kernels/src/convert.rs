//! Conversions between storage formats: bf16 ↔ f32, f32 ↔ f64, u32 → float.

use crate::elementwise::{map, map_zipped};
use crate::error::Result;
use half::bf16;

/// Widens bf16 values to f32; `dst` must have the length of `src`.
pub fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) -> Result<()> {
    map(src, dst, |x| x.to_f32())
}

/// Rounds f32 values to bf16 (round to nearest even); `dst` must have the length of `src`.
pub fn f32_to_bf16(src: &[f32], dst: &mut [bf16]) -> Result<()> {
    map(src, dst, bf16::from_f32)
}

/// Allocates the f32 widening of a bf16 slice.
pub fn bf16_vec_to_f32(src: &[bf16]) -> Vec<f32> {
    let mut out = vec![0.0f32; src.len()];
    map_zipped(src, &mut out, |x| x.to_f32());
    out
}

/// Allocates the bf16 rounding of an f32 slice.
pub fn f32_vec_to_bf16(src: &[f32]) -> Vec<bf16> {
    let mut out = vec![bf16::ZERO; src.len()];
    map_zipped(src, &mut out, bf16::from_f32);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trip_keeps_representable_values() {
        // Values with at most 8 significant bits survive f32 -> bf16 -> f32 exactly.
        let src: Vec<f32> = (0..100_000).map(|i| ((i % 256) as f32 - 128.0) * 0.5).collect();
        let back = bf16_vec_to_f32(&f32_vec_to_bf16(&src));
        assert_eq!(src, back);
    }

    #[test]
    fn bf16_rounds_to_nearest() {
        let x = 1.0f32 + 1.0 / 256.0 + 1.0 / 1024.0; // just above the halfway point
        let y = bf16_vec_to_f32(&f32_vec_to_bf16(&[x]))[0];
        assert_eq!(y, 1.0 + 1.0 / 128.0);
    }

    #[test]
    fn wrong_lengths_are_typed_errors() {
        use crate::Error;
        let mut f = [0.0f32; 2];
        let mut b = [bf16::ZERO; 4];
        assert_eq!(bf16_to_f32(&[bf16::ONE; 3], &mut f), Err(Error::LengthMismatch { op: "map", arg: "dst", expected: 3, actual: 2 }));
        assert_eq!(f32_to_bf16(&[1.0; 3], &mut b), Err(Error::LengthMismatch { op: "map", arg: "dst", expected: 3, actual: 4 }));
        assert_eq!(f32_to_bf16(&[1.0; 4], &mut b), Ok(()));
        assert_eq!(bf16_to_f32(&b[..2], &mut f), Ok(()));
        assert_eq!(f, [1.0, 1.0]);
    }
}
