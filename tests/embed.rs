//! The embedding API end to end (`rustytorch::embed`): the example's Fashion-MNIST task trained by
//! in-process workers with one killed in the middle (recovery, a replacement joining, the loss
//! falling), by worker threads joined to a real supervisor started here (the `Remote`
//! placement), and every error path of the builder and the handle. Needs the Fashion-MNIST data
//! (`bash scripts/fetch-data.sh`). The `LocalProcesses` placement is in `tests/embed_local.rs`
//! (its workers re-execute the test binary, which must hold that one test), and checkpoints of an
//! embedded job land in its run folder.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../examples/embed_elastic.rs"]
#[allow(dead_code, unreachable_pub)]
mod example;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use example::{data_root, FashionTask};
use rustytorch::embed::{tasks::Regression, EmbedError, EmbeddedTask, Job, Placement, TaskError, SYNTHETIC_PID_BASE};
use rustytorch::supervisor::{ElasticConfig, JobEvent, SupervisorHandle, SupervisorOptions};
use rustytorch::Tensor;

fn task() -> FashionTask {
    FashionTask::load(&data_root(), 32, 64).expect("Fashion-MNIST in data/ (bash scripts/fetch-data.sh)")
}

/// Goal: an in-process job survives a killed worker. Method: two worker threads, kill rank 1
/// after step 10 with replacement on; steps are committed in order and none twice, the kill is seen as
/// a crash of a synthetic pid, a replacement joins and trains, and the loss falls.
#[test]
fn an_in_process_job_recovers_a_killed_worker_and_a_replacement_joins() {
    let steps = 120;
    let worlds = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&worlds);
    let handle = Job::builder(task())
        .placement(Placement::InProcess { workers: 2 })
        .steps(steps)
        .replace_lost_workers(true)
        .on_event(move |e| {
            if let JobEvent::Generation { world, .. } = e {
                seen.lock().unwrap().push(*world);
            }
        })
        .start()
        .expect("start");
    assert!(handle.wait_for_step(10));
    let pid = handle.kill_worker(1).expect("kill");
    assert!(pid >= SYNTHETIC_PID_BASE);
    let report = handle.wait().expect("the job finishes with the survivors");
    let committed: Vec<u64> = report.losses.iter().map(|s| s.step).collect();
    // Steps are committed in order, never twice, up to the last; a step the survivors completed
    // while a member died is not committed (the next generation starts after it), at most one per
    // re-formation.
    assert!(committed.windows(2).all(|w| w[0] < w[1]) && committed.last() == Some(&(steps - 1)), "{committed:?}");
    assert!(committed.len() + report.generations.len() > steps as usize, "{committed:?}");
    assert_eq!(report.lost.len(), 1, "{:?}", report.lost);
    assert_eq!(report.lost[0].pid, pid);
    assert!(report.generations.len() >= 2, "a new generation after the kill: {:?}", report.generations);
    assert_eq!(report.joined, 3, "a replacement joined: {:?}", report.generations);
    let (first, last) = (report.first_losses_mean(10).unwrap(), report.last_losses_mean(10).unwrap());
    println!("worlds {:?}, loss {first:.4} -> {last:.4}, eval {:?}", worlds.lock().unwrap(), report.eval);
    assert!(last < first * 0.8, "loss fell: {first} -> {last}");
    assert!(report.eval[0].1 > 0.5, "held-out accuracy {:?}", report.eval);
}

/// Goal: the `Remote` placement joins a real supervisor (QUIC control, rank certificates,
/// production collectives). Method: a supervisor started here with an `rtx`-style job text; two
/// embedded worker threads train its 20 steps; a wrong token is refused with a typed error.
#[test]
fn remote_workers_join_a_real_supervisor() {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let token = rustytorch::supervisor::protocol::generate_token().unwrap();
    let elastic = ElasticConfig { min_workers: 2, max_workers: 2, start_workers: 2, ..ElasticConfig::default() };
    let options = SupervisorOptions { listen: "127.0.0.1:0".parse().unwrap(), token: token.clone(), job: "[train]\nsteps = 20\nseed = 3\n".into(), total_steps: 20, stop_at: None, elastic, resume: None, resume_next_step: 0, run_dir: None, link: Default::default() };
    let mut supervisor = runtime.block_on(SupervisorHandle::start(options, None)).expect("supervisor");
    let addr: SocketAddr = supervisor.addr;

    // A wrong token: refused, and the handle cannot kill remote workers.
    let wrong = Job::builder(task()).placement(Placement::Remote { supervisor: addr, token: "wrong".into(), workers: 1 }).steps(20).start().expect("start");
    assert!(matches!(wrong.kill_worker(0), Err(EmbedError::Unsupported { .. })));
    let refused = wrong.wait().expect_err("a wrong token is refused");
    assert!(matches!(refused, EmbedError::Runtime { .. }), "{refused}");

    let job = std::thread::spawn(move || Job::builder(task()).placement(Placement::Remote { supervisor: addr, token, workers: 2 }).steps(20).run());
    let events = runtime.block_on(async {
        let mut events = Vec::new();
        while let Some(e) = supervisor.events.recv().await {
            events.push(e);
        }
        supervisor.join().await.expect("the supervisor finished the job");
        events
    });
    let report = job.join().unwrap().expect("remote workers finished");
    assert_eq!(report.workers_finished, 2);
    let commits: Vec<f64> = events.iter().filter_map(|e| if let JobEvent::Committed { loss, .. } = e { Some(*loss) } else { None }).collect();
    assert_eq!(commits.len(), 20);
    assert!(events.iter().any(|e| matches!(e, JobEvent::Finished { replicas_identical: true, .. })));
    assert!(events.iter().any(|e| matches!(e, JobEvent::Refused { .. })), "the wrong token was refused");
    assert!(commits[15..].iter().sum::<f64>() < commits[..5].iter().sum::<f64>(), "loss fell: {commits:?}");
}

/// A task whose model cannot be built.
struct Broken;

impl EmbeddedTask for Broken {
    type Model = rustytorch::nn::Linear;
    type Optim = rustytorch::optim::AdamW;
    type Batch = ();
    fn build_model(&self, _seed: u64) -> Result<Self::Model, TaskError> {
        Err("no weights on this machine".into())
    }
    fn build_optimizer(&self, _parameters: Vec<(String, Tensor)>) -> Result<Self::Optim, TaskError> {
        Err("unreachable".into())
    }
    fn global_batch(&self) -> usize {
        8
    }
    fn batch(&self, _step: u64, _rank: usize, _world: usize) -> Result<(), TaskError> {
        Ok(())
    }
    fn loss(&self, _model: &mut Self::Model, _batch: &()) -> Result<(Tensor, usize), TaskError> {
        Err("unreachable".into())
    }
}

/// Goal: every bad option and a failing task is a typed error naming what and why, before
/// anything starts; a kill of a rank that does not exist is one too.
#[test]
fn bad_options_and_failing_tasks_are_typed_errors() {
    let option = |r: Result<_, EmbedError>| match r {
        Err(EmbedError::InvalidOption { option, reason }) => format!("{option}: {reason}"),
        Err(other) => panic!("expected InvalidOption, got {other}"),
        Ok(_) => panic!("expected InvalidOption, got a job"),
    };
    let regression = || Regression::new(4, 8).unwrap();
    assert!(option(Job::builder(regression()).placement(Placement::InProcess { workers: 0 }).start()).starts_with("placement"));
    assert!(option(Job::builder(regression()).steps(0).start()).starts_with("steps"));
    assert!(option(Job::builder(regression()).min_workers(3).start()).starts_with("min_workers"));
    assert!(option(Job::builder(regression()).max_workers(1).start()).starts_with("max_workers"));
    assert!(option(Job::builder(regression()).max_workers(9).start()).contains("global batch of 8"));
    let remote = Placement::Remote { supervisor: "127.0.0.1:1".parse().unwrap(), token: "t".into(), workers: 1 };
    assert!(format!("{remote:?}").contains("redacted"));
    assert!(option(Job::builder(regression()).placement(remote).replace_lost_workers(true).start()).starts_with("replace_lost_workers"));
    assert!(Regression::new(0, 8).is_err());

    match Job::builder(Broken).start() {
        Err(e @ EmbedError::Task { during: "building the model", .. }) => assert!(std::error::Error::source(&e).unwrap().to_string().contains("no weights")),
        Err(other) => panic!("expected a task error, got {other}"),
        Ok(_) => panic!("expected a task error"),
    }

    // Enough steps that the job is still running when the kill is asked for (30 steps could end
    // first on a loaded machine, and a finished job answers NotRunning instead).
    let handle = Job::builder(regression()).steps(10_000).start().expect("start");
    assert!(handle.wait_for_step(1));
    assert!(matches!(handle.kill_worker(7), Err(EmbedError::NoSuchRank { rank: 7, world: 2 })));
    let report = handle.wait().expect("finishes");
    assert_eq!(report.losses.len(), 10_000);
    assert!(report.lost.is_empty());
}

/// Goal: an embedded job's checkpoints land in `<run_dir>/checkpoints`, as `rtx launch`'s do.
/// Method: 20 steps of the regression task, a checkpoint every 5; the report lists them and the
/// folder holds their files.
#[test]
fn checkpoints_go_to_the_run_folder() {
    let dir = tempfile::tempdir().unwrap();
    let report = Job::builder(Regression::new(4, 8).unwrap()).steps(20).checkpoint_every(5).run_dir(dir.path()).run().expect("run");
    assert!(!report.checkpoints.is_empty(), "{report:?}");
    let files: Vec<_> = std::fs::read_dir(dir.path().join("checkpoints")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(files.iter().any(|f| f.to_string_lossy().ends_with(".safetensors")), "{files:?}");
}
