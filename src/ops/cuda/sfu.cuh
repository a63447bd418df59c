/* 2^x on the SFU: ex2.approx (relative error about 2^-22, 2^-inf = 0, subnormal results
 * flushed to 0) in one instruction where exp2f and expf take several. The attention's
 * softmax and the cross-entropy's exps issue so many that instruction issue bounds them.
 * Device code only; included by src/ops/cuda/attn_bf16.cu, crossentropy.cuh and wgmma_util.cuh. */
#pragma once

static __device__ __forceinline__ float sfu_ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
