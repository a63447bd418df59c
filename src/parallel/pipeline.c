#include "pipeline.h"
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

void pipeline_stage_costs(const ModelConfig *c, int T, const Stage *s, int n, double *out) {
    double E = c->embed_dim, pm = layer_matmul_params(c);
    for (int i = 0; i < n; i++) {
        double nl = stage_n_layers(c, &s[i]);
        out[i * 3 + 0] = nl * (2 * pm + 4 * E * T) + (s[i].first == 0 ? E : 0) + (s[i].last == head_unit(c) ? head_flops(c) : 0);
        out[i * 3 + 1] = nl * (2 * pm + 8 * E * T);
        out[i * 3 + 2] = nl * 2 * pm + (s[i].first == 0 ? E : 0);
    }
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

void pipeline_describe(const ModelConfig *c, const Stage *s, int n, char *buf, size_t len) {
    size_t k = 0;
    buf[0] = 0;
    for (int i = 0; i < n && k < len; i++) {
        int l0 = stage_first_layer(&s[i]), l1 = l0 + stage_n_layers(c, &s[i]) - 1;
        k += (size_t)snprintf(buf + k, len - k, "%s%slayers %d-%d%s", i ? " + " : "",
                              stage_has_embedding(&s[i]) ? "embedding, " : "", l0, l1,
                              s[i].last == head_unit(c) ? ", head" : "");
    }
}

/* Stages from layer counts n[0..p): stage i holds layers [sum n[<i], sum n[<=i]). */
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
    if (p > L)
        return set_err(err, errlen, "pipeline_parallel_size=%d exceeds n_layers=%d: every stage needs a layer", p, L);
    int *n = xcalloc((size_t)p, sizeof(int));
    if (strcmp(spec, "auto")) {
        const char *q = spec;
        int i = 0, sum = 0;
        while (*q) {
            char *end;
            long v = strtol(q, &end, 10);
            if (end == q || v < 1 || v > L || i >= p || (*end && *end != ',')) {
                free(n);
                return set_err(err, errlen, "pipeline_split=%s: expected auto or %d layer counts >= 1, comma-separated",
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
        stages_of_counts(c, p, n, stages);
        free(n);
        return 0;
    }
    /* auto: the contiguous split of the layers into p groups (each >= 1) whose largest
     * stage cost, the embedding added to the first and the head to the last, is least.
     * best[i][l]: the least largest cost of stages 0..i holding layers [0, l). */
    double lf = layer_flops(c, T), ef = c->embed_dim, hf = head_flops(c);
    double *best = xmalloc((size_t)p * (L + 1) * sizeof(double));
    int *from = xmalloc((size_t)p * (L + 1) * sizeof(int));
    for (int i = 0; i < p; i++)
        for (int l = 0; l <= L; l++) {
            best[i * (L + 1) + l] = 1e300;
            from[i * (L + 1) + l] = -1;
            if (l < i + 1) continue;
            for (int k = i; k < l; k++) {  /* stage i holds layers [k, l) */
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
                if (j < 0 || j >= S || n[i] < 2) continue;
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
