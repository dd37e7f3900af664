//! Fused layer normalization and RMS normalization over the rows of a contiguous matrix,
//! forward and backward. The forward saves per-row statistics (mean and reciprocal standard
//! deviation) that the backward reuses.

use crate::float::Float;
use crate::reduce::sum;
use crate::threading::should_parallelize;
use rayon::prelude::*;

/// Layer norm forward: `y = (x − mean) · rstd · w + b` per row of `n`; writes `mean` and `rstd`
/// (one per row). `w` and `b` are optional affine parameters of length `n`.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_forward<T: Float>(x: &[T], n: usize, w: Option<&[T]>, b: Option<&[T]>, eps: T, y: &mut [T], mean: &mut [T], rstd: &mut [T]) {
    assert_eq!(x.len(), y.len());
    assert_eq!(mean.len() * n, x.len());
    assert_eq!(rstd.len(), mean.len());
    let nf = T::from_usize(n).unwrap_or(T::one());
    let row = |(((xr, yr), m), r): (((&[T], &mut [T]), &mut T), &mut T)| {
        let mu = sum(xr) / nf;
        let var = xr.iter().fold(T::zero(), |a, &v| a + (v - mu) * (v - mu)) / nf;
        let rs = T::one() / (var + eps).sqrt();
        *m = mu;
        *r = rs;
        for (j, (o, &v)) in yr.iter_mut().zip(xr).enumerate() {
            let mut h = (v - mu) * rs;
            if let Some(w) = w {
                h = h * w[j];
            }
            if let Some(b) = b {
                h = h + b[j];
            }
            *o = h;
        }
    };
    if n == 0 {
        return;
    }
    if should_parallelize(x.len()) {
        x.par_chunks(n).zip(y.par_chunks_mut(n)).zip(mean.par_iter_mut()).zip(rstd.par_iter_mut()).for_each(row);
    } else {
        x.chunks(n).zip(y.chunks_mut(n)).zip(mean.iter_mut()).zip(rstd.iter_mut()).for_each(row);
    }
}

/// Layer norm backward. Writes `dx`; adds this call's contribution to `dw` and `db` when given.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward<T: Float>(
    x: &[T],
    n: usize,
    w: Option<&[T]>,
    mean: &[T],
    rstd: &[T],
    dy: &[T],
    dx: &mut [T],
    mut dw: Option<&mut [T]>,
    mut db: Option<&mut [T]>,
) {
    assert_eq!(x.len(), dy.len());
    assert_eq!(x.len(), dx.len());
    if n == 0 {
        return;
    }
    let nf = T::from_usize(n).unwrap_or(T::one());
    // Parameter gradients: column sums, row order fixed.
    for (i, (xr, gr)) in x.chunks(n).zip(dy.chunks(n)).enumerate() {
        let (mu, rs) = (mean[i], rstd[i]);
        if let Some(dw) = dw.as_deref_mut() {
            for j in 0..n {
                dw[j] = dw[j] + gr[j] * (xr[j] - mu) * rs;
            }
        }
        if let Some(db) = db.as_deref_mut() {
            for j in 0..n {
                db[j] = db[j] + gr[j];
            }
        }
    }
    let row = |(i, (dxr, (xr, gr))): (usize, (&mut [T], (&[T], &[T])))| {
        let (mu, rs) = (mean[i], rstd[i]);
        // g = dy ⊙ w; dx = rstd · (g − mean(g) − xhat · mean(g ⊙ xhat))
        let mut sum_g = T::zero();
        let mut sum_gx = T::zero();
        for j in 0..n {
            let g = match w {
                Some(w) => gr[j] * w[j],
                None => gr[j],
            };
            let xh = (xr[j] - mu) * rs;
            sum_g = sum_g + g;
            sum_gx = sum_gx + g * xh;
        }
        let (mg, mgx) = (sum_g / nf, sum_gx / nf);
        for j in 0..n {
            let g = match w {
                Some(w) => gr[j] * w[j],
                None => gr[j],
            };
            let xh = (xr[j] - mu) * rs;
            dxr[j] = rs * (g - mg - xh * mgx);
        }
    };
    if should_parallelize(x.len()) {
        dx.par_chunks_mut(n).zip(x.par_chunks(n).zip(dy.par_chunks(n))).enumerate().for_each(row);
    } else {
        dx.chunks_mut(n).zip(x.chunks(n).zip(dy.chunks(n))).enumerate().for_each(row);
    }
}

/// RMS norm forward: `y = x · rstd · w`, `rstd = 1/sqrt(mean(x²) + eps)` per row; writes `rstd`.
pub fn rms_norm_forward<T: Float>(x: &[T], n: usize, w: Option<&[T]>, eps: T, y: &mut [T], rstd: &mut [T]) {
    assert_eq!(x.len(), y.len());
    assert_eq!(rstd.len() * n, x.len());
    if n == 0 {
        return;
    }
    let nf = T::from_usize(n).unwrap_or(T::one());
    let row = |((xr, yr), r): ((&[T], &mut [T]), &mut T)| {
        let ms = xr.iter().fold(T::zero(), |a, &v| a + v * v) / nf;
        let rs = T::one() / (ms + eps).sqrt();
        *r = rs;
        for (j, (o, &v)) in yr.iter_mut().zip(xr).enumerate() {
            *o = match w {
                Some(w) => v * rs * w[j],
                None => v * rs,
            };
        }
    };
    if should_parallelize(x.len()) {
        x.par_chunks(n).zip(y.par_chunks_mut(n)).zip(rstd.par_iter_mut()).for_each(row);
    } else {
        x.chunks(n).zip(y.chunks_mut(n)).zip(rstd.iter_mut()).for_each(row);
    }
}

/// RMS norm backward. Writes `dx`; adds into `dw` when given.
pub fn rms_norm_backward<T: Float>(x: &[T], n: usize, w: Option<&[T]>, rstd: &[T], dy: &[T], dx: &mut [T], mut dw: Option<&mut [T]>) {
    assert_eq!(x.len(), dy.len());
    assert_eq!(x.len(), dx.len());
    if n == 0 {
        return;
    }
    let nf = T::from_usize(n).unwrap_or(T::one());
    if let Some(dw) = dw.as_deref_mut() {
        for (i, (xr, gr)) in x.chunks(n).zip(dy.chunks(n)).enumerate() {
            for j in 0..n {
                dw[j] = dw[j] + gr[j] * xr[j] * rstd[i];
            }
        }
    }
    let row = |(i, (dxr, (xr, gr))): (usize, (&mut [T], (&[T], &[T])))| {
        let rs = rstd[i];
        // g = dy ⊙ w; dx = rs · g − x · rs³ · mean(g ⊙ x)
        let mut dot = T::zero();
        for j in 0..n {
            let g = match w {
                Some(w) => gr[j] * w[j],
                None => gr[j],
            };
            dot = dot + g * xr[j];
        }
        let c = rs * rs * rs * dot / nf;
        for j in 0..n {
            let g = match w {
                Some(w) => gr[j] * w[j],
                None => gr[j],
            };
            dxr[j] = rs * g - xr[j] * c;
        }
    };
    if should_parallelize(x.len()) {
        dx.par_chunks_mut(n).zip(x.par_chunks(n).zip(dy.par_chunks(n))).enumerate().for_each(row);
    } else {
        dx.chunks_mut(n).zip(x.chunks(n).zip(dy.chunks(n))).enumerate().for_each(row);
    }
}
