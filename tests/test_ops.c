/* Tests for the ops interface (CPU backend): every forward against a naive double-precision
 * reference written here, every backward against the reference backward and against central
 * finite differences (in double, of the reference forward), plus the interface conventions:
 * backward ops accumulate, NULL gradients are accepted, results are deterministic. */
#include "ops.h"
#include "test.h"
#include "util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------------------ */
/* helpers                                                                               */

static Rng rng;

static float *randf(size_t n, float scale) {
    float *x = xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = scale * rng_normal(&rng);
    return x;
}
static float *zerosf(size_t n) { return xcalloc(n, sizeof(float)); }
static float *copyf(const float *x, size_t n) {
    float *y = xmalloc(n * sizeof(float));
    memcpy(y, x, n * sizeof(float));
    return y;
}
static double *tod(const float *x, size_t n) {
    double *y = xmalloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++) y[i] = x[i];
    return y;
}
static double *zerosd(size_t n) { return xcalloc(n, sizeof(double)); }

/* norm-wise relative error ||a - ref|| / ||ref|| */
static double nerr(const float *a, const double *ref, size_t n) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    return sqrt(num) / fmax(sqrt(den), 1e-300);
}
static int same(const float *a, const float *b, size_t n) { return memcmp(a, b, n * sizeof(float)) == 0; }

/* Central finite differences of a scalar loss(x) (double, reference forward) at `samples`
 * random entries of x, compared with the analytic gradient `grad` (the op's backward).
 * The tolerance is relative to max(|fd|, rms of the whole gradient). Returns the worst. */
typedef double (*LossFn)(const double *x, void *ctx);
static double fd_check(LossFn f, void *ctx, double *x, size_t n, const float *grad, int samples) {
    double rms = 0.0;
    for (size_t i = 0; i < n; i++) rms += (double)grad[i] * grad[i];
    rms = sqrt(rms / (double)n);
    double worst = 0.0;
    for (int s = 0; s < samples; s++) {
        size_t i = (size_t)(rng_u64(&rng) % n);
        double x0 = x[i], h = 1e-4 * fmax(1.0, fabs(x0));
        x[i] = x0 + h;
        double lp = f(x, ctx);
        x[i] = x0 - h;
        double lm = f(x, ctx);
        x[i] = x0;
        double fd = (lp - lm) / (2 * h);
        double e = fabs(fd - grad[i]) / fmax(fmax(fabs(fd), rms), 1e-30);
        if (e > worst) worst = e;
    }
    return worst;
}
static double dotd(const double *a, const double *b, size_t n) {
    double s = 0.0;
    for (size_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

#define TOL_FWD 1e-5 /* fp32 op vs double reference, norm-wise */
#define TOL_BWD 1e-5
#define TOL_FD 1e-4  /* fp32 backward vs finite differences, per entry */

/* ------------------------------------------------------------------------------------ */
/* references (double)                                                                   */

static void ref_rmsnorm(double *out, const double *x, const double *w, int N, int C, double eps) {
    for (int n = 0; n < N; n++) {
        double ss = 0.0;
        for (int c = 0; c < C; c++) ss += x[n * C + c] * x[n * C + c];
        double r = 1.0 / sqrt(ss / C + eps);
        for (int c = 0; c < C; c++) out[n * C + c] = x[n * C + c] * r * w[c];
    }
}
static void ref_rmsnorm_bwd(double *dx, double *dw, const double *g, const double *x, const double *w, int N,
                            int C, double eps) {
    for (int n = 0; n < N; n++) {
        const double *xr = x + n * C, *gr = g + n * C;
        double ss = 0.0, dot = 0.0;
        for (int c = 0; c < C; c++) ss += xr[c] * xr[c];
        double r = 1.0 / sqrt(ss / C + eps);
        for (int c = 0; c < C; c++) dot += gr[c] * w[c] * xr[c];
        for (int c = 0; c < C; c++) {
            dx[n * C + c] += r * w[c] * gr[c] - r * r * r * dot / C * xr[c];
            dw[c] += gr[c] * xr[c] * r;
        }
    }
}
static void ref_matmul(double *out, const double *inp, const double *w, int N, int C, int OC) {
    for (int n = 0; n < N; n++)
        for (int o = 0; o < OC; o++) {
            double s = 0.0;
            for (int c = 0; c < C; c++) s += inp[n * C + c] * w[o * C + c];
            out[n * OC + o] = s;
        }
}
static void ref_rope(double *qkv, const double *cs, const double *sn, int B, int T, int NH, int HD, int inverse) {
    int C = NH * HD, half = HD / 2;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int part = 0; part < 2; part++)
                for (int h = 0; h < NH; h++)
                    for (int i = 0; i < half; i++) {
                        double *x = qkv + ((size_t)(b * T + t) * 3 * C) + part * C + h * HD + 2 * i;
                        double c = cs[t * half + i], s = inverse ? -sn[t * half + i] : sn[t * half + i];
                        double x0 = x[0], x1 = x[1];
                        x[0] = x0 * c - x1 * s;
                        x[1] = x0 * s + x1 * c;
                    }
}
/* naive causal attention with a full T x T score matrix per head */
static void ref_attention(double *out, double *lse, const double *qkv, int B, int T, int NH, int HD) {
    int C = NH * HD;
    double sc = 1.0 / sqrt((double)HD);
    double *s = xmalloc((size_t)T * sizeof(double));
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                const double *q = qkv + (size_t)(b * T + t) * 3 * C + h * HD;
                double mx = -INFINITY;
                for (int j = 0; j <= t; j++) {
                    const double *k = qkv + (size_t)(b * T + j) * 3 * C + C + h * HD;
                    double d = 0.0;
                    for (int e = 0; e < HD; e++) d += q[e] * k[e];
                    s[j] = d * sc;
                    if (s[j] > mx) mx = s[j];
                }
                double sum = 0.0;
                for (int j = 0; j <= t; j++) sum += exp(s[j] - mx);
                if (lse) lse[(b * NH + h) * T + t] = mx + log(sum);
                double *o = out + (size_t)(b * T + t) * C + h * HD;
                for (int e = 0; e < HD; e++) o[e] = 0.0;
                for (int j = 0; j <= t; j++) {
                    const double *v = qkv + (size_t)(b * T + j) * 3 * C + 2 * C + h * HD;
                    double p = exp(s[j] - mx) / sum;
                    for (int e = 0; e < HD; e++) o[e] += p * v[e];
                }
            }
    free(s);
}
static void ref_attention_bwd(double *dqkv, const double *dout, const double *qkv, int B, int T, int NH, int HD) {
    int C = NH * HD;
    double sc = 1.0 / sqrt((double)HD);
    double *p = xmalloc((size_t)T * sizeof(double)), *dp = xmalloc((size_t)T * sizeof(double));
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                const double *q = qkv + (size_t)(b * T + t) * 3 * C + h * HD;
                const double *g = dout + (size_t)(b * T + t) * C + h * HD;
                double mx = -INFINITY, sum = 0.0;
                for (int j = 0; j <= t; j++) {
                    const double *k = qkv + (size_t)(b * T + j) * 3 * C + C + h * HD;
                    double d = 0.0;
                    for (int e = 0; e < HD; e++) d += q[e] * k[e];
                    p[j] = d * sc;
                    if (p[j] > mx) mx = p[j];
                }
                for (int j = 0; j <= t; j++) sum += (p[j] = exp(p[j] - mx));
                double pdp = 0.0;
                for (int j = 0; j <= t; j++) {
                    p[j] /= sum;
                    const double *v = qkv + (size_t)(b * T + j) * 3 * C + 2 * C + h * HD;
                    double d = 0.0;
                    for (int e = 0; e < HD; e++) d += g[e] * v[e];
                    dp[j] = d;
                    pdp += p[j] * d;
                }
                double *dq = dqkv + (size_t)(b * T + t) * 3 * C + h * HD;
                for (int j = 0; j <= t; j++) {
                    double ds = p[j] * (dp[j] - pdp) * sc;
                    const double *k = qkv + (size_t)(b * T + j) * 3 * C + C + h * HD;
                    double *dk = dqkv + (size_t)(b * T + j) * 3 * C + C + h * HD;
                    double *dv = dk + C;
                    for (int e = 0; e < HD; e++) {
                        dq[e] += ds * k[e];
                        dk[e] += ds * q[e];
                        dv[e] += p[j] * g[e];
                    }
                }
            }
    free(p);
    free(dp);
}
static double ref_silu(double g) { return g / (1.0 + exp(-g)); }
static void ref_swiglu(double *out, const double *gu, int N, int H) {
    for (int n = 0; n < N; n++)
        for (int i = 0; i < H; i++) out[n * H + i] = ref_silu(gu[n * 2 * H + i]) * gu[n * 2 * H + H + i];
}
/* losses and (if grad) scale * (softmax - onehot) */
static void ref_crossentropy(double *losses, double *grad, const double *logits, const int *tg, int N, int V,
                             double scale) {
    for (int n = 0; n < N; n++) {
        const double *l = logits + (size_t)n * V;
        double mx = -INFINITY, sum = 0.0;
        for (int j = 0; j < V; j++) mx = fmax(mx, l[j]);
        for (int j = 0; j < V; j++) sum += exp(l[j] - mx);
        double lse = mx + log(sum);
        losses[n] = lse - l[tg[n]];
        if (grad)
            for (int j = 0; j < V; j++)
                grad[(size_t)n * V + j] = scale * (exp(l[j] - lse) - (j == tg[n] ? 1.0 : 0.0));
    }
}

/* ------------------------------------------------------------------------------------ */
/* embedding                                                                             */

static void test_embedding(void) {
    int V = 11, N = 40, C = 37;
    float *wte = randf((size_t)V * C, 1.0f), *out = zerosf((size_t)N * C);
    int tok[40];
    for (int n = 0; n < N; n++) tok[n] = (int)(rng_u64(&rng) % 5) * 2; /* many repeats, some rows unused */
    op_embedding_forward(out, tok, wte, N, C);
    int ok = 1;
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++) ok &= out[n * C + c] == wte[tok[n] * C + c];
    CHECK(ok, "embedding forward is not a row gather");

    float *dout = randf((size_t)N * C, 1.0f), *dwte = randf((size_t)V * C, 1.0f);
    double *ref = tod(dwte, (size_t)V * C);
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++) ref[tok[n] * C + c] += dout[n * C + c];
    op_embedding_backward(dwte, dout, tok, N, C);
    double e = nerr(dwte, ref, (size_t)V * C);
    CHECK(e < 1e-6, "embedding backward err %g", e);
    /* rows of unused tokens keep their old values exactly */
    for (int v = 1; v < V; v += 2) CHECK(fabs(dwte[v * C] - ref[v * C]) == 0.0, "unused row %d changed", v);
    op_embedding_backward(NULL, dout, tok, N, C);
    free(wte), free(out), free(dout), free(dwte), free(ref);
}

/* embedding_rows_index groups the positions by token (rows ascending and distinct, each
 * row's positions ascending, every position once), and the backward by row gives
 * op_embedding_backward's result bitwise */
static void test_embedding_rows(void) {
    int V = 50, N = 300, C = 37;
    int *tok = xmalloc((size_t)N * sizeof(int)), *count = xmalloc((size_t)V * sizeof(int));
    int *idx = xmalloc((3 * (size_t)N + 1) * sizeof(int));
    for (int n = 0; n < N; n++) tok[n] = n % 7 == 0 ? 3 : (int)(rng_u64(&rng) % 20) * 2;  /* repeats, gaps */
    int nr = embedding_rows_index(tok, N, V, count, idx);
    const int *rows = idx, *off = idx + nr, *pos = off + nr + 1;
    int ok = nr > 0 && off[0] == 0 && off[nr] == N, seen[300] = {0};
    for (int i = 0; ok && i < nr; i++) {
        ok &= (i == 0 || rows[i] > rows[i - 1]) && off[i + 1] > off[i];
        for (int k = off[i]; k < off[i + 1]; k++) {
            ok &= tok[pos[k]] == rows[i] && (k == off[i] || pos[k] > pos[k - 1]);
            seen[pos[k]]++;
        }
    }
    for (int n = 0; n < N; n++) ok &= seen[n] == 1;
    int distinct = 0;
    for (int v = 0; v < V; v++) {
        int any = 0;
        for (int n = 0; n < N; n++) any |= tok[n] == v;
        distinct += any;
    }
    CHECK(ok && nr == distinct, "index: %d rows (%d distinct tokens), or wrong grouping", nr, distinct);
    float *dout = randf((size_t)N * C, 1.0f), *d1 = randf((size_t)V * C, 1.0f), *d2 = copyf(d1, (size_t)V * C);
    op_embedding_backward(d1, dout, tok, N, C);
    op_embedding_backward_rows(d2, dout, idx, nr, N, C);
    CHECK(!memcmp(d1, d2, (size_t)V * C * sizeof(float)), "by row: not bitwise op_embedding_backward");
    op_embedding_backward_rows(NULL, dout, idx, nr, N, C);
    free(tok), free(count), free(idx), free(dout), free(d1), free(d2);
}

/* Vocabulary parallel: a shard's lookup is the whole table's rows it holds, zeros elsewhere
 * (the shards' outputs sum to the lookup); its row index numbers its own rows and leaves
 * the other tokens out, and the shards' backwards by row are the whole table's, bitwise. */
static void test_embedding_shard(void) {
    int V = 50, N = 300, C = 19, t = 3, Vt = 20;  /* the last shard holds 10 rows */
    int *tok = xmalloc((size_t)N * sizeof(int)), *count = xmalloc((size_t)V * sizeof(int));
    int *idx = xmalloc((3 * (size_t)N + 1) * sizeof(int));
    for (int n = 0; n < N; n++) tok[n] = (int)(rng_u64(&rng) % (uint64_t)V);
    float *wte = randf((size_t)V * C, 1.0f), *whole = zerosf((size_t)N * C), *sum = zerosf((size_t)N * C);
    float *out = zerosf((size_t)N * C), *dout = randf((size_t)N * C, 1.0f);
    float *d1 = randf((size_t)V * C, 1.0f), *d2 = copyf(d1, (size_t)V * C);
    op_embedding_forward(whole, tok, wte, N, C);
    op_embedding_backward(d1, dout, tok, N, C);
    int ok = 1;
    for (int k = 0; k < t; k++) {
        int lo = k * Vt, rows = V - lo < Vt ? V - lo : Vt;
        for (size_t i = 0; i < (size_t)N * C; i++) out[i] = NAN;
        op_embedding_forward_shard(out, tok, wte + (size_t)lo * C, N, C, lo, rows);
        for (int n = 0; n < N; n++) {
            int mine = tok[n] >= lo && tok[n] < lo + rows;
            for (int c = 0; c < C; c++) {
                float v = out[(size_t)n * C + c];
                ok &= mine ? v == whole[(size_t)n * C + c] : v == 0.0f;
                sum[(size_t)n * C + c] += v;
            }
        }
        int nr = embedding_rows_index_shard(tok, N, lo, rows, count, idx), inside = 0;
        for (int n = 0; n < N; n++) inside += tok[n] >= lo && tok[n] < lo + rows;
        const int *off = idx + nr, *pos = off + nr + 1;
        ok &= off[nr] == inside;
        for (int i = 0; i < nr; i++)
            for (int q = off[i]; q < off[i + 1]; q++) ok &= tok[pos[q]] == lo + idx[i];
        op_embedding_backward_rows(d2 + (size_t)lo * C, dout, idx, nr, N, C);
    }
    CHECK(ok, "embedding shard: lookup, zeros or row index wrong");
    CHECK(same(sum, whole, (size_t)N * C), "the shards' lookups do not sum to the whole");
    CHECK(same(d1, d2, (size_t)V * C), "the shards' backward by row is not the whole table's");
    free(tok), free(count), free(idx), free(wte), free(whole), free(sum), free(out), free(dout), free(d1), free(d2);
}

/* ------------------------------------------------------------------------------------ */
/* rmsnorm                                                                               */

typedef struct { int N, C, wrt_w; const double *x, *w, *g; } RmsCtx;
static double rms_loss(const double *p, void *vctx) {
    RmsCtx *c = vctx;
    const double *x = c->wrt_w ? c->x : p, *w = c->wrt_w ? p : c->w;
    double *o = zerosd((size_t)c->N * c->C);
    ref_rmsnorm(o, x, w, c->N, c->C, 1e-5);
    double s = dotd(o, c->g, (size_t)c->N * c->C);
    free(o);
    return s;
}

static void rmsnorm_case(int N, int C) {
    float eps = 1e-5f;
    float *x = randf((size_t)N * C, 2.0f), *w = randf(C, 1.0f), *out = zerosf((size_t)N * C), *rstd = zerosf(N);
    for (int c = 0; c < C; c++) w[c] += 1.0f;
    double *xd = tod(x, (size_t)N * C), *wd = tod(w, C), *ref = zerosd((size_t)N * C);
    op_rmsnorm_forward(out, rstd, x, w, N, C, eps);
    ref_rmsnorm(ref, xd, wd, N, C, eps);
    double e = nerr(out, ref, (size_t)N * C);
    CHECK(e < TOL_FWD, "rmsnorm %dx%d forward err %g", N, C, e);
    for (int n = 0; n < N; n++) {
        double ss = 0.0;
        for (int c = 0; c < C; c++) ss += xd[n * C + c] * xd[n * C + c];
        CHECK(rel_err(rstd[n], 1.0 / sqrt(ss / C + eps)) < 1e-6, "rstd[%d]", n);
    }

    float *g = randf((size_t)N * C, 1.0f), *dx = zerosf((size_t)N * C), *dw = zerosf(C);
    double *gd = tod(g, (size_t)N * C), *dxr = zerosd((size_t)N * C), *dwr = zerosd(C);
    op_rmsnorm_backward(dx, dw, g, x, w, rstd, N, C);
    ref_rmsnorm_bwd(dxr, dwr, gd, xd, wd, N, C, eps);
    e = nerr(dx, dxr, (size_t)N * C);
    CHECK(e < TOL_BWD, "rmsnorm %dx%d dx err %g", N, C, e);
    e = nerr(dw, dwr, C);
    CHECK(e < TOL_BWD, "rmsnorm %dx%d dw err %g", N, C, e);
    RmsCtx ctx = {N, C, 0, xd, wd, gd};
    e = fd_check(rms_loss, &ctx, xd, (size_t)N * C, dx, 12);
    CHECK(e < TOL_FD, "rmsnorm dx vs finite differences %g", e);
    ctx.wrt_w = 1;
    e = fd_check(rms_loss, &ctx, wd, C, dw, 12);
    CHECK(e < TOL_FD, "rmsnorm dw vs finite differences %g", e);
    free(x), free(w), free(out), free(rstd), free(xd), free(wd), free(ref);
    free(g), free(dx), free(dw), free(gd), free(dxr), free(dwr);
}
/* The fused residual add + rmsnorm is bitwise op_add then op_rmsnorm_forward. */
static void add_rmsnorm_case(int N, int C) {
    size_t n = (size_t)N * C;
    float *res = randf(n, 2.0f), *br = randf(n, 2.0f), *w = randf(C, 1.0f), *res2 = xmalloc(n * sizeof(float));
    float *o1 = zerosf(n), *o2 = zerosf(n), *r1 = zerosf(N), *r2 = zerosf(N);
    memcpy(res2, res, n * sizeof(float));
    op_add(res2, br, n);
    op_rmsnorm_forward(o2, r2, res2, w, N, C, 1e-5f);
    op_add_rmsnorm_forward(res, o1, r1, br, w, N, C, 1e-5f);
    CHECK(!memcmp(res, res2, n * sizeof(float)) && !memcmp(o1, o2, n * sizeof(float)) &&
          !memcmp(r1, r2, (size_t)N * sizeof(float)), "add_rmsnorm %dx%d differs from add then rmsnorm", N, C);
    free(res), free(br), free(w), free(res2), free(o1), free(o2), free(r1), free(r2);
}
static void test_rmsnorm(void) {
    rmsnorm_case(9, 37);
    rmsnorm_case(130, 256); /* more rows than the 64 fixed dw blocks */
    add_rmsnorm_case(9, 37);
    add_rmsnorm_case(130, 256);
}

/* ------------------------------------------------------------------------------------ */
/* matmul                                                                                */

typedef struct { int N, C, OC, wrt_w; const double *inp, *w, *g; } MmCtx;
static double mm_loss(const double *p, void *vctx) {
    MmCtx *c = vctx;
    double *o = zerosd((size_t)c->N * c->OC);
    ref_matmul(o, c->wrt_w ? c->inp : p, c->wrt_w ? p : c->w, c->N, c->C, c->OC);
    double s = dotd(o, c->g, (size_t)c->N * c->OC);
    free(o);
    return s;
}

static void matmul_case(int N, int C, int OC) {
    float *inp = randf((size_t)N * C, 1.0f), *w = randf((size_t)OC * C, 0.3f), *out = randf((size_t)N * OC, 1.0f);
    double *ind = tod(inp, (size_t)N * C), *wd = tod(w, (size_t)OC * C), *ref = zerosd((size_t)N * OC);
    op_matmul_forward(out, inp, w, N, C, OC);
    ref_matmul(ref, ind, wd, N, C, OC);
    double e = nerr(out, ref, (size_t)N * OC);
    CHECK(e < TOL_FWD, "matmul %dx%dx%d forward err %g", N, C, OC, e);

    float *g = randf((size_t)N * OC, 1.0f), *dinp = zerosf((size_t)N * C), *dw = zerosf((size_t)OC * C);
    double *gd = tod(g, (size_t)N * OC), *dinr = zerosd((size_t)N * C), *dwr = zerosd((size_t)OC * C);
    op_matmul_backward(dinp, dw, g, inp, w, N, C, OC);
    for (int n = 0; n < N; n++)
        for (int o = 0; o < OC; o++)
            for (int c = 0; c < C; c++) {
                dinr[n * C + c] += gd[n * OC + o] * wd[o * C + c];
                dwr[o * C + c] += gd[n * OC + o] * ind[n * C + c];
            }
    e = nerr(dinp, dinr, (size_t)N * C);
    CHECK(e < TOL_BWD, "matmul dinp err %g", e);
    e = nerr(dw, dwr, (size_t)OC * C);
    CHECK(e < TOL_BWD, "matmul dw err %g", e);
    if (N * C * OC < 200000) {
        MmCtx ctx = {N, C, OC, 0, ind, wd, gd};
        e = fd_check(mm_loss, &ctx, ind, (size_t)N * C, dinp, 8);
        CHECK(e < TOL_FD, "matmul dinp vs finite differences %g", e);
        ctx.wrt_w = 1;
        e = fd_check(mm_loss, &ctx, wd, (size_t)OC * C, dw, 8);
        CHECK(e < TOL_FD, "matmul dw vs finite differences %g", e);
    }
    free(inp), free(w), free(out), free(ind), free(wd), free(ref);
    free(g), free(dinp), free(dw), free(gd), free(dinr), free(dwr);
}
/* op_matmul_forward_add is the product plus the residual (on the cpu backend: the product,
 * then op_add: bitwise). */
static void test_matmul_forward_add(void) {
    int N = 33, C = 20, OC = 70;
    float *inp = randf((size_t)N * C, 1.0f), *w = randf((size_t)OC * C, 0.3f), *res = randf((size_t)N * OC, 1.0f);
    float *want = zerosf((size_t)N * OC), *got = xmalloc((size_t)N * OC * sizeof(float));
    for (size_t i = 0; i < (size_t)N * OC; i++) got[i] = NAN;
    op_matmul_forward(want, inp, w, N, C, OC);
    op_add(want, res, (size_t)N * OC);
    op_matmul_forward_add(got, inp, w, res, N, C, OC);
    CHECK(same(got, want, (size_t)N * OC), "matmul_forward_add differs from matmul then add");
    free(inp), free(w), free(res), free(want), free(got);
}
/* op_matmul_backward_add is the input gradient plus res (cpu: the product, then op_add) */
static void test_matmul_backward_add(void) {
    int N = 33, C = 20, OC = 70;
    float *dout = randf((size_t)N * OC, 1.0f), *w = randf((size_t)OC * C, 0.3f), *res = randf((size_t)N * C, 1.0f);
    float *want = xmalloc((size_t)N * C * sizeof(float)), *got = xmalloc((size_t)N * C * sizeof(float));
    for (size_t i = 0; i < (size_t)N * C; i++) got[i] = want[i] = NAN;
    op_matmul_backward_set(want, NULL, dout, NULL, w, N, C, OC);
    op_add(want, res, (size_t)N * C);
    op_matmul_backward_add(got, dout, w, res, N, C, OC);
    CHECK(same(got, want, (size_t)N * C), "matmul_backward_add differs from matmul_backward_set then add");
    free(dout), free(w), free(res), free(want), free(got);
}
static void test_matmul(void) {
    matmul_case(37, 29, 53);
    matmul_case(1, 5, 3);
    matmul_case(130, 256, 97);
}

/* ------------------------------------------------------------------------------------ */
/* rope                                                                                  */

static void test_rope_tables(void) {
    int T = 300, HD = 64, half = HD / 2;
    float base = 10000.0f;
    float *cs = zerosf((size_t)T * half), *sn = zerosf((size_t)T * half);
    op_rope_tables(cs, sn, T, HD, base);
    double worst_torch = 0.0, worst_exact = 0.0;
    for (int t = 0; t < T; t++)
        for (int i = 0; i < half; i++) {
            /* torch's fp32 steps for the angle, then an exact cos/sin */
            float inv = (float)(1.0 / (double)powf(base, (float)(2 * i) / (float)HD));
            double f = (double)((float)t * inv);
            double a = (double)t * pow(10000.0, -2.0 * i / HD);
            worst_torch = fmax(worst_torch, fmax(fabs(cs[t * half + i] - cos(f)), fabs(sn[t * half + i] - sin(f))));
            worst_exact = fmax(worst_exact, fmax(fabs(cs[t * half + i] - cos(a)), fabs(sn[t * half + i] - sin(a))));
        }
    CHECK(worst_torch < 2e-7, "rope tables vs torch's fp32 angles: %g", worst_torch);
    CHECK(worst_exact < 1e-4, "rope tables vs exact angles: %g", worst_exact);
    CHECK(cs[0] == 1.0f && sn[0] == 0.0f, "position 0 is the identity");
    free(cs), free(sn);
}

typedef struct { int B, T, NH, HD; const double *cs, *sn, *g; } RopeCtx;
static double rope_loss(const double *p, void *vctx) {
    RopeCtx *c = vctx;
    size_t n = (size_t)c->B * c->T * 3 * c->NH * c->HD;
    double *y = xmalloc(n * sizeof(double));
    memcpy(y, p, n * sizeof(double));
    ref_rope(y, c->cs, c->sn, c->B, c->T, c->NH, c->HD, 0);
    double s = dotd(y, c->g, n);
    free(y);
    return s;
}

static void test_rope(void) {
    int B = 2, T = 9, NH = 3, HD = 8, C = NH * HD, half = HD / 2;
    size_t n = (size_t)B * T * 3 * C;
    float *cs = zerosf((size_t)T * half), *sn = zerosf((size_t)T * half);
    op_rope_tables(cs, sn, T, HD, 10000.0f);
    double *csd = tod(cs, (size_t)T * half), *snd = tod(sn, (size_t)T * half);
    float *x = randf(n, 1.0f), *y = copyf(x, n);
    double *ref = tod(x, n);
    op_rope_forward(y, cs, sn, B, T, NH, HD);
    ref_rope(ref, csd, snd, B, T, NH, HD, 0);
    double e = nerr(y, ref, n);
    CHECK(e < 1e-6, "rope forward err %g", e);
    int vsame = 1;
    for (int bt = 0; bt < B * T; bt++) vsame &= same(y + (size_t)bt * 3 * C + 2 * C, x + (size_t)bt * 3 * C + 2 * C, C);
    CHECK(vsame, "rope touched v");
    /* backward is the inverse rotation: backward(forward(x)) = x */
    float *z = copyf(y, n);
    op_rope_backward(z, cs, sn, B, T, NH, HD);
    e = norm_rel_err(z, x, n);
    CHECK(e < 1e-6, "rope backward(forward(x)) != x: %g", e);
    /* and it is the gradient of sum(g * rope(x)) */
    float *g = randf(n, 1.0f), *dg = copyf(g, n);
    op_rope_backward(dg, cs, sn, B, T, NH, HD);
    double *gd = tod(g, n), *xd = tod(x, n), *refb = tod(g, n);
    ref_rope(refb, csd, snd, B, T, NH, HD, 1);
    e = nerr(dg, refb, n);
    CHECK(e < 1e-6, "rope backward err %g", e);
    RopeCtx ctx = {B, T, NH, HD, csd, snd, gd};
    e = fd_check(rope_loss, &ctx, xd, n, dg, 16);
    CHECK(e < TOL_FD, "rope backward vs finite differences %g", e);
    op_rope_backward(NULL, cs, sn, B, T, NH, HD);
    free(cs), free(sn), free(csd), free(snd), free(x), free(y), free(ref), free(z);
    free(g), free(dg), free(gd), free(xd), free(refb);
}

/* ------------------------------------------------------------------------------------ */
/* attention                                                                             */

typedef struct { int B, T, NH, HD; const double *g; } AttCtx;
static double att_loss(const double *p, void *vctx) {
    AttCtx *c = vctx;
    size_t no = (size_t)c->B * c->T * c->NH * c->HD;
    double *o = zerosd(no);
    ref_attention(o, NULL, p, c->B, c->T, c->NH, c->HD);
    double s = dotd(o, c->g, no);
    free(o);
    return s;
}

static void attention_case(int B, int T, int NH, int HD, int fd) {
    int C = NH * HD;
    size_t nq = (size_t)B * T * 3 * C, no = (size_t)B * T * C, nl = (size_t)B * NH * T;
    float *qkv = randf(nq, 1.0f), *out = zerosf(no), *lse = zerosf(nl);
    double *qd = tod(qkv, nq), *ref = zerosd(no), *lref = zerosd(nl);
    op_attention_forward(out, lse, qkv, B, T, NH, HD);
    ref_attention(ref, lref, qd, B, T, NH, HD);
    double e = nerr(out, ref, no);
    CHECK(e < TOL_FWD, "attention B%d T%d NH%d HD%d forward err %g", B, T, NH, HD, e);
    e = nerr(lse, lref, nl);
    CHECK(e < TOL_FWD, "attention lse err %g", e);

    float *g = randf(no, 1.0f), *dq = zerosf(nq);
    double *gd = tod(g, no), *dref = zerosd(nq);
    op_attention_backward(dq, g, qkv, out, lse, B, T, NH, HD);
    ref_attention_bwd(dref, gd, qd, B, T, NH, HD);
    e = nerr(dq, dref, nq);
    CHECK(e < TOL_BWD, "attention backward err %g", e);
    for (int part = 0; part < 3; part++) { /* each of q, k, v separately */
        double num = 0.0, den = 0.0;
        for (size_t r = 0; r < (size_t)B * T; r++)
            for (int c = 0; c < C; c++) {
                size_t i = r * 3 * C + (size_t)part * C + c;
                num += (dq[i] - dref[i]) * (dq[i] - dref[i]);
                den += dref[i] * dref[i];
            }
        double ep = den > 0.0 ? sqrt(num / den) : sqrt(num);
        CHECK(ep < TOL_BWD, "attention backward part %d err %g", part, ep);
    }
    if (fd) {
        AttCtx ctx = {B, T, NH, HD, gd};
        e = fd_check(att_loss, &ctx, qd, nq, dq, 24);
        CHECK(e < TOL_FD, "attention backward vs finite differences %g", e);
    }
    free(qkv), free(out), free(lse), free(qd), free(ref), free(lref), free(g), free(dq), free(gd), free(dref);
}

static void test_attention(void) {
    attention_case(2, 7, 2, 4, 1);
    attention_case(1, 70, 2, 20, 1);   /* two query blocks, HD not a multiple of 16 */
    attention_case(2, 130, 2, 64, 0);  /* three query blocks, full register tiles */
    attention_case(1, 1, 1, 16, 0);
}

/* Changing tokens after t0 must not change anything at or before t0. */
static void test_attention_causal(void) {
    int B = 2, T = 100, NH = 2, HD = 32, C = NH * HD, t0 = 41;
    size_t nq = (size_t)B * T * 3 * C, no = (size_t)B * T * C, nl = (size_t)B * NH * T;
    float *qkv = randf(nq, 1.0f), *out1 = zerosf(no), *out2 = zerosf(no), *l1 = zerosf(nl), *l2 = zerosf(nl);
    op_attention_forward(out1, l1, qkv, B, T, NH, HD);
    for (int b = 0; b < B; b++)
        for (int t = t0 + 1; t < T; t++)
            for (int c = 0; c < 3 * C; c++) qkv[((size_t)b * T + t) * 3 * C + c] = 5.0f * rng_normal(&rng);
    op_attention_forward(out2, l2, qkv, B, T, NH, HD);
    int ok = 1, changed = 0;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            int eq = same(out1 + ((size_t)b * T + t) * C, out2 + ((size_t)b * T + t) * C, C);
            if (t <= t0) ok &= eq;
            else changed += !eq;
            for (int h = 0; h < NH; h++)
                if (t <= t0) ok &= l1[((size_t)b * NH + h) * T + t] == l2[((size_t)b * NH + h) * T + t];
        }
    CHECK(ok, "output at t <= %d depends on later tokens", t0);
    CHECK(changed == B * (T - 1 - t0), "later outputs did not change (%d)", changed);
    free(qkv), free(out1), free(out2), free(l1), free(l2);
}

/* ------------------------------------------------------------------------------------ */
/* swiglu                                                                                */

typedef struct { int N, H; const double *g; } SwiCtx;
static double swi_loss(const double *p, void *vctx) {
    SwiCtx *c = vctx;
    double *o = zerosd((size_t)c->N * c->H);
    ref_swiglu(o, p, c->N, c->H);
    double s = dotd(o, c->g, (size_t)c->N * c->H);
    free(o);
    return s;
}

static void test_swiglu(void) {
    int N = 13, H = 45;
    size_t ng = (size_t)N * 2 * H, no = (size_t)N * H;
    float *gu = randf(ng, 2.0f), *out = zerosf(no);
    gu[0] = 30.0f, gu[1] = -30.0f, gu[2] = 95.0f, gu[3] = -95.0f, gu[4] = 0.0f; /* tails of silu */
    double *gud = tod(gu, ng), *ref = zerosd(no);
    op_swiglu_forward(out, gu, N, H);
    ref_swiglu(ref, gud, N, H);
    double e = nerr(out, ref, no);
    CHECK(e < TOL_FWD, "swiglu forward err %g", e);
    double worst = 0.0;
    for (size_t i = 0; i < no; i++) worst = fmax(worst, fabs(out[i] - ref[i]) / fmax(fabs(ref[i]), 1e-30));
    CHECK(worst < 1e-6, "swiglu forward worst elementwise rel err %g", worst);

    float *g = randf(no, 1.0f), *dgu = zerosf(ng);
    double *gd = tod(g, no), *dref = zerosd(ng);
    op_swiglu_backward(dgu, g, gu, N, H);
    for (int n = 0; n < N; n++)
        for (int i = 0; i < H; i++) {
            double a = gud[n * 2 * H + i], u = gud[n * 2 * H + H + i], s = 1.0 / (1.0 + exp(-a));
            dref[n * 2 * H + i] = gd[n * H + i] * u * (s + a * s * (1.0 - s));
            dref[n * 2 * H + H + i] = gd[n * H + i] * a * s;
        }
    e = nerr(dgu, dref, ng);
    CHECK(e < TOL_BWD, "swiglu backward err %g", e);
    SwiCtx ctx = {N, H, gd};
    e = fd_check(swi_loss, &ctx, gud, ng, dgu, 16);
    CHECK(e < TOL_FD, "swiglu backward vs finite differences %g", e);
    free(gu), free(out), free(gud), free(ref), free(g), free(dgu), free(gd), free(dref);
}

/* ------------------------------------------------------------------------------------ */
/* cross-entropy                                                                         */

typedef struct { int N, V; const int *tg; double scale; } CeCtx;
static double ce_loss(const double *p, void *vctx) {
    CeCtx *c = vctx;
    double *l = zerosd(c->N);
    ref_crossentropy(l, NULL, p, c->tg, c->N, c->V, 0.0);
    double s = 0.0;
    for (int n = 0; n < c->N; n++) s += l[n];
    free(l);
    return c->scale * s;
}

static void crossentropy_case(int N, int V, float spread, int fd) {
    size_t nl = (size_t)N * V;
    float *logits = randf(nl, spread), *losses = zerosf(N);
    int *tg = xmalloc((size_t)N * sizeof(int));
    for (int n = 0; n < N; n++) tg[n] = (int)(rng_u64(&rng) % (uint64_t)V);
    tg[0] = V - 1;
    logits[(size_t)1 * V + tg[1]] += 10.0f * spread; /* a confident, correct row: 1 - p cancels */
    double *ld = tod(logits, nl), *lref = zerosd(N), *gref = zerosd(nl);
    float scale = 1.0f / (float)N;
    ref_crossentropy(lref, gref, ld, tg, N, V, scale);

    /* loss only: logits untouched */
    float *copy = copyf(logits, nl);
    op_crossentropy_forward_backward(losses, copy, tg, N, V, 0.0f);
    CHECK(same(copy, logits, nl), "scale 0 modified the logits");
    double worst = 0.0;
    for (int n = 0; n < N; n++) worst = fmax(worst, rel_err(losses[n], lref[n]));
    CHECK(worst < 1e-5, "crossentropy N%d V%d loss err %g", N, V, worst);

    /* loss and gradient in place */
    float *losses2 = zerosf(N);
    op_crossentropy_forward_backward(losses2, copy, tg, N, V, scale);
    CHECK(same(losses, losses2, N), "loss differs with and without the gradient");
    double e = nerr(copy, gref, nl);
    CHECK(e < TOL_BWD, "crossentropy gradient err %g", e);
    for (int n = 0; n < N; n++) {
        size_t i = (size_t)n * V + tg[n];
        CHECK(rel_err(copy[i], gref[i]) < 1e-5, "target gradient row %d: %g vs %g", n, copy[i], gref[i]);
    }
    if (fd) {
        CeCtx ctx = {N, V, tg, scale};
        e = fd_check(ce_loss, &ctx, ld, nl, copy, 16);
        CHECK(e < TOL_FD, "crossentropy gradient vs finite differences %g", e);
    }
    free(logits), free(losses), free(tg), free(ld), free(lref), free(gref), free(copy), free(losses2);
}

/* Vocabulary parallel: the columns split into t shards (the last narrower), each shard's
 * statistics gathered, then each shard's loss and gradient: the whole op's. */
static void crossentropy_shard_case(int N, int V, int t, float spread) {
    int Vt = (V + t - 1) / t, ld = Vt + 3;
    size_t nl = (size_t)N * V;
    float *logits = randf(nl, spread), *whole = copyf(logits, nl), *lw = zerosf(N);
    int *tg = xmalloc((size_t)N * sizeof(int));
    for (int n = 0; n < N; n++) tg[n] = (int)(rng_u64(&rng) % (uint64_t)V);
    tg[0] = V - 1;
    float scale = 1.0f / (float)N;
    op_crossentropy_forward_backward(lw, whole, tg, N, V, scale);
    float *stats = zerosf((size_t)t * N * 3), *sh = zerosf((size_t)N * ld), *ls = zerosf(N), *ls0 = zerosf(N);
    for (int k = 0; k < t; k++) {  /* each shard's statistics */
        int v0 = k * Vt, w = V - v0 < Vt ? V - v0 : Vt;
        for (int n = 0; n < N; n++) memcpy(sh + (size_t)n * ld, logits + (size_t)n * V + v0, (size_t)w * sizeof(float));
        op_crossentropy_shard_stats(stats + (size_t)k * N * 3, sh, ld, tg, N, w, v0);
    }
    double eg = 0, ng = 0;
    int same_loss = 1;
    for (int k = 0; k < t; k++) {
        int v0 = k * Vt, w = V - v0 < Vt ? V - v0 : Vt;
        for (int n = 0; n < N; n++) memcpy(sh + (size_t)n * ld, logits + (size_t)n * V + v0, (size_t)w * sizeof(float));
        float *keep = copyf(sh, (size_t)N * ld);
        op_crossentropy_shard_backward(ls0, sh, ld, tg, N, w, v0, stats, t, 0.0f);
        CHECK(same(sh, keep, (size_t)N * ld), "shard %d: scale 0 modified the logits", k);
        op_crossentropy_shard_backward(ls, sh, ld, tg, N, w, v0, stats, t, scale);
        same_loss &= same(ls, ls0, N);
        for (int n = 0; n < N; n++)
            for (int j = 0; j < w; j++) {
                double d = (double)sh[(size_t)n * ld + j] - whole[(size_t)n * V + v0 + j];
                eg += d * d;
                ng += (double)whole[(size_t)n * V + v0 + j] * whole[(size_t)n * V + v0 + j];
            }
        free(keep);
    }
    double worst = 0.0;
    for (int n = 0; n < N; n++) worst = fmax(worst, rel_err(ls[n], lw[n]));
    CHECK(same_loss, "shard loss differs with and without the gradient");
    CHECK(worst < 1e-6, "crossentropy shards N%d V%d t%d: loss err %g", N, V, t, worst);
    CHECK(sqrt(eg / ng) < 1e-6, "crossentropy shards N%d V%d t%d: gradient err %g", N, V, t, sqrt(eg / ng));
    free(logits), free(whole), free(lw), free(tg), free(stats), free(sh), free(ls), free(ls0);
}

static void test_crossentropy_shard(void) {
    crossentropy_shard_case(5, 37, 2, 1.0f);
    crossentropy_shard_case(7, 1000, 4, 40.0f); /* huge logits: each shard's own max */
    crossentropy_shard_case(3, 50257, 3, 3.0f);
    /* a NaN in one shard poisons the row on every shard */
    float a[6] = {1, NAN, 0, 1, 2, 3}, b[6] = {1, 2, 3, 4, 5, 6}, st[12], l[2];
    int tg[2] = {0, 4};
    op_crossentropy_shard_stats(st, a, 3, tg, 2, 3, 0);
    op_crossentropy_shard_stats(st + 6, b, 3, tg, 2, 3, 3);
    op_crossentropy_shard_backward(l, b, 3, tg, 2, 3, 3, st, 2, 0.5f);
    CHECK(isnan(l[0]) && !isnan(l[1]) && isnan(b[0]) && !isnan(b[3]), "NaN in another shard: %g %g", l[0], l[1]);
}

static void test_crossentropy(void) {
    crossentropy_case(5, 37, 1.0f, 1);
    crossentropy_case(4, 50257, 3.0f, 0);
    crossentropy_case(3, 1000, 40.0f, 1); /* huge logits: needs the max subtraction */
    /* a NaN logit poisons its row only */
    float logits[6] = {1, 2, NAN, 0, 1, 2}, losses[2];
    int tg[2] = {0, 1};
    op_crossentropy_forward_backward(losses, logits, tg, 2, 3, 0.5f);
    CHECK(isnan(losses[0]) && !isnan(losses[1]), "NaN row: %g %g", losses[0], losses[1]);
    CHECK(isnan(logits[0]) && !isnan(logits[3]), "NaN row gradient");
}

/* ------------------------------------------------------------------------------------ */
/* adamw                                                                                 */

static void adamw_case(float wd, float grad_scale, float beta1) {
    size_t n = 1001;
    float lr = 1e-2f, beta2 = 0.95f, eps = 1e-8f;
    float *p = randf(n, 1.0f), *m = zerosf(n), *v = zerosf(n);
    double *pr = tod(p, n), *mr = zerosd(n), *vr = zerosd(n);
    for (int step = 1; step <= 6; step++) {
        float *g = randf(n, 0.1f);
        if (step == 3) g[0] = 0.0f;
        op_adamw(p, g, m, v, n, lr, beta1, beta2, eps, wd, step, grad_scale);
        double bc1 = 1.0 - pow(beta1, step), bc2 = 1.0 - pow(beta2, step);
        for (size_t i = 0; i < n; i++) {
            double gi = (double)g[i] * grad_scale;
            pr[i] *= 1.0 - (double)lr * wd;
            mr[i] = beta1 * mr[i] + (1.0 - beta1) * gi;
            vr[i] = beta2 * vr[i] + (1.0 - beta2) * gi * gi;
            double denom = sqrt(vr[i]) / sqrt(bc2) + eps;
            pr[i] -= (double)lr / bc1 * mr[i] / denom;
        }
        free(g);
    }
    double ep = nerr(p, pr, n), em = nerr(m, mr, n), ev = nerr(v, vr, n);
    CHECK(ep < 1e-6 && em < 1e-6 && ev < 1e-6, "adamw wd=%g gs=%g b1=%g: param %g m %g v %g", wd, grad_scale,
          beta1, ep, em, ev);
    free(p), free(m), free(v), free(pr), free(mr), free(vr);
}

static void test_adamw(void) {
    adamw_case(0.1f, 0.5f, 0.9f);
    adamw_case(0.0f, 1.0f, 0.9f);
    adamw_case(0.1f, 1.0f, 0.3f); /* beta1 < 0.5 takes torch's other lerp branch */
    /* one step by hand: m = 0.1 g, v = 0.05 g^2, p -= lr * sign(g) (bias corrected) */
    float p = 1.0f, g = -2.0f, m = 0.0f, v = 0.0f;
    op_adamw(&p, &g, &m, &v, 1, 0.1f, 0.9f, 0.95f, 0.0f, 0.5f, 1, 1.0f);
    CHECK(fabs(p - (1.0 * (1.0 - 0.05) + 0.1)) < 1e-6, "adamw one step: p = %.9g", p);
    CHECK(fabs(m + 0.2) < 1e-6 && fabs(v - 0.2) < 1e-6, "adamw one step: m %g v %g", m, v);
    /* op_adamw_cast: the same step, and the compute copy (fp32 here) of its result */
    float p2 = 1.0f, m2 = 0.0f, v2 = 0.0f, act = 0.0f;
    op_adamw_cast(&p2, &g, &m2, &v2, 1, 0.1f, 0.9f, 0.95f, 0.0f, 0.5f, 1, 1.0f, &act);
    CHECK(p2 == p && m2 == m && v2 == v && act == p, "adamw_cast one step: p %.9g copy %.9g (adamw: %.9g)", p2, act, p);
}

/* ------------------------------------------------------------------------------------ */
/* adafactor                                                                             */

/* Each piece against a naive double loop, on a segment that starts and ends mid-row (a
 * shard of a 13 x 9 matrix) and on part of a vector; with and without a first moment. A
 * segment of a rows x cols column slice (tensor parallel) of a rows x wcols matrix has
 * the whole matrix's statistics, its column j at col0 + j (wcols = cols: no slice). */
static void adafactor_case(int rows, int cols, size_t first, size_t n, float beta1, int col0, int wcols) {
    size_t numel = (size_t)rows * cols, S = rows == 1 ? (size_t)wcols : (size_t)rows + wcols;
    int R = rows == 1 ? 0 : rows;  /* where the column statistics start */
    float scale = 0.7f, beta2t = 0.6f, eps1 = 1e-30f, coef = 0.01f, decay = 0.999f;
    /* the buffers hold the segment at offset 3 */
    float *g = randf(n + 3, 0.1f), *p = randf(n + 3, 1.0f), *m = beta1 > 0 ? randf(n + 3, 0.01f) : NULL;
    float *sums = randf(S, 0.01f), *stat = randf(S, 0.01f), *fac = zerosf(S);
    for (size_t j = 0; j < S; j++) stat[j] = fabsf(stat[j]) + 1e-4f, sums[j] = fabsf(sums[j]);
    AdafactorSeg sg = {.off = 3, .n = n, .first = first, .stat = 0, .col0 = (size_t)col0,
                       .rows = rows, .cols = cols};
    double *rs = tod(sums, S), *rst = tod(stat, S), *rf = zerosd(S), *rp = tod(p, n + 3), *rm = m ? tod(m, n + 3) : NULL;
    for (size_t e = 0; e < n; e++) {  /* sums */
        size_t i = (first + e) / cols, j = (first + e) % cols;
        double x = (double)g[3 + e] * scale;
        if (rows > 1) rs[i] += x * x;
        rs[R + col0 + j] += x * x;
    }
    op_adafactor_sums(sums, g, &sg, scale);
    CHECK(nerr(sums, rs, S) < 1e-6, "sums %dx%d: %g", rows, cols, nerr(sums, rs, S));
    if (rows == 1) {  /* stats, from the sums just made */
        for (int j = 0; j < wcols; j++) rst[j] = beta2t * rst[j] + (1 - beta2t) * (rs[j] + eps1), rf[j] = 1 / sqrt(rst[j]);
    } else {
        double mean = 0;
        for (int i = 0; i < rows; i++) rst[i] = beta2t * rst[i] + (1 - beta2t) * (rs[i] / wcols + eps1), mean += rst[i] / rows;
        for (int i = 0; i < rows; i++) rf[i] = 1 / sqrt(rst[i] / mean);
        for (int j = 0; j < wcols; j++)
            rst[rows + j] = beta2t * rst[rows + j] + (1 - beta2t) * (rs[rows + j] / rows + eps1),
            rf[rows + j] = 1 / sqrt(rst[rows + j]);
    }
    op_adafactor_stats(stat, fac, sums, rows, wcols, beta2t, eps1);
    CHECK(nerr(stat, rst, S) < 1e-6 && nerr(fac, rf, S) < 1e-6, "stats %dx%d: %g, factors %g", rows, cols,
          nerr(stat, rst, S), nerr(fac, rf, S));
    double su = 0, sp = 0, out[2];
    for (size_t e = 0; e < n; e++) {  /* rms, then the update */
        size_t i = (first + e) / cols, j = (first + e) % cols;
        double u = (double)g[3 + e] * scale * (rows == 1 ? 1.0 : rf[i]) * rf[R + col0 + j];
        su += u * u;
        sp += rp[3 + e] * rp[3 + e];
        if (rm) rm[3 + e] = beta1 * rm[3 + e] + (1 - beta1) * coef * u, rp[3 + e] = rp[3 + e] * decay - rm[3 + e];
        else rp[3 + e] = rp[3 + e] * decay - coef * u;
    }
    op_adafactor_rms(out, p, g, fac, &sg, scale);
    CHECK(fabs(out[0] - su) < 1e-6 * su && fabs(out[1] - sp) < 1e-9 * sp, "rms %dx%d: %g vs %g, %g vs %g", rows, cols,
          out[0], su, out[1], sp);
    op_adafactor_update(p, g, m, fac, &sg, scale, coef, decay, beta1);
    CHECK(nerr(p, rp, n + 3) < 1e-6 && (!m || nerr(m, rm, n + 3) < 1e-6), "update %dx%d b1=%g: %g", rows, cols, beta1,
          nerr(p, rp, n + 3));
    CHECK(numel >= first + n, "case");
    free(g), free(p), free(m), free(sums), free(stat), free(fac), free(rs), free(rst), free(rf), free(rp), free(rm);
}

static void test_adafactor(void) {
    adafactor_case(13, 9, 5, 80, 0.0f, 0, 9);    /* rows 0..9, the first and last cut */
    adafactor_case(13, 9, 0, 117, 0.9f, 0, 9);   /* the whole matrix, a first moment */
    adafactor_case(300, 70, 0, 21000, 0.0f, 0, 70);  /* more rows than a chunk of the column sums */
    adafactor_case(1, 40, 7, 20, 0.0f, 0, 40);   /* part of a vector */
    adafactor_case(13, 9, 5, 80, 0.9f, 9, 27);   /* columns 9..17 of a 13 x 27 matrix */
    adafactor_case(1, 40, 7, 20, 0.0f, 40, 120); /* part of a slice of a vector */
}

/* ------------------------------------------------------------------------------------ */
/* flat-buffer helpers                                                                   */

static void test_sumsq_scale_add(void) {
    size_t n = 200003;
    float *x = randf(n, 1.5f), *y = randf(n, 1.0f);
    double ref = 0.0;
    for (size_t i = 0; i < n; i++) ref += (double)x[i] * x[i];
    double s = op_sumsq(x, n);
    CHECK(rel_err(s, ref) < 1e-12, "sumsq %.17g vs %.17g", s, ref);
    CHECK(op_sumsq(x, 0) == 0.0 && op_sumsq(x, 1) == (double)x[0] * x[0], "sumsq small n");
    float *xs = copyf(x, n);
    op_scale(xs, n, 0.37f);
    int ok = 1;
    for (size_t i = 0; i < n; i++) ok &= xs[i] == (float)((double)x[i] * (double)0.37f);
    CHECK(ok, "scale");
    float *ya = copyf(y, n);
    op_add(ya, x, n);
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) worst = fmax(worst, fabs(ya[i] - ((double)y[i] + x[i])) / (fabs(y[i]) + fabs(x[i])));
    CHECK(worst < 1e-7, "add err %g", worst);
    /* op_sum_parts: bitwise op_add one part after another, into another buffer and in place */
    float *p1 = randf(n, 1.0f), *p2 = randf(n, 1.0f), *seq = copyf(y, n), *into = zerosf(n), *inpl = copyf(y, n);
    op_add(seq, x, n), op_add(seq, p1, n), op_add(seq, p2, n);
    const void *parts[4] = {y, x, p1, p2}, *mine[4] = {inpl, x, p1, p2};
    op_sum_parts(into, parts, 4, n);
    op_sum_parts(inpl, mine, 4, n);
    CHECK(!memcmp(into, seq, n * sizeof(float)) && !memcmp(inpl, seq, n * sizeof(float)), "sum_parts differs from the adds");
    op_sum_parts(into, parts, 1, n);
    CHECK(!memcmp(into, y, n * sizeof(float)), "sum_parts of one part is not a copy");
    free(p1), free(p2), free(seq), free(into), free(inpl);
    free(x), free(y), free(xs), free(ya);
}

/* gather / scatter of rows by an index list: every byte where it belongs, nothing else
 * written; rows of floats, and of 6 bytes (row_bytes need not be a multiple of anything) */
static void test_copy_rows(void) {
    const size_t R = 1000, E = 37, n = 300;
    int rows[300];
    for (size_t i = 0; i < n; i++) rows[i] = (int)((i * 7 + 3) % R);  /* distinct: 7 is prime to R */
    float *src = randf(R * E, 1.0f), *g = randf(n * E, 1.0f), *s = zerosf(R * E);
    op_gather_rows(g, src, rows, n, E * sizeof(float));
    int ok = 1;
    for (size_t i = 0; i < n; i++) ok &= !memcmp(g + i * E, src + (size_t)rows[i] * E, E * sizeof(float));
    CHECK(ok, "gather: rows not where they belong");
    op_scatter_rows(s, g, rows, n, E * sizeof(float));
    unsigned char *hit = calloc(R, 1);
    for (size_t i = 0; i < n; i++) hit[rows[i]] = 1;
    ok = 1;
    for (size_t r = 0; r < R; r++)
        for (size_t e = 0; e < E; e++) ok &= s[r * E + e] == (hit[r] ? src[r * E + e] : 0.0f);
    CHECK(ok, "scatter: wrong rows written, or others touched");
    unsigned char b[60], bg[30], bs[60] = {0};
    for (int i = 0; i < 60; i++) b[i] = (unsigned char)(i + 1);
    int r3[] = {7, 2, 9, 0, 5};
    op_gather_rows(bg, b, r3, 5, 6);
    op_scatter_rows(bs, bg, r3, 5, 6);
    ok = bg[0] == 43 && bg[29] == 36;
    for (int i = 0; i < 60; i++) {
        int r = i / 6, in = r == 0 || r == 2 || r == 5 || r == 7 || r == 9;
        ok &= bs[i] == (in ? b[i] : 0);
    }
    CHECK(ok, "6-byte rows");
    free(src), free(g), free(s), free(hit);
}

/* ------------------------------------------------------------------------------------ */
/* conventions: accumulate, NULL gradients, determinism                                   */

/* A small layer's worth of inputs for every backward op. */
typedef struct {
    int B, T, NH, HD, C, N, H, V;
    int *tok;
    float *x, *w, *rstd, *g, *wte, *mw, *gm, *qkv, *att, *lse, *gatt, *gu, *gsw, *cs, *sn;
} Fix;

static Fix fix_make(void) {
    Fix f = {.B = 2, .T = 67, .NH = 2, .HD = 16};
    f.C = f.NH * f.HD, f.N = f.B * f.T, f.H = 40, f.V = 23;
    size_t NC = (size_t)f.N * f.C;
    f.tok = xmalloc((size_t)f.N * sizeof(int));
    for (int n = 0; n < f.N; n++) f.tok[n] = (int)(rng_u64(&rng) % (uint64_t)f.V);
    f.x = randf(NC, 1.0f), f.w = randf(f.C, 1.0f), f.rstd = zerosf(f.N), f.g = randf(NC, 1.0f);
    f.wte = randf((size_t)f.V * f.C, 1.0f);
    f.mw = randf((size_t)3 * f.C * f.C, 0.2f), f.gm = randf(NC * 3, 1.0f);
    f.qkv = randf(NC * 3, 1.0f), f.att = zerosf(NC), f.lse = zerosf((size_t)f.B * f.NH * f.T);
    f.gatt = randf(NC, 1.0f);
    f.gu = randf((size_t)f.N * 2 * f.H, 1.0f), f.gsw = randf((size_t)f.N * f.H, 1.0f);
    f.cs = zerosf((size_t)f.T * f.HD / 2), f.sn = zerosf((size_t)f.T * f.HD / 2);
    op_rope_tables(f.cs, f.sn, f.T, f.HD, 10000.0f);
    float *y = zerosf(NC);
    op_rmsnorm_forward(y, f.rstd, f.x, f.w, f.N, f.C, 1e-5f);
    op_attention_forward(f.att, f.lse, f.qkv, f.B, f.T, f.NH, f.HD);
    free(y);
    return f;
}
static void fix_free(Fix *f) {
    free(f->tok), free(f->x), free(f->w), free(f->rstd), free(f->g), free(f->wte), free(f->mw), free(f->gm);
    free(f->qkv), free(f->att), free(f->lse), free(f->gatt), free(f->gu), free(f->gsw), free(f->cs), free(f->sn);
}

enum { OP_EMB, OP_RMS, OP_MM, OP_ATT, OP_SWI, N_BWD_OPS };
static const char *bwd_name[] = {"embedding", "rmsnorm", "matmul", "attention", "swiglu"};
/* Sizes of the (up to two) gradient outputs of backward op k. */
static void bwd_sizes(const Fix *f, int k, size_t *n0, size_t *n1) {
    size_t NC = (size_t)f->N * f->C;
    *n1 = 0;
    switch (k) {
    case OP_EMB: *n0 = (size_t)f->V * f->C; break;
    case OP_RMS: *n0 = NC, *n1 = f->C; break;
    case OP_MM: *n0 = NC, *n1 = (size_t)3 * f->C * f->C; break;
    case OP_ATT: *n0 = NC * 3; break;
    default: *n0 = (size_t)f->N * 2 * f->H; break;
    }
}
static void bwd_call(const Fix *f, int k, float *d0, float *d1) {
    switch (k) {
    case OP_EMB: op_embedding_backward(d0, f->g, f->tok, f->N, f->C); break;
    case OP_RMS: op_rmsnorm_backward(d0, d1, f->g, f->x, f->w, f->rstd, f->N, f->C); break;
    case OP_MM: op_matmul_backward(d0, d1, f->gm, f->x, f->mw, f->N, f->C, 3 * f->C); break;
    case OP_ATT: op_attention_backward(d0, f->gatt, f->qkv, f->att, f->lse, f->B, f->T, f->NH, f->HD); break;
    default: op_swiglu_backward(d0, f->gsw, f->gu, f->N, f->H); break;
    }
}

static void test_backward_accumulates(void) {
    Fix f = fix_make();
    for (int k = 0; k < N_BWD_OPS; k++) {
        size_t n0, n1;
        bwd_sizes(&f, k, &n0, &n1);
        /* once into zeros */
        float *a0 = zerosf(n0), *a1 = n1 ? zerosf(n1) : NULL;
        bwd_call(&f, k, a0, a1);
        /* twice into zeros: twice the gradient */
        float *b0 = zerosf(n0), *b1 = n1 ? zerosf(n1) : NULL;
        bwd_call(&f, k, b0, b1);
        bwd_call(&f, k, b0, b1);
        for (size_t i = 0; i < n0; i++) b0[i] *= 0.5f;
        for (size_t i = 0; i < n1; i++) b1[i] *= 0.5f;
        double e = norm_rel_err(b0, a0, n0) + (n1 ? norm_rel_err(b1, a1, n1) : 0.0);
        CHECK(e < 1e-6, "%s: calling backward twice does not double the gradient (%g)", bwd_name[k], e);
        /* into random values: adds to them */
        float *c0 = randf(n0, 1.0f), *c1 = n1 ? randf(n1, 1.0f) : NULL;
        float *p0 = copyf(c0, n0), *p1 = n1 ? copyf(c1, n1) : NULL;
        bwd_call(&f, k, c0, c1);
        for (size_t i = 0; i < n0; i++) c0[i] -= p0[i];
        for (size_t i = 0; i < n1; i++) c1[i] -= p1[i];
        e = norm_rel_err(c0, a0, n0) + (n1 ? norm_rel_err(c1, a1, n1) : 0.0);
        CHECK(e < 1e-5, "%s: backward does not accumulate into existing values (%g)", bwd_name[k], e);
        CHECK(norm_rel_err(a0, p0, n0) > 0.1, "%s: gradient is trivially zero", bwd_name[k]);
        /* NULL gradient outputs: the other output is unchanged, nothing crashes */
        bwd_call(&f, k, NULL, NULL);
        if (n1) {
            float *z0 = zerosf(n0), *z1 = zerosf(n1);
            bwd_call(&f, k, z0, NULL);
            bwd_call(&f, k, NULL, z1);
            CHECK(same(z0, a0, n0) && same(z1, a1, n1), "%s: NULL for one gradient changes the other", bwd_name[k]);
            free(z0), free(z1);
        }
        free(a0), free(a1), free(b0), free(b1), free(c0), free(c1), free(p0), free(p1);
    }
    fix_free(&f);
}

/* The _set variants write the input gradient: over NaN they give the same bits as the
 * accumulating op over zeros (so dinp is never read), and matmul's dw still accumulates. */
static void test_backward_set_writes(void) {
    Fix f = fix_make();
    size_t NC = (size_t)f.N * f.C, nw = (size_t)3 * f.C * f.C, ng = (size_t)f.N * 2 * f.H;
    float *want = zerosf(NC), *got = xmalloc(NC * sizeof(float));
    float *dw0 = randf(nw, 1.0f), *dw_acc = copyf(dw0, nw), *dw_set = copyf(dw0, nw);
    for (size_t i = 0; i < NC; i++) got[i] = NAN;
    op_matmul_backward(want, dw_acc, f.gm, f.x, f.mw, f.N, f.C, 3 * f.C);
    op_matmul_backward_set(got, dw_set, f.gm, f.x, f.mw, f.N, f.C, 3 * f.C);
    CHECK(same(got, want, NC), "matmul_backward_set: dinp differs from accumulating into zeros");
    CHECK(same(dw_set, dw_acc, nw) && norm_rel_err(dw_set, dw0, nw) > 0.1,
          "matmul_backward_set: dw does not accumulate as op_matmul_backward does");
    float *gwant = zerosf(ng), *ggot = xmalloc(ng * sizeof(float));
    for (size_t i = 0; i < ng; i++) ggot[i] = NAN;
    op_swiglu_backward(gwant, f.gsw, f.gu, f.N, f.H);
    op_swiglu_backward_set(ggot, f.gsw, f.gu, f.N, f.H);
    CHECK(same(ggot, gwant, ng), "swiglu_backward_set differs from accumulating into zeros");
    size_t nq = NC * 3;
    float *qwant = zerosf(nq), *qgot = xmalloc(nq * sizeof(float));
    for (size_t i = 0; i < nq; i++) qgot[i] = NAN;
    op_attention_backward(qwant, f.gatt, f.qkv, f.att, f.lse, f.B, f.T, f.NH, f.HD);
    op_attention_backward_set(qgot, f.gatt, f.qkv, f.att, f.lse, f.B, f.T, f.NH, f.HD);
    CHECK(same(qgot, qwant, nq), "attention_backward_set differs from accumulating into zeros");
    /* with RoPE's backward: the same, then rotated back */
    for (size_t i = 0; i < nq; i++) qgot[i] = NAN;
    op_rope_backward(qwant, f.cs, f.sn, f.B, f.T, f.NH, f.HD);
    op_attention_rope_backward_set(qgot, f.gatt, f.qkv, f.att, f.lse, f.cs, f.sn, f.B, f.T, f.NH, f.HD);
    CHECK(same(qgot, qwant, nq) && norm_rel_err(qgot, f.qkv, nq) > 0.1,
          "attention_rope_backward_set differs from attention_backward_set then rope_backward");
    op_attention_rope_backward_set(NULL, f.gatt, f.qkv, f.att, f.lse, f.cs, f.sn, f.B, f.T, f.NH, f.HD);
    free(qwant), free(qgot);
    op_attention_backward_set(NULL, f.gatt, f.qkv, f.att, f.lse, f.B, f.T, f.NH, f.HD);
    op_matmul_backward_set(NULL, NULL, f.gm, f.x, f.mw, f.N, f.C, 3 * f.C);  /* NULLs: nothing to do */
    op_swiglu_backward_set(NULL, f.gsw, f.gu, f.N, f.H);
    free(want), free(got), free(dw0), free(dw_acc), free(dw_set), free(gwant), free(ggot);
    fix_free(&f);
}

/* Runs every op once on the fixture and hashes all outputs. */
static uint64_t run_all_ops(const Fix *f) {
    size_t NC = (size_t)f->N * f->C, NQ = NC * 3;
    uint64_t h = FNV1A64_INIT;
    float *y = zerosf(NQ), *r = zerosf(f->N), *z = zerosf(NQ), *l = zerosf((size_t)f->B * f->NH * f->T);
    op_embedding_forward(y, f->tok, f->wte, f->N, f->C);
    h = fnv1a64(y, NC * sizeof(float), h);
    op_rmsnorm_forward(y, r, f->x, f->w, f->N, f->C, 1e-5f);
    h = fnv1a64(y, NC * sizeof(float), h), h = fnv1a64(r, (size_t)f->N * sizeof(float), h);
    op_matmul_forward(y, f->x, f->mw, f->N, f->C, 3 * f->C);
    h = fnv1a64(y, NQ * sizeof(float), h);
    memcpy(y, f->qkv, NQ * sizeof(float));
    op_rope_forward(y, f->cs, f->sn, f->B, f->T, f->NH, f->HD);
    op_rope_backward(y, f->cs, f->sn, f->B, f->T, f->NH, f->HD);
    h = fnv1a64(y, NQ * sizeof(float), h);
    op_attention_forward(z, l, f->qkv, f->B, f->T, f->NH, f->HD);
    h = fnv1a64(z, NC * sizeof(float), h), h = fnv1a64(l, (size_t)f->B * f->NH * f->T * sizeof(float), h);
    op_swiglu_forward(y, f->gu, f->N, f->H);
    h = fnv1a64(y, (size_t)f->N * f->H * sizeof(float), h);
    for (int k = 0; k < N_BWD_OPS; k++) {
        size_t n0, n1;
        bwd_sizes(f, k, &n0, &n1);
        float *d0 = zerosf(n0), *d1 = n1 ? zerosf(n1) : NULL;
        bwd_call(f, k, d0, d1);
        h = fnv1a64(d0, n0 * sizeof(float), h);
        if (d1) h = fnv1a64(d1, n1 * sizeof(float), h);
        free(d0), free(d1);
    }
    memcpy(y, f->gm, NQ * sizeof(float));
    op_crossentropy_forward_backward(r, y, f->tok, f->N, 3 * f->C, 0.01f);
    h = fnv1a64(y, NQ * sizeof(float), h), h = fnv1a64(r, (size_t)f->N * sizeof(float), h);
    float *p = copyf(f->x, NC), *m = zerosf(NC), *v = zerosf(NC);
    op_adamw(p, f->g, m, v, NC, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1, 0.7f);
    h = fnv1a64(p, NC * sizeof(float), h);
    double s = op_sumsq(f->gm, NQ);
    h = fnv1a64(&s, sizeof s, h);
    free(y), free(r), free(z), free(l), free(p), free(m), free(v);
    return h;
}

static void test_determinism(void) {
    Fix f = fix_make();
    uint64_t h1 = run_all_ops(&f), h2 = run_all_ops(&f);
    CHECK(h1 == h2, "two identical runs differ");
    /* The hand-written ops reduce in an order independent of the thread count; the
     * attention and rmsnorm results must match for 1 and 3 threads too. */
    size_t n0, n1;
    float *att[2], *dq[2], *dx[2], *dw[2], *de[2];
    for (int r = 0; r < 2; r++) {
        ops_init("cpu", r == 0 ? 1 : 3, NULL, 0);
        float *l = zerosf((size_t)f.B * f.NH * f.T);
        att[r] = zerosf((size_t)f.N * f.C);
        op_attention_forward(att[r], l, f.qkv, f.B, f.T, f.NH, f.HD);
        bwd_sizes(&f, OP_ATT, &n0, &n1);
        dq[r] = zerosf(n0);
        bwd_call(&f, OP_ATT, dq[r], NULL);
        bwd_sizes(&f, OP_RMS, &n0, &n1);
        dx[r] = zerosf(n0), dw[r] = zerosf(n1);
        bwd_call(&f, OP_RMS, dx[r], dw[r]);
        bwd_sizes(&f, OP_EMB, &n0, &n1);
        de[r] = zerosf(n0);
        bwd_call(&f, OP_EMB, de[r], NULL);
        free(l);
    }
    ops_init("cpu", 0, NULL, 0);
    CHECK(same(att[0], att[1], (size_t)f.N * f.C), "attention forward depends on the thread count");
    CHECK(same(dq[0], dq[1], (size_t)f.N * f.C * 3), "attention backward depends on the thread count");
    CHECK(same(dx[0], dx[1], (size_t)f.N * f.C) && same(dw[0], dw[1], f.C), "rmsnorm backward depends on the thread count");
    CHECK(same(de[0], de[1], (size_t)f.V * f.C), "embedding backward depends on the thread count");
    for (int r = 0; r < 2; r++) free(att[r]), free(dq[r]), free(dx[r]), free(dw[r]), free(de[r]);
    fix_free(&f);
}

static void test_backend_name(void) { CHECK(strcmp(ops_backend_name(), "cpu") == 0, "%s", ops_backend_name()); }

/* Backend selection and the memory ops on the cpu: an unknown device is refused with a
 * message; cuda either starts or says why in one line (no GPU here, or a build without
 * nvcc) and leaves the cpu backend active; op_alloc is zeroed and aligned. */
static void test_backend_memory(void) {
    char err[256] = "";
    CHECK(ops_init("tpu", 0, err, sizeof err) == -1 && strstr(err, "device=tpu"), "tpu: %s", err);
    err[0] = 0;
    if (ops_init("cuda", 0, err, sizeof err) == 0) {
        CHECK(!ops_host_memory(), "cuda backend claims host memory");
    } else {
        CHECK(strstr(err, "no CUDA support") || strstr(err, "no usable GPU"), "cuda refused with: %s", err);
        CHECK(!strchr(err, '\n'), "multi-line message: %s", err);
    }
    CHECK(ops_init("cpu", 0, err, sizeof err) == 0, "cpu: %s", err);
    CHECK(ops_host_memory() && !strcmp(ops_backend_name(), "cpu"), "%s", ops_backend_name());
    size_t f, t;
    CHECK(ops_device_memory(&f, &t) == -1 && ops_device_peak(&f, &t) == -1, "cpu reports device memory");
    CHECK(op_alloc(0) == NULL, "op_alloc(0)");
    size_t n = 1001;
    float *a = op_alloc(n * sizeof(float)), *b = op_alloc(n * sizeof(float)), *h = xmalloc(n * sizeof(float));
    CHECK(((uintptr_t)a & 63) == 0, "op_alloc not 64-byte aligned");
    int zero = 1;
    for (size_t i = 0; i < n; i++) zero &= a[i] == 0.0f;
    CHECK(zero, "op_alloc not zeroed");
    for (size_t i = 0; i < n; i++) h[i] = (float)i;
    op_upload(a, h, n * sizeof(float));
    op_copy(b, a, n * sizeof(float));
    op_zero(b, 10 * sizeof(float));
    memset(h, 0xff, n * sizeof(float));
    op_download(h, b, n * sizeof(float));
    int okv = 1;
    for (size_t i = 0; i < n; i++) okv &= h[i] == (i < 10 ? 0.0f : (float)i);
    CHECK(okv, "upload / copy / zero / download");
    op_free(a);
    op_free(b);
    op_free(NULL);
    free(h);
}

int main(void) {
    ops_init("cpu", 0, NULL, 0);
    rng_seed(&rng, 1234);
    RUN(test_backend_name);
    RUN(test_backend_memory);
    RUN(test_embedding);
    RUN(test_embedding_rows);
    RUN(test_embedding_shard);
    RUN(test_rmsnorm);
    RUN(test_matmul);
    RUN(test_matmul_forward_add);
    RUN(test_matmul_backward_add);
    RUN(test_rope_tables);
    RUN(test_rope);
    RUN(test_attention);
    RUN(test_attention_causal);
    RUN(test_swiglu);
    RUN(test_crossentropy);
    RUN(test_crossentropy_shard);
    RUN(test_adamw);
    RUN(test_adafactor);
    RUN(test_sumsq_scale_add);
    RUN(test_copy_rows);
    RUN(test_backward_accumulates);
    RUN(test_backward_set_writes);
    RUN(test_determinism);
    return TEST_SUMMARY();
}
