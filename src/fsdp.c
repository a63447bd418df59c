/* FSDP (ZeRO-3, shard_strategy=full) and hybrid FSDP (shard_strategy=hybrid).
 * Each rank keeps only its shard of every unit's parameters, gradients and moments. A
 * unit is all-gathered into a slot just before its forward, released right after, and
 * gathered again before its backward; while one unit computes, the next one's gather is
 * already in flight (prefetch). Gradients go through ZeRO-2's hooks, in slots of the same
 * pool (see N_SLOTS): accumulated per unit, reduce-scattered into the shard as soon as the
 * unit's backward ends. Hybrid shards inside a group (a node) and all-reduces the gradient
 * shards across the groups. */
#include "ops.h"
#include "parallel_impl.h"
#include "util.h"

static Slot *slot_of(Parallel *p, int u) {
    for (int i = 0; i < N_SLOTS; i++)
        if (p->pslots[i].unit == u && !p->pslots[i].grad) return &p->pslots[i];
    return NULL;
}

/* Starts gathering unit u into a pool slot. A prefetch (may_fail) gives up, returning
 * NULL, when every slot that fits is taken; a gather that is needed now may wait for a
 * gradient slot to drain. */
static Slot *start_gather(Parallel *p, int u, int may_fail) {
    Slot *s = par_take_slot(p, p->pslots, u, 0, may_fail);
    if (!s) return NULL;
    size_t n = shard_len(p, u);
    op_copy(st_at(s->buf, (size_t)p->r * n), st_at(p->pshard, shard_off(p, u)), n * ops_state_size());
    comm_iallgather(p->group, s->buf, n, par_ctype(), &s->req, "parameter all-gather");
    return s;
}

static void fsdp_gather(void *ctx, int u, int next) {
    Parallel *p = ctx;
    Slot *s = slot_of(p, u);
    if (!s) s = start_gather(p, u, 0);
    par_wait(p, &s->req);
    p->refs[u]++;
    p->m->uparams[u] = s->buf;
    void *cbuf = p->cslots[s - p->pslots];
    if (cbuf) {  /* precision=mixed: cast the gathered unit once per gather */
        if (!s->cast) op_to_act(cbuf, s->buf, p->m->units[u].n_padded);
        s->cast = 1;
        p->m->ucompute[u] = cbuf;
    }
    if (next >= 0 && !slot_of(p, next)) {
        Slot *q = start_gather(p, next, 1);
        if (q && !p->overlap) par_wait(p, &q->req);
    }
    par_progress(p);
}

static void fsdp_release(void *ctx, int u) {
    Parallel *p = ctx;
    if (--p->refs[u] > 0) return;
    Slot *s = slot_of(p, u);
    if (s) s->unit = -1;
    p->m->uparams[u] = NULL;
    p->m->ucompute[u] = NULL;
}

/* Prefetched copies become stale once the optimizer steps: drop them between steps. */
void fsdp_drop_prefetch(Parallel *p) {
    for (int i = 0; i < N_SLOTS; i++) {
        Slot *s = &p->pslots[i];
        if (s->unit >= 0 && !s->grad && p->refs[s->unit] == 0) {
            par_wait(p, &s->req);
            s->unit = -1;
        }
    }
}

void fsdp_setup(Parallel *p) {
    size_t shard = p->n_shard * ops_state_size();
    p->pshard = op_alloc(shard);
    p->gshard = op_alloc(shard);
    p->mom1 = op_alloc(shard);
    p->mom2 = op_alloc(shard);
    par_alloc_slots(p, p->pslots, 1);  /* one pool for parameters and gradients */
    model_point_units(p->m, NULL, NULL);
    p->hooks.gather = fsdp_gather;
    p->hooks.release = fsdp_release;
    p->hooks.grad_begin = zero2_grad_begin;
    p->hooks.grad_ready = zero2_grad_ready;
}
