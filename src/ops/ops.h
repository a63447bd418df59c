/* ops — every kernel the model needs, forward and backward, behind one device-agnostic
 * interface. The model code calls only these. Two backends implement them: `cpu`
 * (ops_cpu.c, fp32, OpenMP + OpenBLAS; the reference) and `cuda` (ops_cuda.cu, fp32, built
 * when nvcc is found). ops_init picks one per process; every op_* then runs on it.
 *
 * Conventions
 * - Row-major. N = B*T rows (tokens), C = channels.
 * - Weights use PyTorch's nn.Linear layout: W is [OC, C], y = x @ W^T.
 * - Every backward ACCUMULATES (+=) into its gradient outputs (dx, dw), so gradient
 *   accumulation and residual branches need no extra adds; callers zero buffers. The `_set`
 *   variants of matmul's, swiglu's and attention's backward WRITE their input gradient (=):
 *   the model's activation gradients start fresh, and on a device that saves zeroing them
 *   and reading them back (the weight gradient still accumulates).
 *   A gradient output pointer may be NULL when that gradient is not needed.
 * - Everything here is deterministic for a fixed thread count (no atomics, fixed
 *   reduction order), so a resumed run is bitwise identical to an uninterrupted one, unless
 *   OpsOptions.deterministic is 0 (the key deterministic=false: see OpsOptions).
 * - Precision (ops_set_precision). Tensors typed `void *` hold one of two element types:
 *   activations (and their gradients) and compute weights are the "act" type, fp32 or
 *   bf16 (ops_act_size); parameters, their gradients and AdamW's moments are the "state"
 *   type, fp32 or bf16 (ops_state_size). Tensors typed `float *` are always fp32: per-row
 *   statistics (rstd, lse, losses) and the RoPE tables. bf16 products accumulate into
 *   state-type gradients.
 */
#ifndef MESHTRAIN_OPS_H
#define MESHTRAIN_OPS_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Once per process, before any buffer is allocated: the backend, "cpu" or "cuda", and the
 * CPU's thread count (0 = all cores). 0, or -1 with a one-line message in err (a build
 * without CUDA, no usable GPU). Until it is called the cpu backend is active, with
 * OpenMP's default thread count. The backend starts with the options ops_set_options gave
 * (before it), or the defaults. */
int ops_init(const char *device, int n_threads, char *err, size_t errlen);
/* What the keys `attention` and `deterministic` choose in the backend. The cpu backend, fp32
 * and deterministic throughout, ignores them; the cuda one reads them in bf16:
 * - attention: OPS_ATTN_AUTO (the default) takes, by shape, whichever of cuDNN's fused flash
 *   attention and our kernels was faster (ops_cuda.cu); OPS_ATTN_CUDNN takes cuDNN wherever it
 *   has an engine for the shape; OPS_ATTN_OWN never takes cuDNN (our tensor-core kernels at
 *   head_dim 64 and 128, the generic ones elsewhere).
 * - deterministic: 1 (the default): every op bitwise repeatable. 0: attention's backward may sum
 *   dQ with atomics where that is faster (our Hopper kernel under auto, cuDNN's fastest engine
 *   under cudnn), and op_tune_matmuls may give product shapes faster algorithms: a run's last
 *   bits then depend on timings. */
typedef enum { OPS_ATTN_AUTO, OPS_ATTN_CUDNN, OPS_ATTN_OWN } OpsAttention;
typedef struct {
    OpsAttention attention;
    int deterministic;
} OpsOptions;
/* Sets the options (any time; the active backend takes them for the ops after the call). */
void ops_set_options(const OpsOptions *o);
OpsOptions ops_options(void);
const char *ops_backend_name(void);  /* "cpu" or "cuda" */
const char *ops_device_name(void);   /* the GPU's name; "" on the cpu */
/* 1 when the backend's buffers are host memory (cpu): callers may then read and write them
 * directly instead of staging copies through op_upload / op_download. */
int ops_host_memory(void);
/* Returns when every op issued so far has finished (ops may run asynchronously). */
void ops_synchronize(void);
/* MESHTRAIN_PROFILE=1's per-op totals back to zero (the train loop: after the first step) */
void ops_profile_reset(void);
/* Between steps, with nothing in flight (the train loop: after the first step): where the
 * options are not deterministic, each matmul shape used so far may take a faster algorithm of
 * the backend's library that gave the same results on random operands (cuda:
 * src/ops/cuda/matmul_tune.cuh; not bitwise on every run's own operands). Writes a one-line
 * report; returns the shapes changed, or -1 where there is nothing to tune (the cpu, or
 * deterministic options). */
int op_tune_matmuls(char *report, size_t len);
/* Recording a run of ops once and replaying it (cuda: a CUDA graph captured from the main
 * queue; the model's layer graphs, bench_ops_cuda's BENCH_GRAPH). Between op_graph_begin and
 * op_graph_end the ops are recorded, not run (no op in between may wait for the device or
 * upload, nor go to the side queue); op_graph_end returns the recording, or NULL where the
 * backend has none or the recording failed (the reason to stderr, once) or went stale while
 * it was made; op_graph_run queues it again as recorded (the same buffers and arguments),
 * or returns -1 without running it where it has gone stale since (the backend's scratch
 * moved, its matmuls were tuned: record again); op_graph_free drops it. Not while
 * MESHTRAIN_PROFILE times the ops (-1 from op_graph_begin). */
typedef struct OpsGraph OpsGraph;
int op_graph_begin(void);  /* 0, or -1 where the backend cannot record */
OpsGraph *op_graph_end(void);
int op_graph_run(OpsGraph *gr);
void op_graph_free(OpsGraph *gr);
/* 1 when the device has run all the work queued so far on the main queue (always on the
 * cpu, whose ops run as they are called). */
int ops_idle(void);
/* A side queue, for work that may overlap what comes after it on the main queue (DDP's
 * update of the units the next forward needs last). op_side_begin: ops from here go to the
 * side queue, after all the main queue holds so far; op_side_end: back to the main queue.
 * op_side_mark(k) marks the side queue's work so far as mark k (0 <= k < OPS_SIDE_MARKS);
 * op_side_wait(k): the main queue's later ops wait for it. ops_synchronize waits for both
 * queues; ops_synchronize_main, op_download and op_upload for the main queue only (a host
 * read of what the side writes needs ops_synchronize first). On synchronous backends (cpu)
 * these do nothing. */
#define OPS_SIDE_MARKS 256
void op_side_begin(void);
void op_side_end(void);
void op_side_mark(int k);
void op_side_wait(int k);
void ops_synchronize_main(void);
/* Host memory for state kept off the device (offload=optimizer), and the two copy queues
 * that move it. op_host_alloc: zeroed, 64-byte aligned host memory, pinned on cuda (so
 * copies run asynchronously on the copy engines); NULL when refused (no exit: the caller
 * says what it was for). op_copy_out(k): host <- device on the "out" queue, after all the
 * main queue holds so far; op_copy_in(k): device <- host on the "in" queue (it may be
 * called from another host thread than the ops'); each records mark k of its queue
 * (0 <= k < op_copy_reserve's n). op_copy_sync(k, in): the calling host thread waits for
 * the mark; op_copy_wait(k, in): the main queue's later ops wait for it. On the cpu the
 * copies are plain copies, done when the call returns, and the marks do nothing. */
void *op_host_alloc(size_t bytes);
void op_host_free(void *p);
void op_copy_reserve(int n);
void op_copy_out(void *dst_host, const void *src, size_t bytes, int k);
void op_copy_in(void *dst, const void *src_host, size_t bytes, int k);
void op_copy_sync(int k, int in);
void op_copy_wait(int k, int in);
/* device <- host (op_host_alloc memory) on the main queue, not waited for: the host bytes
 * must stay as they are until the main queue has passed the copy (offload=params' shards,
 * copied in ahead of their all-gather). */
void op_copy_in_main(void *dst, const void *src_host, size_t bytes);
/* Device memory: free and total bytes now; and the high-water marks since ops_init of the
 * bytes op_alloc holds (`allocated`) and of the device's used memory as seen at each
 * allocation (`used`: includes the runtime's context and other processes). Each returns -1
 * (values untouched) on the cpu, whose memory is the host's (see max RSS). */
int ops_device_memory(size_t *free_bytes, size_t *total_bytes);
int ops_device_peak(size_t *allocated, size_t *used);

/* Precision, right after ops_init and before anything is allocated. 0, or -1 with a
 * message (the cpu backend is fp32 only).
 * - OPS_FP32 (the default): everything fp32.
 * - OPS_MIXED: activations and compute weights bf16 (a bf16 copy of the fp32 parameters);
 *   parameters, gradients and moments fp32.
 * - OPS_BF16: everything bf16, the parameters included, so they are the compute weights
 *   themselves (no copy). AdamW still does its arithmetic in fp32 and rounds once. */
typedef enum { OPS_FP32, OPS_MIXED, OPS_BF16 } OpsPrecision;
/* The most experts a MoE layer has on the cuda backend (its routing keeps a row of scores per warp) */
#define OPS_CUDA_MAX_EXPERTS 1024
/* The widest head the cuda backend's attention takes (its kernels hold a row of it in registers) */
#define OPS_CUDA_MAX_HEAD_DIM 256
int ops_set_precision(OpsPrecision p, char *err, size_t errlen);
OpsPrecision ops_precision(void);
int ops_bf16(void);  /* activations in bf16 (OPS_MIXED or OPS_BF16) */
/* Bytes of one activation element: 2 in bf16, 4 in fp32. */
size_t ops_act_size(void);
/* Bytes of one element of parameter state (parameters, gradients, moments): 2 in OPS_BF16. */
size_t ops_state_size(void);
/* The same for a precision that need not be the active one (the estimate plans any). */
static inline size_t ops_act_size_of(OpsPrecision p) { return p != OPS_FP32 ? 2 : 4; }
static inline size_t ops_state_size_of(OpsPrecision p) { return p == OPS_BF16 ? 2 : 4; }
/* bf16 on the host: fp32 -> bf16 rounded to nearest even (a NaN stays a NaN), as the GPU's
 * conversions round; bf16 -> fp32 is exact (bf16 is the top half of an fp32). */
static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline float bf16_widen(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Address of element i of an activation array (its element size is ops_act_size()). */
static inline void *act_at(const void *base, size_t i) { return (char *)base + i * ops_act_size(); }
/* Address of element i of a parameter-state array (element size ops_state_size()). */
static inline void *st_at(const void *base, size_t i) { return (char *)base + i * ops_state_size(); }

/* ---- memory of the active backend ----
 * Tensors passed to the ops live in memory from op_alloc. The host reads and writes it
 * only through these calls, never with memcpy/memset, so the same code runs on either
 * backend. Every call is ordered with the ops; op_upload and op_download return when the
 * copy is done (the host buffer may then be reused or read). */
void *op_alloc(size_t bytes);  /* zeroed, 64-byte aligned; exits 2 when out of memory; 0 bytes -> NULL */
void op_free(void *p);         /* NULL is fine */
void op_zero(void *p, size_t bytes);
void op_copy(void *dst, const void *src, size_t bytes);          /* both op_alloc memory */
void op_upload(void *dst, const void *src_host, size_t bytes);   /* host -> op_alloc memory */
void op_download(void *dst_host, const void *src, size_t bytes); /* op_alloc memory -> host */
/* n activations (op_alloc memory) -> host floats, widened from bf16 when need be. */
void op_download_act(float *dst_host, const void *src, size_t n);
/* n parameter-state elements: op_alloc memory -> host floats (widened from bf16), and host
 * floats -> op_alloc memory (rounded to the nearest bf16 when the state is bf16). */
void op_download_state(float *dst_host, const void *src, size_t n);
void op_upload_state(void *dst, const float *src_host, size_t n);
/* dst (activation type) = src (fp32): the compute copy of weights; a copy in fp32. */
void op_to_act(void *dst, const float *src, size_t n);

/* out[n, :] = wte[tokens[n], :].  tokens in [0, V). */
void op_embedding_forward(void *out, const int *tokens, const void *wte, int N, int C);
/* dwte[tokens[n], :] += dout[n, :]  (deterministic: parallel over channels, not tokens). */
void op_embedding_backward(void *dwte, const void *dout, const int *tokens, int N, int C);
/* The tokens grouped by row, on the host, for op_embedding_backward_rows: out = rows[nr] |
 * off[nr + 1] | pos[N] (3N + 1 ints at most), rows the distinct tokens ascending and
 * pos[off[i]..off[i+1]) the positions n holding rows[i], ascending. count: V ints of
 * scratch. Returns nr. */
int embedding_rows_index(const int *tokens, int N, int V, int *count, int *out);
/* The same as op_embedding_backward, bitwise (every row's additions in the same order),
 * from that index (idx: op_alloc memory holding it, nr rows): the work goes by row, with no
 * pass over every token for each part of the vocabulary. */
void op_embedding_backward_rows(void *dwte, const void *dout, const int *idx, int nr, int N, int C);

/* Vocabulary parallel (tensor parallel's embedding): wte holds rows [lo, lo + rows) of the
 * table only; out[n, :] = that row for tokens[n] in [lo, lo + rows), zeros for any other
 * token (the sum over the ranks of their outputs is the whole lookup). */
void op_embedding_forward_shard(void *out, const int *tokens, const void *wte, int N, int C, int lo, int rows);
/* embedding_rows_index of the tokens in [lo, lo + rows) only, rows numbered from lo (the
 * shard's own: for op_embedding_backward_rows into its rows); count: rows ints of scratch. */
int embedding_rows_index_shard(const int *tokens, int N, int lo, int rows, int *count, int *out);

/* out = x * rstd * w, rstd[n] = 1/sqrt(mean(x[n]^2) + eps). rstd is saved for backward. */
void op_rmsnorm_forward(void *out, float *rstd, const void *x, const void *w, int N, int C, float eps);
/* The residual add fused with the norm after it, in one pass over the rows: res += branch,
 * then out = rmsnorm(res) exactly as op_rmsnorm_forward (res as stored: in bf16, rounded). */
void op_add_rmsnorm_forward(void *res, void *out, float *rstd, const void *branch, const void *w, int N, int C,
                            float eps);
/* dx += ..., dw += ...  (dw reduced over rows in a fixed order). Either may be NULL; with dx
 * NULL, w is not read (and may be NULL): the weight gradient alone. */
void op_rmsnorm_backward(void *dx, void *dw, const void *dout, const void *x, const void *w,
                         const float *rstd, int N, int C);

/* out[N, OC] = inp[N, C] @ w[OC, C]^T   (overwrites out). */
void op_matmul_forward(void *out, const void *inp, const void *w, int N, int C, int OC);
/* The same with out's rows ldo >= OC elements apart (the logits: rows padded to
 * ops_logit_stride(V) so that every row starts aligned, which tensor cores need). */
void op_matmul_forward_ld(void *out, int ldo, const void *inp, const void *w, int N, int C, int OC);
/* out[N, OC] = inp @ w^T + res (res [N, OC], distinct from out): a residual add fused into
 * the product where the backend can (the cuda one adds in the matmul's epilogue, before
 * rounding); else the product, then op_add. */
void op_matmul_forward_add(void *out, const void *inp, const void *w, const void *res, int N, int C, int OC);
/* Row stride of a logits buffer of V columns: V rounded up to 64. */
int ops_logit_stride(int V);
/* dinp[N, C] += dout @ w ;  dw[OC, C] += dout^T @ inp.  (w may be NULL when dinp is.) */
void op_matmul_backward(void *dinp, void *dw, const void *dout, const void *inp, const void *w,
                        int N, int C, int OC);
/* dinp[N, C] = dout @ w (written, not added);  dw[OC, C] += dout^T @ inp. */
void op_matmul_backward_set(void *dinp, void *dw, const void *dout, const void *inp, const void *w,
                            int N, int C, int OC);
/* dinp[N, C] = dout @ w + res (res [N, C], distinct from dinp): the input gradient alone,
 * with res added in the product's epilogue where the backend can (one rounding of the sum,
 * as op_matmul_forward_add's); else the product, then op_add. */
void op_matmul_backward_add(void *dinp, const void *dout, const void *w, const void *res, int N, int C, int OC);
/* ... with dout's rows ldo elements apart. */
void op_matmul_backward_ld(void *dinp, void *dw, const void *dout, int ldo, const void *inp, const void *w,
                           int N, int C, int OC);

/* RoPE tables for positions 0..T-1: cos/sin[t, i] of t * base^(-2i/HD), i < HD/2,
 * computed in fp32 exactly as PyTorch does (inv = 1/base^(arange(0,HD,2)/HD); f = t*inv). */
void op_rope_tables(float *cos_t, float *sin_t, int T, int HD, float base);
/* In place on the q and k parts of qkv [B, T, 3*NH*HD] (v untouched), interleaved pairs:
 * (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos). */
void op_rope_forward(void *qkv, const float *cos_t, const float *sin_t, int B, int T, int NH, int HD);
/* In place on dqkv: the inverse rotation (the transpose) of the q and k parts. */
void op_rope_backward(void *dqkv, const float *cos_t, const float *sin_t, int B, int T, int NH, int HD);

/* Causal softmax attention, scale 1/sqrt(HD). qkv [B, T, 3*NH*HD] holds q | k | v, each
 * [NH*HD] per token with head h at columns h*HD..h*HD+HD-1. out [B, T, NH*HD].
 * lse [B, NH, T] saves each row's log-sum-exp (of the scaled scores) for backward,
 * which recomputes the probabilities instead of storing a T x T matrix. */
void op_attention_forward(void *out, float *lse, const void *qkv, int B, int T, int NH, int HD);
/* dqkv += gradient w.r.t. qkv (q, k and v parts). */
void op_attention_backward(void *dqkv, const void *dout, const void *qkv, const void *out,
                           const float *lse, int B, int T, int NH, int HD);
/* dqkv = gradient w.r.t. qkv (written, not added). */
void op_attention_backward_set(void *dqkv, const void *dout, const void *qkv, const void *out,
                               const float *lse, int B, int T, int NH, int HD);

/* dqkv = the gradient w.r.t. qkv before RoPE: op_attention_backward_set then op_rope_backward,
 * fused where the backend can (bf16 on CUDA: dq and dk rotated back in fp32 before their one
 * rounding, instead of a second pass over dqkv). */
void op_attention_rope_backward_set(void *dqkv, const void *dout, const void *qkv, const void *out,
                                    const float *lse, const float *cos_t, const float *sin_t, int B, int T, int NH,
                                    int HD);

/* gu [N, 2H] holds gate | up per row; out[N, H] = silu(gate) * up. */
void op_swiglu_forward(void *out, const void *gu, int N, int H);
/* dgu [N, 2H] += gradient w.r.t. gate | up. */
void op_swiglu_backward(void *dgu, const void *dout, const void *gu, int N, int H);
/* dgu [N, 2H] = gradient w.r.t. gate | up (written, not added). */
void op_swiglu_backward_set(void *dgu, const void *dout, const void *gu, int N, int H);

/* Cross-entropy over logits [N, V] with targets [N]. losses[n] = logsumexp - logit[target].
 * If dlogits_scale != 0, logits is overwritten IN PLACE with its gradient
 * dlogits_scale * (softmax - onehot) (the caller passes 1/total_tokens), so a chunk of
 * logits never needs a second buffer. Computed in double per row for stability. */
void op_crossentropy_forward_backward(float *losses, void *logits, const int *targets, int N, int V,
                                      float dlogits_scale);
/* ... with the rows of logits ld >= V elements apart. */
void op_crossentropy_forward_backward_ld(float *losses, void *logits, int ld, const int *targets, int N, int V,
                                         float dlogits_scale);

/* Vocabulary-parallel cross-entropy, in two halves around an all-gather: logits [N, V]
 * (rows ld apart) are the columns [v0, v0 + V) of the whole vocabulary; targets are
 * whole-vocabulary ids.
 * op_crossentropy_shard_stats: per row n, stats[3n..3n+2] = the row's max, the sum of
 * exp(l - max) (in double, rounded once), and the target's logit where this shard holds it
 * (else 0). A NaN or +inf logit makes the max NaN.
 * op_crossentropy_shard_backward: stats holds every shard's statistics (t blocks of 3N
 * floats, shard k's at 3Nk, the same on every shard); per row the log-sum-exp over the
 * shards (combined in shard order, in double) and the loss (every shard writes the same);
 * with dlogits_scale != 0 this shard's logits are overwritten in place with
 * dlogits_scale * (softmax - onehot). A NaN max in any shard, or none finite: NaN loss
 * (and gradient). */
void op_crossentropy_shard_stats(float *stats, const void *logits, int ld, const int *targets, int N, int V, int v0);
void op_crossentropy_shard_backward(float *losses, void *logits, int ld, const int *targets, int N, int V, int v0,
                                    const float *stats, int t, float dlogits_scale);

/* One AdamW step on a flat buffer (PyTorch semantics: decoupled weight decay
 * p -= lr*wd*p, bias-corrected moments, eps added to sqrt(v_hat)). `step` counts from 1.
 * grad is multiplied by grad_scale first (used for clipping). All four are state type. */
void op_adamw(void *param, const void *grad, void *m, void *v, size_t n, float lr, float beta1,
              float beta2, float eps, float weight_decay, int step, float grad_scale);
/* op_adamw on fp32 state, then act = the updated parameters in the compute type (op_to_act),
 * in the same pass where the backend can: precision=mixed's bf16 copy without reading the
 * parameters again. */
void op_adamw_cast(void *param, const void *grad, void *m, void *v, size_t n, float lr, float beta1,
                   float beta2, float eps, float weight_decay, int step, float grad_scale, void *act);

/* Adafactor (Shazeer & Stern 2018), in pieces that a sharded optimizer step strings
 * together with its collectives between them (src/optim/adafactor.c). A segment is the
 * part of one tensor that this call covers: elements [first, first + n) of a rows x cols
 * row-major tensor, at `off` in the buffers passed (param, grad, m: state type). Each
 * tensor has `rows + cols` statistics at `stat` in the fp32 stats arrays (rows of the row
 * statistic R, then cols of the column statistic C), or, for a vector (rows == 1,
 * unfactored), `cols` of its second moment v. A tensor-parallel rank's column slice of a
 * matrix is a segment of its own rows x cols matrix whose column j has the whole matrix's
 * column statistic col0 + j (col0 = 0 otherwise). Per-element work is deterministic (no
 * atomics; fixed reduction order). */
typedef struct {
    size_t off, n, first, stat, col0;
    int rows, cols;
} AdafactorSeg;
/* sums[stat + i] += sum over the segment's elements of row i of (grad_scale g)^2, and
 * sums[stat + rows + col0 + j] += the same over column j (a vector: sums[stat + col0 + j]
 * += (s g_j)^2).
 * Accumulated in double, added once in fp32. */
void op_adafactor_sums(float *sums, const void *grad, const AdafactorSeg *s, float grad_scale);
/* One tensor's statistics (stat, fac, sums all at its offset), from the complete sums of
 * (s g)^2 over its rows and columns: R_i = beta2t R_i + (1 - beta2t) (sums_i / cols + eps1),
 * C_j = beta2t C_j + (1 - beta2t) (sums_j / rows + eps1); then the factors of the update
 * u = s g * fac_r[i] * fac_c[j]: fac_r[i] = 1/sqrt(R_i / mean(R)), fac_c[j] = 1/sqrt(C_j)
 * (mean(R) summed in double). A vector: v_j likewise from sums_j, fac[j] = 1/sqrt(v_j). */
void op_adafactor_stats(float *stat, float *fac, const float *sums, int rows, int cols, float beta2t, float eps1);
/* out[0] = sum over the segment of u^2 (u as above), out[1] = sum of param^2, in double.
 * out: two doubles of op_alloc memory (written, not added). */
void op_adafactor_rms(double *out, const void *param, const void *grad, const float *fac, const AdafactorSeg *s,
                      float grad_scale);
/* The update of the segment, with the tensor's step coef = lr_t / max(1, RMS(u) / d) and
 * decay = 1 - lr_t weight_decay: without a first moment (m NULL) p = p decay - coef u;
 * with one, m = beta1 m + (1 - beta1) coef u, then p = p decay - m. */
void op_adafactor_update(void *param, const void *grad, void *m, const float *fac, const AdafactorSeg *s,
                         float grad_scale, float coef, float decay, float beta1);

/* sum of squares of x (state type), accumulated in double (for global gradient norm). */
double op_sumsq(const void *x, size_t n);
/* x *= s (state type) */
void op_scale(void *x, size_t n, float s);
/* y += x (activations) */
void op_add(void *y, const void *x, size_t n);
/* y = x[0] + x[1] + ... + x[k - 1] (activations; 1 <= k <= OPS_SUM_PARTS), added in that
 * order in fp32 and rounded once; y may be x[0] (y += the rest). Tensor parallel's fused
 * sums: one pass over the parts, where op_add one at a time read and wrote y k - 1 times
 * (in fp32 the two are bitwise the same). */
#define OPS_SUM_PARTS 16
void op_sum_parts(void *y, const void *const *x, int k, size_t n);
/* Rows of row_bytes bytes picked by rows[0..n) (op_alloc memory, ints): gather copies src
 * row rows[i] to dst row i; scatter copies src row i to dst row rows[i] (rows distinct). */
void op_gather_rows(void *dst, const void *src, const int *rows, size_t n, size_t row_bytes);
void op_scatter_rows(void *dst, const void *src, const int *rows, size_t n, size_t row_bytes);

/* ---- mixture of experts (a MoE layer's FFN: src/model/layer_moe.c) ----
 * N token rows, X experts, each row routed to k of them. The rows of each expert are gathered
 * into one contiguous group (expert 0's first; within an expert in order of row n, then of
 * choice j): P rows in all, row p holding token rowtok[p]. Every sum below has a fixed order,
 * so a run is bitwise repeatable (no atomics). Index arrays (int) and fp32 arrays are op_alloc
 * memory unless said otherwise; `void *` arrays are activations unless said "state". */

/* logits[N, X] (fp32) = x[N, E] @ w[X, E]^T, products accumulated in fp32 (the router in fp32
 * whatever the activations' type). */
void op_moe_router_forward(float *logits, const void *x, const void *w, int N, int E, int X);
/* dx[N, E] += dlogits @ w (dx may be NULL), dw[X, E] (state) += dlogits^T @ x, from fp32
 * dlogits, accumulated in fp32 (dw's sum over the rows in row order). */
void op_moe_router_backward(void *dx, void *dw, const float *dlogits, const void *x, const void *w, int N, int E,
                            int X);
/* Per row n: the scores s = softmax(logits[n]) (sigmoid = 0) or sigmoid(logits[n]) (sigmoid = 1)
 * into probs[n, X]; the k experts of largest s + bias into idx[n, 0..k) (bias: X fp32 values,
 * NULL for none; it chooses, it never weighs), by descending s + bias, ties to the lower
 * expert; gate[n, j] = s[idx[n, j]] / (the sum of s over the k chosen); lse[n] = log sum_e
 * exp(logits[n, e]) (the z-loss's). */
void op_moe_topk(float *probs, int *idx, float *gate, float *lse, const float *logits, const float *bias, int N,
                 int X, int k, int sigmoid);
/* The dispatch from idx [N, k] and gate [N, k]. cnt (3X + 1 ints): cnt[e] = the choices of
 * expert e (routed), cnt[X + e] = those kept: each expert's first `capacity` choices in order
 * of n then j (capacity <= 0: all), cnt[2X + e] = the first row of expert e's group (cnt[3X] =
 * P, the kept rows). pos[n k + j] = the row of choice (n, j), -1 where it was dropped;
 * rowtok[p] = the token of row p and gate_rows[p] = its gate (p < P). */
void op_moe_dispatch(int *cnt, int *pos, int *rowtok, float *gate_rows, const int *idx, const float *gate, int N,
                     int k, int X, int capacity);
/* The router's statistics of N rows (fp32, 2X + 2): stats[e] = cnt[e] (the routed choices),
 * stats[X + e] = the sum over the rows of s_hat[n, e] = probs[n, e] / sum_e probs[n, e] (the
 * scores normalised: softmax's are already), stats[2X] = the sum of lse[n]^2, stats[2X + 1] =
 * the kept choices (the sum of cnt[X .. 2X)); sums over the rows in row order, in double,
 * rounded once. */
void op_moe_stats(float *stats, const int *cnt, const float *probs, const float *lse, int N, int X);
/* d(loss)/d(logits) [N, X], written, through the routing op_moe_topk made: from the gates'
 * gradient (dgate_rows[p] for row p; a dropped choice's is 0, pos[n k + j] = -1), from the
 * load-balancing loss (d/d s_hat[n, e] = aux_scale * stats[e]) and from the z-loss (d/d lse[n]
 * = z_scale * lse[n]). logits, probs, idx, gate, lse as op_moe_topk left them. */
void op_moe_route_backward(float *dlogits, const float *dgate_rows, const int *pos, const float *logits,
                           const float *probs, const int *idx, const float *gate, const float *lse, const float *stats,
                           float aux_scale, float z_scale, int N, int X, int k, int sigmoid);
/* The experts' products, one group of rows per expert: expert e's weight is w_e = w + e *
 * wstride elements ([OC, C], in the activations' type; dw's of the state type), its rows
 * [off[e], off[e + 1]) of inp and out (off: X + 1 ints in host memory, off[0] = 0; the same
 * as cnt[2X..3X] of op_moe_dispatch). forward: out = inp @ w_e^T, written. backward: dinp =
 * dout @ w_e written (dinp NULL: not wanted), dw_e += dout^T @ inp (dw NULL: not wanted); an
 * expert with no rows adds nothing. */
void op_moe_matmul_forward(void *out, const void *inp, const void *w, size_t wstride, const int *off, int X, int C,
                           int OC);
void op_moe_matmul_backward(void *dinp, void *dw, size_t wstride, const void *dout, const void *inp, const void *w,
                            const int *off, int X, int C, int OC);
/* out[n, :] += the sum over j = 0 .. k-1, in that order, of gate[n, j] * ys[pos[n k + j], :]
 * (a dropped choice adds nothing), summed in fp32 and added to out once. */
void op_moe_combine(void *out, const void *ys, const float *gate, const int *pos, int N, int k, int E);
/* The gather's backward: dx[n, :] (+)= the sum over j, in order, of dxs[pos[n k + j], :];
 * acc: added to dx, else written. */
void op_moe_unpermute(void *dx, const void *dxs, const int *pos, int N, int k, int E, int acc);
/* The combine's backward, with the gate folded in where the down product's input is: per row
 * p < P, dgate_rows[p] = <dh[p], h[p]> (the fp32 sum of the products of H activations), then
 * h[p] *= gate_rows[p] and dh[p] *= gate_rows[p], in place. (h: the down product's input; dh:
 * the gradient at it of the ungated output, dout[rowtok[p]] @ w_e.) */
void op_moe_gate_backward(float *dgate_rows, void *h, void *dh, const float *gate_rows, int P, int H);
/* The step's statistics of one MoE layer's micro-batch, added into acc (fp32, X + 3): acc[e]
 * += stats[e] (the routed choices), acc[X] += the load-balancing loss X sum_e f_e P_e with f_e =
 * stats[e] / (rows k) and P_e = stats[X + e] / rows, acc[X + 1] += the z-loss stats[2X] / rows,
 * acc[X + 2] += stats[2X + 1] (the kept choices); stats as op_moe_stats made them (summed over
 * the ranks that share the micro-batch's rows). */
void op_moe_accumulate(float *acc, const float *stats, int rows, int X, int k);

/* ---- backends ----
 * A backend is one table of functions with the semantics above (ops.c dispatches every
 * op_* through the active one). op_rope_tables computes on the host in both, so the tables
 * are bitwise the same. */
typedef struct OpsBackend {
    const char *name;
    int host_memory;
    int (*init)(int n_threads, char *err, size_t errlen);
    void (*set_options)(const OpsOptions *o);  /* NULL: the backend takes none (ops_set_options) */
    const char *(*device_name)(void);
    void (*synchronize)(void);
    int (*idle)(void);  /* NULL: ops run synchronously, always idle */
    /* MESHTRAIN_PROFILE=events (ops.c): mark i records event i of a pool in the device's
     * queue; span(a, b) waits for b and gives the seconds from a to b. NULL: not offered */
    void (*prof_mark)(int i);
    double (*prof_span)(int a, int b);
    /* the side queue (ops.h); NULL: one queue, ops_synchronize_main = synchronize */
    void (*side_begin)(void);
    void (*side_end)(void);
    void (*side_mark)(int k);
    void (*side_wait)(int k);
    void (*synchronize_main)(void);
    /* offload's host memory and copy queues (ops.h); NULL: aligned malloc and plain
     * copies (the cpu, whose buffers are host memory) */
    void *(*host_alloc)(size_t bytes);
    void (*host_free)(void *p);
    void (*copy_reserve)(int n);
    void (*copy_out)(void *dst_host, const void *src, size_t bytes, int k);
    void (*copy_in)(void *dst, const void *src_host, size_t bytes, int k);
    void (*copy_sync)(int k, int in);
    void (*copy_wait)(int k, int in);
    void (*copy_in_main)(void *dst, const void *src_host, size_t bytes);
    int (*device_memory)(size_t *free_bytes, size_t *total_bytes); /* NULL on the cpu */
    int (*device_peak)(size_t *allocated, size_t *used);           /* NULL on the cpu */
    void *(*alloc)(size_t bytes);
    void (*free)(void *p);
    void (*zero)(void *p, size_t bytes);
    void (*copy)(void *dst, const void *src, size_t bytes);
    void (*upload)(void *dst, const void *src, size_t bytes);
    void (*download)(void *dst, const void *src, size_t bytes);
    void (*set_precision)(OpsPrecision p);  /* NULL: fp32 only */
    void (*to_act)(void *dst, const float *src, size_t n);
    void (*embedding_forward)(void *out, const int *tokens, const void *wte, int N, int C);
    void (*embedding_backward)(void *dwte, const void *dout, const int *tokens, int N, int C);
    void (*embedding_backward_rows)(void *dwte, const void *dout, const int *idx, int nr, int N, int C);
    void (*embedding_forward_shard)(void *out, const int *tokens, const void *wte, int N, int C, int lo, int rows);
    void (*rmsnorm_forward)(void *out, float *rstd, const void *x, const void *w, int N, int C, float eps);
    void (*add_rmsnorm_forward)(void *res, void *out, float *rstd, const void *branch, const void *w, int N, int C,
                                float eps);
    void (*rmsnorm_backward)(void *dx, void *dw, const void *dout, const void *x, const void *w,
                             const float *rstd, int N, int C);
    void (*matmul_forward)(void *out, int ldo, const void *inp, const void *w, int N, int C, int OC);
    /* NULL: op_matmul_forward_add is matmul_forward then add */
    void (*matmul_forward_add)(void *out, const void *inp, const void *w, const void *res, int N, int C, int OC);
    /* acc: dinp += (1) or dinp = (0); dw always accumulates */
    void (*matmul_backward)(void *dinp, void *dw, const void *dout, int ldo, const void *inp, const void *w,
                            int N, int C, int OC, int acc);
    /* NULL: op_matmul_backward_add is matmul_backward (set) then add */
    void (*matmul_backward_add)(void *dinp, const void *dout, const void *w, const void *res, int N, int C, int OC);
    void (*rope_tables)(float *cos_t, float *sin_t, int T, int HD, float base);
    void (*rope_forward)(void *qkv, const float *cos_t, const float *sin_t, int B, int T, int NH, int HD);
    void (*rope_backward)(void *dqkv, const float *cos_t, const float *sin_t, int B, int T, int NH, int HD);
    void (*attention_forward)(void *out, float *lse, const void *qkv, int B, int T, int NH, int HD);
    void (*attention_backward)(void *dqkv, const void *dout, const void *qkv, const void *out,
                               const float *lse, int B, int T, int NH, int HD, int acc);
    /* NULL: op_attention_rope_backward_set is attention_backward (acc = 0) then rope_backward */
    void (*attention_rope_backward)(void *dqkv, const void *dout, const void *qkv, const void *out,
                                    const float *lse, const float *cos_t, const float *sin_t, int B, int T, int NH,
                                    int HD);
    void (*swiglu_forward)(void *out, const void *gu, int N, int H);
    void (*swiglu_backward)(void *dgu, const void *dout, const void *gu, int N, int H, int acc);
    void (*crossentropy_forward_backward)(float *losses, void *logits, int ld, const int *targets, int N, int V,
                                          float dlogits_scale);
    void (*crossentropy_shard_stats)(float *stats, const void *logits, int ld, const int *targets, int N, int V,
                                     int v0);
    void (*crossentropy_shard_backward)(float *losses, void *logits, int ld, const int *targets, int N, int V, int v0,
                                        const float *stats, int t, float dlogits_scale);
    void (*adamw)(void *param, const void *grad, void *m, void *v, size_t n, float lr, float beta1,
                  float beta2, float eps, float weight_decay, int step, float grad_scale);
    /* The cpu backend's only (NULL elsewhere; offload calls ops_backend_cpu's): adamw on fp32
     * host state with bf16 gradients g16, which then hold the updated parameters rounded to
     * bf16 (offload=optimizer with precision=mixed: the copy the device computes with).
     * Bitwise adamw on the widened gradients, then bf16_round. */
    void (*adamw_host16)(float *param, uint16_t *g16, float *m, float *v, size_t n, float lr, float beta1,
                         float beta2, float eps, float weight_decay, int step, float grad_scale);
    /* NULL: op_adamw_cast is adamw then to_act */
    void (*adamw_cast)(void *param, const void *grad, void *m, void *v, size_t n, float lr, float beta1,
                       float beta2, float eps, float weight_decay, int step, float grad_scale, void *act);
    void (*adafactor_sums)(float *sums, const void *grad, const AdafactorSeg *s, float grad_scale);
    void (*adafactor_stats)(float *stat, float *fac, const float *sums, int rows, int cols, float beta2t, float eps1);
    void (*adafactor_rms)(double *out, const void *param, const void *grad, const float *fac, const AdafactorSeg *s,
                          float grad_scale);
    void (*adafactor_update)(void *param, const void *grad, void *m, const float *fac, const AdafactorSeg *s,
                             float grad_scale, float coef, float decay, float beta1);
    double (*sumsq)(const void *x, size_t n);
    void (*scale)(void *x, size_t n, float s);
    void (*add)(void *y, const void *x, size_t n);
    void (*sum_parts)(void *y, const void *const *x, int k, size_t n);
    void (*copy_rows)(void *dst, const void *src, const int *rows, size_t n, size_t row_bytes, int scatter);
    int (*tune_matmuls)(char *report, size_t len);  /* NULL: nothing to tune (op_tune_matmuls) */
    /* mixture of experts (ops.h's op_moe_*) */
    void (*moe_router_forward)(float *logits, const void *x, const void *w, int N, int E, int X);
    void (*moe_router_backward)(void *dx, void *dw, const float *dlogits, const void *x, const void *w, int N, int E,
                                int X);
    void (*moe_topk)(float *probs, int *idx, float *gate, float *lse, const float *logits, const float *bias, int N,
                     int X, int k, int sigmoid);
    void (*moe_dispatch)(int *cnt, int *pos, int *rowtok, float *gate_rows, const int *idx, const float *gate, int N,
                         int k, int X, int capacity);
    void (*moe_stats)(float *stats, const int *cnt, const float *probs, const float *lse, int N, int X);
    void (*moe_route_backward)(float *dlogits, const float *dgate_rows, const int *pos, const float *logits,
                               const float *probs, const int *idx, const float *gate, const float *lse,
                               const float *stats, float aux_scale, float z_scale, int N, int X, int k, int sigmoid);
    void (*moe_matmul_forward)(void *out, const void *inp, const void *w, size_t wstride, const int *off, int X, int C,
                               int OC);
    void (*moe_matmul_backward)(void *dinp, void *dw, size_t wstride, const void *dout, const void *inp,
                                const void *w, const int *off, int X, int C, int OC);
    void (*moe_combine)(void *out, const void *ys, const float *gate, const int *pos, int N, int k, int E);
    void (*moe_unpermute)(void *dx, const void *dxs, const int *pos, int N, int k, int E, int acc);
    void (*moe_gate_backward)(float *dgate_rows, void *h, void *dh, const float *gate_rows, int P, int H);
    void (*moe_accumulate)(float *acc, const float *stats, int rows, int X, int k);
    /* op_graph_*; NULL: no recording */
    int (*graph_begin)(void);
    OpsGraph *(*graph_end)(void);
    int (*graph_run)(OpsGraph *gr);
    void (*graph_free)(OpsGraph *gr);
} OpsBackend;

extern const OpsBackend ops_backend_cpu;   /* ops_cpu.c */
#ifdef MESHTRAIN_CUDA
extern const OpsBackend ops_backend_cuda;  /* ops_cuda.cu, in builds made with nvcc */
#endif

#ifdef __cplusplus
}
#endif
#endif
