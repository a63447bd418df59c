/* comm_mpi — the MPI backend: all-reduce, reduce-scatter and all-gather as rings over
 * point-to-point messages, moved chunk by chunk (CommReq; a group of one takes the same
 * request with no messages), and the blocking host collectives (doubles, ints, bytes,
 * barrier), which keep every ring in flight moving while they wait. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "comm_impl.h"
#include "trace.h"
#include "util.h"

/* Counts travel as int. */
static int count_of(size_t n, const Comm *c, const char *what) {
    if (n > (size_t)0x7fffffff) {
        char msg[256];
        snprintf(msg, sizeof msg, "rank %d: %s of %zu elements on group %s exceeds MPI's count limit",
                 g_comm_world_rank, what, n, c->name);
        comm_abort(EXIT_RUN_FAILURE, msg);
    }
    return (int)n;
}

#define CHUNK ((size_t)1 << 18)  /* floats per message: 1 MiB */

static size_t blk_lo(const CommReq *r, int b) { return (size_t)b * r->n; }
static size_t blk_len(const CommReq *r, int b) {
    size_t lo = blk_lo(r, b);
    return lo >= r->total ? 0 : (r->total - lo < r->n ? r->total - lo : r->n);
}
static size_t n_chunks(size_t len) { return (len + CHUNK - 1) / CHUNK; }
static int mod(int a, int d) { return ((a % d) + d) % d; }

/* Blocks this rank sends and receives at `step` of the phase: reduce-scatter (phase 0)
 * moves partial sums to the right until rank b holds block b; all-gather (phase 1) then
 * passes the finished blocks around the ring. */
static void ring_blocks(const CommReq *r, int *sb, int *rb) {
    int R = r->c->rank, D = r->c->size;
    if (r->phase == 0) { *sb = mod(R - r->step - 1, D); *rb = mod(R - r->step - 2, D); }
    else { *sb = mod(R - r->step, D); *rb = mod(R - r->step - 1, D); }
}

/* Every collective in flight. A ring moves only when its rank posts the next chunk, so
 * waiting on one must also move all the others: a peer may be waiting on another one. */
#define MAX_ACTIVE 1024
static CommReq *g_active[MAX_ACTIVE];
static int g_n_active;

static void track(CommReq *r) {
    if (g_n_active == MAX_ACTIVE) comm_abort(EXIT_RUN_FAILURE, "internal: too many collectives in flight");
    g_active[g_n_active++] = r;
}

static void untrack(CommReq *r) {
    for (int i = 0; i < g_n_active; i++)
        if (g_active[i] == r) { g_active[i] = g_active[--g_n_active]; return; }
}

static void req_begin(const Comm *c, CommReq *r, int kind, void *buf, void *out, size_t n, size_t total, CommType t,
                      CommOp op, const char *what) {
    memset(r, 0, sizeof *r);
    r->c = c; r->kind = kind; r->buf = buf; r->out = out; r->n = n; r->total = total; r->what = what;
    r->esz = type_size(t);
    /* The rings add and scale in fp32 on the host; bf16 buffers live on a GPU, where
     * NCCL moves them (comm_nccl.c), and a group of one only copies. */
    if (c->impl && t != COMM_F32) die(EXIT_RUN_FAILURE, "internal: %s: bf16 collectives need NCCL", what);
    r->avg = op == COMM_AVG;
    r->phase = kind == K_ALLGATHER ? 1 : 0;
    r->active = 1;
    if (!c->impl) return;
    CommImpl *ci = c->impl;
    r->tag = (int)(ci->seq++ % 30000u) + 1;
    track(r);
    r->sreq = xmalloc(sizeof(MPI_Request));
    r->rreq = xmalloc(sizeof(MPI_Request));
    if (r->phase == 0) r->stage = xmalloc(CHUNK * sizeof(float));
}

static void scale_block(CommReq *r, int b) {
    float s = 1.0f / (float)r->c->size, *p = r->buf + blk_lo(r, b);
    for (size_t i = 0, len = blk_len(r, b); i < len; i++) p[i] *= s;
}

static void req_end(CommReq *r) {
    if (r->c->impl) {
        int R = r->c->rank;
        if (r->kind == K_REDUCE_SCATTER) {
            if (r->avg) scale_block(r, R);
            if (r->out != r->buf + blk_lo(r, R)) memcpy(r->out, r->buf + blk_lo(r, R), r->n * sizeof(float));
        }
    } else if (r->kind == K_REDUCE_SCATTER) {
        /* A group of one: the buffers may be device memory (a one-GPU run), so the copy goes
         * through the ops backend, in order with the ops that filled buf. */
        op_copy(r->out, r->buf, r->n * r->esz);
    }
    if (r->sreq) untrack(r);
    free(r->stage); free(r->sreq); free(r->rreq);
    r->stage = NULL; r->sreq = r->rreq = NULL;
    r->active = 0;
}
/* Posts the messages of the current chunk, or moves to the next step or phase; returns 1
 * when the collective is complete. */
static int ring_post(CommReq *r) {
    int D = r->c->size, R = r->c->rank;
    for (;;) {
        int sb, rb;
        ring_blocks(r, &sb, &rb);
        size_t ns = n_chunks(blk_len(r, sb)), nr = n_chunks(blk_len(r, rb));
        if ((size_t)r->chunk < (ns > nr ? ns : nr)) break;
        r->chunk = 0;
        if (++r->step < D - 1) continue;
        if (r->phase == 1 || r->kind == K_REDUCE_SCATTER) return 1;
        if (r->avg) scale_block(r, R);  /* all-reduce: the finished block, before it travels */
        r->phase = 1;
        r->step = 0;
    }
    int sb, rb;
    ring_blocks(r, &sb, &rb);
    size_t c0 = (size_t)r->chunk * CHUNK, sl = blk_len(r, sb), rl = blk_len(r, rb);
    size_t slen = c0 < sl ? (sl - c0 < CHUNK ? sl - c0 : CHUNK) : 0, rlen = c0 < rl ? (rl - c0 < CHUNK ? rl - c0 : CHUNK) : 0;
    float *rdst = r->phase == 0 ? r->stage : r->buf + blk_lo(r, rb) + c0;
    g_comm_bytes_sent += slen * sizeof(float);
    comm_check(MPI_Isend(r->buf + blk_lo(r, sb) + c0, (int)slen, MPI_FLOAT, mod(R + 1, D), r->tag, mpi(r->c), r->sreq),
          r->c, r->what);
    comm_check(MPI_Irecv(rdst, (int)rlen, MPI_FLOAT, mod(R - 1, D), r->tag, mpi(r->c), r->rreq), r->c, r->what);
    r->posted = 1;
    return 0;
}

static int ring_advance(CommReq *r) {
    if (!r->active) return 1;
    for (;;) {
        if (r->posted) {
            int ds = 0, dr = 0;
            comm_check(MPI_Test(r->sreq, &ds, MPI_STATUS_IGNORE), r->c, r->what);
            comm_check(MPI_Test(r->rreq, &dr, MPI_STATUS_IGNORE), r->c, r->what);
            if (!ds || !dr) return 0;
            if (r->phase == 0) {  /* add the received partial sums into our copy */
                int sb, rb;
                ring_blocks(r, &sb, &rb);
                size_t c0 = (size_t)r->chunk * CHUNK, rl = blk_len(r, rb);
                size_t len = c0 < rl ? (rl - c0 < CHUNK ? rl - c0 : CHUNK) : 0;
                float *dst = r->buf + blk_lo(r, rb) + c0;
                for (size_t i = 0; i < len; i++) dst[i] += r->stage[i];
            }
            r->posted = 0;
            r->chunk++;
        }
        if (ring_post(r)) { req_end(r); return 1; }
    }
}

static int ring_test(CommReq *r) {
    for (int i = g_n_active - 1; i >= 0; i--)
        if (i < g_n_active && g_active[i] != r) ring_advance(g_active[i]);
    return ring_advance(r);
}

/* A plain MPI request (a peer may need one of our rings to move before it can reach the
 * call this request belongs to, so the rings move too). */
typedef struct { MPI_Request *q; const Comm *c; const char *what; } Plain;

static int plain_done(void *arg) {
    Plain *p = arg;
    for (int i = g_n_active - 1; i >= 0; i--)
        if (i < g_n_active) ring_advance(g_active[i]);
    int done = 0;
    comm_check(MPI_Test(p->q, &done, MPI_STATUS_IGNORE), p->c, p->what);
    return done;
}

static void blocking(const Comm *c, int rc, MPI_Request *q, const char *what) {
    comm_check(rc, c, what);
    Plain p = {q, c, what};
    comm_wait_until(plain_done, &p, c, what);
    free(q);
}

void comm_allreduce_double(const Comm *c, double *buf, size_t n) {
    if (!c->impl) return;
    MPI_Request *q = xmalloc(sizeof *q);
    blocking(c, MPI_Iallreduce(MPI_IN_PLACE, buf, count_of(n, c, "all-reduce"), MPI_DOUBLE, MPI_SUM, mpi(c), q), q,
             "all-reduce");
}

void comm_allreduce_max_int(const Comm *c, int *buf, size_t n) {
    if (!c->impl) return;
    MPI_Request *q = xmalloc(sizeof *q);
    blocking(c, MPI_Iallreduce(MPI_IN_PLACE, buf, count_of(n, c, "all-reduce"), MPI_INT, MPI_MAX, mpi(c), q), q,
             "all-reduce");
}

void comm_allreduce_min_int(const Comm *c, int *buf, size_t n) {
    if (!c->impl) return;
    MPI_Request *q = xmalloc(sizeof *q);
    blocking(c, MPI_Iallreduce(MPI_IN_PLACE, buf, count_of(n, c, "all-reduce"), MPI_INT, MPI_MIN, mpi(c), q), q,
             "all-reduce");
}

void comm_allreduce_max_u64(const Comm *c, uint64_t *buf, size_t n) {
    if (!c->impl) return;
    MPI_Request *q = xmalloc(sizeof *q);
    blocking(c, MPI_Iallreduce(MPI_IN_PLACE, buf, count_of(n, c, "all-reduce"), MPI_UINT64_T, MPI_MAX, mpi(c), q), q,
             "all-reduce");
}

void comm_allgather_bytes(const Comm *c, void *buf, size_t each) {
    if (!c->impl) return;
    MPI_Request *q = xmalloc(sizeof *q);
    blocking(c, MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, count_of(each, c, "all-gather"), MPI_BYTE,
                               mpi(c), q), q, "all-gather");
}

void comm_broadcast(const Comm *c, void *buf, size_t bytes, int root) {
    if (!c->impl) return;
    MPI_Request *q = xmalloc(sizeof *q);
    blocking(c, MPI_Ibcast(buf, count_of(bytes, c, "broadcast"), MPI_BYTE, root, mpi(c), q), q, "broadcast");
}

void comm_send(const Comm *c, const void *buf, size_t bytes, int peer, int tag) {
    if (!c->impl) return;
    MPI_Request *q = xmalloc(sizeof *q);
    g_comm_bytes_sent += bytes;
    blocking(c, MPI_Isend(buf, count_of(bytes, c, "send"), MPI_BYTE, peer, tag, mpi(c), q), q, "send");
}

void comm_recv(const Comm *c, void *buf, size_t bytes, int peer, int tag) {
    if (!c->impl) return;
    MPI_Request *q = xmalloc(sizeof *q);
    blocking(c, MPI_Irecv(buf, count_of(bytes, c, "recv"), MPI_BYTE, peer, tag, mpi(c), q), q, "recv");
}

static void mpi_isend(const Comm *c, const void *buf, size_t bytes, int peer, int tag, CommP2P *r, const char *what) {
    MPI_Request *q = xmalloc(sizeof *q);
    g_comm_bytes_sent += bytes;
    comm_check(MPI_Isend(buf, count_of(bytes, c, what), MPI_BYTE, peer, tag, mpi(c), q), c, what);
    r->q = q;
}

static void mpi_irecv(const Comm *c, void *buf, size_t bytes, int peer, int tag, CommP2P *r, const char *what) {
    MPI_Request *q = xmalloc(sizeof *q);
    comm_check(MPI_Irecv(buf, count_of(bytes, c, what), MPI_BYTE, peer, tag, mpi(c), q), c, what);
    r->q = q;
}

static void mpi_p2p_init(const Comm *c, size_t max_bytes, int copy_engines) { (void)c, (void)max_bytes, (void)copy_engines; }

static void mpi_p2p_wait(CommP2P *r) {
    if (!r->q) return;
    Plain p = {r->q, r->c, r->what};
    comm_wait_until(plain_done, &p, r->c, r->what);
    free(r->q);
    r->q = NULL;
}

void comm_barrier(const Comm *c) {
    if (!c->impl) return;
    MPI_Request *q = xmalloc(sizeof *q);
    blocking(c, MPI_Ibarrier(mpi(c), q), q, "barrier");
}

/* ---- the table (comm_impl.h's CommBackend) ---- */

static void mpi_iallreduce(const Comm *c, void *buf, size_t n, CommType t, CommOp op, CommReq *r, const char *what) {
    size_t D = (size_t)c->size;
    trace_span_begin(NULL, what, n * type_size(t));
    req_begin(c, r, K_ALLREDUCE, buf, buf, (n + D - 1) / D, n, t, op, what);
    comm_test(r);
}

static void mpi_ireduce_scatter(const Comm *c, void *send, void *recv, size_t recv_n, CommType t, CommOp op,
                                CommReq *r, const char *what) {
    trace_span_begin(NULL, what, recv_n * (size_t)c->size * type_size(t));
    req_begin(c, r, K_REDUCE_SCATTER, send, recv, recv_n, recv_n * (size_t)c->size, t, op, what);
    comm_test(r);
}

static void mpi_iallgather(const Comm *c, void *buf, size_t n, CommType t, CommReq *r, const char *what) {
    trace_span_begin(NULL, what, n * (size_t)c->size * type_size(t));
    req_begin(c, r, K_ALLGATHER, buf, buf, n, n * (size_t)c->size, t, COMM_SUM, what);
    comm_test(r);
}

/* (a group of one: its request is complete at its first test) */
static int mpi_test(CommReq *r) {
    if (!r->c->impl) { req_end(r); return 1; }
    return ring_test(r);
}

/* host memory: the host waits */
static void mpi_wait_device(CommReq *r) { comm_wait(r); }

static void mpi_release(const Comm *c) { (void)c; }

const CommBackend comm_mpi_backend = {"mpi", mpi_iallreduce, mpi_ireduce_scatter, mpi_iallgather, mpi_test,
                                      mpi_wait_device, mpi_isend, mpi_irecv, mpi_p2p_init, mpi_p2p_wait, mpi_release};
