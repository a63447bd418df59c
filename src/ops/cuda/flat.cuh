/* src/ops/cuda/flat.cuh: sum of squares, scale, add, the fp32 -> bf16 copy and row copies.
 * Part of ops_cuda.cu, which includes it at this point of its one translation unit (after
 * the helpers it uses): not a header to include anywhere else. */
/* ------------------------------------------------------------------------------------ */
/* flat-buffer helpers                                                                   */

/* sum of squares: a grid whose size depends only on n (never on the card), each thread's
 * strided part in double, block sums in double, then one block adds the partials. */
#define SUMSQ_BLOCK 256
#define SUMSQ_MAX_BLOCKS 1024
static __global__ void sumsq_partial_kernel(double *part, const void *x, size_t n, int sbf) {
    double s = 0.0;
    GRID_STRIDE(i, n) {
        double xi = ld(x, i, sbf);
        s += xi * xi;
    }
    s = block_sum_double(s);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}
/* the same on 16-byte vectors (x 16-byte aligned): n / 8 vectors, then the n % 8 last
 * elements by the first threads (the scalar loads ran at a third of the memory's speed) */
static __global__ void sumsq8_partial_kernel(double *part, const void *x, size_t n, int sbf) {
    double s = 0.0;
    size_t nv = n / 8;
    GRID_STRIDE(j, nv) {
        float a[8];
        ld8(a, x, 8 * j, sbf);
#pragma unroll
        for (int e = 0; e < 8; e++) s += (double)a[e] * (double)a[e];
    }
    size_t i = 8 * nv + (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        double xi = ld(x, i, sbf);
        s += xi * xi;
    }
    s = block_sum_double(s);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}
static __global__ void sumsq_final_kernel(double *out, const double *part, int nb) {
    double s = 0.0;
    for (int i = threadIdx.x; i < nb; i += blockDim.x) s += part[i];
    s = block_sum_double(s);
    if (threadIdx.x == 0) out[0] = s;
}

static __global__ void scale_kernel(void *x, size_t n, float s, int sbf) {
    GRID_STRIDE(i, n) st(x, i, __fmul_rn(ld(x, i, sbf), s), sbf);
}
static __global__ void add_kernel(void *y, const void *x, size_t n, int bf) {
    GRID_STRIDE(i, n) st(y, i, __fadd_rn(ld(y, i, bf), ld(x, i, bf)), bf);
}
/* the same on pairs (n2 = n / 2, n even) */
static __global__ void add2_kernel(void *y, const void *x, size_t n2, int bf) {
    GRID_STRIDE(i, n2) {
        float2 a = ld2(y, 2 * i, bf), b = ld2(x, 2 * i, bf);
        st2(y, 2 * i, make_float2(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y)), bf);
    }
}
/* scale and add on 16-byte vectors (pointers 16-byte aligned): n / 8 vectors, then the
 * n % 8 last elements by the first threads. */
static __global__ void scale8_kernel(void *x, size_t n, float s, int sbf) {
    size_t nv = n / 8;
    GRID_STRIDE(j, nv) {
        float a[8];
        ld8(a, x, 8 * j, sbf);
#pragma unroll
        for (int e = 0; e < 8; e++) a[e] = __fmul_rn(a[e], s);
        st8(x, 8 * j, a, sbf);
    }
    size_t i = 8 * nv + (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) st(x, i, __fmul_rn(ld(x, i, sbf), s), sbf);
}
static __global__ void add8_kernel(void *y, const void *x, size_t n, int bf) {
    size_t nv = n / 8;
    GRID_STRIDE(j, nv) {
        float a[8], b[8];
        ld8(a, y, 8 * j, bf);
        ld8(b, x, 8 * j, bf);
#pragma unroll
        for (int e = 0; e < 8; e++) a[e] = __fadd_rn(a[e], b[e]);
        st8(y, 8 * j, a, bf);
    }
    size_t i = 8 * nv + (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) st(y, i, __fadd_rn(ld(y, i, bf), ld(x, i, bf)), bf);
}
static __global__ void to_act_kernel(void *dst, const float *src, size_t n, int bf) {
    GRID_STRIDE(i, n) st(dst, i, src[i], bf);
}

/* rows picked by an index list: gather (dst row i = src row rows[i]) or scatter (dst row
 * rows[i] = src row i); a block per row (striding), in 16-byte words or in bytes */
static __global__ void copy_rows16_kernel(uint4 *dst, const uint4 *src, const int *rows, size_t n, size_t words,
                                          int scatter) {
    for (size_t i = blockIdx.x; i < n; i += gridDim.x) {
        size_t r = (size_t)rows[i], d = scatter ? r : i, s = scatter ? i : r;
        for (size_t j = threadIdx.x; j < words; j += blockDim.x) dst[d * words + j] = src[s * words + j];
    }
}
static __global__ void copy_rows_kernel(unsigned char *dst, const unsigned char *src, const int *rows, size_t n,
                                        size_t bytes, int scatter) {
    for (size_t i = blockIdx.x; i < n; i += gridDim.x) {
        size_t r = (size_t)rows[i], d = scatter ? r : i, s = scatter ? i : r;
        for (size_t j = threadIdx.x; j < bytes; j += blockDim.x) dst[d * bytes + j] = src[s * bytes + j];
    }
}

/* op_sum_parts: y = the k parts added in order in fp32, rounded once (y may be part 0) */
struct SumParts { const void *p[OPS_SUM_PARTS]; };
static __global__ void sum_parts_kernel(void *y, SumParts x, int k, size_t n, int bf) {
    GRID_STRIDE(i, n) {
        float a = ld(x.p[0], i, bf);
        for (int j = 1; j < k; j++) a = __fadd_rn(a, ld(x.p[j], i, bf));
        st(y, i, a, bf);
    }
}
static __global__ void sum_parts8_kernel(void *y, SumParts x, int k, size_t n8, int bf) {
    GRID_STRIDE(i, n8) {
        float a[8], b[8];
        ld8(a, x.p[0], 8 * i, bf);
        for (int j = 1; j < k; j++) {
            ld8(b, x.p[j], 8 * i, bf);
#pragma unroll
            for (int e = 0; e < 8; e++) a[e] = __fadd_rn(a[e], b[e]);
        }
        st8(y, 8 * i, a, bf);
    }
}

/* The reduction half of the copy-engine all-reduce: D blocks of c elements summed in rank
 * order in fp32, scaled, into dst (cuda_sum_blocks). */
static __global__ void sum_blocks_kernel(void *dst, const void *src, size_t c, int D, float s, int bf) {
    GRID_STRIDE(i, c) {
        float a = 0.0f;
        for (int k = 0; k < D; k++) a = __fadd_rn(a, ld(src, (size_t)k * c + i, bf));
        st(dst, i, __fmul_rn(a, s), bf);
    }
}
static __global__ void sum_blocks8_kernel(void *dst, const void *src, size_t c, int D, float s, int bf) {
    GRID_STRIDE(j, c / 8) {
        float a[8] = {0, 0, 0, 0, 0, 0, 0, 0}, b[8];
        for (int k = 0; k < D; k++) {
            ld8(b, src, (size_t)k * c + 8 * j, bf);
#pragma unroll
            for (int e = 0; e < 8; e++) a[e] = __fadd_rn(a[e], b[e]);
        }
#pragma unroll
        for (int e = 0; e < 8; e++) a[e] = __fmul_rn(a[e], s);
        st8(dst, 8 * j, a, bf);
    }
}
