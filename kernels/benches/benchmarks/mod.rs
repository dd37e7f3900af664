//! The bench groups and the deterministic inputs they share.

pub(crate) mod ijepa;
pub(crate) mod matmul;
pub(crate) mod norm;
pub(crate) mod softmax;

/// `n` reproducible values in about [-1, 1) (an LCG, so no RNG dependency and no seed to pass).
pub(crate) fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}
