/* DDP: every rank holds the whole model, gradients and optimizer state; each unit's
 * gradient is averaged over dp with a non-blocking all-reduce started as soon as that
 * unit's backward ends, so it overlaps the backward of the units below it. bucket_mb joins
 * units that finish one after another into fewer, larger all-reduces; an untied
 * embedding's is reduced only in the rows the step's batch uses. Every rank then takes
 * the same AdamW step. On one machine's GPUs the gradient buffer comes from comm_alloc,
 * whose all-reduces run on the copy engines (comm.h). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "ops.h"
#include "parallel_impl.h"
#include "trace.h"
#include "util.h"

size_t ddp_erows_cap(const Model *m, int D) {
    if (D <= 1 || m->c.tie_embeddings) return 0;
    return m->V / 4 > 0 ? (size_t)m->V / 4 : 1;
}

/* A reduction started at the end of the backward, covering [0, hi). */
static void mark_late(Parallel *p, int u, size_t hi) {
    p->greq_late[u] = 1;
    if (hi > p->late_hi) p->late_hi = hi;
}

/* The embedding's gradient, only the rows the global batch uses: gathered, then reduced. */
static void ddp_reduce_erows(Parallel *p) {
    size_t E = (size_t)p->m->E;
    p->erows_pending = p->n_erows > 0;
    if (!p->erows_pending) return;  /* no rows: the gradient is zero everywhere */
    mark_late(p, 0, p->m->units[0].offset + p->m->units[0].n_padded);
    op_gather_rows(p->ebuf, st_at(p->grads, p->m->units[0].offset), p->erows, p->n_erows, E * ops_state_size());
    comm_iallreduce(p->group, p->ebuf, p->n_erows * E, par_ctype(), COMM_AVG, &p->greq[0],
                    "gradient all-reduce (embedding rows)");
    if (!p->overlap) par_wait(p, &p->greq[0]);
}

static void ddp_finish_erows(Parallel *p) {
    if (p->erows_pending)
        op_scatter_rows(st_at(p->grads, p->m->units[0].offset), p->ebuf, p->erows, p->n_erows,
                        (size_t)p->m->E * ops_state_size());
    p->erows_pending = 0;
    p->n_erows = SIZE_MAX;  /* rows are set for one step */
    p->hooks.embed_last = 0;
}

static void flush(Parallel *p, int late) {
    if (!p->bkt_n) return;
    CommReq *r = &p->greq[p->bkt_unit];
    if (late) mark_late(p, p->bkt_unit, p->bkt_off + p->bkt_n);
    comm_iallreduce(p->group, st_at(p->grads, p->bkt_off), p->bkt_n, par_ctype(), COMM_AVG, r, "gradient all-reduce");
    p->bkt_n = 0;
    if (!p->overlap) par_wait(p, r);
}

void ddp_flush(Parallel *p) { flush(p, 1); }

/* Unit u's gradient joins the bucket (a new one unless it borders the pending range); a
 * bucket of bucket_bytes or more is reduced at once. So is one that reaches layer 1 (unit
 * 2), and any holding layer 0 or the embedding (units 1 and 0), whichever order the two
 * finish in (UnitHooks.embed_last): they are the step's last, and waiting longer, for
 * parallel_step, would leave their reduction exposed at the end of the step. */
static void ddp_grad_ready(void *ctx, int u) {
    Parallel *p = ctx;
    int late = u <= 2;
    if (u == 0 && p->n_erows != SIZE_MAX) {
        flush(p, late);
        ddp_reduce_erows(p);
        par_progress(p);
        return;
    }
    const Unit *un = &p->m->units[u];
    size_t lo = un->offset, hi = lo + un->n_padded;
    if (p->bkt_n && hi != p->bkt_off && lo != p->bkt_off + p->bkt_n) flush(p, late);
    if (!p->bkt_n) p->bkt_unit = u, p->bkt_off = lo;
    if (lo < p->bkt_off) p->bkt_off = lo;
    p->bkt_n += un->n_padded;
    if (p->bkt_n * ops_state_size() >= p->bucket_bytes || late) flush(p, late);
    par_progress(p);
}

static void ddp_progress(void *ctx, int u) {
    (void)u;
    par_progress(ctx);
}

/* AdamW over [lo, lo + n); with precision=mixed it also writes the bf16 compute copy of
 * what it updates, so the next forward need not make it from the whole parameters. */
static void update(Parallel *p, size_t lo, size_t n, const OptimConfig *oc, double lr, int step, float scale) {
    float b1 = (float)oc->beta1, b2 = (float)oc->beta2, eps = (float)oc->eps, wd = (float)oc->weight_decay;
    void *pa = st_at(p->params, lo), *g = st_at(p->grads, lo), *m1 = st_at(p->mom1, lo), *m2 = st_at(p->mom2, lo);
    if (p->cparams) op_adamw_cast(pa, g, m1, m2, n, (float)lr, b1, b2, eps, wd, step, scale, act_at(p->cparams, lo));
    else op_adamw(pa, g, m1, m2, n, (float)lr, b1, b2, eps, wd, step, scale);
}

/* Without clipping, the update runs in two parts. AdamW is elementwise, so the result is
 * bitwise that of one update; only the logged norm is summed in two parts. Clipping needs
 * the whole norm before any update: one part.
 * - [0, late_hi), whose reductions end the backward: the embedding and the first layers
 *   (the bucket that reaches layer 1), which the next forward needs first.
 * - [late_hi, n_flat), reduced earlier. With side_update (the default; the ops' side queue)
 *   its units are updated after the first part, beside the next step's forward, which
 *   waits for each at its gather (par_whole_gather). Otherwise it runs first, while the
 *   late reductions finish. */
static int side_units(Parallel *p, size_t split) {
    const Model *m = p->m;
    if (!p->side_update || split >= m->n_flat || m->n_units > OPS_SIDE_MARKS) return 0;
    size_t n = 0;
    for (int u = 0; u < m->n_units; u++)
        if (m->units[u].offset >= split) n += m->units[u].n_padded;
    return n == m->n_flat - split;  /* the part is whole units */
}

double ddp_step(Parallel *p, const OptimConfig *oc, double *lr_out) {
    const Model *m = p->m;
    ddp_flush(p);  /* first: a bucket it starts is a late one, which moves late_hi */
    size_t n = m->n_flat, split = oc->grad_clip > 0 ? n : p->late_hi;
    double lr = lr_at(oc, p->adam_steps);
    int step = ++p->adam_steps;
    for (int u = 0; u < m->n_units; u++)
        if (!p->greq_late[u]) par_wait(p, &p->greq[u]);
    double sumsq = 0;
    int side = side_units(p, split);
    if (split < n) {
        sumsq = op_sumsq(st_at(p->grads, split), n - split);
        if (!side) update(p, split, n - split, oc, lr, step, 1.0f);
    }
    for (int u = 0; u < m->n_units; u++) par_wait(p, &p->greq[u]);
    trace_mark(NULL, "late reductions in");
    ddp_finish_erows(p);
    sumsq += op_sumsq(p->grads, split);
    double norm = sqrt(sumsq);
    update(p, 0, split, oc, lr, step, clip_scale(oc, norm));
    if (side) {
        op_side_begin();
        for (int u = 0; u < m->n_units; u++) {
            const Unit *un = &m->units[u];
            if (un->offset < split) continue;
            update(p, un->offset, un->n_padded, oc, lr, step, 1.0f);
            op_zero(st_at(p->grads, un->offset), un->n_padded * ops_state_size());  /* the next step's */
            op_side_mark(u);
            p->side_pending[u] = 1;
        }
        op_side_end();
        p->side_lo = split;
    }
    /* with precision=mixed AdamW wrote the bf16 copy too: it is current */
    *lr_out = lr;
    return norm;
}

void ddp_setup(Parallel *p) {
    p->greq_late = xcalloc((size_t)p->m->n_units, 1);
    size_t bytes = p->m->n_flat * ops_state_size();
    p->params = op_alloc(bytes);
    p->grads = comm_alloc(p->group, bytes);  /* on one machine's GPUs: reduced on the copy engines */
    p->mom1 = op_alloc(bytes);
    p->mom2 = op_alloc(bytes);
    model_point_units(p->m, p->params, p->grads);
    const char *env = getenv("MESHTRAIN_EMBED_ROWS");  /* =0: reduce the whole embedding (A/B) */
    p->erows_cap = env && !strcmp(env, "0") ? 0 : ddp_erows_cap(p->m, p->D);
    p->erows = op_alloc(p->erows_cap * sizeof(int));
    p->ebuf = op_alloc(p->erows_cap * (size_t)p->m->E * ops_state_size());
    p->n_erows = SIZE_MAX;
    p->hooks.grad_begin = ddp_progress;
    p->hooks.grad_ready = ddp_grad_ready;
    p->hooks.gather = par_whole_gather;  /* waits for a unit's update on the side queue */
    p->side_pending = xcalloc((size_t)p->m->n_units, 1);
    const char *side = getenv("MESHTRAIN_SIDE_UPDATE");  /* =0: the update in one queue (A/B) */
    p->side_update = !(side && !strcmp(side, "0"));
}
