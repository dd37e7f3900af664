//! `rtx sim`: runs a scenario of the deterministic simulator (`rtx-sim`) for one seed, printing
//! its trace hash and the invariants checked (or the first broken one, its event and the command
//! that replays it, after the job events and faults that led there), or for a range of seeds as a
//! swarm across cores, printing every failing seed with its replay command and a summary (seeds
//! per second, virtual-to-wall time ratio, committed steps per wall second).

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context};
use rtx_sim::{fed_swarm, run_fed_seed, run_seed, swarm, FedOutcome, FedScenario, Outcome, RunOptions, Scenario};
use rtx_supervisor::PlantedBug;

use crate::cli::SimArgs;

/// Runs `rtx sim` with data from `data_root`.
pub fn run(args: &SimArgs, data_root: &Path) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&args.scenario).with_context(|| format!("cannot read the scenario {}", args.scenario.display()))?;
    if FedScenario::is_federated(&text) {
        return run_federated(args, data_root);
    }
    let scenario = Scenario::load(&args.scenario)?;
    // The planted bug of the scenario's kind: a replayed step (data parallelism), a replacement
    // that starts its mesh slot from the initial parameters (a `[mesh]` scenario).
    let planted_bug = match (args.planted_bug, scenario.mesh.is_some()) {
        (false, _) => PlantedBug::None,
        (true, false) => PlantedBug::ReplayLastStep,
        (true, true) => PlantedBug::MeshSlotFromInitial,
    };
    let options = RunOptions { planted_bug, ..RunOptions::default() };
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
            let (seeds, threads) = (seed_range(range)?, threads(args));
            let report = swarm(&scenario, seeds, threads, data_root, &options)?;
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

/// `--seeds A..B` as a range.
fn seed_range(range: &str) -> anyhow::Result<std::ops::Range<u64>> {
    let (a, b) = range.split_once("..").context("--seeds takes A..B")?;
    let (a, b): (u64, u64) = (a.trim().parse().context("--seeds: A")?, b.trim().parse().context("--seeds: B")?);
    if a >= b {
        bail!("--seeds {a}..{b} is empty");
    }
    Ok(a..b)
}

fn threads(args: &SimArgs) -> usize {
    args.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// A federated scenario (`[scenario] kind = "federation"`): one seed or a swarm.
fn run_federated(args: &SimArgs, data_root: &Path) -> anyhow::Result<()> {
    let scenario = FedScenario::load(&args.scenario)?;
    let invariants = if scenario.config.secagg.is_some() {
        "unmask-exact (every unmasked sum equals the sum of the included clients' encoded inputs; an aborted round left the model), exactly-once, round-deadline, quiet-host-kept, liveness"
    } else {
        "twin-equal (every round's model bits and counts equal the in-process federation with the hosts that did not deliver marked down), exactly-once, round-deadline, quiet-host-kept, liveness"
    };
    match (args.seed, &args.seeds) {
        (Some(seed), _) => {
            let started = Instant::now();
            let o = run_fed_seed(&scenario, seed, data_root, args.planted_bug)?;
            let wall = started.elapsed().as_secs_f64();
            println!(
                "seed {seed}: trace {:016x}; {}/{} rounds; {} fault(s); hosts done/lost/late {}/{}/{}, {} rejoin(s); clients done {}, dropped {}{}; test accuracy {:.4}; {} invariant checks; virtual {:.3} s in {wall:.3} s wall",
                o.trace,
                o.rounds,
                scenario.config.round.rounds,
                o.faults,
                o.hosts_done,
                o.hosts_lost,
                o.hosts_late,
                o.rejoins,
                o.clients_done,
                o.dropped,
                secure_summary(&scenario, o.secure_aborted, o.secure_recovered),
                o.accuracy,
                o.checks,
                o.virtual_time.as_secs_f64()
            );
            if let Some(v) = &o.violation {
                println!("the federation's log before it:");
                for line in &v.recent {
                    println!("  {line}");
                }
                print_fed_violation(&o, args);
                bail!("seed {seed} broke invariant {}", v.invariant);
            }
            println!("invariants held: {invariants}");
            Ok(())
        }
        (None, Some(range)) => {
            let report = fed_swarm(&scenario, seed_range(range)?, threads(args), data_root, args.planted_bug)?;
            let failing: Vec<&FedOutcome> = report.outcomes.iter().filter(|o| o.violation.is_some()).collect();
            for o in &failing {
                print_fed_violation(o, args);
            }
            let n = report.outcomes.len();
            let sum = |f: fn(&FedOutcome) -> u64| report.outcomes.iter().map(f).sum::<u64>();
            println!(
                "{n} seeds, {} failing; {:.2} s wall on {} thread(s) ({:.1} seeds/s); hosts done/lost/late {}/{}/{}, {} rejoins{} over all seeds",
                failing.len(),
                report.wall.as_secs_f64(),
                report.threads,
                n as f64 / report.wall.as_secs_f64().max(1e-9),
                sum(|o| o.hosts_done),
                sum(|o| o.hosts_lost),
                sum(|o| o.hosts_late),
                sum(|o| o.rejoins),
                secure_summary(&scenario, sum(|o| o.secure_aborted), sum(|o| o.secure_recovered))
            );
            if !failing.is_empty() {
                bail!("{} seed(s) broke invariants", failing.len());
            }
            println!("invariants held on every seed: {invariants}");
            Ok(())
        }
        (None, None) => bail!("give --seed S or --seeds A..B"),
    }
}

/// For secure scenarios: rounds aborted and clients whose self-masks were rebuilt.
fn secure_summary(scenario: &FedScenario, aborted: u64, recovered: u64) -> String {
    if scenario.config.secagg.is_none() {
        return String::new();
    }
    format!("; secure rounds aborted {aborted}, clients unmasked from neighbours' shares {recovered}")
}

fn print_fed_violation(outcome: &FedOutcome, args: &SimArgs) {
    let Some(v) = &outcome.violation else { return };
    println!("seed {}: VIOLATION of {}: {}", outcome.seed, v.invariant, v.detail);
    println!("  replay: rtx sim --scenario {} --seed {}{}", args.scenario.display(), outcome.seed, if args.planted_bug { " --planted-bug" } else { "" });
}

fn print_violation(outcome: &Outcome, args: &SimArgs) {
    let Some(v) = &outcome.violation else { return };
    println!("seed {}: VIOLATION of {}: {}", outcome.seed, v.invariant, v.detail);
    println!("  first bad event (#{} at {:.3} s virtual): {}", v.event_index, v.at.as_secs_f64(), v.event);
    println!("  replay: rtx sim --scenario {} --seed {}{}", args.scenario.display(), outcome.seed, if args.planted_bug { " --planted-bug" } else { "" });
}
