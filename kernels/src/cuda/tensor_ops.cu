// rtx-kernels CUDA tensor-ops module: the general forms of ops GPU tensors need beyond a GPT step,
// for f32 and bf16 storage (`_f32` / `_bf16` instantiations, as mixed.cu): a binary op of two
// strided operands broadcast to one shape, softmax and log-softmax along rows with their
// backward, and sums over the middle axis of an [outer, reduce, inner] view. Storage is read into
// f32 registers; every sum accumulates in f32 in a fixed order (no atomics), so reruns give the
// same bits; results round to the storage type once. Compiled once per process by NVRTC (see
// nvrtc.rs) after the common.cu prelude (`ldf`, `stf`, `GRID_STRIDE`, warp and block sums).
//
// Kernel names are unique across modules (the device caches functions by name).

// ---- binary op of two strided operands broadcast to `shape` ----
// out is contiguous with `shape` (element i decoded row-major); a and b are read through their own
// strides (0 along a broadcast dimension) and offsets, in elements. op: 0 add, 1 sub, 2 mul, 3 div
// (the discriminants of `BinaryOp`).

#define MAX_BINARY_DIMS 8
struct BinaryDims {
    i64 shape[MAX_BINARY_DIMS];
    i64 a_stride[MAX_BINARY_DIMS];
    i64 b_stride[MAX_BINARY_DIMS];
    i64 a_offset, b_offset, n;
    int ndim;
};

__device__ __forceinline__ float tops_apply(int op, float x, float y) {
    switch (op) {
        case 0: return x + y;
        case 1: return x - y;
        case 2: return x * y;
        default: return x / y;
    }
}

template <typename T> __device__ void binary_strided(int op, const T* a, const T* b, T* out, const BinaryDims d) {
    GRID_STRIDE(i, d.n) {
        i64 rest = i, ia = d.a_offset, ib = d.b_offset;
        for (int k = d.ndim - 1; k >= 0; --k) {
            i64 c = rest % d.shape[k];
            rest /= d.shape[k];
            ia += c * d.a_stride[k];
            ib += c * d.b_stride[k];
        }
        stf(out, i, tops_apply(op, ldf(a, ia), ldf(b, ib)));
    }
}

// ---- softmax / log-softmax along dense rows of n (one block per row) ----
// As the CPU kernels: m = the row max (0 when not finite), e = exp(x − m), s = Σ e;
// softmax e / s, log-softmax (x − m) − log s.

template <typename T> __device__ void row_softmax(const T* x, T* y, int n, int take_log) {
    __shared__ float scratch[32];
    i64 off = (i64)blockIdx.x * n;
    float m = -INFINITY;
    for (int j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, ldf(x, off + j));
    m = block_max(m, scratch);
    if (!(fabsf(m) < INFINITY)) m = 0.0f;
    float s = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) s += expf(ldf(x, off + j) - m);
    s = block_sum(s, scratch);
    if (take_log) {
        float log_s = logf(s);
        for (int j = threadIdx.x; j < n; j += blockDim.x) stf(y, off + j, (ldf(x, off + j) - m) - log_s);
    } else {
        float inv = 1.0f / s;
        for (int j = threadIdx.x; j < n; j += blockDim.x) stf(y, off + j, expf(ldf(x, off + j) - m) * inv);
    }
}

// From the forward output y and the upstream gradient dy (dense rows of n):
// softmax dx = y ⊙ (dy − Σ y ⊙ dy); log-softmax dx = dy − exp(y) · Σ dy.
template <typename T> __device__ void row_softmax_backward(const T* y, const T* dy, T* dx, int n, int take_log) {
    __shared__ float scratch[32];
    i64 off = (i64)blockIdx.x * n;
    float s = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) s += take_log ? ldf(dy, off + j) : ldf(y, off + j) * ldf(dy, off + j);
    s = block_sum(s, scratch);
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float yj = ldf(y, off + j), gj = ldf(dy, off + j);
        stf(dx, off + j, take_log ? gj - expf(yj) * s : yj * (gj - s));
    }
}

// ---- sums over the middle axis of a dense [outer, reduce, inner] view, times `scale` ----
// out[o·inner + i] = scale · Σ_r x[(o·reduce + r)·inner + i] (scale 1 for a sum, 1/reduce for a
// mean). `reduce_sum_rows` (inner = 1): one block per output, lanes strided over the row, a fixed
// block tree. `reduce_sum_mid`: one thread per output, r in order (reads coalesce over i).

template <typename T> __device__ void reduce_sum_rows(const T* x, T* out, i64 reduce, float scale) {
    __shared__ float scratch[32];
    const i64 off = (i64)blockIdx.x * reduce;
    float s = 0.0f;
    for (i64 r = threadIdx.x; r < reduce; r += blockDim.x) s += ldf(x, off + r);
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) stf(out, blockIdx.x, s * scale);
}

template <typename T> __device__ void reduce_sum_mid(const T* x, T* out, i64 outer, i64 reduce, i64 inner, float scale) {
    GRID_STRIDE(k, outer * inner) {
        i64 o = k / inner, i = k - o * inner;
        const i64 base = o * reduce * inner + i;
        float s = 0.0f;
        for (i64 r = 0; r < reduce; ++r) s += ldf(x, base + r * inner);
        stf(out, k, s * scale);
    }
}

// ---- instantiations: `_f32` on float storage, `_bf16` on bf16 words ----

#define TOPS_BOTH(NAME, PARAMS, ARGS)                                      \
    extern "C" __global__ void NAME##_f32 PARAMS(float) { NAME ARGS; }   \
    extern "C" __global__ void NAME##_bf16 PARAMS(u16) { NAME ARGS; }

#define P_BINARY(T) (int op, const T* a, const T* b, T* out, const BinaryDims d)
TOPS_BOTH(binary_strided, P_BINARY, (op, a, b, out, d))
#define P_ROW_SOFTMAX(T) (const T* x, T* y, int n, int take_log)
TOPS_BOTH(row_softmax, P_ROW_SOFTMAX, (x, y, n, take_log))
#define P_ROW_SOFTMAX_B(T) (const T* y, const T* dy, T* dx, int n, int take_log)
TOPS_BOTH(row_softmax_backward, P_ROW_SOFTMAX_B, (y, dy, dx, n, take_log))
#define P_SUM_ROWS(T) (const T* x, T* out, i64 reduce, float scale)
TOPS_BOTH(reduce_sum_rows, P_SUM_ROWS, (x, out, reduce, scale))
#define P_SUM_MID(T) (const T* x, T* out, i64 outer, i64 reduce, i64 inner, float scale)
TOPS_BOTH(reduce_sum_mid, P_SUM_MID, (x, out, outer, reduce, inner, scale))
