//! GEMMs with a fused epilogue through cuBLASLt (`cublasLtMatmul`), in the same row-major
//! convention as [`Device::gemm`]: `C = op(A)·op(B) + bias` (the bias over `C`'s columns, added
//! in the GEMM's epilogue instead of a separate pass over `C`), or `C = op(A)·op(B)` together
//! with the column sums of `A` over `k` (a linear layer's weight and bias gradients from one read
//! of the output gradient), or a linear layer with its tanh-GELU (`C = gelu(op(A)·op(B) + bias)`, the
//! pre-activation kept for the backward) and that GELU's backward (`C = (op(A)·op(B)) ⊙ gelu'(aux)`),
//! as llm.c fuses its feed-forward. (cuBLASLt's `DGELU_BGRAD`, which would also sum the bias
//! gradient, measured 0.2 ms slower per GPT-2 layer than `DGELU` with the bias gradient in the
//! next GEMM's `BGRADB`, so it is not offered.)
//!
//! The row-major product is the column-major `Cᵀ = op(B)ᵀ·op(A)ᵀ`, so our `B` is cuBLASLt's first
//! operand and a bias over our columns is one over its rows (`EPILOGUE_BIAS`); the bias gradient
//! reduces cuBLASLt's second operand (our `A`) over `k` (`EPILOGUE_BGRADB`). The algorithm
//! cuBLASLt's heuristic picks is cached per shape; one 32 MiB workspace per device serves every
//! call (all calls are on the device's one stream). When cuBLASLt refuses a combination the error
//! comes back and the caller takes the plain GEMM path.

use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::cublaslt::{result as lt, sys as ltsys};

use super::alloc::Buffer;
use super::blas::{Gemm, GemmElem, GemmMath};
use super::device::Device;
use super::error::{check_len, CudaError, Result};

/// Workspace handed to cuBLASLt, in 32-bit words (32 MiB).
const WORKSPACE_WORDS: usize = 8 << 20;

/// What happens after the product.
pub enum Epilogue<'a, T: GemmElem> {
    /// Add `bias` (one value per column of `C`) to every row.
    Bias(&'a Buffer<T>),
    /// Write the sums of `A`'s columns over `k` (`A` is `[k, m]`, so one value per row of `C`,
    /// which needs `trans_a`) into the buffer.
    BiasGrad(&'a mut Buffer<T>),
    /// Add `bias` (as [`Epilogue::Bias`]), keep that pre-activation in `aux` (`C`'s shape) and
    /// write cuBLASLt's GELU of it (the tanh approximation, as GPT-2's) to `C`: a linear layer
    /// and its activation in one pass, the pre-activation saved for the backward.
    BiasGeluAux {
        /// One value per column of `C`.
        bias: &'a Buffer<T>,
        /// The pre-activation, `C`'s shape.
        aux: &'a mut Buffer<T>,
    },
    /// Multiply the product by the GELU's derivative at `aux` (a pre-activation saved by
    /// [`Epilogue::BiasGeluAux`], `C`'s shape).
    DGelu {
        /// The saved pre-activation.
        aux: &'a Buffer<T>,
    },
}

/// The cuBLASLt handle and workspace of a device, and the algorithms picked so far.
pub(crate) struct LtState {
    handle: ltsys::cublasLtHandle_t,
    workspace: Buffer<u32>,
    algos: HashMap<AlgoKey, ltsys::cublasLtMatmulAlgo_t>,
}

// SAFETY: the handle is only used under the device's `lt` mutex, on the device's stream.
unsafe impl Send for LtState {}

impl Drop for LtState {
    fn drop(&mut self) {
        // SAFETY: the handle came from `create_handle` and is destroyed once.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct AlgoKey {
    m: usize,
    n: usize,
    k: usize,
    trans_a: bool,
    trans_b: bool,
    bf16: bool,
    tf32: bool,
    epilogue: u32,
}

/// Destroys cuBLASLt descriptors when dropped.
struct Descriptors {
    desc: ltsys::cublasLtMatmulDesc_t,
    layouts: Vec<ltsys::cublasLtMatrixLayout_t>,
    pref: Option<ltsys::cublasLtMatmulPreference_t>,
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created once by this value and is destroyed once.
        unsafe {
            let _ = lt::destroy_matmul_desc(self.desc);
            for &l in &self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
            if let Some(p) = self.pref {
                let _ = lt::destroy_matmul_pref(p);
            }
        }
    }
}

fn lt_err(op: &'static str, e: cudarc::cublaslt::result::CublasError) -> CudaError {
    CudaError::Unsupported { op, what: format!("cuBLASLt: {e:?}") }
}

fn op_of(trans: bool) -> i32 {
    if trans {
        cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T as i32
    } else {
        cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N as i32
    }
}

/// Sets one matmul-descriptor attribute from a plain value.
///
/// # Safety
/// `desc` is live and `T` is the attribute's type.
unsafe fn set_attr<T>(desc: ltsys::cublasLtMatmulDesc_t, attr: ltsys::cublasLtMatmulDescAttributes_t, value: &T) -> std::result::Result<(), cudarc::cublaslt::result::CublasError> {
    // SAFETY: the caller guarantees the descriptor and the attribute's type.
    unsafe { lt::set_matmul_desc_attribute(desc, attr, value as *const T as *const c_void, std::mem::size_of::<T>()) }
}

impl Device {
    /// `C = op(A)·op(B)` followed by `epilogue` (see the module docs), queued on the device's
    /// stream. `spec.beta` must be 0 and `spec.batch` 1.
    pub fn gemm_epilogue<T: GemmElem>(&self, spec: &Gemm, a: &Buffer<T>, b: &Buffer<T>, c: &mut Buffer<T>, epilogue: Epilogue<'_, T>) -> Result<()> {
        const OP: &str = "gemm_epilogue";
        let (m, n, k) = (spec.m, spec.n, spec.k);
        if spec.batch != 1 || spec.beta != 0.0 || k == 0 || spec.offsets != [0; 3] {
            return Err(CudaError::Unsupported { op: OP, what: "batch 1, beta 0, k > 0 and whole buffers only".into() });
        }
        check_len(OP, "a", a.len(), m * k)?;
        check_len(OP, "b", b.len(), k * n)?;
        check_len(OP, "c", c.len(), m * n)?;
        let (kind, bias_ptr, aux_ptr) = match &epilogue {
            Epilogue::Bias(bias) => {
                check_len(OP, "bias", bias.len(), n)?;
                (ltsys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS, bias.device_ptr(), None)
            }
            Epilogue::BiasGrad(db) => {
                if !spec.trans_a {
                    return Err(CudaError::Unsupported { op: OP, what: "the bias gradient reduces A stored [k, m] (trans_a)".into() });
                }
                check_len(OP, "bias gradient", db.len(), m)?;
                (ltsys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BGRADB, db.device_ptr(), None)
            }
            Epilogue::BiasGeluAux { bias, aux } => {
                check_len(OP, "bias", bias.len(), n)?;
                check_len(OP, "aux", aux.len(), m * n)?;
                (ltsys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_AUX_BIAS, bias.device_ptr(), Some(aux.device_ptr()))
            }
            Epilogue::DGelu { aux } => {
                check_len(OP, "aux", aux.len(), m * n)?;
                (ltsys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DGELU, 0, Some(aux.device_ptr()))
            }
        };
        if aux_ptr.is_some() && !n.is_multiple_of(8) {
            return Err(CudaError::Unsupported { op: OP, what: format!("a GELU auxiliary matrix needs rows of a multiple of 8 elements, not {n}") });
        }
        if m == 0 || n == 0 {
            return Ok(());
        }
        // SAFETY (this probe): only dlopens the library name.
        if !unsafe { ltsys::is_culib_present() } {
            return Err(CudaError::LibraryNotFound { name: "cublasLt" });
        }
        let call = spec.column_major()?;
        let bf16 = T::DTYPE == crate::DType::BF16;
        let tf32 = !bf16 && spec.math == GemmMath::Tf32;
        let compute = if tf32 { ltsys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32 } else { ltsys::cublasComputeType_t::CUBLAS_COMPUTE_32F };
        let dtype = if bf16 { ltsys::cudaDataType::CUDA_R_16BF } else { ltsys::cudaDataType::CUDA_R_32F };
        self.bind()?;
        let mut guard = self.lt.lock().unwrap_or_else(|e| e.into_inner());
        if guard.is_none() {
            let handle = lt::create_handle().map_err(|e| lt_err(OP, e))?;
            let workspace = self.alloc::<u32>(WORKSPACE_WORDS)?;
            *guard = Some(LtState { handle, workspace, algos: HashMap::new() });
        }
        let state = guard.as_mut().ok_or(CudaError::Unsupported { op: OP, what: "no cuBLASLt state".into() })?;
        let desc = lt::create_matmul_desc(compute, ltsys::cudaDataType::CUDA_R_32F).map_err(|e| lt_err(OP, e))?;
        let mut d = Descriptors { desc, layouts: Vec::new(), pref: None };
        // cuBLASLt's A is our B, its B our A (see the module docs).
        let (first_rows, first_cols) = if call.trans_first { (call.k, call.m) } else { (call.m, call.k) };
        let (second_rows, second_cols) = if call.trans_second { (call.n, call.k) } else { (call.k, call.n) };
        for (rows, cols, ld) in [(first_rows, first_cols, call.ld_first), (second_rows, second_cols, call.ld_second), (call.m, call.n, call.ldc)] {
            let l = lt::create_matrix_layout(dtype, rows as u64, cols as u64, ld as i64).map_err(|e| lt_err(OP, e))?;
            d.layouts.push(l);
        }
        // SAFETY: the descriptor is live; each value has its attribute's type (i32 operations,
        // u32 epilogue, a device pointer).
        unsafe {
            set_attr(d.desc, ltsys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA, &op_of(call.trans_first)).map_err(|e| lt_err(OP, e))?;
            set_attr(d.desc, ltsys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB, &op_of(call.trans_second)).map_err(|e| lt_err(OP, e))?;
            set_attr(d.desc, ltsys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE, &(kind as u32)).map_err(|e| lt_err(OP, e))?;
            set_attr(d.desc, ltsys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr).map_err(|e| lt_err(OP, e))?;
            if let Some(aux) = aux_ptr {
                // The auxiliary matrix has C's column-major layout (C's leading dimension).
                set_attr(d.desc, ltsys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux).map_err(|e| lt_err(OP, e))?;
                set_attr(d.desc, ltsys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &(call.ldc as i64)).map_err(|e| lt_err(OP, e))?;
            }
        }
        let key = AlgoKey { m, n, k, trans_a: spec.trans_a, trans_b: spec.trans_b, bf16, tf32, epilogue: kind as u32 };
        let workspace_bytes = WORKSPACE_WORDS * 4;
        let algo = match state.algos.get(&key) {
            Some(a) => *a,
            None => {
                let pref = lt::create_matmul_pref().map_err(|e| lt_err(OP, e))?;
                d.pref = Some(pref);
                // SAFETY: the preference is live; the attribute is a u64 byte count.
                unsafe {
                    lt::set_matmul_pref_attribute(
                        pref,
                        ltsys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                        &(workspace_bytes as u64) as *const u64 as *const c_void,
                        8,
                    )
                }
                .map_err(|e| lt_err(OP, e))?;
                // SAFETY: every descriptor is live and describes the buffers of this call.
                let found = unsafe { lt::get_matmul_algo_heuristic(state.handle, d.desc, d.layouts[0], d.layouts[1], d.layouts[2], d.layouts[2], pref) }.map_err(|e| lt_err(OP, e))?;
                state.algos.insert(key, found.algo);
                found.algo
            }
        };
        let (alpha, beta) = (spec.alpha, 0.0f32);
        // SAFETY: lengths were checked against the shape above, so cuBLASLt reads and writes
        // inside the buffers; the bias (or bias gradient) holds the epilogue's length; alpha and
        // beta are f32 as the 32F compute types require; the workspace is this device's and only
        // used on its stream.
        unsafe {
            lt::matmul(
                state.handle,
                d.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                b.device_ptr() as *const c_void,
                d.layouts[0],
                a.device_ptr() as *const c_void,
                d.layouts[1],
                c.device_ptr() as *const c_void,
                d.layouts[2],
                c.device_ptr() as *mut c_void,
                d.layouts[2],
                &algo,
                state.workspace.device_ptr() as *mut c_void,
                workspace_bytes,
                self.stream().cu_stream() as _,
            )
        }
        .map_err(|e| lt_err(OP, e))
    }
}
