//! Matrix multiplication: `[.., m, k] @ [.., k, n]` with broadcast batch dims, on strided
//! operands (transposed views cost nothing: the gemm kernel reads them with swapped strides).
//! A batched input times a plain matrix folds the batch into `m` for one large product.

use super::check_same;
use crate::error::{Error, Result};
use crate::layout::broadcast_shape;
use crate::ops::binary::compute_form;
use crate::storage::CpuData;
use crate::tensor::{FloatVec, Tensor};
use rayon::prelude::*;
use rtx_kernels::matmul::{linear, matmul, Operand};
use rtx_kernels::{DType, Float};

/// Element offsets of every batch index of a layout broadcast to `batch`.
pub(crate) fn batch_offsets(batch: &[usize], shape: &[usize], strides: &[usize], offset: usize) -> Vec<usize> {
    let n: usize = batch.iter().product();
    let lead = batch.len() - (shape.len() - 2);
    (0..n)
        .map(|mut idx| {
            let mut off = offset;
            for d in (0..batch.len()).rev() {
                let c = idx % batch[d];
                idx /= batch[d];
                if d >= lead {
                    let own = d - lead;
                    if shape[own] != 1 {
                        off += c * strides[own];
                    }
                }
            }
            off
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn batched<T: Float + crate::pool::Pooled>(m: usize, n: usize, k: usize, a: &[T], a_offs: &[usize], a_rs: usize, a_cs: usize, b: &[T], b_offs: &[usize], b_rs: usize, b_cs: usize) -> Result<Vec<T>> {
    let n_batch = a_offs.len();
    let mut out = crate::pool::take::<T>(n_batch * m * n);
    if m * n == 0 {
        return Ok(out);
    }
    let one = |i: usize, dst: &mut [T]| {
        matmul(m, n, k, a, Operand { offset: a_offs[i], row_stride: a_rs, col_stride: a_cs }, b, Operand { offset: b_offs[i], row_stride: b_rs, col_stride: b_cs }, dst, 0, false)
    };
    if n_batch > 1 && m * n * k < 256 * 256 * 256 {
        out.par_chunks_mut(m * n).enumerate().try_for_each(|(i, dst)| one(i, dst))?;
    } else {
        for (i, dst) in out.chunks_mut(m * n).enumerate() {
            one(i, dst)?;
        }
    }
    Ok(out)
}

impl Tensor {
    /// Matrix product with broadcast batch dims: `[.., m, k] @ [.., k, n] -> [.., m, n]`.
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        check_same("matmul", self, rhs)?;
        super::check_float("matmul", self)?;
        let (ra, rb) = (self.rank(), rhs.rank());
        if ra < 2 || rb < 2 {
            return Err(Error::BadShape { op: "matmul", shape: if ra < 2 { self.shape().to_vec() } else { rhs.shape().to_vec() }, reason: "operands need at least 2 dims".into() });
        }
        let (m, k) = (self.shape()[ra - 2], self.shape()[ra - 1]);
        let (k2, n) = (rhs.shape()[rb - 2], rhs.shape()[rb - 1]);
        if k != k2 {
            return Err(Error::ShapeMismatch { op: "matmul", lhs: self.shape().to_vec(), rhs: rhs.shape().to_vec() });
        }
        if ra > 2 && rb == 2 && self.is_contiguous() {
            // Fold the batch into the rows: one large product instead of many small ones.
            let rows: usize = self.shape()[..ra - 1].iter().product();
            let flat = self.reshape(&[rows, k])?.matmul(rhs)?;
            let mut shape = self.shape()[..ra - 1].to_vec();
            shape.push(n);
            return flat.reshape(&shape);
        }
        let batch = broadcast_shape("matmul", &self.shape()[..ra - 2], &rhs.shape()[..rb - 2])?;
        // The backward, in tensor ops, for every device.
        let (lhs, rhs_d) = (self.detach(), rhs.detach());
        let (req_a, req_b) = (self.is_requires_grad(), rhs.is_requires_grad());
        let backward = move |g: &Tensor, _: &Tensor| {
            let ga = if req_a { Some(g.matmul(&rhs_d.t()?)?.sum_to_shape(lhs.shape())?) } else { None };
            let gb = if req_b { Some(lhs.t()?.matmul(g)?.sum_to_shape(rhs_d.shape())?) } else { None };
            Ok(vec![ga, gb])
        };
        if let Some(device) = crate::backend::of(&[self, rhs]) {
            let y = device.matmul(self, rhs, &batch)?;
            return Ok(Tensor::with_node(y.storage().clone(), y.layout().clone(), y.dtype(), "matmul", &[self, rhs], backward));
        }
        let (a, b) = (compute_form(self)?, compute_form(rhs)?);
        let (la, lb) = (a.layout(), b.layout());
        let a_offs = batch_offsets(&batch, la.shape(), la.strides(), la.offset());
        let b_offs = batch_offsets(&batch, lb.shape(), lb.strides(), lb.offset());
        let (a_rs, a_cs) = (la.strides()[ra - 2], la.strides()[ra - 1]);
        let (b_rs, b_cs) = (lb.strides()[rb - 2], lb.strides()[rb - 1]);
        let values = {
            let (da, db) = (a.storage().read()?, b.storage().read()?);
            match (&*da, &*db) {
                (CpuData::F32(x), CpuData::F32(y)) => FloatVec::F32(batched(m, n, k, x, &a_offs, a_rs, a_cs, y, &b_offs, b_rs, b_cs)?),
                (CpuData::F64(x), CpuData::F64(y)) => FloatVec::F64(batched(m, n, k, x, &a_offs, a_rs, a_cs, y, &b_offs, b_rs, b_cs)?),
                (x, y) => return Err(Error::DTypeMismatch { op: "matmul", lhs: x.dtype(), rhs: y.dtype() }),
            }
        };
        let mut shape = batch.clone();
        shape.extend_from_slice(&[m, n]);
        Tensor::from_op(values, &shape, self.dtype(), "matmul", &[self, rhs], backward)
    }
    /// A GPT feed-forward, `linear(gelu_tanh(linear(self, w1, b1)), w2, b2)` (`w1 [hidden, in]`,
    /// `w2 [out, hidden]`). On a GPU in bf16 it is one node whose GEMMs apply the GELU, its
    /// derivative and the first bias's gradient in cuBLASLt epilogues (no GELU passes over the
    /// hidden activations); elsewhere it is the three ops.
    pub fn linear_gelu_linear(&self, w1: &Tensor, b1: &Tensor, w2: &Tensor, b2: &Tensor) -> Result<Tensor> {
        if let Some(device) = crate::backend::of(&[self]) {
            return device.linear_gelu_linear(self, w1, b1, w2, b2);
        }
        self.linear(w1, Some(b1))?.gelu_with(crate::GeluApprox::Tanh)?.linear(w2, Some(b2))
    }

    /// A fully connected layer, `self · weightᵀ + bias` over the last dim (`weight` is
    /// `[out, in]`, `bias` `[out]`, as `torch.nn.functional.linear`). For f32/f64 the bias is
    /// the starting value of one gemm (no separate add pass), and the backward writes the weight
    /// gradient directly in `[out, in]` layout; other cases compose `matmul` and `add`.
    pub fn linear(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        const OP: &str = "linear";
        check_same(OP, self, weight)?;
        if let Some(device) = crate::backend::of(&[self]).filter(|_| weight.rank() == 2 && self.rank() > 0 && self.shape()[self.rank() - 1] == weight.shape()[1] && bias.is_none_or(|b| b.shape() == [weight.shape()[0]])) {
            return device.linear(self, weight, bias);
        }
        super::check_float(OP, self)?;
        if weight.rank() != 2 || self.rank() == 0 || self.shape()[self.rank() - 1] != weight.shape()[1] {
            return Err(Error::ShapeMismatch { op: OP, lhs: self.shape().to_vec(), rhs: weight.shape().to_vec() });
        }
        let (n_in, n_out) = (weight.shape()[1], weight.shape()[0]);
        if let Some(b) = bias {
            check_same(OP, self, b)?;
            if b.shape() != [n_out] {
                return Err(Error::ShapeMismatch { op: OP, lhs: weight.shape().to_vec(), rhs: b.shape().to_vec() });
            }
        }
        let fast = matches!(self.dtype(), DType::F32 | DType::F64) && self.is_contiguous() && weight.is_contiguous() && bias.is_none_or(|b| b.is_contiguous());
        if !fast {
            let y = self.matmul(&weight.t()?)?;
            return match bias {
                Some(b) => y.add(b),
                None => Ok(y),
            };
        }
        let rows: usize = self.shape()[..self.rank() - 1].iter().product();
        let values = match self.dtype() {
            DType::F64 => FloatVec::F64(linear_forward::<f64>(self, weight, bias, rows, n_in, n_out)?),
            _ => FloatVec::F32(linear_forward::<f32>(self, weight, bias, rows, n_in, n_out)?),
        };
        let mut shape = self.shape().to_vec();
        *shape.last_mut().ok_or(Error::BadShape { op: OP, shape: vec![], reason: "needs a feature dim".into() })? = n_out;
        let (x, w) = (self.detach(), weight.detach());
        let (want_x, want_w, want_b, has_b) = (self.is_requires_grad(), weight.is_requires_grad(), bias.is_some_and(|b| b.is_requires_grad()), bias.is_some());
        let mut inputs = vec![self, weight];
        inputs.extend(bias);
        Tensor::from_op(values, &shape, self.dtype(), OP, &inputs, move |g: &Tensor, _: &Tensor| {
            let g2 = g.reshape(&[rows, n_out])?;
            let gx = if want_x { Some(g2.matmul(&w)?.reshape(x.shape())?) } else { None };
            let gw = if want_w { Some(g2.t()?.matmul(&x.reshape(&[rows, n_in])?)?) } else { None };
            let mut grads = vec![gx, gw];
            if has_b {
                grads.push(if want_b { Some(g2.sum(&[0], false)?) } else { None });
            }
            Ok(grads)
        })
    }
}

/// `x · wᵀ (+ b)` for contiguous operands ([`rtx_kernels::matmul::linear`]: blocks of rows that
/// start as copies of `b` and get the product added while in cache).
fn linear_forward<T: Float + crate::pool::Pooled + crate::tensor::Element>(x: &Tensor, w: &Tensor, b: Option<&Tensor>, rows: usize, n_in: usize, n_out: usize) -> Result<Vec<T>> {
    let mut out = crate::pool::take::<T>(rows * n_out);
    let (dx, dw) = (x.storage().read()?, w.storage().read()?);
    let (Some(xs), Some(ws)) = (T::slice(&dx), T::slice(&dw)) else {
        return Err(Error::DTypeMismatch { op: "linear", lhs: x.dtype(), rhs: w.dtype() });
    };
    match b {
        Some(b) => {
            let db = b.storage().read()?;
            let bs = T::slice(&db).ok_or(Error::DTypeMismatch { op: "linear", lhs: x.dtype(), rhs: b.dtype() })?;
            let bs = &bs[b.layout().offset()..b.layout().offset() + n_out];
            linear(rows, n_in, n_out, xs, x.layout().offset(), ws, w.layout().offset(), Some(bs), &mut out)?;
        }
        None => linear(rows, n_in, n_out, xs, x.layout().offset(), ws, w.layout().offset(), None, &mut out)?,
    }
    Ok(out)
}
