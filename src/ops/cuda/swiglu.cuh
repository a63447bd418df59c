/* src/ops/cuda/swiglu.cuh: SwiGLU forward and backward kernels.
 * Part of ops_cuda.cu, which includes it at this point of its one translation unit (after
 * the helpers it uses): not a header to include anywhere else. */
/* ------------------------------------------------------------------------------------ */
/* swiglu                                                                                */

/* Two hidden units per thread when H is even (pairs: step 2), else one (step 1). */
static __device__ __forceinline__ float silu_f(float g) { return g / (1.0f + expf(-g)); }
static __global__ void swiglu2_forward_kernel(void *out, const void *gu, int N, int H, int bf) {
    size_t total = (size_t)N * H / 2;
    GRID_STRIDE(j, total) {
        size_t i = 2 * j, n = i / H, k = i % H;
        float2 gt = ld2(gu, n * 2 * H + k, bf), up = ld2(gu, n * 2 * H + H + k, bf);
        st2(out, i, make_float2(silu_f(gt.x) * up.x, silu_f(gt.y) * up.y), bf);
    }
}
static __global__ void swiglu2_backward_kernel(void *dgu, const void *dout, const void *gu, int N, int H, int bf,
                                               int acc) {
    size_t total = (size_t)N * H / 2;
    GRID_STRIDE(j, total) {
        size_t i = 2 * j, n = i / H, k = i % H, ig = n * 2 * H + k, iu = ig + H;
        float2 gt = ld2(gu, ig, bf), up = ld2(gu, iu, bf), d = ld2(dout, i, bf), dg = {0.0f, 0.0f},
               du = {0.0f, 0.0f};
        if (acc) dg = ld2(dgu, ig, bf), du = ld2(dgu, iu, bf);
        float s0 = 1.0f / (1.0f + expf(-gt.x)), s1 = 1.0f / (1.0f + expf(-gt.y));
        dg.x += d.x * up.x * (s0 * (1.0f + gt.x * (1.0f - s0)));
        dg.y += d.y * up.y * (s1 * (1.0f + gt.y * (1.0f - s1)));
        du.x += d.x * (gt.x * s0);
        du.y += d.y * (gt.y * s1);
        st2(dgu, ig, dg, bf);
        st2(dgu, iu, du, bf);
    }
}
/* Eight hidden units per thread in 16-byte vectors (H % 8 == 0); nvec = N * H / 8. With
 * bf16 activations (bf) the sigmoid takes the SFU's exp and reciprocal (__expf, __fdividef:
 * relative error ~1e-6, far below the bf16 rounding of the result) instead of expf and an
 * IEEE division, a dozen instructions fewer per unit; fp32 keeps the exact ones. The row
 * index is a 32-bit division where nvec allows. */
static __device__ __forceinline__ float sigmoid_f(float g, int fast) {
    return fast ? __fdividef(1.0f, 1.0f + __expf(-g)) : 1.0f / (1.0f + expf(-g));
}
static __device__ __forceinline__ size_t row_of(size_t j, int h8, size_t nvec) {
    return nvec >> 32 ? j / (size_t)h8 : (size_t)((unsigned)j / (unsigned)h8);
}
static __global__ void swiglu8_forward_kernel(void *out, const void *gu, int H, size_t nvec, int bf) {
    int h8 = H / 8;
    GRID_STRIDE(j, nvec) {
        size_t n = row_of(j, h8, nvec);
        int k = (int)(j - n * h8) * 8;
        size_t ig = n * 2 * H + k;
        float gt[8], up[8], o[8];
        ld8(gt, gu, ig, bf);
        ld8(up, gu, ig + H, bf);
#pragma unroll
        for (int e = 0; e < 8; e++) o[e] = bf ? gt[e] * sigmoid_f(gt[e], 1) * up[e] : silu_f(gt[e]) * up[e];
        st8(out, 8 * j, o, bf);
    }
}
static __global__ void swiglu8_backward_kernel(void *dgu, const void *dout, const void *gu, int H, size_t nvec,
                                               int bf, int acc) {
    int h8 = H / 8;
    GRID_STRIDE(j, nvec) {
        size_t n = row_of(j, h8, nvec);
        int k = (int)(j - n * h8) * 8;
        size_t ig = n * 2 * H + k, iu = ig + H;
        float gt[8], up[8], d[8], dg[8] = {0}, du[8] = {0};
        ld8(gt, gu, ig, bf);
        ld8(up, gu, iu, bf);
        ld8(d, dout, 8 * j, bf);
        if (acc) {  /* else written: dgu is not read */
            ld8(dg, dgu, ig, bf);
            ld8(du, dgu, iu, bf);
        }
#pragma unroll
        for (int e = 0; e < 8; e++) {
            float s = sigmoid_f(gt[e], bf);
            dg[e] += d[e] * up[e] * (s * (1.0f + gt[e] * (1.0f - s)));
            du[e] += d[e] * (gt[e] * s);
        }
        st8(dgu, ig, dg, bf);
        st8(dgu, iu, du, bf);
    }
}
static __global__ void swiglu_forward_kernel(void *out, const void *gu, int N, int H, int bf) {
    size_t total = (size_t)N * H;
    GRID_STRIDE(i, total) {
        size_t n = i / H, k = i % H;
        float gt = ld(gu, n * 2 * H + k, bf), up = ld(gu, n * 2 * H + H + k, bf);
        st(out, i, gt / (1.0f + expf(-gt)) * up, bf);
    }
}

static __global__ void swiglu_backward_kernel(void *dgu, const void *dout, const void *gu, int N, int H, int bf,
                                              int acc) {
    size_t total = (size_t)N * H;
    GRID_STRIDE(i, total) {
        size_t n = i / H, k = i % H, ig = n * 2 * H + k, iu = ig + H;
        float gt = ld(gu, ig, bf), up = ld(gu, iu, bf), d = ld(dout, i, bf);
        float s = 1.0f / (1.0f + expf(-gt));
        float silu = gt * s;
        st(dgu, ig, (acc ? ld(dgu, ig, bf) : 0.0f) + d * up * (s * (1.0f + gt * (1.0f - s))), bf);
        st(dgu, iu, (acc ? ld(dgu, iu, bf) : 0.0f) + d * silu, bf);
    }
}
