/* ops_cuda — the CUDA backend of the ops interface (fp32, mixed, or pure bf16).
 *
 * Every cuda_<name> has the same arguments and semantics as op_<name> in ops.h, with all
 * tensor pointers being DEVICE pointers: row-major, nn.Linear weight layout, backward ops
 * accumulate (+=) into their gradients, a NULL gradient pointer skips that gradient, and
 * every op is deterministic (no float atomics; fixed reduction orders that depend only on
 * the shapes, never on the card) unless the options say otherwise (OpsOptions in ops.h). Ops run asynchronously on the backend's one stream;
 * only cuda_sumsq and the copies to the host wait for it.
 *
 * Errors: a failing CUDA or cuBLASLt call prints
 *   "meshtrain: cuda: <call> failed: <error string> (file:line)"
 * and exits with status 1. Set MESHTRAIN_CUDA_SYNC=1 to synchronize after every kernel, so
 * that an asynchronous fault is reported at the kernel that caused it.
 *
 * This is a plain C header: the implementation (ops_cuda.cu) gives every function C linkage.
 * The trainer does not call these directly: ops_cuda.cu also defines ops_backend_cuda
 * (ops.h), the table through which op_* reaches them after ops_init("cuda", ...).
 */
#ifndef MESHTRAIN_OPS_CUDA_H
#define MESHTRAIN_OPS_CUDA_H
#include <stddef.h>
#include "ops.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- backend state and memory ------------------------------------------------------ */

/* Selects `device`, creates the stream, the cuBLASLt handle and its workspace. 0 on
 * success; -1 with a message in err (no device, bad index, ...). */
int cuda_init(int device, char *err, size_t errlen);
void cuda_shutdown(void);
const char *cuda_device_name(void);   /* "" before cuda_init */
void *cuda_stream(void);              /* the backend's cudaStream_t, for comm overlap later */
/* For benchmarks: n calls of fn(arg), each timed on the stream by a pair of CUDA events, with
 * `flush` bytes (0: none) zeroed before each outside its pair, to clear the L2 cache, as
 * Triton's do_bench does; the host queues all n before waiting once. ms[i]: call i's time. */
void cuda_event_times_ms(void (*fn)(const void *), const void *arg, int n, size_t flush, float *ms);
/* Matmuls in TF32 (faster, ~1e-3 relative error) instead of exact fp32. Default off. */
void cuda_set_tf32(int on);

/* Dies (exit 2, like xmalloc) with the size and the card's free memory on failure.
 * cuda_malloc(0) returns NULL. */
void *cuda_malloc(size_t bytes);
void cuda_free(void *p);
/* Device memory allocated outside cuda_malloc (NCCL's registrable buffers), counted in the
 * high-water marks below all the same. */
void cuda_note_alloc(void *p, size_t bytes);
void cuda_note_free(void *p);
/* dst[i] = s * (src[i] + src[c + i] + ... + src[(D - 1) c + i]) for i < c, summed in fp32 in that
 * order, on `stream` (a cudaStream_t: the communication stream); bf16 buffers when bf16. */
void cuda_sum_blocks(void *dst, const void *src, size_t c, int D, float s, int bf16, void *stream);
/* Synchronous with respect to the host: they return when the copy is done. */
void cuda_memcpy_h2d(void *dst, const void *src, size_t bytes);
void cuda_memcpy_d2h(void *dst, const void *src, size_t bytes);
void cuda_memcpy_d2d(void *dst, const void *src, size_t bytes); /* asynchronous, on the stream */
void cuda_memset_zero(void *p, size_t bytes); /* asynchronous, on the stream */
/* High-water marks since the process started: of the bytes cuda_malloc holds, and of the
 * card's used memory (total - free) as seen after each allocation (the CUDA context and
 * other processes included). */
void cuda_memory_peak(size_t *allocated, size_t *used);
int cuda_memory_info(size_t *free_bytes, size_t *total_bytes); /* 0, or -1 */
int cuda_idle(void);
void cuda_synchronize(void);

/* ---- ops (see ops.h for the semantics of each) ---------------------------------------- */

/* fp32, mixed (bf16 activations and compute weights) or bf16 (the parameter state too); see ops.h. */
void cuda_set_precision(OpsPrecision p);
void cuda_to_act(void *dst, const float *src, size_t n);

void cuda_embedding_forward(void *out, const int *tokens, const void *wte, int N, int C);
void cuda_embedding_backward_rows(void *dwte, const void *dout, const int *idx, int nr, int N, int C);
void cuda_embedding_forward_shard(void *out, const int *tokens, const void *wte, int N, int C, int lo, int rows);
void cuda_embedding_backward(void *dwte, const void *dout, const int *tokens, int N, int C);

void cuda_add_rmsnorm_forward(void *res, void *out, float *rstd, const void *branch, const void *w, int N, int C,
                              float eps);
void cuda_rmsnorm_forward(void *out, float *rstd, const void *x, const void *w, int N, int C, float eps);
void cuda_rmsnorm_backward(void *dx, void *dw, const void *dout, const void *x, const void *w,
                           const float *rstd, int N, int C);

/* out's (dout's) rows are ldo >= OC elements apart */
void cuda_matmul_forward(void *out, int ldo, const void *inp, const void *w, int N, int C, int OC);
void cuda_matmul_forward_add(void *out, const void *inp, const void *w, const void *res, int N, int C, int OC);
void cuda_matmul_backward_add(void *dinp, const void *dout, const void *w, const void *res, int N, int C, int OC);
void cuda_matmul_backward(void *dinp, void *dw, const void *dout, int ldo, const void *inp, const void *w,
                          int N, int C, int OC, int acc);

/* Computed on the host exactly as op_rope_tables does, then copied into the device arrays
 * cos_t and sin_t ([T, HD/2] each), so both backends use bitwise the same tables. */
void cuda_rope_tables(float *cos_t, float *sin_t, int T, int HD, float base);
void cuda_rope_forward(void *qkv, const float *cos_t, const float *sin_t, int B, int T, int NH, int HD);
void cuda_rope_backward(void *dqkv, const float *cos_t, const float *sin_t, int B, int T, int NH, int HD);

/* head_dim up to 256 (larger dies with a message). In bf16, head dims that attn_bf16.h
 * supports run on tensor cores. */
void cuda_attention_forward(void *out, float *lse, const void *qkv, int B, int T, int NH, int HD);
void cuda_attention_backward(void *dqkv, const void *dout, const void *qkv, const void *out,
                             const float *lse, int B, int T, int NH, int HD, int acc);
void cuda_attention_rope_backward(void *dqkv, const void *dout, const void *qkv, const void *out, const float *lse,
                                  const float *cos_t, const float *sin_t, int B, int T, int NH, int HD);

/* rmsnorm's backward (cuda_rmsnorm_backward): rows of C channels take the wide-row kernels where
 * cuda_rmsnorm_wide(C) (and the tensors are 16-byte aligned); N rows run in
 * cuda_rmsnorm_blocks(N, wide) blocks, of about 8 rows on the wide kernels and 16 on the others,
 * fewer where that leaves under RMSNORM_FILL_BLOCKS blocks (down to 2 and 4 rows: at a
 * pipeline's micro-batch of 1,024 rows, 64 blocks of 16 left half the card idle; 256 of 4 took
 * 9 us against 11 on an H200, and the post's step at micro-batches of 4 sequences gained 2.7%;
 * at 4,096 rows 512 blocks of 8 gained nothing on 256 of 16, which stay), each leaving
 * a dw partial of C floats in scratch: a count fixed by N, so the sums' order is. Plain C, so
 * that the memory estimate counts the same scratch. */
#define RMSNORM_DW_BLOCKS 1024
#define RMSNORM_FILL_BLOCKS 256
static inline int cuda_rmsnorm_wide(int C) { return C % 8 == 0 && C > 1024 && C <= 32768; }
static inline int cuda_rmsnorm_blocks(size_t N, int wide) {
    size_t lo = wide ? 2 : 4, hi = wide ? 8 : 16, per = (N + RMSNORM_FILL_BLOCKS - 1) / RMSNORM_FILL_BLOCKS;
    per = per < lo ? lo : per > hi ? hi : per;
    size_t nb = (N + per - 1) / per;
    return nb < RMSNORM_DW_BLOCKS ? (int)nb : RMSNORM_DW_BLOCKS;
}
/* What runs a call of that shape now, as cuda_attention_forward / cuda_attention_backward make it
 * under the options (ops_set_options) and without RoPE's backward fused in: "cudnn", "wgmma" (our
 * Hopper backward), "own" (attn_bf16.cu's tensor-core kernels) or "generic" (attention.cuh); may
 * build cuDNN's plan for the shape. */
const char *cuda_attention_impl(int backward, int B, int T, int NH, int HD);
/* Test hook: the dP limit of cuDNN's deterministic backward (0: ATTN_CUDNN_DET_MAX_BYTES), so that a
 * small shape runs over its batch in pieces as a long context does. */
void cuda_set_attention_det_max(size_t bytes);
/* Test hook: whether every op waits for the device (MESHTRAIN_CUDA_SYNC, read at init);
 * returns the setting before. A graph (op_graph_*) is recorded only without it. */
int cuda_set_sync_each(int on);

void cuda_swiglu_forward(void *out, const void *gu, int N, int H);
void cuda_swiglu_backward(void *dgu, const void *dout, const void *gu, int N, int H, int acc);

/* A target outside [0, V) gives that row a NaN loss (and NaN gradient) rather than an
 * out-of-bounds read. */
void cuda_crossentropy_forward_backward(float *losses, void *logits, int ld, const int *targets, int N, int V,
                                        float dlogits_scale);
void cuda_crossentropy_shard_stats(float *stats, const void *logits, int ld, const int *targets, int N, int V, int v0);
void cuda_crossentropy_shard_backward(float *losses, void *logits, int ld, const int *targets, int N, int V, int v0,
                                      const float *stats, int t, float dlogits_scale);

void cuda_adamw(void *param, const void *grad, void *m, void *v, size_t n, float lr, float beta1,
                float beta2, float eps, float weight_decay, int step, float grad_scale);
void cuda_adamw_cast(void *param, const void *grad, void *m, void *v, size_t n, float lr, float beta1,
                     float beta2, float eps, float weight_decay, int step, float grad_scale, void *act);

/* Adafactor (ops.h): column sums in chunks of rows through the scratch buffer */
void cuda_adafactor_sums(float *sums, const void *grad, const AdafactorSeg *s, float grad_scale);
void cuda_adafactor_stats(float *stat, float *fac, const float *sums, int rows, int cols, float beta2t, float eps1);
void cuda_adafactor_rms(double *out, const void *param, const void *grad, const float *fac, const AdafactorSeg *s,
                        float grad_scale);
void cuda_adafactor_update(void *param, const void *grad, void *m, const float *fac, const AdafactorSeg *s,
                           float grad_scale, float coef, float decay, float beta1);

double cuda_sumsq(const void *x, size_t n); /* waits for the stream; returns on the host */
void cuda_scale(void *x, size_t n, float s);
void cuda_add(void *y, const void *x, size_t n);
void cuda_sum_parts(void *y, const void *const *x, int k, size_t n);
void cuda_copy_rows(void *dst, const void *src, const int *rows, size_t n, size_t row_bytes, int scatter);

/* Mixture of experts (ops.h's op_moe_*; src/ops/cuda/moe.cuh). The routing, dispatch and
 * statistics take at most CUDA_MOE_MAX_EXPERTS experts and top-k routing at most
 * CUDA_MOE_MAX_TOPK choices a row (more dies with a message); the router's products take any
 * number. Their scratch (the backend's one buffer) is fixed by the shapes, so the sums' order
 * is, and the memory estimate can count it: cuda_moe_scratch_bytes. Plain C for that. */
#define CUDA_MOE_MAX_EXPERTS OPS_CUDA_MAX_EXPERTS  /* (ops.h: the config refuses more) */
#define CUDA_MOE_MAX_TOPK 32
/* the dispatch's tiles of choices: a whole number of rounds of 256, at most this many tiles
 * (each leaving X ints of counts) */
#define CUDA_MOE_DISPATCH_TILES 1024
static inline int cuda_moe_dispatch_tile(size_t nk) {
    size_t per = (nk + CUDA_MOE_DISPATCH_TILES - 1) / CUDA_MOE_DISPATCH_TILES;
    per = (per + 255) / 256 * 256;
    return per < 256 ? 256 : (int)per;
}
/* the statistics' blocks (X + 1 doubles of partials each): one per 256 rows, at most 256 */
#define CUDA_MOE_STATS_BLOCKS 256
static inline int cuda_moe_stats_blocks(int N) {
    int nb = N > 0 ? (N + 255) / 256 : 0;
    return nb < CUDA_MOE_STATS_BLOCKS ? nb : CUDA_MOE_STATS_BLOCKS;
}
/* the router's weight gradient sums its N rows in splits of this many (a multiple of 16, at
 * least 256), each leaving X E fp32 partials: at most 128 splits and 2^21 partial floats
 * (8 MiB) where that allows more than one */
static inline int cuda_moe_router_chunk(int N, int E, int X) {
    size_t per = (size_t)(X > 0 ? X : 1) * (size_t)(E > 0 ? E : 1), cap = ((size_t)1 << 21) / per;
    size_t splits = N > 0 ? ((size_t)N + 255) / 256 : 1;
    if (splits > 128) splits = 128;
    if (splits > cap) splits = cap;
    if (splits < 1) splits = 1;
    size_t chunk = ((size_t)(N > 0 ? N : 1) + splits - 1) / splits;
    chunk = (chunk + 15) / 16 * 16;
    return chunk < 256 ? 256 : (int)chunk;
}
/* the largest scratch an op_moe_* call of these shapes takes (N rows, E channels, X experts,
 * top k): the router's weight-gradient partials, the dispatch's tile counts, the statistics'
 * partials */
static inline size_t cuda_moe_scratch_bytes(int N, int E, int X, int k) {
    int chunk = cuda_moe_router_chunk(N, E, X);
    size_t splits = N > 0 ? ((size_t)N + chunk - 1) / chunk : 0;
    size_t a = splits * (size_t)X * (size_t)E * sizeof(float);
    size_t nk = N > 0 && k > 0 ? (size_t)N * k : 0, tile = (size_t)cuda_moe_dispatch_tile(nk);
    size_t b = (nk + tile - 1) / tile * (size_t)X * sizeof(int);
    int nb = cuda_moe_stats_blocks(N);
    size_t c = (size_t)(nb ? nb : 1) * ((size_t)X + 1) * sizeof(double);
    return a > b ? (a > c ? a : c) : (b > c ? b : c);
}
void cuda_moe_router_forward(float *logits, const void *x, const void *w, int N, int E, int X);
void cuda_moe_router_backward(void *dx, void *dw, const float *dlogits, const void *x, const void *w, int N, int E,
                              int X);
void cuda_moe_topk(float *probs, int *idx, float *gate, float *lse, const float *logits, const float *bias, int N,
                   int X, int k, int sigmoid);
void cuda_moe_dispatch(int *cnt, int *pos, int *rowtok, float *gate_rows, const int *idx, const float *gate, int N,
                       int k, int X, int capacity);
void cuda_moe_stats(float *stats, const int *cnt, const float *probs, const float *lse, int N, int X);
void cuda_moe_route_backward(float *dlogits, const float *dgate_rows, const int *pos, const float *logits,
                             const float *probs, const int *idx, const float *gate, const float *lse, const float *stats,
                             float aux_scale, float z_scale, int N, int X, int k, int sigmoid);
/* off: X + 1 host ints; one cuBLASLt product per expert with rows */
void cuda_moe_matmul_forward(void *out, const void *inp, const void *w, size_t wstride, const int *off, int X, int C,
                             int OC);
void cuda_moe_matmul_backward(void *dinp, void *dw, size_t wstride, const void *dout, const void *inp, const void *w,
                              const int *off, int X, int C, int OC);
void cuda_moe_combine(void *out, const void *ys, const float *gate, const int *pos, int N, int k, int E);
void cuda_moe_unpermute(void *dx, const void *dxs, const int *pos, int N, int k, int E, int acc);
void cuda_moe_gate_backward(float *dgate_rows, void *h, void *dh, const float *gate_rows, int P, int H);
void cuda_moe_accumulate(float *acc, const float *stats, int rows, int X, int k);

#ifdef __cplusplus
}
#endif
#endif
