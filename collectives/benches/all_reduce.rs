//! All-reduce bandwidth of two ranks over each transport, next to a memcpy of the same size
//! measured in the same run (the physical limit on one machine). With two ranks, algorithm
//! bandwidth equals bus bandwidth (`2(n-1)/n = 1`), so criterion's bytes/s are directly comparable
//! with Gloo's busbw in DESIGN.md.
//!
//! Both ranks run in this process (each transport's own threads and tasks, one tokio runtime), so
//! this is a quick regression check; the numbers to quote come from `rtx bench collectives`, which
//! runs every rank as its own process next to Gloo and the memcpy/TCP/quinn limits.
//!
//! Run: `cargo bench -p rtx-collectives --bench all_reduce`.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rtx_collectives::{
    ClusterCa, CommConfig, Communicator, Endpoint, InProcessNetwork, QuicOptions, QuicTransport, ReduceOp, ShmOptions, ShmTransport, Transport,
};

const SIZES: [usize; 3] = [4 << 10, 1 << 20, 16 << 20];

fn comms(transports: Vec<Arc<dyn Transport>>) -> Vec<Communicator> {
    transports.into_iter().map(|t| Endpoint::new(t, CommConfig::default()).unwrap().world().unwrap()).collect()
}

async fn in_process() -> Vec<Communicator> {
    let (_net, ts) = InProcessNetwork::new(2);
    comms(ts.into_iter().map(|t| Arc::new(t) as Arc<dyn Transport>).collect())
}

async fn shm() -> Vec<Communicator> {
    let job = format!("bench-{}", std::process::id());
    let options = ShmOptions { job, ..ShmOptions::default() };
    let (a, b) = tokio::join!(ShmTransport::connect(0, 2, options.clone()), ShmTransport::connect(1, 2, options));
    comms(vec![Arc::new(a.unwrap()), Arc::new(b.unwrap())])
}

async fn quic() -> Vec<Communicator> {
    let ca = ClusterCa::generate("bench").unwrap();
    let loopback: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let ts: Vec<Arc<QuicTransport>> =
        (0..2).map(|r| Arc::new(QuicTransport::bind(&ca.issue(r).unwrap(), 2, loopback, QuicOptions::default()).unwrap())).collect();
    let addrs: Vec<SocketAddr> = ts.iter().map(|t| t.local_addr().unwrap()).collect();
    let (a, b) = tokio::join!(ts[0].connect(&addrs), ts[1].connect(&addrs));
    a.unwrap();
    b.unwrap();
    comms(ts.into_iter().map(|t| t as Arc<dyn Transport>).collect())
}

/// Time of `iters` all-reduces of `bytes` on every rank, concurrently.
async fn run(comms: &[Communicator], bytes: usize, iters: u64) -> Duration {
    let start = Instant::now();
    let tasks: Vec<_> = comms
        .iter()
        .cloned()
        .map(|c| {
            tokio::spawn(async move {
                let mut buf = vec![1.0f32; bytes / 4];
                for _ in 0..iters {
                    c.all_reduce(&mut buf, ReduceOp::Sum).await.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    start.elapsed()
}

fn all_reduce(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let worlds = [("in_process", rt.block_on(in_process())), ("shm", rt.block_on(shm())), ("quic", rt.block_on(quic()))];
    let mut group = c.benchmark_group("all_reduce_f32_2_ranks");
    group.sample_size(10).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3));
    for bytes in SIZES {
        group.throughput(Throughput::Bytes(bytes as u64));
        let src = vec![1u8; bytes];
        let mut dst = vec![0u8; bytes];
        group.bench_function(BenchmarkId::new("memcpy", bytes), |b| {
            b.iter(|| {
                dst.copy_from_slice(std::hint::black_box(&src));
                std::hint::black_box(&dst);
            })
        });
        for (name, comms) in &worlds {
            group.bench_function(BenchmarkId::new(*name, bytes), |b| b.iter_custom(|iters| rt.block_on(run(comms, bytes, iters))));
        }
    }
    group.finish();
}

criterion_group!(benches, all_reduce);
criterion_main!(benches);
