//! [`FsdpGpt`]: one rank of ZeRO-3 / FSDP training of a [`Gpt`]: parameters, gradients and
//! optimizer state are all sharded; a unit's full parameters exist only while it computes.
//!
//! # Units and what a rank holds
//!
//! The model is cut into units, one flat bucket each ([`ParamBuckets::grouped`]): unit 0 is the
//! edge of the model (`tok_emb`, `pos_emb`, `ln_f`, and `lm_head` when untied: the tied head
//! reuses `tok_emb`, so embedding and head are one unit), unit `1 + i` is transformer block `i`.
//! Rank `r` owns segment `segment_range(numel_u, n, r)` of every unit `u` in a [`ParamShard`]
//! (the ZeRO-1 role, reused unchanged: parameter and gradient segments and the optimizer over
//! them). Between steps a unit's bucket storages are **empty** (zero elements): the module's
//! parameters are views into them and read nothing until the unit is gathered again, as PyTorch's
//! FSDP resizes a flat parameter's storage to zero.
//!
//! # A step, and why it recomputes
//!
//! Our autograd keeps every tensor a recorded forward used until backward, parameters included,
//! so a graph recorded over a whole step would pin every gathered unit: nothing could be freed.
//! Choice: **recompute per unit**. Forward runs each unit under `no_grad` with its gathered
//! parameters and keeps only the unit's input (`[B, T, C]`, the activation checkpoint), then frees
//! the unit. Backward walks the units in reverse: gather, re-run the unit's forward with grad from
//! its saved input, back-propagate the output gradient through it, reduce-scatter its flat
//! gradient into the owner's segment (averaging over the group) and free both the parameters and
//! the full gradient. Pros: peak parameter memory is two units (the one computing and the one
//! prefetched), activations are one `[B, T, C]` tensor per block, and the bits of each unit's
//! backward are those of a whole-graph backward over the same values. Cons: one extra forward per
//! block (about a third more compute, as activation checkpointing costs), and the edge unit is
//! gathered three times a step (embedding forward, head forward and backward, embedding backward).
//! Dropout masks are replayed: the generator's state before each unit's forward is kept, and the
//! recompute draws from a copy of it.
//!
//! The head (final norm, logits, loss) runs forward and backward at once at the end of the
//! forward pass. Its gradient of the tied `tok_emb.weight` stays in the edge unit's full gradient
//! buffer until the embedding backward adds its part, then the unit is reduce-scattered once, so
//! the edge unit's full gradient lives through the whole backward (reported in [`MemoryPerRank`]).
//!
//! # Clipping
//!
//! With [`FsdpConfig::grad_clip`], once every unit's gradient is reduce-scattered, the averaged
//! gradient is clipped by its norm over the whole model before the optimizer steps: each rank's
//! share of the squared norm (its segments) is gathered in one small collective and every rank
//! scales its segments by the same factor, the replicated engine's ([`crate::clip`]). The tied
//! embedding and head are one parameter in the edge unit, so they count once.
//!
//! # Prefetch and ownership
//!
//! Collectives run on the rank's communication thread ([`crate::reducer`]) one at a time in
//! submission order. Before computing unit `u` the engine submits the all-gather of the unit that
//! comes next (in forward order, then in backward order), so that gather runs while `u` computes;
//! the reduce-scatter of a block runs while the next block's backward computes. The compute thread
//! allocates a unit's full parameter buffer before submitting its gather and touches neither it
//! nor the owner's segment until the gather's report; it frees the buffer after the unit's
//! compute. A reduce-scatter takes the unit's full gradient buffer and drops it when done
//! (`release`). Reports are consumed in submission order; a failed collective fails the step and
//! the engine answers [`Error::Broken`] from then on, as `DataParallel` does.
//!
//! # Determinism
//!
//! Same collectives in the same order on every rank; the averaged gradient segments are the
//! communicator's fixed-order sums; AdamW is elementwise. Every rank computes the same loss on its
//! own rows, and the parameters a rank gathers are bit-identical on every rank.

use std::time::Duration;

use rtx_collectives::Communicator;
use rtx_tensor::nn::{Dropout, Gpt, Module};
use rtx_tensor::optim::ParamBuckets;
use rtx_tensor::{no_grad, CpuData, CrossEntropyOptions, DType, Generator, Optimizer, Tensor};

use crate::data_parallel::run_jobs;
use crate::error::{Error, Result};
use crate::memory::MemoryPerRank;
use crate::param_shard::{ParamShard, ShardState};
use crate::reducer::{block_on, BucketOp, Failure, Job, Reducer, Report};
use crate::shard::ParamSlice;
use crate::{DEFAULT_COLLECTIVE_TIMEOUT, DEFAULT_QUEUE_DEPTH};

/// Configuration of an [`FsdpGpt`] engine; must be the same on every rank.
#[derive(Clone, Debug, PartialEq)]
pub struct FsdpConfig {
    /// Most collectives queued for the communication thread.
    pub queue_depth: usize,
    /// Bound on one unit collective, on top of the communicator's per-frame `op_timeout`.
    pub collective_timeout: Duration,
    /// Gather the next unit while this one computes (off: gather just before use, for measuring).
    pub prefetch: bool,
    /// Clip the averaged gradient to this L2 norm over the whole model before the optimizer
    /// steps (`None`: no clipping); see the module doc.
    pub grad_clip: Option<f64>,
    /// Worker threads of the communication thread's tokio runtime, as
    /// [`DpConfig::comm_threads`](crate::DpConfig::comm_threads) (default 1).
    pub comm_threads: usize,
}

/// What one step did.
#[derive(Clone, Debug, PartialEq)]
pub struct FsdpStats {
    /// The step's index (0 for the first step of this engine).
    pub step: u64,
    /// This rank's loss (mean over its rows).
    pub loss: f64,
    /// All-gathers this step ran (two per block, three of the edge unit).
    pub gathers: usize,
    /// The averaged gradient's norm over the whole model before clipping, when
    /// [`FsdpConfig::grad_clip`] is set (the same on every rank).
    pub grad_norm: Option<f64>,
}

/// One rank of ZeRO-3 / FSDP over a [`Gpt`] (see the module doc).
pub struct FsdpGpt<O> {
    gpt: Gpt,
    drop: Dropout,
    buckets: ParamBuckets,
    shard: ParamShard<O>,
    reducer: Reducer,
    config: FsdpConfig,
    steps: u64,
    failed_step: Option<u64>,
    /// Jobs submitted and reports consumed, over the engine's life.
    submitted: u64,
    reported: u64,
    gathered_bytes: usize,
    gathered_peak_bytes: usize,
    grads_bytes: usize,
    grads_peak_bytes: usize,
    gathers: usize,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        FsdpConfig { queue_depth: DEFAULT_QUEUE_DEPTH, collective_timeout: DEFAULT_COLLECTIVE_TIMEOUT, prefetch: true, grad_clip: None, comm_threads: 1 }
    }
}

impl FsdpConfig {
    /// Checks the values.
    pub fn validate(&self) -> Result<()> {
        if self.queue_depth < 4 {
            return Err(Error::InvalidConfig { reason: "fsdp: queue_depth must be at least 4 (a gather, a prefetch and reduce-scatters in flight)" });
        }
        if self.collective_timeout.is_zero() {
            return Err(Error::InvalidConfig { reason: "collective_timeout must be positive" });
        }
        crate::data_parallel::validate_comm_threads(self.comm_threads)?;
        crate::clip::validate(self.grad_clip)
    }
}

/// The unit of parameter `name`: `1 + i` for `blocks.{i}.…`, 0 for the edge of the model.
pub fn gpt_unit_of(name: &str) -> usize {
    name.strip_prefix("blocks.").and_then(|rest| rest.split('.').next()).and_then(|i| i.parse::<usize>().ok()).map_or(0, |i| i + 1)
}

impl<O: Optimizer> FsdpGpt<O> {
    /// Cuts `gpt` into units, starts the communication thread (forming the communicator with
    /// `connect` there, as [`crate::DataParallel::new`] does), broadcasts group rank 0's
    /// parameters, keeps this rank's segments in a [`ParamShard`] whose optimizer
    /// `make_optimizer` builds over them, and frees every unit. Collective: every rank of the
    /// group constructs its engine.
    pub fn new<C, F>(mut gpt: Gpt, config: FsdpConfig, connect: C, make_optimizer: F) -> Result<Self>
    where
        C: FnOnce() -> rtx_collectives::Result<Communicator> + Send + 'static,
        F: FnOnce(&[ParamSlice]) -> rtx_tensor::Result<O>,
    {
        config.validate()?;
        let n_units = gpt.blocks.len() + 1;
        let buckets = ParamBuckets::grouped(&mut gpt, &gpt_unit_of)?;
        debug_assert_eq!(buckets.buckets().len(), n_units, "fsdp: one bucket per unit");
        if let Some((bucket, b)) = buckets.buckets().iter().enumerate().find(|(_, b)| !b.dtype().is_float()) {
            return Err(Error::UnsupportedDType { bucket, dtype: b.dtype() });
        }
        if let Some(p) = gpt.named_parameters().iter().find(|(_, p)| p.device() != rtx_tensor::Device::Cpu) {
            return Err(Error::ShardedDevice { device: p.1.device() });
        }
        let reducer = Reducer::spawn(connect, config.queue_depth, config.collective_timeout, config.comm_threads)?;
        let broadcasts =
            (0..n_units).map(|bucket| Job { step: 0, bucket, op: BucketOp::Broadcast { params: buckets.buckets()[bucket].param_storage().clone() } });
        block_on(run_jobs(&reducer, 0, broadcasts))?;
        let shard = ParamShard::new(&buckets, reducer.rank(), reducer.size(), make_optimizer)?;
        for bucket in buckets.buckets() {
            *bucket.param_storage().write()? = CpuData::zeros(bucket.dtype(), 0);
            *bucket.grad_storage().write()? = CpuData::zeros(bucket.dtype(), 0);
        }
        let mut drop = Dropout::new(gpt.config().dropout)?;
        drop.set_training(gpt.is_training());
        Ok(FsdpGpt {
            gpt,
            drop,
            buckets,
            shard,
            reducer,
            config,
            steps: 0,
            failed_step: None,
            submitted: 0,
            reported: 0,
            gathered_bytes: 0,
            gathered_peak_bytes: 0,
            grads_bytes: 0,
            grads_peak_bytes: 0,
            gathers: 0,
        })
    }

    /// One training step on this rank's rows: `ids` and `targets` `[B, T]` (u32). Gradients are
    /// averaged over the group, so every rank's rows weigh the same; `rng` feeds dropout.
    pub fn step(&mut self, ids: &Tensor, targets: &Tensor, rng: &mut Generator) -> Result<FsdpStats> {
        if let Some(failed_step) = self.failed_step {
            return Err(Error::Broken { failed_step });
        }
        // Bad input is refused before any collective, so it leaves the engine usable.
        self.check_batch(ids, targets)?;
        let step = self.steps;
        let _span = tracing::debug_span!("fsdp_step", step, rank = self.reducer.rank()).entered();
        self.steps += 1;
        self.failed_step = Some(step);
        self.gathers = 0;
        let result = self.run_step(step, ids, targets, rng);
        match &result {
            Ok(_) => self.failed_step = None,
            Err(error) => tracing::warn!(step, %error, "fsdp step failed"),
        }
        result
    }

    /// Every parameter, gathered whole, in the model's visit order (a copy). Collective: every
    /// rank must call it at the same point.
    pub fn gather_parameters(&mut self) -> Result<Vec<(String, Tensor)>> {
        if let Some(failed_step) = self.failed_step {
            return Err(Error::Broken { failed_step });
        }
        let step = self.steps;
        let mut out: Vec<Option<Tensor>> = vec![None; self.buckets.entries().len()];
        for unit in 0..self.buckets.buckets().len() {
            let ticket = self.gather(step, unit)?;
            self.wait(step, ticket)?;
            let flat = self.buckets.buckets()[unit].params();
            for &idx in self.buckets.buckets()[unit].entries() {
                let e = &self.buckets.entries()[idx];
                let values = flat.narrow(0, e.offset, e.numel)?.to_data()?;
                out[idx] = Some(Tensor::from_data(values, &e.shape)?);
            }
            self.free_params(unit)?;
        }
        self.buckets
            .entries()
            .iter()
            .zip(out)
            .map(|(e, t)| t.map(|t| (e.name.clone(), t)).ok_or(Error::InvalidConfig { reason: "fsdp: a parameter outside every unit" }))
            .collect()
    }

    /// Bytes held now (between steps: the owned segments and the optimizer state), and the peaks
    /// of gathered parameters and full gradients over the engine's steps.
    pub fn memory(&self) -> Result<MemoryPerRank> {
        let elem = |s: &rtx_tensor::Storage, dtype: DType| s.len() * dtype.size_in_bytes();
        let (mut params_bytes, mut grads_bytes) = (0, 0);
        for (unit, b) in self.buckets.buckets().iter().enumerate() {
            params_bytes += elem(b.param_storage(), b.dtype()) + elem(self.shard.param_storage(unit)?, b.dtype());
            grads_bytes += elem(b.grad_storage(), b.dtype()) + elem(self.shard.grad_storage(unit), b.dtype());
        }
        let optimizer_bytes = crate::memory::optimizer_bytes(self.shard.optimizer())?;
        Ok(MemoryPerRank { params_bytes, grads_bytes, optimizer_bytes, gathered_peak_bytes: self.gathered_peak_bytes, grads_peak_bytes: self.grads_peak_bytes })
    }

    /// The element count of each unit (unit 0 the edge, `1 + i` block `i`).
    pub fn unit_numels(&self) -> Vec<usize> {
        self.buckets.buckets().iter().map(|b| b.numel()).collect()
    }

    /// This rank's shard: owned segments, optimizer, next step. [`ParamShard::export`] gives its
    /// [`ShardState`], in the same shape as ZeRO-1's.
    pub fn param_shard(&self) -> &ParamShard<O> {
        &self.shard
    }

    /// Replaces this rank's shard state (checked against its layout first; see
    /// [`ParamShard::import`]), e.g. from a buddy copy or a sharded checkpoint. The engine's step
    /// counter follows the state's step.
    pub fn import_shard(&mut self, state: ShardState) -> Result<()> {
        let step = state.step;
        self.shard.import(state)?;
        self.steps = step;
        Ok(())
    }

    /// The optimizer over this rank's segments.
    pub fn optimizer(&self) -> &O {
        self.shard.optimizer()
    }

    /// The optimizer, mutably (to set the learning rate; the same on every rank).
    pub fn optimizer_mut(&mut self) -> &mut O {
        self.shard.optimizer_mut()
    }

    /// This rank's index in the group, and the group's size.
    pub fn placement(&self) -> (usize, usize) {
        (self.reducer.rank(), self.reducer.size())
    }

    /// Steps started so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Training mode (dropout on) or evaluation mode.
    pub fn set_training(&mut self, training: bool) {
        self.gpt.set_training(training);
        self.drop.set_training(training);
    }

    fn run_step(&mut self, step: u64, ids: &Tensor, targets: &Tensor, rng: &mut Generator) -> Result<FsdpStats> {
        let n_layers = self.gpt.blocks.len();
        assert!(n_layers > 0, "fsdp: Gpt::new refuses zero layers");
        self.buckets.bind_grads()?;
        // Forward, under no_grad, one unit at a time; keeps each block's input.
        let first = self.gather(step, 0)?;
        let mut next = self.prefetch(step, 1)?;
        self.wait(step, first)?;
        let mut replay = Vec::with_capacity(n_layers + 1);
        replay.push(rng.clone());
        let x0 = no_grad(|| self.embed(ids, rng))?;
        self.free_params(0)?;
        let mut inputs = vec![x0];
        for i in 0..n_layers {
            let unit = 1 + i;
            let ticket = self.take_or_gather(step, next.take(), unit)?;
            next = self.prefetch(step, if i + 1 < n_layers { unit + 1 } else { 0 })?;
            self.wait(step, ticket)?;
            replay.push(rng.clone());
            let x = no_grad(|| self.gpt.blocks[i].forward(&inputs[i], None, rng))?;
            inputs.push(x);
            self.free_params(unit)?;
        }
        // The head: forward and backward at once.
        let ticket = self.take_or_gather(step, next.take(), 0)?;
        next = self.prefetch(step, n_layers)?;
        self.wait(step, ticket)?;
        self.alloc_grads(0)?;
        let x_last = inputs[n_layers].detach().requires_grad(true);
        let loss = self.head_loss(&x_last, targets)?;
        if loss.numel() != 1 {
            return Err(Error::NonScalarLoss { shape: loss.shape().to_vec() });
        }
        let loss_value = loss.item()?;
        loss.backward()?;
        drop(loss);
        self.free_params(0)?;
        let mut grad = x_last.grad().ok_or(Error::InvalidConfig { reason: "fsdp: the head's input got no gradient" })?;
        // Backward, block by block in reverse, each recomputed from its saved input.
        for i in (0..n_layers).rev() {
            let unit = 1 + i;
            let ticket = self.take_or_gather(step, next.take(), unit)?;
            next = self.prefetch(step, if i > 0 { unit - 1 } else { 0 })?;
            self.wait(step, ticket)?;
            self.alloc_grads(unit)?;
            let x = inputs[i].detach().requires_grad(true);
            let y = self.gpt.blocks[i].forward(&x, None, &mut replay[unit].clone())?;
            y.backward_from(grad, |_| {})?;
            drop(y);
            grad = x.grad().ok_or(Error::InvalidConfig { reason: "fsdp: a block's input got no gradient" })?;
            self.free_params(unit)?;
            self.reduce_scatter(step, unit)?;
        }
        // The embeddings, recomputed with grad; then the edge unit's gradient is complete.
        let ticket = self.take_or_gather(step, next.take(), 0)?;
        self.wait(step, ticket)?;
        let x0 = self.embed(ids, &mut replay[0].clone())?;
        x0.backward_from(grad, |_| {})?;
        drop(x0);
        self.free_params(0)?;
        let last = self.reduce_scatter(step, 0)?;
        self.wait(step, last)?;
        debug_assert_eq!(self.submitted, self.reported, "fsdp: every collective of the step is done");
        debug_assert_eq!((self.gathered_bytes, self.grads_bytes), (0, 0), "fsdp: nothing full outlives the step");
        // The norm's collective is numbered one past the last unit; it consumes its own report.
        let units = self.buckets.buckets().len();
        let grad_norm = match self.config.grad_clip {
            Some(max) => Some(block_on(crate::clip::clip_segments(&self.reducer, step, units, &mut self.shard, max))?),
            None => None,
        };
        self.shard.apply_reduced(step)?;
        Ok(FsdpStats { step, loss: loss_value, gathers: self.gathers, grad_norm })
    }

    /// `ids` and `targets` are u32 `[B, T]` with `1 <= T <= context`, and every id and target is
    /// inside the vocabulary.
    fn check_batch(&self, ids: &Tensor, targets: &Tensor) -> Result<()> {
        let config = self.gpt.config();
        let bad = |shape: &[usize], reason: String| -> Result<()> {
            Err(Error::Tensor(rtx_tensor::Error::BadShape { op: "FsdpGpt::step", shape: shape.to_vec(), reason }))
        };
        if ids.dtype() != DType::U32 || ids.rank() != 2 || ids.shape()[0] == 0 || ids.shape()[1] == 0 || ids.shape()[1] > config.context {
            return bad(ids.shape(), format!("ids must be u32 [B, T] with B >= 1 and 1 <= T <= context {}, got {}", config.context, ids.dtype()));
        }
        if targets.dtype() != DType::U32 || targets.shape() != ids.shape() {
            return bad(targets.shape(), format!("targets must be u32 of the ids' shape {:?}, got {}", ids.shape(), targets.dtype()));
        }
        for (what, t) in [("id", ids), ("target", targets)] {
            if let Some(&token) = t.to_u32_vec()?.iter().find(|&&v| v as usize >= config.vocab_size) {
                return Err(Error::Tensor(rtx_tensor::Error::IndexOutOfRange {
                    op: if what == "id" { "FsdpGpt::step ids" } else { "FsdpGpt::step targets" },
                    index: token as usize,
                    size: config.vocab_size,
                }));
            }
        }
        Ok(())
    }

    /// Token plus position embeddings and dropout, as `Gpt::forward_hidden` begins.
    fn embed(&self, ids: &Tensor, rng: &mut Generator) -> Result<Tensor> {
        let t = ids.shape()[1];
        let positions = Tensor::from_vec((0..t as u32).collect::<Vec<u32>>(), &[t])?;
        let x = self.gpt.tok_emb.forward(ids)?.add(&self.gpt.pos_emb.forward(&positions)?)?;
        Ok(self.drop.forward(&x, rng)?)
    }

    /// Final norm, logits and mean cross-entropy, as `Gpt::loss` ends.
    fn head_loss(&self, x: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let h = self.gpt.ln_f.forward(x)?;
        let logits = match &self.gpt.lm_head {
            Some(head) => head.forward(&h)?,
            None => h.linear(&self.gpt.tok_emb.weight, None)?,
        };
        let (b, t, v) = (logits.shape()[0], logits.shape()[1], logits.shape()[2]);
        if targets.shape() != [b, t] {
            return Err(Error::Tensor(rtx_tensor::Error::ShapeMismatch { op: "FsdpGpt::loss", lhs: vec![b, t], rhs: targets.shape().to_vec() }));
        }
        Ok(logits.reshape(&[b * t, v])?.cross_entropy(&targets.reshape(&[b * t])?, CrossEntropyOptions::default())?)
    }

    /// Allocates `unit`'s full parameter buffer and submits its all-gather; returns the ticket.
    fn gather(&mut self, step: u64, unit: usize) -> Result<u64> {
        let b = &self.buckets.buckets()[unit];
        {
            let mut data = b.param_storage().write()?;
            debug_assert!(data.is_empty(), "fsdp: a unit is gathered once at a time");
            *data = CpuData::zeros(b.dtype(), b.numel());
        }
        self.gathered_bytes += b.size_bytes();
        self.gathered_peak_bytes = self.gathered_peak_bytes.max(self.gathered_bytes);
        self.gathers += 1;
        let op = BucketOp::Gather { params: b.param_storage().clone(), segment: self.shard.param_storage(unit)?.clone() };
        self.submit(Job { step, bucket: unit, op })
    }

    /// The prefetch of `unit` when prefetching is on.
    fn prefetch(&mut self, step: u64, unit: usize) -> Result<Option<u64>> {
        if self.config.prefetch {
            self.gather(step, unit).map(Some)
        } else {
            Ok(None)
        }
    }

    /// The prefetched gather's ticket, or a gather submitted now.
    fn take_or_gather(&mut self, step: u64, prefetched: Option<u64>, unit: usize) -> Result<u64> {
        match prefetched {
            Some(ticket) => Ok(ticket),
            None => self.gather(step, unit),
        }
    }

    fn free_params(&mut self, unit: usize) -> Result<()> {
        let b = &self.buckets.buckets()[unit];
        *b.param_storage().write()? = CpuData::zeros(b.dtype(), 0);
        self.gathered_bytes -= b.size_bytes();
        Ok(())
    }

    fn alloc_grads(&mut self, unit: usize) -> Result<()> {
        let b = &self.buckets.buckets()[unit];
        *b.grad_storage().write()? = CpuData::zeros(b.dtype(), b.numel());
        self.grads_bytes += b.size_bytes();
        self.grads_peak_bytes = self.grads_peak_bytes.max(self.grads_bytes);
        Ok(())
    }

    /// Submits `unit`'s reduce-scatter into the owned gradient segment; the full buffer is freed
    /// by it.
    fn reduce_scatter(&mut self, step: u64, unit: usize) -> Result<u64> {
        let op =
            BucketOp::ReduceScatter { grads: self.buckets.buckets()[unit].grad_storage().clone(), shard: self.shard.grad_storage(unit).clone(), release: true };
        self.submit(Job { step, bucket: unit, op })
    }

    fn submit(&mut self, job: Job) -> Result<u64> {
        self.reducer.submit(job)?;
        self.submitted += 1;
        Ok(self.submitted - 1)
    }

    /// Consumes reports, in submission order, through job `ticket`.
    fn wait(&mut self, step: u64, ticket: u64) -> Result<()> {
        while self.reported <= ticket {
            let Report { bucket, op, outcome, .. } = block_on(self.reducer.next_report())?;
            self.reported += 1;
            if op == "reduce_scatter" {
                self.grads_bytes -= self.buckets.buckets()[bucket].size_bytes();
            }
            if let Err(failure) = outcome {
                return Err(match failure {
                    Failure::Comm(source) => Error::Collective { step, bucket, op, source },
                    Failure::TimedOut(timeout) => Error::CollectiveTimeout { step, bucket, op, timeout },
                    Failure::Unsupported(dtype) => Error::UnsupportedDType { bucket, dtype },
                    Failure::Skipped => Error::Broken { failed_step: step },
                });
            }
        }
        Ok(())
    }
}

impl<O> std::fmt::Debug for FsdpGpt<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsdpGpt")
            .field("rank", &self.reducer.rank())
            .field("world_size", &self.reducer.size())
            .field("units", &self.buckets.buckets().len())
            .field("config", &self.config)
            .field("steps", &self.steps)
            .field("failed_step", &self.failed_step)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: parameter names map to units as the module doc says.
    #[test]
    fn units_of_gpt_names() {
        assert_eq!(gpt_unit_of("tok_emb.weight"), 0);
        assert_eq!(gpt_unit_of("ln_f.bias"), 0);
        assert_eq!(gpt_unit_of("lm_head.weight"), 0);
        assert_eq!(gpt_unit_of("blocks.0.ln1.weight"), 1);
        assert_eq!(gpt_unit_of("blocks.11.mlp.proj.bias"), 12);
    }
}
