#include "tensor.h"
#include <stdlib.h>
#include <string.h>
#include "comm.h"
#include "ops.h"
#include "util.h"

/* Every tensor-parallel collective runs on the comm stream (NCCL); the compute stream waits
 * for it there (comm_wait_device) when the model joins it, so the GPU's queue does not drain
 * at each of a layer's collectives, and a collective begun early overlaps the products the
 * model queues before joining it. The host polls (within comm_timeout) only the one TP_LAG
 * collectives back, and tp_flush the rest. Tickets number the collectives; ticket t uses
 * slot t % TP_LAG until it is retired. Activations are bf16 there with precision=mixed or
 * bf16, which NCCL sums as they are. On CPU ranks each completes at its begin.
 * The model splits each collective into c chunks (Model's tp_chunks, up to TP_MAX_CHUNKS):
 * a layer begins 4 c of them in the forward under sequence parallel, 6 c in the backward,
 * and holds up to 2 c begun and not yet joined. TP_LAG bounds only how far the host runs
 * ahead of the device, not what it may hold unjoined: a ticket retired before its join is
 * complete, and its join waits for nothing. At 8, c = 4 would have had the host wait for the
 * collective half a layer back, the queue it keeps ahead of the GPU (and the slack for its
 * own pauses) shrinking with c; 64 keeps a layer queued at c = 16. No wait can deadlock:
 * every rank begins the group's collectives in the same order, and the one waited for was
 * begun after all the work it depends on was queued. */
#define TP_LAG 64
static CommReq g_req[TP_LAG];
static long g_next, g_done;  /* tickets [g_done, g_next) are in flight */

static void retire_oldest(void) { comm_wait(&g_req[g_done++ % TP_LAG]); }

static void tp_flush(void *ctx) {
    (void)ctx;
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

static void tp_join(void *ctx, long t) {
    (void)ctx;
    if (t >= g_done && t < g_next) comm_wait_device(&g_req[t % TP_LAG]);
}

static CommType act_type(void) { return ops_act_size() == 2 ? COMM_BF16 : COMM_F32; }

static long tp_allreduce_begin(void *ctx, void *buf, size_t n) {
    CommReq *r = next_slot();
    comm_iallreduce(ctx, buf, n, act_type(), COMM_SUM, r, "tensor-parallel all-reduce");
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

/* A count knob: the environment variable `name` (1 to TP_MAX_CHUNKS), else dflt; a malformed
 * value ends the run (exit 2). */
static int count_asked(const char *name, int dflt) {
    const char *e = getenv(name);
    if (!e) return dflt;
    char *end;
    long c = strtol(e, &end, 10);
    if (end == e || *end || c < 1 || c > TP_MAX_CHUNKS)
        die_once(EXIT_BAD_INPUT, "%s=%s: not a whole number from 1 to %d", name, e, TP_MAX_CHUNKS);
    return (int)c;
}

/* The chunks asked for: MESHTRAIN_TP_CHUNKS (an A/B knob for the GPU benchmarks, not a run
 * key: it changes the speed only, and the results within rounding), else TP_CHUNKS. 1, as
 * measured on H200s (bench/RESULTS.md, session 15): NCCL's kernels take SMs from the
 * products they run beside, and the smaller products run slower, so 2 and 4 chunks were
 * 1-6% slower at tp 2 and up to 17% at tp 4. */
#define TP_CHUNKS 1

/* The forward's groups of rows without sequence parallel (Model's tp_groups):
 * MESHTRAIN_TP_OVERLAP (an A/B knob like MESHTRAIN_TP_CHUNKS), else TP_GROUPS. 1, as
 * measured on two H100s (bench/RESULTS.md, session 18): with NCCL's kernels the groups'
 * all-reduces, though beside products, take their SMs, and the layer ran 2% faster at best
 * (4 groups: slower); on the copy engines the forward fell 0.9 ms but not the step. */
#define TP_GROUPS 1

/* Copy-engine collectives: MESHTRAIN_TP_CE=1 (an A/B knob for the GPU benchmarks, like
 * MESHTRAIN_TP_CHUNKS: it changes the speed only, and the results within rounding), default
 * 0. The activation buffers the collectives run over (ModelTp's alloc) then lie in NCCL
 * symmetric windows on the tp group (comm_alloc), whose communicator takes NCCL's zero-CTA
 * policy: the all-reduces in place run as an all-to-all, a short sum kernel and an
 * all-gather, the reduce-scatters as the first two, the all-gathers on the copy engines,
 * and no SM is held while the bytes move, so chunks can overlap their products (NCCL's
 * kernels took SMs from the products beside them). */
int tensor_parallel_ce_asked(void) {
    const char *e = getenv("MESHTRAIN_TP_CE");
    if (!e || !strcmp(e, "0")) return 0;
    if (strcmp(e, "1")) die_once(EXIT_BAD_INPUT, "MESHTRAIN_TP_CE=%s: not 0 or 1", e);
    return 1;
}
static void *tp_alloc(void *ctx, size_t bytes) { return comm_alloc(ctx, bytes); }

void tensor_parallel_attach(Model *m, const Mesh *mesh, int sequence_parallel, int copy_engines) {
    if (mesh->tp_size == 1) return;
    m->tp = (ModelTp){.ctx = (void *)&mesh->tp, .allreduce_begin = tp_allreduce_begin,
                      .allgather_begin = tp_allgather_begin, .reduce_scatter_begin = tp_reduce_scatter_begin,
                      .join = tp_join, .flush = tp_flush};
    m->sp = sequence_parallel != 0;
    m->tp_chunks = count_asked("MESHTRAIN_TP_CHUNKS", TP_CHUNKS);
    m->tp_groups = count_asked("MESHTRAIN_TP_OVERLAP", TP_GROUPS);
    (void)tensor_parallel_ce_asked();  /* a malformed value ends the run on every rank, CPU ranks too */
    if (copy_engines) {
        m->tp.alloc = tp_alloc;
        m->tp.free = comm_buffer_free;
    }
}

int tensor_parallel_ce_possible(const Mesh *mesh) {
    /* CPU ranks: today's path, silently. On GPUs every rank of the group must take the same
     * path (comm_alloc is collective): they agree to ask only if all of them were asked. */
    if (mesh->tp_size == 1 || ops_host_memory()) return 0;
    int not_asked = !tensor_parallel_ce_asked();
    comm_allreduce_max_int(&mesh->tp, &not_asked, 1);
    return !not_asked && comm_copy_engines_possible(&mesh->tp);
}

int tensor_parallel_on_copy_engines(const Mesh *mesh) {
    return mesh->tp_size > 1 && comm_copy_engines_active(&mesh->tp);
}

double tensor_replicated_sumsq(const Model *m, int u, size_t lo, size_t hi, const void *g) {
    int max = model_tp_max_runs(m);
    TpRun *r = xmalloc((size_t)max * sizeof *r);
    int n = model_tp_runs(m, u, r, max);
    double s = 0;
    for (int i = 0; i < n; i++) {
        size_t a, b;
        if (r[i].replicated && tp_run_clip(&r[i], lo, hi, &a, &b)) s += op_sumsq(st_at(g, a - lo), b - a);
    }
    free(r);
    return s;
}
