/* GPU tests for the CUDA backend (ops_cuda.cu): every cuda_<op> against the CPU backend's
 * op_<op> (itself tested against double references in tests/test_ops.c) on the same random
 * inputs, at small odd sizes and at training-like sizes, plus the interface conventions:
 * forward outputs are fully overwritten (outputs start as NaN), backward ops accumulate
 * (gradients start random, not zero), NULL gradients are accepted, and two runs of an op
 * are bitwise equal. Needs a GPU; usage: gpu_test_ops_cuda [device]. */
#include "ops.h"
#include "ops_cuda.h"
#include "test.h"
#include "util.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOL_FWD 1e-5 /* norm-wise relative error, GPU vs CPU, forward */
#define TOL_BWD 1e-4 /* backward */

static Rng rng;

/* ------------------------------------------------------------------------------------ */
/* helpers                                                                               */

static float *randf(size_t n, float scale) {
    float *x = xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = scale * rng_normal(&rng);
    return x;
}
static float *copyf(const float *x, size_t n) {
    float *y = xmalloc(n * sizeof(float));
    memcpy(y, x, n * sizeof(float));
    return y;
}
static int *rand_tokens(size_t n, int V) {
    int *t = xmalloc(n * sizeof(int));
    for (size_t i = 0; i < n; i++) t[i] = (int)(rng_u64(&rng) % (uint64_t)V);
    return t;
}

/* Device buffers of one test case, freed together. `off` floats of offset make the pointer
 * unaligned (4 bytes past a 256-byte boundary for off = 1). */
#define MAX_DEV 64
static void *dev_bufs[MAX_DEV];
static int n_dev;
static float *dalloc(size_t n, int off) {
    if (n_dev == MAX_DEV) die(1, "test: too many device buffers");
    float *p = cuda_malloc((n + (size_t)off) * sizeof(float) + 4);
    dev_bufs[n_dev++] = p;
    return p + off;
}
static void dfree_all(void) {
    for (int i = 0; i < n_dev; i++) cuda_free(dev_bufs[i]);
    n_dev = 0;
}
/* a device copy of host data */
static float *dcopy(const float *h, size_t n, int off) {
    float *d = dalloc(n, off);
    cuda_memcpy_h2d(d, h, n * sizeof(float));
    return d;
}
static int *dcopy_int(const int *h, size_t n) {
    int *d = (int *)dalloc(n, 0);
    cuda_memcpy_h2d(d, h, n * sizeof(int));
    return d;
}
static void dset(float *d, const float *h, size_t n) { cuda_memcpy_h2d(d, h, n * sizeof(float)); }
/* a device buffer full of NaN, for outputs that must be overwritten entirely */
static float *dnan(size_t n, int off) {
    float *h = xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) h[i] = NAN;
    float *d = dcopy(h, n, off);
    free(h);
    return d;
}
static float *hcopy(const float *d, size_t n) {
    float *h = xmalloc(n * sizeof(float) + 4);
    cuda_memcpy_d2h(h, d, n * sizeof(float));
    return h;
}

static int same(const float *a, const float *b, size_t n) { return memcmp(a, b, n * sizeof(float)) == 0; }

/* Compares device array d with the CPU result ref; prints the error, and whether the two
 * are bitwise equal (expected for the ops made of single roundings). */
static void expect_close(const char *what, const char *shape, const float *d, const float *ref, size_t n,
                         double tol) {
    float *h = hcopy(d, n);
    double e = norm_rel_err(h, ref, n);
    printf("    %-22s %-34s err %.2e%s\n", what, shape, e, same(h, ref, n) ? "  (bitwise equal)" : "");
    CHECK(e < tol, "%s %s: norm-wise relative error %.3g vs CPU (tolerance %.0e)", what, shape, e, tol);
    free(h);
}
static void expect_bitwise(const char *what, const char *shape, const float *d, const float *ref, size_t n) {
    float *h = hcopy(d, n);
    CHECK(same(h, ref, n), "%s %s: not bitwise equal to the CPU result (err %.3g)", what, shape, norm_rel_err(h, ref, n));
    free(h);
}
/* a device array bitwise equal to a host one saved earlier */
static void expect_same_host(const char *what, const char *shape, const float *d, const float *h, size_t n) {
    float *a = hcopy(d, n);
    CHECK(same(a, h, n), "%s %s: differs from the first run (not deterministic)", what, shape);
    free(a);
}

/* ------------------------------------------------------------------------------------ */
/* matmul                                                                                */

static void matmul_case(int N, int C, int OC, int off) {
    char shape[96];
    snprintf(shape, sizeof shape, "N=%d C=%d OC=%d%s", N, C, OC, off ? " unaligned" : "");
    size_t ni = (size_t)N * C, nw = (size_t)OC * C, no = (size_t)N * OC;
    float *inp = randf(ni, 1.0f), *w = randf(nw, 1.0f), *dout = randf(no, 1.0f);
    float *dinp0 = randf(ni, 1.0f), *dw0 = randf(nw, 1.0f);
    float *out = xmalloc(no * sizeof(float)), *dinp = copyf(dinp0, ni), *dw = copyf(dw0, nw);
    op_matmul_forward(out, inp, w, N, C, OC);
    op_matmul_backward(dinp, dw, dout, inp, w, N, C, OC);

    float *d_inp = dcopy(inp, ni, off), *d_w = dcopy(w, nw, off), *d_dout = dcopy(dout, no, off);
    float *d_out = dnan(no, off), *d_dinp = dcopy(dinp0, ni, off), *d_dw = dcopy(dw0, nw, off);
    cuda_matmul_forward(d_out, OC, d_inp, d_w, N, C, OC);
    cuda_matmul_backward(d_dinp, d_dw, d_dout, OC, d_inp, d_w, N, C, OC, 1);
    expect_close("matmul forward", shape, d_out, out, no, TOL_FWD);
    {   /* with the residual in the epilogue: out + res, every element written */
        float *res = randf(no, 1.0f), *want = xmalloc(no * sizeof(float));
        for (size_t i = 0; i < no; i++) want[i] = out[i] + res[i];
        float *d_res = dcopy(res, no, off), *d_sum = dnan(no, off);
        cuda_matmul_forward_add(d_sum, d_inp, d_w, d_res, N, C, OC);
        expect_close("matmul forward + residual", shape, d_sum, want, no, TOL_FWD);
        free(res); free(want);
    }
    {   /* the input gradient with res in the epilogue (written over NaN): dout @ w + res */
        float *res = randf(ni, 1.0f), *want = xmalloc(ni * sizeof(float));
        for (size_t i = 0; i < ni; i++) want[i] = dinp[i] - dinp0[i] + res[i];
        float *d_res = dcopy(res, ni, off), *d_sum = dnan(ni, off);
        cuda_matmul_backward_add(d_sum, d_dout, d_w, d_res, N, C, OC);
        expect_close("matmul backward dinp + res", shape, d_sum, want, ni, TOL_BWD);
        free(res); free(want);
    }
    expect_close("matmul backward dinp", shape, d_dinp, dinp, ni, TOL_BWD);
    expect_close("matmul backward dw", shape, d_dw, dw, nw, TOL_BWD);

    /* determinism, and NULL gradients (each alone gives the same bits as both together) */
    float *g_out = hcopy(d_out, no), *g_dinp = hcopy(d_dinp, ni), *g_dw = hcopy(d_dw, nw);
    cuda_matmul_forward(d_out, OC, d_inp, d_w, N, C, OC);
    expect_same_host("matmul forward", shape, d_out, g_out, no);
    dset(d_dinp, dinp0, ni);
    dset(d_dw, dw0, nw);
    cuda_matmul_backward(d_dinp, NULL, d_dout, OC, d_inp, d_w, N, C, OC, 1);
    cuda_matmul_backward(NULL, d_dw, d_dout, OC, d_inp, d_w, N, C, OC, 1);
    expect_same_host("matmul backward dinp", shape, d_dinp, g_dinp, ni);
    expect_same_host("matmul backward dw", shape, d_dw, g_dw, nw);
    cuda_matmul_backward(NULL, NULL, d_dout, OC, d_inp, d_w, N, C, OC, 1);
    /* acc = 0 writes dinp: over NaN, the same bits as accumulating into zeros */
    float *zeros = calloc(ni, sizeof(float)), *d_z = dcopy(zeros, ni, off), *d_s = dnan(ni, off);
    cuda_matmul_backward(d_z, NULL, d_dout, OC, d_inp, d_w, N, C, OC, 1);
    cuda_matmul_backward(d_s, NULL, d_dout, OC, d_inp, d_w, N, C, OC, 0);
    float *h_z = hcopy(d_z, ni);
    expect_same_host("matmul backward dinp written (acc=0)", shape, d_s, h_z, ni);
    free(zeros); free(h_z);

    free(g_out); free(g_dinp); free(g_dw);
    free(inp); free(w); free(dout); free(dinp0); free(dw0); free(out); free(dinp); free(dw);
    dfree_all();
}

static void test_matmul(void) {
    matmul_case(1, 1, 1, 0);
    matmul_case(7, 13, 5, 0);
    matmul_case(33, 65, 17, 1);
    matmul_case(64, 128, 96, 0);
    matmul_case(4096, 256, 768, 0);
    matmul_case(1000, 768, 257, 1);
    /* C = 0: out = 0 */
    float *d_out = dnan(15, 0), z[15] = {0};
    cuda_matmul_forward(d_out, 5, NULL, NULL, 3, 0, 5);
    expect_bitwise("matmul forward", "N=3 C=0 OC=5", d_out, z, 15);
    dfree_all();
}

/* ------------------------------------------------------------------------------------ */
/* embedding                                                                             */

static void embedding_case(int V, int N, int C) {
    char shape[96];
    snprintf(shape, sizeof shape, "V=%d N=%d C=%d", V, N, C);
    size_t nw = (size_t)V * C, no = (size_t)N * C;
    int *tok = rand_tokens((size_t)N, V);
    for (int n = 0; n < N; n += 2) tok[n] = (int)(rng_u64(&rng) % (uint64_t)(V < 50 ? V : 50)); /* repeats */
    float *wte = randf(nw, 1.0f), *dout = randf(no, 1.0f), *dwte0 = randf(nw, 1.0f);
    float *out = xmalloc(no * sizeof(float)), *dwte = copyf(dwte0, nw);
    op_embedding_forward(out, tok, wte, N, C);
    op_embedding_backward(dwte, dout, tok, N, C);

    int *d_tok = dcopy_int(tok, (size_t)N);
    float *d_wte = dcopy(wte, nw, 0), *d_dout = dcopy(dout, no, 0), *d_out = dnan(no, 0);
    float *d_dwte = dcopy(dwte0, nw, 0);
    cuda_embedding_forward(d_out, d_tok, d_wte, N, C);
    cuda_embedding_backward(d_dwte, d_dout, d_tok, N, C);
    expect_close("embedding forward", shape, d_out, out, no, TOL_FWD);
    expect_close("embedding backward", shape, d_dwte, dwte, nw, TOL_BWD);

    float *first = hcopy(d_dwte, nw);
    dset(d_dwte, dwte0, nw);
    cuda_embedding_backward(d_dwte, d_dout, d_tok, N, C);
    expect_same_host("embedding backward", shape, d_dwte, first, nw);
    cuda_embedding_backward(NULL, d_dout, d_tok, N, C);

    /* by row, from the index: bitwise the kernel above */
    int *count = xmalloc((size_t)V * sizeof(int)), *idx = xmalloc((3 * (size_t)N + 1) * sizeof(int));
    int nr = embedding_rows_index(tok, N, V, count, idx);
    int *d_idx = dcopy_int(idx, 3 * (size_t)N + 1);
    dset(d_dwte, dwte0, nw);
    cuda_embedding_backward_rows(d_dwte, d_dout, d_idx, nr, N, C);
    expect_same_host("embedding backward by row", shape, d_dwte, first, nw);
    cuda_embedding_backward_rows(NULL, d_dout, d_idx, nr, N, C);
    free(count); free(idx);

    free(first); free(tok); free(wte); free(dout); free(dwte0); free(out); free(dwte);
    dfree_all();
}

/* Vocabulary parallel: the shard's rows [lo, lo + rows) of a V-row table, zeros elsewhere
 * (bitwise the CPU's: copies only). */
static void embedding_shard_case(int V, int N, int C, int lo, int rows) {
    char shape[96];
    snprintf(shape, sizeof shape, "V=%d N=%d C=%d rows %d+%d", V, N, C, lo, rows);
    size_t nw = (size_t)rows * C, no = (size_t)N * C;
    int *tok = rand_tokens((size_t)N, V);
    float *wte = randf(nw, 1.0f), *out = xmalloc(no * sizeof(float));
    op_embedding_forward_shard(out, tok, wte, N, C, lo, rows);
    int *d_tok = dcopy_int(tok, (size_t)N);
    float *d_wte = dcopy(wte, nw, 0), *d_out = dnan(no, 0);
    cuda_embedding_forward_shard(d_out, d_tok, d_wte, N, C, lo, rows);
    expect_bitwise("embedding forward shard", shape, d_out, out, no);
    free(tok); free(wte); free(out);
    dfree_all();
}

static void test_embedding(void) {
    embedding_shard_case(50257, 4096, 64, 25152, 25105);
    embedding_shard_case(100, 300, 19, 0, 32);
    embedding_case(13, 37, 19);
    embedding_case(1000, 3000, 1);
    embedding_case(50257, 4096, 768);
    embedding_case(50257, 32768, 1024);  /* the post's batch: rows with thousands of positions */
}

/* ------------------------------------------------------------------------------------ */
/* rmsnorm                                                                               */

static void rmsnorm_case(int N, int C) {
    char shape[96];
    snprintf(shape, sizeof shape, "N=%d C=%d", N, C);
    size_t nx = (size_t)N * C;
    float eps = 1e-5f;
    float *x = randf(nx, 1.0f), *w = randf((size_t)C, 0.1f), *dout = randf(nx, 1.0f);
    for (int c = 0; c < C; c++) w[c] += 1.0f;
    float *dx0 = randf(nx, 1.0f), *dw0 = randf((size_t)C, 1.0f);
    float *out = xmalloc(nx * sizeof(float)), *rstd = xmalloc((size_t)N * sizeof(float));
    float *dx = copyf(dx0, nx), *dw = copyf(dw0, (size_t)C);
    op_rmsnorm_forward(out, rstd, x, w, N, C, eps);
    op_rmsnorm_backward(dx, dw, dout, x, w, rstd, N, C);

    float *d_x = dcopy(x, nx, 0), *d_w = dcopy(w, (size_t)C, 0), *d_dout = dcopy(dout, nx, 0);
    float *d_out = dnan(nx, 0), *d_rstd = dnan((size_t)N, 0);
    float *d_dx = dcopy(dx0, nx, 0), *d_dw = dcopy(dw0, (size_t)C, 0);
    cuda_rmsnorm_forward(d_out, d_rstd, d_x, d_w, N, C, eps);
    expect_close("rmsnorm forward", shape, d_out, out, nx, TOL_FWD);
    expect_close("rmsnorm forward rstd", shape, d_rstd, rstd, (size_t)N, TOL_FWD);
    cuda_rmsnorm_backward(d_dx, d_dw, d_dout, d_x, d_w, d_rstd, N, C);
    expect_close("rmsnorm backward dx", shape, d_dx, dx, nx, TOL_BWD);
    expect_close("rmsnorm backward dw", shape, d_dw, dw, (size_t)C, TOL_BWD);

    float *g_dx = hcopy(d_dx, nx), *g_dw = hcopy(d_dw, (size_t)C);
    dset(d_dx, dx0, nx);
    dset(d_dw, dw0, (size_t)C);
    cuda_rmsnorm_backward(d_dx, NULL, d_dout, d_x, d_w, d_rstd, N, C);
    cuda_rmsnorm_backward(NULL, d_dw, d_dout, d_x, d_w, d_rstd, N, C);
    expect_same_host("rmsnorm backward dx", shape, d_dx, g_dx, nx);
    expect_same_host("rmsnorm backward dw", shape, d_dw, g_dw, (size_t)C);
    cuda_rmsnorm_backward(NULL, NULL, d_dout, d_x, d_w, d_rstd, N, C);

    /* the fused residual add + rmsnorm: the CPU's result, and bitwise the GPU's add then norm */
    float *br = randf(nx, 1.0f), *res = copyf(x, nx), *fout = xmalloc(nx * sizeof(float));
    float *frstd = xmalloc((size_t)N * sizeof(float));
    op_add_rmsnorm_forward(res, fout, frstd, br, w, N, C, eps);
    float *d_res = dcopy(x, nx, 0), *d_br = dcopy(br, nx, 0), *d_fout = dnan(nx, 0), *d_frstd = dnan((size_t)N, 0);
    cuda_add_rmsnorm_forward(d_res, d_fout, d_frstd, d_br, d_w, N, C, eps);
    expect_same_host("add_rmsnorm residual (bitwise the CPU's add)", shape, d_res, res, nx);
    expect_close("add_rmsnorm forward", shape, d_fout, fout, nx, TOL_FWD);
    expect_close("add_rmsnorm rstd", shape, d_frstd, frstd, (size_t)N, TOL_FWD);
    float *d_sep = dcopy(x, nx, 0);
    cuda_add(d_sep, d_br, nx);
    cuda_rmsnorm_forward(d_out, d_rstd, d_sep, d_w, N, C, eps);
    float *h_out = hcopy(d_out, nx), *h_rstd = hcopy(d_rstd, (size_t)N);
    expect_same_host("add_rmsnorm vs add then rmsnorm", shape, d_fout, h_out, nx);
    expect_same_host("add_rmsnorm rstd vs add then rmsnorm", shape, d_frstd, h_rstd, (size_t)N);
    free(br); free(res); free(fout); free(frstd); free(h_out); free(h_rstd);

    free(g_dx); free(g_dw);
    free(x); free(w); free(dout); free(dx0); free(dw0); free(out); free(rstd); free(dx); free(dw);
    dfree_all();
}

static void test_rmsnorm(void) {
    rmsnorm_case(1, 1);
    rmsnorm_case(5, 7);
    rmsnorm_case(37, 1000);
    rmsnorm_case(300, 70);
    rmsnorm_case(4096, 768);
    rmsnorm_case(40, 2056); /* forward: more vectors than a lane keeps; backward: the wide-row kernel */
    rmsnorm_case(33, 4096); /* the 7B model's rows */
    rmsnorm_case(9, 16392); /* beyond what the scalar kernel's shared memory could hold */
    rmsnorm_case(21, 1500); /* C % 8 != 0 past 1024: the scalar kernel */
}

/* ------------------------------------------------------------------------------------ */
/* rope                                                                                  */

static void rope_case(int B, int T, int NH, int HD) {
    char shape[96];
    snprintf(shape, sizeof shape, "B=%d T=%d NH=%d HD=%d", B, T, NH, HD);
    size_t nt = (size_t)T * (HD / 2), n = (size_t)B * T * 3 * NH * HD;
    float *cs = xmalloc(nt * sizeof(float)), *sn = xmalloc(nt * sizeof(float));
    op_rope_tables(cs, sn, T, HD, 10000.0f);
    float *d_cs = dnan(nt, 0), *d_sn = dnan(nt, 0);
    cuda_rope_tables(d_cs, d_sn, T, HD, 10000.0f);
    expect_close("rope tables cos", shape, d_cs, cs, nt, TOL_FWD);
    expect_close("rope tables sin", shape, d_sn, sn, nt, TOL_FWD);

    float *qkv = randf(n, 1.0f), *dqkv = randf(n, 1.0f);
    float *d_qkv = dcopy(qkv, n, 0), *d_dqkv = dcopy(dqkv, n, 0);
    op_rope_forward(qkv, cs, sn, B, T, NH, HD);
    op_rope_backward(dqkv, cs, sn, B, T, NH, HD);
    cuda_rope_forward(d_qkv, d_cs, d_sn, B, T, NH, HD);
    cuda_rope_backward(d_dqkv, d_cs, d_sn, B, T, NH, HD);
    expect_close("rope forward", shape, d_qkv, qkv, n, TOL_FWD);
    expect_close("rope backward", shape, d_dqkv, dqkv, n, TOL_BWD);
    cuda_rope_backward(NULL, d_cs, d_sn, B, T, NH, HD);

    free(cs); free(sn); free(qkv); free(dqkv);
    dfree_all();
}

static void test_rope(void) {
    rope_case(1, 5, 2, 2);
    rope_case(2, 7, 3, 6);
    rope_case(4, 256, 4, 64);
    rope_case(2, 100, 2, 128);
}

/* ------------------------------------------------------------------------------------ */
/* attention                                                                             */

static void attention_case(int B, int T, int NH, int HD) {
    char shape[96];
    snprintf(shape, sizeof shape, "B=%d T=%d NH=%d HD=%d", B, T, NH, HD);
    int C = NH * HD;
    size_t nq = (size_t)B * T * 3 * C, no = (size_t)B * T * C, nl = (size_t)B * NH * T;
    float *qkv = randf(nq, 1.0f), *dout = randf(no, 1.0f), *dqkv0 = randf(nq, 1.0f);
    float *out = xmalloc(no * sizeof(float)), *lse = xmalloc(nl * sizeof(float)), *dqkv = copyf(dqkv0, nq);
    op_attention_forward(out, lse, qkv, B, T, NH, HD);
    op_attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, HD);

    float *d_qkv = dcopy(qkv, nq, 0), *d_dout = dcopy(dout, no, 0), *d_dqkv = dcopy(dqkv0, nq, 0);
    float *d_out = dnan(no, 0), *d_lse = dnan(nl, 0);
    cuda_attention_forward(d_out, d_lse, d_qkv, B, T, NH, HD);
    expect_close("attention forward", shape, d_out, out, no, TOL_FWD);
    expect_close("attention forward lse", shape, d_lse, lse, nl, TOL_FWD);
    cuda_attention_backward(d_dqkv, d_dout, d_qkv, d_out, d_lse, B, T, NH, HD, 1);
    expect_close("attention backward", shape, d_dqkv, dqkv, nq, TOL_BWD);

    float *g_out = hcopy(d_out, no), *g_lse = hcopy(d_lse, nl), *g_dqkv = hcopy(d_dqkv, nq);
    cuda_attention_forward(d_out, d_lse, d_qkv, B, T, NH, HD);
    expect_same_host("attention forward", shape, d_out, g_out, no);
    expect_same_host("attention forward lse", shape, d_lse, g_lse, nl);
    dset(d_dqkv, dqkv0, nq);
    cuda_attention_backward(d_dqkv, d_dout, d_qkv, d_out, d_lse, B, T, NH, HD, 1);
    expect_same_host("attention backward", shape, d_dqkv, g_dqkv, nq);
    cuda_attention_backward(NULL, d_dout, d_qkv, d_out, d_lse, B, T, NH, HD, 1);
    /* acc = 0 writes dqkv: over NaN, the same bits as accumulating into zeros */
    float *zeros = calloc(nq, sizeof(float)), *d_z = dcopy(zeros, nq, 0), *d_s = dnan(nq, 0);
    cuda_attention_backward(d_z, d_dout, d_qkv, d_out, d_lse, B, T, NH, HD, 1);
    cuda_attention_backward(d_s, d_dout, d_qkv, d_out, d_lse, B, T, NH, HD, 0);
    float *h_z = hcopy(d_z, nq);
    expect_same_host("attention backward written (acc=0)", shape, d_s, h_z, nq);
    /* with RoPE's backward (fp32: the two passes): the same bits as the two ops */
    float *d_cs = dnan((size_t)T * (HD / 2) + 1, 0), *d_sn = dnan((size_t)T * (HD / 2) + 1, 0);
    cuda_rope_tables(d_cs, d_sn, T, HD, 10000.0f);
    cuda_rope_backward(d_z, d_cs, d_sn, B, T, NH, HD);
    float *d_r = dnan(nq, 0), *h_zr = hcopy(d_z, nq);
    cuda_attention_rope_backward(d_r, d_dout, d_qkv, d_out, d_lse, d_cs, d_sn, B, T, NH, HD);
    expect_same_host("attention + rope backward", shape, d_r, h_zr, nq);
    free(zeros); free(h_z); free(h_zr);

    free(g_out); free(g_lse); free(g_dqkv);
    free(qkv); free(dout); free(dqkv0); free(out); free(lse); free(dqkv);
    dfree_all();
}

static void test_attention(void) {
    attention_case(1, 1, 1, 8);
    attention_case(2, 37, 3, 16);
    attention_case(1, 70, 2, 24);
    attention_case(1, 64, 2, 40);
    attention_case(2, 45, 2, 128); /* > 48 KiB of shared memory */
    attention_case(1, 33, 1, 256); /* the largest head size */
    attention_case(4, 256, 4, 64);
    attention_case(1, 300, 2, 128);
}

/* ------------------------------------------------------------------------------------ */
/* swiglu                                                                                */

static void swiglu_case(int N, int H) {
    char shape[96];
    snprintf(shape, sizeof shape, "N=%d H=%d", N, H);
    size_t ng = (size_t)N * 2 * H, no = (size_t)N * H;
    float *gu = randf(ng, 2.0f), *dout = randf(no, 1.0f), *dgu0 = randf(ng, 1.0f);
    float *out = xmalloc(no * sizeof(float)), *dgu = copyf(dgu0, ng);
    op_swiglu_forward(out, gu, N, H);
    op_swiglu_backward(dgu, dout, gu, N, H);
    float *d_gu = dcopy(gu, ng, 0), *d_dout = dcopy(dout, no, 0), *d_dgu = dcopy(dgu0, ng, 0), *d_out = dnan(no, 0);
    cuda_swiglu_forward(d_out, d_gu, N, H);
    cuda_swiglu_backward(d_dgu, d_dout, d_gu, N, H, 1);
    expect_close("swiglu forward", shape, d_out, out, no, TOL_FWD);
    expect_close("swiglu backward", shape, d_dgu, dgu, ng, TOL_BWD);
    cuda_swiglu_backward(NULL, d_dout, d_gu, N, H, 1);
    /* acc = 0 writes dgu: over NaN, the same bits as accumulating into zeros */
    float *zeros = calloc(ng, sizeof(float)), *d_z = dcopy(zeros, ng, 0), *d_s = dnan(ng, 0);
    cuda_swiglu_backward(d_z, d_dout, d_gu, N, H, 1);
    cuda_swiglu_backward(d_s, d_dout, d_gu, N, H, 0);
    float *h_z = hcopy(d_z, ng);
    expect_same_host("swiglu backward written (acc=0)", shape, d_s, h_z, ng);
    free(zeros); free(h_z);
    free(gu); free(dout); free(dgu0); free(out); free(dgu);
    dfree_all();
}

static void test_swiglu(void) {
    swiglu_case(1, 1);
    swiglu_case(3, 5);
    swiglu_case(4096, 1536);
}

/* ------------------------------------------------------------------------------------ */
/* cross-entropy                                                                         */

static void crossentropy_case(int N, int V) {
    char shape[96];
    snprintf(shape, sizeof shape, "N=%d V=%d", N, V);
    size_t nl = (size_t)N * V;
    float *logits = randf(nl, 3.0f);
    int *tgt = rand_tokens((size_t)N, V);
    float *loss = xmalloc((size_t)N * sizeof(float)), *grad = copyf(logits, nl);
    float *loss2 = xmalloc((size_t)N * sizeof(float));
    float scale = 1.0f / (float)N;
    op_crossentropy_forward_backward(loss, grad, tgt, N, V, scale);
    op_crossentropy_forward_backward(loss2, logits, tgt, N, V, 0.0f); /* logits unchanged */

    int *d_tgt = dcopy_int(tgt, (size_t)N);
    float *d_logits = dcopy(logits, nl, 0), *d_loss = dnan((size_t)N, 0);
    /* losses only: logits stay as they are */
    cuda_crossentropy_forward_backward(d_loss, d_logits, V, d_tgt, N, V, 0.0f);
    expect_close("crossentropy loss", shape, d_loss, loss2, (size_t)N, TOL_FWD);
    expect_bitwise("crossentropy no grad", shape, d_logits, logits, nl);
    /* losses and the gradient in place */
    cuda_crossentropy_forward_backward(d_loss, d_logits, V, d_tgt, N, V, scale);
    expect_close("crossentropy loss", shape, d_loss, loss, (size_t)N, TOL_FWD);
    expect_close("crossentropy dlogits", shape, d_logits, grad, nl, TOL_BWD);
    /* determinism */
    float *g_loss = hcopy(d_loss, (size_t)N), *g_grad = hcopy(d_logits, nl);
    dset(d_logits, logits, nl);
    cuda_crossentropy_forward_backward(d_loss, d_logits, V, d_tgt, N, V, scale);
    expect_same_host("crossentropy loss", shape, d_loss, g_loss, (size_t)N);
    expect_same_host("crossentropy dlogits", shape, d_logits, g_grad, nl);

    free(g_loss); free(g_grad);
    free(logits); free(tgt); free(loss); free(loss2); free(grad);
    dfree_all();
}

/* Rows with NaN, +inf, all -inf (NaN loss and gradient, as on the CPU), some -inf (fine),
 * and a target out of range (NaN on the GPU; the CPU op does not check). */
static void test_crossentropy_special(void) {
    enum { N = CE_SPECIAL_N, V = 100 };
    float *logits = randf((size_t)N * V, 2.0f);
    int tgt[N];
    ce_special_rows(logits, V, tgt);
    float *grad = copyf(logits, (size_t)N * V), loss[N];
    op_crossentropy_forward_backward(loss, grad, tgt, N - 1, V, 0.5f); /* the CPU without row 5 */
    tgt[5] = V;                                                       /* out of range */
    int *d_tgt = dcopy_int(tgt, N);
    float *d_logits = dcopy(logits, (size_t)N * V, 0), *d_loss = dnan(N, 0);
    cuda_crossentropy_forward_backward(d_loss, d_logits, V, d_tgt, N, V, 0.5f);
    float *g_loss = hcopy(d_loss, N), *g_grad = hcopy(d_logits, (size_t)N * V);
    for (int n = 0; n < N; n++) {
        int expect_nan = ce_special_nan(n);
        CHECK((isnan(g_loss[n]) != 0) == expect_nan, "row %d: loss %g", n, g_loss[n]);
        if (n < N - 1) CHECK((isnan(loss[n]) != 0) == expect_nan, "CPU row %d: loss %g", n, loss[n]);
        int all_nan = 1, any_nan = 0;
        for (int j = 0; j < V; j++) {
            all_nan &= isnan(g_grad[n * V + j]) != 0;
            any_nan |= isnan(g_grad[n * V + j]) != 0;
        }
        CHECK(expect_nan ? all_nan : !any_nan, "row %d: gradient NaN pattern", n);
    }
    CHECK(fabs(g_loss[0] - loss[0]) <= 1e-5 * fabs(loss[0]), "row 0: %g vs %g", g_loss[0], loss[0]);
    CHECK(fabs(g_loss[4] - loss[4]) <= 1e-5 * fabs(loss[4]), "row 4: %g vs %g", g_loss[4], loss[4]);
    CHECK(norm_rel_err(g_grad + 4 * V, grad + 4 * V, V) < TOL_BWD, "row 4 gradient");
    free(logits); free(grad); free(g_loss); free(g_grad);
    dfree_all();
}

/* Vocabulary parallel: each shard's statistics, then its loss and gradient, against the
 * CPU ops on the same shard (logit rows ld apart, the last shard narrower; neither op
 * touches the padding past its columns). */
static void crossentropy_shard_case(int N, int V, int t) {
    char shape[96];
    snprintf(shape, sizeof shape, "N=%d V=%d t=%d", N, V, t);
    int Vt = (V + t - 1) / t, ld = (Vt + 63) / 64 * 64;
    size_t nl = (size_t)N * ld, ns = (size_t)t * N * 3;
    int *tgt = rand_tokens((size_t)N, V);
    float **sh = xmalloc((size_t)t * sizeof *sh), *stats = xmalloc(ns * sizeof(float));
    int *d_tgt = dcopy_int(tgt, (size_t)N);
    float *d_stats = dnan(ns, 0);
    for (int k = 0; k < t; k++) {
        int v0 = k * Vt, w = V - v0 < Vt ? V - v0 : Vt;
        sh[k] = randf(nl, 3.0f);
        op_crossentropy_shard_stats(stats + (size_t)k * N * 3, sh[k], ld, tgt, N, w, v0);
        float *d_l = dcopy(sh[k], nl, 0);
        cuda_crossentropy_shard_stats(d_stats + (size_t)k * N * 3, d_l, ld, d_tgt, N, w, v0);
    }
    expect_close("crossentropy shard stats", shape, d_stats, stats, ns, TOL_FWD);
    dset(d_stats, stats, ns);  /* the same statistics on both sides from here */
    for (int k = 0; k < t; k++) {
        int v0 = k * Vt, w = V - v0 < Vt ? V - v0 : Vt;
        float *loss = xmalloc((size_t)N * sizeof(float)), *grad = copyf(sh[k], nl);
        op_crossentropy_shard_backward(loss, grad, ld, tgt, N, w, v0, stats, t, 1.0f / (float)N);
        float *d_l = dcopy(sh[k], nl, 0), *d_loss = dnan((size_t)N, 0);
        cuda_crossentropy_shard_backward(d_loss, d_l, ld, d_tgt, N, w, v0, d_stats, t, 0.0f);
        expect_bitwise("crossentropy shard no grad", shape, d_l, sh[k], nl);
        cuda_crossentropy_shard_backward(d_loss, d_l, ld, d_tgt, N, w, v0, d_stats, t, 1.0f / (float)N);
        expect_close("crossentropy shard loss", shape, d_loss, loss, (size_t)N, TOL_FWD);
        expect_close("crossentropy shard dlogits", shape, d_l, grad, nl, TOL_BWD);
        free(loss); free(grad);
    }
    for (int k = 0; k < t; k++) free(sh[k]);
    free(sh); free(stats); free(tgt);
    dfree_all();
}

static void test_crossentropy(void) {
    crossentropy_shard_case(3, 11, 2);
    crossentropy_shard_case(16, 50257, 4);
    crossentropy_case(2, 1);
    crossentropy_case(3, 11);
    crossentropy_case(7, 1000);
    crossentropy_case(64, 50257);
    test_crossentropy_special();
}

/* ------------------------------------------------------------------------------------ */
/* adamw: bitwise the CPU result                                                         */

static void adamw_case(size_t n, int step, float beta1, float beta2, float wd, float grad_scale, int off) {
    char shape[96];
    snprintf(shape, sizeof shape, "n=%zu step=%d b1=%g wd=%g%s", n, step, beta1, wd, off ? " unaligned" : "");
    float *p = randf(n, 1.0f), *gr = randf(n, 1.0f), *m = randf(n, 0.1f), *v = randf(n, 0.1f);
    for (size_t i = 0; i < n; i++) v[i] *= v[i];
    float *d_p = dcopy(p, n, off), *d_g = dcopy(gr, n, 0), *d_m = dcopy(m, n, 0), *d_v = dcopy(v, n, 0);
    op_adamw(p, gr, m, v, n, 3e-4f, beta1, beta2, 1e-8f, wd, step, grad_scale);
    cuda_adamw(d_p, d_g, d_m, d_v, n, 3e-4f, beta1, beta2, 1e-8f, wd, step, grad_scale);
    expect_close("adamw param", shape, d_p, p, n, TOL_FWD);
    expect_close("adamw m", shape, d_m, m, n, TOL_FWD);
    expect_close("adamw v", shape, d_v, v, n, TOL_FWD);
    expect_bitwise("adamw param", shape, d_p, p, n);
    expect_bitwise("adamw m", shape, d_m, m, n);
    expect_bitwise("adamw v", shape, d_v, v, n);
    free(p); free(gr); free(m); free(v);
    dfree_all();
}

static void test_adamw(void) {
    adamw_case(17, 1, 0.9f, 0.95f, 0.1f, 1.0f, 0);
    adamw_case(1000003, 1, 0.9f, 0.95f, 0.1f, 1.0f, 0);
    adamw_case(1000003, 7, 0.3f, 0.999f, 0.0f, 0.5f, 0); /* the other lerp branch, no decay */
    adamw_case(100003, 3, 0.9f, 0.95f, 0.1f, 1.0f, 1);   /* unaligned: the scalar kernel */
}

/* ------------------------------------------------------------------------------------ */
/* flat-buffer helpers and memory                                                        */

static void test_flat(void) {
    size_t sizes[] = {1, 1000, 1000003, 20000003};
    CHECK(cuda_sumsq(NULL, 0) == 0.0, "sumsq of nothing");
    for (int k = 0; k < 4; k++) {
        size_t n = sizes[k];
        char shape[64];
        snprintf(shape, sizeof shape, "n=%zu", n);
        float *x = randf(n, 1.0f), *y = randf(n, 1.0f);
        float *d_x = dcopy(x, n, 0), *d_y = dcopy(y, n, 1);
        double c = op_sumsq(x, n), g1 = cuda_sumsq(d_x, n), g2 = cuda_sumsq(d_x, n);
        printf("    %-22s %-34s err %.2e\n", "sumsq", shape, fabs(g1 - c) / c);
        CHECK(fabs(g1 - c) <= 1e-10 * c, "sumsq %s: %.17g vs CPU %.17g", shape, g1, c);
        CHECK(g1 == g2, "sumsq %s: two runs differ", shape);
        double cy = op_sumsq(y, n), gy = cuda_sumsq(d_y, n); /* d_y unaligned: the scalar kernel */
        CHECK(fabs(gy - cy) <= 1e-10 * cy, "sumsq unaligned %s: %.17g vs CPU %.17g", shape, gy, cy);
        op_scale(x, n, 0.37f);
        cuda_scale(d_x, n, 0.37f);
        expect_bitwise("scale", shape, d_x, x, n);
        op_add(y, x, n);
        cuda_add(d_y, d_x, n); /* d_y unaligned: the scalar kernel */
        expect_bitwise("add", shape, d_y, y, n);
        float *d_z = dcopy(y, n, 0); /* aligned: the vector kernel */
        op_add(y, x, n);
        cuda_add(d_z, d_x, n);
        expect_bitwise("add (aligned)", shape, d_z, y, n);
        /* op_sum_parts: 3 parts into a fourth buffer, then y += 3 parts in place, aligned (the
         * vector kernel where n % 8 == 0) and with y unaligned (the scalar kernel) */
        {
            float *p[3] = {randf(n, 1.0f), randf(n, 1.0f), randf(n, 1.0f)}, *want = xcalloc(n, sizeof(float));
            const void *dp[3] = {dcopy(p[0], n, 0), dcopy(p[1], n, 0), dcopy(p[2], n, 0)};
            const void *hp[4] = {p[0], p[1], p[2], NULL};
            float *d_s = dcopy(want, n, 0), *y0 = copyf(y, n);
            op_sum_parts(want, hp, 3, n);
            cuda_sum_parts(d_s, dp, 3, n);
            expect_bitwise("sum_parts (3)", shape, d_s, want, n);
            const void *hq[4] = {y, p[0], p[1], p[2]}, *dq[4] = {d_z, dp[0], dp[1], dp[2]}, *dr[4] = {d_y, dp[0], dp[1], dp[2]};
            op_sum_parts(y, hq, 4, n);
            cuda_sum_parts(d_z, dq, 4, n);
            expect_bitwise("sum_parts (in place)", shape, d_z, y, n);
            dset(d_y, y0, n);
            cuda_sum_parts(d_y, dr, 4, n);
            expect_bitwise("sum_parts (in place, unaligned)", shape, d_y, y, n);
            free(p[0]); free(p[1]); free(p[2]); free(want); free(y0);
        }
        cuda_memset_zero(d_y, n * sizeof(float));
        memset(y, 0, n * sizeof(float));
        expect_bitwise("memset_zero", shape, d_y, y, n);
        free(x); free(y);
        dfree_all();
    }
}

/* The copy-engine all-reduce's sum (cuda_sum_blocks, on a stream of its own): D blocks of c
 * floats added in rank order in fp32 and scaled, bitwise against the same sum on the host;
 * c % 8 == 0 takes the 16-byte kernel, the odd c the scalar one. (Here on the compute
 * stream; comm_ce.c passes its communication stream.) */
static void test_sum_blocks(void) {
    size_t cs[] = {1, 1003, 4096, 1000000};
    int Ds[] = {2, 3, 4, 8};
    for (int k = 0; k < 4; k++)
        for (int j = 0; j < 4; j++) {
            size_t c = cs[k];
            int D = Ds[j];
            float s = 1.0f / (float)D;
            char shape[64];
            snprintf(shape, sizeof shape, "c=%zu D=%d", c, D);
            float *x = randf(c * D, 1.0f), *y = xmalloc(c * sizeof(float));
            for (size_t i = 0; i < c; i++) {
                float a = 0.0f;
                for (int d = 0; d < D; d++) a += x[(size_t)d * c + i];
                y[i] = a * s;
            }
            float *d_x = dcopy(x, c * D, 0), *d_y = dalloc(c, 0);
            cuda_sum_blocks(d_y, d_x, c, D, s, 0, cuda_stream());
            cuda_synchronize();
            expect_bitwise("sum_blocks", shape, d_y, y, c);
            free(x); free(y);
            dfree_all();
        }
}

/* Row gather and scatter by an index list, against the CPU op, bitwise: rows of 1024 floats
 * (the 16-byte kernel) and of 37 floats, unaligned (the byte kernel). Scatter must leave
 * the rows not listed untouched. */
static void test_copy_rows(void) {
    const size_t R = 50257, n = 4647;
    int *rows = xmalloc(n * sizeof(int));
    for (size_t i = 0; i < n; i++) rows[i] = (int)((i * 10007 + 11) % R);  /* distinct: 10007 is prime */
    size_t widths[] = {1024, 37};
    for (int k = 0; k < 2; k++) {
        size_t E = widths[k], rb = E * sizeof(float);
        int off = k;  /* k = 1: unaligned */
        char shape[64];
        snprintf(shape, sizeof shape, "%zu rows of %zu of %zu", n, E, R);
        float *src = randf(R * E, 1.0f), *dst = randf(R * E, 1.0f), *g = xmalloc(n * rb);
        float *d_src = dcopy(src, R * E, off), *d_dst = dcopy(dst, R * E, off), *d_g = dnan(n * E, off);
        int *d_rows = dcopy_int(rows, n);
        op_gather_rows(g, src, rows, n, rb);
        cuda_copy_rows(d_g, d_src, d_rows, n, rb, 0);
        expect_bitwise("gather rows", shape, d_g, g, n * E);
        op_scatter_rows(dst, g, rows, n, rb);
        cuda_copy_rows(d_dst, d_g, d_rows, n, rb, 1);
        expect_bitwise("scatter rows", shape, d_dst, dst, R * E);
        free(src); free(dst); free(g);
        dfree_all();
    }
    free(rows);
}

/* ------------------------------------------------------------------------------------ */
/* adafactor: each piece against the CPU op, on a segment that starts and ends mid-row (a
 * shard), a whole large matrix and part of a vector; deterministic (twice, same bits)      */

/* slice: the segment is of the middle third of a matrix 3 cols wide (a tensor-parallel
 * rank's column slice, whose statistics are the whole matrix's: AdafactorSeg's col0) */
static void adafactor_case(int rows, int cols, size_t first, size_t n, float beta1, int off, int slice) {
    char shape[96];
    snprintf(shape, sizeof shape, "%dx%d [%zu, +%zu)%s%s%s", rows, cols, first, n, beta1 > 0 ? " beta1" : "",
             off ? " unaligned" : "", slice ? " slice" : "");
    int wcols = slice ? 3 * cols : cols;
    size_t S = rows == 1 ? (size_t)wcols : (size_t)rows + wcols;
    float scale = 0.7f, beta2t = 0.6f, eps1 = 1e-30f, coef = 0.01f, decay = 0.999f;
    float *g = randf(n, 0.1f), *p = randf(n, 1.0f), *m = randf(n, 0.01f), *sums = randf(S, 0.01f), *stat = randf(S, 0.01f);
    for (size_t j = 0; j < S; j++) stat[j] = fabsf(stat[j]) + 1e-4f, sums[j] = fabsf(sums[j]);
    float *fac = calloc(S, sizeof(float));
    /* the segment at element 0 of its buffers (off: unaligned ones) */
    AdafactorSeg sg = {.off = 0, .n = n, .first = first, .stat = 0, .col0 = slice ? (size_t)cols : 0,
                       .rows = rows, .cols = cols};
    float *d_g = dcopy(g, n, off), *d_p = dcopy(p, n, off), *d_m = dcopy(m, n, off), *d_sums = dcopy(sums, S, 0);
    float *d_stat = dcopy(stat, S, 0), *d_fac = dnan(S, 0);
    double *d_out = (double *)dalloc(4, 0), out[2], d_res[2];

    op_adafactor_sums(sums, g, &sg, scale);
    cuda_adafactor_sums(d_sums, d_g, &sg, scale);
    expect_close("adafactor sums", shape, d_sums, sums, S, TOL_FWD);
    float *h_sums = hcopy(d_sums, S);
    dset(d_sums, h_sums, S);  /* the same inputs from here: the GPU's sums on both sides */
    {   /* determinism: the sums twice from the same start */
        float *base = randf(S, 0.0f), *d_b1 = dcopy(base, S, 0), *d_b2 = dcopy(base, S, 0);
        cuda_adafactor_sums(d_b1, d_g, &sg, scale);
        cuda_adafactor_sums(d_b2, d_g, &sg, scale);
        float *h1 = hcopy(d_b1, S);
        expect_same_host("adafactor sums (twice)", shape, d_b2, h1, S);
        free(base); free(h1);
    }
    op_adafactor_stats(stat, fac, h_sums, rows, wcols, beta2t, eps1);
    cuda_adafactor_stats(d_stat, d_fac, d_sums, rows, wcols, beta2t, eps1);
    expect_close("adafactor stats", shape, d_stat, stat, S, TOL_FWD);
    expect_close("adafactor factors", shape, d_fac, fac, S, TOL_FWD);
    float *h_fac = hcopy(d_fac, S);
    dset(d_fac, h_fac, S);
    op_adafactor_rms(out, p, g, h_fac, &sg, scale);
    cuda_adafactor_rms(d_out, d_p, d_g, d_fac, &sg, scale);
    cuda_memcpy_d2h(d_res, d_out, sizeof d_res);
    printf("    %-22s %-34s sum u^2 %.9g vs %.9g, sum p^2 %.9g vs %.9g\n", "adafactor rms", shape, d_res[0], out[0],
           d_res[1], out[1]);
    CHECK(fabs(d_res[0] - out[0]) <= 1e-6 * out[0] && fabs(d_res[1] - out[1]) <= 1e-9 * out[1], "adafactor rms %s",
          shape);
    op_adafactor_update(p, g, beta1 > 0 ? m : NULL, h_fac, &sg, scale, coef, decay, beta1);
    cuda_adafactor_update(d_p, d_g, beta1 > 0 ? d_m : NULL, d_fac, &sg, scale, coef, decay, beta1);
    expect_close("adafactor update", shape, d_p, p, n, TOL_FWD);
    if (beta1 > 0) expect_close("adafactor first moment", shape, d_m, m, n, TOL_FWD);
    free(g); free(p); free(m); free(sums); free(stat); free(fac); free(h_sums); free(h_fac);
    dfree_all();
}

static void test_adafactor(void) {
    adafactor_case(13, 9, 5, 80, 0.0f, 0, 0);             /* rows 0..9, the first and last cut */
    adafactor_case(13, 9, 0, 117, 0.9f, 1, 0);            /* whole, a first moment, unaligned */
    adafactor_case(50257, 64, 0, 50257 * 64, 0.0f, 0, 0); /* an embedding: many chunks of rows */
    adafactor_case(3072, 1024, 1000001, 1500000, 0.9f, 0, 0); /* a shard of qkv_proj, mid-row at both ends */
    adafactor_case(1, 1024, 300, 500, 0.0f, 0, 0);        /* part of a norm's weight */
    adafactor_case(13, 9, 5, 80, 0.9f, 0, 1);             /* a column slice (tensor parallel) */
    adafactor_case(1, 40, 7, 20, 0.0f, 0, 1);             /* part of a slice of a vector */
}

/* The backend table the trainer uses (ops_backend_cuda): every entry is set; op_alloc's
 * memory is zeroed; upload, device copy, zero and download move exactly the bytes asked
 * for; the allocator's high-water mark counts what it holds. */
static void test_backend_table(void) {
    const OpsBackend *b = &ops_backend_cuda;
    CHECK(!strcmp(b->name, "cuda") && !b->host_memory, "name %s, host_memory %d", b->name, b->host_memory);
    void (*const fns[])(void) = {
        (void (*)(void))b->init, (void (*)(void))b->device_name, (void (*)(void))b->synchronize,
        (void (*)(void))b->device_memory, (void (*)(void))b->device_peak, (void (*)(void))b->alloc,
        (void (*)(void))b->free, (void (*)(void))b->zero, (void (*)(void))b->copy, (void (*)(void))b->upload,
        (void (*)(void))b->download, (void (*)(void))b->embedding_forward, (void (*)(void))b->embedding_backward,
        (void (*)(void))b->embedding_backward_rows, (void (*)(void))b->embedding_forward_shard,
        (void (*)(void))b->crossentropy_shard_stats, (void (*)(void))b->crossentropy_shard_backward,
        (void (*)(void))b->rmsnorm_forward, (void (*)(void))b->rmsnorm_backward, (void (*)(void))b->matmul_forward,
        (void (*)(void))b->matmul_backward, (void (*)(void))b->rope_tables, (void (*)(void))b->rope_forward,
        (void (*)(void))b->rope_backward, (void (*)(void))b->attention_forward,
        (void (*)(void))b->attention_backward, (void (*)(void))b->swiglu_forward,
        (void (*)(void))b->swiglu_backward, (void (*)(void))b->crossentropy_forward_backward,
        (void (*)(void))b->adamw, (void (*)(void))b->adafactor_sums, (void (*)(void))b->adafactor_stats,
        (void (*)(void))b->adafactor_rms, (void (*)(void))b->adafactor_update, (void (*)(void))b->sumsq, (void (*)(void))b->scale, (void (*)(void))b->add,
        (void (*)(void))b->sum_parts,
        (void (*)(void))b->copy_rows, (void (*)(void))b->host_alloc, (void (*)(void))b->host_free,
        (void (*)(void))b->copy_reserve, (void (*)(void))b->copy_out, (void (*)(void))b->copy_in,
        (void (*)(void))b->copy_sync, (void (*)(void))b->copy_wait, (void (*)(void))b->copy_in_main,
        (void (*)(void))b->graph_begin, (void (*)(void))b->graph_end, (void (*)(void))b->graph_run,
        (void (*)(void))b->graph_free};
    for (size_t i = 0; i < sizeof fns / sizeof fns[0]; i++) CHECK(fns[i] != NULL, "entry %zu is NULL", i);

    size_t n = 1000003, peak0 = 0, peak1 = 0, used = 0, fr = 0, tot = 0;
    b->device_peak(&peak0, NULL);
    float *d1 = b->alloc(n * sizeof(float)), *d2 = b->alloc(n * sizeof(float));
    float *h = xmalloc(n * sizeof(float)), *x = randf(n, 1.0f);
    b->download(h, d1, n * sizeof(float));
    size_t nonzero = 0;
    for (size_t i = 0; i < n; i++) nonzero += h[i] != 0.0f;
    CHECK(nonzero == 0, "alloc: %zu of %zu floats not zero", nonzero, n);
    b->upload(d1, x, n * sizeof(float));
    b->copy(d2 + 1, d1, (n - 1) * sizeof(float));
    b->download(h, d2, n * sizeof(float));
    CHECK(h[0] == 0.0f && same(h + 1, x, n - 1), "upload / copy / download do not round-trip");
    b->zero(d2 + 7, 100 * sizeof(float));
    b->download(h, d2, n * sizeof(float));
    nonzero = 0;
    for (size_t i = 7; i < 107; i++) nonzero += h[i] != 0.0f;
    CHECK(nonzero == 0 && same(h + 107, x + 106, n - 107) && same(h + 1, x, 6), "zero: wrong bytes");
    b->device_peak(&peak1, &used);
    CHECK(peak1 >= peak0 && peak1 >= 2 * n * sizeof(float), "allocation peak %zu (before: %zu)", peak1, peak0);
    CHECK(b->device_memory(&fr, &tot) == 0 && fr <= tot && used <= tot, "device memory %zu / %zu (used %zu)", fr, tot,
          used);
    b->free(d1);
    b->free(d2);
    free(h);
    free(x);
}

/* offload's copy queues: pinned host memory comes zeroed; a copy out lands at its mark; a
 * copy in issued from another host thread (as offload's worker does) is what the main
 * queue's later ops see once it waits for the mark. */
typedef struct { const OpsBackend *b; float *d, *h; size_t bytes; } CopyIn;
static void *copy_in_thread(void *arg) {
    CopyIn *c = arg;
    c->b->copy_in(c->d, c->h, c->bytes, 1);
    return NULL;
}

static void test_copy_queues(void) {
    const OpsBackend *b = &ops_backend_cuda;
    size_t n = (1 << 20) + 3;
    b->copy_reserve(4);
    float *h = b->host_alloc(n * sizeof(float)), *h2 = xmalloc(n * sizeof(float)), *x = randf(n, 1.0f);
    CHECK(h != NULL, "host_alloc refused %zu bytes", n * sizeof(float));
    size_t nonzero = 0;
    for (size_t i = 0; i < n; i++) nonzero += h[i] != 0.0f;
    CHECK(nonzero == 0, "host_alloc: %zu of %zu floats not zero", nonzero, n);
    float *d = b->alloc(n * sizeof(float));
    b->upload(d, x, n * sizeof(float));
    b->copy_out(h, d, n * sizeof(float), 0);
    b->copy_sync(0, 0);
    CHECK(same(h, x, n), "copy_out: not the device's bytes at its mark");
    for (size_t i = 0; i < n; i++) h[i] *= 2.0f;
    CopyIn c = {b, d, h, n * sizeof(float)};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, copy_in_thread, &c) == 0, "cannot start a thread");
    pthread_join(t, NULL);
    b->copy_wait(1, 1);
    b->scale(d, n, 0.5f);  /* on the main queue, after the copy in */
    b->download(h2, d, n * sizeof(float));
    CHECK(same(h2, x, n), "copy_in from another thread: the main queue did not see it");
    b->copy_in_main(d, h, n * sizeof(float));  /* h holds 2x: on the main queue, before the scale */
    b->scale(d, n, 0.5f);
    b->download(h2, d, n * sizeof(float));
    CHECK(same(h2, x, n), "copy_in_main: not ordered on the main queue");
    b->free(d);
    b->host_free(h);
    free(h2);
    free(x);
}

/* ------------------------------------------------------------------------------------ */
/* graphs (op_graph_*, the layers' recordings)                                           */

/* ops recorded as a graph run nothing until replayed, and a replay does bitwise what they
 * do one by one, reading the buffers' values anew each time; a recording during which the
 * scratch grows is dropped (NULL, the process goes on), and one made before the scratch
 * moved is refused at replay (-1), not run on a freed buffer */
static void test_graphs(void) {
    const OpsBackend *b = &ops_backend_cuda;
    int sync = cuda_set_sync_each(0);  /* (a recording cannot wait for the device) */
    int N = 64, C = 1024, N2 = 16384;  /* rmsnorm's backward: dw partials of 4 and 1024 blocks in scratch */
    float *x = randf((size_t)N2 * C, 1), *w = randf(C, 1), *dout = randf((size_t)N2 * C, 1);
    float *dx0 = randf((size_t)N2 * C, 1), *dw0 = randf(C, 1);
    float *d_x = dcopy(x, (size_t)N2 * C, 0), *d_w = dcopy(w, C, 0), *d_dout = dcopy(dout, (size_t)N2 * C, 0);
    float *d_out = dnan((size_t)N2 * C, 0), *d_rstd = dnan(N2, 0);
    float *d_dx = dcopy(dx0, (size_t)N * C, 0), *d_dw = dcopy(dw0, C, 0);
    cuda_rmsnorm_forward(d_out, d_rstd, d_x, d_w, N2, C, 1e-5f);
    /* one by one */
    cuda_rmsnorm_backward(d_dx, d_dw, d_dout, d_x, d_w, d_rstd, N, C);
    float *ref_dx = hcopy(d_dx, (size_t)N * C), *ref_dw = hcopy(d_dw, C);
    /* recorded: nothing runs until the replay, which matches; a second replay from the same
     * starting values matches again */
    dset(d_dx, dx0, (size_t)N * C);
    dset(d_dw, dw0, C);
    CHECK(b->graph_begin() == 0, "graph_begin refused");
    cuda_rmsnorm_backward(d_dx, d_dw, d_dout, d_x, d_w, d_rstd, N, C);
    OpsGraph *gr = b->graph_end();
    CHECK(gr != NULL, "no graph");
    float *h = hcopy(d_dx, (size_t)N * C);
    CHECK(same(h, dx0, (size_t)N * C), "the recording ran the op");
    free(h);
    for (int rep = 0; rep < 2 && gr; rep++) {
        dset(d_dx, dx0, (size_t)N * C);
        dset(d_dw, dw0, C);
        CHECK(b->graph_run(gr) == 0, "replay %d refused", rep);
        float *gdx = hcopy(d_dx, (size_t)N * C), *gdw = hcopy(d_dw, C);
        CHECK(same(gdx, ref_dx, (size_t)N * C) && same(gdw, ref_dw, C), "replay %d differs from the op", rep);
        free(gdx); free(gdw);
    }
    /* the scratch outgrown inside a recording: dropped; then the op runs one by one */
    float *d_dx2 = dcopy(dx0, (size_t)N2 * C, 0);  /* (before: an upload waits) */
    CHECK(b->graph_begin() == 0, "graph_begin refused");
    cuda_rmsnorm_backward(d_dx2, d_dw, d_dout, d_x, d_w, d_rstd, N2, C);
    OpsGraph *gr2 = b->graph_end();
    CHECK(gr2 == NULL, "a recording that moved the scratch was kept");
    if (gr2) b->graph_free(gr2);
    cuda_rmsnorm_backward(d_dx2, d_dw, d_dout, d_x, d_w, d_rstd, N2, C);
    cuda_synchronize();
    /* the first recording's scratch is gone: refused */
    if (gr) CHECK(b->graph_run(gr) == -1, "a stale graph was replayed");
    if (gr) b->graph_free(gr);
    cuda_set_sync_each(sync);
    free(x); free(w); free(dout); free(dx0); free(dw0); free(ref_dx); free(ref_dw);
    dfree_all();
}

int main(int argc, char **argv) {
    int device = argc > 1 ? atoi(argv[1]) : 0;
    setenv("MESHTRAIN_CUDA_SYNC", "1", 0); /* a fault is reported at the kernel that made it */
    char err[256];
    if (cuda_init(device, err, sizeof err)) {
        fprintf(stderr, "meshtrain: %s\n", err);
        printf("RESULT 0 1\n");
        return 1;
    }
    ops_init("cpu", 0, NULL, 0);
    rng_seed(&rng, 20240601);
    printf("device %d: %s\n", device, cuda_device_name());
    RUN(test_graphs);  /* first: the scratch must grow in it */
    RUN(test_flat);
    RUN(test_copy_rows);
    RUN(test_sum_blocks);
    RUN(test_backend_table);
    RUN(test_copy_queues);
    RUN(test_matmul);
    RUN(test_embedding);
    RUN(test_rmsnorm);
    RUN(test_rope);
    RUN(test_attention);
    RUN(test_swiglu);
    RUN(test_crossentropy);
    RUN(test_adamw);
    RUN(test_adafactor);
    cuda_shutdown();
    return TEST_SUMMARY();
}
