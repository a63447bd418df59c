/* comm_ipc — a block of device memory on every rank of a group, mapped by every other rank
 * (CUDA IPC), with 64-bit counters that the others write and the owner's compute stream
 * waits on: stream memory operations (cuStreamWaitValue64 / cuStreamWriteValue64, the
 * driver's, taken by entry point as wgmma_util.cuh takes cuTensorMapEncodeTiled's: libcuda
 * is not linked), so no SM is held while a rank waits. Tensor parallel's fused sums
 * (tensor.c) copy a product's rows into the rank that owns them; the pipeline's
 * copy-engine send/receive (comm_p2p_ce.c) shares the memory operations and the checks.
 *
 * Each block is whole 2 MiB pages: cudaMalloc may place a smaller allocation inside a larger
 * block, and IPC then maps that block, the pointer the peer opens being its start (the CUDA
 * programming guide's interprocess communication); the open checks each mapping by a token
 * written beside the counters. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "comm_impl.h"
#include "util.h"

#define PAGE ((size_t)2 << 20)
static size_t data_bytes(size_t bytes) { return (bytes + 255) & ~(size_t)255; }

size_t comm_ipc_bytes(size_t bytes, int n_ctr) {
    return (data_bytes(bytes) + ((size_t)n_ctr + 1) * 8 + PAGE - 1) / PAGE * PAGE;
}

#ifndef MESHTRAIN_NCCL
CommIpc *comm_ipc_open(const Comm *c, size_t bytes, int n_ctr, const char *what) {
    (void)c, (void)bytes, (void)n_ctr, (void)what;
    return NULL;
}
char *comm_ipc_block(const CommIpc *w, int rank) { (void)w, (void)rank; return NULL; }
void comm_ipc_set(const CommIpc *w, int side, int rank, int i, uint64_t v) { (void)w, (void)side, (void)rank, (void)i, (void)v; }
void comm_ipc_wait(const CommIpc *w, int side, int i, uint64_t v) { (void)w, (void)side, (void)i, (void)v; }
void comm_ipc_mark(const CommIpc *w, int side, CommReq *r, const char *what) { (void)w, (void)side, (void)r, (void)what; }
void comm_ipc_side_after_compute(const CommIpc *w) { (void)w; }
void comm_ipc_record(const CommIpc *w, int from, int k) { (void)w, (void)from, (void)k; }
void comm_ipc_await(const CommIpc *w, int to, int k) { (void)w, (void)to, (void)k; }
void comm_ipc_side_copy(const CommIpc *w, int side, void *dst, const void *src, size_t bytes) {
    (void)w, (void)side, (void)dst, (void)src, (void)bytes;
}
void comm_ipc_close(CommIpc *w) { (void)w; }
#else
#include <cuda.h>
#include "ops_cuda.h"
#include "trace.h"

typedef CUresult (*MemOp64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
static MemOp64 g_wait64, g_write64;

static void *driver_fn(const char *name) {
    void *p = NULL;
    enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
        cudaGetLastError();
        return NULL;
    }
    return p;
}

/* The driver's stream memory operations, where device dev runs 64-bit ones. */
static int memops_ok(int dev) {
    CUresult (*get)(CUdevice *, int) = (CUresult (*)(CUdevice *, int))driver_fn("cuDeviceGet");
    CUresult (*attr)(int *, CUdevice_attribute, CUdevice) =
        (CUresult (*)(int *, CUdevice_attribute, CUdevice))driver_fn("cuDeviceGetAttribute");
    g_wait64 = (MemOp64)driver_fn("cuStreamWaitValue64");
    g_write64 = (MemOp64)driver_fn("cuStreamWriteValue64");
    CUdevice d;
    int on = 0;
    return get && attr && g_wait64 && g_write64 && get(&d, dev) == CUDA_SUCCESS &&
           attr(&on, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, d) == CUDA_SUCCESS && on;
}

static void mchk(CUresult rc, const Comm *c, const char *what, const char *call) {
    if (rc == CUDA_SUCCESS) return;
    char err[32];
    snprintf(err, sizeof err, "CUresult %d", (int)rc);
    nccl_die(c, what, call, err);
}

void ipc_wait64(void *stream, const void *ctr, uint64_t v, const Comm *c, const char *what) {
    mchk(g_wait64((CUstream)stream, (CUdeviceptr)(uintptr_t)ctr, v, CU_STREAM_WAIT_VALUE_GEQ), c, what,
         "cuStreamWaitValue64");
}
/* (the default flags put a memory fence before the write, so what the stream wrote before
 * it, here or in the peer's memory, is visible to the peer first) */
void ipc_write64(void *stream, void *ctr, uint64_t v, const Comm *c, const char *what) {
    mchk(g_write64((CUstream)stream, (CUdeviceptr)(uintptr_t)ctr, v, CU_STREAM_WRITE_VALUE_DEFAULT), c, what,
         "cuStreamWriteValue64");
}

int ipc_agreed(const Comm *c, int ok, const char *what) {
    (void)what;
    comm_allreduce_min_int(c, &ok, 1);
    return ok;
}

int ipc_group_possible(const Comm *c, const char *what) {
    int dev, can = 1;
    cchk(cudaGetDevice(&dev), c, what, "cudaGetDevice");
    int ok = comm_one_machine(c) && memops_ok(dev);
    char (*bus)[32] = xcalloc((size_t)c->size, sizeof *bus);
    cchk(cudaDeviceGetPCIBusId(bus[c->rank], (int)sizeof bus[0], dev), c, what, "cudaDeviceGetPCIBusId");
    comm_allgather_bytes(c, bus, sizeof bus[0]);
    for (int i = 0; ok && i < c->size; i++) {
        int peer = -1;
        if (i == c->rank) continue;
        if (cudaDeviceGetByPCIBusId(&peer, bus[i]) != cudaSuccess) ok = 0;
        else if (peer != dev) ok = cudaDeviceCanAccessPeer(&can, dev, peer) == cudaSuccess && can;
    }
    cudaGetLastError();
    free(bus);
    return ipc_agreed(c, ok, what);
}

int ipc_map_blocks(const Comm *c, char *mine, size_t token_at, char **blocks, const char *what) {
    typedef struct { cudaIpcMemHandle_t h; uint64_t token, at; } Ex;
    Ex *x = xcalloc((size_t)c->size, sizeof *x);
    x[c->rank].token = ((uint64_t)getpid() << 20) ^ (uint64_t)(uintptr_t)mine ^ 0x9e3779b97f4a7c15u;
    x[c->rank].at = token_at;
    cchk(cudaMemcpy(mine + token_at, &x[c->rank].token, 8, cudaMemcpyHostToDevice), c, what, "cudaMemcpy");
    cchk(cudaDeviceSynchronize(), c, what, "cudaDeviceSynchronize");  /* (the counters zeroed before too) */
    cchk(cudaIpcGetMemHandle(&x[c->rank].h, mine), c, what, "cudaIpcGetMemHandle");
    comm_allgather_bytes(c, x, sizeof x[0]);
    int ok = 1;
    for (int i = 0; i < c->size; i++) {
        blocks[i] = i == c->rank ? mine : NULL;
        if (i == c->rank || !ok) continue;
        void *p = NULL;
        uint64_t seen = 0;
        if (cudaIpcOpenMemHandle(&p, x[i].h, cudaIpcMemLazyEnablePeerAccess) == cudaSuccess) {
            blocks[i] = p;
            /* the mapping shows the peer's block where its token is */
            ok = cudaMemcpy(&seen, (char *)p + x[i].at, 8, cudaMemcpyDeviceToHost) == cudaSuccess && seen == x[i].token;
        } else ok = 0;
    }
    cudaGetLastError();
    free(x);
    if (ipc_agreed(c, ok, what)) return 1;
    for (int i = 0; i < c->size; i++)
        if (i != c->rank && blocks[i]) cudaIpcCloseMemHandle(blocks[i]);
    cudaGetLastError();
    return 0;
}

struct CommIpc {
    const Comm *c;
    const char *what;
    size_t ctr_at;  /* where the counters start in a block */
    int n_ctr;
    char **block;   /* per rank: its block as this rank addresses it (own: cuda_malloc; others: IPC) */
    cudaStream_t *side; /* side streams 1 .. size - 1 (side[s - 1]), copies beside the compute stream */
    cudaEvent_t ev;     /* the compute stream's work so far, for the side streams */
    cudaEvent_t fence[COMM_IPC_FENCES];  /* comm_ipc_record and _await's, made at the first use */
};

static uint64_t *ctr_of(const CommIpc *w, int rank, int i) {
    return (uint64_t *)(void *)(w->block[rank] + w->ctr_at + (size_t)i * 8);
}

CommIpc *comm_ipc_open(const Comm *c, size_t bytes, int n_ctr, const char *what) {
    if (!c->impl || ops_host_memory() || c->size < 2 || !ipc_group_possible(c, what)) return NULL;
    CommIpc *w = xcalloc(1, sizeof *w);
    w->c = c, w->what = what, w->n_ctr = n_ctr, w->ctr_at = data_bytes(bytes);
    w->block = xcalloc((size_t)c->size, sizeof *w->block);
    char *mine = cuda_malloc(comm_ipc_bytes(bytes, n_ctr));
    /* the counters zeroed (before any peer can write them), the token after them */
    cchk(cudaMemset(mine + w->ctr_at, 0, (size_t)n_ctr * 8), c, what, "cudaMemset");
    if (!ipc_map_blocks(c, mine, w->ctr_at + (size_t)n_ctr * 8, w->block, what)) {
        cuda_free(mine);
        free(w->block);
        free(w);
        return NULL;
    }
    g_ce_any = 1;  /* nccl_abort_all must not wait behind the compute stream's memory-op waits */
    return w;
}

char *comm_ipc_block(const CommIpc *w, int rank) { return w->block[rank]; }

/* Stream `side`: the compute stream (0), or side stream side (1 .. size, made with the
 * others at the first use: 1 .. size - 1 one a peer, so that copies to and from different
 * peers run on different copy engines at once; size for copies in an order of their own). */
static cudaStream_t stream_of(const CommIpc *w, int side) {
    if (!side) return (cudaStream_t)cuda_stream();
    CommIpc *m = (CommIpc *)w;
    if (side < 0 || side > w->c->size) {
        char msg[160];
        snprintf(msg, sizeof msg, "internal: %s: side stream %d of %d", w->what, side, w->c->size);
        comm_abort(EXIT_RUN_FAILURE, msg);
    }
    if (!m->side) {
        m->side = xcalloc((size_t)w->c->size, sizeof *m->side);
        for (int i = 0; i < w->c->size; i++)
            cchk(cudaStreamCreateWithFlags(&m->side[i], cudaStreamNonBlocking), w->c, w->what, "cudaStreamCreate");
        cchk(cudaEventCreateWithFlags(&m->ev, cudaEventDisableTiming), w->c, w->what, "cudaEventCreate");
    }
    return m->side[side - 1];
}

void comm_ipc_set(const CommIpc *w, int side, int rank, int i, uint64_t v) {
    ipc_write64(stream_of(w, side), ctr_of(w, rank, i), v, w->c, w->what);
}

void comm_ipc_wait(const CommIpc *w, int side, int i, uint64_t v) {
    cudaStream_t s = stream_of(w, side);
    /* on the timeline (MESHTRAIN_TIMELINE), the compute stream's waits: what stays exposed */
    int span = side ? -1 : trace_span_begin(s, "tensor-parallel wait", 0);
    ipc_wait64(s, ctr_of(w, w->c->rank, i), v, w->c, w->what);
    trace_span_end(s, span);
}

void comm_ipc_mark(const CommIpc *w, int side, CommReq *r, const char *what) {
    cudaEvent_t ev;
    cchk(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), w->c, what, "cudaEventCreate");
    cchk(cudaEventRecord(ev, stream_of(w, side)), w->c, what, "cudaEventRecord");
    *r = (CommReq){.c = w->c, .active = 1, .what = what, .ev = (void *)ev};
}

void comm_ipc_side_after_compute(const CommIpc *w) {
    stream_of(w, 1);  /* (made) */
    cchk(cudaEventRecord(w->ev, (cudaStream_t)cuda_stream()), w->c, w->what, "cudaEventRecord");
    for (int i = 0; i < w->c->size; i++)
        cchk(cudaStreamWaitEvent(w->side[i], w->ev, 0), w->c, w->what, "cudaStreamWaitEvent");
}

static cudaEvent_t fence_of(const CommIpc *w, int k) {
    CommIpc *m = (CommIpc *)w;
    if (k < 0 || k >= COMM_IPC_FENCES) {
        char msg[160];
        snprintf(msg, sizeof msg, "internal: %s: fence %d of %d", w->what, k, COMM_IPC_FENCES);
        comm_abort(EXIT_RUN_FAILURE, msg);
    }
    if (!m->fence[k]) cchk(cudaEventCreateWithFlags(&m->fence[k], cudaEventDisableTiming), w->c, w->what, "cudaEventCreate");
    return m->fence[k];
}

void comm_ipc_record(const CommIpc *w, int from, int k) {
    cchk(cudaEventRecord(fence_of(w, k), stream_of(w, from)), w->c, w->what, "cudaEventRecord");
}

void comm_ipc_await(const CommIpc *w, int to, int k) {
    cchk(cudaStreamWaitEvent(stream_of(w, to), fence_of(w, k), 0), w->c, w->what, "cudaStreamWaitEvent");
}

void comm_ipc_side_copy(const CommIpc *w, int side, void *dst, const void *src, size_t bytes) {
    cchk(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_of(w, side)), w->c, w->what, "cudaMemcpyAsync");
}

void comm_ipc_close(CommIpc *w) {
    if (!w) return;
    const Comm *c = w->c;
    ops_synchronize();
    if (w->side) {
        for (int i = 0; i < c->size; i++) {
            cchk(cudaStreamSynchronize(w->side[i]), c, w->what, "cudaStreamSynchronize");
            cudaStreamDestroy(w->side[i]);
        }
        free(w->side);
        cudaEventDestroy(w->ev);
    }
    for (int k = 0; k < COMM_IPC_FENCES; k++)
        if (w->fence[k]) cudaEventDestroy(w->fence[k]);
    comm_barrier(c);  /* no rank writes into another's block any more */
    for (int i = 0; i < c->size; i++)
        if (i != c->rank) cchk(cudaIpcCloseMemHandle(w->block[i]), c, w->what, "cudaIpcCloseMemHandle");
    comm_barrier(c);  /* nor has it mapped */
    cuda_free(w->block[c->rank]);
    free(w->block);
    free(w);
}
#endif
