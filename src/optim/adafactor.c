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
    AfPlan p;
    af_plan_init(&p, m, 1, 0);
    size_t s = p.n_stats;
    af_plan_free(&p);
    return s;
}

/* A part of one tensor that is contiguous in this rank's unit: local elements [lo, lo + n)
 * of the unit, as segment coordinates (first, rows, cols, col0; AdafactorSeg). */
typedef struct { size_t lo, n, first, col0; int rows, cols; } AfPiece;

/* Tensor t's pieces (li: the rank's TensorInfo, gi: the whole model's, at g0 in its unit) from the
 * rank's runs of its unit: a row slice (qkv's heads, gate's and up's rows, the vocabulary
 * rows) is a piece of the whole matrix per run, its rows the whole matrix's rows; a column
 * slice (att_out's and down's columns of the rank's heads and hidden units) is one piece of
 * the rank's own rows x cols matrix, whose columns start at the whole matrix's col0;
 * anything held whole (tp = 1, the norms) is one piece. Returns the count. */
static int tensor_pieces(const Model *m, AfTensor *t, const TensorInfo *li, const TensorInfo *gi, size_t g0,
                         const TpRun *runs, int nr, AfPiece *out) {
    size_t l0 = t->offset, ln = (size_t)li->rows * li->cols;
    int n = 0, whole = li->rows == gi->rows && li->cols == gi->cols;
    if (m->tp_size == 1 || whole) {
        for (int i = 0; i < nr && m->tp_size > 1; i++) {
            size_t a, b;
            if (tp_run_clip(&runs[i], l0, l0 + ln, &a, &b) && !runs[i].replicated)
                die(EXIT_RUN_FAILURE, "internal: adafactor: %s is whole but not replicated", li->name);
        }
        t->replicated = m->tp_size > 1;
        out[0] = (AfPiece){l0, ln, 0, 0, li->rows, li->cols};
        return 1;
    }
    if (li->cols == gi->cols) {  /* rows */
        for (int i = 0; i < nr; i++) {
            size_t a, b;
            if (!tp_run_clip(&runs[i], l0, l0 + ln, &a, &b)) continue;
            out[n++] = (AfPiece){a, b - a, runs[i].global + (a - runs[i].local) - g0, 0, gi->rows, gi->cols};
        }
        return n;
    }
    if (li->rows != gi->rows) die(EXIT_RUN_FAILURE, "internal: adafactor: %s is split both ways", li->name);
    size_t col0 = 0;
    for (int i = 0, first = 1; i < nr; i++) {  /* columns: check that they are one range of the whole's */
        size_t a, b;
        if (!tp_run_clip(&runs[i], l0, l0 + ln, &a, &b)) continue;
        size_t l = a - l0, g = runs[i].global + (a - runs[i].local) - g0, r = l / li->cols, c = l % li->cols;
        if (first) col0 = g % gi->cols - c, first = 0;
        if (g / gi->cols != r || g % gi->cols != col0 + c || c + (b - a) > (size_t)li->cols)
            die(EXIT_RUN_FAILURE, "internal: adafactor: %s's slice is not one range of columns", li->name);
    }
    out[0] = (AfPiece){l0, ln, 0, col0, li->rows, li->cols};
    return 1;
}

void af_plan_init(AfPlan *p, const Model *m, int D, int r) {
    TensorInfo *ti, *gti;
    int n = layout_tensors(m, &ti);
    /* the whole model's tensors: a tensor-parallel rank keeps the statistics of its tensors
     * whole (rows + cols of the whole matrix, summed over the tp group), so that the step and
     * the checkpoint see what one process has */
    Model whole = {0};
    model_init_layout(&whole, &m->c, 1, 0);
    int gn = layout_tensors(&whole, &gti);
    if (gn != n) die(EXIT_RUN_FAILURE, "internal: adafactor: %d tensors in this layout, %d in the model", n, gn);
    int max_runs = model_tp_max_runs(m), nr = 0, run_unit = -1;
    TpRun *runs = xcalloc((size_t)max_runs + 1, sizeof *runs);
    AfPiece *pieces = xcalloc((size_t)max_runs + 1, sizeof *pieces);
    *p = (AfPlan){0};
    p->n_units = m->n_units;
    p->t = xcalloc((size_t)n + 1, sizeof *p->t);
    p->tp_rank = m->tp_size > 1 ? m->tp_rank : 0;
    int n_pieces = 0, cap = 0;
    AfPiece *all = NULL;
    int *all_tensor = NULL;
    for (int i = 0; i < n; i++) {
        const Unit *un = &m->units[ti[i].unit];
        if (!un->n_padded) continue;
        AfTensor *t = &p->t[p->n_tensors];
        *t = (AfTensor){gti[i].rows, gti[i].cols, ti[i].unit, ti[i].offset - un->offset, p->n_stats, 0, 0};
        size_t g0 = gti[i].offset - whole.units[ti[i].unit].offset;  /* in the whole model's unit */
        t->packed = m->packed[ti[i].unit] + g0;
        if (ti[i].unit != run_unit) nr = model_tp_runs(m, ti[i].unit, runs, max_runs), run_unit = ti[i].unit;
        int np = tensor_pieces(m, t, &ti[i], &gti[i], g0, runs, nr, pieces);
        if (n_pieces + np > cap) {
            cap = 2 * (n_pieces + np);
            all = xrealloc(all, (size_t)cap * sizeof *all);
            all_tensor = xrealloc(all_tensor, (size_t)cap * sizeof *all_tensor);
        }
        for (int j = 0; j < np; j++) all[n_pieces] = pieces[j], all_tensor[n_pieces++] = p->n_tensors;
        p->n_stats += af_tensor_stats(t->rows, t->cols);
        p->n_tensors++;
    }
    p->segs = xcalloc((size_t)n_pieces + 1, sizeof *p->segs);
    p->seg_tensor = xcalloc((size_t)n_pieces + 1, sizeof(int));
    p->useg = xcalloc((size_t)m->n_units + 1, sizeof(int));
    /* the segments, unit by unit (model_tensors lists the units in order, and a tensor's
     * pieces are in local order) */
    for (int u = 0, k = 0; u < m->n_units; u++) {
        p->useg[u] = p->n_segs;
        size_t len = m->units[u].n_padded / (size_t)D, lo = (size_t)r * len, hi = lo + len;
        for (; k < n_pieces && p->t[all_tensor[k]].unit == u; k++) {
            const AfPiece *q = &all[k];
            size_t a = q->lo > lo ? q->lo : lo, b = q->lo + q->n < hi ? q->lo + q->n : hi;
            if (a >= b) continue;
            p->segs[p->n_segs] = (AdafactorSeg){.off = a - lo, .n = b - a, .first = q->first + (a - q->lo),
                                                .stat = p->t[all_tensor[k]].stat, .col0 = q->col0,
                                                .rows = q->rows, .cols = q->cols};
            p->seg_tensor[p->n_segs++] = all_tensor[k];
        }
    }
    p->useg[m->n_units] = p->n_segs;
    free(all); free(all_tensor); free(pieces); free(runs);
    free(ti); free(gti);
    model_free(&whole);
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
