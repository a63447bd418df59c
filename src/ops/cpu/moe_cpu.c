/* moe_cpu: the routing, dispatch and combine of a mixture-of-experts FFN on the cpu (fp32).
 * Each row's work is one thread's, and every sum runs in a fixed order (rows, choices j,
 * experts e ascending), so the results do not depend on the thread count. */
#include "moe_cpu.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "util.h"

void cpu_moe_topk(float *probs, int *idx, float *gate, float *lse, const float *logits, const float *bias, int N, int X,
                  int k, int sigmoid) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *z = logits + (size_t)n * X;
        float *s = probs + (size_t)n * X;
        double mx = z[0], sum = 0;
        for (int e = 1; e < X; e++) mx = z[e] > mx ? z[e] : mx;
        for (int e = 0; e < X; e++) sum += exp((double)z[e] - mx);
        double l = mx + log(sum);
        lse[n] = (float)l;
        for (int e = 0; e < X; e++)
            s[e] = sigmoid ? (float)(1.0 / (1.0 + exp(-(double)z[e]))) : (float)exp((double)z[e] - l);
        int *ix = idx + (size_t)n * k;
        double sel = 0;
        for (int j = 0; j < k; j++) {  /* the j-th largest s + bias, ties to the lower expert */
            int best = -1;
            float bv = 0;
            for (int e = 0; e < X; e++) {
                int taken = 0;
                for (int i = 0; i < j; i++) taken |= ix[i] == e;
                if (taken) continue;
                float v = s[e] + (bias ? bias[e] : 0.0f);
                if (best < 0 || v > bv) best = e, bv = v;
            }
            ix[j] = best;
            sel += s[best];
        }
        for (int j = 0; j < k; j++) gate[(size_t)n * k + j] = (float)(s[ix[j]] / sel);
    }
}

void cpu_moe_dispatch(int *cnt, int *pos, int *rowtok, float *gate_rows, const int *idx, const float *gate, int N,
                      int k, int X, int capacity) {
    int *routed = cnt, *kept = cnt + X, *first = cnt + 2 * X;
    memset(cnt, 0, (3 * (size_t)X + 1) * sizeof(int));
    size_t nk = (size_t)N * k;
    for (size_t i = 0; i < nk; i++) {  /* in order of n, then j: the first `capacity` of each expert stay */
        int e = idx[i];
        routed[e]++;
        if (capacity <= 0 || kept[e] < capacity) kept[e]++, pos[i] = 0;
        else pos[i] = -1;
    }
    for (int e = 0; e < X; e++) first[e + 1] = first[e] + kept[e];
    int *fill = xcalloc((size_t)X, sizeof(int));
    for (size_t i = 0; i < nk; i++) {
        if (pos[i] < 0) continue;
        int e = idx[i], p = first[e] + fill[e]++;
        pos[i] = p;
        rowtok[p] = (int)(i / (size_t)k);
        gate_rows[p] = gate[i];
    }
    free(fill);
}

void cpu_moe_stats(float *stats, const int *cnt, const float *probs, const float *lse, int N, int X) {
    double *acc = xcalloc((size_t)X + 1, sizeof(double));
    for (int n = 0; n < N; n++) {
        const float *s = probs + (size_t)n * X;
        double sum = 0;
        for (int e = 0; e < X; e++) sum += s[e];
        for (int e = 0; e < X; e++) acc[e] += s[e] / sum;
        acc[X] += (double)lse[n] * lse[n];
    }
    long kept = 0;
    for (int e = 0; e < X; e++) stats[e] = (float)cnt[e], stats[X + e] = (float)acc[e], kept += cnt[X + e];
    stats[2 * X] = (float)acc[X];
    stats[2 * X + 1] = (float)kept;
    free(acc);
}

void cpu_moe_route_backward(float *dlogits, const float *dgate_rows, const int *pos, const float *logits,
                            const float *probs, const int *idx, const float *gate, const float *lse,
                            const float *stats, float aux_scale, float z_scale, int N, int X, int k, int sigmoid) {
#pragma omp parallel
    {
        double *ds = xmalloc((size_t)X * sizeof(double));
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            const float *s = probs + (size_t)n * X, *z = logits + (size_t)n * X;
            const int *ix = idx + (size_t)n * k, *ps = pos + (size_t)n * k;
            const float *g = gate + (size_t)n * k;
            for (int e = 0; e < X; e++) ds[e] = 0;
            /* the gates g_j = s_(i_j) / S over the chosen: ds_(i_m) = (dg_m - sum_j dg_j g_j) / S */
            double S = 0, dot = 0;
            for (int j = 0; j < k; j++) {
                S += s[ix[j]];
                dot += (ps[j] >= 0 ? (double)dgate_rows[ps[j]] : 0.0) * g[j];
            }
            for (int j = 0; j < k; j++) ds[ix[j]] += ((ps[j] >= 0 ? (double)dgate_rows[ps[j]] : 0.0) - dot) / S;
            /* the load-balancing loss through s_hat = s / sum(s) */
            if (aux_scale != 0.0f) {
                double sum = 0, dot2 = 0;
                for (int e = 0; e < X; e++) sum += s[e];
                for (int e = 0; e < X; e++) dot2 += s[e] / sum * ((double)aux_scale * stats[e]);
                for (int e = 0; e < X; e++) ds[e] += ((double)aux_scale * stats[e] - dot2) / sum;
            }
            double sd = 0;
            if (!sigmoid)
                for (int e = 0; e < X; e++) sd += s[e] * ds[e];
            float *dz = dlogits + (size_t)n * X;
            for (int e = 0; e < X; e++) {
                double v = sigmoid ? ds[e] * s[e] * (1.0 - s[e]) : s[e] * (ds[e] - sd);
                if (z_scale != 0.0f) v += (double)z_scale * lse[n] * exp((double)z[e] - lse[n]);
                dz[e] = (float)v;
            }
        }
        free(ds);
    }
}

void cpu_moe_combine(void *out, const void *ys, const float *gate, const int *pos, int N, int k, int E) {
    float *o = out;
    const float *y = ys;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const int *ps = pos + (size_t)n * k;
        const float *g = gate + (size_t)n * k;
        float *on = o + (size_t)n * E;
        for (int c = 0; c < E; c++) {
            float acc = 0;
            for (int j = 0; j < k; j++)
                if (ps[j] >= 0) acc += g[j] * y[(size_t)ps[j] * E + c];
            on[c] += acc;
        }
    }
}

void cpu_moe_unpermute(void *dx, const void *dxs, const int *pos, int N, int k, int E, int acc) {
    float *d = dx;
    const float *s = dxs;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const int *ps = pos + (size_t)n * k;
        float *dn = d + (size_t)n * E;
        for (int c = 0; c < E; c++) {
            float sum = 0;
            for (int j = 0; j < k; j++)
                if (ps[j] >= 0) sum += s[(size_t)ps[j] * E + c];
            dn[c] = acc ? dn[c] + sum : sum;
        }
    }
}

void cpu_moe_gate_backward(float *dgate_rows, void *h, void *dh, const float *gate_rows, int P, int H) {
    float *hh = h, *dd = dh;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < P; p++) {
        float *hp = hh + (size_t)p * H, *dp = dd + (size_t)p * H, g = gate_rows[p];
        double dot = 0;
        for (int i = 0; i < H; i++) dot += (double)dp[i] * hp[i];
        dgate_rows[p] = (float)dot;
        for (int i = 0; i < H; i++) hp[i] *= g, dp[i] *= g;
    }
}

void cpu_moe_accumulate(float *acc, const float *stats, int rows, int X, int k) {
    double aux = 0;
    for (int e = 0; e < X; e++) {
        acc[e] += stats[e];
        aux += ((double)stats[e] / ((double)rows * k)) * ((double)stats[X + e] / rows);
    }
    acc[X] += (float)(X * aux);
    acc[X + 1] += (float)((double)stats[2 * X] / rows);
    acc[X + 2] += stats[2 * X + 1];
}
