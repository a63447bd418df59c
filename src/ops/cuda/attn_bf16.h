/* Causal flash attention in bf16 on tensor cores (src/ops/cuda/attn_bf16.cu): forward and backward,
 * deterministic (no atomics, fixed reduction order), no T x T matrix in memory.
 * Layouts (HD = head dim, C = NH * HD), all row-major:
 *   qkv  [B, T, 3C] bf16: each token's row is q (C) | k (C) | v (C); head h is columns h*HD .. h*HD+HD-1
 *        of each part.
 *   out  [B, T, C] bf16;  lse [B, NH, T] fp32: natural-log log-sum-exp of each query row's scaled
 *        scores (scale = 1/sqrt(HD)).
 * Query i attends to keys j <= i. Device pointers must be 16-byte aligned (cudaMalloc'd buffers are).
 * `stream` is a cudaStream_t passed as void * (NULL = the default stream). A failed launch prints
 * "meshtrain: cuda: attention <kernel> failed: <reason>" and exits with status 1. */
#ifndef MESHTRAIN_ATTN_BF16_H
#define MESHTRAIN_ATTN_BF16_H
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when the kernels handle this head_dim (64 and 128); 0 otherwise: the caller falls back. */
int attn_bf16_supported(int HD);

/* Bytes of device scratch attn_bf16_backward needs (D = rowsum(dO * O), [B, NH, T] fp32). */
size_t attn_bf16_workspace_bytes(int B, int T, int NH, int HD);

/* out = causal softmax(q k^T / sqrt(HD)) v per head; lse as above. out and lse are overwritten. */
void attn_bf16_forward(void *out, float *lse, const void *qkv, int B, int T, int NH, int HD, void *stream);

/* dqkv [B, T, 3C] bf16: with acc = 1 ACCUMULATES (+=) the gradients w.r.t. q, k and v (reads the old
 * bf16 value, adds in fp32, rounds once); with acc = 0 writes them (every element exactly once, the
 * old values never read). dout [B, T, C] bf16; out and lse from attn_bf16_forward; workspace:
 * attn_bf16_workspace_bytes(...) bytes of device memory. rope_cos / rope_sin (the [T, HD/2] RoPE
 * tables, 16-byte aligned; only with acc = 0, else NULL): dq and dk are rotated back (RoPE's
 * backward, interleaved pairs) in fp32 before their one rounding, so that q and k get the
 * gradient w.r.t. their values before the rotation. */
void attn_bf16_backward(void *dqkv, const void *dout, const void *qkv, const void *out, const float *lse,
                        void *workspace, int B, int T, int NH, int HD, int acc, const float *rope_cos,
                        const float *rope_sin, void *stream);

#ifdef __cplusplus
}
#endif
#endif
