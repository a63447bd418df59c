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
#include "versions.h"

/* Pipeline parallel: this rank is rank `pipe->rank` of the pipe->size ranks of `pipe`,
 * computing `chunks` stages (interleaved: stages c x size + rank; see schedule.h). tie:
 * with tied embeddings, the group of the first and the last stage (its gradient is summed
 * between them); NULL otherwise. */
typedef struct {
    const Comm *pipe, *tie;
    ScheduleKind kind;
    const double *cost;     /* every stage's estimated F, B, W (schedule_build's), or NULL */
    int zb1_max_in_flight;  /* schedule_build's (the key's; 0: the default) */
    int copy_engines;       /* send/receive on the copy engines where a link can (comm_p2p_init's) */
    /* pipedream: per unit of the model, the updates between the version a micro-batch
     * computes it on and the micro-batch's index (versions.h): the micro-batches its stage
     * runs ahead (stages - stage - 1), or stages - 1 under vertical sync; on one process the
     * reference's, each unit its stage's. NULL: 2bw's 1. */
    const int *unit_delay;
} StepPipeline;

typedef struct {
    Model *m;
    int n_chunks;
    Stage chunk[SCHED_MAX_CHUNKS];  /* the stages this rank computes (one unless interleaved) */
    int head_chunk;                 /* the chunk holding the head, or -1 */
    Parallel *par;
    const UnitHooks *hooks;
    Loader *loader;
    Acts *acts[SCHED_MAX_CHUNKS];   /* per chunk, n_acts[c] micro-batches' activations in flight */
    int n_acts[SCHED_MAX_CHUNKS];   /* acts[0][0] is the caller's */
    void **wbuf;                    /* split backward: the weight-gradient inputs, n_wbuf of them */
    int n_wbuf;
    Schedule sched;
    int micro;             /* micro-batches per step */
    StepPipeline pipe;     /* pipe.pipe NULL: one stage */
    /* two-rank groups of the pipeline's ring, one per direction and neighbour, so that on
     * GPUs no stream holds both a send and a receive (see step.c) */
    Comm act_out, act_in, grad_out, grad_in;
    Comm *link_order[4];   /* ... in the order they were made (and must be released) */
    int n_links;
    CommP2P *sent_out[SCHED_MAX_CHUNKS], *sent_grad[SCHED_MAX_CHUNKS];  /* per slot: being sent */
    CommP2P *recv_in[SCHED_MAX_CHUNKS], *recv_grad[SCHED_MAX_CHUNKS];  /* ... being received */
    int *mb_inputs, *mb_targets;  /* the step's micro-batches [micro][N], read at its start */
    float *dev_losses;     /* micro > 1: every micro-batch's per-row losses [micro][N] */
    float *host_losses;
    float **own_losses;    /* the head chunk's slots' losses buffers as planned, restored after each step */
    unsigned char *eseen;  /* the strategy's embedding rows (parallel_wants_embedding_rows) */
    int *erows;
    /* mixture of experts: the last step's router statistics, per MoE layer of the whole model
     * X + 3 values (model_moe_take_stats': the routed choices per expert, the load-balancing
     * and z losses summed over the micro-batches, the kept choices), the same on every rank */
    float *moe_host;
    double *moe_stats;
    /* pipeline_schedule=2bw and pipedream (pipe.kind, schedule_no_flush): the weight versions
     * (versions.h). 2bw: every micro-batch of step t computes on version t - 1, while the
     * forwards of the next step's first micro-batches run on the newest; pipedream: micro-batch
     * i on version i - delay, one update after each backward. lists[fill * 2 + drain]: the
     * schedule's four lists. */
    int versions;          /* 2bw or pipedream */
    int each;              /* pipedream: an update after every micro-batch */
    Versions ver;
    long long mb_base;     /* micro-batches of the steps before this one */
    Schedule lists[4];
    int drain;             /* set by the caller before step_run: the step ends with nothing in flight
                            * (the last, before validation and checkpoints); 1 unless set */
    int filled;            /* the step before left the next micro-batches' forwards in flight */
    int slot_base;         /* 2bw: micro-batch i of this step is in slot (slot_base + i) % n_acts */
} Step;

/* A step of `micro` micro-batches of a->B sequences each through this rank's stages
 * s[0..n_stages): one process's whole model (pipe = NULL: gradient accumulation, 1F1B on
 * one stage), or a pipeline rank's stage(s). a is the caller's activations (the first
 * chunk's first micro-batch's); the step allocates the others its schedule keeps in
 * flight. Returns -1 with err on what cannot run. */
int step_init(Step *st, Model *m, const Stage *s, int n_stages, Parallel *par, Loader *loader, Acts *a, int micro,
              const StepPipeline *pipe, char *err, size_t errlen);
/* Runs one optimizer step on the loader's next micro-batches. Returns the mean loss over
 * this rank's micro-batches' tokens where the stage holds the head, else 0 (the caller
 * averages over the ranks that hold it); *norm gets the global gradient norm before
 * clipping, *lr the rate used. */
double step_run(Step *st, const OptimConfig *oc, double *norm, double *lr);
/* The validation loss of max_batches batches (of va's batch size) of `val` through the
 * pipeline's stages, forward only; as step_run's loss (0 off the head's stage). One stage:
 * evaluate() in va; a pipeline uses its own first slots' buffers. */
double step_eval(Step *st, Acts *va, const Shard *val, int max_batches, int dp_rank, int dp);
/* pipeline_schedule=2bw or pipedream: this rank's weight versions before the newest, unit by
 * unit (ops memory): up to max pieces and their bytes; returns the count (0 without). */
int step_stash_pieces(const Step *st, void **piece, size_t *bytes, int max);
int step_stash_count(const Step *st);
/* A run resumed at step `step`, after `updates` updates of the optimizer: where the versions'
 * indices go on from. */
void step_set_start(Step *st, int step, long long updates);
void step_free(Step *st);
#endif
