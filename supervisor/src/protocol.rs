//! The control protocol between the cluster supervisor and node agents: rkyv messages over an
//! [`rtx_actors::Link`], and the join proof.
//!
//! Join: the worker dials the supervisor (TLS, not yet authenticated), and both sides derive
//! 32 bytes from the TLS exporter of that connection. The worker sends
//! `HMAC-SHA256(token, "rtx-join-worker" ‖ ekm)`; the supervisor checks it in constant time and
//! answers with `HMAC-SHA256(token, "rtx-join-supervisor" ‖ ekm)`, which the worker checks before
//! trusting anything it receives (its certificate, the job). Neither side sends the token, and a
//! proof made for one connection is useless on another, so a man in the middle learns nothing it
//! can replay. Only then does the worker get its rank certificate from the cluster CA, with which
//! workers authenticate each other (mutual TLS) on the collectives connections.
//!
//! A generation change is two round trips: `Prepare` (abort the old generation, bind a fresh
//! collectives endpoint with a new rank certificate) answered by `Ready` (address and the last
//! step this worker completed), then `Start` (everyone's addresses, which rank holds the newest
//! state, the step to run next).

use rtx_actors::auth;

use crate::config::{DataTransport, DpSharding, ZeroCopies};

/// Actor name of the supervisor on its links.
pub const SUPERVISOR: &str = "supervisor";
/// Actor name of a node agent on its link.
pub const AGENT: &str = "agent";
const WORKER_LABEL: &[u8] = b"rtx-join-worker";
const SUPERVISOR_LABEL: &[u8] = b"rtx-join-supervisor";
/// Label of the TLS exporter used for the join proof.
pub const EXPORTER_LABEL: &[u8] = auth::EXPORTER_LABEL;

/// Messages to the supervisor.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub enum ToSupervisor {
    /// Asks to join (an `ask`; the answer is a [`JoinReply`]). `host` identifies the machine
    /// (members on one machine may use shared memory).
    Join { name: String, pid: u32, host: String, proof: Vec<u8> },
    /// Liveness and progress, every heartbeat interval.
    Heartbeat { node: u64, generation: u64, completed: Option<u64> },
    /// The node agent got `Prepare` for `generation` and aborted the old one: sent by the control
    /// path at once, whatever the compute thread is doing, so the supervisor can tell a stuck
    /// compute thread (acknowledged, no `Ready`) from a dead or stopped process (neither).
    Preparing { node: u64, generation: u64 },
    /// Answer to `Prepare`: bound at `addr`; `completed` is the newest step whose whole state
    /// (parameters and full optimizer state) this member holds alone; `zero1` what it holds of a
    /// ZeRO-1 layout (its own and its buddy's segment states), newest first: the copies of the
    /// last two exchanged steps (a re-formation can cut an exchange after some ranks committed its
    /// step and before others did, so the members' newest copies may be one step apart).
    /// `mesh`: in a model-parallel job, the mesh slot whose state this member holds.
    Ready { node: u64, generation: u64, addr: String, completed: Option<u64>, zero1: Vec<Zero1Held>, mesh: Option<MeshHeld> },
    /// A step finished on this worker. `checksum` (of the parameter bits) on verification steps.
    StepDone { node: u64, generation: u64, step: u64, loss: f64, samples: u64, checksum: Option<u64> },
    /// A step failed on this worker (usually because a peer failed).
    StepFailed { node: u64, generation: u64, step: u64, reason: String },
    /// The worker leaves gracefully (SIGTERM: preemption) after `completed`.
    Leaving { node: u64, completed: Option<u64>, reason: String },
    /// The final report after `Finish`: the evaluation of the final model (rank 0) and a checksum.
    /// `compute_s` is the time spent inside training steps, `control_s` on the control path of
    /// the step loop (polling commands, reporting steps), `loop_s` the whole step loop (which
    /// also holds data waits, checksums and checkpoint snapshots).
    Finished { node: u64, checksum: u64, eval: Vec<(String, f64)>, compute_s: f64, control_s: f64, loop_s: f64 },
    /// A checkpoint was written.
    Checkpointed { node: u64, step: u64, path: String },
    /// Writing the checkpoint of `step` failed; the previous one stays the last good one.
    CheckpointFailed { node: u64, step: u64, reason: String },
    /// Asks for a [`StatusReport`] (an `ask`); the proof is the join proof of this connection.
    Status { proof: Vec<u8> },
}

/// The supervisor's answer to `Join`.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub enum JoinReply {
    /// Admitted as `node`; `proof` is the supervisor's; `job` is the job description (TOML).
    /// `run_dir`: the supervisor's output folder, where workers put checkpoints
    /// (`<run_dir>/checkpoints`) unless told otherwise; reachable from other machines only on a
    /// shared filesystem (as on a Slurm cluster). `zero_copies`: under ZeRO-1/2, whether each
    /// step's segment states are exchanged with the buddies or only snapshots are kept.
    /// `data_transport`: what the collectives bind at `Prepare` to cross processes (QUIC, or TLS
    /// over TCP). `channels`: the rings each large all-reduce is split into (`[elastic] channels`),
    /// and the DP communication runtime's threads. `connections`: TCP or QUIC connections per worker
    /// pair of the data transport (`[elastic] connections`).
    Accepted { node: u64, proof: Vec<u8>, job: String, heartbeat_ms: u64, resume: Option<String>, verify_every: u64, checkpoint_every: u64, sharding: DpSharding, snapshot_every: u64, zero_copies: ZeroCopies, data_transport: DataTransport, channels: u32, connections: u32, run_dir: Option<String> },
    /// Not admitted, and why.
    Refused { reason: String },
}

/// Messages to a node agent.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub enum ToWorker {
    /// Abort generation < `generation`, bind a collectives endpoint as `rank` of `world` with this
    /// certificate (DER: CA, leaf, PKCS#8 key), then answer `Ready`.
    Prepare { generation: u64, rank: u32, world: u32, ca: Vec<u8>, cert: Vec<u8>, key: Vec<u8> },
    /// Connect to `addrs` (by rank) — or, with `shm_job`, through shared-memory rings of that
    /// name (every member on one machine) — take the state from `source`, train from
    /// `next_step` up to (not including) `stop_step`. `mesh`: in a model-parallel job, the mesh
    /// and where each member takes its shard from (`source` is then unused). `host_of`: when the
    /// members span several machines and some machine holds several of them, each rank's
    /// machine (an index); the members of one machine then use shared-memory rings named
    /// `{shm_job}-h{host}` among themselves and QUIC to the rest, and `all_reduce` is
    /// hierarchical. Empty otherwise.
    Start { generation: u64, addrs: Vec<String>, source: StateSource, next_step: u64, stop_step: u64, shm_job: Option<String>, mesh: Option<MeshStart>, host_of: Vec<u32> },
    /// Too few workers: abort generation < `generation` and wait for the next `Prepare`.
    Pause { generation: u64 },
    /// Training is complete: report `Finished` and exit.
    Finish,
    /// Leave the job now (evicted after a hang, or the answer to `Leaving`).
    Evict { reason: String },
}

/// What a ZeRO-1 member holds between generations: the segment states (parameter and optimizer
/// segments) of segments `rank` (its own) and `(rank + world - 1) % world` (its buddy's) of the
/// layout of `world` ranks it trained in during `generation`, both as of `step`.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Zero1Held {
    pub generation: u64,
    pub world: u32,
    pub rank: u32,
    pub step: u64,
}

/// What a member of a model-parallel job holds between generations: the state (parameters and
/// optimizer state) of slot `slot` of a mesh replica of `slots` slots (slot = stage · tp + tensor rank),
/// as of `step`.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct MeshHeld {
    pub slots: u32,
    /// Tensor-parallel ranks of the shape (with `slots`, the shape's `(pp, tp)`).
    pub tp: u32,
    pub slot: u32,
    pub step: u64,
}

/// The mesh of a generation of a model-parallel job: `dp · pp · tp` = the world, and where each
/// rank takes its shard's state from (decided by [`crate::placement::shard_sources`]).
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct MeshStart {
    pub dp: u32,
    pub pp: u32,
    pub tp: u32,
    /// One per rank.
    pub sources: Vec<ShardSource>,
}

/// Where a mesh member takes its shard's state from.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum ShardSource {
    /// It holds the state already.
    Local,
    /// Member `rank`, which holds the same slot, sends it.
    Member { rank: u32 },
    /// It loads its part of the sharded checkpoint at `location` (of step `step`).
    Checkpoint { location: String, step: u64 },
    /// Nothing to restore: the state it built at boot.
    Initial,
}

/// Where a new generation takes its state from (decided by [`crate::recovery::plan_recovery`]).
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum StateSource {
    /// Nothing to restore: every member starts from what it built at boot (initial parameters, or
    /// the `--resume` checkpoint every worker loaded).
    Initial,
    /// Member `rank` (of the new generation) holds the whole state: it broadcasts it.
    Member { rank: u32 },
    /// Rebuild the state of `step` from the segments of the ZeRO-1 layout of `world` ranks: old
    /// segment `i` is sent by the member of new rank `holders[i]`.
    Zero1Segments { step: u64, world: u32, holders: Vec<u32> },
    /// Every holder of newer state is gone: rank 0 loads the checkpoint at `location` (of step
    /// `step`) through its checkpoint store and broadcasts it.
    Checkpoint { location: String, step: u64 },
}

impl StateSource {
    /// The new rank that sends the state first: the member source, rank 0 for a checkpoint (it
    /// loads and broadcasts it) or for boot state, the holder of segment 0 for segments.
    pub fn sending_rank(&self) -> usize {
        match self {
            StateSource::Member { rank } => *rank as usize,
            StateSource::Zero1Segments { holders, .. } => holders.first().map_or(0, |&h| h as usize),
            StateSource::Initial | StateSource::Checkpoint { .. } => 0,
        }
    }
}

/// One member in a [`StatusReport`].
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub struct MemberStatus {
    pub node: u64,
    pub name: String,
    pub pid: u32,
    pub rank: Option<u32>,
    pub role: String,
    pub completed: Option<u64>,
}

/// What `rtx status` shows.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq)]
pub struct StatusReport {
    pub phase: String,
    pub generation: u64,
    pub committed: Option<u64>,
    pub total_steps: u64,
    pub members: Vec<MemberStatus>,
    pub steps_per_sec: f64,
    pub samples_per_sec: f64,
    pub failures: u64,
}

/// The worker's join proof for a connection with exporter value `ekm`.
pub fn worker_proof(token: &str, ekm: &[u8; 32]) -> Vec<u8> {
    proof(token, WORKER_LABEL, ekm)
}

/// The supervisor's proof for a connection with exporter value `ekm`.
pub fn supervisor_proof(token: &str, ekm: &[u8; 32]) -> Vec<u8> {
    proof(token, SUPERVISOR_LABEL, ekm)
}

/// Checks `given` against the proof for `label` in constant time.
pub fn verify_worker_proof(token: &str, ekm: &[u8; 32], given: &[u8]) -> bool {
    verify(token, WORKER_LABEL, ekm, given)
}

/// Checks the supervisor's proof in constant time.
pub fn verify_supervisor_proof(token: &str, ekm: &[u8; 32], given: &[u8]) -> bool {
    verify(token, SUPERVISOR_LABEL, ekm, given)
}

fn proof(token: &str, label: &[u8], ekm: &[u8; 32]) -> Vec<u8> {
    auth::prove(token, label, ekm)
}

fn verify(token: &str, label: &[u8], ekm: &[u8; 32], given: &[u8]) -> bool {
    auth::verify(token, label, ekm, given)
}

/// A fresh random cluster token (32 bytes from the OS, hex).
pub fn generate_token() -> Result<String, String> {
    auth::generate_token()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_token_role_and_channel() {
        let ekm = [7u8; 32];
        let p = worker_proof("secret", &ekm);
        assert!(verify_worker_proof("secret", &ekm, &p));
        assert!(!verify_worker_proof("wrong", &ekm, &p));
        assert!(!verify_worker_proof("secret", &[8u8; 32], &p), "a proof is tied to its connection");
        assert!(!verify_supervisor_proof("secret", &ekm, &p), "the roles' proofs differ");
        assert!(!verify_worker_proof("secret", &ekm, &p[..10]));
        let t = generate_token().unwrap();
        assert_eq!(t.len(), 64);
        assert_ne!(t, generate_token().unwrap());
    }
}
