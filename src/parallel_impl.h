/* Internals shared by parallel.c and the strategy files (ddp.c, zero.c, fsdp.c). */
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

struct Parallel {
    ParallelKind kind;
    Model *m;
    Mesh *mesh;
    const Comm *group;      /* ranks a unit is sharded (or replicated) over */
    const Comm *replicas;   /* hybrid: the same shard on other nodes; else a group of one */
    int D, r, overlap;
    size_t n_shard;
    void *params, *grads;   /* full flat buffers where the strategy keeps them whole */
    void *pshard, *gshard;  /* this rank's shard of every unit (unit u at offset_u / D) */
    void *mom1, *mom2;      /* AdamW moments: full (DDP) or over the shard */
    Slot pslots[N_SLOTS], gslots[N_SLOTS];
    /* precision=mixed: the bf16 copy the ops read, of the whole parameters
     * (cparams, when the strategy holds them whole), or of each parameter slot (cslots[i]
     * for pslots[i], FSDP); cstale[u]: unit u of cparams is behind params. */
    void *cparams, *cslots[N_SLOTS];
    unsigned char *cstale;
    /* DDP: side_pending[u]: unit u's update runs on the ops' side queue (op_side_mark u),
     * beside the next step's forward, which waits for it at the unit's gather. */
    unsigned char *side_pending;
    int side_update;
    size_t side_lo;  /* those units are [side_lo, n_flat): the side queue also zeroes their gradients */
    CommReq *greq, *rreq;   /* per unit: gradient reduction, hybrid replica all-reduce */
    int *refs;              /* per unit: FSDP gather references */
    unsigned char *grad_open; /* per unit: gradient slot taken this step */
    int adam_steps;
    /* DDP's bucket: the gradient range [bkt_off, bkt_off + bkt_n) not yet reduced, whose
     * all-reduce goes in greq[bkt_unit] (its first unit); flushed at bucket_bytes. */
    size_t bucket_bytes, bkt_off, bkt_n;
    int bkt_unit;
    /* DDP: greq_late[u]: greq[u] was started at the end of the backward (by units 2..0, the
     * embedding rows or parallel_step), likely still in flight; they cover [0, late_hi).
     * Every reduction above late_hi started earlier, so without clipping the update of
     * [late_hi, n_flat) runs while the late ones finish. */
    unsigned char *greq_late;
    size_t late_hi;
    /* DDP over several ranks, untied embedding: the embedding's gradient is all-reduced only
     * in the rows this step's global batch uses (the others are zero on every rank):
     * erows (op_alloc, ascending, n_erows of them, at most erows_cap), gathered into ebuf,
     * reduced, and scattered back before the update. n_erows == SIZE_MAX: not set for this
     * step (or too many), the whole unit is reduced. */
    int *erows;
    void *ebuf;
    size_t erows_cap, n_erows;
    int erows_pending;
    double wait_s;
    UnitHooks hooks;
};

static inline size_t shard_len(const Parallel *p, int u) { return p->m->units[u].n_padded / (size_t)p->D; }
static inline size_t shard_off(const Parallel *p, int u) { return p->m->units[u].offset / (size_t)p->D; }
/* Where gradient slots come from: FSDP's shared pool, or ZeRO-2's own set. */
static inline Slot *par_grad_slots(Parallel *p) { return p->pshard ? p->pslots : p->gslots; }
/* The collectives' element type: the state type. */
static inline CommType par_ctype(void) { return ops_state_size() == 2 ? COMM_BF16 : COMM_F32; }

/* Capacities of the N_SLOTS slots for this model (0 = unused): ZeRO-2's gradient slots, or
 * FSDP's pool (pool != 0); allocation of a slot set. */
void par_slot_caps(const Model *m, int pool, size_t caps[N_SLOTS]);
void par_alloc_slots(Parallel *p, Slot *slots, int pool);
/* Takes a slot of `slots` for unit u's gradient (grad = 1) or parameters: the smallest free
 * one that holds it, where a gradient slot whose reduction has finished counts as free;
 * failing that, waits for a draining gradient slot that fits. may_fail: returns NULL
 * instead of waiting (a prefetch). */
Slot *par_take_slot(Parallel *p, Slot *slots, int u, int grad, int may_fail);

/* Waits on r, counting the time as communication wait. */
void par_wait(Parallel *p, CommReq *r);
/* Drives MPI progress of everything in flight (called at unit boundaries). */
void par_progress(Parallel *p);
/* Gradient slots (ZeRO-2, FSDP): the slot buffer for unit u's gradient, zeroed. */
void *par_grad_slot(Parallel *p, int u);
/* Starts reduce-scattering unit u's gradient from src into this rank's gshard. */
void par_reduce_scatter_grad(Parallel *p, int u, void *src, CommReq *req);

void ddp_setup(Parallel *p);
/* DDP: starts the all-reduce of the pending bucket, if any. */
void ddp_flush(Parallel *p);
/* DDP: the most embedding rows reduced by themselves (a quarter of the vocabulary), 0 where
 * the whole unit always is (one rank, tied embeddings). */
size_t ddp_erows_cap(const Model *m, int D);
/* DDP's optimizer step (parallel_step). */
double ddp_step(Parallel *p, const OptimConfig *oc, double *lr_out);
void zero_setup(Parallel *p);
void zero_gather_params(Parallel *p);
/* ZeRO-2's gradient hooks (slots + reduce-scatter), FSDP uses them too. */
void zero2_grad_begin(void *ctx, int u);
void zero2_grad_ready(void *ctx, int u);
void fsdp_setup(Parallel *p);
/* precision=mixed: points the model's units at their bf16 compute copies where the strategy
 * holds whole parameters, or makes the bf16 slots (FSDP); a no-op in fp32 and bf16. Called
 * by parallel_create after the strategy's setup. */
void par_setup_compute(Parallel *p);
/* The parameters changed (init, load, update): every unit's compute copy is to be remade. */
void par_params_stale(Parallel *p);
/* The gather hook of strategies holding whole parameters (DDP, ZeRO): ZeRO waits for unit
 * u's parameter all-gather (started after the last update, overlapping this forward), and
 * with precision=mixed unit u's bf16 copy is remade if it is behind. */
void par_whole_gather(void *ctx, int u, int next);
void fsdp_drop_prefetch(Parallel *p);
#endif
