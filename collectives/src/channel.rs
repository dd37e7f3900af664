//! Channels: one large ring all-reduce run as several independent rings over contiguous parts of
//! the buffer, each driven by its own OS thread where the runtime allows, so the user-space work of
//! a rank (copying the caller's data into frames, combining received pieces, copying results out)
//! runs on several cores at once, as NCCL's channels do.
//!
//! Identity on the wire. An operation split into `k` channels takes `k` consecutive sequence
//! numbers (`GroupState::begin_collectives`); channel `c` is an ordinary ring operation with
//! sequence `seq + c` over part `c` of the buffer ([`part_range`]), so frames are matched by
//! (generation, lane, source, sequence, chunk) exactly as for one ring and chunk counters stay per
//! channel. Every frame of a split operation names `k` (header byte 53, see [`crate::frame`]); a
//! rank that split it differently fails with [`Error::ChannelMismatch`] on its first frame from a
//! disagreeing peer (or, for a channel no peer runs, by the operation timeout), never by matching a
//! frame of another shape. `k` comes from the config and the buffer size alone
//! (`Communicator::all_reduce_channels`), so equal configs agree; there is no config exchange at
//! group formation to check it against earlier.
//!
//! Determinism. Each channel's ring reduces its part in the rank order of one ring, so the bits of
//! every element depend only on the inputs, `k` and the config (`k` decides which ring segment an
//! element falls in, hence its summation order: results for different `k` may differ in the last
//! bits, results for one `k` never do). How the channels are driven (threads or one task) changes
//! nothing on the wire.
//!
//! Execution. Constraints: the caller's buffer is borrowed, so a thread touching it must be joined
//! before the operation returns, even if its future is dropped; a scoped thread
//! (`std::thread::scope`) gives that, but only by blocking the calling thread until the channels
//! end; and the calling thread may be the one that drives quinn's connections (a current-thread
//! runtime), which must not be blocked. Choice:
//! - On a multi-thread tokio runtime, the calling task gives its worker up
//!   (`tokio::task::block_in_place`, so the runtime's other tasks, quinn's drivers among them, move
//!   to another worker), runs channel 0 on its own thread and channels `1..k` on scoped threads,
//!   each with `Handle::block_on` (frames are pushed to their receives by the transport's reader
//!   tasks through `EventSink` and the group's oneshot channels, whose wake-ups work from any
//!   thread; timers and spawned abort notices use the entered runtime), and joins them all.
//! - On a current-thread runtime (or outside one), the `k` channels are futures joined on the
//!   calling task: same frames and bits, no extra cores.
//!
//! Pros: safe Rust only, the buffer is never touched after return (the threads are scoped),
//! cancellation is moot on the threaded path (the whole operation runs inside one blocking call),
//! and both runtime flavours run the same protocol. Cons: `k - 1` threads are started per
//! operation (tens of microseconds, against milliseconds of a multi-MiB all-reduce); on a
//! current-thread runtime channels add no parallelism. Rejected: running every channel on
//! helper threads while the calling task awaits them, which would suit a current-thread runtime,
//! needs the threads to outlive a borrow the future cannot pin (a leaked future would leave them
//! writing into freed memory), so it would take `unsafe` that is not sound.
//!
//! Failures. A channel that fails marks the operation failed ([`ChannelState`]); its siblings stop
//! at their next wait and are dropped (withdrawing their posted receives), and when the cause was a
//! lost member, each of them tells the group as the failing channel does (`OpCtx::relay_loss`), so
//! peers blocked on any channel fail fast too. The operation returns the error of the
//! lowest-numbered channel that failed by itself, after every channel has ended.

use std::future::Future;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use futures_util::future::join_all;

use tokio::runtime::{Handle, RuntimeFlavor};
use tokio::sync::Notify;

use crate::error::{Error, Result};
use crate::op::segment_range;

/// Most channels one operation may be split into ([`crate::CommConfig::channels`]).
pub const MAX_CHANNELS: usize = 16;
/// Default channel count when neither the config nor the transport names one
/// ([`crate::Transport::preferred_channels`]): one ring.
pub const DEFAULT_CHANNELS: usize = 1;

// The count travels in one header byte.
const _: () = assert!(MAX_CHANNELS <= u8::MAX as usize && DEFAULT_CHANNELS >= 1 && DEFAULT_CHANNELS <= MAX_CHANNELS);

/// The element range channel `c` of `k` works on in a buffer of `len` elements: contiguous parts
/// that tile the buffer, the first `len % k` one element longer.
pub(crate) fn part_range(len: usize, k: usize, c: usize) -> Range<usize> {
    segment_range(len, k, c)
}

/// What the channels of one operation share: whether one of them failed, and the lost member it
/// named, if that was the cause.
#[derive(Debug, Default)]
pub(crate) struct ChannelState {
    failed: AtomicBool,
    lost: Mutex<Option<usize>>,
    notify: Notify,
}

impl ChannelState {
    /// A channel failed with `error`: its siblings stop at their next wait.
    fn fail(&self, error: &Error) {
        if let Error::PeerLost { rank, .. } = error {
            self.lost.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).get_or_insert(*rank);
        }
        self.failed.store(true, Ordering::Release);
        self.notify.notify_waiters();
    }

    /// The lost member a failed channel named.
    pub(crate) fn lost(&self) -> Option<usize> {
        *self.lost.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Completes once a channel failed.
    async fn failed(&self) {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            // Registered before the flag is read, so a failure in between is not missed.
            notified.as_mut().enable();
            if self.failed.load(Ordering::Acquire) {
                return;
            }
            notified.await;
        }
    }
}

/// Runs one channel: `None` when it was stopped because a sibling failed.
async fn run_one(state: &ChannelState, body: impl Future<Output = Result<()>>) -> Option<Result<()>> {
    tokio::select! {
        biased;
        result = body => {
            if let Err(error) = &result {
                state.fail(error);
            }
            Some(result)
        }
        () = state.failed() => None,
    }
}

/// Runs `body(ctx, part)` for every channel's context and part (see the module doc for on which
/// threads) and returns once all have ended: `Ok` if all succeeded, else the error of the
/// lowest-numbered channel that failed by itself. Each `ctx` (an [`OpCtx`](crate::op::OpCtx))
/// must carry `state` ([`OpCtx::with_channels`](crate::op::OpCtx::with_channels)).
pub(crate) async fn run<C, P, F, Fut>(state: &ChannelState, work: Vec<(C, P)>, body: F) -> Result<()>
where
    C: Send,
    P: Send,
    F: Fn(C, P) -> Fut + Sync,
    Fut: Future<Output = Result<()>> + Send,
{
    debug_assert!(work.len() >= 2, "a split operation has several channels");
    let threaded = Handle::try_current().ok().filter(|handle| handle.runtime_flavor() == RuntimeFlavor::MultiThread);
    let results = match threaded {
        Some(handle) => tokio::task::block_in_place(|| on_threads(&handle, state, work, &body)),
        None => join_all(work.into_iter().map(|(ctx, part)| run_one(state, body(ctx, part)))).await,
    };
    debug_assert!(results.iter().all(Option::is_some) || results.iter().any(|r| matches!(r, Some(Err(_)))), "a channel stops only after another failed");
    results.into_iter().flatten().find(Result::is_err).unwrap_or(Ok(()))
}

/// The threaded path of [`run`]: channel 0 on the calling thread, the others on scoped threads;
/// a channel whose thread cannot be started runs on the calling thread beside channel 0.
fn on_threads<C, P, F, Fut>(handle: &Handle, state: &ChannelState, work: Vec<(C, P)>, body: &F) -> Vec<Option<Result<()>>>
where
    C: Send,
    P: Send,
    F: Fn(C, P) -> Fut + Sync,
    Fut: Future<Output = Result<()>> + Send,
{
    let k = work.len();
    // Each channel's future waits in a slot until a thread takes it: one whose thread did not
    // start is still there for the calling thread.
    let slots: Vec<Mutex<Option<Fut>>> = work.into_iter().map(|(ctx, part)| Mutex::new(Some(body(ctx, part)))).collect();
    let take = |c: usize| slots[c].lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
    let span = tracing::Span::current();
    std::thread::scope(|scope| {
        let mut threads = Vec::with_capacity(k - 1);
        let mut local = vec![0];
        for c in 1..k {
            let (take, span) = (&take, span.clone());
            let spawned = std::thread::Builder::new().name(format!("rtx-channel-{c}")).spawn_scoped(scope, move || {
                let fut = take(c)?;
                Some(span.in_scope(|| handle.block_on(run_one(state, fut))))
            });
            match spawned {
                Ok(thread) => threads.push((c, thread)),
                Err(error) => {
                    tracing::warn!(channel = c, %error, "channel thread not started; it runs on the calling thread");
                    local.push(c);
                }
            }
        }
        let mut results: Vec<Option<Result<()>>> = (0..k).map(|_| None).collect();
        let local: Vec<(usize, Fut)> = local.into_iter().filter_map(|c| take(c).map(|fut| (c, fut))).collect();
        let (indices, futs): (Vec<usize>, Vec<Fut>) = local.into_iter().unzip();
        let local_results = handle.block_on(join_all(futs.into_iter().map(|fut| run_one(state, fut))));
        for (c, result) in indices.into_iter().zip(local_results) {
            results[c] = result;
        }
        for (c, thread) in threads {
            match thread.join() {
                Ok(result) => results[c] = result.flatten(),
                // A panic in a channel is a bug: surface it on the caller.
                Err(payload) => std::panic::resume_unwind(payload),
            }
        }
        results
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    // Goal: channel parts tile the buffer in order, for awkward sizes and counts.
    #[test]
    fn parts_tile() {
        for len in [0usize, 1, 5, 64, 1001] {
            for k in 1..=MAX_CHANNELS {
                let mut next = 0;
                for c in 0..k {
                    let r = part_range(len, k, c);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    // Goal: a failure wakes a waiter registered before it and one that comes after it.
    #[tokio::test]
    async fn failure_reaches_every_sibling() {
        let state = ChannelState::default();
        let early = run_one(&state, std::future::pending());
        let failing = run_one(&state, async { Err(Error::PeerLost { rank: 3, op: crate::OpKind::AllReduce }) });
        let results = join_all(vec![Box::pin(early) as std::pin::Pin<Box<dyn Future<Output = _>>>, Box::pin(failing)]).await;
        assert!(results[0].is_none());
        assert!(matches!(results[1], Some(Err(Error::PeerLost { rank: 3, .. }))));
        assert_eq!(state.lost(), Some(3));
        assert!(run_one(&state, std::future::pending()).await.is_none());
    }

    /// Runs `k` channels that record their thread and returns the distinct threads seen.
    async fn threads_of(k: usize) -> std::collections::BTreeSet<String> {
        let state = ChannelState::default();
        let seen = Mutex::new(Vec::new());
        let work: Vec<(usize, ())> = (0..k).map(|c| (c, ())).collect();
        run(&state, work, |c, ()| {
            let seen = &seen;
            async move {
                tokio::task::yield_now().await;
                seen.lock().unwrap().push((c, format!("{:?}", std::thread::current().id())));
                Ok(())
            }
        })
        .await
        .unwrap();
        let seen = seen.into_inner().unwrap();
        assert_eq!(seen.len(), k, "every channel ran once");
        seen.into_iter().map(|(_, thread)| thread).collect()
    }

    // Goal: on a multi-thread runtime every channel runs on a thread of its own; on a
    // current-thread runtime all run on the calling thread.
    #[test]
    fn channels_get_threads_where_the_runtime_allows() {
        let multi = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        assert_eq!(multi.block_on(async { tokio::spawn(threads_of(4)).await.unwrap() }).len(), 4);
        let current = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        assert_eq!(current.block_on(threads_of(4)).len(), 1);
    }

    // Goal: an error of one channel is the operation's error; the lowest-numbered one wins.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn lowest_failing_channel_wins() {
        let state = ChannelState::default();
        let work: Vec<(usize, ())> = (0..3).map(|c| (c, ())).collect();
        let result = run(&state, work, |c, ()| async move {
            match c {
                0 => Ok(()),
                c => Err(Error::PeerLost { rank: c, op: crate::OpKind::AllReduce }),
            }
        })
        .await;
        assert!(matches!(result, Err(Error::PeerLost { rank: 1 | 2, .. })), "{result:?}");
    }
}
