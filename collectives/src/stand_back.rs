//! Reader threads that stand back while operations read for themselves.
//!
//! The shared-memory and TLS transports each have reader threads that take arrived frames and
//! deliver them, and both let an operation about to wait for a frame read it itself instead
//! ([`crate::Transport::poll_incoming`]): one cross-thread wake-up less, most of a small
//! collective's time. While operations do that, the readers would only compete with them for the
//! same bytes (and cost wake-up calls), so they stand back: a reader that sees polls since it last
//! looked, while an operation is still polling, parks for at most [`POLLED_NAP`] and looks again.
//! An operation that stops polling to sleep ([`crate::Transport::poll_ended`]) wakes them, so no
//! frame waits for a nap to pass once nobody polls; and since a reader only stands back while the
//! poll count moves, frames are always delivered even if a poller disappears without a word.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::thread::Thread;
use std::time::Duration;

use crate::sync::lock;

/// Longest a reader thread stands back before it looks again.
pub(crate) const POLLED_NAP: Duration = Duration::from_millis(5);

/// The operations polling one set of reader threads' sources (a shared-memory transport's rings,
/// or one TLS link's connections), and those reader threads.
#[derive(Default)]
pub(crate) struct PollingOperations {
    /// Calls of `poll_incoming` so far: while it moves and `polling` is set, readers stand back.
    polls: AtomicU64,
    /// Set by a poll, cleared when an operation stops polling.
    polling: AtomicBool,
    /// The reader threads, to wake when operations stop polling.
    readers: Mutex<Vec<Thread>>,
}

impl PollingOperations {
    /// An operation polls (called by `poll_incoming` before it reads).
    pub(crate) fn note_poll(&self) {
        self.polls.fetch_add(1, Ordering::Relaxed);
        if !self.polling.load(Ordering::Relaxed) {
            self.polling.store(true, Ordering::SeqCst);
        }
    }

    /// Polls so far, for a reader's [`Watch`] and for waits that end when an operation polls.
    pub(crate) fn polls(&self) -> u64 {
        self.polls.load(Ordering::Relaxed)
    }

    /// An operation stops polling (to sleep, or to wait for something else): the readers read
    /// again, woken now if they stand back.
    pub(crate) fn stop(&self) {
        if self.polling.swap(false, Ordering::SeqCst) {
            self.wake_readers();
        }
    }

    /// Wakes the reader threads (to stand back no longer, or to see that a source ended).
    pub(crate) fn wake_readers(&self) {
        for reader in lock(&self.readers).iter() {
            reader.unpark();
        }
    }

    /// Registers the calling thread as one of the readers and returns its watch.
    pub(crate) fn join_as_reader(&self) -> Watch<'_> {
        lock(&self.readers).push(std::thread::current());
        Watch { operations: self, polls_seen: self.polls() }
    }
}

/// One reader thread's view of the polling operations.
pub(crate) struct Watch<'a> {
    operations: &'a PollingOperations,
    polls_seen: u64,
}

impl Watch<'_> {
    /// Whether operations polled since the last look and still poll: then the reader should
    /// [`nap`](Self::nap) instead of reading.
    pub(crate) fn operations_poll(&mut self) -> bool {
        let polls = self.operations.polls();
        let polled = polls != self.polls_seen;
        self.polls_seen = polls;
        polled && self.operations.polling.load(Ordering::SeqCst)
    }

    /// Polls as of the last look (shared memory's reader waits until they move).
    #[cfg(feature = "shm")]
    pub(crate) fn polls_seen(&self) -> u64 {
        self.polls_seen
    }

    /// Stands back: parks until an operation stops polling or [`POLLED_NAP`] passes.
    pub(crate) fn nap(&self) {
        std::thread::park_timeout(POLLED_NAP);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    // Goal: a reader stands back only while polls move and an operation still polls.
    #[test]
    fn readers_stand_back_only_while_polls_move() {
        let operations = PollingOperations::default();
        let mut watch = operations.join_as_reader();
        assert!(!watch.operations_poll(), "nobody polled yet");
        operations.note_poll();
        assert!(watch.operations_poll(), "a poll since the last look");
        assert!(!watch.operations_poll(), "no poll since the last look: read again");
        operations.note_poll();
        operations.stop();
        assert!(!watch.operations_poll(), "the operation stopped polling");
    }

    // Goal: an operation that stops polling wakes the readers at once (a reader parked far longer
    // than a nap is woken, not left to its timeout).
    #[test]
    fn stopping_wakes_the_readers() {
        let operations = Arc::new(PollingOperations::default());
        operations.note_poll();
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = {
            let operations = Arc::clone(&operations);
            std::thread::spawn(move || {
                let _watch = operations.join_as_reader();
                tx.send(()).ok();
                let start = Instant::now();
                while operations.polling.load(Ordering::SeqCst) && start.elapsed() < Duration::from_secs(20) {
                    std::thread::park_timeout(Duration::from_secs(20));
                }
                start.elapsed()
            })
        };
        rx.recv().ok();
        operations.stop();
        let parked = reader.join().unwrap_or(Duration::MAX);
        assert!(parked < Duration::from_secs(10), "the reader stayed parked {parked:?} after the operation stopped");
    }
}
