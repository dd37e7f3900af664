// rtx-kernels CUDA core module: elementwise, broadcast, unary, softmax, norms, cross-entropy,
// embedding, AdamW and dtype casts. Compiled once per process by NVRTC (see nvrtc.rs); f32
// compute, no toolkit headers; the shared prelude (types, bf16 words, warp sums, GELU) is
// common.cu, which nvrtc.rs puts in front.

#define MAX_DIMS 6

struct BroadcastShape {
    int ndim;
    i64 shape[MAX_DIMS];
    i64 a_strides[MAX_DIMS];
    i64 b_strides[MAX_DIMS];
};

__device__ __forceinline__ float apply_binary(int op, float a, float b) {
    switch (op) {
        case 0: return a + b;
        case 1: return a - b;
        case 2: return a * b;
        case 3: return a / b;
        case 4: return fmaxf(a, b);
        default: return fminf(a, b);
    }
}

extern "C" __global__ void binary_contig_f32(int op, const float* a, const float* b, float* out, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        out[i] = apply_binary(op, a[i], b[i]);
    }
}

// out is contiguous with `shape`; a and b are read through their (possibly zero) strides.
extern "C" __global__ void binary_broadcast_f32(int op, const float* a, const float* b, float* out, i64 n, BroadcastShape s) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 rem = i, ia = 0, ib = 0;
        for (int d = s.ndim - 1; d >= 0; --d) {
            i64 c = rem % s.shape[d];
            rem /= s.shape[d];
            ia += c * s.a_strides[d];
            ib += c * s.b_strides[d];
        }
        out[i] = apply_binary(op, a[ia], b[ib]);
    }
}

__device__ __forceinline__ float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

// op: 0 exp, 1 tanh-GELU, 2 SiLU, 3 ReLU, 4 exact (erf) GELU.
extern "C" __global__ void unary_f32(int op, const float* x, float* y, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float v = x[i], r;
        switch (op) {
            case 0: r = expf(v); break;
            case 1: r = gelu_tanh(v); break;
            case 4: r = gelu_erf(v); break;
            case 2: r = v * sigmoidf(v); break;
            default: r = v > 0.0f ? v : 0.0f; break;
        }
        y[i] = r;
    }
}

// dx = dy * f'(x).
extern "C" __global__ void unary_backward_f32(int op, const float* x, const float* dy, float* dx, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float v = x[i], g;
        switch (op) {
            case 0: g = expf(v); break;
            case 1: g = gelu_tanh_grad(v); break;
            case 4: g = gelu_erf_grad(v); break;
            case 2: { float s = sigmoidf(v); g = s * (1.0f + v * (1.0f - s)); break; }
            default: g = v > 0.0f ? 1.0f : 0.0f; break;
        }
        dx[i] = dy[i] * g;
    }
}

extern "C" __global__ void cast_f32_bf16(const float* x, u16* y, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) y[i] = f32_to_bf16(x[i]);
}

extern "C" __global__ void cast_bf16_f32(const u16* x, float* y, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) y[i] = bf16_to_f32(x[i]);
}

// ---- softmax over rows (one block per row) ----

extern "C" __global__ void softmax_rows_f32(const float* x, float* y, int n) {
    __shared__ float scratch[32];
    const float* xr = x + (i64)blockIdx.x * n;
    float* yr = y + (i64)blockIdx.x * n;
    float m = -INFINITY;
    for (int j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, xr[j]);
    m = block_max(m, scratch);
    if (!(fabsf(m) < INFINITY)) m = 0.0f;
    float s = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) s += expf(xr[j] - m);
    s = block_sum(s, scratch);
    float inv = 1.0f / s;
    for (int j = threadIdx.x; j < n; j += blockDim.x) yr[j] = expf(xr[j] - m) * inv;
}

// dx = y ⊙ (dy − Σ y ⊙ dy).
extern "C" __global__ void softmax_backward_rows_f32(const float* y, const float* dy, float* dx, int n) {
    __shared__ float scratch[32];
    i64 off = (i64)blockIdx.x * n;
    float d = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) d += y[off + j] * dy[off + j];
    d = block_sum(d, scratch);
    for (int j = threadIdx.x; j < n; j += blockDim.x) dx[off + j] = y[off + j] * (dy[off + j] - d);
}

// ---- layer norm and RMS norm (one block per row; parameter gradients by column) ----

extern "C" __global__ void layer_norm_forward_f32(const float* x, const float* w, const float* b, float* y, float* mean, float* rstd, int n, float eps) {
    __shared__ float scratch[32];
    i64 off = (i64)blockIdx.x * n;
    float s = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) s += x[off + j];
    float mu = block_sum(s, scratch) / n;
    float v = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) { float d = x[off + j] - mu; v += d * d; }
    float var = block_sum(v, scratch) / n;
    float rs = rsqrtf(var + eps);
    if (threadIdx.x == 0) { mean[blockIdx.x] = mu; rstd[blockIdx.x] = rs; }
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float h = (x[off + j] - mu) * rs;
        if (w) h *= w[j];
        if (b) h += b[j];
        y[off + j] = h;
    }
}

extern "C" __global__ void layer_norm_backward_f32(const float* x, const float* w, const float* mean, const float* rstd, const float* dy, float* dx, int n) {
    __shared__ float scratch[32];
    i64 off = (i64)blockIdx.x * n;
    float mu = mean[blockIdx.x], rs = rstd[blockIdx.x];
    float sg = 0.0f, sgx = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float g = dy[off + j] * (w ? w[j] : 1.0f);
        sg += g;
        sgx += g * (x[off + j] - mu) * rs;
    }
    float mg = block_sum(sg, scratch) / n;
    float mgx = block_sum(sgx, scratch) / n;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float g = dy[off + j] * (w ? w[j] : 1.0f);
        float xh = (x[off + j] - mu) * rs;
        dx[off + j] = rs * (g - mg - xh * mgx);
    }
}

// dw[j] += Σ_i dy·xhat, db[j] += Σ_i dy (one thread per column, rows in order: deterministic).
// For RMS norm pass mean = NULL and db = NULL.
extern "C" __global__ void norm_param_grads_f32(const float* x, const float* mean, const float* rstd, const float* dy, float* dw, float* db, int rows, int n) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    float sw = 0.0f, sb = 0.0f;
    for (int i = 0; i < rows; ++i) {
        i64 o = (i64)i * n + j;
        float mu = mean ? mean[i] : 0.0f;
        sw += dy[o] * (x[o] - mu) * rstd[i];
        sb += dy[o];
    }
    if (dw) dw[j] += sw;
    if (db) db[j] += sb;
}

extern "C" __global__ void rms_norm_forward_f32(const float* x, const float* w, float* y, float* rstd, int n, float eps) {
    __shared__ float scratch[32];
    i64 off = (i64)blockIdx.x * n;
    float s = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) s += x[off + j] * x[off + j];
    float rs = rsqrtf(block_sum(s, scratch) / n + eps);
    if (threadIdx.x == 0) rstd[blockIdx.x] = rs;
    for (int j = threadIdx.x; j < n; j += blockDim.x) y[off + j] = x[off + j] * rs * (w ? w[j] : 1.0f);
}

extern "C" __global__ void rms_norm_backward_f32(const float* x, const float* w, const float* rstd, const float* dy, float* dx, int n) {
    __shared__ float scratch[32];
    i64 off = (i64)blockIdx.x * n;
    float rs = rstd[blockIdx.x];
    float d = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) d += dy[off + j] * (w ? w[j] : 1.0f) * x[off + j];
    float c = rs * rs * rs * block_sum(d, scratch) / n;
    for (int j = threadIdx.x; j < n; j += blockDim.x) dx[off + j] = rs * dy[off + j] * (w ? w[j] : 1.0f) - x[off + j] * c;
}

// ---- fused softmax cross-entropy (one block per row) ----
// loss_i = −(1−ε)·log p[t] − (ε/C)·Σ log p; grad = p − q. Rows with t == ignore (when
// has_ignore) get loss 0 and a zero gradient row. grad may be NULL.
extern "C" __global__ void cross_entropy_f32(const float* logits, const u32* targets, float* losses, float* grad, int c, int has_ignore, u32 ignore, float smoothing) {
    __shared__ float scratch[32];
    i64 off = (i64)blockIdx.x * c;
    u32 t = targets[blockIdx.x];
    if ((has_ignore && t == ignore) || t >= (u32)c) {
        // An out-of-range target gets a NaN loss so the caller sees it.
        if (threadIdx.x == 0) losses[blockIdx.x] = (has_ignore && t == ignore) ? 0.0f : __int_as_float(0x7fc00000);
        if (grad) for (int j = threadIdx.x; j < c; j += blockDim.x) grad[off + j] = 0.0f;
        return;
    }
    float m = -INFINITY;
    for (int j = threadIdx.x; j < c; j += blockDim.x) m = fmaxf(m, logits[off + j]);
    m = block_max(m, scratch);
    float s = 0.0f, sl = 0.0f;
    for (int j = threadIdx.x; j < c; j += blockDim.x) { s += expf(logits[off + j] - m); sl += logits[off + j]; }
    s = block_sum(s, scratch);
    sl = block_sum(sl, scratch);
    float lse = logf(s) + m;
    float nll = lse - logits[off + t];
    float loss = nll;
    if (smoothing > 0.0f) {
        float mean_logp = (sl - c * lse) / c;
        loss = (1.0f - smoothing) * nll - smoothing * mean_logp;
    }
    if (threadIdx.x == 0) losses[blockIdx.x] = loss;
    if (grad) {
        float inv = 1.0f / s, offv = smoothing / c;
        for (int j = threadIdx.x; j < c; j += blockDim.x) {
            float g = expf(logits[off + j] - m) * inv - offv;
            if (j == (int)t) g -= 1.0f - smoothing;
            grad[off + j] = g;
        }
    }
}

// ---- embedding ----

extern "C" __global__ void embedding_forward_f32(const float* table, const u32* ids, float* out, i64 n_ids, int dim) {
    i64 total = n_ids * dim;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        i64 r = i / dim;
        int c = (int)(i - r * dim);
        out[i] = table[(i64)ids[r] * dim + c];
    }
}

// dtable[ids[r]] += dout[r] (atomics: the order of additions to one row is not fixed).
extern "C" __global__ void embedding_backward_f32(const float* dout, const u32* ids, float* dtable, i64 n_ids, int dim) {
    i64 total = n_ids * dim;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        i64 r = i / dim;
        int c = (int)(i - r * dim);
        atomicAdd(&dtable[(i64)ids[r] * dim + c], dout[i]);
    }
}

// ---- fused AdamW (decoupled weight decay, bias-corrected) ----
// bc1 = 1 − β1^t, bc2 = 1 − β2^t are computed on the host.
extern "C" __global__ void adamw_f32(float* p, const float* g, float* m, float* v, i64 n, float lr, float beta1, float beta2, float eps, float weight_decay, float bc1, float bc2) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float gi = g[i];
        float mi = beta1 * m[i] + (1.0f - beta1) * gi;
        float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float mhat = mi / bc1, vhat = vi / bc2;
        float pi = p[i] * (1.0f - lr * weight_decay);
        p[i] = pi - lr * mhat / (sqrtf(vhat) + eps);
    }
}
