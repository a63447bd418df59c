/* Causal flash-attention backward for Hopper (sm_90a) on warpgroup MMA (wgmma) and the tensor memory
 * accelerator (TMA): FlashAttention-3's backward structure, written out in C-style CUDA. Interface and
 * results as attn_bf16_backward (attn_bf16.h), RoPE's fused backward included; see attn_wgmma_bwd.h.
 *
 * Three kernels per call (plus a memset of the dQ accumulator and the semaphores):
 *   1. preprocess: D[bh, t] = sum_d dO * O (fp32) and lse2[bh, t] = lse * log2(e), both padded to whole
 *      query tiles (rows past T: D = 0, lse2 = +inf, so that P = 0 there).
 *   2. main: one block per (key tile of BN = 128 keys, 64 at HD 256, batch * head); it keeps dK and dV
 *      of its keys in registers and walks the query tiles of BM queries from its diagonal to the end
 *      (FA3's kBlockM x kBlockN: HD 128 and 96: 64 x 128; HD 64: 128 x 128; HD 256: 64 x 64, see
 *      below). Per query tile i:
 *        S^T = K Q_i^T, P^T = exp2(S^T scale log2e - lse2) (causal mask where a key can pass a query),
 *        dP^T = V dO_i^T, dS^T = P^T (dP^T - D),
 *        dV += P^T dO_i, dK += dS^T Q_i (P^T and dS^T straight from registers: the A operand),
 *        dQ_i (+)= dS K (dS^T written to shared memory as bf16, the A operand of an SS wgmma),
 *      dQ_i goes (fp32) through shared memory to the global accumulator by the copy engine's
 *      reduce-add (cp.reduce.async.bulk .add.f32); with `deterministic`, the key tiles of a query
 *      tile add in a fixed order (a semaphore per (bh, query tile) in the workspace), the first in
 *      the order storing instead of adding (so only the semaphores need zeroing there).
 *      dK (times the softmax scale: S = scale Q K^T) and dV are written from registers at the end.
 *   3. postprocess: dQ (fp32, times the scale) -> bf16 into dqkv's q columns (acc: added).
 * With the RoPE tables (the ROPE instantiations of 2 and 3), dK in 2's epilogue and dQ in 3 are
 * rotated back in fp32 just before their one rounding: a RoPE pair (2i, 2i+1) is two adjacent
 * columns, which the wgmma fragment (dK) and the postprocess's 8 columns a thread (dQ) keep in one
 * thread, so no data moves for it.
 *
 * Main kernel: 384 threads, one block per SM, three warpgroups.
 *   warpgroups 0 and 1 (consumers): warpgroup w owns keys 64w..64w+63 of the block's 128 (the M rows
 *     of S^T, dP^T, dK, dV: FA3's SdP_swapAB with the warpgroups along the keys); for dQ_i they split
 *     the work along the head dim (BM = 64: each has all 64 queries x HD/2 columns) or the queries
 *     (BM = 128: 64 queries x HD each): FA3's AtomLayoutMdQ 1 and 2.
 *   warpgroup 2 (producer): warp 0 lane 0 issues the TMA loads (K and V once; then Q_i with lse2_i,
 *     dO_i with D_i into a 2-stage ring); warp 1 moves dQ_i from shared memory to the global
 *     accumulator (and waits on / signals the semaphores); warps 2 and 3 only give their registers.
 *   Registers: a block's warps are spread round-robin over the SM's 4 sub-partitions, each holding a
 *   quarter of the register file (16,384), so a block of 12 warps may use at most 168 a thread, not
 *   65,536 / 384. Compiled at 168 (__launch_bounds__(384, 1)); the producer warpgroup drops to 24
 *   (setmaxnreg.dec), the consumers rise to 240: per SM sub-partition 2 x 240 + 24 = 3 x 168, the
 *   registers the block was launched with. The host checks the build really is at 168 (an .inc
 *   asking for more than the block holds would wait forever).
 *
 * Per query tile, a consumer warpgroup (w: its 64 keys; s = the ring stage of tile i):
 *   wait Q[s]; S^T (m64nBMk16 x HD/16, SS: A = K rows of w, B = Q[s], both K-major); commit
 *   wait dO[s]; dP^T (same, A = V rows, B = dO[s]); commit
 *   wait<1>: P^T from S^T (lse2 from shared memory), P^T -> bf16 A fragments;
 *     HD 128 only: dV += P^T dO[s] (m64nHDk16 x BM/16, RS, B = dO MN-major: imm-trans-b); commit
 *     (it runs during the next lines; at HD 64 the registers do not allow it: issued after the barrier)
 *   wait (dP^T done): dS^T from dP^T (D from shared memory) -> bf16 A fragments and -> dS[s] in shared
 *     memory; fence.proxy.async; named barrier 1 over both consumer warpgroups (dQ needs the other
 *     one's keys too)
 *   dQ_i = dS K (m64n64k16 x 8, SS, A = dS[s] MN-major: imm-trans-a, B = K MN-major); commit
 *   dK += dS^T Q[s] (RS, as dV); commit
 *   wait<2> (dV done): release dO[s]
 *   wait<1> (dQ done): dQ -> this warpgroup's staging half (after the dQ warp emptied it), signal
 *   wait<0> (dK done): release Q[s]
 * (FA3's order, but for dV's early issue; the tensor cores wait during the exponentials: both
 * warpgroups run the same phase.)
 *
 * Synchronisation. mbarriers: kvfull (TMA bytes of K and V), qfull[s] / dofull[s] (TMA bytes of Q /
 * dO and the bulk bytes of lse2 / D), qempty[s] / doempty[s] (NCONS = 256 arrivals: every consumer
 * thread, after the wgmmas that read the stage completed). A waiter on a barrier used for the u-th
 * time waits for parity u & 1. Named barriers: 1 (dS written, both consumer warpgroups: 256),
 * 2 + w (dQ staging half w full: warpgroup w arrives, the dQ warp syncs: 160), 4 + w (half w empty:
 * the dQ warp arrives, warpgroup w syncs). dS has 2 stages: the next tile's dS goes to the other
 * one, and by the tile after, both warpgroups have passed barrier 1 of the tile between, so their
 * dQ wgmmas of the old one are complete.
 *
 * Shared memory (base aligned to 1024 bytes, as the 128-byte swizzle needs; all TMA tiles in the
 * 128-byte swizzle, as HD/64 panels of 64 columns = 128-byte rows; see wgmma_util.cuh; but HD 96,
 * below):
 *   K, V            BN x HD bf16 each: panel p (columns 64p..) = 128 rows x 128 B (16 KiB)
 *   Q[2], dO[2]     BM x HD bf16 each: panel p = BM rows x 128 B (QPANEL = BM * 128)
 *   dS[2]           dS^T: BN key rows x BM queries bf16, as BM/64 panels of 128 rows x 128 B
 *                   (panel = 64 queries; a thread's two adjacent queries = one 4-byte store, chunk
 *                   c ^ (row & 7): conflict-free)
 *   dQ staging      2 halves (one per consumer warpgroup) of BM x HD / 2 fp32 in fragment order:
 *                   float4 r of consumer thread ct at (r * 128 + ct) * 16 bytes (conflict-free)
 *   lse2[2], D[2]   BM fp32 each
 * Descriptors (start, LBO, SBO; sw128_desc):
 *   S^T: A = K + (kk/4) KPANEL + w * 64 * 128 + (kk%4) * 32, (16, 1024); B = Q[s] + (kk/4) QPANEL +
 *        (kk%4) * 32, (16, 1024). dP^T: V and dO[s] alike.
 *   dV: B = dO[s] + kk * 2048 (queries 16kk.. as K), LBO = QPANEL (the next 64 head-dim columns),
 *       SBO = 1024. dK: Q[s] alike.
 *   dQ: A = dS[s] (+ w * 16 KiB for BM = 128: warpgroup w's queries) + kk * 2048 (keys 16kk.. as
 *       K), M = 64 queries = one swizzle width (LBO unused), SBO = 1024; B = K (+ w * KPANEL for
 *       BM = 64: warpgroup w's head-dim columns) + kk * 2048, N = 64 (LBO unused), SBO = 1024.
 *
 * HD 96 (FA3's atoms there; Cfg's KW, QW): 96 columns are no whole number of 128-byte rows, and dQ's
 * B operand of a consumer warpgroup (K, MN-major) starts at column 48 (BM = 64: the warpgroups split
 * dQ's head dim), which must be the start of a swizzle atom. So K and V are 6 panels of 16 columns
 * (32-byte rows, 32-byte swizzle, TMA box 16 columns; KPANEL = 128 x 32 B), Q and dO 3 panels of 32
 * columns (64-byte rows, 64-byte swizzle, box 32; QPANEL = 64 x 64 B); dS unchanged. Descriptors as
 * above with the row width W (sw_desc<W>): K-major k16 step kk at panel kk / (W / 32), + (kk %
 * (W / 32)) * 32 B, SBO = 8 W; MN-major slice kk at + kk * 16 W, SBO = 8 W, LBO = the panel. S^T,
 * dP^T: m64n64k16 x 6; dV, dK: m64n96k16 x 4 (B = dO / Q, 3 panels of 32 via LBO); dQ: m64n48k16 x 8
 * (B = K panels 3w .. 3w + 2 via LBO). dV is issued early as at HD 128. Shared memory 157,696 bytes
 * (K, V 24 KiB each, Q[2], dO[2] 12 KiB each, dS[2] 16 KiB each, dQ staging 2 x 12 KiB, lse2, D).
 * The preprocess runs 16 lanes a row (12 busy). Proven only by compiling (no spills, no serialized
 * wgmma) until gpu_test_attn_wgmma_bwd has run on a GPU.
 *
 * HD 256 (Cfg's SPLIT; BM = BN = 64, all panels 64 columns / 128-byte swizzle as at HD 128). dK and
 * dV of 128 keys x 256 would be 256 fp32 registers a consumer thread, so a block has BN = 64 keys and
 * both consumer warpgroups own all 64 (kloc = 16 warp + g, w-independent); they split
 *   S^T, dP^T along the queries: warpgroup w has queries wq = 32w .. 32w + 31: m64n32k16 x 16 (SS:
 *     A = K / V, all 4 panels, as above; B = Q[s] / dO[s] + 32w rows * 128 B = + 4 KiB, a whole number
 *     of 1024-byte swizzle patterns, so the same descriptors); 16 + 16 accumulator registers;
 *   dK, dV, dQ along the head dim: warpgroup w has columns wc = 128w .. 128w + 127 (64 registers
 *     each: dK + dV + dQ = 192 of the 240).
 * P^T therefore goes through shared memory too (each warpgroup has only half of it, dV needs all):
 * P[s] is laid out as dS[s] (64 key rows x 128 B, 128-byte swizzle; warpgroup w writes query chunks
 * 4w .. 4w + 3), then barrier BAR_P, then dV += P^T dO (m64n128k16 x 4, SS: A = P[s] K-major, + 32 B
 * per k16 step, SBO = 1024; B = dO[s] + 2w QPANEL MN-major, + 2048 per k16 step, LBO = QPANEL, SBO =
 * 1024, exactly HD 128's dV B), issued before dS^T is computed as HD 128's early dV. dK += dS^T Q the
 * same (A = dS[s] K-major, B = Q[s] + 2w QPANEL), dQ as at HD 128 with N = 128 (m64n128k16 x 4: A =
 * dS[s] MN-major, B = K + 2w KPANEL MN-major, LBO = KPANEL); FA3's hdim-256 tiles do the same (P and
 * dS in shared memory, SS dK / dV), but with dK / dV swapped (M = head dim) for kBlockN = 80; ours
 * keep the keys as M, so the epilogue is HD 128's at column offset wc. P[s], like dS[s], has 2 stages:
 * a warpgroup's wgmmas of tile n are complete (wait<0>) before it reaches a barrier of tile n + 1.
 * dQ has no shared-memory staging (no room): each consumer thread adds its 16 float4 straight to the
 * global accumulator (red.global.add.v4.f32) in the staging's order (so the postprocess is the same);
 * deterministic: the warpgroup's thread 0 waits (acquire) until the semaphore reaches 2 (J(i) - j)
 * (both warpgroups of every key tile before it in the order add 1), bar.sync of the warpgroup, the
 * adds (the first tile in the order stores), bar.sync, thread 0 adds 1 (release): CUTLASS's
 * semaphore pattern. The producer's dQ warp idles. Shared memory 231,424 bytes of the 232,448 a
 * block may have: K, V 32 KiB each, Q[2], dO[2] 32 KiB each (2 stages, 128 KiB), dS[2] and P[2] 8 KiB
 * each (32 KiB), lse2[2] and D[2] 256 B each (1 KiB), + 1 KiB for aligning the base (static: 80 B of
 * mbarriers). 168 registers (240 in the consumers), no spills, no serialized wgmma. The postprocess
 * takes a half (64 x 128 columns) a block (64 x 264 fp32 would pass 48 KiB of static shared memory).
 * Proven only by compiling until gpu_test_attn_wgmma_bwd has run on a GPU.
 *
 * Global dQ accumulator (workspace): per (bh, query tile) BM * HD fp32 in the staging's fragment
 * order (half w, then float4 r of thread ct), so each half is one contiguous bulk reduce-add; the
 * postprocess maps it back: element 4 (r * 128 + ct) + k of half w is (row 16 (ct / 32) + (ct % 32)
 * / 4 + 8 (k / 2), column 8r + 2 (ct % 4) + k % 2) of warpgroup w's m64 x 64 dQ.
 *
 * Order of the blocks: sections of swz (batch, head) pairs whose Q, dO and dQ accumulator fit in
 * ~40 MB of L2; inside a section key tile rank fastest over heads. Not deterministic: key tile 0
 * (the most query tiles) first. Deterministic: FA3's "shortest first": the last key tile first,
 * and the key tiles of query tile i add dQ_i in that same order (J(i), J(i) - 1, ..., 0, J(i) = the
 * diagonal key tile): the block a semaphore waits for has a lower index, so it was started earlier
 * (blocks start in index order) and is usually ahead (it has fewer query tiles before tile i). */
#include "attn_wgmma_bwd.h"
#include "wgmma_util.cuh"

#include <cuda_bf16.h>
#include <math.h>
#include <string.h>

#define NCONS 256     /* 2 consumer warpgroups (threads 0..255) */
#define NTHR 384      /* + the producer warpgroup (threads 256..383) */
#define KREGS 168     /* registers per thread at launch: __launch_bounds__(384, 1) */
#define PRODREGS 24   /* the producer warpgroup after setmaxnreg.dec */
#define CONSREGS 240  /* each consumer warpgroup after setmaxnreg.inc: 2 x 240 + 24 = 3 x 168 */
#define LOG2E_F 1.4426950408889634f
/* named barriers */
#define BAR_DS 1      /* dS written by both consumer warpgroups (256 threads) */
#define BAR_DQFULL 2  /* + w: staging half w written (warpgroup w arrives, the dQ warp syncs; 160) */
#define BAR_DQEMPTY 4 /* + w: staging half w read by the copy engine (the dQ warp arrives; 160) */
#define BAR_P 6       /* HD 256: P^T written by both consumer warpgroups (256) */
#define BAR_DQWG 7    /* + w, HD 256, deterministic: warpgroup w's turn on the semaphore (128) */

typedef __nv_bfloat16 bf16;

static constexpr __host__ __device__ int bm_of(int HD) { return HD == 64 ? 128 : 64; }
/* keys per block (FA3's kBlockN): 128, but 64 at HD 256 (dK and dV of 128 keys x 256 would take 256
 * registers a consumer thread; see the top) */
static constexpr __host__ __device__ int bn_of(int HD) { return HD == 256 ? 64 : 128; }

/* K and V (KW) and Q and dO (QW): bytes a row of one panel (TMA box) = their swizzle width. HD 64,
 * 128: 128 (panels of 64 columns). HD 96: K and V 32 (panels of 16 columns: each consumer warpgroup's
 * 48 columns of dQ's B operand, MN-major, are 3 whole panels), Q and dO 64 (32 columns: dV's and dK's
 * B operand, MN-major, N = 96 = 3 panels); FA3's shared-memory atoms at head_dim 96. */
static constexpr __host__ __device__ int kw_of(int HD) { return HD == 96 ? 32 : 128; }
static constexpr __host__ __device__ int qw_of(int HD) { return HD == 96 ? 64 : 128; }

template <int HD> struct Cfg {
    static constexpr int BM = bm_of(HD);                 /* queries per step */
    static constexpr int BN = bn_of(HD);                 /* keys per block */
    /* HD 256 (SPLIT): both consumer warpgroups own all BN = 64 keys; they split S^T and dP^T along the
     * queries (SN = BM / 2 each), dK, dV and dQ along the head dim (DKN = DQN = HD / 2 each); P^T goes
     * through shared memory (P), dQ from registers straight to the global accumulator (no staging) */
    static constexpr bool SPLIT = HD == 256;
    static constexpr int SN = SPLIT ? BM / 2 : BM;       /* N of a warpgroup's S^T, dP^T */
    static constexpr int DKN = SPLIT ? HD / 2 : HD;      /* head-dim columns of a warpgroup's dK, dV */
    static constexpr int KW = kw_of(HD), QW = qw_of(HD); /* row bytes of a K / V, Q / dO panel */
    static constexpr int KCOLS = KW / 2, QCOLS = QW / 2; /* columns of a panel */
    static constexpr uint32_t KPANEL = BN * KW;          /* one panel of K or V */
    static constexpr uint32_t KVT = BN * HD * 2;         /* K or V tile */
    static constexpr uint32_t QPANEL = BM * QW;          /* one panel of Q or dO */
    static constexpr uint32_t QT = BM * HD * 2;          /* Q or dO tile */
    static constexpr uint32_t DSPANEL = BN * 128;        /* 64 queries of dS^T */
    static constexpr uint32_t DST = BN * BM * 2;         /* dS^T tile */
    static constexpr uint32_t PT = SPLIT ? DST : 0;      /* P^T tile (HD 256 only) */
    static constexpr int DQN = BM == 64 ? HD / 2 : HD;   /* N of a warpgroup's dQ GEMM (M = 64) */
    static constexpr uint32_t DQW = SPLIT ? 0 : 64 * DQN * 4; /* a staging half (fp32; none at HD 256) */
    static constexpr uint32_t OFF_K = 0, OFF_V = KVT, OFF_Q = 2 * KVT, OFF_DO = OFF_Q + 2 * QT;
    static constexpr uint32_t OFF_DS = OFF_DO + 2 * QT, OFF_P = OFF_DS + 2 * DST, OFF_DQ = OFF_P + 2 * PT;
    static constexpr uint32_t OFF_LSE = OFF_DQ + 2 * DQW, OFF_D = OFF_LSE + 2 * BM * 4;
    static constexpr size_t SMEM = OFF_D + 2 * BM * 4 + 1024; /* + alignment of the base */
    static_assert(DQN % KCOLS == 0, "a warpgroup's dQ columns are whole panels of K (MN-major B)");
    static_assert(HD % QCOLS == 0 && HD % KCOLS == 0 && DQN % 8 == 0, "whole panels");
    static_assert(KVT % 1024 == 0 && OFF_DS % 1024 == 0 && OFF_Q % 1024 == 0 && OFF_DO % 1024 == 0 && QT % 1024 == 0 &&
                      OFF_P % 1024 == 0,
                  "swizzle patterns aligned");
    static_assert(SPLIT || DQW * 2 == (uint32_t)BM * HD * 4, "two staging halves hold a dQ tile");
    static_assert(!SPLIT || (BM == 64 && BN == 64 && KW == 128 && QW == 128 && SN == 32 && DKN == DQN),
                  "HD 256's layout (see the top)");
    static_assert(SMEM <= 232448 - 128, "227 KiB of shared memory a block (H100), less the static barriers");
};

/* RoPE's backward on one interleaved pair: (x0, x1) -> (x0 c + x1 sn, -x0 sn + x1 c), each product
 * and sum rounded separately, as rope8_kernel (dir = -1), the CPU backend and attn_bf16.cu compute it */
static __device__ __forceinline__ void rope_back(float &x0, float &x1, float c, float sn) {
    const float s = -sn, a = x0, b = x1;
    x0 = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    x1 = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
}

/* ------------------------------------------------------------------------------------------- */
/* 1. preprocess                                                                                */

/* Row r of the padded [BH, nqp] arrays: D = sum dO * O and lse2 = lse log2(e) for t < T; D = 0 and
 * lse2 = +inf past T. pre_lanes(HD) consecutive threads per row (a power of 2, for the shuffles), 16
 * bytes of dO and O each: HD / 8, or with PAD16 (HD 96) 16, of which the last 16 - HD / 8 add 0. */
static constexpr __host__ __device__ int pre_lanes(int HD) { return HD == 96 ? 16 : HD / 8; }
template <bool PAD16>
__global__ void attn_wgmma_bwd_pre(float *__restrict__ lse2, float *__restrict__ Dw, const bf16 *__restrict__ dout,
                                   const bf16 *__restrict__ out, const float *__restrict__ lse, int T, int NH,
                                   int HD, int nqp, size_t rows) {
    const int per = PAD16 ? 16 : HD / 8;
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x, row = i / per;
    const int c = (int)(i % per);
    const size_t bh = row / (size_t)nqp;
    const int t = (int)(row % (size_t)nqp);
    const bool ok = row < rows && t < T && (!PAD16 || c < HD / 8);
    float acc = 0.f;
    if (ok) {
        const size_t b = bh / NH, h = bh % NH, C = (size_t)NH * HD;
        const size_t off = (b * T + t) * C + h * HD + (size_t)c * 8;
        const uint4 a = *(const uint4 *)(dout + off), o = *(const uint4 *)(out + off);
        acc = __uint_as_float(a.x << 16) * __uint_as_float(o.x << 16) +
              __uint_as_float(a.x & 0xffff0000u) * __uint_as_float(o.x & 0xffff0000u) +
              __uint_as_float(a.y << 16) * __uint_as_float(o.y << 16) +
              __uint_as_float(a.y & 0xffff0000u) * __uint_as_float(o.y & 0xffff0000u) +
              __uint_as_float(a.z << 16) * __uint_as_float(o.z << 16) +
              __uint_as_float(a.z & 0xffff0000u) * __uint_as_float(o.z & 0xffff0000u) +
              __uint_as_float(a.w << 16) * __uint_as_float(o.w << 16) +
              __uint_as_float(a.w & 0xffff0000u) * __uint_as_float(o.w & 0xffff0000u);
    }
    for (int off = per / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (row < rows && c == 0) {
        Dw[row] = ok ? acc : 0.f;
        lse2[row] = ok ? lse[bh * (size_t)T + t] * LOG2E_F : INFINITY;
    }
}

/* ------------------------------------------------------------------------------------------- */
/* 2. main kernel                                                                               */

/* block x -> key tile j and (batch, head) bh (see the top: sections of swz heads, key tile rank
 * fastest over the heads of a section; rank 0 = key tile 0, or with det the last key tile) */
static __device__ __forceinline__ void block_coords(int x, int nkv, int BH, int swz, int det, int &j, int &bh) {
    const int per = swz * nkv, sec = x / per, in = x % per;
    const int nh = sec < BH / swz ? swz : BH % swz;
    const int rank = in / nh;
    j = det ? nkv - 1 - rank : rank;
    bh = sec * swz + in % nh;
}

#ifdef WGU_DEVICE
/* acc = a b^T for one consumer warpgroup (M = 64 key rows of K or V at a, N = SN query rows of Q or
 * dO at b, K = HD; both K-major in panels), fenced and committed: S^T and dP^T */
template <int HD>
static __device__ __forceinline__ void issue_rows_cols(float (&acc)[Cfg<HD>::SN / 2], uint32_t a, uint32_t b) {
    typedef Cfg<HD> K_;
    wgu::fence_regs(acc);
    wgu::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
        constexpr int KS = K_::KW / 32, QS = K_::QW / 32; /* k16 steps a panel row */
        const uint32_t ko = (uint32_t)(kk / KS) * K_::KPANEL + (uint32_t)(kk % KS) * 32u;
        const uint32_t qo = (uint32_t)(kk / QS) * K_::QPANEL + (uint32_t)(kk % QS) * 32u;
        wgu::Mma<K_::SN>::template ss<0, 0>(acc, wgu::sw_desc<K_::KW>(a + ko, 16, 8 * K_::KW),
                                            wgu::sw_desc<K_::QW>(b + qo, 16, 8 * K_::QW), kk > 0);
    }
    wgu::wgmma_commit();
}

/* dV += P^T dO (M = 64 keys, N = HD, K = BM queries; P^T from registers, dO at dos MN-major),
 * fenced and committed */
template <int HD>
static __device__ __forceinline__ void issue_dv(float (&dv)[HD / 2], const uint32_t (&pa)[Cfg<HD>::BM / 16][4],
                                                uint32_t dos) {
    wgu::fence_regs(dv);
    wgu::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Cfg<HD>::BM / 16; kk++)
        wgu::Mma<HD>::template rs<1>(dv, pa[kk],
                                     wgu::sw_desc<Cfg<HD>::QW>(dos + (uint32_t)kk * 16u * Cfg<HD>::QW, Cfg<HD>::QPANEL,
                                                               8 * Cfg<HD>::QW),
                                     1);
    wgu::wgmma_commit();
}

/* HD 256: acc += a b for one consumer warpgroup (M = 64 keys, N = 128 head-dim columns, K = BM = 64
 * queries), fenced and committed: dV (a = P^T[s], b = dO[s] + 2w panels) and dK (dS^T[s], Q[s]).
 * A: P^T / dS^T, 64 key rows of 128 B (64 queries), 128-byte swizzle, K-major: k16 step kk at
 * + 32 kk, SBO = 1024 (the next 8 keys). B: MN-major (imm-trans-b), the layout dV's B has at HD 128:
 * k16 slice kk = queries 16kk.. at + kk * 2048, SBO = 1024 (the next 8 queries), LBO = QPANEL (the
 * next 64 head-dim columns: N = 128 spans two panels). */
template <int HD>
static __device__ __forceinline__ void issue_kv_ss(float (&d)[Cfg<HD>::DKN / 2], uint32_t a, uint32_t b) {
    typedef Cfg<HD> K_;
    static_assert(K_::SPLIT && K_::DKN == 128, "HD 256 only");
    wgu::fence_regs(d);
    wgu::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < K_::BM / 16; kk++)
        wgu::Mma<128>::template ss<0, 1>(d, wgu::sw128_desc(a + (uint32_t)kk * 32u, 16, 1024),
                                         wgu::sw128_desc(b + (uint32_t)kk * 2048u, K_::QPANEL, 1024), 1);
    wgu::wgmma_commit();
}

/* HD 256: dQ (one float4 of the fragment, see the top's accumulator order) -> the global accumulator:
 * added (red.global.add.v4.f32), or stored by the first key tile in the deterministic order */
static __device__ __forceinline__ void dq_out(float *g, float a, float b, float c, float d, bool store) {
    if (store) *(float4 *)g = make_float4(a, b, c, d);
    else atomicAdd((float4 *)g, make_float4(a, b, c, d));
}
#endif

/* ROPE: dK is rotated back by the tables rc / rs (RoPE's backward) before its rounding; the
 * parameters are last so that the no-RoPE instantiation reads the others where it always did */
template <int HD, bool ROPE>
__global__ void __launch_bounds__(NTHR, 1)
    attn_wgmma_bwd_kernel(const __grid_constant__ CUtensorMap tmq, const __grid_constant__ CUtensorMap tmkv,
                          const __grid_constant__ CUtensorMap tmdo, bf16 *__restrict__ dqkv,
                          float *__restrict__ dqacc, const float *__restrict__ lse2, const float *__restrict__ Dw,
                          int *__restrict__ sem, int T, int NH, int BH, int nkv, int nq, int swz, int det, int acc,
                          float scale2, float scale, const float *__restrict__ rc, const float *__restrict__ rs) {
#ifdef WGU_DEVICE
    using namespace wgu;
    typedef Cfg<HD> K_;
    constexpr int BM = K_::BM, BN = K_::BN;
    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) uint64_t bars[9];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t kvfull = smem_u32(&bars[0]);
#define QFULL(s) (kvfull + 8u * (1u + (uint32_t)(s)))
#define DOFULL(s) (kvfull + 8u * (3u + (uint32_t)(s)))
#define QEMPTY(s) (kvfull + 8u * (5u + (uint32_t)(s)))
#define DOEMPTY(s) (kvfull + 8u * (7u + (uint32_t)(s)))

    int j, bh;
    block_coords((int)blockIdx.x, nkv, BH, swz, det, j, bh);
    const int b = bh / NH, h = bh % NH, C = NH * HD;
    const int i0 = j * BN / BM, nsteps = nq - i0; /* query tiles i0 (the diagonal) .. nq - 1 */

    if (threadIdx.x == 0) {
        mbar_init(kvfull, 1);
        for (int s = 0; s < 2; s++) {
            mbar_init(QFULL(s), 1), mbar_init(DOFULL(s), 1);
            mbar_init(QEMPTY(s), NCONS), mbar_init(DOEMPTY(s), NCONS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        fence_async_shared();
    }
    __syncthreads();

    /* the warpgroup, warp-uniform (setmaxnreg is per warpgroup) */
    const int wg = __shfl_sync(0xffffffffu, (int)(threadIdx.x / 128u), 0);
    if (wg == 2) { /* ---------------- producer warpgroup ---------------- */
        setmaxnreg_dec<PRODREGS>();
        const int warp = ((int)threadIdx.x >> 5) & 3, lane = (int)threadIdx.x & 31;
        if (warp == 0 && lane == 0) { /* TMA loads */
            asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&tmq) : "memory");
            asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&tmkv) : "memory");
            asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&tmdo) : "memory");
            mbar_expect_tx(kvfull, 2 * K_::KVT);
#pragma unroll
            for (int p = 0; p < HD / K_::KCOLS; p++) {
                tma_load(base + K_::OFF_K + p * K_::KPANEL, &tmkv, C + h * HD + K_::KCOLS * p, j * BN, b, kvfull);
                tma_load(base + K_::OFF_V + p * K_::KPANEL, &tmkv, 2 * C + h * HD + K_::KCOLS * p, j * BN, b, kvfull);
            }
            const float *l2 = lse2 + (size_t)bh * nq * BM, *d2 = Dw + (size_t)bh * nq * BM;
            for (int n = 0; n < nsteps; n++) {
                const int i = i0 + n, s = n & 1;
                if (n >= 2) mbar_wait(QEMPTY(s), (uint32_t)(((n >> 1) - 1) & 1));
                mbar_expect_tx(QFULL(s), K_::QT + BM * 4);
#pragma unroll
                for (int p = 0; p < HD / K_::QCOLS; p++)
                    tma_load(base + K_::OFF_Q + s * K_::QT + p * K_::QPANEL, &tmq, h * HD + K_::QCOLS * p, i * BM, b,
                             QFULL(s));
                bulk_load(base + K_::OFF_LSE + s * BM * 4, l2 + (size_t)i * BM, BM * 4, QFULL(s));
                if (n >= 2) mbar_wait(DOEMPTY(s), (uint32_t)(((n >> 1) - 1) & 1));
                mbar_expect_tx(DOFULL(s), K_::QT + BM * 4);
#pragma unroll
                for (int p = 0; p < HD / K_::QCOLS; p++)
                    tma_load(base + K_::OFF_DO + s * K_::QT + p * K_::QPANEL, &tmdo, h * HD + K_::QCOLS * p, i * BM, b,
                             DOFULL(s));
                bulk_load(base + K_::OFF_D + s * BM * 4, d2 + (size_t)i * BM, BM * 4, DOFULL(s));
            }
        } else if (!K_::SPLIT && warp == 1) { /* dQ: staging -> global accumulator (reduce-add by the copy engine) */
            named_arrive<BAR_DQEMPTY + 0, 160>(); /* both staging halves start empty */
            named_arrive<BAR_DQEMPTY + 1, 160>();
            for (int n = 0; n < nsteps; n++) {
                const int i = i0 + n;
                float *g = dqacc + ((size_t)bh * nq + i) * (size_t)(BM * HD);
                int *sm = sem + (size_t)bh * nq + i;
                /* deterministic: the first in the order (the diagonal key tile J(i) = i * BM / BN) stores,
                 * the others add (the accumulator is not zeroed in this mode) */
                const bool first = det && j == i * BM / BN;
                if (det) { /* my turn: the key tiles J(i) .. j + 1 have added theirs */
                    if (lane == 0) {
                        sem_wait_eq(sm, i * BM / BN - j);
                        fence_async_global();
                    }
                    __syncwarp();
                }
                named_sync<BAR_DQFULL + 0, 160>();
                if (lane == 0) {
                    if (first) bulk_store(g, base + K_::OFF_DQ, K_::DQW);
                    else bulk_reduce_add_f32(g, base + K_::OFF_DQ, K_::DQW);
                    bulk_commit();
                }
                named_sync<BAR_DQFULL + 1, 160>();
                if (lane == 0) {
                    if (first) bulk_store(g + K_::DQW / 4, base + K_::OFF_DQ + K_::DQW, K_::DQW);
                    else bulk_reduce_add_f32(g + K_::DQW / 4, base + K_::OFF_DQ + K_::DQW, K_::DQW);
                    bulk_commit();
                    if (det) { /* the adds are done (in L2) before the next key tile may start its own */
                        bulk_wait<0>();
                        fence_async_global();
                        red_release_add(sm, 1);
                    } else {
                        bulk_wait_read<0>();
                    }
                }
                __syncwarp();
                if (n + 1 < nsteps) { /* the halves may be overwritten (not after the last tile) */
                    named_arrive<BAR_DQEMPTY + 0, 160>();
                    named_arrive<BAR_DQEMPTY + 1, 160>();
                }
            }
            if (lane == 0) bulk_wait<0>(); /* all reduce-adds complete before the block ends */
            __syncwarp();
        }
    } else { /* ---------------- consumer warpgroups ---------------- */
        setmaxnreg_inc<CONSREGS>();
        const int ct = (int)threadIdx.x, w = ct >> 7, warp = (ct >> 5) & 3, lane = ct & 31;
        const int g = lane >> 2, t = lane & 3;
        const int wt = ct & 127;                              /* thread in the warpgroup */
        /* SPLIT (HD 256): both warpgroups have all 64 keys; warpgroup w has queries wq.. wq + 31 of S^T
         * and dP^T and head-dim columns wc.. wc + 127 of dK, dV, dQ */
        const int wk = K_::SPLIT ? 0 : w * 64, wq = K_::SPLIT ? w * K_::SN : 0, wc = K_::SPLIT ? w * K_::DKN : 0;
        const int kloc = wk + warp * 16 + g;                  /* this thread's key rows: kloc, kloc + 8 */
        const int key0 = j * BN + kloc;                       /* as token indices */
        const uint32_t kA = base + K_::OFF_K + (uint32_t)wk * K_::KW; /* warpgroup w's K rows */
        const uint32_t vA = base + K_::OFF_V + (uint32_t)wk * K_::KW;
        float dk[K_::DKN / 2], dv[K_::DKN / 2];
#pragma unroll
        for (int q = 0; q < K_::DKN / 2; q++) dk[q] = 0.f, dv[q] = 0.f;
        mbar_wait(kvfull, 0u);
        __syncwarp();

        for (int n = 0; n < nsteps; n++) {
            const int i = i0 + n, s = n & 1;
            const uint32_t ph = (uint32_t)((n >> 1) & 1);
            const uint32_t qs = base + K_::OFF_Q + (uint32_t)s * K_::QT, dos = base + K_::OFF_DO + (uint32_t)s * K_::QT;
            const uint32_t dss = base + K_::OFF_DS + (uint32_t)s * K_::DST;
            const uint32_t lses = base + K_::OFF_LSE + (uint32_t)(s * BM + wq) * 4u;
            const uint32_t ds_ = base + K_::OFF_D + (uint32_t)(s * BM + wq) * 4u;
            float sa[K_::SN / 2], dp[K_::SN / 2];

            /* S^T = K_w Q^T and dP^T = V_w dO^T (M = 64 keys, N = SN queries, K = HD; SPLIT: the B rows
             * start at query wq = 32w, + 32w rows of 128 B = 4 KiB: whole 1024-byte swizzle patterns) */
            mbar_wait(QFULL(s), ph);
            __syncwarp();
            issue_rows_cols<HD>(sa, kA, qs + (uint32_t)wq * K_::QW);
            mbar_wait(DOFULL(s), ph);
            __syncwarp();
            issue_rows_cols<HD>(dp, vA, dos + (uint32_t)wq * K_::QW);

            /* P^T = exp2(S^T scale2 - lse2[query]); element (key key0 + 8h, query i*BM + 8c + 2t + e) */
            wgmma_wait<1>();
            fence_regs(sa);
            const bool need_mask = i * BM < (j + 1) * BN; /* some key of the tile can pass some query */
            const int qb = i * BM + wq + 2 * t;
#pragma unroll
            for (int c = 0; c < K_::SN / 8; c++) {
                const float2 l2 = ld_shared_f2(lses + (uint32_t)(8 * c + 2 * t) * 4u);
#pragma unroll
                for (int hh = 0; hh < 2; hh++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int x = 4 * c + 2 * hh + e;
                        float p = sfu_ex2(fmaf(sa[x], scale2, -(e ? l2.y : l2.x)));
                        if (need_mask && key0 + 8 * hh > qb + 8 * c + e) p = 0.f;
                        sa[x] = p;
                    }
            }
            /* P^T as bf16 A fragments (k16 slice kk = queries 16kk..16kk+15). At HD 128, dV += P^T dO
             * (M = 64 keys, N = HD, K = BM queries; B = dO MN-major) is issued at once, to run while
             * dS is computed and written; at HD 64 (BM = 128: S^T and dP^T take 128 registers) that
             * leaves too few registers (ptxas serializes the wgmmas), so it waits for the barrier. */
            constexpr bool EARLY_DV = HD != 64;
            uint32_t pa[K_::SN / 16][4], da[K_::SN / 16][4];
            if constexpr (K_::SPLIT) {
                /* HD 256: P^T (this warpgroup's 32 queries) -> P[s] (as dS^T -> dS[s] below), both
                 * warpgroups' halves visible (fence, barrier), then dV += P^T dO (SS: the whole P^T, 64
                 * keys x 64 queries, against dO's head-dim columns wc..: panels 2w, 2w + 1) */
                const uint32_t pts = base + K_::OFF_P + (uint32_t)s * K_::PT;
#pragma unroll
                for (int kk = 0; kk < K_::SN / 16; kk++)
#pragma unroll
                    for (int q = 0; q < 4; q++) {
                        pa[kk][q] = pack_bf16(sa[8 * kk + 2 * q], sa[8 * kk + 2 * q + 1]);
                        const int c = wq / 8 + 2 * kk + (q >> 1);
                        st_shared_u32(pts + (uint32_t)(kloc + 8 * (q & 1)) * 128u + (uint32_t)((c ^ g) << 4) + 4u * (uint32_t)t,
                                      pa[kk][q]);
                    }
                fence_async_shared();
                named_sync<BAR_P, NCONS>();
                issue_kv_ss<HD>(dv, pts, dos + (uint32_t)w * 2u * K_::QPANEL);
                wgmma_wait<1>(); /* dP^T done (dV may still run) */
            } else if constexpr (EARLY_DV) {
#pragma unroll
                for (int kk = 0; kk < BM / 16; kk++)
#pragma unroll
                    for (int q = 0; q < 4; q++) pa[kk][q] = pack_bf16(sa[8 * kk + 2 * q], sa[8 * kk + 2 * q + 1]);
                issue_dv<HD>(dv, pa, dos);
                wgmma_wait<1>(); /* dP^T done (dV may still run) */
            } else {
                wgmma_wait<0>(); /* dP^T done */
            }
            /* dS^T = P^T (dP^T - D[query]) (P^T in fp32) */
            fence_regs(dp);
#pragma unroll
            for (int c = 0; c < K_::SN / 8; c++) {
                const float2 dd = ld_shared_f2(ds_ + (uint32_t)(8 * c + 2 * t) * 4u);
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    dp[4 * c + 2 * hh] = sa[4 * c + 2 * hh] * (dp[4 * c + 2 * hh] - dd.x);
                    dp[4 * c + 2 * hh + 1] = sa[4 * c + 2 * hh + 1] * (dp[4 * c + 2 * hh + 1] - dd.y);
                }
            }
#pragma unroll
            for (int kk = 0; kk < K_::SN / 16; kk++)
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    if constexpr (!EARLY_DV) pa[kk][q] = pack_bf16(sa[8 * kk + 2 * q], sa[8 * kk + 2 * q + 1]);
                    da[kk][q] = pack_bf16(dp[8 * kk + 2 * q], dp[8 * kk + 2 * q + 1]);
                }
            /* dS^T -> dS[s]: da[kk][q] holds (key row kloc + 8 (q & 1), queries 16kk + 8 (q >> 1) + 2t, +1):
             * query chunk c = 2kk + (q >> 1) of panel c / 8, at chunk position (c % 8) ^ g (kloc & 7 = g);
             * SPLIT: queries wq + 16kk + ..: chunk wq / 8 + 2kk + (q >> 1), one panel (BM = 64) */
#pragma unroll
            for (int kk = 0; kk < K_::SN / 16; kk++)
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const int c = wq / 8 + 2 * kk + (q >> 1);
                    st_shared_u32(dss + (uint32_t)(c / 8) * K_::DSPANEL + (uint32_t)(kloc + 8 * (q & 1)) * 128u +
                                      (uint32_t)(((c % 8) ^ g) << 4) + 4u * (uint32_t)t,
                                  da[kk][q]);
                }
            fence_async_shared();
            named_sync<BAR_DS, NCONS>();

            if constexpr (!EARLY_DV) issue_dv<HD>(dv, pa, dos); /* (see above) */
            /* dQ_i = dS K (M = 64 queries, N = 64 head-dim columns, K = 128 keys; A = dS MN-major,
             * B = K MN-major), then dK += dS^T Q (B = Q MN-major) */
            float dq[K_::DQN / 2];
            const uint32_t dsA = BM == 64 ? dss : dss + (uint32_t)w * K_::DSPANEL;
            const uint32_t kB = BM == 64 ? base + K_::OFF_K + (uint32_t)w * (K_::DQN / K_::KCOLS) * K_::KPANEL
                                         : base + K_::OFF_K;
            fence_regs(dk);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++)
                Mma<K_::DQN>::template ss<1, 1>(dq, sw128_desc(dsA + (uint32_t)kk * 2048u, K_::DSPANEL, 1024),
                                                sw_desc<K_::KW>(kB + (uint32_t)kk * 16u * K_::KW, K_::KPANEL, 8 * K_::KW),
                                                kk > 0);
            wgmma_commit();
            if constexpr (K_::SPLIT) { /* dK += dS^T Q (SS, as dV; Q's head-dim panels 2w, 2w + 1) */
                issue_kv_ss<HD>(dk, dss, qs + (uint32_t)w * 2u * K_::QPANEL);
            } else {
#pragma unroll
                for (int kk = 0; kk < BM / 16; kk++)
                    Mma<HD>::template rs<1>(dk, da[kk],
                                            sw_desc<K_::QW>(qs + (uint32_t)kk * 16u * K_::QW, K_::QPANEL, 8 * K_::QW), 1);
                wgmma_commit();
            }
            wgmma_wait<2>(); /* dV done: dO[s] is free */
            fence_regs(dv);
            mbar_arrive(DOEMPTY(s));
            wgmma_wait<1>(); /* dQ done */
            fence_regs(dq);
            if constexpr (K_::SPLIT) {
                /* HD 256: dQ from registers to the global accumulator, in the staging's fragment order
                 * (float4 r of thread wt of half w at (r * 128 + wt) * 4 floats of half w: the layout
                 * the postprocess reads); deterministic: after the key tiles J(i) .. j + 1 (each counts
                 * 2 on the semaphore, one per warpgroup), the first in the order storing */
                float *gq = dqacc + ((size_t)bh * nq + i) * (size_t)(BM * HD) + (size_t)w * (64 * K_::DQN) + (size_t)wt * 4;
                int *sm = sem + (size_t)bh * nq + i;
                const bool first = det && j == i * BM / BN;
                if (det) { /* my turn: leader's acquire, then the warpgroup follows */
                    if (wt == 0) sem_wait_ge(sm, 2 * (i * BM / BN - j));
                    __syncwarp(); /* (converged again for the aligned bar.sync) */
                    if (w == 0) named_sync<BAR_DQWG + 0, 128>();
                    else named_sync<BAR_DQWG + 1, 128>();
                }
#pragma unroll
                for (int r = 0; r < K_::DQN / 8; r++)
                    dq_out(gq + r * 512, dq[4 * r], dq[4 * r + 1], dq[4 * r + 2], dq[4 * r + 3], first);
                if (det) { /* all the warpgroup's adds, then the leader's release (CUTLASS's semaphore) */
                    if (w == 0) named_sync<BAR_DQWG + 0, 128>();
                    else named_sync<BAR_DQWG + 1, 128>();
                    if (wt == 0) red_release_add(sm, 1);
                    __syncwarp(); /* (converged again for the aligned wgmma.wait_group) */
                }
            } else {
                /* dQ -> staging half w (fragment order), for the dQ warp */
                if (w == 0) named_sync<BAR_DQEMPTY + 0, 160>();
                else named_sync<BAR_DQEMPTY + 1, 160>();
                {
                    const uint32_t st = base + K_::OFF_DQ + (uint32_t)w * K_::DQW + (uint32_t)wt * 16u;
#pragma unroll
                    for (int r = 0; r < K_::DQN / 8; r++)
                        st_shared_v4(st + (uint32_t)r * 2048u, dq[4 * r], dq[4 * r + 1], dq[4 * r + 2], dq[4 * r + 3]);
                }
                fence_async_shared();
                if (w == 0) named_arrive<BAR_DQFULL + 0, 160>();
                else named_arrive<BAR_DQFULL + 1, 160>();
            }
            wgmma_wait<0>(); /* dK done: Q[s] is free */
            fence_regs(dk);
            mbar_arrive(QEMPTY(s));
        }

        /* epilogue: dK (times scale) and dV, rows (keys) < T, from registers: row key0 + 8hh,
         * columns 8c + 2t, +1 (with ROPE: RoPE pair 4c + t of position row, rotated back) */
        const size_t ld = 3 * (size_t)C;
        bf16 *gk = dqkv + (size_t)b * T * ld + C + (size_t)h * HD + wc, *gv = gk + C; /* SPLIT: columns wc.. */
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int row = key0 + 8 * hh;
            if (row < T) {
                uint32_t *pk = (uint32_t *)(gk + (size_t)row * ld + 2 * t), *pv = (uint32_t *)(gv + (size_t)row * ld + 2 * t);
#pragma unroll
                for (int c = 0; c < K_::DKN / 8; c++) {
                    float k0 = dk[4 * c + 2 * hh] * scale, k1 = dk[4 * c + 2 * hh + 1] * scale;
                    float v0 = dv[4 * c + 2 * hh], v1 = dv[4 * c + 2 * hh + 1];
                    if constexpr (ROPE) {
                        const size_t e = (size_t)row * (HD / 2) + wc / 2 + 4 * c + t;
                        rope_back(k0, k1, __ldg(rc + e), __ldg(rs + e));
                    }
                    if (!ROPE && acc) { /* (the host refuses RoPE with acc) */
                        const uint32_t ok = pk[4 * c], ov = pv[4 * c];
                        k0 += bf16_lo(ok), k1 += bf16_hi(ok), v0 += bf16_lo(ov), v1 += bf16_hi(ov);
                    }
                    pk[4 * c] = pack_bf16(k0, k1);
                    pv[4 * c] = pack_bf16(v0, v1);
                }
            }
        }
    }
#undef QFULL
#undef DOFULL
#undef QEMPTY
#undef DOEMPTY
#else
    (void)tmq, (void)tmkv, (void)tmdo, (void)dqkv, (void)dqacc, (void)lse2, (void)Dw, (void)sem, (void)T, (void)NH;
    (void)BH, (void)nkv, (void)nq, (void)swz, (void)det, (void)acc, (void)scale2, (void)scale, (void)rc, (void)rs;
    __trap(); /* built for a target without wgmma */
#endif
}

/* ------------------------------------------------------------------------------------------- */
/* 3. postprocess                                                                               */

/* One block (256 threads) per (query tile, bh): the tile's BM x HD fp32 accumulator (fragment order,
 * see the top) -> a row-major tile in shared memory (row stride HD + 8 floats: the float2 stores of a
 * half warp hit distinct banks) -> times scale, (ROPE: rotated back by rc / rs, 16-byte aligned),
 * (+ old), bf16, 16-byte stores of rows < T. HD 256: one block per half (PARTS = 2: block x = 2 (tile
 * index) + w, head-dim columns 128w..; the half is warpgroup w's contiguous part of the accumulator),
 * as the whole 64 x 264 fp32 tile would pass 48 KiB of static shared memory. */
template <int HD, bool ROPE>
__global__ void __launch_bounds__(256) attn_wgmma_bwd_post(bf16 *__restrict__ dqkv, const float *__restrict__ dqacc,
                                                           int T, int NH, int nq, float scale, int acc,
                                                           const float *__restrict__ rc, const float *__restrict__ rs) {
    constexpr int PARTS = HD == 256 ? 2 : 1, PW = HD / PARTS; /* columns a block */
    constexpr int BM = bm_of(HD), SS = PW + 8, HALF = BM * HD / 2;
    static_assert(PARTS == 1 || (BM == 64 && PW == HD / 2), "a part is a half");
    __shared__ __align__(16) float tile[BM * SS];
    const unsigned x = PARTS == 1 ? blockIdx.x : blockIdx.x / PARTS;
    const int part = PARTS == 1 ? 0 : (int)(blockIdx.x % PARTS);
    const int i = (int)(x % (unsigned)nq), bh = (int)(x / (unsigned)nq);
    const int b = bh / NH, h = bh % NH, C = NH * HD;
    const float4 *src = (const float4 *)(dqacc + ((size_t)bh * nq + i) * (size_t)(BM * HD) + (size_t)part * HALF);
    for (int f = (int)threadIdx.x; f < BM * PW / 4; f += 256) {
        const float4 v = src[f];
        const int e = 4 * f, w = e / HALF, rem = e % HALF, r = rem / 512, ct = (rem / 4) % 128;
        int row = 16 * (ct >> 5) + ((ct & 31) >> 2), col = 8 * r + 2 * (ct & 3);
        if (BM == 64) col += w * (HD / 2); /* (PARTS 2: w = 0, the part's own columns) */
        else row += 64 * w;
        *(float2 *)&tile[row * SS + col] = make_float2(v.x, v.y);
        *(float2 *)&tile[(row + 8) * SS + col] = make_float2(v.z, v.w);
    }
    __syncthreads();
    const size_t ld = 3 * (size_t)C;
    for (int idx = (int)threadIdx.x; idx < BM * PW / 8; idx += 256) {
        const int row = idx / (PW / 8), c = part * (PW / 8) + idx % (PW / 8), trow = i * BM + row;
        if (trow >= T) continue;
        const int tc = 8 * (c - part * (PW / 8)); /* the column in the tile */
        const float4 x0 = *(const float4 *)&tile[row * SS + tc], x1 = *(const float4 *)&tile[row * SS + tc + 4];
        float y[8] = {x0.x * scale, x0.y * scale, x0.z * scale, x0.w * scale,
                      x1.x * scale, x1.y * scale, x1.z * scale, x1.w * scale};
        uint4 *p = (uint4 *)(dqkv + ((size_t)b * T + trow) * ld + (size_t)h * HD + 8 * c);
        if constexpr (ROPE) { /* pairs 4c .. 4c + 3 of position trow */
            const size_t e = (size_t)trow * (HD / 2) + 4 * c;
            const float4 c4 = __ldg((const float4 *)(rc + e)), s4 = __ldg((const float4 *)(rs + e));
            rope_back(y[0], y[1], c4.x, s4.x), rope_back(y[2], y[3], c4.y, s4.y);
            rope_back(y[4], y[5], c4.z, s4.z), rope_back(y[6], y[7], c4.w, s4.w);
        }
        if (!ROPE && acc) { /* (the host refuses RoPE with acc) */
            const uint4 o = *p;
            const uint32_t ow[4] = {o.x, o.y, o.z, o.w};
#pragma unroll
            for (int k = 0; k < 4; k++)
                y[2 * k] += __uint_as_float(ow[k] << 16), y[2 * k + 1] += __uint_as_float(ow[k] & 0xffff0000u);
        }
        uint32_t wv[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const __nv_bfloat162 v2 = __floats2bfloat162_rn(y[2 * k], y[2 * k + 1]);
            memcpy(&wv[k], &v2, 4);
        }
        *p = make_uint4(wv[0], wv[1], wv[2], wv[3]);
    }
}

/* ------------------------------------------------------------------------------------------- */
/* host side                                                                                    */

static void wb_die(const char *what, const char *why) {
    fprintf(stderr, "meshtrain: cuda: attention %s failed: %s\n", what, why);
    exit(1);
}
static void wb_check(const char *what) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) wb_die(what, cudaGetErrorString(e));
}

extern "C" int attn_wgmma_bwd_supported(int HD) { return attn_wgmma_bwd_hd(HD); }

extern "C" int attn_wgmma_device_ok(void) {
    static int ok = -1;
    if (ok < 0) {
        int dev = 0, major = 0, minor = 0;
        ok = cudaGetDevice(&dev) == cudaSuccess &&
             cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
             cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess && major == 9 &&
             minor == 0;
        cudaGetLastError(); /* a failed query leaves no sticky error behind */
    }
    return ok;
}

/* workspace: [dQ accumulator BH * nqp * HD fp32][semaphores BH * nq int][lse2 BH * nqp][D BH * nqp],
 * each part rounded up to 256 bytes; the first two are zeroed by one memset per call */
struct Ws {
    size_t dq, sem, lse2, D, total;
};
static Ws ws_layout(int B, int T, int NH, int HD) {
    const size_t BH = (size_t)B * NH, BM = (size_t)bm_of(HD), nq = ((size_t)T + BM - 1) / BM, nqp = nq * BM;
    const size_t a = ((BH * nqp * HD * 4) + 255) & ~(size_t)255, s = ((BH * nq * 4) + 255) & ~(size_t)255;
    const size_t l = ((BH * nqp * 4) + 255) & ~(size_t)255;
    Ws w;
    w.dq = 0, w.sem = a, w.lse2 = a + s, w.D = a + s + l, w.total = a + s + 2 * l;
    return w;
}


/* once per instantiation: the dynamic shared memory opt-in, and whether a block fits an SM (NULL) or
 * why not */
template <int HD, bool ROPE> static const char *prepare(void) {
    static int done;
    static char why[160];
    if (done) return why[0] ? why : NULL;
    done = 1;
    if (wgu::launchable((const void *)attn_wgmma_bwd_kernel<HD, ROPE>, Cfg<HD>::SMEM, NTHR, KREGS, why,
                        sizeof why) == 0 &&
        !wgu::encode_tiled())
        snprintf(why, sizeof why, "the driver has no cuTensorMapEncodeTiled");
    return why[0] ? why : NULL;
}

/* both instantiations (with and without RoPE), so that a caller told NULL may pass the tables */
extern "C" const char *attn_wgmma_bwd_unlaunchable(int HD) {
    const char *why;
    if (HD == 64) return (why = prepare<64, false>()) ? why : prepare<64, true>();
    if (HD == 96) return (why = prepare<96, false>()) ? why : prepare<96, true>();
    if (HD == 128) return (why = prepare<128, false>()) ? why : prepare<128, true>();
    if (HD == 256) return (why = prepare<256, false>()) ? why : prepare<256, true>();
    return "head_dim not 64, 96, 128 or 256";
}

/* a 3-D tensor map (innermost first: cols, T rows, B) over a bf16 [B, T, cols] array, box w / 2
 * columns (w bytes = the swizzle width: 128, 64 or 32) x rows x 1, w-byte swizzle; rows past T read
 * as zeros */
static CUtensorMap make_map(const void *p, size_t cols, int T, int B, int rows, int w) {
    const cuuint64_t dims[3] = {(cuuint64_t)cols, (cuuint64_t)T, (cuuint64_t)B};
    const cuuint64_t strides[2] = {(cuuint64_t)cols * 2, (cuuint64_t)cols * 2 * (cuuint64_t)T};
    const cuuint32_t box[3] = {(cuuint32_t)w / 2, (cuuint32_t)rows, 1}, estr[3] = {1, 1, 1};
    const CUtensorMapSwizzle sw =
        w == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : w == 64 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_32B;
    CUtensorMap tm;
    const CUresult r = wgu::encode_tiled()(&tm, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, (void *)p, dims, strides, box,
                                           estr, CU_TENSOR_MAP_INTERLEAVE_NONE, sw,
                                           CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        char why[64];
        snprintf(why, sizeof why, "cuTensorMapEncodeTiled returned %d", (int)r);
        wb_die("wgmma backward", why);
    }
    return tm;
}

template <int HD, bool ROPE>
static void launch(bf16 *dqkv, const bf16 *dout, const bf16 *qkv, const bf16 *out, const float *lse,
                   unsigned char *ws, int B, int T, int NH, int acc, int det, const float *rc, const float *rs,
                   cudaStream_t st) {
    constexpr int BM = bm_of(HD), BN = bn_of(HD);
    const char *name = HD == 64    ? (ROPE ? "attn_wgmma_bwd_hd64_rope" : "attn_wgmma_bwd_hd64")
                       : HD == 96  ? (ROPE ? "attn_wgmma_bwd_hd96_rope" : "attn_wgmma_bwd_hd96")
                       : HD == 128 ? (ROPE ? "attn_wgmma_bwd_hd128_rope" : "attn_wgmma_bwd_hd128")
                                   : (ROPE ? "attn_wgmma_bwd_hd256_rope" : "attn_wgmma_bwd_hd256");
    const char *why = prepare<HD, ROPE>();
    if (why) wb_die(name, why);
    const int BH = B * NH, nq = (T + BM - 1) / BM, nkv = (T + BN - 1) / BN, C = NH * HD;
    if ((unsigned long long)nkv * BH > 0x7fffffffull || (unsigned long long)nq * BH > 0x7fffffffull)
        wb_die("wgmma backward", "too many tiles");
    const Ws L = ws_layout(B, T, NH, HD);
    if (L.total != attn_wgmma_bwd_workspace_bytes(B, T, NH, HD)) wb_die("wgmma backward", "workspace layout");
    float *dqacc = (float *)(ws + L.dq), *lse2 = (float *)(ws + L.lse2), *Dw = (float *)(ws + L.D);
    int *sem = (int *)(ws + L.sem);
    /* the dQ accumulator starts at 0 (added to in any order), or in deterministic mode is stored by the
     * first key tile in the order (only the semaphores start at 0) */
    const cudaError_t me = det ? cudaMemsetAsync(ws + L.sem, 0, L.lse2 - L.sem, st) : cudaMemsetAsync(ws, 0, L.lse2, st);
    if (me != cudaSuccess) wb_die("wgmma backward", "memset of the workspace");

    const size_t rows = (size_t)BH * nq * BM, threads = rows * pre_lanes(HD);
    static_assert(pre_lanes(HD) == 16 || pre_lanes(HD) == HD / 8, "lanes a row");
    attn_wgmma_bwd_pre<(pre_lanes(HD) > HD / 8)><<<(unsigned)((threads + 255) / 256), 256, 0, st>>>(
        lse2, Dw, dout, out, lse, T, NH, HD, nq * BM, rows);
    wb_check("attn_wgmma_bwd_pre");

    const CUtensorMap tmq = make_map(qkv, 3 * (size_t)C, T, B, BM, Cfg<HD>::QW);
    const CUtensorMap tmkv = make_map(qkv, 3 * (size_t)C, T, B, BN, Cfg<HD>::KW);
    const CUtensorMap tmdo = make_map(dout, (size_t)C, T, B, BM, Cfg<HD>::QW);
    /* heads per L2 section: Q and dO (bf16) and the dQ accumulator (fp32) of a head, ~40 MB */
    const size_t per_head = (size_t)T * HD * 8, l2 = 40u << 20;
    int swz = 1;
    while (swz * 2 <= BH && (size_t)swz * 2 * per_head <= l2) swz *= 2;
    const float scale = 1.f / sqrtf((float)HD), scale2 = scale * LOG2E_F;
    attn_wgmma_bwd_kernel<HD, ROPE><<<(unsigned)(nkv * BH), NTHR, Cfg<HD>::SMEM, st>>>(
        tmq, tmkv, tmdo, dqkv, dqacc, lse2, Dw, sem, T, NH, BH, nkv, nq, swz, det, acc, scale2, scale, rc, rs);
    wb_check(name);

    const int parts = HD == 256 ? 2 : 1; /* the postprocess's blocks a query tile (see there) */
    if ((unsigned long long)nq * BH * parts > 0x7fffffffull) wb_die("wgmma backward", "too many tiles");
    attn_wgmma_bwd_post<HD, ROPE><<<(unsigned)(nq * BH * parts), 256, 0, st>>>(dqkv, dqacc, T, NH, nq, scale, acc, rc,
                                                                               rs);
    wb_check("attn_wgmma_bwd_post");
}

extern "C" void attn_wgmma_backward(void *dqkv, const void *dout, const void *qkv, const void *out, const float *lse,
                                    void *workspace, int B, int T, int NH, int HD, int acc, int deterministic,
                                    const float *cos_t, const float *sin_t, void *stream) {
    if (B <= 0 || T <= 0 || NH <= 0) return;
    if (!attn_wgmma_bwd_supported(HD)) {
        fprintf(stderr, "meshtrain: cuda: attention wgmma backward does not support head_dim %d\n", HD);
        exit(1);
    }
    if (((uintptr_t)dqkv | (uintptr_t)dout | (uintptr_t)qkv | (uintptr_t)out | (uintptr_t)lse |
         (uintptr_t)workspace) % 16)
        wb_die("wgmma backward", "pointers not 16-byte aligned");
    /* RoPE: both tables, 16-byte aligned (the postprocess reads float4s), written output only (as
     * attn_bf16_backward: accumulating would need the old values rotated too) */
    if (!cos_t != !sin_t) wb_die("wgmma backward", "one RoPE table without the other");
    if (cos_t && ((uintptr_t)cos_t | (uintptr_t)sin_t) % 16)
        wb_die("wgmma backward", "RoPE tables not 16-byte aligned");
    if (cos_t && acc) wb_die("wgmma backward", "RoPE's fused backward needs acc = 0");
    cudaStream_t st = (cudaStream_t)stream;
    unsigned char *ws = (unsigned char *)workspace;
    bf16 *d = (bf16 *)dqkv;
    const bf16 *o = (const bf16 *)dout, *x = (const bf16 *)qkv, *y = (const bf16 *)out;
    const int det = deterministic ? 1 : 0;
    if (HD == 64 && !cos_t) launch<64, false>(d, o, x, y, lse, ws, B, T, NH, acc, det, NULL, NULL, st);
    else if (HD == 64) launch<64, true>(d, o, x, y, lse, ws, B, T, NH, acc, det, cos_t, sin_t, st);
    else if (HD == 96 && !cos_t) launch<96, false>(d, o, x, y, lse, ws, B, T, NH, acc, det, NULL, NULL, st);
    else if (HD == 96) launch<96, true>(d, o, x, y, lse, ws, B, T, NH, acc, det, cos_t, sin_t, st);
    else if (HD == 128 && !cos_t) launch<128, false>(d, o, x, y, lse, ws, B, T, NH, acc, det, NULL, NULL, st);
    else if (HD == 128) launch<128, true>(d, o, x, y, lse, ws, B, T, NH, acc, det, cos_t, sin_t, st);
    else if (!cos_t) launch<256, false>(d, o, x, y, lse, ws, B, T, NH, acc, det, NULL, NULL, st);
    else launch<256, true>(d, o, x, y, lse, ws, B, T, NH, acc, det, cos_t, sin_t, st);
}
