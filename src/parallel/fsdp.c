/* FSDP (ZeRO-3, shard_strategy=full) and hybrid FSDP (shard_strategy=hybrid).
 * Each rank keeps only its shard of every unit's parameters, gradients and optimizer state. A
 * unit is all-gathered into a slot just before its forward, released right after, and
 * gathered again before its backward; while one unit computes, the next one's gather is
 * already in flight (prefetch). Gradients go through the shared slot hooks (as ZeRO-2's),
 * in slots of the same pool (see N_SLOTS): accumulated per unit, reduce-scattered into the
 * shard as soon as the unit's backward ends. Hybrid shards inside a group (a node) and
 * all-reduces the gradient shards across the groups (the replicas) before the update. */
#include <stdlib.h>
#include "ops.h"
#include "parallel_impl.h"
#include "util.h"

typedef struct {
    int *refs;      /* per unit: gather references (a unit gathered twice is released twice) */
    CommReq *rreq;  /* per unit: hybrid's all-reduce of its gradient shard across the replicas */
} Fsdp;

static Slot *slot_of(Parallel *p, int u) {
    for (int i = 0; i < N_SLOTS; i++)
        if (p->slots[i].unit == u && !p->slots[i].grad) return &p->slots[i];
    return NULL;
}

/* Starts gathering unit u into a pool slot. A prefetch (may_fail) gives up, returning
 * NULL, when every slot that fits is taken; a gather that is needed now may wait for a
 * gradient slot to drain. */
static Slot *start_gather(Parallel *p, int u, int may_fail) {
    /* not before its update is back in the shard (a prefetch does not wait for it) */
    if (!par_update_ready(p, u, !may_fail)) return NULL;
    Slot *s = par_take_slot(p, u, 0, may_fail);
    if (!s) return NULL;
    size_t n = shard_len(p, u);
    par_shard_in(p, u, st_at(s->buf, (size_t)p->r * n));
    comm_iallgather(p->group, s->buf, n, par_ctype(), &s->req, "parameter all-gather");
    return s;
}

static void fsdp_gather(void *ctx, int u, int next) {
    Parallel *p = ctx;
    Fsdp *f = p->st;
    Slot *s = slot_of(p, u);
    if (!s) s = start_gather(p, u, 0);
    par_wait(p, &s->req);
    f->refs[u]++;
    p->m->uparams[u] = s->buf;
    void *cbuf = p->cslots[s - p->slots];
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
    Fsdp *f = p->st;
    if (--f->refs[u] > 0) return;
    Slot *s = slot_of(p, u);
    if (s) s->unit = -1;
    p->m->uparams[u] = NULL;
    p->m->ucompute[u] = NULL;
}

/* Prefetched copies become stale once the optimizer steps: drop them between steps. */
static void fsdp_begin_step(Parallel *p) {
    Fsdp *f = p->st;
    for (int i = 0; i < N_SLOTS; i++) {
        Slot *s = &p->slots[i];
        if (s->unit >= 0 && !s->grad && f->refs[s->unit] == 0) {
            par_wait(p, &s->req);
            s->unit = -1;
        }
    }
}

static double fsdp_step(Parallel *p, const OptimConfig *oc, double *lr_out) {
    Fsdp *f = p->st;
    const Model *m = p->m;
    par_wait_grads(p);  /* the gradient shards are now averaged over the group */
    if (p->replicas)  /* hybrid: average each shard over the replicas too */
        for (int u = 0; u < m->n_units; u++) {
            par_replicas_allreduce(p, u, &f->rreq[u]);
            if (!p->overlap) par_wait(p, &f->rreq[u]);
        }
    for (int u = 0; u < m->n_units; u++) par_wait(p, &f->rreq[u]);
    double norm = par_shard_norm(p);
    float scale;
    *lr_out = par_update_begin(p, oc);
    if (!par_update_go(p, oc, &norm, &scale)) return norm;  /* skipped: the shards are as they were */
    par_update_stats(p, scale);
    /* every shard at once (adjacent in pshard); where the updates reach the device later,
     * each unit's gather waits for its own. No compute copy to mark stale: the bf16 copies
     * are cast at each gather. */
    par_update(p, 0, m->n_units, scale);
    return norm;
}

static void fsdp_setup(Parallel *p) {
    Fsdp *f = p->st = xcalloc(1, sizeof *f);
    f->refs = xcalloc((size_t)p->m->n_units, sizeof(int));
    f->rreq = xcalloc((size_t)p->m->n_units, sizeof(CommReq));
    size_t shard = p->n_shard * ops_state_size();
    p->pshard = par_alloc_params(p, shard);  /* NULL where the optimizer's host copy is the shard */
    p->gshard = op_alloc(shard);
    par_alloc_slots(p, 1);  /* one pool for parameters and gradients */
    model_point_units(p->m, NULL, NULL);
    par_compute_slots(p);
}

static void fsdp_free(Parallel *p) {
    Fsdp *f = p->st;
    for (int u = 0; u < p->m->n_units; u++) par_wait(p, &f->rreq[u]);
    free(f->refs); free(f->rreq);
    free(f);
}

/* Shards of everything; the pool counted once (parameters), with a bf16 copy per slot. */
static ParallelBytes fsdp_bytes(const Model *layout, int D, size_t state_size, size_t compute_size) {
    size_t shard = layout->n_flat * state_size / (size_t)D, pool = par_slot_elems(layout, 1);
    return (ParallelBytes){shard + pool * state_size, shard, shard, compute_size ? pool * compute_size : 0, 0};
}

/* FSDP's functions, the same for both tables below */
#define FSDP_FUNCS                                                                                   \
    .setup = fsdp_setup, .free = fsdp_free, .gather = fsdp_gather, .release = fsdp_release,           \
    .grad_begin = par_slot_grad_begin, .grad_ready = par_slot_grad_ready, .init_weights = par_init_shard, \
    .begin_step = fsdp_begin_step, .step = fsdp_step, .ranges = par_shard_ranges, .bytes = fsdp_bytes

const ParallelStrategy par_fsdp = {.name = "fsdp", FSDP_FUNCS};

/* The same, sharded over mesh->shard and replicated over mesh->replicate. */
const ParallelStrategy par_hybrid = {.name = "hybrid", .replicated = 1, FSDP_FUNCS};
