/* Causal flash-attention forward for Hopper (sm_90a) on warpgroup MMA (wgmma) and the tensor
 * memory accelerator (TMA): FlashAttention-3's structure, written out in C-style CUDA.
 *
 * Same interface and results as attn_bf16_forward (attn_bf16.h): qkv [B, T, 3C] bf16, out [B, T, C]
 * bf16, lse [B, NH, T] fp32 (natural log), query i attends keys j <= i, scale 1/sqrt(HD).
 *
 * A block (CTA) owns BM = 128 query rows of one (batch, head) and walks the key tiles of BN = 128
 * keys from its diagonal tile down to tile 0 (only the first, diagonal tile needs the causal mask;
 * keys past T only ever appear in a diagonal tile, so the same mask hides them).
 * Block order (FlashAttention-3's L2 "sections"): a CTA of 128 x 128 tiles does 128 FLOPs per byte
 * of K and V it reads, below the H100's ~295 FLOPs per byte of HBM, so the kernel is compute bound
 * only while K and V come from L2. The (batch, head) pairs are cut into sections of SWZ heads whose
 * K and V together fit in 32 MB of L2 (SWZ a power of 2); inside a section, the heaviest (last)
 * query tiles of all its heads come first, then the next ones: the blocks in flight at a time are
 * many query tiles of few heads, which read the same K and V. (Before: heaviest-first over all
 * heads, at most ~2 blocks a head in flight at T = 4096, about 1 at T = 1024.)
 * Persistent grid with a dynamic scheduler (FA3's DynamicPersistentTileScheduler): min(#SMs, work
 * items) blocks; each starts on one item and its producer then takes the next item of that order
 * from an atomic counter, broadcasting it to the consumers through shared memory under the Q
 * barrier (a static assignment, serpentine, lost 20-25% at long T on an H100: fixed shares of
 * triangular work do not come out level). The producer loads the next item's Q as soon as both
 * consumers' last S GEMM on the current Q is done (mbarrier qempty), and its first key tiles as
 * soon as ring stages free up, so a new item's load latency hides behind the last softmax, P V and
 * epilogue of the current one. MESHTRAIN_WGMMA_GRID=blocks: one block per item instead.
 *
 * Two consumer warpgroups and a producer warpgroup: 384 threads, one block per SM.
 *   warps 0-3 and 4-7, the consumers (warpgroups 0 and 1): each owns 64 of the 128 query rows;
 *   warps 8-11, the producer (warpgroup 2): one thread issues the TMA loads (Q once; then K and V
 *     of each key tile into a ring of STAGES = STAGES_OF(HD) shared-memory stages); the other 127
 *     only give their registers back.
 * Registers. A block's warps are spread round-robin over the SM's 4 sub-partitions (warp w on
 * w % 4), each holding a quarter of the register file (16,384 32-bit registers, allocated per warp
 * in units of 256, i.e. per thread in units of 8). A block of W warps may therefore use at most
 * 16,384 / (32 ceil(W / 4)) registers a thread: 168 for 9 to 12 warps (ptxas gives 168 for
 * __launch_bounds__(288, 1) as for 384), not 65,536 / threads. The first version had a single
 * producer warp (288 threads) and __maxnreg__(224): HD 64 took 154 registers and ran, HD 128 took
 * 186 (192 allocated), and sub-partition 0 (warps 0, 4, 8) would have needed 3 x 32 x 192 = 18,432:
 * "too many resources requested for launch". Capped at 168, the HD 128 consumer spills (240 bytes)
 * and ptxas serializes its wgmmas. So, as in FlashAttention-3, the kernel is compiled at KREGS = 168
 * (__launch_bounds__(384, 1)) and for HD 128 the producer warpgroup gives registers back
 * (setmaxnreg.dec to 24) that the consumer warpgroups take (setmaxnreg.inc to 240): per
 * sub-partition 2 x 240 + 24 = 3 x 168 warps' worth, the same registers the block was launched
 * with (the host checks the kernel really was built at 168: an .inc asking for more than the
 * block holds would wait forever). HD 64 fits in 168 (154, no spills) and skips setmaxnreg.
 * Per key tile a consumer computes S = Q K^T (wgmma m64n128k16, A = Q and B = K from shared
 * memory, both K-major), the online softmax in fp32 registers (exp2, scale folded into log2e),
 * converts P to bf16 A-operand registers in place (the m64nNk16 accumulator fragment of columns
 * 16k..16k+15 is exactly the A register fragment of the k-th k16 slice, as with mma.sync m16n8k16)
 * and computes O += P V (wgmma m64n{HD}k16, A = P from registers, B = V from shared memory,
 * MN-major: imm-trans-b = 1). The S GEMM of tile i+1 and the P V GEMM of tile i are in flight
 * together while the softmax of tile i+1 runs (FA3's intra-warpgroup overlap). Across the two
 * consumer warpgroups, FA3's ping-pong: they take turns issuing their GEMMs (named barriers 1 and
 * 2: wait for my turn, issue, pass the turn), so one's softmax (the MUFU's ex2) runs while the
 * other's GEMMs hold the tensor cores, instead of both exponentiating at the same time. At HD 64
 * a tile's ex2 (128 x 128 on 16 a clock per SM) take as long as its GEMMs.
 * Epilogue: each consumer warpgroup writes its O / l rows (bf16) into its half of a staging tile
 * in shared memory (the 128-byte swizzle: conflict-free 4-byte stores) and one of its threads
 * stores them with TMA (64 rows x 64 columns a box, rows past T clipped by the hardware) instead
 * of 4-byte global stores from registers (8 rows x 16 bytes per warp instruction); the next
 * item's epilogue first waits until those stores have read the tile (a dedicated tile: Q's buffer
 * already holds the next item's Q in the persistent grid).
 *
 * Synchronisation: mbarriers. qfull (TMA bytes of Q, and the work item in shared memory; with no
 * bytes when no item is left), qempty (NCONSUMER arrivals: Q and the item may be overwritten),
 * kfull[s] / vfull[s] (TMA bytes of the K / V tile in stage s), empty[s] (NCONSUMER = 256 arrivals:
 * every consumer thread, after the wgmmas that read stage s have completed). A waiter on a barrier
 * used for the u-th time waits for phase parity u & 1; the ring position (stage, parity) runs on
 * across a block's work items.
 *
 * Shared memory layout (base aligned to 1024 bytes, as the 128-byte swizzle needs):
 *   a "tile" is 128 rows (tokens) x HD bf16, stored as HD/64 column panels; panel p holds columns
 *   64p..64p+63 as 128 rows of 128 bytes (PANEL = 16 KiB), row r at byte r*128 of the panel, its
 *   16-byte chunk c (columns 8c..8c+7) at chunk position c ^ (r & 7): the TMA's
 *   CU_TENSOR_MAP_SWIZZLE_128B layout, which is the wgmma 128-byte swizzle (Swizzle<3,4,3> on the
 *   byte address: bits 4..6 ^= bits 7..9), so 8 rows x 128 B = 1024 B is one swizzle atom.
 *     [0, TILE)                         Q tile
 *     [TILE * (1 + 2s), + TILE)         K tile of stage s
 *     [TILE * (2 + 2s), + TILE)         V tile of stage s
 *     [TILE * (1 + 2 STAGES), + TILE)   O staging tile of the epilogue: consumer warpgroup cw's 64
 *                                       rows at + cw * TILE / 2, as HD/64 panels of 64 rows x 128 B
 *                                       (8 KiB each), same swizzle: the TMA store's boxes
 *   TILE = 128 * HD * 2 bytes.
 *
 * Matrix descriptors (bits 0-13 start >> 4, 16-29 LBO >> 4, 32-45 SBO >> 4, 62-63 = 1: 128B swizzle):
 *   Q (A of S = Q K^T, K-major, 64 x 16 per wgmma): rows of the warpgroup start at Q + cw*64*128
 *     (cw = consumer 0/1; 8 KiB, a multiple of 1024); k16 slice kk of the head dim lies in panel
 *     kk/4 at byte offset (kk%4)*32 inside the 128-byte rows (the hardware applies the swizzle to
 *     the final address, so stepping the start by 32 B inside an atom is the canonical K step).
 *     SBO = 1024 (next 8 rows), LBO unused for swizzled K-major (set to 16 B, "1").
 *   K (B of S = Q K^T, K-major, N = 128 keys x 16): same as Q: start K_s + (kk/4)*PANEL + (kk%4)*32,
 *     SBO = 1024, LBO = 16.
 *   V (B of O = P V, MN-major: N = head dim contiguous, K = keys are the 128-byte rows): the k16
 *     slice kk (keys 16kk..16kk+15) starts at V_s + kk*16*128 (two whole atoms); SBO = 1024 (the
 *     next 8 keys), LBO = PANEL (the next 64 head-dim columns = the next panel; unused for HD = 64).
 *     (PTX ISA "matrix descriptor": MN-major swizzled, LBO = offset between repeats of the swizzle
 *     width along MN, SBO = offset between groups of 8 along K; CuTe's canonical
 *     ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)).)
 *
 * Register fragments (per warp w of a warpgroup: rows 16w..16w+15; g = lane/4, t = lane%4):
 *   accumulator m64nN, f32: d[4c + 2h + e] = element (row 16w + g + 8h, col 8c + 2t + e);
 *   A m64k16 bf16 (4 regs): a[0] = (g, 2t..2t+1), a[1] = (g+8, 2t..), a[2] = (g, 2t+8..),
 *   a[3] = (g+8, 2t+8..), low half = lower column. So P's k16 slice kk is
 *   a[j] = bf16x2(s[8kk + 2j], s[8kk + 2j + 1]), j = 0..3.
 *
 * This file is built for sm_90a only (wgmma); attn_wgmma_device_ok says whether the
 * current device can run it. */
#include "attn_wgmma.h"
#include "wgmma_util.cuh"

#include <cuda.h>
#include <cudaTypedefs.h> /* PFN_cuTensorMapEncodeTiled: the driver function, found at run time */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BM 128       /* query rows per block: 2 consumer warpgroups x 64 */
#define BN 128       /* keys per tile */
/* (K, V) stages in the shared-memory ring: 2 at HD 128 (6 tiles of 32 KiB with Q and the O staging
 * tile: 193 KiB), 4 at HD 64 (10 tiles of 16 KiB: 161 KiB), where a key tile's GEMMs are half as
 * long and the loads have to run further ahead to stay hidden */
#define STAGES_OF(HD) ((HD) == 64 ? 4 : 2)
#define NCONSUMER 256 /* 2 consumer warpgroups (threads 0..255) */
#define NTHREADS 384  /* + 1 producer warpgroup (threads 256..383; one thread issues the TMA loads) */
/* registers per thread: ptxas caps the kernel at KREGS (__launch_bounds__(384, 1): 65,536 / 384 =
 * 170, in units of 8); with setmaxnreg (HD = 128) the producer warpgroup drops to PRODREGS and the
 * consumers rise to CONSREGS: 2 x CONSREGS + PRODREGS = 3 x KREGS, the whole block's registers */
#define KREGS 168
#define PRODREGS 24
#define CONSREGS 240
#define PANEL 16384u /* one 64-column panel of a 128-row tile: 128 rows x 128 bytes */
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

typedef __nv_bfloat16 bf16;

static constexpr __host__ __device__ size_t tile_bytes(int HD) { return (size_t)BM * HD * 2; }
/* Q, STAGES x (K, V), the O staging tile, + alignment */
static constexpr __host__ __device__ size_t smem_bytes(int HD) { return tile_bytes(HD) * (2 + 2 * STAGES_OF(HD)) + 1024; }

#ifdef WGU_DEVICE
/* ------------------------------------------------------------------------------------------- */
/* PTX helpers: wgmma_util.cuh's (namespace wgu), and the forward's own                         */

using wgu::bulk_commit;
using wgu::bulk_wait_read;
using wgu::fence_async_shared;
using wgu::fence_regs;
using wgu::mbar_arrive;
using wgu::mbar_expect_tx;
using wgu::mbar_init;
using wgu::mbar_wait;
using wgu::named_arrive;
using wgu::named_sync;
using wgu::setmaxnreg_dec;
using wgu::setmaxnreg_inc;
using wgu::smem_u32;
using wgu::st_shared_u32;
using wgu::sw128_desc;
using wgu::tma_load;
using wgu::tma_store;
using wgu::wgmma_commit;
using wgu::wgmma_fence;
using wgu::wgmma_ss_n128;
using wgu::wgmma_wait;

/* a consumer's wait: the warp reconverges before the .sync.aligned wgmma instructions that follow */
static __device__ __forceinline__ void consumer_wait(uint32_t bar, uint32_t parity) {
    mbar_wait(bar, parity);
    __syncwarp();
}
/* ping-pong turns of the two consumer warpgroups: named barriers 1 (warpgroup 0's turn) and 2 */
static __device__ __forceinline__ void turn_wait(int cw) {
    if (cw == 0) named_sync<1, NCONSUMER>();
    else named_sync<2, NCONSUMER>();
}
static __device__ __forceinline__ void turn_pass(int cw) {
    if (cw == 0) named_arrive<2, NCONSUMER>();
    else named_arrive<1, NCONSUMER>();
}

/* S (64 x 128 keys) = Q_wg K^T: HD/16 wgmmas, the first one overwriting s. Issued, not waited for. */
template <int HD> static __device__ __forceinline__ void issue_qk(float (&s)[64], uint32_t q, uint32_t k) {
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
        const uint32_t off = (uint32_t)(kk / 4) * PANEL + (uint32_t)(kk % 4) * 32u;
        wgmma_ss_n128<0, 0>(s, sw128_desc(q + off, 16, 1024), sw128_desc(k + off, 16, 1024), kk > 0);
    }
}
/* O (64 x HD) += P V: 8 wgmmas over the 128 keys. Issued, not waited for. */
template <int HD>
static __device__ __forceinline__ void issue_pv(float (&o)[HD / 2], const uint32_t (&p)[BN / 16][4], uint32_t v) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++)
        wgu::Mma<HD>::template rs<1>(o, p[kk], sw128_desc(v + (uint32_t)kk * 16u * 128u, PANEL, 1024), 1);
}

/* online softmax of one S tile (raw scores in s; both rows of this thread): m (log2 units of the
 * scaled scores) and the thread's partial row sums l advance; s becomes P = 2^(s*scale2 - m);
 * alpha = the factor the old O and l had to be scaled by (applied to l here, to O by the caller). */
static __device__ __forceinline__ void softmax_tile(float (&s)[64], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                                    float scale2) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float mx = -INFINITY;
#pragma unroll
        for (int c = 0; c < BN / 8; c++) mx = fmaxf(mx, fmaxf(s[4 * c + 2 * r], s[4 * c + 2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mnew = fmaxf(m[r], mx * scale2);
        const float mu = mnew == -INFINITY ? 0.f : mnew; /* a row with nothing yet stays at 0 */
        alpha[r] = sfu_ex2(m[r] - mu);
        m[r] = mnew;
        float sum = 0.f;
#pragma unroll
        for (int c = 0; c < BN / 8; c++) {
            s[4 * c + 2 * r] = sfu_ex2(fmaf(s[4 * c + 2 * r], scale2, -mu));
            s[4 * c + 2 * r + 1] = sfu_ex2(fmaf(s[4 * c + 2 * r + 1], scale2, -mu));
            sum += s[4 * c + 2 * r] + s[4 * c + 2 * r + 1];
        }
        l[r] = l[r] * alpha[r] + sum;
    }
}
static __device__ __forceinline__ void p_to_bf16(uint32_t (&p)[BN / 16][4], const float (&s)[64]) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++)
#pragma unroll
        for (int j = 0; j < 4; j++) p[kk][j] = pack_bf16(s[8 * kk + 2 * j], s[8 * kk + 2 * j + 1]);
}
#endif /* WGU_DEVICE */

/* ------------------------------------------------------------------------------------------- */
/* the kernel                                                                                   */

/* work item x (0 .. nqt * BH - 1) -> query tile qt and (batch, head) bh: sections of swz heads
 * (the last one holds BH % swz when that is not 0), inside a section heaviest query tile first,
 * heads fastest */
static __device__ __forceinline__ void tile_coords(int x, int nqt, int BH, int swz, int &qt, int &bh) {
    const int per = swz * nqt, sec = x / per, in = x % per;
    const int nh = sec < BH / swz ? swz : BH % swz;
    qt = nqt - 1 - in / nh;
    bh = sec * swz + in % nh;
}

/* The dynamic scheduler of the persistent grid (FlashAttention-3's DynamicPersistentTileScheduler):
 * block c starts on work item c; its producer then takes the next items from a counter in global
 * memory (atomicAdd: the k-th fetch of the launch, over all blocks, gets item G + k), so a block
 * that finishes early takes the next item in the order (heaviest first inside an L2 section)
 * instead of a share fixed up front. The k-th fetch returns k, and the launch makes exactly total
 * fetches (total - G that get an item, one per block that gets none), so the counter pair of a
 * launch is left as it started (0, 0) if the last block to finish resets it: its producer counts
 * the blocks out on the second counter and the last one zeroes both. A launch takes one of SCHED_SLOTS
 * pairs round-robin, so launches in flight at the same time on different streams (up to
 * SCHED_SLOTS of them) do not share a counter. With one block per item (G = total) no block fetches. */
#define SCHED_SLOTS 64
__device__ unsigned attn_wgmma_sched[2 * SCHED_SLOTS];

/* grid: G blocks (min(#SMs, nqt * BH): persistent, or nqt * BH: one item a block); block c does
 * items c, then those its producer fetches from sched (the scheduler above), until none is left.
 * Item x -> tile_coords. */
template <int HD>
__global__ void __launch_bounds__(NTHREADS, 1) /* KREGS registers a thread; see the top */
    attn_wgmma_fwd_kernel(const __grid_constant__ CUtensorMap tm, const __grid_constant__ CUtensorMap tmo,
                          float *__restrict__ lse, unsigned *__restrict__ sched, int T, int NH, int BH, int nqt,
                          int swz, float scale2) {
#ifdef WGU_DEVICE
    constexpr int STAGES = STAGES_OF(HD);
    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) uint64_t bars[2 + 3 * STAGES];
    __shared__ int item; /* the current work item (producer -> consumers; -1: none left), under qfull */
    constexpr uint32_t TILE = (uint32_t)tile_bytes(HD);
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const int C = NH * HD, total = nqt * BH, G = (int)gridDim.x;
    const uint32_t qfull = smem_u32(&bars[0]);
#define QEMPTY (qfull + 8u * (1u + 3u * STAGES))
#define KFULL(s) (qfull + 8u * (1u + (uint32_t)(s)))
#define VFULL(s) (qfull + 8u * (1u + STAGES + (uint32_t)(s)))
#define EMPTY(s) (qfull + 8u * (1u + 2 * STAGES + (uint32_t)(s)))
#define KTILE(s) (base + TILE * (1u + 2u * (uint32_t)(s)))
#define VTILE(s) (base + TILE * (2u + 2u * (uint32_t)(s)))

    if (threadIdx.x == 0) {
        mbar_init(qfull, 1);
        mbar_init(QEMPTY, NCONSUMER);
        for (int s = 0; s < STAGES; s++) mbar_init(KFULL(s), 1), mbar_init(VFULL(s), 1), mbar_init(EMPTY(s), NCONSUMER);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        fence_async_shared();
    }
    __syncthreads();

    /* the warpgroup, warp-uniform (as CUTLASS computes it; setmaxnreg is per warpgroup) */
    const int wg = __shfl_sync(0xffffffffu, (int)(threadIdx.x / 128u), 0);
    if (wg == NCONSUMER / 128) { /* ---------------- producer warpgroup ---------------- */
        if constexpr (HD == 128) setmaxnreg_dec<PRODREGS>(); /* all 4 warps, converged */
        if (threadIdx.x == NCONSUMER) {
            asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&tm) : "memory");
            asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&tmo) : "memory");
            const bool fetch = G < total; /* else every fetch would come back empty: skip them */
            int x = (int)blockIdx.x;
            int g = 0; /* key tiles loaded so far by this block (all work items): ring position */
            for (int j = 0;; j++) {
                /* the item slot and Q are free once every consumer's last S GEMM on the previous
                 * item's Q is done (its softmax, P V and epilogue still run while this Q and the
                 * first K, V load) */
                if (j > 0) mbar_wait(QEMPTY, (uint32_t)((j - 1) & 1));
                if (x >= total) { /* none left: tell the consumers (qfull completes with no bytes) */
                    item = -1;
                    mbar_arrive(qfull);
                    break;
                }
                item = x; /* released to the consumers by the arrive below, acquired by their wait */
                int qt, bh;
                tile_coords(x, nqt, BH, swz, qt, bh);
                const int b = bh / NH, h = bh % NH;
                mbar_expect_tx(qfull, TILE);
#pragma unroll
                for (int p = 0; p < HD / 64; p++) tma_load(base + p * PANEL, &tm, h * HD + 64 * p, qt * BM, b, qfull);
                for (int i = 0; i <= qt; i++, g++) {
                    const int s = g % STAGES, n = qt - i;
                    if (g >= STAGES) mbar_wait(EMPTY(s), (uint32_t)((g / STAGES - 1) & 1));
                    mbar_expect_tx(KFULL(s), TILE);
#pragma unroll
                    for (int p = 0; p < HD / 64; p++)
                        tma_load(KTILE(s) + p * PANEL, &tm, C + h * HD + 64 * p, n * BN, b, KFULL(s));
                    mbar_expect_tx(VFULL(s), TILE);
#pragma unroll
                    for (int p = 0; p < HD / 64; p++)
                        tma_load(VTILE(s) + p * PANEL, &tm, 2 * C + h * HD + 64 * p, n * BN, b, VFULL(s));
                }
                /* the next item, fetched once this one's last loads are issued (the consumers have
                 * about STAGES key tiles left of it): late enough that the block that frees up
                 * first takes it, early enough that the atomic's latency hides */
                x = fetch ? G + (int)atomicAdd(&sched[0], 1u) : total;
            }
            if (fetch) { /* this block's fetches are done: count it out; the last one resets the pair */
                __threadfence();
                if (atomicAdd(&sched[1], 1u) == (unsigned)G - 1u) {
                    atomicExch(&sched[0], 0u);
                    atomicExch(&sched[1], 0u);
                }
            }
        }
    } else { /* ---------------- consumer warpgroups ---------------- */
        if constexpr (HD == 128) setmaxnreg_inc<CONSREGS>();
        const int ct = (int)threadIdx.x, cw = ct >> 7, warp = (ct >> 5) & 3, lane = ct & 31;
        const int g = lane >> 2, t = lane & 3;
        const int rloc = cw * 64 + warp * 16 + g; /* this thread's rows in the tile: rloc, rloc + 8 */
        const uint32_t qa = base + (uint32_t)cw * 64u * 128u;
        /* this warpgroup's half of the O staging tile; the thread's 4-byte pieces of row
         * warp * 16 + g (+ 8) at 16-byte chunk (c % 8) ^ g of panel c / 8: conflict-free stores */
        const uint32_t oa = base + TILE * (1u + 2u * STAGES) + (uint32_t)cw * (TILE / 2u) +
                            (uint32_t)(warp * 16 + g) * 128u + 4u * (uint32_t)t;
        const bool issuer = (ct & 127) == 0; /* issues this warpgroup's TMA stores */
        int kv = 0; /* key tiles consumed so far by this block (all work items): ring position */
        /* ping-pong: the warpgroups take turns issuing their GEMMs, warpgroup 0 first; each turn is
         * one named-barrier round (sync on mine, arrive on the other's), nkv + 1 per item in both
         * warpgroups, so the turns stay paired across items; warpgroup 1's last pass is left
         * unmatched at exit */
        if (cw == 1) turn_pass(1); /* warpgroup 0 goes first */

        for (int j = 0;; j++) {
            consumer_wait(qfull, (uint32_t)(j & 1));
            const int x = item;
            if (x < 0) break;
            int qt, bh;
            tile_coords(x, nqt, BH, swz, qt, bh);
            const int b = bh / NH, h = bh % NH, nkv = qt + 1; /* key tiles qt (the diagonal), ..., 0 */

            float s[64], o[HD / 2], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, alpha[2];
            uint32_t p[BN / 16][4];
#pragma unroll
            for (int i = 0; i < HD / 2; i++) o[i] = 0.f;

            /* tile 0 of the walk: the diagonal, masked */
            {
                const int st = kv % STAGES;
                consumer_wait(KFULL(st), (uint32_t)((kv / STAGES) & 1));
                fence_regs(s);
                turn_wait(cw); /* my turn on the tensor cores */
                wgmma_fence();
                issue_qk<HD>(s, qa, KTILE(st));
                wgmma_commit();
                turn_pass(cw); /* the other warpgroup's turn */
                wgmma_wait<0>();
                fence_regs(s);
                if (nkv == 1) mbar_arrive(QEMPTY); /* the last S GEMM on this Q is done */
            }
#pragma unroll
            for (int c = 0; c < BN / 8; c++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    if (8 * c + 2 * t + (e & 1) > rloc + 8 * (e >> 1)) s[4 * c + e] = -INFINITY;
            softmax_tile(s, m, l, alpha, scale2);
            p_to_bf16(p, s);

            for (int i = 1; i < nkv; i++) {
                const int gi = kv + i, st = gi % STAGES, ps = (gi - 1) % STAGES;
                consumer_wait(KFULL(st), (uint32_t)((gi / STAGES) & 1));
                consumer_wait(VFULL(ps), (uint32_t)(((gi - 1) / STAGES) & 1));
                fence_regs(s);
                fence_regs(o);
                turn_wait(cw);
                wgmma_fence();
                issue_qk<HD>(s, qa, KTILE(st)); /* S of tile i */
                wgmma_commit();
                issue_pv<HD>(o, p, VTILE(ps)); /* O += P V of tile i - 1 */
                wgmma_commit();
                turn_pass(cw);
                wgmma_wait<1>(); /* S done; P V may still run */
                fence_regs(s);
                if (i == nkv - 1) mbar_arrive(QEMPTY); /* the last S GEMM on this Q is done */
                softmax_tile(s, m, l, alpha, scale2);
                wgmma_wait<0>(); /* P V done: stage ps is free, p and o may be touched */
                fence_regs(o);
                mbar_arrive(EMPTY(ps));
#pragma unroll
                for (int c = 0; c < HD / 8; c++) {
                    o[4 * c] *= alpha[0], o[4 * c + 1] *= alpha[0];
                    o[4 * c + 2] *= alpha[1], o[4 * c + 3] *= alpha[1];
                }
                p_to_bf16(p, s);
            }
            {
                const int gl = kv + nkv - 1, ls = gl % STAGES;
                consumer_wait(VFULL(ls), (uint32_t)((gl / STAGES) & 1));
                fence_regs(o);
                turn_wait(cw);
                wgmma_fence();
                issue_pv<HD>(o, p, VTILE(ls));
                wgmma_commit();
                turn_pass(cw);
                wgmma_wait<0>();
                fence_regs(o);
                mbar_arrive(EMPTY(ls)); /* the next work item's key tiles reuse the stage */
            }
            kv += nkv;

            /* epilogue: O / l (bf16) -> the staging tile -> out by TMA stores (rows past T are
             * not written), lse = (m + log2 l) ln 2 from registers */
            if (issuer) bulk_wait_read<0>(); /* the previous item's stores have read the staging tile */
            if (cw == 0) named_sync<3, 128>();
            else named_sync<4, 128>();
#pragma unroll
            for (int r = 0; r < 2; r++) {
                l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
                l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
                const float inv = 1.f / l[r];
                const int row = qt * BM + rloc + 8 * r;
                if (row < T && t == 0) lse[(size_t)bh * T + row] = m[r] * LN2 + logf(l[r]);
#pragma unroll
                for (int c = 0; c < HD / 8; c++)
                    st_shared_u32(oa + (uint32_t)(c / 8) * 8192u + (uint32_t)r * 1024u +
                                      (uint32_t)(((c % 8) ^ g) << 4),
                                  pack_bf16(o[4 * c + 2 * r] * inv, o[4 * c + 2 * r + 1] * inv));
            }
            fence_async_shared(); /* visible to the TMA */
            if (cw == 0) named_sync<3, 128>();
            else named_sync<4, 128>();
            if (issuer) {
#pragma unroll
                for (int p = 0; p < HD / 64; p++)
                    tma_store(&tmo, base + TILE * (1u + 2u * STAGES) + (uint32_t)cw * (TILE / 2u) + (uint32_t)p * 8192u,
                              h * HD + 64 * p, qt * BM + cw * 64, b);
                bulk_commit();
            }
        }
        if (issuer) bulk_wait_read<0>(); /* the staging tile stays valid until the last stores read it */
    }
#undef QEMPTY
#undef KFULL
#undef VFULL
#undef EMPTY
#undef KTILE
#undef VTILE
#else
    (void)tm, (void)tmo, (void)lse, (void)sched, (void)T, (void)NH, (void)BH, (void)nqt, (void)swz, (void)scale2;
    __trap(); /* built for a target without wgmma */
#endif
}

/* ------------------------------------------------------------------------------------------- */
/* host side                                                                                    */

static void wg_die(const char *what, const char *why) {
    fprintf(stderr, "meshtrain: cuda: attention %s failed: %s\n", what, why);
    exit(1);
}
static void wg_check(const char *what) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) wg_die(what, cudaGetErrorString(e));
}

/* cuTensorMapEncodeTiled from the driver (wgmma_util.cuh); fails the forward if absent */
static PFN_cuTensorMapEncodeTiled_v12000 encode_tiled(void) {
    const PFN_cuTensorMapEncodeTiled_v12000 fn = wgu::encode_tiled();
    if (!fn) wg_die("wgmma forward", "the driver has no cuTensorMapEncodeTiled");
    return fn;
}

extern "C" int attn_wgmma_supported(int HD) { return HD == 64 || HD == 128; }

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

/* once per instantiation: the dynamic shared memory opt-in, and whether a block fits an SM (NULL)
 * or why not (registers: see the top) */
template <int HD> static const char *prepare(void) {
    static int done;
    static char why[160];
    if (done) return why[0] ? why : NULL;
    done = 1;
    /* (setmaxnreg at HD 128 only) */
    wgu::launchable((const void *)attn_wgmma_fwd_kernel<HD>, smem_bytes(HD), NTHREADS, HD == 128 ? KREGS : 0, why,
                    sizeof why);
    return why[0] ? why : NULL;
}

extern "C" const char *attn_wgmma_unlaunchable(int HD) {
    if (HD == 64) return prepare<64>();
    if (HD == 128) return prepare<128>();
    return "head_dim not 64 or 128";
}

template <int HD>
static void launch(const CUtensorMap &tm, const CUtensorMap &tmo, float *lse, int B, int T, int NH, cudaStream_t st) {
    const int nqt = (T + BM - 1) / BM, BH = B * NH;
    const unsigned long long total = (unsigned long long)nqt * (unsigned long long)BH;
    if (total > 0x3fffffffull) wg_die("wgmma forward", "too many tiles"); /* G + fetches stay < 2^31 */
    int dev = 0, nsm = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || nsm < 1)
        wg_die("wgmma forward", "no multiprocessor count");
    /* MESHTRAIN_WGMMA_GRID (benchmark knob): "persistent" (the default: min(#SMs, items) blocks,
     * dynamic scheduler) or "blocks" (one block per work item, the hardware's block scheduler);
     * read at every launch so that a benchmark can switch it */
    const char *mode = getenv("MESHTRAIN_WGMMA_GRID");
    int persistent = 1;
    if (mode && *mode) {
        if (!strcmp(mode, "blocks")) persistent = 0;
        else if (strcmp(mode, "persistent"))
            wg_die("wgmma forward", "MESHTRAIN_WGMMA_GRID is neither persistent nor blocks");
    }
    const unsigned grid = persistent && total > (unsigned long long)nsm ? (unsigned)nsm : (unsigned)total;
    /* the scheduler's counter pair for this launch (see attn_wgmma_sched), round-robin */
    static unsigned *sched_base[64];
    unsigned *sched = NULL;
    if (grid < total) {
        if (dev < 0 || dev >= 64) wg_die("wgmma forward", "device index past 63");
        if (!sched_base[dev] && cudaGetSymbolAddress((void **)&sched_base[dev], attn_wgmma_sched) != cudaSuccess)
            wg_die("wgmma forward", "no address of the scheduler's counters");
        static unsigned next_slot;
        sched = sched_base[dev] + 2 * (__atomic_fetch_add(&next_slot, 1u, __ATOMIC_RELAXED) % SCHED_SLOTS);
    }
    const size_t smem = smem_bytes(HD);
    const char *why = prepare<HD>();
    if (why) wg_die(HD == 64 ? "attn_wgmma_fwd_hd64" : "attn_wgmma_fwd_hd128", why);
    const float scale2 = LOG2E / sqrtf((float)HD);
    /* heads per L2 section: K and V of one head are T x HD x 2 x 2 bytes; 32 MB of the 50 MB L2 */
    const size_t kv_head = (size_t)T * HD * 4, l2 = 32u << 20;
    int swz = 1;
    while (swz < BH && (size_t)swz * 2 * kv_head <= l2) swz *= 2;
    attn_wgmma_fwd_kernel<HD>
        <<<grid, NTHREADS, smem, st>>>(tm, tmo, lse, sched, T, NH, BH, nqt, swz, scale2);
    wg_check(HD == 64 ? "attn_wgmma_fwd_hd64" : "attn_wgmma_fwd_hd128");
}

extern "C" void attn_wgmma_forward(void *out, float *lse, const void *qkv, int B, int T, int NH, int HD,
                                   void *stream) {
    if (B <= 0 || T <= 0 || NH <= 0) return;
    if (!attn_wgmma_supported(HD)) {
        fprintf(stderr, "meshtrain: cuda: attention wgmma does not support head_dim %d\n", HD);
        exit(1);
    }
    if (((uintptr_t)out | (uintptr_t)lse | (uintptr_t)qkv) % 16) wg_die("wgmma forward", "pointers not 16-byte aligned");
    /* qkv as a 3-D tensor (innermost first): 3C columns, T rows, B batches; a box is 64 columns
     * (128 bytes, the swizzle width) x 128 rows; rows past T read as zeros */
    const cuuint64_t C3 = 3ull * (cuuint64_t)NH * (cuuint64_t)HD;
    const cuuint64_t dims[3] = {C3, (cuuint64_t)T, (cuuint64_t)B};
    const cuuint64_t strides[2] = {C3 * 2, C3 * 2 * (cuuint64_t)T}; /* bytes, of dims 1 and 2 */
    const cuuint32_t box[3] = {64, BM, 1}, estr[3] = {1, 1, 1};
    CUtensorMap tm, tmo;
    CUresult r = encode_tiled()(&tm, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, (void *)qkv, dims, strides, box, estr,
                                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    /* out as a 3-D tensor: C columns, T rows, B batches; the stores' box is 64 columns x 64 rows
     * (one consumer warpgroup's rows, one panel); rows past T are not written */
    const cuuint64_t C1 = (cuuint64_t)NH * (cuuint64_t)HD;
    const cuuint64_t odims[3] = {C1, (cuuint64_t)T, (cuuint64_t)B};
    const cuuint64_t ostrides[2] = {C1 * 2, C1 * 2 * (cuuint64_t)T};
    const cuuint32_t obox[3] = {64, BM / 2, 1};
    if (r == CUDA_SUCCESS)
        r = encode_tiled()(&tmo, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, out, odims, ostrides, obox, estr,
                           CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                           CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        char why[64];
        snprintf(why, sizeof why, "cuTensorMapEncodeTiled returned %d", (int)r);
        wg_die("wgmma forward", why);
    }
    cudaStream_t st = (cudaStream_t)stream;
    if (HD == 64) launch<64>(tm, tmo, lse, B, T, NH, st);
    else launch<128>(tm, tmo, lse, B, T, NH, st);
}
