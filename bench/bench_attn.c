/* bench_attn — causal attention in bf16 (precision=mixed) through the ops interface, under each
 * choice of the keys attention and deterministic (ops_set_options): our tensor-core kernels ("own":
 * attention=own, attn_bf16.cu), cuDNN's fused flash attention ("cudnn": attention=cudnn
 * deterministic=false, attn_cudnn.cu; "cudnn-det": attention=cudnn, its deterministic backward), the
 * default ("auto", whichever runs: our Hopper backward attn_wgmma_bwd.cu where auto takes it) and
 * "fast" (deterministic=false: auto's choices, the Hopper kernel's atomic dQ where it runs), forward
 * (op_attention_forward) and backward (op_attention_backward_set, what a layer calls), at the shapes
 * given as B:NH:T:HD arguments (default: the shapes in main, T = 256 to 10000). TFLOP/s count
 * causal FLOPs, 4 B NH T^2 HD / 2 forward and 2.5x that backward, as bench_ops_cuda does. Each figure is timed two ways after warm-up: "loop", the
 * median of 7 timings of back-to-back calls (about 50 ms each: every gap between calls and every
 * small kernel counted), and "events", as attn_torch.py's do_bench: the median of 100 calls each
 * between two CUDA events, the L2 cache cleared before each (256 MB zeroed outside the events).
 * The first call's time (cuDNN builds its plan there) is printed apart. Prints one line per
 * figure:
 *   RESULT <impl> <fwd|bwd> <B> <NH> <T> <HD> <ms> <TFLOP/s> <loop|events>
 * and "SKIP <impl> ..." where an implementation does not run a shape. Needs a GPU. */
#include "attn_cudnn.h"
#include "ops.h"
#include "ops_cuda.h"
#include "util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static Rng rng;

static void *rand_act(size_t n) {
    size_t blk = ((size_t)1 << 20) + 7, m = n < blk ? n : blk;
    float *h = xmalloc(n * sizeof(float));
    for (size_t i = 0; i < m; i++) h[i] = rng_normal(&rng);
    for (size_t i = m; i < n; i += blk) memcpy(h + i, h, (n - i < blk ? n - i : blk) * sizeof(float));
    float *d = op_alloc(n * sizeof(float));
    op_upload(d, h, n * sizeof(float));
    void *a = op_alloc(n * ops_act_size());
    op_to_act(a, d, n);
    op_free(d);
    free(h);
    return a;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

typedef struct {
    void *qkv, *dout, *out, *dqkv;
    float *lse;
    int B, T, NH, HD, backward;
} Call;

static void call(const Call *c) {
    if (c->backward) op_attention_backward_set(c->dqkv, c->dout, c->qkv, c->out, c->lse, c->B, c->T, c->NH, c->HD);
    else op_attention_forward(c->out, c->lse, c->qkv, c->B, c->T, c->NH, c->HD);
}

/* the host's seconds per call while queueing the last timing's calls (time_call): near the
 * call's time on the GPU, the loop measures the host */
static double host_per_call;

/* median seconds per call */
static double time_call(const Call *c) {
    for (int i = 0; i < 3; i++) call(c);
    ops_synchronize();
    double t0 = now_seconds();
    call(c);
    ops_synchronize();
    int reps = (int)(0.05 / (now_seconds() - t0 + 1e-9)) + 1;
    if (reps > 1000) reps = 1000;
    double ts[7];
    for (int k = 0; k < 7; k++) {
        t0 = now_seconds();
        for (int i = 0; i < reps; i++) call(c);
        host_per_call = (now_seconds() - t0) / reps;
        ops_synchronize();
        ts[k] = (now_seconds() - t0) / reps;
    }
    qsort(ts, 7, sizeof ts[0], cmp_double);
    return ts[3];
}

static void call_arg(const void *c) { call((const Call *)c); }

/* median seconds per call, each between CUDA events after an L2 flush (do_bench's way) */
#define EVENT_CALLS 100
static double time_call_events(const Call *c) {
    float ms[EVENT_CALLS];
    cuda_event_times_ms(call_arg, c, EVENT_CALLS, (size_t)256 << 20, ms);
    qsort(ms, EVENT_CALLS, sizeof ms[0], cmp_float);
    return 0.5e-3 * (ms[EVENT_CALLS / 2 - 1] + ms[EVENT_CALLS / 2]);
}

static void bench_shape(int B, int NH, int T, int HD) {
    size_t C = (size_t)NH * HD, nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C;
    Call c = {rand_act(nqkv), rand_act(nout), op_alloc(nout * 2), op_alloc(nqkv * 2),
              op_alloc((size_t)B * NH * T * sizeof(float)), B, T, NH, HD, 0};
    const double flops = 4.0 * B * NH * (double)T * T * HD / 2;
    /* auto and fast: whichever they run on (fast's forward is auto's); runs: the kernels the others
     * must run on, else the shape is skipped */
    static const char *impls[] = {"own", "cudnn", "cudnn-det", "auto", "fast"},
                      *runs[] = {"own", "cudnn", "cudnn", NULL, NULL};
    static const OpsOptions opts[] = {{OPS_ATTN_OWN, 1}, {OPS_ATTN_CUDNN, 0}, {OPS_ATTN_CUDNN, 1},
                                      {OPS_ATTN_AUTO, 1}, {OPS_ATTN_AUTO, 0}};
    for (int m = 0; m < 5; m++) {
        ops_set_options(&opts[m]);
        for (int bw = m == 2 || m == 4; bw < 2; bw++) { /* cudnn-det's forward is cudnn's, fast's auto's */
            double tp = now_seconds();
            const char *ran = cuda_attention_impl(bw, B, T, NH, HD); /* builds cuDNN's plan */
            tp = now_seconds() - tp;
            size_t ws = 0;
            if ((m == 1 || m == 2) && (bw ? attn_cudnn_backward_plan(B, T, NH, HD, m == 2, &ws, NULL, 0)
                         : attn_cudnn_forward_plan(B, T, NH, HD, &ws, NULL, 0)) == 0)
                printf("info %s %s B=%d NH=%d T=%d HD=%d: plan built in %.0f ms, workspace %zu bytes (dP %zu)\n",
                       impls[m], bw ? "bwd" : "fwd", B, NH, T, HD, tp * 1e3, ws, attn_cudnn_det_dp_bytes(B, T, NH));
            if (runs[m] && strcmp(ran, runs[m])) {
                printf("SKIP %s %s %d %d %d %d (runs on %s)\n", impls[m], bw ? "bwd" : "fwd", B, NH, T, HD, ran);
                continue;
            }
            c.backward = bw;
            if (bw) { /* out and lse from this implementation's forward */
                c.backward = 0;
                call(&c);
                c.backward = 1;
            }
            double t0 = now_seconds();
            call(&c); /* cuDNN builds its plan in cuda_attention_impl; this is the first execution */
            ops_synchronize();
            double first = now_seconds() - t0, s = time_call(&c), se = time_call_events(&c);
            double f = bw ? 2.5 * flops : flops;
            printf("RESULT %s %s %d %d %d %d %.4f %.1f loop\n", impls[m], bw ? "bwd" : "fwd", B, NH, T, HD, s * 1e3,
                   f / s * 1e-12);
            printf("RESULT %s %s %d %d %d %d %.4f %.1f events\n", impls[m], bw ? "bwd" : "fwd", B, NH, T, HD,
                   se * 1e3, f / se * 1e-12);
            printf("info %s %s B=%d NH=%d T=%d HD=%d (on %s): first call %.1f ms; the host %.1f us a call queueing the "
                   "loop (%.0f%% of its time)\n", impls[m], bw ? "bwd" : "fwd", B, NH, T, HD, ran, first * 1e3,
                   host_per_call * 1e6, 100 * host_per_call / s);
            fflush(stdout);
        }
    }
    ops_set_options(&opts[3]);
    printf("info auto B=%d NH=%d T=%d HD=%d: forward %s, backward %s\n", B, NH, T, HD,
           cuda_attention_impl(0, B, T, NH, HD), cuda_attention_impl(1, B, T, NH, HD));
    op_free(c.qkv), op_free(c.dout), op_free(c.out), op_free(c.dqkv), op_free(c.lse);
}

int main(int argc, char **argv) {
    char err[256];
    if (ops_init("cuda", 0, err, sizeof err) || ops_set_precision(OPS_MIXED, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    rng_seed(&rng, 20);
    char why[256] = "";
    if (attn_cudnn_available(why, sizeof why)) printf("info cuDNN %zu on %s\n", attn_cudnn_version(), ops_device_name());
    else printf("info cuDNN unavailable: %s\n", why);
    static const int def[][4] = {{128, 8, 256, 128}, {32, 8, 1024, 128}, {8, 8, 4096, 128},
                                 {2, 8, 10000, 128}, {8, 16, 4096, 64},  {16, 16, 1024, 128}};
    if (argc > 1) {
        for (int i = 1; i < argc; i++) {
            int B, NH, T, HD;
            if (sscanf(argv[i], "%d:%d:%d:%d", &B, &NH, &T, &HD) != 4 || B <= 0 || NH <= 0 || T <= 0 || HD <= 0) {
                fprintf(stderr, "bench_attn: expected B:NH:T:HD, got %s\n", argv[i]);
                return 2;
            }
            bench_shape(B, NH, T, HD);
        }
    } else
        for (size_t i = 0; i < sizeof def / sizeof def[0]; i++) bench_shape(def[i][0], def[i][1], def[i][2], def[i][3]);
    return 0;
}
