//! The NCCL unique id exchange over our own control plane, and the `Collective` traits on the host
//! communicator, with no GPU: rank 0 makes an id, a real host `Communicator` on the in-process
//! transport broadcasts it, every rank gets the identical bytes; malformed messages and a root that
//! cannot make an id are typed errors on every rank, never a hang.
//!
//! Method: in-process worlds of 1 to 5 ranks, one task per rank; ids are seeded random bytes (the
//! seed is printed, `RTX_TEST_SEED` replays it).
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use rand::Rng;
use rtx_collectives::{
    decode_id_message, encode_id_message, exchange_unique_id, Collective, CollectiveGroup, CommConfig, Communicator, Error, NcclUniqueId, ReduceOp,
    ID_MESSAGE_WORDS, NCCL_UNIQUE_ID_BYTES,
};

fn config() -> CommConfig {
    CommConfig { op_timeout: Duration::from_secs(20), ..CommConfig::default() }
}

fn random_id(seed: u64, stream: u64) -> NcclUniqueId {
    let mut rng = rng(seed, stream);
    let bytes: Vec<u8> = (0..NCCL_UNIQUE_ID_BYTES).map(|_| rng.random()).collect();
    NcclUniqueId::from_bytes(&bytes).unwrap()
}

// Goal: every rank of worlds of 1..=5 ends with rank 0's id, bit for bit; only rank 0 makes one.
#[tokio::test]
async fn every_rank_gets_the_root_id() {
    let seed = seed();
    for n in 1..=5usize {
        let expected = random_id(seed, n as u64);
        let (_net, comms) = world(n, config());
        let results = run_ranks(&comms, move |c| async move {
            exchange_unique_id(&c, || {
                assert_eq!(c.rank(), 0, "only rank 0 makes the id");
                Ok(expected)
            })
            .await
        })
        .await;
        for (rank, got) in results.into_iter().enumerate() {
            assert_eq!(got.unwrap().as_bytes(), expected.as_bytes(), "n={n} rank={rank} seed={seed}");
        }
    }
}

// Goal: a root that cannot make an id fails every rank at once with a typed error (the root keeps
// its own error), instead of leaving the others to time out.
#[tokio::test]
async fn root_failure_reaches_every_rank() {
    let (_net, comms) = world(3, CommConfig { op_timeout: Duration::from_secs(600), ..CommConfig::default() });
    let started = std::time::Instant::now();
    let results = run_ranks(&comms, |c| async move { exchange_unique_id(&c, || Err(Error::NcclNotFound)).await }).await;
    assert_eq!(results[0], Err(Error::NcclNotFound));
    for got in &results[1..] {
        assert_eq!(*got, Err(Error::NcclIdUnavailable { reason: "NCCL library not found on rank 0" }));
    }
    assert!(started.elapsed() < Duration::from_secs(30), "failed fast, not by timeout");
    let results = run_ranks(&comms, |c| async move { exchange_unique_id(&c, || Err(Error::InvalidConfig { reason: "x" })).await }).await;
    assert_eq!(results[1], Err(Error::NcclIdUnavailable { reason: "ncclGetUniqueId failed on rank 0" }));
}

// Goal: wrong lengths and corrupted fields are typed errors naming the problem.
#[test]
fn malformed_ids_are_typed_errors() {
    let seed = seed();
    assert!(matches!(NcclUniqueId::from_bytes(&[0u8; 127]), Err(Error::InvalidNcclId { len: 127, .. })));
    assert!(matches!(NcclUniqueId::from_bytes(&[0u8; 129]), Err(Error::InvalidNcclId { len: 129, .. })));
    let id = random_id(seed, 99);
    let words = encode_id_message(Ok(&id), 4);
    assert_eq!(decode_id_message(&words, 4).unwrap(), id);
    let reason = |r: Result<NcclUniqueId, Error>| match r {
        Err(Error::InvalidNcclId { reason, .. }) => reason,
        other => panic!("expected InvalidNcclId, got {other:?}"),
    };
    assert_eq!(reason(decode_id_message(&words[..ID_MESSAGE_WORDS - 1], 4)), "message has the wrong length");
    assert_eq!(reason(decode_id_message(&[words.as_slice(), &[0]].concat(), 4)), "message has the wrong length");
    assert_eq!(reason(decode_id_message(&words, 3)), "made for a group of another size");
    let mut bad = words;
    bad[10] ^= 0x100;
    assert_eq!(reason(decode_id_message(&bad, 4)), "checksum mismatch");
    // A well-formed checksum over a wrong magic or id length is still refused.
    let reseal = |mut w: [u32; ID_MESSAGE_WORDS]| {
        let mut h = crc32fast::Hasher::new();
        for x in &w[..ID_MESSAGE_WORDS - 1] {
            h.update(&x.to_le_bytes());
        }
        w[ID_MESSAGE_WORDS - 1] = h.finalize();
        w
    };
    let mut bad = words;
    bad[0] = 0;
    assert_eq!(reason(decode_id_message(&reseal(bad), 4)), "bad magic");
    let mut bad = words;
    bad[4] = 64;
    assert_eq!(reason(decode_id_message(&reseal(bad), 4)), "declared id length is not 128 bytes");
}

// Goal: the host communicator behind the `Collective` traits gives the inherent methods' results
// (a generic caller, as the DP engine will be).
#[tokio::test]
async fn host_communicator_through_the_traits() {
    async fn generic<C: Collective<f32, Buf = [f32]>>(c: &C) -> Vec<f32> {
        let mut buf: Vec<f32> = (0..8).map(|i| (c.rank() * 8 + i) as f32).collect();
        c.all_reduce(&mut buf, ReduceOp::Sum).await.unwrap();
        let mut part = vec![0f32; 8 / c.size()];
        c.reduce_scatter(&buf, &mut part, ReduceOp::Max).await.unwrap();
        let mut all = vec![0f32; 8];
        c.all_gather(&part, &mut all).await.unwrap();
        c.barrier().await.unwrap();
        all
    }
    let (_net, comms) = world(2, config());
    let results = run_ranks(&comms, |c: Communicator| async move { generic(&c).await }).await;
    let expected: Vec<f32> = (0..8).map(|i| (i + 8 + i) as f32).collect();
    assert_eq!(results, vec![expected.clone(), expected]);
    // Generations through the trait: a bump is visible, and a non-increasing one refused.
    let c = &comms[0];
    CollectiveGroup::set_generation(c, 3).unwrap();
    assert_eq!(CollectiveGroup::generation(c), 3);
    assert!(matches!(CollectiveGroup::set_generation(c, 2), Err(Error::GenerationNotIncreasing { .. })));
}
