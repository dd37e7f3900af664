//! Generations: a bump aborts in-flight operations of the old generation with `StaleGeneration`,
//! frames of old generations are dropped and counted (never applied), frames of a newer generation
//! wait for the local bump, and re-forming a group aborts the old one.
//!
//! Method: in-process worlds on a paused-clock current-thread runtime, so "wait until everyone is
//! blocked" is a virtual sleep and the outcome does not depend on the machine's speed.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use rtx_collectives::{CommConfig, Error, ReduceOp, WORLD_GROUP_ID};

fn config() -> CommConfig {
    CommConfig { op_timeout: Duration::from_secs(20), chunk_bytes: Some(64), ..CommConfig::default() }
}

// Goal: set_generation aborts operations blocked in the old generation, on every rank that bumps,
// with both generations in the error; and the group works again at the new generation.
#[tokio::test(start_paused = true)]
async fn bump_aborts_in_flight_ops() {
    let (_net, comms) = world(4, config());
    // Rank 3 never joins generation 0's all_reduce, so the others block.
    let tasks: Vec<_> = comms[..3]
        .iter()
        .cloned()
        .map(|c| {
            tokio::spawn(async move {
                let mut buf = vec![1.0f32; 1000];
                c.all_reduce(&mut buf, ReduceOp::Sum).await
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let started = tokio::time::Instant::now();
    for c in &comms {
        c.set_generation(1).unwrap();
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), Err(Error::StaleGeneration { expected: 1, got: 0 }));
    }
    assert_eq!(started.elapsed(), Duration::ZERO, "abort is immediate, not a timeout");
    // Rank 3 had parked generation-0 frames from rank 2; the bump dropped and counted them.
    assert!(comms[3].stale_frames_dropped() > 0);
    let out = run_ranks(&comms, |c| async move {
        let mut buf = vec![c.rank() as f32; 1000];
        c.all_reduce(&mut buf, ReduceOp::Sum).await.unwrap();
        buf
    })
    .await;
    assert!(out.iter().all(|b| b.iter().all(|&x| x == 6.0)));
}

// Goal: a frame of an older generation arriving after the bump is dropped, counted, and never
// delivered to an operation of the new generation.
#[tokio::test(start_paused = true)]
async fn old_generation_frames_are_dropped_and_counted() {
    let (_net, comms) = world(2, config());
    comms[1].set_generation(1).unwrap();
    comms[0].send(&[1.0f32; 8], 1).await.unwrap();
    while comms[1].stale_frames_dropped() == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(comms[1].stale_frames_dropped(), 1);
    comms[0].set_generation(1).unwrap();
    comms[0].send(&[2.0f32; 8], 1).await.unwrap();
    let mut got = [0.0f32; 8];
    comms[1].recv(&mut got, 0).await.unwrap();
    assert_eq!(got, [2.0; 8]);
}

// Goal: a rank bumped later than its peers still completes the new generation's operation: early
// frames of the newer generation are kept, not dropped.
#[tokio::test(start_paused = true)]
async fn newer_generation_frames_wait_for_the_bump() {
    let (_net, comms) = world(3, config());
    let out = run_ranks(&comms, |c| async move {
        if c.rank() == 2 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        c.set_generation(5).unwrap();
        let mut buf = vec![1.0f64; 300];
        c.all_reduce(&mut buf, ReduceOp::Sum).await.unwrap();
        (buf, c.stale_frames_dropped())
    })
    .await;
    for (buf, stale) in out {
        assert!(buf.iter().all(|&x| x == 3.0));
        assert_eq!(stale, 0);
    }
}

// Goal: generations only move forward.
#[tokio::test]
async fn generation_must_increase() {
    let (_net, comms) = world(1, config());
    comms[0].set_generation(3).unwrap();
    assert_eq!(comms[0].set_generation(3), Err(Error::GenerationNotIncreasing { current: 3, requested: 3 }));
    assert_eq!(comms[0].set_generation(2), Err(Error::GenerationNotIncreasing { current: 3, requested: 2 }));
    assert_eq!(comms[0].generation(), 3);
}

// Goal: re-forming a group (same id, new members, higher generation) aborts the old group's
// operations, and the new group works without the missing rank.
#[tokio::test(start_paused = true)]
async fn reform_aborts_old_group() {
    let (_net, comms) = world(3, config());
    let tasks: Vec<_> = comms[..2]
        .iter()
        .cloned()
        .map(|c| {
            tokio::spawn(async move {
                let mut buf = vec![1.0f32; 100];
                c.all_reduce(&mut buf, ReduceOp::Sum).await
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(10)).await;
    let reformed: Vec<_> = comms[..2].iter().map(|c| c.endpoint().group(WORLD_GROUP_ID, vec![0, 1], 1).unwrap()).collect();
    for t in tasks {
        assert_eq!(t.await.unwrap(), Err(Error::StaleGeneration { expected: 1, got: 0 }));
    }
    assert_eq!(comms[0].endpoint().group(WORLD_GROUP_ID, vec![0, 1], 1).unwrap_err(), Error::GenerationNotIncreasing { current: 1, requested: 1 });
    let out = run_ranks(&reformed, |c| async move {
        let mut buf = vec![2.0f32; 100];
        c.all_reduce(&mut buf, ReduceOp::Avg).await.unwrap();
        (c.size(), c.generation(), buf)
    })
    .await;
    for (size, generation, buf) in out {
        assert_eq!((size, generation), (2, 1));
        assert!(buf.iter().all(|&x| x == 2.0));
    }
}
