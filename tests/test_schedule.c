/* Schedules played without a model: every rank's list runs against the others'. A send
 * is buffered (it completes at once), a receive waits for its send; each round, every
 * rank runs its next action if it can. Between two ranks, in each direction, messages
 * arrive in the order they were sent (as NCCL's do): a receive whose message is not the
 * next one sent on that link is an error. The checks: no deadlock, every micro-batch
 * forwarded and backwarded (and weight-passed where split) once on every stage, a backward
 * after its own forward, sends and receives in pairs, at most in_flight[c] micro-batches'
 * activations of chunk c held, at most max_pending_w between a B and its W, the optimizer
 * step last, and the well-known shapes (accumulation, 1F1B's warm-up). */
#include <stdlib.h>
#include <string.h>
#include "schedule.h"
#include "test.h"

typedef struct { int g, i; } Msg;

/* Plays p ranks' schedules s (v chunks each); returns 0, or -1 on a deadlock or a broken
 * rule (message printed). */
static int play_built(Schedule *s, int p, int m) {
    int v = s[0].chunks, G = p * v, split = s[0].split_backward;
    int *pc = calloc((size_t)p, sizeof(int));
    /* per global stage g and micro i: forwarded, backwarded, weight-passed */
    int *fwd = calloc((size_t)(G * m), sizeof(int)), *bwd = calloc((size_t)(G * m), sizeof(int));
    int *wgt = calloc((size_t)(G * m), sizeof(int));
    /* links: activations from rank r go to r + 1 (mod p), gradients to r - 1; FIFO queues */
    Msg *q[2];
    int qh[2][16] = {{0}}, qt[2][16] = {{0}}, cap = G * m;
    for (int d = 0; d < 2; d++) q[d] = calloc((size_t)(p * cap), sizeof(Msg));
    int bad = 0, rounds = 0;
    for (;;) {
        int progressed = 0, done = 1;
        for (int r = 0; r < p && !bad; r++) {
            if (pc[r] >= s[r].n) continue;
            done = 0;
            Action a = s[r].actions[pc[r]];
            int k = a.micro, c = a.chunk, g = c * p + r, ok = 1;
            switch (a.kind) {
            case ACT_RECV_INPUT:
            case ACT_RECV_GRAD: {
                int d = a.kind == ACT_RECV_GRAD, src = d ? (r + 1) % p : (r + p - 1) % p;
                int want = d ? g + 1 : g - 1;
                if (want < 0 || want >= G) { fprintf(stderr, "  rank %d: %s%d.%d has no peer\n", r, action_name(a.kind), k, c); bad = 1; break; }
                if (qh[d][src] == qt[d][src]) { ok = 0; break; }
                Msg msg = q[d][src * cap + qh[d][src]];
                if (msg.g != want || msg.i != k) {
                    fprintf(stderr, "  rank %d: %s%d.%d gets stage %d's micro %d (out of order)\n", r,
                            action_name(a.kind), k, c, msg.g, msg.i);
                    bad = 1;
                    break;
                }
                qh[d][src]++;
                break;
            }
            case ACT_FORWARD:
                if (fwd[g * m + k]++) { fprintf(stderr, "  rank %d: F%d.%d twice\n", r, k, c); bad = 1; }
                break;
            case ACT_BACKWARD:
                if (!fwd[g * m + k] || bwd[g * m + k]++) { fprintf(stderr, "  rank %d: B%d.%d out of order\n", r, k, c); bad = 1; }
                break;
            case ACT_WEIGHT:
                if (!split || !bwd[g * m + k] || wgt[g * m + k]++) { fprintf(stderr, "  rank %d: W%d.%d\n", r, k, c); bad = 1; }
                break;
            case ACT_SEND_OUTPUT:
            case ACT_SEND_GRAD: {
                int d = a.kind == ACT_SEND_GRAD;
                if ((d ? g == 0 : g == G - 1) || !(d ? bwd : fwd)[g * m + k]) {
                    fprintf(stderr, "  rank %d: %s%d.%d\n", r, action_name(a.kind), k, c);
                    bad = 1;
                }
                q[d][r * cap + qt[d][r]++] = (Msg){g, k};
                break;
            }
            case ACT_OPTIM_STEP:
                for (int cc = 0; cc < v; cc++)
                    for (int j = 0; j < m; j++)
                        if (!bwd[(cc * p + r) * m + j] || (split && !wgt[(cc * p + r) * m + j])) {
                            fprintf(stderr, "  rank %d: step before B/W %d.%d\n", r, j, cc);
                            bad = 1;
                        }
                break;
            }
            if (bad) break;
            if (ok) { pc[r]++; progressed = 1; }
            /* activations held: forwarded, not yet backwarded (weight-passed, where split) */
            for (int cc = 0; cc < v; cc++) {
                int held = 0, gg = cc * p + r;
                for (int j = 0; j < m; j++) held += fwd[gg * m + j] && !(split ? wgt : bwd)[gg * m + j];
                if (held > s[r].in_flight[cc]) {
                    fprintf(stderr, "  rank %d chunk %d holds %d > %d\n", r, cc, held, s[r].in_flight[cc]);
                    bad = 1;
                }
            }
            int pend = 0;
            for (int cc = 0; cc < v && split; cc++)
                for (int j = 0; j < m; j++) pend += bwd[(cc * p + r) * m + j] && !wgt[(cc * p + r) * m + j];
            if (pend > s[r].max_pending_w) { fprintf(stderr, "  rank %d: %d waiting for W > %d\n", r, pend, s[r].max_pending_w); bad = 1; }
        }
        if (bad || done) break;
        rounds++;
        if (!progressed) { fprintf(stderr, "  deadlock after %d rounds\n", rounds); bad = 1; break; }
    }
    for (int i = 0; i < G * m && !bad; i++)
        if (fwd[i] != 1 || bwd[i] != 1 || wgt[i] != split) {
            fprintf(stderr, "  micro %d of stage %d: %d F, %d B, %d W\n", i % m, i / m, fwd[i], bwd[i], wgt[i]);
            bad = 1;
        }
    free(pc); free(fwd); free(bwd); free(wgt); free(q[0]); free(q[1]);
    return bad ? -1 : 0;
}

static int play(ScheduleKind kind, int p, int m, int v) {
    Schedule *s = calloc((size_t)p, sizeof *s);
    char err[128];
    for (int i = 0; i < p; i++) CHECK(schedule_build(&s[i], kind, p, i, m, v, SCHED_SPLIT_ANY, 0, NULL, err, sizeof err) == 0, "%s", err);
    int r = play_built(s, p, m);
    for (int i = 0; i < p; i++) schedule_free(&s[i]);
    free(s);
    return r;
}

static void test_every_layout_plays(void) {
    int ps[] = {1, 2, 3, 4}, ms[] = {1, 2, 3, 4, 5, 8, 9};
    for (int k = 0; k < 4; k++)
        for (int v = 1; v <= (k == SCHED_INTERLEAVED ? 4 : 1); v++)
            for (size_t a = 0; a < sizeof ps / sizeof *ps; a++)
                for (size_t b = 0; b < sizeof ms / sizeof *ms; b++)
                    CHECK(play((ScheduleKind)k, ps[a], ms[b], v) == 0, "%s p=%d m=%d v=%d",
                          schedule_kind_name((ScheduleKind)k), ps[a], ms[b], v);
}

/* One rank's list as text; zb1_max: schedule_build's zb1_max_in_flight (printed: 0, the default). */
static char *printed_capped(ScheduleKind k, int p, int stage, int m, int zb1_max) {
    static char buf[4096];
    Schedule s;
    char err[64];
    schedule_build(&s, k, p, stage, m, 1, SCHED_SPLIT_ANY, zb1_max, NULL, err, sizeof err);
    FILE *f = fmemopen(buf, sizeof buf, "w");
    schedule_print(f, &s);
    fclose(f);
    schedule_free(&s);
    buf[strcspn(buf, "\n")] = 0;
    return buf;
}
static char *printed(ScheduleKind k, int p, int stage, int m) { return printed_capped(k, p, stage, m, 0); }

static void test_shapes(void) {
    /* gradient accumulation: one stage, forward and backward in turn, then one step */
    CHECK(!strcmp(printed(SCHED_1F1B, 1, 0, 3), "F0 B0 F1 B1 F2 B2 step"), "%s", printed(SCHED_1F1B, 1, 0, 3));
    CHECK(!strcmp(printed(SCHED_1F1B, 1, 0, 1), "F0 B0 step"), "%s", printed(SCHED_1F1B, 1, 0, 1));
    /* 1F1B on 2 stages: the first stage runs one forward ahead */
    CHECK(!strcmp(printed(SCHED_1F1B, 2, 0, 3), "F0 send0 F1 send1 recvgrad0 B0 F2 send2 recvgrad1 B1 recvgrad2 B2 step"),
          "%s", printed(SCHED_1F1B, 2, 0, 3));
    CHECK(!strcmp(printed(SCHED_1F1B, 2, 1, 2), "recv0 F0 B0 sendgrad0 recv1 F1 B1 sendgrad1 step"), "%s",
          printed(SCHED_1F1B, 2, 1, 2));
    CHECK(!strcmp(printed(SCHED_GPIPE, 2, 1, 2), "recv0 F0 recv1 F1 B1 sendgrad1 B0 sendgrad0 step"), "%s",
          printed(SCHED_GPIPE, 2, 1, 2));
    Schedule s;
    char err[64];
    schedule_build(&s, SCHED_1F1B, 4, 0, 8, 1, SCHED_SPLIT_ANY, 0, NULL, err, sizeof err);
    CHECK(s.max_in_flight == 4, "1F1B's first stage of 4 holds %d", s.max_in_flight);
    schedule_free(&s);
    schedule_build(&s, SCHED_GPIPE, 4, 0, 8, 1, SCHED_SPLIT_ANY, 0, NULL, err, sizeof err);
    CHECK(s.max_in_flight == 8, "GPipe holds every micro-batch: %d", s.max_in_flight);
    schedule_free(&s);
}

/* The lists' length in the builder's unit costs, against the bubbles the schedules are
 * known for: 1F1B (m + p - 1)(F + B), interleaved (m v + p - 1)(F + B) in chunk units,
 * zero bubble about m (F + B + W) + (p - 1)(F + B - W) (ZB-H1). */
static int makespan(ScheduleKind k, int p, int m, int v) {
    Schedule s;
    char err[64];
    int most = 0;
    for (int r = 0; r < p; r++) {
        schedule_build(&s, k, p, r, m, v, SCHED_SPLIT_ANY, 0, NULL, err, sizeof err);
        if (s.makespan > most) most = s.makespan;
        schedule_free(&s);
    }
    return most;
}

static void test_bubbles(void) {
    for (int p = 2; p <= 4; p += 2)
        for (int m = p; m <= 4 * p; m *= 2) {
            int zb = makespan(SCHED_ZB1, p, m, 1), one = (m + p - 1) * 3, zbh1 = m * 3 + (p - 1);
            fprintf(stderr, "  p=%d m=%d: zb1 %d units (ZB-H1 %d; 1F1B %d)", p, m, zb, zbh1, one);
            CHECK(zb <= zbh1, "zb1 p=%d m=%d: %d > %d", p, m, zb, zbh1);
            for (int v = 2; v <= 4; v += 2) {
                int il = makespan(SCHED_INTERLEAVED, p, m, v), want = (m * v + p - 1) * 3;
                fprintf(stderr, "; interleaved v=%d %d (%d)", v, il, want);
                CHECK(il <= want, "interleaved p=%d m=%d v=%d: %d > %d", p, m, v, il, want);
            }
            fprintf(stderr, "\n");
        }
    /* zero bubble's rank r holds at most min(2p + 1 - r, p + 3) micro-batches from F to W:
     * on one stage three; with zb1_max_in_flight=2 (ZB-H1's p + 1), two */
    CHECK(!strcmp(printed(SCHED_ZB1, 1, 0, 6), "F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 F4 B4 W2 F5 B5 W3 W4 W5 step"), "%s",
          printed(SCHED_ZB1, 1, 0, 6));
    CHECK(!strcmp(printed_capped(SCHED_ZB1, 1, 0, 3, 2), "F0 B0 F1 B1 W0 F2 B2 W1 W2 step"), "%s",
          printed_capped(SCHED_ZB1, 1, 0, 3, 2));
}

/* zb1_max_in_flight: every cap from 1 up plays at every layout, no rank holds more than the
 * cap from a forward to its weight pass, p + 3 is the default's lists (0), a larger cap
 * never a longer step in unit costs, and a negative one is refused. */
static void test_zb1_max_in_flight(void) {
    char err[128];
    for (int p = 1; p <= 4; p++)
        for (int m = p; m <= 2 * p + 3; m++) {
            int span[16] = {0};
            for (int cap = 1; cap <= p + 5; cap++) {
                Schedule *s = calloc((size_t)p, sizeof *s);
                int built = 1;
                for (int r = 0; r < p; r++) {
                    built &= schedule_build(&s[r], SCHED_ZB1, p, r, m, 1, SCHED_SPLIT_ANY, cap, NULL, err, sizeof err) == 0;
                    CHECK(built, "p=%d m=%d cap %d: %s", p, m, cap, err);
                    if (built) CHECK(s[r].max_in_flight <= cap, "p=%d m=%d cap %d: rank %d holds %d", p, m, cap, r,
                                     s[r].max_in_flight);
                }
                if (built) {
                    CHECK(play_built(s, p, m) == 0, "p=%d m=%d cap %d", p, m, cap);
                    span[cap] = s[0].makespan;
                    CHECK(cap == 1 || span[cap] <= span[cap - 1], "p=%d m=%d: cap %d %d units, cap %d %d", p, m, cap,
                          span[cap], cap - 1, span[cap - 1]);
                }
                for (int r = 0; r < p; r++)
                    if (built) schedule_free(&s[r]);
                free(s);
            }
            /* with uneven stage costs too (the lists a run builds): every cap plays, and holds */
            double cost[4 * 3];
            for (int g = 0; g < p; g++) cost[g * 3] = 1 + g % 3, cost[g * 3 + 1] = 2 + g % 2, cost[g * 3 + 2] = 1 + (g == p - 1);
            for (int cap = 1; cap <= p + 5; cap++) {
                Schedule c[4];
                int n = 0;
                while (n < p && schedule_build(&c[n], SCHED_ZB1, p, n, m, 1, SCHED_SPLIT_ANY, cap, cost, err, sizeof err) == 0)
                    n++;
                CHECK(n == p, "p=%d m=%d cap %d, costed: %s", p, m, cap, err);
                for (int r = 0; r < n; r++)
                    CHECK(c[r].max_in_flight <= cap, "p=%d m=%d cap %d, costed: rank %d holds %d", p, m, cap, r, c[r].max_in_flight);
                if (n == p) CHECK(play_built(c, p, m) == 0, "p=%d m=%d cap %d, costed", p, m, cap);
                for (int r = 0; r < n; r++) schedule_free(&c[r]);
            }
            for (int r = 0; r < p; r++) {
                char dflt[4096];
                snprintf(dflt, sizeof dflt, "%s", printed_capped(SCHED_ZB1, p, r, m, 0));
                CHECK(!strcmp(dflt, printed_capped(SCHED_ZB1, p, r, m, p + 3)), "p=%d m=%d rank %d: 0 is not p + 3", p, m, r);
            }
        }
    Schedule s;
    CHECK(schedule_build(&s, SCHED_ZB1, 2, 0, 4, 1, SCHED_SPLIT_ANY, -1, NULL, err, sizeof err) == -1 &&
          strstr(err, "zb1_max_in_flight=-1"), "a cap of -1: %s", err);
    CHECK(schedule_makespan(SCHED_ZB1, 2, 4, 1, SCHED_SPLIT_ANY, -1, NULL) == -1, "makespan with a cap of -1");
}

/* schedule_makespan plays every rank's list together and ends with the last action's end
 * (it once ended one tick after the last start): in unit costs one stage runs F0 + B0 in 3,
 * GPipe and 1F1B take (m + p - 1)(F + B); with costs, one simulation of all ranks gives
 * what every rank's own list says, and a longer stage lengthens the step. */
static void test_makespan(void) {
    CHECK(schedule_makespan(SCHED_1F1B, 1, 1, 1, SCHED_SPLIT_ANY, 0, NULL) == 3, "F0 B0: %d", schedule_makespan(SCHED_1F1B, 1, 1, 1, SCHED_SPLIT_ANY, 0, NULL));
    for (int p = 1; p <= 4; p++)
        for (int m = p; m <= 2 * p + 1; m++)
            for (int k = SCHED_GPIPE; k <= SCHED_1F1B; k++)
                CHECK(schedule_makespan((ScheduleKind)k, p, m, 1, SCHED_SPLIT_ANY, 0, NULL) == (m + p - 1) * 3, "%s p=%d m=%d: %d",
                      schedule_kind_name((ScheduleKind)k), p, m, schedule_makespan((ScheduleKind)k, p, m, 1, SCHED_SPLIT_ANY, 0, NULL));
    double cost[4 * 2 * 3];
    for (int g = 0; g < 8; g++) cost[g * 3] = 1 + g % 3, cost[g * 3 + 1] = 2 + g % 2, cost[g * 3 + 2] = 1;
    for (int k = SCHED_INTERLEAVED; k <= SCHED_ZB1; k++) {
        int v = k == SCHED_INTERLEAVED ? 2 : 1, t = schedule_makespan((ScheduleKind)k, 4, 6, v, SCHED_SPLIT_ANY, 0, cost);
        for (int r = 0; r < 4; r++) {
            Schedule s;
            char err[64];
            schedule_build(&s, (ScheduleKind)k, 4, r, 6, v, SCHED_SPLIT_ANY, 0, cost, err, sizeof err);
            CHECK(s.makespan == t, "%s rank %d: %d, all ranks %d", schedule_kind_name((ScheduleKind)k), r, s.makespan, t);
            schedule_free(&s);
        }
        double more[4 * 2 * 3];
        memcpy(more, cost, sizeof more);
        more[0] *= 3, more[1] *= 3;
        CHECK(schedule_makespan((ScheduleKind)k, 4, 6, v, SCHED_SPLIT_ANY, 0, more) > t, "%s: a heavier first stage is not slower",
              schedule_kind_name((ScheduleKind)k));
    }
}

/* PipeDream-2BW: `steps` consecutive steps' lists (the first filling, the last draining),
 * played as one list per rank over steps x m micro-batches (step t's micro-batch j is
 * t m + j; the updates between steps left out, the last kept): no deadlock, every message in
 * its link's order across the steps, each micro-batch forwarded and backwarded once, at most
 * p - r held on rank r; each step's list does its own m backwards and m forwards less the
 * fill's and drain's; a stage's held micro-batches at each update are all the next step's
 * first (two weight versions suffice: m >= p). */
static int play_2bw(int p, int m, int steps) {
    Schedule *s = calloc((size_t)p, sizeof *s);
    char err[128];
    int M = m * steps, bad = 0;
    for (int r = 0; r < p; r++) {
        s[r].actions = malloc((size_t)(7 * M + 1) * sizeof(Action));
        for (int t = 0; t < steps; t++) {
            Schedule one;
            CHECK(schedule_build_2bw(&one, p, r, m, t == 0, t == steps - 1, err, sizeof err) == 0, "%s", err);
            int w = p - r - 1, nf = 0, nb = 0, held = t == 0 ? 0 : w;
            for (int k = 0; k < one.n; k++) {
                Action a = one.actions[k];
                nf += a.kind == ACT_FORWARD, nb += a.kind == ACT_BACKWARD;
                held += (a.kind == ACT_FORWARD) - (a.kind == ACT_BACKWARD);
                if (a.kind == ACT_OPTIM_STEP && t < steps - 1) {
                    if (held != w) { fprintf(stderr, "  rank %d step %d: %d held at the update\n", r, t, held); bad = 1; }
                    continue;
                }
                if (a.micro >= 0) a.micro += t * m;
                s[r].actions[s[r].n++] = a;
            }
            int want_f = m - (t == 0 ? 0 : w) + (t == steps - 1 ? 0 : w);
            if (nb != m || nf != want_f) { fprintf(stderr, "  rank %d step %d: %d F (want %d), %d B\n", r, t, nf, want_f, nb); bad = 1; }
            s[r].in_flight[0] = one.in_flight[0];
            s[r].chunks = 1;
            schedule_free(&one);
        }
    }
    int rc = bad ? -1 : play_built(s, p, M);
    for (int r = 0; r < p; r++) free(s[r].actions);
    free(s);
    return rc;
}

static void test_2bw(void) {
    for (int p = 1; p <= 4; p++)
        for (int m = p; m <= 2 * p + 1; m++)
            for (int steps = 1; steps <= 3; steps++) CHECK(play_2bw(p, m, steps) == 0, "2bw p=%d m=%d steps=%d", p, m, steps);
    /* no flush: steps x m micro-batches in one fill and drain, against 1F1B's fill and
     * drain each step (unit costs: F 1, B 2); 2bw's one step is 1F1B's */
    for (int p = 2; p <= 4; p++)
        for (int m = p; m <= 2 * p; m++)
            for (int steps = 1; steps <= 4; steps++) {
                double i1, i2;
                int a = schedule_makespan_steps(SCHED_1F1B, p, m, steps, 0, &i1);
                int b = schedule_makespan_steps(SCHED_2BW, p, m, steps, 0, &i2);
                CHECK(a == steps * (m + p - 1) * 3, "1f1b p=%d m=%d x%d: %d", p, m, steps, a);
                CHECK(b == (steps * m + p - 1) * 3, "2bw p=%d m=%d x%d: %d", p, m, steps, b);
                CHECK(i2 <= i1 && (steps == 1 || i2 < i1), "idle 2bw %.3f 1f1b %.3f", i2, i1);
            }
    /* with a collective of every stage at each update the stages realign once a step: the
     * fill is gone (each stage's first inputs were forwarded in the step before) but the
     * wait for the first stage's last backward stays; 1F1B's flush makes it the same with or
     * without */
    for (int p = 2; p <= 4; p++)
        for (int m = p; m <= 2 * p; m++) {
            double i1, i2;
            int a = schedule_makespan_steps(SCHED_1F1B, p, m, 4, 1, &i1), b = schedule_makespan_steps(SCHED_2BW, p, m, 4, 1, &i2);
            int free_run = schedule_makespan_steps(SCHED_2BW, p, m, 4, 0, NULL);
            CHECK(a == 4 * (m + p - 1) * 3 && b < a && b > free_run, "p=%d m=%d: 1f1b %d, 2bw %d, 2bw without the barrier %d",
                  p, m, a, b, free_run);
            if (m == 2 * p) fprintf(stderr, "  p=%d m=%d, 4 steps with a collective each: idle 1f1b %.3f, 2bw %.3f (%.3f without)\n",
                                    p, m, i1, i2, 1 - 3.0 * 4 * m / free_run);
        }
    Schedule s;
    char err[128];
    CHECK(schedule_build_2bw(&s, 4, 0, 3, 0, 0, err, sizeof err) == -1 && strstr(err, "at least as many"), "m < p: %s", err);
    char *x = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&x, &n);
    CHECK(schedule_build_2bw(&s, 2, 0, 2, 0, 0, err, sizeof err) == 0, "%s", err);
    schedule_print(f, &s);
    fclose(f);
    /* stage 0 of 2, running on: this step's F1 (F0 ran before), the next step's F2 (its 0) */
    CHECK(!strcmp(x, "F1 send1 recvgrad0 B0 F2 send2 recvgrad1 B1 step\n"), "%s", x);
    free(x);
    schedule_free(&s);
    /* PipeDream: the same forwards and backwards, an update after each backward (and none
     * waiting for another stage's: the simulated steps are 2bw's) */
    f = open_memstream(&x, &n);
    CHECK(schedule_build_pipedream(&s, 2, 0, 2, 0, 0, err, sizeof err) == 0, "%s", err);
    schedule_print(f, &s);
    fclose(f);
    CHECK(!strcmp(x, "F1 send1 recvgrad0 B0 step F2 send2 recvgrad1 B1 step\n"), "%s", x);
    CHECK(s.in_flight[0] == 2, "pipedream stage 0 of 2 holds %d", s.in_flight[0]);
    free(x);
    schedule_free(&s);
    for (int p = 2; p <= 4; p++)
        for (int m = p; m <= 2 * p; m++) {
            double i2, ipd;
            int b = schedule_makespan_steps(SCHED_2BW, p, m, 4, 1, &i2), d = schedule_makespan_steps(SCHED_PIPEDREAM, p, m, 4, 1, &ipd);
            CHECK(b == d && b > 0, "p=%d m=%d: 2bw %d, pipedream %d", p, m, b, d);
        }
}

static void test_bad_layouts(void) {
    Schedule s;
    char err[128];
    CHECK(schedule_build(&s, SCHED_1F1B, 2, 0, 0, 1, SCHED_SPLIT_ANY, 0, NULL, err, sizeof err) == -1, "m = 0 accepted");
    CHECK(schedule_build(&s, SCHED_1F1B, 2, 2, 4, 1, SCHED_SPLIT_ANY, 0, NULL, err, sizeof err) == -1, "stage 2 of 2 accepted");
    ScheduleKind k;
    CHECK(schedule_kind_parse("1f1b", &k) == 0 && k == SCHED_1F1B, "1f1b");
    CHECK(schedule_kind_parse("gpipe", &k) == 0 && k == SCHED_GPIPE, "gpipe");
    CHECK(schedule_kind_parse("zbv", &k) == -1, "zbv parsed");
    CHECK(schedule_kind_parse("zb1", &k) == 0 && k == SCHED_ZB1, "zb1");
    CHECK(schedule_kind_parse("interleaved", &k) == 0 && k == SCHED_INTERLEAVED, "interleaved");
    CHECK(schedule_build(&s, SCHED_1F1B, 2, 0, 4, 2, SCHED_SPLIT_ANY, 0, NULL, err, sizeof err) == -1, "1f1b with 2 chunks accepted");
    CHECK(schedule_build(&s, SCHED_INTERLEAVED, 2, 0, 4, SCHED_MAX_CHUNKS + 1, SCHED_SPLIT_ANY, 0, NULL, err, sizeof err) == -1, "too many chunks");
}

/* The player itself catches broken schedules: a receive moved before the neighbour can
 * send it deadlocks; a backward moved before its forward is out of order. */
static void test_player_catches_broken(void) {
    Schedule s[2];
    char err[64];
    for (int broken = 0; broken < 2; broken++) {
        schedule_build(&s[0], SCHED_1F1B, 2, 0, 2, 1, SCHED_SPLIT_ANY, 0, NULL, err, sizeof err);
        schedule_build(&s[1], SCHED_1F1B, 2, 1, 2, 1, SCHED_SPLIT_ANY, 0, NULL, err, sizeof err);
        ActionKind want = broken == 0 ? ACT_RECV_GRAD : ACT_BACKWARD;
        int j = 0;
        while (s[0].actions[j].kind != want) j++;
        Action first = s[0].actions[0];
        s[0].actions[0] = s[0].actions[j];
        s[0].actions[j] = first;
        fprintf(stderr, "  (a broken schedule, expected to fail:)\n");
        CHECK(play_built(s, 2, 2) == -1, "broken schedule %d played", broken);
        schedule_free(&s[0]);
        schedule_free(&s[1]);
    }
}

int main(void) {
    RUN(test_every_layout_plays);
    RUN(test_shapes);
    RUN(test_zb1_max_in_flight);
    RUN(test_bubbles);
    RUN(test_makespan);
    RUN(test_2bw);
    RUN(test_bad_layouts);
    RUN(test_player_catches_broken);
    return TEST_SUMMARY();
}
