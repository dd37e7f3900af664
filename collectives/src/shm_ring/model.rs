//! Model check of the ring protocol ([`super::RingMemory`]'s provided methods, the code the
//! transport runs) with loom: a ring of loom atomics and loom cells, and a futex made of a loom
//! mutex and condition variable (the waiter checks the word under the lock, the waker takes the
//! lock after bumping the word: the kernel's guarantee). Waits have no timeout here, so a lost
//! wake-up leaves a thread asleep for good, which loom reports as a deadlock; data bytes are loom
//! cells, so a read not ordered after its write (a torn read) or a write over bytes not yet read is
//! reported as a race. Run by `cargo test -p rtx-collectives --lib shm_ring` (no `--cfg loom`).
//!
//! Properties: a transfer through a ring smaller than the message always completes with the right
//! bytes, whichever side sleeps when (no lost wake-up either way, no torn read); a writer sleeping
//! on a full ring and a reader sleeping on an empty one always wake when either side closes the
//! ring (the peer ending the link, or this rank aborting).

use std::mem::MaybeUninit;
use std::sync::atomic::Ordering;
use std::time::Duration;

use loom::cell::UnsafeCell;
use loom::sync::atomic::{AtomicU32, AtomicU64};
use loom::sync::{Arc, Condvar, Mutex};

use super::{RingMemory, Word32, Word64};

/// A futex: `wait` sleeps only if the word still holds the value, checked under the lock.
#[derive(Default)]
struct Futex {
    lock: Mutex<()>,
    woken: Condvar,
}

struct ModelRing {
    capacity: usize,
    head: AtomicU64,
    tail: AtomicU64,
    writer_closed: AtomicU64,
    reader_closed: AtomicU64,
    data_seq: AtomicU32,
    reader_sleeping: AtomicU32,
    space_seq: AtomicU32,
    writer_sleeping: AtomicU32,
    data: Vec<UnsafeCell<u8>>,
    data_futex: Futex,
    space_futex: Futex,
}

impl ModelRing {
    fn new(capacity: usize) -> ModelRing {
        ModelRing {
            capacity,
            head: AtomicU64::new(0),
            tail: AtomicU64::new(0),
            writer_closed: AtomicU64::new(0),
            reader_closed: AtomicU64::new(0),
            data_seq: AtomicU32::new(0),
            reader_sleeping: AtomicU32::new(0),
            space_seq: AtomicU32::new(0),
            writer_sleeping: AtomicU32::new(0),
            data: (0..capacity).map(|_| UnsafeCell::new(0)).collect(),
            data_futex: Futex::default(),
            space_futex: Futex::default(),
        }
    }

    fn futex(&self, word: &AtomicU32) -> &Futex {
        if std::ptr::eq(word, &self.data_seq) {
            &self.data_futex
        } else {
            assert!(std::ptr::eq(word, &self.space_seq), "futex on a word that is not a sequence word");
            &self.space_futex
        }
    }
}

impl Word64 for AtomicU64 {
    fn load(&self, order: Ordering) -> u64 {
        AtomicU64::load(self, order)
    }
    fn store(&self, value: u64, order: Ordering) {
        AtomicU64::store(self, value, order);
    }
}

impl Word32 for AtomicU32 {
    fn load(&self, order: Ordering) -> u32 {
        AtomicU32::load(self, order)
    }
    fn store(&self, value: u32, order: Ordering) {
        AtomicU32::store(self, value, order);
    }
    fn fetch_add(&self, value: u32, order: Ordering) -> u32 {
        AtomicU32::fetch_add(self, value, order)
    }
}

impl RingMemory for ModelRing {
    type W64 = AtomicU64;
    type W32 = AtomicU32;

    fn capacity(&self) -> usize {
        self.capacity
    }
    fn head_word(&self) -> &AtomicU64 {
        &self.head
    }
    fn tail_word(&self) -> &AtomicU64 {
        &self.tail
    }
    fn writer_closed_word(&self) -> &AtomicU64 {
        &self.writer_closed
    }
    fn reader_closed_word(&self) -> &AtomicU64 {
        &self.reader_closed
    }
    fn data_seq(&self) -> &AtomicU32 {
        &self.data_seq
    }
    fn reader_sleeping(&self) -> &AtomicU32 {
        &self.reader_sleeping
    }
    fn space_seq(&self) -> &AtomicU32 {
        &self.space_seq
    }
    fn writer_sleeping(&self) -> &AtomicU32 {
        &self.writer_sleeping
    }
    unsafe fn copy_in(&self, start: usize, src: &[u8]) {
        for (i, &byte) in src.iter().enumerate() {
            // SAFETY: loom checks that no other access to this cell races with this write.
            self.data[start + i].with_mut(|p| unsafe { *p = byte });
        }
    }
    unsafe fn copy_out(&self, start: usize, dst: &mut [MaybeUninit<u8>]) {
        for (i, out) in dst.iter_mut().enumerate() {
            // SAFETY: loom checks that this read is ordered after the cell's last write.
            out.write(self.data[start + i].with(|p| unsafe { *p }));
        }
    }
    fn fence_seqcst(&self) {
        loom::sync::atomic::fence(Ordering::SeqCst);
    }
    fn futex_wait(&self, word: &AtomicU32, expected: u32, _timeout: Duration) {
        // No timeout: a wake-up that never comes is a deadlock for loom to find.
        let futex = self.futex(word);
        let guard = futex.lock.lock().unwrap();
        if word.load(Ordering::Acquire) == expected {
            drop(futex.woken.wait(guard).unwrap());
        }
    }
    fn futex_wake(&self, word: &AtomicU32) {
        let futex = self.futex(word);
        let _guard = futex.lock.lock().unwrap();
        futex.woken.notify_all();
    }
}

/// The waits' timeout argument, unused by the model.
const FOREVER: Duration = Duration::from_secs(3600);

/// Checks `f` in every interleaving with at most `bound` preemptions (the classic lost wake-ups
/// need one or two; the bounds keep each model to about a second in a test build).
fn check(name: &str, bound: usize, f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(bound);
    let started = std::time::Instant::now();
    builder.check(f);
    eprintln!("loom model {name}: checked in {:?}", started.elapsed());
}

/// The writer's loop: writes `message` in steps of `step` bytes, waking the reader after each and
/// sleeping when the ring is full, then closes.
fn write_all(ring: &ModelRing, message: &[u8], step: usize) {
    let mut done = 0;
    while done < message.len() {
        let len = step.min(message.len() - done);
        let n = ring.write_some(Some(&message[done..done + len]), len);
        if n > 0 {
            done += n;
            ring.wake_reader();
            continue;
        }
        assert!(!ring.reader_closed(), "reader closed during the transfer");
        ring.sleep_for_space(FOREVER);
    }
    ring.close_writer();
}

/// The reader's loop: takes at most `step` bytes at a time, gives them back, sleeps when the ring
/// is empty, until the writer closed and everything is read.
fn read_all(ring: &ModelRing, step: usize) -> Vec<u8> {
    let mut rpos = 0u64;
    let mut got = Vec::new();
    loop {
        let available = ring.tail().wrapping_sub(rpos) as usize;
        if available > 0 {
            let n = available.min(step);
            let mut buf = vec![MaybeUninit::<u8>::uninit(); n];
            ring.read_at(rpos, &mut buf);
            // SAFETY: `read_at` initialised every byte.
            got.extend(buf.iter().map(|b| unsafe { b.assume_init() }));
            rpos += n as u64;
            ring.give_back(rpos);
            continue;
        }
        if ring.writer_closed() {
            // Everything published before the flag is visible now.
            if ring.tail() == rpos {
                return got;
            }
            continue;
        }
        ring.sleep_for_data(rpos, FOREVER);
    }
}

/// A transfer of `len` bytes through a ring of `capacity`, written in steps of `write_step` and
/// read in steps of `read_step`, checked to preemption bound `bound`.
fn transfer(capacity: usize, len: u8, write_step: usize, read_step: usize, bound: usize) {
    let name = format!("transfer of {len} bytes through {capacity}, steps {write_step}/{read_step}, bound {bound}");
    check(&name, bound, move || {
        let ring = Arc::new(ModelRing::new(capacity));
        let message: Vec<u8> = (1..=len).collect();
        let writer = {
            let (ring, message) = (Arc::clone(&ring), message.clone());
            loom::thread::spawn(move || write_all(&ring, &message, write_step))
        };
        let got = read_all(&ring, read_step);
        writer.join().unwrap();
        assert_eq!(got, message);
    });
}

// Goal: no lost wake-up and no torn read: a message through a ring smaller than it (so both sides
// must wait for each other, and the ring wraps) arrives whole and in order in every interleaving:
// 7 bytes through 4 (written in steps of 3, read in steps of 2) with up to 2 preemptions, and 3
// bytes through 2 (steps of 2 and 1) with up to 3 (about 4 s together in a test build).
#[test]
fn model_transfer_through_a_small_ring() {
    transfer(4, 7, 3, 2, 2);
    transfer(2, 3, 2, 1, 3);
}

/// Which side closes the ring in a close model.
#[derive(Clone, Copy, Debug)]
enum Closer {
    Writer,
    Reader,
}

fn close(ring: &ModelRing, closer: Closer) {
    match closer {
        Closer::Writer => ring.close_writer(),
        Closer::Reader => ring.close_reader(),
    }
}

// Goal: closing wakes both sides: a writer waiting on a full ring and a reader waiting on an empty
// one both return once either side's closed flag is set (the peer's link end, or this rank's
// abort, which closes its own rings to release its own sleepers).
#[test]
fn model_close_wakes_both_sides() {
    for closer in [Closer::Writer, Closer::Reader] {
        check(&format!("close by the {closer:?}, writer waiting"), 3, move || {
            let ring = Arc::new(ModelRing::new(4));
            assert_eq!(ring.write_some(Some(&[1, 2, 3, 4]), 4), 4);
            let writer = {
                let ring = Arc::clone(&ring);
                loom::thread::spawn(move || {
                    while ring.write_some(Some(&[5]), 1) == 0 {
                        if ring.reader_closed() || ring.writer_closed() {
                            return;
                        }
                        ring.sleep_for_space(FOREVER);
                    }
                    panic!("the ring had space although nobody read");
                })
            };
            close(&ring, closer);
            writer.join().unwrap();
        });
        check(&format!("close by the {closer:?}, reader waiting"), 3, move || {
            let ring = Arc::new(ModelRing::new(4));
            let reader = {
                let ring = Arc::clone(&ring);
                loom::thread::spawn(move || {
                    while ring.tail() == 0 {
                        if ring.reader_closed() || ring.writer_closed() {
                            return;
                        }
                        ring.sleep_for_data(0, FOREVER);
                    }
                    panic!("data appeared although nobody wrote");
                })
            };
            close(&ring, closer);
            reader.join().unwrap();
        });
    }
}

// Goal: the model is not vacuous: with the writer's fence taken out of the wake-up (announce and
// look without ordering), loom finds the lost wake-up.
#[test]
fn model_finds_a_lost_wake_up_without_the_fence() {
    struct NoFence(ModelRing);
    impl RingMemory for NoFence {
        type W64 = AtomicU64;
        type W32 = AtomicU32;
        fn capacity(&self) -> usize {
            self.0.capacity()
        }
        fn head_word(&self) -> &AtomicU64 {
            self.0.head_word()
        }
        fn tail_word(&self) -> &AtomicU64 {
            self.0.tail_word()
        }
        fn writer_closed_word(&self) -> &AtomicU64 {
            self.0.writer_closed_word()
        }
        fn reader_closed_word(&self) -> &AtomicU64 {
            self.0.reader_closed_word()
        }
        fn data_seq(&self) -> &AtomicU32 {
            self.0.data_seq()
        }
        fn reader_sleeping(&self) -> &AtomicU32 {
            self.0.reader_sleeping()
        }
        fn space_seq(&self) -> &AtomicU32 {
            self.0.space_seq()
        }
        fn writer_sleeping(&self) -> &AtomicU32 {
            self.0.writer_sleeping()
        }
        unsafe fn copy_in(&self, start: usize, src: &[u8]) {
            // SAFETY: forwarded with the caller's guarantee.
            unsafe { self.0.copy_in(start, src) }
        }
        unsafe fn copy_out(&self, start: usize, dst: &mut [MaybeUninit<u8>]) {
            // SAFETY: forwarded with the caller's guarantee.
            unsafe { self.0.copy_out(start, dst) }
        }
        fn fence_seqcst(&self) {}
        fn futex_wait(&self, word: &AtomicU32, expected: u32, timeout: Duration) {
            self.0.futex_wait(word, expected, timeout);
        }
        fn futex_wake(&self, word: &AtomicU32) {
            self.0.futex_wake(word);
        }
    }
    eprintln!("model_finds_a_lost_wake_up_without_the_fence: loom's deadlock report below is the expected finding");
    let found = std::panic::catch_unwind(|| {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(2);
        builder.check(|| {
            let ring = Arc::new(NoFence(ModelRing::new(4)));
            let writer = {
                let ring = Arc::clone(&ring);
                loom::thread::spawn(move || {
                    assert_eq!(ring.write_some(Some(&[1]), 1), 1);
                    ring.wake_reader();
                })
            };
            while ring.tail() == 0 {
                ring.sleep_for_data(0, FOREVER);
            }
            writer.join().unwrap();
        });
    });
    assert!(found.is_err(), "loom found no lost wake-up in a protocol without fences");
}
