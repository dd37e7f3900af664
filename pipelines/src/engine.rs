//! The engine contract: what the worker runtime asks of any parallelism, one step at a time,
//! without naming it.
//!
//! # Who does what
//!
//! The worker runtime (`rtx-supervisor`'s `worker/steps.rs`) has one step loop for every
//! engine. Three loops came before it (data parallelism with ZeRO-0/1/2, ZeRO-3 / FSDP, and the
//! `(dp, pp, tp)` mesh), and reading them side by side gives the split below.
//!
//! **Common duties** (the runtime's, done once in its loop, in this order each step):
//! 1. at the end of the run (or of this `--steps` part of it), let the engine finish the run
//!    ([`Engine::finish_run`]) and pass on what it reports, then end the generation;
//! 2. between steps, take a command of the supervisor or leave after a preemption notice,
//!    reporting the newest restorable step ([`Engine::restorable`]);
//! 3. fetch the batch of the global step for the member's data-parallel share
//!    ([`Engine::data_share`]) from its data shard;
//! 4. run the step ([`Engine::step`]); a failure is logged (a stale generation's quietly),
//!    reported as `StepFailed`, and the member waits for the supervisor's decision;
//! 5. secure the step ([`Engine::secure`]: whatever must hold before the step may be called
//!    done), then publish it as completed (heartbeats), then keep it restorable
//!    ([`Engine::keep`]); a failure of either is reported like a failed step;
//! 6. on verification steps ([`Duties::verify`]) take the checksum ([`Engine::checksum`]),
//!    report `StepDone` with the loss, the samples and the checksum;
//! 7. checkpoint when due ([`Engine::checkpoint`]) and pass on its reports;
//! 8. account compute, control and whole-loop time;
//! 9. after the loop, whatever ended it, hand the state over for the next generation
//!    ([`Engine::finish_generation`]).
//!
//! Which steps verify and checkpoint is [`Duties::at`], a pure function of the step.
//!
//! **Engine-specific duties** (behind the trait):
//! - the set-up of a generation (connecting, the state sync or recovery sources, building the
//!   engine) stays with each engine's generation code; the contract starts with a built engine;
//! - what a step is: the learning rate, the forward/backward over the batch or its
//!   micro-batches, the collectives, the optimizer, the job's after-step hook; where it runs
//!   (the runtime's thread, a communication thread, a compute thread per mesh member);
//! - what makes a step restorable: ZeRO-1/2/3 exchange segment states with a buddy before the
//!   step is done, ZeRO-1/2 gather a snapshot every `snapshot_every` steps, a replica or a mesh
//!   slot simply holds it;
//! - what a checksum covers: a replica's parameters, a mesh slot's parameters and optimizer
//!   state; ZeRO-3 has none;
//! - what a checkpoint is: rank 0's single file (DP, and ZeRO-3 after a gather of every rank),
//!   or one shard per mesh slot plus an index;
//! - what is kept between generations: the model and full optimizer state, segment copies, or
//!   the slot's flat state.
//!
//! The contract names no runtime type: the runtime's error and the messages an engine hands it to
//! pass on are associated types, so this crate stays below the supervisor.

use std::future::Future;

/// Which share of the global batch a member trains on: its data-parallel rank and the size of
/// its data-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataShare {
    /// The member's data-parallel rank.
    pub rank: usize,
    /// The number of data-parallel shares of the global batch.
    pub world: usize,
}

/// What one completed step reports.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// The loss the member reports for the step.
    pub loss: f64,
    /// The samples this member counts toward the global batch (the supervisor sums them).
    pub samples: u64,
}

/// What is due at one step besides the step itself; see [`Duties::at`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Duties {
    /// The step is the last one of the run (or of this part of it).
    pub last: bool,
    /// Replicas compare checksums after this step.
    pub verify: bool,
    /// A periodic checkpoint falls after this step (`checkpoint_every`); the engine decides what
    /// the last step adds (a final checkpoint).
    pub checkpoint: bool,
}

impl Duties {
    /// The duties of `step` in a run of `total` steps: verification every `verify_every` steps
    /// (counted from step 0) and at the last step; a checkpoint after every `checkpoint_every`-th
    /// step (`0`: none).
    pub fn at(step: u64, total: u64, verify_every: u64, checkpoint_every: u64) -> Duties {
        debug_assert!(step < total, "step {step} of a run of {total} steps");
        let last = step + 1 == total;
        Duties {
            last,
            verify: step.is_multiple_of(verify_every.max(1)) || last,
            checkpoint: checkpoint_every > 0 && (step + 1).is_multiple_of(checkpoint_every),
        }
    }
}

/// One member's part of a parallel job, as the worker runtime drives it (see the module doc).
/// Methods are called in the order the module doc lists; an engine may assume it.
pub trait Engine: Send {
    /// What the runtime's data shard hands in for one step (the member's share of the global batch).
    type Batch: Send;
    /// The runtime's error.
    type Error: std::error::Error + Send + Sync + 'static;
    /// What the engine hands the runtime to pass on to its supervisor (checkpoint reports).
    type Note: Send;

    /// A short name for logs (`"dp"`, `"zero3"`, `"mesh"`).
    fn name(&self) -> &'static str;

    /// This member's share of each global batch.
    fn data_share(&self) -> DataShare;

    /// The newest step whose state this member can restore in the next generation, if any.
    fn restorable(&self) -> Option<u64>;

    /// Runs step `step` over `batch`. On error the engine holds the state of the last completed
    /// step (every collective precedes the optimizer update).
    fn step(&mut self, step: u64, batch: Self::Batch, duties: Duties) -> impl Future<Output = Result<StepReport, Self::Error>> + Send;

    /// What must hold before step `step` may be reported done (a buddy holding this member's
    /// segment state); runs on every member.
    fn secure(&mut self, step: u64) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Makes step `step` the restorable point where the engine keeps one (a snapshot, or the
    /// state itself); runs on every member after the step was published as completed.
    fn keep(&mut self, step: u64, duties: Duties) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// The checksum replicas compare on a verification step (`None`: the engine has none).
    fn checksum(&mut self) -> Result<Option<u64>, Self::Error>;

    /// The checkpoint after step `step` when `duties` ask for one (a collective on some engines:
    /// every member calls it every step); what to pass on.
    fn checkpoint(&mut self, step: u64, duties: Duties) -> impl Future<Output = Result<Vec<Self::Note>, Self::Error>> + Send;

    /// The end of the run: `total` steps are done (or this generation has nothing left to
    /// train); a final checkpoint or gather where the engine needs one. What to pass on.
    fn finish_run(&mut self, total: u64) -> impl Future<Output = Result<Vec<Self::Note>, Self::Error>> + Send;

    /// Hands the state over for the next generation (the runtime keeps it between
    /// generations), whatever ended the step loop.
    fn finish_generation(self) -> Result<(), Self::Error>;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Verification every `verify_every` steps and at the last step, checkpoints after every
    /// `checkpoint_every`-th step, as the three engines' loops scheduled them before the contract.
    #[test]
    fn duties_follow_the_step_counts() {
        let check = |step, total, verify_every, checkpoint_every, expect: (bool, bool, bool)| {
            let d = Duties::at(step, total, verify_every, checkpoint_every);
            assert_eq!((d.last, d.verify, d.checkpoint), expect, "step {step} of {total}, verify {verify_every}, checkpoint {checkpoint_every}");
        };
        check(0, 10, 5, 0, (false, true, false));
        check(4, 10, 5, 5, (false, false, true));
        check(5, 10, 5, 5, (false, true, false));
        check(9, 10, 5, 5, (true, true, true));
        check(8, 10, 0, 3, (false, true, true));
        check(9, 10, 4, 0, (true, true, false));
        check(6, 10, 4, 0, (false, false, false));
    }
}
