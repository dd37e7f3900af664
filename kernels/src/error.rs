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
    /// A slice's length differs from the one the other arguments imply.
    #[error("{op}: `{arg}` holds {actual} elements but {expected} were expected")]
    LengthMismatch {
        /// The kernel.
        op: &'static str,
        /// Which argument.
        arg: &'static str,
        /// Elements expected.
        expected: usize,
        /// Elements present.
        actual: usize,
    },
    /// An argument the kernel cannot work with (its value, not its length).
    #[error("{op}: `{arg}` {reason}")]
    InvalidArgument {
        /// The kernel.
        op: &'static str,
        /// Which argument.
        arg: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A class index is outside the number of classes.
    #[error("{op}: target {target} at row {row} is out of range for {n_classes} classes")]
    TargetOutOfRange {
        /// The kernel.
        op: &'static str,
        /// Row of the bad target.
        row: usize,
        /// The target value.
        target: i64,
        /// Number of classes.
        n_classes: usize,
    },
}

/// Result alias for kernel calls.
pub type Result<T> = std::result::Result<T, Error>;

/// Checks that `buffer` holds exactly `expected` elements.
#[inline]
pub(crate) fn check_eq<T>(op: &'static str, arg: &'static str, buffer: &[T], expected: usize) -> Result<()> {
    if buffer.len() != expected {
        return Err(Error::LengthMismatch { op, arg, expected, actual: buffer.len() });
    }
    Ok(())
}

/// The product of `xs`, saturating at `usize::MAX` (a saturated size is never a real slice's
/// length, so a length check against it fails instead of overflowing).
#[inline]
pub(crate) fn product(xs: &[usize]) -> usize {
    xs.iter().fold(1usize, |acc, &x| acc.saturating_mul(x))
}

/// Checks that `buffer` holds at least `needed` elements.
#[inline]
pub(crate) fn check_len<T>(op: &'static str, name: &'static str, buffer: &[T], needed: usize) -> Result<()> {
    if buffer.len() < needed {
        return Err(Error::BufferTooSmall { op, buffer: name, needed, actual: buffer.len() });
    }
    Ok(())
}
