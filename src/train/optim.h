/* optim — AdamW over flat buffers, the learning-rate schedule, and clipping by the global
 * gradient norm. Moments mirror the model's flat layout (or a shard of it, later). */
#ifndef MESHTRAIN_OPTIM_H
#define MESHTRAIN_OPTIM_H
#include <stddef.h>

typedef struct {
    double lr, min_lr, beta1, beta2, eps, weight_decay, grad_clip;
    int warmup_steps, decay_steps, cosine;  /* decay_steps: the cosine reaches min_lr there */
} OptimConfig;

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
