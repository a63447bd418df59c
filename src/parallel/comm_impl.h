/* Internals shared by the comm files (see comm.h for what each holds): CommImpl, the rank
 * for messages, the MPI error check and bounded wait (comm.c), the ring requests
 * (comm_mpi.c), and in NCCL builds the communicators and comm stream (comm_nccl.c) and the
 * copy-engine all-reduce and reduce-scatter (comm_ce.c) and send/receive (comm_p2p_ce.c). */
#ifndef MESHTRAIN_COMM_IMPL_H
#define MESHTRAIN_COMM_IMPL_H
#include <mpi.h>
#include "comm.h"
#include "ops.h"
#ifdef MESHTRAIN_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

/* A group's transport: how its float collectives and its point-to-point messages move.
 * comm.c chooses one per group, once, at the group's first collective or message
 * (comm_backend_of): NCCL where the buffers are device memory (a device=cuda run; beside
 * NCCL's own transports its group-side paths: the copy-engine all-reduce, comm_ce.c, and
 * send/receive over mapped memory, comm_p2p_ce.c), MPI's rings where they are host memory;
 * a group of one takes MPI's, which move nothing. The host collectives (doubles, ints,
 * bytes, barrier: comm_mpi.c) always go over MPI, the job's bootstrap. */
typedef struct CommBackend {
    const char *name;
    void (*iallreduce)(const Comm *c, void *buf, size_t n, CommType t, CommOp op, CommReq *r, const char *what);
    void (*ireduce_scatter)(const Comm *c, void *send, void *recv, size_t recv_n, CommType t, CommOp op, CommReq *r,
                            const char *what);
    void (*iallgather)(const Comm *c, void *buf, size_t n, CommType t, CommReq *r, const char *what);
    int (*test)(CommReq *r);            /* 1 when done (and completed) */
    void (*wait_device)(CommReq *r);    /* the compute stream's later ops wait for r */
    void (*isend)(const Comm *c, const void *buf, size_t bytes, int peer, int tag, CommP2P *r, const char *what);
    void (*irecv)(const Comm *c, void *buf, size_t bytes, int peer, int tag, CommP2P *r, const char *what);
    void (*p2p_init)(const Comm *c, size_t max_bytes, int copy_engines);
    void (*p2p_wait)(CommP2P *r);
    void (*release)(const Comm *c);     /* the group's transport state, before its MPI communicator */
} CommBackend;
extern const CommBackend comm_mpi_backend;
#ifdef MESHTRAIN_NCCL
extern const CommBackend comm_nccl_backend;
#endif

/* The MPI communicator and a count of the collectives started on it: every rank starts
 * them in the same order, so the count gives each one its own message tag. */
typedef struct {
    const CommBackend *be;  /* chosen at the group's first use (comm.c) */
    MPI_Comm mc;
    unsigned seq;
    void *nccl;  /* ncclComm_t, made at the group's first collective on a device=cuda run */
    char *a2a;   /* copy-engine all-reduce: the all-to-all's receive buffer (comm_alloc), or NULL */
    size_t a2a_bytes;
    void *a2a_win;  /* its ncclWindow_t */
    int ce_ok;      /* ce_possible's answer, kept: 0 not asked yet, 1 yes, -1 no */
    void *p2p_stream;  /* send/receive on this group: their own stream (cudaStream_t) */
    size_t p2p_bytes;  /* comm_p2p_init's largest message */
    void *p2p_ce;      /* the copy-engine path's state (comm_p2p_ce.c), or NULL */
} CommImpl;
static inline MPI_Comm mpi(const Comm *c) { return ((CommImpl *)c->impl)->mc; }

extern int g_comm_world_rank;  /* this rank in the world, for messages */
extern uint64_t g_comm_bytes_sent;  /* comm_bytes_sent's count */

enum { K_ALLREDUCE, K_REDUCE_SCATTER, K_ALLGATHER };  /* CommReq.kind */
/* comm_hier.c: comm_test of a hierarchical all-reduce (r->chain) */
int comm_hier_test(CommReq *r);
static inline size_t type_size(CommType t) { return t == COMM_BF16 ? 2 : sizeof(float); }

/* comm.c. The group's transport (c->impl set): chosen at its first call, then kept. */
const CommBackend *comm_backend_of(const Comm *c);
#ifdef MESHTRAIN_NCCL
/* The group spans processes and moves device memory: its transport is NCCL. */
static inline int on_nccl(const Comm *c) { return c->impl && comm_backend_of(c) == &comm_nccl_backend; }
#endif
/* An MPI call's failure ends the job with one line naming the group. */
void comm_check(int rc, const Comm *c, const char *what);
/* Whether every rank of c is on this machine (collective over c; MPI_COMM_TYPE_SHARED). */
int comm_one_machine(const Comm *c);
/* c's ranks on this rank's machine: this rank's place among them and their count; returns
 * the lowest c rank among them (the same on each of them). Collective over c. */
int comm_host_first(const Comm *c, int *local_rank, int *local_size);
/* The one waiting loop: polls `done` until it returns nonzero, aborting the job after the
 * world's timeout. */
void comm_wait_until(int (*done)(void *), void *arg, const Comm *c, const char *what);

/* comm_mpi.c: the MPI backend's table (above); its rings move every ring in flight while
 * they wait, so the host collectives there take part too. */

#ifdef MESHTRAIN_NCCL
/* comm_nccl.c */
extern cudaStream_t g_cstream;  /* the communication stream */
static inline ncclDataType_t nccl_type(CommType t) { return t == COMM_BF16 ? ncclBfloat16 : ncclFloat32; }
/* Makes c's NCCL communicator (every rank of c together), with the zero-CTA policy when
 * cta_zero; makes the comm stream first if there is none. */
ncclComm_t nccl_make(const Comm *c, const char *what, int cta_zero);
/* Destroys the group's communicator, if any, after its copy-engine buffers. */
void nccl_free(CommImpl *ci);
/* Aborts every communicator, before MPI_Abort on an error or a lost peer. */
void nccl_abort_all(void);
/* An NCCL or CUDA call's failure aborts the communicators and ends the job with one line. */
_Noreturn void nccl_die(const Comm *c, const char *what, const char *call, const char *err);
void nchk(ncclResult_t rc, const Comm *c, const char *what, const char *call);
void cchk(cudaError_t e, const Comm *c, const char *what, const char *call);
/* A request that holds an event (a collective's, or comm_ipc_mark's): 1 once it is done,
 * the compute stream then waiting for it. */
int nccl_test(CommReq *r);
/* The group's send/receive stream (made at its first use), and its wait for the compute
 * stream's work so far (which wrote the buffer sent, or last read the one received into),
 * through ev, which the caller records again after the message. */
cudaStream_t p2p_stream(const Comm *c, const char *what);
void p2p_after_compute(const Comm *c, cudaStream_t s, cudaEvent_t ev, const char *what);

/* comm_ipc.c: the stream memory operations on a 64-bit counter (ctr: device-accessible,
 * here or a peer's mapping); a failure ends the job naming c and what. Before them,
 * ipc_group_possible (collective over c) says whether every rank can take the IPC path (one
 * machine, the driver's 64-bit memory operations, peer access to every other rank's GPU),
 * and ipc_agreed whether every rank's ok is nonzero (the MIN over c). */
int ipc_group_possible(const Comm *c, const char *what);
int ipc_agreed(const Comm *c, int ok, const char *what);
/* Every rank's block `mine` (cuda_malloc, whole pages) mapped by every other rank of c
 * (collective): each writes a token of its own at mine + token_at (8 bytes the caller keeps
 * for it, after its counters, which it has zeroed), publishes its handle, the token and
 * token_at, and opens the others', checking each mapping shows the token where its owner put
 * it. Returns 1 where every rank did (blocks[i]: rank i's block as this rank addresses it,
 * blocks[c->rank] = mine); else closes what it opened and returns 0 (mine stays the caller's). */
int ipc_map_blocks(const Comm *c, char *mine, size_t token_at, char **blocks, const char *what);
void ipc_wait64(void *stream, const void *ctr, uint64_t v, const Comm *c, const char *what);
void ipc_write64(void *stream, void *ctr, uint64_t v, const Comm *c, const char *what);

/* comm_p2p_ce.c: send/receive on the copy engines (pp_copy_engines=true, comm_p2p_init). */
static inline int p2p_ce_on(const Comm *c) { return ((CommImpl *)c->impl)->p2p_ce != NULL; }
/* Sets c up for it (collective over c); 0 where both ranks take NCCL instead. */
int p2p_ce_init(const Comm *c, size_t max_bytes);
void p2p_ce_send(const Comm *c, const void *buf, size_t bytes, CommP2P *r, const char *what);
void p2p_ce_recv(const Comm *c, void *buf, size_t bytes, CommP2P *r, const char *what);
/* comm_p2p_wait of a copy-engine receive: the compute stream waits for it on the device; 0
 * if r is not one. */
int p2p_ce_wait_device(CommP2P *r);
/* Releases c's copy-engine state, if any (collective over c, from comm_free). */
void p2p_ce_release(const Comm *c);

/* comm_ce.c */
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
#define HAVE_CE 1  /* symmetric windows and the zero-CTA policy: the copy-engine all-reduce */
#else
#define HAVE_CE 0
#endif
/* some communicator reduces on the copy engines (comm_alloc), or a pipeline link sends on
 * them: streams wait in memory operations for a peer's writes */
extern int g_ce_any;
/* Frees the group's copy-engine buffers, before its communicator goes. */
void ce_release(CommImpl *ci, const char *what);
#if HAVE_CE
/* Queues the all-reduce of a comm_alloc buffer on the copy engines; 0 if buf is not one. */
int ce_allreduce(const Comm *c, void *buf, size_t n, CommType t, CommOp op, ncclComm_t nc, const char *what);
#endif
#endif
#endif
