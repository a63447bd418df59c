/* GPU test of attention through cuDNN's fused flash attention (src/ops/cuda/attn_cudnn.cu), in
 * precision=mixed through the ops interface, against the CPU backend's fp32 op on the same
 * bf16-representable inputs (after RoPE, as a layer runs it), with the norm-wise tolerances of
 * test_ops_bf16.c (3e-2 for bf16 attention outputs and gradients, 1e-3 for the lse).
 * With the options (ops_set_options) of attention=cudnn deterministic=false, at head_dim 32, 64, 96,
 * 128 and 256, odd T (1, 77, 129, 300) and small B * NH: the forward over NaN (out and lse entirely
 * written), the backward written over NaN (op_attention_backward_set), accumulating (+=) and fused
 * with RoPE's backward; cuDNN's forward with our backward and ours with cuDNN's backward (the two
 * lse agree); the same with attention=cudnn deterministic=true (cuDNN's deterministic backward
 * engine); head_dim 36 (no cuDNN engine: not a multiple of 8) falls back and still passes;
 * attention=auto picks as attn_cudnn_auto says (T = 1100; T = 64; head_dim 96); the deterministic
 * engine over the batch in pieces (long contexts) gives the bytes of one call.
 * The forward must be bitwise reproducible, and so must every backward but cuDNN's atomic one
 * (deterministic=false), whose reproducibility is printed, not checked (cuDNN sums dq with atomics
 * there and does not promise it). Where libcudnn cannot be loaded the cases run on our kernels and
 * say so. Needs a GPU. */
#include "attn_bf16.h"
#include "attn_cudnn.h"
#include "ops.h"
#include "ops_cuda.h"
#include "test.h"
#include "util.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOL 1.5e-2    /* one or two bf16 roundings */
#define TOL_ATT 3e-2  /* attention: probabilities are rounded to bf16 before P @ V */
#define TOL_LSE 1e-3

#include "bf16_check.h"

static void *nan_act(size_t n) { /* bf16 NaNs */
    void *d = op_alloc(n * 2);
    uint16_t *h = xmalloc(n * 2 + 2);
    for (size_t i = 0; i < n; i++) h[i] = 0x7fc0;
    op_upload(d, h, n * 2);
    free(h);
    return d;
}
static float *nan_f32(size_t n) {
    float *d = op_alloc(n * sizeof(float));
    float *h = xmalloc(n * sizeof(float) + 4);
    for (size_t i = 0; i < n; i++) h[i] = NAN;
    op_upload(d, h, n * sizeof(float));
    free(h);
    return d;
}
static int same_bytes(const void *a, const void *b, size_t bytes) {
    unsigned char *x = xmalloc(bytes + 1), *y = xmalloc(bytes + 1);
    op_download(x, a, bytes);
    op_download(y, b, bytes);
    int same = !memcmp(x, y, bytes);
    free(x), free(y);
    return same;
}

/* the options a case runs under, named by the keys that choose them */
typedef struct {
    const char *name;
    OpsOptions o;
} Mode;
static const Mode CUDNN = {"attention=cudnn deterministic=false", {OPS_ATTN_CUDNN, 0}},
                  CUDNN_DET = {"attention=cudnn", {OPS_ATTN_CUDNN, 1}}, OWN = {"attention=own", {OPS_ATTN_OWN, 1}},
                  AUTO = {"attention=auto", {OPS_ATTN_AUTO, 1}};
static void use(const Mode *m) { ops_set_options(&m->o); }

static int have_cudnn;
static int n_cudnn_fwd, n_cudnn_bwd; /* cases cuDNN ran */
static int bwd_runs, bwd_reproducible;

/* One shape under mode; expect: 1 = cuDNN must run it (when the library loads), 0 = it must not,
 * -1 = either. */
static void attention_case(const Mode *mode, int B, int T, int NH, int HD, int expect) {
    char sh[64];
    snprintf(sh, sizeof sh, "B=%d T=%d NH=%d HD=%d", B, T, NH, HD);
    use(mode);
    const char *impl_f = cuda_attention_impl(0, B, T, NH, HD), *impl_b = cuda_attention_impl(1, B, T, NH, HD);
    printf("  %s %s: forward on %s, backward on %s\n", sh, mode->name, impl_f, impl_b);
    if (have_cudnn && expect >= 0) {
        CHECK((strcmp(impl_f, "cudnn") == 0) == expect, "%s %s: forward on %s", sh, mode->name, impl_f);
        CHECK((strcmp(impl_b, "cudnn") == 0) == expect, "%s %s: backward on %s", sh, mode->name, impl_b);
    }
    n_cudnn_fwd += !strcmp(impl_f, "cudnn");
    n_cudnn_bwd += !strcmp(impl_b, "cudnn");

    size_t C = (size_t)NH * HD, nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C, nl = (size_t)B * NH * T;
    float *qkv = randb(nqkv, 1.0f), *g = randb(nout, 1.0f), *dq0 = randb(nqkv, 0.1f);
    float *cs = xmalloc((size_t)T * HD / 2 * sizeof(float) + 4), *sn = xmalloc((size_t)T * HD / 2 * sizeof(float) + 4);
    cpu->rope_tables(cs, sn, T, HD, 10000.0f);
    /* CPU: rope (rounded to bf16, as the GPU stores it), attention forward, backward */
    float *rr = copyf(qkv, nqkv), *o = xmalloc(nout * sizeof(float)), *lse = xmalloc(nl * sizeof(float));
    cpu->rope_forward(rr, cs, sn, B, T, NH, HD);
    for (size_t i = 0; i < nqkv; i++) rr[i] = bf16_widen(bf16_round(rr[i]));
    cpu->attention_forward(o, lse, rr, B, T, NH, HD);
    float *dz = calloc(nqkv, sizeof(float)), *dacc = copyf(dq0, nqkv);
    cpu->attention_backward(dz, g, rr, o, lse, B, T, NH, HD, 1);
    cpu->attention_backward(dacc, g, rr, o, lse, B, T, NH, HD, 1);
    float *dzr = copyf(dz, nqkv);
    cpu->rope_backward(dzr, cs, sn, B, T, NH, HD);

    float *dCS = up_f32(cs, (size_t)T * HD / 2), *dSN = up_f32(sn, (size_t)T * HD / 2);
    void *dQKV = up_act(qkv, nqkv), *dG = up_act(g, nout);
    op_rope_forward(dQKV, dCS, dSN, B, T, NH, HD);
    /* forward over NaN, twice: written entirely, and bitwise the same */
    void *dO = nan_act(nout), *dO2 = nan_act(nout);
    float *dLSE = nan_f32(nl), *dLSE2 = nan_f32(nl);
    op_attention_forward(dO, dLSE, dQKV, B, T, NH, HD);
    expect_act("forward out", sh, dO, o, nout, TOL_ATT);
    expect_f32("forward lse", sh, dLSE, lse, nl, TOL_LSE);
    op_attention_forward(dO2, dLSE2, dQKV, B, T, NH, HD);
    CHECK(same_bytes(dO, dO2, nout * 2) && same_bytes(dLSE, dLSE2, nl * 4), "%s: two forwards differ", sh);
    /* backward written over NaN, accumulating, and fused with RoPE's backward */
    void *dW = nan_act(nqkv), *dW2 = nan_act(nqkv), *dA = up_act(dq0, nqkv), *dR = nan_act(nqkv);
    op_attention_backward_set(dW, dG, dQKV, dO, dLSE, B, T, NH, HD);
    expect_act("backward (=) over NaN", sh, dW, dz, nqkv, TOL_ATT);
    op_attention_backward(dA, dG, dQKV, dO, dLSE, B, T, NH, HD);
    expect_act("backward (+=)", sh, dA, dacc, nqkv, TOL_ATT);
    op_attention_rope_backward_set(dR, dG, dQKV, dO, dLSE, dCS, dSN, B, T, NH, HD);
    expect_act("backward with rope", sh, dR, dzr, nqkv, TOL_ATT);
    op_attention_backward_set(dW2, dG, dQKV, dO, dLSE, B, T, NH, HD);
    int same = same_bytes(dW, dW2, nqkv * 2);
    if (!strcmp(impl_b, "cudnn") && mode == &CUDNN) {
        bwd_runs++, bwd_reproducible += same;
        printf("    backward: two runs %s (not checked: cuDNN's backward is not deterministic)\n",
               same ? "bitwise equal" : "DIFFER");
    } else
        CHECK(same, "%s %s: two backwards on %s differ", sh, mode->name, impl_b);

    /* each forward's lse and out feed the other implementation's backward */
    if (have_cudnn && attn_bf16_supported(HD) && mode == &CUDNN) {
        void *oO = nan_act(nout), *dX = nan_act(nqkv);
        float *oL = nan_f32(nl);
        use(&OWN);
        op_attention_forward(oO, oL, dQKV, B, T, NH, HD);
        use(&CUDNN);
        op_attention_backward_set(dX, dG, dQKV, oO, oL, B, T, NH, HD);
        expect_act("our forward, cuDNN backward", sh, dX, dz, nqkv, TOL_ATT);
        use(&OWN);
        op_attention_backward_set(dX, dG, dQKV, dO, dLSE, B, T, NH, HD);
        expect_act("cuDNN forward, our backward", sh, dX, dz, nqkv, TOL_ATT);
        op_free(oO), op_free(dX), op_free(oL);
    }
    use(&AUTO);

    op_free(dCS), op_free(dSN), op_free(dQKV), op_free(dG), op_free(dO), op_free(dO2), op_free(dLSE);
    op_free(dLSE2), op_free(dW), op_free(dW2), op_free(dA), op_free(dR);
    free(qkv), free(g), free(dq0), free(cs), free(sn), free(rr), free(o), free(lse), free(dz), free(dacc), free(dzr);
}

static void run_case(const Mode *mode, int B, int T, int NH, int HD, int expect) {
    test_failed_checks_ = 0;
    attention_case(mode, B, T, NH, HD, expect);
    if (test_failed_checks_)
        tests_failed_++, printf("FAIL %s B=%d T=%d NH=%d HD=%d\n", mode->name, B, T, NH, HD);
    else tests_passed_++, printf("ok   %s B=%d T=%d NH=%d HD=%d\n", mode->name, B, T, NH, HD);
    fflush(stdout);
}

/* Long contexts: the deterministic engine runs over the batch in pieces (its dP limit lowered
 * here so that 2 of 3 rows fit, as 2 of 4 do at T = 10000 with 8 heads): the same bytes as the
 * whole batch in one call, written and accumulated (rows are independent). */
static void chunked_case(void) {
    int B = 3, T = 130, NH = 2, HD = 64;
    size_t C = (size_t)NH * HD, nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C, nl = (size_t)B * NH * T;
    test_failed_checks_ = 0;
    float *qkv = randb(nqkv, 1.0f), *g = randb(nout, 1.0f), *dq0 = randb(nqkv, 0.1f);
    void *dQKV = up_act(qkv, nqkv), *dG = up_act(g, nout), *dO = nan_act(nout);
    void *dW1 = nan_act(nqkv), *dW2 = nan_act(nqkv), *dA1 = up_act(dq0, nqkv), *dA2 = up_act(dq0, nqkv);
    float *dL = nan_f32(nl);
    use(&CUDNN_DET);
    op_attention_forward(dO, dL, dQKV, B, T, NH, HD);
    op_attention_backward_set(dW1, dG, dQKV, dO, dL, B, T, NH, HD);
    op_attention_backward(dA1, dG, dQKV, dO, dL, B, T, NH, HD);
    cuda_set_attention_det_max(attn_cudnn_det_dp_bytes(2, T, NH));
    const char *impl = cuda_attention_impl(1, B, T, NH, HD);
    CHECK(!have_cudnn || !strcmp(impl, "cudnn"), "backward in pieces ran on %s", impl);
    op_attention_backward_set(dW2, dG, dQKV, dO, dL, B, T, NH, HD);
    op_attention_backward(dA2, dG, dQKV, dO, dL, B, T, NH, HD);
    CHECK(same_bytes(dW1, dW2, nqkv * 2), "backward (=) in pieces differs from one call");
    CHECK(same_bytes(dA1, dA2, nqkv * 2), "backward (+=) in pieces differs from one call");
    cuda_set_attention_det_max(0);
    use(&AUTO);
    op_free(dQKV), op_free(dG), op_free(dO), op_free(dW1), op_free(dW2), op_free(dA1), op_free(dA2), op_free(dL);
    free(qkv), free(g), free(dq0);
    if (test_failed_checks_) tests_failed_++, printf("FAIL attention=cudnn (deterministic) over the batch in pieces\n");
    else tests_passed_++, printf("ok   attention=cudnn (deterministic) over the batch in pieces (on %s)\n", impl);
}

int main(void) {
    char err[256];
    if (ops_init("cuda", 0, err, sizeof err) || ops_set_precision(OPS_MIXED, err, sizeof err)) {
        printf("FAIL attn_cudnn: %s\n", err);
        printf("RESULT 0 1\n");
        return 1;
    }
    rng_seed(&rng, 2026);
    char why[256] = "";
    have_cudnn = attn_cudnn_available(why, sizeof why);
    if (have_cudnn) printf("info cuDNN %zu loaded on %s\n", attn_cudnn_version(), ops_device_name());
    else printf("info cuDNN unavailable (%s): every case runs on our kernels\n", why);

    static const int hds[] = {64, 128, 96, 256, 32};
    for (size_t i = 0; i < sizeof hds / sizeof hds[0]; i++) {
        int HD = hds[i];
        run_case(&CUDNN, 2, 1, 2, HD, -1); /* T = 1: one key per query */
        run_case(&CUDNN, 2, 77, 3, HD, -1);
        run_case(&CUDNN, 1, 300, 2, HD, -1);
        run_case(&CUDNN, 3, 129, 1, HD, -1);
        run_case(&CUDNN_DET, 2, 77, 3, HD, -1); /* the deterministic backward engine */
        run_case(&CUDNN_DET, 1, 300, 2, HD, -1);
    }
    /* the shapes every cuDNN 9 on Hopper must take */
    run_case(&CUDNN, 1, 200, 2, 64, 1);
    run_case(&CUDNN, 2, 256, 2, 128, 1);
    run_case(&CUDNN, 2, 50, 2, 36, 0); /* head_dim not a multiple of 8: no engine, our kernels */
    run_case(&AUTO, 1, 1100, 2, 128, 1); /* cuDNN, its backward the deterministic engine */
    run_case(&AUTO, 2, 64, 2, 64, 0);     /* short, a head_dim our kernels take: ours */
    run_case(&AUTO, 2, 77, 2, 96, 1);     /* a head_dim ours do not take: cuDNN */
    chunked_case();
    printf("info cuDNN ran %d forwards and %d backwards of %d cases; its backward was bitwise reproducible in %d of "
           "%d\n",
           n_cudnn_fwd, n_cudnn_bwd, tests_passed_ + tests_failed_, bwd_reproducible, bwd_runs);
    return TEST_SUMMARY();
}
