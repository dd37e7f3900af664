//! GPT-2's byte-pair encoding: the 50,257-token vocabulary that GPT-2, nanoGPT and llm.c train
//! with, through `tiktoken-rs` (its `r50k_base` ranks ship inside the crate: nothing is
//! downloaded), and a cache of a corpus's token ids next to the corpus.
//!
//! [`tokenize_corpus_cached`] encodes every document of a [`TextCorpus`] and ends each with
//! `<|endoftext|>` ([`GPT2_EOT`]), as GPT-2's training data separates documents. Ids are stored
//! as little-endian u16 (every GPT-2 id fits) after a header naming the corpus they came from
//! (its length and CRC-32): a cache from other text is rebuilt, never silently used. The file is
//! written to a temporary name (unique to the process and call) and renamed, so a crash leaves the
//! old cache or none, and workers building the same cache at once never read or rename a partial
//! file.

use std::path::Path;

use tiktoken_rs::CoreBPE;

use super::{DataError, Result};
use crate::data::TextCorpus;

/// GPT-2's vocabulary size.
pub const GPT2_VOCAB: usize = 50_257;
/// The vocabulary rounded up to a multiple of 64 (llm.c's padding): embedding rows beyond
/// [`GPT2_VOCAB`] exist in the weights but no target ever names them.
pub const GPT2_PADDED_VOCAB: usize = 50_304;
/// `<|endoftext|>`, the document separator.
pub const GPT2_EOT: u32 = 50_256;

const CACHE_MAGIC: &[u8; 8] = b"RTXBPE1\0";
const HEADER_LEN: usize = 8 + 8 + 4 + 8;

/// GPT-2's tokenizer.
pub struct Gpt2Tokenizer {
    bpe: CoreBPE,
}

impl Gpt2Tokenizer {
    /// Builds the tokenizer from the ranks inside `tiktoken-rs`.
    pub fn new() -> Result<Gpt2Tokenizer> {
        let bpe = tiktoken_rs::r50k_base().map_err(|e| DataError::Tokenizer { reason: format!("loading the r50k_base ranks: {e}") })?;
        Ok(Gpt2Tokenizer { bpe })
    }

    /// The token ids of `text` (special tokens are not recognised in it: `<|endoftext|>` in the
    /// text is encoded as ordinary characters).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_ordinary(text)
    }

    /// The text of `tokens`; an id outside the vocabulary, or ids that end inside a UTF-8
    /// character, are an error.
    pub fn decode(&self, tokens: &[u32]) -> Result<String> {
        String::from_utf8(self.decode_bytes(tokens)?).map_err(|e| DataError::Tokenizer { reason: format!("decoding {} ids: not UTF-8: {e}", tokens.len()) })
    }

    /// The bytes of `tokens`, which need not be valid UTF-8 (a model's sample may stop or wander
    /// inside a character: show it with `String::from_utf8_lossy`); an id outside the
    /// vocabulary is an error.
    pub fn decode_bytes(&self, tokens: &[u32]) -> Result<Vec<u8>> {
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= GPT2_VOCAB) {
            return Err(DataError::Tokenizer { reason: format!("token id {bad} is outside the vocabulary of {GPT2_VOCAB}") });
        }
        self.bpe.decode_bytes(tokens).map_err(|e| DataError::Tokenizer { reason: format!("decoding {} ids: {e}", tokens.len()) })
    }
}

/// The GPT-2 token ids of `corpus` (each document followed by [`GPT2_EOT`]), read from `cache`
/// when it was made from this corpus, else encoded and written there (module docs).
pub fn tokenize_corpus_cached(corpus: &TextCorpus, cache: &Path) -> Result<Vec<u32>> {
    let _span = tracing::info_span!("gpt2_tokens", cache = %cache.display(), corpus_bytes = corpus.len()).entered();
    let header = cache_header(corpus);
    match std::fs::read(cache) {
        Ok(bytes) => match parse_cache(&bytes, &header) {
            Some(tokens) => return Ok(tokens),
            None => tracing::warn!(cache = %cache.display(), "the token cache was made from other text or is damaged: rebuilding it"),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => return Err(DataError::Io { path: cache.to_path_buf(), source }),
    }
    let tokenizer = Gpt2Tokenizer::new()?;
    let mut tokens = Vec::new();
    for document in corpus.documents() {
        let text = String::from_utf8_lossy(&corpus.bytes()[document.range.clone()]);
        tokens.extend(tokenizer.encode(&text));
        tokens.push(GPT2_EOT);
    }
    let mut file = header.to_vec();
    file.extend((tokens.len() as u64).to_le_bytes());
    for &t in &tokens {
        // Every id is below GPT2_VOCAB < 65,536.
        file.extend((t as u16).to_le_bytes());
    }
    let io = |source| DataError::Io { path: cache.to_path_buf(), source };
    // A staging name of this process and call: workers of one job (processes, or threads of
    // `rtx sim`) may build the same cache at once, and each renames only its own complete file.
    static STAGING: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = STAGING.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let staging = cache.with_extension(format!("staging-{}-{n}", std::process::id()));
    std::fs::write(&staging, &file).map_err(io)?;
    std::fs::rename(&staging, cache).map_err(|e| {
        let _ = std::fs::remove_file(&staging);
        io(e)
    })?;
    tracing::info!(n_tokens = tokens.len(), "wrote the GPT-2 token cache");
    Ok(tokens)
}

/// Magic, corpus length and CRC-32 of the corpus bytes.
fn cache_header(corpus: &TextCorpus) -> [u8; HEADER_LEN - 8] {
    let mut header = [0u8; HEADER_LEN - 8];
    header[..8].copy_from_slice(CACHE_MAGIC);
    header[8..16].copy_from_slice(&(corpus.len() as u64).to_le_bytes());
    header[16..20].copy_from_slice(&crc32fast::hash(corpus.bytes()).to_le_bytes());
    header
}

/// The ids of a cache file whose header is `header` and whose length matches its count.
fn parse_cache(bytes: &[u8], header: &[u8]) -> Option<Vec<u32>> {
    let rest = bytes.strip_prefix(header)?;
    let (count, ids) = rest.split_at_checked(8)?;
    let count = u64::from_le_bytes(count.try_into().ok()?) as usize;
    if ids.len() != count.checked_mul(2)? {
        return None;
    }
    let tokens: Vec<u32> = ids.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]) as u32).collect();
    tokens.iter().all(|&t| (t as usize) < GPT2_VOCAB).then_some(tokens)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn corpus() -> TextCorpus {
        TextCorpus::from_documents([("a.txt", "Fellow-Citizens of the Senate and House of Representatives:".as_bytes().to_vec()), ("b.txt", "Mr. Speaker, the state of our union is strong. Ünïcödé ✓".as_bytes().to_vec())])
    }

    #[test]
    fn gpt2_ids_round_trip_and_match_the_reference() {
        // Goal: the encoding is GPT-2's. "Hello world" is [15496, 995] in OpenAI's gpt2 encoding
        // (tiktoken / Hugging Face GPT2TokenizerFast); decode inverts encode on Unicode too.
        let t = Gpt2Tokenizer::new().unwrap();
        assert_eq!(t.encode("Hello world"), vec![15496, 995]);
        let text = "Mr. Speaker, the state of our union is strong. Ünïcödé ✓";
        assert_eq!(t.decode(&t.encode(text)).unwrap(), text);
        assert!(matches!(t.decode(&[GPT2_VOCAB as u32]), Err(DataError::Tokenizer { .. })));
        // Bytes: any ids, even those that end inside a character ("✓" is several byte tokens).
        assert_eq!(t.decode_bytes(&t.encode(text)).unwrap(), text.as_bytes());
        let check = t.encode("✓");
        assert!(check.len() > 1 && t.decode(&check[..1]).is_err());
        assert_eq!(t.decode_bytes(&check[..1]).unwrap(), "✓".as_bytes()[..t.decode_bytes(&check[..1]).unwrap().len()]);
        assert!(matches!(t.decode_bytes(&[GPT2_VOCAB as u32]), Err(DataError::Tokenizer { .. })));
    }

    #[test]
    fn the_cache_is_reused_for_the_same_corpus_and_rebuilt_for_another_or_a_damaged_one() {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("tokens.bin");
        let c = corpus();
        let tokens = tokenize_corpus_cached(&c, &cache).unwrap();
        assert_eq!(tokens.iter().filter(|&&t| t == GPT2_EOT).count(), 2, "one end-of-text per document");
        let t = Gpt2Tokenizer::new().unwrap();
        let first_doc_end = tokens.iter().position(|&t| t == GPT2_EOT).unwrap();
        assert_eq!(t.decode(&tokens[..first_doc_end]).unwrap(), "Fellow-Citizens of the Senate and House of Representatives:");
        let written = std::fs::metadata(&cache).unwrap().modified().unwrap();
        assert_eq!(tokenize_corpus_cached(&c, &cache).unwrap(), tokens);
        assert_eq!(std::fs::metadata(&cache).unwrap().modified().unwrap(), written, "the cache was read, not rewritten");
        // Other text: rebuilt for it.
        let other = TextCorpus::from_documents([("c.txt", b"Hello world".to_vec())]);
        assert_eq!(tokenize_corpus_cached(&other, &cache).unwrap(), vec![15496, 995, GPT2_EOT]);
        // A truncated file: rebuilt, not read short.
        let bytes = std::fs::read(&cache).unwrap();
        std::fs::write(&cache, &bytes[..bytes.len() - 1]).unwrap();
        assert_eq!(tokenize_corpus_cached(&other, &cache).unwrap(), vec![15496, 995, GPT2_EOT]);
    }
}
