/* comm_nccl — the NCCL backend: float collectives on device buffers (device=cuda, groups
 * of more than one), one NCCL communicator per group made at its first collective, the
 * communication stream, the events that order it with the compute stream, and the abort of
 * every communicator before the job ends. */
#include "comm_impl.h"
#ifdef MESHTRAIN_NCCL
#include <stdio.h>
#include <string.h>
#include "ops_cuda.h"
#include "trace.h"
#include "util.h"

#define MAX_NCCL 64
static ncclComm_t g_nccl[MAX_NCCL];  /* every NCCL communicator made, to abort them all */
static int g_n_nccl;
cudaStream_t g_cstream;              /* the communication stream */

/* Before MPI_Abort on an error or a lost peer. Not with copy-engine collectives or pipeline
 * send/receive: they wait in the stream (memory-op waits) for flags that a lost peer never
 * writes, nothing aborts those waits, and ncclCommAbort would wait behind them; MPI_Abort
 * ends the process, and the driver frees the GPU with it. */
void nccl_abort_all(void) {
    if (g_ce_any) return;
    for (int i = 0; i < g_n_nccl; i++) ncclCommAbort(g_nccl[i]);
    g_n_nccl = 0;
}

_Noreturn void nccl_die(const Comm *c, const char *what, const char *call, const char *err) {
    char msg[512];
    snprintf(msg, sizeof msg, "rank %d: %s on group %s: %s failed: %s", g_comm_world_rank, what, c ? c->name : "world",
             call, err);
    nccl_abort_all();
    comm_abort(EXIT_RUN_FAILURE, msg);
}

void nchk(ncclResult_t rc, const Comm *c, const char *what, const char *call) {
    if (rc != ncclSuccess && rc != ncclInProgress) nccl_die(c, what, call, ncclGetErrorString(rc));
}

void cchk(cudaError_t e, const Comm *c, const char *what, const char *call) {
    if (e != cudaSuccess) nccl_die(c, what, call, cudaGetErrorString(e));
}

/* The group's NCCL communicator, made at its first collective: every rank of the group
 * starts its collectives in the same order, so all of them arrive here together. */
static ncclComm_t nccl_of(const Comm *c, const char *what) {
    CommImpl *ci = c->impl;
    return ci->nccl ? ci->nccl : nccl_make(c, what, 0);
}

/* cta_zero: NCCL runs what it can (the all-to-all and all-gather over symmetric windows) on
 * the copy engines, with no CTA (NCCL_CTA_POLICY_ZERO, NCCL 2.28 and later). */
ncclComm_t nccl_make(const Comm *c, const char *what, int cta_zero) {
    CommImpl *ci = c->impl;
    if (!g_cstream) {
        /* the highest priority: a collective's kernels start as soon as SMs free up, so the
         * gradient of the last units to finish (the exposed tail) is not queued behind compute */
        int least, greatest;
        cchk(cudaDeviceGetStreamPriorityRange(&least, &greatest), c, what, "cudaDeviceGetStreamPriorityRange");
        cchk(cudaStreamCreateWithPriority(&g_cstream, cudaStreamNonBlocking, greatest), c, what,
             "cudaStreamCreateWithPriority");
    }
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    if (c->rank == 0) nchk(ncclGetUniqueId(&id), c, what, "ncclGetUniqueId");
    comm_broadcast(c, &id, sizeof id, 0);
    ncclComm_t nc;
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
    if (cta_zero) cfg.CTAPolicy = NCCL_CTA_POLICY_ZERO;
#else
    (void)cta_zero;
#endif
    nchk(ncclCommInitRankConfig(&nc, c->size, id, c->rank, &cfg), c, what, "ncclCommInitRankConfig");
    if (g_n_nccl == MAX_NCCL) comm_abort(EXIT_RUN_FAILURE, "internal: too many NCCL communicators");
    g_nccl[g_n_nccl++] = nc;
    ci->nccl = nc;
    return nc;
}

void nccl_free(CommImpl *ci) {
    if (!ci->nccl) return;
    ce_release(ci, "communicator release");
    for (int i = 0; i < g_n_nccl; i++)
        if (g_nccl[i] == ci->nccl) { g_nccl[i] = g_nccl[--g_n_nccl]; break; }
    ncclCommDestroy(ci->nccl);
    ci->nccl = NULL;
    if (ci->p2p_stream) cudaStreamDestroy((cudaStream_t)ci->p2p_stream);
    ci->p2p_stream = NULL;
}

/* Before the collective: the comm stream waits for the compute stream's work so far (which
 * wrote the buffers). Returns the communicator. */
static ncclComm_t nccl_begin(const Comm *c, CommReq *r, const char *what) {
    memset(r, 0, sizeof *r);
    r->c = c; r->what = what; r->active = 1;
    ncclComm_t nc = nccl_of(c, what);
    cudaEvent_t ready;
    cchk(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), c, what, "cudaEventCreate");
    cchk(cudaEventRecord(ready, (cudaStream_t)cuda_stream()), c, what, "cudaEventRecord");
    cchk(cudaStreamWaitEvent(g_cstream, ready, 0), c, what, "cudaStreamWaitEvent");
    cchk(cudaEventDestroy(ready), c, what, "cudaEventDestroy");
    return nc;
}

/* After it: the event that says it is done. */
static void nccl_launched(CommReq *r) {
    cudaEvent_t done;
    cchk(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), r->c, r->what, "cudaEventCreate");
    cchk(cudaEventRecord(done, g_cstream), r->c, r->what, "cudaEventRecord");
    r->ev = (void *)done;
}

/* *ev, an event recorded after a collective or a send/receive on c: 0 while pending (an
 * asynchronous NCCL error ends the job); once done, later ops on the compute stream wait
 * for it (they see what arrived, may overwrite what left), it is destroyed and *ev
 * cleared: 1. */
static int event_done(const Comm *c, const char *what, void **evp) {
    cudaEvent_t ev = (cudaEvent_t)*evp;
    cudaError_t e = cudaEventQuery(ev);
    if (e == cudaErrorNotReady) {
        ncclResult_t async = ncclSuccess;
        ncclComm_t nc = ((CommImpl *)c->impl)->nccl;
        if (nc && ncclCommGetAsyncError(nc, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress)
            nccl_die(c, what, "NCCL (asynchronous error)", ncclGetErrorString(async));
        return 0;
    }
    cchk(e, c, what, "cudaEventQuery");
    cchk(cudaStreamWaitEvent((cudaStream_t)cuda_stream(), ev, 0), c, what, "cudaStreamWaitEvent");
    cchk(cudaEventDestroy(ev), c, what, "cudaEventDestroy");
    *evp = NULL;
    return 1;
}

int nccl_test(CommReq *r) {
    if (!event_done(r->c, r->what, &r->ev)) return 0;
    r->active = 0;
    return 1;
}

static void nccl_stream_wait(CommReq *r) {
    cchk(cudaStreamWaitEvent((cudaStream_t)cuda_stream(), (cudaEvent_t)r->ev, 0), r->c, r->what, "cudaStreamWaitEvent");
}

static void nccl_p2p_init(const Comm *c) { nccl_of(c, "pipeline send/receive"); }

cudaStream_t p2p_stream(const Comm *c, const char *what) {
    CommImpl *ci = c->impl;
    if (!ci->p2p_stream) {
        cudaStream_t s;
        cchk(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), c, what, "cudaStreamCreate");
        ci->p2p_stream = s;
    }
    return (cudaStream_t)ci->p2p_stream;
}

void p2p_after_compute(const Comm *c, cudaStream_t s, cudaEvent_t ev, const char *what) {
    cchk(cudaEventRecord(ev, (cudaStream_t)cuda_stream()), c, what, "cudaEventRecord");
    cchk(cudaStreamWaitEvent(s, ev, 0), c, what, "cudaStreamWaitEvent");
}

/* Point-to-point on device buffers: queued on the group's own p2p stream after the compute
 * stream's work so far; r->ev completes it (nccl_p2p_done). */
static void nccl_p2p(const Comm *c, void *buf, size_t bytes, int peer, int send, CommP2P *r, const char *what) {
    ncclComm_t nc = nccl_of(c, what);
    cudaStream_t s = p2p_stream(c, what);
    cudaEvent_t ev;
    cchk(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), c, what, "cudaEventCreate");
    p2p_after_compute(c, s, ev, what);  /* after what wrote buf */
    int span = trace_span_begin(s, send ? "pipeline send" : "pipeline receive", bytes);
    if (send) nchk(ncclSend(buf, bytes, ncclUint8, peer, nc, s), c, what, "ncclSend");
    else nchk(ncclRecv(buf, bytes, ncclUint8, peer, nc, s), c, what, "ncclRecv");
    trace_span_end(s, span);
    cchk(cudaEventRecord(ev, s), c, what, "cudaEventRecord");
    *r = (CommP2P){NULL, c, what, (void *)ev};
}

static int nccl_p2p_done(void *arg) {
    CommP2P *r = arg;
    return event_done(r->c, r->what, &r->ev);
}

static ncclRedOp_t nccl_op(CommOp op) { return op == COMM_AVG ? ncclAvg : ncclSum; }

/* comm_iallreduce, comm_ireduce_scatter and comm_iallgather on an NCCL group: queued on the
 * comm stream after the compute stream's work so far, with the event that completes the
 * request. */
static void nccl_iallreduce(const Comm *c, void *buf, size_t n, CommType t, CommOp op, CommReq *r, const char *what) {
    ncclComm_t nc = nccl_begin(c, r, what);
    int span = trace_span_begin(g_cstream, what, n * type_size(t));
#if HAVE_CE
    if (!ce_allreduce(c, buf, n, t, op, nc, what))
#endif
        nchk(ncclAllReduce(buf, buf, n, nccl_type(t), nccl_op(op), nc, g_cstream), c, what, "ncclAllReduce");
    trace_span_end(g_cstream, span);
    nccl_launched(r);
}

static void nccl_ireduce_scatter(const Comm *c, void *send, void *recv, size_t recv_n, CommType t, CommOp op, CommReq *r,
                                 const char *what) {
    ncclComm_t nc = nccl_begin(c, r, what);
    int span = trace_span_begin(g_cstream, what, recv_n * (size_t)c->size * type_size(t));
    nchk(ncclReduceScatter(send, recv, recv_n, nccl_type(t), nccl_op(op), nc, g_cstream), c, what, "ncclReduceScatter");
    trace_span_end(g_cstream, span);
    nccl_launched(r);
}

static void nccl_iallgather(const Comm *c, void *buf, size_t n, CommType t, CommReq *r, const char *what) {
    /* in place: this rank's block is the send buffer */
    ncclComm_t nc = nccl_begin(c, r, what);
    int span = trace_span_begin(g_cstream, what, n * (size_t)c->size * type_size(t));
    nchk(ncclAllGather((char *)buf + (size_t)c->rank * n * type_size(t), buf, n, nccl_type(t), nc, g_cstream), c, what,
         "ncclAllGather");
    trace_span_end(g_cstream, span);
    nccl_launched(r);
}

/* ---- the table (comm_impl.h's CommBackend): NCCL's collectives and send/receive, with the
 * group-side paths beside them (the copy-engine all-reduce inside nccl_iallreduce; a
 * two-rank link's messages over mapped memory, comm_p2p_ce.c, where p2p_init set one up) ---- */

static void nccl_wait_device(CommReq *r) {
    if (r->ev) nccl_stream_wait(r);
    else comm_wait(r);
}

static void nccl_isend(const Comm *c, const void *buf, size_t bytes, int peer, int tag, CommP2P *r, const char *what) {
    (void)tag;  /* (NCCL's messages on a group arrive in the order sent) */
    if (p2p_ce_on(c)) p2p_ce_send(c, buf, bytes, r, what);
    else nccl_p2p(c, (void *)buf, bytes, peer, 1, r, what);
}

static void nccl_irecv(const Comm *c, void *buf, size_t bytes, int peer, int tag, CommP2P *r, const char *what) {
    (void)tag;
    if (p2p_ce_on(c)) p2p_ce_recv(c, buf, bytes, r, what);
    else nccl_p2p(c, buf, bytes, peer, 0, r, what);
}

static void nccl_p2p_setup(const Comm *c, size_t max_bytes, int copy_engines) {
    if (!(copy_engines && p2p_ce_init(c, max_bytes))) nccl_p2p_init(c);
}

static void nccl_p2p_wait(CommP2P *r) {
    if (p2p_ce_wait_device(r)) return;  /* a copy-engine receive: on the device */
    comm_wait_until(nccl_p2p_done, r, r->c, r->what);
}

static void nccl_release(const Comm *c) {
    p2p_ce_release(c);
    nccl_free(c->impl);
}

const CommBackend comm_nccl_backend = {"nccl", nccl_iallreduce, nccl_ireduce_scatter, nccl_iallgather, nccl_test,
                                       nccl_wait_device, nccl_isend, nccl_irecv, nccl_p2p_setup, nccl_p2p_wait,
                                       nccl_release};
#endif
