//! The plan of a generation: which member sits at which mesh coordinate, which shards of the
//! model's state each one must hold, and where it fetches each shard it lacks. A pure function
//! ([`plan`]) of what the supervisor knows; no I/O, no clock, no async, so the supervisor, the
//! simulator, `rtx plan` and unit tests all call the same code. It is the 3D generalisation of
//! [`crate::recovery::plan_recovery`], which assumes every member holds the whole model.
//!
//! **State as shards.** The model's state is cut into [`Unit`]s named from parameter prefixes
//! (`tok_emb.`/`pos_emb.` → [`Unit::Embed`], `blocks.{i}.` → [`Unit::Block`], `ln_f.`/`lm_head.`
//! → [`Unit::Head`]), each unit into `tp` slices, and with ZeRO each slice's optimizer state (and
//! with ZeRO-3 its parameters) into `dp` segments: a [`ShardId`]. A shard is an interval of its
//! unit (slice `t` of `T` is `[t/T, (t+1)/T)`, segment `s` of `n` a sub-interval of it), so a
//! shard of one mesh shape can be cut from, or assembled out of, shards of another.
//! A pipeline stage owns contiguous blocks; stage 0 also owns the embedding and the last stage the
//! head. With tied embeddings and `pp > 1` the last stage also holds a copy of its embedding slice
//! ([`ShardNeed::tied_copy`]). Interleaved schedules cut the layers into `pp · v` virtual stages,
//! virtual stage `j` on pipeline rank `j mod pp`.
//!
//! **Decision rules** (the product; each has a test):
//! 1. *Shape.* Keep the configured `pp` and `tp`; `dp` = world / (pp·tp), capped by `[parallel] dp`
//!    when set. Members beyond `dp·pp·tp` are [`Plan::standby`]: they take no rank (8 → 6 at
//!    (2,2,2) gives (1,2,2) and two standby members; the mesh is not reshaped to (3,2,1), which would
//!    move every tensor-parallel slice).
//! 2. *Re-partition.* When the world no longer fills `pp·tp`: keep `tp` if it divides the world,
//!    else take the largest `tp' < tp` that divides the heads, vocabulary, MLP width and the world
//!    (down to 1); then `pp = world / tp` (at most the layers), so every member takes a rank and
//!    its memory stays a source (8 → 6 at (1,4,2) gives (1,3,2); 8 → 3 at (2,2,2) gives (1,3,1)).
//!    Layers are re-balanced over the new stages (a `stage_layers` override applies only at its
//!    own `pp`); standby members are not sources, which is why this rule fills the world.
//! 3. *Placement.* Members are taken in node order (the input's order does not matter). Each
//!    (member, coordinate) pair scores the bytes of that coordinate's shards the member already
//!    holds; pairs are assigned greedily by score, then by whether the coordinate is the member's
//!    coordinate in the previous plan, then node, then rank. Unscored coordinates take the
//!    remaining members in node order.
//! 4. *Step.* The plan restores the newest step `k` at which every needed shard is held, at `k`,
//!    by mesh members (whole or in pieces) or by the newest checkpoint (of step `k`). Per shard the
//!    source is, in order: [`Source::Local`], one [`Source::Member`] (the least loaded holder in
//!    bytes, ties to the lowest rank), [`Source::Pieces`] from several members, then
//!    [`Source::Checkpoint`]: memory beats disk. With no such step every shard is
//!    [`Source::Initial`] (boot state: initial parameters or the `--resume` checkpoint). A step
//!    below the newest committed one is reported in [`Plan::regressed_from`].
//!
//! [`memory_estimate`] and [`predicted_bubble`] are the numbers `rtx plan` prints.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::ops::Range;

use rtx_pipelines::{check_model, Coord, Mesh, MeshError, MeshShape, ModelDims};
use serde::{Deserialize, Serialize};

/// Why a configuration cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// A `[parallel]` key has a value outside what it allows.
    #[error("[parallel] {key} = {value}: {allowed}")]
    Config {
        /// The key inside `[parallel]`.
        key: &'static str,
        /// The value as written.
        value: String,
        /// What it allows.
        allowed: String,
    },
    /// The mesh does not fit the world or the model.
    #[error(transparent)]
    Mesh(#[from] MeshError),
    /// The members do not match the world size.
    #[error("{members} members given for a world of {world}")]
    Members {
        /// Members listed.
        members: usize,
        /// The world size.
        world: usize,
    },
    /// Two members share a node id.
    #[error("node {node} is listed twice among the members")]
    DuplicateNode {
        /// The node.
        node: u64,
    },
    /// A rank outside the plan's mesh.
    #[error("rank {rank} is outside the plan's {world} ranks")]
    NoSuchRank {
        /// The rank asked for.
        rank: usize,
        /// Ranks in the plan.
        world: usize,
    },
}

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
            (Schedule::Interleaved, Some(v)) if v < 2 => return bad("virtual_stages", v.to_string(), "schedule = \"interleaved\" needs at least 2 chunks per stage".into()),
            (s, Some(v)) if s != Schedule::Interleaved => return bad("virtual_stages", v.to_string(), format!("only used with schedule = \"interleaved\", not \"{s}\"")),
            _ => {}
        }
        // The model axes alone: a world of exactly dp·pp·tp.
        check_model(MeshShape { dp: 1, pp: self.pp, tp: self.tp }, self.pp * self.tp, dims)?;
        let virtual_stages = self.pp * self.chunks();
        match &self.stage_layers {
            Some(layers) => check_stage_layers(layers, virtual_stages, dims.layers)?,
            None if dims.layers % virtual_stages != 0 => {
                let what = if self.chunks() > 1 { format!("pp·virtual_stages = {}·{} = {virtual_stages}", self.pp, self.chunks()) } else { format!("pp = {}", self.pp) };
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

/// A piece of the model that a pipeline stage owns whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Unit {
    /// Token and position embeddings.
    Embed,
    /// Transformer block `i`.
    Block(usize),
    /// Final norm and language-model head.
    Head,
}

impl Unit {
    /// The unit a parameter belongs to, from its name; `None` for a name outside the GPT layout.
    pub fn of_param(name: &str) -> Option<Unit> {
        if name.starts_with("tok_emb.") || name.starts_with("pos_emb.") {
            return Some(Unit::Embed);
        }
        if name.starts_with("ln_f.") || name.starts_with("lm_head.") {
            return Some(Unit::Head);
        }
        let rest = name.strip_prefix("blocks.")?;
        let (index, tail) = rest.split_once('.')?;
        if tail.is_empty() {
            return None;
        }
        index.parse().ok().map(Unit::Block)
    }
}

impl fmt::Display for Unit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unit::Embed => f.write_str("embed"),
            Unit::Block(i) => write!(f, "block{i}"),
            Unit::Head => f.write_str("head"),
        }
    }
}

/// One shard of the state: slice `tp_index` of `tp_size` of a unit, and with ZeRO segment
/// `s` of `n` of that slice.
///
/// `zero_segment: None` is the slice's parameters (and with ZeRO-0 its optimizer moments);
/// `Some((s, n))` is segment `s` of `n` of its optimizer moments (ZeRO-1/2), or of its
/// parameters and moments (ZeRO-3). The two kinds never stand in for each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ShardId {
    /// The unit.
    pub unit: Unit,
    /// Tensor-parallel slice.
    pub tp_index: usize,
    /// Slices of the unit.
    pub tp_size: usize,
    /// ZeRO segment `(index, count)` over `dp`.
    pub zero_segment: Option<(usize, usize)>,
}

impl ShardId {
    /// The whole unit (one slice, no segment).
    pub fn whole(unit: Unit) -> ShardId {
        ShardId { unit, tp_index: 0, tp_size: 1, zero_segment: None }
    }

    /// The shard as the interval `[lo/den, hi/den)` of its unit.
    fn interval(&self) -> (u128, u128, u128) {
        let (t, size) = (self.tp_index as u128, self.tp_size.max(1) as u128);
        match self.zero_segment {
            None => (t, t + 1, size),
            Some((s, n)) => {
                let n = n.max(1) as u128;
                (t * n + s as u128, t * n + s as u128 + 1, size * n)
            }
        }
    }

    fn same_kind(&self, other: &ShardId) -> bool {
        self.unit == other.unit && self.zero_segment.is_some() == other.zero_segment.is_some()
    }

    /// Whether this shard contains all of `other` (same unit and kind, interval containment).
    pub fn covers(&self, other: &ShardId) -> bool {
        if !self.same_kind(other) {
            return false;
        }
        let (a_lo, a_hi, a_d) = self.interval();
        let (b_lo, b_hi, b_d) = other.interval();
        a_lo * b_d <= b_lo * a_d && b_hi * a_d <= a_hi * b_d
    }

    /// Whether the two shards share any part (same unit and kind).
    pub fn overlaps(&self, other: &ShardId) -> bool {
        self.overlap(other) > 0.0
    }

    /// The fraction of `other` that this shard holds.
    fn overlap(&self, other: &ShardId) -> f64 {
        if !self.same_kind(other) {
            return 0.0;
        }
        let (a_lo, a_hi, a_d) = self.interval();
        let (b_lo, b_hi, b_d) = other.interval();
        // On the common denominator a_d·b_d.
        let lo = (a_lo * b_d).max(b_lo * a_d);
        let hi = (a_hi * b_d).min(b_hi * a_d);
        if hi <= lo {
            return 0.0;
        }
        (hi - lo) as f64 / ((b_hi - b_lo) * a_d) as f64
    }
}

impl fmt::Display for ShardId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/tp{}of{}", self.unit, self.tp_index, self.tp_size)?;
        if let Some((s, n)) = self.zero_segment {
            write!(f, "/z{s}of{n}")?;
        }
        Ok(())
    }
}

/// Where a rank gets a shard.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Source {
    /// It holds it already at the plan's step.
    Local,
    /// From the member at `rank`, which holds all of it at the plan's step.
    Member {
        /// The sender's rank in the new mesh.
        rank: usize,
    },
    /// Assembled from parts held by several members at the plan's step (a shard of another
    /// mesh shape); each part is cut down to its overlap with the needed shard.
    Pieces {
        /// `(sender rank, the shard it holds)`, in interval order; `rank` may be the receiver.
        parts: Vec<(usize, ShardId)>,
    },
    /// From the newest checkpoint.
    Checkpoint {
        /// Where it is.
        location: String,
        /// Its step.
        step: u64,
    },
    /// Boot state: initial parameters, or the `--resume` checkpoint every worker loaded.
    Initial,
}

/// One shard a rank must hold, and where it comes from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ShardNeed {
    /// The shard.
    pub shard: ShardId,
    /// Where it comes from.
    pub source: Source,
    /// The last stage's copy of the tied token embedding (its parameters only).
    pub tied_copy: bool,
}

/// One rank of a plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankAssignment {
    /// The rank.
    pub rank: usize,
    /// The member's node id.
    pub node: u64,
    /// Its coordinate.
    pub coord: Coord,
    /// Its blocks: one range per model chunk (one, except with interleaving).
    pub layers: Vec<Range<usize>>,
    /// The units it owns.
    pub units: Vec<Unit>,
    /// The shards it must hold.
    pub shards: Vec<ShardNeed>,
}

/// The plan of one generation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The generation it is for.
    pub generation: u64,
    /// The mesh.
    pub mesh: Mesh,
    /// Node id per rank.
    pub members: Vec<u64>,
    /// Members that take no rank (the world does not fill another replica), in node order.
    pub standby: Vec<u64>,
    /// Blocks per virtual stage (`pp · chunks` ranges, virtual stage `j` on pipeline rank `j mod pp`).
    pub stages: Vec<Range<usize>>,
    /// Per rank, in rank order.
    pub assignments: Vec<RankAssignment>,
    /// The step whose state the plan restores; `None`: boot state.
    pub step: Option<u64>,
    /// The first step the generation trains.
    pub next_step: u64,
    /// The committed step the job falls back from, when the restored state is older.
    pub regressed_from: Option<u64>,
    /// ZeRO stage.
    pub zero: u8,
    /// Micro-batches per step.
    pub microbatches: usize,
    /// Pipeline schedule.
    pub schedule: Schedule,
    /// Model chunks per pipeline rank.
    pub chunks: usize,
}

/// The model's layout, as far as planning needs it (a GPT).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelLayout {
    /// Transformer blocks.
    pub layers: usize,
    /// Width C.
    pub d_model: usize,
    /// Attention heads.
    pub heads: usize,
    /// Vocabulary V.
    pub vocab: usize,
    /// Context length (rows of the position table, and the sequence length).
    pub context: usize,
    /// Feed-forward hidden width.
    pub mlp_hidden: usize,
    /// Whether the head reuses the token embedding.
    pub tied: bool,
}

impl ModelLayout {
    /// The dimensions the mesh splits.
    pub fn dims(&self) -> ModelDims {
        ModelDims { layers: self.layers, heads: self.heads, vocab: self.vocab, mlp_hidden: self.mlp_hidden }
    }

    /// Parameters of `unit` held by one of `tp` ranks: the split tensors divided, the norms and
    /// row-parallel biases whole (Megatron's layout). With `tied_copy_only`, the token embedding.
    pub fn unit_params(&self, unit: Unit, tp: usize) -> u64 {
        let (c, v, f, t) = (self.d_model as u64, self.vocab as u64, self.mlp_hidden as u64, tp.max(1) as u64);
        match unit {
            // Vocabulary-parallel token embedding; the position table is replicated.
            Unit::Embed => v * c / t + self.context as u64 * c,
            // qkv and fc column-parallel (weight and bias), attention and MLP projections
            // row-parallel (weight; their biases replicated), two LayerNorms replicated.
            Unit::Block(_) => (3 * c * c + 3 * c + c * c + c * f + f + f * c) / t + 2 * c + c + c + 2 * c,
            Unit::Head => 2 * c + if self.tied { 0 } else { v * c / t },
        }
    }

    /// Elements of `shard`.
    pub fn shard_params(&self, shard: &ShardId) -> u64 {
        let slice = self.unit_params(shard.unit, shard.tp_size);
        match shard.zero_segment {
            None => slice,
            Some((_, n)) => slice.div_ceil(n.max(1) as u64),
        }
    }

    /// A static cost per unit from forward FLOPs per token: `8·C² + 4·C·F + 4·T·C` per block
    /// (`24·C² + 4·T·C` at `F = 4·C`), `2·C·V`
    /// for the head's logits, `2·C` for the embedding's lookup and add. Measured costs can replace it.
    pub fn static_costs(&self) -> LayerCosts {
        let (c, v, t) = (self.d_model as f64, self.vocab as f64, self.context as f64);
        let f = self.mlp_hidden as f64;
        // qkv 6C², proj 2C², MLP 4·C·F (= 16C² at F = 4C), attention scores and mix 4·T·C.
        let block = 6.0 * c * c + 2.0 * c * c + 4.0 * c * f + 4.0 * t * c;
        LayerCosts { embed: 2.0 * c, blocks: vec![block; self.layers], head: 2.0 * c * v }
    }
}

/// Per-unit costs for the partition (any unit; only ratios matter).
#[derive(Clone, Debug, PartialEq)]
pub struct LayerCosts {
    /// The embedding (on the first stage).
    pub embed: f64,
    /// Each block.
    pub blocks: Vec<f64>,
    /// The head (on the last stage).
    pub head: f64,
}

/// Splits the blocks into `stages` contiguous non-empty ranges minimising the largest stage cost,
/// the first stage paying `embed` and the last `head`. Exact (dynamic programming over split
/// points, O(stages · layers²)); among optimal partitions the earliest split points win.
pub fn partition_layers(costs: &LayerCosts, stages: usize) -> Result<Vec<Range<usize>>, PlanError> {
    let n = costs.blocks.len();
    if stages == 0 || stages > n {
        return Err(PlanError::Mesh(MeshError::TooManyStages { pp: stages, layers: n }));
    }
    let mut prefix = vec![0.0; n + 1];
    for (i, c) in costs.blocks.iter().enumerate() {
        prefix[i + 1] = prefix[i] + c;
    }
    let cost = |stage: usize, a: usize, b: usize| -> f64 {
        let mut x = prefix[b] - prefix[a];
        if stage == 0 {
            x += costs.embed;
        }
        if stage == stages - 1 {
            x += costs.head;
        }
        x
    };
    // best[j][i]: the least largest cost of blocks 0..i over stages 0..=j; split[j][i] its start.
    let mut best = vec![vec![f64::INFINITY; n + 1]; stages];
    let mut split = vec![vec![0usize; n + 1]; stages];
    for (i, slot) in best[0].iter_mut().enumerate().skip(1) {
        *slot = cost(0, 0, i);
    }
    for j in 1..stages {
        for i in (j + 1)..=n {
            for a in j..i {
                let candidate = best[j - 1][a].max(cost(j, a, i));
                if candidate < best[j][i] {
                    best[j][i] = candidate;
                    split[j][i] = a;
                }
            }
        }
    }
    let mut ranges = vec![0..0; stages];
    let mut end = n;
    for j in (0..stages).rev() {
        let start = if j == 0 { 0 } else { split[j][end] };
        ranges[j] = start..end;
        end = start;
    }
    debug_assert!(ranges.iter().all(|r| !r.is_empty()) && ranges[0].start == 0 && ranges[stages - 1].end == n);
    Ok(ranges)
}

/// The cost of each stage of `ranges` (the first with the embedding, the last with the head).
pub fn stage_costs(costs: &LayerCosts, ranges: &[Range<usize>]) -> Vec<f64> {
    let last = ranges.len().saturating_sub(1);
    ranges
        .iter()
        .enumerate()
        .map(|(j, r)| {
            let mut x: f64 = costs.blocks[r.clone()].iter().sum();
            if j == 0 {
                x += costs.embed;
            }
            if j == last {
                x += costs.head;
            }
            x
        })
        .collect()
}

/// The idle share of a step under `schedule` with `pp` stages and `m` micro-batches, from the
/// closed forms: `(p-1)/(m+p-1)` for GPipe and 1F1B, `(p-1)/(v·m+p-1)` interleaved over `v`
/// chunks, `(p-1)/(3m+p-1)` for ZB-H1 (its bubble is a third of 1F1B's at equal F, B, W times).
pub fn predicted_bubble(schedule: Schedule, pp: usize, microbatches: usize, chunks: usize) -> f64 {
    // TODO(lead): replace with `schedule::simulate` once the schedules are merged.
    let (p, m) = (pp as f64, microbatches.max(1) as f64);
    let work = match schedule {
        Schedule::GPipe | Schedule::OneFOneB => m,
        Schedule::Interleaved => chunks.max(1) as f64 * m,
        Schedule::ZbH1 => 3.0 * m,
    };
    (p - 1.0) / (work + p - 1.0)
}

/// What one member holds: shards, each at a step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemberHolding {
    /// The member's node id.
    pub node: u64,
    /// `(shard, step)` pairs it holds.
    pub held: Vec<(ShardId, u64)>,
}

/// The newest checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointInfo {
    /// Where it is.
    pub location: String,
    /// Its step.
    pub step: u64,
    /// The shards it has; `None`: the whole state (an unsharded checkpoint).
    pub shards: Option<Vec<ShardId>>,
}

/// Everything [`plan`] decides from.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanInput {
    /// The generation to plan.
    pub generation: u64,
    /// The previous generation's plan, if any (members keep their coordinates on ties).
    pub previous: Option<Plan>,
    /// Every member of the new generation with what it holds; empty: `world` fresh members with
    /// node ids `0..world` (a static plan).
    pub members: Vec<MemberHolding>,
    /// `[parallel]`.
    pub config: ParallelConfig,
    /// The model.
    pub model: ModelLayout,
    /// Per-unit costs (blocks of `model.layers`).
    pub costs: LayerCosts,
    /// The newest good checkpoint.
    pub checkpoint: Option<CheckpointInfo>,
    /// Members in the generation.
    pub world: usize,
    /// The newest committed step.
    pub committed: Option<u64>,
    /// The first step of a run with nothing to restore.
    pub resume_next_step: u64,
}

/// Plans a generation; see the module doc for the rules.
pub fn plan(input: &PlanInput) -> Result<Plan, PlanError> {
    let config = &input.config;
    let dims = input.model.dims();
    config.validate(dims)?;
    if input.costs.blocks.len() != dims.layers {
        return Err(PlanError::Config { key: "costs", value: format!("{} block costs", input.costs.blocks.len()), allowed: format!("one per layer: the model has {} layers", dims.layers) });
    }
    // Members in node order: the input's order never matters.
    let mut members: Vec<MemberHolding> =
        if input.members.is_empty() { (0..input.world as u64).map(|node| MemberHolding { node, held: Vec::new() }).collect() } else { input.members.clone() };
    if members.len() != input.world || input.world == 0 {
        return Err(PlanError::Members { members: members.len(), world: input.world });
    }
    members.sort_by_key(|m| m.node);
    for pair in members.windows(2) {
        if pair[0].node == pair[1].node {
            return Err(PlanError::DuplicateNode { node: pair[0].node });
        }
    }
    for m in &mut members {
        m.held.sort();
        m.held.dedup();
    }

    let shape = shape_for(config, input.world, dims);
    let mesh = check_model(shape, shape.dp * shape.pp * shape.tp, dims)?;
    let chunks = if shape.pp == config.pp { config.chunks() } else { 1 };
    let virtual_stages = shape.pp * chunks;
    let stages = match &config.stage_layers {
        Some(layers) if virtual_stages == config.pp * config.chunks() => {
            let mut start = 0;
            layers
                .iter()
                .map(|n| {
                    start += n;
                    start - n..start
                })
                .collect()
        }
        _ => partition_layers(&input.costs, virtual_stages)?,
    };
    let tied_copy = input.model.tied && virtual_stages > 1;
    let needs: Vec<Vec<(ShardId, bool)>> = mesh.coords().map(|c| needed_shards(c, shape, &stages, config.zero, tied_copy)).collect();

    let placed = place(&members, &mesh, &needs, input.previous.as_ref(), &input.model)?;
    let node_of: Vec<u64> = placed.iter().map(|&i| members[i].node).collect();
    let in_mesh: BTreeSet<usize> = placed.iter().copied().collect();
    let standby: Vec<u64> = members.iter().enumerate().filter(|(i, _)| !in_mesh.contains(i)).map(|(_, m)| m.node).collect();

    // Candidate steps, newest first: anything a mesh member holds, and the checkpoint's.
    let mut steps: BTreeSet<u64> = placed.iter().flat_map(|&i| members[i].held.iter().map(|(_, s)| *s)).collect();
    if let Some(c) = &input.checkpoint {
        steps.insert(c.step);
    }
    let held_at = |step: u64| -> Vec<Vec<ShardId>> { placed.iter().map(|&i| members[i].held.iter().filter(|(_, s)| *s == step).map(|(h, _)| *h).collect()).collect() };
    let mut chosen = None;
    for &step in steps.iter().rev() {
        if let Some(sources) = sources_at(step, &held_at(step), &needs, input.checkpoint.as_ref(), &input.model) {
            chosen = Some((step, sources));
            break;
        }
    }
    let (step, sources) = match chosen {
        Some((step, sources)) => (Some(step), sources),
        None => (None, needs.iter().map(|n| vec![Source::Initial; n.len()]).collect()),
    };
    let next_step = step.map_or(input.resume_next_step, |s| s + 1);
    let regressed_from = match step {
        Some(s) => input.committed.filter(|&c| c > s),
        None => input.committed.filter(|&c| c >= input.resume_next_step),
    };

    let mut assignments = Vec::with_capacity(mesh.world());
    for (rank, (coord, (need, source))) in mesh.coords().zip(needs.into_iter().zip(sources)).enumerate() {
        let layers: Vec<Range<usize>> = stages.iter().enumerate().filter(|(j, _)| j % shape.pp == coord.pp).map(|(_, r)| r.clone()).collect();
        let units = units_of(coord, shape, &stages);
        let shards = need.into_iter().zip(source).map(|((shard, tied_copy), source)| ShardNeed { shard, source, tied_copy }).collect();
        assignments.push(RankAssignment { rank, node: node_of[rank], coord, layers, units, shards });
    }
    tracing::debug!(generation = input.generation, shape = %mesh.shape(), world = input.world, standby = standby.len(), step = ?step, regressed_from = ?regressed_from, "planned");
    Ok(Plan {
        generation: input.generation,
        mesh,
        members: node_of,
        standby,
        stages,
        assignments,
        step,
        next_step,
        regressed_from,
        zero: config.zero,
        microbatches: config.microbatches,
        schedule: config.schedule,
        chunks,
    })
}

/// Rules 1 and 2 of the module doc.
fn shape_for(config: &ParallelConfig, world: usize, dims: ModelDims) -> MeshShape {
    let (pp, tp) = (config.pp, config.tp);
    if world >= pp * tp {
        let dp = (world / (pp * tp)).min(config.dp.unwrap_or(usize::MAX)).max(1);
        return MeshShape { dp, pp, tp };
    }
    let splittable = |d: usize| [dims.heads, dims.vocab, dims.mlp_hidden].iter().all(|v| v % d == 0);
    let tp = (1..=tp).rev().find(|&d| splittable(d) && world % d == 0).unwrap_or(1);
    let pp = (world / tp).clamp(1, dims.layers.max(1));
    MeshShape { dp: (world / (pp * tp)).max(1), pp, tp }
}

/// The units a coordinate owns: its stages' blocks, the embedding on the first virtual stage and
/// the head on the last.
fn units_of(coord: Coord, shape: MeshShape, stages: &[Range<usize>]) -> Vec<Unit> {
    let last = stages.len().saturating_sub(1);
    let mut units = Vec::new();
    for (j, range) in stages.iter().enumerate().filter(|(j, _)| j % shape.pp == coord.pp) {
        if j == 0 {
            units.push(Unit::Embed);
        }
        units.extend(range.clone().map(Unit::Block));
        if j == last {
            units.push(Unit::Head);
        }
    }
    units.sort();
    units
}

/// The shards a coordinate must hold, with whether each is the tied embedding copy.
fn needed_shards(coord: Coord, shape: MeshShape, stages: &[Range<usize>], zero: u8, tied_copy: bool) -> Vec<(ShardId, bool)> {
    let slice = |unit| ShardId { unit, tp_index: coord.tp, tp_size: shape.tp, zero_segment: None };
    let segment = |unit| ShardId { zero_segment: Some((coord.dp, shape.dp)), ..slice(unit) };
    let units = units_of(coord, shape, stages);
    let mut out = Vec::new();
    for &unit in &units {
        if zero < 3 {
            out.push((slice(unit), false));
        }
        if zero >= 1 {
            out.push((segment(unit), false));
        }
    }
    let last_rank = (stages.len().saturating_sub(1)) % shape.pp;
    if tied_copy && coord.pp == last_rank && !units.contains(&Unit::Embed) {
        out.push((if zero < 3 { slice(Unit::Embed) } else { segment(Unit::Embed) }, true));
    }
    out
}

/// Rule 3: which member (index into `members`) sits at each rank.
fn place(members: &[MemberHolding], mesh: &Mesh, needs: &[Vec<(ShardId, bool)>], previous: Option<&Plan>, model: &ModelLayout) -> Result<Vec<usize>, PlanError> {
    let previous_coord: BTreeMap<u64, Coord> = previous.map(|p| p.assignments.iter().map(|a| (a.node, a.coord)).collect()).unwrap_or_default();
    // (score, kept coordinate, member, rank)
    let mut pairs: Vec<(f64, bool, usize, usize)> = Vec::new();
    for (i, m) in members.iter().enumerate() {
        let held: BTreeSet<ShardId> = m.held.iter().map(|(h, _)| *h).collect();
        for (rank, need) in needs.iter().enumerate() {
            let score: f64 = need.iter().map(|(n, _)| held.iter().map(|h| h.overlap(n)).sum::<f64>().min(1.0) * model.shard_params(n) as f64).sum();
            let kept = mesh.coord(rank).ok() == previous_coord.get(&m.node).copied();
            if score > 0.0 || kept {
                pairs.push((score, kept, i, rank));
            }
        }
    }
    pairs.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.cmp(&a.1)).then(a.2.cmp(&b.2)).then(a.3.cmp(&b.3)));
    let mut at: Vec<Option<usize>> = vec![None; mesh.world()];
    let mut taken = vec![false; members.len()];
    for (_, _, i, rank) in pairs {
        if !taken[i] && at[rank].is_none() {
            at[rank] = Some(i);
            taken[i] = true;
        }
    }
    let mut free = (0..members.len()).filter(|&i| !taken[i]);
    let mut placed = Vec::with_capacity(at.len());
    for (rank, slot) in at.into_iter().enumerate() {
        match slot.or_else(|| free.next()) {
            Some(i) => placed.push(i),
            None => return Err(PlanError::Members { members: members.len(), world: rank + 1 }),
        }
    }
    Ok(placed)
}

/// Rule 4 at one step: a source for every needed shard, or `None` when one has no holder.
/// `held[rank]` is what the member at `rank` holds at `step`.
fn sources_at(step: u64, held: &[Vec<ShardId>], needs: &[Vec<(ShardId, bool)>], checkpoint: Option<&CheckpointInfo>, model: &ModelLayout) -> Option<Vec<Vec<Source>>> {
    let mut load = vec![0u64; held.len()];
    let checkpoint = checkpoint.filter(|c| c.step == step);
    let mut out = Vec::with_capacity(needs.len());
    for (rank, need) in needs.iter().enumerate() {
        let mut sources = Vec::with_capacity(need.len());
        for (shard, _) in need {
            let bytes = model.shard_params(shard);
            if held[rank].iter().any(|h| h.covers(shard)) {
                sources.push(Source::Local);
                continue;
            }
            let holder = (0..held.len()).filter(|&r| held[r].iter().any(|h| h.covers(shard))).min_by_key(|&r| (load[r], r));
            if let Some(r) = holder {
                load[r] += bytes;
                sources.push(Source::Member { rank: r });
                continue;
            }
            if let Some(parts) = cover(shard, held, &load) {
                for (r, part) in &parts {
                    if *r != rank {
                        load[*r] += (part.overlap(shard) * bytes as f64) as u64;
                    }
                }
                sources.push(Source::Pieces { parts });
                continue;
            }
            let in_checkpoint = checkpoint.is_some_and(|c| match &c.shards {
                None => true,
                Some(shards) => union_covers(shards.iter().copied(), shard),
            });
            match checkpoint.filter(|_| in_checkpoint) {
                Some(c) => sources.push(Source::Checkpoint { location: c.location.clone(), step }),
                None => return None,
            }
        }
        out.push(sources);
    }
    Some(out)
}

/// Parts held by members whose union covers `need`: a greedy interval cover that extends the
/// covered prefix with the part reaching furthest (ties: least loaded holder, then lowest rank).
fn cover(need: &ShardId, held: &[Vec<ShardId>], load: &[u64]) -> Option<Vec<(usize, ShardId)>> {
    let (lo, hi, den) = need.interval();
    let mut parts: Vec<(u64, usize, ShardId)> = Vec::new();
    for (r, shards) in held.iter().enumerate() {
        parts.extend(shards.iter().filter(|h| h.overlaps(need)).map(|h| (load.get(r).copied().unwrap_or(0), r, *h)));
    }
    parts.sort();
    let (mut reached, end) = ((lo, den), (hi, den));
    let mut chosen = Vec::new();
    while less(reached, end) {
        let mut best: Option<(usize, (u128, u128))> = None;
        for (k, (_, _, shard)) in parts.iter().enumerate() {
            let (a, b, d) = shard.interval();
            if !less(reached, (a, d)) && less(reached, (b, d)) && best.is_none_or(|(_, e)| less(e, (b, d))) {
                best = Some((k, (b, d)));
            }
        }
        let (k, stop) = best?;
        let (_, r, shard) = parts.remove(k);
        chosen.push((r, shard));
        reached = stop;
    }
    chosen.sort_by(|a, b| {
        let (a0, _, ad) = a.1.interval();
        let (b0, _, bd) = b.1.interval();
        (a0 * bd).cmp(&(b0 * ad)).then(a.0.cmp(&b.0))
    });
    Some(chosen)
}

/// `a < b` for fractions `(numerator, denominator)`.
fn less(a: (u128, u128), b: (u128, u128)) -> bool {
    a.0 * b.1 < b.0 * a.1
}

/// Whether the union of `shards` covers `need`.
fn union_covers(shards: impl Iterator<Item = ShardId>, need: &ShardId) -> bool {
    let held = vec![shards.collect::<Vec<_>>()];
    cover(need, &held, &[0]).is_some()
}

/// Bytes one rank needs, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MemoryEstimate {
    /// Parameters (its units' tensor-parallel slices, and the tied embedding copy).
    pub params: u64,
    /// Gradients of them.
    pub grads: u64,
    /// AdamW's two f32 moments (and f32 master weights when parameters are narrower).
    pub optimizer: u64,
    /// Activations kept for the backward pass at the schedule's peak.
    pub activations: u64,
    /// The sum.
    pub total: u64,
}

/// The memory of `rank` under `plan`, with parameters of `dtype_bytes` and micro-batches of
/// `microbatch_tokens` tokens. ZeRO-1/2/3 divide the optimizer state, then the gradients, then
/// the parameters by `dp`. Activations follow Korthikanti et al. (2022) for a block without
/// sequence parallelism, `tokens · C · (10 + 24/t + 5·a·T/(C·t))` bytes at 16 bits (scaled to the
/// dtype), plus the last stage's f32 logits, times the micro-batches alive at the schedule's peak:
/// `m` for GPipe, `min(pp - stage, m)` for 1F1B and ZB-H1, and that times `1 + (pp-1)/(pp·v)`
/// for interleaving (Narayanan et al. 2021). Not modelled: ZeRO-3's gathered layer buffers,
/// communication buffers and the allocator's slack.
pub fn memory_estimate(plan: &Plan, rank: usize, model: &ModelLayout, dtype_bytes: u64, microbatch_tokens: u64) -> Result<MemoryEstimate, PlanError> {
    let a = plan.assignments.get(rank).ok_or(PlanError::NoSuchRank { rank, world: plan.assignments.len() })?;
    let shape = plan.mesh.shape();
    let (tp, dp) = (shape.tp.max(1) as u64, shape.dp.max(1) as u64);
    let owned: u64 = a.units.iter().map(|&u| model.unit_params(u, shape.tp)).sum();
    let copy = if a.shards.iter().any(|s| s.tied_copy) { model.vocab as u64 * model.d_model as u64 / tp } else { 0 };
    let total_params = owned + copy;
    let zero = plan.zero;
    let params = (total_params * dtype_bytes).div_ceil(if zero >= 3 { dp } else { 1 });
    let grads = (total_params * dtype_bytes).div_ceil(if zero >= 2 { dp } else { 1 });
    let per_param_state = 8 + if dtype_bytes < 4 { 4 } else { 0 };
    let optimizer = (owned * per_param_state).div_ceil(if zero >= 1 { dp } else { 1 });

    let (c, heads, t_seq, t) = (model.d_model as f64, model.heads as f64, model.context as f64, tp as f64);
    let tokens = microbatch_tokens as f64;
    let per_block = tokens * c * (10.0 + 24.0 / t + 5.0 * heads * t_seq / (c * t)) * dtype_bytes as f64 / 2.0;
    let blocks: usize = a.layers.iter().map(|r| r.len()).sum();
    let logits = if a.units.contains(&Unit::Head) { tokens * model.vocab as f64 / t * 4.0 } else { 0.0 };
    let (p, m, stage) = (shape.pp as f64, plan.microbatches.max(1) as f64, a.coord.pp as f64);
    let live = match plan.schedule {
        Schedule::GPipe => m,
        Schedule::OneFOneB | Schedule::ZbH1 => (p - stage).min(m),
        Schedule::Interleaved => ((p - stage).min(m) * (1.0 + (p - 1.0) / (p * plan.chunks.max(1) as f64))).min(m),
    };
    let activations = ((per_block * blocks as f64 + logits) * live).ceil() as u64;
    Ok(MemoryEstimate { params, grads, optimizer, activations, total: params + grads + optimizer + activations })
}

#[cfg(test)]
#[path = "plan/tests.rs"]
mod tests;
