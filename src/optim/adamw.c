/* AdamW (PyTorch's semantics: decoupled weight decay, bias-corrected moments; op_adamw) as
 * an optimizer of the layer (optim_impl.h): two elementwise moments, no per-tensor state,
 * no statistics; a range's update is one kernel over it, which with a compute copy to
 * keep (precision=mixed, on the device) also writes that copy in the same pass. */
#include <stdlib.h>
#include "optim_impl.h"
#include "util.h"

static int adamw_moments(const OptimConfig *c) {
    (void)c;
    return 2;
}

static double adamw_rate(const OptimConfig *c, int t) { return lr_at(c, t - 1); }

static int adamw_update(Optimizer *o, const OptimRange *r, const OptimStep *s) {
    const OptimConfig *oc = s->oc;
    const OptimKernels *k = o->k;
    float lr = (float)s->lr, b1 = (float)oc->beta1, b2 = (float)oc->beta2, eps = (float)oc->eps;
    float wd = (float)oc->weight_decay;
    if (r->grad16) {
        k->adamw16(r->param, (uint16_t *)r->grad, r->m1, r->m2, r->n, lr, b1, b2, eps, wd, s->step, s->scale);
        return 0;
    }
    if (r->act && k->adamw_cast) {
        k->adamw_cast(r->param, r->grad, r->m1, r->m2, r->n, lr, b1, b2, eps, wd, s->step, s->scale, r->act);
        return 1;
    }
    k->adamw(r->param, r->grad, r->m1, r->m2, r->n, lr, b1, b2, eps, wd, s->step, s->scale);
    return 0;
}

const OptimImpl optim_adamw = {
    .name = "adamw",
    .kind = OPTIM_ADAMW,
    .moments = adamw_moments,
    .moment_name = {"AdamW's first moment", "AdamW's second moment"},
    .elementwise = 1,
    .lean = 1,
    .rate = adamw_rate,
    .update = adamw_update,
};

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
