/* src/ops/cuda/attention.cuh: the generic (any head dim, fp32 or bf16) attention kernels.
 * Part of ops_cuda.cu, which includes it at this point of its one translation unit (after
 * the helpers it uses): not a header to include anywhere else. */
/* ------------------------------------------------------------------------------------ */
/* attention                                                                             */

/* Flash-style, fp32, no T x T matrix anywhere. Three shapes of work:
 *  - forward and dq: a block owns ATT_TILE query rows of one (b, h) and walks the key tiles
 *    up to its last row (causal), holding K and V tiles in shared memory;
 *  - dk/dv: a block owns ATT_TILE key rows and walks the query tiles from its first key on,
 *    so every dk/dv element is summed by one thread in query order (no atomics).
 * Inside a block, warp w handles rows w, w + 8, w + 16, w + 24 of its tile (interleaved, so
 * the causal mask costs all warps alike). For one of its rows, lane l takes the l-th
 * row of the other tile: it computes one score (a dot product over HD out of shared
 * memory), and the row's accumulators (HD values: lane l holds d = l, l + 32, ...) are
 * updated by broadcasting each lane's probability with a shuffle. Rows of a tile that
 * are read lane-by-lane are padded to HD + 1 floats so the lanes hit different banks.
 * q is pre-scaled by 1/sqrt(HD) when it is loaded, as in the CPU backend. */
#define ATT_WARPS 8
#define ATT_TILE 32                       /* = lanes per warp: lane l <-> row l of a tile */
#define ATT_RPW (ATT_TILE / ATT_WARPS)    /* rows per warp */
#define ATT_MAX_HD OPS_CUDA_MAX_HEAD_DIM /* (ops.h: the config refuses wider heads on cuda at start-up) */
#define ATT_DPL (ATT_MAX_HD / 32)         /* accumulator registers per lane and row */

static size_t att_forward_smem(int HD) { return (size_t)ATT_TILE * (3 * HD + 1) * sizeof(float); }
static size_t att_dq_smem(int HD) { return (size_t)ATT_TILE * (4 * HD + 2) * sizeof(float); }
static size_t att_dkdv_smem(int HD) { return (size_t)ATT_TILE * (4 * HD + 4) * sizeof(float); }

/* Keys of the tile starting at k0 that query row i sees (causal). */
static __device__ __forceinline__ int att_keys_seen(int i, int k0) {
    return i - k0 + 1 < ATT_TILE ? i - k0 + 1 : ATT_TILE;
}

/* A row's accumulators (lane holds d = lane, lane + 32, ...) += sum over the tile rows
 * jj < n of coef_jj * rows[jj * ld + d], where coef_jj is lane jj's coef (a probability or
 * a score gradient), in jj order: O += P V in the forward, dQ += dS K in the backward. */
static __device__ __forceinline__ void att_acc_rows(float acc[ATT_DPL], float coef, const float *rows, int ld, int n,
                                                    int lane, int HD) {
    for (int jj = 0; jj < n; jj++) {
        float cj = __shfl_sync(FULL_MASK, coef, jj);
        const float *r = rows + jj * ld;
#pragma unroll
        for (int c = 0; c < ATT_DPL; c++) {
            int d = lane + 32 * c;
            if (d < HD) acc[c] += cj * r[d];
        }
    }
}

/* grid (ceil(T/ATT_TILE), NH, B); the last query tiles (most keys) are started first. */
static __global__ void __launch_bounds__(ATT_WARPS * 32)
attention_forward_kernel(void *out, float *lse, const void *qkv, int T, int NH, int HD, float scale, int bf) {
    extern __shared__ float smem[];
    int C = NH * HD, ldk = HD + 1;
    float *q_s = smem;                   /* [TILE][HD], scaled */
    float *k_s = q_s + ATT_TILE * HD;    /* [TILE][HD + 1]: read lane-by-lane */
    float *v_s = k_s + ATT_TILE * ldk;   /* [TILE][HD] */
    int h = blockIdx.y, b = blockIdx.z;
    int q0 = (gridDim.x - 1 - blockIdx.x) * ATT_TILE;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    size_t base = (size_t)b * T * 3 * C + (size_t)h * HD; /* q of token 0, head h */

    for (int idx = threadIdx.x; idx < ATT_TILE * HD; idx += blockDim.x) {
        int r = idx / HD, d = idx % HD, t = q0 + r;
        q_s[idx] = t < T ? ld(qkv, base + (size_t)t * 3 * C + d, bf) * scale : 0.0f;
    }
    float o[ATT_RPW][ATT_DPL], m[ATT_RPW], l[ATT_RPW];
#pragma unroll
    for (int rr = 0; rr < ATT_RPW; rr++) {
        m[rr] = -INFINITY;
        l[rr] = 0.0f;
#pragma unroll
        for (int c = 0; c < ATT_DPL; c++) o[rr][c] = 0.0f;
    }
    int q_last = (q0 + ATT_TILE < T ? q0 + ATT_TILE : T) - 1;
    for (int k0 = 0; k0 <= q_last; k0 += ATT_TILE) {
        __syncthreads(); /* the previous tile is no longer read (and q_s is complete) */
        for (int idx = threadIdx.x; idx < ATT_TILE * HD; idx += blockDim.x) {
            int r = idx / HD, d = idx % HD, t = k0 + r;
            float kx = 0.0f, vx = 0.0f;
            if (t < T) {
                kx = ld(qkv, base + (size_t)t * 3 * C + C + d, bf);
                vx = ld(qkv, base + (size_t)t * 3 * C + 2 * C + d, bf);
            }
            k_s[r * ldk + d] = kx;
            v_s[r * HD + d] = vx;
        }
        __syncthreads();
#pragma unroll
        for (int rr = 0; rr < ATT_RPW; rr++) {
            int r = warp + rr * ATT_WARPS, i = q0 + r;
            if (i >= T || k0 > i) continue; /* uniform across the warp */
            int j = k0 + lane;
            float s = -INFINITY;
            if (j <= i) {
                const float *qr = q_s + r * HD, *kr = k_s + lane * ldk;
                float acc = 0.0f;
                for (int d = 0; d < HD; d++) acc += qr[d] * kr[d];
                s = acc;
            }
            float mnew = fmaxf(m[rr], warp_max(s)); /* finite: key k0 <= i is valid */
            float alpha = expf(m[rr] - mnew);       /* 0 on the first tile */
            float p = j <= i ? expf(s - mnew) : 0.0f;
            l[rr] = l[rr] * alpha + warp_sum(p);
            m[rr] = mnew;
#pragma unroll
            for (int c = 0; c < ATT_DPL; c++) o[rr][c] *= alpha;
            att_acc_rows(o[rr], p, v_s, HD, att_keys_seen(i, k0), lane, HD);
        }
    }
#pragma unroll
    for (int rr = 0; rr < ATT_RPW; rr++) {
        int i = q0 + warp + rr * ATT_WARPS;
        if (i >= T) continue;
        float inv = 1.0f / l[rr];
        size_t dst = ((size_t)b * T + i) * C + (size_t)h * HD;
#pragma unroll
        for (int c = 0; c < ATT_DPL; c++) {
            int d = lane + 32 * c;
            if (d < HD) st(out, dst + d, o[rr][c] * inv, bf);
        }
        if (lane == 0) lse[((size_t)b * NH + h) * T + i] = m[rr] + logf(l[rr]);
    }
}

/* D[b, h, t] = dot(dout, out) over the head's HD values: one warp per (b, t, h). */
static __global__ void attention_backward_D_kernel(float *D, const void *dout, const void *out, int B, int T,
                                                   int NH, int HD, int bf) {
    size_t row = (size_t)blockIdx.x * ROW_WARPS + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31, C = NH * HD;
    if (row >= (size_t)B * T * NH) return;
    int h = (int)(row % NH);
    size_t bt = row / NH;
    size_t b = bt / T, t = bt % T;
    size_t o = bt * C + (size_t)h * HD;
    float s = 0.0f;
    for (int d = lane; d < HD; d += 32) s += ld(dout, o + d, bf) * ld(out, o + d, bf);
    s = warp_sum(s);
    if (lane == 0) D[(b * NH + h) * T + t] = s;
}

/* dq = scale * sum_j dS_ij k_j, dS_ij = P_ij (dO_i . v_j - D_i), P_ij = exp(s_ij - lse_i).
 * Same shape as the forward: a block owns 32 query rows and walks the key tiles. */
static __global__ void __launch_bounds__(ATT_WARPS * 32)
attention_backward_dq_kernel(void *dqkv, const void *dout, const void *qkv, const float *lse, const float *D,
                             int T, int NH, int HD, float scale, int bf) {
    extern __shared__ float smem[];
    int C = NH * HD, ldk = HD + 1;
    float *q_s = smem;                   /* [TILE][HD], scaled */
    float *do_s = q_s + ATT_TILE * HD;   /* [TILE][HD] */
    float *k_s = do_s + ATT_TILE * HD;   /* [TILE][HD + 1] */
    float *v_s = k_s + ATT_TILE * ldk;   /* [TILE][HD + 1] */
    int h = blockIdx.y, b = blockIdx.z;
    int q0 = (gridDim.x - 1 - blockIdx.x) * ATT_TILE;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    size_t base = (size_t)b * T * 3 * C + (size_t)h * HD;
    size_t dbase = (size_t)b * T * C + (size_t)h * HD;
    const float *lse_bh = lse + ((size_t)b * NH + h) * T, *D_bh = D + ((size_t)b * NH + h) * T;

    for (int idx = threadIdx.x; idx < ATT_TILE * HD; idx += blockDim.x) {
        int r = idx / HD, d = idx % HD, t = q0 + r;
        q_s[idx] = t < T ? ld(qkv, base + (size_t)t * 3 * C + d, bf) * scale : 0.0f;
        do_s[idx] = t < T ? ld(dout, dbase + (size_t)t * C + d, bf) : 0.0f;
    }
    float dq[ATT_RPW][ATT_DPL], lse_r[ATT_RPW], D_r[ATT_RPW];
#pragma unroll
    for (int rr = 0; rr < ATT_RPW; rr++) {
        int i = q0 + warp + rr * ATT_WARPS;
        lse_r[rr] = i < T ? lse_bh[i] : 0.0f;
        D_r[rr] = i < T ? D_bh[i] : 0.0f;
#pragma unroll
        for (int c = 0; c < ATT_DPL; c++) dq[rr][c] = 0.0f;
    }
    int q_last = (q0 + ATT_TILE < T ? q0 + ATT_TILE : T) - 1;
    for (int k0 = 0; k0 <= q_last; k0 += ATT_TILE) {
        __syncthreads();
        for (int idx = threadIdx.x; idx < ATT_TILE * HD; idx += blockDim.x) {
            int r = idx / HD, d = idx % HD, t = k0 + r;
            float kx = 0.0f, vx = 0.0f;
            if (t < T) {
                kx = ld(qkv, base + (size_t)t * 3 * C + C + d, bf);
                vx = ld(qkv, base + (size_t)t * 3 * C + 2 * C + d, bf);
            }
            k_s[r * ldk + d] = kx;
            v_s[r * ldk + d] = vx;
        }
        __syncthreads();
#pragma unroll
        for (int rr = 0; rr < ATT_RPW; rr++) {
            int r = warp + rr * ATT_WARPS, i = q0 + r;
            if (i >= T || k0 > i) continue;
            int j = k0 + lane;
            float ds = 0.0f;
            if (j <= i) {
                const float *qr = q_s + r * HD, *gr = do_s + r * HD;
                const float *kr = k_s + lane * ldk, *vr = v_s + lane * ldk;
                float s = 0.0f, dp = 0.0f;
                for (int d = 0; d < HD; d++) {
                    s += qr[d] * kr[d];
                    dp += gr[d] * vr[d];
                }
                float p = expf(s - lse_r[rr]);
                ds = p * (dp - D_r[rr]);
            }
            att_acc_rows(dq[rr], ds, k_s, ldk, att_keys_seen(i, k0), lane, HD);
        }
    }
#pragma unroll
    for (int rr = 0; rr < ATT_RPW; rr++) {
        int i = q0 + warp + rr * ATT_WARPS;
        if (i >= T) continue;
        size_t dst = ((size_t)b * T + i) * 3 * C + (size_t)h * HD;
#pragma unroll
        for (int c = 0; c < ATT_DPL; c++) {
            int d = lane + 32 * c;
            if (d < HD) st(dqkv, dst + d, ld(dqkv, dst + d, bf) + scale * dq[rr][c], bf);
        }
    }
}

/* dk_j = sum_i dS_ij (scale q_i), dv_j = sum_i P_ij dO_i over i >= j. A block owns 32 keys
 * (its K and V rows stay in shared memory) and walks the query tiles from its own tile to
 * T; lane l takes query row l of the current tile. grid (ceil(T/ATT_TILE), NH, B); block 0
 * (the first keys, which see the most queries) starts first. */
static __global__ void __launch_bounds__(ATT_WARPS * 32)
attention_backward_dkdv_kernel(void *dqkv, const void *dout, const void *qkv, const float *lse, const float *D,
                               int T, int NH, int HD, float scale, int bf) {
    extern __shared__ float smem[];
    int C = NH * HD, ldq = HD + 1;
    float *k_s = smem;                   /* [TILE][HD] */
    float *v_s = k_s + ATT_TILE * HD;    /* [TILE][HD] */
    float *q_s = v_s + ATT_TILE * HD;    /* [TILE][HD + 1], scaled */
    float *do_s = q_s + ATT_TILE * ldq;  /* [TILE][HD + 1] */
    float *lse_s = do_s + ATT_TILE * ldq; /* [TILE] */
    float *D_s = lse_s + ATT_TILE;       /* [TILE] */
    int h = blockIdx.y, b = blockIdx.z;
    int k0 = blockIdx.x * ATT_TILE;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    size_t base = (size_t)b * T * 3 * C + (size_t)h * HD;
    size_t dbase = (size_t)b * T * C + (size_t)h * HD;
    const float *lse_bh = lse + ((size_t)b * NH + h) * T, *D_bh = D + ((size_t)b * NH + h) * T;

    for (int idx = threadIdx.x; idx < ATT_TILE * HD; idx += blockDim.x) {
        int r = idx / HD, d = idx % HD, t = k0 + r;
        float kx = 0.0f, vx = 0.0f;
        if (t < T) {
            kx = ld(qkv, base + (size_t)t * 3 * C + C + d, bf);
            vx = ld(qkv, base + (size_t)t * 3 * C + 2 * C + d, bf);
        }
        k_s[idx] = kx;
        v_s[idx] = vx;
    }
    float dk[ATT_RPW][ATT_DPL], dv[ATT_RPW][ATT_DPL];
#pragma unroll
    for (int rr = 0; rr < ATT_RPW; rr++)
#pragma unroll
        for (int c = 0; c < ATT_DPL; c++) dk[rr][c] = dv[rr][c] = 0.0f;

    for (int q0 = k0; q0 < T; q0 += ATT_TILE) {
        __syncthreads();
        for (int idx = threadIdx.x; idx < ATT_TILE * HD; idx += blockDim.x) {
            int r = idx / HD, d = idx % HD, t = q0 + r;
            q_s[r * ldq + d] = t < T ? ld(qkv, base + (size_t)t * 3 * C + d, bf) * scale : 0.0f;
            do_s[r * ldq + d] = t < T ? ld(dout, dbase + (size_t)t * C + d, bf) : 0.0f;
        }
        if (threadIdx.x < ATT_TILE) {
            int t = q0 + threadIdx.x;
            lse_s[threadIdx.x] = t < T ? lse_bh[t] : 0.0f;
            D_s[threadIdx.x] = t < T ? D_bh[t] : 0.0f;
        }
        __syncthreads();
        int i_hi = T - q0 < ATT_TILE ? T - q0 : ATT_TILE; /* query rows of this tile */
#pragma unroll
        for (int rr = 0; rr < ATT_RPW; rr++) {
            int r = warp + rr * ATT_WARPS, j = k0 + r;
            if (j >= T) continue; /* uniform across the warp */
            int i = q0 + lane;
            float p = 0.0f, ds = 0.0f;
            if (i >= j && i < T) {
                const float *qr = q_s + lane * ldq, *gr = do_s + lane * ldq;
                const float *kr = k_s + r * HD, *vr = v_s + r * HD;
                float s = 0.0f, dp = 0.0f;
                for (int d = 0; d < HD; d++) {
                    s += qr[d] * kr[d];
                    dp += gr[d] * vr[d];
                }
                p = expf(s - lse_s[lane]);
                ds = p * (dp - D_s[lane]);
            }
            int i_lo = j - q0 > 0 ? j - q0 : 0; /* rows before the key have p = 0 */
            for (int ii = i_lo; ii < i_hi; ii++) {
                float pi = __shfl_sync(FULL_MASK, p, ii), dsi = __shfl_sync(FULL_MASK, ds, ii);
                const float *qr = q_s + ii * ldq, *gr = do_s + ii * ldq;
#pragma unroll
                for (int c = 0; c < ATT_DPL; c++) {
                    int d = lane + 32 * c;
                    if (d < HD) {
                        dv[rr][c] += pi * gr[d];
                        dk[rr][c] += dsi * qr[d];
                    }
                }
            }
        }
    }
#pragma unroll
    for (int rr = 0; rr < ATT_RPW; rr++) {
        int j = k0 + warp + rr * ATT_WARPS;
        if (j >= T) continue;
        size_t dst = ((size_t)b * T + j) * 3 * C + (size_t)h * HD;
#pragma unroll
        for (int c = 0; c < ATT_DPL; c++) {
            int d = lane + 32 * c;
            if (d < HD) {
                size_t ik = dst + C + d, iv = dst + 2 * C + d;
                st(dqkv, ik, ld(dqkv, ik, bf) + dk[rr][c], bf);
                st(dqkv, iv, ld(dqkv, iv, bf) + dv[rr][c], bf);
            }
        }
    }
}

/* Opts a kernel in to more than 48 KiB of dynamic shared memory, once per size. */
static void att_smem(const void *kernel, size_t bytes, size_t *set, const char *what, int HD) {
    if (bytes > g.smem_optin)
        die(2, "cuda: attention %s with head_dim %d needs %zu bytes of shared memory; the GPU allows %zu", what, HD,
            bytes, g.smem_optin);
    if (bytes > 48 * 1024 && bytes > *set) {
        CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
        *set = bytes;
    }
}

static void att_check_shape(int B, int NH, int HD) {
    if (HD > ATT_MAX_HD) die(2, "cuda: attention head_dim %d is larger than the supported %d", HD, ATT_MAX_HD);
    if (B > 65535 || NH > 65535) die(2, "cuda: attention batch %d or heads %d exceed the grid limit 65535", B, NH);
}
