// rtx-kernels CUDA module `attention_bf16`: flash attention forward and backward on bf16 tensor
// cores (mma.sync m16n8k16, f32 accumulation), head dims 64 and 128, causal or not. Q, K, V, O
// are contiguous [heads, T, D] bf16; the log-sum-exp is f32 [heads, T]; gradients are f32.
// Compiled separately from the f32 module so each compiles only when first used.

typedef long long i64;

// NVRTC compiles without the toolkit headers, so math.h constants are spelled out.
#define INFINITY __int_as_float(0x7f800000)

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

__device__ __forceinline__ float warp_sum_a(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// ---- bf16 tensor-core forward (mma.sync m16n8k16, f32 accumulation) ----
// A block of 4 warps takes 64 query rows (16 per warp) against tiles of 64 keys staged in shared
// memory. Scores live in registers in the mma accumulator layout (thread = lane: group g =
// lane/4 owns rows g and g+8, t = lane%4 owns columns 2t, 2t+1 of each 8-wide tile); the
// probabilities are re-packed in registers as the A operand of P·V, as in FlashAttention-2.
// Inputs and output are bf16 (raw 16-bit words), the log-sum-exp is f32.

typedef unsigned short bf16raw;
typedef unsigned int u32a;

#define BF_WARPS 4
#define BF_ROWS (BF_WARPS * 16)
#define BF_KEYS 64

struct __align__(16) U4 { u32a x, y, z, w; };
struct __align__(8) F2 { float x, y; };

// Two f32 rounded to nearest-even bf16 in one instruction (sm_80+): `lo` in the low half.
__device__ __forceinline__ u32a pack_bf16x2(float lo, float hi) {
    u32a r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ void mma_bf16(float* c, const u32a* a, u32a b0, u32a b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}


// B fragments of two adjacent 8-wide column tiles for one 16-row k-step, read transposed from a
// row-major shared-memory matrix of pitch P with one ldmatrix: rows r0..r0+16 (the k index),
// columns c0..c0+16 (the n index). b[0], b[1] serve columns c0..c0+8 and b[2], b[3] the next 8.
template <int P>
__device__ __forceinline__ void ldsm_b_trans(u32a* b, const bf16raw* base, int r0, int c0) {
    const int lane = threadIdx.x & 31;
    const int mat = lane >> 3, r = lane & 7;
    const bf16raw* p = base + (r0 + (mat & 1) * 8 + r) * P + c0 + (mat >> 1) * 8;
    u32a saddr;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(saddr) : "l"(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n" : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(saddr));
}


__device__ __forceinline__ u32a smem_u32(const void* p) {
    u32a a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// Queues rows r0..r0+BF_KEYS of a [rows, D] bf16 matrix into smem (pitch D+8) with cp.async;
// rows past the end are zeroed with plain stores. Visible after cp_async_wait + __syncthreads.
template <int D>
__device__ __forceinline__ void stage_async(bf16raw* dst, const bf16raw* src, int r0, int rows) {
    constexpr int P = D + 8;
    constexpr int CHUNKS = D / 8;
    for (int e = threadIdx.x; e < BF_KEYS * CHUNKS; e += blockDim.x) {
        int r = e / CHUNKS, c = (e - r * CHUNKS) * 8;
        bf16raw* d = dst + r * P + c;
        if (r0 + r < rows) {
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(d)), "l"(src + (i64)(r0 + r) * D + c));
        } else {
            *(U4*)d = U4{0u, 0u, 0u, 0u};
        }
    }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most one committed group is still in flight.
__device__ __forceinline__ void cp_async_wait_all_but_one() { asm volatile("cp.async.wait_group 1;\n" ::); }

template <int D>
__device__ void flash_forward_bf16(const bf16raw* q, const bf16raw* k, const bf16raw* v, bf16raw* o, float* lse, int tq, int tk, int causal, float scale) {
    constexpr int P = D + 8;           // smem row pitch in bf16 (16 bytes of padding)
    constexpr int KS = D / 16;         // k-steps of Q·Kᵀ
    constexpr int NT = BF_KEYS / 8;    // 8-wide key tiles per block of keys
    constexpr int DT = D / 8;          // 8-wide column tiles of the output
    extern __shared__ __align__(16) unsigned char smem_raw[];
    // Two buffers of [K tile][V tile], each [BF_KEYS][P]: the next tile loads while this one
    // is used.
    bf16raw* kv_buf = (bf16raw*)smem_raw;
    const int h = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    // With a causal mask, later query blocks see more keys: start those first so the long
    // blocks do not form the tail of the grid.
    const int qblock = causal ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
    const int row0 = qblock * BF_ROWS + warp * 16;
    const int ra = row0 + g, rb = row0 + g + 8;  // the two rows this thread owns
    const bf16raw* qh = q + (i64)h * tq * D;
    const bf16raw* kh = k + (i64)h * tk * D;
    const bf16raw* vh = v + (i64)h * tk * D;
    const float sl2 = scale * 1.4426950408889634f;  // scores in log2 units

    // Q fragments for all k-steps, straight from global memory.
    u32a qf[KS][4];
#pragma unroll
    for (int s = 0; s < KS; ++s) {
        int c0 = s * 16 + 2 * t;
        qf[s][0] = ra < tq ? *(const u32a*)(qh + (i64)ra * D + c0) : 0u;
        qf[s][1] = rb < tq ? *(const u32a*)(qh + (i64)rb * D + c0) : 0u;
        qf[s][2] = ra < tq ? *(const u32a*)(qh + (i64)ra * D + c0 + 8) : 0u;
        qf[s][3] = rb < tq ? *(const u32a*)(qh + (i64)rb * D + c0 + 8) : 0u;
    }
    float acc[DT][4];
#pragma unroll
    for (int i = 0; i < DT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    float ma = -INFINITY, mb = -INFINITY, la = 0.0f, lb = 0.0f;

    const int block_last = imin(qblock * BF_ROWS + BF_ROWS, tq);
    const int kmax = causal ? imin(tk, block_last) : tk;
    if (kmax > 0) {
        stage_async<D>(kv_buf, kh, 0, tk);
        stage_async<D>(kv_buf + BF_KEYS * P, vh, 0, tk);
    }
    cp_async_commit();
    for (int j0 = 0; j0 < kmax; j0 += BF_KEYS) {
        // Everyone is done with the buffer the next tile is about to overwrite.
        __syncthreads();
        const int buf = (j0 / BF_KEYS) & 1;
        if (j0 + BF_KEYS < kmax) {
            bf16raw* next = kv_buf + (buf ^ 1) * 2 * BF_KEYS * P;
            stage_async<D>(next, kh, j0 + BF_KEYS, tk);
            stage_async<D>(next + BF_KEYS * P, vh, j0 + BF_KEYS, tk);
        }
        cp_async_commit();
        cp_async_wait_all_but_one();
        __syncthreads();
        const bf16raw* ks = kv_buf + buf * 2 * BF_KEYS * P;
        const bf16raw* vs = ks + BF_KEYS * P;
        if (row0 >= tq) continue;
        // S = Q·Kᵀ for this warp's 16 rows and 64 keys.
        float sc[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
            const bf16raw* krow = ks + (n * 8 + g) * P + 2 * t;
#pragma unroll
            for (int s = 0; s < KS; ++s) {
                u32a b0 = *(const u32a*)(krow + s * 16);
                u32a b1 = *(const u32a*)(krow + s * 16 + 8);
                mma_bf16(sc[n], qf[s], b0, b1);
            }
        }
        // The running max per row, in raw score units (the scale is positive, so the order is
        // the same); only tiles that cross the causal diagonal or the end of the keys are masked.
        float tma = -INFINITY, tmb = -INFINITY;
        const bool need_mask = j0 + BF_KEYS > tk || (causal && j0 + BF_KEYS - 1 > row0);
        if (need_mask) {
#pragma unroll
            for (int n = 0; n < NT; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    int j = j0 + n * 8 + 2 * t + (e & 1);
                    int i = e < 2 ? ra : rb;
                    bool ok = j < tk && (!causal || j <= i);
                    float s = ok ? sc[n][e] : -INFINITY;
                    sc[n][e] = s;
                    if (e < 2) tma = fmaxf(tma, s); else tmb = fmaxf(tmb, s);
                }
            }
        } else {
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                tma = fmaxf(tma, fmaxf(sc[n][0], sc[n][1]));
                tmb = fmaxf(tmb, fmaxf(sc[n][2], sc[n][3]));
            }
        }
        tma = fmaxf(tma, __shfl_xor_sync(0xffffffffu, tma, 1));
        tma = fmaxf(tma, __shfl_xor_sync(0xffffffffu, tma, 2));
        tmb = fmaxf(tmb, __shfl_xor_sync(0xffffffffu, tmb, 1));
        tmb = fmaxf(tmb, __shfl_xor_sync(0xffffffffu, tmb, 2));
        float na = fmaxf(ma, tma), nb = fmaxf(mb, tmb);
        // The new max in log2 units (scaled), and the factor that rescales what came before.
        float ua = na == -INFINITY ? 0.0f : na * sl2, ub = nb == -INFINITY ? 0.0f : nb * sl2;
        float ca = exp2f(ma * sl2 - ua), cb = exp2f(mb * sl2 - ub);
        ma = na;
        mb = nb;
        la *= ca;
        lb *= cb;
#pragma unroll
        for (int i = 0; i < DT; ++i) {
            acc[i][0] *= ca;
            acc[i][1] *= ca;
            acc[i][2] *= cb;
            acc[i][3] *= cb;
        }
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            sc[n][0] = exp2f(fmaf(sc[n][0], sl2, -ua));
            sc[n][1] = exp2f(fmaf(sc[n][1], sl2, -ua));
            sc[n][2] = exp2f(fmaf(sc[n][2], sl2, -ub));
            sc[n][3] = exp2f(fmaf(sc[n][3], sl2, -ub));
            la += sc[n][0] + sc[n][1];
            lb += sc[n][2] + sc[n][3];
        }
        // O += P·V, 16 keys per step.
#pragma unroll
        for (int kk = 0; kk < BF_KEYS / 16; ++kk) {
            u32a pa[4];
            pa[0] = pack_bf16x2(sc[2 * kk][0], sc[2 * kk][1]);
            pa[1] = pack_bf16x2(sc[2 * kk][2], sc[2 * kk][3]);
            pa[2] = pack_bf16x2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
            pa[3] = pack_bf16x2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
#pragma unroll
            for (int i = 0; i < DT; i += 2) {
                u32a b[4];
                ldsm_b_trans<P>(b, vs, kk * 16, i * 8);
                mma_bf16(acc[i], pa, b[0], b[1]);
                mma_bf16(acc[i + 1], pa, b[2], b[3]);
            }
        }
    }
    if (row0 >= tq) return;
    la += __shfl_xor_sync(0xffffffffu, la, 1);
    la += __shfl_xor_sync(0xffffffffu, la, 2);
    lb += __shfl_xor_sync(0xffffffffu, lb, 1);
    lb += __shfl_xor_sync(0xffffffffu, lb, 2);
    float ia = la > 0.0f ? 1.0f / la : 0.0f, ib = lb > 0.0f ? 1.0f / lb : 0.0f;
    bf16raw* oh = o + (i64)h * tq * D;
#pragma unroll
    for (int i = 0; i < DT; ++i) {
        int c = i * 8 + 2 * t;
        if (ra < tq) *(u32a*)(oh + (i64)ra * D + c) = pack_bf16x2(acc[i][0] * ia, acc[i][1] * ia);
        if (rb < tq) *(u32a*)(oh + (i64)rb * D + c) = pack_bf16x2(acc[i][2] * ib, acc[i][3] * ib);
    }
    if (t == 0) {
        const float ln2 = 0.6931471805599453f;
        if (ra < tq) lse[(i64)h * tq + ra] = la > 0.0f ? (ma * sl2 + log2f(la)) * ln2 : INFINITY;
        if (rb < tq) lse[(i64)h * tq + rb] = lb > 0.0f ? (mb * sl2 + log2f(lb)) * ln2 : INFINITY;
    }
}

// At most 128 registers, so four 4-warp blocks fit on an SM (133 registers left room for three).
extern "C" __global__ void __launch_bounds__(BF_WARPS * 32, 4) flash_forward_bf16_d64(const bf16raw* q, const bf16raw* k, const bf16raw* v, bf16raw* o, float* lse, int tq, int tk, int causal, float scale) {
    flash_forward_bf16<64>(q, k, v, o, lse, tq, tk, causal, scale);
}

extern "C" __global__ void __launch_bounds__(BF_WARPS * 32) flash_forward_bf16_d128(const bf16raw* q, const bf16raw* k, const bf16raw* v, bf16raw* o, float* lse, int tq, int tk, int causal, float scale) {
    flash_forward_bf16<128>(q, k, v, o, lse, tq, tk, causal, scale);
}

// ---- bf16 tensor-core backward ----
// Two kernels, no atomics: dQ with one warp per 16 query rows (S, dP and dS recomputed per key
// tile in registers, dQ += dS·K), and dK, dV with one warp per 16 key rows (Sᵀ = K·Qᵀ,
// dPᵀ = V·dOᵀ, dV += Pᵀ·dO, dK += dSᵀ·Q). Recomputing S and dP in both costs two extra
// products over FlashAttention-2's atomic dQ, and makes the result deterministic. Gradients are
// written in f32.

#define LOG2E_F 1.4426950408889634f

// delta[i] = Σ_c dO[i][c] · O[i][c] over bf16 rows, one warp per row.
extern "C" __global__ void flash_backward_delta_bf16(const bf16raw* o, const bf16raw* dout, float* delta, i64 rows, int d) {
    i64 row = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    float s = 0.0f;
    for (int c = lane; c < d; c += 32) s += __uint_as_float(((u32a)o[row * d + c]) << 16) * __uint_as_float(((u32a)dout[row * d + c]) << 16);
    s = warp_sum_a(s);
    if (lane == 0) delta[row] = s;
}

// Stages rows r0..r0+BF_KEYS of a [rows, D] bf16 matrix into smem (pitch P); zero past the end.
template <int D>
__device__ __forceinline__ void stage_bf16(bf16raw* dst, const bf16raw* src, int r0, int rows) {
    constexpr int P = D + 8;
    constexpr int CHUNKS = D / 8;
    for (int e = threadIdx.x; e < BF_KEYS * CHUNKS; e += blockDim.x) {
        int r = e / CHUNKS, c = (e - r * CHUNKS) * 8;
        U4 z = {0u, 0u, 0u, 0u};
        if (r0 + r < rows) z = *(const U4*)(src + (i64)(r0 + r) * D + c);
        *(U4*)(dst + r * P + c) = z;
    }
}

template <int D>
__device__ void flash_backward_dq_bf16(const bf16raw* q, const bf16raw* k, const bf16raw* v, const bf16raw* dout, const float* lse, const float* delta, float* dq, int tq, int tk, int causal, float scale) {
    constexpr int P = D + 8;
    constexpr int KS = D / 16;
    constexpr int NT = BF_KEYS / 8;
    constexpr int DT = D / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16raw* kv_buf = (bf16raw*)smem_raw;  // two buffers of [K tile][V tile], as in the forward
    const int h = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    // With a causal mask, later query blocks see more keys: start those first so the long
    // blocks do not form the tail of the grid.
    const int qblock = causal ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
    const int row0 = qblock * BF_ROWS + warp * 16;
    const int ra = row0 + g, rb = row0 + g + 8;
    const bf16raw* qh = q + (i64)h * tq * D;
    const bf16raw* gh = dout + (i64)h * tq * D;
    const float sl2 = scale * LOG2E_F;
    u32a qf[KS][4], gf[KS][4];
#pragma unroll
    for (int s = 0; s < KS; ++s) {
        int c0 = s * 16 + 2 * t;
        qf[s][0] = ra < tq ? *(const u32a*)(qh + (i64)ra * D + c0) : 0u;
        qf[s][1] = rb < tq ? *(const u32a*)(qh + (i64)rb * D + c0) : 0u;
        qf[s][2] = ra < tq ? *(const u32a*)(qh + (i64)ra * D + c0 + 8) : 0u;
        qf[s][3] = rb < tq ? *(const u32a*)(qh + (i64)rb * D + c0 + 8) : 0u;
        gf[s][0] = ra < tq ? *(const u32a*)(gh + (i64)ra * D + c0) : 0u;
        gf[s][1] = rb < tq ? *(const u32a*)(gh + (i64)rb * D + c0) : 0u;
        gf[s][2] = ra < tq ? *(const u32a*)(gh + (i64)ra * D + c0 + 8) : 0u;
        gf[s][3] = rb < tq ? *(const u32a*)(gh + (i64)rb * D + c0 + 8) : 0u;
    }
    const float l2a = ra < tq ? lse[(i64)h * tq + ra] * LOG2E_F : INFINITY;
    const float l2b = rb < tq ? lse[(i64)h * tq + rb] * LOG2E_F : INFINITY;
    const float dla = ra < tq ? delta[(i64)h * tq + ra] : 0.0f;
    const float dlb = rb < tq ? delta[(i64)h * tq + rb] : 0.0f;
    float acc[DT][4];
#pragma unroll
    for (int i = 0; i < DT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    const int block_last = imin(qblock * BF_ROWS + BF_ROWS, tq);
    const int kmax = causal ? imin(tk, block_last) : tk;
    const bf16raw* kh = k + (i64)h * tk * D;
    const bf16raw* vh = v + (i64)h * tk * D;
    if (kmax > 0) {
        stage_async<D>(kv_buf, kh, 0, tk);
        stage_async<D>(kv_buf + BF_KEYS * P, vh, 0, tk);
    }
    cp_async_commit();
    for (int j0 = 0; j0 < kmax; j0 += BF_KEYS) {
        __syncthreads();
        const int buf = (j0 / BF_KEYS) & 1;
        if (j0 + BF_KEYS < kmax) {
            bf16raw* next = kv_buf + (buf ^ 1) * 2 * BF_KEYS * P;
            stage_async<D>(next, kh, j0 + BF_KEYS, tk);
            stage_async<D>(next + BF_KEYS * P, vh, j0 + BF_KEYS, tk);
        }
        cp_async_commit();
        cp_async_wait_all_but_one();
        __syncthreads();
        const bf16raw* ks = kv_buf + buf * 2 * BF_KEYS * P;
        const bf16raw* vs = ks + BF_KEYS * P;
        if (row0 >= tq) continue;
        float sc[NT][4], dp[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
            dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.0f;
            const bf16raw* krow = ks + (n * 8 + g) * P + 2 * t;
            const bf16raw* vrow = vs + (n * 8 + g) * P + 2 * t;
#pragma unroll
            for (int s = 0; s < KS; ++s) {
                mma_bf16(sc[n], qf[s], *(const u32a*)(krow + s * 16), *(const u32a*)(krow + s * 16 + 8));
                mma_bf16(dp[n], gf[s], *(const u32a*)(vrow + s * 16), *(const u32a*)(vrow + s * 16 + 8));
            }
        }
        // Only tiles crossing the causal diagonal or the end of the keys need the mask.
        const bool need_mask = j0 + BF_KEYS > tk || (causal && j0 + BF_KEYS - 1 > row0);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int j = j0 + n * 8 + 2 * t + (e & 1);
                int i = e < 2 ? ra : rb;
                bool ok = !need_mask || (j < tk && (!causal || j <= i));
                float p = ok ? exp2f(fmaf(sc[n][e], sl2, -(e < 2 ? l2a : l2b))) : 0.0f;
                sc[n][e] = p * (dp[n][e] - (e < 2 ? dla : dlb));
            }
        }
#pragma unroll
        for (int kk = 0; kk < BF_KEYS / 16; ++kk) {
            u32a da[4];
            da[0] = pack_bf16x2(sc[2 * kk][0], sc[2 * kk][1]);
            da[1] = pack_bf16x2(sc[2 * kk][2], sc[2 * kk][3]);
            da[2] = pack_bf16x2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
            da[3] = pack_bf16x2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
#pragma unroll
            for (int i = 0; i < DT; i += 2) {
                u32a b[4];
                ldsm_b_trans<P>(b, ks, kk * 16, i * 8);
                mma_bf16(acc[i], da, b[0], b[1]);
                mma_bf16(acc[i + 1], da, b[2], b[3]);
            }
        }
    }
    if (row0 >= tq) return;
    float* dqh = dq + (i64)h * tq * D;
#pragma unroll
    for (int i = 0; i < DT; ++i) {
        int c = i * 8 + 2 * t;
        if (ra < tq) *(F2*)(dqh + (i64)ra * D + c) = F2{acc[i][0] * scale, acc[i][1] * scale};
        if (rb < tq) *(F2*)(dqh + (i64)rb * D + c) = F2{acc[i][2] * scale, acc[i][3] * scale};
    }
}

template <int D>
__device__ void flash_backward_dkv_bf16(const bf16raw* q, const bf16raw* k, const bf16raw* v, const bf16raw* dout, const float* lse, const float* delta, float* dk, float* dv, int tq, int tk, int causal, float scale) {
    constexpr int P = D + 8;
    constexpr int KS = D / 16;
    constexpr int NT = BF_KEYS / 8;  // 8-wide query tiles per block of queries
    constexpr int DT = D / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16raw* kb = (bf16raw*)smem_raw;  // [64][P] this block's key rows
    bf16raw* vb = kb + BF_KEYS * P;    // [64][P] this block's value rows
    bf16raw* qg_buf = vb + BF_KEYS * P;  // two buffers of [Q tile][dO tile], each [64][P]
    float* stat_buf = (float*)(qg_buf + 4 * BF_KEYS * P);  // two buffers of [lse·log2e][delta], [64] each
    const int h = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int key0 = blockIdx.x * BF_ROWS;
    const int jw = key0 + warp * 16;
    const int ja = jw + g, jb = jw + g + 8;
    const float sl2 = scale * LOG2E_F;
    stage_bf16<D>(kb, k + (i64)h * tk * D, key0, tk);
    stage_bf16<D>(vb, v + (i64)h * tk * D, key0, tk);
    float adk[DT][4], adv[DT][4];
#pragma unroll
    for (int i = 0; i < DT; ++i) {
        adk[i][0] = adk[i][1] = adk[i][2] = adk[i][3] = 0.0f;
        adv[i][0] = adv[i][1] = adv[i][2] = adv[i][3] = 0.0f;
    }
    const bf16raw* qh = q + (i64)h * tq * D;
    const bf16raw* gh = dout + (i64)h * tq * D;
    const int qstart = causal ? (key0 / BF_KEYS) * BF_KEYS : 0;
    const bf16raw* ka = kb + (warp * 16 + g) * P + 2 * t;
    const bf16raw* va = vb + (warp * 16 + g) * P + 2 * t;
    // Queues the Q and dO rows and the row statistics of the tile at i0 into buffer b.
    auto stage_tile = [&](int b, int i0) {
        bf16raw* qd = qg_buf + b * 2 * BF_KEYS * P;
        stage_async<D>(qd, qh, i0, tq);
        stage_async<D>(qd + BF_KEYS * P, gh, i0, tq);
        float* st_b = stat_buf + b * 2 * BF_KEYS;
        if (threadIdx.x < BF_KEYS) {
            int i = i0 + threadIdx.x;
            st_b[threadIdx.x] = i < tq ? lse[(i64)h * tq + i] * LOG2E_F : INFINITY;
            st_b[BF_KEYS + threadIdx.x] = i < tq ? delta[(i64)h * tq + i] : 0.0f;
        }
    };
    if (qstart < tq) stage_tile(0, qstart);
    cp_async_commit();
    for (int i0 = qstart; i0 < tq; i0 += BF_KEYS) {
        __syncthreads();
        const int buf = ((i0 - qstart) / BF_KEYS) & 1;
        if (i0 + BF_KEYS < tq) stage_tile(buf ^ 1, i0 + BF_KEYS);
        cp_async_commit();
        cp_async_wait_all_but_one();
        __syncthreads();
        const bf16raw* qs = qg_buf + buf * 2 * BF_KEYS * P;
        const bf16raw* gs = qs + BF_KEYS * P;
        const float* l2s = stat_buf + buf * 2 * BF_KEYS;
        const float* dls = l2s + BF_KEYS;
        if (jw >= tk) continue;
        float st[NT][4], dpt[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            st[n][0] = st[n][1] = st[n][2] = st[n][3] = 0.0f;
            dpt[n][0] = dpt[n][1] = dpt[n][2] = dpt[n][3] = 0.0f;
        }
#pragma unroll
        for (int s = 0; s < KS; ++s) {
            u32a kf[4], vf[4];
            kf[0] = *(const u32a*)(ka + s * 16);
            kf[1] = *(const u32a*)(ka + 8 * P + s * 16);
            kf[2] = *(const u32a*)(ka + s * 16 + 8);
            kf[3] = *(const u32a*)(ka + 8 * P + s * 16 + 8);
            vf[0] = *(const u32a*)(va + s * 16);
            vf[1] = *(const u32a*)(va + 8 * P + s * 16);
            vf[2] = *(const u32a*)(va + s * 16 + 8);
            vf[3] = *(const u32a*)(va + 8 * P + s * 16 + 8);
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const bf16raw* qrow = qs + (n * 8 + g) * P + 2 * t + s * 16;
                const bf16raw* grow = gs + (n * 8 + g) * P + 2 * t + s * 16;
                mma_bf16(st[n], kf, *(const u32a*)qrow, *(const u32a*)(qrow + 8));
                mma_bf16(dpt[n], vf, *(const u32a*)grow, *(const u32a*)(grow + 8));
            }
        }
        // Only tiles crossing the causal diagonal or the end of the queries or keys need the mask.
        const bool need_mask = i0 + BF_KEYS > tq || jw + 16 > tk || (causal && jw + 15 > i0);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int il = n * 8 + 2 * t + (e & 1);
                int i = i0 + il;
                int j = e < 2 ? ja : jb;
                bool ok = !need_mask || (i < tq && j < tk && (!causal || j <= i));
                float p = ok ? exp2f(fmaf(st[n][e], sl2, -l2s[il])) : 0.0f;
                st[n][e] = p;
                dpt[n][e] = p * (dpt[n][e] - dls[il]);
            }
        }
#pragma unroll
        for (int kk = 0; kk < BF_KEYS / 16; ++kk) {
            u32a pa[4], da[4];
            pa[0] = pack_bf16x2(st[2 * kk][0], st[2 * kk][1]);
            pa[1] = pack_bf16x2(st[2 * kk][2], st[2 * kk][3]);
            pa[2] = pack_bf16x2(st[2 * kk + 1][0], st[2 * kk + 1][1]);
            pa[3] = pack_bf16x2(st[2 * kk + 1][2], st[2 * kk + 1][3]);
            da[0] = pack_bf16x2(dpt[2 * kk][0], dpt[2 * kk][1]);
            da[1] = pack_bf16x2(dpt[2 * kk][2], dpt[2 * kk][3]);
            da[2] = pack_bf16x2(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]);
            da[3] = pack_bf16x2(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3]);
#pragma unroll
            for (int i = 0; i < DT; i += 2) {
                u32a b[4];
                ldsm_b_trans<P>(b, gs, kk * 16, i * 8);
                mma_bf16(adv[i], pa, b[0], b[1]);
                mma_bf16(adv[i + 1], pa, b[2], b[3]);
                ldsm_b_trans<P>(b, qs, kk * 16, i * 8);
                mma_bf16(adk[i], da, b[0], b[1]);
                mma_bf16(adk[i + 1], da, b[2], b[3]);
            }
        }
    }
    float* dkh = dk + (i64)h * tk * D;
    float* dvh = dv + (i64)h * tk * D;
#pragma unroll
    for (int i = 0; i < DT; ++i) {
        int c = i * 8 + 2 * t;
        if (ja < tk) {
            *(F2*)(dkh + (i64)ja * D + c) = F2{adk[i][0] * scale, adk[i][1] * scale};
            *(F2*)(dvh + (i64)ja * D + c) = F2{adv[i][0], adv[i][1]};
        }
        if (jb < tk) {
            *(F2*)(dkh + (i64)jb * D + c) = F2{adk[i][2] * scale, adk[i][3] * scale};
            *(F2*)(dvh + (i64)jb * D + c) = F2{adv[i][2], adv[i][3]};
        }
    }
}

// Register bounds (d64): 164 registers let three dQ blocks share an SM and 178 only two dK/dV
// blocks; the bounds ask for four and three (ncu: both kernels were latency-bound at 12-19%
// occupancy).
#define FLASH_BF16_BWD(D, DQ_BLOCKS, DKV_BLOCKS)                                                                                   \
    extern "C" __global__ void __launch_bounds__(BF_WARPS * 32, DQ_BLOCKS)                                                          \
        flash_backward_dq_bf16_d##D(const bf16raw* q, const bf16raw* k, const bf16raw* v, const bf16raw* dout, const float* lse,  \
                                    const float* delta, float* dq, int tq, int tk, int causal, float scale) {                      \
        flash_backward_dq_bf16<D>(q, k, v, dout, lse, delta, dq, tq, tk, causal, scale);                                          \
    }                                                                                                                               \
    extern "C" __global__ void __launch_bounds__(BF_WARPS * 32, DKV_BLOCKS)                                                         \
        flash_backward_dkv_bf16_d##D(const bf16raw* q, const bf16raw* k, const bf16raw* v, const bf16raw* dout, const float* lse, \
                                     const float* delta, float* dk, float* dv, int tq, int tk, int causal, float scale) {          \
        flash_backward_dkv_bf16<D>(q, k, v, dout, lse, delta, dk, dv, tq, tk, causal, scale);                                     \
    }

FLASH_BF16_BWD(64, 4, 3)
FLASH_BF16_BWD(128, 1, 1)
