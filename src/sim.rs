//! `rtx sim`: runs a scenario of the deterministic simulator (`rtx-sim`) for one seed, printing
//! its trace hash and the invariants checked (or the first broken one, its event and the command
//! that replays it, after the job events and faults that led there), or for a range of seeds as a
//! swarm across cores, printing every failing seed with its replay command and a summary (seeds
//! per second, virtual-to-wall time ratio, committed steps per wall second).

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context};
use rtx_sim::{run_seed, swarm, Outcome, RunOptions, Scenario};
use rtx_supervisor::PlantedBug;

use crate::cli::SimArgs;

/// Runs `rtx sim` with data from `data_root`.
pub fn run(args: &SimArgs, data_root: &Path) -> anyhow::Result<()> {
    let scenario = Scenario::load(&args.scenario)?;
    let options = RunOptions { planted_bug: if args.planted_bug { PlantedBug::ReplayLastStep } else { PlantedBug::None }, ..RunOptions::default() };
    match (args.seed, &args.seeds) {
        (Some(seed), _) => {
            let started = Instant::now();
            let outcome = run_seed(&scenario, seed, data_root, &options)?;
            let wall = started.elapsed();
            println!(
                "seed {seed}: trace {:016x}; committed {}/{} steps in {} generation(s); {} fault(s); {} invariant checks; final checksum {:016x}; virtual {:.3} s in {:.3} s wall ({:.1}x)",
                outcome.trace,
                outcome.committed,
                scenario.job.total_steps,
                outcome.generations,
                outcome.faults,
                outcome.checks,
                outcome.checksum,
                outcome.virtual_time.as_secs_f64(),
                wall.as_secs_f64(),
                outcome.virtual_time.as_secs_f64() / wall.as_secs_f64().max(1e-9)
            );
            if let Some(v) = &outcome.violation {
                println!("the last {} job events and faults before it:", v.recent.len());
                for line in &v.recent {
                    println!("  {line}");
                }
                print_violation(&outcome, args);
                bail!("seed {seed} broke invariant {}", v.invariant);
            }
            let exact = if outcome.exact_recovery_checked {
                ", exact-recovery (final parameters equal the fault-free run's)"
            } else {
                " (exact-recovery not applicable: some step ran on fewer workers)"
            };
            let (written, failed) = outcome.checkpoints;
            println!("invariants held: stale-generation, replicas-identical, committed-monotone, samples-exactly-once, liveness, checkpoint-intact ({written} checkpoints written, {failed} writes failed), durable-progress, no-restart-from-scratch{exact}");
            Ok(())
        }
        (None, Some(range)) => {
            let (a, b) = range.split_once("..").context("--seeds takes A..B")?;
            let (a, b): (u64, u64) = (a.trim().parse().context("--seeds: A")?, b.trim().parse().context("--seeds: B")?);
            if a >= b {
                bail!("--seeds {a}..{b} is empty");
            }
            let threads = args.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
            let report = swarm(&scenario, a..b, threads, data_root, &options)?;
            let mut failing = 0;
            for outcome in report.failing() {
                failing += 1;
                print_violation(outcome, args);
            }
            if let Some(first) = report.failing().next() {
                println!("first failing seed: {} ({failing} of {} seeds fail)", first.seed, report.outcomes.len());
            }
            println!(
                "{} seeds, {failing} failing; {:.2} s wall on {} thread(s): {:.1} seeds/s, virtual/wall {:.1}x, {:.0} committed steps per wall second",
                report.outcomes.len(),
                report.wall.as_secs_f64(),
                report.threads,
                report.seeds_per_s(),
                report.virtual_to_wall(),
                report.steps_per_wall_s()
            );
            if let Some(slowest) = report.outcomes.iter().max_by_key(|o| o.virtual_time) {
                println!(
                    "longest run: seed {} took {:.3} s of virtual time (liveness bound {:.0} s)",
                    slowest.seed,
                    slowest.virtual_time.as_secs_f64(),
                    scenario.max_virtual.as_secs_f64()
                );
            }
            if failing > 0 {
                bail!("{failing} seed(s) broke invariants");
            }
            Ok(())
        }
        (None, None) => bail!("give --seed S or --seeds A..B"),
    }
}

fn print_violation(outcome: &Outcome, args: &SimArgs) {
    let Some(v) = &outcome.violation else { return };
    println!("seed {}: VIOLATION of {}: {}", outcome.seed, v.invariant, v.detail);
    println!("  first bad event (#{} at {:.3} s virtual): {}", v.event_index, v.at.as_secs_f64(), v.event);
    println!("  replay: rtx sim --scenario {} --seed {}{}", args.scenario.display(), outcome.seed, if args.planted_bug { " --planted-bug" } else { "" });
}
