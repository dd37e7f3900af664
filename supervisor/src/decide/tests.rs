//! The core driven directly: inputs in, commands out, virtual instants, no links or processes.

use std::time::Duration;

use super::*;
use crate::config::{ElasticConfig, MeshModel};
use crate::protocol::ShardSource;
use rtx_pipelines::ModelDims;

fn options(elastic: ElasticConfig) -> SupervisorOptions {
    SupervisorOptions {
        listen: "127.0.0.1:0".parse().expect("address"),
        token: "t".into(),
        job: String::new(),
        total_steps: 100,
        stop_at: None,
        elastic,
        resume: None,
        resume_next_step: 0,
        run_dir: None,
        link: Default::default(),
    }
}

/// A (1, 2, 2) mesh job of 4 workers that checkpoints, with the re-partition model of a 4-block
/// GPT of 4 heads.
fn mesh_elastic(on_failure: OnFailure) -> ElasticConfig {
    let mut e = ElasticConfig { start_workers: 4, max_workers: 4, pp: 2, tp: 2, checkpoint_every: 10, ..ElasticConfig::default() };
    e.mesh_model = Some(MeshModel { dims: ModelDims { layers: 4, heads: 4, vocab: 256, mlp_hidden: 256 }, chunks: 1 });
    for p in [&mut e.crash, &mut e.hang, &mut e.network_loss] {
        p.on_failure = on_failure;
    }
    e
}

struct Driver {
    core: SupervisorCore,
    now: Instant,
}

impl Driver {
    fn new(elastic: ElasticConfig) -> Driver {
        let now = Instant::now();
        Driver { core: SupervisorCore::new(options(elastic), "run".into(), true, now), now }
    }

    fn join(&mut self, node: u64) -> Vec<Command> {
        self.now += Duration::from_millis(1);
        self.core.join(node, format!("worker-{node}"), node as u32 + 1000, "host".into(), self.now).expect("no failure").expect("admitted");
        self.core.take_commands()
    }

    fn send(&mut self, input: Input) -> Vec<Command> {
        self.now += Duration::from_millis(1);
        self.core.handle(input, self.now).expect("no failure");
        self.core.take_commands()
    }

    fn message(&mut self, node: u64, msg: ToSupervisor) -> Vec<Command> {
        self.send(Input::Message { node, msg })
    }

    /// Answers every `Prepare` in `commands` with `Ready` holding `held(node)`; the `Start`s sent.
    fn ready_all(&mut self, commands: &[Command], held: impl Fn(u64) -> Option<MeshHeld>) -> Vec<(u64, ToWorker)> {
        let prepared: Vec<(u64, u64)> = commands.iter().filter_map(|c| match c {
            Command::Prepare { node, generation, .. } => Some((*node, *generation)),
            _ => None,
        }).collect();
        let mut starts = Vec::new();
        for (node, generation) in prepared {
            for c in self.message(node, ToSupervisor::Ready { node, generation, addr: format!("a{node}"), completed: None, zero1: Vec::new(), mesh: held(node) }) {
                if let Command::Tell { node, msg: msg @ ToWorker::Start { .. } } = c {
                    starts.push((node, msg));
                }
            }
        }
        starts
    }

    /// Every member reports `step` of `generation`.
    fn step(&mut self, nodes: &[u64], generation: u64, step: u64) -> Vec<Command> {
        nodes.iter().flat_map(|&node| self.message(node, ToSupervisor::StepDone { node, generation, step, loss: 1.0, samples: 4, checksum: None })).collect()
    }
}

fn generation_event(commands: &[Command]) -> Option<(usize, u64, (usize, usize, usize))> {
    commands.iter().find_map(|c| match c {
        Command::Emit(JobEvent::Generation { world, next_step, mesh, .. }) => Some((*world, *next_step, *mesh)),
        _ => None,
    })
}

fn prepares(commands: &[Command]) -> Vec<u64> {
    commands.iter().filter_map(|c| match c {
        Command::Prepare { node, .. } => Some(*node),
        _ => None,
    }).collect()
}

/// Goal: the decisions of a mesh that loses a member, driven through the pure core alone: with no
/// replacement coming it re-partitions to (1,3,1) from the newest checkpoint, and goes back to
/// (1,2,2) only at a checkpoint of its newest committed step once a worker joins; with a
/// replacement on its way it waits for it instead.
#[test]
fn a_mesh_short_of_a_replica_re_partitions_from_the_checkpoint_and_grows_back_at_the_next_one() {
    let mut d = Driver::new(mesh_elastic(OnFailure::Shrink));
    let mut commands = Vec::new();
    for node in 1..=4 {
        commands.extend(d.join(node));
    }
    assert_eq!(prepares(&commands), vec![1, 2, 3, 4]);
    let starts = d.ready_all(&commands, |_| None);
    assert_eq!(starts.len(), 4);
    for step in 0..12 {
        d.step(&[1, 2, 3, 4], 1, step);
    }
    let at = |slot: u32, step: u64| Some(MeshHeld { slots: 4, tp: 2, slot, step });
    d.message(1, ToSupervisor::Checkpointed { node: 1, step: 9, path: "ckpt-9".into() });

    // Node 3 dies: three members, no replacement.
    let lost = d.send(Input::ProcessExited { pid: 1003, status: "killed".into() });
    assert!(d.send(Input::LinkLost { node: 3, reason: "gone".into() }).is_empty(), "a loss is decided once");
    assert!(lost.iter().any(|c| matches!(c, Command::Emit(JobEvent::Lost { node: 3, .. }))), "{lost:?}");
    assert_eq!(prepares(&lost), vec![1, 2, 4]);
    let held = |node: u64| at((node - 1) as u32, 11);
    let starts = d.ready_all(&lost, held);
    assert_eq!(starts.len(), 3);
    for (_, start) in &starts {
        let ToWorker::Start { next_step, mesh: Some(mesh), .. } = start else { panic!("a mesh start: {start:?}") };
        assert_eq!((*next_step, mesh.dp, mesh.pp, mesh.tp), (10, 1, 3, 1));
        assert_eq!(mesh.sources, vec![ShardSource::Checkpoint { location: "ckpt-9".into(), step: 9 }; 3]);
    }
    for step in 10..14 {
        d.step(&[1, 2, 4], 2, step);
    }

    // A worker joins: no change of shape until a checkpoint holds the newest committed step. The
    // checkpoint of step 14 arrives before step 14 is committed (its writer reports it before the
    // others' StepDone): the mesh changes back at that commit, so no step is left uncommitted.
    let joined = d.join(5);
    assert!(prepares(&joined).is_empty(), "{joined:?}");
    let early = d.message(1, ToSupervisor::Checkpointed { node: 1, step: 14, path: "ckpt-14".into() });
    assert!(prepares(&early).is_empty(), "{early:?}");
    let grown = d.step(&[1, 2, 4], 2, 14);
    assert!(grown.iter().any(|c| matches!(c, Command::Emit(JobEvent::Committed { step: 14, .. }))));
    assert_eq!(prepares(&grown), vec![1, 2, 4, 5]);
    let starts = d.ready_all(&grown, |node| if node == 5 { None } else { Some(MeshHeld { slots: 3, tp: 1, slot: 0, step: 14 }) });
    assert!(starts.len() == 4 && starts.iter().all(|(_, s)| matches!(s, ToWorker::Start { next_step: 15, mesh: Some(MeshStart { dp: 1, pp: 2, tp: 2, .. }), .. })), "{starts:?}");
}

/// Goal: under `on_failure = "replace"` a mesh that lost a member waits for the replacement it
/// asked the launcher for (no re-partition), refills the lost slot from it, and stops waiting
/// after `prepare_timeout` if the replacement never joins.
#[test]
fn a_mesh_waits_for_its_replacement_and_re_partitions_only_if_it_never_comes() {
    let mut d = Driver::new(mesh_elastic(OnFailure::Replace));
    let mut commands = Vec::new();
    for node in 1..=4 {
        commands.extend(d.join(node));
    }
    d.ready_all(&commands, |_| None);
    for step in 0..10 {
        d.step(&[1, 2, 3, 4], 1, step);
    }
    d.message(1, ToSupervisor::Checkpointed { node: 1, step: 9, path: "ckpt-9".into() });
    let lost = d.send(Input::LinkLost { node: 2, reason: "gone".into() });
    assert!(lost.contains(&Command::Launch(LaunchRequest::Spawn)), "{lost:?}");
    assert!(prepares(&lost).is_empty(), "waits for the replacement: {lost:?}");
    assert!(generation_event(&lost).is_none());

    // The replacement joins and takes slot 1; the others keep theirs.
    let joined = d.join(5);
    assert_eq!(prepares(&joined), vec![1, 5, 3, 4]);

    // Another loss, and this time the replacement never comes: after prepare_timeout the mesh
    // re-partitions over the three it has.
    let held = |node: u64| Some(MeshHeld { slots: 4, tp: 2, slot: [1, 5, 3, 4].iter().position(|&n| n == node).map_or(0, |s| s as u32), step: 9 });
    d.ready_all(&joined, held);
    d.send(Input::LinkLost { node: 4, reason: "gone".into() });
    d.now += ElasticConfig::default().prepare_timeout + Duration::from_millis(10);
    for node in [1, 3, 5] {
        d.message(node, ToSupervisor::Heartbeat { node, generation: 2, completed: Some(9) });
    }
    let after = d.send(Input::Tick);
    assert_eq!(prepares(&after), vec![1, 3, 5]);
}

/// Goal: under `on_failure = "replace"` a data-parallel group that lost a rank waits for the
/// replacement it asked the launcher for instead of shrinking and growing back (a ZeRO job would
/// re-shard twice): the survivors pause, the replacement joins into a generation of the old size
/// with the survivors in their ranks; a replacement that never comes is waited for only up to
/// `prepare_timeout`, then the group shrinks. Under `shrink` it shrinks at once.
#[test]
fn a_data_parallel_group_waits_for_its_replacement_and_shrinks_only_if_it_never_comes() {
    let policy = |on_failure| {
        let mut e = ElasticConfig { start_workers: 3, max_workers: 3, min_workers: 1, ..ElasticConfig::default() };
        for p in [&mut e.crash, &mut e.hang, &mut e.network_loss] {
            p.on_failure = on_failure;
        }
        e
    };
    let mut d = Driver::new(policy(OnFailure::Replace));
    let mut commands = Vec::new();
    for node in 1..=3 {
        commands.extend(d.join(node));
    }
    assert_eq!(prepares(&commands), vec![1, 2, 3]);
    d.ready_all(&commands, |_| None);
    for step in 0..5 {
        d.step(&[1, 2, 3], 1, step);
    }
    let lost = d.send(Input::LinkLost { node: 2, reason: "gone".into() });
    assert!(lost.contains(&Command::Launch(LaunchRequest::Spawn)), "{lost:?}");
    assert!(prepares(&lost).is_empty(), "waits for the replacement: {lost:?}");
    let paused: Vec<u64> = lost.iter().filter_map(|c| match c {
        Command::Tell { node, msg: ToWorker::Pause { .. } } => Some(*node),
        _ => None,
    }).collect();
    assert_eq!(paused, vec![1, 3], "the survivors stop the old generation: {lost:?}");

    // The replacement takes rank 1; the survivors keep theirs; training resumes after step 4.
    let joined = d.join(4);
    assert_eq!(prepares(&joined), vec![1, 4, 3]);
    let started = d.ready_all(&joined, |_| None);
    assert_eq!(started.len(), 3);
    let generation = started.iter().find_map(|(_, m)| match m {
        ToWorker::Start { generation, .. } => Some(*generation),
        _ => None,
    }).expect("generation");

    // Another loss, and this replacement never comes: after prepare_timeout, two ranks.
    d.step(&[1, 4, 3], generation, 5);
    d.send(Input::LinkLost { node: 3, reason: "gone".into() });
    d.now += ElasticConfig::default().prepare_timeout + Duration::from_millis(10);
    for node in [1, 4] {
        d.message(node, ToSupervisor::Heartbeat { node, generation, completed: Some(5) });
    }
    assert_eq!(prepares(&d.send(Input::Tick)), vec![1, 4]);

    // `shrink` asks for nobody and forms the survivors' group at once.
    let mut d = Driver::new(policy(OnFailure::Shrink));
    let mut commands = Vec::new();
    for node in 1..=3 {
        commands.extend(d.join(node));
    }
    d.ready_all(&commands, |_| None);
    let lost = d.send(Input::LinkLost { node: 2, reason: "gone".into() });
    assert!(!lost.contains(&Command::Launch(LaunchRequest::Spawn)), "{lost:?}");
    assert_eq!(prepares(&lost), vec![1, 3]);
}

/// Goal: a mesh whose steps were committed but that has no checkpoint cannot re-partition (it would
/// restart from the initial parameters): it waits for workers.
#[test]
fn without_a_checkpoint_a_mesh_waits_instead_of_re_partitioning() {
    let mut d = Driver::new(mesh_elastic(OnFailure::Shrink));
    let mut commands = Vec::new();
    for node in 1..=4 {
        commands.extend(d.join(node));
    }
    d.ready_all(&commands, |_| None);
    d.step(&[1, 2, 3, 4], 1, 0);
    let lost = d.send(Input::LinkLost { node: 4, reason: "gone".into() });
    assert!(prepares(&lost).is_empty(), "{lost:?}");
    let paused: Vec<u64> = lost.iter().filter_map(|c| match c {
        Command::Tell { node, msg: ToWorker::Pause { .. } } => Some(*node),
        _ => None,
    }).collect();
    assert_eq!(paused, vec![1, 2, 3], "the survivors stop the old generation");
    let joined = d.join(5);
    assert_eq!(prepares(&joined).len(), 4, "a new worker refills the mesh: {joined:?}");
}

/// Goal: a step every member of a generation reported is committed even when a new generation
/// (here: a grow, a worker joined) interrupted it before the last report arrived, so the new
/// generation, which resumes after the step its members hold, leaves no committed step out.
#[test]
fn a_step_reported_after_a_new_generation_began_is_still_committed() {
    let mut d = Driver::new(ElasticConfig { start_workers: 2, max_workers: 3, ..ElasticConfig::default() });
    let mut commands = d.join(1);
    commands.extend(d.join(2));
    d.ready_all(&commands, |_| None);
    for step in 0..6 {
        d.step(&[1, 2], 1, step);
    }
    d.message(1, ToSupervisor::StepDone { node: 1, generation: 1, step: 6, loss: 1.0, samples: 4, checksum: None });
    let grown = d.join(3);
    assert_eq!(prepares(&grown), vec![1, 2, 3]);
    let late = d.message(2, ToSupervisor::StepDone { node: 2, generation: 1, step: 6, loss: 1.0, samples: 4, checksum: None });
    assert!(late.iter().any(|c| matches!(c, Command::Emit(JobEvent::Committed { step: 6, generation: 1, .. }))), "{late:?}");
    // A report of a generation that was never interrupted this way is still ignored.
    assert!(d.message(2, ToSupervisor::StepDone { node: 2, generation: 0, step: 7, loss: 1.0, samples: 4, checksum: None }).is_empty());
}

#[test]
fn a_mesh_step_checksum_covers_every_slot_and_names_the_slot_whose_replicas_disagree() {
    // Goal: data parallelism keeps the replicas' own checksum; a mesh's folds each slot's in slot
    // order (rank r holds slot r % slots), so a change in any slot changes it; two holders of one
    // slot that disagree name that slot; a member without a checksum gives none.
    let members = [10, 11, 12, 13];
    let dp = |node: u64| Some(if node < 100 { 7 } else { 8 });
    assert_eq!(combined_checksum(&members, 1, dp), Ok(Some(7)));
    let slot_sum = |slot_of_changed: u64, value: u64| move |node: u64| Some(if node % 2 == slot_of_changed { value } else { (node % 2) + 100 });
    let base = combined_checksum(&members, 2, slot_sum(0, 100)).expect("agree").expect("complete");
    let changed = combined_checksum(&members, 2, slot_sum(0, 555)).expect("agree").expect("complete");
    assert_ne!(base, changed);
    let swapped = combined_checksum(&members, 2, |node| Some(if node % 2 == 0 { 101 } else { 100 })).expect("agree").expect("complete");
    assert_ne!(base, swapped, "the slot order is part of the checksum");
    let diverged = combined_checksum(&members, 2, |node| Some(if node == 13 { 9 } else { node % 2 }));
    assert_eq!(diverged, Err((1, vec![1, 9])));
    assert_eq!(combined_checksum(&members, 2, |node| (node != 12).then_some(1)), Ok(None));
}

/// Drives a 2-worker job to its end (100 steps) and returns the driver in `Finishing`.
fn finishing(elastic: ElasticConfig) -> Driver {
    let mut d = Driver::new(ElasticConfig { start_workers: 2, max_workers: 2, ..elastic });
    let mut commands = d.join(1);
    commands.extend(d.join(2));
    d.ready_all(&commands, |_| None);
    for step in 0..99 {
        d.step(&[1, 2], 1, step);
    }
    let last = d.step(&[1, 2], 1, 99);
    let finish_sent = last.iter().filter(|c| matches!(c, Command::Tell { msg: ToWorker::Finish, .. })).count();
    assert_eq!(finish_sent, 2, "{last:?}");
    assert_eq!(d.core.status().phase, "finishing");
    d
}

/// Both members heartbeat for `secs` seconds of virtual time, one tick a second.
fn heartbeat_for(d: &mut Driver, secs: u64) -> Vec<Command> {
    let mut out = Vec::new();
    for _ in 0..secs {
        d.now += Duration::from_millis(999);
        for node in [1, 2] {
            out.extend(d.message(node, ToSupervisor::Heartbeat { node, generation: 1, completed: Some(99) }));
        }
        out.extend(d.send(Input::Tick));
    }
    out
}

fn finished_eval(commands: &[Command]) -> Option<Vec<(String, f64)>> {
    commands.iter().find_map(|c| match c {
        Command::Emit(JobEvent::Finished { eval, .. }) => Some(eval.clone()),
        _ => None,
    })
}

/// Goal: the final evaluation is bounded by `finish_timeout`, not by `prepare_timeout`: a live
/// member whose probes take longer than the prepare timeout (here 90 s against 30 s) still
/// delivers its metrics; one that never reports is left out once `finish_timeout` passes, and the
/// job finishes then, not before.
#[test]
fn the_final_evaluation_may_outlast_the_prepare_timeout_but_not_the_finish_timeout() {
    let prepare = ElasticConfig::default().prepare_timeout;
    let mut d = finishing(ElasticConfig::default());
    assert!(d.message(1, ToSupervisor::Finished { node: 1, checksum: 7, eval: Vec::new(), compute_s: 1.0, control_s: 0.0, loop_s: 1.0 }).is_empty());
    let waited = heartbeat_for(&mut d, prepare.as_secs() * 3);
    assert_eq!(finished_eval(&waited), None, "the job finished before the evaluation did");
    let probes = vec![("probe_test_acc".to_string(), 0.88)];
    let done = d.message(2, ToSupervisor::Finished { node: 2, checksum: 7, eval: probes.clone(), compute_s: 1.0, control_s: 0.0, loop_s: 1.0 });
    assert_eq!(finished_eval(&done), Some(probes));

    let bound = Duration::from_secs(120);
    let mut d = finishing(ElasticConfig { finish_timeout: bound, ..ElasticConfig::default() });
    d.message(1, ToSupervisor::Finished { node: 1, checksum: 7, eval: vec![("loss".into(), 1.0)], compute_s: 1.0, control_s: 0.0, loop_s: 1.0 });
    assert_eq!(finished_eval(&heartbeat_for(&mut d, bound.as_secs() - 5)), None);
    let late = heartbeat_for(&mut d, 10);
    assert_eq!(finished_eval(&late), Some(vec![("loss".into(), 1.0)]), "the stuck member was not left out at finish_timeout");
    assert_eq!(d.core.status().phase, "done");
}

/// Goal: data-parallel ranks keep survivors in place when the world does not shrink. Method: the
/// cases by hand: a replacement takes the lost rank; two lost, two newcomers in node order; a
/// shrink packs the survivors in order; a growth appends; `max` caps.
#[test]
fn a_replacement_takes_the_lost_rank_and_survivors_keep_theirs() {
    assert_eq!(data_parallel_ranks(&[1, 2, 3], &[1, 3, 4], 8), vec![1, 4, 3]);
    assert_eq!(data_parallel_ranks(&[1, 2, 3, 4], &[2, 4, 7, 9], 8), vec![7, 2, 9, 4]);
    assert_eq!(data_parallel_ranks(&[3, 1, 2], &[1, 2], 8), vec![1, 2]);
    assert_eq!(data_parallel_ranks(&[3, 1, 2], &[1, 2, 3, 5, 6], 8), vec![3, 1, 2, 5, 6]);
    assert_eq!(data_parallel_ranks(&[1, 2], &[1, 3, 4, 5], 3), vec![1, 3, 4]);
    assert_eq!(data_parallel_ranks(&[1, 2, 3], &[1, 3, 4], 2), vec![1, 3]);
    assert_eq!(data_parallel_ranks(&[], &[5, 6], 8), vec![5, 6]);
}
