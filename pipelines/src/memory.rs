//! Memory per rank of replicated data parallelism and ZeRO-1/2/3: the closed form of the ZeRO
//! paper adapted to f32 ([`closed_form`]), and what this crate's engines actually hold for a given
//! bucket or unit layout ([`engine_estimate`]), which the live engines' own counts
//! ([`crate::DataParallel::memory`], [`crate::FsdpGpt::memory`]) are checked against.
//!
//! The paper counts `2Ψ + 2Ψ + KΨ` bytes for Ψ parameters in mixed precision (fp16 parameters and
//! gradients, K = 12 bytes of fp32 master weights and Adam moments). In f32 with AdamW the master
//! weights are the parameters, so the same 16 bytes split as `4Ψ + 4Ψ + 8Ψ`: replicated holds all
//! three, ZeRO-1 divides the optimizer term by N, ZeRO-2 the gradients too, ZeRO-3 everything.
//! Our engines add what the paper leaves out: ZeRO-1 and ZeRO-2 keep their parameter and gradient
//! segments in storage of their own next to the full buckets (`ParamShard`), and ZeRO-3 gathers
//! whole units (at most two at once) and holds a unit's full gradient while it is reduced.

use std::ops::Range;

/// Which engine, for the estimates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ZeroStage {
    /// Replicated data parallelism (DDP).
    Replicated,
    /// `Sharding::Zero1`.
    Zero1,
    /// `Sharding::Zero2`.
    Zero2,
    /// `FsdpGpt`.
    Zero3,
}

/// Bytes one rank holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryPerRank {
    /// Parameters resident between steps (full buckets and owned segments).
    pub params_bytes: usize,
    /// Gradients resident between steps.
    pub grads_bytes: usize,
    /// Optimizer state.
    pub optimizer_bytes: usize,
    /// Most bytes of gathered (full) parameters alive at once during a step, on top of
    /// `params_bytes` (ZeRO-3 only; the other engines keep full parameters resident).
    pub gathered_peak_bytes: usize,
    /// Most bytes of full gradients alive at once during a step (ZeRO-3: measured; replicated
    /// and ZeRO-1: every bucket; ZeRO-2: bounded by every bucket, see `DataParallel::memory`).
    pub grads_peak_bytes: usize,
}

impl MemoryPerRank {
    /// Parameters, gradients and optimizer state resident between steps.
    pub fn resident_bytes(&self) -> usize {
        self.params_bytes + self.grads_bytes + self.optimizer_bytes
    }
}

impl ZeroStage {
    /// Every stage, in order.
    pub const ALL: [ZeroStage; 4] = [ZeroStage::Replicated, ZeroStage::Zero1, ZeroStage::Zero2, ZeroStage::Zero3];

    /// Short name for tables.
    pub fn name(self) -> &'static str {
        match self {
            ZeroStage::Replicated => "replicated",
            ZeroStage::Zero1 => "zero1",
            ZeroStage::Zero2 => "zero2",
            ZeroStage::Zero3 => "zero3",
        }
    }
}

/// The ZeRO paper's figures for `psi` f32 parameters with AdamW (`4Ψ + 4Ψ + 8Ψ`) at `n_ranks`,
/// divided exactly (no rounding to segments). `gathered_peak_bytes` is 0: the paper's Ψ/N leaves
/// the gathered buffers out.
pub fn closed_form(stage: ZeroStage, psi: usize, n_ranks: usize) -> MemoryPerRank {
    assert!(n_ranks > 0, "memory: at least one rank");
    let (p, g, o) = (4 * psi, 4 * psi, 8 * psi);
    let (params_bytes, grads_bytes, optimizer_bytes) = match stage {
        ZeroStage::Replicated => (p, g, o),
        ZeroStage::Zero1 => (p, g, o / n_ranks),
        ZeroStage::Zero2 => (p, g / n_ranks, o / n_ranks),
        ZeroStage::Zero3 => (p / n_ranks, g / n_ranks, o / n_ranks),
    };
    MemoryPerRank { params_bytes, grads_bytes, optimizer_bytes, gathered_peak_bytes: 0, grads_peak_bytes: 0 }
}

/// What rank `rank` of `n_ranks` holds in this crate's engines, f32 parameters and AdamW, given
/// the element count of each bucket (data parallelism) or unit (ZeRO-3: unit 0 the edge of the
/// model, then one per block in order).
pub fn engine_estimate(stage: ZeroStage, numels: &[usize], n_ranks: usize, rank: usize) -> MemoryPerRank {
    assert!(rank < n_ranks && !numels.is_empty(), "memory: rank inside the group, at least one bucket");
    let psi: usize = numels.iter().sum();
    let own: usize = numels.iter().map(|&n| segment(n, n_ranks, rank).len()).sum();
    let (params, grads, optimizer, gathered_peak, grads_peak) = match stage {
        ZeroStage::Replicated => (psi, psi, 2 * psi, 0, psi),
        ZeroStage::Zero1 => (psi + own, psi + own, 2 * own, 0, psi),
        ZeroStage::Zero2 => (psi + own, own, 2 * own, 0, psi),
        ZeroStage::Zero3 => {
            // Forward and backward gather unit u while u+1 (or u-1) is prefetched, and the last
            // block next to the edge unit (the head).
            let last = numels.len() - 1;
            let pairs = numels.windows(2).map(|w| w[0] + w[1]).chain([numels[0] + numels[last]]);
            // The edge unit's gradient lives through the whole backward; two blocks' full
            // gradients overlap (one computing, the previous one being reduce-scattered).
            let blocks = &numels[1..];
            let block_pair = blocks.windows(2).map(|w| w[0] + w[1]).chain(blocks.iter().copied()).max().unwrap_or(0);
            (own, own, 2 * own, pairs.max().unwrap_or(0), numels[0] + block_pair)
        }
    };
    MemoryPerRank {
        params_bytes: 4 * params,
        grads_bytes: 4 * grads,
        optimizer_bytes: 4 * optimizer,
        gathered_peak_bytes: 4 * gathered_peak,
        grads_peak_bytes: 4 * grads_peak,
    }
}

/// Element counts of the GPT-2 units of a configuration: the edge (embeddings, final norm, untied
/// head) and one per block, as `FsdpGpt` cuts them.
pub fn gpt_unit_numels(config: &rtx_tensor::nn::GptConfig) -> Vec<usize> {
    let (v, t, c, h) = (config.vocab_size, config.context, config.d_model, config.mlp_ratio * config.d_model);
    let bias = usize::from(config.bias);
    let norm = c * (1 + bias);
    let edge = v * c + t * c + norm + if config.tie_embeddings { 0 } else { v * c };
    let block = 2 * norm + (c * 3 * c + 3 * c * bias) + (c * c + c * bias) + (c * h + h * bias) + (h * c + c * bias);
    std::iter::once(edge).chain(std::iter::repeat_n(block, config.n_layers)).collect()
}

/// Element counts of a GPT's parameters in visit order (`Gpt::named_parameters`), from its
/// configuration alone (so a 124M-parameter shape is counted without being built).
pub fn gpt_param_numels(config: &rtx_tensor::nn::GptConfig) -> Vec<usize> {
    let (v, t, c, h) = (config.vocab_size, config.context, config.d_model, config.mlp_ratio * config.d_model);
    let linear = |i: usize, o: usize| if config.bias { vec![o * i, o] } else { vec![o * i] };
    let norm = if config.bias { vec![c, c] } else { vec![c] };
    let mut out = vec![v * c, t * c];
    for _ in 0..config.n_layers {
        out.extend(norm.iter().copied());
        out.extend(linear(c, 3 * c));
        out.extend(linear(c, c));
        out.extend(norm.iter().copied());
        out.extend(linear(c, h));
        out.extend(linear(h, c));
    }
    out.extend(norm);
    if !config.tie_embeddings {
        out.push(v * c);
    }
    out
}

/// Bucket element counts that `ParamBuckets::new` makes for parameters of `param_numels` (in
/// visit order) under `bucket_bytes_max`, f32: packed in reverse order.
pub fn bucket_numels(param_numels: &[usize], bucket_bytes_max: usize) -> Vec<usize> {
    let mut buckets: Vec<usize> = Vec::new();
    for &n in param_numels.iter().rev() {
        match buckets.last_mut() {
            Some(last) if (*last + n) * 4 <= bucket_bytes_max => *last += n,
            _ => buckets.push(n),
        }
    }
    buckets
}

/// Bytes of an optimizer's state tensors, its per-parameter step counters left out (AdamW: the
/// two moments).
pub(crate) fn optimizer_bytes<O: rtx_tensor::Optimizer>(optimizer: &O) -> rtx_tensor::Result<usize> {
    Ok(optimizer.state_tensors()?.iter().filter(|(name, _)| !name.ends_with(".step")).map(|(_, t)| t.numel() * t.dtype().size_in_bytes()).sum())
}

fn segment(numel: usize, n_ranks: usize, rank: usize) -> Range<usize> {
    rtx_collectives::segment_range(numel, n_ranks, rank)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rtx_tensor::nn::{Gpt, GptConfig, Module};

    // Goal: the closed form is the paper's table in f32: 16Ψ replicated, 4Ψ+4Ψ+8Ψ/N, 4Ψ+12Ψ/N,
    // 16Ψ/N. Method: Ψ = 7.5B at N = 64, the paper's example (paper, mixed precision: 120 / 31.4
    // / 16.6 / 1.9 GB; f32 has the same 16 bytes per parameter, but only 8 of them are optimizer
    // state, so ZeRO-1 saves less and ZeRO-2 lands where the paper's ZeRO-1 does).
    #[test]
    fn closed_form_is_the_papers() {
        let psi = 7_500_000_000;
        let gb = |stage| closed_form(stage, psi, 64).resident_bytes() as f64 / 1e9;
        assert_eq!(gb(ZeroStage::Replicated), 120.0);
        assert!((gb(ZeroStage::Zero1) - 60.9375).abs() < 1e-9);
        assert!((gb(ZeroStage::Zero2) - 31.40625).abs() < 1e-9);
        assert!((gb(ZeroStage::Zero3) - 1.875).abs() < 1e-9);
    }

    // Goal: the unit counts match a real model's parameters. Method: GPT-2 124M's shape has
    // 124,439,808 parameters; a small model is built and counted.
    #[test]
    fn gpt_units_count_parameters() {
        assert_eq!(gpt_unit_numels(&GptConfig::default()).iter().sum::<usize>(), 124_439_808);
        let config = GptConfig { vocab_size: 40, context: 8, d_model: 16, n_layers: 3, n_heads: 2, tie_embeddings: false, ..GptConfig::default() };
        let gpt = Gpt::new(config, &mut rtx_tensor::Generator::new(1)).unwrap();
        assert_eq!(gpt_unit_numels(&config).iter().sum::<usize>(), gpt.num_parameters());
        let block: usize = gpt.blocks[0].num_parameters();
        assert_eq!(gpt_unit_numels(&config)[1], block);
        let numels: Vec<usize> = gpt.named_parameters().iter().map(|(_, t)| t.numel()).collect();
        assert_eq!(gpt_param_numels(&config), numels);
        let mut model = gpt.clone();
        let buckets = rtx_tensor::optim::ParamBuckets::new(&mut model, 4 << 10).unwrap();
        assert_eq!(bucket_numels(&numels, 4 << 10), buckets.buckets().iter().map(|b| b.numel()).collect::<Vec<_>>());
    }
}
