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
use std::ops::Range;

use rtx_pipelines::{check_model, Coord, Mesh, MeshError, MeshShape, ModelDims};
use serde::Serialize;

mod config;
mod cost;
mod shard;

pub use config::{ParallelConfig, Schedule};
pub use cost::{memory_estimate, partition_layers, predicted_bubble, simulated_bubble, stage_costs, LayerCosts, MemoryEstimate, ModelLayout};
use shard::{cover, union_covers};
pub use shard::{ShardId, Unit};

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
        return Err(PlanError::Config {
            key: "costs",
            value: format!("{} block costs", input.costs.blocks.len()),
            allowed: format!("one per layer: the model has {} layers", dims.layers),
        });
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
    let held_at =
        |step: u64| -> Vec<Vec<ShardId>> { placed.iter().map(|&i| members[i].held.iter().filter(|(_, s)| *s == step).map(|(h, _)| *h).collect()).collect() };
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
    repartitioned_shape(tp, world, dims, config.chunks())
}

/// Rule 2 of the module doc: the mesh a world of `world` members takes when it no longer fills
/// one replica of the configured mesh (the supervisor's live re-partition calls this too). `tp` shrinks to
/// the largest divisor of the heads, vocabulary, MLP width and the world; the stages take the
/// rest, at most `layers / chunks` of them (each of an interleaved schedule's `chunks` virtual
/// stages per rank needs a layer).
pub fn repartitioned_shape(tp: usize, world: usize, dims: ModelDims, chunks: usize) -> MeshShape {
    let world = world.max(1);
    let splittable = |d: usize| [dims.heads, dims.vocab, dims.mlp_hidden].iter().all(|v| v % d == 0);
    let tp = (1..=tp.min(world)).rev().find(|&d| splittable(d) && world % d == 0).unwrap_or(1);
    let most_stages = (dims.layers / chunks.max(1)).max(1);
    let pp = (world / tp).clamp(1, most_stages);
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
fn place(
    members: &[MemberHolding],
    mesh: &Mesh,
    needs: &[Vec<(ShardId, bool)>],
    previous: Option<&Plan>,
    model: &ModelLayout,
) -> Result<Vec<usize>, PlanError> {
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
fn sources_at(
    step: u64,
    held: &[Vec<ShardId>],
    needs: &[Vec<(ShardId, bool)>],
    checkpoint: Option<&CheckpointInfo>,
    model: &ModelLayout,
) -> Option<Vec<Vec<Source>>> {
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

#[cfg(test)]
#[path = "plan/tests.rs"]
mod tests;
