//! A text corpus as one byte vector: documents concatenated in sorted file-name order.
//!
//! Byte-level language models read [`TextCorpus::bytes`] directly (vocabulary 256); the
//! [`Document`] ranges keep the boundaries. [`TextCorpus::unigram_entropy_bits`] is the loss a
//! model that ignores context cannot beat, the first baseline to compare a training curve with.

use std::ops::Range;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{bad_argument, fetch_command, io_error, DataError, Result};

/// One document of a [`TextCorpus`]: its name and its byte range in [`TextCorpus::bytes`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Document {
    /// File name (e.g. `1790_george_washington_n.txt`).
    pub name: String,
    /// Where the document's bytes lie in the corpus.
    pub range: Range<usize>,
}

/// How [`TextCorpus::train_val_split_with`] chooses the validation bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TextSplit {
    /// The last `val_fraction` of every document goes to validation (the default). For SOTU this
    /// keeps all eras, 1790 to 2021, in both splits, so validation loss measures fit to the same
    /// distribution rather than drift in language over two centuries.
    PerDocumentTail,
    /// The last `val_fraction` of the whole corpus goes to validation: for SOTU, the most recent
    /// speeches only. Use it to measure generalization to later text.
    OverallTail,
}

/// Documents concatenated into one byte vector, with their boundaries.
///
/// Nothing is inserted between documents: each file's bytes follow the previous file's bytes.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct TextCorpus {
    bytes: Vec<u8>,
    documents: Vec<Document>,
}

impl TextCorpus {
    /// Reads every regular `*.txt` file of `dir` (not recursing) in sorted file-name order, so
    /// the corpus is the same on every machine. A missing folder, or one without `.txt` files,
    /// gives [`DataError::Missing`] with the fetch command (the SOTU set is `$DATA/sotu`).
    pub fn load_dir(dir: &Path) -> Result<Self> {
        let _span = tracing::info_span!("load_text_corpus", dir = %dir.display()).entered();
        let fetch = || fetch_command("sotu", dir, "sotu");
        let entries = std::fs::read_dir(dir).map_err(|err| io_error(dir, err, fetch))?;
        let mut paths = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|source| DataError::Io {
                path: dir.to_path_buf(),
                source,
            })?;
            let path = entry.path();
            let is_txt = path.extension().is_some_and(|ext| ext == "txt");
            let file_type = entry.file_type().map_err(|source| DataError::Io {
                path: path.clone(),
                source,
            })?;
            // Follow symlinks: a data folder may link to files elsewhere.
            let is_file = file_type.is_file() || (file_type.is_symlink() && path.is_file());
            if is_txt && is_file {
                paths.push(path);
            }
        }
        if paths.is_empty() {
            return Err(DataError::Missing {
                path: dir.join("*.txt"),
                fetch_command: fetch(),
            });
        }
        paths.sort_by(|a, b| a.file_name().cmp(&b.file_name()));
        let mut documents = Vec::with_capacity(paths.len());
        for path in &paths {
            let bytes = std::fs::read(path).map_err(|source| DataError::Io {
                path: path.clone(),
                source,
            })?;
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            documents.push((name, bytes));
        }
        let corpus = Self::from_documents(documents);
        tracing::debug!(
            n_documents = corpus.documents.len(),
            n_bytes = corpus.bytes.len(),
            "loaded text corpus"
        );
        Ok(corpus)
    }

    /// A corpus of the given `(name, bytes)` documents, in the given order.
    pub fn from_documents<N: Into<String>>(
        documents: impl IntoIterator<Item = (N, Vec<u8>)>,
    ) -> Self {
        let mut corpus = Self::default();
        for (name, bytes) in documents {
            corpus.push_document(name.into(), &bytes);
        }
        corpus
    }

    /// All documents' bytes, concatenated.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The documents, in corpus order.
    pub fn documents(&self) -> &[Document] {
        &self.documents
    }

    /// Total bytes.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether the corpus holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Shannon entropy of the byte distribution, in bits per byte (0 for an empty corpus).
    pub fn unigram_entropy_bits(&self) -> f64 {
        unigram_entropy_bits(&self.bytes)
    }

    /// [`TextCorpus::unigram_entropy_bits`] in nats per byte, the unit of a cross-entropy loss.
    pub fn unigram_entropy_nats(&self) -> f64 {
        self.unigram_entropy_bits() * std::f64::consts::LN_2
    }

    /// Splits into `(train, val)` with [`TextSplit::PerDocumentTail`]: the last `val_fraction`
    /// of every document is validation. See [`TextCorpus::train_val_split_with`].
    pub fn train_val_split(&self, val_fraction: f64) -> Result<(TextCorpus, TextCorpus)> {
        self.train_val_split_with(val_fraction, TextSplit::PerDocumentTail)
    }

    /// Splits into `(train, val)`, both contiguous pieces of the original documents (a document
    /// cut in two appears under its name in each). The cut is `round(len * (1 - val_fraction))`
    /// bytes into the document (or corpus), moved forward past UTF-8 continuation bytes so no
    /// character is split. `val_fraction` must lie in `(0, 1)` and both sides be non-empty.
    pub fn train_val_split_with(
        &self,
        val_fraction: f64,
        mode: TextSplit,
    ) -> Result<(TextCorpus, TextCorpus)> {
        if !(val_fraction > 0.0 && val_fraction < 1.0) {
            return Err(bad_argument(format!(
                "val_fraction {val_fraction} must lie in (0, 1)"
            )));
        }
        let mut train = TextCorpus::default();
        let mut val = TextCorpus::default();
        match mode {
            TextSplit::PerDocumentTail => {
                for doc in &self.documents {
                    let bytes = &self.bytes[doc.range.clone()];
                    let cut = cut_point(bytes, val_fraction);
                    train.push_document(doc.name.clone(), &bytes[..cut]);
                    val.push_document(doc.name.clone(), &bytes[cut..]);
                }
            }
            TextSplit::OverallTail => {
                let cut = cut_point(&self.bytes, val_fraction);
                for doc in &self.documents {
                    let (start, end) = (doc.range.start, doc.range.end);
                    if start < cut {
                        train.push_document(doc.name.clone(), &self.bytes[start..end.min(cut)]);
                    }
                    if end > cut {
                        val.push_document(doc.name.clone(), &self.bytes[start.max(cut)..end]);
                    }
                }
            }
        }
        debug_assert_eq!(train.len() + val.len(), self.len());
        for (side, corpus) in [("train", &train), ("validation", &val)] {
            if corpus.is_empty() {
                return Err(DataError::Empty {
                    what: format!(
                        "{side} split of a {}-byte corpus at val_fraction {val_fraction}",
                        self.len()
                    ),
                });
            }
        }
        Ok((train, val))
    }

    /// Appends a document; empty pieces are skipped so every [`Document`] has at least one byte.
    fn push_document(&mut self, name: String, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        let start = self.bytes.len();
        self.bytes.extend_from_slice(bytes);
        self.documents.push(Document {
            name,
            range: start..self.bytes.len(),
        });
    }
}

/// Byte-level Shannon entropy of `bytes` in bits per byte (0 for no bytes).
pub(crate) fn unigram_entropy_bits(bytes: &[u8]) -> f64 {
    if bytes.is_empty() {
        return 0.0;
    }
    let mut counts = [0u64; 256];
    for &b in bytes {
        counts[usize::from(b)] += 1;
    }
    let total = bytes.len() as f64;
    let entropy: f64 = counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = c as f64 / total;
            -p * p.log2()
        })
        .sum();
    debug_assert!((0.0..=8.0 + 1e-9).contains(&entropy));
    entropy
}

/// Index where the validation tail of `bytes` starts: `round(len * (1 - val_fraction))`, moved
/// forward to the next UTF-8 character start (never past the end).
fn cut_point(bytes: &[u8], val_fraction: f64) -> usize {
    let mut cut = ((bytes.len() as f64) * (1.0 - val_fraction)).round() as usize;
    cut = cut.min(bytes.len());
    while cut < bytes.len() && (bytes[cut] & 0b1100_0000) == 0b1000_0000 {
        cut += 1;
    }
    cut
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::DataRoot;

    fn corpus(docs: &[(&str, &str)]) -> TextCorpus {
        TextCorpus::from_documents(docs.iter().map(|(n, t)| (*n, t.as_bytes().to_vec())))
    }

    #[test]
    fn load_dir_reads_txt_in_sorted_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("b.txt"), "bee").expect("write");
        std::fs::write(dir.path().join("a.txt"), "ay").expect("write");
        std::fs::write(dir.path().join("c.md"), "ignored").expect("write");
        std::fs::create_dir(dir.path().join("d.txt")).expect("mkdir");
        let corpus = TextCorpus::load_dir(dir.path()).expect("two txt files");
        assert_eq!(corpus.bytes(), b"aybee");
        let names: Vec<&str> = corpus.documents().iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["a.txt", "b.txt"]);
        assert_eq!(corpus.documents()[1].range, 2..5);
    }

    #[test]
    fn missing_or_empty_dir_names_the_fetch_command() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = DataRoot::new(dir.path());
        for setup in [false, true] {
            if setup {
                std::fs::create_dir(root.sotu()).expect("mkdir empty sotu");
            }
            match TextCorpus::load_dir(&root.sotu()) {
                Err(err @ DataError::Missing { .. }) => {
                    let message = err.to_string();
                    assert!(message.contains("bash scripts/fetch-data.sh"), "{message}");
                    assert!(message.contains("--only sotu"), "{message}");
                }
                other => panic!("expected Missing, got {other:?}"),
            }
        }
    }

    #[test]
    fn entropy_of_known_distributions() {
        assert_eq!(corpus(&[]).unigram_entropy_bits(), 0.0);
        assert_eq!(corpus(&[("a", "aaaa")]).unigram_entropy_bits(), 0.0);
        assert!((corpus(&[("a", "abab")]).unigram_entropy_bits() - 1.0).abs() < 1e-12);
        let all: Vec<u8> = (0..=255).collect();
        let uniform = TextCorpus::from_documents([("u", all)]);
        assert!((uniform.unigram_entropy_bits() - 8.0).abs() < 1e-12);
        assert!((uniform.unigram_entropy_nats() - 8.0 * std::f64::consts::LN_2).abs() < 1e-12);
    }

    #[test]
    fn per_document_split_takes_each_tail() {
        let c = corpus(&[("one", "0123456789"), ("two", "abcdefghij")]);
        let (train, val) = c.train_val_split(0.2).expect("split");
        assert_eq!(train.bytes(), b"01234567abcdefgh");
        assert_eq!(val.bytes(), b"89ij");
        assert_eq!(
            val.documents()[1],
            Document {
                name: "two".into(),
                range: 2..4
            }
        );
    }

    #[test]
    fn overall_split_takes_corpus_tail() {
        let c = corpus(&[("one", "0123456789"), ("two", "abcdefghij")]);
        let (train, val) = c
            .train_val_split_with(0.25, TextSplit::OverallTail)
            .expect("split");
        assert_eq!(train.bytes(), b"0123456789abcde");
        assert_eq!(val.bytes(), b"fghij");
        assert_eq!(train.documents().len(), 2);
        assert_eq!(
            val.documents(),
            [Document {
                name: "two".into(),
                range: 0..5
            }]
        );
    }

    #[test]
    fn split_never_cuts_a_utf8_character_and_rejects_bad_fractions() {
        // "é" is two bytes; a naive cut at byte 3 of "abé" + "xy" would split it.
        let c = corpus(&[("d", "abéxy")]); // 6 bytes: a b 0xC3 0xA9 x y
        let (train, val) = c.train_val_split(0.5).expect("split");
        assert_eq!(train.bytes(), "abé".as_bytes());
        assert_eq!(val.bytes(), b"xy");
        assert!(matches!(
            c.train_val_split(0.0),
            Err(DataError::BadArgument { .. })
        ));
        assert!(matches!(
            c.train_val_split(1.0),
            Err(DataError::BadArgument { .. })
        ));
        assert!(matches!(
            c.train_val_split(f64::NAN),
            Err(DataError::BadArgument { .. })
        ));
        assert!(matches!(
            corpus(&[("d", "ab")]).train_val_split(0.1),
            Err(DataError::Empty { .. })
        ));
    }

    /// Runs on the real SOTU corpus when fetched into `./data` (or `$RTX_DATA_DIR`).
    #[test]
    fn sotu_loads_when_fetched() {
        let env = std::env::var_os(crate::data::DATA_DIR_ENV);
        let root = match env.as_deref() {
            Some(value) if !value.is_empty() => DataRoot::resolve(None, Some(value)),
            _ => DataRoot::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("../data")),
        };
        match TextCorpus::load_dir(&root.sotu()) {
            Ok(sotu) => {
                assert_eq!(sotu.documents().len(), 233);
                assert_eq!(sotu.documents()[0].name, "1790_george_washington_n.txt");
                assert!(
                    (10_000_000..12_000_000).contains(&sotu.len()),
                    "{} bytes",
                    sotu.len()
                );
                let bits = sotu.unigram_entropy_bits();
                assert!((4.0..5.0).contains(&bits), "{bits} bits/byte");
                let (train, val) = sotu.train_val_split(0.1).expect("split");
                assert_eq!(train.len() + val.len(), sotu.len());
            }
            Err(DataError::Missing { fetch_command, .. }) => {
                assert!(
                    fetch_command.starts_with("bash scripts/fetch-data.sh"),
                    "{fetch_command}"
                );
            }
            Err(other) => panic!("fetched SOTU failed to load: {other}"),
        }
    }
}
