//! `rtx bench actors`: the round trip of an actor call, in-process (a request/reply through a
//! bounded mailbox on another tokio task) and across processes (an `ask` over a QUIC link on
//! loopback to a child `rtx bench actors --serve` process), as medians over `--calls` calls.
//! Printed against the published figure of Ray's synchronous actor call (~500 µs).
//!
//! With `--load-bytes N` (default 64 MiB) it also times calls on an actor link over a side stream
//! of the collectives `QuicTransport` between this process and a child (`Link::over_transport`,
//! on the transport's control path, `--control`), first idle and then while both processes run
//! `all_reduce` of N bytes back to back through the same transports (the same endpoints the
//! collectives use in production): the control path must stay fast while tensors move. The
//! reference is the loopback TCP round trip between the same two processes (blocking std sockets,
//! `TCP_NODELAY`, a payload of the call's request envelope size, echoed by the child), measured in
//! the same run, idle and during the all_reduces. Each figure is printed as median and p99, and
//! the calls as ratios to the idle TCP round trip (issue 20's bar: at most 2x, idle and loaded).
//!
//! The peer answers with `--echo inline` (default: the echo served with `Link::serve_inline`,
//! answered on the link's reader, on the control thread) or `--echo task` (a task reading the
//! link's inbound receiver and replying, as an ordinary actor does), in both parts. `--caller
//! control` runs rank 0's calling loop on the transport's control thread instead of the bench's
//! runtime: the floor of the path, with no thread hand-off left on either side. `--carrier tls`
//! carries the same link over TCP with mutual TLS against the same cluster CA
//! (`Link::dial_tls`, `rtx_actors::tls`) instead of the QUIC transport, driven by a thread of its
//! own (`tls-runtime`: by the bench's runtime), while the all_reduce load stays on QUIC.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context as _};
use rtx_actors::{spawn, Actor, Context, Inbound, Link, LinkListener, LinkOptions, Reply, TlsLinkListener};
use rtx_collectives::{CommConfig, Communicator, ControlPath, Endpoint, QuicOptions, ReduceOp};
use serde_json::json;

/// Side-stream channel of the actor link in the `--load-bytes` part.
const LOAD_CHANNEL: u32 = 7;
/// All_reduces that must finish while the loaded calls are timed.
const LOADED_ROUNDS: u64 = 3;

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
    /// Which connection carries the actor link of the `--load-bytes` part
    /// (`QuicOptions::control`): `shared` (stripe 0 of the collectives connection), `endpoint` (a
    /// control connection between second endpoints), `thread` (the same, driven by a thread of its
    /// own).
    #[arg(long, default_value = "thread", value_parser = parse_control)]
    pub control: ControlPath,
    /// How the peer process answers the echo calls: `inline` (registered with
    /// `Link::serve_inline`, answered on the link's reader as it reads them) or `task` (through the
    /// link's inbound receiver to a task that replies, as an actor would).
    #[arg(long, default_value = "inline", value_parser = parse_echo)]
    pub echo: EchoMode,
    /// Where rank 0's calling loop of the `--load-bytes` part runs: `task` (on the bench's
    /// runtime, as any caller) or `control` (on the transport's control thread, beside the link's
    /// reader and quinn's drivers: no thread hand-off on the calling side; needs `--control
    /// thread`).
    #[arg(long, default_value = "task", value_parser = parse_caller)]
    pub caller: CallerMode,
    /// What carries the actor link of the `--load-bytes` part: `quic` (a side stream of the
    /// collectives transport, on its `--control` path), `tls` (TCP with mutual TLS against the
    /// same cluster CA, `Link::dial_tls`, driven by a current-thread runtime on a thread of its
    /// own) or `tls-runtime` (the same link driven by the bench's own runtime). The all_reduce load
    /// runs on the collectives transport in every case.
    #[arg(long, default_value = "quic", value_parser = parse_carrier)]
    pub carrier: Carrier,
    /// Internal: be rank 1 of the `--load-bytes` part, with identities in this folder.
    #[arg(long, hide = true)]
    pub serve_load: Option<PathBuf>,
}

fn parse_control(text: &str) -> Result<ControlPath, String> {
    match text {
        "shared" => Ok(ControlPath::Shared),
        "endpoint" => Ok(ControlPath::OwnEndpoint),
        "thread" => Ok(ControlPath::OwnThread),
        other => Err(format!("unknown control path `{other}` (shared, endpoint, thread)")),
    }
}

/// How the peer process answers echo calls (`--echo`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EchoMode {
    /// `Link::serve_inline`: on the link's reader.
    Inline,
    /// A task reading the link's inbound receiver.
    Task,
}

fn parse_echo(text: &str) -> Result<EchoMode, String> {
    match text {
        "inline" => Ok(EchoMode::Inline),
        "task" => Ok(EchoMode::Task),
        other => Err(format!("unknown echo mode `{other}` (inline, task)")),
    }
}

fn echo_name(mode: EchoMode) -> &'static str {
    match mode {
        EchoMode::Inline => "inline",
        EchoMode::Task => "task",
    }
}

/// Answers echo calls on `link` inline when `mode` says so (calls read before this still reach
/// the inbound receiver, which the caller keeps answering).
fn serve_echo(link: &Link, mode: EchoMode) {
    if mode == EchoMode::Inline {
        link.serve_inline("echo", |v: u64| Ok::<u64, String>(v + 1));
    }
}

/// What carries the actor link under load (`--carrier`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Carrier {
    /// A side stream of the collectives' QUIC transport.
    Quic,
    /// TCP with mutual TLS, on a link thread of its own.
    Tls,
    /// TCP with mutual TLS, on the bench's runtime.
    TlsRuntime,
}

fn parse_carrier(text: &str) -> Result<Carrier, String> {
    match text {
        "quic" => Ok(Carrier::Quic),
        "tls" => Ok(Carrier::Tls),
        "tls-runtime" => Ok(Carrier::TlsRuntime),
        other => Err(format!("unknown carrier `{other}` (quic, tls, tls-runtime)")),
    }
}

fn carrier_name(carrier: Carrier) -> &'static str {
    match carrier {
        Carrier::Quic => "quic",
        Carrier::Tls => "tls",
        Carrier::TlsRuntime => "tls-runtime",
    }
}

/// A current-thread runtime on a thread of its own that drives the TLS link (`--carrier tls`),
/// as the transport's control thread drives the QUIC control path; it stops when dropped.
struct LinkThread {
    handle: tokio::runtime::Handle,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl LinkThread {
    fn start() -> anyhow::Result<LinkThread> {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new().name("rtx-bench-link".into()).spawn(move || {
            runtime.block_on(async {
                let _ = stopped.await;
            });
        })?;
        Ok(LinkThread { handle, _stop: stop })
    }
}

/// Rank 1's TLS listener: publishes its address in `dir` and returns the first link accepted.
async fn accept_tls(dir: PathBuf) -> anyhow::Result<(Link, tokio::sync::mpsc::Receiver<Inbound>)> {
    let identity = super::collectives::read_identity(&dir, 1)?;
    let listener = TlsLinkListener::bind(&identity, SocketAddr::from(([127, 0, 0, 1], 0)), LinkOptions::default()).await?;
    let staging = dir.join("tls-link.staging");
    std::fs::write(&staging, listener.local_addr()?.to_string())?;
    std::fs::rename(&staging, dir.join("tls-link"))?;
    let (peer, link, inbound) = listener.accept().await?;
    anyhow::ensure!(peer == 0, "rank {peer} dialed the bench's TLS link");
    Ok((link, inbound))
}

/// Rank 0's side: dials rank 1's TLS listener once its address is published in `dir`.
async fn dial_tls(dir: PathBuf) -> anyhow::Result<(Link, tokio::sync::mpsc::Receiver<Inbound>)> {
    let identity = super::collectives::read_identity(&dir, 0)?;
    let addr: SocketAddr = loop {
        if let Ok(text) = std::fs::read_to_string(dir.join("tls-link")) {
            break text.trim().parse().context("rank 1's TLS link address")?;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    Ok(Link::dial_tls(&identity, addr, 1, LinkOptions::default()).await?)
}

/// Where the calling loop runs (`--caller`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallerMode {
    /// A task of the bench's runtime.
    Task,
    /// A task of the transport's control runtime.
    Control,
}

fn parse_caller(text: &str) -> Result<CallerMode, String> {
    match text {
        "task" => Ok(CallerMode::Task),
        "control" => Ok(CallerMode::Control),
        other => Err(format!("unknown caller `{other}` (task, control)")),
    }
}

fn caller_name(mode: CallerMode) -> &'static str {
    match mode {
        CallerMode::Task => "task",
        CallerMode::Control => "control",
    }
}

fn control_name(path: ControlPath) -> &'static str {
    match path {
        ControlPath::Shared => "shared",
        ControlPath::OwnEndpoint => "endpoint",
        ControlPath::OwnThread => "thread",
    }
}

/// Bytes of the request envelope of one echo call (`u64` body to actor `echo`): the TCP reference
/// moves the same payload each way.
fn call_bytes() -> anyhow::Result<usize> {
    // u32 length, u8 kind, u64 correlation, u16 name length, the name, the rkyv body.
    Ok(4 + 1 + 8 + 2 + "echo".len() + rtx_actors::encode(&0u64)?.len())
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
        return runtime.block_on(serve(args.echo));
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
        let mut child = Command::new(exe).args(["bench", "actors", "--serve", "--echo", echo_name(args.echo)]).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().context("start the peer process")?;
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
        let (l, c) = (Summary::of(&mut local), Summary::of(&mut cross));
        super::emit(json!({ "bench": "actors", "echo": echo_name(args.echo), "caller": caller_name(args.caller), "calls": args.calls, "in_process_median_us": l.median, "in_process_p99_us": l.p99, "cross_process_quic_median_us": c.median, "cross_process_quic_p99_us": c.p99, "ray_sync_call_us": 497.0, "ratio_vs_ray": c.median / 497.0, "bar_us": 100.0 }));
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
        .arg("--control")
        .arg(control_name(args.control))
        .arg("--echo")
        .arg(echo_name(args.echo))
        .arg("--carrier")
        .arg(carrier_name(args.carrier))
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

/// One side of the `--load-bytes` part. Rank 0 times calls to rank 1's echo over a side stream,
/// and TCP round trips to rank 1's TCP echo: idle, then while both run all_reduce of
/// `--load-bytes` in a loop; each loop turn ends with a one-element all_reduce of "go on" (rank 0
/// says stop when its timings are done).
async fn loaded_rank(args: &ActorsArgs, dir: &Path, rank: usize, calls: usize) -> anyhow::Result<()> {
    let options = QuicOptions { connect_timeout: Duration::from_secs(60), stripes: args.stripes, control: args.control, ..QuicOptions::default() };
    let transport = Arc::new(super::collectives::quic_rank_in(dir, rank, 2, options).await?);
    let comm = Endpoint::new(
        Arc::clone(&transport) as Arc<dyn rtx_collectives::Transport>,
        CommConfig { op_timeout: Duration::from_secs(120), ..CommConfig::default() },
    )?
    .world()?;
    let stop = Arc::new(AtomicBool::new(false));
    let payload = call_bytes()?;
    let link_thread = if args.carrier == Carrier::Tls { Some(LinkThread::start()?) } else { None };
    let link_runtime = link_thread.as_ref().map_or_else(tokio::runtime::Handle::current, |t| t.handle.clone());
    if rank == 1 {
        let tcp = std::net::TcpListener::bind("127.0.0.1:0")?;
        let staging = dir.join("tcp-echo.staging");
        std::fs::write(&staging, tcp.local_addr()?.to_string())?;
        std::fs::rename(&staging, dir.join("tcp-echo"))?;
        std::thread::spawn(move || tcp_echo(&tcp, payload));
        let (link, mut inbound) = match args.carrier {
            Carrier::Quic => {
                let (_peer, link, inbound) = Link::accept_over_transport(&transport, LOAD_CHANNEL).await?;
                (link, inbound)
            }
            Carrier::Tls | Carrier::TlsRuntime => link_runtime.spawn(accept_tls(dir.to_path_buf())).await.map_err(|e| anyhow!("TLS accept task: {e}"))??,
        };
        serve_echo(&link, args.echo);
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
    let (link, _inbound) = match args.carrier {
        Carrier::Quic => Link::over_transport(&transport, 1, LOAD_CHANNEL).await?,
        Carrier::Tls | Carrier::TlsRuntime => link_runtime.spawn(dial_tls(dir.to_path_buf())).await.map_err(|e| anyhow!("TLS dial task: {e}"))??,
    };
    let tcp_addr: std::net::SocketAddr = loop {
        if let Ok(text) = std::fs::read_to_string(dir.join("tcp-echo")) {
            break text.trim().parse().context("rank 1's TCP echo address")?;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let mut tcp = std::net::TcpStream::connect(tcp_addr)?;
    tcp.set_nodelay(true)?;
    let remote = link.remote::<u64>("echo");
    let rounds = Arc::new(AtomicU64::new(0));
    // Idle: `calls` calls. Loaded: at least `calls`, and on until LOADED_ROUNDS all_reduces have
    // finished since the first timed call, so the calls span the load rather than a gap in it.
    // With `--caller control` the calling loop itself runs on the control thread's runtime.
    let on_control = match args.caller {
        CallerMode::Task => None,
        CallerMode::Control => Some(match (args.carrier, &link_thread) {
            (Carrier::Tls, Some(thread)) => thread.handle.clone(),
            (Carrier::Quic, _) => transport.control_runtime().ok_or_else(|| anyhow!("--caller control needs --control thread"))?,
            _ => anyhow::bail!("--caller control needs the link on a thread of its own (--carrier quic with --control thread, or --carrier tls)"),
        }),
    };
    let timed = |n: usize, until_rounds: Option<u64>| {
        let calling = time_calls(remote.clone(), Arc::clone(&rounds), n, until_rounds);
        let on_control = on_control.clone();
        async move {
            match on_control {
                Some(runtime) => runtime.spawn(calling).await.map_err(|e| anyhow!("calling task: {e}"))?,
                None => calling.await,
            }
        }
    };
    let mut tcp_idle = tokio::task::block_in_place(|| tcp_round_trips(&mut tcp, payload, calls))?;
    let (mut idle, _) = timed(calls, None).await?;
    let load = {
        let (comm, stop, counter) = (comm.clone(), Arc::clone(&stop), Arc::clone(&rounds));
        let bytes = args.load_bytes;
        tokio::spawn(async move { all_reduce_loop_counted(&comm, bytes, &stop, Some(&counter)).await })
    };
    // Let the first all_reduce get going.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (mut loaded, rounds_during_calls) = timed(calls, Some(LOADED_ROUNDS)).await?;
    let mut tcp_loaded = tokio::task::block_in_place(|| tcp_round_trips(&mut tcp, payload, calls))?;
    stop.store(true, Ordering::SeqCst);
    let rounds_total = load.await.map_err(|e| anyhow!("all_reduce loop: {e}"))??;
    drop(tcp);
    link.close("bench done");
    let (rtt, i, l, rtt_l) = (Summary::of(&mut tcp_idle), Summary::of(&mut idle), Summary::of(&mut loaded), Summary::of(&mut tcp_loaded));
    eprintln!(
        "actor call across processes, carrier {}, control path `{}`, echo {}, caller {} ({} stripe(s), {} threads): TCP round trip ({payload} B, to the same peer process) median {:.1} / p99 {:.1} us; \
         call idle {:.1} / {:.1} us = {:.2}x TCP; {} calls during {} all_reduce of {} MiB {:.1} / {:.1} us = {:.2}x TCP (TCP itself then {:.1} / {:.1} us)",
        carrier_name(args.carrier),
        control_name(args.control),
        echo_name(args.echo),
        caller_name(args.caller),
        args.stripes,
        args.threads,
        rtt.median,
        rtt.p99,
        i.median,
        i.p99,
        i.median / rtt.median,
        loaded.len(),
        rounds_during_calls,
        args.load_bytes >> 20,
        l.median,
        l.p99,
        l.median / rtt.median,
        rtt_l.median,
        rtt_l.p99,
    );
    super::emit(
        json!({ "bench": "actors", "part": "over_collectives_transport", "carrier": carrier_name(args.carrier), "caller": caller_name(args.caller), "control": control_name(args.control), "echo": echo_name(args.echo), "calls": calls, "stripes": args.stripes, "threads": args.threads, "load_bytes": args.load_bytes,
        "payload_bytes": payload, "all_reduces_during_calls": rounds_during_calls, "all_reduces": rounds_total, "loaded_calls": loaded.len(), "tcp_rtt_median_us": rtt.median, "tcp_rtt_p99_us": rtt.p99, "idle_median_us": i.median, "idle_p99_us": i.p99,
        "loaded_median_us": l.median, "loaded_p99_us": l.p99, "tcp_rtt_loaded_median_us": rtt_l.median, "tcp_rtt_loaded_p99_us": rtt_l.p99,
        "idle_over_tcp_rtt": i.median / rtt.median, "loaded_over_tcp_rtt": l.median / rtt.median, "bar_over_tcp_rtt": 2.0 }),
    );
    transport.close(Duration::from_secs(5)).await;
    Ok(())
}

/// Times `n` echo calls to `remote` (after 200 untimed ones); with `until_rounds`, goes on until
/// that many all_reduces have finished since the first timed call. Returns the timings and the
/// all_reduces finished meanwhile.
async fn time_calls(remote: rtx_actors::RemoteRef<u64>, rounds: Arc<AtomicU64>, n: usize, until_rounds: Option<u64>) -> anyhow::Result<(Vec<Duration>, u64)> {
    let mut samples = Vec::with_capacity(n);
    let mut from = rounds.load(Ordering::SeqCst);
    for i in 0u64.. {
        if i == 200 {
            from = rounds.load(Ordering::SeqCst);
        }
        let enough = samples.len() >= n && until_rounds.is_none_or(|k| rounds.load(Ordering::SeqCst) >= from + k);
        if enough {
            break;
        }
        let t = Instant::now();
        let v: u64 = remote.ask(&i, Duration::from_secs(10)).await?;
        anyhow::ensure!(v == i + 1, "remote echo answered {v} to {i}");
        if i >= 200 {
            samples.push(t.elapsed());
        }
    }
    Ok((samples, rounds.load(Ordering::SeqCst) - from))
}

/// Echoes `payload`-byte messages on each accepted TCP connection until it ends (rank 1's TCP
/// reference).
fn tcp_echo(listener: &std::net::TcpListener, payload: usize) {
    use std::io::{Read, Write};
    while let Ok((mut stream, _)) = listener.accept() {
        let _ = stream.set_nodelay(true);
        let mut buf = vec![0u8; payload];
        while stream.read_exact(&mut buf).is_ok() {
            if stream.write_all(&buf).is_err() {
                break;
            }
        }
    }
}

/// `n` timed round trips of `payload` bytes (after 200 untimed ones) on `stream`.
fn tcp_round_trips(stream: &mut std::net::TcpStream, payload: usize, n: usize) -> anyhow::Result<Vec<Duration>> {
    use std::io::{Read, Write};
    let mut buf = vec![7u8; payload];
    let mut samples = Vec::with_capacity(n);
    for i in 0..n + 200 {
        let t = Instant::now();
        stream.write_all(&buf)?;
        stream.read_exact(&mut buf)?;
        if i >= 200 {
            samples.push(t.elapsed());
        }
    }
    Ok(samples)
}

/// all_reduce of `bytes` back to back until rank 0 sets `stop`; returns how many ran.
async fn all_reduce_loop(comm: &Communicator, bytes: usize, stop: &AtomicBool) -> anyhow::Result<u64> {
    all_reduce_loop_counted(comm, bytes, stop, None).await
}

/// [`all_reduce_loop`], counting finished all_reduces in `counter` as they finish.
async fn all_reduce_loop_counted(comm: &Communicator, bytes: usize, stop: &AtomicBool, counter: Option<&AtomicU64>) -> anyhow::Result<u64> {
    let mut data = vec![1.0f32; bytes / 4];
    let mut rounds = 0;
    loop {
        comm.all_reduce(&mut data, ReduceOp::Avg).await?;
        rounds += 1;
        if let Some(counter) = counter {
            counter.fetch_add(1, Ordering::SeqCst);
        }
        let mut go_on = [if stop.load(Ordering::SeqCst) { 0.0f32 } else { 1.0 }];
        comm.all_reduce(&mut go_on, ReduceOp::Min).await?;
        if go_on[0] == 0.0 {
            return Ok(rounds);
        }
    }
}

async fn serve(echo: EchoMode) -> anyhow::Result<()> {
    let listener = LinkListener::bind("127.0.0.1:0".parse()?, LinkOptions::default())?;
    #[allow(clippy::print_stdout)]
    {
        println!("{}", listener.local_addr()?);
    }
    let (link, mut inbound) = listener.accept().await.ok_or_else(|| anyhow!("no peer"))?;
    serve_echo(&link, echo);
    while let Some(msg) = inbound.recv().await {
        let v: u64 = msg.decode()?;
        msg.reply(&(v + 1)).await?;
    }
    Ok(())
}

/// Median and 99th percentile of timings, in microseconds.
struct Summary {
    median: f64,
    p99: f64,
}

impl Summary {
    fn of(samples: &mut [Duration]) -> Summary {
        samples.sort();
        let at = |q: f64| {
            let i = ((samples.len() as f64 * q) as usize).min(samples.len().saturating_sub(1));
            samples.get(i).map_or(0.0, |d| d.as_secs_f64() * 1e6)
        };
        Summary { median: at(0.5), p99: at(0.99) }
    }
}
