//! Pipeline parallelism, and the mesh engine that combines it with tensor and data parallelism.
//!
//! A stage is the member of a pipeline that owns a range of layers ([`StageModule`]; [`GptStage`]
//! for the GPT) and a [`Mailbox`] of activations and gradients; [`MeshEngine`] runs its stage's
//! schedule (see [`crate::schedule`]) for one step and reduces gradients over the mesh's `dp` group.
//! [`MeshEngine::save_sharded`] and [`load_shard`] save and load a mesh's state as a sharded
//! checkpoint that any other mesh shape loads. Communication is blocking on a compute thread ([`BlockingGroup`]), so the same code runs stage
//! layers that communicate inside forward and backward (tensor parallelism); a stage's outgoing
//! activations and gradients go through a [`SendQueue`], whose thread sends them while the stage
//! computes on.

mod blocking;
mod checkpoint;
mod engine;
mod mailbox;
mod sender;
mod stage;
mod timeline;

pub use blocking::BlockingGroup;
pub use checkpoint::{check_model_names, load_shard, named_state, shard_label, write_shard};
pub use engine::{MeshEngine, MeshStep, PipelineConfig};
pub use mailbox::{Key, Kind, Mailbox};
pub use sender::{SendQueue, SEND_QUEUE_MAX};
pub use stage::{DynOptimizer, GptStage, StageModule, TokenBatch, TpGptStage};
pub use timeline::{InstrSpan, StageTimeline};
