//! Fused, numerically stable softmax and log-softmax over the rows of a contiguous matrix, with
//! their backward passes.

use crate::float::Float;
use crate::reduce::sum;
use crate::threading::should_parallelize;
use rayon::prelude::*;

fn for_rows<T: Float>(n_cols: usize, a: &[T], b: Option<&[T]>, dst: &mut [T], f: impl Fn(&[T], &[T], &mut [T]) + Sync + Send) {
    if n_cols == 0 {
        return;
    }
    let empty: &[T] = &[];
    if should_parallelize(dst.len()) && dst.len() / n_cols > 1 {
        match b {
            Some(b) => dst
                .par_chunks_mut(n_cols)
                .zip(a.par_chunks(n_cols))
                .zip(b.par_chunks(n_cols))
                .for_each(|((d, x), y)| f(x, y, d)),
            None => dst.par_chunks_mut(n_cols).zip(a.par_chunks(n_cols)).for_each(|(d, x)| f(x, empty, d)),
        }
    } else {
        match b {
            Some(b) => dst.chunks_mut(n_cols).zip(a.chunks(n_cols)).zip(b.chunks(n_cols)).for_each(|((d, x), y)| f(x, y, d)),
            None => dst.chunks_mut(n_cols).zip(a.chunks(n_cols)).for_each(|(d, x)| f(x, empty, d)),
        }
    }
}

fn row_max<T: Float>(x: &[T]) -> T {
    x.iter().fold(T::neg_infinity(), |m, &v| if v > m { v } else { m })
}

/// `dst = softmax(src)` along rows of `n_cols`.
pub fn softmax_rows<T: Float>(src: &[T], n_cols: usize, dst: &mut [T]) {
    assert_eq!(src.len(), dst.len(), "softmax_rows length mismatch");
    for_rows(n_cols, src, None, dst, |x, _, d| {
        let m = row_max(x);
        let m = if m.is_finite() { m } else { T::zero() };
        for (o, &v) in d.iter_mut().zip(x) {
            *o = (v - m).exp();
        }
        let s = sum(d);
        let inv = T::one() / s;
        for o in d.iter_mut() {
            *o = *o * inv;
        }
    });
}

/// `dst = log_softmax(src)` along rows of `n_cols`.
pub fn log_softmax_rows<T: Float>(src: &[T], n_cols: usize, dst: &mut [T]) {
    assert_eq!(src.len(), dst.len(), "log_softmax_rows length mismatch");
    for_rows(n_cols, src, None, dst, |x, _, d| {
        let m = row_max(x);
        let m = if m.is_finite() { m } else { T::zero() };
        for (o, &v) in d.iter_mut().zip(x) {
            *o = (v - m).exp();
        }
        let log_sum = sum(d).ln();
        for (o, &v) in d.iter_mut().zip(x) {
            *o = (v - m) - log_sum;
        }
    });
}

/// Softmax backward: `dx = y ⊙ (dy − Σ dy ⊙ y)` per row, with `y` the softmax output.
pub fn softmax_backward_rows<T: Float>(y: &[T], dy: &[T], n_cols: usize, dx: &mut [T]) {
    assert_eq!(y.len(), dx.len());
    assert_eq!(dy.len(), dx.len());
    for_rows(n_cols, y, Some(dy), dx, |y, dy, d| {
        let dot = y.iter().zip(dy).fold(T::zero(), |a, (&p, &g)| a + p * g);
        for ((o, &p), &g) in d.iter_mut().zip(y).zip(dy) {
            *o = p * (g - dot);
        }
    });
}

/// Log-softmax backward: `dx = dy − exp(y) · Σ dy` per row, with `y` the log-softmax output.
pub fn log_softmax_backward_rows<T: Float>(y: &[T], dy: &[T], n_cols: usize, dx: &mut [T]) {
    assert_eq!(y.len(), dx.len());
    assert_eq!(dy.len(), dx.len());
    for_rows(n_cols, y, Some(dy), dx, |y, dy, d| {
        let s = sum(dy);
        for ((o, &l), &g) in d.iter_mut().zip(y).zip(dy) {
            *o = g - l.exp() * s;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_rows_sum_to_one_and_survive_large_logits() {
        let x = [1000.0f32, 1001.0, 1002.0, -5.0, 0.0, 5.0];
        let mut y = [0.0f32; 6];
        softmax_rows(&x, 3, &mut y);
        for r in y.chunks(3) {
            assert!((r.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        }
        let mut ly = [0.0f32; 6];
        log_softmax_rows(&x, 3, &mut ly);
        for (a, b) in ly.iter().zip(&y) {
            assert!((a.exp() - b).abs() < 1e-6);
        }
    }
}
