//! The communication thread of one rank: a dedicated OS thread running a current-thread tokio
//! runtime that owns the rank's [`Communicator`] and runs bucket collectives one at a time, in the
//! order they are submitted.
//!
//! Protocol (see also the ownership table in [`crate::data_parallel`]):
//! - The compute thread submits [`Job`]s through a bounded tokio channel, blocking on a full queue
//!   (back-pressure on backward) with a thread-parking `block_on` that works on any thread, and
//!   reads one [`Report`] per job from a std channel.
//! - For a job the thread takes the bucket's `Vec` out of its storage with `std::mem::replace` under
//!   the storage's write lock, releases the lock, awaits the collective on the owned `Vec`, and puts
//!   the `Vec` back under the write lock before it sends the report. No lock guard lives across an
//!   `.await`, and the buffer is moved, never copied (the all-gather copies this rank's own segment,
//!   1/n of the bucket, into a reused scratch buffer because its input may not alias its output).
//! - The `Vec` goes back on every path, failure and timeout included: the collective future only
//!   borrows it and is dropped before the put-back.
//! - After the first failed job every later job is answered `Skipped` without touching the
//!   communicator: its sequence numbers are out of step with the peers, and only a re-formed group
//!   (a new generation) may talk again.
//! - The thread ends when the engine drops the job sender; the runtime, the communicator and (when
//!   it was formed here) the endpoint and its dispatcher task go with it.
//!
//! The **inline** mode ([`Reducer::inline`]) has no thread: `submit` only queues a job, and the
//! caller's task runs each collective when it awaits its report, on whatever runtime it runs on
//! (the deterministic simulator's single thread). Same jobs, same order, same bits; only the
//! overlap with backward is gone.
//!
//! The **device** mode ([`Reducer::device`]) holds the engine's [`DeviceReduce`] and takes no
//! jobs: the device path reduces flat tensors where the parameters are, not host buckets, and
//! the engine awaits its collectives itself (see `crate::data_parallel`, "Reduction on the
//! device").

use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::JoinHandle;
use std::time::Duration;

use rtx_collectives::{Communicator, ReduceOp, WireElement};
use rtx_kernels::DType;
use rtx_tensor::{CpuData, Storage};
use tokio::sync::mpsc;
use tracing::Instrument;

use crate::device_reduce::DeviceReduce;
use crate::error::{Error, Result};

/// Counters a caller (a test, a metrics exporter) can read while the engine runs. Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct CommMonitor(Arc<MonitorState>);

#[derive(Debug, Default)]
struct MonitorState {
    backward_running: AtomicBool,
    started: AtomicU64,
    finished: AtomicU64,
    started_during_backward: AtomicU64,
}

impl CommMonitor {
    /// Bucket collectives the communication thread has begun, over the engine's life.
    pub fn collectives_started(&self) -> u64 {
        self.0.started.load(Ordering::Acquire)
    }

    /// Bucket collectives that have ended (successfully or not).
    pub fn collectives_finished(&self) -> u64 {
        self.0.finished.load(Ordering::Acquire)
    }

    /// Bucket collectives that began while the compute thread was still inside backward.
    pub fn started_during_backward(&self) -> u64 {
        self.0.started_during_backward.load(Ordering::Acquire)
    }

    /// Whether the compute thread is inside backward now.
    pub fn backward_running(&self) -> bool {
        self.0.backward_running.load(Ordering::Acquire)
    }

    pub(crate) fn set_backward_running(&self, running: bool) {
        self.0.backward_running.store(running, Ordering::Release);
    }

    /// Counts a collective's start; returns whether backward was still running.
    fn begin(&self) -> bool {
        let during = self.backward_running();
        if during {
            self.0.started_during_backward.fetch_add(1, Ordering::AcqRel);
        }
        self.0.started.fetch_add(1, Ordering::AcqRel);
        during
    }

    fn finish(&self) {
        self.0.finished.fetch_add(1, Ordering::AcqRel);
    }
}

/// One bucket collective.
#[derive(Debug)]
pub(crate) struct Job {
    pub(crate) step: u64,
    pub(crate) bucket: usize,
    pub(crate) op: BucketOp,
}

/// What to do with a bucket.
#[derive(Debug)]
pub(crate) enum BucketOp {
    /// Average the flat gradient in place.
    AllReduce { grads: Storage },
    /// Average the flat gradient, leaving this rank's segment in `shard` (its own storage). With
    /// `release` (ZeRO-2 and ZeRO-3) the full gradient buffer is dropped afterwards instead of put
    /// back: its storage is left empty, and the compute thread allocates it again when it next
    /// needs it.
    ReduceScatter { grads: Storage, shard: Storage, release: bool },
    /// Replace the flat parameters by every rank's segment; `own` is this rank's.
    AllGather { params: Storage, own: Range<usize> },
    /// Replace the flat parameters by group rank 0's (at construction, as DDP does).
    Broadcast { params: Storage },
    /// ZeRO-3: fill `params` (allocated to the bucket's full length by the compute thread) with
    /// every rank's segment; this rank's is read from `segment`, its own storage.
    Gather { params: Storage, segment: Storage },
    /// Gradient clipping under ZeRO: `values` holds one f64 per rank, this rank's (its share of
    /// the squared gradient norm) at its rank; afterwards every rank's, in rank order.
    NormShares { values: Storage },
}

impl BucketOp {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            BucketOp::AllReduce { .. } => "all_reduce",
            BucketOp::ReduceScatter { .. } => "reduce_scatter",
            BucketOp::AllGather { .. } => "all_gather",
            BucketOp::Broadcast { .. } => "broadcast",
            BucketOp::Gather { .. } => "all_gather",
            BucketOp::NormShares { .. } => "grad_norm_all_gather",
        }
    }
}

/// Why a job did not complete.
#[derive(Debug)]
pub(crate) enum Failure {
    Comm(rtx_collectives::Error),
    TimedOut(Duration),
    Unsupported(DType),
    /// An earlier job failed; this one was not attempted.
    Skipped,
}

/// The answer to one job.
#[derive(Debug)]
pub(crate) struct Report {
    pub(crate) step: u64,
    pub(crate) bucket: usize,
    pub(crate) op: &'static str,
    pub(crate) outcome: std::result::Result<(), Failure>,
    pub(crate) during_backward: bool,
    /// When the collective ran on the communication thread (not for a skipped job).
    pub(crate) ran: Option<(std::time::Instant, std::time::Instant)>,
}

/// The compute thread's handle on the communication thread (or the inline queue).
#[derive(Debug)]
pub(crate) struct Reducer {
    mode: Mode,
    rank: usize,
    size: usize,
    monitor: CommMonitor,
}

#[derive(Debug)]
enum Mode {
    Thread { jobs: Option<mpsc::Sender<Job>>, reports: Mutex<std_mpsc::Receiver<Report>>, thread: Option<JoinHandle<()>> },
    Inline { comm: Communicator, timeout: Duration, queue: Mutex<VecDeque<Job>>, state: tokio::sync::Mutex<Served> },
    /// The device path: no host bucket jobs; the engine runs its collectives through `reduce`.
    Device { reduce: Box<dyn DeviceReduce> },
}

/// What `serve` carries from one job to the next.
#[derive(Debug, Default)]
struct Served {
    broken: bool,
    scratch: BTreeMap<usize, CpuData>,
}

impl Reducer {
    /// Starts the thread, forms the communicator there with `connect` (inside the thread's runtime,
    /// so an endpoint made by it has its dispatcher driven by that runtime) and returns once it is
    /// formed.
    pub(crate) fn spawn<C>(connect: C, queue_depth: usize, collective_timeout: Duration, comm_threads: usize) -> Result<Reducer>
    where
        C: FnOnce() -> rtx_collectives::Result<Communicator> + Send + 'static,
    {
        assert!(queue_depth > 0, "reducer: validated queue depth");
        let (job_tx, job_rx) = mpsc::channel(queue_depth);
        let (report_tx, report_rx) = std_mpsc::channel();
        let (formed_tx, formed_rx) = std_mpsc::sync_channel::<Result<(usize, usize)>>(1);
        let monitor = CommMonitor::default();
        let thread_monitor = monitor.clone();
        let thread = std::thread::Builder::new()
            .name("rtx-dp-comm".into())
            .spawn(move || {
                // One thread: the current-thread runtime, as always. More: a multi-thread runtime,
                // still driven from this thread by `block_on`, so that a communicator with several
                // channels runs each ring on its own thread (`rtx_collectives` splits them only on a
                // multi-thread runtime; on this thread alone they would take turns).
                let built = if comm_threads <= 1 {
                    tokio::runtime::Builder::new_current_thread().enable_all().build()
                } else {
                    tokio::runtime::Builder::new_multi_thread().worker_threads(comm_threads).thread_name("rtx-dp-comm-worker").enable_all().build()
                };
                let runtime = match built {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        let _ = formed_tx.send(Err(Error::CommThread(e)));
                        return;
                    }
                };
                let comm = {
                    let _entered = runtime.enter();
                    connect()
                };
                let comm = match comm {
                    Ok(comm) => comm,
                    Err(e) => {
                        let _ = formed_tx.send(Err(Error::Connect(e)));
                        return;
                    }
                };
                let _ = formed_tx.send(Ok((comm.rank(), comm.size())));
                let span = tracing::debug_span!("dp_comm", rank = comm.rank(), group = comm.group_id(), generation = comm.generation());
                runtime.block_on(serve(comm, job_rx, report_tx, thread_monitor, collective_timeout).instrument(span));
            })
            .map_err(Error::CommThread)?;
        let (rank, size) = match formed_rx.recv() {
            Ok(formed) => formed?,
            Err(_) => return Err(Error::ReducerGone { rank: usize::MAX }),
        };
        Ok(Reducer { mode: Mode::Thread { jobs: Some(job_tx), reports: Mutex::new(report_rx), thread: Some(thread) }, rank, size, monitor })
    }

    /// A reducer without a thread over `comm`: collectives run on the caller's task as it awaits
    /// their reports.
    pub(crate) fn inline(comm: Communicator, collective_timeout: Duration) -> Reducer {
        let (rank, size) = (comm.rank(), comm.size());
        Reducer { mode: Mode::Inline { comm, timeout: collective_timeout, queue: Mutex::new(VecDeque::new()), state: tokio::sync::Mutex::new(Served::default()) }, rank, size, monitor: CommMonitor::default() }
    }

    /// A reducer for the device path: it takes no jobs; the engine calls `reduce` itself.
    pub(crate) fn device(reduce: Box<dyn DeviceReduce>) -> Reducer {
        let (rank, size) = (reduce.rank(), reduce.size());
        Reducer { mode: Mode::Device { reduce }, rank, size, monitor: CommMonitor::default() }
    }

    /// The device reducer, on the device path.
    pub(crate) fn device_reduce(&self) -> Option<&dyn DeviceReduce> {
        match &self.mode {
            Mode::Device { reduce } => Some(reduce.as_ref()),
            Mode::Thread { .. } | Mode::Inline { .. } => None,
        }
    }

    /// Group rank of this engine.
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// Group size.
    pub(crate) fn size(&self) -> usize {
        self.size
    }

    pub(crate) fn monitor(&self) -> &CommMonitor {
        &self.monitor
    }

    /// Queues a job; blocks while the thread's queue is full (an inline queue is never full: the
    /// engine submits at most one job per bucket before it collects the reports).
    pub(crate) fn submit(&self, job: Job) -> Result<()> {
        let gone = Error::ReducerGone { rank: self.rank };
        match &self.mode {
            Mode::Thread { jobs, .. } => {
                let Some(jobs) = jobs else { return Err(gone) };
                // Unconstrained: called inside a task (a worker future on `Handle::block_on`),
                // tokio's cooperative budget would run out and the send would spin forever
                // without ever returning to the scheduler that refills it.
                block_on(tokio::task::unconstrained(jobs.send(job))).map_err(|_| gone)
            }
            Mode::Inline { queue, .. } => {
                queue.lock().unwrap_or_else(PoisonError::into_inner).push_back(job);
                Ok(())
            }
            // The device path submits nothing; a job here is a bug caught as a typed error.
            Mode::Device { .. } => Err(gone),
        }
    }

    /// The next report, in submission order. With a thread this blocks the calling thread; inline
    /// it runs the next queued collective on the caller's task.
    pub(crate) async fn next_report(&self) -> Result<Report> {
        match &self.mode {
            Mode::Thread { reports, .. } => reports.lock().unwrap_or_else(PoisonError::into_inner).recv().map_err(|_| Error::ReducerGone { rank: self.rank }),
            Mode::Inline { comm, timeout, queue, state } => {
                let job = queue.lock().unwrap_or_else(PoisonError::into_inner).pop_front().ok_or(Error::ReducerGone { rank: self.rank })?;
                let mut served = state.lock().await;
                Ok(serve_one(comm, job, &mut served, &self.monitor, *timeout).await)
            }
            Mode::Device { .. } => Err(Error::ReducerGone { rank: self.rank }),
        }
    }
}

impl Drop for Reducer {
    fn drop(&mut self) {
        if let Mode::Thread { jobs, thread, .. } = &mut self.mode {
            // Closing the queue ends `serve` once in-flight jobs are done (each bounded by timeouts).
            drop(jobs.take());
            if let Some(thread) = thread.take() {
                if thread.join().is_err() {
                    tracing::error!(rank = self.rank, "communication thread panicked");
                }
            }
        }
    }
}

async fn serve(comm: Communicator, mut jobs: mpsc::Receiver<Job>, reports: std_mpsc::Sender<Report>, monitor: CommMonitor, timeout: Duration) {
    let mut served = Served::default();
    while let Some(job) = jobs.recv().await {
        let report = serve_one(&comm, job, &mut served, &monitor, timeout).await;
        if reports.send(report).is_err() {
            break;
        }
    }
}

/// Runs one job (or skips it after a failure) and makes its report.
async fn serve_one(comm: &Communicator, job: Job, served: &mut Served, monitor: &CommMonitor, timeout: Duration) -> Report {
    let op = job.op.name();
    let (outcome, during_backward, ran) = if served.broken {
        (Err(Failure::Skipped), false, None)
    } else {
        let during_backward = monitor.begin();
        let span = tracing::debug_span!("dp_bucket", op, step = job.step, bucket = job.bucket, during_backward);
        // Wall time for the step trace only (a measurement; nothing decides on it).
        let began = std::time::Instant::now();
        let outcome = run(comm, &job, timeout, &mut served.scratch).instrument(span).await;
        monitor.finish();
        (outcome, during_backward, Some((began, std::time::Instant::now())))
    };
    if let Err(failure) = &outcome {
        // A stale generation is the supervisor's abort (reported once by the worker runtime).
        if matches!(failure, Failure::Comm(rtx_collectives::Error::StaleGeneration { .. })) {
            tracing::debug!(op, step = job.step, bucket = job.bucket, ?failure, "bucket collective failed; skipping the rest");
        } else if !served.broken {
            tracing::warn!(op, step = job.step, bucket = job.bucket, ?failure, "bucket collective failed; skipping the rest");
        }
        served.broken = true;
    }
    Report { step: job.step, bucket: job.bucket, op, outcome, during_backward, ran }
}

async fn run(comm: &Communicator, job: &Job, timeout: Duration, scratch: &mut BTreeMap<usize, CpuData>) -> std::result::Result<(), Failure> {
    match &job.op {
        BucketOp::AllReduce { grads } => {
            let mut data = take(grads);
            let outcome = bounded(timeout, all_reduce(comm, &mut data)).await;
            restore(grads, data);
            outcome
        }
        BucketOp::ReduceScatter { grads, shard, release } => {
            let data = take(grads);
            let mut out = take(shard);
            let outcome = bounded(timeout, reduce_scatter(comm, &data, &mut out)).await;
            restore(shard, out);
            if *release {
                // The storage stays empty (what `take` left); the buffer is freed here.
                drop(data);
            } else {
                restore(grads, data);
            }
            outcome
        }
        BucketOp::Gather { params, segment } => {
            let mut data = take(params);
            let own = take(segment);
            let outcome = bounded(timeout, gather_segments(comm, &own, &mut data)).await;
            restore(segment, own);
            restore(params, data);
            outcome
        }
        BucketOp::AllGather { params, own } => {
            let mut data = take(params);
            let buf = scratch.entry(job.bucket).or_insert_with(|| CpuData::zeros(data.dtype(), 0));
            let outcome = bounded(timeout, all_gather(comm, &mut data, own.clone(), buf)).await;
            restore(params, data);
            outcome
        }
        BucketOp::Broadcast { params } => {
            let mut data = take(params);
            let outcome = bounded(timeout, broadcast(comm, &mut data)).await;
            restore(params, data);
            outcome
        }
        BucketOp::NormShares { values } => {
            let mut data = take(values);
            let outcome = match &mut data {
                CpuData::F64(v) => bounded(timeout, async { comm.all_gather_in_place(v).await.map_err(Failure::Comm) }).await,
                other => Err(Failure::Unsupported(other.dtype())),
            };
            restore(values, data);
            outcome
        }
    }
}

/// Moves the elements out of `storage`, leaving an empty buffer of the same dtype. The write guard
/// is dropped before this returns.
fn take(storage: &Storage) -> CpuData {
    match storage.write() {
        Ok(mut guard) => {
            let empty = CpuData::zeros(guard.dtype(), 0);
            std::mem::replace(&mut *guard, empty)
        }
        // Buckets are host storages made by `ParamBuckets` (device parameters are copied into
        // them), so this does not happen; were it to, the empty buffer fails the length checks
        // of the collective instead of reducing anything.
        Err(e) => {
            tracing::error!(error = %e, "reducer: bucket storage is not in host memory");
            CpuData::F32(Vec::new().into())
        }
    }
}

/// Puts elements taken by [`take`] back.
fn restore(storage: &Storage, data: CpuData) {
    if let Ok(mut guard) = storage.write() {
        debug_assert!(guard.is_empty(), "reducer: nobody writes a bucket while it is taken");
        *guard = data;
    }
}

async fn bounded(timeout: Duration, op: impl Future<Output = std::result::Result<(), Failure>>) -> std::result::Result<(), Failure> {
    tokio::time::timeout(timeout, op).await.unwrap_or(Err(Failure::TimedOut(timeout)))
}

async fn all_reduce(comm: &Communicator, data: &mut CpuData) -> std::result::Result<(), Failure> {
    let result = match data {
        CpuData::F32(v) => comm.all_reduce(v, ReduceOp::Avg).await,
        CpuData::F64(v) => comm.all_reduce(v, ReduceOp::Avg).await,
        CpuData::BF16(v) => comm.all_reduce(v, ReduceOp::Avg).await,
        CpuData::U32(_) => return Err(Failure::Unsupported(DType::U32)),
        CpuData::I64(_) => return Err(Failure::Unsupported(DType::I64)),
    };
    result.map_err(Failure::Comm)
}

async fn broadcast(comm: &Communicator, data: &mut CpuData) -> std::result::Result<(), Failure> {
    let result = match data {
        CpuData::F32(v) => comm.broadcast(v, 0).await,
        CpuData::F64(v) => comm.broadcast(v, 0).await,
        CpuData::BF16(v) => comm.broadcast(v, 0).await,
        CpuData::U32(_) => return Err(Failure::Unsupported(DType::U32)),
        CpuData::I64(_) => return Err(Failure::Unsupported(DType::I64)),
    };
    result.map_err(Failure::Comm)
}

async fn reduce_scatter(comm: &Communicator, input: &CpuData, output: &mut CpuData) -> std::result::Result<(), Failure> {
    let result = match (input, output) {
        (CpuData::F32(i), CpuData::F32(o)) => comm.reduce_scatter(i, o, ReduceOp::Avg).await,
        (CpuData::F64(i), CpuData::F64(o)) => comm.reduce_scatter(i, o, ReduceOp::Avg).await,
        (CpuData::BF16(i), CpuData::BF16(o)) => comm.reduce_scatter(i, o, ReduceOp::Avg).await,
        (i, _) => return Err(Failure::Unsupported(i.dtype())),
    };
    result.map_err(Failure::Comm)
}

async fn all_gather(comm: &Communicator, data: &mut CpuData, own: Range<usize>, scratch: &mut CpuData) -> std::result::Result<(), Failure> {
    let result = match (data, scratch) {
        (CpuData::F32(d), CpuData::F32(s)) => gather_into(comm, d, own, s.vec_mut()).await,
        (CpuData::F64(d), CpuData::F64(s)) => gather_into(comm, d, own, s.vec_mut()).await,
        (CpuData::BF16(d), CpuData::BF16(s)) => gather_into(comm, d, own, s.vec_mut()).await,
        (d, _) => return Err(Failure::Unsupported(d.dtype())),
    };
    result.map_err(Failure::Comm)
}

async fn gather_segments(comm: &Communicator, own: &CpuData, out: &mut CpuData) -> std::result::Result<(), Failure> {
    let result = match (own, out) {
        (CpuData::F32(i), CpuData::F32(o)) => comm.all_gather(i, o).await,
        (CpuData::F64(i), CpuData::F64(o)) => comm.all_gather(i, o).await,
        (CpuData::BF16(i), CpuData::BF16(o)) => comm.all_gather(i, o).await,
        (i, _) => return Err(Failure::Unsupported(i.dtype())),
    };
    result.map_err(Failure::Comm)
}

/// All-gathers `buf` in place: this rank's segment `own` is the input, copied into `scratch`
/// because the collective's input may not alias its output.
async fn gather_into<T: WireElement>(comm: &Communicator, buf: &mut [T], own: Range<usize>, scratch: &mut Vec<T>) -> rtx_collectives::Result<()> {
    debug_assert_eq!(own, comm.segment(buf.len(), comm.rank()), "reducer: shard boundaries match the collective's");
    scratch.clear();
    scratch.extend_from_slice(&buf[own]);
    comm.all_gather(scratch, buf).await
}

/// Polls `future` to completion on the calling thread, parking it while the future is pending.
/// Unlike tokio's `blocking_send` this does not refuse threads that have a runtime handle entered
/// (`spawn_blocking` threads): the future only waits on the queue, which the communication thread
/// drains.
pub(crate) fn block_on<F: Future>(future: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    loop {
        if let Poll::Ready(output) = future.as_mut().poll(&mut cx) {
            return output;
        }
        std::thread::park();
    }
}
