/* bench_ops — CPU op throughput at the sizes of a training step (E=256, 4 heads, B*T=4096).
 * Usage: bench_ops [threads]   (0 or absent = all cores)
 * Prints GFLOP/s of sgemm (the step's matmuls, lm_head and a 2048^3 peak) as op_matmul runs
 * it and with OpenBLAS's own threads; the attention kernels, with a serial-over-heads
 * threaded-sgemm variant for comparison; the memory-bound ops; and whether an OpenMP op
 * right after an sgemm slows either down. */
#include "ops.h"
#include "util.h"

#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static Rng rng;

static float *randf(size_t n, float s) {
    float *x = xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = s * rng_normal(&rng);
    return x;
}

/* Runs fn at least `reps` times and for at least 0.3 s after one warm-up; seconds per call. */
#define TIME(secs, reps, body)                                                               \
    do {                                                                                     \
        body;                                                                                \
        int n_ = 0;                                                                          \
        double t0_ = now_seconds(), t_;                                                      \
        do { body; n_++; t_ = now_seconds() - t0_; } while (n_ < (reps) || t_ < 0.3);        \
        secs = t_ / n_;                                                                      \
    } while (0)

static int n_threads;

/* OpenBLAS's own pthread pool instead of the backend's OpenMP split, for comparison. */
static void blas_own_threads(int on) { openblas_set_num_threads(on ? n_threads : 1); }
static void blas_fwd(float *out, const float *inp, const float *w, int N, int C, int OC) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, C, 1.0f, inp, C, w, C, 0.0f, out, OC);
}

static void bench_matmul(const char *name, int N, int C, int OC) {
    float *inp = randf((size_t)N * C, 1.0f), *w = randf((size_t)OC * C, 0.05f);
    float *out = xmalloc((size_t)N * OC * sizeof(float)), *dout = randf((size_t)N * OC, 1.0f);
    float *dinp = xcalloc((size_t)N * C, sizeof(float)), *dw = xcalloc((size_t)OC * C, sizeof(float));
    double flops = 2.0 * N * C * OC, tf, tbi, tbw, rf, rbi, rbw;
    TIME(tf, 3, op_matmul_forward(out, inp, w, N, C, OC));
    TIME(tbi, 3, op_matmul_backward(dinp, NULL, dout, inp, w, N, C, OC));
    TIME(tbw, 3, op_matmul_backward(NULL, dw, dout, inp, w, N, C, OC));
    blas_own_threads(1);
    TIME(rf, 3, blas_fwd(out, inp, w, N, C, OC));
    TIME(rbi, 3, cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f, dout, OC, w, C, 1.0f, dinp, C));
    TIME(rbw, 3, cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f, dw, C));
    blas_own_threads(0);
    printf("  %-20s %5d %5d %6d | %6.1f %6.1f %6.1f | %6.1f %6.1f %6.1f | %8.2f ms\n", name, N, C, OC,
           flops / tf * 1e-9, flops / tbi * 1e-9, flops / tbw * 1e-9, flops / rf * 1e-9, flops / rbi * 1e-9,
           flops / rbw * 1e-9, (tf + tbi + tbw) * 1e3);
    free(inp), free(w), free(out), free(dout), free(dinp), free(dw);
}

/* The alternative the CPU backend did not take: heads one after another, each query
 * block's two products through (multi-threaded) OpenBLAS, softmax in between. */
/* The alternative the CPU backend did not take: heads one after another, each query
 * block's two products through OpenBLAS's own threads, softmax in between (scalar, so
 * the time of the sgemm calls alone is reported too). */
static double serial_sgemm_secs;
static void attention_forward_serial_sgemm(float *out, float *lse, const float *qkv, int B, int T, int NH, int HD,
                                           float *q, float *k, float *v, float *s) {
    int C = NH * HD, BR = 64;
    float scale = 1.0f / sqrtf((float)HD);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++) {
            for (int t = 0; t < T; t++) {
                const float *row = qkv + ((size_t)b * T + t) * 3 * C + (size_t)h * HD;
                for (int d = 0; d < HD; d++) {
                    q[t * HD + d] = row[d] * scale;
                    k[t * HD + d] = row[C + d];
                    v[t * HD + d] = row[2 * C + d];
                }
            }
            for (int i0 = 0; i0 < T; i0 += BR) {
                int i1 = i0 + BR < T ? i0 + BR : T, r = i1 - i0;
                double t0 = now_seconds();
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r, i1, HD, 1.0f, q + (size_t)i0 * HD, HD, k, HD,
                            0.0f, s, T);
                serial_sgemm_secs += now_seconds() - t0;
                for (int i = 0; i < r; i++) {
                    int t = i0 + i;
                    float *p = s + (size_t)i * T, mx = -INFINITY, sum = 0.0f;
                    for (int j = 0; j <= t; j++) mx = fmaxf(mx, p[j]);
                    for (int j = 0; j <= t; j++) sum += (p[j] = expf(p[j] - mx));
                    for (int j = 0; j <= t; j++) p[j] /= sum;
                    for (int j = t + 1; j < i1; j++) p[j] = 0.0f;
                    lse[((size_t)b * NH + h) * T + t] = mx + logf(sum);
                }
                t0 = now_seconds();
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, r, HD, i1, 1.0f, s, T, v, HD, 0.0f,
                            out + ((size_t)b * T + i0) * C + (size_t)h * HD, C);
                serial_sgemm_secs += now_seconds() - t0;
            }
        }
}

static void bench_attention(int B, int T, int NH, int HD) {
    int C = NH * HD;
    size_t nq = (size_t)B * T * 3 * C, no = (size_t)B * T * C;
    float *qkv = randf(nq, 1.0f), *out = xmalloc(no * sizeof(float)), *lse = xmalloc((size_t)B * NH * T * sizeof(float));
    float *dout = randf(no, 1.0f), *dqkv = xcalloc(nq, sizeof(float));
    /* causal: QK^T and PV each 2*HD flops per (query, key<=query) pair; backward 2.5x */
    double pairs = (double)B * NH * T * (T + 1) / 2, ff = 4.0 * HD * pairs, fb = 10.0 * HD * pairs;
    double tf, tb, ts;
    TIME(tf, 3, op_attention_forward(out, lse, qkv, B, T, NH, HD));
    TIME(tb, 3, op_attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, HD));
    float *q = xmalloc((size_t)T * HD * 3 * sizeof(float) + (size_t)64 * T * sizeof(float));
    float *out2 = xmalloc(no * sizeof(float)), *lse2 = xmalloc((size_t)B * NH * T * sizeof(float));
    blas_own_threads(1);
    int calls = 0;
    serial_sgemm_secs = 0.0;
    TIME(ts, 3, (attention_forward_serial_sgemm(out2, lse2, qkv, B, T, NH, HD, q, q + (size_t)T * HD,
                                                 q + (size_t)2 * T * HD, q + (size_t)3 * T * HD), calls++));
    blas_own_threads(0);
    double d = 0.0, n = 0.0;
    for (size_t i = 0; i < no; i++) d += (out[i] - out2[i]) * (out[i] - out2[i]), n += out[i] * out[i];
    printf("  B=%-3d T=%-4d NH=%-2d HD=%-3d | fwd %6.2f ms %5.1f GFLOP/s | bwd %6.2f ms %5.1f GFLOP/s | "
           "serial: fwd %6.2f ms, its sgemms alone %6.2f ms (rel diff %.0e)\n",
           B, T, NH, HD, tf * 1e3, ff / tf * 1e-9, tb * 1e3, fb / tb * 1e-9, ts * 1e3,
           serial_sgemm_secs / calls * 1e3, sqrt(d / n));
    free(qkv), free(out), free(lse), free(dout), free(dqkv), free(q), free(out2), free(lse2);
}

static void bench_pointwise(int N, int C, int H, int V) {
    size_t NC = (size_t)N * C;
    float *x = randf(NC, 1.0f), *w = randf(C, 1.0f), *y = xmalloc(NC * sizeof(float)), *r = xmalloc(N * sizeof(float));
    float *dx = xcalloc(NC, sizeof(float)), *dw = xcalloc(C, sizeof(float));
    float *gu = randf((size_t)N * 2 * H, 1.0f), *o = xmalloc((size_t)N * H * sizeof(float));
    float *dgu = xcalloc((size_t)N * 2 * H, sizeof(float)), *go = randf((size_t)N * H, 1.0f);
    double t1, t2, t3, t4, t5, t6;
    TIME(t1, 5, op_rmsnorm_forward(y, r, x, w, N, C, 1e-5f));
    TIME(t2, 5, op_rmsnorm_backward(dx, dw, y, x, w, r, N, C));
    TIME(t3, 5, op_swiglu_forward(o, gu, N, H));
    TIME(t4, 5, op_swiglu_backward(dgu, go, gu, N, H));
    int rows = 256; /* a chunk of the lm_head logits */
    float *logits = randf((size_t)rows * V, 2.0f), *work = xmalloc((size_t)rows * V * sizeof(float));
    float *losses = xmalloc(rows * sizeof(float));
    int *tg = xmalloc(rows * sizeof(int));
    for (int i = 0; i < rows; i++) tg[i] = (int)(rng_u64(&rng) % (uint64_t)V);
    double tc;
    TIME(t5, 3, memcpy(work, logits, (size_t)rows * V * sizeof(float)));
    TIME(tc, 3, (memcpy(work, logits, (size_t)rows * V * sizeof(float)),
                 op_crossentropy_forward_backward(losses, work, tg, rows, V, 1.0f / rows)));
    tc -= t5;
    size_t np = 10000000;
    float *p = randf(np, 1.0f), *g = randf(np, 1.0f), *m = xcalloc(np, sizeof(float)), *v = xcalloc(np, sizeof(float));
    TIME(t6, 3, op_adamw(p, g, m, v, np, 1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1, 1.0f));
    printf("  rmsnorm N=%d C=%d: fwd %.3f ms, bwd %.3f ms;  swiglu N=%d H=%d: fwd %.3f ms, bwd %.3f ms\n", N, C,
           t1 * 1e3, t2 * 1e3, N, H, t3 * 1e3, t4 * 1e3);
    printf("  crossentropy fwd+bwd %d x %d: %.3f ms (%.2f ns/logit);  adamw: %.2f ns/param\n", rows, V, tc * 1e3,
           tc / ((double)rows * V) * 1e9, t6 / np * 1e9);
    free(x), free(w), free(y), free(r), free(dx), free(dw), free(gu), free(o), free(dgu), free(go);
    free(logits), free(work), free(losses), free(tg), free(p), free(g), free(m), free(v);
}

/* An OpenMP op right after each matmul: does one thread pool's idle spinning slow the other? */
static void bench_interleave(int N, int C) {
    float *inp = randf((size_t)N * C, 1.0f), *w = randf((size_t)3 * C * C, 0.05f);
    float *out = xmalloc((size_t)N * 3 * C * sizeof(float)), *y = xmalloc((size_t)N * C * sizeof(float));
    float *r = xmalloc(N * sizeof(float)), *wn = randf(C, 1.0f);
    double ta, tb, tab, ra, rab;
    TIME(tb, 20, op_rmsnorm_forward(y, r, inp, wn, N, C, 1e-5f));
    TIME(ta, 20, op_matmul_forward(out, inp, w, N, C, 3 * C));
    TIME(tab, 20, (op_matmul_forward(out, inp, w, N, C, 3 * C), op_rmsnorm_forward(y, r, inp, wn, N, C, 1e-5f)));
    blas_own_threads(1);
    TIME(ra, 20, blas_fwd(out, inp, w, N, C, 3 * C));
    TIME(rab, 20, (blas_fwd(out, inp, w, N, C, 3 * C), op_rmsnorm_forward(y, r, inp, wn, N, C, 1e-5f)));
    blas_own_threads(0);
    printf("  qkv sgemm then rmsnorm (%.3f ms alone), per pair: OpenMP split %.3f ms (sgemm alone %.3f);"
           " OpenBLAS threads %.3f ms (sgemm alone %.3f)\n",
           tb * 1e3, tab * 1e3, ta * 1e3, rab * 1e3, ra * 1e3);
    free(inp), free(w), free(out), free(y), free(r), free(wn);
}

int main(int argc, char **argv) {
    n_threads = argc > 1 ? atoi(argv[1]) : 0;
    if (n_threads <= 0) n_threads = omp_get_num_procs();
    ops_init("cpu", n_threads, NULL, 0);
    rng_seed(&rng, 1);
    printf("bench_ops: backend %s, %d threads\n", ops_backend_name(), n_threads);
    int B = 16, T = 256, E = 256, H = (int)(1.5 * E), V = 50257, N = B * T;
    printf("sgemm GFLOP/s at the sizes of one training step (E=%d, B*T=%d):\n", E, N);
    printf("  %-20s %5s %5s %6s | %-20s | %-20s | %s\n", "", "N", "C", "OC", "op_matmul fwd dinp dw",
           "OpenBLAS-threaded", "op_matmul total");
    bench_matmul("qkv_proj", N, E, 3 * E);
    bench_matmul("att_out_proj", N, E, E);
    bench_matmul("gate_proj / up_proj", N, E, H);
    bench_matmul("down_proj", N, H, E);
    bench_matmul("lm_head", N, E, V);
    bench_matmul("peak (square)", 2048, 2048, 2048);
    printf("attention (hand-written, parallel over (b, h)) vs serial heads + OpenBLAS-threaded sgemm:\n");
    bench_attention(16, 256, 4, 64);
    bench_attention(8, 256, 8, 64);
    bench_attention(2, 1024, 8, 64);
    printf("memory-bound ops:\n");
    bench_pointwise(N, E, H, V);
    printf("thread pools:\n");
    bench_interleave(N, E);
    return 0;
}
