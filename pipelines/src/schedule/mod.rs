//! Pipeline schedules as pure functions, and a virtual-time simulator that checks them.
//!
//! A schedule maps `(kind, stages p, micro-batches m, stage s)` to the ordered list of
//! [`Instr`]s that rank `s` runs in one training step ([`instructions`]). It is plain data,
//! computed without IO or clocks. Communication is implicit in the vocabulary:
//!
//! - The model is cut into `V = p * chunks` *virtual stages* (`chunks` is 1 except for
//!   [`ScheduleKind::Interleaved`]). Virtual stage `v = chunk * p + s` lives on rank `s`
//!   (Megatron's interleaving: rank `s` holds model chunks `s, s + p, s + 2p, ...`).
//! - [`Op::Forward`] of `(microbatch, v)` first receives the activation of that micro-batch from
//!   virtual stage `v - 1` (nothing for `v = 0`, which reads the batch) and sends its output to
//!   `v + 1` after computing; the forward of `v = V - 1` includes the loss.
//! - [`Op::Backward`] and [`Op::BackwardInput`] of `(microbatch, v)` receive the gradient from
//!   `v + 1` (for `v = V - 1` the loss's own gradient) and send the input gradient to `v - 1`.
//!   [`Op::Backward`] computes input and weight gradients together; the zero-bubble schedule
//!   splits it into [`Op::BackwardInput`] (on the critical path) and [`Op::BackwardWeight`], which
//!   needs only the local `BackwardInput` of the same `(microbatch, v)` and fills bubbles.
//! - Every `(microbatch, v)` a rank owns appears exactly once as a forward and once as a
//!   `Backward` (or once as `BackwardInput` and once as `BackwardWeight`).
//!
//! The schedules ([`ScheduleKind`]): GPipe (all forwards, then all backwards in micro-batch
//! order), 1F1B (PipeDream-flush, Megatron's non-interleaved schedule), interleaved 1F1B
//! (Megatron's virtual-pipeline schedule) and ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline
//! Parallelism", handcrafted schedule H1).
//!
//! **Memory bounds.** A micro-batch's activations are *live* on a rank from its forward until
//! its backward (input) is done. The peak number of live `(microbatch, chunk)` pairs on stage `s`
//! is exactly, and the tests check it for every `p <= 8`, `m <= 32`:
//! - GPipe: `m`.
//! - 1F1B and ZB-H1: `min(p - s, m)`, so at most `p` (stage 0). ZB-H1 additionally keeps, on
//!   stage `s`, up to `s` deferred weight gradients whose inputs stay allocated until their
//!   `BackwardWeight`; counting those ([`Timeline::peak_held`]) it holds at most `min(p, m)`
//!   micro-batches on every stage (exactly `p` when `m >= p`): 1F1B's peak, as the paper states.
//! - Interleaved with `c` chunks: `min(2 (p - s - 1) + (c - 1) p + 1, c m)` chunk-micro-batches
//!   (each a `1/c` share of the stage's layers), i.e. on stage 0 the activations of
//!   `p + (p - 1) / c` micro-batches of the whole stage: Megatron's `p (1 + (p - 1) / (p c))`.
//!
//! [`simulate`] runs every rank's list in virtual time with per-virtual-stage [`Costs`] and
//! returns a [`Timeline`] (busy and idle time per rank, makespan, bubble fraction, peak live
//! activations, events), or [`ScheduleError::Deadlock`] naming the stuck ranks and instructions.

mod error;
mod generate;
mod sim;
#[cfg(test)]
mod tests;

pub use error::ScheduleError;
pub use sim::{check_coverage, simulate, simulate_lists, Costs, Event, Timeline};

/// Which pipeline schedule to compute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScheduleKind {
    /// All forwards in micro-batch order, then all backwards in micro-batch order (Huang et al.
    /// 2019). Holds `m` micro-batches of activations.
    GPipe,
    /// One-forward-one-backward (PipeDream-flush; Megatron's non-interleaved schedule): stage
    /// `s` runs `min(p - s - 1, m)` warm-up forwards, then alternates forward and backward, then
    /// drains the remaining backwards.
    OneFOneB,
    /// Megatron's interleaved 1F1B over `chunks` virtual stages per rank; requires
    /// `m % p == 0` and `chunks >= 2`.
    Interleaved {
        /// Virtual stages (model chunks) per rank, at least 2.
        chunks: usize,
    },
    /// ZB-H1: 1F1B's order of forwards and input-gradient backwards, with weight gradients
    /// split off; stage `s` defers its first `s` weight gradients and runs them to fill the
    /// bubbles of the cool-down.
    ZeroBubbleH1,
}

/// What an instruction computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    /// Forward of one micro-batch through one model chunk (the loss too on the last stage).
    Forward,
    /// Backward: input and weight gradients together.
    Backward,
    /// Input gradient only (zero-bubble schedules); sends it to the previous virtual stage.
    BackwardInput,
    /// Weight gradient only (zero-bubble schedules); local, after the same `BackwardInput`.
    BackwardWeight,
}

/// One step of a rank's schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Instr {
    /// What to compute.
    pub op: Op,
    /// The micro-batch, `0..m`.
    pub microbatch: usize,
    /// The rank's model chunk, `0..chunks` (0 unless [`ScheduleKind::Interleaved`]).
    pub chunk: usize,
}

impl ScheduleKind {
    /// Model chunks per rank: `chunks` for [`ScheduleKind::Interleaved`], else 1.
    pub fn chunks(self) -> usize {
        match self {
            ScheduleKind::Interleaved { chunks } => chunks,
            _ => 1,
        }
    }

    /// Whether the schedule splits backwards into `BackwardInput` and `BackwardWeight`.
    pub fn splits_backward(self) -> bool {
        matches!(self, ScheduleKind::ZeroBubbleH1)
    }

    /// A short stable name (`gpipe`, `1f1b`, `interleaved-2`, `zb-h1`) for reports.
    pub fn name(self) -> String {
        match self {
            ScheduleKind::GPipe => "gpipe".to_string(),
            ScheduleKind::OneFOneB => "1f1b".to_string(),
            ScheduleKind::Interleaved { chunks } => format!("interleaved-{chunks}"),
            ScheduleKind::ZeroBubbleH1 => "zb-h1".to_string(),
        }
    }
}

impl Instr {
    /// An instruction on chunk 0.
    pub fn new(op: Op, microbatch: usize) -> Instr {
        Instr { op, microbatch, chunk: 0 }
    }

    /// The virtual stage this instruction runs on rank `stage` of `stages`.
    pub fn virtual_stage(&self, stages: usize, stage: usize) -> usize {
        self.chunk * stages + stage
    }
}

/// The instruction list of rank `stage` for one step of `microbatches` micro-batches over
/// `stages` pipeline stages. Pure: the same arguments always give the same list.
pub fn instructions(kind: ScheduleKind, stages: usize, microbatches: usize, stage: usize) -> Result<Vec<Instr>, ScheduleError> {
    validate(kind, stages, microbatches)?;
    if stage >= stages {
        return Err(ScheduleError::StageOutOfRange { stage, stages });
    }
    let list = match kind {
        ScheduleKind::GPipe => generate::gpipe(microbatches),
        ScheduleKind::OneFOneB => generate::one_f_one_b(stages, microbatches, stage),
        ScheduleKind::Interleaved { chunks } => generate::interleaved(stages, microbatches, stage, chunks),
        ScheduleKind::ZeroBubbleH1 => generate::zb_h1(stages, microbatches, stage),
    };
    debug_assert_eq!(list.len(), microbatches * kind.chunks() * if kind.splits_backward() { 3 } else { 2 });
    Ok(list)
}

/// Checks `(kind, stages, microbatches)` without computing anything.
pub fn validate(kind: ScheduleKind, stages: usize, microbatches: usize) -> Result<(), ScheduleError> {
    if stages == 0 {
        return Err(ScheduleError::ZeroStages);
    }
    if microbatches == 0 {
        return Err(ScheduleError::ZeroMicrobatches);
    }
    if let ScheduleKind::Interleaved { chunks } = kind {
        if chunks < 2 {
            return Err(ScheduleError::TooFewChunks { chunks });
        }
        if !microbatches.is_multiple_of(stages) {
            return Err(ScheduleError::InterleavedIndivisible { microbatches, stages });
        }
    }
    Ok(())
}
