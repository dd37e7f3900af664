//! Virtual-time execution of every rank's instruction list: the check that a schedule is
//! complete and deadlock-free, and the source of its timeline (busy, idle, bubble, memory).
//!
//! Each rank runs its list in order. An instruction starts when the rank is free and its inputs
//! are there: a forward needs the forward of the same micro-batch on the previous virtual stage,
//! a backward (or backward-input) needs the local forward and the backward(-input) of the next
//! virtual stage, a backward-weight needs the local backward-input. A transfer between two
//! different ranks adds [`Costs::p2p`]. Start times depend only on those end times, so the
//! simulator schedules whatever can start, rank by rank, until every list is done or no rank
//! can move (a deadlock). No clocks, no randomness: the same input gives the same timeline.

use super::{instructions, validate, Instr, Op, ScheduleError, ScheduleKind};

/// Per-virtual-stage compute times and the point-to-point latency, in seconds.
#[derive(Clone, Debug, PartialEq)]
pub struct Costs {
    /// Forward time of one micro-batch through virtual stage `v` (index `v`).
    pub forward: Vec<f64>,
    /// Input-gradient time of one micro-batch through virtual stage `v`.
    pub backward_input: Vec<f64>,
    /// Weight-gradient time of one micro-batch through virtual stage `v`. [`Op::Backward`]
    /// takes `backward_input[v] + backward_weight[v]`.
    pub backward_weight: Vec<f64>,
    /// Latency of one activation or gradient transfer between two different ranks.
    pub p2p: f64,
}

/// One executed instruction.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Event {
    /// The rank that ran it.
    pub stage: usize,
    /// What it ran.
    pub instr: Instr,
    /// Virtual start time, seconds.
    pub start: f64,
    /// Virtual end time, seconds.
    pub end: f64,
}

/// The result of [`simulate`]: what each rank did and when, in virtual seconds.
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    /// Pipeline stages (ranks).
    pub stages: usize,
    /// Model chunks per rank.
    pub chunks: usize,
    /// Micro-batches of the step.
    pub microbatches: usize,
    /// Per rank: seconds spent computing.
    pub busy: Vec<f64>,
    /// Per rank: `makespan - busy`, waiting before, between and after its instructions.
    pub idle: Vec<f64>,
    /// End of the last instruction on any rank (the step starts at 0).
    pub makespan: f64,
    /// Per rank: peak number of `(microbatch, chunk)` whose forward is done and whose
    /// `Backward`/`BackwardInput` is not (live activations).
    pub peak_live: Vec<usize>,
    /// Per rank: peak number of `(microbatch, chunk)` whose forward is done and whose
    /// `Backward`/`BackwardWeight` is not (inputs still held for a weight gradient included).
    pub peak_held: Vec<usize>,
    /// Every executed instruction, ordered by start time, then rank.
    pub events: Vec<Event>,
}

impl Costs {
    /// The same times on each of `virtual_stages` virtual stages.
    pub fn uniform(virtual_stages: usize, forward: f64, backward_input: f64, backward_weight: f64, p2p: f64) -> Costs {
        Costs {
            forward: vec![forward; virtual_stages],
            backward_input: vec![backward_input; virtual_stages],
            backward_weight: vec![backward_weight; virtual_stages],
            p2p,
        }
    }

    /// Seconds `op` takes on virtual stage `v` (which [`Costs::check`] has bounded).
    fn duration(&self, op: Op, v: usize) -> f64 {
        match op {
            Op::Forward => self.forward[v],
            Op::Backward => self.backward_input[v] + self.backward_weight[v],
            Op::BackwardInput => self.backward_input[v],
            Op::BackwardWeight => self.backward_weight[v],
        }
    }

    /// One finite, non-negative time per virtual stage in each table, and a valid latency.
    fn check(&self, virtual_stages: usize) -> Result<(), ScheduleError> {
        let bad = |what: String| Err(ScheduleError::BadCosts { what, virtual_stages });
        for (name, table) in [("forward", &self.forward), ("backward_input", &self.backward_input), ("backward_weight", &self.backward_weight)] {
            if table.len() != virtual_stages {
                return bad(format!("{name} has {} entries", table.len()));
            }
            if let Some((v, t)) = table.iter().enumerate().find(|(_, t)| !(t.is_finite() && **t >= 0.0)) {
                return bad(format!("{name}[{v}] = {t}"));
            }
        }
        if !(self.p2p.is_finite() && self.p2p >= 0.0) {
            return bad(format!("p2p = {}", self.p2p));
        }
        Ok(())
    }
}

impl Timeline {
    /// Idle share of the whole pipeline: total idle over `stages * makespan`.
    pub fn bubble_fraction(&self) -> f64 {
        if self.makespan <= 0.0 {
            return 0.0;
        }
        self.idle.iter().sum::<f64>() / (self.stages as f64 * self.makespan)
    }

    /// Idle share of one rank: `idle[stage] / makespan` (0 for an out-of-range stage).
    pub fn stage_bubble_fraction(&self, stage: usize) -> f64 {
        match self.idle.get(stage) {
            Some(idle) if self.makespan > 0.0 => idle / self.makespan,
            _ => 0.0,
        }
    }
}

/// Runs schedule `kind` for `stages` ranks and `microbatches` micro-batches in virtual time.
/// `costs` has one entry per virtual stage (`stages * kind.chunks()`).
pub fn simulate(kind: ScheduleKind, stages: usize, microbatches: usize, costs: &Costs) -> Result<Timeline, ScheduleError> {
    validate(kind, stages, microbatches)?;
    let lists = (0..stages).map(|s| instructions(kind, stages, microbatches, s)).collect::<Result<Vec<_>, _>>()?;
    simulate_lists(stages, kind.chunks(), microbatches, &lists, costs)
}

/// Checks that `lists` (one per rank) give every `(microbatch, chunk)` of every rank exactly one
/// `Forward` and exactly one `Backward` or one `BackwardInput` plus one `BackwardWeight`, and
/// name nothing outside the step. Says nothing about order: [`simulate_lists`] checks that.
pub fn check_coverage(stages: usize, chunks: usize, microbatches: usize, lists: &[Vec<Instr>]) -> Result<(), ScheduleError> {
    if lists.len() != stages {
        return Err(ScheduleError::ListCount { lists: lists.len(), stages });
    }
    for (stage, list) in lists.iter().enumerate() {
        let problem = |problem: String| Err(ScheduleError::Coverage { stage, problem });
        // counts[op][chunk * m + mb]
        let mut counts = vec![vec![0usize; chunks * microbatches]; 4];
        for instr in list {
            if instr.microbatch >= microbatches || instr.chunk >= chunks {
                return problem(format!("{instr:?} is outside {microbatches} micro-batches x {chunks} chunks"));
            }
            let count = &mut counts[op_index(instr.op)][instr.chunk * microbatches + instr.microbatch];
            *count += 1;
            if *count > 1 {
                return problem(format!("{instr:?} appears twice"));
            }
        }
        for chunk in 0..chunks {
            for mb in 0..microbatches {
                let [f, b, bi, bw] = [0, 1, 2, 3].map(|o| counts[o][chunk * microbatches + mb]);
                if f != 1 {
                    return problem(format!("micro-batch {mb} chunk {chunk} has no Forward"));
                }
                if !((b == 1 && bi == 0 && bw == 0) || (b == 0 && bi == 1 && bw == 1)) {
                    return problem(format!(
                        "micro-batch {mb} chunk {chunk} needs one Backward or one BackwardInput and one BackwardWeight, has {b}, {bi} and {bw}"
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Runs explicit instruction lists (one per rank, `chunks` model chunks per rank) in virtual
/// time; see the module doc for the rules. Checks coverage first ([`check_coverage`]).
pub fn simulate_lists(stages: usize, chunks: usize, microbatches: usize, lists: &[Vec<Instr>], costs: &Costs) -> Result<Timeline, ScheduleError> {
    if stages == 0 {
        return Err(ScheduleError::ZeroStages);
    }
    if microbatches == 0 {
        return Err(ScheduleError::ZeroMicrobatches);
    }
    let virtual_stages = stages * chunks;
    costs.check(virtual_stages)?;
    check_coverage(stages, chunks, microbatches, lists)?;
    let idx = |v: usize, mb: usize| v * microbatches + mb;
    // End times, by virtual stage and micro-batch, of forwards and of input gradients
    // (`Backward` or `BackwardInput`), and whether a `BackwardInput` is done (for its weight).
    let mut forward_end: Vec<Option<f64>> = vec![None; virtual_stages * microbatches];
    let mut grad_end: Vec<Option<f64>> = vec![None; virtual_stages * microbatches];
    let mut next = vec![0usize; stages];
    let mut free = vec![0.0f64; stages];
    let mut busy = vec![0.0f64; stages];
    let (mut live, mut held) = (vec![0usize; stages], vec![0usize; stages]);
    let (mut peak_live, mut peak_held) = (vec![0usize; stages], vec![0usize; stages]);
    let mut events = Vec::with_capacity(lists.iter().map(Vec::len).sum());
    let total: usize = lists.iter().map(Vec::len).sum();
    let latency = |from_v: usize, to_stage: usize| if from_v % stages == to_stage { 0.0 } else { costs.p2p };
    loop {
        let mut progressed = false;
        for stage in 0..stages {
            while let Some(instr) = lists[stage].get(next[stage]).copied() {
                let v = instr.virtual_stage(stages, stage);
                let i = idx(v, instr.microbatch);
                // When the instruction's inputs are there, or None while one is missing.
                let ready = match instr.op {
                    Op::Forward if v == 0 => Some(0.0),
                    Op::Forward => forward_end[idx(v - 1, instr.microbatch)].map(|t| t + latency(v - 1, stage)),
                    Op::Backward | Op::BackwardInput => {
                        let upstream =
                            if v + 1 == virtual_stages { Some(0.0) } else { grad_end[idx(v + 1, instr.microbatch)].map(|t| t + latency(v + 1, stage)) };
                        match (forward_end[i], upstream) {
                            (Some(f), Some(g)) => Some(f.max(g)),
                            _ => None,
                        }
                    }
                    Op::BackwardWeight => grad_end[i],
                };
                let Some(ready) = ready else { break };
                let start = free[stage].max(ready);
                let end = start + costs.duration(instr.op, v);
                match instr.op {
                    Op::Forward => {
                        forward_end[i] = Some(end);
                        live[stage] += 1;
                        held[stage] += 1;
                    }
                    Op::Backward => {
                        grad_end[i] = Some(end);
                        live[stage] = live[stage].saturating_sub(1);
                        held[stage] = held[stage].saturating_sub(1);
                    }
                    Op::BackwardInput => {
                        grad_end[i] = Some(end);
                        live[stage] = live[stage].saturating_sub(1);
                    }
                    Op::BackwardWeight => held[stage] = held[stage].saturating_sub(1),
                }
                peak_live[stage] = peak_live[stage].max(live[stage]);
                peak_held[stage] = peak_held[stage].max(held[stage]);
                busy[stage] += end - start;
                free[stage] = end;
                events.push(Event { stage, instr, start, end });
                next[stage] += 1;
                progressed = true;
            }
        }
        if events.len() == total {
            break;
        }
        if !progressed {
            let stuck = (0..stages).filter_map(|s| lists[s].get(next[s]).map(|instr| (s, *instr, next[s]))).collect();
            return Err(ScheduleError::Deadlock { stuck, done: events.len(), total });
        }
    }
    let makespan = free.iter().copied().fold(0.0, f64::max);
    let idle = busy.iter().map(|b| makespan - b).collect();
    events.sort_by(|a, b| a.start.total_cmp(&b.start).then(a.stage.cmp(&b.stage)));
    tracing::debug!(stages, chunks, microbatches, makespan, "pipeline schedule simulated");
    Ok(Timeline { stages, chunks, microbatches, busy, idle, makespan, peak_live, peak_held, events })
}

/// Position of `op` in the coverage table: `[Forward, Backward, BackwardInput, BackwardWeight]`.
fn op_index(op: Op) -> usize {
    match op {
        Op::Forward => 0,
        Op::Backward => 1,
        Op::BackwardInput => 2,
        Op::BackwardWeight => 3,
    }
}
