/* optim — the optimizer layer: AdamW (adamw.c) and Adafactor (adafactor.c) behind one
 * interface, the Optimizer below (each fills the table in optim_impl.h, as the strategies
 * fill ParallelStrategy); the learning-rate schedule and clipping by the global gradient
 * norm (lr_schedule.c).
 *
 * An Optimizer keeps the state of what one rank updates of every unit of a layout: arrays
 * per element that mirror the units' flat layout, over whole units or over the rank's part
 * of each (its shard), and state per tensor (Adafactor's statistics). A step counts itself
 * (optim_begin), computes the statistics the update needs over whole tensors, which the
 * caller sums over the ranks that share the tensors (optim_stats: Adafactor's row and
 * column sums of g^2 and its sums of u^2 and param^2; AdamW needs none), and updates ranges
 * of units (optim_update).
 *
 * Its placement (OptimConfig.offload; offload.c) is where the state and the update live: on
 * the device, the ops' kernels in the device's queue; or in host memory beside a fp32
 * master copy of the parameters and a copy of the gradient, with the cpu backend's kernels:
 * an elementwise update (AdamW) on a host thread unit by unit while the device goes on, the
 * others on the calling thread at the step. The data-parallel strategies (parallel/) own
 * the units, reduce the gradients and drive the step.
 *
 * Beside the optimizer, its loss scaler (loss_scale.c): the factor the loss's gradient is
 * multiplied by before the backward, and the decision, once the step's global gradient norm
 * is known, whether the update happens at all (an overflow skips it). */
#ifndef MESHTRAIN_OPTIM_H
#define MESHTRAIN_OPTIM_H
#include <stddef.h>
#include "model.h"

typedef enum { OPTIM_ADAMW, OPTIM_ADAFACTOR } OptimKind;

/* Loss scaling: none (the gradient as it is), a fixed scale, or a dynamic one (PyTorch's
 * GradScaler with hysteresis 1, Megatron-LM's DynamicGradScaler with more). */
typedef enum { LOSS_SCALE_NONE, LOSS_SCALE_FIXED, LOSS_SCALE_DYNAMIC } LossScaleKind;
typedef struct LossScaleConfig {
    LossScaleKind kind;
    double init;     /* the scale at the start (fixed: the scale) */
    double min;      /* dynamic: the scale never backs off below it */
    int window;      /* dynamic: steps without an overflow before the scale doubles */
    int hysteresis;  /* dynamic: overflows before a backoff (1 = every one), since the last growth */
} LossScaleConfig;

typedef struct {
    double lr, min_lr, beta1, beta2, eps, weight_decay, grad_clip;
    int warmup_steps, decay_steps, cosine;  /* decay_steps: the cosine reaches min_lr there */
    OptimKind kind;                         /* OPTIM_ADAMW (0) unless set */
    /* Adafactor: first-moment beta1 (0 = none), update clipping threshold d, decay rate c
     * (beta2_t = 1 - t^-c), relative step (min(1e-2, 1/sqrt t) instead of the lr schedule),
     * parameter scaling (the step times max(eps2, RMS(param))) */
    double af_beta1, af_clip, af_decay;
    int af_relative_step, af_scale_parameter;
    /* where the optimizer's state lives: OFFLOAD_NONE (the device), OFFLOAD_OPTIMIZER (fp32
     * master weights and state in host memory, the update on the CPU), OFFLOAD_PARAMS (FSDP:
     * the parameter shards there too) */
    int offload;
    LossScaleConfig loss_scale;             /* LOSS_SCALE_NONE (0) unless set */
} OptimConfig;

enum { OFFLOAD_NONE, OFFLOAD_OPTIMIZER, OFFLOAD_PARAMS };

/* "adamw" / "adafactor" */
const char *optim_kind_name(OptimKind k);
/* Elementwise arrays the optimizer keeps beside the parameters: AdamW's m and v (2);
 * Adafactor's first moment (1 with af_beta1 > 0, else 0). c NULL: AdamW. */
int optim_moments(const OptimConfig *c);

/* ---- the learning-rate schedule and clipping (lr_schedule.c) ---- */

/* Learning rate for optimizer step `step` (0-based): linear warmup over warmup_steps, then
 * constant, or cosine from lr down to min_lr at decay_steps (min_lr after it). */
double lr_at(const OptimConfig *c, int step);
/* Global L2 norm of a gradient buffer (double accumulation). */
double grad_norm(const float *g, size_t n);
/* The factor clipping multiplies the gradient by: min(1, clip / norm) (1 when clip is off). */
float clip_scale(const OptimConfig *c, double norm);

/* ---- the loss scaler (loss_scale.c) ---- */

/* A dynamic scale's state machine, its semantics exactly those of PyTorch's GradScaler.update
 * (growth factor 2, backoff 0.5, growth interval = window) at hysteresis 1 and of Megatron-LM's
 * DynamicGradScaler.update beyond, with the scale kept in fp32 as both keep it. A fixed scale
 * never changes; with either, a step whose gradient overflowed is skipped and counted. */
typedef struct {
    LossScaleConfig c;
    float scale;      /* what this step's loss gradient is multiplied by (1 with none) */
    int growth;       /* steps without an overflow since the scale last changed (the growth tracker) */
    int hysteresis;   /* overflows left before a backoff (the hysteresis tracker; reset at each growth) */
    int skipped;      /* steps skipped for an overflow, in all (a resumed run's too) */
    int last_skipped; /* the last step was skipped */
} LossScaler;

void loss_scaler_init(LossScaler *s, const LossScaleConfig *c);
/* After a step's gradient: overflow = it was not finite somewhere. Moves the scale for the
 * next step and returns 1 where this step's update happens, 0 where it is skipped. */
int loss_scaler_update(LossScaler *s, int overflow);
/* "none", "dynamic", or the fixed scale (as the key's value), into buf */
const char *loss_scale_name(const LossScaleConfig *c, char *buf, size_t len);

/* ---- the Optimizer ---- */

typedef struct Optimizer Optimizer;

/* Where the rank's part of one unit lives on the device. param: its parameters (state type),
 * which the update writes; NULL where the host's master copy is them (offload=params). grad:
 * its gradient. act: NULL, or the compute copy of those parameters (precision=mixed's bf16)
 * that an update on the device writes as it goes (AdamW's). Lean (below): param is where
 * the host's update comes back, the compute copy where there is one. */
typedef struct {
    void *param;
    const void *grad;
    void *act;
} OptimUnit;

typedef struct {
    const OptimConfig *oc;  /* the kind, Adafactor's first moment, the placement (offload) */
    const Model *m;         /* the layout: its units and tensors (tensor parallel's slices) */
    /* the rank updates elements [r n / D, (r + 1) n / D) of every unit (n: its padded size),
     * and keeps the state of those only; D = 1: whole units */
    int D, r;
    int summed;             /* its statistics are summed over other ranks (optim_stats) */
    /* host placement, offload=optimizer: the master copy is the only fp32 copy of the
     * parameters, the gradients' copy is in the compute type (bf16 with precision=mixed)
     * (optim_lean_possible) */
    int lean;
    const OptimUnit *units; /* per unit of m */
} OptimSetup;

/* Allocates the state (in host memory with offload, or a one-line exit 2 where it cannot)
 * and, with offload, the master copy, the gradients' copy and the update thread. */
Optimizer *optim_create(const OptimSetup *s);
void optim_free(Optimizer *o);
OptimKind optim_kind(const Optimizer *o);
/* Completed steps (a checkpoint's adam_step). */
int optim_steps(const Optimizer *o);
void optim_set_steps(Optimizer *o, int steps);
/* The k-th elementwise array (state type, element i of unit u's part at i + its offset:
 * offset / D of the unit's), or NULL where it keeps fewer. */
void *optim_moment(const Optimizer *o, int k);

/* A step. optim_begin counts it and returns its rate (the lr it logs); oc is the config the
 * state was made for. An optimizer with statistics rounds (optim_stat_rounds) then, once
 * every gradient it updates is complete and scaled by `scale` (clipping): for each round,
 * optim_stats computes this rank's part and returns what the caller sums over the ranks
 * (OptimSetup.summed) before optim_stats_summed. Then optim_update updates units
 * [u0, u1), whose parts are contiguous in the rank's buffers, with the gradient times
 * scale (every call of a step the same scale); it returns 1 where it also wrote their
 * compute copies (OptimUnit.act), else 0 (the caller then remakes them). */
double optim_begin(Optimizer *o, const OptimConfig *oc);
typedef struct {
    void *buf;               /* n fp32 in device memory (the collectives'), or n doubles in host memory */
    size_t n;
    int host;
    const char *what, *what_tp;  /* the collectives' names: over the shard group, over the tp group */
} OptimSums;
int optim_stat_rounds(const Optimizer *o);
OptimSums optim_stats(Optimizer *o, int round, float scale);
void optim_stats_summed(Optimizer *o, int round);
int optim_update(Optimizer *o, int u0, int u1, float scale);
/* The loss scaler of the steps (OptimConfig.loss_scale, as at optim_create): the factor the
 * backward multiplies the loss's gradient by (1 without one), and its state (a checkpoint's,
 * the log's; set it after a load). */
float optim_loss_scale(const Optimizer *o);
LossScaler *optim_loss_scaler(Optimizer *o);
/* After optim_begin, once the global norm of the step's gradient is known: overflow = it is
 * not finite. The loss scaler decides: 1, the update goes ahead; 0, the step is skipped and
 * uncounted (the optimizer's steps and its schedule stay where they were; nothing may be
 * updated). Without a scaler always 1. */
int optim_loss_scale_step(Optimizer *o, int overflow);
/* Whether some units may be updated before the others' gradients are complete: an
 * elementwise update in the device's queue (not with statistics, not on the host). */
int optim_updates_in_parts(const Optimizer *o);

/* ---- the placement: no-ops on the device ---- */
/* 1 with offload: the state, the master copy and the update are the host's. */
int optim_on_host(const Optimizer *o);
/* The host's fp32 master copy (unit u's part at offset / D of the unit's), NULL on the device. */
float *optim_master(const Optimizer *o);
/* Before a step's gradients are cleared: the last step's copies of them are done. */
void optim_new_grads(Optimizer *o);
/* Unit u's gradient is complete for this step: copied out now. optim_grad_wanted: it has not
 * been yet this step. optim_grad_changed: it changed after it may have been (copied again). */
void optim_grad_final(Optimizer *o, int u);
int optim_grad_wanted(const Optimizer *o, int u);
void optim_grad_changed(Optimizer *o, int u);
/* Unit u's update is done and its parameters are on the device (the main queue waits for
 * them): 1. wait = 0: 0 instead of waiting while its update still runs. */
int optim_ready(Optimizer *o, int u, int wait);
void optim_finish(Optimizer *o);  /* optim_ready of every unit */
/* Whether the update of a step reaches the device later, unit by unit (optim_ready says
 * when): 1 on the host. */
int optim_updates_later(const Optimizer *o);
/* The parameters were written (the init, a load): the master copy := the device's; lean,
 * where the init and the load wrote the master, the device's copy := the master instead. */
void optim_params_written(Optimizer *o);
/* The update thread's time in updates, and the time spent waiting for them in optim_ready
 * (totals in seconds; 0 on the device). */
void optim_host_times(Optimizer *o, double *update_s, double *wait_s);

/* The state per tensor a checkpoint keeps (Adafactor's statistics: fp32 values, 0 for
 * AdamW), copied to host memory (upload = 0) or from it (upload = 1). */
size_t optim_tensor_state_count(const Optimizer *o);
void optim_tensor_state(Optimizer *o, float *host, int upload);

/* ---- sizes (the estimate) ---- */
typedef struct { size_t device, host; } OptimBytes;
/* The optimizer's memory on a rank that updates n elements of a layout (state_size bytes
 * each): its elementwise arrays and per-tensor state, on the device; or with offload in
 * host memory beside the master copy and the gradients' copy (grad_copy_size bytes an
 * element), the device keeping what is summed over ranks through it (summed). oc NULL:
 * AdamW on the device. */
OptimBytes optim_bytes(const OptimConfig *oc, const Model *layout, size_t n, size_t state_size, size_t grad_copy_size,
                       int summed);
/* Whether offload=optimizer can be lean with this optimizer (OptimSetup.lean): its host update
 * reads the gradients' copy in the compute type and writes the compute copy back (AdamW). */
int optim_lean_possible(const OptimConfig *oc);

/* ---- one process's whole AdamW state in host memory (checkpoints of a world of one) ---- */
typedef struct {
    float *m, *v;
    size_t n;
    int step;  /* completed optimizer steps */
} AdamState;

void adam_alloc(AdamState *s, size_t n);
void adam_free(AdamState *s);
#endif
