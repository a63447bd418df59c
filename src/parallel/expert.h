/* expert — what a mixture-of-experts model needs of the other ranks: the router's statistics
 * of each micro-batch summed over the data-parallel ranks (ModelMoe's allreduce), so the
 * load-balancing loss is the global batch's whatever the layout; and under expert parallel
 * (mesh->ep_size > 1) the all-to-all over the ep group that carries tokens to the ranks
 * holding their experts and the results back (ModelMoe's exchange). */
#ifndef MESHTRAIN_EXPERT_H
#define MESHTRAIN_EXPERT_H
#include "mesh.h"
#include "model.h"

/* Gives m its ModelMoe over mesh->dp and mesh->ep (nothing for a dense model). m's layout
 * must be the mesh's ep rank's (model_init_layout_ep). The mesh must outlive m's use. */
void expert_parallel_attach(Model *m, const Mesh *mesh);
#endif
