#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "ops.h"
#include "parallel_impl.h"
#include "util.h"

const char *parallel_kind_name(ParallelKind k) {
    static const char *names[] = {"ddp", "zero1", "zero2", "fsdp", "hybrid"};
    return names[k];
}

Parallel *parallel_create(ParallelKind kind, Model *m, Mesh *mesh, int overlap) {
    Parallel *p = xcalloc(1, sizeof *p);
    for (int i = 0; i < N_SLOTS; i++) p->pslots[i].unit = p->gslots[i].unit = -1;
    p->kind = kind;
    p->m = m;
    p->mesh = mesh;
    p->overlap = overlap;
    p->group = kind == PAR_HYBRID ? &mesh->shard : &mesh->dp;
    p->replicas = kind == PAR_HYBRID ? &mesh->replicate : &mesh->shard;  /* shard == dp: size 1 unless hybrid */
    if (kind != PAR_HYBRID) p->replicas = NULL;
    p->D = p->group->size;
    p->r = p->group->rank;
    for (int u = 0; u < m->n_units; u++) {
        if (m->units[u].n_padded % (size_t)p->D)
            die(EXIT_RUN_FAILURE, "internal: unit %d is not padded to the shard group size %d", u, p->D);
    }
    p->n_shard = m->n_flat / (size_t)p->D;
    p->greq = xcalloc((size_t)m->n_units, sizeof(CommReq));
    p->rreq = xcalloc((size_t)m->n_units, sizeof(CommReq));
    p->refs = xcalloc((size_t)m->n_units, sizeof(int));
    p->grad_open = xcalloc((size_t)m->n_units, 1);
    p->hooks.ctx = p;
    p->side_lo = SIZE_MAX;
    switch (kind) {
    case PAR_DDP: ddp_setup(p); break;
    case PAR_ZERO1: case PAR_ZERO2: zero_setup(p); break;
    case PAR_FSDP: case PAR_HYBRID: fsdp_setup(p); break;
    }
    par_setup_compute(p);
    return p;
}

void par_params_stale(Parallel *p) {
    if (p->cstale) memset(p->cstale, 1, (size_t)p->m->n_units);
}

void par_whole_gather(void *ctx, int u, int next) {
    Parallel *p = ctx;
    (void)next;
    if (p->side_pending && p->side_pending[u]) {
        op_side_wait(u);
        p->side_pending[u] = 0;
    }
    if (p->kind == PAR_ZERO1 || p->kind == PAR_ZERO2) par_wait(p, &p->greq[u]);
    if (p->cstale && p->cstale[u]) {
        const Unit *un = &p->m->units[u];
        op_to_act(act_at(p->cparams, un->offset), st_at(p->params, un->offset), un->n_padded);
        p->cstale[u] = 0;
    }
}

void par_setup_compute(Parallel *p) {
    if (ops_precision() != OPS_MIXED) return;
    Model *m = p->m;
    if (p->params) {
        p->cparams = op_alloc(m->n_flat * ops_act_size());
        for (int u = 0; u < m->n_units; u++) m->ucompute[u] = act_at(p->cparams, m->units[u].offset);
        p->cstale = xmalloc((size_t)m->n_units);
        par_params_stale(p);
        p->hooks.gather = par_whole_gather;
    } else {
        size_t caps[N_SLOTS];
        par_slot_caps(m, 1, caps);  /* a copy per pool slot (those holding gradients go unused) */
        for (int i = 0; i < N_SLOTS; i++) p->cslots[i] = op_alloc(caps[i] * ops_act_size());
    }
}

void parallel_set_bucket(Parallel *p, size_t bytes) { p->bucket_bytes = bytes; }

int parallel_wants_embedding_rows(const Parallel *p) { return p->erows_cap > 0; }

void parallel_set_embedding_rows(Parallel *p, const int *rows, size_t n) {
    p->n_erows = SIZE_MAX;
    p->hooks.embed_last = 0;
    if (!p->erows_cap || n > p->erows_cap) return;
    op_upload(p->erows, rows, n * sizeof(int));
    p->n_erows = n;
    p->hooks.embed_last = 1;  /* its reduction is small: layer 0's overlaps its backward instead */
}

void parallel_free(Parallel *p) {
    if (!p) return;
    /* Nothing may still be in flight into buffers about to go: an evaluation's forward
     * leaves a prefetched gather behind (FSDP), with no step after it to wait for it. */
    for (int u = 0; u < p->m->n_units; u++) { par_wait(p, &p->greq[u]); par_wait(p, &p->rreq[u]); }
    for (int i = 0; i < N_SLOTS; i++) { par_wait(p, &p->pslots[i].req); par_wait(p, &p->gslots[i].req); }
    op_free(p->cparams);
    op_free(p->erows); op_free(p->ebuf);
    for (int i = 0; i < N_SLOTS; i++) op_free(p->cslots[i]);
    op_free(p->params); comm_buffer_free(p->grads); op_free(p->pshard); op_free(p->gshard); op_free(p->mom1);
    op_free(p->mom2);
    for (int i = 0; i < N_SLOTS; i++) { op_free(p->pslots[i].buf); op_free(p->gslots[i].buf); }
    free(p->greq); free(p->rreq); free(p->refs); free(p->grad_open); free(p->greq_late); free(p->cstale);
    free(p->side_pending);
    free(p);
}

const UnitHooks *parallel_hooks(Parallel *p) { return &p->hooks; }
int parallel_adam_steps(const Parallel *p) { return p->adam_steps; }
void parallel_set_adam_steps(Parallel *p, int steps) { p->adam_steps = steps; }
void parallel_params_changed(Parallel *p) { par_params_stale(p); }
double parallel_comm_wait(const Parallel *p) { return p->wait_s; }

void par_slot_caps(const Model *m, int pool, size_t caps[N_SLOTS]) {
    size_t big = m->units[0].n_padded, layer = m->L > 0 ? m->units[1].n_padded : 0;
    if (m->units[m->L + 1].n_padded > big) big = m->units[m->L + 1].n_padded;
    int tied = m->c.tie_embeddings;
    if (pool) {  /* see N_SLOTS */
        caps[0] = big; caps[1] = big; caps[2] = layer; caps[3] = layer; caps[4] = tied ? layer : 0;
    } else {
        caps[0] = big; caps[1] = layer; caps[2] = layer; caps[3] = tied ? big : 0; caps[4] = 0;
    }
}

void par_alloc_slots(Parallel *p, Slot *slots, int pool) {
    size_t caps[N_SLOTS];
    par_slot_caps(p->m, pool, caps);
    for (int i = 0; i < N_SLOTS; i++) {
        slots[i].cap = caps[i];
        slots[i].buf = op_alloc(caps[i] * ops_state_size());  /* NULL for an unused slot */
        slots[i].unit = -1;
    }
}

/* Free: holds nothing, or a gradient whose reduction has finished. A gradient still
 * accumulating (tok_embed from the head to the end when tied) is never taken. */
static int slot_free(Parallel *p, Slot *s) {
    return s->unit < 0 || (s->grad && p->grad_open[s->unit] == 2 && comm_test(&s->req));
}

/* A gradient slot whose reduction is still in flight. */
static int draining(Parallel *p, Slot *s) { return s->unit >= 0 && s->grad && p->grad_open[s->unit] == 2; }

/* Of the draining slots of capacity in [lo, hi], the one that started first: the backward
 * runs the units in decreasing order, so the highest unit. NULL if none. */
static Slot *oldest_draining(Parallel *p, Slot *slots, size_t lo, size_t hi) {
    Slot *o = NULL;
    for (int i = 0; i < N_SLOTS; i++)
        if (slots[i].cap >= lo && slots[i].cap <= hi && draining(p, &slots[i]) && (!o || slots[i].unit > o->unit))
            o = &slots[i];
    return o;
}

Slot *par_take_slot(Parallel *p, Slot *slots, int u, int grad, int may_fail) {
    size_t need = p->m->units[u].n_padded, fit = 0;
    Slot *best = NULL;
    for (int i = 0; i < N_SLOTS; i++) {
        if (slots[i].cap < need) continue;
        if (!fit || slots[i].cap < fit) fit = slots[i].cap;
        if ((!best || slots[i].cap < best->cap) && slot_free(p, &slots[i])) best = &slots[i];
    }
    /* A gradient does not take a larger slot while one of the size that fits it is only
     * draining: it waits for that one. Else a layer's gradient, still open, could hold the
     * big slot the embedding's gradient needs next (layer 0's stays open across it). */
    Slot *w = NULL;
    if (grad && best && best->cap > fit) w = oldest_draining(p, slots, fit, fit);
    if (!best && !may_fail) {  /* all busy: wait for one, of the size that fits if there is one */
        w = oldest_draining(p, slots, fit, fit);
        if (!w) w = oldest_draining(p, slots, need, (size_t)-1);
    }
    if (w) {
        par_wait(p, &w->req);
        best = w;
    }
    if (!best) {
        if (may_fail) return NULL;
        die(EXIT_RUN_FAILURE, "internal: no free %s slot for unit %d", grad ? "gradient" : "parameter", u);
    }
    best->unit = u;
    best->grad = grad;
    best->cast = 0;
    return best;
}

/* The init writes host fp32: on the cpu straight into the whole parameters or this rank's
 * shard (FSDP builds only its shard of each unit); on a device through one host buffer,
 * uploaded unit by unit (rounded to bf16 with precision=bf16). */
void parallel_init_weights(Parallel *p, uint64_t seed) {
    Model *m = p->m;
    size_t caps[N_SLOTS];
    int big = 0;
    par_slot_caps(m, 1, caps);
    for (int i = 1; i < N_SLOTS; i++) big = caps[i] > caps[big] ? i : big;
    float *host = ops_host_memory() ? NULL : xaligned_alloc(caps[big] * sizeof(float));
    for (int u = 0; u < m->n_units; u++) {
        size_t n = p->params ? m->units[u].n_padded : shard_len(p, u), lo = p->params ? 0 : (size_t)p->r * n;
        void *dst = p->params ? st_at(p->params, m->units[u].offset) : st_at(p->pshard, shard_off(p, u));
        model_init_range(m, u, lo, lo + n, host ? host : dst, seed);
        if (host) op_upload_state(dst, host, n);
    }
    free(host);
    par_params_stale(p);
}

void par_wait(Parallel *p, CommReq *r) {
    if (!r->active) return;
    /* While the device still runs work queued before this wait, waiting costs the step
     * nothing (the host is ahead): only the rest counts. After a few seconds comm_wait takes
     * over anyway, with its timeout for a lost peer. */
    comm_poll(r, ops_idle, 5.0);
    double t1 = now_seconds();
    comm_wait(r);
    p->wait_s += now_seconds() - t1;
}

void par_progress(Parallel *p) {
    for (int u = 0; u < p->m->n_units; u++) {
        comm_test(&p->greq[u]);
        comm_test(&p->rreq[u]);
    }
    for (int i = 0; i < N_SLOTS; i++) { comm_test(&p->pslots[i].req); comm_test(&p->gslots[i].req); }
}

void *par_grad_slot(Parallel *p, int u) {
    Slot *slot = par_take_slot(p, par_grad_slots(p), u, 1, 0);
    op_zero(slot->buf, p->m->units[u].n_padded * ops_state_size());
    return slot->buf;
}

void par_reduce_scatter_grad(Parallel *p, int u, void *src, CommReq *req) {
    comm_ireduce_scatter(p->group, src, st_at(p->gshard, shard_off(p, u)), shard_len(p, u), par_ctype(), COMM_AVG,
                         req, "gradient reduce-scatter");
    if (!p->overlap) par_wait(p, req);
}

void parallel_begin_step(Parallel *p) {
    p->wait_s = 0;
    if (p->pshard) fsdp_drop_prefetch(p);
    if (p->grads) {  /* DDP's side queue zeroes the gradients of the units it updates, after them */
        size_t hi = p->side_lo < p->m->n_flat ? p->side_lo : p->m->n_flat;
        op_zero(p->grads, hi * ops_state_size());
        p->side_lo = SIZE_MAX;
    }
    memset(p->grad_open, 0, (size_t)p->m->n_units);
    if (p->greq_late) memset(p->greq_late, 0, (size_t)p->m->n_units);
    p->late_hi = 0;
    for (int i = 0; i < N_SLOTS; i++) {
        Slot *s = &par_grad_slots(p)[i];
        if (s->grad) s->unit = -1;
    }
}

double parallel_step(Parallel *p, const OptimConfig *oc, double *lr_out) {
    if (p->kind == PAR_DDP) return ddp_step(p, oc, lr_out);
    Model *m = p->m;
    /* Every gradient collective must be done: the gradient is now averaged over the group. */
    for (int u = 0; u < m->n_units; u++) par_wait(p, &p->greq[u]);
    for (int i = 0; i < N_SLOTS; i++) par_wait(p, &par_grad_slots(p)[i].req);
    if (p->replicas)  /* hybrid: average each shard over the replicas too */
        for (int u = 0; u < m->n_units; u++) {
            comm_iallreduce(p->replicas, st_at(p->gshard, shard_off(p, u)), shard_len(p, u), par_ctype(), COMM_AVG,
                            &p->rreq[u], "gradient all-reduce across replicas");
            if (!p->overlap) par_wait(p, &p->rreq[u]);
        }
    for (int u = 0; u < m->n_units; u++) par_wait(p, &p->rreq[u]);

    /* Global norm: over the shards across the group. */
    double sumsq = op_sumsq(p->gshard, p->n_shard);
    comm_allreduce_double(p->group, &sumsq, 1);
    double norm = sqrt(sumsq);
    float scale = clip_scale(oc, norm);
    double lr = lr_at(oc, p->adam_steps);
    p->adam_steps++;
    float b1 = (float)oc->beta1, b2 = (float)oc->beta2, eps = (float)oc->eps, wd = (float)oc->weight_decay;
    if (p->pshard) {
        op_adamw(p->pshard, p->gshard, p->mom1, p->mom2, p->n_shard, (float)lr, b1, b2, eps, wd, p->adam_steps, scale);
    } else {
        /* ZeRO: this rank updates its shard of the whole parameters, then all gather. */
        for (int u = 0; u < m->n_units; u++) {
            size_t so = shard_off(p, u);
            op_adamw(st_at(p->params, m->units[u].offset + (size_t)p->r * shard_len(p, u)), st_at(p->gshard, so),
                     st_at(p->mom1, so), st_at(p->mom2, so), shard_len(p, u), (float)lr, b1, b2, eps, wd, p->adam_steps,
                     scale);
        }
        zero_gather_params(p);
    }
    par_params_stale(p);
    *lr_out = lr;
    return norm;
}

int parallel_ranges(const Parallel *p, int write, OwnedRange *out, int max) {
    const Model *m = p->m;
    int n = 0;
    /* Hybrid replicas hold the same shards: only the first replica saves them. */
    if (write && p->replicas && p->replicas->rank != 0) return 0;
    for (int u = 0; u < m->n_units && n < max; u++) {
        size_t s = shard_len(p, u), lo = (size_t)p->r * s, hi = lo + s, nu = m->units[u].n;
        if (hi > nu) hi = nu;
        int shard_ok = lo < hi;
        size_t off = m->units[u].offset, so = shard_off(p, u);
        void *base_p = p->params ? st_at(p->params, off) : NULL;
        if (p->kind == PAR_DDP) {
            /* replicated: each rank saves its even slice; on load every rank needs all */
            if (write) {
                if (shard_ok && n < max)
                    out[n++] = (OwnedRange){u, lo, hi, st_at(base_p, lo), st_at(p->mom1, off + lo), st_at(p->mom2, off + lo)};
            } else if (n < max) {
                out[n++] = (OwnedRange){u, 0, nu, base_p, st_at(p->mom1, off), st_at(p->mom2, off)};
            }
            continue;
        }
        void *sp = p->pshard ? st_at(p->pshard, so) : st_at(base_p, lo);
        if (shard_ok && n < max) out[n++] = (OwnedRange){u, lo, hi, sp, st_at(p->mom1, so), st_at(p->mom2, so)};
        /* ZeRO keeps whole parameters: on load it needs every unit's parameters too. */
        if (!write && p->params && n < max) out[n++] = (OwnedRange){u, 0, nu, base_p, NULL, NULL};
    }
    return n;
}

ParallelBytes parallel_bytes(ParallelKind kind, const Model *layout, int D, size_t state_size, size_t compute_size) {
    size_t full = layout->n_flat * state_size, shard = full / (size_t)D, caps[N_SLOTS], elems = 0, pool = 0;
    par_slot_caps(layout, 0, caps);
    for (int i = 0; i < N_SLOTS; i++) elems += caps[i];
    par_slot_caps(layout, 1, caps);
    for (int i = 0; i < N_SLOTS; i++) pool += caps[i];
    size_t slots = elems * state_size;
    /* bf16 compute copies: of the whole parameters, or of each pool slot (FSDP) */
    size_t cw = compute_size ? layout->n_flat * compute_size : 0, cs = compute_size ? pool * compute_size : 0;
    switch (kind) {
    case PAR_DDP: {  /* plus the embedding rows' buffer and their indices */
        size_t cap = ddp_erows_cap(layout, D);
        return (ParallelBytes){full, full + cap * ((size_t)layout->E * state_size + sizeof(int)), 2 * full, cw};
    }
    case PAR_ZERO1: return (ParallelBytes){full, full + shard, 2 * shard, cw};
    case PAR_ZERO2: return (ParallelBytes){full, slots + shard, 2 * shard, cw};
    default: return (ParallelBytes){shard + pool * state_size, shard, 2 * shard, cs};  /* pool counted once */
    }
}
