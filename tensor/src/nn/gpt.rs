//! [`Gpt`]: a GPT-2 style decoder-only language model (token and learned position embeddings,
//! pre-norm causal [`TransformerBlock`]s, final LayerNorm, language-model head), with
//! temperature / top-k sampling in [`Gpt::generate`].
//!
//! Parameter names, in visit order: `tok_emb.weight` `[V, C]`, `pos_emb.weight` `[context, C]`,
//! `blocks.{i}.{ln1,attn.qkv,attn.proj,ln2,mlp.fc,mlp.proj}.{weight,bias}`, `ln_f.{weight,bias}`
//! and, only when the head is untied, `lm_head.weight` `[V, C]` (no bias).
//!
//! Tying: with `tie_embeddings` (the default, as GPT-2 and nanoGPT) the head reuses
//! `tok_emb.weight`; there is no `lm_head` parameter and the tensor is stored once in
//! checkpoints. A PyTorch model that ties `lm_head.weight = wte.weight` loads such a checkpoint
//! with `strict=False` (or by copying the one tensor under both names).

use super::{join_name, BlockConfig, Dropout, Embedding, LayerNorm, Linear, Module, TransformerBlock};
use crate::autograd::no_grad;
use crate::error::{Error, Result};
use crate::ops::softmax::CrossEntropyOptions;
use crate::ops::unary::GeluApprox;
use crate::rng::Generator;
use crate::tensor::Tensor;
use rtx_kernels::DType;

/// Sizes and options of a [`Gpt`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GptConfig {
    /// Vocabulary size V: the tokens the model reads and predicts.
    pub vocab_size: usize,
    /// The token table (and tied head) has V rounded up to a multiple of this many rows
    /// ([`GptConfig::padded_vocab`]), as llm.c pads GPT-2's 50,257 tokens to 50,304 so the head's
    /// GEMMs run on tensor-core-friendly shapes. The padding rows are never read by a token,
    /// never predicted (the loss and [`Gpt::forward`] see only the first V logits) and get zero
    /// gradient. 1 (the default) means no padding.
    pub vocab_pad_multiple: usize,
    /// Longest sequence (rows of the position table).
    pub context: usize,
    /// Width C.
    pub d_model: usize,
    /// Number of blocks.
    pub n_layers: usize,
    /// Attention heads per block (divides C).
    pub n_heads: usize,
    /// Dropout after the embeddings and on every residual branch (training mode only).
    pub dropout: f64,
    /// Feed-forward hidden width as a multiple of C.
    pub mlp_ratio: usize,
    /// Biases in Linear and LayerNorm layers.
    pub bias: bool,
    /// Whether the head reuses the token embedding.
    pub tie_embeddings: bool,
    /// LayerNorm epsilon.
    pub layer_norm_eps: f64,
    /// Std of the normal init (residual projections get `init_std / √(2·n_layers)`).
    pub init_std: f64,
    /// Parameter dtype.
    pub dtype: DType,
    /// The feed-forward GELU. GPT-2 (and nanoGPT, llm.c) were trained with the tanh
    /// approximation, so the default is `GeluApprox::Tanh`; `GeluApprox::None` is the exact form
    /// of PyTorch's `nn.GELU()`.
    pub gelu: GeluApprox,
}

impl Default for GptConfig {
    /// GPT-2 small (124M): V 50257, context 1024, C 768, 12 layers, 12 heads, tanh GELU.
    fn default() -> Self {
        GptConfig {
            vocab_size: 50257,
            vocab_pad_multiple: 1,
            context: 1024,
            d_model: 768,
            n_layers: 12,
            n_heads: 12,
            dropout: 0.0,
            mlp_ratio: 4,
            bias: true,
            tie_embeddings: true,
            layer_norm_eps: 1e-5,
            init_std: 0.02,
            dtype: DType::F32,
            gelu: GeluApprox::Tanh,
        }
    }
}

impl GptConfig {
    /// Rows of the token table: V rounded up to a multiple of `vocab_pad_multiple`.
    pub fn padded_vocab(&self) -> usize {
        self.vocab_size.div_ceil(self.vocab_pad_multiple.max(1)) * self.vocab_pad_multiple.max(1)
    }
}

/// Rows of hidden states the fused head + loss takes per chunk: the chunk's logits hold at most
/// 2^28 values (1 GiB in f32, 512 MiB in bf16), and the rows are split evenly over the chunks.
pub fn head_chunk_rows(rows: usize, padded_vocab: usize) -> usize {
    const MAX_CHUNK_LOGITS: usize = 1 << 28;
    let chunks = (rows * padded_vocab).div_ceil(MAX_CHUNK_LOGITS).max(1);
    rows.div_ceil(chunks).max(1)
}

/// A decoder-only transformer language model.
#[derive(Clone, Debug)]
pub struct Gpt {
    /// Token embedding `[V, C]` (also the head when tied).
    pub tok_emb: Embedding,
    /// Position embedding `[context, C]`.
    pub pos_emb: Embedding,
    /// The blocks.
    pub blocks: Vec<TransformerBlock>,
    /// Final norm.
    pub ln_f: LayerNorm,
    /// Untied head `[V, C]`, `None` when tied.
    pub lm_head: Option<Linear>,
    drop: Dropout,
    config: GptConfig,
    training: bool,
}

impl Gpt {
    /// A model with GPT-2 init drawn from `rng` in visit order.
    pub fn new(config: GptConfig, rng: &mut Generator) -> Result<Gpt> {
        let c = config;
        if c.vocab_size == 0 || c.vocab_pad_multiple == 0 || c.context == 0 || c.n_layers == 0 || c.mlp_ratio == 0 {
            return Err(Error::InvalidArgument { op: "Gpt", reason: format!("vocab_size, vocab_pad_multiple, context, n_layers and mlp_ratio must be positive: {c:?}") });
        }
        if u32::try_from(c.padded_vocab()).is_err() || u32::try_from(c.context).is_err() {
            return Err(Error::InvalidArgument { op: "Gpt", reason: "the padded vocabulary and context must fit in u32".into() });
        }
        if !c.tie_embeddings && c.padded_vocab() != c.vocab_size {
            return Err(Error::InvalidArgument { op: "Gpt", reason: "vocabulary padding is for the tied head (an untied head has V rows): set vocab_pad_multiple = 1".into() });
        }
        let tok_emb = Embedding::new(c.padded_vocab(), c.d_model, c.init_std, c.dtype, rng)?;
        let pos_emb = Embedding::new(c.context, c.d_model, c.init_std, c.dtype, rng)?;
        let block = BlockConfig {
            d_model: c.d_model,
            n_heads: c.n_heads,
            mlp_hidden: c.mlp_ratio * c.d_model,
            causal: true,
            bias: c.bias,
            dropout: c.dropout,
            layer_norm_eps: c.layer_norm_eps,
            init_std: c.init_std,
            proj_init_std: c.init_std / (2.0 * c.n_layers as f64).sqrt(),
            dtype: c.dtype,
            gelu: c.gelu,
        };
        let blocks = (0..c.n_layers).map(|_| TransformerBlock::new(&block, rng)).collect::<Result<Vec<_>>>()?;
        let ln_f = LayerNorm::new(c.d_model, c.bias, c.layer_norm_eps, c.dtype)?;
        let lm_head = if c.tie_embeddings { None } else { Some(Linear::normal(c.d_model, c.vocab_size, false, c.init_std, c.dtype, rng)?) };
        Ok(Gpt { tok_emb, pos_emb, blocks, ln_f, lm_head, drop: Dropout::new(c.dropout)?, config, training: true })
    }

    /// A model of `config` holding the given tensors (a PyTorch `state_dict` under this
    /// module's names, in any float dtype): every parameter must be given with its shape and
    /// nothing else may be ([`Module::load_state_dict`] with `strict`, whose error lists every
    /// difference). The tensors are copied in, converted to `config.dtype`.
    pub fn from_state_dict(config: GptConfig, state: &[(String, Tensor)]) -> Result<Gpt> {
        // The init is overwritten, so the generator's seed does not matter.
        let model = Gpt::new(config, &mut Generator::new(0))?;
        model.load_state_dict(state, true)?;
        Ok(model)
    }

    /// The configuration.
    pub fn config(&self) -> &GptConfig {
        &self.config
    }

    /// Whether the model is in training mode.
    pub fn is_training(&self) -> bool {
        self.training
    }

    /// Final hidden states `[B, T, C]` (after `ln_f`) for `ids [B, T]` (u32 or i64, T ≤ context).
    pub fn forward_hidden(&self, ids: &Tensor, rng: &mut Generator) -> Result<Tensor> {
        if !matches!(ids.dtype(), DType::U32 | DType::I64) {
            return Err(Error::DTypeMismatch { op: "Gpt", lhs: ids.dtype(), rhs: DType::U32 });
        }
        if ids.rank() != 2 || ids.shape()[1] == 0 || ids.shape()[1] > self.config.context {
            return Err(Error::BadShape { op: "Gpt", shape: ids.shape().to_vec(), reason: format!("ids must be [B, T] with 1 <= T <= context {}", self.config.context) });
        }
        if self.config.padded_vocab() != self.config.vocab_size && ids.device() == rtx_kernels::Device::Cpu {
            // The embedding checks ids against the padded table; a padding row is not a token.
            let vocab = self.config.vocab_size;
            if let Some(bad) = ids.to_u32_vec()?.into_iter().find(|&id| id as usize >= vocab) {
                return Err(Error::IndexOutOfRange { op: "Gpt", index: bad as usize, size: vocab });
            }
        }
        let t = ids.shape()[1];
        let positions = Tensor::from_vec((0..t as u32).collect::<Vec<u32>>(), &[t])?;
        let x = self.tok_emb.forward(ids)?.add(&self.pos_emb.forward(&positions)?)?;
        let mut x = self.drop.forward(&x, rng)?;
        // Each residual add runs fused with the norm after it (the next block's ln1, or ln_f).
        let Some(first) = self.blocks.first() else { return self.ln_f.forward(&x) };
        let mut h = first.ln1.forward(&x)?;
        for (i, block) in self.blocks.iter().enumerate() {
            let next = self.blocks.get(i + 1).map_or(&self.ln_f, |b| &b.ln1);
            (x, h) = block.forward_norm_fused(&x, &h, next, None, rng)?;
        }
        Ok(h)
    }

    /// The head's weight: `[V, C]` untied, the whole (padded) token table when tied.
    pub fn head_weight(&self) -> &Tensor {
        match &self.lm_head {
            Some(head) => &head.weight,
            None => &self.tok_emb.weight,
        }
    }

    /// Logits `[B, T, V]` for `ids [B, T]` (the padding rows of the table are not logits).
    pub fn forward(&self, ids: &Tensor, rng: &mut Generator) -> Result<Tensor> {
        let h = self.forward_hidden(ids, rng)?;
        match &self.lm_head {
            Some(head) => head.forward(&h),
            None if self.config.padded_vocab() == self.config.vocab_size => h.linear(&self.tok_emb.weight, None),
            // The padded logits are computed (dense operands on every device) and cut off.
            None => h.linear(&self.tok_emb.weight, None)?.narrow(-1, 0, self.config.vocab_size),
        }
    }

    /// Mean next-token cross-entropy of `forward(ids)` against `targets [B, T]` (u32).
    pub fn loss(&self, ids: &Tensor, targets: &Tensor, rng: &mut Generator) -> Result<Tensor> {
        self.loss_with(ids, targets, CrossEntropyOptions::default(), rng)
    }

    /// Next-token cross-entropy (mean or sum, as `options` say) of `ids [B, T]` against
    /// `targets [B, T]`, with the head and the loss fused ([`Tensor::linear_cross_entropy_valid`]):
    /// the `[B·T, V]` logits are made and consumed [`head_chunk_rows`] rows at a time and never
    /// exist whole.
    pub fn loss_with(&self, ids: &Tensor, targets: &Tensor, options: CrossEntropyOptions, rng: &mut Generator) -> Result<Tensor> {
        let h = self.forward_hidden(ids, rng)?;
        let (b, t, c) = (h.shape()[0], h.shape()[1], h.shape()[2]);
        if targets.shape() != [b, t] {
            return Err(Error::ShapeMismatch { op: "Gpt::loss", lhs: ids.shape().to_vec(), rhs: targets.shape().to_vec() });
        }
        let weight = self.head_weight();
        let chunk = head_chunk_rows(b * t, weight.shape()[0]);
        h.reshape(&[b * t, c])?.linear_cross_entropy_valid(weight, &targets.reshape(&[b * t])?, self.config.vocab_size, options, chunk)
    }

    /// Samples `n_new` tokens after `prompt` (one sequence), feeding at most the last `context`
    /// tokens each step. `temperature <= 0` picks the argmax; `top_k` keeps the k most likely
    /// tokens (ties with the k-th kept). Runs in evaluation mode without recording the graph
    /// (the previous mode is restored); draws one uniform from `rng` per sampled token.
    /// Returns only the new tokens.
    pub fn generate(&mut self, prompt: &[u32], n_new: usize, temperature: f64, top_k: Option<usize>, rng: &mut Generator) -> Result<Vec<u32>> {
        if prompt.is_empty() {
            return Err(Error::InvalidArgument { op: "Gpt::generate", reason: "prompt is empty".into() });
        }
        if let Some(&bad) = prompt.iter().find(|&&id| id as usize >= self.config.vocab_size) {
            return Err(Error::IndexOutOfRange { op: "Gpt::generate", index: bad as usize, size: self.config.vocab_size });
        }
        if top_k == Some(0) {
            return Err(Error::InvalidArgument { op: "Gpt::generate", reason: "top_k must be positive".into() });
        }
        let was_training = self.training;
        self.set_training(false);
        let result = no_grad(|| {
            let mut tokens = prompt.to_vec();
            let mut out = Vec::with_capacity(n_new);
            for _ in 0..n_new {
                let start = tokens.len().saturating_sub(self.config.context);
                let window = &tokens[start..];
                let ids = Tensor::from_slice(window, &[1, window.len()])?;
                let logits = self.forward(&ids, rng)?;
                let last = logits.narrow(1, window.len() - 1, 1)?.to_f64_vec()?;
                let next = sample_logits(&last, temperature, top_k, rng);
                tokens.push(next);
                out.push(next);
            }
            Ok(out)
        });
        self.set_training(was_training);
        result
    }
}

impl Module for Gpt {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        self.tok_emb.visit_params(&join_name(prefix, "tok_emb"), f);
        self.pos_emb.visit_params(&join_name(prefix, "pos_emb"), f);
        self.blocks.visit_params(&join_name(prefix, "blocks"), f);
        self.ln_f.visit_params(&join_name(prefix, "ln_f"), f);
        self.lm_head.visit_params(&join_name(prefix, "lm_head"), f);
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        self.tok_emb.visit_params_mut(&join_name(prefix, "tok_emb"), f);
        self.pos_emb.visit_params_mut(&join_name(prefix, "pos_emb"), f);
        self.blocks.visit_params_mut(&join_name(prefix, "blocks"), f);
        self.ln_f.visit_params_mut(&join_name(prefix, "ln_f"), f);
        self.lm_head.visit_params_mut(&join_name(prefix, "lm_head"), f);
    }

    fn set_training(&mut self, training: bool) {
        self.training = training;
        self.drop.set_training(training);
        self.blocks.set_training(training);
    }
}

/// Picks a token from one row of logits (see [`Gpt::generate`]).
fn sample_logits(logits: &[f64], temperature: f64, top_k: Option<usize>, rng: &mut Generator) -> u32 {
    let argmax = || logits.iter().enumerate().fold((0usize, f64::NEG_INFINITY), |(bi, bv), (i, &v)| if v > bv { (i, v) } else { (bi, bv) }).0 as u32;
    if temperature <= 0.0 || !temperature.is_finite() {
        return argmax();
    }
    let mut scaled: Vec<f64> = logits.iter().map(|&v| v / temperature).collect();
    if let Some(k) = top_k {
        if k < scaled.len() {
            let mut sorted = scaled.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            let threshold = sorted[k - 1];
            scaled.iter_mut().for_each(|v| {
                if *v < threshold {
                    *v = f64::NEG_INFINITY;
                }
            });
        }
    }
    let max = scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if !max.is_finite() {
        return argmax();
    }
    let weights: Vec<f64> = scaled.iter().map(|&v| (v - max).exp()).collect();
    let total: f64 = weights.iter().sum();
    let target = rng.uniform() * total;
    let mut acc = 0.0;
    let mut last_positive = 0;
    for (i, &w) in weights.iter().enumerate() {
        if w > 0.0 {
            last_positive = i;
            acc += w;
            if acc > target {
                return i as u32;
            }
        }
    }
    last_positive as u32
}
