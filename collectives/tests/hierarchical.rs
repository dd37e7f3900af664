//! Hierarchical all-reduce: with a host map (`CommConfig::host_of`) that puts several ranks of a
//! group on one host and the group on more than one host, `all_reduce` reduces within each host,
//! all-reduces among host leaders and broadcasts within each host (large buffers on hosts of equal
//! size: reduce-scatter within hosts, a ring per local index across hosts, all-gather within
//! hosts). Checked against the reference
//! for world sizes 4-8 split into 2-3 fake hosts (contiguous, interleaved, uneven, with a lone
//! rank), every dtype and reduce op, small and large paths; bit-identical on every rank and across
//! timings for non-exact data; chosen exactly when the host map says so; and frames cross hosts
//! only between the ranks each scheme pairs.
//!
//! Method: in-process worlds whose transports count the frames each rank sends to each other rank.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use half::bf16;
use rtx_collectives::{
    AllReduceAlgorithm, BoxFuture, CommConfig, Communicator, Endpoint, Error, InProcessNetwork, InProcessTransport, PooledBuf, ReduceOp, Transport,
    TransportEvent,
};

const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];

/// An in-process transport that counts the frames it sends, per destination.
#[derive(Debug)]
struct Counting {
    inner: InProcessTransport,
    sent: Arc<Vec<AtomicU64>>,
}

impl Transport for Counting {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn send(&self, peer: usize, frame: PooledBuf) -> BoxFuture<'_, rtx_collectives::Result<()>> {
        if let Some(counter) = self.sent.get(peer) {
            counter.fetch_add(1, Ordering::Relaxed);
        }
        self.inner.send(peer, frame)
    }
    fn recv(&self) -> BoxFuture<'_, Option<TransportEvent>> {
        self.inner.recv()
    }
    fn checks_integrity(&self) -> bool {
        true
    }
}

/// A world on `host_of` with counting transports: its communicators and, per rank, the frames it
/// sent to each rank.
fn counted_world(host_of: &[u32], config: CommConfig) -> (Vec<Communicator>, Vec<Arc<Vec<AtomicU64>>>) {
    let n = host_of.len();
    let config = CommConfig { host_of: host_of.to_vec(), ..config };
    let (_net, transports) = InProcessNetwork::new(n);
    let mut comms = Vec::new();
    let mut counters = Vec::new();
    for t in transports {
        let sent = Arc::new((0..n).map(|_| AtomicU64::new(0)).collect::<Vec<_>>());
        counters.push(Arc::clone(&sent));
        let t: Arc<dyn Transport> = Arc::new(Counting { inner: t, sent });
        comms.push(Endpoint::new(t, config.clone()).unwrap().world().unwrap());
    }
    (comms, counters)
}

/// Host maps for world sizes 4-8: contiguous blocks, interleaved, uneven with a lone rank.
fn host_maps() -> Vec<Vec<u32>> {
    vec![
        vec![0, 0, 1, 1],
        vec![5, 9, 5, 9],
        vec![0, 0, 0, 1, 1],
        vec![2, 1, 0, 0, 1, 2],
        vec![0, 0, 0, 0, 0, 1, 1],
        vec![0, 1, 2, 0, 1, 2, 0, 1],
        vec![7, 7, 7, 7, 7, 7, 7, 3],
    ]
}

fn sizes(config: &str) -> &'static [usize] {
    match config {
        "ring" | "doubling" => &[0, 1, 2, 7, 13, 97, 1031],
        _ => &[0, 1, 97, 70_001],
    }
}

async fn check_all<T: TestElem>(c: Communicator, seed: u64, config: &'static str) -> Result<(), String> {
    let (n, r) = (c.size(), c.rank());
    for &len in sizes(config) {
        for (oi, &op) in OPS.iter().enumerate() {
            let case = (len as u64) * 16 + oi as u64;
            let inputs = exact_inputs::<T>(seed, case, n, len);
            let mut buf = inputs[r].clone();
            let what = format!("hierarchical all_reduce {op:?} {} n={n} len={len} rank={r} config={config}", T::DTYPE);
            c.all_reduce(&mut buf, op).await.map_err(|e| format!("{what}: {e}"))?;
            if bits(&buf) != bits(&reference(op, &inputs)) {
                return Err(format!("{what}: differs from the reference"));
            }
        }
    }
    Ok(())
}

// Goal: the hierarchical all-reduce equals the reference bit for bit on every rank, for every
// host map, dtype, op, size (0, 1, primes, over the small-message threshold) and algorithm path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hierarchical_all_reduce_matches_reference() {
    let seed = seed();
    for host_of in host_maps() {
        for (name, config) in configs() {
            let (comms, _) = counted_world(&host_of, config);
            assert_eq!(comms[0].all_reduce_algorithm(4096), AllReduceAlgorithm::Hierarchical);
            for result in run_ranks(&comms, move |c| async move {
                check_all::<f32>(c.clone(), seed, name).await?;
                check_all::<f64>(c.clone(), seed, name).await?;
                check_all::<bf16>(c, seed, name).await
            })
            .await
            {
                result.unwrap_or_else(|e| panic!("hosts {host_of:?}: {e}"));
            }
        }
    }
}

// Goal: for non-exact data, every rank gets the same bits, and so does every run whatever the
// timing; the result is within rounding of the exact sum.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hierarchical_results_are_bit_identical_and_timing_independent() {
    let seed = seed();
    let host_of = vec![0, 1, 2, 0, 1, 2, 0];
    let n = host_of.len();
    let len = 3001;
    let inputs: Vec<Vec<f32>> = (0..n)
        .map(|q| {
            let mut g = rng(seed ^ 0x41E7, q as u64);
            (0..len).map(|_| rand::Rng::random_range(&mut g, -1.0f32..1.0) * 10f32.powi(rand::Rng::random_range(&mut g, -3..4))).collect()
        })
        .collect();
    for (name, config) in configs() {
        let mut runs = Vec::new();
        for run in 0..3u64 {
            let (comms, _) = counted_world(&host_of, config.clone());
            let inputs = inputs.clone();
            let out = run_ranks(&comms, move |c| {
                let mut buf = inputs[c.rank()].clone();
                async move {
                    let mut g = rng(seed ^ run, 200 + c.rank() as u64);
                    for _ in 0..rand::Rng::random_range(&mut g, 0..50) {
                        tokio::task::yield_now().await;
                    }
                    c.all_reduce(&mut buf, ReduceOp::Sum).await.unwrap();
                    bits(&buf)
                }
            })
            .await;
            assert!(out.iter().all(|o| o == &out[0]), "{name}: ranks differ");
            runs.push(out[0].clone());
        }
        assert!(runs.iter().all(|r| r == &runs[0]), "{name}: runs differ");
        let got: &[f32] = bytemuck::cast_slice(&runs[0]);
        for i in 0..len {
            let exact: f64 = inputs.iter().map(|v| f64::from(v[i])).sum();
            let scale: f64 = inputs.iter().map(|v| f64::from(v[i]).abs()).sum();
            assert!((f64::from(got[i]) - exact).abs() <= scale * 1e-6 + 1e-30, "{name}: element {i}");
        }
    }
}

// Goal: frames cross hosts only where the algorithm says: a small all_reduce only between host
// leaders (every other rank talks to its own host only); a large one on hosts of equal size only
// between ranks of the same local index (one ring per index across hosts), every rank carrying
// its share; a large one on hosts of unequal size only between leaders again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_host_frames_follow_the_algorithm() {
    // Host 0 = ranks {0, 2, 4}, host 1 = {1, 3, 5}: local indices 0, 1, 2 pair (0,1), (2,3), (4,5).
    let equal = vec![0, 1, 0, 1, 0, 1];
    // Host 0 = {0, 1, 2}, host 1 = {3, 4}: unequal, leaders 0 and 3.
    let unequal = vec![0, 0, 0, 1, 1];
    let leaders = vec![(0usize, 1usize)];
    let columns = vec![(0, 1), (2, 3), (4, 5)];
    for (host_of, len) in [(equal.clone(), 33usize), (equal.clone(), 100_000), (unequal.clone(), 100_000)] {
        let n = host_of.len() as f32;
        for (name, config) in configs() {
            let small = len * 4 <= config.small_message_bytes;
            let allowed = match (host_of == equal, small) {
                (true, true) => leaders.clone(),
                (true, false) => columns.clone(),
                (false, _) => vec![(0, 3)],
            };
            let (comms, counters) = counted_world(&host_of, config);
            run_ranks(&comms, |c| async move {
                let mut buf = vec![1.0f32; len];
                c.all_reduce(&mut buf, ReduceOp::Sum).await.unwrap();
                assert!(buf.iter().all(|&x| x == n));
            })
            .await;
            let pair_allowed = |a: usize, b: usize| allowed.contains(&(a.min(b), a.max(b)));
            for (from, sent) in counters.iter().enumerate() {
                let mut crossed = 0;
                for (to, count) in sent.iter().enumerate() {
                    let count = count.load(Ordering::Relaxed);
                    if host_of[from] != host_of[to] {
                        crossed += count;
                        if !pair_allowed(from, to) {
                            assert_eq!(count, 0, "{name}, {len} elements: rank {from} sent {count} frames to rank {to} on another host");
                        }
                    }
                }
                let crosses = allowed.iter().any(|&(a, b)| a == from || b == from);
                assert_eq!(crossed > 0, crosses, "{name}, {len} elements, hosts {host_of:?}: rank {from} crossed hosts with {crossed} frames");
            }
        }
    }
}

// Goal: the algorithm is hierarchical exactly when the host map says so: not without a map, not
// when every rank has a host of its own, not when all share one, not in a sub-group whose members
// are on distinct hosts; and a map of the wrong length is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hierarchy_only_when_the_host_map_says_so() {
    let big = 1 << 20;
    let flat = |host_of: Vec<u32>| {
        let (comms, _) = counted_world(&host_of, CommConfig::default());
        (comms[0].all_reduce_algorithm(16), comms[0].all_reduce_algorithm(big))
    };
    assert_eq!(flat(vec![3]), (AllReduceAlgorithm::Local, AllReduceAlgorithm::Local));
    let (_net, comms) = world(4, CommConfig::default());
    assert_eq!((comms[0].all_reduce_algorithm(16), comms[0].all_reduce_algorithm(big)), (AllReduceAlgorithm::Doubling, AllReduceAlgorithm::Ring));
    assert_eq!(flat(vec![0, 1, 2, 3]), (AllReduceAlgorithm::Doubling, AllReduceAlgorithm::Ring));
    assert_eq!(flat(vec![4, 4, 4, 4]), (AllReduceAlgorithm::Doubling, AllReduceAlgorithm::Ring));
    assert_eq!(flat(vec![0, 0, 1, 1]), (AllReduceAlgorithm::Hierarchical, AllReduceAlgorithm::Hierarchical));

    // Sub-groups see the map through their members' global ranks.
    let (comms, _) = counted_world(&[0, 0, 1, 1], CommConfig::default());
    let out = run_ranks(&comms, |c| async move {
        // Color by rank parity: {0, 2} and {1, 3}, each one rank per host.
        let across = c.split(Some((c.rank() % 2) as u32), 0).await.unwrap().unwrap();
        // Color by host: {0, 1} and {2, 3}, both on one host.
        let within = c.split(Some((c.rank() / 2) as u32), 0).await.unwrap().unwrap();
        let mut buf = vec![c.rank() as f64; 1000];
        across.all_reduce(&mut buf, ReduceOp::Sum).await.unwrap();
        (across.all_reduce_algorithm(big), within.all_reduce_algorithm(big), buf[0])
    })
    .await;
    for (r, (across, within, sum)) in out.into_iter().enumerate() {
        assert_eq!((across, within), (AllReduceAlgorithm::Ring, AllReduceAlgorithm::Ring));
        assert_eq!(sum, if r % 2 == 0 { 2.0 } else { 4.0 });
    }

    let (_net, transports) = InProcessNetwork::new(3);
    let t: Arc<dyn Transport> = Arc::new(transports.into_iter().next().unwrap());
    let config = CommConfig { host_of: vec![0, 0], op_timeout: Duration::from_secs(1), ..CommConfig::default() };
    assert!(matches!(Endpoint::new(t, config), Err(Error::InvalidConfig { .. })));
}
