//! The [`Tensor`] type: a shared storage, a layout, a dtype and a device, plus the autograd
//! metadata (whether it needs a gradient, the node that made it, its accumulated gradient).
//!
//! Tensors are cheap to clone (an `Arc`). Views (reshape, permute, narrow, expand) share
//! storage; ops write fresh storages. This module holds construction, element access and the
//! compute helpers ([`FloatSlice`], [`FloatVec`]) that op modules use to run kernels generically
//! over f32 and f64 (bf16 is widened to f32 for compute and rounded back on output).

use crate::autograd::{self, BackwardFn, Node};
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::rng::Generator;
use crate::storage::{CpuData, Storage};
use half::bf16;
use parking_lot::RwLock;
use rtx_kernels::{convert, elementwise, DType, Device};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Identity of a tensor object (not of its storage), unique within the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId(u64);

impl TensorId {
    fn fresh() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        TensorId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// An n-dimensional array with autograd. Cloning shares it.
#[derive(Clone)]
pub struct Tensor(pub(crate) Arc<Inner>);

pub(crate) struct Inner {
    pub(crate) id: TensorId,
    pub(crate) storage: Storage,
    pub(crate) layout: Layout,
    pub(crate) dtype: DType,
    pub(crate) device: Device,
    pub(crate) requires_grad: bool,
    pub(crate) node: Option<Node>,
    pub(crate) grad: RwLock<Option<Tensor>>,
}

/// A Rust element type that maps to a [`DType`].
pub trait Element: Copy + Send + Sync + 'static {
    /// The dtype.
    const DTYPE: DType;
    /// Wraps a vector into storage data.
    fn into_data(v: Vec<Self>) -> CpuData;
    /// Borrows the elements if the data has this dtype.
    fn slice(data: &CpuData) -> Option<&[Self]>;
}

macro_rules! element {
    ($t:ty, $d:ident) => {
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            fn into_data(v: Vec<Self>) -> CpuData {
                CpuData::$d(v.into())
            }
            fn slice(data: &CpuData) -> Option<&[Self]> {
                match data {
                    CpuData::$d(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}
element!(f32, F32);
element!(f64, F64);
element!(bf16, BF16);
element!(u32, U32);
element!(i64, I64);

/// A contiguous view of a float tensor's elements in its compute type.
pub enum FloatSlice<'a> {
    /// f32 (also bf16, widened).
    F32(&'a [f32]),
    /// f64.
    F64(&'a [f64]),
}

/// Owned elements in a compute type: what op kernels produce.
pub enum FloatVec {
    /// f32 results.
    F32(Vec<f32>),
    /// f64 results.
    F64(Vec<f64>),
}

impl FloatVec {
    /// Converts the results into storage data of `dtype` (rounding to bf16 when asked).
    pub fn into_data(self, dtype: DType) -> CpuData {
        match (self, dtype) {
            (FloatVec::F32(v), DType::BF16) => CpuData::BF16(convert::f32_vec_to_bf16(&v).into()),
            (FloatVec::F32(v), DType::F64) => CpuData::F64(v.into_iter().map(f64::from).collect()),
            (FloatVec::F64(v), DType::F32) => CpuData::F32(v.into_iter().map(|x| x as f32).collect()),
            (FloatVec::F64(v), DType::BF16) => CpuData::BF16(v.into_iter().map(bf16::from_f64).collect()),
            (FloatVec::F32(v), DType::U32) => CpuData::U32(v.into_iter().map(|x| x as u32).collect()),
            (FloatVec::F64(v), DType::U32) => CpuData::U32(v.into_iter().map(|x| x as u32).collect()),
            (FloatVec::F32(v), DType::I64) => CpuData::I64(v.into_iter().map(|x| x as i64).collect()),
            (FloatVec::F64(v), DType::I64) => CpuData::I64(v.into_iter().map(|x| x as i64).collect()),
            (FloatVec::F32(v), DType::F32) => CpuData::F32(v.into()),
            (FloatVec::F64(v), DType::F64) => CpuData::F64(v.into()),
        }
    }
}

/// Runs a generic body on a tensor's contiguous compute slice and wraps the result:
/// `float_map!(t, |x: T| body)` where `body` produces a `Vec<T>` from `x: &[T]`.
#[macro_export]
#[doc(hidden)]
macro_rules! float_map {
    ($t:expr, |$x:ident : $T:ident| $body:expr) => {
        $t.with_float_slice(|__s| match __s {
            $crate::FloatSlice::F32($x) => {
                #[allow(dead_code)]
                type $T = f32;
                $crate::FloatVec::F32($body)
            }
            $crate::FloatSlice::F64($x) => {
                #[allow(dead_code)]
                type $T = f64;
                $crate::FloatVec::F64($body)
            }
        })
    };
}

/// [`float_map!`] with a fallible body: `try_float_map!(t, |x: T| body)` where `body` produces a
/// `Result<Vec<T>, E>` (`E` converts into [`crate::Error`], e.g. a kernel's error); the first error
/// is returned.
#[macro_export]
#[doc(hidden)]
macro_rules! try_float_map {
    ($t:expr, |$x:ident : $T:ident| $body:expr) => {
        $t.with_float_slice(|__s| -> $crate::Result<$crate::FloatVec> {
            match __s {
                $crate::FloatSlice::F32($x) => {
                    #[allow(dead_code)]
                    type $T = f32;
                    Ok($crate::FloatVec::F32($body?))
                }
                $crate::FloatSlice::F64($x) => {
                    #[allow(dead_code)]
                    type $T = f64;
                    Ok($crate::FloatVec::F64($body?))
                }
            }
        })
        .and_then(|r| r)
    };
}

impl Tensor {
    // ---------------------------------------------------------------- construction

    pub(crate) fn from_parts(storage: Storage, layout: Layout, dtype: DType, requires_grad: bool, node: Option<Node>) -> Tensor {
        debug_assert!(layout.storage_extent() <= storage.len(), "layout reaches past storage");
        let device = storage.device();
        Tensor(Arc::new(Inner {
            id: TensorId::fresh(),
            storage,
            layout,
            dtype,
            device,
            requires_grad,
            node,
            grad: RwLock::new(None),
        }))
    }

    /// A tensor from storage data laid out contiguously in `shape`.
    pub fn from_data(data: CpuData, shape: &[usize]) -> Result<Tensor> {
        let numel: usize = shape.iter().product();
        if data.len() != numel {
            return Err(Error::BadShape { op: "from_data", shape: shape.to_vec(), reason: format!("{} elements given, shape holds {numel}", data.len()) });
        }
        let dtype = data.dtype();
        Ok(Tensor::from_parts(Storage::new(data), Layout::contiguous(shape), dtype, false, None))
    }

    /// A tensor owning `data` in `shape` (row-major).
    pub fn from_vec<T: Element>(data: Vec<T>, shape: &[usize]) -> Result<Tensor> {
        Tensor::from_data(T::into_data(data), shape)
    }

    /// A tensor copying `data` in `shape`.
    pub fn from_slice<T: Element>(data: &[T], shape: &[usize]) -> Result<Tensor> {
        Tensor::from_vec(data.to_vec(), shape)
    }

    /// A 0-dimensional tensor holding `value`.
    pub fn scalar(value: f64, dtype: DType) -> Tensor {
        Tensor::full(&[], value, dtype)
    }

    /// A tensor of `value` in `shape`.
    pub fn full(shape: &[usize], value: f64, dtype: DType) -> Tensor {
        let n: usize = shape.iter().product();
        let data = match dtype {
            DType::F32 => CpuData::F32(vec![value as f32; n].into()),
            DType::F64 => CpuData::F64(vec![value; n].into()),
            DType::BF16 => CpuData::BF16(vec![bf16::from_f64(value); n].into()),
            DType::U32 => CpuData::U32(vec![value as u32; n].into()),
            DType::I64 => CpuData::I64(vec![value as i64; n].into()),
        };
        Tensor::from_parts(Storage::new(data), Layout::contiguous(shape), dtype, false, None)
    }

    /// Zeros in `shape`.
    pub fn zeros(shape: &[usize], dtype: DType) -> Tensor {
        Tensor::from_parts(Storage::new(CpuData::zeros(dtype, shape.iter().product())), Layout::contiguous(shape), dtype, false, None)
    }

    /// Ones in `shape`.
    pub fn ones(shape: &[usize], dtype: DType) -> Tensor {
        Tensor::full(shape, 1.0, dtype)
    }

    /// Zeros with this tensor's shape and dtype.
    pub fn zeros_like(&self) -> Tensor {
        Tensor::zeros(self.shape(), self.dtype())
    }

    /// Ones with this tensor's shape and dtype.
    pub fn ones_like(&self) -> Tensor {
        Tensor::ones(self.shape(), self.dtype())
    }

    /// `start, start+step, ...` below `end`, as a 1-d tensor.
    pub fn arange(start: f64, end: f64, step: f64, dtype: DType) -> Result<Tensor> {
        if step == 0.0 || !step.is_finite() || (end - start) / step < 0.0 {
            return Err(Error::InvalidArgument { op: "arange", reason: format!("cannot go from {start} to {end} by {step}") });
        }
        let n = ((end - start) / step).ceil() as usize;
        let v: Vec<f64> = (0..n).map(|i| start + i as f64 * step).collect();
        Ok(Tensor::from_parts(Storage::new(FloatVec::F64(v).into_data(dtype)), Layout::contiguous(&[n]), dtype, false, None))
    }

    /// Standard normal samples scaled by `std` and shifted by `mean`, drawn from `rng`.
    pub fn randn(shape: &[usize], mean: f64, std: f64, dtype: DType, rng: &mut Generator) -> Result<Tensor> {
        if !dtype.is_float() {
            return Err(Error::UnsupportedDType { op: "randn", dtype });
        }
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|_| mean + std * rng.normal()).collect();
        Ok(Tensor::from_parts(Storage::new(FloatVec::F64(v).into_data(dtype)), Layout::contiguous(shape), dtype, false, None))
    }

    /// Uniform samples in `[low, high)` drawn from `rng`.
    pub fn rand(shape: &[usize], low: f64, high: f64, dtype: DType, rng: &mut Generator) -> Result<Tensor> {
        if !dtype.is_float() {
            return Err(Error::UnsupportedDType { op: "rand", dtype });
        }
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|_| low + (high - low) * rng.uniform()).collect();
        Ok(Tensor::from_parts(Storage::new(FloatVec::F64(v).into_data(dtype)), Layout::contiguous(shape), dtype, false, None))
    }

    /// Marks this tensor as a leaf that collects gradients (a parameter). Returns a new handle
    /// sharing the storage.
    pub fn requires_grad(self, requires: bool) -> Tensor {
        Tensor::from_parts(self.0.storage.clone(), self.0.layout.clone(), self.0.dtype, requires, None)
    }

    /// The same data cut off from the graph.
    pub fn detach(&self) -> Tensor {
        Tensor::from_parts(self.0.storage.clone(), self.0.layout.clone(), self.0.dtype, false, None)
    }

    // ---------------------------------------------------------------- accessors

    /// Identity of this tensor handle.
    pub fn id(&self) -> TensorId {
        self.0.id
    }

    /// The dimensions.
    pub fn shape(&self) -> &[usize] {
        self.0.layout.shape()
    }

    /// Size of dimension `dim` (negative counts from the end).
    pub fn size(&self, dim: isize) -> Result<usize> {
        let d = crate::layout::normalize_dim("size", dim, self.rank())?;
        Ok(self.shape()[d])
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.0.layout.rank()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.0.layout.numel()
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.0.dtype
    }

    /// Device.
    pub fn device(&self) -> Device {
        self.0.device
    }

    /// Layout in the storage.
    pub fn layout(&self) -> &Layout {
        &self.0.layout
    }

    /// The shared storage.
    pub fn storage(&self) -> &Storage {
        &self.0.storage
    }

    /// Whether this tensor takes part in gradient computation.
    pub fn is_requires_grad(&self) -> bool {
        self.0.requires_grad
    }

    /// Whether this is a leaf of the graph (not produced by a differentiable op).
    pub fn is_leaf(&self) -> bool {
        self.0.node.is_none()
    }

    /// Whether the elements are packed row-major.
    pub fn is_contiguous(&self) -> bool {
        self.0.layout.is_contiguous()
    }

    /// The name of the op that produced this tensor, if any.
    pub fn op_name(&self) -> Option<&'static str> {
        self.0.node.as_ref().map(|n| n.op)
    }

    // ---------------------------------------------------------------- element access

    /// Runs `f` on the elements as a contiguous compute slice (borrowed when already
    /// contiguous f32/f64, gathered or widened otherwise). Errors on integer tensors.
    pub fn with_float_slice<R>(&self, f: impl FnOnce(FloatSlice<'_>) -> R) -> Result<R> {
        if self.device() != Device::Cpu {
            return self.to_device(Device::Cpu)?.with_float_slice(f);
        }
        let data = self.0.storage.read()?;
        let layout = &self.0.layout;
        let n = layout.numel();
        let contiguous = layout.is_contiguous();
        let range = layout.offset()..layout.offset() + n;
        match &*data {
            CpuData::F32(v) if contiguous => Ok(f(FloatSlice::F32(&v[range]))),
            CpuData::F64(v) if contiguous => Ok(f(FloatSlice::F64(&v[range]))),
            CpuData::F32(v) => {
                let g = gather(layout, v)?;
                let r = f(FloatSlice::F32(&g));
                crate::pool::give(g);
                Ok(r)
            }
            CpuData::F64(v) => {
                let g = gather(layout, v)?;
                let r = f(FloatSlice::F64(&g));
                crate::pool::give(g);
                Ok(r)
            }
            CpuData::BF16(v) => {
                let g = if contiguous { convert::bf16_vec_to_f32(&v[range]) } else { convert::bf16_vec_to_f32(&gather(layout, v)?) };
                Ok(f(FloatSlice::F32(&g)))
            }
            CpuData::U32(_) => Err(Error::UnsupportedDType { op: "float op", dtype: DType::U32 }),
            CpuData::I64(_) => Err(Error::UnsupportedDType { op: "float op", dtype: DType::I64 }),
        }
    }

    /// The elements of an integer tensor as u32, contiguous: a u32 tensor as is, an i64 tensor
    /// checked element by element ([`Error::IntegerOutOfRange`] for the first value outside
    /// `0..=u32::MAX`, so i64 ids and labels index like u32 ones).
    pub fn to_u32_vec(&self) -> Result<Vec<u32>> {
        if self.device() != Device::Cpu {
            return self.to_device(Device::Cpu)?.to_u32_vec();
        }
        let data = self.0.storage.read()?;
        match &*data {
            CpuData::U32(v) => gather(&self.0.layout, v),
            CpuData::I64(v) => {
                let wide = gather(&self.0.layout, v)?;
                let narrow = checked_u32(&wide);
                crate::pool::give(wide);
                narrow
            }
            other => Err(Error::DTypeMismatch { op: "to_u32_vec", lhs: other.dtype(), rhs: DType::U32 }),
        }
    }

    /// The elements of an integer tensor (u32 or i64) as i64, contiguous.
    pub fn to_i64_vec(&self) -> Result<Vec<i64>> {
        if self.device() != Device::Cpu {
            return self.to_device(Device::Cpu)?.to_i64_vec();
        }
        let data = self.0.storage.read()?;
        match &*data {
            CpuData::I64(v) => gather(&self.0.layout, v),
            CpuData::U32(v) => Ok(gather(&self.0.layout, v)?.into_iter().map(i64::from).collect()),
            other => Err(Error::DTypeMismatch { op: "to_i64_vec", lhs: other.dtype(), rhs: DType::I64 }),
        }
    }

    /// The elements as f32, contiguous (any float dtype; u32 converts exactly up to 2^24).
    /// A device tensor is copied to the host once (the copy is the result in f32; bf16 is widened
    /// from it), as host-staged collectives read their operands.
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        if self.dtype() == DType::U32 {
            return Ok(self.to_u32_vec()?.into_iter().map(|x| x as f32).collect());
        }
        if self.dtype() == DType::I64 {
            return Ok(self.to_i64_vec()?.into_iter().map(|x| x as f32).collect());
        }
        if let Some(device) = crate::backend::of(&[self]) {
            return match device.download(self)? {
                CpuData::F32(v) => Ok(v.into_vec()),
                CpuData::BF16(v) => Ok(convert::bf16_vec_to_f32(&v)),
                other => Err(Error::UnsupportedDType { op: "to_f32_vec", dtype: other.dtype() }),
            };
        }
        Ok(match self.with_float_slice(|s| match s {
            FloatSlice::F32(x) => FloatVec::F32(x.to_vec()),
            FloatSlice::F64(x) => FloatVec::F64(x.to_vec()),
        })? {
            FloatVec::F32(v) => v,
            FloatVec::F64(v) => v.into_iter().map(|x| x as f32).collect(),
        })
    }

    /// The elements as f64, contiguous.
    pub fn to_f64_vec(&self) -> Result<Vec<f64>> {
        if self.dtype() == DType::U32 {
            return Ok(self.to_u32_vec()?.into_iter().map(f64::from).collect());
        }
        if self.dtype() == DType::I64 {
            return Ok(self.to_i64_vec()?.into_iter().map(|x| x as f64).collect());
        }
        Ok(match self.with_float_slice(|s| match s {
            FloatSlice::F32(x) => FloatVec::F32(x.to_vec()),
            FloatSlice::F64(x) => FloatVec::F64(x.to_vec()),
        })? {
            FloatVec::F32(v) => v.into_iter().map(f64::from).collect(),
            FloatVec::F64(v) => v,
        })
    }

    /// The single element of a one-element tensor.
    pub fn item(&self) -> Result<f64> {
        if self.numel() != 1 {
            return Err(Error::BadShape { op: "item", shape: self.shape().to_vec(), reason: "needs exactly one element".into() });
        }
        Ok(self.to_f64_vec()?[0])
    }

    /// A contiguous copy of the elements in storage form (for checkpoints and transports).
    /// A device tensor is copied to the host.
    pub fn to_data(&self) -> Result<CpuData> {
        if let Some(device) = crate::backend::of(&[self]) {
            return device.download(self);
        }
        let data = self.0.storage.read()?;
        let l = &self.0.layout;
        Ok(match &*data {
            CpuData::F32(v) => CpuData::F32(gather(l, v)?.into()),
            CpuData::F64(v) => CpuData::F64(gather(l, v)?.into()),
            CpuData::BF16(v) => CpuData::BF16(gather(l, v)?.into()),
            CpuData::U32(v) => CpuData::U32(gather(l, v)?.into()),
            CpuData::I64(v) => CpuData::I64(gather(l, v)?.into()),
        })
    }

    /// Builds an op's output from computed elements, recording the backward node when grad
    /// mode is on and any input requires grad.
    pub fn from_op(values: FloatVec, shape: &[usize], dtype: DType, op: &'static str, inputs: &[&Tensor], backward: impl BackwardFn + 'static) -> Result<Tensor> {
        let data = values.into_data(dtype);
        let numel: usize = shape.iter().product();
        if data.len() != numel {
            return Err(Error::BadShape { op, shape: shape.to_vec(), reason: format!("kernel produced {} elements", data.len()) });
        }
        Ok(Tensor::with_node(Storage::new(data), Layout::contiguous(shape), dtype, op, inputs, backward))
    }

    /// Wraps a storage/layout (a view or a fresh result) and records the backward node.
    pub fn with_node(storage: Storage, layout: Layout, dtype: DType, op: &'static str, inputs: &[&Tensor], backward: impl BackwardFn + 'static) -> Tensor {
        let track = autograd::is_grad_enabled() && inputs.iter().any(|t| t.is_requires_grad());
        let node = track.then(|| Node { op, inputs: inputs.iter().map(|t| (*t).clone()).collect(), backward: Box::new(backward) });
        Tensor::from_parts(storage, layout, dtype, track, node)
    }

    /// A contiguous version (the same tensor when already contiguous).
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        // A device view is copied on its device.
        if let Some(device) = crate::backend::of(&[self]) {
            return device.contiguous(self);
        }
        let storage = Storage::new(self.to_data()?);
        let t = Tensor::with_node(storage, Layout::contiguous(self.shape()), self.dtype(), "contiguous", &[self], |g: &Tensor, _: &Tensor| Ok(vec![Some(g.clone())]));
        Ok(t)
    }

    /// A copy with another dtype (differentiable between float dtypes).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        if let Some(device) = crate::backend::of(&[self]) {
            return device.cast(self, dtype);
        }
        match (self.dtype(), dtype) {
            (DType::U32, DType::I64) => return Tensor::from_vec(self.to_i64_vec()?, self.shape()),
            (DType::I64, DType::U32) => return Tensor::from_vec(self.to_u32_vec()?, self.shape()),
            (DType::U32, _) => {
                let v = self.to_u32_vec()?;
                let vals = FloatVec::F64(v.into_iter().map(f64::from).collect());
                return Tensor::from_data(vals.into_data(dtype), self.shape());
            }
            (DType::I64, _) => {
                // Rounds past 2^53 (f64) or 2^24 (f32), as `tensor.float()` does in PyTorch.
                let vals = FloatVec::F64(self.to_i64_vec()?.into_iter().map(|x| x as f64).collect());
                return Tensor::from_data(vals.into_data(dtype), self.shape());
            }
            _ => {}
        }
        let values = float_map!(self, |x: T| x.to_vec())?;
        let from = self.dtype();
        Tensor::from_op(values, self.shape(), dtype, "to_dtype", &[self], move |g: &Tensor, _: &Tensor| Ok(vec![Some(g.to_dtype(from)?)]))
    }

    /// A copy on `device` (the same tensor when already there). Moving between devices is not
    /// recorded by autograd: a leaf that requires grad gives a leaf that requires grad (move
    /// parameters before building the optimizer). Only the CPU exists without the `cuda`
    /// feature; reading a device tensor's elements on the host waits for its queued work.
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if device == self.device() {
            return Ok(self.clone());
        }
        let requires = self.is_requires_grad() && self.is_leaf();
        match device {
            Device::Cpu => Ok(Tensor::from_data(self.to_data()?, self.shape())?.requires_grad(requires)),
            Device::Cuda(i) => {
                let backend = crate::backend::of_device(device).ok_or_else(|| Error::DeviceUnavailable { device, reason: "this build has no CUDA backend (build with --features cuda)".into() })?;
                let host = if self.device() == Device::Cpu { self.clone() } else { self.to_device(Device::Cpu)? };
                backend.upload(&host, i)
            }
        }
    }

    // ---------------------------------------------------------------- gradients

    /// The accumulated gradient of a leaf, if any.
    pub fn grad(&self) -> Option<Tensor> {
        self.0.grad.read().clone()
    }

    /// Replaces the gradient slot; a flat-bucket trainer binds it to a view of its gradient
    /// buffer so that backward accumulates straight into the bucket.
    pub fn set_grad(&self, grad: Option<Tensor>) -> Result<()> {
        if let Some(g) = &grad {
            if g.shape() != self.shape() {
                return Err(Error::ShapeMismatch { op: "set_grad", lhs: self.shape().to_vec(), rhs: g.shape().to_vec() });
            }
        }
        *self.0.grad.write() = grad;
        Ok(())
    }

    /// Zeros the gradient in place (keeping its buffer, e.g. a bucket view).
    pub fn zero_grad(&self) -> Result<()> {
        if let Some(g) = self.0.grad.read().as_ref() {
            g.zero_()?;
        }
        Ok(())
    }

    /// Adds `g` into this leaf's gradient (in place when one exists).
    pub(crate) fn accumulate_grad(&self, g: &Tensor) -> Result<()> {
        let mut slot = self.0.grad.write();
        match slot.as_ref() {
            Some(existing) => existing.add_assign_(g)?,
            None => {
                let g = g.to_dtype(self.dtype())?;
                let owned = g.is_contiguous() && g.layout().offset() == 0 && g.storage().is_unique() && g.storage().len() == g.numel();
                *slot = Some(if owned {
                    g.detach()
                } else {
                    match g.device() {
                        Device::Cpu => Tensor::from_data(g.to_data()?, g.shape())?,
                        device => crate::backend::required("accumulate_grad", device)?.clone_dense(&g)?,
                    }
                });
            }
        }
        Ok(())
    }

    // ---------------------------------------------------------------- in-place updates

    /// Runs `f` on this tensor's elements in place. The tensor must be contiguous (parameters,
    /// gradients and bucket views are). Not recorded by autograd.
    pub fn update_f32_(&self, f: impl FnOnce(&mut [f32])) -> Result<()> {
        let l = self.contiguous_range("update_")?;
        let mut data = self.0.storage.write()?;
        match &mut *data {
            CpuData::F32(v) => {
                f(&mut v[l]);
                Ok(())
            }
            CpuData::BF16(v) => {
                let mut tmp = convert::bf16_vec_to_f32(&v[l.clone()]);
                f(&mut tmp);
                convert::f32_to_bf16(&tmp, &mut v[l])?;
                Ok(())
            }
            other => Err(Error::DTypeMismatch { op: "update_f32_", lhs: other.dtype(), rhs: DType::F32 }),
        }
    }

    /// Like [`Tensor::update_f32_`] for any float dtype, through generic closures.
    pub fn update_(&self, f32_fn: impl FnOnce(&mut [f32]), f64_fn: impl FnOnce(&mut [f64])) -> Result<()> {
        if self.dtype() == DType::F64 {
            let l = self.contiguous_range("update_")?;
            let mut data = self.0.storage.write()?;
            if let CpuData::F64(v) = &mut *data {
                f64_fn(&mut v[l]);
            }
            return Ok(());
        }
        self.update_f32_(f32_fn)
    }

    fn contiguous_range(&self, op: &'static str) -> Result<std::ops::Range<usize>> {
        if !self.is_contiguous() {
            return Err(Error::NotContiguous { op, shape: self.shape().to_vec(), strides: self.layout().strides().to_vec() });
        }
        let o = self.layout().offset();
        Ok(o..o + self.numel())
    }

    /// `self += other` in place (other broadcast to self's shape). Not recorded by autograd.
    pub fn add_assign_(&self, other: &Tensor) -> Result<()> {
        if let Some(device) = crate::backend::of(&[self]) {
            return device.add_assign(self, other);
        }
        let src = self.prepare_source("add_assign_", other)?;
        match src {
            FloatVec::F32(s) => {
                let mut added = Ok(());
                let r = self.update_(|d| added = elementwise::zip_map_inplace(d, &s, |a, b| a + b), |_| {});
                crate::pool::give(s);
                r.and(added.map_err(Error::from))
            }
            FloatVec::F64(s) => {
                let mut added = Ok(());
                let r = self.update_(|_| {}, |d| added = elementwise::zip_map_inplace(d, &s, |a, b| a + b));
                crate::pool::give(s);
                r.and(added.map_err(Error::from))
            }
        }
    }

    /// Copies `other` (broadcast to self's shape) into self in place. Into a CUDA tensor, `other`
    /// must have self's shape and live on the host or the same device; it is rounded to self's
    /// dtype.
    pub fn copy_from_(&self, other: &Tensor) -> Result<()> {
        if let Some(device) = crate::backend::of(&[self]) {
            return device.copy_(self, other);
        }
        let src = self.prepare_source("copy_from_", other)?;
        match src {
            FloatVec::F32(s) => {
                let r = self.update_(|d| d.copy_from_slice(&s), |_| {});
                crate::pool::give(s);
                r
            }
            FloatVec::F64(s) => {
                let r = self.update_(|_| {}, |d| d.copy_from_slice(&s));
                crate::pool::give(s);
                r
            }
        }
    }

    /// Sets every element to zero in place.
    pub fn zero_(&self) -> Result<()> {
        if let Some(device) = crate::backend::of(&[self]) {
            return device.fill_(self, 0.0);
        }
        self.update_(|d| d.fill(0.0), |d| d.fill(0.0))
    }

    /// Multiplies every element by `k` in place.
    pub fn scale_(&self, k: f64) -> Result<()> {
        if let Some(device) = crate::backend::of(&[self]) {
            return device.scale_(self, k);
        }
        self.update_(|d| elementwise::map_inplace(d, |x| x * k as f32), |d| elementwise::map_inplace(d, |x| x * k))
    }

    /// Gathers `other` broadcast to self's shape, in self's compute type, before any lock on
    /// self's storage is taken.
    fn prepare_source(&self, op: &'static str, other: &Tensor) -> Result<FloatVec> {
        let other = if other.shape() == self.shape() { other.clone() } else { other.broadcast_to(self.shape()).map_err(|_| Error::ShapeMismatch { op, lhs: self.shape().to_vec(), rhs: other.shape().to_vec() })? };
        let want_f64 = self.dtype() == DType::F64;
        {
            // Same compute type: one (pooled) gather, no intermediate copy.
            let data = other.storage().read()?;
            match (&*data, want_f64) {
                (CpuData::F32(v), false) => return Ok(FloatVec::F32(gather(other.layout(), v)?)),
                (CpuData::F64(v), true) => return Ok(FloatVec::F64(gather(other.layout(), v)?)),
                _ => {}
            }
        }
        let v = other.with_float_slice(|s| match (s, want_f64) {
            (FloatSlice::F32(x), false) => FloatVec::F32(crate::pool::copied(x)),
            (FloatSlice::F64(x), true) => FloatVec::F64(crate::pool::copied(x)),
            (FloatSlice::F32(x), true) => FloatVec::F64(x.iter().map(|&v| v as f64).collect()),
            (FloatSlice::F64(x), false) => FloatVec::F32(x.iter().map(|&v| v as f32).collect()),
        })?;
        Ok(v)
    }
}

/// `values` as u32, or [`Error::IntegerOutOfRange`] naming the first that does not fit.
fn checked_u32(values: &[i64]) -> Result<Vec<u32>> {
    let mut out = Vec::with_capacity(values.len());
    for (index, &value) in values.iter().enumerate() {
        let narrow = u32::try_from(value).map_err(|_| Error::IntegerOutOfRange { op: "to_u32_vec", index, value, target: DType::U32 })?;
        out.push(narrow);
    }
    Ok(out)
}

/// Gathers the elements a layout selects into a contiguous vector; a layout reaching past `src`
/// is a kernel error.
pub(crate) fn gather<T: crate::pool::Pooled + Sync>(layout: &Layout, src: &[T]) -> Result<Vec<T>> {
    let n = layout.numel();
    if layout.is_contiguous() {
        let range = layout.offset()..layout.offset() + n;
        let Some(contiguous) = src.get(range) else {
            return Err(Error::Kernel(rtx_kernels::Error::BufferTooSmall { op: "gather", buffer: "src", needed: layout.offset() + n, actual: src.len() }));
        };
        return Ok(crate::pool::copied(contiguous));
    }
    let mut out = crate::pool::take::<T>(n);
    elementwise::strided_copy(layout.shape(), src, layout.offset(), layout.strides(), &mut out)?;
    Ok(out)
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor[{:?}, {}", self.shape(), self.dtype())?;
        if let Some(op) = self.op_name() {
            write!(f, ", op={op}")?;
        }
        if self.is_requires_grad() {
            write!(f, ", grad")?;
        }
        if self.numel() <= 16 {
            if let Ok(v) = self.to_f64_vec() {
                write!(f, ", {v:?}")?;
            }
        }
        write!(f, "]")
    }
}
