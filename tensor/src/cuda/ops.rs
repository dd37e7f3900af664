//! The device side of the tensor ops a GPT training step runs, each with its backward written
//! directly in device kernels (no host round trip, no sync): `linear` (cuBLAS; the bias in a cuBLASLt
//! epilogue), `layer_norm`, `gelu`, `add` (same shape, or the right operand broadcast
//! over leading dimensions), `embedding`, causal attention on packed QKV (flash attention),
//! `cross_entropy` (mean; the loss is an f32 scalar whatever the logits' dtype), casts, and the
//! in-place updates of gradient accumulation. The generic CPU ops call these when an operand is
//! on a CUDA device (`dispatch!` below picks the f32 or bf16 instantiation). Linear layers put the
//! bias (forward) and its gradient (backward) in cuBLASLt epilogues where cuBLASLt takes them.

use std::sync::Arc;

use half::bf16;
use rtx_kernels::cuda::{Buffer, DeviceElem, Epilogue, FlashSpec, Gemm, HeadLayout};
use rtx_kernels::{DType, Device};

use super::{dense, dense_u32, device, device_of, tensor_from, DeviceData, GpuFloat};
use crate::error::{Error, Result};
use crate::ops::checksum::{self, CHECKSUM_CHUNK};
use crate::ops::softmax::{CrossEntropyOptions, Reduction};
use crate::tensor::Tensor;


fn same_device(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.device() != b.device() {
        return Err(Error::DeviceMismatch { op, lhs: a.device(), rhs: b.device() });
    }
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch { op, lhs: a.dtype(), rhs: b.dtype() });
    }
    Ok(())
}

fn wrap<T: GpuFloat>(ordinal: usize, buf: Buffer<T>, shape: &[usize]) -> Tensor {
    tensor_from(ordinal, T::wrap(buf), shape)
}

// ------------------------------------------------------------------------------------ linear

/// `x · wᵀ (+ b)` over the last dimension of `x`.
pub(crate) fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    const OP: &str = "linear";
    same_device(OP, x, w)?;
    if let Some(b) = b {
        same_device(OP, x, b)?;
    }
    dispatch!(OP, x.dtype(), linear_t(x, w, b))
}

fn linear_t<T: GpuFloat>(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    const OP: &str = "linear";
    let (ordinal, dev) = device_of(OP, x)?;
    let (n_out, n_in) = (w.shape()[0], w.shape()[1]);
    let rows = x.numel() / n_in.max(1);
    let mut out = dev.alloc::<T>(rows * n_out)?;
    let spec = Gemm { trans_b: true, ..Gemm::new(rows, n_out, n_in) };
    let (xb, wb) = (dense::<T>(OP, x)?, dense::<T>(OP, w)?);
    match b {
        Some(b) => {
            let bb = dense::<T>(OP, b)?;
            // The bias in the GEMM's epilogue; where cuBLASLt refuses, the bias rows become the
            // GEMM's initial C.
            if let Err(e) = dev.gemm_epilogue(&spec, &xb, &wb, &mut out, Epilogue::Bias(&bb)) {
                tracing::debug!(error = %e, "linear: no cuBLASLt bias epilogue, adding the bias through C");
                dev.fill_rows(&bb, &mut out)?;
                dev.gemm(&Gemm { beta: 1.0, ..spec }, &xb, &wb, &mut out)?;
            }
        }
        None => dev.gemm(&spec, &xb, &wb, &mut out)?,
    }
    drop((xb, wb));
    let mut shape = x.shape().to_vec();
    if let Some(last) = shape.last_mut() {
        *last = n_out;
    }
    let (xd, wd) = (x.detach(), w.detach());
    let (want_x, want_w, want_b, has_b) = (x.is_requires_grad(), w.is_requires_grad(), b.is_some_and(|b| b.is_requires_grad()), b.is_some());
    let mut inputs = vec![x, w];
    inputs.extend(b);
    let y = wrap(ordinal, out, &shape);
    Ok(Tensor::with_node(y.storage().clone(), y.layout().clone(), <T as DeviceElem>::DTYPE, OP, &inputs, move |g: &Tensor, _: &Tensor| {
        let dev = device(ordinal)?;
        let gb_ = dense::<T>(OP, g)?;
        let gx = if want_x {
            let mut dx = dev.alloc::<T>(rows * n_in)?;
            dev.gemm(&Gemm::new(rows, n_in, n_out), &gb_, &*dense::<T>(OP, &wd)?, &mut dx)?;
            Some(wrap(ordinal, dx, xd.shape()))
        } else {
            None
        };
        // The weight gradient, and the bias gradient in the same GEMM's epilogue when cuBLASLt
        // takes it (else a column sum of g).
        let mut db = if want_b { Some(dev.alloc::<T>(n_out)?) } else { None };
        let mut db_done = false;
        let gw = if want_w {
            let mut dw = dev.alloc::<T>(n_out * n_in)?;
            let spec = Gemm { trans_a: true, ..Gemm::new(n_out, n_in, rows) };
            let xb = dense::<T>(OP, &xd)?;
            if let Some(db) = db.as_mut() {
                match dev.gemm_epilogue(&spec, &gb_, &xb, &mut dw, Epilogue::BiasGrad(db)) {
                    Ok(()) => db_done = true,
                    Err(e) => tracing::debug!(error = %e, "linear backward: no cuBLASLt bias-gradient epilogue"),
                }
            }
            if !db_done {
                dev.gemm(&spec, &gb_, &xb, &mut dw)?;
            }
            Some(wrap(ordinal, dw, &[n_out, n_in]))
        } else {
            None
        };
        if let (Some(db), false) = (db.as_mut(), db_done) {
            dev.column_sums(&gb_, db, false)?;
        }
        let mut grads = vec![gx, gw];
        if has_b {
            grads.push(db.map(|db| wrap(ordinal, db, &[n_out])));
        }
        Ok(grads)
    }))
}

// ------------------------------------------------------------------------------- layer norm

/// Layer norm over the last dimension.
pub(crate) fn layer_norm(x: &Tensor, w: Option<&Tensor>, b: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    const OP: &str = "layer_norm";
    for p in [w, b].into_iter().flatten() {
        same_device(OP, x, p)?;
    }
    dispatch!(OP, x.dtype(), layer_norm_t(x, w, b, eps))
}

fn layer_norm_t<T: GpuFloat>(x: &Tensor, w: Option<&Tensor>, b: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    const OP: &str = "layer_norm";
    let (ordinal, dev) = device_of(OP, x)?;
    let n = x.shape().last().copied().unwrap_or(0);
    let rows = x.numel() / n.max(1);
    let mut y = dev.alloc::<T>(x.numel())?;
    let mut mean = dev.alloc::<f32>(rows)?;
    let mut rstd = dev.alloc::<f32>(rows)?;
    {
        let wg = w.map(|w| dense::<T>(OP, w)).transpose()?;
        let bg = b.map(|b| dense::<T>(OP, b)).transpose()?;
        dev.norm_forward(&*dense::<T>(OP, x)?, n, wg.as_deref(), bg.as_deref(), eps as f32, &mut y, &mut mean, &mut rstd)?;
    }
    Ok(layer_norm_node(ordinal, y, mean, rstd, x, w, b))
}

/// The layer norm's output tensor `y` of input `x`, recording [`LayerNormBackward`].
fn layer_norm_node<T: GpuFloat>(ordinal: usize, y: Buffer<T>, mean: Buffer<f32>, rstd: Buffer<f32>, x: &Tensor, w: Option<&Tensor>, b: Option<&Tensor>) -> Tensor {
    let backward = LayerNormBackward::<T> {
        ordinal,
        n: x.shape().last().copied().unwrap_or(0),
        x: x.detach(),
        w: w.map(Tensor::detach),
        mean,
        rstd,
        want: (w.is_some_and(|w| w.is_requires_grad()), b.is_some_and(|b| b.is_requires_grad())),
        has: (w.is_some(), b.is_some()),
        _storage: std::marker::PhantomData,
    };
    let mut inputs = vec![x];
    inputs.extend(w);
    inputs.extend(b);
    let out = wrap(ordinal, y, x.shape());
    Tensor::with_node(out.storage().clone(), out.layout().clone(), <T as DeviceElem>::DTYPE, "layer_norm", &inputs, backward)
}

/// The layer norm's backward. It takes the gradient its input already has from the other
/// consumers (the residual stream's, in a pre-norm transformer) and adds it in the same kernel
/// pass that makes the input gradient, with the weight and bias gradients from that pass too
/// ([`rtx_kernels::cuda::Device::norm_backward_accumulate`]): one read of `x`, `dy` and the prior
/// gradient, one write, where the unfused form reads and writes the rows eight times.
struct LayerNormBackward<T> {
    ordinal: usize,
    n: usize,
    x: Tensor,
    w: Option<Tensor>,
    mean: Buffer<f32>,
    rstd: Buffer<f32>,
    want: (bool, bool),
    has: (bool, bool),
    _storage: std::marker::PhantomData<fn() -> T>,
}

impl<T: GpuFloat> crate::autograd::BackwardFn for LayerNormBackward<T> {
    fn backward(&self, g: &Tensor, out: &Tensor) -> Result<Vec<Option<Tensor>>> {
        self.backward_accumulating(g, out, None)
    }

    fn accumulates_first_input(&self) -> bool {
        true
    }

    fn backward_accumulating(&self, g: &Tensor, _: &Tensor, prior: Option<Tensor>) -> Result<Vec<Option<Tensor>>> {
        const OP: &str = "layer_norm";
        let (ordinal, n) = (self.ordinal, self.n);
        let dev = device(ordinal)?;
        // A prior gradient the kernel cannot read in place (another dtype, a strided view) is
        // added afterwards, as the engine would.
        let (fused_prior, late_prior) = match prior {
            Some(p) if p.dtype() == <T as DeviceElem>::DTYPE && p.device() == self.x.device() && p.is_contiguous() && p.layout().offset() == 0 && p.storage().len() == p.numel() => (Some(p), None),
            other => (None, other),
        };
        let mut dx = dev.alloc::<T>(self.x.numel())?;
        let mut dw = if self.want.0 { Some(dev.alloc::<T>(n)?) } else { None };
        let mut db = if self.want.1 { Some(dev.alloc::<T>(n)?) } else { None };
        {
            let wg = self.w.as_ref().map(|w| dense::<T>(OP, w)).transpose()?;
            let pg = fused_prior.as_ref().map(|p| dense::<T>(OP, p)).transpose()?;
            dev.norm_backward_accumulate(&*dense::<T>(OP, &self.x)?, n, wg.as_deref(), &self.mean, &self.rstd, &*dense::<T>(OP, g)?, pg.as_deref(), &mut dx, dw.as_mut(), db.as_mut())?;
        }
        let dx = wrap(ordinal, dx, self.x.shape());
        let dx = match late_prior {
            Some(p) => p.add(&dx)?,
            None => dx,
        };
        let mut grads = vec![Some(dx)];
        if self.has.0 {
            grads.push(dw.map(|b| wrap(ordinal, b, &[n])));
        }
        if self.has.1 {
            grads.push(db.map(|b| wrap(ordinal, b, &[n])));
        }
        Ok(grads)
    }
}

/// The residual add fused with the layer norm after it: `(s, layer_norm(s))` for `s = a + b`
/// (`b`'s shape a suffix of `a`'s), in one kernel pass where
/// [`rtx_kernels::cuda::Device::fused_norm_supported`] takes the rows (bf16 GPT widths), else
/// the two ops. `s` records the add's backward and the norm records [`LayerNormBackward`] on
/// `s`, so the graph is the unfused one.
pub(crate) fn add_layer_norm(a: &Tensor, b: &Tensor, w: Option<&Tensor>, bias: Option<&Tensor>, eps: f64) -> Result<(Tensor, Tensor)> {
    const OP: &str = "add_layer_norm";
    same_device(OP, a, b)?;
    for p in [w, bias].into_iter().flatten() {
        same_device(OP, a, p)?;
    }
    let n = a.shape().last().copied().unwrap_or(0);
    let fused = a.dtype() == DType::BF16 && rtx_kernels::cuda::Device::fused_norm_supported::<bf16>(n) && a.shape().ends_with(b.shape()) && b.rank() >= 1;
    if !fused {
        let s = add(a, b)?;
        let y = layer_norm(&s, w, bias, eps)?;
        return Ok((s, y));
    }
    let (ordinal, dev) = device_of(OP, a)?;
    let rows = a.numel() / n.max(1);
    let mut s = dev.alloc::<bf16>(a.numel())?;
    let mut y = dev.alloc::<bf16>(a.numel())?;
    let mut mean = dev.alloc::<f32>(rows)?;
    let mut rstd = dev.alloc::<f32>(rows)?;
    {
        let wg = w.map(|w| dense::<bf16>(OP, w)).transpose()?;
        let bg = bias.map(|b| dense::<bf16>(OP, b)).transpose()?;
        dev.add_norm_forward(&*dense::<bf16>(OP, a)?, &*dense::<bf16>(OP, b)?, n, wg.as_deref(), bg.as_deref(), eps as f32, &mut s, &mut y, &mut mean, &mut rstd)?;
    }
    let s = add_node(ordinal, s, a, b);
    let y = layer_norm_node(ordinal, y, mean, rstd, &s, w, bias);
    Ok((s, y))
}

// ------------------------------------------------------------------- linear + GELU + linear

/// The feed-forward `linear(gelu_tanh(linear(x, w1, b1)), w2, b2)` as one node. In bf16 the first
/// GEMM adds its bias and applies the GELU in a cuBLASLt epilogue that keeps the pre-activation,
/// and the backward's GEMM into the hidden gradient multiplies by the GELU's derivative at that
/// pre-activation in its epilogue (the first bias's gradient comes from the next GEMM's, as in
/// `linear`): no GELU kernels, and the
/// hidden activations (`[rows, hidden]`, the largest of a transformer block) are read and written
/// three times fewer per step (GPT-2 124M on the H200: 1.5 ms less per step). Where cuBLASLt
/// refuses the forward epilogue (or not bf16) it is the three ops; a refused backward epilogue
/// runs the GELU's backward kernel.
pub(crate) fn linear_gelu_linear(x: &Tensor, w1: &Tensor, b1: &Tensor, w2: &Tensor, b2: &Tensor) -> Result<Tensor> {
    const OP: &str = "linear_gelu_linear";
    for t in [w1, b1, w2, b2] {
        same_device(OP, x, t)?;
    }
    let (hidden, c_in, c_out) = (w1.shape()[0], w1.shape()[1], w2.shape()[0]);
    let shapes_ok = w1.rank() == 2 && w2.rank() == 2 && w2.shape()[1] == hidden && b1.shape() == [hidden] && b2.shape() == [c_out] && x.rank() > 0 && x.shape()[x.rank() - 1] == c_in;
    if !shapes_ok {
        return Err(Error::ShapeMismatch { op: OP, lhs: x.shape().to_vec(), rhs: w1.shape().to_vec() });
    }
    if x.dtype() == DType::BF16 && hidden.is_multiple_of(8) {
        if let Some(y) = linear_gelu_linear_t::<bf16>(x, w1, b1, w2, b2)? {
            return Ok(y);
        }
    }
    let h = gelu(&linear(x, w1, Some(b1))?, crate::GeluApprox::Tanh)?;
    linear(&h, w2, Some(b2))
}

/// The fused form; `None` when cuBLASLt refuses the GELU epilogue (the caller runs the ops).
fn linear_gelu_linear_t<T: GpuFloat>(x: &Tensor, w1: &Tensor, b1: &Tensor, w2: &Tensor, b2: &Tensor) -> Result<Option<Tensor>> {
    const OP: &str = "linear_gelu_linear";
    let (ordinal, dev) = device_of(OP, x)?;
    let (hidden, c_in, c_out) = (w1.shape()[0], w1.shape()[1], w2.shape()[0]);
    let rows = x.numel() / c_in.max(1);
    let mut pre = dev.alloc::<T>(rows * hidden)?;
    let mut h = dev.alloc::<T>(rows * hidden)?;
    let mut y = dev.alloc::<T>(rows * c_out)?;
    {
        let (xb, w1b, b1b) = (dense::<T>(OP, x)?, dense::<T>(OP, w1)?, dense::<T>(OP, b1)?);
        let spec = Gemm { trans_b: true, ..Gemm::new(rows, hidden, c_in) };
        if let Err(e) = dev.gemm_epilogue(&spec, &xb, &w1b, &mut h, Epilogue::BiasGeluAux { bias: &b1b, aux: &mut pre }) {
            tracing::debug!(error = %e, "linear_gelu_linear: no cuBLASLt GELU epilogue, running the three ops");
            return Ok(None);
        }
        let (w2b, b2b) = (dense::<T>(OP, w2)?, dense::<T>(OP, b2)?);
        let spec = Gemm { trans_b: true, ..Gemm::new(rows, c_out, hidden) };
        if let Err(e) = dev.gemm_epilogue(&spec, &h, &w2b, &mut y, Epilogue::Bias(&b2b)) {
            tracing::debug!(error = %e, "linear_gelu_linear: no cuBLASLt bias epilogue, adding the bias through C");
            dev.fill_rows(&b2b, &mut y)?;
            dev.gemm(&Gemm { beta: 1.0, ..spec }, &h, &w2b, &mut y)?;
        }
    }
    let mut shape = x.shape().to_vec();
    if let Some(last) = shape.last_mut() {
        *last = c_out;
    }
    let (xd, w1d, w2d) = (x.detach(), w1.detach(), w2.detach());
    let want = [x, w1, b1, w2, b2].map(Tensor::is_requires_grad);
    let x_shape = x.shape().to_vec();
    let out = wrap(ordinal, y, &shape);
    Ok(Some(Tensor::with_node(out.storage().clone(), out.layout().clone(), <T as DeviceElem>::DTYPE, OP, &[x, w1, b1, w2, b2], move |g: &Tensor, _: &Tensor| {
        let dev = device(ordinal)?;
        let gb = dense::<T>(OP, g)?;
        // The second layer: dW2 = gᵀ·h with db2 in the epilogue (else a column sum).
        let mut db2 = dev.alloc::<T>(c_out)?;
        let mut dw2 = dev.alloc::<T>(c_out * hidden)?;
        let spec = Gemm { trans_a: true, ..Gemm::new(c_out, hidden, rows) };
        if let Err(e) = dev.gemm_epilogue(&spec, &gb, &h, &mut dw2, Epilogue::BiasGrad(&mut db2)) {
            tracing::debug!(error = %e, "linear_gelu_linear backward: no cuBLASLt bias-gradient epilogue");
            dev.gemm(&spec, &gb, &h, &mut dw2)?;
            dev.column_sums(&gb, &mut db2, false)?;
        }
        // The pre-activation's gradient (g·W2) ⊙ gelu'(pre).
        let mut dpre = dev.alloc::<T>(rows * hidden)?;
        {
            let w2b = dense::<T>(OP, &w2d)?;
            let spec = Gemm::new(rows, hidden, c_out);
            let fused = dev.gemm_epilogue(&spec, &gb, &w2b, &mut dpre, Epilogue::DGelu { aux: &pre }).map_err(|e| tracing::debug!(error = %e, "linear_gelu_linear backward: no cuBLASLt GELU-gradient epilogue")).is_ok();
            if !fused {
                let mut dh = dev.alloc::<T>(rows * hidden)?;
                dev.gemm(&spec, &gb, &w2b, &mut dh)?;
                dev.gelu_backward(&pre, &dh, &mut dpre, false)?;
            }
        }
        // The first layer: dW1 = dpreᵀ·x with db1 in the epilogue (else a column sum).
        let mut db1 = dev.alloc::<T>(hidden)?;
        let dw1 = {
            let mut dw1 = dev.alloc::<T>(hidden * c_in)?;
            let spec = Gemm { trans_a: true, ..Gemm::new(hidden, c_in, rows) };
            let xb = dense::<T>(OP, &xd)?;
            if let Err(e) = dev.gemm_epilogue(&spec, &dpre, &xb, &mut dw1, Epilogue::BiasGrad(&mut db1)) {
                tracing::debug!(error = %e, "linear_gelu_linear backward: no cuBLASLt bias-gradient epilogue");
                dev.gemm(&spec, &dpre, &xb, &mut dw1)?;
                dev.column_sums(&dpre, &mut db1, false)?;
            }
            want[1].then(|| wrap(ordinal, dw1, &[hidden, c_in]))
        };
        // dx = dpre·W1.
        let dx = if want[0] {
            let mut dx = dev.alloc::<T>(rows * c_in)?;
            dev.gemm(&Gemm::new(rows, c_in, hidden), &dpre, &*dense::<T>(OP, &w1d)?, &mut dx)?;
            Some(wrap(ordinal, dx, &x_shape))
        } else {
            None
        };
        Ok(vec![
            dx,
            dw1,
            want[2].then(|| wrap(ordinal, db1, &[hidden])),
            want[3].then(|| wrap(ordinal, dw2, &[c_out, hidden])),
            want[4].then(|| wrap(ordinal, db2, &[c_out])),
        ])
    })))
}

// ------------------------------------------------------------------------------------ gelu

/// GELU in the form `approx` names (exact erf or tanh).
pub(crate) fn gelu(x: &Tensor, approx: crate::GeluApprox) -> Result<Tensor> {
    dispatch!("gelu", x.dtype(), gelu_t(x, approx == crate::GeluApprox::None))
}

fn gelu_t<T: GpuFloat>(x: &Tensor, exact: bool) -> Result<Tensor> {
    const OP: &str = "gelu";
    let (ordinal, dev) = device_of(OP, x)?;
    let mut y = dev.alloc::<T>(x.numel())?;
    dev.gelu(&*dense::<T>(OP, x)?, &mut y, exact)?;
    let xd = x.detach();
    let out = wrap(ordinal, y, x.shape());
    Ok(Tensor::with_node(out.storage().clone(), out.layout().clone(), <T as DeviceElem>::DTYPE, OP, &[x], move |g: &Tensor, _: &Tensor| {
        let dev = device(ordinal)?;
        let mut dx = dev.alloc::<T>(xd.numel())?;
        dev.gelu_backward(&*dense::<T>(OP, &xd)?, &*dense::<T>(OP, g)?, &mut dx, exact)?;
        Ok(vec![Some(wrap(ordinal, dx, xd.shape()))])
    }))
}

// ------------------------------------------------------------------------------------- add

/// `a + b` where the shapes are equal or one is a suffix of the other (broadcast over leading
/// dimensions, as a position embedding over a batch).
pub(crate) fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "add";
    same_device(OP, a, b)?;
    if a.shape().ends_with(b.shape()) {
        dispatch!(OP, a.dtype(), add_t(a, b))
    } else if b.shape().ends_with(a.shape()) {
        dispatch!(OP, a.dtype(), add_t(b, a))
    } else {
        Err(Error::UnsupportedDevice { op: "add (general broadcast)", device: a.device() })
    }
}

/// `big + small`, `small`'s shape a suffix of `big`'s.
fn add_t<T: GpuFloat>(big: &Tensor, small: &Tensor) -> Result<Tensor> {
    const OP: &str = "add";
    let (ordinal, dev) = device_of(OP, big)?;
    let mut out = dev.alloc::<T>(big.numel())?;
    dev.add_rows(&*dense::<T>(OP, big)?, &*dense::<T>(OP, small)?, &mut out)?;
    Ok(add_node(ordinal, out, big, small))
}

/// The sum `out` of `big + small` as a tensor recording the add's backward (the gradient to
/// both, column-summed for a broadcast `small`).
fn add_node<T: GpuFloat>(ordinal: usize, out: Buffer<T>, big: &Tensor, small: &Tensor) -> Tensor {
    const OP: &str = "add";
    let (want_big, want_small) = (big.is_requires_grad(), small.is_requires_grad());
    let (small_shape, same) = (small.shape().to_vec(), big.shape() == small.shape());
    let y = wrap(ordinal, out, big.shape());
    Tensor::with_node(y.storage().clone(), y.layout().clone(), <T as DeviceElem>::DTYPE, OP, &[big, small], move |g: &Tensor, _: &Tensor| {
        let gs = if !want_small {
            None
        } else if same {
            Some(g.clone())
        } else {
            let dev = device(ordinal)?;
            let mut s = dev.alloc::<T>(small_shape.iter().product())?;
            dev.column_sums(&*dense::<T>(OP, g)?, &mut s, false)?;
            Some(wrap(ordinal, s, &small_shape))
        };
        Ok(vec![want_big.then(|| g.clone()), gs])
    })
}

// ------------------------------------------------------------------------------- embedding

/// Rows of `weight [V, C]` at `ids` (u32, host or device; host ids are checked against `V`,
/// device ids are trusted).
pub(crate) fn embedding(weight: &Tensor, ids: &Tensor) -> Result<Tensor> {
    const OP: &str = "embedding";
    if ids.dtype() != DType::U32 {
        return Err(Error::DTypeMismatch { op: OP, lhs: ids.dtype(), rhs: DType::U32 });
    }
    if weight.rank() != 2 {
        return Err(Error::BadShape { op: OP, shape: weight.shape().to_vec(), reason: "weight must be [V, C]".into() });
    }
    let (ordinal, _) = device_of(OP, weight)?;
    let ids = on_device_checked(OP, ids, ordinal, weight.shape()[0])?;
    dispatch!(OP, weight.dtype(), embedding_t(weight, &ids))
}

/// `ids` on device `ordinal`: host ids are checked to be below `bound`, then uploaded.
pub(crate) fn on_device_checked(op: &'static str, ids: &Tensor, ordinal: usize, bound: usize) -> Result<Tensor> {
    match ids.device() {
        Device::Cuda(i) if i == ordinal => Ok(ids.clone()),
        Device::Cuda(_) => Err(Error::DeviceMismatch { op, lhs: Device::Cuda(ordinal), rhs: ids.device() }),
        Device::Cpu => {
            let v = ids.to_u32_vec()?;
            if let Some(&bad) = v.iter().find(|&&i| i as usize >= bound) {
                return Err(Error::IndexOutOfRange { op, index: bad as usize, size: bound });
            }
            super::upload(&Tensor::from_vec(v, ids.shape())?, ordinal)
        }
    }
}

fn embedding_t<T: GpuFloat>(weight: &Tensor, ids: &Tensor) -> Result<Tensor> {
    const OP: &str = "embedding";
    let (ordinal, dev) = device_of(OP, weight)?;
    let (v, c) = (weight.shape()[0], weight.shape()[1]);
    let mut out = dev.alloc::<T>(ids.numel() * c)?;
    dev.gather_rows(&*dense::<T>(OP, weight)?, c, &*dense_u32(OP, ids)?, &mut out)?;
    let mut shape = ids.shape().to_vec();
    shape.push(c);
    let ids_d = ids.clone();
    let y = wrap(ordinal, out, &shape);
    Ok(Tensor::with_node(y.storage().clone(), y.layout().clone(), <T as DeviceElem>::DTYPE, OP, &[weight], move |g: &Tensor, _: &Tensor| {
        let dev = device(ordinal)?;
        let mut table = dev.zeros::<f32>(v * c)?;
        dev.scatter_add_rows(&*dense::<T>(OP, g)?, &*dense_u32(OP, &ids_d)?, c, &mut table)?;
        let grad = tensor_from(ordinal, DeviceData::F32(table), &[v, c]);
        Ok(vec![Some(cast(&grad, <T as DeviceElem>::DTYPE)?)])
    }))
}

// ------------------------------------------------------------------------------- attention

/// Attention on packed `qkv [B, T, 3·C]` with `h` heads, merged back to `[B, T, C]`, by flash
/// attention (head dims 64 and 128).
pub(crate) fn attention_packed(qkv: &Tensor, h: usize, causal: bool, scale: f64) -> Result<Tensor> {
    match qkv.dtype() {
        DType::F32 => attention_t::<f32>(qkv, h, causal, scale),
        DType::BF16 => attention_bf16(qkv, h, causal, scale),
        other => Err(Error::UnsupportedDType { op: "scaled_dot_product_attention_packed", dtype: other }),
    }
}

/// The bf16 path: the tensor-core kernels read Q, K and V in place from the packed rows and write
/// the output straight into the merged `[B, T, C]` rows; the backward reads O and dO there too
/// and writes dQ, dK and dV as bf16 straight into the packed gradient (no head copies, no casts).
fn attention_bf16(qkv: &Tensor, h: usize, causal: bool, scale: f64) -> Result<Tensor> {
    const OP: &str = "scaled_dot_product_attention_packed";
    let (ordinal, dev) = device_of(OP, qkv)?;
    let (b, t, c) = (qkv.shape()[0], qkv.shape()[1], qkv.shape()[2] / 3);
    let d = c / h;
    let part = move |s: usize| HeadLayout { batch: b, seq: t, heads: h, head_dim: d, row_stride: 3 * c, col_offset: s * c };
    let merged = HeadLayout { batch: b, seq: t, heads: h, head_dim: d, row_stride: c, col_offset: 0 };
    let spec = FlashSpec { heads: b * h, tq: t, tk: t, d, causal, scale: scale as f32 };
    let mut y = dev.alloc::<bf16>(b * t * c)?;
    let mut lse = dev.alloc::<f32>(b * h * t)?;
    {
        let src = dense::<bf16>(OP, qkv)?;
        dev.flash_attention_forward_bf16_strided(spec, (&*src, part(0)), (&*src, part(1)), (&*src, part(2)), (&mut y, merged), &mut lse)?;
    }
    let y = wrap(ordinal, y, &[b, t, c]);
    // The backward reads the packed input and the output where they are (as `linear` keeps its
    // input); neither is written in place during a training step.
    let (qkv_saved, y_saved) = (qkv.detach(), y.detach());
    Ok(Tensor::with_node(y.storage().clone(), y.layout().clone(), DType::BF16, OP, &[qkv], move |g: &Tensor, _: &Tensor| {
        let dev = device(ordinal)?;
        let (src, out, gd) = (dense::<bf16>(OP, &qkv_saved)?, dense::<bf16>(OP, &y_saved)?, dense::<bf16>(OP, g)?);
        let mut dqkv = dev.alloc::<bf16>(b * t * 3 * c)?;
        dev.flash_attention_backward_bf16(
            spec,
            (&*src, part(0)),
            (&*src, part(1)),
            (&*src, part(2)),
            (&*out, merged),
            &lse,
            (&*gd, merged),
            &mut dqkv,
            [part(0), part(1), part(2)],
        )?;
        Ok(vec![Some(wrap(ordinal, dqkv, &[b, t, 3 * c]))])
    }))
}

/// The flash-attention entry points of one storage type (f32; bf16 has its own path above).
trait Flash: GpuFloat {
    fn forward(
        dev: &rtx_kernels::cuda::Device,
        spec: FlashSpec,
        q: &Buffer<Self>,
        k: &Buffer<Self>,
        v: &Buffer<Self>,
        out: &mut Buffer<Self>,
        lse: &mut Buffer<f32>,
    ) -> Result<()>;
    #[allow(clippy::too_many_arguments)]
    fn backward(
        dev: &rtx_kernels::cuda::Device,
        spec: FlashSpec,
        q: &Buffer<Self>,
        k: &Buffer<Self>,
        v: &Buffer<Self>,
        out: &Buffer<Self>,
        lse: &Buffer<f32>,
        dout: &Buffer<Self>,
        grads: &mut [Buffer<f32>; 3],
    ) -> Result<()>;
    fn f32_heads_to_rows(dev: &rtx_kernels::cuda::Device, heads: &Buffer<f32>, layout: HeadLayout, rows: &mut Buffer<Self>) -> Result<()>;
}

impl Flash for f32 {
    fn forward(
        dev: &rtx_kernels::cuda::Device,
        spec: FlashSpec,
        q: &Buffer<f32>,
        k: &Buffer<f32>,
        v: &Buffer<f32>,
        out: &mut Buffer<f32>,
        lse: &mut Buffer<f32>,
    ) -> Result<()> {
        Ok(dev.flash_attention_forward(spec, q, k, v, out, lse)?)
    }
    fn backward(
        dev: &rtx_kernels::cuda::Device,
        spec: FlashSpec,
        q: &Buffer<f32>,
        k: &Buffer<f32>,
        v: &Buffer<f32>,
        out: &Buffer<f32>,
        lse: &Buffer<f32>,
        dout: &Buffer<f32>,
        grads: &mut [Buffer<f32>; 3],
    ) -> Result<()> {
        let [dq, dk, dv] = grads;
        Ok(dev.flash_attention_backward(spec, q, k, v, out, lse, dout, dq, dk, dv)?)
    }
    fn f32_heads_to_rows(dev: &rtx_kernels::cuda::Device, heads: &Buffer<f32>, layout: HeadLayout, rows: &mut Buffer<f32>) -> Result<()> {
        Ok(dev.heads_to_rows(heads, layout, rows)?)
    }
}

/// What the attention backward keeps: the head-major q, k, v and output, and the row
/// log-sum-exps.
struct AttentionSaved<T: rtx_kernels::cuda::DeviceElem> {
    q: Buffer<T>,
    k: Buffer<T>,
    v: Buffer<T>,
    out: Buffer<T>,
    lse: Buffer<f32>,
}

fn attention_t<T: Flash>(qkv: &Tensor, h: usize, causal: bool, scale: f64) -> Result<Tensor> {
    const OP: &str = "scaled_dot_product_attention_packed";
    let (ordinal, dev) = device_of(OP, qkv)?;
    let (b, t, c) = (qkv.shape()[0], qkv.shape()[1], qkv.shape()[2] / 3);
    let d = c / h;
    let heads = b * h * t * d;
    let part = move |s: usize| HeadLayout { batch: b, seq: t, heads: h, head_dim: d, row_stride: 3 * c, col_offset: s * c };
    let merged = HeadLayout { batch: b, seq: t, heads: h, head_dim: d, row_stride: c, col_offset: 0 };
    let spec = FlashSpec { heads: b * h, tq: t, tk: t, d, causal, scale: scale as f32 };
    let saved = {
        let src = dense::<T>(OP, qkv)?;
        let mut q = dev.alloc::<T>(heads)?;
        let mut k = dev.alloc::<T>(heads)?;
        let mut v = dev.alloc::<T>(heads)?;
        dev.rows_to_heads(&src, part(0), &mut q)?;
        dev.rows_to_heads(&src, part(1), &mut k)?;
        dev.rows_to_heads(&src, part(2), &mut v)?;
        let mut out = dev.alloc::<T>(heads)?;
        let mut lse = dev.alloc::<f32>(b * h * t)?;
        T::forward(&dev, spec, &q, &k, &v, &mut out, &mut lse)?;
        Arc::new(AttentionSaved { q, k, v, out, lse })
    };
    let mut y = dev.alloc::<T>(b * t * c)?;
    dev.heads_to_rows(&saved.out, merged, &mut y)?;
    let y = wrap(ordinal, y, &[b, t, c]);
    Ok(Tensor::with_node(y.storage().clone(), y.layout().clone(), <T as DeviceElem>::DTYPE, OP, &[qkv], move |g: &Tensor, _: &Tensor| {
        let dev = device(ordinal)?;
        let mut dout = dev.alloc::<T>(heads)?;
        dev.rows_to_heads(&*dense::<T>(OP, g)?, merged, &mut dout)?;
        let mut grads = [dev.alloc::<f32>(heads)?, dev.alloc::<f32>(heads)?, dev.alloc::<f32>(heads)?];
        T::backward(&dev, spec, &saved.q, &saved.k, &saved.v, &saved.out, &saved.lse, &dout, &mut grads)?;
        let mut dqkv = dev.alloc::<T>(b * t * 3 * c)?;
        for (s, gpart) in grads.iter().enumerate() {
            T::f32_heads_to_rows(&dev, gpart, part(s), &mut dqkv)?;
        }
        Ok(vec![Some(wrap(ordinal, dqkv, &[b, t, 3 * c]))])
    }))
}

// --------------------------------------------------------------------------- cross-entropy

/// Mean softmax cross-entropy of `logits [N, V]` against `targets [N]` (host targets are
/// checked against `V`); an f32 scalar on the device.
pub(crate) fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    const OP: &str = "cross_entropy";
    if logits.rank() != 2 || targets.shape() != [logits.shape()[0]] {
        return Err(Error::ShapeMismatch { op: OP, lhs: logits.shape().to_vec(), rhs: targets.shape().to_vec() });
    }
    let (ordinal, _) = device_of(OP, logits)?;
    let targets = on_device_checked(OP, targets, ordinal, logits.shape()[1])?;
    dispatch!(OP, logits.dtype(), cross_entropy_t(logits, &targets))
}

fn cross_entropy_t<T: GpuFloat>(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    const OP: &str = "cross_entropy";
    let (ordinal, dev) = device_of(OP, logits)?;
    let (n, v) = (logits.shape()[0], logits.shape()[1]);
    let mut losses = dev.alloc::<f32>(n)?;
    dev.cross_entropy_losses(&*dense::<T>(OP, logits)?, v, &*dense_u32(OP, targets)?, &mut losses)?;
    let mut loss = dev.alloc::<f32>(1)?;
    dev.mean_f32(&losses, &mut loss)?;
    let (ld, td) = (logits.detach(), targets.clone());
    let y = tensor_from(ordinal, DeviceData::F32(loss), &[]);
    Ok(Tensor::with_node(y.storage().clone(), y.layout().clone(), DType::F32, OP, &[logits], move |g: &Tensor, _: &Tensor| {
        let dev = device(ordinal)?;
        let g = if g.dtype() == DType::F32 { g.clone() } else { cast(g, DType::F32)? };
        let mut dl = dev.alloc::<T>(n * v)?;
        dev.cross_entropy_grad(&*dense::<T>(OP, &ld)?, v, &*dense_u32(OP, &td)?, &*dense::<f32>(OP, &g)?, 1.0 / n.max(1) as f32, &mut dl)?;
        Ok(vec![Some(wrap(ordinal, dl, &[n, v]))])
    }))
}

// ----------------------------------------------------------------- fused head + cross-entropy

/// `hidden [N, C] · weightᵀ` fused with the softmax cross-entropy over the first `classes` rows
/// of `weight` (the rest is vocabulary padding), chunk by chunk of rows (see
/// `ops/linear_cross_entropy.rs`). Per chunk: one GEMM makes the chunk's logits over every row of
/// `weight` (the padding too: GEMM-friendly shapes), [`rtx_kernels::cuda::Device::fused_classifier`]
/// turns them into loss rows and, in place, logit gradients (0 in the padding), and two GEMMs fold
/// those into `dhidden` (the chunk's rows) and `dweight` (accumulated over chunks with `beta = 1`).
/// Backward only scales both by the incoming gradient, read on the device. The loss is an f32
/// scalar. Label smoothing is refused; an ignore index needs host targets (the mean's count is
/// taken on the host).
pub(crate) fn linear_cross_entropy(hidden: &Tensor, weight: &Tensor, targets: &Tensor, classes: usize, options: CrossEntropyOptions, chunk_rows: usize) -> Result<Tensor> {
    const OP: &str = "linear_cross_entropy";
    same_device(OP, hidden, weight)?;
    if options.label_smoothing != 0.0 {
        return Err(Error::UnsupportedDevice { op: "linear_cross_entropy (label smoothing)", device: hidden.device() });
    }
    let (ordinal, _) = device_of(OP, hidden)?;
    let n = hidden.shape()[0];
    let ignore = options.ignore_index.and_then(|i| u32::try_from(i).ok());
    let (targets, counted) = match targets.device() {
        Device::Cpu => {
            let v = targets.to_u32_vec()?;
            if let Some(&bad) = v.iter().find(|&&t| t as usize >= classes && Some(t) != ignore) {
                return Err(Error::IndexOutOfRange { op: OP, index: bad as usize, size: classes });
            }
            let counted = v.iter().filter(|&&t| Some(t) != ignore).count();
            (super::upload(&Tensor::from_vec(v, &[n])?, ordinal)?, counted)
        }
        Device::Cuda(i) if i == ordinal => {
            if targets.dtype() != DType::U32 {
                return Err(Error::DTypeMismatch { op: OP, lhs: targets.dtype(), rhs: DType::U32 });
            }
            if ignore.is_some() {
                return Err(Error::UnsupportedDevice { op: "linear_cross_entropy (an ignore index with targets on the device: the mean's count is taken on the host)", device: targets.device() });
            }
            (targets.clone(), n)
        }
        other => return Err(Error::DeviceMismatch { op: OP, lhs: hidden.device(), rhs: other }),
    };
    // The logit gradient's factor, and the factor turning the mean of the N loss rows into the
    // result: Σ/counted for the mean (NaN with nothing counted, as PyTorch), Σ for the sum.
    let (grad_scale, loss_factor) = match options.reduction {
        Reduction::Sum => (1.0, n as f32),
        _ if counted == 0 => (0.0, f32::NAN),
        _ => (1.0 / counted as f32, n as f32 / counted as f32),
    };
    let chunk = chunk_rows.clamp(1, n.max(1));
    dispatch!(OP, hidden.dtype(), linear_cross_entropy_t(hidden, weight, &targets, classes, ignore, grad_scale, loss_factor, chunk))
}

#[allow(clippy::too_many_arguments)]
fn linear_cross_entropy_t<T: GpuFloat>(hidden: &Tensor, weight: &Tensor, targets: &Tensor, classes: usize, ignore: Option<u32>, grad_scale: f32, loss_factor: f32, chunk: usize) -> Result<Tensor> {
    const OP: &str = "linear_cross_entropy";
    let (ordinal, dev) = device_of(OP, hidden)?;
    let (n, c, padded) = (hidden.shape()[0], hidden.shape()[1], weight.shape()[0]);
    let grad_on = crate::autograd::is_grad_enabled();
    let (want_h, want_w) = (grad_on && hidden.is_requires_grad(), grad_on && weight.is_requires_grad());
    let mut losses = dev.alloc::<f32>(n)?;
    let mut dh = if want_h { Some(dev.alloc::<T>(n * c)?) } else { None };
    // The weight gradient sums over chunks in f32 (one rounding, in backward's scaling).
    let mut dw = if want_w { Some(dev.alloc::<f32>(padded * c)?) } else { None };
    {
        let (hb, wb, tb) = (dense::<T>(OP, hidden)?, dense::<T>(OP, weight)?, dense_u32(OP, targets)?);
        let mut logits = dev.alloc::<T>(chunk * padded)?;
        for start in (0..n).step_by(chunk) {
            let rows = chunk.min(n - start);
            dev.gemm(&Gemm { trans_b: true, offsets: [start * c, 0, 0], ..Gemm::new(rows, padded, c) }, &hb, &wb, &mut logits)?;
            dev.fused_classifier(&mut logits, rows, padded, classes, &tb, start, &mut losses, ignore, (want_h || want_w).then_some(grad_scale))?;
            if let Some(dh) = dh.as_mut() {
                dev.gemm(&Gemm { offsets: [0, 0, start * c], ..Gemm::new(rows, c, padded) }, &logits, &wb, dh)?;
            }
            if let Some(dw) = dw.as_mut() {
                let beta = if start == 0 { 0.0 } else { 1.0 };
                dev.gemm_f32_out(&Gemm { trans_a: true, beta, offsets: [0, start * c, 0], ..Gemm::new(padded, c, rows) }, &logits, &hb, dw)?;
            }
        }
    }
    let mut loss = dev.alloc::<f32>(1)?;
    dev.mean_f32(&losses, &mut loss)?;
    dev.scale_in_place(&mut loss, loss_factor)?;
    let y = tensor_from(ordinal, DeviceData::F32(loss), &[]);
    let dh = dh.map(|b| wrap(ordinal, b, &[n, c]));
    let dw = dw.map(|b| wrap(ordinal, b, &[padded, c]));
    Ok(Tensor::with_node(y.storage().clone(), y.layout().clone(), DType::F32, OP, &[hidden, weight], move |g: &Tensor, _: &Tensor| {
        let dev = device(ordinal)?;
        let g = if g.dtype() == DType::F32 { g.clone() } else { cast(g, DType::F32)? };
        let gb = dense::<f32>(OP, &g)?;
        // Each gradient made in forward, times the upstream scalar, by `scale` (dhidden is kept in
        // T, dweight in its f32 accumulator).
        let scaled = |made: &Tensor, scale: &dyn Fn(&mut Buffer<T>) -> Result<()>| -> Result<Tensor> {
            let mut out = dev.alloc::<T>(made.numel())?;
            scale(&mut out)?;
            Ok(wrap(ordinal, out, made.shape()))
        };
        let gh = dh.as_ref().map(|made| scaled(made, &|out| Ok(dev.scale_by_device(&*dense::<T>(OP, made)?, &gb, out)?))).transpose()?;
        let gw = dw.as_ref().map(|made| scaled(made, &|out| Ok(dev.scale_by_device_from_f32(&*dense::<f32>(OP, made)?, &gb, out)?))).transpose()?;
        Ok(vec![gh, gw])
    }))
}

// ------------------------------------------------------------------------- casts, in place

/// A copy in `dtype` (f32 ↔ bf16), differentiable.
pub(crate) fn cast(x: &Tensor, dtype: DType) -> Result<Tensor> {
    const OP: &str = "to_dtype";
    if x.dtype() == dtype {
        return Ok(x.clone());
    }
    let (ordinal, dev) = device_of(OP, x)?;
    let data = match (x.dtype(), dtype) {
        (DType::F32, DType::BF16) => {
            let mut y = dev.alloc::<bf16>(x.numel())?;
            dev.cast_f32_to_bf16(&*dense::<f32>(OP, x)?, &mut y)?;
            DeviceData::BF16(y)
        }
        (DType::BF16, DType::F32) => {
            let mut y = dev.alloc::<f32>(x.numel())?;
            dev.cast_bf16_to_f32(&*dense::<bf16>(OP, x)?, &mut y)?;
            DeviceData::F32(y)
        }
        (from, _) => return Err(Error::UnsupportedDType { op: OP, dtype: from }),
    };
    let from = x.dtype();
    let y = tensor_from(ordinal, data, x.shape());
    Ok(Tensor::with_node(y.storage().clone(), y.layout().clone(), dtype, OP, &[x], move |g: &Tensor, _: &Tensor| Ok(vec![Some(cast(g, from)?)])))
}

/// `dst += src` in place (same shape, or `src` broadcast over leading dimensions).
pub(crate) fn add_assign(dst: &Tensor, src: &Tensor) -> Result<()> {
    const OP: &str = "add_assign_";
    let src = if src.dtype() == dst.dtype() { src.clone() } else { cast(src, dst.dtype())? };
    same_device(OP, dst, &src)?;
    let src = if src.storage().same(dst.storage()) { clone_dense(&src)? } else { src };
    dispatch!(OP, dst.dtype(), add_assign_t(dst, &src))
}

fn add_assign_t<T: GpuFloat>(dst: &Tensor, src: &Tensor) -> Result<()> {
    const OP: &str = "add_assign_";
    let (_, dev) = device_of(OP, dst)?;
    check_dense_mut(OP, dst)?;
    let s = dense::<T>(OP, src)?;
    let mut guard = dst.storage().write_cuda(OP)?;
    let dtype = guard.dtype();
    let d = T::buffer_mut(&mut guard).ok_or(Error::DTypeMismatch { op: OP, lhs: dtype, rhs: <T as DeviceElem>::DTYPE })?;
    Ok(dev.add_rows_in_place(d, &s)?)
}

fn check_dense_mut(op: &'static str, x: &Tensor) -> Result<()> {
    if !x.is_contiguous() || x.layout().offset() != 0 || x.storage().len() != x.numel() {
        return Err(Error::NotContiguous { op, shape: x.shape().to_vec(), strides: x.layout().strides().to_vec() });
    }
    Ok(())
}

/// A dense copy of a device tensor's storage, viewed with the same layout.
pub(crate) fn clone_dense(x: &Tensor) -> Result<Tensor> {
    let (ordinal, dev) = device_of("clone", x)?;
    let data = {
        let g = x.storage().read_cuda("clone")?;
        match &*g {
            DeviceData::F32(b) => {
                let mut c = dev.alloc::<f32>(b.len())?;
                dev.copy_dtod(b, &mut c)?;
                DeviceData::F32(c)
            }
            DeviceData::BF16(b) => {
                let mut c = dev.alloc::<bf16>(b.len())?;
                dev.copy_dtod(b, &mut c)?;
                DeviceData::BF16(c)
            }
            DeviceData::U32(b) => {
                let mut c = dev.alloc::<u32>(b.len())?;
                dev.copy_dtod(b, &mut c)?;
                DeviceData::U32(c)
            }
        }
    };
    let t = tensor_from(ordinal, data, &[x.storage().len()]);
    Ok(Tensor::from_parts(t.storage().clone(), x.layout().clone(), x.dtype(), false, None))
}

/// Copies `src` (same shape, on the host or the same device, any float dtype) into the dense
/// device tensor `dst` in place, rounded to `dst`'s dtype: the buffer keeps its identity, so
/// optimizers and other holders of `dst` see the new values. A host source is converted on the
/// host and uploaded once.
pub(crate) fn copy_(dst: &Tensor, src: &Tensor) -> Result<()> {
    const OP: &str = "copy_from_";
    if src.shape() != dst.shape() {
        return Err(Error::ShapeMismatch { op: OP, lhs: dst.shape().to_vec(), rhs: src.shape().to_vec() });
    }
    let (ordinal, _) = device_of(OP, dst)?;
    let src = match src.device() {
        Device::Cpu => super::upload(&src.to_dtype(dst.dtype())?, ordinal)?,
        _ => {
            let same = if src.dtype() == dst.dtype() { src.clone() } else { cast(src, dst.dtype())? };
            if !same.is_contiguous() || same.layout().offset() != 0 || same.storage().len() != same.numel() || same.storage().same(dst.storage()) {
                clone_dense(&same)?
            } else {
                same
            }
        }
    };
    same_device(OP, dst, &src)?;
    dispatch!(OP, dst.dtype(), copy_t(dst, &src))
}

fn copy_t<T: GpuFloat>(dst: &Tensor, src: &Tensor) -> Result<()> {
    const OP: &str = "copy_from_";
    let (_, dev) = device_of(OP, dst)?;
    check_dense_mut(OP, dst)?;
    let s = dense::<T>(OP, src)?;
    let mut guard = dst.storage().write_cuda(OP)?;
    let dtype = guard.dtype();
    let d = T::buffer_mut(&mut guard).ok_or(Error::DTypeMismatch { op: OP, lhs: dtype, rhs: <T as DeviceElem>::DTYPE })?;
    Ok(dev.copy_dtod(&s, d)?)
}

/// [`Tensor::bits_checksum`] of a device tensor: one digest per chunk computed on the device and
/// only those copied back (8 bytes per chunk), folded on the host. A strided view is hashed
/// through a host copy.
pub(crate) fn bits_checksum(x: &Tensor) -> Result<u64> {
    match bits_checksums(std::slice::from_ref(x))? {
        Some(digests) => digests.first().copied().ok_or(Error::InvalidArgument { op: "bits_checksum", reason: "no digest came back".into() }),
        None => Ok(checksum::host_bits_checksum(&x.to_data()?)),
    }
}

/// The digests of `tensors` when all are dense, non-empty and on one GPU: each tensor's chunk
/// digests go into one shared buffer (queued kernels), copied back once. `None` otherwise.
pub(crate) fn bits_checksums(tensors: &[Tensor]) -> Result<Option<Vec<u64>>> {
    const OP: &str = "bits_checksum";
    let Some(first) = tensors.first() else { return Ok(Some(Vec::new())) };
    let device = first.device();
    let eligible = |x: &Tensor| x.device() == device && x.numel() > 0 && x.is_contiguous() && x.layout().offset() == 0 && x.storage().len() == x.numel();
    if device == Device::Cpu || !tensors.iter().all(eligible) {
        return Ok(None);
    }
    let (_, dev) = device_of(OP, first)?;
    let chunks: Vec<usize> = tensors.iter().map(|x| x.numel().div_ceil(CHECKSUM_CHUNK)).collect();
    let mut out = dev.alloc::<u32>(2 * chunks.iter().sum::<usize>())?;
    let mut at = 0;
    for (x, n_chunks) in tensors.iter().zip(&chunks) {
        let g = x.storage().read_cuda(OP)?;
        match &*g {
            DeviceData::F32(b) => dev.bits_checksum_chunks(b, CHECKSUM_CHUNK, &mut out, at)?,
            DeviceData::BF16(b) => dev.bits_checksum_chunks(b, CHECKSUM_CHUNK, &mut out, at)?,
            DeviceData::U32(b) => dev.bits_checksum_chunks(b, CHECKSUM_CHUNK, &mut out, at)?,
        }
        at += 2 * n_chunks;
    }
    let words = dev.dtoh(&out)?;
    let mut digests = Vec::with_capacity(tensors.len());
    let mut at = 0;
    for (x, n_chunks) in tensors.iter().zip(&chunks) {
        let mine: Vec<u64> = words[at..at + 2 * n_chunks].chunks_exact(2).map(|w| u64::from(w[0]) | (u64::from(w[1]) << 32)).collect();
        digests.push(checksum::fold_digests(&mine, x.numel()));
        at += 2 * n_chunks;
    }
    Ok(Some(digests))
}

/// `x · k` for a dense device tensor (the scaled loss of a data-parallel rank), differentiable.
pub(crate) fn mul_scalar(x: &Tensor, k: f64) -> Result<Tensor> {
    const OP: &str = "mul_scalar";
    check_dense_mut(OP, x)?;
    let y = clone_dense(&x.detach())?;
    scale_(&y, k)?;
    Ok(Tensor::with_node(y.storage().clone(), y.layout().clone(), x.dtype(), OP, &[x], move |g: &Tensor, _: &Tensor| {
        let dx = clone_dense(&g.detach())?;
        scale_(&dx, k)?;
        Ok(vec![Some(dx)])
    }))
}

/// Sets every element to `value` in place (dense tensors).
pub(crate) fn fill_(x: &Tensor, value: f64) -> Result<()> {
    dispatch!("fill_", x.dtype(), in_place_t(x, InPlace::Fill(value as f32)))
}

/// Multiplies every element by `k` in place (dense tensors).
pub(crate) fn scale_(x: &Tensor, k: f64) -> Result<()> {
    dispatch!("scale_", x.dtype(), in_place_t(x, InPlace::Scale(k as f32)))
}

enum InPlace {
    Fill(f32),
    Scale(f32),
}

fn in_place_t<T: GpuFloat>(x: &Tensor, what: InPlace) -> Result<()> {
    const OP: &str = "in-place update";
    let (_, dev) = device_of(OP, x)?;
    check_dense_mut(OP, x)?;
    let mut guard = x.storage().write_cuda(OP)?;
    let dtype = guard.dtype();
    let b = T::buffer_mut(&mut guard).ok_or(Error::DTypeMismatch { op: OP, lhs: dtype, rhs: <T as DeviceElem>::DTYPE })?;
    match what {
        InPlace::Fill(v) => dev.fill(b, v)?,
        InPlace::Scale(k) => dev.scale_in_place(b, k)?,
    }
    Ok(())
}
