//! The NVRTC kernels of the `core` module behind typed calls on [`Device`]: elementwise and
//! broadcast binary ops, unary activations with their backward, row softmax, layer and RMS norm,
//! fused softmax-cross-entropy, embedding, fused AdamW and f32↔bf16 casts. All f32 (bf16 only as
//! a storage format through the casts); all queued on the device's stream.
//!
//! Each call checks buffer lengths against the shape before launching, so a kernel never reads
//! or writes outside its buffers. Semantics match the CPU kernels of this crate
//! ([`crate::softmax`], [`crate::norm`], [`crate::cross_entropy`]) except where a doc says
//! otherwise: sums run in a different order, and the embedding backward adds with atomics.

use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use half::bf16;

use super::alloc::Buffer;
use super::device::Device;
use super::error::{check_len, CudaError, OpContext, Result};
use super::nvrtc::Module;
use crate::cross_entropy::CrossEntropySpec;

/// Binary elementwise operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinaryOp {
    /// `a + b`
    Add,
    /// `a − b`
    Sub,
    /// `a · b`
    Mul,
    /// `a / b`
    Div,
    /// `max(a, b)`
    Max,
    /// `min(a, b)`
    Min,
}

/// Unary activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnaryOp {
    /// `exp(x)`
    Exp,
    /// GELU, tanh approximation.
    GeluTanh,
    /// `x · sigmoid(x)`
    Silu,
    /// `max(x, 0)`
    Relu,
    /// GELU, exact erf form (PyTorch's default).
    GeluErf,
}

/// Hyper-parameters of one AdamW step (decoupled weight decay, bias correction).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
    /// Step number, starting at 1.
    pub step: u32,
}

/// Most dimensions a broadcast binary op takes.
pub const MAX_BROADCAST_DIMS: usize = 6;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct BroadcastShape {
    ndim: i32,
    shape: [i64; MAX_BROADCAST_DIMS],
    a_strides: [i64; MAX_BROADCAST_DIMS],
    b_strides: [i64; MAX_BROADCAST_DIMS],
}

// SAFETY: #[repr(C)] plain integers, laid out as the `BroadcastShape` struct in core.cu.
unsafe impl DeviceRepr for BroadcastShape {}

/// Threads per block of the elementwise kernels.
const BLOCK: u32 = 256;
/// Most blocks of a grid-stride launch.
const MAX_BLOCKS: usize = 1 << 16;

fn grid_stride(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, MAX_BLOCKS) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// One block per row, with enough threads for the row (a multiple of 32, at most 1024).
fn per_row(op: &'static str, rows: usize, cols: usize) -> Result<LaunchConfig> {
    let grid = u32::try_from(rows).map_err(|_| CudaError::Unsupported { op, what: format!("{rows} rows exceed u32") })?;
    let threads = (cols.div_ceil(32) * 32).clamp(32, 1024) as u32;
    Ok(LaunchConfig { grid_dim: (grid.max(1), 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 })
}

fn int(op: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| CudaError::Unsupported { op, what: format!("{v} exceeds i32") })
}

fn opt_ptr(b: Option<&Buffer<f32>>) -> u64 {
    b.map_or(0, |b| b.device_ptr())
}

/// Numpy-style broadcast of two shapes (aligned at the right); `None` when incompatible.
pub fn broadcast_shape(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let nd = a.len().max(b.len());
    let mut out = vec![0; nd];
    for i in 0..nd {
        let da = if i + a.len() >= nd { a[i + a.len() - nd] } else { 1 };
        let db = if i + b.len() >= nd { b[i + b.len() - nd] } else { 1 };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        };
    }
    Some(out)
}

impl Device {
    /// `out = a ∘ b` elementwise over equal lengths.
    pub fn binary(&self, op: BinaryOp, a: &Buffer<f32>, b: &Buffer<f32>, out: &mut Buffer<f32>) -> Result<()> {
        let n = a.len();
        check_len("binary", "b", b.len(), n)?;
        check_len("binary", "out", out.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(Module::Core, "binary_contig_f32")?;
        let (opi, ap, bp, op_, n64) = (op as i32, a.device_ptr(), b.device_ptr(), out.device_ptr(), n as i64);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&opi).arg(&ap).arg(&bp).arg(&op_).arg(&n64);
        // SAFETY: all three buffers hold at least n f32s, checked above.
        unsafe { l.launch(grid_stride(n)) }.op("binary")?;
        Ok(())
    }

    /// `out = a ∘ b` with numpy broadcasting of `a_shape` and `b_shape` (contiguous inputs);
    /// `out` is contiguous with the broadcast shape, which is returned.
    pub fn broadcast_binary(
        &self,
        op: BinaryOp,
        a: &Buffer<f32>,
        a_shape: &[usize],
        b: &Buffer<f32>,
        b_shape: &[usize],
        out: &mut Buffer<f32>,
    ) -> Result<Vec<usize>> {
        const OP: &str = "broadcast_binary";
        let shape = broadcast_shape(a_shape, b_shape)
            .ok_or_else(|| CudaError::Unsupported { op: OP, what: format!("shapes {a_shape:?} and {b_shape:?} do not broadcast") })?;
        if shape.len() > MAX_BROADCAST_DIMS {
            return Err(CudaError::Unsupported { op: OP, what: format!("{} dims (at most {MAX_BROADCAST_DIMS})", shape.len()) });
        }
        let n: usize = shape.iter().product();
        check_len(OP, "a", a.len(), a_shape.iter().product())?;
        check_len(OP, "b", b.len(), b_shape.iter().product())?;
        check_len(OP, "out", out.len(), n)?;
        if n == 0 {
            return Ok(shape);
        }
        let mut desc = BroadcastShape { ndim: shape.len() as i32, ..Default::default() };
        let nd = shape.len();
        for (src_shape, strides) in [(a_shape, &mut desc.a_strides), (b_shape, &mut desc.b_strides)] {
            let mut stride = 1i64;
            for i in (0..nd).rev() {
                let dim = if i + src_shape.len() >= nd { src_shape[i + src_shape.len() - nd] } else { 1 };
                strides[i] = if dim == 1 { 0 } else { stride };
                stride *= dim as i64;
            }
        }
        for (d, &s) in shape.iter().enumerate() {
            desc.shape[d] = s as i64;
        }
        let f = self.function(Module::Core, "binary_broadcast_f32")?;
        let (opi, ap, bp, op_, n64) = (op as i32, a.device_ptr(), b.device_ptr(), out.device_ptr(), n as i64);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&opi).arg(&ap).arg(&bp).arg(&op_).arg(&n64).arg(&desc);
        // SAFETY: every index the kernel forms is < the checked product of its operand's shape.
        unsafe { l.launch(grid_stride(n)) }.op(OP)?;
        Ok(shape)
    }

    /// `y = f(x)`.
    pub fn unary(&self, op: UnaryOp, x: &Buffer<f32>, y: &mut Buffer<f32>) -> Result<()> {
        let n = x.len();
        check_len("unary", "y", y.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(Module::Core, "unary_f32")?;
        let (opi, xp, yp, n64) = (op as i32, x.device_ptr(), y.device_ptr(), n as i64);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&opi).arg(&xp).arg(&yp).arg(&n64);
        // SAFETY: both buffers hold at least n f32s.
        unsafe { l.launch(grid_stride(n)) }.op("unary")?;
        Ok(())
    }

    /// `dx = dy · f'(x)`.
    pub fn unary_backward(&self, op: UnaryOp, x: &Buffer<f32>, dy: &Buffer<f32>, dx: &mut Buffer<f32>) -> Result<()> {
        let n = x.len();
        check_len("unary_backward", "dy", dy.len(), n)?;
        check_len("unary_backward", "dx", dx.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(Module::Core, "unary_backward_f32")?;
        let (opi, xp, gp, dp, n64) = (op as i32, x.device_ptr(), dy.device_ptr(), dx.device_ptr(), n as i64);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&opi).arg(&xp).arg(&gp).arg(&dp).arg(&n64);
        // SAFETY: all buffers hold at least n f32s.
        unsafe { l.launch(grid_stride(n)) }.op("unary_backward")?;
        Ok(())
    }

    /// Softmax of each row of `n_cols` (rows = `x.len() / n_cols`).
    pub fn softmax_rows(&self, x: &Buffer<f32>, n_cols: usize, y: &mut Buffer<f32>) -> Result<()> {
        let rows = rows_of("softmax_rows", x.len(), n_cols)?;
        check_len("softmax_rows", "y", y.len(), x.len())?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(Module::Core, "softmax_rows_f32")?;
        let (xp, yp, n) = (x.device_ptr(), y.device_ptr(), int("softmax_rows", n_cols)?);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&xp).arg(&yp).arg(&n);
        // SAFETY: rows·n_cols elements in both buffers.
        unsafe { l.launch(per_row("softmax_rows", rows, n_cols)?) }.op("softmax_rows")?;
        Ok(())
    }

    /// Softmax backward per row: `dx = y ⊙ (dy − Σ y ⊙ dy)`.
    pub fn softmax_backward_rows(&self, y: &Buffer<f32>, dy: &Buffer<f32>, n_cols: usize, dx: &mut Buffer<f32>) -> Result<()> {
        const OP: &str = "softmax_backward_rows";
        let rows = rows_of(OP, y.len(), n_cols)?;
        check_len(OP, "dy", dy.len(), y.len())?;
        check_len(OP, "dx", dx.len(), y.len())?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(Module::Core, "softmax_backward_rows_f32")?;
        let (yp, gp, dp, n) = (y.device_ptr(), dy.device_ptr(), dx.device_ptr(), int(OP, n_cols)?);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&yp).arg(&gp).arg(&dp).arg(&n);
        // SAFETY: rows·n_cols elements in every buffer.
        unsafe { l.launch(per_row(OP, rows, n_cols)?) }.op(OP)?;
        Ok(())
    }

    /// Layer norm forward over rows of `n`; writes `y`, `mean` and `rstd` (one per row).
    #[allow(clippy::too_many_arguments)]
    pub fn layer_norm_forward(
        &self,
        x: &Buffer<f32>,
        n: usize,
        w: Option<&Buffer<f32>>,
        b: Option<&Buffer<f32>>,
        eps: f32,
        y: &mut Buffer<f32>,
        mean: &mut Buffer<f32>,
        rstd: &mut Buffer<f32>,
    ) -> Result<()> {
        const OP: &str = "layer_norm_forward";
        let rows = rows_of(OP, x.len(), n)?;
        check_params(OP, w, b, n)?;
        check_len(OP, "y", y.len(), x.len())?;
        check_len(OP, "mean", mean.len(), rows)?;
        check_len(OP, "rstd", rstd.len(), rows)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(Module::Core, "layer_norm_forward_f32")?;
        let (xp, wp, bp, yp, mp, rp, ni) = (x.device_ptr(), opt_ptr(w), opt_ptr(b), y.device_ptr(), mean.device_ptr(), rstd.device_ptr(), int(OP, n)?);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&xp).arg(&wp).arg(&bp).arg(&yp).arg(&mp).arg(&rp).arg(&ni).arg(&eps);
        // SAFETY: lengths checked above; absent parameters are null and the kernel skips them.
        unsafe { l.launch(per_row(OP, rows, n)?) }.op(OP)?;
        Ok(())
    }

    /// Layer norm backward: writes `dx`; adds into `dw` and `db` when given.
    #[allow(clippy::too_many_arguments)]
    pub fn layer_norm_backward(
        &self,
        x: &Buffer<f32>,
        n: usize,
        w: Option<&Buffer<f32>>,
        mean: &Buffer<f32>,
        rstd: &Buffer<f32>,
        dy: &Buffer<f32>,
        dx: &mut Buffer<f32>,
        dw: Option<&mut Buffer<f32>>,
        db: Option<&mut Buffer<f32>>,
    ) -> Result<()> {
        const OP: &str = "layer_norm_backward";
        let rows = rows_of(OP, x.len(), n)?;
        check_params(OP, w, None, n)?;
        check_len(OP, "mean", mean.len(), rows)?;
        check_len(OP, "rstd", rstd.len(), rows)?;
        check_len(OP, "dy", dy.len(), x.len())?;
        check_len(OP, "dx", dx.len(), x.len())?;
        check_params(OP, dw.as_deref(), db.as_deref(), n)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(Module::Core, "layer_norm_backward_f32")?;
        let (xp, wp, mp, rp, gp, dp, ni) = (x.device_ptr(), opt_ptr(w), mean.device_ptr(), rstd.device_ptr(), dy.device_ptr(), dx.device_ptr(), int(OP, n)?);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&xp).arg(&wp).arg(&mp).arg(&rp).arg(&gp).arg(&dp).arg(&ni);
        // SAFETY: lengths checked above.
        unsafe { l.launch(per_row(OP, rows, n)?) }.op(OP)?;
        self.norm_param_grads(x, Some(mean), rstd, dy, dw, db, rows, n)
    }

    /// RMS norm forward over rows of `n`; writes `y` and `rstd`.
    pub fn rms_norm_forward(&self, x: &Buffer<f32>, n: usize, w: Option<&Buffer<f32>>, eps: f32, y: &mut Buffer<f32>, rstd: &mut Buffer<f32>) -> Result<()> {
        const OP: &str = "rms_norm_forward";
        let rows = rows_of(OP, x.len(), n)?;
        check_params(OP, w, None, n)?;
        check_len(OP, "y", y.len(), x.len())?;
        check_len(OP, "rstd", rstd.len(), rows)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(Module::Core, "rms_norm_forward_f32")?;
        let (xp, wp, yp, rp, ni) = (x.device_ptr(), opt_ptr(w), y.device_ptr(), rstd.device_ptr(), int(OP, n)?);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&xp).arg(&wp).arg(&yp).arg(&rp).arg(&ni).arg(&eps);
        // SAFETY: lengths checked above.
        unsafe { l.launch(per_row(OP, rows, n)?) }.op(OP)?;
        Ok(())
    }

    /// RMS norm backward: writes `dx`; adds into `dw` when given.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_backward(
        &self,
        x: &Buffer<f32>,
        n: usize,
        w: Option<&Buffer<f32>>,
        rstd: &Buffer<f32>,
        dy: &Buffer<f32>,
        dx: &mut Buffer<f32>,
        dw: Option<&mut Buffer<f32>>,
    ) -> Result<()> {
        const OP: &str = "rms_norm_backward";
        let rows = rows_of(OP, x.len(), n)?;
        check_params(OP, w, None, n)?;
        check_len(OP, "rstd", rstd.len(), rows)?;
        check_len(OP, "dy", dy.len(), x.len())?;
        check_len(OP, "dx", dx.len(), x.len())?;
        check_params(OP, dw.as_deref(), None, n)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(Module::Core, "rms_norm_backward_f32")?;
        let (xp, wp, rp, gp, dp, ni) = (x.device_ptr(), opt_ptr(w), rstd.device_ptr(), dy.device_ptr(), dx.device_ptr(), int(OP, n)?);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&xp).arg(&wp).arg(&rp).arg(&gp).arg(&dp).arg(&ni);
        // SAFETY: lengths checked above.
        unsafe { l.launch(per_row(OP, rows, n)?) }.op(OP)?;
        self.norm_param_grads(x, None, rstd, dy, dw, None, rows, n)
    }

    #[allow(clippy::too_many_arguments)]
    fn norm_param_grads(
        &self,
        x: &Buffer<f32>,
        mean: Option<&Buffer<f32>>,
        rstd: &Buffer<f32>,
        dy: &Buffer<f32>,
        dw: Option<&mut Buffer<f32>>,
        db: Option<&mut Buffer<f32>>,
        rows: usize,
        n: usize,
    ) -> Result<()> {
        if dw.is_none() && db.is_none() {
            return Ok(());
        }
        let f = self.function(Module::Core, "norm_param_grads_f32")?;
        let (xp, mp, rp, gp) = (x.device_ptr(), opt_ptr(mean), rstd.device_ptr(), dy.device_ptr());
        let (wp, bp) = (dw.map_or(0, |b| b.device_ptr()), db.map_or(0, |b| b.device_ptr()));
        let (ri, ni) = (int("norm_param_grads", rows)?, int("norm_param_grads", n)?);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&xp).arg(&mp).arg(&rp).arg(&gp).arg(&wp).arg(&bp).arg(&ri).arg(&ni);
        let cfg = LaunchConfig { grid_dim: (n.div_ceil(BLOCK as usize) as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the callers checked every length against rows and n.
        unsafe { l.launch(cfg) }.op("norm_param_grads")?;
        Ok(())
    }

    /// Fused softmax-cross-entropy over rows of `spec.n_classes`: per-row `losses` (0 for
    /// ignored rows, NaN for a target out of range) and, when given, the logits gradient
    /// `p − q` per row (not divided by the number of rows).
    pub fn cross_entropy(
        &self,
        logits: &Buffer<f32>,
        targets: &Buffer<u32>,
        spec: CrossEntropySpec,
        losses: &mut Buffer<f32>,
        grad: Option<&mut Buffer<f32>>,
    ) -> Result<()> {
        const OP: &str = "cross_entropy";
        let (rows, c) = (targets.len(), spec.n_classes);
        check_len(OP, "logits", logits.len(), rows * c)?;
        check_len(OP, "losses", losses.len(), rows)?;
        if let Some(g) = grad.as_deref() {
            check_len(OP, "grad", g.len(), rows * c)?;
        }
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(Module::Core, "cross_entropy_f32")?;
        let (lp, tp, op_, gp) = (logits.device_ptr(), targets.device_ptr(), losses.device_ptr(), grad.map_or(0, |g| g.device_ptr()));
        // Targets are u32 here: an ignore index no u32 can equal (PyTorch's -100) ignores nothing.
        let ignore_u32 = spec.ignore_index.and_then(|i| u32::try_from(i).ok());
        let (ci, has_ignore, ignore, smoothing) = (int(OP, c)?, ignore_u32.is_some() as i32, ignore_u32.unwrap_or(0), spec.label_smoothing as f32);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&lp).arg(&tp).arg(&op_).arg(&gp).arg(&ci).arg(&has_ignore).arg(&ignore).arg(&smoothing);
        // SAFETY: lengths checked above; the kernel never indexes with an out-of-range target.
        unsafe { l.launch(per_row(OP, rows, c)?) }.op(OP)?;
        Ok(())
    }

    /// `out[r] = table[ids[r]]` for rows of `dim`. Ids must be below the table's row count
    /// (not checked on the device).
    pub fn embedding_forward(&self, table: &Buffer<f32>, dim: usize, ids: &Buffer<u32>, out: &mut Buffer<f32>) -> Result<()> {
        const OP: &str = "embedding_forward";
        check_len(OP, "out", out.len(), ids.len() * dim)?;
        if ids.is_empty() || dim == 0 {
            return Ok(());
        }
        let f = self.function(Module::Core, "embedding_forward_f32")?;
        let (tp, ip, op_, n, d) = (table.device_ptr(), ids.device_ptr(), out.device_ptr(), ids.len() as i64, int(OP, dim)?);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&tp).arg(&ip).arg(&op_).arg(&n).arg(&d);
        // SAFETY: out holds ids·dim elements; the caller guarantees ids index the table.
        unsafe { l.launch(grid_stride(ids.len() * dim)) }.op(OP)?;
        Ok(())
    }

    /// `dtable[ids[r]] += dout[r]` (atomic adds: the order of additions into a row repeated in
    /// `ids` is not fixed).
    pub fn embedding_backward(&self, dout: &Buffer<f32>, ids: &Buffer<u32>, dim: usize, dtable: &mut Buffer<f32>) -> Result<()> {
        const OP: &str = "embedding_backward";
        check_len(OP, "dout", dout.len(), ids.len() * dim)?;
        if ids.is_empty() || dim == 0 {
            return Ok(());
        }
        let f = self.function(Module::Core, "embedding_backward_f32")?;
        let (gp, ip, tp, n, d) = (dout.device_ptr(), ids.device_ptr(), dtable.device_ptr(), ids.len() as i64, int(OP, dim)?);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&gp).arg(&ip).arg(&tp).arg(&n).arg(&d);
        // SAFETY: dout holds ids·dim elements; the caller guarantees ids index the table.
        unsafe { l.launch(grid_stride(ids.len() * dim)) }.op(OP)?;
        Ok(())
    }

    /// One fused AdamW step over `params` in place, updating the moments `m` and `v`.
    pub fn adamw(&self, params: &mut Buffer<f32>, grads: &Buffer<f32>, m: &mut Buffer<f32>, v: &mut Buffer<f32>, hp: AdamW) -> Result<()> {
        const OP: &str = "adamw";
        let n = params.len();
        check_len(OP, "grads", grads.len(), n)?;
        check_len(OP, "m", m.len(), n)?;
        check_len(OP, "v", v.len(), n)?;
        if hp.step == 0 {
            return Err(CudaError::Unsupported { op: OP, what: "step 0 (steps start at 1)".into() });
        }
        if n == 0 {
            return Ok(());
        }
        let bc1 = 1.0 - (hp.beta1 as f64).powi(hp.step as i32);
        let bc2 = 1.0 - (hp.beta2 as f64).powi(hp.step as i32);
        let f = self.function(Module::Core, "adamw_f32")?;
        let (pp, gp, mp, vp, n64) = (params.device_ptr(), grads.device_ptr(), m.device_ptr(), v.device_ptr(), n as i64);
        let (bc1, bc2) = (bc1 as f32, bc2 as f32);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&pp).arg(&gp).arg(&mp).arg(&vp).arg(&n64).arg(&hp.lr).arg(&hp.beta1).arg(&hp.beta2).arg(&hp.eps).arg(&hp.weight_decay).arg(&bc1).arg(&bc2);
        // SAFETY: all four buffers hold n f32s.
        unsafe { l.launch(grid_stride(n)) }.op(OP)?;
        Ok(())
    }

    /// Rounds f32 to bf16 (nearest even).
    pub fn cast_f32_to_bf16(&self, x: &Buffer<f32>, y: &mut Buffer<bf16>) -> Result<()> {
        check_len("cast_f32_to_bf16", "y", y.len(), x.len())?;
        self.cast("cast_f32_bf16", x.device_ptr(), y.device_ptr(), x.len())
    }

    /// Widens bf16 to f32.
    pub fn cast_bf16_to_f32(&self, x: &Buffer<bf16>, y: &mut Buffer<f32>) -> Result<()> {
        check_len("cast_bf16_to_f32", "y", y.len(), x.len())?;
        self.cast("cast_bf16_f32", x.device_ptr(), y.device_ptr(), x.len())
    }

    fn cast(&self, name: &'static str, x: u64, y: u64, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let f = self.function(Module::Core, name)?;
        let n64 = n as i64;
        let mut l = self.stream().launch_builder(&f);
        l.arg(&x).arg(&y).arg(&n64);
        // SAFETY: the callers checked both lengths.
        unsafe { l.launch(grid_stride(n)) }.op(name)?;
        Ok(())
    }
}

fn rows_of(op: &'static str, len: usize, n_cols: usize) -> Result<usize> {
    if n_cols == 0 {
        return if len == 0 { Ok(0) } else { Err(CudaError::Unsupported { op, what: "zero columns".into() }) };
    }
    if !len.is_multiple_of(n_cols) {
        return Err(CudaError::Unsupported { op, what: format!("length {len} is not a multiple of the row length {n_cols}") });
    }
    Ok(len / n_cols)
}

fn check_params(op: &'static str, w: Option<&Buffer<f32>>, b: Option<&Buffer<f32>>, n: usize) -> Result<()> {
    if let Some(w) = w {
        check_len(op, "weight", w.len(), n)?;
    }
    if let Some(b) = b {
        check_len(op, "bias", b.len(), n)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcast_shapes_follow_numpy() {
        // Goal: the host-side shape rule the broadcast kernel relies on.
        assert_eq!(broadcast_shape(&[4, 1, 3], &[5, 1]), Some(vec![4, 5, 3]));
        assert_eq!(broadcast_shape(&[3], &[2, 3]), Some(vec![2, 3]));
        assert_eq!(broadcast_shape(&[2], &[3]), None);
        assert_eq!(std::mem::size_of::<BroadcastShape>(), 8 + 3 * 8 * MAX_BROADCAST_DIMS);
    }
}
