//! [`Part`] and [`Split`]: where a local tensor sits in the full one. A split tensor holds a
//! range of rows of one dim; a grouped split (a packed `[q; k; v]` weight whose heads are
//! split) views that dim as `groups` equal blocks and holds the same range of each block,
//! stored block after block.

use serde::{Deserialize, Serialize};

/// How a local tensor relates to the full tensor of the same name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Part {
    /// The whole tensor (replicated, or simply not split).
    Whole,
    /// A slice of one dim.
    Split(Split),
}

/// A slice of dim `dim` of a full tensor whose size along it is `full_len`.
///
/// The dim is seen as `groups` equal blocks of `full_len / groups` rows; the slice holds rows
/// `start..start + len` of every block, so its local size along `dim` is `groups * len`. With
/// `groups == 1` that is simply rows `start..start + len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Split {
    /// The split dim.
    pub dim: usize,
    /// First row held, within each block.
    pub start: usize,
    /// Rows held, per block.
    pub len: usize,
    /// Size of the full tensor along `dim`.
    pub full_len: usize,
    /// Number of blocks the dim is seen as (1: a plain range).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub groups: usize,
}

fn one() -> usize {
    1
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

impl Split {
    /// Rows `start..start + len` of dim `dim`, whose full size is `full_len`.
    pub fn range(dim: usize, start: usize, len: usize, full_len: usize) -> Split {
        Split { dim, start, len, full_len, groups: 1 }
    }

    /// Rank `rank`'s share when dim `dim` (full size `full_len`, seen as `groups` blocks) is split
    /// evenly over `size` ranks: rows `rank * b / size ..` of each block of `b` rows. Errors
    /// when the numbers do not divide.
    pub fn even(dim: usize, rank: usize, size: usize, full_len: usize, groups: usize) -> std::result::Result<Split, String> {
        if size == 0 || rank >= size || groups == 0 {
            return Err(format!("rank {rank} of {size} with {groups} groups is not a valid split"));
        }
        if !full_len.is_multiple_of(groups) {
            return Err(format!("dim {dim} of size {full_len} does not divide into {groups} groups"));
        }
        let block = full_len / groups;
        if !block.is_multiple_of(size) {
            return Err(format!("dim {dim}: {block} rows per group do not divide over {size} ranks"));
        }
        let len = block / size;
        Ok(Split { dim, start: rank * len, len, full_len, groups })
    }

    /// Rows per block.
    pub fn block(&self) -> usize {
        self.full_len / self.groups.max(1)
    }

    /// Size of the local tensor along `dim`.
    pub fn local_len(&self) -> usize {
        self.groups * self.len
    }

    /// Whether the split is consistent with a full shape: `dim` within the rank, `full_len` equal
    /// to the shape's size there, groups dividing it, a non-empty range inside one block.
    pub fn check(&self, full_shape: &[usize]) -> std::result::Result<(), String> {
        let Some(&size) = full_shape.get(self.dim) else {
            return Err(format!("split dim {} but the tensor has rank {}", self.dim, full_shape.len()));
        };
        if size != self.full_len {
            return Err(format!("split records full size {} along dim {}, the tensor has {size}", self.full_len, self.dim));
        }
        if self.groups == 0 || !self.full_len.is_multiple_of(self.groups) {
            return Err(format!("dim {} of size {} does not divide into {} groups", self.dim, self.full_len, self.groups));
        }
        let end = self.start.checked_add(self.len);
        if self.len == 0 || end.is_none_or(|end| end > self.block()) {
            return Err(format!(
                "rows {}..{}+{} are empty or beyond the {} rows of a block of dim {}",
                self.start,
                self.start,
                self.len,
                self.block(),
                self.dim
            ));
        }
        Ok(())
    }

    /// The rows held as `(full row, local row, count)` runs, one per block.
    pub fn runs(&self) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        let block = self.block();
        (0..self.groups).map(move |g| (g * block + self.start, g * self.len, self.len))
    }
}

impl Part {
    /// The local shape of this part of a tensor of `full_shape` (after [`Part::check`]).
    pub fn local_shape(&self, full_shape: &[usize]) -> Vec<usize> {
        let mut shape = full_shape.to_vec();
        if let Part::Split(s) = self {
            if let Some(d) = shape.get_mut(s.dim) {
                *d = s.local_len();
            }
        }
        shape
    }

    /// Whether the part fits a tensor of `full_shape` (see [`Split::check`]).
    pub fn check(&self, full_shape: &[usize]) -> std::result::Result<(), String> {
        match self {
            Part::Whole => Ok(()),
            Part::Split(s) => s.check(full_shape),
        }
    }

    /// The full shape of a tensor whose part of shape `local_shape` this is.
    pub fn full_shape(&self, local_shape: &[usize]) -> std::result::Result<Vec<usize>, String> {
        let mut shape = local_shape.to_vec();
        if let Part::Split(s) = self {
            match shape.get_mut(s.dim) {
                Some(d) if *d == s.local_len() => *d = s.full_len,
                Some(d) => return Err(format!("local size {} along dim {} is not the {} rows the split holds", d, s.dim, s.local_len())),
                None => return Err(format!("split dim {} but the local tensor has rank {}", s.dim, local_shape.len())),
            }
        }
        Ok(shape)
    }
}
