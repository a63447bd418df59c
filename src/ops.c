/* ops — the active backend and the op_* entry points, each one call through its table.
 * The backend is chosen once per process (ops_init) and never changes mid-run, so the
 * table pointer needs no synchronization. */
#include "ops.h"
#include <stdio.h>
#include <string.h>
#include "util.h"

static const OpsBackend *g_ops = &ops_backend_cpu;

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
    return 0;
}

const char *ops_backend_name(void) { return g_ops->name; }
const char *ops_device_name(void) { return g_ops->device_name(); }
int ops_host_memory(void) { return g_ops->host_memory; }
void ops_synchronize(void) { g_ops->synchronize(); }
int ops_device_memory(size_t *free_bytes, size_t *total_bytes) {
    return g_ops->device_memory ? g_ops->device_memory(free_bytes, total_bytes) : -1;
}
int ops_device_peak(size_t *allocated, size_t *used) {
    return g_ops->device_peak ? g_ops->device_peak(allocated, used) : -1;
}

void *op_alloc(size_t bytes) { return bytes ? g_ops->alloc(bytes) : NULL; }
void op_free(void *p) { if (p) g_ops->free(p); }
void op_zero(void *p, size_t bytes) { if (bytes) g_ops->zero(p, bytes); }
void op_copy(void *dst, const void *src, size_t bytes) { if (bytes && dst != src) g_ops->copy(dst, src, bytes); }
void op_upload(void *dst, const void *src, size_t bytes) { if (bytes) g_ops->upload(dst, src, bytes); }
void op_download(void *dst, const void *src, size_t bytes) { if (bytes) g_ops->download(dst, src, bytes); }

void op_embedding_forward(float *out, const int *tokens, const float *wte, int N, int C) {
    g_ops->embedding_forward(out, tokens, wte, N, C);
}
void op_embedding_backward(float *dwte, const float *dout, const int *tokens, int N, int C) {
    g_ops->embedding_backward(dwte, dout, tokens, N, C);
}
void op_rmsnorm_forward(float *out, float *rstd, const float *x, const float *w, int N, int C, float eps) {
    g_ops->rmsnorm_forward(out, rstd, x, w, N, C, eps);
}
void op_rmsnorm_backward(float *dx, float *dw, const float *dout, const float *x, const float *w, const float *rstd,
                         int N, int C) {
    g_ops->rmsnorm_backward(dx, dw, dout, x, w, rstd, N, C);
}
void op_matmul_forward(float *out, const float *inp, const float *w, int N, int C, int OC) {
    g_ops->matmul_forward(out, inp, w, N, C, OC);
}
void op_matmul_backward(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int N, int C,
                        int OC) {
    g_ops->matmul_backward(dinp, dw, dout, inp, w, N, C, OC);
}
void op_rope_tables(float *cos_t, float *sin_t, int T, int HD, float base) {
    g_ops->rope_tables(cos_t, sin_t, T, HD, base);
}
void op_rope_forward(float *qkv, const float *cos_t, const float *sin_t, int B, int T, int NH, int HD) {
    g_ops->rope_forward(qkv, cos_t, sin_t, B, T, NH, HD);
}
void op_rope_backward(float *dqkv, const float *cos_t, const float *sin_t, int B, int T, int NH, int HD) {
    g_ops->rope_backward(dqkv, cos_t, sin_t, B, T, NH, HD);
}
void op_attention_forward(float *out, float *lse, const float *qkv, int B, int T, int NH, int HD) {
    g_ops->attention_forward(out, lse, qkv, B, T, NH, HD);
}
void op_attention_backward(float *dqkv, const float *dout, const float *qkv, const float *out, const float *lse,
                           int B, int T, int NH, int HD) {
    g_ops->attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, HD);
}
void op_swiglu_forward(float *out, const float *gu, int N, int H) { g_ops->swiglu_forward(out, gu, N, H); }
void op_swiglu_backward(float *dgu, const float *dout, const float *gu, int N, int H) {
    g_ops->swiglu_backward(dgu, dout, gu, N, H);
}
void op_crossentropy_forward_backward(float *losses, float *logits, const int *targets, int N, int V,
                                      float dlogits_scale) {
    g_ops->crossentropy_forward_backward(losses, logits, targets, N, V, dlogits_scale);
}
void op_adamw(float *param, const float *grad, float *m, float *v, size_t n, float lr, float beta1, float beta2,
              float eps, float weight_decay, int step, float grad_scale) {
    g_ops->adamw(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, step, grad_scale);
}
double op_sumsq(const float *x, size_t n) { return g_ops->sumsq(x, n); }
void op_scale(float *x, size_t n, float s) { g_ops->scale(x, n, s); }
void op_add(float *y, const float *x, size_t n) { g_ops->add(y, x, n); }
