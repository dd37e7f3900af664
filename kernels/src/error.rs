//! The kernels' error type: what a kernel refuses to do and why.

/// An error from a kernel call.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum Error {
    /// A slice is shorter than the shape handed in needs.
    #[error("{op}: buffer `{buffer}` holds {actual} elements but the shape needs {needed}")]
    BufferTooSmall {
        /// The kernel.
        op: &'static str,
        /// Which argument.
        buffer: &'static str,
        /// Elements needed.
        needed: usize,
        /// Elements present.
        actual: usize,
    },
    /// A class index is outside the number of classes.
    #[error("{op}: target {target} at row {row} is out of range for {n_classes} classes")]
    TargetOutOfRange {
        /// The kernel.
        op: &'static str,
        /// Row of the bad target.
        row: usize,
        /// The target value.
        target: u32,
        /// Number of classes.
        n_classes: usize,
    },
}

/// Result alias for kernel calls.
pub type Result<T> = std::result::Result<T, Error>;

/// Checks that `buffer` holds at least `needed` elements.
pub(crate) fn check_len<T>(op: &'static str, name: &'static str, buffer: &[T], needed: usize) -> Result<()> {
    if buffer.len() < needed {
        return Err(Error::BufferTooSmall { op, buffer: name, needed, actual: buffer.len() });
    }
    Ok(())
}
