/* lt_algos_probe — does cuBLASLt's first heuristic choice leave speed behind at the step's
 * products? ops_cuda.cu takes the heuristic's first algorithm for every shape (deterministic, so
 * a run is bitwise repeatable). For each product of one layer and of the head of the post's
 * model (E=1024, H=1536, N=32768 tokens, lm_head in chunks of 8192 rows), called exactly as
 * ops_cuda.cu calls it (column-major: forward D[OC,N] = W^T X, input gradient D[C,N] = W dY,
 * weight gradient D[C,OC] += X dY^T into fp32), this asks the heuristic for up to 16
 * algorithms, times each (20 calls queued back to back, median of 5), and prints the first's
 * time, the fastest's, and whether the fastest gives bitwise the first's result.
 * Usage: lt_algos_probe [E H N V CHUNK]   (bf16 inputs, fp32 accumulation, as precision=mixed) */
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CK(x)                                                                                   \
    do {                                                                                        \
        cudaError_t e_ = (x);                                                                   \
        if (e_ != cudaSuccess) {                                                                \
            fprintf(stderr, "lt_algos_probe: %s: %s\n", #x, cudaGetErrorString(e_));            \
            exit(1);                                                                            \
        }                                                                                       \
    } while (0)
#define LT(x)                                                                                   \
    do {                                                                                        \
        cublasStatus_t s_ = (x);                                                                \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                      \
            fprintf(stderr, "lt_algos_probe: %s: status %d\n", #x, (int)s_);                    \
            exit(1);                                                                            \
        }                                                                                       \
    } while (0)

enum { MAXALGO = 16, QUEUE = 20, REPS = 5 };
static const size_t WS = 32u << 20;

static __global__ void fill(__nv_bfloat16 *p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
        p[i] = __float2bfloat16(((h & 0xffff) / 32768.0f - 1.0f) * 0.5f);
    }
}

static int cmp_f(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

typedef struct {
    const char *name;
    cublasOperation_t ta, tb;
    int m, n, k, lda, ldb, ldd, d_f32;
    float beta;
} Prod;

static cublasLtHandle_t lt;
static void *ws;

static float time_algo(const Prod *p, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t la, cublasLtMatrixLayout_t lb,
                       cublasLtMatrixLayout_t ld, const cublasLtMatmulAlgo_t *algo, const void *A, const void *B,
                       void *D, cudaStream_t st, cudaEvent_t e0, cudaEvent_t e1) {
    const float one = 1.0f;
    float ms[REPS];
    for (int r = -1; r < REPS; r++) {
        CK(cudaEventRecord(e0, st));
        for (int q = 0; q < QUEUE; q++)
            LT(cublasLtMatmul(lt, op, &one, A, la, B, lb, &p->beta, D, ld, D, ld, algo, ws, WS, st));
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        if (r >= 0) {
            CK(cudaEventElapsedTime(&ms[r], e0, e1));
            ms[r] /= QUEUE;
        }
    }
    qsort(ms, REPS, sizeof ms[0], cmp_f);
    return ms[REPS / 2];
}

int main(int argc, char **argv) {
    int E = argc > 1 ? atoi(argv[1]) : 1024, H = argc > 2 ? atoi(argv[2]) : 1536, N = argc > 3 ? atoi(argv[3]) : 32768,
        V = argc > 4 ? atoi(argv[4]) : 50257, CH = argc > 5 ? atoi(argv[5]) : 8192;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("card: %s; E=%d H=%d N=%d V=%d chunk=%d; bf16 in, fp32 accumulation\n", prop.name, E, H, N, V, CH);
    Prod ps[] = {
        {"fwd qkv", CUBLAS_OP_T, CUBLAS_OP_N, 3 * E, N, E, E, E, 3 * E, 0, 0.0f},
        {"fwd att_out (+res)", CUBLAS_OP_T, CUBLAS_OP_N, E, N, E, E, E, E, 0, 1.0f},
        {"fwd gate_up", CUBLAS_OP_T, CUBLAS_OP_N, 2 * H, N, E, E, E, 2 * H, 0, 0.0f},
        {"fwd down (+res)", CUBLAS_OP_T, CUBLAS_OP_N, E, N, H, H, H, E, 0, 1.0f},
        {"fwd lm_head chunk", CUBLAS_OP_T, CUBLAS_OP_N, V, CH, E, E, E, V, 0, 0.0f},
        {"dX qkv", CUBLAS_OP_N, CUBLAS_OP_N, E, N, 3 * E, E, 3 * E, E, 0, 1.0f},
        {"dX att_out", CUBLAS_OP_N, CUBLAS_OP_N, E, N, E, E, E, E, 0, 0.0f},
        {"dX gate_up", CUBLAS_OP_N, CUBLAS_OP_N, E, N, 2 * H, E, 2 * H, E, 0, 1.0f},
        {"dX down", CUBLAS_OP_N, CUBLAS_OP_N, H, N, E, H, E, H, 0, 0.0f},
        {"dX lm_head chunk", CUBLAS_OP_N, CUBLAS_OP_N, E, CH, V, E, V, E, 0, 0.0f},
        {"dW qkv", CUBLAS_OP_N, CUBLAS_OP_T, E, 3 * E, N, E, 3 * E, E, 1, 1.0f},
        {"dW att_out", CUBLAS_OP_N, CUBLAS_OP_T, E, E, N, E, E, E, 1, 1.0f},
        {"dW gate_up", CUBLAS_OP_N, CUBLAS_OP_T, E, 2 * H, N, E, 2 * H, E, 1, 1.0f},
        {"dW down", CUBLAS_OP_N, CUBLAS_OP_T, H, E, N, H, E, H, 1, 1.0f},
        {"dW lm_head chunk", CUBLAS_OP_N, CUBLAS_OP_T, E, V, CH, E, V, E, 1, 1.0f},
    };
    LT(cublasLtCreate(&lt));
    CK(cudaMalloc(&ws, WS));
    size_t big = (size_t)(V > 3 * E ? V : 3 * E) * (size_t)(N > CH ? N : CH);
    __nv_bfloat16 *A, *B;
    void *D, *D0;
    CK(cudaMalloc(&A, big * 2));
    CK(cudaMalloc(&B, big * 2));
    CK(cudaMalloc(&D, big * 4));
    CK(cudaMalloc(&D0, big * 4));
    fill<<<1024, 256>>>(A, big, 1);
    fill<<<1024, 256>>>(B, big, 2);
    CK(cudaDeviceSynchronize());
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    printf("%-20s %6s %6s %6s  %5s %9s %9s %8s %8s  %s\n", "product", "m", "n", "k", "algos", "first ms", "best ms",
           "first TF", "best TF", "best's result");
    double tot_first = 0, tot_best = 0;
    for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) {
        const Prod *p = &ps[i];
        cudaDataType_t td = p->d_f32 ? CUDA_R_32F : CUDA_R_16BF;
        cublasLtMatmulDesc_t op;
        cublasLtMatrixLayout_t la, lb, ld;
        LT(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &p->ta, sizeof p->ta));
        LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &p->tb, sizeof p->tb));
        LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, p->ta == CUBLAS_OP_N ? p->m : p->k,
                                      p->ta == CUBLAS_OP_N ? p->k : p->m, p->lda));
        LT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, p->tb == CUBLAS_OP_N ? p->k : p->n,
                                      p->tb == CUBLAS_OP_N ? p->n : p->k, p->ldb));
        LT(cublasLtMatrixLayoutCreate(&ld, td, p->m, p->n, p->ldd));
        cublasLtMatmulPreference_t pref;
        LT(cublasLtMatmulPreferenceCreate(&pref));
        uint64_t wsb = WS;
        LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
        cublasLtMatmulHeuristicResult_t res[MAXALGO];
        int nres = 0;
        LT(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, MAXALGO, res, &nres));
        size_t dbytes = (size_t)p->ldd * p->n * (p->d_f32 ? 4 : 2);
        float t[MAXALGO];
        int best = 0;
        for (int a = 0; a < nres; a++) {
            t[a] = time_algo(p, op, la, lb, ld, &res[a].algo, A, B, D, st, e0, e1);
            if (t[a] < t[best]) best = a;
        }
        /* bitwise: the first and the fastest, each once from zero */
        const char *same = "-";
        if (best != 0) {
            Prod z = *p;
            z.beta = 0.0f;
            const float one = 1.0f;
            CK(cudaMemsetAsync(D0, 0, dbytes, st));
            LT(cublasLtMatmul(lt, op, &one, A, la, B, lb, &z.beta, D0, ld, D0, ld, &res[0].algo, ws, WS, st));
            CK(cudaMemsetAsync(D, 0, dbytes, st));
            LT(cublasLtMatmul(lt, op, &one, A, la, B, lb, &z.beta, D, ld, D, ld, &res[best].algo, ws, WS, st));
            CK(cudaStreamSynchronize(st));
            char *h0 = (char *)malloc(dbytes), *h1 = (char *)malloc(dbytes);
            CK(cudaMemcpy(h0, D0, dbytes, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(h1, D, dbytes, cudaMemcpyDeviceToHost));
            same = memcmp(h0, h1, dbytes) ? "differs" : "bitwise equal";
            free(h0), free(h1);
        }
        double fl = 2.0 * p->m * (double)p->n * p->k;
        printf("%-20s %6d %6d %6d  %5d %9.4f %9.4f %8.1f %8.1f  #%d %s\n", p->name, p->m, p->n, p->k, nres, t[0],
               t[best], fl / t[0] * 1e-9, fl / t[best] * 1e-9, best, same);
        int reps = strstr(p->name, "lm_head") ? N / CH : 16;  /* per step: 16 layers, N/CH head chunks */
        tot_first += reps * t[0], tot_best += reps * t[best];
        LT(cublasLtMatmulPreferenceDestroy(pref));
        LT(cublasLtMatrixLayoutDestroy(la));
        LT(cublasLtMatrixLayoutDestroy(lb));
        LT(cublasLtMatrixLayoutDestroy(ld));
        LT(cublasLtMatmulDescDestroy(op));
    }
    printf("a step's products (16 layers, %d head chunks): first %.2f ms, fastest %.2f ms (%.1f%% less)\n", N / CH,
           tot_first, tot_best, 100.0 * (1.0 - tot_best / tot_first));
    return 0;
}
