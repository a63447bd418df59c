/* comm — collectives on groups of ranks, on flat buffers. Backends: MPI for CPU ranks,
 * and a built-in one for a group of one process (no MPI call at all, so a plain
 * `meshtrain train` needs no launcher). A group of one never reads or writes its buffers
 * on the host (they may be device memory on a one-GPU run): its only data movement, the
 * reduce-scatter's copy into recv, goes through op_copy.
 *
 * NCCL backend (builds with MESHTRAIN_NCCL, i.e. nvcc and nccl.h found): on a device=cuda
 * run (ops_host_memory() == 0) the float collectives of a group of more than one rank run
 * as ncclAllReduce / ncclReduceScatter / ncclAllGather on one communication stream (an
 * all-reduce over a comm_alloc buffer on the copy engines instead, see there). Each
 * group's NCCL communicator is made at its first float collective (rank 0 of the group
 * makes the id, broadcast over the group's MPI communicator), so the device is already
 * selected by ops_init. The comm stream first waits for the compute stream's work so far;
 * the CommReq then holds a CUDA event recorded after the collective: comm_test queries it,
 * and once it is done makes the compute stream wait on it, so later ops see the result.
 * comm_wait polls it within comm_timeout (and checks ncclCommGetAsyncError). The host-scalar
 * collectives (doubles, ints, bytes, barrier) stay on MPI.
 *
 * Every wait is bounded: a collective that does not complete within comm_timeout seconds
 * (a peer rank died or hangs) ends this rank with a one-line message and aborts the job,
 * instead of hanging forever.
 *
 * Where each part lives: comm.c, the world and its groups, the choice of each group's
 * transport (a table of functions, comm_impl.h's CommBackend, chosen once per group) and the
 * one place every collective and message is dispatched to it, the bounded wait; comm_mpi.c,
 * the MPI transport (rings) and the host collectives; comm_nccl.c, the NCCL transport
 * (communicators, comm stream, events, abort), with its group-side paths beside it:
 * comm_ce.c, comm_alloc and the copy-engine all-reduce; comm_p2p_ce.c, the pipeline's
 * send/receive on the copy engines; comm_ipc.c, memory every rank of a group maps (tensor
 * parallel's fused sums); comm_impl.h, what they share. */
#ifndef MESHTRAIN_COMM_H
#define MESHTRAIN_COMM_H
#include <stddef.h>
#include <stdint.h>
#include "util.h"

typedef enum { COMM_SUM, COMM_AVG } CommOp;
/* Element type of the non-blocking collectives' buffers: fp32, or bf16 (precision=bf16's
 * gradients and parameters; NCCL and groups of one only, the MPI rings are fp32). */
typedef enum { COMM_F32, COMM_BF16 } CommType;

typedef struct {
    int rank, size;
    void *impl;        /* CommImpl* (comm_impl.h); NULL for a group of one */
    char name[16];     /* "world", "dp", "shard", ... for messages */
} Comm;

/* A collective in flight: a ring algorithm over point-to-point messages, moved along
 * chunk by chunk by comm_test / comm_wait (so a fixed staging buffer is all the memory it
 * needs, on every rank alike, and every rank ends with bitwise the same result). */
typedef struct {
    const Comm *c;
    int kind, phase, step, chunk, posted, active, avg;
    float *buf, *out, *stage;
    size_t n, total;   /* block length; total length of buf (elements) */
    size_t esz;        /* bytes per element */
    int tag;
    void *sreq, *rreq; /* MPI_Request* */
    const char *what;  /* for timeout messages */
    void *ev;          /* NCCL backend: cudaEvent_t recorded on the comm stream after the
                        * collective; NULL for MPI and for a group of one */
    void *chain;       /* a hierarchical all-reduce's stages (comm_hier.c); NULL otherwise */
} CommReq;

/* Bytes this process has sent to other ranks through MPI since it started: the rings'
 * messages, the all-to-alls' and the point-to-point messages (not the host collectives of a
 * few scalars, nor NCCL's traffic, which NCCL moves itself). */
uint64_t comm_bytes_sent(void);
/* Seconds this process has spent blocked waiting for communication since it started (every
 * wait goes through one loop). On CPU ranks, whose compute is synchronous, that is the time a
 * rank had nothing to do; on a GPU the device may be busy meanwhile. */
double comm_blocked_seconds(void);

/* Starts the world: MPI when this process was started by a launcher (mpirun, srun; it
 * looks at OMPI_COMM_WORLD_SIZE, PMI_SIZE, PMIX_RANK and SLURM_NTASKS), else a world of
 * one. timeout_s bounds every wait (0 = forever). */
void comm_world_init(Comm *world, double timeout_s);
void comm_world_finalize(void);
int comm_using_mpi(void);
/* Hostname-local rank and size (for hybrid sharding's default group size). */
int comm_local_size(void);
/* The sum of v over the ranks of this machine (the ranks that share its memory); collective
 * over the world, every rank calls it together. v itself in a world of one. */
double comm_local_sum(double v);

/* Sub-group of the ranks with the same color, ordered by key (MPI_Comm_split); a negative
 * color: none (out is a group of one). */
void comm_split(const Comm *parent, int color, int key, const char *name, Comm *out);
void comm_free(Comm *c);

/* Device memory for a buffer that c's all-reduces run over (DDP's gradients); zeroed. On
 * an NCCL group whose ranks share one machine (NCCL 2.28 or later; comm_set_copy_engines,
 * on by default) it lies in a symmetric NCCL window, and an all-reduce over it runs on the
 * GPUs' copy engines: an all-to-all gives each rank every rank's copy of its block, one
 * short kernel on the comm stream sums them in rank order, and an all-gather sends the sums
 * to all. No SM is held while the bytes move or while a rank waits for a slower peer, which
 * leaves the backward beside it more of the card (and of its power). It takes one more
 * buffer of comm_ce_buffer_bytes (sized by c's first comm_alloc), in pieces of which larger
 * all-reduces run. Elsewhere it is op_alloc memory and NCCL's kernels. Every
 * rank of c calls it together, with the same sizes in the same order (it may make c's NCCL
 * communicator, with NCCL's zero-CTA policy: before any other collective on c, or it gives
 * op_alloc memory; the other collectives on c then still run, on NCCL's kernels). */
#define COMM_CE_BUFFER_BYTES ((size_t)64 << 20)
void *comm_alloc(const Comm *c, size_t bytes);
/* Frees comm_alloc memory (or op_alloc memory); before c itself is freed. */
void comm_buffer_free(void *p);
void comm_set_copy_engines(int on);
/* Whether c's comm_alloc buffers are reduced by the copy engines. */
int comm_copy_engines_active(const Comm *c);
/* Whether comm_alloc on c will take the copy-engine path (asked before any buffer, for the
 * memory estimate): comm_set_copy_engines on, and c's ranks on one machine with NCCL 2.28
 * or later. Every rank of c calls it together. */
int comm_copy_engines_possible(const Comm *c);
/* The all-to-all buffer that comm_alloc adds for a first buffer of `bytes`. */
size_t comm_ce_buffer_bytes(size_t bytes);

/* Non-blocking collectives on n elements of type t; in place where it says so. */
void comm_iallreduce(const Comm *c, void *buf, size_t n, CommType t, CommOp op, CommReq *r, const char *what);
/* send holds size * recv_n elements; rank i receives block i (reduced) into recv. send is
 * used as scratch: its contents are undefined afterwards. */
void comm_ireduce_scatter(const Comm *c, void *send, void *recv, size_t recv_n, CommType t, CommOp op, CommReq *r,
                          const char *what);
/* In place: buf holds size * n elements, this rank's block at rank * n; every block is filled. */
void comm_iallgather(const Comm *c, void *buf, size_t n, CommType t, CommReq *r, const char *what);
/* Hierarchical all-reduce (comm_hier.c) of buf's n elements over the ranks of node x cross
 * (node and node_gather: the ranks of one machine, comm_split_hosts; cross: the ranks with the
 * same place on every machine):
 * reduce-scatter inside the machine, all-reduce of this rank's block across machines,
 * all-gather inside the machine, each stage started once the one before is done. n must
 * divide by node->size. op COMM_AVG averages over all node x cross ranks. The stages of
 * every hierarchical all-reduce in flight are issued in the order the all-reduces were
 * begun, so every rank issues each group's collectives in one order. Host memory (CPU ranks). */
void comm_iallreduce_hier(const Comm *node, const Comm *node_gather, const Comm *cross, void *buf, size_t n, CommType t,
                          CommOp op, CommReq *r, const char *what);
/* The machines of c's ranks (MPI_COMM_TYPE_SHARED), as groups: node = c's ranks on this
 * machine (and node_gather, the same ranks again: a hierarchical all-reduce's last stage runs
 * on it, so that each group carries one stage's collectives, begun in one order), cross = c's
 * ranks with this rank's place on every machine. Returns 1 where c spans more than one
 * machine with the same number (more than one) of its ranks on each, else 0 with groups of
 * one. Collective over c. */
int comm_split_hosts(const Comm *c, Comm *node, Comm *node_gather, Comm *cross);
/* Returns 1 when done (and completes it), 0 if still in flight. Drives MPI progress. */
int comm_test(CommReq *r);
void comm_wait(CommReq *r);
/* The compute stream's later ops wait for r: NCCL, on the device (r stays in flight for
 * comm_test / comm_wait, which the host must still call); elsewhere comm_wait. */
void comm_wait_device(CommReq *r);
/* Polls r as comm_wait does until it completes, stop() returns nonzero or max_s seconds
 * pass, whichever is first; never aborts (comm_wait, with its timeout, does that). */
void comm_poll(CommReq *r, int (*stop)(void), double max_s);

/* Blocking forms. */
void comm_allreduce(const Comm *c, float *buf, size_t n, CommOp op);
void comm_allreduce_double(const Comm *c, double *buf, size_t n);  /* sum */
void comm_allreduce_max_int(const Comm *c, int *buf, size_t n);
void comm_allreduce_min_int(const Comm *c, int *buf, size_t n);
void comm_allreduce_max_u64(const Comm *c, uint64_t *buf, size_t n);
/* buf holds size blocks of `each` bytes, this rank's at rank x each; every block is filled. */
void comm_allgather_bytes(const Comm *c, void *buf, size_t each);
void comm_reduce_scatter(const Comm *c, float *send, float *recv, size_t recv_n, CommOp op);
void comm_allgather(const Comm *c, float *buf, size_t n);
void comm_broadcast(const Comm *c, void *buf, size_t bytes, int root);
void comm_send(const Comm *c, const void *buf, size_t bytes, int peer, int tag);
void comm_recv(const Comm *c, void *buf, size_t bytes, int peer, int tag);
void comm_barrier(const Comm *c);
/* A point-to-point message in flight (pipeline stages' activations and their gradients,
 * host memory over MPI): comm_isend / comm_irecv start it, comm_p2p_wait completes it
 * within comm_timeout (a peer that never answers ends the job). A request never started
 * (zeroed) or already completed waits for nothing. */
typedef struct { void *q; const Comm *c; const char *what; void *ev; } CommP2P;
void comm_isend(const Comm *c, const void *buf, size_t bytes, int peer, int tag, CommP2P *r, const char *what);
void comm_irecv(const Comm *c, void *buf, size_t bytes, int peer, int tag, CommP2P *r, const char *what);
void comm_p2p_wait(CommP2P *r);
/* All-to-all over c (host memory: CPU ranks), blocking within comm_timeout: rank i's block
 * for rank j is send_bytes[j] bytes of send (blocks back to back in rank order) and arrives
 * as block i of recv (recv_bytes[i] bytes, in rank order). Both sides know the sizes (a
 * fixed size, or counts exchanged first), and a zero-byte block sends nothing. Every rank
 * of c calls it together, in the same order as its other collectives on c. */
void comm_alltoallv(const Comm *c, const void *send, const size_t *send_bytes, void *recv, const size_t *recv_bytes,
                    const char *what);
/* Collective over c, before its first send or receive: on a device=cuda run makes c's NCCL
 * communicator now, while every rank is here (a group is best used for one direction of
 * traffic: a stage's sends wait in its stream for the peer's receive). max_bytes: the largest
 * message this rank will send or receive on c (0: none), for the copy-engine path below.
 *
 * copy_engines (the key pp_copy_engines, true by default; false keeps NCCL's kernels;
 * comm_p2p_ce.c): a two-rank group that
 * carries messages one way, from its rank 0 to its rank 1 (step.c's links), with both GPUs
 * on one machine and peer access between them, moves them with no SM at all instead of
 * NCCL's kernels: the copy engines through CUDA IPC into a ring of COMM_P2P_CE_SLOTS slots
 * of max_bytes on the receiver, synchronised by stream memory operations. Both ranks agree
 * on the path (else both take NCCL). A receive there completes on the device: the compute
 * stream waits for it, the host does not (see comm_p2p_drain). */
void comm_p2p_init(const Comm *c, size_t max_bytes, int copy_engines);
#define COMM_P2P_CE_SLOTS 4
/* MESHTRAIN_PP_SKIP_COPIES=1 (a timing experiment for the benchmarks, never for training): on
 * the copy engines' path the messages' copies are left out, the counters kept, so the
 * schedule runs as before without moving a byte, and the step's time against a normal run's
 * is what the transfers cost it (not hidden by compute). The results are wrong. Another value
 * than 0 or 1 ends the run (exit 2). */
int comm_p2p_skip_copies(void);
/* Whether c's messages take the copy engines: 1, 0 (NCCL or MPI), or -1 where comm_p2p_init
 * was given no messages. */
int comm_p2p_on_copy_engines(const Comm *c);
/* Device memory the copy-engine path takes for a link direction of messages of up to msg
 * bytes: the receiving end's ring and the counters of both ends (for the memory estimate). */
size_t comm_p2p_ce_bytes(size_t msg);
/* Waits on the host, within comm_timeout, until every message received on c so far is
 * complete (a peer that never sends ends the job). Only copy-engine receives need it: theirs
 * completes on the device, and a later host wait without a bound (a download) must not wait
 * for it; elsewhere comm_p2p_wait has done it. */
void comm_p2p_drain(const Comm *c);
/* comm_ipc.c: a block of device memory on every rank of c that every other rank maps (CUDA
 * IPC), with n_ctr 64-bit counters after `bytes` of data, zeroed, that other ranks write and
 * the owner's compute stream waits on (stream memory operations: no SM held). Collective
 * over c; NULL on every rank where any rank cannot (CPU ranks, another machine, no peer
 * access or 64-bit memory operations). Tensor parallel's fused sums (tensor.c). */
typedef struct CommIpc CommIpc;
CommIpc *comm_ipc_open(const Comm *c, size_t bytes, int n_ctr, const char *what);
/* Device memory one rank's block takes (whole 2 MiB pages), for the memory estimate. */
size_t comm_ipc_bytes(size_t bytes, int n_ctr);
/* rank's block as this rank addresses it (its own, or the mapping of another's). */
char *comm_ipc_block(const CommIpc *w, int rank);
/* On the compute stream (side = 0) or one of the block's side streams (copies beside the
 * compute stream: 1 .. size - 1 one stream a peer, size one more for copies in an order of
 * their own), after that stream's work so far (a memory fence first): rank's counter i := v. */
void comm_ipc_set(const CommIpc *w, int side, int rank, int i, uint64_t v);
/* That stream waits until this rank's counter i >= v. */
void comm_ipc_wait(const CommIpc *w, int side, int i, uint64_t v);
/* r: a request complete once that stream's work so far is (comm_wait waits for it within
 * comm_timeout: a peer that never writes ends the job there; comm_wait_device makes the
 * compute stream wait for it). */
void comm_ipc_mark(const CommIpc *w, int side, CommReq *r, const char *what);
/* Every side stream waits for the compute stream's work so far. */
void comm_ipc_side_after_compute(const CommIpc *w);
/* Fence k (0 .. COMM_IPC_FENCES - 1): record marks stream `from`'s work so far (0: the compute
 * stream, 1 .. size the side streams); await makes stream `to`'s later work wait for the
 * last record (none yet: nothing to wait for). */
#define COMM_IPC_FENCES 64
void comm_ipc_record(const CommIpc *w, int from, int k);
void comm_ipc_await(const CommIpc *w, int to, int k);
/* On side stream `side`: bytes from src to dst (device memory here, or a mapped block: a copy engine). */
void comm_ipc_side_copy(const CommIpc *w, int side, void *dst, const void *src, size_t bytes);
/* Collective over the group (NULL: nothing). */
void comm_ipc_close(CommIpc *w);
/* Set-up checks agreed on by every rank of w (collective): when any rank's f holds a
 * failure, the lowest such rank prints its message once, naming itself, and every rank
 * exits with that rank's code; else nothing happens. */
void comm_exit_if_failed(const Comm *w, const Fail *f);
/* Ends every rank of the job (MPI_Abort) after printing msg; exit code `code`. */
_Noreturn void comm_abort(int code, const char *msg);
#endif
