//! [`crate::backend::Backend`] for CUDA devices: each method is the device op of `ops.rs`,
//! `general.rs`, `views.rs`, `jepa.rs`, `packed.rs` or this module's parent.

use rtx_kernels::cuda::LatentLoss;
use rtx_kernels::DType;

use crate::backend::{Backend, LatentLossKind};
use crate::error::Result;
use crate::ops::softmax::CrossEntropyOptions;
use crate::ops::unary::GeluApprox;
use crate::storage::{CpuData, Storage};
use crate::tensor::Tensor;

/// The CUDA backend (stateless: devices are opened on first use, see [`super::device`]).
pub(crate) struct CudaBackend;

/// The one instance [`crate::backend::of_device`] hands out.
pub(crate) static CUDA: CudaBackend = CudaBackend;

impl Backend for CudaBackend {
    fn download(&self, x: &Tensor) -> Result<CpuData> {
        super::download(x)
    }
    fn upload(&self, x: &Tensor, ordinal: usize) -> Result<Tensor> {
        super::upload(x, ordinal)
    }
    fn full(&self, ordinal: usize, shape: &[usize], value: f64, dtype: DType) -> Result<Tensor> {
        super::full(ordinal, shape, value, dtype)
    }
    fn contiguous(&self, x: &Tensor) -> Result<Tensor> {
        super::views::contiguous(x)
    }
    fn clone_dense(&self, x: &Tensor) -> Result<Tensor> {
        super::ops::clone_dense(x)
    }
    fn cat(&self, tensors: &[&Tensor], dim: usize) -> Result<Tensor> {
        super::views::cat(tensors, dim)
    }
    fn narrow_grad(&self, g: &Tensor, dim: usize, start: usize, full: usize) -> Result<Tensor> {
        super::views::narrow_grad(g, dim, start, full)
    }
    fn cast(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        super::ops::cast(x, dtype)
    }
    fn download_packed(&self, parts: &[(Option<&Tensor>, usize)], total: usize, dst: &Storage, offset: usize) -> Result<()> {
        super::packed::download(parts, total, dst, offset)
    }
    fn upload_packed(&self, src: &Storage, offset: usize, total: usize, shapes: &[Vec<usize>], ordinal: usize) -> Result<Vec<Tensor>> {
        super::packed::upload(src, offset, total, shapes, ordinal)
    }
    fn pack_dense(&self, parts: &[(Option<&Tensor>, usize)], total: usize, dtype: DType, ordinal: usize) -> Result<Tensor> {
        super::packed::pack(parts, total, dtype, ordinal)
    }
    fn unpack_dense(&self, flat: &Tensor, offset: usize, shapes: &[Vec<usize>]) -> Result<Vec<Tensor>> {
        super::packed::unpack(flat, offset, shapes)
    }
    fn add_assign(&self, dst: &Tensor, src: &Tensor) -> Result<()> {
        super::ops::add_assign(dst, src)
    }
    fn copy_(&self, dst: &Tensor, src: &Tensor) -> Result<()> {
        super::ops::copy_(dst, src)
    }
    fn fill_(&self, x: &Tensor, value: f64) -> Result<()> {
        super::ops::fill_(x, value)
    }
    fn scale_(&self, x: &Tensor, k: f64) -> Result<()> {
        super::ops::scale_(x, k)
    }
    fn ema_update(&self, targets: &[Tensor], sources: &[Tensor], m: f32, one_minus_m: f32) -> Result<()> {
        super::jepa::ema_update(targets, sources, m, one_minus_m)
    }
    fn bits_checksum(&self, x: &Tensor) -> Result<u64> {
        super::ops::bits_checksum(x)
    }
    fn bits_checksums(&self, tensors: &[Tensor]) -> Result<Option<Vec<u64>>> {
        super::ops::bits_checksums(tensors)
    }
    fn linear(&self, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
        super::ops::linear(x, w, b)
    }
    fn linear_gelu_linear(&self, x: &Tensor, w1: &Tensor, b1: &Tensor, w2: &Tensor, b2: &Tensor) -> Result<Tensor> {
        super::ops::linear_gelu_linear(x, w1, b1, w2, b2)
    }
    fn layer_norm(&self, x: &Tensor, w: Option<&Tensor>, b: Option<&Tensor>, eps: f64) -> Result<Tensor> {
        super::ops::layer_norm(x, w, b, eps)
    }
    fn add_layer_norm(&self, a: &Tensor, b: &Tensor, w: Option<&Tensor>, bias: Option<&Tensor>, eps: f64) -> Result<(Tensor, Tensor)> {
        super::ops::add_layer_norm(a, b, w, bias, eps)
    }
    fn gelu(&self, x: &Tensor, approx: GeluApprox) -> Result<Tensor> {
        super::ops::gelu(x, approx)
    }
    fn mul_scalar(&self, x: &Tensor, c: f64) -> Result<Tensor> {
        super::ops::mul_scalar(x, c)
    }
    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        super::ops::add(a, b)
    }
    fn mul(&self, a: &Tensor, b: &Tensor, shape: &[usize]) -> Result<Tensor> {
        super::general::mul(a, b, shape)
    }
    fn matmul(&self, a: &Tensor, b: &Tensor, batch: &[usize]) -> Result<Tensor> {
        super::general::matmul(a, b, batch)
    }
    fn softmax(&self, x: &Tensor, log: bool) -> Result<Tensor> {
        super::general::softmax(x, log)
    }
    fn sum(&self, x: &Tensor, dims: &[usize], keepdim: bool, mean: bool) -> Result<Tensor> {
        super::general::sum(x, dims, keepdim, mean)
    }
    fn embedding(&self, weight: &Tensor, ids: &Tensor) -> Result<Tensor> {
        super::ops::embedding(weight, ids)
    }
    fn attention_packed(&self, qkv: &Tensor, heads: usize, causal: bool, scale: f64) -> Result<Tensor> {
        super::ops::attention_packed(qkv, heads, causal, scale)
    }
    fn cross_entropy(&self, logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        super::ops::cross_entropy(logits, targets)
    }
    fn linear_cross_entropy(&self, hidden: &Tensor, weight: &Tensor, targets: &Tensor, classes: usize, options: CrossEntropyOptions, chunk_rows: usize) -> Result<Tensor> {
        super::ops::linear_cross_entropy(hidden, weight, targets, classes, options, chunk_rows)
    }
    fn latent_loss(&self, pred: &Tensor, target: &Tensor, kind: LatentLossKind) -> Result<Tensor> {
        let kind = match kind {
            LatentLossKind::Squared => LatentLoss::Squared,
            LatentLossKind::SmoothL1 => LatentLoss::SmoothL1,
        };
        super::jepa::latent_loss(pred, target, kind)
    }
    fn collapse_std(&self, z: &Tensor) -> Result<f64> {
        super::jepa::feature_std(z)
    }
}
