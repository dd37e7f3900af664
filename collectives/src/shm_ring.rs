//! The synchronisation protocol of one shared-memory ring (single producer, single consumer),
//! written once, generic over the memory it runs on ([`RingMemory`]): the transport
//! ([`crate::ShmTransport`]) runs it on a mapped file with the kernel's futex, and the model check
//! (`model` below, with [loom](https://docs.rs/loom)) runs the very same provided methods on loom's
//! atomics, with the futex replaced by a mutex and condition variable that check the word under
//! the lock, as the kernel does. Loom explores every interleaving (up to a preemption bound) and
//! every value a weak-memory load may return, and flags a thread that sleeps forever (a lost
//! wake-up: the model's waits have no timeout) and a data byte read without a happens-before edge
//! from its write (a torn read).
//!
//! The protocol: `tail` (bytes published, written only by the writer) and `head` (bytes given
//! back, written only by the reader) count bytes since creation; a side publishes with a release
//! store and observes the other side with an acquire load. Each direction has an event count: a
//! sequence word the publishing side bumps, and a "sleeping" word the waiting side sets before it
//! re-checks the ring and sleeps on the sequence word (`FUTEX_WAIT` with the value it read before
//! announcing itself). The store-load pairs "publish, then look for a sleeper" and "announce, then
//! look at the ring" are ordered by a sequentially consistent fence on each side, so at least one
//! side sees the other: either the sleeper sees the new data (or space, or closed flag) and does
//! not sleep, or the publisher sees the sleeper and wakes it (and the futex's own value check
//! covers a wake that comes before the sleep). Fences rather than `SeqCst` accesses because they
//! say exactly which pairs are ordered, and because loom models `SeqCst` fences but not the
//! store-buffering guarantee of `SeqCst` accesses. A busy link makes no system calls: a publisher
//! calls `FUTEX_WAKE` only when a sleeper is announced.
//!
//! Closing: either side may set its closed flag (the writer: no more data; the reader: no more
//! reading), and [`RingMemory::close_writer`] / [`RingMemory::close_reader`] then wake both
//! sides, because a sleeper on either word must see it (an aborting rank closes its own rings and
//! must release its own sleeping threads as well as the peer's). A sleeper never sleeps while
//! either flag is set.

use std::mem::MaybeUninit;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// A 64-bit control word (std's atomic in the mapped file, or loom's in the model).
pub(crate) trait Word64 {
    fn load(&self, order: Ordering) -> u64;
    fn store(&self, value: u64, order: Ordering);
}

/// A 32-bit futex word.
pub(crate) trait Word32 {
    fn load(&self, order: Ordering) -> u32;
    fn store(&self, value: u32, order: Ordering);
    fn fetch_add(&self, value: u32, order: Ordering) -> u32;
}

impl Word64 for std::sync::atomic::AtomicU64 {
    #[inline]
    fn load(&self, order: Ordering) -> u64 {
        std::sync::atomic::AtomicU64::load(self, order)
    }
    #[inline]
    fn store(&self, value: u64, order: Ordering) {
        std::sync::atomic::AtomicU64::store(self, value, order);
    }
}

impl Word32 for std::sync::atomic::AtomicU32 {
    #[inline]
    fn load(&self, order: Ordering) -> u32 {
        std::sync::atomic::AtomicU32::load(self, order)
    }
    #[inline]
    fn store(&self, value: u32, order: Ordering) {
        std::sync::atomic::AtomicU32::store(self, value, order);
    }
    #[inline]
    fn fetch_add(&self, value: u32, order: Ordering) -> u32 {
        std::sync::atomic::AtomicU32::fetch_add(self, value, order)
    }
}

/// The memory of one ring: what an implementation provides (control words, the data area, a
/// fence and a futex); the protocol is the provided methods, which implementations do not
/// override.
pub(crate) trait RingMemory {
    type W64: Word64;
    type W32: Word32;

    /// Data bytes; a power of two.
    fn capacity(&self) -> usize;
    fn head_word(&self) -> &Self::W64;
    fn tail_word(&self) -> &Self::W64;
    fn writer_closed_word(&self) -> &Self::W64;
    fn reader_closed_word(&self) -> &Self::W64;
    /// Data wake-up: bumped by the writer, slept on by the reader.
    fn data_seq(&self) -> &Self::W32;
    fn reader_sleeping(&self) -> &Self::W32;
    /// Space wake-up: bumped by the reader, slept on by the writer.
    fn space_seq(&self) -> &Self::W32;
    fn writer_sleeping(&self) -> &Self::W32;
    /// Copies `src` into the data area at `start` (`start + src.len() <= capacity`).
    ///
    /// # Safety
    ///
    /// Only the writer calls it, on bytes it owns: past `tail` and before `head + capacity`.
    unsafe fn copy_in(&self, start: usize, src: &[u8]);
    /// Copies `dst.len()` bytes of the data area at `start` into `dst` (no wrap).
    ///
    /// # Safety
    ///
    /// Only the reader calls it, on bytes published (before `tail`) and not given back.
    unsafe fn copy_out(&self, start: usize, dst: &mut [MaybeUninit<u8>]);
    /// A sequentially consistent fence.
    fn fence_seqcst(&self);
    /// Sleeps while `word` holds `expected`, at most `timeout` (spurious returns allowed).
    fn futex_wait(&self, word: &Self::W32, expected: u32, timeout: Duration);
    /// Wakes every sleeper on `word`.
    fn futex_wake(&self, word: &Self::W32);

    /// Bytes published so far.
    #[inline]
    fn tail(&self) -> u64 {
        self.tail_word().load(Ordering::Acquire)
    }

    /// Bytes given back so far.
    #[inline]
    fn head(&self) -> u64 {
        self.head_word().load(Ordering::Acquire)
    }

    /// Bytes the writer may not overwrite yet.
    #[inline]
    fn fill(&self) -> usize {
        let head = self.head();
        self.tail().wrapping_sub(head) as usize
    }

    /// Bytes the writer may write now.
    #[inline]
    fn free(&self) -> usize {
        self.capacity() - self.fill()
    }

    /// Whether the writer closed the ring (everything it published before is visible now).
    #[inline]
    fn writer_closed(&self) -> bool {
        self.writer_closed_word().load(Ordering::Acquire) != 0
    }

    /// Whether the reader closed the ring.
    #[inline]
    fn reader_closed(&self) -> bool {
        self.reader_closed_word().load(Ordering::Acquire) != 0
    }

    /// Writer side: puts up to `len` bytes (copied from `src`, or skipped over when `None`) into
    /// the free space and publishes them; returns the byte count. Does not wake the reader (the
    /// caller does, with [`wake_reader`](Self::wake_reader), once per step).
    fn write_some(&self, src: Option<&[u8]>, len: usize) -> usize {
        let capacity = self.capacity();
        let tail = self.tail_word().load(Ordering::Relaxed);
        let head = self.head();
        let used = tail.wrapping_sub(head) as usize;
        debug_assert!(used <= capacity, "ring: fill within capacity");
        let n = len.min(capacity - used);
        if n == 0 {
            return 0;
        }
        if let Some(src) = src {
            let start = (tail as usize) & (capacity - 1);
            let first = n.min(capacity - start);
            // SAFETY: bytes `tail..tail + n` (mod capacity) are free: the reader has given back
            // everything before `head` (acquired above), and reads nothing beyond `tail` until we
            // publish it below. Neither piece wraps.
            unsafe {
                self.copy_in(start, &src[..first]);
                self.copy_in(0, &src[first..n]);
            }
        }
        self.tail_word().store(tail + n as u64, Ordering::Release);
        n
    }

    /// Reader side: copies `dst.len()` published bytes starting at stream offset `pos` (the
    /// caller has seen `tail` past them and not given them back).
    fn read_at(&self, pos: u64, dst: &mut [MaybeUninit<u8>]) {
        let capacity = self.capacity();
        let n = dst.len();
        debug_assert!(self.tail().wrapping_sub(pos) as usize >= n, "ring: copy within the published bytes");
        let start = (pos as usize) & (capacity - 1);
        let first = n.min(capacity - start);
        let (a, b) = dst.split_at_mut(first);
        // SAFETY: bytes `pos..pos + n` (mod capacity) were published by the writer's release store
        // of `tail`, which the caller acquired, and the writer does not overwrite them before
        // `head` passes them, which only happens after the reader is done.
        unsafe {
            self.copy_out(start, a);
            self.copy_out(0, b);
        }
    }

    /// Reader side: gives every byte before `head` back to the writer and wakes it if it sleeps.
    fn give_back(&self, head: u64) {
        self.head_word().store(head, Ordering::Release);
        self.wake_writer();
    }

    /// Writer side, after publishing (data or the closed flag): bumps the data word and wakes a
    /// sleeping reader.
    #[inline]
    fn wake_reader(&self) {
        self.data_seq().fetch_add(1, Ordering::Release);
        self.fence_seqcst();
        if self.reader_sleeping().load(Ordering::Relaxed) != 0 {
            self.futex_wake(self.data_seq());
        }
    }

    /// Reader side, after giving space back (or closing): bumps the space word and wakes a
    /// sleeping writer.
    #[inline]
    fn wake_writer(&self) {
        self.space_seq().fetch_add(1, Ordering::Release);
        self.fence_seqcst();
        if self.writer_sleeping().load(Ordering::Relaxed) != 0 {
            self.futex_wake(self.space_seq());
        }
    }

    /// Reader side: sleeps until the writer publishes past `rpos` (or `timeout`), unless it did
    /// already or a closed flag is set. Spurious returns are fine; the caller re-checks.
    fn sleep_for_data(&self, rpos: u64, timeout: Duration) {
        let seq = self.data_seq().load(Ordering::Acquire);
        self.reader_sleeping().store(1, Ordering::Relaxed);
        self.fence_seqcst();
        if self.tail() == rpos && !self.writer_closed() && !self.reader_closed() {
            self.futex_wait(self.data_seq(), seq, timeout);
        }
        self.reader_sleeping().store(0, Ordering::Relaxed);
    }

    /// Writer side: sleeps until the reader frees space (or `timeout`); see
    /// [`sleep_for_data`](Self::sleep_for_data).
    fn sleep_for_space(&self, timeout: Duration) {
        let seq = self.space_seq().load(Ordering::Acquire);
        self.writer_sleeping().store(1, Ordering::Relaxed);
        self.fence_seqcst();
        if self.free() == 0 && !self.reader_closed() && !self.writer_closed() {
            self.futex_wait(self.space_seq(), seq, timeout);
        }
        self.writer_sleeping().store(0, Ordering::Relaxed);
    }

    /// Sets the writer's closed flag and wakes both sides.
    fn close_writer(&self) {
        self.writer_closed_word().store(1, Ordering::Release);
        self.wake_reader();
        self.wake_writer();
    }

    /// Sets the reader's closed flag and wakes both sides.
    fn close_reader(&self) {
        self.reader_closed_word().store(1, Ordering::Release);
        self.wake_writer();
        self.wake_reader();
    }
}

#[cfg(test)]
mod model;
