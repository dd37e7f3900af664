//! `rtx bench collectives`: all_reduce, reduce_scatter and all_gather of f32 buffers between
//! ranks that are separate processes on this machine, over QUIC (mutual TLS, loopback) and shared
//! memory, next to references measured in the same run.
//!
//! The command spawns itself once per rank (hidden `--worker-*` arguments); ranks meet through a
//! temporary directory (QUIC: certificates issued by the parent, each rank's bound address; shared
//! memory: a job name). Every rank runs the same sweep; for each operation and size, rank 0 times
//! `--repeats` samples of back-to-back operations (each sample about `--sample-ms` long, started
//! after a barrier) and reports the median time per operation. Bandwidths follow nccl-tests:
//! `algbw = bytes / time` with `bytes` the full buffer (all_reduce buffer, reduce_scatter input,
//! all_gather output); `busbw = algbw * 2(n-1)/n` for all_reduce and `algbw * (n-1)/n` for the
//! other two.
//!
//! References, measured first in the same run: memcpy bandwidth at every size (pre-touched
//! buffers), loopback TCP throughput (one std `TcpStream`, 1 MiB writes), TCP round trip of 64
//! bytes (`TCP_NODELAY` ping-pong), and raw quinn stream throughput with the transport's own
//! configuration and TLS ([`rtx_collectives::quic_stream_throughput`], one way and both ways at
//! once). The ratio column divides busbw by the transport's limit: memcpy at that size for shared
//! memory, the two-way raw quinn rate for QUIC (a two-rank ring sends and receives at once, so that is
//! the cipher-and-quinn bound of its bus bandwidth). JSON lines go to stdout, a table to stderr.
//! `scripts/bench-collectives.sh` adds PyTorch Gloo on the same sizes.
//!
//! One more reference bounds what any TLS transport can reach where the CPUs are the limit: the
//! single-core seal and open rates of the transport's packet cipher
//! ([`rtx_collectives::tls_packet_cipher_throughput`]). A ring rank moving `B = busbw · t` bytes
//! each way spends at least `B / seal + B / open` seconds in the cipher on top of what a
//! plaintext transport spends, so Gloo made to encrypt could reach at most
//! `1 / (1 / gloo + k / seal + k / open)` busbw, with `k = max(1, ranks / cores)` ranks sharing a
//! core. `scripts/peer/gloo_bench.py --table` prints that bound and our ratio to it.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::ValueEnum;
use rtx_collectives::{
    quic_stream_throughput, segment_range, tls_packet_cipher_throughput, Cipher, ClusterCa, CommConfig, Communicator, Endpoint, NodeIdentity, QuicOptions,
    QuicTransport, ReduceOp, RoutedTransport, ShmOptions, ShmTransport, TlsOptions, TlsTransport, Transport,
};
use serde_json::json;

use super::emit;
use super::timing::round3;

/// A transport to measure.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum BenchTransport {
    /// QUIC with mutual TLS over 127.0.0.1.
    Quic,
    /// Shared-memory rings.
    Shm,
    /// Shared-memory rings between the ranks of one host and QUIC between hosts (`--hosts`), with
    /// the hierarchical all-reduce.
    Routed,
    /// TLS 1.3 over TCP (`TlsTransport`: one writer and one reader thread per connection).
    Tls,
    /// Shared-memory rings inside a host and TLS over TCP between hosts (`--hosts`), hierarchical.
    RoutedTls,
}

/// The AEAD of the TLS transports (`TlsOptions::cipher`).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum BenchCipher {
    /// AES-128-GCM first where the CPU has AES instructions, else ChaCha20-Poly1305.
    Auto,
    /// AES-128-GCM only.
    Aes128Gcm,
    /// ChaCha20-Poly1305 only.
    Chacha20Poly1305,
}

impl BenchCipher {
    fn cipher(self) -> Cipher {
        match self {
            BenchCipher::Auto => Cipher::Auto,
            BenchCipher::Aes128Gcm => Cipher::Aes128Gcm,
            BenchCipher::Chacha20Poly1305 => Cipher::ChaCha20Poly1305,
        }
    }
}

/// A collective to measure.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum CollectiveOp {
    /// `all_reduce` (sum), in place.
    AllReduce,
    /// `reduce_scatter` (sum).
    ReduceScatter,
    /// `all_gather`.
    AllGather,
}

/// Arguments of `rtx bench collectives`.
#[derive(clap::Args, Debug, Clone)]
pub struct CollectivesArgs {
    /// Transports to measure.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [BenchTransport::Quic, BenchTransport::Shm])]
    pub transports: Vec<BenchTransport>,
    /// World sizes; every rank is its own process.
    #[arg(long, value_delimiter = ',', default_values_t = [2usize, 4])]
    pub worlds: Vec<usize>,
    /// Operations to measure.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [CollectiveOp::AllReduce, CollectiveOp::ReduceScatter, CollectiveOp::AllGather])]
    pub ops: Vec<CollectiveOp>,
    /// Buffer sizes in bytes (suffixes K, M, G: powers of 1024); default: powers of 4 from 4K to
    /// --max-size.
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    pub sizes: Vec<usize>,
    /// Largest size of the default sweep.
    #[arg(long, value_parser = parse_size, default_value = "256M")]
    pub max_size: usize,
    /// Timed samples per size; the median is reported.
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Approximate length of one timed sample, in milliseconds (sets operations per sample).
    #[arg(long, default_value_t = 40)]
    pub sample_ms: u64,
    /// Measure all_reduce with the ring (the direct exchange off) and with recursive doubling at
    /// every size (the algorithm crossover), instead of the library's choice.
    #[arg(long)]
    pub crossover: bool,
    /// Override `CommConfig::small_message_bytes` (all_reduce up to this size uses recursive
    /// doubling).
    #[arg(long, value_parser = parse_size)]
    pub small_message_bytes: Option<usize>,
    /// Override `CommConfig::chunk_bytes` (payload bytes per frame).
    #[arg(long, value_parser = parse_size)]
    pub chunk_bytes: Option<usize>,
    /// Override `CommConfig::ring_window` (frames a ring sends ahead of those it has received).
    #[arg(long)]
    pub ring_window: Option<usize>,
    /// Override `QuicOptions::loopback_datagram_bytes`.
    #[arg(long)]
    pub quic_datagram: Option<u16>,
    /// Override `QuicOptions::stream_window_bytes`.
    #[arg(long, value_parser = parse_size)]
    pub quic_window: Option<usize>,
    /// Override `QuicOptions::network_datagram_bytes` (towards non-loopback addresses; 8952 for a
    /// 9000-byte MTU).
    #[arg(long)]
    pub quic_network_datagram: Option<u16>,
    /// QUIC connections per rank pair (`QuicOptions::stripes`); use with `--threads` of at least
    /// the same number so the connections' drivers run on separate cores.
    #[arg(long, default_value_t = 1)]
    pub stripes: usize,
    /// The AEAD of the `tls` and `routed-tls` transports.
    #[arg(long, value_enum, default_value = "auto")]
    pub cipher: BenchCipher,
    /// Override `CommConfig::channels`: most independent rings a large all_reduce is split into,
    /// each driven by its own thread on a multi-thread runtime (`--threads` 2 or more); unset, the
    /// transport's preference (1). The `ch` column shows what each size got.
    #[arg(long)]
    pub channels: Option<usize>,
    /// Override `CommConfig::direct_all_reduce_ranks`: largest group whose mid-size all_reduce
    /// (below two frames per rank) runs the direct exchange instead of the ring (0: never); unset,
    /// the transport's preference (TLS: 8, others: never). The JSON's `algorithm` shows what ran.
    #[arg(long)]
    pub direct_ranks: Option<usize>,
    /// Hosts the ranks are spread over, in contiguous blocks (rank r is on host r * hosts / n):
    /// sets `CommConfig::host_of`, so `all_reduce` is hierarchical, and decides which ranks the
    /// `routed` transport connects through shared memory.
    #[arg(long, default_value_t = 1)]
    pub hosts: usize,
    /// The address each host's ranks bind their QUIC endpoint to, one per host (default: all on
    /// 127.0.0.1). With `--netns`, the hosts' addresses inside their namespaces.
    #[arg(long, value_delimiter = ',')]
    pub host_addrs: Vec<std::net::IpAddr>,
    /// Run host h's ranks in the network namespace `PREFIX{h}` (`ip netns exec`; see
    /// scripts/netns-hosts.sh, whose namespaces are rtx-h0, rtx-h1, ... at 10.77.0.1, .2, ...).
    #[arg(long, value_name = "PREFIX", requires = "host_addrs")]
    pub netns: Option<String>,
    /// Override `ShmOptions::ring_bytes` (a power of two).
    #[arg(long, value_parser = parse_size)]
    pub shm_ring: Option<usize>,
    /// tokio worker threads per rank (1: a current-thread runtime).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Skip the reference measurements.
    #[arg(long)]
    pub no_references: bool,
    #[arg(long, hide = true)]
    pub worker_rank: Option<usize>,
    #[arg(long, hide = true)]
    pub worker_world: Option<usize>,
    #[arg(long, hide = true, value_enum)]
    pub worker_transport: Option<BenchTransport>,
    #[arg(long, hide = true)]
    pub worker_dir: Option<PathBuf>,
}

/// The references of one run.
#[derive(Debug, Default)]
struct References {
    /// (bytes, GB/s) for every size.
    memcpy: Vec<(usize, f64)>,
    tcp_gbps: f64,
    tcp_rtt_us: f64,
    quic_one_way_gbps: f64,
    quic_duplex_gbps: f64,
    /// The TLS packet cipher on one core: (seal, open) GB/s.
    tls_cipher_gbps: Option<(f64, f64)>,
}

const GB: f64 = 1e9;
/// Bytes the TCP and raw-QUIC references move per sample.
const STREAM_REFERENCE_BYTES: usize = 256 << 20;
/// How long a worker waits after the last barrier before it disconnects.
const LINGER: Duration = Duration::from_millis(300);
/// How long a worker waits for its peers to show up.
const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs the benchmark (or, with the hidden worker arguments, one rank of it).
pub(crate) fn run(args: &CollectivesArgs) -> anyhow::Result<()> {
    if let Some(rank) = args.worker_rank {
        return worker(args, rank);
    }
    anyhow::ensure!(args.repeats > 0, "--repeats must be at least 1");
    anyhow::ensure!(args.worlds.iter().all(|&n| n >= 2), "--worlds must be at least 2");
    anyhow::ensure!(args.hosts >= 1 && args.worlds.iter().all(|&n| n >= args.hosts), "--hosts must be between 1 and the smallest world size");
    anyhow::ensure!(
        args.host_addrs.is_empty() || args.host_addrs.len() == args.hosts,
        "--host-addrs names {} addresses for --hosts {}: one per host",
        args.host_addrs.len(),
        args.hosts
    );
    let sizes = sizes(args);
    anyhow::ensure!(!sizes.is_empty(), "no sizes to measure");
    let refs = if args.no_references { References::default() } else { references(args, &sizes)? };
    let mut rows = Vec::new();
    for &transport in &args.transports {
        for &world in &args.worlds {
            let algos: Vec<(&str, Option<usize>)> =
                if args.crossover { vec![("ring", Some(0)), ("doubling", Some(usize::MAX))] } else { vec![("auto", args.small_message_bytes)] };
            for (algo, small) in algos {
                let group = run_group(args, transport, world, algo, small, &sizes, &refs).with_context(|| format!("{transport:?} with {world} ranks"))?;
                rows.extend(group);
            }
        }
    }
    summary(&rows, &refs);
    Ok(())
}

/// One measured line, for the summary.
#[derive(Debug, Clone)]
struct Row {
    transport: BenchTransport,
    world: usize,
    algo: String,
    op: CollectiveOp,
    bytes: usize,
    stats: Micros,
}

/// Median, fastest and slowest of timed samples, in microseconds.
#[derive(Debug, Clone, Copy)]
struct Micros {
    median: f64,
    min: f64,
    max: f64,
    n: usize,
}

impl Micros {
    fn of(mut samples: Vec<f64>) -> Micros {
        samples.sort_by(f64::total_cmp);
        let n = samples.len();
        let median = if n % 2 == 1 { samples[n / 2] } else { 0.5 * (samples[n / 2 - 1] + samples[n / 2]) };
        Micros { median, min: samples[0], max: samples[n - 1], n }
    }
}

fn sizes(args: &CollectivesArgs) -> Vec<usize> {
    if !args.sizes.is_empty() {
        return args.sizes.clone();
    }
    let mut out = Vec::new();
    let mut size = 4 << 10;
    while size <= args.max_size {
        out.push(size);
        size *= 4;
    }
    out
}

pub(super) fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (digits, shift) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 30),
        _ => (s, 0),
    };
    let n: usize = digits.parse().map_err(|_| format!("not a size: {s:?} (use e.g. 4096, 64K, 16M)"))?;
    n.checked_shl(shift).filter(|v| v >> shift == n).ok_or_else(|| format!("size too large: {s}"))
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}G", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => format!("{b}"),
    }
}

fn op_name(op: CollectiveOp) -> &'static str {
    match op {
        CollectiveOp::AllReduce => "all_reduce",
        CollectiveOp::ReduceScatter => "reduce_scatter",
        CollectiveOp::AllGather => "all_gather",
    }
}

fn transport_name(t: BenchTransport) -> &'static str {
    match t {
        BenchTransport::Quic => "quic",
        BenchTransport::Shm => "shm",
        BenchTransport::Routed => "routed",
        BenchTransport::Tls => "tls",
        BenchTransport::RoutedTls => "routed-tls",
    }
}

/// nccl-tests' bus bandwidth factor.
fn bus_factor(op: CollectiveOp, n: usize) -> f64 {
    let n = n as f64;
    match op {
        CollectiveOp::AllReduce => 2.0 * (n - 1.0) / n,
        CollectiveOp::ReduceScatter | CollectiveOp::AllGather => (n - 1.0) / n,
    }
}

fn median(v: Vec<f64>) -> f64 {
    Micros::of(v).median
}

#[allow(clippy::print_stderr)]
fn note(line: &str) {
    eprintln!("{line}");
}

// ---------------------------------------------------------------------------------------------
// References

fn references(args: &CollectivesArgs, sizes: &[usize]) -> anyhow::Result<References> {
    let mut refs = References::default();
    note("references (median of repeats):");
    for &bytes in sizes {
        let gbps = memcpy_gbps(bytes, args.repeats);
        note(&format!("  memcpy {:>5}: {gbps:6.2} GB/s", human(bytes)));
        emit(json!({"bench": "collectives", "reference": "memcpy", "bytes": bytes, "gbps": round3(gbps)}));
        refs.memcpy.push((bytes, gbps));
    }
    refs.tcp_gbps = median((0..3).map(|_| tcp_throughput(STREAM_REFERENCE_BYTES)).collect::<anyhow::Result<Vec<_>>>()?);
    note(&format!("  loopback TCP, one stream: {:.2} GB/s", refs.tcp_gbps));
    emit(json!({"bench": "collectives", "reference": "tcp_throughput", "bytes": STREAM_REFERENCE_BYTES, "gbps": round3(refs.tcp_gbps)}));
    refs.tcp_rtt_us = tcp_round_trip_us(2000)?;
    note(&format!("  loopback TCP 64 B round trip: {:.1} us", refs.tcp_rtt_us));
    emit(json!({"bench": "collectives", "reference": "tcp_rtt_64b", "us": round3(refs.tcp_rtt_us)}));
    if args.transports.iter().any(|&t| t != BenchTransport::Shm) {
        let options = quic_options(args);
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        for duplex in [false, true] {
            let samples = (0..3)
                .map(|_| rt.block_on(quic_stream_throughput(&options, STREAM_REFERENCE_BYTES as u64, duplex)).map(|bps| bps / GB))
                .collect::<Result<Vec<_>, _>>()?;
            let gbps = median(samples);
            let which = if duplex { "both ways at once, per direction" } else { "one way" };
            note(&format!("  raw quinn stream (TLS, transport's config), {which}: {gbps:.2} GB/s"));
            emit(
                json!({"bench": "collectives", "reference": if duplex { "quic_raw_duplex" } else { "quic_raw_one_way" }, "bytes": STREAM_REFERENCE_BYTES, "gbps": round3(gbps)}),
            );
            if duplex {
                refs.quic_duplex_gbps = gbps;
            } else {
                refs.quic_one_way_gbps = gbps;
            }
        }
        let packet = usize::from(options.loopback_datagram_bytes);
        let samples = (0..3).map(|_| tls_packet_cipher_throughput(packet, STREAM_REFERENCE_BYTES as u64 / 4)).collect::<Result<Vec<_>, _>>()?;
        let seal = median(samples.iter().map(|c| c.seal_bps / GB).collect());
        let open = median(samples.iter().map(|c| c.open_bps / GB).collect());
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        note(&format!(
            "  TLS packet cipher (AES-128-GCM as quinn runs it, {packet}-byte packets), one core: seal {seal:.2} GB/s, open {open:.2} GB/s ({cores} cores)"
        ));
        emit(
            json!({"bench": "collectives", "reference": "tls_cipher", "packet_bytes": packet, "seal_gbps": round3(seal), "open_gbps": round3(open), "cores": cores}),
        );
        refs.tls_cipher_gbps = Some((seal, open));
    }
    Ok(refs)
}

fn memcpy_gbps(bytes: usize, repeats: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(&src);
    // Enough copies per sample to last a few milliseconds, and enough samples for a steady
    // median on a shared machine.
    let iters = ((8 << 30) / bytes / 1000).max(1);
    let samples = (0..repeats.max(11))
        .map(|_| {
            let start = Instant::now();
            for _ in 0..iters {
                dst.copy_from_slice(std::hint::black_box(&src));
                std::hint::black_box(&mut dst);
            }
            start.elapsed().as_secs_f64() / iters as f64
        })
        .collect();
    bytes as f64 / median(samples) / GB
}

fn tcp_throughput(total: usize) -> anyhow::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let writer = std::thread::spawn(move || -> std::io::Result<()> {
        let mut stream = TcpStream::connect(addr)?;
        let chunk = vec![0x5Au8; 1 << 20];
        let mut left = total;
        while left > 0 {
            let n = left.min(chunk.len());
            stream.write_all(&chunk[..n])?;
            left -= n;
        }
        Ok(())
    });
    let (mut stream, _) = listener.accept()?;
    let mut buf = vec![0u8; 1 << 20];
    let mut got = 0;
    let start = Instant::now();
    while got < total {
        let n = stream.read(&mut buf)?;
        anyhow::ensure!(n > 0, "TCP reference: stream ended early");
        got += n;
    }
    let seconds = start.elapsed().as_secs_f64();
    writer.join().map_err(|_| anyhow::anyhow!("TCP reference writer panicked"))??;
    Ok(total as f64 / seconds / GB)
}

pub(super) fn tcp_round_trip_us(rounds: usize) -> anyhow::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut stream, _) = listener.accept()?;
        stream.set_nodelay(true)?;
        let mut buf = [0u8; 64];
        loop {
            if stream.read_exact(&mut buf).is_err() {
                return Ok(());
            }
            stream.write_all(&buf)?;
        }
    });
    let mut stream = TcpStream::connect(addr)?;
    stream.set_nodelay(true)?;
    let mut buf = [7u8; 64];
    let mut samples = Vec::with_capacity(rounds);
    for i in 0..rounds + rounds / 10 {
        let start = Instant::now();
        stream.write_all(&buf)?;
        stream.read_exact(&mut buf)?;
        if i >= rounds / 10 {
            samples.push(start.elapsed().as_secs_f64() * 1e6);
        }
    }
    drop(stream);
    echo.join().map_err(|_| anyhow::anyhow!("TCP echo panicked"))??;
    Ok(median(samples))
}

// ---------------------------------------------------------------------------------------------
// Parent: one group of rank processes

/// Kills the rank processes if the parent gives up early.
struct Ranks(Vec<Child>);

impl Drop for Ranks {
    fn drop(&mut self) {
        for child in &mut self.0 {
            if let Ok(None) = child.try_wait() {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

fn run_group(
    args: &CollectivesArgs,
    transport: BenchTransport,
    world: usize,
    algo: &str,
    small: Option<usize>,
    sizes: &[usize],
    refs: &References,
) -> anyhow::Result<Vec<Row>> {
    let dir = std::env::temp_dir().join(format!("rtx-bench-collectives-{}-{}-{world}-{algo}", std::process::id(), transport_name(transport)));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    if transport != BenchTransport::Shm {
        write_identities(&dir, world)?;
    }
    let exe = std::env::current_exe().context("locate the rtx binary")?;
    let ops: Vec<String> = args.ops.iter().map(|&op| op_name(op).replace('_', "-")).collect();
    let size_list: Vec<String> = sizes.iter().map(|s| s.to_string()).collect();
    let mut ranks = Ranks(Vec::new());
    for rank in 0..world {
        let mut cmd = match &args.netns {
            // This rank's host is a network namespace: `ip netns exec NAME rtx ...`.
            Some(prefix) => {
                let mut cmd = Command::new("ip");
                cmd.args(["netns", "exec"]).arg(format!("{prefix}{}", host_of_rank(rank, world, args.hosts))).arg(&exe);
                cmd
            }
            None => Command::new(&exe),
        };
        cmd.args(["bench", "collectives", "--worker-transport", transport_name(transport)])
            .arg("--hosts")
            .arg(args.hosts.to_string())
            .arg("--worker-rank")
            .arg(rank.to_string())
            .arg("--worker-world")
            .arg(world.to_string())
            .arg("--worker-dir")
            .arg(&dir)
            .arg("--ops")
            .arg(ops.join(","))
            .arg("--sizes")
            .arg(size_list.join(","))
            .arg("--repeats")
            .arg(args.repeats.to_string())
            .arg("--sample-ms")
            .arg(args.sample_ms.to_string())
            .arg("--threads")
            .arg(args.threads.to_string())
            .arg("--stripes")
            .arg(args.stripes.to_string())
            .arg("--cipher")
            .arg(args.cipher.to_possible_value().map_or_else(|| "auto".to_string(), |v| v.get_name().to_string()));
        let overrides = [
            ("--small-message-bytes", small),
            ("--chunk-bytes", args.chunk_bytes),
            ("--ring-window", args.ring_window),
            ("--channels", args.channels),
            // The crossover's ring is the ring at every size: no direct exchange in its window.
            ("--direct-ranks", if algo == "ring" { Some(0) } else { args.direct_ranks }),
            ("--quic-datagram", args.quic_datagram.map(usize::from)),
            ("--quic-window", args.quic_window),
            ("--quic-network-datagram", args.quic_network_datagram.map(usize::from)),
            ("--shm-ring", args.shm_ring),
        ];
        if !args.host_addrs.is_empty() {
            cmd.arg("--host-addrs").arg(args.host_addrs.iter().map(ToString::to_string).collect::<Vec<_>>().join(","));
        }
        for (flag, value) in overrides {
            if let Some(v) = value {
                cmd.arg(flag).arg(v.to_string());
            }
        }
        cmd.stdin(Stdio::null()).stdout(if rank == 0 { Stdio::piped() } else { Stdio::null() });
        ranks.0.push(cmd.spawn().with_context(|| format!("spawn rank {rank}"))?);
    }
    let stdout = ranks.0[0].stdout.take().context("rank 0 stdout")?;
    let mut rows = Vec::new();
    note(&format!(
        "\n{:<5} {:>2} {:<8} {:<15} {:>6} {:>2} {:>11} {:>8} {:>8} {:>13} {:>6}",
        "xport", "n", "algo", "op", "size", "ch", "time (us)", "algbw", "busbw", "limit GB/s", "ratio"
    ));
    note(&format!("(threads {}, stripes {}, channels {})", args.threads, args.stripes, args.channels.map_or_else(|| "default".to_string(), |c| c.to_string())));
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        let v: serde_json::Value = serde_json::from_str(&line).with_context(|| format!("rank 0 printed {line:?}"))?;
        let (Some(op), Some(bytes)) = (v["op"].as_str(), v["bytes"].as_u64()) else { continue };
        let op = match op {
            "all_reduce" => CollectiveOp::AllReduce,
            "reduce_scatter" => CollectiveOp::ReduceScatter,
            _ => CollectiveOp::AllGather,
        };
        let bytes = bytes as usize;
        let samples: Vec<f64> = v["samples_us"].as_array().map(|a| a.iter().filter_map(|x| x.as_f64()).collect()).unwrap_or_default();
        anyhow::ensure!(!samples.is_empty(), "rank 0 reported no samples: {line}");
        let stats = Micros::of(samples);
        let time_s = stats.median * 1e-6;
        let algbw = bytes as f64 / time_s / GB;
        let busbw = algbw * bus_factor(op, world);
        let (limit_name, limit) = match transport {
            BenchTransport::Shm => ("memcpy", refs.memcpy.iter().find(|(b, _)| *b == bytes).map_or(0.0, |(_, g)| *g)),
            BenchTransport::Quic | BenchTransport::Routed => ("quinn-2way", refs.quic_duplex_gbps),
            BenchTransport::Tls | BenchTransport::RoutedTls => ("tcp-1way", refs.tcp_gbps),
        };
        let ratio = if limit > 0.0 { busbw / limit } else { f64::NAN };
        let tcp_ratio = if refs.tcp_gbps > 0.0 { busbw / refs.tcp_gbps } else { f64::NAN };
        let channels = v["channels"].as_u64().unwrap_or(1);
        note(&format!(
            "{:<5} {:>2} {:<8} {:<15} {:>6} {:>2} {:>11.1} {:>8.3} {:>8.3} {:>6} {:>6.2} {:>6.2}",
            transport_name(transport),
            world,
            algo,
            op_name(op),
            human(bytes),
            channels,
            stats.median,
            algbw,
            busbw,
            limit_name,
            limit,
            ratio
        ));
        emit(json!({
            "bench": "collectives", "transport": transport_name(transport), "world": world, "algo": algo, "op": op_name(op), "bytes": bytes,
            "channels": channels, "algorithm": v["algorithm"], "threads": args.threads, "stripes": args.stripes,
            "time_us": round3(stats.median), "min_us": round3(stats.min), "max_us": round3(stats.max), "repeats": stats.n,
            "iters": v["iters"], "algbw_gbps": round3(algbw), "busbw_gbps": round3(busbw), "limit": limit_name, "limit_gbps": round3(limit),
            "ratio": if ratio.is_finite() { json!(round3(ratio)) } else { json!(null) },
            "busbw_over_tcp": if tcp_ratio.is_finite() { json!(round3(tcp_ratio)) } else { json!(null) },
        }));
        rows.push(Row { transport, world, algo: algo.to_string(), op, bytes, stats });
    }
    for (rank, child) in ranks.0.iter_mut().enumerate() {
        let status = child.wait()?;
        anyhow::ensure!(status.success(), "rank {rank} failed: {status}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(rows)
}

fn summary(rows: &[Row], refs: &References) {
    if refs.tcp_rtt_us <= 0.0 {
        return;
    }
    note("\nsmall messages: 4K all_reduce time / TCP 64 B round trip");
    for row in rows.iter().filter(|r| r.op == CollectiveOp::AllReduce && r.bytes == 4 << 10) {
        let ratio = row.stats.median / refs.tcp_rtt_us;
        note(&format!(
            "  {:<5} n={} {:<8} {:8.1} us = {:5.2} x {:.1} us",
            transport_name(row.transport),
            row.world,
            row.algo,
            row.stats.median,
            ratio,
            refs.tcp_rtt_us
        ));
        emit(
            json!({"bench": "collectives", "summary": "latency_4k_over_tcp_rtt", "transport": transport_name(row.transport), "world": row.world, "algo": row.algo, "ratio": round3(ratio)}),
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Worker: one rank

fn quic_options(args: &CollectivesArgs) -> QuicOptions {
    let mut options = QuicOptions { connect_timeout: RENDEZVOUS_TIMEOUT, stripes: args.stripes, ..QuicOptions::default() };
    if let Some(d) = args.quic_datagram {
        options.loopback_datagram_bytes = d;
    }
    if let Some(d) = args.quic_network_datagram {
        options.network_datagram_bytes = d;
    }
    if let Some(w) = args.quic_window {
        options.stream_window_bytes = u32::try_from(w).unwrap_or(u32::MAX);
    }
    options
}

/// The host of `rank` among `world` ranks in `hosts` contiguous blocks.
fn host_of_rank(rank: usize, world: usize, hosts: usize) -> usize {
    rank * hosts.max(1) / world.max(1)
}

fn comm_config(args: &CollectivesArgs, world: usize) -> CommConfig {
    let mut config = CommConfig { op_timeout: Duration::from_secs(120), ..CommConfig::default() };
    if args.hosts > 1 {
        config.host_of = (0..world).map(|r| host_of_rank(r, world, args.hosts) as u32).collect();
    }
    if let Some(s) = args.small_message_bytes {
        config.small_message_bytes = s;
    }
    if let Some(w) = args.ring_window {
        config.ring_window = Some(w);
    }
    if let Some(c) = args.channels {
        config.channels = Some(c);
    }
    if let Some(d) = args.direct_ranks {
        config.direct_all_reduce_ranks = Some(d);
    }
    if let Some(c) = args.chunk_bytes {
        config.chunk_bytes = Some(c);
        config.max_payload_bytes = config.max_payload_bytes.max(c);
    }
    config
}

fn worker(args: &CollectivesArgs, rank: usize) -> anyhow::Result<()> {
    let world = args.worker_world.context("--worker-world")?;
    let transport = args.worker_transport.context("--worker-transport")?;
    let dir = args.worker_dir.clone().context("--worker-dir")?;
    let rt = if args.threads <= 1 {
        tokio::runtime::Builder::new_current_thread().enable_all().build()?
    } else {
        tokio::runtime::Builder::new_multi_thread().worker_threads(args.threads).enable_all().build()?
    };
    rt.block_on(async {
        let config = comm_config(args, world);
        let mut quic = None;
        let mut tls: Option<Arc<TlsTransport>> = None;
        let job = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "bench".into());
        let shm_options = |job: String| {
            let mut options = ShmOptions { job, connect_timeout: RENDEZVOUS_TIMEOUT, max_payload_bytes: config.max_payload_bytes, ..ShmOptions::default() };
            if let Some(r) = args.shm_ring {
                options.ring_bytes = r;
            }
            options
        };
        let transport: Arc<dyn Transport> = match transport {
            BenchTransport::Quic => {
                let (t, addrs) = quic_rank_published(args, rank, world, &dir, config.max_payload_bytes).await?;
                t.connect(&addrs).await?;
                let t = Arc::new(t);
                quic = Some(Arc::clone(&t));
                t
            }
            BenchTransport::Shm => Arc::new(ShmTransport::connect(rank, world, shm_options(job)).await?),
            BenchTransport::Routed => {
                anyhow::ensure!(args.hosts > 1, "the routed transport needs --hosts of at least 2");
                let (network, addrs) = quic_rank_published(args, rank, world, &dir, config.max_payload_bytes).await?;
                let network = Arc::new(network);
                quic = Some(Arc::clone(&network));
                Arc::new(RoutedTransport::connect_over_quic(network, &addrs, &config.host_of, shm_options(job)).await?)
            }
            BenchTransport::Tls => {
                let (t, addrs) = tls_rank_published(args, rank, world, &dir, config.max_payload_bytes).await?;
                t.connect(&addrs).await?;
                let t = Arc::new(t);
                tls = Some(Arc::clone(&t));
                t
            }
            BenchTransport::RoutedTls => {
                anyhow::ensure!(args.hosts > 1, "the routed transport needs --hosts of at least 2");
                let (network, addrs) = tls_rank_published(args, rank, world, &dir, config.max_payload_bytes).await?;
                let network = Arc::new(network);
                tls = Some(Arc::clone(&network));
                Arc::new(RoutedTransport::connect_over_tls(network, &addrs, &config.host_of, shm_options(job)).await?)
            }
        };
        let comm = Endpoint::new(transport, config)?.world()?;
        for &op in &args.ops {
            for &bytes in &args.sizes {
                measure(&comm, args, op, bytes).await.with_context(|| format!("{} of {bytes} bytes", op_name(op)))?;
            }
        }
        comm.barrier().await?;
        // A rank leaving makes its peers' pending operations fail; give the slowest rank time to
        // return from the barrier before this one goes.
        tokio::time::sleep(LINGER).await;
        if let Some(quic) = quic {
            // Loss and congestion on this rank's links, for reading a slow run (stderr).
            for peer in quic.connected_peers() {
                for (stripe, stats) in quic.link_stats(peer).iter().enumerate() {
                    eprintln!(
                        "{}",
                        json!({"quic_link_stats": {"rank": rank, "peer": peer, "stripe": stripe, "sent_packets": stats.path.sent_packets,
                            "lost_packets": stats.path.lost_packets, "congestion_events": stats.path.congestion_events, "cwnd": stats.path.cwnd,
                            "rtt_us": stats.path.rtt.as_micros()}})
                    );
                }
            }
            // Frames still in flight to a peer are delivered before the connection closes.
            quic.close(Duration::from_secs(5)).await;
        }
        if let Some(tls) = tls {
            tls.close(Duration::from_secs(5)).await;
        }
        Ok(())
    })
}

/// A cluster CA and one certificate per rank, as DER files in `dir`, for rank processes to read.
pub(super) fn write_identities(dir: &Path, world: usize) -> anyhow::Result<()> {
    let ca = ClusterCa::generate("rtx bench")?;
    std::fs::write(dir.join("ca.der"), ca.certificate().as_ref())?;
    for rank in 0..world {
        let id = ca.issue(rank)?;
        let (cert, key) = id.to_der().context("rank identity in DER")?;
        std::fs::write(dir.join(format!("rank-{rank}.cert.der")), cert)?;
        std::fs::write(dir.join(format!("rank-{rank}.key.der")), key)?;
    }
    Ok(())
}

/// Rank `rank`'s identity from the files [`write_identities`] wrote in `dir`.
pub(super) fn read_identity(dir: &Path, rank: usize) -> anyhow::Result<NodeIdentity> {
    let read = |name: String| std::fs::read(dir.join(&name)).with_context(|| format!("read {name}"));
    Ok(NodeIdentity::from_der(rank, read("ca.der".into())?, read(format!("rank-{rank}.cert.der"))?, read(format!("rank-{rank}.key.der"))?))
}

/// This rank's QUIC transport bound on its host's address, with every rank's published address,
/// not yet connected (the routed transport links it to the ranks of other hosts).
async fn quic_rank_published(
    args: &CollectivesArgs,
    rank: usize,
    world: usize,
    dir: &Path,
    max_payload: usize,
) -> anyhow::Result<(QuicTransport, Vec<SocketAddr>)> {
    let options = QuicOptions { max_payload_bytes: max_payload, ..quic_options(args) };
    let ip = args.host_addrs.get(host_of_rank(rank, world, args.hosts)).copied().unwrap_or(std::net::IpAddr::from([127, 0, 0, 1]));
    bind_and_publish(dir, rank, world, options, SocketAddr::new(ip, 0)).await
}

/// Binds rank `rank` with its identity from `dir` (see [`write_identities`]), publishes its
/// address there and connects to every other rank's.
pub(super) async fn quic_rank_in(dir: &Path, rank: usize, world: usize, options: QuicOptions) -> anyhow::Result<QuicTransport> {
    let (transport, addrs) = bind_and_publish(dir, rank, world, options, SocketAddr::from(([127, 0, 0, 1], 0))).await?;
    transport.connect(&addrs).await?;
    Ok(transport)
}

/// This rank's TLS transport bound on its host's address (`--stripes` connections per pair), with
/// every rank's published address, not yet connected.
async fn tls_rank_published(args: &CollectivesArgs, rank: usize, world: usize, dir: &Path, max_payload: usize) -> anyhow::Result<(TlsTransport, Vec<SocketAddr>)> {
    let options = TlsOptions { connect_timeout: RENDEZVOUS_TIMEOUT, stripes: args.stripes, max_payload_bytes: max_payload, cipher: args.cipher.cipher(), ..TlsOptions::default() };
    let ip = args.host_addrs.get(host_of_rank(rank, world, args.hosts)).copied().unwrap_or(std::net::IpAddr::from([127, 0, 0, 1]));
    let transport = TlsTransport::bind(&read_identity(dir, rank)?, world, SocketAddr::new(ip, 0), options)?;
    let addrs = publish_and_read_addrs(dir, rank, world, transport.local_addr()).await?;
    Ok((transport, addrs))
}

/// Binds rank `rank` on `listen` with its identity from `dir`, publishes its address there and
/// reads every rank's.
async fn bind_and_publish(dir: &Path, rank: usize, world: usize, options: QuicOptions, listen: SocketAddr) -> anyhow::Result<(QuicTransport, Vec<SocketAddr>)> {
    let identity = read_identity(dir, rank)?;
    let transport = QuicTransport::bind(&identity, world, listen, options)?;
    let addrs = publish_and_read_addrs(dir, rank, world, transport.local_addr()?).await?;
    Ok((transport, addrs))
}

/// Publishes rank `rank`'s address in `dir` and waits for every rank's.
async fn publish_and_read_addrs(dir: &Path, rank: usize, world: usize, addr: SocketAddr) -> anyhow::Result<Vec<SocketAddr>> {
    let staging = dir.join(format!("addr-{rank}.staging"));
    std::fs::write(&staging, addr.to_string())?;
    std::fs::rename(&staging, dir.join(format!("addr-{rank}")))?;
    let deadline = Instant::now() + RENDEZVOUS_TIMEOUT;
    let mut addrs = Vec::with_capacity(world);
    for peer in 0..world {
        let path = dir.join(format!("addr-{peer}"));
        let text = loop {
            if let Ok(text) = std::fs::read_to_string(&path) {
                break text;
            }
            anyhow::ensure!(Instant::now() < deadline, "rank {peer} never published its address");
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        addrs.push(text.trim().parse::<SocketAddr>()?);
    }
    Ok(addrs)
}

/// Times `op` on `bytes` of f32 on every rank; rank 0 prints one JSON line with the samples.
async fn measure(comm: &Communicator, args: &CollectivesArgs, op: CollectiveOp, bytes: usize) -> anyhow::Result<()> {
    let (rank, n) = (comm.rank(), comm.size());
    let len = bytes / 4;
    let own = segment_range(len, n, rank);
    let mut full = vec![(rank + 1) as f32; len];
    let mut part = vec![(rank + 1) as f32; own.len()];
    // One checked run: every element of the result is known.
    let sum = (n * (n + 1) / 2) as f32;
    let expected = match op {
        CollectiveOp::AllReduce => {
            comm.all_reduce(&mut full, ReduceOp::Sum).await?;
            full.iter().all(|&x| x == sum)
        }
        CollectiveOp::ReduceScatter => {
            comm.reduce_scatter(&full, &mut part, ReduceOp::Sum).await?;
            part.iter().all(|&x| x == sum)
        }
        CollectiveOp::AllGather => {
            comm.all_gather(&part, &mut full).await?;
            (0..n).all(|r| full[segment_range(len, n, r)].iter().all(|&x| x == (r + 1) as f32))
        }
    };
    anyhow::ensure!(expected, "rank {rank}: wrong {} result", op_name(op));
    // Operations per sample from a timed warm-up run, decided by rank 0 for everyone.
    comm.barrier().await?;
    let start = Instant::now();
    run_op(comm, op, &mut full, &mut part).await?;
    let once = start.elapsed().as_secs_f64();
    let mut iters = [((args.sample_ms as f64 * 1e-3 / once.max(1e-7)) as u32).clamp(1, 20_000)];
    comm.broadcast(&mut iters, 0).await?;
    let mut samples = Vec::with_capacity(args.repeats);
    for _ in 0..args.repeats {
        comm.barrier().await?;
        let start = Instant::now();
        for _ in 0..iters[0] {
            run_op(comm, op, &mut full, &mut part).await?;
        }
        samples.push(start.elapsed().as_secs_f64() * 1e6 / f64::from(iters[0]));
    }
    if rank == 0 {
        let samples: Vec<f64> = samples.into_iter().map(round3).collect();
        let (channels, algorithm) = match op {
            CollectiveOp::AllReduce => (comm.all_reduce_channels(bytes), format!("{:?}", comm.all_reduce_algorithm(bytes)).to_lowercase()),
            _ => (1, "ring".to_string()),
        };
        emit(json!({"op": op_name(op), "bytes": bytes, "iters": iters[0], "samples_us": samples, "channels": channels, "algorithm": algorithm}));
        std::io::stdout().flush()?;
    }
    Ok(())
}

async fn run_op(comm: &Communicator, op: CollectiveOp, full: &mut [f32], part: &mut [f32]) -> rtx_collectives::Result<()> {
    match op {
        CollectiveOp::AllReduce => comm.all_reduce(full, ReduceOp::Sum).await,
        CollectiveOp::ReduceScatter => comm.reduce_scatter(full, part, ReduceOp::Sum).await,
        CollectiveOp::AllGather => comm.all_gather(part, full).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: sizes parse with binary suffixes and reject junk.
    #[test]
    fn parses_sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size("256M"), Ok(256 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert!(parse_size("12Q").is_err());
        assert_eq!(human(256 << 20), "256M");
    }

    // Goal: bus bandwidth factors match nccl-tests.
    #[test]
    fn bus_factors() {
        assert_eq!(bus_factor(CollectiveOp::AllReduce, 2), 1.0);
        assert_eq!(bus_factor(CollectiveOp::AllReduce, 4), 1.5);
        assert_eq!(bus_factor(CollectiveOp::AllGather, 4), 0.75);
    }
}
