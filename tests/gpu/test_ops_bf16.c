/* GPU tests for bf16 compute. precision=mixed: every op through the ops interface with
 * bf16 activations and compute weights on the cuda backend, against the CPU backend's fp32
 * op on the same inputs rounded to bf16. Tolerances are norm-wise relative errors sized
 * for bf16 (8 bits of mantissa: one rounding is ~2e-3); gradients of weights stay fp32.
 * precision=bf16: the ops whose outputs are parameter state (weight gradients, AdamW's
 * param, m and v, sumsq, scale) with that state in bf16; where the GPU rounds once per
 * element after fp32 arithmetic, the CPU result rounded the same way must match bitwise.
 * The precision is fixed per process, so the bf16 part runs in a child process.
 * Backward ops must accumulate (their outputs start non-zero). Needs a GPU. */
#include "ops.h"
#include "ops_cuda.h"
#include "test.h"
#include "util.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define TOL 1.5e-2      /* one or two bf16 roundings of the result */
#define TOL_ATT 3e-2    /* attention: probabilities are rounded to bf16 before P @ V */

#include "bf16_check.h"

static void test_matmul(void) {
    int shapes[][3] = {{7, 16, 24}, {256, 128, 384}, {1000, 96, 200}, {40, 64, 1000}};  /* 1000: a 960 + 40 split */
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int N = shapes[s][0], C = shapes[s][1], OC = shapes[s][2];
        char sh[64];
        snprintf(sh, sizeof sh, "N=%d C=%d OC=%d", N, C, OC);
        float *x = randb((size_t)N * C, 1.0f), *w = randb((size_t)OC * C, 0.1f), *g = randb((size_t)N * OC, 1.0f);
        float *dx0 = randb((size_t)N * C, 0.1f), *dw0 = randb((size_t)OC * C, 0.1f);
        float *y = xmalloc((size_t)N * OC * sizeof(float)), *dx = copyf(dx0, (size_t)N * C),
              *dw = copyf(dw0, (size_t)OC * C);
        cpu->matmul_forward(y, OC, x, w, N, C, OC);
        cpu->matmul_backward(dx, dw, g, OC, x, w, N, C, OC, 1);
        void *dX = up_act(x, (size_t)N * C), *dW = up_act(w, (size_t)OC * C), *dG = up_act(g, (size_t)N * OC);
        void *dY = op_alloc((size_t)N * OC * 2), *dDX = up_act(dx0, (size_t)N * C);
        float *dDW = up_f32(dw0, (size_t)OC * C);
        op_matmul_forward(dY, dX, dW, N, C, OC);
        op_matmul_backward(dDX, dDW, dG, dX, dW, N, C, OC);
        expect_act("matmul forward", sh, dY, y, (size_t)N * OC, TOL);
        {   /* the residual in the epilogue (one rounding), over NaN: y + res */
            size_t no = (size_t)N * OC;
            float *res = randb(no, 1.0f), *want = xmalloc(no * sizeof(float)), *nan = xmalloc(no * sizeof(float));
            for (size_t i = 0; i < no; i++) want[i] = y[i] + res[i], nan[i] = NAN;
            void *dR = up_act(res, no), *dS = up_act(nan, no);
            op_matmul_forward_add(dS, dX, dW, dR, N, C, OC);
            expect_act("matmul forward + residual", sh, dS, want, no, TOL);
            op_free(dR); op_free(dS); free(res); free(want); free(nan);
        }
        {   /* the input gradient with res in the epilogue, over NaN: (dx - dx0) + res */
            size_t ni = (size_t)N * C;
            float *res = randb(ni, 1.0f), *want = xmalloc(ni * sizeof(float)), *nan = xmalloc(ni * sizeof(float));
            for (size_t i = 0; i < ni; i++) want[i] = dx[i] - dx0[i] + res[i], nan[i] = NAN;
            void *dR = up_act(res, ni), *dS = up_act(nan, ni);
            op_matmul_backward_add(dS, dG, dW, dR, N, C, OC);
            expect_act("matmul dinp + res", sh, dS, want, ni, TOL);
            op_free(dR); op_free(dS); free(res); free(want); free(nan);
        }
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
    for (size_t i = 0; i < (size_t)N * V; i++) y[i] = bf16_widen(bf16_round(y[i])); /* the GPU's logits are bf16 */
    cpu->crossentropy_forward_backward(losses, y, V, tok, N, V, 1.0f / N);
    cpu->matmul_backward(dx, dw, y, V, x, w, N, C, V, 1);
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
    /* the fused residual add + rmsnorm: bitwise the add above, then rmsnorm of its sum */
    {
        void *dRes = up_act(x, NC), *dF = op_alloc(NC * 2), *dS = op_alloc(NC * 2);
        float *dFR = op_alloc(N * sizeof(float)), *dSR = op_alloc(N * sizeof(float));
        op_add_rmsnorm_forward(dRes, dF, dFR, dG, dWt, N, C, 1e-5f);
        op_rmsnorm_forward(dS, dSR, dX, dWt, N, C, 1e-5f);
        unsigned char *a = xmalloc(NC * 2), *b = xmalloc(NC * 2);
        float ra[300], rb[300];
        int same = 1;
        op_download(a, dRes, NC * 2); op_download(b, dX, NC * 2); same &= !memcmp(a, b, NC * 2);
        op_download(a, dF, NC * 2); op_download(b, dS, NC * 2); same &= !memcmp(a, b, NC * 2);
        op_download(ra, dFR, N * sizeof(float)); op_download(rb, dSR, N * sizeof(float));
        same &= !memcmp(ra, rb, N * sizeof(float));
        printf("    %-22s %-30s %s\n", "add_rmsnorm", sh, same ? "bitwise add then rmsnorm" : "DIFFERS");
        CHECK(same, "add_rmsnorm %s: not bitwise op_add then op_rmsnorm_forward", sh);
        free(a); free(b);
        op_free(dRes); op_free(dF); op_free(dS); op_free(dFR); op_free(dSR);
    }
    op_free(dX); op_free(dWt); op_free(dG); op_free(dY); op_free(dDX); op_free(dR); op_free(dDW);
    free(x); free(w); free(g); free(dx0); free(dw0); free(y); free(rstd); free(dx); free(dw); free(s);

    /* swiglu */
    snprintf(sh, sizeof sh, "N=%d H=%d", N, H);
    size_t NH2 = (size_t)N * 2 * H, NHn = (size_t)N * H;
    float *gu = randb(NH2, 1.0f), *go = randb(NHn, 1.0f), *dgu0 = randb(NH2, 0.1f);
    float *o = xmalloc(NHn * sizeof(float)), *dgu = copyf(dgu0, NH2);
    cpu->swiglu_forward(o, gu, N, H);
    cpu->swiglu_backward(dgu, go, gu, N, H, 1);
    void *dGU = up_act(gu, NH2), *dGO = up_act(go, NHn), *dO = op_alloc(NHn * 2), *dDGU = up_act(dgu0, NH2);
    op_swiglu_forward(dO, dGU, N, H);
    op_swiglu_backward(dDGU, dGO, dGU, N, H);
    expect_act("swiglu forward", sh, dO, o, NHn, TOL);
    expect_act("swiglu backward (+=)", sh, dDGU, dgu, NH2, TOL);
    {   /* the _set variant writes dgu: over NaN, the CPU's gradient into zeros */
        float *nan = xmalloc(NH2 * sizeof(float)), *dz = calloc(NH2, sizeof(float));
        for (size_t i = 0; i < NH2; i++) nan[i] = NAN;
        cpu->swiglu_backward(dz, go, gu, N, H, 1);
        void *dS = up_act(nan, NH2);
        op_swiglu_backward_set(dS, dGO, dGU, N, H);
        expect_act("swiglu backward (=)", sh, dS, dz, NH2, TOL);
        op_free(dS); free(nan); free(dz);
    }
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
    {  /* by row: bitwise the kernel above */
        int *cnt = xmalloc((size_t)V * sizeof(int)), *ix = xmalloc((3 * (size_t)N + 1) * sizeof(int));
        int nr = embedding_rows_index(tok, N, V, cnt, ix);
        int *dIX = op_alloc((3 * (size_t)N + 1) * sizeof(int));
        op_upload(dIX, ix, (3 * (size_t)N + 1) * sizeof(int));
        float *dR = up_f32(dwte0, (size_t)V * C), *a = xmalloc((size_t)V * C * 4), *b = xmalloc((size_t)V * C * 4);
        op_embedding_backward_rows(dR, dGE, dIX, nr, N, C);
        op_download(a, dDWTE, (size_t)V * C * 4);
        op_download(b, dR, (size_t)V * C * 4);
        CHECK(!memcmp(a, b, (size_t)V * C * 4), "embedding dwte by row (fp32) %s: not bitwise the kernel's", sh);
        op_free(dIX); op_free(dR); free(cnt); free(ix); free(a); free(b);
    }
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

/* Vocabulary parallel in bf16 (crossentropy8_shard_*: 16-byte rows): each shard's
 * statistics, then its loss and gradient, against the CPU's on the same bf16 values; the
 * padding past a shard's columns (NaN here) is neither used nor written. */
static void crossentropy_shard_bf16_case(int N, int V, int t) {
    char sh[64];
    snprintf(sh, sizeof sh, "N=%d V=%d t=%d", N, V, t);
    int Vt = (V + t - 1) / t, ld = ops_logit_stride(Vt);
    size_t nl = (size_t)N * ld, ns = (size_t)t * N * 3;
    int *tok = xmalloc((size_t)N * sizeof(int));
    for (int i = 0; i < N; i++) tok[i] = (int)(rng_u64(&rng) % (uint64_t)V);
    int *dT = op_alloc((size_t)N * sizeof(int));
    op_upload(dT, tok, (size_t)N * sizeof(int));
    float *stats = xmalloc(ns * sizeof(float)), **lg = xmalloc((size_t)t * sizeof *lg);
    float *dS = op_alloc(ns * sizeof(float));
    for (int k = 0; k < t; k++) {
        int v0 = k * Vt, w = V - v0 < Vt ? V - v0 : Vt;
        lg[k] = randb(nl, 3.0f);
        for (int n = 0; n < N; n++)
            for (int j = w; j < ld; j++) lg[k][(size_t)n * ld + j] = NAN;
        cpu->crossentropy_shard_stats(stats + (size_t)k * N * 3, lg[k], ld, tok, N, w, v0);
        void *dL = up_act(lg[k], nl);
        op_crossentropy_shard_stats(dS + (size_t)k * N * 3, dL, ld, dT, N, w, v0);
        op_free(dL);
    }
    expect_f32("crossentropy shard stats", sh, dS, stats, ns, 1e-5);
    op_upload(dS, stats, ns * sizeof(float));  /* the same statistics on both sides from here */
    float *loss = xmalloc((size_t)N * sizeof(float)), *after = xmalloc(nl * sizeof(float));
    float *dLS = op_alloc((size_t)N * sizeof(float));
    for (int k = 0; k < t; k++) {
        int v0 = k * Vt, w = V - v0 < Vt ? V - v0 : Vt;
        float *grad = copyf(lg[k], nl);
        cpu->crossentropy_shard_backward(loss, grad, ld, tok, N, w, v0, stats, t, 1.0f / (float)N);
        void *dL = up_act(lg[k], nl);
        op_crossentropy_shard_backward(dLS, dL, ld, dT, N, w, v0, dS, t, 1.0f / (float)N);
        expect_f32("crossentropy shard loss", sh, dLS, loss, (size_t)N, 1e-5);
        op_download_act(after, dL, nl);
        int pad_ok = 1;
        for (int n = 0; n < N; n++)
            for (int j = w; j < ld; j++) pad_ok &= isnan(after[(size_t)n * ld + j]) != 0;
        CHECK(pad_ok, "%s shard %d: the padding past its columns was written", sh, k);
        for (int n = 0; n < N; n++)  /* (the padding's NaN out of the comparison) */
            for (int j = w; j < ld; j++) grad[(size_t)n * ld + j] = after[(size_t)n * ld + j] = 0.0f;
        double e = norm_rel_err(after, grad, nl);
        printf("    %-22s %-30s err %.2e\n", "crossentropy shard dlogits", sh, e);
        CHECK(e < TOL, "crossentropy shard dlogits %s: norm-wise relative error %.3g", sh, e);
        op_free(dL);
        free(grad);
    }
    for (int k = 0; k < t; k++) free(lg[k]);
    free(lg); free(stats); free(loss); free(after); free(tok);
    op_free(dS); op_free(dLS); op_free(dT);
}
static void test_crossentropy_shard(void) {
    crossentropy_shard_bf16_case(3, 11, 2);
    crossentropy_shard_bf16_case(16, 50257, 2);
    crossentropy_shard_bf16_case(16, 50257, 4);
}

/* Cross-entropy in bf16 on padded rows (the lm_head's form): rows with NaN, +inf, all -inf
 * (NaN loss and gradient, as on the CPU), some -inf (fine), a target out of range (NaN);
 * the padding past V is NaN, which must be neither used nor written; and losses alone
 * (scale 0) leave the logits untouched. */
static void test_crossentropy_special(void) {
    enum { N = CE_SPECIAL_N, V = 100 };
    int ld = ops_logit_stride(V);
    float *lg = randb((size_t)N * V, 2.0f);
    int tgt[N];
    ce_special_rows(lg, V, tgt);
    float *pad = xmalloc((size_t)N * ld * sizeof(float)), *grad = copyf(lg, (size_t)N * V), loss[N];
    for (int n = 0; n < N; n++)
        for (int j = 0; j < ld; j++) pad[(size_t)n * ld + j] = j < V ? lg[(size_t)n * V + j] : NAN;
    cpu->crossentropy_forward_backward(loss, grad, V, tgt, N - 1, V, 0.5f); /* the CPU without row 5 */
    tgt[5] = V;                                                              /* out of range */
    int *dT = op_alloc(N * sizeof(int));
    op_upload(dT, tgt, N * sizeof(int));
    void *dL = up_act(pad, (size_t)N * ld);
    float *dLS = op_alloc(N * sizeof(float)), g_loss[N];
    float *before = xmalloc((size_t)N * ld * sizeof(float)), *after = xmalloc((size_t)N * ld * sizeof(float));
    op_download_act(before, dL, (size_t)N * ld);
    for (int pass = 0; pass < 2; pass++) {
        float scale = pass ? 0.5f : 0.0f;
        op_crossentropy_forward_backward_ld(dLS, dL, ld, dT, N, V, scale);
        op_download(g_loss, dLS, sizeof g_loss);
        op_download_act(after, dL, (size_t)N * ld);
        for (int n = 0; n < N; n++) {
            int expect_nan = ce_special_nan(n);
            CHECK((isnan(g_loss[n]) != 0) == expect_nan, "scale %g row %d: loss %g", scale, n, g_loss[n]);
            if (n < N - 1) CHECK((isnan(loss[n]) != 0) == expect_nan, "CPU row %d: loss %g", n, loss[n]);
            CHECK(memcmp(after + (size_t)n * ld + V, before + (size_t)n * ld + V, (size_t)(ld - V) * sizeof(float)) == 0,
                  "scale %g row %d: the padding past V was written", scale, n);
            if (!pass) {
                CHECK(memcmp(after + (size_t)n * ld, before + (size_t)n * ld, V * sizeof(float)) == 0,
                      "row %d: logits changed without a gradient", n);
                continue;
            }
            int all_nan = 1, any_nan = 0;
            for (int j = 0; j < V; j++) {
                all_nan &= isnan(after[(size_t)n * ld + j]) != 0;
                any_nan |= isnan(after[(size_t)n * ld + j]) != 0;
            }
            CHECK(expect_nan ? all_nan : !any_nan, "row %d: gradient NaN pattern", n);
        }
        CHECK(fabs(g_loss[0] - loss[0]) <= 1e-5 * fabs(loss[0]), "row 0: %g vs %g", g_loss[0], loss[0]);
        CHECK(fabs(g_loss[4] - loss[4]) <= 1e-5 * fabs(loss[4]), "row 4: %g vs %g", g_loss[4], loss[4]);
    }
    CHECK(norm_rel_err(after, grad, V) < TOL, "row 0 gradient");
    CHECK(norm_rel_err(after + 4 * ld, grad + 4 * V, V) < TOL, "row 4 gradient");
    op_free(dT); op_free(dL); op_free(dLS);
    free(lg); free(pad); free(grad); free(before); free(after);
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
        for (size_t i = 0; i < nqkv; i++) rr[i] = bf16_widen(bf16_round(rr[i]));
    }
    cpu->attention_forward(o, lse, rr, B, T, NH, HD);
    cpu->attention_backward(dq, g, rr, o, lse, B, T, NH, HD, 1);
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
    {   /* the _set variant writes dqkv: over NaN, the CPU's gradient into zeros */
        float *nan = xmalloc(nqkv * sizeof(float)), *dz = calloc(nqkv, sizeof(float));
        for (size_t i = 0; i < nqkv; i++) nan[i] = NAN;
        cpu->attention_backward(dz, g, rr, o, lse, B, T, NH, HD, 1);
        void *dS = up_act(nan, nqkv);
        op_attention_backward_set(dS, dG, dQKV, dO, dLSE, B, T, NH, HD);
        expect_act("attention backward (=)", sh, dS, dz, nqkv, TOL_ATT);
        /* with RoPE's backward, fused (dq, dk rotated back before their one rounding): against
         * the CPU's two ops, and against the GPU's two passes within a rounding or two */
        cpu->rope_backward(dz, cs, sn, B, T, NH, HD);
        void *dR = up_act(nan, nqkv);
        op_attention_rope_backward_set(dR, dG, dQKV, dO, dLSE, dCS, dSN, B, T, NH, HD);
        expect_act("attention+rope backward", sh, dR, dz, nqkv, TOL_ATT);
        float *two = xmalloc(nqkv * sizeof(float));
        op_rope_backward(dS, dCS, dSN, B, T, NH, HD);
        op_download_act(two, dS, nqkv);
        expect_act("  ... vs two passes", sh, dR, two, nqkv, TOL);
        op_free(dR); free(two);
        op_free(dS); free(nan); free(dz);
    }
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

/* ------------------------------------------------------------------------------------ */
/* precision=bf16: parameter state in bf16                                               */

static void round_bf16(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = bf16_widen(bf16_round(x[i]));
}
/* device state (bf16 here) from host floats, and back */
static void *up_state(const float *h, size_t n) {
    void *d = op_alloc(n * ops_state_size());
    op_upload_state(d, h, n);
    return d;
}
static float *down_state(const void *d, size_t n) {
    float *h = xmalloc(n * sizeof(float) + 4);
    op_download_state(h, d, n);
    return h;
}
static void expect_state(const char *what, const char *shape, const void *d, const float *ref, size_t n, double tol) {
    float *h = down_state(d, n);
    double e = norm_rel_err(h, ref, n);
    printf("    %-22s %-30s err %.2e\n", what, shape, e);
    CHECK(e < tol, "%s %s: norm-wise relative error %.3g vs the fp32 CPU op (tolerance %.0e)", what, shape, e, tol);
    free(h);
}
/* ref is already rounded to bf16 as the GPU must round */
static void expect_state_bitwise(const char *what, const char *shape, const void *d, const float *ref, size_t n) {
    float *h = down_state(d, n);
    size_t bad = 0, first = n;
    for (size_t i = 0; i < n; i++)
        if (memcmp(&h[i], &ref[i], sizeof(float)) != 0 && bad++ == 0) first = i;
    CHECK(bad == 0, "%s %s: %zu of %zu elements differ from the CPU result rounded to bf16 (first at %zu: %.9g vs %.9g)",
          what, shape, bad, n, first, first < n ? h[first] : 0.0, first < n ? ref[first] : 0.0);
    free(h);
}

/* dwte (bf16) += dout: every addition rounds to bf16, in token order, so a host loop doing
 * the same gives the exact bits; the fp32 CPU op bounds the drift. */
static void test_bf16_embedding_backward(void) {
    int N = 300, C = 192, V = 1000;
    char sh[64];
    snprintf(sh, sizeof sh, "N=%d C=%d V=%d", N, C, V);
    size_t NC = (size_t)N * C, VC = (size_t)V * C;
    int *tok = xmalloc(N * sizeof(int));
    for (int i = 0; i < N; i++) tok[i] = (int)(rng_u64(&rng) % (uint64_t)(V / 10)); /* repeats */
    float *ge = randb(NC, 1.0f), *dwte0 = randb(VC, 0.1f), *dwte = copyf(dwte0, VC), *emu = copyf(dwte0, VC);
    cpu->embedding_backward(dwte, ge, tok, N, C);
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++) {
            float *e = &emu[(size_t)tok[n] * C + c];
            *e = bf16_widen(bf16_round(*e + ge[(size_t)n * C + c]));
        }
    int *dT = op_alloc(N * sizeof(int));
    op_upload(dT, tok, N * sizeof(int));
    void *dGE = up_act(ge, NC), *dDWTE = up_state(dwte0, VC);
    op_embedding_backward(dDWTE, dGE, dT, N, C);
    expect_state("embedding dwte (bf16)", sh, dDWTE, dwte, VC, TOL);
    expect_state_bitwise("embedding dwte (bf16)", sh, dDWTE, emu, VC);
    {  /* by row: the same rounding after every add */
        int *cnt = xmalloc((size_t)V * sizeof(int)), *ix = xmalloc((3 * (size_t)N + 1) * sizeof(int));
        int nr = embedding_rows_index(tok, N, V, cnt, ix);
        int *dIX = op_alloc((3 * (size_t)N + 1) * sizeof(int));
        op_upload(dIX, ix, (3 * (size_t)N + 1) * sizeof(int));
        void *dR = up_state(dwte0, VC);
        op_embedding_backward_rows(dR, dGE, dIX, nr, N, C);
        expect_state_bitwise("embedding dwte by row (bf16)", sh, dR, emu, VC);
        op_free(dIX); op_free(dR); free(cnt); free(ix);
    }
    op_free(dT); op_free(dGE); op_free(dDWTE);
    free(tok); free(ge); free(dwte0); free(dwte); free(emu);
}

static void test_bf16_rmsnorm_backward(void) {
    int shapes[][2] = {{300, 192}, {1000, 77}, {70, 4096}, {5, 12296}};  /* (4096, 12296: the wide-row kernels) */
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        int N = shapes[k][0], C = shapes[k][1];
        char sh[64];
        snprintf(sh, sizeof sh, "N=%d C=%d", N, C);
        size_t NC = (size_t)N * C;
        float *x = randb(NC, 1.0f), *w = randb(C, 1.0f), *g = randb(NC, 1.0f), *dx0 = randb(NC, 0.1f);
        float *dw0 = randb(C, 0.1f), *rstd = xmalloc(N * sizeof(float)), *y = xmalloc(NC * sizeof(float));
        float *dx = copyf(dx0, NC), *dw = copyf(dw0, C);
        cpu->rmsnorm_forward(y, rstd, x, w, N, C, 1e-5f);
        cpu->rmsnorm_backward(dx, dw, g, x, w, rstd, N, C);
        void *dX = up_act(x, NC), *dW = up_state(w, C), *dG = up_act(g, NC), *dY = op_alloc(NC * 2);
        void *dDX = up_act(dx0, NC), *dDW = up_state(dw0, C);
        float *dR = op_alloc(N * sizeof(float));
        op_rmsnorm_forward(dY, dR, dX, dW, N, C, 1e-5f);
        op_rmsnorm_backward(dDX, dDW, dG, dX, dW, dR, N, C);
        expect_act("rmsnorm forward", sh, dY, y, NC, TOL);
        expect_f32("rmsnorm rstd", sh, dR, rstd, N, 1e-5);
        expect_act("rmsnorm dx (+=)", sh, dDX, dx, NC, TOL);
        expect_state("rmsnorm dw (bf16, +=)", sh, dDW, dw, C, TOL);
        op_free(dX); op_free(dW); op_free(dG); op_free(dY); op_free(dDX); op_free(dDW); op_free(dR);
        free(x); free(w); free(g); free(dx0); free(dw0); free(rstd); free(y); free(dx); free(dw);
    }
}

/* dw (bf16) += dout^T @ inp through cuBLASLt with a bf16 D. OC = 1001 is split into 960
 * columns and a tail of 41 (as the 50257-wide lm_head is): the tail's dw lands at its own
 * offset. dout's rows are padded to ops_logit_stride(OC) with NaN, which must not be read. */
static void test_bf16_matmul_backward(void) {
    int shapes[][3] = {{256, 128, 384}, {300, 64, 1001}, {33, 40, 5}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int N = shapes[s][0], C = shapes[s][1], OC = shapes[s][2], ld = ops_logit_stride(OC);
        char sh[64];
        snprintf(sh, sizeof sh, "N=%d C=%d OC=%d ld=%d", N, C, OC, ld);
        float *x = randb((size_t)N * C, 1.0f), *w = randb((size_t)OC * C, 0.1f), *g = randb((size_t)N * OC, 1.0f);
        float *dx0 = randb((size_t)N * C, 0.1f), *dw0 = randb((size_t)OC * C, 1.0f);
        float *dx = copyf(dx0, (size_t)N * C), *dw = copyf(dw0, (size_t)OC * C);
        cpu->matmul_backward(dx, dw, g, OC, x, w, N, C, OC, 1);
        float *gp = xmalloc((size_t)N * ld * sizeof(float));
        for (int n = 0; n < N; n++)
            for (int j = 0; j < ld; j++) gp[(size_t)n * ld + j] = j < OC ? g[(size_t)n * OC + j] : NAN;
        void *dX = up_act(x, (size_t)N * C), *dW = up_state(w, (size_t)OC * C), *dG = up_act(gp, (size_t)N * ld);
        void *dDX = up_act(dx0, (size_t)N * C), *dDW = up_state(dw0, (size_t)OC * C);
        op_matmul_backward_ld(dDX, dDW, dG, ld, dX, dW, N, C, OC);
        expect_act("matmul dinp (+=)", sh, dDX, dx, (size_t)N * C, TOL);
        expect_state("matmul dw (bf16, +=)", sh, dDW, dw, (size_t)OC * C, TOL);
        {   /* the _set variant writes dinp: over NaN, the CPU's gradient into zeros */
            size_t NC = (size_t)N * C;
            float *nan = xmalloc(NC * sizeof(float)), *dz = calloc(NC, sizeof(float));
            for (size_t i = 0; i < NC; i++) nan[i] = NAN;
            cpu->matmul_backward(dz, NULL, g, OC, x, w, N, C, OC, 1);
            void *dS = up_act(nan, NC), *dG2 = up_act(g, (size_t)N * OC);
            op_matmul_backward_set(dS, NULL, dG2, dX, dW, N, C, OC);
            expect_act("matmul dinp (=)", sh, dS, dz, NC, TOL);
            op_free(dS); op_free(dG2); free(nan); free(dz);
        }
        if (OC > 64) { /* the tail columns alone: a misplaced tail fails here, not in the mean */
            int t0 = OC / 64 * 64;
            float *h = down_state(dDW, (size_t)OC * C);
            double e = norm_rel_err(h + (size_t)t0 * C, dw + (size_t)t0 * C, (size_t)(OC - t0) * C);
            CHECK(e < TOL, "matmul dw tail rows %d..%d %s: error %.3g", t0, OC - 1, sh, e);
            free(h);
        }
        op_free(dX); op_free(dW); op_free(dG); op_free(dDX); op_free(dDW);
        free(x); free(w); free(g); free(dx0); free(dw0); free(dx); free(dw); free(gp);
    }
}

/* AdamW with bf16 state computes in fp32 on the widened values and rounds param, m and v
 * once each: bitwise the CPU's fp32 step on the same values, rounded to bf16, step after
 * step. Against the fp32 trajectory (no rounding between steps) only a bf16-sized drift. */
static void adamw_bf16_case(size_t n, int steps, float lr, float beta1, float beta2, float wd, float grad_scale) {
    char sh[96];
    snprintf(sh, sizeof sh, "n=%zu steps=%d b1=%g wd=%g", n, steps, beta1, wd);
    float *p = randb(n, 1.0f), *m = randb(n, 0.1f), *v = randb(n, 0.1f);
    for (size_t i = 0; i < n; i++) v[i] *= v[i];
    round_bf16(v, n);
    float *pf = copyf(p, n), *mf = copyf(m, n), *vf = copyf(v, n); /* the fp32 trajectory */
    void *dP = up_state(p, n), *dM = up_state(m, n), *dV = up_state(v, n), *dG = op_alloc(n * 2);
    for (int step = 1; step <= steps; step++) {
        float *g = randb(n, 1.0f);
        op_upload_state(dG, g, n);
        op_adamw(dP, dG, dM, dV, n, lr, beta1, beta2, 1e-8f, wd, step, grad_scale);
        cpu->adamw(p, g, m, v, n, lr, beta1, beta2, 1e-8f, wd, step, grad_scale);
        cpu->adamw(pf, g, mf, vf, n, lr, beta1, beta2, 1e-8f, wd, step, grad_scale);
        round_bf16(p, n);
        round_bf16(m, n);
        round_bf16(v, n);
        free(g);
    }
    expect_state_bitwise("adamw param (bf16)", sh, dP, p, n);
    expect_state_bitwise("adamw m (bf16)", sh, dM, m, n);
    expect_state_bitwise("adamw v (bf16)", sh, dV, v, n);
    expect_state("adamw param vs fp32", sh, dP, pf, n, TOL);
    expect_state("adamw m vs fp32", sh, dM, mf, n, TOL);
    expect_state("adamw v vs fp32", sh, dV, vf, n, TOL);
    op_free(dP); op_free(dM); op_free(dV); op_free(dG);
    free(p); free(m); free(v); free(pf); free(mf); free(vf);
}

static void test_bf16_adamw(void) {
    adamw_bf16_case(17, 1, 1e-3f, 0.9f, 0.95f, 0.1f, 1.0f);
    adamw_bf16_case(1000003, 1, 1e-3f, 0.9f, 0.95f, 0.1f, 1.0f);
    adamw_bf16_case(1000003, 5, 1e-2f, 0.3f, 0.999f, 0.0f, 0.5f); /* the other lerp branch, no decay */
    adamw_bf16_case(4099, 5, 3e-4f, 0.9f, 0.95f, 0.1f, 0.7f);
}

/* sumsq of bf16 state (in double: the CPU's value up to summation order), and scale (one
 * fp32 product rounded to bf16: bitwise). Sizes odd and unaligned to any vector width. */
static void test_bf16_flat(void) {
    size_t sizes[] = {1, 1001, 1000003};
    for (int k = 0; k < 3; k++) {
        size_t n = sizes[k];
        char sh[64];
        snprintf(sh, sizeof sh, "n=%zu", n);
        float *x = randb(n, 1.0f);
        void *dX = up_state(x, n);
        double c = cpu->sumsq(x, n), g1 = op_sumsq(dX, n), g2 = op_sumsq(dX, n);
        printf("    %-22s %-30s err %.2e\n", "sumsq (bf16)", sh, fabs(g1 - c) / c);
        CHECK(fabs(g1 - c) <= 1e-10 * c, "sumsq (bf16) %s: %.17g vs CPU %.17g", sh, g1, c);
        CHECK(g1 == g2, "sumsq (bf16) %s: two runs differ", sh);
        cpu->scale(x, n, 0.37f);
        round_bf16(x, n);
        op_scale(dX, n, 0.37f);
        expect_state_bitwise("scale (bf16)", sh, dX, x, n);
        op_free(dX);
        free(x);
    }
}

/* precision=bf16: the copy-engine all-reduce's sum of bf16 gradients (cuda_sum_blocks):
 * each element summed in rank order in fp32, scaled, rounded to bf16 once. */
static void test_bf16_sum_blocks(void) {
    size_t cs[] = {1001, 4096};
    for (int k = 0; k < 2; k++)
        for (int D = 2; D <= 4; D += 2) {
            size_t c = cs[k];
            float s = 1.0f / (float)D, *x = randb(c * D, 1.0f), *y = xmalloc(c * sizeof(float));
            char sh[64];
            snprintf(sh, sizeof sh, "c=%zu D=%d", c, D);
            for (size_t i = 0; i < c; i++) {
                float a = 0.0f;
                for (int d = 0; d < D; d++) a += x[(size_t)d * c + i];
                y[i] = a * s;
            }
            round_bf16(y, c);
            void *dX = up_state(x, c * D), *dY = op_alloc(c * ops_state_size());
            cuda_sum_blocks(dY, dX, c, D, s, 1, cuda_stream());
            cuda_synchronize();
            expect_state_bitwise("sum_blocks (bf16)", sh, dY, y, c);
            op_free(dX); op_free(dY);
            free(x); free(y);
        }
}

/* precision=mixed: AdamW that also writes the bf16 compute copy (DDP's update) gives the
 * parameters and moments of op_adamw and the copy op_to_act makes of them, bitwise; on the
 * 16-byte path, and one element off alignment (the scalar path). */
static void test_mixed_adamw_cast(void) {
    size_t sizes[] = {17, 1000003};
    for (int k = 0; k < 2; k++)
        for (size_t off = 0; off < 2; off++) {
            size_t n = sizes[k];
            char sh[64];
            snprintf(sh, sizeof sh, "n=%zu offset=%zu", n, off);
            float *p = randb(n + 1, 1.0f), *m = randb(n + 1, 0.1f), *v = randb(n + 1, 0.1f), *g = randb(n + 1, 1.0f);
            for (size_t i = 0; i < n + 1; i++) v[i] *= v[i];
            void *P[2], *M[2], *V[2], *A[2], *G = up_state(g, n + 1);
            for (int c = 0; c < 2; c++) {
                P[c] = up_state(p, n + 1), M[c] = up_state(m, n + 1), V[c] = up_state(v, n + 1);
                A[c] = op_alloc((n + 1) * ops_act_size());
                op_zero(A[c], (n + 1) * ops_act_size());
            }
            for (int step = 1; step <= 3; step++) {
                op_adamw_cast(st_at(P[0], off), st_at(G, off), st_at(M[0], off), st_at(V[0], off), n, 1e-3f, 0.9f,
                              0.95f, 1e-8f, 0.1f, step, 0.7f, act_at(A[0], off));
                op_adamw(st_at(P[1], off), st_at(G, off), st_at(M[1], off), st_at(V[1], off), n, 1e-3f, 0.9f, 0.95f,
                         1e-8f, 0.1f, step, 0.7f);
                op_to_act(act_at(A[1], off), st_at(P[1], off), n);
            }
            float *ref[3] = {down_state(P[1], n + 1), down_state(M[1], n + 1), down_state(V[1], n + 1)};
            expect_state_bitwise("adamw_cast param", sh, P[0], ref[0], n + 1);
            expect_state_bitwise("adamw_cast m", sh, M[0], ref[1], n + 1);
            expect_state_bitwise("adamw_cast v", sh, V[0], ref[2], n + 1);
            size_t bytes = (n + 1) * ops_act_size();
            unsigned char *a0 = xmalloc(bytes), *a1 = xmalloc(bytes);
            op_download(a0, A[0], bytes);
            op_download(a1, A[1], bytes);
            CHECK(memcmp(a0, a1, bytes) == 0, "adamw_cast %s: the bf16 copy differs from op_to_act's", sh);
            free(a0); free(a1);
            for (int c = 0; c < 3; c++) free(ref[c]);
            for (int c = 0; c < 2; c++) { op_free(P[c]); op_free(M[c]); op_free(V[c]); op_free(A[c]); }
            op_free(G);
            free(p); free(m); free(v); free(g);
        }
}

static int run_mode(OpsPrecision p) {
    char err[256];
    if (ops_init("cuda", 0, err, sizeof err) || ops_set_precision(p, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return -1;
    }
    if (p == OPS_BF16) {
        rng_seed(&rng, 4321);
        RUN(test_bf16_embedding_backward);
        RUN(test_bf16_rmsnorm_backward);
        RUN(test_bf16_matmul_backward);
        RUN(test_bf16_adamw);
        RUN(test_bf16_flat);
        RUN(test_bf16_sum_blocks);
        return 0;
    }
    rng_seed(&rng, 1234);
    RUN(test_matmul);
    RUN(test_lm_head_padded);
    RUN(test_rows);
    RUN(test_crossentropy_special);
    RUN(test_crossentropy_shard);
    RUN(test_attention);
    RUN(test_mixed_adamw_cast);
    return 0;
}

/* precision=bf16 first, in a child (the precision is set once per process, before any
 * allocation, and no CUDA context exists yet to be inherited); its counts come back
 * through a pipe and join this process's. Then precision=mixed here. */
int main(void) {
    int fd[2];
    if (pipe(fd)) {
        perror("pipe");
        return 1;
    }
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) {
        perror("fork");
        return 1;
    }
    if (pid == 0) {
        close(fd[0]);
        printf("precision=bf16\n");
        int counts[2] = {tests_passed_, tests_failed_};
        if (run_mode(OPS_BF16)) counts[1]++;
        else counts[0] = tests_passed_, counts[1] = tests_failed_;
        fflush(stdout);
        _exit(write(fd[1], counts, sizeof counts) == (ssize_t)sizeof counts ? 0 : 1);
    }
    close(fd[1]);
    int counts[2] = {0, 0}, status = 0;
    ssize_t got = read(fd[0], counts, sizeof counts);
    close(fd[0]);
    waitpid(pid, &status, 0);
    if (got != (ssize_t)sizeof counts || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        printf("FAIL precision=bf16: the child process ended without reporting (status %d)\n", status);
        tests_failed_++;
    } else {
        tests_passed_ += counts[0];
        tests_failed_ += counts[1];
    }
    printf("precision=mixed\n");
    if (run_mode(OPS_MIXED)) tests_failed_++;
    return TEST_SUMMARY();
}
