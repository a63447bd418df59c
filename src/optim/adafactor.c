#include "adafactor.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "optim_impl.h"
#include "util.h"

static int layout_tensors(const Model *m, TensorInfo **out) {
    int max = model_n_tensors(&m->c);
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
        int repl = 0;  /* (expert parallel: every tensor is whole; the experts' are the rank's own) */
        for (int i = 0; i < nr && (m->tp_size > 1 || m->ep_size > 1); i++) {
            size_t a, b;
            if (!tp_run_clip(&runs[i], l0, l0 + ln, &a, &b)) continue;
            if (!(runs[i].replicated & TP_REPL_TP) && m->tp_size > 1)
                die(EXIT_RUN_FAILURE, "internal: adafactor: %s is whole but not replicated", li->name);
            repl = runs[i].replicated != 0;
        }
        t->replicated = m->tp_size > 1 || repl;
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
    /* the whole model's tensor of each of this layout's, by name (an expert-parallel rank
     * holds some of the experts; the tensors are listed in the same order) */
    TensorInfo *match = xcalloc((size_t)n + 1, sizeof *match);
    for (int i = 0, j = 0; i < n; i++, j++) {
        while (j < gn && strcmp(gti[j].name, ti[i].name)) j++;
        if (j == gn) die(EXIT_RUN_FAILURE, "internal: adafactor: %s is not a tensor of the model", ti[i].name);
        match[i] = gti[j];
    }
    free(gti);
    gti = match;
    int max_runs = model_tp_max_runs(m), nr = 0, run_unit = -1;
    TpRun *runs = xcalloc((size_t)max_runs + 1, sizeof *runs);
    AfPiece *pieces = xcalloc((size_t)max_runs + 1, sizeof *pieces);
    *p = (AfPlan){0};
    p->n_units = m->n_units;
    p->t = xcalloc((size_t)n + 1, sizeof *p->t);
    p->tp_rank = m->tp_size > 1 ? m->tp_rank : 0;  /* (expert parallel sums no statistics over its ep group) */
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

/* ---- the optimizer (optim_impl.h) ---- */

/* The state per tensor: the plan of this rank's part; fp32 statistics, the update's factors
 * and the sums of g^2 (n_stats each, in the placement's memory); per segment the sums of u^2
 * and param^2 (the placement's, and a host copy), per tensor their totals (host). */
typedef struct {
    AfPlan plan;
    float *stats, *fac, *sums;
    float *dsums;  /* on the host and summed over ranks: the sums' device copy, which the collectives sum */
    double *seg, *seg_host, *tensor;
} Af;

static int af_moments(const OptimConfig *c) { return c->af_beta1 > 0 ? 1 : 0; }

static void af_setup(Optimizer *o) {
    Af *a = o->state = xcalloc(1, sizeof *a);
    int host = o->k == &optim_host_kernels;
    af_plan_init(&a->plan, o->m, o->D, o->r);
    size_t s = a->plan.n_stats * sizeof(float), ns = (size_t)a->plan.n_segs;
    a->stats = o->k->alloc(s, "Adafactor's statistics");
    a->fac = o->k->alloc(s, "Adafactor's factors");
    a->sums = o->k->alloc(s, "Adafactor's sums");
    if (host && o->summed) a->dsums = op_alloc(s);
    if (!host) a->seg = op_alloc(2 * ns * sizeof(double));
    a->seg_host = xcalloc(2 * ns + 1, sizeof(double));
    if (host) a->seg = a->seg_host;  /* the host's kernels write it directly */
    a->tensor = xcalloc(2 * (size_t)a->plan.n_tensors + 1, sizeof(double));
}

static void af_free(Optimizer *o) {
    Af *a = o->state;
    o->k->free(a->stats); o->k->free(a->fac); o->k->free(a->sums);
    op_free(a->dsums);
    if (a->seg != a->seg_host) op_free(a->seg);
    free(a->seg_host); free(a->tensor);
    af_plan_free(&a->plan);
    free(a);
}

const AfPlan *adafactor_plan(const Optimizer *o) {
    return o->impl == &optim_adafactor ? &((const Af *)o->state)->plan : NULL;
}

/* statistics, factors and sums (fp32), and per tensor two doubles (at most one segment each) */
static size_t af_tensor_bytes(const Model *layout) {
    size_t nt = (size_t)model_n_tensors(&layout->c);
    return 3 * af_stats_count(layout) * sizeof(float) + 2 * nt * sizeof(double);
}
static size_t af_summed_bytes(const Model *layout) { return af_stats_count(layout) * sizeof(float); }

static float *af_tensor_state(const Optimizer *o, size_t *n) {
    const Af *a = o->state;
    *n = a->plan.n_stats;
    return a->stats;
}

/* Segment i is of a tensor every tp rank holds alike, and this rank is not tp rank 0: its
 * sums are tp rank 0's to add (the tp all-reduces would count them tp_size times). */
static int af_tp_skip(const AfPlan *af, int i) { return af->tp_rank != 0 && af->t[af->seg_tensor[i]].replicated; }

static OptimSums af_stats_round(Optimizer *o, int round, float scale) {
    Af *a = o->state;
    const AfPlan *af = &a->plan;
    if (round == 0) {
        /* 1. the sums of (s g)^2 over the rows and columns of what this rank holds, summed over
         * the shard group and then the tp group: a tp rank's row slice adds its rows' sums
         * (zeros in the other ranks' rows) and its part of every column's, a column slice the
         * reverse; what every tp rank holds alike (the norms) is counted by tp rank 0 alone */
        o->k->zero(a->sums, af->n_stats * sizeof(float));
        for (int u = 0; u < o->n_units; u++) {
            const void *grad = optim_grad_of(o, u);
            for (int i = af->useg[u]; i < af->useg[u + 1]; i++)
                if (!af_tp_skip(af, i)) o->k->af_sums(a->sums, grad, &af->segs[i], scale);
        }
        float *sums = a->sums;
        if (a->dsums) {  /* on the host: through a device buffer (the collectives' buffers are the device's) */
            op_upload(a->dsums, a->sums, af->n_stats * sizeof(float));
            sums = a->dsums;
        }
        return (OptimSums){sums, af->n_stats, 0, "adafactor statistics all-reduce",
                           "adafactor statistics tensor-parallel all-reduce"};
    }
    /* 3. per tensor: the sums of u^2 and param^2, for the update clipping and the parameter scale */
    for (int u = 0; u < o->n_units; u++) {
        void *param = optim_param_of(o, u);
        const void *grad = optim_grad_of(o, u);
        for (int i = af->useg[u]; i < af->useg[u + 1]; i++)
            o->k->af_rms(a->seg + 2 * i, param, grad, a->fac, &af->segs[i], scale);
    }
    if (af->n_segs && a->seg != a->seg_host)
        op_download(a->seg_host, a->seg, 2 * (size_t)af->n_segs * sizeof(double));
    memset(a->tensor, 0, 2 * (size_t)af->n_tensors * sizeof(double));
    for (int i = 0; i < af->n_segs; i++) {
        if (af_tp_skip(af, i)) continue;
        a->tensor[2 * af->seg_tensor[i]] += a->seg_host[2 * i];
        a->tensor[2 * af->seg_tensor[i] + 1] += a->seg_host[2 * i + 1];
    }
    return (OptimSums){a->tensor, 2 * (size_t)af->n_tensors, 1, NULL, NULL};
}

static void af_stats_summed(Optimizer *o, int round) {
    Af *a = o->state;
    const AfPlan *af = &a->plan;
    if (round != 0) return;
    if (a->dsums) op_download(a->sums, a->dsums, af->n_stats * sizeof(float));
    /* 2. the statistics (the same on every rank) and the update's factors */
    float b2 = af_beta2(o->cur.oc, o->cur.step);
    for (int k = 0; k < af->n_tensors; k++) {
        const AfTensor *tk = &af->t[k];
        o->k->af_stats(a->stats + tk->stat, a->fac + tk->stat, a->sums + tk->stat, tk->rows, tk->cols, b2,
                       (float)ADAFACTOR_EPS1);
    }
}

/* 4. the update, segment by segment, with each tensor's coefficients from its sums */
static int af_update_range(Optimizer *o, const OptimRange *r, const OptimStep *s) {
    Af *a = o->state;
    const AfPlan *af = &a->plan;
    for (int u = r->u0; u < r->u1; u++) {
        void *param = optim_param_of(o, u), *m1 = optim_at(o->mom[0], o->at[u]);
        const void *grad = optim_grad_of(o, u);
        for (int i = af->useg[u]; i < af->useg[u + 1]; i++) {
            int k = af->seg_tensor[i];
            float coef, decay;
            af_coef(s->oc, s->lr, a->tensor[2 * k], a->tensor[2 * k + 1], (size_t)af->t[k].rows * af->t[k].cols, &coef,
                    &decay);
            o->k->af_update(param, grad, m1, a->fac, &af->segs[i], s->scale, coef, decay, (float)s->oc->af_beta1);
        }
    }
    return 0;
}

const OptimImpl optim_adafactor = {
    .name = "adafactor",
    .kind = OPTIM_ADAFACTOR,
    .moments = af_moments,
    .moment_name = {"Adafactor's first moment", NULL},
    .setup = af_setup,
    .free = af_free,
    .tensor_bytes = af_tensor_bytes,
    .summed_bytes = af_summed_bytes,
    .tensor_state = af_tensor_state,
    .rate = af_rate,
    .rounds = 2,
    .stats = af_stats_round,
    .stats_summed = af_stats_summed,
    .update = af_update_range,
};
