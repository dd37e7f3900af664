//! Device kernels that let a JEPA step (and any model that reshapes its activations) run on the
//! GPU without a trip through the host: strided copies of views ([`Device::strided_copy`]: what
//! `contiguous()`, `cat` and the gradient of `narrow` need), the latent regression losses with
//! their gradient ([`Device::latent_loss`], [`Device::latent_loss_backward`]: mean squared error
//! and smooth L1), the collapse monitor ([`Device::feature_std`]) and the EMA of a whole encoder
//! in one launch ([`Device::ema_multi`]). The kernels are in `mixed.cu`; every reduction is
//! two-pass and deterministic, and the EMA is bit-exact with the host's f32 arithmetic.

use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

use super::alloc::{Buffer, DeviceElem};
use super::device::Device;
use super::error::{check_len, CudaError, OpContext, Result};
use super::mixed::StorageElem;
use super::nvrtc::Module;

/// Largest rank of a strided copy (the kernel's `MAX_COPY_DIMS`).
pub const MAX_COPY_DIMS: usize = 8;
/// Threads per block of these kernels.
const BLOCK: u32 = 256;
/// Upper bound on grid-stride blocks.
const MAX_BLOCKS: usize = 132 * 8;

/// One side of a strided copy: element strides and the offset of the first element.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StridedSide<'a> {
    /// Strides in elements, one per dimension of the copied shape.
    pub strides: &'a [usize],
    /// Offset of element `[0, …, 0]` in elements.
    pub offset: usize,
}

/// Mirrors `CopyDims` in mixed.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct CopyDims {
    shape: [i64; MAX_COPY_DIMS],
    src_stride: [i64; MAX_COPY_DIMS],
    dst_stride: [i64; MAX_COPY_DIMS],
    src_offset: i64,
    dst_offset: i64,
    n: i64,
    ndim: i32,
}

// SAFETY: plain old data with the field order, types and alignment of the kernel's `CopyDims`.
unsafe impl DeviceRepr for CopyDims {}

/// A latent regression loss ([`Device::latent_loss`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LatentLoss {
    /// Mean of `d²`.
    Squared,
    /// Mean of smooth L1 with β = 1: `0.5·d²` where `|d| < 1`, else `|d| − 0.5`.
    SmoothL1,
}

impl LatentLoss {
    fn code(self) -> i32 {
        match self {
            LatentLoss::Squared => 0,
            LatentLoss::SmoothL1 => 1,
        }
    }
}

/// One tensor of [`Device::ema_multi`]: the f32 EMA state and the source it follows.
pub struct EmaPair<'a, S: StorageElem> {
    /// The f32 target (updated in place).
    pub target: &'a mut Buffer<f32>,
    /// The source (the online encoder's parameter), f32 or bf16.
    pub source: &'a Buffer<S>,
}

fn grid_stride(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, MAX_BLOCKS) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

fn i64_of(op: &'static str, v: usize) -> Result<i64> {
    i64::try_from(v).map_err(|_| CudaError::Unsupported { op, what: format!("{v} exceeds i64") })
}

fn i32_of(op: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| CudaError::Unsupported { op, what: format!("{v} exceeds i32") })
}

/// The highest element index a side touches over `shape`, plus one (0 for an empty shape).
pub(super) fn extent(shape: &[usize], side: &StridedSide<'_>) -> usize {
    if shape.contains(&0) {
        return 0;
    }
    side.offset + shape.iter().zip(side.strides).map(|(&n, &s)| (n - 1) * s).sum::<usize>() + 1
}

impl Device {
    /// Copies the region `shape` of `src` (read through `from`'s strides and offset) into `dst`
    /// (written through `to`'s). Elements of 2 or 4 bytes (bf16, f32, u32) are copied as raw bits.
    /// Both sides must lie inside their buffers; the destination's elements must not overlap.
    pub fn strided_copy<T: DeviceElem>(&self, src: &Buffer<T>, from: StridedSide<'_>, dst: &mut Buffer<T>, to: StridedSide<'_>, shape: &[usize]) -> Result<()> {
        const OP: &str = "strided_copy";
        if shape.len() > MAX_COPY_DIMS || from.strides.len() != shape.len() || to.strides.len() != shape.len() {
            return Err(CudaError::Unsupported { op: OP, what: format!("{} dimensions with {} and {} strides (at most {MAX_COPY_DIMS})", shape.len(), from.strides.len(), to.strides.len()) });
        }
        check_len(OP, "src", src.len(), extent(shape, &from))?;
        check_len(OP, "dst", dst.len(), extent(shape, &to))?;
        let n: usize = shape.iter().product();
        if n == 0 {
            return Ok(());
        }
        let mut d = CopyDims { n: i64_of(OP, n)?, ndim: i32_of(OP, shape.len())?, src_offset: i64_of(OP, from.offset)?, dst_offset: i64_of(OP, to.offset)?, ..CopyDims::default() };
        for (k, &len) in shape.iter().enumerate() {
            d.shape[k] = i64_of(OP, len)?;
            d.src_stride[k] = i64_of(OP, from.strides[k])?;
            d.dst_stride[k] = i64_of(OP, to.strides[k])?;
        }
        let name = match std::mem::size_of::<T>() {
            2 => "strided_copy_u16",
            4 => "strided_copy_u32",
            other => return Err(CudaError::Unsupported { op: OP, what: format!("{other}-byte elements") }),
        };
        let f = self.function(Module::Mixed, name)?;
        let (sp, dp) = (src.device_ptr(), dst.device_ptr());
        let mut l = self.stream().launch_builder(&f);
        l.arg(&sp).arg(&dp).arg(&d);
        // SAFETY: every index the kernel forms lies below the extents checked above; `CopyDims`
        // mirrors the kernel's struct.
        unsafe { l.launch(grid_stride(n)) }.op(OP)?;
        Ok(())
    }

    /// `out[0] = mean over i of l(pred[i] − target[i])` (queued; f32 accumulation, fixed order).
    pub fn latent_loss<T: StorageElem>(&self, pred: &Buffer<T>, target: &Buffer<T>, kind: LatentLoss, out: &mut Buffer<f32>) -> Result<()> {
        const OP: &str = "latent_loss";
        let n = pred.len();
        check_len(OP, "target", target.len(), n)?;
        check_len(OP, "out", out.len(), 1)?;
        let cfg = grid_stride(n);
        let blocks = cfg.grid_dim.0 as usize;
        let partials = self.alloc::<f32>(blocks)?;
        let name = if T::IS_BF16 { "latent_loss_partials_bf16" } else { "latent_loss_partials_f32" };
        let f = self.function(Module::Mixed, name)?;
        let (pp, tp, np, kind, pa) = (pred.device_ptr(), target.device_ptr(), i64_of(OP, n)?, kind.code(), partials.device_ptr());
        let mut l = self.stream().launch_builder(&f);
        l.arg(&pp).arg(&tp).arg(&np).arg(&kind).arg(&pa);
        // SAFETY: pred and target hold n elements, partials one f32 per block of the grid.
        unsafe { l.launch(cfg) }.op(OP)?;
        let f = self.function(Module::Mixed, "latent_loss_finish")?;
        let (nb, inv, op_) = (i32_of(OP, blocks)?, if n == 0 { 0.0f32 } else { (1.0 / n as f64) as f32 }, out.device_ptr());
        let mut l = self.stream().launch_builder(&f);
        l.arg(&pa).arg(&nb).arg(&inv).arg(&op_);
        let one = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: partials holds nb f32s, out one.
        unsafe { l.launch(one) }.op(OP)?;
        Ok(())
    }

    /// `dpred = g[0] / n · l'(pred − target)`, `g` the loss gradient on the device.
    pub fn latent_loss_backward<T: StorageElem>(&self, pred: &Buffer<T>, target: &Buffer<T>, g: &Buffer<f32>, kind: LatentLoss, dpred: &mut Buffer<T>) -> Result<()> {
        const OP: &str = "latent_loss_backward";
        let n = pred.len();
        check_len(OP, "target", target.len(), n)?;
        check_len(OP, "dpred", dpred.len(), n)?;
        check_len(OP, "g", g.len(), 1)?;
        if n == 0 {
            return Ok(());
        }
        let name = if T::IS_BF16 { "latent_loss_backward_bf16" } else { "latent_loss_backward_f32" };
        let f = self.function(Module::Mixed, name)?;
        let (pp, tp, gp, np, kind, inv, dp) = (pred.device_ptr(), target.device_ptr(), g.device_ptr(), i64_of(OP, n)?, kind.code(), (1.0 / n as f64) as f32, dpred.device_ptr());
        let mut l = self.stream().launch_builder(&f);
        l.arg(&pp).arg(&tp).arg(&gp).arg(&np).arg(&kind).arg(&inv).arg(&dp);
        // SAFETY: pred, target and dpred hold n elements, g one.
        unsafe { l.launch(grid_stride(n)) }.op(OP)?;
        Ok(())
    }

    /// The collapse monitor of `z [b, k, c]`: per feature, the unbiased standard deviation over
    /// the `b` images of the mean over the `k` tokens, averaged over the `c` features, into
    /// `out[0]` (0 when `b < 2`).
    pub fn feature_std<T: StorageElem>(&self, z: &Buffer<T>, b: usize, k: usize, c: usize, out: &mut Buffer<f32>) -> Result<()> {
        const OP: &str = "feature_std";
        check_len(OP, "z", z.len(), b * k * c)?;
        check_len(OP, "out", out.len(), 1)?;
        if k == 0 || c == 0 {
            return Err(CudaError::Unsupported { op: OP, what: format!("[{b}, {k}, {c}] features (tokens and features must be positive)") });
        }
        let (means, stds) = (self.alloc::<f32>(b * c)?, self.alloc::<f32>(c)?);
        let name = if T::IS_BF16 { "feature_means_bf16" } else { "feature_means_f32" };
        let f = self.function(Module::Mixed, name)?;
        let (zp, bi, ki, ci, mp, sp) = (z.device_ptr(), i32_of(OP, b)?, i32_of(OP, k)?, i32_of(OP, c)?, means.device_ptr(), stds.device_ptr());
        let mut l = self.stream().launch_builder(&f);
        l.arg(&zp).arg(&bi).arg(&ki).arg(&ci).arg(&mp);
        // SAFETY: z holds b·k·c elements, means b·c.
        unsafe { l.launch(grid_stride(b * c)) }.op(OP)?;
        let f = self.function(Module::Mixed, "feature_stds")?;
        let mut l = self.stream().launch_builder(&f);
        l.arg(&mp).arg(&bi).arg(&ci).arg(&sp);
        // SAFETY: means holds b·c f32s, stds c.
        unsafe { l.launch(grid_stride(c)) }.op(OP)?;
        self.mean_f32(&stds, out)?;
        Ok(())
    }

    /// `target = m·target + (1 − m)·source` for every pair, in one launch (`one_minus_m` is
    /// passed so callers round it as their host twin does). The table of tensors is uploaded first.
    pub fn ema_multi<S: StorageElem>(&self, pairs: &mut [EmaPair<'_, S>], m: f32, one_minus_m: f32) -> Result<()> {
        const OP: &str = "ema_multi";
        // Per tensor: target, source, n, block_start (the kernel's `EmaTensor`).
        let mut table: Vec<u64> = Vec::with_capacity(4 * pairs.len());
        let mut blocks = 0usize;
        for p in pairs.iter_mut() {
            let n = p.target.len();
            check_len(OP, "source", p.source.len(), n)?;
            if n == 0 {
                continue;
            }
            table.extend_from_slice(&[p.target.device_ptr(), p.source.device_ptr(), n as u64, blocks as u64]);
            blocks += n.div_ceil(BLOCK as usize);
        }
        let n_tensors = i32_of(OP, table.len() / 4)?;
        if n_tensors == 0 {
            return Ok(());
        }
        let words: Vec<u32> = table.iter().flat_map(|&w| [w as u32, (w >> 32) as u32]).collect();
        let table = self.htod(&words)?;
        let f = self.function(Module::Mixed, if S::IS_BF16 { "ema_multi_bf16" } else { "ema_multi_f32" })?;
        let tp = table.device_ptr();
        let mut l = self.stream().launch_builder(&f);
        l.arg(&tp).arg(&n_tensors).arg(&m).arg(&one_minus_m);
        let grid = u32::try_from(blocks).map_err(|_| CudaError::Unsupported { op: OP, what: format!("{blocks} blocks") })?;
        let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the table lists each pair's two buffers (lengths checked equal) with its
        // element count and first block; the blocks add up to the grid, so every thread finds
        // its tensor and stays inside its buffers.
        unsafe { l.launch(cfg) }.op(OP)?;
        Ok(())
    }
}
