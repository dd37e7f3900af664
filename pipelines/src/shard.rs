//! What a rank's optimizer updates: [`ParamSlice`]s, whole parameters under plain data
//! parallelism or, under ZeRO-1, the parts of parameters that fall in this rank's segment of each
//! flat bucket.
//!
//! ZeRO-1 layout: bucket `b` of `numel` elements is split with
//! [`rtx_collectives::segment_range`]`(numel, n_ranks, rank)`, the same split `reduce_scatter` and
//! `all_gather` use, so the segment this rank owns is exactly the one the collective leaves
//! reduced on it. The averaged gradient segment lands in a buffer of its own (one per bucket); each
//! slice is a 1-d view of the bucket's parameter storage whose gradient slot is bound to the
//! matching view of that buffer. A parameter meets a contiguous segment in at most one contiguous
//! run, so each rank gets at most one slice per parameter and slices keep the parameter's name.

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

/// This rank's segment of one bucket under ZeRO-1.
#[derive(Clone, Debug)]
pub(crate) struct BucketShard {
    /// Elements of the flat bucket this rank owns.
    pub(crate) own: Range<usize>,
    /// The averaged gradient of `own` (1-d, its own storage; written by `reduce_scatter`).
    pub(crate) grads: Tensor,
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

/// The ZeRO-1 segments of every bucket for `rank` of `n_ranks`, and the slices they cut, in
/// parameter visit order.
pub(crate) fn shard_slices(buckets: &ParamBuckets, rank: usize, n_ranks: usize) -> rtx_tensor::Result<(Vec<BucketShard>, Vec<ParamSlice>)> {
    assert!(rank < n_ranks, "shard: rank inside the group");
    let shards: Vec<BucketShard> = buckets
        .buckets()
        .iter()
        .map(|b| {
            let own = rtx_collectives::segment_range(b.numel(), n_ranks, rank);
            BucketShard { grads: Tensor::zeros(&[own.len()], b.dtype()), own }
        })
        .collect();
    let mut slices = Vec::new();
    for entry in buckets.entries() {
        let shard = &shards[entry.bucket];
        let start = entry.offset.max(shard.own.start);
        let end = (entry.offset + entry.numel).min(shard.own.end);
        if start >= end {
            continue;
        }
        let bucket = &buckets.buckets()[entry.bucket];
        let tensor = bucket.params().narrow(0, start, end - start)?;
        let grad = shard.grads.narrow(0, start - shard.own.start, end - start)?;
        debug_assert!(tensor.is_contiguous() && grad.is_contiguous());
        tensor.set_grad(Some(grad))?;
        slices.push(ParamSlice { name: entry.name.clone(), tensor, param_shape: entry.shape.clone(), elements: start - entry.offset..end - entry.offset });
    }
    debug_assert_eq!(slices.iter().map(|s| s.elements.len()).sum::<usize>(), shards.iter().map(|s| s.own.len()).sum::<usize>(), "shard: slices cover the owned segments exactly");
    Ok((shards, slices))
}
