/* schedule — one optimizer step as a list of actions for one stage: forward or backward
 * of micro-batch i, sends and receives of the activations and their gradients between
 * neighbouring stages, and the optimizer step. GPipe and 1F1B are different lists;
 * gradient accumulation on one stage is 1F1B with one stage (F0 B0 F1 B1 ... step).
 * A schedule knows nothing of models or ranks' memory: it can be printed and checked
 * (tests/test_schedule.c plays every stage's list against the others) without running
 * anything. */
#ifndef MESHTRAIN_SCHEDULE_H
#define MESHTRAIN_SCHEDULE_H
#include <stddef.h>
#include <stdio.h>

typedef enum {
    ACT_RECV_INPUT,   /* the stage's input for micro i, from the stage before */
    ACT_FORWARD,      /* forward of micro i (the last stage also its loss and head backward) */
    ACT_SEND_OUTPUT,  /* the stage's output for micro i, to the stage after */
    ACT_RECV_GRAD,    /* d(loss)/d(output) of micro i, from the stage after */
    ACT_BACKWARD,     /* backward of micro i: input gradient and weight gradients */
    ACT_SEND_GRAD,    /* d(loss)/d(input) of micro i, to the stage before */
    ACT_OPTIM_STEP,   /* the data-parallel reductions' end and the update, once per step */
} ActionKind;

typedef struct { ActionKind kind; int micro; } Action;

typedef enum { SCHED_GPIPE, SCHED_1F1B } ScheduleKind;

typedef struct {
    ScheduleKind kind;
    int stages, stage, micro_batches;
    int n;
    Action *actions;
    int max_in_flight;  /* micro-batches whose activations this stage holds at once */
} Schedule;

/* Parses "gpipe" / "1f1b"; -1 if unknown. */
int schedule_kind_parse(const char *name, ScheduleKind *out);
const char *schedule_kind_name(ScheduleKind k);
/* The actions stage `stage` of `stages` runs for one step of m micro-batches. Returns -1
 * with err on an impossible layout (m < 1, stage out of range). */
int schedule_build(Schedule *s, ScheduleKind kind, int stages, int stage, int m, char *err, size_t errlen);
void schedule_free(Schedule *s);
/* The micro-batches whose activations stage `stage` holds at once under kind (what
 * schedule_build's max_in_flight says, without building the list: the estimate's). */
int schedule_in_flight(ScheduleKind kind, int stages, int stage, int m);
/* One line, e.g. "recv0 F0 send0 ... recvgrad0 B0 sendgrad0 ... step". */
void schedule_print(FILE *f, const Schedule *s);
const char *action_name(ActionKind k);
#endif
