//! Fused, numerically stable softmax and log-softmax over the rows of a contiguous matrix, with
//! their backward passes.

use crate::error::{check_eq, Result};
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

/// `dst = softmax(src)` along rows of `n_cols`; `dst` must have the length of `src`.
pub fn softmax_rows<T: Float>(src: &[T], n_cols: usize, dst: &mut [T]) -> Result<()> {
    check_eq("softmax_rows", "dst", dst, src.len())?;
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
    Ok(())
}

/// `dst = log_softmax(src)` along rows of `n_cols`; `dst` must have the length of `src`.
pub fn log_softmax_rows<T: Float>(src: &[T], n_cols: usize, dst: &mut [T]) -> Result<()> {
    check_eq("log_softmax_rows", "dst", dst, src.len())?;
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
    Ok(())
}

/// Softmax backward: `dx = y ⊙ (dy − Σ dy ⊙ y)` per row, with `y` the softmax output; the
/// three slices must have the same length.
pub fn softmax_backward_rows<T: Float>(y: &[T], dy: &[T], n_cols: usize, dx: &mut [T]) -> Result<()> {
    check_eq("softmax_backward_rows", "y", y, dx.len())?;
    check_eq("softmax_backward_rows", "dy", dy, dx.len())?;
    for_rows(n_cols, y, Some(dy), dx, |y, dy, d| {
        let dot = y.iter().zip(dy).fold(T::zero(), |a, (&p, &g)| a + p * g);
        for ((o, &p), &g) in d.iter_mut().zip(y).zip(dy) {
            *o = p * (g - dot);
        }
    });
    Ok(())
}

/// Log-softmax backward: `dx = dy − exp(y) · Σ dy` per row, with `y` the log-softmax output;
/// the three slices must have the same length.
pub fn log_softmax_backward_rows<T: Float>(y: &[T], dy: &[T], n_cols: usize, dx: &mut [T]) -> Result<()> {
    check_eq("log_softmax_backward_rows", "y", y, dx.len())?;
    check_eq("log_softmax_backward_rows", "dy", dy, dx.len())?;
    for_rows(n_cols, y, Some(dy), dx, |y, dy, d| {
        let s = sum(dy);
        for ((o, &l), &g) in d.iter_mut().zip(y).zip(dy) {
            *o = g - l.exp() * s;
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_rows_sum_to_one_and_survive_large_logits() {
        let x = [1000.0f32, 1001.0, 1002.0, -5.0, 0.0, 5.0];
        let mut y = [0.0f32; 6];
        softmax_rows(&x, 3, &mut y).unwrap();
        for r in y.chunks(3) {
            assert!((r.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        }
        let mut ly = [0.0f32; 6];
        log_softmax_rows(&x, 3, &mut ly).unwrap();
        for (a, b) in ly.iter().zip(&y) {
            assert!((a.exp() - b).abs() < 1e-6);
        }
    }

    #[test]
    fn wrong_lengths_are_typed_errors() {
        use crate::Error;
        let x = [1.0f32; 6];
        let mut short = [0.0f32; 5];
        let mismatch = |op, arg, expected, actual| Err(Error::LengthMismatch { op, arg, expected, actual });
        assert_eq!(softmax_rows(&x, 3, &mut short), mismatch("softmax_rows", "dst", 6, 5));
        assert_eq!(log_softmax_rows(&x, 3, &mut short), mismatch("log_softmax_rows", "dst", 6, 5));
        assert_eq!(softmax_backward_rows(&x, &x, 3, &mut short), mismatch("softmax_backward_rows", "y", 5, 6));
        assert_eq!(softmax_backward_rows(&x[..5], &x, 3, &mut short), mismatch("softmax_backward_rows", "dy", 5, 6));
        assert_eq!(log_softmax_backward_rows(&x, &x[..5], 3, &mut short), mismatch("log_softmax_backward_rows", "y", 5, 6));
        assert_eq!(log_softmax_backward_rows(&x[..5], &x[..4], 3, &mut short), mismatch("log_softmax_backward_rows", "dy", 5, 4));
    }
}
