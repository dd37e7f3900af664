//! `simulate(scenario, seed, data_dir)`: one seed of the deterministic simulator (`rtx sim
//! --scenario FILE --seed N`), its outcome as a JSON report; the same seed gives the same report.

use std::path::PathBuf;

use pyo3::prelude::*;
use rustytorch::data::DataRoot;
use rustytorch::simulator::{run_seed, RunOptions, Scenario};
use serde_json::json;

use crate::errors::{message, ConfigError, SimulationError};

/// Runs `scenario` (a TOML file like `sim/scenarios/elastic_dp.toml`) for `seed` with the data in
/// `data_dir` (a folder filled by `scripts/fetch-data.sh`); returns the report as JSON text. A
/// broken invariant is in the report (`violation`), not an exception.
#[pyfunction]
#[pyo3(signature = (scenario, seed, data_dir))]
pub(crate) fn simulate(py: Python<'_>, scenario: PathBuf, seed: u64, data_dir: PathBuf) -> PyResult<String> {
    let loaded = Scenario::load(&scenario).map_err(|e| ConfigError::new_err(format!("scenario {}: {}", scenario.display(), message(&e))))?;
    let data_root = DataRoot::new(data_dir);
    let outcome = py
        .detach(|| run_seed(&loaded, seed, data_root.path(), &RunOptions::default()))
        .map_err(|e| SimulationError::new_err(format!("seed {seed} of {}: {}", scenario.display(), message(&e))))?;
    let violation = outcome.violation.as_ref().map(|v| {
        json!({ "invariant": v.invariant, "detail": v.detail, "event_index": v.event_index, "at_s": v.at.as_secs_f64(), "event": v.event, "recent": v.recent })
    });
    let report = json!({
        "scenario": loaded.name,
        "seed": outcome.seed,
        "trace": format!("{:016x}", outcome.trace),
        "ok": outcome.violation.is_none(),
        "violation": violation,
        "committed": outcome.committed,
        "total_steps": loaded.job.total_steps,
        "generations": outcome.generations,
        "faults": outcome.faults,
        "checks": outcome.checks,
        "checksum": format!("{:016x}", outcome.checksum),
        "virtual_time_s": outcome.virtual_time.as_secs_f64(),
        "exact_recovery_checked": outcome.exact_recovery_checked,
        "events": outcome.events,
        "checkpoints_written": outcome.checkpoints.0,
        "checkpoints_failed": outcome.checkpoints.1,
        "eval": outcome.eval.iter().cloned().collect::<std::collections::BTreeMap<String, f64>>(),
    });
    Ok(report.to_string())
}
