//! [`ComputeDriver`]: how a compute thread waits for communication, and how the worker runtime
//! starts compute threads.
//!
//! Pipeline stages and tensor-parallel layers communicate in the middle of forward and backward,
//! which run synchronously on a compute thread (autograd's backward closures are plain
//! functions). Every blocking group ([`crate::tp::TpGroup`], [`crate::pipeline::BlockingGroup`])
//! runs its collectives through a driver, and the worker runtime starts each mesh step's compute
//! thread through the same driver. Production uses [`RuntimeDriver`]: a plain OS thread that blocks
//! on the runtime's [`Handle::block_on`] while another thread drives the runtime. The simulator
//! plugs in a driver that hands one baton between its single runtime thread and the compute
//! threads, so exactly one of them runs at a time and virtual time cannot move while a compute
//! thread works (the schedule is then a function of the seed).
//!
//! Invariant: [`ComputeDriver::block_on`] is never called on a tokio runtime thread (the groups
//! refuse that with a typed error before they get here).

use std::future::Future;
use std::pin::Pin;

use tokio::runtime::Handle;

use crate::error::{Error, Result};

/// A boxed future of a compute thread's end.
pub type ComputeDone = Pin<Box<dyn Future<Output = Result<()>> + Send>>;

/// Runs communication futures on compute threads, and starts those threads.
pub trait ComputeDriver: Send + Sync + std::fmt::Debug {
    /// Runs `future` to completion on the calling compute thread. Fails when the thread may not
    /// wait here (not a compute thread of this driver, or its step was abandoned).
    fn block_on(&self, future: Pin<&mut dyn Future<Output = ()>>) -> Result<()>;

    /// Runs `work` on a new compute thread named `name`; the returned future resolves when `work`
    /// returned (an error when the thread could not start or `work` panicked).
    fn spawn(&self, name: String, work: Box<dyn FnOnce() + Send>) -> ComputeDone;

    /// Whether helper threads (a pipeline stage's sender thread) may run beside a compute thread.
    /// A driver that schedules every thread itself says no, and the stage sends inline.
    fn side_threads(&self) -> bool {
        true
    }
}

/// Runs `future` on the calling compute thread through `driver` and returns its output.
pub fn drive<F: Future>(driver: &dyn ComputeDriver, future: F) -> Result<F::Output> {
    let mut output = None;
    {
        let slot = &mut output;
        let mut wrapped = std::pin::pin!(async move {
            *slot = Some(future.await);
        });
        driver.block_on(wrapped.as_mut())?;
    }
    output.ok_or_else(|| Error::Pipeline { reason: "a compute driver returned before the future it ran completed".into() })
}

/// The production driver: compute threads are OS threads that block on the runtime's handle
/// (the runtime must be driven by other threads: a multi-thread runtime, or a current-thread
/// runtime whose `block_on` runs elsewhere).
#[derive(Clone, Debug)]
pub struct RuntimeDriver {
    handle: Handle,
}

impl RuntimeDriver {
    /// A driver over the runtime of `handle`.
    pub fn new(handle: Handle) -> RuntimeDriver {
        RuntimeDriver { handle }
    }

    /// A driver over the current runtime (`None` outside one).
    pub fn current() -> Option<RuntimeDriver> {
        Handle::try_current().ok().map(RuntimeDriver::new)
    }
}

impl ComputeDriver for RuntimeDriver {
    fn block_on(&self, future: Pin<&mut dyn Future<Output = ()>>) -> Result<()> {
        self.handle.block_on(future);
        Ok(())
    }

    fn spawn(&self, name: String, work: Box<dyn FnOnce() + Send>) -> ComputeDone {
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
        let started = std::thread::Builder::new().name(name.clone()).spawn(move || {
            work();
            let _ = done_tx.send(());
        });
        Box::pin(async move {
            started.map_err(Error::CommThread)?;
            done_rx.await.map_err(|_| Error::Pipeline { reason: format!("the compute thread {name} ended without finishing its work (it panicked)") })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_runtime_driver_runs_futures_on_compute_threads_and_reports_a_panicked_one() {
        // Goal: a compute thread started by the driver waits for a runtime future through it and
        // the caller sees its end; a thread that panics is an error, not a hang.
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let driver = std::sync::Arc::new(RuntimeDriver::new(runtime.handle().clone()));
        let (tx, rx) = std::sync::mpsc::channel();
        let inner = std::sync::Arc::clone(&driver);
        let done = driver.spawn(
            "compute-test".into(),
            Box::new(move || {
                let value = drive(inner.as_ref(), async {
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                    41 + 1
                });
                tx.send(value.unwrap()).unwrap();
            }),
        );
        runtime.block_on(done).unwrap();
        assert_eq!(rx.recv().unwrap(), 42);
        let panicked = driver.spawn("compute-panics".into(), Box::new(|| panic!("planted panic of a compute thread")));
        let err = runtime.block_on(panicked).unwrap_err();
        assert!(err.to_string().contains("compute-panics"), "{err}");
    }
}
