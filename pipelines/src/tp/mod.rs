//! Megatron-style tensor parallelism (TP): layers whose weights are split over a group of ranks,
//! with the communication inside forward and backward as autograd ops.
//!
//! Start from [`TpGpt`] (the TP form of `rtx_tensor::nn::Gpt`, from the same config, or a
//! pipeline stage's part of it) or [`TpVit`] (of `rtx_tensor::nn::Vit`) on a [`TpGroup`] (a
//! blocking [`TpComm`] over a `Communicator`).
//! The pieces: [`ops`]' conjugate ops (`copy_to_tp` / `reduce_from_tp`, gather / scatter along the
//! last dimension, the sequence-parallel reduce-scatter / all-gather, the vocab-parallel
//! cross-entropy), the layers ([`ColumnParallelLinear`], [`RowParallelLinear`],
//! [`ParallelAttention`], [`ParallelMlp`], [`VocabParallelEmbedding`], [`TpBlock`]), and
//! [`ShardSpec`] (which dimension of a parameter is split, and the moves between full and
//! sharded tensors).
//!
//! This module does not form groups or pick batches: the caller hands in the group, runs
//! `backward` (use [`backward`] to get collective failures typed) and steps an optimizer over
//! the local parameters.

#![allow(clippy::manual_is_multiple_of, reason = "is_multiple_of needs Rust 1.87; the workspace says 1.85")]

mod gpt;
mod group;
mod layers;
pub mod ops;
mod shard;
mod vit;

pub use gpt::{check_config, gpt_shard_spec, StagePart, TpGpt, TpOptions, TIED_EMBEDDING_PARAM};
pub use group::{backward, lift_tensor_error, to_tensor_error, TpComm, TpGroup, TpHandle};
pub use layers::{ColumnParallelLinear, ParallelAttention, ParallelMlp, RowParallelLinear, TpBlock, TpContext, VocabParallelEmbedding};
pub use shard::ShardSpec;
pub use vit::{check_vit_config, vit_shard_spec, TpVit};
