//! The data side of a run: which dataset, its splits, and the seeded batch streams.
//!
//! Images: the training file is split into train/validation with
//! [`train_val_split`] (seeded by `train.seed`); the test split is the dataset's own test file
//! (Fashion-MNIST), or absent (digits: the final evaluation is on validation). Pixels are
//! normalized with the mean and standard deviation of the training part. Batches come from a
//! [`Sampler`] whose [`Cursor`] is saved in checkpoints.
//!
//! Text: the corpus is split with [`TextCorpus::train_val_split`] (the tail of every document
//! is validation); batch `k` is [`TextWindowSampler::batch`]`(train, k)`, so the step number is
//! the whole cursor.

use rtx_tensor::data::{load_digits_csv, load_fashion_mnist, train_val_split, Cursor, DataRoot, ImageDataset, Sampler, Split, TextCorpus, TextWindowSampler};
use rtx_tensor::nn::JepaMasks;
use rtx_tensor::Tensor;

use crate::config::{Dataset, TrainConfig};

use super::{Result, TrainError};

/// Images of one split, ready to batch.
pub(crate) struct ImageSplits {
    pub(crate) train: ImageDataset,
    pub(crate) val: ImageDataset,
    pub(crate) test: Option<ImageDataset>,
    pub(crate) mean: f32,
    pub(crate) std: f32,
    pub(crate) sampler: Sampler,
}

/// A text corpus split for language modelling.
pub(crate) struct TextSplits {
    pub(crate) train: Vec<u8>,
    pub(crate) val: Vec<u8>,
    /// Unigram entropy of the whole corpus in nats per byte.
    pub(crate) entropy_nats: f64,
    pub(crate) corpus_bytes: usize,
    pub(crate) sampler: TextWindowSampler,
    pub(crate) eval_sampler: TextWindowSampler,
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
                Ok(TaskData::Image(Box::new(ImageSplits { train, val, test, mean, std, sampler })))
            }
            Dataset::Sotu => {
                let corpus = TextCorpus::load_dir(&root.sotu())?;
                let entropy_nats = corpus.unigram_entropy_nats();
                let (train, val) = corpus.train_val_split(d.val_fraction)?;
                let seq_len = context.ok_or_else(|| TrainError::Internal("text data needs the model context".into()))?;
                let sampler = TextWindowSampler::new(d.batch_size, seq_len, seed)?;
                let eval_sampler = TextWindowSampler::new(d.batch_size, seq_len, seed)?;
                // Fail here, not at step 0, when the corpus is shorter than one window.
                sampler.batch(train.bytes(), 0)?;
                if eval_sampler.n_eval_batches(val.len()) == 0 {
                    return Err(TrainError::Data(rtx_tensor::data::DataError::Empty { what: format!("validation text of {} bytes at data.val_fraction {}: shorter than one window of model.context + 1 = {} bytes", val.len(), d.val_fraction, seq_len + 1) }));
                }
                Ok(TaskData::Text(Box::new(TextSplits { train: train.bytes().to_vec(), val: val.bytes().to_vec(), entropy_nats, corpus_bytes: corpus.len(), sampler, eval_sampler })))
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

    /// Classes (the MLP's output width), or 256 for bytes.
    pub(crate) fn n_classes(&self) -> usize {
        match self {
            TaskData::Image(s) => s.train.n_classes.max(s.val.n_classes).max(s.test.as_ref().map_or(0, |t| t.n_classes)),
            TaskData::Text(_) => 256,
        }
    }

    /// The training batch of `step` (images advance the sampler; text is a function of `step`).
    pub(crate) fn train_batch(&mut self, step: u64) -> Result<Batch> {
        match self {
            TaskData::Image(s) => {
                let idx = s.sampler.next_batch();
                image_batch(&s.train, &idx, s.mean, s.std)
            }
            TaskData::Text(s) => {
                let b = s.sampler.batch(&s.train, step)?;
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
                image_batch(set, &idx, s.mean, s.std).map(Some)
            }
            TaskData::Text(s) => match which {
                EvalSplit::Val => s.eval_sampler.eval_batch(&s.val, i).map(text_batch).transpose(),
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
                "{} train / {} val{} images of {}x{}, {} classes, {} batches per epoch",
                s.train.n,
                s.val.n,
                s.test.as_ref().map_or(String::new(), |t| format!(" / {} test", t.n)),
                s.train.height,
                s.train.width,
                self.n_classes(),
                s.sampler.batches_per_epoch()
            ),
            TaskData::Text(s) => format!("{} bytes ({} train / {} val), windows of {}", s.corpus_bytes, s.train.len(), s.val.len(), s.sampler.seq_len()),
        }
    }
}

/// Which held-out split to evaluate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EvalSplit {
    Val,
    Test,
}

pub(crate) fn image_batch(set: &ImageDataset, idx: &[usize], mean: f32, std: f32) -> Result<Batch> {
    let b = set.batch(idx, mean, std);
    let rows = b.batch_size;
    let inputs = Tensor::from_vec(b.pixels, &[rows, b.height * b.width])?;
    let targets = Tensor::from_vec(b.labels, &[rows])?;
    Ok(Batch { inputs, targets, rows, tokens: rows, masks: None })
}

pub(crate) fn text_batch(b: rtx_tensor::data::TextBatch) -> Result<Batch> {
    let (rows, t) = (b.batch_size, b.seq_len);
    let inputs = Tensor::from_vec(b.inputs, &[rows, t])?;
    let targets = Tensor::from_vec(b.targets, &[rows, t])?;
    Ok(Batch { inputs, targets, rows, tokens: rows * t, masks: None })
}
