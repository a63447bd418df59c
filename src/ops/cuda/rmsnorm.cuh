/* src/ops/cuda/rmsnorm.cuh: rmsnorm forward and backward kernels.
 * Part of ops_cuda.cu, which includes it at this point of its one translation unit (after
 * the helpers it uses): not a header to include anywhere else. */
/* ------------------------------------------------------------------------------------ */
/* rmsnorm                                                                               */

/* One warp per row (rows are short: C ~ 1e3), 8 rows per block; lanes stride the
 * channels so loads coalesce.
 * branch != NULL (op_add_rmsnorm_forward): x += branch first, each sum computed, rounded
 * and stored exactly as add_kernel does, and the norm taken of the stored value, so the
 * result is bitwise the two ops one after the other. A lane re-reads only what it wrote. */
#define ROW_WARPS 8
static __device__ __forceinline__ float round_to(float v, int bf) {
    return bf ? __bfloat162float(__float2bfloat16(v)) : v;
}
static __global__ void rmsnorm_forward_kernel(void *out, float *rstd, void *x, const void *branch, const void *w,
                                              int N, int C, float eps, int bf) {
    int row = blockIdx.x * ROW_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= N) return;
    size_t r0 = (size_t)row * C;
    float ss = 0.0f;
    if (!(C & 1)) { /* two channels per load */
        for (int c = 2 * lane; c < C; c += 64) {
            float2 xv = ld2(x, r0 + c, bf);
            if (branch) {
                float2 b = ld2(branch, r0 + c, bf);
                xv = make_float2(round_to(__fadd_rn(xv.x, b.x), bf), round_to(__fadd_rn(xv.y, b.y), bf));
                st2(x, r0 + c, xv, bf);
            }
            ss += xv.x * xv.x + xv.y * xv.y;
        }
    } else {
        for (int c = lane; c < C; c += 32) {
            float xv = ld(x, r0 + c, bf);
            if (branch) {
                xv = round_to(__fadd_rn(xv, ld(branch, r0 + c, bf)), bf);
                st(x, r0 + c, xv, bf);
            }
            ss += xv * xv;
        }
    }
    ss = warp_sum(ss);
    float r = 1.0f / sqrtf(ss / (float)C + eps);
    if (lane == 0) rstd[row] = r;
    if (!(C & 1)) {
        for (int c = 2 * lane; c < C; c += 64) {
            float2 xv = ld2(x, r0 + c, bf), wv = ld2(w, c, bf);
            st2(out, r0 + c, make_float2((xv.x * r) * wv.x, (xv.y * r) * wv.y), bf);
        }
    } else {
        for (int c = lane; c < C; c += 32) st(out, r0 + c, (ld(x, r0 + c, bf) * r) * ld(w, c, bf), bf);
    }
}

/* The same with C % 8 == 0, in 16-byte vectors: lane l takes channels [8(32k + l), +8). The
 * first RMS_VEC vectors of a lane stay in registers between the two passes, so rows of up
 * to 32 * 8 * RMS_VEC channels are read from memory once; longer rows read the rest again. */
#define RMS_VEC 4
/* x += 8 elements of branch at i (see rmsnorm_forward_kernel), leaving the stored sums in v. */
static __device__ __forceinline__ void add8_round(float *v, void *x, const void *branch, size_t i, int bf) {
    float b[8];
    ld8(b, branch, i, bf);
#pragma unroll
    for (int e = 0; e < 8; e++) v[e] = round_to(__fadd_rn(v[e], b[e]), bf);
    st8(x, i, v, bf);
}
/* out[i, +8) = v * r * w[c, +8): a normed row's 8 channels, written */
static __device__ __forceinline__ void rms_out8(void *out, size_t i, const float *v, const void *w, int c, float r,
                                                int bf) {
    float wv[8], o[8];
    ld8(wv, w, c, bf);
#pragma unroll
    for (int e = 0; e < 8; e++) o[e] = (v[e] * r) * wv[e];
    st8(out, i, o, bf);
}
static __global__ void rmsnorm8_forward_kernel(void *out, float *rstd, void *x, const void *branch, const void *w,
                                               int N, int C, float eps, int bf) {
    int row = blockIdx.x * ROW_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= N) return;
    size_t r0 = (size_t)row * C;
    float xv[RMS_VEC][8], ss = 0.0f;
#pragma unroll
    for (int k = 0; k < RMS_VEC; k++) {
        int c = (32 * k + lane) * 8;
        if (c < C) {
            ld8(xv[k], x, r0 + c, bf);
            if (branch) add8_round(xv[k], x, branch, r0 + c, bf);
        }
    }
#pragma unroll
    for (int k = 0; k < RMS_VEC; k++)
        if ((32 * k + lane) * 8 < C)
#pragma unroll
            for (int e = 0; e < 8; e++) ss += xv[k][e] * xv[k][e];
    for (int c = (32 * RMS_VEC + lane) * 8; c < C; c += 256) {
        float t[8];
        ld8(t, x, r0 + c, bf);
        if (branch) add8_round(t, x, branch, r0 + c, bf);
#pragma unroll
        for (int e = 0; e < 8; e++) ss += t[e] * t[e];
    }
    ss = warp_sum(ss);
    float r = 1.0f / sqrtf(ss / (float)C + eps);
    if (lane == 0) rstd[row] = r;
#pragma unroll
    for (int k = 0; k < RMS_VEC; k++) {
        int c = (32 * k + lane) * 8;
        if (c < C) rms_out8(out, r0 + c, xv[k], w, c, r, bf);
    }
    for (int c = (32 * RMS_VEC + lane) * 8; c < C; c += 256) {
        float t[8];
        ld8(t, x, r0 + c, bf);
        rms_out8(out, r0 + c, t, w, c, r, bf);
    }
}

/* Wide rows (cuda_rmsnorm_wide: C % 8 == 0, 1024 < C <= 32768), one row a block: thread t
 * holds channels [8(kT + t), +8) for k < VEC in registers (the row read once: one warp a row
 * read 3 of 4,096 channels twice and left SMs idle at a tp rank's 1,024 rows: on an H200 1.6
 * TB/s there, now 2.5; 2.4 -> 2.8 at 4,096 rows), the sum of squares taken over the block
 * (each warp's, then the warps' in order, the same on every thread). Threads, VEC and the
 * launch bound as the wide backward's. */
template <int VEC, int MAXT>
static __global__ void __launch_bounds__(MAXT)
rmsnorm_wide_forward_kernel(void *out, float *rstd, void *x, const void *branch, const void *w, int C, float eps,
                            int bf) {
    __shared__ float red[32];
    int T = blockDim.x, t = threadIdx.x, warp = t >> 5, lane = t & 31, nw = T >> 5;
    size_t r0 = (size_t)blockIdx.x * C;
    float xv[VEC][8], ss = 0.0f;
#pragma unroll
    for (int k = 0; k < VEC; k++) {
        int c = (k * T + t) * 8;
        if (c < C) {
            ld8(xv[k], x, r0 + c, bf);
            if (branch) add8_round(xv[k], x, branch, r0 + c, bf);
        }
    }
#pragma unroll
    for (int k = 0; k < VEC; k++)
        if ((k * T + t) * 8 < C)
#pragma unroll
            for (int e = 0; e < 8; e++) ss += xv[k][e] * xv[k][e];
    ss = warp_sum(ss);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    ss = 0.0f;
    for (int k = 0; k < nw; k++) ss += red[k];
    float r = 1.0f / sqrtf(ss / (float)C + eps);
    if (t == 0) rstd[blockIdx.x] = r;
#pragma unroll
    for (int k = 0; k < VEC; k++) {
        int c = (k * T + t) * 8;
        if (c < C) rms_out8(out, r0 + c, xv[k], w, c, r, bf);
    }
}

/* Backward in one pass over the rows: block b owns rows [N*b/nb, N*(b+1)/nb), its warps take
 * every RMS_BWD_WARPS-th of them. Per row, dx += rstd*w*g - rstd^3 (g.w.x)/C x; and the
 * warp adds the row's dw terms g*x*rstd into its own shared-memory row of C floats. At the
 * end the block sums its warps' rows in warp order into part[b, :] (the second pass adds
 * the blocks in order): deterministic, and x and dout are read once. Even C goes two
 * channels per load. */
#define RMS_BWD_WARPS 4
static __global__ void __launch_bounds__(RMS_BWD_WARPS * 32)
rmsnorm_backward_kernel(void *dx, float *part, const void *dout, const void *x, const void *w, const float *rstd,
                        int N, int C, int nb, int bf) {
    extern __shared__ float acc[]; /* [RMS_BWD_WARPS][C] */
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, b = blockIdx.x, pairs = !(C & 1);
    float *my = acc + (size_t)warp * C;
    for (int c = lane; c < C; c += 32) my[c] = 0.0f;
    int n0 = (int)((long long)N * b / nb), n1 = (int)((long long)N * (b + 1) / nb);
    for (int row = n0 + warp; row < n1; row += RMS_BWD_WARPS) {
        size_t r0 = (size_t)row * C;
        float r = rstd[row], dot = 0.0f;
        if (pairs) {
            for (int c = 2 * lane; c < C; c += 64) {
                float2 g = ld2(dout, r0 + c, bf), xv = ld2(x, r0 + c, bf);
                float2 wv = dx ? ld2(w, c, bf) : make_float2(0.0f, 0.0f);  /* dw alone: w may be NULL */
                dot += g.x * wv.x * xv.x + g.y * wv.y * xv.y;
                my[c] += g.x * (xv.x * r);
                my[c + 1] += g.y * (xv.y * r);
            }
        } else {
            for (int c = lane; c < C; c += 32) {
                float g = ld(dout, r0 + c, bf), xv = ld(x, r0 + c, bf);
                if (dx) dot += g * ld(w, c, bf) * xv;
                my[c] += g * (xv * r);
            }
        }
        dot = warp_sum(dot);
        if (!dx) continue;
        float coef = r * r * r * dot / (float)C;
        if (pairs) {
            for (int c = 2 * lane; c < C; c += 64) {
                float2 g = ld2(dout, r0 + c, bf), xv = ld2(x, r0 + c, bf), wv = ld2(w, c, bf), d = ld2(dx, r0 + c, bf);
                d.x += r * wv.x * g.x - coef * xv.x;
                d.y += r * wv.y * g.y - coef * xv.y;
                st2(dx, r0 + c, d, bf);
            }
        } else {
            for (int c = lane; c < C; c += 32)
                st(dx, r0 + c, ld(dx, r0 + c, bf) + (r * ld(w, c, bf) * ld(dout, r0 + c, bf) - coef * ld(x, r0 + c, bf)),
                   bf);
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float sum = 0.0f;
        for (int k = 0; k < RMS_BWD_WARPS; k++) sum += acc[(size_t)k * C + c];
        part[(size_t)b * C + c] = sum;
    }
}

/* The same blocks, rows and partials with C % 8 == 0 and C <= 256 * RMS_VEC, in 16-byte
 * vectors: a lane owns channels [8(32k + l), +8) of every row its warp takes, so it keeps
 * their dw sums in registers (in row order, as the shared-memory rows above do) and writes
 * them to shared memory once. dout, x and dx of a row are loaded together (one memory
 * latency per row) and kept, as loaded, in registers for the dx update. The body is
 * compiled once per element type (bf a constant), so bf16 rows take half the registers
 * and more warps fit on an SM to hide the per-row latency. */
static __device__ __forceinline__ void ldraw8(uint4 *r, const void *p, size_t i, int bf) {
    if (bf) {
        r[0] = *(const uint4 *)((const bf16 *)p + i);
    } else {
        r[0] = *(const uint4 *)((const float *)p + i);
        r[1] = *(const uint4 *)((const float *)p + i + 4);
    }
}
static __device__ __forceinline__ void unraw8(float *v, const uint4 *r, int bf) {
    if (bf) {
        unpack8_bf16(v, r[0]);
    } else {
        v[0] = __uint_as_float(r[0].x), v[1] = __uint_as_float(r[0].y), v[2] = __uint_as_float(r[0].z);
        v[3] = __uint_as_float(r[0].w), v[4] = __uint_as_float(r[1].x), v[5] = __uint_as_float(r[1].y);
        v[6] = __uint_as_float(r[1].z), v[7] = __uint_as_float(r[1].w);
    }
}
static __device__ __forceinline__ void rmsnorm8_backward_body(void *dx, float *part, const void *dout, const void *x,
                                                              const void *w, const float *rstd, int N, int C, int nb,
                                                              const int bf) {
    extern __shared__ float acc[]; /* [RMS_BWD_WARPS][C] */
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, b = blockIdx.x;
    float dwa[RMS_VEC][8];
#pragma unroll
    for (int k = 0; k < RMS_VEC; k++)
#pragma unroll
        for (int e = 0; e < 8; e++) dwa[k][e] = 0.0f;
    int n0 = (int)((long long)N * b / nb), n1 = (int)((long long)N * (b + 1) / nb);
    for (int row = n0 + warp; row < n1; row += RMS_BWD_WARPS) {
        size_t r0 = (size_t)row * C;
        float r = rstd[row], dot = 0.0f;
        uint4 graw[RMS_VEC][2], xraw[RMS_VEC][2], draw[RMS_VEC][2];
#pragma unroll
        for (int k = 0; k < RMS_VEC; k++) {
            int c = (32 * k + lane) * 8;
            if (c < C) {
                ldraw8(graw[k], dout, r0 + c, bf);
                ldraw8(xraw[k], x, r0 + c, bf);
                if (dx) ldraw8(draw[k], dx, r0 + c, bf);
            }
        }
#pragma unroll
        for (int k = 0; k < RMS_VEC; k++) {
            int c = (32 * k + lane) * 8;
            if (c < C) {
                float g[8], xv[8], wv[8];
                unraw8(g, graw[k], bf);
                unraw8(xv, xraw[k], bf);
                if (dx) ld8(wv, w, c, bf);  /* dw alone needs no weights (w may be NULL) */
                else for (int e = 0; e < 8; e++) wv[e] = 0.0f;
#pragma unroll
                for (int e = 0; e < 8; e++) {
                    dot += g[e] * wv[e] * xv[e];
                    dwa[k][e] += g[e] * (xv[e] * r);
                }
            }
        }
        dot = warp_sum(dot);
        if (!dx) continue;
        float coef = r * r * r * dot / (float)C;
#pragma unroll
        for (int k = 0; k < RMS_VEC; k++) {
            int c = (32 * k + lane) * 8;
            if (c < C) {
                float g[8], xv[8], wv[8], d[8];
                unraw8(g, graw[k], bf);
                unraw8(xv, xraw[k], bf);
                unraw8(d, draw[k], bf);
                ld8(wv, w, c, bf);
#pragma unroll
                for (int e = 0; e < 8; e++) d[e] += r * wv[e] * g[e] - coef * xv[e];
                st8(dx, r0 + c, d, bf);
            }
        }
    }
    float *my = acc + (size_t)warp * C;
#pragma unroll
    for (int k = 0; k < RMS_VEC; k++) {
        int c = (32 * k + lane) * 8;
        if (c < C)
#pragma unroll
            for (int e = 0; e < 8; e++) my[c + e] = dwa[k][e];
    }
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float sum = 0.0f;
        for (int k = 0; k < RMS_BWD_WARPS; k++) sum += acc[(size_t)k * C + c];
        part[(size_t)b * C + c] = sum;
    }
}
static __global__ void __launch_bounds__(RMS_BWD_WARPS * 32)
rmsnorm8_backward_bf16_kernel(void *dx, float *part, const void *dout, const void *x, const void *w, const float *rstd,
                              int N, int C, int nb) {
    rmsnorm8_backward_body(dx, part, dout, x, w, rstd, N, C, nb, 1);
}
static __global__ void __launch_bounds__(RMS_BWD_WARPS * 32)
rmsnorm8_backward_f32_kernel(void *dx, float *part, const void *dout, const void *x, const void *w, const float *rstd,
                             int N, int C, int nb) {
    rmsnorm8_backward_body(dx, part, dout, x, w, rstd, N, C, nb, 0);
}

/* Wide rows (C % 8 == 0, 256 RMS_VEC < C <= 8192 RMS_VEC: the 7B model's 4096 channels, which
 * the kernels above took with one warp a row and 16 KB of shared memory a warp, at about a
 * sixth of the memory's speed): the block's threads share each row, thread t taking channels
 * [8(kT + t), +8) for k < VEC (T threads, coalesced), so it keeps those channels' dw sums
 * in registers over all the block's rows, in row order, and writes them to part[b, :] once;
 * a row's g.w.x is summed over the block (warp sums, then the warps in order; red is double
 * buffered by row parity, so one barrier a row). part = NULL: dx only. dx's old values are
 * read after the barrier, not held across it. VEC and the launch bound MAXT (T <= MAXT)
 * are chosen together so that a thread's registers fit without spilling where they can:
 * C <= 16 * 512 takes VEC 2 under 512 threads (up to 128 registers a thread); wider rows
 * VEC 4 under 1024 (64 registers). */
#define RMS_WIDE_NARROW_C (16 * 512) /* the widest row for VEC 2, MAXT 512 */
template <int VEC>
static __device__ __forceinline__ void rmsnorm_wide_backward_body(void *dx, float *part, const void *dout,
                                                                  const void *x, const void *w, const float *rstd,
                                                                  int N, int C, int nb, const int bf) {
    __shared__ float red[2][32];
    int T = blockDim.x, t = threadIdx.x, warp = t >> 5, lane = t & 31, nw = T >> 5, b = blockIdx.x;
    float dwa[VEC][8];
#pragma unroll
    for (int k = 0; k < VEC; k++)
#pragma unroll
        for (int e = 0; e < 8; e++) dwa[k][e] = 0.0f;
    int n0 = (int)((long long)N * b / nb), n1 = (int)((long long)N * (b + 1) / nb);
    for (int row = n0; row < n1; row++) {
        size_t r0 = (size_t)row * C;
        float r = rstd[row], dot = 0.0f;
        uint4 graw[VEC][2], xraw[VEC][2];
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            int c = (k * T + t) * 8;
            if (c < C) {
                ldraw8(graw[k], dout, r0 + c, bf);
                ldraw8(xraw[k], x, r0 + c, bf);
            }
        }
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            int c = (k * T + t) * 8;
            if (c < C) {
                float g[8], xv[8], wv[8];
                unraw8(g, graw[k], bf);
                unraw8(xv, xraw[k], bf);
                if (dx) {
                    ld8(wv, w, c, bf);
#pragma unroll
                    for (int e = 0; e < 8; e++) dot += g[e] * wv[e] * xv[e];
                }
                if (part)
#pragma unroll
                    for (int e = 0; e < 8; e++) dwa[k][e] += g[e] * (xv[e] * r);
            }
        }
        if (!dx) continue;
        dot = warp_sum(dot);
        if (lane == 0) red[row & 1][warp] = dot;
        __syncthreads();
        dot = 0.0f;
        for (int k = 0; k < nw; k++) dot += red[row & 1][k];
        float coef = r * r * r * dot / (float)C;
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            int c = (k * T + t) * 8;
            if (c < C) {
                float g[8], xv[8], wv[8], d[8];
                unraw8(g, graw[k], bf);
                unraw8(xv, xraw[k], bf);
                ld8(d, dx, r0 + c, bf);
                ld8(wv, w, c, bf);
#pragma unroll
                for (int e = 0; e < 8; e++) d[e] += r * wv[e] * g[e] - coef * xv[e];
                st8(dx, r0 + c, d, bf);
            }
        }
    }
    if (!part) return;
#pragma unroll
    for (int k = 0; k < VEC; k++) {
        int c = (k * T + t) * 8;
        if (c < C)
#pragma unroll
            for (int e = 0; e < 8; e++) part[(size_t)b * C + c + e] = dwa[k][e];
    }
}
template <int VEC, int MAXT>
static __global__ void __launch_bounds__(MAXT)
rmsnorm_wide_backward_bf16_kernel(void *dx, float *part, const void *dout, const void *x, const void *w,
                                  const float *rstd, int N, int C, int nb) {
    rmsnorm_wide_backward_body<VEC>(dx, part, dout, x, w, rstd, N, C, nb, 1);
}
template <int VEC, int MAXT>
static __global__ void __launch_bounds__(MAXT)
rmsnorm_wide_backward_f32_kernel(void *dx, float *part, const void *dout, const void *x, const void *w,
                                 const float *rstd, int N, int C, int nb) {
    rmsnorm_wide_backward_body<VEC>(dx, part, dout, x, w, rstd, N, C, nb, 0);
}

/* dw, second pass: a block of 32 x 32 threads per 32 channels; thread (x, y) sums the
 * partials of channel x in the y-th of 32 runs of consecutive blocks, in block order, and
 * then y = 0 adds the 32 run sums in order. The order depends on nb (so on N) alone; one
 * thread per channel walking all nb partials took 0.1 ms (a chain of 1024 dependent loads). */
static __global__ void rmsnorm_dw_reduce_kernel(void *dw, const float *part, int C, int nb, int sbf) {
    __shared__ float run[32][33];
    int x = threadIdx.x & 31, y = threadIdx.x >> 5, c = blockIdx.x * 32 + x;
    int len = (nb + 31) / 32, b0 = y * len, b1 = b0 + len < nb ? b0 + len : nb;
    float s = 0.0f;
    if (c < C)
        for (int b = b0; b < b1; b++) s += part[(size_t)b * C + c];
    run[y][x] = s;
    __syncthreads();
    if (y == 0 && c < C) {
        float t = 0.0f;
        for (int k = 0; k < 32; k++) t += run[k][x];
        st(dw, c, ld(dw, c, sbf) + t, sbf);
    }
}
