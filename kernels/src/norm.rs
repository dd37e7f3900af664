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
    #[allow(clippy::type_complexity)]
    let row = |(((xr, yr), m), r): (((&[T], &mut [T]), &mut T), &mut T)| {
        let mu = sum(xr) / nf;
        let var = sum_sq_dev(xr, mu) / nf;
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
    #[allow(clippy::type_complexity)]
    let row = |(i, (dxr, (xr, gr))): (usize, (&mut [T], (&[T], &[T])))| {
        let (mu, rs) = (mean[i], rstd[i]);
        // g = dy ⊙ w; dx = rstd · (g − mean(g) − xhat · mean(g ⊙ xhat))
        let (sum_g, sum_gx) = sums_g_gxhat(gr, w, xr, mu, rs);
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
        let ms = sum_sq_dev(xr, T::zero()) / nf;
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
pub fn rms_norm_backward<T: Float>(x: &[T], n: usize, w: Option<&[T]>, rstd: &[T], dy: &[T], dx: &mut [T], dw: Option<&mut [T]>) {
    assert_eq!(x.len(), dy.len());
    assert_eq!(x.len(), dx.len());
    if n == 0 {
        return;
    }
    let nf = T::from_usize(n).unwrap_or(T::one());
    if let Some(dw) = dw {
        for (i, (xr, gr)) in x.chunks(n).zip(dy.chunks(n)).enumerate() {
            for j in 0..n {
                dw[j] = dw[j] + gr[j] * xr[j] * rstd[i];
            }
        }
    }
    #[allow(clippy::type_complexity)]
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

/// Σ (x − mu)² in eight fixed lanes: deterministic, and the loop vectorizes (a single running
/// sum would be one long dependency chain).
#[inline(always)]
fn sum_sq_dev<T: Float>(xs: &[T], mu: T) -> T {
    let mut lanes = [T::zero(); 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            let d = c[l] - mu;
            lanes[l] = lanes[l] + d * d;
        }
    }
    let mut s = fold_lanes(lanes);
    for &x in rest {
        s = s + (x - mu) * (x - mu);
    }
    s
}

/// `(Σ g, Σ g·x̂)` over a row with `g = dy ⊙ w` and `x̂ = (x − mu)·rs`, in eight fixed lanes.
#[inline(always)]
fn sums_g_gxhat<T: Float>(dy: &[T], w: Option<&[T]>, x: &[T], mu: T, rs: T) -> (T, T) {
    debug_assert_eq!(dy.len(), x.len());
    let (mut sg, mut sgx) = ([T::zero(); 8], [T::zero(); 8]);
    let n_full = dy.len() / 8 * 8;
    let mut add = |gc: &[T], xc: &[T], wc: Option<&[T]>| {
        for l in 0..8 {
            let g = match wc {
                Some(wc) => gc[l] * wc[l],
                None => gc[l],
            };
            let xh = (xc[l] - mu) * rs;
            sg[l] = sg[l] + g;
            sgx[l] = sgx[l] + g * xh;
        }
    };
    match w {
        Some(w) => {
            for ((gc, xc), wc) in dy.chunks_exact(8).zip(x.chunks_exact(8)).zip(w.chunks_exact(8)) {
                add(gc, xc, Some(wc));
            }
        }
        None => {
            for (gc, xc) in dy.chunks_exact(8).zip(x.chunks_exact(8)) {
                add(gc, xc, None);
            }
        }
    }
    let (mut a, mut b) = (fold_lanes(sg), fold_lanes(sgx));
    for j in n_full..dy.len() {
        let g = match w {
            Some(w) => dy[j] * w[j],
            None => dy[j],
        };
        let xh = (x[j] - mu) * rs;
        a = a + g;
        b = b + g * xh;
    }
    (a, b)
}

#[inline(always)]
fn fold_lanes<T: Float>(l: [T; 8]) -> T {
    ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Layer norm forward and backward of one row in f64, written out plainly.
    fn reference(x: &[f64], w: &[f64], dy: &[f64], eps: f64) -> (Vec<f64>, Vec<f64>) {
        let n = x.len() as f64;
        let mu = x.iter().sum::<f64>() / n;
        let var = x.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / n;
        let rs = 1.0 / (var + eps).sqrt();
        let xh: Vec<f64> = x.iter().map(|v| (v - mu) * rs).collect();
        let y = xh.iter().zip(w).map(|(h, w)| h * w).collect();
        let g: Vec<f64> = dy.iter().zip(w).map(|(d, w)| d * w).collect();
        let (mg, mgx) = (g.iter().sum::<f64>() / n, g.iter().zip(&xh).map(|(g, h)| g * h).sum::<f64>() / n);
        let dx = g.iter().zip(&xh).map(|(g, h)| rs * (g - mg - h * mgx)).collect();
        (y, dx)
    }

    #[test]
    fn layer_norm_matches_a_plain_f64_reference() {
        // Goal: the eight-lane sums agree with a straightforward computation, for widths that
        // are and are not multiples of the lane count, with and without a weight.
        for n in [5usize, 8, 37, 256] {
            let rows = 3;
            let x: Vec<f32> = (0..rows * n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
            let dy: Vec<f32> = (0..rows * n).map(|i| ((i * 53 % 97) as f32 - 48.0) / 23.0).collect();
            let w: Vec<f32> = (0..n).map(|j| 0.5 + (j % 7) as f32 / 7.0).collect();
            for weight in [Some(w.as_slice()), None] {
                let (mut y, mut mean, mut rstd) = (vec![0f32; rows * n], vec![0f32; rows], vec![0f32; rows]);
                layer_norm_forward(&x, n, weight, None, 1e-5, &mut y, &mut mean, &mut rstd);
                let mut dx = vec![0f32; rows * n];
                layer_norm_backward(&x, n, weight, &mean, &rstd, &dy, &mut dx, None, None);
                for r in 0..rows {
                    let row = |v: &[f32]| v[r * n..(r + 1) * n].iter().map(|&a| f64::from(a)).collect::<Vec<f64>>();
                    let w64 = weight.map_or(vec![1.0; n], |w| w.iter().map(|&a| f64::from(a)).collect());
                    let (y_ref, dx_ref) = reference(&row(&x), &w64, &row(&dy), 1e-5);
                    for j in 0..n {
                        assert!((f64::from(y[r * n + j]) - y_ref[j]).abs() < 1e-5, "y n={n} row {r} col {j}");
                        assert!((f64::from(dx[r * n + j]) - dx_ref[j]).abs() < 1e-4, "dx n={n} row {r} col {j}");
                    }
                }
            }
        }
    }
}
