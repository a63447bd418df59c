/* DDP: every rank holds the whole model, gradients and optimizer state; each unit's
 * gradient is averaged over dp with a non-blocking all-reduce started the moment that
 * unit's backward ends, so it overlaps the backward of the units below it (one bucket per
 * unit). Every rank then takes the same AdamW step. */
#include "ops.h"
#include "parallel_impl.h"
#include "util.h"

static void ddp_grad_ready(void *ctx, int u) {
    Parallel *p = ctx;
    const Unit *un = &p->m->units[u];
    comm_iallreduce(p->group, st_at(p->grads, un->offset), un->n_padded, par_ctype(), COMM_AVG, &p->greq[u],
                    "gradient all-reduce");
    if (!p->overlap) par_wait(p, &p->greq[u]);
    par_progress(p);
}

static void ddp_progress(void *ctx, int u) {
    (void)u;
    par_progress(ctx);
}

void ddp_setup(Parallel *p) {
    size_t bytes = p->m->n_flat * ops_state_size();
    p->params = op_alloc(bytes);
    p->grads = op_alloc(bytes);
    p->mom1 = op_alloc(bytes);
    p->mom2 = op_alloc(bytes);
    model_point_units(p->m, p->params, p->grads);
    p->hooks.grad_begin = ddp_progress;
    p->hooks.grad_ready = ddp_grad_ready;
}
