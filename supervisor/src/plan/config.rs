//! `[parallel]`: the mesh axes, ZeRO stage, micro-batches and pipeline schedule a job asks for,
//! and the checks that need the model but not the world.

use rtx_pipelines::{check_model, Mesh, MeshShape, ModelDims};
use serde::{Deserialize, Serialize};
use std::fmt;

use super::PlanError;

/// A pipeline schedule.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Schedule {
    /// All forwards, then all backwards: `m` micro-batches of activations live.
    #[serde(rename = "gpipe")]
    GPipe,
    /// One forward, one backward: at most `pp - stage` micro-batches live.
    #[default]
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// 1F1B over `virtual_stages` chunks per rank.
    #[serde(rename = "interleaved")]
    Interleaved,
    /// Zero-bubble ZB-H1 (backward split into input and weight gradients).
    #[serde(rename = "zb-h1")]
    ZbH1,
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Schedule::GPipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
            Schedule::Interleaved => "interleaved",
            Schedule::ZbH1 => "zb-h1",
        })
    }
}

/// `[parallel]` in a job's TOML.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelConfig {
    /// Replicas; unset: as many as the world fills.
    #[serde(default)]
    pub dp: Option<usize>,
    /// Pipeline stages.
    #[serde(default = "one")]
    pub pp: usize,
    /// Tensor-parallel ranks per stage.
    #[serde(default = "one")]
    pub tp: usize,
    /// ZeRO stage over `dp`: 0 replicated, 1 optimizer, 2 + gradients, 3 + parameters.
    #[serde(default)]
    pub zero: u8,
    /// Micro-batches per step (divides the batch).
    #[serde(default = "one")]
    pub microbatches: usize,
    /// The pipeline schedule.
    #[serde(default)]
    pub schedule: Schedule,
    /// Model chunks per pipeline rank with `schedule = "interleaved"` (default 2; 1 otherwise).
    #[serde(default)]
    pub virtual_stages: Option<usize>,
    /// Blocks per stage, overriding the balanced partition (one entry per stage).
    #[serde(default)]
    pub stage_layers: Option<Vec<usize>>,
}

fn one() -> usize {
    1
}

impl Default for ParallelConfig {
    fn default() -> Self {
        ParallelConfig { dp: None, pp: 1, tp: 1, zero: 0, microbatches: 1, schedule: Schedule::OneFOneB, virtual_stages: None, stage_layers: None }
    }
}

impl ParallelConfig {
    /// Model chunks per pipeline rank: `virtual_stages` for interleaved (default 2), else 1.
    pub fn chunks(&self) -> usize {
        match self.schedule {
            Schedule::Interleaved => self.virtual_stages.unwrap_or(2),
            _ => 1,
        }
    }

    /// Checks what does not depend on the world: ranges, and that `tp` divides the heads,
    /// vocabulary and MLP width and `pp` (times the chunks) the layers, unless `stage_layers` says
    /// how to cut them.
    pub fn validate(&self, dims: ModelDims) -> Result<(), PlanError> {
        let bad = |key: &'static str, value: String, allowed: String| Err(PlanError::Config { key, value, allowed });
        if self.dp == Some(0) {
            return bad("dp", "0".into(), "must be at least 1 (leave it out to fill the world)".into());
        }
        for (key, value) in [("pp", self.pp), ("tp", self.tp), ("microbatches", self.microbatches)] {
            if value == 0 {
                return bad(key, "0".into(), "must be at least 1".into());
            }
        }
        if self.zero > 3 {
            return bad("zero", self.zero.to_string(), "must be 0, 1, 2 or 3".into());
        }
        match (self.schedule, self.virtual_stages) {
            (Schedule::Interleaved, Some(v)) if v < 2 => {
                return bad("virtual_stages", v.to_string(), "schedule = \"interleaved\" needs at least 2 chunks per stage".into())
            }
            (s, Some(v)) if s != Schedule::Interleaved => {
                return bad("virtual_stages", v.to_string(), format!("only used with schedule = \"interleaved\", not \"{s}\""))
            }
            _ => {}
        }
        // The model axes alone: a world of exactly dp·pp·tp.
        check_model(MeshShape { dp: 1, pp: self.pp, tp: self.tp }, self.pp * self.tp, dims)?;
        let virtual_stages = self.pp * self.chunks();
        match &self.stage_layers {
            Some(layers) => check_stage_layers(layers, virtual_stages, dims.layers)?,
            None if dims.layers % virtual_stages != 0 => {
                let what = if self.chunks() > 1 {
                    format!("pp·virtual_stages = {}·{} = {virtual_stages}", self.pp, self.chunks())
                } else {
                    format!("pp = {}", self.pp)
                };
                return bad("pp", self.pp.to_string(), format!("{what} does not divide the model's {} layers; change pp or set stage_layers", dims.layers));
            }
            None => {}
        }
        Ok(())
    }

    /// The mesh at launch: `dp` fills `world` when unset, and must then equal it exactly.
    pub fn mesh(&self, world: usize, dims: ModelDims) -> Result<Mesh, PlanError> {
        self.validate(dims)?;
        let model = self.pp * self.tp;
        let dp = self.dp.unwrap_or_else(|| (world / model).max(1));
        Ok(check_model(MeshShape { dp, pp: self.pp, tp: self.tp }, world, dims)?)
    }
}

fn check_stage_layers(layers: &[usize], stages: usize, total: usize) -> Result<(), PlanError> {
    let value = format!("{layers:?}");
    if layers.len() != stages {
        return Err(PlanError::Config { key: "stage_layers", value, allowed: format!("needs one entry per (virtual) stage: {stages}, not {}", layers.len()) });
    }
    if layers.contains(&0) {
        return Err(PlanError::Config { key: "stage_layers", value, allowed: "every stage needs at least one layer".into() });
    }
    let sum: usize = layers.iter().sum();
    if sum != total {
        return Err(PlanError::Config { key: "stage_layers", value, allowed: format!("sums to {sum}, but the model has {total} layers") });
    }
    Ok(())
}
