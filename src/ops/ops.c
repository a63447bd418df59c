/* ops — the active backend and the op_* entry points, each one call through its table.
 * The backend is chosen once per process (ops_init) and never changes mid-run, so the
 * table pointer needs no synchronization. */
#include "ops.h"
#include "env.h"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "util.h"

static const OpsBackend *g_ops = &ops_backend_cpu;
static OpsPrecision g_prec = OPS_FP32;
static OpsOptions g_opts = {OPS_ATTN_AUTO, 1};

/* MESHTRAIN_PROFILE=1: every op waits for the device before and after, and its time is
 * added to its name's total; the table goes to stderr at exit. It slows the run (no
 * overlap of launches with work) but says where a step's time goes. The train loop resets it
 * after the first step, whose plans, autotuning and first touches are no step's cost.
 * MESHTRAIN_PROFILE=events (backends with device events): the same table from events the
 * device records around each op, with nothing waited for, so the ops run as in a real
 * step; an op's time then runs from where the one before ended, so it also holds any time
 * the device sat idle waiting for its launch (a launch-bound op shows as slow). */
#define PROF_MAX 40
#define PROF_PENDING 16384 /* events mode: ops timed before their spans are read */
static struct { const char *name; double s; long n; } g_prof[PROF_MAX];
static int g_prof_on, g_n_prof, g_prof_events, g_n_pend, g_pend[PROF_PENDING];
static double g_prof_t0;
static void prof_add(int i, double dt) {
    g_prof[i].s += dt;
    g_prof[i].n++;
}
static void prof_flush(void) {
    for (int k = 0; k < g_n_pend; k++) prof_add(g_pend[k], g_ops->prof_span(2 * k, 2 * k + 1));
    g_n_pend = 0;
}
static void prof_report(void) {
    if (g_prof_events) prof_flush();
    double total = 0;
    for (int i = 0; i < g_n_prof; i++) total += g_prof[i].s;
    fprintf(stderr, "ops profile (MESHTRAIN_PROFILE=%s, %s): %.3f s in ops\n", g_prof_events ? "events" : "1",
            g_ops->name, total);
    for (int i = 0; i < g_n_prof; i++)
        fprintf(stderr, "  %-34s %9.4f s %5.1f%% %8ld calls\n", g_prof[i].name, g_prof[i].s,
                total > 0 ? 100 * g_prof[i].s / total : 0.0, g_prof[i].n);
}
void ops_profile_reset(void) {
    if (g_prof_events) prof_flush();
    for (int i = 0; i < g_n_prof; i++) g_prof[i].s = 0, g_prof[i].n = 0;
}
/* Tuning picks algorithms by their timings, so only where the run need not be repeatable */
int op_tune_matmuls(char *report, size_t len) {
    return g_ops->tune_matmuls && !g_opts.deterministic ? g_ops->tune_matmuls(report, len) : -1;
}
int op_graph_begin(void) { return g_ops->graph_begin && !g_prof_on ? g_ops->graph_begin() : -1; }
OpsGraph *op_graph_end(void) { return g_ops->graph_end ? g_ops->graph_end() : NULL; }
int op_graph_run(OpsGraph *gr) { return gr ? g_ops->graph_run(gr) : -1; }
void op_graph_free(OpsGraph *gr) { if (gr) g_ops->graph_free(gr); }
static void prof_begin(void) {
    if (!g_prof_on) return;
    if (g_prof_events) {
        if (g_n_pend == PROF_PENDING) prof_flush();
        g_ops->prof_mark(2 * g_n_pend);
        return;
    }
    g_ops->synchronize();
    g_prof_t0 = now_seconds();
}
static void prof_end(const char *name) {
    if (!g_prof_on) return;
    double dt = 0;
    if (!g_prof_events) {
        g_ops->synchronize();
        dt = now_seconds() - g_prof_t0;
    }
    int i = 0;
    while (i < g_n_prof && strcmp(g_prof[i].name, name)) i++;
    if (i == g_n_prof) {
        if (g_n_prof == PROF_MAX) return;  /* (events mode: its begin mark is recorded again) */
        g_prof[g_n_prof++].name = name;
    }
    if (g_prof_events) {
        g_ops->prof_mark(2 * g_n_pend + 1);
        g_pend[g_n_pend++] = i;
    } else {
        prof_add(i, dt);
    }
}
#define PROF(name, call) do { prof_begin(); call; prof_end(name); } while (0)

int ops_init(const char *device, int n_threads, char *err, size_t errlen) {
    char dummy[1];
    if (!err || !errlen) err = dummy, errlen = sizeof dummy;
    const OpsBackend *b = NULL;
    if (!strcmp(device, "cpu")) b = &ops_backend_cpu;
#ifdef MESHTRAIN_CUDA
    else if (!strcmp(device, "cuda")) b = &ops_backend_cuda;
#else
    else if (!strcmp(device, "cuda"))
        return set_err(err, errlen, "this build has no CUDA support (nvcc was not found at build time)");
#endif
    else return set_err(err, errlen, "device=%s: unknown device (cpu or cuda)", device);
    if (b->init(n_threads, err, errlen)) return -1;
    g_ops = b;
    if (b->set_options) b->set_options(&g_opts);
    if (hook_on(HOOK_PROFILE) && !g_prof_on) {
        g_prof_on = 1;
        g_prof_events = !strcmp(hook_text(HOOK_PROFILE), "events") && b->prof_mark && b->prof_span;
        atexit(prof_report);
    }
    return 0;
}

void ops_set_options(const OpsOptions *o) {
    g_opts = *o;
    if (g_ops->set_options) g_ops->set_options(&g_opts);
}
OpsOptions ops_options(void) { return g_opts; }

const char *ops_backend_name(void) { return g_ops->name; }
const char *ops_device_name(void) { return g_ops->device_name(); }
int ops_host_memory(void) { return g_ops->host_memory; }
void ops_synchronize(void) { g_ops->synchronize(); }
int ops_idle(void) { return g_ops->idle ? g_ops->idle() : 1; }
void op_side_begin(void) { if (g_ops->side_begin) g_ops->side_begin(); }
void op_side_end(void) { if (g_ops->side_end) g_ops->side_end(); }
void op_side_mark(int k) { if (g_ops->side_mark) g_ops->side_mark(k); }
void op_side_wait(int k) { if (g_ops->side_wait) g_ops->side_wait(k); }
void ops_synchronize_main(void) { (g_ops->synchronize_main ? g_ops->synchronize_main : g_ops->synchronize)(); }
int ops_device_memory(size_t *free_bytes, size_t *total_bytes) {
    return g_ops->device_memory ? g_ops->device_memory(free_bytes, total_bytes) : -1;
}
int ops_device_peak(size_t *allocated, size_t *used) {
    return g_ops->device_peak ? g_ops->device_peak(allocated, used) : -1;
}

void *op_host_alloc(size_t bytes) {
    if (!bytes) return NULL;
    if (g_ops->host_alloc) return g_ops->host_alloc(bytes);
    void *p = NULL;
    if (posix_memalign(&p, 64, (bytes + 63) / 64 * 64)) return NULL;
    memset(p, 0, bytes);
    return p;
}
void op_host_free(void *p) {
    if (p) (g_ops->host_free ? g_ops->host_free : free)(p);
}
void op_copy_reserve(int n) { if (g_ops->copy_reserve) g_ops->copy_reserve(n); }
/* The cpu's: its buffers are host memory, so a copy either way is a memcpy (no PROF: the
 * worker thread calls op_copy_in, and the profile's table is the ops thread's). */
void op_copy_out(void *dst, const void *src, size_t bytes, int k) {
    if (!bytes) return;
    if (g_ops->copy_out) g_ops->copy_out(dst, src, bytes, k);
    else memcpy(dst, src, bytes);
}
void op_copy_in(void *dst, const void *src, size_t bytes, int k) {
    if (!bytes) return;
    if (g_ops->copy_in) g_ops->copy_in(dst, src, bytes, k);
    else memcpy(dst, src, bytes);
}
void op_copy_sync(int k, int in) { if (g_ops->copy_sync) g_ops->copy_sync(k, in); }
void op_copy_wait(int k, int in) { if (g_ops->copy_wait) g_ops->copy_wait(k, in); }
void op_copy_in_main(void *dst, const void *src, size_t bytes) {
    if (!bytes) return;
    if (g_ops->copy_in_main) g_ops->copy_in_main(dst, src, bytes);
    else memcpy(dst, src, bytes);
}
void *op_alloc(size_t bytes) { return bytes ? g_ops->alloc(bytes) : NULL; }
void op_free(void *p) { if (p) g_ops->free(p); }
void op_zero(void *p, size_t bytes) {
    if (bytes) PROF("zero", g_ops->zero(p, bytes));
}
void op_copy(void *dst, const void *src, size_t bytes) { if (bytes && dst != src) g_ops->copy(dst, src, bytes); }
void op_upload(void *dst, const void *src, size_t bytes) { if (bytes) g_ops->upload(dst, src, bytes); }
void op_download(void *dst, const void *src, size_t bytes) { if (bytes) g_ops->download(dst, src, bytes); }

int ops_set_precision(OpsPrecision p, char *err, size_t errlen) {
    char dummy[1];
    if (!err || !errlen) err = dummy, errlen = sizeof dummy;
    if (p != OPS_FP32 && !g_ops->set_precision)
        return set_err(err, errlen, "the %s backend computes in fp32 only", g_ops->name);
    if (g_ops->set_precision) g_ops->set_precision(p);
    g_prec = p;
    return 0;
}
OpsPrecision ops_precision(void) { return g_prec; }
int ops_bf16(void) { return g_prec != OPS_FP32; }
size_t ops_act_size(void) { return ops_act_size_of(g_prec); }
size_t ops_state_size(void) { return ops_state_size_of(g_prec); }

/* n bf16 in the first half of dst widen in place, from the back. */
static void widen_bf16(float *dst, size_t n) {
    const uint16_t *h = (const uint16_t *)dst;
    for (size_t i = n; i-- > 0;) dst[i] = bf16_widen(h[i]);
}
static void download_widen(const char *name, float *dst, const void *src, size_t n, int bf16) {
    if (!n) return;
    PROF(name, g_ops->download(dst, src, n * (bf16 ? 2 : 4)));
    if (bf16) widen_bf16(dst, n);
}
void op_download_act(float *dst, const void *src, size_t n) { download_widen("download_act", dst, src, n, ops_bf16()); }
void op_download_state(float *dst, const void *src, size_t n) {
    download_widen("download_state", dst, src, n, g_prec == OPS_BF16);
}
void op_upload_state(void *dst, const float *src, size_t n) {
    if (!n) return;
    if (g_prec != OPS_BF16) {
        g_ops->upload(dst, src, n * sizeof(float));
        return;
    }
    /* rounded in chunks through a small host buffer */
    enum { CH = 1 << 16 };
    uint16_t *h = xmalloc(CH * sizeof *h);
    for (size_t i0 = 0; i0 < n; i0 += CH) {
        size_t k = n - i0 < CH ? n - i0 : CH;
        for (size_t i = 0; i < k; i++) h[i] = bf16_round(src[i0 + i]);
        g_ops->upload((char *)dst + i0 * 2, h, k * 2);
    }
    free(h);
}
void op_to_act(void *dst, const float *src, size_t n) {
    if (n) PROF("to_act", g_ops->to_act(dst, src, n));
}

void op_embedding_forward(void *out, const int *tokens, const void *wte, int N, int C) {
    PROF("embedding_forward", g_ops->embedding_forward(out, tokens, wte, N, C));
}
void op_embedding_backward(void *dwte, const void *dout, const int *tokens, int N, int C) {
    PROF("embedding_backward", g_ops->embedding_backward(dwte, dout, tokens, N, C));
}
int embedding_rows_index(const int *tokens, int N, int V, int *count, int *out) {
    return embedding_rows_index_shard(tokens, N, 0, V, count, out);
}
int embedding_rows_index_shard(const int *tokens, int N, int lo, int V, int *count, int *out) {
    memset(count, 0, (size_t)V * sizeof *count);
#define MINE(t) ((unsigned)((t) - lo) < (unsigned)V)
    for (int n = 0; n < N; n++)
        if (MINE(tokens[n])) count[tokens[n] - lo]++;
    int nr = 0;
    for (int v = 0; v < V; v++) nr += count[v] > 0;
    int *rows = out, *off = out + nr, *pos = off + nr + 1, k = 0, o = 0;
    for (int v = 0; v < V; v++)
        if (count[v]) {
            rows[k] = v;
            off[k++] = o;
            o += count[v];
            count[v] = off[k - 1];  /* from here: where v's next position goes */
        }
    off[nr] = o;
    for (int n = 0; n < N; n++)
        if (MINE(tokens[n])) pos[count[tokens[n] - lo]++] = n;
#undef MINE
    return nr;
}
void op_embedding_forward_shard(void *out, const int *tokens, const void *wte, int N, int C, int lo, int rows) {
    PROF("embedding_forward", g_ops->embedding_forward_shard(out, tokens, wte, N, C, lo, rows));
}
void op_embedding_backward_rows(void *dwte, const void *dout, const int *idx, int nr, int N, int C) {
    PROF("embedding_backward", g_ops->embedding_backward_rows(dwte, dout, idx, nr, N, C));
}
void op_rmsnorm_forward(void *out, float *rstd, const void *x, const void *w, int N, int C, float eps) {
    PROF("rmsnorm_forward", g_ops->rmsnorm_forward(out, rstd, x, w, N, C, eps));
}
void op_add_rmsnorm_forward(void *res, void *out, float *rstd, const void *branch, const void *w, int N, int C,
                            float eps) {
    PROF("add_rmsnorm_forward", g_ops->add_rmsnorm_forward(res, out, rstd, branch, w, N, C, eps));
}
void op_rmsnorm_backward(void *dx, void *dw, const void *dout, const void *x, const void *w, const float *rstd,
                         int N, int C) {
    PROF("rmsnorm_backward", g_ops->rmsnorm_backward(dx, dw, dout, x, w, rstd, N, C));
}
void op_matmul_forward(void *out, const void *inp, const void *w, int N, int C, int OC) {
    PROF("matmul_forward", g_ops->matmul_forward(out, OC, inp, w, N, C, OC));
}
void op_matmul_forward_add(void *out, const void *inp, const void *w, const void *res, int N, int C, int OC) {
    if (g_ops->matmul_forward_add) {
        PROF("matmul_forward (+ residual)", g_ops->matmul_forward_add(out, inp, w, res, N, C, OC));
        return;
    }
    op_matmul_forward(out, inp, w, N, C, OC);
    op_add(out, res, (size_t)N * OC);
}
void op_matmul_forward_ld(void *out, int ldo, const void *inp, const void *w, int N, int C, int OC) {
    PROF("matmul_forward (lm_head)", g_ops->matmul_forward(out, ldo, inp, w, N, C, OC));
}
/* the profile's names: which of the two products a call makes */
static const char *mm_bwd_name(const void *dinp, const void *dw) {
    return dinp && dw ? "matmul_backward (dinp, dw)" : dw ? "matmul_backward (dw)" : "matmul_backward (dinp)";
}
int ops_logit_stride(int V) { return (V + 63) / 64 * 64; }
void op_matmul_backward(void *dinp, void *dw, const void *dout, const void *inp, const void *w, int N, int C,
                        int OC) {
    PROF(mm_bwd_name(dinp, dw), g_ops->matmul_backward(dinp, dw, dout, OC, inp, w, N, C, OC, 1));
}
void op_matmul_backward_set(void *dinp, void *dw, const void *dout, const void *inp, const void *w, int N, int C,
                            int OC) {
    PROF(mm_bwd_name(dinp, dw), g_ops->matmul_backward(dinp, dw, dout, OC, inp, w, N, C, OC, 0));
}
void op_matmul_backward_add(void *dinp, const void *dout, const void *w, const void *res, int N, int C, int OC) {
    if (g_ops->matmul_backward_add) {
        PROF("matmul_backward (+ sum)", g_ops->matmul_backward_add(dinp, dout, w, res, N, C, OC));
        return;
    }
    op_matmul_backward_set(dinp, NULL, dout, NULL, w, N, C, OC);
    op_add(dinp, res, (size_t)N * C);
}
void op_matmul_backward_ld(void *dinp, void *dw, const void *dout, int ldo, const void *inp, const void *w, int N,
                           int C, int OC) {
    PROF("matmul_backward (lm_head)", g_ops->matmul_backward(dinp, dw, dout, ldo, inp, w, N, C, OC, 1));
}
void op_rope_tables(float *cos_t, float *sin_t, int T, int HD, float base) {
    g_ops->rope_tables(cos_t, sin_t, T, HD, base);
}
void op_rope_forward(void *qkv, const float *cos_t, const float *sin_t, int B, int T, int NH, int HD) {
    PROF("rope_forward", g_ops->rope_forward(qkv, cos_t, sin_t, B, T, NH, HD));
}
void op_rope_backward(void *dqkv, const float *cos_t, const float *sin_t, int B, int T, int NH, int HD) {
    PROF("rope_backward", g_ops->rope_backward(dqkv, cos_t, sin_t, B, T, NH, HD));
}
void op_attention_forward(void *out, float *lse, const void *qkv, int B, int T, int NH, int HD) {
    PROF("attention_forward", g_ops->attention_forward(out, lse, qkv, B, T, NH, HD));
}
void op_attention_backward(void *dqkv, const void *dout, const void *qkv, const void *out, const float *lse,
                           int B, int T, int NH, int HD) {
    PROF("attention_backward", g_ops->attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, HD, 1));
}
void op_attention_backward_set(void *dqkv, const void *dout, const void *qkv, const void *out, const float *lse,
                               int B, int T, int NH, int HD) {
    PROF("attention_backward", g_ops->attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, HD, 0));
}
void op_attention_rope_backward_set(void *dqkv, const void *dout, const void *qkv, const void *out,
                                    const float *lse, const float *cos_t, const float *sin_t, int B, int T, int NH,
                                    int HD) {
    if (g_ops->attention_rope_backward) {
        PROF("attention_backward", g_ops->attention_rope_backward(dqkv, dout, qkv, out, lse, cos_t, sin_t, B, T, NH, HD));
        return;
    }
    op_attention_backward_set(dqkv, dout, qkv, out, lse, B, T, NH, HD);
    op_rope_backward(dqkv, cos_t, sin_t, B, T, NH, HD);
}
void op_swiglu_forward(void *out, const void *gu, int N, int H) {
    PROF("swiglu_forward", g_ops->swiglu_forward(out, gu, N, H));
}
void op_swiglu_backward(void *dgu, const void *dout, const void *gu, int N, int H) {
    PROF("swiglu_backward", g_ops->swiglu_backward(dgu, dout, gu, N, H, 1));
}
void op_swiglu_backward_set(void *dgu, const void *dout, const void *gu, int N, int H) {
    PROF("swiglu_backward", g_ops->swiglu_backward(dgu, dout, gu, N, H, 0));
}
void op_crossentropy_forward_backward(float *losses, void *logits, const int *targets, int N, int V,
                                      float dlogits_scale) {
    PROF("crossentropy_forward_backward",
         g_ops->crossentropy_forward_backward(losses, logits, V, targets, N, V, dlogits_scale));
}
void op_crossentropy_forward_backward_ld(float *losses, void *logits, int ld, const int *targets, int N, int V,
                                         float dlogits_scale) {
    PROF("crossentropy_forward_backward",
         g_ops->crossentropy_forward_backward(losses, logits, ld, targets, N, V, dlogits_scale));
}
void op_crossentropy_shard_stats(float *stats, const void *logits, int ld, const int *targets, int N, int V, int v0) {
    PROF("crossentropy_forward_backward", g_ops->crossentropy_shard_stats(stats, logits, ld, targets, N, V, v0));
}
void op_crossentropy_shard_backward(float *losses, void *logits, int ld, const int *targets, int N, int V, int v0,
                                    const float *stats, int t, float dlogits_scale) {
    PROF("crossentropy_forward_backward",
         g_ops->crossentropy_shard_backward(losses, logits, ld, targets, N, V, v0, stats, t, dlogits_scale));
}
void op_adamw(void *param, const void *grad, void *m, void *v, size_t n, float lr, float beta1, float beta2,
              float eps, float weight_decay, int step, float grad_scale) {
    PROF("adamw", g_ops->adamw(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, step, grad_scale));
}
void op_adamw_cast(void *param, const void *grad, void *m, void *v, size_t n, float lr, float beta1, float beta2,
                   float eps, float weight_decay, int step, float grad_scale, void *act) {
    if (ops_state_size() != sizeof(float)) die(EXIT_RUN_FAILURE, "internal: op_adamw_cast needs fp32 state");
    if (g_ops->adamw_cast) {
        PROF("adamw", g_ops->adamw_cast(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, step, grad_scale,
                                        act));
        return;
    }
    op_adamw(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, step, grad_scale);
    op_to_act(act, param, n);
}
void op_adafactor_sums(float *sums, const void *grad, const AdafactorSeg *s, float grad_scale) {
    if (s->n) PROF("adafactor", g_ops->adafactor_sums(sums, grad, s, grad_scale));
}
void op_adafactor_stats(float *stat, float *fac, const float *sums, int rows, int cols, float beta2t, float eps1) {
    PROF("adafactor", g_ops->adafactor_stats(stat, fac, sums, rows, cols, beta2t, eps1));
}
void op_adafactor_rms(double *out, const void *param, const void *grad, const float *fac, const AdafactorSeg *s,
                      float grad_scale) {
    if (!s->n) op_zero(out, 2 * sizeof(double));
    else PROF("adafactor", g_ops->adafactor_rms(out, param, grad, fac, s, grad_scale));
}
void op_adafactor_update(void *param, const void *grad, void *m, const float *fac, const AdafactorSeg *s,
                         float grad_scale, float coef, float decay, float beta1) {
    if (s->n) PROF("adafactor", g_ops->adafactor_update(param, grad, m, fac, s, grad_scale, coef, decay, beta1));
}
double op_sumsq(const void *x, size_t n) {
    double r;
    PROF("sumsq", r = g_ops->sumsq(x, n));
    return r;
}
void op_scale(void *x, size_t n, float s) {
    PROF("scale", g_ops->scale(x, n, s));
}
void op_add(void *y, const void *x, size_t n) {
    PROF("add", g_ops->add(y, x, n));
}
void op_sum_parts(void *y, const void *const *x, int k, size_t n) {
    if (k < 1 || k > OPS_SUM_PARTS) die(EXIT_RUN_FAILURE, "internal: op_sum_parts of %d parts (1 to %d)", k, OPS_SUM_PARTS);
    PROF("sum_parts", g_ops->sum_parts(y, x, k, n));
}
void op_gather_rows(void *dst, const void *src, const int *rows, size_t n, size_t row_bytes) {
    if (n && row_bytes) PROF("copy_rows", g_ops->copy_rows(dst, src, rows, n, row_bytes, 0));
}
void op_scatter_rows(void *dst, const void *src, const int *rows, size_t n, size_t row_bytes) {
    if (n && row_bytes) PROF("copy_rows", g_ops->copy_rows(dst, src, rows, n, row_bytes, 1));
}

/* ---- mixture of experts ---- */
static void moe_need(const void *fn, const char *name) {
    if (!fn) die(EXIT_RUN_FAILURE, "internal: the %s backend has no %s", g_ops->name, name);
}
#define MOE_CALL(fn, name, args)                      \
    do {                                              \
        moe_need((const void *)g_ops->fn, #fn);       \
        PROF(name, g_ops->fn args);                   \
    } while (0)
void op_moe_router_forward(float *logits, const void *x, const void *w, int N, int E, int X) {
    if (N > 0) MOE_CALL(moe_router_forward, "moe_router", (logits, x, w, N, E, X));
}
void op_moe_router_backward(void *dx, void *dw, const float *dlogits, const void *x, const void *w, int N, int E,
                            int X) {
    if (N > 0) MOE_CALL(moe_router_backward, "moe_router_backward", (dx, dw, dlogits, x, w, N, E, X));
}
void op_moe_topk(float *probs, int *idx, float *gate, float *lse, const float *logits, const float *bias, int N,
                 int X, int k, int sigmoid) {
    if (k < 1 || k > X) die(EXIT_RUN_FAILURE, "internal: op_moe_topk: top %d of %d experts", k, X);
    if (N > 0) MOE_CALL(moe_topk, "moe_route", (probs, idx, gate, lse, logits, bias, N, X, k, sigmoid));
}
void op_moe_dispatch(int *cnt, int *pos, int *rowtok, float *gate_rows, const int *idx, const float *gate, int N,
                     int k, int X, int capacity) {
    MOE_CALL(moe_dispatch, "moe_route", (cnt, pos, rowtok, gate_rows, idx, gate, N, k, X, capacity));
}
void op_moe_stats(float *stats, const int *cnt, const float *probs, const float *lse, int N, int X) {
    MOE_CALL(moe_stats, "moe_route", (stats, cnt, probs, lse, N, X));
}
void op_moe_route_backward(float *dlogits, const float *dgate_rows, const int *pos, const float *logits,
                           const float *probs, const int *idx, const float *gate, const float *lse, const float *stats,
                           float aux_scale, float z_scale, int N, int X, int k, int sigmoid) {
    if (N > 0)
        MOE_CALL(moe_route_backward, "moe_route_backward",
                 (dlogits, dgate_rows, pos, logits, probs, idx, gate, lse, stats, aux_scale, z_scale, N, X, k, sigmoid));
}
void op_moe_matmul_forward(void *out, const void *inp, const void *w, size_t wstride, const int *off, int X, int C,
                           int OC) {
    if (off[X] > 0) MOE_CALL(moe_matmul_forward, "moe_matmul_forward", (out, inp, w, wstride, off, X, C, OC));
}
void op_moe_matmul_backward(void *dinp, void *dw, size_t wstride, const void *dout, const void *inp, const void *w,
                            const int *off, int X, int C, int OC) {
    if (off[X] > 0)
        MOE_CALL(moe_matmul_backward, "moe_matmul_backward", (dinp, dw, wstride, dout, inp, w, off, X, C, OC));
}
void op_moe_combine(void *out, const void *ys, const float *gate, const int *pos, int N, int k, int E) {
    if (N > 0) MOE_CALL(moe_combine, "moe_combine", (out, ys, gate, pos, N, k, E));
}
void op_moe_unpermute(void *dx, const void *dxs, const int *pos, int N, int k, int E, int acc) {
    if (N > 0) MOE_CALL(moe_unpermute, "moe_combine_backward", (dx, dxs, pos, N, k, E, acc));
}
void op_moe_gate_backward(float *dgate_rows, void *h, void *dh, const float *gate_rows, int P, int H) {
    if (P > 0) MOE_CALL(moe_gate_backward, "moe_combine_backward", (dgate_rows, h, dh, gate_rows, P, H));
}
void op_moe_accumulate(float *acc, const float *stats, int rows, int X, int k) {
    MOE_CALL(moe_accumulate, "moe_route", (acc, stats, rows, X, k));
}
#undef MOE_CALL
