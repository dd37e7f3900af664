//! Actor links over the collectives' QUIC transport (`Link::over_transport`): actor envelopes
//! travel on the transport's control path (`ControlPath`: stripe 0 of the collectives connection,
//! or a control connection of its own between second endpoints, driven by the caller's runtime or
//! by a thread of its own), asks go both ways while all_reduces run and all answers are right, a
//! peer whose transport is dropped fails the pending ask with a typed error instead of a hang, and
//! an oversized envelope closes the link with a typed reason while the control connection stays.
//!
//! Method: two real `QuicTransport`s on 127.0.0.1 with certificates from one `ClusterCa` (mutual
//! TLS, as the collectives' own QUIC tests set them up), each wrapped in an `Endpoint` for
//! collectives and used for one side-stream link. "No new connection for the link" is checked
//! three ways: the endpoints' open connections, their handshake counters (no handshake after
//! `connect`), and quinn's connection id, the same before and after; which connection carries the
//! link is checked against the id of the frames' connection.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use rtx_actors::{ActorError, Inbound, Link, ACTOR_CHANNEL};
use rtx_collectives::{ClusterCa, CommConfig, Communicator, ControlPath, Endpoint, QuicOptions, QuicTransport, ReduceOp, Transport};
use tokio::sync::mpsc;

/// Wall-clock bound on each test body.
const TEST_TIMEOUT: Duration = Duration::from_secs(60);
const ASK_TIMEOUT: Duration = Duration::from_secs(10);
const ROUNDS: usize = 12;
const ASKS_PER_ROUND: u64 = 10;
/// Elements of each all_reduce: large enough for the ring path and frames of many packets.
const ELEMS: usize = 1 << 18;

#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, PartialEq, Clone)]
enum Calc {
    /// Answered with `a * 1000 + b + rank of the answering side`.
    Mix { a: u64, b: u64 },
    /// Taken and never answered.
    Hold,
}

fn options(control: ControlPath) -> QuicOptions {
    QuicOptions {
        connect_timeout: Duration::from_secs(20),
        idle_timeout: Duration::from_secs(3),
        keep_alive: Duration::from_millis(500),
        control,
        ..QuicOptions::default()
    }
}

/// Two connected ranks on loopback.
async fn pair(ca: &ClusterCa, control: ControlPath) -> Vec<Arc<QuicTransport>> {
    QuicTransport::loopback_world(ca, 2, options(control)).await.unwrap()
}

fn communicator(transport: &Arc<QuicTransport>) -> Communicator {
    let t: Arc<dyn Transport> = Arc::clone(transport) as Arc<dyn Transport>;
    Endpoint::new(t, CommConfig { op_timeout: Duration::from_secs(20), ..CommConfig::default() }).unwrap().world().unwrap()
}

/// Rank 0 opens the actor link, rank 1 accepts it; returns each rank's link and inbound queue.
async fn links(transports: &[Arc<QuicTransport>]) -> [(Link, mpsc::Receiver<Inbound>); 2] {
    let acceptor = Arc::clone(&transports[1]);
    let accepted = tokio::spawn(async move { Link::accept_over_transport(&acceptor, ACTOR_CHANNEL).await });
    let opened = Link::over_transport(&transports[0], 1, ACTOR_CHANNEL).await.unwrap();
    let (peer, link1, inbound1) = accepted.await.unwrap().unwrap();
    assert_eq!(peer, 0);
    [opened, (link1, inbound1)]
}

/// Serves `Calc` asks for `rank` until the link ends; returns how many it answered.
fn serve(rank: u64, mut inbound: mpsc::Receiver<Inbound>) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let mut answered = 0;
        let mut held = Vec::new();
        while let Some(msg) = inbound.recv().await {
            assert_eq!(msg.to(), "calc");
            match msg.decode::<Calc>().unwrap() {
                Calc::Mix { a, b } => {
                    msg.reply(&(a * 1000 + b + rank)).await.unwrap();
                    answered += 1;
                }
                Calc::Hold => held.push(msg),
            }
        }
        answered
    })
}

// Goal: actor asks in both directions and all_reduces share one QUIC connection per peer pair and
// all complete correctly while running at the same time. Method: each rank runs ROUNDS
// all_reduces of ELEMS floats while a second task per rank issues asks to the other rank; the
// replies encode the answering rank, the sums are exact; then the connection counters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asks_and_all_reduce_share_one_connection() {
    asks_during_all_reduce(ControlPath::Shared).await;
}

// Goal: the same with the actor link on a control connection of its own (`OwnThread`): asks and
// all_reduces interleave with correct results, the link rides the one control connection per
// pair that `connect` made, which is not the frames' connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asks_during_all_reduce_on_the_control_thread() {
    asks_during_all_reduce(ControlPath::OwnThread).await;
}

// Goal: the same with the control endpoint driven by the caller's runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asks_during_all_reduce_on_a_control_endpoint() {
    asks_during_all_reduce(ControlPath::OwnEndpoint).await;
}

async fn asks_during_all_reduce(control: ControlPath) {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let ca = ClusterCa::generate("rtx actor-link test cluster").unwrap();
        let transports = pair(&ca, control).await;
        let ids: Vec<usize> = vec![transports[0].connection_id(1).unwrap(), transports[1].connection_id(0).unwrap()];
        for (t, peer) in [(&transports[0], 1), (&transports[1], 0)] {
            let on_frames = t.connection_id(peer) == t.frame_connection_id(peer);
            assert_eq!(on_frames, control == ControlPath::Shared, "{control:?}");
            assert_eq!(t.open_control_connections(), usize::from(control != ControlPath::Shared), "{control:?}");
            assert_eq!(t.control_runtime().is_some(), control == ControlPath::OwnThread);
        }
        let handshakes = |t: &QuicTransport| {
            let stats = t.endpoint_stats();
            (stats.outgoing_handshakes, stats.accepted_handshakes)
        };
        let handshakes_before: Vec<(u64, u64)> = transports.iter().map(|t| handshakes(t)).collect();
        // Rank 0 dialed rank 1 (a failed first attempt would add a retry, never an accept).
        assert!(handshakes_before[0].0 >= 1 && handshakes_before[0].1 == 0, "{handshakes_before:?}");
        assert!(handshakes_before[1].0 == 0 && handshakes_before[1].1 >= 1, "{handshakes_before:?}");
        let comms: Vec<Communicator> = transports.iter().map(communicator).collect();
        let [(link0, inbound0), (link1, inbound1)] = links(&transports).await;
        let servers = [serve(0, inbound0), serve(1, inbound1)];

        let mut tasks = Vec::new();
        for (rank, comm) in comms.iter().enumerate() {
            let comm = comm.clone();
            tasks.push(tokio::spawn(async move {
                for round in 0..ROUNDS {
                    let mut buf: Vec<f32> = (0..ELEMS).map(|i| ((i + round) % 13) as f32 + rank as f32).collect();
                    comm.all_reduce(&mut buf, ReduceOp::Sum).await.unwrap();
                    assert!(buf.iter().enumerate().all(|(i, &x)| x == 2.0 * ((i + round) % 13) as f32 + 1.0), "round {round} of rank {rank}");
                }
                ROUNDS as u64
            }));
        }
        for (rank, link) in [(0u64, link0.clone()), (1u64, link1.clone())] {
            tasks.push(tokio::spawn(async move {
                let calc = link.remote::<Calc>("calc");
                let other = 1 - rank;
                let mut asked = 0;
                for round in 0..ROUNDS as u64 {
                    for i in 0..ASKS_PER_ROUND {
                        let answer: u64 = calc.ask(&Calc::Mix { a: round, b: i }, ASK_TIMEOUT).await.unwrap();
                        assert_eq!(answer, round * 1000 + i + other);
                        asked += 1;
                    }
                    tokio::task::yield_now().await;
                }
                asked
            }));
        }
        let done: Vec<u64> = futures_join(tasks).await;
        assert_eq!(done, vec![ROUNDS as u64, ROUNDS as u64, ROUNDS as u64 * ASKS_PER_ROUND, ROUNDS as u64 * ASKS_PER_ROUND]);

        // Exactly one connection per peer pair: the same connection throughout, and no other was
        // ever dialed or accepted.
        assert_eq!(transports[0].connection_id(1), Some(ids[0]));
        assert_eq!(transports[1].connection_id(0), Some(ids[1]));
        for t in &transports {
            assert_eq!(t.open_connections(), 1);
            assert_eq!(t.open_control_connections(), usize::from(control != ControlPath::Shared));
        }
        let handshakes_after: Vec<(u64, u64)> = transports.iter().map(|t| handshakes(t)).collect();
        assert_eq!(handshakes_after, handshakes_before, "the actor link made a connection of its own");
        // Both ends of the side stream see the same TLS channel.
        assert_eq!(link0.export_keying_material(b"test").unwrap(), link1.export_keying_material(b"test").unwrap());

        // Closing the actor link ends only its stream: the collectives keep working.
        link0.close("done");
        drop((link0, link1));
        let answered: Vec<u64> = futures_join(servers.into_iter().collect()).await;
        assert_eq!(answered, vec![ROUNDS as u64 * ASKS_PER_ROUND; 2]);
        let sums = futures_join(
            comms
                .iter()
                .map(|c| {
                    let c = c.clone();
                    tokio::spawn(async move {
                        let mut one = vec![1.0f32; 100];
                        c.all_reduce(&mut one, ReduceOp::Sum).await.unwrap();
                        one[0] as u64
                    })
                })
                .collect(),
        )
        .await;
        assert_eq!(sums, vec![2, 2]);
        assert_eq!(transports[0].connection_id(1), Some(ids[0]));
    })
    .await
    .expect("test body timed out");
}

// Goal: a peer whose transport goes away fails the pending ask with a typed error, promptly.
// Method: rank 1 takes an ask and holds it; then rank 1's communicator, link and transport are
// dropped. Rank 0's ask (30 s timeout) must end with LinkClosed well before that; a later ask
// fails at once, and the side-stream opener reports the lost peer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_peer_transport_fails_the_pending_ask() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let ca = ClusterCa::generate("rtx actor-link test cluster").unwrap();
        let mut transports = pair(&ca, ControlPath::default()).await;
        let mut comms: Vec<Communicator> = transports.iter().map(communicator).collect();
        let [(link0, _inbound0), (link1, mut inbound1)] = links(&transports).await;

        // One all_reduce and one answered ask first: the link works.
        let warm = futures_join(
            comms
                .iter()
                .map(|c| {
                    let c = c.clone();
                    tokio::spawn(async move {
                        let mut v = vec![c.rank() as f32; 1000];
                        c.all_reduce(&mut v, ReduceOp::Sum).await.unwrap();
                        v[0] as u64
                    })
                })
                .collect(),
        )
        .await;
        assert_eq!(warm, vec![1, 1]);
        let calc = link0.remote::<Calc>("calc");
        let asked = tokio::spawn({
            let calc = calc.clone();
            async move { calc.ask::<u64>(&Calc::Mix { a: 1, b: 2 }, ASK_TIMEOUT).await }
        });
        let msg = inbound1.recv().await.unwrap();
        msg.reply(&7u64).await.unwrap();
        assert_eq!(asked.await.unwrap().unwrap(), 7);

        // Now an ask rank 1 takes and never answers.
        let pending = tokio::spawn({
            let calc = calc.clone();
            async move {
                let started = tokio::time::Instant::now();
                (calc.ask::<u64>(&Calc::Hold, Duration::from_secs(30)).await, started.elapsed())
            }
        });
        let held = inbound1.recv().await.unwrap();
        assert_eq!(held.decode::<Calc>().unwrap(), Calc::Hold);

        // Rank 1's transport goes away (with its communicator and endpoint). Rank 1's link object
        // stays alive, so only the transport's end can be what fails the ask.
        drop(comms.pop());
        drop((held, inbound1));
        let gone = transports.pop().unwrap();
        // The endpoint's dispatcher lets go of its transport as it winds down.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while Arc::strong_count(&gone) > 1 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(Arc::strong_count(&gone), 1, "nothing else holds rank 1's transport");
        drop(gone);

        let (answer, waited) = pending.await.unwrap();
        assert!(matches!(answer, Err(ActorError::LinkClosed { .. })), "{answer:?}");
        assert!(waited < Duration::from_secs(15), "the loss took {waited:?} to reach the pending ask");
        let again = calc.ask::<u64>(&Calc::Mix { a: 0, b: 0 }, ASK_TIMEOUT).await;
        assert!(matches!(again, Err(ActorError::LinkClosed { .. })), "{again:?}");
        // No link to a lost peer can be opened either.
        let reopened = Link::over_transport(&transports[0], 1, ACTOR_CHANNEL).await;
        assert!(matches!(reopened, Err(ActorError::Connect { .. })), "{reopened:?}");
        // Rank 1's link sees the loss too (its reader task notices asynchronously: wait, bounded),
        // and its keying material is gone with the transport.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while link1.closed_reason().is_none() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(link1.closed_reason().is_some(), "rank 1's link never saw its transport go");
        assert!(link1.export_keying_material(b"test").is_err());
    })
    .await
    .expect("test body timed out");
}

// Goal: a malformed control frame (an envelope whose length is over the cap) is a typed error, not
// a hang or a huge allocation: the receiving link closes with the reason, the sender's pending ask
// fails with LinkClosed, and the control connection stays up for a new link. Method: on the
// control thread path, rank 0 sends a raw length prefix past MAX_ENVELOPE_BYTES with an ask
// pending; then a fresh link is opened and answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_envelope_closes_only_the_link() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let ca = ClusterCa::generate("rtx actor-link test cluster").unwrap();
        let transports = pair(&ca, ControlPath::OwnThread).await;
        let control_ids = (transports[0].connection_id(1).unwrap(), transports[1].connection_id(0).unwrap());
        let [(link0, _inbound0), (link1, mut inbound1)] = links(&transports).await;
        let calc = link0.remote::<Calc>("calc");
        let pending = tokio::spawn({
            let calc = calc.clone();
            async move { calc.ask::<u64>(&Calc::Hold, Duration::from_secs(30)).await }
        });
        let held = inbound1.recv().await.unwrap();
        let oversized = (rtx_actors::MAX_ENVELOPE_BYTES as u32 + 1).to_le_bytes().to_vec();
        link0.raw_send_for_tests(oversized).await.unwrap();
        let reason = tokio::time::timeout(Duration::from_secs(5), link1.closed()).await.unwrap();
        assert!(reason.contains("over the"), "{reason}");
        let answer = tokio::time::timeout(Duration::from_secs(5), pending).await.unwrap().unwrap();
        assert!(matches!(answer, Err(ActorError::LinkClosed { .. })), "{answer:?}");
        assert!(inbound1.recv().await.is_none(), "nothing malformed is delivered");
        drop(held);
        // The control connection is untouched: a new link on it works.
        assert_eq!((transports[0].connection_id(1).unwrap(), transports[1].connection_id(0).unwrap()), control_ids);
        let [(again0, _i0), (_again1, inbound)] = links(&transports).await;
        let server = serve(1, inbound);
        let answer: u64 = again0.remote::<Calc>("calc").ask(&Calc::Mix { a: 2, b: 3 }, ASK_TIMEOUT).await.unwrap();
        assert_eq!(answer, 2004);
        again0.close("done");
        assert_eq!(server.await.unwrap(), 1);
    })
    .await
    .expect("test body timed out");
}

// Goal: an actor served inline (`Link::serve_inline`) answers asks on the link's reader, on the
// control thread, without the inbound receiver: values, handler errors, panics and bodies of the
// wrong type each come back as the right typed answer, the handler survives a panic, tells run it
// too, and after `stop_serving_inline` the name's messages reach the inbound receiver again.
// Method: on the control thread path, rank 1 serves "calc" inline (a shared counter records
// tells); rank 0 asks and tells; rank 1's inbound receiver must stay empty until the handler goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inline_handlers_answer_on_the_reader() {
    tokio::time::timeout(TEST_TIMEOUT, async {
        let ca = ClusterCa::generate("rtx actor-link test cluster").unwrap();
        let transports = pair(&ca, ControlPath::OwnThread).await;
        let [(link0, _inbound0), (link1, mut inbound1)] = links(&transports).await;
        let told = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counter = Arc::clone(&told);
        let control_thread = std::sync::Mutex::new(None);
        link1.serve_inline("calc", move |msg: Calc| {
            *control_thread.lock().unwrap() = std::thread::current().name().map(str::to_string);
            match msg {
                Calc::Mix { a: 0, .. } => panic!("asked to panic"),
                Calc::Mix { a: 1, .. } => Err("asked to fail".to_string()),
                Calc::Mix { a, b } => Ok(a * 1000 + b),
                Calc::Hold => {
                    counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    Ok(0)
                }
            }
        });
        let calc = link0.remote::<Calc>("calc");
        for i in 2..50u64 {
            let answer: u64 = calc.ask(&Calc::Mix { a: i, b: 7 }, ASK_TIMEOUT).await.unwrap();
            assert_eq!(answer, i * 1000 + 7);
        }
        let failed = calc.ask::<u64>(&Calc::Mix { a: 1, b: 0 }, ASK_TIMEOUT).await;
        assert!(matches!(&failed, Err(ActorError::Remote { reason, .. }) if reason == "asked to fail"), "{failed:?}");
        let panicked = calc.ask::<u64>(&Calc::Mix { a: 0, b: 0 }, ASK_TIMEOUT).await;
        assert!(matches!(&panicked, Err(ActorError::Remote { reason, .. }) if reason.contains("asked to panic")), "{panicked:?}");
        // A body that is not a `Calc`: a typed codec error for the caller, not a closed link.
        let wrong = link0.remote::<String>("calc").ask::<u64>(&"not a calc".to_string(), ASK_TIMEOUT).await;
        assert!(matches!(&wrong, Err(ActorError::Remote { .. })), "{wrong:?}");
        // Tells run the handler; the ask after them is answered after them (one reader, in order).
        for _ in 0..3 {
            calc.tell(&Calc::Hold).await.unwrap();
        }
        let answer: u64 = calc.ask(&Calc::Mix { a: 5, b: 5 }, ASK_TIMEOUT).await.unwrap();
        assert_eq!(answer, 5005);
        assert_eq!(told.load(std::sync::atomic::Ordering::SeqCst), 3);
        assert!(inbound1.try_recv().is_err(), "inline messages bypass the inbound receiver");
        // The link survived a panic and errors, and without the handler the inbound receiver
        // gets the name's messages again.
        assert!(link1.stop_serving_inline("calc"));
        assert!(!link1.stop_serving_inline("calc"));
        let server = serve(1, inbound1);
        let answer: u64 = calc.ask(&Calc::Mix { a: 3, b: 4 }, ASK_TIMEOUT).await.unwrap();
        assert_eq!(answer, 3005);
        link0.close("done");
        assert_eq!(server.await.unwrap(), 1);
    })
    .await
    .expect("test body timed out");
}

/// Awaits every task, in order.
async fn futures_join<T>(tasks: Vec<tokio::task::JoinHandle<T>>) -> Vec<T> {
    let mut out = Vec::with_capacity(tasks.len());
    for task in tasks {
        out.push(task.await.unwrap());
    }
    out
}
