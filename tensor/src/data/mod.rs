//! Dataset readers and deterministic loaders: plain bytes and indices in, no `Tensor` type needed.
//!
//! The data itself is never downloaded here. `scripts/fetch-data.sh` installs pinned copies
//! into a data folder (`$RTX_DATA_DIR`, else `./data`), and every reader that finds a file
//! missing returns [`DataError::Missing`] naming the exact command that fetches it.
//!
//! Start from:
//! - [`DataRoot`]: where the data folder is, and the path of each dataset inside it.
//! - [`ImageDataset`] via [`load_fashion_mnist`], [`load_mnist`], [`load_idx_pair`] or
//!   [`load_digits_csv`]; [`read_idx`] for a single IDX file (gzipped or raw).
//! - [`MovingConfig`]: moving-item clips made from an image dataset on the fly, by seed (V-JEPA).
//! - [`TextCorpus`]: a directory of `.txt` documents as one byte vector with document boundaries.
//! - [`Sampler`] / [`EpochPlan`]: seeded shuffling and batching with a resumable [`Cursor`] and
//!   [`EpochPlan::shard`] for data parallelism; [`ImageDataset::batch`] and
//!   [`TextWindowSampler`] turn index batches into `f32` pixels / `u32` token batches.
//!
//! Determinism: every random choice comes from a `ChaCha8Rng` whose 32-byte seed is built from
//! the user seed, a purpose tag and the epoch or step (see [`Sampler`]); files of a directory
//! are read in sorted file-name order. The same seed gives the same batches on every machine.
//!
//! Not here: augmentation, background prefetching, and any network access.

mod bpe;
mod idx;
mod image_dataset;
mod loader;
mod moving;
mod text;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

pub use bpe::{tokenize_corpus_cached, Gpt2Tokenizer, GPT2_EOT, GPT2_PADDED_VOCAB, GPT2_VOCAB};
pub use idx::{read_idx, IdxArray, IDX_MAGIC_U8_1D, IDX_MAGIC_U8_3D};
pub use image_dataset::{
    load_digits_csv, load_fashion_mnist, load_idx_pair, load_mnist, ImageBatch, ImageDataset, Split,
};
pub use loader::{train_val_split, Cursor, EpochPlan, Sampler, TextBatch, TextWindowSampler};
pub use moving::{Clip, ClipKey, MovingConfig, TEST_CLIP_STREAM, TRAIN_CLIP_STREAM};
pub use text::{Document, TextCorpus, TextSplit};

/// Environment variable a binary may read to locate the data folder (see [`DataRoot::resolve`]).
pub const DATA_DIR_ENV: &str = "RTX_DATA_DIR";
/// Data folder used when neither a flag nor [`DATA_DIR_ENV`] names one (git-ignored).
pub const DEFAULT_DATA_DIR: &str = "data";
/// The script, relative to the repository root, that installs every dataset.
pub const FETCH_SCRIPT: &str = "scripts/fetch-data.sh";

/// Errors of the dataset readers and loaders.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A dataset file or folder does not exist; `fetch_command` installs it.
    #[error("dataset not found at {path}; fetch it with `{fetch_command}`", path = .path.display())]
    Missing {
        /// The file or folder that was looked for.
        path: PathBuf,
        /// The shell command, run from the repository root, that installs it.
        fetch_command: String,
    },
    /// Reading an existing file or folder failed.
    #[error("failed to read {path}", path = .path.display())]
    Io {
        /// The file or folder being read.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A file exists but its content is not what the reader expects.
    #[error("bad format in {path}: {reason}", path = .path.display())]
    BadFormat {
        /// The offending file.
        path: PathBuf,
        /// What was wrong, with the expected and actual values.
        reason: String,
    },
    /// A dataset, corpus or split has no samples where at least one is needed.
    #[error("empty dataset: {what}")]
    Empty {
        /// What turned out to be empty.
        what: String,
    },
    /// The GPT-2 tokenizer could not be built or could not decode token ids.
    #[error("GPT-2 tokenizer: {reason}")]
    Tokenizer {
        /// What failed.
        reason: String,
    },
    /// A loader was configured with values that cannot work (zero batch size, rank >= world, ...).
    #[error("invalid loader argument: {reason}")]
    BadArgument {
        /// Which argument, and its value.
        reason: String,
    },
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, DataError>;

/// The data folder that `scripts/fetch-data.sh` fills, with the layout it produces.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataRoot {
    path: PathBuf,
}

impl DataRoot {
    /// A data folder at `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }

    /// The folder from a command-line flag, else from the value of [`DATA_DIR_ENV`], else
    /// [`DEFAULT_DATA_DIR`]. The caller reads the environment (libraries here read none), e.g.
    /// `DataRoot::resolve(args.data_dir.as_deref(), std::env::var_os(DATA_DIR_ENV).as_deref())`.
    pub fn resolve(flag: Option<&Path>, env_value: Option<&OsStr>) -> Self {
        match (flag, env_value) {
            (Some(path), _) => Self::new(path),
            (None, Some(value)) if !value.is_empty() => Self::new(value),
            _ => Self::new(DEFAULT_DATA_DIR),
        }
    }

    /// The folder itself.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `$DATA/fashion-mnist`, holding the four gzipped IDX files.
    pub fn fashion_mnist(&self) -> PathBuf {
        self.path.join("fashion-mnist")
    }

    /// `$DATA/mnist`, holding the four raw IDX files (optional set).
    pub fn mnist(&self) -> PathBuf {
        self.path.join("mnist")
    }

    /// `$DATA/sotu`, holding the 233 State of the Union `.txt` files.
    pub fn sotu(&self) -> PathBuf {
        self.path.join("sotu")
    }

    /// `$DATA/digits/digits.csv.gz` (optional set).
    pub fn digits_csv(&self) -> PathBuf {
        self.path.join("digits").join("digits.csv.gz")
    }
}

/// The fetch command for dataset `name` whose folder is `dataset_dir`. When that folder is
/// `$DATA/<dir_name>` (the script's layout) the command names `$DATA`, so it installs exactly
/// where the reader looks; otherwise it is the plain command.
pub(crate) fn fetch_command(name: &str, dataset_dir: &Path, dir_name: &str) -> String {
    let mut command = format!("bash {FETCH_SCRIPT}");
    if dataset_dir.file_name() == Some(OsStr::new(dir_name)) {
        if let Some(root) = dataset_dir.parent() {
            if !root.as_os_str().is_empty() {
                command.push(' ');
                command.push_str(&shell_quote(&root.display().to_string()));
            }
        }
    }
    command.push_str(" --only ");
    command.push_str(name);
    command
}

/// Maps an open/read failure of `path` to `Missing` (not found) or `Io` (anything else).
pub(crate) fn io_error(
    path: &Path,
    source: std::io::Error,
    fetch_command: impl FnOnce() -> String,
) -> DataError {
    if source.kind() == std::io::ErrorKind::NotFound {
        DataError::Missing {
            path: path.to_path_buf(),
            fetch_command: fetch_command(),
        }
    } else {
        DataError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

pub(crate) fn bad_format(path: &Path, reason: impl Into<String>) -> DataError {
    DataError::BadFormat {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

pub(crate) fn bad_argument(reason: impl Into<String>) -> DataError {
    DataError::BadArgument {
        reason: reason.into(),
    }
}

fn shell_quote(text: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "/._-+=:,@".contains(c);
    if !text.is_empty() && text.chars().all(plain) {
        text.to_string()
    } else {
        format!("'{}'", text.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolve_prefers_flag_then_env_then_default() {
        let env = OsStr::new("/srv/rtx-data");
        assert_eq!(
            DataRoot::resolve(Some(Path::new("x")), Some(env)).path(),
            Path::new("x")
        );
        assert_eq!(
            DataRoot::resolve(None, Some(env)).path(),
            Path::new("/srv/rtx-data")
        );
        assert_eq!(
            DataRoot::resolve(None, Some(OsStr::new(""))).path(),
            Path::new("data")
        );
        assert_eq!(DataRoot::resolve(None, None).path(), Path::new("data"));
    }

    #[test]
    fn fetch_command_names_script_folder_and_set() {
        let root = DataRoot::new("/srv/my data");
        assert_eq!(
            fetch_command("fashion-mnist", &root.fashion_mnist(), "fashion-mnist"),
            "bash scripts/fetch-data.sh '/srv/my data' --only fashion-mnist"
        );
        let default_root = DataRoot::new(DEFAULT_DATA_DIR);
        assert_eq!(
            fetch_command("sotu", &default_root.sotu(), "sotu"),
            "bash scripts/fetch-data.sh data --only sotu"
        );
        // A folder not laid out by the script: the plain command, no folder argument.
        assert_eq!(
            fetch_command("sotu", Path::new("/elsewhere/speeches"), "sotu"),
            "bash scripts/fetch-data.sh --only sotu"
        );
    }

    #[test]
    fn missing_message_tells_the_command() {
        let err = DataError::Missing {
            path: PathBuf::from("data/sotu"),
            fetch_command: "bash scripts/fetch-data.sh --only sotu".into(),
        };
        assert_eq!(
            err.to_string(),
            "dataset not found at data/sotu; fetch it with `bash scripts/fetch-data.sh --only sotu`"
        );
    }
}
