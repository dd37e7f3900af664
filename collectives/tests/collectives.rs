//! Every collective against a straightforward reference, for world sizes 1–8, each dtype and reduce
//! op, awkward sizes (0, 1, primes, non-divisible by the world size), with each algorithm forced.
//!
//! Method: inputs are seeded multiples of 1/8 (exact in bf16), so sums are exact whatever the
//! order, and the library's bits must equal the reference's bits on every rank. Each rank runs all
//! cases in sequence as one tokio task, which also exercises sequence numbering across many ops.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::*;
use half::bf16;
use rtx_collectives::{Accumulator, AllReduceAlgorithm, CommConfig, Communicator, ReduceOp, WireElement};

const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];

fn sizes(config: &str) -> &'static [usize] {
    match config {
        // Tiny frames: keep sizes moderate so the frame count stays small.
        "ring" | "doubling" | "direct" => &[0, 1, 2, 3, 5, 7, 13, 31, 64, 97, 257, 1031],
        // Real defaults: the largest size is over the small-message threshold in every dtype.
        _ => &[0, 1, 7, 97, 40_009],
    }
}

type Check = std::result::Result<(), String>;

fn mismatch<T: std::fmt::Debug>(what: &str, got: &[T], want: &[T]) -> String {
    let at = got.iter().zip(want).position(|(a, b)| format!("{a:?}") != format!("{b:?}")).unwrap_or(0);
    format!("{what}: first difference at {at}: got {:?}, want {:?} (len {})", got.get(at), want.get(at), want.len())
}

fn case_id(parts: &[usize]) -> u64 {
    parts.iter().fold(0u64, |acc, &p| acc.wrapping_mul(1_000_003).wrapping_add(p as u64 + 1))
}

async fn all_reduce_cases<T: TestElem>(c: &Communicator, seed: u64, config: &str) -> Check {
    let (n, r) = (c.size(), c.rank());
    for &len in sizes(config) {
        for (oi, &op) in OPS.iter().enumerate() {
            let inputs = exact_inputs::<T>(seed, case_id(&[1, len, oi]), n, len);
            let mut buf = inputs[r].clone();
            let what = format!("all_reduce {op:?} {} n={n} len={len} rank={r} config={config}", T::DTYPE);
            c.all_reduce(&mut buf, op).await.map_err(|e| format!("{what}: {e}"))?;
            let want = reference(op, &inputs);
            if bits(&buf) != bits(&want) {
                return Err(mismatch(&what, &buf, &want));
            }
        }
    }
    Ok(())
}

async fn reduce_scatter_cases<T: TestElem>(c: &Communicator, seed: u64, config: &str) -> Check {
    let (n, r) = (c.size(), c.rank());
    for &len in sizes(config) {
        for (oi, &op) in OPS.iter().enumerate() {
            let inputs = exact_inputs::<T>(seed, case_id(&[2, len, oi]), n, len);
            let seg = c.segment(len, r);
            let mut out = vec![T::from_f64(99.0); seg.len()];
            let what = format!("reduce_scatter {op:?} {} n={n} len={len} rank={r} config={config}", T::DTYPE);
            c.reduce_scatter(&inputs[r], &mut out, op).await.map_err(|e| format!("{what}: {e}"))?;
            let want = reference(op, &inputs)[seg.clone()].to_vec();
            if bits(&out) != bits(&want) {
                return Err(mismatch(&what, &out, &want));
            }
            // In place: the owned segment gets the same bits, the rest is left as it was.
            let mut buf = inputs[r].clone();
            c.reduce_scatter_in_place(&mut buf, op).await.map_err(|e| format!("{what} in place: {e}"))?;
            let mut want_buf = inputs[r].clone();
            want_buf[seg].copy_from_slice(&want);
            if bits(&buf) != bits(&want_buf) {
                return Err(mismatch(&format!("{what} in place"), &buf, &want_buf));
            }
        }
    }
    Ok(())
}

async fn reduce_cases<T: TestElem>(c: &Communicator, seed: u64, config: &str) -> Check {
    let (n, r) = (c.size(), c.rank());
    for &len in sizes(config) {
        for (oi, &op) in OPS.iter().enumerate() {
            let root = (len + oi) % n;
            let inputs = exact_inputs::<T>(seed, case_id(&[3, len, oi]), n, len);
            let mut buf = inputs[r].clone();
            let what = format!("reduce {op:?} root={root} {} n={n} len={len} rank={r} config={config}", T::DTYPE);
            c.reduce(&mut buf, root, op).await.map_err(|e| format!("{what}: {e}"))?;
            let want = if r == root { reference(op, &inputs) } else { inputs[r].clone() };
            if bits(&buf) != bits(&want) {
                return Err(mismatch(&what, &buf, &want));
            }
        }
    }
    Ok(())
}

async fn all_gather_cases<T: WireElement + TestElem>(c: &Communicator, seed: u64, config: &str) -> Check {
    let (n, r) = (c.size(), c.rank());
    for &len in sizes(config) {
        let full = exact_input::<T>(seed, case_id(&[4, len]), 0, len);
        let mut out = vec![T::from_f64(99.0); len];
        let what = format!("all_gather {} n={n} len={len} rank={r} config={config}", T::DTYPE);
        c.all_gather(&full[c.segment(len, r)], &mut out).await.map_err(|e| format!("{what}: {e}"))?;
        if bits(&out) != bits(&full) {
            return Err(mismatch(&what, &out, &full));
        }
        let mut buf = vec![T::from_f64(99.0); len];
        buf[c.segment(len, r)].copy_from_slice(&full[c.segment(len, r)]);
        c.all_gather_in_place(&mut buf).await.map_err(|e| format!("{what} in place: {e}"))?;
        if bits(&buf) != bits(&full) {
            return Err(mismatch(&format!("{what} in place"), &buf, &full));
        }
    }
    Ok(())
}

async fn broadcast_cases<T: TestElem>(c: &Communicator, seed: u64, config: &str) -> Check {
    let (n, r) = (c.size(), c.rank());
    for &len in sizes(config) {
        for root in [0, n - 1, len % n] {
            let inputs = exact_inputs::<T>(seed, case_id(&[5, len, root]), n, len);
            let mut buf = inputs[r].clone();
            let what = format!("broadcast root={root} {} n={n} len={len} rank={r} config={config}", T::DTYPE);
            c.broadcast(&mut buf, root).await.map_err(|e| format!("{what}: {e}"))?;
            if bits(&buf) != bits(&inputs[root]) {
                return Err(mismatch(&what, &buf, &inputs[root]));
            }
        }
    }
    Ok(())
}

async fn all_to_all_cases<T: TestElem>(c: &Communicator, seed: u64, config: &str) -> Check {
    let (n, r) = (c.size(), c.rank());
    for &block in &[0usize, 1, 3, 17, 250] {
        let len = block * n;
        let inputs = exact_inputs::<T>(seed, case_id(&[6, block]), n, len);
        let mut out = vec![T::from_f64(99.0); len];
        let what = format!("all_to_all {} n={n} block={block} rank={r} config={config}", T::DTYPE);
        c.all_to_all(&inputs[r], &mut out).await.map_err(|e| format!("{what}: {e}"))?;
        let want: Vec<T> = (0..n).flat_map(|j| inputs[j][r * block..(r + 1) * block].to_vec()).collect();
        if bits(&out) != bits(&want) {
            return Err(mismatch(&what, &out, &want));
        }
    }
    Ok(())
}

async fn send_recv_cases<T: TestElem>(c: &Communicator, seed: u64, config: &str) -> Check {
    let (n, r) = (c.size(), c.rank());
    if n == 1 {
        return Ok(());
    }
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    for &len in sizes(config) {
        // Each rank sends its "forward" message to next, then its "backward" message to prev.
        let fwd = |rank: usize| exact_input::<T>(seed, case_id(&[7, len]), rank, len);
        let bwd = |rank: usize| exact_input::<T>(seed, case_id(&[8, len]), rank, len);
        let what = format!("send/recv {} n={n} len={len} rank={r} config={config}", T::DTYPE);
        c.send(&fwd(r), next).await.map_err(|e| format!("{what}: {e}"))?;
        c.send(&bwd(r), prev).await.map_err(|e| format!("{what}: {e}"))?;
        let mut got = vec![T::from_f64(99.0); len];
        c.recv(&mut got, prev).await.map_err(|e| format!("{what}: {e}"))?;
        if bits(&got) != bits(&fwd(prev)) {
            return Err(mismatch(&what, &got, &fwd(prev)));
        }
        c.recv(&mut got, next).await.map_err(|e| format!("{what}: {e}"))?;
        if bits(&got) != bits(&bwd(next)) {
            return Err(mismatch(&what, &got, &bwd(next)));
        }
    }
    Ok(())
}

/// Runs `check` on every world size 1..=8 and config, for f32, f64 and bf16.
macro_rules! every_world {
    ($check:ident) => {{
        let seed = seed();
        for n in 1..=8 {
            for (name, config) in configs() {
                let (_net, comms) = world(n, config);
                let results = run_ranks(&comms, move |c| async move {
                    $check::<f32>(&c, seed, name).await?;
                    $check::<f64>(&c, seed, name).await?;
                    $check::<bf16>(&c, seed, name).await
                })
                .await;
                for result in results {
                    if let Err(e) = result {
                        panic!("{e} (replay with RTX_TEST_SEED={seed})");
                    }
                }
            }
        }
    }};
}

// Goal: all_reduce equals the reference bit for bit on every rank, for every op, dtype and size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_reduce_matches_reference() {
    every_world!(all_reduce_cases);
}

// Goal: the direct exchange (two-shot all_reduce) equals the reference bit for bit on every rank,
// for every op, dtype (bf16 widened), world size 1-8 and size: with tiny frames, segments of one
// or two frames, uneven ones lacking their last piece, and sizes past the window that go by ring;
// with frames larger than any segment, every size in one round. And the algorithm is chosen by
// the window: doubling up to `small_message_bytes`, direct below two frames per rank, ring above
// (and ring when the group is larger than `direct_all_reduce_ranks`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_all_reduce_matches_reference() {
    let seed = seed();
    let base = CommConfig { op_timeout: std::time::Duration::from_secs(20), small_message_bytes: 0, direct_all_reduce_ranks: Some(8), ..CommConfig::default() };
    let configs = [("direct", CommConfig { chunk_bytes: Some(24), ..base.clone() }), ("direct-one-round", CommConfig { chunk_bytes: Some(1 << 20), ..base })];
    for n in 1..=8 {
        for (name, config) in configs.clone() {
            let (_net, comms) = world(n, config);
            if n > 1 {
                let frame = comms[0].config().effective_chunk_bytes();
                assert_eq!(comms[0].all_reduce_algorithm(2 * n * frame - 1), AllReduceAlgorithm::Direct, "{name} n={n}");
                assert_eq!(comms[0].all_reduce_algorithm(2 * n * frame), AllReduceAlgorithm::Ring, "{name} n={n}");
            }
            let results = run_ranks(&comms, move |c| async move {
                all_reduce_cases::<f32>(&c, seed, name).await?;
                all_reduce_cases::<f64>(&c, seed, name).await?;
                all_reduce_cases::<bf16>(&c, seed, name).await
            })
            .await;
            for result in results {
                if let Err(e) = result {
                    panic!("{e} (replay with RTX_TEST_SEED={seed})");
                }
            }
        }
    }
    let (_net, comms) = world(5, CommConfig { small_message_bytes: 0, direct_all_reduce_ranks: Some(4), ..CommConfig::default() });
    assert_eq!(comms[0].all_reduce_algorithm(1024), AllReduceAlgorithm::Ring, "5 ranks, direct up to 4");
    let (_net, comms) = world(4, CommConfig { small_message_bytes: 16, ..CommConfig::default() });
    assert_eq!(comms[0].all_reduce_algorithm(1024), AllReduceAlgorithm::Ring, "in-process transport: no direct exchange unless configured");
    assert_eq!(comms[0].config().direct_all_reduce_ranks, Some(0));
}

// Goal: reduce_scatter (and its in-place form) leaves each rank its segment of the reference.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reduce_scatter_matches_reference() {
    every_world!(reduce_scatter_cases);
}

// Goal: reduce gives the reference on the root (every root position) and leaves others untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reduce_matches_reference() {
    every_world!(reduce_cases);
}

// Goal: all_gather (and its in-place form) reassembles the full vector from uneven segments.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_gather_reassembles() {
    every_world!(all_gather_cases);
}

// Goal: broadcast copies the root's buffer everywhere, from first, last and middle roots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broadcast_copies_root() {
    every_world!(broadcast_cases);
}

// Goal: all_to_all transposes blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_to_all_transposes() {
    every_world!(all_to_all_cases);
}

// Goal: send/recv deliver whole messages, matched in order per pair, in both ring directions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_recv_pairs() {
    every_world!(send_recv_cases);
}

// Goal: u32 buffers move through the copy-only collectives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u32_moves() {
    for n in [1, 3, 4] {
        let (_net, comms) = world(n, configs()[0].1.clone());
        run_ranks(&comms, |c| async move {
            let (n, r) = (c.size(), c.rank());
            let full: Vec<u32> = (0..23).map(|i| i * 7 + 1).collect();
            let mut out = vec![0u32; 23];
            c.all_gather(&full[c.segment(23, r)], &mut out).await.unwrap();
            assert_eq!(out, full);
            let mut b = if r == n - 1 { full.clone() } else { vec![0; 23] };
            c.broadcast(&mut b, n - 1).await.unwrap();
            assert_eq!(b, full);
        })
        .await;
    }
}

// Goal: nobody leaves a barrier before everyone entered it. Method: each rank bumps a shared
// counter before the barrier and reads it after, several rounds, with seeded delays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn barrier_waits_for_everyone() {
    let seed = seed();
    for n in 1..=8 {
        let (_net, comms) = world(n, configs()[2].1.clone());
        let entered = Arc::new(AtomicUsize::new(0));
        run_ranks(&comms, |c| {
            let entered = Arc::clone(&entered);
            async move {
                let mut rng = rng(seed, c.rank() as u64);
                for round in 1..=5 {
                    for _ in 0..rand::Rng::random_range(&mut rng, 0..20) {
                        tokio::task::yield_now().await;
                    }
                    entered.fetch_add(1, Ordering::SeqCst);
                    c.barrier().await.unwrap();
                    assert!(entered.load(Ordering::SeqCst) >= round * c.size(), "left barrier early");
                    c.barrier().await.unwrap();
                }
            }
        })
        .await;
    }
}

// Goal: split forms the right sub-groups (color, key order, None opting out) and they work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_forms_working_subgroups() {
    let seed = seed();
    for n in 1..=8 {
        let (_net, comms) = world(n, configs()[1].1.clone());
        run_ranks(&comms, move |c| async move {
            let (n, r) = (c.size(), c.rank());
            let color_of = |rank: usize| {
                if n > 2 && rank == n - 1 {
                    None
                } else {
                    Some((rank % 3) as u32)
                }
            };
            let key_of = |rank: usize| (n - rank) as u32;
            let sub = c.split(color_of(r), key_of(r)).await.unwrap();
            let Some(sub) = sub else {
                assert_eq!(color_of(r), None);
                c.barrier().await.unwrap();
                return;
            };
            let mut expected: Vec<usize> = (0..n).filter(|&q| color_of(q) == color_of(r)).collect();
            expected.sort_by_key(|&q| key_of(q));
            assert_eq!(sub.members(), &expected[..]);
            assert_eq!(sub.members()[sub.rank()], r);
            assert_ne!(sub.group_id(), c.group_id());
            let inputs: Vec<Vec<f32>> = expected.iter().map(|&q| exact_input(seed, 77, q, 19)).collect();
            let mut buf = inputs[sub.rank()].clone();
            sub.all_reduce(&mut buf, ReduceOp::Sum).await.unwrap();
            assert_eq!(bits(&buf), bits(&reference(ReduceOp::Sum, &inputs)));
            // The parent keeps working after a split, and splits nest.
            c.barrier().await.unwrap();
            let solo = sub.split(Some(0), 0).await.unwrap().unwrap();
            assert_eq!(solo.size(), sub.size());
        })
        .await;
    }
}

// Goal: results are bit-identical on every rank and across runs with different timing, for
// non-exact data. Method: random wide-range floats; three runs with seeded random yields before
// each op; compare all ranks and runs, and check closeness to an f64 reference.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_are_bit_identical_and_timing_independent() {
    let seed = seed();
    for n in [3, 5, 8] {
        for (name, config) in configs() {
            let len = 5003;
            let inputs: Vec<Vec<f32>> = (0..n)
                .map(|q| {
                    let mut g = rng(seed ^ 0xD5, q as u64);
                    (0..len).map(|_| rand::Rng::random_range(&mut g, -1.0f32..1.0) * 10f32.powi(rand::Rng::random_range(&mut g, -3..4))).collect()
                })
                .collect();
            let mut runs = Vec::new();
            for run in 0..3u64 {
                let (_net, comms) = world(n, config.clone());
                let inputs = inputs.clone();
                let out = run_ranks(&comms, move |c| {
                    let mut buf = inputs[c.rank()].clone();
                    async move {
                        let mut g = rng(seed ^ run, 100 + c.rank() as u64);
                        for _ in 0..rand::Rng::random_range(&mut g, 0..50) {
                            tokio::task::yield_now().await;
                        }
                        c.all_reduce(&mut buf, ReduceOp::Sum).await.unwrap();
                        bits(&buf)
                    }
                })
                .await;
                for (q, o) in out.iter().enumerate() {
                    assert_eq!(o, &out[0], "{name} n={n}: rank {q} differs from rank 0");
                }
                runs.push(out[0].clone());
            }
            assert!(runs.iter().all(|r| r == &runs[0]), "{name} n={n}: runs differ");
            let got: &[f32] = bytemuck::cast_slice(&runs[0]);
            for i in 0..len {
                let exact: f64 = inputs.iter().map(|v| f64::from(v[i])).sum();
                let scale: f64 = inputs.iter().map(|v| f64::from(v[i]).abs()).sum();
                assert!((f64::from(got[i]) - exact).abs() <= scale * 1e-6 + 1e-30, "{name}: element {i}");
            }
        }
    }
}

// Goal: buffer length errors are typed and leave the group usable (they are checked before any
// frame is sent, on every rank alike).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_lengths_are_typed_errors() {
    let (_net, comms) = world(3, configs()[2].1.clone());
    run_ranks(&comms, |c| async move {
        let mut out = vec![0f32; 5];
        let e = c.reduce_scatter(&[1.0f32; 10], &mut out, ReduceOp::Sum).await.unwrap_err();
        assert!(matches!(e, rtx_collectives::Error::BufferLength { .. }), "{e}");
        let mut out = vec![0f32; 7];
        let e = c.all_to_all(&[1.0f32; 7], &mut out).await.unwrap_err();
        assert!(matches!(e, rtx_collectives::Error::NotDivisible { len: 7, size: 3, .. }), "{e}");
        let e = c.broadcast(&mut out, 3).await.unwrap_err();
        assert!(matches!(e, rtx_collectives::Error::RankOutOfRange { rank: 3, size: 3 }), "{e}");
        let e = c.send(&out, c.rank()).await.unwrap_err();
        assert!(matches!(e, rtx_collectives::Error::SelfPeer { .. }), "{e}");
        let mut buf = vec![1.0f32; 4];
        c.all_reduce(&mut buf, ReduceOp::Sum).await.unwrap();
        assert_eq!(buf, vec![3.0; 4]);
    })
    .await;
}

// Goal: max/min give the same bits on every rank even where IEEE comparison cannot decide (signed
// zeros, NaN payloads). Method: inputs drawn from {+0, -0, NaN variants, 1}; compare all ranks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_min_bits_agree_on_zeros_and_nans() {
    let seed = seed();
    let specials = [0.0f32, -0.0, f32::NAN, -f32::NAN, f32::from_bits(0x7fc0_0001), 1.0];
    for n in [2, 3, 5, 8] {
        for (name, config) in configs() {
            let (_net, comms) = world(n, config);
            let out = run_ranks(&comms, move |c| async move {
                let mut g = rng(seed ^ 0x2E, c.rank() as u64);
                let mut results = Vec::new();
                for op in [ReduceOp::Max, ReduceOp::Min] {
                    let mut buf: Vec<f32> = (0..301).map(|_| specials[rand::Rng::random_range(&mut g, 0..specials.len())]).collect();
                    c.all_reduce(&mut buf, op).await.unwrap();
                    results.push(bits(&buf));
                }
                results
            })
            .await;
            for (q, o) in out.iter().enumerate() {
                assert_eq!(o, &out[0], "{name} n={n}: rank {q} differs from rank 0");
            }
        }
    }
}

// Goal: ranks that disagree on the operation, dtype or length get a typed error, not mixed data.
#[tokio::test(start_paused = true)]
async fn mismatched_calls_are_typed_errors() {
    use rtx_collectives::{CommConfig, DType, Error, OpKind};
    let config = CommConfig { op_timeout: std::time::Duration::from_secs(1), ..CommConfig::default() };

    let (_net, comms) = world(2, config.clone());
    let (c0, c1) = (comms[0].clone(), comms[1].clone());
    let other = tokio::spawn(async move { c1.broadcast(&mut [1.0f32; 8], 1).await });
    let e = c0.all_reduce(&mut [1.0f32; 8], ReduceOp::Sum).await.unwrap_err();
    assert_eq!(e, Error::OpMismatch { seq: 0, src: 1, expected: OpKind::AllReduce, got: OpKind::Broadcast });
    other.await.unwrap().unwrap();

    let (_net, comms) = world(2, config.clone());
    let (c0, c1) = (comms[0].clone(), comms[1].clone());
    let other = tokio::spawn(async move { c1.all_reduce(&mut [1.0f64; 8], ReduceOp::Sum).await });
    let e = c0.all_reduce(&mut [1.0f32; 8], ReduceOp::Sum).await.unwrap_err();
    assert_eq!(e, Error::DTypeMismatch { src: 1, expected: Some(DType::F32), got: Some(DType::F64) });
    assert!(matches!(other.await.unwrap(), Err(Error::DTypeMismatch { .. })));

    let (_net, comms) = world(2, config);
    let (c0, c1) = (comms[0].clone(), comms[1].clone());
    let other = tokio::spawn(async move { c1.all_reduce(&mut [1.0f32; 9], ReduceOp::Sum).await });
    let e = c0.all_reduce(&mut [1.0f32; 8], ReduceOp::Sum).await.unwrap_err();
    assert_eq!(e, Error::PayloadLength { src: 1, expected: 32, got: 36 });
    assert!(matches!(other.await.unwrap(), Err(Error::PayloadLength { .. })));
}

/// The ring's fixed order for element `i` of segment `c`: `((v[c+1] + v[c+2]) + ...) + v[c]`,
/// accumulated in `T::Acc` and rounded once.
fn ring_order_sum<T: TestElem>(inputs: &[Vec<T>], c: usize, i: usize) -> T {
    let n = inputs.len();
    let mut acc = inputs[(c + 1) % n][i].to_acc();
    for k in 2..=n {
        acc = <T::Acc as Accumulator>::combine(ReduceOp::Sum, acc, inputs[(c + k) % n][i].to_acc());
    }
    T::from_acc(acc)
}

async fn ring_order_case<T: TestElem>(n: usize, seed: u64) {
    let len = 1001;
    let inputs: Vec<Vec<T>> = (0..n)
        .map(|q| {
            let mut g = rng(seed ^ 0x0DE7, q as u64);
            (0..len).map(|_| T::from_f64(rand::Rng::random_range(&mut g, -1.0f64..1.0) * 10f64.powi(rand::Rng::random_range(&mut g, -3..4)))).collect()
        })
        .collect();
    let want: Vec<T> = (0..n).flat_map(|c| rtx_collectives::segment_range(len, n, c).map(|i| ring_order_sum(&inputs, c, i)).collect::<Vec<_>>()).collect();
    let (_net, comms) = world(n, CommConfig { small_message_bytes: 0, chunk_bytes: Some(24), ..CommConfig::default() });
    let out = run_ranks(&comms, |c| {
        let (inputs, want) = (inputs.clone(), want.clone());
        async move {
            let (r, seg) = (c.rank(), c.segment(len, c.rank()));
            let mut all = inputs[r].clone();
            c.all_reduce(&mut all, ReduceOp::Sum).await.unwrap();
            assert_eq!(bits(&all), bits(&want), "all_reduce rank {r}");
            let mut out = vec![T::from_f64(0.0); seg.len()];
            c.reduce_scatter(&inputs[r], &mut out, ReduceOp::Sum).await.unwrap();
            assert_eq!(bits(&out), bits(&want[seg.clone()]), "reduce_scatter rank {r}");
            let mut in_place = inputs[r].clone();
            c.reduce_scatter_in_place(&mut in_place, ReduceOp::Sum).await.unwrap();
            assert_eq!(bits(&in_place[seg.clone()]), bits(&want[seg]), "reduce_scatter_in_place rank {r}");
            let mut reduced = inputs[r].clone();
            c.reduce(&mut reduced, 1, ReduceOp::Sum).await.unwrap();
            if r == 1 {
                assert_eq!(bits(&reduced), bits(&want), "reduce rank {r}");
            }
        }
    })
    .await;
    assert_eq!(out.len(), n);
}

// Goal: the large-message algorithms reduce in the documented fixed ring order, for non-exact
// data (so a change of order would change bits), in f32 and bf16 (accumulated in f32, rounded
// once), whether the caller's buffer is read in place or widened piece by piece.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_reduction_order_is_fixed() {
    let seed = seed();
    for n in [2, 3, 4] {
        ring_order_case::<f32>(n, seed).await;
        ring_order_case::<bf16>(n, seed).await;
    }
}
