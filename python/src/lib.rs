//! `_rustytorch`: the extension module of the `rustytorch` Python package (PyO3), wrapped by the
//! pure-Python package in `python/rustytorch/`.
//!
//! Start from `job::launch` (an elastic job on a background thread, watched through a
//! `job::JobHandle`), `checkpoint::load_checkpoint` (a checkpoint's tensors as `tensor::PyTensor`s
//! that numpy views without a copy, through the buffer protocol), `sim::simulate` (one simulator
//! seed) and `worker::worker_main` (the worker process, `python -m rustytorch._worker`). Every
//! Rust error becomes a Python exception of `errors` carrying the Rust message. Nothing here
//! trains or decides: it adapts the `rustytorch` facade's functions to Python.

mod checkpoint;
mod errors;
mod job;
mod sim;
mod tensor;
mod worker;

use pyo3::prelude::*;

/// The module object `rustytorch._rustytorch`.
#[pymodule]
fn _rustytorch(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<tensor::PyTensor>()?;
    m.add_class::<job::JobHandle>()?;
    m.add_function(wrap_pyfunction!(job::launch, m)?)?;
    m.add_function(wrap_pyfunction!(checkpoint::load_checkpoint, m)?)?;
    m.add_function(wrap_pyfunction!(checkpoint::latest_checkpoint, m)?)?;
    m.add_function(wrap_pyfunction!(sim::simulate, m)?)?;
    m.add_function(wrap_pyfunction!(worker::worker_main, m)?)?;
    Ok(())
}
