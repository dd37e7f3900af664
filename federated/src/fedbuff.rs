//! The asynchronous mode (FedBuff, Nguyen et al. 2022), in virtual time: `concurrency` clients
//! train at once, each on the model version current when it was launched; arrivals are taken in
//! (virtual finish time, launch number) order, and every `buffer_size` accepted arrivals make one
//! server step. An update more than `max_staleness` versions old is rejected; the others are
//! down-weighted by their staleness (`1/sqrt(1 + s)` or constant). Every finished, dropped or
//! rejected client is replaced by a fresh launch, so the pipeline stays full.
//!
//! Only the last `max_staleness + 1` model versions are kept; client launches, fates and latencies
//! are pure functions of the seed and the launch number, so a run replays bit for bit.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use crate::availability::{drops_out, latency_ms, AvailabilityTrace};
use crate::config::{AsyncConfig, FedConfig, StalenessWeighting};
use crate::population::{splitmix64, Population};

/// Bound on events handled per server step, in multiples of the buffer size, so a population that
/// almost never answers cannot spin forever; the step then applies what arrived.
pub const MAX_EVENTS_PER_UPDATE: u64 = 64;
/// Attempts to find a free, online client for a launch before the slot stays empty for now.
pub const LAUNCH_ATTEMPTS: u64 = 64;

/// One launched client, ordered by finish time then launch number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Event {
    finish_us: u64,
    seq: u64,
    client: u32,
    version: u32,
    fate: Fate,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Fate {
    Arrives,
    Dropped,
    Straggler,
}

/// An accepted arrival: who, trained on which version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Arrival {
    pub(crate) client: u32,
    pub(crate) version: u32,
}

/// What one server step's events were.
#[derive(Debug, Default)]
pub(crate) struct Arrivals {
    pub(crate) accepted: Vec<Arrival>,
    pub(crate) dropped: u64,
    pub(crate) stragglers: u64,
    pub(crate) stale: u64,
    pub(crate) handled: u64,
}

/// The server side of the asynchronous mode.
#[derive(Debug)]
pub(crate) struct AsyncState {
    buffer_size: usize,
    max_staleness: u32,
    concurrency: usize,
    weighting: StalenessWeighting,
    pub(crate) server_lr: f32,
    version: u32,
    models: VecDeque<(u32, Vec<f32>)>,
    events: BinaryHeap<Reverse<Event>>,
    clock_us: u64,
    in_flight: Vec<u64>,
    launches: u64,
    started: bool,
}

impl AsyncState {
    pub(crate) fn new(a: &AsyncConfig, config: &FedConfig, initial: &[f32]) -> Self {
        let n = config.population.n_clients as usize;
        AsyncState {
            buffer_size: a.buffer_size,
            max_staleness: a.max_staleness,
            concurrency: a.concurrency,
            weighting: a.staleness,
            server_lr: a.server_lr,
            version: 0,
            models: VecDeque::from([(0, initial.to_vec())]),
            events: BinaryHeap::new(),
            clock_us: 0,
            in_flight: vec![0; n.div_ceil(64)],
            launches: 0,
            started: false,
        }
    }

    /// Handles events until `buffer_size` updates are accepted (or the step's event bound).
    pub(crate) fn collect_arrivals(&mut self, config: &FedConfig, pop: &Population, trace: Option<&AvailabilityTrace>) -> Arrivals {
        if !self.started {
            self.started = true;
            for _ in 0..self.concurrency {
                self.launch(config, pop, trace);
            }
        }
        let mut out = Arrivals::default();
        let bound = MAX_EVENTS_PER_UPDATE * self.buffer_size as u64 + self.concurrency as u64;
        while out.accepted.len() < self.buffer_size && out.handled < bound {
            let Some(Reverse(ev)) = self.events.pop() else { break };
            out.handled += 1;
            self.clock_us = self.clock_us.max(ev.finish_us);
            self.in_flight[ev.client as usize / 64] &= !(1u64 << (ev.client % 64));
            match ev.fate {
                Fate::Dropped => out.dropped += 1,
                Fate::Straggler => out.stragglers += 1,
                Fate::Arrives if self.version - ev.version > self.max_staleness => out.stale += 1,
                Fate::Arrives => out.accepted.push(Arrival { client: ev.client, version: ev.version }),
            }
            self.launch(config, pop, trace);
        }
        out
    }

    /// The down-weighting of an update trained on `version`.
    pub(crate) fn staleness_factor(&self, version: u32) -> f32 {
        let s = self.version.saturating_sub(version);
        match self.weighting {
            StalenessWeighting::Constant => 1.0,
            StalenessWeighting::Polynomial => 1.0 / (1.0 + s as f32).sqrt(),
        }
    }

    /// The model of `version` (kept for the last `max_staleness + 1` versions).
    pub(crate) fn model_of(&self, version: u32) -> &[f32] {
        let found = self.models.iter().find(|(v, _)| *v == version);
        debug_assert!(found.is_some(), "version {version} evicted while an accepted update needs it");
        found.or(self.models.back()).map_or(&[], |(_, m)| m.as_slice())
    }

    /// Records the new global model as the next version.
    pub(crate) fn publish(&mut self, model: &[f32]) {
        self.version += 1;
        let recycled = if self.models.len() > self.max_staleness as usize { self.models.pop_front().map(|(_, m)| m) } else { None };
        let mut buf = recycled.unwrap_or_default();
        buf.clear();
        buf.extend_from_slice(model);
        self.models.push_back((self.version, buf));
    }

    /// Launches one free, online client on the current version at the current virtual time.
    fn launch(&mut self, config: &FedConfig, pop: &Population, trace: Option<&AvailabilityTrace>) {
        let n = u64::from(pop.n_clients());
        let seq = self.launches;
        self.launches += 1;
        let now_s = self.clock_us as f64 / 1e6;
        for attempt in 0..LAUNCH_ATTEMPTS {
            let c = (splitmix64(config.seed ^ splitmix64(seq << 8 | attempt)) % n) as u32;
            let busy = self.in_flight[c as usize / 64] & (1u64 << (c % 64)) != 0;
            if busy || trace.is_some_and(|t| !t.is_online(c, now_s)) {
                continue;
            }
            self.in_flight[c as usize / 64] |= 1u64 << (c % 64);
            let f = &config.faults;
            let latency = latency_ms(config.seed, seq, c, f.latency_median_ms, f.latency_sigma);
            let (fate, after_ms) = if drops_out(config.seed, seq, c, f.dropout_rate) {
                (Fate::Dropped, f.deadline_ms.unwrap_or(latency))
            } else if f.deadline_ms.is_some_and(|d| latency > d) {
                (Fate::Straggler, f.deadline_ms.unwrap_or(latency))
            } else {
                (Fate::Arrives, latency)
            };
            let finish_us = self.clock_us + (after_ms * 1e3).round().max(1.0) as u64;
            self.events.push(Reverse(Event { finish_us, seq, client: c, version: self.version, fate }));
            return;
        }
    }
}
