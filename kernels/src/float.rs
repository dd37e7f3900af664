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
}

impl Float for f32 {
    fn from_f64_lossy(v: f64) -> Self {
        v as f32
    }
    fn to_f64_lossless(self) -> f64 {
        self as f64
    }
    const IS_F32: bool = true;
}

impl Float for f64 {
    fn from_f64_lossy(v: f64) -> Self {
        v
    }
    fn to_f64_lossless(self) -> f64 {
        self
    }
    const IS_F32: bool = false;
}
