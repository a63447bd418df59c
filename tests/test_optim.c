/* The optimizer layer (src/optim) through its interface, over the flat units of a tiny model
 * (vocab 13, embed_dim 8, 2 heads, 1 layer) and over D emulated ranks that each update their
 * shard of every unit, their statistics summed between the ranks as a strategy sums them:
 * - AdamW against a plain double-precision reference of PyTorch's update (weight decay, a
 *   warmup and cosine schedule, a clip scale); one call, in parts, and over 2 and 4 shards
 *   bitwise alike; its host placement (offload, the update thread) bitwise the device's;
 * - Adafactor against a float64 reference of HF's (tests/gen_adafactor_fixture.py writes
 *   tests/fixtures/adafactor.bin for this model's tensors), in one process and over 4
 *   shards that cut rows; its host placement bitwise the device's;
 * - the learning-rate schedule and clipping; offload's bf16-gradient AdamW against adamw. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "adafactor.h"
#include "model.h"
#include "ops.h"
#include "optim.h"
#include "test.h"
#include "util.h"

static const ModelConfig TINY = MODEL_CONFIG(13, 8, 2, 1, 16, 0);
#define MAX_RANKS 4
#define MAX_TENSORS 16

static void test_schedule(void) {
    OptimConfig c = {.lr = 1.0, .min_lr = 0.1, .warmup_steps = 4, .decay_steps = 14, .cosine = 1};
    CHECK(fabs(lr_at(&c, 0) - 0.25) < 1e-12, "warmup step 0: %g", lr_at(&c, 0));
    CHECK(fabs(lr_at(&c, 3) - 1.0) < 1e-12, "end of warmup: %g", lr_at(&c, 3));
    CHECK(fabs(lr_at(&c, 4) - 1.0) < 1e-12, "cosine start: %g", lr_at(&c, 4));
    CHECK(fabs(lr_at(&c, 9) - 0.55) < 1e-12, "cosine midpoint: %g", lr_at(&c, 9));
    CHECK(fabs(lr_at(&c, 14) - 0.1) < 1e-12, "cosine end: %g", lr_at(&c, 14));
    CHECK(fabs(lr_at(&c, 20) - 0.1) < 1e-12, "after the end: %g", lr_at(&c, 20));
    for (int s = 4; s < 14; s++) CHECK(lr_at(&c, s + 1) <= lr_at(&c, s), "monotone at %d", s);
    c.cosine = 0;
    CHECK(fabs(lr_at(&c, 10) - 1.0) < 1e-12, "constant");
    c.warmup_steps = 0;
    CHECK(fabs(lr_at(&c, 0) - 1.0) < 1e-12, "no warmup");
}

static void test_clip(void) {
    OptimConfig c = {.grad_clip = 1.0};
    CHECK(clip_scale(&c, 0.5) == 1.0f, "below the bound");
    CHECK(fabs(clip_scale(&c, 4.0) - 0.25) < 1e-6, "above: %g", clip_scale(&c, 4.0));
    c.grad_clip = 0;
    CHECK(clip_scale(&c, 1e9) == 1.0f, "off");
    float g[3] = {3, 4, 0};
    CHECK(fabs(grad_norm(g, 3) - 5.0) < 1e-12, "norm");
}

/* ---- D emulated ranks of one layout ---- */

/* The tiny model laid out for D ranks; rank r updates its shard of every unit (D = 1: the
 * whole units) from its own flat buffers of parameters and gradients, the shards of the
 * units one after another as FSDP keeps them. */
typedef struct {
    Model m;
    int D;
    Optimizer *opt[MAX_RANKS];
    float *param[MAX_RANKS], *grad[MAX_RANKS];
    TensorInfo t[MAX_TENSORS];
    int nt;
} Ranks;

static void ranks_init(Ranks *R, int D, const OptimConfig *oc) {
    memset(R, 0, sizeof *R);
    R->D = D;
    model_init_layout(&R->m, &TINY, D, 0);
    R->nt = model_tensors(&R->m, R->t, MAX_TENSORS);
    size_t n = R->m.n_flat / (size_t)D;
    OptimUnit *units = calloc((size_t)R->m.n_units, sizeof *units);
    for (int r = 0; r < D; r++) {
        R->param[r] = calloc(n, sizeof(float));
        R->grad[r] = calloc(n, sizeof(float));
        for (int u = 0; u < R->m.n_units; u++) {
            size_t at = R->m.units[u].offset / (size_t)D;
            units[u] = (OptimUnit){R->param[r] + at, R->grad[r] + at, NULL};
        }
        OptimSetup s = {oc, &R->m, D, r, D > 1, 0, units};
        R->opt[r] = optim_create(&s);
    }
    free(units);
}

static void ranks_free(Ranks *R) {
    for (int r = 0; r < R->D; r++) {
        optim_free(R->opt[r]);
        free(R->param[r]);
        free(R->grad[r]);
    }
    model_free(&R->m);
}

/* Element j of tensor k of the layout: which rank's buffer holds it, and where. */
static float *ranks_elem(Ranks *R, float **bufs, int k, size_t j) {
    const Unit *un = &R->m.units[R->t[k].unit];
    size_t local = R->t[k].offset - un->offset + j, len = un->n_padded / (size_t)R->D;
    return bufs[local / len] + un->offset / (size_t)R->D + local % len;
}

/* Tensor by tensor, in model_tensors' order (the fixture's): values[] into the ranks'
 * buffers (to = 1), or out of them. */
static void ranks_copy(Ranks *R, float **bufs, float *values, int to) {
    size_t at = 0;
    for (int k = 0; k < R->nt; k++)
        for (size_t j = 0; j < (size_t)R->t[k].rows * R->t[k].cols; j++, at++) {
            float *e = ranks_elem(R, bufs, k, j);
            if (to) *e = values[at];
            else values[at] = *e;
        }
}

/* A step's gradients into the ranks' buffers (after the last step's copies of them are done:
 * the host placement's). */
static void ranks_grads(Ranks *R, float *g) {
    for (int r = 0; r < R->D; r++) optim_new_grads(R->opt[r]);
    ranks_copy(R, R->grad, g, 1);
}

static size_t tiny_params(void) {
    Ranks R;
    OptimConfig oc = {0};
    ranks_init(&R, 1, &oc);
    size_t n = R.m.n_params;
    ranks_free(&R);
    return n;
}

/* One step on every rank as a strategy runs it: begin, each statistics round summed over
 * the ranks in rank order and handed back to each, then the update of every unit (a rank's
 * shards are adjacent in its buffers), in `parts` calls split at unit boundaries. */
static void ranks_step(Ranks *R, const OptimConfig *oc, float scale, int parts) {
    for (int r = 0; r < R->D; r++) optim_begin(R->opt[r], oc);
    for (int k = 0; k < optim_stat_rounds(R->opt[0]); k++) {
        OptimSums s[MAX_RANKS];
        for (int r = 0; r < R->D; r++) s[r] = optim_stats(R->opt[r], k, scale);
        for (size_t i = 0; R->D > 1 && i < s[0].n; i++) {
            if (s[0].host) {
                double sum = 0;
                for (int r = 0; r < R->D; r++) sum += ((double *)s[r].buf)[i];
                for (int r = 0; r < R->D; r++) ((double *)s[r].buf)[i] = sum;
            } else {
                float sum = 0;
                for (int r = 0; r < R->D; r++) sum += ((float *)s[r].buf)[i];
                for (int r = 0; r < R->D; r++) ((float *)s[r].buf)[i] = sum;
            }
        }
        for (int r = 0; r < R->D; r++) optim_stats_summed(R->opt[r], k);
    }
    int U = R->m.n_units, cut = parts > 1 ? U / 2 : U;
    for (int r = 0; r < R->D; r++) {
        optim_update(R->opt[r], 0, cut, scale);
        optim_update(R->opt[r], cut, U, scale);
        optim_finish(R->opt[r]);
    }
}

static uint64_t rng_state = 12345;
static float uniform(void) {  /* in [-0.5, 0.5) */
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(rng_state >> 11) / 9007199254740992.0 - 0.5);
}

/* ---- AdamW ---- */

/* torch.optim.AdamW's step, in double: p *= 1 - lr wd; m, v; p -= lr m_hat / (sqrt(v_hat) + eps) */
static void adamw_ref(double *p, const float *g, double *m, double *v, size_t n, const OptimConfig *c, double lr, int t,
                      float scale) {
    double bc1 = 1 - pow(c->beta1, t), bc2 = 1 - pow(c->beta2, t);
    for (size_t i = 0; i < n; i++) {
        double gi = (double)g[i] * scale;
        m[i] = c->beta1 * m[i] + (1 - c->beta1) * gi;
        v[i] = c->beta2 * v[i] + (1 - c->beta2) * gi * gi;
        p[i] = p[i] * (1 - lr * c->weight_decay) - lr * (m[i] / bc1) / (sqrt(v[i] / bc2) + c->eps);
    }
}

#define ADAMW_STEPS 6

/* Runs the tiny model's AdamW for ADAMW_STEPS steps over D ranks (the step's update in
 * `parts` calls; offload: the host placement); into p, m, v (n_params each, tensor order). */
static void adamw_run(int D, int parts, int offload, float *p, float *m, float *v) {
    OptimConfig oc = {.lr = 1e-2, .min_lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1,
                      .warmup_steps = 2, .decay_steps = ADAMW_STEPS, .cosine = 1, .offload = offload};
    Ranks R;
    ranks_init(&R, D, &oc);
    size_t n = R.m.n_params;
    float *g = malloc(n * sizeof(float));
    rng_state = 777;
    for (size_t i = 0; i < n; i++) p[i] = uniform();
    ranks_copy(&R, R.param, p, 1);
    for (int r = 0; r < D; r++) optim_params_written(R.opt[r]);  /* (the host's master copy: from them) */
    for (int t = 1; t <= ADAMW_STEPS; t++) {
        for (size_t i = 0; i < n; i++) g[i] = 0.01f * uniform();
        ranks_grads(&R, g);
        ranks_step(&R, &oc, t == 3 ? 0.37f : 1.0f, parts);
    }
    ranks_copy(&R, R.param, p, 0);
    float *mb[MAX_RANKS], *vb[MAX_RANKS];
    for (int r = 0; r < D; r++) mb[r] = optim_moment(R.opt[r], 0), vb[r] = optim_moment(R.opt[r], 1);
    ranks_copy(&R, mb, m, 0);
    ranks_copy(&R, vb, v, 0);
    CHECK(optim_steps(R.opt[0]) == ADAMW_STEPS && optim_tensor_state_count(R.opt[0]) == 0,
          "steps %d, per-tensor state %zu", optim_steps(R.opt[0]), optim_tensor_state_count(R.opt[0]));
    free(g);
    ranks_free(&R);
}

static void test_adamw(void) {
    size_t n = tiny_params();
    float *p = malloc(n * 4), *m = malloc(n * 4), *v = malloc(n * 4), *p2 = malloc(n * 4), *m2 = malloc(n * 4),
          *v2 = malloc(n * 4), *g = malloc(n * 4);
    double *rp = malloc(n * 8), *rm = calloc(n, 8), *rv = calloc(n, 8);
    OptimConfig oc = {.lr = 1e-2, .min_lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1,
                      .warmup_steps = 2, .decay_steps = ADAMW_STEPS, .cosine = 1};
    /* the reference, on the same values */
    rng_state = 777;
    for (size_t i = 0; i < n; i++) rp[i] = uniform();
    for (int t = 1; t <= ADAMW_STEPS; t++) {
        for (size_t i = 0; i < n; i++) g[i] = 0.01f * uniform();
        adamw_ref(rp, g, rm, rv, n, &oc, lr_at(&oc, t - 1), t, t == 3 ? 0.37f : 1.0f);
    }
    adamw_run(1, 1, OFFLOAD_NONE, p, m, v);
    double ep = 0, em = 0, ev = 0, dp = 0, dm = 0, dv = 0;
    for (size_t i = 0; i < n; i++) {
        ep += (p[i] - rp[i]) * (p[i] - rp[i]), dp += rp[i] * rp[i];
        em += (m[i] - rm[i]) * (m[i] - rm[i]), dm += rm[i] * rm[i];
        ev += (v[i] - rv[i]) * (v[i] - rv[i]), dv += rv[i] * rv[i];
    }
    CHECK(sqrt(ep / dp) < 1e-6 && sqrt(em / dm) < 1e-5 && sqrt(ev / dv) < 1e-5,
          "against the reference: params %.3g, m %.3g, v %.3g", sqrt(ep / dp), sqrt(em / dm), sqrt(ev / dv));
    /* elementwise: in parts, over shards, and on the host's thread it is the same update */
    const struct { int D, parts, offload; const char *what; } alike[] = {
        {1, 2, OFFLOAD_NONE, "in two parts"},
        {2, 1, OFFLOAD_NONE, "over 2 shards"},
        {4, 2, OFFLOAD_NONE, "over 4 shards, in two parts"},
        {1, 1, OFFLOAD_OPTIMIZER, "on the host"},
        {4, 1, OFFLOAD_OPTIMIZER, "on the host over 4 shards"},
    };
    for (size_t k = 0; k < sizeof alike / sizeof alike[0]; k++) {
        adamw_run(alike[k].D, alike[k].parts, alike[k].offload, p2, m2, v2);
        CHECK(!memcmp(p, p2, n * 4) && !memcmp(m, m2, n * 4) && !memcmp(v, v2, n * 4),
              "%s: not bitwise the one call's update", alike[k].what);
    }
    free(p); free(m); free(v); free(p2); free(m2); free(v2); free(g); free(rp); free(rm); free(rv);
}

/* ---- Adafactor against tests/fixtures/adafactor.bin ---- */

/* The fixture's steps through the layer over D ranks; p: the initial parameters in, the final out. */
static void af_run(const OptimConfig *oc, int D, float *p, float **grads, int n_steps, float scale) {
    Ranks R;
    ranks_init(&R, D, oc);
    ranks_copy(&R, R.param, p, 1);
    for (int r = 0; r < D; r++) optim_params_written(R.opt[r]);
    for (int t = 1; t <= n_steps; t++) {
        ranks_grads(&R, grads[t - 1]);
        ranks_step(&R, oc, scale, 1);
    }
    ranks_copy(&R, R.param, p, 0);
    const AfPlan *plan = adafactor_plan(R.opt[0]);
    CHECK(plan && optim_tensor_state_count(R.opt[0]) == plan->n_stats && optim_steps(R.opt[0]) == n_steps,
          "D=%d: the optimizer's plan and state", D);
    ranks_free(&R);
}

static void test_adafactor_fixture(void) {
    FILE *f = fopen("tests/fixtures/adafactor.bin", "rb");
    CHECK(f != NULL, "tests/fixtures/adafactor.bin (run from the repository root)");
    if (!f) return;
    Ranks L;
    OptimConfig none = {0};
    ranks_init(&L, 1, &none);  /* the layout's tensors, which the fixture's must be */
    int32_t hdr[2];
    CHECK(fread(hdr, 4, 2, f) == 2 && hdr[0] == 0x58464641, "fixture magic");
    for (int cs = 0; cs < hdr[1]; cs++) {
        int32_t ci[5];
        double cd[6];
        if (fread(ci, 4, 5, f) != 5 || fread(cd, 8, 6, f) != 6) { CHECK(0, "fixture truncated"); break; }
        int nt = ci[0], n_steps = ci[1];
        OptimConfig oc = {.lr = cd[0], .weight_decay = cd[4], .kind = OPTIM_ADAFACTOR, .af_beta1 = cd[1],
                          .af_clip = cd[2], .af_decay = cd[3], .af_relative_step = ci[2], .af_scale_parameter = ci[3]};
        CHECK(nt == L.nt, "case %d: %d tensors, the model has %d", cs, nt, L.nt);
        if (nt != L.nt) break;
        size_t off[MAX_TENSORS + 1] = {0}, N = 0;
        double *p0 = malloc(1 << 20), *gd = malloc(1 << 22), *pf = malloc(1 << 20);
        for (int k = 0; k < nt; k++) {
            int32_t rc[2];
            if (fread(rc, 4, 2, f) != 2) break;
            CHECK(rc[0] == L.t[k].rows && rc[1] == L.t[k].cols, "case %d tensor %d: %dx%d, the model's %s is %dx%d", cs,
                  k, rc[0], rc[1], L.t[k].name, L.t[k].rows, L.t[k].cols);
            size_t n = (size_t)rc[0] * rc[1];
            off[k] = N;
            if (fread(p0 + N, 8, n, f) != n) break;
            N += n;
        }
        off[nt] = N;
        for (int s = 0; s < n_steps; s++)
            if (fread(gd + s * N, 8, N, f) != N) break;
        if (fread(pf, 8, N, f) != N) CHECK(0, "fixture truncated");
        float **g = malloc(n_steps * sizeof *g), *one = malloc(N * 4);
        for (int s = 0; s < n_steps; s++) {
            g[s] = malloc(N * 4);
            for (size_t i = 0; i < N; i++) g[s][i] = (float)gd[s * N + i];
        }
        for (int D = 1; D <= 4; D += 3) {  /* one process, and 4 ranks cutting rows */
            float *p = malloc(N * 4);
            for (size_t i = 0; i < N; i++) p[i] = (float)p0[i];
            af_run(&oc, D, p, g, n_steps, (float)cd[5]);
            for (int k = 0; k < nt; k++) {
                /* against the reference's change (the update itself, not the parameters), less
                 * what fp32 parameters cannot resolve: a few ulps of them over the steps */
                double num = 0, den = 0, pn = 0;
                for (size_t i = off[k]; i < off[k + 1]; i++) {
                    num += ((double)p[i] - pf[i]) * ((double)p[i] - pf[i]);
                    den += (pf[i] - p0[i]) * (pf[i] - p0[i]);
                    pn += pf[i] * pf[i];
                }
                double e = sqrt(num), bound = 2e-4 * sqrt(den) + 1e-6 * sqrt(pn);
                CHECK(e < bound, "case %d D=%d %s (%dx%d): off by %.3g of the update (bound %.3g)", cs, D, L.t[k].name,
                      L.t[k].rows, L.t[k].cols, e / sqrt(den), bound / sqrt(den));
            }
            if (D == 1) memcpy(one, p, N * 4);
            else CHECK(norm_rel_err(p, one, N) < 1e-6, "case %d: 4 ranks vs one: %.3g", cs, norm_rel_err(p, one, N));
            /* the host placement (offload): the same kernels on the host's buffers, bitwise */
            OptimConfig host = oc;
            host.offload = OFFLOAD_OPTIMIZER;
            float *q = malloc(N * 4);
            for (size_t i = 0; i < N; i++) q[i] = (float)p0[i];
            af_run(&host, D, q, g, n_steps, (float)cd[5]);
            CHECK(!memcmp(p, q, N * 4), "case %d D=%d: on the host, not bitwise the device's", cs, D);
            free(q);
            free(p);
        }
        free(one);
        for (int s = 0; s < n_steps; s++) free(g[s]);
        free(g); free(p0); free(gd); free(pf);
    }
    ranks_free(&L);
    fclose(f);
}

/* offload's lean host update: adamw_host16 is bitwise adamw on the widened bf16 gradients,
 * its parameters then rounded to bf16 over the gradients (several steps, a length that is
 * not a whole number of blocks, a clip scale, weight decay). */
static void test_adamw_host16(void) {
    size_t n = 3000;
    float *p = malloc(n * sizeof(float)), *m = calloc(n, sizeof(float)), *v = calloc(n, sizeof(float));
    float *p2 = malloc(n * sizeof(float)), *m2 = calloc(n, sizeof(float)), *v2 = calloc(n, sizeof(float));
    float *g = malloc(n * sizeof(float));
    uint16_t *g16 = malloc(n * sizeof(uint16_t));
    uint64_t r = 12345;
    for (size_t i = 0; i < n; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        p[i] = p2[i] = (float)((double)(r >> 11) / 9007199254740992.0 - 0.5);
    }
    for (int step = 1; step <= 3; step++) {
        for (size_t i = 0; i < n; i++) {
            r = r * 6364136223846793005ull + 1442695040888963407ull;
            g16[i] = bf16_round((float)((double)(r >> 11) / 9007199254740992.0 - 0.5) * 0.01f);
            g[i] = bf16_widen(g16[i]);
        }
        float scale = step == 2 ? 0.37f : 1.0f;
        ops_backend_cpu.adamw(p, g, m, v, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step, scale);
        ops_backend_cpu.adamw_host16(p2, g16, m2, v2, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step, scale);
        CHECK(!memcmp(p, p2, n * sizeof(float)) && !memcmp(m, m2, n * sizeof(float)) &&
                  !memcmp(v, v2, n * sizeof(float)), "step %d: master, m or v differ from adamw's", step);
        size_t bad = 0;
        for (size_t i = 0; i < n; i++) bad += g16[i] != bf16_round(p[i]);
        CHECK(bad == 0, "step %d: %zu bf16 parameters are not the rounded master", step, bad);
    }
    free(p); free(m); free(v); free(p2); free(m2); free(v2); free(g); free(g16);
}

int main(void) {
    RUN(test_schedule);
    RUN(test_clip);
    RUN(test_adamw);
    RUN(test_adafactor_fixture);
    RUN(test_adamw_host16);
    return TEST_SUMMARY();
}
