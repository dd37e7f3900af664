//! The CUDA backend of `rtx-kernels` (feature `cuda`): a [`Device`] with its stream, a caching
//! allocator handing out [`Buffer`]s, pinned host buffers, cuBLAS GEMM ([`Gemm`]: f32, TF32,
//! bf16, batched), and NVRTC kernels for elementwise ops, softmax, norms, cross-entropy,
//! embedding, AdamW and flash attention ([`FlashSpec`]; f32, and bf16 on tensor cores), and the
//! general tensor ops in f32 and bf16 (`tensor_ops`: strided broadcast binary ops, row softmax and
//! log-softmax, axis sums).
//!
//! cudarc loads the driver and libraries at run time, so this compiles on machines without CUDA;
//! a missing driver or library is a [`CudaError`], never a panic. The kernels here are the same
//! operations as the CPU kernels of this crate, on device buffers; `kernels/examples/gpu_check.rs`
//! checks each against its CPU twin (`scripts/gpu-check.sh` runs it on a GPU machine). The
//! `mixed` module holds the f32/bf16 kernels GPU tensors in `rtx-tensor` train with. Not here yet:
//! several streams.

mod alloc;
mod attention;
mod blas;
mod blas_lt;
mod device;
mod error;
mod jepa;
mod mixed;
mod nvrtc;
mod ops;
mod tensor_ops;

pub use alloc::{Buffer, DeviceElem, MemoryStats, PinnedBuffer};
pub use attention::FlashSpec;
pub use blas::{ColumnMajorCall, Gemm, GemmElem, GemmMath};
pub use blas_lt::Epilogue;
pub use device::{probe_libraries, Device, STAGING_BYTES};
pub use error::{CudaError, Result};
pub use jepa::{EmaPair, LatentLoss, StridedSide, MAX_COPY_DIMS};
pub use mixed::{AdamWTensor, HeadLayout, StorageElem, FUSED_NORM_MAX};
pub use nvrtc::compile_all;
pub use ops::{broadcast_shape, AdamW, BinaryOp, UnaryOp, MAX_BROADCAST_DIMS};
pub use tensor_ops::MAX_BINARY_DIMS;

/// The cudarc crate this backend is built on, for callers that benchmark against raw cuBLAS.
pub use cudarc;
