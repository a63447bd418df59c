/* src/ops/cuda/adamw.cuh: the AdamW kernels.
 * Part of ops_cuda.cu, which includes it at this point of its one translation unit (after
 * the helpers it uses): not a header to include anywhere else. */
/* ------------------------------------------------------------------------------------ */
/* adamw                                                                                 */

/* Elementwise; the scalars come from the host computed as op_adamw computes them, and the
 * operations are op_adamw's, one rounding each, in its order: bitwise the CPU result in
 * fp32. With bf16 state (sbf) the same fp32 arithmetic runs on the widened values, and each
 * of param, m and v is rounded to bf16 once, when stored. act (NULL: none) receives the
 * updated fp32 parameters rounded to bf16, as to_act_kernel rounds them. */
typedef struct {
    float decay, w1, w1c, b2, w2, neg_step, bc2_sqrt, eps, grad_scale;
    int small;
} AdamwArgs;
/* one element: p, m, v updated in place (fp32 values) */
static __device__ __forceinline__ void adamw_elem(float *p, float g, float *m, float *v, const AdamwArgs *a) {
    float gr = __fmul_rn(g, a->grad_scale);
    float mi = *m;
    float mn = a->small ? __fadd_rn(mi, __fmul_rn(a->w1, __fsub_rn(gr, mi)))
                        : __fsub_rn(gr, __fmul_rn(__fsub_rn(gr, mi), a->w1c));
    *m = mn;
    float vi = __fmul_rn(*v, a->b2);
    vi = __fadd_rn(vi, __fmul_rn(__fmul_rn(a->w2, gr), gr));
    *v = vi;
    float den = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), a->bc2_sqrt), a->eps);
    float pi = __fmul_rn(*p, a->decay);
    *p = __fadd_rn(pi, __fdiv_rn(__fmul_rn(a->neg_step, mn), den));
}
static __global__ void adamw_kernel(void *param, const void *grad, void *m, void *v, size_t n, AdamwArgs a, int sbf,
                                    bf16 *act) {
    GRID_STRIDE(i, n) {
        float p = ld(param, i, sbf), mi = ld(m, i, sbf), vi = ld(v, i, sbf);
        adamw_elem(&p, ld(grad, i, sbf), &mi, &vi, &a);
        st(m, i, mi, sbf);
        st(v, i, vi, sbf);
        st(param, i, p, sbf);
        if (act) st(act, i, p, 1);
    }
}
/* The same on 16-byte vectors (all four arrays 16-byte aligned): n / 8 vectors, then the
 * n % 8 last elements by the first threads. */
static __global__ void adamw8_kernel(void *param, const void *grad, void *m, void *v, size_t n, AdamwArgs a, int sbf,
                                     bf16 *act) {
    size_t nv = n / 8;
    GRID_STRIDE(j, nv) {
        float p[8], g[8], mi[8], vi[8];
        ld8(p, param, 8 * j, sbf);
        ld8(g, grad, 8 * j, sbf);
        ld8(mi, m, 8 * j, sbf);
        ld8(vi, v, 8 * j, sbf);
#pragma unroll
        for (int e = 0; e < 8; e++) adamw_elem(&p[e], g[e], &mi[e], &vi[e], &a);
        st8(m, 8 * j, mi, sbf);
        st8(v, 8 * j, vi, sbf);
        st8(param, 8 * j, p, sbf);
        if (act) st8(act, 8 * j, p, 1);
    }
    size_t i = 8 * nv + (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float p = ld(param, i, sbf), mi = ld(m, i, sbf), vi = ld(v, i, sbf);
        adamw_elem(&p, ld(grad, i, sbf), &mi, &vi, &a);
        st(m, i, mi, sbf);
        st(v, i, vi, sbf);
        st(param, i, p, sbf);
        if (act) st(act, i, p, 1);
    }
}
