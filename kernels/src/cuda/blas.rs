//! Matrix multiplication on the GPU through cuBLAS (`cublasGemmEx` and
//! `cublasGemmStridedBatchedEx`), in rustytorch's row-major convention.
//!
//! `C[b] = alpha · op(A[b]) · op(B[b]) + beta · C[b]` for `b < batch`, each matrix contiguous and
//! row-major: `A` is `[m, k]` (`[k, m]` with `trans_a`), `B` is `[k, n]` (`[n, k]` with
//! `trans_b`), `C` is `[m, n]`; the products lie back to back, or `Gemm::batch_strides` apart (0
//! broadcasts one `A` or `B` to every product). cuBLAS is column-major, so the call computes `Cᵀ = op(B)ᵀ·op(A)ᵀ`,
//! which needs no copy. f32 inputs accumulate in f32, or use TF32 tensor cores with
//! [`GemmMath::Tf32`]; bf16 inputs always accumulate in f32 and write bf16.

use std::ffi::c_void;

use cudarc::cublas::{result as blas, sys as bsys};
use half::bf16;

use super::alloc::{Buffer, DeviceElem};
use super::device::Device;
use super::error::{check_len, CudaError, OpContext, Result};

/// How f32 products are computed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GemmMath {
    /// IEEE f32 multiply-adds.
    #[default]
    F32,
    /// TF32 tensor cores (10-bit mantissa inputs, f32 accumulation), about 8× faster.
    Tf32,
}

/// Shape and options of one (batched) product. See the module docs for the layout.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemm {
    /// Rows of `C`.
    pub m: usize,
    /// Columns of `C`.
    pub n: usize,
    /// The contracted dimension.
    pub k: usize,
    /// `A` is stored `[k, m]`.
    pub trans_a: bool,
    /// `B` is stored `[n, k]`.
    pub trans_b: bool,
    /// Number of independent products, stored back to back.
    pub batch: usize,
    /// Factor on the product.
    pub alpha: f32,
    /// Factor on the old `C` (0 overwrites; then `C` may hold anything, NaN included).
    pub beta: f32,
    /// f32 math mode (ignored for bf16).
    pub math: GemmMath,
    /// Where `A`, `B` and `C` start inside their buffers, in elements (a product over a
    /// chunk of rows of a larger buffer); 0 by default.
    pub offsets: [usize; 3],
    /// Elements from one product's `A`, `B` and `C` to the next's; `None` (the default): stored
    /// back to back (`m·k`, `k·n`, `m·n`). A stride of 0 for `A` or `B` uses one matrix in every
    /// product (a broadcast batch dimension).
    pub batch_strides: Option<[usize; 3]>,
}

impl Gemm {
    /// `C = A·B` for one `[m, k] × [k, n]` product.
    pub fn new(m: usize, n: usize, k: usize) -> Self {
        Gemm { m, n, k, trans_a: false, trans_b: false, batch: 1, alpha: 1.0, beta: 0.0, math: GemmMath::F32, offsets: [0; 3], batch_strides: None }
    }

    /// Multiply-adds × 2 (the usual FLOP count).
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64 * self.batch as f64
    }

    /// The element strides between consecutive products of `A`, `B` and `C`.
    pub fn strides(&self) -> [usize; 3] {
        self.batch_strides.unwrap_or([self.m * self.k, self.k * self.n, self.m * self.n])
    }

    /// How many elements of `A`, `B` and `C` the products reach from their offsets: the last
    /// product's start plus one matrix (0 for an empty batch).
    pub fn extents(&self) -> [usize; 3] {
        let [sa, sb, sc] = self.strides();
        let last = self.batch.saturating_sub(1);
        let reach = |stride: usize, size: usize| if self.batch == 0 { 0 } else { last * stride + size };
        [reach(sa, self.m * self.k), reach(sb, self.k * self.n), reach(sc, self.m * self.n)]
    }
}

/// Element types cuBLAS multiplies here.
pub trait GemmElem: DeviceElem {
    /// cuBLAS's name for the type.
    const CUDA_TYPE: bsys::cudaDataType;
}

impl GemmElem for f32 {
    const CUDA_TYPE: bsys::cudaDataType = bsys::cudaDataType::CUDA_R_32F;
}

impl GemmElem for bf16 {
    const CUDA_TYPE: bsys::cudaDataType = bsys::cudaDataType::CUDA_R_16BF;
}

/// The cuBLAS arguments of a row-major product (column-major `Cᵀ = op(B)ᵀ op(A)ᵀ`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ColumnMajorCall {
    /// cuBLAS `m` (our `n`).
    pub m: i32,
    /// cuBLAS `n` (our `m`).
    pub n: i32,
    /// cuBLAS `k`.
    pub k: i32,
    /// Transpose of cuBLAS's first operand (our `B`).
    pub trans_first: bool,
    /// Transpose of cuBLAS's second operand (our `A`).
    pub trans_second: bool,
    /// Leading dimension of our `B`.
    pub ld_first: i32,
    /// Leading dimension of our `A`.
    pub ld_second: i32,
    /// Leading dimension of `C`.
    pub ldc: i32,
}

impl Gemm {
    /// Translates the row-major product into cuBLAS's column-major arguments; errors when a
    /// dimension exceeds cuBLAS's 32-bit sizes.
    pub fn column_major(&self) -> Result<ColumnMajorCall> {
        let int = |v: usize, what: &str| i32::try_from(v).map_err(|_| CudaError::Unsupported { op: "gemm", what: format!("{what} = {v} exceeds i32") });
        let (m, n, k) = (int(self.m, "m")?, int(self.n, "n")?, int(self.k, "k")?);
        Ok(ColumnMajorCall {
            m: n,
            n: m,
            k,
            trans_first: self.trans_b,
            trans_second: self.trans_a,
            ld_first: if self.trans_b { k } else { n },
            ld_second: if self.trans_a { m } else { k },
            ldc: n,
        })
    }
}

fn op(trans: bool) -> bsys::cublasOperation_t {
    if trans {
        bsys::cublasOperation_t::CUBLAS_OP_T
    } else {
        bsys::cublasOperation_t::CUBLAS_OP_N
    }
}

impl Device {
    /// Runs the product described by `spec` on the device's stream (queued).
    pub fn gemm<T: GemmElem>(&self, spec: &Gemm, a: &Buffer<T>, b: &Buffer<T>, c: &mut Buffer<T>) -> Result<()> {
        self.gemm_typed::<T, T>(spec, a, b, c)
    }

    /// [`Device::gemm`] writing (and, with `beta`, accumulating into) an f32 `C` whatever the
    /// inputs' type: bf16 products summed over several calls (a weight gradient accumulated
    /// chunk by chunk) round once at the end instead of at every call.
    pub fn gemm_f32_out<T: GemmElem>(&self, spec: &Gemm, a: &Buffer<T>, b: &Buffer<T>, c: &mut Buffer<f32>) -> Result<()> {
        self.gemm_typed::<T, f32>(spec, a, b, c)
    }

    fn gemm_typed<T: GemmElem, C: GemmElem>(&self, spec: &Gemm, a: &Buffer<T>, b: &Buffer<T>, c: &mut Buffer<C>) -> Result<()> {
        const OP: &str = "gemm";
        let (m, n, k, batch) = (spec.m, spec.n, spec.k, spec.batch);
        let [a_off, b_off, c_off] = spec.offsets;
        let [a_reach, b_reach, c_reach] = spec.extents();
        let [a_stride, b_stride, c_stride] = spec.strides();
        check_len(OP, "a", a.len(), a_off + a_reach)?;
        check_len(OP, "b", b.len(), b_off + b_reach)?;
        check_len(OP, "c", c.len(), c_off + c_reach)?;
        if batch > 1 && c_stride < m * n {
            return Err(CudaError::Unsupported { op: OP, what: format!("C products {c_stride} elements apart overlap ({m}×{n} each)") });
        }
        let (a_ptr, b_ptr, c_ptr) = (a.device_ptr_at(a_off)?, b.device_ptr_at(b_off)?, c.device_ptr_at(c_off)?);
        if m == 0 || n == 0 || batch == 0 {
            return Ok(());
        }
        if k == 0 {
            return Err(CudaError::Unsupported { op: OP, what: "k = 0".into() });
        }
        let call = spec.column_major()?;
        let batch_i = i32::try_from(batch).map_err(|_| CudaError::Unsupported { op: OP, what: format!("batch {batch} exceeds i32") })?;
        let compute = match (T::DTYPE, spec.math) {
            (crate::DType::F32, GemmMath::Tf32) => bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            _ => bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        };
        let (alpha, beta) = (spec.alpha, spec.beta);
        self.bind()?;
        let handle = *self.blas.handle();
        let alpha_p = &alpha as *const f32 as *const c_void;
        let beta_p = &beta as *const f32 as *const c_void;
        let algo = bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT;
        // SAFETY: the lengths were checked against the shape above, so every element cuBLAS
        // reads or writes lies inside the three buffers; alpha and beta are f32 as the 32F
        // compute types require, and the handle runs on this device's stream.
        unsafe {
            if batch == 1 {
                blas::gemm_ex(
                    handle,
                    op(call.trans_first),
                    op(call.trans_second),
                    call.m,
                    call.n,
                    call.k,
                    alpha_p,
                    b_ptr as *const c_void,
                    T::CUDA_TYPE,
                    call.ld_first,
                    a_ptr as *const c_void,
                    T::CUDA_TYPE,
                    call.ld_second,
                    beta_p,
                    c_ptr as *mut c_void,
                    C::CUDA_TYPE,
                    call.ldc,
                    compute,
                    algo,
                )
                .op(OP)
            } else {
                blas::gemm_strided_batched_ex(
                    handle,
                    op(call.trans_first),
                    op(call.trans_second),
                    call.m,
                    call.n,
                    call.k,
                    alpha_p,
                    b_ptr as *const c_void,
                    T::CUDA_TYPE,
                    call.ld_first,
                    b_stride as i64,
                    a_ptr as *const c_void,
                    T::CUDA_TYPE,
                    call.ld_second,
                    a_stride as i64,
                    beta_p,
                    c_ptr as *mut c_void,
                    C::CUDA_TYPE,
                    call.ldc,
                    c_stride as i64,
                    batch_i,
                    compute,
                    algo,
                )
                .op(OP)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_major_maps_to_swapped_column_major_operands() {
        // Goal: the translation the GPU relies on, checked without a GPU. Method: the four
        // transpose combinations of a 2×3×4 product.
        let mut g = Gemm::new(2, 3, 4);
        let c = g.column_major().unwrap();
        assert_eq!((c.m, c.n, c.k, c.ld_first, c.ld_second, c.ldc), (3, 2, 4, 3, 4, 3));
        g.trans_a = true;
        g.trans_b = true;
        let c = g.column_major().unwrap();
        assert!(c.trans_first && c.trans_second);
        assert_eq!((c.ld_first, c.ld_second), (4, 2));
        assert_eq!(g.flops(), 48.0);
    }

    #[test]
    fn batch_strides_set_how_far_products_reach() {
        // Goal: the lengths checked before a batched product, without a GPU. Method: 3 packed
        // 2×3×4 products, then the same with B broadcast (stride 0) and A spaced 10 apart.
        let g = Gemm { batch: 3, ..Gemm::new(2, 3, 4) };
        assert_eq!((g.strides(), g.extents()), ([8, 12, 6], [24, 36, 18]));
        let g = Gemm { batch_strides: Some([10, 0, 6]), ..g };
        assert_eq!(g.extents(), [28, 12, 18]);
        assert_eq!(Gemm { batch: 0, ..g }.extents(), [0; 3]);
    }
}
