/* The public interface (parallel.h), run through the strategy's table, and the shared core
 * the strategies are built from (parallel_impl.h): slots, waits, AdamW over a range,
 * norms, the compute (bf16) copies, init and checkpoint ranges. Nothing here depends on
 * which strategy runs, except strategy_for. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "ops.h"
#include "parallel_impl.h"
#include "tensor.h"
#include "util.h"

/* The one place that maps a kind to its strategy. */
static const ParallelStrategy *strategy_for(ParallelKind k) {
    static const ParallelStrategy *const table[] = {
        [PAR_DDP] = &par_ddp, [PAR_ZERO1] = &par_zero1, [PAR_ZERO2] = &par_zero2,
        [PAR_FSDP] = &par_fsdp, [PAR_HYBRID] = &par_hybrid,
    };
    return table[k];
}

const char *parallel_kind_name(ParallelKind k) { return strategy_for(k)->name; }

/* The strategy's grad_ready, but whole gradients (p->grads) keep accumulating until the
 * step's last micro-batch's is complete, and are reduced once, then. */
static void grad_ready(void *ctx, int u) {
    Parallel *p = ctx;
    if (p->grads && p->n_ready[u] + 1 < p->n_micro) {
        p->n_ready[u]++;
        par_progress(p);
        return;
    }
    p->s->grad_ready(ctx, u);
    p->n_ready[u]++;
}

Parallel *parallel_create(ParallelKind kind, Model *m, Mesh *mesh, int overlap, const OptimConfig *oc) {
    const ParallelStrategy *s = strategy_for(kind);
    Parallel *p = xcalloc(1, sizeof *p);
    for (int i = 0; i < N_SLOTS; i++) p->slots[i].unit = -1;
    p->s = s;
    p->m = m;
    p->mesh = mesh;
    p->overlap = overlap;
    p->optim = oc ? oc->kind : OPTIM_ADAMW;
    p->offload = oc ? oc->offload : OFFLOAD_NONE;
    p->af_beta1 = oc && oc->kind == OPTIM_ADAFACTOR ? oc->af_beta1 : 0;
    p->group = s->replicated ? &mesh->shard : &mesh->dp;
    p->replicas = s->replicated ? &mesh->replicate : NULL;
    p->D = p->group->size;
    p->r = p->group->rank;
    for (int u = 0; u < m->n_units; u++) {
        if (m->units[u].n_padded % (size_t)p->D)
            die(EXIT_RUN_FAILURE, "internal: unit %d is not padded to the shard group size %d", u, p->D);
    }
    p->n_shard = m->n_flat / (size_t)p->D;
    p->greq = xcalloc((size_t)m->n_units, sizeof(CommReq));
    p->grad_open = xcalloc((size_t)m->n_units, 1);
    p->n_ready = xcalloc((size_t)m->n_units, sizeof(int));
    p->hooks = (UnitHooks){.ctx = p, .gather = s->gather, .release = s->release, .grad_begin = s->grad_begin,
                           .grad_ready = s->grad_ready ? grad_ready : NULL};
    s->setup(p);
    if (p->offload) par_offload_setup(p);
    return p;
}

void parallel_free(Parallel *p) {
    if (!p) return;
    /* Nothing may still be in flight into buffers about to go: an evaluation's forward
     * leaves a prefetched gather behind (FSDP), with no step after it to wait for it. */
    for (int u = 0; u < p->m->n_units; u++) par_wait(p, &p->greq[u]);
    for (int i = 0; i < N_SLOTS; i++) par_wait(p, &p->slots[i].req);
    par_offload_free(p);
    if (p->s->free) p->s->free(p);
    op_free(p->cparams);
    op_free(p->tp_pack);
    free(p->tp_repl[0]); free(p->tp_repl[1]);
    for (int i = 0; i < N_SLOTS; i++) op_free(p->cslots[i]);
    op_free(p->params); comm_buffer_free(p->grads); op_free(p->pshard); op_free(p->gshard);
    if (p->offload) {  /* host memory (par_alloc_optim) */
        op_host_free(p->mom1); op_host_free(p->mom2);
        op_host_free(p->af_stats); op_host_free(p->af_fac); op_host_free(p->af_sums);
    } else {
        op_free(p->mom1); op_free(p->mom2);
        op_free(p->af_stats); op_free(p->af_fac); op_free(p->af_sums);
    }
    op_free(p->af_dsums); op_free(p->af_seg);
    free(p->af_seg_host); free(p->af_tensor);
    af_plan_free(&p->af);
    for (int i = 0; i < N_SLOTS; i++) op_free(p->slots[i].buf);
    free(p->greq); free(p->grad_open); free(p->cstale); free(p->n_ready);
    free(p);
}

void parallel_set_bucket(Parallel *p, size_t bytes) {
    if (p->s->set_bucket) p->s->set_bucket(p, bytes);
}
int parallel_wants_embedding_rows(const Parallel *p) { return p->s->wants_rows && p->s->wants_rows(p); }
void parallel_set_embedding_rows(Parallel *p, const int *rows, size_t n) {
    if (p->s->set_rows) p->s->set_rows(p, rows, n);
}
const UnitHooks *parallel_hooks(Parallel *p) { return &p->hooks; }
int parallel_adam_steps(const Parallel *p) { return p->adam_steps; }
void parallel_set_adam_steps(Parallel *p, int steps) { p->adam_steps = steps; }
double parallel_comm_wait(const Parallel *p) { return p->wait_s; }

void parallel_params_changed(Parallel *p) {
    if (p->s->params_changed) p->s->params_changed(p);
    par_offload_params_written(p);
}

void parallel_init_weights(Parallel *p, uint64_t seed) {
    p->s->init_weights(p, seed);
    par_offload_params_written(p);
}

void parallel_sync(Parallel *p) { par_offload_finish(p); }
int parallel_state_on_host(const Parallel *p) { return !p->off ? 0 : p->hshard || p->hparams ? 2 : 1; }

void parallel_begin_step(Parallel *p) {
    p->wait_s = 0;
    par_offload_begin_step(p);
    p->n_micro = 1;
    memset(p->n_ready, 0, (size_t)p->m->n_units * sizeof(int));
    if (p->s->begin_step) p->s->begin_step(p);
    memset(p->grad_open, 0, (size_t)p->m->n_units);
    for (int i = 0; i < N_SLOTS; i++)
        if (p->slots[i].grad) p->slots[i].unit = -1;
}

void parallel_set_stages(Parallel *p, const Comm *stages, int count_embedding) {
    p->stages = stages;
    p->count_embedding = count_embedding;
}

void parallel_set_micro_batches(Parallel *p, int n) { p->n_micro = n; }

double parallel_step(Parallel *p, const OptimConfig *oc, double *lr) { return p->s->step(p, oc, lr); }

int parallel_ranges(const Parallel *p, int write, OwnedRange *out, int max) {
    /* Hybrid replicas hold the same shards: only the first replica saves them. */
    if (write && p->replicas && p->replicas->rank != 0) return 0;
    return p->s->ranges(p, write, out, max);
}

ParallelBytes parallel_bytes(ParallelKind kind, const Model *layout, int D, size_t state_size, size_t compute_size,
                             const OptimConfig *oc) {
    ParallelBytes b = strategy_for(kind)->bytes(layout, D, state_size, compute_size);
    size_t one = b.optim / 2;  /* the strategies count AdamW's two moments: one is what the rank updates */
    size_t nt = 8 + 7 * (size_t)layout->L, stats = af_stats_count(layout) * sizeof(float);
    if (oc && oc->kind == OPTIM_ADAFACTOR) {
        b.optim = one * (size_t)optim_moments(oc);
        /* statistics, factors and sums (fp32), and per tensor two doubles (at most one segment each) */
        b.optim += 3 * stats + 2 * nt * sizeof(double);
    }
    b.host = 0;
    if (parallel_offload_lean(kind, oc)) {
        /* the master copy and the moments in fp32, the gradients' copy in the compute type;
         * on the device no fp32 parameters under precision=mixed (the compute copy is what
         * the ops read), and two staging buffers of the largest unit for the bf16 gradients */
        size_t act = compute_size ? compute_size : state_size, caps[N_SLOTS];
        b.host = b.optim + one + one / state_size * act;
        b.optim = 0;
        if (compute_size) {
            par_slot_caps(layout, 0, caps);
            b.params = 0;
            b.grads += 2 * caps[0] * act;
        }
    } else if (oc && oc->offload) {  /* fp32 state: the master copy and the gradients' copy beside it */
        b.host = b.optim + 2 * one;
        b.optim = oc->kind == OPTIM_ADAFACTOR && D > 1 ? stats : 0;
        if (oc->offload == OFFLOAD_PARAMS) b.params -= one;  /* the shard: the master copy is it */
    }
    return b;
}

int parallel_offload_lean(ParallelKind kind, const OptimConfig *oc) {
    return oc && oc->offload == OFFLOAD_OPTIMIZER && oc->kind == OPTIM_ADAMW && strategy_for(kind)->lean_offload;
}

OptimKind parallel_optim(const Parallel *p) { return p->optim; }
const AfPlan *parallel_af_plan(const Parallel *p) { return &p->af; }
void parallel_af_stats(const Parallel *p, float *host, int upload) {
    size_t bytes = p->af.n_stats * sizeof(float);
    if (!bytes) return;
    if (p->off) {  /* host memory already */
        par_offload_finish((Parallel *)p);
        if (upload) memcpy(p->af_stats, host, bytes);
        else memcpy(host, p->af_stats, bytes);
    } else if (upload) op_upload(p->af_stats, host, bytes);
    else {
        ops_synchronize();
        op_download(host, p->af_stats, bytes);
    }
}

/* ---- slots ---- */

void par_slot_caps(const Model *m, int pool, size_t caps[N_SLOTS]) {
    /* the largest layer this layout holds (a pipeline stage holds some), and never a big
     * slot smaller than it: a layer may take a big slot */
    size_t big = m->units[UNIT_EMBEDDING].n_padded, layer = 0;
    for (int l = 0; l < m->L; l++)
        if (m->units[unit_of_layer(l)].n_padded > layer) layer = m->units[unit_of_layer(l)].n_padded;
    if (m->units[unit_head(m)].n_padded > big) big = m->units[unit_head(m)].n_padded;
    if (big < layer) big = layer;
    int tied = m->c.tie_embeddings;
    /* a pipeline stage holding the head alone, tied: the head unit (output_norm) takes the
     * slot a layer would, beside tok_embed's copy and its gradient in the big ones */
    if (!layer && tied) layer = m->units[unit_head(m)].n_padded;
    if (pool) {  /* see N_SLOTS */
        caps[0] = big; caps[1] = big; caps[2] = layer; caps[3] = layer; caps[4] = tied ? layer : 0;
    } else {
        caps[0] = big; caps[1] = layer; caps[2] = layer; caps[3] = tied ? big : 0; caps[4] = 0;
    }
}

size_t par_slot_elems(const Model *m, int pool) {
    size_t caps[N_SLOTS], n = 0;
    par_slot_caps(m, pool, caps);
    for (int i = 0; i < N_SLOTS; i++) n += caps[i];
    return n;
}

void par_alloc_slots(Parallel *p, int pool) {
    size_t caps[N_SLOTS];
    par_slot_caps(p->m, pool, caps);
    for (int i = 0; i < N_SLOTS; i++) {
        p->slots[i].cap = caps[i];
        p->slots[i].buf = op_alloc(caps[i] * ops_state_size());  /* NULL for an unused slot */
        p->slots[i].unit = -1;
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
static Slot *oldest_draining(Parallel *p, size_t lo, size_t hi) {
    Slot *o = NULL, *slots = p->slots;
    for (int i = 0; i < N_SLOTS; i++)
        if (slots[i].cap >= lo && slots[i].cap <= hi && draining(p, &slots[i]) && (!o || slots[i].unit > o->unit))
            o = &slots[i];
    return o;
}

Slot *par_take_slot(Parallel *p, int u, int grad, int may_fail) {
    size_t need = p->m->units[u].n_padded, fit = 0;
    Slot *best = NULL, *slots = p->slots;
    for (int i = 0; i < N_SLOTS; i++) {
        if (slots[i].cap < need) continue;
        if (!fit || slots[i].cap < fit) fit = slots[i].cap;
        if ((!best || slots[i].cap < best->cap) && slot_free(p, &slots[i])) best = &slots[i];
    }
    /* A gradient does not take a larger slot while one of the size that fits it is only
     * draining: it waits for that one. Else a layer's gradient, still open, could hold the
     * big slot the embedding's gradient needs next (layer 0's stays open across it). */
    Slot *w = NULL;
    if (grad && best && best->cap > fit) w = oldest_draining(p, fit, fit);
    if (!best && !may_fail) {  /* all busy: wait for one, of the size that fits if there is one */
        w = oldest_draining(p, fit, fit);
        if (!w) w = oldest_draining(p, need, (size_t)-1);
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

void par_slot_grad_begin(void *ctx, int u) {
    Parallel *p = ctx;
    if (p->grad_open[u] == 1) return;  /* tied tok_embed: opened by the head already */
    /* A micro-batch after the first (gradient accumulation): the shard holds the earlier
     * micro-batches' reduced gradient once unit u's last reduction has landed; its slot
     * is then free for good. */
    if (p->grad_open[u] == 2)
        for (int i = 0; i < N_SLOTS; i++)
            if (p->slots[i].grad && p->slots[i].unit == u) {
                par_wait(p, &p->slots[i].req);
                p->slots[i].unit = -1;
            }
    p->grad_open[u] = 1;
    Slot *slot = par_take_slot(p, u, 1, 0);
    op_zero(slot->buf, p->m->units[u].n_padded * ops_state_size());
    if (p->n_ready[u] > 0) {
        /* ... and is added in by the reduce-scatter: this rank's block of the slot starts
         * as D x the shard, which the average over the D ranks brings back to 1 x */
        size_t n = shard_len(p, u);
        void *mine = st_at(slot->buf, (size_t)p->r * n);
        op_copy(mine, st_at(p->gshard, shard_off(p, u)), n * ops_state_size());
        if (p->D > 1) op_scale(mine, n, (float)p->D);
    }
    p->m->ugrads[u] = slot->buf;
    par_progress(p);
}

void par_slot_grad_ready(void *ctx, int u) {
    Parallel *p = ctx;
    for (int i = 0; i < N_SLOTS; i++)
        if (p->slots[i].grad && p->slots[i].unit == u) {
            par_reduce_scatter_grad(p, u, p->slots[i].buf, &p->slots[i].req);
            /* offload: the step's last reduce-scatter of u ends its gradient (hybrid's shards
             * are all-reduced across replicas at the step, and go out then). Should the slot
             * be taken again first, its request is another's: u's goes out later, never early. */
            if (!p->replicas && p->n_ready[u] + 1 >= p->n_micro) par_offload_grad_request(p, u, &p->slots[i].req);
        }
    p->grad_open[u] = 2;
    p->m->ugrads[u] = NULL;
    par_progress(p);
}

/* ---- communication ---- */

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
    for (int u = 0; u < p->m->n_units; u++) comm_test(&p->greq[u]);
    for (int i = 0; i < N_SLOTS; i++) comm_test(&p->slots[i].req);
    par_offload_poll(p);
}

void par_reduce_scatter_grad(Parallel *p, int u, void *src, CommReq *req) {
    comm_ireduce_scatter(p->group, src, st_at(p->gshard, shard_off(p, u)), shard_len(p, u), par_ctype(), COMM_AVG,
                         req, "gradient reduce-scatter");
    if (!p->overlap) par_wait(p, req);
}

void par_wait_grads(Parallel *p) {
    for (int u = 0; u < p->m->n_units; u++) par_wait(p, &p->greq[u]);
    for (int i = 0; i < N_SLOTS; i++) par_wait(p, &p->slots[i].req);
}

/* ---- the optimizer ---- */

double par_next_lr(Parallel *p, const OptimConfig *oc) {
    double lr = lr_at(oc, p->adam_steps);
    p->adam_steps++;
    return lr;
}

/* op_alloc, or with offload host memory */
static void *optim_alloc(Parallel *p, size_t bytes, const char *what) {
    return p->offload ? par_host_alloc(bytes, what) : op_alloc(bytes);
}

void par_alloc_optim(Parallel *p, size_t n, int sharded) {
    size_t bytes = n * ops_state_size();
    if (p->optim != OPTIM_ADAFACTOR) {
        p->mom1 = optim_alloc(p, bytes, "AdamW's first moment");
        p->mom2 = optim_alloc(p, bytes, "AdamW's second moment");
        return;
    }
    if (p->af_beta1 > 0) p->mom1 = optim_alloc(p, bytes, "Adafactor's first moment");
    p->af_sharded = sharded && p->D > 1;
    p->af_tp = p->mesh && p->mesh->tp_size > 1 ? &p->mesh->tp : NULL;
    af_plan_init(&p->af, p->m, sharded ? p->D : 1, sharded ? p->r : 0);
    size_t s = p->af.n_stats * sizeof(float), ns = (size_t)p->af.n_segs;
    p->af_stats = optim_alloc(p, s, "Adafactor's statistics");
    p->af_fac = optim_alloc(p, s, "Adafactor's factors");
    p->af_sums = optim_alloc(p, s, "Adafactor's sums");
    /* offloaded and sharded or tensor parallel: the sums are all-reduced through the device */
    if (p->offload && (p->af_sharded || p->af_tp)) p->af_dsums = op_alloc(s);
    if (!p->offload) p->af_seg = op_alloc(2 * ns * sizeof(double));
    p->af_seg_host = xcalloc(2 * ns + 1, sizeof(double));
    p->af_tensor = xcalloc(2 * (size_t)p->af.n_tensors + 1, sizeof(double));
}

/* Where the rank's update of unit u starts (Adafactor's segments' offsets are relative to
 * it): its shard (pshard, gshard) or, updating whole units (DDP), the unit in the whole
 * buffers; ZeRO's whole parameters at its shard. */
void par_owned(Parallel *p, int u, void **param, const void **grad, void **m1, size_t *own_out) {
    const Unit *un = &p->m->units[u];
    int sharded = p->gshard != NULL;
    size_t so = shard_off(p, u), own = sharded ? so : un->offset;
    *param = p->pshard   ? st_at(p->pshard, so)
             : p->params ? st_at(p->params, un->offset + (sharded ? (size_t)p->r * shard_len(p, u) : 0))
                         : NULL;  /* offload=params: on the host (hshard) */
    *grad = sharded ? st_at(p->gshard, so) : st_at(p->grads, un->offset);
    *m1 = p->mom1 ? st_at(p->mom1, own) : NULL;
    if (own_out) *own_out = own;
}

/* Adafactor's update reads and writes the device's buffers, or with offload the host's
 * (the master copy, the gradients' copy, the moment) with the cpu backend's kernels, which
 * the op_adafactor_* wrappers would guard as below. */
static void af_unit(Parallel *p, int u, void **param, const void **grad, void **m1) {
    size_t own;
    par_owned(p, u, param, grad, m1, &own);
    if (p->off) {
        *param = par_offload_master(p) + own;
        *grad = par_offload_grad(p) + own;
    }
}
static void af_sums(const Parallel *p, float *sums, const void *grad, const AdafactorSeg *s, float scale) {
    if (!p->off) op_adafactor_sums(sums, grad, s, scale);
    else if (s->n) ops_backend_cpu.adafactor_sums(sums, grad, s, scale);
}
static void af_stats(const Parallel *p, float *stat, float *fac, const float *sums, int rows, int cols, float b2) {
    if (!p->off) op_adafactor_stats(stat, fac, sums, rows, cols, b2, (float)ADAFACTOR_EPS1);
    else ops_backend_cpu.adafactor_stats(stat, fac, sums, rows, cols, b2, (float)ADAFACTOR_EPS1);
}
static void af_rms(const Parallel *p, double *out, const void *param, const void *grad, const float *fac,
                   const AdafactorSeg *s, float scale) {
    if (!p->off) op_adafactor_rms(out, param, grad, fac, s, scale);
    else if (!s->n) out[0] = out[1] = 0;
    else ops_backend_cpu.adafactor_rms(out, param, grad, fac, s, scale);
}
static void af_update(const Parallel *p, void *param, const void *grad, void *m, const float *fac, const AdafactorSeg *s,
                      float scale, float coef, float decay, float beta1) {
    if (!p->off) op_adafactor_update(param, grad, m, fac, s, scale, coef, decay, beta1);
    else if (s->n) ops_backend_cpu.adafactor_update(param, grad, m, fac, s, scale, coef, decay, beta1);
}

/* Segment i is of a tensor every tp rank holds alike, and this rank is not tp rank 0: its
 * sums are tp rank 0's to add (the tp all-reduces would count them tp_size times). */
static int af_tp_skip(const AfPlan *af, int i) { return af->tp_rank != 0 && af->t[af->seg_tensor[i]].replicated; }

double par_adafactor(Parallel *p, const OptimConfig *oc, float scale) {
    if (oc->kind != OPTIM_ADAFACTOR || p->optim != OPTIM_ADAFACTOR)
        die(EXIT_RUN_FAILURE, "internal: the optimizer step is not the one whose state was allocated");
    const AfPlan *af = &p->af;
    int t = ++p->adam_steps;
    double rate = af_rate(oc, t);
    if (p->off) par_offload_grads_in(p);
    /* 1. the sums of (s g)^2 over the rows and columns of what this rank holds, over the shard
     * group and then the tp group: a tp rank's row slice adds its rows' sums (zeros in the
     * other ranks' rows) and its part of every column's, a column slice the reverse; what
     * every tp rank holds alike (the norms) is counted by tp rank 0 alone */
    if (p->off) memset(p->af_sums, 0, af->n_stats * sizeof(float));
    else op_zero(p->af_sums, af->n_stats * sizeof(float));
    for (int u = 0; u < p->m->n_units; u++) {
        void *param, *m1;
        const void *grad;
        af_unit(p, u, &param, &grad, &m1);
        for (int i = af->useg[u]; i < af->useg[u + 1]; i++)
            if (!af_tp_skip(af, i)) af_sums(p, p->af_sums, grad, &af->segs[i], scale);
    }
    if (p->af_sharded || p->af_tp) {
        /* offloaded: through a device buffer (the collectives' buffers are the device's) */
        float *sums = p->off ? p->af_dsums : p->af_sums;
        if (p->off) op_upload(sums, p->af_sums, af->n_stats * sizeof(float));
        if (p->af_sharded) {
            CommReq r = {0};
            comm_iallreduce(p->group, sums, af->n_stats, COMM_F32, COMM_SUM, &r, "adafactor statistics all-reduce");
            par_wait(p, &r);
        }
        if (p->af_tp) {
            CommReq r = {0};
            comm_iallreduce(p->af_tp, sums, af->n_stats, COMM_F32, COMM_SUM, &r,
                            "adafactor statistics tensor-parallel all-reduce");
            par_wait(p, &r);
        }
        if (p->off) op_download(p->af_sums, sums, af->n_stats * sizeof(float));
    }
    /* 2. the statistics (the same on every rank) and the update's factors */
    float b2 = af_beta2(oc, t);
    for (int k = 0; k < af->n_tensors; k++) {
        const AfTensor *tk = &af->t[k];
        af_stats(p, p->af_stats + tk->stat, p->af_fac + tk->stat, p->af_sums + tk->stat, tk->rows, tk->cols, b2);
    }
    /* 3. per tensor: the sums of u^2 and param^2, for the update clipping and the parameter scale */
    for (int u = 0; u < p->m->n_units; u++) {
        void *param, *m1;
        const void *grad;
        af_unit(p, u, &param, &grad, &m1);
        for (int i = af->useg[u]; i < af->useg[u + 1]; i++)
            af_rms(p, (p->off ? p->af_seg_host : p->af_seg) + 2 * i, param, grad, p->af_fac, &af->segs[i], scale);
    }
    if (af->n_segs && !p->off) op_download(p->af_seg_host, p->af_seg, 2 * (size_t)af->n_segs * sizeof(double));
    memset(p->af_tensor, 0, 2 * (size_t)af->n_tensors * sizeof(double));
    for (int i = 0; i < af->n_segs; i++) {
        if (af_tp_skip(af, i)) continue;
        p->af_tensor[2 * af->seg_tensor[i]] += p->af_seg_host[2 * i];
        p->af_tensor[2 * af->seg_tensor[i] + 1] += p->af_seg_host[2 * i + 1];
    }
    if (p->af_sharded) comm_allreduce_double(p->group, p->af_tensor, 2 * (size_t)af->n_tensors);
    if (p->af_tp) comm_allreduce_double(p->af_tp, p->af_tensor, 2 * (size_t)af->n_tensors);
    /* 4. the update */
    for (int u = 0; u < p->m->n_units; u++) {
        void *param, *m1;
        const void *grad;
        af_unit(p, u, &param, &grad, &m1);
        for (int i = af->useg[u]; i < af->useg[u + 1]; i++) {
            int k = af->seg_tensor[i];
            float coef, decay;
            af_coef(oc, rate, p->af_tensor[2 * k], p->af_tensor[2 * k + 1], (size_t)af->t[k].rows * af->t[k].cols, &coef,
                    &decay);
            af_update(p, param, grad, m1, p->af_fac, &af->segs[i], scale, coef, decay, (float)oc->af_beta1);
        }
    }
    if (p->off) par_offload_params_out(p);
    return rate;
}

void par_adamw(void *param, const void *grad, void *m1, void *m2, size_t n, const OptimConfig *oc, double lr,
               int step, float scale, void *act) {
    float b1 = (float)oc->beta1, b2 = (float)oc->beta2, eps = (float)oc->eps, wd = (float)oc->weight_decay;
    if (act) op_adamw_cast(param, grad, m1, m2, n, (float)lr, b1, b2, eps, wd, step, scale, act);
    else op_adamw(param, grad, m1, m2, n, (float)lr, b1, b2, eps, wd, step, scale);
}

/* Tensor parallel: the gradients every tp rank holds alike (the embedding, the head, the
 * norms) are counted by tp rank 0 alone, the slices by each; the sum over the tp group is
 * then the whole model's. sharded: this rank's gradient is its shard of each unit (gshard),
 * else the whole units (grads). */
static size_t pack_replicated(Parallel *p, int sharded, int how);
/* p->tp_pack, large enough for the replicated runs (sharded or not); their count */
static size_t tp_pack_ready(Parallel *p, int sharded) {
    size_t n = pack_replicated(p, sharded, 0);
    if (n > p->tp_pack_n) {
        op_free(p->tp_pack);
        p->tp_pack = op_alloc(n * ops_state_size());
        p->tp_pack_n = n;
    }
    return n;
}

/* A tp rank other than 0 leaves the replicated runs out of its part of the norm, so that the
 * sum over tp counts them once: packed and summed in one op_sumsq (one wait for the device;
 * one a run was 2L + 1 of them, the step's tail waiting for each). */
static double tp_sumsq(Parallel *p, double sumsq, int sharded) {
    const Mesh *mesh = p->mesh;
    if (!mesh || mesh->tp_size < 2 || mesh->tp_rank == 0) return sumsq;
    size_t n = tp_pack_ready(p, sharded);
    if (!n) return sumsq;
    if (p->tp_pack_summed != sharded + 1) pack_replicated(p, sharded, 1);  /* (else there already, summed) */
    p->tp_pack_summed = 0;
    return sumsq - op_sumsq(p->tp_pack, n);
}

/* p->tp_repl[sharded]: the replicated runs, found once (the layout and the shards are fixed) */
static void find_replicated(Parallel *p, int sharded) {
    int max = model_tp_max_runs(p->m), cap = 0, k = 0;
    TpRun *r = xmalloc((size_t)max * sizeof *r);
    size_t elems = 0;
    for (int u = 0; u < p->m->n_units; u++) {
        const Unit *un = &p->m->units[u];
        size_t lo = sharded ? (size_t)p->r * shard_len(p, u) : 0, hi = sharded ? lo + shard_len(p, u) : un->n;
        int n = model_tp_runs(p->m, u, r, max);
        for (int i = 0; i < n; i++) {
            size_t a, b;
            if (!r[i].replicated || !tp_run_clip(&r[i], lo, hi, &a, &b)) continue;
            if (k == cap) p->tp_repl[sharded] = xrealloc(p->tp_repl[sharded], (size_t)(cap = 2 * cap + 8) * sizeof(ReplRun));
            p->tp_repl[sharded][k++] = (ReplRun){u, a - lo, b - a};
            elems += b - a;
        }
    }
    free(r);
    p->tp_nrepl[sharded] = k, p->tp_repl_elems[sharded] = elems, p->tp_repl_ready[sharded] = 1;
}

/* The replicated runs of every unit's gradient (this rank's part of each when sharded), in
 * order: how = 0 counts their elements, 1 copies them into p->tp_pack, 2 back out of it (and
 * has offload copy those units out again). */
static size_t pack_replicated(Parallel *p, int sharded, int how) {
    if (!p->tp_repl_ready[sharded]) find_replicated(p, sharded);
    size_t off = 0, es = ops_state_size();
    for (int i = 0; how && i < p->tp_nrepl[sharded]; i++) {
        int u = p->tp_repl[sharded][i].unit;
        size_t at = p->tp_repl[sharded][i].at, n = p->tp_repl[sharded][i].n;
        void *g = sharded ? st_at(p->gshard, shard_off(p, u) + at) : st_at(p->grads, p->m->units[u].offset + at);
        if (how == 1) op_copy(st_at(p->tp_pack, off), g, n * es);
        if (how == 2) {
            op_copy(g, st_at(p->tp_pack, off), n * es);
            if (i + 1 == p->tp_nrepl[sharded] || p->tp_repl[sharded][i + 1].unit != u) par_offload_grad_changed(p, u);
        }
        off += n;
    }
    return p->tp_repl_elems[sharded];
}

/* The norms' weight gradients under sequence parallel are each tp rank's rows' part: summed
 * over tp once the gradient is complete, all of them in one all-reduce (one per norm was
 * 2L + 1 small collectives, each waited for). */
void par_tp_sum_partial(Parallel *p, int sharded) {
    const Mesh *mesh = p->mesh;
    if (!mesh || mesh->tp_size < 2 || !p->m->sp) return;
    size_t n = tp_pack_ready(p, sharded);
    if (!n) return;
    pack_replicated(p, sharded, 1);
    CommReq q = {0};
    comm_iallreduce(&mesh->tp, p->tp_pack, n, par_ctype(), COMM_SUM, &q, "tensor-parallel all-reduce (norms' gradients)");
    par_wait(p, &q);
    pack_replicated(p, sharded, 2);
    p->tp_pack_summed = sharded + 1;
}

double par_stages_sumsq(Parallel *p, double sumsq) {
    int piped = p->stages && p->stages->size > 1;
    const Unit *e = &p->m->units[UNIT_EMBEDDING];
    /* the tied copy, before the tp sum: each tp rank's copy is its own vocabulary rows */
    if (piped && !p->count_embedding && e->n) sumsq -= op_sumsq(st_at(p->grads, e->offset), e->n_padded);
    if (p->mesh && p->mesh->tp_size > 1) {
        sumsq = tp_sumsq(p, sumsq, 0);
        comm_allreduce_double(&p->mesh->tp, &sumsq, 1);
        if (sumsq < 0) sumsq = 0;  /* rounding */
    }
    if (piped) comm_allreduce_double(p->stages, &sumsq, 1);
    return sumsq;
}

double par_shard_norm(Parallel *p) {
    par_tp_sum_partial(p, 1);
    double sumsq = op_sumsq(p->gshard, p->n_shard);
    int piped = p->stages && p->stages->size > 1;
    if (piped && !p->count_embedding && shard_len(p, UNIT_EMBEDDING))  /* the tied copy: counted by the first stage */
        sumsq -= op_sumsq(st_at(p->gshard, shard_off(p, UNIT_EMBEDDING)), shard_len(p, UNIT_EMBEDDING));
    sumsq = tp_sumsq(p, sumsq, 1);
    comm_allreduce_double(p->group, &sumsq, 1);
    if (p->mesh && p->mesh->tp_size > 1) comm_allreduce_double(&p->mesh->tp, &sumsq, 1);
    if (piped) comm_allreduce_double(p->stages, &sumsq, 1);
    return sqrt(sumsq > 0 ? sumsq : 0);
}

/* ---- parameters ---- */

void par_compute_whole(Parallel *p) {
    if (ops_precision() != OPS_MIXED) return;
    Model *m = p->m;
    p->cparams = op_alloc(m->n_flat * ops_act_size());
    for (int u = 0; u < m->n_units; u++) m->ucompute[u] = act_at(p->cparams, m->units[u].offset);
    if (p->lean) return;  /* made from the host's master by offload.c, never from device params */
    p->cstale = xmalloc((size_t)m->n_units);
    par_params_stale(p);
}

void par_compute_slots(Parallel *p) {
    if (ops_precision() != OPS_MIXED) return;
    size_t caps[N_SLOTS];
    par_slot_caps(p->m, 1, caps);  /* a copy per pool slot (those holding gradients go unused) */
    for (int i = 0; i < N_SLOTS; i++) p->cslots[i] = op_alloc(caps[i] * ops_act_size());
}

void par_params_stale(Parallel *p) {
    if (p->cstale) memset(p->cstale, 1, (size_t)p->m->n_units);
}

void par_cast_unit(Parallel *p, int u) {
    if (p->cstale && p->cstale[u]) {
        const Unit *un = &p->m->units[u];
        op_to_act(act_at(p->cparams, un->offset), st_at(p->params, un->offset), un->n_padded);
        p->cstale[u] = 0;
    }
}

/* The init writes host fp32: on the cpu straight into the whole parameters or this rank's
 * shard (FSDP builds only its shard of each unit); on a device through one host buffer,
 * uploaded unit by unit (rounded to bf16 with precision=bf16). */
static void init_units(Parallel *p, uint64_t seed, int whole) {
    Model *m = p->m;
    size_t caps[N_SLOTS];
    int big = 0;
    par_slot_caps(m, 1, caps);
    for (int i = 1; i < N_SLOTS; i++) big = caps[i] > caps[big] ? i : big;
    /* offload=params and lean offload: straight into the host's master copy */
    float *host = ops_host_memory() || p->hshard || p->hparams ? NULL : xaligned_alloc(caps[big] * sizeof(float));
    for (int u = 0; u < m->n_units; u++) {
        size_t n = whole ? m->units[u].n_padded : shard_len(p, u), lo = whole ? 0 : (size_t)p->r * n;
        void *dst = whole && p->hparams ? (void *)(p->hparams + m->units[u].offset)
                    : whole             ? st_at(p->params, m->units[u].offset)
                    : p->hshard ? (void *)(p->hshard + shard_off(p, u))
                                : st_at(p->pshard, shard_off(p, u));
        model_init_range(m, u, lo, lo + n, host ? host : dst, seed);
        if (host) op_upload_state(dst, host, n);
    }
    free(host);
    par_params_stale(p);
}

void par_init_whole(Parallel *p, uint64_t seed) { init_units(p, seed, 1); }
void par_init_shard(Parallel *p, uint64_t seed) { init_units(p, seed, 0); }

int par_shard_ranges(const Parallel *p, int write, OwnedRange *out, int max) {
    const Model *m = p->m;
    int n = 0;
    for (int u = 0; u < m->n_units && n < max; u++) {
        size_t s = shard_len(p, u), lo = (size_t)p->r * s, hi = lo + s, nu = m->units[u].n;
        if (hi > nu) hi = nu;
        size_t so = shard_off(p, u);
        void *base_p = p->params ? st_at(p->params, m->units[u].offset) : NULL;
        void *sp = p->hshard ? (void *)(p->hshard + so) : p->pshard ? st_at(p->pshard, so) : st_at(base_p, lo);
        if (lo < hi && n < max)
            out[n++] = (OwnedRange){u, lo, hi, sp, p->mom1 ? st_at(p->mom1, so) : NULL, p->mom2 ? st_at(p->mom2, so) : NULL};
        /* Whole parameters: on load every unit's are needed, not only the shard. */
        if (!write && p->params && n < max) out[n++] = (OwnedRange){u, 0, nu, base_p, NULL, NULL};
    }
    return n;
}
