/* Two floats in one 32-bit register as bf16x2 and back: the packing the tensor-core attention
 * kernels feed their matrix products with. Device code only; included by
 * src/ops/cuda/attn_bf16.cu and src/ops/cuda/wgmma_util.cuh. */
#pragma once
#include <stdint.h>

/* two floats -> bf16x2 (round to nearest even), lo in the low half (the lower column) */
static __device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
static __device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
static __device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
