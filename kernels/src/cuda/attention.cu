// rtx-kernels CUDA attention module: flash attention forward and backward in f32 for head dims
// 64 and 128, causal or not. Q, K, V, O are contiguous [heads, T, D]. Nothing of size T×T is
// ever stored: the forward keeps one log-sum-exp per query row (`lse`), the backward recomputes
// the probabilities from it.
//
// Work split: a block of WARPS warps handles WARPS rows (query rows in the forward and dQ
// kernels, key rows in the dK/dV kernel); tiles of 32 rows of the other operand are staged in
// shared memory, each lane scores one row of the tile, and each lane owns D/32 output columns.

typedef long long i64;

// NVRTC compiles without the toolkit headers, so math.h constants are spelled out.
#define INFINITY __int_as_float(0x7f800000)

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

#define WARPS 8
#define TILE 32

__device__ __forceinline__ float warp_sum_a(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max_a(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Loads rows [r0, r0+TILE) of a [rows, D] matrix into smem with row pitch `pitch`; rows past
// the end are zero.
template <int D>
__device__ __forceinline__ void load_tile(float* dst, int pitch, const float* src, int r0, int rows) {
    for (int e = threadIdx.x; e < TILE * D; e += blockDim.x) {
        int r = e / D, c = e - r * D;
        dst[r * pitch + c] = (r0 + r < rows) ? src[(i64)(r0 + r) * D + c] : 0.0f;
    }
}

template <int D>
__device__ void flash_forward(const float* q, const float* k, const float* v, float* o, float* lse, int tq, int tk, int causal, float scale) {
    constexpr int C = D / 32;
    constexpr int KP = D + 1;
    extern __shared__ float smem[];
    float* ks = smem;                 // [TILE][D+1]
    float* vs = ks + TILE * KP;       // [TILE][D]
    float* qs = vs + TILE * D;        // [WARPS][D]
    int h = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int row0 = blockIdx.x * WARPS, i = row0 + warp;
    const float* qh = q + (i64)h * tq * D;
    const float* kh = k + (i64)h * tk * D;
    const float* vh = v + (i64)h * tk * D;
    for (int e = threadIdx.x; e < WARPS * D; e += blockDim.x) {
        int r = e / D, c = e - r * D;
        qs[e] = (row0 + r < tq) ? qh[(i64)(row0 + r) * D + c] : 0.0f;
    }
    float m = -INFINITY, l = 0.0f, acc[C];
#pragma unroll
    for (int c = 0; c < C; ++c) acc[c] = 0.0f;
    int last_row = imin(row0 + WARPS, tq);
    int kmax = causal ? imin(tk, last_row) : tk;
    const float* qw = qs + warp * D;
    for (int t0 = 0; t0 < kmax; t0 += TILE) {
        __syncthreads();
        load_tile<D>(ks, KP, kh, t0, tk);
        load_tile<D>(vs, D, vh, t0, tk);
        __syncthreads();
        if (i >= tq) continue;
        int j = t0 + lane;
        bool valid = j < tk && (!causal || j <= i);
        float s = 0.0f;
        const float* kr = ks + lane * KP;
#pragma unroll 16
        for (int c = 0; c < D; ++c) s += qw[c] * kr[c];
        s = valid ? s * scale : -INFINITY;
        float mt = warp_max_a(s);
        float mn = fmaxf(m, mt);
        if (mn == -INFINITY) continue;  // nothing visible yet (uniform across the warp)
        float p = valid ? expf(s - mn) : 0.0f;
        float corr = expf(m - mn);
        l = l * corr + warp_sum_a(p);
        m = mn;
#pragma unroll
        for (int c = 0; c < C; ++c) acc[c] *= corr;
        for (int jj = 0; jj < TILE; ++jj) {
            float pj = __shfl_sync(0xffffffffu, p, jj);
            const float* vr = vs + jj * D;
#pragma unroll
            for (int c = 0; c < C; ++c) acc[c] += pj * vr[lane + 32 * c];
        }
    }
    if (i < tq) {
        float inv = l > 0.0f ? 1.0f / l : 0.0f;
        float* orow = o + ((i64)h * tq + i) * D;
#pragma unroll
        for (int c = 0; c < C; ++c) orow[lane + 32 * c] = acc[c] * inv;
        if (lane == 0) lse[(i64)h * tq + i] = l > 0.0f ? m + logf(l) : INFINITY;
    }
}

// delta[i] = Σ_c dO[i][c] · O[i][c], one warp per row.
extern "C" __global__ void flash_backward_delta(const float* o, const float* dout, float* delta, i64 rows, int d) {
    i64 row = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    float s = 0.0f;
    for (int c = lane; c < d; c += 32) s += o[row * d + c] * dout[row * d + c];
    s = warp_sum_a(s);
    if (lane == 0) delta[row] = s;
}

template <int D>
__device__ void flash_backward_dq(const float* q, const float* k, const float* v, const float* dout, const float* lse, const float* delta, float* dq, int tq, int tk, int causal, float scale) {
    constexpr int C = D / 32;
    constexpr int KP = D + 1;
    extern __shared__ float smem[];
    float* ks = smem;                 // [TILE][D+1]
    float* vs = ks + TILE * KP;       // [TILE][D+1]
    float* qs = vs + TILE * KP;       // [WARPS][D]
    float* gs = qs + WARPS * D;       // [WARPS][D]
    int h = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int row0 = blockIdx.x * WARPS, i = row0 + warp;
    const float* kh = k + (i64)h * tk * D;
    const float* vh = v + (i64)h * tk * D;
    for (int e = threadIdx.x; e < WARPS * D; e += blockDim.x) {
        int r = e / D, c = e - r * D;
        bool in = row0 + r < tq;
        i64 src = ((i64)h * tq + row0 + r) * D + c;
        qs[e] = in ? q[src] : 0.0f;
        gs[e] = in ? dout[src] : 0.0f;
    }
    float li = 0.0f, di = 0.0f;
    if (i < tq) { li = lse[(i64)h * tq + i]; di = delta[(i64)h * tq + i]; }
    float acc[C];
#pragma unroll
    for (int c = 0; c < C; ++c) acc[c] = 0.0f;
    int last_row = imin(row0 + WARPS, tq);
    int kmax = causal ? imin(tk, last_row) : tk;
    const float* qw = qs + warp * D;
    const float* gw = gs + warp * D;
    for (int t0 = 0; t0 < kmax; t0 += TILE) {
        __syncthreads();
        load_tile<D>(ks, KP, kh, t0, tk);
        load_tile<D>(vs, KP, vh, t0, tk);
        __syncthreads();
        if (i >= tq) continue;
        int j = t0 + lane;
        bool valid = j < tk && (!causal || j <= i);
        float s = 0.0f, dp = 0.0f;
        const float* kr = ks + lane * KP;
        const float* vr = vs + lane * KP;
#pragma unroll 16
        for (int c = 0; c < D; ++c) { s += qw[c] * kr[c]; dp += gw[c] * vr[c]; }
        float p = valid ? expf(s * scale - li) : 0.0f;
        float ds = p * (dp - di);
        for (int jj = 0; jj < TILE; ++jj) {
            float dsj = __shfl_sync(0xffffffffu, ds, jj);
            const float* krow = ks + jj * KP;
#pragma unroll
            for (int c = 0; c < C; ++c) acc[c] += dsj * krow[lane + 32 * c];
        }
    }
    if (i < tq) {
        float* row = dq + ((i64)h * tq + i) * D;
#pragma unroll
        for (int c = 0; c < C; ++c) row[lane + 32 * c] = acc[c] * scale;
    }
}

template <int D>
__device__ void flash_backward_dkv(const float* q, const float* k, const float* v, const float* dout, const float* lse, const float* delta, float* dk, float* dv, int tq, int tk, int causal, float scale) {
    constexpr int C = D / 32;
    constexpr int KP = D + 1;
    extern __shared__ float smem[];
    float* qs = smem;                 // [TILE][D+1]
    float* gs = qs + TILE * KP;       // [TILE][D+1]
    float* kw_all = gs + TILE * KP;   // [WARPS][D]
    float* vw_all = kw_all + WARPS * D; // [WARPS][D]
    float* ls = vw_all + WARPS * D;   // [TILE]
    float* ds_ = ls + TILE;           // [TILE]
    int h = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int row0 = blockIdx.x * WARPS, j = row0 + warp;
    const float* qh = q + (i64)h * tq * D;
    const float* gh = dout + (i64)h * tq * D;
    for (int e = threadIdx.x; e < WARPS * D; e += blockDim.x) {
        int r = e / D, c = e - r * D;
        bool in = row0 + r < tk;
        i64 src = ((i64)h * tk + row0 + r) * D + c;
        kw_all[e] = in ? k[src] : 0.0f;
        vw_all[e] = in ? v[src] : 0.0f;
    }
    float adk[C], adv[C];
#pragma unroll
    for (int c = 0; c < C; ++c) { adk[c] = 0.0f; adv[c] = 0.0f; }
    int qmin = causal ? row0 : 0;
    const float* kw = kw_all + warp * D;
    const float* vw = vw_all + warp * D;
    for (int t0 = qmin; t0 < tq; t0 += TILE) {
        __syncthreads();
        load_tile<D>(qs, KP, qh, t0, tq);
        load_tile<D>(gs, KP, gh, t0, tq);
        if (threadIdx.x < TILE) {
            int ii = t0 + threadIdx.x;
            ls[threadIdx.x] = ii < tq ? lse[(i64)h * tq + ii] : INFINITY;
            ds_[threadIdx.x] = ii < tq ? delta[(i64)h * tq + ii] : 0.0f;
        }
        __syncthreads();
        if (j >= tk) continue;
        int i = t0 + lane;
        bool valid = i < tq && (!causal || j <= i);
        float s = 0.0f, dp = 0.0f;
        const float* qr = qs + lane * KP;
        const float* gr = gs + lane * KP;
#pragma unroll 16
        for (int c = 0; c < D; ++c) { s += qr[c] * kw[c]; dp += gr[c] * vw[c]; }
        float p = valid ? expf(s * scale - ls[lane]) : 0.0f;
        float dsv = p * (dp - ds_[lane]);
        for (int ii = 0; ii < TILE; ++ii) {
            float pi = __shfl_sync(0xffffffffu, p, ii);
            float dsi = __shfl_sync(0xffffffffu, dsv, ii);
            const float* qrow = qs + ii * KP;
            const float* grow = gs + ii * KP;
#pragma unroll
            for (int c = 0; c < C; ++c) {
                adv[c] += pi * grow[lane + 32 * c];
                adk[c] += dsi * qrow[lane + 32 * c];
            }
        }
    }
    if (j < tk) {
        float* krow = dk + ((i64)h * tk + j) * D;
        float* vrow = dv + ((i64)h * tk + j) * D;
#pragma unroll
        for (int c = 0; c < C; ++c) {
            krow[lane + 32 * c] = adk[c] * scale;
            vrow[lane + 32 * c] = adv[c];
        }
    }
}

#define FLASH_ENTRY(D)                                                                                                      \
    extern "C" __global__ void flash_forward_d##D(const float* q, const float* k, const float* v, float* o, float* lse,    \
                                                  int tq, int tk, int causal, float scale) {                               \
        flash_forward<D>(q, k, v, o, lse, tq, tk, causal, scale);                                                          \
    }                                                                                                                       \
    extern "C" __global__ void flash_backward_dq_d##D(const float* q, const float* k, const float* v, const float* dout,  \
                                                      const float* lse, const float* delta, float* dq, int tq, int tk,     \
                                                      int causal, float scale) {                                           \
        flash_backward_dq<D>(q, k, v, dout, lse, delta, dq, tq, tk, causal, scale);                                        \
    }                                                                                                                       \
    extern "C" __global__ void flash_backward_dkv_d##D(const float* q, const float* k, const float* v, const float* dout, \
                                                       const float* lse, const float* delta, float* dk, float* dv, int tq, \
                                                       int tk, int causal, float scale) {                                  \
        flash_backward_dkv<D>(q, k, v, dout, lse, delta, dk, dv, tq, tk, causal, scale);                                   \
    }

FLASH_ENTRY(64)
FLASH_ENTRY(128)
