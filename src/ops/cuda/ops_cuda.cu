/* ops_cuda — the ops of ops.h as CUDA kernels on device pointers, in fp32, mixed or pure
 * bf16; matmuls through cuBLASLt (bf16 in, fp32 accumulate; exact fp32, or TF32 only when
 * asked for, in fp32).
 *
 * This file holds the backend's state, memory, cuBLASLt and the C entry points. The
 * kernels are in src/ops/cuda/, one .cuh per op family, which this file includes into its one
 * translation unit: common (reductions, the fp32/bf16 loads and stores), embedding,
 * rmsnorm, rope, attention (the generic kernels; the tensor-core one is attn_bf16.cu),
 * swiglu, crossentropy, adamw, flat (sumsq, scale, add, the bf16 copy), moe (the
 * mixture-of-experts routing, dispatch, combine and grouped products).
 *
 * Written as CUDA C: plain functions and kernels, no classes, templates or std::.
 * One stream for everything, so ops are ordered without events and the one scratch buffer
 * can be shared by all ops. Determinism: no float atomics; every reduction has an order
 * fixed by the shapes alone (never by the number of SMs), so two runs of the same op are
 * bitwise equal on any card; only where the options waive it (OpsOptions.deterministic = 0)
 * may attention's backward sum with atomics and the products take algorithms by their timings.
 *
 * Where an op is a few separately rounded fp32 operations (rope, adamw, scale, add,
 * embedding) the kernels use the __f*_rn intrinsics, which nvcc never fuses into FMAs, so
 * they give bitwise the CPU backend's result (gcc -std=c11 does not contract either).
 */
#include "ops_cuda.h"
#include "env.h"
#include "attn_bf16.h"
#include "attn_cudnn.h"
#include "attn_wgmma_bwd.h"
#include "ops.h"

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* util.h cannot be included in C++ (it uses C11's _Noreturn); die() is its error exit,
 * which prefixes "meshtrain: " (and the rank when there are several). */
extern "C" void die(int code, const char *fmt, ...) __attribute__((noreturn, format(printf, 2, 3)));

/* ------------------------------------------------------------------------------------ */
/* cuBLASLt, opened at cuda_init                                                         */

/* cuBLASLt is loaded with dlopen when the backend starts, not linked: loading the library
 * costs about 150 MiB of resident memory (its relocations), which every cpu run of a
 * CUDA-enabled build would otherwise pay. The soname is the one of the headers built
 * against; the executable's RUNPATH (the CUDA toolkit's lib64) and LD_LIBRARY_PATH find it. */
#define LT_STR2(x) #x
#define LT_STR(x) LT_STR2(x)
#define LT_SONAME "libcublasLt.so." LT_STR(CUBLAS_VER_MAJOR)
#define LT_FUNCS(X)                                                                        \
    X(cublasLtCreate) X(cublasLtDestroy) X(cublasLtGetStatusString) X(cublasLtMatmul)     \
    X(cublasLtMatmulAlgoGetHeuristic) X(cublasLtMatmulDescCreate)                          \
    X(cublasLtMatmulDescDestroy) X(cublasLtMatmulDescSetAttribute)                         \
    X(cublasLtMatmulPreferenceCreate) X(cublasLtMatmulPreferenceDestroy)                   \
    X(cublasLtMatmulPreferenceSetAttribute) X(cublasLtMatrixLayoutCreate)                  \
    X(cublasLtMatrixLayoutDestroy) X(cublasLtMatmulAlgoConfigGetAttribute)
static struct {
#define LT_FIELD(f) decltype(&::f) f;
    LT_FUNCS(LT_FIELD)
#undef LT_FIELD
    void *lib;
} lt;

static int lt_load(char *err, size_t errlen) {
    if (lt.lib) return 0;
    void *lib = dlopen(LT_SONAME, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(err, errlen, "cuda: cannot load cuBLASLt (%s)", dlerror());
        return -1;
    }
#define LT_SYM(f)                                                                          \
    if (!(lt.f = (decltype(lt.f))dlsym(lib, #f))) {                                       \
        snprintf(err, errlen, "cuda: %s lacks %s", LT_SONAME, #f);                         \
        dlclose(lib);                                                                      \
        return -1;                                                                         \
    }
    LT_FUNCS(LT_SYM)
#undef LT_SYM
    lt.lib = lib;
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* state and error checking                                                              */

#define WORKSPACE_BYTES (32u << 20) /* cuBLASLt workspace: what llm.c gives Hopper */

static struct {
    int ready, device, sync_each, tf32;
    int bf16;  /* activations and compute weights in bf16 (precision mixed or bf16) */
    int sbf16; /* parameters, gradients and moments in bf16 (precision bf16) */
    cudaStream_t stream;    /* where ops go: the main queue, or the side one between op_side_begin/end */
    cudaStream_t main, side;
    cudaEvent_t side_in, side_ev[OPS_SIDE_MARKS];
    int side_used;          /* side work since the last full synchronize */
    cublasLtHandle_t lt;
    void *workspace;
    void *scratch; /* grows on demand; ops use it only within one call, on the one stream */
    size_t scratch_bytes;
    unsigned graph_epoch; /* bumped where a recorded graph may no longer hold (op_graph_*) */
    size_t smem_optin; /* largest dynamic shared memory a block may opt in to */
    size_t att_smem_set[3]; /* what each attention kernel has been opted in to */
    OpsAttention att;       /* the options (ops_set_options): attention's kernels, */
    int nondet;             /* and 1 where they need not be deterministic (zeroed: the defaults) */
    size_t att_det_max;     /* cuda_set_attention_det_max; 0: ATTN_CUDNN_DET_MAX_BYTES */
    size_t rms_smem_set;    /* ... and the rmsnorm backward */
    size_t ce_smem_set;     /* ... and the bf16 cross-entropy */
    char name[256];
} g;

/* The queues the experts' products are spread over (moe.cuh), made on their first use: queue 0
 * is the caller's, with the caller's workspace; the others have their own. */
#define MOE_STREAMS 4
static struct {
    int made, sms;
    cudaStream_t s[MOE_STREAMS], caller;
    cudaEvent_t fork, join[MOE_STREAMS];
    void *ws[MOE_STREAMS], *caller_ws;
} g_moe;

/* Offload's copy queues (ops.h): two streams, one per direction, and an event per mark and
 * direction. op_copy_in and op_copy_sync are called from offload's worker thread too: the
 * current device is per host thread, so each such call selects the run's device first. */
static struct {
    cudaStream_t q[2]; /* 0: out (device -> host), 1: in */
    cudaEvent_t *ev[2], main_ev;
    int n;
} g_copy;
/* cuBLASLt algorithms chosen so far, per matmul shape and pointer alignment, each with its
 * plan (descriptor and layouts, made once: matmul_lt.cuh); ct, beta_seen (1: a call with beta 0,
 * 2: one with beta not 0), calls and tuned are for matmul_tune.cuh. The experts' products of a
 * MoE layer take a shape per expert and routing, so the cache is large and hashed: a lookup is
 * a few compares, where the heuristic and a plan's making cost microseconds of host time each. */
typedef struct {
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, ld;
} LtPlan;
typedef struct {
    int used, ta, tb, m, n, k, lda, ldb, ldd, tf32, tab, td, ct, beta_seen, calls, tuned;
    uint32_t al_a, al_b, al_c, al_d;
    cublasLtMatmulAlgo_t algo;
    LtPlan plan;
    int bucket, next; /* its hash bucket, and the next entry + 1 in it (0: the last) */
} AlgoEntry;
#define ALGO_CACHE 2048
#define ALGO_BUCKETS 4096
static AlgoEntry g_algos[ALGO_CACHE];
static int g_algo_head[ALGO_BUCKETS]; /* first entry + 1 of each bucket (0: empty) */
static int g_algo_next;

static void cuda_fail(const char *call, const char *msg, const char *file, int line) __attribute__((noreturn));
static void cuda_fail(const char *call, const char *msg, const char *file, int line) {
    die(1, "cuda: %s failed: %s (%s:%d)", call, msg, file, line);
}

#define CUDA_CHECK(call)                                                                   \
    do {                                                                                   \
        cudaError_t e_ = (call);                                                           \
        if (e_ != cudaSuccess) cuda_fail(#call, cudaGetErrorString(e_), __FILE__, __LINE__); \
    } while (0)

#define CUBLAS_CHECK(call)                                                                 \
    do {                                                                                   \
        cublasStatus_t s_ = (call);                                                        \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                   \
            cuda_fail(#call, lt.cublasLtGetStatusString(s_), __FILE__, __LINE__);          \
    } while (0)

/* After every launch: a bad launch configuration shows up here; with MESHTRAIN_CUDA_SYNC=1
 * also a fault inside the kernel. */
#define LAUNCH_CHECK(kernel) launch_check(#kernel "<<<>>>", __FILE__, __LINE__)
static void launch_check(const char *what, const char *file, int line) {
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess && g.sync_each) e = cudaStreamSynchronize(g.stream);
    if (e != cudaSuccess) cuda_fail(what, cudaGetErrorString(e), file, line);
}

#define SCRATCH_RETIRED 8
static void *g_scratch_retired[SCRATCH_RETIRED]; /* the scratch ops outgrew while a graph was recorded */
static int g_n_retired;
static void *scratch(size_t bytes) {
    if (bytes > g.scratch_bytes) {
        cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
        CUDA_CHECK(cudaStreamIsCapturing(g.main, &cs));
        if (g.scratch && cs != cudaStreamCaptureStatusNone && g_n_retired < SCRATCH_RETIRED) {
            /* recording (op_graph_*): a free would wait for the device, which a recording may
             * not; the old buffer goes after it (cuda_graph_end), and the recording, stale, is
             * dropped */
            g_scratch_retired[g_n_retired++] = g.scratch;
        } else if (g.scratch) {
            cuda_free(g.scratch); /* waits: earlier kernels may still use it */
        }
        g.scratch = NULL;
        g.scratch_bytes = 0;
        g.scratch = cuda_malloc(bytes);
        g.scratch_bytes = bytes;
        g.graph_epoch++;  /* graphs recorded with the old scratch are stale */
    }
    return g.scratch;
}

/* elementwise kernels: 256 threads, grid-stride loops, at most 2^20 blocks */
#define EW_BLOCK 256
/* 16-byte vector paths need every pointer 16-byte aligned (op_alloc gives 64; slices of
 * flat buffers may not be, and then the pair or scalar kernels run). */
static int al16(const void *p) { return ((uintptr_t)p & 15u) == 0; }
static unsigned ew_grid(size_t n) {
    size_t b = (n + EW_BLOCK - 1) / EW_BLOCK;
    return (unsigned)(b < (1u << 20) ? b : (1u << 20));
}
#define GRID_STRIDE(i, n)                                                                  \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);              \
         i += (size_t)gridDim.x * blockDim.x)

#include "cuda/common.cuh"

/* ------------------------------------------------------------------------------------ */
/* backend state                                                                         */

extern "C" {
static void copy_free(void);

int cuda_init(int device, char *err, size_t errlen) {
    char dummy[1];
    if (!err || !errlen) err = dummy, errlen = sizeof dummy;
    int n = 0, driver = 0;
    /* Without a driver, the runtime's error says "driver version is insufficient". */
    if (cudaDriverGetVersion(&driver) != cudaSuccess || driver == 0) {
        snprintf(err, errlen, "cuda: no usable GPU (no NVIDIA driver found)");
        return -1;
    }
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        snprintf(err, errlen, "cuda: no usable GPU (%s)",
                 e != cudaSuccess ? cudaGetErrorString(e) : "no device is visible");
        return -1;
    }
    if (device < 0 || device >= n) {
        snprintf(err, errlen, "cuda: device %d does not exist (%d visible)", device, n);
        return -1;
    }
    if (lt_load(err, errlen)) return -1;
    if (g.ready) cuda_shutdown();
    e = cudaSetDevice(device);
    if (e != cudaSuccess) {
        snprintf(err, errlen, "cuda: cannot use device %d: %s", device, cudaGetErrorString(e));
        return -1;
    }
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    snprintf(g.name, sizeof g.name, "%s", prop.name);
    int optin = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    g.smem_optin = (size_t)optin;
    g.device = device;
    g.sync_each = hook_on(HOOK_CUDA_SYNC);
    CUDA_CHECK(cudaStreamCreateWithFlags(&g.stream, cudaStreamNonBlocking));
    g.main = g.stream;
    CUBLAS_CHECK(lt.cublasLtCreate(&g.lt));
    g.workspace = cuda_malloc(WORKSPACE_BYTES);
    g.ready = 1;
    return 0;
}

static void stage_free(void);
static void lt_cache_free(void);

void cuda_shutdown(void) {
    if (!g.ready) return;
    cuda_synchronize();
    if (g.side) {
        CUDA_CHECK(cudaStreamDestroy(g.side));
        CUDA_CHECK(cudaEventDestroy(g.side_in));
        for (int k = 0; k < OPS_SIDE_MARKS; k++) CUDA_CHECK(cudaEventDestroy(g.side_ev[k]));
    }
    if (g_moe.made) {
        CUDA_CHECK(cudaEventDestroy(g_moe.fork));
        for (int i = 1; i < MOE_STREAMS; i++) {
            CUDA_CHECK(cudaStreamDestroy(g_moe.s[i]));
            CUDA_CHECK(cudaEventDestroy(g_moe.join[i]));
            cuda_free(g_moe.ws[i]);
        }
        memset(&g_moe, 0, sizeof g_moe);
    }
    attn_cudnn_shutdown();
    copy_free();
    stage_free();
    cuda_free(g.scratch);
    cuda_free(g.workspace);
    CUBLAS_CHECK(lt.cublasLtDestroy(g.lt));
    CUDA_CHECK(cudaStreamDestroy(g.stream));
    memset(&g, 0, sizeof g);
    lt_cache_free(); /* algorithms belong to the handle and the card */
}

const char *cuda_device_name(void) { return g.name; }
void *cuda_stream(void) { return (void *)g.stream; }

void cuda_event_times_ms(void (*fn)(const void *), const void *arg, int n, size_t flush, float *ms) {
    void *buf = NULL;
    if (flush) CUDA_CHECK(cudaMalloc(&buf, flush));
    cudaEvent_t *ev = (cudaEvent_t *)malloc(2 * (size_t)n * sizeof *ev);
    if (!ev) die(2, "out of host memory");
    for (int i = 0; i < 2 * n; i++) CUDA_CHECK(cudaEventCreate(&ev[i]));
    for (int i = 0; i < n; i++) {
        if (buf) CUDA_CHECK(cudaMemsetAsync(buf, 0, flush, g.stream));
        CUDA_CHECK(cudaEventRecord(ev[2 * i], g.stream));
        fn(arg);
        CUDA_CHECK(cudaEventRecord(ev[2 * i + 1], g.stream));
    }
    CUDA_CHECK(cudaEventSynchronize(ev[2 * n - 1]));
    for (int i = 0; i < n; i++) CUDA_CHECK(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
    for (int i = 0; i < 2 * n; i++) CUDA_CHECK(cudaEventDestroy(ev[i]));
    free(ev);
    if (buf) CUDA_CHECK(cudaFree(buf));
}
void cuda_set_tf32(int on) { g.tf32 = on != 0; }

#include "cuda/memory.cuh"

void cuda_synchronize(void) {
    CUDA_CHECK(cudaStreamSynchronize(g.main));
    for (int d = 0; d < 2 && g_copy.q[0]; d++) CUDA_CHECK(cudaStreamSynchronize(g_copy.q[d]));
    if (g.side_used) CUDA_CHECK(cudaStreamSynchronize(g.side));
    g.side_used = 0;
}
void cuda_synchronize_main(void) { CUDA_CHECK(cudaStreamSynchronize(g.main)); }

#include "cuda/queues.cuh"

} /* extern "C" */

#include "cuda/embedding.cuh"

#include "cuda/rmsnorm.cuh"

#include "cuda/rope.cuh"

#include "cuda/attention.cuh"

#include "cuda/swiglu.cuh"

#include "cuda/crossentropy.cuh"

#include "cuda/adamw.cuh"

#include "cuda/adafactor.cuh"

#include "cuda/flat.cuh"

#include "cuda/matmul_lt.cuh"

#include "cuda/matmul_tune.cuh"

/* ------------------------------------------------------------------------------------ */
/* the ops (C entry points)                                                              */

extern "C" {

/* bytes of one activation element, and the address of element i of an activation array */
static size_t act_size(void) { return g.bf16 ? 2 : 4; }

static size_t state_size(void) { return g.sbf16 ? 2 : 4; }

void cuda_set_precision(OpsPrecision p) {
    g.bf16 = p != OPS_FP32;
    g.sbf16 = p == OPS_BF16;
}

void cuda_to_act(void *dst, const float *src, size_t n) {
    if (n == 0) return;
    if (!g.bf16) {
        cuda_memcpy_d2d(dst, src, n * sizeof(float));
        return;
    }
    to_act_kernel<<<ew_grid(n), EW_BLOCK, 0, g.stream>>>(dst, src, n, 1);
    LAUNCH_CHECK(to_act_kernel);
}

void cuda_embedding_forward(void *out, const int *tokens, const void *wte, int N, int C) {
    if (N <= 0 || C <= 0) return;
    embedding_forward_kernel<<<ew_grid((size_t)N * C), EW_BLOCK, 0, g.stream>>>(out, tokens, wte, N, C, g.bf16);
    LAUNCH_CHECK(embedding_forward_kernel);
}

void cuda_embedding_forward_shard(void *out, const int *tokens, const void *wte, int N, int C, int lo, int rows) {
    if (N <= 0 || C <= 0) return;
    embedding_forward_shard_kernel<<<ew_grid((size_t)N * C), EW_BLOCK, 0, g.stream>>>(out, tokens, wte, N, C, lo, rows,
                                                                                        g.bf16);
    LAUNCH_CHECK(embedding_forward_shard_kernel);
}

void cuda_embedding_backward_rows(void *dwte, const void *dout, const int *idx, int nr, int N, int C) {
    (void)N;
    if (!dwte || nr <= 0 || C <= 0) return;
    dim3 grid((unsigned)nr, (C + EMBR_BLOCK - 1) / EMBR_BLOCK);
    embedding_backward_rows_kernel<<<grid, EMBR_BLOCK, 0, g.stream>>>(dwte, dout, idx, nr, C, g.bf16, g.sbf16);
    LAUNCH_CHECK(embedding_backward_rows_kernel);
}

void cuda_embedding_backward(void *dwte, const void *dout, const int *tokens, int N, int C) {
    if (!dwte || N <= 0 || C <= 0) return;
    dim3 grid((C + EMB_BLOCK - 1) / EMB_BLOCK, EMB_BUCKETS);
    embedding_backward_kernel<<<grid, EMB_BLOCK, 0, g.stream>>>(dwte, dout, tokens, N, C, g.bf16, g.sbf16);
    LAUNCH_CHECK(embedding_backward_kernel);
}

/* The wide-row kernels' block (forward and backward alike): warps enough for VEC vectors of 8
 * channels a thread, VEC 2 up to RMS_WIDE_NARROW_C channels and 4 beyond */
static int rmsnorm_wide_threads(int C) {
    int vec = C <= RMS_WIDE_NARROW_C ? 2 : 4;
    return ((C / 8 + vec - 1) / vec + 31) / 32 * 32;
}

static void rmsnorm_forward(void *out, float *rstd, void *x, const void *branch, const void *w, int N, int C,
                            float eps) {
    if (N <= 0 || C <= 0) return;
    unsigned blocks = (N + ROW_WARPS - 1) / ROW_WARPS;
    int aligned = al16(out) && al16(x) && al16(w) && (!branch || al16(branch));
    if (cuda_rmsnorm_wide(C) && aligned) {  /* one row a block: its threads as the wide backward's */
        int narrow = C <= RMS_WIDE_NARROW_C, threads = rmsnorm_wide_threads(C);
        if (narrow)
            rmsnorm_wide_forward_kernel<2, 512><<<N, threads, 0, g.stream>>>(out, rstd, x, branch, w, C, eps, g.bf16);
        else rmsnorm_wide_forward_kernel<4, 1024><<<N, threads, 0, g.stream>>>(out, rstd, x, branch, w, C, eps, g.bf16);
        LAUNCH_CHECK(rmsnorm_wide_forward_kernel);
        return;
    }
    if (C % 8 == 0 && aligned) {
        rmsnorm8_forward_kernel<<<blocks, ROW_WARPS * 32, 0, g.stream>>>(out, rstd, x, branch, w, N, C, eps, g.bf16);
        LAUNCH_CHECK(rmsnorm8_forward_kernel);
        return;
    }
    rmsnorm_forward_kernel<<<blocks, ROW_WARPS * 32, 0, g.stream>>>(out, rstd, x, branch, w, N, C, eps, g.bf16);
    LAUNCH_CHECK(rmsnorm_forward_kernel);
}

void cuda_rmsnorm_forward(void *out, float *rstd, const void *x, const void *w, int N, int C, float eps) {
    rmsnorm_forward(out, rstd, (void *)x, NULL, w, N, C, eps);  /* x is only read without a branch */
}

void cuda_add_rmsnorm_forward(void *res, void *out, float *rstd, const void *branch, const void *w, int N, int C,
                              float eps) {
    rmsnorm_forward(out, rstd, res, branch, w, N, C, eps);
}

void cuda_rmsnorm_backward(void *dx, void *dw, const void *dout, const void *x, const void *w,
                           const float *rstd, int N, int C) {
    if ((!dx && !dw) || N <= 0 || C <= 0) return;
    /* the blocks and their dw partials as ops_cuda.h says (the estimate counts the same) */
    static_assert(256 * RMS_VEC == 1024 && 8192 * RMS_VEC == 32768, "cuda_rmsnorm_wide's bounds");
    const int wide = cuda_rmsnorm_wide(C) && al16(dx) && al16(dout) && al16(x) && al16(w);
    int nb = cuda_rmsnorm_blocks((size_t)N, wide);
    float *part = (float *)scratch((size_t)nb * C * sizeof(float));
    if (wide) {
        /* wide rows: a block's threads share each row, warps enough for VEC vectors a thread;
         * blocks of about 8 rows, for enough blocks on every SM */
        int narrow = C <= RMS_WIDE_NARROW_C, threads = rmsnorm_wide_threads(C);
        float *pt = dw ? part : NULL;
        if (narrow && g.bf16)
            rmsnorm_wide_backward_bf16_kernel<2, 512><<<nb, threads, 0, g.stream>>>(dx, pt, dout, x, w, rstd, N, C, nb);
        else if (narrow)
            rmsnorm_wide_backward_f32_kernel<2, 512><<<nb, threads, 0, g.stream>>>(dx, pt, dout, x, w, rstd, N, C, nb);
        else if (g.bf16)
            rmsnorm_wide_backward_bf16_kernel<4, 1024><<<nb, threads, 0, g.stream>>>(dx, pt, dout, x, w, rstd, N, C, nb);
        else
            rmsnorm_wide_backward_f32_kernel<4, 1024><<<nb, threads, 0, g.stream>>>(dx, pt, dout, x, w, rstd, N, C, nb);
        LAUNCH_CHECK(rmsnorm_wide_backward_kernel);
        if (dw) {
            rmsnorm_dw_reduce_kernel<<<(C + 31) / 32, 1024, 0, g.stream>>>(dw, part, C, nb, g.sbf16);
            LAUNCH_CHECK(rmsnorm_dw_reduce_kernel);
        }
        return;
    }
    size_t smem = (size_t)RMS_BWD_WARPS * C * sizeof(float);
    if (smem > g.smem_optin)
        die(2, "cuda: rmsnorm backward with %d channels needs %zu bytes of shared memory; the GPU allows %zu", C, smem,
            g.smem_optin);
    if (smem > 48 * 1024 && smem > g.rms_smem_set) { /* C > 3072: only the scalar kernel runs */
        CUDA_CHECK(cudaFuncSetAttribute((const void *)rmsnorm_backward_kernel,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        g.rms_smem_set = smem;
    }
    if (C % 8 == 0 && C <= 256 * RMS_VEC && al16(dx) && al16(dout) && al16(x) && al16(w)) { /* dx may be NULL */
        if (g.bf16)
            rmsnorm8_backward_bf16_kernel<<<nb, RMS_BWD_WARPS * 32, smem, g.stream>>>(dx, part, dout, x, w, rstd, N, C,
                                                                                      nb);
        else
            rmsnorm8_backward_f32_kernel<<<nb, RMS_BWD_WARPS * 32, smem, g.stream>>>(dx, part, dout, x, w, rstd, N, C,
                                                                                     nb);
        LAUNCH_CHECK(rmsnorm8_backward_kernel);
    } else {
        rmsnorm_backward_kernel<<<nb, RMS_BWD_WARPS * 32, smem, g.stream>>>(dx, part, dout, x, w, rstd, N, C, nb,
                                                                            g.bf16);
        LAUNCH_CHECK(rmsnorm_backward_kernel);
    }
    if (dw) {
        rmsnorm_dw_reduce_kernel<<<(C + 31) / 32, 1024, 0, g.stream>>>(dw, part, C, nb, g.sbf16);
        LAUNCH_CHECK(rmsnorm_dw_reduce_kernel);
    }
}

/* out[N, OC] = inp[N, C] @ w[OC, C]^T  <=>  (column-major) out^T[OC, N] = w^T' @ inp^T
 * where w read column-major is [C, OC] (ld C), used transposed; inp read column-major is
 * inp^T [C, N] (ld C); out read column-major is out^T [OC, N] (ld OC). */
/* An output dimension that is not a multiple of 64 (the vocabulary, 50257) makes cuBLASLt
 * fall back to slow kernels (5x slower for the lm_head). Such a dimension is split: the
 * largest multiple of 64, then the few rows left, as a second small product. */
static int oc_main(int OC) { return OC >= 128 && OC % 64 ? OC / 64 * 64 : OC; }
static const void *act_off(const void *p, size_t i) { return (const char *)p + i * act_size(); }

void cuda_matmul_forward(void *out, int ldo, const void *inp, const void *w, int N, int C, int OC) {
    if (N <= 0 || OC <= 0) return;
    if (C <= 0) {
        CUDA_CHECK(cudaMemset2DAsync(out, (size_t)ldo * act_size(), 0, (size_t)OC * act_size(), N, g.stream));
        return;
    }
    int OCa = oc_main(OC);
    lt_matmul(CUBLAS_OP_T, CUBLAS_OP_N, OCa, N, C, w, C, inp, C, 0.0f, out, ldo, 0);
    if (OCa < OC)
        lt_matmul(CUBLAS_OP_T, CUBLAS_OP_N, OC - OCa, N, C, act_off(w, (size_t)OCa * C), C, inp, C, 0.0f,
                  (void *)act_off(out, OCa), ldo, 0);
}

/* out = inp @ w^T + res: the same product with res as the epilogue's C (one rounding of
 * the sum in bf16, where a separate add rounds the product first). */
void cuda_matmul_forward_add(void *out, const void *inp, const void *w, const void *res, int N, int C, int OC) {
    if (N <= 0 || OC <= 0) return;
    if (C <= 0) {
        cuda_memcpy_d2d(out, res, (size_t)N * OC * act_size());
        return;
    }
    int OCa = oc_main(OC);
    lt_matmul_c(CUBLAS_OP_T, CUBLAS_OP_N, OCa, N, C, w, C, inp, C, 1.0f, res, out, OC, 0);
    if (OCa < OC)
        lt_matmul_c(CUBLAS_OP_T, CUBLAS_OP_N, OC - OCa, N, C, act_off(w, (size_t)OCa * C), C, inp, C, 1.0f,
                    act_off(res, OCa), (void *)act_off(out, OCa), OC, 0);
}

/* dinp[N, C] += dout[N, OC] @ w[OC, C]  <=>  dinp^T[C, N] += w_cm[C, OC] @ dout^T[OC, N]
 *   (w column-major is [C, OC] ld C, dout column-major is [OC, N] ld OC: no transposes);
 * dw[OC, C] += dout^T @ inp  <=>  dw^T[C, OC] += inp^T[C, N] @ (dout^T[OC, N])^T
 *   (inp column-major is [C, N] ld C; dout column-major [OC, N] ld OC, transposed).
 * dw is the state type: bf16 products accumulate into fp32 gradients unless precision=bf16. */
void cuda_matmul_backward(void *dinp, void *dw, const void *dout, int ldo, const void *inp, const void *w,
                          int N, int C, int OC, int acc) {
    if (N <= 0 || C <= 0 || OC <= 0) return;
    int OCa = oc_main(OC), OCt = OC - OCa; /* see cuda_matmul_forward */
    const void *w_t = dinp ? act_off(w, (size_t)OCa * C) : NULL, *dout_t = act_off(dout, OCa);
    if (dinp) {
        lt_matmul(CUBLAS_OP_N, CUBLAS_OP_N, C, N, OCa, w, C, dout, ldo, acc ? 1.0f : 0.0f, dinp, C, 0);
        if (OCt) lt_matmul(CUBLAS_OP_N, CUBLAS_OP_N, C, N, OCt, w_t, C, dout_t, ldo, 1.0f, dinp, C, 0);
    }
    if (dw) {
        lt_matmul(CUBLAS_OP_N, CUBLAS_OP_T, C, OCa, N, inp, C, dout, ldo, 1.0f, dw, C, 1);
        if (OCt)
            lt_matmul(CUBLAS_OP_N, CUBLAS_OP_T, C, OCt, N, inp, C, dout_t, ldo, 1.0f,
                      (char *)dw + (size_t)OCa * C * state_size(), C, 1);
    }
}

/* dinp = dout @ w + res: cuda_matmul_backward's input gradient with res as the epilogue's C */
void cuda_matmul_backward_add(void *dinp, const void *dout, const void *w, const void *res, int N, int C, int OC) {
    if (N <= 0 || C <= 0) return;
    if (OC <= 0) {
        cuda_memcpy_d2d(dinp, res, (size_t)N * C * act_size());
        return;
    }
    int OCa = oc_main(OC), OCt = OC - OCa;
    lt_matmul_c(CUBLAS_OP_N, CUBLAS_OP_N, C, N, OCa, w, C, dout, OC, 1.0f, res, dinp, C, 0);
    if (OCt)
        lt_matmul(CUBLAS_OP_N, CUBLAS_OP_N, C, N, OCt, act_off(w, (size_t)OCa * C), C, act_off(dout, OCa), OC, 1.0f,
                  dinp, C, 0);
}

void cuda_rope_tables(float *cos_t, float *sin_t, int T, int HD, float base) {
    int half = HD / 2;
    if (T <= 0 || half <= 0) return;
    size_t n = (size_t)T * half;
    float *hc = (float *)malloc(n * sizeof(float)), *hs = (float *)malloc(n * sizeof(float));
    if (!hc || !hs) die(2, "cannot allocate %zu bytes: out of memory", 2 * n * sizeof(float));
    /* op_rope_tables, operation for operation (same libm, so the same bits) */
    for (int i = 0; i < half; i++) {
        float inv = 1.0f / powf(base, (float)(2 * i) / (float)HD);
        for (int t = 0; t < T; t++) {
            float f = (float)t * inv;
            hc[(size_t)t * half + i] = cosf(f);
            hs[(size_t)t * half + i] = sinf(f);
        }
    }
    cuda_memcpy_h2d(cos_t, hc, n * sizeof(float));
    cuda_memcpy_h2d(sin_t, hs, n * sizeof(float));
    free(hc);
    free(hs);
}

void cuda_rope_forward(void *qkv, const float *cos_t, const float *sin_t, int B, int T, int NH, int HD) {
    size_t total = (size_t)B * T * 2 * NH * (HD / 2);
    if (B <= 0 || T <= 0 || NH <= 0 || HD < 2) return;
    if (HD % 8 == 0 && al16(qkv) && al16(cos_t) && al16(sin_t)) {
        rope8_kernel<<<ew_grid(total / 4), EW_BLOCK, 0, g.stream>>>(qkv, cos_t, sin_t, T, NH, HD, total / 4, 1.0f, g.bf16);
        LAUNCH_CHECK(rope8_kernel);
        return;
    }
    rope_kernel<<<ew_grid(total), EW_BLOCK, 0, g.stream>>>(qkv, cos_t, sin_t, B, T, NH, HD, 1.0f, g.bf16);
    LAUNCH_CHECK(rope_kernel);
}

void cuda_rope_backward(void *dqkv, const float *cos_t, const float *sin_t, int B, int T, int NH, int HD) {
    size_t total = (size_t)B * T * 2 * NH * (HD / 2);
    if (!dqkv || B <= 0 || T <= 0 || NH <= 0 || HD < 2) return;
    if (HD % 8 == 0 && al16(dqkv) && al16(cos_t) && al16(sin_t)) {
        rope8_kernel<<<ew_grid(total / 4), EW_BLOCK, 0, g.stream>>>(dqkv, cos_t, sin_t, T, NH, HD, total / 4, -1.0f, g.bf16);
        LAUNCH_CHECK(rope8_kernel);
        return;
    }
    rope_kernel<<<ew_grid(total), EW_BLOCK, 0, g.stream>>>(dqkv, cos_t, sin_t, B, T, NH, HD, -1.0f, g.bf16);
    LAUNCH_CHECK(rope_kernel);
}

/* Attention in bf16 runs on one of two tensor-core implementations: cuDNN's fused flash attention
 * (attn_cudnn.cu, when libcudnn loads and has an engine for the shape) or our own kernels
 * (attn_bf16.cu, head_dim 64 and 128; the backward also on Hopper, attn_wgmma_bwd.cu); other head
 * dims without cuDNN, and fp32, take the generic kernels (attention.cuh). The options
 * (ops_set_options) pick: OPS_ATTN_OWN = never cuDNN (nor the Hopper backward); OPS_ATTN_CUDNN =
 * cuDNN wherever it runs; OPS_ATTN_AUTO = the faster by shape, as measured on an H100
 * (attn_cudnn_auto in attn_cudnn.h; bench/attn_hopper.sh, bench/results/attention-h100-2026-11.md), its backward our
 * Hopper kernel where that was faster (attn_wgmma_bwd_auto). Deterministic (the default), every
 * choice is bitwise reproducible: cuDNN's backward is its deterministic engine and the Hopper
 * kernel adds dQ in a fixed order. Not deterministic: the Hopper kernel sums dQ with atomics
 * (faster: +7% at T = 4096, +20% at 10000 on an H100) and auto takes it at head_dim 256 too
 * (where, deterministic, it trails cuDNN's engine); under cudnn, cuDNN's backward is its fastest
 * engine, which sums dq with atomics. Under auto, cuDNN's engine stays the deterministic one, which
 * leads cuDNN's atomic one where auto takes cuDNN. */
static void cuda_set_options(const OpsOptions *o) {
    g.att = o->attention;
    g.nondet = !o->deterministic;
}

/* cuDNN's backward engine: the deterministic one unless cudnn is asked for without determinism */
static int att_det(void) { return g.att != OPS_ATTN_CUDNN || !g.nondet; }

void cuda_set_attention_det_max(size_t bytes) { g.att_det_max = bytes; }
int cuda_set_sync_each(int on) {
    int was = g.sync_each;
    g.sync_each = on;
    return was;
}

/* Our Hopper backward (attn_wgmma_bwd.cu) runs where auto picks it by shape, by whether RoPE's
 * backward is fused in and by determinism (attn_wgmma_bwd_auto), on a device that takes it. */
static int att_wgmma_bwd(int T, int HD, int rope) {
    return g.bf16 && g.att == OPS_ATTN_AUTO && attn_wgmma_bwd_auto(T, HD, !g.nondet, rope) &&
           attn_wgmma_bwd_supported(HD) && attn_wgmma_device_ok() && !attn_wgmma_bwd_unlaunchable(HD);
}

/* 1 when cuDNN runs this call, with the bytes of workspace it needs; 0: our kernels do. The first
 * time cuDNN is wanted and cannot run, one line on stderr says why (once per process). */
static int att_cudnn(int backward, int B, int T, int NH, int HD, size_t *ws) {
    static int said;
    if (!g.bf16 || g.att == OPS_ATTN_OWN) return 0;
    if (g.att == OPS_ATTN_AUTO && !attn_cudnn_auto(backward, B, T, NH, HD, attn_bf16_supported(HD))) return 0;
    char why[320];
    int r = backward ? attn_cudnn_backward_plan(B, T, NH, HD, att_det(), ws, why, sizeof why)
                     : attn_cudnn_forward_plan(B, T, NH, HD, ws, why, sizeof why);
    if (r == 0) return 1;
    if (!said) {
        said = 1;
        fprintf(stderr, "meshtrain: cuda: attention %s B=%d T=%d NH=%d HD=%d runs on our kernels, not cuDNN: %s\n",
                backward ? "backward" : "forward", B, T, NH, HD, why);
    }
    return 0;
}

const char *cuda_attention_impl(int backward, int B, int T, int NH, int HD) {
    size_t ws;
    if (backward && att_wgmma_bwd(T, HD, 0)) return "wgmma";
    if (att_cudnn(backward, B, T, NH, HD, &ws)) return "cudnn";
    return g.bf16 && attn_bf16_supported(HD) ? "own" : "generic";
}

void cuda_attention_forward(void *out, float *lse, const void *qkv, int B, int T, int NH, int HD) {
    if (B <= 0 || T <= 0 || NH <= 0 || HD <= 0) return;
    size_t ws = 0;
    if (al16(out) && al16(lse) && al16(qkv) && att_cudnn(0, B, T, NH, HD, &ws)) {
        if (attn_cudnn_forward(out, lse, qkv, B, T, NH, HD, scratch(ws), (void *)g.stream))
            die(1, "cuda: cuDNN attention forward B=%d T=%d NH=%d HD=%d failed to run", B, T, NH, HD);
        if (g.sync_each) CUDA_CHECK(cudaStreamSynchronize(g.stream));
        return;
    }
    if (g.bf16 && attn_bf16_supported(HD)) {
        attn_bf16_forward(out, lse, qkv, B, T, NH, HD, (void *)g.stream);
        if (g.sync_each) CUDA_CHECK(cudaStreamSynchronize(g.stream));
        return;
    }
    att_check_shape(B, NH, HD);
    size_t smem = att_forward_smem(HD);
    att_smem((const void *)attention_forward_kernel, smem, &g.att_smem_set[0], "forward", HD);
    dim3 grid((T + ATT_TILE - 1) / ATT_TILE, NH, B);
    float scale = 1.0f / sqrtf((float)HD);
    attention_forward_kernel<<<grid, ATT_WARPS * 32, smem, g.stream>>>(out, lse, qkv, T, NH, HD, scale, g.bf16);
    LAUNCH_CHECK(attention_forward_kernel);
}

/* att_wgmma_bwd's backward: 1 when it ran. cos_t, sin_t: NULL, or RoPE's tables (16-byte aligned,
 * acc = 0), rotated back in the kernel (attn_wgmma_bwd.h) */
static int att_backward_wgmma(void *dqkv, const void *dout, const void *qkv, const void *out, const float *lse,
                              int B, int T, int NH, int HD, int acc, const float *cos_t, const float *sin_t) {
    if (!att_wgmma_bwd(T, HD, cos_t != NULL) || !(al16(dqkv) && al16(dout) && al16(qkv) && al16(out) && al16(lse)))
        return 0;
    void *ws = scratch(attn_wgmma_bwd_workspace_bytes(B, T, NH, HD));
    attn_wgmma_backward(dqkv, dout, qkv, out, lse, ws, B, T, NH, HD, acc, !g.nondet, cos_t, sin_t,
                        (void *)g.stream);
    if (g.sync_each) CUDA_CHECK(cudaStreamSynchronize(g.stream));
    return 1;
}

/* cuDNN's backward writes dq, dk, dv: with acc, into scratch after its workspace, then added. The
 * deterministic engine keeps B NH T^2 of dP: at long contexts it runs over the batch in pieces
 * (attn_cudnn_det_batch), each row's q, k, v, out and lse being contiguous. */
static int att_backward_cudnn(void *dqkv, const void *dout, const void *qkv, const void *out, const float *lse,
                              int B, int T, int NH, int HD, int acc) {
    int Bc = att_det() ? attn_cudnn_det_batch(B, T, NH, g.att_det_max ? g.att_det_max : ATTN_CUDNN_DET_MAX_BYTES) : B, rem;
    if (Bc < 1) Bc = B;  /* cudnn asked for: let cuDNN take or refuse the whole batch */
    rem = B % Bc;
    size_t ws = 0, ws2 = 0, row3 = (size_t)T * 3 * NH * HD, row = (size_t)T * NH * HD, lrow = (size_t)NH * T;
    if (!(al16(dqkv) && al16(dout) && al16(qkv) && al16(out) && al16(lse) && (Bc == B || lrow * Bc % 4 == 0) &&
          att_cudnn(1, Bc, T, NH, HD, &ws) && (!rem || att_cudnn(1, rem, T, NH, HD, &ws2))))
        return 0;
    ws = ((ws > ws2 ? ws : ws2) + 255) & ~(size_t)255;
    char *w = (char *)scratch(ws + (acc ? (size_t)Bc * row3 * 2 : 0));
    for (int b0 = 0; b0 < B; b0 += Bc) {
        int nb = B - b0 < Bc ? B - b0 : Bc;
        char *dq = (char *)dqkv + (size_t)b0 * row3 * 2;
        void *dst = acc ? (void *)(w + ws) : (void *)dq;
        if (attn_cudnn_backward(dst, (const char *)dout + (size_t)b0 * row * 2, (const char *)qkv + (size_t)b0 * row3 * 2,
                                (const char *)out + (size_t)b0 * row * 2, lse + (size_t)b0 * lrow, nb, T, NH, HD,
                                att_det(), w, (void *)g.stream))
            die(1, "cuda: cuDNN attention backward B=%d T=%d NH=%d HD=%d failed to run", nb, T, NH, HD);
        if (g.sync_each) CUDA_CHECK(cudaStreamSynchronize(g.stream));
        if (acc) cuda_add(dq, dst, (size_t)nb * row3);
    }
    return 1;
}

void cuda_attention_backward(void *dqkv, const void *dout, const void *qkv, const void *out,
                             const float *lse, int B, int T, int NH, int HD, int acc) {
    if (!dqkv || B <= 0 || T <= 0 || NH <= 0 || HD <= 0) return;
    if (att_backward_wgmma(dqkv, dout, qkv, out, lse, B, T, NH, HD, acc, NULL, NULL)) return;
    if (att_backward_cudnn(dqkv, dout, qkv, out, lse, B, T, NH, HD, acc)) return;
    if (g.bf16 && attn_bf16_supported(HD)) {
        void *ws = scratch(attn_bf16_workspace_bytes(B, T, NH, HD));
        attn_bf16_backward(dqkv, dout, qkv, out, lse, ws, B, T, NH, HD, acc, NULL, NULL, (void *)g.stream);
        if (g.sync_each) CUDA_CHECK(cudaStreamSynchronize(g.stream));
        return;
    }
    att_check_shape(B, NH, HD);
    /* the fp32 kernels only accumulate: writing is zeroing first */
    if (!acc) CUDA_CHECK(cudaMemsetAsync(dqkv, 0, (size_t)B * T * 3 * NH * HD * act_size(), g.stream));
    size_t smem_dq = att_dq_smem(HD), smem_dkdv = att_dkdv_smem(HD);
    att_smem((const void *)attention_backward_dq_kernel, smem_dq, &g.att_smem_set[1], "backward", HD);
    att_smem((const void *)attention_backward_dkdv_kernel, smem_dkdv, &g.att_smem_set[2], "backward", HD);
    float scale = 1.0f / sqrtf((float)HD);
    size_t rows = (size_t)B * T * NH;
    float *D = (float *)scratch(rows * sizeof(float));
    attention_backward_D_kernel<<<(unsigned)((rows + ROW_WARPS - 1) / ROW_WARPS), ROW_WARPS * 32, 0, g.stream>>>(
        D, dout, out, B, T, NH, HD, g.bf16);
    LAUNCH_CHECK(attention_backward_D_kernel);
    dim3 grid((T + ATT_TILE - 1) / ATT_TILE, NH, B);
    attention_backward_dq_kernel<<<grid, ATT_WARPS * 32, smem_dq, g.stream>>>(dqkv, dout, qkv, lse, D, T, NH, HD,
                                                                             scale, g.bf16);
    LAUNCH_CHECK(attention_backward_dq_kernel);
    attention_backward_dkdv_kernel<<<grid, ATT_WARPS * 32, smem_dkdv, g.stream>>>(dqkv, dout, qkv, lse, D, T, NH,
                                                                                 HD, scale, g.bf16);
    LAUNCH_CHECK(attention_backward_dkdv_kernel);
}

/* Our tensor-core kernels (mma.sync and Hopper's) rotate dq and dk back as they store them, where
 * the tables are 16-byte aligned; elsewhere (cuDNN too), two passes. */
void cuda_attention_rope_backward(void *dqkv, const void *dout, const void *qkv, const void *out, const float *lse,
                                  const float *cos_t, const float *sin_t, int B, int T, int NH, int HD) {
    if (!dqkv || B <= 0 || T <= 0 || NH <= 0 || HD <= 0) return;
    const int fuse = al16(cos_t) && al16(sin_t);
    if (att_backward_wgmma(dqkv, dout, qkv, out, lse, B, T, NH, HD, 0, fuse ? cos_t : NULL, fuse ? sin_t : NULL)) {
        if (!fuse) cuda_rope_backward(dqkv, cos_t, sin_t, B, T, NH, HD);
        return;
    }
    if (att_backward_cudnn(dqkv, dout, qkv, out, lse, B, T, NH, HD, 0)) {
        cuda_rope_backward(dqkv, cos_t, sin_t, B, T, NH, HD);
        return;
    }
    if (g.bf16 && attn_bf16_supported(HD) && al16(cos_t) && al16(sin_t)) {
        void *ws = scratch(attn_bf16_workspace_bytes(B, T, NH, HD));
        attn_bf16_backward(dqkv, dout, qkv, out, lse, ws, B, T, NH, HD, 0, cos_t, sin_t, (void *)g.stream);
        if (g.sync_each) CUDA_CHECK(cudaStreamSynchronize(g.stream));
        return;
    }
    cuda_attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, HD, 0);
    cuda_rope_backward(dqkv, cos_t, sin_t, B, T, NH, HD);
}

void cuda_swiglu_forward(void *out, const void *gu, int N, int H) {
    if (N <= 0 || H <= 0) return;
    if (H % 8 == 0 && al16(out) && al16(gu)) {
        size_t nv = (size_t)N * H / 8;
        swiglu8_forward_kernel<<<ew_grid(nv), EW_BLOCK, 0, g.stream>>>(out, gu, H, nv, g.bf16);
        LAUNCH_CHECK(swiglu8_forward_kernel);
        return;
    }
    if (!(H & 1)) {
        swiglu2_forward_kernel<<<ew_grid((size_t)N * H / 2), EW_BLOCK, 0, g.stream>>>(out, gu, N, H, g.bf16);
        LAUNCH_CHECK(swiglu2_forward_kernel);
        return;
    }
    swiglu_forward_kernel<<<ew_grid((size_t)N * H), EW_BLOCK, 0, g.stream>>>(out, gu, N, H, g.bf16);
    LAUNCH_CHECK(swiglu_forward_kernel);
}

void cuda_swiglu_backward(void *dgu, const void *dout, const void *gu, int N, int H, int acc) {
    if (!dgu || N <= 0 || H <= 0) return;
    if (H % 8 == 0 && al16(dgu) && al16(dout) && al16(gu)) {
        size_t nv = (size_t)N * H / 8;
        swiglu8_backward_kernel<<<ew_grid(nv), EW_BLOCK, 0, g.stream>>>(dgu, dout, gu, H, nv, g.bf16, acc);
        LAUNCH_CHECK(swiglu8_backward_kernel);
        return;
    }
    if (!(H & 1)) {
        swiglu2_backward_kernel<<<ew_grid((size_t)N * H / 2), EW_BLOCK, 0, g.stream>>>(dgu, dout, gu, N, H, g.bf16,
                                                                                         acc);
        LAUNCH_CHECK(swiglu2_backward_kernel);
        return;
    }
    swiglu_backward_kernel<<<ew_grid((size_t)N * H), EW_BLOCK, 0, g.stream>>>(dgu, dout, gu, N, H, g.bf16, acc);
    LAUNCH_CHECK(swiglu_backward_kernel);
}

void cuda_crossentropy_forward_backward(float *losses, void *logits, int ld, const int *targets, int N, int V,
                                        float dlogits_scale) {
    if (N <= 0 || V <= 0) return;
    size_t smem = (size_t)((V + 7) / 8) * 16;
    if (g.bf16 && ld % 8 == 0 && al16(logits) && smem <= g.smem_optin) {
        if (smem > 48 * 1024 && smem > g.ce_smem_set) {
            CUDA_CHECK(cudaFuncSetAttribute((const void *)crossentropy8_kernel,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
            g.ce_smem_set = smem;
        }
        crossentropy8_kernel<<<N, CE8_BLOCK, smem, g.stream>>>(losses, (bf16 *)logits, ld, targets, V, dlogits_scale);
        LAUNCH_CHECK(crossentropy8_kernel);
        return;
    }
    crossentropy_kernel<<<N, CE_BLOCK, 0, g.stream>>>(losses, logits, ld, targets, V, dlogits_scale, g.bf16);
    LAUNCH_CHECK(crossentropy_kernel);
}

void cuda_crossentropy_shard_stats(float *stats, const void *logits, int ld, const int *targets, int N, int V, int v0) {
    if (N <= 0 || V <= 0) return;
    if (g.bf16 && ld % 8 == 0 && ptr_alignment(logits) >= 16) {
        crossentropy8_shard_stats_kernel<<<N, CE8_BLOCK, 0, g.stream>>>(stats, (const bf16 *)logits, ld, targets, V, v0);
        LAUNCH_CHECK(crossentropy8_shard_stats_kernel);
        return;
    }
    crossentropy_shard_stats_kernel<<<N, CE_BLOCK, 0, g.stream>>>(stats, logits, ld, targets, V, v0, g.bf16);
    LAUNCH_CHECK(crossentropy_shard_stats_kernel);
}

void cuda_crossentropy_shard_backward(float *losses, void *logits, int ld, const int *targets, int N, int V, int v0,
                                      const float *stats, int t, float dlogits_scale) {
    if (N <= 0 || V <= 0) return;
    if (g.bf16 && ld % 8 == 0 && ptr_alignment(logits) >= 16) {
        crossentropy8_shard_kernel<<<N, CE8_BLOCK, 0, g.stream>>>(losses, (bf16 *)logits, ld, targets, V, v0, stats, N, t,
                                                                  dlogits_scale);
        LAUNCH_CHECK(crossentropy8_shard_kernel);
        return;
    }
    crossentropy_shard_kernel<<<N, CE_BLOCK, 0, g.stream>>>(losses, logits, ld, targets, V, v0, stats, N, t,
                                                            dlogits_scale, g.bf16);
    LAUNCH_CHECK(crossentropy_shard_kernel);
}

static void adamw_launch(void *param, const void *grad, void *m, void *v, size_t n, float lr, float beta1,
                         float beta2, float eps, float weight_decay, int step, float grad_scale, bf16 *act) {
    if (n == 0) return;
    /* the scalars exactly as op_adamw computes them */
    double bc1 = 1.0 - pow((double)beta1, step), bc2 = 1.0 - pow((double)beta2, step);
    float decay = weight_decay != 0.0f ? (float)(1.0 - (double)lr * (double)weight_decay) : 1.0f;
    float w1 = (float)(1.0 - (double)beta1), w1c = 1.0f - w1;
    int small = fabsf(w1) < 0.5f;
    float b2 = beta2, w2 = (float)(1.0 - (double)beta2);
    float neg_step = (float)(-((double)lr / bc1));
    float bc2_sqrt = (float)sqrt(bc2);
    AdamwArgs a = {decay, w1, w1c, b2, w2, neg_step, bc2_sqrt, eps, grad_scale, small};
    if (al16(param) && al16(grad) && al16(m) && al16(v) && (!act || al16(act))) {
        adamw8_kernel<<<ew_grid((n + 7) / 8), EW_BLOCK, 0, g.stream>>>(param, grad, m, v, n, a, g.sbf16, act);
        LAUNCH_CHECK(adamw8_kernel);
        return;
    }
    adamw_kernel<<<ew_grid(n), EW_BLOCK, 0, g.stream>>>(param, grad, m, v, n, a, g.sbf16, act);
    LAUNCH_CHECK(adamw_kernel);
}

void cuda_adamw(void *param, const void *grad, void *m, void *v, size_t n, float lr, float beta1,
                float beta2, float eps, float weight_decay, int step, float grad_scale) {
    adamw_launch(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, step, grad_scale, NULL);
}

/* precision=mixed: the bf16 copy written in the update's pass; in fp32 the copy is the
 * parameters themselves, as cuda_to_act makes it */
void cuda_adamw_cast(void *param, const void *grad, void *m, void *v, size_t n, float lr, float beta1,
                     float beta2, float eps, float weight_decay, int step, float grad_scale, void *act) {
    adamw_launch(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, step, grad_scale,
                 g.bf16 ? (bf16 *)act : NULL);
    if (!g.bf16) cuda_to_act(act, (const float *)param, n);
}

double cuda_sumsq(const void *x, size_t n) {
    if (n == 0) return 0.0;
    size_t per = (size_t)SUMSQ_BLOCK * 8; /* at least 8 elements per thread */
    size_t nb64 = (n + per - 1) / per;
    int nb = (int)(nb64 < SUMSQ_MAX_BLOCKS ? nb64 : SUMSQ_MAX_BLOCKS);
    double *part = (double *)scratch((size_t)(nb + 1) * sizeof(double));
    if (al16(x)) {
        sumsq8_partial_kernel<<<nb, SUMSQ_BLOCK, 0, g.stream>>>(part, x, n, g.sbf16);
        LAUNCH_CHECK(sumsq8_partial_kernel);
    } else {
        sumsq_partial_kernel<<<nb, SUMSQ_BLOCK, 0, g.stream>>>(part, x, n, g.sbf16);
        LAUNCH_CHECK(sumsq_partial_kernel);
    }
    sumsq_final_kernel<<<1, 1024, 0, g.stream>>>(part + nb, part, nb);
    LAUNCH_CHECK(sumsq_final_kernel);
    double s = 0.0;
    cuda_memcpy_d2h(&s, part + nb, sizeof s);
    return s;
}

/* The pointers of a segment's buffers are its element 0 (base + off), in the state type. */
static const void *af_at(const void *base, size_t off) { return (const char *)base + off * (g.sbf16 ? 2 : 4); }

void cuda_adafactor_sums(float *sums, const void *grad, const AdafactorSeg *s, float grad_scale) {
    if (!s->n) return;
    const void *gp = af_at(grad, s->off);
    if (s->rows == 1) {
        af_vec_sums_kernel<<<ew_grid(s->n), EW_BLOCK, 0, g.stream>>>(sums + s->stat + s->col0, gp, s->first, s->n,
                                                                       grad_scale, g.sbf16);
        LAUNCH_CHECK(af_vec_sums_kernel);
        return;
    }
    size_t r0 = s->first / s->cols, r1 = (s->first + s->n - 1) / s->cols + 1, nr = r1 - r0;
    size_t nb = (nr + 7) / 8;
    /* gp points at element `first`: the kernels index from the tensor's element 0 minus first */
    af_row_sums_kernel<<<(unsigned)(nb < (1u << 20) ? nb : (1u << 20)), AF_BLOCK, 0, g.stream>>>(
        sums + s->stat, gp, s->first, s->n, s->cols, r0, nr, grad_scale, g.sbf16);
    LAUNCH_CHECK(af_row_sums_kernel);
    int nch = (int)((nr + AF_CHUNK_ROWS - 1) / AF_CHUNK_ROWS);
    double *part = (double *)scratch((size_t)nch * s->cols * sizeof(double));
    dim3 grid((unsigned)((s->cols + 31) / 32), (unsigned)nch), block(32, 8);
    af_col_part_kernel<<<grid, block, 0, g.stream>>>(part, gp, s->first, s->n, s->cols, r0, r1, grad_scale, g.sbf16);
    LAUNCH_CHECK(af_col_part_kernel);
    af_col_final_kernel<<<(s->cols + 255) / 256, 256, 0, g.stream>>>(sums + s->stat + s->rows + s->col0, part, nch,
                                                                   s->cols);
    LAUNCH_CHECK(af_col_final_kernel);
}

void cuda_adafactor_stats(float *stat, float *fac, const float *sums, int rows, int cols, float beta2t, float eps1) {
    float w = (float)(1.0 - (double)beta2t);
    af_stats_kernel<<<1, 1024, 0, g.stream>>>(stat, fac, sums, rows, cols, beta2t, w, eps1);
    LAUNCH_CHECK(af_stats_kernel);
}

static AfSeg af_seg(const float *fac, const AdafactorSeg *s) {
    AfSeg a = {s->first, s->n, s->rows, s->cols, s->first + s->n < ((size_t)1 << 32), NULL, NULL};
    a.fr = fac + s->stat;
    a.fc = fac + s->stat + s->col0 + (s->rows == 1 ? 0 : s->rows);
    return a;
}

void cuda_adafactor_rms(double *out, const void *param, const void *grad, const float *fac, const AdafactorSeg *s,
                        float grad_scale) {
    size_t per = (size_t)AF_BLOCK * 8, nb64 = (s->n + per - 1) / per;
    int nb = (int)(nb64 < AF_MAX_BLOCKS ? (nb64 ? nb64 : 1) : AF_MAX_BLOCKS);
    double *part = (double *)scratch(2 * (size_t)nb * sizeof(double));
    af_rms_kernel<<<nb, AF_BLOCK, 0, g.stream>>>(part, af_at(param, s->off), af_at(grad, s->off), af_seg(fac, s),
                                                 grad_scale, g.sbf16);
    LAUNCH_CHECK(af_rms_kernel);
    af_rms_final_kernel<<<1, 1024, 0, g.stream>>>(out, part, nb);
    LAUNCH_CHECK(af_rms_final_kernel);
}

void cuda_adafactor_update(void *param, const void *grad, void *m, const float *fac, const AdafactorSeg *s,
                           float grad_scale, float coef, float decay, float beta1) {
    if (!s->n) return;
    af_update_kernel<<<ew_grid(s->n), EW_BLOCK, 0, g.stream>>>(
        (void *)af_at(param, s->off), af_at(grad, s->off), m ? (void *)af_at(m, s->off) : NULL, af_seg(fac, s),
        grad_scale, coef, decay, beta1, 1.0f - beta1, g.sbf16);
    LAUNCH_CHECK(af_update_kernel);
}

void cuda_scale(void *x, size_t n, float s) {
    if (n == 0) return;
    if (al16(x)) {
        scale8_kernel<<<ew_grid((n + 7) / 8), EW_BLOCK, 0, g.stream>>>(x, n, s, g.sbf16);
        LAUNCH_CHECK(scale8_kernel);
        return;
    }
    scale_kernel<<<ew_grid(n), EW_BLOCK, 0, g.stream>>>(x, n, s, g.sbf16);
    LAUNCH_CHECK(scale_kernel);
}

void cuda_sum_parts(void *y, const void *const *x, int k, size_t n) {
    if (n == 0) return;
    SumParts p;
    int al = al16(y) && n % 8 == 0;
    for (int j = 0; j < k; j++) p.p[j] = x[j], al = al && al16(x[j]);
    if (al) {
        sum_parts8_kernel<<<ew_grid(n / 8), EW_BLOCK, 0, g.stream>>>(y, p, k, n / 8, g.bf16);
        LAUNCH_CHECK(sum_parts8_kernel);
        return;
    }
    sum_parts_kernel<<<ew_grid(n), EW_BLOCK, 0, g.stream>>>(y, p, k, n, g.bf16);
    LAUNCH_CHECK(sum_parts_kernel);
}

void cuda_add(void *y, const void *x, size_t n) {
    if (n == 0) return;
    if (al16(y) && al16(x)) {
        add8_kernel<<<ew_grid((n + 7) / 8), EW_BLOCK, 0, g.stream>>>(y, x, n, g.bf16);
        LAUNCH_CHECK(add8_kernel);
        return;
    }
    if (!(n & 1) && ptr_alignment(y) >= 8 && ptr_alignment(x) >= 8) {
        add2_kernel<<<ew_grid(n / 2), EW_BLOCK, 0, g.stream>>>(y, x, n / 2, g.bf16);
        LAUNCH_CHECK(add2_kernel);
        return;
    }
    add_kernel<<<ew_grid(n), EW_BLOCK, 0, g.stream>>>(y, x, n, g.bf16);
    LAUNCH_CHECK(add_kernel);
}

void cuda_copy_rows(void *dst, const void *src, const int *rows, size_t n, size_t row_bytes, int scatter) {
    unsigned grid = (unsigned)(n < 65535 ? n : 65535);
    if (row_bytes % 16 == 0 && al16(dst) && al16(src)) {
        copy_rows16_kernel<<<grid, 256, 0, g.stream>>>((uint4 *)dst, (const uint4 *)src, rows, n, row_bytes / 16,
                                                       scatter);
        LAUNCH_CHECK(copy_rows16_kernel);
        return;
    }
    copy_rows_kernel<<<grid, 256, 0, g.stream>>>((unsigned char *)dst, (const unsigned char *)src, rows, n, row_bytes,
                                                 scatter);
    LAUNCH_CHECK(copy_rows_kernel);
}

} /* extern "C" */

/* the mixture-of-experts ops: after the matmuls and helpers they call */
#include "cuda/moe.cuh"

/* ------------------------------------------------------------------------------------ */
/* the backend table (ops.h)                                                             */

/* One GPU per process: with several processes on a machine (mpirun -np N), the process's
 * rank on its machine modulo the devices visible (OMPI_COMM_WORLD_LOCAL_RANK, or MPICH's
 * MPI_LOCALRANKID, or SLURM_LOCALID); device 0 for a plain run. CUDA_VISIBLE_DEVICES still
 * narrows what is visible (one visible device: every process takes it). */
static int local_rank(void) { return env_local_rank(); }

static int backend_init(int n_threads, char *err, size_t errlen) {
    (void)n_threads; /* host threads: the cuda backend does its work on the card */
    int n = 0, local = local_rank();
    if (cudaGetDeviceCount(&n) != cudaSuccess || n <= 0) n = 1; /* cuda_init says what is wrong */
    return cuda_init(local < 0 ? 0 : local % n, err, errlen);
}

/* op_alloc promises zeroed memory; the memset runs on the stream, before any later op. */
static void *backend_alloc(size_t bytes) {
    void *p = cuda_malloc(bytes);
    cuda_memset_zero(p, bytes);
    return p;
}

static int backend_device_peak(size_t *allocated, size_t *used) {
    cuda_memory_peak(allocated, used);
    return 0;
}

void cuda_sum_blocks(void *dst, const void *src, size_t c, int D, float s, int bf16, void *stream) {
    if (!c) return;
    cudaStream_t st = (cudaStream_t)stream;
    size_t es = bf16 ? 2 : 4;
    if (c % 8 == 0 && ((uintptr_t)dst | (uintptr_t)src | (c * es)) % 16 == 0) {
        sum_blocks8_kernel<<<ew_grid(c / 8), EW_BLOCK, 0, st>>>(dst, src, c, D, s, bf16);
        LAUNCH_CHECK(sum_blocks8_kernel);
        return;
    }
    sum_blocks_kernel<<<ew_grid(c), EW_BLOCK, 0, st>>>(dst, src, c, D, s, bf16);
    LAUNCH_CHECK(sum_blocks_kernel);
}

extern "C" const OpsBackend ops_backend_cuda = {
    .name = "cuda",
    .host_memory = 0,
    .init = backend_init,
    .set_options = cuda_set_options,
    .device_name = cuda_device_name,
    .synchronize = cuda_synchronize,
    .idle = cuda_idle,
    .prof_mark = cuda_prof_mark,
    .prof_span = cuda_prof_span,
    .side_begin = cuda_side_begin,
    .side_end = cuda_side_end,
    .side_mark = cuda_side_mark,
    .side_wait = cuda_side_wait,
    .synchronize_main = cuda_synchronize_main,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .copy_reserve = cuda_copy_reserve,
    .copy_out = cuda_copy_out,
    .copy_in = cuda_copy_in,
    .copy_sync = cuda_copy_sync,
    .copy_wait = cuda_copy_wait,
    .copy_in_main = cuda_copy_in_main,
    .device_memory = cuda_memory_info,
    .device_peak = backend_device_peak,
    .alloc = backend_alloc,
    .free = cuda_free,
    .zero = cuda_memset_zero,
    .copy = cuda_memcpy_d2d,
    .upload = cuda_memcpy_h2d,
    .download = cuda_memcpy_d2h,
    .set_precision = cuda_set_precision,
    .to_act = cuda_to_act,
    .embedding_forward = cuda_embedding_forward,
    .embedding_backward = cuda_embedding_backward,
    .embedding_backward_rows = cuda_embedding_backward_rows,
    .embedding_forward_shard = cuda_embedding_forward_shard,
    .rmsnorm_forward = cuda_rmsnorm_forward,
    .add_rmsnorm_forward = cuda_add_rmsnorm_forward,
    .rmsnorm_backward = cuda_rmsnorm_backward,
    .matmul_forward = cuda_matmul_forward,
    .matmul_forward_add = cuda_matmul_forward_add,
    .matmul_backward = cuda_matmul_backward,
    .matmul_backward_add = cuda_matmul_backward_add,
    .rope_tables = cuda_rope_tables,
    .rope_forward = cuda_rope_forward,
    .rope_backward = cuda_rope_backward,
    .attention_forward = cuda_attention_forward,
    .attention_backward = cuda_attention_backward,
    .attention_rope_backward = cuda_attention_rope_backward,
    .swiglu_forward = cuda_swiglu_forward,
    .swiglu_backward = cuda_swiglu_backward,
    .crossentropy_forward_backward = cuda_crossentropy_forward_backward,
    .crossentropy_shard_stats = cuda_crossentropy_shard_stats,
    .crossentropy_shard_backward = cuda_crossentropy_shard_backward,
    .adamw = cuda_adamw,
    .adamw_host16 = NULL,  /* the cpu backend's (offload's host update) */
    .adamw_cast = cuda_adamw_cast,
    .adafactor_sums = cuda_adafactor_sums,
    .adafactor_stats = cuda_adafactor_stats,
    .adafactor_rms = cuda_adafactor_rms,
    .adafactor_update = cuda_adafactor_update,
    .sumsq = cuda_sumsq,
    .scale = cuda_scale,
    .add = cuda_add,
    .sum_parts = cuda_sum_parts,
    .copy_rows = cuda_copy_rows,
    .tune_matmuls = cuda_tune_matmuls,
    .moe_router_forward = cuda_moe_router_forward,
    .moe_router_backward = cuda_moe_router_backward,
    .moe_topk = cuda_moe_topk,
    .moe_dispatch = cuda_moe_dispatch,
    .moe_stats = cuda_moe_stats,
    .moe_route_backward = cuda_moe_route_backward,
    .moe_matmul_forward = cuda_moe_matmul_forward,
    .moe_matmul_backward = cuda_moe_matmul_backward,
    .moe_combine = cuda_moe_combine,
    .moe_unpermute = cuda_moe_unpermute,
    .moe_gate_backward = cuda_moe_gate_backward,
    .moe_accumulate = cuda_moe_accumulate,
    .graph_begin = cuda_graph_begin,
    .graph_end = cuda_graph_end,
    .graph_run = cuda_graph_run,
    .graph_free = cuda_graph_free,
};
