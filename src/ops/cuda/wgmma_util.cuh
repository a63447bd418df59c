/* PTX wrappers for Hopper (sm_90a) kernels: wgmma, TMA and bulk copies, mbarriers, named barriers,
 * setmaxnreg, shared-memory matrix descriptors; and the host's tensor-map encoder, for the
 * attention backward (attn_wgmma_bwd.cu); header-only, everything static, in namespace wgu.
 *
 * Device code exists only where WGU_DEVICE is defined (the sm_90a device pass); a kernel body
 * guards itself with #ifdef WGU_DEVICE.
 *
 * Conventions (checked on a GPU through tests/gpu/test_attn_wgmma_bwd.cu):
 *   128-byte swizzle: a 128-byte row r of a 1024-byte-aligned region has its 16-byte chunk c at
 *   chunk position c ^ (r & 7) (CU_TENSOR_MAP_SWIZZLE_128B = wgmma's 128B swizzle mode).
 *   Descriptor (sw128_desc): bits 0-13 start >> 4, 16-29 LBO >> 4, 32-45 SBO >> 4, 62-63 = 1.
 *     K-major operand (rows of 128 bytes along K): start + 32 B per k16 step inside a 64-element
 *     panel, SBO = 1024 (the next 8 rows), LBO unused (16).
 *     MN-major operand (rows along K, M or N contiguous; imm-trans = 1): k16 slice kk starts at
 *     + kk * 16 * 128, SBO = 1024 (the next 8 K rows), LBO = the byte offset of the next
 *     64-element panel along M / N.
 *   Accumulator fragment m64nN (f32), warp w of the warpgroup, g = lane / 4, t = lane % 4:
 *     d[4c + 2h + e] = element (row 16w + g + 8h, column 8c + 2t + e).
 *   A fragment m64k16 (bf16x2 registers): a[j] = (row g + 8 (j & 1), columns 8 (j >> 1) + 2t, +1),
 *     so the k16 slice kk of an accumulator is a[j] = bf16x2(d[8kk + 2j], d[8kk + 2j + 1]). */
#ifndef MESHTRAIN_WGMMA_UTIL_CUH
#define MESHTRAIN_WGMMA_UTIL_CUH

#include <cuda.h>
#include <cudaTypedefs.h> /* PFN_cuTensorMapEncodeTiled: the driver function, found at run time */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include "bf16x2.cuh" /* pack_bf16, bf16_lo, bf16_hi */
#include "sfu.cuh"    /* sfu_ex2 */

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WGU_DEVICE 1
#endif

/* an mbarrier or semaphore wait gives up (the launch fails instead of hanging) after this many ns */
#define WGU_WATCHDOG_NS 4000000000ull

namespace wgu {

/* cuTensorMapEncodeTiled from the driver, found once through the runtime (no -lcuda); NULL if absent */
static inline PFN_cuTensorMapEncodeTiled_v12000 encode_tiled(void) {
    static PFN_cuTensorMapEncodeTiled_v12000 fn;
    if (!fn) {
        void *p = NULL;
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) !=
                cudaSuccess ||
            q != cudaDriverEntryPointSuccess || !p) {
            cudaGetLastError();
            return NULL;
        }
        fn = (PFN_cuTensorMapEncodeTiled_v12000)p;
    }
    return fn;
}

/* Whether kernel fn launches with nthreads threads and smem bytes of dynamic shared memory (which
 * it is opted in to here): 0, or why not in why[len]. kregs > 0: the kernel's setmaxnreg split
 * hands out exactly the registers of a block launched at kregs, so it must be built with exactly
 * that many (with fewer, the consumers' setmaxnreg.inc would wait forever). */
static inline int launchable(const void *fn, size_t smem, int nthreads, int kregs, char *why, size_t len) {
    cudaFuncAttributes fa;
    int nb = 0;
    cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&fa, fn);
    if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, fn, nthreads, smem);
    cudaGetLastError(); /* reported below, not left sticky */
    if (e != cudaSuccess) snprintf(why, len, "%s", cudaGetErrorString(e));
    else if (kregs > 0 && fa.numRegs != kregs)
        snprintf(why, len, "built with %d registers a thread, setmaxnreg needs %d", fa.numRegs, kregs);
    else if (nb < 1)
        snprintf(why, len, "a block (%d threads x %d registers, %zu bytes of shared memory) fits no SM", nthreads,
                 fa.numRegs, smem + fa.sharedSizeBytes);
    else return 0;
    return -1;
}

#ifdef WGU_DEVICE
static __device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* ---- mbarriers ---- */
static __device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
/* arrive (count 1) and add `bytes` to the transaction count this phase waits for */
static __device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
static __device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
/* the watchdog's way of failing the launch: a store to address 0 ("an illegal memory access was
 * encountered"). Not __trap(): a trap inside setmaxnreg regions makes ptxas give up on them (the
 * consumers then stay at 168 registers, spill and serialize their wgmmas). */
static __device__ __forceinline__ void watchdog_fault(void) {
    asm volatile("st.global.u32 [%0], %1;\n" ::"l"(0ull), "r"(0u) : "memory");
}
static __device__ __forceinline__ uint64_t globaltimer(void) {
    uint64_t now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    return now;
}
/* wait until the phase of parity `parity` has completed; after WGU_WATCHDOG_NS, fault (the launch
 * fails with an error instead of hanging: a bug, never a legitimate wait) */
static __device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done, polls = 0;
    uint64_t t0 = 0;
    for (;;) {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
        if (done) return;
        if ((++polls & 255u) == 0) {
            const uint64_t now = globaltimer();
            if (!t0) t0 = now;
            else if (now - t0 > WGU_WATCHDOG_NS) watchdog_fault();
        }
    }
}

/* ---- global semaphores (acquire / release at GPU scope) ---- */
static __device__ __forceinline__ int ld_acquire(const int *p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
static __device__ __forceinline__ void red_release_add(int *p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
/* spin until *p == v (acquire); after WGU_WATCHDOG_NS, fault */
static __device__ __forceinline__ void sem_wait_eq(const int *p, int v) {
    uint32_t polls = 0;
    uint64_t t0 = 0;
    while (ld_acquire(p) != v) {
        if ((++polls & 63u) == 0) {
            const uint64_t now = globaltimer();
            if (!t0) t0 = now;
            else if (now - t0 > WGU_WATCHDOG_NS) watchdog_fault();
        }
    }
}

/* spin until *p >= v (acquire); after WGU_WATCHDOG_NS, fault */
static __device__ __forceinline__ void sem_wait_ge(const int *p, int v) {
    uint32_t polls = 0;
    uint64_t t0 = 0;
    while (ld_acquire(p) < v) {
        if ((++polls & 63u) == 0) {
            const uint64_t now = globaltimer();
            if (!t0) t0 = now;
            else if (now - t0 > WGU_WATCHDOG_NS) watchdog_fault();
        }
    }
}

/* ---- TMA and bulk copies ---- */
/* box of the 3-D tensor map at (c0, c1, c2) -> shared dst, completing `bar`'s transaction bytes;
 * elements past the tensor's ends are filled with zeros (and still count as bytes) */
static __device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap *tm, int c0, int c1, int c2,
                                                uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(
            dst),
        "l"((uint64_t)tm), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}
/* `bytes` (a multiple of 16; both addresses 16-byte aligned) global -> shared, completing `bar` */
static __device__ __forceinline__ void bulk_load(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"((uint64_t)src), "r"(bytes), "r"(bar)
                 : "memory");
}
/* global[dst .. + bytes) += shared[src ..) as fp32, element-wise, by the copy engine (each element one
 * atomic add in L2), in this thread's bulk async-group */
static __device__ __forceinline__ void bulk_reduce_add_f32(void *dst, uint32_t src, uint32_t bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"((uint64_t)dst),
                 "r"(src), "r"(bytes)
                 : "memory");
}
/* global[dst .. + bytes) = shared[src ..) by the copy engine, in this thread's bulk async-group */
static __device__ __forceinline__ void bulk_store(void *dst, uint32_t src, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"((uint64_t)dst), "r"(src),
                 "r"(bytes)
                 : "memory");
}
static __device__ __forceinline__ void bulk_commit(void) { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
/* wait until at most N of this thread's bulk async-groups have not finished reading their sources */
template <int N> static __device__ __forceinline__ void bulk_wait_read(void) {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
/* wait until at most N of this thread's bulk async-groups are not complete (writes done) */
template <int N> static __device__ __forceinline__ void bulk_wait(void) {
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
/* ordinary shared-memory stores before this -> visible to the async proxy (wgmma, TMA, bulk copies) */
static __device__ __forceinline__ void fence_async_shared(void) {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
/* orders global accesses between the generic and the async proxy */
static __device__ __forceinline__ void fence_async_global(void) {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
static __device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
static __device__ __forceinline__ void st_shared_v4(uint32_t addr, float a, float b, float c, float d) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}
static __device__ __forceinline__ float2 ld_shared_f2(uint32_t addr) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
    return v;
}

/* ---- wgmma bookkeeping ---- */
static __device__ __forceinline__ void wgmma_fence(void) { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
static __device__ __forceinline__ void wgmma_commit(void) {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N> static __device__ __forceinline__ void wgmma_wait(void) {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* keeps the compiler from moving accesses of accumulator registers across a wgmma issue / wait */
template <int N> static __device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}
/* register reallocation between warpgroups (every warp of the warpgroup, converged, executes it) */
template <int N> static __device__ __forceinline__ void setmaxnreg_dec(void) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> static __device__ __forceinline__ void setmaxnreg_inc(void) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
/* named barriers (id 0 is __syncthreads): bar.sync waits until COUNT threads have arrived at ID (its
 * own warp included); bar.arrive counts this warp in without waiting */
template <int ID, int COUNT> static __device__ __forceinline__ void named_sync(void) {
    asm volatile("bar.sync %0, %1;\n" ::"n"(ID), "n"(COUNT) : "memory");
}
template <int ID, int COUNT> static __device__ __forceinline__ void named_arrive(void) {
    asm volatile("bar.arrive %0, %1;\n" ::"n"(ID), "n"(COUNT) : "memory");
}

/* 128-byte-swizzle shared-memory matrix descriptor (see the top) */
static __device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFFu) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFFu) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3FFFu) << 32) | (1ull << 62);
}
/* The same for a W-byte swizzle, W = 128, 64 or 32 (layout type 1, 2, 3 in bits 62-63): rows of W
 * bytes (W / 2 bf16), chunk c of row r at chunk position c ^ ((r / (8 / (W / 16))) % (W / 16)), the
 * pattern repeating every 8 W bytes (the alignment a region needs); the conventions at the top with
 * 128 -> W: K-major: + 32 B per k16 step inside a row, the next row of W bytes after W / 32 steps,
 * SBO = 8 W; MN-major: k16 slice kk at + kk * 16 * W, SBO = 8 W, LBO = the next W / 2 elements along
 * M / N. sw_desc<128> is sw128_desc. */
template <int W> static __device__ __forceinline__ uint64_t sw_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    static_assert(W == 128 || W == 64 || W == 32, "swizzle width 128, 64 or 32 bytes");
    constexpr uint64_t type = W == 128 ? 1ull : W == 64 ? 2ull : 3ull;
    return (uint64_t)((addr & 0x3FFFFu) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFFu) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3FFFu) << 32) | (type << 62);
}

/* ---- wgmma (operand lists written out by a short script) ---- */
/* d[32] (+)= A * B, m64n64k16, A and B from shared memory (descriptors); TA / TB: imm-trans-a / -b
 * (1 = MN-major); scale_d = 0 ignores the old d. */
template <int TA, int TB>
static __device__ __forceinline__ void wgmma_ss_n64(float (&d)[32], uint64_t da, uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, %35, %36;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
}

/* d[32] (+)= A * B, m64n64k16, A from registers (4 x bf16x2, the m64k16 fragment), B from shared
 * memory; TB: imm-trans-b (1 = MN-major); scale_d = 0 ignores the old d. */
template <int TB>
static __device__ __forceinline__ void wgmma_rs_n64(float (&d)[32], const uint32_t (&a)[4], uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, %38;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
}

/* d[64] (+)= A * B, m64n128k16, A and B from shared memory (descriptors); TA / TB: imm-trans-a / -b
 * (1 = MN-major); scale_d = 0 ignores the old d. */
template <int TA, int TB>
static __device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], uint64_t da, uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
                 "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
                 "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, %67, %68;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
}

/* d[64] (+)= A * B, m64n128k16, A from registers (4 x bf16x2, the m64k16 fragment), B from shared
 * memory; TB: imm-trans-b (1 = MN-major); scale_d = 0 ignores the old d. */
template <int TB>
static __device__ __forceinline__ void wgmma_rs_n128(float (&d)[64], const uint32_t (&a)[4], uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
                 "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
                 "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, %70;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
}

/* d[24] (+)= A * B, m64n48k16, A and B from shared memory (descriptors); TA / TB: imm-trans-a / -b
 * (1 = MN-major); scale_d = 0 ignores the old d. */
template <int TA, int TB>
static __device__ __forceinline__ void wgmma_ss_n48(float (&d)[24], uint64_t da, uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %26, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23}, %24, %25, p, 1, 1, %27, %28;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
                 : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
}

/* d[48] (+)= A * B, m64n96k16, A from registers (4 x bf16x2, the m64k16 fragment), B from shared
 * memory; TB: imm-trans-b (1 = MN-major); scale_d = 0 ignores the old d. */
template <int TB>
static __device__ __forceinline__ void wgmma_rs_n96(float (&d)[48], const uint32_t (&a)[4], uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %53, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
                 "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47}, {%48,%49,%50,%51}, %52, p, 1, 1, %54;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
}

/* d[16] (+)= A * B, m64n32k16, A and B from shared memory (descriptors); TA / TB: imm-trans-a / -b
 * (1 = MN-major); scale_d = 0 ignores the old d. */
template <int TA, int TB>
static __device__ __forceinline__ void wgmma_ss_n32(float (&d)[16], uint64_t da, uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, %19, %20;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
}

/* by N (the accumulator's columns): d[N / 2] */
template <int N> struct Mma;
template <> struct Mma<64> {
    template <int TA, int TB>
    static __device__ __forceinline__ void ss(float (&d)[32], uint64_t da, uint64_t db, int scale_d) {
        wgmma_ss_n64<TA, TB>(d, da, db, scale_d);
    }
    template <int TB>
    static __device__ __forceinline__ void rs(float (&d)[32], const uint32_t (&a)[4], uint64_t db, int scale_d) {
        wgmma_rs_n64<TB>(d, a, db, scale_d);
    }
};
template <> struct Mma<128> {
    template <int TA, int TB>
    static __device__ __forceinline__ void ss(float (&d)[64], uint64_t da, uint64_t db, int scale_d) {
        wgmma_ss_n128<TA, TB>(d, da, db, scale_d);
    }
    template <int TB>
    static __device__ __forceinline__ void rs(float (&d)[64], const uint32_t (&a)[4], uint64_t db, int scale_d) {
        wgmma_rs_n128<TB>(d, a, db, scale_d);
    }
};
template <> struct Mma<48> { /* head_dim 96's dQ: each consumer warpgroup's 48 head-dim columns */
    template <int TA, int TB>
    static __device__ __forceinline__ void ss(float (&d)[24], uint64_t da, uint64_t db, int scale_d) {
        wgmma_ss_n48<TA, TB>(d, da, db, scale_d);
    }
};
template <> struct Mma<32> { /* head_dim 256's S^T and dP^T: each consumer warpgroup's 32 queries */
    template <int TA, int TB>
    static __device__ __forceinline__ void ss(float (&d)[16], uint64_t da, uint64_t db, int scale_d) {
        wgmma_ss_n32<TA, TB>(d, da, db, scale_d);
    }
};
template <> struct Mma<96> { /* head_dim 96's dK and dV */
    template <int TB>
    static __device__ __forceinline__ void rs(float (&d)[48], const uint32_t (&a)[4], uint64_t db, int scale_d) {
        wgmma_rs_n96<TB>(d, a, db, scale_d);
    }
};
#endif /* WGU_DEVICE */

} /* namespace wgu */
#endif
