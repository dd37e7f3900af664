//! Finite-difference gradient checking, as `torch.autograd.gradcheck`: compares the gradients
//! autograd computes with central differences, in f64.

use crate::error::{Error, Result};
use crate::rng::Generator;
use crate::tensor::Tensor;
use rtx_kernels::DType;

/// The worst disagreement a [`gradcheck`] found.
#[derive(Clone, Debug, PartialEq)]
pub struct GradcheckReport {
    /// Largest |analytic − numeric| over all checked elements.
    pub max_abs_error: f64,
    /// Largest |analytic − numeric| / max(1, |numeric|).
    pub max_rel_error: f64,
    /// Number of input elements checked.
    pub checked: usize,
}

/// Checks `f`'s gradients with respect to every element of `inputs` (f64 tensors) by central
/// differences with step `eps`. The output is reduced with fixed random weights drawn from
/// `seed` so every output element matters. Fails with `InvalidArgument` when the relative error
/// exceeds `tolerance`.
pub fn gradcheck(f: impl Fn(&[Tensor]) -> Result<Tensor>, inputs: &[Tensor], eps: f64, tolerance: f64, seed: u64) -> Result<GradcheckReport> {
    for t in inputs {
        if t.dtype() != DType::F64 {
            return Err(Error::DTypeMismatch { op: "gradcheck", lhs: t.dtype(), rhs: DType::F64 });
        }
    }
    let leaves: Vec<Tensor> = inputs.iter().map(|t| Tensor::from_vec(t.to_f64_vec().unwrap_or_default(), t.shape()).map(|x| x.requires_grad(true))).collect::<Result<_>>()?;
    let probe = f(&leaves)?;
    let mut rng = Generator::new(seed);
    let weights = Tensor::randn(probe.shape(), 0.0, 1.0, DType::F64, &mut rng)?;
    let objective = |xs: &[Tensor]| -> Result<f64> { f(xs)?.mul(&weights)?.sum_all()?.item() };
    let loss = probe.mul(&weights)?.sum_all()?;
    loss.backward()?;
    let mut report = GradcheckReport { max_abs_error: 0.0, max_rel_error: 0.0, checked: 0 };
    for (i, leaf) in leaves.iter().enumerate() {
        let analytic = match leaf.grad() {
            Some(g) => g.to_f64_vec()?,
            None => vec![0.0; leaf.numel()],
        };
        let base = leaf.to_f64_vec()?;
        for j in 0..base.len() {
            let eval = |delta: f64| -> Result<f64> {
                let mut v = base.clone();
                v[j] += delta;
                let mut xs: Vec<Tensor> = leaves.iter().map(|l| l.detach()).collect();
                xs[i] = Tensor::from_vec(v, leaf.shape())?;
                crate::no_grad(|| objective(&xs))
            };
            let numeric = (eval(eps)? - eval(-eps)?) / (2.0 * eps);
            let abs = (analytic[j] - numeric).abs();
            let rel = abs / numeric.abs().max(1.0);
            report.max_abs_error = report.max_abs_error.max(abs);
            report.max_rel_error = report.max_rel_error.max(rel);
            report.checked += 1;
            // Fails on NaN too.
            if !matches!(rel.partial_cmp(&tolerance), Some(std::cmp::Ordering::Less | std::cmp::Ordering::Equal)) {
                return Err(Error::InvalidArgument {
                    op: "gradcheck",
                    reason: format!("input {i} element {j}: analytic {} vs numeric {numeric} (rel error {rel:.3e} > {tolerance:.1e})", analytic[j]),
                });
            }
        }
    }
    Ok(report)
}
