/* src/ops/cuda/crossentropy.cuh: the fused cross-entropy forward/backward kernels.
 * Part of ops_cuda.cu, which includes it at this point of its one translation unit (after
 * the helpers it uses): not a header to include anywhere else. */
#include "sfu.cuh"
/* ------------------------------------------------------------------------------------ */
/* cross-entropy                                                                         */

/* One block per row (V ~ 5e4: 50 elements per thread). Pass 1: max and a NaN flag;
 * pass 2: sum of exp(l - max), each thread's part in double, the block sum in double;
 * pass 3 (gradient): exp recomputed and written once, scaled, in place. The target's
 * logit is read by every thread before the first block reduction, hence before any write. */
#define CE_BLOCK 1024
/* The block's max over a row's V logits, and whether any is NaN (fmaxf ignores NaN: the
 * flag catches it). Every thread gets both. */
static __device__ __forceinline__ float row_max_nan(const void *row, int V, int bf, int *bad) {
    float mx = -INFINITY;
    int b = 0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        float x = ld(row, j, bf);
        mx = fmaxf(mx, x);
        b |= x != x;
    }
    mx = block_max(mx);
    *bad = __syncthreads_or(b);
    return mx;
}

static __global__ void __launch_bounds__(CE_BLOCK)
crossentropy_kernel(float *losses, void *logits, int ldl, const int *targets, int V, float scale, int bf) {
    int n = blockIdx.x;
    void *row = bf ? (void *)((bf16 *)logits + (size_t)n * ldl) : (void *)((float *)logits + (size_t)n * ldl);
    int tgt = targets[n];
    int tgt_ok = tgt >= 0 && tgt < V;
    float lt = tgt_ok ? ld(row, tgt, bf) : 0.0f;
    int bad;
    float mx = row_max_nan(row, V, bf, &bad);
    if (bad || !tgt_ok || mx == INFINITY || mx == -INFINITY) {
        if (threadIdx.x == 0) losses[n] = NAN;
        if (scale != 0.0f)
            for (int j = threadIdx.x; j < V; j += blockDim.x) st(row, j, NAN, bf);
        return;
    }
    double sum = 0.0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) sum += (double)expf(ld(row, j, bf) - mx);
    sum = block_sum_double(sum);
    if (threadIdx.x == 0) losses[n] = (float)((double)mx + log(sum) - (double)lt);
    if (scale != 0.0f) {
        float f = (float)((double)scale / sum);
        for (int j = threadIdx.x; j < V; j += blockDim.x) {
            float e = expf(ld(row, j, bf) - mx);
            st(row, j, j == tgt ? (float)((double)scale * ((double)e / sum - 1.0)) : e * f, bf);
        }
    }
}

/* bf16 rows with ld % 8 == 0 (16-byte aligned rows): the same three passes (the exps on the
 * SFU, ce_exp, except the target's), but the row (V rounded up to 8: 100 KB for the GPT-2 vocabulary) is first
 * copied into shared memory with asynchronous 16-byte copies, so it is read from memory
 * once and written once; with few registers and that much shared memory two blocks share an
 * SM, and one's copy overlaps the other's exp work (one block per SM, with the row held in
 * registers, left the memory idle during the exps: 0.45 ms vs this kernel's goal of 0.3).
 * Thread t takes the 16-byte chunks t, t + CE8_BLOCK, ... Padding past V in the last chunk is
 * copied but never used or written. 512 threads: two blocks then have 64 registers a thread. */
#define CE8_BLOCK 512
#define CE_SMEM_BLOCKS 2
/* e^(x - mx) as 2^(x log2 e - mx log2 e): one FMA and the SFU's ex2.approx (relative error
 * about 2^-22, -inf -> 0) where expf takes several instructions; the exp passes issue two
 * exps per logit and are bound by instruction issue more than by memory. */
#define CE_LOG2E 1.4426950408889634f
static __device__ __forceinline__ float ce_exp(float x, float mxl) { return sfu_ex2(fmaf(x, CE_LOG2E, -mxl)); }
static __global__ void __launch_bounds__(CE8_BLOCK, CE_SMEM_BLOCKS)
crossentropy8_kernel(float *losses, bf16 *logits, int ldl, const int *targets, int V, float scale) {
    extern __shared__ uint4 ce_row[]; /* [ceil(V / 8)] */
    int n = blockIdx.x, nch = (V + 7) / 8;
    bf16 *row = logits + (size_t)n * ldl;
    for (int k = threadIdx.x; k < nch; k += blockDim.x)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"((uint32_t)__cvta_generic_to_shared(ce_row + k)),
                     "l"(row + 8 * (size_t)k));
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    int tgt = targets[n];
    int tgt_ok = tgt >= 0 && tgt < V;
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    __syncthreads();
    float lt = tgt_ok ? __bfloat162float(((const bf16 *)ce_row)[tgt]) : 0.0f;
    float mx = -INFINITY;
    int bad = 0;
    for (int k = threadIdx.x; k < nch; k += blockDim.x) {
        float v[8];
        unpack8_bf16(v, ce_row[k]);
#pragma unroll
        for (int e = 0; e < 8; e++)
            if (8 * k + e < V) {
                mx = fmaxf(mx, v[e]); /* ignores NaN; the flag catches it */
                bad |= v[e] != v[e];
            }
    }
    mx = block_max(mx);
    bad = __syncthreads_or(bad);
    if (bad || !tgt_ok || mx == INFINITY || mx == -INFINITY) {
        if (threadIdx.x == 0) losses[n] = NAN;
        if (scale != 0.0f)
            for (int j = threadIdx.x; j < V; j += blockDim.x) row[j] = __float2bfloat16(NAN);
        return;
    }
    /* each chunk's 8 exps (each <= 1) summed in fp32 (relative error ~1e-7), the chunks in
     * double: the conversions to double cost as much as the exps themselves */
    const float mxl = mx * CE_LOG2E;
    double sum = 0.0;
    for (int k = threadIdx.x; k < nch; k += blockDim.x) {
        float v[8], cs = 0.0f;
        unpack8_bf16(v, ce_row[k]);
        if (8 * k + 8 <= V) {
#pragma unroll
            for (int e = 0; e < 8; e++) cs += ce_exp(v[e], mxl);
        } else {
#pragma unroll
            for (int e = 0; e < 8; e++)
                if (8 * k + e < V) cs += ce_exp(v[e], mxl);
        }
        sum += (double)cs;
    }
    sum = block_sum_double(sum);
    if (threadIdx.x == 0) losses[n] = (float)((double)mx + log(sum) - (double)lt);
    if (scale == 0.0f) return;
    float f = (float)((double)scale / sum);
    float gt = (float)((double)scale * ((double)expf(lt - mx) / sum - 1.0)); /* the target's */
    for (int k = threadIdx.x; k < nch; k += blockDim.x) {
        int j0 = 8 * k;
        float v[8];
        unpack8_bf16(v, ce_row[k]);
#pragma unroll
        for (int e = 0; e < 8; e++) v[e] = j0 + e == tgt ? gt : ce_exp(v[e], mxl) * f;
        if (j0 + 8 <= V) {
            *(uint4 *)(row + j0) = pack8_bf16(v);
        } else {
#pragma unroll
            for (int e = 0; e < 8; e++)
                if (j0 + e < V) row[j0 + e] = __float2bfloat16(v[e]);
        }
    }
}

/* Vocabulary parallel (ops.h: op_crossentropy_shard_stats / _backward): one block per row,
 * the generic kernel's passes on the shard's columns (a shard is V/t wide: the
 * shared-memory variant above is not needed for it). */
static __global__ void __launch_bounds__(CE_BLOCK)
crossentropy_shard_stats_kernel(float *stats, const void *logits, int ldl, const int *targets, int V, int v0, int bf) {
    int n = blockIdx.x;
    const void *row = bf ? (const void *)((const bf16 *)logits + (size_t)n * ldl)
                         : (const void *)((const float *)logits + (size_t)n * ldl);
    unsigned t = (unsigned)(targets[n] - v0);
    int bad;
    float mx = row_max_nan(row, V, bf, &bad);
    if (bad || mx == INFINITY) mx = NAN;
    double sum = 0.0;
    if (mx == mx && mx != -INFINITY)
        for (int j = threadIdx.x; j < V; j += blockDim.x) sum += (double)expf(ld(row, j, bf) - mx);
    sum = block_sum_double(sum);
    if (threadIdx.x == 0) {
        stats[3 * (size_t)n] = mx;
        stats[3 * (size_t)n + 1] = (float)sum;
        stats[3 * (size_t)n + 2] = t < (unsigned)V ? ld(row, t, bf) : 0.0f;
    }
}

/* Row n's statistics over the nt shards, in shard order (nt is small; every thread combines
 * them itself): the max M, the target's logit lt and the sum of exp(l - M); 0 where the row's
 * loss is NaN (a NaN in some shard, or every logit -inf). */
static __device__ __forceinline__ int shard_combine(const float *stats, int N, int n, int nt, float *M, float *lt,
                                                    double *sum) {
    int bad = 0;
    *M = -INFINITY, *lt = 0.0f, *sum = 0.0;
    for (int k = 0; k < nt; k++) {
        const float *s = stats + 3 * ((size_t)k * N + n);
        bad |= s[0] != s[0];
        *M = fmaxf(*M, s[0]);
        *lt += s[2];
    }
    if (bad || *M == -INFINITY) return 0;
    for (int k = 0; k < nt; k++) {
        const float *s = stats + 3 * ((size_t)k * N + n);
        if (s[0] != -INFINITY) *sum += (double)s[1] * exp((double)s[0] - (double)*M);
    }
    return 1;
}

/* The backward of one shard's rows from every shard's statistics. */
static __global__ void __launch_bounds__(CE_BLOCK)
crossentropy_shard_kernel(float *losses, void *logits, int ldl, const int *targets, int V, int v0, const float *stats,
                          int N, int nt, float scale, int bf) {
    int n = blockIdx.x;
    void *row = bf ? (void *)((bf16 *)logits + (size_t)n * ldl) : (void *)((float *)logits + (size_t)n * ldl);
    float M, lt;
    double sum;
    if (!shard_combine(stats, N, n, nt, &M, &lt, &sum)) {
        if (threadIdx.x == 0) losses[n] = NAN;
        if (scale != 0.0f)
            for (int j = threadIdx.x; j < V; j += blockDim.x) st(row, j, NAN, bf);
        return;
    }
    if (threadIdx.x == 0) losses[n] = (float)((double)M + log(sum) - (double)lt);
    if (scale == 0.0f) return;
    unsigned t = (unsigned)(targets[n] - v0);
    float f = (float)((double)scale / sum);
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        float e = expf(ld(row, j, bf) - M);
        st(row, j, (unsigned)j == t ? (float)((double)scale * ((double)e / sum - 1.0)) : e * f, bf);
    }
}

/* The shard kernels for bf16 rows with ld % 8 == 0 (16-byte aligned rows, as crossentropy8's):
 * 16-byte loads and the SFU's exps (ce_exp), each chunk's 8 exps summed in fp32 and the
 * chunks in double. The row is read twice (the max, then the exps: the second pass mostly
 * from L2); the generic kernels' scalar loads and expf made the vocabulary-parallel head's
 * two passes cost 4x half of the one-GPU kernel (TP-efficiency model, two H200s). Padding
 * past V in the last chunk is read but never used or written. */
static __device__ __forceinline__ int ce8_chunk(const bf16 *row, int k, int V, float v[8]) {
    unpack8_bf16(v, *(const uint4 *)(row + 8 * (size_t)k));
    return 8 * k + 8 <= V ? 8 : V - 8 * k;
}
static __global__ void __launch_bounds__(CE8_BLOCK)
crossentropy8_shard_stats_kernel(float *stats, const bf16 *logits, int ldl, const int *targets, int V, int v0) {
    int n = blockIdx.x, nch = (V + 7) / 8;
    const bf16 *row = logits + (size_t)n * ldl;
    unsigned t = (unsigned)(targets[n] - v0);
    float mx = -INFINITY;
    int bad = 0;
    for (int k = threadIdx.x; k < nch; k += blockDim.x) {
        float v[8];
        int m = ce8_chunk(row, k, V, v);
        for (int e = 0; e < m; e++) mx = fmaxf(mx, v[e]), bad |= v[e] != v[e];
    }
    mx = block_max(mx);
    bad = __syncthreads_or(bad);
    if (bad || mx == INFINITY) mx = NAN;
    double sum = 0.0;
    if (mx == mx && mx != -INFINITY) {
        const float mxl = mx * CE_LOG2E;
        for (int k = threadIdx.x; k < nch; k += blockDim.x) {
            float v[8], cs = 0.0f;
            int m = ce8_chunk(row, k, V, v);
            if (m == 8) {
#pragma unroll
                for (int e = 0; e < 8; e++) cs += ce_exp(v[e], mxl);
            } else
                for (int e = 0; e < m; e++) cs += ce_exp(v[e], mxl);
            sum += (double)cs;
        }
    }
    sum = block_sum_double(sum);
    if (threadIdx.x == 0) {
        stats[3 * (size_t)n] = mx;
        stats[3 * (size_t)n + 1] = (float)sum;
        stats[3 * (size_t)n + 2] = t < (unsigned)V ? __bfloat162float(row[t]) : 0.0f;
    }
}

static __global__ void __launch_bounds__(CE8_BLOCK)
crossentropy8_shard_kernel(float *losses, bf16 *logits, int ldl, const int *targets, int V, int v0, const float *stats,
                           int N, int nt, float scale) {
    int n = blockIdx.x, nch = (V + 7) / 8;
    bf16 *row = logits + (size_t)n * ldl;
    float M, lt;
    double sum;
    if (!shard_combine(stats, N, n, nt, &M, &lt, &sum)) {
        if (threadIdx.x == 0) losses[n] = NAN;
        if (scale != 0.0f)
            for (int j = threadIdx.x; j < V; j += blockDim.x) row[j] = __float2bfloat16(NAN);
        return;
    }
    if (threadIdx.x == 0) losses[n] = (float)((double)M + log(sum) - (double)lt);
    if (scale == 0.0f) return;
    unsigned t = (unsigned)(targets[n] - v0);
    float f = (float)((double)scale / sum);
    const float Ml = M * CE_LOG2E;
    for (int k = threadIdx.x; k < nch; k += blockDim.x) {
        float v[8];
        int m = ce8_chunk(row, k, V, v), j0 = 8 * k;
#pragma unroll
        for (int e = 0; e < 8; e++)
            v[e] = (unsigned)(j0 + e) == t ? (float)((double)scale * ((double)expf(v[e] - M) / sum - 1.0))
                                           : ce_exp(v[e], Ml) * f;
        if (m == 8) *(uint4 *)(row + j0) = pack8_bf16(v);
        else
            for (int e = 0; e < m; e++) row[j0 + e] = __float2bfloat16(v[e]);
    }
}
