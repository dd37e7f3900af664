//! Criterion benches of the CPU kernels, one file per component under `benchmarks/`.
//!
//! `cargo bench -p rtx-kernels` measures; `cargo test -p rtx-kernels --benches` runs each bench
//! once so they cannot rot. Thread count follows `RTX_NUM_THREADS` like every kernel.
#![allow(clippy::unwrap_used)]

mod benchmarks;

criterion::criterion_main!(benchmarks::ijepa::benches, benchmarks::matmul::benches, benchmarks::softmax::benches, benchmarks::norm::benches);
