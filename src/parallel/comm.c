/* comm — the public functions of comm.h: the world and its groups, the choice of each
 * group's transport (comm_impl.h's CommBackend: MPI's rings, comm_mpi.c, or NCCL,
 * comm_nccl.c) and the one place every collective and message is dispatched to it, the
 * bounded wait, and the agreement on set-up failures. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "comm_impl.h"
#include "env.h"
#include "trace.h"
#include "util.h"

static int g_mpi;            /* MPI initialised by us */
static double g_timeout;     /* seconds; 0 = forever */
int g_comm_world_rank;
uint64_t g_comm_bytes_sent;

uint64_t comm_bytes_sent(void) { return g_comm_bytes_sent; }

int comm_using_mpi(void) { return g_mpi; }

static int launched_by_mpi(void) { return env_launched(); }

_Noreturn void comm_abort(int code, const char *msg) {
    fprintf(stderr, "meshtrain: %s\n", msg);
    fflush(stderr);
    if (g_mpi) MPI_Abort(MPI_COMM_WORLD, code);
    exit(code);
}

void comm_check(int rc, const Comm *c, const char *what) {
    if (rc == MPI_SUCCESS) return;
    char s[MPI_MAX_ERROR_STRING], msg[MPI_MAX_ERROR_STRING + 128];
    int len = 0;
    MPI_Error_string(rc, s, &len);
    snprintf(msg, sizeof msg, "rank %d: %s on group %s failed: %s", g_comm_world_rank, what, c ? c->name : "world", s);
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
    g_comm_world_rank = world->rank;
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

double comm_local_sum(double v) {
    if (!g_mpi) return v;
    MPI_Comm local;
    double sum = 0;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local);
    MPI_Allreduce(&v, &sum, 1, MPI_DOUBLE, MPI_SUM, local);
    MPI_Comm_free(&local);
    return sum;
}

int comm_one_machine(const Comm *c) {
    MPI_Comm shm;
    int local;
    comm_check(MPI_Comm_split_type(mpi(c), MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &shm), c, "comm split (node)");
    MPI_Comm_size(shm, &local);
    MPI_Comm_free(&shm);
    return local == c->size;
}

int comm_host_first(const Comm *c, int *local_rank, int *local_size) {
    *local_rank = 0, *local_size = 1;
    if (!c->impl) return c->rank;
    MPI_Comm shm;
    comm_check(MPI_Comm_split_type(mpi(c), MPI_COMM_TYPE_SHARED, c->rank, MPI_INFO_NULL, &shm), c, "comm split (node)");
    int first = c->rank;
    MPI_Comm_rank(shm, local_rank);
    MPI_Comm_size(shm, local_size);
    MPI_Allreduce(MPI_IN_PLACE, &first, 1, MPI_INT, MPI_MIN, shm);
    MPI_Comm_free(&shm);
    return first;
}

void comm_split(const Comm *parent, int color, int key, const char *name, Comm *out) {
    memset(out, 0, sizeof *out);
    snprintf(out->name, sizeof out->name, "%s", name);
    out->size = 1;
    if (!parent->impl) return;
    CommImpl *ci = xcalloc(1, sizeof *ci);
    comm_check(MPI_Comm_split(mpi(parent), color < 0 ? MPI_UNDEFINED : color, key, &ci->mc), parent, "comm split");
    if (ci->mc == MPI_COMM_NULL) {  /* a negative color: in no group */
        free(ci);
        return;
    }
    MPI_Comm_set_errhandler(ci->mc, MPI_ERRORS_RETURN);
    MPI_Comm_rank(ci->mc, &out->rank);
    MPI_Comm_size(ci->mc, &out->size);
    if (out->size > 1) out->impl = ci;
    else { MPI_Comm_free(&ci->mc); free(ci); }
}

const CommBackend *comm_backend_of(const Comm *c) {
    CommImpl *ci = c->impl;
    if (!ci->be) {
#ifdef MESHTRAIN_NCCL
        ci->be = ops_host_memory() ? &comm_mpi_backend : &comm_nccl_backend;
#else
        ci->be = &comm_mpi_backend;
#endif
    }
    return ci->be;
}

/* Every float collective and message goes through here: a group of one to MPI's table (its
 * requests move nothing), any other group to its own. */
static const CommBackend *be(const Comm *c) { return c->impl ? comm_backend_of(c) : &comm_mpi_backend; }

void comm_free(Comm *c) {
    if (c->impl) {
        CommImpl *ci = c->impl;
        if (ci->be) ci->be->release(c);
        MPI_Comm_free(&ci->mc);
        free(c->impl);
    }
    c->impl = NULL;
}

int comm_test(CommReq *r) {
    if (r->chain) return comm_hier_test(r);
    return !r->active || be(r->c)->test(r);
}

void comm_iallreduce(const Comm *c, void *buf, size_t n, CommType t, CommOp op, CommReq *r, const char *what) {
    be(c)->iallreduce(c, buf, n, t, op, r, what);
}

void comm_ireduce_scatter(const Comm *c, void *send, void *recv, size_t recv_n, CommType t, CommOp op, CommReq *r,
                          const char *what) {
    be(c)->ireduce_scatter(c, send, recv, recv_n, t, op, r, what);
}

void comm_iallgather(const Comm *c, void *buf, size_t n, CommType t, CommReq *r, const char *what) {
    be(c)->iallgather(c, buf, n, t, r, what);
}

void comm_isend(const Comm *c, const void *buf, size_t bytes, int peer, int tag, CommP2P *r, const char *what) {
    *r = (CommP2P){NULL, c, what, NULL};
    if (c->impl) be(c)->isend(c, buf, bytes, peer, tag, r, what);
}

void comm_irecv(const Comm *c, void *buf, size_t bytes, int peer, int tag, CommP2P *r, const char *what) {
    *r = (CommP2P){NULL, c, what, NULL};
    if (c->impl) be(c)->irecv(c, buf, bytes, peer, tag, r, what);
}

void comm_p2p_init(const Comm *c, size_t max_bytes, int copy_engines) {
    if (!c->impl) return;
    ((CommImpl *)c->impl)->p2p_bytes = max_bytes;
    be(c)->p2p_init(c, max_bytes, copy_engines);
}

void comm_p2p_wait(CommP2P *r) {
    if (r->c && r->c->impl && (r->q || r->ev)) be(r->c)->p2p_wait(r);
}

enum { COMM_ALLTOALL_TAG = 31001 };  /* above the rings' tags (1..30000, comm_mpi.c) */

void comm_alltoallv(const Comm *c, const void *send, const size_t *send_bytes, void *recv, const size_t *recv_bytes,
                    const char *what) {
    int n = c->size, me = c->rank;
    size_t so = 0, ro = 0, self_so = 0, self_ro = 0;
    CommP2P *q = xcalloc(2 * (size_t)n, sizeof *q);
    /* every receive posted before any send: no pair waits on the other's order */
    for (int j = 0; j < n; j++) {
        if (j == me) self_ro = ro;
        else if (recv_bytes[j]) comm_irecv(c, (char *)recv + ro, recv_bytes[j], j, COMM_ALLTOALL_TAG, &q[j], what);
        ro += recv_bytes[j];
    }
    for (int j = 0; j < n; j++) {
        if (j == me) self_so = so;
        else if (send_bytes[j]) comm_isend(c, (const char *)send + so, send_bytes[j], j, COMM_ALLTOALL_TAG, &q[n + j], what);
        so += send_bytes[j];
    }
    if (send_bytes[me] != recv_bytes[me])
        die(EXIT_RUN_FAILURE, "internal: %s: rank %d sends itself %zu bytes but expects %zu", what, me, send_bytes[me],
            recv_bytes[me]);
    if (send_bytes[me]) memcpy((char *)recv + self_ro, (const char *)send + self_so, send_bytes[me]);
    for (int j = 0; j < 2 * n; j++) comm_p2p_wait(&q[j]);
    free(q);
}

/* Between polls: spin a while, then sleep 20 us a round so as not to starve the other
 * ranks' cores. */
static void backoff(long spins) {
    if (spins > 1000) {
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
    }
}

/* Seconds the main thread has spent in comm_wait_until (comm_blocked_seconds). */
static double g_blocked_s;
double comm_blocked_seconds(void) { return g_blocked_s; }

/* The one waiting loop: polls `done` (which moves every ring in flight) so that a lost
 * peer ends the run after g_timeout seconds instead of hanging it. */
void comm_wait_until(int (*done)(void *), void *arg, const Comm *c, const char *what) {
    double t0 = now_seconds();
    for (long spins = 0;; spins++) {
        if (done(arg)) {
            g_blocked_s += now_seconds() - t0;
            return;
        }
        backoff(spins);
        if (g_timeout > 0 && (spins & 255) == 0 && now_seconds() - t0 > g_timeout) {
            char msg[256];
            snprintf(msg, sizeof msg, "rank %d: %s on group %s did not complete within %.0f s: a peer rank died "
                     "or hangs; aborting the job", g_comm_world_rank, what, c->name, g_timeout);
#ifdef MESHTRAIN_NCCL
            nccl_abort_all();
#endif
            comm_abort(EXIT_RUN_FAILURE, msg);
        }
    }
}

static int req_done(void *arg) { return comm_test(arg); }

void comm_wait(CommReq *r) {
    if (r->active) comm_wait_until(req_done, r, r->c, r->what);
}

void comm_wait_device(CommReq *r) {
    if (r->active) be(r->c)->wait_device(r);
}

void comm_poll(CommReq *r, int (*stop)(void), double max_s) {
    double t0 = now_seconds();
    for (long spins = 0; !comm_test(r) && !stop() && now_seconds() - t0 < max_s; spins++) backoff(spins);
}

void comm_allreduce(const Comm *c, float *buf, size_t n, CommOp op) {
    CommReq r;
    comm_iallreduce(c, buf, n, COMM_F32, op, &r, "all-reduce");
    comm_wait(&r);
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
