// rtx-kernels CUDA module `attention_bf16`: flash attention forward and backward on bf16 tensor
// cores (mma.sync m16n8k16, f32 accumulation), head dims 64 and 128, causal or not. Q, K, V, O,
// dO and the gradients are bf16 rows addressed through a `HeadRows` layout each (contiguous
// [heads, T, D], or the heads of a [batch, T, row] matrix such as packed QKV, read and written
// in place); the log-sum-exp and the backward's row statistics are f32 [heads, T].
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
// A block of W warps (4 or 8; see flash_forward_bf16) takes 16·W query rows (16 per warp) against
// tiles of 64 keys staged in shared memory. Scores live in registers in the mma accumulator layout (thread = lane: group g =
// lane/4 owns rows g and g+8, t = lane%4 owns columns 2t, 2t+1 of each 8-wide tile); the
// probabilities are re-packed in registers as the A operand of P·V, as in FlashAttention-2.
// Inputs and output are bf16 (raw 16-bit words), the log-sum-exp is f32.

typedef unsigned short bf16raw;
typedef unsigned int u32a;

#define BF_WARPS 4
#define BF_KEYS 64

struct __align__(16) U4 { u32a x, y, z, w; };
struct __align__(8) F2 { float x, y; };

// Where one operand's rows live: row t of head h (= batch·hpb + head-in-batch) starts at element
// off + (h / hpb)·batch + (h % hpb)·head + t·row. Mirrors `HeadRows` in attention.rs.
struct HeadRows {
    i64 off, row, batch, head;
    int hpb, pad;
};

__device__ __forceinline__ i64 head_base(const HeadRows& l, int h) { return l.off + (i64)(h / l.hpb) * l.batch + (i64)(h % l.hpb) * l.head; }

// Every argument of the forward, delta and backward kernels. Mirrors `AttnArgs` in attention.rs.
struct AttnArgs {
    const bf16raw *q, *k, *v;
    bf16raw* o;  // written by the forward, read by the backward
    const bf16raw* dout;
    bf16raw *dq, *dk, *dv;
    float* lse;
    float* delta;      // [heads, tq]
    float* dq_acc;     // [heads, tq, D] f32: dQ partial sums between key blocks
    u32a* counters;    // [heads, query blocks]: key blocks that have added into dq_acc
    HeadRows lq, lk, lv, lo, lg, ldq, ldk, ldv;
    int tq, tk, causal, rotate;
    float scale;
    int probe;  // timing probes only (wrong results): 1 = no dQ ordering, 2 = no dQ at all,
                // 4 = dQ products but no adding, 8 = adding but no dQ products
};

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


__device__ __forceinline__ u32a smem_u32(const void* p) {
    u32a a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 2^x on the MUFU unit (ex2.approx.ftz: ~2 ulp, 2^-inf = 0), without exp2f's denormal fix-up.
__device__ __forceinline__ float ex2f(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// ldmatrix.x4.trans at a shared-memory address; the x4 row addresses come from the lanes.
__device__ __forceinline__ void ldsm_x4_trans(u32a* b, u32a addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n" : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(addr));
}

// This lane's row offset (elements) for reading, with one ldmatrix.x4.trans, the B fragments of
// two adjacent 8-wide column tiles for one 16-row k-step from a row-major shared-memory matrix
// of pitch P: rows r0..r0+16 (the k index), columns c0..c0+16 (the n index) are at
// base + 2·(ldsm_b_lane + r0·P + c0) bytes; b[0], b[1] serve columns c0..c0+8, b[2], b[3] the
// next 8.
template <int P>
__device__ __forceinline__ int ldsm_b_lane() {
    const int lane = threadIdx.x & 31, mat = lane >> 3, r = lane & 7;
    return ((mat & 1) * 8 + r) * P + (mat >> 1) * 8;
}

// ldmatrix.x4 (no transpose) at a shared-memory address.
__device__ __forceinline__ void ldsm_x4(u32a* b, u32a addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n" : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(addr));
}

// This lane's row offset (elements) for reading, with one ldmatrix.x4, the B fragments of two
// adjacent 8-wide column tiles for one 16-wide k-step from a shared-memory matrix whose rows
// are the n index (pitch P): rows n0..n0+16, columns k0..k0+16 are at
// base + 2·(ldsm_n_lane + n0·P + k0) bytes; b[0], b[1] serve rows n0..n0+8, b[2], b[3] the next 8.
template <int P>
__device__ __forceinline__ int ldsm_n_lane() {
    const int lane = threadIdx.x & 31, mat = lane >> 3, r = lane & 7;
    return ((mat >> 1) * 8 + r) * P + (mat & 1) * 8;
}

// The same for the A fragments (m16 × k16) of A = Mᵀ for a row-major shared-memory matrix M of
// pitch P: rows k0..k0+16 of M (the k index), columns m0..m0+16 (the m index).
template <int P>
__device__ __forceinline__ int ldsm_a_lane() {
    const int lane = threadIdx.x & 31, mat = lane >> 3, r = lane & 7;
    return ((mat >> 1) * 8 + r) * P + (mat & 1) * 8;
}

// Queues rows r0..r0+ROWS of a [rows, D] bf16 matrix (row pitch `ld` elements) into smem
// (pitch D+8) with cp.async, from a block of THREADS threads; rows past the end are zeroed with
// plain stores. Visible after cp_async_wait + __syncthreads.
template <int D, int ROWS = BF_KEYS, int THREADS = BF_WARPS * 32>
__device__ __forceinline__ void stage_async(bf16raw* dst, const bf16raw* src, int r0, int rows, i64 ld) {
    constexpr int P = D + 8;
    constexpr int CHUNKS = D / 8;
#pragma unroll
    for (int e = threadIdx.x; e < ROWS * CHUNKS; e += THREADS) {
        int r = e / CHUNKS, c = (e - r * CHUNKS) * 8;
        bf16raw* d = dst + r * P + c;
        if (r0 + r < rows) {
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(d)), "l"(src + (i64)(r0 + r) * ld + c));
        } else {
            *(U4*)d = U4{0u, 0u, 0u, 0u};
        }
    }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most one committed group is still in flight.
__device__ __forceinline__ void cp_async_wait_all_but_one() { asm volatile("cp.async.wait_group 1;\n" ::); }

// W warps take 16·W query rows (16 each); every warp walks the same staged K/V tiles, so 8
// warps stage each tile once for 128 rows instead of 64.
template <int D, int W>
__device__ void flash_forward_bf16(const AttnArgs& a) {
    const int tq = a.tq, tk = a.tk, causal = a.causal;
    const float scale = a.scale;
    constexpr int P = D + 8;           // smem row pitch in bf16 (16 bytes of padding)
    constexpr int KS = D / 16;         // k-steps of Q·Kᵀ
    constexpr int NT = BF_KEYS / 8;    // 8-wide key tiles per block of keys
    constexpr int DT = D / 8;          // 8-wide column tiles of the output
    constexpr int ROWS = 16 * W;       // query rows per block
    constexpr int THREADS = 32 * W;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    // Two buffers of [K tile][V tile], each [BF_KEYS][P]: the next tile loads while this one
    // is used.
    bf16raw* kv_buf = (bf16raw*)smem_raw;
    const int h = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    // With a causal mask, later query blocks see more keys: start those first so the long
    // blocks do not form the tail of the grid.
    const int qblock = causal ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
    const int row0 = qblock * ROWS + warp * 16;
    const int ra = row0 + g, rb = row0 + g + 8;  // the two rows this thread owns
    const bf16raw* qh = a.q + head_base(a.lq, h);
    const bf16raw* kh = a.k + head_base(a.lk, h);
    const bf16raw* vh = a.v + head_base(a.lv, h);
    const i64 rq = a.lq.row, rk = a.lk.row, rv = a.lv.row;
    const float sl2 = scale * 1.4426950408889634f;  // scores in log2 units

    // Q fragments for all k-steps, straight from global memory.
    u32a qf[KS][4];
#pragma unroll
    for (int s = 0; s < KS; ++s) {
        int c0 = s * 16 + 2 * t;
        qf[s][0] = ra < tq ? *(const u32a*)(qh + (i64)ra * rq + c0) : 0u;
        qf[s][1] = rb < tq ? *(const u32a*)(qh + (i64)rb * rq + c0) : 0u;
        qf[s][2] = ra < tq ? *(const u32a*)(qh + (i64)ra * rq + c0 + 8) : 0u;
        qf[s][3] = rb < tq ? *(const u32a*)(qh + (i64)rb * rq + c0 + 8) : 0u;
    }
    float acc[DT][4];
#pragma unroll
    for (int i = 0; i < DT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    float ma = -INFINITY, mb = -INFINITY, la = 0.0f, lb = 0.0f;

    const int block_last = imin(qblock * ROWS + ROWS, tq);
    const int kmax = causal ? imin(tk, block_last) : tk;
    if (kmax > 0) {
        stage_async<D, BF_KEYS, THREADS>(kv_buf, kh, 0, tk, rk);
        stage_async<D, BF_KEYS, THREADS>(kv_buf + BF_KEYS * P, vh, 0, tk, rv);
    }
    cp_async_commit();
    for (int j0 = 0; j0 < kmax; j0 += BF_KEYS) {
        // Everyone is done with the buffer the next tile is about to overwrite.
        __syncthreads();
        const int buf = (j0 / BF_KEYS) & 1;
        if (j0 + BF_KEYS < kmax) {
            bf16raw* next = kv_buf + (buf ^ 1) * 2 * BF_KEYS * P;
            stage_async<D, BF_KEYS, THREADS>(next, kh, j0 + BF_KEYS, tk, rk);
            stage_async<D, BF_KEYS, THREADS>(next + BF_KEYS * P, vh, j0 + BF_KEYS, tk, rv);
        }
        cp_async_commit();
        cp_async_wait_all_but_one();
        __syncthreads();
        const bf16raw* ks = kv_buf + buf * 2 * BF_KEYS * P;
        const u32a vs_b = smem_u32(ks + BF_KEYS * P) + 2 * ldsm_b_lane<P>();
        // Rows past the end, and (causal, wide blocks) a tile wholly after this warp's rows.
        if (row0 >= tq || (W > 4 && causal && j0 > row0 + 15)) continue;
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
        float ca = ex2f(ma * sl2 - ua), cb = ex2f(mb * sl2 - ub);
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
            sc[n][0] = ex2f(fmaf(sc[n][0], sl2, -ua));
            sc[n][1] = ex2f(fmaf(sc[n][1], sl2, -ua));
            sc[n][2] = ex2f(fmaf(sc[n][2], sl2, -ub));
            sc[n][3] = ex2f(fmaf(sc[n][3], sl2, -ub));
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
                ldsm_x4_trans(b, vs_b + 2 * (kk * 16 * P + i * 8));
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
    bf16raw* oh = a.o + head_base(a.lo, h);
    const i64 ro = a.lo.row;
    float* lse = a.lse;
#pragma unroll
    for (int i = 0; i < DT; ++i) {
        int c = i * 8 + 2 * t;
        if (ra < tq) *(u32a*)(oh + (i64)ra * ro + c) = pack_bf16x2(acc[i][0] * ia, acc[i][1] * ia);
        if (rb < tq) *(u32a*)(oh + (i64)rb * ro + c) = pack_bf16x2(acc[i][2] * ib, acc[i][3] * ib);
    }
    if (t == 0) {
        const float ln2 = 0.6931471805599453f;
        if (ra < tq) lse[(i64)h * tq + ra] = la > 0.0f ? (ma * sl2 + log2f(la)) * ln2 : INFINITY;
        if (rb < tq) lse[(i64)h * tq + rb] = lb > 0.0f ? (mb * sl2 + log2f(lb)) * ln2 : INFINITY;
    }
}

// At most 128 registers, so four 4-warp blocks fit on an SM (133 registers left room for three).
extern "C" __global__ void __launch_bounds__(BF_WARPS * 32, 4) flash_forward_bf16_d64(const AttnArgs a) { flash_forward_bf16<64, 4>(a); }

// 128 query rows (8 warps), at most 128 registers: two blocks per SM.
extern "C" __global__ void __launch_bounds__(256, 2) flash_forward_bf16_r128_d64(const AttnArgs a) { flash_forward_bf16<64, 8>(a); }

extern "C" __global__ void __launch_bounds__(512, 1) flash_forward_bf16_r256_d64(const AttnArgs a) { flash_forward_bf16<64, 16>(a); }

extern "C" __global__ void __launch_bounds__(BF_WARPS * 32) flash_forward_bf16_d128(const AttnArgs a) { flash_forward_bf16<128, 4>(a); }

// ---- bf16 tensor-core backward ----
// One pass per key block (FlashAttention-2): a block of W warps (4, 8 or 16) owns 16·W keys (16
// per warp) and walks the 64-row query blocks that see them. Per (key block, query block) tile it
// forms Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ once, in registers, then P and dS = P ⊙ (dP − delta),
// accumulates dV += Pᵀ·dO and dK += dSᵀ·Q in registers, writes dSᵀ (bf16) to shared memory and
// forms the block's dQ contribution dS·K (split over the warps by query rows and head-dim
// columns). Five products per tile instead of the seven of separate dQ and dK/dV passes.
//
// dQ sums over key blocks in a fixed order, so results are bit-identical run to run (no
// unordered float atomics): per (head, query block) a counter in global memory counts the key
// blocks that have added their part into an f32 scratch. A block's warps wait (lane 0 spins on
// an acquire load) until the counter reaches the block's rank, add their part, and after the
// next barrier thread 0 releases the counter: the first in the order stores, the ones between
// add at L2 (red, each only after the one before has released), the last reads the sum
// (bypassing L1) and writes dQ as bf16 into its layout. Orders:
// - causal: key block j walks query blocks j, j+1, ...; block i takes key blocks i, i-1, ..., 0,
//   the order they reach it in. The grid runs key blocks in descending order, so the block a
//   block waits for was dispatched before it and waiting cannot deadlock.
// - non-causal with as many query as key blocks (`rotate`): key block j walks i = j, j+1, ...
//   wrapping, and block i takes key blocks in the order they reach it (rank = step). A block may
//   wait on one dispatched after it, so one head's key blocks must fit on the GPU at once (the
//   launcher only rotates when they are at most the SM count).
// - otherwise: every key block walks i = 0, 1, ...; block i takes key blocks in descending order.

#define LOG2E_F 1.4426950408889634f

__device__ __forceinline__ u32a ld_acquire_u32(const u32a* p) {
    u32a v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_u32(u32a* p, u32a v) { asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory"); }

// Two f32 from L2 (not L1, which other SMs' stores do not update).
__device__ __forceinline__ F2 ld_cg_f2(const float* p) {
    F2 v;
    asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_cg_f2(float* p, F2 v) { asm volatile("st.global.cg.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(v.x), "f"(v.y) : "memory"); }

// p[0] += v.x, p[1] += v.y at L2, without waiting for the result (one vector red, sm_90).
__device__ __forceinline__ void red_add_f2(float* p, F2 v) {
    asm volatile("red.relaxed.gpu.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(v.x), "f"(v.y) : "memory");
}

// delta[h, t] = Σ_c dO ⊙ O over the row, one warp per row. Also zeroes the first `counters` dQ
// counters, and with no keys at all writes dQ = 0 (no key block would).
extern "C" __global__ void flash_backward_delta_bf16(const AttnArgs a, i64 rows, int d, int counters) {
    const i64 row = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    if (lane == 0 && row < counters) a.counters[row] = 0u;
    const int h = (int)(row / a.tq), t = (int)(row - (i64)h * a.tq);
    const bf16raw* o = a.o + head_base(a.lo, h) + (i64)t * a.lo.row;
    const bf16raw* g = a.dout + head_base(a.lg, h) + (i64)t * a.lg.row;
    float s = 0.0f;
    for (int c = 2 * lane; c < d; c += 64) {
        u32a x = *(const u32a*)(o + c), y = *(const u32a*)(g + c);
        s += __uint_as_float(x << 16) * __uint_as_float(y << 16);
        s += __uint_as_float(x & 0xffff0000u) * __uint_as_float(y & 0xffff0000u);
    }
    s = warp_sum_a(s);
    if (lane == 0) a.delta[row] = s;
    if (a.tk == 0) {
        bf16raw* dq = a.dq + head_base(a.ldq, h) + (i64)t * a.ldq.row;
        for (int c = 2 * lane; c < d; c += 64) *(u32a*)(dq + c) = 0u;
    }
}

// Contributors to query block `i`'s dQ and this key block's place among them (`rank`; the one
// with rank `last` writes dQ). Key block b covers keys b·KB .. b·KB+KB, query block i rows
// i·64 .. i·64+64.
// - causal: key blocks 0 ..= min((i·64+63)/KB, nk−1) see block i; they reach it in descending
//   order (a higher key block starts its walk at an earlier step), and the grid dispatches them
//   in that order too.
// - rotating (non-causal): key block b starts its walk at query block (b·KB/64) mod nq, so it
//   reaches block i at step (i − start_b) mod nq; the rank is how many key blocks reach i at an
//   earlier step (distinct for distinct b while KB/64·nk ≤ nq, which the launcher checks).
// - otherwise: every key block walks 0, 1, ...; the rank is by descending key block.
template <int KB>
__device__ __forceinline__ void dq_order(int i, int kblock, int step, int nq, int nk, int causal, int rotate, int& rank, int& last) {
    if (causal) {
        last = imin((i * BF_KEYS + BF_KEYS - 1) / KB, nk - 1);
        rank = last - kblock;
    } else if (rotate) {
        last = nk - 1;
        rank = 0;
        for (int b = 0; b < nk; ++b) {
            const int sb = (i - (b * KB / BF_KEYS) % nq + nq) % nq;
            rank += sb < step;
        }
    } else {
        last = nk - 1;
        rank = nk - 1 - kblock;
    }
}

// W warps own 16·W keys (16 each); the query tiles stay 64 rows. With W = 8 each key block adds
// into dQ half as often as with W = 4 (half the dQ traffic and ordered hand-offs) and stages
// each Q/dO tile for twice the keys; its dQ part, dS·K over 128 keys, is split by query rows
// (warp % 4) and by halves of the head dims (warp / 4).
template <int D, int W>
__device__ void flash_backward_bf16(const AttnArgs& a) {
    constexpr int P = D + 8;
    constexpr int KS = D / 16;
    constexpr int NT = BF_KEYS / 8;  // 8-wide query tiles per block of queries
    constexpr int DT = D / 8;
    constexpr int KB = 16 * W;       // keys per block
    constexpr int THREADS = 32 * W;
    constexpr int CG = W / 4;        // column groups of the dQ part
    constexpr int DQT = DT / CG;     // 8-wide dQ column tiles per warp
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16raw* kb = (bf16raw*)smem_raw;     // [KB][P] this block's key rows
    bf16raw* vb = kb + KB * P;            // [KB][P] this block's value rows
    bf16raw* dsb = vb + KB * P;           // [KB keys][P] dSᵀ of the current tile
    bf16raw* qg_buf = dsb + KB * P;       // two buffers of [Q tile][dO tile], each [64][P]
    float* stat_buf = (float*)(qg_buf + 4 * BF_KEYS * P);  // two buffers of [lse][delta], [64] each
    const int tq = a.tq, tk = a.tk, causal = a.causal, rotate = a.rotate;
    const float scale = a.scale;
    const int h = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int nq = (tq + BF_KEYS - 1) / BF_KEYS, nk = (tk + KB - 1) / KB;
    const int kblock = nk - 1 - (int)blockIdx.x;
    const int key0 = kblock * KB;
    const int jw = key0 + warp * 16;
    const int ja = jw + g, jb = jw + g + 8;
    const float sl2 = scale * LOG2E_F;
    const bf16raw* qh = a.q + head_base(a.lq, h);
    const bf16raw* gh = a.dout + head_base(a.lg, h);
    const i64 rq = a.lq.row, rg = a.lg.row;
    const float* lse_h = a.lse + (i64)h * tq;
    const float* delta_h = a.delta + (i64)h * tq;
    // The first query block that sees this block's keys under a causal mask.
    const int qfirst = key0 / BF_KEYS;
    const int nsteps = causal ? (nq > qfirst ? nq - qfirst : 0) : nq;
    // The first query block of the walk; each step takes the next one, wrapping (only a
    // rotating walk wraps within its steps).
    int qblk = causal ? qfirst : rotate ? qfirst % nq : 0;
    // Queues the Q and dO rows and the row statistics (lse, delta) of the tile at i0 into
    // buffer b, all with cp.async (one statistic per thread of the first 128).
    auto stage_tile = [&](int b, int i0) {
        bf16raw* qd = qg_buf + b * 2 * BF_KEYS * P;
        stage_async<D, BF_KEYS, THREADS>(qd, qh, i0, tq, rq);
        stage_async<D, BF_KEYS, THREADS>(qd + BF_KEYS * P, gh, i0, tq, rg);
        if (threadIdx.x < 2 * BF_KEYS) {
            const int which = threadIdx.x / BF_KEYS, il = threadIdx.x % BF_KEYS, i = i0 + il;
            float* dst = stat_buf + b * 2 * BF_KEYS + which * BF_KEYS + il;
            if (i < tq) {
                asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(dst)), "l"((which ? delta_h : lse_h) + i));
            } else {
                *dst = which ? 0.0f : INFINITY;
            }
        }
    };
    stage_async<D, KB, THREADS>(kb, a.k + head_base(a.lk, h), key0, tk, a.lk.row);
    stage_async<D, KB, THREADS>(vb, a.v + head_base(a.lv, h), key0, tk, a.lv.row);
    if (nsteps > 0) stage_tile(0, qblk * BF_KEYS);
    cp_async_commit();
    float adk[DT][4], adv[DT][4];
#pragma unroll
    for (int i = 0; i < DT; ++i) {
        adk[i][0] = adk[i][1] = adk[i][2] = adk[i][3] = 0.0f;
        adv[i][0] = adv[i][1] = adv[i][2] = adv[i][3] = 0.0f;
    }
    // This warp's share of the dQ part: query rows 16·(warp % 4) of the tile, head-dim columns
    // from dq_c0.
    const int dq_row = (warp & 3) * 16, dq_c0 = (warp >> 2) * (D / CG);
    // Shared addresses of this lane's ldmatrix rows: K for dQ's B, dSᵀ for dQ's A, and the two
    // Q/dO buffers for dV's and dK's B.
    const u32a kb_b = smem_u32(kb) + 2 * (ldsm_b_lane<P>() + dq_c0);
    const u32a ds_a = smem_u32(dsb) + 2 * (ldsm_a_lane<P>() + dq_row);
    const u32a qg_b = smem_u32(qg_buf) + 2 * ldsm_b_lane<P>();
    const u32a qg_r = smem_u32(qg_buf) + 2 * ldsm_n_lane<P>();
    const bf16raw* ka = kb + (warp * 16 + g) * P + 2 * t;
    const bf16raw* va = vb + (warp * 16 + g) * P + 2 * t;
    float* acc_h = a.dq_acc + (i64)h * tq * D;
    bf16raw* dq_h = a.dq + head_base(a.ldq, h);
    const i64 rdq = a.ldq.row;
    // The counter this block still has to release (after the next barrier) and its new value.
    u32a* pending = nullptr;
    u32a pending_value = 0u;
    for (int s = 0; s < nsteps; ++s, qblk = qblk + 1 == nq ? 0 : qblk + 1) {
        const int i0 = qblk * BF_KEYS;
        const int buf = s & 1;
        // The buffer the next tile goes into was last read before step s-1's dSᵀ barrier.
        if (s + 1 < nsteps) stage_tile(buf ^ 1, (qblk + 1 == nq ? 0 : qblk + 1) * BF_KEYS);
        cp_async_commit();
        cp_async_wait_all_but_one();
        // This tile is in, everyone is done with dSᵀ of step s-1 and has added its dQ part of
        // step s-1: publish that part.
        __syncthreads();
        if (threadIdx.x == 0 && pending != nullptr) st_release_u32(pending, pending_value);
        pending = nullptr;
        const float* l2s = stat_buf + buf * 2 * BF_KEYS;
        const float* dls = l2s + BF_KEYS;
        // Only tiles crossing the causal diagonal or the end of the queries or keys need the
        // mask (keys past the end are zero rows in shared memory, masked to p = 0 here). A warp
        // whose keys all come after the tile's last query (causal, wide blocks on the diagonal)
        // only writes its zero rows of dSᵀ.
        const bool need_mask = i0 + BF_KEYS > tq || jw + 16 > tk || (causal && jw + 15 > i0);
        const bool dead = W > 4 && causal && jw > i0 + BF_KEYS - 1;  // never with 64-key blocks
        // Two halves of 32 queries each, one after the other, so only half of Sᵀ and dPᵀ is
        // live in registers at a time.
#pragma unroll 1
        for (int half = 0; half < 2; ++half) {
            constexpr int NH = NT / 2;
            const int q0 = half * (BF_KEYS / 2);  // first query of the half, within the tile
            float st[NH][4], dpt[NH][4];
            // This lane's ldmatrix row in the Q tile of this half (no transpose).
            const u32a qg_n = qg_r + 2 * (buf * 2 * BF_KEYS * P + q0 * P);
#pragma unroll
            for (int n = 0; n < NH; ++n) {
                st[n][0] = st[n][1] = st[n][2] = st[n][3] = 0.0f;
                dpt[n][0] = dpt[n][1] = dpt[n][2] = dpt[n][3] = 0.0f;
            }
            if (!dead) {
#pragma unroll
                for (int s2 = 0; s2 < KS; ++s2) {
                    u32a kf[4], vf[4];
                    kf[0] = *(const u32a*)(ka + s2 * 16);
                    kf[1] = *(const u32a*)(ka + 8 * P + s2 * 16);
                    kf[2] = *(const u32a*)(ka + s2 * 16 + 8);
                    kf[3] = *(const u32a*)(ka + 8 * P + s2 * 16 + 8);
                    vf[0] = *(const u32a*)(va + s2 * 16);
                    vf[1] = *(const u32a*)(va + 8 * P + s2 * 16);
                    vf[2] = *(const u32a*)(va + s2 * 16 + 8);
                    vf[3] = *(const u32a*)(va + 8 * P + s2 * 16 + 8);
                    // B fragments of two query tiles per ldmatrix.x4 (Q and dO rows are the n
                    // index, head dims the k index: no transpose). 32-bit shared loads measured
                    // the same.
#pragma unroll
                    for (int n = 0; n < NH; n += 2) {
                        u32a bq[4], bg[4];
                        ldsm_x4(bq, qg_n + 2 * (n * 8 * P + s2 * 16));
                        ldsm_x4(bg, qg_n + 2 * (BF_KEYS * P + n * 8 * P + s2 * 16));
                        mma_bf16(st[n], kf, bq[0], bq[1]);
                        mma_bf16(st[n + 1], kf, bq[2], bq[3]);
                        mma_bf16(dpt[n], vf, bg[0], bg[1]);
                        mma_bf16(dpt[n + 1], vf, bg[2], bg[3]);
                    }
                }
            }
            // P = 2^(S·scale·log2e − lse·log2e) and dS = P ⊙ (dP − delta), branch-free; masked
            // entries get a score of −∞ (P = 0).
#pragma unroll
            for (int n = 0; n < NH; ++n) {
                const int il = q0 + n * 8 + 2 * t;
                const F2 ls = *(const F2*)(l2s + il), dl = *(const F2*)(dls + il);
                const float l2x = ls.x * LOG2E_F, l2y = ls.y * LOG2E_F;
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float x = fmaf(st[n][e], sl2, -((e & 1) ? l2y : l2x));
                    if (need_mask) {
                        const int i = i0 + il + (e & 1), j = e < 2 ? ja : jb;
                        x = (i < tq && j < tk && (!causal || j <= i)) ? x : -INFINITY;
                    }
                    const float p = ex2f(x);
                    st[n][e] = p;
                    dpt[n][e] = p * (dpt[n][e] - ((e & 1) ? dl.y : dl.x));
                }
            }
            bf16raw* dsw = dsb + (warp * 16 + g) * P + 2 * t + q0;
            // This lane's ldmatrix rows in the Q tile (dO follows at BF_KEYS·P), from query q0.
            const u32a qg_h = qg_b + 2 * (buf * 2 * BF_KEYS * P + q0 * P);
#pragma unroll
            for (int kk = 0; kk < NH / 2; ++kk) {
                u32a pa[4], da[4];
                pa[0] = pack_bf16x2(st[2 * kk][0], st[2 * kk][1]);
                pa[1] = pack_bf16x2(st[2 * kk][2], st[2 * kk][3]);
                pa[2] = pack_bf16x2(st[2 * kk + 1][0], st[2 * kk + 1][1]);
                pa[3] = pack_bf16x2(st[2 * kk + 1][2], st[2 * kk + 1][3]);
                da[0] = pack_bf16x2(dpt[2 * kk][0], dpt[2 * kk][1]);
                da[1] = pack_bf16x2(dpt[2 * kk][2], dpt[2 * kk][3]);
                da[2] = pack_bf16x2(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]);
                da[3] = pack_bf16x2(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3]);
                // dSᵀ rows g and g+8 of this warp, query columns q0 + 16·kk + 2t (+1) and +8.
                *(u32a*)(dsw + kk * 16) = da[0];
                *(u32a*)(dsw + 8 * P + kk * 16) = da[1];
                *(u32a*)(dsw + kk * 16 + 8) = da[2];
                *(u32a*)(dsw + 8 * P + kk * 16 + 8) = da[3];
                if (dead) continue;
#pragma unroll
                for (int i = 0; i < DT; i += 2) {
                    u32a b[4];
                    ldsm_x4_trans(b, qg_h + 2 * (BF_KEYS * P + kk * 16 * P + i * 8));
                    mma_bf16(adv[i], pa, b[0], b[1]);
                    mma_bf16(adv[i + 1], pa, b[2], b[3]);
                    ldsm_x4_trans(b, qg_h + 2 * (kk * 16 * P + i * 8));
                    mma_bf16(adk[i], da, b[0], b[1]);
                    mma_bf16(adk[i + 1], da, b[2], b[3]);
                }
            }
        }
        if (a.probe & 2) continue;
        // This key block's dQ part for this warp's rows and columns of the tile, dS·K, added
        // in this block's turn. Each warp waits on its own and fetches the running sum before
        // the dSᵀ barrier and its products so the L2 round trip overlaps them; the release
        // comes after the next barrier, once every warp has added.
        int last, rank;
        dq_order<KB>(qblk, kblock, s, nq, nk, causal, rotate, rank, last);
        if (a.probe & 1) rank = 1, last = 2;
        if (a.probe & 4) rank = 0, last = 1;
        u32a* ctr = a.counters + (i64)h * nq + qblk;
        if (rank > 0 && !(a.probe & 1)) {
            if (lane == 0) {
                while (ld_acquire_u32(ctr) < (u32a)rank) asm volatile("nanosleep.u32 32;\n" ::);
            }
            __syncwarp();
        }
        int qa = i0 + dq_row + g, qb = qa + 8;
        float* acc_a = acc_h + (i64)qa * D + dq_c0 + 2 * t;
        float* acc_b = acc_h + (i64)qb * D + dq_c0 + 2 * t;
        // The first in the order stores its part, the ones between add theirs at L2 (vector
        // red: no round trip; reading, adding and storing measured 8% slower overall), the last
        // reads the running sum and writes dQ. The order makes every element's sum the same,
        // bit for bit, on every run.
        F2 prev[DQT][2];
        if (a.probe & 4) qa = qb = tq;
#pragma unroll
        for (int i = 0; i < DQT; ++i) {
            prev[i][0] = prev[i][1] = F2{0.0f, 0.0f};
            if (rank > 0 && rank == last) {
                if (qa < tq) prev[i][0] = ld_cg_f2(acc_a + i * 8);
                if (qb < tq) prev[i][1] = ld_cg_f2(acc_b + i * 8);
            }
        }
        __syncthreads();
        float dqa[DQT][4];
#pragma unroll
        for (int i = 0; i < DQT; ++i) dqa[i][0] = dqa[i][1] = dqa[i][2] = dqa[i][3] = 0.0f;
        if (!(a.probe & 8)) {
            // Keys of this block that the tile's queries can see (causal: none past its last
            // row), in 16-key steps.
            const int kend = W > 4 && causal ? imin(KB, i0 + BF_KEYS - key0) : KB;
#pragma unroll
            for (int kk = 0; kk < KB / 16; ++kk) {
                if (kk * 16 >= kend) break;
                u32a af[4];
                ldsm_x4_trans(af, ds_a + 2 * (kk * 16 * P));
#pragma unroll
                for (int i = 0; i < DQT; i += 2) {
                    u32a b[4];
                    ldsm_x4_trans(b, kb_b + 2 * (kk * 16 * P + i * 8));
                    mma_bf16(dqa[i], af, b[0], b[1]);
                    mma_bf16(dqa[i + 1], af, b[2], b[3]);
                }
            }
        }
        if (rank == last) {
            bf16raw* dq_a = dq_h + (i64)qa * rdq + dq_c0 + 2 * t;
            bf16raw* dq_b = dq_h + (i64)qb * rdq + dq_c0 + 2 * t;
#pragma unroll
            for (int i = 0; i < DQT; ++i) {
                if (qa < tq) *(u32a*)(dq_a + i * 8) = pack_bf16x2((dqa[i][0] + prev[i][0].x) * scale, (dqa[i][1] + prev[i][0].y) * scale);
                if (qb < tq) *(u32a*)(dq_b + i * 8) = pack_bf16x2((dqa[i][2] + prev[i][1].x) * scale, (dqa[i][3] + prev[i][1].y) * scale);
            }
        } else if (rank == 0) {
#pragma unroll
            for (int i = 0; i < DQT; ++i) {
                if (qa < tq) st_cg_f2(acc_a + i * 8, F2{dqa[i][0], dqa[i][1]});
                if (qb < tq) st_cg_f2(acc_b + i * 8, F2{dqa[i][2], dqa[i][3]});
            }
        } else {
#pragma unroll
            for (int i = 0; i < DQT; ++i) {
                if (qa < tq) red_add_f2(acc_a + i * 8, F2{dqa[i][0], dqa[i][1]});
                if (qb < tq) red_add_f2(acc_b + i * 8, F2{dqa[i][2], dqa[i][3]});
            }
        }
        if (rank < last && !(a.probe & 1)) {
            pending = ctr;
            pending_value = (u32a)(rank + 1);
        }
    }
    // Every thread's part is in (bar.sync), then one release store publishes them all.
    __syncthreads();
    if (threadIdx.x == 0 && pending != nullptr) st_release_u32(pending, pending_value);
    bf16raw* dkh = a.dk + head_base(a.ldk, h);
    bf16raw* dvh = a.dv + head_base(a.ldv, h);
    const i64 rdk = a.ldk.row, rdv = a.ldv.row;
#pragma unroll
    for (int i = 0; i < DT; ++i) {
        int c = i * 8 + 2 * t;
        if (ja < tk) {
            *(u32a*)(dkh + (i64)ja * rdk + c) = pack_bf16x2(adk[i][0] * scale, adk[i][1] * scale);
            *(u32a*)(dvh + (i64)ja * rdv + c) = pack_bf16x2(adv[i][0], adv[i][1]);
        }
        if (jb < tk) {
            *(u32a*)(dkh + (i64)jb * rdk + c) = pack_bf16x2(adk[i][2] * scale, adk[i][3] * scale);
            *(u32a*)(dvh + (i64)jb * rdv + c) = pack_bf16x2(adv[i][2], adv[i][3]);
        }
    }
}

// d64 at most 168 registers (three blocks per SM; 255 registers and two blocks measured 20%
// slower); d128 takes the registers it needs (one block per SM, by shared memory too). The
// 128-key d64 form (8 warps) at most 128 registers, two blocks per SM.
extern "C" __global__ void __launch_bounds__(BF_WARPS * 32, 3) flash_backward_bf16_d64(const AttnArgs a) { flash_backward_bf16<64, 4>(a); }

extern "C" __global__ void __launch_bounds__(256, 2) flash_backward_bf16_k128_d64(const AttnArgs a) { flash_backward_bf16<64, 8>(a); }

extern "C" __global__ void __launch_bounds__(512, 1) flash_backward_bf16_k256_d64(const AttnArgs a) { flash_backward_bf16<64, 16>(a); }

extern "C" __global__ void __launch_bounds__(BF_WARPS * 32, 1) flash_backward_bf16_d128(const AttnArgs a) { flash_backward_bf16<128, 4>(a); }
