/* expert: the router's statistics summed over the data-parallel group (ModelMoe's allreduce),
 * and expert parallel's all-to-all over the ep group (ModelMoe's exchange). */
#include "expert.h"
#include "comm.h"
#include "util.h"

static void stats_allreduce(void *ctx, float *buf, size_t n) {
    comm_allreduce(&((const Mesh *)ctx)->dp, buf, n, COMM_SUM);
}

static void exchange(void *ctx, const void *send, const size_t *send_bytes, void *recv, const size_t *recv_bytes,
                     const char *what) {
    comm_alltoallv(&((const Mesh *)ctx)->ep, send, send_bytes, recv, recv_bytes, what);
}

void expert_parallel_attach(Model *m, const Mesh *mesh) {
    if (!m->n_moe) return;
    if (m->ep_size != mesh->ep_size || m->ep_rank != mesh->ep_rank)
        die(EXIT_RUN_FAILURE, "internal: the model's expert-parallel rank %d of %d is not the mesh's %d of %d",
            m->ep_rank, m->ep_size, mesh->ep_rank, mesh->ep_size);
    m->moe = (ModelMoe){.ctx = (void *)mesh, .allreduce = mesh->dp_size > 1 ? stats_allreduce : NULL,
                        .dp = mesh->dp_size, .exchange = mesh->ep_size > 1 ? exchange : NULL};
}
