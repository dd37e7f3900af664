//! `rtx-tensor`: eager tensors with tape autograd, the `nn` modules, optimizers, data readers
//! and safetensors checkpoints of rustytorch.
//!
//! Start from [`Tensor`] (creation, views, ops, `backward()`), [`nn`] (the [`nn::Module`] trait and
//! layers up to a GPT decoder and a ViT encoder) and [`optim`] (SGD, AdamW, schedules, clipping,
//! flat parameter buckets). Tensors are f32, f64 or bf16 (f32 compute) on the CPU; u32 tensors
//! hold indices and labels. Randomness comes from a [`Generator`] the caller seeds. This crate
//! knows nothing about transports, actors or processes.

mod autograd;
mod elements;
mod error;
mod gradcheck;
mod layout;
mod backend;
mod ops;
mod pool;
mod rng;
mod storage;
mod tensor;

pub mod checkpoint;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod data;
pub mod nn;
pub mod optim;
mod packed;
pub mod testing;

pub use autograd::{is_grad_enabled, no_grad, set_grad_enabled, BackwardFn, GradModeGuard};
pub use error::{Error, Result};
pub use gradcheck::{gradcheck, GradcheckReport};

pub use nn::Module;
pub use optim::Optimizer;
pub use layout::{broadcast_shape, contiguous_strides, normalize_dim, Layout};
pub use ops::softmax::{CrossEntropyOptions, Reduction, DEFAULT_IGNORE_INDEX};
pub use ops::checksum::{bits_checksums, CHECKSUM_CHUNK};
pub use packed::{download_packed, pack_dense, unpack_dense, upload_packed};
pub use ops::unary::GeluApprox;
pub use rng::{Generator, GeneratorState};
pub use rtx_kernels::{DType, Device};
pub use pool::{buffer_pool_held_bytes, buffer_pool_limit_bytes, release_buffer_pool, set_buffer_pool_limit_bytes};
pub use storage::{CpuData, Elements, ForeignOwner, Storage};
pub use tensor::{Element, FloatSlice, FloatVec, Tensor, TensorId};
