//! [`Device`]: one CUDA device with its context, its one stream, a cuBLAS handle, the caching
//! allocator, a pinned staging buffer for host↔device copies, and the loaded kernel modules.
//!
//! Opening a device first checks that the driver, cuBLAS and NVRTC libraries can be loaded
//! (cudarc panics on a missing library; here it is [`CudaError::DriverNotFound`] or
//! [`CudaError::LibraryNotFound`]). All work is queued on the device's stream in call order;
//! copies back to the host synchronize it. A `Device` can be shared between threads: the
//! allocator, the staging buffer and the module cache sit behind mutexes, and every entry point
//! binds the context to the calling thread.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{result as drv, sys, CudaContext, CudaEvent, CudaFunction, CudaModule, CudaStream};
use rayon::prelude::*;

use super::alloc::{Buffer, DeviceElem, MemoryStats, PinnedBuffer, Pool};
use super::error::{check_len, CudaError, OpContext, Result};
use super::nvrtc::{self, Module};

/// Bytes of the pinned staging buffer that pageable host slices are copied through (two
/// halves, so the host copy of one chunk overlaps the DMA of the previous one).
pub const STAGING_BYTES: usize = 32 << 20;

const STAGING_HALF_BYTES: usize = STAGING_BYTES / 2;

/// Host bytes per task of the parallel copy into and out of the staging buffer.
const COPY_TASK_BYTES: usize = 1 << 20;

/// The two page-locked halves of the staging buffer and, per half, the event recorded after the
/// last DMA that used it.
struct Staging {
    halves: [PinnedBuffer<u32>; 2],
    events: [CudaEvent; 2],
}

impl Staging {
    fn half(&mut self, slot: usize) -> &mut [u8] {
        let words = self.halves[slot].as_mut_slice();
        // SAFETY: u32 words viewed as bytes; the borrow of `self` keeps the buffer alive.
        unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut u8, std::mem::size_of_val(words)) }
    }
}

/// `dst.copy_from_slice(src)` split over the thread pool.
fn parallel_copy(src: &[u8], dst: &mut [u8]) {
    debug_assert_eq!(src.len(), dst.len());
    if src.len() <= COPY_TASK_BYTES {
        dst.copy_from_slice(src);
        return;
    }
    dst.par_chunks_mut(COPY_TASK_BYTES).zip(src.par_chunks(COPY_TASK_BYTES)).for_each(|(d, s)| d.copy_from_slice(s));
}

/// One CUDA device. See the module docs.
pub struct Device {
    ordinal: usize,
    name: String,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    pub(crate) blas: CudaBlas,
    pool: Arc<Pool>,
    staging: Mutex<Option<Staging>>,
    modules: Mutex<HashMap<Module, Arc<CudaModule>>>,
    functions: Mutex<HashMap<&'static str, Arc<CudaFunction>>>,
    /// cuBLASLt handle, workspace and chosen algorithms, made on first use.
    pub(crate) lt: Mutex<Option<super::blas_lt::LtState>>,
    /// Timing probe of this device's bf16 attention backward (0 = none; see
    /// `Device::set_flash_backward_bf16_probe`).
    pub(crate) bwd_probe: std::sync::atomic::AtomicI32,
    /// Keys per block of this device's bf16 attention backward at head dim 64 (0 = the
    /// default; see `Device::set_flash_backward_bf16_keys`).
    pub(crate) bwd_keys: std::sync::atomic::AtomicUsize,
    /// Query rows per block of this device's bf16 attention forward at head dim 64 (0 = the
    /// default; see `Device::set_flash_forward_bf16_rows`).
    pub(crate) fwd_rows: std::sync::atomic::AtomicUsize,
    /// Whether the bf16 fused classifier holds rows in registers (see
    /// `Device::set_fused_classifier_regs`).
    pub(crate) classifier_regs: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cuda:{} ({})", self.ordinal, self.name)
    }
}

/// Checks that the driver, cuBLAS and NVRTC libraries can be loaded, without loading them for
/// use (cudarc panics on first use of a missing one).
pub fn probe_libraries() -> Result<()> {
    // SAFETY: these only try to dlopen the library names and drop the handles.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaError::DriverNotFound);
    }
    // SAFETY: as above.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(CudaError::LibraryNotFound { name: "cublas" });
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::LibraryNotFound { name: "nvrtc" });
    }
    Ok(())
}

impl Device {
    /// Opens device `ordinal`: checks the libraries, creates the context, a stream and a cuBLAS
    /// handle. Kernel modules are compiled and loaded on first use.
    pub fn new(ordinal: usize) -> Result<Self> {
        probe_libraries()?;
        let count = CudaContext::device_count().op("device count")?;
        let count = usize::try_from(count).unwrap_or(0);
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).op("create context")?;
        let name = ctx.name().op("device name")?;
        let stream = ctx.new_stream().op("create stream")?;
        let blas = CudaBlas::new(stream.clone()).op("create cuBLAS handle")?;
        let pool = Pool::new(ctx.clone());
        Ok(Device {
            ordinal,
            name,
            ctx,
            stream,
            blas,
            pool,
            staging: Mutex::new(None),
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            lt: Mutex::new(None),
            bwd_probe: std::sync::atomic::AtomicI32::new(0),
            bwd_keys: std::sync::atomic::AtomicUsize::new(0),
            fwd_rows: std::sync::atomic::AtomicUsize::new(0),
            classifier_regs: std::sync::atomic::AtomicBool::new(true),
        })
    }

    /// The number of CUDA devices, or the error saying why there are none usable.
    pub fn count() -> Result<usize> {
        probe_libraries()?;
        let n = CudaContext::device_count().op("device count")?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's marketing name (`NVIDIA H200`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Compute capability (major, minor).
    pub fn compute_capability(&self) -> Result<(i32, i32)> {
        self.ctx.compute_capability().op("compute capability")
    }

    /// The cudarc context, for code that calls CUDA directly (benchmarks, NCCL).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream all of this device's work runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits until all queued work is done.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().op("synchronize")
    }

    /// Allocator counters.
    pub fn memory_stats(&self) -> MemoryStats {
        self.pool.stats()
    }

    /// Returns the allocator's cached free blocks to the driver.
    pub fn empty_cache(&self) -> Result<()> {
        self.pool.empty_cache()
    }

    /// A buffer of `len` elements with undefined contents.
    pub fn alloc<T: DeviceElem>(&self, len: usize) -> Result<Buffer<T>> {
        self.pool.alloc(len)
    }

    /// A buffer of `len` zero-bit elements.
    pub fn zeros<T: DeviceElem>(&self, len: usize) -> Result<Buffer<T>> {
        let buf = self.pool.alloc::<T>(len)?;
        self.memset_zero(&buf)?;
        Ok(buf)
    }

    /// Sets every byte of `buf` to zero (queued).
    pub fn memset_zero<T: DeviceElem>(&self, buf: &Buffer<T>) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the range lies inside the buffer's block; the stream orders it with other work.
        unsafe { drv::memset_d8_async(buf.device_ptr(), 0, buf.len() * std::mem::size_of::<T>(), self.stream.cu_stream()) }.op("memset")
    }

    /// Page-locked host memory of `len` zeroed elements.
    pub fn alloc_pinned<T: DeviceElem>(&self, len: usize) -> Result<PinnedBuffer<T>> {
        PinnedBuffer::new(&self.ctx, len)
    }

    /// A new device buffer holding a copy of `src`.
    pub fn htod<T: DeviceElem>(&self, src: &[T]) -> Result<Buffer<T>> {
        let mut buf = self.pool.alloc::<T>(src.len())?;
        self.copy_htod(src, &mut buf)?;
        Ok(buf)
    }

    /// Copies `src` into the start of `dst` through the two pinned staging halves (the host
    /// copy into one half, on all cores, overlaps the DMA out of the other); returns when the
    /// copy is done, so `src` may change afterwards.
    pub fn copy_htod<T: DeviceElem>(&self, src: &[T], dst: &mut Buffer<T>) -> Result<()> {
        const OP: &str = "copy_htod";
        check_len(OP, "dst", dst.len(), src.len())?;
        self.bind()?;
        // SAFETY: `src` is plain-old-data elements, viewed as bytes.
        let src_bytes = unsafe { std::slice::from_raw_parts(src.as_ptr() as *const u8, std::mem::size_of_val(src)) };
        let mut guard = self.staging()?;
        let staging = guard.as_mut().ok_or(CudaError::Unsupported { op: OP, what: "staging buffer missing".into() })?;
        for (idx, off) in (0..src_bytes.len()).step_by(STAGING_HALF_BYTES).enumerate() {
            let n = (src_bytes.len() - off).min(STAGING_HALF_BYTES);
            let slot = idx % 2;
            // The DMA that last read this half must be done before it is overwritten.
            staging.events[slot].synchronize().op(OP)?;
            let half = staging.half(slot);
            parallel_copy(&src_bytes[off..off + n], &mut half[..n]);
            // SAFETY: `dst` holds at least `off + n` bytes; the half is page-locked and not
            // written again before its event (recorded right after) completes.
            unsafe { drv::memcpy_htod_async(dst.device_ptr() + off as u64, &half[..n], self.stream.cu_stream()) }.op(OP)?;
            staging.events[slot].record(&self.stream).op(OP)?;
        }
        self.synchronize()
    }

    /// Copies a pinned host buffer into the start of `dst` with one DMA; returns when done.
    pub fn copy_pinned_htod<T: DeviceElem>(&self, src: &PinnedBuffer<T>, dst: &mut Buffer<T>) -> Result<()> {
        check_len("copy_pinned_htod", "dst", dst.len(), src.len())?;
        self.bind()?;
        // SAFETY: `dst` is long enough; `src` is page-locked and borrowed until the sync below.
        unsafe { drv::memcpy_htod_async(dst.device_ptr(), src.as_slice(), self.stream.cu_stream()) }.op("copy_pinned_htod")?;
        self.synchronize()
    }

    /// Copies the start of `src` into a pinned host buffer with one DMA; returns when done.
    pub fn copy_dtoh_pinned<T: DeviceElem>(&self, src: &Buffer<T>, dst: &mut PinnedBuffer<T>) -> Result<()> {
        check_len("copy_dtoh_pinned", "src", src.len(), dst.len())?;
        self.bind()?;
        // SAFETY: `src` holds at least `dst.len()` elements; `dst` is borrowed until the sync.
        unsafe { drv::memcpy_dtoh_async(dst.as_mut_slice(), src.device_ptr(), self.stream.cu_stream()) }.op("copy_dtoh_pinned")?;
        self.synchronize()
    }

    /// Copies the whole buffer back to a new vector (waits for queued work).
    pub fn dtoh<T: DeviceElem>(&self, src: &Buffer<T>) -> Result<Vec<T>> {
        let mut out = vec![T::default(); src.len()];
        self.copy_dtoh(src, &mut out)?;
        Ok(out)
    }

    /// Copies the first `dst.len()` elements of `src` to `dst` through the two pinned staging
    /// halves (the DMA into one half overlaps the host copy out of the other).
    pub fn copy_dtoh<T: DeviceElem>(&self, src: &Buffer<T>, dst: &mut [T]) -> Result<()> {
        const OP: &str = "copy_dtoh";
        check_len(OP, "src", src.len(), dst.len())?;
        self.bind()?;
        // SAFETY: `dst` is plain-old-data elements, viewed as bytes.
        let dst_bytes = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr() as *mut u8, std::mem::size_of_val(dst)) };
        let total = dst_bytes.len();
        let mut guard = self.staging()?;
        let staging = guard.as_mut().ok_or(CudaError::Unsupported { op: OP, what: "staging buffer missing".into() })?;
        let n_chunks = total.div_ceil(STAGING_HALF_BYTES);
        let chunk = |idx: usize| (idx * STAGING_HALF_BYTES, (total - idx * STAGING_HALF_BYTES).min(STAGING_HALF_BYTES));
        let stream = self.stream.cu_stream();
        let issue = |staging: &mut Staging, idx: usize| -> Result<()> {
            let (off, n) = chunk(idx);
            let slot = idx % 2;
            // SAFETY: `src` holds at least `off + n` bytes; the half is read on the host only
            // after the event recorded below completes.
            unsafe { drv::memcpy_dtoh_async(&mut staging.half(slot)[..n], src.device_ptr() + off as u64, stream) }.op(OP)?;
            staging.events[slot].record(&self.stream).op(OP)
        };
        for idx in 0..n_chunks.min(2) {
            issue(staging, idx)?;
        }
        for idx in 0..n_chunks {
            let (off, n) = chunk(idx);
            let slot = idx % 2;
            staging.events[slot].synchronize().op(OP)?;
            parallel_copy(&staging.half(slot)[..n], &mut dst_bytes[off..off + n]);
            if idx + 2 < n_chunks {
                issue(staging, idx + 2)?;
            }
        }
        Ok(())
    }

    /// Device-to-device copy of `src` into the start of `dst` (queued).
    pub fn copy_dtod<T: DeviceElem>(&self, src: &Buffer<T>, dst: &mut Buffer<T>) -> Result<()> {
        check_len("copy_dtod", "dst", dst.len(), src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: both ranges lie inside their blocks; distinct buffers never overlap.
        unsafe { drv::memcpy_dtod_async(dst.device_ptr(), src.device_ptr(), src.len() * std::mem::size_of::<T>(), self.stream.cu_stream()) }.op("copy_dtod")
    }

    /// Device-to-device copy of `n` elements from `src[src_offset..]` into `dst[dst_offset..]`
    /// (queued): packing many tensors into one buffer, or unpacking it.
    pub fn copy_dtod_range<T: DeviceElem>(&self, src: &Buffer<T>, src_offset: usize, dst: &mut Buffer<T>, dst_offset: usize, n: usize) -> Result<()> {
        const OP: &str = "copy_dtod_range";
        check_len(OP, "src", src.len(), src_offset + n)?;
        check_len(OP, "dst", dst.len(), dst_offset + n)?;
        if n == 0 {
            return Ok(());
        }
        self.bind()?;
        let size = std::mem::size_of::<T>();
        // SAFETY: both ranges were checked to lie inside their buffers; distinct buffers never
        // overlap.
        unsafe {
            drv::memcpy_dtod_async(
                dst.device_ptr() + (dst_offset * size) as u64,
                src.device_ptr() + (src_offset * size) as u64,
                n * size,
                self.stream.cu_stream(),
            )
        }
        .op(OP)
    }

    /// Runs `f` once to warm up, then `iters` times between two CUDA events; returns the mean
    /// milliseconds per run as the device measured it.
    pub fn time_ms(&self, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
        f()?;
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.ctx.new_event(flags).op("timer event")?;
        let end = self.ctx.new_event(flags).op("timer event")?;
        start.record(&self.stream).op("timer record")?;
        for _ in 0..iters {
            f()?;
        }
        end.record(&self.stream).op("timer record")?;
        end.synchronize().op("timer sync")?;
        let ms = start.elapsed_ms(&end).op("timer elapsed")?;
        Ok(ms as f64 / iters.max(1) as f64)
    }

    /// The kernel `name` of `module`, compiling and loading the module on first use.
    pub(crate) fn function(&self, module: Module, name: &'static str) -> Result<Arc<CudaFunction>> {
        let mut functions = self.functions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = functions.get(name) {
            return Ok(f.clone());
        }
        let loaded = self.module(module)?;
        let f = Arc::new(loaded.load_function(name).op("load kernel")?);
        functions.insert(name, f.clone());
        Ok(f)
    }

    /// Compiles (in parallel, one thread per module) and loads every built-in module now, so
    /// later timings exclude it.
    pub fn warm_up(&self) -> Result<()> {
        let cc = self.compute_capability()?;
        let compiled: Vec<Result<()>> = std::thread::scope(|scope| {
            let handles: Vec<_> = Module::ALL.iter().map(|&m| scope.spawn(move || nvrtc::cubin(m, cc).map(|_| ()))).collect();
            handles.into_iter().map(|h| h.join().unwrap_or(Err(CudaError::Unsupported { op: "warm_up", what: "compile thread panicked".into() }))).collect()
        });
        for r in compiled {
            r?;
        }
        for m in Module::ALL {
            self.module(m)?;
        }
        Ok(())
    }

    /// The loaded `module`, compiling and loading it on first use.
    fn module(&self, module: Module) -> Result<Arc<CudaModule>> {
        let mut modules = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = modules.get(&module) {
            return Ok(m.clone());
        }
        let image = nvrtc::cubin(module, self.compute_capability()?)?;
        let m = self.ctx.load_module(image).op("load kernel module")?;
        modules.insert(module, m.clone());
        Ok(m)
    }

    pub(crate) fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().op("bind context")
    }

    fn staging(&self) -> Result<std::sync::MutexGuard<'_, Option<Staging>>> {
        let mut guard = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        if guard.is_none() {
            let halves = [PinnedBuffer::new(&self.ctx, STAGING_HALF_BYTES / 4)?, PinnedBuffer::new(&self.ctx, STAGING_HALF_BYTES / 4)?];
            let events = [self.ctx.new_event(None).op("staging event")?, self.ctx.new_event(None).op("staging event")?];
            // Record both once so the first wait on each returns at once.
            for e in &events {
                e.record(&self.stream).op("staging event")?;
            }
            *guard = Some(Staging { halves, events });
        }
        Ok(guard)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_driver_is_an_error_not_a_panic() {
        // Goal: the cuda build runs on CPU-only machines (CI). Method: opening device 0 either
        // works (a GPU machine) or returns a typed error; it must not panic.
        match Device::new(0) {
            Ok(dev) => assert!(!dev.name().is_empty()),
            Err(CudaError::DriverNotFound) => {
                assert_eq!(Device::count().err().map(|e| e.to_string()), Some(CudaError::DriverNotFound.to_string()));
            }
            Err(e) => assert!(!e.to_string().is_empty()),
        }
    }

    #[test]
    fn device_is_shareable_between_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Device>();
        assert_send_sync::<Buffer<f32>>();
    }
}
