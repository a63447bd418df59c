/* plan: the fastest layouts of a model on a cluster, predicted (and with try=, run);
 * calibrate: the profile the predictions read. */
#include <errno.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include "calibrate.h"
#include "commands.h"
#include "estimate.h"
#include "ops.h"
#include "plan.h"
#include "run.h"
#include "util.h"

/* The keys plan and calibrate take that a train command does not. */
static const char *PLAN_ONLY[] = {"global_batch", "cluster", "hosts", "devices_per_host", "device_memory", "host_memory",
                                  "link_intra", "link_inter", "profile", "top", "try", "try_steps", "out", "config"};

static const char *g_program = "meshtrain";
void set_program_name(const char *argv0) { g_program = argv0; }
const char *program_name(void) { return g_program; }

typedef struct { char *buf; size_t len; } Words;

static void model_key(void *ctx, const char *key, const char *value, int is_text) {
    (void)is_text;
    Words *w = ctx;
    for (size_t i = 0; i < sizeof PLAN_ONLY / sizeof PLAN_ONLY[0]; i++)
        if (!strcmp(key, PLAN_ONLY[i])) return;
    if (!config_was_set(key)) return;
    size_t n = strlen(w->buf);
    snprintf(w->buf + n, w->len - n, "%s%s=%s", n ? " " : "", key, value);
}

/* The model's keys as given (and device, optimizer, data_dir), checked as train would check
 * them: a bad model is one line and exit 2 here, not a plan with no layout. */
static void model_keys(const Config *c, int mask, char *buf, size_t len) {
    Words w = {buf, len};
    buf[0] = 0;
    config_each(c, mask, model_key, &w);
    char copy[2048], err[512], *words[96];
    int n = 0;
    snprintf(copy, sizeof copy, "%s", buf);
    for (char *s = strtok(copy, " "); s && n < 96; s = strtok(NULL, " ")) words[n++] = s;
    Config t;
    config_defaults(&t);
    if (config_parse(&t, CMD_TRAIN, n, words, err, sizeof err)) die(EXIT_BAD_INPUT, "%s", err);
}

/* The cluster the keys describe, or this machine (cluster=this; keys given override what it
 * reads). Every missing or impossible part is one line and exit 2. */
static Cluster cluster_of(const Config *c, int cmd, int hosts_given, int link_inter_given) {
    Cluster cl = {c->hosts, c->devices_per_host, 0, !strcmp(c->device, "cuda"), c->device_memory, c->host_memory,
                  c->link_intra, c->link_inter};
    int cores = omp_get_num_procs();
    const char *who = cmd == CMD_PLAN ? "plan" : "calibrate";
    if (!strcmp(c->cluster, "this")) {
        if (hosts_given && c->hosts != 1)
            die(EXIT_BAD_INPUT, "%s: cluster=this reads one machine; hosts=%d describes others (drop cluster=this)", who,
                c->hosts);
        cl.cores = cores;
        if (cl.host_memory <= 0) cl.host_memory = (double)available_memory_bytes();
        if (cl.gpu) {
            char err[512];
            size_t free_b, total;
            if (ops_init("cuda", 0, err, sizeof err)) die(EXIT_BAD_INPUT, "%s: cluster=this, device=cuda: %s", who, err);
            if (ops_device_memory(&free_b, &total)) die(EXIT_BAD_INPUT, "%s: cluster=this: the GPU's memory is unknown", who);
            if (cl.device_memory <= 0) cl.device_memory = (double)total;
            if (cl.per_host <= 0) cl.per_host = 1;  /* (the GPUs a machine has: devices_per_host=) */
        } else if (cl.per_host <= 0) {
            cl.per_host = cores;
        }
        return cl;
    }
    if (cmd == CMD_CALIBRATE) {  /* calibrate measures this machine whatever the keys: they only bound the groups */
        cl.cores = cores;
        if (cl.per_host <= 0) cl.per_host = cores;
        return cl;
    }
    if (cl.per_host <= 0)
        die(EXIT_BAD_INPUT, "plan: describe the cluster: devices_per_host= (GPUs, or CPU ranks, per machine), or cluster=this");
    if (cl.gpu && cl.device_memory <= 0)
        die(EXIT_BAD_INPUT, "plan: device=cuda needs device_memory= (one GPU's memory, e.g. 80GB), or cluster=this");
    if (cl.host_memory <= 0)
        die(EXIT_BAD_INPUT, "plan: host_memory= (one machine's memory, e.g. 1TB) is needed, or cluster=this");
    if (cl.hosts > 1 && cl.link_inter <= 0 && link_inter_given)
        die(EXIT_BAD_INPUT, "plan: link_inter=0 with hosts=%d: the machines need a link", cl.hosts);
    cl.cores = cl.gpu ? cores : cl.per_host;  /* (described CPU machines: a core a rank) */
    return cl;
}

/* The command a layout runs with: mpirun over its ranks (on CPU ranks not bound to a core,
 * so that a rank's threads spread; oversubscribed where ranks outnumber the cores). */
static void command_of(const char *model, const PlanLayout *l, const Cluster *cl, char *out, size_t len) {
    char buf[2048], *words[96];
    int n = plan_words(model, l, l->cost.threads, buf, sizeof buf, words, 96);
    size_t k = 0;
    if (l->world > 1)
        k += (size_t)snprintf(out, len, "mpirun -np %d%s%s ", l->world, cl->gpu ? "" : " --bind-to none",
                              !cl->gpu && l->world > cl->cores * cl->hosts ? " --oversubscribe" : "");
    k += (size_t)snprintf(out + k, k < len ? len - k : 0, "%s train", program_name());
    for (int i = 0; i < n && k < len; i++) k += (size_t)snprintf(out + k, len - k, " %s", words[i]);
}

static double ms(double s) { return s * 1e3; }

static void print_layout(int i, const char *model, const PlanLayout *l, const Cluster *cl, double corr) {
    char b1[32], b2[32], cmd[4096];
    fmt_commas(b2, (long long)(l->cost.tokens_per_s / corr + 0.5));
    printf("%2d. predicted %.1f ms a step, %s tokens/s, %s a %s%s: %s\n", i, ms(l->cost.step * corr), b2,
           fmt_bytes(b1, (double)l->mem), cl->gpu ? "GPU" : "rank", l->fits ? "" : " (does not fit)", l->what);
    if (l->fits) {
        const StepCost *s = &l->cost;
        printf("    compute %.1f ms, exposed communication %.1f, bubble %.1f, optimizer %.1f, host transfers %.1f",
               ms(s->compute * corr), ms(s->comm * corr), ms(s->bubble * corr), ms(s->optim * corr), ms(s->host * corr));
        printf("; ops %d measured, %d interpolated, %d default; collectives %d measured, %d interpolated, %d default\n",
               l->src_ops[SRC_MEASURED], l->src_ops[SRC_INTERPOLATED], l->src_ops[SRC_DEFAULT], l->src_coll[SRC_MEASURED],
               l->src_coll[SRC_INTERPOLATED], l->src_coll[SRC_DEFAULT]);
        if (l->measured > 0) printf("    measured (try=): %.1f ms a step\n", ms(l->measured));
    }
    command_of(model, l, cl, cmd, sizeof cmd);
    printf("    run: %s\n", cmd);
}

/* The median of the logged steps' ms after the first (the first pays for first touches). */
static double logged_step(const char *log) {
    FILE *f = fopen(log, "r");
    if (!f) return 0;
    char line[4096];
    double v[1024];
    int n = 0;
    while (fgets(line, sizeof line, f) && n < 1024) {
        int step;
        char *m = strstr(line, "\"ms\":");
        if (sscanf(line, "{\"step\":%d,\"loss\"", &step) == 1 && step > 1 && m) v[n++] = atof(m + 5) / 1e3;
    }
    fclose(f);
    for (int i = 1; i < n; i++)  /* (few: insertion) */
        for (int j = i; j > 0 && v[j] < v[j - 1]; j--) { double t = v[j]; v[j] = v[j - 1]; v[j - 1] = t; }
    return n ? (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2])) : 0;
}

/* Runs a layout's command for `steps` steps as a child (its output into dir/out.txt); the
 * measured step, or 0 when it failed. */
static double try_layout(const char *model, const PlanLayout *l, const Cluster *cl, int steps, const char *dir) {
    char self[1024], buf[2048], *words[96], *argv[140], a_np[16], a_steps[32], a_out[640], a_log[700], a_thr[32];
    if (self_exe(self, sizeof self)) return 0;
    int n = plan_words(model, l, 0, buf, sizeof buf, words, 96), a = 0;
    if (l->world > 1) {
        snprintf(a_np, sizeof a_np, "%d", l->world);
        argv[a++] = "mpirun", argv[a++] = "-np", argv[a++] = a_np;
        if (!cl->gpu) argv[a++] = "--bind-to", argv[a++] = "none";
        if (!cl->gpu && l->world > cl->cores) argv[a++] = "--oversubscribe";
    }
    argv[a++] = self, argv[a++] = "train";
    for (int i = 0; i < n; i++) argv[a++] = words[i];
    snprintf(a_thr, sizeof a_thr, "threads=%d", l->cost.threads);
    snprintf(a_steps, sizeof a_steps, "steps=%d", steps);
    snprintf(a_out, sizeof a_out, "out_dir=%s", dir);
    if (!cl->gpu) argv[a++] = a_thr;
    argv[a++] = a_steps, argv[a++] = a_out, argv[a++] = "ckpt_path=none", argv[a++] = "progress=false";
    argv[a++] = "val_batches=1";
    argv[a] = NULL;
    mkdir_p(dir);
    snprintf(a_log, sizeof a_log, "%s/out.txt", dir);
    if (run_child(argv, a_log) != 0) return 0;
    snprintf(a_log, sizeof a_log, "%s/log.jsonl", dir);
    return logged_step(a_log);
}

int cmd_plan(Config *c) {
    char model[2048];
    int hosts_given = config_was_set("hosts"), link_given = config_was_set("link_inter");  /* (before the model's parse) */
    model_keys(c, CMD_PLAN, model, sizeof model);
    if (c->global_batch <= 0) die(EXIT_BAD_INPUT, "plan: give global_batch= (sequences per optimizer step, over all ranks)");
    Cluster cl = cluster_of(c, CMD_PLAN, hosts_given, link_given);
    Profile prof;
    char err[1024];
    if (c->profile[0]) {
        if (profile_read(&prof, c->profile, err, sizeof err)) die(EXIT_BAD_INPUT, "%s", err);
        if (strcmp(prof.device, c->device))
            die(EXIT_BAD_INPUT, "plan: profile=%s was measured on device=%s, not device=%s", c->profile, prof.device,
                c->device);
    } else {
        profile_init(&prof, c->device, cl.cores);
    }
    double t0 = now_seconds();
    PlanList pl;
    plan_enumerate(model, c, &cl, &prof, &pl);
    double dt = now_seconds() - t0;
    int runs;
    double corr = profile_correction(&prof, &runs);
    char b1[32], b2[32];
    printf("meshtrain plan: %s global_batch=%d\n", model, c->global_batch);
    if (cl.gpu)
        printf("cluster: %d machine%s x %d GPU%s of %s, %s host memory each%s\n", cl.hosts, cl.hosts > 1 ? "s" : "",
               cl.per_host, cl.per_host > 1 ? "s" : "", fmt_bytes(b1, cl.device_memory), fmt_bytes(b2, cl.host_memory),
               !strcmp(c->cluster, "this") ? " (this machine)" : "");
    else
        printf("cluster: %d machine%s, up to %d CPU rank%s on %d cores and %s each%s\n", cl.hosts, cl.hosts > 1 ? "s" : "",
               cl.per_host, cl.per_host > 1 ? "s" : "", cl.cores, fmt_bytes(b1, cl.host_memory),
               !strcmp(c->cluster, "this") ? " (this machine)" : "");
    int feasible = pl.n - pl.too_big;
    printf("layouts: %d written, %d refused by the checks a run makes, %d over memory, %d feasible (searched in %.2f s)\n",
           pl.candidates, pl.refused, pl.too_big, feasible, dt);
    if (c->profile[0])
        printf("profile: %s (%d ops, %d collectives measured%s)\n", c->profile, prof.n_ops, prof.n_coll,
               runs ? "" : "; no layouts run yet");
    else
        printf("profile: none: every op and collective from the stated defaults (docs/plan.md); run meshtrain calibrate\n");
    if (runs)
        printf("  scaled by %.3f, the median of measured over predicted of the %d layout%s try= ran\n", corr, runs,
               runs > 1 ? "s" : "");
    if (!feasible) {
        printf("no layout fits");
        if (pl.n) printf("; the smallest takes %s a %s", fmt_bytes(b1, (double)pl.v[pl.n - 1].mem), cl.gpu ? "GPU" : "rank");
        printf("\n");
        plan_list_free(&pl);
        profile_free(&prof);
        return EXIT_RUN_FAILURE;
    }
    int top = c->top > 0 && c->top < feasible ? c->top : feasible;
    if (!c->top) top = pl.n;  /* every layout the checks passed, the ones over memory last */
    printf("\n");
    for (int i = 0; i < top; i++) print_layout(i + 1, model, &pl.v[i], &cl, corr);
    if (c->try > 0) {
        int k = c->try < feasible ? c->try : feasible;
        printf("\ntry: the best %d for %d steps each (the median step after the first):\n", k, c->try_steps);
        for (int i = 0; i < k; i++) {
            char dir[600];
            snprintf(dir, sizeof dir, "runs/plan/try%d", i + 1);
            PlanLayout *l = &pl.v[i];
            double m = try_layout(model, l, &cl, c->try_steps, dir);
            double pr = l->cost.step * corr;
            if (m > 0) {
                printf("%2d. predicted %.1f ms, measured %.1f ms (%+.1f%%): %s\n", i + 1, ms(pr), ms(m), 100 * (pr - m) / m,
                       l->what);
                profile_add_run(&prof, m, l->cost.step, l->world, l->keys);
            } else {
                printf("%2d. predicted %.1f ms, the run failed (its output: %s/out.txt): %s\n", i + 1, ms(pr), dir, l->what);
            }
        }
        if (c->profile[0]) {
            if (profile_write(&prof, c->profile, err, sizeof err)) die(EXIT_RUN_FAILURE, "%s", err);
            printf("folded into %s: the next plan shows these steps and scales the others by measured over predicted\n",
                   c->profile);
        } else {
            printf("(no profile= to fold the measurements into)\n");
        }
    }
    plan_list_free(&pl);
    profile_free(&prof);
    return 0;
}

int cmd_calibrate(Config *c) {
    char model[2048];
    model_keys(c, CMD_CALIBRATE, model, sizeof model);
    Cluster cl = cluster_of(c, CMD_CALIBRATE, 0, 0);
    const char *out = c->out[0] ? c->out : "profile.txt";
    return calibrate_run(c, model, &cl, out);
}
