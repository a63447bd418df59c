/* Causal flash attention in bf16 on tensor cores: FlashAttention-2's scheme on mma.sync.
 *
 * Forward: a block of 4 warps owns 64 query rows (16 per warp) of one head and walks the keys in
 * steps of 32 from the diagonal down to 0 with an online softmax in fp32; Q stays in registers
 * as mma A fragments, S = Q K^T and O += P V run on m16n8k16 bf16 mma with fp32 accumulators,
 * and P goes from the S accumulators to bf16 A fragments without leaving registers (the m16n8
 * accumulator layout is, pairwise, the m16k16 A layout).
 * Backward: D = rowsum(dO * O) by a small kernel; then dK/dV (a block owns 64 keys and walks the
 * query tiles from the diagonal to the end) and dQ (a block owns 64 queries and walks the keys
 * from 0 to the diagonal), both recomputing P = exp(S - lse). Every output element is summed by
 * one thread in a fixed order, so results are bitwise reproducible; gradients are added to dqkv
 * once. On the diagonal, a warp skips the steps whose keys all lie past its rows.
 *
 * At the training shape (T = 256, HD = 128) these kernels are bound by memory and latency, not by
 * the tensor cores: the block count per SM (registers, shared memory) is what the tuning traded.
 *
 * Tiles live in shared memory with their 16-byte chunks XOR-swizzled by row, so the 8 row
 * addresses of each ldmatrix (and the cp.async writes) fall in 8 different bank groups.
 * Rows past T are zero-filled by cp.async, so padded keys and queries contribute exactly 0;
 * the causal mask (key > query) alone then covers every padded key a real query could see.
 *
 * Kernel bodies take HD as an argument of a force-inlined function that each __global__ wrapper
 * calls with a literal (64 or 128), so all loops unroll and register arrays stay in registers;
 * arrays are sized for MAXHD and the unused part is dead code for HD = 64. */
#include "attn_bf16.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include "cuda/bf16x2.cuh"
#include "cuda/sfu.cuh"

#define TILE 64 /* query rows per block and keys per tile: equal, so each tile has one diagonal tile */
#define NWARPS 4
#define NTHREADS (NWARPS * 32)
#define KT 32         /* forward and dQ: keys per step (a pair of K and V tiles of KT rows) */
#define FWD_PAIRS 2   /* forward: (K, V) pairs in the shared-memory ring; one loads while one is used */
#define SUB_KV 16     /* dK/dV: queries per inner step; bounds the live registers */
#define DKDV_QROWS 64 /* dK/dV: query rows per shared-memory tile */
#define MAXHD 128
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

typedef __nv_bfloat16 bf16;

extern __shared__ __align__(128) unsigned char attn_smem[];

/* ------------------------------------------------------------------------------------------- */
/* PTX helpers                                                                                  */

static __device__ __forceinline__ uint32_t smem_u32(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}
/* 16 bytes global -> shared, asynchronously; bytes = 0 writes zeros (rows past T). */
static __device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
static __device__ __forceinline__ void cp_async4(uint32_t dst, const void *src, int bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
static __device__ __forceinline__ void cp_async_commit(void) { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
/* wait until at most n of this thread's committed groups are still in flight */
#define CP_ASYNC_WAIT(n) asm volatile("cp.async.wait_group %0;\n" ::"n"(n) : "memory")

static __device__ __forceinline__ void ldsm_x4(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
static __device__ __forceinline__ void ldsm_x4_t(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
/* c (16x8 fp32) += a (16x16 bf16, row) * b (16x8 bf16, col) */
static __device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* ------------------------------------------------------------------------------------------- */
/* tiles                                                                                        */

/* byte offset of 16-byte chunk c (columns 8c..8c+7) of row r in a swizzled TILE x HD bf16 tile */
static __device__ __forceinline__ uint32_t toff(int r, int c, const int HD) {
    return (uint32_t)(r * HD + ((c ^ (r & 7)) << 3)) * 2u;
}

/* cp.async rows r0..r0+ROWS-1 of g (HD bf16 each, row stride ld elements) into tile s; rows >= T
 * become zeros. */
static __device__ __forceinline__ void load_rows(uint32_t s, const bf16 *g, size_t ld, int r0, int T, const int HD,
                                                 const int ROWS) {
    const int CH = HD / 8;
#pragma unroll
    for (int i = 0; i < ROWS * CH / NTHREADS; i++) {
        const int idx = (int)threadIdx.x + i * NTHREADS, r = idx / CH, c = idx % CH, row = r0 + r;
        const int ok = row < T;
        cp_async16(s + toff(r, c, HD), g + (size_t)(ok ? row : 0) * ld + c * 8, ok ? 16 : 0);
    }
}
static __device__ __forceinline__ void load_tile(uint32_t s, const bf16 *g, size_t ld, int r0, int T, const int HD) {
    load_rows(s, g, ld, r0, T, HD, TILE);
}
/* cp.async n floats g[r0..] into s; entries >= T become 0 */
static __device__ __forceinline__ void load_vec(uint32_t s, const float *g, int r0, int T, const int n) {
    if ((int)threadIdx.x < n) {
        const int row = r0 + (int)threadIdx.x, ok = row < T;
        cp_async4(s + threadIdx.x * 4u, g + (ok ? row : 0), ok ? 4 : 0);
    }
}

/* A fragment (16x16) at rows r0.., columns 16*kc.. of a tile */
static __device__ __forceinline__ void ld_a(uint32_t a[4], uint32_t s, int r0, int kc, const int HD) {
    const int lane = threadIdx.x & 31;
    ldsm_x4(a, s + toff(r0 + (lane & 15), kc * 2 + (lane >> 4), HD));
}
/* B fragments of two n8 tiles where B[k][n] = tile[n][k] (e.g. K for S = Q K^T): n = rows r0..r0+15,
 * k = columns 16*kc..; b[0..1] for rows r0..r0+7, b[2..3] for rows r0+8.. */
static __device__ __forceinline__ void ld_b(uint32_t b[4], uint32_t s, int r0, int kc, const int HD) {
    const int lane = threadIdx.x & 31;
    ldsm_x4(b, s + toff(r0 + (lane & 7) + ((lane >> 4) << 3), kc * 2 + ((lane >> 3) & 1), HD));
}
/* B fragments of two n8 tiles where B[k][n] = tile[k][n] (e.g. V for O = P V): k = rows r0..r0+15,
 * n = columns 16*nc..; b[0..1] for columns 16nc..16nc+7, b[2..3] for the next 8 */
static __device__ __forceinline__ void ld_bt(uint32_t b[4], uint32_t s, int r0, int nc, const int HD) {
    const int lane = threadIdx.x & 31;
    ldsm_x4_t(b, s + toff(r0 + (lane & 7) + (((lane >> 3) & 1) << 3), nc * 2 + (lane >> 4), HD));
}
/* the 16x16 A fragment of columns 16kk.. of a 16 x n accumulator (acc[n8 tile][4]) */
static __device__ __forceinline__ void acc_to_a(uint32_t a[4], float (*acc)[4], int kk) {
    a[0] = pack_bf16(acc[2 * kk][0], acc[2 * kk][1]);
    a[1] = pack_bf16(acc[2 * kk][2], acc[2 * kk][3]);
    a[2] = pack_bf16(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
    a[3] = pack_bf16(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
}

/* RoPE's backward on one pair: (x0, x1) -> (x0 c - x1 s', x0 s' + x1 c) with s' = -sin. */
static __device__ __forceinline__ void rope_back(float &x0, float &x1, float c, float sn) {
    const float s = -sn, a = x0, b = x1;
    x0 = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    x1 = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
}

/* Writes (accumulate = 0) or adds (accumulate = 1: old bf16 + value in fp32, rounded once) a warp's
 * 16 x HD accumulator rows, row r scaled by mult[r / 8], to rows row0..row0+15 (< T) of g (bf16, row
 * stride ld). Goes through the warp's fp32 stage in shared memory (16 x (HD+8) floats; the 8 floats
 * of padding make the fragment writes conflict-free) so global accesses are 16 bytes, coalesced.
 * rc / rs (writing only): RoPE's inverse rotation of each interleaved pair of row t (= the
 * position) by the tables' row t, in fp32 before the rounding, with the products and sums
 * separately rounded as the rope kernel and the CPU backend compute them. */
static __device__ __forceinline__ void store_rows(bf16 *g, size_t ld, int row0, int T, float (*acc)[4],
                                                  const float mult[2], float *stage, int accumulate,
                                                  const int HD, const float *rc = nullptr,
                                                  const float *rs = nullptr) {
    const int lane = threadIdx.x & 31, gr = lane >> 2, t = lane & 3, SS = HD + 8, CH = HD / 8;
#pragma unroll
    for (int n = 0; n < HD / 8; n++) {
        *(float2 *)&stage[gr * SS + n * 8 + 2 * t] = make_float2(acc[n][0] * mult[0], acc[n][1] * mult[0]);
        *(float2 *)&stage[(gr + 8) * SS + n * 8 + 2 * t] = make_float2(acc[n][2] * mult[1], acc[n][3] * mult[1]);
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 16 * CH / 32; i++) {
        const int idx = lane + 32 * i, r = idx / CH, c = idx % CH, row = row0 + r;
        if (row < T) {
            float4 x0 = *(const float4 *)&stage[r * SS + c * 8], x1 = *(const float4 *)&stage[r * SS + c * 8 + 4];
            uint4 *p = (uint4 *)(g + (size_t)row * ld + c * 8);
            if (rc) { /* the 4 pairs of these 8 columns: pair index c * 4 + k of row `row` */
                const float4 c4 = *(const float4 *)(rc + (size_t)row * (HD / 2) + c * 4);
                const float4 s4 = *(const float4 *)(rs + (size_t)row * (HD / 2) + c * 4);
                rope_back(x0.x, x0.y, c4.x, s4.x), rope_back(x0.z, x0.w, c4.y, s4.y);
                rope_back(x1.x, x1.y, c4.z, s4.z), rope_back(x1.z, x1.w, c4.w, s4.w);
            }
            if (accumulate) {
                const uint4 o = *p;
                x0.x += bf16_lo(o.x), x0.y += bf16_hi(o.x), x0.z += bf16_lo(o.y), x0.w += bf16_hi(o.y);
                x1.x += bf16_lo(o.z), x1.y += bf16_hi(o.z), x1.z += bf16_lo(o.w), x1.w += bf16_hi(o.w);
            }
            uint4 v;
            v.x = pack_bf16(x0.x, x0.y), v.y = pack_bf16(x0.z, x0.w);
            v.z = pack_bf16(x1.x, x1.y), v.w = pack_bf16(x1.z, x1.w);
            *p = v;
        }
    }
    __syncwarp(); /* the stage is reused by the next call */
}

/* ------------------------------------------------------------------------------------------- */
/* forward                                                                                      */

/* Shared memory: the block's Q tile (64 rows), then a ring of FWD_PAIRS (K, V) pairs of KT-key
 * tiles: step n consumes pair n (key tile jl - n: from the diagonal down, so the masked tiles come
 * first) and prefetches pair n + FWD_PAIRS - 1 into the slot pair n-1 had. The small steps keep S
 * at 16 registers, so 3 blocks (12 warps) fit on an SM to hide the load latency of this short-T,
 * memory-bound kernel (64-key steps through a ring of single tiles, at 2 blocks per SM, measured
 * about 20% slower). */
static __device__ __forceinline__ void fwd_body(bf16 *out, float *lse, const bf16 *qkv, int T, int NH,
                                                 float scale2, const int HD) {
    const int nt = (T + TILE - 1) / TILE;
    const int bh = (int)(blockIdx.x / nt), qt = nt - 1 - (int)(blockIdx.x % nt); /* longest rows first */
    const int b = bh / NH, h = bh % NH, C = NH * HD;
    const size_t ld = 3 * (size_t)C;
    const bf16 *qg = qkv + (size_t)b * T * ld + (size_t)h * HD, *kg = qg + C, *vg = qg + 2 * C;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const uint32_t KB = KT * HD * 2, sQ = smem_u32(attn_smem), sR = sQ + TILE * HD * 2;
    const int q0 = qt * TILE + warp * 16;                                  /* this warp's first row */
    const int jl = min((T - 1) / KT, (qt * TILE + TILE - 1) / KT), ns = jl + 1; /* key tiles jl..0 */

    load_tile(sQ, qg, ld, qt * TILE, T, HD); /* in the first group, with pair 0 */
#pragma unroll
    for (int p = 0; p < FWD_PAIRS - 1; p++) {
        if (p < ns) {
            load_rows(sR + p * 2 * KB, kg, ld, (jl - p) * KT, T, HD, KT);
            load_rows(sR + p * 2 * KB + KB, vg, ld, (jl - p) * KT, T, HD, KT);
        }
        cp_async_commit();
    }

    uint32_t qf[MAXHD / 16][4]; /* Q as mma A fragments, loaded once */
    float o[MAXHD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}; /* running max (log2 units), partial sum */

    for (int n = 0; n < ns; n++) {
        CP_ASYNC_WAIT(FWD_PAIRS - 2);
        __syncthreads(); /* pair n landed for all threads; every warp is done with pair n-1 */
        const int nx = n + FWD_PAIRS - 1;
        if (nx < ns) {
            const uint32_t sx = sR + (nx % FWD_PAIRS) * 2 * KB;
            load_rows(sx, kg, ld, (jl - nx) * KT, T, HD, KT);
            load_rows(sx + KB, vg, ld, (jl - nx) * KT, T, HD, KT);
        }
        cp_async_commit(); /* possibly empty: keeps the group count uniform for the wait above */
        if (n == 0) {
#pragma unroll
            for (int kc = 0; kc < HD / 16; kc++) ld_a(qf[kc], sQ, warp * 16, kc, HD);
        }
        const int k0 = (jl - n) * KT;
        if (k0 > q0 + 15) continue; /* every key past this warp's rows */
        const uint32_t sK = sR + (n % FWD_PAIRS) * 2 * KB, sV = sK + KB;

        float s[KT / 8][4];
#pragma unroll
        for (int i = 0; i < KT / 8; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
        for (int kc = 0; kc < HD / 16; kc++) {
            const uint32_t *qa = qf[kc];
#pragma unroll
            for (int np = 0; np < KT / 16; np++) {
                uint32_t kb[4];
                ld_b(kb, sK, np * 16, kc, HD);
                mma16816(s[2 * np], qa, kb[0], kb[1]);
                mma16816(s[2 * np + 1], qa, kb[2], kb[3]);
            }
        }
        if (k0 + KT - 1 > q0) { /* some key > some row: mask (covers keys past T too) */
#pragma unroll
            for (int i = 0; i < KT / 8; i++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    if (k0 + i * 8 + 2 * t + (e & 1) > q0 + g + 8 * (e >> 1)) s[i][e] = -INFINITY;
        }
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float mx = -INFINITY;
#pragma unroll
            for (int i = 0; i < KT / 8; i++) mx = fmaxf(mx, fmaxf(s[i][2 * r], s[i][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mnew = fmaxf(m[r], mx * scale2);
            const float mu = mnew == -INFINITY ? 0.f : mnew; /* a row with nothing yet stays at 0 */
            const float alpha = sfu_ex2(m[r] - mu);
            m[r] = mnew;
            float sum = 0.f;
#pragma unroll
            for (int i = 0; i < KT / 8; i++) {
                s[i][2 * r] = sfu_ex2(fmaf(s[i][2 * r], scale2, -mu));
                s[i][2 * r + 1] = sfu_ex2(fmaf(s[i][2 * r + 1], scale2, -mu));
                sum += s[i][2 * r] + s[i][2 * r + 1];
            }
            l[r] = l[r] * alpha + sum;
#pragma unroll
            for (int i = 0; i < HD / 8; i++) o[i][2 * r] *= alpha, o[i][2 * r + 1] *= alpha;
        }
#pragma unroll
        for (int kk = 0; kk < KT / 16; kk++) { /* O += P V, P straight from the S registers */
            uint32_t pa[4];
            acc_to_a(pa, s, kk);
#pragma unroll
            for (int nc = 0; nc < HD / 16; nc++) {
                uint32_t vb[4];
                ld_bt(vb, sV, kk * 16, nc, HD);
                mma16816(o[2 * nc], pa, vb[0], vb[1]);
                mma16816(o[2 * nc + 1], pa, vb[2], vb[3]);
            }
        }
    }

    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        inv[r] = 1.f / l[r];
        const int row = q0 + g + 8 * r;
        if (t == 0 && row < T) lse[(size_t)bh * T + row] = m[r] * LN2 + logf(l[r]);
    }
    __syncthreads(); /* all warps done with the last pair before the stage overwrites shared memory */
    store_rows(out + (size_t)b * T * C + (size_t)h * HD, (size_t)C, q0, T, o, inv,
               (float *)attn_smem + warp * 16 * (HD + 8), 0, HD);
}

/* ------------------------------------------------------------------------------------------- */
/* backward                                                                                     */

/* D[b, h, t] = sum_d dO[b, t, h, d] * O[b, t, h, d]: HD/8 consecutive threads per row, 16 bytes each. */
__global__ void attn_bf16_D_kernel(float *D, const bf16 *dout, const bf16 *out, int B, int T, int NH, int HD) {
    const int per = HD / 8;
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x, rows = (size_t)B * T * NH;
    const size_t row = i / per;
    const int c = (int)(i % per);
    float acc = 0.f;
    if (row < rows) {
        const uint4 a = *(const uint4 *)(dout + row * HD + c * 8), o = *(const uint4 *)(out + row * HD + c * 8);
        acc = bf16_lo(a.x) * bf16_lo(o.x) + bf16_hi(a.x) * bf16_hi(o.x) + bf16_lo(a.y) * bf16_lo(o.y) +
              bf16_hi(a.y) * bf16_hi(o.y) + bf16_lo(a.z) * bf16_lo(o.z) + bf16_hi(a.z) * bf16_hi(o.z) +
              bf16_lo(a.w) * bf16_lo(o.w) + bf16_hi(a.w) * bf16_hi(o.w);
    }
    for (int off = per / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (row < rows && c == 0) {
        const size_t b = row / ((size_t)T * NH), rem = row % ((size_t)T * NH);
        const size_t tt = rem / NH, h = rem % NH;
        D[(b * NH + h) * T + tt] = acc;
    }
}

/* dK, dV of 64 keys (16 per warp). Shared memory: K, V, then two buffers of {Q, dO} for the query
 * tiles of DKDV_QROWS rows (double-buffered with cp.async), then lse[2][QROWS] and D[2][QROWS].
 * Per query tile, in steps of SUB_KV queries: S^T = K Q^T, dP^T = V dO^T, P^T = exp(S^T - lse),
 * dS^T = P^T (dP^T - D), dV += P^T dO, dK += dS^T Q. K and V fragments are re-read from shared
 * memory each step (registers hold dK and dV). A warp skips query steps entirely before its keys. */
static __device__ __forceinline__ void dkdv_body(bf16 *dqkv, const bf16 *dout, const bf16 *qkv, const float *lse,
                                                 const float *Dw, int T, int NH, float scale, int acc,
                                                 const float *rc, const float *rs, const int HD) {
    const int QR = DKDV_QROWS;
    const int nt = (T + TILE - 1) / TILE, nq = (T + QR - 1) / QR;
    const int bh = (int)(blockIdx.x / nt), kt = (int)(blockIdx.x % nt); /* kt 0 walks the most tiles: first */
    const int b = bh / NH, h = bh % NH, C = NH * HD;
    const size_t ld = 3 * (size_t)C;
    const bf16 *qg = qkv + (size_t)b * T * ld + (size_t)h * HD, *kg = qg + C, *vg = qg + 2 * C;
    const bf16 *dog = dout + (size_t)b * T * C + (size_t)h * HD;
    const float *lseg = lse + (size_t)bh * T, *Dg = Dw + (size_t)bh * T;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const uint32_t TB = TILE * HD * 2, QB = QR * HD * 2, sK = smem_u32(attn_smem), sV = sK + TB;
    const uint32_t sQ0 = sK + 2 * TB, sVec = sQ0 + 4 * QB; /* Q[b] = sQ0 + 2b QB, dO[b] = Q[b] + QB */
    const float *vec = (const float *)(attn_smem + 2 * TB + 4 * QB); /* lse[2][QR], D[2][QR] */
    const float scale2 = scale * LOG2E;
    const int kw = kt * TILE + warp * 16; /* this warp's first key */
    const int qi0 = kt * TILE / QR;       /* the first query tile that sees any of the block's keys */

    load_tile(sK, kg, ld, kt * TILE, T, HD);
    load_tile(sV, vg, ld, kt * TILE, T, HD);
    load_rows(sQ0, qg, ld, qi0 * QR, T, HD, QR);
    load_rows(sQ0 + QB, dog, (size_t)C, qi0 * QR, T, HD, QR);
    load_vec(sVec, lseg, qi0 * QR, T, QR);
    load_vec(sVec + 2 * QR * 4, Dg, qi0 * QR, T, QR);
    cp_async_commit();

    float dk[MAXHD / 8][4], dv[MAXHD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) dk[n][e] = dv[n][e] = 0.f;

    for (int qi = qi0; qi < nq; qi++) {
        const int buf = (qi - qi0) & 1;
        if (qi + 1 < nq) { /* prefetch the next query tile into the other buffer */
            const int nb = buf ^ 1;
            load_rows(sQ0 + 2 * nb * QB, qg, ld, (qi + 1) * QR, T, HD, QR);
            load_rows(sQ0 + 2 * nb * QB + QB, dog, (size_t)C, (qi + 1) * QR, T, HD, QR);
            load_vec(sVec + nb * QR * 4, lseg, (qi + 1) * QR, T, QR);
            load_vec(sVec + (2 + nb) * QR * 4, Dg, (qi + 1) * QR, T, QR);
            cp_async_commit();
            CP_ASYNC_WAIT(1);
        } else {
            CP_ASYNC_WAIT(0);
        }
        __syncthreads();
        const uint32_t sQ = sQ0 + 2 * buf * QB, sO = sQ + QB;
        const float *slse = vec + buf * QR, *sD = vec + (2 + buf) * QR;
#pragma unroll 1
        for (int qs = 0; qs < QR / SUB_KV; qs++) {
            const int qq = qi * QR + qs * SUB_KV; /* first query of the step */
            if (qq + SUB_KV - 1 < kw) continue;   /* every query before this warp's keys */
            float st[SUB_KV / 8][4], dpt[SUB_KV / 8][4];
#pragma unroll
            for (int n = 0; n < SUB_KV / 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) st[n][e] = dpt[n][e] = 0.f;
#pragma unroll
            for (int kc = 0; kc < HD / 16; kc++) {
                uint32_t ka[4], va[4];
                ld_a(ka, sK, warp * 16, kc, HD);
                ld_a(va, sV, warp * 16, kc, HD);
#pragma unroll
                for (int np = 0; np < SUB_KV / 16; np++) {
                    uint32_t qb[4], ob[4];
                    ld_b(qb, sQ, qs * SUB_KV + np * 16, kc, HD);
                    mma16816(st[2 * np], ka, qb[0], qb[1]);
                    mma16816(st[2 * np + 1], ka, qb[2], qb[3]);
                    ld_b(ob, sO, qs * SUB_KV + np * 16, kc, HD);
                    mma16816(dpt[2 * np], va, ob[0], ob[1]);
                    mma16816(dpt[2 * np + 1], va, ob[2], ob[3]);
                }
            }
            /* element (n, e): key kw + g + 8(e>>1), query qq + 8n + 2t + (e&1) */
            const int mask = kw + 15 > qq; /* some key after some query */
#pragma unroll
            for (int n = 0; n < SUB_KV / 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int ql = qs * SUB_KV + n * 8 + 2 * t + (e & 1);
                    float p = sfu_ex2(fmaf(st[n][e], scale2, -slse[ql] * LOG2E));
                    if (mask && kw + g + 8 * (e >> 1) > qi * QR + ql) p = 0.f;
                    st[n][e] = p;
                    dpt[n][e] = p * (dpt[n][e] - sD[ql]);
                }
#pragma unroll
            for (int kk = 0; kk < SUB_KV / 16; kk++) {
                uint32_t pa[4], da[4];
                acc_to_a(pa, st, kk);
                acc_to_a(da, dpt, kk);
#pragma unroll
                for (int nc = 0; nc < HD / 16; nc++) {
                    uint32_t ob[4], qb[4];
                    ld_bt(ob, sO, qs * SUB_KV + kk * 16, nc, HD);
                    mma16816(dv[2 * nc], pa, ob[0], ob[1]);
                    mma16816(dv[2 * nc + 1], pa, ob[2], ob[3]);
                    ld_bt(qb, sQ, qs * SUB_KV + kk * 16, nc, HD);
                    mma16816(dk[2 * nc], da, qb[0], qb[1]);
                    mma16816(dk[2 * nc + 1], da, qb[2], qb[3]);
                }
            }
        }
        __syncthreads(); /* every warp is done with this buffer before the next prefetch overwrites it */
    }

    const float mk[2] = {scale, scale}, mv[2] = {1.f, 1.f}; /* S = scale Q K^T, so dK carries the scale */
    float *stage = (float *)attn_smem + warp * 16 * (HD + 8);
    bf16 *dkg = dqkv + (size_t)b * T * ld + C + (size_t)h * HD;
    store_rows(dkg, ld, kw, T, dk, mk, stage, acc, HD, rc, rs);
    store_rows(dkg + C, ld, kw, T, dv, mv, stage, acc, HD);
}

/* dQ of 64 queries (16 per warp). Q and dO stay in shared memory (their fragments are re-read
 * each step: fewer registers, 3 blocks per SM), and K, V come in pairs of KT-key tiles through a
 * ring of two: step n computes with pair n (keys n*KT..) while pair n+1 loads. Per step:
 * S = Q K^T, dP = dO V^T, P = exp(S - lse), dS = P (dP - D), dQ += dS K. */
static __device__ __forceinline__ void dq_body(bf16 *dqkv, const bf16 *dout, const bf16 *qkv, const float *lse,
                                                const float *Dw, int T, int NH, float scale, int acc, const float *rc,
                                                const float *rs, const int HD) {
    const int nt = (T + TILE - 1) / TILE;
    const int bh = (int)(blockIdx.x / nt), qt = nt - 1 - (int)(blockIdx.x % nt); /* longest first */
    const int b = bh / NH, h = bh % NH, C = NH * HD;
    const size_t ld = 3 * (size_t)C;
    const bf16 *qg = qkv + (size_t)b * T * ld + (size_t)h * HD, *kg = qg + C, *vg = qg + 2 * C;
    const bf16 *dog = dout + (size_t)b * T * C + (size_t)h * HD;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const uint32_t TB = TILE * HD * 2, KB = KT * HD * 2, sQ = smem_u32(attn_smem), sO = sQ + TB, sR = sO + TB;
    const float scale2 = scale * LOG2E;
    const int q0 = qt * TILE + warp * 16;
    const int ns = min((T - 1) / KT, (qt * TILE + TILE - 1) / KT) + 1; /* key tiles 0..ns-1 */

    load_tile(sQ, qg, ld, qt * TILE, T, HD);
    load_tile(sO, dog, (size_t)C, qt * TILE, T, HD);
    load_rows(sR, kg, ld, 0, T, HD, KT);
    load_rows(sR + KB, vg, ld, 0, T, HD, KT);
    cp_async_commit();

    float lr[2], dr[2]; /* this thread's two rows: lse in log2 units, and D */
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = q0 + g + 8 * r;
        lr[r] = row < T ? lse[(size_t)bh * T + row] * LOG2E : 0.f;
        dr[r] = row < T ? Dw[(size_t)bh * T + row] : 0.f;
    }
    float dq[MAXHD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.f;

    for (int n = 0; n < ns; n++) {
        CP_ASYNC_WAIT(0);
        __syncthreads(); /* pair n landed for all threads; every warp is done with pair n-1 */
        if (n + 1 < ns) {
            const uint32_t sx = sR + ((n + 1) & 1) * 2 * KB;
            load_rows(sx, kg, ld, (n + 1) * KT, T, HD, KT);
            load_rows(sx + KB, vg, ld, (n + 1) * KT, T, HD, KT);
            cp_async_commit();
        }
        const int k0 = n * KT;
        if (k0 > q0 + 15) continue; /* every key past this warp's rows */
        const uint32_t sK = sR + (n & 1) * 2 * KB, sV = sK + KB;
        float s[KT / 8][4], dp[KT / 8][4];
#pragma unroll
        for (int i = 0; i < KT / 8; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[i][e] = dp[i][e] = 0.f;
#pragma unroll
        for (int kc = 0; kc < HD / 16; kc++) {
            uint32_t qa[4], oa[4];
            ld_a(qa, sQ, warp * 16, kc, HD);
            ld_a(oa, sO, warp * 16, kc, HD);
#pragma unroll
            for (int np = 0; np < KT / 16; np++) {
                uint32_t kb[4], vb[4];
                ld_b(kb, sK, np * 16, kc, HD);
                mma16816(s[2 * np], qa, kb[0], kb[1]);
                mma16816(s[2 * np + 1], qa, kb[2], kb[3]);
                ld_b(vb, sV, np * 16, kc, HD);
                mma16816(dp[2 * np], oa, vb[0], vb[1]);
                mma16816(dp[2 * np + 1], oa, vb[2], vb[3]);
            }
        }
        /* element (i, e): query q0 + g + 8(e>>1), key k0 + 8i + 2t + (e&1) */
        const int mask = k0 + KT - 1 > q0; /* some key after some row (covers keys past T too) */
#pragma unroll
        for (int i = 0; i < KT / 8; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float p = sfu_ex2(fmaf(s[i][e], scale2, -lr[e >> 1]));
                if (mask && k0 + i * 8 + 2 * t + (e & 1) > q0 + g + 8 * (e >> 1)) p = 0.f;
                s[i][e] = p * (dp[i][e] - dr[e >> 1]); /* dS */
            }
#pragma unroll
        for (int kk = 0; kk < KT / 16; kk++) {
            uint32_t da[4];
            acc_to_a(da, s, kk);
#pragma unroll
            for (int nc = 0; nc < HD / 16; nc++) {
                uint32_t kb[4];
                ld_bt(kb, sK, kk * 16, nc, HD);
                mma16816(dq[2 * nc], da, kb[0], kb[1]);
                mma16816(dq[2 * nc + 1], da, kb[2], kb[3]);
            }
        }
    }

    const float mq[2] = {scale, scale};
    __syncthreads(); /* all warps done with the last pair before the stage overwrites shared memory */
    store_rows(dqkv + (size_t)b * T * ld + (size_t)h * HD, ld, q0, T, dq, mq,
               (float *)attn_smem + warp * 16 * (HD + 8), acc, HD, rc, rs);
}

/* one kernel per head dim, so HD is a compile-time constant inside */
/* __launch_bounds__' second argument caps the registers at 168 so that 3 blocks fit on an SM (at
 * HD = 128 the forward then spills 16 bytes and dQ 32; still faster, as measured, than 2 blocks, and
 * for the forward than re-reading Q from shared memory at 4 blocks); dK/dV needs its ~250. */
#define FWD_SMEM(HD) ((size_t)TILE * (HD) * 2 + FWD_PAIRS * 2 * (size_t)KT * (HD) * 2)
__global__ void __launch_bounds__(NTHREADS, 3) attn_bf16_fwd_hd64(bf16 *out, float *lse, const bf16 *qkv, int T,
                                                                  int NH, float scale2) {
    fwd_body(out, lse, qkv, T, NH, scale2, 64);
}
__global__ void __launch_bounds__(NTHREADS, 3) attn_bf16_fwd_hd128(bf16 *out, float *lse, const bf16 *qkv, int T,
                                                                   int NH, float scale2) {
    fwd_body(out, lse, qkv, T, NH, scale2, 128);
}
#define DKDV_SMEM(HD) (2 * (size_t)TILE * (HD) * 2 + 4 * (size_t)DKDV_QROWS * (HD) * 2 + 4 * DKDV_QROWS * sizeof(float))
#define DQ_SMEM(HD) (2 * (size_t)TILE * (HD) * 2 + 2 * 2 * (size_t)KT * (HD) * 2)
__global__ void __launch_bounds__(NTHREADS, 1) attn_bf16_dkdv_hd64(bf16 *dqkv, const bf16 *dout, const bf16 *qkv,
                                                                  const float *lse, const float *D, int T, int NH,
                                                                  float scale, int acc, const float *rc, const float *rs) {
    dkdv_body(dqkv, dout, qkv, lse, D, T, NH, scale, acc, rc, rs, 64);
}
__global__ void __launch_bounds__(NTHREADS, 1) attn_bf16_dkdv_hd128(bf16 *dqkv, const bf16 *dout,
                                                                   const bf16 *qkv, const float *lse, const float *D,
                                                                   int T, int NH, float scale, int acc, const float *rc, const float *rs) {
    dkdv_body(dqkv, dout, qkv, lse, D, T, NH, scale, acc, rc, rs, 128);
}
__global__ void __launch_bounds__(NTHREADS, 3) attn_bf16_dq_hd64(bf16 *dqkv, const bf16 *dout, const bf16 *qkv,
                                                              const float *lse, const float *D, int T, int NH,
                                                              float scale, int acc, const float *rc, const float *rs) {
    dq_body(dqkv, dout, qkv, lse, D, T, NH, scale, acc, rc, rs, 64);
}
__global__ void __launch_bounds__(NTHREADS, 3) attn_bf16_dq_hd128(bf16 *dqkv, const bf16 *dout, const bf16 *qkv,
                                                               const float *lse, const float *D, int T, int NH,
                                                               float scale, int acc, const float *rc, const float *rs) {
    dq_body(dqkv, dout, qkv, lse, D, T, NH, scale, acc, rc, rs, 128);
}

/* ------------------------------------------------------------------------------------------- */
/* host side                                                                                    */

static void attn_check(const char *what) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        fprintf(stderr, "meshtrain: cuda: attention %s failed: %s\n", what, cudaGetErrorString(e));
        exit(1);
    }
}

/* blocks of one launch: (T / TILE rounded up) per head; dies when past the grid limit */
static unsigned attn_grid(int B, int T, int NH, int HD) {
    if (!attn_bf16_supported(HD)) {
        fprintf(stderr, "meshtrain: cuda: attention bf16 does not support head_dim %d\n", HD);
        exit(1);
    }
    const unsigned long long n = (unsigned long long)((T + TILE - 1) / TILE) * (unsigned long long)B * NH;
    if (n > 0x7fffffffull) {
        fprintf(stderr, "meshtrain: cuda: attention bf16 grid of %llu blocks is too large\n", n);
        exit(1);
    }
    return (unsigned)n;
}

/* Opts a kernel in to `bytes` of dynamic shared memory (needed past 48 KiB) and asks for the largest
 * shared-memory carveout, so that as many blocks fit on an SM as the registers allow (the driver
 * otherwise may pick a smaller one). Cheap, so on every call. */
static void attn_set_smem(const void *fn, size_t bytes, const char *what) {
    if (bytes > 48 * 1024) cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
    cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, (int)cudaSharedmemCarveoutMaxShared);
    attn_check(what);
}

extern "C" int attn_bf16_supported(int HD) { return HD == 64 || HD == 128; }

extern "C" size_t attn_bf16_workspace_bytes(int B, int T, int NH, int HD) {
    (void)HD;
    return ((size_t)B * NH * T * sizeof(float) + 255) & ~(size_t)255;
}

extern "C" void attn_bf16_forward(void *out, float *lse, const void *qkv, int B, int T, int NH, int HD,
                                  void *stream) {
    const unsigned grid = attn_grid(B, T, NH, HD);
    if (grid == 0) return;
    cudaStream_t st = (cudaStream_t)stream;
    const float scale2 = LOG2E / sqrtf((float)HD);
    const size_t smem = FWD_SMEM(HD);
    if (HD == 64) {
        attn_set_smem((const void *)attn_bf16_fwd_hd64, smem, "attn_bf16_fwd_hd64");
        attn_bf16_fwd_hd64<<<grid, NTHREADS, smem, st>>>((bf16 *)out, lse, (const bf16 *)qkv, T, NH, scale2);
        attn_check("attn_bf16_fwd_hd64");
    } else {
        attn_set_smem((const void *)attn_bf16_fwd_hd128, smem, "attn_bf16_fwd_hd128");
        attn_bf16_fwd_hd128<<<grid, NTHREADS, smem, st>>>((bf16 *)out, lse, (const bf16 *)qkv, T, NH, scale2);
        attn_check("attn_bf16_fwd_hd128");
    }
}

extern "C" void attn_bf16_backward(void *dqkv, const void *dout, const void *qkv, const void *out,
                                   const float *lse, void *workspace, int B, int T, int NH, int HD, int acc,
                                   const float *rope_cos, const float *rope_sin, void *stream) {
    const unsigned grid = attn_grid(B, T, NH, HD);
    if (grid == 0) return;
    cudaStream_t st = (cudaStream_t)stream;
    const float scale = 1.f / sqrtf((float)HD);
    float *D = (float *)workspace;
    const size_t threads = (size_t)B * T * NH * (HD / 8);
    attn_bf16_D_kernel<<<(unsigned)((threads + 255) / 256), 256, 0, st>>>(D, (const bf16 *)dout,
                                                                           (const bf16 *)out, B, T, NH, HD);
    attn_check("attn_bf16_D_kernel");
    if (rope_cos && (acc || ((uintptr_t)rope_cos | (uintptr_t)rope_sin) % 16)) {
        fprintf(stderr, "meshtrain: cuda: attention backward with RoPE needs acc = 0 and 16-byte aligned tables\n");
        exit(1);
    }
    const float *rc = rope_cos, *rs = rope_cos ? rope_sin : NULL;
    const size_t smem_kv = DKDV_SMEM(HD), smem_q = DQ_SMEM(HD);
    bf16 *dq = (bf16 *)dqkv;
    const bf16 *dO = (const bf16 *)dout, *x = (const bf16 *)qkv;
    if (HD == 64) {
        attn_set_smem((const void *)attn_bf16_dkdv_hd64, smem_kv, "attn_bf16_dkdv_hd64");
        attn_bf16_dkdv_hd64<<<grid, NTHREADS, smem_kv, st>>>(dq, dO, x, lse, D, T, NH, scale, acc, rc, rs);
        attn_check("attn_bf16_dkdv_hd64");
        attn_set_smem((const void *)attn_bf16_dq_hd64, smem_q, "attn_bf16_dq_hd64");
        attn_bf16_dq_hd64<<<grid, NTHREADS, smem_q, st>>>(dq, dO, x, lse, D, T, NH, scale, acc, rc, rs);
        attn_check("attn_bf16_dq_hd64");
    } else {
        attn_set_smem((const void *)attn_bf16_dkdv_hd128, smem_kv, "attn_bf16_dkdv_hd128");
        attn_bf16_dkdv_hd128<<<grid, NTHREADS, smem_kv, st>>>(dq, dO, x, lse, D, T, NH, scale, acc, rc, rs);
        attn_check("attn_bf16_dkdv_hd128");
        attn_set_smem((const void *)attn_bf16_dq_hd128, smem_q, "attn_bf16_dq_hd128");
        attn_bf16_dq_hd128<<<grid, NTHREADS, smem_q, st>>>(dq, dO, x, lse, D, T, NH, scale, acc, rc, rs);
        attn_check("attn_bf16_dq_hd128");
    }
}
