/* comm_p2p_ce — pipeline send/receive on the copy engines (pp_copy_engines=true, the default;
 * comm.h's comm_p2p_init): no SM is held while a stage's activations and their gradients
 * move, or while a stage waits for them. On four H100s every stage's kernels ran 8-12% slower
 * beside NCCL's send/receive kernels (which hold SMs and spin), and NCCL_P2P_USE_CUDA_MEMCPY=1
 * did not take them off; on the copy engines interleaved reached 0.99 of the bubble's
 * prediction (four H200s, 2026-11-28).
 *
 * A link carries messages one way, from its rank 0 to its rank 1. The receiver holds a ring
 * of R slots of the link's largest message and a counter the sender writes ("full": messages
 * delivered); the sender holds a counter the receiver writes ("consumed": messages copied
 * out). Each end maps the other's block (CUDA IPC) and only ever waits on its own counter.
 * Message n, on each end's own stream, after the compute stream's work so far:
 *   send:    wait consumed >= n - R + 1 (slot n % R is free); copy buf into the peer's slot
 *            n % R; write the peer's full := n + 1
 *   receive: wait full >= n + 1; copy slot n % R into buf; write the peer's consumed := n + 1
 * cudaMemcpyAsync between device buffers runs on a copy engine; the waits and writes are
 * stream memory operations (cuStreamWaitValue64 / cuStreamWriteValue64: comm_ipc.c's).
 * A write with the default flags is preceded by a memory fence (the v2 API has no other), so
 * the copy before it in the stream is visible to the peer first. Counters only grow, for the
 * life of the run, so the ring goes on across steps.
 *
 * Never hang: the compute stream waits for a receive on the device (comm_p2p_wait returns at
 * once), but the host still notices a peer that never sends, within comm_timeout: before it
 * queues receive n it waits for receive n - LAG (so it runs at most LAG receives ahead of
 * them), and comm_p2p_drain, at the optimizer step (step.c's free_all_slots) and before an
 * evaluation's loss is read, waits for all of them. A send completes, as NCCL's does, by
 * an event the host polls (comm_p2p_wait, step.c's slot_free).
 *
 * A stream blocked in a memory-op wait holds one of the device's hardware queues: train.c
 * sets CUDA_DEVICE_MAX_CONNECTIONS=32 (unless set) before the CUDA context is made, so the
 * waiting streams do not share a queue with (and block) other streams' work. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "comm_impl.h"
#include "env.h"
#include "util.h"

int comm_p2p_skip_copies(void) {
    static int v = -1;  /* (asked per message: read once) */
    if (v < 0) v = hook_on(HOOK_PP_SKIP_COPIES);
    return v;
}

/* LAG: the host queues receive n once receive n - LAG is complete (below R, whose events
 * record the last R receives): far enough ahead that the device never waits for the host's
 * queueing, near enough that it meets a timeout (comm_wait_until) before a wait with none
 * (the cuda backend's ring of 16 upload buffers, reused as its uploads complete) */
enum { R = COMM_P2P_CE_SLOTS, LAG = 2, CTR_BYTES = 256 };  /* CTR_BYTES: a block's counter, after its slots */
/* Each end's block is whole 2 MiB pages: cudaMalloc may place a smaller allocation inside a
 * larger block, and IPC then maps that block, the pointer the peer opens being its start
 * (the CUDA programming guide's interprocess communication); p2p_ce_init checks the mapping. */
#define BLOCK_ALIGN ((size_t)2 << 20)
static size_t slot_bytes(size_t msg) { return (msg + 255) & ~(size_t)255; }
static size_t block_bytes(size_t slots) { return (slots + CTR_BYTES + BLOCK_ALIGN - 1) / BLOCK_ALIGN * BLOCK_ALIGN; }

size_t comm_p2p_ce_bytes(size_t msg) { return block_bytes(R * slot_bytes(msg)) + block_bytes(0); }

int comm_p2p_on_copy_engines(const Comm *c) {
    if (!c->impl || !((CommImpl *)c->impl)->p2p_bytes) return -1;
#ifdef MESHTRAIN_NCCL
    return p2p_ce_on(c);
#else
    return 0;
#endif
}

#ifndef MESHTRAIN_NCCL
void comm_p2p_drain(const Comm *c) { (void)c; }
#else
#include <cuda.h>
#include "ops_cuda.h"
#include "trace.h"

typedef struct {
    int recv;             /* this end receives (the link's rank 1) */
    size_t slot;          /* bytes a slot */
    char *mine, *peer;    /* this end's block (cuda_malloc) and the other end's (IPC) */
    uint64_t n;           /* messages so far on this end */
    cudaEvent_t done[R];  /* receives: message k complete, in done[k % R] */
} P2pCe;

/* The counter in a block: after a receiver's slots, at a sender's start; a token beside it
 * (the 8 bytes after) says whose block a mapping shows. */
static char *counter(const P2pCe *p, char *block, int receiver) { return block + (receiver ? R * p->slot : 0); }

int p2p_ce_init(const Comm *c, size_t max_bytes) {
    const char *what = "pipeline send/receive set-up (pp_copy_engines=true)";
    CommImpl *ci = c->impl;
    uint64_t most = max_bytes;  /* both ends size the ring alike */
    comm_allreduce_max_u64(c, &most, 1);
    if (!most || c->size != 2 || !ipc_group_possible(c, what)) return 0;
    P2pCe *p = xcalloc(1, sizeof *p);
    p->recv = c->rank == 1;
    p->slot = slot_bytes((size_t)most);
    p->mine = cuda_malloc(block_bytes(p->recv ? R * p->slot : 0));
    /* the counter zeroed (before the peer can write it), and this block's token beside it */
    char *ctr = counter(p, p->mine, p->recv), *blocks[2];
    cchk(cudaMemset(ctr, 0, 8), c, what, "cudaMemset");
    if (!ipc_map_blocks(c, p->mine, (size_t)(ctr + 8 - p->mine), blocks, what)) {
        cuda_free(p->mine);
        free(p);
        return 0;
    }
    p->peer = blocks[1 - c->rank];
    for (int i = 0; i < R; i++)
        cchk(cudaEventCreateWithFlags(&p->done[i], cudaEventDisableTiming), c, what, "cudaEventCreate");
    ci->p2p_ce = p;
    g_ce_any = 1;  /* nccl_abort_all must not wait behind our streams' memory-op waits */
    return 1;
}

typedef struct { cudaEvent_t ev; const Comm *c; const char *what; } EvWait;
static int event_complete(void *arg) {
    EvWait *w = arg;
    cudaError_t e = cudaEventQuery(w->ev);
    if (e == cudaErrorNotReady) return 0;
    cchk(e, w->c, w->what, "cudaEventQuery");
    return 1;
}
/* The host waits for ev within comm_timeout (comm_wait_until ends the job after it). */
static void host_wait(const Comm *c, cudaEvent_t ev, const char *what) {
    EvWait w = {ev, c, what};
    comm_wait_until(event_complete, &w, c, what);
}

static P2pCe *ce_of(const Comm *c, int recv, size_t bytes, const char *what) {
    P2pCe *p = ((CommImpl *)c->impl)->p2p_ce;
    if (p->recv != recv || bytes > p->slot) {
        char msg[256];
        snprintf(msg, sizeof msg, "internal: rank %d: %s of %zu bytes on group %s, set up to %s up to %zu", g_comm_world_rank,
                 what, bytes, c->name, p->recv ? "receive" : "send", p->slot);
        comm_abort(EXIT_RUN_FAILURE, msg);
    }
    return p;
}

void p2p_ce_send(const Comm *c, const void *buf, size_t bytes, CommP2P *r, const char *what) {
    P2pCe *p = ce_of(c, 0, bytes, what);
    cudaStream_t s = p2p_stream(c, what);
    cudaEvent_t ev;
    cchk(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), c, what, "cudaEventCreate");
    p2p_after_compute(c, s, ev, what);  /* after what wrote buf */
    uint64_t n = p->n++;
    int span = trace_span_begin(s, "pipeline send", bytes);
    if (n >= R) ipc_wait64(s, counter(p, p->mine, 0), n - R + 1, c, what);
    if (!comm_p2p_skip_copies())
        cchk(cudaMemcpyAsync(p->peer + (n % R) * p->slot, buf, bytes, cudaMemcpyDefault, s), c, what, "cudaMemcpyAsync");
    ipc_write64(s, counter(p, p->peer, 1), n + 1, c, what);
    trace_span_end(s, span);
    cchk(cudaEventRecord(ev, s), c, what, "cudaEventRecord");
    *r = (CommP2P){NULL, c, what, (void *)ev};  /* comm_p2p_wait polls it, as NCCL's */
}

void p2p_ce_recv(const Comm *c, void *buf, size_t bytes, CommP2P *r, const char *what) {
    P2pCe *p = ce_of(c, 1, bytes, what);
    cudaStream_t s = p2p_stream(c, what);
    uint64_t n = p->n++;
    if (n >= LAG) host_wait(c, p->done[(n - LAG) % R], what);  /* a lost peer ends the job here */
    cudaEvent_t ev = p->done[n % R];
    p2p_after_compute(c, s, ev, what);  /* after the compute stream's last use of buf */
    int span = trace_span_begin(s, "pipeline receive", bytes);
    ipc_wait64(s, counter(p, p->mine, 1), n + 1, c, what);
    if (!comm_p2p_skip_copies())
        cchk(cudaMemcpyAsync(buf, p->mine + (n % R) * p->slot, bytes, cudaMemcpyDefault, s), c, what, "cudaMemcpyAsync");
    ipc_write64(s, counter(p, p->peer, 0), n + 1, c, what);
    trace_span_end(s, span);
    cchk(cudaEventRecord(ev, s), c, what, "cudaEventRecord");
    *r = (CommP2P){NULL, c, what, (void *)ev};
}

int p2p_ce_wait_device(CommP2P *r) {
    if (!r->c->impl || !p2p_ce_on(r->c) || !((P2pCe *)((CommImpl *)r->c->impl)->p2p_ce)->recv) return 0;
    cchk(cudaStreamWaitEvent((cudaStream_t)cuda_stream(), (cudaEvent_t)r->ev, 0), r->c, r->what, "cudaStreamWaitEvent");
    r->ev = NULL;  /* the link's own event, not the request's */
    return 1;
}

void comm_p2p_drain(const Comm *c) {
    P2pCe *p = c->impl ? ((CommImpl *)c->impl)->p2p_ce : NULL;
    if (p && p->recv && p->n) host_wait(c, p->done[(p->n - 1) % R], "pipeline receive");
}

void p2p_ce_release(const Comm *c) {
    CommImpl *ci = c->impl;
    P2pCe *p = ci->p2p_ce;
    if (!p) return;
    const char *what = "pipeline send/receive release";
    comm_p2p_drain(c);
    cchk(cudaStreamSynchronize((cudaStream_t)ci->p2p_stream), c, what, "cudaStreamSynchronize");
    comm_barrier(c);  /* neither end writes into the other's block any more */
    cchk(cudaIpcCloseMemHandle(p->peer), c, what, "cudaIpcCloseMemHandle");
    comm_barrier(c);  /* nor has it mapped */
    cuda_free(p->mine);
    for (int i = 0; i < R; i++) cudaEventDestroy(p->done[i]);
    cudaStreamDestroy((cudaStream_t)ci->p2p_stream);
    ci->p2p_stream = NULL;
    free(p);
    ci->p2p_ce = NULL;
}
#endif
