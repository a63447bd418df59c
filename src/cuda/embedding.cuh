/* src/cuda/embedding.cuh: embedding forward and backward kernels.
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
