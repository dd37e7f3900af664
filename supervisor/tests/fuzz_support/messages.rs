//! Random valid control-protocol messages (every variant, random field values) for the fuzz
//! tests of `supervisor/tests/fuzz_*.rs`.
#![allow(dead_code)]

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use rtx_supervisor::{DataTransport, DpSharding, ZeroCopies};
use rtx_supervisor::protocol::{JoinReply, MemberStatus, MeshHeld, MeshStart, ShardSource, StateSource, StatusReport, ToSupervisor, ToWorker, Zero1Held};

use crate::fuzz_support::Values;

/// Every `ToSupervisor` variant, picked at random.
pub(crate) fn to_supervisor(rng: &mut ChaCha8Rng) -> ToSupervisor {
    let v = Values::u64;
    match rng.random_range(0..12) {
        0 => ToSupervisor::Join { name: Values::string(rng), pid: Values::u32(rng), host: Values::string(rng), proof: Values::bytes(rng, 40) },
        1 => ToSupervisor::Heartbeat { node: v(rng), generation: v(rng), completed: Values::option(rng, v) },
        2 => ToSupervisor::Ready { node: v(rng), generation: v(rng), addr: Values::string(rng), completed: Values::option(rng, v), zero1: Values::vec(rng, 3, zero1_held), mesh: Values::option(rng, mesh_held) },
        3 => ToSupervisor::StepDone { node: v(rng), generation: v(rng), step: v(rng), loss: Values::f64(rng), samples: v(rng), checksum: Values::option(rng, v) },
        4 => ToSupervisor::StepFailed { node: v(rng), generation: v(rng), step: v(rng), reason: Values::string(rng) },
        5 => ToSupervisor::Leaving { node: v(rng), completed: Values::option(rng, v), reason: Values::string(rng) },
        6 => ToSupervisor::Finished {
            node: v(rng),
            checksum: v(rng),
            eval: Values::vec(rng, 4, |r| (Values::string(r), Values::f64(r))),
            compute_s: Values::f64(rng),
            control_s: Values::f64(rng),
            loop_s: Values::f64(rng),
        },
        7 => ToSupervisor::Checkpointed { node: v(rng), step: v(rng), path: Values::string(rng) },
        8 => ToSupervisor::CheckpointFailed { node: v(rng), step: v(rng), reason: Values::string(rng) },
        9 => ToSupervisor::Status { proof: Values::bytes(rng, 40) },
        10 => ToSupervisor::Preparing { node: v(rng), generation: v(rng) },
        _ => ToSupervisor::Heartbeat { node: v(rng), generation: v(rng), completed: None },
    }
}

/// Every `ToWorker` variant.
pub(crate) fn to_worker(rng: &mut ChaCha8Rng) -> ToWorker {
    let v = Values::u64;
    match rng.random_range(0..5) {
        0 => ToWorker::Prepare { generation: v(rng), rank: Values::u32(rng), world: Values::u32(rng), ca: Values::bytes(rng, 64), cert: Values::bytes(rng, 64), key: Values::bytes(rng, 64) },
        1 => ToWorker::Start {
            generation: v(rng),
            addrs: Values::vec(rng, 5, Values::string),
            source: state_source(rng),
            next_step: v(rng),
            stop_step: v(rng),
            shm_job: Values::option(rng, Values::string),
            mesh: Values::option(rng, mesh_start),
            host_of: Values::vec(rng, 5, Values::u32),
        },
        2 => ToWorker::Pause { generation: v(rng) },
        3 => ToWorker::Finish,
        _ => ToWorker::Evict { reason: Values::string(rng) },
    }
}

/// What a mesh member holds.
fn mesh_held(rng: &mut ChaCha8Rng) -> MeshHeld {
    MeshHeld { slots: Values::u32(rng), tp: Values::u32(rng), slot: Values::u32(rng), step: Values::u64(rng) }
}

/// A mesh generation's start.
fn mesh_start(rng: &mut ChaCha8Rng) -> MeshStart {
    let source = |rng: &mut ChaCha8Rng| match rng.random_range(0..4) {
        0 => ShardSource::Local,
        1 => ShardSource::Member { rank: Values::u32(rng) },
        2 => ShardSource::Checkpoint { location: Values::string(rng), step: Values::u64(rng) },
        _ => ShardSource::Initial,
    };
    MeshStart { dp: Values::u32(rng), pp: Values::u32(rng), tp: Values::u32(rng), sources: Values::vec(rng, 4, source) }
}

/// What a ZeRO-1 member holds.
fn zero1_held(rng: &mut ChaCha8Rng) -> Zero1Held {
    Zero1Held { generation: Values::u64(rng), world: Values::u32(rng), rank: Values::u32(rng), step: Values::u64(rng) }
}

/// Every `StateSource` variant.
fn state_source(rng: &mut ChaCha8Rng) -> StateSource {
    match rng.random_range(0..4) {
        0 => StateSource::Initial,
        1 => StateSource::Member { rank: Values::u32(rng) },
        2 => StateSource::Zero1Segments { step: Values::u64(rng), world: Values::u32(rng), holders: Values::vec(rng, 8, Values::u32) },
        _ => StateSource::Checkpoint { location: Values::string(rng), step: Values::u64(rng) },
    }
}

/// Both `JoinReply` variants.
pub(crate) fn join_reply(rng: &mut ChaCha8Rng) -> JoinReply {
    if rng.random_bool(0.7) {
        JoinReply::Accepted {
            node: Values::u64(rng),
            proof: Values::bytes(rng, 40),
            job: Values::string(rng),
            heartbeat_ms: Values::u64(rng),
            resume: Values::option(rng, Values::string),
            verify_every: Values::u64(rng),
            checkpoint_every: Values::u64(rng),
            sharding: [DpSharding::Replicated, DpSharding::Zero1, DpSharding::Zero2, DpSharding::Zero3][rng.random_range(0..4)],
            snapshot_every: Values::u64(rng),
            zero_copies: if rng.random_bool(0.5) { ZeroCopies::Buddy } else { ZeroCopies::Snapshot },
            data_transport: if rng.random_bool(0.5) { DataTransport::Quic } else { DataTransport::Tls },
            channels: Values::u32(rng),
            connections: Values::u32(rng),
            run_dir: Values::option(rng, Values::string),
        }
    } else {
        JoinReply::Refused { reason: Values::string(rng) }
    }
}

/// A `StatusReport` with up to five members.
pub(crate) fn status_report(rng: &mut ChaCha8Rng) -> StatusReport {
    StatusReport {
        phase: Values::string(rng),
        generation: Values::u64(rng),
        committed: Values::option(rng, Values::u64),
        total_steps: Values::u64(rng),
        members: Values::vec(rng, 5, |r| MemberStatus {
            node: Values::u64(r),
            name: Values::string(r),
            pid: Values::u32(r),
            rank: Values::option(r, Values::u32),
            role: Values::string(r),
            completed: Values::option(r, Values::u64),
        }),
        steps_per_sec: Values::f64(rng),
        samples_per_sec: Values::f64(rng),
        failures: Values::u64(rng),
    }
}

/// The encoding of a random message of a random one of the four types.
pub(crate) fn any_encoded(rng: &mut ChaCha8Rng) -> Vec<u8> {
    let encoded = match rng.random_range(0..4) {
        0 => rtx_actors::encode(&to_supervisor(rng)),
        1 => rtx_actors::encode(&to_worker(rng)),
        2 => rtx_actors::encode(&join_reply(rng)),
        _ => rtx_actors::encode(&status_report(rng)),
    };
    encoded.unwrap_or_default()
}
