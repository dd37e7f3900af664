//! [`NcclCommunicator`] (feature `nccl`): a group of GPU ranks running NCCL collectives on device
//! buffers ([`Buffer`]), one rank per [`Device`], bootstrapped over a host [`Communicator`].
//!
//! Lifecycle. [`NcclCommunicator::new`] is collective over the host communicator: group rank 0
//! makes the NCCL unique id, it travels over our own control plane ([`super::exchange_unique_id`]),
//! and every rank calls `ncclCommInitRankConfig` on its device. Every operation is queued on the
//! device's one stream (so it is ordered with the kernels and copies of `rtx-kernels`), then the
//! returned future polls a CUDA event recorded after it; `Ok` means the operation has completed on
//! the device. The `start_*` methods only queue (for overlapping several operations, or for
//! benchmarks); [`NcclCommunicator::wait`] then waits for everything queued so far.
//!
//! Decisions (constraint, choice, consequence):
//! - *A dead peer must not hang a rank forever, and a stuck NCCL call cannot be interrupted.* The
//!   communicator is created **non-blocking** (`ncclConfig_t.blocking = 0`): NCCL calls return at
//!   once (possibly `ncclInProgress`) and we poll `ncclCommGetAsyncError` and the CUDA event from
//!   async code, yielding to the runtime for the first few thousand polls (small operations finish
//!   in microseconds) and then sleeping with back-off up to 1 ms. Each wait is bounded by
//!   [`NcclOptions::op_timeout`] (default: the host [`CommConfig`](crate::CommConfig)'s
//!   `op_timeout`) measured with `tokio::time`; on expiry the communicator is aborted
//!   (`ncclCommAbort` makes stuck kernels exit) and the operation fails with
//!   [`Error::DeviceTimeout`]. An NCCL error (`ncclCommGetAsyncError`, e.g. a remote error) aborts
//!   it too ([`Error::Nccl`]). A peer the host control plane has already seen go
//!   ([`Error::PeerLost`]) aborts it as soon as a waiting operation notices (once it stops
//!   spinning), without waiting for the timeout. Later operations then fail with
//!   [`Error::CommAborted`]: an aborted NCCL communicator cannot be repaired, only rebuilt.
//! - *Generations.* An `NcclCommunicator` belongs to the generation its host group had when it was
//!   created, and reads the group's current generation from the host communicator it keeps (a
//!   clone sharing the group). When the group moves on, whether by
//!   [`set_generation`](CollectiveGroup::set_generation) here or on the host communicator, the
//!   next poll of an in-flight operation aborts the NCCL communicator and every in-flight and later
//!   operation fails with [`Error::StaleGeneration`]. The supervisor re-forms the group and a new
//!   `NcclCommunicator` is built for the new generation.
//! - *Teardown.* [`shutdown`](NcclCommunicator::shutdown) finalizes (flushes NCCL's outstanding
//!   network work, bounded by the timeout) and destroys the communicator. Dropping one that was
//!   not shut down does the same, blocking the dropping thread for at most the timeout, then
//!   aborts; an aborted one needs nothing more.
//! - *Safe cudarc API or `sys`?* cudarc's safe `nccl::Comm` takes cudarc slices and creates only
//!   blocking communicators, so this module calls `cudarc::nccl::sys` directly, with the raw
//!   communicator behind a mutex (NCCL communicators are not thread-safe) and a SAFETY note at each
//!   call. NCCL is loaded at run time; [`probe_nccl`] turns a missing library into
//!   [`Error::NcclNotFound`] (cudarc would panic) and checks the version (the config struct and
//!   symbols bound are NCCL 2.28's, cudarc feature `nccl-02028`). cudarc looks the library up as
//!   `libnccl.so` (and a few other names, but not `libnccl.so.2`), so a machine with only NCCL's
//!   runtime package needs the `libnccl.so` link (the `-dev` package) or reports `NcclNotFound`.
//! - *Element types.* f32, f64 and bf16 ([`NcclElement`]). Reductions happen in the element type as
//!   NCCL does them (bf16 sums are not widened to f32 between hops as the host communicator
//!   does); `Avg` is NCCL's `ncclAvg`. Unlike the host communicator, `reduce_scatter` and
//!   `all_gather` need lengths divisible by the group size.
//!
//! Ownership: the host communicator, the device and a one-element scratch buffer (for `barrier`)
//! are owned here; the raw `ncclComm_t` lives in a mutex together with the abort reason, and is
//! null once aborted or destroyed. Operations must be issued in the same order on every rank, one
//! at a time per communicator (as with the host communicator).

use std::ffi::{c_int, c_void, CStr};
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use half::bf16;
use rtx_kernels::cuda::cudarc;
use rtx_kernels::cuda::{Buffer, Device, DeviceElem};
use tracing::Instrument;

use cudarc::driver::sys as cu;
use cudarc::nccl::sys as nccl;

use super::{exchange_unique_id, NcclUniqueId, NCCL_UNIQUE_ID_BYTES};
use crate::collective::{Collective, CollectiveGroup};
use crate::communicator::{CommConfig, Communicator};
use crate::element::Element;
use crate::error::{Error, Result};
use crate::frame::OpKind;
use crate::ReduceOp;

/// The oldest NCCL this build accepts: the `ncclConfig_t` layout and symbols bound are 2.28's.
pub const NCCL_MIN_VERSION: i32 = 22800;

/// Polls that yield to the runtime before the waiting starts to sleep.
const SPIN_POLLS: u32 = 4096;
/// While spinning, the generation, lost peers and the deadline are checked every this many polls.
const CHECK_EVERY_POLLS: u32 = 64;
/// First and longest sleep between polls once spinning is over.
const FIRST_POLL_SLEEP: Duration = Duration::from_micros(50);
const MAX_POLL_SLEEP: Duration = Duration::from_millis(1);
/// Sleep between polls while a drop finalizes the communicator (no runtime there).
const DROP_POLL_SLEEP: Duration = Duration::from_micros(200);

/// `ncclConfig_t` constants from `nccl.h` (`NCCL_CONFIG_INITIALIZER`).
const NCCL_CONFIG_MAGIC: u32 = 0xcafe_beef;
const NCCL_CONFIG_UNDEF_INT: c_int = c_int::MIN;
/// The layout version of the config struct we pass (2.28.0's fields).
const NCCL_CONFIG_VERSION: u32 = 22800;

const _: () = assert!(CHECK_EVERY_POLLS > 0 && SPIN_POLLS >= CHECK_EVERY_POLLS);
const _: () = assert!(std::mem::size_of::<nccl::ncclUniqueId>() == NCCL_UNIQUE_ID_BYTES);

/// An element type NCCL reduces on the device: f32, f64, bf16.
pub trait NcclElement: Element + DeviceElem + sealed::Sealed {}

impl NcclElement for f32 {}
impl NcclElement for f64 {}
impl NcclElement for bf16 {}

mod sealed {
    use super::nccl;

    pub trait Sealed {
        fn nccl_dtype() -> nccl::ncclDataType_t;
    }
    impl Sealed for f32 {
        fn nccl_dtype() -> nccl::ncclDataType_t {
            nccl::ncclDataType_t::ncclFloat32
        }
    }
    impl Sealed for f64 {
        fn nccl_dtype() -> nccl::ncclDataType_t {
            nccl::ncclDataType_t::ncclFloat64
        }
    }
    impl Sealed for half::bf16 {
        fn nccl_dtype() -> nccl::ncclDataType_t {
            nccl::ncclDataType_t::ncclBfloat16
        }
    }
}

/// Limits of an [`NcclCommunicator`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NcclOptions {
    /// How long one operation may take from being queued to completing on the device (and how
    /// long `shutdown` may take) before the communicator is aborted.
    pub op_timeout: Duration,
    /// How long `ncclCommInitRankConfig` may take (all ranks must join).
    pub init_timeout: Duration,
}

/// One rank of an NCCL communicator. See the module docs.
pub struct NcclCommunicator {
    host: Communicator,
    device: Arc<Device>,
    rank: usize,
    size: usize,
    generation: u64,
    options: NcclOptions,
    handle: Mutex<Handle>,
    scratch: Buffer<f32>,
}

/// The raw communicator and why it was aborted, if it was. `raw` is null once aborted or
/// destroyed (or if init never produced one).
struct Handle {
    raw: nccl::ncclComm_t,
    aborted: Option<String>,
}

// SAFETY: an `ncclComm_t` may be used from any thread as long as calls on it are not concurrent;
// the handle is only reached through `NcclCommunicator::handle`'s mutex.
unsafe impl Send for Handle {}

/// What a wait is for, for error messages.
#[derive(Clone, Copy, Debug)]
enum Stage {
    Init,
    Op(OpKind),
    Wait,
    Shutdown,
}

impl Stage {
    fn name(self) -> &'static str {
        match self {
            Stage::Init => "nccl init",
            Stage::Op(op) => op.as_str(),
            Stage::Wait => "wait",
            Stage::Shutdown => "nccl shutdown",
        }
    }
}

impl NcclOptions {
    /// Both timeouts from the host configuration's `op_timeout`.
    pub fn from_config(config: &CommConfig) -> Self {
        NcclOptions { op_timeout: config.op_timeout, init_timeout: config.op_timeout }
    }
}

/// Checks that the NCCL library can be loaded and is recent enough; returns its version
/// (`ncclGetVersion`, e.g. 22803 for 2.28.3).
pub fn probe_nccl() -> Result<i32> {
    // SAFETY: only tries to dlopen the library names and drops the handles.
    if !unsafe { nccl::is_culib_present() } {
        return Err(Error::NcclNotFound);
    }
    let mut version: c_int = 0;
    // SAFETY: the library is present (checked above), so the symbol loads; `version` is a valid
    // out-pointer.
    let code = unsafe { nccl::ncclGetVersion(&mut version) };
    if code != nccl::ncclResult_t::ncclSuccess {
        return Err(nccl_error("ncclGetVersion", code, None));
    }
    if version < NCCL_MIN_VERSION {
        return Err(Error::NcclVersion { found: version, required: NCCL_MIN_VERSION });
    }
    Ok(version)
}

/// A fresh NCCL unique id from `ncclGetUniqueId` (after [`probe_nccl`]). This is what group rank 0
/// contributes to the id exchange.
pub fn nccl_unique_id() -> Result<NcclUniqueId> {
    probe_nccl()?;
    let mut id = nccl::ncclUniqueId { internal: [0; NCCL_UNIQUE_ID_BYTES] };
    // SAFETY: NCCL is loaded (probed); `id` is a valid, writable `ncclUniqueId`.
    let code = unsafe { nccl::ncclGetUniqueId(&mut id) };
    if code != nccl::ncclResult_t::ncclSuccess {
        return Err(nccl_error("ncclGetUniqueId", code, None));
    }
    let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
    NcclUniqueId::from_bytes(&bytes)
}

impl NcclCommunicator {
    /// Creates this rank's NCCL communicator on `device`, collectively over `host` (every member
    /// of the host group calls this): rank 0 makes the unique id, the host group broadcasts it,
    /// every rank joins. Timeouts come from the host configuration.
    pub async fn new(host: &Communicator, device: Arc<Device>) -> Result<Self> {
        Self::with_options(host, device, NcclOptions::from_config(host.config())).await
    }

    /// [`new`](Self::new) with explicit limits.
    pub async fn with_options(host: &Communicator, device: Arc<Device>, options: NcclOptions) -> Result<Self> {
        let id = exchange_unique_id(host, nccl_unique_id).await?;
        Self::from_unique_id(host, device, id, options).await
    }

    /// Joins the NCCL communicator named by `id` (obtained by some other bootstrap) as rank
    /// `host.rank()` of `host.size()`.
    pub async fn from_unique_id(host: &Communicator, device: Arc<Device>, id: NcclUniqueId, options: NcclOptions) -> Result<Self> {
        probe_nccl()?;
        if options.op_timeout.is_zero() || options.init_timeout.is_zero() {
            return Err(Error::InvalidConfig { reason: "NCCL timeouts must be positive" });
        }
        let (rank, size, generation) = (host.rank(), host.size(), host.generation());
        let n_ranks = c_int::try_from(size).map_err(|_| Error::InvalidConfig { reason: "NCCL group size over i32::MAX" })?;
        let rank_c = c_int::try_from(rank).map_err(|_| Error::InvalidConfig { reason: "NCCL rank over i32::MAX" })?;
        let span = tracing::info_span!("nccl_init", group = host.group_id(), generation, rank, n_ranks = size, device = device.ordinal());
        async move {
            bind(&device, "nccl init")?;
            let scratch = device.zeros::<f32>(1).map_err(|e| Error::Cuda { op: "nccl scratch buffer", reason: e.to_string() })?;
            let mut comm = NcclCommunicator {
                host: host.clone(),
                device,
                rank,
                size,
                generation,
                options,
                handle: Mutex::new(Handle { raw: std::ptr::null_mut(), aborted: None }),
                scratch,
            };
            let mut sys_id = nccl::ncclUniqueId { internal: [0; NCCL_UNIQUE_ID_BYTES] };
            for (dst, &src) in sys_id.internal.iter_mut().zip(id.as_bytes()) {
                *dst = src as _;
            }
            let mut config = nonblocking_config();
            let mut raw: nccl::ncclComm_t = std::ptr::null_mut();
            // SAFETY: NCCL is loaded (probed); `raw`, `config` are valid for the call; the device's
            // context is current on this thread, so NCCL picks this device.
            let code = unsafe { nccl::ncclCommInitRankConfig(&mut raw, n_ranks, sys_id, rank_c, &mut config) };
            comm.handle.get_mut().unwrap_or_else(|e| e.into_inner()).raw = raw;
            match code {
                nccl::ncclResult_t::ncclSuccess | nccl::ncclResult_t::ncclInProgress => {}
                code => return Err(comm.fail(Stage::Init, code)),
            }
            comm.settle(Stage::Init).await?;
            tracing::info!("NCCL communicator ready");
            Ok(comm)
        }
        .instrument(span)
        .await
    }

    /// The device this rank runs on.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// The host communicator the group was bootstrapped over (it shares the group's generation).
    pub fn host(&self) -> &Communicator {
        &self.host
    }

    /// The generation this NCCL communicator was created at (the group's may have moved on).
    pub fn created_generation(&self) -> u64 {
        self.generation
    }

    /// The limits in force.
    pub fn options(&self) -> &NcclOptions {
        &self.options
    }

    /// Whether the communicator has been aborted, and why.
    pub fn aborted(&self) -> Option<String> {
        self.handle().aborted.clone()
    }

    /// Aborts the NCCL communicator now (in-flight operations fail; later ones fail with
    /// [`Error::CommAborted`]). Local: does not wait for peers.
    pub fn abort(&self, reason: &str) {
        self.abort_with(reason.to_string());
    }

    /// Queues an all-reduce of `buf` in place on the device's stream; see [`wait`](Self::wait).
    pub async fn start_all_reduce<T: NcclElement>(&self, buf: &mut Buffer<T>, op: ReduceOp) -> Result<()> {
        let (ptr, count) = (buf.device_ptr(), buf.len());
        if count == 0 {
            return Ok(());
        }
        // SAFETY: `buf` holds `count` elements of `T` on this device; the call is queued on the
        // device's stream, ordered with every other use of the buffer (the caching allocator
        // reuses blocks in stream order).
        self.launch(OpKind::AllReduce, |comm, stream| unsafe {
            nccl::ncclAllReduce(ptr as *const c_void, ptr as *mut c_void, count, T::nccl_dtype(), red_op(op), comm, stream)
        })
        .await
    }

    /// Queues a reduce-scatter: `output` (of `input.len() / size` elements) gets this rank's
    /// segment of the reduction of `input`.
    pub async fn start_reduce_scatter<T: NcclElement>(&self, input: &Buffer<T>, output: &mut Buffer<T>, op: ReduceOp) -> Result<()> {
        if input.len() % self.size != 0 {
            return Err(Error::NotDivisible { op: OpKind::ReduceScatter, len: input.len(), size: self.size });
        }
        let count = input.len() / self.size;
        if output.len() != count {
            return Err(Error::BufferLength { op: OpKind::ReduceScatter, expected: count, got: output.len() });
        }
        if count == 0 {
            return Ok(());
        }
        let (src, dst) = (input.device_ptr(), output.device_ptr());
        // SAFETY: `input` holds `count * size` and `output` `count` elements of `T` on this device
        // (checked above); distinct buffers do not overlap; queued on the device's stream.
        self.launch(OpKind::ReduceScatter, |comm, stream| unsafe {
            nccl::ncclReduceScatter(src as *const c_void, dst as *mut c_void, count, T::nccl_dtype(), red_op(op), comm, stream)
        })
        .await
    }

    /// Queues an all-gather: `output` (of `input.len() * size` elements) gets every rank's `input`
    /// in rank order.
    pub async fn start_all_gather<T: NcclElement>(&self, input: &Buffer<T>, output: &mut Buffer<T>) -> Result<()> {
        let count = input.len();
        let expected = count.saturating_mul(self.size);
        if output.len() != expected {
            return Err(Error::BufferLength { op: OpKind::AllGather, expected, got: output.len() });
        }
        if count == 0 {
            return Ok(());
        }
        let (src, dst) = (input.device_ptr(), output.device_ptr());
        // SAFETY: `input` holds `count` and `output` `count * size` elements of `T` on this device
        // (checked above); distinct buffers do not overlap; queued on the device's stream.
        self.launch(OpKind::AllGather, |comm, stream| unsafe {
            nccl::ncclAllGather(src as *const c_void, dst as *mut c_void, count, T::nccl_dtype(), comm, stream)
        })
        .await
    }

    /// Queues a broadcast of `buf` from group rank `root`, in place.
    pub async fn start_broadcast<T: NcclElement>(&self, buf: &mut Buffer<T>, root: usize) -> Result<()> {
        let root = self.check_rank(root)?;
        let (ptr, count) = (buf.device_ptr(), buf.len());
        if count == 0 {
            return Ok(());
        }
        // SAFETY: `buf` holds `count` elements of `T` on this device; queued on the device's stream.
        self.launch(OpKind::Broadcast, |comm, stream| unsafe {
            nccl::ncclBroadcast(ptr as *const c_void, ptr as *mut c_void, count, T::nccl_dtype(), root, comm, stream)
        })
        .await
    }

    /// Queues a reduce of `buf` into `buf` on group rank `root`, in place (other ranks' buffers
    /// are only read).
    pub async fn start_reduce<T: NcclElement>(&self, buf: &mut Buffer<T>, root: usize, op: ReduceOp) -> Result<()> {
        let root = self.check_rank(root)?;
        let (ptr, count) = (buf.device_ptr(), buf.len());
        if count == 0 {
            return Ok(());
        }
        // SAFETY: `buf` holds `count` elements of `T` on this device; queued on the device's stream.
        self.launch(OpKind::Reduce, |comm, stream| unsafe {
            nccl::ncclReduce(ptr as *const c_void, ptr as *mut c_void, count, T::nccl_dtype(), red_op(op), root, comm, stream)
        })
        .await
    }

    /// Queues a send of `buf` to group rank `dst` (matched by a receive of the same length there;
    /// NCCL cannot check lengths, a mismatch ends in the operation timeout).
    pub async fn start_send<T: NcclElement>(&self, buf: &Buffer<T>, dst: usize) -> Result<()> {
        let peer = self.check_peer(dst)?;
        let (ptr, count) = (buf.device_ptr(), buf.len());
        // SAFETY: `buf` holds `count` elements of `T` on this device; queued on the device's stream.
        self.launch(OpKind::Send, |comm, stream| unsafe { nccl::ncclSend(ptr as *const c_void, count, T::nccl_dtype(), peer, comm, stream) }).await
    }

    /// Queues a receive into `buf` from group rank `src`.
    pub async fn start_recv<T: NcclElement>(&self, buf: &mut Buffer<T>, src: usize) -> Result<()> {
        let peer = self.check_peer(src)?;
        let (ptr, count) = (buf.device_ptr(), buf.len());
        // SAFETY: `buf` holds `count` elements of `T` on this device; queued on the device's stream.
        self.launch(OpKind::Send, |comm, stream| unsafe { nccl::ncclRecv(ptr as *mut c_void, count, T::nccl_dtype(), peer, comm, stream) }).await
    }

    /// Waits until everything queued so far on the device's stream (operations started with the
    /// `start_*` methods included) has completed, bounded by the operation timeout, watching for
    /// NCCL errors, generation changes and lost peers as the operations themselves do.
    pub async fn wait(&self) -> Result<()> {
        self.complete(Stage::Wait).await
    }

    /// Finalizes (flushing outstanding work, bounded by the operation timeout) and destroys the
    /// communicator. Collective in effect: peers should shut down too.
    pub async fn shutdown(self) -> Result<()> {
        let span = self.span(Stage::Shutdown, 0);
        async {
            self.check_live(Stage::Shutdown)?;
            bind(&self.device, "nccl shutdown")?;
            let code = {
                let handle = self.handle();
                if handle.raw.is_null() {
                    // Aborted between the check above and this lock.
                    let reason = handle.aborted.clone().unwrap_or_default();
                    return Err(Error::CommAborted { op: Stage::Shutdown.name(), generation: self.generation, reason });
                }
                // SAFETY: `raw` is a live communicator (not aborted: checked above, and only the
                // lock holder changes it); calls on it are serialized by the lock.
                unsafe { nccl::ncclCommFinalize(handle.raw) }
            };
            match code {
                nccl::ncclResult_t::ncclSuccess | nccl::ncclResult_t::ncclInProgress => {}
                code => return Err(self.fail(Stage::Shutdown, code)),
            }
            self.settle(Stage::Shutdown).await?;
            let mut handle = self.handle();
            if !handle.raw.is_null() {
                // SAFETY: finalized and live; after this the handle is null, so it is never used again.
                let code = unsafe { nccl::ncclCommDestroy(handle.raw) };
                handle.raw = std::ptr::null_mut();
                handle.aborted = Some("shut down".into());
                if code != nccl::ncclResult_t::ncclSuccess {
                    drop(handle);
                    return Err(nccl_error("ncclCommDestroy", code, None));
                }
            }
            Ok(())
        }
        .instrument(span)
        .await
    }

    /// Queues one NCCL call (`call(comm, stream)`) and, if NCCL answers `ncclInProgress`, waits
    /// until it is queued for real.
    async fn launch(&self, op: OpKind, call: impl FnOnce(nccl::ncclComm_t, nccl::cudaStream_t) -> nccl::ncclResult_t) -> Result<()> {
        let stage = Stage::Op(op);
        self.check_live(stage)?;
        bind(&self.device, op.as_str())?;
        let code = {
            let handle = self.handle();
            if let Some(reason) = &handle.aborted {
                return Err(Error::CommAborted { op: op.as_str(), generation: self.generation, reason: reason.clone() });
            }
            let stream = self.device.stream().cu_stream() as nccl::cudaStream_t;
            call(handle.raw, stream)
        };
        match code {
            nccl::ncclResult_t::ncclSuccess => Ok(()),
            nccl::ncclResult_t::ncclInProgress => self.settle(stage).await,
            code => Err(self.fail(stage, code)),
        }
    }

    /// Waits until the communicator's state is no longer `ncclInProgress` (non-blocking init,
    /// calls, finalize).
    async fn settle(&self, stage: Stage) -> Result<()> {
        let timeout = match stage {
            Stage::Init => self.options.init_timeout,
            _ => self.options.op_timeout,
        };
        self.poll_until(stage, timeout, |comm| comm.async_state(stage)).await
    }

    /// Records an event on the device's stream and waits until the device has passed it.
    async fn complete(&self, stage: Stage) -> Result<()> {
        self.check_live(stage)?;
        bind(&self.device, stage.name())?;
        let flags = Some(cu::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        let event = self.device.context().new_event(flags).map_err(|e| Error::Cuda { op: "create completion event", reason: e.to_string() })?;
        event.record(self.device.stream()).map_err(|e| Error::Cuda { op: "record completion event", reason: e.to_string() })?;
        self.poll_until(stage, self.options.op_timeout, |comm| {
            // SAFETY: the event is alive (owned by this frame) and belongs to the device's context.
            match unsafe { cudarc::driver::result::event::query(event.cu_event()) } {
                Ok(()) => comm.async_state(stage),
                Err(e) if e.0 == cu::cudaError_enum::CUDA_ERROR_NOT_READY => Ok(false),
                Err(e) => Err(Error::Cuda { op: "query completion event", reason: e.to_string() }),
            }
        })
        .await
    }

    /// Polls `ready` (spinning, then sleeping with back-off) until it says done, checking the
    /// generation, lost peers, NCCL's asynchronous error and the deadline along the way.
    async fn poll_until(&self, stage: Stage, timeout: Duration, mut ready: impl FnMut(&Self) -> Result<bool>) -> Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut polls: u32 = 0;
        let mut sleep = FIRST_POLL_SLEEP;
        loop {
            if ready(self)? {
                return Ok(());
            }
            polls = polls.saturating_add(1);
            let spinning = polls < SPIN_POLLS;
            if !spinning || polls % CHECK_EVERY_POLLS == 0 {
                self.check_live(stage)?;
                if !spinning {
                    self.check_peers(stage)?;
                }
                self.async_state(stage)?;
                if tokio::time::Instant::now() >= deadline {
                    let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
                    self.abort_with(format!("{} timed out after {timeout_ms} ms", stage.name()));
                    return Err(Error::DeviceTimeout { op: stage.name(), timeout_ms });
                }
            }
            if spinning {
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(sleep).await;
                sleep = (sleep * 2).min(MAX_POLL_SLEEP);
            }
        }
    }

    /// `Ok(true)` when NCCL reports the communicator idle, `Ok(false)` while in progress; an
    /// asynchronous error aborts the communicator.
    fn async_state(&self, stage: Stage) -> Result<bool> {
        let (state, code) = {
            let handle = self.handle();
            if let Some(reason) = &handle.aborted {
                return Err(Error::CommAborted { op: stage.name(), generation: self.generation, reason: reason.clone() });
            }
            let mut state = nccl::ncclResult_t::ncclSuccess;
            // SAFETY: `raw` is live (not aborted, checked under this lock); `state` is a valid
            // out-pointer; calls on the communicator are serialized by the lock.
            let code = unsafe { nccl::ncclCommGetAsyncError(handle.raw, &mut state) };
            (state, code)
        };
        if code != nccl::ncclResult_t::ncclSuccess {
            return Err(self.fail(stage, code));
        }
        match state {
            nccl::ncclResult_t::ncclSuccess => Ok(true),
            nccl::ncclResult_t::ncclInProgress => Ok(false),
            state => Err(self.fail(stage, state)),
        }
    }

    /// Fails when the group has moved to another generation (aborting this communicator) or the
    /// communicator was aborted.
    fn check_live(&self, stage: Stage) -> Result<()> {
        let current = self.host.generation();
        if current != self.generation {
            self.abort_with(format!("group moved to generation {current}"));
            return Err(Error::StaleGeneration { expected: current, got: self.generation });
        }
        if let Some(reason) = &self.handle().aborted {
            return Err(Error::CommAborted { op: stage.name(), generation: self.generation, reason: reason.clone() });
        }
        Ok(())
    }

    /// Fails (aborting) when the host control plane has seen a member of the group go.
    fn check_peers(&self, stage: Stage) -> Result<()> {
        let lost = self.host.endpoint().shared().lost_ranks();
        let Some(&rank) = lost.iter().find(|r| self.host.members().contains(r)) else { return Ok(()) };
        self.abort_with(format!("peer rank {rank} lost during {}", stage.name()));
        Err(match stage {
            Stage::Op(op) => Error::PeerLost { rank, op },
            _ => Error::CommAborted { op: stage.name(), generation: self.generation, reason: format!("peer rank {rank} lost") },
        })
    }

    /// Turns an NCCL error code into [`Error::Nccl`] (with NCCL's last-error text) and aborts.
    fn fail(&self, stage: Stage, code: nccl::ncclResult_t) -> Error {
        let error = {
            let handle = self.handle();
            nccl_error(stage.name(), code, (!handle.raw.is_null()).then_some(handle.raw))
        };
        self.abort_with(error.to_string());
        error
    }

    /// Aborts the NCCL communicator (once) and records why.
    fn abort_with(&self, reason: String) {
        let mut handle = self.handle();
        if handle.aborted.is_some() {
            return;
        }
        tracing::warn!(rank = self.rank, generation = self.generation, reason = reason.as_str(), "aborting NCCL communicator");
        if !handle.raw.is_null() {
            // Binding can only fail if the context is gone, in which case NCCL fails too; the abort
            // is attempted regardless.
            let _ = self.device.context().bind_to_thread();
            // SAFETY: `raw` is live (not yet aborted or destroyed: only this lock holder changes
            // that), and null afterwards so it is never used again.
            let code = unsafe { nccl::ncclCommAbort(handle.raw) };
            if code != nccl::ncclResult_t::ncclSuccess {
                tracing::warn!(code = code as u32, "ncclCommAbort failed");
            }
            handle.raw = std::ptr::null_mut();
        }
        handle.aborted = Some(reason);
    }

    fn check_rank(&self, rank: usize) -> Result<c_int> {
        if rank >= self.size {
            return Err(Error::RankOutOfRange { rank, size: self.size });
        }
        // `size` fits a c_int (checked at creation).
        Ok(rank as c_int)
    }

    fn check_peer(&self, peer: usize) -> Result<c_int> {
        let peer_c = self.check_rank(peer)?;
        if peer == self.rank {
            return Err(Error::SelfPeer { op: OpKind::Send, rank: peer });
        }
        Ok(peer_c)
    }

    fn handle(&self) -> MutexGuard<'_, Handle> {
        self.handle.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn span(&self, stage: Stage, bytes: usize) -> tracing::Span {
        tracing::debug_span!("nccl", op = stage.name(), group = self.host.group_id(), generation = self.generation, rank = self.rank, bytes)
    }

    /// Queues `start` and waits for it to complete, inside a span.
    async fn run<F: Future<Output = Result<()>>>(&self, op: OpKind, bytes: usize, start: F) -> Result<()> {
        let span = self.span(Stage::Op(op), bytes);
        async {
            start.await?;
            self.complete(Stage::Op(op)).await
        }
        .instrument(span)
        .await
    }

    /// Drop's teardown: finalize, poll (blocking the thread, no runtime here) up to the operation
    /// timeout, destroy; abort instead if it does not settle.
    fn finalize_blocking(&self) {
        let mut handle = self.handle();
        if handle.raw.is_null() || handle.aborted.is_some() {
            return;
        }
        let _ = self.device.context().bind_to_thread();
        // SAFETY (this block): `raw` is live and we hold the lock for the whole teardown.
        let code = unsafe { nccl::ncclCommFinalize(handle.raw) };
        let deadline = std::time::Instant::now() + self.options.op_timeout;
        let mut settled = code == nccl::ncclResult_t::ncclSuccess || code == nccl::ncclResult_t::ncclInProgress;
        while settled {
            let mut state = nccl::ncclResult_t::ncclSuccess;
            // SAFETY: as above; `state` is a valid out-pointer.
            let code = unsafe { nccl::ncclCommGetAsyncError(handle.raw, &mut state) };
            if code != nccl::ncclResult_t::ncclSuccess || (state != nccl::ncclResult_t::ncclSuccess && state != nccl::ncclResult_t::ncclInProgress) {
                settled = false;
            } else if state == nccl::ncclResult_t::ncclSuccess {
                break;
            } else if std::time::Instant::now() >= deadline {
                settled = false;
            } else {
                std::thread::sleep(DROP_POLL_SLEEP);
            }
        }
        // SAFETY: as above; the handle is nulled right after, so it is never used again.
        let code = unsafe {
            if settled {
                nccl::ncclCommDestroy(handle.raw)
            } else {
                nccl::ncclCommAbort(handle.raw)
            }
        };
        if !settled || code != nccl::ncclResult_t::ncclSuccess {
            tracing::warn!(rank = self.rank, settled, code = code as u32, "NCCL communicator dropped without a clean finalize");
        }
        handle.raw = std::ptr::null_mut();
        handle.aborted = Some("dropped".into());
    }
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        self.finalize_blocking();
    }
}

impl std::fmt::Debug for NcclCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclCommunicator")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("generation", &self.generation)
            .field("device", &self.device.ordinal())
            .field("aborted", &self.handle().aborted)
            .finish()
    }
}

impl CollectiveGroup for NcclCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    /// The group's current generation (read from the host communicator).
    fn generation(&self) -> u64 {
        self.host.generation()
    }

    /// Moves the group (shared with the host communicator) to `generation` and aborts this NCCL
    /// communicator: in-flight and later operations fail with [`Error::StaleGeneration`].
    fn set_generation(&self, generation: u64) -> Result<()> {
        self.host.set_generation(generation)?;
        self.abort_with(format!("generation advanced to {generation}"));
        Ok(())
    }

    /// An all-reduce of one f32 on the device (NCCL has no barrier), waited for.
    fn barrier(&self) -> impl Future<Output = Result<()>> + Send {
        let ptr = self.scratch.device_ptr();
        self.run(OpKind::Barrier, 0, async move {
            // SAFETY: the scratch buffer holds one f32 on this device and lives as long as `self`;
            // queued on the device's stream.
            self.launch(OpKind::Barrier, |comm, stream| unsafe {
                nccl::ncclAllReduce(ptr as *const c_void, ptr as *mut c_void, 1, nccl::ncclDataType_t::ncclFloat32, nccl::ncclRedOp_t::ncclSum, comm, stream)
            })
            .await
        })
    }
}

impl<T: NcclElement> Collective<T> for NcclCommunicator {
    type Buf = Buffer<T>;

    fn all_reduce(&self, buf: &mut Buffer<T>, op: ReduceOp) -> impl Future<Output = Result<()>> + Send {
        let bytes = std::mem::size_of::<T>() * buf.len();
        self.run(OpKind::AllReduce, bytes, self.start_all_reduce(buf, op))
    }

    fn reduce_scatter(&self, input: &Buffer<T>, output: &mut Buffer<T>, op: ReduceOp) -> impl Future<Output = Result<()>> + Send {
        let bytes = std::mem::size_of::<T>() * input.len();
        self.run(OpKind::ReduceScatter, bytes, self.start_reduce_scatter(input, output, op))
    }

    fn all_gather(&self, input: &Buffer<T>, output: &mut Buffer<T>) -> impl Future<Output = Result<()>> + Send {
        let bytes = std::mem::size_of::<T>() * output.len();
        self.run(OpKind::AllGather, bytes, self.start_all_gather(input, output))
    }

    fn broadcast(&self, buf: &mut Buffer<T>, root: usize) -> impl Future<Output = Result<()>> + Send {
        let bytes = std::mem::size_of::<T>() * buf.len();
        self.run(OpKind::Broadcast, bytes, self.start_broadcast(buf, root))
    }

    fn reduce(&self, buf: &mut Buffer<T>, root: usize, op: ReduceOp) -> impl Future<Output = Result<()>> + Send {
        let bytes = std::mem::size_of::<T>() * buf.len();
        self.run(OpKind::Reduce, bytes, self.start_reduce(buf, root, op))
    }

    fn send(&self, buf: &Buffer<T>, dst: usize) -> impl Future<Output = Result<()>> + Send {
        let bytes = std::mem::size_of::<T>() * buf.len();
        self.run(OpKind::Send, bytes, self.start_send(buf, dst))
    }

    fn recv(&self, buf: &mut Buffer<T>, src: usize) -> impl Future<Output = Result<()>> + Send {
        let bytes = std::mem::size_of::<T>() * buf.len();
        self.run(OpKind::Send, bytes, self.start_recv(buf, src))
    }
}

/// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`.
fn nonblocking_config() -> nccl::ncclConfig_t {
    nccl::ncclConfig_t {
        size: std::mem::size_of::<nccl::ncclConfig_t>(),
        magic: NCCL_CONFIG_MAGIC,
        version: NCCL_CONFIG_VERSION,
        blocking: 0,
        cgaClusterSize: NCCL_CONFIG_UNDEF_INT,
        minCTAs: NCCL_CONFIG_UNDEF_INT,
        maxCTAs: NCCL_CONFIG_UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: NCCL_CONFIG_UNDEF_INT,
        trafficClass: NCCL_CONFIG_UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: NCCL_CONFIG_UNDEF_INT,
        CTAPolicy: NCCL_CONFIG_UNDEF_INT,
        shrinkShare: NCCL_CONFIG_UNDEF_INT,
        nvlsCTAs: NCCL_CONFIG_UNDEF_INT,
        nChannelsPerNetPeer: NCCL_CONFIG_UNDEF_INT,
        nvlinkCentricSched: NCCL_CONFIG_UNDEF_INT,
    }
}

fn red_op(op: ReduceOp) -> nccl::ncclRedOp_t {
    match op {
        ReduceOp::Sum => nccl::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => nccl::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => nccl::ncclRedOp_t::ncclMax,
        ReduceOp::Min => nccl::ncclRedOp_t::ncclMin,
    }
}

/// Makes the device's context current on this thread (NCCL and the driver act on it).
fn bind(device: &Device, op: &'static str) -> Result<()> {
    device.context().bind_to_thread().map_err(|e| Error::Cuda { op, reason: e.to_string() })
}

/// [`Error::Nccl`] for `code`, with the communicator's last-error text when there is one.
fn nccl_error(op: &'static str, code: nccl::ncclResult_t, comm: Option<nccl::ncclComm_t>) -> Error {
    let text = match comm {
        // SAFETY: `comm` is live (callers hold its lock); NCCL returns a NUL-terminated string it
        // owns, copied out at once.
        Some(comm) => unsafe { c_text(nccl::ncclGetLastError(comm)) },
        None => String::new(),
    };
    let detail = if text.is_empty() {
        // SAFETY: NCCL returns a static NUL-terminated string for any code.
        unsafe { c_text(nccl::ncclGetErrorString(code)) }
    } else {
        text
    };
    let name = match code {
        nccl::ncclResult_t::ncclSuccess => "success",
        nccl::ncclResult_t::ncclUnhandledCudaError => "unhandled CUDA error",
        nccl::ncclResult_t::ncclSystemError => "system error",
        nccl::ncclResult_t::ncclInternalError => "internal error",
        nccl::ncclResult_t::ncclInvalidArgument => "invalid argument",
        nccl::ncclResult_t::ncclInvalidUsage => "invalid usage",
        nccl::ncclResult_t::ncclRemoteError => "remote error",
        nccl::ncclResult_t::ncclInProgress => "in progress",
        _ => "unknown",
    };
    Error::Nccl { op, code: code as u32, name, detail }
}

/// Copies a C string (null: empty).
///
/// # Safety
/// `ptr` is null or points to a NUL-terminated string valid for the call.
unsafe fn c_text(ptr: *const std::ffi::c_char) -> String {
    if ptr.is_null() {
        return String::new();
    }
    // SAFETY: non-null and NUL-terminated by the caller's contract.
    unsafe { CStr::from_ptr(ptr) }.to_string_lossy().into_owned()
}
