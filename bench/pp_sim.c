/* pp_sim — every pipeline schedule simulated with the estimated stage costs
 * (pipeline_stage_costs, schedule_makespan), against the bubble's prediction the GPU
 * benchmarks use: one GPU's time per micro-batch (every stage's F + B + W, the model's
 * fused head) x (m + b) / p, b = p - 1 for GPipe and 1F1B, (p - 1) / v for interleaved,
 * (p - 1) / 3 for zb1. Each schedule on the balanced split (pipeline_split_ranks) and on the
 * searched one (pipeline_split_schedule, what `auto` runs), and with the head's matmuls
 * (logits, input gradient, weight gradient) placed in F, B and W otherwise than the model
 * does today. No GPU; CPU time about a second.
 * Usage: pp_sim [embed_dim n_heads n_layers context_len [head_scale]]  (default: the post's
 * model; head_scale: the head's matmuls' time per FLOP against a layer's, 1 by default)
 *        pp_sim replay KIND P M LAT_MS F0 B0 W0 ...: the trainer's lists with measured times
 *        (3 x P x v of them: v chunks a rank with interleaved) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "pipeline.h"
#include "schedule.h"
#include "schedule_sim.h"

static ModelConfig C = MODEL_CONFIG(50257, 1024, 8, 16, 256, 0);
static double UNIT, T1;  /* one layer's F + B + W; one GPU's F + B + W per micro-batch, in layers */
static double HS = 1;    /* the head's time per FLOP against a layer's (argument 5; 1: FLOPs alone) */
static const double FUSED[3] = {3, 0, 0};

/* The simulated step in layer units for one split (searched or balanced), its counts in
 * desc; *held: the micro-batches the head's stage holds from a forward to its backward (or
 * weight pass) at once. */
static double span(ScheduleKind k, int p, int m, const double *head, int search, char *desc, size_t len, int *held) {
    int v = k == SCHED_INTERLEAVED ? 2 : 1, S = p * v;
    Stage st[64];
    double cost[64 * 3], meanf = 0;
    char err[256];
    double hs[3];
    for (int i = 0; i < 3; i++) hs[i] = HS * (head ? head : FUSED)[i];
    head = hs;
    int rc = search ? pipeline_split_schedule(&C, C.context_len, p, v, k, m, SCHED_SPLIT_ANY, 0, head, "auto", st, err, sizeof err)
                    : pipeline_split_ranks(&C, C.context_len, p, v, "auto", st, err, sizeof err);
    if (rc) { fprintf(stderr, "%s\n", err); exit(1); }
    pipeline_stage_costs(&C, C.context_len, st, S, head, cost);
    desc[0] = 0;
    for (int g = 0; g < S; g++) {
        meanf += cost[g * 3] / S;
        size_t n = strlen(desc);
        snprintf(desc + n, len - n, "%s%d", g ? "," : "", stage_n_layers(&C, &st[g]));
    }
    Schedule sc;
    if (schedule_build(&sc, k, p, p - 1, m, v, SCHED_SPLIT_ANY, 0, cost, err, sizeof err)) { fprintf(stderr, "%s\n", err); exit(1); }
    *held = sc.in_flight[v - 1];
    schedule_free(&sc);
    return schedule_makespan(k, p, m, v, SCHED_SPLIT_ANY, 0, cost) * meanf / SCHED_TICKS_PER_FORWARD / UNIT;
}

static double predicted(ScheduleKind k, int p, int m) {
    double b = k == SCHED_INTERLEAVED ? (p - 1.0) / 2 : k == SCHED_ZB1 ? (p - 1.0) / 3 : p - 1.0;
    return T1 * (m + b) / p;
}

/* One row: the schedule with head placement h, balanced and searched; "of 1f1b": against
 * 1F1B with the fused head on the same kind of split. */
static void row(ScheduleKind k, int p, int m, const char *hname, const double *h) {
    char d0[64], d1[64], e[64], gb[32] = "";
    int held, x;
    double b = span(k, p, m, h, 0, d0, sizeof d0, &x), s = span(k, p, m, h, 1, d1, sizeof d1, &held);
    double b1 = span(SCHED_1F1B, p, m, NULL, 0, e, sizeof e, &x), s1 = span(SCHED_1F1B, p, m, NULL, 1, e, sizeof e, &x);
    double pr = predicted(k, p, m);
    /* dlogits kept between the head's passes: bf16, batch 128 cut into m */
    if (h && h[0] < 3 && h[0] + h[1] + h[2] == 3) snprintf(gb, sizeof gb, "%d x %.2f GB", held, 128.0 / m * C.context_len * C.vocab_size * 2 / 1e9);
    printf("%-2d %-3d %-12s %-9s | %-16s %7.2f %6.3f %6.3f | %-16s %7.2f %6.3f %6.3f %s\n", p, m, schedule_kind_name(k), hname,
           d0, b, pr / b, b1 / b, d1, s, pr / s, s1 / s, gb);
}

/* The head on a stage of its own (no layer; `auto` takes such a split where it is the
 * shortest, and explicit counts ending in 0 ask for one): the shortest of every split whose
 * last stage holds only the head. */
static int BEST, N[16], BEST_N[16];
static void every(ScheduleKind k, int p, int v, int m, int i, int left) {
    int S = p * v;
    if (i == S - 1) {
        if (left) return;
        Stage st[16];
        double cost[16 * 3];
        for (int g = 0, l = 0; g < S; g++) {
            st[g].first = g == 0 ? 0 : 1 + l;
            l += N[g];
            st[g].last = g == S - 1 ? C.n_layers + 1 : l;
        }
        double hs[3] = {3 * HS, 0, 0};
        pipeline_stage_costs(&C, C.context_len, st, S, hs, cost);
        int t = schedule_makespan(k, p, m, v, SCHED_SPLIT_ANY, 0, cost);
        if (t > 0 && t < BEST) BEST = t, memcpy(BEST_N, N, sizeof N);
        return;
    }
    for (int n = 1; n <= left - (S - 2 - i); n++) N[i] = n, N[S - 1] = 0, every(k, p, v, m, i + 1, left - n);
}

static void head_alone(ScheduleKind k, int p, int m) {
    int v = k == SCHED_INTERLEAVED ? 2 : 1, S = p * v, x;
    char e[64], d[64] = "";
    BEST = 1 << 30;
    every(k, p, v, m, 0, C.n_layers);
    /* ticks to layer units: the mean forward is SCHED_TICKS_PER_FORWARD, the total the same as any split's */
    double total_f, c[3];
    Stage one = {0, C.n_layers + 1};
    double hs[3] = {3 * HS, 0, 0};
    pipeline_stage_costs(&C, C.context_len, &one, 1, hs, c);
    total_f = c[0];
    double t = BEST * (total_f / S) / SCHED_TICKS_PER_FORWARD / UNIT;
    for (int g = 0; g < S; g++) {
        size_t n = strlen(d);
        snprintf(d + n, sizeof d - n, "%s%d", g ? "," : "", BEST_N[g]);
    }
    double s1 = span(SCHED_1F1B, p, m, NULL, 1, e, sizeof e, &x);
    printf("%-2d %-3d %-12s %-9s | %-16s %7.2f %6.3f %6.3f\n", p, m, schedule_kind_name(k), "F3", d, t, predicted(k, p, m) / t,
           s1 / t);
}

static void header(void) {
    printf("%-2s %-3s %-12s %-9s | %-16s %7s %6s %6s | %-16s %7s %6s %6s %s\n", "p", "m", "schedule", "head", "balanced split",
           "step", "/pred", "/1f1b", "searched split", "step", "/pred", "/1f1b", "dlogits held");
}

/* replay: the lists the trainer builds for kind at p ranks x v chunks (v > 1: interleaved),
 * m micro-batches (the post's model, `auto` split, its head placement), run with measured
 * per-stage times instead of the estimate: F, B, W in ms for each of the p v stages (stage
 * c p + r is rank r's chunk c; B includes W where the backward is not split; W is then
 * ignored), and lat ms from a send's start to the data's use on the next stage. Each rank
 * runs its compute actions in list order, each when its inputs are in; prints every rank's
 * actions with their start times and the step's length, to set beside a GPU timeline
 * (bench/pp_timeline.sh) and see whether a gap comes from the lists or from the costs. */
static int replay(ScheduleKind k, int p, int v, int m, const double *ms, double lat) {
    int G = p * v;
    Stage st[64];
    double cost[64 * 3];
    char err[256];
    const double *head = pipeline_head_placement(k, p);
    if (G > 64 || pipeline_split_schedule(&C, C.context_len, p, v, k, m, SCHED_SPLIT_ANY, 0, head, "auto", st, err, sizeof err)) {
        fprintf(stderr, "replay: %s\n", G > 64 ? "at most 64 stages" : err);
        return 1;
    }
    pipeline_stage_costs(&C, C.context_len, st, G, head, cost);
    Schedule *sc = calloc((size_t)p, sizeof *sc);
    for (int r = 0; r < p; r++)
        if (schedule_build(&sc[r], k, p, r, m, v, SCHED_SPLIT_ANY, 0, cost, err, sizeof err)) { fprintf(stderr, "replay: %s\n", err); return 1; }
    printf("%s p=%d v=%d m=%d%s, split", schedule_kind_name(k), p, v, m, sc[0].split_backward ? " (backward split)" : "");
    for (int g = 0; g < G; g++) printf("%s%d", g ? "," : " ", stage_n_layers(&C, &st[g]));
    printf("; per stage F/B/W ms:");
    for (int g = 0; g < G; g++) printf(" %.2f/%.2f/%.2f", ms[g * 3], ms[g * 3 + 1], ms[g * 3 + 2]);
    printf("; link %.3f ms\n", lat);
    SimStep step;
    if (schedule_simulate(sc, p, ms, lat, &step, getenv("REPLAY_QUIET") ? NULL : stdout)) {
        fprintf(stderr, "replay: a rank's list never finished\n");
        return 1;
    }
    double end = step.makespan;
    printf("step (last action's end): %.2f ms\n", end);
    for (int r = 0; r < p; r++) schedule_free(&sc[r]);
    free(sc);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 2 && !strcmp(argv[1], "replay")) {
        ScheduleKind k;
        int p = argc >= 5 ? atoi(argv[3]) : 0, n = argc - 6, v = p > 0 && n > 0 ? n / (3 * p) : 0;
        if (argc < 6 || p < 2 || v < 1 || n != 3 * p * v || 3 * n > 3 * 64 * 3 || schedule_kind_parse(argv[2], &k) ||
            (v > 1 && k != SCHED_INTERLEAVED)) {
            fprintf(stderr, "usage: pp_sim replay gpipe|1f1b|zb1|interleaved P M LAT_MS F0 B0 W0 ... (3 x P x v ms, "
                            "stage c P + r = rank r's chunk c; the post's model)\n");
            return 2;
        }
        double ms[64 * 3];
        for (int i = 0; i < n; i++) ms[i] = atof(argv[6 + i]);
        return replay(k, p, v, atoi(argv[4]), ms, atof(argv[5]));
    }
    if (argc >= 5) C.embed_dim = atoi(argv[1]), C.n_heads = atoi(argv[2]), C.n_layers = atoi(argv[3]), C.context_len = atoi(argv[4]);
    if (argc >= 6) HS = atof(argv[5]);
    ScheduleKind kinds[] = {SCHED_GPIPE, SCHED_1F1B, SCHED_INTERLEAVED, SCHED_ZB1};
    Stage one = {0, C.n_layers + 1}, lay = {1, 1};
    double c1[3], cl[3];
    const double hf[3] = {3 * HS, 0, 0};
    pipeline_stage_costs(&C, C.context_len, &one, 1, hf, c1);
    pipeline_stage_costs(&C, C.context_len, &lay, 1, NULL, cl);
    UNIT = cl[0] + cl[1] + cl[2], T1 = (c1[0] + c1[1] + c1[2]) / UNIT;
    printf("model E=%d H=%d L=%d T=%d: one micro-batch on one GPU %.2f layer units (F + B + W of one layer); the head's\n"
           "three matmuls %.2f units each (head_scale %g). step: simulated makespan in layer units; /pred: the bubble's prediction over\n"
           "it (the GPU benchmarks' 'of the prediction'); /1f1b: 1F1B's step (fused head, same kind of split) over it.\n"
           "interleaved: v = 2.\n\n", C.embed_dim, C.n_heads, C.n_layers, C.context_len, T1, HS * 2.0 * C.embed_dim * C.vocab_size / UNIT, HS);
    printf("The model's head (logits, its backward fused into the forward: head = F3):\n");
    header();
    for (int p = 2; p <= 4; p += 2)
        for (int m = 8; m <= 32; m *= 4)
            for (int k = 0; k < 4; k++) row(kinds[k], p, m, "F3", NULL);
    /* head placements: F/B/W counts of the three head matmuls (a recomputed logit matmul counts again) */
    static const double zw[3] = {2, 0, 1}, zr[3] = {2, 0, 2}, z3[3] = {1, 1, 1}, gr[3] = {1, 3, 0}, gk[3] = {1, 2, 0};
    printf("\nThe head's backward moved. F2+W1: lm_head's dW in W, dlogits kept until W; F2+W2: the same, the logits\n"
           "recomputed in W instead; F1+B1+W1: dlogits kept from F, dX in B, dW in W; F1+B3: the backward in B, logits\n"
           "recomputed; F1+B2: the backward in B, dlogits kept from F. dlogits held: micro-batches on the head's stage at\n"
           "once x bf16 size of one (batch 128), where kept:\n");
    header();
    for (int p = 2; p <= 4; p += 2)
        for (int m = 8; m <= 32; m *= 4) {
            row(SCHED_ZB1, p, m, "F2+W1", zw);
            row(SCHED_ZB1, p, m, "F2+W2", zr);
            row(SCHED_ZB1, p, m, "F1+B1+W1", z3);
            row(SCHED_GPIPE, p, m, "F1+B3", gr);
            row(SCHED_GPIPE, p, m, "F1+B2", gk);
            row(SCHED_1F1B, p, m, "F1+B3", gr);
            row(SCHED_INTERLEAVED, p, m, "F1+B3", gr);
            row(SCHED_INTERLEAVED, p, m, "F1+B2", gk);
        }
    printf("\nThe head on a stage of its own (the last stage holds no layer: pipeline_split=...,0, and what auto takes\n"
           "where it is shortest), the best such split of every one (/1f1b: against 1F1B on its searched split):\n");
    printf("%-2s %-3s %-12s %-9s | %-16s %7s %6s %6s\n", "p", "m", "schedule", "head", "split", "step", "/pred", "/1f1b");
    for (int p = 2; p <= 4; p += 2)
        for (int m = 8; m <= 32; m *= 4)
            for (int k = 0; k < 4; k++) head_alone(kinds[k], p, m);
    return 0;
}
