//! [`Tensor::linear_cross_entropy`]: a language model's head (`hidden · weightᵀ`) fused with the
//! softmax cross-entropy, chunk by chunk of rows, so the `[N, V]` logits never exist whole: at most
//! `chunk_rows × V` of them at a time. For GPT-2's padded 50,304-token vocabulary and 16 × 1024
//! positions the whole logits are 3.3 GB in f32 (and as much again for their gradient); 1,024-row
//! chunks need 206 MB.
//!
//! The gradients of hidden and weight are computed in the same pass (each chunk's logit gradient
//! is used at once: `dhidden[chunk] = dlogits · weight`, `dweight += dlogitsᵀ · hidden[chunk]`)
//! and backward only scales them by the incoming gradient, so nothing is recomputed. This is the
//! scheme of Liger-Kernel's fused linear cross-entropy; llm.c's fused classifier likewise writes
//! the logit gradient during the forward pass. It is also why only the mean and sum reductions
//! exist here: per-row losses would need each row's upstream gradient before the weight gradient
//! could be summed (use `matmul` + [`Tensor::cross_entropy`] for those).
//!
//! Results equal the unfused `hidden.matmul(weightᵀ).cross_entropy(targets)` up to rounding
//! (the loss is summed in f64 over chunks; `tests/linear_cross_entropy.rs` checks both ways).
//! On a CUDA device the same scheme runs as cuBLAS GEMMs per chunk around one fused kernel that
//! turns the chunk's logits into its loss rows and, in place, its logit gradient
//! (`crate::cuda::linear_cross_entropy`).

use super::softmax::{CrossEntropyOptions, Reduction, Targets};
use super::{check_float, check_same};
use crate::autograd::{is_grad_enabled, no_grad};
use crate::error::{Error, Result};
use crate::tensor::{FloatSlice, FloatVec, Tensor};
use rtx_kernels::cross_entropy::CrossEntropySpec;
use rtx_kernels::{DType, Device};

const OP: &str = "linear_cross_entropy";

/// What one pass over the chunks produced.
struct Pass {
    loss_sum: f64,
    counted: usize,
    grad_hidden: Option<Tensor>,
    grad_weight: Option<Tensor>,
}

impl Tensor {
    /// Cross-entropy of the logits `self · weightᵀ` (`self`: hidden states `[N, C]`, `weight`:
    /// `[V, C]`, targets: `[N]` u32 or i64 class indices) without materialising the `[N, V]`
    /// logits: rows are processed `chunk_rows` at a time (module docs). `options` as for
    /// [`Tensor::cross_entropy`], with reduction mean or sum.
    pub fn linear_cross_entropy(&self, weight: &Tensor, targets: &Tensor, options: CrossEntropyOptions, chunk_rows: usize) -> Result<Tensor> {
        self.linear_cross_entropy_valid(weight, targets, weight.shape().first().copied().unwrap_or(0), options, chunk_rows)
    }

    /// [`Tensor::linear_cross_entropy`] where only the first `classes` rows of `weight` are
    /// classes and the rest are padding (a vocabulary padded to a GEMM-friendly size, as llm.c
    /// pads GPT-2's 50,257 tokens to 50,304): the softmax runs over the first `classes` logits,
    /// a target must be below `classes`, and the padding rows get a zero gradient. The result
    /// equals `linear_cross_entropy` with `weight.narrow(0, 0, classes)`.
    pub fn linear_cross_entropy_valid(&self, weight: &Tensor, targets: &Tensor, classes: usize, options: CrossEntropyOptions, chunk_rows: usize) -> Result<Tensor> {
        check_float(OP, self)?;
        check_same(OP, self, weight)?;
        if self.rank() != 2 || weight.rank() != 2 || self.shape()[1] != weight.shape()[1] {
            return Err(Error::ShapeMismatch { op: OP, lhs: self.shape().to_vec(), rhs: weight.shape().to_vec() });
        }
        let (n, rows) = (self.shape()[0], weight.shape()[0]);
        if classes == 0 || classes > rows {
            return Err(Error::InvalidArgument { op: OP, reason: format!("classes {classes} must be in 1..={rows} (the weight's rows)") });
        }
        if !matches!(targets.dtype(), DType::U32 | DType::I64) {
            return Err(Error::DTypeMismatch { op: OP, lhs: targets.dtype(), rhs: DType::I64 });
        }
        if targets.shape() != [n] {
            return Err(Error::ShapeMismatch { op: OP, lhs: self.shape().to_vec(), rhs: targets.shape().to_vec() });
        }
        if chunk_rows == 0 {
            return Err(Error::InvalidArgument { op: OP, reason: "chunk_rows must be at least 1".into() });
        }
        if options.reduction == Reduction::None {
            return Err(Error::InvalidArgument { op: OP, reason: "reduction None needs every row's upstream gradient before the weight gradient can be summed: use matmul + cross_entropy for per-row losses".into() });
        }
        if !(0.0..1.0).contains(&options.label_smoothing) {
            return Err(Error::InvalidArgument { op: OP, reason: format!("label_smoothing {} outside [0, 1)", options.label_smoothing) });
        }
        if let Some(device) = crate::backend::of(&[self, weight]) {
            return device.linear_cross_entropy(self, weight, targets, classes, options, chunk_rows);
        }
        if self.device() != Device::Cpu || weight.device() != Device::Cpu {
            return Err(Error::UnsupportedDevice { op: OP, device: self.device() });
        }
        // The padding rows are cut off by a view, whose backward gives them a zero gradient.
        let narrowed;
        let weight = if classes < rows {
            narrowed = weight.narrow(0, 0, classes)?;
            &narrowed
        } else {
            weight
        };
        let spec = CrossEntropySpec { n_classes: classes, ignore_index: options.ignore_index, label_smoothing: options.label_smoothing };
        // Read before `no_grad`, which turns it off for the chunk ops.
        let want_grad = is_grad_enabled() && (self.is_requires_grad() || weight.is_requires_grad());
        let pass = no_grad(|| chunked_pass(self, weight, &Targets::of(targets)?, spec, chunk_rows, want_grad))?;
        let (value, scale) = match options.reduction {
            Reduction::Sum => (pass.loss_sum, 1.0),
            // No counted row: 0/0 = NaN as PyTorch, and a zero gradient.
            Reduction::Mean if pass.counted == 0 => (f64::NAN, 0.0),
            _ => (pass.loss_sum / pass.counted as f64, 1.0 / pass.counted as f64),
        };
        let dtype = self.dtype();
        let out = Tensor::full(&[], value, dtype);
        let Pass { grad_hidden, grad_weight, .. } = pass;
        Ok(Tensor::with_node(out.storage().clone(), out.layout().clone(), dtype, OP, &[self, weight], move |g: &Tensor, _: &Tensor| {
            let g = g.reshape(&[1])?.mul_scalar(scale)?;
            let scaled = |t: &Option<Tensor>| t.as_ref().map(|t| t.mul(&g)).transpose();
            Ok(vec![scaled(&grad_hidden)?, scaled(&grad_weight)?])
        }))
    }
}

/// The loss sum, counted rows and (when autograd wants them) the unscaled gradients, one chunk of
/// rows at a time. Runs under `no_grad`: the chunk ops are not recorded.
fn chunked_pass(hidden: &Tensor, weight: &Tensor, targets: &Targets, spec: CrossEntropySpec, chunk_rows: usize, want_grad: bool) -> Result<Pass> {
    let (n, vocab) = (hidden.shape()[0], weight.shape()[0]);
    let dtype = hidden.dtype();
    let weight_t = weight.transpose(0, 1)?;
    let mut pass = Pass { loss_sum: 0.0, counted: 0, grad_hidden: None, grad_weight: None };
    let mut hidden_chunks = Vec::new();
    for start in (0..n).step_by(chunk_rows) {
        let rows = chunk_rows.min(n - start);
        let h = hidden.narrow(0, start, rows)?;
        let logits = h.matmul(&weight_t)?;
        let (loss, counted, grad) = logits.with_float_slice(|x| match x {
            FloatSlice::F32(x) => chunk_rows_of(targets, start, x, spec, rows, want_grad).map(|(l, c, g)| (l, c, FloatVec::F32(g))),
            FloatSlice::F64(x) => chunk_rows_of(targets, start, x, spec, rows, want_grad).map(|(l, c, g)| (l, c, FloatVec::F64(g))),
        })??;
        pass.loss_sum += loss;
        pass.counted += counted;
        if want_grad {
            let grad_logits = Tensor::from_data(grad.into_data(dtype), &[rows, vocab])?;
            if hidden.is_requires_grad() {
                hidden_chunks.push(grad_logits.matmul(weight)?);
            }
            if weight.is_requires_grad() {
                let part = grad_logits.transpose(0, 1)?.matmul(&h)?;
                pass.grad_weight = Some(match pass.grad_weight.take() {
                    Some(sum) => sum.add(&part)?,
                    None => part,
                });
            }
        }
    }
    if want_grad && hidden.is_requires_grad() {
        pass.grad_hidden = Some(match hidden_chunks.len() {
            0 => Tensor::zeros(hidden.shape(), dtype),
            _ => Tensor::cat(&hidden_chunks.iter().collect::<Vec<_>>(), 0)?,
        });
    }
    if want_grad && weight.is_requires_grad() && pass.grad_weight.is_none() {
        pass.grad_weight = Some(Tensor::zeros(weight.shape(), dtype));
    }
    Ok(pass)
}

/// One chunk's loss sum (f64), counted rows, and per-row loss gradient w.r.t. its logits (empty
/// unless `want_grad`).
fn chunk_rows_of<T: rtx_kernels::Float + crate::pool::Pooled>(targets: &Targets, start: usize, logits: &[T], spec: CrossEntropySpec, rows: usize, want_grad: bool) -> Result<(f64, usize, Vec<T>)> {
    let mut losses = vec![T::default(); rows];
    let mut grad = if want_grad { crate::pool::zeroed::<T>(logits.len()) } else { Vec::new() };
    let counted = targets.rows_at(start, logits, spec, &mut losses, want_grad.then_some(grad.as_mut_slice()))?;
    Ok((losses.iter().map(|l| l.to_f64_lossless()).sum(), counted, grad))
}
