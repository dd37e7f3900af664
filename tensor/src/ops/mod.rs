//! Tensor operations, each with its backward. One module per family; every op validates its
//! operands (shape, dtype, device) and returns a typed error naming itself and both shapes.
//!
//! Pattern for writing an op: validate, compute the output with a kernel through
//! `float_map!`/[`Tensor::with_float_slice`], then wrap it with [`Tensor::from_op`] (fresh
//! storage) or [`Tensor::with_node`] (a view), passing a backward closure that captures what it
//! needs (inputs are captured by clone; the output arrives as an argument to avoid cycles).
//! Backward closures are written with tensor ops so they work on every dtype and device.

pub(crate) mod attention;
pub(crate) mod binary;
pub(crate) mod checksum;
pub(crate) mod dropout;
pub(crate) mod index;
pub(crate) mod linear_cross_entropy;
pub(crate) mod matmul;
pub(crate) mod norm;
pub(crate) mod reduce;
pub(crate) mod shape;
pub(crate) mod softmax;
pub(crate) mod unary;
pub(crate) mod view;

use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Checks two operands share dtype and device.
pub(crate) fn check_same(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch { op, lhs: a.dtype(), rhs: b.dtype() });
    }
    if a.device() != b.device() {
        return Err(Error::DeviceMismatch { op, lhs: a.device(), rhs: b.device() });
    }
    Ok(())
}

/// Checks an operand lives on the host: an op with only a CPU kernel refuses a device tensor
/// with a typed error rather than computing on a host copy and returning a host tensor.
pub(crate) fn check_host(op: &'static str, a: &Tensor) -> Result<()> {
    match a.device() {
        rtx_kernels::Device::Cpu => Ok(()),
        device => Err(Error::UnsupportedDevice { op, device }),
    }
}

/// Checks an operand is a float tensor.
pub(crate) fn check_float(op: &'static str, a: &Tensor) -> Result<()> {
    if !a.dtype().is_float() {
        return Err(Error::UnsupportedDType { op, dtype: a.dtype() });
    }
    Ok(())
}
