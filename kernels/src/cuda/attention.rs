//! Flash attention on the GPU, head dims 64 and 128, causal or not, forward and backward,
//! without storing any `T × T` matrix, in two precisions:
//!
//! - f32 (the `attention` NVRTC module): CUDA cores, one warp per row, the exact path that the
//!   1e-5 check holds to;
//! - bf16 (the `attention_bf16` module): tensor cores (`mma.sync` m16n8k16, f32 accumulation and
//!   softmax), blocks of 16 query rows (forward) or keys (backward) per warp — 8 warps at head
//!   dim 64, 4 at 128 — K/V (or Q/dO) tiles of 64 rows double-buffered in shared memory with
//!   `cp.async`, FlashAttention-2's register re-packing of P as the A operand of P·V.
//!
//! Layout: the f32 path takes Q as `[heads, tq, d]`, K and V `[heads, tk, d]`, O `[heads, tq, d]`,
//! all contiguous (`heads` is batch × heads). The bf16 path addresses every operand through a
//! [`HeadLayout`], so it also reads the heads of packed QKV in place and writes O and the
//! gradients straight into `[batch, t, ·]` rows. The forward saves one log-sum-exp per query row
//! (`lse`, `[heads, tq]`, f32); the backward recomputes the probabilities from it, first forming
//! `delta = Σ dO ⊙ O` per row. The f32 backward then forms dQ (per query block) and dK, dV (per
//! key block) in two kernels; the bf16 backward makes one pass per key block and adds the key
//! blocks' dQ parts in a fixed order. Both are bit-identical run to run (no unordered float
//! atomics). The causal mask and the scale match [`crate::attention`] (query `i` sees keys
//! `j ≤ i`).

use std::sync::atomic::Ordering;

use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use half::bf16;

use super::alloc::Buffer;
use super::device::Device;
use super::error::{check_len, CudaError, OpContext, Result};
use super::mixed::HeadLayout;
use super::nvrtc::Module;

/// Query rows (or keys, in the backward) per block of 4 warps of the bf16 tensor-core kernels,
/// 16 per warp.
const BF_ROWS: usize = 64;
/// Query rows per block of the bf16 forward at head dim 64 unless a device says otherwise
/// (`Device::set_flash_forward_bf16_rows`): 8 warps (`flash_forward_bf16_r128_d64`).
const FWD_ROWS_D64: usize = 128;
/// Keys per shared-memory tile of the bf16 forward, and query rows per tile of the backward;
/// must match `BF_KEYS` in attention_bf16.cu.
const BF_KEYS: usize = 64;
/// Keys per block of the bf16 backward at head dim 64 unless a device says otherwise
/// (`Device::set_flash_backward_bf16_keys`): 8 warps of 16 keys (`flash_backward_bf16_k128_d64`).
const BWD_KEYS_D64: usize = 128;

/// Rows (warps) per block in the attention kernels; must match `WARPS` in attention.cu.
const WARPS: usize = 8;
/// Rows per shared-memory tile; must match `TILE` in attention.cu.
const TILE: usize = 32;

/// Sizes and options of one flash-attention call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlashSpec {
    /// Batch × heads.
    pub heads: usize,
    /// Query rows per head.
    pub tq: usize,
    /// Key and value rows per head.
    pub tk: usize,
    /// Head dim (64 or 128).
    pub d: usize,
    /// Whether query `i` sees only keys `j ≤ i`.
    pub causal: bool,
    /// Factor on the scores (usually `1/sqrt(d)`).
    pub scale: f32,
}

impl FlashSpec {
    /// The layout of a contiguous `[heads, t, d]` buffer, for the strided bf16 entry points.
    pub fn heads_layout(&self, t: usize) -> HeadLayout {
        HeadLayout { batch: self.heads, seq: t, heads: 1, head_dim: self.d, row_stride: self.d, col_offset: 0 }
    }

    /// FLOPs of the forward (two matmuls; halved when causal and square).
    pub fn forward_flops(&self) -> f64 {
        let full = 4.0 * self.heads as f64 * self.tq as f64 * self.tk as f64 * self.d as f64;
        if self.causal {
            full / 2.0
        } else {
            full
        }
    }

    fn check(&self, op: &'static str) -> Result<(i32, i32)> {
        if self.d != 64 && self.d != 128 {
            return Err(CudaError::Unsupported { op, what: format!("head dim {} (64 or 128)", self.d) });
        }
        let tq = i32::try_from(self.tq).map_err(|_| CudaError::Unsupported { op, what: "tq exceeds i32".into() })?;
        let tk = i32::try_from(self.tk).map_err(|_| CudaError::Unsupported { op, what: "tk exceeds i32".into() })?;
        if !(self.scale > 0.0 && self.scale.is_finite()) {
            return Err(CudaError::Unsupported { op, what: format!("scale {} (must be positive and finite)", self.scale) });
        }
        if self.heads > 65535 {
            return Err(CudaError::Unsupported { op, what: format!("{} heads (at most 65535)", self.heads) });
        }
        Ok((tq, tk))
    }

    fn grid(&self, rows: usize, smem_floats: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (rows.div_ceil(WARPS).max(1) as u32, self.heads as u32, 1),
            block_dim: ((WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: (smem_floats * 4) as u32,
        }
    }
}

impl Device {
    /// Forward: writes `out` (`[heads, tq, d]`) and `lse` (`[heads, tq]`).
    pub fn flash_attention_forward(
        &self,
        spec: FlashSpec,
        q: &Buffer<f32>,
        k: &Buffer<f32>,
        v: &Buffer<f32>,
        out: &mut Buffer<f32>,
        lse: &mut Buffer<f32>,
    ) -> Result<()> {
        const OP: &str = "flash_attention_forward";
        let (tq, tk) = spec.check(OP)?;
        let FlashSpec { heads, d, .. } = spec;
        check_len(OP, "q", q.len(), heads * spec.tq * d)?;
        check_len(OP, "k", k.len(), heads * spec.tk * d)?;
        check_len(OP, "v", v.len(), heads * spec.tk * d)?;
        check_len(OP, "out", out.len(), heads * spec.tq * d)?;
        check_len(OP, "lse", lse.len(), heads * spec.tq)?;
        if heads == 0 || spec.tq == 0 {
            return Ok(());
        }
        let name = if d == 64 { "flash_forward_d64" } else { "flash_forward_d128" };
        let f = self.function(Module::Attention, name)?;
        let (qp, kp, vp, op_, lp) = (q.device_ptr(), k.device_ptr(), v.device_ptr(), out.device_ptr(), lse.device_ptr());
        let (causal, scale) = (spec.causal as i32, spec.scale);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&qp).arg(&kp).arg(&vp).arg(&op_).arg(&lp).arg(&tq).arg(&tk).arg(&causal).arg(&scale);
        let smem = TILE * (d + 1) + TILE * d + WARPS * d;
        // SAFETY: lengths checked above; shared memory matches the kernel's layout (< 48 KiB).
        unsafe { l.launch(spec.grid(spec.tq, smem)) }.op(OP)?;
        Ok(())
    }

    /// Forward on bf16 tensor cores (`mma.sync`, f32 accumulation and softmax) on contiguous
    /// `[heads, t, d]` operands: `q`, `k`, `v` and `out` are bf16, `lse` is f32 as in
    /// [`Device::flash_attention_forward`].
    pub fn flash_attention_forward_bf16(
        &self,
        spec: FlashSpec,
        q: &Buffer<bf16>,
        k: &Buffer<bf16>,
        v: &Buffer<bf16>,
        out: &mut Buffer<bf16>,
        lse: &mut Buffer<f32>,
    ) -> Result<()> {
        let (lq, lk) = (spec.heads_layout(spec.tq), spec.heads_layout(spec.tk));
        self.flash_attention_forward_bf16_strided(spec, (q, lq), (k, lk), (v, lk), (out, lq), lse)
    }

    /// Forward on bf16 tensor cores with each operand's rows where its [`HeadLayout`] says: the
    /// heads of packed QKV are read in place and the output can go straight into merged
    /// `[batch, t, heads·d]` rows (no head copies). `lse` is f32 `[heads, tq]`.
    pub fn flash_attention_forward_bf16_strided(
        &self,
        spec: FlashSpec,
        q: (&Buffer<bf16>, HeadLayout),
        k: (&Buffer<bf16>, HeadLayout),
        v: (&Buffer<bf16>, HeadLayout),
        out: (&mut Buffer<bf16>, HeadLayout),
        lse: &mut Buffer<f32>,
    ) -> Result<()> {
        const OP: &str = "flash_attention_forward_bf16";
        let (tq, tk) = spec.check(OP)?;
        let FlashSpec { heads, d, .. } = spec;
        let mut a = AttnArgs::new(spec, tq, tk);
        a.lq = head_rows(OP, "q", &spec, spec.tq, q.0.len(), q.1)?;
        a.lk = head_rows(OP, "k", &spec, spec.tk, k.0.len(), k.1)?;
        a.lv = head_rows(OP, "v", &spec, spec.tk, v.0.len(), v.1)?;
        a.lo = head_rows(OP, "out", &spec, spec.tq, out.0.len(), out.1)?;
        check_len(OP, "lse", lse.len(), heads * spec.tq)?;
        if heads == 0 || spec.tq == 0 {
            return Ok(());
        }
        (a.q, a.k, a.v, a.o, a.lse) = (q.0.device_ptr(), k.0.device_ptr(), v.0.device_ptr(), out.0.device_ptr(), lse.device_ptr());
        // Query rows per block: 128 (8 warps) at head dim 64 by default, 64 (4 warps) otherwise.
        let rows = match (d, self.fwd_rows.load(Ordering::Relaxed)) {
            (64, 0) => FWD_ROWS_D64,
            (64, r @ (128 | 256)) => r,
            _ => BF_ROWS,
        };
        let name = match (d, rows) {
            (64, 128) => "flash_forward_bf16_r128_d64",
            (64, 256) => "flash_forward_bf16_r256_d64",
            (64, _) => "flash_forward_bf16_d64",
            _ => "flash_forward_bf16_d128",
        };
        let f = self.function(Module::AttentionBf16, name)?;
        let mut l = self.stream().launch_builder(&f);
        l.arg(&a);
        // Two buffers of a K and a V tile.
        let smem_bytes = 4 * BF_KEYS * (d + 8) * 2;
        allow_smem(&f, smem_bytes, OP)?;
        // 16 rows per warp.
        let threads = (rows / 16 * 32) as u32;
        let cfg = LaunchConfig { grid_dim: (spec.tq.div_ceil(rows) as u32, heads as u32, 1), block_dim: (threads, 1, 1), shared_mem_bytes: smem_bytes as u32 };
        // SAFETY: every operand's rows were checked to lie inside its buffer and to start
        // 16-byte aligned (row strides and offsets are multiples of 8 elements, buffers start
        // 512-byte aligned); `AttnArgs` mirrors the kernel's struct; shared memory matches the
        // kernel's layout and was allowed above.
        unsafe { l.launch(cfg) }.op(OP)?;
        Ok(())
    }

    /// Backward on bf16 tensor cores from the bf16 forward's `out` and `lse` and a bf16 output
    /// gradient, one pass per key block (FlashAttention-2: S and dP formed once per tile). Each
    /// operand's rows are where its [`HeadLayout`] says; dQ, dK and dV are written as bf16 into
    /// `grads` at `grad_layouts` (in that order; they must not overlap), e.g. straight into
    /// the gradient of packed QKV. Deterministic: the key blocks' dQ parts are added in a fixed
    /// order (see attention_bf16.cu), so the result is bit-identical run to run.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attention_backward_bf16(
        &self,
        spec: FlashSpec,
        q: (&Buffer<bf16>, HeadLayout),
        k: (&Buffer<bf16>, HeadLayout),
        v: (&Buffer<bf16>, HeadLayout),
        out: (&Buffer<bf16>, HeadLayout),
        lse: &Buffer<f32>,
        dout: (&Buffer<bf16>, HeadLayout),
        grads: &mut Buffer<bf16>,
        grad_layouts: [HeadLayout; 3],
    ) -> Result<()> {
        const OP: &str = "flash_attention_backward_bf16";
        let (tq, tk) = spec.check(OP)?;
        let FlashSpec { heads, d, .. } = spec;
        let mut a = AttnArgs::new(spec, tq, tk);
        a.lq = head_rows(OP, "q", &spec, spec.tq, q.0.len(), q.1)?;
        a.lk = head_rows(OP, "k", &spec, spec.tk, k.0.len(), k.1)?;
        a.lv = head_rows(OP, "v", &spec, spec.tk, v.0.len(), v.1)?;
        a.lo = head_rows(OP, "out", &spec, spec.tq, out.0.len(), out.1)?;
        a.lg = head_rows(OP, "dout", &spec, spec.tq, dout.0.len(), dout.1)?;
        a.ldq = head_rows(OP, "dq", &spec, spec.tq, grads.len(), grad_layouts[0])?;
        a.ldk = head_rows(OP, "dk", &spec, spec.tk, grads.len(), grad_layouts[1])?;
        a.ldv = head_rows(OP, "dv", &spec, spec.tk, grads.len(), grad_layouts[2])?;
        check_len(OP, "lse", lse.len(), heads * spec.tq)?;
        if heads == 0 || (spec.tq == 0 && spec.tk == 0) {
            return Ok(());
        }
        // Keys per block: 128 (8 warps) at head dim 64 by default, 64 (4 warps) otherwise.
        let keys = match (d, self.bwd_keys.load(Ordering::Relaxed)) {
            (64, 0) => BWD_KEYS_D64,
            (64, k @ (128 | 256)) => k,
            _ => BF_ROWS,
        };
        let (nq, nk) = (spec.tq.div_ceil(BF_KEYS), spec.tk.div_ceil(keys));
        let rows = heads * spec.tq;
        let delta = self.alloc::<f32>(rows.max(1))?;
        let counters = self.alloc::<u32>((heads * nq).max(1))?;
        let dq_acc = self.alloc::<f32>((rows * d).max(1))?;
        (a.q, a.k, a.v, a.o, a.dout, a.lse) = (q.0.device_ptr(), k.0.device_ptr(), v.0.device_ptr(), out.0.device_ptr(), dout.0.device_ptr(), lse.device_ptr());
        (a.dq, a.dk, a.dv) = (grads.device_ptr(), grads.device_ptr(), grads.device_ptr());
        (a.delta, a.counters, a.dq_acc) = (delta.device_ptr(), counters.device_ptr(), dq_acc.device_ptr());
        // Rotating the walk needs one head's key blocks resident together (attention_bf16.cu).
        let sms = self.stream().context().attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).op(OP)?;
        a.probe = self.bwd_probe.load(Ordering::Relaxed);
        a.rotate = i32::from(!spec.causal && spec.tq == spec.tk && nk <= usize::try_from(sms).unwrap_or(0));
        if rows > 0 {
            let f = self.function(Module::AttentionBf16, "flash_backward_delta_bf16")?;
            let (rows64, di, nc) = (rows as i64, d as i32, (heads * nq) as i32);
            let mut l = self.stream().launch_builder(&f);
            l.arg(&a).arg(&rows64).arg(&di).arg(&nc);
            let cfg = LaunchConfig { grid_dim: (rows.div_ceil(8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: out, dout and (with no keys) dq rows were checked above; delta holds
            // `rows` and counters `heads · nq` ≤ `rows` elements.
            unsafe { l.launch(cfg) }.op(OP)?;
        }
        if nk > 0 {
            let name = match (d, keys) {
                (64, 128) => "flash_backward_bf16_k128_d64",
                (64, 256) => "flash_backward_bf16_k256_d64",
                (64, _) => "flash_backward_bf16_d64",
                _ => "flash_backward_bf16_d128",
            };
            let f = self.function(Module::AttentionBf16, name)?;
            // K and V rows and the dSᵀ tile (`keys` rows each), two buffers of a Q and a dO
            // tile, two of the row statistics.
            let smem = 3 * keys * (d + 8) * 2 + 4 * BF_KEYS * (d + 8) * 2 + 4 * BF_KEYS * 4;
            allow_smem(&f, smem, OP)?;
            let mut l = self.stream().launch_builder(&f);
            l.arg(&a);
            // 16 keys per warp.
            let threads = (keys / 16 * 32) as u32;
            let cfg = LaunchConfig { grid_dim: (nk as u32, heads as u32, 1), block_dim: (threads, 1, 1), shared_mem_bytes: smem as u32 };
            // SAFETY: every operand's rows were checked to lie inside its buffer, 16-byte
            // aligned; the scratch buffers hold what the kernel indexes (`dq_acc` heads·tq·d,
            // counters zeroed by the delta kernel just before on this stream); the grid walks
            // key blocks in the order the kernel's wait-free-of-deadlock argument needs; shared
            // memory matches the kernel's layout and was allowed above.
            unsafe { l.launch(cfg) }.op(OP)?;
        }
        // The scratch goes back to the cache; later users are queued behind these kernels.
        drop((delta, counters, dq_acc));
        Ok(())
    }

    /// Makes the bf16 backward skip parts of its work so a benchmark can time the rest: 1 = add
    /// the dQ parts in no order (races), 2 = no dQ at all, 4 = form the dQ parts but do not add
    /// them, 8 = add without forming them. The results are wrong; 0 restores. It affects only this
    /// device (see `AttnArgs.probe` in attention_bf16.cu).
    #[doc(hidden)]
    pub fn set_flash_backward_bf16_probe(&self, probe: i32) {
        self.bwd_probe.store(probe, Ordering::Relaxed);
    }

    /// Chooses the keys per block of the bf16 backward at head dim 64 on this device, so a
    /// benchmark can time the forms in one process: 64 (4 warps), 128 (8 warps) or 256 (16
    /// warps); 0 restores the default. Each gives results bit-identical run to run, not to each
    /// other (the dQ sums group the keys differently). Other head dims always use 64.
    #[doc(hidden)]
    pub fn set_flash_backward_bf16_keys(&self, keys: usize) {
        self.bwd_keys.store(keys, Ordering::Relaxed);
    }

    /// Chooses the query rows per block of the bf16 forward at head dim 64 on this device, so a
    /// benchmark can time the forms in one process: 64 (4 warps), 128 (8 warps) or 256 (16
    /// warps); 0 restores the default. All give the same bits (a row's sums do not depend on the
    /// block). Other head dims always use 64.
    #[doc(hidden)]
    pub fn set_flash_forward_bf16_rows(&self, rows: usize) {
        self.fwd_rows.store(rows, Ordering::Relaxed);
    }

    /// Backward from the forward's `out` and `lse` and the output gradient `dout`; writes `dq`,
    /// `dk` and `dv`.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attention_backward(
        &self,
        spec: FlashSpec,
        q: &Buffer<f32>,
        k: &Buffer<f32>,
        v: &Buffer<f32>,
        out: &Buffer<f32>,
        lse: &Buffer<f32>,
        dout: &Buffer<f32>,
        dq: &mut Buffer<f32>,
        dk: &mut Buffer<f32>,
        dv: &mut Buffer<f32>,
    ) -> Result<()> {
        const OP: &str = "flash_attention_backward";
        let (tq, tk) = spec.check(OP)?;
        let FlashSpec { heads, d, .. } = spec;
        let (nq, nk) = (heads * spec.tq * d, heads * spec.tk * d);
        for (name, len, needed) in [
            ("q", q.len(), nq),
            ("k", k.len(), nk),
            ("v", v.len(), nk),
            ("out", out.len(), nq),
            ("lse", lse.len(), heads * spec.tq),
            ("dout", dout.len(), nq),
            ("dq", dq.len(), nq),
            ("dk", dk.len(), nk),
            ("dv", dv.len(), nk),
        ] {
            check_len(OP, name, len, needed)?;
        }
        if heads == 0 {
            return Ok(());
        }
        if spec.tq == 0 {
            self.memset_zero(dk)?;
            return self.memset_zero(dv);
        }
        let rows = heads * spec.tq;
        let delta = self.alloc::<f32>(rows)?;
        let f = self.function(Module::Attention, "flash_backward_delta")?;
        let (op_, gp, dp, rows64, di) = (out.device_ptr(), dout.device_ptr(), delta.device_ptr(), rows as i64, d as i32);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&op_).arg(&gp).arg(&dp).arg(&rows64).arg(&di);
        let cfg = LaunchConfig { grid_dim: (rows.div_ceil(8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: out and dout hold rows·d elements, delta holds rows.
        unsafe { l.launch(cfg) }.op(OP)?;

        let (qp, kp, vp, lp) = (q.device_ptr(), k.device_ptr(), v.device_ptr(), lse.device_ptr());
        let (causal, scale) = (spec.causal as i32, spec.scale);
        let (dqp, dkp, dvp) = (dq.device_ptr(), dk.device_ptr(), dv.device_ptr());
        let name = if d == 64 { "flash_backward_dq_d64" } else { "flash_backward_dq_d128" };
        let f = self.function(Module::Attention, name)?;
        let mut l = self.stream().launch_builder(&f);
        l.arg(&qp).arg(&kp).arg(&vp).arg(&gp).arg(&lp).arg(&dp).arg(&dqp).arg(&tq).arg(&tk).arg(&causal).arg(&scale);
        let smem = 2 * TILE * (d + 1) + 2 * WARPS * d;
        // SAFETY: lengths checked above; shared memory matches the kernel's layout.
        unsafe { l.launch(spec.grid(spec.tq, smem)) }.op(OP)?;

        let name = if d == 64 { "flash_backward_dkv_d64" } else { "flash_backward_dkv_d128" };
        let f = self.function(Module::Attention, name)?;
        let mut l = self.stream().launch_builder(&f);
        l.arg(&qp).arg(&kp).arg(&vp).arg(&gp).arg(&lp).arg(&dp).arg(&dkp).arg(&dvp).arg(&tq).arg(&tk).arg(&causal).arg(&scale);
        let smem = 2 * TILE * (d + 1) + 2 * WARPS * d + 2 * TILE;
        // SAFETY: as above.
        unsafe { l.launch(spec.grid(spec.tk, smem)) }.op(OP)?;
        // `delta` goes back to the cache; later users are queued behind these kernels.
        drop(delta);
        Ok(())
    }
}

/// Where one bf16 operand's rows live; mirrors `HeadRows` in attention_bf16.cu: row `t` of head
/// `h` starts at element `off + (h / hpb)·batch + (h % hpb)·head + t·row`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct HeadRows {
    off: i64,
    row: i64,
    batch: i64,
    head: i64,
    hpb: i32,
    pad: i32,
}

/// Every argument of the bf16 kernels; mirrors `AttnArgs` in attention_bf16.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct AttnArgs {
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    dout: u64,
    dq: u64,
    dk: u64,
    dv: u64,
    lse: u64,
    delta: u64,
    dq_acc: u64,
    counters: u64,
    lq: HeadRows,
    lk: HeadRows,
    lv: HeadRows,
    lo: HeadRows,
    lg: HeadRows,
    ldq: HeadRows,
    ldk: HeadRows,
    ldv: HeadRows,
    tq: i32,
    tk: i32,
    causal: i32,
    rotate: i32,
    scale: f32,
    probe: i32,
}

// SAFETY: #[repr(C)] plain integers and floats (device pointers as u64), laid out as the
// `AttnArgs` struct in attention_bf16.cu.
unsafe impl DeviceRepr for AttnArgs {}

impl AttnArgs {
    fn new(spec: FlashSpec, tq: i32, tk: i32) -> AttnArgs {
        AttnArgs { tq, tk, causal: i32::from(spec.causal), scale: spec.scale, ..AttnArgs::default() }
    }
}

/// The kernel-side form of `layout` for a bf16 operand of `t` rows per head in a buffer of `len`
/// elements, after checking that it matches `spec`, stays inside the buffer and keeps rows
/// 16-byte aligned.
fn head_rows(op: &'static str, name: &'static str, spec: &FlashSpec, t: usize, len: usize, layout: HeadLayout) -> Result<HeadRows> {
    let HeadLayout { batch, seq, heads, head_dim, row_stride, col_offset } = layout;
    let bad = |what: String| Err(CudaError::Unsupported { op, what: format!("{name} layout {layout:?}: {what}") });
    if batch * heads != spec.heads || seq != t || head_dim != spec.d {
        return bad(format!("does not describe {} heads of {t} rows of {}", spec.heads, spec.d));
    }
    if col_offset + heads * head_dim > row_stride {
        return bad("heads run past the row".into());
    }
    if row_stride % 8 != 0 || col_offset % 8 != 0 {
        return bad("rows must start 16-byte aligned (row stride and column offset multiples of 8)".into());
    }
    check_len(op, name, len, batch * seq * row_stride)?;
    let hpb = i32::try_from(heads.max(1)).map_err(|_| CudaError::Unsupported { op, what: format!("{name}: {heads} heads per batch") })?;
    Ok(HeadRows { off: col_offset as i64, row: row_stride as i64, batch: (seq * row_stride) as i64, head: head_dim as i64, hpb, pad: 0 })
}

/// Lets `f` use `bytes` of dynamic shared memory (above 48 KiB a kernel must opt in).
pub(super) fn allow_smem(f: &cudarc::driver::CudaFunction, bytes: usize, op: &'static str) -> Result<()> {
    // SAFETY: `f` is a loaded kernel; the attribute only asks for the largest shared-memory
    // carve-out of the SM's unified L1, so more blocks of these shared-memory-heavy kernels fit.
    unsafe {
        cudarc::driver::result::function::set_function_attribute(
            f.cu_function(),
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
            100,
        )
    }
    .op(op)?;
    if bytes <= 48 * 1024 {
        return Ok(());
    }
    // SAFETY: `f` is a loaded kernel; the attribute only raises its shared-memory limit, and the
    // H100/H200 allow up to 227 KiB per block.
    unsafe {
        cudarc::driver::result::function::set_function_attribute(
            f.cu_function(),
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
    }
    .op(op)
}
