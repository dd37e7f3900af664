//! The simulated control network: the supervisor↔node links of a simulated cluster. Each link is
//! a real [`rtx_actors::Link`] (the production envelope protocol) over in-memory byte streams,
//! made by [`Link::over_stream`]; between the two ends, one pump task per direction carries the
//! bytes with a seeded latency (plus a node's straggler delay), holds them while the node is
//! isolated (a partition or a hang: nothing is lost, as QUIC would retransmit), and closes the
//! connection when the node stays isolated past [`ControlConfig::idle_timeout`], as QUIC's idle
//! timeout would. Every chunk delivered is folded into the trace.
//!
//! Ownership: [`ControlNet`] holds the shared state behind one mutex (rng, isolation, delays,
//! open connections by node slot, trace); pumps take it only between awaits.
//!
//! Determinism: pumps wait on plain `Notify`s, never on `tokio::sync::watch`, whose receivers
//! register on one of several internal notifiers picked at random (their wake order would change
//! from run to run).

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rtx_actors::{Accepted, Inbound, Link, LinkListener, StreamConn};
use rtx_collectives::BoxFuture;
use rtx_supervisor::ControlDialer;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;

use crate::trace::TraceHash;

/// Bytes buffered inside one in-memory pipe.
const PIPE_BYTES: usize = 1 << 20;
/// Largest chunk a pump moves at once.
const CHUNK_BYTES: usize = 64 * 1024;
/// Links waiting to be accepted by the supervisor.
const ACCEPT_QUEUE: usize = 64;

/// Timing of the control network.
#[derive(Clone, Debug, PartialEq)]
pub struct ControlConfig {
    /// The seed of the latency draws.
    pub seed: u64,
    /// One-way latency.
    pub latency: Duration,
    /// Extra latency drawn uniformly from `0..=jitter` per chunk.
    pub jitter: Duration,
    /// A node isolated this long loses its connections (QUIC idle timeout).
    pub idle_timeout: Duration,
}

/// The control network; clone it to inject faults.
#[derive(Clone)]
pub struct ControlNet {
    shared: Arc<Shared>,
}

/// Dials the supervisor as one node slot.
pub struct SlotDialer {
    slot: usize,
    net: ControlNet,
}

struct Shared {
    config: ControlConfig,
    accept: mpsc::Sender<Accepted>,
    state: Mutex<State>,
    /// Notified whenever isolation ends, so held pumps look again.
    changed: Notify,
}

struct State {
    rng: ChaCha8Rng,
    isolated: BTreeMap<usize, u64>,
    delay: BTreeMap<usize, Duration>,
    conns: BTreeMap<usize, Vec<Arc<SimConn>>>,
    next_conn: u64,
    trace: TraceHash,
    epoch: Instant,
    isolation_epoch: u64,
}

/// One simulated connection: both ends share it.
struct SimConn {
    id: u64,
    slot: usize,
    closed: std::sync::atomic::AtomicBool,
    on_close: Notify,
}

impl SimConn {
    fn is_closed(&self) -> bool {
        self.closed.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Returns once the connection is closed.
    async fn wait_closed(&self) {
        loop {
            let notified = self.on_close.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_closed() {
                return;
            }
            notified.await;
        }
    }
}

impl StreamConn for SimConn {
    fn close(&self, _reason: &str) {
        self.closed.store(true, std::sync::atomic::Ordering::Release);
        self.on_close.notify_waiters();
    }

    fn export_keying_material(&self, label: &[u8]) -> [u8; 32] {
        // Both ends share this connection object; nobody else can reach it.
        let mut out = [0u8; 32];
        for (i, chunk) in out.chunks_mut(8).enumerate() {
            let mut h = TraceHash::default();
            h.absorb_u64(self.id);
            h.absorb_u64(i as u64);
            h.absorb(label);
            chunk.copy_from_slice(&h.value().to_le_bytes());
        }
        out
    }

    fn remote_address(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::new(10, 0, (self.slot / 250) as u8, (self.slot % 250) as u8 + 1), 1))
    }
}

impl ControlNet {
    /// A control network and the supervisor's listener (call inside the simulation runtime).
    pub fn new(config: ControlConfig) -> (ControlNet, LinkListener) {
        let (listener, accept) = LinkListener::channel(SocketAddr::from((Ipv4Addr::new(10, 255, 0, 1), 29500)), ACCEPT_QUEUE);
        let state = State {
            rng: ChaCha8Rng::seed_from_u64(config.seed),
            isolated: BTreeMap::new(),
            delay: BTreeMap::new(),
            conns: BTreeMap::new(),
            next_conn: 1,
            trace: TraceHash::default(),
            epoch: Instant::now(),
            isolation_epoch: 0,
        };
        let shared = Arc::new(Shared { config, accept, state: Mutex::new(state), changed: Notify::new() });
        (ControlNet { shared }, listener)
    }

    /// The dialer of node slot `slot`.
    pub fn dialer(&self, slot: usize) -> Arc<SlotDialer> {
        Arc::new(SlotDialer { slot, net: self.clone() })
    }

    /// Holds every byte to and from `slot` until [`reconnect`](Self::reconnect); after
    /// `idle_timeout` of it, the slot's connections close.
    pub fn isolate(&self, slot: usize) {
        let epoch = {
            let mut state = self.shared.lock();
            state.isolation_epoch += 1;
            let epoch = state.isolation_epoch;
            state.isolated.insert(slot, epoch);
            state.trace.absorb(b"isolate");
            state.trace.absorb_u64(slot as u64);
            epoch
        };
        let shared = Arc::clone(&self.shared);
        tokio::spawn(async move {
            tokio::time::sleep(shared.config.idle_timeout).await;
            let conns = {
                let state = shared.lock();
                if state.isolated.get(&slot) != Some(&epoch) {
                    return;
                }
                state.conns.get(&slot).cloned().unwrap_or_default()
            };
            for conn in conns {
                conn.close("idle timeout");
            }
        });
    }

    /// Ends an isolation: held bytes flow again.
    pub fn reconnect(&self, slot: usize) {
        {
            let mut state = self.shared.lock();
            state.isolated.remove(&slot);
            state.trace.absorb(b"reconnect");
            state.trace.absorb_u64(slot as u64);
        }
        self.shared.changed.notify_waiters();
    }

    /// Adds `delay` to every chunk to and from `slot` (a straggler).
    pub fn slow(&self, slot: usize, delay: Duration) {
        self.shared.lock().delay.insert(slot, delay);
    }

    /// Closes every connection of `slot` at once (its process died).
    pub fn kill(&self, slot: usize) {
        let conns = {
            let mut state = self.shared.lock();
            state.isolated.remove(&slot);
            state.trace.absorb(b"kill");
            state.trace.absorb_u64(slot as u64);
            state.conns.remove(&slot).unwrap_or_default()
        };
        for conn in conns {
            conn.close("process killed");
        }
    }

    /// The trace of everything the control network carried.
    pub fn trace(&self) -> TraceHash {
        self.shared.lock().trace
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl ControlDialer for SlotDialer {
    fn dial(&self) -> BoxFuture<'_, rtx_supervisor::Result<(Link, mpsc::Receiver<Inbound>)>> {
        Box::pin(async move {
            let shared = &self.net.shared;
            let conn = {
                let mut state = shared.lock();
                let id = state.next_conn;
                state.next_conn += 1;
                let conn = Arc::new(SimConn { id, slot: self.slot, closed: std::sync::atomic::AtomicBool::new(false), on_close: Notify::new() });
                state.conns.entry(self.slot).or_default().push(Arc::clone(&conn));
                conn
            };
            // node writes → up_in ... pump ... up_out → supervisor reads; and the reverse.
            let (node_w, up_in) = tokio::io::duplex(PIPE_BYTES);
            let (up_out, sup_r) = tokio::io::duplex(PIPE_BYTES);
            let (sup_w, down_in) = tokio::io::duplex(PIPE_BYTES);
            let (down_out, node_r) = tokio::io::duplex(PIPE_BYTES);
            tokio::spawn(pump(Arc::clone(shared), Arc::clone(&conn), true, up_in, up_out));
            tokio::spawn(pump(Arc::clone(shared), Arc::clone(&conn), false, down_in, down_out));
            let node_name = format!("sim-node-{}", self.slot);
            let (sup_link, sup_inbound) = Link::over_stream(node_name, Arc::clone(&conn) as Arc<dyn StreamConn>, sup_r, sup_w);
            shared
                .accept
                .send((sup_link, sup_inbound))
                .await
                .map_err(|_| rtx_supervisor::SupervisorError::SupervisorLost { reason: "the simulated supervisor stopped accepting".into() })?;
            Ok(Link::over_stream("sim-supervisor".into(), conn as Arc<dyn StreamConn>, node_r, node_w))
        })
    }
}

/// Carries one direction of one connection.
async fn pump(shared: Arc<Shared>, conn: Arc<SimConn>, up: bool, mut from: DuplexStream, mut to: DuplexStream) {
    let mut last = Instant::now();
    let mut buf = vec![0u8; CHUNK_BYTES];
    loop {
        let n = tokio::select! {
            biased;
            () = conn.wait_closed() => break,
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            },
        };
        let at = {
            let mut state = shared.lock();
            let jitter_ns = shared.config.jitter.as_nanos() as u64;
            let jitter = if jitter_ns > 0 { Duration::from_nanos(state.rng.random_range(0..=jitter_ns)) } else { Duration::ZERO };
            let extra = state.delay.get(&conn.slot).copied().unwrap_or_default();
            (Instant::now() + shared.config.latency + jitter + extra).max(last)
        };
        last = at;
        tokio::select! {
            biased;
            () = conn.wait_closed() => break,
            () = tokio::time::sleep_until(at) => {}
        }
        // Held while the node is cut off.
        loop {
            let changed = shared.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if !shared.lock().isolated.contains_key(&conn.slot) {
                break;
            }
            tokio::select! {
                biased;
                () = conn.wait_closed() => return,
                () = changed => {}
            }
        }
        {
            let mut state = shared.lock();
            let t = Instant::now().duration_since(state.epoch).as_nanos() as u64;
            state.trace.absorb_u64(t);
            state.trace.absorb_u64(conn.id * 2 + u64::from(up));
            state.trace.absorb(&buf[..n]);
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    conn.close("pump ended");
    let _ = to.shutdown().await;
}
