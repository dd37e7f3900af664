//! `rtx-kernels`: the compute floor of rustytorch.
//!
//! Plain functions over slices that the tensor engine calls: matrix multiplication through the
//! `gemm` crate ([`matmul`]), elementwise maps written so the compiler vectorizes them
//! ([`elementwise`]), row reductions ([`reduce`]), fused attention ([`attention`]), fused
//! softmax, layer/RMS norm and softmax-cross-entropy kernels ([`softmax`], [`norm`],
//! [`cross_entropy`]), bf16 conversion
//! ([`convert`]) and the thread pool they share ([`threading`]). It knows nothing about tensors,
//! autograd or transports; it depends on no other rustytorch crate. CUDA kernels will live here
//! behind the `cuda` feature.

mod dtype;
mod error;
mod float;
pub mod simd;

pub mod attention;
pub mod convert;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod cross_entropy;
pub mod elementwise;
pub mod matmul;
pub mod norm;
pub mod reduce;
pub mod softmax;
pub mod threading;

pub use dtype::{DType, Device};
pub use error::{Error, Result};
pub use float::Float;
