//! `rustytorch.Tensor`: an `rtx-tensor` CPU tensor as a Python object that exports its storage
//! through the buffer protocol, so `numpy.asarray(t)` (and `torch.from_numpy` on that) views the
//! Rust memory without a copy.
//!
//! Lifetime: a buffer export holds a reference to the Python object (`Py_buffer.obj`), which owns
//! a `Tensor` handle, which keeps the reference-counted storage alive: the numpy array can outlive
//! every other reference. The storage's element vector is never reallocated (in-place ops write
//! into it; other ops make new storages), so the exported pointer stays valid. The view is
//! writable: writes through numpy are seen by Rust, and in-place Rust ops by numpy. Rust takes the
//! storage's lock for its own reads and writes, numpy does not: mutating one side while the other
//! reads on another thread is a data race, as with any two numpy views of one array.
//!
//! The other way, `Tensor.from_numpy` shares too, like `torch.from_numpy`: a writable C-contiguous
//! array becomes the storage's elements ([`Elements::from_foreign`]), held alive by the buffer the
//! storage keeps; writes are seen on both sides. A read-only array is copied once (a Rust in-place
//! op must not write into memory numpy promised would not change), as is a non-contiguous one
//! (numpy's `ascontiguousarray`, whose result is then shared). An export of a tensor over numpy
//! memory also holds that memory's owner, so the view stays valid even if a Rust op later moves
//! the storage into an owned copy. bf16 has no buffer format: `numpy()` converts it.

use std::ffi::{c_int, c_void, CStr};

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyBufferError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;
use std::ptr::NonNull;
use std::sync::Arc;

use rustytorch::tensor::{CpuData, Elements, ForeignOwner};
use rustytorch::{DType, Device, Tensor};

use crate::errors::{message, RustytorchError};

/// A CPU tensor of rustytorch (f32, f64, bf16, u32 or i64).
#[pyclass(name = "Tensor", module = "rustytorch._rustytorch", frozen)]
pub struct PyTensor {
    pub(crate) tensor: Tensor,
}

/// Shape and byte strides of one buffer export, freed by `__releasebuffer__`.
struct ExportedLayout {
    shape: Vec<ffi::Py_ssize_t>,
    strides: Vec<ffi::Py_ssize_t>,
    /// The owner of foreign (numpy) elements, held for as long as the export lives.
    _foreign_owner: Option<ForeignOwner>,
}

#[pymethods]
impl PyTensor {
    /// A tensor of zeros of `dtype` (`float32`, `float64`, `uint32`, `int64` or `bfloat16`).
    #[staticmethod]
    #[pyo3(signature = (shape, dtype = "float32"))]
    fn zeros(shape: Vec<usize>, dtype: &str) -> PyResult<PyTensor> {
        Ok(PyTensor { tensor: Tensor::zeros(&shape, dtype_from_name(dtype)?) })
    }

    /// A tensor of `shape` over a C-contiguous buffer (numpy array) of float32, float64, uint32
    /// or int64: shared without a copy when the buffer is writable, copied when it is read-only.
    #[staticmethod]
    fn _from_buffer(object: &Bound<'_, PyAny>, shape: Vec<usize>) -> PyResult<PyTensor> {
        let py = object.py();
        let tensor = if let Ok(buffer) = PyBuffer::<f32>::get(object) {
            share_or_copy(py, buffer, &shape, CpuData::F32)
        } else if let Ok(buffer) = PyBuffer::<f64>::get(object) {
            share_or_copy(py, buffer, &shape, CpuData::F64)
        } else if let Ok(buffer) = PyBuffer::<u32>::get(object) {
            share_or_copy(py, buffer, &shape, CpuData::U32)
        } else if let Ok(buffer) = PyBuffer::<i64>::get(object) {
            share_or_copy(py, buffer, &shape, CpuData::I64)
        } else {
            return Err(PyTypeError::new_err("a rustytorch Tensor holds float32, float64, uint32 or int64 (convert with .astype first)"));
        }?;
        Ok(PyTensor { tensor })
    }

    /// Whether the tensor's elements are numpy's memory, shared by `from_numpy`.
    fn shares_foreign_memory(&self) -> PyResult<bool> {
        let data = self.tensor.storage().read().map_err(|e| RustytorchError::new_err(message(&e)))?;
        Ok(data.is_foreign())
    }

    /// The shape.
    #[getter]
    fn shape(&self) -> Vec<usize> {
        self.tensor.shape().to_vec()
    }

    /// The dtype's numpy name (`float32`, `float64`, `bfloat16`, `uint32`, `int64`).
    #[getter]
    fn dtype(&self) -> &'static str {
        dtype_name(self.tensor.dtype())
    }

    /// The address of the first element (what a zero-copy numpy view must point at).
    fn data_ptr(&self) -> PyResult<usize> {
        let (pointer, _, _) = self.element_pointer()?;
        Ok(pointer as usize)
    }

    /// The elements as a flat list of floats, read by Rust under the storage's lock.
    fn to_list(&self) -> PyResult<Vec<f64>> {
        self.tensor.to_f64_vec().map_err(|e| RustytorchError::new_err(message(&e)))
    }

    /// Adds `value` to every element in place, in Rust (`Tensor::add_assign_`).
    fn add_(&self, value: f64) -> PyResult<()> {
        let other = Tensor::full(self.tensor.shape(), value, self.tensor.dtype());
        self.tensor.add_assign_(&other).map_err(|e| RustytorchError::new_err(message(&e)))
    }

    /// The same tensor in float32 (a new storage; the identity, not a copy, when it is float32).
    fn to_float32(&self) -> PyResult<PyTensor> {
        self.tensor.to_dtype(DType::F32).map(|tensor| PyTensor { tensor }).map_err(|e| RustytorchError::new_err(message(&e)))
    }

    fn __repr__(&self) -> String {
        format!("rustytorch.Tensor(shape={:?}, dtype={})", self.tensor.shape(), dtype_name(self.tensor.dtype()))
    }

    /// Exports the storage (buffer protocol).
    ///
    /// # Safety
    /// `view` is the `Py_buffer` CPython hands in (non-null, ours to fill).
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("a null Py_buffer was passed"));
        }
        let this = slf.get();
        let format = buffer_format(this.tensor.dtype())?;
        let (pointer, item_bytes, foreign_owner) = this.element_pointer()?;
        let layout = this.tensor.layout();
        let is_contiguous = layout.is_contiguous();
        if flags & ffi::PyBUF_STRIDES != ffi::PyBUF_STRIDES && !is_contiguous {
            return Err(PyBufferError::new_err("the tensor is not contiguous and the reader does not take strides"));
        }
        let exported = Box::new(ExportedLayout {
            shape: layout.shape().iter().map(|&d| d as ffi::Py_ssize_t).collect(),
            strides: layout.strides().iter().map(|&s| (s * item_bytes) as ffi::Py_ssize_t).collect(),
            _foreign_owner: foreign_owner,
        });
        debug_assert_eq!(exported.shape.len(), exported.strides.len(), "one stride per dimension");
        // SAFETY: `view` is non-null and CPython's to fill; the pointers stored in it live until
        // `__releasebuffer__` (the boxed layout) or as long as `obj` (the elements).
        unsafe {
            (*view).obj = slf.clone().into_any().into_ptr();
            (*view).buf = pointer.cast_mut().cast::<c_void>();
            (*view).len = (layout.numel() * item_bytes) as ffi::Py_ssize_t;
            (*view).readonly = 0;
            (*view).itemsize = item_bytes as ffi::Py_ssize_t;
            (*view).format = if flags & ffi::PyBUF_FORMAT == ffi::PyBUF_FORMAT { format.as_ptr().cast_mut() } else { std::ptr::null_mut() };
            (*view).ndim = exported.shape.len() as c_int;
            (*view).shape = if flags & ffi::PyBUF_ND == ffi::PyBUF_ND { exported.shape.as_ptr().cast_mut() } else { std::ptr::null_mut() };
            (*view).strides = if flags & ffi::PyBUF_STRIDES == ffi::PyBUF_STRIDES { exported.strides.as_ptr().cast_mut() } else { std::ptr::null_mut() };
            (*view).suboffsets = std::ptr::null_mut();
            (*view).internal = Box::into_raw(exported).cast::<c_void>();
        }
        Ok(())
    }

    /// Frees what `__getbuffer__` allocated for the export.
    ///
    /// # Safety
    /// `view` was filled by `__getbuffer__` above.
    unsafe fn __releasebuffer__(&self, view: *mut ffi::Py_buffer) {
        // SAFETY: `internal` is the box `__getbuffer__` leaked, released once by CPython.
        unsafe {
            let internal = (*view).internal.cast::<ExportedLayout>();
            if !internal.is_null() {
                drop(Box::from_raw(internal));
                (*view).internal = std::ptr::null_mut();
            }
        }
    }
}

impl PyTensor {
    /// The address of the tensor's first element, the bytes per element, and the owner of the
    /// memory when it is foreign (read under one lock, so the three agree).
    fn element_pointer(&self) -> PyResult<(*const u8, usize, Option<ForeignOwner>)> {
        if self.tensor.device() != Device::Cpu {
            return Err(PyBufferError::new_err(format!("the tensor is on {:?}: only CPU tensors are shared with numpy", self.tensor.device())));
        }
        let data = self.tensor.storage().read().map_err(|e| RustytorchError::new_err(message(&e)))?;
        let bytes = data.as_bytes();
        let item_bytes = self.tensor.dtype().size_in_bytes();
        let start = self.tensor.layout().offset() * item_bytes;
        assert!(start <= bytes.len(), "a tensor's offset lies inside its storage");
        // The pointer outlives the read guard: an owned vector is never reallocated, and foreign
        // memory stays alive through the returned owner (module doc).
        Ok((bytes[start..].as_ptr(), item_bytes, data.foreign_owner()))
    }
}

/// A tensor over `buffer`'s memory when it is writable and C-contiguous (the buffer, and with it
/// the numpy array, lives as long as the storage), else over a copy of its elements.
fn share_or_copy<T>(py: Python<'_>, buffer: PyBuffer<T>, shape: &[usize], wrap: fn(Elements<T>) -> CpuData) -> PyResult<Tensor>
where
    T: pyo3::buffer::Element + Copy + Send + Sync + 'static,
{
    let pointer = NonNull::new(buffer.buf_ptr().cast::<T>());
    let elements = match pointer {
        Some(pointer) if !buffer.readonly() && buffer.is_c_contiguous() => {
            let len = buffer.item_count();
            let owner: ForeignOwner = Arc::new(buffer);
            // SAFETY: pyo3 checked the buffer's format, item size and alignment for `T`; it is
            // C-contiguous, so `len` elements from `pointer` are its memory; the exporter keeps
            // that memory in place until the buffer is released, which is when `owner` drops.
            unsafe { Elements::from_foreign(pointer, len, true, owner) }
        }
        _ => Elements::from(buffer.to_vec(py)?),
    };
    Tensor::from_data(wrap(elements), shape).map_err(|e| RustytorchError::new_err(message(&e)))
}

/// The struct-module format of a dtype's elements.
fn buffer_format(dtype: DType) -> PyResult<&'static CStr> {
    match dtype {
        DType::F32 => Ok(c"f"),
        DType::F64 => Ok(c"d"),
        DType::U32 => Ok(c"I"),
        DType::I64 => Ok(c"q"),
        DType::BF16 => Err(PyBufferError::new_err("bfloat16 has no buffer-protocol format: use Tensor.numpy(), which converts to float32")),
    }
}

/// The numpy name of a dtype.
pub(crate) fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float32",
        DType::F64 => "float64",
        DType::BF16 => "bfloat16",
        DType::U32 => "uint32",
        DType::I64 => "int64",
    }
}

fn dtype_from_name(name: &str) -> PyResult<DType> {
    match name {
        "float32" => Ok(DType::F32),
        "float64" => Ok(DType::F64),
        "bfloat16" => Ok(DType::BF16),
        "uint32" => Ok(DType::U32),
        "int64" => Ok(DType::I64),
        other => Err(PyTypeError::new_err(format!("dtype {other:?}: a rustytorch Tensor is float32, float64, bfloat16, uint32 or int64"))),
    }
}
