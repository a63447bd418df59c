/* schedule — one optimizer step as a list of actions for one pipeline rank: forward or
 * backward of micro-batch i on chunk c, sends and receives of the activations and their
 * gradients between neighbouring stages, the weight-gradient pass where the backward is
 * split (zero bubble), and the optimizer step. GPipe, 1F1B, interleaved 1F1B and ZB-H1 are
 * different lists; gradient accumulation on one stage is 1F1B with one stage
 * (F0 B0 F1 B1 ... step). A schedule knows nothing of models or memory: it can be printed
 * and checked (tests/test_schedule.c plays every rank's list against the others) without
 * running anything.
 *
 * Stages and chunks: with v chunks per rank (interleaved; v = 1 otherwise) the model is cut
 * into p x v stages; rank r computes chunks c = 0..v-1, which are stages c x p + r. The
 * activations of chunk c flow to stage c x p + r + 1: rank r + 1's chunk c, or, from the
 * last rank, rank 0's chunk c + 1. */
#ifndef MESHTRAIN_SCHEDULE_H
#define MESHTRAIN_SCHEDULE_H
#include <stddef.h>
#include <stdio.h>

typedef enum {
    ACT_RECV_INPUT,   /* the chunk's input for micro i, from the stage before */
    ACT_FORWARD,      /* forward of micro i (the last stage also its loss and head backward) */
    ACT_SEND_OUTPUT,  /* the chunk's output for micro i, to the stage after */
    ACT_RECV_GRAD,    /* d(loss)/d(output) of micro i, from the stage after */
    ACT_BACKWARD,     /* backward of micro i: the input gradient, and the weight gradients unless split */
    ACT_SEND_GRAD,    /* d(loss)/d(input) of micro i, to the stage before */
    ACT_WEIGHT,       /* split backward (zb1): the weight gradients of micro i */
    ACT_OPTIM_STEP,   /* the data-parallel reductions' end and the update, once per step */
} ActionKind;

typedef struct { ActionKind kind; int micro, chunk; } Action;

/* SCHED_2BW (PipeDream-2BW): 1F1B whose steps run into each other, with no flush between
 * optimizer steps; every micro-batch of step t computes on the weights of the update before
 * the last (schedule_build_2bw). SCHED_PIPEDREAM (PipeDream): the same order of forwards and
 * backwards, but an update after every micro-batch's backward, each micro-batch computing on
 * the weights its stage had when its forward ran (schedule_build_pipedream). */
typedef enum { SCHED_GPIPE, SCHED_1F1B, SCHED_INTERLEAVED, SCHED_ZB1, SCHED_2BW, SCHED_PIPEDREAM } ScheduleKind;

#define SCHED_MAX_CHUNKS 8
#define SCHED_TICKS_PER_FORWARD 1000  /* the simulations' scale with costs: the mean stage forward */

typedef struct {
    ScheduleKind kind;
    int stages, stage, micro_batches, chunks;  /* stages: pipeline ranks; stage: this rank */
    int n;
    Action *actions;
    int split_backward;                 /* zb1 (and interleaved where that is shorter): ACT_BACKWARD is the
                                         * input gradient, ACT_WEIGHT the rest */
    int head_split;                     /* schedule_head_split: the head's backward in B (and W) */
    int max_in_flight;                  /* micro-batches whose activations this rank holds at once */
    int in_flight[SCHED_MAX_CHUNKS];    /* ... per chunk (a chunk's micro-batch i uses slot i % this) */
    int max_pending_w;                  /* split: (micro-batch, chunk)s between their B and their W at once */
    int makespan;                       /* the step's length in the builder's unit costs (0: not simulated) */
} Schedule;

/* Whether the last stage keeps the logits' gradient and runs the head's backward with its
 * B (input gradient) and W (weight gradients; B under GPipe) rather than in its forward
 * (ACTS_HEAD_SPLIT): under GPipe and zb1 across stages, where a forward that holds the head's
 * three products stalls the other stages (GPipe waits for the longest F, then the longest B;
 * zb1's W cannot fill that). 1F1B only needs F + B balanced, and keeps the memory. */
static inline int schedule_head_split(ScheduleKind k, int stages) {
    return stages > 1 && (k == SCHED_GPIPE || k == SCHED_ZB1);
}

/* Parses "gpipe" / "1f1b" / "interleaved" / "zb1" / "2bw" / "pipedream"; -1 if unknown. */
int schedule_kind_parse(const char *name, ScheduleKind *out);
const char *schedule_kind_name(ScheduleKind k);
/* The actions rank `stage` of `stages` runs for one step of m micro-batches, with `chunks`
 * chunks per rank (interleaved; 1 for the others). Returns -1 with err on an impossible
 * layout (m < 1, stage out of range, chunks out of range or > 1 with another kind).
 * cost (or NULL: unit costs): [stages x chunks][3], each stage's estimated forward,
 * backward (input gradient) and weight-pass times, stage c x stages + r for chunk c of rank
 * r; the simulated schedules (interleaved, zb1) are built for them. Every rank must pass
 * the same. split_ok (SCHED_SPLIT_*): whether the backward may be split in B and W: never
 * with activation checkpointing (W needs every layer's activations kept); zb1 needs it;
 * with SCHED_SPLIT_ANY interleaved also simulates its lists with the backward split (W
 * filling the bubble) and takes them where they end sooner. zb1_max_in_flight (zb1 only;
 * the key of that name): the most micro-batches a rank holds from a forward to its weight
 * pass, 0 for the default p + 3 (p + 1 is ZB-H1's memory); below 0 is refused. */
enum { SCHED_SPLIT_NONE, SCHED_SPLIT_ZB1, SCHED_SPLIT_ANY };
int schedule_build(Schedule *s, ScheduleKind kind, int stages, int stage, int m, int chunks, int split_ok,
                   int zb1_max_in_flight, const double *cost, char *err, size_t errlen);
/* The simulated step of every rank's list under kind (all ranks together, in ticks of the
 * builders' scale: the mean forward is SCHED_TICKS_PER_FORWARD with cost, 1 in unit costs);
 * -1 on a deadlock or a layout schedule_build refuses. */
int schedule_makespan(ScheduleKind kind, int stages, int m, int chunks, int split_ok, int zb1_max_in_flight,
                      const double *cost);
/* PipeDream-2BW's list for rank `stage` of `stages` and m >= stages micro-batches a step:
 * 1F1B (w = stages - stage - 1 forwards ahead) over the endless sequence of micro-batches,
 * cut after each step's last backward, where the update goes. fill: the step starts with an
 * empty pipeline (the run's first step, or after a drained one): its first w forwards lead;
 * else they ran at the end of the step before. drain: the step ends with nothing in flight
 * (its last w backwards with no forward between: the run's last step, before validation or
 * a checkpoint); else its last w forwards are of the next step's micro-batches 0..w-1,
 * numbered m..m+w-1 here (they compute on the newest weights, the ones the next step's
 * batch uses). fill and drain both set: the 1F1B list. */
int schedule_build_2bw(Schedule *s, int stages, int stage, int m, int fill, int drain, char *err, size_t errlen);
/* PipeDream's list: 2bw's forwards and backwards in the same order, each backward followed
 * by an update (ACT_OPTIM_STEP naming its micro-batch) instead of one at the end: a step of m
 * micro-batches is m updates of the stage, none waiting for another stage's. */
int schedule_build_pipedream(Schedule *s, int stages, int stage, int m, int fill, int drain, char *err, size_t errlen);
/* Whether a kind's steps run into each other (2bw, pipedream): the lists above, weight
 * versions, a drain only where the caller asks for one. */
static inline int schedule_no_flush(ScheduleKind k) { return k == SCHED_2BW || k == SCHED_PIPEDREAM; }
/* The simulated length of `steps` consecutive steps of kind (the 1F1B family: 1f1b, gpipe,
 * 2bw or pipedream; 2bw's and pipedream's first fills, the last drains, none flushes between;
 * updates take no time) in unit costs (F 1, B 2),
 * with *idle (or NULL) the share of the ranks' time spent waiting; -1 on a deadlock.
 * barrier: no rank starts a step before every rank has ended the one before (what a
 * collective of all stages at each update does: the trainer's clipping norm and loss sum). */
int schedule_makespan_steps(ScheduleKind kind, int stages, int m, int steps, int barrier, double *idle);
void schedule_free(Schedule *s);
/* One line, e.g. "recv0 F0 send0 ... recvgrad0 B0 sendgrad0 ... step"; with chunks,
 * each action's chunk follows a dot ("F3.1": micro 3 on chunk 1). */
void schedule_print(FILE *f, const Schedule *s);
const char *action_name(ActionKind k);
#endif
