//! Byte-level copies between row-major tensors that differ along one dim: the `outer` leading
//! indices, the dim itself, and `inner` trailing bytes per row of the dim. Reading a piece of a
//! shard into a caller's slice copies only the rows both hold, straight from the memory map.

/// A contiguous row-major tensor seen along one dim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Geometry {
    /// Product of the sizes before the dim.
    outer: usize,
    /// Size of the dim.
    rows: usize,
    /// Bytes of one row of the dim (product of the sizes after it, times the element size).
    row_bytes: usize,
}

impl Geometry {
    /// The geometry of `shape` along `dim` with `elem_bytes`-byte elements; `None` when `dim` is
    /// beyond the rank or the byte count overflows.
    pub(super) fn new(shape: &[usize], dim: usize, elem_bytes: usize) -> Option<Geometry> {
        let rows = *shape.get(dim)?;
        let outer = shape.get(..dim)?.iter().try_fold(1usize, |a, &b| a.checked_mul(b))?;
        let row_bytes = shape.get(dim + 1..)?.iter().try_fold(elem_bytes, |a, &b| a.checked_mul(b))?;
        outer.checked_mul(rows)?.checked_mul(row_bytes)?;
        Some(Geometry { outer, rows, row_bytes })
    }

    /// Total bytes of the tensor.
    pub(super) fn bytes(&self) -> usize {
        self.outer * self.rows * self.row_bytes
    }
}

/// Copies rows `src_row..src_row + count` of `src`'s dim onto rows `dst_row..` of `dst`'s dim, for
/// every outer index. The two geometries must agree on `outer` and `row_bytes`. Returns `false`
/// (copying nothing) when they do not or a range falls outside a buffer.
pub(super) fn copy_rows(src: &[u8], sg: Geometry, src_row: usize, dst: &mut [u8], dg: Geometry, dst_row: usize, count: usize) -> bool {
    let fits = sg.outer == dg.outer
        && sg.row_bytes == dg.row_bytes
        && src.len() == sg.bytes()
        && dst.len() == dg.bytes()
        && src_row.checked_add(count).is_some_and(|end| end <= sg.rows)
        && dst_row.checked_add(count).is_some_and(|end| end <= dg.rows);
    if !fits {
        return false;
    }
    let run = count * sg.row_bytes;
    if run == 0 {
        return true;
    }
    for o in 0..sg.outer {
        let s = (o * sg.rows + src_row) * sg.row_bytes;
        let d = (o * dg.rows + dst_row) * dg.row_bytes;
        // In range by the checks above.
        let (Some(from), Some(to)) = (src.get(s..s + run), dst.get_mut(d..d + run)) else { return false };
        to.copy_from_slice(from);
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_a_column_block_of_a_matrix() {
        // Goal: rows of dim 1 of a [2, 4] u8 matrix land where they should. Method: copy
        // columns 1..3 into a [2, 2] buffer and compare with the hand-computed result.
        let src: Vec<u8> = (0..8).collect();
        let sg = Geometry::new(&[2, 4], 1, 1).unwrap();
        let dg = Geometry::new(&[2, 2], 1, 1).unwrap();
        let mut dst = vec![0u8; 4];
        assert!(copy_rows(&src, sg, 1, &mut dst, dg, 0, 2));
        assert_eq!(dst, vec![1, 2, 5, 6]);
        // Out of range: refused, nothing written.
        let mut untouched = vec![9u8; 4];
        assert!(!copy_rows(&src, sg, 3, &mut untouched, dg, 0, 2));
        assert_eq!(untouched, vec![9u8; 4]);
        assert!(Geometry::new(&[2, 4], 2, 1).is_none());
    }
}
