//! The tensor-parallel group as the compute thread sees it: [`TpComm`], a blocking trait
//! (rank, size, sum and max all-reduce, all-gather, reduce-scatter on f32 host buffers), and
//! [`TpGroup`], its implementation over a [`Communicator`] and the [`ComputeDriver`] of the
//! runtime that drives the communicator's endpoint.
//!
//! Forward and backward closures run on a plain compute thread and must finish a collective
//! before they return, so every call blocks that thread through the driver (production:
//! [`Handle::block_on`]; the simulator: its baton). A thread inside a
//! tokio runtime context (a worker thread, a task, a thread that entered a handle) gets
//! [`Error::TpOnRuntimeThread`] instead of tokio's panic. The handle's runtime must be driven by
//! some other thread: a multi-thread runtime, or a current-thread runtime whose `block_on` runs
//! on a thread of its own (what the tests do).
//!
//! Failures: the communicator's collectives time out ([`rtx_collectives::CommConfig::op_timeout`])
//! and report lost peers, so a call returns [`Error::TpCollective`] instead of hanging. After the
//! first failure the group is out of step with its peers and every later call returns
//! [`Error::TpBroken`] at once; the group must be re-formed (a new communicator generation).
//!
//! Backward closures can only return [`rtx_tensor::Error`]. A failure there travels as
//! `rtx_tensor::Error::Io` whose source is the boxed typed [`Error`] (see [`to_tensor_error`]);
//! [`lift_tensor_error`] unwraps it again, and [`backward`] does so for a loss.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rtx_collectives::{Communicator, ReduceOp};
use rtx_tensor::Tensor;
use tokio::runtime::Handle;

use crate::driver::{drive, ComputeDriver, RuntimeDriver};
use crate::error::{Error, Result};

/// A shared handle to a tensor-parallel group, as layers and autograd closures hold it.
pub type TpHandle = Arc<dyn TpComm>;

/// A blocking tensor-parallel group: every member calls the same operations in the same order
/// with matching sizes. A group of size 1 moves nothing. Implemented by [`TpGroup`]; other
/// backends (NCCL) can implement it too.
pub trait TpComm: Send + Sync + std::fmt::Debug {
    /// This rank's index in the group.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn size(&self) -> usize;

    /// Sums `buf` element-wise across the group; every rank ends with the same bits.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()>;

    /// Element-wise maximum of `buf` across the group.
    fn all_reduce_max(&self, buf: &mut [f32]) -> Result<()>;

    /// Concatenates every rank's `input` (all of one length) into `output` in rank order;
    /// `output.len() == size * input.len()`.
    fn all_gather(&self, input: &[f32], output: &mut [f32]) -> Result<()>;

    /// Sums `input` (length `size * output.len()`) across the group and leaves this rank's part
    /// (elements `rank * output.len()..`) in `output`.
    fn reduce_scatter_sum(&self, input: &[f32], output: &mut [f32]) -> Result<()>;
}

/// [`TpComm`] over a [`Communicator`], blocking the calling thread through a [`ComputeDriver`].
#[derive(Debug)]
pub struct TpGroup {
    link: Option<(Communicator, Arc<dyn ComputeDriver>)>,
    rank: usize,
    size: usize,
    broken: AtomicBool,
}

impl TpGroup {
    /// A group over `comm`, whose endpoint runs on the runtime of `handle`.
    pub fn new(comm: Communicator, handle: Handle) -> TpGroup {
        TpGroup::with_driver(comm, Arc::new(RuntimeDriver::new(handle)))
    }

    /// A group over `comm` whose collectives the compute thread waits for through `driver`.
    pub fn with_driver(comm: Communicator, driver: Arc<dyn ComputeDriver>) -> TpGroup {
        let (rank, size) = (comm.rank(), comm.size());
        TpGroup { link: Some((comm, driver)), rank, size, broken: AtomicBool::new(false) }
    }

    /// A group of one rank: no communicator, no runtime, every operation local.
    pub fn solo() -> TpGroup {
        TpGroup { link: None, rank: 0, size: 1, broken: AtomicBool::new(false) }
    }

    /// This group as a shared [`TpHandle`].
    pub fn into_handle(self) -> TpHandle {
        Arc::new(self)
    }

    /// Whether an earlier operation failed (the group must be re-formed).
    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    /// Runs one collective to completion on the calling thread.
    fn run<'a, F>(&'a self, op: &'static str, bytes: usize, collective: impl FnOnce(&'a Communicator) -> F) -> Result<()>
    where
        F: std::future::Future<Output = rtx_collectives::Result<()>> + 'a,
    {
        let Some((comm, driver)) = &self.link else { return Ok(()) };
        let _span = tracing::debug_span!("tp_collective", op, group = comm.group_id(), generation = comm.generation(), rank = self.rank, bytes).entered();
        if self.is_broken() {
            return Err(Error::TpBroken { op, rank: self.rank });
        }
        if Handle::try_current().is_ok() {
            return Err(Error::TpOnRuntimeThread { op });
        }
        let outcome = drive(driver.as_ref(), collective(comm)).inspect_err(|_| self.broken.store(true, Ordering::Release))?;
        outcome.map_err(|source| {
            self.broken.store(true, Ordering::Release);
            tracing::warn!(op, rank = self.rank, size = self.size, error = %source, "tensor-parallel collective failed");
            Error::TpCollective { op, rank: self.rank, size: self.size, source }
        })
    }
}

impl TpComm for TpGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        let bytes = std::mem::size_of_val(buf);
        self.run("all_reduce_sum", bytes, move |comm| comm.all_reduce(buf, ReduceOp::Sum))
    }

    fn all_reduce_max(&self, buf: &mut [f32]) -> Result<()> {
        let bytes = std::mem::size_of_val(buf);
        self.run("all_reduce_max", bytes, move |comm| comm.all_reduce(buf, ReduceOp::Max))
    }

    fn all_gather(&self, input: &[f32], output: &mut [f32]) -> Result<()> {
        check_parts("all_gather", output.len(), input.len(), self.size)?;
        if self.size == 1 {
            output.copy_from_slice(input);
            return Ok(());
        }
        let bytes = std::mem::size_of_val(output);
        self.run("all_gather", bytes, move |comm| comm.all_gather(input, output))
    }

    fn reduce_scatter_sum(&self, input: &[f32], output: &mut [f32]) -> Result<()> {
        check_parts("reduce_scatter_sum", input.len(), output.len(), self.size)?;
        if self.size == 1 {
            output.copy_from_slice(input);
            return Ok(());
        }
        let bytes = std::mem::size_of_val(input);
        self.run("reduce_scatter_sum", bytes, move |comm| comm.reduce_scatter(input, output, ReduceOp::Sum))
    }
}

/// Wraps a typed error for a backward closure (which can only return [`rtx_tensor::Error`]):
/// an `Io` error whose source is the boxed [`Error`]; [`lift_tensor_error`] undoes it.
pub fn to_tensor_error(error: Error) -> rtx_tensor::Error {
    let kind = match &error {
        Error::TpCollective { source: rtx_collectives::Error::Timeout { .. }, .. } => std::io::ErrorKind::TimedOut,
        Error::TpCollective { .. } | Error::TpBroken { .. } => std::io::ErrorKind::ConnectionAborted,
        _ => std::io::ErrorKind::Other,
    };
    rtx_tensor::Error::Io { path: "tensor-parallel group".into(), source: std::io::Error::new(kind, error) }
}

/// The typed error carried by a tensor error made by [`to_tensor_error`], or the tensor error
/// itself wrapped as [`Error::Tensor`].
pub fn lift_tensor_error(error: rtx_tensor::Error) -> Error {
    match error {
        rtx_tensor::Error::Io { path, source } => {
            if source.get_ref().is_some_and(|inner| inner.is::<Error>()) {
                if let Some(inner) = source.into_inner() {
                    match inner.downcast::<Error>() {
                        Ok(typed) => return *typed,
                        Err(other) => return Error::Tensor(rtx_tensor::Error::Io { path, source: std::io::Error::other(other) }),
                    }
                }
                // `get_ref` saw an inner error, so `into_inner` has one; kept total anyway.
                return Error::Tensor(rtx_tensor::Error::Io { path, source: std::io::Error::other("tensor-parallel failure") });
            }
            Error::Tensor(rtx_tensor::Error::Io { path, source })
        }
        other => Error::Tensor(other),
    }
}

/// `loss.backward()`, with a collective failure inside a tensor-parallel backward returned as
/// its typed [`Error`] (see [`lift_tensor_error`]).
pub fn backward(loss: &Tensor) -> Result<()> {
    loss.backward().map_err(lift_tensor_error)
}

fn check_parts(op: &'static str, whole: usize, part: usize, size: usize) -> Result<()> {
    if whole != part * size {
        return Err(Error::TpBufferLength { op, expected: part * size, got: whole });
    }
    Ok(())
}
