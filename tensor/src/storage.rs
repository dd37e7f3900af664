//! Tensor storage: a reference-counted, lock-protected buffer of one dtype that many tensors
//! (views) can share.
//!
//! Ownership protocol: ops read storages under a (recursive) read lock and always write their
//! results into fresh storages, so sharing is safe. Only the explicit in-place methods
//! (`Tensor::add_assign_`, `copy_from_`, `zero_` and the optimizers built on them) take the write
//! lock; they first gather their source into an owned buffer, so a tensor updated from a view of
//! itself cannot deadlock. Flat parameter and gradient buckets are storages that many parameter
//! tensors view at different offsets.

use crate::pool;
use half::bf16;
use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use rtx_kernels::DType;
use std::sync::Arc;

/// The elements of a CPU storage.
#[derive(Clone, Debug)]
pub enum CpuData {
    /// f32 elements.
    F32(Vec<f32>),
    /// f64 elements.
    F64(Vec<f64>),
    /// bf16 elements.
    BF16(Vec<bf16>),
    /// u32 elements (indices, labels).
    U32(Vec<u32>),
}

impl CpuData {
    /// The dtype of the elements.
    pub fn dtype(&self) -> DType {
        match self {
            CpuData::F32(_) => DType::F32,
            CpuData::F64(_) => DType::F64,
            CpuData::BF16(_) => DType::BF16,
            CpuData::U32(_) => DType::U32,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            CpuData::F32(v) => v.len(),
            CpuData::F64(v) => v.len(),
            CpuData::BF16(v) => v.len(),
            CpuData::U32(v) => v.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `len` zeros of `dtype`.
    pub fn zeros(dtype: DType, len: usize) -> Self {
        match dtype {
            DType::F32 => CpuData::F32(pool::zeroed(len)),
            DType::F64 => CpuData::F64(pool::zeroed(len)),
            DType::BF16 => CpuData::BF16(pool::zeroed(len)),
            DType::U32 => CpuData::U32(pool::zeroed(len)),
        }
    }

    /// The raw little-endian bytes of the elements (safetensors layout).
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            CpuData::F32(v) => bytemuck::cast_slice(v),
            CpuData::F64(v) => bytemuck::cast_slice(v),
            CpuData::BF16(v) => bytemuck::cast_slice(v),
            CpuData::U32(v) => bytemuck::cast_slice(v),
        }
    }
}

/// A shared buffer of elements. Cloning shares it. When the last handle drops, the buffer goes
/// back to the process's buffer pool for reuse by later ops (`crate::pool`).
#[derive(Clone, Debug)]
pub struct Storage(Arc<Buffer>);

/// The lock-protected elements behind a storage; returns them to the pool when dropped.
#[derive(Debug)]
struct Buffer(RwLock<CpuData>);

impl Drop for Buffer {
    fn drop(&mut self) {
        pool::give_data(std::mem::replace(self.0.get_mut(), CpuData::U32(Vec::new())));
    }
}

impl Storage {
    /// Wraps elements into a new storage.
    pub fn new(data: CpuData) -> Self {
        Storage(Arc::new(Buffer(RwLock::new(data))))
    }

    /// Reads the elements (recursive read lock: nested reads of the same storage never block).
    pub fn read(&self) -> RwLockReadGuard<'_, CpuData> {
        self.0 .0.read_recursive()
    }

    /// Writes the elements.
    pub fn write(&self) -> RwLockWriteGuard<'_, CpuData> {
        self.0 .0.write()
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
