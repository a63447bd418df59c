/* Causal flash-attention forward on Hopper's warpgroup MMA (wgmma) and TMA (src/ops/cuda/attn_wgmma.cu),
 * built for sm_90a only: it runs on compute capability 9.0 (H100, H200) and nowhere else.
 * Same layouts and results as attn_bf16_forward (attn_bf16.h):
 *   qkv [B, T, 3C] bf16 (each token's row q | k | v, head h = columns h*HD .. h*HD+HD-1 of each part),
 *   out [B, T, C] bf16, lse [B, NH, T] fp32 (natural-log log-sum-exp of each query row's scores
 *   scaled by 1/sqrt(HD)); query i attends keys j <= i. Any T >= 1. Pointers 16-byte aligned.
 * `stream` is a cudaStream_t passed as void * (NULL = the default stream). A failed launch prints
 * "meshtrain: cuda: attention <kernel> failed: <reason>" and exits with status 1.
 * There is no backward here: attn_bf16_backward takes this forward's out and lse. */
#ifndef MESHTRAIN_ATTN_WGMMA_H
#define MESHTRAIN_ATTN_WGMMA_H

#ifdef __cplusplus
extern "C" {
#endif

/* 1 for the head dims the kernel handles (64 and 128); 0 otherwise. */
int attn_wgmma_supported(int HD);

/* 1 when the current device is compute capability 9.0 (asked once per process, then cached). */
int attn_wgmma_device_ok(void);

/* NULL when this process's device can launch the kernel for HD (64 or 128; asked once per HD,
 * which also opts the kernel into its dynamic shared memory), else why not (a static string).
 * attn_wgmma_forward dies with the same reason. */
const char *attn_wgmma_unlaunchable(int HD);

/* out = causal softmax(q k^T / sqrt(HD)) v per head, and lse; both overwritten (rows < T only). */
void attn_wgmma_forward(void *out, float *lse, const void *qkv, int B, int T, int NH, int HD, void *stream);

#ifdef __cplusplus
}
#endif
#endif
