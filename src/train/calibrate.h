/* calibrate — measures, on this machine, what the planner's cost model reads (profile.h):
 * each op at every shape the model's layouts need on this cluster (found by running the
 * planner's enumeration and noting each shape it asks for), through the ops backend, on the
 * thread counts the layouts give a rank; the host copy rate (and on a GPU the host-device
 * copies and the host optimizer's rate); and, with CPU ranks, the collectives over groups of
 * 2 .. devices_per_host ranks (MPI), timed by a child `mpirun` of this same command. */
#ifndef MESHTRAIN_CALIBRATE_H
#define MESHTRAIN_CALIBRATE_H
#include "config.h"
#include "plan_cost.h"

/* model: the model's keys as given; writes the profile to out. 0, or an exit status. */
int calibrate_run(const Config *c, const char *model, const Cluster *cl, const char *out);
#endif
