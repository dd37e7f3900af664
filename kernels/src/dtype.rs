//! Element types and devices shared by every floor above: which numbers a buffer holds and where it lives.

use std::fmt;

/// The element type of a buffer or tensor.
///
/// Floating types compute in f32 (f64 stays f64); `BF16` is a storage format converted to f32 for
/// compute. `U32` holds indices and labels (embedding ids, class targets, argmax results) and is
/// never differentiated. `I64` holds signed integers as PyTorch keeps them (class targets with
/// `ignore_index = -100`, token ids, integer tensors of a loaded `state_dict`); it is never
/// differentiated either, and ops that index with it check that each value fits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// IEEE 754 single precision.
    F32,
    /// IEEE 754 double precision (gradient checks, reference computations).
    F64,
    /// bfloat16 storage with f32 compute.
    BF16,
    /// Unsigned 32-bit integers (indices, labels).
    U32,
    /// Signed 64-bit integers (PyTorch's `torch.long`: targets, ids, integer buffers).
    I64,
}

impl DType {
    /// Bytes per element.
    pub const fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::U32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::BF16 => 2,
        }
    }

    /// Whether the type is a floating-point type (can carry gradients).
    pub const fn is_float(self) -> bool {
        !matches!(self, DType::U32 | DType::I64)
    }

    /// The name used in safetensors files and error messages (`F32`, `F64`, `BF16`, `U32`, `I64`).
    pub const fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F64 => "F64",
            DType::BF16 => "BF16",
            DType::U32 => "U32",
            DType::I64 => "I64",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a buffer lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Device {
    /// Host memory.
    Cpu,
    /// The CUDA device with this ordinal (needs the `cuda` feature).
    Cuda(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}
