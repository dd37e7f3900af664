//! Tensors on CUDA devices (feature `cuda`): [`Device::Cuda`] storages, host↔device moves, and
//! the ops GPU training runs on them ([`ops`]), plus [`MixedAdamW`], AdamW on f32 master weights
//! for bf16 (or f32) parameters.
//!
//! A CUDA storage holds one `rtx_kernels::cuda::Buffer` (f32, bf16 or u32) from its device's
//! caching allocator. Every op of a device runs on that device's one stream, in order, so ops
//! return as soon as their kernels are queued; only reading elements on the host
//! ([`Tensor::to_data`], `item`, `to_device(Cpu)`) waits. Devices are opened once per process and
//! shared ([`device`]); they are hardware handles, not protocol state.
//!
//! Coverage: the ops of a GPT training step (linear, layer norm, GELU, add with a broadcast over
//! leading dimensions, embedding, causal attention on packed QKV, cross-entropy with mean
//! reduction), their backward, casts between f32 and bf16, and the in-place updates gradient
//! accumulation and optimizers use. They take dense operands (contiguous, covering their storage).
//! The general ops of [`general`] (`mul` with any broadcast, batched `matmul`, `softmax`,
//! `log_softmax`, `sum`, `mean`) also take strided views. Any other op, or a strided view where a
//! dense operand is needed, on a device tensor is an [`Error::UnsupportedDevice`] or
//! [`Error::NotContiguous`], never a silent host round trip. Mixed precision follows llm.c:
//! bf16 parameters, activations and gradients, f32 accumulation inside every kernel, and f32
//! master weights and moments in [`MixedAdamW`].

/// Runs `$f::<T>(args)` for the float dtype `$dtype` (f32 or bf16); defined before the modules
/// that use it (`ops`, `jepa`).
macro_rules! dispatch {
    ($op:expr, $dtype:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            rtx_kernels::DType::F32 => $f::<f32>($($arg),*),
            rtx_kernels::DType::BF16 => $f::<half::bf16>($($arg),*),
            other => Err($crate::error::Error::UnsupportedDType { op: $op, dtype: other }),
        }
    };
}

pub(crate) mod ops;
mod optim;
pub(crate) mod packed;
pub(crate) mod backend;
pub(crate) mod general;
pub(crate) mod jepa;
pub(crate) mod views;

pub use optim::MixedAdamW;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};

use half::bf16;
use parking_lot::{MappedRwLockReadGuard, RwLockReadGuard};
use rtx_kernels::cuda::{Buffer, Device as CudaDevice, DeviceElem, StorageElem};
use rtx_kernels::{DType, Device};

use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::storage::{CpuData, Storage};
use crate::tensor::Tensor;

/// The elements of a CUDA storage.
pub enum DeviceData {
    /// f32 elements.
    F32(Buffer<f32>),
    /// bf16 elements.
    BF16(Buffer<bf16>),
    /// u32 elements (token ids, targets).
    U32(Buffer<u32>),
}

impl DeviceData {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            DeviceData::F32(b) => b.len(),
            DeviceData::BF16(b) => b.len(),
            DeviceData::U32(b) => b.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The dtype of the elements.
    pub fn dtype(&self) -> DType {
        match self {
            DeviceData::F32(_) => DType::F32,
            DeviceData::BF16(_) => DType::BF16,
            DeviceData::U32(_) => DType::U32,
        }
    }
}

impl std::fmt::Debug for DeviceData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceData::F32(b) => b.fmt(f),
            DeviceData::BF16(b) => b.fmt(f),
            DeviceData::U32(b) => b.fmt(f),
        }
    }
}

/// A float storage type of device tensors (f32 or bf16).
pub(crate) trait GpuFloat: StorageElem + rtx_kernels::cuda::GemmElem {
    /// The buffer, when the data has this type.
    fn buffer(data: &DeviceData) -> Option<&Buffer<Self>>;
    /// The buffer, writable, when the data has this type.
    fn buffer_mut(data: &mut DeviceData) -> Option<&mut Buffer<Self>>;
    /// Wraps a buffer.
    fn wrap(buffer: Buffer<Self>) -> DeviceData;
}

impl GpuFloat for f32 {
    fn buffer(data: &DeviceData) -> Option<&Buffer<f32>> {
        match data {
            DeviceData::F32(b) => Some(b),
            _ => None,
        }
    }
    fn buffer_mut(data: &mut DeviceData) -> Option<&mut Buffer<f32>> {
        match data {
            DeviceData::F32(b) => Some(b),
            _ => None,
        }
    }
    fn wrap(buffer: Buffer<f32>) -> DeviceData {
        DeviceData::F32(buffer)
    }
}

impl GpuFloat for bf16 {
    fn buffer(data: &DeviceData) -> Option<&Buffer<bf16>> {
        match data {
            DeviceData::BF16(b) => Some(b),
            _ => None,
        }
    }
    fn buffer_mut(data: &mut DeviceData) -> Option<&mut Buffer<bf16>> {
        match data {
            DeviceData::BF16(b) => Some(b),
            _ => None,
        }
    }
    fn wrap(buffer: Buffer<bf16>) -> DeviceData {
        DeviceData::BF16(buffer)
    }
}

static DEVICES: OnceLock<Mutex<BTreeMap<usize, Arc<CudaDevice>>>> = OnceLock::new();

/// The process's handle to CUDA device `ordinal`, opened on first use. A missing driver or
/// library, or a device that does not exist, is an error.
pub fn device(ordinal: usize) -> Result<Arc<CudaDevice>> {
    let mut map = DEVICES.get_or_init(|| Mutex::new(BTreeMap::new())).lock().unwrap_or_else(|e| e.into_inner());
    if let Some(d) = map.get(&ordinal) {
        return Ok(d.clone());
    }
    let d = Arc::new(CudaDevice::new(ordinal)?);
    map.insert(ordinal, d.clone());
    Ok(d)
}

/// The device handle of a tensor on a CUDA device.
pub(crate) fn device_of(op: &'static str, t: &Tensor) -> Result<(usize, Arc<CudaDevice>)> {
    match t.device() {
        Device::Cuda(i) => Ok((i, device(i)?)),
        Device::Cpu => Err(Error::UnsupportedDevice { op, device: Device::Cpu }),
    }
}

/// A fresh tensor of `shape` owning `data` on CUDA device `ordinal` (no graph node).
pub(crate) fn tensor_from(ordinal: usize, data: DeviceData, shape: &[usize]) -> Tensor {
    let dtype = data.dtype();
    Tensor::from_parts(Storage::new_cuda(Device::Cuda(ordinal), data), Layout::contiguous(shape), dtype, false, None)
}

/// Copies a host tensor to CUDA device `ordinal` (contiguous, same dtype; f64 is refused: the
/// device kernels are f32/bf16).
pub(crate) fn upload(t: &Tensor, ordinal: usize) -> Result<Tensor> {
    let dev = device(ordinal)?;
    let l = t.layout();
    if l.is_contiguous() && l.offset() == 0 && t.storage().len() == t.numel() {
        // Dense: copied straight from the host storage (no intermediate host copy).
        let data = {
            let host = t.storage().read()?;
            match &*host {
                CpuData::F32(v) => DeviceData::F32(dev.htod(v)?),
                CpuData::BF16(v) => DeviceData::BF16(dev.htod(v)?),
                CpuData::U32(v) => DeviceData::U32(dev.htod(v)?),
                CpuData::F64(_) => return Err(Error::UnsupportedDType { op: "to_device(cuda)", dtype: DType::F64 }),
                CpuData::I64(_) => return Err(Error::UnsupportedDType { op: "to_device(cuda) (convert i64 ids with to_dtype(U32) first)", dtype: DType::I64 }),
            }
        };
        return Ok(tensor_from(ordinal, data, t.shape()).requires_grad(t.is_requires_grad() && t.is_leaf()));
    }
    let data = match t.to_data()? {
        CpuData::F32(v) => DeviceData::F32(dev.htod(&v)?),
        CpuData::BF16(v) => DeviceData::BF16(dev.htod(&v)?),
        CpuData::U32(v) => DeviceData::U32(dev.htod(&v)?),
        CpuData::F64(_) => return Err(Error::UnsupportedDType { op: "to_device(cuda)", dtype: DType::F64 }),
        CpuData::I64(_) => return Err(Error::UnsupportedDType { op: "to_device(cuda) (convert i64 ids with to_dtype(U32) first)", dtype: DType::I64 }),
    };
    Ok(tensor_from(ordinal, data, t.shape()).requires_grad(t.is_requires_grad() && t.is_leaf()))
}

/// Copies a device tensor's elements to the host (waits for the queued work), gathering a
/// strided view on the host.
pub(crate) fn download(t: &Tensor) -> Result<CpuData> {
    let (_, dev) = device_of("download", t)?;
    let full = {
        let data = t.storage().read_cuda("download")?;
        match &*data {
            DeviceData::F32(b) => CpuData::F32((dev.dtoh(b)?).into()),
            DeviceData::BF16(b) => CpuData::BF16((dev.dtoh(b)?).into()),
            DeviceData::U32(b) => CpuData::U32((dev.dtoh(b)?).into()),
        }
    };
    let layout = t.layout();
    if layout.is_contiguous() && layout.offset() == 0 && full.len() == t.numel() {
        return Ok(full);
    }
    let host = Tensor::from_parts(Storage::new(full), layout.clone(), t.dtype(), false, None);
    host.to_data()
}

/// The buffer of a dense device tensor (contiguous from offset 0 over its whole storage), read-locked.
pub(crate) fn dense<'a, T: GpuFloat>(op: &'static str, t: &'a Tensor) -> Result<MappedRwLockReadGuard<'a, Buffer<T>>> {
    check_dense(op, t)?;
    storage_buffer(op, t)
}

/// The whole buffer under a device tensor of any layout (a view reads it through its strides and
/// offset), read-locked.
pub(crate) fn storage_buffer<'a, T: GpuFloat>(op: &'static str, t: &'a Tensor) -> Result<MappedRwLockReadGuard<'a, Buffer<T>>> {
    let guard = t.storage().read_cuda(op)?;
    let dtype = guard.dtype();
    RwLockReadGuard::try_map(guard, |d| T::buffer(d)).map_err(|_| Error::DTypeMismatch { op, lhs: dtype, rhs: <T as DeviceElem>::DTYPE })
}

/// `t` itself (detached) when dense, else a dense device copy of it (no graph node either way).
pub(crate) fn dense_detached(t: &Tensor) -> Result<Tensor> {
    if check_dense("dense", t).is_ok() {
        return Ok(t.detach());
    }
    views::contiguous(&t.detach())
}

/// Runs `f` on the elements of a dense device tensor (contiguous from offset 0 over its whole
/// storage) under the storage's write lock. This is how code outside this crate hands a tensor's
/// device memory to a library that works on [`Buffer`]s, NCCL in `rtx-collectives`: work queued
/// on the device's stream ([`device`]`(ordinal).stream()`) is ordered with every op of the tensor.
///
/// No lock may be held across an `.await`, so an asynchronous caller takes the elements out
/// (`std::mem::replace` with an empty buffer of the same dtype), awaits with the owned buffer,
/// and puts them back with a second call before anything else uses the tensor; in between the
/// tensor holds the placeholder. The elements put back must have the tensor's dtype and length.
pub fn with_dense_data_mut<R>(t: &Tensor, f: impl FnOnce(&mut DeviceData) -> R) -> Result<R> {
    const OP: &str = "with_dense_data_mut";
    let l = t.layout();
    let mut guard = t.storage().write_cuda(OP)?;
    // An empty storage is a taken tensor whose elements are being put back.
    if !l.is_contiguous() || l.offset() != 0 || !(guard.len() == t.numel() || guard.is_empty()) {
        return Err(Error::NotContiguous { op: OP, shape: t.shape().to_vec(), strides: l.strides().to_vec() });
    }
    Ok(f(&mut guard))
}

/// The u32 buffer of a dense device tensor.
pub(crate) fn dense_u32<'a>(op: &'static str, t: &'a Tensor) -> Result<MappedRwLockReadGuard<'a, Buffer<u32>>> {
    check_dense(op, t)?;
    let guard = t.storage().read_cuda(op)?;
    let dtype = guard.dtype();
    RwLockReadGuard::try_map(guard, |d| match d {
        DeviceData::U32(b) => Some(b),
        _ => None,
    })
    .map_err(|_| Error::DTypeMismatch { op, lhs: dtype, rhs: DType::U32 })
}

fn check_dense(op: &'static str, t: &Tensor) -> Result<()> {
    let l = t.layout();
    if !l.is_contiguous() || l.offset() != 0 || t.storage().len() != t.numel() {
        return Err(Error::NotContiguous { op, shape: t.shape().to_vec(), strides: l.strides().to_vec() });
    }
    Ok(())
}

/// `shape` filled with `value` on CUDA device `ordinal`.
pub(crate) fn full(ordinal: usize, shape: &[usize], value: f64, dtype: DType) -> Result<Tensor> {
    let dev = device(ordinal)?;
    let n: usize = shape.iter().product();
    let data = match dtype {
        DType::F32 => {
            let mut b = dev.alloc::<f32>(n)?;
            dev.fill(&mut b, value as f32)?;
            DeviceData::F32(b)
        }
        DType::BF16 => {
            let mut b = dev.alloc::<bf16>(n)?;
            dev.fill(&mut b, value as f32)?;
            DeviceData::BF16(b)
        }
        other => return Err(Error::UnsupportedDType { op: "full(cuda)", dtype: other }),
    };
    Ok(tensor_from(ordinal, data, shape))
}

/// Moves every parameter of `module` to CUDA device `ordinal` in `dtype` (f32 or bf16), as leaves
/// that require grad; returns the f32 host values they were rounded from, in visit order (the
/// master weights for [`MixedAdamW::new`]).
pub fn move_module(module: &mut dyn crate::nn::Module, ordinal: usize, dtype: DType) -> Result<Vec<Tensor>> {
    let mut masters = Vec::new();
    let mut failure = None;
    module.visit_params_mut("", &mut |_, p| {
        if failure.is_some() {
            return;
        }
        let moved = p.to_dtype(DType::F32).and_then(|master| {
            let on_device = upload(&master.detach().to_dtype(dtype)?, ordinal)?;
            Ok((master.detach(), on_device.requires_grad(true)))
        });
        match moved {
            Ok((master, on_device)) => {
                masters.push(master);
                *p = on_device;
            }
            Err(e) => failure = Some(e),
        }
    });
    match failure {
        Some(e) => Err(e),
        None => Ok(masters),
    }
}

/// Moves every buffer of `module` (non-trainable state such as an EMA target encoder) to CUDA
/// device `ordinal` in `dtype`, detached. An I-JEPA trained in bf16 keeps its target encoder in
/// f32 here: the EMA state, which bf16 could not hold (a step of `(1 − m)·Δ` vanishes below
/// bf16's resolution).
pub fn move_buffers(module: &mut dyn crate::nn::Module, ordinal: usize, dtype: DType) -> Result<()> {
    let mut failure = None;
    module.visit_buffers_mut("", &mut |_, b| {
        if failure.is_some() {
            return;
        }
        match b.detach().to_dtype(dtype).and_then(|t| upload(&t, ordinal)) {
            Ok(moved) => *b = moved,
            Err(e) => failure = Some(e),
        }
    });
    failure.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether this machine can run CUDA (tests that need a GPU return early without one; the
    /// GPU checks themselves live in `examples/gpt_gpu.rs`).
    fn has_gpu() -> bool {
        rtx_kernels::cuda::Device::count().is_ok_and(|n| n > 0)
    }

    #[test]
    fn moving_to_a_missing_gpu_is_a_clear_error() {
        // Goal: on a machine without a driver or device, to_device(Cuda) is a typed error that
        // names the problem, never a panic inside cudarc.
        if has_gpu() {
            return;
        }
        let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3]).unwrap();
        let err = t.to_device(Device::Cuda(0)).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("CUDA") || msg.contains("cuda"), "unexpected error: {msg}");
    }

    #[test]
    fn host_tensors_refuse_device_reads() {
        // Goal: asking a host storage for device elements is an error, not a silent copy.
        let t = Tensor::from_vec(vec![1.0f32, 2.0], &[2]).unwrap();
        assert!(matches!(t.storage().read_cuda("test"), Err(Error::UnsupportedDevice { .. })));
        assert!(ops::linear(&t.reshape(&[1, 2]).unwrap(), &t.reshape(&[1, 2]).unwrap(), None).is_err());
    }
}
