//! The simulated collectives wire of a cluster: one [`SimNetwork`] per generation, as production
//! binds one QUIC endpoint per generation. A node's [`SlotWire`] implements the supervisor's
//! `GenerationWire`: `bind` records which node slot holds which rank, `connect` hands out that
//! rank's [`SimTransport`] (the network is made by the first member to connect, with a seed
//! derived from the master seed and the generation). Faults are addressed by node slot and
//! mapped to ranks: a crash crashes the slot's rank in every generation, a cut between two slots
//! (kept until healed) applies to every generation both are in, now and later. A stall (a member
//! stuck in a collective) applies to the generations the slot is in when it starts (the
//! collective it is stuck in), including one it was prepared for but has not connected yet, until
//! it ends or the transport is aborted; later generations are not stuck.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rtx_collectives::{BoxFuture, Transport};
use rtx_supervisor::{GenerationWire, SupervisorError};

use crate::network::{LinkModel, SimConfig, SimNetwork, SimTransport};
use crate::trace::TraceHash;

/// The collectives networks of a simulated cluster; clone it to inject faults.
#[derive(Clone)]
pub struct ClusterWire {
    shared: Arc<Mutex<State>>,
}

/// One node slot's view of the [`ClusterWire`].
pub struct SlotWire {
    slot: usize,
    wire: ClusterWire,
}

struct State {
    seed: u64,
    config: SimConfig,
    generations: BTreeMap<u64, Generation>,
    /// Cut links `(from, to, symmetric)` between slots (a symmetric cut is stored once).
    cuts: BTreeSet<(usize, usize, bool)>,
    slow: BTreeMap<usize, Duration>,
}

struct Generation {
    world: usize,
    slots: BTreeMap<usize, usize>,
    /// Slots stalled in this generation.
    stalled: BTreeSet<usize>,
    net: Option<SimNetwork>,
    transports: Vec<Option<SimTransport>>,
}

impl ClusterWire {
    /// Collectives networks whose seeds derive from `seed`, each link modelled by `config.link`.
    pub fn new(seed: u64, config: SimConfig) -> ClusterWire {
        let state = State { seed, config, generations: BTreeMap::new(), cuts: BTreeSet::new(), slow: BTreeMap::new() };
        ClusterWire { shared: Arc::new(Mutex::new(state)) }
    }

    /// Node slot `slot`'s wire.
    pub fn slot(&self, slot: usize) -> Arc<SlotWire> {
        Arc::new(SlotWire { slot, wire: self.clone() })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The slot's process died: its rank in every generation stops at once.
    pub fn crash(&self, slot: usize) {
        let state = self.lock();
        for g in state.generations.values() {
            if let (Some(net), Some(rank)) = (&g.net, rank_of(g, slot)) {
                net.crash(rank);
            }
        }
    }

    /// Cuts the collectives link from slot `a` to slot `b` (with `symmetric`, both ways) until
    /// [`heal`](Self::heal), in this and later generations.
    pub fn cut(&self, a: usize, b: usize, symmetric: bool) {
        let mut state = self.lock();
        let key = if symmetric { (a.min(b), a.max(b), true) } else { (a, b, false) };
        state.cuts.insert(key);
        for g in state.generations.values() {
            if let (Some(net), Some(ra), Some(rb)) = (&g.net, rank_of(g, a), rank_of(g, b)) {
                net.partition(ra, rb, symmetric);
            }
        }
    }

    /// Heals a [`cut`](Self::cut).
    pub fn heal(&self, a: usize, b: usize) {
        let mut state = self.lock();
        state.cuts.retain(|&(x, y, _)| (x, y) != (a, b) && (x, y) != (b, a));
        for g in state.generations.values() {
            if let (Some(net), Some(ra), Some(rb)) = (&g.net, rank_of(g, a), rank_of(g, b)) {
                net.heal(ra, rb);
            }
        }
    }

    /// Adds `delay` to every collectives link to and from `slot`, now and in later generations.
    pub fn slow(&self, slot: usize, delay: Duration) {
        let mut state = self.lock();
        state.slow.insert(slot, delay);
        let base = state.config.link;
        for g in state.generations.values() {
            if let Some(net) = &g.net {
                apply_slow(net, g, &state.slow, base);
            }
        }
    }

    /// Stalls `slot` (its compute is stuck in a collective) in every generation it is in now; see
    /// [`SimNetwork::stall`]. Returns how many generations that was.
    pub fn stall(&self, slot: usize) -> usize {
        let mut state = self.lock();
        let mut hit = 0;
        for g in state.generations.values_mut() {
            if let Some(rank) = rank_of(g, slot) {
                g.stalled.insert(slot);
                hit += 1;
                if let Some(net) = &g.net {
                    net.stall(rank);
                }
            }
        }
        hit
    }

    /// Ends a [`stall`](Self::stall) of `slot`.
    pub fn unstall(&self, slot: usize) {
        let mut state = self.lock();
        for g in state.generations.values_mut() {
            if g.stalled.remove(&slot) {
                if let (Some(net), Some(rank)) = (&g.net, rank_of(g, slot)) {
                    net.unstall(rank);
                }
            }
        }
    }

    /// Frames delivered on a generation's network that named another generation.
    pub fn foreign_generation_frames(&self) -> u64 {
        self.lock().generations.values().filter_map(|g| g.net.as_ref()).map(SimNetwork::foreign_generation_frames).sum()
    }

    /// Frames delivered, over all generations.
    pub fn delivered(&self) -> u64 {
        self.lock().generations.values().filter_map(|g| g.net.as_ref()).map(SimNetwork::delivered).sum()
    }

    /// The traces of every generation's network, in generation order.
    pub fn trace(&self) -> TraceHash {
        let mut trace = TraceHash::default();
        for (generation, g) in &self.lock().generations {
            trace.absorb_u64(*generation);
            if let Some(net) = &g.net {
                trace.absorb_u64(net.trace().value());
            }
        }
        trace
    }
}

fn rank_of(g: &Generation, slot: usize) -> Option<usize> {
    g.slots.iter().find(|(_, s)| **s == slot).map(|(r, _)| *r)
}

fn apply_slow(net: &SimNetwork, g: &Generation, slow: &BTreeMap<usize, Duration>, base: LinkModel) {
    for (&rank, slot) in &g.slots {
        if let Some(delay) = slow.get(slot) {
            let model = LinkModel { latency: base.latency + *delay, ..base };
            for peer in 0..g.world {
                if peer != rank {
                    net.set_link(rank, peer, model);
                    net.set_link(peer, rank, model);
                }
            }
        }
    }
}

impl GenerationWire for SlotWire {
    fn bind(&self, _node: u64, generation: u64, rank: usize, world: usize) -> rtx_supervisor::Result<String> {
        let mut state = self.wire.lock();
        let g = state.generations.entry(generation).or_insert_with(|| Generation { world, slots: BTreeMap::new(), stalled: BTreeSet::new(), net: None, transports: Vec::new() });
        if g.world != world || rank >= world {
            return Err(SupervisorError::Job(format!("simulated wire: rank {rank} of {world} in generation {generation} of {} ranks", g.world)));
        }
        g.slots.insert(rank, self.slot);
        Ok(format!("sim-slot-{}", self.slot))
    }

    fn connect(&self, _node: u64, generation: u64, rank: usize, addrs: &[String]) -> BoxFuture<'_, rtx_supervisor::Result<Arc<dyn Transport>>> {
        let world = addrs.len();
        Box::pin(async move {
            let mut state = self.wire.lock();
            let State { seed, config, generations, cuts, slow } = &mut *state;
            let g = generations.get_mut(&generation).ok_or_else(|| SupervisorError::Job(format!("simulated wire: generation {generation} was never bound")))?;
            if g.world != world {
                return Err(SupervisorError::Job(format!("simulated wire: {world} addresses for a generation of {}", g.world)));
            }
            if g.net.is_none() {
                let net_config = SimConfig { seed: derive(*seed, generation), ..config.clone() };
                let (net, transports) = SimNetwork::new(world, net_config);
                net.expect_generation(generation);
                for &(a, b, symmetric) in cuts.iter() {
                    if let (Some(ra), Some(rb)) = (rank_of(g, a), rank_of(g, b)) {
                        net.partition(ra, rb, symmetric);
                    }
                }
                apply_slow(&net, g, slow, config.link);
                for slot in &g.stalled {
                    if let Some(rank) = rank_of(g, *slot) {
                        net.stall(rank);
                    }
                }
                g.transports = transports.into_iter().map(Some).collect();
                g.net = Some(net);
            }
            let transport = g
                .transports
                .get_mut(rank)
                .and_then(Option::take)
                .ok_or_else(|| SupervisorError::Job(format!("simulated wire: rank {rank} of generation {generation} connected twice")))?;
            Ok(Arc::new(transport) as Arc<dyn Transport>)
        })
    }
}

/// A stream seed from the master seed and a tag (SplitMix64 over both).
pub(crate) fn derive(seed: u64, tag: u64) -> u64 {
    let mut z = seed ^ tag.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49eb_133b_a133);
    z ^ (z >> 31)
}
