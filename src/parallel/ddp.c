/* DDP: every rank holds the whole model, gradients and optimizer state; each unit's
 * gradient is averaged over dp with a non-blocking all-reduce started as soon as that
 * unit's backward ends, so it overlaps the backward of the units below it. bucket_mb joins
 * units that finish one after another into fewer, larger all-reduces; an untied
 * embedding's is reduced only in the rows the step's batch uses. Every rank then takes
 * the same optimizer step on the whole model. On one machine's GPUs the gradient buffer
 * comes from comm_alloc, whose all-reduces run on the copy engines (comm.h). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "ops.h"
#include "parallel_impl.h"
#include "trace.h"
#include "util.h"

typedef struct {
    /* The bucket: the gradient range [bkt_off, bkt_off + bkt_n) not yet reduced, whose
     * all-reduce goes in greq[bkt_unit] (its first unit); flushed at bucket_bytes. */
    size_t bucket_bytes, bkt_off, bkt_n;
    int bkt_unit;
    /* greq_late[u]: greq[u] was started at the end of the backward (by units 2..0, the
     * embedding rows or the step), likely still in flight; they cover [0, late_hi). Every
     * reduction above late_hi started earlier, so without clipping the update of
     * [late_hi, n_flat) runs while the late ones finish. */
    unsigned char *greq_late;
    size_t late_hi;
    /* Over several ranks, untied embedding: the embedding's gradient is all-reduced only in
     * the rows this step's global batch uses (the others are zero on every rank): erows
     * (op_alloc, ascending, n_erows of them, at most erows_cap), gathered into ebuf,
     * reduced, and scattered back before the update. n_erows == SIZE_MAX: not set for this
     * step (or too many), the whole unit is reduced. */
    int *erows;
    void *ebuf;
    size_t erows_cap, n_erows;
    int erows_pending;
    /* side_pending[u]: unit u's update runs on the ops' side queue (op_side_mark u), beside
     * the next step's forward, which waits for it at the unit's gather. */
    unsigned char *side_pending;
    size_t side_lo;  /* those units are [side_lo, n_flat): the side queue also zeroes their gradients */
} Ddp;

/* The most embedding rows reduced by themselves (a quarter of the vocabulary), 0 where the
 * whole unit always is (one rank, tied embeddings). */
static size_t erows_cap(const Model *m, int D) {
    if (D <= 1 || m->c.tie_embeddings || !m->units[UNIT_EMBEDDING].n) return 0;  /* (or another stage's) */
    return m->V / 4 > 0 ? (size_t)m->V / 4 : 1;
}

/* A reduction started at the end of the backward, covering [0, hi). */
static void mark_late(Ddp *d, int u, size_t hi) {
    d->greq_late[u] = 1;
    if (hi > d->late_hi) d->late_hi = hi;
}

/* The embedding's gradient, only the rows the global batch uses: gathered, then reduced. */
static void reduce_erows(Parallel *p, Ddp *d) {
    size_t E = (size_t)p->m->E;
    d->erows_pending = d->n_erows > 0;
    if (!d->erows_pending) return;  /* no rows: the gradient is zero everywhere */
    const Unit *e = &p->m->units[UNIT_EMBEDDING];
    mark_late(d, UNIT_EMBEDDING, e->offset + e->n_padded);
    op_gather_rows(d->ebuf, st_at(p->grads, e->offset), d->erows, d->n_erows, E * ops_state_size());
    comm_iallreduce(p->group, d->ebuf, d->n_erows * E, par_ctype(), COMM_AVG, &p->greq[UNIT_EMBEDDING],
                    "gradient all-reduce (embedding rows)");
    if (!p->overlap) par_wait(p, &p->greq[UNIT_EMBEDDING]);
}

static void finish_erows(Parallel *p, Ddp *d) {
    if (d->erows_pending)
        op_scatter_rows(st_at(p->grads, p->m->units[UNIT_EMBEDDING].offset), d->ebuf, d->erows, d->n_erows,
                        (size_t)p->m->E * ops_state_size());
    d->erows_pending = 0;
    d->n_erows = SIZE_MAX;  /* rows are set for one step */
    p->hooks.embed_last = 0;
}

static void flush(Parallel *p, Ddp *d, int late) {
    if (!d->bkt_n) return;
    CommReq *r = &p->greq[d->bkt_unit];
    if (late) mark_late(d, d->bkt_unit, d->bkt_off + d->bkt_n);
    par_allreduce_grad(p, st_at(p->grads, d->bkt_off), d->bkt_n, r);
    /* the bucket's units' gradients are complete once it is reduced (an embedding reduced in
     * its rows is scattered back at the step, and is complete then) */
    for (int u = 0; u < p->m->n_units; u++) {
        const Unit *un = &p->m->units[u];
        if (un->n_padded && un->offset >= d->bkt_off && un->offset < d->bkt_off + d->bkt_n) par_grad_final(p, u, r);
    }
    d->bkt_n = 0;
    if (!p->overlap) par_wait(p, r);
}

/* Unit u's gradient joins the bucket (a new one unless it borders the pending range); a
 * bucket of bucket_bytes or more is reduced at once. So is one that reaches layer 1 (unit
 * 2), and any holding layer 0 or the embedding (units 1 and 0), whichever order the two
 * finish in (UnitHooks.embed_last): they are the step's last, and waiting longer, for
 * the step, would leave their reduction exposed at the end of the step. */
static void ddp_grad_ready(void *ctx, int u) {
    Parallel *p = ctx;
    Ddp *d = p->st;
    int late = u == UNIT_EMBEDDING || u == unit_of_layer(0) || u == unit_of_layer(1);
    if (u == UNIT_EMBEDDING && d->n_erows != SIZE_MAX) {
        flush(p, d, late);
        reduce_erows(p, d);
        par_progress(p);
        return;
    }
    const Unit *un = &p->m->units[u];
    size_t lo = un->offset, hi = lo + un->n_padded;
    if (d->bkt_n && hi != d->bkt_off && lo != d->bkt_off + d->bkt_n) flush(p, d, late);
    if (!d->bkt_n) d->bkt_unit = u, d->bkt_off = lo;
    if (lo < d->bkt_off) d->bkt_off = lo;
    d->bkt_n += un->n_padded;
    if (d->bkt_n * ops_state_size() >= d->bucket_bytes || late) flush(p, d, late);
    par_progress(p);
}

static void ddp_grad_begin(void *ctx, int u) {
    (void)u;
    par_progress(ctx);
}

/* Waits for unit u's update (on the side queue, or where the optimizer's placement runs it);
 * with precision=mixed remakes its bf16 copy if it is behind (after a load, or an update that
 * does not write it itself). */
static void ddp_gather(void *ctx, int u, int next) {
    Parallel *p = ctx;
    Ddp *d = p->st;
    (void)next;
    if (d->side_pending[u]) {
        op_side_wait(u);
        d->side_pending[u] = 0;
    }
    par_update_ready(p, u, 1);
    par_cast_unit(p, u);
}

/* The units at offsets [lo, hi) of the flat buffer (whole units; hi = n_flat: to the last): [*u0, *u1). */
static void units_in(const Model *m, size_t lo, size_t hi, int *u0, int *u1) {
    int a = 0;
    while (a < m->n_units && m->units[a].offset < lo) a++;
    int b = a;
    while (b < m->n_units && (hi >= m->n_flat || m->units[b].offset < hi)) b++;
    *u0 = a, *u1 = b;
}

/* The update of the units at offsets [lo, hi), in one call (they are adjacent in the whole
 * buffers); with precision=mixed an update on the device writes the bf16 compute copy of
 * what it updates, so the next forward need not make it from the whole parameters. */
static void update(Parallel *p, size_t lo, size_t hi, float scale) {
    int u0, u1;
    units_in(p->m, lo, hi, &u0, &u1);
    par_update(p, u0, u1, scale);
}

/* Where the optimizer allows it (par_update_parts: an elementwise update in the device's
 * queue) and without clipping, the update runs in two parts. It is elementwise, so the
 * result is bitwise that of one update; only the logged norm is summed in two parts.
 * Clipping needs the whole norm before any update: one part; so does a loss scaler, which
 * decides from it whether anything is updated, and so does an optimizer that
 * needs statistics of whole tensors, after every reduction, and one whose update runs on
 * the host, unit by unit once the norm is known (the gather hook waits for each).
 * - [0, late_hi), whose reductions end the backward: the embedding and the first layers
 *   (the bucket that reaches layer 1), which the next forward needs first.
 * - [late_hi, n_flat), reduced earlier: its units are updated after the first part, one by
 *   one on the ops' side queue, beside the next step's forward, which waits for each at its
 *   gather (ddp_gather). Where the side queue cannot take them (more units than it has
 *   marks, or not whole units) they are updated first, while the late reductions finish. */
static int side_units(const Parallel *p, size_t split) {
    const Model *m = p->m;
    if (split >= m->n_flat || m->n_units > OPS_SIDE_MARKS) return 0;
    size_t n = 0;
    for (int u = 0; u < m->n_units; u++)
        if (m->units[u].offset >= split) n += m->units[u].n_padded;
    return n == m->n_flat - split;  /* the part is whole units */
}

static double ddp_step(Parallel *p, const OptimConfig *oc, double *lr_out) {
    const Model *m = p->m;
    Ddp *d = p->st;
    flush(p, d, 1);  /* first: a bucket it starts is a late one, which moves late_hi */
    size_t n = m->n_flat, split = oc->grad_clip > 0 || oc->loss_scale.kind || !par_update_parts(p) ? n : d->late_hi;
    double lr = par_update_begin(p, oc);
    for (int u = 0; u < m->n_units; u++)
        if (!d->greq_late[u]) par_wait(p, &p->greq[u]);
    double sumsq = 0;
    int side = side_units(p, split);
    /* Sequence parallel: nothing is updated, nor its norm taken, before the norms' gradients
     * are summed over tp; the side update (after that sum) still overlaps the next forward,
     * but the first part may not run ahead of it. */
    int later = par_sums_replicated(p);
    if (later && !side) split = n;
    if (split < n && !later) {
        sumsq = op_sumsq(st_at(p->grads, split), n - split);
        if (!side) update(p, split, n, 1.0f);
    }
    for (int u = 0; u < m->n_units; u++) par_wait(p, &p->greq[u]);
    trace_mark(NULL, "late reductions in");
    finish_erows(p, d);
    par_tp_sum_partial(p, 0);  /* (where the placement copied those units out: again) */
    trace_mark(NULL, "norms' gradients summed");
    sumsq = later ? op_sumsq(p->grads, n) : sumsq + op_sumsq(p->grads, split);  /* (one wait for the device) */
    double norm = sqrt(par_stages_sumsq(p, sumsq));
    trace_mark(NULL, "gradient norm on the host");
    float scale;
    *lr_out = lr;
    if (!par_update_go(p, oc, &norm, &scale)) return norm;  /* skipped: nothing updated, split = n */
    par_update_stats(p, scale);
    update(p, 0, split, scale);
    if (side) {
        op_side_begin();
        for (int u = 0; u < m->n_units; u++) {
            const Unit *un = &m->units[u];
            if (un->offset < split) continue;
            par_update(p, u, u + 1, 1.0f);
            op_zero(st_at(p->grads, un->offset), un->n_padded * ops_state_size());  /* the next step's */
            op_side_mark(u);
            d->side_pending[u] = 1;
        }
        op_side_end();
        d->side_lo = split;
    }
    return norm;
}

/* Clears the gradients, except those the side queue zeroes after its update. */
static void ddp_begin_step(Parallel *p) {
    Ddp *d = p->st;
    size_t hi = d->side_lo < p->m->n_flat ? d->side_lo : p->m->n_flat;
    op_zero(p->grads, hi * ops_state_size());
    d->side_lo = SIZE_MAX;
    memset(d->greq_late, 0, (size_t)p->m->n_units);
    d->late_hi = 0;
}

static void ddp_setup(Parallel *p) {
    Ddp *d = p->st = xcalloc(1, sizeof *d);
    d->side_lo = SIZE_MAX;
    d->greq_late = xcalloc((size_t)p->m->n_units, 1);
    size_t bytes = p->m->n_flat * ops_state_size();
    /* lean with bf16 compute: no device parameters, the optimizer's host copy is them */
    p->params = par_alloc_params(p, bytes);
    p->grads = comm_alloc(p->group, bytes);  /* on one machine's GPUs: reduced on the copy engines */
    model_point_units(p->m, p->params, p->grads);
    d->erows_cap = erows_cap(p->m, p->D);
    d->erows = op_alloc(d->erows_cap * sizeof(int));
    d->ebuf = op_alloc(d->erows_cap * (size_t)p->m->E * ops_state_size());
    d->n_erows = SIZE_MAX;
    d->side_pending = xcalloc((size_t)p->m->n_units, 1);
    par_compute_whole(p);
}

static void ddp_free(Parallel *p) {
    Ddp *d = p->st;
    op_free(d->erows); op_free(d->ebuf);
    free(d->greq_late); free(d->side_pending);
    free(d);
}

/* Replicated: each rank saves its even slice of every unit; on load every rank needs all. */
static int ddp_ranges(const Parallel *p, int write, OwnedRange *out, int max) {
    const Model *m = p->m;
    int n = 0;
    for (int u = 0; u < m->n_units && n < max; u++) {
        size_t s = shard_len(p, u), lo = (size_t)p->r * s, hi = lo + s, nu = m->units[u].n;
        if (hi > nu) hi = nu;
        size_t off = m->units[u].offset;
        void *base_p = par_whole_params(p, u);
        if (write) {
            if (lo < hi && n < max)
                out[n++] = (OwnedRange){u, lo, hi, st_at(base_p, lo), par_state_at(p, 0, off + lo),
                                        par_state_at(p, 1, off + lo)};
        } else if (n < max) {
            out[n++] = (OwnedRange){u, 0, nu, base_p, par_state_at(p, 0, off), par_state_at(p, 1, off)};
        }
    }
    return n;
}

/* Everything whole, plus the embedding rows' buffer and their indices. */
static ParallelBytes ddp_bytes(const Model *layout, int D, size_t state_size, size_t compute_size) {
    size_t full = layout->n_flat * state_size, cap = erows_cap(layout, D);
    return (ParallelBytes){full, full + cap * ((size_t)layout->E * state_size + sizeof(int)), full,
                           compute_size ? layout->n_flat * compute_size : 0, 0};
}

static void ddp_set_bucket(Parallel *p, size_t bytes) { ((Ddp *)p->st)->bucket_bytes = bytes; }

static int ddp_wants_rows(const Parallel *p) { return ((const Ddp *)p->st)->erows_cap > 0; }

static void ddp_set_rows(Parallel *p, const int *rows, size_t n) {
    Ddp *d = p->st;
    d->n_erows = SIZE_MAX;
    p->hooks.embed_last = 0;
    if (!d->erows_cap || n > d->erows_cap) return;
    op_upload(d->erows, rows, n * sizeof(int));
    d->n_erows = n;
    p->hooks.embed_last = 1;  /* its reduction is small: layer 0's overlaps its backward instead */
}

const ParallelStrategy par_ddp = {
    .name = "ddp",
    .updates_all = 1,
    .setup = ddp_setup,
    .free = ddp_free,
    .gather = ddp_gather,
    .grad_begin = ddp_grad_begin,
    .grad_ready = ddp_grad_ready,
    .init_weights = par_init_whole,
    .params_changed = par_params_stale,
    .begin_step = ddp_begin_step,
    .step = ddp_step,
    .ranges = ddp_ranges,
    .bytes = ddp_bytes,
    .set_bucket = ddp_set_bucket,
    .wants_rows = ddp_wants_rows,
    .set_rows = ddp_set_rows,
};
