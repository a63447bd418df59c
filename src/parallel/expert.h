/* expert — what a mixture-of-experts model needs of the data-parallel ranks: the router's
 * statistics of each micro-batch summed over them (ModelMoe), so the load-balancing loss is
 * the global batch's whatever the layout. */
#ifndef MESHTRAIN_EXPERT_H
#define MESHTRAIN_EXPERT_H
#include "mesh.h"
#include "model.h"

/* Gives m its ModelMoe over mesh->dp (nothing for a dense model). The mesh must outlive m's use. */
void expert_parallel_attach(Model *m, const Mesh *mesh);
#endif
