/* comm_ce — the copy-engine all-reduce (NCCL 2.28 or later): comm_alloc's buffers in
 * symmetric NCCL windows, an all-reduce over one as an all-to-all, a sum kernel and an
 * all-gather on the comm stream (see comm_alloc in comm.h); elsewhere comm_alloc is
 * op_alloc. */
#include <stdlib.h>
#include "comm_impl.h"
#include "env.h"
#include "util.h"
#ifdef MESHTRAIN_NCCL
#include "ops_cuda.h"

int g_ce_any;

#if HAVE_CE
/* Copy-engine all-reduce (comm_alloc). Buffers in NCCL symmetric windows, to find the
 * all-reduces over them and to deregister and free them. */
typedef struct { char *p; size_t bytes; void *win; ncclComm_t nc; const Comm *c; } RegBuf;
/* DDP takes one buffer a group (its gradients). Past this, comm_alloc gives op_alloc memory,
 * whose collectives run on NCCL's kernels. */
#define MAX_REG 64
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
    int v = 0, ok;
    ok = ncclGetVersion(&v) == ncclSuccess && v >= NCCL_VERSION(2, 28, 0);
    ok = comm_one_machine(c) && ok;
    comm_allreduce_min_int(c, &ok, 1);
    ci->ce_ok = ok ? 1 : -1;
    return ok;
}

/* The copy-engine all-reduce of a comm_alloc buffer, queued on the comm stream; 0 if buf is
 * not one (or n does not divide into the group's blocks). In pieces of the all-to-all
 * buffer's size: an all-to-all gives this rank every rank's copy of its block, one kernel
 * sums them in rank order, an all-gather sends the sum to all; NCCL moves both by copy
 * engine. */
int ce_allreduce(const Comm *c, void *buf, size_t n, CommType t, CommOp op, ncclComm_t nc, const char *what) {
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

void ce_release(CommImpl *ci, const char *what) {
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
    return g_ce_wanted && c->size > 1 && on_nccl(c) && ce_possible(c);
#else
    (void)c;
    return 0;
#endif
}

size_t comm_ce_buffer_bytes(size_t bytes) {
    /* (a test hook: all-reduces in many pieces) */
    size_t cap = (size_t)hook_int(HOOK_CE_BUFFER_BYTES, (long long)COMM_CE_BUFFER_BYTES);
    return bytes < cap ? bytes : cap;
}

void *comm_alloc(const Comm *c, size_t bytes) {
#if defined(MESHTRAIN_NCCL) && HAVE_CE
    const char *what = "copy-engine buffer registration (copy_engines=false avoids it)";
    CommImpl *ci = c->impl;
    /* The communicator must be new, to be made with the zero-CTA policy, unless it already
     * has the all-to-all buffer; every rank takes the same branch (the same calls have
     * reached here on all of them). */
    if (bytes && g_n_reg < MAX_REG && on_nccl(c) && (ci->a2a || !ci->nccl) && comm_copy_engines_possible(c)) {
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
