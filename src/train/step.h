/* step — one optimizer step of training, as its schedule says: the micro-batches' forwards
 * and backwards through this process's stage, the sends and receives between pipeline
 * stages, then the data-parallel strategy's part (the reductions' end, clipping, the
 * update). It owns what a step needs beyond the model and the strategy: the activations
 * of the micro-batches in flight, the micro-batches' losses and, for a strategy that asks,
 * the rows of the embedding the next step's global batch uses. train.c runs it once per
 * step. */
#ifndef MESHTRAIN_STEP_H
#define MESHTRAIN_STEP_H
#include "comm.h"
#include "data.h"
#include "model.h"
#include "optim.h"
#include "parallel.h"
#include "schedule.h"

/* Pipeline parallel: this rank's stage is stage `pipe->rank` of the pipe->size stages of
 * `pipe` (neighbours are ranks pipe->rank +- 1 of it). tie: with tied embeddings, the group
 * of the first and the last stage (its gradient is summed between them); NULL otherwise. */
typedef struct { const Comm *pipe, *tie; ScheduleKind kind; } StepPipeline;

typedef struct {
    Model *m;
    Stage stage;
    Parallel *par;
    const UnitHooks *hooks;
    Loader *loader;
    Acts *acts;            /* n_acts micro-batches' activations in flight; acts[0] is the caller's */
    int n_acts;
    Schedule sched;
    int micro;             /* micro-batches per step */
    StepPipeline pipe;     /* pipe.pipe NULL: one stage */
    Comm fwd, bwd;         /* pipe's ranks again, one group per direction: activations, gradients */
    CommP2P *sent_out, *sent_grad;  /* per acts slot: its output / input gradient being sent */
    float **own_losses;    /* acts[i].losses as planned; restored after each step */
    float *dev_losses;     /* micro > 1: every micro-batch's per-row losses [micro][N] */
    float *host_losses;
    unsigned char *eseen;  /* the strategy's embedding rows (parallel_wants_embedding_rows) */
    int *erows;
} Step;

/* A step of `micro` micro-batches of a->B sequences each through stage s: one process's
 * whole model (pipe = NULL: gradient accumulation, 1F1B on one stage), or one stage of a
 * pipeline. a is the caller's activations (the first micro-batch's); the step allocates
 * the others a schedule keeps in flight. Returns -1 with err on what cannot run. */
int step_init(Step *st, Model *m, Stage s, Parallel *par, Loader *loader, Acts *a, int micro,
              const StepPipeline *pipe, char *err, size_t errlen);
/* Runs one optimizer step on the loader's next micro-batches. Returns the mean loss over
 * this rank's micro-batches' tokens where the stage holds the head, else 0 (the caller
 * averages over the ranks that hold it); *norm gets the global gradient norm before
 * clipping, *lr the rate used. */
double step_run(Step *st, const OptimConfig *oc, double *norm, double *lr);
/* The validation loss of max_batches batches (of the caller's activations' batch size) of
 * `val` through the pipeline's stages, forward only; as step_run's loss (0 off the head's
 * stage). One stage: evaluate(). */
double step_eval(Step *st, Acts *va, const Shard *val, int max_batches, int dp_rank, int dp);
void step_free(Step *st);
#endif
