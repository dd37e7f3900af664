//! Element types the collectives move ([`WireElement`]) and reduce ([`Element`]), and the reduction
//! kernels.
//!
//! Reductions accumulate in [`Element::Acc`]: f32 for f32 and bf16, f64 for f64. Partial results
//! travel between ranks in the accumulator type and are rounded to the element type once, at the
//! end, so bf16 sums do not lose precision hop by hop. `combine` always takes its operands in a fixed
//! order (the lower block of ranks first), and max/min are written out so that NaN and signed zero
//! give the same bits whichever rank computes them.

use half::bf16;
use rtx_kernels::DType;

use crate::ReduceOp;

/// A plain element type that collectives can move as raw little-endian bytes.
pub trait WireElement: bytemuck::Pod + Send + Sync + std::fmt::Debug + sealed::Sealed + 'static {
    /// The dtype named in frame headers.
    const DTYPE: DType;
}

/// An element type that collectives can also reduce.
pub trait Element: WireElement {
    /// The type partial results are accumulated and sent in.
    type Acc: Accumulator;
    /// Widens to the accumulator type.
    fn to_acc(self) -> Self::Acc;
    /// Rounds from the accumulator type.
    fn from_acc(acc: Self::Acc) -> Self;
    /// The same slice seen as accumulator values, when the element type is its own accumulator.
    fn as_acc_mut(buf: &mut [Self]) -> Option<&mut [Self::Acc]>;
    /// The same slice seen as accumulator values, read-only; see [`as_acc_mut`](Self::as_acc_mut).
    fn as_acc(buf: &[Self]) -> Option<&[Self::Acc]>;
}

/// An accumulator type (f32 or f64): the arithmetic of reductions.
pub trait Accumulator: Element<Acc = Self> + Copy + PartialOrd {
    /// `a op b`, with `a` from the lower block of ranks.
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self;
    /// `self / n`, for averages.
    fn div_count(self, n: usize) -> Self;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for half::bf16 {}
    impl Sealed for u32 {}
}

impl WireElement for f32 {
    const DTYPE: DType = DType::F32;
}
impl WireElement for f64 {
    const DTYPE: DType = DType::F64;
}
impl WireElement for bf16 {
    const DTYPE: DType = DType::BF16;
}
impl WireElement for u32 {
    const DTYPE: DType = DType::U32;
}

impl Element for f32 {
    type Acc = f32;
    fn to_acc(self) -> f32 {
        self
    }
    fn from_acc(acc: f32) -> f32 {
        acc
    }
    fn as_acc_mut(buf: &mut [f32]) -> Option<&mut [f32]> {
        Some(buf)
    }
    fn as_acc(buf: &[f32]) -> Option<&[f32]> {
        Some(buf)
    }
}

impl Element for f64 {
    type Acc = f64;
    fn to_acc(self) -> f64 {
        self
    }
    fn from_acc(acc: f64) -> f64 {
        acc
    }
    fn as_acc_mut(buf: &mut [f64]) -> Option<&mut [f64]> {
        Some(buf)
    }
    fn as_acc(buf: &[f64]) -> Option<&[f64]> {
        Some(buf)
    }
}

impl Element for bf16 {
    type Acc = f32;
    fn to_acc(self) -> f32 {
        self.to_f32()
    }
    fn from_acc(acc: f32) -> bf16 {
        bf16::from_f32(acc)
    }
    fn as_acc_mut(_buf: &mut [bf16]) -> Option<&mut [f32]> {
        None
    }
    fn as_acc(_buf: &[bf16]) -> Option<&[f32]> {
        None
    }
}

macro_rules! accumulator {
    ($t:ty) => {
        impl Accumulator for $t {
            #[inline]
            fn combine(op: ReduceOp, a: $t, b: $t) -> $t {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a + b,
                    // NaN wins, then the larger; on equality (±0) the first operand.
                    ReduceOp::Max => {
                        if a.is_nan() || (!b.is_nan() && a >= b) {
                            a
                        } else {
                            b
                        }
                    }
                    ReduceOp::Min => {
                        if a.is_nan() || (!b.is_nan() && a <= b) {
                            a
                        } else {
                            b
                        }
                    }
                }
            }
            #[inline]
            fn div_count(self, n: usize) -> $t {
                self / (n as $t)
            }
        }
    };
}
accumulator!(f32);
accumulator!(f64);

/// `local[i] = combine(received[i], local[i])` when `received_first`, else
/// `combine(local[i], received[i])`; `received` is raw little-endian bytes of `A`.
pub(crate) fn combine_bytes<A: Accumulator>(op: ReduceOp, local: &mut [A], received: &[u8], received_first: bool) {
    assert_eq!(received.len(), std::mem::size_of_val(local), "combine: length checked by the caller");
    match bytemuck::try_cast_slice::<u8, A>(received) {
        Ok(received) => combine_in_place(op, local, received, !received_first),
        Err(_) => {
            let size = std::mem::size_of::<A>();
            for (dst, bytes) in local.iter_mut().zip(received.chunks_exact(size)) {
                let other: A = bytemuck::pod_read_unaligned(bytes);
                *dst = if received_first { A::combine(op, other, *dst) } else { A::combine(op, *dst, other) };
            }
        }
    }
}

/// `received[i] = combine(received[i], local[i])`, writing into the received bytes (a ring
/// reduce-scatter step combines into the frame it then forwards).
pub(crate) fn combine_into_bytes<A: Accumulator>(op: ReduceOp, received: &mut [u8], local: &[A]) {
    assert_eq!(received.len(), std::mem::size_of_val(local), "combine: length checked by the caller");
    match bytemuck::try_cast_slice_mut::<u8, A>(received) {
        Ok(received) => combine_in_place(op, received, local, true),
        Err(_) => {
            let size = std::mem::size_of::<A>();
            for (bytes, mine) in received.chunks_exact_mut(size).zip(local) {
                let other: A = bytemuck::pod_read_unaligned(bytes);
                bytes.copy_from_slice(bytemuck::bytes_of(&A::combine(op, other, *mine)));
            }
        }
    }
}

/// `dst[i] = combine(dst[i], other[i])` when `dst_first`, else `combine(other[i], dst[i])`. One
/// loop per operation, so each compiles to straight vector code.
pub(crate) fn combine_in_place<A: Accumulator>(op: ReduceOp, dst: &mut [A], other: &[A], dst_first: bool) {
    assert_eq!(dst.len(), other.len(), "combine: equal lengths");
    macro_rules! each {
        ($op:expr) => {
            if dst_first {
                for (d, o) in dst.iter_mut().zip(other) {
                    *d = A::combine($op, *d, *o);
                }
            } else {
                for (d, o) in dst.iter_mut().zip(other) {
                    *d = A::combine($op, *o, *d);
                }
            }
        };
    }
    match op {
        ReduceOp::Sum | ReduceOp::Avg => each!(ReduceOp::Sum),
        ReduceOp::Max => each!(ReduceOp::Max),
        ReduceOp::Min => each!(ReduceOp::Min),
    }
}

/// Rounds raw little-endian accumulator values into `dst` (a copy when `T` is its own
/// accumulator).
pub(crate) fn round_bytes<T: Element>(dst: &mut [T], received: &[u8]) {
    assert_eq!(received.len(), dst.len() * std::mem::size_of::<T::Acc>(), "round: length checked by the caller");
    if let Some(acc) = T::as_acc_mut(&mut *dst) {
        copy_bytes(acc, received);
        return;
    }
    match bytemuck::try_cast_slice::<u8, T::Acc>(received) {
        Ok(values) => {
            for (d, v) in dst.iter_mut().zip(values) {
                *d = T::from_acc(*v);
            }
        }
        Err(_) => {
            for (d, bytes) in dst.iter_mut().zip(received.chunks_exact(std::mem::size_of::<T::Acc>())) {
                *d = T::from_acc(bytemuck::pod_read_unaligned(bytes));
            }
        }
    }
}

/// Walks a payload given as byte pieces (`parts`, whose lengths need not be multiples of
/// `elem_size`) as runs of whole elements: calls `f(elements, bytes)` for each run, with the
/// element index range and its bytes; an element split across two pieces is put together in a
/// small buffer and passed on its own. Returns the number of elements seen.
fn walk_parts<'a>(elem_size: usize, parts: impl Iterator<Item = &'a [u8]>, mut f: impl FnMut(std::ops::Range<usize>, &[u8])) -> usize {
    const CARRY: usize = 16;
    assert!(elem_size > 0 && elem_size <= CARRY, "walk_parts: element size");
    let mut carry = [0u8; CARRY];
    let mut carried = 0;
    let mut next = 0;
    for part in parts {
        let mut rest = part;
        if carried > 0 {
            let take = (elem_size - carried).min(rest.len());
            carry[carried..carried + take].copy_from_slice(&rest[..take]);
            carried += take;
            rest = &rest[take..];
            if carried < elem_size {
                continue;
            }
            f(next..next + 1, &carry[..elem_size]);
            next += 1;
        }
        let whole = rest.len() / elem_size;
        if whole > 0 {
            f(next..next + whole, &rest[..whole * elem_size]);
            next += whole;
        }
        let tail = &rest[whole * elem_size..];
        carry[..tail.len()].copy_from_slice(tail);
        carried = tail.len();
    }
    debug_assert_eq!(carried, 0, "walk_parts: a whole number of elements");
    next
}

/// [`copy_bytes`] from a payload in pieces.
pub(crate) fn copy_parts<'a, T: WireElement>(dst: &mut [T], parts: impl Iterator<Item = &'a [u8]>) {
    let dst_bytes: &mut [u8] = bytemuck::cast_slice_mut(dst);
    let copied = walk_parts(1, parts, |r, bytes| dst_bytes[r].copy_from_slice(bytes));
    assert_eq!(copied, dst_bytes.len(), "copy: length checked by the caller");
}

/// `out[i] = combine(received[i], local[i])`: a received payload in pieces combined with local
/// values into a separate buffer (`out`, raw little-endian bytes of `A`), in one pass.
pub(crate) fn combine_parts_to<'a, A: Accumulator>(op: ReduceOp, out: &mut [u8], parts: impl Iterator<Item = &'a [u8]>, local: &[A]) {
    assert_eq!(out.len(), std::mem::size_of_val(local), "combine: length checked by the caller");
    let size = std::mem::size_of::<A>();
    let combined = walk_parts(size, parts, |r, bytes| combine_to_bytes(op, &mut out[r.start * size..r.end * size], bytes, &local[r]));
    assert_eq!(combined, local.len(), "combine: length checked by the caller");
}

/// `out[i] = combine(received[i], local[i])` over raw little-endian bytes of `A` (`out` and
/// `received`); one loop per operation, so each compiles to straight vector code.
pub(crate) fn combine_to_bytes<A: Accumulator>(op: ReduceOp, out: &mut [u8], received: &[u8], local: &[A]) {
    debug_assert_eq!(out.len(), received.len());
    macro_rules! each {
        ($op:expr) => {
            match (bytemuck::try_cast_slice_mut::<u8, A>(out), bytemuck::try_cast_slice::<u8, A>(received)) {
                (Ok(out), Ok(received)) => {
                    for ((o, r), l) in out.iter_mut().zip(received).zip(local) {
                        *o = A::combine($op, *r, *l);
                    }
                }
                (Ok(out), Err(_)) => {
                    for ((o, r), l) in out.iter_mut().zip(received.chunks_exact(std::mem::size_of::<A>())).zip(local) {
                        *o = A::combine($op, bytemuck::pod_read_unaligned(r), *l);
                    }
                }
                (Err(_), _) => {
                    let size = std::mem::size_of::<A>();
                    for ((o, r), l) in out.chunks_exact_mut(size).zip(received.chunks_exact(size)).zip(local) {
                        o.copy_from_slice(bytemuck::bytes_of(&A::combine($op, bytemuck::pod_read_unaligned(r), *l)));
                    }
                }
            }
        };
    }
    match op {
        ReduceOp::Sum | ReduceOp::Avg => each!(ReduceOp::Sum),
        ReduceOp::Max => each!(ReduceOp::Max),
        ReduceOp::Min => each!(ReduceOp::Min),
    }
}

/// [`round_bytes`] from a payload in pieces.
pub(crate) fn round_parts<'a, T: Element>(dst: &mut [T], parts: impl Iterator<Item = &'a [u8]>) {
    let rounded = walk_parts(std::mem::size_of::<T::Acc>(), parts, |r, bytes| round_bytes(&mut dst[r], bytes));
    assert_eq!(rounded, dst.len(), "round: length checked by the caller");
}

/// Copies raw little-endian bytes into typed elements (one `memcpy`).
pub(crate) fn copy_bytes<T: WireElement>(dst: &mut [T], received: &[u8]) {
    let dst_bytes: &mut [u8] = bytemuck::cast_slice_mut(dst);
    assert_eq!(dst_bytes.len(), received.len(), "copy: length checked by the caller");
    dst_bytes.copy_from_slice(received);
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    // Goal: max/min are order-independent in bits for NaN and signed zeros except where the fixed
    // first operand decides, and NaN propagates.
    #[test]
    fn max_min_nan_and_zero() {
        assert!(f32::combine(ReduceOp::Max, f32::NAN, 1.0).is_nan());
        assert!(f32::combine(ReduceOp::Max, 1.0, f32::NAN).is_nan());
        assert!(f32::combine(ReduceOp::Min, 1.0, f32::NAN).is_nan());
        assert_eq!(f32::combine(ReduceOp::Max, -0.0, 0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(f32::combine(ReduceOp::Max, 0.0, -0.0).to_bits(), 0.0f32.to_bits());
        assert_eq!(f64::combine(ReduceOp::Min, 2.0, -3.0), -3.0);
    }

    /// `bytes` cut at the (ascending) byte positions `cuts`.
    fn cut_at<'a>(bytes: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
        let mut parts = Vec::new();
        let mut at = 0;
        for &c in cuts {
            parts.push(&bytes[at..c]);
            at = c;
        }
        parts.push(&bytes[at..]);
        parts
    }

    // Goal: a payload cut into pieces at any byte positions (elements split across pieces,
    // unaligned pieces, empty pieces) copies and rounds exactly as the whole payload (combining from
    // pieces: `frame::tests::plain_stream_takes_elements_across_any_cuts`).
    #[test]
    fn pieces_equal_whole() {
        let values: Vec<f32> = (0..37).map(|i| i as f32 * 1.25 - 7.0).collect();
        let bytes: Vec<u8> = bytemuck::cast_slice(&values).to_vec();
        for cuts in [vec![], vec![1], vec![3, 4, 5], vec![0, 0, 7, 7, 70, 147], (1..148).collect::<Vec<_>>()] {
            let parts = cut_at(&bytes, &cuts);
            let mut copied = vec![0.0f32; 37];
            copy_parts(&mut copied, parts.iter().copied());
            assert_eq!(copied, values);
            let mut rounded = vec![bf16::ZERO; 37];
            round_parts(&mut rounded, parts.iter().copied());
            assert_eq!(rounded, values.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>());
        }
    }

    // Goal: combining pieces into a separate buffer (a ring's Forward step over QUIC) gives the
    // same bits as combining into the received bytes in place, for every operation, with pieces
    // cut anywhere (unaligned, elements split) and an output buffer that is aligned or not.
    #[test]
    fn combine_to_separate_buffer_equals_in_place() {
        let received: Vec<f32> = (0..41).map(|i| if i % 9 == 4 { f32::NAN } else { i as f32 * 0.75 - 11.0 }).collect();
        let local: Vec<f32> = (0..41).map(|i| if i % 5 == 0 { -0.0 } else { 13.0 - i as f32 * 0.5 }).collect();
        let bytes: Vec<u8> = bytemuck::cast_slice(&received).to_vec();
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            let mut expected = bytes.clone();
            combine_into_bytes(op, &mut expected, &local);
            for cuts in [vec![], vec![2], vec![3, 4, 5, 80], (1..164).step_by(7).collect::<Vec<_>>()] {
                let parts = cut_at(&bytes, &cuts);
                for offset in [0usize, 1] {
                    let mut out = vec![0u8; bytes.len() + offset];
                    combine_parts_to(op, &mut out[offset..], parts.iter().copied(), &local);
                    assert_eq!(&out[offset..], &expected[..], "{op:?}, cuts {cuts:?}, offset {offset}");
                }
            }
        }
    }

    // Goal: combine_bytes reads unaligned little-endian bytes correctly.
    #[test]
    fn combine_unaligned() {
        let mut local = [1.0f32, 2.0];
        let mut bytes = vec![0u8];
        bytes.extend_from_slice(bytemuck::cast_slice(&[10.0f32, 20.0]));
        combine_bytes(ReduceOp::Sum, &mut local, &bytes[1..], true);
        assert_eq!(local, [11.0, 22.0]);
    }
}
