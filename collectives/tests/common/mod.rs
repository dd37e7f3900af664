//! Shared helpers for the integration tests: seeded RNGs, in-process worlds, running one task per
//! rank under a timeout, and exact-valued test data with a straightforward reference reduction.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used)] // shared by several test binaries

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rtx_collectives::{CommConfig, Communicator, Element, Endpoint, InProcessNetwork, ReduceOp, Transport};

/// Wall-clock bound for a whole test body.
pub const TEST_TIMEOUT: Duration = Duration::from_secs(60);

/// The run's base seed: `RTX_TEST_SEED` if set, else a fixed default; printed so a failure can be
/// replayed.
pub fn seed() -> u64 {
    let seed = std::env::var("RTX_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5EED_2026);
    eprintln!("RTX_TEST_SEED={seed}");
    seed
}

/// A ChaCha RNG for `(seed, stream)`.
pub fn rng(seed: u64, stream: u64) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(stream);
    rng
}

/// `n` in-process ranks with endpoints on `config`, and their world communicators.
pub fn world(n: usize, config: CommConfig) -> (InProcessNetwork, Vec<Communicator>) {
    let (net, transports) = InProcessNetwork::new(n);
    let comms = transports
        .into_iter()
        .map(|t| {
            let t: Arc<dyn Transport> = Arc::new(t);
            Endpoint::new(t, config.clone()).unwrap().world().unwrap()
        })
        .collect();
    (net, comms)
}

/// Test configs that force each algorithm family, with tiny frames so pipelining is exercised
/// (indexed by position in some tests: append new ones at the end).
pub fn configs() -> Vec<(&'static str, CommConfig)> {
    let base = CommConfig { op_timeout: Duration::from_secs(20), ..CommConfig::default() };
    vec![
        ("ring", CommConfig { small_message_bytes: 0, chunk_bytes: Some(24), ..base.clone() }),
        ("doubling", CommConfig { small_message_bytes: usize::MAX, chunk_bytes: Some(40), ..base.clone() }),
        ("default", base.clone()),
        // A ring sending far ahead of its receives (as QUIC asks), and one frame at a time.
        ("ring-deep-window", CommConfig { small_message_bytes: 0, chunk_bytes: Some(24), ring_window: Some(16), ..base.clone() }),
        ("ring-window-1", CommConfig { small_message_bytes: 0, chunk_bytes: Some(32), ring_window: Some(1), ..base }),
    ]
}

/// Runs `body(comm)` for every rank as its own task and returns the results in rank order.
pub async fn run_ranks<R, F, Fut>(comms: &[Communicator], body: F) -> Vec<R>
where
    R: Send + 'static,
    F: Fn(Communicator) -> Fut,
    Fut: Future<Output = R> + Send + 'static,
{
    let handles: Vec<_> = comms.iter().map(|c| tokio::spawn(body(c.clone()))).collect();
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        out.push(tokio::time::timeout(TEST_TIMEOUT, h).await.expect("rank timed out").expect("rank panicked"));
    }
    out
}

/// Element types under test, built from exact small values.
pub trait TestElem: Element<Acc: TestAcc> + PartialEq {
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
}

impl TestElem for f32 {
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
}
impl TestElem for f64 {
    fn from_f64(x: f64) -> Self {
        x
    }
    fn to_f64(self) -> f64 {
        self
    }
}
impl TestElem for bf16 {
    fn from_f64(x: f64) -> Self {
        bf16::from_f64(x)
    }
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
}

/// Accumulator-side helpers for the reference.
pub trait TestAcc: Copy {
    fn from_f64_exact(x: f64) -> Self;
    fn div(self, n: usize) -> Self;
}
impl TestAcc for f32 {
    fn from_f64_exact(x: f64) -> Self {
        x as f32
    }
    fn div(self, n: usize) -> Self {
        self / n as f32
    }
}
impl TestAcc for f64 {
    fn from_f64_exact(x: f64) -> Self {
        x
    }
    fn div(self, n: usize) -> Self {
        self / n as f64
    }
}

/// Rank `rank`'s input for case `case`: multiples of 1/8 in [-8, 8], exact in bf16, so sums over up
/// to 8 ranks are exact in f32 and the reference does not depend on summation order.
pub fn exact_input<T: TestElem>(seed: u64, case: u64, rank: usize, len: usize) -> Vec<T> {
    let mut rng = rng(seed ^ case.wrapping_mul(0x9E37_79B9_7F4A_7C15), rank as u64);
    (0..len).map(|_| T::from_f64(f64::from(rng.random_range(-64i32..=64)) / 8.0)).collect()
}

/// Every rank's input for case `case`.
pub fn exact_inputs<T: TestElem>(seed: u64, case: u64, n: usize, len: usize) -> Vec<Vec<T>> {
    (0..n).map(|r| exact_input(seed, case, r, len)).collect()
}

/// The straightforward reference: reduce element by element in f64 (exact for these inputs), divide
/// in the accumulator type for `Avg` as the library does, round once to `T`.
pub fn reference<T: TestElem>(op: ReduceOp, inputs: &[Vec<T>]) -> Vec<T> {
    let n = inputs.len();
    (0..inputs[0].len())
        .map(|i| {
            let mut acc = inputs[0][i].to_f64();
            for input in &inputs[1..] {
                let x = input[i].to_f64();
                acc = match op {
                    ReduceOp::Sum | ReduceOp::Avg => acc + x,
                    ReduceOp::Max => acc.max(x),
                    ReduceOp::Min => acc.min(x),
                };
            }
            let acc = <T::Acc as TestAcc>::from_f64_exact(acc);
            T::from_acc(if op == ReduceOp::Avg { acc.div(n) } else { acc })
        })
        .collect()
}

/// Bit patterns, so NaNs and signed zeros compare exactly.
pub fn bits<T: bytemuck::Pod>(v: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

/// Communicators of a network world (one per rank, each on its own transport, world group), the
/// way the QUIC and TLS tests build them.
pub fn network_comms<T: Transport>(transports: &[Arc<T>], config: &CommConfig) -> Vec<Communicator> {
    transports
        .iter()
        .map(|t| {
            let t: Arc<dyn Transport> = Arc::clone(t) as Arc<dyn Transport>;
            Endpoint::new(t, config.clone()).unwrap().world().unwrap()
        })
        .collect()
}

/// On a 3-rank network world: collectives give exact results on the large ring and small doubling
/// paths (f32 sum and max, f64 broadcast, bf16 all_reduce and reduce, which travel as f32 partial
/// sums); then rank 2 goes away and the survivors' next collective fails with PeerLost naming it.
pub async fn collectives_then_peer_loss(mut comms: Vec<Communicator>) {
    assert_eq!(comms.len(), 3);
    let out = run_ranks(&comms, |c| async move {
        let r = c.rank() as f32;
        let mut big: Vec<f32> = (0..(1 << 20)).map(|i| (i % 7) as f32 + r).collect();
        c.all_reduce(&mut big, ReduceOp::Sum).await.unwrap();
        let mut small = vec![r; 33];
        c.all_reduce(&mut small, ReduceOp::Max).await.unwrap();
        let mut b = if c.rank() == 1 { vec![7.5f64; 1000] } else { vec![0.0; 1000] };
        c.broadcast(&mut b, 1).await.unwrap();
        let mut half: Vec<bf16> = (0..(1 << 20)).map(|i| bf16::from_f32((i % 5) as f32 + r)).collect();
        c.all_reduce(&mut half, ReduceOp::Sum).await.unwrap();
        let mut reduced: Vec<bf16> = (0..(1 << 20)).map(|i| bf16::from_f32((i % 3) as f32 * r)).collect();
        c.reduce(&mut reduced, 0, ReduceOp::Sum).await.unwrap();
        (big, small, b, half, (c.rank() == 0).then_some(reduced))
    })
    .await;
    for (big, small, b, half, reduced) in out {
        assert!(big.iter().enumerate().all(|(i, &x)| x == 3.0 * (i % 7) as f32 + 3.0));
        assert_eq!(small, vec![2.0; 33]);
        assert_eq!(b, vec![7.5; 1000]);
        assert!(half.iter().enumerate().all(|(i, &x)| x.to_f32() == 3.0 * (i % 5) as f32 + 3.0));
        if let Some(reduced) = reduced {
            assert!(reduced.iter().enumerate().all(|(i, &x)| x.to_f32() == (i % 3) as f32 * 3.0));
        }
    }
    drop(comms.pop());
    let out = run_ranks(&comms, |c| async move {
        let mut buf = vec![1.0f32; 1000];
        c.all_reduce(&mut buf, ReduceOp::Sum).await
    })
    .await;
    for result in out {
        assert_eq!(result, Err(rtx_collectives::Error::PeerLost { rank: 2, op: rtx_collectives::OpKind::AllReduce }));
    }
}
