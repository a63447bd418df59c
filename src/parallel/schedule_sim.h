/* schedule_sim — one step of every pipeline rank's list (schedule_build's, the lists a run
 * executes) played against the others in time: each compute action (F, B, W) takes its
 * stage's time, and an action that needs another rank's output starts `link` after that
 * output is done (the message). Each rank runs its actions in list order, each as soon as
 * its inputs are in and the rank is free. The planner predicts a pipeline's step with it,
 * bench/pp_sim replays the trainer's lists with measured times, and the tests hold its bubble
 * to the closed forms of GPipe, 1F1B and interleaved. */
#ifndef MESHTRAIN_SCHEDULE_SIM_H
#define MESHTRAIN_SCHEDULE_SIM_H
#include <stdio.h>
#include "schedule.h"

typedef struct {
    double makespan;   /* from the first action's start to the last one's end */
    double busy_max;   /* compute time of the busiest rank */
    double busy_mean;  /* ... and of the mean rank */
    double bubble;     /* makespan - busy_max: what the busiest rank waits */
} SimStep;

/* sc[0..p): every rank's list (the same kind, micro-batches and chunks); cost[(c p + r) x 3
 * + 0..2]: the forward, backward (input gradient) and weight-pass time of rank r's chunk c
 * (where the backward is not split, B runs B + W and W is not used); link: a message's
 * time. trace (or NULL): each compute action with its start, one line each. 0, or -1 if a
 * rank's list can never go on (lists that do not fit each other). */
int schedule_simulate(const Schedule *sc, int p, const double *cost, double link, SimStep *out, FILE *trace);
#endif
