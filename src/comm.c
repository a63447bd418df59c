#include "comm.h"
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "ops.h"
#include "trace.h"
#include "util.h"
#ifdef MESHTRAIN_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>
#include "ops_cuda.h"
#endif

static int g_mpi;            /* MPI initialised by us */
static double g_timeout;     /* seconds; 0 = forever */
static int g_world_rank;

/* The MPI communicator and a count of the collectives started on it: every rank starts
 * them in the same order, so the count gives each one its own message tag. */
typedef struct {
    MPI_Comm mc;
    unsigned seq;
    void *nccl;  /* ncclComm_t, made at the group's first collective on a device=cuda run */
    char *a2a;   /* copy-engine all-reduce: the all-to-all's receive buffer (comm_alloc), or NULL */
    size_t a2a_bytes;
    void *a2a_win;  /* its ncclWindow_t */
    int ce_ok;      /* ce_possible's answer, kept: 0 not asked yet, 1 yes, -1 no */
} CommImpl;
static MPI_Comm mpi(const Comm *c) { return ((CommImpl *)c->impl)->mc; }

int comm_using_mpi(void) { return g_mpi; }

static int launched_by_mpi(void) {
    const char *vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_NTASKS"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *v = getenv(vars[i]);
        if (v && *v) return 1;
    }
    return 0;
}

_Noreturn void comm_abort(int code, const char *msg) {
    fprintf(stderr, "meshtrain: %s\n", msg);
    fflush(stderr);
    if (g_mpi) MPI_Abort(MPI_COMM_WORLD, code);
    exit(code);
}

static void check(int rc, const Comm *c, const char *what) {
    if (rc == MPI_SUCCESS) return;
    char s[MPI_MAX_ERROR_STRING], msg[MPI_MAX_ERROR_STRING + 128];
    int len = 0;
    MPI_Error_string(rc, s, &len);
    snprintf(msg, sizeof msg, "rank %d: %s on group %s failed: %s", g_world_rank, what, c ? c->name : "world", s);
    comm_abort(EXIT_RUN_FAILURE, msg);
}

void comm_world_init(Comm *world, double timeout_s) {
    memset(world, 0, sizeof *world);
    snprintf(world->name, sizeof world->name, "world");
    g_timeout = timeout_s;
    world->size = 1;
    if (!launched_by_mpi()) return;
    int provided;
    if (MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
        die(EXIT_RUN_FAILURE, "MPI_Init failed");
    g_mpi = 1;
    CommImpl *ci = xcalloc(1, sizeof *ci);
    MPI_Comm_dup(MPI_COMM_WORLD, &ci->mc);
    /* Errors come back to us (and end the job with a message) instead of MPI's own abort. */
    MPI_Comm_set_errhandler(ci->mc, MPI_ERRORS_RETURN);
    MPI_Comm_rank(ci->mc, &world->rank);
    MPI_Comm_size(ci->mc, &world->size);
    g_world_rank = world->rank;
    world->impl = world->size > 1 ? ci : NULL;
    if (!world->impl) { MPI_Comm_free(&ci->mc); free(ci); }
}

void comm_exit_if_failed(const Comm *w, const Fail *f) {
    int first = f->code ? w->size - w->rank : 0;  /* max over ranks: the lowest failing rank */
    comm_allreduce_max_int(w, &first, 1);
    if (!first) return;
    first = w->size - first;
    int code = f->code;
    comm_broadcast(w, &code, sizeof code, first);
    if (w->rank == first) print_error(w->rank, w->size, f->msg);
    comm_barrier(w);  /* printed before any rank exits: the launcher ends the job at the first exit */
    comm_world_finalize();
    exit(code);
}

void comm_world_finalize(void) {
    if (g_mpi) MPI_Finalize();
    g_mpi = 0;
}

int comm_local_size(void) {
    if (!g_mpi) return 1;
    MPI_Comm local;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local);
    int n;
    MPI_Comm_size(local, &n);
    MPI_Comm_free(&local);
    return n;
}

void comm_split(const Comm *parent, int color, int key, const char *name, Comm *out) {
    memset(out, 0, sizeof *out);
    snprintf(out->name, sizeof out->name, "%s", name);
    out->size = 1;
    if (!parent->impl) return;
    CommImpl *ci = xcalloc(1, sizeof *ci);
    check(MPI_Comm_split(mpi(parent), color, key, &ci->mc), parent, "comm split");
    MPI_Comm_set_errhandler(ci->mc, MPI_ERRORS_RETURN);
    MPI_Comm_rank(ci->mc, &out->rank);
    MPI_Comm_size(ci->mc, &out->size);
    if (out->size > 1) out->impl = ci;
    else { MPI_Comm_free(&ci->mc); free(ci); }
}

#ifdef MESHTRAIN_NCCL
static void nccl_free(CommImpl *ci);
#endif

void comm_free(Comm *c) {
    if (c->impl) {
#ifdef MESHTRAIN_NCCL
        nccl_free(c->impl);
#endif
        MPI_Comm_free(&((CommImpl *)c->impl)->mc);
        free(c->impl);
    }
    c->impl = NULL;
}


#ifdef MESHTRAIN_NCCL
/* ---- NCCL: float collectives on device buffers (device=cuda, groups of more than one) ---- */

#define MAX_NCCL 64
static ncclComm_t g_nccl[MAX_NCCL];  /* every NCCL communicator made, to abort them all */
static int g_n_nccl;
static cudaStream_t g_cstream;       /* the communication stream */

static int g_ce_any;  /* some communicator reduces on the copy engines (comm_alloc) */

/* Before MPI_Abort on an error or a lost peer. Not with copy-engine collectives: they wait
 * in the stream (memory-op waits) for flags that a lost peer never writes, nothing aborts
 * those waits, and ncclCommAbort would wait behind them; MPI_Abort ends the process, and
 * the driver frees the GPU with it. */
static void nccl_abort_all(void) {
    if (g_ce_any) return;
    for (int i = 0; i < g_n_nccl; i++) ncclCommAbort(g_nccl[i]);
    g_n_nccl = 0;
}

static _Noreturn void nccl_die(const Comm *c, const char *what, const char *call, const char *err) {
    char msg[512];
    snprintf(msg, sizeof msg, "rank %d: %s on group %s: %s failed: %s", g_world_rank, what, c ? c->name : "world",
             call, err);
    nccl_abort_all();
    comm_abort(EXIT_RUN_FAILURE, msg);
}

static void nchk(ncclResult_t rc, const Comm *c, const char *what, const char *call) {
    if (rc != ncclSuccess && rc != ncclInProgress) nccl_die(c, what, call, ncclGetErrorString(rc));
}

static void cchk(cudaError_t e, const Comm *c, const char *what, const char *call) {
    if (e != cudaSuccess) nccl_die(c, what, call, cudaGetErrorString(e));
}

/* The buffers are device memory and the group spans processes. */
static int use_nccl(const Comm *c) { return c->impl && !ops_host_memory(); }

/* The group's NCCL communicator, made at its first collective: every rank of the group
 * starts its collectives in the same order, so all of them arrive here together. */
static ncclComm_t nccl_make(const Comm *c, const char *what, int cta_zero);
static ncclComm_t nccl_of(const Comm *c, const char *what) {
    CommImpl *ci = c->impl;
    return ci->nccl ? ci->nccl : nccl_make(c, what, 0);
}

/* cta_zero: NCCL runs what it can (the all-to-all and all-gather over symmetric windows) on
 * the copy engines, with no CTA (NCCL_CTA_POLICY_ZERO, NCCL 2.28 and later). */
static ncclComm_t nccl_make(const Comm *c, const char *what, int cta_zero) {
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

static void ce_release(CommImpl *ci, const char *what);
static void nccl_free(CommImpl *ci) {
    if (!ci->nccl) return;
    ce_release(ci, "communicator release");
    for (int i = 0; i < g_n_nccl; i++)
        if (g_nccl[i] == ci->nccl) { g_nccl[i] = g_nccl[--g_n_nccl]; break; }
    ncclCommDestroy(ci->nccl);
    ci->nccl = NULL;
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

static int nccl_test(CommReq *r) {
    cudaEvent_t ev = (cudaEvent_t)r->ev;
    cudaError_t e = cudaEventQuery(ev);
    if (e == cudaErrorNotReady) {
        ncclResult_t async = ncclSuccess;
        ncclComm_t nc = ((CommImpl *)r->c->impl)->nccl;
        if (nc && ncclCommGetAsyncError(nc, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress)
            nccl_die(r->c, r->what, "NCCL (asynchronous error)", ncclGetErrorString(async));
        return 0;
    }
    cchk(e, r->c, r->what, "cudaEventQuery");
    /* Later ops on the compute stream see the result. */
    cchk(cudaStreamWaitEvent((cudaStream_t)cuda_stream(), ev, 0), r->c, r->what, "cudaStreamWaitEvent");
    cchk(cudaEventDestroy(ev), r->c, r->what, "cudaEventDestroy");
    r->ev = NULL;
    r->active = 0;
    return 1;
}

static ncclRedOp_t nccl_op(CommOp op) { return op == COMM_AVG ? ncclAvg : ncclSum; }

#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
#define HAVE_CE 1
/* Copy-engine all-reduce (comm_alloc). Buffers in NCCL symmetric windows, to find the
 * all-reduces over them and to deregister and free them. */
typedef struct { char *p; size_t bytes; void *win; ncclComm_t nc; const Comm *c; } RegBuf;
#define MAX_REG 16
static RegBuf g_reg[MAX_REG];
static int g_n_reg;

static void win_free(const Comm *c, ncclComm_t nc, void *p, void *win, const char *what);
/* Takes g_reg[i] off the list (the last entry moves into its place) and frees its memory. */
static void reg_drop(int i, const char *what) {
    RegBuf r = g_reg[i];
    g_reg[i] = g_reg[--g_n_reg];
    win_free(r.c, r.nc, r.p, r.win, what);
}

static const RegBuf *reg_of(const Comm *c, const void *p, size_t bytes) {
    for (int i = 0; i < g_n_reg; i++)
        if (g_reg[i].c == c && (const char *)p >= g_reg[i].p && (const char *)p + bytes <= g_reg[i].p + g_reg[i].bytes)
            return &g_reg[i];
    return NULL;
}

/* Memory in a symmetric window of nc (collective: every rank of c together). */
static void *win_alloc(const Comm *c, ncclComm_t nc, size_t bytes, void **win, const char *what) {
    void *p = NULL;
    ncclWindow_t w;
    nchk(ncclMemAlloc(&p, bytes), c, what, "ncclMemAlloc");
    nchk(ncclCommWindowRegister(nc, p, bytes, &w, NCCL_WIN_COLL_SYMMETRIC), c, what, "ncclCommWindowRegister");
    cuda_note_alloc(p, bytes);
    *win = (void *)w;
    return p;
}
static void win_free(const Comm *c, ncclComm_t nc, void *p, void *win, const char *what) {
    ops_synchronize();  /* kernels and copies in flight may still use it */
    cchk(cudaStreamSynchronize(g_cstream), c, what, "cudaStreamSynchronize");
    nchk(ncclCommWindowDeregister(nc, (ncclWindow_t)win), c, what, "ncclCommWindowDeregister");
    nchk(ncclMemFree(p), c, what, "ncclMemFree");
    cuda_note_free(p);
}

/* Whether every rank of c can take the copy-engine path: NCCL 2.28 or later at run time, and
 * all of c's ranks on one machine (symmetric windows span one NVLink domain). Decided
 * together, so that all ranks register (collectively) or none does; asked once per group
 * (every rank asks at the same calls, so all of them keep the answer at the same time). */
static int ce_possible(const Comm *c) {
    CommImpl *ci = c->impl;
    if (ci->ce_ok) return ci->ce_ok > 0;
    int v = 0, ok, local;
    ok = ncclGetVersion(&v) == ncclSuccess && v >= NCCL_VERSION(2, 28, 0);
    MPI_Comm shm;
    check(MPI_Comm_split_type(mpi(c), MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &shm), c, "comm split (node)");
    MPI_Comm_size(shm, &local);
    MPI_Comm_free(&shm);
    ok = ok && local == c->size;
    check(MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, mpi(c)), c, "copy-engine check");
    ci->ce_ok = ok ? 1 : -1;
    return ok;
}
#else
#define HAVE_CE 0
#endif

static void ce_release(CommImpl *ci, const char *what) {
#if HAVE_CE
    if (!ci->a2a) return;
    for (int i = g_n_reg - 1; i >= 0; i--)  /* buffers still registered on this communicator */
        if (g_reg[i].nc == ci->nccl) reg_drop(i, what);
    win_free(NULL, ci->nccl, ci->a2a, ci->a2a_win, what);
    ci->a2a = NULL;
#else
    (void)ci; (void)what;
#endif
}
#endif

static int g_ce_wanted = 1;
void comm_set_copy_engines(int on) { g_ce_wanted = on; }

int comm_copy_engines_active(const Comm *c) {
#ifdef MESHTRAIN_NCCL
    return c->impl && ((CommImpl *)c->impl)->a2a != NULL;
#else
    (void)c;
    return 0;
#endif
}

int comm_copy_engines_possible(const Comm *c) {
#if defined(MESHTRAIN_NCCL) && HAVE_CE
    return g_ce_wanted && c->size > 1 && use_nccl(c) && ce_possible(c);
#else
    (void)c;
    return 0;
#endif
}

size_t comm_ce_buffer_bytes(size_t bytes) {
    const char *e = getenv("MESHTRAIN_CE_BUFFER_BYTES");  /* test hook: all-reduces in many pieces */
    size_t cap = e && atoll(e) > 0 ? (size_t)atoll(e) : COMM_CE_BUFFER_BYTES;
    return bytes < cap ? bytes : cap;
}

void *comm_alloc(const Comm *c, size_t bytes) {
#if defined(MESHTRAIN_NCCL) && HAVE_CE
    const char *what = "copy-engine buffer registration (copy_engines=false avoids it)";
    CommImpl *ci = c->impl;
    /* The communicator must be new, to be made with the zero-CTA policy, unless it already
     * has the all-to-all buffer; every rank takes the same branch (the same calls have
     * reached here on all of them). */
    if (bytes && g_n_reg < MAX_REG && use_nccl(c) && (ci->a2a || !ci->nccl) && comm_copy_engines_possible(c)) {
        ncclComm_t nc = ci->nccl ? ci->nccl : nccl_make(c, what, 1);
        if (!ci->a2a) {  /* sized by the first buffer: later ones are reduced in pieces of it */
            ci->a2a_bytes = comm_ce_buffer_bytes(bytes);
            ci->a2a = win_alloc(c, nc, ci->a2a_bytes, &ci->a2a_win, what);
            g_ce_any = 1;
        }
        void *win;
        char *p = win_alloc(c, nc, bytes, &win, what);
        op_zero(p, bytes);
        g_reg[g_n_reg++] = (RegBuf){p, bytes, win, nc, c};
        return p;
    }
#else
    (void)c;
#endif
    return op_alloc(bytes);
}

void comm_buffer_free(void *p) {
    if (!p) return;
#if defined(MESHTRAIN_NCCL) && HAVE_CE
    for (int i = 0; i < g_n_reg; i++)
        if (g_reg[i].p == p) {
            reg_drop(i, "copy-engine buffer release");
            return;
        }
#endif
    op_free(p);
}

/* Counts travel as int. */
static int count_of(size_t n, const Comm *c, const char *what) {
    if (n > (size_t)0x7fffffff) {
        char msg[256];
        snprintf(msg, sizeof msg, "rank %d: %s of %zu elements on group %s exceeds MPI's count limit", g_world_rank,
                 what, n, c->name);
        comm_abort(EXIT_RUN_FAILURE, msg);
    }
    return (int)n;
}

#define CHUNK ((size_t)1 << 18)  /* floats per message: 1 MiB */
enum { K_ALLREDUCE, K_REDUCE_SCATTER, K_ALLGATHER };

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

static size_t type_size(CommType t) { return t == COMM_BF16 ? 2 : sizeof(float); }

static void req_begin(const Comm *c, CommReq *r, int kind, void *buf, void *out, size_t n, size_t total, CommType t,
                      CommOp op, const char *what) {
    memset(r, 0, sizeof *r);
    r->c = c; r->kind = kind; r->buf = buf; r->out = out; r->n = n; r->total = total; r->what = what;
    r->esz = type_size(t);
    /* The rings add and scale in fp32 on the host; bf16 buffers live on a GPU, where
     * NCCL moves them (use_nccl), and a group of one only copies. */
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
    check(MPI_Isend(r->buf + blk_lo(r, sb) + c0, (int)slen, MPI_FLOAT, mod(R + 1, D), r->tag, mpi(r->c), r->sreq),
          r->c, r->what);
    check(MPI_Irecv(rdst, (int)rlen, MPI_FLOAT, mod(R - 1, D), r->tag, mpi(r->c), r->rreq), r->c, r->what);
    r->posted = 1;
    return 0;
}

static int ring_advance(CommReq *r);

int comm_test(CommReq *r) {
    if (!r->active) return 1;
#ifdef MESHTRAIN_NCCL
    if (r->ev) return nccl_test(r);
#endif
    if (!r->c->impl) { req_end(r); return 1; }
    for (int i = g_n_active - 1; i >= 0; i--)
        if (i < g_n_active && g_active[i] != r) ring_advance(g_active[i]);
    return ring_advance(r);
}

static int ring_advance(CommReq *r) {
    if (!r->active) return 1;
    for (;;) {
        if (r->posted) {
            int ds = 0, dr = 0;
            check(MPI_Test(r->sreq, &ds, MPI_STATUS_IGNORE), r->c, r->what);
            check(MPI_Test(r->rreq, &dr, MPI_STATUS_IGNORE), r->c, r->what);
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

#ifdef MESHTRAIN_NCCL
static ncclDataType_t nccl_type(CommType t) { return t == COMM_BF16 ? ncclBfloat16 : ncclFloat32; }

#if HAVE_CE
/* The copy-engine all-reduce of a comm_alloc buffer, queued on the comm stream; 0 if buf is
 * not one (or n does not divide into the group's blocks). In pieces of the all-to-all
 * buffer's size: an all-to-all gives this rank every rank's copy of its block, one kernel
 * sums them in rank order, an all-gather sends the sum to all; NCCL moves both by copy
 * engine. */
static int ce_allreduce(const Comm *c, void *buf, size_t n, CommType t, CommOp op, ncclComm_t nc, const char *what) {
    CommImpl *ci = c->impl;
    size_t es = type_size(t), D = (size_t)c->size, piece = ci->a2a ? ci->a2a_bytes / es / D * D : 0;
    if (piece >= 8 * D) piece = piece / (8 * D) * (8 * D);  /* 16-byte blocks for the sum */
    if (!piece || n % D || !reg_of(c, buf, n * es)) return 0;
    for (size_t off = 0; off < n; off += piece) {
        size_t len = n - off < piece ? n - off : piece, cnt = len / D;
        char *base = (char *)buf + off * es, *mine = base + (size_t)c->rank * cnt * es;
        nchk(ncclAlltoAll(base, ci->a2a, cnt, nccl_type(t), nc, g_cstream), c, what, "ncclAlltoAll");
        cuda_sum_blocks(mine, ci->a2a, cnt, c->size, op == COMM_AVG ? 1.0f / (float)D : 1.0f, t == COMM_BF16, g_cstream);
        nchk(ncclAllGather(mine, base, cnt, nccl_type(t), nc, g_cstream), c, what, "ncclAllGather");
    }
    return 1;
}
#endif
#endif

void comm_iallreduce(const Comm *c, void *buf, size_t n, CommType t, CommOp op, CommReq *r, const char *what) {
#ifdef MESHTRAIN_NCCL
    if (use_nccl(c)) {
        ncclComm_t nc = nccl_begin(c, r, what);
        int span = trace_span_begin(g_cstream, what, n * type_size(t));
#if HAVE_CE
        if (!ce_allreduce(c, buf, n, t, op, nc, what))
#endif
            nchk(ncclAllReduce(buf, buf, n, nccl_type(t), nccl_op(op), nc, g_cstream), c, what, "ncclAllReduce");
        trace_span_end(g_cstream, span);
        nccl_launched(r);
        return;
    }
#endif
    size_t D = (size_t)c->size;
    trace_span_begin(NULL, what, n * type_size(t));
    req_begin(c, r, K_ALLREDUCE, buf, buf, (n + D - 1) / D, n, t, op, what);
    comm_test(r);
}

void comm_ireduce_scatter(const Comm *c, void *send, void *recv, size_t recv_n, CommType t, CommOp op, CommReq *r,
                          const char *what) {
#ifdef MESHTRAIN_NCCL
    if (use_nccl(c)) {
        ncclComm_t nc = nccl_begin(c, r, what);
        int span = trace_span_begin(g_cstream, what, recv_n * (size_t)c->size * type_size(t));
        nchk(ncclReduceScatter(send, recv, recv_n, nccl_type(t), nccl_op(op), nc, g_cstream), c, what,
             "ncclReduceScatter");
        trace_span_end(g_cstream, span);
        nccl_launched(r);
        return;
    }
#endif
    trace_span_begin(NULL, what, recv_n * (size_t)c->size * type_size(t));
    req_begin(c, r, K_REDUCE_SCATTER, send, recv, recv_n, recv_n * (size_t)c->size, t, op, what);
    comm_test(r);
}

void comm_iallgather(const Comm *c, void *buf, size_t n, CommType t, CommReq *r, const char *what) {
#ifdef MESHTRAIN_NCCL
    if (use_nccl(c)) {  /* in place: this rank's block is the send buffer */
        ncclComm_t nc = nccl_begin(c, r, what);
        int span = trace_span_begin(g_cstream, what, n * (size_t)c->size * type_size(t));
        nchk(ncclAllGather((char *)buf + (size_t)c->rank * n * type_size(t), buf, n, nccl_type(t), nc, g_cstream), c, what,
             "ncclAllGather");
        trace_span_end(g_cstream, span);
        nccl_launched(r);
        return;
    }
#endif
    trace_span_begin(NULL, what, n * (size_t)c->size * type_size(t));
    req_begin(c, r, K_ALLGATHER, buf, buf, n, n * (size_t)c->size, t, COMM_SUM, what);
    comm_test(r);
}

/* Between polls: spin a while, then sleep 20 us a round so as not to starve the other
 * ranks' cores. */
static void backoff(long spins) {
    if (spins > 1000) {
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
    }
}

/* The one waiting loop: polls `done` (which moves every ring in flight) so that a lost
 * peer ends the run after g_timeout seconds instead of hanging it. */
static void wait_until(int (*done)(void *), void *arg, const Comm *c, const char *what) {
    double t0 = now_seconds();
    for (long spins = 0;; spins++) {
        if (done(arg)) return;
        backoff(spins);
        if (g_timeout > 0 && (spins & 255) == 0 && now_seconds() - t0 > g_timeout) {
            char msg[256];
            snprintf(msg, sizeof msg, "rank %d: %s on group %s did not complete within %.0f s: a peer rank died "
                     "or hangs; aborting the job", g_world_rank, what, c->name, g_timeout);
#ifdef MESHTRAIN_NCCL
            nccl_abort_all();
#endif
            comm_abort(EXIT_RUN_FAILURE, msg);
        }
    }
}

static int req_done(void *arg) { return comm_test(arg); }

void comm_wait(CommReq *r) {
    if (r->active) wait_until(req_done, r, r->c, r->what);
}

void comm_poll(CommReq *r, int (*stop)(void), double max_s) {
    double t0 = now_seconds();
    for (long spins = 0; !comm_test(r) && !stop() && now_seconds() - t0 < max_s; spins++) backoff(spins);
}

/* A plain MPI request (a peer may need one of our rings to move before it can reach the
 * call this request belongs to, so the rings move too). */
typedef struct { MPI_Request *q; const Comm *c; const char *what; } Plain;

static int plain_done(void *arg) {
    Plain *p = arg;
    for (int i = g_n_active - 1; i >= 0; i--)
        if (i < g_n_active) ring_advance(g_active[i]);
    int done = 0;
    check(MPI_Test(p->q, &done, MPI_STATUS_IGNORE), p->c, p->what);
    return done;
}

static void blocking(const Comm *c, int rc, MPI_Request *q, const char *what) {
    check(rc, c, what);
    Plain p = {q, c, what};
    wait_until(plain_done, &p, c, what);
    free(q);
}

void comm_allreduce(const Comm *c, float *buf, size_t n, CommOp op) {
    CommReq r;
    comm_iallreduce(c, buf, n, COMM_F32, op, &r, "all-reduce");
    comm_wait(&r);
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

void comm_reduce_scatter(const Comm *c, float *send, float *recv, size_t recv_n, CommOp op) {
    CommReq r;
    comm_ireduce_scatter(c, send, recv, recv_n, COMM_F32, op, &r, "reduce-scatter");
    comm_wait(&r);
}

void comm_allgather(const Comm *c, float *buf, size_t n) {
    CommReq r;
    comm_iallgather(c, buf, n, COMM_F32, &r, "all-gather");
    comm_wait(&r);
}

void comm_broadcast(const Comm *c, void *buf, size_t bytes, int root) {
    if (!c->impl) return;
    MPI_Request *q = xmalloc(sizeof *q);
    blocking(c, MPI_Ibcast(buf, count_of(bytes, c, "broadcast"), MPI_BYTE, root, mpi(c), q), q, "broadcast");
}

void comm_send(const Comm *c, const void *buf, size_t bytes, int peer, int tag) {
    if (!c->impl) return;
    MPI_Request *q = xmalloc(sizeof *q);
    blocking(c, MPI_Isend(buf, count_of(bytes, c, "send"), MPI_BYTE, peer, tag, mpi(c), q), q, "send");
}

void comm_recv(const Comm *c, void *buf, size_t bytes, int peer, int tag) {
    if (!c->impl) return;
    MPI_Request *q = xmalloc(sizeof *q);
    blocking(c, MPI_Irecv(buf, count_of(bytes, c, "recv"), MPI_BYTE, peer, tag, mpi(c), q), q, "recv");
}

void comm_barrier(const Comm *c) {
    if (!c->impl) return;
    MPI_Request *q = xmalloc(sizeof *q);
    blocking(c, MPI_Ibarrier(mpi(c), q), q, "barrier");
}
