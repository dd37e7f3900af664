//! [`NcclReduce`] (feature `nccl`): the device reducer over an [`NcclCommunicator`], one GPU per
//! rank.
//!
//! Stream order. The communicator must run on the process's shared handle of the tensors' device
//! (`rtx_tensor::cuda::device(ordinal)`, checked by [`NcclReduce::new`]): that handle has one
//! stream, on which the tensor ops queue their kernels and NCCL queues its calls. So the
//! all-reduce of a bucket starts after the copies that packed it and ends before the copies that
//! unpack it, without the host waiting in between. The host does wait once per bucket
//! ([`NcclCommunicator::wait`], which also watches for NCCL errors, lost peers, generation
//! changes and the operation timeout): buckets are reduced one at a time, as the engine's
//! determinism rule asks.
//!
//! Ownership. No lock is held across an `.await`: the flat tensor's device buffer is taken out
//! (`rtx_tensor::cuda::with_dense_data_mut`, leaving an empty placeholder), the NCCL call is
//! queued on the owned buffer, and the buffer is put back at once (the device is still working
//! on it, but every later use is queued on the same stream, after the collective). Only then does
//! the host wait for the collective to complete.

use std::sync::Arc;

use rtx_collectives::{CollectiveGroup, NcclCommunicator, NcclElement, ReduceOp};
use rtx_kernels::cuda::{Buffer, Device as CudaDevice};
use rtx_tensor::cuda::{with_dense_data_mut, DeviceData};
use rtx_tensor::{Device, Tensor};

use super::{DeviceReduce, ReduceFuture};
use crate::error::{Error, Result};

/// A [`DeviceReduce`] over an [`NcclCommunicator`]: flat tensors on the communicator's CUDA
/// device, reduced with `ncclAvg` and broadcast with `ncclBroadcast` on the device's stream.
#[derive(Debug)]
pub struct NcclReduce {
    comm: NcclCommunicator,
    ordinal: usize,
}

/// A collective to queue on a taken buffer.
#[derive(Clone, Copy)]
enum Op {
    AllReduceAvg,
    Broadcast(usize),
}

impl NcclReduce {
    /// Wraps `comm`, which must have been created on `rtx_tensor::cuda::device(ordinal)` (the
    /// handle whose stream the tensor ops use); another handle of the same GPU would put NCCL on
    /// another stream, unordered with the packing kernels, and is refused.
    pub fn new(comm: NcclCommunicator) -> Result<Self> {
        let ordinal = comm.device().ordinal();
        let shared = rtx_tensor::cuda::device(ordinal)?;
        if !Arc::ptr_eq(&shared, comm.device()) {
            return Err(Error::InvalidConfig {
                reason: "the NCCL communicator must be created on rtx_tensor::cuda::device(ordinal), whose stream the tensor ops use",
            });
        }
        Ok(NcclReduce { comm, ordinal })
    }

    /// The NCCL communicator.
    pub fn communicator(&self) -> &NcclCommunicator {
        &self.comm
    }

    /// Unwraps the communicator (to shut it down).
    pub fn into_communicator(self) -> NcclCommunicator {
        self.comm
    }

    /// Queues `op` on `flat`'s buffer, puts the buffer back, then waits for the device.
    async fn run(&self, flat: &Tensor, op: Op) -> Result<()> {
        let name = match op {
            Op::AllReduceAvg => "all_reduce",
            Op::Broadcast(_) => "broadcast",
        };
        if flat.device() != Device::Cuda(self.ordinal) {
            return Err(rtx_tensor::Error::DeviceMismatch { op: name, lhs: Device::Cuda(self.ordinal), rhs: flat.device() }.into());
        }
        let placeholder = empty_like(self.comm.device(), flat.dtype())?;
        let mut data = with_dense_data_mut(flat, |d| std::mem::replace(d, placeholder))?;
        let queued = match &mut data {
            DeviceData::F32(b) => self.queue(b, op, name).await,
            DeviceData::BF16(b) => self.queue(b, op, name).await,
            DeviceData::U32(_) => Err(rtx_tensor::Error::UnsupportedDType { op: name, dtype: rtx_tensor::DType::U32 }.into()),
        };
        // Queued on the stream every later use of the buffer is queued on: it may go back now.
        with_dense_data_mut(flat, |d| *d = data)?;
        queued?;
        self.comm.wait().await.map_err(|source| Error::Group { op: name, role: "dp", source })
    }

    /// Queues `op` on `buf` (only queues: `Ok` once NCCL has the call).
    async fn queue<T: NcclElement>(&self, buf: &mut Buffer<T>, op: Op, name: &'static str) -> Result<()> {
        let queued = match op {
            Op::AllReduceAvg => self.comm.start_all_reduce(buf, ReduceOp::Avg).await,
            Op::Broadcast(root) => self.comm.start_broadcast(buf, root).await,
        };
        queued.map_err(|source| Error::Group { op: name, role: "dp", source })
    }
}

impl DeviceReduce for NcclReduce {
    fn rank(&self) -> usize {
        CollectiveGroup::rank(&self.comm)
    }

    fn size(&self) -> usize {
        CollectiveGroup::size(&self.comm)
    }

    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    fn all_reduce_avg<'a>(&'a self, flat: &'a Tensor) -> ReduceFuture<'a> {
        Box::pin(self.run(flat, Op::AllReduceAvg))
    }

    fn broadcast<'a>(&'a self, flat: &'a Tensor, root: usize) -> ReduceFuture<'a> {
        Box::pin(self.run(flat, Op::Broadcast(root)))
    }
}

/// An empty device buffer of `dtype`, the placeholder a taken tensor holds.
fn empty_like(device: &CudaDevice, dtype: rtx_tensor::DType) -> Result<DeviceData> {
    let data = match dtype {
        rtx_tensor::DType::F32 => DeviceData::F32(device.alloc(0).map_err(rtx_tensor::Error::from)?),
        rtx_tensor::DType::BF16 => DeviceData::BF16(device.alloc(0).map_err(rtx_tensor::Error::from)?),
        other => return Err(rtx_tensor::Error::UnsupportedDType { op: "device reduce (nccl)", dtype: other }.into()),
    };
    Ok(data)
}
