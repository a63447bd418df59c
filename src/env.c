#include "env.h"
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "util.h"

extern char **environ;

typedef enum { K_FLAG, K_INT, K_CHOICE, K_TEXT, K_RANK_STEP, K_RANK_STEPS } Kind;
typedef struct {
    const char *name;
    Kind kind;
    long long lo, hi;  /* K_INT's range */
    const char *choices;
    int wrong;         /* a fault, or results wrong on purpose */
} HookDef;

/* One row per Hook, in its order. */
static const HookDef HOOKS[HOOK_COUNT] = {
    [HOOK_PROFILE] = {"MESHTRAIN_PROFILE", K_CHOICE, 0, 0, "0|1|events", 0},
    [HOOK_TIMELINE] = {"MESHTRAIN_TIMELINE", K_INT, 0, 1LL << 31, NULL, 0},
    [HOOK_TIMELINE_LEADS] = {"MESHTRAIN_TIMELINE_LEADS", K_FLAG, 0, 0, NULL, 0},
    [HOOK_CUDA_SYNC] = {"MESHTRAIN_CUDA_SYNC", K_FLAG, 0, 0, NULL, 0},
    [HOOK_CUDNN_LIB] = {"MESHTRAIN_CUDNN_LIB", K_TEXT, 0, 0, NULL, 0},
    [HOOK_PP_SKIP_COPIES] = {"MESHTRAIN_PP_SKIP_COPIES", K_FLAG, 0, 0, NULL, 1},
    [HOOK_CE_BUFFER_BYTES] = {"MESHTRAIN_CE_BUFFER_BYTES", K_INT, 1, 1LL << 40, NULL, 0},
    [HOOK_OFFLOAD_STAGING] = {"MESHTRAIN_OFFLOAD_STAGING", K_FLAG, 0, 0, NULL, 0},
    [HOOK_FAULT_KILL] = {"MESHTRAIN_FAULT_KILL", K_RANK_STEP, 0, 0, NULL, 1},
    [HOOK_FAULT_HANG] = {"MESHTRAIN_FAULT_HANG", K_RANK_STEP, 0, 0, NULL, 1},
    [HOOK_FAULT_NAN_STEP] = {"MESHTRAIN_FAULT_NAN_STEP", K_INT, 1, 1LL << 31, NULL, 1},
    [HOOK_FAULT_NAN_VAL_STEP] = {"MESHTRAIN_FAULT_NAN_VAL_STEP", K_INT, 1, 1LL << 31, NULL, 1},
    [HOOK_FAULT_TERM_VAL_STEP] = {"MESHTRAIN_FAULT_TERM_VAL_STEP", K_INT, 1, 1LL << 31, NULL, 1},
    [HOOK_FAULT_HOST_ALLOC] = {"MESHTRAIN_FAULT_HOST_ALLOC", K_FLAG, 0, 0, NULL, 1},
    [HOOK_FAULT_OVERFLOW] = {"MESHTRAIN_FAULT_OVERFLOW", K_RANK_STEPS, 0, 0, NULL, 1},
    [HOOK_FAKE_MEMAVAILABLE] = {"MESHTRAIN_FAKE_MEMAVAILABLE", K_INT, 0, 1LL << 62, NULL, 1},
    [HOOK_MOE_SKEW] = {"MESHTRAIN_MOE_SKEW", K_INT, 0, 1000000, NULL, 1},
};

/* Variables earlier builds read (named after MESHTRAIN_): set, they end the run with where
 * the setting went, rather than being ignored. */
static const struct { const char *name, *now; } RETIRED[] = {
    /* {"NAME", "the key ...=" or NULL where the alternative it chose was removed}, */
    {"TP_FUSED", "the key tp_comm="},
    {"TP_CHUNKS", NULL},
    {"TP_OVERLAP", NULL},
    {"TP_HALVES", NULL},
    {"TP_CE", NULL},
    {"TP_KEEP_GATHERED", NULL},
    {"TP_WHOLE_COLS", NULL},
    {"ATTN", "the keys attention=auto|cudnn|own and deterministic=true|false (fast: deterministic=false; "
             "cudnn: attention=cudnn deterministic=false; cudnn-det: attention=cudnn)"},
    {"MATMUL_TUNE", "the key deterministic=false"},
    {"GRAPHS", "the key cuda_graphs=auto|true|false"},
    {"WGMMA_GRID", NULL},
    {"WGMMA_BWD_T", NULL},
    {"GEMM_SMS", NULL},
    {"SIDE_UPDATE", NULL},  /* =0: DDP's update in one queue; the side queue's is the one path */
    {"EMBED_ROWS", NULL},   /* =0: DDP reduced the whole embedding; the rows the batch uses are */
    {"PP_RECV", NULL},
    {"INTERLEAVED_LISTS", NULL},
    {"ZB1_EXTRA", NULL},
    {"ZB1_HELD", "the key zb1_max_in_flight="},
    {"PP_CE", "the key pp_copy_engines="},
    {NULL, NULL},
};

/* parsed values: set (0/1), and the value; a rank:step,... hook's steps */
enum { MAX_HOOK_STEPS = 64 };
static struct {
    int checked; int set[HOOK_COUNT]; long long v[HOOK_COUNT], v2[HOOK_COUNT];
    long long steps[HOOK_COUNT][MAX_HOOK_STEPS];
    int n_steps[HOOK_COUNT];
} g;

static const char *raw(Hook h) {
    const char *e = getenv(HOOKS[h].name);
    return e && *e ? e : NULL;
}

const char *hook_name(Hook h) { return HOOKS[h].name; }

static int parse_ll(const char *s, long long *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end || errno) return -1;
    *out = v;
    return 0;
}

/* the one parser: 0, or -1 with why (for the one-line error) */
static int parse(Hook h, const char *s, const char **why) {
    const HookDef *d = &HOOKS[h];
    long long v = 0, w = 0;
    switch (d->kind) {
    case K_FLAG:
        if (strcmp(s, "0") && strcmp(s, "1")) { *why = "not 0 or 1"; return -1; }
        v = s[0] == '1';
        break;
    case K_INT:
        if (parse_ll(s, &v)) { *why = "not an integer"; return -1; }
        if (v < d->lo || v > d->hi) { *why = "out of range"; return -1; }
        break;
    case K_CHOICE: {
        size_t n = strlen(s);
        int i = 0, found = -1;
        for (const char *c = d->choices; *c; i++) {
            size_t len = strcspn(c, "|");
            if (len == n && !strncmp(c, s, n)) found = i;
            c += len + (c[len] == '|');
        }
        if (found < 0) { *why = d->choices; return -1; }
        v = found;
        break;
    }
    case K_TEXT: v = 1; break;
    case K_RANK_STEP: {
        const char *colon = strchr(s, ':');
        char a[32];
        if (!colon || colon - s >= (long)sizeof a) { *why = "expected rank:step"; return -1; }
        memcpy(a, s, (size_t)(colon - s));
        a[colon - s] = 0;
        if (parse_ll(a, &v) || parse_ll(colon + 1, &w) || v < 0 || w < 0) { *why = "expected rank:step"; return -1; }
        break;
    }
    case K_RANK_STEPS: {  /* rank:step,step,... (up to MAX_HOOK_STEPS steps, each from 1) */
        const char *colon = strchr(s, ':'), *want = "expected rank:step,step,... (steps from 1, at most 64)";
        char a[32];
        if (!colon || colon - s >= (long)sizeof a) { *why = want; return -1; }
        memcpy(a, s, (size_t)(colon - s));
        a[colon - s] = 0;
        if (parse_ll(a, &v) || v < 0) { *why = want; return -1; }
        int n = 0;
        for (const char *p = colon + 1;; n++) {
            size_t len = strcspn(p, ",");
            char b[32];
            long long st;
            if (!len || len >= sizeof b || n == MAX_HOOK_STEPS) { *why = want; return -1; }
            memcpy(b, p, len);
            b[len] = 0;
            if (parse_ll(b, &st) || st < 1) { *why = want; return -1; }
            g.steps[h][n] = st;
            if (!p[len]) { n++; break; }
            p += len + 1;
        }
        g.n_steps[h] = n;
        break;
    }
    }
    g.v[h] = v;
    g.v2[h] = w;
    g.set[h] = d->kind == K_FLAG || d->kind == K_CHOICE ? v != 0 : 1;
    return 0;
}

/* Levenshtein distance, capped: a misspelt hook should not pass silently. */
static int one_edit(const char *a, const char *b) {
    size_t la = strlen(a), lb = strlen(b);
    if (la > lb + 1 || lb > la + 1 || !strcmp(a, b)) return 0;
    size_t i = 0, j = 0;
    int edits = 0;
    while (i < la && j < lb) {
        if (a[i] == b[j]) { i++; j++; continue; }
        if (++edits > 1) return 0;
        if (la > lb) i++;
        else if (lb > la) j++;
        else { i++; j++; }
    }
    return edits + (int)(la - i) + (int)(lb - j) == 1;
}

void hooks_check(void) {
    if (g.checked) return;
    g.checked = 1;
    for (int h = 0; h < HOOK_COUNT; h++) {
        const char *s = raw((Hook)h), *why = NULL;
        if (s && parse((Hook)h, s, &why))
            die_once(EXIT_BAD_INPUT, "%s=%s: %s%s", hook_name((Hook)h), s,
                     HOOKS[h].kind == K_CHOICE ? "expected one of " : "", why);
    }
    for (char **e = environ; e && *e; e++) {
        if (strncmp(*e, "MESHTRAIN_", 10)) continue;
        char name[64];
        size_t n = strcspn(*e + 10, "=");
        if (n >= sizeof name || !(*e)[10 + n + 1]) continue;  /* (set empty: unset) */
        memcpy(name, *e + 10, n);
        name[n] = 0;
        for (size_t r = 0; RETIRED[r].name; r++)
            if (!strcmp(name, RETIRED[r].name)) {
                if (RETIRED[r].now) die_once(EXIT_BAD_INPUT, "MESHTRAIN_%s is no longer read: use %s", name, RETIRED[r].now);
                die_once(EXIT_BAD_INPUT, "MESHTRAIN_%s is no longer read: the alternative it chose was removed (see "
                         "README, Environment)", name);
            }
        for (int h = 0; h < HOOK_COUNT; h++)
            if (one_edit(name, HOOKS[h].name + 10))
                die_once(EXIT_BAD_INPUT, "MESHTRAIN_%s is not a hook meshtrain reads (did you mean %s?)", name,
                         hook_name((Hook)h));
    }
}

int hook_on(Hook h) {
    hooks_check();
    return g.set[h];
}

long long hook_int(Hook h, long long dflt) {
    hooks_check();
    return g.set[h] ? g.v[h] : dflt;
}

const char *hook_text(Hook h) {
    hooks_check();
    return g.set[h] ? raw(h) : NULL;
}

int hook_rank_step(Hook h, int *rank, int *step) {
    hooks_check();
    if (!g.set[h] || HOOKS[h].kind != K_RANK_STEP) return 0;
    *rank = (int)g.v[h];
    *step = (int)g.v2[h];
    return 1;
}

int hook_rank_at_step(Hook h, int rank, int step) {
    hooks_check();
    if (!g.set[h] || HOOKS[h].kind != K_RANK_STEPS || g.v[h] != rank) return 0;
    for (int i = 0; i < g.n_steps[h]; i++)
        if (g.steps[h][i] == step) return 1;
    return 0;
}

void hooks_each(void (*fn)(void *ctx, const char *name, const char *value, int wrong), void *ctx) {
    hooks_check();
    for (int h = 0; h < HOOK_COUNT; h++) {
        const char *s = raw((Hook)h);
        if (s) fn(ctx, hook_name((Hook)h), s, HOOKS[h].wrong);
    }
}

/* ---- the launcher ---- */

/* A task srun started (a job step's task: SLURM_STEP_ID is set); the batch script of an
 * sbatch job also has SLURM_NTASKS and SLURM_PROCID, but it is one process. */
static int slurm_step_tasks(void) {
    const char *step = getenv("SLURM_STEP_ID"), *n = getenv("SLURM_STEP_NUM_TASKS");
    return step && *step && n && *n ? atoi(n) : 0;
}

/* The variables an MPI launcher (mpirun, or srun's PMIx or PMI-2 plugin) gives each rank:
 * without one of them MPI cannot join the process to the others. */
static int mpi_wired(void) {
    const char *vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *v = getenv(vars[i]);
        if (v && *v) return 1;
    }
    return 0;
}

/* srun's tasks without PMIx or PMI are not launched for MPI: one is a plain process (MPI_Init
 * would fail), several are refused (env_unwired_tasks) */
int env_launched(void) { return mpi_wired(); }

int env_local_rank(void) {
    const char *vars[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *v = getenv(vars[i]);
        if (v && *v) return atoi(v);
    }
    return 0;
}

int env_launcher(int *rank, int *size) {
    /* PMIx (srun --mpi=pmix) names no size in the environment: the step's task count is it */
    const char *ranks[] = {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"};
    const char *sizes[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_TASKS"};
    for (size_t i = 0; i < sizeof ranks / sizeof ranks[0]; i++) {
        const char *r = getenv(ranks[i]), *s = getenv(sizes[i]);
        if (i == 3 && !slurm_step_tasks()) break;
        if (r && *r) {
            *rank = atoi(r);
            *size = s && *s && atoi(s) > 0 ? atoi(s) : *rank + 1;
            return 1;
        }
    }
    return 0;
}

int env_unwired_tasks(void) {
    int n = slurm_step_tasks();
    return n > 1 && !mpi_wired() ? n : 0;
}

int env_open_mpi(void) { return getenv("OMPI_COMM_WORLD_SIZE") != NULL; }
int env_mpirun_kill_delay_set(void) { return getenv("OMPI_MCA_odls_base_sigkill_timeout") != NULL; }
void env_default(const char *name, const char *value) { setenv(name, value, 0); }
