/* Learning-rate schedule and clipping; offload's bf16-gradient AdamW against adamw. (AdamW itself is checked in test_ops and, against
 * torch, in test_model.) Adafactor against a float64 reference of its update
 * (tests/gen_adafactor_fixture.py), one process and sharded. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "adafactor.h"
#include "ops.h"
#include "optim.h"
#include "test.h"
#include "util.h"

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

/* ---- Adafactor against tests/fixtures/adafactor.bin ---- */

typedef struct { int rows, cols; size_t off, stat; } Tens;

/* The step as par_adafactor strings it together, with D ranks emulated: the tensors lie one
 * after another in one flat buffer (a unit), padded to a multiple of D; rank r updates
 * [r len, (r + 1) len), cut into segments that may start mid-row; each rank's sums go into
 * its own array and are added in rank order (the all-reduce), as are the per-tensor sums. */
static void af_steps(const OptimConfig *oc, int D, int nt, const Tens *tt, size_t N, size_t S, float *p,
                     float **grads, int n_steps, float scale, float *m1) {
    size_t len = (N + D - 1) / D, Np = len * D;
    float *sums = calloc(S, 4), *part = calloc(S, 4), *stats = calloc(S, 4), *fac = calloc(S, 4);
    float *g = calloc(Np, 4), *pp = calloc(Np, 4), *mm = m1 ? calloc(Np, 4) : NULL;
    memcpy(pp, p, N * 4);
    AdafactorSeg seg[64];
    int segt[64], ns[64], nseg = 0;
    for (int r = 0; r < D; r++) {
        ns[r] = nseg;
        size_t lo = r * len, hi = lo + len;
        for (int k = 0; k < nt; k++) {
            size_t t0 = tt[k].off, t1 = t0 + (size_t)tt[k].rows * tt[k].cols, a = t0 > lo ? t0 : lo, b = t1 < hi ? t1 : hi;
            if (a >= b) continue;
            seg[nseg] = (AdafactorSeg){.off = a - lo, .n = b - a, .first = a - t0, .stat = tt[k].stat,
                                       .rows = tt[k].rows, .cols = tt[k].cols};
            segt[nseg++] = k;
        }
    }
    ns[D] = nseg;
    for (int t = 1; t <= n_steps; t++) {
        memcpy(g, grads[t - 1], N * 4);
        memset(sums, 0, S * 4);
        for (int r = 0; r < D; r++) {
            memset(part, 0, S * 4);
            for (int i = ns[r]; i < ns[r + 1]; i++) op_adafactor_sums(part, g + r * len, &seg[i], scale);
            for (size_t j = 0; j < S; j++) sums[j] += part[j];
        }
        for (int k = 0; k < nt; k++)
            op_adafactor_stats(stats + tt[k].stat, fac + tt[k].stat, sums + tt[k].stat, tt[k].rows, tt[k].cols,
                               af_beta2(oc, t), (float)ADAFACTOR_EPS1);
        double ts[64][2] = {{0}};
        for (int r = 0; r < D; r++)
            for (int i = ns[r]; i < ns[r + 1]; i++) {
                double o[2];
                op_adafactor_rms(o, pp + r * len, g + r * len, fac, &seg[i], scale);
                ts[segt[i]][0] += o[0];
                ts[segt[i]][1] += o[1];
            }
        for (int r = 0; r < D; r++)
            for (int i = ns[r]; i < ns[r + 1]; i++) {
                int k = segt[i];
                float coef, decay;
                af_coef(oc, af_rate(oc, t), ts[k][0], ts[k][1], (size_t)tt[k].rows * tt[k].cols, &coef, &decay);
                op_adafactor_update(pp + r * len, g + r * len, mm ? mm + r * len : NULL, fac, &seg[i], scale, coef,
                                    decay, (float)oc->af_beta1);
            }
    }
    memcpy(p, pp, N * 4);
    free(sums); free(part); free(stats); free(fac); free(g); free(pp); free(mm);
}

static void test_adafactor_fixture(void) {
    FILE *f = fopen("tests/fixtures/adafactor.bin", "rb");
    CHECK(f != NULL, "tests/fixtures/adafactor.bin (run from the repository root)");
    if (!f) return;
    int32_t hdr[2];
    CHECK(fread(hdr, 4, 2, f) == 2 && hdr[0] == 0x58464641, "fixture magic");
    for (int cs = 0; cs < hdr[1]; cs++) {
        int32_t ci[5];
        double cd[6];
        if (fread(ci, 4, 5, f) != 5 || fread(cd, 8, 6, f) != 6) { CHECK(0, "fixture truncated"); break; }
        int nt = ci[0], n_steps = ci[1];
        OptimConfig oc = {.lr = cd[0], .weight_decay = cd[4], .kind = OPTIM_ADAFACTOR, .af_beta1 = cd[1],
                          .af_clip = cd[2], .af_decay = cd[3], .af_relative_step = ci[2], .af_scale_parameter = ci[3]};
        Tens tt[8];
        size_t N = 0, S = 0;
        double *p0 = malloc(1 << 20), *gd = malloc(1 << 22), *pf = malloc(1 << 20);
        for (int k = 0; k < nt; k++) {
            int32_t rc[2];
            if (fread(rc, 4, 2, f) != 2) break;
            tt[k] = (Tens){rc[0], rc[1], N, S};
            size_t n = (size_t)rc[0] * rc[1];
            if (fread(p0 + N, 8, n, f) != n) break;
            N += n;
            S += af_tensor_stats(rc[0], rc[1]);
        }
        for (int s = 0; s < n_steps; s++)
            for (int k = 0; k < nt; k++) {
                size_t n = (size_t)tt[k].rows * tt[k].cols;
                if (fread(gd + s * N + tt[k].off, 8, n, f) != n) break;
            }
        if (fread(pf, 8, N, f) != N) CHECK(0, "fixture truncated");
        float **g = malloc(n_steps * sizeof *g), *ref = malloc(N * 4);
        for (int s = 0; s < n_steps; s++) {
            g[s] = malloc(N * 4);
            for (size_t i = 0; i < N; i++) g[s][i] = (float)gd[s * N + i];
        }
        for (size_t i = 0; i < N; i++) ref[i] = (float)pf[i];
        float *one = NULL;
        for (int D = 1; D <= 4; D += 3) {  /* one process, and 4 ranks cutting rows */
            float *p = malloc(N * 4), m1 = 0;
            for (size_t i = 0; i < N; i++) p[i] = (float)p0[i];
            af_steps(&oc, D, nt, tt, N, S, p, g, n_steps, (float)cd[5], oc.af_beta1 > 0 ? &m1 : NULL);
            for (int k = 0; k < nt; k++) {
                size_t n = (size_t)tt[k].rows * tt[k].cols;
                /* against the reference's change (the update itself, not the parameters), less
                 * what fp32 parameters cannot resolve: a few ulps of them over the steps */
                double num = 0, den = 0, pn = 0;
                for (size_t i = tt[k].off; i < tt[k].off + n; i++) {
                    num += ((double)p[i] - pf[i]) * ((double)p[i] - pf[i]);
                    den += (pf[i] - p0[i]) * (pf[i] - p0[i]);
                    pn += pf[i] * pf[i];
                }
                double e = sqrt(num), bound = 2e-4 * sqrt(den) + 1e-6 * sqrt(pn);
                CHECK(e < bound, "case %d D=%d tensor %d (%dx%d): off by %.3g of the update (bound %.3g)", cs, D, k,
                      tt[k].rows, tt[k].cols, e / sqrt(den), bound / sqrt(den));
            }
            if (D == 1) one = p;
            else {
                CHECK(norm_rel_err(p, one, N) < 1e-6, "case %d: 4 ranks vs one: %.3g", cs, norm_rel_err(p, one, N));
                free(p);
            }
        }
        free(one);
        for (int s = 0; s < n_steps; s++) free(g[s]);
        free(g); free(ref); free(p0); free(gd); free(pf);
    }
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
    RUN(test_adamw_host16);
    RUN(test_schedule);
    RUN(test_clip);
    RUN(test_adafactor_fixture);
    return TEST_SUMMARY();
}
