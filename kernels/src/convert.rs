//! Conversions between storage formats: bf16 ↔ f32, f32 ↔ f64, u32 → float.

use crate::elementwise::map;
use half::bf16;

/// Widens bf16 values to f32.
pub fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) {
    map(src, dst, |x| x.to_f32());
}

/// Rounds f32 values to bf16 (round to nearest even).
pub fn f32_to_bf16(src: &[f32], dst: &mut [bf16]) {
    map(src, dst, bf16::from_f32);
}

/// Allocates the f32 widening of a bf16 slice.
pub fn bf16_vec_to_f32(src: &[bf16]) -> Vec<f32> {
    let mut out = vec![0.0f32; src.len()];
    bf16_to_f32(src, &mut out);
    out
}

/// Allocates the bf16 rounding of an f32 slice.
pub fn f32_vec_to_bf16(src: &[f32]) -> Vec<bf16> {
    let mut out = vec![bf16::ZERO; src.len()];
    f32_to_bf16(src, &mut out);
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
}
