//! Collectives between real processes: 2, 3 and 4 ranks, each its own OS process, over QUIC
//! (mutual TLS on 127.0.0.1) and over shared memory, compared with a straightforward reference.
//!
//! Method: the test re-executes its own binary once per rank to run `rank_process` (which does
//! nothing unless `RTX_PROC_RANK` is set). The parent issues the QUIC certificates into a temporary
//! directory where ranks also publish their bound addresses. Every rank runs the same script of
//! collectives (every one: all_reduce, reduce_scatter and all_gather with their in-place forms,
//! broadcast, reduce, barrier, all_to_all, send/recv, split) on exact-valued inputs (multiples of
//! 1/8, so any summation order gives the same bits) with 2 KiB frames, so each operation takes many
//! frames. Shared memory runs with a 64 KiB ring (every frame read in place, with pad records where
//! a slot would wrap) and with a 16 KiB ring (small frames read in place, 2 KiB frames streamed
//! through and copied out). The 4-rank shared-memory world also declares two fake hosts of two
//! ranks each (`CommConfig::host_of`), so its all-reduces are hierarchical. Each rank leaves as
//! soon as its script returns (no closing barrier): peers still reading its last frames must not
//! see that as a failure. A rank exits 0 only if every result matched; the parent checks every exit
//! status.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use half::bf16;
use rtx_collectives::{ClusterCa, CommConfig, Communicator, Endpoint, NodeIdentity, QuicOptions, QuicTransport, ReduceOp, ShmOptions, ShmTransport, Transport};

const RANK_ENV: &str = "RTX_PROC_RANK";
const WORLD_ENV: &str = "RTX_PROC_WORLD";
const TRANSPORT_ENV: &str = "RTX_PROC_TRANSPORT";
const DIR_ENV: &str = "RTX_PROC_DIR";
const RING_ENV: &str = "RTX_PROC_RING";
const HOSTS_ENV: &str = "RTX_PROC_HOSTS";
const DEADLINE: Duration = Duration::from_secs(60);

/// Kills rank processes that are still running when the parent gives up.
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

fn scratch_dir(tag: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    let dir = std::env::temp_dir().join(format!("rtx-proc-{tag}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `world` rank processes over `transport` (shared-memory rings of `ring_bytes`; `hosts`: the
/// host of each rank, or empty) and asserts that every one succeeded.
fn run_world(transport: &str, world: usize, ring_bytes: usize, hosts: &[u32]) {
    let seed = seed();
    let dir = scratch_dir(&format!("{transport}{world}"));
    if transport == "quic" {
        let ca = ClusterCa::generate("rtx process test").unwrap();
        std::fs::write(dir.join("ca.der"), ca.certificate().as_ref()).unwrap();
        for rank in 0..world {
            let (cert, key) = ca.issue(rank).unwrap().to_der().unwrap();
            std::fs::write(dir.join(format!("cert-{rank}")), cert).unwrap();
            std::fs::write(dir.join(format!("key-{rank}")), key).unwrap();
        }
    }
    let exe = std::env::current_exe().unwrap();
    let started = Instant::now();
    let mut ranks = Ranks(Vec::new());
    for rank in 0..world {
        let child = Command::new(&exe)
            .args(["--exact", "rank_process", "--nocapture", "--test-threads=1"])
            .env(RANK_ENV, rank.to_string())
            .env(WORLD_ENV, world.to_string())
            .env(TRANSPORT_ENV, transport)
            .env(DIR_ENV, &dir)
            .env(RING_ENV, ring_bytes.to_string())
            .env(HOSTS_ENV, hosts.iter().map(u32::to_string).collect::<Vec<_>>().join(","))
            .env("RTX_TEST_SEED", seed.to_string())
            .spawn()
            .unwrap();
        ranks.0.push(child);
    }
    let mut failed = Vec::new();
    for (rank, child) in ranks.0.iter_mut().enumerate() {
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                if !status.success() {
                    failed.push(format!("rank {rank}: {status}"));
                }
                break;
            }
            assert!(started.elapsed() < DEADLINE, "{transport} with {world} ranks did not finish within {DEADLINE:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failed.is_empty(), "{transport} with {world} ranks: {failed:?} (their stderr is above)");
    eprintln!("{transport} with {world} processes: ok in {:?}", started.elapsed());
}

// Goal: 2, 3 and 4 processes over shared memory get the reference results for every collective,
// with frames read in place (and pad records), and frames copied out and wrapped around the ring;
// 4 processes on two fake hosts also run the hierarchical all-reduce.
#[test]
fn collectives_between_processes_over_shm() {
    run_world("shm", 2, 64 << 10, &[]);
    run_world("shm", 3, 16 << 10, &[]);
    run_world("shm", 4, 64 << 10, &[0, 0, 1, 1]);
}

// Goal: 2, 3 and 4 processes over QUIC get the reference results for every collective (3 also
// takes the non-power-of-two path of recursive doubling; 4 the flat ring with four ranks).
#[test]
fn collectives_between_processes_over_quic() {
    run_world("quic", 2, 0, &[]);
    run_world("quic", 3, 0, &[]);
    run_world("quic", 4, 0, &[]);
}

// Helper, not a test of its own: one rank of `run_world`, in a child process. Without the
// parent's environment it returns at once.
#[test]
fn rank_process() {
    let Ok(rank) = std::env::var(RANK_ENV).map(|r| r.parse::<usize>().unwrap()) else {
        return;
    };
    let world: usize = std::env::var(WORLD_ENV).unwrap().parse().unwrap();
    let transport = std::env::var(TRANSPORT_ENV).unwrap();
    let dir = PathBuf::from(std::env::var(DIR_ENV).unwrap());
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let name = transport.clone();
    let mismatches = rt.block_on(async move {
        // Small frames: a 30 000-element f32 buffer takes dozens of frames per step.
        let host_of: Vec<u32> = std::env::var(HOSTS_ENV).unwrap().split(',').filter(|h| !h.is_empty()).map(|h| h.parse().unwrap()).collect();
        let config = CommConfig { op_timeout: Duration::from_secs(30), chunk_bytes: Some(2048), small_message_bytes: 1024, host_of, ..CommConfig::default() };
        let (t, quic): (Arc<dyn Transport>, Option<Arc<QuicTransport>>) = if transport == "quic" {
            let q = Arc::new(quic_rank(rank, world, &dir).await);
            (Arc::clone(&q) as Arc<dyn Transport>, Some(q))
        } else {
            let job = dir.file_name().unwrap().to_string_lossy().into_owned();
            let ring_bytes = std::env::var(RING_ENV).unwrap().parse().unwrap();
            let options = ShmOptions { job, ring_bytes, connect_timeout: Duration::from_secs(30), ..ShmOptions::default() };
            (Arc::new(ShmTransport::connect(rank, world, options).await.unwrap()), None)
        };
        let comm = Endpoint::new(t, config).unwrap().world().unwrap();
        let mismatches = script(&comm, seed()).await;
        // Leave at once: a slower peer may still be reading this rank's last frames.
        if let Some(q) = quic {
            q.close(Duration::from_secs(5)).await;
        }
        mismatches
    });
    assert!(mismatches.is_empty(), "rank {rank} of {world} over {name}: {mismatches:?}");
}

async fn quic_rank(rank: usize, world: usize, dir: &Path) -> QuicTransport {
    let read = |name: String| std::fs::read(dir.join(name)).unwrap();
    let identity = NodeIdentity::from_der(rank, read("ca.der".into()), read(format!("cert-{rank}")), read(format!("key-{rank}")));
    let options = QuicOptions { connect_timeout: Duration::from_secs(30), ..QuicOptions::default() };
    let t = QuicTransport::bind(&identity, world, "127.0.0.1:0".parse().unwrap(), options).unwrap();
    let staging = dir.join(format!("addr-{rank}.staging"));
    std::fs::write(&staging, t.local_addr().unwrap().to_string()).unwrap();
    std::fs::rename(&staging, dir.join(format!("addr-{rank}"))).unwrap();
    let mut addrs = Vec::new();
    for peer in 0..world {
        let path = dir.join(format!("addr-{peer}"));
        let deadline = Instant::now() + Duration::from_secs(30);
        let text = loop {
            if let Ok(text) = std::fs::read_to_string(&path) {
                break text;
            }
            assert!(Instant::now() < deadline, "rank {peer} never published its address");
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        addrs.push(text.parse().unwrap());
    }
    t.connect(&addrs).await.unwrap();
    t
}

/// The same collectives on every rank; returns what differed from the reference.
async fn script(c: &Communicator, seed: u64) -> Vec<String> {
    let (rank, n) = (c.rank(), c.size());
    let mut bad = Vec::new();
    let mut check = |what: String, ok: bool| {
        if !ok {
            bad.push(what);
        }
    };
    // all_reduce: small (recursive doubling), large (fused ring), odd lengths, every op, bf16.
    for (case, len) in [(1u64, 7usize), (2, 250), (3, 30_001), (4, 65_536)] {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
            let inputs = exact_inputs::<f32>(seed, case * 10 + op as u64, n, len);
            let mut buf = inputs[rank].clone();
            c.all_reduce(&mut buf, op).await.unwrap();
            check(format!("all_reduce f32 len {len} {op:?}"), bits(&buf) == bits(&reference(op, &inputs)));
        }
    }
    let inputs = exact_inputs::<bf16>(seed, 50, n, 20_000);
    let mut buf = inputs[rank].clone();
    c.all_reduce(&mut buf, ReduceOp::Sum).await.unwrap();
    check("all_reduce bf16".into(), bits(&buf) == bits(&reference(ReduceOp::Sum, &inputs)));
    let inputs = exact_inputs::<f64>(seed, 51, n, 9_999);
    let mut buf = inputs[rank].clone();
    c.all_reduce(&mut buf, ReduceOp::Min).await.unwrap();
    check("all_reduce f64".into(), bits(&buf) == bits(&reference(ReduceOp::Min, &inputs)));

    // reduce_scatter and all_gather, lengths not divisible by the world.
    for (case, len) in [(60u64, 10usize), (61, 25_003)] {
        let inputs = exact_inputs::<f32>(seed, case, n, len);
        let own = c.segment(len, rank);
        let mut out = vec![0.0f32; own.len()];
        c.reduce_scatter(&inputs[rank], &mut out, ReduceOp::Sum).await.unwrap();
        check(format!("reduce_scatter len {len}"), bits(&out) == bits(&reference(ReduceOp::Sum, &inputs)[own.clone()]));
        let mut in_place = inputs[rank].clone();
        c.reduce_scatter_in_place(&mut in_place, ReduceOp::Sum).await.unwrap();
        check(format!("reduce_scatter_in_place len {len}"), bits(&in_place[own.clone()]) == bits(&out));
        let whole = &inputs[0];
        let mut gathered = vec![0.0f32; len];
        c.all_gather(&whole[own.clone()], &mut gathered).await.unwrap();
        check(format!("all_gather len {len}"), bits(&gathered) == bits(whole));
        let mut gathered = vec![0.0f32; len];
        gathered[own.clone()].copy_from_slice(&whole[own]);
        c.all_gather_in_place(&mut gathered).await.unwrap();
        check(format!("all_gather_in_place len {len}"), bits(&gathered) == bits(whole));
    }

    // broadcast (tree and chain), reduce to a root, barrier.
    for (case, len) in [(70u64, 100usize), (71, 12_345)] {
        let root = (case as usize) % n;
        let data = exact_input::<f64>(seed, case, root, len);
        let mut buf = if rank == root { data.clone() } else { vec![0.0; len] };
        c.broadcast(&mut buf, root).await.unwrap();
        check(format!("broadcast len {len}"), bits(&buf) == bits(&data));
    }
    let inputs = exact_inputs::<f32>(seed, 80, n, 9_000);
    let mut buf = inputs[rank].clone();
    c.reduce(&mut buf, n - 1, ReduceOp::Sum).await.unwrap();
    let want = if rank == n - 1 { reference(ReduceOp::Sum, &inputs) } else { inputs[rank].clone() };
    check("reduce".into(), bits(&buf) == bits(&want));
    c.barrier().await.unwrap();

    // all_to_all and point-to-point around the ring.
    let block = 700;
    let input: Vec<f32> = (0..n * block).map(|i| (rank * 1_000_000 + i) as f32).collect();
    let mut output = vec![0.0f32; n * block];
    c.all_to_all(&input, &mut output).await.unwrap();
    let want: Vec<f32> = (0..n).flat_map(|src| (0..block).map(move |i| (src * 1_000_000 + rank * block + i) as f32)).collect();
    check("all_to_all".into(), output == want);
    let next = (rank + 1) % n;
    let prev = (rank + n - 1) % n;
    let msg: Vec<u32> = (0..6_000).map(|i| (rank as u32) << 20 | i).collect();
    let mut got = vec![0u32; 6_000];
    let (sent, received) = tokio::join!(c.send(&msg, next), c.recv(&mut got, prev));
    sent.unwrap();
    received.unwrap();
    check("send/recv".into(), got.iter().enumerate().all(|(i, &x)| x == (prev as u32) << 20 | i as u32));

    // split into even and odd ranks (reversed by key), and an all-reduce in each half.
    let half = c.split(Some((rank % 2) as u32), (n - rank) as u32).await.unwrap().unwrap();
    let members: Vec<usize> = (0..n).rev().filter(|r| r % 2 == rank % 2).collect();
    check("split members".into(), half.members() == members);
    let inputs = exact_inputs::<f32>(seed, 90 + (rank % 2) as u64, members.len(), 5_000);
    let mut buf = inputs[half.rank()].clone();
    half.all_reduce(&mut buf, ReduceOp::Sum).await.unwrap();
    check("split all_reduce".into(), bits(&buf) == bits(&reference(ReduceOp::Sum, &inputs)));
    bad
}
