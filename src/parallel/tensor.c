#include "tensor.h"
#include <stdlib.h>
#include "comm.h"
#include "ops.h"
#include "util.h"

/* The layer needs the sum before its next op. On a device the NCCL all-reduce runs on the
 * comm stream and the compute stream waits for it there (comm_wait_device), so the GPU's queue
 * does not drain at each of a layer's all-reduces; the host polls (within comm_timeout) only
 * the one TP_LAG calls back, and tp_flush the rest. Activations are bf16 there with
 * precision=mixed or bf16, which NCCL sums as they are. On CPU ranks each completes here. */
#define TP_LAG 8
static CommReq g_req[TP_LAG];
static int g_first, g_n;

static void tp_flush(void *ctx) {
    (void)ctx;
    for (; g_n; g_n--, g_first = (g_first + 1) % TP_LAG) comm_wait(&g_req[g_first]);
}

static void tp_allreduce(void *ctx, void *buf, size_t n) {
    const Comm *tp = ctx;
    if (g_n == TP_LAG) comm_wait(&g_req[g_first]), g_first = (g_first + 1) % TP_LAG, g_n--;
    CommReq *r = &g_req[(g_first + g_n++) % TP_LAG];
    comm_iallreduce(tp, buf, n, ops_act_size() == 2 ? COMM_BF16 : COMM_F32, COMM_SUM, r, "tensor-parallel all-reduce");
    comm_wait_device(r);
}

static void tp_allgather(void *ctx, void *buf, size_t n, int stats) {
    const Comm *tp = ctx;
    CommReq r = {0};
    comm_iallgather(tp, buf, n, !stats && ops_act_size() == 2 ? COMM_BF16 : COMM_F32, &r, "tensor-parallel all-gather");
    comm_wait(&r);
}

static void tp_reduce_scatter(void *ctx, void *send, void *recv, size_t n) {
    const Comm *tp = ctx;
    CommReq r = {0};
    comm_ireduce_scatter(tp, send, recv, n, ops_act_size() == 2 ? COMM_BF16 : COMM_F32, COMM_SUM, &r,
                         "tensor-parallel reduce-scatter");
    comm_wait(&r);
}

void tensor_parallel_attach(Model *m, const Mesh *mesh, int sequence_parallel) {
    if (mesh->tp_size == 1) return;
    m->tp = (ModelTp){.ctx = (void *)&mesh->tp, .allreduce = tp_allreduce, .allgather = tp_allgather,
                      .reduce_scatter = tp_reduce_scatter, .flush = tp_flush};
    m->sp = sequence_parallel != 0;
}

double tensor_replicated_sumsq(const Model *m, int u, size_t lo, size_t hi, const void *g) {
    int max = model_tp_max_runs(m);
    TpRun *r = xmalloc((size_t)max * sizeof *r);
    int n = model_tp_runs(m, u, r, max);
    double s = 0;
    for (int i = 0; i < n; i++) {
        if (!r[i].replicated) continue;
        size_t a = lo > r[i].local ? lo : r[i].local, b = hi < r[i].local + r[i].n ? hi : r[i].local + r[i].n;
        if (a < b) s += op_sumsq(st_at(g, a - lo), b - a);
    }
    free(r);
    return s;
}
