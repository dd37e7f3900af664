//! A process-wide pool of freed element buffers, so an op's output reuses the memory of a
//! tensor that died earlier instead of asking the allocator for fresh pages.
//!
//! Why: every op writes a fresh output. A large fresh allocation comes back from the OS as
//! untouched pages that fault in (and are zeroed by the kernel) on first write, about 3.5 µs per
//! 4 KiB on the reference VM; a GPT training step spent a fifth of its time there. A training
//! loop allocates the same sizes every step, so recycling buffers by size removes nearly all of
//! it. When a [`crate::Storage`] is dropped, its buffer goes back here ([`give`]); ops take their
//! outputs with [`take`] (stale contents, for outputs the kernel fully overwrites) or [`zeroed`].
//!
//! Buffers are binned by capacity in size classes (four per power of two); a request takes a
//! buffer from the smallest class that is sure to hold it. Buffers under [`POOL_MIN_BYTES`] are
//! left to the allocator, and the pool holds at most [`buffer_pool_limit_bytes`] in all (new
//! buffers are simply freed past it). Reuse never changes results: a taken buffer is either fully
//! overwritten or zero-filled.

use half::bf16;
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Buffers smaller than this are not pooled (the allocator reuses small blocks well).
pub(crate) const POOL_MIN_BYTES: usize = 32 * 1024;

/// Default bound on the bytes the pool holds.
pub(crate) const POOL_LIMIT_BYTES_DEFAULT: usize = 1 << 30;

/// How many buffers of one size class the pool keeps.
const POOL_PER_CLASS_MAX: usize = 256;

// The smallest pooled buffer (bytes of the widest element) is far above the 4 elements
// the size classes start at.
const _: () = assert!(POOL_MIN_BYTES / 8 >= 4);

static LIMIT_BYTES: AtomicUsize = AtomicUsize::new(POOL_LIMIT_BYTES_DEFAULT);
static HELD_BYTES: AtomicUsize = AtomicUsize::new(0);

/// Sets the most bytes of freed tensor buffers the process keeps for reuse (0 turns the pool
/// off). Lowering it does not free what is held; see [`release_buffer_pool`].
pub fn set_buffer_pool_limit_bytes(bytes: usize) {
    LIMIT_BYTES.store(bytes, Ordering::Relaxed);
}

/// The current bound on pooled bytes.
pub fn buffer_pool_limit_bytes() -> usize {
    LIMIT_BYTES.load(Ordering::Relaxed)
}

/// Bytes of freed buffers the pool holds now.
pub fn buffer_pool_held_bytes() -> usize {
    HELD_BYTES.load(Ordering::Relaxed)
}

/// Frees every buffer the pool holds.
pub fn release_buffer_pool() {
    f32::bins().lock().clear();
    f64::bins().lock().clear();
    bf16::bins().lock().clear();
    u32::bins().lock().clear();
    i64::bins().lock().clear();
    HELD_BYTES.store(0, Ordering::Relaxed);
}

/// Size class bins of one element type: class index -> buffers whose capacity is at least the
/// class size.
type Bins<T> = Mutex<BTreeMap<u32, Vec<Vec<T>>>>;

/// An element type with its own bins.
pub(crate) trait Pooled: Copy + Default + Send + 'static {
    fn bins() -> &'static Bins<Self>;
}

macro_rules! pooled {
    ($t:ty) => {
        impl Pooled for $t {
            fn bins() -> &'static Bins<Self> {
                static BINS: Bins<$t> = Mutex::new(BTreeMap::new());
                &BINS
            }
        }
    };
}
pooled!(f32);
pooled!(f64);
pooled!(bf16);
pooled!(u32);
pooled!(i64);

/// Size of class `c` in elements: four classes per power of two, from 4 up.
fn class_size(c: u32) -> usize {
    let (pow, quarter) = (c / 4 + 2, c % 4);
    (1usize << pow) + (quarter as usize) * (1usize << (pow - 2))
}

/// The largest class whose size is at most `cap` (a buffer of capacity `cap` serves it).
fn class_floor(cap: usize) -> u32 {
    debug_assert!(cap >= 4, "pooled buffers hold at least 4 elements");
    let pow = usize::BITS - 1 - cap.leading_zeros();
    let quarter = ((cap - (1usize << pow)) >> (pow - 2)) as u32;
    let c = (pow - 2) * 4 + quarter;
    debug_assert!(class_size(c) <= cap && (class_size(c + 1) > cap));
    c
}

/// The smallest class whose size is at least `n` (every buffer in it holds `n`).
fn class_ceil(n: usize) -> u32 {
    let c = class_floor(n);
    if class_size(c) == n {
        c
    } else {
        c + 1
    }
}

fn pooled_size<T>(n: usize) -> bool {
    n.saturating_mul(std::mem::size_of::<T>()) >= POOL_MIN_BYTES
}

/// A buffer of `n` elements whose contents are unspecified (left over from an earlier tensor or
/// zero); for outputs the caller overwrites entirely.
pub(crate) fn take<T: Pooled>(n: usize) -> Vec<T> {
    if pooled_size::<T>(n) {
        let c = class_ceil(n);
        let got = {
            let mut bins = T::bins().lock();
            match bins.get_mut(&c) {
                Some(list) => list.pop(),
                None => None,
            }
        };
        if let Some(mut v) = got {
            HELD_BYTES.fetch_sub(v.capacity() * std::mem::size_of::<T>(), Ordering::Relaxed);
            debug_assert!(v.capacity() >= n);
            if v.len() >= n {
                v.truncate(n);
            } else {
                v.resize(n, T::default());
            }
            return v;
        }
        // Allocate a whole class so that the buffer serves any request of its class later.
        let mut v = vec![T::default(); class_size(c)];
        v.truncate(n);
        return v;
    }
    vec![T::default(); n]
}

/// A buffer of `n` zeros (a reused buffer is cleared).
pub(crate) fn zeroed<T: Pooled>(n: usize) -> Vec<T> {
    let mut v = take::<T>(n);
    v.fill(T::default());
    v
}

/// A copy of `src` in a pooled buffer.
pub(crate) fn copied<T: Pooled>(src: &[T]) -> Vec<T> {
    let mut v = take::<T>(src.len());
    v.copy_from_slice(src);
    v
}

/// Hands the buffer of dead storage data back (see [`give`]).
pub(crate) fn give_data(data: crate::storage::CpuData) {
    use crate::storage::CpuData;
    match data {
        CpuData::F32(v) => give_elements(v),
        CpuData::F64(v) => give_elements(v),
        CpuData::BF16(v) => give_elements(v),
        CpuData::U32(v) => give_elements(v),
        CpuData::I64(v) => give_elements(v),
    }
}

/// Hands owned elements back; foreign memory is its owner's to free.
fn give_elements<T: Pooled>(elements: crate::storage::Elements<T>) {
    if let Some(v) = elements.into_owned_vec() {
        give(v);
    }
}

/// Hands a dead buffer back for reuse (or frees it when small or when the pool is full).
pub(crate) fn give<T: Pooled>(v: Vec<T>) {
    let cap = v.capacity();
    if !pooled_size::<T>(cap) {
        return;
    }
    let bytes = cap * std::mem::size_of::<T>();
    if HELD_BYTES.load(Ordering::Relaxed) + bytes > LIMIT_BYTES.load(Ordering::Relaxed) {
        return;
    }
    let c = class_floor(cap);
    let mut bins = T::bins().lock();
    let list = bins.entry(c).or_default();
    if list.len() < POOL_PER_CLASS_MAX {
        list.push(v);
        HELD_BYTES.fetch_add(bytes, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_bracket_sizes() {
        for n in 4..5000usize {
            let f = class_floor(n);
            assert!(class_size(f) <= n && class_size(f + 1) > n, "floor {n}");
            let c = class_ceil(n);
            assert!(class_size(c) >= n && (c == 0 || class_size(c - 1) < n), "ceil {n}");
        }
        for c in 0..200u32 {
            assert!(class_size(c + 1) > class_size(c));
        }
    }

    #[test]
    fn reused_buffer_has_requested_len() {
        let n = 100_000;
        let mut v = take::<f32>(n);
        assert_eq!(v.len(), n);
        v.fill(7.0);
        give(v);
        let z = zeroed::<f32>(n - 3);
        assert_eq!(z.len(), n - 3);
        assert!(z.iter().all(|&x| x == 0.0));
        let w = take::<f32>(n + 1);
        assert_eq!(w.len(), n + 1);
    }
}
