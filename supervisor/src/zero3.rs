//! ZeRO-3 (FSDP) state between steps: one rank's unit segments in a world-independent form, its
//! wire encoding for the buddy copies, and the re-sharding that moves it to another world size.
//!
//! Under ZeRO-3 rank `r` of `n` owns `segment_range(numel_u, n, r)` of every unit `u` (the GPT's
//! edge and its blocks, see `rtx_pipelines::FsdpGpt`): those elements' parameter values and
//! optimizer moments, and nothing else of the model. [`UnitState`] is that state cut by unit
//! rather than by parameter: per unit its owned range and, per field (the parameter values, then
//! each per-element optimizer field such as `exp_avg`), the values of that range; per-parameter
//! scalars (AdamW's `step`) are kept once per field name. [`UnitState::from_shard`] and
//! [`UnitState::into_shard`] convert from and to the engine's `ShardState` (whose optimizer
//! tensors are named per parameter slice).
//!
//! The segments of one world tile every unit, so a state for another world is cut from them
//! ([`Cutter`]: gather each unit's old segments and keep the new range; [`reshard`] for all new
//! ranks at once). Nothing is summed, so the values are bit-identical to the old world's.
//!
//! The encoded form ([`encode`], [`decode`]) is one `u32` buffer that starts like a ZeRO-1 segment
//! state (magic word, then the committed step), so [`crate::zero1::BuddyCopies`] keeps and
//! exchanges it unchanged ([`crate::zero1::encoded_step`] reads either). Values are f32 bits.

use std::collections::BTreeMap;
use std::ops::Range;

use rtx_collectives::segment_range;
use rtx_pipelines::{ParamSlice, ShardState};
use rtx_tensor::{CpuData, Tensor};

use crate::error::{Result, SupervisorError};
use crate::zero1::{push_str, push_u64, Reader};

/// First word of an encoded ZeRO-3 unit state (format version 1).
pub const MAGIC: u32 = 0x5a33_5501;
/// The field name of the parameter values (the first field of every [`UnitState`]).
pub const PARAM_FIELD: &str = "param";

/// One rank's ZeRO-3 state cut by unit (see the module doc).
#[derive(Clone, Debug, PartialEq)]
pub struct UnitState {
    /// The committed job step this state is the result of.
    pub step: u64,
    /// The engine's next step (`ShardState::step`: steps since the engine's start).
    pub engine_step: u64,
    /// The owned element range of each unit.
    pub ranges: Vec<Range<usize>>,
    /// Field names: [`PARAM_FIELD`], then the optimizer's per-element fields in a fixed order.
    pub fields: Vec<String>,
    /// `values[f][u]`: field `f`'s values over `ranges[u]`.
    pub values: Vec<Vec<Vec<f32>>>,
    /// Scalar optimizer fields (one value per parameter, the same for all: AdamW's `step`).
    pub scalars: BTreeMap<String, f64>,
}

impl UnitState {
    /// The state of `shard` (exported after committed step `step`): the parameter segments as they
    /// are, and the optimizer tensors of each slice placed at the slice's run in its unit.
    /// `slices` are the engine's, in order; `unit_of` names a parameter's unit. Checks that the
    /// slices of each unit tile its segment in order (their values are the segment's).
    pub fn from_shard(step: u64, shard: &ShardState, slices: &[ParamSlice], unit_of: impl Fn(&str) -> usize) -> Result<UnitState> {
        let n_units = shard.segments.len();
        if shard.params.len() != n_units {
            return Err(bad(format!("{} parameter segments for {n_units} units", shard.params.len())));
        }
        let params: Vec<Vec<f32>> = shard.params.iter().enumerate().map(|(u, d)| f32_values(d).ok_or_else(|| bad(format!("unit {u}'s parameters are {}, not f32", d.dtype())))).collect::<Result<_>>()?;
        for (u, (p, r)) in params.iter().zip(&shard.segments).enumerate() {
            if p.len() != r.len() {
                return Err(bad(format!("unit {u}: {} parameter values for range {r:?}", p.len())));
            }
        }
        let by_name: BTreeMap<&str, &Tensor> = shard.optimizer.iter().map(|(n, t)| (n.as_str(), t)).collect();
        // The per-element fields, from the first slice's tensors (every slice has the same).
        let mut fields = vec![PARAM_FIELD.to_string()];
        let mut scalar_names = Vec::new();
        if let Some(first) = slices.first() {
            let prefix = format!("{}.", first.name);
            for (name, t) in &shard.optimizer {
                if let Some(field) = name.strip_prefix(&prefix) {
                    if is_scalar_field(field) {
                        scalar_names.push(field.to_string());
                    } else if t.numel() == first.elements.len() {
                        fields.push(field.to_string());
                    } else {
                        return Err(bad(format!("optimizer state {name} holds {} values for a slice of {}", t.numel(), first.elements.len())));
                    }
                }
            }
        }
        let mut values: Vec<Vec<Vec<f32>>> = vec![Vec::new(); fields.len()];
        values[0] = params;
        let mut scalars = BTreeMap::new();
        let runs = slice_runs(slices, &shard.segments, &unit_of)?;
        for field in values.iter_mut().skip(1) {
            *field = shard.segments.iter().map(|r| vec![0.0; r.len()]).collect();
        }
        let mut tensors_used = 0usize;
        for (slice, &(u, at, len)) in slices.iter().zip(&runs) {
            // The slice views its run of the unit's segment: its values say so.
            let own = slice.tensor.to_data()?;
            let own = f32_values(&own).ok_or_else(|| bad(format!("slice {} is not f32", slice.name)))?;
            if own.iter().map(|v| v.to_bits()).ne(values[0][u][at..at + len].iter().map(|v| v.to_bits())) {
                return Err(bad(format!("slice {} does not hold unit {u}'s elements {at}..{} of its segment", slice.name, at + len)));
            }
            for (f, field) in fields.iter().enumerate().skip(1) {
                let name = format!("{}.{field}", slice.name);
                let t = by_name.get(name.as_str()).ok_or_else(|| bad(format!("optimizer state {name} is missing")))?;
                let data = t.to_data()?;
                let v = f32_values(&data).ok_or_else(|| bad(format!("optimizer state {name} is {}, not f32", t.dtype())))?;
                if v.len() != len {
                    return Err(bad(format!("optimizer state {name} holds {} values for a slice of {len}", v.len())));
                }
                values[f][u][at..at + len].copy_from_slice(&v);
                tensors_used += 1;
            }
            for field in &scalar_names {
                let name = format!("{}.{field}", slice.name);
                let t = by_name.get(name.as_str()).ok_or_else(|| bad(format!("optimizer state {name} is missing")))?;
                let v = t.item()?;
                let slot = scalars.entry(field.clone()).or_insert(v);
                *slot = slot.max(v);
                tensors_used += 1;
            }
        }
        if tensors_used != shard.optimizer.len() {
            return Err(bad(format!("{} optimizer tensors, {tensors_used} of them of the slices", shard.optimizer.len())));
        }
        Ok(UnitState { step, engine_step: shard.step, ranges: shard.segments.clone(), fields, values, scalars })
    }

    /// The engine's `ShardState` of this state, for an engine whose slices are `slices` and whose
    /// optimizer's current tensors are `local` (their names, shapes and dtypes are the target's).
    pub fn into_shard(self, slices: &[ParamSlice], local: &[(String, Tensor)], unit_of: impl Fn(&str) -> usize) -> Result<ShardState> {
        let field_index: BTreeMap<&str, usize> = self.fields.iter().enumerate().map(|(i, f)| (f.as_str(), i)).collect();
        let runs = slice_runs(slices, &self.ranges, &unit_of)?;
        let slice_of: BTreeMap<&str, (usize, usize, usize)> = slices.iter().zip(runs).map(|(slice, run)| (slice.name.as_str(), run)).collect();
        let mut optimizer = Vec::with_capacity(local.len());
        for (name, t) in local {
            let (param, field) = name.rsplit_once('.').ok_or_else(|| bad(format!("optimizer state name {name:?} has no field")))?;
            let &(u, at, len) = slice_of.get(param).ok_or_else(|| bad(format!("optimizer state {name} of no slice")))?;
            let value = if is_scalar_field(field) {
                let v = *self.scalars.get(field).ok_or_else(|| bad(format!("the state has no {field}")))?;
                Tensor::scalar(v, t.dtype())
            } else {
                let f = *field_index.get(field).ok_or_else(|| bad(format!("the state has no field {field} (for {name})")))?;
                let run = self.values[f][u].get(at..at + len).ok_or_else(|| bad(format!("field {field} of unit {u} is short of {name}")))?;
                Tensor::from_vec(run.to_vec(), t.shape())?.to_dtype(t.dtype())?
            };
            optimizer.push((name.clone(), value));
        }
        let params = self.values.first().ok_or_else(|| bad("no parameter field".into()))?.iter().map(|v| CpuData::F32(v.clone().into())).collect();
        Ok(ShardState { step: self.engine_step, segments: self.ranges, params, optimizer })
    }

    /// Elements held (all fields, all units).
    pub fn numel(&self) -> usize {
        self.values.iter().flatten().map(Vec::len).sum()
    }
}

/// Cuts new segment `rank` of `world` out of old segments (see the module doc): place every old
/// rank's state once, in any order, then [`finish`](Cutter::finish).
#[derive(Debug)]
pub struct Cutter {
    ranges: Vec<Range<usize>>,
    step: Option<(u64, u64)>,
    fields: Option<Vec<String>>,
    values: Vec<Vec<Vec<f32>>>,
    placed: Vec<usize>,
    scalars: BTreeMap<String, f64>,
}

impl Cutter {
    /// An empty cut of segment `rank` of `world` over units of `unit_numels` elements.
    pub fn new(unit_numels: &[usize], world: usize, rank: usize) -> Result<Cutter> {
        if world == 0 || rank >= world {
            return Err(bad(format!("rank {rank} outside a world of {world}")));
        }
        let ranges: Vec<Range<usize>> = unit_numels.iter().map(|&n| segment_range(n, world, rank)).collect();
        Ok(Cutter { placed: vec![0; ranges.len()], ranges, step: None, fields: None, values: Vec::new(), scalars: BTreeMap::new() })
    }

    /// Places the overlap of one old rank's state with the new segment.
    pub fn place(&mut self, old: &UnitState) -> Result<()> {
        if old.ranges.len() != self.ranges.len() {
            return Err(bad(format!("an old state of {} units for {} units", old.ranges.len(), self.ranges.len())));
        }
        match self.step {
            None => self.step = Some((old.step, old.engine_step)),
            Some(s) if s == (old.step, old.engine_step) => {}
            Some(s) => return Err(bad(format!("old states of steps {:?} and {:?}", s, (old.step, old.engine_step)))),
        }
        match &self.fields {
            None => {
                self.values = vec![self.ranges.iter().map(|r| vec![0.0; r.len()]).collect(); old.fields.len()];
                self.fields = Some(old.fields.clone());
            }
            Some(f) if *f == old.fields => {}
            Some(f) => return Err(bad(format!("old states with fields {f:?} and {:?}", old.fields))),
        }
        for (u, (new, got)) in self.ranges.iter().zip(&old.ranges).enumerate() {
            let start = new.start.max(got.start);
            let end = new.end.min(got.end);
            if start >= end {
                continue;
            }
            for (f, field) in old.values.iter().enumerate() {
                let src = field.get(u).and_then(|v| v.get(start - got.start..end - got.start)).ok_or_else(|| bad(format!("old field {f} of unit {u} shorter than its range {got:?}")))?;
                self.values[f][u][start - new.start..end - new.start].copy_from_slice(src);
            }
            self.placed[u] += end - start;
        }
        for (name, v) in &old.scalars {
            let slot = self.scalars.entry(name.clone()).or_insert(*v);
            *slot = slot.max(*v);
        }
        Ok(())
    }

    /// The new segment's state; fails when an element was placed other than exactly once (old
    /// segments are disjoint, so a count that does not match means a hole or an overlap).
    pub fn finish(self) -> Result<UnitState> {
        for (u, (r, placed)) in self.ranges.iter().zip(&self.placed).enumerate() {
            if *placed != r.len() {
                return Err(bad(format!("old segments hold {placed} of unit {u}'s {} new elements", r.len())));
            }
        }
        let (step, engine_step) = self.step.unwrap_or((0, 0));
        let fields = self.fields.unwrap_or_else(|| vec![PARAM_FIELD.to_string()]);
        let values = if self.values.is_empty() { vec![self.ranges.iter().map(|_| Vec::new()).collect(); fields.len()] } else { self.values };
        Ok(UnitState { step, engine_step, ranges: self.ranges, fields, values, scalars: self.scalars })
    }
}

/// Every new rank's state in a world of `world`, cut from `old` (one state per old rank, in any
/// order) over units of `unit_numels` elements.
pub fn reshard(unit_numels: &[usize], old: &[UnitState], world: usize) -> Result<Vec<UnitState>> {
    (0..world)
        .map(|rank| {
            let mut cutter = Cutter::new(unit_numels, world, rank)?;
            for state in old {
                cutter.place(state)?;
            }
            cutter.finish()
        })
        .collect()
}

/// The wire form of `state` (see the module doc).
pub fn encode(state: &UnitState) -> Vec<u32> {
    let mut out = Vec::with_capacity(state.numel() + 16 + 4 * state.ranges.len());
    out.push(MAGIC);
    push_u64(&mut out, state.step);
    push_u64(&mut out, state.engine_step);
    push_u64(&mut out, state.ranges.len() as u64);
    for r in &state.ranges {
        push_u64(&mut out, r.start as u64);
        push_u64(&mut out, r.end as u64);
    }
    push_u64(&mut out, state.fields.len() as u64);
    for (name, field) in state.fields.iter().zip(&state.values) {
        push_str(&mut out, name);
        for unit in field {
            out.extend(unit.iter().map(|v| v.to_bits()));
        }
    }
    push_u64(&mut out, state.scalars.len() as u64);
    for (name, v) in &state.scalars {
        push_str(&mut out, name);
        push_u64(&mut out, v.to_bits());
    }
    out
}

/// The state encoded in `blob`; a typed error for anything malformed.
pub fn decode(blob: &[u32]) -> Result<UnitState> {
    let mut r = Reader::new(blob, "ZeRO-3 unit state");
    if r.word()? != MAGIC {
        return Err(bad("not a ZeRO-3 unit state (bad magic)".into()));
    }
    let step = r.u64()?;
    let engine_step = r.u64()?;
    let n_units = r.usize()?;
    let ranges = (0..n_units)
        .map(|_| {
            let (start, end) = (r.usize()?, r.usize()?);
            if start > end {
                return Err(bad(format!("range {start}..{end} runs backwards")));
            }
            Ok(start..end)
        })
        .collect::<Result<Vec<_>>>()?;
    let n_fields = r.usize()?;
    let (mut fields, mut values) = (Vec::new(), Vec::new());
    for _ in 0..n_fields {
        fields.push(r.string()?);
        values.push(ranges.iter().map(|range| Ok(r.take(range.len())?.iter().map(|w| f32::from_bits(*w)).collect())).collect::<Result<Vec<Vec<f32>>>>()?);
    }
    let mut scalars = BTreeMap::new();
    for _ in 0..r.usize()? {
        let name = r.string()?;
        scalars.insert(name, f64::from_bits(r.u64()?));
    }
    if r.remaining() != 0 {
        return Err(bad(format!("{} words after the unit state", r.remaining())));
    }
    if fields.first().map(String::as_str) != Some(PARAM_FIELD) {
        return Err(bad(format!("the first field is {:?}, not {PARAM_FIELD}", fields.first())));
    }
    Ok(UnitState { step, engine_step, ranges, fields, values, scalars })
}

/// Where each slice lies: its unit, its first element in the unit's segment (the slice views the
/// segment's parameter tensor, so this is its view offset) and its length. Checks that the slices
/// of every unit tile its segment exactly (no hole, no overlap).
fn slice_runs(slices: &[ParamSlice], ranges: &[Range<usize>], unit_of: &impl Fn(&str) -> usize) -> Result<Vec<(usize, usize, usize)>> {
    let mut runs = Vec::with_capacity(slices.len());
    let mut by_unit: Vec<Vec<(usize, usize)>> = vec![Vec::new(); ranges.len()];
    for slice in slices {
        let u = unit_of(&slice.name);
        let unit = by_unit.get_mut(u).ok_or_else(|| bad(format!("slice {} of unit {u}, beyond {} units", slice.name, ranges.len())))?;
        let (at, len) = (slice.tensor.layout().offset(), slice.elements.len());
        if slice.tensor.numel() != len {
            return Err(bad(format!("slice {} holds {} values for {len} elements", slice.name, slice.tensor.numel())));
        }
        unit.push((at, len));
        runs.push((u, at, len));
    }
    for (u, (unit, range)) in by_unit.iter_mut().zip(ranges).enumerate() {
        unit.sort_unstable();
        let mut next = 0;
        for &(at, len) in unit.iter() {
            if at != next {
                return Err(bad(format!("the slices of unit {u} leave a gap or overlap at element {next} of its segment (a slice starts at {at})")));
            }
            next = at + len;
        }
        if next != range.len() {
            return Err(bad(format!("the slices of unit {u} cover {next} of its {} owned elements", range.len())));
        }
    }
    Ok(runs)
}

/// Whether an optimizer field holds one value per parameter rather than one per element.
fn is_scalar_field(field: &str) -> bool {
    field == "step"
}

fn f32_values(data: &CpuData) -> Option<Vec<f32>> {
    match data {
        CpuData::F32(v) => Some(v.to_vec()),
        _ => None,
    }
}

fn bad(reason: String) -> SupervisorError {
    SupervisorError::Job(format!("ZeRO-3 unit state: {reason}"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use proptest::prelude::*;
    use rtx_tensor::Optimizer;

    /// The state of segment `rank` of `world` cut straight from whole units (`whole[f][u]`).
    fn cut(whole: &[Vec<Vec<f32>>], numels: &[usize], world: usize, rank: usize, scalars: &BTreeMap<String, f64>) -> UnitState {
        let ranges: Vec<Range<usize>> = numels.iter().map(|&n| segment_range(n, world, rank)).collect();
        let values = whole.iter().map(|f| f.iter().zip(&ranges).map(|(u, r)| u[r.clone()].to_vec()).collect()).collect();
        UnitState { step: 41, engine_step: 7, ranges, fields: vec![PARAM_FIELD.into(), "exp_avg".into(), "exp_avg_sq".into()], values, scalars: scalars.clone() }
    }

    fn whole(numels: &[usize], seed: u32) -> Vec<Vec<Vec<f32>>> {
        (0..3u32).map(|f| numels.iter().enumerate().map(|(u, &n)| (0..n).map(|i| (seed ^ (f << 24) ^ ((u as u32) << 16) ^ i as u32) as f32 * 0.5).collect()).collect()).collect()
    }

    proptest! {
        /// Goal: re-sharding old segments gives exactly the segments cut from the whole state, for
        /// any old and new world and any unit sizes (empty units and units smaller than the world
        /// included). Method: cut whole units at the old world, reshard to the new one, compare
        /// with a direct cut; the old states arrive in reverse order, which must not matter.
        #[test]
        fn resharding_equals_cutting_the_whole_state(numels in proptest::collection::vec(0usize..40, 1..6), old_world in 1usize..7, new_world in 1usize..7, seed in any::<u32>()) {
            let scalars = BTreeMap::from([("step".to_string(), 42.0)]);
            let whole = whole(&numels, seed);
            let mut old: Vec<UnitState> = (0..old_world).map(|r| cut(&whole, &numels, old_world, r, &scalars)).collect();
            old.reverse();
            let new = reshard(&numels, &old, new_world).unwrap();
            for (rank, state) in new.iter().enumerate() {
                prop_assert_eq!(state, &cut(&whole, &numels, new_world, rank, &scalars));
                prop_assert_eq!(decode(&encode(state)).unwrap(), state.clone());
            }
        }

        /// Goal: a missing old segment is a typed error, never a silent hole. Method: drop one old
        /// rank's state (of a world of two or more) and reshard to one rank, which needs them all.
        #[test]
        fn a_missing_segment_is_refused(numels in proptest::collection::vec(1usize..40, 1..6), old_world in 2usize..7, missing in 0usize..7) {
            let whole = whole(&numels, 9);
            let missing = missing % old_world;
            prop_assume!(numels.iter().any(|&n| !segment_range(n, old_world, missing).is_empty()));
            let old: Vec<UnitState> = (0..old_world).filter(|&r| r != missing).map(|r| cut(&whole, &numels, old_world, r, &BTreeMap::new())).collect();
            let err = reshard(&numels, &old, 1).unwrap_err().to_string();
            prop_assert!(err.contains("old segments hold"), "{}", err);
        }
    }

    /// Shards of a small GPT cut into FSDP units, rank `rank` of `world`; the optimizer's moments
    /// hold values of their own (distinct per element), so a misplaced run shows.
    fn gpt_shards(world: usize) -> (Vec<usize>, Vec<rtx_pipelines::ParamShard<rtx_tensor::optim::AdamW>>) {
        use rtx_tensor::nn::{Gpt, GptConfig, Module};
        let config = GptConfig { vocab_size: 32, context: 8, d_model: 8, n_layers: 2, n_heads: 2, ..GptConfig::default() };
        let mut gpt = Gpt::new(config, &mut rtx_tensor::Generator::new(3)).unwrap();
        let buckets = rtx_tensor::optim::ParamBuckets::grouped(&mut gpt, &rtx_pipelines::gpt_unit_of).unwrap();
        let numels = buckets.buckets().iter().map(|b| b.numel()).collect();
        let adamw = rtx_tensor::optim::AdamWConfig { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-6, weight_decay: 0.1 };
        let shards = (0..world)
            .map(|rank| {
                let mut shard = rtx_pipelines::ParamShard::new(&buckets, rank, world, rtx_pipelines::adamw(adamw, |_, s| s.len() >= 2)).unwrap();
                // Moments: element e of parameter p holds 1000·p + e (exp_avg) and its negation.
                let moments: Vec<(String, Tensor)> = shard
                    .optimizer()
                    .state_tensors()
                    .unwrap()
                    .into_iter()
                    .map(|(name, t)| {
                        let (param, field) = name.rsplit_once('.').unwrap();
                        let slice = shard.slices().iter().find(|s| s.name == param).unwrap();
                        let p = gpt.named_parameters().iter().position(|(n, _)| n == param).unwrap() as f32;
                        let value = match field {
                            "step" => Tensor::scalar(5.0, t.dtype()),
                            _ => {
                                let sign = if field == "exp_avg" { 1.0 } else { -1.0 };
                                Tensor::from_vec(slice.elements.clone().map(|e| sign * (1000.0 * p + e as f32)).collect::<Vec<f32>>(), t.shape()).unwrap()
                            }
                        };
                        (name, value)
                    })
                    .collect();
                shard.optimizer_mut().load_state(&moments).unwrap();
                shard
            })
            .collect();
        (numels, shards)
    }

    /// Goal: a real shard's state survives the unit form and the re-cut. Method: a GPT's FSDP
    /// shards at 3 ranks (grouped buckets, whose parameter order inside a unit is not the visit
    /// order) go to the unit form, are re-cut for 2 ranks and imported into shards of 2; their
    /// exports equal the shards built at 2 ranks directly (same parameters, same moments). A round
    /// trip at the same size gives the exported state back.
    #[test]
    fn a_gpt_shard_state_moves_through_the_unit_form_to_another_world() {
        let unit_of = rtx_pipelines::gpt_unit_of;
        let (numels, old) = gpt_shards(3);
        let states: Vec<UnitState> = old.iter().map(|s| UnitState::from_shard(9, &s.export().unwrap(), s.slices(), unit_of).unwrap()).collect();
        for (shard, state) in old.iter().zip(&states) {
            let local = shard.optimizer().state_tensors().unwrap();
            let back = state.clone().into_shard(shard.slices(), &local, unit_of).unwrap();
            let exported = shard.export().unwrap();
            assert_eq!((back.step, &back.segments, format!("{:?}", back.params)), (exported.step, &exported.segments, format!("{:?}", exported.params)));
            assert_eq!(format!("{:?}", back.optimizer), format!("{:?}", exported.optimizer));
        }
        let (_, mut new) = gpt_shards(2);
        let (_, direct) = gpt_shards(2);
        for (rank, shard) in new.iter_mut().enumerate() {
            let mut cutter = Cutter::new(&numels, 2, rank).unwrap();
            for state in &states {
                cutter.place(&decode(&encode(state)).unwrap()).unwrap();
            }
            let local = shard.optimizer().state_tensors().unwrap();
            shard.import(cutter.finish().unwrap().into_shard(shard.slices(), &local, unit_of).unwrap()).unwrap();
            let (got, want) = (shard.export().unwrap(), direct[rank].export().unwrap());
            assert_eq!((&got.segments, format!("{:?}", got.params)), (&want.segments, format!("{:?}", want.params)));
            assert_eq!(format!("{:?}", got.optimizer), format!("{:?}", want.optimizer));
        }
    }

    /// Goal: a segment placed twice, a mixed step, or a damaged blob is refused with its reason.
    #[test]
    fn overlaps_mixed_steps_and_bad_blobs_are_refused() {
        let numels = [10, 3];
        let whole = whole(&numels, 1);
        let a = cut(&whole, &numels, 2, 0, &BTreeMap::new());
        let b = cut(&whole, &numels, 2, 1, &BTreeMap::new());
        let err = reshard(&numels, &[a.clone(), a.clone(), b.clone()], 1).unwrap_err().to_string();
        assert!(err.contains("old segments hold 15 of unit 0's 10 new elements"), "{err}");
        let mut later = b.clone();
        later.step += 1;
        let err = reshard(&numels, &[a.clone(), later], 1).unwrap_err().to_string();
        assert!(err.contains("old states of steps"), "{err}");
        let blob = encode(&a);
        assert!(decode(&blob[..blob.len() - 1]).unwrap_err().to_string().contains("truncated"));
        let mut extra = blob.clone();
        extra.push(0);
        assert!(decode(&extra).unwrap_err().to_string().contains("words after"));
        assert!(decode(&[0, 0, 0]).unwrap_err().to_string().contains("bad magic"));
        assert_eq!(crate::zero1::encoded_step(&blob).unwrap(), 41);
    }
}
