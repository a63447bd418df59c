#include "adafactor.h"
#include <math.h>
#include <stdlib.h>
#include "util.h"

static int layout_tensors(const Model *m, TensorInfo **out) {
    int max = 8 + 7 * m->L;
    *out = xcalloc((size_t)max, sizeof **out);
    return model_tensors(m, *out, max);
}

size_t af_stats_count(const Model *m) {
    TensorInfo *ti;
    int n = layout_tensors(m, &ti);
    size_t s = 0;
    for (int i = 0; i < n; i++)
        if (m->units[ti[i].unit].n_padded) s += af_tensor_stats(ti[i].rows, ti[i].cols);
    free(ti);
    return s;
}

void af_plan_init(AfPlan *p, const Model *m, int D, int r) {
    TensorInfo *ti;
    int n = layout_tensors(m, &ti);
    *p = (AfPlan){0};
    p->n_units = m->n_units;
    p->t = xcalloc((size_t)n + 1, sizeof *p->t);
    p->segs = xcalloc((size_t)n + 1, sizeof *p->segs);
    p->seg_tensor = xcalloc((size_t)n + 1, sizeof(int));
    p->useg = xcalloc((size_t)m->n_units + 1, sizeof(int));
    for (int i = 0; i < n; i++) {
        const Unit *un = &m->units[ti[i].unit];
        if (!un->n_padded) continue;
        AfTensor *t = &p->t[p->n_tensors];
        *t = (AfTensor){ti[i].rows, ti[i].cols, ti[i].unit, ti[i].offset - un->offset, p->n_stats, 0};
        t->packed = m->packed[ti[i].unit] + t->offset;
        p->n_stats += af_tensor_stats(t->rows, t->cols);
        p->n_tensors++;
    }
    /* the segments, unit by unit (model_tensors lists the units in order) */
    for (int u = 0, k = 0; u < m->n_units; u++) {
        p->useg[u] = p->n_segs;
        size_t len = m->units[u].n_padded / (size_t)D, lo = (size_t)r * len, hi = lo + len;
        for (; k < p->n_tensors && p->t[k].unit == u; k++) {
            const AfTensor *t = &p->t[k];
            size_t t0 = t->offset, t1 = t0 + (size_t)t->rows * t->cols;
            size_t a = t0 > lo ? t0 : lo, b = t1 < hi ? t1 : hi;
            if (a >= b) continue;
            p->segs[p->n_segs] = (AdafactorSeg){.off = a - lo, .n = b - a, .first = a - t0, .stat = t->stat,
                                                .rows = t->rows, .cols = t->cols};
            p->seg_tensor[p->n_segs++] = k;
        }
    }
    p->useg[m->n_units] = p->n_segs;
    free(ti);
}

void af_plan_free(AfPlan *p) {
    free(p->t); free(p->segs); free(p->seg_tensor); free(p->useg);
    *p = (AfPlan){0};
}

float af_beta2(const OptimConfig *c, int t) { return (float)(1.0 - pow((double)t, -c->af_decay)); }

double af_rate(const OptimConfig *c, int t) {
    if (c->af_relative_step) return fmin(1e-2, 1.0 / sqrt((double)t));
    return lr_at(c, t - 1);
}

void af_coef(const OptimConfig *c, double rate, double su2, double sp2, size_t numel, float *coef, float *decay) {
    double lr = rate;
    if (c->af_scale_parameter) lr *= fmax(ADAFACTOR_EPS2, sqrt(sp2 / (double)numel));
    double clip = fmax(1.0, sqrt(su2 / (double)numel) / c->af_clip);
    *coef = (float)(lr / clip);
    *decay = c->weight_decay != 0 ? (float)(1.0 - lr * c->weight_decay) : 1.0f;
}

void af_pack(const AfPlan *p, const float *stats, uint64_t start, uint64_t n, float *out) {
    for (uint64_t i = 0; i < n; i++) out[i] = 0.0f;
    for (int k = 0; k < p->n_tensors; k++) {
        const AfTensor *t = &p->t[k];
        uint64_t a = t->packed, b = a + af_tensor_stats(t->rows, t->cols);
        uint64_t lo = a > start ? a : start, hi = b < start + n ? b : start + n;
        for (uint64_t x = lo; x < hi; x++) out[x - start] = stats[t->stat + (x - a)];
    }
}
