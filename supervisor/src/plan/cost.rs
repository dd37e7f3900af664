//! What a plan costs: the model's layout and per-unit costs, the balanced stage partition, the
//! predicted bubble and the memory estimate of a rank.

use serde::Serialize;
use std::ops::Range;

use rtx_pipelines::{MeshError, ModelDims};

use super::{Plan, PlanError, Schedule, ShardId, Unit};

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
    let (p, m) = (pp as f64, microbatches.max(1) as f64);
    let work = match schedule {
        Schedule::GPipe | Schedule::OneFOneB => m,
        Schedule::Interleaved => chunks.max(1) as f64 * m,
        Schedule::ZbH1 => 3.0 * m,
    };
    (p - 1.0) / (work + p - 1.0)
}

/// The bubble of one step in virtual time: `rtx_pipelines::schedule::simulate` runs the schedule's
/// instruction lists with each virtual stage's forward cost from `virtual_stage_costs` (the plan's
/// stage costs, unequal when the embedding and head weigh in), the backward at twice the forward
/// (split evenly into input and weight gradient), free transfers. Returns the mean idle share over
/// stages and the worst stage's, or `None` for a schedule the simulator refuses (reported, not
/// guessed).
pub fn simulated_bubble(schedule: Schedule, pp: usize, microbatches: usize, chunks: usize, virtual_stage_costs: &[f64]) -> Option<(f64, f64)> {
    use rtx_pipelines::schedule::{simulate, Costs, ScheduleKind};
    let kind = match schedule {
        Schedule::GPipe => ScheduleKind::GPipe,
        Schedule::OneFOneB => ScheduleKind::OneFOneB,
        Schedule::Interleaved => ScheduleKind::Interleaved { chunks },
        Schedule::ZbH1 => ScheduleKind::ZeroBubbleH1,
    };
    if virtual_stage_costs.len() != pp * kind.chunks() {
        return None;
    }
    let costs = Costs { forward: virtual_stage_costs.to_vec(), backward_input: virtual_stage_costs.to_vec(), backward_weight: virtual_stage_costs.to_vec(), p2p: 0.0 };
    let timeline = simulate(kind, pp, microbatches.max(1), &costs).ok()?;
    let makespan = timeline.makespan.max(f64::MIN_POSITIVE);
    let mean = timeline.idle.iter().sum::<f64>() / (pp as f64 * makespan);
    let worst = timeline.idle.iter().copied().fold(0.0, f64::max) / makespan;
    Some((mean, worst))
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
