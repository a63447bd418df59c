/* Causal flash-attention BACKWARD on Hopper's warpgroup MMA (wgmma) and TMA
 * (src/ops/cuda/attn_wgmma_bwd.cu), built for sm_90a only: it runs on compute capability 9.0 (H100,
 * H200) and nowhere else (attn_wgmma_device_ok says whether the device is one).
 * Same layouts and results as attn_bf16_backward (attn_bf16.h), RoPE's fused backward included:
 *   qkv [B, T, 3C] bf16 (each token's row q | k | v, head h = columns h*HD .. h*HD+HD-1 of each part),
 *   dout, out [B, T, C] bf16, lse [B, NH, T] fp32 (natural log, scores scaled by 1/sqrt(HD)), from
 *   any of the forwards; query i attends keys j <= i. Any T >= 1. Pointers 16-byte aligned.
 * `stream` is a cudaStream_t passed as void * (NULL = the default stream). A failed launch prints
 * "meshtrain: cuda: attention <kernel> failed: <reason>" and exits with status 1. */
#ifndef MESHTRAIN_ATTN_WGMMA_BWD_H
#define MESHTRAIN_ATTN_WGMMA_BWD_H
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when the current device is compute capability 9.0 (asked once per process, then cached). */
int attn_wgmma_device_ok(void);

/* 1 for the head dims the kernels handle (64, 96, 128 and 256); 0 otherwise. attn_wgmma_bwd_hd is the
 * same in plain C (for the memory estimate, which links no CUDA). */
int attn_wgmma_bwd_supported(int HD);
static inline int attn_wgmma_bwd_hd(int HD) { return HD == 64 || HD == 96 || HD == 128 || HD == 256; }

/* NULL when this process's device can launch the backward for HD, with and without RoPE (asked once
 * per HD, which also opts the kernels into their dynamic shared memory), else why not (a static
 * string). */
const char *attn_wgmma_bwd_unlaunchable(int HD);

/* Bytes of device scratch attn_wgmma_backward needs: the fp32 dQ accumulator, D = rowsum(dO * O),
 * lse in log2 units (both padded to whole query tiles of 64 queries at head_dim 96, 128 and 256, 128
 * at 64) and the deterministic mode's semaphores. Plain C, so that the memory estimate counts the same. */
static inline size_t attn_wgmma_bwd_workspace_bytes(int B, int T, int NH, int HD) {
    if (B <= 0 || T <= 0 || NH <= 0 || !attn_wgmma_bwd_hd(HD)) return 0;
    size_t BH = (size_t)B * NH, BM = HD == 64 ? 128 : 64, nq = ((size_t)T + BM - 1) / BM, nqp = nq * BM;
    size_t a = ((BH * nqp * HD * 4) + 255) & ~(size_t)255, s = ((BH * nq * 4) + 255) & ~(size_t)255;
    size_t l = ((BH * nqp * 4) + 255) & ~(size_t)255;
    return a + s + 2 * l;
}

/* ops_cuda's auto choice for the backward in bf16 (deterministic mode), measured (bench/results/attention-h100-2026-11.md):
 * 1 where this kernel runs, on a device that takes it (attn_wgmma_device_ok), from
 * T = attn_wgmma_bwd_auto_t(HD, det, rope). Against cuDNN's deterministic engine, on an H100: 436.7 /
 * 459.7 TFLOP/s at head_dim 128, T = 4096 / 10000 (cuDNN 385 / 403), 392.5 at head_dim 64, T = 4096
 * (cuDNN 263), 395-404 at head_dim 96, T = 4096 (cuDNN 298) and 244-252 at 96, T = 1024 (cuDNN 218-
 * 225). At head_dim 64 and 128, T = 1024, 247-258 against 273-281 alone, so the op without RoPE
 * (rope = 0) takes it from 2048; with RoPE's backward to fuse (cuDNN's needs a pass of its own: the
 * model's step) the post's step at 1024 x 32 ties (381,640 against 381,402 tokens/s) in 0.37 GiB
 * less, and at 512 cuDNN's step is 0.4% ahead: so from 1024 there. At head_dim 96 the step (embed_dim
 * 768, 8 heads, H200) is ahead from 512: +0.8% at 512 x 64, +2.6% at 1024 x 32, +9.4% at 4096 x 8,
 * and the op alone at 1024 too. Head_dim 256 (BM = BN = 64, warpgroups splitting the head dim; H200,
 * B=16 H=4 T=4096): deterministic 269.9 TFLOP/s against cuDNN's deterministic engine's 289.2, so
 * auto (det) never takes it there; with atomic dQ (deterministic=false, det = 0) 356.5 against
 * cuDNN's atomic 339.6 and torch's cuDNN 327.2, so that takes it from 1024 (at B=8 H=4 T=1024: 199.8
 * against 201.3 and 206.2 alone; the fused RoPE pass not counted). Plain C, so that the memory
 * estimate follows the same choice (the model's step always has RoPE). */
#define ATTN_WGMMA_BWD_AUTO_T 1024
#define ATTN_WGMMA_BWD_AUTO_T_NOROPE 2048
#define ATTN_WGMMA_BWD_AUTO_T_HD96 512
#define ATTN_WGMMA_BWD_NEVER 0x7fffffff
static inline int attn_wgmma_bwd_auto_t(int HD, int det, int rope) {
    return HD == 96 ? ATTN_WGMMA_BWD_AUTO_T_HD96
         : HD == 256 && det ? ATTN_WGMMA_BWD_NEVER
         : rope ? ATTN_WGMMA_BWD_AUTO_T : ATTN_WGMMA_BWD_AUTO_T_NOROPE;
}
/* det: the deterministic mode or atomic dQ (deterministic=false); rope: RoPE's backward fused in */
static inline int attn_wgmma_bwd_auto(int T, int HD, int det, int rope) {
    return attn_wgmma_bwd_hd(HD) && T >= attn_wgmma_bwd_auto_t(HD, det, rope);
}

/* dqkv [B, T, 3C] bf16: with acc = 1 ACCUMULATES (+=) the gradients w.r.t. q, k and v (reads the old
 * bf16 value, adds in fp32, rounds once); with acc = 0 writes them (every element exactly once).
 * deterministic = 1: dQ's fp32 sums are added in a fixed order (bitwise reproducible); 0: in the
 * order the blocks get there (faster). workspace: attn_wgmma_bwd_workspace_bytes(...) bytes.
 * cos_t / sin_t: NULL, or both RoPE's [T, HD/2] fp32 tables (row t = position t; 16-byte aligned;
 * only with acc = 0: anything else exits as a failed launch does): dq and dk are rotated back
 * (RoPE's backward on interleaved pairs, as rope8_kernel's dir = -1) in fp32 before their one
 * rounding, so that q and k get the gradient w.r.t. their values before the rotation; dv as
 * without. */
void attn_wgmma_backward(void *dqkv, const void *dout, const void *qkv, const void *out, const float *lse,
                         void *workspace, int B, int T, int NH, int HD, int acc, int deterministic,
                         const float *cos_t, const float *sin_t, void *stream);

#ifdef __cplusplus
}
#endif
#endif
