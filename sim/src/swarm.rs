//! Seed swarms: many seeds of one scenario across OS threads, each thread running its own
//! single-thread simulation runtime per seed. Results come back sorted by seed, so a report does
//! not depend on which thread ran what.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::cluster::{run_seed, Outcome, RunOptions};
use crate::error::{Result, SimError};
use crate::scenario::Scenario;

/// What a swarm found.
#[derive(Clone, Debug)]
pub struct SwarmReport {
    /// Every seed's outcome, by seed.
    pub outcomes: Vec<Outcome>,
    /// Wall time of the whole swarm.
    pub wall: Duration,
    /// Threads used.
    pub threads: usize,
}

impl SwarmReport {
    /// The outcomes that broke an invariant.
    pub fn failing(&self) -> impl Iterator<Item = &Outcome> {
        self.outcomes.iter().filter(|o| o.violation.is_some())
    }

    /// Seeds per wall second.
    pub fn seeds_per_s(&self) -> f64 {
        self.outcomes.len() as f64 / self.wall.as_secs_f64().max(1e-9)
    }

    /// Simulated time over wall time, summed over seeds and threads' wall time.
    pub fn virtual_to_wall(&self) -> f64 {
        let simulated: f64 = self.outcomes.iter().map(|o| o.virtual_time.as_secs_f64()).sum();
        simulated / (self.wall.as_secs_f64() * self.threads as f64).max(1e-9)
    }

    /// Committed training steps per wall second (all threads together).
    pub fn steps_per_wall_s(&self) -> f64 {
        self.outcomes.iter().map(|o| o.committed).sum::<u64>() as f64 / self.wall.as_secs_f64().max(1e-9)
    }
}

/// Runs `seeds` of `scenario` on `threads` threads (at least one).
pub fn swarm(scenario: &Scenario, seeds: std::ops::Range<u64>, threads: usize, data_root: &Path, options: &RunOptions) -> Result<SwarmReport> {
    let started = Instant::now();
    let threads = threads.max(1);
    let mut outcomes = run_seeds(seeds, threads, |seed| run_seed(scenario, seed, data_root, options))?;
    outcomes.sort_by_key(|o| o.seed);
    Ok(SwarmReport { outcomes, wall: started.elapsed(), threads })
}

/// Runs `run` for every seed of `seeds` on `threads` threads (at least one), each seed on the
/// thread that picked it; returns the results in no particular order, or the first error. The
/// federated swarm uses it too.
pub(crate) fn run_seeds<T: Send>(seeds: std::ops::Range<u64>, threads: usize, run: impl Fn(u64) -> Result<T> + Sync) -> Result<Vec<T>> {
    let next = AtomicU64::new(seeds.start);
    let results: Mutex<Vec<Result<T>>> = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..threads.max(1) {
            scope.spawn(|| loop {
                let seed = next.fetch_add(1, Ordering::Relaxed);
                if seed >= seeds.end {
                    return;
                }
                let outcome = run(seed);
                results.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(outcome);
            });
        }
    });
    let mut outcomes = Vec::new();
    for result in results.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner) {
        outcomes.push(result?);
    }
    if outcomes.len() as u64 != seeds.end.saturating_sub(seeds.start) {
        return Err(SimError::Scenario(format!(
            "swarm ran {} of {} seeds (a simulation thread panicked)",
            outcomes.len(),
            seeds.end.saturating_sub(seeds.start)
        )));
    }
    Ok(outcomes)
}
