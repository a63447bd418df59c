/* ZeRO-1 and ZeRO-2: every rank holds the whole parameters, but AdamW's moments only for
 * its shard of each unit. A unit's gradient is reduce-scattered (averaged) as soon as its
 * backward ends; each rank updates its shard; the parameters are then all-gathered,
 * overlapping the next forward.
 * ZeRO-1 keeps a whole gradient buffer; ZeRO-2 (shard_strategy=grad_op) accumulates a
 * unit's gradient in a slot that is reused once its reduce-scatter has drained it, so the
 * whole gradient never exists on one rank. */
#include "ops.h"
#include "parallel_impl.h"
#include "util.h"

static void zero1_grad_ready(void *ctx, int u) {
    Parallel *p = ctx;
    par_reduce_scatter_grad(p, u, st_at(p->grads, p->m->units[u].offset), &p->greq[u]);
    par_progress(p);
}

void zero2_grad_begin(void *ctx, int u) {
    Parallel *p = ctx;
    if (p->grad_open[u]) return;  /* tied tok_embed: opened by the head already */
    p->grad_open[u] = 1;
    p->m->ugrads[u] = par_grad_slot(p, u);
    par_progress(p);
}

void zero2_grad_ready(void *ctx, int u) {
    Parallel *p = ctx;
    Slot *slots = par_grad_slots(p);
    for (int i = 0; i < N_SLOTS; i++)
        if (slots[i].grad && slots[i].unit == u) par_reduce_scatter_grad(p, u, slots[i].buf, &slots[i].req);
    p->grad_open[u] = 2;
    p->m->ugrads[u] = NULL;
    par_progress(p);
}

/* Started in the order the next forward needs the units (the embedding first); each is
 * waited for by the gather hook of its unit (par_whole_gather), so they overlap the
 * forward instead of ending the step. */
void zero_gather_params(Parallel *p) {
    for (int u = 0; u < p->m->n_units; u++) {
        comm_iallgather(p->group, st_at(p->params, p->m->units[u].offset), shard_len(p, u), par_ctype(), &p->greq[u],
                        "parameter all-gather");
        if (!p->overlap) par_wait(p, &p->greq[u]);
    }
}

void zero_setup(Parallel *p) {
    size_t full = p->m->n_flat * ops_state_size(), shard = p->n_shard * ops_state_size();
    p->params = op_alloc(full);
    p->hooks.gather = par_whole_gather;
    p->gshard = op_alloc(shard);
    p->mom1 = op_alloc(shard);
    p->mom2 = op_alloc(shard);
    if (p->kind == PAR_ZERO1) {
        p->grads = op_alloc(full);
        model_point_units(p->m, p->params, p->grads);
        p->hooks.grad_ready = zero1_grad_ready;
    } else {
        par_alloc_slots(p, p->gslots, 0);
        model_point_units(p->m, p->params, NULL);
        p->hooks.grad_begin = zero2_grad_begin;
        p->hooks.grad_ready = zero2_grad_ready;
    }
}
