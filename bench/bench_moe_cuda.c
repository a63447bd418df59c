/* bench_moe_cuda — the cuda backend's mixture-of-experts ops at the post's model (E=1024, N = 128 x
 * 256 = 32768 tokens), in bf16 (precision=mixed; `bf16`: precision=bf16, the weight gradients in
 * bf16 too).
 * Usage: bench_moe_cuda [mixed|bf16] [N]; BENCH_MOE=products or BENCH_MOE=routing: that part alone.
 * For three layouts of the experts, A: X=16 experts of width He=512, top 2; B: X=8, He=768, top 2;
 * C: X=64, He=256, top 6 (each about the dense FFN's 2 x 1.5 E active width), it times:
 * - the experts' grouped products (op_moe_matmul_*, one cuBLASLt product per expert) on P = N k
 *   rows: forward gate|up [P, E] x [2He, E]^T and down [P, He] x [E, He]^T, backward each one's
 *   input gradient (written) and weight gradient (+=), under three routings of the rows: balanced
 *   (P / X rows each), zipf (expert e's share 1 / (e + 1), normalised) and half (half the rows to
 *   expert 0, the rest evenly); beside one dense product of the same P rows and shapes (op_matmul_*,
 *   the ceiling: the same work in one call), with TFLOP/s and grouped / dense;
 * - the routing ops on N tokens (router forward and backward, top-k, dispatch, statistics, the
 *   routing's backward, combine, unpermute, gate backward), per call in microseconds.
 * Each time is the mean over calls queued 10 at a time between synchronisations (at least 0.2 s),
 * so it holds the host's work a call leaves exposed (the grouped products' per-expert launches and
 * cuBLASLt's algorithm choice for each new row count) but not a round trip per call. Needs a GPU. */
#include "ops.h"
#include "util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static Rng rng;

/* n random floats: a block of 2^20 + 7 normal draws repeated (far larger than any cache) */
static float *rand_host(size_t n, float s) {
    float *h = xmalloc(n * sizeof(float) + 4);
    size_t blk = ((size_t)1 << 20) + 7;
    for (size_t i = 0; i < n && i < blk; i++) h[i] = s * rng_normal(&rng);
    for (size_t i = blk; i < n; i += blk) memcpy(h + i, h, (n - i < blk ? n - i : blk) * sizeof(float));
    return h;
}
static void *rand_act(size_t n, float s) {
    float *h = rand_host(n, s), *d = op_alloc(n * sizeof(float));
    op_upload(d, h, n * sizeof(float));
    void *a = op_alloc(n * ops_act_size());
    op_to_act(a, d, n);
    op_free(d);
    free(h);
    return a;
}
static void *rand_state(size_t n, float s) {
    float *h = rand_host(n, s);
    void *d = op_alloc(n * ops_state_size());
    op_upload_state(d, h, n);
    free(h);
    return d;
}
static float *rand_f32(size_t n, float s) {
    float *h = rand_host(n, s), *d = op_alloc(n * sizeof(float));
    op_upload(d, h, n * sizeof(float));
    free(h);
    return d;
}

/* seconds per call of body: one warm-up, then calls queued 10 at a time until 0.2 s */
#define TIME(secs, body)                                                                     \
    do {                                                                                     \
        body;                                                                                \
        ops_synchronize();                                                                   \
        int n_ = 0;                                                                          \
        double t0_ = now_seconds(), t_;                                                      \
        do {                                                                                 \
            for (int q_ = 0; q_ < 10; q_++) { body; }                                        \
            n_ += 10;                                                                        \
            ops_synchronize();                                                               \
            t_ = now_seconds() - t0_;                                                        \
        } while (t_ < 0.2);                                                                  \
        secs = t_ / n_;                                                                      \
    } while (0)

/* expert e's first row under each routing of P rows over X experts (off: X + 1 ints) */
enum { ROUTE_BALANCED, ROUTE_ZIPF, ROUTE_HALF, N_ROUTES };
static const char *route_name[N_ROUTES] = {"balanced", "zipf", "half"};
static void routing_offsets(int route, int P, int X, int *off) {
    int *cnt = xcalloc((size_t)X, sizeof(int)), given = 0;
    if (route == ROUTE_BALANCED) {
        for (int e = 0; e < X; e++) cnt[e] = P / X;
    } else if (route == ROUTE_ZIPF) {
        double W = 0;
        for (int e = 0; e < X; e++) W += 1.0 / (e + 1);
        for (int e = 0; e < X; e++) cnt[e] = (int)((double)P / (e + 1) / W);
    } else {
        cnt[0] = P / 2;
        for (int e = 1; e < X; e++) cnt[e] = (P - P / 2) / (X - 1);
    }
    for (int e = 0; e < X; e++) given += cnt[e];
    cnt[0] += P - given; /* what the rounding left */
    off[0] = 0;
    for (int e = 0; e < X; e++) off[e + 1] = off[e] + cnt[e];
    free(cnt);
}

typedef struct {
    const char *name;
    int X, He, k;
} Layout;

static void report(const char *what, const char *route, double s, double flops, double dense) {
    printf("  %-30s %-9s %8.3f ms %6.1f TFLOP/s", what, route, s * 1e3, flops / s / 1e12);
    if (dense > 0) printf("   x%.2f of dense", dense / s);
    printf("\n");
}

static void bench_products(const Layout *ly, int N, int E) {
    int X = ly->X, He = ly->He, k = ly->k, P = N * k, H2 = 2 * He;
    size_t PE = (size_t)P * E, PH = (size_t)P * He, PH2 = (size_t)P * H2;
    size_t ws1 = (size_t)H2 * E, ws2 = (size_t)E * He; /* one expert's gate|up and down */
    printf("layout %s: X=%d He=%d k=%d, P=%d rows: gate|up [P,%d]x[%d,%d]^T, down [P,%d]x[%d,%d]^T\n", ly->name, X, He,
           k, P, E, H2, E, He, E, He);
    void *xa = rand_act(PE, 1.0f), *gu = rand_act(PH2, 1.0f), *h = rand_act(PH, 1.0f), *xb = rand_act(PE, 1.0f);
    void *dxa = rand_act(PE, 1.0f), *dgu = rand_act(PH2, 1.0f), *dh = rand_act(PH, 1.0f), *dxb = rand_act(PE, 1.0f);
    void *w1 = rand_act((size_t)X * ws1, 0.02f), *w2 = rand_act((size_t)X * ws2, 0.02f);
    void *dw1 = rand_state((size_t)X * ws1, 0.01f), *dw2 = rand_state((size_t)X * ws2, 0.01f);
    double f_gu = 2.0 * P * E * H2, f_dn = 2.0 * P * He * E, s;
    double dense[4];
    TIME(dense[0], op_matmul_forward(gu, xa, w1, P, E, H2));
    TIME(dense[1], op_matmul_forward(xb, h, w2, P, He, E));
    TIME(dense[2], op_matmul_backward_set(dxa, dw1, dgu, xa, w1, P, E, H2));
    TIME(dense[3], op_matmul_backward_set(dh, dw2, dxb, h, w2, P, He, E));
    report("forward gate|up", "dense", dense[0], f_gu, 0);
    report("forward down", "dense", dense[1], f_dn, 0);
    report("backward gate|up (dinp, dw)", "dense", dense[2], 2 * f_gu, 0);
    report("backward down (dinp, dw)", "dense", dense[3], 2 * f_dn, 0);
    int *off = xmalloc(((size_t)X + 1) * sizeof(int));
    for (int r = 0; r < N_ROUTES; r++) {
        routing_offsets(r, P, X, off);
        int most = 0;
        for (int e = 0; e < X; e++) most = off[e + 1] - off[e] > most ? off[e + 1] - off[e] : most;
        printf("  (%s: the largest group %d rows, the smallest %d)\n", route_name[r], most,
               r == ROUTE_BALANCED ? P / X : off[X] - off[X - 1]);
        TIME(s, op_moe_matmul_forward(gu, xa, w1, ws1, off, X, E, H2));
        report("forward gate|up", route_name[r], s, f_gu, dense[0]);
        TIME(s, op_moe_matmul_forward(xb, h, w2, ws2, off, X, He, E));
        report("forward down", route_name[r], s, f_dn, dense[1]);
        TIME(s, op_moe_matmul_backward(dxa, dw1, ws1, dgu, xa, w1, off, X, E, H2));
        report("backward gate|up (dinp, dw)", route_name[r], s, 2 * f_gu, dense[2]);
        TIME(s, op_moe_matmul_backward(dh, dw2, ws2, dxb, h, w2, off, X, He, E));
        report("backward down (dinp, dw)", route_name[r], s, 2 * f_dn, dense[3]);
    }
    free(off);
    op_free(xa); op_free(gu); op_free(h); op_free(xb); op_free(dxa); op_free(dgu); op_free(dh); op_free(dxb);
    op_free(w1); op_free(w2); op_free(dw1); op_free(dw2);
}

static void report_us(const char *what, double s) { printf("  %-44s %9.1f us\n", what, s * 1e6); }

static void bench_routing(const Layout *ly, int N, int E) {
    int X = ly->X, He = ly->He, k = ly->k;
    size_t NE = (size_t)N * E, NX = (size_t)N * X, NK = (size_t)N * k;
    printf("layout %s routing: N=%d E=%d X=%d k=%d\n", ly->name, N, E, X, k);
    void *x = rand_act(NE, 1.0f), *wr = rand_act((size_t)X * E, 0.02f), *dx = rand_act(NE, 1.0f);
    void *dwr = rand_state((size_t)X * E, 0.01f);
    float *logits = op_alloc(NX * sizeof(float)), *probs = op_alloc(NX * sizeof(float)), *gate = op_alloc(NK * 4);
    float *lse = op_alloc((size_t)N * 4), *grow = op_alloc(NK * 4), *stats = op_alloc((2 * (size_t)X + 1) * 4);
    float *dlogits = op_alloc(NX * sizeof(float)), *acc = op_alloc(((size_t)X + 2) * 4);
    int *idx = op_alloc(NK * 4), *pos = op_alloc(NK * 4), *rowtok = op_alloc(NK * 4);
    int *cnt = op_alloc((3 * (size_t)X + 1) * 4), *hcnt = xmalloc((3 * (size_t)X + 1) * 4);
    double s;
    TIME(s, op_moe_router_forward(logits, x, wr, N, E, X));
    report_us("router forward (logits fp32)", s);
    TIME(s, op_moe_topk(probs, idx, gate, lse, logits, NULL, N, X, k, 0));
    report_us("topk (softmax)", s);
    TIME(s, op_moe_topk(probs, idx, gate, lse, logits, NULL, N, X, k, 1));
    report_us("topk (sigmoid)", s);
    op_moe_topk(probs, idx, gate, lse, logits, NULL, N, X, k, 0);
    TIME(s, op_moe_dispatch(cnt, pos, rowtok, grow, idx, gate, N, k, X, 0));
    report_us("dispatch", s);
    TIME(s, op_moe_stats(stats, cnt, probs, lse, N, X));
    report_us("stats", s);
    op_download(hcnt, cnt, (3 * (size_t)X + 1) * 4);
    int P = hcnt[3 * X];
    size_t PE = (size_t)P * E, PH = (size_t)P * He;
    void *ys = rand_act(PE, 1.0f), *out = rand_act(NE, 1.0f), *h = rand_act(PH, 1.0f), *dh = rand_act(PH, 1.0f);
    void *xa = rand_act(PE, 1.0f);
    float *dgr = rand_f32((size_t)P, 1.0f), *dgate = op_alloc((size_t)P * 4);
    TIME(s, op_gather_rows(xa, x, rowtok, (size_t)P, (size_t)E * ops_act_size()));
    report_us("gather rows [P, E] (op_gather_rows)", s);
    TIME(s, op_moe_combine(out, ys, gate, pos, N, k, E));
    report_us("combine (+=)", s);
    TIME(s, op_moe_unpermute(dx, ys, pos, N, k, E, 1));
    report_us("unpermute (+=)", s);
    TIME(s, op_moe_gate_backward(dgate, h, dh, grow, P, He));
    report_us("gate backward", s);
    TIME(s, op_moe_route_backward(dlogits, dgr, pos, logits, probs, idx, gate, lse, stats, 1e-3f, 1e-4f, N, X, k, 0));
    report_us("route backward", s);
    TIME(s, op_moe_router_backward(dx, dwr, dlogits, x, wr, N, E, X));
    report_us("router backward (dx +=, dw +=)", s);
    TIME(s, op_moe_router_backward(NULL, dwr, dlogits, x, wr, N, E, X));
    report_us("router backward (dw alone)", s);
    TIME(s, op_moe_accumulate(acc, stats, N, X, k));
    report_us("accumulate", s);
    op_free(x); op_free(wr); op_free(dx); op_free(dwr); op_free(logits); op_free(probs); op_free(gate); op_free(lse);
    op_free(grow); op_free(stats); op_free(dlogits); op_free(acc); op_free(idx); op_free(pos); op_free(rowtok);
    op_free(cnt); op_free(ys); op_free(out); op_free(h); op_free(dh); op_free(xa); op_free(dgr); op_free(dgate);
    free(hcnt);
}

int main(int argc, char **argv) {
    char err[256];
    int pure = argc > 1 && !strcmp(argv[1], "bf16");
    int N = argc > 2 ? atoi(argv[2]) : 32768, E = 1024;
    if (ops_init("cuda", 0, err, sizeof err) || ops_set_precision(pure ? OPS_BF16 : OPS_MIXED, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    rng_seed(&rng, 7);
    printf("%s, %s: E=%d N=%d, calls queued 10 at a time\n", ops_device_name(), pure ? "bf16 (state too)" : "bf16",
           E, N);
    const Layout layouts[3] = {{"A", 16, 512, 2}, {"B", 8, 768, 2}, {"C", 64, 256, 6}};
    const char *only = getenv("BENCH_MOE");  /* "products" or "routing": that part alone */
    for (int i = 0; i < 3; i++) {
        if (!only || strcmp(only, "routing")) bench_products(&layouts[i], N, E);
        if (!only || strcmp(only, "products")) bench_routing(&layouts[i], N, E);
    }
    return 0;
}
