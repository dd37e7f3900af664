//! The frame decoder under hostile input: every malformed frame maps to a typed error, never a
//! panic; random and mutated bytes are fed through proptest with a seeded RNG; and an endpoint that
//! receives garbage or forged frames drops and counts them while its groups keep working.
//!
//! `RTX_FUZZ_CASES=N` runs every proptest here with N cases instead of its small default (CI keeps
//! the default; a long run is recorded in BENCHMARKS.md):
//! `RTX_FUZZ_CASES=1000000 cargo test --release -p rtx-collectives --test frame_decode`.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use rtx_collectives::frame::{decode, decode_header, encode, encode_header_only_checksum, FrameHeader, FLAG_HEADER_ONLY_CHECKSUM, HEADER_LEN, MAGIC, VERSION};
use rtx_collectives::{BufferPool, CommConfig, DType, Endpoint, Error, InProcessNetwork, OpKind, PooledBuf, ReduceOp, Transport};

const CAP: usize = 1 << 16;

/// `default` cases, or `RTX_FUZZ_CASES` when set.
fn cases(default: u32) -> u32 {
    let cases = std::env::var("RTX_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default);
    eprintln!("proptest cases: {cases}");
    cases
}

fn runner(seed: u64, cases: u32) -> TestRunner {
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let config = Config { cases, failure_persistence: None, ..Config::default() };
    TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &bytes))
}

fn header() -> FrameHeader {
    FrameHeader { group: 9, generation: 4, seq: 17, op: OpKind::ReduceScatter, chunk: 3, src: 1, dtype: Some(DType::BF16), payload_len: 0, channels: 0 }
}

fn valid_frame(payload: &[u8]) -> Vec<u8> {
    encode(&BufferPool::new(), &header(), payload).to_vec()
}

const OPS: [OpKind; 9] = [
    OpKind::Send,
    OpKind::AllReduce,
    OpKind::ReduceScatter,
    OpKind::AllGather,
    OpKind::Broadcast,
    OpKind::Reduce,
    OpKind::Barrier,
    OpKind::AllToAll,
    OpKind::Split,
];

// Goal: arbitrary bytes never panic the decoder and are never accepted.
#[test]
fn random_bytes_are_rejected() {
    let seed = seed();
    runner(seed, cases(4000))
        .run(&proptest::collection::vec(any::<u8>(), 0..300), |bytes| {
            prop_assert!(decode(&bytes, CAP).is_err());
            let _ = decode_header(&bytes, CAP);
            Ok(())
        })
        .unwrap();
}

// Goal: random bytes behind a valid magic and version still never panic (they reach the deeper
// checks), and are rejected.
#[test]
fn random_bytes_after_magic_are_rejected() {
    let seed = seed();
    runner(seed ^ 1, cases(4000))
        .run(&proptest::collection::vec(any::<u8>(), 0..300), |mut bytes| {
            if bytes.len() >= 6 {
                bytes[..4].copy_from_slice(&MAGIC.to_le_bytes());
                bytes[4..6].copy_from_slice(&VERSION.to_le_bytes());
            }
            prop_assert!(decode(&bytes, CAP).is_err());
            Ok(())
        })
        .unwrap();
}

// Goal: any header round-trips, and flipping any set of distinct bits (or truncating or
// extending the frame) of a valid frame is detected with a typed error.
#[test]
fn mutated_frames_are_rejected() {
    let seed = seed();
    let strategy = (
        proptest::collection::vec(any::<u8>(), 0..200),
        (any::<u64>(), any::<u64>(), any::<u64>(), 0usize..OPS.len(), any::<u32>(), any::<u32>(), 0usize..5),
        proptest::collection::vec((any::<prop::sample::Index>(), 1u8..=255), 0..4),
        prop_oneof![Just(0isize), -70isize..0, 1isize..10],
    );
    runner(seed ^ 2, cases(3000))
        .run(&strategy, |(payload, (group, generation, seq, op, chunk, src, dtype), flips, resize)| {
            let dtypes = [None, Some(DType::F32), Some(DType::F64), Some(DType::BF16), Some(DType::U32)];
            let h = FrameHeader { group, generation, seq, op: OPS[op], chunk, src, dtype: dtypes[dtype], payload_len: 0, channels: 0 };
            let mut bytes = encode(&BufferPool::new(), &h, &payload).to_vec();
            prop_assert_eq!(decode(&bytes, CAP).unwrap(), FrameHeader { payload_len: payload.len() as u64, ..h });
            let len = bytes.len();
            // Distinct positions, each XORed with a non-zero byte, so every flip changes the frame.
            let mut at = std::collections::BTreeMap::new();
            for (i, xor) in &flips {
                at.entry(i.index(len)).or_insert(*xor);
            }
            let changed = !at.is_empty() || resize != 0;
            for (i, xor) in &at {
                bytes[*i] ^= xor;
            }
            if resize < 0 {
                bytes.truncate(len.saturating_sub(resize.unsigned_abs()));
            } else {
                bytes.extend(std::iter::repeat_n(0xAB, resize as usize));
            }
            if changed {
                prop_assert!(decode(&bytes, CAP).is_err(), "mutation accepted: {:?} {}", at, resize);
            }
            Ok(())
        })
        .unwrap();
}

// Goal: a frame whose checksum covers only its header (what transports that guarantee integrity
// send) round-trips; any change to its header, including setting the flag on a fully checksummed
// frame or clearing it, is detected; unknown flag bits are refused; a changed payload is by design
// not (its transport vouches for it), though a changed length still is.
#[test]
fn header_only_checksum_frames() {
    let seed = seed();
    let strategy = (
        proptest::collection::vec(any::<u8>(), 0..200),
        (any::<u64>(), any::<u64>(), any::<u32>(), 0usize..OPS.len()),
        (0usize..HEADER_LEN, 1u8..=255),
        proptest::collection::vec((any::<prop::sample::Index>(), 1u8..=255), 1..4),
    );
    runner(seed ^ 3, cases(3000))
        .run(&strategy, |(payload, (group, seq, chunk, op), (at, xor), payload_flips)| {
            let h = FrameHeader { group, generation: 1, seq, op: OPS[op], chunk, src: 0, dtype: Some(DType::F32), payload_len: 0, channels: 0 };
            let mut bytes = encode_header_only_checksum(&h, payload.len()).to_vec();
            bytes.extend_from_slice(&payload);
            prop_assert_eq!(decode(&bytes, CAP).unwrap(), FrameHeader { payload_len: payload.len() as u64, ..h });
            let mut header_flipped = bytes.clone();
            header_flipped[at] ^= xor;
            prop_assert!(decode(&header_flipped, CAP).is_err(), "header byte {} changed and accepted", at);
            let mut payload_flipped = bytes.clone();
            if !payload.is_empty() {
                for (i, x) in &payload_flips {
                    payload_flipped[HEADER_LEN + i.index(payload.len())] ^= x;
                }
                prop_assert!(decode(&payload_flipped, CAP).is_ok());
            }
            let mut full = encode(&BufferPool::new(), &h, &payload).to_vec();
            full[52] |= FLAG_HEADER_ONLY_CHECKSUM;
            let flagged = matches!(decode(&full, CAP), Err(Error::ChecksumMismatch { .. }));
            prop_assert!(flagged, "flag set on a fully checksummed frame was accepted");
            Ok(())
        })
        .unwrap();
    let mut unknown = encode_header_only_checksum(&header(), 0).to_vec();
    unknown[52] |= 0x80;
    assert_eq!(decode(&unknown, CAP), Err(Error::ReservedNonZero));
}

// Goal: each kind of malformation has its own typed error with the facts in it.
#[test]
fn each_malformation_has_its_error() {
    let good = valid_frame(&[1, 2, 3, 4, 5, 6, 7, 8]);
    assert!(decode(&good, CAP).is_ok());

    assert_eq!(decode(&good[..10], CAP), Err(Error::FrameTooShort { len: 10, min: HEADER_LEN }));

    let mut b = good.clone();
    b[0] = b'X';
    assert!(matches!(decode(&b, CAP), Err(Error::BadMagic { .. })));

    let mut b = good.clone();
    b[4..6].copy_from_slice(&7u16.to_le_bytes());
    assert_eq!(decode(&b, CAP), Err(Error::UnsupportedVersion { got: 7, supported: VERSION }));

    let mut b = good.clone();
    b[6] = 200;
    assert_eq!(decode(&b, CAP), Err(Error::UnknownOpKind { code: 200 }));

    let mut b = good.clone();
    b[7] = 99;
    assert_eq!(decode(&b, CAP), Err(Error::UnknownDType { code: 99 }));

    let mut b = good.clone();
    b[60] = 1;
    assert_eq!(decode(&b, CAP), Err(Error::ReservedNonZero));

    assert_eq!(decode(&good, 4), Err(Error::PayloadTooLarge { len: 8, cap: 4 }));
    // A stream reader learns the length is over the cap from the header alone.
    assert_eq!(decode_header(&good[..HEADER_LEN], 4), Err(Error::PayloadTooLarge { len: 8, cap: 4 }));

    assert_eq!(decode(&good[..good.len() - 3], CAP), Err(Error::PayloadLengthMismatch { declared: 8, actual: 5 }));

    let mut b = good.clone();
    b[HEADER_LEN + 2] ^= 1;
    assert!(matches!(decode(&b, CAP), Err(Error::ChecksumMismatch { .. })));

    let mut b = good.clone();
    b[20] ^= 1; // generation: covered by the checksum too
    assert!(matches!(decode(&b, CAP), Err(Error::ChecksumMismatch { .. })));
}

// Goal: an endpoint drops and counts garbage and forged frames from a rogue rank, and its group
// keeps working. Method: a 3-rank network where rank 2 is a raw transport writing bytes by hand.
#[tokio::test(start_paused = true)]
async fn endpoint_drops_and_counts_malformed_frames() {
    let (_net, transports) = InProcessNetwork::new(3);
    let mut transports = transports.into_iter();
    let config = CommConfig { op_timeout: Duration::from_secs(5), ..CommConfig::default() };
    let t0: Arc<dyn Transport> = Arc::new(transports.next().unwrap());
    let t1: Arc<dyn Transport> = Arc::new(transports.next().unwrap());
    let rogue = transports.next().unwrap();
    let e0 = Endpoint::new(t0, config.clone()).unwrap();
    let e1 = Endpoint::new(t1, config).unwrap();
    let g0 = e0.group(5, vec![0, 1], 0).unwrap();
    let g1 = e1.group(5, vec![0, 1], 0).unwrap();

    // Garbage, a truncated frame, and a valid frame that claims to come from rank 1.
    rogue.send(0, PooledBuf::unpooled(vec![0xFF; 100])).await.unwrap();
    let mut truncated = valid_frame(&[0; 16]);
    truncated.truncate(HEADER_LEN + 3);
    rogue.send(0, PooledBuf::unpooled(truncated)).await.unwrap();
    let forged = FrameHeader { group: 5, generation: 0, seq: 0, op: OpKind::AllReduce, chunk: 0, src: 1, dtype: Some(DType::F32), payload_len: 0, channels: 0 };
    rogue.send(0, encode(&BufferPool::new(), &forged, &[0; 16])).await.unwrap();
    // A valid frame from the rogue itself, for a group it is not in.
    let foreign = FrameHeader { src: 2, ..forged };
    rogue.send(0, encode(&BufferPool::new(), &foreign, &[0; 16])).await.unwrap();
    while e0.malformed_frames() < 4 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(e0.malformed_frames(), 4);

    let out = run_ranks(&[g0, g1], |c| async move {
        let mut buf = vec![1.5f32; 4];
        c.all_reduce(&mut buf, ReduceOp::Sum).await.unwrap();
        buf
    })
    .await;
    assert_eq!(out, vec![vec![3.0f32; 4]; 2], "forged frame must not have been applied");
}
