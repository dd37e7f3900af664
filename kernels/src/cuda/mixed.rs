//! The kernels of GPU training in mixed precision (the `mixed` NVRTC module, `mixed.cu`), each
//! for f32 and bf16 storage ([`StorageElem`]): residual and broadcast adds, bias rows for a GEMM
//! with `beta = 1`, tanh-GELU, deterministic column sums (bias and broadcast gradients), layer
//! norm forward and backward (one warp per row) with its parameter gradients, embedding gather and
//! scatter-add, softmax cross-entropy losses and gradients (the loss gradient read on the device,
//! so backward never waits for the host), the attention head layouts, AdamW on f32 master weights
//! writing the storage-type parameter.
//!
//! Storage is widened to f32 in registers; every sum accumulates in f32 and rounds once on the
//! way out. These are what `rtx-tensor`'s CUDA tensors call; `rtx-tensor`'s
//! `examples/gpt_gpu.rs` checks the tensor ops built on them against the CPU ops on the device.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use half::bf16;

use super::alloc::{Buffer, DeviceElem};
use super::device::Device;
use super::error::{check_len, CudaError, OpContext, Result};
use super::nvrtc::Module;
use super::ops::AdamW;

/// One bf16 parameter of [`Device::adamw_master_multi`], with its f32 master weights, moments
/// and gradient, and its step's hyperparameters (`hp.weight_decay` and `hp.step` its own).
pub struct AdamWTensor<'a> {
    /// f32 master weights.
    pub master: &'a mut Buffer<f32>,
    /// The bf16 parameter (written from the master).
    pub param: &'a mut Buffer<bf16>,
    /// Its gradient.
    pub grad: &'a Buffer<bf16>,
    /// First moment.
    pub m: &'a mut Buffer<f32>,
    /// Second moment.
    pub v: &'a mut Buffer<f32>,
    /// The step's hyperparameters.
    pub hp: AdamW,
}

/// Threads per block of the grid-stride kernels.
const BLOCK: u32 = 256;
/// Upper bound on grid-stride blocks.
const MAX_BLOCKS: usize = 132 * 16;
/// Rows (warps) per block of the row kernels; must match the kernels' `8`.
const ROWS_PER_BLOCK: usize = 8;
/// Largest classifier row kept in shared memory (H100/H200 blocks may take 227 KiB).
const MAX_ROW_CACHE_BYTES: usize = 200 * 1024;
/// Longest row of the fused residual layer-norm kernels: 4 16-byte words per lane of a warp.
pub const FUSED_NORM_MAX: usize = 8 * 32 * 4;
/// Rows per block of the accumulating layer-norm backward (8 warps, 4 rows each); the parameter
/// partials are summed over `rows / 32` blocks.
const ACC_NORM_ROWS_PER_BLOCK: usize = 32;
/// Rows per chunk of the column-sum partials.
const ROWS_PER_CHUNK: usize = 128;

/// A storage type of GPU tensors: f32 or bf16.
pub trait StorageElem: DeviceElem {
    /// Whether the storage is bf16 (picks the `_bf16` kernel instantiation).
    const IS_BF16: bool;
}

impl StorageElem for f32 {
    const IS_BF16: bool = false;
}

impl StorageElem for bf16 {
    const IS_BF16: bool = true;
}

/// The kernel of the right instantiation: `kernel!(T, "name")` (also for tensor_ops.rs).
macro_rules! kernel {
    ($t:ty, $name:literal) => {
        if <$t as StorageElem>::IS_BF16 {
            concat!($name, "_bf16")
        } else {
            concat!($name, "_f32")
        }
    };
}
pub(super) use kernel;

/// Where the heads of an attention input or output sit: rows `[B, T, row_stride]` with head `h`
/// at columns `col_offset + h·D`; the head-major side is `[B, H, T, D]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadLayout {
    /// Batch.
    pub batch: usize,
    /// Sequence length.
    pub seq: usize,
    /// Heads.
    pub heads: usize,
    /// Head dim.
    pub head_dim: usize,
    /// Elements per row of the row-major side (`C` or `3·C`).
    pub row_stride: usize,
    /// Column where head 0 starts (`0`, `C` or `2·C` in packed QKV).
    pub col_offset: usize,
}

impl HeadLayout {
    fn head_elems(&self) -> usize {
        self.batch * self.heads * self.seq * self.head_dim
    }

    fn row_elems(&self) -> usize {
        self.batch * self.seq * self.row_stride
    }

    /// Whether rows move in 8-element (16-byte) pieces: every offset a multiple of 8.
    fn vectorizable(&self) -> bool {
        self.head_dim.is_multiple_of(8) && self.row_stride.is_multiple_of(8) && self.col_offset.is_multiple_of(8)
    }

    fn check(&self, op: &'static str) -> Result<[i32; 6]> {
        if self.col_offset + self.heads * self.head_dim > self.row_stride {
            return Err(CudaError::Unsupported {
                op,
                what: format!("heads end at column {} past the row of {}", self.col_offset + self.heads * self.head_dim, self.row_stride),
            });
        }
        Ok([int(op, self.batch)?, int(op, self.seq)?, int(op, self.heads)?, int(op, self.head_dim)?, int(op, self.row_stride)?, int(op, self.col_offset)?])
    }
}

/// A grid-stride launch of 256-thread blocks over `n` elements (also for tensor_ops.rs).
pub(super) fn grid_stride(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, MAX_BLOCKS) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

fn per_warp_rows(op: &'static str, rows: usize) -> Result<LaunchConfig> {
    let blocks = u32::try_from(rows.div_ceil(ROWS_PER_BLOCK).max(1)).map_err(|_| CudaError::Unsupported { op, what: format!("{rows} rows") })?;
    Ok(LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: ((ROWS_PER_BLOCK * 32) as u32, 1, 1), shared_mem_bytes: 0 })
}

/// `v` as a kernel's `int` argument, or the error naming `op` (also for tensor_ops.rs).
pub(super) fn int(op: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| CudaError::Unsupported { op, what: format!("{v} exceeds i32") })
}

fn rows_of(op: &'static str, len: usize, cols: usize) -> Result<usize> {
    if cols == 0 || !len.is_multiple_of(cols) {
        return Err(CudaError::Unsupported { op, what: format!("length {len} is not a whole number of rows of {cols}") });
    }
    Ok(len / cols)
}

/// Column-sum partials: `(chunks, launch)` for `rows × n`.
fn partial_grid(op: &'static str, rows: usize, n: usize) -> Result<(usize, LaunchConfig)> {
    let chunks = rows.div_ceil(ROWS_PER_CHUNK).max(1);
    let cfg = LaunchConfig {
        grid_dim: (
            u32::try_from(n.div_ceil(32)).map_err(|_| CudaError::Unsupported { op, what: format!("{n} columns") })?,
            u32::try_from(chunks).map_err(|_| CudaError::Unsupported { op, what: format!("{rows} rows") })?,
            1,
        ),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    };
    Ok((chunks, cfg))
}

impl Device {
    /// `out = a + b`, with `b` either `a`'s length or broadcast over `a`'s leading dimensions
    /// (`a.len()` a multiple of `b.len()`). `out` may be `a` itself only through
    /// [`Device::add_rows_in_place`].
    pub fn add_rows<T: StorageElem>(&self, a: &Buffer<T>, b: &Buffer<T>, out: &mut Buffer<T>) -> Result<()> {
        const OP: &str = "add_rows";
        check_len(OP, "out", out.len(), a.len())?;
        self.launch_add::<T>(OP, a.device_ptr(), a.len(), b, out.device_ptr())
    }

    /// `a += b` (same broadcast rule as [`Device::add_rows`]).
    pub fn add_rows_in_place<T: StorageElem>(&self, a: &mut Buffer<T>, b: &Buffer<T>) -> Result<()> {
        let p = a.device_ptr();
        self.launch_add::<T>("add_rows_in_place", p, a.len(), b, p)
    }

    fn launch_add<T: StorageElem>(&self, op: &'static str, a: u64, n: usize, b: &Buffer<T>, out: u64) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        if b.is_empty() || !n.is_multiple_of(b.len()) {
            return Err(CudaError::Unsupported { op, what: format!("cannot broadcast {} elements over {n}", b.len()) });
        }
        // bf16 with whole 8-element pieces moves 16 bytes per thread (buffers start 512-byte aligned).
        let v8 = T::IS_BF16 && n.is_multiple_of(8) && b.len().is_multiple_of(8);
        let (name, width) = if v8 { ("add_rows_v8_bf16", 8) } else { (kernel!(T, "add_rows"), 1) };
        let f = self.function(Module::Mixed, name)?;
        let (bp, n64, nb) = (b.device_ptr(), (n / width) as i64, (b.len() / width) as i64);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&a).arg(&bp).arg(&out).arg(&n64).arg(&nb);
        // SAFETY: a and out hold n elements, b holds nb dividing n; indices stay below them.
        unsafe { l.launch(grid_stride(n / width)) }.op(op)?;
        Ok(())
    }

    /// Every row of `out` (`rows × bias.len()`) set to `bias`.
    pub fn fill_rows<T: StorageElem>(&self, bias: &Buffer<T>, out: &mut Buffer<T>) -> Result<()> {
        const OP: &str = "fill_rows";
        let rows = rows_of(OP, out.len(), bias.len())?;
        if out.is_empty() {
            return Ok(());
        }
        let f = self.function(Module::Mixed, kernel!(T, "fill_rows"))?;
        let (bp, op_, r, n) = (bias.device_ptr(), out.device_ptr(), rows as i64, int(OP, bias.len())?);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&bp).arg(&op_).arg(&r).arg(&n);
        // SAFETY: out holds rows·n elements, bias n.
        unsafe { l.launch(grid_stride(out.len())) }.op(OP)?;
        Ok(())
    }

    /// Every element of `out` set to `value` (rounded to the storage type).
    pub fn fill<T: StorageElem>(&self, out: &mut Buffer<T>, value: f32) -> Result<()> {
        self.scalar_op::<T>(kernel!(T, "fill"), "fill", out, value)
    }

    /// `x *= k` in place.
    pub fn scale_in_place<T: StorageElem>(&self, x: &mut Buffer<T>, k: f32) -> Result<()> {
        self.scalar_op::<T>(kernel!(T, "scale"), "scale_in_place", x, k)
    }

    fn scalar_op<T: StorageElem>(&self, name: &'static str, op: &'static str, x: &mut Buffer<T>, v: f32) -> Result<()> {
        if x.is_empty() {
            return Ok(());
        }
        let f = self.function(Module::Mixed, name)?;
        let (p, n) = (x.device_ptr(), x.len() as i64);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&p).arg(&v).arg(&n);
        // SAFETY: x holds n elements.
        unsafe { l.launch(grid_stride(x.len())) }.op(op)?;
        Ok(())
    }

    /// `y = gelu(x)`: the exact erf form when `exact` (PyTorch's default), else the tanh
    /// approximation (GPT-2).
    pub fn gelu<T: StorageElem>(&self, x: &Buffer<T>, y: &mut Buffer<T>, exact: bool) -> Result<()> {
        const OP: &str = "gelu";
        check_len(OP, "y", y.len(), x.len())?;
        if x.is_empty() {
            return Ok(());
        }
        let v8 = T::IS_BF16 && x.len().is_multiple_of(8);
        let (name, width) = if v8 { ("gelu_forward_v8_bf16", 8) } else { (kernel!(T, "gelu_forward"), 1) };
        let f = self.function(Module::Mixed, name)?;
        let (xp, yp, n, exact) = (x.device_ptr(), y.device_ptr(), (x.len() / width) as i64, i32::from(exact));
        let mut l = self.stream().launch_builder(&f);
        l.arg(&xp).arg(&yp).arg(&n).arg(&exact);
        // SAFETY: both hold n elements (n / 8 pieces of 16 aligned bytes on the vectorized path).
        unsafe { l.launch(grid_stride(x.len() / width)) }.op(OP)?;
        Ok(())
    }

    /// `dx = dy · gelu'(x)` for the GELU form `exact` picks (see [`Self::gelu`]).
    pub fn gelu_backward<T: StorageElem>(&self, x: &Buffer<T>, dy: &Buffer<T>, dx: &mut Buffer<T>, exact: bool) -> Result<()> {
        const OP: &str = "gelu_backward";
        check_len(OP, "dy", dy.len(), x.len())?;
        check_len(OP, "dx", dx.len(), x.len())?;
        if x.is_empty() {
            return Ok(());
        }
        let v8 = T::IS_BF16 && x.len().is_multiple_of(8);
        let (name, width) = if v8 { ("gelu_backward_v8_bf16", 8) } else { (kernel!(T, "gelu_backward"), 1) };
        let f = self.function(Module::Mixed, name)?;
        let (xp, gp, dp, n, exact) = (x.device_ptr(), dy.device_ptr(), dx.device_ptr(), (x.len() / width) as i64, i32::from(exact));
        let mut l = self.stream().launch_builder(&f);
        l.arg(&xp).arg(&gp).arg(&dp).arg(&n).arg(&exact);
        // SAFETY: all three hold n elements (n / 8 aligned pieces on the vectorized path).
        unsafe { l.launch(grid_stride(x.len() / width)) }.op(OP)?;
        Ok(())
    }

    /// `out[j] (+)= Σ_r x[r, j]` over the rows of `x` (`rows × out.len()`), in a fixed order.
    pub fn column_sums<T: StorageElem>(&self, x: &Buffer<T>, out: &mut Buffer<T>, accumulate: bool) -> Result<()> {
        const OP: &str = "column_sums";
        let n = out.len();
        if n == 0 {
            return Ok(());
        }
        let rows = rows_of(OP, x.len(), n)?;
        let (chunks, cfg) = partial_grid(OP, rows, n)?;
        let partial = self.alloc::<f32>(chunks * n)?;
        let f = self.function(Module::Mixed, kernel!(T, "col_sum_partial"))?;
        let (xp, pp, r, ni, per) = (x.device_ptr(), partial.device_ptr(), rows as i64, int(OP, n)?, ROWS_PER_CHUNK as i64);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&xp).arg(&pp).arg(&r).arg(&ni).arg(&per);
        // SAFETY: x holds rows·n elements; partial holds chunks·n.
        unsafe { l.launch(cfg) }.op(OP)?;
        self.finish_columns::<T>(&partial, chunks, out, accumulate)
    }

    /// `out[j] = Σ_c partial[c·n + j]` for many chunks (hundreds): 32 columns per block, each
    /// column's chunks split over 8 threads and their sums added in a fixed order.
    fn finish_columns_wide<T: StorageElem>(&self, partial: &Buffer<f32>, chunks: usize, out: &mut Buffer<T>) -> Result<()> {
        const OP: &str = "column_sums";
        check_len(OP, "partial", partial.len(), chunks * out.len())?;
        if out.is_empty() {
            return Ok(());
        }
        let f = self.function(Module::Mixed, kernel!(T, "col_sum_finish_wide"))?;
        let (pp, op_, c, n) = (partial.device_ptr(), out.device_ptr(), int(OP, chunks)?, int(OP, out.len())?);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&pp).arg(&op_).arg(&c).arg(&n);
        let cfg = LaunchConfig {
            grid_dim: (u32::try_from(out.len().div_ceil(32)).map_err(|_| CudaError::Unsupported { op: OP, what: format!("{} columns", out.len()) })?, 1, 1),
            block_dim: (32, 8, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: partial holds chunks·n f32s, out n elements.
        unsafe { l.launch(cfg) }.op(OP)?;
        Ok(())
    }

    fn finish_columns<T: StorageElem>(&self, partial: &Buffer<f32>, chunks: usize, out: &mut Buffer<T>, accumulate: bool) -> Result<()> {
        const OP: &str = "column_sums";
        let f = self.function(Module::Mixed, kernel!(T, "col_sum_finish"))?;
        let (pp, op_, c, n, acc) = (partial.device_ptr(), out.device_ptr(), int(OP, chunks)?, int(OP, out.len())?, accumulate as i32);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&pp).arg(&op_).arg(&c).arg(&n).arg(&acc);
        // SAFETY: partial holds chunks·n f32s, out n elements.
        unsafe { l.launch(grid_stride(out.len())) }.op(OP)?;
        Ok(())
    }

    /// Layer norm over rows of `n`: `y = (x − mean)·rstd·w + b`, saving per-row `mean` and `rstd`.
    #[allow(clippy::too_many_arguments)]
    pub fn norm_forward<T: StorageElem>(
        &self,
        x: &Buffer<T>,
        n: usize,
        w: Option<&Buffer<T>>,
        b: Option<&Buffer<T>>,
        eps: f32,
        y: &mut Buffer<T>,
        mean: &mut Buffer<f32>,
        rstd: &mut Buffer<f32>,
    ) -> Result<()> {
        const OP: &str = "norm_forward";
        let rows = rows_of(OP, x.len(), n)?;
        check_len(OP, "y", y.len(), x.len())?;
        check_len(OP, "mean", mean.len(), rows)?;
        check_len(OP, "rstd", rstd.len(), rows)?;
        for (name, p) in [("weight", w), ("bias", b)] {
            if let Some(p) = p {
                check_len(OP, name, p.len(), n)?;
            }
        }
        if rows == 0 {
            return Ok(());
        }
        let name = if T::IS_BF16 && n.is_multiple_of(8) { "layer_norm_forward_v8_bf16" } else { kernel!(T, "layer_norm_forward") };
        let f = self.function(Module::Mixed, name)?;
        let (xp, wp, bp, yp, mp, rp) =
            (x.device_ptr(), w.map_or(0, |w| w.device_ptr()), b.map_or(0, |b| b.device_ptr()), y.device_ptr(), mean.device_ptr(), rstd.device_ptr());
        let (r, ni) = (rows as i64, int(OP, n)?);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&xp).arg(&wp).arg(&bp).arg(&yp).arg(&mp).arg(&rp).arg(&r).arg(&ni).arg(&eps);
        // SAFETY: lengths checked above; null w/b are allowed by the kernel.
        unsafe { l.launch(per_warp_rows(OP, rows)?) }.op(OP)?;
        Ok(())
    }

    /// Layer norm backward: `dx`, and the parameter gradients `dw`, `db` when asked (written,
    /// not accumulated).
    #[allow(clippy::too_many_arguments)]
    pub fn norm_backward<T: StorageElem>(
        &self,
        x: &Buffer<T>,
        n: usize,
        w: Option<&Buffer<T>>,
        mean: &Buffer<f32>,
        rstd: &Buffer<f32>,
        dy: &Buffer<T>,
        dx: &mut Buffer<T>,
        dw: Option<&mut Buffer<T>>,
        db: Option<&mut Buffer<T>>,
    ) -> Result<()> {
        const OP: &str = "norm_backward";
        let rows = rows_of(OP, x.len(), n)?;
        check_len(OP, "dy", dy.len(), x.len())?;
        check_len(OP, "dx", dx.len(), x.len())?;
        check_len(OP, "mean", mean.len(), rows)?;
        check_len(OP, "rstd", rstd.len(), rows)?;
        if let Some(w) = w {
            check_len(OP, "weight", w.len(), n)?;
        }
        if rows == 0 {
            return Ok(());
        }
        let name = if T::IS_BF16 && n.is_multiple_of(8) { "layer_norm_backward_v8_bf16" } else { kernel!(T, "layer_norm_backward") };
        let f = self.function(Module::Mixed, name)?;
        let (xp, wp, mp, rp, gp, dp) =
            (x.device_ptr(), w.map_or(0, |w| w.device_ptr()), mean.device_ptr(), rstd.device_ptr(), dy.device_ptr(), dx.device_ptr());
        let (r, ni) = (rows as i64, int(OP, n)?);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&xp).arg(&wp).arg(&mp).arg(&rp).arg(&gp).arg(&dp).arg(&r).arg(&ni);
        // SAFETY: lengths checked above.
        unsafe { l.launch(per_warp_rows(OP, rows)?) }.op(OP)?;
        if dw.is_none() && db.is_none() {
            return Ok(());
        }
        let (chunks, cfg) = partial_grid(OP, rows, n)?;
        let pw = self.alloc::<f32>(chunks * n)?;
        let pb = self.alloc::<f32>(chunks * n)?;
        let f = self.function(Module::Mixed, kernel!(T, "layer_norm_param_partial"))?;
        let (pwp, pbp, per) = (pw.device_ptr(), pb.device_ptr(), ROWS_PER_CHUNK as i64);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&xp).arg(&mp).arg(&rp).arg(&gp).arg(&pwp).arg(&pbp).arg(&r).arg(&ni).arg(&per);
        // SAFETY: x, dy hold rows·n; mean, rstd rows; partials chunks·n.
        unsafe { l.launch(cfg) }.op(OP)?;
        if let Some(dw) = dw {
            check_len(OP, "dw", dw.len(), n)?;
            self.finish_columns::<T>(&pw, chunks, dw, false)?;
        }
        if let Some(db) = db {
            check_len(OP, "db", db.len(), n)?;
            self.finish_columns::<T>(&pb, chunks, db, false)?;
        }
        Ok(())
    }

    /// Whether rows of `n` elements of storage `T` take the fused residual layer-norm kernels
    /// ([`Device::add_norm_forward`], and the one-pass form of
    /// [`Device::norm_backward_accumulate`]): bf16 rows of whole 16-byte words, at most
    /// [`FUSED_NORM_MAX`] long (a warp holds a row in registers).
    pub fn fused_norm_supported<T: StorageElem>(n: usize) -> bool {
        T::IS_BF16 && n > 0 && n.is_multiple_of(8) && n <= FUSED_NORM_MAX
    }

    /// The residual add fused with the layer norm after it: `s = a + b` (rounded to `T`; `b` of
    /// `a`'s length or broadcast over its leading rows) and `y = layer_norm(s)` with `s`'s rounded
    /// values, in one pass (the bits of [`Device::add_rows`] then [`Device::norm_forward`]).
    /// Only where [`Device::fused_norm_supported`] says so.
    #[allow(clippy::too_many_arguments)]
    pub fn add_norm_forward<T: StorageElem>(
        &self,
        a: &Buffer<T>,
        b: &Buffer<T>,
        n: usize,
        w: Option<&Buffer<T>>,
        bias: Option<&Buffer<T>>,
        eps: f32,
        s: &mut Buffer<T>,
        y: &mut Buffer<T>,
        mean: &mut Buffer<f32>,
        rstd: &mut Buffer<f32>,
    ) -> Result<()> {
        const OP: &str = "add_norm_forward";
        if !Self::fused_norm_supported::<T>(n) {
            return Err(CudaError::Unsupported { op: OP, what: format!("rows of {n} (bf16 rows of a multiple of 8, at most {FUSED_NORM_MAX})") });
        }
        let rows = rows_of(OP, a.len(), n)?;
        let b_rows = rows_of(OP, b.len(), n)?;
        if b_rows == 0 || !rows.is_multiple_of(b_rows) {
            return Err(CudaError::Unsupported { op: OP, what: format!("cannot broadcast {} elements over {}", b.len(), a.len()) });
        }
        check_len(OP, "s", s.len(), a.len())?;
        check_len(OP, "y", y.len(), a.len())?;
        check_len(OP, "mean", mean.len(), rows)?;
        check_len(OP, "rstd", rstd.len(), rows)?;
        for (name, p) in [("weight", w), ("bias", bias)] {
            if let Some(p) = p {
                check_len(OP, name, p.len(), n)?;
            }
        }
        if rows == 0 {
            return Ok(());
        }
        let name = match (n / 8).div_ceil(32) {
            1 => "add_layer_norm_forward_k1_bf16",
            2 => "add_layer_norm_forward_k2_bf16",
            3 => "add_layer_norm_forward_k3_bf16",
            _ => "add_layer_norm_forward_k4_bf16",
        };
        let f = self.function(Module::Mixed, name)?;
        let (ap, bp, wp, biasp) = (a.device_ptr(), b.device_ptr(), w.map_or(0, |w| w.device_ptr()), bias.map_or(0, |b| b.device_ptr()));
        let (sp, yp, mp, rp) = (s.device_ptr(), y.device_ptr(), mean.device_ptr(), rstd.device_ptr());
        let (r, ni, br) = (rows as i64, int(OP, n)?, b_rows as i64);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&ap).arg(&bp).arg(&wp).arg(&biasp).arg(&sp).arg(&yp).arg(&mp).arg(&rp).arg(&r).arg(&ni).arg(&br).arg(&eps);
        // SAFETY: a, s, y hold rows·n elements, b b_rows·n with b_rows dividing rows, mean and
        // rstd rows, w and bias n or null; n is a multiple of 8 within the kernel's K words per
        // lane, and buffers start 16-byte aligned.
        unsafe { l.launch(per_warp_rows(OP, rows)?) }.op(OP)?;
        Ok(())
    }

    /// Layer norm backward that also adds the gradient the input already has from its other
    /// consumers: `dx = prior + dx_norm` (rounded once on the fused path), and the parameter
    /// gradients `dw`, `db` when asked (written). bf16 rows that
    /// [`Device::fused_norm_supported`] takes run in one kernel pass over `x`, `dy` and `prior`
    /// (the parameter partials made in the same pass, summed over blocks in a fixed order);
    /// other rows run [`Device::norm_backward`] and an add.
    #[allow(clippy::too_many_arguments)]
    pub fn norm_backward_accumulate<T: StorageElem>(
        &self,
        x: &Buffer<T>,
        n: usize,
        w: Option<&Buffer<T>>,
        mean: &Buffer<f32>,
        rstd: &Buffer<f32>,
        dy: &Buffer<T>,
        prior: Option<&Buffer<T>>,
        dx: &mut Buffer<T>,
        dw: Option<&mut Buffer<T>>,
        db: Option<&mut Buffer<T>>,
    ) -> Result<()> {
        const OP: &str = "norm_backward_accumulate";
        if let Some(p) = prior {
            check_len(OP, "prior", p.len(), x.len())?;
        }
        if !Self::fused_norm_supported::<T>(n) {
            self.norm_backward(x, n, w, mean, rstd, dy, dx, dw, db)?;
            if let Some(p) = prior {
                self.add_rows_in_place(dx, p)?;
            }
            return Ok(());
        }
        let rows = rows_of(OP, x.len(), n)?;
        check_len(OP, "dy", dy.len(), x.len())?;
        check_len(OP, "dx", dx.len(), x.len())?;
        check_len(OP, "mean", mean.len(), rows)?;
        check_len(OP, "rstd", rstd.len(), rows)?;
        if let Some(w) = w {
            check_len(OP, "weight", w.len(), n)?;
        }
        if rows == 0 {
            return Ok(());
        }
        let blocks = rows.div_ceil(ACC_NORM_ROWS_PER_BLOCK);
        let want_params = dw.is_some() || db.is_some();
        let (pw, pb) = if want_params { (Some(self.alloc::<f32>(blocks * n)?), Some(self.alloc::<f32>(blocks * n)?)) } else { (None, None) };
        let name = match (n / 8).div_ceil(32) {
            1 => "layer_norm_backward_acc_k1_bf16",
            2 => "layer_norm_backward_acc_k2_bf16",
            3 => "layer_norm_backward_acc_k3_bf16",
            _ => "layer_norm_backward_acc_k4_bf16",
        };
        let f = self.function(Module::Mixed, name)?;
        // Each warp's dw and db sums: 2·n floats per warp.
        let smem = ROWS_PER_BLOCK * 2 * n * std::mem::size_of::<f32>();
        super::attention::allow_smem(&f, smem, OP)?;
        let (xp, wp, mp, rp, gp, pp, dp) = (
            x.device_ptr(),
            w.map_or(0, |w| w.device_ptr()),
            mean.device_ptr(),
            rstd.device_ptr(),
            dy.device_ptr(),
            prior.map_or(0, |p| p.device_ptr()),
            dx.device_ptr(),
        );
        let (pwp, pbp) = (pw.as_ref().map_or(0, |b| b.device_ptr()), pb.as_ref().map_or(0, |b| b.device_ptr()));
        let (r, ni, per) = (rows as i64, int(OP, n)?, int(OP, ACC_NORM_ROWS_PER_BLOCK)?);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&xp).arg(&wp).arg(&mp).arg(&rp).arg(&gp).arg(&pp).arg(&dp).arg(&pwp).arg(&pbp).arg(&r).arg(&ni).arg(&per);
        let grid = u32::try_from(blocks).map_err(|_| CudaError::Unsupported { op: OP, what: format!("{rows} rows") })?;
        let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: ((ROWS_PER_BLOCK * 32) as u32, 1, 1), shared_mem_bytes: smem as u32 };
        // SAFETY: x, dy, dx (and prior) hold rows·n elements, mean and rstd rows, w n or null,
        // the partials blocks·n f32s or null; n is a multiple of 8 within the kernel's K words per
        // lane; the shared memory holds the kernel's 2·n floats per warp and was allowed above.
        unsafe { l.launch(cfg) }.op(OP)?;
        if let (Some(dw), Some(pw)) = (dw, pw.as_ref()) {
            check_len(OP, "dw", dw.len(), n)?;
            self.finish_columns_wide::<T>(pw, blocks, dw)?;
        }
        if let (Some(db), Some(pb)) = (db, pb.as_ref()) {
            check_len(OP, "db", db.len(), n)?;
            self.finish_columns_wide::<T>(pb, blocks, db)?;
        }
        Ok(())
    }

    /// `out[r] = table[ids[r]]` for rows of `dim`. The caller guarantees every id is a row of the
    /// table (the tensor layer checks ids on the host before they are uploaded).
    pub fn gather_rows<T: StorageElem>(&self, table: &Buffer<T>, dim: usize, ids: &Buffer<u32>, out: &mut Buffer<T>) -> Result<()> {
        const OP: &str = "gather_rows";
        check_len(OP, "out", out.len(), ids.len() * dim)?;
        if out.is_empty() {
            return Ok(());
        }
        let f = self.function(Module::Mixed, kernel!(T, "embedding_forward"))?;
        let (tp, ip, op_, n, d) = (table.device_ptr(), ids.device_ptr(), out.device_ptr(), ids.len() as i64, int(OP, dim)?);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&tp).arg(&ip).arg(&op_).arg(&n).arg(&d);
        // SAFETY: out holds ids·dim elements; ids index the table (caller's contract).
        unsafe { l.launch(grid_stride(out.len())) }.op(OP)?;
        Ok(())
    }

    /// `dtable[ids[r]] += dout[r]` into an f32 table (atomic adds: the order of additions into a
    /// repeated row is not fixed).
    pub fn scatter_add_rows<T: StorageElem>(&self, dout: &Buffer<T>, ids: &Buffer<u32>, dim: usize, dtable: &mut Buffer<f32>) -> Result<()> {
        const OP: &str = "scatter_add_rows";
        check_len(OP, "dout", dout.len(), ids.len() * dim)?;
        if dout.is_empty() {
            return Ok(());
        }
        let f = self.function(Module::Mixed, kernel!(T, "embedding_backward"))?;
        let (gp, ip, tp, n, d) = (dout.device_ptr(), ids.device_ptr(), dtable.device_ptr(), ids.len() as i64, int(OP, dim)?);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&gp).arg(&ip).arg(&tp).arg(&n).arg(&d);
        // SAFETY: dout holds ids·dim elements; ids index dtable (caller's contract).
        unsafe { l.launch(grid_stride(dout.len())) }.op(OP)?;
        Ok(())
    }

    /// Per-row softmax cross-entropy losses of `logits` (`rows × classes`) against `targets`
    /// (a target outside the classes gives NaN; the tensor layer checks targets first).
    pub fn cross_entropy_losses<T: StorageElem>(&self, logits: &Buffer<T>, classes: usize, targets: &Buffer<u32>, losses: &mut Buffer<f32>) -> Result<()> {
        const OP: &str = "cross_entropy_losses";
        let rows = rows_of(OP, logits.len(), classes)?;
        check_len(OP, "targets", targets.len(), rows)?;
        check_len(OP, "losses", losses.len(), rows)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(Module::Mixed, kernel!(T, "cross_entropy_forward"))?;
        let (lp, tp, op_, r, c) = (logits.device_ptr(), targets.device_ptr(), losses.device_ptr(), rows as i64, int(OP, classes)?);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&lp).arg(&tp).arg(&op_).arg(&r).arg(&c);
        // SAFETY: lengths checked above.
        unsafe { l.launch(per_warp_rows(OP, rows)?) }.op(OP)?;
        Ok(())
    }

    /// `dlogits = g[0] · (softmax(logits) − onehot(targets)) · inv_rows`, with the loss gradient
    /// `g` (one f32) read on the device.
    #[allow(clippy::too_many_arguments)]
    pub fn cross_entropy_grad<T: StorageElem>(
        &self,
        logits: &Buffer<T>,
        classes: usize,
        targets: &Buffer<u32>,
        g: &Buffer<f32>,
        inv_rows: f32,
        dlogits: &mut Buffer<T>,
    ) -> Result<()> {
        const OP: &str = "cross_entropy_grad";
        let rows = rows_of(OP, logits.len(), classes)?;
        check_len(OP, "targets", targets.len(), rows)?;
        check_len(OP, "dlogits", dlogits.len(), logits.len())?;
        check_len(OP, "g", g.len(), 1)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(Module::Mixed, kernel!(T, "cross_entropy_backward"))?;
        let (lp, tp, gp, dp, r, c) = (logits.device_ptr(), targets.device_ptr(), g.device_ptr(), dlogits.device_ptr(), rows as i64, int(OP, classes)?);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&lp).arg(&tp).arg(&gp).arg(&inv_rows).arg(&dp).arg(&r).arg(&c);
        // SAFETY: lengths checked above.
        unsafe { l.launch(per_warp_rows(OP, rows)?) }.op(OP)?;
        Ok(())
    }

    /// The fused classifier step of a chunk of `rows` logit rows `[rows, padded]` (row-major in
    /// `logits`), whose first `classes` columns are classes and the rest padding, against
    /// `targets[first_row..first_row + rows]`: writes `losses[first_row + r]` = logsumexp of the
    /// row's classes − its target's logit (0 for a row whose target is `ignore`, NaN for a target
    /// ≥ `classes`) and, with `grad_scale`, overwrites the logits in place by their gradient
    /// `(softmax − onehot) · grad_scale` (0 in the padding and in ignored rows). One 1024-thread
    /// block per row; deterministic.
    #[allow(clippy::too_many_arguments)]
    pub fn fused_classifier<T: StorageElem>(
        &self,
        logits: &mut Buffer<T>,
        rows: usize,
        padded: usize,
        classes: usize,
        targets: &Buffer<u32>,
        first_row: usize,
        losses: &mut Buffer<f32>,
        ignore: Option<u32>,
        grad_scale: Option<f32>,
    ) -> Result<()> {
        const OP: &str = "fused_classifier";
        if classes == 0 || classes > padded {
            return Err(CudaError::Unsupported { op: OP, what: format!("classes {classes} must be in 1..={padded}") });
        }
        check_len(OP, "logits", logits.len(), rows * padded)?;
        check_len(OP, "targets", targets.len(), first_row + rows)?;
        check_len(OP, "losses", losses.len(), first_row + rows)?;
        if rows == 0 {
            return Ok(());
        }
        // bf16 rows of whole 16-byte words (the buffer itself is 256-byte aligned) take the
        // vectorized kernel.
        // With a gradient to write, a row that fits in shared memory (GPT-2's 50,304 bf16 logits
        // take 98 KiB) is read from global memory once instead of twice.
        // Rows of up to 8 words per thread of a 1024-thread block (65,536 logits) are held in
        // registers between the passes (`fused_classifier_v8_regs_bf16`), unless this device was
        // told to use the shared-memory row cache (`Device::set_fused_classifier_regs`).
        let vectorized = T::IS_BF16 && padded.is_multiple_of(8);
        let in_registers = vectorized && padded <= 8 * 8 * 1024 && self.classifier_regs.load(std::sync::atomic::Ordering::Relaxed);
        let cached_bytes = if vectorized && !in_registers && grad_scale.is_some() && padded * 2 <= MAX_ROW_CACHE_BYTES { padded * 2 } else { 0 };
        let name = match (vectorized, in_registers, cached_bytes > 0) {
            (true, true, _) => "fused_classifier_v8_regs_bf16",
            (true, false, true) => "fused_classifier_v8_cached_bf16",
            (true, false, false) => "fused_classifier_v8_bf16",
            (false, ..) => kernel!(T, "fused_classifier"),
        };
        let f = self.function(Module::Mixed, name)?;
        if cached_bytes > 0 {
            super::attention::allow_smem(&f, cached_bytes, OP)?;
        }
        let (lp, tp, op_) = (logits.device_ptr(), targets.device_ptr_at(first_row)?, losses.device_ptr_at(first_row)?);
        let (vp, v) = (int(OP, padded)?, int(OP, classes)?);
        let (has_ignore, ignore) = (ignore.is_some() as i32, ignore.unwrap_or(0));
        let (scale, write_grad) = (grad_scale.unwrap_or(0.0), grad_scale.is_some() as i32);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&lp).arg(&tp).arg(&op_).arg(&vp).arg(&v).arg(&has_ignore).arg(&ignore).arg(&scale).arg(&write_grad);
        let blocks = u32::try_from(rows).map_err(|_| CudaError::Unsupported { op: OP, what: format!("{rows} rows") })?;
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: cached_bytes as u32 };
        // SAFETY: lengths checked above; the kernel reads a target's logit only when the target
        // is below `classes`; the cached kernel gets the row's bytes of shared memory.
        unsafe { l.launch(cfg) }.op(OP)?;
        Ok(())
    }

    /// Whether [`Device::fused_classifier`] holds bf16 rows in registers (the default) or in a
    /// shared-memory row cache (the earlier form), so a benchmark can time both in one process.
    /// The two differ in the last bits (2^x on the MUFU unit and a two-pass max/sum against an
    /// online log-sum-exp with `expf`); each is deterministic.
    #[doc(hidden)]
    pub fn set_fused_classifier_regs(&self, on: bool) {
        self.classifier_regs.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// `y = x · g[0]`, the factor read on the device (an incoming loss gradient, so backward
    /// never waits for the host).
    pub fn scale_by_device<T: StorageElem>(&self, x: &Buffer<T>, g: &Buffer<f32>, y: &mut Buffer<T>) -> Result<()> {
        self.scale_by_device_typed(kernel!(T, "scale_by_device"), x, g, y)
    }

    /// [`Device::scale_by_device`] from an f32 `x` (an f32 accumulator) into `y`'s storage type.
    pub fn scale_by_device_from_f32<T: StorageElem>(&self, x: &Buffer<f32>, g: &Buffer<f32>, y: &mut Buffer<T>) -> Result<()> {
        self.scale_by_device_typed(kernel!(T, "scale_by_device_from_f32"), x, g, y)
    }

    fn scale_by_device_typed<S: StorageElem, T: StorageElem>(&self, name: &'static str, x: &Buffer<S>, g: &Buffer<f32>, y: &mut Buffer<T>) -> Result<()> {
        const OP: &str = "scale_by_device";
        check_len(OP, "g", g.len(), 1)?;
        check_len(OP, "y", y.len(), x.len())?;
        if x.is_empty() {
            return Ok(());
        }
        let f = self.function(Module::Mixed, name)?;
        let (xp, gp, yp, n) = (x.device_ptr(), g.device_ptr(), y.device_ptr(), x.len() as i64);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&xp).arg(&gp).arg(&yp).arg(&n);
        // SAFETY: x and y hold n elements, g one.
        unsafe { l.launch(grid_stride(x.len())) }.op(OP)?;
        Ok(())
    }

    /// Per chunk of `chunk` elements of `x` (the last one may be shorter), the 64-bit FNV-1a
    /// digest of the elements' raw bits (bf16 as 16-bit, f32 and u32 as 32-bit integers) in
    /// order, starting from the FNV basis xor the chunk's index: `out[at + 2c]` holds chunk `c`'s
    /// low word, `out[at + 2c + 1]` its high word (queued; several tensors can share one `out`).
    /// Bit-exact with the host's definition in `rtx_tensor`.
    pub fn bits_checksum_chunks<T: DeviceElem>(&self, x: &Buffer<T>, chunk: usize, out: &mut Buffer<u32>, at: usize) -> Result<()> {
        const OP: &str = "bits_checksum_chunks";
        if chunk == 0 {
            return Err(CudaError::Unsupported { op: OP, what: "chunks of 0 elements".into() });
        }
        let n_chunks = x.len().div_ceil(chunk);
        check_len(OP, "out", out.len(), at + 2 * n_chunks)?;
        if x.is_empty() {
            return Ok(());
        }
        let name = match std::mem::size_of::<T>() {
            2 => "bits_checksum_chunks_u16",
            4 => "bits_checksum_chunks_u32",
            other => return Err(CudaError::Unsupported { op: OP, what: format!("{other}-byte elements") }),
        };
        let f = self.function(Module::Mixed, name)?;
        let (xp, op_, n, c, nc) = (x.device_ptr(), out.device_ptr() + (at * 4) as u64, x.len() as i64, chunk as i64, n_chunks as i64);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&xp).arg(&n).arg(&c).arg(&op_).arg(&nc);
        // SAFETY: x holds n elements of the kernel's width, out at least at + 2·n_chunks words.
        unsafe { l.launch(grid_stride(n_chunks)) }.op(OP)?;
        Ok(())
    }

    /// `out[0] = mean(x)` in a fixed order.
    pub fn mean_f32(&self, x: &Buffer<f32>, out: &mut Buffer<f32>) -> Result<()> {
        const OP: &str = "mean_f32";
        check_len(OP, "out", out.len(), 1)?;
        let f = self.function(Module::Mixed, "mean_f32")?;
        let (xp, op_, n) = (x.device_ptr(), out.device_ptr(), x.len() as i64);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&xp).arg(&op_).arg(&n);
        let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: x holds n f32s, out one.
        unsafe { l.launch(cfg) }.op(OP)?;
        Ok(())
    }

    /// Copies the heads out of rows: `rows [B, T, row_stride]` → `heads [B, H, T, D]`.
    pub fn rows_to_heads<T: StorageElem>(&self, rows: &Buffer<T>, layout: HeadLayout, heads: &mut Buffer<T>) -> Result<()> {
        let name = if T::IS_BF16 && layout.vectorizable() { "rows_to_heads_v8_bf16" } else { kernel!(T, "rows_to_heads") };
        self.head_copy::<T, T>(name, "rows_to_heads", rows, layout, heads, true)
    }

    /// Writes heads into rows: `heads [B, H, T, D]` → the head columns of `rows`.
    pub fn heads_to_rows<T: StorageElem>(&self, heads: &Buffer<T>, layout: HeadLayout, rows: &mut Buffer<T>) -> Result<()> {
        let name = if T::IS_BF16 && layout.vectorizable() { "heads_to_rows_v8_bf16" } else { kernel!(T, "heads_to_rows") };
        self.head_copy::<T, T>(name, "heads_to_rows", heads, layout, rows, false)
    }

    fn head_copy<S: DeviceElem, D: DeviceElem>(
        &self,
        name: &'static str,
        op: &'static str,
        src: &Buffer<S>,
        layout: HeadLayout,
        dst: &mut Buffer<D>,
        to_heads: bool,
    ) -> Result<()> {
        let args = layout.check(op)?;
        let (src_len, dst_len) = if to_heads { (layout.row_elems(), layout.head_elems()) } else { (layout.head_elems(), layout.row_elems()) };
        check_len(op, "src", src.len(), src_len)?;
        check_len(op, "dst", dst.len(), dst_len)?;
        let n = layout.head_elems();
        if n == 0 {
            return Ok(());
        }
        let f = self.function(Module::Mixed, name)?;
        let (sp, dp) = (src.device_ptr(), dst.device_ptr());
        let mut l = self.stream().launch_builder(&f);
        l.arg(&sp).arg(&dp);
        for a in &args {
            l.arg(a);
        }
        let items = if name.contains("_v8_") { n / 8 } else { n };
        // SAFETY: both buffers were checked against the layout's extents; the vectorized kernels
        // are only picked when every 8-element piece is 16-byte aligned (buffers start 512-byte
        // aligned).
        unsafe { l.launch(grid_stride(items)) }.op(op)?;
        Ok(())
    }

    /// [`Device::adamw_master`] for many bf16 tensors in one launch (each of a multiple of 8
    /// elements, each with its own weight decay and step; `lr`, betas and `eps` shared): the
    /// same bits per element as the per-tensor kernel. The table of tensors is uploaded first,
    /// which waits for the device's queued work.
    pub fn adamw_master_multi(&self, tensors: &mut [AdamWTensor<'_>]) -> Result<()> {
        const OP: &str = "adamw_master_multi";
        let Some(first) = tensors.first() else { return Ok(()) };
        let (lr, beta1, beta2, eps) = (first.hp.lr, first.hp.beta1, first.hp.beta2, first.hp.eps);
        // Per tensor: master, param, grad, m, v, n8, block_start, (weight_decay, bc1), (bc2, 0),
        // as the kernel's `AdamTensor`.
        let mut table: Vec<u64> = Vec::with_capacity(9 * tensors.len());
        let mut blocks = 0usize;
        for t in tensors.iter_mut() {
            let n = t.master.len();
            for (name, len) in [("param", t.param.len()), ("grad", t.grad.len()), ("m", t.m.len()), ("v", t.v.len())] {
                check_len(OP, name, len, n)?;
            }
            if !n.is_multiple_of(8) || t.hp.step == 0 || (t.hp.lr, t.hp.beta1, t.hp.beta2, t.hp.eps) != (lr, beta1, beta2, eps) {
                return Err(CudaError::Unsupported {
                    op: OP,
                    what: format!("tensors of a multiple of 8 elements, steps from 1 and one lr, betas and eps (got {n} elements, step {})", t.hp.step),
                });
            }
            if n == 0 {
                continue;
            }
            let bc1 = (1.0 - (t.hp.beta1 as f64).powi(t.hp.step as i32)) as f32;
            let bc2 = (1.0 - (t.hp.beta2 as f64).powi(t.hp.step as i32)) as f32;
            let n8 = n / 8;
            table.extend_from_slice(&[
                t.master.device_ptr(),
                t.param.device_ptr(),
                t.grad.device_ptr(),
                t.m.device_ptr(),
                t.v.device_ptr(),
                n8 as u64,
                blocks as u64,
            ]);
            table.push(u64::from(t.hp.weight_decay.to_bits()) | (u64::from(bc1.to_bits()) << 32));
            table.push(u64::from(bc2.to_bits()));
            blocks += n8.div_ceil(BLOCK as usize);
        }
        let n_tensors = int(OP, table.len() / 9)?;
        if n_tensors == 0 {
            return Ok(());
        }
        // Uploaded as little-endian u32 pairs (the device reads the 8-byte fields).
        let words: Vec<u32> = table.iter().flat_map(|&w| [w as u32, (w >> 32) as u32]).collect();
        let table = self.htod(&words)?;
        let f = self.function(Module::Mixed, "adamw_master_multi_v8_bf16")?;
        let tp = table.device_ptr();
        let mut l = self.stream().launch_builder(&f);
        l.arg(&tp).arg(&n_tensors).arg(&lr).arg(&beta1).arg(&beta2).arg(&eps);
        let grid = u32::try_from(blocks).map_err(|_| CudaError::Unsupported { op: OP, what: format!("{blocks} blocks") })?;
        let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the table lists each tensor's five buffers (lengths checked equal, n a multiple
        // of 8, 16-byte aligned) with its word count and first block; the blocks add up to the
        // grid, so every thread finds its tensor and stays inside its buffers.
        unsafe { l.launch(cfg) }.op(OP)?;
        Ok(())
    }

    /// One AdamW step on f32 `master` weights (moments `m`, `v`) from storage-type `grad`,
    /// writing the rounded result into `param`.
    #[allow(clippy::too_many_arguments)]
    pub fn adamw_master<T: StorageElem>(
        &self,
        master: &mut Buffer<f32>,
        param: &mut Buffer<T>,
        grad: &Buffer<T>,
        m: &mut Buffer<f32>,
        v: &mut Buffer<f32>,
        hp: AdamW,
    ) -> Result<()> {
        const OP: &str = "adamw_master";
        let n = master.len();
        for (name, len) in [("param", param.len()), ("grad", grad.len()), ("m", m.len()), ("v", v.len())] {
            check_len(OP, name, len, n)?;
        }
        if hp.step == 0 {
            return Err(CudaError::Unsupported { op: OP, what: "step 0 (steps start at 1)".into() });
        }
        if n == 0 {
            return Ok(());
        }
        let bc1 = (1.0 - (hp.beta1 as f64).powi(hp.step as i32)) as f32;
        let bc2 = (1.0 - (hp.beta2 as f64).powi(hp.step as i32)) as f32;
        // bf16 parameters of whole 8-element words update 8 elements per thread (16-byte loads;
        // buffers start 256-byte aligned), the same arithmetic per element.
        let width = if T::IS_BF16 && n.is_multiple_of(8) { 8 } else { 1 };
        let f = self.function(Module::Mixed, if width == 8 { "adamw_master_v8_bf16" } else { kernel!(T, "adamw_master") })?;
        let (mp, pp, gp, m1, v1, n64) = (master.device_ptr(), param.device_ptr(), grad.device_ptr(), m.device_ptr(), v.device_ptr(), (n / width) as i64);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&mp)
            .arg(&pp)
            .arg(&gp)
            .arg(&m1)
            .arg(&v1)
            .arg(&n64)
            .arg(&hp.lr)
            .arg(&hp.beta1)
            .arg(&hp.beta2)
            .arg(&hp.eps)
            .arg(&hp.weight_decay)
            .arg(&bc1)
            .arg(&bc2);
        // SAFETY: all five buffers hold n elements (n64 words of `width` of them).
        unsafe { l.launch(grid_stride(n / width)) }.op(OP)?;
        Ok(())
    }
}
