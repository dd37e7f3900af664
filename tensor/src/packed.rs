//! Many tensors to and from one flat host storage in one transfer: the host mirror of a
//! data-parallel model whose parameters stay on a GPU (its gradients go down bucket by bucket and
//! come back averaged). On the host this is a plain copy per tensor. For device tensors the parts
//! are packed into one device buffer and copied down once (and the reverse: one copy up, then
//! unpacked on the device), so a bucket of a hundred gradients waits for the device once instead
//! of once per gradient: with several processes time-slicing one GPU, each wait can be a whole
//! slice of another process's work.
//!
//! [`pack_dense`] / [`unpack_dense`] are the same packing without the host: the parts go into one
//! fresh dense 1-d tensor on their own device and come back out of it as fresh dense tensors
//! there. The device data-parallel path reduces that flat tensor where it is (NCCL, one GPU per
//! rank); on the host they are plain copies, which is how CPU tests run that path.

use crate::error::{Error, Result};
use crate::storage::{CpuData, Storage};
use crate::tensor::Tensor;
use rtx_kernels::{DType, Device};

/// Copies `parts` back to back into the host storage `dst` from element `offset` on: each part
/// `(tensor, len)` puts the tensor's `len` elements in row-major order, or `len` zeros for `None`
/// (a parameter without a gradient). Parts must have `dst`'s dtype and live on one device.
pub fn download_packed(parts: &[(Option<&Tensor>, usize)], dst: &Storage, offset: usize) -> Result<()> {
    const OP: &str = "download_packed";
    let total: usize = parts.iter().map(|(_, len)| len).sum();
    let mut device = Device::Cpu;
    for (t, len) in parts {
        let Some(t) = t else { continue };
        if t.numel() != *len {
            return Err(Error::BadShape { op: OP, shape: t.shape().to_vec(), reason: format!("a part of {len} elements") });
        }
        if device == Device::Cpu {
            device = t.device();
        } else if t.device() != device {
            return Err(Error::DeviceMismatch { op: OP, lhs: device, rhs: t.device() });
        }
    }
    {
        let guard = dst.read()?;
        if offset + total > guard.len() {
            return Err(Error::BadShape { op: OP, shape: vec![guard.len()], reason: format!("elements {offset}..{} beyond the storage", offset + total) });
        }
        if let Some(t) = parts.iter().find_map(|(t, _)| t.filter(|t| t.dtype() != guard.dtype())) {
            return Err(Error::DTypeMismatch { op: OP, lhs: guard.dtype(), rhs: t.dtype() });
        }
    }
    if let Some(backend) = crate::backend::of_device(device) {
        return backend.download_packed(parts, total, dst, offset);
    }
    let mut guard = dst.write()?;
    let dtype = guard.dtype();
    let mut at = offset;
    for (t, len) in parts {
        match t {
            Some(t) => guard.write_at(at, &t.to_data()?)?,
            None => guard.write_at(at, &CpuData::zeros(dtype, *len))?,
        }
        at += len;
    }
    Ok(())
}

/// One fresh tensor per shape on `device`, filled from consecutive elements of the host storage
/// `src` from `offset` on (the reverse of [`download_packed`]), in `src`'s dtype.
pub fn upload_packed(src: &Storage, offset: usize, shapes: &[Vec<usize>], device: Device) -> Result<Vec<Tensor>> {
    const OP: &str = "upload_packed";
    let total: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
    {
        let guard = src.read()?;
        if offset + total > guard.len() {
            return Err(Error::BadShape { op: OP, shape: vec![guard.len()], reason: format!("elements {offset}..{} beyond the storage", offset + total) });
        }
    }
    if let (Some(backend), Device::Cuda(ordinal)) = (crate::backend::of_device(device), device) {
        return backend.upload_packed(src, offset, total, shapes, ordinal);
    }
    if device != Device::Cpu {
        return Err(Error::UnsupportedDevice { op: OP, device });
    }
    let dtype = src.read()?.dtype();
    let flat = Tensor::from_parts(src.clone(), crate::layout::Layout::contiguous(&[src.len()]), dtype, false, None);
    unpack_dense(&flat, offset, shapes)
}

/// Packs `parts` back to back into one fresh dense 1-d tensor of `dtype` on `device` (no graph
/// node): each part `(tensor, len)` contributes the tensor's `len` elements in row-major order, or
/// `len` zeros for `None`. Parts must have `dtype` and live on `device`.
pub fn pack_dense(parts: &[(Option<&Tensor>, usize)], dtype: DType, device: Device) -> Result<Tensor> {
    const OP: &str = "pack_dense";
    let total: usize = parts.iter().map(|(_, len)| len).sum();
    for (t, len) in parts {
        let Some(t) = t else { continue };
        if t.numel() != *len {
            return Err(Error::BadShape { op: OP, shape: t.shape().to_vec(), reason: format!("a part of {len} elements") });
        }
        if t.device() != device {
            return Err(Error::DeviceMismatch { op: OP, lhs: device, rhs: t.device() });
        }
        if t.dtype() != dtype {
            return Err(Error::DTypeMismatch { op: OP, lhs: dtype, rhs: t.dtype() });
        }
    }
    if let (Some(backend), Device::Cuda(ordinal)) = (crate::backend::of_device(device), device) {
        return backend.pack_dense(parts, total, dtype, ordinal);
    }
    if device != Device::Cpu {
        return Err(Error::UnsupportedDevice { op: OP, device });
    }
    let mut flat = CpuData::zeros(dtype, total);
    let mut at = 0;
    for (t, len) in parts {
        if let Some(t) = t {
            flat.write_at(at, &t.to_data()?)?;
        }
        at += len;
    }
    debug_assert_eq!(at, total, "pack_dense: the parts tile the flat tensor");
    Tensor::from_data(flat, &[total])
}

/// One fresh dense tensor per shape, on `flat`'s device and in its dtype, filled from consecutive
/// elements of the dense 1-d tensor `flat` from `offset` on (the reverse of [`pack_dense`]).
pub fn unpack_dense(flat: &Tensor, offset: usize, shapes: &[Vec<usize>]) -> Result<Vec<Tensor>> {
    const OP: &str = "unpack_dense";
    let total: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
    if flat.shape().len() != 1 || offset + total > flat.numel() {
        return Err(Error::BadShape { op: OP, shape: flat.shape().to_vec(), reason: format!("a 1-d tensor holding elements {offset}..{}", offset + total) });
    }
    if let Some(backend) = crate::backend::of(&[flat]) {
        return backend.unpack_dense(flat, offset, shapes);
    }
    let mut at = offset;
    let mut out = Vec::with_capacity(shapes.len());
    for shape in shapes {
        let n: usize = shape.iter().product();
        out.push(Tensor::from_data(flat.narrow(0, at, n)?.to_data()?, shape)?);
        at += n;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_round_trip_through_one_flat_storage() -> Result<()> {
        // Goal: packing writes each part at its place (zeros for a missing one) and unpacking
        // gives the same values back in the given shapes; bad ranges and dtypes are typed errors.
        let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
        let b = Tensor::from_vec(vec![7.0f32, 8.0], &[2])?;
        let flat = Storage::new(CpuData::zeros(crate::DType::F32, 12));
        {
            let mut g = flat.write()?;
            if let CpuData::F32(v) = &mut *g {
                v.iter_mut().for_each(|x| *x = -1.0);
            }
        }
        download_packed(&[(Some(&a.transpose(0, 1)?), 6), (None, 3), (Some(&b), 2)], &flat, 1)?;
        let values = Tensor::from_parts(flat.clone(), crate::layout::Layout::contiguous(&[12]), crate::DType::F32, false, None).to_f32_vec()?;
        assert_eq!(values, vec![-1.0, 1.0, 4.0, 2.0, 5.0, 3.0, 6.0, 0.0, 0.0, 0.0, 7.0, 8.0]);
        let back = upload_packed(&flat, 1, &[vec![3, 2], vec![3], vec![2]], Device::Cpu)?;
        assert_eq!(back[0].to_f32_vec()?, a.transpose(0, 1)?.to_f32_vec()?);
        assert_eq!(back[0].shape(), [3, 2]);
        assert_eq!(back[2].to_f32_vec()?, vec![7.0, 8.0]);
        assert!(download_packed(&[(Some(&b), 2)], &flat, 11).is_err(), "beyond the storage");
        assert!(download_packed(&[(Some(&b), 3)], &flat, 0).is_err(), "wrong length");
        assert!(download_packed(&[(Some(&b.to_dtype(crate::DType::BF16)?), 2)], &flat, 0).is_err(), "wrong dtype");
        assert!(upload_packed(&flat, 10, &[vec![3]], Device::Cpu).is_err(), "beyond the storage");
        Ok(())
    }

    #[test]
    fn parts_round_trip_through_one_dense_tensor() -> Result<()> {
        // Goal: `pack_dense` puts each part at its place (zeros for a missing one) in a fresh 1-d
        // tensor and `unpack_dense` gives fresh dense tensors back; bad parts are typed errors.
        let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
        let b = Tensor::from_vec(vec![7.0f32, 8.0], &[2])?;
        let flat = pack_dense(&[(None, 1), (Some(&a.transpose(0, 1)?), 6), (None, 2), (Some(&b), 2)], DType::F32, Device::Cpu)?;
        assert_eq!(flat.shape(), [11]);
        assert_eq!(flat.to_f32_vec()?, vec![0.0, 1.0, 4.0, 2.0, 5.0, 3.0, 6.0, 0.0, 0.0, 7.0, 8.0]);
        let back = unpack_dense(&flat, 1, &[vec![3, 2], vec![2], vec![2]])?;
        assert_eq!(back[0].to_f32_vec()?, a.transpose(0, 1)?.to_f32_vec()?);
        assert_eq!(back[0].shape(), [3, 2]);
        assert_eq!(back[1].to_f32_vec()?, vec![0.0, 0.0]);
        assert_eq!(back[2].to_f32_vec()?, vec![7.0, 8.0]);
        assert!(back.iter().all(|t| t.is_contiguous() && t.layout().offset() == 0 && t.storage().len() == t.numel()), "fresh dense tensors");
        assert!(pack_dense(&[(Some(&b), 3)], DType::F32, Device::Cpu).is_err(), "wrong length");
        assert!(pack_dense(&[(Some(&b), 2)], DType::BF16, Device::Cpu).is_err(), "wrong dtype");
        assert!(unpack_dense(&flat, 10, &[vec![2]]).is_err(), "beyond the tensor");
        Ok(())
    }
}
