//! `NcclCommunicator` creation (feature `nccl`): on a machine without the NCCL library or a GPU
//! (CI), probing and the real id exchange return typed errors on every rank instead of panicking
//! inside cudarc; on a GPU machine, a one-rank communicator is created through the real exchange
//! and runs an all-reduce, a stale generation and an abort.
//!
//! Method: in-process host worlds; each test first asks what the machine has and asserts the
//! behaviour expected for it, so the same file passes on CPU CI and on a GPU.
#![cfg(feature = "nccl")]
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use rtx_collectives::{
    exchange_unique_id, nccl_unique_id, probe_nccl, Collective, CollectiveGroup, CommConfig, Error, NcclCommunicator, ReduceOp, NCCL_MIN_VERSION,
};
use rtx_kernels::cuda::Device;

fn config() -> CommConfig {
    CommConfig { op_timeout: Duration::from_secs(30), ..CommConfig::default() }
}

// Goal: probing never panics; it reports the library as missing, too old, or its version.
#[test]
fn probe_reports_instead_of_panicking() {
    match probe_nccl() {
        Ok(version) => assert!(version >= NCCL_MIN_VERSION),
        Err(Error::NcclNotFound) | Err(Error::NcclVersion { .. }) => {}
        Err(other) => panic!("unexpected probe error {other}"),
    }
}

// Goal: the real exchange (rank 0 calls ncclGetUniqueId) over a 3-rank host world either gives
// every rank the same id, or, without NCCL, fails every rank with a typed error at once.
#[tokio::test]
async fn real_exchange_agrees_or_fails_typed() {
    let (_net, comms) = world(3, config());
    let results = run_ranks(&comms, |c| async move { exchange_unique_id(&c, nccl_unique_id).await }).await;
    match probe_nccl() {
        Ok(_) => {
            let first = results[0].clone().unwrap();
            assert!(results.iter().all(|r| r.as_ref().ok() == Some(&first)));
        }
        Err(probe) => {
            assert_eq!(results[0], Err(probe));
            for r in &results[1..] {
                assert!(matches!(r, Err(Error::NcclIdUnavailable { .. })), "{r:?}");
            }
        }
    }
}

// Goal: creating a communicator without a GPU or NCCL is an error naming what is missing; with
// both, a one-rank communicator works, and a generation bump fails later operations as stale.
#[tokio::test]
async fn one_rank_communicator_or_clear_error() {
    let device = match Device::new(0) {
        Ok(device) => Arc::new(device),
        Err(e) => {
            // No driver or no device here: that is the error a caller sees first, and it names it.
            eprintln!("no CUDA device: {e}");
            assert!(!e.to_string().is_empty());
            assert!(matches!(probe_nccl(), Ok(_) | Err(Error::NcclNotFound) | Err(Error::NcclVersion { .. })));
            return;
        }
    };
    let (_net, comms) = world(1, config());
    let comm = match NcclCommunicator::new(&comms[0], device.clone()).await {
        Ok(comm) => comm,
        Err(e) => {
            assert!(matches!(e, Error::NcclNotFound | Error::NcclVersion { .. }), "{e}");
            return;
        }
    };
    let data: Vec<f32> = (1..=1000).map(|i| i as f32 * 0.5).collect();
    let mut buf = device.htod(&data).unwrap();
    comm.all_reduce(&mut buf, ReduceOp::Sum).await.unwrap();
    assert_eq!(device.dtoh(&buf).unwrap(), data);
    comm.barrier().await.unwrap();
    CollectiveGroup::set_generation(&comm, 1).unwrap();
    let err = comm.all_reduce(&mut buf, ReduceOp::Sum).await.unwrap_err();
    assert_eq!(err, Error::StaleGeneration { expected: 1, got: 0 });
}
