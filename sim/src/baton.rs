//! [`Baton`]: the simulator's [`ComputeDriver`]. A model-parallel member trains on compute threads
//! (tensor-parallel layers and pipeline stages communicate inside forward and backward, which are
//! plain functions), but the simulator has one runtime thread with virtual time, whose schedule
//! must be a function of the seed. So exactly one thread runs at a time: the runtime thread or one
//! compute thread, which holds the baton.
//!
//! - Starting a compute thread ([`ComputeDriver::spawn`]) returns a future. Each time the runtime
//!   polls it, it hands the baton to the thread and blocks the runtime thread until the thread
//!   gives it back: when its communication future is pending, or when its work is done.
//! - On a compute thread, [`ComputeDriver::block_on`] polls the communication future itself (in
//!   the runtime's context, so its timers are virtual). Pending: it gives the baton back and waits.
//!   The future's waker wakes the runtime-side future, which the runtime then polls in its
//!   deterministic order, and which hands the baton back to the thread.
//! - Virtual time cannot move while a compute thread works: the runtime thread is blocked, so it
//!   cannot park and advance the paused clock. A step's compute costs no virtual time. (Code on a
//!   compute thread sees virtual time only inside a driven future: outside the runtime's context
//!   tokio's clock is the wall clock.)
//! - A node killed mid-step drops the runtime-side future: the drop tells the thread its step is
//!   abandoned (every later `block_on` fails at once, so the step unwinds with an error) and waits
//!   for the thread to end, still holding the runtime thread, so nothing runs beside it.
//!
//! Helper threads beside a compute thread are not allowed ([`ComputeDriver::side_threads`] is
//! false): a pipeline stage sends inline.

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Wake, Waker};

use rtx_pipelines::{ComputeDone, ComputeDriver};
use tokio::runtime::Handle;
use tokio::sync::Notify;

/// Who holds the baton of one compute thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Holder {
    /// The runtime thread; the compute thread waits (not started, or its future is pending).
    Runtime,
    /// The compute thread runs; the runtime thread waits.
    Compute,
    /// The runtime side abandoned the step (its future was dropped): every wait of the compute
    /// thread fails at once until its work returns.
    Abandoned,
    /// The compute thread's work returned (`true`: it panicked).
    Done { panicked: bool },
}

/// One compute thread's baton and the wake-up of its runtime-side future. `holder` is the whole
/// state, under one lock with one condition variable: `Runtime` and `Compute` alternate;
/// the runtime side moves `Runtime` to `Abandoned` (dropped future); the compute thread moves any
/// state to `Done` when its work returns, and nothing leaves `Done`.
#[derive(Debug)]
struct Turn {
    holder: Mutex<Holder>,
    changed: Condvar,
    /// Woken by the compute thread's communication futures.
    wake: Notify,
}

impl Turn {
    fn lock(&self) -> MutexGuard<'_, Holder> {
        self.holder.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runtime side: gives the baton to the compute thread and waits until it comes back.
    fn run_compute(&self) -> Holder {
        let mut holder = self.lock();
        if *holder == Holder::Runtime {
            *holder = Holder::Compute;
            self.changed.notify_all();
        }
        while *holder == Holder::Compute {
            holder = self.changed.wait(holder).unwrap_or_else(PoisonError::into_inner);
        }
        *holder
    }

    /// Compute side: gives the baton back and waits for it (false: the step was abandoned).
    fn yield_to_runtime(&self) -> bool {
        let mut holder = self.lock();
        debug_assert_eq!(*holder, Holder::Compute, "a compute thread yields only a baton it holds");
        *holder = Holder::Runtime;
        self.changed.notify_all();
        drop(holder);
        self.wait_for_baton()
    }

    /// Compute side: waits until the thread holds the baton (false: the step was abandoned).
    fn wait_for_baton(&self) -> bool {
        let mut holder = self.lock();
        while *holder == Holder::Runtime {
            holder = self.changed.wait(holder).unwrap_or_else(PoisonError::into_inner);
        }
        *holder == Holder::Compute
    }

    fn finish(&self, panicked: bool) {
        *self.lock() = Holder::Done { panicked };
        self.changed.notify_all();
    }
}

/// Wakes a compute thread's runtime-side future.
struct WakeTurn(Arc<Turn>);

impl Wake for WakeTurn {
    fn wake(self: Arc<Self>) {
        self.0.wake.notify_one();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.wake.notify_one();
    }
}

thread_local! {
    /// The baton of the compute thread this is, if it is one.
    static CURRENT: RefCell<Option<Arc<Turn>>> = const { RefCell::new(None) };
}

/// The simulator's compute driver over the runtime of `handle` (see the module doc).
#[derive(Clone, Debug)]
pub struct Baton {
    handle: Handle,
}

impl Baton {
    /// A driver for compute threads of the (single-thread, paused-clock) runtime of `handle`.
    pub fn new(handle: Handle) -> Baton {
        Baton { handle }
    }
}

/// Abandons a step whose runtime-side future is dropped before the work ended, and waits for it.
struct AbandonOnDrop {
    turn: Arc<Turn>,
    done: bool,
}

impl Drop for AbandonOnDrop {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut holder = self.turn.lock();
        // The runtime thread drops the future, so it holds the baton (or the work is done).
        debug_assert!(matches!(*holder, Holder::Runtime | Holder::Done { .. }), "abandoned in {:?}", *holder);
        if *holder == Holder::Runtime {
            *holder = Holder::Abandoned;
        }
        self.turn.changed.notify_all();
        // The thread unwinds its step (every wait fails at once) while the runtime thread waits.
        while !matches!(*holder, Holder::Done { .. }) {
            holder = self.turn.changed.wait(holder).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

impl ComputeDriver for Baton {
    fn block_on(&self, mut future: Pin<&mut dyn Future<Output = ()>>) -> rtx_pipelines::Result<()> {
        let turn = CURRENT.with(|current| current.borrow().clone()).ok_or_else(|| rtx_pipelines::Error::Pipeline {
            reason: "the simulator's driver waited on a thread it did not start (helper threads beside a compute thread are not simulated)".into(),
        })?;
        let abandoned = || rtx_pipelines::Error::Pipeline { reason: "the simulated node of this compute thread was killed".into() };
        let waker = Waker::from(Arc::new(WakeTurn(Arc::clone(&turn))));
        let mut cx = Context::from_waker(&waker);
        loop {
            if *turn.lock() == Holder::Abandoned {
                return Err(abandoned());
            }
            let polled = {
                let _runtime = self.handle.enter();
                future.as_mut().poll(&mut cx)
            };
            match polled {
                Poll::Ready(()) => return Ok(()),
                Poll::Pending => {
                    if !turn.yield_to_runtime() {
                        return Err(abandoned());
                    }
                }
            }
        }
    }

    fn spawn(&self, name: String, work: Box<dyn FnOnce() + Send>) -> ComputeDone {
        let turn = Arc::new(Turn { holder: Mutex::new(Holder::Runtime), changed: Condvar::new(), wake: Notify::new() });
        let thread_turn = Arc::clone(&turn);
        let started = std::thread::Builder::new().name(name.clone()).spawn(move || {
            let run = thread_turn.wait_for_baton();
            CURRENT.with(|current| *current.borrow_mut() = Some(Arc::clone(&thread_turn)));
            // An abandoned step still drops its work here, while the runtime thread waits.
            let panicked = if run { std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)).is_err() } else { false };
            CURRENT.with(|current| *current.borrow_mut() = None);
            thread_turn.finish(panicked);
        });
        Box::pin(async move {
            started.map_err(rtx_pipelines::Error::CommThread)?;
            let mut guard = AbandonOnDrop { turn, done: false };
            loop {
                match guard.turn.run_compute() {
                    Holder::Done { panicked } => {
                        guard.done = true;
                        if panicked {
                            return Err(rtx_pipelines::Error::Pipeline { reason: format!("the compute thread {name} panicked") });
                        }
                        return Ok(());
                    }
                    Holder::Runtime | Holder::Compute | Holder::Abandoned => guard.turn.wake.notified().await,
                }
            }
        })
    }

    fn side_threads(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rtx_pipelines::drive;
    use std::time::Duration;

    /// Runs `f` on a paused single-thread runtime, as the simulator does.
    fn simulated<F: Future>(f: F) -> F::Output {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap();
        tokio::task::LocalSet::new().block_on(&runtime, f)
    }

    #[test]
    fn compute_threads_take_turns_with_the_runtime_and_their_waits_take_virtual_time() {
        // Goal: two compute threads exchange values through runtime channels; each sleeps in
        // virtual time inside `block_on`; the order of everything is the same on every run, and
        // virtual time advances only by the sleeps (compute costs none).
        let run = || {
            simulated(async {
                let baton = Arc::new(Baton::new(Handle::current()));
                let log = Arc::new(Mutex::new(Vec::new()));
                let (a_tx, mut a_rx) = tokio::sync::mpsc::unbounded_channel::<u32>();
                let (b_tx, mut b_rx) = tokio::sync::mpsc::unbounded_channel::<u32>();
                let start = tokio::time::Instant::now();
                let (la, lb, ba, bb) = (Arc::clone(&log), Arc::clone(&log), Arc::clone(&baton), Arc::clone(&baton));
                let first = baton.spawn(
                    "a".into(),
                    Box::new(move || {
                        for i in 0..5 {
                            a_tx.send(i).unwrap();
                            let got = drive(ba.as_ref(), async { b_rx.recv().await }).unwrap().unwrap();
                            let at = drive(ba.as_ref(), async { start.elapsed() }).unwrap();
                            la.lock().unwrap().push(format!("a got {got} at {at:?}"));
                        }
                    }),
                );
                let second = baton.spawn(
                    "b".into(),
                    Box::new(move || {
                        for _ in 0..5 {
                            let got = drive(bb.as_ref(), async { a_rx.recv().await }).unwrap().unwrap();
                            drive(bb.as_ref(), async { tokio::time::sleep(Duration::from_millis(10)).await }).unwrap();
                            let at = drive(bb.as_ref(), async { start.elapsed() }).unwrap();
                            lb.lock().unwrap().push(format!("b got {got} at {at:?}"));
                            b_tx.send(got * 10).unwrap();
                        }
                    }),
                );
                let (x, y) = tokio::join!(first, second);
                x.unwrap();
                y.unwrap();
                assert_eq!(start.elapsed(), Duration::from_millis(50));
                let log = log.lock().unwrap().clone();
                log
            })
        };
        let once = run();
        assert_eq!(once.len(), 10);
        assert_eq!(once[0], "b got 0 at 10ms");
        assert_eq!(once.last().unwrap(), "a got 40 at 50ms");
        for _ in 0..5 {
            assert_eq!(run(), once);
        }
    }

    #[test]
    fn a_dropped_step_unwinds_its_thread_and_a_panic_is_an_error() {
        // Goal: a node killed while its compute thread waits (the future dropped) does not leak a
        // waiting thread: its wait fails and the thread ends before the drop returns; a thread
        // that panics is a typed error.
        simulated(async {
            let baton = Arc::new(Baton::new(Handle::current()));
            let (ended_tx, ended_rx) = std::sync::mpsc::channel();
            let inner = Arc::clone(&baton);
            let step = baton.spawn(
                "waits-forever".into(),
                Box::new(move || {
                    let waited = drive(inner.as_ref(), std::future::pending::<()>());
                    ended_tx.send(waited.is_err()).unwrap();
                }),
            );
            let timed_out = tokio::time::timeout(Duration::from_millis(5), step).await;
            assert!(timed_out.is_err());
            assert_eq!(ended_rx.try_recv(), Ok(true), "the thread ended with a failed wait before the drop returned");
            let err = baton.spawn("panics".into(), Box::new(|| panic!("planted"))).await.unwrap_err();
            assert!(err.to_string().contains("panics"), "{err}");
        });
    }

    #[test]
    fn waiting_outside_a_compute_thread_is_refused() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        let baton = Baton::new(runtime.handle().clone());
        let err = std::thread::spawn(move || drive(&baton, async { 1 })).join().unwrap().unwrap_err();
        assert!(err.to_string().contains("did not start"), "{err}");
    }
}
