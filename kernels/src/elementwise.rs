//! Elementwise kernels: maps over one or two contiguous slices, and a strided binary map used
//! for broadcasting.
//!
//! The closures are generic and inlined, so each op becomes a plain loop the compiler
//! vectorizes; large inputs are split across the shared pool in fixed chunks (the split never
//! changes results, since every element is computed independently).
//!
//! Lengths are checked up front: a slice of the wrong length is a typed [`Error`], never a panic.

use crate::error::{check_eq, product, Error, Result};
use crate::simd::dispatch;
use crate::threading::{chunk_len, should_parallelize};
use rayon::prelude::*;

/// `dst[i] = f(src[i])`; `src` and `dst` must have the same length.
pub fn map<A: Copy + Send + Sync, B: Copy + Send + Sync>(src: &[A], dst: &mut [B], f: impl Fn(A) -> B + Sync + Send) -> Result<()> {
    check_eq("map", "dst", dst, src.len())?;
    map_zipped(src, dst, f);
    Ok(())
}

/// [`map`] over the common prefix of `src` and `dst` (callers that made them equal).
pub(crate) fn map_zipped<A: Copy + Send + Sync, B: Copy + Send + Sync>(src: &[A], dst: &mut [B], f: impl Fn(A) -> B + Sync + Send) {
    if should_parallelize(src.len()) {
        let c = chunk_len(src.len());
        src.par_chunks(c).zip(dst.par_chunks_mut(c)).for_each(|(s, d)| map_run(s, d, &f));
    } else {
        map_run(src, dst, &f);
    }
}

#[inline(always)]
fn map_body<A: Copy, B: Copy, F: Fn(A) -> B>(s: &[A], d: &mut [B], f: &F) {
    for (o, i) in d.iter_mut().zip(s) {
        *o = f(*i);
    }
}

dispatch! {
    fn map_run[A, B, F](s: &[A], d: &mut [B], f: &F) = map_body where [A: Copy, B: Copy, F: Fn(A) -> B];
}

/// `dst[i] = f(dst[i])` in place.
pub fn map_inplace<T: Copy + Send + Sync>(dst: &mut [T], f: impl Fn(T) -> T + Sync + Send) {
    if should_parallelize(dst.len()) {
        let c = chunk_len(dst.len());
        dst.par_chunks_mut(c).for_each(|d| map_inplace_run(d, &f));
    } else {
        map_inplace_run(dst, &f);
    }
}

#[inline(always)]
fn map_inplace_body<T: Copy, F: Fn(T) -> T>(d: &mut [T], f: &F) {
    for o in d.iter_mut() {
        *o = f(*o);
    }
}

dispatch! {
    fn map_inplace_run[T, F](d: &mut [T], f: &F) = map_inplace_body where [T: Copy, F: Fn(T) -> T];
}

/// `dst[i] = f(a[i], b[i])`; the three slices must have the same length.
pub fn zip_map<T: Copy + Send + Sync, U: Copy + Send + Sync>(a: &[T], b: &[T], dst: &mut [U], f: impl Fn(T, T) -> U + Sync + Send) -> Result<()> {
    check_eq("zip_map", "a", a, dst.len())?;
    check_eq("zip_map", "b", b, dst.len())?;
    if should_parallelize(dst.len()) {
        let c = chunk_len(dst.len());
        a.par_chunks(c).zip(b.par_chunks(c)).zip(dst.par_chunks_mut(c)).for_each(|((a, b), d)| zip_run(a, b, d, &f));
    } else {
        zip_run(a, b, dst, &f);
    }
    Ok(())
}

#[inline(always)]
fn zip_body<T: Copy, U: Copy, F: Fn(T, T) -> U>(a: &[T], b: &[T], d: &mut [U], f: &F) {
    for ((o, x), y) in d.iter_mut().zip(a).zip(b) {
        *o = f(*x, *y);
    }
}

dispatch! {
    fn zip_run[T, U, F](a: &[T], b: &[T], d: &mut [U], f: &F) = zip_body where [T: Copy, U: Copy, F: Fn(T, T) -> U];
}

/// `dst[i] = f(a[i], b[i], c[i])`; the four slices must have the same length (a backward
/// `g ⊙ f'(x, y)` in one pass).
pub fn zip3_map<T: Copy + Send + Sync>(a: &[T], b: &[T], c: &[T], dst: &mut [T], f: impl Fn(T, T, T) -> T + Sync + Send) -> Result<()> {
    check_eq("zip3_map", "a", a, dst.len())?;
    check_eq("zip3_map", "b", b, dst.len())?;
    check_eq("zip3_map", "c", c, dst.len())?;
    if should_parallelize(dst.len()) {
        let n = chunk_len(dst.len());
        dst.par_chunks_mut(n).zip(a.par_chunks(n)).zip(b.par_chunks(n)).zip(c.par_chunks(n)).for_each(|(((d, a), b), c)| zip3_run(a, b, c, d, &f));
    } else {
        zip3_run(a, b, c, dst, &f);
    }
    Ok(())
}

#[inline(always)]
fn zip3_body<T: Copy, F: Fn(T, T, T) -> T>(a: &[T], b: &[T], c: &[T], d: &mut [T], f: &F) {
    for (((o, x), y), z) in d.iter_mut().zip(a).zip(b).zip(c) {
        *o = f(*x, *y, *z);
    }
}

dispatch! {
    fn zip3_run[T, F](a: &[T], b: &[T], c: &[T], d: &mut [T], f: &F) = zip3_body where [T: Copy, F: Fn(T, T, T) -> T];
}

/// `dst[i] = f(dst[i], src[i])` in place; `src` must have the length of `dst`.
pub fn zip_map_inplace<T: Copy + Send + Sync>(dst: &mut [T], src: &[T], f: impl Fn(T, T) -> T + Sync + Send) -> Result<()> {
    check_eq("zip_map_inplace", "src", src, dst.len())?;
    if should_parallelize(dst.len()) {
        let c = chunk_len(dst.len());
        dst.par_chunks_mut(c).zip(src.par_chunks(c)).for_each(|(d, s)| zip_inplace_run(d, s, &f));
    } else {
        zip_inplace_run(dst, src, &f);
    }
    Ok(())
}

#[inline(always)]
fn zip_inplace_body<T: Copy, F: Fn(T, T) -> T>(d: &mut [T], s: &[T], f: &F) {
    for (o, x) in d.iter_mut().zip(s) {
        *o = f(*o, *x);
    }
}

dispatch! {
    fn zip_inplace_run[T, F](d: &mut [T], s: &[T], f: &F) = zip_inplace_body where [T: Copy, F: Fn(T, T) -> T];
}

/// Strided binary map over an output of `shape` (row-major, contiguous), reading
/// `a[a_offset + Σ idx·a_strides]` and `b[...]` likewise; a stride of 0 broadcasts.
///
/// The innermost dimension is a tight loop specialised for the common stride patterns
/// (1/1, 1/0, 0/1) so bias adds and row scalings vectorize.
///
/// Errors: a stride list whose length is not the rank, a `dst` that is not `shape`'s size, or an
/// operand whose furthest element (`offset + Σ (shape[d] − 1)·strides[d]`) lies past its slice.
#[allow(clippy::too_many_arguments)]
pub fn broadcast_zip_map<T: Copy + Send + Sync, U: Copy + Send + Sync + Default>(
    shape: &[usize],
    a: &[T],
    a_offset: usize,
    a_strides: &[usize],
    b: &[T],
    b_offset: usize,
    b_strides: &[usize],
    dst: &mut [U],
    f: impl Fn(T, T) -> U + Sync + Send,
) -> Result<()> {
    const OP: &str = "broadcast_zip_map";
    let rank = shape.len();
    check_eq(OP, "a_strides", a_strides, rank)?;
    check_eq(OP, "b_strides", b_strides, rank)?;
    let total = product(shape);
    check_eq(OP, "dst", dst, total)?;
    if total == 0 {
        return Ok(());
    }
    check_reach(OP, "a", a.len(), shape, a_offset, a_strides)?;
    check_reach(OP, "b", b.len(), shape, b_offset, b_strides)?;
    if rank == 0 {
        dst[0] = f(a[a_offset], b[b_offset]);
        return Ok(());
    }
    let geometry = Geometry { inner: shape[rank - 1], outer_shape: &shape[..rank - 1], a_offset, a_strides, b_offset, b_strides };
    let inner = geometry.inner;
    if should_parallelize(total) && inner > 0 {
        let rows_per_chunk = (chunk_len(total) / inner).max(1);
        dst.par_chunks_mut(rows_per_chunk * inner).enumerate().for_each(|(ci, chunk)| broadcast_rows(&geometry, ci * rows_per_chunk, chunk, a, b, &f));
    } else if inner > 0 {
        broadcast_rows(&geometry, 0, dst, a, b, &f);
    }
    Ok(())
}

/// The layout of a [`broadcast_zip_map`]: rows of `inner` elements over `outer_shape`.
struct Geometry<'a> {
    inner: usize,
    outer_shape: &'a [usize],
    a_offset: usize,
    a_strides: &'a [usize],
    b_offset: usize,
    b_strides: &'a [usize],
}

/// Output rows `first_row..` of a [`broadcast_zip_map`] into `out` (whole rows). The innermost
/// dimension is a tight loop specialised for the stride patterns 1/1, 1/0 and 0/1.
#[inline(always)]
fn broadcast_rows_body<T: Copy, U: Copy, F: Fn(T, T) -> U>(g: &Geometry<'_>, first_row: usize, out: &mut [U], a: &[T], b: &[T], f: &F) {
    let (inner, rank) = (g.inner, g.a_strides.len());
    let (sa, sb) = (g.a_strides[rank - 1], g.b_strides[rank - 1]);
    for (ri, out) in out.chunks_mut(inner).enumerate() {
        // Decompose the row index into outer coordinates.
        let mut rem = first_row + ri;
        let (mut oa, mut ob) = (g.a_offset, g.b_offset);
        for d in (0..rank - 1).rev() {
            let c = rem % g.outer_shape[d];
            rem /= g.outer_shape[d];
            oa += c * g.a_strides[d];
            ob += c * g.b_strides[d];
        }
        match (sa, sb) {
            (1, 1) => {
                for ((o, x), y) in out.iter_mut().zip(&a[oa..oa + inner]).zip(&b[ob..ob + inner]) {
                    *o = f(*x, *y);
                }
            }
            (1, 0) => {
                let y = b[ob];
                for (o, x) in out.iter_mut().zip(&a[oa..oa + inner]) {
                    *o = f(*x, y);
                }
            }
            (0, 1) => {
                let x = a[oa];
                for (o, y) in out.iter_mut().zip(&b[ob..ob + inner]) {
                    *o = f(x, *y);
                }
            }
            _ => {
                for (j, o) in out.iter_mut().enumerate() {
                    *o = f(a[oa + j * sa], b[ob + j * sb]);
                }
            }
        }
    }
}

dispatch! {
    fn broadcast_rows[T, U, F](g: &Geometry<'_>, first_row: usize, out: &mut [U], a: &[T], b: &[T], f: &F) = broadcast_rows_body where [T: Copy, U: Copy, F: Fn(T, T) -> U];
}

/// Checks that the furthest element a strided view of the non-empty `shape` reads,
/// `offset + Σ (shape[d] − 1)·strides[d]`, lies inside a slice of `len` (saturating, so huge
/// strides are refused instead of overflowing). `strides` has `shape`'s rank.
fn check_reach(op: &'static str, arg: &'static str, len: usize, shape: &[usize], offset: usize, strides: &[usize]) -> Result<()> {
    let last = shape.iter().zip(strides).fold(offset, |acc, (&n, &s)| acc.saturating_add(n.saturating_sub(1).saturating_mul(s)));
    if last >= len {
        return Err(Error::BufferTooSmall { op, buffer: arg, needed: last.saturating_add(1), actual: len });
    }
    Ok(())
}

/// Gathers a strided view into a contiguous buffer: `dst[i] = src[offset + Σ idx·strides]`.
/// Errors as [`broadcast_zip_map`] does.
pub fn strided_copy<T: Copy + Send + Sync + Default>(shape: &[usize], src: &[T], offset: usize, strides: &[usize], dst: &mut [T]) -> Result<()> {
    let zero = [0usize; 8];
    let rank = shape.len();
    if strides.len() != rank {
        return Err(Error::LengthMismatch { op: "strided_copy", arg: "strides", expected: rank, actual: strides.len() });
    }
    if rank <= 8 {
        broadcast_zip_map(shape, src, offset, strides, src, 0, &zero[..rank], dst, |x, _| x)
    } else {
        let z = vec![0usize; rank];
        broadcast_zip_map(shape, src, offset, strides, src, 0, &z, dst, |x, _| x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcast_bias_add_and_transpose_copy() {
        // [2,3] + [3]
        let a = [1.0f32, 2., 3., 4., 5., 6.];
        let b = [10.0f32, 20., 30.];
        let mut out = [0.0f32; 6];
        broadcast_zip_map(&[2, 3], &a, 0, &[3, 1], &b, 0, &[0, 1], &mut out, |x, y| x + y).unwrap();
        assert_eq!(out, [11., 22., 33., 14., 25., 36.]);
        // transpose of a viewed as [3,2]
        let mut t = [0.0f32; 6];
        strided_copy(&[3, 2], &a, 0, &[1, 3], &mut t).unwrap();
        assert_eq!(t, [1., 4., 2., 5., 3., 6.]);
    }

    #[test]
    fn parallel_and_serial_paths_agree() {
        let n = 3 * crate::threading::PARALLEL_MIN_ELEMS + 17;
        let a: Vec<f32> = (0..n).map(|i| i as f32 * 0.25).collect();
        let mut par = vec![0.0f32; n];
        map(&a, &mut par, |x| x.sin()).unwrap();
        let serial: Vec<f32> = a.iter().map(|x| x.sin()).collect();
        assert_eq!(par, serial);
    }

    #[test]
    fn wrong_lengths_are_typed_errors() {
        let a = [1.0f32, 2., 3., 4., 5., 6.];
        let mut short = [0.0f32; 5];
        assert_eq!(map(&a, &mut short, |x| x), Err(Error::LengthMismatch { op: "map", arg: "dst", expected: 6, actual: 5 }));
        assert_eq!(zip_map(&a[..5], &a, &mut [0.0f32; 6], |x, y| x + y), Err(Error::LengthMismatch { op: "zip_map", arg: "a", expected: 6, actual: 5 }));
        assert_eq!(zip_map(&a, &a[..4], &mut [0.0f32; 6], |x, y| x + y), Err(Error::LengthMismatch { op: "zip_map", arg: "b", expected: 6, actual: 4 }));
        assert_eq!(zip_map_inplace(&mut short, &a, |x, y| x + y), Err(Error::LengthMismatch { op: "zip_map_inplace", arg: "src", expected: 5, actual: 6 }));
        let mut out = [0.0f32; 6];
        let op = "broadcast_zip_map";
        assert_eq!(broadcast_zip_map(&[2, 3], &a, 0, &[3], &a, 0, &[3, 1], &mut out, |x, y| x + y), Err(Error::LengthMismatch { op, arg: "a_strides", expected: 2, actual: 1 }));
        assert_eq!(broadcast_zip_map(&[2, 3], &a, 0, &[3, 1], &a, 0, &[3, 1, 0], &mut out, |x, y| x + y), Err(Error::LengthMismatch { op, arg: "b_strides", expected: 2, actual: 3 }));
        assert_eq!(broadcast_zip_map(&[2, 3], &a, 0, &[3, 1], &a, 0, &[3, 1], &mut short, |x, y| x + y), Err(Error::LengthMismatch { op, arg: "dst", expected: 6, actual: 5 }));
        // An offset or stride reaching past the operand: every code path (1/1, 1/0, 0/1, general).
        assert_eq!(broadcast_zip_map(&[2, 3], &a, 1, &[3, 1], &a, 0, &[3, 1], &mut out, |x, y| x + y), Err(Error::BufferTooSmall { op, buffer: "a", needed: 7, actual: 6 }));
        assert_eq!(broadcast_zip_map(&[2, 3], &a, 0, &[3, 1], &a, 0, &[4, 0], &mut out, |x, y| x + y), Ok(()));
        assert_eq!(broadcast_zip_map(&[2, 3], &a, 0, &[3, 1], &a, 2, &[4, 0], &mut out, |x, y| x + y), Err(Error::BufferTooSmall { op, buffer: "b", needed: 7, actual: 6 }));
        assert_eq!(broadcast_zip_map(&[2, 3], &a, 0, &[3, 1], &a, 3, &[0, 2], &mut out, |x, y| x + y), Err(Error::BufferTooSmall { op, buffer: "b", needed: 8, actual: 6 }));
        assert_eq!(broadcast_zip_map(&[2, 3], &a, 0, &[0, 1], &a, 0, &[usize::MAX, 1], &mut out, |x, y| x + y), Err(Error::BufferTooSmall { op, buffer: "b", needed: usize::MAX, actual: 6 }));
        assert_eq!(broadcast_zip_map(&[], &a, 6, &[], &a, 0, &[], &mut [0.0f32], |x, y| x + y), Err(Error::BufferTooSmall { op, buffer: "a", needed: 7, actual: 6 }));
        // Empty outputs read nothing, so any offset is fine.
        assert_eq!(broadcast_zip_map(&[2, 0], &a, 99, &[3, 1], &a, 99, &[3, 1], &mut [0.0f32; 0], |x, y| x + y), Ok(()));
        let mut t = [0.0f32; 6];
        assert_eq!(strided_copy(&[3, 2], &a, 0, &[1, 3, 1], &mut t), Err(Error::LengthMismatch { op: "strided_copy", arg: "strides", expected: 2, actual: 3 }));
        assert_eq!(strided_copy(&[3, 2], &a, 1, &[1, 3], &mut t), Err(Error::BufferTooSmall { op, buffer: "a", needed: 7, actual: 6 }));
        assert_eq!(strided_copy(&[3, 2], &a, 0, &[1, 3], &mut t[..4]), Err(Error::LengthMismatch { op, arg: "dst", expected: 6, actual: 4 }));
    }
}
