//! `load_state_dict` for any [`Module`]: compare a set of named tensors (a PyTorch `state_dict`
//! saved as safetensors, another model's [`Module::named_state`]) with the module's parameters
//! and buffers by name, report what is missing, unexpected or mismatched, and copy the rest in.
//!
//! Semantics follow `torch.nn.Module.load_state_dict`:
//! - `strict = true`: any missing name, unexpected name or mismatch is an
//!   [`Error::StateDict`](crate::Error::StateDict) listing all of them, and nothing is copied;
//! - `strict = false`: missing and unexpected names are only reported, matching names are copied;
//!   a shape mismatch is still an error (PyTorch raises on "size mismatch" either way), as is a
//!   float tensor given for an integer one or the reverse.
//!
//! Float tensors convert on copy (an F64 or F16-loaded F32 tensor into a BF16 parameter rounds,
//! as `param.copy_(t)` does). Everything is checked before the first copy, so a failed call
//! leaves the module untouched. Copies are in place ([`Tensor::copy_from_`]), so bucket views and
//! optimizers bound to the parameters stay bound.

use super::Module;
use crate::error::{Error, Result};
use crate::storage::CpuData;
use crate::tensor::Tensor;
use rtx_kernels::DType;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

/// What a `load_state_dict` call found, by name (each list sorted by name).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StateDictReport {
    /// Names the module has and the given tensors lack.
    pub missing: Vec<String>,
    /// Names given that the module does not have.
    pub unexpected: Vec<String>,
    /// Names both have whose shapes (or dtype kinds) differ.
    pub mismatched: Vec<StateMismatch>,
}

/// One name whose given tensor does not fit the module's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateMismatch {
    /// The parameter or buffer name.
    pub name: String,
    /// The module's shape.
    pub expected_shape: Vec<usize>,
    /// The given shape.
    pub found_shape: Vec<usize>,
    /// The module's dtype.
    pub expected_dtype: DType,
    /// The given dtype.
    pub found_dtype: DType,
}

impl StateDictReport {
    /// Whether every name matched (nothing missing, unexpected or mismatched).
    pub fn is_clean(&self) -> bool {
        self.missing.is_empty() && self.unexpected.is_empty() && self.mismatched.is_empty()
    }
}

impl fmt::Display for StateDictReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_clean() {
            return f.write_str("all names match");
        }
        let mut parts = Vec::new();
        if !self.missing.is_empty() {
            parts.push(format!("missing keys: {}", self.missing.join(", ")));
        }
        if !self.unexpected.is_empty() {
            parts.push(format!("unexpected keys: {}", self.unexpected.join(", ")));
        }
        if !self.mismatched.is_empty() {
            let each: Vec<String> = self.mismatched.iter().map(|m| format!("{} (given {:?} {}, module has {:?} {})", m.name, m.found_shape, m.found_dtype, m.expected_shape, m.expected_dtype)).collect();
            parts.push(format!("mismatched: {}", each.join(", ")));
        }
        f.write_str(&parts.join("; "))
    }
}

/// The body of [`Module::load_state_dict`].
pub(crate) fn load_state_dict<M: Module + ?Sized>(module: &M, state: &[(String, Tensor)], strict: bool) -> Result<StateDictReport> {
    let span = tracing::debug_span!("load_state_dict", n_given = state.len(), strict);
    let _entered = span.enter();
    let mut given: BTreeMap<&str, &Tensor> = BTreeMap::new();
    for (name, t) in state {
        if given.insert(name.as_str(), t).is_some() {
            return Err(Error::InvalidArgument { op: "load_state_dict", reason: format!("tensor name {name} is given twice") });
        }
    }
    let own = module.named_state();
    let own_names: BTreeSet<&str> = own.iter().map(|(n, _)| n.as_str()).collect();
    let mut report = StateDictReport::default();
    let mut plan = Vec::with_capacity(own.len());
    for (name, target) in &own {
        let Some(&source) = given.get(name.as_str()) else {
            report.missing.push(name.clone());
            continue;
        };
        if source.shape() != target.shape() || source.dtype().is_float() != target.dtype().is_float() {
            report.mismatched.push(StateMismatch { name: name.clone(), expected_shape: target.shape().to_vec(), found_shape: source.shape().to_vec(), expected_dtype: target.dtype(), found_dtype: source.dtype() });
            continue;
        }
        plan.push((target, Prepared::of(target, source)?));
    }
    report.unexpected = given.keys().filter(|n| !own_names.contains(*n)).map(|n| n.to_string()).collect();
    report.missing.sort();
    report.mismatched.sort_by(|a, b| a.name.cmp(&b.name));
    if !report.mismatched.is_empty() || (strict && !report.is_clean()) {
        return Err(Error::StateDict { report });
    }
    for (target, prepared) in plan {
        prepared.copy_into(target)?;
    }
    Ok(report)
}

/// A source made ready to copy: float tensors convert during the copy (which cannot fail on
/// values); integer tensors are converted to the target's dtype up front, so a value that does
/// not fit fails before anything is copied.
enum Prepared<'a> {
    Float(&'a Tensor),
    Int(CpuData),
}

impl<'a> Prepared<'a> {
    fn of(target: &Tensor, source: &'a Tensor) -> Result<Prepared<'a>> {
        if target.dtype().is_float() {
            return Ok(Prepared::Float(source));
        }
        if !target.is_contiguous() {
            return Err(Error::NotContiguous { op: "load_state_dict", shape: target.shape().to_vec(), strides: target.layout().strides().to_vec() });
        }
        Ok(Prepared::Int(source.to_dtype(target.dtype())?.to_data()?))
    }

    /// Copies into `target` in place.
    fn copy_into(self, target: &Tensor) -> Result<()> {
        let data = match self {
            Prepared::Float(source) => return target.copy_from_(source),
            Prepared::Int(data) => data,
        };
        let range = target.layout().offset()..target.layout().offset() + target.numel();
        let mut storage = target.storage().write()?;
        match (&mut *storage, data) {
            (CpuData::U32(d), CpuData::U32(s)) => d[range].copy_from_slice(&s),
            (CpuData::I64(d), CpuData::I64(s)) => d[range].copy_from_slice(&s),
            (d, s) => return Err(Error::DTypeMismatch { op: "load_state_dict", lhs: d.dtype(), rhs: s.dtype() }),
        }
        Ok(())
    }
}
