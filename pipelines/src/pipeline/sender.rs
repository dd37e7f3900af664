//! [`SendQueue`]: a stage's outgoing activations and gradients, sent by a thread of their own so
//! the compute thread moves on to its next instruction instead of copying the message into frames
//! and waiting for the transport to take them.
//!
//! The compute thread hands over the payload it already owns (no copy); the sender thread puts the
//! mailbox's typed header in front ([`crate::pipeline::Mailbox`]'s frame format, unchanged) and
//! sends through the `pp` group. Messages go out in the order they were posted, so transfers
//! between a pair of ranks keep their call order, as if the compute thread had sent them itself;
//! [`SendQueue::flush`] waits until every posted message is with the transport, which the engine
//! does at the end of its instruction loop, before any other communication on the `pp` group.
//!
//! Back-pressure: at most [`SEND_QUEUE_MAX`] messages wait in the queue; posting to a full queue
//! blocks the compute thread (counted as sending in its timeline).
//!
//! Decision: the first failed send is kept and returned by the next [`SendQueue::post`],
//! [`SendQueue::check`] or [`SendQueue::flush`]; later messages are dropped, not sent out of
//! order. A failed send fails the step, as it did when the compute thread sent.
//!
//! [`SendQueue::inline`] has no thread: the compute thread sends each message as it posts it
//! (for a [`crate::ComputeDriver`] that schedules every thread itself, such as the simulator's).

use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::pipeline::blocking::BlockingGroup;
use crate::pipeline::mailbox::{frame, Key};

/// Messages that may wait for the sender thread before posting blocks.
pub const SEND_QUEUE_MAX: usize = 64;

/// A stage's queue of outgoing pipeline messages and the thread that sends them.
#[derive(Debug)]
pub struct SendQueue {
    /// The sender thread's queue; `None`: inline, [`SendQueue::inline`].
    jobs: Option<SyncSender<Job>>,
    /// The group an inline queue sends through.
    inline: Option<BlockingGroup>,
    shared: Arc<Shared>,
    rank: usize,
}

#[derive(Debug)]
struct Job {
    dst: usize,
    key: Key,
    payload: Vec<f32>,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    drained: Condvar,
}

#[derive(Debug, Default)]
struct State {
    /// Posted and not yet handed to the transport (or dropped after a failure).
    in_flight: usize,
    /// The first failed send, until reported.
    failed: Option<Error>,
    /// A failure happened (reported or not): the queue sends nothing more.
    broken: bool,
}

impl SendQueue {
    /// Starts the sender thread of group rank `group.rank()`; it ends when the queue is dropped
    /// and the messages already posted are sent.
    pub fn new(group: BlockingGroup) -> Result<SendQueue> {
        let rank = group.rank();
        let (jobs, queue) = sync_channel::<Job>(SEND_QUEUE_MAX);
        let shared = Arc::new(Shared::default());
        let worker = Arc::clone(&shared);
        std::thread::Builder::new()
            .name(format!("pp{rank}-send"))
            .spawn(move || {
                for job in queue {
                    let skip = lock(&worker.state).broken;
                    let result = if skip { Ok(()) } else { group.send(&frame(job.key, &job.payload), job.dst) };
                    let mut state = lock(&worker.state);
                    debug_assert!(state.in_flight > 0, "a send finished that was never posted");
                    state.in_flight = state.in_flight.saturating_sub(1);
                    if let Err(e) = result {
                        state.broken = true;
                        state.failed.get_or_insert(e);
                    }
                    drop(state);
                    worker.drained.notify_all();
                }
            })
            .map_err(Error::CommThread)?;
        Ok(SendQueue { jobs: Some(jobs), inline: None, shared, rank })
    }

    /// A queue without a thread: [`SendQueue::post`] sends on the caller's thread before it returns.
    pub fn inline(group: BlockingGroup) -> SendQueue {
        SendQueue { jobs: None, rank: group.rank(), inline: Some(group), shared: Arc::new(Shared::default()) }
    }

    /// This queue's group rank (messages to it are filed, not sent).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Queues `payload` for group rank `dst` under `key`; blocks while [`SEND_QUEUE_MAX`] messages
    /// wait. Fails with an earlier send's error.
    pub fn post(&self, dst: usize, key: Key, payload: Vec<f32>) -> Result<()> {
        assert_ne!(dst, self.rank, "{key:?}: a message to oneself is filed by the mailbox, not sent");
        if let Some(group) = &self.inline {
            report(&mut lock(&self.shared.state))?;
            return group.send(&frame(key, &payload), dst).inspect_err(|_| lock(&self.shared.state).broken = true);
        }
        {
            let mut state = lock(&self.shared.state);
            report(&mut state)?;
            state.in_flight += 1;
        }
        let Some(jobs) = &self.jobs else { return Err(self.gone()) };
        if jobs.send(Job { dst, key, payload }).is_err() {
            lock(&self.shared.state).in_flight -= 1;
            return Err(self.gone());
        }
        Ok(())
    }

    /// Fails with the error of a send that failed since the last report.
    pub fn check(&self) -> Result<()> {
        report(&mut lock(&self.shared.state))
    }

    /// Waits until every posted message is with the transport; fails with a failed send's error.
    pub fn flush(&self) -> Result<()> {
        let mut state = lock(&self.shared.state);
        while state.in_flight > 0 {
            state = self.shared.drained.wait(state).unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        report(&mut state)?;
        debug_assert_eq!(state.in_flight, 0);
        Ok(())
    }

    /// Messages posted and not yet with the transport.
    pub fn in_flight(&self) -> usize {
        lock(&self.shared.state).in_flight
    }

    fn gone(&self) -> Error {
        Error::Pipeline { reason: format!("the send thread of pipeline rank {} is gone", self.rank) }
    }
}

/// The unreported failure, or a plain one once it was reported.
fn report(state: &mut State) -> Result<()> {
    if let Some(e) = state.failed.take() {
        return Err(e);
    }
    if state.broken {
        return Err(Error::Pipeline { reason: "an earlier pipeline send failed; later messages were not sent".into() });
    }
    Ok(())
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh::{Mesh, MeshGroups, MeshShape};
    use crate::pipeline::mailbox::{Kind, Mailbox};
    use rtx_collectives::{CommConfig, Endpoint, InProcessNetwork, Transport};

    /// The `pp` groups of a two-stage pipeline over the in-process transport, and their runtime.
    fn two_stages() -> (tokio::runtime::Runtime, Vec<Endpoint>, Vec<BlockingGroup>) {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let (_net, transports) = InProcessNetwork::new(2);
        let mesh = Mesh::new(MeshShape { dp: 1, pp: 2, tp: 1 }, 2).unwrap();
        let _guard = runtime.enter();
        let mut endpoints = Vec::new();
        let mut groups = Vec::new();
        for transport in transports {
            let endpoint = Endpoint::new(Arc::new(transport) as Arc<dyn Transport>, CommConfig::default()).unwrap();
            let mesh_groups = MeshGroups::new(&endpoint, mesh, 0).unwrap();
            groups.push(BlockingGroup::new(mesh_groups.pp.clone(), runtime.handle().clone(), "pp"));
            endpoints.push(endpoint);
        }
        (runtime, endpoints, groups)
    }

    fn activation(mb: usize) -> Key {
        Key { kind: Kind::Activation, microbatch: mb, stage: 1 }
    }

    #[test]
    fn posted_messages_arrive_whole_in_order_and_before_what_is_sent_after_a_flush() {
        // Goal: what a stage posts reaches the peer's mailbox with its header (taken out of order
        // there), a message to oneself is filed without a thread, and a flush puts every posted
        // message on the wire before a plain send that follows it on the same channel.
        let (_runtime, _endpoints, groups) = two_stages();
        let (g0, g1) = (groups[0].clone(), groups[1].clone());
        let payload = |mb: usize| (0..1000).map(|i| (mb * 1000 + i) as f32 * 0.5).collect::<Vec<f32>>();
        let receiver = std::thread::spawn(move || {
            let mut mailbox = Mailbox::default();
            let taken: Vec<Vec<f32>> = (0..3).rev().map(|mb| mailbox.take(&g1, 0, activation(mb), 1000).unwrap()).collect();
            let mut after = [0f32; 3];
            g1.recv(&mut after, 0).unwrap();
            (taken, after, mailbox.pending())
        });
        let queue = SendQueue::new(g0.clone()).unwrap();
        let mut mailbox = Mailbox::default();
        for mb in 0..3 {
            mailbox.post(&queue, 1, activation(mb), payload(mb)).unwrap();
        }
        mailbox.post(&queue, 0, Key { kind: Kind::Gradient, microbatch: 7, stage: 0 }, vec![1.0, 2.0]).unwrap();
        queue.flush().unwrap();
        assert_eq!(queue.in_flight(), 0);
        g0.send(&[9.0f32, 8.0, 7.0], 1).unwrap();
        let (taken, after, pending) = receiver.join().unwrap();
        assert_eq!(taken, vec![payload(2), payload(1), payload(0)]);
        assert_eq!(after, [9.0, 8.0, 7.0]);
        assert_eq!(pending, 0);
        assert_eq!(mailbox.take(&g0, 0, Key { kind: Kind::Gradient, microbatch: 7, stage: 0 }, 2).unwrap(), vec![1.0, 2.0]);
    }

    #[test]
    fn an_inline_queue_sends_before_post_returns_and_refuses_posts_after_a_failure() {
        // Goal: the thread-less queue (the simulator's) delivers in posting order with the same
        // frames, and after a failed send it sends nothing more.
        let (_runtime, _endpoints, groups) = two_stages();
        let g1 = groups[1].clone();
        let receiver = std::thread::spawn(move || {
            let mut mailbox = Mailbox::default();
            (0..2).map(|mb| mailbox.take(&g1, 0, activation(mb), 2).unwrap()).collect::<Vec<_>>()
        });
        let queue = SendQueue::inline(groups[0].clone());
        queue.post(1, activation(0), vec![1.0, 2.0]).unwrap();
        assert_eq!(queue.in_flight(), 0);
        queue.post(1, activation(1), vec![3.0, 4.0]).unwrap();
        queue.flush().unwrap();
        assert_eq!(receiver.join().unwrap(), vec![vec![1.0, 2.0], vec![3.0, 4.0]]);
        let err = queue.post(5, activation(2), vec![1.0]).unwrap_err();
        assert!(matches!(err, Error::Group { op: "send", role: "pp", .. }), "{err}");
        assert!(matches!(queue.post(1, activation(3), vec![1.0]), Err(Error::Pipeline { .. })));
    }

    #[test]
    fn a_failed_send_is_reported_once_typed_and_then_refuses_every_post() {
        // Goal: a send that fails on the sender thread comes back as the group's error on the next
        // flush, and the queue sends nothing after it (later posts fail instead of reordering).
        let (_runtime, _endpoints, groups) = two_stages();
        let queue = SendQueue::new(groups[0].clone()).unwrap();
        queue.post(5, activation(0), vec![1.0]).unwrap();
        let err = queue.flush().unwrap_err();
        assert!(matches!(err, Error::Group { op: "send", role: "pp", .. }), "{err}");
        assert!(matches!(queue.post(1, activation(1), vec![1.0]), Err(Error::Pipeline { .. })));
        assert!(queue.check().is_err() && queue.flush().is_err());
        assert_eq!(queue.in_flight(), 0);
    }
}
