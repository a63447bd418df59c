/* Causal flash-attention BACKWARD on Hopper's warpgroup MMA (wgmma) and TMA
 * (src/ops/cuda/attn_wgmma_bwd.cu), built for sm_90a only: it runs on compute capability 9.0 (H100,
 * H200) and nowhere else (attn_wgmma_device_ok in attn_wgmma.h says whether the device is one).
 * Same layouts and results as attn_bf16_backward (attn_bf16.h), without RoPE:
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

/* 1 for the head dims the kernels handle (64 and 128); 0 otherwise. */
int attn_wgmma_bwd_supported(int HD);

/* NULL when this process's device can launch the backward for HD (asked once per HD, which also
 * opts the kernel into its dynamic shared memory), else why not (a static string). */
const char *attn_wgmma_bwd_unlaunchable(int HD);

/* Bytes of device scratch attn_wgmma_backward needs: the fp32 dQ accumulator, D = rowsum(dO * O),
 * lse in log2 units (both padded to whole query tiles) and the deterministic mode's semaphores. */
size_t attn_wgmma_bwd_workspace_bytes(int B, int T, int NH, int HD);

/* dqkv [B, T, 3C] bf16: with acc = 1 ACCUMULATES (+=) the gradients w.r.t. q, k and v (reads the old
 * bf16 value, adds in fp32, rounds once); with acc = 0 writes them (every element exactly once).
 * deterministic = 1: dQ's fp32 sums are added in a fixed order (bitwise reproducible); 0: in the
 * order the blocks get there (faster). workspace: attn_wgmma_bwd_workspace_bytes(...) bytes. */
void attn_wgmma_backward(void *dqkv, const void *dout, const void *qkv, const void *out, const float *lse,
                         void *workspace, int B, int T, int NH, int HD, int acc, int deterministic, void *stream);

#ifdef __cplusplus
}
#endif
#endif
