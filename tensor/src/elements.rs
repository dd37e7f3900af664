//! The elements of one dtype in host memory: owned (a `Vec`, which goes back to the buffer pool
//! when its storage dies) or **borrowed from foreign memory** (a numpy array, a memory-mapped
//! file) that an owner object keeps alive.
//!
//! Why a second kind: `rustytorch.Tensor.from_numpy(a)` should view `a`'s memory as PyTorch's
//! `torch.from_numpy` does, not copy it. A `Vec` cannot adopt memory it did not allocate, so a
//! foreign buffer is a pointer, a length and an `owner` (for numpy: the Python buffer export)
//! whose drop releases the memory. Everything that reads elements sees a slice (`Deref`) and does
//! not know the difference.
//!
//! Writes: a *writable* foreign buffer is written in place (a write through the tensor is seen by
//! the numpy array and the other way round, as with `torch.from_numpy`); a *read-only* one is
//! copied into an owned `Vec` on the first mutable access (copy-on-write), so a read-only numpy
//! array is never written. Code that needs the `Vec` itself (to grow it, to hand it to the pool)
//! calls [`Elements::vec_mut`] or [`Elements::into_vec`], which copy a foreign buffer first and
//! from then on the tensor owns its memory. `Clone` always makes an owned copy: a clone is a
//! snapshot, never another alias of foreign memory.
//!
//! Data races: Rust takes the storage's lock for its own reads and writes; the foreign side does
//! not. Mutating the numpy array while a Rust op reads the tensor on another thread is a race, as
//! it is between two numpy views of one array or with `torch.from_numpy`.

use std::any::Any;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::Arc;

/// What keeps foreign memory alive; dropped (last handle) when no tensor reads it any more.
pub type ForeignOwner = Arc<dyn Any + Send + Sync>;

/// Host elements of type `T`, owned or borrowed from foreign memory (module docs).
pub struct Elements<T> {
    repr: Repr<T>,
}

enum Repr<T> {
    Owned(Vec<T>),
    Foreign(Foreign<T>),
}

/// A borrowed foreign buffer, kept alive by its owner.
struct Foreign<T> {
    pointer: NonNull<T>,
    len: usize,
    writable: bool,
    owner: ForeignOwner,
}

// SAFETY: a foreign buffer is plain memory of `T` that the owner (itself `Send + Sync`) keeps
// alive and in place; shared reads (`&[T]`) and the exclusive writes of `DerefMut` (`&mut self`)
// follow Rust's rules on the Rust side, exactly as for a `Vec<T>`.
unsafe impl<T: Send> Send for Foreign<T> {}
// SAFETY: see `Send`: `&Foreign<T>` only hands out `&[T]`.
unsafe impl<T: Sync> Sync for Foreign<T> {}

impl<T> Elements<T> {
    /// Views `len` elements at `pointer`, kept alive by `owner`.
    ///
    /// # Safety
    /// `pointer` is non-null, aligned for `T`, and valid for reads of `len` initialized elements
    /// (and for writes, when `writable`) for as long as `owner` lives; the memory is neither freed
    /// nor moved while `owner` lives.
    pub unsafe fn from_foreign(pointer: NonNull<T>, len: usize, writable: bool, owner: ForeignOwner) -> Self {
        Elements { repr: Repr::Foreign(Foreign { pointer, len, writable, owner }) }
    }

    /// Whether the elements are borrowed from foreign memory.
    pub fn is_foreign(&self) -> bool {
        matches!(self.repr, Repr::Foreign(_))
    }

    /// The owner of borrowed foreign memory (`None` when owned): whoever hands the memory on
    /// (a buffer export) holds it so the memory outlives a later copy-on-write of these elements.
    pub fn foreign_owner(&self) -> Option<ForeignOwner> {
        match &self.repr {
            Repr::Owned(_) => None,
            Repr::Foreign(f) => Some(Arc::clone(&f.owner)),
        }
    }

    /// The elements as a slice.
    pub fn as_slice(&self) -> &[T] {
        match &self.repr {
            Repr::Owned(v) => v,
            // SAFETY: `from_foreign`'s contract: valid for reads of `len` elements while the owner
            // (held by `self`) lives.
            Repr::Foreign(f) => unsafe { std::slice::from_raw_parts(f.pointer.as_ptr(), f.len) },
        }
    }

    /// The elements as a mutable slice: in place for owned and writable foreign memory, after a
    /// copy into an owned `Vec` for read-only foreign memory.
    pub fn as_mut_slice(&mut self) -> &mut [T]
    where
        T: Clone,
    {
        if let Repr::Foreign(f) = &self.repr {
            if f.writable {
                // SAFETY: `from_foreign`'s contract: valid for writes of `len` elements while the
                // owner lives; `&mut self` makes this the only Rust access.
                return unsafe { std::slice::from_raw_parts_mut(f.pointer.as_ptr(), f.len) };
            }
        }
        self.vec_mut()
    }

    /// The owned `Vec`, copying foreign elements into one first (after which the elements no
    /// longer alias the foreign memory).
    pub fn vec_mut(&mut self) -> &mut Vec<T>
    where
        T: Clone,
    {
        if let Repr::Foreign(_) = &self.repr {
            self.repr = Repr::Owned(self.as_slice().to_vec());
        }
        match &mut self.repr {
            Repr::Owned(v) => v,
            Repr::Foreign(_) => unreachable!("made owned just above"),
        }
    }

    /// The elements as an owned `Vec` (a copy for foreign memory).
    pub fn into_vec(self) -> Vec<T>
    where
        T: Clone,
    {
        match self.repr {
            Repr::Owned(v) => v,
            Repr::Foreign(f) => {
                // SAFETY: as in `as_slice`; `f` (and with it the owner) lives until the copy is made.
                unsafe { std::slice::from_raw_parts(f.pointer.as_ptr(), f.len) }.to_vec()
            }
        }
    }

    /// The owned `Vec` for the buffer pool; `None` for foreign memory (its owner frees it).
    pub(crate) fn into_owned_vec(self) -> Option<Vec<T>> {
        match self.repr {
            Repr::Owned(v) => Some(v),
            Repr::Foreign(_) => None,
        }
    }
}

impl<T> From<Vec<T>> for Elements<T> {
    fn from(v: Vec<T>) -> Self {
        Elements { repr: Repr::Owned(v) }
    }
}

impl<T> FromIterator<T> for Elements<T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        Elements::from(iter.into_iter().collect::<Vec<T>>())
    }
}

impl<T> Default for Elements<T> {
    fn default() -> Self {
        Elements { repr: Repr::Owned(Vec::new()) }
    }
}

impl<T> Deref for Elements<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.as_slice()
    }
}

impl<T: Clone> DerefMut for Elements<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.as_mut_slice()
    }
}

impl<T: Clone> Clone for Elements<T> {
    fn clone(&self) -> Self {
        Elements { repr: Repr::Owned(self.as_slice().to_vec()) }
    }
}

impl<T: fmt::Debug> fmt::Debug for Elements<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.as_slice().fmt(f)
    }
}

impl<T: PartialEq> PartialEq for Elements<T> {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl<'a, T> IntoIterator for &'a Elements<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.as_slice().iter()
    }
}

/// Consumes the elements; borrowed foreign memory is copied out first (see [`Elements::into_vec`]).
impl<T: Clone> IntoIterator for Elements<T> {
    type Item = T;
    type IntoIter = std::vec::IntoIter<T>;
    fn into_iter(self) -> Self::IntoIter {
        self.into_vec().into_iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// An owner that records its drop, holding the memory it lends.
    struct Lender {
        memory: std::cell::UnsafeCell<Vec<f32>>,
        dropped: Arc<AtomicBool>,
    }
    // SAFETY (test): the memory is only touched through the `Elements` under test, one at a time.
    unsafe impl Sync for Lender {}
    impl Drop for Lender {
        fn drop(&mut self) {
            self.dropped.store(true, Ordering::SeqCst);
        }
    }

    fn lend(values: Vec<f32>, writable: bool) -> (Elements<f32>, Arc<Lender>, Arc<AtomicBool>) {
        let dropped = Arc::new(AtomicBool::new(false));
        let lender = Arc::new(Lender { memory: std::cell::UnsafeCell::new(values), dropped: dropped.clone() });
        // SAFETY: the lender's Vec is never resized and lives as long as the owner handle.
        let pointer = NonNull::new(unsafe { (*lender.memory.get()).as_mut_ptr() }).expect("non-null");
        let len = unsafe { (*lender.memory.get()).len() };
        let owner: ForeignOwner = lender.clone();
        (unsafe { Elements::from_foreign(pointer, len, writable, owner) }, lender, dropped)
    }

    #[test]
    fn foreign_elements_alias_the_lent_memory_and_keep_it_alive() {
        let (mut e, lender, dropped) = lend(vec![1.0, 2.0, 3.0], true);
        assert!(e.is_foreign());
        assert_eq!(&e[..], &[1.0, 2.0, 3.0]);
        e[1] = 7.0; // writable: in place
        assert!(e.is_foreign());
        assert_eq!(unsafe { &*lender.memory.get() }, &vec![1.0, 7.0, 3.0]);
        drop(lender);
        assert!(!dropped.load(Ordering::SeqCst), "the elements still hold the owner");
        let copy = e.clone();
        assert!(!copy.is_foreign(), "a clone is an owned snapshot");
        drop(e);
        assert!(dropped.load(Ordering::SeqCst), "the last handle released the owner");
        assert_eq!(copy.as_slice(), &[1.0, 7.0, 3.0]);
    }

    #[test]
    fn read_only_foreign_elements_are_copied_on_first_write() {
        let (mut e, lender, _) = lend(vec![1.0, 2.0], false);
        e[0] = 5.0;
        assert!(!e.is_foreign(), "a write to read-only memory made an owned copy");
        assert_eq!(&e[..], &[5.0, 2.0]);
        assert_eq!(unsafe { &*lender.memory.get() }, &vec![1.0, 2.0], "the lent memory was not written");
    }

    #[test]
    fn vec_mut_detaches_from_foreign_memory() {
        let (mut e, lender, _) = lend(vec![1.0], true);
        e.vec_mut().push(2.0);
        assert!(!e.is_foreign());
        assert_eq!(e.into_vec(), vec![1.0, 2.0]);
        assert_eq!(unsafe { &*lender.memory.get() }, &vec![1.0]);
    }
}
