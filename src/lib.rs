//! `rustytorch`: the facade of the rustytorch training runtime, and the library behind the `rtx`
//! binary.
//!
//! Start from [`Tensor`] (eager tensors with tape autograd), [`nn`] (the [`nn::Module`] trait,
//! `Linear`, `Mlp`, `Gpt`, `Vit`), [`optim`] (SGD, AdamW, schedules, clipping) and [`data`]
//! (Fashion-MNIST, SOTU text, digits, seeded resumable samplers); those come from `rtx-tensor`,
//! re-exported whole as [`tensor`], with the compute kernels of `rtx-kernels` as [`kernels`].
//! [`train`] is the single-process trainer that `rtx train CONFIG.toml` runs, driven by a
//! [`config::TrainConfig`]; embed it, or write your own loop from the same pieces (see
//! `examples/mnist_mlp.rs`).
//!
//! This crate adds no compute of its own: it parses configs, runs the loop, and writes metrics
//! (`metrics.jsonl`), a loss curve (`loss.png`) and checkpoints. [`elastic`] runs the same configs
//! as elastic data-parallel jobs (`rtx launch`, `rtx supervisor`, `rtx worker`, `rtx status`) on the
//! actors, collectives and supervisor crates, re-exported as [`actors`], [`collectives`],
//! [`pipelines`] and [`supervisor`]. [`sim`] runs such a job in the deterministic simulator
//! (`rtx sim`, on `rtx-sim`, re-exported as [`simulator`]). [`plan_cmd`] prints the plan of a
//! config's `[parallel]` section (`rtx plan CONFIG --world N`). [`fed_cmd`] runs a federation
//! (`rtx fed run CONFIG.toml`, on `rtx-federated`, re-exported as [`federated`]). [`live`] serves
//! the live cluster page of `rtx launch --http ADDR`.

pub use rtx_actors as actors;
pub use rtx_collectives as collectives;
pub use rtx_federated as federated;
pub use rtx_kernels as kernels;
pub use rtx_pipelines as pipelines;
pub use rtx_sim as simulator;
pub use rtx_supervisor as supervisor;
pub use rtx_tensor as tensor;
pub use rtx_tensor::{checkpoint, data, nn, optim, DType, Device, Generator, Tensor};

pub mod bench;
pub mod cli;
pub mod config;
pub mod elastic;
pub mod embed;
pub mod fed_cmd;
pub mod live;
pub mod metrics;
pub mod plan_cmd;
pub mod plot;
pub mod progress;
pub mod sim;
pub mod train;
