//! Flash attention on the GPU, head dims 64 and 128, causal or not, forward and backward,
//! without storing any `T × T` matrix, in two precisions:
//!
//! - f32 (the `attention` NVRTC module): CUDA cores, one warp per row, the exact path that the
//!   1e-5 check holds to;
//! - bf16 (the `attention_bf16` module): tensor cores (`mma.sync` m16n8k16, f32 accumulation and
//!   softmax), 64-row blocks of 4 warps, K/V (or Q/dO) tiles double-buffered in shared memory
//!   with `cp.async`, FlashAttention-2's register re-packing of P as the A operand of P·V.
//!
//! Layout: Q is `[heads, tq, d]`, K and V `[heads, tk, d]`, O `[heads, tq, d]`, all contiguous
//! (`heads` is batch × heads). The forward saves one log-sum-exp per query row (`lse`,
//! `[heads, tq]`, f32); the backward recomputes the probabilities from it, first forming
//! `delta = Σ dO ⊙ O` per row, then dQ (per query block) and dK, dV (per key block) in two
//! kernels with no atomics, so results are deterministic. The causal mask and the scale match
//! [`crate::attention`] (query `i` sees keys `j ≤ i`).

use cudarc::driver::{LaunchConfig, PushKernelArg};
use half::bf16;

use super::alloc::Buffer;
use super::device::Device;
use super::error::{check_len, CudaError, OpContext, Result};
use super::nvrtc::Module;

/// Query rows per block of the bf16 tensor-core forward; must match `BF_ROWS` in attention_bf16.cu.
const BF_ROWS: usize = 64;
/// Keys per shared-memory tile of the bf16 forward; must match `BF_KEYS` in attention_bf16.cu.
const BF_KEYS: usize = 64;

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

    /// Forward on bf16 tensor cores (`mma.sync`, f32 accumulation and softmax): `q`, `k`, `v`
    /// and `out` are bf16, `lse` is f32 as in [`Device::flash_attention_forward`].
    pub fn flash_attention_forward_bf16(
        &self,
        spec: FlashSpec,
        q: &Buffer<bf16>,
        k: &Buffer<bf16>,
        v: &Buffer<bf16>,
        out: &mut Buffer<bf16>,
        lse: &mut Buffer<f32>,
    ) -> Result<()> {
        const OP: &str = "flash_attention_forward_bf16";
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
        let name = if d == 64 { "flash_forward_bf16_d64" } else { "flash_forward_bf16_d128" };
        let f = self.function(Module::AttentionBf16, name)?;
        let (qp, kp, vp, op_, lp) = (q.device_ptr(), k.device_ptr(), v.device_ptr(), out.device_ptr(), lse.device_ptr());
        let (causal, scale) = (spec.causal as i32, spec.scale);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&qp).arg(&kp).arg(&vp).arg(&op_).arg(&lp).arg(&tq).arg(&tk).arg(&causal).arg(&scale);
        // Two buffers of a K and a V tile.
        let smem_bytes = 4 * BF_KEYS * (d + 8) * 2;
        allow_smem(&f, smem_bytes, OP)?;
        let cfg = LaunchConfig { grid_dim: (spec.tq.div_ceil(BF_ROWS) as u32, heads as u32, 1), block_dim: (128, 1, 1), shared_mem_bytes: smem_bytes as u32 };
        // SAFETY: lengths checked above; rows are 16-byte aligned because d is 64 or 128 and
        // buffers start 512-byte aligned; shared memory matches the kernel's layout and was
        // allowed above.
        unsafe { l.launch(cfg) }.op(OP)?;
        Ok(())
    }

    /// Backward on bf16 tensor cores from the bf16 forward's `out` and `lse` and a bf16 output
    /// gradient; writes f32 `dq`, `dk` and `dv`. Deterministic (no atomics): one kernel forms
    /// dQ per query block, another dK and dV per key block.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attention_backward_bf16(
        &self,
        spec: FlashSpec,
        q: &Buffer<bf16>,
        k: &Buffer<bf16>,
        v: &Buffer<bf16>,
        out: &Buffer<bf16>,
        lse: &Buffer<f32>,
        dout: &Buffer<bf16>,
        dq: &mut Buffer<f32>,
        dk: &mut Buffer<f32>,
        dv: &mut Buffer<f32>,
    ) -> Result<()> {
        const OP: &str = "flash_attention_backward_bf16";
        let (tq, tk) = spec.check(OP)?;
        let FlashSpec { heads, d, .. } = spec;
        let (nq, nk) = (heads * spec.tq * d, heads * spec.tk * d);
        for (name, len, needed) in
            [("q", q.len(), nq), ("k", k.len(), nk), ("v", v.len(), nk), ("out", out.len(), nq), ("lse", lse.len(), heads * spec.tq), ("dout", dout.len(), nq)]
        {
            check_len(OP, name, len, needed)?;
        }
        for (name, len, needed) in [("dq", dq.len(), nq), ("dk", dk.len(), nk), ("dv", dv.len(), nk)] {
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
        let f = self.function(Module::AttentionBf16, "flash_backward_delta_bf16")?;
        let (op_, gp, dp, rows64, di) = (out.device_ptr(), dout.device_ptr(), delta.device_ptr(), rows as i64, d as i32);
        let mut l = self.stream().launch_builder(&f);
        l.arg(&op_).arg(&gp).arg(&dp).arg(&rows64).arg(&di);
        let cfg = LaunchConfig { grid_dim: (rows.div_ceil(8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: out and dout hold rows·d elements, delta holds rows.
        unsafe { l.launch(cfg) }.op(OP)?;

        let (qp, kp, vp, lp) = (q.device_ptr(), k.device_ptr(), v.device_ptr(), lse.device_ptr());
        let (causal, scale) = (spec.causal as i32, spec.scale);
        let (dqp, dkp, dvp) = (dq.device_ptr(), dk.device_ptr(), dv.device_ptr());
        let name = if d == 64 { "flash_backward_dq_bf16_d64" } else { "flash_backward_dq_bf16_d128" };
        let f = self.function(Module::AttentionBf16, name)?;
        let mut l = self.stream().launch_builder(&f);
        l.arg(&qp).arg(&kp).arg(&vp).arg(&gp).arg(&lp).arg(&dp).arg(&dqp).arg(&tq).arg(&tk).arg(&causal).arg(&scale);
        let smem = 4 * BF_KEYS * (d + 8) * 2;
        allow_smem(&f, smem, OP)?;
        let cfg = LaunchConfig { grid_dim: (spec.tq.div_ceil(BF_ROWS) as u32, heads as u32, 1), block_dim: (128, 1, 1), shared_mem_bytes: smem as u32 };
        // SAFETY: lengths checked above; shared memory matches the kernel's layout and was
        // allowed above.
        unsafe { l.launch(cfg) }.op(OP)?;

        let name = if d == 64 { "flash_backward_dkv_bf16_d64" } else { "flash_backward_dkv_bf16_d128" };
        let f = self.function(Module::AttentionBf16, name)?;
        // The block's K and V rows, two buffers of a Q and a dO tile, two of the row statistics.
        let smem = 6 * BF_KEYS * (d + 8) * 2 + 4 * BF_KEYS * 4;
        allow_smem(&f, smem, OP)?;
        let mut l = self.stream().launch_builder(&f);
        l.arg(&qp).arg(&kp).arg(&vp).arg(&gp).arg(&lp).arg(&dp).arg(&dkp).arg(&dvp).arg(&tq).arg(&tk).arg(&causal).arg(&scale);
        let cfg = LaunchConfig { grid_dim: (spec.tk.div_ceil(BF_ROWS) as u32, heads as u32, 1), block_dim: (128, 1, 1), shared_mem_bytes: smem as u32 };
        // SAFETY: lengths checked above; shared memory matches the kernel's layout and was
        // allowed above.
        unsafe { l.launch(cfg) }.op(OP)?;
        drop(delta);
        Ok(())
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

/// Lets `f` use `bytes` of dynamic shared memory (above 48 KiB a kernel must opt in).
fn allow_smem(f: &cudarc::driver::CudaFunction, bytes: usize, op: &'static str) -> Result<()> {
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
