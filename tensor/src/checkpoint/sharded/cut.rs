//! Cutting a model's full named tensors the way a (pp, tp) mesh holds them: a [`ModelLayout`]
//! says which dim of each tensor tensor parallelism splits and which pipeline stage holds each
//! tensor; a [`Cut`] is one member's coordinate (tp rank, range of blocks). The same cut gives a
//! shard writer its tensors and parts, and a loader its [`PartSpec`].
//!
//! Names are matched by dot-separated segments: the pattern `attn.qkv.weight` matches
//! `blocks.3.attn.qkv.weight`, its optimizer state `blocks.3.attn.qkv.weight.exp_avg` and the
//! single-file form `optim.blocks.3.attn.qkv.weight.exp_avg`. A split rule applies only to
//! tensors with more dims than the split dim, so 0-d state (`….step`) is whole everywhere.

use super::error::{Result, ShardedError};
use super::part::{Part, Split};
use super::reader::PartSpec;
use crate::autograd::no_grad;
use crate::nn::GptConfig;
use crate::tensor::Tensor;
use std::ops::Range;

/// Which dim each tensor is split along under tensor parallelism, and which pipeline stage
/// holds each tensor that is not in a block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelLayout {
    /// `(pattern, dim, groups)`, first match wins.
    splits: Vec<(String, usize, usize)>,
    /// The segment before a block index (`blocks` in `blocks.3.attn.qkv.weight`).
    block_prefix: String,
    /// Patterns of tensors the first stage holds.
    first: Vec<String>,
    /// Patterns of tensors the last stage holds.
    last: Vec<String>,
}

impl ModelLayout {
    /// A layout with no splits whose blocks are named `<block_prefix>.<i>.…`. Tensors outside
    /// blocks that no stage rule names are held by every stage.
    pub fn new(block_prefix: &str) -> ModelLayout {
        ModelLayout { splits: Vec::new(), block_prefix: block_prefix.to_string(), first: Vec::new(), last: Vec::new() }
    }

    /// Tensors matching `pattern` are split along `dim` over the tp ranks.
    pub fn split(self, pattern: &str, dim: usize) -> ModelLayout {
        self.split_grouped(pattern, dim, 1)
    }

    /// Tensors matching `pattern` are split along `dim` seen as `groups` blocks (a packed
    /// `[q; k; v]` weight: `groups = 3`), each rank taking the same range of every block.
    pub fn split_grouped(mut self, pattern: &str, dim: usize, groups: usize) -> ModelLayout {
        self.splits.push((pattern.to_string(), dim, groups));
        self
    }

    /// Tensors matching `pattern` (outside blocks) are held by the first pipeline stage.
    pub fn first_stage(mut self, pattern: &str) -> ModelLayout {
        self.first.push(pattern.to_string());
        self
    }

    /// Tensors matching `pattern` (outside blocks) are held by the last pipeline stage.
    pub fn last_stage(mut self, pattern: &str) -> ModelLayout {
        self.last.push(pattern.to_string());
        self
    }

    /// Megatron's layout of [`crate::nn::Gpt`]: qkv column-parallel by heads (dim 0 in 3
    /// groups: each rank keeps q, k and v of its heads), `mlp.fc` column-parallel (dim 0),
    /// `attn.proj` and `mlp.proj` weights row-parallel (dim 1, their biases whole), token
    /// embedding and untied head by vocab rows (dim 0); LayerNorms and the position embedding
    /// whole. The embeddings belong to the first stage, `ln_f` and the head to the last, which
    /// with tied embeddings holds its own copy of `tok_emb.weight`.
    pub fn gpt(config: &GptConfig) -> ModelLayout {
        let layout = ModelLayout::new("blocks")
            .split_grouped("attn.qkv.weight", 0, 3)
            .split_grouped("attn.qkv.bias", 0, 3)
            .split("attn.proj.weight", 1)
            .split("mlp.fc.weight", 0)
            .split("mlp.fc.bias", 0)
            .split("mlp.proj.weight", 1)
            .split("tok_emb.weight", 0)
            .split("lm_head.weight", 0)
            .first_stage("tok_emb")
            .first_stage("pos_emb")
            .last_stage("ln_f")
            .last_stage("lm_head");
        if config.tie_embeddings {
            layout.last_stage("tok_emb")
        } else {
            layout
        }
    }

    /// The split rule `(dim, groups)` of `name`, if any.
    pub fn split_of(&self, name: &str) -> Option<(usize, usize)> {
        self.splits.iter().find(|(p, _, _)| matches(name, p)).map(|&(_, dim, groups)| (dim, groups))
    }

    /// The block index of `name` (`blocks.3.…` → 3, also under a prefix such as `optim.`).
    pub fn block_of(&self, name: &str) -> Option<usize> {
        let segments: Vec<&str> = name.split('.').collect();
        segments.windows(2).find(|w| w.first() == Some(&self.block_prefix.as_str())).and_then(|w| w.get(1)?.parse().ok())
    }
}

/// One member's part of the model: tp rank `tp_rank` of `tp_size`, blocks `blocks`, and whether
/// it is the first and/or last pipeline stage.
#[derive(Clone, Debug)]
pub struct Cut<'a> {
    /// The layout cut.
    pub layout: &'a ModelLayout,
    /// This member's tp rank.
    pub tp_rank: usize,
    /// The tp group size.
    pub tp_size: usize,
    /// The blocks this member's stage holds.
    pub blocks: Range<usize>,
    /// Whether it is the first stage (holds the embeddings).
    pub first: bool,
    /// Whether it is the last stage (holds the final norm and head).
    pub last: bool,
}

impl<'a> Cut<'a> {
    /// The cut of tp rank `tp_rank` of `tp_size` on the stage holding `blocks` of `n_blocks`.
    pub fn new(layout: &'a ModelLayout, tp_rank: usize, tp_size: usize, blocks: Range<usize>, n_blocks: usize) -> Cut<'a> {
        let first = blocks.start == 0;
        let last = blocks.end == n_blocks;
        Cut { layout, tp_rank, tp_size, blocks, first, last }
    }

    /// One rank holding everything.
    pub fn whole(layout: &'a ModelLayout, n_blocks: usize) -> Cut<'a> {
        Cut::new(layout, 0, 1, 0..n_blocks, n_blocks)
    }

    /// Whether this member's stage holds (its part of) `name`.
    pub fn holds(&self, name: &str) -> bool {
        if let Some(b) = self.layout.block_of(name) {
            return self.blocks.contains(&b);
        }
        let first = self.layout.first.iter().any(|p| matches(name, p));
        let last = self.layout.last.iter().any(|p| matches(name, p));
        (first && self.first) || (last && self.last) || (!first && !last)
    }

    /// This member's part of `name`, whose full shape is `full_shape`.
    pub fn part(&self, name: &str, full_shape: &[usize]) -> std::result::Result<Part, String> {
        match self.layout.split_of(name) {
            Some((dim, groups)) if self.tp_size > 1 && dim < full_shape.len() => {
                let full_len = full_shape.get(dim).copied().unwrap_or(0);
                Split::even(dim, self.tp_rank, self.tp_size, full_len, groups).map(Part::Split)
            }
            _ => Ok(Part::Whole),
        }
    }

    /// The part each of this member's local tensors is (full names, local shapes: a tp rank's
    /// parameters and optimizer state), ready for [`super::ShardWriter::write`]. A split tensor's
    /// full size is its local size times `tp_size`.
    pub fn local_parts<'t>(&self, local: &'t [(String, Tensor)]) -> Result<Vec<(&'t str, &'t Tensor, Part)>> {
        local
            .iter()
            .map(|(name, t)| {
                let mut full = t.shape().to_vec();
                if let Some((dim, _)) = self.layout.split_of(name) {
                    if let Some(d) = full.get_mut(dim) {
                        *d = d.saturating_mul(self.tp_size);
                    }
                }
                let part = self.part(name, &full).map_err(|reason| ShardedError::BadPart { file: "<local>".into(), tensor: name.clone(), reason })?;
                Ok((name.as_str(), t, part))
            })
            .collect()
    }

    /// The tensors of `full` this member holds, cut to its part, each with that part: what it
    /// passes to [`super::ShardWriter::write`]. The tensors are new (no autograd history).
    pub fn cut(&self, full: &[(String, Tensor)]) -> Result<Vec<(String, Tensor, Part)>> {
        let mut out = Vec::new();
        for (name, t) in full.iter().filter(|(n, _)| self.holds(n)) {
            let fail = |source| ShardedError::Tensor { file: "<cut>".into(), tensor: name.clone(), source };
            let part = self.part(name, t.shape()).map_err(|reason| ShardedError::BadPart { file: "<cut>".into(), tensor: name.clone(), reason })?;
            let local = no_grad(|| match part {
                Part::Whole => Ok(t.clone()),
                Part::Split(s) => {
                    let dim = s.dim as isize;
                    let runs = s.runs().map(|(full_row, _, len)| t.narrow(dim, full_row, len)).collect::<crate::Result<Vec<_>>>()?;
                    Tensor::cat(&runs.iter().collect::<Vec<_>>(), dim)
                }
            })
            .map_err(fail)?;
            let fresh = Tensor::from_data(local.to_data().map_err(fail)?, local.shape()).map_err(fail)?;
            out.push((name.clone(), fresh, part));
        }
        Ok(out)
    }
}

impl PartSpec for Cut<'_> {
    fn part(&self, name: &str, full_shape: &[usize]) -> std::result::Result<Part, String> {
        Cut::part(self, name, full_shape)
    }
}

/// `n_blocks` blocks over `pp` stages as evenly as possible (earlier stages take the extra
/// blocks); an error when a stage would get none.
pub fn even_stages(n_blocks: usize, pp: usize) -> std::result::Result<Vec<Range<usize>>, String> {
    if pp == 0 || pp > n_blocks {
        return Err(format!("{n_blocks} blocks cannot fill {pp} stages"));
    }
    let (base, extra) = (n_blocks / pp, n_blocks % pp);
    let mut start = 0;
    Ok((0..pp)
        .map(|s| {
            let len = base + usize::from(s < extra);
            let r = start..start + len;
            start += len;
            r
        })
        .collect())
}

/// Whether `pattern`'s dot-separated segments appear as a contiguous run of `name`'s.
fn matches(name: &str, pattern: &str) -> bool {
    let name: Vec<&str> = name.split('.').collect();
    let pattern: Vec<&str> = pattern.split('.').collect();
    !pattern.is_empty() && name.windows(pattern.len()).any(|w| w == pattern.as_slice())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_match_by_segments_and_blocks_are_found_under_prefixes() {
        // Goal: the matching rules of the module doc. Method: a few names against the GPT layout.
        let layout = ModelLayout::gpt(&GptConfig::default());
        assert_eq!(layout.split_of("blocks.3.attn.qkv.weight"), Some((0, 3)));
        assert_eq!(layout.split_of("optim.blocks.3.attn.qkv.weight.exp_avg"), Some((0, 3)));
        assert_eq!(layout.split_of("blocks.3.attn.proj.bias"), None);
        assert_eq!(layout.split_of("xtok_emb.weight"), None);
        assert_eq!(layout.block_of("optim.blocks.12.ln1.weight.step"), Some(12));
        assert_eq!(layout.block_of("tok_emb.weight"), None);
        let last = Cut::new(&layout, 0, 2, 2..4, 4);
        assert!(last.holds("tok_emb.weight") && last.holds("ln_f.bias") && !last.holds("pos_emb.weight") && !last.holds("blocks.1.ln1.weight"));
        assert_eq!(last.part("blocks.2.attn.qkv.weight.step", &[]), Ok(Part::Whole));
        assert!(last.part("blocks.2.mlp.fc.weight", &[3, 8]).is_err());
        assert_eq!(even_stages(5, 2), Ok(vec![0..3, 3..5]));
        assert!(even_stages(1, 2).is_err());
    }
}
