//! The tensor crate's error type. Every variant names the operation and carries the facts
//! (both shapes, both dtypes, the bad dimension) so the message says what to fix.

use rtx_kernels::{DType, Device};

/// An error from a tensor operation, module, optimizer or checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Two operands' shapes do not fit the operation.
    #[error("{op}: shape mismatch between {lhs:?} and {rhs:?}")]
    ShapeMismatch {
        /// The operation.
        op: &'static str,
        /// First operand's shape.
        lhs: Vec<usize>,
        /// Second operand's shape.
        rhs: Vec<usize>,
    },
    /// An operand's shape is not what the operation needs.
    #[error("{op}: bad shape {shape:?}: {reason}")]
    BadShape {
        /// The operation.
        op: &'static str,
        /// The offending shape.
        shape: Vec<usize>,
        /// What was expected.
        reason: String,
    },
    /// Two operands' dtypes differ, or a dtype the operation does not support.
    #[error("{op}: dtype mismatch: {lhs} vs {rhs}")]
    DTypeMismatch {
        /// The operation.
        op: &'static str,
        /// First dtype.
        lhs: DType,
        /// Second dtype (or the dtype needed).
        rhs: DType,
    },
    /// The operation does not support this dtype.
    #[error("{op}: unsupported dtype {dtype}")]
    UnsupportedDType {
        /// The operation.
        op: &'static str,
        /// The dtype.
        dtype: DType,
    },
    /// Operands live on different devices.
    #[error("{op}: device mismatch: {lhs} vs {rhs}")]
    DeviceMismatch {
        /// The operation.
        op: &'static str,
        /// First device.
        lhs: Device,
        /// Second device.
        rhs: Device,
    },
    /// The device is not available in this build or on this machine.
    #[error("device {device} is not available: {reason}")]
    DeviceUnavailable {
        /// The device asked for.
        device: Device,
        /// Why.
        reason: String,
    },
    /// A dimension index is out of range for the tensor's rank.
    #[error("{op}: dimension {dim} out of range for rank {rank}")]
    DimOutOfRange {
        /// The operation.
        op: &'static str,
        /// The dimension asked for (as given, possibly negative).
        dim: isize,
        /// The tensor's rank.
        rank: usize,
    },
    /// An index is out of range.
    #[error("{op}: index {index} out of range for size {size}")]
    IndexOutOfRange {
        /// The operation.
        op: &'static str,
        /// The index.
        index: usize,
        /// The size of the indexed dimension.
        size: usize,
    },
    /// The operation needs a contiguous tensor (in-place updates of flat buffers).
    #[error("{op}: tensor must be contiguous (shape {shape:?}, strides {strides:?})")]
    NotContiguous {
        /// The operation.
        op: &'static str,
        /// Shape.
        shape: Vec<usize>,
        /// Strides.
        strides: Vec<usize>,
    },
    /// `backward` was called on a tensor that does not require gradients.
    #[error("backward: tensor does not require grad (no differentiable path to any parameter)")]
    NoGradient,
    /// `backward` was called on a non-scalar without an explicit gradient.
    #[error("backward: output has shape {shape:?}; call backward on a scalar or pass a gradient")]
    NonScalarBackward {
        /// The shape of the tensor.
        shape: Vec<usize>,
    },
    /// An invalid argument value (negative probability, zero heads, ...).
    #[error("{op}: invalid argument: {reason}")]
    InvalidArgument {
        /// The operation.
        op: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A checkpoint could not be read or written.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint {
        /// The file.
        path: String,
        /// What went wrong.
        reason: String,
    },
    /// An I/O error with the path it happened on.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A kernel refused its inputs.
    #[error(transparent)]
    Kernel(#[from] rtx_kernels::Error),
    /// The op has no implementation for tensors on this device.
    #[error("{op}: not supported for tensors on {device} (move them with to_device first)")]
    UnsupportedDevice {
        /// The operation.
        op: &'static str,
        /// The device of the operand.
        device: Device,
    },
    /// An integer value does not fit the integer dtype it is converted to (a negative or too
    /// large i64 used as a u32 index, label or id).
    #[error("{op}: value {value} at element {index} does not fit {target}")]
    IntegerOutOfRange {
        /// The operation.
        op: &'static str,
        /// Position of the value in the (contiguous) elements.
        index: usize,
        /// The value.
        value: i64,
        /// The dtype it had to fit.
        target: DType,
    },
    /// A strict `load_state_dict` found missing or unexpected names, or shapes or dtypes that do
    /// not match; every problem is listed, and the module was left untouched.
    #[error("load_state_dict: {report}")]
    StateDict {
        /// What did not match, by name.
        report: crate::nn::StateDictReport,
    },
    /// A CUDA call failed (driver, cuBLAS, NVRTC, out of memory, a refused argument).
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Cuda(#[from] rtx_kernels::cuda::CudaError),
}

/// Result alias for tensor operations.
pub type Result<T> = std::result::Result<T, Error>;
