//! `worker_main(argv)`: the worker process of a job launched from Python (`python -m
//! rustytorch._worker --join ADDR`), the same code as `rtx worker` (`elastic::worker`), with the
//! same arguments and environment (`RTX_TOKEN`, `RTX_DATA_DIR`, `RTX_RUN_DIR`, `RUST_LOG`).

use clap::Parser as _;
use pyo3::prelude::*;
use rustytorch::cli::{Cli, Command};

use crate::errors::{ConfigError, JobError};

/// Runs a worker until its job ends; `argv` are the arguments after `rtx worker`. Installs a
/// tracing subscriber (stderr, `RUST_LOG`, default `warn`): this is the process's main program.
#[pyfunction]
pub(crate) fn worker_main(py: Python<'_>, argv: Vec<String>) -> PyResult<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // Fails only when a subscriber is already installed (a second call): then that one stays.
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(false).try_init();
    let full: Vec<String> = ["rtx", "worker"].into_iter().map(String::from).chain(argv).collect();
    let cli = Cli::try_parse_from(&full).map_err(|e| ConfigError::new_err(e.to_string()))?;
    let Command::Worker(args) = cli.command else {
        return Err(ConfigError::new_err("worker_main runs `rtx worker` only"));
    };
    py.detach(|| rustytorch::elastic::worker(args)).map_err(|e| JobError::new_err(format!("{e:#}")))
}
