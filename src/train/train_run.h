/* train_run — what `meshtrain train` holds from its set-up to its report, shared by its
 * three parts: train_setup.c (the keys, the mesh, the data, the checks, the model and its
 * strategy, the header), train_loop.c (the steps, validation, checkpoints, stops) and
 * train_report.c (the summary). train.c runs them in turn. */
#ifndef MESHTRAIN_TRAIN_RUN_H
#define MESHTRAIN_TRAIN_RUN_H
#include "checkpoint.h"
#include "comm.h"
#include "config.h"
#include "data.h"
#include "estimate.h"
#include "jsonlog.h"
#include "mesh.h"
#include "model.h"
#include "parallel.h"
#include "pipeline.h"
#include "schedule.h"
#include "step.h"

typedef struct {
    Config *c;
    Comm world;
    Mesh mesh;
    int lead, dp, gpu;
    /* the batch: B sequences per data-parallel rank and micro-batch, T tokens each, K
     * micro-batches a step (accumulation), G the global batch; a pipeline's M micro-batches
     * of BM sequences over PP stages, V chunks per rank */
    int B, T, K, G, PP, M, BM, V;
    ScheduleKind sched;
    Stage *stages, mine[SCHED_MAX_CHUNKS];
    Schedule sc;
    double *stage_cost;
    int holds_head, tied_copy, tie_member;
    Comm tie;  /* a tied embedding's two copies (the first and the last stage) */
    ModelConfig mc;
    OptimConfig oc;
    ParallelKind kind;
    OpsPrecision prec;
    Shard train, val;
    Loader loader;
    int val_B;
    EstimateInput ein;
    MemEstimate est;
    int resuming, ckpt_global, start;
    CkptHeader resume_h, h;  /* the checkpoint resumed from; the one each save writes */
    LossScaler resume_scaler;  /* the checkpoint's loss scaler, where it keeps one (resume_has_scaler) */
    int resume_has_scaler;
    int saving;
    int compress;             /* grad_compression: its CompressKind (0: none) */
    JsonLog log_store, *log;  /* rank 0's log (NULL elsewhere) */
    char *settings;           /* its first line, written beside every checkpoint too */
    Model m;
    Parallel *par;
    Acts a;
    Step st;
    /* paths the keys and the machine chose */
    int pp_ce, graphs, tp_fused_wanted, tp_fused;  /* tp_fused: wanted and taken */
    double peak;  /* MFU's reference, FLOP/s per GPU (0: none) */
} TrainRun;

/* What the loop measured, for the report. */
typedef struct {
    int done, timed_steps, stopped, late_signal;
    double t_timed, comm_timed, upd_timed, uwait_timed, blocked_timed, val_loss;
    float loss;
} TrainTotals;

/* Everything up to the first step; a failure any rank meets ends every rank here, in one
 * line (exit 2). */
void train_setup(TrainRun *r, Config *c);
/* The steps; a non-finite loss, or a checkpoint or log that cannot be written, ends the run
 * inside (exit 1). */
TrainTotals train_loop(TrainRun *r);
/* The summary (rank 0 prints it; every rank takes part); the exit status. */
int train_report(TrainRun *r, const TrainTotals *t);
void train_free(TrainRun *r);
#endif
