//! `rtx bench actors`: the round trip of an actor call, in-process (a request/reply through a
//! bounded mailbox on another tokio task) and across processes (an `ask` over a QUIC link on
//! loopback to a child `rtx bench actors --serve` process), as medians over `--calls` calls.
//! Printed against the published figure of Ray's synchronous actor call (~500 µs).
//!
//! With `--load-bytes N` (default 64 MiB) it also times calls on an actor link that rides a side
//! stream of a collectives `QuicTransport` between this process and a child, first idle and then
//! while both processes run `all_reduce` of N bytes back to back on the same connection pair: the
//! control path must stay fast while tensors move. Both are printed as ratios to the loopback TCP
//! round trip of 64 bytes measured in the same run.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context as _};
use rtx_actors::{spawn, Actor, Context, Link, LinkListener, LinkOptions, Reply};
use rtx_collectives::{CommConfig, Communicator, Endpoint, QuicOptions, ReduceOp};
use serde_json::json;

/// Side-stream channel of the actor link in the `--load-bytes` part.
const LOAD_CHANNEL: u32 = 7;

/// Arguments of `rtx bench actors`.
#[derive(clap::Args, Debug, Clone)]
pub struct ActorsArgs {
    /// Calls to time (after 200 warm-up calls).
    #[arg(long, default_value_t = 5000)]
    pub calls: usize,
    /// Internal: serve echo calls on a link and print the address (the peer process).
    #[arg(long, hide = true)]
    pub serve: bool,
    /// Bytes of the all_reduce that runs while calls are timed over the collectives connection
    /// (K, M, G suffixes; 0 skips that part).
    #[arg(long, default_value = "64M", value_parser = super::collectives::parse_size)]
    pub load_bytes: usize,
    /// QUIC connections per rank pair for the collectives transport (`QuicOptions::stripes`).
    #[arg(long, default_value_t = 1)]
    pub stripes: usize,
    /// tokio worker threads per process.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Internal: be rank 1 of the `--load-bytes` part, with identities in this folder.
    #[arg(long, hide = true)]
    pub serve_load: Option<PathBuf>,
}

struct Echo;

impl Actor for Echo {
    type Msg = (u64, Reply<u64>);
    async fn handle(&mut self, (v, reply): (u64, Reply<u64>), _ctx: &mut Context<(u64, Reply<u64>)>) -> rtx_actors::Result<()> {
        reply.send(v + 1);
        Ok(())
    }
}

/// Runs the benchmark (or the peer side).
pub(super) fn run(args: &ActorsArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(args.threads.max(1)).enable_all().build()?;
    if args.serve {
        return runtime.block_on(serve());
    }
    if let Some(dir) = &args.serve_load {
        return runtime.block_on(loaded_rank(args, dir, 1, args.calls));
    }
    runtime.block_on(async {
        let warm = 200;
        let (echo, _handle) = spawn("echo", Echo, 64);
        let mut local = Vec::with_capacity(args.calls);
        for i in 0..(warm + args.calls) as u64 {
            let t = Instant::now();
            let v = echo.ask(|r| (i, r)).await?;
            if v != i + 1 {
                return Err(anyhow!("echo answered {v} to {i}"));
            }
            if i >= warm as u64 {
                local.push(t.elapsed());
            }
        }
        let exe = std::env::current_exe()?;
        let mut child = Command::new(exe).args(["bench", "actors", "--serve"]).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().context("start the peer process")?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().ok_or_else(|| anyhow!("no peer stdout"))?).read_line(&mut line)?;
        let addr = line.trim().parse().with_context(|| format!("peer printed {line:?}"))?;
        let (link, _inbound) = Link::dial(addr, LinkOptions::default()).await?;
        let remote = link.remote::<u64>("echo");
        let mut cross = Vec::with_capacity(args.calls);
        for i in 0..(warm + args.calls) as u64 {
            let t = Instant::now();
            let v: u64 = remote.ask(&i, Duration::from_secs(10)).await?;
            if v != i + 1 {
                return Err(anyhow!("remote echo answered {v} to {i}"));
            }
            if i >= warm as u64 {
                cross.push(t.elapsed());
            }
        }
        link.close("bench done");
        let _ = child.kill();
        let _ = child.wait();
        let (l, c) = (median_us(&mut local), median_us(&mut cross));
        super::emit(json!({ "bench": "actors", "calls": args.calls, "in_process_median_us": l, "cross_process_quic_median_us": c, "ray_sync_call_us": 497.0, "ratio_vs_ray": c / 497.0, "bar_us": 100.0 }));
        Ok::<_, anyhow::Error>(())
    })?;
    if args.load_bytes > 0 {
        under_load(args, &runtime)?;
    }
    Ok(())
}

/// The `--load-bytes` part: a child process as rank 1, this one as rank 0.
fn under_load(args: &ActorsArgs, runtime: &tokio::runtime::Runtime) -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("rtx-bench-actors-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    super::collectives::write_identities(&dir, 2)?;
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe)
        .args(["bench", "actors", "--calls"])
        .arg(args.calls.to_string())
        .arg("--load-bytes")
        .arg(args.load_bytes.to_string())
        .arg("--stripes")
        .arg(args.stripes.to_string())
        .arg("--threads")
        .arg(args.threads.to_string())
        .arg("--serve-load")
        .arg(&dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .context("start the peer process")?;
    let outcome = runtime.block_on(loaded_rank(args, &dir, 0, args.calls));
    if outcome.is_err() {
        let _ = child.kill();
    }
    let status = child.wait()?;
    let _ = std::fs::remove_dir_all(&dir);
    outcome?;
    anyhow::ensure!(status.success(), "the peer process failed: {status}");
    Ok(())
}

/// One side of the `--load-bytes` part. Rank 0 times calls to rank 1's echo over a side stream:
/// idle, then while both run all_reduce of `--load-bytes` in a loop; each loop turn ends with a
/// one-element all_reduce of "go on" (rank 0 says stop when its calls are done).
async fn loaded_rank(args: &ActorsArgs, dir: &Path, rank: usize, calls: usize) -> anyhow::Result<()> {
    let options = QuicOptions { connect_timeout: Duration::from_secs(60), stripes: args.stripes, ..QuicOptions::default() };
    let transport = Arc::new(super::collectives::quic_rank_in(dir, rank, 2, options).await?);
    let comm = Endpoint::new(Arc::clone(&transport) as Arc<dyn rtx_collectives::Transport>, CommConfig { op_timeout: Duration::from_secs(120), ..CommConfig::default() })?.world()?;
    let stop = Arc::new(AtomicBool::new(false));
    if rank == 1 {
        let (_peer, link, mut inbound) = Link::accept_over_transport(&transport, LOAD_CHANNEL).await?;
        let echo = tokio::spawn(async move {
            while let Some(msg) = inbound.recv().await {
                let v: u64 = msg.decode()?;
                msg.reply(&(v + 1)).await?;
            }
            Ok::<_, anyhow::Error>(())
        });
        // Idle part: rank 0 calls; then it joins the all_reduce loop.
        all_reduce_loop(&comm, args.load_bytes, &stop).await?;
        link.close("bench done");
        echo.abort();
        transport.close(Duration::from_secs(5)).await;
        return Ok(());
    }
    let (link, _inbound) = Link::over_transport(&transport, 1, LOAD_CHANNEL).await?;
    let remote = link.remote::<u64>("echo");
    let time_calls = |n: usize| {
        let remote = &remote;
        async move {
            let mut samples = Vec::with_capacity(n);
            for i in 0..(n + 200) as u64 {
                let t = Instant::now();
                let v: u64 = remote.ask(&i, Duration::from_secs(10)).await?;
                anyhow::ensure!(v == i + 1, "remote echo answered {v} to {i}");
                if i >= 200 {
                    samples.push(t.elapsed());
                }
            }
            Ok::<_, anyhow::Error>(samples)
        }
    };
    let mut idle = time_calls(calls).await?;
    let load = {
        let (comm, stop) = (comm.clone(), Arc::clone(&stop));
        let bytes = args.load_bytes;
        tokio::spawn(async move { all_reduce_loop(&comm, bytes, &stop).await })
    };
    // Let the first all_reduce get going.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut loaded = time_calls(calls).await?;
    stop.store(true, Ordering::SeqCst);
    let rounds = load.await.map_err(|e| anyhow!("all_reduce loop: {e}"))??;
    link.close("bench done");
    let rtt = super::collectives::tcp_round_trip_us(2000)?;
    let (i, l) = (median_us(&mut idle), median_us(&mut loaded));
    eprintln!(
        "actor call over the collectives connection ({} stripe(s)): idle {i:.1} us = {:.2}x TCP rtt, during {} all_reduce of {} MiB {l:.1} us = {:.2}x TCP rtt ({rtt:.1} us)",
        args.stripes,
        i / rtt,
        rounds,
        args.load_bytes >> 20,
        l / rtt
    );
    super::emit(json!({ "bench": "actors", "part": "over_collectives_connection", "calls": calls, "stripes": args.stripes, "threads": args.threads, "load_bytes": args.load_bytes,
        "all_reduces_during": rounds, "idle_median_us": i, "loaded_median_us": l, "tcp_rtt_us": rtt, "idle_over_tcp_rtt": i / rtt, "loaded_over_tcp_rtt": l / rtt, "bar_over_tcp_rtt": 2.0 }));
    transport.close(Duration::from_secs(5)).await;
    Ok(())
}

/// all_reduce of `bytes` back to back until rank 0 sets `stop`; returns how many ran.
async fn all_reduce_loop(comm: &Communicator, bytes: usize, stop: &AtomicBool) -> anyhow::Result<u64> {
    let mut data = vec![1.0f32; bytes / 4];
    let mut rounds = 0;
    loop {
        comm.all_reduce(&mut data, ReduceOp::Avg).await?;
        rounds += 1;
        let mut go_on = [if stop.load(Ordering::SeqCst) { 0.0f32 } else { 1.0 }];
        comm.all_reduce(&mut go_on, ReduceOp::Min).await?;
        if go_on[0] == 0.0 {
            return Ok(rounds);
        }
    }
}

async fn serve() -> anyhow::Result<()> {
    let listener = LinkListener::bind("127.0.0.1:0".parse()?, LinkOptions::default())?;
    #[allow(clippy::print_stdout)]
    {
        println!("{}", listener.local_addr()?);
    }
    let (_link, mut inbound) = listener.accept().await.ok_or_else(|| anyhow!("no peer"))?;
    while let Some(msg) = inbound.recv().await {
        let v: u64 = msg.decode()?;
        msg.reply(&(v + 1)).await?;
    }
    Ok(())
}

fn median_us(samples: &mut [Duration]) -> f64 {
    samples.sort();
    samples.get(samples.len() / 2).map_or(0.0, |d| d.as_secs_f64() * 1e6)
}
