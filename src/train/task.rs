//! The data side of a run: which dataset, its splits, and the seeded batch streams.
//!
//! Images: the training file is split into train/validation with
//! [`train_val_split`] (seeded by `train.seed`); the test split is the dataset's own test file
//! (Fashion-MNIST), or absent (digits: the final evaluation is on validation). Pixels are
//! normalized with the mean and standard deviation of the training part. Batches come from a
//! [`Sampler`] whose [`Cursor`] is saved in checkpoints.
//!
//! Clips (V-JEPA, `model.kind = "vjepa"`): the same splits and sampler, but every row is a clip
//! of its item moving across a canvas ([`rtx_tensor::data::MovingConfig`]), made when the batch is:
//! a training row from `(train.seed, item index in the train split, epoch)` on the train clip
//! stream, so each epoch shows an item moving differently; a validation, test or probe row from a
//! fixed epoch ([`EVAL_EPOCH`], [`PROBE_EPOCH`]), so every evaluation scores the same clips.
//! Clip pixels are normalized with the mean and standard deviation a clip of the training items
//! has (the items' statistics diluted by the blank canvas).
//!
//! Text: the tail `val_fraction` of every document is validation; batch `k` is
//! [`TextWindowSampler::batch`]`(train, k)`, so the step number is the whole cursor. The tokens
//! depend on `[data] tokenizer`:
//! - `"bytes"`: the corpus is split with [`TextCorpus::train_val_split`] (the cut moved to a
//!   character boundary) and each split's bytes are the tokens, nothing between documents.
//! - `"gpt2"`: the whole corpus is tokenized once by [`tokenize_corpus_cached`] into
//!   `<data>/sotu/gpt2-tokens.bin` (each document encoded on its own and followed by
//!   `<|endoftext|>`; later runs read the cache, rebuilt when the text changed or the file is
//!   damaged).
//!
//! **Decision:** with GPT-2 tokens the split is made on each document's tokens, not on its
//! bytes: document `d`'s `n` tokens are cut at `round(n · (1 − val_fraction))`, the same rule
//! the bytes use, counted in tokens. Every piece (a document's head in train, its tail in
//! validation) is followed by [`GPT2_EOT`], so documents stay apart in both streams as in
//! GPT-2's training data, and no window reads from one speech into the next without the
//! separator. Cutting token lists keeps one tokenization of the corpus, the cached one:
//! splitting the bytes first and encoding each split would need a cache per split and
//! `val_fraction`, and would encode the words at the cut differently from the whole text. Cost:
//! a head piece in train ends with `<|endoftext|>` although its speech goes on in validation.
//!
//! The unigram entropy printed beside the loss is over the unit the model predicts: bytes, or
//! GPT-2 tokens of the whole stream (`<|endoftext|>` included), in nats per byte or per token.

use rtx_tensor::data::{
    load_digits_csv, load_fashion_mnist, tokenize_corpus_cached, train_val_split, ClipKey, Cursor, DataError, DataRoot, ImageDataset, MovingConfig, Sampler,
    Split, TextBatch, TextCorpus, TextWindowSampler, GPT2_EOT, GPT2_VOCAB, TEST_CLIP_STREAM, TRAIN_CLIP_STREAM,
};
use rtx_tensor::nn::JepaMasks;
use rtx_tensor::Tensor;

use crate::config::{Dataset, ModelConfig, Tokenizer, TrainConfig};

use super::{Result, TrainError};

/// The GPT-2 token cache's file name inside the corpus folder.
pub(crate) const GPT2_CACHE_FILE: &str = "gpt2-tokens.bin";

/// The epoch of validation and test clips.
pub(crate) const EVAL_EPOCH: u64 = u64::MAX;
/// The epoch of the probes' training clips.
pub(crate) const PROBE_EPOCH: u64 = u64::MAX - 1;

/// Images of one split, ready to batch.
pub(crate) struct ImageSplits {
    pub(crate) train: ImageDataset,
    pub(crate) val: ImageDataset,
    pub(crate) test: Option<ImageDataset>,
    pub(crate) mean: f32,
    pub(crate) std: f32,
    pub(crate) sampler: Sampler,
    /// The clips every row becomes (V-JEPA); `None` for images.
    pub(crate) clips: Option<ClipSource>,
}

/// How a V-JEPA run turns items into clips.
pub(crate) struct ClipSource {
    pub(crate) moving: MovingConfig,
    /// The run seed.
    pub(crate) seed: u64,
    /// Normalization of clip pixels (see the module docs).
    pub(crate) mean: f32,
    pub(crate) std: f32,
}

/// Which clip stream a set's rows come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ClipSplit {
    /// The training split (train clip stream).
    Train,
    /// Validation or test (held-out clip stream).
    HeldOut,
}

/// A text corpus split for language modelling.
pub(crate) struct TextSplits {
    /// How the text became tokens.
    pub(crate) tokenizer: Tokenizer,
    pub(crate) train: Tokens,
    pub(crate) val: Tokens,
    /// Unigram entropy of the whole corpus in nats per token (per byte for bytes).
    pub(crate) entropy_nats: f64,
    pub(crate) corpus_bytes: usize,
    /// Tokens of the whole corpus (its bytes for bytes; with every `<|endoftext|>` for GPT-2).
    pub(crate) corpus_tokens: usize,
    pub(crate) sampler: TextWindowSampler,
    pub(crate) eval_sampler: TextWindowSampler,
}

/// One split's token stream: bytes as they are (the byte tokenizer), or token ids.
pub(crate) enum Tokens {
    Bytes(Vec<u8>),
    Ids(Vec<u32>),
}

impl Tokens {
    /// Tokens in the stream.
    pub(crate) fn len(&self) -> usize {
        match self {
            Tokens::Bytes(b) => b.len(),
            Tokens::Ids(t) => t.len(),
        }
    }

    /// The training batch of `step` (bytes widen to the same `u32` values as before ids existed).
    pub(crate) fn batch(&self, sampler: &TextWindowSampler, step: u64) -> rtx_tensor::data::Result<TextBatch> {
        match self {
            Tokens::Bytes(b) => sampler.batch(b, step),
            Tokens::Ids(t) => sampler.batch(t, step),
        }
    }

    /// Validation batch `i`, `None` past the end.
    pub(crate) fn eval_batch(&self, sampler: &TextWindowSampler, i: usize) -> Option<TextBatch> {
        match self {
            Tokens::Bytes(b) => sampler.eval_batch(b, i),
            Tokens::Ids(t) => sampler.eval_batch(t, i),
        }
    }
}

/// The task's data.
pub(crate) enum TaskData {
    Image(Box<ImageSplits>),
    Text(Box<TextSplits>),
}

/// One training or evaluation batch as tensors.
pub(crate) struct Batch {
    /// `[B, features]` f32 pixels, or `[B, T]` u32 byte ids.
    pub(crate) inputs: Tensor,
    /// `[B]` or `[B, T]` u32 targets.
    pub(crate) targets: Tensor,
    /// Samples (images or windows) in the batch.
    pub(crate) rows: usize,
    /// Tokens in the batch (`rows * T`; `rows` for images).
    pub(crate) tokens: usize,
    /// The I-JEPA masks of these rows (`None` for other models).
    pub(crate) masks: Option<JepaMasks>,
}

impl TaskData {
    /// Loads the dataset of `config` from `root`.
    pub(crate) fn load(config: &TrainConfig, root: &DataRoot, context: Option<usize>) -> Result<TaskData> {
        let seed = config.train.seed;
        let d = &config.data;
        match d.dataset {
            Dataset::FashionMnist | Dataset::Digits => {
                let (full, test) = if d.dataset == Dataset::FashionMnist {
                    let dir = root.fashion_mnist();
                    (load_fashion_mnist(&dir, Split::Train)?, Some(load_fashion_mnist(&dir, Split::Test)?))
                } else {
                    (load_digits_csv(&root.digits_csv())?, None)
                };
                let (train_idx, val_idx) = train_val_split(full.n, d.val_fraction, seed)?;
                let train = full.subset(&train_idx);
                let val = full.subset(&val_idx);
                let (mean, std) = train.pixel_mean_std();
                let std = if std > 0.0 { std } else { 1.0 };
                let sampler = Sampler::new(train.n, d.batch_size, seed, false)?;
                let clips = match &config.model {
                    ModelConfig::IJepa { video: Some(v), .. } => {
                        let moving = v.moving();
                        moving.validate([train.height, train.width])?;
                        let (m, sd) = moving.pixel_mean_std([train.height, train.width], mean, std);
                        Some(ClipSource { moving, seed, mean: m, std: if sd > 0.0 { sd } else { 1.0 } })
                    }
                    _ => None,
                };
                Ok(TaskData::Image(Box::new(ImageSplits { train, val, test, mean, std, sampler, clips })))
            }
            Dataset::Sotu => {
                let corpus = TextCorpus::load_dir(&root.sotu())?;
                let seq_len = context.ok_or_else(|| TrainError::Internal("text data needs the model context".into()))?;
                let (train, val, entropy_nats, corpus_tokens) = match d.tokenizer {
                    Tokenizer::Bytes => {
                        let (train, val) = corpus.train_val_split(d.val_fraction)?;
                        (Tokens::Bytes(train.bytes().to_vec()), Tokens::Bytes(val.bytes().to_vec()), corpus.unigram_entropy_nats(), corpus.len())
                    }
                    Tokenizer::Gpt2 => {
                        let tokens = tokenize_corpus_cached(&corpus, &root.sotu().join(GPT2_CACHE_FILE))?;
                        let (train, val) = split_document_tokens(&tokens, corpus.documents().len(), d.val_fraction)?;
                        (Tokens::Ids(train), Tokens::Ids(val), unigram_entropy_nats(&tokens, GPT2_VOCAB), tokens.len())
                    }
                };
                let unit = d.tokenizer.unit();
                let sampler = TextWindowSampler::new(d.batch_size, seq_len, seed)?;
                let eval_sampler = TextWindowSampler::new(d.batch_size, seq_len, seed)?;
                // Fail here, not at step 0, when the corpus is shorter than one window.
                train.batch(&sampler, 0)?;
                if eval_sampler.n_eval_batches(val.len()) == 0 {
                    return Err(TrainError::Data(DataError::Empty {
                        what: format!(
                            "validation text of {} {unit}s at data.val_fraction {}: shorter than one window of model.context + 1 = {} {unit}s",
                            val.len(),
                            d.val_fraction,
                            seq_len + 1
                        ),
                    }));
                }
                Ok(TaskData::Text(Box::new(TextSplits {
                    tokenizer: d.tokenizer,
                    train,
                    val,
                    entropy_nats,
                    corpus_bytes: corpus.len(),
                    corpus_tokens,
                    sampler,
                    eval_sampler,
                })))
            }
        }
    }

    /// Pixels per image (the MLP's input width), or `None` for text.
    pub(crate) fn input_features(&self) -> Option<usize> {
        match self {
            TaskData::Image(s) => Some(s.train.pixels_per_image()),
            TaskData::Text(_) => None,
        }
    }

    /// Classes (the MLP's output width), or the tokenizer's vocabulary (256 for bytes).
    pub(crate) fn n_classes(&self) -> usize {
        match self {
            TaskData::Image(s) => s.train.n_classes.max(s.val.n_classes).max(s.test.as_ref().map_or(0, |t| t.n_classes)),
            TaskData::Text(s) => s.tokenizer.vocab_size(),
        }
    }

    /// The token table's padding multiple (`nn::GptConfig::vocab_pad_multiple`; 1 for images).
    pub(crate) fn vocab_pad_multiple(&self) -> usize {
        match self {
            TaskData::Image(_) => 1,
            TaskData::Text(s) => s.tokenizer.vocab_pad_multiple(),
        }
    }

    /// The training batch of `step` (images advance the sampler; text is a function of `step`).
    pub(crate) fn train_batch(&mut self, step: u64) -> Result<Batch> {
        match self {
            TaskData::Image(s) => {
                let idx = s.sampler.next_batch();
                let epoch = s.sampler.cursor().epoch;
                Ok(s.rows(&s.train, &idx, ClipSplit::Train, epoch)?.0)
            }
            TaskData::Text(s) => {
                let b = s.train.batch(&s.sampler, step)?;
                text_batch(b)
            }
        }
    }

    /// The sampler position to checkpoint (`None` for text: the step is the cursor).
    pub(crate) fn cursor(&self) -> Option<Cursor> {
        match self {
            TaskData::Image(s) => Some(s.sampler.cursor()),
            TaskData::Text(_) => None,
        }
    }

    /// Restores a checkpointed sampler position.
    pub(crate) fn restore(&mut self, cursor: Option<Cursor>) -> Result<()> {
        match (self, cursor) {
            (TaskData::Image(s), Some(c)) => Ok(s.sampler.restore(c)?),
            (TaskData::Image(_), None) => Err(TrainError::Resume("the checkpoint has no data cursor for an image dataset".into())),
            (TaskData::Text(_), _) => Ok(()),
        }
    }

    /// Evaluation batch `i` of the validation (or test) split, `None` past the end.
    pub(crate) fn eval_batch(&self, which: EvalSplit, i: usize, image_batch_size: usize) -> Result<Option<Batch>> {
        match self {
            TaskData::Image(s) => {
                let set = match which {
                    EvalSplit::Val => &s.val,
                    EvalSplit::Test => match &s.test {
                        Some(t) => t,
                        None => return Ok(None),
                    },
                };
                let start = i * image_batch_size;
                if start >= set.n {
                    return Ok(None);
                }
                let idx: Vec<usize> = (start..(start + image_batch_size).min(set.n)).collect();
                Ok(Some(s.rows(set, &idx, ClipSplit::HeldOut, EVAL_EPOCH)?.0))
            }
            TaskData::Text(s) => match which {
                EvalSplit::Val => s.val.eval_batch(&s.eval_sampler, i).map(text_batch).transpose(),
                EvalSplit::Test => Ok(None),
            },
        }
    }

    /// Number of evaluation batches of a split.
    pub(crate) fn n_eval_batches(&self, which: EvalSplit, image_batch_size: usize) -> usize {
        match (self, which) {
            (TaskData::Image(s), EvalSplit::Val) => s.val.n.div_ceil(image_batch_size),
            (TaskData::Image(s), EvalSplit::Test) => s.test.as_ref().map_or(0, |t| t.n.div_ceil(image_batch_size)),
            (TaskData::Text(s), EvalSplit::Val) => s.eval_sampler.n_eval_batches(s.val.len()),
            (TaskData::Text(_), EvalSplit::Test) => 0,
        }
    }

    /// Image `[height, width]`, or `None` for text.
    pub(crate) fn image_size(&self) -> Option<[usize; 2]> {
        match self {
            TaskData::Image(s) => Some([s.train.height, s.train.width]),
            TaskData::Text(_) => None,
        }
    }

    /// The image splits, if this is an image task.
    pub(crate) fn images(&self) -> Option<&ImageSplits> {
        match self {
            TaskData::Image(s) => Some(s),
            TaskData::Text(_) => None,
        }
    }

    /// Whether a test split exists.
    pub(crate) fn has_test(&self) -> bool {
        matches!(self, TaskData::Image(s) if s.test.is_some())
    }

    /// The text splits, if this is a text task.
    pub(crate) fn text(&self) -> Option<&TextSplits> {
        match self {
            TaskData::Text(s) => Some(s),
            TaskData::Image(_) => None,
        }
    }

    /// A one-line description for the log.
    pub(crate) fn describe(&self) -> String {
        match self {
            TaskData::Image(s) => format!(
                "{} train / {} val{} images of {}x{}, {} classes, {} batches per epoch{}",
                s.train.n,
                s.val.n,
                s.test.as_ref().map_or(String::new(), |t| format!(" / {} test", t.n)),
                s.train.height,
                s.train.width,
                self.n_classes(),
                s.sampler.batches_per_epoch(),
                s.clips.as_ref().map_or(String::new(), |c| format!(
                    ", as clips of {} frames on a {}x{} canvas moving in {} directions at {}-{} px/frame",
                    c.moving.frames, c.moving.canvas, c.moving.canvas, c.moving.directions, c.moving.speed.0, c.moving.speed.1
                ))
            ),
            TaskData::Text(s) => match s.tokenizer {
                Tokenizer::Bytes => format!("{} bytes ({} train / {} val), windows of {}", s.corpus_bytes, s.train.len(), s.val.len(), s.sampler.seq_len()),
                Tokenizer::Gpt2 => format!(
                    "{} bytes as {} GPT-2 tokens ({} train / {} val), windows of {} tokens",
                    s.corpus_bytes,
                    s.corpus_tokens,
                    s.train.len(),
                    s.val.len(),
                    s.sampler.seq_len()
                ),
            },
        }
    }
}

/// Which held-out split to evaluate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EvalSplit {
    Val,
    Test,
}

impl ImageSplits {
    /// Rows `idx` of `set` as a batch: the images, or (V-JEPA) their clips of `epoch` on `split`'s
    /// stream, `[B, frames·canvas²]` normalized pixels, with the clips' direction labels.
    pub(crate) fn rows(&self, set: &ImageDataset, idx: &[usize], split: ClipSplit, epoch: u64) -> Result<(Batch, Option<Vec<u32>>)> {
        let Some(c) = &self.clips else { return Ok((image_batch(set, idx, self.mean, self.std)?, None)) };
        let stream = match split {
            ClipSplit::Train => TRAIN_CLIP_STREAM,
            ClipSplit::HeldOut => TEST_CLIP_STREAM,
        };
        let per_clip = c.moving.pixels_per_clip();
        let scale = 1.0 / (f32::from(set.pixel_max) * c.std);
        let shift = c.mean / c.std;
        let table: Vec<f32> = (0..=255u8).map(|v| f32::from(v) * scale - shift).collect();
        let mut pixels = Vec::with_capacity(idx.len() * per_clip);
        let mut directions = Vec::with_capacity(idx.len());
        let mut labels = Vec::with_capacity(idx.len());
        for &i in idx {
            let clip = c.moving.clip(set.image(i), [set.height, set.width], ClipKey { seed: c.seed, stream, index: i as u64, epoch })?;
            pixels.extend(clip.pixels.iter().map(|&p| table[usize::from(p)]));
            directions.push(clip.direction);
            labels.push(set.labels[i]);
        }
        let rows = idx.len();
        debug_assert_eq!(pixels.len(), rows * per_clip);
        let batch = Batch { inputs: Tensor::from_vec(pixels, &[rows, per_clip])?, targets: Tensor::from_vec(labels, &[rows])?, rows, tokens: rows, masks: None };
        Ok((batch, Some(directions)))
    }
}

pub(crate) fn image_batch(set: &ImageDataset, idx: &[usize], mean: f32, std: f32) -> Result<Batch> {
    let b = set.batch(idx, mean, std);
    let rows = b.batch_size;
    let inputs = Tensor::from_vec(b.pixels, &[rows, b.height * b.width])?;
    let targets = Tensor::from_vec(b.labels, &[rows])?;
    Ok(Batch { inputs, targets, rows, tokens: rows, masks: None })
}

/// Splits the token stream of a corpus of `n_documents` documents (each followed by
/// [`GPT2_EOT`], as [`tokenize_corpus_cached`] makes it) into `(train, val)`: document `d`'s
/// `n` tokens are cut at `round(n · (1 − val_fraction))` and each non-empty piece is followed by
/// [`GPT2_EOT`] (module docs). Both sides must hold tokens.
pub(crate) fn split_document_tokens(tokens: &[u32], n_documents: usize, val_fraction: f64) -> Result<(Vec<u32>, Vec<u32>)> {
    if !(val_fraction > 0.0 && val_fraction < 1.0) {
        return Err(TrainError::Data(DataError::BadArgument { reason: format!("val_fraction {val_fraction} must lie in (0, 1)") }));
    }
    let documents: Vec<&[u32]> = tokens.split_inclusive(|&t| t == GPT2_EOT).collect();
    if documents.len() != n_documents || documents.last().is_some_and(|d| d.last() != Some(&GPT2_EOT)) {
        return Err(TrainError::Internal(format!(
            "the GPT-2 token stream holds {} end-of-text-terminated documents; the corpus has {n_documents}",
            documents.len()
        )));
    }
    let (mut train, mut val) = (Vec::with_capacity(tokens.len()), Vec::with_capacity(tokens.len() / 8));
    for document in documents {
        let body = &document[..document.len() - 1];
        let cut = (((body.len() as f64) * (1.0 - val_fraction)).round() as usize).min(body.len());
        for (side, piece) in [(&mut train, &body[..cut]), (&mut val, &body[cut..])] {
            if !piece.is_empty() {
                side.extend_from_slice(piece);
                side.push(GPT2_EOT);
            }
        }
    }
    for (side, split) in [("train", &train), ("validation", &val)] {
        if split.is_empty() {
            return Err(TrainError::Data(DataError::Empty { what: format!("{side} split of {} GPT-2 tokens at val_fraction {val_fraction}", tokens.len()) }));
        }
    }
    Ok((train, val))
}

/// Shannon entropy of the token distribution of `tokens` (ids below `vocab`), in nats per token
/// (0 for no tokens).
pub(crate) fn unigram_entropy_nats(tokens: &[u32], vocab: usize) -> f64 {
    let mut counts = vec![0u64; vocab];
    for &t in tokens {
        if let Some(c) = counts.get_mut(t as usize) {
            *c += 1;
        }
    }
    let total = counts.iter().sum::<u64>() as f64;
    counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = c as f64 / total;
            -p * p.ln()
        })
        .sum()
}

pub(crate) fn text_batch(b: TextBatch) -> Result<Batch> {
    let (rows, t) = (b.batch_size, b.seq_len);
    let inputs = Tensor::from_vec(b.inputs, &[rows, t])?;
    let targets = Tensor::from_vec(b.targets, &[rows, t])?;
    Ok(Batch { inputs, targets, rows, tokens: rows * t, masks: None })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn document_tokens_split_per_document_tail_with_end_of_text_after_every_piece() {
        // Goal: the GPT-2 split follows the byte rule (the tail of every document, cut at
        // round(n·(1 − f)) tokens), each piece ends with <|endoftext|>, empty pieces are left out,
        // and a stream that does not match the corpus's documents is refused.
        let e = GPT2_EOT;
        let tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, e, 11, 12, e, 13, e];
        let (train, val) = split_document_tokens(&tokens, 3, 0.2).unwrap();
        // 10 tokens: cut at 8; 2 tokens: cut at round(1.6) = 2 (no validation piece); 1 token: cut at 1.
        assert_eq!(train, vec![1, 2, 3, 4, 5, 6, 7, 8, e, 11, 12, e, 13, e]);
        assert_eq!(val, vec![9, 10, e]);
        let (train, val) = split_document_tokens(&tokens, 3, 0.5).unwrap();
        assert_eq!(train, vec![1, 2, 3, 4, 5, e, 11, e, 13, e]);
        assert_eq!(val, vec![6, 7, 8, 9, 10, e, 12, e]);
        assert!(matches!(split_document_tokens(&tokens, 2, 0.2), Err(TrainError::Internal(_))));
        assert!(matches!(split_document_tokens(&tokens[..15], 3, 0.2), Err(TrainError::Internal(_))));
        assert!(matches!(split_document_tokens(&[1, e], 1, 0.2), Err(TrainError::Data(DataError::Empty { .. }))));
        assert!(matches!(split_document_tokens(&tokens, 3, 1.0), Err(TrainError::Data(DataError::BadArgument { .. }))));
    }

    #[test]
    fn byte_runs_get_the_byte_windows_and_model_of_before() {
        // Goal: `tokenizer = "bytes"` (the default) is today's run: the batches are the windows
        // the byte sampler draws from the byte split (u8 in, the same u32 tensors out), the model
        // has a 256-row table, and its fused loss equals the unfused head + cross-entropy.
        // Method: configs/sotu_gpt.toml on the real SOTU corpus against the byte sampler called
        // on the byte split directly, and a pinned window.
        use crate::train::model::Model;
        use rtx_tensor::{CrossEntropyOptions, DType, Generator, Reduction};
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let config = TrainConfig::load(&root.join("configs/sotu_gpt.toml")).unwrap();
        assert_eq!(config.data.tokenizer, Tokenizer::Bytes);
        let data_root = DataRoot::new(root.join("data"));
        let mut data = TaskData::load(&config, &data_root, Some(128)).unwrap();
        let corpus = TextCorpus::load_dir(&data_root.sotu()).unwrap();
        let (train, val) = corpus.train_val_split(config.data.val_fraction).unwrap();
        let sampler = TextWindowSampler::new(16, 128, 0).unwrap();
        for step in [0, 1, 499] {
            let batch = data.train_batch(step).unwrap();
            let old = sampler.batch(train.bytes(), step).unwrap();
            assert_eq!((batch.inputs.dtype(), batch.inputs.shape(), batch.targets.shape()), (DType::U32, &[16, 128][..], &[16, 128][..]));
            assert_eq!(batch.inputs.to_u32_vec().unwrap(), old.inputs, "step {step}");
            assert_eq!(batch.targets.to_u32_vec().unwrap(), old.targets, "step {step}");
        }
        let n_eval = data.n_eval_batches(EvalSplit::Val, 1);
        assert_eq!(n_eval, sampler.n_eval_batches(val.len()));
        for i in [0, n_eval - 1] {
            let batch = data.eval_batch(EvalSplit::Val, i, 1).unwrap().unwrap();
            assert_eq!(batch.inputs.to_u32_vec().unwrap(), sampler.eval_batch(val.bytes(), i).unwrap().inputs);
        }
        assert_eq!(data.n_classes(), 256);
        assert_eq!(data.vocab_pad_multiple(), 1);
        assert!(data.describe().starts_with(&format!("{} bytes (", corpus.len())), "{}", data.describe());

        let model = Model::for_config(&config, &data, &mut Generator::new(0)).unwrap();
        let Model::Gpt(gpt) = &model else { panic!("a GPT") };
        assert_eq!(gpt.tok_emb.weight.shape(), &[256, 128]);
        let batch = data.train_batch(0).unwrap();
        let mut rng = Generator::new(1);
        let fused = model.loss(&batch, &mut rng, Reduction::Mean, false).unwrap().loss.item().unwrap();
        let logits = gpt.forward(&batch.inputs, &mut rng).unwrap();
        let unfused = logits.cross_entropy(&batch.targets, CrossEntropyOptions::default()).unwrap().item().unwrap();
        assert!((fused - unfused).abs() < 1e-5 * unfused, "fused {fused} vs unfused {unfused}");
    }

    #[test]
    fn token_unigram_entropy_matches_the_byte_formula() {
        // Goal: the per-token entropy is the same quantity as the corpus's per-byte one, in nats.
        let bytes = b"the state of the union is strong".to_vec();
        let ids: Vec<u32> = bytes.iter().map(|&b| u32::from(b)).collect();
        let corpus = TextCorpus::from_documents([("a.txt", bytes)]);
        assert!((unigram_entropy_nats(&ids, 256) - corpus.unigram_entropy_nats()).abs() < 1e-12);
        assert!((unigram_entropy_nats(&[7, 9, 7, 9], GPT2_VOCAB) - std::f64::consts::LN_2).abs() < 1e-12);
        assert_eq!(unigram_entropy_nats(&[], GPT2_VOCAB), 0.0);
    }
}
