/* expert: the router's statistics summed over the data-parallel group (ModelMoe's allreduce). */
#include "expert.h"
#include "comm.h"

static void stats_allreduce(void *ctx, float *buf, size_t n) {
    comm_allreduce((const Comm *)ctx, buf, n, COMM_SUM);
}

void expert_parallel_attach(Model *m, const Mesh *mesh) {
    if (!m->n_moe) return;
    m->moe = (ModelMoe){.ctx = (void *)&mesh->dp, .allreduce = mesh->dp_size > 1 ? stats_allreduce : NULL,
                        .dp = mesh->dp_size};
}
