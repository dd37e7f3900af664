//! Dense copies of strided device views without a trip through the host: [`contiguous`] (a
//! permuted, narrowed or broadcast view copied into a fresh dense tensor), [`cat`] (each part
//! copied into its slot of the output; the backward hands each part a dense slice of the
//! gradient) and [`narrow_grad`] (a gradient placed into zeros of the full shape). All three
//! go through one strided-copy kernel (`rtx_kernels::cuda::Device::strided_copy`) and keep the
//! dtype (f32, bf16 or u32).

use rtx_kernels::cuda::{Device as CudaDevice, StridedSide};
use rtx_kernels::DType;

use super::{device_of, tensor_from, DeviceData};
use crate::error::{Error, Result};
use crate::layout::contiguous_strides;
use crate::tensor::Tensor;

/// Zeroed (or uninitialised when `zero` is false) device data of `n` elements of `dtype`.
fn alloc(dev: &CudaDevice, op: &'static str, dtype: DType, n: usize, zero: bool) -> Result<DeviceData> {
    Ok(match (dtype, zero) {
        (DType::F32, false) => DeviceData::F32(dev.alloc(n)?),
        (DType::F32, true) => DeviceData::F32(dev.zeros(n)?),
        (DType::BF16, false) => DeviceData::BF16(dev.alloc(n)?),
        (DType::BF16, true) => DeviceData::BF16(dev.zeros(n)?),
        (DType::U32, false) => DeviceData::U32(dev.alloc(n)?),
        (DType::U32, true) => DeviceData::U32(dev.zeros(n)?),
        (other, _) => return Err(Error::UnsupportedDType { op, dtype: other }),
    })
}

/// Copies the elements of `x` (any strides and offset) into `dst` through `to`.
fn copy_into(op: &'static str, dev: &CudaDevice, x: &Tensor, dst: &mut DeviceData, to: StridedSide<'_>) -> Result<()> {
    let src = x.storage().read_cuda(op)?;
    let from = StridedSide { strides: x.layout().strides(), offset: x.layout().offset() };
    let shape = x.shape();
    match (&*src, dst) {
        (DeviceData::F32(s), DeviceData::F32(d)) => dev.strided_copy(s, from, d, to, shape)?,
        (DeviceData::BF16(s), DeviceData::BF16(d)) => dev.strided_copy(s, from, d, to, shape)?,
        (DeviceData::U32(s), DeviceData::U32(d)) => dev.strided_copy(s, from, d, to, shape)?,
        (s, d) => return Err(Error::DTypeMismatch { op, lhs: d.dtype(), rhs: s.dtype() }),
    }
    Ok(())
}

/// A dense copy of the device view `x`, recording `contiguous`'s backward (the gradient as is).
pub(crate) fn contiguous(x: &Tensor) -> Result<Tensor> {
    const OP: &str = "contiguous";
    let (ordinal, dev) = device_of(OP, x)?;
    let mut data = alloc(&dev, OP, x.dtype(), x.numel(), false)?;
    let strides = contiguous_strides(x.shape());
    copy_into(OP, &dev, x, &mut data, StridedSide { strides: &strides, offset: 0 })?;
    let t = tensor_from(ordinal, data, x.shape());
    Ok(Tensor::with_node(t.storage().clone(), t.layout().clone(), x.dtype(), OP, &[x], |g: &Tensor, _: &Tensor| Ok(vec![Some(g.clone())])))
}

/// `tensors` (already checked: same device, dtype and shape off `dim`) joined along `dim`.
pub(crate) fn cat(tensors: &[&Tensor], dim: usize) -> Result<Tensor> {
    const OP: &str = "cat";
    let first = tensors.first().ok_or_else(|| Error::InvalidArgument { op: OP, reason: "no tensors".into() })?;
    let (ordinal, dev) = device_of(OP, first)?;
    let sizes: Vec<usize> = tensors.iter().map(|t| t.shape()[dim]).collect();
    let mut shape = first.shape().to_vec();
    shape[dim] = sizes.iter().sum();
    let strides = contiguous_strides(&shape);
    let mut data = alloc(&dev, OP, first.dtype(), shape.iter().product(), false)?;
    let mut start = 0;
    for (t, &s) in tensors.iter().zip(&sizes) {
        if t.device() != first.device() {
            return Err(Error::DeviceMismatch { op: OP, lhs: first.device(), rhs: t.device() });
        }
        copy_into(OP, &dev, t, &mut data, StridedSide { strides: &strides, offset: start * strides[dim] })?;
        start += s;
    }
    let t = tensor_from(ordinal, data, &shape);
    Ok(Tensor::with_node(t.storage().clone(), t.layout().clone(), first.dtype(), OP, tensors, move |g: &Tensor, _: &Tensor| {
        let mut start = 0;
        let mut grads = Vec::with_capacity(sizes.len());
        for &s in &sizes {
            grads.push(Some(crate::no_grad(|| contiguous(&g.narrow(dim as isize, start, s)?))?));
            start += s;
        }
        Ok(grads)
    }))
}

/// The gradient of `narrow(dim, start, len)` of a tensor whose `dim` had `full` elements: `g`
/// placed at `start` inside zeros (its own backward narrows again).
pub(crate) fn narrow_grad(g: &Tensor, dim: usize, start: usize, full: usize) -> Result<Tensor> {
    const OP: &str = "narrow_backward";
    let (ordinal, dev) = device_of(OP, g)?;
    let mut shape = g.shape().to_vec();
    let len = shape[dim];
    shape[dim] = full;
    let strides = contiguous_strides(&shape);
    let mut data = alloc(&dev, OP, g.dtype(), shape.iter().product(), true)?;
    copy_into(OP, &dev, g, &mut data, StridedSide { strides: &strides, offset: start * strides[dim] })?;
    let t = tensor_from(ordinal, data, &shape);
    Ok(Tensor::with_node(t.storage().clone(), t.layout().clone(), g.dtype(), OP, &[g], move |gg: &Tensor, _: &Tensor| Ok(vec![Some(gg.narrow(dim as isize, start, len)?)])))
}
