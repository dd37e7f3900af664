//! The device side of [`crate::download_packed`] / [`crate::upload_packed`]: parts are packed
//! into (or unpacked from) one device buffer with queued device-to-device copies, so the host
//! transfer is one copy and the host waits for the device once. [`crate::pack_dense`] /
//! [`crate::unpack_dense`] are the same copies without the host transfer (nothing waits).

use half::bf16;
use rtx_kernels::cuda::{Buffer, Device as CudaDevice};

use super::{dense, device, device_of, tensor_from, GpuFloat};
use crate::error::{Error, Result};
use crate::storage::{CpuData, Storage};
use crate::tensor::Tensor;

/// Packs `parts` (checked by the caller: lengths, one device, `dst`'s dtype) into one device
/// buffer and copies it into `dst[offset..offset + total]`.
pub(crate) fn download(parts: &[(Option<&Tensor>, usize)], total: usize, dst: &Storage, offset: usize) -> Result<()> {
    const OP: &str = "download_packed";
    let Some(ordinal) = parts.iter().find_map(|(t, _)| t.map(|t| t.device())).and_then(|d| match d {
        rtx_kernels::Device::Cuda(i) => Some(i),
        rtx_kernels::Device::Cpu => None,
    }) else {
        return Err(Error::UnsupportedDevice { op: OP, device: rtx_kernels::Device::Cpu });
    };
    let dev = device(ordinal)?;
    let mut guard = dst.write()?;
    match &mut *guard {
        CpuData::F32(v) => pack_down::<f32>(&dev, parts, total, &mut v[offset..offset + total]),
        CpuData::BF16(v) => pack_down::<bf16>(&dev, parts, total, &mut v[offset..offset + total]),
        other => Err(Error::UnsupportedDType { op: OP, dtype: other.dtype() }),
    }
}

fn pack_down<T: GpuFloat>(dev: &CudaDevice, parts: &[(Option<&Tensor>, usize)], total: usize, out: &mut [T]) -> Result<()> {
    let flat = pack_flat::<T>("download_packed", dev, parts, total)?;
    Ok(dev.copy_dtoh(&flat, out)?)
}

/// `parts` back to back in one fresh device buffer of `total` elements: each part `(tensor, len)`
/// puts the tensor's `len` elements in row-major order, or `len` zeros for `None`.
fn pack_flat<T: GpuFloat>(op: &'static str, dev: &CudaDevice, parts: &[(Option<&Tensor>, usize)], total: usize) -> Result<Buffer<T>> {
    let mut flat = dev.alloc::<T>(total)?;
    if parts.iter().any(|(t, _)| t.is_none()) {
        dev.fill(&mut flat, 0.0)?;
    }
    let mut at = 0;
    for (t, len) in parts {
        if let Some(t) = t {
            // A strided view (not what a gradient is) is made dense on the device first.
            let dense_copy;
            let t = if t.is_contiguous() && t.layout().offset() == 0 && t.storage().len() == t.numel() {
                *t
            } else {
                dense_copy = t.contiguous()?;
                &dense_copy
            };
            let b = dense::<T>(op, t)?;
            dev.copy_dtod_range(&b, 0, &mut flat, at, *len)?;
        }
        at += len;
    }
    debug_assert_eq!(at, total, "{op}: the parts tile the flat buffer");
    Ok(flat)
}

/// One host-to-device copy of `src[offset..offset + total]`, unpacked into fresh tensors.
pub(crate) fn upload(src: &Storage, offset: usize, total: usize, shapes: &[Vec<usize>], ordinal: usize) -> Result<Vec<Tensor>> {
    const OP: &str = "upload_packed";
    let dev = device(ordinal)?;
    let guard = src.read()?;
    match &*guard {
        CpuData::F32(v) => unpack_up::<f32>(&dev, ordinal, &v[offset..offset + total], shapes),
        CpuData::BF16(v) => unpack_up::<bf16>(&dev, ordinal, &v[offset..offset + total], shapes),
        other => Err(Error::UnsupportedDType { op: OP, dtype: other.dtype() }),
    }
}

fn unpack_up<T: GpuFloat>(dev: &CudaDevice, ordinal: usize, src: &[T], shapes: &[Vec<usize>]) -> Result<Vec<Tensor>> {
    let flat = dev.htod(src)?;
    let mut at = 0;
    let mut out = Vec::with_capacity(shapes.len());
    for shape in shapes {
        let n: usize = shape.iter().product();
        let mut b = dev.alloc::<T>(n)?;
        dev.copy_dtod_range(&flat, at, &mut b, 0, n)?;
        out.push(tensor_from(ordinal, T::wrap(b), shape));
        at += n;
    }
    // `flat` returns to the caching allocator now; the copies out of it are queued on the same
    // stream, so whatever reuses the block runs after them.
    Ok(out)
}

/// Packs `parts` (checked by the caller: lengths, device `ordinal`, `dtype`) into one fresh dense
/// device tensor of `total` elements; only queues copies.
pub(crate) fn pack(parts: &[(Option<&Tensor>, usize)], total: usize, dtype: rtx_kernels::DType, ordinal: usize) -> Result<Tensor> {
    let dev = device(ordinal)?;
    dispatch!("pack_dense", dtype, pack_on(&dev, ordinal, parts, total))
}

fn pack_on<T: GpuFloat>(dev: &CudaDevice, ordinal: usize, parts: &[(Option<&Tensor>, usize)], total: usize) -> Result<Tensor> {
    let flat = pack_flat::<T>("pack_dense", dev, parts, total)?;
    Ok(tensor_from(ordinal, T::wrap(flat), &[total]))
}

/// Fresh dense device tensors of `shapes` from consecutive elements of the dense 1-d device
/// tensor `flat` from `offset` on (range checked by the caller); only queues copies.
pub(crate) fn unpack(flat: &Tensor, offset: usize, shapes: &[Vec<usize>]) -> Result<Vec<Tensor>> {
    let (ordinal, dev) = device_of("unpack_dense", flat)?;
    dispatch!("unpack_dense", flat.dtype(), unpack_on(&dev, ordinal, flat, offset, shapes))
}

fn unpack_on<T: GpuFloat>(dev: &CudaDevice, ordinal: usize, flat: &Tensor, offset: usize, shapes: &[Vec<usize>]) -> Result<Vec<Tensor>> {
    let src = dense::<T>("unpack_dense", flat)?;
    let mut at = offset;
    let mut out = Vec::with_capacity(shapes.len());
    for shape in shapes {
        let n: usize = shape.iter().product();
        let mut b = dev.alloc::<T>(n)?;
        dev.copy_dtod_range(&src, at, &mut b, 0, n)?;
        out.push(tensor_from(ordinal, T::wrap(b), shape));
        at += n;
    }
    Ok(out)
}
