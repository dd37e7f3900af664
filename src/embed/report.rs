//! What an embedded job reports when it ends: the [`Report`] (loss per committed step, the
//! generations formed, the workers lost, the final evaluation), folded from the supervisor's
//! `JobEvent`s.

use rtx_supervisor::{FailureClass, JobEvent};

/// One committed step.
#[derive(Clone, Debug, PartialEq)]
pub struct StepLoss {
    /// The step (0-based).
    pub step: u64,
    /// Mean loss over the global batch.
    pub loss: f64,
    /// Workers that trained it.
    pub world: usize,
    /// The generation it was trained in.
    pub generation: u64,
}

/// One generation (a membership of the job).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GenerationInfo {
    /// Its number.
    pub generation: u64,
    /// Workers in it.
    pub world: usize,
    /// The first step it trains.
    pub next_step: u64,
    /// The workers' pids in rank order (synthetic ids for in-process workers).
    pub pids: Vec<u32>,
}

/// A worker the job lost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LostWorker {
    /// Its pid (a synthetic id for an in-process worker).
    pub pid: u32,
    /// How it was lost.
    pub class: FailureClass,
    /// The supervisor's reason.
    pub reason: String,
}

/// What a finished job reports. With [`Placement::Remote`](super::Placement::Remote) the
/// supervisor is elsewhere: only [`Report::workers_finished`] is filled (the remote supervisor
/// has the job's events).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    /// The loss of every committed step, in commit order.
    pub losses: Vec<StepLoss>,
    /// Every generation formed, in order.
    pub generations: Vec<GenerationInfo>,
    /// Workers lost (crashed, killed, hung, left).
    pub lost: Vec<LostWorker>,
    /// Workers admitted over the job (the starting ones, and replacements).
    pub joined: usize,
    /// Steps after which a checkpoint was written.
    pub checkpoints: Vec<u64>,
    /// The task's evaluation of the final model (rank 0).
    pub eval: Vec<(String, f64)>,
    /// The replicas' final parameter checksum (they all agree, or the job fails).
    pub checksum: Option<u64>,
    /// Workers of this program that finished the job.
    pub workers_finished: usize,
}

impl Report {
    /// Mean loss of the first `n` committed steps (`None` without commits).
    pub fn first_losses_mean(&self, n: usize) -> Option<f64> {
        mean(self.losses.iter().take(n).map(|s| s.loss))
    }

    /// Mean loss of the last `n` committed steps (`None` without commits).
    pub fn last_losses_mean(&self, n: usize) -> Option<f64> {
        mean(self.losses.iter().rev().take(n).map(|s| s.loss))
    }

    /// Folds one supervisor event in.
    pub(crate) fn record(&mut self, event: &JobEvent) {
        match event {
            JobEvent::Committed { step, loss, world, generation, .. } => self.losses.push(StepLoss { step: *step, loss: *loss, world: *world, generation: *generation }),
            JobEvent::Generation { generation, world, next_step, pids, .. } => self.generations.push(GenerationInfo { generation: *generation, world: *world, next_step: *next_step, pids: pids.clone() }),
            JobEvent::Lost { pid, class, reason, .. } => self.lost.push(LostWorker { pid: *pid, class: *class, reason: reason.clone() }),
            JobEvent::Joined { .. } => self.joined += 1,
            JobEvent::Checkpointed { step, .. } => self.checkpoints.push(*step),
            JobEvent::Finished { eval, checksum, .. } => {
                self.eval = eval.clone();
                self.checksum = Some(*checksum);
            }
            JobEvent::Refused { .. } | JobEvent::CheckpointFailed { .. } | JobEvent::Failed { .. } | JobEvent::Suspect { .. } => {}
        }
    }
}

fn mean(values: impl Iterator<Item = f64>) -> Option<f64> {
    let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    (n > 0).then(|| sum / n as f64)
}
