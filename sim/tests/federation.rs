//! Federated scenarios in the simulator: the real coordinator and client hosts over the simulated
//! control network, with seeded host crashes, partitions and slow links. Every seed holds every
//! invariant (twin-equal with the in-process federation, exactly-once, round-deadline,
//! quiet-host-kept, liveness) and replays to the same trace; faults really cost hosts; bad
//! scenarios are refused with a reason; secure rounds over the same faults unmask exactly.
//! `RTX_SIM_SEEDS=A..B` picks other seeds.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use rtx_sim::{fed_swarm, run_fed_seed, FedOutcome, FedScenario};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn data_root() -> PathBuf {
    std::env::var_os("RTX_DATA_DIR").map_or_else(|| root().join("data"), PathBuf::from)
}

fn scenario() -> FedScenario {
    FedScenario::load(&root().join("sim/scenarios/fed_hosts.toml")).unwrap()
}

fn seeds(default: std::ops::Range<u64>) -> std::ops::Range<u64> {
    std::env::var("RTX_SIM_SEEDS").ok().and_then(|r| r.split_once("..").and_then(|(a, b)| Some(a.parse().ok()?..b.parse().ok()?))).unwrap_or(default)
}

/// Runs `seeds` of `sim/scenarios/FILE` twice; every seed must hold every invariant and replay to
/// the same trace. Returns the first run's outcomes.
fn swarm_twice(file: &str, seeds: std::ops::Range<u64>) -> Vec<FedOutcome> {
    let scenario = FedScenario::load(&root().join("sim/scenarios").join(file)).unwrap();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let first = fed_swarm(&scenario, seeds.clone(), threads, &data_root(), false).unwrap();
    let second = fed_swarm(&scenario, seeds, threads, &data_root(), false).unwrap();
    for (a, b) in first.outcomes.iter().zip(&second.outcomes) {
        println!(
            "seed {}: trace {:016x}, {} rounds, {} faults, hosts done/lost/late {}/{}/{}, {} rejoins, secure rounds aborted {}, clients unmasked from shares {}, accuracy {:.3}, {:.1} virtual s",
            a.seed, a.trace, a.rounds, a.faults, a.hosts_done, a.hosts_lost, a.hosts_late, a.rejoins, a.secure_aborted, a.secure_recovered, a.accuracy, a.virtual_time.as_secs_f64()
        );
        if let Some(v) = &a.violation {
            panic!("seed {} broke {}: {}\n{}\nreplay: rtx sim --scenario sim/scenarios/{file} --seed {}", a.seed, v.invariant, v.detail, v.recent.join("\n"), a.seed);
        }
        assert_eq!(a.trace, b.trace, "seed {} did not replay: rtx sim --scenario sim/scenarios/{file} --seed {}", a.seed, a.seed);
    }
    first.outcomes
}

#[test]
fn every_seed_holds_every_invariant_and_replays() {
    let outcomes = swarm_twice("fed_hosts.toml", seeds(0..24));
    // The faults bite: hosts were lost or late, processes rejoined, and the model still learned.
    let lost: u64 = outcomes.iter().map(|o| o.hosts_lost + o.hosts_late).sum();
    let rejoins: u64 = outcomes.iter().map(|o| o.rejoins).sum();
    assert!(lost > 0 && rejoins > 0, "no host was ever lost ({lost}) or rejoined ({rejoins}): the faults did nothing");
    assert!(outcomes.iter().all(|o| o.accuracy > 0.6), "a seed's final model did not learn");
}

#[test]
fn a_host_crash_without_restart_costs_only_its_slice_for_the_rest_of_the_run() {
    let mut scenario = scenario();
    scenario.random = Default::default();
    scenario.faults = vec![rtx_sim::FedFault { kind: rtx_sim::FedFaultKind::Crash, host: 2, at_s: 0.5, for_s: None, delay_ms: 0.0 }];
    let outcome = run_fed_seed(&scenario, 7, &data_root(), false).unwrap();
    assert!(outcome.violation.is_none(), "{:?}", outcome.violation);
    let rounds = u64::from(outcome.rounds);
    assert_eq!(outcome.rejoins, 0);
    // Host 2 delivered at most the rounds before 0.5 s and none after.
    assert!(outcome.hosts_done < 4 * rounds && outcome.hosts_done >= 3 * rounds, "{outcome:?}");
}

#[test]
fn bad_federated_scenarios_are_refused_with_the_reason() {
    let text = std::fs::read_to_string(root().join("sim/scenarios/fed_hosts.toml")).unwrap();
    let dir = root().join("sim/scenarios");
    let cases = [
        (text.replace("\"1100..1500\", \"1500..2000\"", "\"1100..1500\""), "not at the population's 2000"),
        (text.replace("\"500..1100\", \"1100..1500\"", "\"500..1200\", \"1100..1500\""), "must start at 1200"),
        (text.replace("round_timeout_s = 3.0", "round_timeout_s = -1.0"), "round_timeout_s"),
        (text.replace("[federation.faults]", "[federation.async]\nbuffer_size = 10\nmax_staleness = 2\nconcurrency = 20\n[federation.faults]"), "does not run over client hosts"),
        (text.replace("threads = 1", "threads = 1\nhosts = 4"), "come from the scenario"),
        (format!("{text}\n[[faults]]\nkind = \"crash\"\nhost = 9\nat_s = 1.0\n"), "there are 4 hosts"),
        (format!("{text}\n[[faults]]\nkind = \"partition\"\nhost = 1\nat_s = 1.0\n"), "needs for_s"),
        (text.replace("kind = \"federation\"", "kind = \"federation\"\nbogus = 1"), "unknown field"),
    ];
    for (bad, why) in cases {
        let err = FedScenario::parse(&bad, &dir).unwrap_err().to_string();
        assert!(err.contains(why), "expected {why:?} in: {err}");
    }
    assert!(FedScenario::is_federated(&text));
    let elastic = std::fs::read_to_string(root().join("sim/scenarios/elastic_dp.toml")).unwrap();
    assert!(!FedScenario::is_federated(&elastic));
}

#[test]
fn secure_rounds_over_faulty_hosts_unmask_exactly_and_replay() {
    // Goal: `[secagg]` over client hosts that crash, are cut off or slowed at any phase of the
    // protocol: every unmasked sum equals the sum of the included clients' inputs (or the round
    // aborts with the model unchanged), and each seed replays to the same trace.
    let outcomes = swarm_twice("fed_secagg_hosts.toml", seeds(0..10));
    let lost: u64 = outcomes.iter().map(|o| o.hosts_lost + o.hosts_late).sum();
    let unmasked = outcomes.iter().map(|o| u64::from(o.rounds) - o.secure_aborted).sum::<u64>();
    assert!(lost > 0 && unmasked > 0, "faults never cost a host ({lost}) or no round unmasked ({unmasked})");
}
