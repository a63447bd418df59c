/* bench_ops_cuda — the cuda backend's ops at the sizes of one layer of the post's
 * configuration (E=1024, 8 heads, B*T = 128*256 tokens), in bf16 (precision=mixed), fp32, or
 * pure bf16 (precision=bf16: AdamW's state in bf16 too).
 * Usage: bench_ops_cuda [mixed|fp32|bf16] [E] [NH] [B] [T]
 * With BENCH_OPS=mem in the environment, only the memory-bound ops (no matmuls, no attention);
 * BENCH_OPS=rms, rmsnorm's backward alone, calls queued back to back (no sync between).
 * BENCH_QUEUED=1: every op timed with its calls queued back to back (see TIME); BENCH_GRAPH=1:
 * the same calls replayed from a CUDA graph.
 * Prints each op's time, and TFLOP/s for the matmuls and attention or GB/s (the fewest
 * bytes the op must move) for the memory-bound ops, so the gap to the card's ceilings is
 * visible. Attention runs on the default options' kernels (attention=auto, deterministic:
 * bench_attn compares the others). Needs a GPU. */
#include "ops.h"
#include "util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static Rng rng;

/* n random floats: a block of 2^20 + 7 normal draws repeated (drawing them all took most of
 * a run's time; the repetition is far larger than any cache) */
static float *rand_host(size_t n, float s) {
    float *h = xmalloc(n * sizeof(float));
    size_t blk = ((size_t)1 << 20) + 7;
    for (size_t i = 0; i < n && i < blk; i++) h[i] = s * rng_normal(&rng);
    for (size_t i = blk; i < n; i += blk) memcpy(h + i, h, (n - i < blk ? n - i : blk) * sizeof(float));
    return h;
}

/* random device activations (uploaded as fp32 and converted, so bf16 gets real values) */
static void *rand_act(size_t n, float s) {
    float *h = rand_host(n, s);
    float *d = op_alloc(n * sizeof(float));
    op_upload(d, h, n * sizeof(float));
    void *a = op_alloc(n * ops_act_size());
    op_to_act(a, d, n);
    op_free(d);
    free(h);
    return a;
}

/* random device parameter state (fp32, or bf16 in precision=bf16); |values| when positive */
static void *rand_state(size_t n, float s, int positive) {
    float *h = rand_host(n, s);
    if (positive)
        for (size_t i = 0; i < n; i++) h[i] = h[i] < 0 ? -h[i] : h[i];
    void *d = op_alloc(n * ops_state_size());
    op_upload_state(d, h, n);
    free(h);
    return d;
}

/* seconds per call: one warm-up, then repeats for at least 0.2 s, each call synchronised
 * (a call then carries its launch and the host's round trip, several us), or with
 * BENCH_QUEUED=1 set, 20 calls queued back to back between synchronisations (as a step
 * queues them), or with BENCH_GRAPH=1, those 20 calls recorded once as a CUDA graph
 * (op_graph_*) and the graph replayed: against BENCH_QUEUED, what the launches cost (an op
 * that waits for the device, or a capture that fails, falls back to queued calls: "queued"
 * is printed after its time) */
static int queued, graphed, graph_fell;
#define TIME(secs, body)                                                                     \
    do {                                                                                     \
        body;                                                                                \
        ops_synchronize();                                                                   \
        OpsGraph *gr_ = NULL;                                                                \
        graph_fell = 0;                                                                      \
        if (graphed && !op_graph_begin()) {                                                  \
            for (int q_ = 0; q_ < 20; q_++) { body; }                                        \
            gr_ = op_graph_end();                                                            \
            graph_fell = !gr_;                                                               \
            if (gr_) op_graph_run(gr_);                                                      \
            ops_synchronize();                                                               \
        }                                                                                    \
        int n_ = 0;                                                                          \
        double t0_ = now_seconds(), t_;                                                      \
        do {                                                                                 \
            if (gr_) op_graph_run(gr_), n_ += 20;                                            \
            else                                                                             \
                for (int q_ = 0; q_ < (queued || graphed ? 20 : 1); q_++, n_++) { body; }    \
            ops_synchronize();                                                               \
            t_ = now_seconds() - t0_;                                                        \
        } while (n_ < 5 || t_ < 0.2);                                                        \
        op_graph_free(gr_);                                                                  \
        secs = t_ / n_;                                                                      \
    } while (0)

static void report_flops(const char *what, double s, double flops) {
    printf("  %-44s %8.3f ms  %7.1f TFLOP/s%s\n", what, s * 1e3, flops / s / 1e12, graph_fell ? " queued" : "");
}
static void report_bytes(const char *what, double s, double bytes) {
    printf("  %-44s %8.3f ms  %7.1f GB/s%s\n", what, s * 1e3, bytes / s / 1e9, graph_fell ? " queued" : "");
}

int main(int argc, char **argv) {
    char err[256];
    int fp32 = argc > 1 && !strcmp(argv[1], "fp32"), pure = argc > 1 && !strcmp(argv[1], "bf16");
    int E = argc > 2 ? atoi(argv[2]) : 1024, NH = argc > 3 ? atoi(argv[3]) : 8;
    int B = argc > 4 ? atoi(argv[4]) : 128, T = argc > 5 ? atoi(argv[5]) : 256;
    if (ops_init("cuda", 0, err, sizeof err) || ops_set_precision(fp32 ? OPS_FP32 : pure ? OPS_BF16 : OPS_MIXED, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    rng_seed(&rng, 7);
    queued = getenv("BENCH_QUEUED") && atoi(getenv("BENCH_QUEUED")) > 0;
    graphed = getenv("BENCH_GRAPH") && atoi(getenv("BENCH_GRAPH")) > 0;
    int N = B * T, H = (int)(1.5 * E), HD = E / NH, V = 50257;
    size_t a = ops_act_size();
    printf("%s, %s: E=%d NH=%d H=%d N=%d (B=%d T=%d)%s\n", ops_device_name(), fp32 ? "fp32" : pure ? "bf16 (state too)" : "bf16", E, NH, H, N, B, T,
           graphed ? ", calls in a CUDA graph" : queued ? ", calls queued" : "");
    double s;
    char what[96];
    const char *only = getenv("BENCH_OPS");
    int mem_only = only && !strcmp(only, "mem");
    /* BENCH_OPS=rms: rmsnorm's backward alone, 200 calls queued back to back and one sync (as a
     * step queues them: no host round trip a call) */
    if (only && !strcmp(only, "rms")) {
        size_t ne = (size_t)N * E;
        void *x = rand_act(ne, 1), *y = rand_act(ne, 1), *w = rand_act(E, 1), *dx = rand_act(ne, 1);
        float *rstd = op_alloc((size_t)N * sizeof(float)), *dw = op_alloc((size_t)E * sizeof(float));
        op_rmsnorm_forward(y, rstd, x, w, N, E, 1e-5f);
        for (int pass = 0; pass < 2; pass++) {
            ops_synchronize();
            double t0 = now_seconds();
            for (int i = 0; i < 200; i++) op_rmsnorm_backward(dx, dw, y, x, w, rstd, N, E);
            ops_synchronize();
            s = (now_seconds() - t0) / 200;
        }
        report_bytes("rmsnorm backward (dx += , dw), queued", s, 4.0 * ne * a);
        return 0;
    }
    /* matmuls of a layer, and one lm_head chunk */
    int shapes[32][3] = {{N, E, 3 * E}, {N, E, E}, {N, E, 2 * H}, {N, H, E}, {4096, E, V}}, n_shapes = 5;
    /* BENCH_SHAPES="n,c,oc;...": those matmuls alone (e.g. a tensor-parallel rank's, whole and in row blocks) */
    const char *want = getenv("BENCH_SHAPES");
    if (want) {
        n_shapes = 0;
        for (const char *q = want; *q && n_shapes < 32;) {
            int *sh = shapes[n_shapes], used = 0;
            if (sscanf(q, "%d,%d,%d%n", &sh[0], &sh[1], &sh[2], &used) != 3 || sh[0] < 1 || sh[1] < 1 || sh[2] < 1)
                die(EXIT_BAD_INPUT, "BENCH_SHAPES=%s: not n,c,oc;n,c,oc...", want);
            n_shapes++, q += used;
            if (*q == ';') q++;
        }
    }
    for (int i = 0; i < (mem_only ? 0 : n_shapes); i++) {
        int n = shapes[i][0], c = shapes[i][1], oc = shapes[i][2];
        int ld = oc == V ? ops_logit_stride(V) : oc; /* the lm_head writes padded logit rows */
        void *x = rand_act((size_t)n * c, 1), *w = rand_act((size_t)oc * c, 0.02f), *y = rand_act((size_t)n * ld, 1);
        void *dx = rand_act((size_t)n * c, 1);
        float *dw = op_alloc((size_t)oc * c * sizeof(float));
        double f = 2.0 * n * c * oc;
        snprintf(what, sizeof what, "matmul fwd   %6d x %5d -> %5d", n, c, oc);
        TIME(s, op_matmul_forward_ld(y, ld, x, w, n, c, oc));
        report_flops(what, s, f);
        snprintf(what, sizeof what, "matmul dinp  %6d x %5d <- %5d", n, c, oc);
        TIME(s, op_matmul_backward_ld(dx, NULL, y, ld, x, w, n, c, oc));
        report_flops(what, s, f);
        snprintf(what, sizeof what, "matmul dw    %6d x %5d <- %5d", n, c, oc);
        TIME(s, op_matmul_backward_ld(NULL, dw, y, ld, x, w, n, c, oc));
        report_flops(what, s, f);
        op_free(x); op_free(w); op_free(y); op_free(dx); op_free(dw);
    }
    if (want) return 0;
    /* attention */
    {
        size_t nq = (size_t)N * 3 * E, no = (size_t)N * E;
        void *qkv = rand_act(nq, 1), *out = rand_act(no, 1), *dout = rand_act(no, 1), *dqkv = rand_act(nq, 1);
        float *lse = op_alloc((size_t)B * NH * T * sizeof(float));
        double f = 4.0 * B * NH * (double)T * T * HD / 2;
        if (!mem_only) {
            TIME(s, op_attention_forward(out, lse, qkv, B, T, NH, HD));
            report_flops("attention forward (causal FLOPs)", s, f);
            TIME(s, op_attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, HD));
            report_flops("attention backward (2.5x forward)", s, 2.5 * f);
        }
        float *cs = op_alloc((size_t)T * HD / 2 * sizeof(float)), *sn = op_alloc((size_t)T * HD / 2 * sizeof(float));
        op_rope_tables(cs, sn, T, HD, 10000.0f);
        TIME(s, op_rope_forward(qkv, cs, sn, B, T, NH, HD));
        report_bytes("rope forward (q, k read + written)", s, 2.0 * 2 * no * a);
        op_free(qkv); op_free(out); op_free(dout); op_free(dqkv); op_free(lse); op_free(cs); op_free(sn);
    }
    /* row ops and elementwise */
    {
        size_t ne = (size_t)N * E, nh = (size_t)N * H;
        void *x = rand_act(ne, 1), *y = rand_act(ne, 1), *w = rand_act(E, 1), *dx = rand_act(ne, 1);
        float *rstd = op_alloc((size_t)N * sizeof(float)), *dw = op_alloc((size_t)E * sizeof(float));
        TIME(s, op_rmsnorm_forward(y, rstd, x, w, N, E, 1e-5f));
        report_bytes("rmsnorm forward", s, 2.0 * ne * a);
        TIME(s, op_rmsnorm_backward(dx, dw, y, x, w, rstd, N, E));
        report_bytes("rmsnorm backward (dx += , dw)", s, 4.0 * ne * a);
        TIME(s, op_add(y, x, ne));
        report_bytes("add (residual)", s, 3.0 * ne * a);
        TIME(s, op_zero(dx, ne * a));
        report_bytes("zero", s, 1.0 * ne * a);
        void *gu = rand_act(2 * nh, 1), *h = rand_act(nh, 1), *dgu = rand_act(2 * nh, 1);
        TIME(s, op_swiglu_forward(h, gu, N, H));
        report_bytes("swiglu forward", s, 3.0 * nh * a);
        TIME(s, op_swiglu_backward(dgu, h, gu, N, H));
        report_bytes("swiglu backward (+=)", s, 7.0 * nh * a);
        op_free(x); op_free(y); op_free(w); op_free(dx); op_free(rstd); op_free(dw);
        op_free(gu); op_free(h); op_free(dgu);
        int rows = 4096;
        /* the lm_head's form: rows padded to ops_logit_stride(V) */
        int ldl = ops_logit_stride(V);
        void *logits = rand_act((size_t)rows * ldl, 2);
        int *tg = xmalloc(rows * sizeof(int));
        for (int i = 0; i < rows; i++) tg[i] = (int)(rng_u64(&rng) % V);
        int *dtg = op_alloc(rows * sizeof(int));
        op_upload(dtg, tg, rows * sizeof(int));
        float *losses = op_alloc(rows * sizeof(float));
        TIME(s, op_crossentropy_forward_backward_ld(losses, logits, ldl, dtg, rows, V, 0.0f));
        report_bytes("cross-entropy forward only, 4096 rows", s, 1.0 * rows * V * a);
        /* in place: from the second call on it runs on the first call's gradient (same work) */
        TIME(s, op_crossentropy_forward_backward_ld(losses, logits, ldl, dtg, rows, V, 1.0f / rows));
        report_bytes("cross-entropy fwd+bwd, 4096 rows", s, 2.0 * rows * V * a);
        op_free(logits); op_free(dtg); op_free(losses);
        free(tg);
    }
    /* the optimizer over 64M parameters (a quarter of the post's model): p, g, m, v read,
     * p, m, v written, in the state type */
    {
        size_t n = (size_t)64 << 20, st = ops_state_size();
        void *p = rand_state(n, 1, 0), *g = rand_state(n, 1, 0), *m = rand_state(n, 0.1f, 0), *v = rand_state(n, 0.01f, 1);
        int step = 1;
        TIME(s, op_adamw(p, g, m, v, n, 3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, step++, 1.0f));
        report_bytes(st == 2 ? "adamw 64M (bf16 state)" : "adamw 64M (fp32 state)", s, 7.0 * n * st);
        TIME(s, op_scale(g, n, 0.999f));
        report_bytes("scale 64M (state)", s, 2.0 * n * st);
        int was = graphed;
        graphed = 0;  /* it waits for its result */
        TIME(s, (void)op_sumsq(g, n));
        graphed = was;
        report_bytes("sumsq 64M (state, returns to host)", s, 1.0 * n * st);
        op_free(p); op_free(g); op_free(m); op_free(v);
    }
    return 0;
}
