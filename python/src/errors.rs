//! The Python exceptions of the package: `RustytorchError` and its subclasses, each carrying the
//! Rust error's message (the whole `anyhow` chain, outermost first, joined by `: `).

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(rustytorch, RustytorchError, PyException, "An error of the rustytorch runtime; the message is the Rust error's.");
create_exception!(rustytorch, ConfigError, RustytorchError, "A config, scenario or argument the runtime refuses (missing file, bad TOML, bad nproc).");
create_exception!(rustytorch, CheckpointError, RustytorchError, "A checkpoint that cannot be read (missing, malformed, unsupported dtype).");
create_exception!(rustytorch, JobError, RustytorchError, "A launched job that failed, or a worker that could not run.");
create_exception!(rustytorch, SimulationError, RustytorchError, "A simulator run that could not start or run (not a broken invariant: that is in the report).");

/// Adds the exception classes to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("RustytorchError", py.get_type::<RustytorchError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("CheckpointError", py.get_type::<CheckpointError>())?;
    m.add("JobError", py.get_type::<JobError>())?;
    m.add("SimulationError", py.get_type::<SimulationError>())?;
    Ok(())
}

/// The text of an error and its causes, as `rtx` prints it (`{:#}`).
pub(crate) fn message(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        // thiserror's `transparent` and anyhow's context can repeat the inner text.
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}
