//! The TOML training config read by `rtx train` and [`crate::train::Trainer`].
//!
//! A config has the sections `[model]`, `[data]`, `[optim]`, `[schedule]` (optional), `[train]`,
//! `[output]` (optional) and `[sample]` (optional, GPT only). Every section rejects unknown keys,
//! and [`TrainConfig::from_toml_str`] checks ranges and combinations after parsing, so a bad
//! config fails before any data is read, with a message naming the key and what it allows.
//!
//! Parsing is two-step on purpose: serde reads flat sections (`RawModel`, `RawOptim`) that keep
//! the TOML line/column in its errors, then validation turns them into the typed
//! [`ModelConfig`] / [`OptimConfig`] enums and reports keys that do not belong to the chosen kind.
//!
//! # GELU form (`[model] gelu`, GPT only)
//! `gelu = "none"` (the default, as PyTorch's `nn.GELU()`) is the exact erf form; `gelu = "tanh"`
//! is the approximation GPT-2, nanoGPT and llm.c were trained with. Every GPT config in
//! `configs/` names `"tanh"`, so runs started before the default changed keep their numbers.
//!
//! # Tokenizer (`[data] tokenizer`, text only)
//! `tokenizer = "bytes"` (the default) trains a byte-level GPT: every byte is a token, vocabulary
//! 256. `tokenizer = "gpt2"` reads GPT-2's 50,257 BPE tokens (the model's token table padded to
//! 50,304 rows); the loss is then in nats per token, not per byte. Any other name, or a tokenizer
//! on an image dataset, is refused here; so are pipeline and tensor parallelism with `"gpt2"`
//! (their stages do not pad the vocabulary yet).
//!
//! # Device and precision (`[train] device`, `[train] precision`)
//! `device = "cpu"` (the default) trains on host tensors in f32. `device = "cuda"` puts each
//! worker's replica on one GPU: under `rtx launch` worker `i` takes `cuda:(i mod visible
//! devices)`, so several workers may share a GPU; gradients are averaged through host buffers
//! by the same communicator as on the CPU. On the GPU, `precision = "bf16"` (the default there)
//! keeps parameters, activations and gradients in bf16 with f32 master weights and moments in the
//! optimizer; `"f32"` keeps everything in f32. The GPU path supports what its kernels cover: a GPT
//! without dropout, and I-JEPA / V-JEPA (`model.kind = "ijepa"` / `"vjepa"`), trained with AdamW,
//! with attention heads of 64 or 128 channels (the encoder's `d_model / n_heads`, the predictor's
//! `predictor_width / predictor_heads`); an MLP trains on the CPU. Whether a GPU is really there is checked when a job starts
//! ([`crate::train::resolve_device`]), not here: a config is valid on any machine.
//!
//! # Parallelism (`[parallel]`)
//! `dp`, `pp`, `tp`, `zero`, `microbatches`, `schedule`, `virtual_stages` and `stage_layers`
//! ([`ParallelConfig`], all optional: one rank of plain data parallelism by default). Parsing
//! checks what does not depend on the world: `tp` divides the heads, the vocabulary and the MLP
//! width, `pp` divides the layers (unless `stage_layers` cuts them), `microbatches` divides
//! `data.batch_size`, and `pp`/`tp` above 1 need a GPT. The world is checked by
//! [`TrainConfig::mesh`] when it is known (`rtx launch --nproc N`, `rtx plan --world N`), before
//! any worker starts.

use std::path::{Path, PathBuf};

use rtx_pipelines::{Mesh, MeshError};
use rtx_supervisor::plan::{ModelLayout, ParallelConfig, PlanError};
use serde::{Deserialize, Serialize};

/// Errors of reading or validating a config.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("cannot read config {path}", path = .path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The TOML did not parse, or a key is unknown, missing or of the wrong type.
    #[error("invalid config{origin}: {message}")]
    Parse {
        /// ` path` of the file, or empty for a string.
        origin: String,
        /// The parser's message, with line and column.
        message: String,
    },
    /// A key has a value outside what it allows.
    #[error("invalid config{origin}: `{key}` = {value}: {allowed}")]
    Invalid {
        /// ` path` of the file, or empty for a string.
        origin: String,
        /// The dotted key, e.g. `optim.lr`.
        key: String,
        /// The offending value as written.
        value: String,
        /// What the key allows.
        allowed: String,
    },
}

/// A whole training config.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TrainConfig {
    /// The model to train.
    pub model: ModelConfig,
    /// Dataset and batching.
    pub data: DataConfig,
    /// Optimizer.
    pub optim: OptimConfig,
    /// Learning-rate schedule.
    pub schedule: ScheduleConfig,
    /// Loop lengths and intervals.
    pub train: LoopConfig,
    /// Where outputs go; `None` means `runs/<config file stem>`.
    pub output_dir: Option<PathBuf>,
    /// Text sampling at the end of a GPT run.
    pub sample: SampleConfig,
    /// `[parallel]`: the mesh and the pipeline schedule (see the module doc).
    pub parallel: ParallelConfig,
    /// The `[elastic]` table for `rtx launch` (checked by `rtx_supervisor::ElasticConfig::apply_toml`).
    #[serde(skip)]
    pub elastic: Option<toml::Table>,
    /// `[jepa]`: masks, EMA, weight-decay schedule and probes of an I-JEPA run (present exactly
    /// when `model.kind = "ijepa"`, filled with defaults when the section is absent).
    pub jepa: Option<JepaConfig>,
}

/// `[jepa]`: the self-supervised side of `model.kind = "ijepa"` (see `train::jepa`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JepaConfig {
    /// Predictor width.
    #[serde(default = "default_predictor_width")]
    pub predictor_width: usize,
    /// Predictor blocks.
    #[serde(default = "default_predictor_depth")]
    pub predictor_depth: usize,
    /// Predictor heads (divides the width).
    #[serde(default = "default_predictor_heads")]
    pub predictor_heads: usize,
    /// `"l2"` or `"smooth-l1"`.
    #[serde(default)]
    pub loss: JepaLossKind,
    /// Target blocks per image.
    #[serde(default = "default_n_targets")]
    pub n_targets: usize,
    /// Target block area as a fraction of the grid.
    #[serde(default = "default_target_scale")]
    pub target_scale: (f64, f64),
    /// Target block aspect ratio range (height / width).
    #[serde(default = "default_target_aspect")]
    pub target_aspect: (f64, f64),
    /// Context block area as a fraction of the grid.
    #[serde(default = "default_context_scale")]
    pub context_scale: (f64, f64),
    /// Fewest context tokens per image.
    #[serde(default = "default_min_keep")]
    pub min_keep: usize,
    /// EMA momentum of the target encoder at the first and the last step (linear between).
    #[serde(default = "default_ema_momentum")]
    pub ema_momentum: (f64, f64),
    /// Weight decay at the last step: cosine from `optim.weight_decay` to this (I-JEPA: 0.04 -> 0.4).
    #[serde(default)]
    pub final_weight_decay: Option<f64>,
    /// Run the linear probe and k-NN every this many steps (0: only at the end).
    #[serde(default)]
    pub probe_every: u64,
    /// Training images the periodic probes use (all of the train split at the end).
    #[serde(default = "default_probe_images")]
    pub probe_train_images: usize,
    /// Test images the periodic probes score (all 10,000 at the end).
    #[serde(default = "default_probe_images")]
    pub probe_test_images: usize,
    /// Training images of the final probes (every one when unset).
    #[serde(default)]
    pub final_probe_train_images: Option<usize>,
    /// Test images of the final probes (every one when unset).
    #[serde(default)]
    pub final_probe_test_images: Option<usize>,
    /// Epochs of the logistic-regression probe.
    #[serde(default = "default_probe_epochs")]
    pub probe_epochs: usize,
    /// Neighbours of the k-NN classifier.
    #[serde(default = "default_knn_k")]
    pub knn_k: usize,
    /// Also probe raw pixels the same way at the end (the baseline to beat).
    #[serde(default = "default_true")]
    pub pixel_baseline: bool,
    /// Frozen-feature readouts the probes score, a name or a list of names (see
    /// [`ProbeReadout`]); the first is the run's headline `probe_acc` / `knn_acc`.
    #[serde(default = "default_probe_features", deserialize_with = "one_or_many_readouts")]
    pub probe_features: Vec<ProbeReadout>,
}

/// `[jepa] probe_features`: how the frozen encoder's final token grid becomes the probes' input
/// (the computation is `train::readout`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProbeReadout {
    /// Mean over all tokens of the final (layer-normed) output: `C` values (the I-JEPA paper's).
    Mean,
    /// The token grid average-pooled over 2x2 regions, concatenated: `4·C` values.
    Grid2,
    /// The token grid average-pooled over 3x3 regions, concatenated: `9·C` values.
    Grid3,
    /// Every token of the final output, concatenated: `N·C` values.
    Tokens,
    /// Mean-pooled outputs of the last 4 blocks (each through the final norm), concatenated:
    /// `min(4, layers)·C` values.
    MeanLast4,
}

impl ProbeReadout {
    /// Every readout, in the order the docs list them.
    pub const ALL: [ProbeReadout; 5] = [ProbeReadout::Mean, ProbeReadout::Grid2, ProbeReadout::Grid3, ProbeReadout::Tokens, ProbeReadout::MeanLast4];

    /// The config name.
    pub fn name(self) -> &'static str {
        match self {
            ProbeReadout::Mean => "mean",
            ProbeReadout::Grid2 => "grid2",
            ProbeReadout::Grid3 => "grid3",
            ProbeReadout::Tokens => "tokens",
            ProbeReadout::MeanLast4 => "mean-last4",
        }
    }

    /// The readout called `name`, if any.
    pub fn from_name(name: &str) -> Option<ProbeReadout> {
        Self::ALL.into_iter().find(|r| r.name() == name)
    }

    /// The allowed names, quoted and comma-separated (for error messages).
    pub fn allowed() -> String {
        Self::ALL.iter().map(|r| format!("\"{}\"", r.name())).collect::<Vec<_>>().join(", ")
    }
}

impl<'de> Deserialize<'de> for ProbeReadout {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        ProbeReadout::from_name(&name)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown probe readout \"{name}\" in jepa.probe_features: allowed {}", ProbeReadout::allowed())))
    }
}

/// `probe_features = "grid3"` or `probe_features = ["mean", "grid3"]`.
fn one_or_many_readouts<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<ProbeReadout>, D::Error> {
    struct Visitor;
    impl<'de> serde::de::Visitor<'de> for Visitor {
        type Value = Vec<ProbeReadout>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            write!(f, "a probe readout name or a list of them ({})", ProbeReadout::allowed())
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
            ProbeReadout::deserialize(serde::de::value::StrDeserializer::<E>::new(v)).map(|r| vec![r])
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(r) = seq.next_element::<ProbeReadout>()? {
                out.push(r);
            }
            Ok(out)
        }
    }
    d.deserialize_any(Visitor)
}

/// `[jepa] loss`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum JepaLossKind {
    /// Mean squared error.
    #[default]
    L2,
    /// Smooth L1.
    SmoothL1,
}

impl Default for JepaConfig {
    fn default() -> Self {
        JepaConfig {
            predictor_width: default_predictor_width(),
            predictor_depth: default_predictor_depth(),
            predictor_heads: default_predictor_heads(),
            loss: JepaLossKind::default(),
            n_targets: default_n_targets(),
            target_scale: default_target_scale(),
            target_aspect: default_target_aspect(),
            context_scale: default_context_scale(),
            min_keep: default_min_keep(),
            ema_momentum: default_ema_momentum(),
            final_weight_decay: None,
            probe_every: 0,
            probe_train_images: default_probe_images(),
            probe_test_images: default_probe_images(),
            final_probe_train_images: None,
            final_probe_test_images: None,
            probe_epochs: default_probe_epochs(),
            knn_k: default_knn_k(),
            pixel_baseline: true,
            probe_features: default_probe_features(),
        }
    }
}

fn default_predictor_width() -> usize {
    64
}
fn default_predictor_depth() -> usize {
    2
}
fn default_predictor_heads() -> usize {
    4
}
fn default_n_targets() -> usize {
    4
}
fn default_target_scale() -> (f64, f64) {
    (0.15, 0.2)
}
fn default_target_aspect() -> (f64, f64) {
    (0.75, 1.5)
}
fn default_context_scale() -> (f64, f64) {
    (0.85, 1.0)
}
fn default_min_keep() -> usize {
    4
}
fn default_ema_momentum() -> (f64, f64) {
    (0.996, 1.0)
}
fn default_probe_images() -> usize {
    10_000
}
fn default_probe_epochs() -> usize {
    20
}
fn default_knn_k() -> usize {
    20
}
fn default_probe_features() -> Vec<ProbeReadout> {
    vec![ProbeReadout::Mean]
}
fn default_true() -> bool {
    true
}

/// Model kinds and their shapes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub enum ModelConfig {
    /// A multilayer perceptron on flattened images.
    Mlp {
        /// Hidden layer widths (input and output widths come from the dataset).
        hidden: Vec<usize>,
        /// Activation between layers.
        activation: Activation,
    },
    /// A GPT decoder; its vocabulary comes from `[data] tokenizer` (256 bytes, or GPT-2's BPE).
    Gpt {
        /// Transformer blocks.
        n_layers: usize,
        /// Embedding width.
        d_model: usize,
        /// Attention heads (divides `d_model`).
        n_heads: usize,
        /// Context length in tokens (bytes for the byte tokenizer; also the training window).
        context: usize,
        /// Dropout probability.
        dropout: f64,
        /// The feed-forward GELU (`[model] gelu`, default exact).
        gelu: Gelu,
    },
    /// An I-JEPA ViT encoder (with its EMA target and predictor, see `[jepa]`) on images, or,
    /// with `video` (`model.kind = "vjepa"`), a V-JEPA encoder of tubelets on moving-item clips.
    IJepa {
        /// Patch side (divides the image sides, or the canvas side of clips).
        patch_size: usize,
        /// Encoder width (a multiple of 4: the position embedding starts at 2-D sin-cos; of 8
        /// for clips: 3-D sin-cos).
        d_model: usize,
        /// Encoder blocks.
        n_layers: usize,
        /// Encoder heads (divides `d_model`).
        n_heads: usize,
        /// The clips and tubelets of a V-JEPA run (`[video]`); `None` for I-JEPA on images.
        #[serde(skip_serializing_if = "Option::is_none")]
        video: Option<VideoConfig>,
    },
    /// A ViT classifier trained supervised end to end (`model.kind = "vit"`): the I-JEPA
    /// encoder's shape (same keys) with mean pooling and a linear head, the twin that says how
    /// far the self-supervised features are from supervised ones.
    Vit {
        /// Patch side (divides the image sides).
        patch_size: usize,
        /// Encoder width (a multiple of 4: the position embedding starts at 2-D sin-cos).
        d_model: usize,
        /// Encoder blocks.
        n_layers: usize,
        /// Encoder heads (divides `d_model`).
        n_heads: usize,
    },
}

impl ModelConfig {
    /// The `model.kind` this configuration was read from.
    pub fn kind_name(&self) -> &'static str {
        match self {
            ModelConfig::Mlp { .. } => "mlp",
            ModelConfig::Gpt { .. } => "gpt",
            ModelConfig::IJepa { video: None, .. } => "ijepa",
            ModelConfig::IJepa { video: Some(_), .. } => "vjepa",
            ModelConfig::Vit { .. } => "vit",
        }
    }
}

/// `[video]`: the clips and tubelets of `model.kind = "vjepa"` (moving dataset items, see
/// `rtx_tensor::data::MovingConfig`), and its attentive probe.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VideoConfig {
    /// Canvas side in pixels (a multiple of `model.patch_size`).
    #[serde(default = "default_canvas")]
    pub canvas: usize,
    /// Frames per clip (a multiple of `tubelet`).
    #[serde(default = "default_frames")]
    pub frames: usize,
    /// Frames per tubelet.
    #[serde(default = "default_tubelet")]
    pub tubelet: usize,
    /// Motion directions (the direction label's classes), evenly spaced.
    #[serde(default = "default_directions")]
    pub directions: usize,
    /// Speed range in pixels per frame.
    #[serde(default = "default_speed")]
    pub speed: (f64, f64),
    /// Also train an attentive probe (a learned query attending over the frozen tokens, then a
    /// linear classifier) for both labels.
    #[serde(default = "default_true")]
    pub attentive_probe: bool,
    /// Epochs of the attentive probe (at least 600 steps, like the linear probe).
    #[serde(default = "default_attentive_epochs")]
    pub attentive_epochs: usize,
}

impl Default for VideoConfig {
    fn default() -> Self {
        VideoConfig {
            canvas: default_canvas(),
            frames: default_frames(),
            tubelet: default_tubelet(),
            directions: default_directions(),
            speed: default_speed(),
            attentive_probe: true,
            attentive_epochs: default_attentive_epochs(),
        }
    }
}

impl VideoConfig {
    /// The clip generator of this section.
    pub fn moving(&self) -> rtx_tensor::data::MovingConfig {
        rtx_tensor::data::MovingConfig { canvas: self.canvas, frames: self.frames, directions: self.directions, speed: self.speed }
    }
}

fn default_canvas() -> usize {
    48
}
fn default_frames() -> usize {
    8
}
fn default_tubelet() -> usize {
    2
}
fn default_directions() -> usize {
    8
}
fn default_speed() -> (f64, f64) {
    (1.5, 2.5)
}
fn default_attentive_epochs() -> usize {
    10
}

/// Activation functions an MLP may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Activation {
    /// max(0, x).
    Relu,
    /// Gaussian error linear unit.
    Gelu,
    /// Hyperbolic tangent.
    Tanh,
}

/// The two GELU forms of PyTorch's `approximate=` argument.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Gelu {
    /// Exact `x·Φ(x)` through erf (`approximate="none"`).
    #[default]
    None,
    /// `x/2·(1 + tanh(√(2/π)(x + 0.044715x³)))` (`approximate="tanh"`, GPT-2).
    Tanh,
}

/// Datasets `rtx train` knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Dataset {
    /// Fashion-MNIST, 60k train / 10k test images of 28×28.
    FashionMnist,
    /// US State of the Union addresses as one byte stream.
    Sotu,
    /// scikit-learn digits, 1797 images of 8×8 (no test split).
    Digits,
}

impl Dataset {
    /// The name used in configs and by `scripts/fetch-data.sh --only`.
    pub fn name(self) -> &'static str {
        match self {
            Dataset::FashionMnist => "fashion-mnist",
            Dataset::Sotu => "sotu",
            Dataset::Digits => "digits",
        }
    }

    /// Whether the dataset is images (else text).
    pub fn is_image(self) -> bool {
        !matches!(self, Dataset::Sotu)
    }
}

/// `[data]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// Which dataset.
    pub dataset: Dataset,
    /// Fraction of the training data held out for validation, in (0, 1).
    #[serde(default = "default_val_fraction")]
    pub val_fraction: f64,
    /// Samples (images, or text windows) per step.
    pub batch_size: usize,
    /// How text becomes tokens (text datasets only; see [`Tokenizer`]). Left out of the
    /// serialized config when it is the default, so the `[data]` section a byte run records in
    /// its checkpoints is the one it recorded before the key existed (resume compares it).
    #[serde(default, skip_serializing_if = "Tokenizer::is_bytes")]
    pub tokenizer: Tokenizer,
}

/// `[data] tokenizer`: the tokens a GPT reads and predicts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tokenizer {
    /// Every byte is a token (vocabulary 256): the byte-level GPT.
    #[default]
    Bytes,
    /// GPT-2's byte-pair encoding (`r50k_base`, vocabulary 50,257, documents separated by
    /// `<|endoftext|>`); the token table is padded to 50,304 rows as llm.c does. The corpus is
    /// tokenized once into `<data>/sotu/gpt2-tokens.bin`.
    Gpt2,
}

impl Tokenizer {
    /// The name used in configs.
    pub fn name(self) -> &'static str {
        match self {
            Tokenizer::Bytes => "bytes",
            Tokenizer::Gpt2 => "gpt2",
        }
    }

    /// Whether this is the byte tokenizer (the default).
    pub fn is_bytes(&self) -> bool {
        *self == Tokenizer::Bytes
    }

    /// The vocabulary V: the tokens the model reads and predicts.
    pub fn vocab_size(self) -> usize {
        match self {
            Tokenizer::Bytes => GPT_VOCAB,
            Tokenizer::Gpt2 => rtx_tensor::data::GPT2_VOCAB,
        }
    }

    /// The token table's rows are a multiple of this (`nn::GptConfig::vocab_pad_multiple`):
    /// 1 for bytes, 128 for GPT-2 (50,257 rows padded to 50,304, as llm.c).
    pub fn vocab_pad_multiple(self) -> usize {
        match self {
            Tokenizer::Bytes => 1,
            Tokenizer::Gpt2 => GPT2_VOCAB_PAD_MULTIPLE,
        }
    }

    /// Rows of the token table: [`Tokenizer::vocab_size`] rounded up to
    /// [`Tokenizer::vocab_pad_multiple`].
    pub fn padded_vocab(self) -> usize {
        self.vocab_size().div_ceil(self.vocab_pad_multiple()) * self.vocab_pad_multiple()
    }

    /// What one token is, for log lines and units (`nats/byte`, `nats/token`).
    pub fn unit(self) -> &'static str {
        match self {
            Tokenizer::Bytes => "byte",
            Tokenizer::Gpt2 => "token",
        }
    }
}

/// Optimizer settings.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OptimConfig {
    /// Which optimizer, with its own settings.
    pub kind: OptimKind,
    /// Peak learning rate.
    pub lr: f64,
    /// Weight decay (decoupled for AdamW, L2 for SGD).
    pub weight_decay: f64,
    /// Clip the global gradient norm to this value, if set.
    pub grad_clip: Option<f64>,
}

/// Optimizer kinds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub enum OptimKind {
    /// Stochastic gradient descent with optional momentum.
    Sgd {
        /// Momentum factor in [0, 1).
        momentum: f64,
    },
    /// Adam with decoupled weight decay.
    AdamW {
        /// (beta1, beta2), each in [0, 1).
        betas: (f64, f64),
        /// Denominator epsilon.
        eps: f64,
    },
}

/// `[schedule]`: linear warmup, then cosine decay to `min_lr` at `total_steps`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ScheduleConfig {
    /// Steps of linear warmup from 0 to `optim.lr`.
    pub warmup_steps: u64,
    /// Step at which the cosine reaches `min_lr` (after it the rate stays there). Defaults to
    /// `train.steps`.
    pub total_steps: u64,
    /// Final learning rate.
    pub min_lr: f64,
    /// Whether to decay at all (`false`: constant rate after warmup).
    pub cosine: bool,
}

/// `[train]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoopConfig {
    /// Optimizer steps of the whole run.
    pub steps: u64,
    /// Seed of every random choice (initialization, data order, dropout).
    #[serde(default)]
    pub seed: u64,
    /// Evaluate on the validation split every this many steps (0: only at the end).
    #[serde(default)]
    pub eval_every: u64,
    /// Print and record a log line every this many steps.
    #[serde(default = "default_log_every")]
    pub log_every: u64,
    /// Write a checkpoint every this many steps (0: only at the end).
    #[serde(default)]
    pub checkpoint_every: u64,
    /// Under `rtx launch`: record each generation's first this many steps per rank and write
    /// them to `<out>/trace-rank<r>.json` (Chrome trace format; 0: no trace).
    #[serde(default)]
    pub trace_steps: u64,
    /// Keep this many most recent checkpoints.
    #[serde(default = "default_keep_checkpoints")]
    pub keep_checkpoints: usize,
    /// At most this many validation batches per periodic evaluation (all when unset). The final
    /// evaluation always uses the whole split.
    #[serde(default)]
    pub eval_batches: Option<usize>,
    /// Where each worker trains (see the module doc).
    #[serde(default)]
    pub device: DeviceKind,
    /// Element type of parameters and activations on the GPU (see the module doc); `None` takes
    /// the device's default ([`TrainConfig::precision`]).
    #[serde(default)]
    pub precision: Option<Precision>,
}

/// `[train] device`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// Host tensors (f32).
    #[default]
    Cpu,
    /// One CUDA GPU per worker (shared when there are more workers than GPUs).
    Cuda,
}

/// `[train] precision`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in f32.
    F32,
    /// bf16 parameters, activations and gradients; f32 master weights and moments (GPU only).
    Bf16,
}

/// `[sample]`: what a GPT run generates at the end.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SampleConfig {
    /// Text the sample continues.
    #[serde(default = "default_prompt")]
    pub prompt: String,
    /// Tokens to generate (bytes with the byte tokenizer).
    #[serde(default = "default_sample_length")]
    pub length: usize,
    /// Softmax temperature (> 0).
    #[serde(default = "default_temperature")]
    pub temperature: f64,
}

impl Default for SampleConfig {
    fn default() -> Self {
        Self { prompt: default_prompt(), length: default_sample_length(), temperature: default_temperature() }
    }
}

/// What the mesh sees of an MLP: one unsplittable layer (it trains with `dp` only).
const MLP_DIMS: rtx_pipelines::ModelDims = rtx_pipelines::ModelDims { layers: 1, heads: 1, vocab: 1, mlp_hidden: 1 };
/// The byte-level GPT's vocabulary.
const GPT_VOCAB: usize = 256;
/// GPT-2's vocabulary is padded to a multiple of this (50,257 → 50,304 = 393 · 128).
const GPT2_VOCAB_PAD_MULTIPLE: usize = 128;
/// The GPT's feed-forward width as a multiple of `d_model` (`nn::GptConfig::default().mlp_ratio`).
const GPT_MLP_RATIO: usize = 4;

fn default_val_fraction() -> f64 {
    0.1
}
fn default_log_every() -> u64 {
    50
}
fn default_keep_checkpoints() -> usize {
    3
}
fn default_prompt() -> String {
    "Fellow-Citizens of the Senate and House of Representatives: ".into()
}
fn default_sample_length() -> usize {
    300
}
fn default_temperature() -> f64 {
    0.8
}

// ------------------------------------------------------------------------ raw (serde) form

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    model: RawModel,
    data: DataConfig,
    optim: RawOptim,
    #[serde(default)]
    schedule: Option<RawSchedule>,
    train: LoopConfig,
    #[serde(default)]
    output: Option<RawOutput>,
    #[serde(default)]
    sample: Option<SampleConfig>,
    #[serde(default)]
    parallel: ParallelConfig,
    #[serde(default)]
    elastic: Option<toml::Table>,
    #[serde(default)]
    jepa: Option<JepaConfig>,
    #[serde(default)]
    video: Option<VideoConfig>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum RawModelKind {
    Mlp,
    Gpt,
    Ijepa,
    Vjepa,
    Vit,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawModel {
    kind: RawModelKind,
    hidden: Option<Vec<usize>>,
    activation: Option<Activation>,
    n_layers: Option<usize>,
    d_model: Option<usize>,
    n_heads: Option<usize>,
    context: Option<usize>,
    dropout: Option<f64>,
    patch_size: Option<usize>,
    gelu: Option<Gelu>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum RawOptimKind {
    Sgd,
    Adamw,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawOptim {
    kind: RawOptimKind,
    lr: f64,
    #[serde(default)]
    weight_decay: f64,
    betas: Option<(f64, f64)>,
    eps: Option<f64>,
    momentum: Option<f64>,
    grad_clip: Option<f64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum RawScheduleKind {
    WarmupCosine,
    WarmupConstant,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSchedule {
    #[serde(default = "default_schedule_kind")]
    kind: RawScheduleKind,
    #[serde(default)]
    warmup_steps: u64,
    total_steps: Option<u64>,
    #[serde(default)]
    min_lr: f64,
}

fn default_schedule_kind() -> RawScheduleKind {
    RawScheduleKind::WarmupCosine
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawOutput {
    dir: PathBuf,
}

// ------------------------------------------------------------------------ loading

impl TrainConfig {
    /// Reads and validates the config file at `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
        Self::parse(&text, &format!(" {}", path.display()))
    }

    /// Parses and validates a config held in a string.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        Self::parse(text, "")
    }

    fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::Parse { origin: origin.to_string(), message: e.to_string().trim_end().to_string() })?;
        let v = Validator { origin };
        v.validate(raw)
    }

    /// The effective precision: `[train] precision`, else bf16 on the GPU and f32 on the CPU.
    pub fn precision(&self) -> Precision {
        self.train.precision.unwrap_or(match self.train.device {
            DeviceKind::Cpu => Precision::F32,
            DeviceKind::Cuda => Precision::Bf16,
        })
    }

    /// The model's layout for planning: a GPT's dimensions (the tokenizer's padded vocabulary,
    /// MLP width 4·C, tied head, as `train::model` builds it); `None` for an MLP.
    pub fn model_layout(&self) -> Option<ModelLayout> {
        match self.model {
            ModelConfig::Gpt { n_layers, d_model, n_heads, context, .. } => {
                Some(ModelLayout { layers: n_layers, d_model, heads: n_heads, vocab: self.data.tokenizer.padded_vocab(), context, mlp_hidden: GPT_MLP_RATIO * d_model, tied: true })
            }
            ModelConfig::Mlp { .. } | ModelConfig::IJepa { .. } | ModelConfig::Vit { .. } => None,
        }
    }

    /// The mesh of `[parallel]` over `world` ranks: the check `rtx launch --nproc N` and `rtx plan
    /// --world N` make before any worker starts (`dp` fills the world when unset; a mesh larger
    /// than the world, or one that does not divide it, is an error naming the numbers).
    pub fn mesh(&self, world: usize) -> Result<Mesh, ConfigError> {
        let dims = self.model_layout().map_or(MLP_DIMS, |m| m.dims());
        let v = Validator { origin: "" };
        self.parallel.mesh(world, dims).map_err(|e| v.parallel_error(&self.parallel, e))
    }

    /// The output folder: `[output] dir`, else `runs/<stem of config_path>`.
    pub fn default_output_dir(&self, config_path: Option<&Path>) -> PathBuf {
        if let Some(dir) = &self.output_dir {
            return dir.clone();
        }
        let stem = config_path.and_then(|p| p.file_stem()).map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "run".into());
        PathBuf::from("runs").join(stem)
    }
}

struct Validator<'a> {
    origin: &'a str,
}

impl Validator<'_> {
    fn invalid(&self, key: &str, value: impl std::fmt::Display, allowed: impl Into<String>) -> ConfigError {
        ConfigError::Invalid { origin: self.origin.to_string(), key: key.to_string(), value: value.to_string(), allowed: allowed.into() }
    }

    /// A key set for a kind that does not use it.
    fn not_for(&self, key: &str, set: bool, kind_key: &str, kind: &str, used_by: &str) -> Result<(), ConfigError> {
        if set {
            return Err(self.invalid(key, "(set)", format!("not used when {kind_key} = \"{kind}\"; it is a key of {kind_key} = \"{used_by}\"")));
        }
        Ok(())
    }

    fn require<T>(&self, key: &str, value: Option<T>, kind_key: &str, kind: &str) -> Result<T, ConfigError> {
        value.ok_or_else(|| self.invalid(key, "(missing)", format!("required when {kind_key} = \"{kind}\"")))
    }

    fn positive(&self, key: &str, value: f64) -> Result<(), ConfigError> {
        if !(value.is_finite() && value > 0.0) {
            return Err(self.invalid(key, value, "must be a finite number > 0"));
        }
        Ok(())
    }

    fn unit_open(&self, key: &str, value: f64, low_inclusive: bool) -> Result<(), ConfigError> {
        let ok = if low_inclusive { (0.0..1.0).contains(&value) } else { value > 0.0 && value < 1.0 };
        if !ok {
            let range = if low_inclusive { "[0, 1)" } else { "(0, 1)" };
            return Err(self.invalid(key, value, format!("must lie in {range}")));
        }
        Ok(())
    }

    fn nonzero(&self, key: &str, value: usize) -> Result<(), ConfigError> {
        if value == 0 {
            return Err(self.invalid(key, value, "must be at least 1"));
        }
        Ok(())
    }

    fn validate(&self, raw: RawConfig) -> Result<TrainConfig, ConfigError> {
        let video_kind = raw.model.kind == RawModelKind::Vjepa;
        if raw.video.is_some() && !video_kind {
            return Err(self.invalid("video", "(section)", "only allowed with model.kind = \"vjepa\""));
        }
        let mut model = self.model(raw.model)?;
        if let ModelConfig::IJepa { video, .. } = &mut model {
            if video_kind {
                *video = Some(raw.video.unwrap_or_default());
            }
        }
        let data = raw.data;
        self.unit_open("data.val_fraction", data.val_fraction, false)?;
        self.nonzero("data.batch_size", data.batch_size)?;
        match (&model, data.dataset) {
            (ModelConfig::Mlp { .. } | ModelConfig::IJepa { .. } | ModelConfig::Vit { .. }, Dataset::Sotu) => {
                return Err(self.invalid("data.dataset", "\"sotu\"", format!("model.kind = \"{}\" trains on images: use \"fashion-mnist\" or \"digits\" (or model.kind = \"gpt\" for text)", model.kind_name())));
            }
            (ModelConfig::Gpt { .. }, d) if d.is_image() => {
                return Err(self.invalid("data.dataset", format!("\"{}\"", d.name()), "model.kind = \"gpt\" trains on text: use \"sotu\" (or model.kind = \"mlp\" for images)"));
            }
            _ => {}
        }
        if data.tokenizer != Tokenizer::Bytes && data.dataset.is_image() {
            return Err(self.invalid("data.tokenizer", format!("\"{}\"", data.tokenizer.name()), format!("a tokenizer turns text into tokens: data.dataset = \"{}\" is images (use \"sotu\" with model.kind = \"gpt\", or leave data.tokenizer out)", data.dataset.name())));
        }
        let optim = self.optim(raw.optim)?;
        let train = raw.train;
        if train.steps == 0 {
            return Err(self.invalid("train.steps", 0, "must be at least 1"));
        }
        if train.log_every == 0 {
            return Err(self.invalid("train.log_every", 0, "must be at least 1"));
        }
        self.nonzero("train.keep_checkpoints", train.keep_checkpoints)?;
        if let Some(n) = train.eval_batches {
            self.nonzero("train.eval_batches", n)?;
        }
        let schedule = match raw.schedule {
            None => ScheduleConfig { warmup_steps: 0, total_steps: train.steps, min_lr: optim.lr, cosine: false },
            Some(s) => {
                let total_steps = s.total_steps.unwrap_or(train.steps);
                if total_steps == 0 {
                    return Err(self.invalid("schedule.total_steps", 0, "must be at least 1"));
                }
                if s.warmup_steps > total_steps {
                    return Err(self.invalid("schedule.warmup_steps", s.warmup_steps, format!("must not exceed schedule.total_steps ({total_steps})")));
                }
                if !(s.min_lr.is_finite() && s.min_lr >= 0.0 && s.min_lr <= optim.lr) {
                    return Err(self.invalid("schedule.min_lr", s.min_lr, format!("must lie in [0, optim.lr = {}]", optim.lr)));
                }
                let cosine = s.kind == RawScheduleKind::WarmupCosine;
                ScheduleConfig { warmup_steps: s.warmup_steps, total_steps, min_lr: if cosine { s.min_lr } else { optim.lr }, cosine }
            }
        };
        let is_gpt = matches!(model, ModelConfig::Gpt { .. });
        if raw.sample.is_some() && !is_gpt {
            return Err(self.invalid("sample", "(section)", "only allowed with model.kind = \"gpt\""));
        }
        let sample = raw.sample.unwrap_or_default();
        if is_gpt {
            self.positive("sample.temperature", sample.temperature)?;
            if sample.prompt.is_empty() {
                return Err(self.invalid("sample.prompt", "\"\"", "must hold at least one character"));
            }
        }
        let jepa = self.jepa(&model, &data, raw.jepa)?;
        self.device(&model, &optim, &train, jepa.as_ref())?;
        let config = TrainConfig { model, data, optim, schedule, train, output_dir: raw.output.map(|o| o.dir), sample, parallel: raw.parallel, elastic: raw.elastic, jepa };
        self.parallel(&config)?;
        Ok(config)
    }

    /// `[parallel]` against the model and the batch (not the world: see [`TrainConfig::mesh`]).
    fn parallel(&self, config: &TrainConfig) -> Result<(), ConfigError> {
        let p = &config.parallel;
        if config.data.tokenizer != Tokenizer::Bytes {
            for (key, value) in [("parallel.pp", p.pp), ("parallel.tp", p.tp)] {
                if value > 1 {
                    return Err(self.invalid(key, value, format!("data.tokenizer = \"{}\" pads the token table to {} rows, which pipeline and tensor parallel stages do not support yet: train it with dp (and zero) only", config.data.tokenizer.name(), config.data.tokenizer.padded_vocab())));
                }
            }
        }
        let dims = match config.model_layout() {
            Some(layout) => layout.dims(),
            None => {
                for (key, value) in [("parallel.pp", p.pp), ("parallel.tp", p.tp)] {
                    if value > 1 {
                        return Err(self.invalid(key, value, "pipeline and tensor parallelism split a GPT's layers and heads; an MLP trains with dp (and zero) only"));
                    }
                }
                MLP_DIMS
            }
        };
        p.validate(dims).map_err(|e| self.parallel_error(p, e))?;
        if p.microbatches > 0 && !config.data.batch_size.is_multiple_of(p.microbatches) {
            return Err(self.invalid("parallel.microbatches", p.microbatches, format!("must divide data.batch_size ({})", config.data.batch_size)));
        }
        Ok(())
    }

    /// A planning error as a config error naming the `[parallel]` key.
    fn parallel_error(&self, p: &ParallelConfig, e: PlanError) -> ConfigError {
        let (key, value) = match &e {
            PlanError::Config { key, value, .. } => (format!("parallel.{key}"), value.clone()),
            PlanError::Mesh(MeshError::Indivisible { .. } | MeshError::ZeroAxis { axis: rtx_pipelines::Axis::Tp }) => ("parallel.tp".into(), p.tp.to_string()),
            PlanError::Mesh(MeshError::TooManyStages { .. } | MeshError::ZeroAxis { axis: rtx_pipelines::Axis::Pp }) => ("parallel.pp".into(), p.pp.to_string()),
            PlanError::Mesh(MeshError::WorldMismatch { dp, pp, tp, .. }) => ("parallel".into(), format!("(dp={dp}, pp={pp}, tp={tp})")),
            _ => ("parallel".into(), "(section)".into()),
        };
        let allowed = match &e {
            PlanError::Config { allowed, .. } => allowed.clone(),
            other => other.to_string(),
        };
        self.invalid(&key, value, allowed)
    }

    /// `[train] device` and `precision` against what the GPU path supports (`jepa`: the checked
    /// `[jepa]` section of an I-JEPA / V-JEPA model).
    fn device(&self, model: &ModelConfig, optim: &OptimConfig, train: &LoopConfig, jepa: Option<&JepaConfig>) -> Result<(), ConfigError> {
        // The GPU's flash attention takes head dims 64 and 128.
        let head_dim = |key: &str, width: usize, heads: usize| -> Result<(), ConfigError> {
            let dim = width / heads.max(1);
            if dim == 64 || dim == 128 {
                return Ok(());
            }
            Err(self.invalid(key, heads, format!("with train.device = \"cuda\", the head dim ({width} / {heads}) must be 64 or 128 (the GPU's flash attention head sizes); it is {dim}")))
        };
        match train.device {
            DeviceKind::Cpu => {
                if train.precision == Some(Precision::Bf16) {
                    return Err(self.invalid("train.precision", "\"bf16\"", "bf16 needs train.device = \"cuda\"; CPU training is f32"));
                }
            }
            DeviceKind::Cuda => {
                match model {
                    ModelConfig::Mlp { .. } | ModelConfig::Vit { .. } => {
                        return Err(self.invalid("train.device", "\"cuda\"", format!("the GPU path trains model.kind = \"gpt\", \"ijepa\" and \"vjepa\" (their kernels cover transformer training); model.kind = \"{}\" trains with train.device = \"cpu\"", model.kind_name())))
                    }
                    ModelConfig::Gpt { dropout, d_model, n_heads, .. } => {
                        head_dim("model.n_heads", *d_model, *n_heads)?;
                        if *dropout > 0.0 {
                            return Err(self.invalid("model.dropout", dropout, "must be 0 with train.device = \"cuda\" (dropout has no GPU kernel yet)"));
                        }
                    }
                    // The encoder's and the predictor's attention both run the GPU's kernels.
                    ModelConfig::IJepa { d_model, n_heads, .. } => {
                        head_dim("model.n_heads", *d_model, *n_heads)?;
                        if let Some(j) = jepa {
                            head_dim("jepa.predictor_heads", j.predictor_width, j.predictor_heads)?;
                        }
                    }
                }
                if !matches!(optim.kind, OptimKind::AdamW { .. }) {
                    return Err(self.invalid("optim.kind", "\"sgd\"", "train.device = \"cuda\" trains with \"adamw\" (f32 master weights on the GPU)"));
                }
            }
        }
        Ok(())
    }

    fn model(&self, m: RawModel) -> Result<ModelConfig, ConfigError> {
        match m.kind {
            RawModelKind::Mlp => {
                for (key, set) in [("model.n_layers", m.n_layers.is_some()), ("model.d_model", m.d_model.is_some()), ("model.n_heads", m.n_heads.is_some()), ("model.context", m.context.is_some()), ("model.dropout", m.dropout.is_some())] {
                    self.not_for(key, set, "model.kind", "mlp", "gpt")?;
                }
                self.not_for("model.patch_size", m.patch_size.is_some(), "model.kind", "mlp", "ijepa")?;
                self.not_for("model.gelu", m.gelu.is_some(), "model.kind", "mlp", "gpt")?;
                let hidden = self.require("model.hidden", m.hidden, "model.kind", "mlp")?;
                if let Some(pos) = hidden.iter().position(|&h| h == 0) {
                    return Err(self.invalid(&format!("model.hidden[{pos}]"), 0, "every hidden width must be at least 1"));
                }
                Ok(ModelConfig::Mlp { hidden, activation: m.activation.unwrap_or(Activation::Relu) })
            }
            RawModelKind::Gpt => {
                self.not_for("model.hidden", m.hidden.is_some(), "model.kind", "gpt", "mlp")?;
                self.not_for("model.activation", m.activation.is_some(), "model.kind", "gpt", "mlp")?;
                self.not_for("model.patch_size", m.patch_size.is_some(), "model.kind", "gpt", "ijepa")?;
                let n_layers = self.require("model.n_layers", m.n_layers, "model.kind", "gpt")?;
                let d_model = self.require("model.d_model", m.d_model, "model.kind", "gpt")?;
                let n_heads = self.require("model.n_heads", m.n_heads, "model.kind", "gpt")?;
                let context = self.require("model.context", m.context, "model.kind", "gpt")?;
                let dropout = m.dropout.unwrap_or(0.0);
                self.nonzero("model.n_layers", n_layers)?;
                self.nonzero("model.d_model", d_model)?;
                self.nonzero("model.n_heads", n_heads)?;
                self.nonzero("model.context", context)?;
                if d_model % n_heads != 0 {
                    return Err(self.invalid("model.n_heads", n_heads, format!("must divide model.d_model ({d_model})")));
                }
                self.unit_open("model.dropout", dropout, true)?;
                Ok(ModelConfig::Gpt { n_layers, d_model, n_heads, context, dropout, gelu: m.gelu.unwrap_or_default() })
            }
            RawModelKind::Ijepa | RawModelKind::Vjepa | RawModelKind::Vit => {
                let kind = match m.kind {
                    RawModelKind::Vjepa => "vjepa",
                    RawModelKind::Vit => "vit",
                    _ => "ijepa",
                };
                self.not_for("model.hidden", m.hidden.is_some(), "model.kind", kind, "mlp")?;
                self.not_for("model.activation", m.activation.is_some(), "model.kind", kind, "mlp")?;
                self.not_for("model.context", m.context.is_some(), "model.kind", kind, "gpt")?;
                self.not_for("model.dropout", m.dropout.is_some(), "model.kind", kind, "gpt")?;
                self.not_for("model.gelu", m.gelu.is_some(), "model.kind", kind, "gpt")?;
                let patch_size = self.require("model.patch_size", m.patch_size, "model.kind", kind)?;
                let d_model = self.require("model.d_model", m.d_model, "model.kind", kind)?;
                let n_layers = self.require("model.n_layers", m.n_layers, "model.kind", kind)?;
                let n_heads = self.require("model.n_heads", m.n_heads, "model.kind", kind)?;
                self.nonzero("model.patch_size", patch_size)?;
                self.nonzero("model.n_layers", n_layers)?;
                self.nonzero("model.n_heads", n_heads)?;
                if d_model == 0 || d_model % 4 != 0 {
                    return Err(self.invalid("model.d_model", d_model, "must be a positive multiple of 4 (the position embedding starts at 2-D sin-cos)"));
                }
                if d_model % n_heads != 0 {
                    return Err(self.invalid("model.n_heads", n_heads, format!("must divide model.d_model ({d_model})")));
                }
                if m.kind == RawModelKind::Vit {
                    return Ok(ModelConfig::Vit { patch_size, d_model, n_layers, n_heads });
                }
                Ok(ModelConfig::IJepa { patch_size, d_model, n_layers, n_heads, video: None })
            }
        }
    }

    /// `[jepa]` against the model kind (present exactly for I-JEPA) and its own ranges.
    fn jepa(&self, model: &ModelConfig, data: &DataConfig, raw: Option<JepaConfig>) -> Result<Option<JepaConfig>, ConfigError> {
        let ModelConfig::IJepa { patch_size, d_model, video, .. } = model else {
            if raw.is_some() {
                return Err(self.invalid("jepa", "(section)", "only allowed with model.kind = \"ijepa\" or \"vjepa\""));
            }
            if let ModelConfig::Vit { patch_size, .. } = model {
                let side = if data.dataset == Dataset::FashionMnist { 28 } else { 8 };
                if side % patch_size != 0 {
                    return Err(self.invalid("model.patch_size", patch_size, format!("must divide the image side ({side} for {})", data.dataset.name())));
                }
            }
            return Ok(None);
        };
        if !data.dataset.is_image() {
            return Err(self.invalid("data.dataset", format!("\"{}\"", data.dataset.name()), "model.kind = \"ijepa\" / \"vjepa\" trains on images: use \"fashion-mnist\" or \"digits\""));
        }
        let item = match data.dataset {
            Dataset::FashionMnist => 28,
            _ => 8,
        };
        let j = raw.unwrap_or_default();
        let side = match video {
            None => item,
            Some(v) => {
                self.video(v, item, *patch_size, *d_model, &j)?;
                v.canvas
            }
        };
        if side % patch_size != 0 {
            let what = if video.is_some() { "video.canvas" } else { "the image side" };
            return Err(self.invalid("model.patch_size", patch_size, format!("must divide {what} ({side} for {})", data.dataset.name())));
        }
        self.nonzero("jepa.predictor_width", j.predictor_width)?;
        self.nonzero("jepa.predictor_depth", j.predictor_depth)?;
        self.nonzero("jepa.predictor_heads", j.predictor_heads)?;
        if !j.predictor_width.is_multiple_of(4) || !j.predictor_width.is_multiple_of(j.predictor_heads) {
            return Err(self.invalid("jepa.predictor_width", j.predictor_width, format!("must be a multiple of 4 and of jepa.predictor_heads ({})", j.predictor_heads)));
        }
        let grid = side / patch_size;
        let masks = rtx_tensor::nn::MaskConfig { n_targets: j.n_targets, target_scale: j.target_scale, target_aspect: j.target_aspect, context_scale: j.context_scale, min_keep: j.min_keep };
        masks.validate([grid, grid]).map_err(|e| self.invalid("jepa", "(masks)", e.to_string()))?;
        let (m0, m1) = j.ema_momentum;
        if !((0.0..=1.0).contains(&m0) && (0.0..=1.0).contains(&m1)) {
            return Err(self.invalid("jepa.ema_momentum", format!("[{m0}, {m1}]"), "both must lie in [0, 1]"));
        }
        if let Some(wd) = j.final_weight_decay {
            if !(wd.is_finite() && wd >= 0.0) {
                return Err(self.invalid("jepa.final_weight_decay", wd, "must be a finite number >= 0"));
            }
        }
        self.nonzero("jepa.probe_train_images", j.probe_train_images)?;
        self.nonzero("jepa.probe_test_images", j.probe_test_images)?;
        self.nonzero("jepa.probe_epochs", j.probe_epochs)?;
        for (key, n) in [("jepa.final_probe_train_images", j.final_probe_train_images), ("jepa.final_probe_test_images", j.final_probe_test_images)] {
            if let Some(n) = n {
                self.nonzero(key, n)?;
            }
        }
        self.nonzero("jepa.knn_k", j.knn_k)?;
        if j.probe_features.is_empty() {
            return Err(self.invalid("jepa.probe_features", "[]", format!("name at least one readout: {}", ProbeReadout::allowed())));
        }
        if let Some((i, r)) = j.probe_features.iter().enumerate().find(|(i, r)| j.probe_features[..*i].contains(r)) {
            return Err(self.invalid("jepa.probe_features", format!("\"{}\" (entry {})", r.name(), i + 1), "each readout at most once"));
        }
        Ok(Some(j))
    }

    /// `[video]` of a V-JEPA run on items of side `item`.
    fn video(&self, v: &VideoConfig, item: usize, patch_size: usize, d_model: usize, j: &JepaConfig) -> Result<(), ConfigError> {
        self.nonzero("video.tubelet", v.tubelet)?;
        self.nonzero("video.attentive_epochs", v.attentive_epochs)?;
        if v.frames < 2 || !v.frames.is_multiple_of(v.tubelet) {
            return Err(self.invalid("video.frames", v.frames, format!("must be at least 2 and a multiple of video.tubelet ({})", v.tubelet)));
        }
        if v.directions < 2 {
            return Err(self.invalid("video.directions", v.directions, "must be at least 2"));
        }
        let (lo, hi) = v.speed;
        if !(lo.is_finite() && hi.is_finite() && lo >= 0.0 && lo <= hi) {
            return Err(self.invalid("video.speed", format!("[{lo}, {hi}]"), "must be 0 <= lo <= hi pixels per frame"));
        }
        v.moving().validate([item, item]).map_err(|e| self.invalid("video.canvas", v.canvas, format!("too small for the motion: {e}")))?;
        if !v.canvas.is_multiple_of(patch_size) {
            return Err(self.invalid("model.patch_size", patch_size, format!("must divide video.canvas ({})", v.canvas)));
        }
        if v.frames / v.tubelet > 1 {
            if !d_model.is_multiple_of(8) {
                return Err(self.invalid("model.d_model", d_model, "must be a multiple of 8 for clips (3-D sin-cos positions)"));
            }
            if !j.predictor_width.is_multiple_of(8) {
                return Err(self.invalid("jepa.predictor_width", j.predictor_width, "must be a multiple of 8 for clips (3-D sin-cos positions)"));
            }
        }
        if let Some(r) = j.probe_features.iter().find(|r| matches!(r, ProbeReadout::Grid2 | ProbeReadout::Grid3)) {
            return Err(self.invalid("jepa.probe_features", format!("\"{}\"", r.name()), "region grids are image readouts; a V-JEPA run takes \"mean\", \"tokens\" or \"mean-last4\""));
        }
        Ok(())
    }

    fn optim(&self, o: RawOptim) -> Result<OptimConfig, ConfigError> {
        self.positive("optim.lr", o.lr)?;
        if !(o.weight_decay.is_finite() && o.weight_decay >= 0.0) {
            return Err(self.invalid("optim.weight_decay", o.weight_decay, "must be a finite number >= 0"));
        }
        if let Some(c) = o.grad_clip {
            self.positive("optim.grad_clip", c)?;
        }
        let kind = match o.kind {
            RawOptimKind::Sgd => {
                self.not_for("optim.betas", o.betas.is_some(), "optim.kind", "sgd", "adamw")?;
                self.not_for("optim.eps", o.eps.is_some(), "optim.kind", "sgd", "adamw")?;
                let momentum = o.momentum.unwrap_or(0.0);
                self.unit_open("optim.momentum", momentum, true)?;
                OptimKind::Sgd { momentum }
            }
            RawOptimKind::Adamw => {
                self.not_for("optim.momentum", o.momentum.is_some(), "optim.kind", "adamw", "sgd")?;
                let betas = o.betas.unwrap_or((0.9, 0.999));
                self.unit_open("optim.betas[0]", betas.0, true)?;
                self.unit_open("optim.betas[1]", betas.1, true)?;
                let eps = o.eps.unwrap_or(1e-8);
                self.positive("optim.eps", eps)?;
                OptimKind::AdamW { betas, eps }
            }
        };
        Ok(OptimConfig { kind, lr: o.lr, weight_decay: o.weight_decay, grad_clip: o.grad_clip })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MLP: &str = r#"
[model]
kind = "mlp"
hidden = [32]

[data]
dataset = "digits"
batch_size = 16

[optim]
kind = "adamw"
lr = 1e-3

[train]
steps = 10
"#;

    fn err(text: &str) -> String {
        match TrainConfig::from_toml_str(text) {
            Ok(_) => panic!("config should be rejected:\n{text}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn minimal_config_takes_defaults() {
        let c = TrainConfig::from_toml_str(MLP).expect("valid");
        assert_eq!(c.model, ModelConfig::Mlp { hidden: vec![32], activation: Activation::Relu });
        assert_eq!(c.data.val_fraction, 0.1);
        assert_eq!(c.optim.kind, OptimKind::AdamW { betas: (0.9, 0.999), eps: 1e-8 });
        assert_eq!(c.schedule, ScheduleConfig { warmup_steps: 0, total_steps: 10, min_lr: 1e-3, cosine: false });
        assert_eq!(c.train.log_every, 50);
        assert_eq!(c.default_output_dir(Some(Path::new("configs/x.toml"))), PathBuf::from("runs/x"));
    }

    #[test]
    fn unknown_keys_name_the_key_and_the_allowed_ones() {
        let e = err(&MLP.replace("hidden = [32]", "hiden = [32]"));
        assert!(e.contains("unknown field `hiden`") && e.contains("`hidden`") && e.contains("line"), "{e}");
        let e = err(&format!("{MLP}\n[extra]\nx = 1\n"));
        assert!(e.contains("unknown field `extra`"), "{e}");
    }

    #[test]
    fn bad_enum_values_list_the_choices() {
        let e = err(&MLP.replace("kind = \"mlp\"", "kind = \"cnn\""));
        assert!(e.contains("unknown variant `cnn`") && e.contains("`mlp`") && e.contains("`gpt`"), "{e}");
        let e = err(&MLP.replace("\"digits\"", "\"cifar\""));
        assert!(e.contains("unknown variant `cifar`") && e.contains("`fashion-mnist`"), "{e}");
    }

    #[test]
    fn out_of_range_values_name_the_key() {
        let e = err(&MLP.replace("lr = 1e-3", "lr = -1.0"));
        assert!(e.contains("`optim.lr` = -1") && e.contains("> 0"), "{e}");
        let e = err(&MLP.replace("batch_size = 16", "batch_size = 16\nval_fraction = 1.5"));
        assert!(e.contains("`data.val_fraction` = 1.5") && e.contains("(0, 1)"), "{e}");
        let e = err(&MLP.replace("hidden = [32]", "hidden = [32]\nn_heads = 4"));
        assert!(e.contains("`model.n_heads`") && e.contains("model.kind = \"gpt\""), "{e}");
        let e = err(&MLP.replace("\"digits\"", "\"sotu\""));
        assert!(e.contains("`data.dataset`") && e.contains("fashion-mnist"), "{e}");
        let e = err(&MLP.replace("lr = 1e-3", "lr = 1e-3\nmomentum = 0.9"));
        assert!(e.contains("`optim.momentum`") && e.contains("sgd"), "{e}");
    }

    const GPT_CUDA: &str = r#"
[model]
kind = "gpt"
n_layers = 2
d_model = 128
n_heads = 2
context = 16
[data]
dataset = "sotu"
batch_size = 4
[optim]
kind = "adamw"
lr = 1e-3
[train]
steps = 5
device = "cuda"
"#;

    #[test]
    fn device_and_precision_default_and_parse() {
        // Goal: the device keys are optional, default to the CPU in f32, and bf16 is the GPU's
        // default precision. Method: parse with and without them.
        let c = TrainConfig::from_toml_str(MLP).expect("valid");
        assert_eq!((c.train.device, c.precision()), (DeviceKind::Cpu, Precision::F32));
        let c = TrainConfig::from_toml_str(GPT_CUDA).expect("valid");
        assert_eq!((c.train.device, c.precision()), (DeviceKind::Cuda, Precision::Bf16));
        let c = TrainConfig::from_toml_str(&GPT_CUDA.replace("device = \"cuda\"", "device = \"cuda\"\nprecision = \"f32\"")).expect("valid");
        assert_eq!(c.precision(), Precision::F32);
    }

    #[test]
    fn device_combinations_the_gpu_cannot_train_are_rejected() {
        // Goal: every combination the GPU path does not support is a typed error naming the key.
        // Method: one bad value at a time.
        let e = err(&GPT_CUDA.replace("device = \"cuda\"", "device = \"tpu\""));
        assert!(e.contains("unknown variant `tpu`") && e.contains("`cpu`") && e.contains("`cuda`"), "{e}");
        let e = err(&GPT_CUDA.replace("device = \"cuda\"", "precision = \"bf16\""));
        assert!(e.contains("`train.precision`") && e.contains("cuda"), "{e}");
        let e = err(&GPT_CUDA.replace("device = \"cuda\"", "device = \"cuda\"\nprecision = \"fp8\""));
        assert!(e.contains("unknown variant `fp8`") && e.contains("`bf16`"), "{e}");
        let e = err(&GPT_CUDA.replace("context = 16", "context = 16\ndropout = 0.1"));
        assert!(e.contains("`model.dropout` = 0.1") && e.contains("cuda"), "{e}");
        let e = err(&GPT_CUDA.replace("n_heads = 2", "n_heads = 4"));
        assert!(e.contains("`model.n_heads` = 4") && e.contains("64 or 128") && e.contains("it is 32"), "{e}");
        let e = err(&GPT_CUDA.replace("kind = \"adamw\"", "kind = \"sgd\""));
        assert!(e.contains("`optim.kind`") && e.contains("adamw"), "{e}");
        let e = err(&MLP.replace("steps = 10", "steps = 10\ndevice = \"cuda\""));
        assert!(e.contains("`train.device`") && e.contains("gpt") && e.contains("ijepa") && e.contains("model.kind = \"mlp\" trains with train.device = \"cpu\""), "{e}");
    }

    /// An I-JEPA whose encoder and predictor have one head of 64 channels each.
    const IJEPA_CUDA: &str = r#"
[model]
kind = "ijepa"
patch_size = 2
d_model = 64
n_heads = 1
n_layers = 1
[jepa]
predictor_width = 64
predictor_heads = 1
[data]
dataset = "digits"
batch_size = 16
[optim]
kind = "adamw"
lr = 1e-3
[train]
steps = 5
device = "cuda"
"#;

    #[test]
    fn jepa_trains_on_the_gpu_within_its_kernels() {
        // Goal: I-JEPA and V-JEPA are accepted on the GPU with AdamW in either precision, and what
        // the GPU cannot run is a typed error naming the key (head dims of the encoder and the
        // predictor, SGD). Method: a valid GPU config, then one bad value at a time.
        for precision in ["", "precision = \"bf16\"", "precision = \"f32\""] {
            let c = TrainConfig::from_toml_str(&IJEPA_CUDA.replace("device = \"cuda\"", &format!("device = \"cuda\"\n{precision}"))).expect("valid");
            let want = if precision.contains("f32") { Precision::F32 } else { Precision::Bf16 };
            assert_eq!((c.train.device, c.precision()), (DeviceKind::Cuda, want));
        }
        let d128 = IJEPA_CUDA.replace("d_model = 64\nn_heads = 1", "d_model = 256\nn_heads = 2").replace("predictor_width = 64\npredictor_heads = 1", "predictor_width = 128\npredictor_heads = 2");
        TrainConfig::from_toml_str(&d128).expect("head dim 128");
        let vjepa = IJEPA_CUDA.replace("kind = \"ijepa\"", "kind = \"vjepa\"").replace("patch_size = 2", "patch_size = 4").replace("[jepa]", "[video]\ncanvas = 16\nframes = 4\ntubelet = 2\nspeed = [0.5, 1.0]\n[jepa]");
        let c = TrainConfig::from_toml_str(&vjepa).expect("vjepa on the GPU");
        assert!(matches!(&c.model, ModelConfig::IJepa { video: Some(_), .. }));
        let e = err(&IJEPA_CUDA.replace("n_heads = 1", "n_heads = 4"));
        assert!(e.contains("`model.n_heads` = 4") && e.contains("64 or 128") && e.contains("it is 16"), "{e}");
        let e = err(&IJEPA_CUDA.replace("predictor_heads = 1", "predictor_heads = 4"));
        assert!(e.contains("`jepa.predictor_heads` = 4") && e.contains("64 or 128") && e.contains("it is 16"), "{e}");
        let e = err(&IJEPA_CUDA.replace("kind = \"adamw\"", "kind = \"sgd\""));
        assert!(e.contains("`optim.kind`") && e.contains("adamw"), "{e}");
        let e = err(&vjepa.replace("n_heads = 1", "n_heads = 2"));
        assert!(e.contains("`model.n_heads` = 2") && e.contains("it is 32"), "{e}");
        let shipped = TrainConfig::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/ijepa_fashion_gpu.toml")).expect("configs/ijepa_fashion_gpu.toml");
        assert_eq!((shipped.train.device, shipped.precision()), (DeviceKind::Cuda, Precision::Bf16));
        // The same models train on the CPU whatever their head dims (the CPU attention takes any).
        TrainConfig::from_toml_str(&IJEPA_CUDA.replace("device = \"cuda\"", "").replace("n_heads = 1", "n_heads = 4")).expect("cpu");
    }

    const GPT: &str = r#"
[model]
kind = "gpt"
n_layers = 4
d_model = 32
n_heads = 4
context = 16
[data]
dataset = "sotu"
batch_size = 8
[optim]
kind = "adamw"
lr = 1e-3
[train]
steps = 5
"#;

    #[test]
    fn parallel_defaults_to_one_rank_and_parses() {
        // Goal: `[parallel]` is optional, defaults to plain DP, and takes every key.
        let c = TrainConfig::from_toml_str(GPT).expect("valid");
        assert_eq!(c.parallel, ParallelConfig::default());
        assert_eq!(c.mesh(3).expect("dp fills").shape(), rtx_pipelines::MeshShape { dp: 3, pp: 1, tp: 1 });
        let text = format!("{GPT}\n[parallel]\npp = 2\ntp = 2\nzero = 1\nmicrobatches = 4\nschedule = \"gpipe\"\nstage_layers = [3, 1]\n");
        let c = TrainConfig::from_toml_str(&text).expect("valid");
        assert_eq!((c.parallel.pp, c.parallel.tp, c.parallel.zero, c.parallel.microbatches), (2, 2, 1, 4));
        assert_eq!(c.parallel.stage_layers, Some(vec![3, 1]));
        assert_eq!(c.mesh(8).expect("fits").shape(), rtx_pipelines::MeshShape { dp: 2, pp: 2, tp: 2 });
    }

    #[test]
    fn parallel_errors_name_the_key_and_the_numbers() {
        // Goal: every `[parallel]` that cannot split the model, the batch or the world is a typed
        // error naming the key and the numbers. Method: one bad value at a time.
        let with = |body: &str| format!("{GPT}\n[parallel]\n{body}\n");
        let e = err(&with("tp = 3"));
        assert!(e.contains("`parallel.tp` = 3") && e.contains("attention heads (4)"), "{e}");
        let e = err(&with("pp = 3"));
        assert!(e.contains("`parallel.pp` = 3") && e.contains("4 layers"), "{e}");
        let e = err(&with("pp = 8"));
        assert!(e.contains("`parallel.pp` = 8") && e.contains("only 4 layers"), "{e}");
        let e = err(&with("pp = 2\nstage_layers = [4, 0]"));
        assert!(e.contains("`parallel.stage_layers` = [4, 0]") && e.contains("at least one layer"), "{e}");
        let e = err(&with("microbatches = 3"));
        assert!(e.contains("`parallel.microbatches` = 3") && e.contains("data.batch_size (8)"), "{e}");
        let e = err(&with("zero = 5"));
        assert!(e.contains("`parallel.zero` = 5"), "{e}");
        let e = err(&with("schedule = \"pipedream\""));
        assert!(e.contains("unknown variant `pipedream`") && e.contains("`1f1b`"), "{e}");
        let e = err(&with("tpp = 2"));
        assert!(e.contains("unknown field `tpp`"), "{e}");
        let e = err(&MLP.replace("steps = 10", "steps = 10\n[parallel]\npp = 2"));
        assert!(e.contains("`parallel.pp` = 2") && e.contains("GPT"), "{e}");
        let e = err(&MLP.replace("steps = 10", "steps = 10\n[parallel]\nmicrobatches = 5"));
        assert!(e.contains("`parallel.microbatches` = 5") && e.contains("data.batch_size (16)"), "{e}");
        // The world: known at launch.
        let c = TrainConfig::from_toml_str(&with("dp = 2\npp = 2\ntp = 2")).expect("valid alone");
        let e = c.mesh(4).unwrap_err().to_string();
        assert!(e.contains("2·2·2 = 8") && e.contains("world has 4") && e.contains("larger than the world"), "{e}");
        let c = TrainConfig::from_toml_str(&with("pp = 2\ntp = 2")).expect("valid alone");
        let e = c.mesh(6).unwrap_err().to_string();
        assert!(e.contains("does not divide 6"), "{e}");
        let e = c.mesh(2).unwrap_err().to_string();
        assert!(e.contains("= 4 ranks") && e.contains("world has 2"), "{e}");
    }

    #[test]
    fn tokenizer_defaults_to_bytes_and_gpt2_is_for_text_only() {
        // Goal: `[data] tokenizer` is optional (bytes, recorded exactly as before the key
        // existed), "gpt2" sets the model's vocabulary, and every misuse is a typed error naming
        // the key, the value and why. Method: parse inline configs, one change at a time.
        let bytes = TrainConfig::from_toml_str(GPT).expect("valid");
        assert_eq!(bytes.data.tokenizer, Tokenizer::Bytes);
        let data = serde_json::to_value(&bytes.data).expect("json");
        assert!(data.get("tokenizer").is_none(), "a byte run's [data] section changed: {data}");
        assert_eq!(bytes.model_layout().expect("gpt").vocab, 256);
        let explicit = TrainConfig::from_toml_str(&GPT.replace("batch_size = 8", "batch_size = 8\ntokenizer = \"bytes\"")).expect("valid");
        assert_eq!(explicit, bytes);

        let gpt2 = TrainConfig::from_toml_str(&GPT.replace("batch_size = 8", "batch_size = 8\ntokenizer = \"gpt2\"")).expect("valid");
        assert_eq!(gpt2.data.tokenizer, Tokenizer::Gpt2);
        assert_eq!((gpt2.data.tokenizer.vocab_size(), gpt2.data.tokenizer.padded_vocab()), (50_257, 50_304));
        assert_eq!(gpt2.model_layout().expect("gpt").vocab, 50_304);
        let data = serde_json::to_value(&gpt2.data).expect("json");
        assert_eq!(data.get("tokenizer").and_then(|t| t.as_str()), Some("gpt2"));

        let e = err(&GPT.replace("batch_size = 8", "batch_size = 8\ntokenizer = \"sentencepiece\""));
        assert!(e.contains("unknown variant `sentencepiece`") && e.contains("`bytes`") && e.contains("`gpt2`"), "{e}");
        let e = err(&MLP.replace("batch_size = 16", "batch_size = 16\ntokenizer = \"gpt2\""));
        assert!(e.contains("`data.tokenizer` = \"gpt2\"") && e.contains("\"digits\" is images"), "{e}");
        // Bytes on images is the default, so writing it is harmless.
        TrainConfig::from_toml_str(&MLP.replace("batch_size = 16", "batch_size = 16\ntokenizer = \"bytes\"")).expect("valid");
        let with_gpt2 = GPT.replace("batch_size = 8", "batch_size = 8\ntokenizer = \"gpt2\"");
        let e = err(&format!("{with_gpt2}\n[parallel]\npp = 2\n"));
        assert!(e.contains("`parallel.pp` = 2") && e.contains("gpt2") && e.contains("50304 rows"), "{e}");
        let e = err(&format!("{with_gpt2}\n[parallel]\ntp = 2\n"));
        assert!(e.contains("`parallel.tp` = 2"), "{e}");
        TrainConfig::from_toml_str(&format!("{with_gpt2}\n[parallel]\nzero = 1\n")).expect("data parallelism takes gpt2");
    }

    #[test]
    fn gpt_checks_heads_and_requires_its_keys() {
        let gpt = r#"
[model]
kind = "gpt"
n_layers = 2
d_model = 30
n_heads = 4
context = 16
[data]
dataset = "sotu"
batch_size = 4
[optim]
kind = "sgd"
lr = 0.1
[train]
steps = 5
"#;
        let e = err(gpt);
        assert!(e.contains("`model.n_heads` = 4") && e.contains("divide"), "{e}");
        let e = err(&gpt.replace("context = 16\n", ""));
        assert!(e.contains("`model.context`") && e.contains("required"), "{e}");
        let ok = TrainConfig::from_toml_str(&gpt.replace("d_model = 30", "d_model = 32")).expect("valid");
        assert!(matches!(ok.model, ModelConfig::Gpt { d_model: 32, .. }));
    }

    #[test]
    fn gelu_defaults_to_exact_and_every_shipped_gpt_config_keeps_tanh() {
        // Goal: `[model] gelu` is optional with PyTorch's exact default, "tanh" picks the GPT-2
        // form, another kind refuses the key, and each GPT config in configs/ names "tanh" (they
        // were tuned with it). Method: parse inline configs and every file in configs/.
        let gpt = "[model]\nkind = \"gpt\"\nn_layers = 1\nd_model = 8\nn_heads = 2\ncontext = 8\n[data]\ndataset = \"sotu\"\nbatch_size = 2\n[optim]\nkind = \"sgd\"\nlr = 0.1\n[train]\nsteps = 1\n";
        let exact = TrainConfig::from_toml_str(gpt).expect("valid");
        assert!(matches!(exact.model, ModelConfig::Gpt { gelu: Gelu::None, .. }));
        let tanh = TrainConfig::from_toml_str(&gpt.replace("context = 8", "context = 8\ngelu = \"tanh\"")).expect("valid");
        assert!(matches!(tanh.model, ModelConfig::Gpt { gelu: Gelu::Tanh, .. }));
        assert!(TrainConfig::from_toml_str(&gpt.replace("context = 8", "context = 8\ngelu = \"erf\"")).is_err());
        let mlp = "[model]\nkind = \"mlp\"\nhidden = [4]\ngelu = \"tanh\"\n[data]\ndataset = \"digits\"\nbatch_size = 2\n[optim]\nkind = \"sgd\"\nlr = 0.1\n[train]\nsteps = 1\n";
        assert!(err(mlp).contains("`model.gelu`"), "{}", err(mlp));
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
        let mut gpt_configs = 0;
        for entry in std::fs::read_dir(&dir).expect("configs/") {
            let path = entry.expect("entry").path();
            let text = std::fs::read_to_string(&path).expect("read");
            if path.extension().is_some_and(|e| e == "toml") && text.contains("kind = \"gpt\"") {
                let config = TrainConfig::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                assert!(matches!(config.model, ModelConfig::Gpt { gelu: Gelu::Tanh, .. }), "{} does not keep gelu = \"tanh\"", path.display());
                gpt_configs += 1;
            }
        }
        assert!(gpt_configs >= 6, "found {gpt_configs} GPT configs");
    }

    const IJEPA: &str = r#"
[model]
kind = "ijepa"
patch_size = 2
d_model = 16
n_layers = 2
n_heads = 2

[jepa]
predictor_width = 8
predictor_heads = 2

[data]
dataset = "digits"
batch_size = 16

[optim]
kind = "adamw"
lr = 1e-3

[train]
steps = 10
"#;

    fn readouts(text: &str) -> Vec<ProbeReadout> {
        TrainConfig::from_toml_str(text).expect("valid").jepa.expect("[jepa]").probe_features
    }

    #[test]
    fn probe_features_take_a_name_or_a_list() {
        assert_eq!(readouts(IJEPA), vec![ProbeReadout::Mean], "default: mean pooling");
        let one = IJEPA.replace("predictor_heads = 2", "predictor_heads = 2\nprobe_features = \"grid3\"");
        assert_eq!(readouts(&one), vec![ProbeReadout::Grid3]);
        let all = IJEPA.replace("predictor_heads = 2", "predictor_heads = 2\nprobe_features = [\"grid3\", \"mean\", \"grid2\", \"tokens\", \"mean-last4\"]");
        assert_eq!(readouts(&all), vec![ProbeReadout::Grid3, ProbeReadout::Mean, ProbeReadout::Grid2, ProbeReadout::Tokens, ProbeReadout::MeanLast4]);
        // The config's order is kept through serialisation (the run's config.json).
        let c = TrainConfig::from_toml_str(&all).expect("valid");
        let json = serde_json::to_string(&c.jepa).expect("json");
        assert!(json.contains(r#""probe_features":["grid3","mean","grid2","tokens","mean-last4"]"#), "{json}");
    }

    #[test]
    fn bad_probe_features_name_the_allowed_readouts() {
        let allowed = [r#""mean""#, r#""grid2""#, r#""grid3""#, r#""tokens""#, r#""mean-last4""#];
        for bad in [r#""grid4""#, r#"["mean", "Mean"]"#] {
            let text = IJEPA.replace("predictor_heads = 2", &format!("predictor_heads = 2\nprobe_features = {bad}"));
            let e = TrainConfig::from_toml_str(&text).expect_err("bad readout");
            assert!(matches!(e, ConfigError::Parse { .. }), "{e:?}");
            let msg = e.to_string();
            assert!(msg.contains("unknown probe readout") && msg.contains("jepa.probe_features") && allowed.iter().all(|a| msg.contains(a)), "{msg}");
        }
        let e = TrainConfig::from_toml_str(&IJEPA.replace("predictor_heads = 2", "predictor_heads = 2\nprobe_features = 3")).expect_err("a number");
        assert!(e.to_string().contains("a probe readout name or a list of them"), "{e}");
        let e = TrainConfig::from_toml_str(&IJEPA.replace("predictor_heads = 2", "predictor_heads = 2\nprobe_features = []")).expect_err("empty");
        assert!(matches!(&e, ConfigError::Invalid { key, .. } if key == "jepa.probe_features") && e.to_string().contains(r#""grid3""#), "{e}");
        let e = TrainConfig::from_toml_str(&IJEPA.replace("predictor_heads = 2", "predictor_heads = 2\nprobe_features = [\"grid3\", \"mean\", \"grid3\"]"))
            .expect_err("twice");
        assert!(matches!(&e, ConfigError::Invalid { key, .. } if key == "jepa.probe_features") && e.to_string().contains("entry 3"), "{e}");
    }
}
