#include "mesh.h"
#include <string.h>
#include "util.h"

int mesh_check(int W, int tp, int pp, int shard_group_size, int ep, char *err, size_t errlen) {
    if (tp < 1 || pp < 1 || W % (tp * pp))
        return set_err(err, errlen, "world size %d is not divisible by tensor_parallel_size x pipeline_parallel_size "
                       "= %d x %d", W, tp, pp);
    int dp = W / (tp * pp);
    int g = shard_group_size > 0 ? shard_group_size : dp;
    if (g > dp || dp % g)
        return set_err(err, errlen, "shard_group_size=%d does not divide the data-parallel size %d", g, dp);
    if (ep < 1 || dp % ep)
        return set_err(err, errlen, "expert_parallel_size=%d does not divide the data-parallel size %d (world size %d / "
                       "(tensor_parallel_size x pipeline_parallel_size = %d x %d))", ep, dp, W, tp, pp);
    return 0;
}

int mesh_init(Mesh *m, const Comm *world, int tp, int pp, int shard_group_size, int ep, char *err, size_t errlen) {
    memset(m, 0, sizeof *m);
    int W = world->size;
    if (mesh_check(W, tp, pp, shard_group_size, ep, err, errlen)) return -1;
    int dp = W / (tp * pp);
    int g = shard_group_size > 0 ? shard_group_size : dp;
    m->world = *world;
    m->rank = world->rank; m->size = W;
    m->tp_size = tp; m->pp_size = pp; m->dp_size = dp; m->shard_size = g;
    m->tp_rank = m->rank % tp;
    m->dp_rank = (m->rank / tp) % dp;
    m->pp_rank = m->rank / (tp * dp);
    m->shard_rank = m->dp_rank % g;
    m->replicate_rank = m->dp_rank / g;
    m->ep_size = ep; m->edp_size = dp / ep;
    m->ep_rank = m->dp_rank % ep;
    m->edp_rank = m->dp_rank / ep;
    /* Groups are the ranks that share every other coordinate. */
    comm_split(world, m->pp_rank * dp + m->dp_rank, m->tp_rank, "tp", &m->tp);
    comm_split(world, m->pp_rank * tp + m->tp_rank, m->dp_rank, "dp", &m->dp);
    comm_split(world, m->dp_rank * tp + m->tp_rank, m->pp_rank, "pp", &m->pp);
    comm_split(&m->dp, m->replicate_rank, m->shard_rank, "shard", &m->shard);
    comm_split(&m->dp, m->shard_rank, m->replicate_rank, "replicate", &m->replicate);
    comm_split(&m->dp, m->edp_rank, m->ep_rank, "ep", &m->ep);
    comm_split(&m->dp, m->ep_rank, m->edp_rank, "edp", &m->edp);
    m->dp_hosts = comm_split_hosts(&m->dp, &m->node, &m->node_gather, &m->cross);
    return 0;
}

void mesh_free(Mesh *m) {
    comm_free(&m->tp); comm_free(&m->dp); comm_free(&m->pp);
    comm_free(&m->shard); comm_free(&m->replicate);
    comm_free(&m->ep); comm_free(&m->edp);
    comm_free(&m->node); comm_free(&m->node_gather); comm_free(&m->cross);
}
