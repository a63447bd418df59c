/* layout — what a run of these keys is on `world` ranks, before anything is allocated:
 * the mesh's degrees, the pipeline's split and every rank's schedule (the lists the run
 * executes), and each rank's memory as the estimate computes it. Checked as a training
 * run's start-up checks them (the mesh, the split, the lists), so `estimate`, `plan` and
 * `train` agree on what a layout is, whether it can run and what it takes. */
#ifndef MESHTRAIN_LAYOUT_H
#define MESHTRAIN_LAYOUT_H
#include <stddef.h>
#include "config.h"
#include "estimate.h"
#include "optim.h"
#include "pipeline.h"
#include "schedule.h"

typedef struct {
    int world, dp, tp, pp, v, ep, group;  /* group: the ranks a unit is sharded over (hybrid: its shard group) */
    int K, M, BM;          /* accumulation; micro-batches a step per rank (pipeline: micro_batches x K) of BM sequences */
    ScheduleKind sched;
    int split_ok;          /* schedule_build's (pipeline_split_backward_ok) */
    Stage *stages;         /* [pp v]: the split (pp > 1) */
    double *stage_cost;    /* [pp v][3]: pipeline_stage_costs, what the lists were built for */
    Schedule *sc;          /* [pp]: every pipeline rank's list (pp > 1) */
    OptimConfig oc;
    EstimateInput ein;
    MemEstimate whole;     /* estimate_memory: one rank holding every unit */
    MemEstimate *stage_mem; /* [pp]: each pipeline rank's (estimate_stage; pp > 1) */
    size_t most;           /* the largest rank's total */
    size_t host_most;      /* the largest rank's offloaded state (host memory) */
} Layout;

/* c validated (config_parse); world: the ranks of the run. 0, or -1 with a one-line err
 * (the world does not divide, the split does not fit, ...). */
int layout_init(Layout *L, const Config *c, int world, char *err, size_t errlen);
void layout_free(Layout *L);
#endif
