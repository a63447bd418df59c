/* optim — AdamW over flat buffers, the learning-rate schedule, and clipping by the global
 * gradient norm. Moments mirror the model's flat layout (or a shard of it). Adafactor,
 * the other optimizer, is in adafactor.h (its plan) and parallel.c (its step). */
#ifndef MESHTRAIN_OPTIM_H
#define MESHTRAIN_OPTIM_H
#include <stddef.h>

typedef enum { OPTIM_ADAMW, OPTIM_ADAFACTOR } OptimKind;

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
} OptimConfig;

enum { OFFLOAD_NONE, OFFLOAD_OPTIMIZER, OFFLOAD_PARAMS };

/* "adamw" / "adafactor" */
const char *optim_kind_name(OptimKind k);
/* Elementwise arrays the optimizer keeps beside the parameters: AdamW's m and v (2);
 * Adafactor's first moment (1 with af_beta1 > 0, else 0). */
int optim_moments(const OptimConfig *c);

typedef struct {
    float *m, *v;
    size_t n;
    int step;  /* completed optimizer steps */
} AdamState;

void adam_alloc(AdamState *s, size_t n);
void adam_free(AdamState *s);

/* Learning rate for optimizer step `step` (0-based): linear warmup over warmup_steps, then
 * constant, or cosine from lr down to min_lr at decay_steps (min_lr after it). */
double lr_at(const OptimConfig *c, int step);

/* Global L2 norm of a gradient buffer (double accumulation). */
double grad_norm(const float *g, size_t n);

/* The factor clipping multiplies the gradient by: min(1, clip / norm) (1 when clip is off). */
float clip_scale(const OptimConfig *c, double norm);

/* One AdamW step on params/grads of length s->n; returns the learning rate used. */
double adam_step(AdamState *s, const OptimConfig *c, float *params, const float *grads, float grad_scale);
#endif
