//! The one device switch point. Ops are written once, on the host, above this module; when an
//! operand lives on a device, the op hands itself to that device's [`Backend`] through
//! [`of`] / [`of_device`]. A backend implements the device side of each op family (its kernels
//! and, for most, their backward; `mul` and `matmul` return values and the op records a backward
//! written in tensor ops, which the backend then serves too); an op it lacks is an
//! [`Error::UnsupportedDevice`] from the op, never a silent host result. Today there is one
//! device backend, CUDA (`cuda/backend.rs`, feature `cuda`); without the feature [`of`] is always
//! `None` and every op runs on the host. This is candle's shape (a backend per device behind one
//! trait, the op above it), and it keeps the `cfg(feature = "cuda")` sites of this crate to this
//! file, `lib.rs`, `storage.rs` (the device storage variant) and the test macro.

use crate::error::{Error, Result};
use crate::ops::softmax::CrossEntropyOptions;
use crate::ops::unary::GeluApprox;
use crate::storage::{CpuData, Storage};
use crate::tensor::Tensor;
use rtx_kernels::{DType, Device};

/// A latent regression loss ([`Backend::latent_loss`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LatentLossKind {
    /// Mean of `(pred − target)²`.
    Squared,
    /// Mean of smooth L1 with β = 1.
    SmoothL1,
}

/// The device side of the tensor ops. Every method receives operands of which at least one lives
/// on this backend's device (checked by the caller through [`of`]); shapes are checked by the op
/// above unless a method says otherwise.
pub(crate) trait Backend: Sync {
    // --- element movement ---
    /// The elements of a device tensor, contiguous, on the host (waits for the device).
    fn download(&self, x: &Tensor) -> Result<CpuData>;
    /// A host tensor copied to device `ordinal` (a fresh leaf, same dtype).
    fn upload(&self, x: &Tensor, ordinal: usize) -> Result<Tensor>;
    /// `shape` filled with `value` on device `ordinal`.
    fn full(&self, ordinal: usize, shape: &[usize], value: f64, dtype: DType) -> Result<Tensor>;
    /// A dense copy of a device view (records `contiguous`'s backward).
    fn contiguous(&self, x: &Tensor) -> Result<Tensor>;
    /// A dense copy of the whole storage under the same layout (no graph node).
    fn clone_dense(&self, x: &Tensor) -> Result<Tensor>;
    /// `tensors` joined along `dim` (checked: same device, dtype and shape off `dim`).
    fn cat(&self, tensors: &[&Tensor], dim: usize) -> Result<Tensor>;
    /// The gradient of `narrow(dim, start, ·)` of a dim of `full` elements.
    fn narrow_grad(&self, g: &Tensor, dim: usize, start: usize, full: usize) -> Result<Tensor>;
    /// A copy in another dtype (differentiable between float dtypes).
    fn cast(&self, x: &Tensor, dtype: DType) -> Result<Tensor>;
    /// [`crate::download_packed`] from device tensors.
    fn download_packed(&self, parts: &[(Option<&Tensor>, usize)], total: usize, dst: &Storage, offset: usize) -> Result<()>;
    /// [`crate::upload_packed`] to device `ordinal`.
    fn upload_packed(&self, src: &Storage, offset: usize, total: usize, shapes: &[Vec<usize>], ordinal: usize) -> Result<Vec<Tensor>>;
    /// [`crate::pack_dense`] onto device `ordinal` (parts checked by the caller).
    fn pack_dense(&self, parts: &[(Option<&Tensor>, usize)], total: usize, dtype: DType, ordinal: usize) -> Result<Tensor>;
    /// [`crate::unpack_dense`] of a device tensor (range checked by the caller).
    fn unpack_dense(&self, flat: &Tensor, offset: usize, shapes: &[Vec<usize>]) -> Result<Vec<Tensor>>;

    // --- in place, outside autograd ---
    /// `dst += src`.
    fn add_assign(&self, dst: &Tensor, src: &Tensor) -> Result<()>;
    /// `dst ← src` (rounded to `dst`'s dtype, the buffer keeps its identity).
    fn copy_(&self, dst: &Tensor, src: &Tensor) -> Result<()>;
    /// Every element to `value`.
    fn fill_(&self, x: &Tensor, value: f64) -> Result<()>;
    /// Every element times `k`.
    fn scale_(&self, x: &Tensor, k: f64) -> Result<()>;
    /// `target = m·target + (1 − m)·source` for every pair (f32 targets).
    fn ema_update(&self, targets: &[Tensor], sources: &[Tensor], m: f32, one_minus_m: f32) -> Result<()>;
    /// [`Tensor::bits_checksum`].
    fn bits_checksum(&self, x: &Tensor) -> Result<u64>;
    /// [`crate::bits_checksums`] of tensors on this device (`None`: hash them on the host).
    fn bits_checksums(&self, tensors: &[Tensor]) -> Result<Option<Vec<u64>>>;

    // --- differentiable ops ---
    /// `x · wᵀ (+ b)` over the last dimension.
    fn linear(&self, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor>;
    /// A feed-forward `linear(gelu_tanh(linear(x, w1, b1)), w2, b2)`.
    fn linear_gelu_linear(&self, x: &Tensor, w1: &Tensor, b1: &Tensor, w2: &Tensor, b2: &Tensor) -> Result<Tensor>;
    /// Layer norm over the last dimension.
    fn layer_norm(&self, x: &Tensor, w: Option<&Tensor>, b: Option<&Tensor>, eps: f64) -> Result<Tensor>;
    /// `(a + b, layer_norm(a + b))`.
    fn add_layer_norm(&self, a: &Tensor, b: &Tensor, w: Option<&Tensor>, bias: Option<&Tensor>, eps: f64) -> Result<(Tensor, Tensor)>;
    /// GELU.
    fn gelu(&self, x: &Tensor, approx: GeluApprox) -> Result<Tensor>;
    /// `x · c`.
    fn mul_scalar(&self, x: &Tensor, c: f64) -> Result<Tensor>;
    /// `a + b` (same shape, or one a suffix of the other).
    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor>;
    /// `a ⊙ b` broadcast to `shape` (the op checked dtype, device and shapes), either operand
    /// any view. Values only: [`Tensor::mul`] records the backward, in tensor ops (`mul`, and
    /// [`Backend::sum`] through `sum_to_shape` for a broadcast operand).
    fn mul(&self, a: &Tensor, b: &Tensor, shape: &[usize]) -> Result<Tensor>;
    /// `a [.., m, k] @ b [.., k, n]` with the batch dims broadcast to `batch` (checked by the op),
    /// either operand any view (transposed matrices are read in place). Values only:
    /// [`Tensor::matmul`] records the backward, itself `matmul`s of transposed views and sums.
    fn matmul(&self, a: &Tensor, b: &Tensor, batch: &[usize]) -> Result<Tensor>;
    /// Softmax, or log-softmax with `log`, along the last dimension (the op moves another dim
    /// there), recording its backward.
    fn softmax(&self, x: &Tensor, log: bool) -> Result<Tensor>;
    /// The sum over `dims` (sorted, unique and in range: checked by the op), or with `mean` the
    /// mean, recording a backward that gives the input a dense gradient.
    fn sum(&self, x: &Tensor, dims: &[usize], keepdim: bool, mean: bool) -> Result<Tensor>;
    /// Rows of `weight` at `ids`.
    fn embedding(&self, weight: &Tensor, ids: &Tensor) -> Result<Tensor>;
    /// Attention over packed `[B, T, 3·C]` rows.
    fn attention_packed(&self, qkv: &Tensor, heads: usize, causal: bool, scale: f64) -> Result<Tensor>;
    /// Mean softmax cross-entropy of `[N, V]` logits.
    fn cross_entropy(&self, logits: &Tensor, targets: &Tensor) -> Result<Tensor>;
    /// The LM head fused with the cross-entropy, chunk by chunk of rows.
    fn linear_cross_entropy(&self, hidden: &Tensor, weight: &Tensor, targets: &Tensor, classes: usize, options: CrossEntropyOptions, chunk_rows: usize) -> Result<Tensor>;
    /// The mean latent regression loss (f32 scalar).
    fn latent_loss(&self, pred: &Tensor, target: &Tensor, kind: LatentLossKind) -> Result<Tensor>;
    /// The JEPA collapse monitor of `z [B, K, C]` (waits for the device).
    fn collapse_std(&self, z: &Tensor) -> Result<f64>;
}

/// The backend of `device`: `None` for the host (and for every device in a build without one).
pub(crate) fn of_device(device: Device) -> Option<&'static dyn Backend> {
    match device {
        Device::Cpu => None,
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => Some(&crate::cuda::backend::CUDA),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => None,
    }
}

/// The backend of the first operand that lives on a device (`None`: all on the host).
pub(crate) fn of(tensors: &[&Tensor]) -> Option<&'static dyn Backend> {
    tensors.iter().find_map(|t| of_device(t.device()))
}

/// The backend of `device`, or the error an op gives when none exists for it.
pub(crate) fn required(op: &'static str, device: Device) -> Result<&'static dyn Backend> {
    of_device(device).ok_or(Error::UnsupportedDevice { op, device })
}
