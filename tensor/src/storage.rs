//! Tensor storage: a reference-counted, lock-protected buffer of one dtype, in host memory or on
//! a CUDA device, that many tensors (views) can share.
//!
//! Ownership protocol: ops read storages under a (recursive) read lock and always write their
//! results into fresh storages, so sharing is safe. Only the explicit in-place methods
//! (`Tensor::add_assign_`, `copy_from_`, `zero_` and the optimizers built on them) take the write
//! lock; they first gather their source into an owned buffer, so a tensor updated from a view of
//! itself cannot deadlock. Flat parameter and gradient buckets are storages that many parameter
//! tensors view at different offsets.

pub use crate::elements::{Elements, ForeignOwner};
use crate::pool;
use half::bf16;
use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use crate::error::{Error, Result};
use rtx_kernels::{DType, Device};
use std::sync::Arc;

/// The elements of a CPU storage.
#[derive(Clone, Debug)]
pub enum CpuData {
    /// f32 elements.
    F32(Elements<f32>),
    /// f64 elements.
    F64(Elements<f64>),
    /// bf16 elements.
    BF16(Elements<bf16>),
    /// u32 elements (indices, labels).
    U32(Elements<u32>),
    /// i64 elements (PyTorch's `long`: signed targets, ids, integer buffers).
    I64(Elements<i64>),
}

impl CpuData {
    /// The dtype of the elements.
    pub fn dtype(&self) -> DType {
        match self {
            CpuData::F32(_) => DType::F32,
            CpuData::F64(_) => DType::F64,
            CpuData::BF16(_) => DType::BF16,
            CpuData::U32(_) => DType::U32,
            CpuData::I64(_) => DType::I64,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            CpuData::F32(v) => v.len(),
            CpuData::F64(v) => v.len(),
            CpuData::BF16(v) => v.len(),
            CpuData::U32(v) => v.len(),
            CpuData::I64(v) => v.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies `src` into elements `offset..offset + src.len()`: a typed error when the dtypes
    /// differ or the range ends beyond these elements.
    pub fn write_at(&mut self, offset: usize, src: &CpuData) -> Result<()> {
        let (n, len) = (src.len(), self.len());
        if offset + n > len {
            return Err(Error::BadShape { op: "write_at", shape: vec![len], reason: format!("elements {offset}..{} beyond the storage", offset + n) });
        }
        match (self, src) {
            (CpuData::F32(d), CpuData::F32(s)) => d[offset..offset + n].copy_from_slice(s),
            (CpuData::F64(d), CpuData::F64(s)) => d[offset..offset + n].copy_from_slice(s),
            (CpuData::BF16(d), CpuData::BF16(s)) => d[offset..offset + n].copy_from_slice(s),
            (CpuData::U32(d), CpuData::U32(s)) => d[offset..offset + n].copy_from_slice(s),
            (CpuData::I64(d), CpuData::I64(s)) => d[offset..offset + n].copy_from_slice(s),
            (d, s) => return Err(Error::DTypeMismatch { op: "write_at", lhs: d.dtype(), rhs: s.dtype() }),
        }
        Ok(())
    }

    /// `len` zeros of `dtype`.
    pub fn zeros(dtype: DType, len: usize) -> Self {
        match dtype {
            DType::F32 => CpuData::F32(pool::zeroed(len).into()),
            DType::F64 => CpuData::F64(pool::zeroed(len).into()),
            DType::BF16 => CpuData::BF16(pool::zeroed(len).into()),
            DType::U32 => CpuData::U32(pool::zeroed(len).into()),
            DType::I64 => CpuData::I64(pool::zeroed(len).into()),
        }
    }

    /// The raw little-endian bytes of the elements (safetensors layout).
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            CpuData::F32(v) => bytemuck::cast_slice(v),
            CpuData::F64(v) => bytemuck::cast_slice(v),
            CpuData::BF16(v) => bytemuck::cast_slice(v),
            CpuData::U32(v) => bytemuck::cast_slice(v),
            CpuData::I64(v) => bytemuck::cast_slice(v),
        }
    }

    /// Whether the elements are borrowed from foreign memory (see [`Elements`]).
    pub fn is_foreign(&self) -> bool {
        self.foreign_owner().is_some()
    }

    /// The owner of the borrowed foreign memory, if any (see [`Elements::foreign_owner`]).
    pub fn foreign_owner(&self) -> Option<ForeignOwner> {
        match self {
            CpuData::F32(v) => v.foreign_owner(),
            CpuData::F64(v) => v.foreign_owner(),
            CpuData::BF16(v) => v.foreign_owner(),
            CpuData::U32(v) => v.foreign_owner(),
            CpuData::I64(v) => v.foreign_owner(),
        }
    }
}

macro_rules! cpu_data_from_vec {
    ($($t:ty => $variant:ident),*) => {$(
        impl From<Vec<$t>> for CpuData {
            fn from(v: Vec<$t>) -> Self {
                CpuData::$variant(v.into())
            }
        }
    )*};
}
cpu_data_from_vec!(f32 => F32, f64 => F64, bf16 => BF16, u32 => U32, i64 => I64);

/// A shared buffer of elements, in host memory or (with the `cuda` feature) on a GPU. Cloning
/// shares it. When the last handle of a host buffer drops, its elements go back to the process's
/// buffer pool for reuse by later ops (`crate::pool`); a device buffer goes back to its device's
/// caching allocator.
#[derive(Clone, Debug)]
pub struct Storage(Arc<Buffer>);

/// The lock-protected elements behind a storage.
#[derive(Debug)]
enum Buffer {
    Cpu(RwLock<CpuData>),
    #[cfg(feature = "cuda")]
    Cuda { device: Device, data: RwLock<crate::cuda::DeviceData> },
}

impl Drop for Buffer {
    #[allow(irrefutable_let_patterns, reason = "the pattern is refutable with the cuda feature")]
    fn drop(&mut self) {
        if let Buffer::Cpu(data) = self {
            pool::give_data(std::mem::replace(data.get_mut(), CpuData::U32(Elements::default())));
        }
    }
}

impl Storage {
    /// Wraps host elements into a new storage.
    pub fn new(data: CpuData) -> Self {
        Storage(Arc::new(Buffer::Cpu(RwLock::new(data))))
    }

    /// Wraps device elements into a new storage on `device`.
    #[cfg(feature = "cuda")]
    pub(crate) fn new_cuda(device: Device, data: crate::cuda::DeviceData) -> Self {
        Storage(Arc::new(Buffer::Cuda { device, data: RwLock::new(data) }))
    }

    /// Where the elements live.
    pub fn device(&self) -> Device {
        match &*self.0 {
            Buffer::Cpu(_) => Device::Cpu,
            #[cfg(feature = "cuda")]
            Buffer::Cuda { device, .. } => *device,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match &*self.0 {
            Buffer::Cpu(data) => data.read_recursive().len(),
            #[cfg(feature = "cuda")]
            Buffer::Cuda { data, .. } => data.read_recursive().len(),
        }
    }

    /// Whether the storage holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Reads host elements (recursive read lock: nested reads of the same storage never block).
    /// A device storage is an error: move the tensor to the CPU first.
    pub fn read(&self) -> Result<RwLockReadGuard<'_, CpuData>> {
        match &*self.0 {
            Buffer::Cpu(data) => Ok(data.read_recursive()),
            #[cfg(feature = "cuda")]
            Buffer::Cuda { device, .. } => Err(Error::UnsupportedDevice { op: "read host elements", device: *device }),
        }
    }

    /// Writes host elements (see [`Storage::read`]).
    pub fn write(&self) -> Result<RwLockWriteGuard<'_, CpuData>> {
        match &*self.0 {
            Buffer::Cpu(data) => Ok(data.write()),
            #[cfg(feature = "cuda")]
            Buffer::Cuda { device, .. } => Err(Error::UnsupportedDevice { op: "write host elements", device: *device }),
        }
    }

    /// Reads device elements; a host storage is an error.
    #[cfg(feature = "cuda")]
    pub(crate) fn read_cuda(&self, op: &'static str) -> Result<RwLockReadGuard<'_, crate::cuda::DeviceData>> {
        match &*self.0 {
            Buffer::Cuda { data, .. } => Ok(data.read_recursive()),
            Buffer::Cpu(_) => Err(Error::UnsupportedDevice { op, device: Device::Cpu }),
        }
    }

    /// Writes device elements; a host storage is an error.
    #[cfg(feature = "cuda")]
    pub(crate) fn write_cuda(&self, op: &'static str) -> Result<RwLockWriteGuard<'_, crate::cuda::DeviceData>> {
        match &*self.0 {
            Buffer::Cuda { data, .. } => Ok(data.write()),
            Buffer::Cpu(_) => Err(Error::UnsupportedDevice { op, device: Device::Cpu }),
        }
    }

    /// Whether two handles share one buffer.
    pub fn same(&self, other: &Storage) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Whether this handle is the only one.
    pub fn is_unique(&self) -> bool {
        Arc::strong_count(&self.0) == 1
    }
}
