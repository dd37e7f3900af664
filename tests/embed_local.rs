//! The `LocalProcesses` placement of the embedding API: worker processes are this test binary
//! started again, which `run_worker_if_child` turns into workers, so this file holds exactly one
//! test. Needs the Fashion-MNIST data (`bash scripts/fetch-data.sh`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../examples/embed_elastic.rs"]
#[allow(dead_code, unreachable_pub)]
mod example;

use example::{data_root, FashionTask};
use rustytorch::embed::{self, Job, Placement, SYNTHETIC_PID_BASE};

const TEST_NAME: &str = "worker_processes_recover_a_killed_worker";

/// Goal: a job of two worker processes recovers a SIGKILLed worker and finishes with the
/// survivor. Method: kill rank 1 after step 10; steps are committed in order, the lost worker is
/// a real process (a pid below the synthetic range), and the loss falls.
#[test]
fn worker_processes_recover_a_killed_worker() {
    embed::run_worker_if_child(|| FashionTask::load(&data_root(), 32, 64)).expect("worker process");
    let steps = 80;
    let task = FashionTask::load(&data_root(), 32, 64).expect("Fashion-MNIST in data/ (bash scripts/fetch-data.sh)");
    let handle = Job::builder(task).placement(Placement::LocalProcesses { workers: 2 }).steps(steps).child_args(vec![TEST_NAME.into(), "--exact".into(), "--nocapture".into()]).start().expect("start");
    assert!(handle.wait_for_step(10));
    let pid = handle.kill_worker(1).expect("kill");
    assert!(pid < SYNTHETIC_PID_BASE);
    let report = handle.wait().expect("the job finishes with the survivor");
    let committed: Vec<u64> = report.losses.iter().map(|s| s.step).collect();
    // Steps are committed in order, never twice, up to the last; a step the survivors completed
    // while a member died is not committed (the next generation starts after it), at most one per
    // re-formation.
    assert!(committed.windows(2).all(|w| w[0] < w[1]) && committed.last() == Some(&(steps - 1)), "{committed:?}");
    assert!(committed.len() + report.generations.len() > steps as usize, "{committed:?}");
    assert_eq!(report.lost.len(), 1, "{:?}", report.lost);
    assert_eq!(report.lost[0].pid, pid);
    assert_eq!(report.generations.last().map(|g| g.world), Some(1));
    let (first, last) = (report.first_losses_mean(10).unwrap(), report.last_losses_mean(10).unwrap());
    assert!(last < first, "loss fell: {first} -> {last}");
}
