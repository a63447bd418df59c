#include "optim.h"
#include <math.h>
#include <stdlib.h>
#include "ops.h"
#include "util.h"

const char *optim_kind_name(OptimKind k) { return k == OPTIM_ADAFACTOR ? "adafactor" : "adamw"; }

int optim_moments(const OptimConfig *c) {
    if (c && c->kind == OPTIM_ADAFACTOR) return c->af_beta1 > 0 ? 1 : 0;
    return 2;
}

void adam_alloc(AdamState *s, size_t n) {
    s->m = xaligned_alloc(n * sizeof(float));
    s->v = xaligned_alloc(n * sizeof(float));
    s->n = n;
    s->step = 0;
}

void adam_free(AdamState *s) {
    free(s->m);
    free(s->v);
    s->m = s->v = NULL;
}

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

double adam_step(AdamState *s, const OptimConfig *c, float *params, const float *grads, float grad_scale) {
    double lr = lr_at(c, s->step);
    s->step++;
    op_adamw(params, grads, s->m, s->v, s->n, (float)lr, (float)c->beta1, (float)c->beta2, (float)c->eps,
             (float)c->weight_decay, s->step, grad_scale);
    return lr;
}
