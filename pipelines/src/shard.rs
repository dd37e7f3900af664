//! What a rank's optimizer updates: [`ParamSlice`]s, whole parameters under plain data
//! parallelism or, under ZeRO-1, the parts of parameters that fall in this rank's segment of each
//! flat bucket.
//!
//! ZeRO-1 slices are cut by the [`crate::ParamShard`] that owns the segments (see
//! `param_shard.rs`): views of its own parameter segments, not of the buckets. This module holds
//! the slice type, the whole-parameter slices of plain data parallelism and the AdamW factory.

use std::collections::BTreeMap;
use std::ops::Range;

use rtx_tensor::optim::{AdamW, AdamWConfig, ParamBuckets};
use rtx_tensor::Tensor;

/// A contiguous run of one parameter's elements that this rank's optimizer updates.
#[derive(Clone, Debug)]
pub struct ParamSlice {
    /// The parameter's name (as in `Module::named_parameters`).
    pub name: String,
    /// The view the optimizer updates in place: the parameter itself (plain data parallelism) or
    /// a 1-d view of the part of its bucket this rank owns (ZeRO-1). Its gradient slot is bound.
    pub tensor: Tensor,
    /// The full parameter's shape.
    pub param_shape: Vec<usize>,
    /// Which elements of the flattened parameter the view covers.
    pub elements: Range<usize>,
}

impl ParamSlice {
    /// Whether the slice is the whole parameter.
    pub fn is_whole(&self) -> bool {
        self.elements.start == 0 && self.elements.end == self.param_shape.iter().product::<usize>()
    }
}

/// The `(name, tensor)` pairs an optimizer constructor takes.
pub fn named_slices(slices: &[ParamSlice]) -> Vec<(String, Tensor)> {
    slices.iter().map(|s| (s.name.clone(), s.tensor.clone())).collect()
}

/// An optimizer factory building [`AdamW`] over the slices, with weight decay where
/// `decay(name, full_shape)` holds (`|_, shape| shape.len() >= 2` is nanoGPT's rule). Deciding by the
/// full shape keeps the decision the same whether or not the parameter is sharded.
pub fn adamw(config: AdamWConfig, decay: impl Fn(&str, &[usize]) -> bool) -> impl FnOnce(&[ParamSlice]) -> rtx_tensor::Result<AdamW> {
    move |slices| {
        let shapes: BTreeMap<&str, &[usize]> = slices.iter().map(|s| (s.name.as_str(), s.param_shape.as_slice())).collect();
        AdamW::with_decay_filter(named_slices(slices), config, |name, _| shapes.get(name).is_some_and(|shape| decay(name, shape)))
    }
}

/// Whole-parameter slices (plain data parallelism): the bucket views the module holds, whose
/// gradient slots `ParamBuckets` already bound.
pub(crate) fn whole_slices(buckets: &ParamBuckets) -> Vec<ParamSlice> {
    buckets
        .named_parameters()
        .into_iter()
        .zip(buckets.entries())
        .map(|((name, tensor), entry)| ParamSlice { name, tensor, param_shape: entry.shape.clone(), elements: 0..entry.numel })
        .collect()
}
