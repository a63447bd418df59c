/* GPU tests for the CUDA backend's mixture-of-experts ops (src/ops/cuda/moe.cuh): every op_moe_*
 * on the cuda backend against the CPU backend's (src/ops/cpu/moe_cpu.c and ops_cpu.c) on the same
 * inputs, each op on its own (its inputs are the CPU's outputs of the ops before it), in
 * precision=fp32, mixed and bf16 (one child process each: the precision is set once per process).
 * Inputs are representable in bf16, so every precision sees the same values.
 * - Index outputs (idx, cnt, pos, rowtok) and the dispatched gates must equal the CPU's exactly;
 *   the combine, its backward, the gates' scaling and the step's statistics bitwise (in bf16,
 *   the CPU's fp32 result rounded once); the rest within a norm-wise relative error (fp32:
 *   1e-5 forward, 1e-4 backward; the routing, computed in double on both, 1e-6; bf16
 *   activations 1.5e-2, as test_ops_bf16.c).
 * - Outputs start as NaN (or -7 for ints) and must be written entirely; gradients start
 *   random and must be accumulated (the experts' input gradient is written: over NaN);
 *   NULL gradients work and give the same bits; a second run of each op is bitwise equal.
 * - Shapes: one expert (k 1), 4 experts k 2 with a bias, 16 k 2 with a capacity that drops,
 *   64 k 6 sigmoid scores with an expert no row chooses, tied logits, rows of widths not a
 *   multiple of 8 (the scalar kernels), 1024 experts k 16, and 150,000 rows (the dispatch's
 *   tiles of several rounds), 200 experts (the router's product split as a wide output's), N = 0 for
 *   the dispatch and statistics.
 * Needs a GPU; usage: gpu_test_ops_moe_cuda. */
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

#define TOL_FWD 1e-5
#define TOL_BWD 1e-4
#define TOL_ROUTE 1e-6  /* routing and statistics: double on both backends */
#define TOL_BF16 1.5e-2 /* one or two bf16 roundings */

static Rng rng;
static const OpsBackend *cpu = &ops_backend_cpu;

/* ------------------------------------------------------------------------------------ */
/* device copies and checks                                                              */

static int bf_act(void) { return ops_act_size() == 2; }
static int bf_state(void) { return ops_state_size() == 2; }
/* a tolerance for outputs of the activations' type, and of the state type */
static double tol_act(double t) { return bf_act() ? TOL_BF16 : t; }
static double tol_state(double t) { return bf_state() ? TOL_BF16 : bf_act() ? 1e-3 : t; }

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
static float *nanf_host(size_t n) {
    float *x = xmalloc(n * sizeof(float) + 4);
    for (size_t i = 0; i < n; i++) x[i] = NAN;
    return x;
}
/* x rounded as the device stores activations */
static void round_act(float *x, size_t n) {
    if (bf_act())
        for (size_t i = 0; i < n; i++) x[i] = bf16_widen(bf16_round(x[i]));
}

/* device copies (op_alloc memory; 16 bytes more, so that n = 0 is no NULL) */
static void *up_act(const float *h, size_t n) {
    void *d = op_alloc(n * ops_act_size() + 16);
    if (bf_act()) {
        uint16_t *b = xmalloc(n * sizeof(uint16_t) + 2);
        for (size_t i = 0; i < n; i++) b[i] = bf16_round(h[i]);
        op_upload(d, b, n * sizeof(uint16_t));
        free(b);
    } else {
        op_upload(d, h, n * sizeof(float));
    }
    return d;
}
static void *up_state(const float *h, size_t n) {
    void *d = op_alloc(n * ops_state_size() + 16);
    op_upload_state(d, h, n);
    return d;
}
static float *up_f32(const float *h, size_t n) {
    float *d = op_alloc(n * sizeof(float) + 16);
    op_upload(d, h, n * sizeof(float));
    return d;
}
/* fp32 device memory full of NaN: outputs that must be written entirely */
static float *nan_f32(size_t n) {
    float *h = nanf_host(n), *d = up_f32(h, n);
    free(h);
    return d;
}
static int *up_int(const int *h, size_t n) {
    int *d = op_alloc(n * sizeof(int) + 16);
    op_upload(d, h, n * sizeof(int));
    return d;
}
static int *int_fill(size_t n, int v) {
    int *h = xmalloc(n * sizeof(int) + 4);
    for (size_t i = 0; i < n; i++) h[i] = v;
    return h;
}
static float *down_act(const void *d, size_t n) {
    float *h = xmalloc(n * sizeof(float) + 4);
    op_download_act(h, d, n);
    return h;
}
static float *down_state(const void *d, size_t n) {
    float *h = xmalloc(n * sizeof(float) + 4);
    op_download_state(h, d, n);
    return h;
}
static float *down_f32(const float *d, size_t n) {
    float *h = xmalloc(n * sizeof(float) + 4);
    op_download(h, d, n * sizeof(float));
    return h;
}
static int *down_int(const int *d, size_t n) {
    int *h = xmalloc(n * sizeof(int) + 4);
    op_download(h, d, n * sizeof(int));
    return h;
}

static int same_f(const float *a, const float *b, size_t n) { return memcmp(a, b, n * sizeof(float)) == 0; }

/* host result h against the CPU's ref: the norm-wise error (and whether bitwise) printed */
static void check_close(const char *what, const char *shape, const float *h, const float *ref, size_t n, double tol) {
    double e = norm_rel_err(h, ref, n);
    printf("    %-30s %-40s err %.2e%s\n", what, shape, e, same_f(h, ref, n) ? "  (bitwise equal)" : "");
    CHECK(e < tol, "%s %s: norm-wise relative error %.3g vs the CPU op (tolerance %.0e)", what, shape, e, tol);
}
static void check_bitwise(const char *what, const char *shape, const float *h, const float *ref, size_t n) {
    size_t bad = 0, first = n;
    for (size_t i = 0; i < n; i++)
        if (memcmp(&h[i], &ref[i], sizeof(float)) != 0 && bad++ == 0) first = i;
    printf("    %-30s %-40s %s\n", what, shape, bad ? "DIFFERS" : "bitwise equal");
    CHECK(bad == 0, "%s %s: %zu of %zu elements differ from the CPU's (first at %zu: %.9g vs %.9g)", what, shape, bad,
          n, first, first < n ? h[first] : 0.0, first < n ? ref[first] : 0.0);
}
static void check_ints(const char *what, const char *shape, const int *h, const int *ref, size_t n) {
    size_t bad = 0, first = n;
    for (size_t i = 0; i < n; i++)
        if (h[i] != ref[i] && bad++ == 0) first = i;
    printf("    %-30s %-40s %s\n", what, shape, bad ? "DIFFERS" : "equal");
    CHECK(bad == 0, "%s %s: %zu of %zu differ from the CPU's (first at %zu: %d vs %d)", what, shape, bad, n, first,
          first < n ? h[first] : 0, first < n ? ref[first] : 0);
}
/* a second run's result (host copy h2) bitwise the first's (h1) */
static void check_repeat(const char *what, const char *shape, const void *h1, const void *h2, size_t bytes) {
    CHECK(memcmp(h1, h2, bytes) == 0, "%s %s: a second run differs from the first (not deterministic)", what, shape);
}

/* ------------------------------------------------------------------------------------ */
/* one shape through every op                                                            */

typedef struct {
    int N, E, H, X, k, capacity, sigmoid, bias, ties, dead; /* dead: an expert the bias keeps out (-1: none) */
} MoeCase;

static void moe_case(const MoeCase *c) {
    int N = c->N, E = c->E, H = c->H, X = c->X, k = c->k, cap = c->capacity;
    char sh[128];
    snprintf(sh, sizeof sh, "N=%d E=%d X=%d k=%d%s%s%s%s", N, E, X, k, cap > 0 ? " cap" : "",
             c->sigmoid ? " sigmoid" : "", c->bias ? " bias" : "", c->ties ? " ties" : "");
    size_t NE = (size_t)N * E, XE = (size_t)X * E, NX = (size_t)N * X, NK = (size_t)N * k;

    /* ---- router forward and backward ---- */
    {
        float *x = randb(NE, 1.0f), *w = randb(XE, 0.2f), *dl = randb(NX, 1.0f);
        float *dx0 = randb(NE, 0.5f), *dw0 = randb(XE, 0.5f);
        float *lg = xmalloc(NX * sizeof(float) + 4), *dx = copyf(dx0, NE), *dw = copyf(dw0, XE);
        cpu->moe_router_forward(lg, x, w, N, E, X);
        cpu->moe_router_backward(dx, dw, dl, x, w, N, E, X);
        void *dX = up_act(x, NE), *dW = up_act(w, XE), *dDX = up_act(dx0, NE), *dDW = up_state(dw0, XE);
        float *dLg = nan_f32(NX), *dDl = up_f32(dl, NX);
        op_moe_router_forward(dLg, dX, dW, N, E, X);
        op_moe_router_backward(dDX, dDW, dDl, dX, dW, N, E, X);
        float *h_lg = down_f32(dLg, NX), *h_dx = down_act(dDX, NE), *h_dw = down_state(dDW, XE);
        check_close("router logits (fp32)", sh, h_lg, lg, NX, bf_act() ? 1e-4 : TOL_FWD);
        check_close("router dx (+=)", sh, h_dx, dx, NE, tol_act(TOL_BWD));
        check_close("router dw (+=)", sh, h_dw, dw, XE, tol_state(TOL_BWD));
        /* twice the same; each gradient alone the same bits as both together */
        op_moe_router_forward(dLg, dX, dW, N, E, X);
        float *r_lg = down_f32(dLg, NX);
        check_repeat("router logits", sh, h_lg, r_lg, NX * sizeof(float));
        void *dDX2 = up_act(dx0, NE), *dDW2 = up_state(dw0, XE);
        op_moe_router_backward(dDX2, NULL, dDl, dX, dW, N, E, X);
        op_moe_router_backward(NULL, dDW2, dDl, dX, NULL, N, E, X);
        float *r_dx = down_act(dDX2, NE), *r_dw = down_state(dDW2, XE);
        check_repeat("router dx alone", sh, h_dx, r_dx, NE * sizeof(float));
        check_repeat("router dw alone", sh, h_dw, r_dw, XE * sizeof(float));
        op_moe_router_backward(NULL, NULL, dDl, dX, dW, N, E, X);
        op_free(dX); op_free(dW); op_free(dDX); op_free(dDW); op_free(dLg); op_free(dDl); op_free(dDX2); op_free(dDW2);
        free(x); free(w); free(dl); free(dx0); free(dw0); free(lg); free(dx); free(dw);
        free(h_lg); free(h_dx); free(h_dw); free(r_lg); free(r_dx); free(r_dw);
    }

    /* ---- routing: top-k, dispatch, statistics ---- */
    float *logits = xmalloc(NX * sizeof(float) + 4), *bias = NULL;
    for (size_t i = 0; i < NX; i++) {
        float z = 1.5f * rng_normal(&rng);
        logits[i] = c->ties ? roundf(2.0f * z) / 2.0f : z; /* steps of 0.5: many equal scores a row */
    }
    if (c->bias) {
        bias = randb((size_t)X, 0.05f);
        if (c->dead >= 0) bias[c->dead] = -1000.0f;
    }
    float *probs = xmalloc(NX * sizeof(float) + 4), *gate = xmalloc(NK * sizeof(float) + 4);
    float *lse = xmalloc((size_t)N * sizeof(float) + 4);
    int *idx = xmalloc(NK * sizeof(int) + 4);
    cpu->moe_topk(probs, idx, gate, lse, logits, bias, N, X, k, c->sigmoid);
    int *cnt = xmalloc((3 * (size_t)X + 1) * sizeof(int)), *pos = xmalloc(NK * sizeof(int) + 4);
    int *rowtok = xmalloc(NK * sizeof(int) + 4);
    float *grow = xmalloc(NK * sizeof(float) + 4);
    cpu->moe_dispatch(cnt, pos, rowtok, grow, idx, gate, N, k, X, cap);
    int P = cnt[3 * X];
    float *stats = xmalloc((2 * (size_t)X + 1) * sizeof(float));
    cpu->moe_stats(stats, cnt, probs, lse, N, X);
    {   /* the case is what it says */
        int dropped = 0;
        for (size_t i = 0; i < NK; i++) dropped += pos[i] < 0;
        CHECK(cap <= 0 || dropped > 0, "%s: the capacity drops nothing", sh);
        CHECK(cap > 0 || dropped == 0, "%s: choices dropped without a capacity", sh);
        CHECK(c->dead < 0 || cnt[c->dead] == 0, "%s: expert %d has rows", sh, c->dead);
        CHECK(P > 0, "%s: no rows", sh);
    }
    {
        float *dLgt = up_f32(logits, NX), *dBias = bias ? up_f32(bias, (size_t)X) : NULL;
        float *dProbs = nan_f32(NX), *dGate = nan_f32(NK);
        float *dLse = nan_f32((size_t)N);
        int *seven = int_fill(NK + 3 * (size_t)X + 1, -7), *dIdx = up_int(seven, NK);
        op_moe_topk(dProbs, dIdx, dGate, dLse, dLgt, dBias, N, X, k, c->sigmoid);
        int *h_idx = down_int(dIdx, NK);
        float *h_probs = down_f32(dProbs, NX), *h_gate = down_f32(dGate, NK), *h_lse = down_f32(dLse, (size_t)N);
        check_ints("topk idx", sh, h_idx, idx, NK);
        check_close("topk probs", sh, h_probs, probs, NX, TOL_ROUTE);
        check_close("topk gate", sh, h_gate, gate, NK, TOL_ROUTE);
        check_close("topk lse", sh, h_lse, lse, (size_t)N, TOL_ROUTE);
        op_moe_topk(dProbs, dIdx, dGate, dLse, dLgt, dBias, N, X, k, c->sigmoid);
        int *r_idx = down_int(dIdx, NK);
        float *r_probs = down_f32(dProbs, NX), *r_gate = down_f32(dGate, NK), *r_lse = down_f32(dLse, (size_t)N);
        check_repeat("topk idx", sh, h_idx, r_idx, NK * sizeof(int));
        check_repeat("topk probs", sh, h_probs, r_probs, NX * sizeof(float));
        check_repeat("topk gate", sh, h_gate, r_gate, NK * sizeof(float));
        check_repeat("topk lse", sh, h_lse, r_lse, (size_t)N * sizeof(float));

        /* dispatch from the CPU's routing */
        int *dI = up_int(idx, NK), *dCnt = up_int(seven, 3 * (size_t)X + 1), *dPos = up_int(seven, NK);
        int *dRt = up_int(seven, NK);
        float *dG = up_f32(gate, NK), *dGr = nan_f32(NK);
        op_moe_dispatch(dCnt, dPos, dRt, dGr, dI, dG, N, k, X, cap);
        int *h_cnt = down_int(dCnt, 3 * (size_t)X + 1), *h_pos = down_int(dPos, NK), *h_rt = down_int(dRt, (size_t)P);
        float *h_gr = down_f32(dGr, (size_t)P);
        check_ints("dispatch cnt", sh, h_cnt, cnt, 3 * (size_t)X + 1);
        check_ints("dispatch pos", sh, h_pos, pos, NK);
        check_ints("dispatch rowtok", sh, h_rt, rowtok, (size_t)P);
        check_bitwise("dispatch gate_rows", sh, h_gr, grow, (size_t)P);
        op_moe_dispatch(dCnt, dPos, dRt, dGr, dI, dG, N, k, X, cap);
        int *r_pos = down_int(dPos, NK), *r_rt = down_int(dRt, (size_t)P);
        check_repeat("dispatch pos", sh, h_pos, r_pos, NK * sizeof(int));
        check_repeat("dispatch rowtok", sh, h_rt, r_rt, (size_t)P * sizeof(int));

        /* statistics from the CPU's */
        int *dC = up_int(cnt, 3 * (size_t)X + 1);
        float *dP = up_f32(probs, NX), *dL = up_f32(lse, (size_t)N), *dS = nan_f32(2 * (size_t)X + 1);
        op_moe_stats(dS, dC, dP, dL, N, X);
        float *h_s = down_f32(dS, 2 * (size_t)X + 1);
        check_close("stats", sh, h_s, stats, 2 * (size_t)X + 1, TOL_ROUTE);
        CHECK(same_f(h_s, stats, (size_t)X), "%s: stats' counts differ", sh);
        op_moe_stats(dS, dC, dP, dL, N, X);
        float *r_s = down_f32(dS, 2 * (size_t)X + 1);
        check_repeat("stats", sh, h_s, r_s, (2 * (size_t)X + 1) * sizeof(float));

        op_free(dLgt); op_free(dBias); op_free(dProbs); op_free(dGate); op_free(dLse); op_free(dIdx);
        op_free(dI); op_free(dCnt); op_free(dPos); op_free(dRt); op_free(dG); op_free(dGr);
        op_free(dC); op_free(dP); op_free(dL); op_free(dS);
        free(seven); free(h_idx); free(h_probs); free(h_gate); free(h_lse); free(r_idx); free(r_probs); free(r_gate);
        free(r_lse); free(h_cnt); free(h_pos); free(h_rt); free(h_gr); free(r_pos); free(r_rt); free(h_s); free(r_s);
    }

    /* ---- the routing's backward, with and without the two losses ---- */
    {
        float *dgr = randb((size_t)P, 1.0f);
        float scales[2][2] = {{0.013f, 0.0021f}, {0.0f, 0.0f}};
        float *dIn[8];
        int *dPos = up_int(pos, NK), *dIdx = up_int(idx, NK);
        dIn[0] = up_f32(dgr, (size_t)P), dIn[1] = up_f32(logits, NX), dIn[2] = up_f32(probs, NX);
        dIn[3] = up_f32(gate, NK), dIn[4] = up_f32(lse, (size_t)N), dIn[5] = up_f32(stats, 2 * (size_t)X + 1);
        for (int v = 0; v < 2; v++) {
            char shv[160];
            snprintf(shv, sizeof shv, "%s%s", sh, v ? " no losses" : "");
            float *ref = xmalloc(NX * sizeof(float) + 4);
            cpu->moe_route_backward(ref, dgr, pos, logits, probs, idx, gate, lse, stats, scales[v][0], scales[v][1], N,
                                    X, k, c->sigmoid);
            float *dOut = nan_f32(NX);
            op_moe_route_backward(dOut, dIn[0], dPos, dIn[1], dIn[2], dIdx, dIn[3], dIn[4], dIn[5], scales[v][0],
                                  scales[v][1], N, X, k, c->sigmoid);
            float *h = down_f32(dOut, NX);
            check_close("route backward dlogits", shv, h, ref, NX, TOL_ROUTE);
            op_moe_route_backward(dOut, dIn[0], dPos, dIn[1], dIn[2], dIdx, dIn[3], dIn[4], dIn[5], scales[v][0],
                                  scales[v][1], N, X, k, c->sigmoid);
            float *r = down_f32(dOut, NX);
            check_repeat("route backward", shv, h, r, NX * sizeof(float));
            op_free(dOut);
            free(ref); free(h); free(r);
        }
        for (int i = 0; i < 6; i++) op_free(dIn[i]);
        op_free(dPos); op_free(dIdx);
        free(dgr);
    }

    /* ---- the experts' grouped products (gate|up: C = E, OC = 2H), weights wstride apart ---- */
    {
        int C = E, OC = 2 * H, *off = cnt + 2 * X;
        size_t wstride = (size_t)OC * C + 8, nw = (size_t)X * wstride, ni = (size_t)P * C, no = (size_t)P * OC;
        float *inp = randb(ni, 1.0f), *w = randb(nw, 0.2f), *dout = randb(no, 1.0f), *dw0 = randb(nw, 0.5f);
        float *out = xmalloc(no * sizeof(float) + 4), *dinp = xcalloc(ni + 1, sizeof(float)), *dw = copyf(dw0, nw);
        cpu->moe_matmul_forward(out, inp, w, wstride, off, X, C, OC);
        cpu->moe_matmul_backward(dinp, dw, wstride, dout, inp, w, off, X, C, OC);
        float *nan_i = nanf_host(ni), *nan_o = nanf_host(no);
        void *dI = up_act(inp, ni), *dW = up_act(w, nw), *dDo = up_act(dout, no), *dO = up_act(nan_o, no);
        void *dDi = up_act(nan_i, ni), *dDw = up_state(dw0, nw);
        op_moe_matmul_forward(dO, dI, dW, wstride, off, X, C, OC);
        op_moe_matmul_backward(dDi, dDw, wstride, dDo, dI, dW, off, X, C, OC);
        float *h_o = down_act(dO, no), *h_di = down_act(dDi, ni), *h_dw = down_state(dDw, nw);
        check_close("experts forward", sh, h_o, out, no, tol_act(TOL_FWD));
        check_close("experts dinp (written)", sh, h_di, dinp, ni, tol_act(TOL_BWD));
        check_close("experts dw (+=)", sh, h_dw, dw, nw, tol_state(TOL_BWD));
        op_moe_matmul_forward(dO, dI, dW, wstride, off, X, C, OC);
        float *r_o = down_act(dO, no);
        check_repeat("experts forward", sh, h_o, r_o, no * sizeof(float));
        void *dDi2 = up_act(nan_i, ni), *dDw2 = up_state(dw0, nw);
        op_moe_matmul_backward(dDi2, NULL, wstride, dDo, NULL, dW, off, X, C, OC);
        op_moe_matmul_backward(NULL, dDw2, wstride, dDo, dI, NULL, off, X, C, OC);
        float *r_di = down_act(dDi2, ni), *r_dw = down_state(dDw2, nw);
        check_repeat("experts dinp alone", sh, h_di, r_di, ni * sizeof(float));
        check_repeat("experts dw alone", sh, h_dw, r_dw, nw * sizeof(float));
        op_free(dI); op_free(dW); op_free(dDo); op_free(dO); op_free(dDi); op_free(dDw); op_free(dDi2); op_free(dDw2);
        free(inp); free(w); free(dout); free(dw0); free(out); free(dinp); free(dw); free(nan_i); free(nan_o);
        free(h_o); free(h_di); free(h_dw); free(r_o); free(r_di); free(r_dw);
    }

    /* ---- combine, its backward, the gates' scaling ---- */
    {
        size_t PE = (size_t)P * E, PH = (size_t)P * H;
        float *out0 = randb(NE, 1.0f), *ys = randb(PE, 1.0f), *out = copyf(out0, NE);
        cpu->moe_combine(out, ys, gate, pos, N, k, E);
        round_act(out, NE);
        int *dPos = up_int(pos, NK);
        float *dGate = up_f32(gate, NK);
        void *dOut = up_act(out0, NE), *dYs = up_act(ys, PE);
        op_moe_combine(dOut, dYs, dGate, dPos, N, k, E);
        float *h = down_act(dOut, NE);
        check_bitwise("combine (+=)", sh, h, out, NE);
        void *dOut2 = up_act(out0, NE);
        op_moe_combine(dOut2, dYs, dGate, dPos, N, k, E);
        float *r = down_act(dOut2, NE);
        check_repeat("combine", sh, h, r, NE * sizeof(float));
        free(h); free(r);

        /* unpermute: written over NaN, and added */
        float *nan_n = nanf_host(NE), *dx0 = randb(NE, 1.0f), *ref_w = xmalloc(NE * sizeof(float) + 4),
              *ref_a = copyf(dx0, NE);
        cpu->moe_unpermute(ref_w, ys, pos, N, k, E, 0);
        cpu->moe_unpermute(ref_a, ys, pos, N, k, E, 1);
        round_act(ref_w, NE);
        round_act(ref_a, NE);
        void *dW = up_act(nan_n, NE), *dA = up_act(dx0, NE);
        op_moe_unpermute(dW, dYs, dPos, N, k, E, 0);
        op_moe_unpermute(dA, dYs, dPos, N, k, E, 1);
        float *hw = down_act(dW, NE), *ha = down_act(dA, NE);
        check_bitwise("unpermute (written)", sh, hw, ref_w, NE);
        check_bitwise("unpermute (+=)", sh, ha, ref_a, NE);
        op_free(dW); op_free(dA);
        free(nan_n); free(dx0); free(ref_w); free(ref_a); free(hw); free(ha);

        /* gate backward: the dot products, and h and dh scaled in place */
        float *hh = randb(PH, 1.0f), *dh = randb(PH, 1.0f), *hh_ref = copyf(hh, PH), *dh_ref = copyf(dh, PH);
        float *dg_ref = xmalloc((size_t)P * sizeof(float) + 4);
        cpu->moe_gate_backward(dg_ref, hh_ref, dh_ref, grow, P, H);
        round_act(hh_ref, PH);
        round_act(dh_ref, PH);
        void *dH = up_act(hh, PH), *dDH = up_act(dh, PH);
        float *dGr = up_f32(grow, (size_t)P), *dDg = nan_f32((size_t)P);
        op_moe_gate_backward(dDg, dH, dDH, dGr, P, H);
        float *h_dg = down_f32(dDg, (size_t)P), *h_h = down_act(dH, PH), *h_dh = down_act(dDH, PH);
        check_close("gate backward dgate", sh, h_dg, dg_ref, (size_t)P, TOL_ROUTE);
        check_bitwise("gate backward h (scaled)", sh, h_h, hh_ref, PH);
        check_bitwise("gate backward dh (scaled)", sh, h_dh, dh_ref, PH);
        void *dH2 = up_act(hh, PH), *dDH2 = up_act(dh, PH);
        op_moe_gate_backward(dDg, dH2, dDH2, dGr, P, H);
        float *r_dg = down_f32(dDg, (size_t)P);
        check_repeat("gate backward dgate", sh, h_dg, r_dg, (size_t)P * sizeof(float));
        op_free(dH); op_free(dDH); op_free(dGr); op_free(dDg); op_free(dH2); op_free(dDH2);
        free(hh); free(dh); free(hh_ref); free(dh_ref); free(dg_ref); free(h_dg); free(h_h); free(h_dh); free(r_dg);

        op_free(dPos); op_free(dGate); op_free(dOut); op_free(dYs); op_free(dOut2);
        free(out0); free(ys); free(out);
    }

    /* ---- the step's statistics ---- */
    {
        size_t na = (size_t)X + 2;
        float *acc0 = randb(na, 10.0f), *acc = copyf(acc0, na);
        cpu->moe_accumulate(acc, stats, N, X, k);
        float *dAcc = up_f32(acc0, na), *dS = up_f32(stats, 2 * (size_t)X + 1);
        op_moe_accumulate(dAcc, dS, N, X, k);
        float *h = down_f32(dAcc, na);
        check_bitwise("accumulate (+=)", sh, h, acc, na);
        op_free(dAcc); op_free(dS);
        free(acc0); free(acc); free(h);
    }

    free(logits); free(bias); free(probs); free(gate); free(lse); free(idx); free(cnt); free(pos); free(rowtok);
    free(grow); free(stats);
}

static void test_moe_small(void) {
    static const MoeCase cases[] = {
        /* N    E    H   X   k  cap sig bias ties dead */
        {5, 8, 8, 1, 1, 0, 0, 0, 0, -1},
        {37, 24, 16, 4, 2, 0, 0, 1, 0, -1},
        {1000, 64, 40, 16, 2, 100, 0, 0, 0, -1},
        {300, 32, 24, 8, 3, 0, 0, 0, 1, -1},
        {513, 20, 12, 16, 2, 40, 1, 1, 1, 3},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) moe_case(&cases[i]);
}
static void test_moe_wide(void) {
    static const MoeCase cases[] = {
        {777, 136, 96, 64, 6, 0, 1, 1, 0, 5},
        {300, 64, 32, 1024, 16, 0, 0, 1, 0, 7},
        {2048, 256, 64, 32, 4, 0, 0, 0, 0, -1},
        {100, 40, 16, 200, 8, 0, 1, 0, 0, -1}, /* 200 router outputs: cuBLASLt's 192 + 8 */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) moe_case(&cases[i]);
}
static void test_moe_many_rows(void) {
    static const MoeCase c = {150000, 16, 8, 8, 2, 30000, 0, 0, 0, -1};
    moe_case(&c);
}

/* N = 0: the dispatch writes zero counts and offsets, the statistics the counts and zeros */
static void test_moe_empty(void) {
    int X = 5, k = 2;
    int *seven = int_fill(3 * (size_t)X + 1, -7), *dCnt = up_int(seven, 3 * (size_t)X + 1);
    int *dI = op_alloc(16), *dPos = op_alloc(16), *dRt = op_alloc(16);
    float *dG = op_alloc(16), *dGr = op_alloc(16), *dS = nan_f32(2 * (size_t)X + 1);
    op_moe_dispatch(dCnt, dPos, dRt, dGr, dI, dG, 0, k, X, 0);
    int *h = down_int(dCnt, 3 * (size_t)X + 1), *z = xcalloc(3 * (size_t)X + 1, sizeof(int));
    check_ints("dispatch cnt", "N=0 X=5", h, z, 3 * (size_t)X + 1);
    op_moe_stats(dS, dCnt, NULL, NULL, 0, X);
    float *hs = down_f32(dS, 2 * (size_t)X + 1), *zs = xcalloc(2 * (size_t)X + 1, sizeof(float));
    check_bitwise("stats", "N=0 X=5", hs, zs, 2 * (size_t)X + 1);
    op_free(dCnt); op_free(dI); op_free(dPos); op_free(dRt); op_free(dG); op_free(dGr); op_free(dS);
    free(seven); free(h); free(z); free(hs); free(zs);
}

static int run_mode(OpsPrecision p) {
    char err[256];
    setenv("MESHTRAIN_CUDA_SYNC", "1", 0); /* a fault is reported at the kernel that made it */
    if (ops_init("cuda", 0, err, sizeof err) || ops_set_precision(p, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return -1;
    }
    rng_seed(&rng, 20261201 + (uint64_t)p);
    printf("%s, precision=%s\n", ops_device_name(), p == OPS_FP32 ? "fp32" : p == OPS_MIXED ? "mixed" : "bf16");
    RUN(test_moe_small);
    RUN(test_moe_wide);
    RUN(test_moe_many_rows);
    RUN(test_moe_empty);
    return 0;
}

/* Each precision in a child process (the precision is set once per process, before any
 * allocation); the counts come back through a pipe. */
int main(void) {
    const OpsPrecision modes[3] = {OPS_FP32, OPS_MIXED, OPS_BF16};
    for (int m = 0; m < 3; m++) {
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
            int counts[2];
            if (run_mode(modes[m])) counts[0] = 0, counts[1] = 1;
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
            printf("FAIL precision %d: the child process ended without reporting (status %d)\n", m, status);
            tests_failed_++;
        } else {
            tests_passed_ += counts[0];
            tests_failed_ += counts[1];
        }
    }
    return TEST_SUMMARY();
}
