//! Device memory: a caching allocator, the [`Buffer`] it hands out, and page-locked
//! [`PinnedBuffer`]s for host↔device copies.
//!
//! The allocator rounds every request up to a size class (512-byte steps up to 4 KiB, then four
//! classes per power of two, so at most 25% is wasted) and keeps freed blocks in a free list per
//! class; a request takes a cached block of its class before asking the driver. All work of a
//! [`super::Device`] runs on its one stream, so a block freed on the host while a queued kernel
//! still reads it can be handed out again at once: the next user's work is queued behind that
//! kernel (the reasoning PyTorch's caching allocator uses per stream). When the driver is out of
//! memory, the cache is emptied and the request retried once.
//!
//! Ownership: the pool is shared (`Arc`) by its device and every live buffer; a buffer gives its
//! block back in `Drop`, and the pool returns every cached block to the driver when the last
//! owner goes.

use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{result as drv, sys, CudaContext, DeviceRepr};
use half::bf16;

use super::error::{CudaError, OpContext, Result};
use crate::DType;

/// An element type that device buffers can hold.
pub trait DeviceElem: DeviceRepr + Copy + Default + Send + Sync + 'static + private::Sealed {
    /// The matching [`DType`].
    const DTYPE: DType;
}

impl DeviceElem for f32 {
    const DTYPE: DType = DType::F32;
}
impl DeviceElem for f64 {
    const DTYPE: DType = DType::F64;
}
impl DeviceElem for bf16 {
    const DTYPE: DType = DType::BF16;
}
impl DeviceElem for u32 {
    const DTYPE: DType = DType::U32;
}

mod private {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for half::bf16 {}
    impl Sealed for u32 {}
}

/// Counters of the caching allocator, in bytes (rounded to size classes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes in live buffers.
    pub allocated: usize,
    /// Bytes obtained from the driver and not yet returned (live plus cached).
    pub reserved: usize,
    /// Highest `allocated` seen.
    pub peak_allocated: usize,
    /// Highest `reserved` seen.
    pub peak_reserved: usize,
    /// Requests served from the cache.
    pub cache_hits: u64,
    /// Requests that went to the driver.
    pub driver_allocs: u64,
}

/// A device buffer of `len` elements from the caching allocator; returns its block to the cache
/// when dropped. Contents start undefined.
pub struct Buffer<T: DeviceElem> {
    ptr: sys::CUdeviceptr,
    len: usize,
    class_bytes: usize,
    pool: Arc<Pool>,
    _elem: PhantomData<T>,
}

/// Page-locked host memory: copies from and to it run at full PCIe/NVLink speed and can be
/// asynchronous. Allocated with `cuMemAllocHost`; freed on drop.
pub struct PinnedBuffer<T: DeviceElem> {
    ptr: *mut T,
    len: usize,
    ctx: Arc<CudaContext>,
}

/// The caching allocator shared by a device and its buffers.
pub(crate) struct Pool {
    ctx: Arc<CudaContext>,
    state: Mutex<PoolState>,
}

#[derive(Default)]
struct PoolState {
    free: BTreeMap<usize, Vec<sys::CUdeviceptr>>,
    stats: MemoryStats,
}

impl<T: DeviceElem> Buffer<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The raw device address (for kernels and cuBLAS).
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// The device address of element `idx` (which may be `len`, one past the end); an index
    /// past that is a `BufferTooSmall` error.
    pub fn device_ptr_at(&self, idx: usize) -> Result<sys::CUdeviceptr> {
        if idx > self.len {
            return Err(CudaError::BufferTooSmall { op: "device_ptr_at", buffer: "self", needed: idx, actual: self.len });
        }
        Ok(self.ptr + (idx * std::mem::size_of::<T>()) as u64)
    }
}

impl<T: DeviceElem> std::fmt::Debug for Buffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Buffer<{}>[{}]@{:#x}", T::DTYPE, self.len, self.ptr)
    }
}

impl<T: DeviceElem> Drop for Buffer<T> {
    fn drop(&mut self) {
        self.pool.release(self.ptr, self.class_bytes);
    }
}

impl<T: DeviceElem> PinnedBuffer<T> {
    /// Allocates `len` elements of page-locked host memory, zeroed.
    pub(crate) fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self> {
        ctx.bind_to_thread().op("pinned alloc")?;
        let bytes = (len.max(1)) * std::mem::size_of::<T>();
        // SAFETY: the context is current; the returned pointer is page-locked host memory of
        // `bytes` bytes, which we zero before handing out any slice of it.
        let ptr = unsafe { drv::malloc_host(bytes, 0) }.op("pinned alloc")? as *mut T;
        // SAFETY: `ptr` points to `bytes` writable bytes just allocated.
        unsafe { std::ptr::write_bytes(ptr as *mut u8, 0, bytes) };
        Ok(PinnedBuffer { ptr, len, ctx: ctx.clone() })
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The contents. Synchronize the device before reading what a copy wrote.
    pub fn as_slice(&self) -> &[T] {
        // SAFETY: `ptr` holds `len` initialized (zeroed, then written) elements owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The contents, writable.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<T: DeviceElem> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from `malloc_host` and is freed once; no copy is in flight
            // because the device synchronizes its copies before returning.
            let _ = unsafe { drv::free_host(self.ptr as *mut std::ffi::c_void) };
        }
    }
}

// SAFETY: the pinned block is owned by this value alone and is plain memory.
unsafe impl<T: DeviceElem> Send for PinnedBuffer<T> {}
// SAFETY: shared access only reads.
unsafe impl<T: DeviceElem> Sync for PinnedBuffer<T> {}

/// The size class of a request: 512-byte steps up to 4 KiB, then a quarter of the power of two
/// below the request.
pub(crate) fn size_class(bytes: usize) -> usize {
    if bytes <= 4096 {
        return bytes.div_ceil(512).max(1) * 512;
    }
    let high = usize::BITS - 1 - (bytes - 1).leading_zeros(); // floor(log2(bytes - 1))
    let step = 1usize << (high - 2);
    bytes.div_ceil(step) * step
}

impl Pool {
    pub(crate) fn new(ctx: Arc<CudaContext>) -> Arc<Self> {
        Arc::new(Pool { ctx, state: Mutex::new(PoolState::default()) })
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        // A poisoned lock only means a panic elsewhere while holding it; the free lists and
        // counters are still consistent because every update is a single step.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn stats(&self) -> MemoryStats {
        self.lock().stats
    }

    /// Hands out a buffer of `len` elements.
    pub(crate) fn alloc<T: DeviceElem>(self: &Arc<Self>, len: usize) -> Result<Buffer<T>> {
        let bytes = len * std::mem::size_of::<T>();
        let class_bytes = size_class(bytes);
        debug_assert!(class_bytes >= bytes && class_bytes.is_multiple_of(512));
        let cached = {
            let mut st = self.lock();
            let ptr = st.free.get_mut(&class_bytes).and_then(|v| v.pop());
            if let Some(p) = ptr {
                st.stats.cache_hits += 1;
                st.stats.allocated += class_bytes;
                st.stats.peak_allocated = st.stats.peak_allocated.max(st.stats.allocated);
                Some(p)
            } else {
                None
            }
        };
        let ptr = match cached {
            Some(p) => p,
            None => {
                self.ctx.bind_to_thread().op("device alloc")?;
                // SAFETY: the context is current; the block is tracked by the pool until freed.
                let ptr = match unsafe { drv::malloc_sync(class_bytes) } {
                    Ok(p) => p,
                    Err(_) => {
                        self.empty_cache()?;
                        // SAFETY: as above.
                        unsafe { drv::malloc_sync(class_bytes) }.map_err(|source| CudaError::OutOfMemory {
                            bytes: class_bytes,
                            reserved: self.stats().reserved,
                            source,
                        })?
                    }
                };
                let mut st = self.lock();
                st.stats.driver_allocs += 1;
                st.stats.allocated += class_bytes;
                st.stats.reserved += class_bytes;
                st.stats.peak_allocated = st.stats.peak_allocated.max(st.stats.allocated);
                st.stats.peak_reserved = st.stats.peak_reserved.max(st.stats.reserved);
                ptr
            }
        };
        Ok(Buffer { ptr, len, class_bytes, pool: self.clone(), _elem: PhantomData })
    }

    fn release(&self, ptr: sys::CUdeviceptr, class_bytes: usize) {
        let mut st = self.lock();
        debug_assert!(st.stats.allocated >= class_bytes);
        st.stats.allocated -= class_bytes;
        st.free.entry(class_bytes).or_default().push(ptr);
    }

    /// Returns every cached (free) block to the driver.
    pub(crate) fn empty_cache(&self) -> Result<()> {
        let blocks: Vec<(usize, Vec<sys::CUdeviceptr>)> = std::mem::take(&mut self.lock().free).into_iter().collect();
        if blocks.is_empty() {
            return Ok(());
        }
        self.ctx.bind_to_thread().op("empty cache")?;
        // Work queued on the stream may still use a cached block.
        self.ctx.synchronize().op("empty cache")?;
        for (class_bytes, ptrs) in blocks {
            for p in ptrs {
                // SAFETY: `p` came from `malloc_sync`, is not in use (it was in the free list
                // and the context is synchronized) and is freed once.
                unsafe { drv::free_sync(p) }.op("empty cache")?;
                self.lock().stats.reserved -= class_bytes;
            }
        }
        Ok(())
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let _ = self.empty_cache();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_round_up_by_at_most_a_quarter() {
        // Goal: classes are aligned, never smaller than the request, and waste ≤ 25% above 4 KiB.
        assert_eq!(size_class(0), 512);
        assert_eq!(size_class(1), 512);
        assert_eq!(size_class(513), 1024);
        assert_eq!(size_class(4096), 4096);
        assert_eq!(size_class(4097), 5120);
        assert_eq!(size_class(1 << 20), 1 << 20);
        for bytes in (1..5_000_000).step_by(997) {
            let c = size_class(bytes);
            assert!(c >= bytes && c.is_multiple_of(512), "{bytes} -> {c}");
            if bytes > 4096 {
                assert!(c - bytes <= bytes / 4 + 1, "{bytes} -> {c}");
            }
        }
    }
}
