/* src/ops/cuda/adafactor.cuh: the Adafactor kernels (op_adafactor_* in ops.h).
 * Part of ops_cuda.cu, which includes it at this point of its one translation unit (after
 * the helpers it uses): not a header to include anywhere else.
 *
 * A segment covers elements [first, first + n) of a rows x cols tensor; row r's part is
 * columns [c0(r), c1(r)). Reductions are deterministic: a row's sum by one warp, a column's
 * in chunks of AF_CHUNK_ROWS rows (each chunk's by one block, in a fixed order) whose
 * partials one thread adds in chunk order, the sums of u^2 and param^2 in blocks whose
 * partials one block adds; all in double, rounded once to fp32 where they are stored.
 * Parameters, gradients and the first moment are the state type (bf16 with sbf); the
 * statistics and factors fp32. */
#define AF_CHUNK_ROWS 64
#define AF_BLOCK 256
#define AF_MAX_BLOCKS 1024

/* row r (of the segment's rows, from row first / cols) and its columns in the segment */
static __device__ __forceinline__ void af_row_span(size_t first, size_t n, int cols, size_t r, int *c0, int *c1) {
    size_t lo = r * (size_t)cols, a = first, b = first + n;
    *c0 = (int)(a > lo ? a - lo : 0);
    *c1 = (int)(b < lo + cols ? b - lo : (size_t)cols);
}

/* one warp per row: sums[r] += sum of (s g)^2 over the row's part */
static __global__ void af_row_sums_kernel(float *rsum, const void *grad, size_t first, size_t n, int cols,
                                          size_t r0, size_t nr, float scale, int sbf) {
    int lane = threadIdx.x & 31;
    size_t w = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5, nw = ((size_t)gridDim.x * blockDim.x) >> 5;
    for (size_t k = w; k < nr; k += nw) {
        size_t r = r0 + k;
        int c0, c1;
        af_row_span(first, n, cols, r, &c0, &c1);
        double acc = 0.0;
        for (int j = c0 + lane; j < c1; j += 32) {
            float x = __fmul_rn(ld(grad, r * cols + j - first, sbf), scale);
            acc += (double)x * x;
        }
        acc = warp_sum_double(acc);
        if (lane == 0) rsum[r] = __fadd_rn(rsum[r], (float)acc);
    }
}

/* block (32, 8) per 32 columns x AF_CHUNK_ROWS rows: part[chunk][col] */
static __global__ void af_col_part_kernel(double *part, const void *grad, size_t first, size_t n, int cols,
                                          size_t r0, size_t r1, float scale, int sbf) {
    __shared__ double sh[8][33];
    int j = blockIdx.x * 32 + threadIdx.x;
    size_t ra = r0 + (size_t)blockIdx.y * AF_CHUNK_ROWS, rb = ra + AF_CHUNK_ROWS < r1 ? ra + AF_CHUNK_ROWS : r1;
    double acc = 0.0;
    if (j < cols)
        for (size_t r = ra + threadIdx.y; r < rb; r += 8) {
            size_t e = r * cols + j;
            if (e < first || e >= first + n) continue;
            float x = __fmul_rn(ld(grad, e - first, sbf), scale);
            acc += (double)x * x;
        }
    sh[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && j < cols) {
        double s = 0.0;
        for (int y = 0; y < 8; y++) s += sh[y][threadIdx.x];
        part[(size_t)blockIdx.y * cols + j] = s;
    }
}

static __global__ void af_col_final_kernel(float *csum, const double *part, int nch, int cols) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= cols) return;
    double s = 0.0;
    for (int k = 0; k < nch; k++) s += part[(size_t)k * cols + j];
    csum[j] = __fadd_rn(csum[j], (float)s);
}

/* a vector's part: elementwise */
static __global__ void af_vec_sums_kernel(float *sums, const void *grad, size_t first, size_t n, float scale, int sbf) {
    GRID_STRIDE(i, n) {
        float x = __fmul_rn(ld(grad, i, sbf), scale);
        sums[first + i] = __fadd_rn(sums[first + i], (float)((double)x * x));
    }
}

static __device__ __forceinline__ float af_ema(float x, float sum, float count, float beta, float w, float eps1) {
    return __fadd_rn(__fmul_rn(x, beta), __fmul_rn(w, __fadd_rn(__fdiv_rn(sum, count), eps1)));
}

/* one block: the tensor's statistics and factors */
static __global__ void af_stats_kernel(float *stat, float *fac, const float *sums, int rows, int cols, float beta,
                                       float w, float eps1) {
    if (rows == 1) {
        for (int j = threadIdx.x; j < cols; j += blockDim.x) {
            stat[j] = af_ema(stat[j], sums[j], 1.0f, beta, w, eps1);
            fac[j] = __fdiv_rn(1.0f, __fsqrt_rn(stat[j]));
        }
        return;
    }
    double total = 0.0;
    for (int i = threadIdx.x; i < rows; i += blockDim.x) {
        stat[i] = af_ema(stat[i], sums[i], (float)cols, beta, w, eps1);
        total += stat[i];
    }
    float mean = (float)(block_sum_double(total) / rows);
    for (int i = threadIdx.x; i < rows; i += blockDim.x) fac[i] = __fdiv_rn(1.0f, __fsqrt_rn(__fdiv_rn(stat[i], mean)));
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        stat[rows + j] = af_ema(stat[rows + j], sums[rows + j], (float)rows, beta, w, eps1);
        fac[rows + j] = __fdiv_rn(1.0f, __fsqrt_rn(stat[rows + j]));
    }
}

/* element i of the segment: its update direction u = s g fac_r fac_c (fac_r = 1 for a vector) */
typedef struct {
    size_t first, n;
    int rows, cols, small;  /* small: first + n < 2^32 (32-bit index arithmetic) */
    const float *fr, *fc;
} AfSeg;
static __device__ __forceinline__ float af_u(const AfSeg *s, size_t i, float g, float scale) {
    size_t e = s->first + i, r, j;
    if (s->small) r = (unsigned)e / (unsigned)s->cols, j = (unsigned)e - (unsigned)r * (unsigned)s->cols;
    else r = e / (size_t)s->cols, j = e - r * (size_t)s->cols;
    float fr = s->rows == 1 ? 1.0f : s->fr[r];
    return __fmul_rn(__fmul_rn(__fmul_rn(g, scale), fr), s->fc[j]);
}

static __global__ void af_rms_kernel(double *part, const void *param, const void *grad, AfSeg s, float scale, int sbf) {
    double su = 0.0, sp = 0.0;
    GRID_STRIDE(i, s.n) {
        float u = af_u(&s, i, ld(grad, i, sbf), scale), p = ld(param, i, sbf);
        su += (double)u * u;
        sp += (double)p * p;
    }
    su = block_sum_double(su);
    sp = block_sum_double(sp);
    if (threadIdx.x == 0) part[2 * blockIdx.x] = su, part[2 * blockIdx.x + 1] = sp;
}
static __global__ void af_rms_final_kernel(double *out, const double *part, int nb) {
    double su = 0.0, sp = 0.0;
    for (int i = threadIdx.x; i < nb; i += blockDim.x) su += part[2 * i], sp += part[2 * i + 1];
    su = block_sum_double(su);
    sp = block_sum_double(sp);
    if (threadIdx.x == 0) out[0] = su, out[1] = sp;
}

static __global__ void af_update_kernel(void *param, const void *grad, void *m, AfSeg s, float scale, float coef,
                                        float decay, float beta1, float w1, int sbf) {
    GRID_STRIDE(i, s.n) {
        float u = __fmul_rn(coef, af_u(&s, i, ld(grad, i, sbf), scale)), p = __fmul_rn(ld(param, i, sbf), decay);
        if (m) {
            float mi = __fadd_rn(__fmul_rn(ld(m, i, sbf), beta1), __fmul_rn(w1, u));
            st(m, i, mi, sbf);
            st(param, i, __fsub_rn(p, mi), sbf);
        } else {
            st(param, i, __fsub_rn(p, u), sbf);
        }
    }
}
