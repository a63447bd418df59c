/* GPU tests for bf16 compute (precision=mixed): every op through the ops interface with
 * bf16 activations and compute weights on the cuda backend, against the CPU backend's fp32
 * op on the same inputs rounded to bf16. Tolerances are norm-wise relative errors sized
 * for bf16 (8 bits of mantissa: one rounding is ~2e-3); gradients of weights stay fp32.
 * Backward ops must accumulate (their outputs start non-zero). Needs a GPU. */
#include "ops.h"
#include "test.h"
#include "util.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOL 1.5e-2      /* one or two bf16 roundings of the result */
#define TOL_ATT 3e-2    /* attention: probabilities are rounded to bf16 before P @ V */

static Rng rng;
static const OpsBackend *cpu = &ops_backend_cpu;

static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}
static float from_bf16(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* random values already representable in bf16, so both backends see the same inputs */
static float *randb(size_t n, float scale) {
    float *x = xmalloc(n * sizeof(float) + 4);
    for (size_t i = 0; i < n; i++) x[i] = from_bf16(to_bf16(scale * rng_normal(&rng)));
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
    for (size_t i = 0; i < n; i++) b[i] = to_bf16(h[i]);
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

static void test_matmul(void) {
    int shapes[][3] = {{7, 16, 24}, {256, 128, 384}, {1000, 96, 200}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int N = shapes[s][0], C = shapes[s][1], OC = shapes[s][2];
        char sh[64];
        snprintf(sh, sizeof sh, "N=%d C=%d OC=%d", N, C, OC);
        float *x = randb((size_t)N * C, 1.0f), *w = randb((size_t)OC * C, 0.1f), *g = randb((size_t)N * OC, 1.0f);
        float *dx0 = randb((size_t)N * C, 0.1f), *dw0 = randb((size_t)OC * C, 0.1f);
        float *y = xmalloc((size_t)N * OC * sizeof(float)), *dx = copyf(dx0, (size_t)N * C),
              *dw = copyf(dw0, (size_t)OC * C);
        cpu->matmul_forward(y, OC, x, w, N, C, OC);
        cpu->matmul_backward(dx, dw, g, OC, x, w, N, C, OC);
        void *dX = up_act(x, (size_t)N * C), *dW = up_act(w, (size_t)OC * C), *dG = up_act(g, (size_t)N * OC);
        void *dY = op_alloc((size_t)N * OC * 2), *dDX = up_act(dx0, (size_t)N * C);
        float *dDW = up_f32(dw0, (size_t)OC * C);
        op_matmul_forward(dY, dX, dW, N, C, OC);
        op_matmul_backward(dDX, dDW, dG, dX, dW, N, C, OC);
        expect_act("matmul forward", sh, dY, y, (size_t)N * OC, TOL);
        expect_act("matmul dinp (+=)", sh, dDX, dx, (size_t)N * C, TOL);
        expect_f32("matmul dw (fp32, +=)", sh, dDW, dw, (size_t)OC * C, TOL);
        op_free(dX); op_free(dW); op_free(dG); op_free(dY); op_free(dDX); op_free(dDW);
        free(x); free(w); free(g); free(dx0); free(dw0); free(y); free(dx); free(dw);
    }
}

/* The lm_head's form: an odd vocabulary in logit rows padded to ops_logit_stride(V), the
 * cross-entropy on them in place, and the backward reading the padded rows. */
static void test_lm_head_padded(void) {
    int N = 300, C = 64, V = 1001, ld = ops_logit_stride(V);
    char sh[64];
    snprintf(sh, sizeof sh, "N=%d C=%d V=%d ld=%d", N, C, V, ld);
    float *x = randb((size_t)N * C, 1.0f), *w = randb((size_t)V * C, 0.1f), *dw0 = randb((size_t)V * C, 0.1f);
    float *y = xmalloc((size_t)N * V * sizeof(float)), *losses = xmalloc(N * sizeof(float));
    float *dx = xcalloc((size_t)N * C, sizeof(float)), *dw = copyf(dw0, (size_t)V * C);
    int *tok = xmalloc(N * sizeof(int));
    for (int i = 0; i < N; i++) tok[i] = (int)(rng_u64(&rng) % (uint64_t)V);
    cpu->matmul_forward(y, V, x, w, N, C, V);
    for (size_t i = 0; i < (size_t)N * V; i++) y[i] = from_bf16(to_bf16(y[i])); /* the GPU's logits are bf16 */
    cpu->crossentropy_forward_backward(losses, y, V, tok, N, V, 1.0f / N);
    cpu->matmul_backward(dx, dw, y, V, x, w, N, C, V);
    void *dX = up_act(x, (size_t)N * C), *dW = up_act(w, (size_t)V * C), *dL = op_alloc((size_t)N * ld * 2);
    void *dDX = op_alloc((size_t)N * C * 2);
    float *dDW = up_f32(dw0, (size_t)V * C), *dLS = op_alloc(N * sizeof(float));
    int *dT = op_alloc(N * sizeof(int));
    op_upload(dT, tok, N * sizeof(int));
    op_matmul_forward_ld(dL, ld, dX, dW, N, C, V);
    op_crossentropy_forward_backward_ld(dLS, dL, ld, dT, N, V, 1.0f / N);
    op_matmul_backward_ld(dDX, dDW, dL, ld, dX, dW, N, C, V);
    expect_f32("lm_head losses", sh, dLS, losses, N, 1e-3);
    expect_act("lm_head dx", sh, dDX, dx, (size_t)N * C, TOL);
    expect_f32("lm_head dw (fp32, +=)", sh, dDW, dw, (size_t)V * C, TOL);
    op_free(dX); op_free(dW); op_free(dL); op_free(dDX); op_free(dDW); op_free(dLS); op_free(dT);
    free(x); free(w); free(dw0); free(y); free(losses); free(dx); free(dw); free(tok);
}

static void test_rows(void) {
    int N = 300, C = 192, H = 288, V = 1000;
    char sh[64];
    snprintf(sh, sizeof sh, "N=%d C=%d", N, C);
    size_t NC = (size_t)N * C;
    /* rmsnorm */
    float *x = randb(NC, 1.0f), *w = randb(C, 1.0f), *g = randb(NC, 1.0f), *dx0 = randb(NC, 0.1f), *dw0 = randb(C, 0.1f);
    float *y = xmalloc(NC * sizeof(float)), *rstd = xmalloc(N * sizeof(float)), *dx = copyf(dx0, NC), *dw = copyf(dw0, C);
    cpu->rmsnorm_forward(y, rstd, x, w, N, C, 1e-5f);
    cpu->rmsnorm_backward(dx, dw, g, x, w, rstd, N, C);
    void *dX = up_act(x, NC), *dWt = up_act(w, C), *dG = up_act(g, NC), *dY = op_alloc(NC * 2), *dDX = up_act(dx0, NC);
    float *dR = op_alloc(N * sizeof(float)), *dDW = up_f32(dw0, C);
    op_rmsnorm_forward(dY, dR, dX, dWt, N, C, 1e-5f);
    op_rmsnorm_backward(dDX, dDW, dG, dX, dWt, dR, N, C);
    expect_act("rmsnorm forward", sh, dY, y, NC, TOL);
    expect_f32("rmsnorm rstd", sh, dR, rstd, N, 1e-5);
    expect_act("rmsnorm dx (+=)", sh, dDX, dx, NC, TOL);
    expect_f32("rmsnorm dw (fp32, +=)", sh, dDW, dw, C, TOL);
    /* add */
    float *s = copyf(x, NC);
    cpu->add(s, g, NC);
    op_add(dX, dG, NC);
    expect_act("add", sh, dX, s, NC, TOL);
    op_free(dX); op_free(dWt); op_free(dG); op_free(dY); op_free(dDX); op_free(dR); op_free(dDW);
    free(x); free(w); free(g); free(dx0); free(dw0); free(y); free(rstd); free(dx); free(dw); free(s);

    /* swiglu */
    snprintf(sh, sizeof sh, "N=%d H=%d", N, H);
    size_t NH2 = (size_t)N * 2 * H, NHn = (size_t)N * H;
    float *gu = randb(NH2, 1.0f), *go = randb(NHn, 1.0f), *dgu0 = randb(NH2, 0.1f);
    float *o = xmalloc(NHn * sizeof(float)), *dgu = copyf(dgu0, NH2);
    cpu->swiglu_forward(o, gu, N, H);
    cpu->swiglu_backward(dgu, go, gu, N, H);
    void *dGU = up_act(gu, NH2), *dGO = up_act(go, NHn), *dO = op_alloc(NHn * 2), *dDGU = up_act(dgu0, NH2);
    op_swiglu_forward(dO, dGU, N, H);
    op_swiglu_backward(dDGU, dGO, dGU, N, H);
    expect_act("swiglu forward", sh, dO, o, NHn, TOL);
    expect_act("swiglu backward (+=)", sh, dDGU, dgu, NH2, TOL);
    op_free(dGU); op_free(dGO); op_free(dO); op_free(dDGU);
    free(gu); free(go); free(dgu0); free(o); free(dgu);

    /* embedding */
    snprintf(sh, sizeof sh, "N=%d C=%d V=%d", N, C, V);
    int *tok = xmalloc(N * sizeof(int));
    for (int i = 0; i < N; i++) tok[i] = (int)(rng_u64(&rng) % (uint64_t)(V / 10)); /* repeats */
    float *wte = randb((size_t)V * C, 1.0f), *ge = randb(NC, 1.0f), *dwte0 = randb((size_t)V * C, 0.1f);
    float *e = xmalloc(NC * sizeof(float)), *dwte = copyf(dwte0, (size_t)V * C);
    cpu->embedding_forward(e, tok, wte, N, C);
    cpu->embedding_backward(dwte, ge, tok, N, C);
    int *dT = op_alloc(N * sizeof(int));
    op_upload(dT, tok, N * sizeof(int));
    void *dWTE = up_act(wte, (size_t)V * C), *dGE = up_act(ge, NC), *dE = op_alloc(NC * 2);
    float *dDWTE = up_f32(dwte0, (size_t)V * C);
    op_embedding_forward(dE, dT, dWTE, N, C);
    op_embedding_backward(dDWTE, dGE, dT, N, C);
    expect_act("embedding forward", sh, dE, e, NC, 1e-6); /* a copy: exact */
    expect_f32("embedding dwte (fp32)", sh, dDWTE, dwte, (size_t)V * C, 1e-6);
    op_free(dWTE); op_free(dGE); op_free(dE); op_free(dDWTE);
    free(wte); free(ge); free(dwte0); free(e); free(dwte);

    /* cross-entropy, forward and in-place gradient */
    snprintf(sh, sizeof sh, "N=%d V=%d", N, V);
    size_t NV = (size_t)N * V;
    float *lg = randb(NV, 2.0f), *losses = xmalloc(N * sizeof(float));
    for (int i = 0; i < N; i++) tok[i] = (int)(rng_u64(&rng) % (uint64_t)V);
    op_upload(dT, tok, N * sizeof(int));
    void *dL = up_act(lg, NV);
    float *dLS = op_alloc(N * sizeof(float));
    cpu->crossentropy_forward_backward(losses, lg, V, tok, N, V, 1.0f / N);
    op_crossentropy_forward_backward(dLS, dL, dT, N, V, 1.0f / N);
    expect_f32("crossentropy losses", sh, dLS, losses, N, 1e-5);
    expect_act("crossentropy dlogits", sh, dL, lg, NV, TOL);
    op_free(dL); op_free(dLS); op_free(dT);
    free(lg); free(losses); free(tok);

    /* fp32 -> bf16 copy of weights */
    float *f = randb(1001, 1.0f);
    float *df = up_f32(f, 1001);
    void *da = op_alloc(1001 * 2);
    op_to_act(da, df, 1001);
    expect_act("to_act (exact here)", "n=1001", da, f, 1001, 1e-7);
    op_free(df); op_free(da);
    free(f);
}

static void attention_case(int B, int T, int NH, int HD) {
    char sh[64];
    snprintf(sh, sizeof sh, "B=%d T=%d NH=%d HD=%d", B, T, NH, HD);
    size_t C = (size_t)NH * HD, nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C, nl = (size_t)B * NH * T;
    float *qkv = randb(nqkv, 1.0f), *g = randb(nout, 1.0f), *dq0 = randb(nqkv, 0.1f);
    float *cs = xmalloc((size_t)T * HD / 2 * sizeof(float)), *sn = xmalloc((size_t)T * HD / 2 * sizeof(float));
    cpu->rope_tables(cs, sn, T, HD, 10000.0f);
    /* rope, then attention, forward and backward, as a layer runs them */
    float *r = copyf(qkv, nqkv), *o = xmalloc(nout * sizeof(float)), *lse = xmalloc(nl * sizeof(float)),
          *dq = copyf(dq0, nqkv);
    cpu->rope_forward(r, cs, sn, B, T, NH, HD);
    float *rr = NULL;
    { /* the GPU's rope output is rounded to bf16 before attention reads it: so is the CPU's */
        rr = copyf(r, nqkv);
        for (size_t i = 0; i < nqkv; i++) rr[i] = from_bf16(to_bf16(rr[i]));
    }
    cpu->attention_forward(o, lse, rr, B, T, NH, HD);
    cpu->attention_backward(dq, g, rr, o, lse, B, T, NH, HD);
    float *dqr = copyf(dq, nqkv);
    cpu->rope_backward(dqr, cs, sn, B, T, NH, HD);

    float *dCS = up_f32(cs, (size_t)T * HD / 2), *dSN = up_f32(sn, (size_t)T * HD / 2);
    void *dQKV = up_act(qkv, nqkv), *dG = up_act(g, nout), *dO = op_alloc(nout * 2), *dDQ = up_act(dq0, nqkv);
    float *dLSE = op_alloc(nl * sizeof(float));
    op_rope_forward(dQKV, dCS, dSN, B, T, NH, HD);
    expect_act("rope forward", sh, dQKV, r, nqkv, TOL);
    op_attention_forward(dO, dLSE, dQKV, B, T, NH, HD);
    expect_act("attention forward", sh, dO, o, nout, TOL_ATT);
    expect_f32("attention lse", sh, dLSE, lse, nl, 1e-3);
    op_attention_backward(dDQ, dG, dQKV, dO, dLSE, B, T, NH, HD);
    expect_act("attention backward (+=)", sh, dDQ, dq, nqkv, TOL_ATT);
    op_rope_backward(dDQ, dCS, dSN, B, T, NH, HD);
    expect_act("rope backward", sh, dDQ, dqr, nqkv, TOL_ATT);
    op_free(dCS); op_free(dSN); op_free(dQKV); op_free(dG); op_free(dO); op_free(dDQ); op_free(dLSE);
    free(qkv); free(g); free(dq0); free(cs); free(sn); free(r); free(rr); free(o); free(lse); free(dq); free(dqr);
}

static void test_attention(void) {
    attention_case(2, 1, 2, 64);
    attention_case(2, 77, 3, 64);
    attention_case(1, 300, 2, 128);
    attention_case(2, 256, 4, 128);
    attention_case(2, 50, 2, 32); /* a head_dim the tensor-core kernel may not take: the fallback */
}

int main(void) {
    char err[256];
    if (ops_init("cuda", 0, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    if (ops_set_precision(OPS_MIXED, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    rng_seed(&rng, 1234);
    RUN(test_matmul);
    RUN(test_lm_head_padded);
    RUN(test_rows);
    RUN(test_attention);
    return TEST_SUMMARY();
}
