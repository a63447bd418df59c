/* step — one optimizer step of training, as its schedule says: the micro-batches' forwards
 * and backwards through this process's stage, then the data-parallel strategy's part (the
 * reductions' end, clipping, the update). It owns what a step needs beyond the model and
 * the strategy: the micro-batches' losses and, for a strategy that asks, the rows of the
 * embedding the next step's global batch uses. train.c runs it once per step. */
#ifndef MESHTRAIN_STEP_H
#define MESHTRAIN_STEP_H
#include "data.h"
#include "model.h"
#include "optim.h"
#include "parallel.h"
#include "schedule.h"

typedef struct {
    Model *m;
    Stage stage;
    Parallel *par;
    const UnitHooks *hooks;
    Loader *loader;
    Acts *a;               /* one micro-batch's activations, reused by each in turn */
    Schedule sched;
    int micro;             /* micro-batches per step (grad_accum_steps) */
    float *own_losses;     /* a->losses as planned; restored after each step */
    float *dev_losses;     /* micro > 1: every micro-batch's per-row losses [micro][N] */
    float *host_losses;
    unsigned char *eseen;  /* the strategy's embedding rows (parallel_wants_embedding_rows) */
    int *erows;
} Step;

/* A step of `micro` micro-batches of a->B sequences each through stage s of one process.
 * Returns -1 with err on what this build of the step cannot run. Asks the strategy whether
 * it wants the first step's embedding rows (and gives them). */
int step_init(Step *st, Model *m, Stage s, Parallel *par, Loader *loader, Acts *a, int micro, char *err,
              size_t errlen);
/* Runs one optimizer step on the loader's next micro-batches. Returns this rank's mean loss
 * over its micro-batches' tokens (the caller averages over data-parallel ranks); *norm gets
 * the global gradient norm before clipping, *lr the rate used. */
double step_run(Step *st, const OptimConfig *oc, double *norm, double *lr);
void step_free(Step *st);
#endif
