//! Host staging of gradients for parameters that stay where they are: the data-parallel path of
//! models on a CUDA device (and, for tests, of host models with [`crate::DpConfig::host_staging`]).
//!
//! Plain data parallelism moves every parameter into flat host buckets and lets backward write
//! into them (see [`rtx_tensor::optim::ParamBuckets`]). A parameter on a GPU cannot live in a host
//! bucket, so instead the engine keeps a **mirror**: [`ParamBuckets`] built over host copies of the
//! parameters (same layout rule: reverse visit order, one dtype per bucket, `bucket_bytes_max`),
//! while the module keeps its own tensors. Per step:
//!
//! 1. every parameter's gradient is cleared (`set_grad(None)`); forward and backward run where
//!    the parameters are;
//! 2. bucket by bucket in index order, the bucket's gradients are packed on the device and copied
//!    device → host into the bucket's gradient storage in one transfer
//!    ([`Staging::download_bucket`]; a parameter the loss did not use contributes zeros) and the
//!    bucket is handed to the communication thread at once, so the all-reduce of bucket `i`
//!    overlaps the copy of bucket `i + 1`;
//! 3. once every report is in, each bucket's averaged gradients go back host → device in one
//!    transfer and are unpacked into the parameters' gradients ([`Staging::upload_grads`]), and
//!    the optimizer steps where the parameters are.
//!
//! The collectives are the host communicator's, in the same order with the same bits as the
//! bucket path, so replicas stay bit-identical and nothing depends on timing; the copies are
//! exact (same dtype both ways). The mirror's parameter storage serves the engine's opening
//! broadcast of rank 0's parameters, which [`Staging::install_params`] then writes into the
//! module's tensors in place (so an optimizer built afterwards, or anyone else holding them,
//! sees them).
//!
//! The device path ([`crate::DataParallel::with_device_reduce`]) uses the same layout without the
//! host copies: [`Staging::pack_grads`] packs a bucket's gradients into a dense tensor of the
//! mirror bucket's length on the parameters' device, the engine's `DeviceReduce` averages it
//! there, and [`Staging::unpack_grads`] hands each parameter its slice; the opening broadcast
//! goes through [`Staging::pack_params`] and [`Staging::install_flat_params`]. The mirror's
//! host storages are then only the layout (they still hold a host copy of the parameters and
//! room for the gradients, which this path leaves unused).
//!
//! Under ZeRO-1/2 (see `crate::data_parallel`, "ZeRO on staged parameters") step 3 changes: the
//! bucket collective is a reduce-scatter into the rank's `ParamShard`, which uploads its own
//! segment and steps on the device; the mirror's parameter storage then receives every rank's
//! updated segments by all-gather and [`Staging::install_params`] writes them into the module
//! (one upload per bucket). Under ZeRO-2, [`Staging::release_grads`] drops a bucket's parameter
//! gradients right after its download.
//!
//! Ownership: the mirror's gradient storage belongs to the compute thread except while its bucket
//! is handed to the communication thread (between `submit` and its report), exactly as in the
//! bucket path; the module's tensors and their gradients are never touched by the communication
//! thread.

use rtx_tensor::optim::ParamBuckets;
use rtx_tensor::{Device, Module, Tensor};

use crate::error::{Error, Result};
use crate::shard::ParamSlice;

/// The mirror of a module whose parameters stay in place.
pub(crate) struct Staging {
    /// Host buckets over copies of the parameters.
    mirror: ParamBuckets,
    /// Per bucket, its first element and its entries in offset order (they tile one range, so
    /// the bucket moves as one block).
    tiles: Vec<(usize, Vec<usize>)>,
    /// The module's own parameters, in visit order (index = mirror entry index).
    params: Vec<(String, Tensor)>,
    /// Where the parameters live.
    device: Device,
}

/// A module holding host copies of another module's parameters, for [`ParamBuckets::new`].
struct HostCopies(Vec<(String, Tensor)>);

impl Module for HostCopies {
    fn visit_params(&self, _prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        for (name, t) in &self.0 {
            f(name, t);
        }
    }

    fn visit_params_mut(&mut self, _prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        for (name, t) in &mut self.0 {
            f(name, t);
        }
    }
}

impl Staging {
    /// Mirrors `model`'s parameters (all on one device) in host buckets of at most
    /// `bucket_bytes_max` bytes. Reads every parameter once (a device → host copy).
    pub(crate) fn new<M: Module>(model: &M, bucket_bytes_max: usize) -> Result<Staging> {
        let params = model.named_parameters();
        let device = placement(&params)?;
        let mut copies = Vec::with_capacity(params.len());
        for (name, p) in &params {
            copies.push((name.clone(), Tensor::from_data(p.to_data()?, p.shape())?.requires_grad(true)));
        }
        let mut host = HostCopies(copies);
        let mirror = ParamBuckets::new(&mut host, bucket_bytes_max)?;
        debug_assert_eq!(mirror.entries().len(), params.len(), "staging: one mirror entry per parameter");
        let tiles = (0..mirror.buckets().len()).map(|bucket| tiled_entries(&mirror, bucket)).collect::<Result<_>>()?;
        Ok(Staging { mirror, tiles, params, device })
    }

    /// The host buckets (their storages are what the collectives reduce).
    pub(crate) fn buckets(&self) -> &ParamBuckets {
        &self.mirror
    }

    /// Where the parameters live.
    pub(crate) fn device(&self) -> Device {
        self.device
    }

    /// Whole-parameter slices over the module's own tensors (what the optimizer updates).
    pub(crate) fn slices(&self) -> Vec<ParamSlice> {
        self.params
            .iter()
            .zip(self.mirror.entries())
            .map(|((name, tensor), entry)| ParamSlice {
                name: name.clone(),
                tensor: tensor.clone(),
                param_shape: entry.shape.clone(),
                elements: 0..entry.numel,
            })
            .collect()
    }

    /// Clears every parameter's gradient, so backward allocates fresh ones where the parameters
    /// are (an unused parameter keeps none).
    pub(crate) fn clear_grads(&self) -> Result<()> {
        for (_, p) in &self.params {
            p.set_grad(None)?;
        }
        Ok(())
    }

    /// Copies the gradients of bucket `bucket`'s parameters into its host gradient storage
    /// (zeros for a parameter without a gradient) in one device → host transfer
    /// ([`rtx_tensor::download_packed`]). Waits for the device's queued work.
    pub(crate) fn download_bucket(&self, bucket: usize) -> Result<()> {
        let b = &self.mirror.buckets()[bucket];
        let start = self.tiles[bucket].0;
        let grads = self.bucket_grads(bucket)?;
        let parts: Vec<(Option<&Tensor>, usize)> = grads.iter().map(|(g, n)| (g.as_ref(), *n)).collect();
        Ok(rtx_tensor::download_packed(&parts, b.grad_storage(), start)?)
    }

    /// Drops the gradients of bucket `bucket`'s parameters (ZeRO-2, once they are downloaded).
    pub(crate) fn release_grads(&self, bucket: usize) -> Result<()> {
        for &idx in &self.tiles[bucket].1 {
            self.params[idx].1.set_grad(None)?;
        }
        Ok(())
    }

    /// Bucket `bucket`'s gradients packed into one fresh dense 1-d tensor where the parameters
    /// live ([`rtx_tensor::pack_dense`]), as long as the mirror's bucket and laid out as it is:
    /// zeros for a parameter without a gradient and outside the parameters' range. A collective
    /// over it therefore sees the buffer the host-staging path reduces. Only queues work.
    pub(crate) fn pack_grads(&self, bucket: usize) -> Result<Tensor> {
        let grads = self.bucket_grads(bucket)?;
        self.pack(bucket, grads.iter().map(|(g, n)| (g.as_ref(), *n)).collect())
    }

    /// Sets the gradients of bucket `bucket`'s parameters to their slices of `flat` (a tensor of
    /// [`pack_grads`](Self::pack_grads)'s layout, averaged), as fresh tensors on the device.
    pub(crate) fn unpack_grads(&self, bucket: usize, flat: &Tensor) -> Result<()> {
        let (start, entries) = &self.tiles[bucket];
        let shapes: Vec<Vec<usize>> = entries.iter().map(|&idx| self.mirror.entries()[idx].shape.clone()).collect();
        let grads = rtx_tensor::unpack_dense(flat, *start, &shapes)?;
        debug_assert_eq!(grads.len(), entries.len(), "staging: one gradient per entry");
        for (&idx, g) in entries.iter().zip(grads) {
            self.params[idx].1.set_grad(Some(g))?;
        }
        Ok(())
    }

    /// Bucket `bucket`'s parameter values packed as [`pack_grads`](Self::pack_grads) packs
    /// gradients (for the opening broadcast on the device path).
    pub(crate) fn pack_params(&self, bucket: usize) -> Result<Tensor> {
        let (_, entries) = &self.tiles[bucket];
        let parts = entries.iter().map(|&idx| (Some(&self.params[idx].1), self.mirror.entries()[idx].numel)).collect();
        self.pack(bucket, parts)
    }

    /// Writes bucket `bucket`'s parameter values from `flat` (of [`pack_params`](Self::pack_params)'s
    /// layout) into the module's tensors, in place.
    pub(crate) fn install_flat_params(&self, bucket: usize, flat: &Tensor) -> Result<()> {
        let (start, entries) = &self.tiles[bucket];
        let shapes: Vec<Vec<usize>> = entries.iter().map(|&idx| self.mirror.entries()[idx].shape.clone()).collect();
        let values = rtx_tensor::unpack_dense(flat, *start, &shapes)?;
        for (&idx, v) in entries.iter().zip(values) {
            self.params[idx].1.copy_from_(&v)?;
        }
        Ok(())
    }

    /// Packs `parts` (bucket `bucket`'s entries in offset order) into a dense tensor of the
    /// bucket's length on the parameters' device, zeros before and after them.
    fn pack(&self, bucket: usize, parts: Vec<(Option<&Tensor>, usize)>) -> Result<Tensor> {
        let b = &self.mirror.buckets()[bucket];
        let start = self.tiles[bucket].0;
        let used: usize = parts.iter().map(|(_, n)| n).sum();
        debug_assert!(start + used <= b.numel(), "staging: a bucket's entries lie inside it");
        let mut all = Vec::with_capacity(parts.len() + 2);
        all.push((None, start));
        all.extend(parts);
        all.push((None, b.numel() - start - used));
        let flat = rtx_tensor::pack_dense(&all, b.dtype(), self.device)?;
        debug_assert_eq!(flat.numel(), b.numel(), "staging: a packed bucket has the mirror's length");
        Ok(flat)
    }

    /// The gradients of bucket `bucket`'s parameters in offset order, in the bucket's dtype, with
    /// their lengths (`None`: the parameter has no gradient).
    fn bucket_grads(&self, bucket: usize) -> Result<Vec<(Option<Tensor>, usize)>> {
        let b = &self.mirror.buckets()[bucket];
        let (_, entries) = &self.tiles[bucket];
        let mut grads = Vec::with_capacity(entries.len());
        for &idx in entries {
            let entry = &self.mirror.entries()[idx];
            let (name, p) = &self.params[idx];
            let g = match p.grad() {
                Some(g) if g.dtype() == b.dtype() => Some(g),
                Some(g) => Some(g.to_dtype(b.dtype())?),
                None => None,
            };
            if let Some(g) = &g {
                if g.numel() != entry.numel {
                    return Err(Error::Staging {
                        name: name.clone(),
                        reason: format!("gradient of {} elements for a parameter of {}", g.numel(), entry.numel),
                    });
                }
            }
            grads.push((g, entry.numel));
        }
        Ok(grads)
    }

    /// Sets every parameter's gradient to its averaged value from the mirror, one host → device
    /// transfer per bucket ([`rtx_tensor::upload_packed`]).
    pub(crate) fn upload_grads(&self) -> Result<()> {
        for (b, (start, entries)) in self.mirror.buckets().iter().zip(&self.tiles) {
            let shapes: Vec<Vec<usize>> = entries.iter().map(|&idx| self.mirror.entries()[idx].shape.clone()).collect();
            let grads = rtx_tensor::upload_packed(b.grad_storage(), *start, &shapes, self.device)?;
            for (&idx, g) in entries.iter().zip(grads) {
                self.params[idx].1.set_grad(Some(g))?;
            }
        }
        Ok(())
    }

    /// Writes the mirror's parameter values (after the opening broadcast, and under ZeRO after
    /// each step's all-gather) into the module's tensors, in place: one host → device transfer
    /// per bucket ([`rtx_tensor::upload_packed`]), then a copy into each parameter.
    pub(crate) fn install_params(&self) -> Result<()> {
        for (b, (start, entries)) in self.mirror.buckets().iter().zip(&self.tiles) {
            let shapes: Vec<Vec<usize>> = entries.iter().map(|&idx| self.mirror.entries()[idx].shape.clone()).collect();
            let values = rtx_tensor::upload_packed(b.param_storage(), *start, &shapes, self.device)?;
            debug_assert_eq!(values.len(), entries.len(), "staging: one value per entry");
            for (&idx, v) in entries.iter().zip(values) {
                self.params[idx].1.copy_from_(&v)?;
            }
        }
        Ok(())
    }
}

/// The one device all `params` live on (the host for none); mixed placements are an error.
pub(crate) fn placement(params: &[(String, Tensor)]) -> Result<Device> {
    let Some((first, p0)) = params.first() else { return Ok(Device::Cpu) };
    let device = p0.device();
    match params.iter().find(|(_, p)| p.device() != device) {
        Some((other, p)) => Err(Error::MixedDevices { first: first.clone(), first_device: device, other: other.clone(), other_device: p.device() }),
        None => Ok(device),
    }
}

/// Bucket `bucket`'s first element and its entries in offset order, checked to tile one range of
/// the bucket (so the bucket moves as one block).
fn tiled_entries(mirror: &ParamBuckets, bucket: usize) -> Result<(usize, Vec<usize>)> {
    let mut entries = mirror.buckets()[bucket].entries().to_vec();
    entries.sort_by_key(|&idx| mirror.entries()[idx].offset);
    let start = entries.first().map_or(0, |&idx| mirror.entries()[idx].offset);
    let mut at = start;
    for &idx in &entries {
        let entry = &mirror.entries()[idx];
        if entry.offset != at {
            return Err(Error::Staging { name: entry.name.clone(), reason: format!("bucket {bucket} has a gap before element {}", entry.offset) });
        }
        at += entry.numel;
    }
    Ok((start, entries))
}
