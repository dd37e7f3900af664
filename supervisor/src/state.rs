//! Moving training state between ranks and sharding layouts.
//!
//! The worker keeps optimizer state in one **full** form between generations: the state of an
//! optimizer over whole parameters (`<param>.<field>` with the parameter's shape, and a scalar
//! `<param>.step`). Plain data parallelism has it already; under ZeRO-1 each rank's optimizer holds
//! only its segments (`<param>.<field>` of the segment's length), and [`gather_full_state`] rebuilds
//! the full form on every rank (segments are disjoint: a sum of zero-padded pieces is exact; steps
//! take the maximum). A new generation broadcasts the source rank's parameters and full state
//! ([`broadcast_parameters`], [`broadcast_full_state`]) and every rank cuts out what its optimizer
//! updates ([`slice_full_state`]), so replicas restart bit-identical whatever the world size.
//! Values travel as f32 when every tensor of the template is f32 or bf16 (what every optimizer
//! here keeps: half the bytes of the f64 they once travelled in), else as f64; either way the
//! rebuilt state is exact.

use std::collections::BTreeMap;

use rtx_collectives::{Communicator, ReduceOp};
use rtx_pipelines::ParamSlice;
use rtx_tensor::{DType, Element, Module, Optimizer, Tensor};

use crate::error::{Result, SupervisorError};

/// Named tensors.
pub type NamedTensors = Vec<(String, Tensor)>;

/// The full-form state of a fresh optimizer over `model`'s whole parameters (names, shapes and
/// dtypes; values are the fresh optimizer's).
pub fn full_template<M: Module, O: Optimizer>(model: &M, build: impl FnOnce(&[ParamSlice]) -> std::result::Result<O, String>) -> Result<NamedTensors> {
    let slices: Vec<ParamSlice> = model.named_parameters().into_iter().map(|(name, t)| ParamSlice { name, param_shape: t.shape().to_vec(), elements: 0..t.numel(), tensor: t }).collect();
    let optimizer = build(&slices).map_err(SupervisorError::Job)?;
    Ok(optimizer.state_tensors()?)
}

/// `(parameter, field)` of a state name such as `blocks.0.attn.qkv.weight.exp_avg`.
fn split_field(name: &str) -> Result<(&str, &str)> {
    name.rsplit_once('.').ok_or_else(|| SupervisorError::Job(format!("optimizer state name {name:?} has no field")))
}

/// The full state from this rank's (possibly sharded) optimizer state; collective under ZeRO-1.
/// `local` is the optimizer's `state_tensors()`, `slices` what it updates.
pub async fn gather_full_state(comm: &Communicator, local: &[(String, Tensor)], slices: &[ParamSlice], template: &[(String, Tensor)]) -> Result<NamedTensors> {
    // Decided by the template alone, so every rank makes the same choice (see broadcast_full_state).
    if fits_f32(template)? {
        gather_values::<f32>(comm, local, slices, template).await
    } else {
        gather_values::<f64>(comm, local, slices, template).await
    }
}

async fn gather_values<T: StateValue>(comm: &Communicator, local: &[(String, Tensor)], slices: &[ParamSlice], template: &[(String, Tensor)]) -> Result<NamedTensors> {
    let local: BTreeMap<&str, &Tensor> = local.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let owned: BTreeMap<&str, &ParamSlice> = slices.iter().map(|s| (s.name.as_str(), s)).collect();
    let mut values = Vec::new();
    let mut steps = Vec::new();
    for (name, full) in template {
        let (param, field) = split_field(name)?;
        if field == "step" {
            steps.push(local.get(name.as_str()).map_or(Ok(0.0), |t| t.item())?);
            continue;
        }
        let start = values.len();
        values.resize(start + full.numel(), T::default());
        if let (Some(t), Some(slice)) = (local.get(name.as_str()), owned.get(param)) {
            let part = T::read(t)?;
            if part.len() != slice.elements.len() {
                return Err(SupervisorError::Job(format!("state {name} holds {} values for {} owned elements", part.len(), slice.elements.len())));
            }
            values[start + slice.elements.start..start + slice.elements.end].copy_from_slice(&part);
        }
    }
    if comm.size() > 1 {
        comm.all_reduce(&mut values, ReduceOp::Sum).await?;
        comm.all_reduce(&mut steps, ReduceOp::Max).await?;
    }
    rebuild(template, &values, &steps)
}

/// Broadcasts `state` (full form, shaped like `template`) from `source`; returns it on every rank.
pub async fn broadcast_full_state(comm: &Communicator, source: usize, state: Option<&[(String, Tensor)]>, template: &[(String, Tensor)]) -> Result<NamedTensors> {
    let given = state.unwrap_or(template);
    if given.len() != template.len() {
        return Err(SupervisorError::Job(format!("carried optimizer state has {} tensors, this optimizer {}", given.len(), template.len())));
    }
    for ((name, want), (given_name, t)) in template.iter().zip(given) {
        if name != given_name || want.numel() != t.numel() {
            return Err(SupervisorError::Job(format!("carried optimizer state {given_name} does not match {name} of this optimizer")));
        }
    }
    if comm.size() == 1 {
        // Nobody to send to: the same values, copied without the f64 round trip (a large model's
        // state on a GPU is hundreds of millions of elements).
        // (Host state tensors are never written in place: a tensor of the right shape and dtype
        // is shared, not copied.)
        return template
            .iter()
            .zip(given)
            .map(|((name, want), (_, t))| {
                let same = t.shape() == want.shape() && t.dtype() == want.dtype() && t.device() == want.device();
                Ok((name.clone(), if same { t.clone() } else { Tensor::from_data(t.to_data()?, want.shape())?.to_dtype(want.dtype())? }))
            })
            .collect();
    }
    let mut steps = Vec::new();
    for (name, t) in given {
        if split_field(name)?.1 == "step" {
            steps.push(t.item()?);
        }
    }
    comm.broadcast(&mut steps, source).await?;
    // Decided by the template alone, which every rank shares (a rank's own carried state may
    // differ, and the ranks must agree on the wire type): f32 when the rebuilt tensors are f32 or
    // bf16 anyway (moments and master weights: half the bytes of f64), so nothing is lost on the
    // way; f64 otherwise.
    if fits_f32(template)? {
        broadcast_values::<f32>(comm, source, given, template, &steps).await
    } else {
        broadcast_values::<f64>(comm, source, given, template, &steps).await
    }
}

/// Broadcasts the non-step values of `given` as `T`s and rebuilds the state like `template`.
async fn broadcast_values<T: StateValue>(comm: &Communicator, source: usize, given: &[(String, Tensor)], template: &[(String, Tensor)], steps: &[f64]) -> Result<NamedTensors> {
    let mut values = Vec::new();
    for (name, t) in given {
        if split_field(name)?.1 != "step" {
            values.extend(T::read(t)?);
        }
    }
    comm.broadcast(&mut values, source).await?;
    rebuild(template, &values, steps)
}

/// A type optimizer state values travel in.
trait StateValue: Element + rtx_collectives::Element + Copy + Default {
    fn read(t: &Tensor) -> rtx_tensor::Result<Vec<Self>>;
}

impl StateValue for f32 {
    fn read(t: &Tensor) -> rtx_tensor::Result<Vec<f32>> {
        t.to_f32_vec()
    }
}

impl StateValue for f64 {
    fn read(t: &Tensor) -> rtx_tensor::Result<Vec<f64>> {
        t.to_f64_vec()
    }
}

/// Whether every tensor of `state` except its step counters is f32 or bf16 (so values rebuilt
/// into it lose nothing by travelling as f32).
fn fits_f32(state: &[(String, Tensor)]) -> Result<bool> {
    for (name, t) in state {
        if split_field(name)?.1 != "step" && !matches!(t.dtype(), DType::F32 | DType::BF16) {
            return Ok(false);
        }
    }
    Ok(true)
}

fn rebuild<T: Element + Copy>(template: &[(String, Tensor)], values: &[T], steps: &[f64]) -> Result<NamedTensors> {
    let (mut at, mut step_at) = (0, 0);
    let mut out = Vec::with_capacity(template.len());
    for (name, t) in template {
        let tensor = if split_field(name)?.1 == "step" {
            step_at += 1;
            Tensor::from_vec(vec![steps[step_at - 1]], t.shape())?
        } else {
            at += t.numel();
            Tensor::from_vec(values[at - t.numel()..at].to_vec(), t.shape())?
        };
        out.push((name.clone(), tensor.to_dtype(t.dtype())?));
    }
    Ok(out)
}

/// The part of `full` an optimizer over `slices` holds, named and shaped like its `local`
/// state (`optimizer.state_tensors()`).
pub fn slice_full_state(full: &[(String, Tensor)], local: &[(String, Tensor)], slices: &[ParamSlice]) -> Result<NamedTensors> {
    let full: BTreeMap<&str, &Tensor> = full.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let owned: BTreeMap<&str, &ParamSlice> = slices.iter().map(|s| (s.name.as_str(), s)).collect();
    let mut out = Vec::with_capacity(local.len());
    for (name, want) in local {
        let (param, field) = split_field(name)?;
        let source = full.get(name.as_str()).ok_or_else(|| SupervisorError::Job(format!("the full optimizer state lacks {name}")))?;
        let whole = owned.get(param).is_some_and(|slice| slice.is_whole() && source.numel() == want.numel());
        if field != "step" && whole {
            // Replicated: the whole tensor, copied in its own dtype (no f64 round trip).
            out.push((name.clone(), Tensor::from_data(source.to_data()?, want.shape())?.to_dtype(want.dtype())?));
            continue;
        }
        let values = if field == "step" {
            source.to_f64_vec()?
        } else {
            let slice = owned.get(param).ok_or_else(|| SupervisorError::Job(format!("no parameter slice for state {name}")))?;
            let all = source.to_f64_vec()?;
            all.get(slice.elements.clone()).ok_or_else(|| SupervisorError::Job(format!("state {name}: elements {:?} beyond {}", slice.elements, all.len())))?.to_vec()
        };
        out.push((name.clone(), Tensor::from_vec(values, want.shape())?.to_dtype(want.dtype())?));
    }
    Ok(out)
}

/// Broadcasts every parameter from `source` (one flat f32 buffer; `params` is the model's
/// `named_parameters()`) and returns the source's values, without installing them (see
/// [`install_parameters`]: a sync that fails later must leave the replica as it was). The
/// source sends `values` when given (a snapshot), else `params`.
pub async fn broadcast_parameters(comm: &Communicator, source: usize, params: &[(String, Tensor)], values: Option<&[f32]>) -> Result<Vec<f32>> {
    let mut flat = match values {
        Some(v) => v.to_vec(),
        None => {
            let mut flat = Vec::new();
            for (_, p) in params {
                flat.extend(p.to_f32_vec()?);
            }
            flat
        }
    };
    let total: usize = params.iter().map(|(_, p)| p.numel()).sum();
    if flat.len() != total {
        return Err(SupervisorError::Job(format!("parameter snapshot of {} values for {total} parameters", flat.len())));
    }
    comm.broadcast(&mut flat, source).await?;
    Ok(flat)
}

/// Writes `flat` (every parameter, in visit order) into `params`.
pub fn install_parameters(params: &[(String, Tensor)], flat: &[f32]) -> Result<()> {
    let total: usize = params.iter().map(|(_, p)| p.numel()).sum();
    if flat.len() != total {
        return Err(SupervisorError::Job(format!("{} parameter values for {total} parameters", flat.len())));
    }
    let mut offset = 0;
    for (_, p) in params {
        let n = p.numel();
        p.copy_from_(&Tensor::from_vec(flat[offset..offset + n].to_vec(), p.shape())?)?;
        offset += n;
    }
    Ok(())
}

/// Every parameter's values, then every buffer's, flat, in visit order (`named_state`).
pub fn flat_parameters<M: Module + ?Sized>(model: &M) -> Result<Vec<f32>> {
    let mut flat = Vec::new();
    for (_, p) in model.named_state() {
        flat.extend(p.to_f32_vec()?);
    }
    Ok(flat)
}
