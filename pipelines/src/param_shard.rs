//! The `ParamShard` role (ZeRO-1): owns one rank's segment of every flat parameter bucket, the
//! optimizer over those segments and its state, and the number of the next step it will apply.
//! Given the group-averaged gradient of its segments for step `s` it runs the optimizer and hands
//! back the updated parameter segments, which the trainer all-gathers into every replica.
//!
//! # What it owns
//!
//! Per bucket `b`, the shard owns the elements `segment_range(numel_b, n_ranks, rank)` (the split
//! `reduce_scatter` and `all_gather` use). A host shard ([`ParamShard::new`]) holds them as two
//! 1-d tensors over storages of its own: the parameter segment (copied from the bucket when the
//! shard is made) and the gradient segment; a shard on a device is laid out as "Segments on a
//! device" below says.
//! The optimizer is built over [`ParamSlice`]s that view the parameter segments (a parameter meets
//! a contiguous segment in at most one run, so each rank gets at most one slice per parameter, and
//! slices keep the parameter's name), with their gradient slots bound to the matching views of the
//! gradient segments. Nobody else writes these storages, except the data-parallel engine's
//! reduce-scatter, which fills the gradient segments while the shard waits for that step.
//!
//! # Segments on a device
//!
//! [`ParamShard::new_on`] places the shard's slices, and so the optimizer and its state, on a
//! device: the shard of a data-parallel engine whose parameters stay in the module on a GPU (host
//! staging, see `crate::staging`). There each slice is a 1-d tensor of its own on the device, with
//! no flat parameter segment: a device optimizer (`MixedAdamW`) updates whole dense storages, not
//! views into a segment. The collectives still run over host buffers, so each segment keeps a
//! host **landing** gradient segment: the reduce-scatter writes the averaged gradient there
//! ([`grad_storage`](ParamShard::grad_storage)), clipping reads and scales it there
//! ([`ParamShard::grad_sum_squares`] and `scale_grads`: the host shard's arithmetic on the same
//! bits), and [`ParamShard::apply_reduced`] uploads it, one host → device transfer per bucket,
//! as the slices' gradients before the optimizer steps on the device. `write_into` copies the
//! updated slices device → host into their places in the mirror's parameter bucket (one transfer
//! per bucket) for the host all-gather.
//!
//! Decision (constraints, choice, consequences). *Constraints:* checkpoints and elastic recovery
//! exchange [`ShardState`]s of host data; the optimizer must run where its parameters are (a GPU
//! optimizer takes device tensors, and its f32 master weights and moments are the bulk of the
//! state); the host engine's bits must not change. *Choice:* a device on the shard, fixed at
//! construction (`new_on`; `new` is the host shard, whose slices view flat host segments and
//! whose landing segments are its gradient segments); exports download (parameter values as host
//! `CpuData`, one transfer per bucket; optimizer state as the optimizer's `state_tensors`, which
//! leave the device), imports upload. `new_on(Device::Cpu)` keeps the device layout (slices of
//! their own, separate landing segments), so host staging on the CPU runs every step of the GPU
//! path, and its bits are the host shard's (AdamW's per-element arithmetic does not depend on
//! where a slice's storage starts). *Pros:* on a GPU a rank holds `1/n` of the optimizer state
//! there and AdamW runs on the GPU; the wire and checkpoint formats are unchanged. *Cons:* the
//! host keeps a landing copy of the gradient segments and the device a copy of them as the
//! slices' gradients (each `1/n` of the gradients, counted by [`ParamShard::bytes`]); the uploads
//! and downloads serialise with the device's queue; ZeRO-3, which all-gathers flat parameter
//! segments, takes host shards only.
//!
//! # Messages and their contract
//!
//! [`ParamShardMsg::Apply`] takes step `s` and one gradient segment per bucket; it is accepted only
//! when `s` is the shard's next step and every segment has the owned length and the bucket's
//! dtype. Otherwise the answer is a typed error ([`Error::StaleStep`], [`Error::SegmentCount`],
//! [`Error::SegmentLength`], [`Error::SegmentDType`]) and nothing has changed: validation runs
//! before the first write. [`ParamShardMsg::Export`] copies the whole state ([`ShardState`]: next
//! step, segments, parameter values, the optimizer's named state tensors) for checkpoints and
//! elastic recovery; [`ParamShardMsg::Import`] restores one, checked against this shard's layout
//! and optimizer state names, shapes and dtypes first ([`Error::SegmentLayout`],
//! [`Error::ShardStateMismatch`]). Bad input never stops the actor; it answers and waits for the
//! next message. The mailbox holds [`PARAM_SHARD_MAILBOX`] messages (back-pressure on senders).
//!
//! # Decision: how `DataParallel` drives it
//!
//! Constraint: `DataParallel`'s public API lends out the optimizer between steps
//! (`optimizer()`, `optimizer_mut()` for the learning-rate schedule, `into_parts()`), and the
//! supervisor's elastic ZeRO-1 path reads it for its snapshots; a tokio task cannot lend `&O`.
//! The tensors themselves are no obstacle (`Tensor` is `Send + Sync`), and a `ParamShard` is an
//! [`Actor`]: spawn it with [`rtx_actors::spawn`] to serve the messages above. Choice: the engine
//! owns its shard in place and calls the same handlers ([`ParamShard::apply_reduced`], the
//! zero-copy form of `Apply` whose gradients the reduce-scatter already wrote into the shard's
//! gradient segments) between its collectives, as `DataShard::inline` serves batches without a
//! thread. Pros: the public API, the step's timing and its bits are unchanged (the same AdamW
//! arithmetic on the same values); no extra copy of gradients. Cons: an in-place shard lives on the
//! trainer's thread; a remote shard (another process) needs the messages carried over a link
//! (`rtx_actors::Link::over_transport`) and a serialisable `ShardState`, not written yet.

use std::collections::BTreeMap;
use std::ops::Range;

use rtx_actors::{Actor, Context, Reply};
use rtx_kernels::DType;
use rtx_tensor::optim::ParamBuckets;
use rtx_tensor::{CpuData, Device, Optimizer, Storage, Tensor};

use crate::error::{Error, Result};
use crate::shard::ParamSlice;

/// Mailbox capacity of a spawned [`ParamShard`]: the trainer has at most one step in flight, plus
/// room for an export or a learning-rate change.
pub const PARAM_SHARD_MAILBOX: usize = 4;

/// One rank's ZeRO-1 segments, their optimizer and its state (see the module doc).
pub struct ParamShard<O> {
    rank: usize,
    n_ranks: usize,
    /// Where the segments and the optimizer live.
    device: Device,
    /// Whether the gradient segments have separate host landing segments (made by `new_on`).
    staged: bool,
    segments: Vec<Segment>,
    slices: Vec<ParamSlice>,
    optimizer: O,
    next_step: u64,
}

/// A copy of a shard's whole state: what [`ParamShard::export`] returns and
/// [`ParamShard::import`] restores.
#[derive(Clone, Debug)]
pub struct ShardState {
    /// The next step the shard will apply (steps applied so far, counted from the shard's start).
    pub step: u64,
    /// The owned element range of each bucket.
    pub segments: Vec<Range<usize>>,
    /// The parameter values of each segment.
    pub params: Vec<CpuData>,
    /// The optimizer's named state tensors ([`Optimizer::state_tensors`]).
    pub optimizer: Vec<(String, Tensor)>,
}

/// Messages of a spawned [`ParamShard`].
#[derive(Debug)]
pub enum ParamShardMsg {
    /// Apply the averaged gradient segments (one per bucket) of `step`; answers the updated
    /// parameter segments.
    Apply {
        /// The step these gradients belong to; must be the shard's next step.
        step: u64,
        /// One averaged gradient segment per bucket, of the owned length and the bucket's dtype.
        grads: Vec<CpuData>,
        /// The updated parameter segments, or why nothing was applied.
        reply: Reply<Result<Vec<CpuData>>>,
    },
    /// Copy the whole state.
    Export {
        /// The state.
        reply: Reply<Result<ShardState>>,
    },
    /// Replace the whole state (checked first; nothing changes on an error).
    Import {
        /// The state to restore.
        state: ShardState,
        /// Done, or why not.
        reply: Reply<Result<()>>,
    },
    /// Set the optimizer's learning rate (before the next `Apply`).
    SetLr {
        /// The new base learning rate.
        lr: f64,
    },
}

/// One bucket's owned segment.
struct Segment {
    own: Range<usize>,
    dtype: DType,
    /// A host shard's owned parameter elements: 1-d, its own storage, viewed by the slices.
    /// `None` for a staged shard, whose slices are tensors of their own on the device.
    params: Option<Tensor>,
    /// 1-d, on the host, its own storage: the averaged gradient of the owned elements, what the
    /// reduce-scatter writes into. A host shard's slices' gradients view it; a staged shard
    /// uploads it into its slices' gradients before the optimizer steps.
    landing: Tensor,
    /// The indices (into the shard's slices) of the slices in this segment, in element order;
    /// they tile the segment.
    parts: Vec<usize>,
}

impl<O: Optimizer> ParamShard<O> {
    /// The shard of `rank` in a group of `n_ranks` over `buckets`: copies the rank's segment of
    /// every bucket's parameters, cuts the [`ParamSlice`]s and builds the optimizer over them with
    /// `make_optimizer` (which may load state into it). The optimizer must update only the given
    /// slices.
    pub fn new<F>(buckets: &ParamBuckets, rank: usize, n_ranks: usize, make_optimizer: F) -> Result<Self>
    where
        F: FnOnce(&[ParamSlice]) -> rtx_tensor::Result<O>,
    {
        Self::build(buckets, rank, n_ranks, None, make_optimizer)
    }

    /// [`new`](Self::new) with the parameter and gradient segments on `device` (copied there from
    /// the host buckets), so the optimizer `make_optimizer` builds over them, and its state, live
    /// there too; the reduce-scatter writes into host landing segments, uploaded before each
    /// optimizer step (see the module doc, "Segments on a device"). `Device::Cpu` keeps the
    /// landing segments separate too, so the host runs the device path's transfers.
    pub fn new_on<F>(device: Device, buckets: &ParamBuckets, rank: usize, n_ranks: usize, make_optimizer: F) -> Result<Self>
    where
        F: FnOnce(&[ParamSlice]) -> rtx_tensor::Result<O>,
    {
        Self::build(buckets, rank, n_ranks, Some(device), make_optimizer)
    }

    /// The shard, with its segments on `staged_on` and separate landing segments when given.
    fn build<F>(buckets: &ParamBuckets, rank: usize, n_ranks: usize, staged_on: Option<Device>, make_optimizer: F) -> Result<Self>
    where
        F: FnOnce(&[ParamSlice]) -> rtx_tensor::Result<O>,
    {
        if n_ranks == 0 || rank >= n_ranks {
            return Err(Error::InvalidConfig { reason: "param shard: rank must be inside the group" });
        }
        let device = staged_on.unwrap_or(Device::Cpu);
        let mut segments = Vec::with_capacity(buckets.buckets().len());
        for bucket in buckets.buckets() {
            let own = rtx_collectives::segment_range(bucket.numel(), n_ranks, rank);
            let params = match staged_on {
                None => Some(Tensor::from_data(bucket.params().narrow(0, own.start, own.len())?.to_data()?, &[own.len()])?),
                Some(_) => None,
            };
            let landing = Tensor::zeros(&[own.len()], bucket.dtype());
            segments.push(Segment { own, dtype: bucket.dtype(), params, landing, parts: Vec::new() });
        }
        let mut slices = Vec::new();
        // Per bucket, (first bucket element, slice index) of the slices in its segment.
        let mut starts: Vec<Vec<(usize, usize)>> = vec![Vec::new(); segments.len()];
        for entry in buckets.entries() {
            let segment = &segments[entry.bucket];
            let start = entry.offset.max(segment.own.start);
            let end = (entry.offset + entry.numel).min(segment.own.end);
            if start >= end {
                continue;
            }
            let at = start - segment.own.start;
            let tensor = match &segment.params {
                Some(params) => {
                    let tensor = params.narrow(0, at, end - start)?;
                    let grad = segment.landing.narrow(0, at, end - start)?;
                    debug_assert!(tensor.is_contiguous() && grad.is_contiguous());
                    tensor.set_grad(Some(grad))?;
                    tensor
                }
                // A tensor of its own where the shard lives: a device optimizer (`MixedAdamW`)
                // updates whole dense storages, not views into a segment. Its gradient is bound
                // by each step's upload.
                None => Tensor::from_data(bucket_values(buckets, entry.bucket, start..end)?, &[end - start])?.to_device(device)?,
            };
            starts[entry.bucket].push((start, slices.len()));
            slices.push(ParamSlice { name: entry.name.clone(), tensor, param_shape: entry.shape.clone(), elements: start - entry.offset..end - entry.offset });
        }
        for (segment, mut starts) in segments.iter_mut().zip(starts) {
            starts.sort_unstable();
            let mut at = segment.own.start;
            for &(start, idx) in &starts {
                debug_assert_eq!(start, at, "param shard: a segment's slices tile it");
                at += slices[idx].elements.len();
            }
            segment.parts = starts.into_iter().map(|(_, idx)| idx).collect();
        }
        debug_assert_eq!(
            slices.iter().map(|s| s.elements.len()).sum::<usize>(),
            segments.iter().map(|s| s.own.len()).sum::<usize>(),
            "param shard: slices cover the owned segments exactly"
        );
        let optimizer = make_optimizer(&slices)?;
        check_optimizer_params(&optimizer, &slices)?;
        Ok(ParamShard { rank, n_ranks, device, staged: staged_on.is_some(), segments, slices, optimizer, next_step: 0 })
    }

    /// Applies `grads` (one averaged gradient segment per bucket) as step `step` and returns the
    /// updated parameter segments. Nothing changes when it fails validation (see the module doc).
    pub fn apply(&mut self, step: u64, grads: Vec<CpuData>) -> Result<Vec<CpuData>> {
        let _span = tracing::debug_span!("param_shard", actor = "param_shard", msg = "apply", rank = self.rank, step).entered();
        self.check_step(step)?;
        self.check_segments(&grads)?;
        for (segment, grad) in self.segments.iter().zip(grads) {
            let mut slot = segment.landing.storage().write()?;
            debug_assert_eq!(slot.len(), grad.len(), "param shard: validated length");
            *slot = grad;
        }
        self.upload_grads()?;
        self.run_optimizer(step)?;
        (0..self.segments.len()).map(|bucket| self.param_values(bucket)).collect()
    }

    /// Applies step `step` with the averaged gradients already in the shard's gradient segments
    /// (written there by the engine's reduce-scatter, see [`grad_storage`](Self::grad_storage);
    /// a staged shard uploads them from its landing segments first). The parameter segments are
    /// updated in place.
    pub(crate) fn apply_reduced(&mut self, step: u64) -> Result<()> {
        let _span = tracing::debug_span!("param_shard", actor = "param_shard", msg = "apply_reduced", rank = self.rank, step).entered();
        self.check_step(step)?;
        for (bucket, segment) in self.segments.iter().enumerate() {
            let got = segment.landing.storage().len();
            if got != segment.own.len() {
                return Err(Error::SegmentLength { bucket, expected: segment.own.len(), got });
            }
        }
        self.upload_grads()?;
        self.run_optimizer(step)
    }

    /// A staged shard: uploads every landing segment (one host → device transfer per bucket) and
    /// binds the pieces as its slices' gradients. A host shard's slices' gradients view its
    /// landing segments already.
    fn upload_grads(&self) -> Result<()> {
        if !self.staged {
            return Ok(());
        }
        for segment in &self.segments {
            let shapes = self.part_shapes(segment);
            let grads = rtx_tensor::upload_packed(segment.landing.storage(), 0, &shapes, self.device)?;
            debug_assert_eq!(grads.len(), segment.parts.len(), "param shard: one gradient per slice");
            for (&i, grad) in segment.parts.iter().zip(grads) {
                self.slices[i].tensor.set_grad(Some(grad))?;
            }
        }
        Ok(())
    }

    /// Σ g² over this rank's gradient segments, in f64 (buckets in order, each segment in the
    /// fixed chunks of [`rtx_tensor::optim::sum_squares`]). The segments of a group's ranks tile
    /// every bucket exactly once, with no padding, so the group's sum of these is the squared
    /// norm of the whole averaged gradient (see [`crate::clip`]).
    pub fn grad_sum_squares(&self) -> Result<f64> {
        // The host landing segments: a staged shard's arithmetic is the host shard's.
        let grads: Vec<Tensor> = self.segments.iter().map(|s| s.landing.clone()).collect();
        Ok(rtx_tensor::optim::sum_squares(&grads)?)
    }

    /// Multiplies every gradient segment by `coef` in place (the clipping factor, before the
    /// optimizer reads them).
    pub(crate) fn scale_grads(&self, coef: f64) -> Result<()> {
        for segment in &self.segments {
            segment.landing.scale_(coef)?;
        }
        Ok(())
    }

    /// A copy of the whole state.
    pub fn export(&self) -> Result<ShardState> {
        let _span = tracing::debug_span!("param_shard", actor = "param_shard", msg = "export", rank = self.rank, step = self.next_step).entered();
        // Host parameter values wherever the segments live (a device segment is downloaded).
        let params = (0..self.segments.len()).map(|bucket| self.param_values(bucket)).collect::<Result<Vec<_>>>()?;
        Ok(ShardState { step: self.next_step, segments: self.segments(), params, optimizer: self.optimizer.state_tensors()? })
    }

    /// Replaces the whole state by `state`, after checking that it fits this shard (segments,
    /// parameter lengths and dtypes, optimizer state names, shapes and dtypes).
    pub fn import(&mut self, state: ShardState) -> Result<()> {
        let _span = tracing::debug_span!("param_shard", actor = "param_shard", msg = "import", rank = self.rank, step = state.step).entered();
        if state.segments.len() != self.segments.len() {
            return Err(Error::SegmentCount { expected: self.segments.len(), got: state.segments.len() });
        }
        for (bucket, (segment, got)) in self.segments.iter().zip(&state.segments).enumerate() {
            if segment.own != *got {
                return Err(Error::SegmentLayout { bucket, expected: segment.own.clone(), got: got.clone() });
            }
        }
        self.check_segments(&state.params)?;
        let expected: BTreeMap<String, (Vec<usize>, DType)> =
            self.optimizer.state_tensors()?.into_iter().map(|(name, t)| (name, (t.shape().to_vec(), t.dtype()))).collect();
        let mut given = BTreeMap::new();
        for (name, t) in &state.optimizer {
            if given.insert(name.clone(), (t.shape().to_vec(), t.dtype())).is_some() {
                return Err(Error::ShardStateMismatch { name: name.clone(), reason: "appears twice".into() });
            }
        }
        for (name, want) in &expected {
            match given.get(name) {
                None => return Err(Error::ShardStateMismatch { name: name.clone(), reason: "missing".into() }),
                Some(got) if got != want => {
                    return Err(Error::ShardStateMismatch {
                        name: name.clone(),
                        reason: format!("shape {:?} {}, expected {:?} {}", got.0, got.1, want.0, want.1),
                    })
                }
                Some(_) => {}
            }
        }
        if let Some(name) = given.keys().find(|name| !expected.contains_key(*name)) {
            return Err(Error::ShardStateMismatch { name: name.clone(), reason: "not a state tensor of this optimizer".into() });
        }
        // Checked above; the optimizer checks again (and validates before writing).
        self.optimizer.load_state(&state.optimizer)?;
        for (segment, values) in self.segments.iter().zip(state.params) {
            match &segment.params {
                Some(params) => *params.storage().write()? = values,
                None => {
                    // One upload per bucket, then each slice's values copied in place (the
                    // optimizer holds the slices' tensors).
                    let shapes = self.part_shapes(segment);
                    let uploaded = rtx_tensor::upload_packed(&Storage::new(values), 0, &shapes, self.device)?;
                    for (&i, v) in segment.parts.iter().zip(uploaded) {
                        self.slices[i].tensor.copy_from_(&v)?;
                    }
                }
            }
        }
        self.next_step = state.step;
        Ok(())
    }

    /// The next step the shard will apply.
    pub fn next_step(&self) -> u64 {
        self.next_step
    }

    /// The owned element range of each bucket.
    pub fn segments(&self) -> Vec<Range<usize>> {
        self.segments.iter().map(|s| s.own.clone()).collect()
    }

    /// Where the segments and the optimizer live (the host, unless made by [`new_on`](Self::new_on)).
    pub fn device(&self) -> Device {
        self.device
    }

    /// Bytes the shard holds now: `(parameters, gradients)`, wherever they live. Gradients are the
    /// landing segments, plus a staged shard's slices' uploaded gradients.
    pub fn bytes(&self) -> (usize, usize) {
        let (mut params, mut grads) = (0, 0);
        for s in &self.segments {
            let size = s.dtype.size_in_bytes();
            grads += s.landing.storage().len() * size;
            match &s.params {
                Some(p) => params += p.storage().len() * size,
                None => {
                    for &i in &s.parts {
                        let t = &self.slices[i].tensor;
                        params += t.storage().len() * size;
                        grads += t.grad().map_or(0, |g| g.storage().len() * size);
                    }
                }
            }
        }
        (params, grads)
    }

    /// This shard's rank and group size.
    pub fn placement(&self) -> (usize, usize) {
        (self.rank, self.n_ranks)
    }

    /// What the optimizer updates, in parameter order (views of the parameter segments, gradient
    /// slots bound to the gradient segments).
    pub fn slices(&self) -> &[ParamSlice] {
        &self.slices
    }

    /// The optimizer.
    pub fn optimizer(&self) -> &O {
        &self.optimizer
    }

    /// The optimizer, mutably (to set the learning rate).
    pub fn optimizer_mut(&mut self) -> &mut O {
        &mut self.optimizer
    }

    /// Ends the shard and returns its optimizer.
    pub fn into_optimizer(self) -> O {
        self.optimizer
    }

    /// The storage of bucket `bucket`'s parameter segment (ZeRO-3 all-gathers it into the unit);
    /// a staged shard has none ([`Error::ShardedDevice`]: ZeRO-3 shards host parameters only).
    pub(crate) fn param_storage(&self, bucket: usize) -> Result<&Storage> {
        match &self.segments[bucket].params {
            Some(params) => Ok(params.storage()),
            None => Err(Error::ShardedDevice { device: self.device }),
        }
    }

    /// The host storage bucket `bucket`'s averaged gradient segment is written into by a
    /// reduce-scatter (a staged shard's landing segment).
    pub(crate) fn grad_storage(&self, bucket: usize) -> &Storage {
        self.segments[bucket].landing.storage()
    }

    /// Copies every parameter segment into its place in the buckets' parameter storages (before
    /// the all-gather that sends them to every replica); from a device, one transfer per bucket.
    pub(crate) fn write_into(&self, buckets: &ParamBuckets) -> Result<()> {
        for (bucket, segment) in buckets.buckets().iter().zip(&self.segments) {
            match &segment.params {
                Some(params) => {
                    let src = params.storage().read()?;
                    let mut dst = bucket.param_storage().write()?;
                    dst.write_at(segment.own.start, &src)?;
                }
                None => {
                    rtx_tensor::download_packed(&self.part_tensors(segment), bucket.param_storage(), segment.own.start)?;
                }
            }
        }
        Ok(())
    }

    /// Bucket `bucket`'s owned parameter values on the host (a staged shard's in one
    /// device → host transfer).
    fn param_values(&self, bucket: usize) -> Result<CpuData> {
        let segment = &self.segments[bucket];
        if let Some(params) = &segment.params {
            return Ok(params.storage().read()?.clone());
        }
        let out = Storage::new(CpuData::zeros(segment.dtype, segment.own.len()));
        rtx_tensor::download_packed(&self.part_tensors(segment), &out, 0)?;
        let values = out.read()?.clone();
        Ok(values)
    }

    /// A staged segment's slices as 1-d shapes, in element order (for `upload_packed`).
    fn part_shapes(&self, segment: &Segment) -> Vec<Vec<usize>> {
        segment.parts.iter().map(|&i| vec![self.slices[i].elements.len()]).collect()
    }

    /// A staged segment's slices and their lengths, in element order (for `download_packed`).
    fn part_tensors(&self, segment: &Segment) -> Vec<(Option<&Tensor>, usize)> {
        segment.parts.iter().map(|&i| (Some(&self.slices[i].tensor), self.slices[i].elements.len())).collect()
    }

    fn check_step(&self, step: u64) -> Result<()> {
        if step != self.next_step {
            return Err(Error::StaleStep { expected: self.next_step, got: step });
        }
        Ok(())
    }

    /// One segment per bucket, each of the owned length and the bucket's dtype.
    fn check_segments(&self, given: &[CpuData]) -> Result<()> {
        if given.len() != self.segments.len() {
            return Err(Error::SegmentCount { expected: self.segments.len(), got: given.len() });
        }
        for (bucket, (segment, data)) in self.segments.iter().zip(given).enumerate() {
            if data.len() != segment.own.len() {
                return Err(Error::SegmentLength { bucket, expected: segment.own.len(), got: data.len() });
            }
            if data.dtype() != segment.dtype {
                return Err(Error::SegmentDType { bucket, expected: segment.dtype, got: data.dtype() });
            }
        }
        Ok(())
    }

    fn run_optimizer(&mut self, step: u64) -> Result<()> {
        debug_assert_eq!(step, self.next_step, "param shard: step checked before running");
        self.optimizer.step()?;
        self.next_step += 1;
        Ok(())
    }
}

impl<O: Optimizer + Send + 'static> Actor for ParamShard<O> {
    type Msg = ParamShardMsg;

    async fn handle(&mut self, msg: ParamShardMsg, _ctx: &mut Context<ParamShardMsg>) -> rtx_actors::Result<()> {
        // Typed errors go back to the caller; the shard keeps serving.
        match msg {
            ParamShardMsg::Apply { step, grads, reply } => reply.send(self.apply(step, grads)),
            ParamShardMsg::Export { reply } => reply.send(self.export()),
            ParamShardMsg::Import { state, reply } => reply.send(self.import(state)),
            ParamShardMsg::SetLr { lr } => self.optimizer.set_lr(lr),
        }
        Ok(())
    }
}

impl<O> std::fmt::Debug for ParamShard<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParamShard")
            .field("rank", &self.rank)
            .field("n_ranks", &self.n_ranks)
            .field("device", &self.device)
            .field("segments", &self.segments.iter().map(|s| s.own.clone()).collect::<Vec<_>>())
            .field("next_step", &self.next_step)
            .finish_non_exhaustive()
    }
}

/// Elements `range` of bucket `bucket`'s flat parameters, on the host.
fn bucket_values(buckets: &ParamBuckets, bucket: usize, range: Range<usize>) -> Result<CpuData> {
    Ok(buckets.buckets()[bucket].params().narrow(0, range.start, range.len())?.to_data()?)
}

/// Fails with `ForeignOptimizerParam` when `optimizer` updates a tensor that is not one of
/// `slices`.
pub(crate) fn check_optimizer_params<O: Optimizer>(optimizer: &O, slices: &[ParamSlice]) -> Result<()> {
    let given: std::collections::BTreeSet<_> = slices.iter().map(|s| s.tensor.id()).collect();
    match optimizer.parameters().into_iter().find(|(_, t)| !given.contains(&t.id())) {
        Some((name, _)) => Err(Error::ForeignOptimizerParam { name }),
        None => Ok(()),
    }
}
