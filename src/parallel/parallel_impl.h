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
typedef struct Offload Offload;  /* offload.c */
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
    void *mom1, *mom2;      /* AdamW moments: full (DDP) or over the shard; Adafactor's first moment
                             * in mom1 (NULL without one), mom2 NULL */
    /* Adafactor (optim == OPTIM_ADAFACTOR): the plan of this rank's part; fp32 statistics,
     * the update's factors and the sums of g^2 (n_stats each, op_alloc); per segment the
     * sums of u^2 and param^2 (op_alloc, and a host copy), per tensor their totals (host) */
    OptimKind optim;
    double af_beta1;
    int af_sharded;
    const Comm *af_tp;  /* tensor parallel: the tp group the statistics are summed over, else NULL */
    AfPlan af;
    float *af_stats, *af_fac, *af_sums;
    float *af_dsums;  /* offload over several ranks: the sums' device copy, all-reduced there */
    double *af_seg, *af_seg_host, *af_tensor;
    Slot slots[N_SLOTS];    /* gradient slots (ZeRO-2), or the pool of parameters and gradients (FSDP) */
    /* precision=mixed: the bf16 copy the ops read, of the whole parameters
     * (cparams, when the strategy holds them whole), or of each parameter slot (cslots[i]
     * for slots[i], FSDP); cstale[u]: unit u of cparams is behind params. */
    void *cparams, *cslots[N_SLOTS];
    unsigned char *cstale;
    void *tp_pack;            /* the norms' gradients packed: sequence parallel's all-reduce of their */
    size_t tp_pack_n;         /* parts, and the norm's replicated part (tp_sumsq); its elements */
    /* the replicated runs of the gradient (whole units [0], shards [1]), found once:
     * model_tp_runs lists 2E + 8 runs a layer, and each pass over them took 0.3-0.7 ms of the
     * host at embed_dim 4096 with the device idle (bench/RESULTS.md, session 22) */
    ReplRun *tp_repl[2];
    int tp_nrepl[2], tp_repl_ready[2];
    size_t tp_repl_elems[2];
    int tp_pack_summed;       /* sharded + 1: tp_pack holds the runs, summed (par_tp_sum_partial) */
    CommReq *greq;            /* per unit: its collective (gradient reduction, parameter gather) */
    unsigned char *grad_open; /* per unit: gradient slot taken this step (1), reducing (2) */
    int adam_steps;
    /* offload=optimizer (oc->offload): the moments above (and Adafactor's statistics) are
     * host memory, and `off` keeps the master weights, the gradients' copy and the update
     * (offload.c); NULL without */
    int offload;
    Offload *off;
    /* offload=params (FSDP): no pshard on the device; this rank's parameter shards are the
     * host's master copy (hshard, fp32, at shard_off(u)), copied into a slot at each gather */
    float *hshard;
    /* Lean offload=optimizer (a strategy with lean_offload, AdamW): the host's master copy
     * (hparams, fp32, whole units at their offsets) is the only copy of the parameters the
     * checkpoint, the init and a load see. The device keeps only what the ops read: with
     * precision=mixed the bf16 compute copy (cparams; no fp32 params at all), with fp32 the
     * params. Gradients go out in the compute type (bf16 with mixed) and each unit's update
     * comes back into the compute copy (offload.c). */
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
    UnitHooks hooks;
};

/* One data-parallel strategy. Entries marked optional may be NULL. */
struct ParallelStrategy {
    const char *name;  /* parallel_kind_name */
    /* 1: a unit is sharded over mesh->shard and each shard replicated over mesh->replicate
     * (hybrid); 0: sharded or replicated over mesh->dp. */
    int replicated;
    /* 1: keeps whole parameters and updates them whole (DDP): offload=optimizer with AdamW is
     * then lean (Parallel.lean); the setup leaves p->params out under precision=mixed. */
    int lean_offload;
    /* Allocates the buffers the strategy keeps and its state, points the model's units at
     * them; with precision=mixed also the bf16 compute copies (par_compute_*). */
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
    /* parallel_step, all of it: the gradient reductions' end, the norm, clipping, AdamW. */
    double (*step)(Parallel *p, const OptimConfig *oc, double *lr);
    /* parallel_ranges, after the shared part (a hybrid replica other than the first saves nothing). */
    int (*ranges)(const Parallel *p, int write, OwnedRange *out, int max);
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
/* Starts reduce-scattering unit u's gradient from src into this rank's gshard. */
void par_reduce_scatter_grad(Parallel *p, int u, void *src, CommReq *req);
/* Waits for every gradient reduction into the shard (greq, the slots). */
void par_wait_grads(Parallel *p);

/* ---- the optimizer ---- */
/* What the rank updates of unit u: its parameters and gradient (device) and first moment,
 * and `own`, its offset in the optimizer's buffers (mom1, mom2: the shard's offset, or the
 * unit's in whole buffers). Its length: shard_len with a gradient shard, else the unit. */
void par_owned(Parallel *p, int u, void **param, const void **grad, void **m1, size_t *own);
/* A strategy's setup allocates the optimizer's elementwise state over n elements (AdamW's
 * two moments, or Adafactor's first moment if any) and, for Adafactor, its statistics and
 * plan: sharded = 1 where the rank updates its shard of each unit, 0 whole units. */
void par_alloc_optim(Parallel *p, size_t n, int sharded);
/* The Adafactor step on what the rank updates (sharded as par_alloc_optim said): counts the
 * step; returns the step size before parameter scaling (the lr it logs). Where sharded over
 * more than one rank, the sums of g^2 and the per-tensor sums are reduced over the group. */
double par_adafactor(Parallel *p, const OptimConfig *oc, float scale);
/* The step's learning rate; counts the step (p->adam_steps is then AdamW's step number). */
double par_next_lr(Parallel *p, const OptimConfig *oc);
/* AdamW over n elements; with act (precision=mixed) it also writes their bf16 copy there. */
void par_adamw(void *param, const void *grad, void *m1, void *m2, size_t n, const OptimConfig *oc, double lr,
               int step, float scale, void *act);
/* A rank's sum of squares of its gradient, summed over the pipeline's stages (without the
 * tied embedding's copy); the sum itself with one stage. */
double par_stages_sumsq(Parallel *p, double sumsq);
/* Sequence parallel (model's sp): the gradients every tp rank holds alike (the norms'
 * weights) are each rank's part, from its rows of the sequence, until this sums them over
 * the tp group: once a step, where the gradient is complete (reduced over dp) and before
 * its norm or any update. sharded: this rank's gradient is its shard of each unit (gshard;
 * par_shard_norm calls it), else the whole units (grads, DDP). */
void par_tp_sum_partial(Parallel *p, int sharded);
/* The global norm of the gradient shards (gshard) over the group. */
double par_shard_norm(Parallel *p);

/* ---- offload=optimizer (offload.c) ---- */
/* Host memory for the offloaded state (pinned on a GPU), or a one-line exit 2. */
void *par_host_alloc(size_t bytes, const char *what);
/* After the strategy's setup (its buffers and par_alloc_optim's host moments): the master
 * copy, the gradients' copy, the worker thread. par_offload_free: waits and frees. */
void par_offload_setup(Parallel *p);
void par_offload_free(Parallel *p);
/* The parameters were written (the init, a load): the master copy := the device's
 * parameters; lean (p->lean), where the init and the load wrote the master, the device's
 * compute copy := the master instead. */
void par_offload_params_written(Parallel *p);
/* Before a step's gradients are cleared: the last step's copies out are done. */
void par_offload_begin_step(Parallel *p);
/* Unit u's last reduction of the step is r: once r is done its gradient goes out to the
 * host (par_offload_poll, from par_progress). */
void par_offload_grad_request(Parallel *p, int u, CommReq *r);
/* Unit u's device gradient changed after it may have been copied out (under sequence parallel
 * the norms' parts are summed over tp at the step, par_tp_sum_partial): copied out again,
 * after the first on the in-order out queue, before the update reads it. */
void par_offload_grad_changed(Parallel *p, int u);
void par_offload_poll(Parallel *p);
/* The AdamW step of every unit, on the worker (after the step's reductions and norm):
 * returns at once; each unit's parameters are back on the device at par_offload_ready. */
void par_offload_adamw(Parallel *p, const OptimConfig *oc, double lr, int step, float scale);
/* Adafactor's (on this thread): every gradient into the host copy, waited for; and after
 * the update every unit's parameters back to the device (waited for at par_offload_ready). */
void par_offload_grads_in(Parallel *p);
void par_offload_params_out(Parallel *p);
/* Unit u's update is done and its parameters are on the device (the main queue waits for
 * them): 1. wait = 0: 0 instead of waiting while its update still runs. 1 without offload. */
int par_offload_ready(Parallel *p, int u, int wait);
void par_offload_finish(Parallel *p);  /* par_offload_ready of every unit */
/* Whether a strategy's setup should make this run lean (AdamW, offload=optimizer, a
 * strategy with lean_offload); it sets p->lean before allocating. */
int par_offload_lean(const Parallel *p);
float *par_offload_master(const Parallel *p);
float *par_offload_grad(const Parallel *p);

/* ---- parameters ---- */
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
