//! Errors of the CUDA backend: a missing driver or library, a failed driver, cuBLAS or NVRTC
//! call, device memory exhaustion, and arguments a GPU kernel refuses. Every cudarc error is kept
//! as the `source` of a variant that names the operation, never flattened to a string.

use cudarc::cublas::result::CublasError;
use cudarc::driver::DriverError;

/// An error from the CUDA backend.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// `libcuda` could not be loaded (no NVIDIA driver on this machine).
    #[error("CUDA driver not found: build without the cuda feature or install a driver")]
    DriverNotFound,
    /// A CUDA library other than the driver could not be loaded.
    #[error("CUDA library {name} not found: install the CUDA {name} library or build without the cuda feature")]
    LibraryNotFound {
        /// The library (`cublas`, `nvrtc`).
        name: &'static str,
    },
    /// The requested device ordinal does not exist.
    #[error("no CUDA device {ordinal}: {count} device(s) present")]
    NoDevice {
        /// Requested ordinal.
        ordinal: usize,
        /// Devices the driver reports.
        count: usize,
    },
    /// A CUDA driver call failed.
    #[error("{op}: CUDA driver call failed: {source}")]
    Driver {
        /// What was being done.
        op: &'static str,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
    /// A cuBLAS call failed.
    #[error("{op}: cuBLAS call failed: {source}")]
    Blas {
        /// What was being done.
        op: &'static str,
        /// cuBLAS's status.
        #[source]
        source: CublasError,
    },
    /// NVRTC could not compile one of the built-in kernel modules.
    #[error("NVRTC compile of module `{module}` failed: {source}\n{log}")]
    Compile {
        /// The module.
        module: &'static str,
        /// The compiler's log.
        log: String,
        /// NVRTC's status.
        #[source]
        source: cudarc::nvrtc::result::NvrtcError,
    },
    /// The device ran out of memory even after the allocator released its cached blocks.
    #[error("out of device memory allocating {bytes} bytes ({reserved} bytes reserved by the allocator): {source}")]
    OutOfMemory {
        /// Size of the failed request.
        bytes: usize,
        /// Bytes the caching allocator held at the time (after emptying its cache).
        reserved: usize,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
    /// A device or host buffer is shorter than the shape needs.
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
    /// An argument the GPU kernel does not support (a head dim other than 64 or 128, too many
    /// broadcast dimensions, a size over the 32-bit launch limits).
    #[error("{op}: unsupported argument: {what}")]
    Unsupported {
        /// The kernel.
        op: &'static str,
        /// What is unsupported.
        what: String,
    },
}

/// Result alias of the CUDA backend.
pub type Result<T> = std::result::Result<T, CudaError>;

/// Attaches the operation name to a cudarc error.
pub(crate) trait OpContext<T> {
    /// Maps the error into a [`CudaError`] naming `op`.
    fn op(self, op: &'static str) -> Result<T>;
}

impl<T> OpContext<T> for std::result::Result<T, DriverError> {
    fn op(self, op: &'static str) -> Result<T> {
        self.map_err(|source| CudaError::Driver { op, source })
    }
}

impl<T> OpContext<T> for std::result::Result<T, CublasError> {
    fn op(self, op: &'static str) -> Result<T> {
        self.map_err(|source| CudaError::Blas { op, source })
    }
}

/// Checks that a buffer of `actual` elements holds at least `needed`.
pub(crate) fn check_len(op: &'static str, buffer: &'static str, actual: usize, needed: usize) -> Result<()> {
    if actual < needed {
        return Err(CudaError::BufferTooSmall { op, buffer, needed, actual });
    }
    Ok(())
}
