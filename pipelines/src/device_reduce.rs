//! [`DeviceReduce`]: the collectives of the device data-parallel path, on flat dense tensors that
//! stay where the parameters are (see [`crate::DataParallel::with_device_reduce`]).
//!
//! A reducer averages a bucket's flat gradient across the group ([`DeviceReduce::all_reduce_avg`])
//! and broadcasts rank 0's flat parameters at construction ([`DeviceReduce::broadcast`]), in
//! place, one operation at a time, in the order the engine issues them (bucket-index order on
//! every rank). Two implementations:
//!
//! - [`HostReduce`], the host communicator standing in: flat tensors on the host, reduced by an
//!   [`rtx_collectives::Communicator`] (in-process, shared memory, QUIC). Tests run the device
//!   path's logic with it on the CPU, and its bits are the host-staging path's: the same
//!   communicator call (`all_reduce` with `ReduceOp::Avg`) on a buffer of the same length.
//! - `NcclReduce` (feature `nccl`): flat tensors on a CUDA device, reduced by an
//!   `NcclCommunicator` on the device's one stream, so the all-reduce is ordered after the
//!   kernels that packed the bucket and before the copies that unpack it.
//!
//! Decision (constraint, choice, consequence): *average in the collective, not after it.* A sum
//! followed by a division in the engine would round twice for bf16 (the host communicator widens
//! bf16 to f32 between hops and divides before rounding; NCCL's `ncclAvg` divides in its kernel)
//! and, as a multiplication by `1/n`, would not give the host path's bits even in f32. So the one
//! operation a reducer offers is the average (the sum over the group divided by its size, in the
//! communicator's fixed order), and the host stand-in is bit-identical to host staging.
//!
//! Errors: a failed collective is [`Error::Group`] with role `"dp"` (the engine turns it into
//! [`Error::Collective`] naming the step and bucket); a flat tensor the reducer cannot take (on
//! another device, not dense, an integer dtype) is a tensor error.

#[cfg(feature = "nccl")]
mod nccl;

use std::future::Future;
use std::pin::Pin;

use rtx_collectives::{Communicator, ReduceOp};
use rtx_tensor::{CpuData, Device, Tensor};

use crate::error::{Error, Result};

#[cfg(feature = "nccl")]
pub use nccl::NcclReduce;

/// The future of one reducer operation.
pub type ReduceFuture<'a> = Pin<Box<dyn Future<Output = Result<()>> + Send + 'a>>;

/// One rank's collectives over flat dense tensors on [`DeviceReduce::device`]; see the module doc.
/// Every rank issues the same operations in the same order, one at a time.
pub trait DeviceReduce: Send + Sync + std::fmt::Debug {
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// The number of ranks in the group.
    fn size(&self) -> usize;
    /// Where the flat tensors this reducer takes live (the parameters' device).
    fn device(&self) -> Device;
    /// Replaces `flat` (a dense 1-d float tensor on [`device`](Self::device)) by the average of
    /// every rank's `flat`, in place; `Ok` once the result is in `flat` (for a device, once it
    /// has been computed there).
    fn all_reduce_avg<'a>(&'a self, flat: &'a Tensor) -> ReduceFuture<'a>;
    /// Replaces `flat` by group rank `root`'s, in place.
    fn broadcast<'a>(&'a self, flat: &'a Tensor, root: usize) -> ReduceFuture<'a>;
}

/// The host communicator standing in for a device reducer: flat tensors on the host, reduced by
/// a [`Communicator`] whose endpoint the caller's runtime drives.
#[derive(Debug)]
pub struct HostReduce {
    comm: Communicator,
}

impl HostReduce {
    /// A reducer over `comm`'s group.
    pub fn new(comm: Communicator) -> Self {
        HostReduce { comm }
    }

    /// The communicator.
    pub fn communicator(&self) -> &Communicator {
        &self.comm
    }
}

impl DeviceReduce for HostReduce {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn size(&self) -> usize {
        self.comm.size()
    }

    fn device(&self) -> Device {
        Device::Cpu
    }

    fn all_reduce_avg<'a>(&'a self, flat: &'a Tensor) -> ReduceFuture<'a> {
        Box::pin(async move {
            let mut data = take_host(flat)?;
            let result = match &mut data {
                CpuData::F32(v) => self.comm.all_reduce(v, ReduceOp::Avg).await,
                CpuData::F64(v) => self.comm.all_reduce(v, ReduceOp::Avg).await,
                CpuData::BF16(v) => self.comm.all_reduce(v, ReduceOp::Avg).await,
                other => {
                    let dtype = other.dtype();
                    restore_host(flat, data)?;
                    return Err(rtx_tensor::Error::UnsupportedDType { op: "all_reduce_avg", dtype }.into());
                }
            };
            restore_host(flat, data)?;
            result.map_err(|source| Error::Group { op: "all_reduce", role: "dp", source })
        })
    }

    fn broadcast<'a>(&'a self, flat: &'a Tensor, root: usize) -> ReduceFuture<'a> {
        Box::pin(async move {
            let mut data = take_host(flat)?;
            let result = match &mut data {
                CpuData::F32(v) => self.comm.broadcast(v, root).await,
                CpuData::F64(v) => self.comm.broadcast(v, root).await,
                CpuData::BF16(v) => self.comm.broadcast(v, root).await,
                other => {
                    let dtype = other.dtype();
                    restore_host(flat, data)?;
                    return Err(rtx_tensor::Error::UnsupportedDType { op: "broadcast", dtype }.into());
                }
            };
            restore_host(flat, data)?;
            result.map_err(|source| Error::Group { op: "broadcast", role: "dp", source })
        })
    }
}

/// Moves a dense host tensor's elements out (the write guard is dropped before this returns, so
/// nothing is locked across the collective's `.await`), leaving an empty buffer of its dtype.
fn take_host(flat: &Tensor) -> Result<CpuData> {
    let dense = flat.is_contiguous() && flat.layout().offset() == 0 && flat.storage().len() == flat.numel();
    if !dense || flat.shape().len() != 1 {
        return Err(
            rtx_tensor::Error::NotContiguous { op: "device reduce (host)", shape: flat.shape().to_vec(), strides: flat.layout().strides().to_vec() }.into()
        );
    }
    let mut guard = flat.storage().write()?;
    let empty = CpuData::zeros(guard.dtype(), 0);
    Ok(std::mem::replace(&mut *guard, empty))
}

/// Puts elements taken by [`take_host`] back.
fn restore_host(flat: &Tensor, data: CpuData) -> Result<()> {
    let mut guard = flat.storage().write()?;
    debug_assert!(guard.is_empty(), "device reduce: nobody writes a flat tensor while it is taken");
    debug_assert_eq!(data.len(), flat.numel(), "device reduce: the elements go back whole");
    *guard = data;
    Ok(())
}
