#include "schedule.h"
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "util.h"

static const char *KIND_NAMES[] = {"gpipe", "1f1b", "interleaved", "zb1", "2bw", "pipedream"};

int schedule_kind_parse(const char *name, ScheduleKind *out) {
    for (int k = 0; k < (int)(sizeof KIND_NAMES / sizeof KIND_NAMES[0]); k++)
        if (!strcmp(name, KIND_NAMES[k])) { *out = (ScheduleKind)k; return 0; }
    return -1;
}

const char *schedule_kind_name(ScheduleKind k) { return KIND_NAMES[k]; }

const char *action_name(ActionKind k) {
    static const char *names[] = {"recv", "F", "send", "recvgrad", "B", "sendgrad", "W", "step"};
    return names[k];
}

static void add(Schedule *s, ActionKind k, int micro, int chunk) { s->actions[s->n++] = (Action){k, micro, chunk}; }

/* The first and the last of the p x v stages have no neighbour on one side. */
static int first_stage(const Schedule *s, int c) { return c == 0 && s->stage == 0; }
static int last_stage(const Schedule *s, int c) { return c == s->chunks - 1 && s->stage == s->stages - 1; }

/* A forward with its receive before and its send after, where the stage has neighbours. */
static void forward(Schedule *s, int i, int c) {
    if (!first_stage(s, c)) add(s, ACT_RECV_INPUT, i, c);
    add(s, ACT_FORWARD, i, c);
    if (!last_stage(s, c)) add(s, ACT_SEND_OUTPUT, i, c);
}

static void backward(Schedule *s, int i, int c) {
    if (!last_stage(s, c)) add(s, ACT_RECV_GRAD, i, c);
    add(s, ACT_BACKWARD, i, c);
    if (!first_stage(s, c)) add(s, ACT_SEND_GRAD, i, c);
}

/* ---- interleaved and zero bubble: the lists from a simulation of every rank ----
 *
 * Each rank takes its forwards and its backwards in fixed orders (interleaved: rounds of p
 * micro-batches, each round through chunk 0, 1, ... forward and back down the chunks
 * backward, as Megatron-LM orders them; m need not divide by p: the last round is shorter).
 * In unit time steps (forward 1, backward 2, or 1 + 1 when split), a free rank runs the
 * next backward if its gradient has arrived, else the next forward if its input has and it
 * holds fewer micro-batches than its limit, else (split) the oldest weight-gradient pass
 * waiting; communication is taken as instant. The limit for zb1 is p + 3 micro-batches
 * (zb1_max_in_flight), less on the last stages (p + 1, one more than 1F1B's first stage,
 * gives ZB-H1's m (F + B + W) + (p - 1)(F + B - W) in unit steps, but measured times are not
 * equal units: see plan()); for interleaved Megatron's warm-up plus one,
 * (p - r - 1) x 2 + (v - 1) x p + 1, raised by one until the simulation ends (a short last
 * round can need more). Interleaved takes Megatron-LM's own lists instead where they run
 * and are no longer, and, without activation checkpointing, lists with its backward split
 * (as zb1's: the W passes fill the bubble, two more held) where those end sooner. What
 * each rank ran, in the order it ran it, is its list: every rank simulates all of them
 * alike, so the lists agree. */

typedef struct { int c, i; } Op;

typedef struct {
    int p, v, m, split;
    int *dur;               /* [p v][3]: each stage's forward, backward and weight pass, in ticks */
    Op *ford, *bord;        /* [p][v m]: each rank's forward and backward orders */
    Action **out;           /* [p]: each rank's compute actions (F, B, W) in order */
    int *nout;
    int *in_flight, *pend;  /* [p][v], [p]: most held per chunk, most waiting for W */
    int makespan;
    /* (or NULL) with fixed lists: bar[r * nbar + j], the index in rank r's list where its step j
     * ends; no rank starts step j + 1 before every rank has ended step j (a collective a step) */
    const int *bar;
    int nbar;
} Sim;

static void orders(Sim *S, int r) {
    int p = S->p, v = S->v, m = S->m, k = 0, kb = 0;
    Op *f = S->ford + (size_t)r * v * m, *b = S->bord + (size_t)r * v * m;
    for (int r0 = 0; r0 < m; r0 += p) {
        int n = m - r0 < p ? m - r0 : p;
        for (int c = 0; c < v; c++)
            for (int j = 0; j < n; j++) f[k++] = (Op){c, r0 + j};
        for (int c = v - 1; c >= 0; c--)
            for (int j = 0; j < n; j++) b[kb++] = (Op){c, r0 + j};
    }
}

/* One simulation with per-rank limits lim[r]; 0 when every rank finished, -1 on a deadlock.
 * fixed (or NULL): each rank's compute actions in a given order, run as their inputs
 * arrive (Megatron-LM's interleaved lists), instead of the greedy choice. */
static int simulate(Sim *S, const int *lim, Action *const *fixed, const int *nfixed) {
    int p = S->p, v = S->v, m = S->m, G = p * v, vm = v * m;
    size_t nd = (size_t)G * m;
    int *fdone = xmalloc(nd * sizeof(int)), *bdone = xmalloc(nd * sizeof(int));
    for (size_t k = 0; k < nd; k++) fdone[k] = bdone[k] = INT_MAX;
    int *fi = xcalloc((size_t)p, sizeof(int)), *bi = xcalloc((size_t)p, sizeof(int)), *busy = xcalloc((size_t)p, sizeof(int));
    int *held = xcalloc((size_t)p * v, sizeof(int)), *nheld = xcalloc((size_t)p, sizeof(int));
    Op *wq = xmalloc((size_t)p * vm * sizeof(Op));
    int *wh = xcalloc((size_t)p, sizeof(int)), *wt = xcalloc((size_t)p, sizeof(int));
    memset(S->nout, 0, (size_t)p * sizeof(int));
    memset(S->in_flight, 0, (size_t)p * v * sizeof(int));
    memset(S->pend, 0, (size_t)p * sizeof(int));
    int rc = 0, t = 0;
    for (;;) {
        int finished = 1, running = 0, started = 0;
        for (int r = 0; r < p; r++) {
            if (fixed ? S->nout[r] < nfixed[r] : (fi[r] < vm || bi[r] < vm || wh[r] < wt[r])) finished = 0;
            if (busy[r] > t) { running = 1; continue; }
            Op fx = {0, 0}, bx = {0, 0};
            const Op *fo = fi[r] < vm ? &S->ford[(size_t)r * vm + fi[r]] : NULL;
            const Op *bo = bi[r] < vm ? &S->bord[(size_t)r * vm + bi[r]] : NULL;
            int w_ok = wh[r] < wt[r];
            if (fixed) {  /* only the list's next action may run */
                int k = S->nout[r];
                if (S->bar) {  /* at a step's end: every rank there and idle first */
                    int j = 0, held_back = 0;
                    while (j < S->nbar && S->bar[r * S->nbar + j] < k) j++;
                    if (j < S->nbar && S->bar[r * S->nbar + j] == k && k < nfixed[r])
                        for (int q = 0; q < p; q++)
                            if (S->nout[q] < S->bar[q * S->nbar + j] ||  /* not there, or its last action running */
                                (S->nout[q] == S->bar[q * S->nbar + j] && busy[q] > t))
                                held_back = 1;
                    if (held_back) continue;
                }
                fo = bo = NULL;
                w_ok = 0;
                if (k < nfixed[r]) {
                    Action a = fixed[r][k];
                    if (a.kind == ACT_FORWARD) fx = (Op){a.chunk, a.micro}, fo = &fx;
                    else if (a.kind == ACT_BACKWARD) bx = (Op){a.chunk, a.micro}, bo = &bx;
                    else w_ok = wh[r] < wt[r];  /* the list's W is the oldest waiting (FIFO) */
                }
            }
            int bg = bo ? bo->c * p + r : 0, fg = fo ? fo->c * p + r : 0;
            int b_ok = bo && fdone[(size_t)bg * m + bo->i] <= t &&
                       (bg == G - 1 || bdone[(size_t)(bg + 1) * m + bo->i] <= t);
            int f_ok = fo && nheld[r] < lim[r] && (fg == 0 || fdone[(size_t)(fg - 1) * m + fo->i] <= t);
            Action *a = &S->out[r][S->nout[r]];
            if (b_ok) {
                busy[r] = t + S->dur[bg * 3 + 1];
                bdone[(size_t)bg * m + bo->i] = t + S->dur[bg * 3 + 1];
                *a = (Action){ACT_BACKWARD, bo->i, bo->c};
                if (S->split) {
                    wq[(size_t)r * vm + wt[r]++] = *bo;
                    if (wt[r] - wh[r] > S->pend[r]) S->pend[r] = wt[r] - wh[r];
                } else {
                    held[r * v + bo->c]--;
                    nheld[r]--;
                }
                bi[r]++;
            } else if (f_ok) {
                busy[r] = t + S->dur[fg * 3];
                fdone[(size_t)fg * m + fo->i] = t + S->dur[fg * 3];
                *a = (Action){ACT_FORWARD, fo->i, fo->c};
                if (++held[r * v + fo->c] > S->in_flight[r * v + fo->c]) S->in_flight[r * v + fo->c] = held[r * v + fo->c];
                nheld[r]++;
                fi[r]++;
            } else if (w_ok) {
                Op w = wq[(size_t)r * vm + wh[r]++];
                busy[r] = t + S->dur[(w.c * p + r) * 3 + 2];
                *a = (Action){ACT_WEIGHT, w.i, w.c};
                held[r * v + w.c]--;
                nheld[r]--;
            } else {
                continue;
            }
            S->nout[r]++;
            started = running = 1;
        }
        if (finished) break;
        if (!running && !started) { rc = -1; break; }
        /* nothing changes until a running action ends: go to the next end */
        int next = INT_MAX;
        for (int r = 0; r < p; r++)
            if (busy[r] > t && busy[r] < next) next = busy[r];
        t = next;
    }
    S->makespan = t;  /* the last actions' ends, not their starts */
    for (int r = 0; r < p; r++)
        if (busy[r] > S->makespan) S->makespan = busy[r];
    free(fdone); free(bdone); free(fi); free(bi); free(busy); free(held); free(nheld); free(wq); free(wh); free(wt);
    return rc;
}

/* Megatron-LM's interleaved lists: rank r runs (p - r - 1) x 2 + (v - 1) x p forwards
 * (at most all), then a forward and a backward in turn, then the remaining backwards. */
static void megatron_lists(const Sim *S, Action **lists) {
    int p = S->p, v = S->v, vm = v * S->m;
    for (int r = 0; r < p; r++) {
        const Op *f = S->ford + (size_t)r * vm, *b = S->bord + (size_t)r * vm;
        int w = (p - r - 1) * 2 + (v - 1) * p, n = 0, kf = 0, kb = 0;
        if (w > vm) w = vm;
        while (kf < w) lists[r][n++] = (Action){ACT_FORWARD, f[kf].i, f[kf].c}, kf++;
        while (kf < vm) {
            lists[r][n++] = (Action){ACT_FORWARD, f[kf].i, f[kf].c}, kf++;
            lists[r][n++] = (Action){ACT_BACKWARD, b[kb].i, b[kb].c}, kb++;
        }
        while (kb < vm) lists[r][n++] = (Action){ACT_BACKWARD, b[kb].i, b[kb].c}, kb++;
    }
}

/* Each stage's F, B, W in ticks: unit costs (1, 2 or 1 + 1 split, 1) without cost, else
 * cost's [stage][3] times scaled so that the mean forward is SCHED_TICKS_PER_FORWARD ticks
 * (fine enough that a layer moved between stages shows in the makespan). */
static int *durations(int G, int split, const double *cost) {
    int *d = xmalloc((size_t)G * 3 * sizeof(int));
    double mean = 0;
    for (int g = 0; cost && g < G; g++) mean += cost[g * 3] / G;
    for (int g = 0; g < G; g++)
        for (int k = 0; k < 3; k++) {
            if (!cost || mean <= 0) d[g * 3 + k] = k == 1 && !split ? 2 : 1;
            else {
                double c = k == 1 && !split ? cost[g * 3 + 1] + cost[g * 3 + 2] : cost[g * 3 + k];
                long x = lround(SCHED_TICKS_PER_FORWARD * c / mean);
                d[g * 3 + k] = x < 1 ? 1 : (int)x;
            }
        }
    return d;
}

static Sim sim_new(int p, int v, int m, int split, const double *cost) {
    Sim S = {p, v, m, split, durations(p * v, split, cost), NULL, NULL, NULL, NULL, NULL, NULL, 0, NULL, 0};
    int vm = v * m;
    S.ford = xmalloc((size_t)p * vm * sizeof(Op));
    S.bord = xmalloc((size_t)p * vm * sizeof(Op));
    S.out = xmalloc((size_t)p * sizeof(Action *));
    for (int r = 0; r < p; r++) {
        orders(&S, r);
        S.out[r] = xmalloc((size_t)3 * vm * sizeof(Action));
    }
    S.nout = xmalloc((size_t)p * sizeof(int));
    S.in_flight = xmalloc((size_t)p * v * sizeof(int));
    S.pend = xmalloc((size_t)p * sizeof(int));
    return S;
}

static void sim_free(Sim *S) {
    for (int q = 0; q < S->p; q++) free(S->out[q]);
    free(S->out); free(S->ford); free(S->bord); free(S->nout); free(S->in_flight); free(S->pend); free(S->dur);
}

/* Every rank's list of kind (interleaved or zb1) into S: 0, or -1 if none was found. */
static int plan(Sim *S, ScheduleKind kind, int zb1_max_in_flight) {
    /* interleaved with its backward split: Megatron-LM's lists have no W; two more held
     * (micro-batch, chunk)s than without, where W waits (bench/pp_sim: 0.95 of the bubble's
     * prediction at p = 4, m = 8 with none more, 0.98 with two, no better with more) */
    int more = kind == SCHED_INTERLEAVED && S->split ? 2 : 0;
    int p = S->p, v = S->v, vm = v * S->m, rc;
    int *lim = xmalloc((size_t)p * sizeof(int));
    /* zb1's limit on rank r is p - r + p + 1, 1F1B's in-flight count plus p, capped at
     * zb1_max_in_flight (the most micro-batches a rank holds from its F to its W; p + 3 by
     * default). A cap of p + 1 gives ZB-H1's memory (1F1B's plus one), but its lists end on
     * the last micro-batch's chain: on four H100s at m = 8, p + 3 ran 1.19x 1F1B against
     * p + 1's 1.06x (bench/results/pipeline-h100x4-2026-11.md), for 1.2 GB more activations on the first stage. */
    int cap = zb1_max_in_flight > 0 ? zb1_max_in_flight : p + 3;
    for (int r = 0; r < p; r++) {
        int l = kind == SCHED_ZB1 ? (2 * p + 1 - r < cap ? 2 * p + 1 - r : cap) : (p - r - 1) * 2 + (v - 1) * p + 2 + more;
        lim[r] = l < vm ? l : vm;
    }
    /* interleaved: Megatron-LM's lists where they run and are no longer than the greedy's */
    int mega = -1, *vmlim = xmalloc((size_t)p * sizeof(int)), *nfixed = xmalloc((size_t)p * sizeof(int));
    Action **fixed = NULL;
    if (kind == SCHED_INTERLEAVED && !S->split) {
        fixed = xmalloc((size_t)p * sizeof(Action *));
        for (int r = 0; r < p; r++) fixed[r] = xmalloc((size_t)2 * vm * sizeof(Action)), vmlim[r] = vm, nfixed[r] = 2 * vm;
        megatron_lists(S, fixed);
        if (simulate(S, vmlim, fixed, nfixed) == 0) mega = S->makespan;
    }
    while ((rc = simulate(S, lim, NULL, NULL)) != 0) {
        int raised = 0;
        for (int r = 0; r < p; r++)
            if (lim[r] < vm) lim[r]++, raised = 1;
        if (!raised) break;
    }
    if (mega >= 0 && (rc || mega <= S->makespan)) rc = simulate(S, vmlim, fixed, nfixed);
    for (int r = 0; fixed && r < p; r++) free(fixed[r]);
    free(fixed);
    free(vmlim);
    free(nfixed);
    free(lim);
    return rc;
}

/* The lists of kind (interleaved or zb1) into *S: zb1's with the backward split; interleaved's
 * without, and, with SCHED_SPLIT_ANY, also with it, taking those where they end sooner. 0, or
 * -1. */
static int plan_best(Sim *S, ScheduleKind kind, int p, int v, int m, int split_ok, int zb1_max_in_flight,
                     const double *cost) {
    *S = sim_new(p, v, m, kind == SCHED_ZB1, cost);
    int rc = plan(S, kind, zb1_max_in_flight);
    if (kind != SCHED_INTERLEAVED || split_ok != SCHED_SPLIT_ANY) return rc;
    Sim T = sim_new(p, v, m, 1, cost);
    if (plan(&T, kind, zb1_max_in_flight) == 0 && (rc || T.makespan < S->makespan)) {
        sim_free(S);
        *S = T;
        return 0;
    }
    sim_free(&T);
    return rc;
}

static int build_simulated(Schedule *s, int split_ok, int zb1_max_in_flight, const double *cost, char *err,
                           size_t errlen) {
    int v = s->chunks;
    Sim S;
    int rc = plan_best(&S, s->kind, s->stages, v, s->micro_batches, split_ok, zb1_max_in_flight, cost);
    s->split_backward = S.split;
    if (rc) {
        set_err(err, errlen, "internal: no %s schedule for %d stages, %d chunks, %d micro-batches",
                schedule_kind_name(s->kind), s->stages, v, s->micro_batches);
    } else {
        int r = s->stage;
        for (int k = 0; k < S.nout[r]; k++) {
            Action a = S.out[r][k];
            if (a.kind == ACT_FORWARD) forward(s, a.micro, a.chunk);
            else if (a.kind == ACT_BACKWARD) backward(s, a.micro, a.chunk);
            else add(s, a.kind, a.micro, a.chunk);
        }
        for (int c = 0; c < v; c++) {
            s->in_flight[c] = S.in_flight[r * v + c];
            s->max_in_flight += s->in_flight[c];  /* what the slots of every chunk hold */
        }
        s->max_pending_w = S.pend[r];
        s->makespan = S.makespan;
    }
    sim_free(&S);
    return rc;
}

int schedule_build(Schedule *s, ScheduleKind kind, int stages, int stage, int m, int chunks, int split_ok,
                   int zb1_max_in_flight, const double *cost, char *err, size_t errlen) {
    memset(s, 0, sizeof *s);
    if (stages < 1 || stage < 0 || stage >= stages) return set_err(err, errlen, "stage %d of %d", stage, stages);
    if (m < 1) return set_err(err, errlen, "%d micro-batches: at least one is needed", m);
    if (chunks < 1 || chunks > SCHED_MAX_CHUNKS || (chunks > 1 && kind != SCHED_INTERLEAVED))
        return set_err(err, errlen, "virtual_stages=%d: 1 to %d, and more than 1 only with pipeline_schedule=interleaved",
                       chunks, SCHED_MAX_CHUNKS);
    if (zb1_max_in_flight < 0)
        return set_err(err, errlen, "zb1_max_in_flight=%d: at least 1 (0: the default, %d)", zb1_max_in_flight,
                       stages + 3);
    s->kind = kind; s->stages = stages; s->stage = stage; s->micro_batches = m; s->chunks = chunks;
    if (kind == SCHED_ZB1 && split_ok == SCHED_SPLIT_NONE)
        return set_err(err, errlen, "pipeline_schedule=zb1 keeps every layer's activations for its weight pass: "
                       "it does not combine with activation_checkpointing");
    s->head_split = schedule_head_split(kind, stages);
    s->actions = xmalloc((size_t)(7 * m * chunks + 1) * sizeof *s->actions);
    if (kind == SCHED_INTERLEAVED || kind == SCHED_ZB1) {
        if (build_simulated(s, split_ok, zb1_max_in_flight, cost, err, errlen)) { schedule_free(s); return -1; }
    } else if (kind == SCHED_GPIPE) {
        /* every forward, then every backward (in reverse order, as the activations were made) */
        for (int i = 0; i < m; i++) forward(s, i, 0);
        for (int i = m - 1; i >= 0; i--) backward(s, i, 0);
        s->max_in_flight = m;
    } else {
        /* 1F1B (and 2bw's step on an empty pipeline that ends empty): stage s runs stages - s - 1 forwards ahead, then one forward and one
         * backward in turn, then the remaining backwards: at most stages - s micro-batches'
         * activations at once (the first stage holds the most). With one stage: F0 B0 F1 B1 ... */
        int warmup = stages - stage - 1 < m ? stages - stage - 1 : m;
        for (int i = 0; i < warmup; i++) forward(s, i, 0);
        for (int i = 0; i < m - warmup; i++) {
            forward(s, warmup + i, 0);
            backward(s, i, 0);
        }
        for (int i = m - warmup; i < m; i++) backward(s, i, 0);
        s->max_in_flight = warmup + 1 < m ? warmup + 1 : m;
    }
    if (kind == SCHED_GPIPE || kind == SCHED_1F1B || schedule_no_flush(kind)) s->in_flight[0] = s->max_in_flight;
    add(s, ACT_OPTIM_STEP, -1, 0);
    return 0;
}

static int build_no_flush(Schedule *s, ScheduleKind kind, int stages, int stage, int m, int fill, int drain, char *err,
                          size_t errlen) {
    memset(s, 0, sizeof *s);
    if (stages < 1 || stage < 0 || stage >= stages) return set_err(err, errlen, "stage %d of %d", stage, stages);
    /* m >= stages: a stage's in-flight micro-batches then span at most two steps (2bw: two
     * weight versions serve them all), and a drain ends within its step */
    if (m < stages)
        return set_err(err, errlen, "pipeline_schedule=%s: %d micro-batches for %d stages: at least as many as stages",
                       schedule_kind_name(kind), m, stages);
    s->kind = kind; s->stages = stages; s->stage = stage; s->micro_batches = m; s->chunks = 1;
    int w = stages - stage - 1, each = kind == SCHED_PIPEDREAM;
    s->actions = xmalloc((size_t)(8 * (m + w) + 1) * sizeof *s->actions);
    if (fill)
        for (int i = 0; i < w; i++) forward(s, i, 0);
    /* forward w + i, then backward i; past m the forwards are the next step's (drain: none) */
    for (int i = 0; i < m; i++) {
        if (!drain || w + i < m) forward(s, w + i, 0);
        backward(s, i, 0);
        if (each) add(s, ACT_OPTIM_STEP, i, 0);
    }
    s->max_in_flight = s->in_flight[0] = w + 1;
    if (!each) add(s, ACT_OPTIM_STEP, -1, 0);
    return 0;
}

int schedule_build_2bw(Schedule *s, int stages, int stage, int m, int fill, int drain, char *err, size_t errlen) {
    return build_no_flush(s, SCHED_2BW, stages, stage, m, fill, drain, err, errlen);
}

int schedule_build_pipedream(Schedule *s, int stages, int stage, int m, int fill, int drain, char *err, size_t errlen) {
    return build_no_flush(s, SCHED_PIPEDREAM, stages, stage, m, fill, drain, err, errlen);
}

int schedule_makespan_steps(ScheduleKind kind, int stages, int m, int steps, int barrier, double *idle) {
    int p = stages, M = m * steps, rc = 0;
    char err[128];
    if (stages < 1 || m < 1 || steps < 1 || (kind != SCHED_1F1B && kind != SCHED_GPIPE && !schedule_no_flush(kind))) return -1;
    if (schedule_no_flush(kind) && m < stages) return -1;
    /* one simulation over steps x m micro-batches: step t's micro-batch j is t m + j (2bw's
     * forwards of the next step, m + j, are its (t + 1) m + j); the update takes no time */
    Sim S = sim_new(p, 1, M, 0, NULL);
    Action **fixed = xmalloc((size_t)p * sizeof(Action *));
    int *nfixed = xcalloc((size_t)p, sizeof(int)), *lim = xmalloc((size_t)p * sizeof(int));
    int *bar = xmalloc((size_t)p * steps * sizeof(int));
    for (int r = 0; r < p; r++) {
        fixed[r] = xmalloc((size_t)2 * M * sizeof(Action));
        lim[r] = M;
        for (int t = 0; t < steps && !rc; t++) {
            Schedule sc;
            int bad = schedule_no_flush(kind) ? build_no_flush(&sc, kind, p, r, m, t == 0, t == steps - 1, err, sizeof err)
                                        : schedule_build(&sc, kind, p, r, m, 1, SCHED_SPLIT_NONE, 0, NULL, err, sizeof err);
            if (bad) { rc = -1; break; }
            for (int k = 0; k < sc.n; k++)
                if (sc.actions[k].kind == ACT_FORWARD || sc.actions[k].kind == ACT_BACKWARD) {
                    Action a = sc.actions[k];
                    a.micro += t * m;
                    fixed[r][nfixed[r]++] = a;
                }
            bar[r * steps + t] = nfixed[r];
            schedule_free(&sc);
        }
    }
    if (barrier) S.bar = bar, S.nbar = steps;
    if (!rc) rc = simulate(&S, lim, fixed, nfixed);
    int t = rc ? -1 : S.makespan;
    if (idle && t > 0) *idle = 1.0 - 3.0 * M / t;  /* each rank computes M forwards (1) and backwards (2) */
    for (int r = 0; r < p; r++) free(fixed[r]);
    free(fixed); free(nfixed); free(lim); free(bar);
    sim_free(&S);
    return t;
}

void schedule_free(Schedule *s) {
    free(s->actions);
    s->actions = NULL;
    s->n = 0;
}

void schedule_print(FILE *f, const Schedule *s) {
    for (int i = 0; i < s->n; i++) {
        const Action *a = &s->actions[i];
        if (a->kind == ACT_OPTIM_STEP) fprintf(f, "%sstep", i ? " " : "");
        else if (s->chunks > 1) fprintf(f, "%s%s%d.%d", i ? " " : "", action_name(a->kind), a->micro, a->chunk);
        else fprintf(f, "%s%s%d", i ? " " : "", action_name(a->kind), a->micro);
    }
    fputc('\n', f);
}

int schedule_makespan(ScheduleKind kind, int stages, int m, int chunks, int split_ok, int zb1_max_in_flight,
                      const double *cost) {
    int p = stages, vm = chunks * m, rc = 0;
    char err[128];
    if (stages < 1 || m < 1 || chunks < 1 || chunks > SCHED_MAX_CHUNKS || (chunks > 1 && kind != SCHED_INTERLEAVED))
        return -1;
    if ((kind == SCHED_ZB1 && split_ok == SCHED_SPLIT_NONE) || zb1_max_in_flight < 0) return -1;
    Sim S;
    if (kind == SCHED_INTERLEAVED || kind == SCHED_ZB1) {
        rc = plan_best(&S, kind, p, chunks, m, split_ok, zb1_max_in_flight, cost);  /* every rank's list at once: its makespan is theirs */
    } else {
        S = sim_new(p, chunks, m, 0, cost);  /* the fixed lists, played together */
        Action **fixed = xmalloc((size_t)p * sizeof(Action *));
        int *nfixed = xcalloc((size_t)p, sizeof(int)), *lim = xmalloc((size_t)p * sizeof(int));
        for (int r = 0; r < p; r++) {
            Schedule sc;
            fixed[r] = xmalloc((size_t)2 * vm * sizeof(Action));
            lim[r] = vm;
            if (schedule_build(&sc, kind, p, r, m, chunks, split_ok, zb1_max_in_flight, cost, err, sizeof err)) {
                rc = -1;
                continue;
            }
            for (int k = 0; k < sc.n; k++)
                if (sc.actions[k].kind == ACT_FORWARD || sc.actions[k].kind == ACT_BACKWARD) fixed[r][nfixed[r]++] = sc.actions[k];
            schedule_free(&sc);
        }
        if (!rc) rc = simulate(&S, lim, fixed, nfixed);
        for (int r = 0; r < p; r++) free(fixed[r]);
        free(fixed); free(nfixed); free(lim);
    }
    int t = rc ? -1 : S.makespan;
    sim_free(&S);
    return t;
}
