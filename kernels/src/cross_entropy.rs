//! Fused softmax + cross-entropy over rows of logits, forward and backward in one pass.
//!
//! For each row `i` with target `t_i` (rows whose target equals the ignore index contribute
//! nothing), with label smoothing `ε` over `C` classes:
//! `loss_i = −(1−ε)·log p[t_i] − (ε/C)·Σ_c log p[c]`, and the gradient with respect to the logits
//! is `p − q` where `q` is the smoothed one-hot target.
//!
//! Targets are `u32` or `i64` ([`ClassTarget`]); the ignore index is an `i64` so PyTorch's
//! `ignore_index = -100` works with signed targets. A negative target that is not the ignore
//! index is out of range, like one at or past the class count.

use crate::error::{Error, Result};
use crate::float::Float;
use crate::reduce::sum;

/// Settings of the fused cross-entropy kernel.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CrossEntropySpec {
    /// Number of classes (row length).
    pub n_classes: usize,
    /// Rows whose target equals this are skipped (PyTorch's default is `-100`).
    pub ignore_index: Option<i64>,
    /// Label smoothing ε in [0, 1).
    pub label_smoothing: f64,
}

/// An integer type class targets come in: `u32` (this crate's labels) or `i64` (PyTorch's).
pub trait ClassTarget: Copy + Send + Sync + 'static {
    /// The value as an `i64` (exact for both).
    fn as_i64(self) -> i64;
}

impl ClassTarget for u32 {
    #[inline(always)]
    fn as_i64(self) -> i64 {
        i64::from(self)
    }
}

impl ClassTarget for i64 {
    #[inline(always)]
    fn as_i64(self) -> i64 {
        self
    }
}

/// Computes per-row losses (0 for ignored rows) and, when `grad` is given, `p − q` per row
/// (0 rows for ignored rows). Returns the number of rows that counted.
pub fn cross_entropy_rows<T: Float, I: ClassTarget>(logits: &[T], targets: &[I], spec: CrossEntropySpec, losses: &mut [T], mut grad: Option<&mut [T]>) -> Result<usize> {
    let c = spec.n_classes;
    let n = targets.len();
    let needed = n.saturating_mul(c);
    crate::error::check_len("cross_entropy", "logits", logits, needed)?;
    crate::error::check_len("cross_entropy", "losses", losses, n)?;
    if let Some(g) = grad.as_deref() {
        crate::error::check_len("cross_entropy", "grad", g, needed)?;
    }
    let eps = T::from_f64_lossy(spec.label_smoothing);
    let cf = T::from_usize(c.max(1)).unwrap_or(T::one());
    let mut counted = 0usize;
    let mut probs = vec![T::zero(); c];
    for (i, &t) in targets.iter().enumerate() {
        let row = &logits[i * c..(i + 1) * c];
        let t = t.as_i64();
        if Some(t) == spec.ignore_index {
            losses[i] = T::zero();
            if let Some(g) = grad.as_deref_mut() {
                g[i * c..(i + 1) * c].fill(T::zero());
            }
            continue;
        }
        let Some(t) = usize::try_from(t).ok().filter(|&t| t < c) else {
            return Err(Error::TargetOutOfRange { op: "cross_entropy", row: i, target: t, n_classes: c });
        };
        counted += 1;
        let m = row.iter().fold(T::neg_infinity(), |a, &v| if v > a { v } else { a });
        for (p, &v) in probs.iter_mut().zip(row) {
            *p = (v - m).exp();
        }
        let s = sum(&probs);
        let lse = s.ln() + m;
        let nll = lse - row[t];
        let loss = if spec.label_smoothing > 0.0 {
            let mean_logp = (sum(row) - cf * lse) / cf;
            (T::one() - eps) * nll - eps * mean_logp
        } else {
            nll
        };
        losses[i] = loss;
        if let Some(g) = grad.as_deref_mut() {
            let inv = T::one() / s;
            let gr = &mut g[i * c..(i + 1) * c];
            let off = eps / cf;
            for (o, &p) in gr.iter_mut().zip(&probs) {
                *o = p * inv - off;
            }
            gr[t] = gr[t] - (T::one() - eps);
        }
    }
    Ok(counted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_logits_give_log_c_and_ignored_rows_count_nothing() {
        let logits = [0.0f64; 8];
        let mut losses = [0.0f64; 2];
        let mut grad = [0.0f64; 8];
        let spec = CrossEntropySpec { n_classes: 4, ignore_index: Some(7), label_smoothing: 0.0 };
        let n = cross_entropy_rows(&logits, &[2u32, 7], spec, &mut losses, Some(&mut grad)).unwrap();
        assert_eq!(n, 1);
        assert!((losses[0] - 4f64.ln()).abs() < 1e-12);
        assert_eq!(losses[1], 0.0);
        assert_eq!(grad[2], 0.25 - 1.0);
        assert_eq!(&grad[4..], &[0.0; 4]);
    }

    #[test]
    fn out_of_range_target_is_an_error() {
        let spec = CrossEntropySpec { n_classes: 3, ignore_index: None, label_smoothing: 0.0 };
        let err = cross_entropy_rows(&[0.0f32; 3], &[3u32], spec, &mut [0.0], None);
        assert!(matches!(err, Err(Error::TargetOutOfRange { target: 3, .. })));
    }

    #[test]
    fn signed_targets_skip_the_ignore_index_and_refuse_other_negatives() {
        // Goal: with i64 targets and PyTorch's ignore_index -100, the -100 rows count nothing
        // and give zero gradient rows, while another negative target is a typed error naming
        // its row.
        let spec = CrossEntropySpec { n_classes: 2, ignore_index: Some(-100), label_smoothing: 0.0 };
        let logits = [1.0f64, 0.0, 0.0, 3.0, 2.0, 2.0];
        let (mut losses, mut grad) = ([9.0f64; 3], [9.0f64; 6]);
        let n = cross_entropy_rows(&logits, &[0i64, -100, 1], spec, &mut losses, Some(&mut grad)).unwrap();
        assert_eq!(n, 2);
        assert!((losses[0] - (1.0 + (-1f64).exp()).ln()).abs() < 1e-12);
        assert_eq!((losses[1], &grad[2..4]), (0.0, &[0.0, 0.0][..]));
        assert!((losses[2] - 2f64.ln()).abs() < 1e-12);
        let err = cross_entropy_rows(&logits, &[0i64, -1, 1], spec, &mut losses, None);
        assert_eq!(err, Err(Error::TargetOutOfRange { op: "cross_entropy", row: 1, target: -1, n_classes: 2 }));
    }

    #[test]
    fn wrong_lengths_are_typed_errors() {
        let spec = CrossEntropySpec { n_classes: 3, ignore_index: None, label_smoothing: 0.0 };
        let short = |buffer, needed, actual| Err(Error::BufferTooSmall { op: "cross_entropy", buffer, needed, actual });
        assert_eq!(cross_entropy_rows(&[0.0f32; 5], &[0u32, 1], spec, &mut [0.0; 2], None), short("logits", 6, 5));
        assert_eq!(cross_entropy_rows(&[0.0f32; 6], &[0u32, 1], spec, &mut [0.0; 1], None), short("losses", 2, 1));
        assert_eq!(cross_entropy_rows(&[0.0f32; 6], &[0u32, 1], spec, &mut [0.0; 2], Some(&mut [0.0; 4])), short("grad", 6, 4));
        let huge = CrossEntropySpec { n_classes: usize::MAX, ..spec };
        assert_eq!(cross_entropy_rows(&[0.0f32; 6], &[0u32, 1], huge, &mut [0.0; 2], None), short("logits", usize::MAX, 6));
    }
}
