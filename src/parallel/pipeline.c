#include "pipeline.h"
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "util.h"

/* Units as model.h names them, from the config alone (no Model is built here). */
static int head_unit(const ModelConfig *c) { return c->n_layers + 1; }

/* FLOPs per token of forward + backward: 6 per matmul parameter, and the causal
 * attention's 12 E T per layer (as model_flops_per_token counts them); the embedding is a
 * lookup (counted as E, so that it is not free). */
/* A layer's matrix parameters: qkv, att_out, gate_up, down. */
static double layer_matmul_params(const ModelConfig *c) {
    double E = c->embed_dim, H = (double)(int)(1.5 * c->embed_dim);
    return 3 * E * E + E * E + 3 * E * H;
}
static double layer_flops(const ModelConfig *c, int T) {
    return 6.0 * layer_matmul_params(c) + 12.0 * c->embed_dim * (double)T;
}
static double head_flops(const ModelConfig *c) { return 6.0 * c->embed_dim * (double)c->vocab_size; }

/* Time per FLOP against a layer's forward, measured on the GPU timeline (H200, the post's
 * model at micro-batch 16 x 256, bench/pp_timeline.sh, 2026-11-27): a layer's input-gradient
 * pass 1.2 (attention's backward and the elementwise backwards cost more than their FLOPs
 * say), its weight-gradient pass 0.87 (plain matmuls), the head's matmuls 0.55 (one large
 * E x V product runs nearer the chip's peak than a layer's small ones), and the
 * cross-entropy's passes over the logits, in the head's forward, 0.3 of one head matmul's
 * FLOPs (memory-bound: N x V read and written). FLOPs alone put the head's stage 30% over
 * the others where the GPU shows them even, and the lists built for that left the pipeline
 * waiting. */
#define COST_B 1.2
#define COST_W 0.87
#define COST_HEAD 0.55
#define COST_CE 0.3

void pipeline_stage_costs(const ModelConfig *c, int T, const Stage *s, int n, const double *head, double *out) {
    static const double fused[3] = {3, 0, 0};
    double E = c->embed_dim, pm = layer_matmul_params(c), hm = COST_HEAD * head_flops(c) / 3;  /* one head matmul */
    double ce = COST_CE * head_flops(c) / 3;
    if (!head) head = fused;
    for (int i = 0; i < n; i++) {
        double nl = stage_n_layers(c, &s[i]);
        int h = s[i].last == head_unit(c);
        out[i * 3 + 0] = nl * (2 * pm + 4 * E * T) + (s[i].first == 0 ? E : 0) + (h ? head[0] * hm + ce : 0);
        out[i * 3 + 1] = COST_B * nl * (2 * pm + 8 * E * T) + (h ? head[1] * hm : 0);
        out[i * 3 + 2] = COST_W * nl * 2 * pm + (s[i].first == 0 ? E : 0) + (h ? head[2] * hm : 0);
    }
}

int pipeline_split_backward_ok(const ModelConfig *c, int micro_tokens, int recompute) {
    if (recompute) return SCHED_SPLIT_NONE;
    return (double)micro_tokens * c->embed_dim >= (double)(1 << 22) ? SCHED_SPLIT_ANY : SCHED_SPLIT_ZB1;
}

const double *pipeline_head_placement(ScheduleKind kind, int p) {
    static const double zb[3] = {1, 1, 1}, gpipe[3] = {1, 2, 0};
    if (!schedule_head_split(kind, p)) return NULL;
    return kind == SCHED_ZB1 ? zb : gpipe;
}

double pipeline_stage_flops(const ModelConfig *c, int T, const Stage *s) {
    double f = 0;
    for (int u = s->first; u <= s->last; u++)
        f += u == 0 ? c->embed_dim : u == head_unit(c) ? head_flops(c) : layer_flops(c, T);
    return f;
}

void pipeline_rank_stages(const Stage *split, int p, int v, int rank, Stage *out) {
    for (int c = 0; c < v; c++) out[c] = split[c * p + rank];
}

void pipeline_rank_messages(const ModelConfig *c, const Stage *s, int n, int *fwd, int *bwd) {
    *fwd = *bwd = 0;
    for (int i = 0; i < n; i++) {
        *fwd |= s[i].last != head_unit(c);
        *bwd |= !stage_has_embedding(&s[i]);
    }
}

void pipeline_describe(const ModelConfig *c, const Stage *s, int n, char *buf, size_t len) {
    size_t k = 0;
    buf[0] = 0;
    for (int i = 0; i < n && k < len; i++) {
        int l0 = stage_first_layer(&s[i]), nl = stage_n_layers(c, &s[i]), h = s[i].last == head_unit(c);
        k += (size_t)snprintf(buf + k, len - k, "%s%s", i ? " + " : "", stage_has_embedding(&s[i]) ? "embedding, " : "");
        if (k < len && nl > 0) k += (size_t)snprintf(buf + k, len - k, "layers %d-%d%s", l0, l0 + nl - 1, h ? ", " : "");
        if (k < len && h) k += (size_t)snprintf(buf + k, len - k, "head");  /* nl = 0: the head alone */
    }
}

/* Stages from layer counts n[0..p): stage i holds layers [sum n[<i], sum n[<=i]); a last
 * stage of 0 layers holds the head alone (first = last = the head's unit). */
static void stages_of_counts(const ModelConfig *c, int p, const int *n, Stage *s) {
    int l = 0;
    for (int i = 0; i < p; i++) {
        s[i].first = i == 0 ? 0 : 1 + l;
        l += n[i];
        s[i].last = i == p - 1 ? head_unit(c) : l;  /* unit of layer l - 1 is l */
    }
}

int pipeline_split(const ModelConfig *c, int T, int p, const char *spec, Stage *stages, char *err, size_t errlen) {
    int L = c->n_layers;
    if (p < 1) return set_err(err, errlen, "pipeline_parallel_size=%d: at least 1", p);
    if (p > (p > 1 ? L + 1 : L))
        return set_err(err, errlen, "pipeline_parallel_size=%d exceeds n_layers=%d: every stage but the last (which may "
                       "hold the head alone) needs a layer", p, L);
    int *n = xcalloc((size_t)p, sizeof(int));
    if (strcmp(spec, "auto")) {
        const char *q = spec;
        int i = 0, sum = 0;
        while (*q) {
            char *end;
            long v = strtol(q, &end, 10);
            if (end == q || v < 0 || v > L || i >= p || (*end && *end != ',')) {
                free(n);
                return set_err(err, errlen, "pipeline_split=%s: expected auto or %d layer counts, comma-separated",
                               spec, p);
            }
            n[i++] = (int)v;
            sum += (int)v;
            q = *end ? end + 1 : end;
        }
        if (i != p || sum != L) {
            free(n);
            return set_err(err, errlen, "pipeline_split=%s: %d counts summing to %d; pipeline_parallel_size=%d and "
                           "n_layers=%d want %d summing to %d", spec, i, sum, p, L, p, L);
        }
        for (int k = 0; k < p; k++)
            if (n[k] == 0 && (k < p - 1 || p == 1)) {
                free(n);
                return set_err(err, errlen, "pipeline_split=%s: stage %d holds no layer; only the last stage may (it "
                               "then holds the head alone)", spec, k);
            }
        stages_of_counts(c, p, n, stages);
        free(n);
        return 0;
    }
    /* auto: the contiguous split of the layers into p groups (each >= 1, but for the last
     * when there are p - 1 layers: it then holds the head alone) whose largest stage cost,
     * the embedding added to the first and the head to the last, is least. A head-only last
     * stage is otherwise left to the searches below, which weigh it by its time.
     * best[i][l]: the least largest cost of stages 0..i holding layers [0, l). */
    double lf = layer_flops(c, T), ef = c->embed_dim, hf = head_flops(c);
    double *best = xmalloc((size_t)p * (L + 1) * sizeof(double));
    int *from = xmalloc((size_t)p * (L + 1) * sizeof(int));
    int empty_last = p > L;
    for (int i = 0; i < p; i++)
        for (int l = 0; l <= L; l++) {
            best[i * (L + 1) + l] = 1e300;
            from[i * (L + 1) + l] = -1;
            int last_empty = i == p - 1 && empty_last;
            if (l < i + !last_empty) continue;
            for (int k = i; k < l + last_empty; k++) {  /* stage i holds layers [k, l) */
                if (i == 0 && k != 0) break;
                double prev = i == 0 ? 0 : best[(i - 1) * (L + 1) + k];
                if (i > 0 && from[(i - 1) * (L + 1) + k] < 0) continue;
                double cost = (l - k) * lf + (i == 0 ? ef : 0) + (i == p - 1 && l == L ? hf : 0);
                double m = prev > cost ? prev : cost;
                if (m < best[i * (L + 1) + l]) { best[i * (L + 1) + l] = m; from[i * (L + 1) + l] = k; }
            }
        }
    for (int i = p - 1, l = L; i >= 0; i--) {
        int k = from[i * (L + 1) + l];
        n[i] = l - k;
        l = k;
    }
    stages_of_counts(c, p, n, stages);
    free(best);
    free(from);
    free(n);
    return 0;
}

/* Layer counts of stages s[0..S) (each holds layers only, but for the embedding and head). */
static void counts_of_stages(const ModelConfig *c, const Stage *s, int S, int *n) {
    for (int i = 0; i < S; i++) n[i] = stage_n_layers(c, &s[i]);
}

/* The fewest layers stage i of S may keep: one, but the last of several may hold the head
 * alone. */
static int min_layers(int i, int S) { return i == S - 1 && S > 1 ? 0 : 1; }

/* (the largest rank's load, the sum of the ranks' loads squared, the largest stage's) for
 * layer counts n of p x v stages */
static void loads(const ModelConfig *c, int T, int p, int v, const int *n, double *rank_max, double *sq,
                  double *stage_max) {
    double lf = layer_flops(c, T), *r = xcalloc((size_t)p, sizeof(double));
    *stage_max = 0;
    for (int i = 0; i < p * v; i++) {
        double f = n[i] * lf + (i == 0 ? c->embed_dim : 0) + (i == p * v - 1 ? head_flops(c) : 0);
        r[i % p] += f;
        if (f > *stage_max) *stage_max = f;
    }
    *rank_max = *sq = 0;
    for (int k = 0; k < p; k++) {
        if (r[k] > *rank_max) *rank_max = r[k];
        *sq += r[k] * r[k];
    }
    free(r);
}

int pipeline_split_ranks(const ModelConfig *c, int T, int p, int v, const char *spec, Stage *stages, char *err,
                         size_t errlen) {
    int S = p * v;
    if (pipeline_split(c, T, S, spec, stages, err, errlen)) return -1;
    if (v < 2 || strcmp(spec, "auto")) return 0;
    int *n = xmalloc((size_t)S * sizeof(int));
    counts_of_stages(c, stages, S, n);
    double rm, sq, sm;
    loads(c, T, p, v, n, &rm, &sq, &sm);
    for (int moved = 1; moved;) {
        moved = 0;
        int bi = -1, bj = -1;
        double brm = rm, bsq = sq, bsm = sm;
        for (int i = 0; i < S; i++)
            for (int d = -1; d <= 1; d += 2) {
                int j = i + d;  /* stage i gives its last (d = 1) or first (d = -1) layer to j */
                if (j < 0 || j >= S || n[i] <= min_layers(i, S)) continue;
                n[i]--, n[j]++;
                double r2, q2, s2;
                loads(c, T, p, v, n, &r2, &q2, &s2);
                n[i]++, n[j]--;
                int better = r2 < brm * (1 - 1e-9) ||
                             (r2 <= brm * (1 + 1e-9) && (q2 < bsq * (1 - 1e-9) || (q2 <= bsq * (1 + 1e-9) && s2 < bsm * (1 - 1e-9))));
                if (better) brm = r2, bsq = q2, bsm = s2, bi = i, bj = j;
            }
        if (bi >= 0) {
            n[bi]--, n[bj]++;
            rm = brm, sq = bsq, sm = bsm;
            moved = 1;
        }
    }
    stages_of_counts(c, S, n, stages);
    free(n);
    return 0;
}

/* ---- auto for a schedule: the split whose simulated step is shortest ---- */

/* The simulated makespan of kind over m micro-batches for layer counts n of p x v stages. */
static int span_of(const ModelConfig *c, int T, int p, int v, ScheduleKind kind, int m, int split_ok, int zb1_max,
                   const double *head, const int *n, Stage *tmp, double *cost) {
    stages_of_counts(c, p * v, n, tmp);
    pipeline_stage_costs(c, T, tmp, p * v, head, cost);
    return schedule_makespan(kind, p, m, v, split_ok, zb1_max, cost);
}

/* What the search may spend, in simulated actions x ranks (half a second on one core at most). */
#define SEARCH_BUDGET 2e8

typedef struct {
    const ModelConfig *c;
    int T, p, v, m, S, best, split_ok, zb1_max;
    ScheduleKind kind;
    const double *head;
    int *n, *best_n;
    Stage *tmp;
    double *cost;
} Search;

/* Every split of the layers left over stages i.. (each >= 1, the last >= 0), the shortest kept. */
static void every_split(Search *q, int i, int left) {
    if (i == q->S - 1) {
        q->n[i] = left;
        int t = span_of(q->c, q->T, q->p, q->v, q->kind, q->m, q->split_ok, q->zb1_max, q->head, q->n, q->tmp, q->cost);
        if (t > 0 && t < q->best) q->best = t, memcpy(q->best_n, q->n, (size_t)q->S * sizeof(int));
        return;
    }
    for (int k = 1; k <= left - (q->S - 2 - i); k++) {  /* stages i + 1 .. S - 2 keep one each */
        q->n[i] = k;
        every_split(q, i + 1, left - k);
    }
}

int pipeline_split_schedule(const ModelConfig *c, int T, int p, int v, ScheduleKind kind, int m, int split_ok,
                            int zb1_max_in_flight, const double *head, const char *spec, Stage *stages, char *err,
                            size_t errlen) {
    int S = p * v;
    if (pipeline_split_ranks(c, T, p, v, spec, stages, err, errlen)) return -1;
    if (p < 2 || m < 1 || strcmp(spec, "auto")) return 0;
    /* Every split where there are few enough (C(L, S - 1), the last stage holding the head
     * alone or with layers); else, from the balanced
     * split, move one layer at a time from one stage to another (every pair of stages up to
     * 16, else neighbours) while the best such move shortens the simulated step. Only a
     * step shorter by more than 1/500 replaces the balanced split (a tick's rounding is no
     * reason to unbalance the stages' memory), so the result is never worse. */
    int *n = xmalloc((size_t)S * sizeof(int));
    Stage *tmp = xmalloc((size_t)S * sizeof(Stage));
    double *cost = xmalloc((size_t)S * 3 * sizeof(double));
    double per_eval = 3.0 * S * m * p * (kind == SCHED_INTERLEAVED ? 2 : 1), spent = 0, splits = 1;
    counts_of_stages(c, stages, S, n);
    int best = span_of(c, T, p, v, kind, m, split_ok, zb1_max_in_flight, head, n, tmp, cost);
    spent += per_eval;
    for (int k = 1; k < S && splits * per_eval <= SEARCH_BUDGET; k++) splits *= (double)(c->n_layers - S + 1 + k) / k;
    if (best > 0 && splits * per_eval <= SEARCH_BUDGET) {
        Search q = {c, T, p, v, m, S, INT_MAX, split_ok, zb1_max_in_flight, kind, head, xmalloc((size_t)S * sizeof(int)),
                    xmalloc((size_t)S * sizeof(int)), tmp, cost};
        every_split(&q, 0, c->n_layers);
        if (q.best < best - best / 500) memcpy(n, q.best_n, (size_t)S * sizeof(int));
        free(q.n);
        free(q.best_n);
        best = -1;  /* done */
    }
    while (best > 0) {
        int move_a = -1, move_b = -1, move_span = best;
        for (int a = 0; a < S && spent < SEARCH_BUDGET; a++)
            for (int b = 0; b < S && spent < SEARCH_BUDGET; b++) {
                if (b == a || n[a] <= min_layers(a, S) || (S > 16 && abs(a - b) != 1)) continue;
                n[a]--, n[b]++;
                int t = span_of(c, T, p, v, kind, m, split_ok, zb1_max_in_flight, head, n, tmp, cost);
                n[a]++, n[b]--;
                spent += per_eval;
                if (t > 0 && t < move_span) move_span = t, move_a = a, move_b = b;
            }
        if (move_a < 0 || move_span >= best - best / 500) break;
        n[move_a]--, n[move_b]++;
        best = move_span;
    }
    stages_of_counts(c, S, n, stages);
    free(n); free(tmp); free(cost);
    return 0;
}
