//! Shapes, strides and offsets: how a tensor's elements sit in its storage, and the view
//! arithmetic (reshape, permute, narrow, broadcast) that never copies.

use crate::error::{Error, Result};

/// Where a tensor's elements are in its storage: element `idx` lives at
/// `offset + Σ idx[d]·strides[d]`. Strides are in elements; a stride of 0 broadcasts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
}

/// Row-major (C-order) strides for `shape`.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut acc = 1usize;
    for d in (0..shape.len()).rev() {
        strides[d] = acc;
        acc *= shape[d];
    }
    strides
}

/// Normalises a possibly negative dimension index.
pub fn normalize_dim(op: &'static str, dim: isize, rank: usize) -> Result<usize> {
    let d = if dim < 0 { dim + rank as isize } else { dim };
    if d < 0 || d as usize >= rank {
        return Err(Error::DimOutOfRange { op, dim, rank });
    }
    Ok(d as usize)
}

/// The broadcast shape of two shapes (NumPy rules), or an error naming both.
pub fn broadcast_shape(op: &'static str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for i in 0..rank {
        let da = if i + a.len() >= rank { a[i + a.len() - rank] } else { 1 };
        let db = if i + b.len() >= rank { b[i + b.len() - rank] } else { 1 };
        out[i] = if da == db {
            da
        } else if da == 1 {
            db
        } else if db == 1 {
            da
        } else {
            return Err(Error::ShapeMismatch { op, lhs: a.to_vec(), rhs: b.to_vec() });
        };
    }
    Ok(out)
}

impl Layout {
    /// A contiguous row-major layout.
    pub fn contiguous(shape: &[usize]) -> Self {
        Layout { strides: contiguous_strides(shape), shape: shape.to_vec(), offset: 0 }
    }

    /// A layout from raw parts (the caller guarantees it stays inside the storage).
    pub fn new(shape: Vec<usize>, strides: Vec<usize>, offset: usize) -> Self {
        debug_assert_eq!(shape.len(), strides.len());
        Layout { shape, strides, offset }
    }

    /// The dimensions.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The strides, in elements.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// Offset of the first element in the storage.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the elements are row-major and packed (offset may be non-zero).
    pub fn is_contiguous(&self) -> bool {
        let mut acc = 1usize;
        for d in (0..self.shape.len()).rev() {
            if self.shape[d] != 1 && self.strides[d] != acc {
                return false;
            }
            acc *= self.shape[d];
        }
        true
    }

    /// One past the largest storage index this layout touches (0 when empty).
    pub fn storage_extent(&self) -> usize {
        if self.numel() == 0 {
            return 0;
        }
        self.offset + self.shape.iter().zip(&self.strides).map(|(&n, &s)| (n - 1) * s).sum::<usize>() + 1
    }

    /// The layout viewed with a new shape of equal size; `None` when the strides cannot express it
    /// without a copy.
    pub fn reshaped(&self, shape: &[usize]) -> Option<Layout> {
        if self.is_contiguous() {
            return Some(Layout { shape: shape.to_vec(), strides: contiguous_strides(shape), offset: self.offset });
        }
        None
    }

    /// Dimensions reordered by `perm`.
    pub fn permuted(&self, perm: &[usize]) -> Result<Layout> {
        let rank = self.rank();
        let mut seen = vec![false; rank];
        if perm.len() != rank || perm.iter().any(|&p| p >= rank || std::mem::replace(&mut seen[p], true)) {
            return Err(Error::InvalidArgument { op: "permute", reason: format!("{perm:?} is not a permutation of 0..{rank}") });
        }
        Ok(Layout {
            shape: perm.iter().map(|&p| self.shape[p]).collect(),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
            offset: self.offset,
        })
    }

    /// Elements `start..start+len` of dimension `dim`.
    pub fn narrowed(&self, dim: usize, start: usize, len: usize) -> Result<Layout> {
        let size = self.shape[dim];
        if start + len > size {
            return Err(Error::IndexOutOfRange { op: "narrow", index: start + len, size });
        }
        let mut out = self.clone();
        out.shape[dim] = len;
        if len > 0 {
            out.offset += start * self.strides[dim];
        }
        Ok(out)
    }

    /// The layout broadcast to `shape` (stride 0 on expanded dims).
    pub fn broadcast_to(&self, shape: &[usize]) -> Result<Layout> {
        let err = || Error::ShapeMismatch { op: "expand", lhs: self.shape.clone(), rhs: shape.to_vec() };
        if shape.len() < self.rank() {
            return Err(err());
        }
        let lead = shape.len() - self.rank();
        let mut strides = vec![0; shape.len()];
        for (i, &n) in shape.iter().enumerate() {
            if i < lead {
                continue;
            }
            let (own, own_stride) = (self.shape[i - lead], self.strides[i - lead]);
            strides[i] = if own == n {
                own_stride
            } else if own == 1 {
                0
            } else {
                return Err(err());
            };
        }
        Ok(Layout { shape: shape.to_vec(), strides, offset: self.offset })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcasting_rules() {
        assert_eq!(broadcast_shape("t", &[2, 1, 3], &[4, 1]).unwrap(), vec![2, 4, 3]);
        assert!(broadcast_shape("t", &[2, 3], &[4, 3]).is_err());
        let l = Layout::contiguous(&[1, 3]).broadcast_to(&[2, 3]).unwrap();
        assert_eq!(l.strides(), &[0, 1]);
    }

    #[test]
    fn contiguity_and_narrow() {
        let l = Layout::contiguous(&[4, 5]);
        assert!(l.is_contiguous());
        let t = l.permuted(&[1, 0]).unwrap();
        assert!(!t.is_contiguous());
        let n = l.narrowed(0, 1, 2).unwrap();
        assert!(n.is_contiguous());
        assert_eq!(n.offset(), 5);
        assert!(l.narrowed(1, 1, 2).unwrap().reshaped(&[8]).is_none());
    }
}
