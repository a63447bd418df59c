/* ops_cuda — the ops of ops.h as CUDA kernels on device pointers, fp32; matmuls through
 * cuBLASLt in exact fp32 (TF32 only when asked for).
 *
 * Written as CUDA C: plain functions and kernels, no classes, templates or std::.
 * One stream for everything, so ops are ordered without events and the one scratch buffer
 * can be shared by all ops. Determinism: no float atomics anywhere; every reduction has an
 * order fixed by the shapes alone (never by the number of SMs), so two runs of the same op
 * are bitwise equal on any card.
 *
 * Where an op is a few separately rounded fp32 operations (rope, adamw, scale, add,
 * embedding) the kernels use the __f*_rn intrinsics, which nvcc never fuses into FMAs, so
 * they give bitwise the CPU backend's result (gcc -std=c11 does not contract either).
 */
#include "ops_cuda.h"
#include "attn_bf16.h"
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
    X(cublasLtMatrixLayoutDestroy)
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
    cudaStream_t stream;
    cublasLtHandle_t lt;
    void *workspace;
    void *scratch; /* grows on demand; ops use it only within one call, on the one stream */
    size_t scratch_bytes;
    size_t smem_optin; /* largest dynamic shared memory a block may opt in to */
    size_t att_smem_set[3]; /* what each attention kernel has been opted in to */
    size_t rms_smem_set;    /* ... and the rmsnorm backward */
    size_t ce_smem_set;     /* ... and the bf16 cross-entropy */
    char name[256];
} g;

/* cuBLASLt algorithms chosen so far, per matmul shape and pointer alignment */
typedef struct {
    int used, ta, tb, m, n, k, lda, ldb, ldd, tf32, tab, td;
    uint32_t al_a, al_b, al_d;
    cublasLtMatmulAlgo_t algo;
} AlgoEntry;
#define ALGO_CACHE 64
static AlgoEntry g_algos[ALGO_CACHE];
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

static void *scratch(size_t bytes) {
    if (bytes > g.scratch_bytes) {
        if (g.scratch) {
            cuda_free(g.scratch); /* waits: earlier kernels may still use it */
        }
        g.scratch = NULL;
        g.scratch_bytes = 0;
        g.scratch = cuda_malloc(bytes);
        g.scratch_bytes = bytes;
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

/* ------------------------------------------------------------------------------------ */
/* reductions (blockDim.x must be a multiple of 32; every thread gets the result)        */

#define FULL_MASK 0xffffffffu

/* Activations are fp32 or bf16 (precision=mixed), chosen once per process; kernels take
 * them as void pointers and a flag `bf`, uniform across the grid, so one kernel serves
 * both. Arithmetic is always fp32. */
typedef __nv_bfloat16 bf16;
static __device__ __forceinline__ float ld(const void *p, size_t i, int bf) {
    return bf ? __bfloat162float(((const bf16 *)p)[i]) : ((const float *)p)[i];
}
static __device__ __forceinline__ void st(void *p, size_t i, float v, int bf) {
    if (bf) ((bf16 *)p)[i] = __float2bfloat16(v);
    else ((float *)p)[i] = v;
}
/* Elements i and i+1 in one load or store (i even, the array 4-byte (bf16) or 8-byte (fp32)
 * aligned: every activation buffer and row of even length is). */
static __device__ __forceinline__ float2 ld2(const void *p, size_t i, int bf) {
    if (bf) return __bfloat1622float2(*(const __nv_bfloat162 *)((const bf16 *)p + i));
    return *(const float2 *)((const float *)p + i);
}
static __device__ __forceinline__ void st2(void *p, size_t i, float2 v, int bf) {
    if (bf) *(__nv_bfloat162 *)((bf16 *)p + i) = __float22bfloat162_rn(v);
    else *(float2 *)((float *)p + i) = v;
}

/* Eight consecutive elements, i a multiple of 8 and the array 16-byte aligned: one 16-byte
 * access in bf16, two in fp32. The memory-bound kernels move their data in these. */
static __device__ __forceinline__ void unpack8_bf16(float *v, uint4 u) {
    const __nv_bfloat162 *h = (const __nv_bfloat162 *)&u;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        float2 f = __bfloat1622float2(h[k]);
        v[2 * k] = f.x;
        v[2 * k + 1] = f.y;
    }
}
static __device__ __forceinline__ void ld8(float *v, const void *p, size_t i, int bf) {
    if (bf) {
        unpack8_bf16(v, *(const uint4 *)((const bf16 *)p + i));
    } else {
        float4 a = *(const float4 *)((const float *)p + i), b = *(const float4 *)((const float *)p + i + 4);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    }
}
static __device__ __forceinline__ uint4 pack8_bf16(const float *v) {
    uint4 u;
    __nv_bfloat162 *h = (__nv_bfloat162 *)&u;
#pragma unroll
    for (int k = 0; k < 4; k++) h[k] = __float22bfloat162_rn(make_float2(v[2 * k], v[2 * k + 1]));
    return u;
}
static __device__ __forceinline__ void st8(void *p, size_t i, const float *v, int bf) {
    if (bf) {
        *(uint4 *)((bf16 *)p + i) = pack8_bf16(v);
    } else {
        *(float4 *)((float *)p + i) = make_float4(v[0], v[1], v[2], v[3]);
        *(float4 *)((float *)p + i + 4) = make_float4(v[4], v[5], v[6], v[7]);
    }
}

static __device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}
static __device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}
static __device__ __forceinline__ double warp_sum_double(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}
static __device__ float block_max(float v) {
    __shared__ float sh[32];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads(); /* sh may still be read by a previous call */
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    return warp_max(lane < nw ? sh[lane] : -INFINITY);
}
static __device__ double block_sum_double(double v) {
    __shared__ double sh[32];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum_double(v);
    __syncthreads();
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    return warp_sum_double(lane < nw ? sh[lane] : 0.0);
}

/* ------------------------------------------------------------------------------------ */
/* backend state                                                                         */

extern "C" {

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
    const char *s = getenv("MESHTRAIN_CUDA_SYNC");
    g.sync_each = s && *s && strcmp(s, "0") != 0;
    CUDA_CHECK(cudaStreamCreateWithFlags(&g.stream, cudaStreamNonBlocking));
    CUBLAS_CHECK(lt.cublasLtCreate(&g.lt));
    g.workspace = cuda_malloc(WORKSPACE_BYTES);
    g.ready = 1;
    return 0;
}

void cuda_shutdown(void) {
    if (!g.ready) return;
    CUDA_CHECK(cudaStreamSynchronize(g.stream));
    cuda_free(g.scratch);
    cuda_free(g.workspace);
    CUBLAS_CHECK(lt.cublasLtDestroy(g.lt));
    CUDA_CHECK(cudaStreamDestroy(g.stream));
    memset(&g, 0, sizeof g);
    memset(g_algos, 0, sizeof g_algos); /* algorithms belong to the handle and the card */
    g_algo_next = 0;
}

const char *cuda_device_name(void) { return g.name; }
void *cuda_stream(void) { return (void *)g.stream; }
void cuda_set_tf32(int on) { g.tf32 = on != 0; }

/* Live allocations, for the high-water mark of the bytes held on the card (cudaFree does
 * not say how big a block was). They are few and long-lived, so a list does. Kept apart
 * from g: the marks survive cuda_shutdown. */
typedef struct { void *p; size_t bytes; } LiveAlloc;
static LiveAlloc *g_live;
static size_t g_n_live, g_cap_live, g_live_bytes, g_peak_alloc, g_peak_used;

static void track_alloc(void *p, size_t bytes) {
    if (g_n_live == g_cap_live) {
        size_t cap = g_cap_live ? 2 * g_cap_live : 64;
        void *q = realloc(g_live, cap * sizeof *g_live);
        if (!q) die(2, "cannot allocate %zu bytes: out of memory", cap * sizeof *g_live);
        g_live = (LiveAlloc *)q;
        g_cap_live = cap;
    }
    g_live[g_n_live].p = p;
    g_live[g_n_live++].bytes = bytes;
    g_live_bytes += bytes;
    if (g_live_bytes > g_peak_alloc) g_peak_alloc = g_live_bytes;
    size_t fr = 0, tot = 0;
    if (cudaMemGetInfo(&fr, &tot) == cudaSuccess && tot - fr > g_peak_used) g_peak_used = tot - fr;
}

static void track_free(void *p) {
    for (size_t i = 0; i < g_n_live; i++)
        if (g_live[i].p == p) {
            g_live_bytes -= g_live[i].bytes;
            g_live[i] = g_live[--g_n_live];
            return;
        }
}

void *cuda_malloc(size_t bytes) {
    if (bytes == 0) return NULL;
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
        size_t fr = 0, tot = 0;
        (void)cudaGetLastError(); /* clear the allocation error before asking */
        cudaMemGetInfo(&fr, &tot);
        die(2, "cuda: cannot allocate %zu bytes on the GPU: %s (%zu MiB free of %zu MiB)", bytes,
            cudaGetErrorString(e), fr >> 20, tot >> 20);
    }
    track_alloc(p, bytes);
    return p;
}

void cuda_free(void *p) {
    if (!p) return;
    CUDA_CHECK(cudaStreamSynchronize(g.stream)); /* kernels in flight may still use it */
    CUDA_CHECK(cudaFree(p));
    track_free(p);
}

void cuda_memory_peak(size_t *allocated, size_t *used) {
    if (allocated) *allocated = g_peak_alloc;
    if (used) *used = g_peak_used;
}

int cuda_memory_info(size_t *free_bytes, size_t *total_bytes) {
    size_t fr = 0, tot = 0;
    if (cudaMemGetInfo(&fr, &tot) != cudaSuccess) return -1;
    if (free_bytes) *free_bytes = fr;
    if (total_bytes) *total_bytes = tot;
    return 0;
}

void cuda_memcpy_h2d(void *dst, const void *src, size_t bytes) {
    if (!bytes) return;
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, g.stream));
    CUDA_CHECK(cudaStreamSynchronize(g.stream));
}

void cuda_memcpy_d2h(void *dst, const void *src, size_t bytes) {
    if (!bytes) return;
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, g.stream));
    CUDA_CHECK(cudaStreamSynchronize(g.stream));
}

void cuda_memcpy_d2d(void *dst, const void *src, size_t bytes) {
    if (bytes) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, g.stream));
}

void cuda_memset_zero(void *p, size_t bytes) {
    if (bytes) CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, g.stream));
}

void cuda_synchronize(void) { CUDA_CHECK(cudaStreamSynchronize(g.stream)); }

} /* extern "C" */

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

/* ------------------------------------------------------------------------------------ */
/* rmsnorm                                                                               */

/* One warp per row (rows are short: C ~ 1e3), 8 rows per block; lanes stride the
 * channels so loads coalesce. */
#define ROW_WARPS 8
static __global__ void rmsnorm_forward_kernel(void *out, float *rstd, const void *x, const void *w, int N, int C,
                                              float eps, int bf) {
    int row = blockIdx.x * ROW_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= N) return;
    size_t r0 = (size_t)row * C;
    float ss = 0.0f;
    if (!(C & 1)) { /* two channels per load */
        for (int c = 2 * lane; c < C; c += 64) {
            float2 xv = ld2(x, r0 + c, bf);
            ss += xv.x * xv.x + xv.y * xv.y;
        }
    } else {
        for (int c = lane; c < C; c += 32) {
            float xv = ld(x, r0 + c, bf);
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
static __global__ void rmsnorm8_forward_kernel(void *out, float *rstd, const void *x, const void *w, int N, int C,
                                               float eps, int bf) {
    int row = blockIdx.x * ROW_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= N) return;
    size_t r0 = (size_t)row * C;
    float xv[RMS_VEC][8], ss = 0.0f;
#pragma unroll
    for (int k = 0; k < RMS_VEC; k++) {
        int c = (32 * k + lane) * 8;
        if (c < C) ld8(xv[k], x, r0 + c, bf);
    }
#pragma unroll
    for (int k = 0; k < RMS_VEC; k++)
        if ((32 * k + lane) * 8 < C)
#pragma unroll
            for (int e = 0; e < 8; e++) ss += xv[k][e] * xv[k][e];
    for (int c = (32 * RMS_VEC + lane) * 8; c < C; c += 256) {
        float t[8];
        ld8(t, x, r0 + c, bf);
#pragma unroll
        for (int e = 0; e < 8; e++) ss += t[e] * t[e];
    }
    ss = warp_sum(ss);
    float r = 1.0f / sqrtf(ss / (float)C + eps);
    if (lane == 0) rstd[row] = r;
#pragma unroll
    for (int k = 0; k < RMS_VEC; k++) {
        int c = (32 * k + lane) * 8;
        if (c < C) {
            float wv[8], o[8];
            ld8(wv, w, c, bf);
#pragma unroll
            for (int e = 0; e < 8; e++) o[e] = (xv[k][e] * r) * wv[e];
            st8(out, r0 + c, o, bf);
        }
    }
    for (int c = (32 * RMS_VEC + lane) * 8; c < C; c += 256) {
        float t[8], wv[8];
        ld8(t, x, r0 + c, bf);
        ld8(wv, w, c, bf);
#pragma unroll
        for (int e = 0; e < 8; e++) t[e] = (t[e] * r) * wv[e];
        st8(out, r0 + c, t, bf);
    }
}

/* Backward in one pass over the rows: block b owns rows [N*b/nb, N*(b+1)/nb), its warps take
 * every RMS_BWD_WARPS-th of them. Per row, dx += rstd*w*g - rstd^3 (g.w.x)/C x; and the
 * warp adds the row's dw terms g*x*rstd into its own shared-memory row of C floats. At the
 * end the block sums its warps' rows in warp order into part[b, :] (the second pass adds
 * the blocks in order): deterministic, and x and dout are read once. Even C goes two
 * channels per load. */
#define RMS_BWD_WARPS 4
#define RMSNORM_DW_BLOCKS 1024 /* keep estimate.c's cuda_scratch_bytes in step */
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
                float2 g = ld2(dout, r0 + c, bf), xv = ld2(x, r0 + c, bf), wv = ld2(w, c, bf);
                dot += g.x * wv.x * xv.x + g.y * wv.y * xv.y;
                my[c] += g.x * (xv.x * r);
                my[c + 1] += g.y * (xv.y * r);
            }
        } else {
            for (int c = lane; c < C; c += 32) {
                float g = ld(dout, r0 + c, bf), xv = ld(x, r0 + c, bf);
                dot += g * ld(w, c, bf) * xv;
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
                ld8(wv, w, c, bf);
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

/* ------------------------------------------------------------------------------------ */
/* rope                                                                                  */

/* One thread per (token, q-or-k head, pair). Separately rounded products and sums (no FMA),
 * as the CPU backend computes them. */
static __global__ void rope_kernel(void *qkv, const float *cos_t, const float *sin_t, int B, int T, int NH, int HD,
                                   float dir, int bf) {
    int half = HD / 2, C = NH * HD;
    size_t total = (size_t)B * T * 2 * NH * half;
    GRID_STRIDE(idx, total) {
        int i = (int)(idx % half);
        size_t r = idx / half;
        int hh = (int)(r % (2 * NH)); /* q heads, then k heads: contiguous in the row */
        size_t bt = r / (2 * NH);
        int t = (int)(bt % T);
        size_t x = bt * 3 * C + (size_t)hh * HD + 2 * i;
        float c = cos_t[(size_t)t * half + i], s = dir * sin_t[(size_t)t * half + i];
        float2 v = ld2(qkv, x, bf); /* x is even: HD and the row lengths are */
        st2(qkv, x, make_float2(__fsub_rn(__fmul_rn(v.x, c), __fmul_rn(v.y, s)), __fadd_rn(__fmul_rn(v.x, s), __fmul_rn(v.y, c))),
            bf);
    }
}

/* The same on 16-byte vectors (HD % 8 == 0): a thread rotates 4 pairs of one head with one
 * load of the row and one float4 each of the cos and sin tables (which stay in cache). */
static __global__ void rope8_kernel(void *qkv, const float *cos_t, const float *sin_t, int T, int NH, int HD,
                                    size_t nvec, float dir, int bf) {
    int half = HD / 2, C = NH * HD, per_tok = C / 4; /* vectors of q and k in one token */
    GRID_STRIDE(idx, nvec) {
        size_t bt = idx / per_tok;
        int col = (int)(idx - bt * per_tok) * 8; /* in q | k of the token */
        int t = (int)(bt % T), i = (col % HD) / 2;
        size_t x = bt * 3 * C + col;
        float4 c4 = *(const float4 *)(cos_t + (size_t)t * half + i), s4 = *(const float4 *)(sin_t + (size_t)t * half + i);
        float cs[4] = {c4.x, c4.y, c4.z, c4.w}, sn[4] = {dir * s4.x, dir * s4.y, dir * s4.z, dir * s4.w};
        float v[8], o[8];
        ld8(v, qkv, x, bf);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float x0 = v[2 * k], x1 = v[2 * k + 1];
            o[2 * k] = __fsub_rn(__fmul_rn(x0, cs[k]), __fmul_rn(x1, sn[k]));
            o[2 * k + 1] = __fadd_rn(__fmul_rn(x0, sn[k]), __fmul_rn(x1, cs[k]));
        }
        st8(qkv, x, o, bf);
    }
}

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
#define ATT_MAX_HD 256
#define ATT_DPL (ATT_MAX_HD / 32)         /* accumulator registers per lane and row */

static size_t att_forward_smem(int HD) { return (size_t)ATT_TILE * (3 * HD + 1) * sizeof(float); }
static size_t att_dq_smem(int HD) { return (size_t)ATT_TILE * (4 * HD + 2) * sizeof(float); }
static size_t att_dkdv_smem(int HD) { return (size_t)ATT_TILE * (4 * HD + 4) * sizeof(float); }

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
            int nk = i - k0 + 1 < ATT_TILE ? i - k0 + 1 : ATT_TILE; /* keys of this tile row i sees */
#pragma unroll
            for (int c = 0; c < ATT_DPL; c++) o[rr][c] *= alpha;
            for (int jj = 0; jj < nk; jj++) {
                float pj = __shfl_sync(FULL_MASK, p, jj);
                const float *vr = v_s + jj * HD;
#pragma unroll
                for (int c = 0; c < ATT_DPL; c++) {
                    int d = lane + 32 * c;
                    if (d < HD) o[rr][c] += pj * vr[d];
                }
            }
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
            int nk = i - k0 + 1 < ATT_TILE ? i - k0 + 1 : ATT_TILE;
            for (int jj = 0; jj < nk; jj++) {
                float dsj = __shfl_sync(FULL_MASK, ds, jj);
                const float *kr = k_s + jj * ldk;
#pragma unroll
                for (int c = 0; c < ATT_DPL; c++) {
                    int d = lane + 32 * c;
                    if (d < HD) dq[rr][c] += dsj * kr[d];
                }
            }
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

/* ------------------------------------------------------------------------------------ */
/* swiglu                                                                                */

/* Two hidden units per thread when H is even (pairs: step 2), else one (step 1). */
static __device__ __forceinline__ float silu_f(float g) { return g / (1.0f + expf(-g)); }
static __global__ void swiglu2_forward_kernel(void *out, const void *gu, int N, int H, int bf) {
    size_t total = (size_t)N * H / 2;
    GRID_STRIDE(j, total) {
        size_t i = 2 * j, n = i / H, k = i % H;
        float2 gt = ld2(gu, n * 2 * H + k, bf), up = ld2(gu, n * 2 * H + H + k, bf);
        st2(out, i, make_float2(silu_f(gt.x) * up.x, silu_f(gt.y) * up.y), bf);
    }
}
static __global__ void swiglu2_backward_kernel(void *dgu, const void *dout, const void *gu, int N, int H, int bf) {
    size_t total = (size_t)N * H / 2;
    GRID_STRIDE(j, total) {
        size_t i = 2 * j, n = i / H, k = i % H, ig = n * 2 * H + k, iu = ig + H;
        float2 gt = ld2(gu, ig, bf), up = ld2(gu, iu, bf), d = ld2(dout, i, bf), dg = ld2(dgu, ig, bf),
               du = ld2(dgu, iu, bf);
        float s0 = 1.0f / (1.0f + expf(-gt.x)), s1 = 1.0f / (1.0f + expf(-gt.y));
        dg.x += d.x * up.x * (s0 * (1.0f + gt.x * (1.0f - s0)));
        dg.y += d.y * up.y * (s1 * (1.0f + gt.y * (1.0f - s1)));
        du.x += d.x * (gt.x * s0);
        du.y += d.y * (gt.y * s1);
        st2(dgu, ig, dg, bf);
        st2(dgu, iu, du, bf);
    }
}
/* Eight hidden units per thread in 16-byte vectors (H % 8 == 0); nvec = N * H / 8. */
static __global__ void swiglu8_forward_kernel(void *out, const void *gu, int H, size_t nvec, int bf) {
    int h8 = H / 8;
    GRID_STRIDE(j, nvec) {
        size_t n = j / h8;
        int k = (int)(j - n * h8) * 8;
        size_t ig = n * 2 * H + k;
        float gt[8], up[8], o[8];
        ld8(gt, gu, ig, bf);
        ld8(up, gu, ig + H, bf);
#pragma unroll
        for (int e = 0; e < 8; e++) o[e] = silu_f(gt[e]) * up[e];
        st8(out, 8 * j, o, bf);
    }
}
static __global__ void swiglu8_backward_kernel(void *dgu, const void *dout, const void *gu, int H, size_t nvec,
                                               int bf) {
    int h8 = H / 8;
    GRID_STRIDE(j, nvec) {
        size_t n = j / h8;
        int k = (int)(j - n * h8) * 8;
        size_t ig = n * 2 * H + k, iu = ig + H;
        float gt[8], up[8], d[8], dg[8], du[8];
        ld8(gt, gu, ig, bf);
        ld8(up, gu, iu, bf);
        ld8(d, dout, 8 * j, bf);
        ld8(dg, dgu, ig, bf);
        ld8(du, dgu, iu, bf);
#pragma unroll
        for (int e = 0; e < 8; e++) {
            float s = 1.0f / (1.0f + expf(-gt[e]));
            dg[e] += d[e] * up[e] * (s * (1.0f + gt[e] * (1.0f - s)));
            du[e] += d[e] * (gt[e] * s);
        }
        st8(dgu, ig, dg, bf);
        st8(dgu, iu, du, bf);
    }
}
static __global__ void swiglu_forward_kernel(void *out, const void *gu, int N, int H, int bf) {
    size_t total = (size_t)N * H;
    GRID_STRIDE(i, total) {
        size_t n = i / H, k = i % H;
        float gt = ld(gu, n * 2 * H + k, bf), up = ld(gu, n * 2 * H + H + k, bf);
        st(out, i, gt / (1.0f + expf(-gt)) * up, bf);
    }
}

static __global__ void swiglu_backward_kernel(void *dgu, const void *dout, const void *gu, int N, int H, int bf) {
    size_t total = (size_t)N * H;
    GRID_STRIDE(i, total) {
        size_t n = i / H, k = i % H, ig = n * 2 * H + k, iu = ig + H;
        float gt = ld(gu, ig, bf), up = ld(gu, iu, bf), d = ld(dout, i, bf);
        float s = 1.0f / (1.0f + expf(-gt));
        float silu = gt * s;
        st(dgu, ig, ld(dgu, ig, bf) + d * up * (s * (1.0f + gt * (1.0f - s))), bf);
        st(dgu, iu, ld(dgu, iu, bf) + d * silu, bf);
    }
}

/* ------------------------------------------------------------------------------------ */
/* cross-entropy                                                                         */

/* One block per row (V ~ 5e4: 50 elements per thread). Pass 1: max and a NaN flag;
 * pass 2: sum of exp(l - max), each thread's part in double, the block sum in double;
 * pass 3 (gradient): exp recomputed and written once, scaled, in place. The target's
 * logit is read by every thread before the first block reduction, hence before any write. */
#define CE_BLOCK 1024
static __global__ void __launch_bounds__(CE_BLOCK)
crossentropy_kernel(float *losses, void *logits, int ldl, const int *targets, int V, float scale, int bf) {
    int n = blockIdx.x;
    void *row = bf ? (void *)((bf16 *)logits + (size_t)n * ldl) : (void *)((float *)logits + (size_t)n * ldl);
    int tgt = targets[n];
    int tgt_ok = tgt >= 0 && tgt < V;
    float lt = tgt_ok ? ld(row, tgt, bf) : 0.0f;
    float mx = -INFINITY;
    int bad = 0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        float x = ld(row, j, bf);
        mx = fmaxf(mx, x); /* ignores NaN; the flag catches it */
        bad |= x != x;
    }
    mx = block_max(mx);
    bad = __syncthreads_or(bad);
    if (bad || !tgt_ok || mx == INFINITY || mx == -INFINITY) {
        if (threadIdx.x == 0) losses[n] = NAN;
        if (scale != 0.0f)
            for (int j = threadIdx.x; j < V; j += blockDim.x) st(row, j, NAN, bf);
        return;
    }
    double sum = 0.0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) sum += (double)expf(ld(row, j, bf) - mx);
    sum = block_sum_double(sum);
    if (threadIdx.x == 0) losses[n] = (float)((double)mx + log(sum) - (double)lt);
    if (scale != 0.0f) {
        float f = (float)((double)scale / sum);
        for (int j = threadIdx.x; j < V; j += blockDim.x) {
            float e = expf(ld(row, j, bf) - mx);
            st(row, j, j == tgt ? (float)((double)scale * ((double)e / sum - 1.0)) : e * f, bf);
        }
    }
}

/* bf16 rows with ld % 8 == 0 (16-byte aligned rows): the same three passes and the same
 * arithmetic, but the row (V rounded up to 8: 100 KB for the GPT-2 vocabulary) is first
 * copied into shared memory with asynchronous 16-byte copies, so it is read from memory
 * once and written once; with few registers and that much shared memory two blocks share an
 * SM, and one's copy overlaps the other's exp work (one block per SM, with the row held in
 * registers, left the memory idle during the exps: 0.45 ms vs this kernel's goal of 0.3).
 * Thread t takes the 16-byte chunks t, t + CE8_BLOCK, ... Padding past V in the last chunk is
 * copied but never used or written. 512 threads: two blocks then have 64 registers a thread. */
#define CE8_BLOCK 512
#define CE_SMEM_BLOCKS 2
static __global__ void __launch_bounds__(CE8_BLOCK, CE_SMEM_BLOCKS)
crossentropy8_kernel(float *losses, bf16 *logits, int ldl, const int *targets, int V, float scale) {
    extern __shared__ uint4 ce_row[]; /* [ceil(V / 8)] */
    int n = blockIdx.x, nch = (V + 7) / 8;
    bf16 *row = logits + (size_t)n * ldl;
    for (int k = threadIdx.x; k < nch; k += blockDim.x)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"((uint32_t)__cvta_generic_to_shared(ce_row + k)),
                     "l"(row + 8 * (size_t)k));
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    int tgt = targets[n];
    int tgt_ok = tgt >= 0 && tgt < V;
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    __syncthreads();
    float lt = tgt_ok ? __bfloat162float(((const bf16 *)ce_row)[tgt]) : 0.0f;
    float mx = -INFINITY;
    int bad = 0;
    for (int k = threadIdx.x; k < nch; k += blockDim.x) {
        float v[8];
        unpack8_bf16(v, ce_row[k]);
#pragma unroll
        for (int e = 0; e < 8; e++)
            if (8 * k + e < V) {
                mx = fmaxf(mx, v[e]); /* ignores NaN; the flag catches it */
                bad |= v[e] != v[e];
            }
    }
    mx = block_max(mx);
    bad = __syncthreads_or(bad);
    if (bad || !tgt_ok || mx == INFINITY || mx == -INFINITY) {
        if (threadIdx.x == 0) losses[n] = NAN;
        if (scale != 0.0f)
            for (int j = threadIdx.x; j < V; j += blockDim.x) row[j] = __float2bfloat16(NAN);
        return;
    }
    /* each chunk's 8 exps (each <= 1) summed in fp32 (relative error ~1e-7), the chunks in
     * double: the conversions to double cost as much as the exps themselves */
    double sum = 0.0;
    for (int k = threadIdx.x; k < nch; k += blockDim.x) {
        float v[8], cs = 0.0f;
        unpack8_bf16(v, ce_row[k]);
        if (8 * k + 8 <= V) {
#pragma unroll
            for (int e = 0; e < 8; e++) cs += expf(v[e] - mx);
        } else {
#pragma unroll
            for (int e = 0; e < 8; e++)
                if (8 * k + e < V) cs += expf(v[e] - mx);
        }
        sum += (double)cs;
    }
    sum = block_sum_double(sum);
    if (threadIdx.x == 0) losses[n] = (float)((double)mx + log(sum) - (double)lt);
    if (scale == 0.0f) return;
    float f = (float)((double)scale / sum);
    float gt = (float)((double)scale * ((double)expf(lt - mx) / sum - 1.0)); /* the target's */
    for (int k = threadIdx.x; k < nch; k += blockDim.x) {
        int j0 = 8 * k;
        float v[8];
        unpack8_bf16(v, ce_row[k]);
#pragma unroll
        for (int e = 0; e < 8; e++) v[e] = j0 + e == tgt ? gt : expf(v[e] - mx) * f;
        if (j0 + 8 <= V) {
            *(uint4 *)(row + j0) = pack8_bf16(v);
        } else {
#pragma unroll
            for (int e = 0; e < 8; e++)
                if (j0 + e < V) row[j0 + e] = __float2bfloat16(v[e]);
        }
    }
}

/* ------------------------------------------------------------------------------------ */
/* adamw                                                                                 */

/* Elementwise; the scalars come from the host computed as op_adamw computes them, and the
 * operations are op_adamw's, one rounding each, in its order: bitwise the CPU result in
 * fp32. With bf16 state (sbf) the same fp32 arithmetic runs on the widened values, and each
 * of param, m and v is rounded to bf16 once, when stored. */
typedef struct {
    float decay, w1, w1c, b2, w2, neg_step, bc2_sqrt, eps, grad_scale;
    int small;
} AdamwArgs;
/* one element: p, m, v updated in place (fp32 values) */
static __device__ __forceinline__ void adamw_elem(float *p, float g, float *m, float *v, const AdamwArgs *a) {
    float gr = __fmul_rn(g, a->grad_scale);
    float mi = *m;
    float mn = a->small ? __fadd_rn(mi, __fmul_rn(a->w1, __fsub_rn(gr, mi)))
                        : __fsub_rn(gr, __fmul_rn(__fsub_rn(gr, mi), a->w1c));
    *m = mn;
    float vi = __fmul_rn(*v, a->b2);
    vi = __fadd_rn(vi, __fmul_rn(__fmul_rn(a->w2, gr), gr));
    *v = vi;
    float den = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), a->bc2_sqrt), a->eps);
    float pi = __fmul_rn(*p, a->decay);
    *p = __fadd_rn(pi, __fdiv_rn(__fmul_rn(a->neg_step, mn), den));
}
static __global__ void adamw_kernel(void *param, const void *grad, void *m, void *v, size_t n, AdamwArgs a, int sbf) {
    GRID_STRIDE(i, n) {
        float p = ld(param, i, sbf), mi = ld(m, i, sbf), vi = ld(v, i, sbf);
        adamw_elem(&p, ld(grad, i, sbf), &mi, &vi, &a);
        st(m, i, mi, sbf);
        st(v, i, vi, sbf);
        st(param, i, p, sbf);
    }
}
/* The same on 16-byte vectors (all four arrays 16-byte aligned): n / 8 vectors, then the
 * n % 8 last elements by the first threads. */
static __global__ void adamw8_kernel(void *param, const void *grad, void *m, void *v, size_t n, AdamwArgs a, int sbf) {
    size_t nv = n / 8;
    GRID_STRIDE(j, nv) {
        float p[8], g[8], mi[8], vi[8];
        ld8(p, param, 8 * j, sbf);
        ld8(g, grad, 8 * j, sbf);
        ld8(mi, m, 8 * j, sbf);
        ld8(vi, v, 8 * j, sbf);
#pragma unroll
        for (int e = 0; e < 8; e++) adamw_elem(&p[e], g[e], &mi[e], &vi[e], &a);
        st8(m, 8 * j, mi, sbf);
        st8(v, 8 * j, vi, sbf);
        st8(param, 8 * j, p, sbf);
    }
    size_t i = 8 * nv + (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float p = ld(param, i, sbf), mi = ld(m, i, sbf), vi = ld(v, i, sbf);
        adamw_elem(&p, ld(grad, i, sbf), &mi, &vi, &a);
        st(m, i, mi, sbf);
        st(v, i, vi, sbf);
        st(param, i, p, sbf);
    }
}

/* ------------------------------------------------------------------------------------ */
/* flat-buffer helpers                                                                   */

/* sum of squares: a grid whose size depends only on n (never on the card), each thread's
 * strided part in double, block sums in double, then one block adds the partials. */
#define SUMSQ_BLOCK 256
#define SUMSQ_MAX_BLOCKS 1024
static __global__ void sumsq_partial_kernel(double *part, const void *x, size_t n, int sbf) {
    double s = 0.0;
    GRID_STRIDE(i, n) {
        double xi = ld(x, i, sbf);
        s += xi * xi;
    }
    s = block_sum_double(s);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}
static __global__ void sumsq_final_kernel(double *out, const double *part, int nb) {
    double s = 0.0;
    for (int i = threadIdx.x; i < nb; i += blockDim.x) s += part[i];
    s = block_sum_double(s);
    if (threadIdx.x == 0) out[0] = s;
}

static __global__ void scale_kernel(void *x, size_t n, float s, int sbf) {
    GRID_STRIDE(i, n) st(x, i, __fmul_rn(ld(x, i, sbf), s), sbf);
}
static __global__ void add_kernel(void *y, const void *x, size_t n, int bf) {
    GRID_STRIDE(i, n) st(y, i, __fadd_rn(ld(y, i, bf), ld(x, i, bf)), bf);
}
/* the same on pairs (n2 = n / 2, n even) */
static __global__ void add2_kernel(void *y, const void *x, size_t n2, int bf) {
    GRID_STRIDE(i, n2) {
        float2 a = ld2(y, 2 * i, bf), b = ld2(x, 2 * i, bf);
        st2(y, 2 * i, make_float2(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y)), bf);
    }
}
/* scale and add on 16-byte vectors (pointers 16-byte aligned): n / 8 vectors, then the
 * n % 8 last elements by the first threads. */
static __global__ void scale8_kernel(void *x, size_t n, float s, int sbf) {
    size_t nv = n / 8;
    GRID_STRIDE(j, nv) {
        float a[8];
        ld8(a, x, 8 * j, sbf);
#pragma unroll
        for (int e = 0; e < 8; e++) a[e] = __fmul_rn(a[e], s);
        st8(x, 8 * j, a, sbf);
    }
    size_t i = 8 * nv + (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) st(x, i, __fmul_rn(ld(x, i, sbf), s), sbf);
}
static __global__ void add8_kernel(void *y, const void *x, size_t n, int bf) {
    size_t nv = n / 8;
    GRID_STRIDE(j, nv) {
        float a[8], b[8];
        ld8(a, y, 8 * j, bf);
        ld8(b, x, 8 * j, bf);
#pragma unroll
        for (int e = 0; e < 8; e++) a[e] = __fadd_rn(a[e], b[e]);
        st8(y, 8 * j, a, bf);
    }
    size_t i = 8 * nv + (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) st(y, i, __fadd_rn(ld(y, i, bf), ld(x, i, bf)), bf);
}
static __global__ void to_act_kernel(void *dst, const float *src, size_t n, int bf) {
    GRID_STRIDE(i, n) st(dst, i, src[i], bf);
}

/* ------------------------------------------------------------------------------------ */
/* matmul through cuBLASLt                                                               */

/* cuBLASLt is column-major. A row-major [R, K] matrix is, read column-major, its transpose
 * [K, R] with leading dimension K. So every row-major product Y = X W^T is computed as the
 * column-major Y^T = W X^T (see the callers). Each pointer's real alignment is passed to the
 * heuristic (its default assumes 256 bytes), so slices at any float offset work. The chosen
 * algorithm is cached per shape; the heuristic is deterministic, so is the choice. */

static uint32_t ptr_alignment(const void *p) {
    uintptr_t a = (uintptr_t)p;
    uint32_t al = 256;
    while (al > 2 && a % al) al >>= 1;
    return al;
}

/* column-major D[m, n] = op(A)[m, k] @ op(B)[k, n] + beta * D. A and B are activations or
 * compute weights (fp32, or bf16 with precision mixed or bf16); D is that type too, or the
 * state type (d_state: weight gradients, fp32 unless precision=bf16). Accumulation is
 * always fp32. */
static void lt_matmul(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void *A, int lda,
                      const void *B, int ldb, float beta, void *D, int ldd, int d_state) {
    if (!g.ready) die(1, "cuda: a matmul was called before cuda_init");
    cudaDataType_t tab = g.bf16 ? CUDA_R_16BF : CUDA_R_32F;
    cudaDataType_t td = d_state ? (g.sbf16 ? CUDA_R_16BF : CUDA_R_32F) : tab;
    cublasComputeType_t ct = g.tf32 && !g.bf16 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, ld;
    CUBLAS_CHECK(lt.cublasLtMatmulDescCreate(&op, ct, CUDA_R_32F));
    CUBLAS_CHECK(lt.cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(lt.cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    /* layouts describe the matrices as stored (before op) */
    CUBLAS_CHECK(lt.cublasLtMatrixLayoutCreate(&la, tab, ta == CUBLAS_OP_N ? m : k, ta == CUBLAS_OP_N ? k : m, lda));
    CUBLAS_CHECK(lt.cublasLtMatrixLayoutCreate(&lb, tab, tb == CUBLAS_OP_N ? k : n, tb == CUBLAS_OP_N ? n : k, ldb));
    CUBLAS_CHECK(lt.cublasLtMatrixLayoutCreate(&ld, td, m, n, ldd));

    uint32_t al_a = ptr_alignment(A), al_b = ptr_alignment(B), al_d = ptr_alignment(D);
    AlgoEntry *hit = NULL;
    for (int i = 0; i < ALGO_CACHE && !hit; i++) {
        AlgoEntry *e = &g_algos[i];
        if (e->used && e->ta == (int)ta && e->tb == (int)tb && e->m == m && e->n == n && e->k == k &&
            e->lda == lda && e->ldb == ldb && e->ldd == ldd && e->tf32 == g.tf32 && e->tab == (int)tab &&
            e->td == (int)td && e->al_a == al_a &&
            e->al_b == al_b && e->al_d == al_d)
            hit = e;
    }
    if (!hit) {
        cublasLtMatmulPreference_t pref;
        CUBLAS_CHECK(lt.cublasLtMatmulPreferenceCreate(&pref));
        uint64_t ws = WORKSPACE_BYTES;
        CUBLAS_CHECK(lt.cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
        CUBLAS_CHECK(lt.cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof al_a));
        CUBLAS_CHECK(lt.cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof al_b));
        CUBLAS_CHECK(lt.cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_d, sizeof al_d));
        CUBLAS_CHECK(lt.cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof al_d));
        cublasLtMatmulHeuristicResult_t res;
        int nres = 0;
        CUBLAS_CHECK(lt.cublasLtMatmulAlgoGetHeuristic(g.lt, op, la, lb, ld, ld, pref, 1, &res, &nres));
        CUBLAS_CHECK(lt.cublasLtMatmulPreferenceDestroy(pref));
        if (nres < 1)
            die(1, "cuda: cuBLASLt has no algorithm for the matmul m=%d n=%d k=%d (transa %d transb %d)", m, n, k,
                (int)ta, (int)tb);
        hit = &g_algos[g_algo_next];
        g_algo_next = (g_algo_next + 1) % ALGO_CACHE;
        hit->used = 1;
        hit->ta = (int)ta; hit->tb = (int)tb;
        hit->m = m; hit->n = n; hit->k = k;
        hit->lda = lda; hit->ldb = ldb; hit->ldd = ldd;
        hit->tf32 = g.tf32;
        hit->tab = (int)tab; hit->td = (int)td;
        hit->al_a = al_a; hit->al_b = al_b; hit->al_d = al_d;
        hit->algo = res.algo;
    }
    const float alpha = 1.0f;
    CUBLAS_CHECK(lt.cublasLtMatmul(g.lt, op, &alpha, A, la, B, lb, &beta, D, ld, D, ld, &hit->algo, g.workspace,
                                WORKSPACE_BYTES, g.stream));
    if (g.sync_each) CUDA_CHECK(cudaStreamSynchronize(g.stream));
    CUBLAS_CHECK(lt.cublasLtMatrixLayoutDestroy(la));
    CUBLAS_CHECK(lt.cublasLtMatrixLayoutDestroy(lb));
    CUBLAS_CHECK(lt.cublasLtMatrixLayoutDestroy(ld));
    CUBLAS_CHECK(lt.cublasLtMatmulDescDestroy(op));
}

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

void cuda_embedding_backward(void *dwte, const void *dout, const int *tokens, int N, int C) {
    if (!dwte || N <= 0 || C <= 0) return;
    dim3 grid((C + EMB_BLOCK - 1) / EMB_BLOCK, EMB_BUCKETS);
    embedding_backward_kernel<<<grid, EMB_BLOCK, 0, g.stream>>>(dwte, dout, tokens, N, C, g.bf16, g.sbf16);
    LAUNCH_CHECK(embedding_backward_kernel);
}

void cuda_rmsnorm_forward(void *out, float *rstd, const void *x, const void *w, int N, int C, float eps) {
    if (N <= 0 || C <= 0) return;
    if (C % 8 == 0 && al16(out) && al16(x) && al16(w)) {
        rmsnorm8_forward_kernel<<<(N + ROW_WARPS - 1) / ROW_WARPS, ROW_WARPS * 32, 0, g.stream>>>(out, rstd, x, w, N, C,
                                                                                                 eps, g.bf16);
        LAUNCH_CHECK(rmsnorm8_forward_kernel);
        return;
    }
    rmsnorm_forward_kernel<<<(N + ROW_WARPS - 1) / ROW_WARPS, ROW_WARPS * 32, 0, g.stream>>>(out, rstd, x, w, N, C,
                                                                                            eps, g.bf16);
    LAUNCH_CHECK(rmsnorm_forward_kernel);
}

void cuda_rmsnorm_backward(void *dx, void *dw, const void *dout, const void *x, const void *w,
                           const float *rstd, int N, int C) {
    if ((!dx && !dw) || N <= 0 || C <= 0) return;
    /* blocks of about 16 rows, at most RMSNORM_DW_BLOCKS: a count fixed by N alone */
    int nb = (N + 15) / 16 < RMSNORM_DW_BLOCKS ? (N + 15) / 16 : RMSNORM_DW_BLOCKS;
    size_t smem = (size_t)RMS_BWD_WARPS * C * sizeof(float);
    if (smem > g.smem_optin)
        die(2, "cuda: rmsnorm backward with %d channels needs %zu bytes of shared memory; the GPU allows %zu", C, smem,
            g.smem_optin);
    if (smem > 48 * 1024 && smem > g.rms_smem_set) { /* C > 3072: only the scalar kernel runs */
        CUDA_CHECK(cudaFuncSetAttribute((const void *)rmsnorm_backward_kernel,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        g.rms_smem_set = smem;
    }
    float *part = (float *)scratch((size_t)nb * C * sizeof(float));
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

/* dinp[N, C] += dout[N, OC] @ w[OC, C]  <=>  dinp^T[C, N] += w_cm[C, OC] @ dout^T[OC, N]
 *   (w column-major is [C, OC] ld C, dout column-major is [OC, N] ld OC: no transposes);
 * dw[OC, C] += dout^T @ inp  <=>  dw^T[C, OC] += inp^T[C, N] @ (dout^T[OC, N])^T
 *   (inp column-major is [C, N] ld C; dout column-major [OC, N] ld OC, transposed).
 * dw is the state type: bf16 products accumulate into fp32 gradients unless precision=bf16. */
void cuda_matmul_backward(void *dinp, void *dw, const void *dout, int ldo, const void *inp, const void *w,
                          int N, int C, int OC) {
    if (N <= 0 || C <= 0 || OC <= 0) return;
    int OCa = oc_main(OC), OCt = OC - OCa; /* see cuda_matmul_forward */
    const void *w_t = act_off(w, (size_t)OCa * C), *dout_t = act_off(dout, OCa);
    if (dinp) {
        lt_matmul(CUBLAS_OP_N, CUBLAS_OP_N, C, N, OCa, w, C, dout, ldo, 1.0f, dinp, C, 0);
        if (OCt) lt_matmul(CUBLAS_OP_N, CUBLAS_OP_N, C, N, OCt, w_t, C, dout_t, ldo, 1.0f, dinp, C, 0);
    }
    if (dw) {
        lt_matmul(CUBLAS_OP_N, CUBLAS_OP_T, C, OCa, N, inp, C, dout, ldo, 1.0f, dw, C, 1);
        if (OCt)
            lt_matmul(CUBLAS_OP_N, CUBLAS_OP_T, C, OCt, N, inp, C, dout_t, ldo, 1.0f,
                      (char *)dw + (size_t)OCa * C * state_size(), C, 1);
    }
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

void cuda_attention_forward(void *out, float *lse, const void *qkv, int B, int T, int NH, int HD) {
    if (B <= 0 || T <= 0 || NH <= 0 || HD <= 0) return;
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

void cuda_attention_backward(void *dqkv, const void *dout, const void *qkv, const void *out,
                             const float *lse, int B, int T, int NH, int HD) {
    if (!dqkv || B <= 0 || T <= 0 || NH <= 0 || HD <= 0) return;
    if (g.bf16 && attn_bf16_supported(HD)) {
        void *ws = scratch(attn_bf16_workspace_bytes(B, T, NH, HD));
        attn_bf16_backward(dqkv, dout, qkv, out, lse, ws, B, T, NH, HD, (void *)g.stream);
        if (g.sync_each) CUDA_CHECK(cudaStreamSynchronize(g.stream));
        return;
    }
    att_check_shape(B, NH, HD);
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

void cuda_swiglu_backward(void *dgu, const void *dout, const void *gu, int N, int H) {
    if (!dgu || N <= 0 || H <= 0) return;
    if (H % 8 == 0 && al16(dgu) && al16(dout) && al16(gu)) {
        size_t nv = (size_t)N * H / 8;
        swiglu8_backward_kernel<<<ew_grid(nv), EW_BLOCK, 0, g.stream>>>(dgu, dout, gu, H, nv, g.bf16);
        LAUNCH_CHECK(swiglu8_backward_kernel);
        return;
    }
    if (!(H & 1)) {
        swiglu2_backward_kernel<<<ew_grid((size_t)N * H / 2), EW_BLOCK, 0, g.stream>>>(dgu, dout, gu, N, H, g.bf16);
        LAUNCH_CHECK(swiglu2_backward_kernel);
        return;
    }
    swiglu_backward_kernel<<<ew_grid((size_t)N * H), EW_BLOCK, 0, g.stream>>>(dgu, dout, gu, N, H, g.bf16);
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

void cuda_adamw(void *param, const void *grad, void *m, void *v, size_t n, float lr, float beta1,
                float beta2, float eps, float weight_decay, int step, float grad_scale) {
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
    if (al16(param) && al16(grad) && al16(m) && al16(v)) {
        adamw8_kernel<<<ew_grid((n + 7) / 8), EW_BLOCK, 0, g.stream>>>(param, grad, m, v, n, a, g.sbf16);
        LAUNCH_CHECK(adamw8_kernel);
        return;
    }
    adamw_kernel<<<ew_grid(n), EW_BLOCK, 0, g.stream>>>(param, grad, m, v, n, a, g.sbf16);
    LAUNCH_CHECK(adamw_kernel);
}

double cuda_sumsq(const void *x, size_t n) {
    if (n == 0) return 0.0;
    size_t per = (size_t)SUMSQ_BLOCK * 8; /* at least 8 elements per thread */
    size_t nb64 = (n + per - 1) / per;
    int nb = (int)(nb64 < SUMSQ_MAX_BLOCKS ? nb64 : SUMSQ_MAX_BLOCKS);
    double *part = (double *)scratch((size_t)(nb + 1) * sizeof(double));
    sumsq_partial_kernel<<<nb, SUMSQ_BLOCK, 0, g.stream>>>(part, x, n, g.sbf16);
    LAUNCH_CHECK(sumsq_partial_kernel);
    sumsq_final_kernel<<<1, 1024, 0, g.stream>>>(part + nb, part, nb);
    LAUNCH_CHECK(sumsq_final_kernel);
    double s = 0.0;
    cuda_memcpy_d2h(&s, part + nb, sizeof s);
    return s;
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

} /* extern "C" */

/* ------------------------------------------------------------------------------------ */
/* the backend table (ops.h)                                                             */

/* One GPU per process: with several processes on a machine (mpirun -np N), the process's
 * rank on its machine modulo the devices visible (OMPI_COMM_WORLD_LOCAL_RANK, or MPICH's
 * MPI_LOCALRANKID, or SLURM_LOCALID); device 0 for a plain run. CUDA_VISIBLE_DEVICES still
 * narrows what is visible (one visible device: every process takes it). */
static int local_rank(void) {
    const char *vars[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *v = getenv(vars[i]);
        if (v && *v) return atoi(v);
    }
    return 0;
}

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

extern "C" const OpsBackend ops_backend_cuda = {
    .name = "cuda",
    .host_memory = 0,
    .init = backend_init,
    .device_name = cuda_device_name,
    .synchronize = cuda_synchronize,
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
    .rmsnorm_forward = cuda_rmsnorm_forward,
    .rmsnorm_backward = cuda_rmsnorm_backward,
    .matmul_forward = cuda_matmul_forward,
    .matmul_backward = cuda_matmul_backward,
    .rope_tables = cuda_rope_tables,
    .rope_forward = cuda_rope_forward,
    .rope_backward = cuda_rope_backward,
    .attention_forward = cuda_attention_forward,
    .attention_backward = cuda_attention_backward,
    .swiglu_forward = cuda_swiglu_forward,
    .swiglu_backward = cuda_swiglu_backward,
    .crossentropy_forward_backward = cuda_crossentropy_forward_backward,
    .adamw = cuda_adamw,
    .sumsq = cuda_sumsq,
    .scale = cuda_scale,
    .add = cuda_add,
};
