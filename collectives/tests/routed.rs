//! `RoutedTransport`: a world of 2 "hosts" x 2 ranks whose host-internal frames go over shared
//! memory and whose cross-host frames go over QUIC (real loopback sockets, mutual TLS), with the
//! host map making `all_reduce` hierarchical. Checks exact results on the small and large paths,
//! that QUIC links only ranks of other hosts, that local ranks are renamed to global ones (frames,
//! peer loss and errors) in both delivery modes, and that impossible layouts are refused.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use rtx_collectives::{
    AllReduceAlgorithm, ClusterCa, CommConfig, Communicator, Endpoint, Error, InProcessNetwork, QuicOptions, QuicTransport, ReduceOp, RoutedTransport,
    ShmOptions, Transport,
};

const HOSTS: [u32; 4] = [0, 0, 1, 1];

fn config() -> CommConfig {
    CommConfig { host_of: HOSTS.to_vec(), op_timeout: Duration::from_secs(30), chunk_bytes: Some(64 << 10), ..CommConfig::default() }
}

fn same_host(rank: usize) -> Vec<usize> {
    (0..HOSTS.len()).filter(|&r| HOSTS[r] == HOSTS[rank]).collect()
}

/// Four ranks in this process: shared memory per host (its own job name), QUIC between hosts.
async fn routed_world(job: &str) -> (Vec<Communicator>, Vec<Arc<QuicTransport>>) {
    let ca = ClusterCa::generate("routed test").unwrap();
    let listen = "127.0.0.1:0".parse().unwrap();
    let quic: Vec<Arc<QuicTransport>> =
        (0..4).map(|r| Arc::new(QuicTransport::bind(&ca.issue(r).unwrap(), 4, listen, QuicOptions::default()).unwrap())).collect();
    let addrs: Vec<_> = quic.iter().map(|q| q.local_addr().unwrap()).collect();
    let mut tasks = tokio::task::JoinSet::new();
    for (rank, q) in quic.iter().enumerate() {
        let (q, addrs, job) = (Arc::clone(q), addrs.clone(), job.to_string());
        tasks.spawn(async move {
            let options = ShmOptions { job, connect_timeout: Duration::from_secs(30), ..ShmOptions::default() };
            let routed = RoutedTransport::connect_over_quic(q, &addrs, &HOSTS, options).await.unwrap();
            assert_eq!(routed.local_ranks(), same_host(rank).as_slice());
            let routed: Arc<dyn Transport> = Arc::new(routed);
            (rank, Endpoint::new(routed, config()).unwrap().world().unwrap())
        });
    }
    let mut comms: Vec<Option<Communicator>> = vec![None, None, None, None];
    while let Some(done) = tasks.join_next().await {
        let (rank, comm) = done.unwrap();
        comms[rank] = Some(comm);
    }
    (comms.into_iter().map(Option::unwrap).collect(), quic)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn routed_world_all_reduces_hierarchically_over_shm_and_quic() {
    let seed = seed();
    let job = format!("rtx-routed-{}", std::process::id());
    let (comms, quic) = tokio::time::timeout(TEST_TIMEOUT, routed_world(&job)).await.unwrap();
    // QUIC links only the other host's ranks.
    for (rank, q) in quic.iter().enumerate() {
        let expected: Vec<usize> = (0..4).filter(|&r| HOSTS[r] != HOSTS[rank]).collect();
        assert_eq!(q.connected_peers(), expected, "rank {rank}'s QUIC links");
    }
    // Small (doubling among leaders) and large (ring among leaders, chain inside hosts) paths.
    for (case, len) in [(0u64, 1000usize), (1, 300_000)] {
        assert!(matches!(comms[0].all_reduce_algorithm(len * 4), AllReduceAlgorithm::Hierarchical), "{len} floats");
        let inputs = exact_inputs::<f32>(seed, case, 4, len);
        let expected = reference(ReduceOp::Sum, &inputs);
        let results = run_ranks(&comms, |c| {
            let mut buf = inputs[c.rank()].clone();
            async move {
                c.all_reduce(&mut buf, ReduceOp::Sum).await.unwrap();
                buf
            }
        })
        .await;
        for (rank, got) in results.iter().enumerate() {
            assert!(got == &expected, "rank {rank}, {len} floats: routed hierarchical all_reduce differs from the reference (seed {seed})");
        }
    }
}

/// In-process halves (pull delivery): hosts {0, 1} and {2, 3}.
fn in_process_routed() -> (InProcessNetwork, Vec<InProcessNetwork>, Vec<Communicator>) {
    let (network, net_transports) = InProcessNetwork::new(4);
    let (host0, local0) = InProcessNetwork::new(2);
    let (host1, local1) = InProcessNetwork::new(2);
    let comms = net_transports
        .into_iter()
        .zip(local0.into_iter().chain(local1))
        .enumerate()
        .map(|(rank, (net, local))| {
            let routed = RoutedTransport::new(Arc::new(net), Arc::new(local), same_host(rank)).unwrap();
            Endpoint::new(Arc::new(routed), config()).unwrap().world().unwrap()
        })
        .collect();
    (network, vec![host0, host1], comms)
}

#[tokio::test]
async fn routed_pull_delivery_renames_local_ranks() {
    let seed = seed();
    let (_network, _hosts, comms) = in_process_routed();
    let inputs = exact_inputs::<f32>(seed, 7, 4, 50_000);
    let expected = reference(ReduceOp::Max, &inputs);
    let results = run_ranks(&comms, |c| {
        let mut buf = inputs[c.rank()].clone();
        async move {
            c.all_reduce(&mut buf, ReduceOp::Max).await.unwrap();
            let mut gathered = vec![0u32; 4];
            gathered[c.rank()] = c.rank() as u32 * 10;
            c.all_gather_in_place(&mut gathered).await.unwrap();
            (buf, gathered)
        }
    })
    .await;
    for (rank, (buf, gathered)) in results.iter().enumerate() {
        assert!(buf == &expected, "rank {rank}: all_reduce over in-process halves (seed {seed})");
        assert_eq!(gathered, &vec![0, 10, 20, 30], "rank {rank}: frames from local ranks carry their global rank");
    }
}

#[tokio::test]
async fn routed_local_peer_loss_names_the_global_rank() {
    let (_network, hosts, comms) = in_process_routed();
    // Host 1's second rank (global 3) vanishes from its host's local transport.
    hosts[1].disconnect(1);
    let mut buf = vec![1.0f32; 1000];
    let result = tokio::time::timeout(TEST_TIMEOUT, comms[2].all_reduce(&mut buf, ReduceOp::Sum)).await.unwrap();
    match result {
        Err(Error::PeerLost { rank, .. }) => assert_eq!(rank, 3, "the lost local peer is named by its global rank"),
        other => panic!("expected PeerLost of rank 3, got {other:?}"),
    }
}

#[test]
fn routed_refuses_impossible_layouts() {
    let transports = || {
        let (_n, mut net) = InProcessNetwork::new(4);
        let (_l, mut local) = InProcessNetwork::new(2);
        let network: Arc<dyn Transport> = Arc::new(net.remove(2));
        let local: Arc<dyn Transport> = Arc::new(local.remove(0));
        (network, local)
    };
    let cases: [(&[usize], &str); 4] =
        [(&[2, 3, 1], "one rank per local rank"), (&[2, 9], "outside the world"), (&[2, 2], "listed twice"), (&[3, 2], "not this rank")];
    for (local_ranks, why) in cases {
        let (network, local) = transports();
        match RoutedTransport::new(network, local, local_ranks.to_vec()) {
            Err(Error::InvalidConfig { reason }) => assert!(reason.contains(why), "{local_ranks:?}: {reason}"),
            other => panic!("{local_ranks:?} must be refused ({why}), got {other:?}"),
        }
    }
}

#[tokio::test]
async fn connecting_with_a_host_map_that_misses_ranks_is_a_typed_error() {
    // Goal: a host map that does not name every rank is refused before any ring or link is made.
    let ca = ClusterCa::generate("routed host map").unwrap();
    let quic = Arc::new(QuicTransport::bind(&ca.issue(0).unwrap(), 4, "127.0.0.1:0".parse().unwrap(), QuicOptions::default()).unwrap());
    let addrs = vec![quic.local_addr().unwrap(); 4];
    let options = ShmOptions { job: format!("routed-hostmap-{}", std::process::id()), ..ShmOptions::default() };
    match RoutedTransport::connect_over_quic(quic, &addrs, &[0, 0, 1], options).await {
        Err(Error::InvalidConfig { reason }) => assert!(reason.contains("host map"), "{reason}"),
        other => panic!("expected InvalidConfig, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn quic_refuses_impossible_network_datagrams() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let _in_runtime = rt.enter();
    let ca = ClusterCa::generate("datagram test").unwrap();
    let listen = "127.0.0.1:0".parse().unwrap();
    for bytes in [0u16, 1199, 65_488] {
        let options = QuicOptions { network_datagram_bytes: bytes, ..QuicOptions::default() };
        match QuicTransport::bind(&ca.issue(0).unwrap(), 2, listen, options) {
            Err(Error::InvalidConfig { reason }) => assert!(reason.contains("network_datagram_bytes"), "{bytes}: {reason}"),
            other => panic!("network_datagram_bytes {bytes} must be refused, got {other:?}"),
        }
    }
    // 8952 (a 9000-byte MTU) is a valid setting.
    let options = QuicOptions { network_datagram_bytes: 8952, ..QuicOptions::default() };
    QuicTransport::bind(&ca.issue(0).unwrap(), 2, listen, options).unwrap();
}
