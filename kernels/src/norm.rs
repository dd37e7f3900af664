//! Fused layer normalization and RMS normalization over the rows of a contiguous matrix,
//! forward and backward. The forward saves per-row statistics (mean and reciprocal standard
//! deviation) that the backward reuses.

use crate::error::{check_eq, Error, Result};
use crate::float::Float;
use crate::reduce::sum;
use crate::simd::dispatch;
use crate::threading::{chunk_len, should_parallelize};
use rayon::prelude::*;

/// Layer norm forward: `y = (x − mean) · rstd · w + b` per row of `n`; writes `mean` and `rstd`
/// (one per row). `w` and `b` are optional affine parameters of length `n`. Errors when a
/// length does not match: `y` as `x`, `mean` and `rstd` one per row.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_forward<T: Float>(x: &[T], n: usize, w: Option<&[T]>, b: Option<&[T]>, eps: T, y: &mut [T], mean: &mut [T], rstd: &mut [T]) -> Result<()> {
    const OP: &str = "layer_norm_forward";
    check_eq(OP, "y", y, x.len())?;
    let rows = check_rows(OP, x, n)?;
    check_eq(OP, "mean", mean, rows)?;
    check_eq(OP, "rstd", rstd, rows)?;
    check_param(OP, "w", w, n)?;
    check_param(OP, "b", b, n)?;
    if n == 0 {
        return Ok(());
    }
    if should_parallelize(x.len()) {
        let rows_per_chunk = (chunk_len(x.len()) / n).max(1);
        x.par_chunks(rows_per_chunk * n)
            .zip(y.par_chunks_mut(rows_per_chunk * n))
            .zip(mean.par_chunks_mut(rows_per_chunk).zip(rstd.par_chunks_mut(rows_per_chunk)))
            .for_each(|((x, y), (m, r))| layer_norm_rows(x, n, w, b, eps, y, m, r));
    } else {
        layer_norm_rows(x, n, w, b, eps, y, mean, rstd);
    }
    Ok(())
}

/// [`layer_norm_forward`] of whole rows (lengths checked by the caller).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn layer_norm_rows_body<T: Float>(x: &[T], n: usize, w: Option<&[T]>, b: Option<&[T]>, eps: T, y: &mut [T], mean: &mut [T], rstd: &mut [T]) {
    let nf = T::from_usize(n).unwrap_or(T::one());
    for (((xr, yr), m), r) in x.chunks_exact(n).zip(y.chunks_exact_mut(n)).zip(mean.iter_mut()).zip(rstd.iter_mut()) {
        let mu = sum(xr) / nf;
        let var = sum_sq_dev(xr, mu) / nf;
        let rs = T::one() / (var + eps).sqrt();
        *m = mu;
        *r = rs;
        // `((v − mu)·rs)·w + b`, each affine part only when present; one loop per case so each
        // vectorizes.
        match (w, b) {
            (Some(w), Some(b)) => yr.iter_mut().zip(xr).zip(w.iter().zip(b)).for_each(|((o, &v), (&w, &b))| *o = (v - mu) * rs * w + b),
            (Some(w), None) => yr.iter_mut().zip(xr).zip(w).for_each(|((o, &v), &w)| *o = (v - mu) * rs * w),
            (None, Some(b)) => yr.iter_mut().zip(xr).zip(b).for_each(|((o, &v), &b)| *o = (v - mu) * rs + b),
            (None, None) => yr.iter_mut().zip(xr).for_each(|(o, &v)| *o = (v - mu) * rs),
        }
    }
}

dispatch! {
    fn layer_norm_rows[T](x: &[T], n: usize, w: Option<&[T]>, b: Option<&[T]>, eps: T, y: &mut [T], mean: &mut [T], rstd: &mut [T]) = layer_norm_rows_body where [T: Float];
}

/// Checks that `x` is whole rows of `n` and returns how many (`x` must be empty when `n` is 0).
fn check_rows<T>(op: &'static str, x: &[T], n: usize) -> Result<usize> {
    if n == 0 {
        check_eq(op, "x", x, 0)?;
        return Ok(0);
    }
    if !x.len().is_multiple_of(n) {
        return Err(Error::InvalidArgument { op, arg: "x", reason: "is not a whole number of rows of n elements" });
    }
    Ok(x.len() / n)
}

/// Checks that an optional per-column parameter (or its gradient) has `n` elements.
fn check_param<T>(op: &'static str, arg: &'static str, p: Option<&[T]>, n: usize) -> Result<()> {
    match p {
        Some(p) => check_eq(op, arg, p, n),
        None => Ok(()),
    }
}

/// Layer norm backward. Writes `dx`; adds this call's contribution to `dw` and `db` when given.
/// Errors when a length does not match the forward's.
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
) -> Result<()> {
    const OP: &str = "layer_norm_backward";
    check_eq(OP, "dy", dy, x.len())?;
    check_eq(OP, "dx", dx, x.len())?;
    let rows = check_rows(OP, x, n)?;
    check_eq(OP, "mean", mean, rows)?;
    check_eq(OP, "rstd", rstd, rows)?;
    check_param(OP, "w", w, n)?;
    check_param(OP, "dw", dw.as_deref(), n)?;
    check_param(OP, "db", db.as_deref(), n)?;
    if n == 0 {
        return Ok(());
    }
    // Fixed chunks of rows: each computes its dx rows and its partial parameter gradients in one
    // pass; the partials are then added in chunk order, whatever the thread count.
    let (want_dw, want_db) = (dw.is_some(), db.is_some());
    let n_chunks = rows.div_ceil(GRAD_CHUNK_ROWS);
    let mut partials = vec![T::zero(); if want_dw || want_db { n_chunks * 2 * n } else { 0 }];
    let len = GRAD_CHUNK_ROWS * n;
    #[allow(clippy::type_complexity)]
    let chunk = |(c, (dx, (x, dy))): (usize, (&mut [T], (&[T], &[T]))), partial: &mut [T]| {
        let r = c * GRAD_CHUNK_ROWS..c * GRAD_CHUNK_ROWS + x.len() / n;
        layer_norm_backward_rows(x, n, w, &mean[r.clone()], &rstd[r], dy, dx, partial, want_dw, want_db);
    };
    let chunks = dx.par_chunks_mut(len).zip(x.par_chunks(len).zip(dy.par_chunks(len))).enumerate();
    match (want_dw || want_db, should_parallelize(x.len())) {
        (true, true) => chunks.zip(partials.par_chunks_mut(2 * n)).for_each(|(a, p)| chunk(a, p)),
        (false, true) => chunks.for_each(|a| chunk(a, &mut [])),
        (true, false) => dx.chunks_mut(len).zip(x.chunks(len).zip(dy.chunks(len))).enumerate().zip(partials.chunks_mut(2 * n)).for_each(|(a, p)| chunk(a, p)),
        (false, false) => dx.chunks_mut(len).zip(x.chunks(len).zip(dy.chunks(len))).enumerate().for_each(|a| chunk(a, &mut [])),
    }
    for part in partials.chunks_exact(2 * n) {
        let (pw, pb) = part.split_at(n);
        if let Some(dw) = dw.as_deref_mut() {
            dw.iter_mut().zip(pw).for_each(|(d, &p)| *d = *d + p);
        }
        if let Some(db) = db.as_deref_mut() {
            db.iter_mut().zip(pb).for_each(|(d, &p)| *d = *d + p);
        }
    }
    Ok(())
}

/// Rows per chunk of [`layer_norm_backward`] (the unit of its parameter-gradient partial sums).
const GRAD_CHUNK_ROWS: usize = 128;

/// [`layer_norm_backward`] of whole rows: `dx`, and, as asked, `partial[..n] = Σ_rows dy ⊙ x̂`
/// and `partial[n..] = Σ_rows dy` in row order (`partial` is zero on entry).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn layer_norm_backward_rows_body<T: Float>(x: &[T], n: usize, w: Option<&[T]>, mean: &[T], rstd: &[T], dy: &[T], dx: &mut [T], partial: &mut [T], want_dw: bool, want_db: bool) {
    if want_dw || want_db {
        let (pw, pb) = partial.split_at_mut(n);
        for (i, (xr, gr)) in x.chunks_exact(n).zip(dy.chunks_exact(n)).enumerate() {
            let (mu, rs) = (mean[i], rstd[i]);
            if want_dw {
                pw.iter_mut().zip(gr.iter().zip(xr)).for_each(|(d, (&g, &v))| *d = *d + g * (v - mu) * rs);
            }
            if want_db {
                pb.iter_mut().zip(gr).for_each(|(d, &g)| *d = *d + g);
            }
        }
    }
    layer_norm_dx_rows_body(x, n, w, mean, rstd, dy, dx);
}

dispatch! {
    fn layer_norm_backward_rows[T](x: &[T], n: usize, w: Option<&[T]>, mean: &[T], rstd: &[T], dy: &[T], dx: &mut [T], partial: &mut [T], want_dw: bool, want_db: bool) = layer_norm_backward_rows_body where [T: Float];
}

/// `dx` of whole rows: with `g = dy ⊙ w`, `dx = rstd · (g − mean(g) − x̂ · mean(g ⊙ x̂))`.
#[inline(always)]
fn layer_norm_dx_rows_body<T: Float>(x: &[T], n: usize, w: Option<&[T]>, mean: &[T], rstd: &[T], dy: &[T], dx: &mut [T]) {
    let nf = T::from_usize(n).unwrap_or(T::one());
    for (i, (dxr, (xr, gr))) in dx.chunks_exact_mut(n).zip(x.chunks_exact(n).zip(dy.chunks_exact(n))).enumerate() {
        let (mu, rs) = (mean[i], rstd[i]);
        let (sum_g, sum_gx) = sums_g_gxhat(gr, w, xr, mu, rs);
        let (mg, mgx) = (sum_g / nf, sum_gx / nf);
        match w {
            Some(w) => dxr.iter_mut().zip(xr.iter().zip(gr)).zip(w).for_each(|((o, (&v, &g)), &w)| *o = rs * (g * w - mg - (v - mu) * rs * mgx)),
            None => dxr.iter_mut().zip(xr.iter().zip(gr)).for_each(|(o, (&v, &g))| *o = rs * (g - mg - (v - mu) * rs * mgx)),
        }
    }
}


/// RMS norm forward: `y = x · rstd · w`, `rstd = 1/sqrt(mean(x²) + eps)` per row; writes `rstd`.
/// Errors when a length does not match: `y` as `x`, `rstd` one per row, `w` of `n`.
pub fn rms_norm_forward<T: Float>(x: &[T], n: usize, w: Option<&[T]>, eps: T, y: &mut [T], rstd: &mut [T]) -> Result<()> {
    const OP: &str = "rms_norm_forward";
    check_eq(OP, "y", y, x.len())?;
    let rows = check_rows(OP, x, n)?;
    check_eq(OP, "rstd", rstd, rows)?;
    check_param(OP, "w", w, n)?;
    if n == 0 {
        return Ok(());
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
    Ok(())
}

/// RMS norm backward. Writes `dx`; adds into `dw` when given. Errors when a length does not
/// match the forward's.
pub fn rms_norm_backward<T: Float>(x: &[T], n: usize, w: Option<&[T]>, rstd: &[T], dy: &[T], dx: &mut [T], dw: Option<&mut [T]>) -> Result<()> {
    const OP: &str = "rms_norm_backward";
    check_eq(OP, "dy", dy, x.len())?;
    check_eq(OP, "dx", dx, x.len())?;
    let rows = check_rows(OP, x, n)?;
    check_eq(OP, "rstd", rstd, rows)?;
    check_param(OP, "w", w, n)?;
    check_param(OP, "dw", dw.as_deref(), n)?;
    if n == 0 {
        return Ok(());
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
    Ok(())
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
    match w {
        Some(w) => {
            for ((gc, xc), wc) in dy.chunks_exact(8).zip(x.chunks_exact(8)).zip(w.chunks_exact(8)) {
                for l in 0..8 {
                    let (g, xh) = (gc[l] * wc[l], (xc[l] - mu) * rs);
                    sg[l] = sg[l] + g;
                    sgx[l] = sgx[l] + g * xh;
                }
            }
        }
        None => {
            for (gc, xc) in dy.chunks_exact(8).zip(x.chunks_exact(8)) {
                for l in 0..8 {
                    let (g, xh) = (gc[l], (xc[l] - mu) * rs);
                    sg[l] = sg[l] + g;
                    sgx[l] = sgx[l] + g * xh;
                }
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
                layer_norm_forward(&x, n, weight, None, 1e-5, &mut y, &mut mean, &mut rstd).unwrap();
                let mut dx = vec![0f32; rows * n];
                layer_norm_backward(&x, n, weight, &mean, &rstd, &dy, &mut dx, None, None).unwrap();
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

    #[test]
    fn layer_norm_parameter_gradients_sum_every_row() {
        // Goal: dw and db, summed in chunks of rows and added onto what was there, equal
        // Σ dy·x̂ and Σ dy over every row (row counts below and across the chunk size).
        let n = 24;
        for rows in [1usize, 127, 300] {
            let x: Vec<f64> = (0..rows * n).map(|i| ((i * 37 % 101) as f64 - 50.0) / 17.0).collect();
            let dy: Vec<f64> = (0..rows * n).map(|i| ((i * 53 % 97) as f64 - 48.0) / 23.0).collect();
            let (mut y, mut mean, mut rstd) = (vec![0.0; rows * n], vec![0.0; rows], vec![0.0; rows]);
            layer_norm_forward(&x, n, None, None, 1e-5, &mut y, &mut mean, &mut rstd).unwrap();
            let (mut dx, mut dw, mut db) = (vec![0.0; rows * n], vec![1.0; n], vec![2.0; n]);
            layer_norm_backward(&x, n, None, &mean, &rstd, &dy, &mut dx, Some(&mut dw), Some(&mut db)).unwrap();
            for j in 0..n {
                let want_w: f64 = 1.0 + (0..rows).map(|r| dy[r * n + j] * (x[r * n + j] - mean[r]) * rstd[r]).sum::<f64>();
                let want_b: f64 = 2.0 + (0..rows).map(|r| dy[r * n + j]).sum::<f64>();
                assert!((dw[j] - want_w).abs() < 1e-9 && (db[j] - want_b).abs() < 1e-9, "rows {rows} col {j}");
            }
        }
    }

    #[test]
    fn wrong_lengths_are_typed_errors() {
        let x = [1.0f32; 6];
        let (n, w, b) = (3, [1.0f32; 3], [0.0f32; 3]);
        let (mut y, mut mean, mut rstd, mut dx, mut dw, mut db) = ([0f32; 6], [0f32; 2], [0f32; 2], [0f32; 6], [0f32; 3], [0f32; 3]);
        let mismatch = |op, arg, expected, actual| Err(Error::LengthMismatch { op, arg, expected, actual });
        let op = "layer_norm_forward";
        assert_eq!(layer_norm_forward(&x, n, Some(&w), Some(&b), 1e-5, &mut y[..5], &mut mean, &mut rstd), mismatch(op, "y", 6, 5));
        assert_eq!(layer_norm_forward(&x, n, Some(&w), Some(&b), 1e-5, &mut y, &mut mean[..1], &mut rstd), mismatch(op, "mean", 2, 1));
        assert_eq!(layer_norm_forward(&x, n, Some(&w), Some(&b), 1e-5, &mut y, &mut mean, &mut [0f32; 3]), mismatch(op, "rstd", 2, 3));
        assert_eq!(layer_norm_forward(&x, n, Some(&w[..2]), Some(&b), 1e-5, &mut y, &mut mean, &mut rstd), mismatch(op, "w", 3, 2));
        assert_eq!(layer_norm_forward(&x, n, Some(&w), Some(&b[..1]), 1e-5, &mut y, &mut mean, &mut rstd), mismatch(op, "b", 3, 1));
        assert!(matches!(layer_norm_forward(&x, 4, None, None, 1e-5, &mut y, &mut mean, &mut rstd), Err(Error::InvalidArgument { arg: "x", .. })));
        assert_eq!(layer_norm_forward(&x, 0, None, None, 1e-5, &mut y, &mut [], &mut []), mismatch(op, "x", 0, 6));
        layer_norm_forward(&x, n, Some(&w), Some(&b), 1e-5, &mut y, &mut mean, &mut rstd).unwrap();
        let op = "layer_norm_backward";
        assert_eq!(layer_norm_backward(&x, n, Some(&w), &mean, &rstd, &x[..3], &mut dx, None, None), mismatch(op, "dy", 6, 3));
        assert_eq!(layer_norm_backward(&x, n, Some(&w), &mean, &rstd, &x, &mut dx[..4], None, None), mismatch(op, "dx", 6, 4));
        assert_eq!(layer_norm_backward(&x, n, Some(&w), &mean[..1], &rstd, &x, &mut dx, None, None), mismatch(op, "mean", 2, 1));
        assert_eq!(layer_norm_backward(&x, n, Some(&w), &mean, &[], &x, &mut dx, None, None), mismatch(op, "rstd", 2, 0));
        assert_eq!(layer_norm_backward(&x, n, Some(&x), &mean, &rstd, &x, &mut dx, None, None), mismatch(op, "w", 3, 6));
        assert_eq!(layer_norm_backward(&x, n, Some(&w), &mean, &rstd, &x, &mut dx, Some(&mut dw[..2]), None), mismatch(op, "dw", 3, 2));
        assert_eq!(layer_norm_backward(&x, n, Some(&w), &mean, &rstd, &x, &mut dx, Some(&mut dw), Some(&mut db[..1])), mismatch(op, "db", 3, 1));
        let op = "rms_norm_forward";
        assert_eq!(rms_norm_forward(&x, n, Some(&w), 1e-5, &mut y[..1], &mut rstd), mismatch(op, "y", 6, 1));
        assert_eq!(rms_norm_forward(&x, n, Some(&w), 1e-5, &mut y, &mut rstd[..1]), mismatch(op, "rstd", 2, 1));
        assert_eq!(rms_norm_forward(&x, n, Some(&w[..1]), 1e-5, &mut y, &mut rstd), mismatch(op, "w", 3, 1));
        let op = "rms_norm_backward";
        assert_eq!(rms_norm_backward(&x, n, Some(&w), &rstd, &x[..5], &mut dx, None), mismatch(op, "dy", 6, 5));
        assert_eq!(rms_norm_backward(&x, n, Some(&w), &rstd, &x, &mut dx[..5], None), mismatch(op, "dx", 6, 5));
        assert_eq!(rms_norm_backward(&x, n, Some(&w), &rstd[..1], &x, &mut dx, None), mismatch(op, "rstd", 2, 1));
        assert_eq!(rms_norm_backward(&x, n, Some(&w[..2]), &rstd, &x, &mut dx, None), mismatch(op, "w", 3, 2));
        assert_eq!(rms_norm_backward(&x, n, None, &rstd, &x, &mut dx, Some(&mut dw[..1])), mismatch(op, "dw", 3, 1));
        assert_eq!(rms_norm_backward(&x, n, None, &rstd, &x, &mut dx, Some(&mut dw)), Ok(()));
    }
}
