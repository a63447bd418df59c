/* Learning-rate schedule and clipping. (AdamW itself is checked in test_ops and, against
 * torch, in test_model.) */
#include "optim.h"
#include "test.h"

static void test_schedule(void) {
    OptimConfig c = {.lr = 1.0, .min_lr = 0.1, .warmup_steps = 4, .decay_steps = 14, .cosine = 1};
    CHECK(fabs(lr_at(&c, 0) - 0.25) < 1e-12, "warmup step 0: %g", lr_at(&c, 0));
    CHECK(fabs(lr_at(&c, 3) - 1.0) < 1e-12, "end of warmup: %g", lr_at(&c, 3));
    CHECK(fabs(lr_at(&c, 4) - 1.0) < 1e-12, "cosine start: %g", lr_at(&c, 4));
    CHECK(fabs(lr_at(&c, 9) - 0.55) < 1e-12, "cosine midpoint: %g", lr_at(&c, 9));
    CHECK(fabs(lr_at(&c, 14) - 0.1) < 1e-12, "cosine end: %g", lr_at(&c, 14));
    CHECK(fabs(lr_at(&c, 20) - 0.1) < 1e-12, "after the end: %g", lr_at(&c, 20));
    for (int s = 4; s < 14; s++) CHECK(lr_at(&c, s + 1) <= lr_at(&c, s), "monotone at %d", s);
    c.cosine = 0;
    CHECK(fabs(lr_at(&c, 10) - 1.0) < 1e-12, "constant");
    c.warmup_steps = 0;
    CHECK(fabs(lr_at(&c, 0) - 1.0) < 1e-12, "no warmup");
}

static void test_clip(void) {
    OptimConfig c = {.grad_clip = 1.0};
    CHECK(clip_scale(&c, 0.5) == 1.0f, "below the bound");
    CHECK(fabs(clip_scale(&c, 4.0) - 0.25) < 1e-6, "above: %g", clip_scale(&c, 4.0));
    c.grad_clip = 0;
    CHECK(clip_scale(&c, 1e9) == 1.0f, "off");
    float g[3] = {3, 4, 0};
    CHECK(fabs(grad_norm(g, 3) - 5.0) < 1e-12, "norm");
}

int main(void) {
    RUN(test_schedule);
    RUN(test_clip);
    return TEST_SUMMARY();
}
