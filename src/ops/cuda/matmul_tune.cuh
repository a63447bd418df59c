/* src/ops/cuda/matmul_tune.cuh: op_tune_matmuls, which runs where the options are not
 * deterministic (the key deterministic=false): after a run's first step, each product shape
 * cached so far (g_algos) may take a faster algorithm from cuBLASLt's heuristic list, one that
 * gave bitwise the first choice's result on random operands.
 * Part of ops_cuda.cu, which includes it after lt_matmul_c: not a header to include anywhere else.
 *
 * Why: the heuristic's first choice leaves speed behind at some of the step's shapes. On an
 * H200 (bench/lt_algos_probe.cu) the post's att_out forward with its residual ran at 540
 * TFLOP/s where the list's sixth algorithm ran at 691, the down projection 580 against 653,
 * their input gradients 6-10% slower than the fastest: +1.3-1.4% a step on the post's model.
 * How: for each shape, on scratch operands of its size and alignments (random values; the run's
 * own buffers are not touched, so nothing in flight is disturbed), each of up to TUNE_ALGOS of
 * the list without split-K or a reduction scheme is timed (TUNE_REPS rounds of TUNE_QUEUE calls
 * queued back to back, the median round); one at least TUNE_GAIN faster than the cached
 * algorithm replaces it only if, from the same D and at each beta the shape was called with, it
 * writes bitwise the same D twice (a 64-bit hash of D's bytes).
 * Why only where determinism is not asked for: that check holds on the random operands, not
 * always on a run's own. At embed_dim 256 with grad_accum_steps=3 on an H200, 36 of 70 tuned runs
 * saved a checkpoint in which 150 of the lm_head's 12.9M weights had another last bit (max
 * relative difference 4.6e-10 after 5 steps), and none of 69 untuned runs did: which algorithms
 * a run takes depends on timings, so tuned runs are not bitwise repeatable. Kept to the first
 * choice's own kernel (the same algorithm id, tile, inner shape and custom option: only the
 * swizzle, stages or cluster shape may differ, which cannot move a sum), no shape of that run or
 * of the post's model found a faster algorithm (0 of 15), so that rule was dropped.
 * A shape whose scratch does not fit in the free memory (less a margin) keeps its algorithm. */

enum { TUNE_ALGOS = 8, TUNE_QUEUE = 5, TUNE_REPS = 3 };
#define TUNE_GAIN 0.97f                    /* at least 3% faster: noise does not flip a choice */
#define TUNE_MARGIN ((size_t)512 << 20)    /* free memory left beside the scratch */

static __global__ void tune_fill_kernel(void *p, size_t n, int bf, unsigned seed) {
    GRID_STRIDE(i, n) {
        unsigned h = (unsigned)i * 2654435761u ^ seed ^ (unsigned)(i >> 32) * 40503u;
        h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
        st(p, i, (float)(h & 0xffff) / 32768.0f - 1.0f, bf);
    }
}

/* sum over the 16-bit words w_i of (w_i + 1) (2 i h + 1), mod 2^64: any change of a word
 * changes it but with negligible chance; the order of the adds does not matter */
static __global__ void tune_hash_kernel(const uint16_t *p, size_t n, unsigned long long *out) {
    unsigned long long h = 0;
    GRID_STRIDE(i, n) h += (unsigned long long)(p[i] + 1u) * ((2ull * i * 0x9E3779B97F4A7C15ull) | 1ull);
    for (int o = 16; o > 0; o >>= 1) h += __shfl_down_sync(0xffffffffu, h, o);
    if ((threadIdx.x & 31) == 0) atomicAdd(out, h);
}

/* an algorithm's configuration (cublasLtMatmulAlgoConfigAttributes_t), each read as uint32 */
enum { CFG_ID, CFG_TILE, CFG_SPLITK, CFG_REDUCTION, CFG_SWIZZLE, CFG_CUSTOM, CFG_STAGES, CFG_INNER, CFG_CLUSTER, CFG_N };
static void tune_config(const cublasLtMatmulAlgo_t *algo, uint32_t cfg[CFG_N]) {
    static const size_t size[CFG_N] = {4, 4, 4, 4, 4, 4, 4, 2, 2}; /* INNER_SHAPE and CLUSTER_SHAPE: uint16 */
    for (int i = 0; i < CFG_N; i++) {
        size_t got = 0;
        cfg[i] = 0;  /* (little-endian: a uint16 lands in the low half) */
        if (lt.cublasLtMatmulAlgoConfigGetAttribute(algo, (cublasLtMatmulAlgoConfigAttributes_t)i, &cfg[i], size[i],
                                                    &got) != CUBLAS_STATUS_SUCCESS)
            cfg[i] = 0xffffffffu;
    }
}

/* whether algo sums each tile's K in one CTA (no split-K, no reduction scheme): the reduction
 * order is then the kernel's own, not one set at run time */
static int tune_candidate(const cublasLtMatmulAlgo_t *algo) {
    uint32_t c[CFG_N];
    tune_config(algo, c);
    return c[CFG_SPLITK] <= 1 && c[CFG_REDUCTION] == CUBLASLT_REDUCTION_SCHEME_NONE;
}

/* ms per call of algo on the plan (median of TUNE_REPS rounds), or -1 if cuBLASLt refuses it */
static float tune_time(const LtPlan *p, const cublasLtMatmulAlgo_t *algo, const void *A, const void *B, void *D,
                       float beta, cudaEvent_t e0, cudaEvent_t e1) {
    const float one = 1.0f;
    if (lt.cublasLtMatmul(g.lt, p->op, &one, A, p->la, B, p->lb, &beta, D, p->ld, D, p->ld, algo, g.workspace,
                          WORKSPACE_BYTES, g.stream) != CUBLAS_STATUS_SUCCESS) {
        (void)cudaGetLastError();
        return -1.0f;
    }
    float ms[TUNE_REPS];
    for (int r = 0; r < TUNE_REPS; r++) {
        CUDA_CHECK(cudaEventRecord(e0, g.stream));
        for (int q = 0; q < TUNE_QUEUE; q++)
            CUBLAS_CHECK(lt.cublasLtMatmul(g.lt, p->op, &one, A, p->la, B, p->lb, &beta, D, p->ld, D, p->ld, algo,
                                           g.workspace, WORKSPACE_BYTES, g.stream));
        CUDA_CHECK(cudaEventRecord(e1, g.stream));
        CUDA_CHECK(cudaEventSynchronize(e1));
        CUDA_CHECK(cudaEventElapsedTime(&ms[r], e0, e1));
        ms[r] /= TUNE_QUEUE;
    }
    for (int i = 1; i < TUNE_REPS; i++)  /* sort the few rounds */
        for (int j = i; j > 0 && ms[j] < ms[j - 1]; j--) {
            float t = ms[j];
            ms[j] = ms[j - 1], ms[j - 1] = t;
        }
    return ms[TUNE_REPS / 2];
}

/* the hash of D after one call of algo from the same starting D (seed 3) */
static unsigned long long tune_hash(const LtPlan *p, const cublasLtMatmulAlgo_t *algo, const void *A, const void *B,
                                    void *D, size_t d_elems, int d_bf, float beta, unsigned long long *dh) {
    const float one = 1.0f;
    tune_fill_kernel<<<ew_grid(d_elems), EW_BLOCK, 0, g.stream>>>(D, d_elems, d_bf, 3u);
    LAUNCH_CHECK(tune_fill_kernel);
    CUBLAS_CHECK(lt.cublasLtMatmul(g.lt, p->op, &one, A, p->la, B, p->lb, &beta, D, p->ld, D, p->ld, algo,
                                   g.workspace, WORKSPACE_BYTES, g.stream));
    CUDA_CHECK(cudaMemsetAsync(dh, 0, sizeof *dh, g.stream));
    size_t words = d_elems * (d_bf ? 2 : 4) / 2;
    tune_hash_kernel<<<ew_grid(words), EW_BLOCK, 0, g.stream>>>((const uint16_t *)D, words, dh);
    LAUNCH_CHECK(tune_hash_kernel);
    unsigned long long h = 0;
    CUDA_CHECK(cudaMemcpyAsync(&h, dh, sizeof h, cudaMemcpyDeviceToHost, g.stream));
    CUDA_CHECK(cudaStreamSynchronize(g.stream));
    return h;
}

/* Tunes every cached shape not yet tuned (op_tune_matmuls calls it only where the options are
 * not deterministic); a one-line report into rep. Returns the shapes that took another
 * algorithm, or -1 when nothing was cached. */
static int cuda_tune_matmuls(char *rep, size_t len) {
    if (!g.ready || g.stream != g.main) return -1;
    cuda_synchronize();  /* a step is complete: nothing in flight to time beside */
    g.graph_epoch++;     /* graphs recorded before hold the algorithms chosen before */
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    unsigned long long *dh = NULL;
    CUDA_CHECK(cudaMalloc(&dh, sizeof *dh));
    int shapes = 0, faster = 0, skipped = 0;
    double saved = 0, before = 0;  /* ms a step as timed: the tuned shapes' calls in the first step */
    size_t most = 0;
    for (int i = 0; i < ALGO_CACHE; i++) {
        AlgoEntry *e = &g_algos[i];
        if (!e->used || e->tuned) continue;
        e->tuned = 1;
        shapes++;
        size_t es = e->tab == (int)CUDA_R_16BF ? 2 : 4, ds = e->td == (int)CUDA_R_16BF ? 2 : 4;
        size_t na = (size_t)e->lda * (e->ta == (int)CUBLAS_OP_N ? e->k : e->m);
        size_t nb = (size_t)e->ldb * (e->tb == (int)CUBLAS_OP_N ? e->n : e->k);
        size_t nd = (size_t)e->ldd * e->n;
        /* the operands at the run's own alignments (a pointer 256 bytes on plus al is aligned to al) */
        size_t oa = e->al_a % 256, off_b = (oa + na * es + 255) / 256 * 256 + e->al_b % 256,
               off_d = (off_b + nb * es + 255) / 256 * 256 + e->al_d % 256, bytes = off_d + nd * ds;
        size_t fr = 0, tot = 0;
        char *buf = NULL;
        if (cudaMemGetInfo(&fr, &tot) != cudaSuccess || bytes + TUNE_MARGIN > fr ||
            cudaMalloc(&buf, bytes) != cudaSuccess) {
            (void)cudaGetLastError();
            skipped++;
            continue;
        }
        if (bytes > most) most = bytes;
        void *A = buf + oa, *B = buf + off_b, *D = buf + off_d;
        tune_fill_kernel<<<ew_grid(na), EW_BLOCK, 0, g.stream>>>(A, na, es == 2, 1u);
        LAUNCH_CHECK(tune_fill_kernel);
        tune_fill_kernel<<<ew_grid(nb), EW_BLOCK, 0, g.stream>>>(B, nb, es == 2, 2u);
        LAUNCH_CHECK(tune_fill_kernel);
        CUDA_CHECK(cudaMemsetAsync(D, 0, nd * ds, g.stream));
        const LtPlan *p = &e->plan;  /* (made when the shape was cached) */
        const uint32_t al[4] = {e->al_a, e->al_b, e->al_c, e->al_d};
        cublasLtMatmulHeuristicResult_t res[TUNE_ALGOS];
        int nres = lt_heuristic(p, al, TUNE_ALGOS, res);
        /* timed at the beta of the shape's calls (1 where some add to D); checked at each beta seen */
        float beta = e->beta_seen & 2 ? 1.0f : 0.0f;
        const cublasLtMatmulAlgo_t first = e->algo;
        float t0 = nres > 1 ? tune_time(p, &first, A, B, D, beta, e0, e1) : -1.0f, tb = t0;
        int best = -1, have_ref = 0;
        unsigned long long ref[2] = {0, 0};
        for (int a = 0; t0 > 0 && a < nres; a++) {
            if (!memcmp(&res[a].algo, &first, sizeof first) || !tune_candidate(&res[a].algo)) continue;
            float t = tune_time(p, &res[a].algo, A, B, D, beta, e0, e1);
            if (t <= 0 || t >= TUNE_GAIN * tb) continue;
            int same = 1;
            for (int bz = 0; bz < 2; bz++) {
                if (!(e->beta_seen & (1 << bz))) continue;
                float b = (float)bz;
                if (!have_ref) ref[bz] = tune_hash(p, &first, A, B, D, nd, ds == 2, b, dh);
                same = same && tune_hash(p, &res[a].algo, A, B, D, nd, ds == 2, b, dh) == ref[bz] &&
                       tune_hash(p, &res[a].algo, A, B, D, nd, ds == 2, b, dh) == ref[bz];
            }
            have_ref = 1;
            if (same) best = a, tb = t;
        }
        if (best >= 0) {
            e->algo = res[best].algo;
            faster++;
            saved += (double)e->calls * (t0 - tb);
        }
        if (t0 > 0) before += (double)e->calls * t0;
        CUDA_CHECK(cudaStreamSynchronize(g.stream));
        CUDA_CHECK(cudaFree(buf));
    }
    CUDA_CHECK(cudaFree(dh));
    CUDA_CHECK(cudaEventDestroy(e0));
    CUDA_CHECK(cudaEventDestroy(e1));
    if (!shapes) return -1;
    snprintf(rep, len,
             "matmul tuning: %d of %d product shapes took a faster cuBLASLt algorithm, equal on random operands "
             "(the first step's products %.1f -> %.1f ms as timed alone%s; scratch up to %zu MiB, freed; the run is "
             "not bitwise repeatable: its last bits depend on the timings)",
             faster, shapes, before, before - saved, skipped ? ", some shapes skipped: no memory for their scratch" : "",
             most >> 20);
    return faster;
}
