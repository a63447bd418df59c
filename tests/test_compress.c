/* The gradient compression (src/parallel/compress.c) on a group of one, where its two
 * exchanges are copies: the error-feedback identity holds exactly (the values given plus the
 * residuals held before equal the values returned plus the residuals held after, as real
 * numbers), step after step, for bf16 and int8; bf16 rounds to nearest even; an int8 block of
 * zeros stays zero; a value that is not finite comes back not finite and leaves the residuals
 * as they were. The exchanges themselves, their bytes and the training runs are
 * tests/test_compression.sh's. */
#include <stdlib.h>
#include <string.h>
#include "compress.h"
#include "test.h"
#include "util.h"

#define N 1000  /* (not a multiple of the int8 block: a short last block) */

static void fill(float *x, uint64_t seed) {
    Rng r;
    rng_seed(&r, seed);
    for (int i = 0; i < N; i++) x[i] = (float)(rng_normal(&r) * pow(10.0, (double)(i % 7) - 4));
}

/* sum x + e + f, as real numbers (long double holds these few floats' sum exactly) */
static long double total(float x, float e, float f) { return (long double)x + (long double)e + (long double)f; }

/* What is sent plus the residual is exactly the value compressed: on a fresh compressor the
 * values given equal, as real numbers, the values returned plus the two residuals. Later
 * steps compress the value plus its residual, a sum rounded to fp32: there the identity holds
 * to that rounding. */
static void identity(CompressKind kind) {
    Comm one = {.rank = 0, .size = 1};
    float x[N], in[N], e0[N], f0[N];
    int bad = 0, far = 0;
    for (int trial = 0; trial < 3; trial++) {
        Compressor *c = compress_create(kind, N, 1);
        size_t ne, nf;
        float *e = compress_state(c, &ne, &nf), *f = compress_server_state(c);
        CHECK(ne == N && nf == N, "state sizes %zu %zu", ne, nf);
        for (int step = 0; step < 3; step++) {
            fill(x, 7 + 10 * (uint64_t)trial + (uint64_t)step);
            memcpy(in, x, sizeof x);
            memcpy(e0, e, sizeof e0);
            memcpy(f0, f, sizeof f0);
            CHECK(compress_allreduce(c, &one, x, 0, N), "step %d: not compressed", step);
            for (int i = 0; i < N; i++) {
                long double a = total(in[i], e0[i], f0[i]), b = total(x[i], e[i], f[i]);
                if (step == 0) bad += a != b;
                else far += fabsl(a - b) > 2 * 0x1p-24L * (fabsl((long double)in[i]) + fabsl((long double)e0[i]));
            }
        }
        compress_free(c);
    }
    CHECK(bad == 0, "%s: %d values break the identity", compress_kind_name(kind), bad);
    CHECK(far == 0, "%s: %d values beyond the residual sum's rounding", compress_kind_name(kind), far);
}

static void test_identity_bf16(void) { identity(COMPRESS_BF16); }
static void test_identity_int8(void) { identity(COMPRESS_INT8); }

static void test_bf16_rounding(void) {
    Comm one = {.rank = 0, .size = 1};
    Compressor *c = compress_create(COMPRESS_BF16, 4, 1);
    /* 1 + 2^-8 is halfway between two bf16 values: to the even one (1); 1 + 3 * 2^-8 to 1 + 2^-6 */
    float x[4] = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, -2.5f, 0.0f};
    compress_allreduce(c, &one, x, 0, 4);
    CHECK(x[0] == 1.0f && x[1] == 1.0f + 0x1p-6f && x[2] == -2.5f && x[3] == 0.0f, "%.9g %.9g %.9g %.9g", x[0], x[1],
          x[2], x[3]);
    compress_free(c);
}

static void test_int8_zero_and_nonfinite(void) {
    Comm one = {.rank = 0, .size = 1};
    Compressor *c = compress_create(COMPRESS_INT8, 512, 1);
    size_t ne, nf;
    float *e = compress_state(c, &ne, &nf), x[512];
    for (int i = 0; i < 512; i++) x[i] = i < 256 ? 0.0f : 0.001f * (float)(i - 300);
    compress_allreduce(c, &one, x, 0, 512);
    int zero = 1;
    for (int i = 0; i < 256; i++) zero &= x[i] == 0.0f && e[i] == 0.0f;
    CHECK(zero, "a block of zeros stays zero");
    float e_before[512];
    memcpy(e_before, e, sizeof e_before);
    for (int i = 0; i < 512; i++) x[i] = 1.0f;
    x[300] = INFINITY;
    compress_allreduce(c, &one, x, 0, 512);
    CHECK(!isfinite(x[300]) && !isfinite(x[256]) && isfinite(x[0]), "the overflow's block comes back not finite: %g %g %g",
          x[300], x[256], x[0]);
    CHECK(!memcmp(e + 256, e_before + 256, 256 * sizeof(float)), "the overflow's block keeps its residuals");
    compress_free(c);
}

/* PowerSGD at full rank (every matrix compressed: min_rate 0) gives the values back: P P^T is
 * the projection on each matrix's columns; at rank 1 it does not, and the residual keeps the
 * difference, so what is returned plus the residual is what was given. */
static void test_powersgd_full_rank(void) {
    Comm one = {.rank = 0, .size = 1};
    ModelConfig mc = MODEL_CONFIG(37, 16, 2, 2, 8, 0);
    Model m;
    model_init_layout(&m, &mc, 1, 0);
    size_t n = m.n_flat;
    float *x = xmalloc(n * sizeof(float)), *in = xmalloc(n * sizeof(float));
    Rng r;
    rng_seed(&r, 3);
    for (size_t i = 0; i < n; i++) in[i] = rng_normal(&r);
    for (int rank = 64; rank >= 1; rank -= 63) {
        Compressor *c = compress_create_powersgd(&m, 1, rank, 0.0);
        memcpy(x, in, n * sizeof(float));
        CHECK(compress_allreduce(c, &one, x, 0, n), "rank %d: not compressed", rank);
        size_t ne, nq;
        float *e = compress_state(c, &ne, &nq);
        double d = norm_rel_err(x, in, n), back = 0;
        for (size_t i = 0; i < n; i++) back = fmax(back, fabs((double)x[i] + e[i] - in[i]));
        if (rank == 64) CHECK(d < 1e-5, "full rank: %.3g from the input", d);
        else CHECK(d > 1e-2, "rank 1 changed nothing (%.3g)", d);
        CHECK(back < 1e-5, "rank %d: returned + residual %.3g from the input", rank, back);
        CHECK(nq > 0, "no matrix compressed");
        compress_free(c);
    }
    free(x); free(in);
    model_free(&m);
}

int main(void) {
    RUN(test_identity_bf16);
    RUN(test_identity_int8);
    RUN(test_bf16_rounding);
    RUN(test_int8_zero_and_nonfinite);
    RUN(test_powersgd_full_rank);
    return TEST_SUMMARY();
}
