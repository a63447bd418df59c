#include "tensor.h"
#include <stdlib.h>
#include <string.h>
#include "comm.h"
#include "ops.h"
#include "trace.h"
#include "util.h"

/* Every tensor-parallel collective runs on the comm stream (NCCL); the compute stream waits
 * for it there (comm_wait_device) when the model joins it, so the GPU's queue does not drain
 * at each of a layer's collectives, and a collective begun early overlaps the products the
 * model queues before joining it. The host polls (within comm_timeout) only the one TP_LAG
 * collectives back, and tp_flush the rest. Tickets number the collectives; ticket t uses
 * slot t % TP_LAG until it is retired. Activations are bf16 there with precision=mixed or
 * bf16, which NCCL sums as they are. On CPU ranks each completes at its begin.
 * TP_LAG bounds only how far the host runs ahead of the device, not what it may hold
 * unjoined: a ticket retired before its join is complete, and its join waits for nothing. 64
 * tickets keep several layers queued ahead of the GPU (and the slack for the host's own
 * pauses), a fused gather taking one ticket a rank. No wait can deadlock: every rank begins
 * the group's collectives in the same order, and the one waited for was begun after all the
 * work it depends on was queued. */
#define TP_LAG 64
static CommReq g_req[TP_LAG];
static long g_next, g_done;  /* tickets [g_done, g_next) are in flight */

static void retire_oldest(void) { comm_wait(&g_req[g_done++ % TP_LAG]); }

static void fused_join(void);
static void tp_flush(void *ctx) {
    (void)ctx;
    fused_join();
    while (g_done < g_next) retire_oldest();
}

static CommReq *next_slot(void) {
    if (g_next - g_done == TP_LAG) retire_oldest();
    CommReq *r = &g_req[g_next % TP_LAG];
    *r = (CommReq){0};
    return r;
}

/* The request just begun in r: complete at once on CPU ranks (MPI rings progress only while
 * waited on, one at a time); its ticket. */
static long begun(CommReq *r) {
    if (ops_host_memory()) comm_wait(r);
    return g_next++;
}

static const char FUSED_GATHER[] = "tensor-parallel fused gather";  /* its tickets' name (tp_join) */
static int fused_pending(long t);

static void tp_join(void *ctx, long t) {
    (void)ctx;
    if (fused_pending(t)) fused_join();
    else if (t >= g_done && t < g_next) {
        CommReq *q = &g_req[t % TP_LAG];
        /* on the timeline, the compute stream's waits for a fused gather's rows (as comm_ipc's for the sums) */
        int span = q->active && q->what == FUSED_GATHER ? trace_span_begin(NULL, "tensor-parallel gather-wait", 0) : -1;
        comm_wait_device(q);
        trace_span_end(NULL, span);
    }
}

static CommType act_type(void) { return ops_act_size() == 2 ? COMM_BF16 : COMM_F32; }

static long tp_allreduce_begin(void *ctx, void *buf, size_t n, int stats) {
    CommReq *r = next_slot();
    comm_iallreduce(ctx, buf, n, stats ? COMM_F32 : act_type(), COMM_SUM, r, "tensor-parallel all-reduce");
    return begun(r);
}
static long tp_allgather_begin(void *ctx, void *buf, size_t n, int stats) {
    CommReq *r = next_slot();
    comm_iallgather(ctx, buf, n, stats ? COMM_F32 : act_type(), r, "tensor-parallel all-gather");
    return begun(r);
}
static long tp_reduce_scatter_begin(void *ctx, void *send, void *recv, size_t n) {
    CommReq *r = next_slot();
    comm_ireduce_scatter(ctx, send, recv, n, act_type(), COMM_SUM, r, "tensor-parallel reduce-scatter");
    return begun(r);
}

/* ---- Fused sums (tp_comm): see ModelTp's fused_sum_begin. ----
 * On GPUs each rank's IPC block (comm_ipc.c) holds two sets (by the sum's parity) of t - 1
 * slots, one for each other rank's part of this rank's block, then as many for the gathers
 * (fused_gather_begin), then 5 t counters: the sums' full[s] (rank s's part of sum n has
 * landed: n + 1) and consumed[d] (rank d has read this rank's part of sum n: n + 1), the
 * gathers' gfull and gconsumed, alike, and the direct gathers' gready. Sum n on rank r:
 *   begin: for each other rank j, from r + 1 on: the product writes the rows of block j (r's
 *          part) into local staging, and side stream i (peer r + i's) copies it by copy
 *          engine into j's slot for r, once consumed[j] >= n - 1 (j has read the part r sent
 *          it two sums ago, from the slot this one overwrites); then sets j's full[r] := n + 1.
 *          The compute stream goes on with r's own rows unless fill (a weight gradient is
 *          queued before the join, under which the parts travel).
 *   join:  wait full[j] >= n + 1 for every j; r's own rows with rank r + 1's part added in the
 *          product's epilogue (beta = 1), or after them if already made, the others' after
 *          it (op_sum_parts, one pass); set every j's consumed[r] := n + 1; without sequence
 *          parallel, a gather of the blocks (fused_gather_begin).
 * Nothing but the products and the adds runs on the SMs: at tp 2 the step ran at 91.4-91.9%
 * of one GPU's per-GPU speed against 82.4-82.7% on NCCL's kernels (two H200s, 2026-11-28,
 * bench/results/tensor-parallel-h200x2-2026-11.md). A peer that never writes blocks the compute stream: the join's ticket
 * is an event the host waits for within comm_timeout (tp_flush), which ends the job.
 * CPU ranks run the same blocks and parts with MPI messages for the slots, so that the
 * data flow is tested without GPUs. One sum is begun and not yet joined at a time: a sum
 * begun joins the one before it first. */
enum { FUSED_TAG = 31000 };  /* above the rings' tags (1..30000, comm_mpi.c) */
typedef struct {
    TpRowsFn rows;
    _Alignas(16) char arg[128];
    void *dst;
    size_t R, E;  /* rows a block, and their width */
    int scatter, fill;
    uint64_t n;   /* its number */
    long ticket;
} FusedSum;
typedef struct {
    int asked, off;  /* TpOptions' fused; off: the GPUs cannot (every rank then sums by collectives) */
    const Comm *c;
    CommIpc *w;       /* GPUs */
    char *host;       /* CPU ranks: t - 1 parts to send, then t - 1 received */
    char *stage;      /* GPUs: two sets of t - 1 parts to send, made here, then copied out */
    size_t cap;       /* bytes a slot */
    uint64_t n, ng;   /* sums and gathers begun */
    FusedSum pend;    /* the sum begun and not yet joined, where pending */
    int pending;
} Fused;
static Fused g_fused;

/* The default (tp_comm=auto): on GPUs at tp = 2 and 4, where it pays (91.4-91.9% of one
 * GPU's per-GPU speed against 82.4-82.7% on NCCL's kernels at tp 2, two H200s; at tp 4, with
 * the gathers straight into the others' buffers one peer after another, 72.1% against
 * 64.0%, four H200s; 2026-11-28, bench/results/tensor-parallel-h200x4-2026-11.md); elsewhere the collectives: tp 8 is
 * unmeasured, and CPU ranks gain nothing by it. */
int tensor_parallel_fused_wanted(TpComm comm, int tp_size, int gpu) {
    if (tp_size < 2) return 0;
    if (comm == TP_COMM_AUTO) return gpu && (tp_size == 2 || tp_size == 4);
    return comm == TP_COMM_FUSED;
}

/* Slot of source s's part on receiver d, in set b, from the start of d's block. */
static size_t fused_slot(int t, int d, int s, uint64_t b) {
    size_t rel = (size_t)((s - d - 1 + 2 * t) % t);
    return ((size_t)b * (size_t)(t - 1) + rel) * g_fused.cap;
}
/* the sums' slots, then the gathers' (as many) */
static size_t fused_bytes(int t, size_t cap) { return 4 * (size_t)(t - 1) * cap; }
/* counters, t each: the sums' full and consumed, the gathers' full and consumed (by slot),
 * and the direct gathers' ready (fused_gather_begin) */
enum { CTR_SETS = 5 };
/* fences (comm_ipc_record): one a staging slot, 2 (t - 1), then one for "the part is made"
 * and one for "a direct gather's blocks are out" */
enum { FENCE_MADE = COMM_IPC_FENCES - 1, FENCE_PUSHED = COMM_IPC_FENCES - 2 };

/* Bytes a slot: a block of N / t rows of E activations, 256-byte aligned. */
static size_t fused_cap(int t, size_t N, size_t E, size_t act_size) {
    return (N / (size_t)t * E * act_size + 255) & ~(size_t)255;
}
/* Whether a sum or gather of N rows of E can take the fused path (every rank has the same
 * N: all of them decline together, and then use the collectives; the join adds at most
 * OPS_SUM_PARTS parts). */
static int fused_fits(const Fused *f, int t, size_t N, size_t E) {
    return !f->off && t <= OPS_SUM_PARTS && N % (size_t)t == 0 && N / (size_t)t * E * ops_act_size() <= f->cap;
}

/* Where this rank's own rows of sum s go: dst's rows with scatter, else block r of dst. */
static void *fused_own(const FusedSum *s, int r) {
    return s->scatter ? s->dst : (char *)s->dst + (size_t)r * s->R * s->E * ops_act_size();
}
/* Staging slot i of set b (peer r + i's part, 1 <= i < t): its index, which is its fence's too. */
static int stage_fence(int t, uint64_t b, int i) { return (int)b * (t - 1) + i - 1; }

/* Peer r + i's part of sum n (block j's rows, at src) into its slot for r, on side stream i:
 * after the compute stream's FENCE_MADE and once j has read the part r sent it two sums ago;
 * then staging fence k and j's full[r]. */
static void part_out(const Fused *f, int i, int j, int k, uint64_t n, uint64_t b, const char *src, size_t bytes) {
    int t = f->c->size, r = f->c->rank;
    comm_ipc_await(f->w, i, FENCE_MADE);
    if (n >= 2) comm_ipc_wait(f->w, i, t + j, n - 1);
    comm_ipc_side_copy(f->w, i, comm_ipc_block(f->w, j) + fused_slot(t, j, r, b), src, bytes);
    comm_ipc_record(f->w, i, k);
    comm_ipc_set(f->w, i, j, r, n + 1);
}

static long fused_sum_begin(void *ctx, TpRowsFn rows, const void *arg, size_t arg_bytes, void *dst, size_t N,
                            size_t E, int scatter, int fill) {
    Fused *f = &g_fused;
    const Comm *c = ctx;
    int t = c->size, r = c->rank;
    size_t R = N / (size_t)t, bytes = R * E * ops_act_size();
    if (!fused_fits(f, t, N, E) || arg_bytes > sizeof f->pend.arg) return -1;
    fused_join();  /* (one at a time) */
    uint64_t n = f->n++, b = n & 1;
    FusedSum *s = &f->pend;
    *s = (FusedSum){.rows = rows, .dst = dst, .R = R, .E = E, .scatter = scatter, .fill = fill, .n = n};
    memcpy(s->arg, arg, arg_bytes);
    if (f->w) {
        for (int i = 1; i < t; i++) {  /* (peer r + i's copy on side stream i) */
            int j = (r + i) % t;
            int k = stage_fence(t, b, i);  /* (the staging slot, and its fence) */
            char *st = f->stage + (size_t)k * f->cap;
            comm_ipc_await(f->w, 0, k);  /* its copy two sums ago is out */
            rows(s->arg, (size_t)j * R, R, st, NULL, r == (j + 1) % t);
            comm_ipc_record(f->w, 0, FENCE_MADE);
            part_out(f, i, j, k, n, b, st, bytes);
        }
        /* with nothing queued before the join, this rank's own rows now, while the parts travel */
        if (!fill) rows(s->arg, (size_t)r * R, R, fused_own(s, r), NULL, 0);
    } else {  /* CPU ranks: each part as a message */
        CommP2P *q = xmalloc(2 * (size_t)(t - 1) * sizeof *q);
        for (int i = 1; i < t; i++) {
            int j = (r + i) % t;
            char *out = f->host + (size_t)(i - 1) * f->cap, *in = f->host + (size_t)(t - 2 + i) * f->cap;
            comm_irecv(c, in, bytes, (r - i + t) % t, FUSED_TAG, &q[t - 2 + i], "tensor-parallel fused sum");
            rows(s->arg, (size_t)j * R, R, out, NULL, r == (j + 1) % t);
            comm_isend(c, out, bytes, j, FUSED_TAG, &q[i - 1], "tensor-parallel fused sum");
        }
        for (int i = 0; i < 2 * (t - 1); i++) comm_p2p_wait(&q[i]);
        free(q);
    }
    CommReq *q = next_slot();  /* (inactive: the join's ticket carries the wait) */
    s->ticket = begun(q);
    f->pending = 1;
    return s->ticket;
}

static int fused_gather_begin(void *ctx, void *buf, size_t N, size_t E, long *tk);
/* The join of the sum pending (nothing if none is): this rank's own block. */
static void fused_join(void) {
    Fused *f = &g_fused;
    if (!f->pending) return;
    f->pending = 0;
    const FusedSum *s = &f->pend;
    const Comm *c = f->c;
    int t = c->size, r = c->rank;
    uint64_t n = s->n, b = n & 1;
    size_t R = s->R, E = s->E, own_row = (size_t)r * R;
    void *own = fused_own(s, r);
    /* part of source s (i = s - r mod t: 1 .. t - 1), as received */
    #define PART(i) (f->w ? comm_ipc_block(f->w, r) + fused_slot(t, r, (r + (i)) % t, b) \
                          : f->host + (size_t)(t - 2 + ((t - (i)) % t)) * f->cap)
    if (f->w)
        for (int j = 0; j < t; j++)
            if (j != r) comm_ipc_wait(f->w, 0, j, n + 1);
    int made = f->w && !s->fill;  /* (the own rows made at the begin) */
    /* the own rows and the parts not yet added, in one pass */
    const void *parts[OPS_SUM_PARTS];
    int k = 0;
    parts[k++] = own;
    if (!made) s->rows(s->arg, own_row, R, own, PART(1), 0);
    for (int i = made ? 1 : 2; i < t; i++) parts[k++] = PART(i);
    if (k > 1) op_sum_parts(own, parts, k, R * E);
    #undef PART
    if (f->w) {
        for (int j = 0; j < t; j++)
            if (j != r) comm_ipc_set(f->w, 0, j, t + r, n + 1);
        CommReq *q = next_slot();
        comm_ipc_mark(f->w, 0, q, "tensor-parallel fused sum");
        begun(q);
    }
    if (s->scatter) return;
    /* without sequence parallel every rank needs every block: gathered by copy engine */
    long tk[TP_MAX_TICKETS];
    if (t <= TP_MAX_TICKETS && fused_gather_begin((void *)c, s->dst, R * t, E, tk)) {
        for (int i = 0; i < t; i++)
            if (tk[i] >= 0) tp_join(NULL, tk[i]);
    } else tp_join(NULL, tp_allgather_begin((void *)c, s->dst, R * E, 0));
}
static int fused_pending(long t) { return g_fused.pending && g_fused.pend.ticket == t; }

/* ---- Buffers every rank of the group maps: ModelTp's alloc under the fused sums on GPUs.
 * Each is an IPC block of its own (comm_ipc_open: whole pages, every other rank's mapping
 * checked), allocated and freed by every rank of the group in the same order (the Acts plan
 * is the same on each), so that a fused gather can write each rank's rows straight into
 * their place in the others' buffer. Where the group cannot map, plain memory (and the
 * gathers take the slots). ---- */
typedef struct { CommIpc *w; char *base; size_t bytes; } Mapped;
static Mapped *g_mapped;
static int g_n_mapped;

static void *mapped_alloc(void *ctx, size_t bytes) {
    CommIpc *w = comm_ipc_open(ctx, bytes, 0, "tensor-parallel gather buffer");
    if (!w) return op_alloc(bytes);
    g_mapped = xrealloc(g_mapped, ((size_t)g_n_mapped + 1) * sizeof *g_mapped);
    char *base = comm_ipc_block(w, ((const Comm *)ctx)->rank);
    g_mapped[g_n_mapped++] = (Mapped){w, base, bytes};
    return base;
}

static void mapped_free(void *p) {
    for (int i = 0; p && i < g_n_mapped; i++)
        if (g_mapped[i].base == p) {
            comm_ipc_close(g_mapped[i].w);  /* (collective, as the alloc was) */
            g_mapped[i] = g_mapped[--g_n_mapped];
            return;
        }
    op_free(p);  /* (Acts free every buffer through ModelTp's free) */
}

/* The mapped buffer holding [p, p + bytes), or NULL. */
static const Mapped *mapped_of(const void *p, size_t bytes) {
    for (int i = 0; i < g_n_mapped; i++) {
        const Mapped *b = &g_mapped[i];
        if ((const char *)p >= b->base && (const char *)p + bytes <= b->base + b->bytes) return b;
    }
    return NULL;
}

int tensor_parallel_gathers_direct(void) { return g_n_mapped > 0; }

size_t tensor_parallel_buffer_extra(size_t bytes) {
    return comm_ipc_bytes(bytes, 0) - (bytes + 63) / 64 * 64;
}

/* The fused gathers (ModelTp's fused_gather_begin). Into a mapped buffer (direct), gather n
 * on rank r: r's compute stream tells every other rank j that its buffer is free for gather
 * n (j's gready[r] := n + 1, after the work that reads it), then on the ordered side stream
 * (after the compute stream's work so far) r's rows go straight into their place in each
 * other rank's buffer, one copy after another, to r - 1 first, r - 2 next...: each is a
 * shift, every rank receiving one block at a time, and rank r + i's block reaches r at step
 * i, the order product_after reads them in (at once, the copies shared the links and every
 * block landed near the end: bench/ce_p2p_probe); each once that rank's gready[r] >= n + 1,
 * then its gfull[r] := n + 1. Ticket i (block r + i) marks side stream i once gfull[r + i]
 * >= n + 1; the last one also once r's own copies are out (fence FENCE_PUSHED: the compute
 * stream may then write r's rows again). Into any other buffer (slots), on GPUs, gather n on rank r, on the IPC
 * block's side streams after the compute stream's work so far (peer r + i's on stream i, so
 * that copies to and from different peers run on different copy engines at once): for each
 * other rank j, wait gconsumed[j] >= n - 1, copy r's rows (copy engine) into j's gather slot
 * for r, set j's gfull[r] := n + 1; then for each j, wait gfull[j] >= n + 1, copy j's rows
 * from the slot into their place in buf, set j's gconsumed[r] := n + 1, and mark a ticket.
 * The compute stream runs the product on r's own rows meanwhile. CPU ranks: the all-gather
 * over MPI, complete at once (every ticket -1), the blocks in the same order. */
static int fused_gather_begin(void *ctx, void *buf, size_t N, size_t E, long *tk) {
    Fused *f = &g_fused;
    const Comm *c = ctx;
    int t = c->size, r = c->rank;
    size_t R = N / (size_t)t, bytes = R * E * ops_act_size();  /* (a block's, and where block j starts: j bytes) */
    if (!fused_fits(f, t, N, E)) return 0;
    for (int i = 0; i < t; i++) tk[i] = -1;
    if (!f->w) {
        tp_join(NULL, tp_allgather_begin((void *)c, buf, R * E, 0));
        return t;
    }
    uint64_t n = f->ng++, b = n & 1;
    size_t base = fused_bytes(t, f->cap) / 2;  /* (the gathers' slots after the sums') */
    const int GF = 2 * t, GC = 3 * t;
    char *mine = (char *)buf + (size_t)r * bytes;
    const Mapped *mp = mapped_of(buf, (size_t)t * bytes);
    if (mp) {
        const int GR = 4 * t, ORDERED = t;
        size_t at = (size_t)((char *)mine - mp->base);  /* (r's rows, in every rank's buffer) */
        for (int j = 0; j < t; j++)
            if (j != r) comm_ipc_set(f->w, 0, j, GR + r, n + 1);
        comm_ipc_side_after_compute(f->w);
        for (int i = 1; i < t; i++) {
            int d = (r - i + t) % t;
            comm_ipc_wait(f->w, ORDERED, GR + d, n + 1);
            comm_ipc_side_copy(f->w, ORDERED, comm_ipc_block(mp->w, d) + at, mine, bytes);
            comm_ipc_set(f->w, ORDERED, d, GF + r, n + 1);
        }
        comm_ipc_record(f->w, ORDERED, FENCE_PUSHED);
        for (int i = 1; i < t; i++) {
            comm_ipc_wait(f->w, i, GF + (r + i) % t, n + 1);
            if (i == t - 1) comm_ipc_await(f->w, i, FENCE_PUSHED);
            CommReq *q = next_slot();
            comm_ipc_mark(f->w, i, q, FUSED_GATHER);
            tk[i] = begun(q);
        }
        return t;
    }
    comm_ipc_side_after_compute(f->w);
    for (int i = 1; i < t; i++) {  /* (peer r + i on side stream i) */
        int j = (r + i) % t;
        if (n >= 2) comm_ipc_wait(f->w, i, GC + j, n - 1);
        comm_ipc_side_copy(f->w, i, comm_ipc_block(f->w, j) + base + fused_slot(t, j, r, b), mine, bytes);
        comm_ipc_set(f->w, i, j, GF + r, n + 1);
    }
    for (int i = 1; i < t; i++) {
        int j = (r + i) % t;
        comm_ipc_wait(f->w, i, GF + j, n + 1);
        comm_ipc_side_copy(f->w, i, (char *)buf + (size_t)j * bytes,
                           comm_ipc_block(f->w, r) + base + fused_slot(t, r, j, b), bytes);
        comm_ipc_set(f->w, i, j, GC + r, n + 1);
        CommReq *q = next_slot();
        comm_ipc_mark(f->w, i, q, FUSED_GATHER);
        tk[i] = begun(q);
    }
    return t;
}

/* the staging on GPUs: two sets of t - 1 parts; CPU ranks' host buffer: t - 1 parts to send,
 * t - 1 received */
static size_t stage_bytes(int t, size_t cap) { return 2 * (size_t)(t - 1) * cap; }

int tensor_parallel_fused_open(const Model *m, const Mesh *mesh, size_t N) {
    Fused *f = &g_fused;
    if (mesh->tp_size == 1 || !f->asked) return 0;
    int t = mesh->tp_size;
    f->c = &mesh->tp;
    f->cap = fused_cap(t, N, (size_t)m->E, ops_act_size());
    if (ops_host_memory()) {
        f->host = xmalloc(stage_bytes(t, f->cap));
        return 1;
    }
    f->w = comm_ipc_open(&mesh->tp, fused_bytes(t, f->cap), CTR_SETS * t, "tensor-parallel fused sums");
    f->off = !f->w;
    if (f->w) f->stage = op_alloc(stage_bytes(t, f->cap));
    return f->w != NULL;
}

size_t tensor_parallel_fused_bytes(int tp, size_t N, size_t E, size_t act_size) {
    if (tp == 1) return 0;
    size_t cap = fused_cap(tp, N, E, act_size);
    return comm_ipc_bytes(fused_bytes(tp, cap), CTR_SETS * tp) + stage_bytes(tp, cap);  /* (and the staging) */
}

unsigned long long tensor_parallel_fused_count(void) { return g_fused.n; }

void tensor_parallel_fused_close(void) {
    Fused *f = &g_fused;
    fused_join();
    comm_ipc_close(f->w);  /* (first: it waits for the side streams' copies out of the staging) */
    op_free(f->stage);
    free(f->host);
    *f = (Fused){0};
}

void tensor_parallel_attach(Model *m, const Mesh *mesh, const TpOptions *o) {
    if (mesh->tp_size == 1) return;
    m->tp = (ModelTp){.ctx = (void *)&mesh->tp, .allreduce_begin = tp_allreduce_begin,
                      .allgather_begin = tp_allgather_begin, .reduce_scatter_begin = tp_reduce_scatter_begin,
                      .join = tp_join, .flush = tp_flush};
    m->sp = o->sequence_parallel != 0;
    g_fused.asked = o->fused != 0;
    if (!g_fused.asked) return;
    m->tp.fused_sum_begin = fused_sum_begin;
    m->tp.fused_gather_begin = fused_gather_begin;
    if (!ops_host_memory()) {  /* (the direct gathers' buffers) */
        m->tp.alloc = mapped_alloc;
        m->tp.free = mapped_free;
    }
}
