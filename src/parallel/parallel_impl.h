/* The shared core of the data-parallel strategies: what every strategy file (ddp.c,
 * zero.c, fsdp.c) may use, and the table each of them fills. parallel.c implements these
 * pieces and the public interface (parallel.h), which runs through the table; it never
 * names a strategy except in the one lookup from ParallelKind to table. Strategy files
 * depend on this header only, never on each other. */
#ifndef MESHTRAIN_PARALLEL_IMPL_H
#define MESHTRAIN_PARALLEL_IMPL_H
#include "comm.h"
#include "ops.h"
#include "parallel.h"

/* Units live in slots while gathered (FSDP) or while their gradient accumulates and
 * drains (ZeRO-2, FSDP).
 * - ZeRO-2's gradient slots: at most two units are live at once (one accumulating, the
 *   previous one reducing), and at most one of them is the embedding or the head; tied
 *   embeddings keep tok_embed's gradient open from the head to the end of the backward.
 *   So: one slot the size of the largest of tok_embed and the head ("big"), two the size
 *   of a layer, and a second big one when tied.
 * - FSDP's one pool, shared by gathered parameters and gradients (they are never all live
 *   at once): in a layer's backward, its parameters, the next unit's prefetch, its
 *   gradient and the previous unit's draining gradient (four slots, plus tok_embed's open
 *   gradient when tied); in the head's backward, the head's parameters and gradient (two
 *   big) and the next layer's prefetch. So: two big slots and two layer slots (three when
 *   tied); a layer may take a big slot. When the pool is full a prefetch is skipped and a
 *   gradient waits for the oldest draining one: slower, never wrong. */
#define N_SLOTS 5

/* Every flat buffer below (parameters, gradients, moments, slots) holds elements of the ops'
 * state type: fp32, or bf16 with precision=bf16 (ops_state_size, st_at). */
typedef struct {
    void *buf;
    size_t cap;     /* elements; 0 = slot not used by this model */
    int unit;       /* unit held, -1 = free */
    CommReq req;    /* the collective filling (params) or draining (grads) it */
    int grad;       /* holds a gradient (else parameters); FSDP's pool holds both */
    int cast;       /* parameter slots with bf16 compute: the bf16 copy matches buf */
} Slot;

typedef struct ParallelStrategy ParallelStrategy;
typedef struct { int unit; size_t at, n; } ReplRun;  /* a replicated run of a unit's gradient (pack_replicated) */

/* What every strategy has; the strategy's own fields are behind `st`. A strategy's setup
 * allocates the buffers it keeps (the others stay NULL), and the shared code below works
 * from which of them exist: whole parameters (params) or only a shard (pshard). */
struct Parallel {
    const ParallelStrategy *s;
    void *st;               /* the strategy's own state (its setup allocates, its free frees) */
    Model *m;
    Mesh *mesh;
    const Comm *group;      /* ranks a unit is sharded (or replicated) over */
    const Comm *replicas;   /* ranks holding the same shard (hybrid's other nodes); else NULL */
    int D, r, overlap;
    size_t n_shard;
    void *params, *grads;   /* full flat buffers where the strategy keeps them whole */
    void *pshard, *gshard;  /* this rank's shard of every unit (unit u at offset_u / D) */
    /* The optimizer of what the rank updates (its shard of every unit where the strategy
     * keeps gradient shards, gshard: sharded; else whole units), made after the strategy's
     * setup from its buffers (par_owned_unit); its state, and with offload its master copy,
     * live where its placement puts them (src/optim). */
    Optimizer *opt;
    int sharded;
    Slot slots[N_SLOTS];    /* gradient slots (ZeRO-2), or the pool of parameters and gradients (FSDP) */
    /* precision=mixed: the bf16 copy the ops read, of the whole parameters
     * (cparams, when the strategy holds them whole), or of each parameter slot (cslots[i]
     * for slots[i], FSDP); cstale[u]: unit u of cparams is behind params. */
    void *cparams, *cslots[N_SLOTS];
    unsigned char *cstale;
    void *tp_pack;            /* the norms' gradients packed: sequence parallel's all-reduce of their */
    size_t tp_pack_n;         /* parts, and the norm's replicated part (tp_sumsq); its elements */
    /* the replicated runs of the gradient, [k][sharded]: those the tp group holds alike (k = 0,
     * TP_REPL_TP) or the ep group (k = 1, TP_REPL_EP), of whole units [0] or shards [1], found
     * once: model_tp_runs lists 2E + 8 runs a layer, and each pass over them took 0.3-0.7 ms of
     * the host at embed_dim 4096 with the device idle
     * (bench/results/tensor-parallel-h200x2-2026-11.md) */
    ReplRun *tp_repl[2][2];
    int tp_nrepl[2][2], tp_repl_ready[2][2];
    size_t tp_repl_elems[2][2];
    int tp_pack_summed;       /* sharded + 1: tp_pack holds the runs, summed (par_tp_sum_partial) */
    CommReq *greq;            /* per unit: its collective (gradient reduction, parameter gather) */
    unsigned char *grad_open; /* per unit: gradient slot taken this step (1), reducing (2) */
    /* per unit: the collective whose end completes its gradient this step (par_grad_final),
     * while the optimizer's placement wants to know (the host's: it copies it out then) */
    CommReq **gfinal;
    /* offload=params (FSDP): no pshard on the device; this rank's parameter shards are the
     * host's master copy (hshard, fp32, at shard_off(u)), copied into a slot at each gather */
    int params_host;
    float *hshard;
    /* Lean offload=optimizer (a strategy with updates_all, an optimizer that can be:
     * parallel_offload_lean): the host's master copy (hparams, fp32, whole units at their
     * offsets) is the only copy of the parameters the checkpoint, the init and a load see.
     * The device keeps only what the ops read: with precision=mixed the bf16 compute copy
     * (cparams; no fp32 params at all), with fp32 the params. Gradients go out in the compute
     * type (bf16 with mixed) and each unit's update comes back into the compute copy
     * (src/optim/offload.c). */
    int lean;
    float *hparams;
    /* Pipeline parallel: the other stages of this rank's pipeline, over which the gradient
     * norm is summed; a tied embedding's copy (on the last stage) is not counted twice. */
    const Comm *stages;
    int count_embedding;
    /* Micro-batches per step (gradient accumulation, pipeline), and per unit how many of
     * their gradients are complete so far this step (in whatever order a schedule runs
     * them: a unit's last is its n_micro-th). */
    int n_micro;
    int *n_ready;
    double wait_s;
    int overflow_next;  /* parallel_inject_overflow: the step's next unit gradient made non-finite */
    UnitHooks hooks;
    /* grad_compression (DDP): the buckets' all-reduce compressed, with error feedback (compress.h) */
    struct Compressor *comp;
    int comp_warmup;  /* PowerSGD: the optimizer steps it leaves uncompressed */
};

/* One data-parallel strategy. Entries marked optional may be NULL. */
struct ParallelStrategy {
    const char *name;  /* parallel_kind_name */
    /* 1: a unit is sharded over mesh->shard and each shard replicated over mesh->replicate
     * (hybrid); 0: sharded or replicated over mesh->dp. */
    int replicated;
    /* 1: keeps whole parameters and updates them all (DDP): offload=optimizer may then be
     * lean (Parallel.lean: par_alloc_params leaves p->params out under precision=mixed). */
    int updates_all;
    /* Allocates the buffers the strategy keeps and its state, points the model's units at
     * them; with precision=mixed also the bf16 compute copies (par_compute_*). The
     * optimizer's state is made after it, over what par_owned_unit says the rank updates. */
    void (*setup)(Parallel *p);
    /* Waits for the strategy's own requests and frees its state (the shared buffers are
     * freed by parallel_free). Optional. */
    void (*free)(Parallel *p);
    /* The model's unit hooks, called with ctx = the Parallel (UnitHooks). Optional. */
    void (*gather)(void *ctx, int u, int next);
    void (*release)(void *ctx, int u);
    void (*grad_begin)(void *ctx, int u);
    void (*grad_ready)(void *ctx, int u);
    /* The model's init into what this rank holds (par_init_whole / par_init_shard). */
    void (*init_weights)(Parallel *p, uint64_t seed);
    /* The parameters were written from outside; optional (no copies to remake). */
    void (*params_changed)(Parallel *p);
    /* Before a step's forward, after the shared part (wait_s, gradient slots); optional. */
    void (*begin_step)(Parallel *p);
    /* parallel_step, all of it: the gradient reductions' end, the norm, clipping, the
     * update (par_update_*) of the ranges the rank owns. */
    double (*step)(Parallel *p, const OptimConfig *oc, double *lr);
    /* parallel_ranges, after the shared part (a hybrid replica other than the first saves nothing). */
    int (*ranges)(const Parallel *p, int write, OwnedRange *out, int max);
    /* parallel_bytes of the strategy's buffers; its `optim`: the bytes of one elementwise
     * array over what the rank updates (the optimizer's are counted from it: optim_bytes). */
    ParallelBytes (*bytes)(const Model *layout, int D, size_t state_size, size_t compute_size);
    /* Optional: parallel_set_bucket; parallel_wants_embedding_rows and
     * parallel_set_embedding_rows (the step's token rows, ascending and distinct). */
    void (*set_bucket)(Parallel *p, size_t bytes);
    int (*wants_rows)(const Parallel *p);
    void (*set_rows)(Parallel *p, const int *rows, size_t n);
};

extern const ParallelStrategy par_ddp;                 /* ddp.c */
extern const ParallelStrategy par_zero1, par_zero2;    /* zero.c */
extern const ParallelStrategy par_fsdp, par_hybrid;    /* fsdp.c */

static inline size_t shard_len(const Parallel *p, int u) { return p->m->units[u].n_padded / (size_t)p->D; }
static inline size_t shard_off(const Parallel *p, int u) { return p->m->units[u].offset / (size_t)p->D; }
/* The collectives' element type: the state type. */
static inline CommType par_ctype(void) { return ops_state_size() == 2 ? COMM_BF16 : COMM_F32; }

/* ---- slots ---- */
/* Capacities of the N_SLOTS slots for this model (0 = unused): ZeRO-2's gradient slots, or
 * FSDP's pool (pool != 0); their sum. Allocation of p->slots. */
void par_slot_caps(const Model *m, int pool, size_t caps[N_SLOTS]);
size_t par_slot_elems(const Model *m, int pool);
void par_alloc_slots(Parallel *p, int pool);
/* Takes a slot for unit u's gradient (grad = 1) or parameters: the smallest free one that
 * holds it, where a gradient slot whose reduction has finished counts as free; failing
 * that, waits for a draining gradient slot that fits. may_fail: returns NULL instead of
 * waiting (a prefetch). */
Slot *par_take_slot(Parallel *p, int u, int grad, int may_fail);
/* Gradient hooks for gradients kept in slots (ZeRO-2, FSDP): grad_begin takes a zeroed
 * slot for unit u; grad_ready reduce-scatters it into this rank's gshard. */
void par_slot_grad_begin(void *ctx, int u);
void par_slot_grad_ready(void *ctx, int u);

/* ---- communication ---- */
/* Waits on r, counting the time as communication wait. */
void par_wait(Parallel *p, CommReq *r);
/* Drives MPI progress of everything in flight (called at unit boundaries). */
void par_progress(Parallel *p);
/* Starts averaging n elements of gradient at buf over the group, in place: flat, or where
 * the mesh says (hier_allreduce, the group being dp) machine by machine (comm_iallreduce_hier). */
void par_allreduce_grad(Parallel *p, void *buf, size_t n, CommReq *req);
/* Starts reduce-scattering unit u's gradient from src into this rank's gshard (compressed:
 * done on return). */
void par_reduce_scatter_grad(Parallel *p, int u, void *src, CommReq *req);
/* Hybrid: unit u's gradient shard averaged over the replicas (compressed: done on return). */
void par_replicas_allreduce(Parallel *p, int u, CommReq *req);
/* Waits for every gradient reduction into the shard (greq, the slots). */
void par_wait_grads(Parallel *p);

/* ---- the optimizer (src/optim: its state, its update, where they live) ---- */
/* What the rank updates of unit u, on the device: its parameters (NULL where they are the
 * host's: offload=params), its gradient (its shard of it with a gradient shard), and the
 * compute copy its update may write as it goes (DDP's, updating whole units). */
OptimUnit par_owned_unit(const Parallel *p, int u);
/* A step's update, which a strategy calls on the ranges it owns once it has reduced their
 * gradients: par_update_begin counts the step and returns its rate; par_update_stats, once
 * every gradient the rank updates is complete and its norm known, computes the statistics
 * the optimizer needs of whole tensors, summed over the shard group (where the rank updates
 * shards) and the tp group (none for AdamW); par_update updates units [u0, u1), contiguous
 * in the rank's buffers, with the gradient times scale (the same for every call of a step),
 * and marks their compute copies stale unless the update wrote them. */
double par_update_begin(Parallel *p, const OptimConfig *oc);
/* After par_update_begin, once the step's global gradient norm is known (the same on every
 * rank: summed over every group holding a part of the gradient, so a non-finite value
 * anywhere is non-finite everywhere): whether the update happens. The norm is of the
 * gradient as the backward made it, times the loss scale; *norm becomes the unscaled norm
 * and *scale the factor the update multiplies the gradient by (clipping's on the unscaled
 * norm, over the loss scale). 0: the loss scaler skips the step (an overflow): nothing may
 * be updated, and the step is uncounted. */
int par_update_go(Parallel *p, const OptimConfig *oc, double *norm, float *scale);
void par_update_stats(Parallel *p, float scale);
void par_update(Parallel *p, int u0, int u1, float scale);
/* Whether some units may be updated before the others' gradients are complete (AdamW on
 * the device: DDP's update in two parts). */
int par_update_parts(const Parallel *p);
/* Whether the step's updates reach the device later, unit by unit (with offload, from the
 * host), rather than in the device's queue: par_update_ready says when each is there. */
int par_update_later(const Parallel *p);
/* Unit u's update is done and its parameters are where the forward reads them (the main
 * queue waits for them): 1. wait = 0: 0 instead of waiting while it still runs. */
int par_update_ready(Parallel *p, int u, int wait);
/* Unit u's last reduction of the step is r: once r is done its gradient is complete, which
 * the optimizer's placement may take from then (offload copies it out: par_progress polls). */
void par_grad_final(Parallel *p, int u, CommReq *r);
/* Unit u's gradient changed after it was complete (under sequence parallel the norms' parts
 * are summed over tp at the step, par_tp_sum_partial): taken again before the update. */
void par_grad_changed(Parallel *p, int u);
/* The optimizer's k-th elementwise array at element `at` of what the rank updates (NULL
 * where it keeps fewer): a checkpoint range's m (k = 0) and v (k = 1). */
void *par_state_at(const Parallel *p, int k, size_t at);
/* A rank's sum of squares of its gradient, summed over the pipeline's stages (without the
 * tied embedding's copy); the sum itself with one stage. */
double par_stages_sumsq(Parallel *p, double sumsq);
/* Sequence parallel (model's sp): the gradients every tp rank holds alike (the norms'
 * weights) are each rank's part, from its rows of the sequence, until this sums them over
 * the tp group; expert parallel (mesh's ep_size > 1): everything but the experts is each ep
 * rank's part, from its own tokens, until this sums it over the ep group: once a step, where the gradient is complete (reduced over dp) and before
 * its norm or any update. sharded: this rank's gradient is its shard of each unit (gshard;
 * par_shard_norm calls it), else the whole units (grads, DDP). */
void par_tp_sum_partial(Parallel *p, int sharded);
/* Whether par_tp_sum_partial sums anything (sequence parallel; expert parallel, whose ep group
 * sums everything but the experts): no update, nor its norm, may run before it. */
int par_sums_replicated(const Parallel *p);
/* The global norm of the gradient shards (gshard) over the group. */
double par_shard_norm(Parallel *p);

/* ---- parameters ---- */
/* The device buffer (bytes) of the parameters the rank updates, or NULL where the
 * optimizer's host copy is them (offload=params: the shards; lean under precision=mixed,
 * where the device keeps only the compute copy). */
void *par_alloc_params(const Parallel *p, size_t bytes);
/* This rank's shard of unit u's parameters into dst (a slot's part): from the device's
 * shard, or from the host's master copy (offload=params: on the main queue). */
void par_shard_in(Parallel *p, int u, void *dst);
/* Unit u's whole parameters as a checkpoint reads them: the device's, or lean the host's
 * master copy (the only fp32 copy). */
void *par_whole_params(const Parallel *p, int u);
/* precision=mixed, a no-op otherwise: the bf16 copy of the whole parameters (cparams, the
 * units' ucompute), remade unit by unit when behind (par_cast_unit, from the gather hook);
 * or one per pool slot (cslots), cast at each gather. */
void par_compute_whole(Parallel *p);
void par_compute_slots(Parallel *p);
/* The parameters changed (init, load, update): every unit's compute copy is to be remade. */
void par_params_stale(Parallel *p);
/* Remakes unit u's compute copy if it is behind the parameters. */
void par_cast_unit(Parallel *p, int u);
/* init_weights entries: into the whole parameters, or this rank's shard of each unit. */
void par_init_whole(Parallel *p, uint64_t seed);
void par_init_shard(Parallel *p, uint64_t seed);
/* ranges entry of sharded optimizer state: this rank's shard of every unit (parameters
 * from pshard, or from the whole params); on load, whole params need every unit too. */
int par_shard_ranges(const Parallel *p, int write, OwnedRange *out, int max);
#endif
