/* src/ops/cuda/matmul_lt.cuh: matrix products through cuBLASLt: plans, the heuristic, the algorithm cache
 * per shape, and the call.
 * Part of ops_cuda.cu, which includes it at this point of its one translation unit (after
 * the state and helpers it uses): not a header to include anywhere else. */
/* ------------------------------------------------------------------------------------ */
/* matmul through cuBLASLt                                                               */

/* cuBLASLt is column-major. A row-major [R, K] matrix is, read column-major, its transpose
 * [K, R] with leading dimension K. So every row-major product Y = X W^T is computed as the
 * column-major Y^T = W X^T (see the callers). Each pointer's real alignment is passed to the
 * heuristic (its default assumes 256 bytes), so slices at any float offset work. The chosen
 * algorithm is cached per shape; the heuristic is deterministic, so is the choice. Where the
 * options are not deterministic, after a run's first step matmul_tune.cuh may swap it for a
 * faster one of the heuristic's list that gives bitwise the same results on random operands. */

static uint32_t ptr_alignment(const void *p) {
    uintptr_t a = (uintptr_t)p;
    uint32_t al = 256;
    while (al > 2 && a % al) al >>= 1;
    return al;
}

/* A product's descriptor and its three layouts (the matrices as stored, before op): LtPlan. */
static void lt_plan(LtPlan *p, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, int lda, int ldb,
                    int ldd, cudaDataType_t tab, cudaDataType_t td, cublasComputeType_t ct) {
    CUBLAS_CHECK(lt.cublasLtMatmulDescCreate(&p->op, ct, CUDA_R_32F));
    CUBLAS_CHECK(lt.cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(lt.cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    CUBLAS_CHECK(lt.cublasLtMatrixLayoutCreate(&p->la, tab, ta == CUBLAS_OP_N ? m : k, ta == CUBLAS_OP_N ? k : m, lda));
    CUBLAS_CHECK(lt.cublasLtMatrixLayoutCreate(&p->lb, tab, tb == CUBLAS_OP_N ? k : n, tb == CUBLAS_OP_N ? n : k, ldb));
    CUBLAS_CHECK(lt.cublasLtMatrixLayoutCreate(&p->ld, td, m, n, ldd));
}
static void lt_plan_free(LtPlan *p) {
    CUBLAS_CHECK(lt.cublasLtMatrixLayoutDestroy(p->la));
    CUBLAS_CHECK(lt.cublasLtMatrixLayoutDestroy(p->lb));
    CUBLAS_CHECK(lt.cublasLtMatrixLayoutDestroy(p->ld));
    CUBLAS_CHECK(lt.cublasLtMatmulDescDestroy(p->op));
}
/* up to max of the heuristic's algorithms for the plan and the pointers' alignments, best first */
static int lt_heuristic(const LtPlan *p, const uint32_t al[4], int max, cublasLtMatmulHeuristicResult_t *res) {
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(lt.cublasLtMatmulPreferenceCreate(&pref));
    uint64_t ws = WORKSPACE_BYTES;
    CUBLAS_CHECK(lt.cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    const cublasLtMatmulPreferenceAttributes_t which[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4; i++)
        CUBLAS_CHECK(lt.cublasLtMatmulPreferenceSetAttribute(pref, which[i], &al[i], sizeof al[i]));
    int nres = 0;
    CUBLAS_CHECK(lt.cublasLtMatmulAlgoGetHeuristic(g.lt, p->op, p->la, p->lb, p->ld, p->ld, pref, max, res, &nres));
    CUBLAS_CHECK(lt.cublasLtMatmulPreferenceDestroy(pref));
    return nres;
}

/* Empties cache entry slot: its plan freed, unlinked from its bucket. */
static void lt_cache_drop(int slot) {
    AlgoEntry *e = &g_algos[slot];
    if (!e->used) return;
    int *link = &g_algo_head[e->bucket];
    while (*link && *link != slot + 1) link = &g_algos[*link - 1].next;
    if (*link) *link = e->next;
    lt_plan_free(&e->plan);
    memset(e, 0, sizeof *e);
}
static void lt_cache_free(void) {
    for (int i = 0; i < ALGO_CACHE; i++) lt_cache_drop(i);
    g_algo_next = 0;
}

/* D's type (d_state below) */
enum { LT_D_ACT = 0, LT_D_STATE = 1, LT_D_F32 = 2 };
/* column-major D[m, n] = op(A)[m, k] @ op(B)[k, n] + beta * C, where C is D unless given
 * (then of D's type and layout: the residual added in the epilogue). A and B are activations
 * or compute weights (fp32, or bf16 with precision mixed or bf16); D is that type too
 * (LT_D_ACT), or the state type (LT_D_STATE: weight gradients, fp32 unless precision=bf16),
 * or fp32 whatever the precision (LT_D_F32: the MoE router's logits). Accumulation is
 * always fp32. */
static void lt_matmul_c(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void *A, int lda,
                        const void *B, int ldb, float beta, const void *C, void *D, int ldd, int d_state) {
    if (!C) C = D;
    if (!g.ready) die(1, "cuda: a matmul was called before cuda_init");
    cudaDataType_t tab = g.bf16 ? CUDA_R_16BF : CUDA_R_32F;
    cudaDataType_t td = d_state == LT_D_F32 ? CUDA_R_32F : d_state ? (g.sbf16 ? CUDA_R_16BF : CUDA_R_32F) : tab;
    cublasComputeType_t ct = g.tf32 && !g.bf16 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    uint32_t al_a = ptr_alignment(A), al_b = ptr_alignment(B), al_c = ptr_alignment(C), al_d = ptr_alignment(D);
    const int key[16] = {(int)ta, (int)tb, m, n, k, lda, ldb, ldd, g.tf32, (int)tab, (int)td, (int)ct,
                         (int)al_a, (int)al_b, (int)al_c, (int)al_d};
    unsigned h = 2166136261u;
    for (int i = 0; i < 16; i++) h = (h ^ (unsigned)key[i]) * 16777619u;
    h %= ALGO_BUCKETS;
    AlgoEntry *hit = NULL;
    for (int i = g_algo_head[h]; i && !hit; i = g_algos[i - 1].next) {
        AlgoEntry *e = &g_algos[i - 1];
        if (e->ta == (int)ta && e->tb == (int)tb && e->m == m && e->n == n && e->k == k && e->lda == lda &&
            e->ldb == ldb && e->ldd == ldd && e->tf32 == g.tf32 && e->tab == (int)tab && e->td == (int)td &&
            e->ct == (int)ct && e->al_a == al_a && e->al_b == al_b && e->al_c == al_c && e->al_d == al_d)
            hit = e;
    }
    if (!hit) {
        LtPlan p;
        lt_plan(&p, ta, tb, m, n, k, lda, ldb, ldd, tab, td, ct);
        const uint32_t al[4] = {al_a, al_b, al_c, al_d};
        cublasLtMatmulHeuristicResult_t res;
        if (lt_heuristic(&p, al, 1, &res) < 1)
            die(1, "cuda: cuBLASLt has no algorithm for the matmul m=%d n=%d k=%d (transa %d transb %d)", m, n, k,
                (int)ta, (int)tb);
        int slot = g_algo_next;
        g_algo_next = (g_algo_next + 1) % ALGO_CACHE;
        lt_cache_drop(slot);
        hit = &g_algos[slot];
        hit->used = 1;
        hit->ta = (int)ta; hit->tb = (int)tb;
        hit->m = m; hit->n = n; hit->k = k;
        hit->lda = lda; hit->ldb = ldb; hit->ldd = ldd;
        hit->tf32 = g.tf32;
        hit->tab = (int)tab; hit->td = (int)td; hit->ct = (int)ct;
        hit->al_a = al_a; hit->al_b = al_b; hit->al_c = al_c; hit->al_d = al_d;
        hit->algo = res.algo;
        hit->plan = p;
        hit->bucket = (int)h;
        hit->next = g_algo_head[h];
        g_algo_head[h] = slot + 1;
    }
    hit->calls++;
    hit->beta_seen |= beta != 0.0f ? 2 : 1;
    const float alpha = 1.0f;
    const LtPlan *p = &hit->plan;
    CUBLAS_CHECK(lt.cublasLtMatmul(g.lt, p->op, &alpha, A, p->la, B, p->lb, &beta, C, p->ld, D, p->ld, &hit->algo,
                                   g.workspace, WORKSPACE_BYTES, g.stream));
    if (g.sync_each) CUDA_CHECK(cudaStreamSynchronize(g.stream));
}
static void lt_matmul(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void *A, int lda,
                      const void *B, int ldb, float beta, void *D, int ldd, int d_state) {
    lt_matmul_c(ta, tb, m, n, k, A, lda, B, ldb, beta, NULL, D, ldd, d_state);
}
