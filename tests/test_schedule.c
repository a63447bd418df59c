/* Schedules played without a model: every stage's list runs against the others'. A send
 * is buffered (it completes at once), a receive waits for its send; each round, every
 * stage runs its next action if it can. The checks: no deadlock, every micro-batch
 * forwarded and backwarded once on every stage, a backward after its own forward, sends
 * and receives in pairs, at most max_in_flight micro-batches' activations held, the
 * optimizer step last, and the well-known shapes (accumulation, 1F1B's warm-up). */
#include <stdlib.h>
#include <string.h>
#include "schedule.h"
#include "test.h"

/* Plays p stages' schedules s; returns 0, or -1 on a deadlock or a broken rule (message
 * printed). */
static int play_built(Schedule *s, int p, int m) {
    int *pc = calloc((size_t)p, sizeof(int));
    /* sent[stage][micro]: outputs sent to the next stage; gsent: gradients sent back */
    int *sent = calloc((size_t)(p * m), sizeof(int)), *gsent = calloc((size_t)(p * m), sizeof(int));
    int *fwd = calloc((size_t)(p * m), sizeof(int)), *bwd = calloc((size_t)(p * m), sizeof(int));
    int bad = 0, rounds = 0;
    for (;;) {
        int progressed = 0, done = 1;
        for (int i = 0; i < p && !bad; i++) {
            if (pc[i] >= s[i].n) continue;
            done = 0;
            Action a = s[i].actions[pc[i]];
            int k = a.micro, ok = 1;
            switch (a.kind) {
            case ACT_RECV_INPUT: ok = i > 0 && sent[(i - 1) * m + k]; break;
            case ACT_RECV_GRAD: ok = i < p - 1 && gsent[(i + 1) * m + k]; break;
            case ACT_FORWARD:
                if (fwd[i * m + k]++) { fprintf(stderr, "  stage %d: F%d twice\n", i, k); bad = 1; }
                break;
            case ACT_BACKWARD:
                if (!fwd[i * m + k] || bwd[i * m + k]++) { fprintf(stderr, "  stage %d: B%d out of order\n", i, k); bad = 1; }
                break;
            case ACT_SEND_OUTPUT:
                if (i == p - 1 || !fwd[i * m + k]) { fprintf(stderr, "  stage %d: send%d\n", i, k); bad = 1; }
                sent[i * m + k] = 1;
                break;
            case ACT_SEND_GRAD:
                if (i == 0 || !bwd[i * m + k]) { fprintf(stderr, "  stage %d: sendgrad%d\n", i, k); bad = 1; }
                gsent[i * m + k] = 1;
                break;
            case ACT_OPTIM_STEP:
                for (int j = 0; j < m; j++)
                    if (!bwd[i * m + j]) { fprintf(stderr, "  stage %d: step before B%d\n", i, j); bad = 1; }
                break;
            }
            if (ok) { pc[i]++; progressed = 1; }
            /* activations held: forwarded, not yet backwarded */
            int held = 0;
            for (int j = 0; j < m; j++) held += fwd[i * m + j] && !bwd[i * m + j];
            if (held > s[i].max_in_flight) { fprintf(stderr, "  stage %d holds %d > %d\n", i, held, s[i].max_in_flight); bad = 1; }
        }
        if (bad || done) break;
        rounds++;
        if (!progressed) { fprintf(stderr, "  deadlock after %d rounds\n", rounds); bad = 1; break; }
    }
    for (int i = 0; i < p * m && !bad; i++)
        if (fwd[i] != 1 || bwd[i] != 1) { fprintf(stderr, "  micro %d of stage %d: %d F, %d B\n", i % m, i / m, fwd[i], bwd[i]); bad = 1; }
    free(pc); free(sent); free(gsent); free(fwd); free(bwd);
    return bad ? -1 : 0;
}

static int play(ScheduleKind kind, int p, int m) {
    Schedule *s = calloc((size_t)p, sizeof *s);
    char err[128];
    for (int i = 0; i < p; i++) CHECK(schedule_build(&s[i], kind, p, i, m, err, sizeof err) == 0, "%s", err);
    int r = play_built(s, p, m);
    for (int i = 0; i < p; i++) schedule_free(&s[i]);
    free(s);
    return r;
}

static void test_every_layout_plays(void) {
    int ps[] = {1, 2, 3, 4}, ms[] = {1, 2, 3, 4, 5, 8, 9};
    for (int k = 0; k < 2; k++)
        for (size_t a = 0; a < sizeof ps / sizeof *ps; a++)
            for (size_t b = 0; b < sizeof ms / sizeof *ms; b++)
                CHECK(play((ScheduleKind)k, ps[a], ms[b]) == 0, "%s p=%d m=%d", schedule_kind_name((ScheduleKind)k),
                      ps[a], ms[b]);
}

static char *printed(ScheduleKind k, int p, int stage, int m) {
    static char buf[4096];
    Schedule s;
    char err[64];
    schedule_build(&s, k, p, stage, m, err, sizeof err);
    FILE *f = fmemopen(buf, sizeof buf, "w");
    schedule_print(f, &s);
    fclose(f);
    schedule_free(&s);
    buf[strcspn(buf, "\n")] = 0;
    return buf;
}

static void test_shapes(void) {
    /* gradient accumulation: one stage, forward and backward in turn, then one step */
    CHECK(!strcmp(printed(SCHED_1F1B, 1, 0, 3), "F0 B0 F1 B1 F2 B2 step"), "%s", printed(SCHED_1F1B, 1, 0, 3));
    CHECK(!strcmp(printed(SCHED_1F1B, 1, 0, 1), "F0 B0 step"), "%s", printed(SCHED_1F1B, 1, 0, 1));
    /* 1F1B on 2 stages: the first stage runs one forward ahead */
    CHECK(!strcmp(printed(SCHED_1F1B, 2, 0, 3), "F0 send0 F1 send1 recvgrad0 B0 F2 send2 recvgrad1 B1 recvgrad2 B2 step"),
          "%s", printed(SCHED_1F1B, 2, 0, 3));
    CHECK(!strcmp(printed(SCHED_1F1B, 2, 1, 2), "recv0 F0 B0 sendgrad0 recv1 F1 B1 sendgrad1 step"), "%s",
          printed(SCHED_1F1B, 2, 1, 2));
    CHECK(!strcmp(printed(SCHED_GPIPE, 2, 1, 2), "recv0 F0 recv1 F1 B1 sendgrad1 B0 sendgrad0 step"), "%s",
          printed(SCHED_GPIPE, 2, 1, 2));
    Schedule s;
    char err[64];
    schedule_build(&s, SCHED_1F1B, 4, 0, 8, err, sizeof err);
    CHECK(s.max_in_flight == 4, "1F1B's first stage of 4 holds %d", s.max_in_flight);
    schedule_free(&s);
    schedule_build(&s, SCHED_GPIPE, 4, 0, 8, err, sizeof err);
    CHECK(s.max_in_flight == 8, "GPipe holds every micro-batch: %d", s.max_in_flight);
    schedule_free(&s);
}

static void test_bad_layouts(void) {
    Schedule s;
    char err[128];
    CHECK(schedule_build(&s, SCHED_1F1B, 2, 0, 0, err, sizeof err) == -1, "m = 0 accepted");
    CHECK(schedule_build(&s, SCHED_1F1B, 2, 2, 4, err, sizeof err) == -1, "stage 2 of 2 accepted");
    ScheduleKind k;
    CHECK(schedule_kind_parse("1f1b", &k) == 0 && k == SCHED_1F1B, "1f1b");
    CHECK(schedule_kind_parse("gpipe", &k) == 0 && k == SCHED_GPIPE, "gpipe");
    CHECK(schedule_kind_parse("zbv", &k) == -1, "zbv parsed");
}

/* The player itself catches broken schedules: a receive moved before the neighbour can
 * send it deadlocks; a backward moved before its forward is out of order. */
static void test_player_catches_broken(void) {
    Schedule s[2];
    char err[64];
    for (int broken = 0; broken < 2; broken++) {
        schedule_build(&s[0], SCHED_1F1B, 2, 0, 2, err, sizeof err);
        schedule_build(&s[1], SCHED_1F1B, 2, 1, 2, err, sizeof err);
        ActionKind want = broken == 0 ? ACT_RECV_GRAD : ACT_BACKWARD;
        int j = 0;
        while (s[0].actions[j].kind != want) j++;
        Action first = s[0].actions[0];
        s[0].actions[0] = s[0].actions[j];
        s[0].actions[j] = first;
        fprintf(stderr, "  (a broken schedule, expected to fail:)\n");
        CHECK(play_built(s, 2, 2) == -1, "broken schedule %d played", broken);
        schedule_free(&s[0]);
        schedule_free(&s[1]);
    }
}

int main(void) {
    RUN(test_every_layout_plays);
    RUN(test_shapes);
    RUN(test_bad_layouts);
    RUN(test_player_catches_broken);
    return TEST_SUMMARY();
}
