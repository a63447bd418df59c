/* mesh — the device mesh: world = pp x dp x tp, ranks ordered with tp fastest, then dp,
 * then pp. Each rank gets its sub-groups. Hybrid sharding splits dp further into shard
 * groups of shard_group_size consecutive dp ranks (one node) and replicate groups across
 * them. Expert parallel splits dp into ep groups of ep_size consecutive dp ranks, which
 * share out a mixture of experts' experts and exchange tokens, and edp groups across them
 * (the ranks holding the same experts, dp / ep_size of them: dp_rank = edp_rank x ep_size +
 * ep_rank). One object; nothing else keeps multi-process state. */
#ifndef MESHTRAIN_MESH_H
#define MESHTRAIN_MESH_H
#include "comm.h"

typedef struct {
    Comm world, dp, tp, pp;
    Comm shard, replicate;   /* within dp: shard = whole dp unless hybrid */
    Comm ep, edp;            /* within dp: expert parallel's groups (ep of one rank, edp = dp, without) */
    /* within dp, by machine (comm_split_hosts): node = the dp ranks on this machine, cross =
     * those with this rank's place on every machine; dp_hosts = 1 where dp spans several
     * machines with as many (more than one) ranks on each, else 0 and groups of one (node_gather:
 * node's ranks again, for the hierarchical all-reduce's last stage).
     * hier_allreduce: DDP's all-reduces over dp go through them (the key dp_allreduce). */
    Comm node, node_gather, cross;
    int dp_hosts, hier_allreduce;
    int rank, size;          /* in the world */
    int dp_size, tp_size, pp_size, shard_size, ep_size, edp_size;
    int dp_rank, tp_rank, pp_rank, shard_rank, replicate_rank, ep_rank, edp_rank;
} Mesh;

/* world must be initialised; tp * pp must divide its size, and shard_group_size (0 = all of
 * dp) and ep must divide dp. Returns -1 with err on an impossible layout. */
/* The same conditions on a world of W ranks, without one (the planner asks it of layouts). */
int mesh_check(int W, int tp, int pp, int shard_group_size, int ep, char *err, size_t errlen);
int mesh_init(Mesh *m, const Comm *world, int tp, int pp, int shard_group_size, int ep, char *err, size_t errlen);
void mesh_free(Mesh *m);
#endif
