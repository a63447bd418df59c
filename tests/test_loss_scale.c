/* The loss scaler's state machine (src/optim/loss_scale.c) over scripted overflow sequences:
 * the scale each step's gradient is made with, which steps are skipped, and the trackers,
 * against the trajectories of PyTorch's GradScaler.update (hysteresis 1) and Megatron-LM's
 * DynamicGradScaler.update (hysteresis 2), written out below from their update rules:
 *   PyTorch:  overflow: scale *= 0.5, growth = 0.
 *             else: growth += 1; at growth == interval: scale *= 2 (if still finite), growth = 0.
 *   Megatron: overflow: growth = 0, hysteresis -= 1; at hysteresis <= 0: scale = max(scale / 2, min).
 *             else: growth += 1; at growth == interval: growth = 0, hysteresis = h, scale *= 2.
 * (every overflow skips its step in both); and the floor, the fp32 ceiling, a fixed scale,
 * and none. */
#include <math.h>
#include <string.h>
#include "optim.h"
#include "test.h"

/* Runs `seq` ('.' a good step, 'O' an overflow) and checks, per step, the scale it used
 * (want[i]), that exactly its overflows were skipped, and the scale at the end (want[n]). */
static void run_seq(const LossScaleConfig *c, const char *seq, const double *want, const char *what) {
    LossScaler s;
    loss_scaler_init(&s, c);
    int n = (int)strlen(seq), skipped = 0;
    for (int i = 0; i < n; i++) {
        int overflow = seq[i] == 'O';
        CHECK(s.scale == (float)want[i], "%s: step %d used scale %g, want %g", what, i + 1, s.scale, want[i]);
        int go = loss_scaler_update(&s, overflow);
        skipped += overflow;
        CHECK(go == !overflow, "%s: step %d: update %d with overflow %d", what, i + 1, go, overflow);
        CHECK(s.last_skipped == overflow && s.skipped == skipped, "%s: step %d: skipped %d (%d in all), want %d (%d)",
              what, i + 1, s.last_skipped, s.skipped, overflow, skipped);
    }
    CHECK(s.scale == (float)want[n], "%s: final scale %g, want %g", what, s.scale, want[n]);
}

/* growth window 3: three good steps double the scale */
static const char *SEQ = "...OO..O....O.O";

static void test_pytorch_trajectory(void) {
    LossScaleConfig c = {LOSS_SCALE_DYNAMIC, 65536, 1, 3, 1};
    /* steps 1-3 good: x2 after step 3; 4 and 5 overflow: /2 each; 6, 7 good, 8 overflow: /2 (the
     * count restarts); 9-11 good: x2; 12 good; 13 overflow: /2; 14 good; 15 overflow: /2 */
    static const double want[] = {65536, 65536, 65536, 131072, 65536, 32768, 32768, 32768,
                                  16384, 16384, 16384, 32768, 32768, 16384, 16384, 8192};
    run_seq(&c, SEQ, want, "pytorch");
    LossScaler s;  /* the trackers at the end: the growth count restarted at the last overflow */
    loss_scaler_init(&s, &c);
    for (const char *p = SEQ; *p; p++) loss_scaler_update(&s, *p == 'O');
    CHECK(s.growth == 0 && s.skipped == 5, "growth %d skipped %d", s.growth, s.skipped);
    loss_scaler_update(&s, 0);
    loss_scaler_update(&s, 0);
    CHECK(s.growth == 2 && s.scale == 8192.0f, "two good steps: growth %d scale %g", s.growth, s.scale);
}

static void test_megatron_trajectory(void) {
    LossScaleConfig c = {LOSS_SCALE_DYNAMIC, 65536, 1, 3, 2};
    /* 1-3 good: x2 (hysteresis back to 2); 4 overflow: hysteresis 1, no backoff; 5 overflow:
     * hysteresis 0, /2; 6, 7 good (a good step does not restore it); 8 overflow: /2 at once;
     * 9-11 good: x2, hysteresis 2; 12 good; 13 overflow: hysteresis 1, no backoff; 14 good;
     * 15 overflow: /2 */
    static const double want[] = {65536, 65536, 65536, 131072, 131072, 65536, 65536, 65536,
                                  32768, 32768, 32768, 65536, 65536, 65536, 65536, 32768};
    run_seq(&c, SEQ, want, "megatron");
    /* hysteresis 1 in Megatron's rule is PyTorch's (the floor aside) */
    c.hysteresis = 1;
    static const double py[] = {65536, 65536, 65536, 131072, 65536, 32768, 32768, 32768,
                                16384, 16384, 16384, 32768, 32768, 16384, 16384, 8192};
    run_seq(&c, SEQ, py, "megatron_h1");
    /* hysteresis 3: only the third overflow since the growth backs off */
    c.hysteresis = 3;
    static const double h3[] = {65536, 65536, 65536, 131072, 131072, 131072, 131072, 131072,
                                65536, 65536, 65536, 131072, 131072, 131072, 131072, 131072};
    run_seq(&c, SEQ, h3, "megatron_h3");
}

static void test_floor_and_ceiling(void) {
    LossScaleConfig c = {LOSS_SCALE_DYNAMIC, 4, 1, 2, 1};
    static const double want[] = {4, 2, 1, 1, 1, 1, 2};
    run_seq(&c, "OOOO..", want, "floor");
    c.min = 0.25;
    static const double want2[] = {4, 2, 1, 0.5, 0.25, 0.25};
    run_seq(&c, "OOOOO", want2, "floor_0.25");
    /* PyTorch keeps a scale whose doubling would not be finite in fp32 (and restarts the count) */
    LossScaleConfig big = {LOSS_SCALE_DYNAMIC, ldexp(1, 127), 1, 1, 1};
    static const double want3[] = {ldexp(1, 127), ldexp(1, 127), ldexp(1, 127), ldexp(1, 126)};
    run_seq(&big, "..O", want3, "ceiling");
}

static void test_fixed_and_none(void) {
    LossScaleConfig c = {LOSS_SCALE_FIXED, 1024, 1, 2000, 1};
    static const double want[] = {1024, 1024, 1024, 1024, 1024, 1024};
    run_seq(&c, "O.OO.", want, "fixed");
    LossScaleConfig none = {LOSS_SCALE_NONE, 65536, 1, 3, 1};
    LossScaler s;
    loss_scaler_init(&s, &none);
    CHECK(s.scale == 1.0f, "none: scale %g", s.scale);
    CHECK(loss_scaler_update(&s, 1) == 1 && s.skipped == 0 && s.scale == 1.0f,
          "none: an overflow is not skipped (the run stops on it instead)");
    char buf[32];
    CHECK(!strcmp(loss_scale_name(&c, buf, sizeof buf), "1024"), "name %s", buf);
    CHECK(!strcmp(loss_scale_name(&none, buf, sizeof buf), "none"), "name %s", buf);
}

/* A resumed run given a shorter window than its trackers have counted grows at once. */
static void test_shorter_window(void) {
    LossScaleConfig c = {LOSS_SCALE_DYNAMIC, 8, 1, 2, 1};
    LossScaler s;
    loss_scaler_init(&s, &c);
    s.growth = 5;
    loss_scaler_update(&s, 0);
    CHECK(s.scale == 16.0f && s.growth == 0, "scale %g growth %d", s.scale, s.growth);
}

int main(void) {
    RUN(test_pytorch_trajectory);
    RUN(test_megatron_trajectory);
    RUN(test_floor_and_ceiling);
    RUN(test_fixed_and_none);
    RUN(test_shorter_window);
    return TEST_SUMMARY();
}
