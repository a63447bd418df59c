/* src/ops/cuda/common.cuh: warp and block reductions, and the fp32/bf16 loads and stores every kernel uses.
 * Part of ops_cuda.cu, which includes it at this point of its one translation unit (after
 * the helpers it uses): not a header to include anywhere else. */
/* ------------------------------------------------------------------------------------ */
/* reductions (blockDim.x must be a multiple of 32; every thread gets the result)        */

#define FULL_MASK 0xffffffffu

/* Activations are fp32 or bf16 (precision=mixed), chosen once per process; kernels take
 * them as void pointers and a flag `bf`, uniform across the grid, so one kernel serves
 * both. Arithmetic is always fp32. */
typedef __nv_bfloat16 bf16;
static __device__ __forceinline__ float ld(const void *p, size_t i, int bf) {
    return bf ? __bfloat162float(((const bf16 *)p)[i]) : ((const float *)p)[i];
}
static __device__ __forceinline__ void st(void *p, size_t i, float v, int bf) {
    if (bf) ((bf16 *)p)[i] = __float2bfloat16(v);
    else ((float *)p)[i] = v;
}
/* Elements i and i+1 in one load or store (i even, the array 4-byte (bf16) or 8-byte (fp32)
 * aligned: every activation buffer and row of even length is). */
static __device__ __forceinline__ float2 ld2(const void *p, size_t i, int bf) {
    if (bf) return __bfloat1622float2(*(const __nv_bfloat162 *)((const bf16 *)p + i));
    return *(const float2 *)((const float *)p + i);
}
static __device__ __forceinline__ void st2(void *p, size_t i, float2 v, int bf) {
    if (bf) *(__nv_bfloat162 *)((bf16 *)p + i) = __float22bfloat162_rn(v);
    else *(float2 *)((float *)p + i) = v;
}

/* Eight consecutive elements, i a multiple of 8 and the array 16-byte aligned: one 16-byte
 * access in bf16, two in fp32. The memory-bound kernels move their data in these. */
static __device__ __forceinline__ void unpack8_bf16(float *v, uint4 u) {
    const __nv_bfloat162 *h = (const __nv_bfloat162 *)&u;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        float2 f = __bfloat1622float2(h[k]);
        v[2 * k] = f.x;
        v[2 * k + 1] = f.y;
    }
}
static __device__ __forceinline__ void ld8(float *v, const void *p, size_t i, int bf) {
    if (bf) {
        unpack8_bf16(v, *(const uint4 *)((const bf16 *)p + i));
    } else {
        float4 a = *(const float4 *)((const float *)p + i), b = *(const float4 *)((const float *)p + i + 4);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    }
}
static __device__ __forceinline__ uint4 pack8_bf16(const float *v) {
    uint4 u;
    __nv_bfloat162 *h = (__nv_bfloat162 *)&u;
#pragma unroll
    for (int k = 0; k < 4; k++) h[k] = __float22bfloat162_rn(make_float2(v[2 * k], v[2 * k + 1]));
    return u;
}
static __device__ __forceinline__ void st8(void *p, size_t i, const float *v, int bf) {
    if (bf) {
        *(uint4 *)((bf16 *)p + i) = pack8_bf16(v);
    } else {
        *(float4 *)((float *)p + i) = make_float4(v[0], v[1], v[2], v[3]);
        *(float4 *)((float *)p + i + 4) = make_float4(v[4], v[5], v[6], v[7]);
    }
}

static __device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}
static __device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}
static __device__ __forceinline__ double warp_sum_double(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}
static __device__ float block_max(float v) {
    __shared__ float sh[32];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads(); /* sh may still be read by a previous call */
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    return warp_max(lane < nw ? sh[lane] : -INFINITY);
}
static __device__ double block_sum_double(double v) {
    __shared__ double sh[32];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum_double(v);
    __syncthreads();
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    return warp_sum_double(lane < nw ? sh[lane] : 0.0);
}
