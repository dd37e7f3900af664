//! The model of a run: an [`Mlp`] on flattened images, a [`Gpt`] on bytes or GPT-2 tokens, an
//! I-JEPA ViT, or a ViT classifier trained supervised (the I-JEPA encoder's twin), behind one enum
//! so the loop does not care which.
//!
//! A GPT's loss is [`Gpt::loss_with`] on every device: the head and the cross-entropy fused, so
//! the `[B·T, V]` logits of a 50k-token vocabulary never exist whole (mean for training, sum for
//! evaluation).

use rtx_tensor::nn::{self, Mlp, Module};
use rtx_tensor::{CrossEntropyOptions, DType, Generator, Reduction, Tensor};

use crate::config::{Activation, ModelConfig, TrainConfig};

use super::jepa::JepaSetup;
use super::task::{Batch, TaskData};
use super::Result;

/// The trained model.
pub enum Model {
    /// Image classifier.
    Mlp(Mlp),
    /// Language model (bytes or GPT-2 tokens).
    Gpt(Box<nn::Gpt>),
    /// I-JEPA encoder, predictor and EMA target encoder, with its masks and image shape.
    IJepa(Box<nn::IJepa>, Box<JepaSetup>),
    /// ViT classifier (mean pooling, linear head) on images of `[height, width]`.
    Vit(Box<nn::Vit>, [usize; 2]),
}

/// The loss of one batch, and the count of correct predictions when classifying.
pub(crate) struct BatchLoss {
    pub(crate) loss: Tensor,
    pub(crate) correct: Option<usize>,
    /// The I-JEPA collapse monitor of the batch.
    pub(crate) feature_std: Option<f64>,
}

impl Model {
    /// Builds the model of `config`, drawing its initial parameters from `rng`. `in_features`
    /// and `n_classes` come from the dataset (a GPT's vocabulary: the tokenizer's), and a GPT's
    /// token table is padded to a multiple of `vocab_pad_multiple` rows.
    pub(crate) fn build(config: &ModelConfig, in_features: Option<usize>, n_classes: usize, vocab_pad_multiple: usize, rng: &mut Generator) -> Result<Model> {
        match config {
            ModelConfig::Mlp { hidden, activation } => {
                let input = in_features.ok_or_else(|| super::TrainError::Internal("an MLP needs image data".into()))?;
                let sizes: Vec<usize> = std::iter::once(input).chain(hidden.iter().copied()).chain(std::iter::once(n_classes)).collect();
                Ok(Model::Mlp(Mlp::new(&sizes, nn_activation(*activation), DType::F32, rng)?))
            }
            ModelConfig::Gpt { n_layers, d_model, n_heads, context, dropout, gelu } => {
                let gelu = match gelu {
                    crate::config::Gelu::None => rtx_tensor::GeluApprox::None,
                    crate::config::Gelu::Tanh => rtx_tensor::GeluApprox::Tanh,
                };
                let cfg = nn::GptConfig { vocab_size: n_classes, vocab_pad_multiple, context: *context, n_layers: *n_layers, d_model: *d_model, n_heads: *n_heads, dropout: *dropout, dtype: DType::F32, gelu, ..nn::GptConfig::default() };
                Ok(Model::Gpt(Box::new(nn::Gpt::new(cfg, rng)?)))
            }
            ModelConfig::IJepa { .. } | ModelConfig::Vit { .. } => Err(super::TrainError::Internal("a ViT model is built by Model::for_config".into())),
        }
    }

    /// Builds the model of `config` for `data`, drawing its initial parameters from `rng`.
    pub(crate) fn for_config(config: &TrainConfig, data: &TaskData, rng: &mut Generator) -> Result<Model> {
        match &config.model {
            ModelConfig::IJepa { .. } => {
                let image = data.image_size().ok_or_else(|| super::TrainError::Internal("I-JEPA needs image data".into()))?;
                let (model, setup) = super::jepa::build(config, image, rng)?;
                Ok(Model::IJepa(Box::new(model), Box::new(setup)))
            }
            ModelConfig::Vit { patch_size, d_model, n_layers, n_heads } => {
                let image = data.image_size().ok_or_else(|| super::TrainError::Internal("a ViT classifier needs image data".into()))?;
                let cfg = nn::VitConfig { n_classes: Some(data.n_classes()), ..super::jepa::encoder_config(image, *patch_size, *d_model, *n_layers, *n_heads) };
                let vit = nn::Vit::new(cfg, rng)?;
                // Positions start at 2-D sin-cos, as the I-JEPA encoder's.
                let grid = [image[0] / patch_size, image[1] / patch_size];
                vit.pos_embed.copy_from_(&Tensor::from_vec(nn::sincos_2d(grid, *d_model)?, vit.pos_embed.shape())?)?;
                Ok(Model::Vit(Box::new(vit), image))
            }
            other => Model::build(other, data.input_features(), data.n_classes(), data.vocab_pad_multiple(), rng),
        }
    }

    /// After the optimizer step `step` (0-based): the EMA update of an I-JEPA target encoder
    /// (nothing for other models).
    pub(crate) fn after_step(&self, step: u64) -> Result<()> {
        if let Model::IJepa(m, setup) = self {
            m.ema_update(m.momentum(step + 1, setup.total_steps))?;
        }
        Ok(())
    }

    /// The model as a [`Module`] (parameters, training mode).
    pub fn module(&self) -> &dyn Module {
        match self {
            Model::Mlp(m) => m,
            Model::Gpt(m) => m.as_ref(),
            Model::IJepa(m, _) => m.as_ref(),
            Model::Vit(m, _) => m.as_ref(),
        }
    }

    /// Mutable [`Module`] access.
    pub fn module_mut(&mut self) -> &mut dyn Module {
        match self {
            Model::Mlp(m) => m,
            Model::Gpt(m) => m.as_mut(),
            Model::IJepa(m, _) => m.as_mut(),
            Model::Vit(m, _) => m.as_mut(),
        }
    }

    /// Forward pass and mean cross-entropy of `batch` (`reduction` Sum for evaluation sums).
    pub(crate) fn loss(&self, batch: &Batch, rng: &mut Generator, reduction: Reduction, count_correct: bool) -> Result<BatchLoss> {
        let options = CrossEntropyOptions { reduction, ..CrossEntropyOptions::default() };
        match self {
            Model::Mlp(m) => classify(m.forward(&batch.inputs)?, batch, options, count_correct),
            Model::Vit(m, [h, w]) => {
                let images = batch.inputs.reshape(&[batch.rows, 1, *h, *w])?;
                classify(m.forward(&images, rng)?, batch, options, count_correct)
            }
            Model::Gpt(m) => {
                let loss = m.loss_with(&batch.inputs, &batch.targets, options, rng)?;
                Ok(BatchLoss { loss, correct: None, feature_std: None })
            }
            Model::IJepa(m, setup) => {
                let masks = batch.masks.as_ref().ok_or_else(|| super::TrainError::Internal("an I-JEPA batch without masks".into()))?;
                let out = m.loss(&setup.images(&batch.inputs)?, masks, rng)?;
                // Sums for evaluation: the mean loss weighted by the batch's images.
                let loss = if reduction == Reduction::Sum { out.loss.mul_scalar(batch.rows as f64)? } else { out.loss };
                Ok(BatchLoss { loss, correct: None, feature_std: Some(out.feature_std) })
            }
        }
    }
}

impl Module for Model {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        self.module().visit_params(prefix, f)
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        self.module_mut().visit_params_mut(prefix, f)
    }

    fn visit_buffers(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        self.module().visit_buffers(prefix, f)
    }

    fn visit_buffers_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor)) {
        self.module_mut().visit_buffers_mut(prefix, f)
    }

    fn set_training(&mut self, training: bool) {
        self.module_mut().set_training(training)
    }
}

/// The cross-entropy of `logits` against the batch's labels, and the count of correct argmax
/// predictions when asked.
fn classify(logits: Tensor, batch: &Batch, options: CrossEntropyOptions, count_correct: bool) -> Result<BatchLoss> {
    let loss = logits.cross_entropy(&batch.targets, options)?;
    let correct = if count_correct {
        let pred = logits.argmax(-1, false)?.to_u32_vec()?;
        let labels = batch.targets.to_u32_vec()?;
        Some(pred.iter().zip(&labels).filter(|(p, l)| p == l).count())
    } else {
        None
    };
    Ok(BatchLoss { loss, correct, feature_std: None })
}

fn nn_activation(a: Activation) -> nn::Activation {
    match a {
        Activation::Relu => nn::Activation::Relu,
        Activation::Gelu => nn::Activation::Gelu,
        Activation::Tanh => nn::Activation::Tanh,
    }
}
