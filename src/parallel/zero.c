/* ZeRO-1 and ZeRO-2: every rank holds the whole parameters, but the optimizer's state only
 * for its shard of each unit. A unit's gradient is reduce-scattered (averaged) as soon as its
 * backward ends; each rank updates its shard; the parameters are then all-gathered,
 * overlapping the next forward.
 * ZeRO-1 keeps a whole gradient buffer; ZeRO-2 (shard_strategy=grad_op) accumulates a
 * unit's gradient in a slot that is reused once its reduce-scatter has drained it, so the
 * whole gradient never exists on one rank (the shared slot hooks, parallel_impl.h).
 * greq[u] carries unit u's gradient reduce-scatter (ZeRO-1), then its parameter
 * all-gather. Where the optimizer's updates reach the device later, unit by unit (from the
 * host: par_update_later), the all-gather of a unit starts only once its update is back on
 * the device: at its gather hook, or as the previous unit's prefetch; the state is which
 * units' all-gathers are still to start. */
#include <stdlib.h>
#include <string.h>
#include "ops.h"
#include "parallel_impl.h"
#include "util.h"

typedef struct { unsigned char *pending; } Zero;  /* per unit: all-gather still to start (par_update_later) */

static void zero1_grad_ready(void *ctx, int u) {
    Parallel *p = ctx;
    par_reduce_scatter_grad(p, u, st_at(p->grads, p->m->units[u].offset), &p->greq[u]);
    par_grad_final(p, u, &p->greq[u]);
    par_progress(p);
}

static void gather_unit(Parallel *p, int u) {
    comm_iallgather(p->group, st_at(p->params, p->m->units[u].offset), shard_len(p, u), par_ctype(), &p->greq[u],
                    "parameter all-gather");
    if (!p->overlap) par_wait(p, &p->greq[u]);
}

/* Starts unit u's all-gather if it is still to start, once its update is on the device
 * (wait = 0: only if it already is). */
static void gather_pending(Parallel *p, int u, int wait) {
    Zero *z = p->st;
    if (u < 0 || !z->pending[u] || !par_update_ready(p, u, wait)) return;
    z->pending[u] = 0;
    gather_unit(p, u);
}

/* Waits for unit u's parameter all-gather (started after the last update, overlapping
 * this forward); with precision=mixed remakes its bf16 copy if it is behind. */
static void zero_gather(void *ctx, int u, int next) {
    Parallel *p = ctx;
    gather_pending(p, u, 1);
    gather_pending(p, next, 0);
    par_wait(p, &p->greq[u]);
    par_cast_unit(p, u);
}

/* Every rank updates its shard of the whole parameters, then all gather: in the order the
 * next forward needs the units (the embedding first), each waited for by the gather hook of
 * its unit (zero_gather), so they overlap the forward instead of ending the step. Where the
 * updates reach the device later, unit by unit, each unit's all-gather starts at its gather
 * hook instead, once its update is in. */
static double zero_step(Parallel *p, const OptimConfig *oc, double *lr_out) {
    Model *m = p->m;
    Zero *z = p->st;
    par_wait_grads(p);  /* the gradient is now averaged over the group */
    double norm = par_shard_norm(p);
    float scale;
    *lr_out = par_update_begin(p, oc);
    /* skipped: the parameters are as they were, whole on every rank: nothing to gather */
    if (!par_update_go(p, oc, &norm, &scale)) return norm;
    par_update_stats(p, scale);
    for (int u = 0; u < m->n_units; u++) par_update(p, u, u + 1, scale);  /* (not adjacent in params) */
    memset(z->pending, 1, (size_t)m->n_units);
    if (!par_update_later(p))
        for (int u = 0; u < m->n_units; u++) gather_pending(p, u, 1);
    par_params_stale(p);
    return norm;
}

/* ZeRO-1's whole gradient is cleared before each step (ZeRO-2's slots are at each take). */
static void zero1_begin_step(Parallel *p) { op_zero(p->grads, p->m->n_flat * ops_state_size()); }

/* What both keep: the whole parameters and the gradient's shard (the optimizer keeps its
 * state of that shard). The setups then add ZeRO-1's whole gradient buffer or ZeRO-2's
 * gradient slots. */
static void zero_alloc(Parallel *p) {
    size_t full = p->m->n_flat * ops_state_size(), shard = p->n_shard * ops_state_size();
    Zero *z = p->st = xcalloc(1, sizeof *z);
    z->pending = xcalloc((size_t)p->m->n_units, 1);
    p->params = op_alloc(full);
    p->gshard = op_alloc(shard);
}

static void zero1_setup(Parallel *p) {
    zero_alloc(p);
    p->grads = op_alloc(p->m->n_flat * ops_state_size());
    model_point_units(p->m, p->params, p->grads);
    par_compute_whole(p);
}

static void zero2_setup(Parallel *p) {
    zero_alloc(p);
    par_alloc_slots(p, 0);
    model_point_units(p->m, p->params, NULL);
    par_compute_whole(p);
}

static void zero_free(Parallel *p) {
    Zero *z = p->st;
    free(z->pending);
    free(z);
}

static ParallelBytes zero1_bytes(const Model *layout, int D, size_t state_size, size_t compute_size) {
    size_t full = layout->n_flat * state_size, shard = full / (size_t)D;
    return (ParallelBytes){full, full + shard, shard, compute_size ? layout->n_flat * compute_size : 0, 0};
}

static ParallelBytes zero2_bytes(const Model *layout, int D, size_t state_size, size_t compute_size) {
    size_t full = layout->n_flat * state_size, shard = full / (size_t)D;
    return (ParallelBytes){full, par_slot_elems(layout, 0) * state_size + shard, shard,
                           compute_size ? layout->n_flat * compute_size : 0, 0};
}

const ParallelStrategy par_zero1 = {
    .name = "zero1",
    .setup = zero1_setup,
    .free = zero_free,
    .gather = zero_gather,
    .grad_ready = zero1_grad_ready,
    .init_weights = par_init_whole,
    .params_changed = par_params_stale,
    .begin_step = zero1_begin_step,
    .step = zero_step,
    .ranges = par_shard_ranges,
    .bytes = zero1_bytes,
};

const ParallelStrategy par_zero2 = {
    .name = "zero2",
    .setup = zero2_setup,
    .free = zero_free,
    .gather = zero_gather,
    .grad_begin = par_slot_grad_begin,
    .grad_ready = par_slot_grad_ready,
    .init_weights = par_init_whole,
    .params_changed = par_params_stale,
    .step = zero_step,
    .ranges = par_shard_ranges,
    .bytes = zero2_bytes,
};
