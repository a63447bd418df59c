/* Mixture of experts on the cpu: the routing, dispatch and combine ops against double
 * references and finite differences; the load-balancing loss's values; and whole models: one
 * expert with top 1 is the dense FFN, dropless is unlimited capacity, finite differences of the
 * whole loss (cross-entropy, load-balancing and z losses) through router and experts, and the
 * parameter counts of the benchmarks' variants. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "model.h"
#include "ops.h"
#include "optim.h"
#include "test.h"
#include "util.h"

static Rng rng;

static float *randf(size_t n, float scale) {
    float *x = xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = scale * rng_normal(&rng);
    return x;
}

/* ---- the routing in double: scores, the top k by score + bias, gates, log-sum-exp ---- */
typedef struct { double *s, *gate, *lse; int *idx; } RefRoute;

static void ref_route(RefRoute *r, const double *z, const float *bias, int N, int X, int k, int sigmoid) {
    for (int n = 0; n < N; n++) {
        const double *zn = z + (size_t)n * X;
        double mx = zn[0], sum = 0;
        for (int e = 1; e < X; e++) mx = fmax(mx, zn[e]);
        for (int e = 0; e < X; e++) sum += exp(zn[e] - mx);
        r->lse[n] = mx + log(sum);
        double *s = r->s + (size_t)n * X;
        for (int e = 0; e < X; e++) s[e] = sigmoid ? 1 / (1 + exp(-zn[e])) : exp(zn[e] - r->lse[n]);
        int *ix = r->idx + (size_t)n * k;
        double sel = 0;
        for (int j = 0; j < k; j++) {
            int best = -1;
            for (int e = 0; e < X; e++) {
                int taken = 0;
                for (int i = 0; i < j; i++) taken |= ix[i] == e;
                double v = s[e] + (bias ? bias[e] : 0);
                if (!taken && (best < 0 || v > s[best] + (bias ? bias[best] : 0))) best = e;
            }
            ix[j] = best;
            sel += s[best];
        }
        for (int j = 0; j < k; j++) r->gate[(size_t)n * k + j] = s[ix[j]] / sel;
    }
}

static RefRoute ref_alloc(int N, int X, int k) {
    RefRoute r = {xcalloc((size_t)N * X, 8), xcalloc((size_t)N * k, 8), xcalloc((size_t)N, 8),
                  xcalloc((size_t)N * k, sizeof(int))};
    return r;
}
static void ref_free(RefRoute *r) { free(r->s); free(r->gate); free(r->lse); free(r->idx); }

static void topk_case(int N, int X, int k, int sigmoid, int with_bias, int ties) {
    float *z = randf((size_t)N * X, 2.0f), *bias = with_bias ? randf((size_t)X, 0.3f) : NULL;
    if (ties)  /* row 0 all equal, row 1 two equal leaders: the lower expert first */
        for (int e = 0; e < X; e++) z[e] = 0.5f, z[X + e] = e == 1 || e == 3 ? 3.0f : -1.0f;
    double *zd = xmalloc((size_t)N * X * 8);
    for (size_t i = 0; i < (size_t)N * X; i++) zd[i] = z[i];
    RefRoute r = ref_alloc(N, X, k);
    ref_route(&r, zd, bias, N, X, k, sigmoid);
    float *probs = xmalloc((size_t)N * X * 4), *gate = xmalloc((size_t)N * k * 4), *lse = xmalloc((size_t)N * 4);
    int *idx = xmalloc((size_t)N * k * sizeof(int));
    op_moe_topk(probs, idx, gate, lse, z, bias, N, X, k, sigmoid);
    int idx_ok = !memcmp(idx, r.idx, (size_t)N * k * sizeof(int));
    double ep = 0, eg = 0, el = 0;
    for (size_t i = 0; i < (size_t)N * X; i++) ep = fmax(ep, fabs(probs[i] - r.s[i]));
    for (size_t i = 0; i < (size_t)N * k; i++) eg = fmax(eg, fabs(gate[i] - r.gate[i]));
    for (int n = 0; n < N; n++) el = fmax(el, fabs(lse[n] - r.lse[n]) / fmax(1, fabs(r.lse[n])));
    CHECK(idx_ok && ep < 1e-6 && eg < 1e-6 && el < 1e-6, "N=%d X=%d k=%d sigmoid=%d bias=%d: idx %s, probs %.3g, "
          "gates %.3g, lse %.3g", N, X, k, sigmoid, with_bias, idx_ok ? "same" : "differ", ep, eg, el);
    if (ties) CHECK(idx[0] == 0 && (k < 2 || idx[1] == 1) && idx[k] == 1 && (k < 2 || idx[k + 1] == 3),
                    "ties go to the lower expert: %d %d / %d %d", idx[0], idx[1], idx[k], idx[k + 1]);
    ref_free(&r);
    free(z); free(bias); free(zd); free(probs); free(gate); free(lse); free(idx);
}

static void test_topk(void) {
    topk_case(37, 8, 2, 0, 0, 1);
    topk_case(37, 8, 3, 1, 0, 1);
    topk_case(50, 16, 2, 0, 1, 0);
    topk_case(50, 16, 6, 1, 1, 0);
    topk_case(9, 1, 1, 0, 0, 0);
    topk_case(21, 64, 6, 0, 0, 0);
}

/* ---- dispatch: each expert's choices one group of rows, in order of token then choice;
 * capacity keeps each expert's first ones ---- */
typedef struct { int *cnt, *pos, *rowtok; float *grow; } Disp;

static Disp dispatch(const int *idx, const float *gate, int N, int k, int X, int cap) {
    Disp d = {xmalloc((3 * (size_t)X + 1) * sizeof(int)), xmalloc((size_t)N * k * sizeof(int)),
              xmalloc((size_t)N * k * sizeof(int) + 4), xmalloc((size_t)N * k * 4 + 4)};
    op_moe_dispatch(d.cnt, d.pos, d.rowtok, d.grow, idx, gate, N, k, X, cap);
    return d;
}
static void disp_free(Disp *d) { free(d->cnt); free(d->pos); free(d->rowtok); free(d->grow); }

static void dispatch_case(int N, int X, int k, int cap) {
    int *idx = xmalloc((size_t)N * k * sizeof(int));
    float *gate = randf((size_t)N * k, 1.0f);
    for (int n = 0; n < N; n++)  /* distinct experts per token, expert X - 1 never chosen (X > k) */
        for (int j = 0; j < k; j++) {
            int e;
            for (;;) {
                e = (int)(rng_u64(&rng) % (uint64_t)(X - 1));
                if (n % 3 == 0) e = j;  /* a skew toward the first experts */
                int dup = 0;
                for (int i = 0; i < j; i++) dup |= idx[(size_t)n * k + i] == e;
                if (!dup) break;
            }
            idx[(size_t)n * k + j] = e;
        }
    Disp d = dispatch(idx, gate, N, k, X, cap);
    const int *routed = d.cnt, *kept = d.cnt + X, *first = d.cnt + 2 * X;
    int ok = first[0] == 0, seen_total = 0;
    int *seen = xcalloc((size_t)X, sizeof(int)), *seen_kept = xcalloc((size_t)X, sizeof(int));
    for (int n = 0; n < N; n++)
        for (int j = 0; j < k; j++) {
            int i = n * k + j, e = idx[i], p = d.pos[i];
            int keep = cap <= 0 || seen[e] < cap;
            seen[e]++;
            if (!keep) { ok &= p == -1; continue; }
            /* kept: the next row of expert e's group, holding token n and its gate */
            ok &= p == first[e] + seen_kept[e] && d.rowtok[p] == n && d.grow[p] == gate[i];
            seen_kept[e]++, seen_total++;
        }
    for (int e = 0; e < X; e++) ok &= routed[e] == seen[e] && kept[e] == seen_kept[e] && first[e + 1] == first[e] + kept[e];
    ok &= first[X] == seen_total && routed[X - 1] == 0;
    CHECK(ok, "dispatch N=%d X=%d k=%d capacity=%d", N, X, k, cap);
    if (cap > 0 && cap >= N) {  /* a capacity no expert can reach is dropless */
        Disp d0 = dispatch(idx, gate, N, k, X, 0);
        CHECK(!memcmp(d0.cnt, d.cnt, (3 * (size_t)X + 1) * sizeof(int)) && !memcmp(d0.pos, d.pos, (size_t)N * k * sizeof(int)) &&
              !memcmp(d0.rowtok, d.rowtok, (size_t)first[X] * sizeof(int)), "capacity %d = dropless", cap);
        disp_free(&d0);
    }
    disp_free(&d);
    free(seen); free(seen_kept); free(idx); free(gate);
}

static void test_dispatch(void) {
    dispatch_case(50, 8, 2, 0);
    dispatch_case(50, 8, 2, 5);
    dispatch_case(50, 8, 2, 50);
    dispatch_case(31, 6, 3, 2);
    dispatch_case(7, 16, 1, 0);  /* most experts get no token */
}

/* ---- permute (op_gather_rows by rowtok) then unpermute: every copy of a row summed back;
 * and unpermute is the gather's adjoint (its backward), with drops and idle experts ---- */
static void permute_case(int N, int X, int k, int E, int cap) {
    int *idx = xmalloc((size_t)N * k * sizeof(int));
    float *gate = randf((size_t)N * k, 1.0f), *x = randf((size_t)N * E, 1.0f);
    for (int n = 0; n < N; n++)
        for (int j = 0; j < k; j++) idx[(size_t)n * k + j] = (n % 2 + j * 2) % X;  /* experts >= 4 idle */
    Disp d = dispatch(idx, gate, N, k, X, cap);
    int P = d.cnt[3 * X];
    float *xs = xmalloc(((size_t)P + 1) * E * 4), *back = xmalloc((size_t)N * E * 4);
    op_gather_rows(xs, x, d.rowtok, (size_t)P, (size_t)E * 4);
    op_moe_unpermute(back, xs, d.pos, N, k, E, 0);
    int ok = 1;
    for (int n = 0; n < N; n++) {
        int copies = 0;
        for (int j = 0; j < k; j++) copies += d.pos[n * k + j] >= 0;
        for (int c = 0; c < E; c++) ok &= back[(size_t)n * E + c] == copies * x[(size_t)n * E + c];
    }
    CHECK(ok, "unpermute(permute(x)) = copies x, N=%d X=%d k=%d capacity=%d", N, X, k, cap);
    /* <unpermute(dy), x> = <dy, permute(x)> */
    float *dy = randf((size_t)P * E + 1, 1.0f);
    op_moe_unpermute(back, dy, d.pos, N, k, E, 0);
    double a = 0, b = 0;
    for (size_t i = 0; i < (size_t)N * E; i++) a += (double)back[i] * x[i];
    for (size_t i = 0; i < (size_t)P * E; i++) b += (double)dy[i] * xs[i];
    CHECK(fabs(a - b) < 1e-5 * fmax(1, fabs(b)), "adjoint %.9g vs %.9g", a, b);
    /* acc = 1 adds */
    float *acc = randf((size_t)N * E, 1.0f), *acc0 = xmalloc((size_t)N * E * 4);
    memcpy(acc0, acc, (size_t)N * E * 4);
    op_moe_unpermute(acc, dy, d.pos, N, k, E, 1);
    double e = 0;
    for (size_t i = 0; i < (size_t)N * E; i++) e = fmax(e, fabs(acc[i] - acc0[i] - back[i]));
    CHECK(e < 1e-5, "unpermute acc=1 adds: %.3g", e);
    disp_free(&d);
    free(idx); free(gate); free(x); free(xs); free(back); free(dy); free(acc); free(acc0);
}

static void test_permute_unpermute(void) {
    permute_case(24, 8, 2, 12, 0);
    permute_case(24, 8, 2, 12, 7);
    permute_case(5, 4, 1, 8, 0);
}

/* ---- combine, and the gate's backward, against double references ---- */
static void test_combine_and_gates(void) {
    int N = 19, X = 5, k = 2, E = 10, H = 7;
    int *idx = xmalloc((size_t)N * k * sizeof(int));
    for (int n = 0; n < N; n++) idx[n * k] = n % X, idx[n * k + 1] = (n + 2) % X;
    float *gate = randf((size_t)N * k, 1.0f);
    Disp d = dispatch(idx, gate, N, k, X, 3);  /* some dropped */
    int P = d.cnt[3 * X];
    float *ys = randf((size_t)P * E, 1.0f), *out = randf((size_t)N * E, 1.0f), *want = xmalloc((size_t)N * E * 4);
    for (int n = 0; n < N; n++)
        for (int c = 0; c < E; c++) {
            double s = 0;
            for (int j = 0; j < k; j++)
                if (d.pos[n * k + j] >= 0) s += (double)gate[n * k + j] * ys[(size_t)d.pos[n * k + j] * E + c];
            want[(size_t)n * E + c] = (float)(out[(size_t)n * E + c] + s);
        }
    op_moe_combine(out, ys, gate, d.pos, N, k, E);
    CHECK(norm_rel_err(out, want, (size_t)N * E) < 1e-6, "combine %.3g", norm_rel_err(out, want, (size_t)N * E));
    float *h = randf((size_t)P * H, 1.0f), *dh = randf((size_t)P * H, 1.0f), *dg = xmalloc((size_t)P * 4);
    float *h0 = xmalloc((size_t)P * H * 4), *dh0 = xmalloc((size_t)P * H * 4);
    memcpy(h0, h, (size_t)P * H * 4), memcpy(dh0, dh, (size_t)P * H * 4);
    op_moe_gate_backward(dg, h, dh, d.grow, P, H);
    double e = 0;
    for (int p = 0; p < P; p++) {
        double dot = 0;
        for (int i = 0; i < H; i++) {
            dot += (double)h0[(size_t)p * H + i] * dh0[(size_t)p * H + i];
            e = fmax(e, fabs(h[(size_t)p * H + i] - d.grow[p] * h0[(size_t)p * H + i]));
            e = fmax(e, fabs(dh[(size_t)p * H + i] - d.grow[p] * dh0[(size_t)p * H + i]));
        }
        e = fmax(e, fabs(dg[p] - dot) / fmax(1, fabs(dot)));
    }
    CHECK(e < 1e-6, "gate backward %.3g", e);
    disp_free(&d);
    free(idx); free(gate); free(ys); free(out); free(want); free(h); free(dh); free(dg); free(h0); free(dh0);
}

/* ---- the router's backward: d/d(logits) of sum_p c_p gate_rows[p] + aux_scale sum_e
 * stats[e] sum_n s_hat[n, e] + z_scale / 2 sum_n lse[n]^2, against central differences of
 * the double reference (the choices fixed: the spread keeps them from flipping) ---- */
typedef struct { int N, X, k, sigmoid; const int *pos; const float *c, *stats; double aux_scale, z_scale; } RbCtx;

static double rb_loss(const double *z, const RbCtx *q) {
    RefRoute r = ref_alloc(q->N, q->X, q->k);
    ref_route(&r, z, NULL, q->N, q->X, q->k, q->sigmoid);
    double L = 0;
    for (int n = 0; n < q->N; n++) {
        const double *s = r.s + (size_t)n * q->X;
        double sum = 0;
        for (int e = 0; e < q->X; e++) sum += s[e];
        for (int e = 0; e < q->X; e++) L += q->aux_scale * q->stats[e] * s[e] / sum;
        for (int j = 0; j < q->k; j++) {
            int p = q->pos[n * q->k + j];
            if (p >= 0) L += q->c[p] * r.gate[n * q->k + j];
        }
        L += q->z_scale / 2 * r.lse[n] * r.lse[n];
    }
    ref_free(&r);
    return L;
}

static void route_backward_case(int N, int X, int k, int sigmoid, int cap) {
    float *z = xmalloc((size_t)N * X * 4);
    for (int n = 0; n < N; n++)  /* distinct values 0.3 apart, shuffled per row */
        for (int e = 0; e < X; e++) z[n * X + e] = 0.3f * (float)((e * 7 + n * 3) % X) - 0.4f * X / 4;
    float *probs = xmalloc((size_t)N * X * 4), *gate = xmalloc((size_t)N * k * 4), *lse = xmalloc((size_t)N * 4);
    int *idx = xmalloc((size_t)N * k * sizeof(int));
    op_moe_topk(probs, idx, gate, lse, z, NULL, N, X, k, sigmoid);
    Disp d = dispatch(idx, gate, N, k, X, cap);
    int P = d.cnt[3 * X];
    float *c = randf((size_t)P + 1, 1.0f), *stats = randf((size_t)2 * X + 2, 1.0f), *dz = xmalloc((size_t)N * X * 4);
    RbCtx q = {N, X, k, sigmoid, d.pos, c, stats, 0.7, 0.3};
    op_moe_route_backward(dz, c, d.pos, z, probs, idx, gate, lse, stats, (float)q.aux_scale, (float)q.z_scale, N, X, k,
                          sigmoid);
    double *zd = xmalloc((size_t)N * X * 8), worst = 0;
    for (size_t i = 0; i < (size_t)N * X; i++) zd[i] = z[i];
    for (size_t i = 0; i < (size_t)N * X; i++) {
        double h = 1e-5, v = zd[i];
        zd[i] = v + h;
        double lp = rb_loss(zd, &q);
        zd[i] = v - h;
        double lm = rb_loss(zd, &q);
        zd[i] = v;
        double g = (lp - lm) / (2 * h);
        worst = fmax(worst, fabs(dz[i] - g) / fmax(1e-3, fabs(g)));
    }
    CHECK(worst < 1e-4, "route backward N=%d X=%d k=%d sigmoid=%d capacity=%d: worst rel err %.3g", N, X, k, sigmoid,
          cap, worst);
    disp_free(&d);
    free(z); free(probs); free(gate); free(lse); free(idx); free(c); free(stats); free(dz); free(zd);
}

static void test_route_backward(void) {
    route_backward_case(6, 4, 2, 0, 0);
    route_backward_case(6, 4, 2, 1, 0);
    route_backward_case(8, 8, 3, 0, 2);
    route_backward_case(5, 8, 1, 1, 0);
    route_backward_case(4, 1, 1, 0, 0);
}

/* ---- the load-balancing loss: 1 for a uniform router, the expert count when every token
 * goes to one expert ---- */
static void test_aux_values(void) {
    int N = 64, X = 4;
    for (int k = 1; k <= 2; k++) {
        float *probs = xmalloc((size_t)N * X * 4), *lse = xcalloc((size_t)N, 4), stats[2 * 4 + 2], acc[4 + 3] = {0};
        int cnt[3 * 4 + 1] = {0};
        for (size_t i = 0; i < (size_t)N * X; i++) probs[i] = 1.0f / X;
        for (int e = 0; e < X; e++) cnt[e] = cnt[X + e] = N * k / X;
        op_moe_stats(stats, cnt, probs, lse, N, X);
        op_moe_accumulate(acc, stats, N, X, k);
        CHECK(acc[X] == 1.0f, "uniform routing, top %d: aux %.9g", k, acc[X]);
        CHECK(acc[X + 2] == (float)(N * k), "kept %.0f", acc[X + 2]);
        free(probs); free(lse);
    }
    float *probs = xcalloc((size_t)N * X, 4), *lse = xcalloc((size_t)N, 4), stats[2 * 4 + 2], acc[4 + 3] = {0};
    int cnt[3 * 4 + 1] = {0};
    for (int n = 0; n < N; n++) probs[(size_t)n * X] = 1.0f, lse[n] = 2.0f;
    cnt[0] = cnt[X] = N;  /* top 1, every token to expert 0 */
    op_moe_stats(stats, cnt, probs, lse, N, X);
    op_moe_accumulate(acc, stats, N, X, 1);
    CHECK(acc[X] == (float)X, "one expert: aux %.9g, want %d", acc[X], X);
    CHECK(acc[X + 1] == 4.0f, "z-loss %.9g, want 4", acc[X + 1]);
    CHECK(acc[0] == (float)N && acc[1] == 0, "loads %.0f %.0f", acc[0], acc[1]);
    free(probs); free(lse);
}

/* ---- whole models ---- */

static void random_weights(Model *m, float scale) {
    for (size_t i = 0; i < m->n_flat; i++) m->params[i] = scale * rng_normal(&rng);
}

static void random_batch(Acts *a, int V) {
    for (size_t i = 0; i < a->N; i++) a->inputs[i] = (int)(rng_u64(&rng) % (uint64_t)V), a->targets[i] = (int)(rng_u64(&rng) % (uint64_t)V);
}

/* The tensor of m named `name` (NULL: none). */
static const TensorInfo *tensor(const Model *m, TensorInfo *t, int n, const char *name) {
    (void)m;
    for (int i = 0; i < n; i++)
        if (!strcmp(t[i].name, name)) return &t[i];
    return NULL;
}

/* The one-expert model's name of a dense model's tensor: its FFN's are expert 0's. */
static void expert0_name(char *out, size_t len, const char *dense) {
    int l;
    char rest[64];
    if (sscanf(dense, "blocks.%d.ffn.%63s", &l, rest) == 2) snprintf(out, len, "blocks.%d.ffn.experts.0.%s", l, rest);
    else snprintf(out, len, "%s", dense);
}

/* One expert, top 1, of the dense FFN's width: its gate is 1, so the layer is the dense one:
 * the same loss, and every gradient the same (the router's is zero). */
static void test_one_expert_is_dense(void) {
    ModelConfig cd = {97, 32, 4, 2, 8, 0, 0, 2, 0, 0, 1, 0, 0}, cm = cd;
    cm.moe_experts = 1, cm.moe_top_k = 1, cm.moe_expert_dim = 48;  /* 1.5 x 32 */
    Model d, m;
    model_init_layout(&d, &cd, 1, 1);
    model_init_layout(&m, &cm, 1, 1);
    random_weights(&d, 0.1f);
    int nd = model_n_tensors(&cd), nm = model_n_tensors(&cm);
    TensorInfo *td = xmalloc((size_t)nd * sizeof *td), *tm = xmalloc((size_t)nm * sizeof *tm);
    model_tensors(&d, td, nd), model_tensors(&m, tm, nm);
    /* the dense model's tensors into the MoE model's places */
    char name[96];
    for (int i = 0; i < nd; i++) {
        const char *n = td[i].name;
        expert0_name(name, sizeof name, n);
        const TensorInfo *t = tensor(&m, tm, nm, name);
        CHECK(t && t->rows == td[i].rows && t->cols == td[i].cols, "%s has no place %s", n, name);
        if (t) memcpy(m.params + t->offset, d.params + td[i].offset, (size_t)t->rows * t->cols * 4);
    }
    for (int l = 0; l < 2; l++) {  /* any router: its one score is 1 */
        snprintf(name, sizeof name, "blocks.%d.ffn.router.weight", l);
        const TensorInfo *t = tensor(&m, tm, nm, name);
        for (int c = 0; c < t->cols; c++) m.params[t->offset + c] = 0.3f * rng_normal(&rng);
    }
    Acts ad, am;
    acts_alloc(&ad, &d, 2, 8, 1);
    acts_alloc(&am, &m, 2, 8, 1);
    random_batch(&ad, 97);
    memcpy(am.inputs, ad.inputs, ad.N * sizeof(int)), memcpy(am.targets, ad.targets, ad.N * sizeof(int));
    model_moe_set_training(&m, 0.01f, 0.0f, 0.0f);  /* (one expert: the load-balancing loss is constant) */
    float ld = model_step(&d, &ad, 1, 1.0f, NULL), lm = model_step(&m, &am, 1, 1.0f, NULL);
    CHECK(rel_err(ld, lm) < 1e-6, "loss dense %.7f vs one expert %.7f", ld, lm);
    for (int i = 0; i < nd; i++) {
        const char *n = td[i].name;
        expert0_name(name, sizeof name, n);
        const TensorInfo *t = tensor(&m, tm, nm, name);
        double e = norm_rel_err(m.grads + t->offset, d.grads + td[i].offset, (size_t)t->rows * t->cols);
        CHECK(e < 1e-5, "gradient of %s: rel err %.3g", name, e);
    }
    for (int l = 0; l < 2; l++) {
        snprintf(name, sizeof name, "blocks.%d.ffn.router.weight", l);
        const TensorInfo *t = tensor(&m, tm, nm, name);
        double s = 0;
        for (int c = 0; c < t->cols; c++) s += fabs(m.grads[t->offset + c]);
        CHECK(s == 0, "router gradient %.3g, want 0", s);
    }
    acts_free(&ad), acts_free(&am);
    model_free(&d), model_free(&m);
    free(td), free(tm);
}

/* A capacity no expert can reach (factor X / k: every expert may take all N tokens) is
 * dropless: bitwise the same loss and gradients. */
static void test_dropless_is_unlimited_capacity(void) {
    ModelConfig c = {97, 32, 4, 2, 8, 0, 4, 2, 16, 1, 1, 0, 0}, cc = c;
    cc.moe_capacity_factor = 2.0f;  /* 4 experts / top 2 */
    Model a, b;
    model_init_layout(&a, &c, 1, 1);
    model_init_layout(&b, &cc, 1, 1);
    random_weights(&a, 0.1f);
    memcpy(b.params, a.params, a.n_flat * 4);
    Acts xa, xb;
    acts_alloc(&xa, &a, 2, 8, 1);
    acts_alloc(&xb, &b, 2, 8, 1);
    random_batch(&xa, 97);
    memcpy(xb.inputs, xa.inputs, xa.N * sizeof(int)), memcpy(xb.targets, xa.targets, xa.N * sizeof(int));
    model_moe_set_training(&a, 0.01f, 0.001f, 0.0f), model_moe_set_training(&b, 0.01f, 0.001f, 0.0f);
    CHECK(model_moe_capacity(&cc, 16) == 16, "capacity %d", model_moe_capacity(&cc, 16));
    float la = model_step(&a, &xa, 1, 1.0f, NULL), lb = model_step(&b, &xb, 1, 1.0f, NULL);
    CHECK(la == lb && !memcmp(a.grads, b.grads, a.n_flat * 4), "loss %.7f vs %.7f, gradients %s", la, lb,
          memcmp(a.grads, b.grads, a.n_flat * 4) ? "differ" : "same");
    /* a capacity that binds drops choices: another loss */
    cc.moe_capacity_factor = 0.5f;
    Model s;
    model_init_layout(&s, &cc, 1, 1);
    memcpy(s.params, a.params, a.n_flat * 4);
    Acts xs;
    acts_alloc(&xs, &s, 2, 8, 1);
    memcpy(xs.inputs, xa.inputs, xa.N * sizeof(int)), memcpy(xs.targets, xa.targets, xa.N * sizeof(int));
    float ls = model_step(&s, &xs, 0, 0.0f, NULL);
    CHECK(ls != la, "a binding capacity changes the loss (%.7f)", ls);
    acts_free(&xa), acts_free(&xb), acts_free(&xs);
    model_free(&a), model_free(&b), model_free(&s);
}

/* The whole loss, cross-entropy + aux_w x (the layers' load-balancing losses) + z_w x (their
 * z-losses), of one batch: model_step's cross-entropy and the step's statistics. */
static double total_loss(Model *m, Acts *a, double aux_w, double z_w) {
    float *st = xcalloc((size_t)m->n_moe * (m->X + 3), 4);
    model_moe_take_stats(m, st);  /* (zeroes what an earlier step left) */
    double L = model_step(m, a, 1, 1.0f, NULL);  /* (a training forward: the statistics are its) */
    model_moe_take_stats(m, st);
    for (int i = 0; i < m->n_moe; i++) L += aux_w * st[i * (m->X + 3) + m->X] + z_w * st[i * (m->X + 3) + m->X + 1];
    free(st);
    return L;
}

/* Central differences of the whole loss through attention, router, shared and routed experts,
 * at parameters sampled from each kind of tensor (a sample whose step moves a token between
 * experts is skipped: the loss is not differentiable there). */
static void fd_case(int sigmoid, int shared, int every) {
    ModelConfig c = {61, 16, 2, 2, 6, 0, 4, 2, 8, shared, every, sigmoid, 0};
    Model m;
    model_init_layout(&m, &c, 1, 1);
    model_moe_alloc(&m, 0);
    random_weights(&m, 0.3f);
    double aux_w = 0.5, z_w = 0.05;  /* large: their gradients must show */
    model_moe_set_training(&m, (float)aux_w, (float)z_w, 0.0f);
    Acts a;
    acts_alloc(&a, &m, 2, 6, 1);
    random_batch(&a, 61);
    memset(m.grads, 0, m.n_flat * 4);
    total_loss(&m, &a, aux_w, z_w);
    float *g = xmalloc(m.n_flat * 4);
    memcpy(g, m.grads, m.n_flat * 4);
    int nt = model_n_tensors(&c);
    TensorInfo *t = xmalloc((size_t)nt * sizeof *t);
    model_tensors(&m, t, nt);
    size_t ni = (size_t)m.n_moe * a.N * 2;  /* every MoE layer's choices */
    int *idx0 = xmalloc(ni * sizeof(int)), *idx1 = xmalloc(ni * sizeof(int));
    int checked = 0, skipped = 0;
    float fd[256] = {0}, an[256] = {0};
    double worst = 0;
    const char *worst_at = "";
    for (int i = 0; i < nt; i++) {
        if (!strstr(t[i].name, "blocks.1.") && !strstr(t[i].name, "blocks.0.qkv")) continue;
        for (int s = 0; s < 3; s++) {
            size_t j = t[i].offset + rng_u64(&rng) % ((size_t)t[i].rows * t[i].cols);
            float v = m.params[j], h = 1e-2f;
            m.params[j] = v + h;
            double lp = total_loss(&m, &a, aux_w, z_w);
            memcpy(idx0, a.moe_idx, ni * sizeof(int));
            m.params[j] = v - h;
            double lm = total_loss(&m, &a, aux_w, z_w);
            memcpy(idx1, a.moe_idx, ni * sizeof(int));
            m.params[j] = v;
            if (memcmp(idx0, idx1, ni * sizeof(int))) { skipped++; continue; }
            /* fp32 losses: a difference is good to about 1e-6 / h = 1e-4 absolute, so each sample's
             * error is relative to its size but floored at 1e-2 (2e-4 absolute at the bound below:
             * twice that noise, which an element near 0 reaches on some BLAS builds); a wrong
             * gradient is off by about its own size */
            double num = (lp - lm) / (2.0 * h), err = fabs(num - g[j]) / (fabs(num) + 1e-2);
            fd[checked] = num, an[checked] = g[j];
            checked++;
            if (err > worst) worst = err, worst_at = t[i].name;
        }
    }
    double all = norm_rel_err(an, fd, (size_t)checked);
    CHECK(checked > 20 && worst < 2e-2 && all < 5e-3, "sigmoid=%d shared=%d every=%d: %d checked (%d skipped), "
          "norm-wise rel err %.3g, worst %.3g at %s", sigmoid, shared, every, checked, skipped, all, worst, worst_at);
    free(g); free(t); free(idx0); free(idx1);
    acts_free(&a);
    model_free(&m);
}

static void test_finite_differences(void) {
    fd_case(0, 1, 1);
    fd_case(1, 0, 1);
    fd_case(0, 0, 2);
}

/* The benchmarks' variants of the post's model (embed_dim 1024, 16 layers): total and active
 * parameters. A: 16 experts of 512, top 2, one shared: 598M total, 246M active. */
static void test_param_counts(void) {
    ModelConfig a = {50257, 1024, 8, 16, 256, 0, 16, 2, 512, 1, 1, 0, 0}, dense = a;
    dense.moe_experts = 0;
    CHECK(model_param_count(&a) == 598150144, "A: %zu", model_param_count(&a));
    CHECK(model_active_param_count(&a) == 245828608, "A active: %zu", model_active_param_count(&a));
    CHECK(model_param_count(&dense) == 245566464 && model_active_param_count(&dense) == 245566464, "dense");
    ModelConfig b = {50257, 1024, 8, 16, 256, 0, 8, 2, 768, 0, 1, 0, 0}, cc = {50257, 1024, 8, 16, 256, 0, 64, 6, 256, 0, 1, 0, 0};
    /* each of B's and C's tokens computes with 1.5 E of expert width, as the dense model */
    size_t router_b = 16 * (size_t)8 * 1024, router_c = 16 * (size_t)64 * 1024;
    CHECK(model_active_param_count(&b) == 245566464 + router_b, "B active: %zu", model_active_param_count(&b));
    CHECK(model_active_param_count(&cc) == 245566464 + router_c, "C active: %zu", model_active_param_count(&cc));
    ModelConfig half = a;
    half.moe_every = 2;  /* layers 1, 3, ..., 15 */
    CHECK(model_layer_is_moe(&half, 1) && !model_layer_is_moe(&half, 0) && model_moe_layers_before(&half, 16) == 8,
          "every 2");
    CHECK(model_n_tensors(&a) == 3 + 16 * (5 + 3 * 16 + 3), "tensors %d", model_n_tensors(&a));
}

/* ---- against the PyTorch reference (tests/gen_moe_fixture.py: its MoE model in fp32, its
 * loop over experts): the cross-entropy and the load-balancing loss, every gradient of their
 * weighted sum, and 5 AdamW steps with clipping. The fixture is made on a machine with torch;
 * where it is not there yet the test is not run, and says so. ---- */
static void test_against_torch(void) {
    const char *path = "tests/fixtures/moe_small.bin";
    char err[256];
    size_t len;
    char *buf = read_file(path, &len, err, sizeof err);
    CHECK(buf, "%s", err);
    if (!buf) return;
    int32_t h[14];
    float aux_w;
    CHECK(len > sizeof h + 4, "%s: too short", path);
    if (len <= sizeof h + 4) { free(buf); return; }
    memcpy(h, buf, sizeof h);
    memcpy(&aux_w, buf + sizeof h, 4);
    CHECK(h[0] == 0x454F4D4D && h[1] == 1, "%s: not a MoE fixture", path);
    ModelConfig c = {h[2], h[3], h[4], h[5], h[6], 0, h[8], h[9], h[10], h[11], 1, 0, 0};
    int B = h[7], T = h[6], V = h[2], steps = h[12];
    Model m;
    model_init_layout(&m, &c, 3, 1);  /* odd padding: the layout must not matter */
    model_moe_alloc(&m, 0);
    model_moe_set_training(&m, aux_w, 0.0f, 0.0f);
    size_t np = m.n_params, nt = (size_t)steps * B * (T + 1), nl = (size_t)B * T * V;
    size_t want = sizeof h + 4 + nt * 4 + (3 * np + nl + 2 + (size_t)steps) * 4;
    CHECK(len == want, "%s: %zu bytes, want %zu", path, len, want);
    if (len != want) { free(buf); model_free(&m); return; }
    const char *p = buf + sizeof h + 4;
    const int *tokens = (const int *)p;
    p += nt * 4;
    int n = model_n_tensors(&c);
    TensorInfo *t = xmalloc((size_t)n * sizeof *t);
    model_tensors(&m, t, n);
    /* packed (the fixture's model order) into the flat layout */
#define SCATTER(dst, src)                                                                   \
    do {                                                                                    \
        const float *q_ = (const float *)(src);                                             \
        for (int i = 0; i < n; i++) {                                                       \
            size_t k_ = (size_t)t[i].rows * t[i].cols;                                       \
            memcpy((dst) + t[i].offset, q_, k_ * 4);                                        \
            q_ += k_;                                                                       \
        }                                                                                   \
    } while (0)
    const char *p0 = p, *logits = p + np * 4, *grads = logits + nl * 4 + 8, *step_losses = grads + np * 4;
    const char *final = step_losses + (size_t)steps * 4;
    float ce, aux;
    memcpy(&ce, logits + nl * 4, 4);
    memcpy(&aux, logits + nl * 4 + 4, 4);
    SCATTER(m.params, p0);
    Acts a;
    acts_alloc(&a, &m, B, T, 1);
    float *st = xcalloc((size_t)m.n_moe * (m.X + 3), 4), *want_g = xaligned_alloc(m.n_flat * 4);
    for (int b = 0; b < B; b++)
        for (int i = 0; i < T; i++)
            a.inputs[b * T + i] = tokens[b * (T + 1) + i], a.targets[b * T + i] = tokens[b * (T + 1) + i + 1];
    memset(m.grads, 0, m.n_flat * 4);
    float loss = model_step(&m, &a, 1, 1.0f, NULL);
    model_moe_take_stats(&m, st);
    double maux = 0;
    for (int i = 0; i < m.n_moe; i++) maux += st[i * (m.X + 3) + m.X];
    CHECK(rel_err(loss, ce) < 1e-5, "cross-entropy %.7f vs torch %.7f", loss, ce);
    CHECK(rel_err(maux, aux) < 1e-5, "load-balancing loss %.7f vs torch %.7f", maux, aux);
    SCATTER(want_g, grads);
    for (int i = 0; i < n; i++) {
        double e = norm_rel_err(m.grads + t[i].offset, want_g + t[i].offset, (size_t)t[i].rows * t[i].cols);
        CHECK(e < 1e-4, "gradient of %s: rel err %.3g", t[i].name, e);
    }
    /* 5 AdamW steps as torch: lr 1e-3, wd 0.01, clip 1.0 */
    SCATTER(m.params, p0);
    OptimConfig oc = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01, .grad_clip = 1.0,
                      .decay_steps = steps};
    OptimUnit *units = xcalloc((size_t)m.n_units, sizeof *units);
    for (int u = 0; u < m.n_units; u++) units[u] = (OptimUnit){unit_params(&m, u), unit_grads(&m, u), NULL};
    Optimizer *opt = optim_create(&(OptimSetup){&oc, &m, 1, 0, 0, 0, units});
    free(units);
    for (int s = 0; s < steps; s++) {
        const int *tk = tokens + (size_t)s * B * (T + 1);
        for (int b = 0; b < B; b++)
            for (int i = 0; i < T; i++)
                a.inputs[b * T + i] = tk[b * (T + 1) + i], a.targets[b * T + i] = tk[b * (T + 1) + i + 1];
        memset(m.grads, 0, m.n_flat * 4);
        float l = model_step(&m, &a, 1, 1.0f, NULL), want_l;
        memcpy(&want_l, step_losses + (size_t)s * 4, 4);
        CHECK(rel_err(l, want_l) < 1e-4, "step %d loss %.7f vs torch %.7f", s + 1, l, want_l);
        optim_begin(opt, &oc);
        optim_update(opt, 0, m.n_units, clip_scale(&oc, grad_norm(m.grads, m.n_flat)));
    }
    SCATTER(want_g, final);
    double pe = norm_rel_err(m.params, want_g, m.n_flat);
    CHECK(pe < 1e-4, "parameters after %d steps: rel err %.3g", steps, pe);
#undef SCATTER
    optim_free(opt);
    free(st); free(want_g); free(t); free(buf);
    acts_free(&a);
    model_free(&m);
}

int main(void) {
    rng_seed(&rng, 7);
    ops_init("cpu", 2, NULL, 0);
    RUN(test_topk);
    RUN(test_dispatch);
    RUN(test_permute_unpermute);
    RUN(test_combine_and_gates);
    RUN(test_route_backward);
    RUN(test_aux_values);
    RUN(test_one_expert_is_dense);
    RUN(test_dropless_is_unlimited_capacity);
    RUN(test_finite_differences);
    RUN(test_param_counts);
    if (access("tests/fixtures/moe_small.bin", R_OK) == 0) RUN(test_against_torch);
    else printf("skip test_against_torch (no tests/fixtures/moe_small.bin: python3 tests/gen_moe_fixture.py makes it "
                "where torch is)\n");
    return TEST_SUMMARY();
}
