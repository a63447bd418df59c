/* plan_cost — a layout's step time, predicted from a profile: each pipeline stage's
 * forward, backward and weight pass per micro-batch summed from the ops a layer, the
 * embedding and the head run (model/layer.c, model/stage.c) at the layout's shapes, with the
 * collectives inside them (tensor parallel's, FSDP's gathers); the step's lists played
 * against each other in time (schedule_simulate) with the messages between stages; then what
 * follows the last backward: the data-parallel reductions, the optimizer, the host copies
 * of offload. docs/plan.md says what it leaves out. */
#ifndef MESHTRAIN_PLAN_COST_H
#define MESHTRAIN_PLAN_COST_H
#include "config.h"
#include "layout.h"
#include "profile.h"

/* The machines a plan may use. cores: a machine's CPU cores (CPU ranks share them). */
typedef struct {
    int hosts, per_host, cores, gpu;
    double device_memory, host_memory, link_intra, link_inter;  /* bytes; bytes/s (0: the profile's) */
} Cluster;

typedef struct {
    double compute, comm, bubble, optim, host, step;  /* seconds a step: the parts, their sum */
    double tokens_per_s;
    int threads;         /* CPU threads a rank (the key threads=) */
} StepCost;

/* CPU threads each of `world` ranks gets on cl's cores (at least 1; ranks beyond the cores share them). */
int plan_threads(const Cluster *cl, int world);
/* c: the layout's keys, L its layout_init. Fills *out; lookups are counted in p's tallies. */
void plan_cost(const Config *c, const Layout *L, const Cluster *cl, Profile *p, StepCost *out);
#endif
