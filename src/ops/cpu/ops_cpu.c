/* ops_cpu — the reference backend: fp32, OpenMP across cores, OpenBLAS for the big matmuls.
 *
 * Threading: OpenMP only. OpenBLAS is set to one thread and called from inside OpenMP
 * regions, each thread on its own slab of a matmul's output (see cpu_init).
 * Determinism: no atomics; every reduction has a fixed order that does not depend on the
 * thread count (per-channel or per-row ownership, or fixed blocks summed in block order).
 */
#include "ops.h"
#include "moe_cpu.h"
#include "util.h"

#include <cblas.h>
#ifdef __AVX__
#include <immintrin.h>
#endif
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* GCC will not vectorize a loop that compares floats (exp_f32's clamps) unless FP
 * comparisons may be treated as non-trapping; nothing here reads FP exception flags. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
/* FMAs for the attention micro-kernel only (-std=c11 turns contraction off); the
 * elementwise ops keep separately rounded multiplies and adds, as PyTorch's kernels do. */
#define FP_CONTRACT __attribute__((optimize("fp-contract=fast")))
#else
#define FP_CONTRACT
#endif
#define ALWAYS_INLINE inline __attribute__((always_inline))

/* One pool of threads: OpenMP's. OpenBLAS runs single-threaded inside OpenMP regions, each
 * thread on its own slab of the output. (With OpenBLAS's own pthread pool as well, libgomp's
 * idle spinning after every region takes the cores from OpenBLAS's workers: an sgemm right
 * after an OpenMP op ran about 2x slower.) */
static int g_blas_single; /* OpenBLAS set to one thread (by ops_init, or lazily) */

static int cpu_init(int n_threads, char *err, size_t errlen) {
    (void)err, (void)errlen;
    if (n_threads <= 0) n_threads = omp_get_num_procs();
    omp_set_num_threads(n_threads);
    openblas_set_num_threads(1);
    g_blas_single = 1;
    return 0;
}

/* exp(x) in fp32 without a libm call, so loops that use it vectorize: Cody-Waite range
 * reduction and the Cephes polynomial, max error ~1.5 ulp. Saturates above 88.37, and
 * returns exactly 0 below -87.33 (including -inf). Inputs must not be NaN. */
static inline float exp_f32(float x) {
    const float lo = -87.33654f, hi = 88.37626f;
    float xc = x < lo ? lo : (x > hi ? hi : x);
    float n = floorf(xc * 1.44269504088896341f + 0.5f);
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) * (1 << 23);
    float s;
    memcpy(&s, &bits, sizeof s);
    float y = p * s;
    return x < lo ? 0.0f : y;
}

/* ------------------------------------------------------------------------------------ */
/* embedding                                                                             */

static void cpu_embedding_forward(float *out, const int *tokens, const float *wte, int N, int C) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        memcpy(out + (size_t)n * C, wte + (size_t)tokens[n] * C, (size_t)C * sizeof(float));
}

static void cpu_embedding_forward_shard(float *out, const int *tokens, const float *wte, int N, int C, int lo,
                                        int rows) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        unsigned r = (unsigned)(tokens[n] - lo);
        if (r < (unsigned)rows) memcpy(out + (size_t)n * C, wte + (size_t)r * C, (size_t)C * sizeof(float));
        else memset(out + (size_t)n * C, 0, (size_t)C * sizeof(float));
    }
}

static void cpu_embedding_backward(float *dwte, const float *dout, const int *tokens, int N, int C) {
    if (!dwte) return;
    /* Each thread owns a range of channels (multiples of 16 floats = one cache line) and
     * walks the tokens in order, so repeated tokens add up in a fixed order. */
#pragma omp parallel
    {
        int nt = omp_get_num_threads(), tid = omp_get_thread_num();
        int lines = (C + 15) / 16;
        int c0 = (int)((long)lines * tid / nt) * 16, c1 = (int)((long)lines * (tid + 1) / nt) * 16;
        if (c1 > C) c1 = C;
        for (int n = 0; n < N; n++) {
            float *dst = dwte + (size_t)tokens[n] * C;
            const float *src = dout + (size_t)n * C;
            for (int c = c0; c < c1; c++) dst[c] += src[c];
        }
    }
}

/* ------------------------------------------------------------------------------------ */
/* rmsnorm                                                                               */

static void rmsnorm_row(float *o, float *rstd, const float *xr, const float *w, int C, float eps) {
    double ss = 0.0;
#pragma omp simd reduction(+ : ss)
    for (int c = 0; c < C; c++) ss += (double)xr[c] * xr[c];
    float r = 1.0f / sqrtf((float)(ss / C) + eps);
    *rstd = r;
    for (int c = 0; c < C; c++) o[c] = (xr[c] * r) * w[c];
}

static void cpu_rmsnorm_forward(float *out, float *rstd, const float *x, const float *w, int N, int C, float eps) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) rmsnorm_row(out + (size_t)n * C, &rstd[n], x + (size_t)n * C, w, C, eps);
}

/* cpu_add's sums, then the same rows: bitwise the two ops one after the other. */
static void cpu_add_rmsnorm_forward(float *res, float *out, float *rstd, const float *branch, const float *w, int N,
                                    int C, float eps) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        float *xr = res + (size_t)n * C;
        const float *br = branch + (size_t)n * C;
        for (int c = 0; c < C; c++) xr[c] += br[c];
        rmsnorm_row(out + (size_t)n * C, &rstd[n], xr, w, C, eps);
    }
}

/* dw is reduced over a fixed number of row blocks (independent of the thread count),
 * each block's partial sum in row order, the partials summed in block order. */
#define RMSNORM_DW_BLOCKS 64

static void cpu_rmsnorm_backward(float *dx, float *dw, const float *dout, const float *x, const float *w,
                                 const float *rstd, int N, int C) {
    if (!dx && !dw) return;
    int nb = N < RMSNORM_DW_BLOCKS ? N : RMSNORM_DW_BLOCKS;
    float *part = dw ? xaligned_alloc((size_t)nb * C * sizeof(float)) : NULL;
#pragma omp parallel for schedule(static)
    for (int b = 0; b < nb; b++) {
        int n0 = (int)((long)N * b / nb), n1 = (int)((long)N * (b + 1) / nb);
        float *pw = part ? part + (size_t)b * C : NULL;
        for (int n = n0; n < n1; n++) {
            const float *xr = x + (size_t)n * C, *g = dout + (size_t)n * C;
            float r = rstd[n];
            if (dx) {
                double dot = 0.0;
#pragma omp simd reduction(+ : dot)
                for (int c = 0; c < C; c++) dot += (double)g[c] * w[c] * xr[c];
                float coef = (float)((double)r * r * r * dot / C);
                float *d = dx + (size_t)n * C;
                for (int c = 0; c < C; c++) d[c] += r * w[c] * g[c] - coef * xr[c];
            }
            if (pw)
                for (int c = 0; c < C; c++) pw[c] += g[c] * (xr[c] * r);
        }
    }
    if (dw) {
#pragma omp parallel for schedule(static)
        for (int c = 0; c < C; c++) {
            float s = 0.0f;
            for (int b = 0; b < nb; b++) s += part[(size_t)b * C + c];
            dw[c] += s;
        }
        free(part);
    }
}

/* ------------------------------------------------------------------------------------ */
/* matmul: OpenBLAS, split over the OpenMP threads                                       */

/* C[M, N] = op(A) @ op(B) + beta * C (row-major), each thread computing a contiguous slab of
 * C's rows, or of its columns when there are fewer rows, with single-threaded sgemm. The
 * split never cuts the K dimension, so every element is one thread's dot product. */
static void sgemm_split(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M, int N, int K, const float *A, int lda,
                        const float *B, int ldb, float beta, float *C, int ldc) {
    if (!g_blas_single) { /* never a multi-threaded OpenBLAS inside OpenMP threads */
        openblas_set_num_threads(1);
        g_blas_single = 1;
    }
    int by_rows = M >= N;
    int units = ((by_rows ? M : N) + 15) / 16; /* slabs are multiples of 16 rows/columns */
#pragma omp parallel
    {
        int nt = omp_get_num_threads(), tid = omp_get_thread_num();
        if (nt > units) nt = units;
        if (tid < nt) {
            int total = by_rows ? M : N;
            int a = (int)((long)units * tid / nt) * 16, b = (int)((long)units * (tid + 1) / nt) * 16;
            if (b > total) b = total;
            if (by_rows)
                cblas_sgemm(CblasRowMajor, ta, tb, b - a, N, K, 1.0f,
                            ta == CblasNoTrans ? A + (size_t)a * lda : A + a, lda, B, ldb, beta,
                            C + (size_t)a * ldc, ldc);
            else
                cblas_sgemm(CblasRowMajor, ta, tb, M, b - a, K, 1.0f, A, lda,
                            tb == CblasNoTrans ? B + a : B + (size_t)a * ldb, ldb, beta, C + a, ldc);
        }
    }
}

/* out's (dout's) rows are ldo >= OC floats apart */
static void cpu_matmul_forward(float *out, int ldo, const float *inp, const float *w, int N, int C, int OC) {
    if (N <= 0 || OC <= 0) return;
    if (C <= 0) {
        for (int n = 0; n < N; n++) memset(out + (size_t)n * ldo, 0, (size_t)OC * sizeof(float));
        return;
    }
    sgemm_split(CblasNoTrans, CblasTrans, N, OC, C, inp, C, w, C, 0.0f, out, ldo);
}

static void cpu_matmul_backward(float *dinp, float *dw, const float *dout, int ldo, const float *inp,
                                const float *w, int N, int C, int OC) {
    if (N <= 0 || C <= 0 || OC <= 0) return;
    if (dinp) sgemm_split(CblasNoTrans, CblasNoTrans, N, C, OC, dout, ldo, w, C, 1.0f, dinp, C);
    if (dw) sgemm_split(CblasTrans, CblasNoTrans, OC, C, N, dout, ldo, inp, C, 1.0f, dw, C);
}

/* ------------------------------------------------------------------------------------ */
/* mixture of experts: the router's and the experts' products (the rest: moe_cpu.c)        */

static void cpu_moe_router_forward(float *logits, const void *x, const void *w, int N, int E, int X) {
    cpu_matmul_forward(logits, X, x, w, N, E, X);
}
static void cpu_moe_router_backward(void *dx, void *dw, const float *dlogits, const void *x, const void *w, int N,
                                    int E, int X) {
    cpu_matmul_backward(dx, dw, dlogits, X, x, w, N, E, X);
}
static void cpu_moe_matmul_forward(void *out, const void *inp, const void *w, size_t wstride, const int *off, int X,
                                   int C, int OC) {
    for (int e = 0; e < X; e++)
        if (off[e + 1] > off[e])
            cpu_matmul_forward((float *)out + (size_t)off[e] * OC, OC, (const float *)inp + (size_t)off[e] * C,
                               (const float *)w + e * wstride, off[e + 1] - off[e], C, OC);
}
static void cpu_moe_matmul_backward(void *dinp, void *dw, size_t wstride, const void *dout, const void *inp,
                                    const void *w, const int *off, int X, int C, int OC) {
    for (int e = 0; e < X; e++) {
        int r0 = off[e], n = off[e + 1] - off[e];
        if (n <= 0) continue;
        float *di = dinp ? (float *)dinp + (size_t)r0 * C : NULL;
        if (di) memset(di, 0, (size_t)n * C * sizeof(float));
        cpu_matmul_backward(di, dw ? (float *)dw + e * wstride : NULL, (const float *)dout + (size_t)r0 * OC, OC,
                            (const float *)inp + (size_t)r0 * C, w ? (const float *)w + e * wstride : NULL, n, C, OC);
    }
}

/* ------------------------------------------------------------------------------------ */
/* rope                                                                                  */

static void cpu_rope_tables(float *cos_t, float *sin_t, int T, int HD, float base) {
    int half = HD / 2;
    for (int i = 0; i < half; i++) {
        float inv = 1.0f / powf(base, (float)(2 * i) / (float)HD);
        for (int t = 0; t < T; t++) {
            float f = (float)t * inv;
            cos_t[(size_t)t * half + i] = cosf(f);
            sin_t[(size_t)t * half + i] = sinf(f);
        }
    }
}

/* Rotates the q and k parts of every row by +angle (dir = 1) or -angle (dir = -1). */
static void rope_apply(float *qkv, const float *cos_t, const float *sin_t, int B, int T, int NH, int HD,
                       float dir) {
    int half = HD / 2, C = NH * HD;
#pragma omp parallel for schedule(static)
    for (int bt = 0; bt < B * T; bt++) {
        int t = bt % T;
        float *row = qkv + (size_t)bt * 3 * C;
        const float *cr = cos_t + (size_t)t * half, *sr = sin_t + (size_t)t * half;
        for (int hh = 0; hh < 2 * NH; hh++) { /* q heads, then k heads */
            float *x = row + (size_t)hh * HD;
            for (int i = 0; i < half; i++) {
                float x0 = x[2 * i], x1 = x[2 * i + 1], c = cr[i], s = dir * sr[i];
                x[2 * i] = x0 * c - x1 * s;
                x[2 * i + 1] = x0 * s + x1 * c;
            }
        }
    }
}

static void cpu_rope_forward(float *qkv, const float *cos_t, const float *sin_t, int B, int T, int NH, int HD) {
    rope_apply(qkv, cos_t, sin_t, B, T, NH, HD, 1.0f);
}

static void cpu_rope_backward(float *dqkv, const float *cos_t, const float *sin_t, int B, int T, int NH, int HD) {
    if (dqkv) rope_apply(dqkv, cos_t, sin_t, B, T, NH, HD, -1.0f);
}

/* ------------------------------------------------------------------------------------ */
/* small single-threaded matmul for attention tiles                                       */

/* Called from inside OpenMP regions, where OpenBLAS (pthread build) must not be used.
 * C[M, N] (+)= A[M, K] @ B[K, N]: A's element (i, k) is A[i*ars + k*acs] (so A may be a
 * transposed view), B and C row-major. A 6 x 16 register tile of 12 AVX accumulators. */
#define MM_MR 6
#define MM_NR 16
typedef float v8f __attribute__((vector_size(32), aligned(4), may_alias));

FP_CONTRACT static ALWAYS_INLINE void mm_tile(int mr, int K, const float *A, ptrdiff_t ars, ptrdiff_t acs,
                                             const float *B, ptrdiff_t ldb, float *C, ptrdiff_t ldc,
                                             int accumulate) {
    v8f c[MM_MR][2];
    for (int r = 0; r < mr; r++) c[r][0] = c[r][1] = (v8f){0};
    for (int k = 0; k < K; k++) {
        const float *b = B + (ptrdiff_t)k * ldb;
        v8f b0 = *(const v8f *)b, b1 = *(const v8f *)(b + 8);
        for (int r = 0; r < mr; r++) {
            float a = A[r * ars + k * acs];
            c[r][0] += a * b0;
            c[r][1] += a * b1;
        }
    }
    for (int r = 0; r < mr; r++) {
        v8f *o0 = (v8f *)(C + r * ldc), *o1 = (v8f *)(C + r * ldc + 8);
        if (accumulate) { *o0 += c[r][0]; *o1 += c[r][1]; }
        else { *o0 = c[r][0]; *o1 = c[r][1]; }
    }
}

FP_CONTRACT static void mm(int M, int N, int K, const float *A, ptrdiff_t ars, ptrdiff_t acs, const float *B,
                           ptrdiff_t ldb, float *C, ptrdiff_t ldc, int accumulate) {
    int nfull = N / MM_NR * MM_NR;
    for (int j = 0; j < nfull; j += MM_NR) /* a 16-column strip of B stays in L1 */
        for (int i = 0; i < M; i += MM_MR) {
            const float *a = A + i * ars;
            const float *b = B + j;
            float *c = C + i * ldc + j;
            switch (M - i < MM_MR ? M - i : MM_MR) {
            case 6: mm_tile(6, K, a, ars, acs, b, ldb, c, ldc, accumulate); break;
            case 5: mm_tile(5, K, a, ars, acs, b, ldb, c, ldc, accumulate); break;
            case 4: mm_tile(4, K, a, ars, acs, b, ldb, c, ldc, accumulate); break;
            case 3: mm_tile(3, K, a, ars, acs, b, ldb, c, ldc, accumulate); break;
            case 2: mm_tile(2, K, a, ars, acs, b, ldb, c, ldc, accumulate); break;
            default: mm_tile(1, K, a, ars, acs, b, ldb, c, ldc, accumulate); break;
            }
        }
    if (nfull < N) /* leftover columns (head sizes that are not a multiple of 16) */
        for (int i = 0; i < M; i++)
            for (int j = nfull; j < N; j++) {
                float s = 0.0f;
                for (int k = 0; k < K; k++) s += A[i * ars + k * acs] * B[(ptrdiff_t)k * ldb + j];
                C[i * ldc + j] = accumulate ? C[i * ldc + j] + s : s;
            }
}

/* ------------------------------------------------------------------------------------ */
/* attention                                                                             */

/* Each (b, h) is one task for one thread (so no reductions cross threads). Its q, k, v are
 * copied into contiguous per-thread scratch; queries go in blocks of ATT_BR rows, whose
 * scores against keys 0..end-of-block live in an ATT_BR x T scratch (never T x T). Key
 * tables are stored transposed with the key count padded to 16 (zeros) so the score
 * products use full register tiles. */
#define ATT_BR 64

static int round16(int x) { return (x + 15) / 16 * 16; }

/* copies head h of part `part` (0 = q, 1 = k, 2 = v) of sequence b: dst[t*HD + d], scaled */
static void head_copy(float *dst, const float *qkv, int b, int h, int part, int T, int NH, int HD, float s) {
    int C = NH * HD;
    for (int t = 0; t < T; t++) {
        const float *src = qkv + ((size_t)b * T + t) * 3 * C + (size_t)part * C + (size_t)h * HD;
        for (int d = 0; d < HD; d++) dst[(size_t)t * HD + d] = src[d] * s;
    }
}

/* transposed: dst[d*ld + t], columns T..ld-1 zero */
static void head_copy_t(float *dst, int ld, const float *qkv, int b, int h, int part, int T, int NH, int HD) {
    int C = NH * HD;
    for (int d = 0; d < HD; d++)
        for (int t = T; t < ld; t++) dst[(size_t)d * ld + t] = 0.0f;
    for (int t = 0; t < T; t++) {
        const float *src = qkv + ((size_t)b * T + t) * 3 * C + (size_t)part * C + (size_t)h * HD;
        for (int d = 0; d < HD; d++) dst[(size_t)d * ld + t] = src[d];
    }
}

static void cpu_attention_forward(float *out, float *lse, const float *qkv, int B, int T, int NH, int HD) {
    int C = NH * HD, Tp = round16(T), BR = T < ATT_BR ? T : ATT_BR;
    float scale = 1.0f / sqrtf((float)HD);
#pragma omp parallel
    {
        size_t th = (size_t)T * HD;
        float *q = xmalloc((th * 2 + (size_t)HD * Tp + (size_t)BR * Tp + (size_t)BR * HD) * sizeof(float));
        float *v = q + th, *kt = v + th, *p = kt + (size_t)HD * Tp, *o = p + (size_t)BR * Tp;
#pragma omp for schedule(dynamic, 1)
        for (int bh = 0; bh < B * NH; bh++) {
            int b = bh / NH, h = bh % NH;
            head_copy(q, qkv, b, h, 0, T, NH, HD, scale);
            head_copy_t(kt, Tp, qkv, b, h, 1, T, NH, HD);
            head_copy(v, qkv, b, h, 2, T, NH, HD, 1.0f);
            for (int i0 = 0; i0 < T; i0 += BR) {
                int i1 = i0 + BR < T ? i0 + BR : T, r = i1 - i0;
                mm(r, round16(i1), HD, q + (size_t)i0 * HD, HD, 1, kt, Tp, p, Tp, 0);
                for (int i = 0; i < r; i++) {
                    int t = i0 + i;
                    float *pr = p + (size_t)i * Tp;
                    float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
                    for (int j = 0; j <= t; j++) mx = pr[j] > mx ? pr[j] : mx;
                    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                    for (int j = 0; j <= t; j++) {
                        pr[j] = exp_f32(pr[j] - mx);
                        sum += pr[j];
                    }
                    for (int j = t + 1; j < i1; j++) pr[j] = 0.0f;
                    float inv = 1.0f / sum;
                    for (int j = 0; j <= t; j++) pr[j] *= inv;
                    lse[(size_t)bh * T + t] = mx + logf(sum);
                }
                mm(r, HD, i1, p, Tp, 1, v, HD, o, HD, 0);
                for (int i = 0; i < r; i++)
                    memcpy(out + ((size_t)b * T + i0 + i) * C + (size_t)h * HD, o + (size_t)i * HD,
                           (size_t)HD * sizeof(float));
            }
        }
        free(q);
    }
}

static void cpu_attention_backward(float *dqkv, const float *dout, const float *qkv, const float *out,
                                   const float *lse, int B, int T, int NH, int HD) {
    if (!dqkv) return;
    int C = NH * HD, Tp = round16(T), BR = T < ATT_BR ? T : ATT_BR;
    float scale = 1.0f / sqrtf((float)HD);
#pragma omp parallel
    {
        size_t th = (size_t)T * HD, tt = (size_t)HD * Tp, bt = (size_t)BR * Tp;
        float *q = xmalloc((th * 5 + tt * 2 + bt * 2 + (size_t)BR * HD + (size_t)T) * sizeof(float));
        float *k = q + th, *dO = k + th, *dk = dO + th, *dv = dk + th;
        float *kt = dv + th, *vt = kt + tt, *p = vt + tt, *ds = p + bt, *dq = ds + bt, *D = dq + (size_t)BR * HD;
#pragma omp for schedule(dynamic, 1)
        for (int bh = 0; bh < B * NH; bh++) {
            int b = bh / NH, h = bh % NH;
            head_copy(q, qkv, b, h, 0, T, NH, HD, scale);
            head_copy(k, qkv, b, h, 1, T, NH, HD, 1.0f);
            head_copy_t(kt, Tp, qkv, b, h, 1, T, NH, HD);
            head_copy_t(vt, Tp, qkv, b, h, 2, T, NH, HD);
            for (int t = 0; t < T; t++) {
                const float *g = dout + ((size_t)b * T + t) * C + (size_t)h * HD;
                const float *y = out + ((size_t)b * T + t) * C + (size_t)h * HD;
                float s = 0.0f;
                for (int d = 0; d < HD; d++) {
                    dO[(size_t)t * HD + d] = g[d];
                    s += g[d] * y[d];
                }
                D[t] = s;
            }
            memset(dk, 0, th * 2 * sizeof(float)); /* dk and dv */
            for (int i0 = 0; i0 < T; i0 += BR) {
                int i1 = i0 + BR < T ? i0 + BR : T, r = i1 - i0, n16 = round16(i1);
                mm(r, n16, HD, q + (size_t)i0 * HD, HD, 1, kt, Tp, p, Tp, 0);
                mm(r, n16, HD, dO + (size_t)i0 * HD, HD, 1, vt, Tp, ds, Tp, 0);
                for (int i = 0; i < r; i++) {
                    int t = i0 + i;
                    float *pr = p + (size_t)i * Tp, *dr = ds + (size_t)i * Tp;
                    float l = lse[(size_t)bh * T + t], Dt = D[t];
#pragma omp simd
                    for (int j = 0; j <= t; j++) {
                        pr[j] = exp_f32(pr[j] - l);
                        dr[j] = pr[j] * (dr[j] - Dt);
                    }
                    for (int j = t + 1; j < i1; j++) pr[j] = dr[j] = 0.0f;
                }
                /* dq = scale * dS @ K ; dk += dS^T @ (scale*Q) ; dv += P^T @ dO */
                mm(r, HD, i1, ds, Tp, 1, k, HD, dq, HD, 0);
                mm(i1, HD, r, ds, 1, Tp, q + (size_t)i0 * HD, HD, dk, HD, 1);
                mm(i1, HD, r, p, 1, Tp, dO + (size_t)i0 * HD, HD, dv, HD, 1);
                for (int i = 0; i < r; i++) {
                    float *dst = dqkv + ((size_t)b * T + i0 + i) * 3 * C + (size_t)h * HD;
                    for (int d = 0; d < HD; d++) dst[d] += scale * dq[(size_t)i * HD + d];
                }
            }
            for (int t = 0; t < T; t++) {
                float *dst = dqkv + ((size_t)b * T + t) * 3 * C + (size_t)h * HD;
                for (int d = 0; d < HD; d++) {
                    dst[C + d] += dk[(size_t)t * HD + d];
                    dst[2 * C + d] += dv[(size_t)t * HD + d];
                }
            }
        }
        free(q);
    }
}

/* ------------------------------------------------------------------------------------ */
/* swiglu                                                                                */

static void cpu_swiglu_forward(float *out, const float *gu, int N, int H) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *g = gu + (size_t)n * 2 * H, *u = g + H;
        float *o = out + (size_t)n * H;
#pragma omp simd
        for (int i = 0; i < H; i++) o[i] = g[i] / (1.0f + exp_f32(-g[i])) * u[i];
    }
}

static void cpu_swiglu_backward(float *dgu, const float *dout, const float *gu, int N, int H) {
    if (!dgu) return;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *g = gu + (size_t)n * 2 * H, *u = g + H, *d = dout + (size_t)n * H;
        float *dg = dgu + (size_t)n * 2 * H, *du = dg + H;
#pragma omp simd
        for (int i = 0; i < H; i++) {
            float s = 1.0f / (1.0f + exp_f32(-g[i]));
            float silu = g[i] * s;
            dg[i] += d[i] * u[i] * (s * (1.0f + g[i] * (1.0f - s)));
            du[i] += d[i] * silu;
        }
    }
}

/* ------------------------------------------------------------------------------------ */
/* cross-entropy                                                                         */

/* A row's max and whether any of it is NaN (the comparison skips NaN: the flag catches it). */
static inline float row_max_nan(const float *row, int V, int *bad) {
    float mx = -INFINITY;
    int b = 0;
#pragma omp simd reduction(max : mx) reduction(| : b)
    for (int j = 0; j < V; j++) {
        mx = row[j] > mx ? row[j] : mx;
        b |= row[j] != row[j];
    }
    *bad = b;
    return mx;
}

/* Per row: max, then exp(l - max) in fp32 (stored in place when the gradient is wanted)
 * summed in double; loss and the target's gradient (where 1 - p cancels) in double. A row
 * with a NaN or +inf logit gets a NaN loss (and NaN gradient) instead of garbage. */
static void cpu_crossentropy_forward_backward(float *losses, float *logits, int ld, const int *targets, int N,
                                              int V, float dlogits_scale) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        float *row = logits + (size_t)n * ld;
        int tgt = targets[n];
        int bad;
        float mx = row_max_nan(row, V, &bad);
        if (bad || mx == INFINITY || mx == -INFINITY) {
            losses[n] = NAN;
            if (dlogits_scale != 0.0f)
                for (int j = 0; j < V; j++) row[j] = NAN;
            continue;
        }
        float lt = row[tgt];
        double sum = 0.0;
        if (dlogits_scale != 0.0f) {
#pragma omp simd reduction(+ : sum)
            for (int j = 0; j < V; j++) {
                row[j] = exp_f32(row[j] - mx);
                sum += row[j];
            }
        } else {
#pragma omp simd reduction(+ : sum)
            for (int j = 0; j < V; j++) sum += exp_f32(row[j] - mx);
        }
        double lse = (double)mx + log(sum);
        losses[n] = (float)(lse - (double)lt);
        if (dlogits_scale != 0.0f) {
            float et = row[tgt];
            float f = (float)((double)dlogits_scale / sum);
            for (int j = 0; j < V; j++) row[j] *= f;
            row[tgt] = (float)((double)dlogits_scale * ((double)et / sum - 1.0));
        }
    }
}

/* Vocabulary parallel: this shard's max, sum of exp (as above) and target logit per row. */
static void cpu_crossentropy_shard_stats(float *stats, const float *logits, int ld, const int *targets, int N, int V,
                                         int v0) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *row = logits + (size_t)n * ld;
        int bad;
        float mx = row_max_nan(row, V, &bad);
        double sum = 0.0;
        if (bad || mx == INFINITY) mx = NAN;
        else if (mx != -INFINITY) {
#pragma omp simd reduction(+ : sum)
            for (int j = 0; j < V; j++) sum += exp_f32(row[j] - mx);
        }
        unsigned t = (unsigned)(targets[n] - v0);
        stats[3 * (size_t)n] = mx;
        stats[3 * (size_t)n + 1] = (float)sum;
        stats[3 * (size_t)n + 2] = t < (unsigned)V ? row[t] : 0.0f;
    }
}

/* The shards' statistics combined in shard order: lse = M + log(sum_k s_k e^(m_k - M)). */
static void cpu_crossentropy_shard_backward(float *losses, float *logits, int ld, const int *targets, int N, int V,
                                            int v0, const float *stats, int nt, float scale) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        float *row = logits + (size_t)n * ld;
        float M = -INFINITY, lt = 0.0f;
        int bad = 0;
        for (int k = 0; k < nt; k++) {
            const float *s = stats + 3 * ((size_t)k * N + n);
            bad |= s[0] != s[0];
            M = s[0] > M ? s[0] : M;
            lt += s[2];  /* one shard holds the target, the others add 0 */
        }
        if (bad || M == -INFINITY) {
            losses[n] = NAN;
            if (scale != 0.0f)
                for (int j = 0; j < V; j++) row[j] = NAN;
            continue;
        }
        double sum = 0.0;
        for (int k = 0; k < nt; k++) {
            const float *s = stats + 3 * ((size_t)k * N + n);
            if (s[0] != -INFINITY) sum += (double)s[1] * exp((double)s[0] - (double)M);
        }
        losses[n] = (float)((double)M + log(sum) - (double)lt);
        if (scale == 0.0f) continue;
        unsigned t = (unsigned)(targets[n] - v0);
        float et = t < (unsigned)V ? exp_f32(row[t] - M) : 0.0f;
        float f = (float)((double)scale / sum);
#pragma omp simd
        for (int j = 0; j < V; j++) row[j] = exp_f32(row[j] - M) * f;
        if (t < (unsigned)V) row[t] = (float)((double)scale * ((double)et / sum - 1.0));
    }
}

/* ------------------------------------------------------------------------------------ */
/* adamw                                                                                 */

/* sqrt of n floats in place. (GCC cannot vectorize sqrtf itself without -fno-math-errno.) */
static void sqrt_inplace(float *x, int n) {
    int i = 0;
#ifdef __AVX__
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_sqrt_ps(_mm256_loadu_ps(x + i)));
#endif
    for (; i < n; i++) x[i] = sqrtf(x[i]);
}

/* Follows torch.optim.AdamW's single-tensor path: scalars are computed in double (as
 * Python floats) and rounded to fp32 where the tensor kernels use them; exp_avg is updated
 * with lerp_ and the step with addcdiv_, in their operation order. */
#define ADAMW_BLOCK 1024

/* The step's scalars, the same for every block. */
typedef struct { float decay, w1, w1c, b2, w2, neg_step, bc2_sqrt, eps, scale; int small; } AdamwCoef;

static AdamwCoef adamw_coef(float lr, float beta1, float beta2, float eps, float weight_decay, int step,
                            float grad_scale) {
    double bc1 = 1.0 - pow((double)beta1, step), bc2 = 1.0 - pow((double)beta2, step);
    AdamwCoef c;
    c.decay = weight_decay != 0.0f ? (float)(1.0 - (double)lr * (double)weight_decay) : 1.0f;
    c.w1 = (float)(1.0 - (double)beta1), c.w1c = 1.0f - c.w1; /* exp_avg.lerp_(grad, 1 - beta1) */
    c.small = fabsf(c.w1) < 0.5f;
    c.b2 = beta2, c.w2 = (float)(1.0 - (double)beta2);
    c.neg_step = (float)(-((double)lr / bc1));
    c.bc2_sqrt = (float)sqrt(bc2);
    c.eps = eps, c.scale = grad_scale;
    return c;
}

/* One block of at most ADAMW_BLOCK elements. */
static inline void adamw_block(const AdamwCoef *c, float *p, const float *gb, float *mb, float *vb, int len) {
    float den[ADAMW_BLOCK];
    for (int i = 0; i < len; i++) {
        float g = gb[i] * c->scale;
        float mi = mb[i];
        mb[i] = c->small ? mi + c->w1 * (g - mi) : g - (g - mi) * c->w1c;
        float vi = vb[i] * c->b2;
        vi = vi + c->w2 * g * g;
        vb[i] = vi;
        den[i] = vi;
    }
    sqrt_inplace(den, len);
    for (int i = 0; i < len; i++) {
        float pi = p[i] * c->decay;
        p[i] = pi + c->neg_step * mb[i] / (den[i] / c->bc2_sqrt + c->eps);
    }
}

static void cpu_adamw(float *param, const float *grad, float *m, float *v, size_t n, float lr, float beta1,
                      float beta2, float eps, float weight_decay, int step, float grad_scale) {
    AdamwCoef c = adamw_coef(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
    size_t nb = (n + ADAMW_BLOCK - 1) / ADAMW_BLOCK;
#pragma omp parallel for schedule(static)
    for (size_t b = 0; b < nb; b++) {
        size_t i0 = b * ADAMW_BLOCK;
        int len = (int)(n - i0 < ADAMW_BLOCK ? n - i0 : ADAMW_BLOCK);
        adamw_block(&c, param + i0, grad + i0, m + i0, v + i0, len);
    }
}

/* offload's lean host update (ops.h, adamw_host16): bf16 gradients widened per block (exact),
 * the same arithmetic as cpu_adamw, and the updated parameters rounded to bf16 over the
 * gradients they came from: one pass over the host's buffers, no fp32 gradient copy. */
/* bf16_round as a select, not a branch, so that the loop below vectorises (same results). */
static inline uint16_t bf16_round_sel(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, nan = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : r);
}

static void cpu_adamw_host16(float *param, uint16_t *g16, float *m, float *v, size_t n, float lr, float beta1,
                             float beta2, float eps, float weight_decay, int step, float grad_scale) {
    AdamwCoef c = adamw_coef(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
    size_t nb = (n + ADAMW_BLOCK - 1) / ADAMW_BLOCK;
#pragma omp parallel for schedule(static)
    for (size_t b = 0; b < nb; b++) {
        size_t i0 = b * ADAMW_BLOCK;
        int len = (int)(n - i0 < ADAMW_BLOCK ? n - i0 : ADAMW_BLOCK);
        float g[ADAMW_BLOCK];
        uint16_t *h = g16 + i0;
        const float *p = param + i0;
        int i = 0;
#ifdef __AVX2__
        /* GCC leaves these scalar (the 16-bit loads and stores): 8 at a time by hand, the same bits */
        for (; i + 8 <= len; i += 8)
            _mm256_storeu_ps(g + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                                        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + i))), 16)));
#endif
        for (; i < len; i++) g[i] = bf16_widen(h[i]);
        adamw_block(&c, param + i0, g, m + i0, v + i0, len);
        i = 0;
#ifdef __AVX2__
        const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff), abs = _mm256_set1_epi32(0x7fffffff),
                      inf = _mm256_set1_epi32(0x7f800000), quiet = _mm256_set1_epi32(0x40);
        for (; i + 8 <= len; i += 8) {
            __m256i u = _mm256_castps_si256(_mm256_loadu_ps(p + i));
            __m256i r = _mm256_srli_epi32(
                _mm256_add_epi32(_mm256_add_epi32(u, half), _mm256_and_si256(_mm256_srli_epi32(u, 16), one)), 16);
            __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs), inf);
            r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), quiet), nan);
            /* 32 -> 16 bits (each fits: no saturation), lanes back in order */
            __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
            _mm_storeu_si128((__m128i *)(h + i), _mm256_castsi256_si128(packed));
        }
#endif
        for (; i < len; i++) h[i] = bf16_round_sel(p[i]);
    }
}

/* ------------------------------------------------------------------------------------ */
/* adafactor                                                                             */

/* The rows a segment touches, and row r's columns [*c0, *c1) within it. */
static void af_rows(const AdafactorSeg *s, size_t *r0, size_t *r1) {
    *r0 = s->first / (size_t)s->cols;
    *r1 = (s->first + s->n - 1) / (size_t)s->cols + 1;
}
static const float *af_row_cols(const AdafactorSeg *s, const float *base, size_t r, int *c0, int *c1) {
    size_t lo = r * (size_t)s->cols, hi = lo + (size_t)s->cols, a = s->first, b = s->first + s->n;
    *c0 = (int)(a > lo ? a - lo : 0);
    *c1 = (int)(b < hi ? b - lo : (size_t)s->cols);
    return base + s->off + lo - s->first;  /* column 0 of row r (only [c0, c1) is the segment's) */
}

/* Rows in a chunk of the column sums: each chunk sums its rows into its own partial, and
 * the partials are added in chunk order (the result does not depend on the threads). */
#define AF_CHUNK_ROWS 64

static void cpu_adafactor_sums(float *sums, const void *grad, const AdafactorSeg *s, float scale) {
    const float *g = grad;
    size_t r0, r1;
    af_rows(s, &r0, &r1);
    int C = s->cols;
    if (s->rows == 1) {
        int c0, c1;
        const float *row = af_row_cols(s, g, 0, &c0, &c1);
        for (int j = c0; j < c1; j++) {
            float x = row[j] * scale;
            sums[s->stat + s->col0 + j] += (float)((double)x * x);
        }
        return;
    }
    float *rsum = sums + s->stat, *csum = sums + s->stat + s->rows + s->col0;
#pragma omp parallel for schedule(static)
    for (size_t r = r0; r < r1; r++) {
        int c0, c1;
        const float *row = af_row_cols(s, g, r, &c0, &c1);
        double acc = 0;
#pragma omp simd reduction(+ : acc)
        for (int j = c0; j < c1; j++) {
            float x = row[j] * scale;
            acc += (double)x * x;
        }
        rsum[r] += (float)acc;
    }
    size_t nch = (r1 - r0 + AF_CHUNK_ROWS - 1) / AF_CHUNK_ROWS;
    double *part = xcalloc(nch * (size_t)C, sizeof(double));
#pragma omp parallel for schedule(static)
    for (size_t k = 0; k < nch; k++) {
        double *pc = part + k * (size_t)C;
        size_t ra = r0 + k * AF_CHUNK_ROWS, rb = ra + AF_CHUNK_ROWS < r1 ? ra + AF_CHUNK_ROWS : r1;
        for (size_t r = ra; r < rb; r++) {
            int c0, c1;
            const float *row = af_row_cols(s, g, r, &c0, &c1);
#pragma omp simd
            for (int j = c0; j < c1; j++) {
                float x = row[j] * scale;
                pc[j] += (double)x * x;
            }
        }
    }
#pragma omp parallel for schedule(static)
    for (int j = 0; j < C; j++) {
        double acc = 0;
        for (size_t k = 0; k < nch; k++) acc += part[k * (size_t)C + j];
        csum[j] += (float)acc;
    }
    free(part);
}

/* x = x beta + (1 - beta) (sum / count + eps1), as torch's mul_(beta).add_(mean, alpha=1-beta) */
static inline float af_ema(float x, float sum, float count, float beta, float w, float eps1) {
    return x * beta + w * (sum / count + eps1);
}

static void cpu_adafactor_stats(float *stat, float *fac, const float *sums, int rows, int cols, float beta2t,
                                float eps1) {
    float w = (float)(1.0 - (double)beta2t);
    if (rows == 1) {
        for (int j = 0; j < cols; j++) {
            stat[j] = af_ema(stat[j], sums[j], 1.0f, beta2t, w, eps1);
            fac[j] = 1.0f / sqrtf(stat[j]);
        }
        return;
    }
    double total = 0;
    for (int i = 0; i < rows; i++) {
        stat[i] = af_ema(stat[i], sums[i], (float)cols, beta2t, w, eps1);
        total += stat[i];
    }
    float mean = (float)(total / rows);
    for (int i = 0; i < rows; i++) fac[i] = 1.0f / sqrtf(stat[i] / mean);
    for (int j = 0; j < cols; j++) {
        stat[rows + j] = af_ema(stat[rows + j], sums[rows + j], (float)rows, beta2t, w, eps1);
        fac[rows + j] = 1.0f / sqrtf(stat[rows + j]);
    }
}

/* The factors of element (r, j): fac_r (1 for a vector) and the column's fac_c[j]. */
static inline float af_fac_row(const AdafactorSeg *s, const float *fac, size_t r) {
    return s->rows == 1 ? 1.0f : fac[s->stat + r];
}
static inline const float *af_fac_cols(const AdafactorSeg *s, const float *fac) {
    return fac + s->stat + s->col0 + (s->rows == 1 ? 0 : s->rows);
}

static void cpu_adafactor_rms(double *out, const void *param, const void *grad, const float *fac,
                              const AdafactorSeg *s, float scale) {
    size_t r0, r1;
    af_rows(s, &r0, &r1);
    const float *fc = af_fac_cols(s, fac);
    size_t nr = r1 - r0;
    double *part = xmalloc(2 * nr * sizeof(double));
#pragma omp parallel for schedule(static)
    for (size_t k = 0; k < nr; k++) {
        int c0, c1;
        const float *g = af_row_cols(s, grad, r0 + k, &c0, &c1), *p = af_row_cols(s, param, r0 + k, &c0, &c1);
        float fr = af_fac_row(s, fac, r0 + k);
        double su = 0, sp = 0;
#pragma omp simd reduction(+ : su, sp)
        for (int j = c0; j < c1; j++) {
            float u = g[j] * scale * fr * fc[j];
            su += (double)u * u;
            sp += (double)p[j] * p[j];
        }
        part[2 * k] = su;
        part[2 * k + 1] = sp;
    }
    out[0] = out[1] = 0;
    for (size_t k = 0; k < nr; k++) out[0] += part[2 * k], out[1] += part[2 * k + 1];
    free(part);
}

static void cpu_adafactor_update(void *param, const void *grad, void *m, const float *fac, const AdafactorSeg *s,
                                 float scale, float coef, float decay, float beta1) {
    size_t r0, r1;
    af_rows(s, &r0, &r1);
    const float *fc = af_fac_cols(s, fac);
    float w1 = 1.0f - beta1;
#pragma omp parallel for schedule(static)
    for (size_t r = r0; r < r1; r++) {
        int c0, c1;
        const float *g = af_row_cols(s, grad, r, &c0, &c1);
        float *p = (float *)af_row_cols(s, param, r, &c0, &c1);
        float fr = af_fac_row(s, fac, r);
        if (m) {
            float *mr = (float *)af_row_cols(s, m, r, &c0, &c1);
#pragma omp simd
            for (int j = c0; j < c1; j++) {
                float u = coef * (g[j] * scale * fr * fc[j]);
                mr[j] = mr[j] * beta1 + w1 * u;
                p[j] = p[j] * decay - mr[j];
            }
        } else {
#pragma omp simd
            for (int j = c0; j < c1; j++) p[j] = p[j] * decay - coef * (g[j] * scale * fr * fc[j]);
        }
    }
}

/* ------------------------------------------------------------------------------------ */
/* flat-buffer helpers                                                                   */

#define SUMSQ_CHUNK 65536

static double cpu_sumsq(const float *x, size_t n) {
    size_t nc = (n + SUMSQ_CHUNK - 1) / SUMSQ_CHUNK;
    if (nc == 0) return 0.0;
    double *part = xmalloc(nc * sizeof(double));
#pragma omp parallel for schedule(static)
    for (size_t c = 0; c < nc; c++) {
        size_t i0 = c * SUMSQ_CHUNK, i1 = i0 + SUMSQ_CHUNK < n ? i0 + SUMSQ_CHUNK : n;
        double s = 0.0;
#pragma omp simd reduction(+ : s)
        for (size_t i = i0; i < i1; i++) s += (double)x[i] * x[i];
        part[c] = s;
    }
    double s = 0.0;
    for (size_t c = 0; c < nc; c++) s += part[c];
    free(part);
    return s;
}

static void cpu_scale(float *x, size_t n, float s) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) x[i] *= s;
}

static void cpu_add(float *y, const float *x, size_t n) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) y[i] += x[i];
}

static void cpu_sum_parts(float *y, const float *const *x, int k, size_t n) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        float a = x[0][i];
        for (int j = 1; j < k; j++) a += x[j][i];
        y[i] = a;
    }
}

static void cpu_copy_rows(void *dst, const void *src, const int *rows, size_t n, size_t row_bytes, int scatter) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        size_t r = (size_t)rows[i], d = scatter ? r : i, s = scatter ? i : r;
        memcpy((char *)dst + d * row_bytes, (const char *)src + s * row_bytes, row_bytes);
    }
}

/* ------------------------------------------------------------------------------------ */
/* memory and the backend table                                                          */

static void *cpu_alloc(size_t bytes) { return xaligned_alloc(bytes); }
static void cpu_free(void *p) { free(p); }
static void cpu_zero(void *p, size_t bytes) { memset(p, 0, bytes); }
static void cpu_copy(void *dst, const void *src, size_t bytes) { memcpy(dst, src, bytes); }
static const char *cpu_device_name(void) { return ""; }
static void cpu_synchronize(void) {}

/* The table's activation and state arguments are `void *` (ops.h); on the cpu they are always fp32. */
static void cpu_to_act(void *dst, const float *src, size_t n) { memcpy(dst, src, n * sizeof(float)); }
static void t_embedding_forward(void *out, const int *tokens, const void *wte, int N, int C) {
    cpu_embedding_forward(out, tokens, wte, N, C);
}
static void t_embedding_forward_shard(void *out, const int *tokens, const void *wte, int N, int C, int lo, int rows) {
    cpu_embedding_forward_shard(out, tokens, wte, N, C, lo, rows);
}
static void t_embedding_backward(void *dwte, const void *dout, const int *tokens, int N, int C) {
    cpu_embedding_backward(dwte, dout, tokens, N, C);
}
/* By row: each row's positions in order, so every element's additions are op_embedding_backward's */
static void t_embedding_backward_rows(void *dwte, const void *dout, const int *idx, int nr, int N, int C) {
    const int *off = idx + nr, *pos = off + nr + 1;
    (void)N;
    if (!dwte) return;
#pragma omp parallel for schedule(dynamic, 16)
    for (int i = 0; i < nr; i++) {
        float *d = (float *)dwte + (size_t)idx[i] * C;
        for (int k = off[i]; k < off[i + 1]; k++) {
            const float *g = (const float *)dout + (size_t)pos[k] * C;
            for (int c = 0; c < C; c++) d[c] += g[c];
        }
    }
}
static void t_rmsnorm_forward(void *out, float *rstd, const void *x, const void *w, int N, int C, float eps) {
    cpu_rmsnorm_forward(out, rstd, x, w, N, C, eps);
}
static void t_add_rmsnorm_forward(void *res, void *out, float *rstd, const void *branch, const void *w, int N, int C,
                                  float eps) {
    cpu_add_rmsnorm_forward(res, out, rstd, branch, w, N, C, eps);
}
static void t_rmsnorm_backward(void *dx, void *dw, const void *dout, const void *x, const void *w,
                               const float *rstd, int N, int C) {
    cpu_rmsnorm_backward(dx, dw, dout, x, w, rstd, N, C);
}
static void t_matmul_forward(void *out, int ldo, const void *inp, const void *w, int N, int C, int OC) {
    cpu_matmul_forward(out, ldo, inp, w, N, C, OC);
}
/* acc = 0: zeroed here, then accumulated: the same bits as the caller zeroing first */
static void t_matmul_backward(void *dinp, void *dw, const void *dout, int ldo, const void *inp, const void *w,
                              int N, int C, int OC, int acc) {
    if (!acc && dinp && N > 0 && C > 0) memset(dinp, 0, (size_t)N * C * sizeof(float));
    cpu_matmul_backward(dinp, dw, dout, ldo, inp, w, N, C, OC);
}
static void t_rope_forward(void *qkv, const float *cos_t, const float *sin_t, int B, int T, int NH, int HD) {
    cpu_rope_forward(qkv, cos_t, sin_t, B, T, NH, HD);
}
static void t_rope_backward(void *dqkv, const float *cos_t, const float *sin_t, int B, int T, int NH, int HD) {
    cpu_rope_backward(dqkv, cos_t, sin_t, B, T, NH, HD);
}
static void t_attention_forward(void *out, float *lse, const void *qkv, int B, int T, int NH, int HD) {
    cpu_attention_forward(out, lse, qkv, B, T, NH, HD);
}
static void t_attention_backward(void *dqkv, const void *dout, const void *qkv, const void *out, const float *lse,
                                 int B, int T, int NH, int HD, int acc) {
    if (!acc && dqkv && B > 0 && T > 0) memset(dqkv, 0, (size_t)B * T * 3 * NH * HD * sizeof(float));
    cpu_attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, HD);
}
static void t_swiglu_forward(void *out, const void *gu, int N, int H) { cpu_swiglu_forward(out, gu, N, H); }
static void t_swiglu_backward(void *dgu, const void *dout, const void *gu, int N, int H, int acc) {
    if (!acc && dgu && N > 0 && H > 0) memset(dgu, 0, (size_t)N * 2 * H * sizeof(float));
    cpu_swiglu_backward(dgu, dout, gu, N, H);
}
static void t_crossentropy_forward_backward(float *losses, void *logits, int ld, const int *targets, int N, int V,
                                            float scale) {
    cpu_crossentropy_forward_backward(losses, logits, ld, targets, N, V, scale);
}
static void t_crossentropy_shard_stats(float *stats, const void *logits, int ld, const int *targets, int N, int V,
                                       int v0) {
    cpu_crossentropy_shard_stats(stats, logits, ld, targets, N, V, v0);
}
static void t_crossentropy_shard_backward(float *losses, void *logits, int ld, const int *targets, int N, int V,
                                          int v0, const float *stats, int t, float scale) {
    cpu_crossentropy_shard_backward(losses, logits, ld, targets, N, V, v0, stats, t, scale);
}
static void t_add(void *y, const void *x, size_t n) { cpu_add(y, x, n); }
static void t_sum_parts(void *y, const void *const *x, int k, size_t n) {
    cpu_sum_parts(y, (const float *const *)x, k, n);
}
static void t_adamw(void *param, const void *grad, void *m, void *v, size_t n, float lr, float beta1, float beta2,
                    float eps, float wd, int step, float grad_scale) {
    cpu_adamw(param, grad, m, v, n, lr, beta1, beta2, eps, wd, step, grad_scale);
}
static double t_sumsq(const void *x, size_t n) { return cpu_sumsq(x, n); }
static void t_adafactor_sums(float *sums, const void *grad, const AdafactorSeg *s, float scale) {
    cpu_adafactor_sums(sums, grad, s, scale);
}
static void t_scale(void *x, size_t n, float s) { cpu_scale(x, n, s); }

const OpsBackend ops_backend_cpu = {
    .name = "cpu",
    .host_memory = 1,
    .init = cpu_init,
    .device_name = cpu_device_name,
    .synchronize = cpu_synchronize,
    .device_memory = NULL,
    .device_peak = NULL,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .zero = cpu_zero,
    .copy = cpu_copy,
    .upload = cpu_copy,
    .download = cpu_copy,
    .set_precision = NULL,
    .to_act = cpu_to_act,
    .embedding_forward = t_embedding_forward,
    .embedding_backward = t_embedding_backward,
    .embedding_backward_rows = t_embedding_backward_rows,
    .embedding_forward_shard = t_embedding_forward_shard,
    .rmsnorm_forward = t_rmsnorm_forward,
    .add_rmsnorm_forward = t_add_rmsnorm_forward,
    .rmsnorm_backward = t_rmsnorm_backward,
    .matmul_forward = t_matmul_forward,
    .matmul_backward = t_matmul_backward,
    .rope_tables = cpu_rope_tables,
    .rope_forward = t_rope_forward,
    .rope_backward = t_rope_backward,
    .attention_forward = t_attention_forward,
    .attention_backward = t_attention_backward,
    .swiglu_forward = t_swiglu_forward,
    .swiglu_backward = t_swiglu_backward,
    .crossentropy_forward_backward = t_crossentropy_forward_backward,
    .crossentropy_shard_stats = t_crossentropy_shard_stats,
    .crossentropy_shard_backward = t_crossentropy_shard_backward,
    .adamw = t_adamw,
    .adamw_host16 = cpu_adamw_host16,
    .adafactor_sums = t_adafactor_sums,
    .adafactor_stats = cpu_adafactor_stats,
    .adafactor_rms = cpu_adafactor_rms,
    .adafactor_update = cpu_adafactor_update,
    .sumsq = t_sumsq,
    .scale = t_scale,
    .add = t_add,
    .sum_parts = t_sum_parts,
    .copy_rows = cpu_copy_rows,
    .moe_router_forward = cpu_moe_router_forward,
    .moe_router_backward = cpu_moe_router_backward,
    .moe_topk = cpu_moe_topk,
    .moe_dispatch = cpu_moe_dispatch,
    .moe_stats = cpu_moe_stats,
    .moe_route_backward = cpu_moe_route_backward,
    .moe_matmul_forward = cpu_moe_matmul_forward,
    .moe_matmul_backward = cpu_moe_matmul_backward,
    .moe_combine = cpu_moe_combine,
    .moe_unpermute = cpu_moe_unpermute,
    .moe_gate_backward = cpu_moe_gate_backward,
    .moe_accumulate = cpu_moe_accumulate,
};
