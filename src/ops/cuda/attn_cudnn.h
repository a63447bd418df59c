/* Causal attention in bf16 through cuDNN's fused flash attention (src/ops/cuda/attn_cudnn.cu), built
 * on cuDNN's backend C API: the operation graph of matmuls, pointwise ops and reductions that cuDNN 9
 * recognises as scaled dot-product attention, forward and backward. The same layouts as attn_bf16.h:
 *   qkv [B, T, 3C] bf16 (q | k | v per token, head h at columns h*HD .. h*HD+HD-1 of each part,
 *       C = NH * HD), read in place through strides (no copies);
 *   out [B, T, C] bf16;  lse [B, NH, T] fp32, the natural-log log-sum-exp of each query row's scaled
 *       scores (cuDNN's softmax "stats" are exactly that, so either path's lse feeds the other's
 *       backward).
 * libcudnn.so.9 is opened with dlopen on first use (MESHTRAIN_CUDNN_LIB=path names another file);
 * without it, or where cuDNN has no engine for a shape, every call returns -1 and the caller runs its
 * own kernels. Execution plans are built once per shape (slow: tens to hundreds of ms) and cached.
 * Device pointers must be 16-byte aligned; `stream` is a cudaStream_t passed as void *.
 * The forward is deterministic; the backward is not (cuDNN sums dQ with atomics) unless asked for the
 * deterministic engine. */
#ifndef MESHTRAIN_ATTN_CUDNN_H
#define MESHTRAIN_ATTN_CUDNN_H
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when libcudnn could be loaded (and a handle created on the current device); 0 otherwise,
 * with the reason in why (may be NULL). Cheap after the first call. */
int attn_cudnn_available(char *why, size_t whylen);
/* cudnnGetVersion() of the loaded library (e.g. 91900), 0 when none. */
size_t attn_cudnn_version(void);

/* Builds (or finds) the plan for this shape. 0 and *workspace = the device bytes the call needs;
 * -1 when cuDNN cannot run it (no library, no engine for this head_dim, ...), with the reason in why. */
int attn_cudnn_forward_plan(int B, int T, int NH, int HD, size_t *workspace, char *why, size_t whylen);
/* deterministic = 1: the graph cudnn-frontend builds for its deterministic backward on Hopper (dQ = dS K
 * straight into dQ, no fp32 accumulator): an engine that keeps dP (B NH T^2 bf16) in its workspace
 * instead of summing dQ with atomics. */
int attn_cudnn_backward_plan(int B, int T, int NH, int HD, int deterministic, size_t *workspace, char *why,
                             size_t whylen);

/* out, lse = causal attention of qkv (overwritten). workspace: the bytes the plan asked for.
 * 0, or -1 when the plan cannot be had or the execution fails (nothing launched then). */
int attn_cudnn_forward(void *out, float *lse, const void *qkv, int B, int T, int NH, int HD, void *workspace,
                       void *stream);
/* dqkv [B, T, 3C] = the gradients w.r.t. q, k and v (WRITTEN, every element; never read). dout
 * [B, T, C]; out and lse from either forward. 0 or -1 as above. */
int attn_cudnn_backward(void *dqkv, const void *dout, const void *qkv, const void *out, const float *lse, int B,
                        int T, int NH, int HD, int deterministic, void *workspace, void *stream);

/* The dP buffer the deterministic backward engine keeps in its workspace, as cudnn-frontend sizes
 * it: B NH T^2 bf16, T rounded up to 64. */
static inline size_t attn_cudnn_det_dp_bytes(int B, int T, int NH) {
    size_t t = ((size_t)T + 63) / 64 * 64;
    return (size_t)B * NH * t * t * 2;
}
/* The workspace that engine's plan asks for, as measured on an H100 with cuDNN 9.14
 * (bench/results/attention-h100-2026-11.md): dP and about 1 MiB, or twice dP at T <= 64. */
static inline size_t attn_cudnn_det_workspace_bytes(int B, int T, int NH) {
    size_t dp = attn_cudnn_det_dp_bytes(B, T, NH);
    return T <= 64 ? 2 * dp + ((size_t)64 << 10) : dp + ((size_t)1 << 20);
}
/* The most dP that engine may keep (B=2 NH=8 T=10000 takes 3.2 GB). */
#define ATTN_CUDNN_DET_MAX_BYTES ((size_t)4 << 30)
/* The batch rows that engine takes in one call: all B, or at long contexts as many as keep its
 * dP within max_bytes (ATTN_CUDNN_DET_MAX_BYTES; ops_cuda runs the batch in pieces of this
 * many); 0 when one row alone does not fit. */
static inline int attn_cudnn_det_batch(int B, int T, int NH, size_t max_bytes) {
    size_t one = attn_cudnn_det_dp_bytes(1, T, NH), b = one ? max_bytes / one : (size_t)B;
    return b >= (size_t)B ? B : (int)b;
}

/* ops_cuda's auto choice in bf16, measured on an H100 with cuDNN 9.14 (bench/results/attention-h100-2026-11.md): 1 when cuDNN
 * runs the forward (backward = 0) or the backward (1; its deterministic engine), 0 for our tensor-core
 * kernels. own_kernels: whether those take this head_dim (attn_bf16_supported: 64 and 128); where they
 * do not, the generic kernels would run, far slower, so cuDNN does. cuDNN's forward beat ours from
 * T = 256 on (at 64 a tie, at 128 ours by 15%); its deterministic backward beat ours at T = 256 with
 * head_dim 128 and from T = 512 on (ours led at T <= 256 with head_dim 64). Plain C, so that the
 * memory estimate follows the same choice; cuDNN may still decline a shape at run time. */
static inline int attn_cudnn_auto(int backward, int B, int T, int NH, int HD, int own_kernels) {
    if (HD % 8) return 0;
    if (backward && !attn_cudnn_det_batch(B, T, NH, ATTN_CUDNN_DET_MAX_BYTES)) return 0;
    if (!own_kernels) return 1;
    return backward ? T >= 512 || (T >= 256 && HD >= 128) : T >= 256;
}

/* The atomic backward's own buffers after its plan's workspace (attn_cudnn.cu): Dsum [B, NH, T]
 * and the fp32 dQ accumulator [B, NH, T, HD] (the plan's own part is not known before it is
 * built: a few KB to a MB measured). */
static inline size_t attn_cudnn_atomic_extra_bytes(int B, int T, int NH, int HD) {
    size_t rows = (size_t)B * NH * T;
    return ((rows * 4 + 255) & ~(size_t)255) + rows * (size_t)HD * 4;
}

/* Destroys the cached plans and the handle (before the device is reset); the library stays open. */
void attn_cudnn_shutdown(void);

#ifdef __cplusplus
}
#endif
#endif
