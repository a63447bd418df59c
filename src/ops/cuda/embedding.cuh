/* src/ops/cuda/embedding.cuh: embedding forward and backward kernels.
 * Part of ops_cuda.cu, which includes it at this point of its one translation unit (after
 * the helpers it uses): not a header to include anywhere else. */
/* ------------------------------------------------------------------------------------ */
/* embedding                                                                             */

/* One thread per output element; consecutive threads read consecutive channels. */
static __global__ void embedding_forward_kernel(void *out, const int *tokens, const void *wte, int N, int C,
                                                int bf) {
    size_t total = (size_t)N * C;
    GRID_STRIDE(i, total) {
        size_t n = i / C;
        int c = (int)(i % C);
        st(out, i, ld(wte, (size_t)tokens[n] * C + c, bf), bf);
    }
}

/* Vocabulary parallel: wte holds rows [lo, lo + rows); other tokens give zeros. */
static __global__ void embedding_forward_shard_kernel(void *out, const int *tokens, const void *wte, int N, int C,
                                                      int lo, int rows, int bf) {
    size_t total = (size_t)N * C;
    GRID_STRIDE(i, total) {
        size_t n = i / C;
        int c = (int)(i % C);
        unsigned r = (unsigned)(tokens[n] - lo);
        st(out, i, r < (unsigned)rows ? ld(wte, (size_t)r * C + c, bf) : 0.0f, bf);
    }
}

/* Deterministic without sorting: a thread owns one channel c of one bucket of the
 * vocabulary (token % EMB_BUCKETS == blockIdx.y) and walks ALL tokens in order, adding the
 * ones in its bucket. So every dwte element gets its additions in token order, exactly as
 * the CPU backend does (bitwise equal), and different tokens proceed in parallel. The
 * tokens are staged through shared memory; the bucket test is uniform across the block, so
 * there is no divergence. */
#define EMB_BUCKETS 32
#define EMB_BLOCK 128
#define EMB_CHUNK 1024
static __global__ void embedding_backward_kernel(void *dwte, const void *dout, const int *tokens, int N, int C,
                                                 int bf, int sbf) {
    __shared__ int tok_s[EMB_CHUNK];
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    int bucket = blockIdx.y;
    for (int n0 = 0; n0 < N; n0 += EMB_CHUNK) {
        int len = N - n0 < EMB_CHUNK ? N - n0 : EMB_CHUNK;
        __syncthreads(); /* the previous chunk is consumed */
        for (int i = threadIdx.x; i < len; i += blockDim.x) tok_s[i] = tokens[n0 + i];
        __syncthreads();
        if (c < C)
            for (int i = 0; i < len; i++) {
                int t = tok_s[i];
                if (t % EMB_BUCKETS == bucket) {
                    size_t j = (size_t)t * C + c;
                    st(dwte, j, ld(dwte, j, sbf) + ld(dout, (size_t)(n0 + i) * C + c, bf), sbf);
                }
            }
    }
}

/* From the tokens grouped by row (embedding_rows_index): a thread owns one channel of one
 * row and adds that row's positions in order in a register, rounded to the state type
 * after each add as a store would round it, so the result is embedding_backward_kernel's
 * bitwise; one read and one write of dwte. Loads go EMBR_UNROLL at a time (frequent
 * tokens have thousands of positions, added in a fixed order). */
#define EMBR_BLOCK 128
#define EMBR_UNROLL 16
static __global__ void embedding_backward_rows_kernel(void *dwte, const void *dout, const int *idx, int nr, int C,
                                                      int bf, int sbf) {
    int i = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int *off = idx + nr, *pos = off + nr + 1;
    size_t j = (size_t)idx[i] * C + c;
    float acc = ld(dwte, j, sbf);
    int k = off[i], end = off[i + 1];
    for (; k + EMBR_UNROLL <= end; k += EMBR_UNROLL) {
        float v[EMBR_UNROLL];
#pragma unroll
        for (int u = 0; u < EMBR_UNROLL; u++) v[u] = ld(dout, (size_t)pos[k + u] * C + c, bf);
#pragma unroll
        for (int u = 0; u < EMBR_UNROLL; u++) {
            acc = __fadd_rn(acc, v[u]);
            if (sbf) acc = __bfloat162float(__float2bfloat16(acc));
        }
    }
    for (; k < end; k++) {
        acc = __fadd_rn(acc, ld(dout, (size_t)pos[k] * C + c, bf));
        if (sbf) acc = __bfloat162float(__float2bfloat16(acc));
    }
    st(dwte, j, acc, sbf);
}
