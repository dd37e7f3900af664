//! What a pipeline stage runs: the [`StageModule`] contract, and [`GptStage`], the pipeline form of
//! [`rtx_tensor::nn::Gpt`] built from the same config and the same initial parameters.
//!
//! A rank of a pipeline holds one or more **virtual stages** (model chunks; more than one under
//! interleaved schedules): virtual stage `v = chunk · stages + stage`. The first virtual stage reads
//! the micro-batch (token ids) and embeds it, the last one ends in the loss, the others map an
//! activation to an activation of the same shape. Parameters keep the full model's names
//! (`blocks.5.mlp.fc.weight`), so optimizer state and checkpoints of a stage are slices of the full
//! model's. With tied embeddings and more than one stage, the last stage holds a copy of
//! `tok_emb.weight` for its head; [`StageModule::tied`] names it so the engine sums its gradient with
//! the first stage's each step and both copies stay equal (Megatron's embedding group).

use std::ops::Range;

use rtx_tensor::nn::{Dropout, Embedding, Gpt, LayerNorm, Module, TransformerBlock};
use rtx_tensor::CrossEntropyOptions;
use rtx_tensor::{Generator, Tensor};

/// One rank's part of a pipelined model.
pub trait StageModule: Module + Send {
    /// The input of one micro-batch.
    type MicroBatch: Send + Sync;

    /// Model chunks (virtual stages) this rank holds.
    fn chunks(&self) -> usize;

    /// Shape of the activations passed between virtual stages for `mb`.
    fn activation_shape(&self, mb: &Self::MicroBatch) -> Vec<usize>;

    /// Forward of chunk `chunk`: `input` is `None` on the first virtual stage (which reads `mb`), the
    /// previous virtual stage's activation otherwise. Returns the next activation, or on the last
    /// virtual stage the loss: the mean over `mb`'s rows, a scalar.
    fn forward(&self, chunk: usize, input: Option<&Tensor>, mb: &Self::MicroBatch, rng: &mut Generator) -> rtx_tensor::Result<Tensor>;

    /// Parameters that another stage also holds (a tied embedding), whose gradients are summed
    /// between the first and the last stage.
    fn tied(&self) -> Vec<String> {
        Vec::new()
    }

    /// Whether `name` is the same on every tensor-parallel rank (counted once in the gradient norm).
    fn tp_replicated(&self, name: &str) -> bool {
        let _ = name;
        true
    }

    /// Where the activations and gradients between stages live: the device and dtype of the
    /// part's parameters (the first one's; host f32 for a part without any).
    fn placement(&self) -> crate::Placement {
        let mut first = None;
        self.visit_params("", &mut |_, t| {
            if first.is_none() {
                first = Some(crate::Placement::of(t));
            }
        });
        first.unwrap_or(crate::Placement::HOST_F32)
    }
}

/// Token ids and next-token targets of one micro-batch, `[rows, T]` u32 each.
#[derive(Clone, Debug)]
pub struct TokenBatch {
    /// Input ids.
    pub ids: Tensor,
    /// Targets.
    pub targets: Tensor,
}

impl TokenBatch {
    /// Rows in the batch.
    pub fn rows(&self) -> usize {
        self.ids.shape().first().copied().unwrap_or(0)
    }

    /// Cuts the batch into `parts` equal micro-batches along the rows.
    pub fn split(&self, parts: usize) -> rtx_tensor::Result<Vec<TokenBatch>> {
        let rows = self.rows();
        if parts == 0 || !rows.is_multiple_of(parts) {
            return Err(rtx_tensor::Error::InvalidArgument { op: "TokenBatch::split", reason: format!("{rows} rows do not split into {parts} equal micro-batches") });
        }
        let each = rows / parts;
        (0..parts).map(|i| Ok(TokenBatch { ids: self.ids.narrow(0, i * each, each)?.contiguous()?, targets: self.targets.narrow(0, i * each, each)?.contiguous()? })).collect()
    }
}

/// The layers of a [`Gpt`] that one pipeline rank holds (no tensor parallelism).
pub struct GptStage {
    embed: Option<(Embedding, Embedding, Dropout)>,
    /// Per chunk: the global index of its first block, and its blocks.
    chunks: Vec<(usize, Vec<TransformerBlock>)>,
    /// The final norm and the head weight `[V, C]` (the token embedding when tied).
    head: Option<(LayerNorm, Tensor, bool)>,
    width: usize,
    context: usize,
    tie: bool,
}

impl GptStage {
    /// The part of `gpt` that pipeline rank `stage` of `stages` holds, when virtual stage `v` owns
    /// blocks `layers[v]` (`layers.len()` = stages · chunks, contiguous, covering every block).
    /// Takes the tensors of `gpt` itself (no copy): build a `Gpt` per rank.
    pub fn from_full(gpt: Gpt, layers: &[Range<usize>], stage: usize, stages: usize) -> rtx_tensor::Result<GptStage> {
        let config = *gpt.config();
        let bad = |reason: String| rtx_tensor::Error::InvalidArgument { op: "GptStage", reason };
        if stages == 0 || stage >= stages || layers.is_empty() || !layers.len().is_multiple_of(stages) {
            return Err(bad(format!("stage {stage} of {stages} with {} virtual stages", layers.len())));
        }
        let mut next = 0;
        for (v, r) in layers.iter().enumerate() {
            if r.start != next || r.end <= r.start {
                return Err(bad(format!("virtual stage {v} holds blocks {r:?}; stages must hold contiguous non-empty ranges from 0")));
            }
            next = r.end;
        }
        if next != config.n_layers {
            return Err(bad(format!("the stages hold {next} blocks, the model has {}", config.n_layers)));
        }
        let n_chunks = layers.len() / stages;
        let last_virtual = layers.len() - 1;
        let holds_first = stage == 0;
        let holds_last = (n_chunks - 1) * stages + stage == last_virtual;
        let Gpt { tok_emb, pos_emb, blocks, ln_f, lm_head, .. } = gpt;
        let mut blocks: Vec<Option<TransformerBlock>> = blocks.into_iter().map(Some).collect();
        let chunks = (0..n_chunks)
            .map(|c| {
                let r = &layers[c * stages + stage];
                (r.start, r.clone().filter_map(|i| blocks.get_mut(i).and_then(Option::take)).collect::<Vec<_>>())
            })
            .collect();
        let head = holds_last.then(|| match &lm_head {
            Some(head) => (ln_f.clone(), head.weight.clone(), false),
            None => (ln_f.clone(), tok_emb.weight.clone(), true),
        });
        let embed = holds_first.then(|| Ok::<_, rtx_tensor::Error>((tok_emb, pos_emb, Dropout::new(config.dropout)?))).transpose()?;
        Ok(GptStage { embed, chunks, head, width: config.d_model, context: config.context, tie: config.tie_embeddings })
    }

    fn embed(&self, mb: &TokenBatch, rng: &mut Generator) -> rtx_tensor::Result<Tensor> {
        let Some((tok, pos, drop)) = &self.embed else {
            return Err(rtx_tensor::Error::InvalidArgument { op: "GptStage", reason: "the first virtual stage is not on this rank".into() });
        };
        let t = mb.ids.shape().get(1).copied().unwrap_or(0);
        if t == 0 || t > self.context {
            return Err(rtx_tensor::Error::BadShape { op: "GptStage", shape: mb.ids.shape().to_vec(), reason: format!("ids must be [B, T] with 1 <= T <= context {}", self.context) });
        }
        let positions = Tensor::from_vec((0..t as u32).collect::<Vec<u32>>(), &[t])?;
        drop.forward(&tok.forward(&mb.ids)?.add(&pos.forward(&positions)?)?, rng)
    }
}

impl Module for GptStage {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        let name = |n: &str| rtx_tensor::nn::join_name(prefix, n);
        if let Some((tok, pos, _)) = &self.embed {
            tok.visit_params(&name("tok_emb"), f);
            pos.visit_params(&name("pos_emb"), f);
        }
        for (first, blocks) in &self.chunks {
            for (i, block) in blocks.iter().enumerate() {
                block.visit_params(&name(&format!("blocks.{}", first + i)), f);
            }
        }
        if let Some((ln_f, head, tied)) = &self.head {
            ln_f.visit_params(&name("ln_f"), f);
            f(&name(if *tied { "tok_emb.weight" } else { "lm_head.weight" }), head);
        }
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        let name = |n: &str| rtx_tensor::nn::join_name(prefix, n);
        if let Some((tok, pos, _)) = &mut self.embed {
            tok.visit_params_mut(&name("tok_emb"), f);
            pos.visit_params_mut(&name("pos_emb"), f);
        }
        for (first, blocks) in &mut self.chunks {
            for (i, block) in blocks.iter_mut().enumerate() {
                block.visit_params_mut(&name(&format!("blocks.{}", *first + i)), f);
            }
        }
        if let Some((ln_f, head, tied)) = &mut self.head {
            ln_f.visit_params_mut(&name("ln_f"), f);
            f(&name(if *tied { "tok_emb.weight" } else { "lm_head.weight" }), head);
        }
    }

    fn set_training(&mut self, training: bool) {
        if let Some((_, _, drop)) = &mut self.embed {
            drop.set_training(training);
        }
        for (_, blocks) in &mut self.chunks {
            for block in blocks {
                block.set_training(training);
            }
        }
    }
}

impl StageModule for GptStage {
    type MicroBatch = TokenBatch;

    fn chunks(&self) -> usize {
        self.chunks.len()
    }

    fn activation_shape(&self, mb: &TokenBatch) -> Vec<usize> {
        let s = mb.ids.shape();
        vec![s.first().copied().unwrap_or(0), s.get(1).copied().unwrap_or(0), self.width]
    }

    fn forward(&self, chunk: usize, input: Option<&Tensor>, mb: &TokenBatch, rng: &mut Generator) -> rtx_tensor::Result<Tensor> {
        let (_, blocks) = self.chunks.get(chunk).ok_or_else(|| rtx_tensor::Error::InvalidArgument { op: "GptStage", reason: format!("chunk {chunk} of {}", self.chunks.len()) })?;
        let mut x = match input {
            Some(x) => x.clone(),
            None => self.embed(mb, rng)?,
        };
        for block in blocks {
            x = block.forward(&x, None, rng)?;
        }
        let last_chunk = chunk + 1 == self.chunks.len();
        match (&self.head, last_chunk) {
            (Some((ln_f, head, _)), true) => {
                let logits = ln_f.forward(&x)?.linear(head, None)?;
                let (b, t, v) = (logits.shape()[0], logits.shape()[1], logits.shape()[2]);
                logits.reshape(&[b * t, v])?.cross_entropy(&mb.targets.reshape(&[b * t])?, CrossEntropyOptions::default())
            }
            _ => Ok(x),
        }
    }

    fn tied(&self) -> Vec<String> {
        // Only when the embedding and the head live on different ranks is the weight held twice.
        if self.tie && self.embed.is_some() != self.head.is_some() {
            vec!["tok_emb.weight".to_string()]
        } else {
            Vec::new()
        }
    }
}

/// The layers of a tensor-parallel GPT that one pipeline rank holds: one [`crate::tp::TpGpt`] part per model
/// chunk, sharing the rank's tensor-parallel group. With `tp = 1` it trains exactly like
/// [`GptStage`].
pub struct TpGptStage {
    chunks: Vec<crate::tp::TpGpt>,
    width: usize,
    sequence_parallel_tp: Option<usize>,
}

impl TpGptStage {
    /// The part of `full` that pipeline rank `stage` of `stages` holds at tensor rank `group.rank()`,
    /// when virtual stage `v` owns blocks `layers[v]` (see [`GptStage::from_full`]).
    pub fn from_full(full: &Gpt, group: crate::tp::TpHandle, options: crate::tp::TpOptions, layers: &[Range<usize>], stage: usize, stages: usize) -> crate::Result<TpGptStage> {
        if stages == 0 || stage >= stages || layers.is_empty() || !layers.len().is_multiple_of(stages) {
            return Err(crate::Error::Pipeline { reason: format!("stage {stage} of {stages} with {} virtual stages", layers.len()) });
        }
        let virtual_stages = layers.len();
        let chunks = (0..virtual_stages / stages)
            .map(|c| {
                let v = c * stages + stage;
                let part = crate::tp::StagePart { layers: layers[v].clone(), embedding: v == 0, head: v + 1 == virtual_stages };
                crate::tp::TpGpt::from_full_part(full, group.clone(), options, part)
            })
            .collect::<crate::Result<Vec<_>>>()?;
        let tp = group.size();
        Ok(TpGptStage { chunks, width: full.config().d_model, sequence_parallel_tp: options.sequence_parallel.then_some(tp) })
    }
}

impl Module for TpGptStage {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        for chunk in &self.chunks {
            chunk.visit_params(prefix, f);
        }
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        for chunk in &mut self.chunks {
            chunk.visit_params_mut(prefix, f);
        }
    }

    fn set_training(&mut self, training: bool) {
        for chunk in &mut self.chunks {
            chunk.set_training(training);
        }
    }
}

impl StageModule for TpGptStage {
    type MicroBatch = TokenBatch;

    fn chunks(&self) -> usize {
        self.chunks.len()
    }

    fn activation_shape(&self, mb: &TokenBatch) -> Vec<usize> {
        let s = mb.ids.shape();
        let t = s.get(1).copied().unwrap_or(0);
        vec![s.first().copied().unwrap_or(0), self.sequence_parallel_tp.map_or(t, |tp| t / tp.max(1)), self.width]
    }

    fn forward(&self, chunk: usize, input: Option<&Tensor>, mb: &TokenBatch, rng: &mut Generator) -> rtx_tensor::Result<Tensor> {
        let part = self.chunks.get(chunk).ok_or_else(|| rtx_tensor::Error::InvalidArgument { op: "TpGptStage", reason: format!("chunk {chunk} of {}", self.chunks.len()) })?;
        let mut run = || -> crate::Result<Tensor> {
            let x = match input {
                Some(x) => x.clone(),
                None => part.embed(&mb.ids, rng)?,
            };
            let x = part.forward_blocks(&x, rng)?;
            if part.part().head {
                part.head_loss(&x, &mb.targets)
            } else {
                Ok(x)
            }
        };
        run().map_err(crate::tp::to_tensor_error)
    }

    fn tied(&self) -> Vec<String> {
        if self.chunks.iter().any(crate::tp::TpGpt::needs_embedding_sync) {
            vec![crate::tp::TIED_EMBEDDING_PARAM.to_string()]
        } else {
            Vec::new()
        }
    }

    fn tp_replicated(&self, name: &str) -> bool {
        self.chunks.first().is_none_or(|c| c.shard_spec(name).is_none())
    }
}

/// A stage chosen at run time (the worker runtime builds whatever the job hands it; `Module` comes
/// from `rtx_tensor`'s impl for boxes).
impl<B: Send + Sync> StageModule for Box<dyn StageModule<MicroBatch = B>> {
    type MicroBatch = B;

    fn chunks(&self) -> usize {
        (**self).chunks()
    }

    fn activation_shape(&self, mb: &B) -> Vec<usize> {
        (**self).activation_shape(mb)
    }

    fn forward(&self, chunk: usize, input: Option<&Tensor>, mb: &B, rng: &mut Generator) -> rtx_tensor::Result<Tensor> {
        (**self).forward(chunk, input, mb, rng)
    }

    fn tied(&self) -> Vec<String> {
        (**self).tied()
    }

    fn tp_replicated(&self, name: &str) -> bool {
        (**self).tp_replicated(name)
    }

    fn placement(&self) -> crate::Placement {
        (**self).placement()
    }
}

/// An optimizer chosen at run time.
pub struct DynOptimizer(pub Box<dyn rtx_tensor::Optimizer + Send>);

impl rtx_tensor::Optimizer for DynOptimizer {
    fn step(&mut self) -> rtx_tensor::Result<()> {
        self.0.step()
    }

    fn zero_grad(&self) -> rtx_tensor::Result<()> {
        self.0.zero_grad()
    }

    fn lr(&self) -> f64 {
        self.0.lr()
    }

    fn set_lr(&mut self, lr: f64) {
        self.0.set_lr(lr);
    }

    fn kind(&self) -> &'static str {
        self.0.kind()
    }

    fn parameters(&self) -> Vec<(String, Tensor)> {
        self.0.parameters()
    }

    fn state_tensors(&self) -> rtx_tensor::Result<Vec<(String, Tensor)>> {
        self.0.state_tensors()
    }

    fn load_state(&mut self, state: &[(String, Tensor)]) -> rtx_tensor::Result<()> {
        self.0.load_state(state)
    }
}
