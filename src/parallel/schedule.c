#include "schedule.h"
#include <stdlib.h>
#include <string.h>
#include "util.h"

static const char *KIND_NAMES[] = {"gpipe", "1f1b"};

int schedule_kind_parse(const char *name, ScheduleKind *out) {
    for (int k = 0; k < (int)(sizeof KIND_NAMES / sizeof KIND_NAMES[0]); k++)
        if (!strcmp(name, KIND_NAMES[k])) { *out = (ScheduleKind)k; return 0; }
    return -1;
}

const char *schedule_kind_name(ScheduleKind k) { return KIND_NAMES[k]; }

const char *action_name(ActionKind k) {
    static const char *names[] = {"recv", "F", "send", "recvgrad", "B", "sendgrad", "step"};
    return names[k];
}

static void add(Schedule *s, ActionKind k, int micro) { s->actions[s->n++] = (Action){k, micro}; }

/* A forward with its receive before and its send after, where the stage has neighbours. */
static void forward(Schedule *s, int i) {
    if (s->stage > 0) add(s, ACT_RECV_INPUT, i);
    add(s, ACT_FORWARD, i);
    if (s->stage < s->stages - 1) add(s, ACT_SEND_OUTPUT, i);
}

static void backward(Schedule *s, int i) {
    if (s->stage < s->stages - 1) add(s, ACT_RECV_GRAD, i);
    add(s, ACT_BACKWARD, i);
    if (s->stage > 0) add(s, ACT_SEND_GRAD, i);
}

/* GPipe holds every micro-batch; 1F1B's stage s runs stages - s - 1 forwards ahead, so it
 * holds one more than that (the first stage the most). */
int schedule_in_flight(ScheduleKind kind, int stages, int stage, int m) {
    if (kind == SCHED_GPIPE) return m;
    return (stages - stage - 1 < m ? stages - stage - 1 : m) + 1;
}

int schedule_build(Schedule *s, ScheduleKind kind, int stages, int stage, int m, char *err, size_t errlen) {
    memset(s, 0, sizeof *s);
    if (stages < 1 || stage < 0 || stage >= stages) return set_err(err, errlen, "stage %d of %d", stage, stages);
    if (m < 1) return set_err(err, errlen, "%d micro-batches: at least one is needed", m);
    s->kind = kind; s->stages = stages; s->stage = stage; s->micro_batches = m;
    s->actions = xmalloc((size_t)(6 * m + 1) * sizeof *s->actions);
    if (kind == SCHED_GPIPE) {
        /* every forward, then every backward (in reverse order, as the activations were made) */
        for (int i = 0; i < m; i++) forward(s, i);
        for (int i = m - 1; i >= 0; i--) backward(s, i);
    } else {
        /* 1F1B: stage s runs stages - s - 1 forwards ahead, then one forward and one
         * backward in turn, then the remaining backwards: at most stages - s micro-batches'
         * activations at once (the first stage holds the most). With one stage: F0 B0 F1 B1 ... */
        int warmup = stages - stage - 1 < m ? stages - stage - 1 : m;
        for (int i = 0; i < warmup; i++) forward(s, i);
        for (int i = 0; i < m - warmup; i++) {
            forward(s, warmup + i);
            backward(s, i);
        }
        for (int i = m - warmup; i < m; i++) backward(s, i);
    }
    s->max_in_flight = schedule_in_flight(kind, stages, stage, m);
    add(s, ACT_OPTIM_STEP, -1);
    return 0;
}

void schedule_free(Schedule *s) {
    free(s->actions);
    s->actions = NULL;
    s->n = 0;
}

void schedule_print(FILE *f, const Schedule *s) {
    for (int i = 0; i < s->n; i++) {
        const Action *a = &s->actions[i];
        if (a->kind == ACT_OPTIM_STEP) fprintf(f, "%sstep", i ? " " : "");
        else fprintf(f, "%s%s%d", i ? " " : "", action_name(a->kind), a->micro);
    }
    fputc('\n', f);
}
