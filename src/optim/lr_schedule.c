/* The learning-rate schedule (warmup, then constant or cosine) and clipping by the global
 * gradient norm: what every optimizer's step shares (optim.h). */
#include <math.h>
#include "ops.h"
#include "optim.h"

double lr_at(const OptimConfig *c, int step) {
    if (c->warmup_steps > 0 && step < c->warmup_steps) return c->lr * (step + 1) / c->warmup_steps;
    if (!c->cosine) return c->lr;
    int span = c->decay_steps - c->warmup_steps;
    if (span <= 0) return c->lr;
    double progress = (double)(step - c->warmup_steps) / span;
    if (progress > 1) progress = 1;
    return c->min_lr + 0.5 * (c->lr - c->min_lr) * (1.0 + cos(M_PI * progress));
}

double grad_norm(const float *g, size_t n) { return sqrt(op_sumsq(g, n)); }

float clip_scale(const OptimConfig *c, double norm) {
    if (c->grad_clip <= 0 || !(norm > c->grad_clip)) return 1.0f;
    return (float)(c->grad_clip / (norm + 1e-6));
}
