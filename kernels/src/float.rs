//! The floating-point element trait the generic kernels are written against (f32 and f64).

use std::iter::Sum;

/// A floating-point element that the CPU kernels compute in: `f32` or `f64`.
pub trait Float:
    num_traits::Float + num_traits::FromPrimitive + Sum + Default + Send + Sync + Copy + 'static + std::fmt::Debug
{
    /// Converts from f64 (rounding for f32).
    fn from_f64_lossy(v: f64) -> Self;
    /// Converts to f64.
    fn to_f64_lossless(self) -> f64;
    /// Whether this is f32 (for picking gemm paths).
    const IS_F32: bool;
    /// tanh, branch-free so that loops over it vectorize. For f32 a rational approximation
    /// (Eigen's `generic_fast_tanh_float`): max abs error 5e-7 (4 ulp near ±1), 10–15× faster than
    /// libm's `tanhf`, which does not vectorize. For f64 the exact `tanh`.
    fn fast_tanh(self) -> Self;
    /// The error function `erf(x) = 2/√π ∫₀ˣ e^(−t²) dt` (libm's `erff`/`erf`, within 1 ulp), for
    /// the exact GELU `x·Φ(x) = x/2·(1 + erf(x/√2))` PyTorch uses by default.
    fn erf(self) -> Self;
    /// eˣ, branch-free so that loops over it vectorize. For f32 Cephes' `expf` polynomial:
    /// relative error below 2.5e-7 where the result is a normal f32, 0 where it would be
    /// denormal (x < −87.33), ±∞ and NaN as `exp`; about 10× faster than libm's `expf` in a
    /// vectorized loop. For f64 the exact `exp`.
    fn fast_exp(self) -> Self;
}

impl Float for f32 {
    fn from_f64_lossy(v: f64) -> Self {
        v as f32
    }
    fn to_f64_lossless(self) -> f64 {
        self as f64
    }
    const IS_F32: bool = true;
    #[inline(always)]
    fn fast_tanh(self) -> Self {
        fast_tanh_f32(self)
    }
    #[inline(always)]
    fn erf(self) -> Self {
        libm::erff(self)
    }
    #[inline(always)]
    fn fast_exp(self) -> Self {
        fast_exp_f32(self)
    }
}

impl Float for f64 {
    fn from_f64_lossy(v: f64) -> Self {
        v
    }
    fn to_f64_lossless(self) -> f64 {
        self
    }
    const IS_F32: bool = false;
    #[inline(always)]
    fn fast_tanh(self) -> Self {
        self.tanh()
    }
    #[inline(always)]
    fn erf(self) -> Self {
        libm::erf(self)
    }
    #[inline(always)]
    fn fast_exp(self) -> Self {
        self.exp()
    }
}

/// Eigen's rational tanh for f32: odd degree-13 numerator over even degree-6 denominator on the
/// input clamped to ±7.9053 (where tanh rounds to ±1), and `x` itself below 4e-4.
// The coefficients are Eigen's, digit for digit, so they can be checked against the source.
#[allow(clippy::excessive_precision)]
#[inline(always)]
fn fast_tanh_f32(a: f32) -> f32 {
    const CLAMP: f32 = 7.905_311;
    const TINY: f32 = 0.0004;
    let x = a.clamp(-CLAMP, CLAMP);
    let x2 = x * x;
    let mut p = x2 * -2.760_768_5e-16 + 2.000_187_9e-13;
    p = x2 * p + -8.604_671_5e-11;
    p = x2 * p + 5.122_297e-8;
    p = x2 * p + 1.485_722_4e-5;
    p = x2 * p + 6.372_619_3e-4;
    p = x2 * p + 4.893_524_6e-3;
    p *= x;
    let mut q = x2 * 1.198_258_4e-6 + 1.185_347e-4;
    q = x2 * q + 2.268_434_6e-3;
    q = x2 * q + 4.893_525e-3;
    if a.abs() < TINY {
        a
    } else {
        p / q
    }
}

/// Cephes' `expf` without branches: `n = round(x·log2 e)` (by the 1.5·2²³ rounding trick, so it
/// needs no SSE4.1), `r = x − n·ln 2` in two parts (the first exact), a degree-6 polynomial by
/// Horner's rule in fused multiply-adds, then `·2^⌊n/2⌋·2^(n−⌊n/2⌋)`: two normal factors, so
/// overflow gives ∞. Results below the smallest normal f32 (x < −87.33) are flushed to 0 instead
/// of computed as denormals: an operation that produces a denormal costs a microcode assist of
/// ~100 cycles on x86, and a softmax feeds −∞ (masked and padded scores) through here. Only
/// exactly rounded operations and true `mul_add`s, so every ISA gives the same bits (without FMA
/// hardware `mul_add` is libm's `fmaf`: slow, but the same result).
#[allow(clippy::excessive_precision)]
#[inline(always)]
fn fast_exp_f32(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_375;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0;
    const LOWEST: f32 = -87.33;
    let xc = x.clamp(LOWEST, 88.73);
    let t = xc.mul_add(std::f32::consts::LOG2_E, ROUND);
    let n = t - ROUND;
    let ni = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, xc));
    let mut p = 1.987_569_15e-4f32;
    p = p.mul_add(r, 1.398_199_950_7e-3);
    p = p.mul_add(r, 8.333_451_907_3e-3);
    p = p.mul_add(r, 4.166_579_589_4e-2);
    p = p.mul_add(r, 1.666_666_545_9e-1);
    p = p.mul_add(r, 5.000_000_120_1e-1);
    let y = (p * r).mul_add(r, r) + 1.0;
    let e1 = ni >> 1;
    let e2 = ni - e1;
    let s1 = f32::from_bits(((e1 + 127) as u32) << 23);
    let s2 = f32::from_bits(((e2 + 127) as u32) << 23);
    let e = y * s1 * s2;
    if x < LOWEST {
        0.0
    } else {
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_tanh_f32_is_within_5e_7_of_exact_tanh() {
        // Goal: the approximation's documented bound holds on a dense grid over and past the
        // clamp, it is odd, saturates to ±1, and passes NaN through.
        let mut worst = 0f64;
        let mut x = -12.0f32;
        while x < 12.0 {
            let err = (x.fast_tanh() as f64 - (x as f64).tanh()).abs();
            worst = worst.max(err);
            assert_eq!(x.fast_tanh(), -(-x).fast_tanh(), "not odd at {x}");
            x += 1.0e-4;
        }
        assert!(worst <= 5.0e-7, "worst abs error {worst:e}");
        assert_eq!(1.0e-5f32.fast_tanh(), 1.0e-5);
        assert!((f32::INFINITY.fast_tanh() - 1.0).abs() <= 1.0e-6);
        assert!((f32::NEG_INFINITY.fast_tanh() + 1.0).abs() <= 1.0e-6);
        assert!(f32::NAN.fast_tanh().is_nan());
        assert_eq!(0.3f64.fast_tanh(), 0.3f64.tanh());
    }

    #[test]
    fn fast_exp_f32_is_within_2_5e_7_relative_of_exact_exp() {
        // Goal: the vectorizable exp keeps its documented bound on a dense grid over the whole
        // range of normal results, flushes below it to 0, overflows to ∞, passes NaN, and f64
        // is the exact exp.
        let mut worst = 0f64;
        let mut x = -87.3f32;
        while x < 88.7 {
            let exact = (x as f64).exp();
            worst = worst.max(((x.fast_exp() as f64) - exact).abs() / exact);
            x += 3.0e-4;
        }
        assert!(worst <= 2.5e-7, "worst relative error {worst:e}");
        for x in [-1.0e-9f32, 0.0, -0.0, 1.0e-9] {
            assert_eq!(x.fast_exp(), 1.0, "exp({x})");
        }
        // Results below the normal range flush to zero; the last normal ones do not.
        assert!((-87.3f32).fast_exp() >= f32::MIN_POSITIVE);
        for x in [-87.34f32, -88.0, -95.0, -105.0] {
            assert_eq!(x.fast_exp(), 0.0, "exp({x})");
        }
        assert_eq!(f32::NEG_INFINITY.fast_exp(), 0.0);
        assert_eq!(89.0f32.fast_exp(), f32::INFINITY);
        assert_eq!(f32::INFINITY.fast_exp(), f32::INFINITY);
        assert!(f32::NAN.fast_exp().is_nan());
        assert_eq!(0.3f64.fast_exp(), 0.3f64.exp());
    }

    #[test]
    fn erf_matches_tabulated_values() {
        // Goal: the erf behind the exact GELU agrees with tabulated values (Abramowitz & Stegun
        // table 7.1) in f64 to 1e-15 and in f32 to 1e-7, is odd, and saturates.
        let table: [(f64, f64); 5] = [(0.0, 0.0), (0.1, 0.112_462_916_018_284_9), (0.5, 0.520_499_877_813_046_5), (1.0, 0.842_700_792_949_714_9), (2.0, 0.995_322_265_018_952_7)];
        for (x, want) in table {
            assert!((Float::erf(x) - want).abs() < 1e-15, "erf({x})");
            assert!((Float::erf(-x) + want).abs() < 1e-15, "erf(-{x})");
            assert!((Float::erf(x as f32) as f64 - want).abs() < 1e-7, "erff({x})");
        }
        assert_eq!(Float::erf(10.0f32), 1.0);
        assert_eq!(Float::erf(f64::NEG_INFINITY), -1.0);
    }
}
