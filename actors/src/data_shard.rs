//! The `DataShard` role: serves the training batches of one rank and prefetches the next one on
//! its own thread while the worker computes. Which samples make up a batch is the
//! [`BatchSource`]'s business and must be a pure function of `(step, rank, world)`: the global
//! batch of a step is the same whatever the world size, and each rank takes its part, so after
//! the world shrinks or grows no sample of an epoch is skipped or seen twice.
//!
//! The shard's mailbox holds one request: it works at most one batch ahead.
//!
//! [`DataShard::inline`] makes a shard without a thread that computes each batch when asked, for
//! runtimes that must not start OS threads (the deterministic simulator); the batches are the same.

use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::error::{ActorError, Result};

/// Where batches come from.
pub trait BatchSource: Send + Sync + 'static {
    /// A batch, ready for the forward pass.
    type Batch: Send + 'static;

    /// This rank's part of global batch `step` when the world has `world` ranks.
    fn batch(&self, step: u64, rank: usize, world: usize) -> std::result::Result<Self::Batch, String>;
}

type Key = (u64, usize, usize);

/// A rank's data shard: one batch ahead, on its own thread.
pub struct DataShard<S: BatchSource> {
    /// Set for an inline shard: batches are computed on `get`, on the caller's thread.
    inline: Option<Arc<S>>,
    requests: Option<SyncSender<Key>>,
    batches: Receiver<(Key, std::result::Result<S::Batch, String>)>,
    in_flight: Option<Key>,
    thread: Option<JoinHandle<()>>,
}

impl<S: BatchSource> DataShard<S> {
    /// Starts the shard's thread over `source`.
    pub fn start(source: Arc<S>) -> Result<Self> {
        let (requests, inbox) = mpsc::sync_channel::<Key>(1);
        let (outbox, batches) = mpsc::sync_channel(1);
        let thread = std::thread::Builder::new()
            .name("data-shard".into())
            .spawn(move || {
                while let Ok(key) = inbox.recv() {
                    let (step, rank, world) = key;
                    if outbox.send((key, source.batch(step, rank, world))).is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| ActorError::Failed { name: "data-shard".into(), reason: format!("cannot start its thread: {e}") })?;
        Ok(DataShard { inline: None, requests: Some(requests), batches, in_flight: None, thread: Some(thread) })
    }

    /// A shard without a thread: each batch is computed by `get` itself, nothing ahead.
    pub fn inline(source: Arc<S>) -> Self {
        let (_, batches) = mpsc::sync_channel(1);
        DataShard { inline: Some(source), requests: None, batches, in_flight: None, thread: None }
    }

    /// This rank's part of global batch `step`, then starts preparing `step + 1`.
    pub fn get(&mut self, step: u64, rank: usize, world: usize) -> Result<S::Batch> {
        let key = (step, rank, world);
        if let Some(source) = &self.inline {
            return source.batch(step, rank, world).map_err(|reason| ActorError::Failed { name: "data-shard".into(), reason: format!("batch {step} (rank {rank} of {world}): {reason}") });
        }
        if self.in_flight != Some(key) {
            if self.in_flight.take().is_some() {
                // A prefetch for another step or world: drain it.
                let _stale = self.receive()?;
            }
            self.request(key)?;
        }
        self.in_flight = None;
        let (got, batch) = self.receive()?;
        debug_assert_eq!(got, key);
        let next = (step + 1, rank, world);
        self.request(next)?;
        self.in_flight = Some(next);
        batch.map_err(|reason| ActorError::Failed { name: "data-shard".into(), reason: format!("batch {step} (rank {rank} of {world}): {reason}") })
    }

    fn request(&self, key: Key) -> Result<()> {
        self.requests.as_ref().ok_or_else(stopped)?.send(key).map_err(|_| stopped())
    }

    fn receive(&self) -> Result<(Key, std::result::Result<S::Batch, String>)> {
        self.batches.recv().map_err(|_| stopped())
    }
}

impl<S: BatchSource> Drop for DataShard<S> {
    fn drop(&mut self) {
        self.requests = None;
        // Unblock a send of a prefetched batch nobody will take.
        while self.batches.try_recv().is_ok() {}
        if let Some(thread) = self.thread.take() {
            drop(std::mem::replace(&mut self.batches, mpsc::sync_channel(1).1));
            let _ = thread.join();
        }
    }
}

fn stopped() -> ActorError {
    ActorError::Stopped { name: "data-shard".into() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Squares(AtomicUsize);
    impl BatchSource for Squares {
        type Batch = Vec<u64>;
        fn batch(&self, step: u64, rank: usize, world: usize) -> std::result::Result<Vec<u64>, String> {
            self.0.fetch_add(1, Ordering::SeqCst);
            if step == 99 {
                return Err("no such batch".into());
            }
            // Global batch of 8 items, rank's contiguous part.
            let items: Vec<u64> = (0..8).map(|i| step * 8 + i).collect();
            let per = items.len().div_ceil(world);
            Ok(items.chunks(per).nth(rank).map(<[u64]>::to_vec).unwrap_or_default())
        }
    }

    #[test]
    fn serves_in_order_prefetches_and_follows_world_changes() {
        let source = Arc::new(Squares(AtomicUsize::new(0)));
        let mut shard = DataShard::start(source.clone()).unwrap();
        assert_eq!(shard.get(0, 0, 2).unwrap(), vec![0, 1, 2, 3]);
        assert_eq!(shard.get(1, 0, 2).unwrap(), vec![8, 9, 10, 11]);
        // The world shrank: the prefetched batch is dropped and the right one computed.
        assert_eq!(shard.get(2, 0, 1).unwrap(), (16..24).collect::<Vec<_>>());
        let err = shard.get(99, 0, 1).unwrap_err();
        assert!(err.to_string().contains("no such batch"), "{err}");
        drop(shard);
        assert!(source.0.load(Ordering::SeqCst) >= 5);
    }

    // Goal: an inline shard serves the same batches with no thread and no prefetch.
    #[test]
    fn inline_serves_the_same_batches() {
        let source = Arc::new(Squares(AtomicUsize::new(0)));
        let mut shard = DataShard::inline(source.clone());
        assert_eq!(shard.get(0, 0, 2).unwrap(), vec![0, 1, 2, 3]);
        assert_eq!(shard.get(2, 0, 1).unwrap(), (16..24).collect::<Vec<_>>());
        assert_eq!(source.0.load(Ordering::SeqCst), 2);
    }
}
