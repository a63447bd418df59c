/* Shared by the bf16 GPU tests (test_ops_bf16.c, test_attn_cudnn.c): inputs already
 * representable in bf16 (so both backends see the same values), device copies of them, and
 * the norm-wise check of a device result against the CPU's fp32 op. Include after test.h,
 * ops.h and util.h; it keeps the random stream `rng` and the CPU backend `cpu`. */
#ifndef MESHTRAIN_TESTS_GPU_BF16_CHECK_H
#define MESHTRAIN_TESTS_GPU_BF16_CHECK_H
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static Rng rng;
static const OpsBackend *cpu = &ops_backend_cpu;

/* random values already representable in bf16, so both backends see the same inputs */
static float *randb(size_t n, float scale) {
    float *x = xmalloc(n * sizeof(float) + 4);
    for (size_t i = 0; i < n; i++) x[i] = bf16_widen(bf16_round(scale * rng_normal(&rng)));
    return x;
}
static float *copyf(const float *x, size_t n) {
    float *y = xmalloc(n * sizeof(float) + 4);
    memcpy(y, x, n * sizeof(float));
    return y;
}
/* device bf16 copy of host floats */
static void *up_act(const float *h, size_t n) {
    uint16_t *b = xmalloc(n * sizeof(uint16_t) + 2);
    for (size_t i = 0; i < n; i++) b[i] = bf16_round(h[i]);
    void *d = op_alloc(n * sizeof(uint16_t));
    op_upload(d, b, n * sizeof(uint16_t));
    free(b);
    return d;
}
static float *up_f32(const float *h, size_t n) {
    float *d = op_alloc(n * sizeof(float));
    op_upload(d, h, n * sizeof(float));
    return d;
}
static void expect_act(const char *what, const char *shape, const void *d, const float *ref, size_t n, double tol) {
    float *h = xmalloc(n * sizeof(float) + 4);
    op_download_act(h, d, n);
    double e = norm_rel_err(h, ref, n);
    printf("    %-22s %-30s err %.2e\n", what, shape, e);
    CHECK(e < tol, "%s %s: norm-wise relative error %.3g vs the fp32 CPU op (tolerance %.0e)", what, shape, e, tol);
    free(h);
}
static void expect_f32(const char *what, const char *shape, const float *d, const float *ref, size_t n, double tol) {
    float *h = xmalloc(n * sizeof(float) + 4);
    op_download(h, d, n * sizeof(float));
    double e = norm_rel_err(h, ref, n);
    printf("    %-22s %-30s err %.2e\n", what, shape, e);
    CHECK(e < tol, "%s %s: norm-wise relative error %.3g vs the fp32 CPU op (tolerance %.0e)", what, shape, e, tol);
    free(h);
}
#endif
