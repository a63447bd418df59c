/* Causal attention through cuDNN's fused flash attention, on the backend C API (see attn_cudnn.h).
 *
 * cuDNN 9 has no single "attention" operation that takes a causal mask on Hopper; what it fuses is a
 * graph of small operations in the shape cudnn-frontend's SDPA nodes emit (CompositeSDPANode and
 * CompositeSDPABackwardNode in include/cudnn_frontend/node/scaled_dot_product_flash_attention.h,
 * the pre-9.21 causal mask of diagonal_band_mask.h). This file builds that graph operation by
 * operation, in the same order, with the same tensor types and strides, since the engine that
 * recognises it matches on the pattern:
 *
 *   forward:  S = Q K^T * scale; causal mask (row index >= column index, else -inf);
 *             M = rowmax S; E = exp(S - M); Z = rowsum E; stats = M + log Z; P = E / Z (bf16);
 *             O = P V
 *   backward: Dsum = rowsum(dO * O) (* 1, as the frontend writes it); E = exp(mask(S*scale - stats));
 *             dV = E^T dO; dS = (dO V^T - Dsum) * E * scale; dK = dS^T Q;
 *             dQ = dS K into an fp32 buffer (cuDNN accumulates it with atomics), then copied to dQ
 *
 * Q, K and V are strided views of qkv (K^T by swapping K's last two strides), dQ, dK, dV strided
 * views of dqkv: nothing is copied. The backward's two fp32 intermediates (Dsum [B, NH, T] and the dQ
 * accumulator [B, NH, T, HD]) are real tensors the caller's workspace holds, after the plan's own.
 *
 * Written as C: plain functions and structs; compiled by nvcc only for the CUDA types. libcudnn is
 * opened with dlopen, like cuBLASLt in ops_cuda.cu, so the binary runs where it is absent. */
#include "attn_cudnn.h"
#include "env.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef MESHTRAIN_NO_CUDNN
#include <cudnn_graph.h>
#endif

#ifdef MESHTRAIN_NO_CUDNN /* built without cuDNN's headers: never available */

int attn_cudnn_available(char *why, size_t whylen) {
    if (why && whylen) snprintf(why, whylen, "this build has no cuDNN (its headers were not found)");
    return 0;
}
size_t attn_cudnn_version(void) { return 0; }
int attn_cudnn_forward_plan(int, int, int, int, size_t *, char *why, size_t whylen) {
    return attn_cudnn_available(why, whylen) - 1;
}
int attn_cudnn_backward_plan(int, int, int, int, int, size_t *, char *why, size_t whylen) {
    return attn_cudnn_available(why, whylen) - 1;
}
int attn_cudnn_forward(void *, float *, const void *, int, int, int, int, void *, void *) { return -1; }
int attn_cudnn_backward(void *, const void *, const void *, const void *, const float *, int, int, int, int, int,
                        void *, void *) {
    return -1;
}
void attn_cudnn_shutdown(void) {}

#else

/* ------------------------------------------------------------------------------------------- */
/* the library, opened on first use                                                            */

#define DNN_FUNCS(X)                                                                              \
    X(cudnnGetVersion) X(cudnnGetErrorString) X(cudnnGetLastErrorString) X(cudnnCreate)          \
    X(cudnnDestroy) X(cudnnSetStream) X(cudnnBackendCreateDescriptor)                            \
    X(cudnnBackendDestroyDescriptor) X(cudnnBackendFinalize) X(cudnnBackendSetAttribute)         \
    X(cudnnBackendGetAttribute) X(cudnnBackendExecute)
static struct {
#define DNN_FIELD(f) decltype(&::f) f;
    DNN_FUNCS(DNN_FIELD)
#undef DNN_FIELD
    void *lib;
    int tried;     /* dlopen attempted (once per process) */
    size_t version;
    cudnnHandle_t handle;
    int device;    /* the handle's device */
    char why[256]; /* why the library is unusable */
} dnn;

static int dnn_load(void) {
    if (dnn.lib) return 0;
    if (dnn.tried) return -1;
    dnn.tried = 1;
    const char *path = hook_text(HOOK_CUDNN_LIB);
    if (!path) path = "libcudnn.so.9";
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(dnn.why, sizeof dnn.why, "cannot load %s (%s)", path, dlerror());
        return -1;
    }
#define DNN_SYM(f)                                                                                \
    if (!(dnn.f = (decltype(dnn.f))dlsym(lib, #f))) {                                             \
        snprintf(dnn.why, sizeof dnn.why, "%s lacks %s", path, #f);                              \
        dlclose(lib);                                                                             \
        return -1;                                                                                \
    }
    DNN_FUNCS(DNN_SYM)
#undef DNN_SYM
    dnn.version = dnn.cudnnGetVersion();
    if (dnn.version < 90000) {
        snprintf(dnn.why, sizeof dnn.why, "%s is cuDNN %zu; 9.0 or later is needed", path, dnn.version);
        dlclose(lib);
        return -1;
    }
    dnn.lib = lib;
    return 0;
}

/* the handle, on the current device */
static int dnn_ready(void) {
    if (dnn_load()) return -1;
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        (void)cudaGetLastError();
        snprintf(dnn.why, sizeof dnn.why, "no current CUDA device");
        return -1;
    }
    if (dnn.handle && dnn.device == dev) return 0;
    if (dnn.handle) attn_cudnn_shutdown();
    cudnnStatus_t s = dnn.cudnnCreate(&dnn.handle);
    if (s != CUDNN_STATUS_SUCCESS) {
        snprintf(dnn.why, sizeof dnn.why, "cudnnCreate failed: %s", dnn.cudnnGetErrorString(s));
        dnn.handle = NULL;
        return -1;
    }
    dnn.device = dev;
    return 0;
}

int attn_cudnn_available(char *why, size_t whylen) {
    int ok = dnn_ready() == 0;
    if (!ok && why && whylen) snprintf(why, whylen, "%s", dnn.why);
    return ok;
}

size_t attn_cudnn_version(void) { return dnn_load() == 0 ? dnn.version : 0; }

/* ------------------------------------------------------------------------------------------- */
/* building a graph                                                                            */

#define MAX_DESC 96
#define MAX_OPS 40

typedef struct {
    cudnnBackendDescriptor_t all[MAX_DESC]; /* every descriptor made, destroyed at the end */
    int n_all;
    cudnnBackendDescriptor_t ops[MAX_OPS];
    int n_ops;
    int64_t next_uid; /* virtual tensors' ids */
    cudnnStatus_t status;
    char failed[160]; /* the first step that failed */
} Graph;

static cudnnBackendDescriptor_t make(Graph *g, cudnnBackendDescriptorType_t type, const char *what) {
    cudnnBackendDescriptor_t d = NULL;
    if (g->status != CUDNN_STATUS_SUCCESS) return NULL;
    if (g->n_all == MAX_DESC) {
        g->status = CUDNN_STATUS_INTERNAL_ERROR;
        snprintf(g->failed, sizeof g->failed, "%s: too many descriptors", what);
        return NULL;
    }
    cudnnStatus_t s = dnn.cudnnBackendCreateDescriptor(type, &d);
    if (s != CUDNN_STATUS_SUCCESS) {
        g->status = s;
        snprintf(g->failed, sizeof g->failed, "create %s", what);
        return NULL;
    }
    g->all[g->n_all++] = d;
    return d;
}

static void set(Graph *g, cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
                int64_t n, const void *value, const char *what) {
    if (g->status != CUDNN_STATUS_SUCCESS) return;
    cudnnStatus_t s = dnn.cudnnBackendSetAttribute(d, name, type, n, value);
    if (s != CUDNN_STATUS_SUCCESS) {
        g->status = s;
        snprintf(g->failed, sizeof g->failed, "%s: attribute %d", what, (int)name);
    }
}

static void finalize(Graph *g, cudnnBackendDescriptor_t d, const char *what) {
    if (g->status != CUDNN_STATUS_SUCCESS) return;
    cudnnStatus_t s = dnn.cudnnBackendFinalize(d);
    if (s != CUDNN_STATUS_SUCCESS) {
        g->status = s;
        snprintf(g->failed, sizeof g->failed, "finalize %s", what);
    }
}

static void set_desc(Graph *g, cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name,
                     cudnnBackendDescriptor_t v, const char *what) {
    set(g, d, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &v, what);
}

static void add_op(Graph *g, cudnnBackendDescriptor_t op, const char *what) {
    finalize(g, op, what);
    if (g->status != CUDNN_STATUS_SUCCESS) return;
    if (g->n_ops == MAX_OPS) {
        g->status = CUDNN_STATUS_INTERNAL_ERROR;
        snprintf(g->failed, sizeof g->failed, "%s: too many operations", what);
        return;
    }
    g->ops[g->n_ops++] = op;
}

/* A 4-d tensor; uid 0 = a new virtual one. */
static cudnnBackendDescriptor_t tensor(Graph *g, int64_t uid, cudnnDataType_t dt, const int64_t dims[4],
                                       const int64_t strides[4], const char *what) {
    cudnnBackendDescriptor_t t = make(g, CUDNN_BACKEND_TENSOR_DESCRIPTOR, what);
    bool virt = uid == 0, by_value = false;
    int64_t id = virt ? g->next_uid++ : uid, align = 16;
    set(g, t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt, what);
    set(g, t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims, what);
    set(g, t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides, what);
    set(g, t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &id, what);
    set(g, t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align, what);
    set(g, t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &virt, what);
    set(g, t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value, what);
    finalize(g, t, what);
    return t;
}

/* An fp32 scalar passed by value (its variant-pack pointer is host memory). */
static cudnnBackendDescriptor_t scalar(Graph *g, int64_t uid, const char *what) {
    static const int64_t one[4] = {1, 1, 1, 1};
    cudnnBackendDescriptor_t t = make(g, CUDNN_BACKEND_TENSOR_DESCRIPTOR, what);
    cudnnDataType_t dt = CUDNN_DATA_FLOAT;
    bool virt = false, by_value = true;
    int64_t align = 16;
    set(g, t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt, what);
    set(g, t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, one, what);
    set(g, t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, one, what);
    set(g, t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, what);
    set(g, t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align, what);
    set(g, t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &virt, what);
    set(g, t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value, what);
    finalize(g, t, what);
    return t;
}

/* y = mode(x, b, t): b and t may be NULL (unary, binary); axis >= 0 only for GEN_INDEX. The math
 * precision is fp32 except for comparisons (boolean), as the frontend sets them. */
static void pointwise(Graph *g, cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                      cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y, int64_t axis, const char *what) {
    cudnnBackendDescriptor_t pw = make(g, CUDNN_BACKEND_POINTWISE_DESCRIPTOR, what);
    cudnnDataType_t prec = mode == CUDNN_POINTWISE_CMP_GE ? CUDNN_DATA_BOOLEAN : CUDNN_DATA_FLOAT;
    set(g, pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, what);
    set(g, pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec, what);
    if (axis >= 0) set(g, pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, what);
    finalize(g, pw, what);
    cudnnBackendDescriptor_t op = make(g, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, what);
    set_desc(g, op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw, what);
    set_desc(g, op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x, what);
    set_desc(g, op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y, what);
    if (b) set_desc(g, op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b, what);
    if (t) set_desc(g, op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t, what);
    float one = 1.0f;
    set(g, op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one, what);
    set(g, op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one, what);
    add_op(g, op, what);
}

static void reduction(Graph *g, cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y,
                      const char *what) {
    cudnnBackendDescriptor_t r = make(g, CUDNN_BACKEND_REDUCTION_DESCRIPTOR, what);
    cudnnDataType_t prec = CUDNN_DATA_FLOAT;
    set(g, r, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &prec, what);
    set(g, r, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode, what);
    finalize(g, r, what);
    cudnnBackendDescriptor_t op = make(g, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, what);
    set_desc(g, op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, r, what);
    set_desc(g, op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x, what);
    set_desc(g, op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y, what);
    add_op(g, op, what);
}

/* c = a @ b (batched over the first two dimensions), fp32 accumulation */
static void matmul(Graph *g, cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c,
                   const char *what) {
    cudnnBackendDescriptor_t m = make(g, CUDNN_BACKEND_MATMUL_DESCRIPTOR, what);
    cudnnDataType_t prec = CUDNN_DATA_FLOAT;
    set(g, m, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &prec, what);
    finalize(g, m, what);
    cudnnBackendDescriptor_t op = make(g, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, what);
    set_desc(g, op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, a, what);
    set_desc(g, op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, b, what);
    set_desc(g, op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, c, what);
    set_desc(g, op, CUDNN_ATTR_OPERATION_MATMUL_DESC, m, what);
    add_op(g, op, what);
}

/* y = x with other dimensions and strides (a transposed view) */
static void reshape(Graph *g, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y, const char *what) {
    cudnnBackendDescriptor_t op = make(g, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, what);
    set_desc(g, op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x, what);
    set_desc(g, op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y, what);
    add_op(g, op, what);
}

static void graph_free(Graph *g) {
    for (int i = g->n_all - 1; i >= 0; i--) dnn.cudnnBackendDestroyDescriptor(g->all[i]);
    g->n_all = g->n_ops = 0;
}

/* tensor ids of the variant pack */
enum { U_Q = 1, U_K, U_V, U_O, U_STATS, U_SCALE, U_NEG_INF, U_DO, U_ONE, U_DQ, U_DK, U_DV, U_DSUM, U_DQ_ACC };

/* The shapes of one call: [B, NH, T, HD] views of the row-major buffers. */
typedef struct {
    int64_t q[4], q_st[4];   /* q, k, v (and dq, dk, dv) in qkv: [B, NH, T, HD] with rows 3C apart */
    int64_t kt[4], kt_st[4]; /* k (or v) transposed: [B, NH, HD, T] */
    int64_t o[4], o_st[4];   /* out, dout: [B, NH, T, HD] with rows C apart */
    int64_t r[4], r_st[4];   /* per row: [B, NH, T, 1] (lse, row max, row sums) */
    int64_t s[4], s_st[4];   /* scores: [B, NH, T, T] */
    int64_t st[4], st_st[4]; /* scores transposed: [B, NH, T, T] column-major */
    int64_t f[4], f_st[4];   /* a packed fp32 [B, NH, T, HD] (the dQ accumulator) */
    int64_t m[4], m_st[4];   /* dO * O as the frontend lays it out */
} Shapes;

static void shapes(Shapes *sh, int64_t B, int64_t T, int64_t NH, int64_t HD) {
    const int64_t C = NH * HD;
#define SET4(a, x0, x1, x2, x3) (a)[0] = (x0), (a)[1] = (x1), (a)[2] = (x2), (a)[3] = (x3)
    SET4(sh->q, B, NH, T, HD), SET4(sh->q_st, T * 3 * C, HD, 3 * C, 1);
    SET4(sh->kt, B, NH, HD, T), SET4(sh->kt_st, T * 3 * C, HD, 1, 3 * C);
    SET4(sh->o, B, NH, T, HD), SET4(sh->o_st, T * C, HD, C, 1);
    SET4(sh->r, B, NH, T, 1), SET4(sh->r_st, NH * T, T, 1, 1);
    SET4(sh->s, B, NH, T, T), SET4(sh->s_st, NH * T * T, T * T, T, 1);
    SET4(sh->st, B, NH, T, T), SET4(sh->st_st, NH * T * T, T * T, 1, T);
    SET4(sh->f, B, NH, T, HD), SET4(sh->f_st, NH * T * HD, T * HD, HD, 1);
    SET4(sh->m, B, NH, T, HD), SET4(sh->m_st, NH * T * HD, T * HD, NH * HD, 1);
#undef SET4
}

/* x with the causal mask: entries whose key (column) lies past the query (row) become -inf */
static cudnnBackendDescriptor_t causal_mask(Graph *g, const Shapes *sh, cudnnBackendDescriptor_t x,
                                            cudnnBackendDescriptor_t neg_inf) {
    cudnnBackendDescriptor_t row = tensor(g, 0, CUDNN_DATA_INT32, sh->s, sh->s_st, "row index");
    pointwise(g, CUDNN_POINTWISE_GEN_INDEX, x, NULL, NULL, row, 2, "gen row index");
    cudnnBackendDescriptor_t col = tensor(g, 0, CUDNN_DATA_INT32, sh->s, sh->s_st, "column index");
    pointwise(g, CUDNN_POINTWISE_GEN_INDEX, x, NULL, NULL, col, 3, "gen column index");
    cudnnBackendDescriptor_t keep = tensor(g, 0, CUDNN_DATA_BOOLEAN, sh->s, sh->s_st, "causal keep");
    pointwise(g, CUDNN_POINTWISE_CMP_GE, row, col, NULL, keep, -1, "row >= column");
    cudnnBackendDescriptor_t y = tensor(g, 0, CUDNN_DATA_FLOAT, sh->s, sh->s_st, "masked scores");
    pointwise(g, CUDNN_POINTWISE_BINARY_SELECT, x, neg_inf, keep, y, -1, "causal select");
    return y;
}

static void forward_graph(Graph *g, const Shapes *sh) {
    cudnnBackendDescriptor_t q = tensor(g, U_Q, CUDNN_DATA_BFLOAT16, sh->q, sh->q_st, "Q");
    cudnnBackendDescriptor_t kt = tensor(g, U_K, CUDNN_DATA_BFLOAT16, sh->kt, sh->kt_st, "K^T");
    cudnnBackendDescriptor_t v = tensor(g, U_V, CUDNN_DATA_BFLOAT16, sh->q, sh->q_st, "V");
    cudnnBackendDescriptor_t o = tensor(g, U_O, CUDNN_DATA_BFLOAT16, sh->o, sh->o_st, "O");
    cudnnBackendDescriptor_t stats = tensor(g, U_STATS, CUDNN_DATA_FLOAT, sh->r, sh->r_st, "stats");
    cudnnBackendDescriptor_t scale = scalar(g, U_SCALE, "scale");
    cudnnBackendDescriptor_t neg_inf = scalar(g, U_NEG_INF, "-inf");

    cudnnBackendDescriptor_t s = tensor(g, 0, CUDNN_DATA_FLOAT, sh->s, sh->s_st, "S");
    matmul(g, q, kt, s, "Q K^T");
    cudnnBackendDescriptor_t ss = tensor(g, 0, CUDNN_DATA_FLOAT, sh->s, sh->s_st, "S scaled");
    pointwise(g, CUDNN_POINTWISE_MUL, s, scale, NULL, ss, -1, "S * scale");
    cudnnBackendDescriptor_t sm = causal_mask(g, sh, ss, neg_inf);
    /* softmax with its statistics */
    cudnnBackendDescriptor_t mx = tensor(g, 0, CUDNN_DATA_FLOAT, sh->r, sh->r_st, "row max");
    reduction(g, CUDNN_REDUCE_TENSOR_MAX, sm, mx, "row max");
    cudnnBackendDescriptor_t sub = tensor(g, 0, CUDNN_DATA_FLOAT, sh->s, sh->s_st, "S - max");
    pointwise(g, CUDNN_POINTWISE_SUB, sm, mx, NULL, sub, -1, "S - max");
    cudnnBackendDescriptor_t e = tensor(g, 0, CUDNN_DATA_FLOAT, sh->s, sh->s_st, "exp");
    pointwise(g, CUDNN_POINTWISE_EXP, sub, NULL, NULL, e, -1, "exp");
    cudnnBackendDescriptor_t z = tensor(g, 0, CUDNN_DATA_FLOAT, sh->r, sh->r_st, "row sum");
    reduction(g, CUDNN_REDUCE_TENSOR_ADD, e, z, "row sum");
    cudnnBackendDescriptor_t lz = tensor(g, 0, CUDNN_DATA_FLOAT, sh->r, sh->r_st, "log sum");
    pointwise(g, CUDNN_POINTWISE_LOG, z, NULL, NULL, lz, -1, "log");
    pointwise(g, CUDNN_POINTWISE_ADD, mx, lz, NULL, stats, -1, "max + log sum");
    cudnnBackendDescriptor_t p = tensor(g, 0, CUDNN_DATA_BFLOAT16, sh->s, sh->s_st, "P");
    pointwise(g, CUDNN_POINTWISE_DIV, e, z, NULL, p, -1, "exp / sum");
    matmul(g, p, v, o, "P V");
}

static void backward_graph(Graph *g, const Shapes *sh, int deterministic) {
    cudnnBackendDescriptor_t q = tensor(g, U_Q, CUDNN_DATA_BFLOAT16, sh->q, sh->q_st, "Q");
    cudnnBackendDescriptor_t kt = tensor(g, U_K, CUDNN_DATA_BFLOAT16, sh->kt, sh->kt_st, "K^T");
    cudnnBackendDescriptor_t vt = tensor(g, U_V, CUDNN_DATA_BFLOAT16, sh->kt, sh->kt_st, "V^T");
    cudnnBackendDescriptor_t o = tensor(g, U_O, CUDNN_DATA_BFLOAT16, sh->o, sh->o_st, "O");
    cudnnBackendDescriptor_t d_o = tensor(g, U_DO, CUDNN_DATA_BFLOAT16, sh->o, sh->o_st, "dO");
    cudnnBackendDescriptor_t stats = tensor(g, U_STATS, CUDNN_DATA_FLOAT, sh->r, sh->r_st, "stats");
    cudnnBackendDescriptor_t scale = scalar(g, U_SCALE, "scale");
    cudnnBackendDescriptor_t neg_inf = scalar(g, U_NEG_INF, "-inf");
    cudnnBackendDescriptor_t one = scalar(g, U_ONE, "one");
    cudnnBackendDescriptor_t dq = tensor(g, U_DQ, CUDNN_DATA_BFLOAT16, sh->q, sh->q_st, "dQ");
    cudnnBackendDescriptor_t dk = tensor(g, U_DK, CUDNN_DATA_BFLOAT16, sh->q, sh->q_st, "dK");
    cudnnBackendDescriptor_t dv = tensor(g, U_DV, CUDNN_DATA_BFLOAT16, sh->q, sh->q_st, "dV");
    cudnnBackendDescriptor_t dsum = tensor(g, U_DSUM, CUDNN_DATA_FLOAT, sh->r, sh->r_st, "rowsum(dO * O)");
    cudnnBackendDescriptor_t dq_acc =
        deterministic ? NULL : tensor(g, U_DQ_ACC, CUDNN_DATA_FLOAT, sh->f, sh->f_st, "dQ accumulator");

    /* Dsum = rowsum(dO * O) */
    cudnnBackendDescriptor_t m = tensor(g, 0, CUDNN_DATA_FLOAT, sh->m, sh->m_st, "dO * O");
    pointwise(g, CUDNN_POINTWISE_MUL, d_o, o, NULL, m, -1, "dO * O");
    cudnnBackendDescriptor_t rs = tensor(g, 0, CUDNN_DATA_FLOAT, sh->r, sh->r_st, "rowsum(dO * O)");
    reduction(g, CUDNN_REDUCE_TENSOR_ADD, m, rs, "rowsum(dO * O)");
    pointwise(g, CUDNN_POINTWISE_MUL, rs, one, NULL, dsum, -1, "Dsum * 1");
    /* E = exp(mask(S * scale - stats)): the probabilities */
    cudnnBackendDescriptor_t s = tensor(g, 0, CUDNN_DATA_FLOAT, sh->s, sh->s_st, "S");
    matmul(g, q, kt, s, "Q K^T");
    cudnnBackendDescriptor_t ss = tensor(g, 0, CUDNN_DATA_FLOAT, sh->s, sh->s_st, "S scaled");
    pointwise(g, CUDNN_POINTWISE_MUL, s, scale, NULL, ss, -1, "S * scale");
    cudnnBackendDescriptor_t sl = tensor(g, 0, CUDNN_DATA_FLOAT, sh->s, sh->s_st, "S - stats");
    pointwise(g, CUDNN_POINTWISE_SUB, ss, stats, NULL, sl, -1, "S - stats");
    cudnnBackendDescriptor_t sm = causal_mask(g, sh, sl, neg_inf);
    cudnnBackendDescriptor_t e = tensor(g, 0, CUDNN_DATA_FLOAT, sh->s, sh->s_st, "P");
    pointwise(g, CUDNN_POINTWISE_EXP, sm, NULL, NULL, e, -1, "exp");
    /* dV = P^T dO */
    cudnnBackendDescriptor_t pt = tensor(g, 0, CUDNN_DATA_BFLOAT16, sh->st, sh->st_st, "P^T");
    reshape(g, e, pt, "P^T");
    matmul(g, pt, d_o, dv, "P^T dO");
    /* dS = (dO V^T - Dsum) * P * scale */
    cudnnBackendDescriptor_t dp = tensor(g, 0, CUDNN_DATA_FLOAT, sh->s, sh->s_st, "dP");
    matmul(g, d_o, vt, dp, "dO V^T");
    cudnnBackendDescriptor_t dp2 = tensor(g, 0, CUDNN_DATA_FLOAT, sh->s, sh->s_st, "dP - Dsum");
    pointwise(g, CUDNN_POINTWISE_SUB, dp, dsum, NULL, dp2, -1, "dP - Dsum");
    cudnnBackendDescriptor_t dp3 = tensor(g, 0, CUDNN_DATA_FLOAT, sh->s, sh->s_st, "(dP - Dsum) P");
    pointwise(g, CUDNN_POINTWISE_MUL, dp2, e, NULL, dp3, -1, "(dP - Dsum) * P");
    cudnnBackendDescriptor_t ds = tensor(g, 0, CUDNN_DATA_FLOAT, sh->s, sh->s_st, "dS");
    pointwise(g, CUDNN_POINTWISE_MUL, dp3, scale, NULL, ds, -1, "dS * scale");
    /* dK = dS^T Q */
    cudnnBackendDescriptor_t dst = tensor(g, 0, CUDNN_DATA_BFLOAT16, sh->st, sh->st_st, "dS^T");
    reshape(g, ds, dst, "dS^T");
    matmul(g, dst, q, dk, "dS^T Q");
    /* dQ = dS K: through the fp32 accumulator (atomics); straight into dQ for the deterministic
     * engine, which keeps dP in its workspace instead (B NH T^2 bf16) */
    cudnnBackendDescriptor_t k = tensor(g, 0, CUDNN_DATA_BFLOAT16, sh->q, sh->q_st, "K");
    reshape(g, kt, k, "K");
    if (deterministic) {
        matmul(g, ds, k, dq, "dS K");
        return;
    }
    matmul(g, ds, k, dq_acc, "dS K");
    pointwise(g, CUDNN_POINTWISE_IDENTITY, dq_acc, NULL, NULL, dq, -1, "dQ = accumulator");
}

/* ------------------------------------------------------------------------------------------- */
/* plans, cached per shape                                                                     */

typedef struct {
    int used, backward, B, T, NH, HD; /* backward: 0 forward, 1 backward, 2 deterministic backward */
    int ok;                         /* 0: cuDNN has no plan for it (remembered, not retried) */
    cudnnBackendDescriptor_t plan;  /* when ok */
    Graph *graph;                   /* the descriptors the plan was built from, kept while it lives */
    size_t plan_ws;                 /* the plan's own workspace */
    size_t workspace;               /* all the call needs: the plan's, then Dsum and dQ's accumulator */
} Plan;

#define PLAN_CACHE 32
static Plan plans[PLAN_CACHE];
static int plan_next;

static void plan_free(Plan *p) {
    if (p->plan) dnn.cudnnBackendDestroyDescriptor(p->plan);
    if (p->graph) graph_free(p->graph), free(p->graph);
    memset(p, 0, sizeof *p);
}

static size_t round256(size_t n) { return (n + 255) & ~(size_t)255; }

/* The first engine cuDNN's heuristics (mode A) rank for the graph that finalizes into a plan. */
static cudnnBackendDescriptor_t build_plan(Graph *g, char *why, size_t whylen) {
    cudnnBackendDescriptor_t og = make(g, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
    set(g, og, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &dnn.handle, "operation graph");
    set(g, og, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, g->n_ops, g->ops, "operation graph");
    finalize(g, og, "operation graph");
    cudnnBackendDescriptor_t heur = make(g, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "heuristics");
    cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
    set_desc(g, heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, og, "heuristics");
    set(g, heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "heuristics");
    finalize(g, heur, "heuristics");
    if (g->status != CUDNN_STATUS_SUCCESS) {
        char last[256] = "";
        dnn.cudnnGetLastErrorString(last, sizeof last);
        snprintf(why, whylen, "%s: %s%s%s", g->failed, dnn.cudnnGetErrorString(g->status), *last ? "; " : "", last);
        return NULL;
    }
    int64_t n = 0;
    dnn.cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &n, NULL);
    if (n <= 0) {
        snprintf(why, whylen, "cuDNN's heuristics offer no engine for the graph");
        return NULL;
    }
    if (n > 16) n = 16;
    cudnnBackendDescriptor_t cfg[16];
    for (int64_t i = 0; i < n; i++) cfg[i] = make(g, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine config");
    if (g->status != CUDNN_STATUS_SUCCESS) {
        snprintf(why, whylen, "%s: %s", g->failed, dnn.cudnnGetErrorString(g->status));
        return NULL;
    }
    int64_t got = 0;
    cudnnStatus_t s = dnn.cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                                   n, &got, cfg);
    if (s != CUDNN_STATUS_SUCCESS || got <= 0) {
        if (s == CUDNN_STATUS_SUCCESS) snprintf(why, whylen, "cuDNN's heuristics offer no engine for this shape");
        else snprintf(why, whylen, "cuDNN's heuristics results: %s", dnn.cudnnGetErrorString(s));
        return NULL;
    }
    char last[256] = "";
    for (int64_t i = 0; i < got; i++) {
        cudnnBackendDescriptor_t plan = NULL;
        if (dnn.cudnnBackendCreateDescriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &plan) != CUDNN_STATUS_SUCCESS)
            continue;
        s = dnn.cudnnBackendSetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &dnn.handle);
        if (s == CUDNN_STATUS_SUCCESS)
            s = dnn.cudnnBackendSetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                                             CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfg[i]);
        if (s == CUDNN_STATUS_SUCCESS) s = dnn.cudnnBackendFinalize(plan);
        if (s == CUDNN_STATUS_SUCCESS) return plan;
        dnn.cudnnGetLastErrorString(last, sizeof last);
        dnn.cudnnBackendDestroyDescriptor(plan);
    }
    snprintf(why, whylen, "none of cuDNN's %d engines builds a plan: %s%s%s", (int)got, dnn.cudnnGetErrorString(s),
             *last ? "; " : "", last);
    return NULL;
}

static Plan *get_plan(int backward, int B, int T, int NH, int HD, char *why, size_t whylen) {
    char dummy[1];
    if (!why || !whylen) why = dummy, whylen = sizeof dummy;
    for (int i = 0; i < PLAN_CACHE; i++) {
        Plan *p = &plans[i];
        if (p->used && p->backward == backward && p->B == B && p->T == T && p->NH == NH && p->HD == HD) {
            if (!p->ok) snprintf(why, whylen, "cuDNN has no plan for this shape (found earlier)");
            return p->ok ? p : NULL;
        }
    }
    if (dnn_ready()) {
        snprintf(why, whylen, "%s", dnn.why);
        return NULL;
    }
    Plan *p = &plans[plan_next];
    plan_next = (plan_next + 1) % PLAN_CACHE;
    plan_free(p);
    p->used = 1, p->backward = backward, p->B = B, p->T = T, p->NH = NH, p->HD = HD;
    if (B <= 0 || T <= 0 || NH <= 0 || HD <= 0 || HD % 8) {
        snprintf(why, whylen, "head_dim %d is not a multiple of 8", HD);
        return NULL;
    }
    Graph *g = (Graph *)calloc(1, sizeof(Graph));
    if (!g) {
        snprintf(why, whylen, "out of host memory");
        return NULL;
    }
    g->next_uid = 100;
    Shapes sh;
    shapes(&sh, B, T, NH, HD);
    if (backward) backward_graph(g, &sh, backward == 2);
    else forward_graph(g, &sh);
    cudnnBackendDescriptor_t plan = build_plan(g, why, whylen);
    if (!plan) {
        graph_free(g), free(g);
        return NULL;
    }
    p->graph = g;
    int64_t ws = 0, n = 0;
    if (dnn.cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n, &ws) !=
            CUDNN_STATUS_SUCCESS ||
        ws < 0) {
        dnn.cudnnBackendDestroyDescriptor(plan);
        graph_free(g), free(g);
        p->graph = NULL;
        snprintf(why, whylen, "cannot read the plan's workspace size");
        return NULL;
    }
    p->ok = 1;
    p->plan = plan;
    p->plan_ws = round256((size_t)ws);
    p->workspace = p->plan_ws;
    if (backward) {
        size_t rows = (size_t)B * NH * T;
        p->workspace += round256(rows * sizeof(float)) + (backward == 1 ? rows * (size_t)HD * sizeof(float) : 0);
    }
    return p;
}

int attn_cudnn_forward_plan(int B, int T, int NH, int HD, size_t *workspace, char *why, size_t whylen) {
    Plan *p = get_plan(0, B, T, NH, HD, why, whylen);
    if (p && workspace) *workspace = p->workspace;
    return p ? 0 : -1;
}

int attn_cudnn_backward_plan(int B, int T, int NH, int HD, int deterministic, size_t *workspace, char *why,
                             size_t whylen) {
    Plan *p = get_plan(deterministic ? 2 : 1, B, T, NH, HD, why, whylen);
    if (p && workspace) *workspace = p->workspace;
    return p ? 0 : -1;
}

/* ------------------------------------------------------------------------------------------- */
/* execution                                                                                   */

static int execute(Plan *p, int n, const int64_t *uids, void **ptrs, void *workspace, void *stream) {
    if (dnn.cudnnSetStream(dnn.handle, (cudaStream_t)stream) != CUDNN_STATUS_SUCCESS) return -1;
    cudnnBackendDescriptor_t vp = NULL;
    if (dnn.cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &vp) != CUDNN_STATUS_SUCCESS) return -1;
    cudnnStatus_t s = dnn.cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids);
    if (s == CUDNN_STATUS_SUCCESS)
        s = dnn.cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n, ptrs);
    if (s == CUDNN_STATUS_SUCCESS)
        s = dnn.cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
    if (s == CUDNN_STATUS_SUCCESS) s = dnn.cudnnBackendFinalize(vp);
    if (s == CUDNN_STATUS_SUCCESS) s = dnn.cudnnBackendExecute(dnn.handle, p->plan, vp);
    dnn.cudnnBackendDestroyDescriptor(vp);
    if (s != CUDNN_STATUS_SUCCESS) {
        char last[256] = "";
        dnn.cudnnGetLastErrorString(last, sizeof last);
        fprintf(stderr, "meshtrain: cuda: cuDNN attention %s failed: %s%s%s\n", p->backward ? "backward" : "forward",
                dnn.cudnnGetErrorString(s), *last ? "; " : "", last);
        return -1;
    }
    return 0;
}

/* -inf masks the scores; cuDNN before 9.10 wanted the lowest float instead (as the frontend does) */
static float neg_inf_value(void) { return dnn.version < 91000 ? -FLT_MAX : -INFINITY; }

int attn_cudnn_forward(void *out, float *lse, const void *qkv, int B, int T, int NH, int HD, void *workspace,
                       void *stream) {
    Plan *p = get_plan(0, B, T, NH, HD, NULL, 0);
    if (!p) return -1;
    const size_t C = (size_t)NH * HD;
    float scale = 1.0f / sqrtf((float)HD), neg_inf = neg_inf_value();
    const int64_t uids[] = {U_Q, U_K, U_V, U_O, U_STATS, U_SCALE, U_NEG_INF};
    void *ptrs[] = {(void *)qkv, (char *)qkv + C * 2, (char *)qkv + 2 * C * 2, out, lse, &scale, &neg_inf};
    return execute(p, 7, uids, ptrs, workspace, stream);
}

int attn_cudnn_backward(void *dqkv, const void *dout, const void *qkv, const void *out, const float *lse, int B,
                        int T, int NH, int HD, int deterministic, void *workspace, void *stream) {
    Plan *p = get_plan(deterministic ? 2 : 1, B, T, NH, HD, NULL, 0);
    if (!p) return -1;
    const size_t C = (size_t)NH * HD, rows = (size_t)B * NH * T;
    char *dsum = (char *)workspace + p->plan_ws, *dq_acc = dsum + round256(rows * sizeof(float));
    /* before 9.6 the accumulator had to start at zero (the frontend cleared it) */
    if (!deterministic && dnn.version < 90600 &&
        cudaMemsetAsync(dq_acc, 0, rows * (size_t)HD * sizeof(float), (cudaStream_t)stream) != cudaSuccess)
        return -1;
    float scale = 1.0f / sqrtf((float)HD), neg_inf = neg_inf_value(), one = 1.0f;
    const int64_t uids[] = {U_Q, U_K, U_V, U_O, U_DO, U_STATS, U_SCALE, U_NEG_INF, U_ONE, U_DQ, U_DK, U_DV,
                            U_DSUM, U_DQ_ACC};
    void *ptrs[] = {(void *)qkv,
                    (char *)qkv + C * 2,
                    (char *)qkv + 2 * C * 2,
                    (void *)out,
                    (void *)dout,
                    (void *)lse,
                    &scale,
                    &neg_inf,
                    &one,
                    dqkv,
                    (char *)dqkv + C * 2,
                    (char *)dqkv + 2 * C * 2,
                    dsum,
                    dq_acc};
    return execute(p, deterministic ? 13 : 14, uids, ptrs, workspace, stream);
}

void attn_cudnn_shutdown(void) {
    if (!dnn.lib) return;
    for (int i = 0; i < PLAN_CACHE; i++) plan_free(&plans[i]);
    plan_next = 0;
    if (dnn.handle) dnn.cudnnDestroy(dnn.handle);
    dnn.handle = NULL;
}

#endif /* MESHTRAIN_NO_CUDNN */
