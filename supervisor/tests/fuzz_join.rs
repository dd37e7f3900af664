//! Fuzzing the join handshake (`supervisor/src/protocol.rs`): the `Join` and `Status` asks as
//! the supervisor decodes and verifies them, the `JoinReply` as the worker decodes and verifies
//! it, and a real supervisor answering hostile asks over a real link.
//!
//! An input is `ekm ‖ message`: the 32 bytes of TLS keying material of its connection, then a
//! message whose proof is the right one, or one truncated to any length, extended, bit-flipped,
//! made for another connection, another role or another token, empty, long, or random; the
//! encoded message is then mutated (half the time) as `fuzz_support` does. The supervisor side
//! must decode to `Ok` or a typed error and verify **exactly** the proof equal to
//! `HMAC(token, "rtx-join-worker" ‖ ekm)` (a supervisor's proof, or one for another channel, never
//! passes); the worker side likewise with the supervisor's proof, then takes the fields as the
//! worker does. A third test hands such asks to a real supervisor (`SupervisorHandle::start_with`
//! on a channel listener, links over in-memory streams) and checks each answer against the
//! decode: undecodable or not-joined messages close the link, a wrong proof is refused, the right
//! one admitted with an authentic supervisor proof; nothing hangs and the supervisor survives.
//!
//! `cargo test -p rtx-supervisor --test fuzz_join` runs the full 1,000,000 asks and 1,000,000
//! replies (a few seconds of CPU in the debug test build) and 3,000 asks to the real supervisor;
//! `RTX_FUZZ_INPUTS` and `RTX_FUZZ_E2E_INPUTS` change the counts (`RTX_FUZZ_E2E_INPUTS=1000000`
//! takes about 80 s in release) and `RTX_FUZZ_SEED` replays a run.
#![allow(clippy::unwrap_used)]

#[path = "../../actors/tests/fuzz_support/mod.rs"]
mod fuzz_support;
#[path = "fuzz_support/messages.rs"]
mod messages;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use fuzz_support::{Mutator, Values};
use rand::{Rng, RngCore};
use rand_chacha::ChaCha8Rng;
use rtx_actors::{ActorError, Link, LinkListener, LinkOptions, StreamConn};
use rtx_supervisor::protocol::{self, JoinReply, StatusReport, ToSupervisor};
use rtx_supervisor::{ClassPolicy, ElasticConfig, JobEvent, OnFailure, SupervisorEnv, SupervisorHandle, SupervisorOptions};
use tokio::io::{AsyncRead, ReadBuf};

const TOKEN: &str = "5f0c1e0d9a7b3c2e4f6a8b0c1d2e3f405162738495a6b7c8d9e0f1a2b3c4d5e6";

fn ekm(rng: &mut ChaCha8Rng) -> [u8; 32] {
    let mut e = [0u8; 32];
    rng.fill_bytes(&mut e);
    e
}

/// A proof for a connection with `ekm` whose right value is `right`: that value, or a near miss.
fn proof_variant(rng: &mut ChaCha8Rng, right: &[u8], ekm: &[u8; 32], wrong_role: &[u8]) -> Vec<u8> {
    match rng.random_range(0..11) {
        0 | 1 => right.to_vec(),
        2 => right[..rng.random_range(0..right.len())].to_vec(),
        3 => [right, &Values::bytes(rng, 64)[..]].concat(),
        4 => {
            let mut p = right.to_vec();
            let i = rng.random_range(0..p.len());
            p[i] ^= 1 << rng.random_range(0..8);
            p
        }
        5 => {
            let mut other = *ekm;
            other[rng.random_range(0..32)] ^= 1;
            protocol::worker_proof(TOKEN, &other)
        }
        6 => wrong_role.to_vec(),
        7 => protocol::worker_proof(&Values::string(rng), ekm),
        8 => Vec::new(),
        9 => {
            let max = if rng.random_ratio(1, 50) { 70_000 } else { 80 };
            Values::bytes(rng, max)
        }
        _ => [&right[..right.len() / 2], &right[..right.len() / 2]].concat(),
    }
}

/// `ekm ‖ encoded ask`: a `Join` or `Status` with a proof variant (or, for the end-to-end test,
/// sometimes any other `ToSupervisor`), mutated half the time.
fn ask_input(rng: &mut ChaCha8Rng, other_variants: bool) -> Vec<u8> {
    let ekm = ekm(rng);
    let right = protocol::worker_proof(TOKEN, &ekm);
    let proof = proof_variant(rng, &right, &ekm, &protocol::supervisor_proof(TOKEN, &ekm));
    let msg = match rng.random_range(0..10) {
        0 | 1 => ToSupervisor::Status { proof },
        2 if other_variants => messages::to_supervisor(rng),
        _ => ToSupervisor::Join { name: Values::string(rng), pid: Values::u32(rng), host: Values::string(rng), proof },
    };
    let mut bytes = rtx_actors::encode(&msg).unwrap();
    if rng.random_bool(0.5) {
        let other = messages::any_encoded(rng);
        bytes = Mutator::mutate(rng, &bytes, &other);
    }
    [&ekm[..], &bytes].concat()
}

fn split(input: &[u8]) -> ([u8; 32], &[u8]) {
    (input[..32].try_into().unwrap(), &input[32..])
}

/// What the supervisor decides for an ask, from the decode and the proof check alone.
#[derive(Debug, PartialEq)]
enum Verdict {
    Undecodable,
    Admit,
    RefuseJoin,
    Status,
    StatusRefused,
    NotJoined,
}

/// Decodes and verifies an ask as the supervisor does; checks that exactly the right proof
/// passes, and that no proof passes for the wrong role.
fn supervisor_verdict(ekm: &[u8; 32], bytes: &[u8]) -> Result<Verdict, String> {
    let msg = match rtx_actors::decode::<ToSupervisor>(bytes) {
        Ok(msg) => msg,
        Err(ActorError::Codec(_)) => return Ok(Verdict::Undecodable),
        Err(other) => return Err(format!("untyped decode error {other:?}")),
    };
    let (proof, join) = match &msg {
        ToSupervisor::Join { proof, .. } => (proof, true),
        ToSupervisor::Status { proof } => (proof, false),
        _ => return Ok(Verdict::NotJoined),
    };
    let verified = protocol::verify_worker_proof(TOKEN, ekm, proof);
    if verified != (*proof == protocol::worker_proof(TOKEN, ekm)) {
        return Err(format!("verify_worker_proof said {verified} for a proof of {} bytes", proof.len()));
    }
    if protocol::verify_supervisor_proof(TOKEN, ekm, proof) != (*proof == protocol::supervisor_proof(TOKEN, ekm)) {
        return Err("verify_supervisor_proof disagrees with the supervisor's proof".into());
    }
    Ok(match (join, verified) {
        (true, true) => Verdict::Admit,
        (true, false) => Verdict::RefuseJoin,
        (false, true) => Verdict::Status,
        (false, false) => Verdict::StatusRefused,
    })
}

// Goal: at least 1M hostile `Join`/`Status` asks (`RTX_FUZZ_INPUTS`) decode to `Ok` or a typed
// error and verify exactly when the proof is the right one; never a panic or a hang.
#[test]
fn join_asks_verify_exactly_the_right_proof() {
    let seed = fuzz_support::seed("fuzz_join_asks");
    let mut admitted = 0u64;
    let summary = fuzz_support::run("fuzz_join_asks", seed, fuzz_support::inputs(1_000_000), |rng| ask_input(rng, false), |input| {
        let (ekm, bytes) = split(input);
        let verdict = supervisor_verdict(&ekm, bytes)?;
        admitted += u64::from(matches!(verdict, Verdict::Admit | Verdict::Status));
        Ok(!matches!(verdict, Verdict::Undecodable))
    });
    eprintln!("fuzz_join_asks: {admitted} of {} asks carried the right proof", summary.inputs);
    assert!(admitted > summary.inputs / 20 && admitted < summary.inputs / 2, "proof variants are not mixed: {admitted}");
}

// Goal: at least 1M hostile `JoinReply`s (`RTX_FUZZ_INPUTS`) decode on the worker side to `Ok`
// or a typed error; the supervisor's proof verifies exactly when it is the right one (a worker's
// proof reflected back never does), and the worker takes the fields without a panic.
#[test]
fn join_replies_verify_exactly_the_right_proof() {
    let seed = fuzz_support::seed("fuzz_join_replies");
    let mut authentic = 0u64;
    let summary = fuzz_support::run(
        "fuzz_join_replies",
        seed,
        fuzz_support::inputs(1_000_000),
        |rng| {
            let ekm = ekm(rng);
            let right = protocol::supervisor_proof(TOKEN, &ekm);
            let mut reply = messages::join_reply(rng);
            if let JoinReply::Accepted { proof, .. } = &mut reply {
                *proof = proof_variant(rng, &right, &ekm, &protocol::worker_proof(TOKEN, &ekm));
            }
            let mut bytes = rtx_actors::encode(&reply).unwrap();
            if rng.random_bool(0.5) {
                let other = messages::any_encoded(rng);
                bytes = Mutator::mutate(rng, &bytes, &other);
            }
            [&ekm[..], &bytes].concat()
        },
        |input| {
            let (ekm, bytes) = split(input);
            match rtx_actors::decode::<JoinReply>(bytes) {
                Ok(JoinReply::Accepted { node, proof, job, heartbeat_ms, resume, verify_every, checkpoint_every, sharding, snapshot_every, zero_copies, data_transport, channels, connections, run_dir }) => {
                    let verified = protocol::verify_supervisor_proof(TOKEN, &ekm, &proof);
                    if verified != (proof == protocol::supervisor_proof(TOKEN, &ekm)) {
                        return Err(format!("verify_supervisor_proof said {verified} for a proof of {} bytes", proof.len()));
                    }
                    if protocol::verify_worker_proof(TOKEN, &ekm, &proof) != (proof == protocol::worker_proof(TOKEN, &ekm)) {
                        return Err("verify_worker_proof disagrees with the worker's proof".into());
                    }
                    authentic += u64::from(verified);
                    // What run_node does with an authentic reply's fields.
                    let heartbeat = Duration::from_millis(heartbeat_ms.max(10));
                    let resume = resume.map(PathBuf::from);
                    let run_dir = run_dir.map(PathBuf::from);
                    std::hint::black_box((node, job.len(), heartbeat, resume, verify_every, checkpoint_every, sharding, snapshot_every, zero_copies, data_transport, channels, connections, run_dir));
                    Ok(true)
                }
                Ok(JoinReply::Refused { .. }) => Ok(true),
                Err(ActorError::Codec(_)) => Ok(false),
                Err(other) => Err(format!("untyped decode error {other:?}")),
            }
        },
    );
    eprintln!("fuzz_join_replies: {authentic} of {} replies carried the right supervisor proof", summary.inputs);
    assert!(authentic > summary.inputs / 50, "too few authentic replies: {authentic}");
}

/// An in-memory connection: both ends agree on its keying material, and closing it (either
/// end) ends both ends' reads, as closing a QUIC connection does.
struct Conn {
    ekm: [u8; 32],
    closed: AtomicBool,
    readers: Mutex<Vec<Waker>>,
}

impl Conn {
    fn new(ekm: [u8; 32]) -> Arc<Conn> {
        Arc::new(Conn { ekm, closed: AtomicBool::new(false), readers: Mutex::new(Vec::new()) })
    }
}

/// A read half of the connection: ends (EOF) once the connection is closed.
struct Reader<R> {
    inner: R,
    conn: Arc<Conn>,
}

impl<R: AsyncRead + Unpin> AsyncRead for Reader<R> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        self.conn.readers.lock().unwrap().push(cx.waker().clone());
        if self.conn.closed.load(Ordering::Acquire) {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl StreamConn for Conn {
    fn close(&self, _reason: &str) {
        self.closed.store(true, Ordering::Release);
        for waker in self.readers.lock().unwrap().drain(..) {
            waker.wake();
        }
    }

    fn export_keying_material(&self, _label: &[u8]) -> [u8; 32] {
        self.ekm
    }

    fn remote_address(&self) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, 2], 4000))
    }
}

// Goal: a real supervisor answers every hostile ask as its decode and proof dictate (closes the
// link, refuses, admits with an authentic proof, reports status), within a deadline, and is still
// admitting a good worker afterwards. `RTX_FUZZ_E2E_INPUTS` sets the count.
#[test]
fn a_real_supervisor_answers_hostile_asks() {
    let seed = fuzz_support::seed("fuzz_join_supervisor");
    let n = std::env::var("RTX_FUZZ_E2E_INPUTS").ok().and_then(|v| v.parse().ok()).unwrap_or(3_000);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let addr = SocketAddr::from(([10, 255, 0, 1], 29500));
    let (listener, accept) = LinkListener::channel(addr, 16);
    // Every admitted ask's link is closed right after its answer: a lost member each time, so
    // the failure budgets must outlast the run (with the default of 100 the job fails, as it
    // should, and the supervisor stops answering).
    let endless = ClassPolicy { on_failure: OnFailure::Shrink, budget: u32::MAX };
    let elastic = ElasticConfig { min_workers: 1, start_workers: 1_000_000, max_workers: 1_000_000, crash: endless, hang: endless, network_loss: endless, preemption: endless, ..ElasticConfig::default() };
    let options = SupervisorOptions {
        listen: addr,
        token: TOKEN.into(),
        job: "[model]\nkind = \"fuzz\"\n".into(),
        total_steps: 10,
        stop_at: None,
        elastic,
        resume: None,
        resume_next_step: 0, run_dir: None,
        link: LinkOptions::default(),
    };
    let mut handle = rt.block_on(SupervisorHandle::start_with(options, None, SupervisorEnv { listener, seed })).unwrap();
    // Someone must read the job's events, as `rtx launch` does.
    let mut events = std::mem::replace(&mut handle.events, tokio::sync::mpsc::channel(1).1);
    let failed = Arc::new(Mutex::new(None));
    let failed_in = Arc::clone(&failed);
    rt.spawn(async move {
        while let Some(event) = events.recv().await {
            if let JobEvent::Failed { reason } = event {
                *failed_in.lock().unwrap() = Some(reason);
            }
        }
    });
    let ask = |input: &[u8]| {
        let (ekm, bytes) = split(input);
        rt.block_on(async {
            let conn = Conn::new(ekm);
            let (a, b) = tokio::io::duplex(1 << 16);
            let ((ar, aw), (br, bw)) = (tokio::io::split(a), tokio::io::split(b));
            let (ar, br) = (Reader { inner: ar, conn: Arc::clone(&conn) }, Reader { inner: br, conn: Arc::clone(&conn) });
            let (client, _client_inbound) = Link::over_stream("supervisor".into(), Arc::clone(&conn) as Arc<dyn StreamConn>, ar, aw);
            let server = Link::over_stream("worker".into(), conn, br, bw);
            accept.send(server).await.map_err(|_| "the supervisor's listener is gone".to_string())?;
            let answer = client.ask_bytes(protocol::SUPERVISOR, bytes.to_vec(), Duration::from_secs(10)).await;
            client.close("done");
            Ok::<_, String>(answer)
        })
    };
    fuzz_support::run("fuzz_join_supervisor", seed, n, |rng| ask_input(rng, true), |input| {
        let (ekm, bytes) = split(input);
        let verdict = supervisor_verdict(&ekm, bytes)?;
        let answer = ask(input)?;
        let ok = match (&verdict, &answer) {
            (Verdict::Undecodable | Verdict::NotJoined, Err(ActorError::LinkClosed { .. })) => true,
            (Verdict::StatusRefused, Err(ActorError::Remote { reason, .. })) => reason == "wrong cluster token",
            (Verdict::Status, Ok(bytes)) => rtx_actors::decode::<StatusReport>(bytes).is_ok(),
            (Verdict::RefuseJoin, Ok(bytes)) => matches!(rtx_actors::decode::<JoinReply>(bytes), Ok(JoinReply::Refused { reason }) if reason == "wrong cluster token"),
            (Verdict::Admit, Ok(bytes)) => matches!(rtx_actors::decode::<JoinReply>(bytes), Ok(JoinReply::Accepted { proof, .. }) if protocol::verify_supervisor_proof(TOKEN, &ekm, &proof)),
            _ => false,
        };
        if !ok {
            let failed = failed.lock().unwrap().clone();
            return Err(format!("the supervisor answered {answer:?} to an ask whose verdict is {verdict:?} (job failed: {failed:?})"));
        }
        Ok(matches!(verdict, Verdict::Admit))
    });
    // Still alive and admitting.
    let mut rng = fuzz_support::input_rng(seed, u64::MAX);
    let ekm = ekm(&mut rng);
    let join = ToSupervisor::Join { name: "good".into(), pid: 1, host: "h".into(), proof: protocol::worker_proof(TOKEN, &ekm) };
    let input = [&ekm[..], &rtx_actors::encode(&join).unwrap()].concat();
    let reply = ask(&input).unwrap().unwrap();
    assert!(matches!(rtx_actors::decode::<JoinReply>(&reply), Ok(JoinReply::Accepted { .. })));
    assert_eq!(*failed.lock().unwrap(), None, "the job failed");
}
