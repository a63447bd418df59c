/* The planner's parts without timings: the schedule simulator's bubble against the closed
 * forms of GPipe, 1F1B and interleaved; the enumeration of a small case against a count made
 * by hand; the memory of every layout against the estimate's; profiles read and written. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "config.h"
#include "layout.h"
#include "plan.h"
#include "profile.h"
#include "schedule_sim.h"
#include "test.h"

/* Every rank's list of kind at p ranks, m micro-batches, v chunks, each chunk's forward f and
 * backward b (no weight pass apart), simulated with a message time of link. */
static SimStep simulate(ScheduleKind k, int p, int m, int v, double f, double b, double link) {
    double cost[8 * 8 * 3];
    for (int g = 0; g < p * v; g++) cost[g * 3] = f, cost[g * 3 + 1] = b, cost[g * 3 + 2] = 0;
    Schedule sc[8] = {{0}};
    char err[128];
    for (int r = 0; r < p; r++)
        CHECK(schedule_build(&sc[r], k, p, r, m, v, SCHED_SPLIT_NONE, 0, cost, err, sizeof err) == 0, "%s", err);
    SimStep s;
    CHECK(schedule_simulate(sc, p, cost, link, &s, NULL) == 0, "%s p=%d m=%d v=%d: a list never finished",
          schedule_kind_name(k), p, m, v);
    for (int r = 0; r < p; r++) schedule_free(&sc[r]);
    return s;
}

/* GPipe and 1F1B with equal stages F, B: (m + p - 1)(F + B) a step, of which (p - 1)(F + B)
 * is the bubble; interleaved over v chunks a rank (each F / v, B / v): the bubble (p - 1)(F +
 * B) / v (Narayanan et al. 2021), where p divides m (Megatron-LM's lists). A message's time
 * adds to the step, never to the compute. */
static void test_bubble_closed_forms(void) {
    const double F = 1.0, B = 2.0;
    for (int p = 1; p <= 4; p++)
        for (int m = p; m <= 3 * p; m++) {
            for (int k = SCHED_GPIPE; k <= SCHED_1F1B; k++) {
                SimStep s = simulate((ScheduleKind)k, p, m, 1, F, B, 0);
                CHECK(fabs(s.makespan - (m + p - 1) * (F + B)) < 1e-9, "%s p=%d m=%d: step %g, closed form %g",
                      schedule_kind_name((ScheduleKind)k), p, m, s.makespan, (m + p - 1) * (F + B));
                CHECK(fabs(s.bubble - (p - 1) * (F + B)) < 1e-9, "%s p=%d m=%d: bubble %g, closed form %g",
                      schedule_kind_name((ScheduleKind)k), p, m, s.bubble, (p - 1) * (F + B));
                CHECK(fabs(s.busy_max - m * (F + B)) < 1e-9, "busy %g", s.busy_max);
                SimStep l = simulate((ScheduleKind)k, p, m, 1, F, B, 0.25);
                CHECK(l.makespan >= s.makespan - 1e-12 && fabs(l.busy_max - s.busy_max) < 1e-9 &&
                      (p == 1 ? l.makespan == s.makespan : l.makespan > s.makespan), "link: %g against %g", l.makespan,
                      s.makespan);
            }
            if (p < 2 || m % p) continue;
            for (int v = 2; v <= 4; v += 2) {
                SimStep s = simulate(SCHED_INTERLEAVED, p, m, v, F / v, B / v, 0);
                double want = (p - 1) * (F + B) / v;
                CHECK(fabs(s.bubble - want) < 1e-9, "interleaved p=%d m=%d v=%d: bubble %g, closed form %g", p, m, v,
                      s.bubble, want);
                CHECK(fabs(s.makespan - (m * (F + B) + want)) < 1e-9, "interleaved p=%d m=%d v=%d: step %g", p, m, v,
                      s.makespan);
            }
        }
}

/* The enumeration of a small case, counted by hand: the tests' TINY model (embed_dim=32
 * n_heads=2 n_layers=1), global_batch=2, one machine of 2 CPU ranks.
 *   1 rank:  batch 2 or 1 x 2 accumulated (2) x DDP x {checkpointing} (2) x {offload none,
 *            optimizer} (2) = 8
 *   dp 2:    batch 1 (1) x {DDP, ZeRO-1, ZeRO-2} x 2 x 2 = 12, FSDP x 2 x {none, optimizer,
 *            params} (3) = 6: 18
 *   tp 2:    {sequence parallel, not} (2) x batch (2) x DDP x 2 x 2 = 16
 *   pp 2:    batch 2, 2 micro-batches (batch 1 cannot feed 2 stages) x {1f1b, gpipe, zb1}
 *            (interleaved needs 4 stages of a 1-layer model) x DDP x 2 x 2 = 12, of which the
 *            checks refuse zb1 with checkpointing (2)
 * 54 written, 2 refused, 52 feasible with room enough. */
static void test_enumeration_count(void) {
    const char *model = "vocab_size=50257 embed_dim=32 n_heads=2 n_layers=1 context_len=32";
    Config c;
    config_defaults(&c);
    char buf[256], err[256], *w[8];
    int n = 0;
    snprintf(buf, sizeof buf, "%s", model);
    for (char *s = strtok(buf, " "); s; s = strtok(NULL, " ")) w[n++] = s;
    CHECK(config_parse(&c, CMD_TRAIN, n, w, err, sizeof err) == 0, "%s", err);
    c.global_batch = 2;
    Cluster cl = {1, 2, 2, 0, 0, 64e9, 0, 0};
    Profile p;
    profile_init(&p, "cpu", 2);
    PlanList pl;
    plan_enumerate(model, &c, &cl, &p, &pl);
    CHECK(pl.candidates == 54, "%d layouts written, 54 by hand", pl.candidates);
    CHECK(pl.refused == 2, "%d refused, 2 by hand (first: %s)", pl.refused, pl.first_refusal);
    CHECK(pl.n == 52 && pl.too_big == 0, "%d feasible, %d over memory", pl.n, pl.too_big);
    int by_world[3] = {0, 0, 0};
    for (int i = 0; i < pl.n; i++) by_world[pl.v[i].world]++;
    CHECK(by_world[1] == 8 && by_world[2] == 44, "1 rank %d (8), 2 ranks %d (44)", by_world[1], by_world[2]);
    /* ordered fastest first, each with its parts summing to the step */
    for (int i = 0; i < pl.n; i++) {
        const StepCost *s = &pl.v[i].cost;
        CHECK(i == 0 || pl.v[i - 1].cost.step <= s->step, "order at %d", i);
        CHECK(fabs(s->compute + s->comm + s->bubble + s->optim + s->host - s->step) < 1e-12 && s->step > 0, "parts at %d", i);
    }
    /* the pruning: with a machine of less memory, exactly the layouts whose ranks' estimates
     * on it add up to more are over; each layout's memory is what estimate (layout_init) gives */
    size_t limit = pl.v[pl.n / 2].host;
    for (int i = 0; i < pl.n; i++) {
        Config lc;
        char lb[2048], *lw[96];
        config_defaults(&lc);
        int ln = plan_words(model, &pl.v[i], 0, lb, sizeof lb, lw, 96);
        Layout L;
        CHECK(config_parse(&lc, CMD_TRAIN, ln, lw, err, sizeof err) == 0 && layout_init(&L, &lc, pl.v[i].world, err, sizeof err) == 0,
              "%s: %s", pl.v[i].keys, err);
        CHECK(L.most == pl.v[i].mem, "%s: %zu, estimate %zu", pl.v[i].keys, pl.v[i].mem, L.most);
        size_t need = 0;
        for (int r = 0; r < L.world; r++) need += L.pp > 1 ? L.stage_mem[r / (L.tp * L.dp)].total : L.whole.total;
        CHECK(need == pl.v[i].host, "%s: the machine's need %zu, %zu", pl.v[i].keys, pl.v[i].host, need);
        layout_free(&L);
    }
    Cluster small = cl;
    small.host_memory = (double)limit;
    PlanList pt;
    plan_enumerate(model, &c, &small, &p, &pt);
    int over = 0;
    for (int i = 0; i < pl.n; i++) over += pl.v[i].host > limit;
    CHECK(pt.too_big == over && pt.n == 52, "over memory %d, by the estimates %d", pt.too_big, over);
    for (int i = 0; i < pt.n; i++) CHECK(pt.v[i].fits == (pt.v[i].host <= limit), "%s", pt.v[i].keys);
    plan_list_free(&pt);
    plan_list_free(&pl);
    profile_free(&p);
}

/* A profile written and read back holds the same records; lookups at a measured shape say
 * measured, between two sizes interpolated, of an op never measured default. */
static void test_profile(void) {
    Profile p;
    profile_init(&p, "cpu", 2);
    long a[4] = {256, 32, 96, 0}, b[4] = {1024, 32, 96, 0}, mid[4] = {512, 32, 96, 0};
    profile_add_op(&p, "matmul_forward", 1, a, 0.001);
    profile_add_op(&p, "matmul_forward", 1, b, 0.004);
    profile_add_coll(&p, COLL_ALLREDUCE, 2, 1e-5, 2e9);
    profile_add_run(&p, 0.5, 0.4, 2, "batch_size=4 zero_opt=true");
    char path[] = "/tmp/meshtrain-profile-XXXXXX", err[256];
    int fd = mkstemp(path);
    CHECK(fd >= 0, "mkstemp");
    CHECK(profile_write(&p, path, err, sizeof err) == 0, "%s", err);
    Profile q;
    CHECK(profile_read(&q, path, err, sizeof err) == 0, "%s", err);
    CHECK(q.n_ops == 2 && q.n_coll == 1 && q.n_runs == 1 && q.cores == 2 && !strcmp(q.device, "cpu"), "read back");
    CHECK(fabs(profile_op(&q, "matmul_forward", 1, a) - 0.001) < 1e-12 && q.tally_ops[SRC_MEASURED] == 1, "measured");
    CHECK(fabs(profile_op(&q, "matmul_forward", 1, mid) - 0.002) < 1e-12 && q.tally_ops[SRC_INTERPOLATED] == 1, "interpolated");
    long r[4] = {64, 32, 0, 0};
    CHECK(profile_op(&q, "rmsnorm_forward", 1, r) > 0 && q.tally_ops[SRC_DEFAULT] == 1, "default");
    CHECK(fabs(profile_coll(&q, COLL_ALLREDUCE, 2, 2e9, 0) - (1e-5 + 1)) < 1e-9 && q.tally_coll[SRC_MEASURED] == 1, "coll");
    CHECK(profile_coll(&q, COLL_ALLREDUCE, 4, 2e9, 0) > 1 && q.tally_coll[SRC_INTERPOLATED] == 1, "coll at 4 ranks");
    CHECK(profile_run_of(&q, 2, "batch_size=4 zero_opt=true") == 0.5, "run");
    int n;
    CHECK(fabs(profile_correction(&q, &n) - 1.25) < 1e-12 && n == 1, "correction");
    profile_free(&q);
    FILE *f = fopen(path, "w");
    fprintf(f, "device cpu\nop matmul_forward 1 2 3\n");
    fclose(f);
    CHECK(profile_read(&q, path, err, sizeof err) == -1 && strstr(err, "line 2"), "a bad line: %s", err);
    remove(path);
    profile_free(&p);
}

int main(void) {
    RUN(test_bubble_closed_forms);
    RUN(test_enumeration_count);
    RUN(test_profile);
    return TEST_SUMMARY();
}
