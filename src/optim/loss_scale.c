/* The loss scaler's state machine (optim.h). fp16's range ends at 65504 and its subnormals
 * at 6e-8: a gradient is computed on a loss multiplied by the scale, so that its small
 * values stay representable, and the update divides it back out. The largest scale whose
 * gradient stays finite moves with training; the dynamic scale finds it by trial: halved
 * at an overflow (that step's update skipped), doubled after `window` steps without one.
 *
 * At hysteresis 1 this is PyTorch's GradScaler.update (torch.amp; its CUDA kernel's check
 * that a grown scale is still finite included), with loss_scale_min as a floor PyTorch does
 * not have. At hysteresis h > 1 it is Megatron-LM's DynamicGradScaler.update: only the h-th
 * overflow since the last growth backs off (and each one after it, until the scale grows
 * again); a step without an overflow does not restore the count, a growth does. Every
 * overflow skips its step whatever the count says, as in both. The scale is fp32, as both
 * keep it, so the trajectories agree to the bit. */
#include <math.h>
#include <stdio.h>
#include "optim.h"

void loss_scaler_init(LossScaler *s, const LossScaleConfig *c) {
    *s = (LossScaler){0};
    s->c = *c;
    s->scale = c->kind == LOSS_SCALE_NONE ? 1.0f : (float)c->init;
    s->hysteresis = c->hysteresis > 0 ? c->hysteresis : 1;
}

int loss_scaler_update(LossScaler *s, int overflow) {
    s->last_skipped = 0;
    if (s->c.kind == LOSS_SCALE_NONE) return 1;  /* nothing decides: a non-finite step stops the run */
    if (overflow) {
        s->skipped++;
        s->last_skipped = 1;
    }
    if (s->c.kind == LOSS_SCALE_FIXED) return !overflow;
    if (overflow) {
        s->growth = 0;
        if (s->hysteresis > 0) s->hysteresis--;  /* (Megatron's goes on below 0; <= 0 acts the same) */
        if (s->hysteresis <= 0) {
            float half = s->scale * 0.5f, lo = (float)s->c.min;
            s->scale = half > lo ? half : lo;
        }
        return 0;
    }
    if (++s->growth >= s->c.window) {  /* (== but for a resumed run given a shorter window) */
        float twice = s->scale * 2.0f;
        if (isfinite(twice)) s->scale = twice;  /* (fp32's largest power of two stays) */
        s->growth = 0;
        s->hysteresis = s->c.hysteresis > 0 ? s->c.hysteresis : 1;
    }
    return 1;
}

const char *loss_scale_name(const LossScaleConfig *c, char *buf, size_t len) {
    if (c->kind == LOSS_SCALE_NONE) snprintf(buf, len, "none");
    else if (c->kind == LOSS_SCALE_DYNAMIC) snprintf(buf, len, "dynamic");
    else snprintf(buf, len, "%.17g", c->init);  /* (reads back as the same scale) */
    return buf;
}
