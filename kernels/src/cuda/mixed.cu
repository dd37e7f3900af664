// rtx-kernels CUDA mixed-precision module: the kernels GPU tensors use for training in bf16 (and
// f32), each in two instantiations, `_f32` (float storage) and `_bf16` (bf16 storage as raw
// 16-bit words). Storage is read into f32 registers and every reduction accumulates in f32;
// results round to the storage type on the way out. Compiled once per process by NVRTC (see
// nvrtc.rs) after the common.cu prelude, no toolkit headers.
//
// Reductions over rows (bias and norm-parameter gradients) are two-pass and deterministic: the
// first pass writes one f32 partial per (chunk of rows, column), the second sums the chunks in
// order.

// `ldf`/`stf` (storage to f32 and back) and `GRID_STRIDE` are in the common.cu prelude.

// ---- elementwise ----

// out[i] = a[i] + b[i % nb]: same shape (nb = n) or b broadcast over leading dimensions.
template <typename T> __device__ void add_rows(const T* a, const T* b, T* out, i64 n, i64 nb) {
    GRID_STRIDE(i, n) stf(out, i, ldf(a, i) + ldf(b, i % nb));
}

// out[r, j] = bias[j]: the C of a GEMM with beta = 1 that adds the bias.
template <typename T> __device__ void fill_rows(const T* bias, T* out, i64 rows, int n) {
    GRID_STRIDE(i, rows * n) out[i] = bias[i % n];
}

template <typename T> __device__ void fill(T* out, float v, i64 n) {
    GRID_STRIDE(i, n) stf(out, i, v);
}

template <typename T> __device__ void scale(T* x, float k, i64 n) {
    GRID_STRIDE(i, n) stf(x, i, ldf(x, i) * k);
}

template <typename T> __device__ void gelu_forward(const T* x, T* y, i64 n, int exact) {
    GRID_STRIDE(i, n) stf(y, i, gelu_any(ldf(x, i), exact));
}

template <typename T> __device__ void gelu_backward(const T* x, const T* dy, T* dx, i64 n, int exact) {
    GRID_STRIDE(i, n) stf(dx, i, ldf(dy, i) * gelu_any_grad(ldf(x, i), exact));
}

// ---- column sums (bias gradients, broadcast-add gradients) ----
// Block (32, 8): column bx·32 + tx, rows of chunk by, strided by 8; partial[by·n + col].

template <typename T> __device__ void col_sum_partial(const T* x, float* partial, i64 rows, int n, i64 rows_per_chunk) {
    __shared__ float acc[8][33];
    int col = blockIdx.x * 32 + threadIdx.x;
    i64 r0 = blockIdx.y * rows_per_chunk;
    i64 r1 = min(rows, r0 + rows_per_chunk);
    float s = 0.0f;
    if (col < n)
        for (i64 r = r0 + threadIdx.y; r < r1; r += 8) s += ldf(x, r * n + col);
    acc[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && col < n) {
        float t = 0.0f;
        for (int k = 0; k < 8; ++k) t += acc[k][threadIdx.x];
        partial[(i64)blockIdx.y * n + col] = t;
    }
}

// out[j] (+)= Σ_c partial[c·n + j], chunks in order.
template <typename T> __device__ void col_sum_finish(const float* partial, T* out, int chunks, int n, int accumulate) {
    GRID_STRIDE(j, n) {
        float t = accumulate ? ldf(out, j) : 0.0f;
        for (int c = 0; c < chunks; ++c) t += partial[(i64)c * n + j];
        stf(out, j, t);
    }
}

// ---- layer norm: one warp per row, 8 rows per block ----

template <typename T> __device__ void layer_norm_forward(const T* x, const T* w, const T* b, T* y, float* mean, float* rstd, i64 rows, int n, float eps) {
    i64 row = blockIdx.x * 8 + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    i64 off = row * n;
    float s = 0.0f;
    for (int j = lane; j < n; j += 32) s += ldf(x, off + j);
    float mu = warp_sum(s) / n;
    float v = 0.0f;
    for (int j = lane; j < n; j += 32) { float d = ldf(x, off + j) - mu; v += d * d; }
    float rs = rsqrtf(warp_sum(v) / n + eps);
    if (lane == 0) { mean[row] = mu; rstd[row] = rs; }
    for (int j = lane; j < n; j += 32) {
        float h = (ldf(x, off + j) - mu) * rs;
        if (w) h *= ldf(w, j);
        if (b) h += ldf(b, j);
        stf(y, off + j, h);
    }
}

template <typename T> __device__ void layer_norm_backward(const T* x, const T* w, const float* mean, const float* rstd, const T* dy, T* dx, i64 rows, int n) {
    i64 row = blockIdx.x * 8 + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    i64 off = row * n;
    float mu = mean[row], rs = rstd[row];
    float sg = 0.0f, sgx = 0.0f;
    for (int j = lane; j < n; j += 32) {
        float g = ldf(dy, off + j) * (w ? ldf(w, j) : 1.0f);
        sg += g;
        sgx += g * (ldf(x, off + j) - mu) * rs;
    }
    float mg = warp_sum(sg) / n;
    float mgx = warp_sum(sgx) / n;
    for (int j = lane; j < n; j += 32) {
        float g = ldf(dy, off + j) * (w ? ldf(w, j) : 1.0f);
        float xh = (ldf(x, off + j) - mu) * rs;
        stf(dx, off + j, rs * (g - mg - xh * mgx));
    }
}

// Partials of dw = Σ dy·xhat and db = Σ dy, laid out as col_sum_partial's.
template <typename T> __device__ void layer_norm_param_partial(const T* x, const float* mean, const float* rstd, const T* dy, float* pw, float* pb, i64 rows, int n, i64 rows_per_chunk) {
    __shared__ float aw[8][33];
    __shared__ float ab[8][33];
    int col = blockIdx.x * 32 + threadIdx.x;
    i64 r0 = blockIdx.y * rows_per_chunk;
    i64 r1 = min(rows, r0 + rows_per_chunk);
    float sw = 0.0f, sb = 0.0f;
    if (col < n)
        for (i64 r = r0 + threadIdx.y; r < r1; r += 8) {
            float g = ldf(dy, r * n + col);
            sw += g * (ldf(x, r * n + col) - mean[r]) * rstd[r];
            sb += g;
        }
    aw[threadIdx.y][threadIdx.x] = sw;
    ab[threadIdx.y][threadIdx.x] = sb;
    __syncthreads();
    if (threadIdx.y == 0 && col < n) {
        float tw = 0.0f, tb = 0.0f;
        for (int k = 0; k < 8; ++k) { tw += aw[k][threadIdx.x]; tb += ab[k][threadIdx.x]; }
        pw[(i64)blockIdx.y * n + col] = tw;
        pb[(i64)blockIdx.y * n + col] = tb;
    }
}

// ---- embedding ----

template <typename T> __device__ void embedding_forward(const T* table, const u32* ids, T* out, i64 n_ids, int dim) {
    GRID_STRIDE(i, n_ids * dim) out[i] = table[(i64)ids[i / dim] * dim + (i % dim)];
}

// dtable (f32) += dout rows at ids (atomic adds).
template <typename T> __device__ void embedding_backward(const T* dout, const u32* ids, float* dtable, i64 n_ids, int dim) {
    GRID_STRIDE(i, n_ids * dim) atomicAdd(&dtable[(i64)ids[i / dim] * dim + (i % dim)], ldf(dout, i));
}

// ---- softmax cross-entropy: one warp per row, 8 rows per block ----

template <typename T> __device__ void cross_entropy_forward(const T* logits, const u32* targets, float* losses, i64 rows, int c) {
    i64 row = blockIdx.x * 8 + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    i64 off = row * c;
    float m = -INFINITY;
    for (int j = lane; j < c; j += 32) m = fmaxf(m, ldf(logits, off + j));
    m = warp_max(m);
    float s = 0.0f;
    for (int j = lane; j < c; j += 32) s += expf(ldf(logits, off + j) - m);
    s = warp_sum(s);
    if (lane == 0) {
        u32 t = targets[row];
        losses[row] = (t < (u32)c) ? (logf(s) + m - ldf(logits, off + t)) : __int_as_float(0x7fc00000);
    }
}

// dlogits = g · (softmax − onehot) · inv_rows, with g read from the device (the loss gradient).
template <typename T> __device__ void cross_entropy_backward(const T* logits, const u32* targets, const float* g, float inv_rows, T* dlogits, i64 rows, int c) {
    i64 row = blockIdx.x * 8 + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    i64 off = row * c;
    float m = -INFINITY;
    for (int j = lane; j < c; j += 32) m = fmaxf(m, ldf(logits, off + j));
    m = warp_max(m);
    float s = 0.0f;
    for (int j = lane; j < c; j += 32) s += expf(ldf(logits, off + j) - m);
    s = warp_sum(s);
    float k = g[0] * inv_rows / s;
    u32 t = targets[row];
    for (int j = lane; j < c; j += 32) {
        float p = expf(ldf(logits, off + j) - m) * k;
        stf(dlogits, off + j, p - ((u32)j == t ? g[0] * inv_rows : 0.0f));
    }
}

// ---- fused classifier: the per-chunk step of linear_cross_entropy ----
// One block (1024 threads) per row of a chunk of logits [rows, vp], whose first v columns are
// classes and the rest padding. losses[row] = logsumexp(x[0, v)) − x[t]: 0 for an ignored row,
// NaN for t ≥ v. With write_grad the row is overwritten in place by its logit gradient
// (softmax(x)[j] − [j = t]) · scale for j < v, and 0 for the padding and for an ignored row.
// The (max, sum of exp) pairs are merged in a fixed order: deterministic.

__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
    float mm = fmaxf(m, m2);
    float a = (m == -INFINITY) ? 0.0f : s * expf(m - mm);
    float b = (m2 == -INFINITY) ? 0.0f : s2 * expf(m2 - mm);
    m = mm;
    s = a + b;
}

// Merges every thread's (max, sum of exp) pair of the block into the block's pair, the same in
// every thread, in a fixed order. sm and ss: 32 floats of shared memory each.
__device__ __forceinline__ void block_lse(float& m, float& s, float* sm, float* ss) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) lse_merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
    if (lane == 0) { sm[warp] = m; ss[warp] = s; }
    __syncthreads();
    if (warp == 0) {
        m = lane < n_warps ? sm[lane] : -INFINITY;
        s = lane < n_warps ? ss[lane] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) lse_merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
        if (lane == 0) { sm[0] = m; ss[0] = s; }
    }
    __syncthreads();
    m = sm[0];
    s = ss[0];
}

template <typename T> __device__ void fused_classifier(T* logits, const u32* targets, float* losses, int vp, int v, int has_ignore, u32 ignore, float scale, int write_grad) {
    __shared__ float sm[32], ss[32];
    i64 row = blockIdx.x;
    i64 off = row * vp;
    u32 t = targets[row];
    bool ignored = has_ignore && t == ignore;
    if (ignored || t >= (u32)v) {
        if (threadIdx.x == 0) losses[row] = ignored ? 0.0f : __int_as_float(0x7fc00000);
        if (write_grad) for (int j = threadIdx.x; j < vp; j += blockDim.x) stf(logits, off + j, 0.0f);
        return;
    }
    float m = -INFINITY, s = 0.0f;
    for (int j = threadIdx.x; j < v; j += blockDim.x) {
        float x = ldf(logits, off + j);
        if (x > m) { s = s * expf(m - x) + 1.0f; m = x; } else { s += expf(x - m); }
    }
    block_lse(m, s, sm, ss);
    float xt = ldf(logits, off + t);
    if (threadIdx.x == 0) losses[row] = logf(s) + m - xt;
    if (!write_grad) return;
    // Every thread has read x[t] before any thread overwrites the row.
    __syncthreads();
    float inv = 1.0f / s;
    for (int j = threadIdx.x; j < vp; j += blockDim.x) {
        float g = 0.0f;
        if (j < v) {
            g = expf(ldf(logits, off + j) - m) * inv;
            if (j == (int)t) g -= 1.0f;
            g *= scale;
        }
        stf(logits, off + j, g);
    }
}

// y = x · g[0], with g read on the device (a loss gradient); x may be f32 for a bf16 y.
template <typename S, typename T> __device__ void scale_by_device(const S* x, const float* g, T* y, i64 n) {
    float k = g[0];
    GRID_STRIDE(i, n) stf(y, i, ldf(x, i) * k);
}
template <typename T> __device__ void scale_by_device_from_f32(const float* x, const float* g, T* y, i64 n) { scale_by_device(x, g, y, n); }

// out[0] = mean of x (one block; fixed order per thread, then a fixed tree: deterministic).
extern "C" __global__ void mean_f32(const float* x, float* out, i64 n) {
    __shared__ float scratch[32];
    float s = 0.0f;
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) s += x[i];
    s = warp_sum(s);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    if (lane == 0) scratch[warp] = s;
    __syncthreads();
    if (warp == 0) {
        float t = lane < n_warps ? scratch[lane] : 0.0f;
        t = warp_sum(t);
        if (lane == 0) out[0] = n > 0 ? t / (float)n : 0.0f;
    }
}

// Chunked FNV-1a digests of raw element bits (rtx_tensor's `Tensor::bits_checksum`): thread c
// hashes elements [c·chunk, min(n, (c+1)·chunk)) in order, starting from the FNV basis xor c, and
// writes the 64-bit digest as out[2c] (low word), out[2c+1] (high word). Integer arithmetic only:
// the same bits give the same digests as the host's definition.
template <typename B> __device__ void bits_checksum_chunks(const B* x, i64 n, i64 chunk, u32* out, i64 n_chunks) {
    for (i64 c = blockIdx.x * (i64)blockDim.x + threadIdx.x; c < n_chunks; c += (i64)gridDim.x * blockDim.x) {
        unsigned long long h = 0xcbf29ce484222325ULL ^ (unsigned long long)c;
        i64 end = min(n, (c + 1) * chunk);
        for (i64 i = c * chunk; i < end; ++i) h = (h ^ (unsigned long long)x[i]) * 0x100000001b3ULL;
        out[2 * c] = (u32)h;
        out[2 * c + 1] = (u32)(h >> 32);
    }
}
extern "C" __global__ void bits_checksum_chunks_u16(const u16* x, i64 n, i64 chunk, u32* out, i64 n_chunks) { bits_checksum_chunks(x, n, chunk, out, n_chunks); }
extern "C" __global__ void bits_checksum_chunks_u32(const u32* x, i64 n, i64 chunk, u32* out, i64 n_chunks) { bits_checksum_chunks(x, n, chunk, out, n_chunks); }

// ---- attention head layout ----
// rows: [B, T, row_stride] with the heads at columns col_off + h·D; heads: [B, H, T, D].

template <typename S, typename D_> __device__ void rows_to_heads(const S* src, D_* dst, int B, int T, int H, int D, int row_stride, int col_off) {
    i64 n = (i64)B * H * T * D;
    GRID_STRIDE(i, n) {
        int d = i % D;
        i64 r = i / D;
        int t = r % T;
        r /= T;
        int h = r % H;
        int b = r / H;
        stf(dst, i, ldf(src, ((i64)b * T + t) * row_stride + col_off + (i64)h * D + d));
    }
}

template <typename S, typename D_> __device__ void heads_to_rows(const S* src, D_* dst, int B, int T, int H, int D, int row_stride, int col_off) {
    i64 n = (i64)B * H * T * D;
    GRID_STRIDE(i, n) {
        int d = i % D;
        i64 r = i / D;
        int t = r % T;
        r /= T;
        int h = r % H;
        int b = r / H;
        stf(dst, ((i64)b * T + t) * row_stride + col_off + (i64)h * D + d, ldf(src, i));
    }
}

// ---- AdamW on f32 master weights, writing the storage-type parameter ----

template <typename T> __device__ void adamw_master(float* master, T* param, const T* grad, float* m, float* v, i64 n, float lr, float beta1, float beta2, float eps, float weight_decay, float bc1, float bc2) {
    GRID_STRIDE(i, n) {
        float g = ldf(grad, i);
        float p = master[i] * (1.0f - lr * weight_decay);
        float mi = beta1 * m[i] + (1.0f - beta1) * g;
        float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        p -= lr * (mi / bc1) / (sqrtf(vi / bc2) + eps);
        master[i] = p;
        stf(param, i, p);
    }
}

// ---- instantiations: `_f32` on float storage, `_bf16` on bf16 words ----

#define BOTH(NAME, PARAMS, ARGS)                                           \
    extern "C" __global__ void NAME##_f32 PARAMS(float) { NAME ARGS; }   \
    extern "C" __global__ void NAME##_bf16 PARAMS(u16) { NAME ARGS; }

#define P_ADD(T) (const T* a, const T* b, T* out, i64 n, i64 nb)
BOTH(add_rows, P_ADD, (a, b, out, n, nb))
#define P_FILL_ROWS(T) (const T* bias, T* out, i64 rows, int n)
BOTH(fill_rows, P_FILL_ROWS, (bias, out, rows, n))
#define P_FILL(T) (T* out, float v, i64 n)
BOTH(fill, P_FILL, (out, v, n))
#define P_SCALE(T) (T* x, float k, i64 n)
BOTH(scale, P_SCALE, (x, k, n))
#define P_GELU_F(T) (const T* x, T* y, i64 n, int exact)
BOTH(gelu_forward, P_GELU_F, (x, y, n, exact))
#define P_GELU_B(T) (const T* x, const T* dy, T* dx, i64 n, int exact)
BOTH(gelu_backward, P_GELU_B, (x, dy, dx, n, exact))
#define P_CSP(T) (const T* x, float* partial, i64 rows, int n, i64 rows_per_chunk)
BOTH(col_sum_partial, P_CSP, (x, partial, rows, n, rows_per_chunk))
#define P_CSF(T) (const float* partial, T* out, int chunks, int n, int accumulate)
BOTH(col_sum_finish, P_CSF, (partial, out, chunks, n, accumulate))
#define P_LNF(T) (const T* x, const T* w, const T* b, T* y, float* mean, float* rstd, i64 rows, int n, float eps)
BOTH(layer_norm_forward, P_LNF, (x, w, b, y, mean, rstd, rows, n, eps))
#define P_LNB(T) (const T* x, const T* w, const float* mean, const float* rstd, const T* dy, T* dx, i64 rows, int n)
BOTH(layer_norm_backward, P_LNB, (x, w, mean, rstd, dy, dx, rows, n))
#define P_LNP(T) (const T* x, const float* mean, const float* rstd, const T* dy, float* pw, float* pb, i64 rows, int n, i64 rows_per_chunk)
BOTH(layer_norm_param_partial, P_LNP, (x, mean, rstd, dy, pw, pb, rows, n, rows_per_chunk))
#define P_EMBF(T) (const T* table, const u32* ids, T* out, i64 n_ids, int dim)
BOTH(embedding_forward, P_EMBF, (table, ids, out, n_ids, dim))
#define P_EMBB(T) (const T* dout, const u32* ids, float* dtable, i64 n_ids, int dim)
BOTH(embedding_backward, P_EMBB, (dout, ids, dtable, n_ids, dim))
#define P_CEF(T) (const T* logits, const u32* targets, float* losses, i64 rows, int c)
BOTH(cross_entropy_forward, P_CEF, (logits, targets, losses, rows, c))
#define P_CEB(T) (const T* logits, const u32* targets, const float* g, float inv_rows, T* dlogits, i64 rows, int c)
BOTH(cross_entropy_backward, P_CEB, (logits, targets, g, inv_rows, dlogits, rows, c))
#define P_FC(T) (T* logits, const u32* targets, float* losses, int vp, int v, int has_ignore, u32 ignore, float scale, int write_grad)
BOTH(fused_classifier, P_FC, (logits, targets, losses, vp, v, has_ignore, ignore, scale, write_grad))
#define P_SBD(T) (const T* x, const float* g, T* y, i64 n)
BOTH(scale_by_device, P_SBD, (x, g, y, n))
#define P_SBDF(T) (const float* x, const float* g, T* y, i64 n)
BOTH(scale_by_device_from_f32, P_SBDF, (x, g, y, n))
#define P_R2H(T) (const T* src, T* dst, int B, int T_, int H, int D, int row_stride, int col_off)
BOTH(rows_to_heads, P_R2H, (src, dst, B, T_, H, D, row_stride, col_off))
#define P_H2R(T) (const T* src, T* dst, int B, int T_, int H, int D, int row_stride, int col_off)
BOTH(heads_to_rows, P_H2R, (src, dst, B, T_, H, D, row_stride, col_off))
#define P_ADAM(T) (float* master, T* param, const T* grad, float* m, float* v, i64 n, float lr, float beta1, float beta2, float eps, float weight_decay, float bc1, float bc2)
BOTH(adamw_master, P_ADAM, (master, param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, bc1, bc2))

// Vectorized forms for bf16 with D, row_stride and col_off multiples of 8: each thread moves 8
// elements (16 bytes), in head-major order, so both sides are read and written in 128-byte runs.
struct __align__(16) V8 { u32 x, y, z, w; };

// The fused classifier for bf16 rows of a multiple of 8 elements (16-byte aligned): each thread
// moves 8 logits (one 16-byte word) at a time. Same results as fused_classifier_bf16 up to the
// order of the (deterministic) sums.
__device__ __forceinline__ void v8_unpack(V8 w, float* x) {
    u32 words[4] = {w.x, w.y, w.z, w.w};
    for (int k = 0; k < 4; ++k) {
        x[2 * k] = bf16_to_f32((u16)(words[k] & 0xffffu));
        x[2 * k + 1] = bf16_to_f32((u16)(words[k] >> 16));
    }
}

__device__ __forceinline__ V8 v8_pack(const float* x) {
    u32 words[4];
    for (int k = 0; k < 4; ++k) words[k] = (u32)f32_to_bf16(x[2 * k]) | ((u32)f32_to_bf16(x[2 * k + 1]) << 16);
    V8 w;
    w.x = words[0]; w.y = words[1]; w.z = words[2]; w.w = words[3];
    return w;
}

// A row whose target is the ignore index (loss 0) or not a class (loss NaN) has no softmax to
// take: writes its loss and, with a gradient, zeros over the row; true when the row was one.
__device__ __forceinline__ bool v8_row_without_target(V8* rowp, int n8, i64 row, u32 t, int v, int has_ignore, u32 ignore, float* losses, int write_grad) {
    bool ignored = has_ignore && t == ignore;
    if (!ignored && t < (u32)v) return false;
    if (threadIdx.x == 0) losses[row] = ignored ? 0.0f : __int_as_float(0x7fc00000);
    if (write_grad) {
        V8 zero; zero.x = 0u; zero.y = 0u; zero.z = 0u; zero.w = 0u;
        for (int c = threadIdx.x; c < n8; c += blockDim.x) rowp[c] = zero;
    }
    return true;
}

template <bool CACHE> __device__ void fused_classifier_v8(u16* logits, const u32* targets, float* losses, int vp, int v, int has_ignore, u32 ignore, float scale, int write_grad, V8* cache) {
    __shared__ float sm[32], ss[32];
    i64 row = blockIdx.x;
    V8* rowp = (V8*)(logits + row * vp);
    int n8 = vp >> 3;
    u32 t = targets[row];
    if (v8_row_without_target(rowp, n8, row, t, v, has_ignore, ignore, losses, write_grad)) return;
    float m = -INFINITY, s = 0.0f;
    float x[8];
    for (int c = threadIdx.x; c < n8; c += blockDim.x) {
        V8 w = rowp[c];
        if (CACHE) cache[c] = w;
        v8_unpack(w, x);
        int base = c * 8;
        float cm = -INFINITY;
        for (int k = 0; k < 8; ++k) {
            if (base + k >= v) x[k] = -INFINITY;
            cm = fmaxf(cm, x[k]);
        }
        if (cm == -INFINITY) continue;
        if (cm > m) { s *= expf(m - cm); m = cm; }
        for (int k = 0; k < 8; ++k) s += expf(x[k] - m);
    }
    block_lse(m, s, sm, ss);
    float xt = bf16_to_f32(logits[row * vp + t]);
    if (threadIdx.x == 0) losses[row] = logf(s) + m - xt;
    if (!write_grad) return;
    __syncthreads();
    float inv = 1.0f / s;
    for (int c = threadIdx.x; c < n8; c += blockDim.x) {
        v8_unpack(CACHE ? cache[c] : rowp[c], x);
        int base = c * 8;
        for (int k = 0; k < 8; ++k) {
            float g = 0.0f;
            if (base + k < v) {
                g = expf(x[k] - m) * inv;
                if (base + k == (int)t) g -= 1.0f;
                g *= scale;
            }
            x[k] = g;
        }
        rowp[c] = v8_pack(x);
    }
}

extern "C" __global__ void fused_classifier_v8_bf16(u16* logits, const u32* targets, float* losses, int vp, int v, int has_ignore, u32 ignore, float scale, int write_grad) {
    fused_classifier_v8<false>(logits, targets, losses, vp, v, has_ignore, ignore, scale, write_grad, 0);
}

// The row kept in dynamic shared memory (vp·2 bytes) between the two passes: the logits are read
// from global memory once.
extern "C" __global__ void fused_classifier_v8_cached_bf16(u16* logits, const u32* targets, float* losses, int vp, int v, int has_ignore, u32 ignore, float scale, int write_grad) {
    extern __shared__ V8 row_cache[];
    fused_classifier_v8<true>(logits, targets, losses, vp, v, has_ignore, ignore, scale, write_grad, row_cache);
}

// The fused classifier with the row held in registers: one block of 1024 threads per row, each
// thread owning the row's 16-byte words c = tid + k·1024 (k < 8, so rows of up to 65,536 bf16
// logits). All of a thread's loads are issued before any arithmetic (8 words in flight per
// thread instead of one), the row's max and then its sum of exponentials are block reductions in
// a fixed order (deterministic), the exponentials are 2^x on the MUFU unit, and the gradient is
// written from the same registers: the logits are read from global memory once, with no shared
// row cache, so occupancy is set by registers alone.
__device__ __forceinline__ float ex2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

#define FC_WORDS 8
extern "C" __global__ void __launch_bounds__(1024, 1) fused_classifier_v8_regs_bf16(u16* logits, const u32* targets, float* losses, int vp, int v, int has_ignore, u32 ignore, float scale, int write_grad) {
    __shared__ float scratch[32];
    const float L2E = 1.4426950408889634f;
    i64 row = blockIdx.x;
    V8* rowp = (V8*)(logits + row * vp);
    int n8 = vp >> 3;
    u32 t = targets[row];
    if (v8_row_without_target(rowp, n8, row, t, v, has_ignore, ignore, losses, write_grad)) return;
    V8 w[FC_WORDS];
#pragma unroll
    for (int k = 0; k < FC_WORDS; ++k) {
        int c = threadIdx.x + k * 1024;
        if (c < n8) w[k] = rowp[c];
    }
    float xt = threadIdx.x == 0 ? bf16_to_f32(logits[row * vp + t]) : 0.0f;
    float x[8];
    float m = -INFINITY;
#pragma unroll
    for (int k = 0; k < FC_WORDS; ++k) {
        int c = threadIdx.x + k * 1024;
        if (c >= n8) continue;
        v8_unpack(w[k], x);
        int base = c * 8;
#pragma unroll
        for (int e = 0; e < 8; ++e) m = (base + e < v) ? fmaxf(m, x[e]) : m;
    }
    m = block_max(m, scratch);
    const float ml = m * L2E;
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < FC_WORDS; ++k) {
        int c = threadIdx.x + k * 1024;
        if (c >= n8) continue;
        v8_unpack(w[k], x);
        int base = c * 8;
#pragma unroll
        for (int e = 0; e < 8; ++e) s += (base + e < v) ? ex2_approx(fmaf(x[e], L2E, -ml)) : 0.0f;
    }
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) losses[row] = logf(s) + m - xt;
    if (!write_grad) return;
    const float k_scale = scale / s;
#pragma unroll
    for (int k = 0; k < FC_WORDS; ++k) {
        int c = threadIdx.x + k * 1024;
        if (c >= n8) continue;
        v8_unpack(w[k], x);
        int base = c * 8;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            float g = (base + e < v) ? ex2_approx(fmaf(x[e], L2E, -ml)) * k_scale : 0.0f;
            x[e] = (base + e == (int)t) ? g - scale : g;
        }
        rowp[c] = v8_pack(x);
    }
}

__device__ __forceinline__ i64 row_index_v8(i64 i, int T_, int H, int D8, int row_stride, int col_off) {
    int d8 = i % D8;
    i64 r = i / D8;
    int t = r % T_;
    r /= T_;
    int h = r % H;
    i64 b = r / H;
    return (b * T_ + t) * row_stride + col_off + (i64)h * D8 * 8 + d8 * 8;
}

extern "C" __global__ void rows_to_heads_v8_bf16(const u16* src, u16* dst, int B, int T_, int H, int D, int row_stride, int col_off) {
    int D8 = D / 8;
    GRID_STRIDE(i, (i64)B * H * T_ * D8) *(V8*)(dst + i * 8) = *(const V8*)(src + row_index_v8(i, T_, H, D8, row_stride, col_off));
}

extern "C" __global__ void heads_to_rows_v8_bf16(const u16* src, u16* dst, int B, int T_, int H, int D, int row_stride, int col_off) {
    int D8 = D / 8;
    GRID_STRIDE(i, (i64)B * H * T_ * D8) *(V8*)(dst + row_index_v8(i, T_, H, D8, row_stride, col_off)) = *(const V8*)(src + i * 8);
}

// Vectorized bf16 elementwise kernels (8 elements, 16 bytes per thread per step) for lengths
// that are multiples of 8: `n8 = n / 8`, `nb8 = nb / 8`.
__device__ __forceinline__ void unpack8(V8 v, float* f) {
    f[0] = bf16_to_f32((u16)(v.x & 0xffffu)); f[1] = bf16_to_f32((u16)(v.x >> 16));
    f[2] = bf16_to_f32((u16)(v.y & 0xffffu)); f[3] = bf16_to_f32((u16)(v.y >> 16));
    f[4] = bf16_to_f32((u16)(v.z & 0xffffu)); f[5] = bf16_to_f32((u16)(v.z >> 16));
    f[6] = bf16_to_f32((u16)(v.w & 0xffffu)); f[7] = bf16_to_f32((u16)(v.w >> 16));
}

__device__ __forceinline__ V8 pack8(const float* f) {
    V8 v;
    v.x = (u32)f32_to_bf16(f[0]) | ((u32)f32_to_bf16(f[1]) << 16);
    v.y = (u32)f32_to_bf16(f[2]) | ((u32)f32_to_bf16(f[3]) << 16);
    v.z = (u32)f32_to_bf16(f[4]) | ((u32)f32_to_bf16(f[5]) << 16);
    v.w = (u32)f32_to_bf16(f[6]) | ((u32)f32_to_bf16(f[7]) << 16);
    return v;
}

extern "C" __global__ void add_rows_v8_bf16(const u16* a, const u16* b, u16* out, i64 n8, i64 nb8) {
    GRID_STRIDE(i, n8) {
        float x[8], y[8];
        unpack8(((const V8*)a)[i], x);
        unpack8(((const V8*)b)[i % nb8], y);
        for (int e = 0; e < 8; ++e) x[e] += y[e];
        ((V8*)out)[i] = pack8(x);
    }
}

extern "C" __global__ void gelu_forward_v8_bf16(const u16* x, u16* y, i64 n8, int exact) {
    GRID_STRIDE(i, n8) {
        float v[8];
        unpack8(((const V8*)x)[i], v);
        for (int e = 0; e < 8; ++e) v[e] = gelu_any(v[e], exact);
        ((V8*)y)[i] = pack8(v);
    }
}

extern "C" __global__ void gelu_backward_v8_bf16(const u16* x, const u16* dy, u16* dx, i64 n8, int exact) {
    GRID_STRIDE(i, n8) {
        float v[8], g[8];
        unpack8(((const V8*)x)[i], v);
        unpack8(((const V8*)dy)[i], g);
        for (int e = 0; e < 8; ++e) g[e] *= gelu_any_grad(v[e], exact);
        ((V8*)dx)[i] = pack8(g);
    }
}

// Layer norm on bf16 rows with n a multiple of 8: one warp per row, 8 elements per lane access.
extern "C" __global__ void layer_norm_forward_v8_bf16(const u16* x, const u16* w, const u16* b, u16* y, float* mean, float* rstd, i64 rows, int n, float eps) {
    i64 row = blockIdx.x * 8 + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const V8* xr = (const V8*)(x + row * n);
    int n8 = n / 8;
    float s = 0.0f;
    for (int j = lane; j < n8; j += 32) { float v[8]; unpack8(xr[j], v); for (int e = 0; e < 8; ++e) s += v[e]; }
    float mu = warp_sum(s) / n;
    float q = 0.0f;
    for (int j = lane; j < n8; j += 32) { float v[8]; unpack8(xr[j], v); for (int e = 0; e < 8; ++e) { float d = v[e] - mu; q += d * d; } }
    float rs = rsqrtf(warp_sum(q) / n + eps);
    if (lane == 0) { mean[row] = mu; rstd[row] = rs; }
    V8* yr = (V8*)(y + row * n);
    for (int j = lane; j < n8; j += 32) {
        float v[8], wv[8], bv[8];
        unpack8(xr[j], v);
        if (w) unpack8(((const V8*)w)[j], wv); else for (int e = 0; e < 8; ++e) wv[e] = 1.0f;
        if (b) unpack8(((const V8*)b)[j], bv); else for (int e = 0; e < 8; ++e) bv[e] = 0.0f;
        for (int e = 0; e < 8; ++e) v[e] = (v[e] - mu) * rs * wv[e] + bv[e];
        yr[j] = pack8(v);
    }
}

extern "C" __global__ void layer_norm_backward_v8_bf16(const u16* x, const u16* w, const float* mean, const float* rstd, const u16* dy, u16* dx, i64 rows, int n) {
    i64 row = blockIdx.x * 8 + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const V8* xr = (const V8*)(x + row * n);
    const V8* gr = (const V8*)(dy + row * n);
    int n8 = n / 8;
    float mu = mean[row], rs = rstd[row];
    float sg = 0.0f, sgx = 0.0f;
    for (int j = lane; j < n8; j += 32) {
        float v[8], g[8], wv[8];
        unpack8(xr[j], v);
        unpack8(gr[j], g);
        if (w) unpack8(((const V8*)w)[j], wv); else for (int e = 0; e < 8; ++e) wv[e] = 1.0f;
        for (int e = 0; e < 8; ++e) { float gg = g[e] * wv[e]; sg += gg; sgx += gg * (v[e] - mu) * rs; }
    }
    float mg = warp_sum(sg) / n;
    float mgx = warp_sum(sgx) / n;
    V8* dr = (V8*)(dx + row * n);
    for (int j = lane; j < n8; j += 32) {
        float v[8], g[8], wv[8];
        unpack8(xr[j], v);
        unpack8(gr[j], g);
        if (w) unpack8(((const V8*)w)[j], wv); else for (int e = 0; e < 8; ++e) wv[e] = 1.0f;
        for (int e = 0; e < 8; ++e) v[e] = rs * (g[e] * wv[e] - mg - (v[e] - mu) * rs * mgx);
        dr[j] = pack8(v);
    }
}


// ---- layer norm fused with the residual stream: bf16 rows of n = 8·n8 elements, n8 ≤ 32·K ----
// One warp per row; lane l owns the 16-byte words l, l+32, ... (K of them) and keeps them in
// registers as packed bf16, so a row is read from global memory once.
//
// Forward: s = a + b (b the same shape or broadcast over leading rows: row r reads b's row
// r % b_rows), rounded to bf16 and stored, then y = layer_norm(s) from the rounded s: the same
// bits as the add kernel followed by the layer-norm kernel, one pass fewer (s is not read back).

template <int K> __device__ void add_layer_norm_forward_k(const u16* a, const u16* b, const u16* w, const u16* bias, u16* s, u16* y, float* mean, float* rstd, i64 rows, int n, i64 b_rows, float eps) {
    i64 row = blockIdx.x * 8 + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    int n8 = n >> 3;
    const V8* ar = (const V8*)(a + row * n);
    const V8* br = (const V8*)(b + (row % b_rows) * n);
    V8* sr = (V8*)(s + row * n);
    V8 held[K];
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        int j = lane + 32 * k;
        if (j < n8) {
            float x[8], z[8];
            unpack8(ar[j], x);
            unpack8(br[j], z);
            for (int e = 0; e < 8; ++e) x[e] += z[e];
            V8 p = pack8(x);
            sr[j] = p;
            held[k] = p;
            unpack8(p, x);
            for (int e = 0; e < 8; ++e) sum += x[e];
        }
    }
    float mu = warp_sum(sum) / n;
    float q = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        if (lane + 32 * k < n8) {
            float x[8];
            unpack8(held[k], x);
            for (int e = 0; e < 8; ++e) { float d = x[e] - mu; q += d * d; }
        }
    }
    float rs = rsqrtf(warp_sum(q) / n + eps);
    if (lane == 0) { mean[row] = mu; rstd[row] = rs; }
    V8* yr = (V8*)(y + row * n);
#pragma unroll
    for (int k = 0; k < K; ++k) {
        int j = lane + 32 * k;
        if (j < n8) {
            float x[8], wv[8], bv[8];
            unpack8(held[k], x);
            if (w) unpack8(((const V8*)w)[j], wv); else for (int e = 0; e < 8; ++e) wv[e] = 1.0f;
            if (bias) unpack8(((const V8*)bias)[j], bv); else for (int e = 0; e < 8; ++e) bv[e] = 0.0f;
            for (int e = 0; e < 8; ++e) x[e] = (x[e] - mu) * rs * wv[e] + bv[e];
            yr[j] = pack8(x);
        }
    }
}

// Backward, accumulating: dx = prior + layer_norm_backward(x, dy) (prior, the gradient the
// residual stream already has from its other consumers, may be null), rounded once; and with pw
// non-null the block's partial sums of dw = Σ dy·x̂ and db = Σ dy over its rows_per_block rows,
// pw[blockIdx.x·n + j], pb[...]. Each warp adds its rows' terms into its own slice of dynamic
// shared memory (2·n floats per warp, stored [element of the word][word] so the lanes hit
// distinct banks); the block then sums its 8 warps in a fixed order, and col_sum_finish_wide
// sums the blocks in order: deterministic. One pass over x, dy and prior instead of the three of
// the unfused form (backward, parameter partials, add); the accumulators in shared memory keep
// the registers low enough for 4 blocks (32 warps) per SM.

template <int K> __device__ void layer_norm_backward_acc_k(const u16* x, const u16* w, const float* mean, const float* rstd, const u16* dy, const u16* prior, u16* dx, float* pw, float* pb, i64 rows, int n, int rows_per_block) {
    extern __shared__ float acc[];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n8 = n >> 3;
    float* aw = acc + (i64)warp * 2 * n;
    float* ab = aw + n;
    if (pw) {
        for (int j = lane; j < 2 * n; j += 32) aw[j] = 0.0f;
        __syncwarp();
    }
    i64 r0 = (i64)blockIdx.x * rows_per_block;
    i64 r1 = min(rows, r0 + rows_per_block);
    for (i64 row = r0 + warp; row < r1; row += 8) {
        const V8* xr = (const V8*)(x + row * n);
        const V8* gr = (const V8*)(dy + row * n);
        float mu = mean[row], rs = rstd[row];
        V8 xw[K], gw[K];
#pragma unroll
        for (int k = 0; k < K; ++k) {
            int j = lane + 32 * k;
            if (j < n8) { xw[k] = xr[j]; gw[k] = gr[j]; }
        }
        float sg = 0.0f, sgx = 0.0f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            int j = lane + 32 * k;
            if (j < n8) {
                float v[8], g[8], wv[8];
                unpack8(xw[k], v);
                unpack8(gw[k], g);
                if (w) unpack8(((const V8*)w)[j], wv); else for (int e = 0; e < 8; ++e) wv[e] = 1.0f;
                for (int e = 0; e < 8; ++e) {
                    float gg = g[e] * wv[e];
                    sg += gg;
                    sgx += gg * (v[e] - mu) * rs;
                    if (pw) {
                        aw[e * n8 + j] += g[e] * (v[e] - mu) * rs;
                        ab[e * n8 + j] += g[e];
                    }
                }
            }
        }
        float mg = warp_sum(sg) / n;
        float mgx = warp_sum(sgx) / n;
        V8* dr = (V8*)(dx + row * n);
#pragma unroll
        for (int k = 0; k < K; ++k) {
            int j = lane + 32 * k;
            if (j < n8) {
                float v[8], g[8], wv[8], p[8];
                unpack8(xw[k], v);
                unpack8(gw[k], g);
                if (w) unpack8(((const V8*)w)[j], wv); else for (int e = 0; e < 8; ++e) wv[e] = 1.0f;
                if (prior) unpack8(((const V8*)(prior + row * n))[j], p); else for (int e = 0; e < 8; ++e) p[e] = 0.0f;
                for (int e = 0; e < 8; ++e) v[e] = rs * (g[e] * wv[e] - mg - (v[e] - mu) * rs * mgx) + p[e];
                dr[j] = pack8(v);
            }
        }
    }
    if (!pw) return;
    __syncthreads();
    for (int col = threadIdx.x; col < n; col += blockDim.x) {
        int idx = (col & 7) * n8 + (col >> 3);
        float tw = 0.0f, tb = 0.0f;
        for (int wi = 0; wi < 8; ++wi) {
            tw += acc[(i64)wi * 2 * n + idx];
            tb += acc[(i64)wi * 2 * n + n + idx];
        }
        pw[(i64)blockIdx.x * n + col] = tw;
        pb[(i64)blockIdx.x * n + col] = tb;
    }
}

// out[j] = Σ_c partial[c·n + j] over many chunks: block (32, 8) per 32 columns; thread (x, y)
// sums chunks y, y+8, ... in order, then row 0 adds the 8 sums in order (deterministic).
template <typename T> __device__ void col_sum_finish_wide(const float* partial, T* out, int chunks, int n) {
    __shared__ float s[8][33];
    int col = blockIdx.x * 32 + threadIdx.x;
    float t = 0.0f;
    if (col < n)
        for (int c = threadIdx.y; c < chunks; c += 8) t += partial[(i64)c * n + col];
    s[threadIdx.y][threadIdx.x] = t;
    __syncthreads();
    if (threadIdx.y == 0 && col < n) {
        float u = 0.0f;
        for (int k = 0; k < 8; ++k) u += s[k][threadIdx.x];
        stf(out, col, u);
    }
}
#define P_CSFW(T) (const float* partial, T* out, int chunks, int n)
BOTH(col_sum_finish_wide, P_CSFW, (partial, out, chunks, n))

#define ADD_LN_K(K)                                                                                                                   \
    extern "C" __global__ void add_layer_norm_forward_k##K##_bf16(const u16* a, const u16* b, const u16* w, const u16* bias, u16* s, \
                                                                  u16* y, float* mean, float* rstd, i64 rows, int n, i64 b_rows,     \
                                                                  float eps) {                                                        \
        add_layer_norm_forward_k<K>(a, b, w, bias, s, y, mean, rstd, rows, n, b_rows, eps);                                           \
    }                                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(256, 4) layer_norm_backward_acc_k##K##_bf16(const u16* x, const u16* w, const float* mean, const float* rstd,  \
                                                                   const u16* dy, const u16* prior, u16* dx, float* pw, float* pb,   \
                                                                   i64 rows, int n, int rows_per_block) {                            \
        layer_norm_backward_acc_k<K>(x, w, mean, rstd, dy, prior, dx, pw, pb, rows, n, rows_per_block);                               \
    }
ADD_LN_K(1)
ADD_LN_K(2)
ADD_LN_K(3)
ADD_LN_K(4)

// AdamW on f32 master weights for bf16 parameters of a multiple of 8 elements: each thread
// updates 8 elements per step (16-byte gradient and parameter words, 32-byte master and moment
// runs), with adamw_master's arithmetic per element, so the results are the same bits.
struct __align__(16) F4 { float x, y, z, w; };

// The update of word i (8 elements) of one tensor.
__device__ __forceinline__ void adamw_word(float* master, u16* param, const u16* grad, float* m, float* v, i64 i, float lr, float beta1, float beta2, float eps, float weight_decay, float bc1, float bc2) {
    float g[8], p[8], mi[8], vi[8];
    unpack8(((const V8*)grad)[i], g);
    F4* mp = (F4*)master + 2 * i;
    F4* m4 = (F4*)m + 2 * i;
    F4* v4 = (F4*)v + 2 * i;
    F4 a0 = mp[0], a1 = mp[1], b0 = m4[0], b1 = m4[1], c0 = v4[0], c1 = v4[1];
    p[0] = a0.x; p[1] = a0.y; p[2] = a0.z; p[3] = a0.w; p[4] = a1.x; p[5] = a1.y; p[6] = a1.z; p[7] = a1.w;
    mi[0] = b0.x; mi[1] = b0.y; mi[2] = b0.z; mi[3] = b0.w; mi[4] = b1.x; mi[5] = b1.y; mi[6] = b1.z; mi[7] = b1.w;
    vi[0] = c0.x; vi[1] = c0.y; vi[2] = c0.z; vi[3] = c0.w; vi[4] = c1.x; vi[5] = c1.y; vi[6] = c1.z; vi[7] = c1.w;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        float pe = p[e] * (1.0f - lr * weight_decay);
        float me = beta1 * mi[e] + (1.0f - beta1) * g[e];
        float ve = beta2 * vi[e] + (1.0f - beta2) * g[e] * g[e];
        mi[e] = me;
        vi[e] = ve;
        pe -= lr * (me / bc1) / (sqrtf(ve / bc2) + eps);
        p[e] = pe;
    }
    mp[0] = F4{p[0], p[1], p[2], p[3]};
    mp[1] = F4{p[4], p[5], p[6], p[7]};
    m4[0] = F4{mi[0], mi[1], mi[2], mi[3]};
    m4[1] = F4{mi[4], mi[5], mi[6], mi[7]};
    v4[0] = F4{vi[0], vi[1], vi[2], vi[3]};
    v4[1] = F4{vi[4], vi[5], vi[6], vi[7]};
    ((V8*)param)[i] = pack8(p);
}

extern "C" __global__ void adamw_master_v8_bf16(float* master, u16* param, const u16* grad, float* m, float* v, i64 n8, float lr, float beta1, float beta2, float eps, float weight_decay, float bc1, float bc2) {
    GRID_STRIDE(i, n8) adamw_word(master, param, grad, m, v, i, lr, beta1, beta2, eps, weight_decay, bc1, bc2);
}

// Every tensor of a model in one launch (a GPT-2 has ~150, most of them biases and norm
// parameters whose own launches would cost more than their update): tensor k owns blocks
// [block_start, next block_start), one 8-element word per thread; a block finds its tensor by
// binary search over the table (uploaded per step: the gradients are fresh buffers).
struct AdamTensor {
    float* master;
    u16* param;
    const u16* grad;
    float* m;
    float* v;
    i64 n8;
    i64 block_start;
    float weight_decay, bc1, bc2, pad;
};

extern "C" __global__ void adamw_master_multi_v8_bf16(const AdamTensor* ts, int n_tensors, float lr, float beta1, float beta2, float eps) {
    int lo = 0, hi = n_tensors - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (ts[mid].block_start <= (i64)blockIdx.x) lo = mid; else hi = mid - 1;
    }
    const AdamTensor* t = ts + lo;
    i64 i = ((i64)blockIdx.x - t->block_start) * blockDim.x + threadIdx.x;
    if (i >= t->n8) return;
    adamw_word(t->master, t->param, t->grad, t->m, t->v, i, lr, beta1, beta2, eps, t->weight_decay, t->bc1, t->bc2);
}

// ---- strided copies (contiguous(), cat and narrow gradients of device views) ----

// Up to 8 dimensions; `shape` is the copied region, each side with its own strides and offset
// (in elements). Element i of the region is decoded row-major from `shape`.
#define MAX_COPY_DIMS 8
struct CopyDims {
    i64 shape[MAX_COPY_DIMS];
    i64 src_stride[MAX_COPY_DIMS];
    i64 dst_stride[MAX_COPY_DIMS];
    i64 src_offset, dst_offset, n;
    int ndim;
};

template <typename W> __device__ void strided_copy(const W* src, W* dst, const CopyDims d) {
    GRID_STRIDE(i, d.n) {
        i64 rest = i, s = d.src_offset, t = d.dst_offset;
        for (int k = d.ndim - 1; k >= 0; --k) {
            i64 c = rest % d.shape[k];
            rest /= d.shape[k];
            s += c * d.src_stride[k];
            t += c * d.dst_stride[k];
        }
        dst[t] = src[s];
    }
}

extern "C" __global__ void strided_copy_u16(const u16* src, u16* dst, const CopyDims d) { strided_copy(src, dst, d); }
extern "C" __global__ void strided_copy_u32(const u32* src, u32* dst, const CopyDims d) { strided_copy(src, dst, d); }

// ---- latent regression losses (JEPA): mean of l(pred - target) over all elements ----
// kind 0: squared error d²; kind 1: smooth L1 with beta 1 (0.5·d² where |d| < 1, else |d| - 0.5).
// Two passes, deterministic: each block writes a partial sum, `latent_loss_finish` adds the
// partials in order and divides by n.

__device__ __forceinline__ float latent_term(float d, int kind) {
    if (kind == 0) return d * d;
    float a = fabsf(d);
    return a < 1.0f ? 0.5f * d * d : a - 0.5f;
}

__device__ __forceinline__ float latent_grad(float d, int kind) {
    if (kind == 0) return 2.0f * d;
    return fabsf(d) < 1.0f ? d : (d > 0.0f ? 1.0f : -1.0f);
}

template <typename T> __device__ void latent_loss_partials(const T* pred, const T* target, i64 n, int kind, float* partials) {
    __shared__ float scratch[32];
    float s = 0.0f;
    GRID_STRIDE(i, n) s += latent_term(ldf(pred, i) - ldf(target, i), kind);
    s = warp_sum(s);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    if (lane == 0) scratch[warp] = s;
    __syncthreads();
    if (warp == 0) {
        float t = lane < n_warps ? scratch[lane] : 0.0f;
        t = warp_sum(t);
        if (lane == 0) partials[blockIdx.x] = t;
    }
}

extern "C" __global__ void latent_loss_finish(const float* partials, int n_partials, float inv_n, float* out) {
    __shared__ float scratch[32];
    float s = 0.0f;
    for (int i = threadIdx.x; i < n_partials; i += blockDim.x) s += partials[i];
    s = warp_sum(s);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    if (lane == 0) scratch[warp] = s;
    __syncthreads();
    if (warp == 0) {
        float t = lane < n_warps ? scratch[lane] : 0.0f;
        t = warp_sum(t);
        if (lane == 0) out[0] = t * inv_n;
    }
}

// dpred = g[0] · inv_n · l'(pred - target) (g read on the device: backward never waits for the host).
template <typename T> __device__ void latent_loss_backward(const T* pred, const T* target, const float* g, i64 n, int kind, float inv_n, T* dpred) {
    float k = g[0] * inv_n;
    GRID_STRIDE(i, n) stf(dpred, i, k * latent_grad(ldf(pred, i) - ldf(target, i), kind));
}

// ---- the collapse monitor: mean over features of the batch std of token-mean features ----
// z [B, K, C]: `feature_means` writes each image's mean over its K tokens per feature
// (means [B, C], one thread per (b, c)); `feature_stds` takes, per feature, the unbiased std over
// the B images (two passes, f32) into stds[c]; the mean over c is `mean_f32` (fixed order).
template <typename T> __device__ void feature_means(const T* z, int B, int K, int C, float* means) {
    GRID_STRIDE(i, (i64)B * C) {
        i64 b = i / C, c = i % C;
        float m = 0.0f;
        for (int k = 0; k < K; ++k) m += ldf(z, (b * K + k) * C + c);
        means[i] = m / (float)K;
    }
}

extern "C" __global__ void feature_stds(const float* means, int B, int C, float* stds) {
    GRID_STRIDE(c, C) {
        float sum = 0.0f;
        for (int b = 0; b < B; ++b) sum += means[(i64)b * C + c];
        float mean = sum / (float)B, ss = 0.0f;
        for (int b = 0; b < B; ++b) {
            float d = means[(i64)b * C + c] - mean;
            ss += d * d;
        }
        stds[c] = B > 1 ? sqrtf(ss / (float)(B - 1)) : 0.0f;
    }
}

#define P_LOSS_PARTIALS(T) (const T* pred, const T* target, i64 n, int kind, float* partials)
#define P_LOSS_BACKWARD(T) (const T* pred, const T* target, const float* g, i64 n, int kind, float inv_n, T* dpred)
#define P_FEATURE_MEANS(T) (const T* z, int B, int K, int C, float* means)
BOTH(latent_loss_partials, P_LOSS_PARTIALS, (pred, target, n, kind, partials))
BOTH(latent_loss_backward, P_LOSS_BACKWARD, (pred, target, g, n, kind, inv_n, dpred))
BOTH(feature_means, P_FEATURE_MEANS, (z, B, K, C, means))

// ---- EMA of a whole encoder in one launch: target = m·target + (1 - m)·source ----
// The targets are f32 (the EMA state itself); the sources f32 or bf16 (a bf16 encoder's
// parameters). Rounded multiply and add (no FMA contraction), so f32 results equal the host's
// `m * t + (1 - m) * s` bit for bit. Tensor k owns blocks [block_start, next); a block finds its
// tensor by binary search, as in `adamw_master_multi`.
struct EmaTensor {
    float* target;
    const void* source;
    i64 n;
    i64 block_start;
};

template <typename S> __device__ void ema_multi(const EmaTensor* ts, int n_tensors, float m, float one_minus_m) {
    int lo = 0, hi = n_tensors - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (ts[mid].block_start <= (i64)blockIdx.x) lo = mid; else hi = mid - 1;
    }
    const EmaTensor t = ts[lo];
    i64 i = ((i64)blockIdx.x - t.block_start) * blockDim.x + threadIdx.x;
    if (i < t.n) {
        float s = ldf((const S*)t.source, i);
        t.target[i] = __fadd_rn(__fmul_rn(m, t.target[i]), __fmul_rn(one_minus_m, s));
    }
}

extern "C" __global__ void ema_multi_f32(const EmaTensor* ts, int n_tensors, float m, float one_minus_m) { ema_multi<float>(ts, n_tensors, m, one_minus_m); }
extern "C" __global__ void ema_multi_bf16(const EmaTensor* ts, int n_tensors, float m, float one_minus_m) { ema_multi<u16>(ts, n_tensors, m, one_minus_m); }
