//! GPU check and benchmark of `NcclCommunicator` (feature `nccl`; run by `scripts/gpu-nccl-check.sh`).
//!
//! 1. A one-rank communicator on GPU 0, created through the real id exchange over an in-process
//!    host world of 1; then, if several GPUs are visible, one rank per GPU (threads of this
//!    process, each with its own tokio runtime; the host world on the in-process transport carries
//!    the NCCL unique id).
//! 2. Every operation (all_reduce sum/avg/max/min, reduce_scatter, all_gather, broadcast, reduce,
//!    send/recv, barrier) on f32 and bf16 random non-zero data, checked against a CPU reference
//!    computed in f64 from every rank's input (each rank regenerates all inputs from the seed).
//! 3. Bus bandwidth of all_reduce, reduce_scatter and all_gather (f32, in place where NCCL allows),
//!    sizes 8 B to 4 GiB (capped by `--max-bytes` and device memory), timed with CUDA events over
//!    queued operations like nccl-tests; `algbw = bytes / time`, `busbw = algbw * 2(n-1)/n` for
//!    all_reduce and `algbw * (n-1)/n` for reduce_scatter / all_gather (bytes = the full buffer),
//!    the slowest rank's time counts. Then the latency of awaited operations through the
//!    `Collective` trait (host-timed), for a caller that waits for each one.
//! 4. Failure semantics on GPU 0: a generation bump fails the next operation as stale, an abort
//!    fails later ones, and a 2-rank init whose peer never joins ends by the timeout (or at once
//!    when the control plane loses the peer, or the group's generation moves on) instead of
//!    hanging.
//!
//! Usage: `nccl_check [--ranks N] [--max-bytes BYTES] [--no-bench]`; `RTX_SEED` sets the seed.
//! Exit status 1 if any check fails.

use std::sync::Arc;
use std::time::Duration;

use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rtx_collectives::{probe_nccl, Collective, CollectiveGroup, CommConfig, Endpoint, InProcessNetwork, NcclCommunicator, NcclElement, ReduceOp, Transport};
use rtx_kernels::cuda::{Buffer, Device};

/// Examples may box errors (anyhow is not a dependency of this crate).
type Result<T, E = Box<dyn std::error::Error + Send + Sync>> = std::result::Result<T, E>;

/// Attaches `what` to an error.
fn ctx<T, E: std::fmt::Display>(r: std::result::Result<T, E>, what: &str) -> Result<T> {
    r.map_err(|e| format!("{what}: {e}").into())
}

/// Largest benchmark buffer (nccl-tests' usual top).
const MAX_BENCH_BYTES: usize = 4 << 30;

struct Args {
    ranks: Option<usize>,
    max_bytes: usize,
    bench: bool,
    seed: u64,
}

/// One benchmark row as measured by one rank.
#[derive(Clone, Debug)]
struct Row {
    op: &'static str,
    bytes: usize,
    ms: f64,
}

/// What a rank thread reports: failed checks (as text) and benchmark rows.
#[derive(Default)]
struct Report {
    failures: Vec<String>,
    checks: usize,
    rows: Vec<Row>,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let args = parse_args()?;
    println!("nccl_check: seed {} (RTX_SEED replays)", args.seed);
    let version = ctx(probe_nccl(), "probing NCCL")?;
    let n_gpus = ctx(Device::count(), "counting CUDA devices")?;
    println!("NCCL {version}, {n_gpus} GPU(s) visible");
    if n_gpus == 0 {
        return Err("no GPU visible".into());
    }
    let mut failed = false;
    let mut worlds = vec![1];
    let multi = args.ranks.unwrap_or(n_gpus).min(n_gpus);
    if multi > 1 {
        worlds.push(multi);
    }
    for n in worlds {
        println!("\n## world of {n} rank(s), one per GPU");
        let started = std::time::Instant::now();
        let reports = match run_world(n, &args) {
            Ok(reports) => reports,
            Err(e) => {
                println!("  FAIL world of {n}: {e}");
                failed = true;
                continue;
            }
        };
        let checks: usize = reports.iter().map(|r| r.checks).sum();
        let failures: Vec<&String> = reports.iter().flat_map(|r| &r.failures).collect();
        println!("checks: {checks} passed of {} ({:.1} s)", checks + failures.len(), started.elapsed().as_secs_f64());
        for f in &failures {
            println!("  FAIL {f}");
        }
        failed |= !failures.is_empty();
        if args.bench {
            print_table(n, &reports);
        }
    }
    {
        println!("\n## failure semantics on GPU 0");
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let (passed, failures) = rt.block_on(check_failures()).unwrap_or_else(|e| (0, vec![format!("error: {e}")]));
        println!("checks: {passed} passed of {}", passed + failures.len());
        for f in &failures {
            println!("  FAIL {f}");
        }
        failed |= !failures.is_empty();
    }
    if failed {
        println!("\nnccl_check: FAILED");
        std::process::exit(1);
    }
    println!("\nnccl_check: all checks passed");
    Ok(())
}

fn parse_args() -> Result<Args> {
    let seed = ctx(std::env::var("RTX_SEED").ok().map(|s| s.parse::<u64>()).transpose(), "RTX_SEED")?.unwrap_or(0x05EE_D6C1);
    let mut args = Args { ranks: None, max_bytes: MAX_BENCH_BYTES, bench: true, seed };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--ranks" => args.ranks = Some(ctx(it.next().ok_or("missing value").and_then(|v| v.parse().map_err(|_| "not a number")), "--ranks N")?),
            "--max-bytes" => args.max_bytes = ctx(it.next().ok_or("missing value").and_then(|v| v.parse().map_err(|_| "not a number")), "--max-bytes B")?,
            "--no-bench" => args.bench = false,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    Ok(args)
}

/// Runs `n` ranks as threads (rank r on GPU r) and collects their reports in rank order.
fn run_world(n: usize, args: &Args) -> Result<Vec<Report>> {
    let (_net, transports) = InProcessNetwork::new(n);
    let handles: Vec<_> = transports
        .into_iter()
        .enumerate()
        .map(|(rank, transport)| {
            let (seed, max_bytes, bench) = (args.seed, args.max_bytes, args.bench);
            std::thread::Builder::new().name(format!("rank{rank}")).spawn(move || -> Result<Report> {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
                rt.block_on(rank_main(rank, n, transport, seed, max_bytes, bench))
            })
        })
        .collect::<std::io::Result<_>>()?;
    let mut reports = Vec::new();
    for (rank, h) in handles.into_iter().enumerate() {
        let report = h.join().map_err(|_| format!("rank {rank} panicked"))?;
        let report = ctx(report, &format!("rank {rank}"))?;
        reports.push(report);
    }
    Ok(reports)
}

async fn rank_main(rank: usize, n: usize, transport: rtx_collectives::InProcessTransport, seed: u64, max_bytes: usize, bench: bool) -> Result<Report> {
    let transport: Arc<dyn Transport> = Arc::new(transport);
    let config = CommConfig { op_timeout: Duration::from_secs(120), ..CommConfig::default() };
    let host = Endpoint::new(transport, config)?.world()?;
    let device = Arc::new(Device::new(rank)?);
    let created = std::time::Instant::now();
    let comm = NcclCommunicator::new(&host, device.clone()).await?;
    if rank == 0 {
        println!("NcclCommunicator of {n} created in {:.0} ms (id exchange + ncclCommInitRankConfig)", created.elapsed().as_secs_f64() * 1e3);
    }
    let mut report = Report::default();
    for len in [1usize, 3, 1000, 65_537, 1 << 22] {
        let len = len * n; // reduce_scatter / all_gather need multiples of n
        check_ops::<f32>(&comm, &device, seed, len, &mut report).await?;
        check_ops::<bf16>(&comm, &device, seed, len, &mut report).await?;
    }
    comm.barrier().await?;
    report.checks += 1;
    if bench {
        benchmark(&comm, &device, max_bytes, &mut report).await?;
    }
    // Everyone is done with NCCL before anyone tears down the host world.
    comm.shutdown().await?;
    host.barrier().await?;
    Ok(report)
}

/// Generations, aborts, a peer that never joins and a peer lost during init, on one GPU: returns
/// the number of passed checks and the failures.
async fn check_failures() -> Result<(usize, Vec<String>)> {
    let mut passed = 0;
    let mut failures = Vec::new();
    let mut check = |what: &str, ok: bool, detail: String| {
        if ok {
            passed += 1;
            println!("  ok   {what}: {detail}");
        } else {
            failures.push(format!("{what}: {detail}"));
        }
    };
    let device = Arc::new(Device::new(0)?);
    let config = CommConfig { op_timeout: Duration::from_secs(60), ..CommConfig::default() };

    // A bump of the group's generation (here through the host communicator, as the supervisor
    // would) fails the next operation as stale; a communicator built at the new generation works.
    let (_net, transports) = InProcessNetwork::new(1);
    let host = Endpoint::new(Arc::new(transports.into_iter().next().ok_or("no transport")?), config.clone())?.world()?;
    let comm = NcclCommunicator::new(&host, device.clone()).await?;
    let mut buf = device.htod(&[1.0f32, 2.0, 3.0])?;
    comm.all_reduce(&mut buf, ReduceOp::Sum).await?;
    host.set_generation(1)?;
    let got = comm.all_reduce(&mut buf, ReduceOp::Sum).await;
    check("stale generation", got == Err(rtx_collectives::Error::StaleGeneration { expected: 1, got: 0 }), format!("{got:?}"));
    drop(comm);
    let comm = NcclCommunicator::new(&host, device.clone()).await?;
    let got = comm.all_reduce(&mut buf, ReduceOp::Sum).await;
    check("rebuilt at the new generation", got.is_ok(), format!("{got:?}"));
    comm.abort("test abort");
    let got = comm.barrier().await;
    check("after abort", matches!(got, Err(rtx_collectives::Error::CommAborted { .. })), format!("{got:?}"));
    drop(comm);

    // A group of 2 whose rank 1 never joins: init must end by the timeout, not hang.
    let (_net, transports) = InProcessNetwork::new(2);
    let mut transports = transports.into_iter();
    let host = Endpoint::new(Arc::new(transports.next().ok_or("no transport")?), config.clone())?.world()?;
    let _silent = Endpoint::new(Arc::new(transports.next().ok_or("no transport")?), config.clone())?;
    let options = rtx_collectives::NcclOptions { op_timeout: Duration::from_secs(3), init_timeout: Duration::from_secs(3) };
    let started = std::time::Instant::now();
    let got = NcclCommunicator::from_unique_id(&host, device.clone(), rtx_collectives::nccl_unique_id()?, options).await;
    let secs = started.elapsed().as_secs_f64();
    check(
        "peer never joins init",
        matches!(got, Err(rtx_collectives::Error::DeviceTimeout { op: "nccl init", .. })) && secs < 10.0,
        format!("{:?} after {secs:.1} s", got.as_ref().err()),
    );

    // The same, but the control plane loses rank 1 after 0.5 s: init fails at once, not at the
    // 60 s timeout.
    let (net, transports) = InProcessNetwork::new(2);
    let mut transports = transports.into_iter();
    let host = Endpoint::new(Arc::new(transports.next().ok_or("no transport")?), config.clone())?.world()?;
    let _silent = Endpoint::new(Arc::new(transports.next().ok_or("no transport")?), config.clone())?;
    let options = rtx_collectives::NcclOptions::from_config(&config);
    let started = std::time::Instant::now();
    let init = NcclCommunicator::from_unique_id(&host, device.clone(), rtx_collectives::nccl_unique_id()?, options);
    let lose = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        net.disconnect(1);
        std::future::pending::<()>().await
    };
    let got = tokio::select! { got = init => got, _ = lose => unreachable!() };
    let secs = started.elapsed().as_secs_f64();
    check(
        "peer lost during init",
        matches!(&got, Err(rtx_collectives::Error::CommAborted { reason, .. }) if reason.contains("lost")) && secs < 10.0,
        format!("{:?} after {secs:.1} s", got.as_ref().err()),
    );

    // A generation bump while init is in flight (rank 1 never joins) fails it as stale at once.
    let (_net, transports) = InProcessNetwork::new(2);
    let mut transports = transports.into_iter();
    let host = Endpoint::new(Arc::new(transports.next().ok_or("no transport")?), config.clone())?.world()?;
    let _silent = Endpoint::new(Arc::new(transports.next().ok_or("no transport")?), config.clone())?;
    let options = rtx_collectives::NcclOptions::from_config(&config);
    let started = std::time::Instant::now();
    let init = NcclCommunicator::from_unique_id(&host, device.clone(), rtx_collectives::nccl_unique_id()?, options);
    let bump = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let bumped = host.set_generation(1);
        std::future::pending::<()>().await;
        bumped
    };
    let got = tokio::select! { got = init => got, _ = bump => unreachable!() };
    let secs = started.elapsed().as_secs_f64();
    check(
        "generation bump during init",
        matches!(got, Err(rtx_collectives::Error::StaleGeneration { expected: 1, got: 0 })) && secs < 10.0,
        format!("{:?} after {secs:.1} s", got.as_ref().err()),
    );
    Ok((passed, failures))
}

/// Element-type helpers for the check.
trait CheckElem: NcclElement + Copy {
    const NAME: &'static str;
    /// Relative rounding unit of the type.
    const EPS: f64;
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
}
impl CheckElem for f32 {
    const NAME: &'static str = "f32";
    const EPS: f64 = 1.2e-7;
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
}
impl CheckElem for bf16 {
    const NAME: &'static str = "bf16";
    const EPS: f64 = 7.9e-3;
    fn from_f64(x: f64) -> Self {
        bf16::from_f64(x)
    }
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
}

/// Rank `r`'s input for the check of `(op_tag, len)`: random non-zero values in ±[0.5, 1.5).
fn input<T: CheckElem>(seed: u64, rank: usize, tag: u64, len: usize) -> Vec<T> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (tag << 40) ^ (len as u64) << 8);
    rng.set_stream(rank as u64);
    (0..len)
        .map(|_| {
            let m: f64 = rng.random_range(0.5..1.5);
            T::from_f64(if rng.random::<bool>() { m } else { -m })
        })
        .collect()
}

/// Compares `got` with the f64 reference `want`: |got - want| <= tol * scale[i], where `scale` is
/// the sum of magnitudes that went into the element.
fn compare<T: CheckElem>(what: &str, got: &[T], want: &[f64], scale: &[f64], ulps: f64, report: &mut Report) {
    let tol = T::EPS * ulps;
    let bad = got.iter().zip(want).zip(scale).position(|((g, w), s)| (g.to_f64() - w).abs() > tol * s.max(1.0));
    match bad {
        None if got.len() == want.len() => report.checks += 1,
        None => report.failures.push(format!("{what}: {} elements, expected {}", got.len(), want.len())),
        Some(i) => {
            report.failures.push(format!("{what}: element {i} is {}, expected {} (tolerance {:.2e})", got[i].to_f64(), want[i], tol * scale[i].max(1.0)))
        }
    }
}

async fn check_ops<T: CheckElem>(comm: &NcclCommunicator, device: &Device, seed: u64, len: usize, report: &mut Report) -> Result<()> {
    let (rank, n) = (comm.rank(), comm.size());
    let name = |op: &str| format!("{op} {} len={len} rank={rank}/{n}", T::NAME);
    let all = |tag: u64| -> Vec<Vec<T>> { (0..n).map(|r| input::<T>(seed, r, tag, len)).collect() };
    let ulps = 2.0 * n as f64 + 2.0;

    for (tag, op) in [(1u64, ReduceOp::Sum), (2, ReduceOp::Avg), (3, ReduceOp::Max), (4, ReduceOp::Min)] {
        let inputs = all(tag);
        let mut buf = device.htod(&inputs[rank])?;
        comm.all_reduce(&mut buf, op).await?;
        let got = device.dtoh(&buf)?;
        let (want, scale) = reference(&inputs, op);
        compare(&name(&format!("all_reduce {op:?}")), &got, &want, &scale, ulps, report);
    }

    let inputs = all(5);
    let input_buf = device.htod(&inputs[rank])?;
    let mut out: Buffer<T> = device.alloc(len / n)?;
    comm.reduce_scatter(&input_buf, &mut out, ReduceOp::Sum).await?;
    let (want, scale) = reference(&inputs, ReduceOp::Sum);
    let seg = rank * (len / n)..(rank + 1) * (len / n);
    compare(&name("reduce_scatter"), &device.dtoh(&out)?, &want[seg.clone()], &scale[seg], ulps, report);

    let parts: Vec<Vec<T>> = (0..n).map(|r| input::<T>(seed, r, 6, len / n)).collect();
    let part = device.htod(&parts[rank])?;
    let mut gathered: Buffer<T> = device.alloc(len)?;
    comm.all_gather(&part, &mut gathered).await?;
    let want: Vec<f64> = parts.iter().flatten().map(|x| x.to_f64()).collect();
    compare(&name("all_gather"), &device.dtoh(&gathered)?, &want, &vec![0.0; len], 0.0, report);

    let root = n - 1;
    let inputs = all(7);
    let mut buf = device.htod(&inputs[rank])?;
    comm.broadcast(&mut buf, root).await?;
    let want: Vec<f64> = inputs[root].iter().map(|x| x.to_f64()).collect();
    compare(&name("broadcast"), &device.dtoh(&buf)?, &want, &vec![0.0; len], 0.0, report);

    let inputs = all(8);
    let mut buf = device.htod(&inputs[rank])?;
    comm.reduce(&mut buf, 0, ReduceOp::Sum).await?;
    let got = device.dtoh(&buf)?;
    if rank == 0 {
        let (want, scale) = reference(&inputs, ReduceOp::Sum);
        compare(&name("reduce (root)"), &got, &want, &scale, ulps, report);
    } else {
        let want: Vec<f64> = inputs[rank].iter().map(|x| x.to_f64()).collect();
        compare(&name("reduce (non-root unchanged)"), &got, &want, &vec![0.0; len], 0.0, report);
    }

    if n > 1 {
        // A ring: even ranks send first, odd ranks receive first, so queued sends never wait on
        // each other in a cycle.
        let inputs = all(9);
        let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
        let send_buf = device.htod(&inputs[rank])?;
        let mut recv_buf: Buffer<T> = device.alloc(len)?;
        if rank % 2 == 0 {
            comm.send(&send_buf, next).await?;
            comm.recv(&mut recv_buf, prev).await?;
        } else {
            comm.recv(&mut recv_buf, prev).await?;
            comm.send(&send_buf, next).await?;
        }
        let want: Vec<f64> = inputs[prev].iter().map(|x| x.to_f64()).collect();
        compare(&name("send/recv"), &device.dtoh(&recv_buf)?, &want, &vec![0.0; len], 0.0, report);
    }
    Ok(())
}

/// The reduction of every rank's input in f64, and the sum of magnitudes per element (the scale of
/// the rounding error).
fn reference<T: CheckElem>(inputs: &[Vec<T>], op: ReduceOp) -> (Vec<f64>, Vec<f64>) {
    let len = inputs[0].len();
    let n = inputs.len();
    let mut want = vec![0.0; len];
    let mut scale = vec![0.0; len];
    for i in 0..len {
        let xs = inputs.iter().map(|v| v[i].to_f64());
        want[i] = match op {
            ReduceOp::Sum => xs.sum(),
            ReduceOp::Avg => xs.sum::<f64>() / n as f64,
            ReduceOp::Max => xs.fold(f64::NEG_INFINITY, f64::max),
            ReduceOp::Min => xs.fold(f64::INFINITY, f64::min),
        };
        scale[i] = inputs.iter().map(|v| v[i].to_f64().abs()).sum();
    }
    (want, scale)
}

/// The nccl-tests style sweep on f32; rows carry this rank's mean time per operation.
async fn benchmark(comm: &NcclCommunicator, device: &Device, max_bytes: usize, report: &mut Report) -> Result<()> {
    let n = comm.size();
    let mut bytes = 8usize;
    while bytes <= max_bytes.min(MAX_BENCH_BYTES) {
        let len = bytes / 4;
        if len % n != 0 {
            bytes *= 2;
            continue;
        }
        let iters = ((1usize << 30) / bytes).clamp(5, 200);
        let warmup = 3;
        let Ok(mut buf) = device.zeros::<f32>(len) else {
            println!("stopping the sweep at {bytes} bytes: out of device memory");
            break;
        };
        let Ok(mut part) = device.zeros::<f32>(len / n) else { break };
        let ms = timed(comm, device, warmup, iters, |c, buf, _| Box::pin(c.start_all_reduce(buf, ReduceOp::Sum)), &mut buf, &mut part).await?;
        report.rows.push(Row { op: "all_reduce", bytes, ms });
        let ms = timed(comm, device, warmup, iters, |c, buf, part| Box::pin(c.start_reduce_scatter(buf, part, ReduceOp::Sum)), &mut buf, &mut part).await?;
        report.rows.push(Row { op: "reduce_scatter", bytes, ms });
        let ms = timed(comm, device, warmup, iters, |c, buf, part| Box::pin(c.start_all_gather(part, buf)), &mut buf, &mut part).await?;
        report.rows.push(Row { op: "all_gather", bytes, ms });
        drop((buf, part));
        bytes *= 2;
    }
    // Latency through the `Collective` trait, each operation awaited (queue, then poll its
    // completion event), timed on the host: what a caller that waits for every bucket pays.
    for bytes in [8usize, 64 << 10, 1 << 20, 16 << 20] {
        let len = bytes / 4;
        if len % n != 0 || bytes > max_bytes {
            continue;
        }
        let mut buf = device.zeros::<f32>(len)?;
        let mut part = device.zeros::<f32>(len / n)?;
        let iters = 100;
        for (op, which) in [("all_reduce (awaited)", 0), ("all_gather (awaited)", 1)] {
            for _ in 0..5 {
                awaited(comm, which, &mut buf, &mut part).await?;
            }
            comm.barrier().await?;
            let started = std::time::Instant::now();
            for _ in 0..iters {
                awaited(comm, which, &mut buf, &mut part).await?;
            }
            report.rows.push(Row { op, bytes, ms: started.elapsed().as_secs_f64() * 1e3 / iters as f64 });
        }
    }
    device.empty_cache()?;
    Ok(())
}

/// One awaited operation through the trait: all_reduce (`which == 0`) or all_gather.
async fn awaited(comm: &NcclCommunicator, which: usize, buf: &mut Buffer<f32>, part: &mut Buffer<f32>) -> rtx_collectives::Result<()> {
    if which == 0 {
        comm.all_reduce(buf, ReduceOp::Sum).await
    } else {
        comm.all_gather(part, buf).await
    }
}

type StartFn = for<'a> fn(
    &'a NcclCommunicator,
    &'a mut Buffer<f32>,
    &'a mut Buffer<f32>,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = rtx_collectives::Result<()>> + 'a>>;

/// Mean milliseconds per operation over `iters` queued operations, timed by CUDA events on the
/// device's stream after `warmup` untimed ones and a barrier.
async fn timed(
    comm: &NcclCommunicator,
    device: &Device,
    warmup: usize,
    iters: usize,
    start: StartFn,
    buf: &mut Buffer<f32>,
    part: &mut Buffer<f32>,
) -> Result<f64> {
    for _ in 0..warmup {
        start(comm, buf, part).await?;
    }
    comm.wait().await?;
    comm.barrier().await?;
    let timing = Some(rtx_kernels::cuda::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let begin = device.context().new_event(timing)?;
    let end = device.context().new_event(timing)?;
    begin.record(device.stream())?;
    for _ in 0..iters {
        start(comm, buf, part).await?;
    }
    end.record(device.stream())?;
    comm.wait().await?;
    let ms = begin.elapsed_ms(&end)? as f64;
    Ok(ms / iters as f64)
}

fn print_table(n: usize, reports: &[Report]) {
    let factor = |op: &str| if op.starts_with("all_reduce") { 2.0 * (n as f64 - 1.0) / n as f64 } else { (n as f64 - 1.0) / n as f64 };
    println!("\n| op | ranks | bytes | time (us) | algbw (GB/s) | busbw (GB/s) |");
    println!("|---|---|---|---|---|---|");
    for (i, row) in reports[0].rows.iter().enumerate() {
        // The slowest rank's time counts (as in nccl-tests).
        let ms = reports.iter().filter_map(|r| r.rows.get(i)).map(|r| r.ms).fold(row.ms, f64::max);
        let algbw = row.bytes as f64 / (ms * 1e-3) / 1e9;
        println!("| {} | {n} | {} | {:.1} | {:.2} | {:.2} |", row.op, human(row.bytes), ms * 1e3, algbw, algbw * factor(row.op));
    }
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}
