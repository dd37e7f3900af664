// rtx-kernels CUDA common prelude: the types, constants and device helpers the `core` and `mixed`
// modules share (nvrtc.rs puts this text in front of each; NVRTC compiles without the toolkit
// headers, so there is no #include). bf16 is handled as raw 16-bit words.

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

// NVRTC compiles without the toolkit headers, so math.h constants are spelled out.
#define INFINITY __int_as_float(0x7f800000)

__device__ __forceinline__ float bf16_to_f32(u16 x) { return __uint_as_float(((u32)x) << 16); }

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);  // NaN stays NaN
    u32 rounding = 0x7fffu + ((u >> 16) & 1u);                             // round to nearest even
    return (u16)((u + rounding) >> 16);
}

// Storage read into f32 (`ldf`) and f32 rounded to storage (`stf`): float, or bf16 as raw words.
__device__ __forceinline__ float ldf(const float* p, i64 i) { return p[i]; }
__device__ __forceinline__ float ldf(const u16* p, i64 i) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ void stf(float* p, i64 i, float v) { p[i] = v; }
__device__ __forceinline__ void stf(u16* p, i64 i, float v) { p[i] = f32_to_bf16(v); }

#define GRID_STRIDE(i, n) for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float gelu_tanh(float x) {
    const float k = 0.7978845608028654f;  // sqrt(2/pi)
    float u = k * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.0f + tanhf(u));
}

// Exact GELU x·Φ(x) (PyTorch's default, approximate="none") and its derivative Φ(x) + x·φ(x).
__device__ __forceinline__ float gelu_erf(float x) {
    return 0.5f * x * (1.0f + erff(x * 0.7071067811865476f));
}

__device__ __forceinline__ float gelu_erf_grad(float x) {
    const float inv_sqrt_2pi = 0.3989422804014327f;
    return 0.5f * (1.0f + erff(x * 0.7071067811865476f)) + x * inv_sqrt_2pi * expf(-0.5f * x * x);
}

__device__ __forceinline__ float gelu_tanh_grad(float x) {
    const float k = 0.7978845608028654f;
    float x2 = x * x;
    float u = k * (x + 0.044715f * x2 * x);
    float t = tanhf(u);
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * k * (1.0f + 3.0f * 0.044715f * x2);
}

// `exact` picks the erf form, otherwise the tanh approximation.
__device__ __forceinline__ float gelu_any(float x, int exact) { return exact ? gelu_erf(x) : gelu_tanh(x); }
__device__ __forceinline__ float gelu_any_grad(float x, int exact) { return exact ? gelu_erf_grad(x) : gelu_tanh_grad(x); }

// ---- block reductions (blockDim.x is a multiple of 32, at most 1024) ----

// Every thread gets the result. `scratch` holds 32 floats; the call ends with a barrier so
// scratch can be reused right away.
__device__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < n_warps ? scratch[lane] : 0.0f;
    t = warp_sum(t);
    __syncthreads();
    return t;
}

__device__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < n_warps ? scratch[lane] : -INFINITY;
    t = warp_max(t);
    __syncthreads();
    return t;
}
