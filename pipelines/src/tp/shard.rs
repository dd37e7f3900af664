//! How a tensor is split over a tensor-parallel group ([`ShardSpec`]) and the moves between a
//! full tensor, one rank's part and the rank-major concatenation that `all_gather` and
//! `reduce_scatter` work on.
//!
//! A split of dimension `dim` into `parts` views the full tensor as `[outer, blocks, parts,
//! chunk]`: `outer` is the product of the dimensions before `dim`, `blocks` independent blocks of
//! `dim` are each cut into `parts` contiguous pieces, and `chunk` is one piece with everything
//! after `dim`. Rank `r` holds `[outer, blocks, 1, chunk]`. `blocks` is 1 except for the packed
//! attention projection `attn.qkv` (`[3C, C]` = q rows | k rows | v rows), where it is 3 so a rank
//! keeps the q, k and v rows of the same heads. Collectives concatenate per rank, giving the
//! rank-major order `[parts, outer, blocks, chunk]`.

use std::collections::BTreeMap;

use rtx_tensor::nn::Module;
use rtx_tensor::{DType, Tensor};

use super::group::TpHandle;
use crate::error::{Error, Result};

/// Which dimension of a tensor is split over the tensor-parallel ranks, and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardSpec {
    /// The split dimension.
    pub dim: usize,
    /// Number of ranks (parts).
    pub parts: usize,
    /// Independent blocks of `dim`, each split into `parts` (3 for `attn.qkv`, else 1).
    pub blocks: usize,
}

impl ShardSpec {
    /// A plain split of `dim` into `parts`.
    pub fn new(dim: usize, parts: usize) -> ShardSpec {
        ShardSpec { dim, parts, blocks: 1 }
    }

    /// Checks that `full` can be split: `dim` exists and its size is a multiple of
    /// `blocks * parts`.
    pub fn check_full(&self, what: &'static str, full: &[usize]) -> Result<()> {
        let Some(&size) = full.get(self.dim) else {
            return Err(Error::Tensor(rtx_tensor::Error::DimOutOfRange { op: "tp shard", dim: self.dim as isize, rank: full.len() }));
        };
        if self.parts == 0 || self.blocks == 0 || size % (self.parts * self.blocks) != 0 {
            return Err(Error::TpIndivisible { what, value: size, tp: self.parts * self.blocks });
        }
        Ok(())
    }

    /// The shape of one rank's part of a tensor of shape `full`.
    pub fn local_shape(&self, full: &[usize]) -> Vec<usize> {
        let mut shape = full.to_vec();
        if let Some(d) = shape.get_mut(self.dim) {
            *d /= self.parts.max(1);
        }
        shape
    }

    /// The full shape whose parts have shape `local`.
    pub fn full_shape(&self, local: &[usize]) -> Vec<usize> {
        let mut shape = local.to_vec();
        if let Some(d) = shape.get_mut(self.dim) {
            *d *= self.parts;
        }
        shape
    }

    /// `[outer, blocks, parts, chunk]` for a tensor of shape `full`.
    fn view(&self, full: &[usize]) -> [usize; 4] {
        let outer: usize = full[..self.dim].iter().product();
        let inner: usize = full[self.dim + 1..].iter().product();
        let piece = full[self.dim] / (self.blocks * self.parts);
        [outer, self.blocks, self.parts, piece * inner]
    }

    /// Rank `rank`'s part of `full`, as a fresh contiguous f32 tensor (sharing nothing with
    /// `full`, not attached to its graph).
    pub fn slice(&self, full: &Tensor, rank: usize) -> Result<Tensor> {
        self.check_full("split dimension", full.shape())?;
        let view = self.view(full.shape());
        let part = full.detach().reshape(&view)?.narrow(2, rank, 1)?;
        Ok(Tensor::from_vec(part.to_f32_vec()?, &self.local_shape(full.shape()))?)
    }

    /// The elements of `full` in rank-major order (every rank's part, rank 0 first), the input
    /// layout of a reduce-scatter.
    pub fn to_rank_major(&self, full: &Tensor) -> Result<Vec<f32>> {
        self.check_full("split dimension", full.shape())?;
        let view = self.view(full.shape());
        Ok(full.detach().reshape(&view)?.permute(&[2, 0, 1, 3])?.to_f32_vec()?)
    }

    /// The full tensor of shape `full` from its elements in rank-major order (the output of an
    /// all-gather of the parts).
    pub fn from_rank_major(&self, rank_major: Vec<f32>, full: &[usize]) -> Result<Tensor> {
        self.check_full("split dimension", full)?;
        let [outer, blocks, parts, chunk] = self.view(full);
        let t = Tensor::from_vec(rank_major, &[parts, outer, blocks, chunk])?.permute(&[1, 2, 0, 3])?;
        Ok(Tensor::from_vec(t.to_f32_vec()?, full)?)
    }
}

/// Every parameter of `module` as the full tensor: `value(param)` (the parameter or its
/// gradient), all-gathered where `spec(name)` says it is split. A collective over `group`.
pub(crate) fn gather_full_state(
    module: &dyn Module,
    spec: impl Fn(&str) -> Option<ShardSpec>,
    group: &TpHandle,
    value: impl Fn(&Tensor) -> Result<Tensor>,
) -> Result<Vec<(String, Tensor)>> {
    module
        .named_parameters()
        .into_iter()
        .map(|(name, param)| {
            let local = value(&param)?;
            let full = match spec(&name) {
                Some(spec) => {
                    let input = local.to_f32_vec()?;
                    let mut gathered = vec![0f32; input.len() * group.size()];
                    group.all_gather(&input, &mut gathered)?;
                    spec.from_rank_major(gathered, &spec.full_shape(local.shape()))?
                }
                None => Tensor::from_vec(local.to_f32_vec()?, local.shape())?,
            };
            Ok((name, full))
        })
        .collect()
}

/// Copies rank `rank`'s slices of the full tensors `full` (by name; extra entries ignored) into
/// `module`'s parameters, in place.
pub(crate) fn load_full_state(module: &dyn Module, spec: impl Fn(&str) -> Option<ShardSpec>, rank: usize, full: &[(String, Tensor)]) -> Result<()> {
    let by_name: BTreeMap<&str, &Tensor> = full.iter().map(|(n, t)| (n.as_str(), t)).collect();
    for (name, local) in module.named_parameters() {
        let Some(&source) = by_name.get(name.as_str()) else {
            return Err(Error::TpLoad { name, reason: "missing from the full state".into() });
        };
        let spec = spec(&name);
        let expected = spec.map_or_else(|| local.shape().to_vec(), |s| s.full_shape(local.shape()));
        if source.shape() != expected.as_slice() {
            return Err(Error::TpLoad { name, reason: format!("full shape {:?}, expected {expected:?}", source.shape()) });
        }
        let part = match spec {
            Some(spec) => spec.slice(source, rank)?,
            None => source.detach(),
        };
        local.copy_from_(&part)?;
    }
    Ok(())
}

/// Refuses tensors the tensor-parallel collectives do not move (they move f32).
pub(crate) fn check_f32(op: &'static str, t: &Tensor) -> Result<()> {
    if t.dtype() != DType::F32 {
        return Err(Error::Tensor(rtx_tensor::Error::UnsupportedDType { op, dtype: t.dtype() }));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: slicing then reassembling rank-major parts gives back the full tensor, for plain and
    // blocked (qkv) splits. Method: a tensor of distinct values, every rank's slice concatenated.
    #[test]
    fn slices_reassemble() {
        let full = Tensor::from_vec((0..6 * 4).map(|x| x as f32).collect::<Vec<_>>(), &[6, 4]).unwrap();
        for spec in [ShardSpec::new(0, 2), ShardSpec::new(1, 2), ShardSpec::new(1, 4), ShardSpec { dim: 0, parts: 2, blocks: 3 }] {
            let parts: Vec<f32> = (0..spec.parts).flat_map(|r| spec.slice(&full, r).unwrap().to_f32_vec().unwrap()).collect();
            assert_eq!(parts, spec.to_rank_major(&full).unwrap(), "{spec:?}");
            let back = spec.from_rank_major(parts, &[6, 4]).unwrap();
            assert_eq!(back.to_f32_vec().unwrap(), full.to_f32_vec().unwrap(), "{spec:?}");
        }
        // qkv blocks: rank 0 of 2 keeps rows 0 (q), 2 (k), 4 (v) of a [6, 4] table.
        let q = ShardSpec { dim: 0, parts: 2, blocks: 3 }.slice(&full, 0).unwrap().to_f32_vec().unwrap();
        assert_eq!(q, [0., 1., 2., 3., 8., 9., 10., 11., 16., 17., 18., 19.]);
        assert!(matches!(ShardSpec::new(0, 4).slice(&full, 0), Err(Error::TpIndivisible { value: 6, tp: 4, .. })));
    }
}
