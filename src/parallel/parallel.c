/* The public interface (parallel.h), run through the strategy's table, and the shared core
 * the strategies are built from (parallel_impl.h): slots, waits, the optimizer's update of
 * what the rank owns (src/optim), norms, the compute (bf16) copies, init and checkpoint
 * ranges. Nothing here depends on which strategy runs, except strategy_for, nor on which
 * optimizer, or where it keeps its state. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "ops.h"
#include "parallel_impl.h"
#include "compress.h"
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
    if (p->overflow_next && u != UNIT_EMBEDDING && p->m->units[u].n) {
        /* x inf: inf, or NaN where the element is 0; either is an overflow (an op in the
         * device's queue, after the backward that wrote it) */
        op_scale(st_at(unit_grads(p->m, u), p->m->units[u].n - 1), 1, INFINITY);
        p->overflow_next = 0;
    }
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
    /* under expert parallel a unit is sharded (or replicated) over the ranks holding the same
     * experts; what the ep group holds alike is summed over it at the step (par_tp_sum_partial) */
    p->group = s->replicated ? &mesh->shard : mesh->ep_size > 1 ? &mesh->edp : &mesh->dp;
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
    p->gfinal = xcalloc((size_t)m->n_units, sizeof(CommReq *));
    p->hooks = (UnitHooks){.ctx = p, .gather = s->gather, .release = s->release, .grad_begin = s->grad_begin,
                           .grad_ready = s->grad_ready ? grad_ready : NULL};
    p->lean = parallel_offload_lean(kind, oc);
    p->params_host = oc && oc->offload == OFFLOAD_PARAMS;
    s->setup(p);
    if (p->params_host && (p->pshard || p->params))
        die(EXIT_RUN_FAILURE, "internal: offload=params with a strategy that keeps parameters on the device");
    /* the optimizer over what the strategy's buffers say the rank updates: the shards of the
     * units where it keeps gradient shards, else whole units */
    p->sharded = p->gshard != NULL;
    OptimUnit *units = xcalloc((size_t)m->n_units, sizeof *units);
    for (int u = 0; u < m->n_units; u++) units[u] = par_owned_unit(p, u);
    int tp = mesh && mesh->tp_size > 1;
    OptimSetup os = {oc, m, p->sharded ? p->D : 1, p->sharded ? p->r : 0, (p->sharded && p->D > 1) || tp, p->lean,
                     units};
    p->opt = optim_create(&os);
    free(units);
    if (p->params_host) p->hshard = optim_master(p->opt);
    if (p->lean) p->hparams = optim_master(p->opt);
    return p;
}

void parallel_free(Parallel *p) {
    if (!p) return;
    /* Nothing may still be in flight into buffers about to go: an evaluation's forward
     * leaves a prefetched gather behind (FSDP), with no step after it to wait for it. */
    for (int u = 0; u < p->m->n_units; u++) par_wait(p, &p->greq[u]);
    for (int i = 0; i < N_SLOTS; i++) par_wait(p, &p->slots[i].req);
    optim_free(p->opt);  /* first: with offload its thread and copies still use the buffers */
    compress_free(p->comp);
    if (p->s->free) p->s->free(p);
    op_free(p->cparams);
    op_free(p->tp_pack);
    for (int k = 0; k < 2; k++) free(p->tp_repl[k][0]), free(p->tp_repl[k][1]);
    for (int i = 0; i < N_SLOTS; i++) op_free(p->cslots[i]);
    op_free(p->params); comm_buffer_free(p->grads); op_free(p->pshard); op_free(p->gshard);
    for (int i = 0; i < N_SLOTS; i++) op_free(p->slots[i].buf);
    free(p->greq); free(p->grad_open); free(p->cstale); free(p->n_ready); free(p->gfinal);
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
int parallel_adam_steps(const Parallel *p) { return optim_steps(p->opt); }
void parallel_set_adam_steps(Parallel *p, int steps) { optim_set_steps(p->opt, steps); }
double parallel_comm_wait(const Parallel *p) { return p->wait_s; }

void parallel_params_changed(Parallel *p) {
    if (p->s->params_changed) p->s->params_changed(p);
    optim_params_written(p->opt);
}

void parallel_init_weights(Parallel *p, uint64_t seed) {
    p->s->init_weights(p, seed);
    optim_params_written(p->opt);
}

void parallel_sync(Parallel *p) { optim_finish(p->opt); }
void parallel_offload_times(Parallel *p, double *update_s, double *wait_s) {
    optim_host_times(p->opt, update_s, wait_s);
}
int parallel_state_on_host(const Parallel *p) { return !optim_on_host(p->opt) ? 0 : p->hshard || p->hparams ? 2 : 1; }

void parallel_begin_step(Parallel *p) {
    p->wait_s = 0;
    optim_new_grads(p->opt);
    memset(p->gfinal, 0, (size_t)p->m->n_units * sizeof(CommReq *));
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

void parallel_inject_overflow(Parallel *p) { p->overflow_next = 1; }

int parallel_ranges(const Parallel *p, int write, OwnedRange *out, int max) {
    /* Hybrid replicas hold the same shards: only the first replica saves them. */
    if (write && p->replicas && p->replicas->rank != 0) return 0;
    return p->s->ranges(p, write, out, max);
}

ParallelBytes parallel_bytes(ParallelKind kind, const Model *layout, int D, size_t state_size, size_t compute_size,
                             const OptimConfig *oc) {
    ParallelBytes b = strategy_for(kind)->bytes(layout, D, state_size, compute_size);
    size_t one = b.optim;  /* one elementwise array over what the rank updates */
    int lean = parallel_offload_lean(kind, oc);
    /* lean: the gradients' copy in the compute type; on the device no fp32 parameters under
     * precision=mixed (the compute copy is what the ops read), and two staging buffers of the
     * largest unit for the bf16 gradients */
    size_t act = compute_size ? compute_size : state_size;
    OptimBytes ob = optim_bytes(oc, layout, one / state_size, state_size, lean ? act : state_size, D > 1);
    b.optim = ob.device;
    b.host = ob.host;
    if (lean && compute_size) {
        size_t caps[N_SLOTS];
        par_slot_caps(layout, 0, caps);
        b.params = 0;
        b.grads += 2 * caps[0] * act;
    } else if (!lean && oc && oc->offload == OFFLOAD_PARAMS) {
        b.params -= one;  /* the shard: the master copy is it */
    }
    return b;
}

int parallel_offload_lean(ParallelKind kind, const OptimConfig *oc) {
    return optim_lean_possible(oc) && strategy_for(kind)->updates_all;
}

Optimizer *parallel_optimizer(const Parallel *p) { return p->opt; }

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
            /* the step's last reduce-scatter of u ends its gradient (hybrid's shards are
             * all-reduced across replicas at the step, and are complete then). Should the slot
             * be taken again first, its request is another's: u's is taken later, never early. */
            if (!p->replicas && p->n_ready[u] + 1 >= p->n_micro) par_grad_final(p, u, &p->slots[i].req);
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
    for (int u = 0; u < p->m->n_units; u++)
        if (p->gfinal[u] && optim_grad_wanted(p->opt, u) && comm_test(p->gfinal[u])) optim_grad_final(p->opt, u);
}

/* Whether DDP's all-reduces over dp go machine by machine (the mesh's hier_allreduce). */
static int hierarchical(const Parallel *p) { return p->mesh && p->mesh->hier_allreduce && p->group == &p->mesh->dp; }

int parallel_set_compression(Parallel *p, int kind, int rank, int warmup, double min_rate, char *err, size_t errlen) {
    if (!kind) return 0;
    if (!ops_host_memory() || p->m->ep_size > 1)
        return set_err(err, errlen, "grad_compression=%s runs on CPU ranks (device=cpu), without expert parallel",
                       compress_kind_name((CompressKind)kind));
    if (kind == COMPRESS_POWERSGD && p->s != &par_ddp)
        return set_err(err, errlen, "grad_compression=powersgd compresses an all-reduce: DDP only (fsdp and zero_opt "
                       "off); bf16 and int8 take every strategy");
    if (p->s != &par_ddp) {  /* ZeRO and FSDP: their reduce-scatter; hybrid: the all-reduce across replicas */
        p->comp = p->replicas ? compress_create((CompressKind)kind, p->n_shard, p->replicas->size)
                              : compress_create((CompressKind)kind, p->m->n_flat, p->D);
        return 0;
    }
    /* machine by machine: the residuals of the rank's block of each bucket, across machines */
    const Mesh *mesh = p->mesh;
    if (kind == COMPRESS_POWERSGD) {  /* over all of dp: its matrices are whole tensors, not a machine's blocks */
        if (p->m->tp_size > 1 || p->m->ep_size > 1)
            return set_err(err, errlen, "grad_compression=powersgd takes whole tensors: not with tensor or expert "
                           "parallel");
        p->comp = compress_create_powersgd(p->m, p->D, rank, min_rate);
        p->comp_warmup = warmup;
        return 0;
    }
    p->comp = hierarchical(p) ? compress_create((CompressKind)kind, p->m->n_flat / (size_t)mesh->node.size, mesh->cross.size)
                              : compress_create((CompressKind)kind, p->m->n_flat, p->D);
    return 0;
}

float *parallel_compression_state(Parallel *p, size_t *n_e, float **f, size_t *n_f) {
    if (!p->comp) return NULL;
    *f = compress_server_state(p->comp);
    return compress_state(p->comp, n_e, n_f);
}

/* Compressed, blocking: the whole bucket over the group; or, machine by machine, only the hop
 * across machines compressed (the rank's block of the machine's reduce-scatter), the machine's
 * own links carrying fp32. 0 where it cannot (the caller reduces buf uncompressed). */
static int allreduce_compressed(Parallel *p, float *buf, size_t n) {
    const Mesh *mesh = p->mesh;
    size_t off = (size_t)(buf - (float *)p->grads);
    if (compress_kind(p->comp) == COMPRESS_POWERSGD && optim_steps(p->opt) < p->comp_warmup) return 0;
    if (!hierarchical(p) || compress_kind(p->comp) == COMPRESS_POWERSGD)
        return p->D > 1 && compress_allreduce(p->comp, p->group, buf, off, n);
    size_t k = (size_t)mesh->node.size, blk = n / k;
    if (n % k) return 0;
    float *mine = buf + (size_t)mesh->node.rank * blk;
    CommReq q = {0};
    comm_ireduce_scatter(&mesh->node, buf, mine, blk, COMM_F32, COMM_AVG, &q, "gradient reduce-scatter (inside the machine)");
    par_wait(p, &q);
    if (!compress_allreduce(p->comp, &mesh->cross, mine, off / k, blk)) {
        comm_iallreduce(&mesh->cross, mine, blk, COMM_F32, COMM_AVG, &q, "gradient all-reduce (across machines)");
        par_wait(p, &q);
    }
    comm_iallgather(&mesh->node_gather, buf, blk, COMM_F32, &q, "gradient all-gather (inside the machine)");
    par_wait(p, &q);
    return 1;
}

void par_allreduce_grad(Parallel *p, void *buf, size_t n, CommReq *req) {
    const Mesh *mesh = p->mesh;
    if (p->comp && allreduce_compressed(p, buf, n)) {  /* complete on return: a request never begun */
        memset(req, 0, sizeof *req);
        return;
    }
    if (hierarchical(p) && n % (size_t)mesh->node.size == 0)
        comm_iallreduce_hier(&mesh->node, &mesh->node_gather, &mesh->cross, buf, n, par_ctype(), COMM_AVG, req,
                             "gradient all-reduce (inside the machine, then across)");
    else comm_iallreduce(p->group, buf, n, par_ctype(), COMM_AVG, req, "gradient all-reduce");
}

void par_reduce_scatter_grad(Parallel *p, int u, void *src, CommReq *req) {
    /* compressed (not hybrid's, whose machine keeps it; its replicas' all-reduce is): blocking */
    if (p->comp && !p->replicas && p->D > 1 &&
        compress_reduce_scatter(p->comp, p->group, src, p->m->units[u].offset, p->m->units[u].n_padded,
                                st_at(p->gshard, shard_off(p, u)))) {
        memset(req, 0, sizeof *req);
        return;
    }
    comm_ireduce_scatter(p->group, src, st_at(p->gshard, shard_off(p, u)), shard_len(p, u), par_ctype(), COMM_AVG,
                         req, "gradient reduce-scatter");
    if (!p->overlap) par_wait(p, req);
}

void par_replicas_allreduce(Parallel *p, int u, CommReq *req) {
    void *shard = st_at(p->gshard, shard_off(p, u));
    if (p->comp && compress_allreduce(p->comp, p->replicas, shard, shard_off(p, u), shard_len(p, u))) {
        memset(req, 0, sizeof *req);
        return;
    }
    comm_iallreduce(p->replicas, shard, shard_len(p, u), par_ctype(), COMM_AVG, req, "gradient all-reduce across replicas");
}

void par_wait_grads(Parallel *p) {
    for (int u = 0; u < p->m->n_units; u++) par_wait(p, &p->greq[u]);
    for (int i = 0; i < N_SLOTS; i++) par_wait(p, &p->slots[i].req);
}

/* ---- the optimizer ---- */

/* Where the rank's update of unit u starts (Adafactor's segments' offsets are relative to
 * it): its shard (pshard, gshard) or, updating whole units (DDP), the unit in the whole
 * buffers; ZeRO's whole parameters at its shard. Updating whole units with a compute copy
 * of them (DDP with precision=mixed), the update writes that copy too; lean, the host's
 * update comes back into it (what the ops read). */
OptimUnit par_owned_unit(const Parallel *p, int u) {
    const Unit *un = &p->m->units[u];
    int sharded = p->gshard != NULL;
    size_t so = shard_off(p, u);
    OptimUnit o = {0};
    o.param = p->pshard   ? st_at(p->pshard, so)
              : p->params ? st_at(p->params, un->offset + (sharded ? (size_t)p->r * shard_len(p, u) : 0))
                          : NULL;  /* offload=params: on the host (hshard) */
    o.grad = sharded ? st_at(p->gshard, so) : st_at(p->grads, un->offset);
    o.act = !sharded && p->cparams ? act_at(p->cparams, un->offset) : NULL;
    if (p->lean && p->m->ucompute[u]) o.param = p->m->ucompute[u];
    return o;
}

double par_update_begin(Parallel *p, const OptimConfig *oc) { return optim_begin(p->opt, oc); }

int par_update_go(Parallel *p, const OptimConfig *oc, double *norm, float *scale) {
    float loss_scale = optim_loss_scale(p->opt);  /* this step's (the decision moves it) */
    if (!optim_loss_scale_step(p->opt, !isfinite(*norm))) return 0;
    *norm /= loss_scale;
    *scale = clip_scale(oc, *norm) / loss_scale;
    return 1;
}

void par_update_stats(Parallel *p, float scale) {
    const Comm *tp = p->mesh && p->mesh->tp_size > 1 ? &p->mesh->tp : NULL;
    int sharded = p->sharded && p->D > 1;
    for (int k = 0; k < optim_stat_rounds(p->opt); k++) {
        OptimSums s = optim_stats(p->opt, k, scale);
        if (s.host) {
            if (sharded) comm_allreduce_double(p->group, s.buf, s.n);
            if (tp) comm_allreduce_double(tp, s.buf, s.n);
        } else {
            if (sharded) {
                CommReq r = {0};
                comm_iallreduce(p->group, s.buf, s.n, COMM_F32, COMM_SUM, &r, s.what);
                par_wait(p, &r);
            }
            if (tp) {
                CommReq r = {0};
                comm_iallreduce(tp, s.buf, s.n, COMM_F32, COMM_SUM, &r, s.what_tp);
                par_wait(p, &r);
            }
        }
        optim_stats_summed(p->opt, k);
    }
}

void par_update(Parallel *p, int u0, int u1, float scale) {
    if (!optim_update(p->opt, u0, u1, scale) && p->cstale)
        for (int u = u0; u < u1; u++) p->cstale[u] = 1;
}

int par_update_parts(const Parallel *p) { return optim_updates_in_parts(p->opt); }
int par_update_later(const Parallel *p) { return optim_updates_later(p->opt); }
int par_update_ready(Parallel *p, int u, int wait) { return optim_ready(p->opt, u, wait); }

void par_grad_final(Parallel *p, int u, CommReq *r) {
    if (optim_on_host(p->opt)) p->gfinal[u] = r;
}

void par_grad_changed(Parallel *p, int u) { optim_grad_changed(p->opt, u); }

void *par_state_at(const Parallel *p, int k, size_t at) {
    void *a = optim_moment(p->opt, k);
    return a ? st_at(a, at) : NULL;
}

/* The replicated runs (model_tp_runs) are held alike by the tensor-parallel group (k = 0:
 * the norms, the router, the head's output_norm) or by expert parallel's ep group (k = 1:
 * everything but the experts); with both, the first are the second's too. */
enum { REPL_TP_K = 0, REPL_EP_K = 1 };
static int split_tp(const Parallel *p) { return p->mesh && p->mesh->tp_size > 1; }
static int split_ep(const Parallel *p) { return p->mesh && p->mesh->ep_size > 1; }
/* a part of the gradient norm summed over the groups that split the model */
static void split_sum(const Parallel *p, double *sumsq) {
    if (split_tp(p)) comm_allreduce_double(&p->mesh->tp, sumsq, 1);
    if (split_ep(p)) comm_allreduce_double(&p->mesh->ep, sumsq, 1);
}

int par_sums_replicated(const Parallel *p) {
    return p->mesh && ((p->mesh->tp_size > 1 && p->m->sp) || p->mesh->ep_size > 1);
}

/* Tensor parallel: the gradients every tp rank holds alike (the embedding, the head, the
 * norms) are counted by tp rank 0 alone, the slices by each; the sum over the tp group is
 * then the whole model's. Expert parallel the same over the ep group: its ranks hold
 * everything but their experts alike; with both, what both groups hold alike is counted by
 * the rank that is 0 in each. sharded: this rank's gradient is its shard of each unit
 * (gshard), else the whole units (grads). */
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
 * one a run was 2L + 1 of them, the step's tail waiting for each). Under expert parallel
 * (whose replicated runs are a few long stretches) they are summed where they are. */
static double repl_sumsq(Parallel *p, int sharded, int k);
static double tp_sumsq(Parallel *p, double sumsq, int sharded) {
    if (split_ep(p) && p->mesh->ep.rank != 0) return sumsq - repl_sumsq(p, sharded, REPL_EP_K);
    if (!split_tp(p) || p->mesh->tp.rank == 0) return sumsq;
    if (split_ep(p)) return sumsq - repl_sumsq(p, sharded, REPL_TP_K);
    size_t n = tp_pack_ready(p, sharded);
    if (!n) return sumsq;
    if (p->tp_pack_summed != sharded + 1) pack_replicated(p, sharded, 1);  /* (else there already, summed) */
    p->tp_pack_summed = 0;
    return sumsq - op_sumsq(p->tp_pack, n);
}

/* p->tp_repl[k][sharded]: the replicated runs of kind k, found once (the layout and the
 * shards are fixed) */
static void find_replicated(Parallel *p, int sharded, int k) {
    int max = model_tp_max_runs(p->m), cap = 0, nk = 0, bit = k == REPL_TP_K ? TP_REPL_TP : TP_REPL_EP;
    TpRun *r = xmalloc((size_t)max * sizeof *r);
    size_t elems = 0;
    for (int u = 0; u < p->m->n_units; u++) {
        const Unit *un = &p->m->units[u];
        size_t lo = sharded ? (size_t)p->r * shard_len(p, u) : 0, hi = sharded ? lo + shard_len(p, u) : un->n;
        int n = model_tp_runs(p->m, u, r, max);
        for (int i = 0; i < n; i++) {
            size_t a, b;
            if (!(r[i].replicated & bit) || !tp_run_clip(&r[i], lo, hi, &a, &b)) continue;
            if (nk == cap)
                p->tp_repl[k][sharded] = xrealloc(p->tp_repl[k][sharded], (size_t)(cap = 2 * cap + 8) * sizeof(ReplRun));
            p->tp_repl[k][sharded][nk++] = (ReplRun){u, a - lo, b - a};
            elems += b - a;
        }
    }
    free(r);
    p->tp_nrepl[k][sharded] = nk, p->tp_repl_elems[k][sharded] = elems, p->tp_repl_ready[k][sharded] = 1;
}

/* Unit u's gradient at element `at` of what the rank holds of it (its shard when sharded). */
static void *repl_grad(Parallel *p, int sharded, int u, size_t at) {
    return sharded ? st_at(p->gshard, shard_off(p, u) + at) : st_at(p->grads, p->m->units[u].offset + at);
}

/* The replicated runs of kind k taken where they are rather than packed. Their sum of squares: */
static double repl_sumsq(Parallel *p, int sharded, int k) {
    if (!p->tp_repl_ready[k][sharded]) find_replicated(p, sharded, k);
    double s = 0;
    for (int i = 0; i < p->tp_nrepl[k][sharded]; i++) {
        const ReplRun *r = &p->tp_repl[k][sharded][i];
        s += op_sumsq(repl_grad(p, sharded, r->unit, r->at), r->n);
    }
    return s;
}

/* ... and their sum over group g, in place (expert parallel: each rank's gradient was scaled
 * by 1 / ep_size, so the sum is the mean over the data-parallel ranks). */
static void sum_replicated(Parallel *p, int sharded, int k, const Comm *g, const char *what) {
    if (!p->tp_repl_ready[k][sharded]) find_replicated(p, sharded, k);
    int n = p->tp_nrepl[k][sharded];
    CommReq *q = xcalloc((size_t)(n ? n : 1), sizeof *q);
    for (int i = 0; i < n; i++) {
        const ReplRun *r = &p->tp_repl[k][sharded][i];
        comm_iallreduce(g, repl_grad(p, sharded, r->unit, r->at), r->n, par_ctype(), COMM_SUM, &q[i], what);
        if (!p->overlap) par_wait(p, &q[i]);
    }
    for (int i = 0; i < n; i++) {
        par_wait(p, &q[i]);
        if (i + 1 == n || p->tp_repl[k][sharded][i + 1].unit != p->tp_repl[k][sharded][i].unit)
            par_grad_changed(p, p->tp_repl[k][sharded][i].unit);
    }
    free(q);
}

/* The tp group's replicated runs of every unit's gradient (this rank's part of each when
 * sharded), in order: how = 0 counts their elements, 1 copies them into p->tp_pack, 2 back
 * out of it (and tells the optimizer's placement those units changed). */
static size_t pack_replicated(Parallel *p, int sharded, int how) {
    const int k = REPL_TP_K;
    if (!p->tp_repl_ready[k][sharded]) find_replicated(p, sharded, k);
    size_t off = 0, es = ops_state_size();
    for (int i = 0; how && i < p->tp_nrepl[k][sharded]; i++) {
        int u = p->tp_repl[k][sharded][i].unit;
        size_t at = p->tp_repl[k][sharded][i].at, n = p->tp_repl[k][sharded][i].n;
        void *g = repl_grad(p, sharded, u, at);
        if (how == 1) op_copy(st_at(p->tp_pack, off), g, n * es);
        if (how == 2) {
            op_copy(g, st_at(p->tp_pack, off), n * es);
            if (i + 1 == p->tp_nrepl[k][sharded] || p->tp_repl[k][sharded][i + 1].unit != u) par_grad_changed(p, u);
        }
        off += n;
    }
    return p->tp_repl_elems[k][sharded];
}

/* What the ep group holds alike summed over it (expert parallel), and the norms' (and the
 * router's) weight gradients under sequence parallel, each tp rank's rows' part, summed over
 * tp once the gradient is complete: under tensor parallel alone all of them in one
 * all-reduce (one per norm was 2L + 1 small collectives, each waited for). */
void par_tp_sum_partial(Parallel *p, int sharded) {
    const Mesh *mesh = p->mesh;
    if (!par_sums_replicated(p)) return;
    if (mesh->ep_size > 1)
        sum_replicated(p, sharded, REPL_EP_K, &mesh->ep, "expert-parallel all-reduce (the gradients the ep group shares)");
    if (mesh->tp_size == 1 || !p->m->sp) return;
    if (mesh->ep_size > 1) {
        sum_replicated(p, sharded, REPL_TP_K, &mesh->tp, "tensor-parallel all-reduce (norms' gradients)");
        return;
    }
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
    if (split_tp(p) || split_ep(p)) {
        sumsq = tp_sumsq(p, sumsq, 0);
        split_sum(p, &sumsq);
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
    split_sum(p, &sumsq);
    if (piped) comm_allreduce_double(p->stages, &sumsq, 1);
    return sqrt(sumsq < 0 ? 0 : sumsq);  /* (rounding below 0; a NaN stays one: an overflow) */
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
        if (lo < hi && n < max) out[n++] = (OwnedRange){u, lo, hi, sp, par_state_at(p, 0, so), par_state_at(p, 1, so)};
        /* Whole parameters: on load every unit's are needed, not only the shard. */
        if (!write && p->params && n < max) out[n++] = (OwnedRange){u, 0, nu, base_p, NULL, NULL};
    }
    return n;
}

void *par_alloc_params(const Parallel *p, size_t bytes) {
    if (p->params_host || (p->lean && ops_precision() == OPS_MIXED)) return NULL;
    return op_alloc(bytes);
}

void par_shard_in(Parallel *p, int u, void *dst) {
    size_t n = shard_len(p, u);
    if (p->hshard) op_copy_in_main(dst, p->hshard + shard_off(p, u), n * sizeof(float));
    else op_copy(dst, st_at(p->pshard, shard_off(p, u)), n * ops_state_size());
}

void *par_whole_params(const Parallel *p, int u) {
    size_t off = p->m->units[u].offset;
    return p->hparams ? (void *)(p->hparams + off) : st_at(p->params, off);
}
