//! [`BlockingGroup`]: a communicator driven from a compute thread. Pipeline stages and tensor-parallel
//! layers communicate in the middle of forward and backward, which run synchronously on a thread of
//! their own (autograd's backward closures are plain functions); this wrapper runs each collective on
//! the endpoint's tokio runtime and waits for it. Calling it from a runtime thread is refused with a
//! typed error instead of the runtime's panic. A size-1 group does no communication.

use std::sync::Arc;

use rtx_collectives::{Communicator, Element, ReduceOp, WireElement};
use tokio::runtime::Handle;

use crate::driver::{drive, ComputeDriver, RuntimeDriver};
use crate::error::{Error, Result};

/// A communicator plus the driver of the runtime its endpoint runs on, used from a compute thread.
#[derive(Clone)]
pub struct BlockingGroup {
    comm: Communicator,
    driver: Arc<dyn ComputeDriver>,
    /// What the group is for (`pp`, `dp`, `tp`), in errors.
    role: &'static str,
}

impl std::fmt::Debug for BlockingGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockingGroup").field("role", &self.role).field("rank", &self.comm.rank()).field("size", &self.comm.size()).finish()
    }
}

impl BlockingGroup {
    /// Wraps `comm`, whose endpoint runs on `handle`'s runtime.
    pub fn new(comm: Communicator, handle: Handle, role: &'static str) -> BlockingGroup {
        BlockingGroup::with_driver(comm, Arc::new(RuntimeDriver::new(handle)), role)
    }

    /// Wraps `comm`; the compute thread waits for its collectives through `driver`.
    pub fn with_driver(comm: Communicator, driver: Arc<dyn ComputeDriver>, role: &'static str) -> BlockingGroup {
        BlockingGroup { comm, driver, role }
    }

    /// The driver the compute thread waits through.
    pub fn driver(&self) -> &Arc<dyn ComputeDriver> {
        &self.driver
    }

    /// This member's group rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Members in the group.
    pub fn size(&self) -> usize {
        self.comm.size()
    }

    /// The communicator.
    pub fn communicator(&self) -> &Communicator {
        &self.comm
    }

    fn run<T>(&self, op: &'static str, work: impl std::future::Future<Output = rtx_collectives::Result<T>>) -> Result<T> {
        if Handle::try_current().is_ok() {
            return Err(Error::BlockingOnRuntime { op, role: self.role });
        }
        drive(self.driver.as_ref(), work)?.map_err(|source| Error::Group { op, role: self.role, source })
    }

    /// Sums `buf` over the group in place.
    pub fn all_reduce_sum<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        if self.size() == 1 {
            return Ok(());
        }
        self.run("all_reduce", self.comm.all_reduce(buf, ReduceOp::Sum))
    }

    /// Replaces `buf` with group rank `root`'s.
    pub fn broadcast<T: WireElement>(&self, buf: &mut [T], root: usize) -> Result<()> {
        if self.size() == 1 {
            return Ok(());
        }
        self.run("broadcast", self.comm.broadcast(buf, root))
    }

    /// Gathers every member's `input` into `output`, in group-rank order.
    pub fn all_gather(&self, input: &[f32], output: &mut [f32]) -> Result<()> {
        if self.size() == 1 {
            output.copy_from_slice(input);
            return Ok(());
        }
        self.run("all_gather", self.comm.all_gather(input, output))
    }

    /// Sends `buf` to group rank `dst` (returns once the transport has it).
    pub fn send(&self, buf: &[f32], dst: usize) -> Result<()> {
        self.run("send", self.comm.send(buf, dst))
    }

    /// Receives what group rank `src` sent; `buf`'s length must match.
    pub fn recv(&self, buf: &mut [f32], src: usize) -> Result<()> {
        self.run("recv", self.comm.recv(buf, src))
    }
}
