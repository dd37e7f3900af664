//! Peer loss: when a rank disappears during a collective, every participant's call returns an
//! error naming the lost rank, promptly; nothing hangs. A silent (alive but absent) peer is caught
//! by the operation timeout instead. Survivors can re-form without the lost rank and go on.
//!
//! Method: in-process worlds on a paused clock; faults injected with `InProcessNetwork::disconnect`
//! or by dropping a rank's communicator (which drops its transport).
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use rtx_collectives::{CommConfig, Error, OpKind, ReduceOp, WORLD_GROUP_ID};

const OP_TIMEOUT: Duration = Duration::from_secs(5);

fn config() -> CommConfig {
    // Tiny frames and the ring, so an all_reduce takes many steps and can be cut in the middle.
    CommConfig { op_timeout: OP_TIMEOUT, chunk_bytes: Some(64), small_message_bytes: 0, ..CommConfig::default() }
}

// Goal: a disconnect during a ring all_reduce fails every survivor with PeerLost naming the rank,
// without waiting for the timeout.
#[tokio::test(start_paused = true)]
async fn disconnect_mid_collective_fails_everyone() {
    let (net, comms) = world(4, config());
    let tasks: Vec<_> = [0, 1, 3]
        .into_iter()
        .map(|r| {
            let c = comms[r].clone();
            tokio::spawn(async move {
                let mut buf = vec![1.0f32; 4096];
                c.all_reduce(&mut buf, ReduceOp::Sum).await
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(10)).await;
    let started = tokio::time::Instant::now();
    net.disconnect(2);
    for t in tasks {
        assert_eq!(t.await.unwrap(), Err(Error::PeerLost { rank: 2, op: OpKind::AllReduce }));
    }
    assert!(started.elapsed() < OP_TIMEOUT);
    // The cut-off rank cannot run collectives either.
    let mut buf = vec![1.0f32; 8];
    assert!(matches!(comms[2].all_reduce(&mut buf, ReduceOp::Sum).await, Err(Error::PeerLost { .. })));
}

// Goal: a rank that crashes (its task aborted, its communicator and transport dropped) in the
// middle of an all_reduce it had joined fails every survivor with PeerLost naming it.
#[tokio::test(start_paused = true)]
async fn crash_mid_collective_fails_everyone() {
    let (_net, mut comms) = world(4, config());
    let tasks: Vec<_> = comms
        .iter()
        .cloned()
        .map(|c| {
            tokio::spawn(async move {
                let mut buf = vec![1.0f32; 1 << 16];
                c.all_reduce(&mut buf, ReduceOp::Sum).await
            })
        })
        .collect();
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
    let mut tasks = tasks.into_iter();
    let (t0, t1, t2, t3) = (tasks.next().unwrap(), tasks.next().unwrap(), tasks.next().unwrap(), tasks.next().unwrap());
    t1.abort();
    assert!(t1.await.unwrap_err().is_cancelled());
    drop(comms.remove(1));
    for t in [t0, t2, t3] {
        assert_eq!(t.await.unwrap(), Err(Error::PeerLost { rank: 1, op: OpKind::AllReduce }));
    }
}

// Goal: once a peer is known lost, new operations on groups containing it fail at once.
#[tokio::test(start_paused = true)]
async fn lost_peer_fails_new_ops_at_once() {
    let (net, comms) = world(3, config());
    net.disconnect(1);
    tokio::time::sleep(Duration::from_millis(1)).await;
    let started = tokio::time::Instant::now();
    let mut buf = vec![0.0f64; 10];
    assert_eq!(comms[0].broadcast(&mut buf, 0).await, Err(Error::PeerLost { rank: 1, op: OpKind::Broadcast }));
    assert_eq!(comms[2].barrier().await, Err(Error::PeerLost { rank: 1, op: OpKind::Barrier }));
    assert_eq!(started.elapsed(), Duration::ZERO);
}

// Goal: a peer that stays connected but never joins is caught by the operation timeout, which
// names the rank that was waited for.
#[tokio::test(start_paused = true)]
async fn silent_peer_times_out() {
    let (_net, comms) = world(3, config());
    let started = tokio::time::Instant::now();
    let out = run_ranks(&comms[..2], |c| async move {
        let mut buf = vec![1.0f32; 100];
        c.all_reduce(&mut buf, ReduceOp::Sum).await
    })
    .await;
    let timeout_ms = OP_TIMEOUT.as_millis() as u64;
    assert_eq!(out[0], Err(Error::Timeout { op: OpKind::AllReduce, waiting_for: 2, timeout_ms }));
    assert!(matches!(out[1], Err(Error::Timeout { .. })));
    assert!(started.elapsed() <= OP_TIMEOUT * 2);
}

// Goal: after a loss, survivors re-form the group without the lost rank at a new generation and
// get correct results (the elastic shrink path).
#[tokio::test(start_paused = true)]
async fn survivors_reform_and_continue() {
    let (net, comms) = world(4, config());
    net.disconnect(3);
    let survivors: Vec<_> = comms[..3].iter().map(|c| c.endpoint().group(WORLD_GROUP_ID, vec![0, 1, 2], 1).unwrap()).collect();
    let out = run_ranks(&survivors, |c| async move {
        let mut buf = vec![(c.rank() + 1) as f32; 777];
        c.all_reduce(&mut buf, ReduceOp::Sum).await.unwrap();
        buf
    })
    .await;
    assert!(out.iter().all(|b| b.iter().all(|&x| x == 6.0)));
    // A group that still contains the lost rank keeps failing fast, even at a new generation.
    let stale = comms[0].endpoint().group(77, vec![0, 3], 1).unwrap();
    assert_eq!(stale.barrier().await, Err(Error::PeerLost { rank: 3, op: OpKind::Barrier }));
}

// Goal: a sender blocked on the full inbox of a rank that is then cut off fails with PeerLost
// instead of waiting for ever. Method: raw transports; rank 1 never reads, rank 0 fills its inbox.
#[tokio::test(start_paused = true)]
async fn blocked_send_to_lost_peer_fails() {
    use rtx_collectives::{InProcessNetwork, PooledBuf, Transport, IN_PROCESS_INBOX_FRAMES};
    let (net, transports) = InProcessNetwork::new(2);
    let mut transports = transports.into_iter();
    let t0 = Arc::new(transports.next().unwrap());
    let _unread_rank1 = transports.next().unwrap();
    for _ in 0..IN_PROCESS_INBOX_FRAMES {
        t0.send(1, PooledBuf::unpooled(vec![0; 8])).await.unwrap();
    }
    let sender = Arc::clone(&t0);
    let blocked = tokio::spawn(async move { sender.send(1, PooledBuf::unpooled(vec![0; 8])).await });
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(!blocked.is_finished(), "the inbox should be full");
    net.disconnect(1);
    let result = tokio::time::timeout(Duration::from_secs(5), blocked).await;
    let result = result.expect("blocked send must end when the peer is lost");
    assert_eq!(result.unwrap(), Err(Error::PeerLost { rank: 1, op: OpKind::Send }));
}

// Goal: a collective whose sends cannot drain (peer alive but not reading) ends with Timeout.
// Method: rank 1 is a raw transport that never reads; rank 0 broadcasts more frames than fit.
#[tokio::test(start_paused = true)]
async fn undrained_send_times_out() {
    use rtx_collectives::{Endpoint, InProcessNetwork, Transport};
    let (_net, transports) = InProcessNetwork::new(2);
    let mut transports = transports.into_iter();
    let t0: Arc<dyn Transport> = Arc::new(transports.next().unwrap());
    let _silent_rank1 = transports.next().unwrap();
    let c0 = Endpoint::new(t0, config()).unwrap().world().unwrap();
    // 64-byte frames: 2000 pieces, more than the inbox holds.
    let mut buf = vec![1.0f32; 16 * 2000];
    let err = c0.broadcast(&mut buf, 0).await.unwrap_err();
    let timeout_ms = OP_TIMEOUT.as_millis() as u64;
    assert_eq!(err, Error::Timeout { op: OpKind::Broadcast, waiting_for: 1, timeout_ms });
}
