/* src/ops/cuda/rope.cuh: the rotary embedding kernel.
 * Part of ops_cuda.cu, which includes it at this point of its one translation unit (after
 * the helpers it uses): not a header to include anywhere else. */
/* ------------------------------------------------------------------------------------ */
/* rope                                                                                  */

/* One thread per (token, q-or-k head, pair). Separately rounded products and sums (no FMA),
 * as the CPU backend computes them. */
static __global__ void rope_kernel(void *qkv, const float *cos_t, const float *sin_t, int B, int T, int NH, int HD,
                                   float dir, int bf) {
    int half = HD / 2, C = NH * HD;
    size_t total = (size_t)B * T * 2 * NH * half;
    GRID_STRIDE(idx, total) {
        int i = (int)(idx % half);
        size_t r = idx / half;
        int hh = (int)(r % (2 * NH)); /* q heads, then k heads: contiguous in the row */
        size_t bt = r / (2 * NH);
        int t = (int)(bt % T);
        size_t x = bt * 3 * C + (size_t)hh * HD + 2 * i;
        float c = cos_t[(size_t)t * half + i], s = dir * sin_t[(size_t)t * half + i];
        float2 v = ld2(qkv, x, bf); /* x is even: HD and the row lengths are */
        st2(qkv, x, make_float2(__fsub_rn(__fmul_rn(v.x, c), __fmul_rn(v.y, s)), __fadd_rn(__fmul_rn(v.x, s), __fmul_rn(v.y, c))),
            bf);
    }
}

/* The same on 16-byte vectors (HD % 8 == 0): a thread rotates 4 pairs of one head with one
 * load of the row and one float4 each of the cos and sin tables (which stay in cache). */
static __global__ void rope8_kernel(void *qkv, const float *cos_t, const float *sin_t, int T, int NH, int HD,
                                    size_t nvec, float dir, int bf) {
    int half = HD / 2, C = NH * HD, per_tok = C / 4; /* vectors of q and k in one token */
    GRID_STRIDE(idx, nvec) {
        size_t bt = idx / per_tok;
        int col = (int)(idx - bt * per_tok) * 8; /* in q | k of the token */
        int t = (int)(bt % T), i = (col % HD) / 2;
        size_t x = bt * 3 * C + col;
        float4 c4 = *(const float4 *)(cos_t + (size_t)t * half + i), s4 = *(const float4 *)(sin_t + (size_t)t * half + i);
        float cs[4] = {c4.x, c4.y, c4.z, c4.w}, sn[4] = {dir * s4.x, dir * s4.y, dir * s4.z, dir * s4.w};
        float v[8], o[8];
        ld8(v, qkv, x, bf);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float x0 = v[2 * k], x1 = v[2 * k + 1];
            o[2 * k] = __fsub_rn(__fmul_rn(x0, cs[k]), __fmul_rn(x1, sn[k]));
            o[2 * k + 1] = __fadd_rn(__fmul_rn(x0, sn[k]), __fmul_rn(x1, cs[k]));
        }
        st8(qkv, x, o, bf);
    }
}
