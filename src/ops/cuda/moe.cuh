/* src/ops/cuda/moe.cuh: the mixture-of-experts ops (ops.h's op_moe_*): the router's products,
 * the top-k routing and its backward, the dispatch (a stable counting sort of the choices by
 * expert), the router's statistics, the experts' grouped products, the combine, its backward
 * and the step's statistics.
 * Part of ops_cuda.cu, which includes it after the matmuls and the ops they use (the router's
 * forward and the experts' products are cuBLASLt products): not a header to include anywhere else.
 *
 * Determinism: no atomics; every sum has an order fixed by the shapes (ops_cuda.h's
 * cuda_moe_* bounds), never by the card. The routing, the router's gradient and the statistics
 * compute in double as the CPU reference does (src/ops/cpu/moe_cpu.c), with the sums over a
 * row's experts in a warp's fixed butterfly order instead of its sequential one (the last
 * bits of a double; the fp32 results agree but for rare roundings). The combine, its backward,
 * the gates' scaling and the step's statistics use the CPU's own single roundings (the
 * __f*_rn / __d*_rn intrinsics, which nvcc never fuses), so in fp32 they give its bits, and
 * in bf16 its fp32 result rounded once. */
/* ------------------------------------------------------------------------------------ */
/* mixture of experts                                                                    */

#define MOE_ROW_WARPS 4           /* the per-row kernels: one warp a row */
#define MOE_GATE_WARPS 8          /* op_moe_gate_backward: one warp a row */
#define MOE_DISPATCH_BLOCK 256    /* the dispatch's blocks: a round of 256 choices at a time */
#define MOE_DISPATCH_WARPS (MOE_DISPATCH_BLOCK / 32)
#define MOE_STATS_BLOCK 256
/* each thread of a stats block owns the experts tid + 256 s (s < slots) and the lse slot X */
#define MOE_STATS_SLOTS ((CUDA_MOE_MAX_EXPERTS + MOE_STATS_BLOCK) / MOE_STATS_BLOCK)

static void moe_check_experts(int X, const char *op) {
    if (X > CUDA_MOE_MAX_EXPERTS)
        die(2, "cuda: %s with %d experts: the kernels take at most %d", op, X, CUDA_MOE_MAX_EXPERTS);
}

/* ---- the router's gradient: a register-tiled product with a fp32 or bf16 left operand ----
 * C[m, n] over k in [k0, k1): A(m, k) = a[m a_m + k a_k] (fp32, or the activations' type
 * with a_bf), B(k, n) = b[k b_k + n] (the activations' type). mode 0: C is fp32 partials,
 * split z's [M, Nn] at c + z M Nn, written; mode 1: c[m c_m + n] (the activations' type) +=
 * the sum, rounded once. A block of MG_THREADS computes BM x BN outputs, each thread 4 rows x
 * 8 columns (columns tx * 4 + q and BN / 2 + tx * 4 + q: both halves read from shared memory
 * without bank conflicts); each output's sum runs over k in order (one split: the rows in
 * order). BM = 16 or 32 keeps few-expert weight gradients (M = X) from computing mostly
 * padding. */
#define MG_BK 16
#define MG_THREADS 256
typedef struct {
    const void *a;
    size_t a_m, a_k;
    int a_bf;
    const void *b;
    size_t b_k;
    int b_bf, b_vec; /* b_vec: b 16-byte aligned and b_k % 8 == 0 (eight columns a load) */
    void *c;
    size_t c_m;
    int c_bf, c_vec; /* c_vec: c 16-byte aligned and c_m % 4 == 0 (four columns a load) */
    int M, Nn, K, kchunk, mode;
} MoeGemm;

static __device__ __forceinline__ void moe_ld4(float *v, const void *p, size_t i, int bf) {
    if (bf) {
        uint2 u = *(const uint2 *)((const bf16 *)p + i);
        float2 a = __bfloat1622float2(*(const __nv_bfloat162 *)&u.x), b = __bfloat1622float2(*(const __nv_bfloat162 *)&u.y);
        v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
    } else {
        float4 a = *(const float4 *)((const float *)p + i);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    }
}
static __device__ __forceinline__ void moe_st4(void *p, size_t i, const float *v, int bf) {
    if (bf) {
        uint2 u;
        *(__nv_bfloat162 *)&u.x = __float22bfloat162_rn(make_float2(v[0], v[1]));
        *(__nv_bfloat162 *)&u.y = __float22bfloat162_rn(make_float2(v[2], v[3]));
        *(uint2 *)((bf16 *)p + i) = u;
    } else {
        *(float4 *)((float *)p + i) = make_float4(v[0], v[1], v[2], v[3]);
    }
}

template <int BM>
static __global__ void __launch_bounds__(MG_THREADS) moe_gemm_kernel(MoeGemm p) {
    constexpr int TY = BM / 4, TX = MG_THREADS / TY, BN = TX * 8;
    __shared__ __align__(16) float As[MG_BK][BM + 4];
    __shared__ __align__(16) float Bs[MG_BK][BN + 4];
    int tid = threadIdx.x, tx = tid % TX, ty = tid / TX;
    size_t m0 = (size_t)blockIdx.x * BM;
    int n0 = blockIdx.y * BN;
    int k0 = blockIdx.z * p.kchunk, k1 = min(p.K, k0 + p.kchunk);
    float acc[4][8];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[i][j] = 0.0f;
    for (int kb = k0; kb < k1; kb += MG_BK) {
        for (int i = tid; i < BM * MG_BK; i += MG_THREADS) {
            /* consecutive threads along A's unit stride */
            int m = p.a_k == 1 ? i / MG_BK : i % BM, kk = p.a_k == 1 ? i % MG_BK : i / BM;
            size_t gm = m0 + m;
            int gk = kb + kk;
            As[kk][m] = gm < (size_t)p.M && gk < k1 ? ld(p.a, gm * p.a_m + (size_t)gk * p.a_k, p.a_bf) : 0.0f;
        }
        for (int i = tid; i < MG_BK * (BN / 8); i += MG_THREADS) {
            int kk = i / (BN / 8), nn = (i % (BN / 8)) * 8, gk = kb + kk, gn = n0 + nn;
            float v[8];
            if (gk < k1 && p.b_vec && gn + 8 <= p.Nn) {
                ld8(v, p.b, (size_t)gk * p.b_k + gn, p.b_bf);
            } else {
#pragma unroll
                for (int q = 0; q < 8; q++)
                    v[q] = gk < k1 && gn + q < p.Nn ? ld(p.b, (size_t)gk * p.b_k + gn + q, p.b_bf) : 0.0f;
            }
            *(float4 *)&Bs[kk][nn] = make_float4(v[0], v[1], v[2], v[3]);
            *(float4 *)&Bs[kk][nn + 4] = make_float4(v[4], v[5], v[6], v[7]);
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < MG_BK; kk++) {
            float4 a = *(const float4 *)&As[kk][ty * 4];
            float4 b0 = *(const float4 *)&Bs[kk][tx * 4], b1 = *(const float4 *)&Bs[kk][BN / 2 + tx * 4];
            const float av[4] = {a.x, a.y, a.z, a.w}, bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 8; j++) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        size_t gm = m0 + ty * 4 + i;
        if (gm >= (size_t)p.M) continue;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int gn = n0 + h * (BN / 2) + tx * 4;
            if (p.mode == 0) {
                float *c = (float *)p.c + (size_t)blockIdx.z * p.M * p.Nn + gm * p.Nn;
#pragma unroll
                for (int q = 0; q < 4; q++)
                    if (gn + q < p.Nn) c[gn + q] = acc[i][4 * h + q];
                continue;
            }
            size_t o = gm * p.c_m + gn;
            if (p.c_vec && gn + 4 <= p.Nn) {
                float v[4];
                moe_ld4(v, p.c, o, p.c_bf);
#pragma unroll
                for (int q = 0; q < 4; q++) v[q] += acc[i][4 * h + q];
                moe_st4(p.c, o, v, p.c_bf);
            } else {
#pragma unroll
                for (int q = 0; q < 4; q++)
                    if (gn + q < p.Nn) st(p.c, o + q, ld(p.c, o + q, p.c_bf) + acc[i][4 * h + q], p.c_bf);
            }
        }
    }
}

/* dw[i] (state type) += the splits' partials summed in split order, rounded once */
static __global__ void moe_dw_reduce_kernel(void *dw, const float *part, size_t n, int splits, int sbf) {
    GRID_STRIDE(i, n) {
        float s = 0.0f;
        for (int z = 0; z < splits; z++) s += part[(size_t)z * n + i];
        st(dw, i, ld(dw, i, sbf) + s, sbf);
    }
}

/* ---- routing ---- */

/* One warp a row: the scores and lse in double as the CPU computes them, then k rounds of a
 * warp argmax of s + bias (largest first, ties to the lower expert) over the experts not yet
 * taken; lane l holds experts l + 32 s, its taken ones as bits s of a mask (X <= 1024). Shared
 * memory: s and s + bias, 2 X floats a warp. */
static __global__ void __launch_bounds__(MOE_ROW_WARPS * 32)
    moe_topk_kernel(float *probs, int *idx, float *gate, float *lse, const float *logits, const float *bias, int N,
                    int X, int k, int sigmoid) {
    extern __shared__ float moe_shf[];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    size_t n = (size_t)blockIdx.x * MOE_ROW_WARPS + wid;
    if (n >= (size_t)N) return;  /* the whole warp: no block-wide barrier follows */
    float *s_sh = moe_shf + (size_t)wid * 2 * X, *v_sh = s_sh + X;
    const float *z = logits + n * X;
    float mf = -INFINITY;
    for (int e = lane; e < X; e += 32) mf = fmaxf(mf, z[e]);
    double mx = (double)warp_max(mf), sum = 0.0;
    for (int e = lane; e < X; e += 32) sum += exp((double)z[e] - mx);
    double l = mx + log(warp_sum_double(sum));
    if (lane == 0) lse[n] = (float)l;
    for (int e = lane; e < X; e += 32) {
        double ze = (double)z[e];
        float s = sigmoid ? (float)(1.0 / (1.0 + exp(-ze))) : (float)exp(ze - l);
        probs[n * X + e] = s;
        s_sh[e] = s;
        v_sh[e] = bias ? __fadd_rn(s, bias[e]) : s;
    }
    __syncwarp();
    unsigned taken = 0;
    int mine = 0;
    double sel = 0.0;
    for (int j = 0; j < k; j++) {
        float bv = 0.0f;
        int bi = -1;
        for (int e = lane, sl = 0; e < X; e += 32, sl++) {
            if (taken >> sl & 1u) continue;
            float v = v_sh[e];
            if (bi < 0 || v > bv) bv = v, bi = e;
        }
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(FULL_MASK, bv, o);
            int oi = __shfl_xor_sync(FULL_MASK, bi, o);
            if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) bv = ov, bi = oi;
        }
        if (bi < 0) bi = 0; /* only NaN scores can leave lanes disagreeing; stay in bounds */
        if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
        if (lane == j) mine = bi;
        sel += (double)s_sh[bi];
    }
    if (lane < k) {
        idx[n * k + lane] = mine;
        gate[n * k + lane] = (float)((double)s_sh[mine] / sel);
    }
}

/* One warp a row, in double as the CPU: the gates' gradient onto the chosen scores, the
 * load-balancing loss's onto all, then through the softmax or sigmoid, plus the z-loss's.
 * Shared memory: the scores' gradient, X doubles a warp. */
static __global__ void __launch_bounds__(MOE_ROW_WARPS * 32)
    moe_route_backward_kernel(float *dlogits, const float *dgate_rows, const int *pos, const float *logits,
                              const float *probs, const int *idx, const float *gate, const float *lse,
                              const float *stats, float aux_scale, float z_scale, int N, int X, int k, int sigmoid) {
    extern __shared__ double moe_shd[];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    size_t n = (size_t)blockIdx.x * MOE_ROW_WARPS + wid;
    if (n >= (size_t)N) return;
    double *ds = moe_shd + (size_t)wid * X;
    const float *s = probs + n * X, *z = logits + n * X, *g = gate + n * k;
    const int *ix = idx + n * k, *ps = pos + n * k;
    /* the gates g_j = s_(i_j) / S over the chosen: ds_(i_m) = (dg_m - sum_j dg_j g_j) / S */
    double S = 0.0, dot = 0.0;
    for (int j = 0; j < k; j++) {
        S += s[ix[j]];
        dot += (ps[j] >= 0 ? (double)dgate_rows[ps[j]] : 0.0) * g[j];
    }
    for (int e = lane; e < X; e += 32) ds[e] = 0.0;
    __syncwarp();
    if (lane == 0)
        for (int j = 0; j < k; j++) ds[ix[j]] += ((ps[j] >= 0 ? (double)dgate_rows[ps[j]] : 0.0) - dot) / S;
    __syncwarp();
    if (aux_scale != 0.0f) { /* the load-balancing loss through s_hat = s / sum(s) */
        double sum = 0.0, dot2 = 0.0;
        for (int e = lane; e < X; e += 32) sum += s[e];
        sum = warp_sum_double(sum);
        for (int e = lane; e < X; e += 32) dot2 += s[e] / sum * ((double)aux_scale * stats[e]);
        dot2 = warp_sum_double(dot2);
        for (int e = lane; e < X; e += 32) ds[e] += ((double)aux_scale * stats[e] - dot2) / sum;
    }
    double sd = 0.0;
    if (!sigmoid) {
        for (int e = lane; e < X; e += 32) sd += s[e] * ds[e];
        sd = warp_sum_double(sd);
    }
    double l = lse[n];
    for (int e = lane; e < X; e += 32) {
        double se = s[e];
        double v = sigmoid ? ds[e] * se * (1.0 - se) : se * (ds[e] - sd);
        if (z_scale != 0.0f) v += (double)z_scale * l * exp((double)z[e] - l);
        dlogits[n * X + e] = (float)v;
    }
}

/* ---- dispatch: a stable counting sort of the N k choices by expert ----
 * The choices are cut into T tiles of `tile` (ops_cuda.h's cuda_moe_dispatch_tile: at most
 * CUDA_MOE_DISPATCH_TILES tiles), each a whole number of rounds of 256. (1) each tile counts
 * its choices per expert; (2) one block per expert turns its column of counts into each
 * tile's first rank among the expert's choices (an exclusive scan in tile order) and writes
 * routed and kept; (3) each tile ranks its choices again in order, round by round: within a
 * warp by __match_any_sync (the lanes of the same expert before this one), across the warps
 * by their counts in shared memory, and across rounds by a running rank per expert; a choice
 * of rank r is kept where r < capacity, at row first[e] + r. Integer counts only: the order
 * of the adds cannot change them. */
static __device__ int block_exclusive_scan_int(int v, int *total) {
    __shared__ int sh[32];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int x = v;
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(FULL_MASK, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads(); /* sh may still be read by a previous call */
    if (lane == 31) sh[wid] = x;
    __syncthreads();
    if (wid == 0) {
        int w = lane < nw ? sh[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            int y = __shfl_up_sync(FULL_MASK, w, o);
            if (lane >= o) w += y;
        }
        __syncwarp();
        if (lane < nw) sh[lane] = w;
    }
    __syncthreads();
    *total = sh[nw - 1];
    return (wid > 0 ? sh[wid - 1] : 0) + x - v;
}

/* an expert index out of [0, X) counts nowhere and is dropped (pos -1) */
static __device__ __forceinline__ int moe_expert_of(const int *idx, size_t i, size_t i1, int X) {
    int e = i < i1 ? idx[i] : -1;
    return e >= 0 && e < X ? e : -1;
}

/* (1) tile_cnt[t, e]: the choices of expert e in tile t. Shared: a row of X counts a warp. */
static __global__ void __launch_bounds__(MOE_DISPATCH_BLOCK)
    moe_count_kernel(int *tile_cnt, const int *idx, size_t nk, int tile, int X) {
    extern __shared__ int moe_shi[];
    int *wc = moe_shi;
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    for (int i = threadIdx.x; i < MOE_DISPATCH_WARPS * X; i += blockDim.x) wc[i] = 0;
    __syncthreads();
    size_t i0 = (size_t)blockIdx.x * tile, i1 = i0 + tile < nk ? i0 + tile : nk;
    for (size_t b = i0; b < i1; b += MOE_DISPATCH_BLOCK) {
        int e = moe_expert_of(idx, b + threadIdx.x, i1, X);
        unsigned m = __match_any_sync(FULL_MASK, e);
        if (e >= 0 && (m & ((1u << lane) - 1u)) == 0) wc[wid * X + e] += __popc(m); /* one lane per expert */
        __syncwarp();
    }
    __syncthreads();
    for (int e = threadIdx.x; e < X; e += blockDim.x) {
        int c = 0;
        for (int w = 0; w < MOE_DISPATCH_WARPS; w++) c += wc[w * X + e];
        tile_cnt[(size_t)blockIdx.x * X + e] = c;
    }
}

/* (2) block e: tile_cnt[:, e] -> each tile's first rank (in place); cnt[e], cnt[X + e] */
static __global__ void moe_tile_scan_kernel(int *cnt, int *tile_cnt, int T, int X, int capacity) {
    int e = blockIdx.x, carry = 0;
    for (int base = 0; base < T; base += blockDim.x) {
        int t = base + threadIdx.x, total;
        int v = t < T ? tile_cnt[(size_t)t * X + e] : 0;
        int ex = block_exclusive_scan_int(v, &total);
        if (t < T) tile_cnt[(size_t)t * X + e] = carry + ex;
        carry += total;
    }
    if (threadIdx.x == 0) {
        cnt[e] = carry;
        cnt[X + e] = capacity > 0 && carry > capacity ? capacity : carry;
    }
}

/* (3) every block: first[e], the exclusive scan of the kept counts (block 0 writes it to cnt);
 * then tile t's choices ranked and placed. Shared: running[X] | first[X] | a row of X counts a
 * warp (10 X ints). */
static __global__ void __launch_bounds__(MOE_DISPATCH_BLOCK)
    moe_scatter_kernel(int *cnt, int *pos, int *rowtok, float *gate_rows, const int *idx, const float *gate,
                       const int *tile_first, size_t nk, int tile, int k, int X, int capacity) {
    extern __shared__ int moe_shi[];
    int *running = moe_shi, *first = running + X, *wc = first + X;
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    int carry = 0;
    for (int base = 0; base < X; base += blockDim.x) {
        int e = base + threadIdx.x, total;
        int ex = block_exclusive_scan_int(e < X ? cnt[X + e] : 0, &total);
        if (e < X) {
            first[e] = carry + ex;
            if (blockIdx.x == 0) cnt[2 * X + e] = carry + ex;
        }
        carry += total;
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) cnt[3 * X] = carry;
    size_t i0 = (size_t)blockIdx.x * tile, i1 = i0 + tile < nk ? i0 + tile : nk;
    if (i0 >= nk) return; /* no choices (N = 0): the one block wrote the offsets */
    for (int i = threadIdx.x; i < MOE_DISPATCH_WARPS * X; i += blockDim.x) wc[i] = 0;
    for (int e = threadIdx.x; e < X; e += blockDim.x) running[e] = tile_first[(size_t)blockIdx.x * X + e];
    __syncthreads();
    for (size_t b = i0; b < i1; b += MOE_DISPATCH_BLOCK) {
        size_t i = b + threadIdx.x;
        int e = moe_expert_of(idx, i, i1, X);
        unsigned m = __match_any_sync(FULL_MASK, e), lt = m & ((1u << lane) - 1u);
        if (e >= 0 && lt == 0) wc[wid * X + e] = __popc(m);
        __syncthreads();
        int r = 0, last = 0;
        if (e >= 0) {
            int before = 0, after = 0;
            for (int w = 0; w < MOE_DISPATCH_WARPS; w++) {
                int c = wc[w * X + e];
                if (w < wid) before += c;
                else if (w > wid) after += c;
            }
            r = running[e] + before + __popc(lt);
            last = after == 0 && (m >> lane) == 1u; /* the round's last choice of e */
        }
        __syncthreads(); /* every rank read before running and the counts change */
        if (e >= 0) {
            if (last) running[e] = r + 1;
            if (lt == 0) wc[wid * X + e] = 0;
            if (capacity > 0 && r >= capacity) {
                pos[i] = -1;
            } else {
                int p = first[e] + r;
                pos[i] = p;
                rowtok[p] = (int)(i / (size_t)k);
                gate_rows[p] = gate[i];
            }
        } else if (i < i1) {
            pos[i] = -1;
        }
        __syncwarp(); /* the warp's cleared counts before its next round's */
    }
}

/* ---- the router's statistics: each block's rows in order into double partials (X + 1 a
 * block: the normalised scores' sums, then lse^2's), then one block adds the partials in block
 * order. The row sums of the scores are the CPU's (one thread a row, experts in order). */
static __global__ void __launch_bounds__(MOE_STATS_BLOCK)
    moe_stats_partial_kernel(double *part, const float *probs, const float *lse, int N, int X, int rows) {
    __shared__ double rs[MOE_STATS_BLOCK], l2[MOE_STATS_BLOCK];
    int tid = threadIdx.x;
    int r0 = blockIdx.x * rows, r1 = min(N, r0 + rows);
    double acc[MOE_STATS_SLOTS];
#pragma unroll
    for (int sl = 0; sl < MOE_STATS_SLOTS; sl++) acc[sl] = 0.0;
    for (int b = r0; b < r1; b += MOE_STATS_BLOCK) {
        int n = b + tid, cnt = min(MOE_STATS_BLOCK, r1 - b);
        double sum = 0.0, ll = 0.0;
        if (n < r1) {
            const float *s = probs + (size_t)n * X;
            for (int e = 0; e < X; e++) sum += s[e];
            ll = (double)lse[n] * lse[n];
        }
        __syncthreads(); /* the previous rows' sums are read */
        rs[tid] = sum;
        l2[tid] = ll;
        __syncthreads();
#pragma unroll
        for (int sl = 0; sl < MOE_STATS_SLOTS; sl++) {
            int e = tid + sl * MOE_STATS_BLOCK;
            if (e < X)
                for (int r = 0; r < cnt; r++) acc[sl] += probs[(size_t)(b + r) * X + e] / rs[r];
            else if (e == X)
                for (int r = 0; r < cnt; r++) acc[sl] += l2[r];
        }
    }
#pragma unroll
    for (int sl = 0; sl < MOE_STATS_SLOTS; sl++) {
        int e = tid + sl * MOE_STATS_BLOCK;
        if (e <= X) part[(size_t)blockIdx.x * (X + 1) + e] = acc[sl];
    }
}
static __global__ void moe_stats_final_kernel(float *stats, const int *cnt, const double *part, int nb, int X) {
    for (int e = threadIdx.x; e <= X; e += blockDim.x) {
        double s = 0.0;
        for (int b = 0; b < nb; b++) s += part[(size_t)b * (X + 1) + e];
        if (e < X) stats[e] = (float)cnt[e], stats[X + e] = (float)s;
        else stats[2 * X] = (float)s;
    }
}

/* ---- combine and its backward: eight columns a thread (E % 8 == 0, 16-byte aligned), else
 * one; the k terms in order j, each a fp32 product and add as the CPU's ---- */
static __global__ void moe_combine8_kernel(void *out, const void *ys, const float *gate, const int *pos, int k, int E,
                                           size_t nvec, int bf) {
    int e8 = E / 8;
    GRID_STRIDE(j, nvec) {
        size_t n = j / e8, c = (j - n * e8) * 8;
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, y[8], o[8];
        for (int q = 0; q < k; q++) {
            int p = pos[n * k + q];
            if (p < 0) continue;
            float gq = gate[n * k + q];
            ld8(y, ys, (size_t)p * E + c, bf);
#pragma unroll
            for (int t = 0; t < 8; t++) acc[t] = __fadd_rn(acc[t], __fmul_rn(gq, y[t]));
        }
        ld8(o, out, n * E + c, bf);
#pragma unroll
        for (int t = 0; t < 8; t++) o[t] = __fadd_rn(o[t], acc[t]);
        st8(out, n * E + c, o, bf);
    }
}
static __global__ void moe_combine_kernel(void *out, const void *ys, const float *gate, const int *pos, int k, int E,
                                          size_t total, int bf) {
    GRID_STRIDE(i, total) {
        size_t n = i / E, c = i - n * E;
        float acc = 0.0f;
        for (int q = 0; q < k; q++) {
            int p = pos[n * k + q];
            if (p >= 0) acc = __fadd_rn(acc, __fmul_rn(gate[n * k + q], ld(ys, (size_t)p * E + c, bf)));
        }
        st(out, i, __fadd_rn(ld(out, i, bf), acc), bf);
    }
}
static __global__ void moe_unpermute8_kernel(void *dx, const void *dxs, const int *pos, int k, int E, size_t nvec,
                                             int acc, int bf) {
    int e8 = E / 8;
    GRID_STRIDE(j, nvec) {
        size_t n = j / e8, c = (j - n * e8) * 8;
        float sum[8] = {0, 0, 0, 0, 0, 0, 0, 0}, y[8];
        for (int q = 0; q < k; q++) {
            int p = pos[n * k + q];
            if (p < 0) continue;
            ld8(y, dxs, (size_t)p * E + c, bf);
#pragma unroll
            for (int t = 0; t < 8; t++) sum[t] = __fadd_rn(sum[t], y[t]);
        }
        if (acc) {
            ld8(y, dx, n * E + c, bf);
#pragma unroll
            for (int t = 0; t < 8; t++) sum[t] = __fadd_rn(y[t], sum[t]);
        }
        st8(dx, n * E + c, sum, bf);
    }
}
static __global__ void moe_unpermute_kernel(void *dx, const void *dxs, const int *pos, int k, int E, size_t total,
                                            int acc, int bf) {
    GRID_STRIDE(i, total) {
        size_t n = i / E, c = i - n * E;
        float sum = 0.0f;
        for (int q = 0; q < k; q++) {
            int p = pos[n * k + q];
            if (p >= 0) sum = __fadd_rn(sum, ld(dxs, (size_t)p * E + c, bf));
        }
        st(dx, i, acc ? __fadd_rn(ld(dx, i, bf), sum) : sum, bf);
    }
}

/* One warp a row: <dh, h> in double (each product exact, summed in the warp's fixed order),
 * and both scaled by the gate in the same pass (each element read before it is written). */
static __global__ void __launch_bounds__(MOE_GATE_WARPS * 32)
    moe_gate_backward_kernel(float *dgate_rows, void *h, void *dh, const float *gate_rows, int P, int H, int vec,
                             int bf) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    size_t p = (size_t)blockIdx.x * MOE_GATE_WARPS + wid;
    if (p >= (size_t)P) return;
    float gp = gate_rows[p];
    size_t o = p * H;
    double dot = 0.0;
    if (vec) {
        for (int c = lane * 8; c < H; c += 256) {
            float a[8], d[8];
            ld8(a, h, o + c, bf);
            ld8(d, dh, o + c, bf);
#pragma unroll
            for (int t = 0; t < 8; t++) {
                dot += (double)d[t] * a[t];
                a[t] = __fmul_rn(a[t], gp);
                d[t] = __fmul_rn(d[t], gp);
            }
            st8(h, o + c, a, bf);
            st8(dh, o + c, d, bf);
        }
    } else {
        for (int c = lane; c < H; c += 32) {
            float a = ld(h, o + c, bf), d = ld(dh, o + c, bf);
            dot += (double)d * a;
            st(h, o + c, __fmul_rn(a, gp), bf);
            st(dh, o + c, __fmul_rn(d, gp), bf);
        }
    }
    dot = warp_sum_double(dot);
    if (lane == 0) dgate_rows[p] = (float)dot;
}

/* one thread: the CPU's operations in its order */
static __global__ void moe_accumulate_kernel(float *acc, const float *stats, int rows, int X, int k) {
    double aux = 0.0, rk = __dmul_rn((double)rows, (double)k);
    for (int e = 0; e < X; e++) {
        acc[e] = __fadd_rn(acc[e], stats[e]);
        aux = __dadd_rn(aux, __dmul_rn((double)stats[e] / rk, (double)stats[X + e] / rows));
    }
    acc[X] = __fadd_rn(acc[X], (float)__dmul_rn((double)X, aux));
    acc[X + 1] = __fadd_rn(acc[X + 1], (float)((double)stats[2 * X] / rows));
}

/* ------------------------------------------------------------------------------------ */
/* the ops (C entry points)                                                              */

extern "C" {

/* The router in fp32 whatever the activations: a cuBLASLt product with fp32 output (bf16
 * operands accumulate in fp32), split as cuda_matmul_forward splits a wide output. */
void cuda_moe_router_forward(float *logits, const void *x, const void *w, int N, int E, int X) {
    if (N <= 0 || X <= 0) return;
    if (E <= 0) {
        CUDA_CHECK(cudaMemsetAsync(logits, 0, (size_t)N * X * sizeof(float), g.stream));
        return;
    }
    int Xa = oc_main(X);
    lt_matmul(CUBLAS_OP_T, CUBLAS_OP_N, Xa, N, E, w, E, x, E, 0.0f, logits, X, LT_D_F32);
    if (Xa < X)
        lt_matmul(CUBLAS_OP_T, CUBLAS_OP_N, X - Xa, N, E, act_off(w, (size_t)Xa * E), E, x, E, 0.0f, logits + Xa, X,
                  LT_D_F32);
}

void cuda_moe_router_backward(void *dx, void *dw, const float *dlogits, const void *x, const void *w, int N, int E,
                              int X) {
    if (N <= 0 || E <= 0 || X <= 0) return;
    if (dx) { /* dx[N, E] += dlogits[N, X] @ w[X, E]: one split (k = the X experts in order) */
        MoeGemm p = {dlogits, (size_t)X, 1, 0, w, (size_t)E, g.bf16, E % 8 == 0 && al16(w),
                     dx, (size_t)E, g.bf16, E % 4 == 0 && al16(dx), N, E, X, X, 1};
        dim3 grid((unsigned)((N + 63) / 64), (unsigned)((E + 127) / 128), 1);
        moe_gemm_kernel<64><<<grid, MG_THREADS, 0, g.stream>>>(p);
        LAUNCH_CHECK(moe_gemm_kernel);
    }
    if (dw) { /* dw[X, E] += dlogits^T @ x: the rows in splits of `chunk`, fp32 partials, then summed */
        int chunk = cuda_moe_router_chunk(N, E, X), splits = (N + chunk - 1) / chunk;
        size_t n = (size_t)X * E;
        float *part = (float *)scratch((size_t)splits * n * sizeof(float));
        MoeGemm p = {dlogits, 1, (size_t)X, 0, x, (size_t)E, g.bf16, E % 8 == 0 && al16(x),
                     part, (size_t)E, 0, 0, X, E, N, chunk, 0};
        if (X <= 16) {
            dim3 grid((unsigned)((X + 15) / 16), (unsigned)((E + 511) / 512), (unsigned)splits);
            moe_gemm_kernel<16><<<grid, MG_THREADS, 0, g.stream>>>(p);
        } else if (X <= 32) {
            dim3 grid(1, (unsigned)((E + 255) / 256), (unsigned)splits);
            moe_gemm_kernel<32><<<grid, MG_THREADS, 0, g.stream>>>(p);
        } else {
            dim3 grid((unsigned)((X + 63) / 64), (unsigned)((E + 127) / 128), (unsigned)splits);
            moe_gemm_kernel<64><<<grid, MG_THREADS, 0, g.stream>>>(p);
        }
        LAUNCH_CHECK(moe_gemm_kernel);
        moe_dw_reduce_kernel<<<ew_grid(n), EW_BLOCK, 0, g.stream>>>(dw, part, n, splits, g.sbf16);
        LAUNCH_CHECK(moe_dw_reduce_kernel);
    }
}

void cuda_moe_topk(float *probs, int *idx, float *gate, float *lse, const float *logits, const float *bias, int N,
                   int X, int k, int sigmoid) {
    if (N <= 0 || X <= 0) return;
    moe_check_experts(X, "moe top-k routing");
    if (k < 1 || k > CUDA_MOE_MAX_TOPK || k > X)
        die(2, "cuda: moe top-k routing: top %d of %d experts; the kernel takes 1 <= k <= %d and k <= experts", k, X,
            CUDA_MOE_MAX_TOPK);
    size_t smem = (size_t)MOE_ROW_WARPS * 2 * X * sizeof(float);
    moe_topk_kernel<<<(unsigned)((N + MOE_ROW_WARPS - 1) / MOE_ROW_WARPS), MOE_ROW_WARPS * 32, smem, g.stream>>>(
        probs, idx, gate, lse, logits, bias, N, X, k, sigmoid);
    LAUNCH_CHECK(moe_topk_kernel);
}

void cuda_moe_dispatch(int *cnt, int *pos, int *rowtok, float *gate_rows, const int *idx, const float *gate, int N,
                       int k, int X, int capacity) {
    if (X <= 0) return;
    moe_check_experts(X, "moe dispatch");
    size_t nk = N > 0 && k > 0 ? (size_t)N * k : 0;
    if (nk > (size_t)0x7fffffff) die(2, "cuda: moe dispatch of %zu choices: rows are ints", nk);
    int tile = cuda_moe_dispatch_tile(nk), T = (int)((nk + tile - 1) / tile);
    int *tc = T ? (int *)scratch((size_t)T * X * sizeof(int)) : NULL;
    if (T) {
        moe_count_kernel<<<T, MOE_DISPATCH_BLOCK, (size_t)MOE_DISPATCH_WARPS * X * sizeof(int), g.stream>>>(
            tc, idx, nk, tile, X);
        LAUNCH_CHECK(moe_count_kernel);
    }
    moe_tile_scan_kernel<<<X, 256, 0, g.stream>>>(cnt, tc, T, X, capacity);
    LAUNCH_CHECK(moe_tile_scan_kernel);
    size_t smem = (size_t)(2 + MOE_DISPATCH_WARPS) * X * sizeof(int);
    moe_scatter_kernel<<<T ? T : 1, MOE_DISPATCH_BLOCK, smem, g.stream>>>(cnt, pos, rowtok, gate_rows, idx, gate, tc,
                                                                         nk, tile, k, X, capacity);
    LAUNCH_CHECK(moe_scatter_kernel);
}

void cuda_moe_stats(float *stats, const int *cnt, const float *probs, const float *lse, int N, int X) {
    if (X <= 0) return;
    moe_check_experts(X, "moe statistics");
    int nb = cuda_moe_stats_blocks(N), rows = nb ? (N + nb - 1) / nb : 0;
    double *part = (double *)scratch((size_t)(nb ? nb : 1) * (X + 1) * sizeof(double));
    if (nb) {
        moe_stats_partial_kernel<<<nb, MOE_STATS_BLOCK, 0, g.stream>>>(part, probs, lse, N, X, rows);
        LAUNCH_CHECK(moe_stats_partial_kernel);
    }
    moe_stats_final_kernel<<<1, 256, 0, g.stream>>>(stats, cnt, part, nb, X);
    LAUNCH_CHECK(moe_stats_final_kernel);
}

void cuda_moe_route_backward(float *dlogits, const float *dgate_rows, const int *pos, const float *logits,
                             const float *probs, const int *idx, const float *gate, const float *lse, const float *stats,
                             float aux_scale, float z_scale, int N, int X, int k, int sigmoid) {
    if (N <= 0 || X <= 0) return;
    moe_check_experts(X, "moe routing backward");
    size_t smem = (size_t)MOE_ROW_WARPS * X * sizeof(double);
    moe_route_backward_kernel<<<(unsigned)((N + MOE_ROW_WARPS - 1) / MOE_ROW_WARPS), MOE_ROW_WARPS * 32, smem,
                                g.stream>>>(dlogits, dgate_rows, pos, logits, probs, idx, gate, lse, stats, aux_scale,
                                            z_scale, N, X, k, sigmoid);
    LAUNCH_CHECK(moe_route_backward_kernel);
}

/* The experts' products, one cuBLASLt product per expert with rows (weights at w + e wstride).
 * An expert's product can be small (a few thousand rows by the expert's width): its tiles then
 * fill a fraction of the card's SMs, and one after another they leave most of it idle. Such
 * products are spread over MOE_STREAMS queues instead (expert e on queue e % MOE_STREAMS, each
 * with its own cuBLASLt workspace), forked from and joined back to the caller's queue, so the
 * products of different experts overlap. Each product is the one it was alone (same algorithm,
 * same operands): the results do not depend on the overlap. Products that fill the card twice
 * over on their own stay on the caller's queue: on an H100 (bench_moe_cuda) spreading took 7%
 * off 64 experts of 256 (under a wave each), changed 16 of 512 (about two waves) by under 2%,
 * and made 8 of 768 (six waves) 3% slower. */
static int moe_spread(const int *off, int X, int C, int OC) {
    if (!g_moe.sms) CUDA_CHECK(cudaDeviceGetAttribute(&g_moe.sms, cudaDevAttrMultiProcessorCount, g.device));
    int busy = 0;
    for (int e = 0; e < X; e++) busy += off[e + 1] > off[e];
    if (busy < 2) return 0;
    long rows = (long)(off[X] - off[0]) / busy, wide = C > OC ? C : OC;
    return ((rows + 127) / 128) * ((wide + 127) / 128) < 2L * g_moe.sms; /* 128 x 128 tiles */
}
static void moe_streams_begin(void) {
    if (!g_moe.made) {
        CUDA_CHECK(cudaEventCreateWithFlags(&g_moe.fork, cudaEventDisableTiming));
        for (int i = 1; i < MOE_STREAMS; i++) {
            CUDA_CHECK(cudaStreamCreateWithFlags(&g_moe.s[i], cudaStreamNonBlocking));
            CUDA_CHECK(cudaEventCreateWithFlags(&g_moe.join[i], cudaEventDisableTiming));
            g_moe.ws[i] = cuda_malloc(WORKSPACE_BYTES);
        }
        g_moe.made = 1;
    }
    g_moe.caller = g.stream;
    g_moe.caller_ws = g.workspace;
    CUDA_CHECK(cudaEventRecord(g_moe.fork, g.stream));
    for (int i = 1; i < MOE_STREAMS; i++) CUDA_CHECK(cudaStreamWaitEvent(g_moe.s[i], g_moe.fork, 0));
}
/* the queue (and workspace) of expert e's products */
static void moe_streams_use(int e) {
    int i = e % MOE_STREAMS;
    g.stream = i ? g_moe.s[i] : g_moe.caller;
    g.workspace = i ? g_moe.ws[i] : g_moe.caller_ws;
}
static void moe_streams_end(void) {
    g.stream = g_moe.caller;
    g.workspace = g_moe.caller_ws;
    for (int i = 1; i < MOE_STREAMS; i++) {
        CUDA_CHECK(cudaEventRecord(g_moe.join[i], g_moe.s[i]));
        CUDA_CHECK(cudaStreamWaitEvent(g.stream, g_moe.join[i], 0));
    }
}

void cuda_moe_matmul_forward(void *out, const void *inp, const void *w, size_t wstride, const int *off, int X, int C,
                             int OC) {
    int spread = moe_spread(off, X, C, OC);
    if (spread) moe_streams_begin();
    for (int e = 0; e < X; e++) {
        int n = off[e + 1] - off[e];
        if (n <= 0) continue;
        if (spread) moe_streams_use(e);
        cuda_matmul_forward((void *)act_off(out, (size_t)off[e] * OC), OC, act_off(inp, (size_t)off[e] * C),
                            act_off(w, e * wstride), n, C, OC);
    }
    if (spread) moe_streams_end();
}

/* dinp written (acc = 0), dw accumulated; a NULL gradient is not computed, and its operand
 * (w for dinp, inp for dw) is not read */
void cuda_moe_matmul_backward(void *dinp, void *dw, size_t wstride, const void *dout, const void *inp, const void *w,
                              const int *off, int X, int C, int OC) {
    if (!dinp && !dw) return;
    int spread = moe_spread(off, X, C, OC);
    if (spread) moe_streams_begin();
    for (int e = 0; e < X; e++) {
        int n = off[e + 1] - off[e];
        if (n <= 0) continue;
        size_t r0 = (size_t)off[e];
        if (spread) moe_streams_use(e);
        cuda_matmul_backward(dinp ? (void *)act_off(dinp, r0 * C) : NULL,
                             dw ? (char *)dw + e * wstride * state_size() : NULL, act_off(dout, r0 * OC), OC,
                             dw ? act_off(inp, r0 * C) : NULL, dinp ? act_off(w, e * wstride) : NULL, n, C, OC, 0);
    }
    if (spread) moe_streams_end();
}

void cuda_moe_combine(void *out, const void *ys, const float *gate, const int *pos, int N, int k, int E) {
    if (N <= 0 || E <= 0) return;
    if (E % 8 == 0 && al16(out) && al16(ys)) {
        size_t nv = (size_t)N * E / 8;
        moe_combine8_kernel<<<ew_grid(nv), EW_BLOCK, 0, g.stream>>>(out, ys, gate, pos, k, E, nv, g.bf16);
        LAUNCH_CHECK(moe_combine8_kernel);
        return;
    }
    moe_combine_kernel<<<ew_grid((size_t)N * E), EW_BLOCK, 0, g.stream>>>(out, ys, gate, pos, k, E, (size_t)N * E,
                                                                         g.bf16);
    LAUNCH_CHECK(moe_combine_kernel);
}

void cuda_moe_unpermute(void *dx, const void *dxs, const int *pos, int N, int k, int E, int acc) {
    if (N <= 0 || E <= 0) return;
    if (E % 8 == 0 && al16(dx) && al16(dxs)) {
        size_t nv = (size_t)N * E / 8;
        moe_unpermute8_kernel<<<ew_grid(nv), EW_BLOCK, 0, g.stream>>>(dx, dxs, pos, k, E, nv, acc, g.bf16);
        LAUNCH_CHECK(moe_unpermute8_kernel);
        return;
    }
    moe_unpermute_kernel<<<ew_grid((size_t)N * E), EW_BLOCK, 0, g.stream>>>(dx, dxs, pos, k, E, (size_t)N * E, acc,
                                                                           g.bf16);
    LAUNCH_CHECK(moe_unpermute_kernel);
}

void cuda_moe_gate_backward(float *dgate_rows, void *h, void *dh, const float *gate_rows, int P, int H) {
    if (P <= 0) return;
    if (H <= 0) {
        CUDA_CHECK(cudaMemsetAsync(dgate_rows, 0, (size_t)P * sizeof(float), g.stream));
        return;
    }
    int vec = H % 8 == 0 && al16(h) && al16(dh);
    moe_gate_backward_kernel<<<(unsigned)((P + MOE_GATE_WARPS - 1) / MOE_GATE_WARPS), MOE_GATE_WARPS * 32, 0,
                               g.stream>>>(dgate_rows, h, dh, gate_rows, P, H, vec, g.bf16);
    LAUNCH_CHECK(moe_gate_backward_kernel);
}

void cuda_moe_accumulate(float *acc, const float *stats, int rows, int X, int k) {
    if (X <= 0) return;
    moe_accumulate_kernel<<<1, 1, 0, g.stream>>>(acc, stats, rows, X, k);
    LAUNCH_CHECK(moe_accumulate_kernel);
}

} /* extern "C" */
