/* tp_fused_probe — what tensor parallel's row-parallel product and its sum over tp = 2 could cost
 * without a collective on the SMs, measured in one process on two GPUs (peer access on), before
 * building it into the model (issue 19: the forward's all-reduces are exposed, and beside the
 * products NCCL's kernels take their SMs). The product is Y[N, E] = X[N, K] W[E, K]^T in bf16
 * (fp32 accumulate), each GPU holding its own X and W (its half of the heads or FFN units), and
 * Y must be the sum of both GPUs' products. Per shape, milliseconds a step, both GPUs at once:
 *   gemm      the product alone (no sum: the floor)
 *   halves    the product as two products of N/2 rows (what the fused ways cost in products)
 *   nccl      the product, then NCCL's all-reduce of Y (today's tensor parallel, no sequence parallel)
 *   rs_nccl   the product, then NCCL's reduce-scatter (today's, with sequence parallel)
 *   fused_ag  each GPU writes the rows the other owns straight into the other's memory (the
 *             product's stores go over NVLink), waits for the other's, then computes its own rows
 *             with beta = 1 on them (the sum in the epilogue), then copies its finished rows to
 *             the other (copy engine): an all-reduce with nothing on the SMs but the products
 *   fused_rs  the same without the last copy (a reduce-scatter: sequence parallel's)
 * Cross-GPU order by events (one process), as a multi-process version would by IPC flags.
 * Usage: tp_fused_probe [N:E:K ...]   (default 4096:4096:2048 4096:4096:3072: the TP-efficiency
 * model's att_out_proj and down_proj at tp = 2). Needs two GPUs with peer access. */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>

/* A failed call ends the probe with one line naming it; CK, CB and CN check the CUDA runtime's,
 * cuBLAS's and NCCL's return codes. */
static void fail(const char *call, const char *why) {
    fprintf(stderr, "tp_fused_probe: %s: %s\n", call, why);
    exit(1);
}
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) fail(#x, cudaGetErrorString(e_)); } while (0)
#define CB(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) fail(#x, cublasGetStatusString(s_)); } while (0)
#define CN(x) do { ncclResult_t r_ = (x); if (r_ != ncclSuccess) fail(#x, ncclGetErrorString(r_)); } while (0)

typedef __nv_bfloat16 bf16;

static __global__ void fill_kernel(bf16 *p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
        p[i] = __float2bfloat16(((float)(h & 0xffff) / 65535.f - 0.5f) * 0.1f);
    }
}

typedef struct {
    cublasHandle_t h;
    cudaStream_t s;
    ncclComm_t nc;
    bf16 *X, *W, *Y, *R; /* R: the rows this GPU owns, as the other GPU's product writes them */
    cudaEvent_t sent, done;
} Gpu;

static Gpu g[2];
static int N, E, K;

/* rows [r0, r0 + n) of X W^T into D (row-major, E columns), beta 0 or 1 (D read). cuBLAS is
 * column-major: D^T [E, n] = W [E, K] X^T, W stored [E][K] = column-major K x E, so op T. */
static void gemm(int d, int r0, int n, bf16 *D, float beta) {
    const float alpha = 1.f;
    CB(cublasGemmEx(g[d].h, CUBLAS_OP_T, CUBLAS_OP_N, E, n, K, &alpha, g[d].W, CUDA_R_16BF, K,
                    g[d].X + (size_t)r0 * K, CUDA_R_16BF, K, &beta, D, CUDA_R_16BF, E, CUBLAS_COMPUTE_32F,
                    CUBLAS_GEMM_DEFAULT));
}

enum { GEMM, HALVES, NCCL_AR, NCCL_RS, FUSED_AG, FUSED_RS, N_WAYS };
static const char *names[N_WAYS] = {"gemm", "halves", "nccl", "rs_nccl", "fused_ag", "fused_rs"};

static void one_step(int way) {
    const int h = N / 2;
    size_t half = (size_t)h * E;
    switch (way) {
    case GEMM:
        for (int d = 0; d < 2; d++) {
            CK(cudaSetDevice(d));
            gemm(d, 0, N, g[d].Y, 0.f);
        }
        break;
    case HALVES:
        for (int d = 0; d < 2; d++) {
            CK(cudaSetDevice(d));
            gemm(d, (1 - d) * h, h, g[d].Y + (1 - d) * half, 0.f);
            gemm(d, d * h, h, g[d].Y + d * half, 0.f);
        }
        break;
    case NCCL_AR:
    case NCCL_RS:
        for (int d = 0; d < 2; d++) {
            CK(cudaSetDevice(d));
            gemm(d, 0, N, g[d].Y, 0.f);
        }
        CN(ncclGroupStart());
        for (int d = 0; d < 2; d++) {
            if (way == NCCL_AR)
                CN(ncclAllReduce(g[d].Y, g[d].Y, (size_t)N * E, ncclBfloat16, ncclSum, g[d].nc, g[d].s));
            else
                CN(ncclReduceScatter(g[d].Y, g[d].R, half, ncclBfloat16, ncclSum, g[d].nc, g[d].s));
        }
        CN(ncclGroupEnd());
        break;
    case FUSED_AG:
    case FUSED_RS:
        /* the other's rows, into the other's R (peer stores), then say so */
        for (int d = 0; d < 2; d++) {
            CK(cudaSetDevice(d));
            gemm(d, (1 - d) * h, h, g[1 - d].R, 0.f);
            CK(cudaEventRecord(g[d].sent, g[d].s));
        }
        /* own rows with beta = 1 on the other's partial sum: R = own + other's */
        for (int d = 0; d < 2; d++) {
            CK(cudaSetDevice(d));
            CK(cudaStreamWaitEvent(g[d].s, g[1 - d].sent, 0));
            gemm(d, d * h, h, g[d].R, 1.f);
        }
        if (way == FUSED_AG) { /* the finished rows to the other GPU's Y (copy engine), and own */
            for (int d = 0; d < 2; d++) {
                CK(cudaSetDevice(d));
                CK(cudaMemcpyPeerAsync(g[1 - d].Y + d * half, 1 - d, g[d].R, d, half * sizeof(bf16), g[d].s));
                CK(cudaMemcpyAsync(g[d].Y + d * half, g[d].R, half * sizeof(bf16), cudaMemcpyDeviceToDevice, g[d].s));
                CK(cudaEventRecord(g[d].done, g[d].s));
            }
            for (int d = 0; d < 2; d++) {
                CK(cudaSetDevice(d));
                CK(cudaStreamWaitEvent(g[d].s, g[1 - d].done, 0));
            }
        }
        break;
    }
}

static void sync_both(void) {
    for (int d = 0; d < 2; d++) {
        CK(cudaSetDevice(d));
        CK(cudaStreamSynchronize(g[d].s));
    }
}

/* ms a step: the median of 5 timings of 20 steps */
static double time_way(int way) {
    double t[5];
    for (int i = 0; i < 3; i++) one_step(way);
    sync_both();
    for (int r = 0; r < 5; r++) {
        cudaEvent_t a, b;
        CK(cudaSetDevice(0));
        CK(cudaEventCreate(&a));
        CK(cudaEventCreate(&b));
        CK(cudaEventRecord(a, g[0].s));
        for (int i = 0; i < 20; i++) one_step(way);
        /* GPU 0's clock stops when both are done */
        CK(cudaSetDevice(1));
        CK(cudaEventRecord(g[1].done, g[1].s));
        CK(cudaSetDevice(0));
        CK(cudaStreamWaitEvent(g[0].s, g[1].done, 0));
        CK(cudaEventRecord(b, g[0].s));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        t[r] = ms / 20;
        CK(cudaEventDestroy(a));
        CK(cudaEventDestroy(b));
    }
    sync_both();
    for (int i = 0; i < 5; i++)
        for (int j = i + 1; j < 5; j++)
            if (t[j] < t[i]) { double x = t[i]; t[i] = t[j]; t[j] = x; }
    return t[2];
}

/* fused_ag's Y equals nccl's (the same sum; the order of the two partials' addition is the
 * same fp32 epilogue add, so bitwise equal is not promised: max abs difference printed) */
static double check_sum(void) {
    size_t n = (size_t)N * E;
    bf16 *a = (bf16 *)malloc(n * sizeof(bf16)), *b = (bf16 *)malloc(n * sizeof(bf16));
    one_step(NCCL_AR);
    sync_both();
    CK(cudaSetDevice(1));
    CK(cudaMemcpy(a, g[1].Y, n * sizeof(bf16), cudaMemcpyDeviceToHost));
    one_step(FUSED_AG);
    sync_both();
    CK(cudaSetDevice(1));
    CK(cudaMemcpy(b, g[1].Y, n * sizeof(bf16), cudaMemcpyDeviceToHost));
    double md = 0, mr = 0;
    for (size_t i = 0; i < n; i++) {
        double x = __bfloat162float(a[i]), y = __bfloat162float(b[i]), dd = x > y ? x - y : y - x;
        if (dd > md) md = dd;
        if ((x > 0 ? x : -x) > mr) mr = x > 0 ? x : -x;
    }
    free(a), free(b);
    return mr > 0 ? md / mr : md;
}

int main(int argc, char **argv) {
    int n = 0;
    CK(cudaGetDeviceCount(&n));
    if (n < 2) {
        fprintf(stderr, "tp_fused_probe: needs two GPUs (found %d)\n", n);
        return 1;
    }
    int ok01 = 0, ok10 = 0;
    CK(cudaDeviceCanAccessPeer(&ok01, 0, 1));
    CK(cudaDeviceCanAccessPeer(&ok10, 1, 0));
    if (!ok01 || !ok10) {
        fprintf(stderr, "tp_fused_probe: GPUs 0 and 1 have no peer access\n");
        return 1;
    }
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    printf("card: %s x 2\n", p.name);
    int devs[2] = {0, 1};
    ncclComm_t comms[2];
    CN(ncclCommInitAll(comms, 2, devs));
    static const char *defaults[] = {"4096:4096:2048", "4096:4096:3072"};
    int nshapes = argc > 1 ? argc - 1 : 2;
    printf("%-16s", "N:E:K");
    for (int w = 0; w < N_WAYS; w++) printf(" %9s", names[w]);
    printf("   (ms a step, both GPUs; fused_ag's sum against nccl's: max rel diff)\n");
    for (int si = 0; si < nshapes; si++) {
        const char *sh = argc > 1 ? argv[si + 1] : defaults[si];
        if (sscanf(sh, "%d:%d:%d", &N, &E, &K) != 3 || N <= 0 || N % 2 || E <= 0 || K <= 0) {
            fprintf(stderr, "tp_fused_probe: bad shape %s (N:E:K, N even)\n", sh);
            return 2;
        }
        for (int d = 0; d < 2; d++) {
            CK(cudaSetDevice(d));
            cudaError_t pe = cudaDeviceEnablePeerAccess(1 - d, 0);
            if (pe != cudaSuccess && pe != cudaErrorPeerAccessAlreadyEnabled) CK(pe);
            (void)cudaGetLastError();
            if (!g[d].h) {
                CB(cublasCreate(&g[d].h));
                CK(cudaStreamCreateWithFlags(&g[d].s, cudaStreamNonBlocking));
                CB(cublasSetStream(g[d].h, g[d].s));
                CK(cudaEventCreateWithFlags(&g[d].sent, cudaEventDisableTiming));
                CK(cudaEventCreateWithFlags(&g[d].done, cudaEventDisableTiming));
                g[d].nc = comms[d];
            } else {
                CK(cudaFree(g[d].X));
                CK(cudaFree(g[d].W));
                CK(cudaFree(g[d].Y));
                CK(cudaFree(g[d].R));
            }
            CK(cudaMalloc(&g[d].X, (size_t)N * K * sizeof(bf16)));
            CK(cudaMalloc(&g[d].W, (size_t)E * K * sizeof(bf16)));
            CK(cudaMalloc(&g[d].Y, (size_t)N * E * sizeof(bf16)));
            CK(cudaMalloc(&g[d].R, (size_t)N / 2 * E * sizeof(bf16)));
            fill_kernel<<<1024, 256, 0, g[d].s>>>(g[d].X, (size_t)N * K, 17u + d);
            fill_kernel<<<1024, 256, 0, g[d].s>>>(g[d].W, (size_t)E * K, 91u + 7u * d);
            CK(cudaGetLastError());
        }
        sync_both();
        printf("%-16s", sh);
        for (int w = 0; w < N_WAYS; w++) {
            printf(" %9.4f", time_way(w));
            fflush(stdout);
        }
        printf("   %.2e\n", check_sum());
    }
    for (int d = 0; d < 2; d++) CN(ncclCommDestroy(comms[d]));
    return 0;
}
