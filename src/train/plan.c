#include "plan.h"
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "layout.h"
#include "run.h"
#include "util.h"

#define MAX_WORDS 96

int plan_words(const char *model, const PlanLayout *l, int threads, char *buf, size_t len, char **words, int max) {
    int n = 0;
    if (threads > 0) snprintf(buf, len, "%s %s threads=%d", model, l->keys, threads);
    else snprintf(buf, len, "%s %s", model, l->keys);
    for (char *s = strtok(buf, " "); s && n < max; s = strtok(NULL, " ")) words[n++] = s;
    return n;
}

static void push(PlanList *out, const PlanLayout *l) {
    if (out->n == out->cap) out->cap = out->cap ? 2 * out->cap : 256, out->v = xrealloc(out->v, (size_t)out->cap * sizeof *out->v);
    out->v[out->n++] = *l;
}

typedef struct {
    const char *model;
    const Config *base;
    const Cluster *cl;
    Profile *p;
    PlanList *out;
} Enum;

/* The largest machine's need: its ranks' estimates (CPU ranks share its memory), or on GPUs
 * their offloaded state. Rank r holds pipeline stage r / (tp dp). */
static size_t host_need(const Layout *L, const Cluster *cl) {
    size_t most = 0;
    for (int h = 0; h * cl->per_host < L->world; h++) {
        size_t need = 0;
        for (int r = h * cl->per_host; r < L->world && r < (h + 1) * cl->per_host; r++) {
            int s = r / (L->tp * L->dp);
            const MemEstimate *e = L->pp > 1 ? &L->stage_mem[s] : &L->whole;
            need += cl->gpu ? e->host : e->total;
        }
        if (need > most) most = need;
    }
    return most;
}

/* One candidate: its keys parsed and checked as `meshtrain train` would, its memory, its cost. */
static void consider(Enum *en, PlanLayout *l) {
    char buf[2048], err[512];
    char *words[MAX_WORDS];
    en->out->candidates++;
    if (l->keys[0] == ' ') memmove(l->keys, l->keys + 1, strlen(l->keys));
    int n = plan_words(en->model, l, 0, buf, sizeof buf, words, MAX_WORDS);
    Config c;
    config_defaults(&c);
    Layout L;
    if (config_parse(&c, CMD_TRAIN, n, words, err, sizeof err) || layout_init(&L, &c, l->world, err, sizeof err)) {
        if (!en->out->refused++) snprintf(en->out->first_refusal, sizeof en->out->first_refusal, "%s: %s", l->keys, err);
        return;
    }
    const Cluster *cl = en->cl;
    l->mem = L.most;
    l->host = host_need(&L, cl);
    l->fits = cl->gpu ? (cl->device_memory <= 0 || l->mem <= cl->device_memory) &&
                            (cl->host_memory <= 0 || l->host <= cl->host_memory)
                      : cl->host_memory <= 0 || l->host <= cl->host_memory;
    if (l->fits) {
        profile_tally_reset(en->p);
        plan_cost(&c, &L, cl, en->p, &l->cost);
        memcpy(l->src_ops, en->p->tally_ops, sizeof l->src_ops);
        memcpy(l->src_coll, en->p->tally_coll, sizeof l->src_coll);
        l->measured = profile_run_of(en->p, l->world, l->keys);
    } else {
        en->out->too_big++;
    }
    layout_free(&L);
    push(en->out, l);
}

/* printf's fmt appended to the string in dst[len] */
static void cat(char *dst, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void cat(char *dst, size_t len, const char *fmt, ...) {
    size_t n = strlen(dst);
    va_list ap;
    va_start(ap, fmt);
    if (n < len) vsnprintf(dst + n, len - n, fmt, ap);
    va_end(ap);
}
#define KEY(l, ...) cat((l)->keys, sizeof (l)->keys, __VA_ARGS__)

static void describe(PlanLayout *l) {
    char *w = l->what;
    size_t n = sizeof l->what;
    snprintf(w, n, "dp %d x tp %d x pp %d", l->dp, l->tp, l->pp);
    if (l->tp > 1 && l->sp) cat(w, n, " (sequence parallel)");
    if (l->sched) cat(w, n, " (%s, %d micro-batches)", l->sched, l->m);
    if (l->ep > 1) cat(w, n, ", expert parallel %d", l->ep);
    cat(w, n, ", %s", l->strategy);
    cat(w, n, ", batch %d a rank", l->B);
    if (l->K > 1) cat(w, n, " x %d accumulated", l->K);
    if (l->ac) cat(w, n, ", activation checkpointing");
    if (l->offload) cat(w, n, ", offload %s", l->offload);
    if (l->prec) cat(w, n, ", %s", l->prec);
}

/* The options that change neither degrees nor batches: checkpointing, offload, precision. */
static void options(Enum *en, PlanLayout base, int fsdp_full) {
    static const char *precs[] = {"mixed", "bf16"}, *offs[] = {NULL, "optimizer", "params"};
    int gpu = en->cl->gpu;
    for (int pr = 0; pr < (gpu ? 2 : 1); pr++)
        for (int ac = 0; ac < 2; ac++)
            for (int off = 0; off < (fsdp_full ? 3 : 2); off++) {
                PlanLayout l = base;
                l.ac = ac;
                l.offload = offs[off];
                l.prec = gpu ? precs[pr] : NULL;
                if (ac) KEY(&l, " activation_checkpointing=true");
                if (off) KEY(&l, " offload=%s", offs[off]);
                if (gpu) KEY(&l, " precision=%s", precs[pr]);
                describe(&l);
                consider(en, &l);
            }
}

/* Strategies over dp ranks: DDP, ZeRO-1, ZeRO-2, FSDP, and hybrid FSDP where dp spans machines
 * (a shard group of one machine's dp ranks); one (DDP) where dp is 1. */
static void strategies(Enum *en, PlanLayout base) {
    static const char *keys[] = {"", " zero_opt=true", " fsdp=true shard_strategy=grad_op", " fsdp=true", ""};
    static const char *names[] = {"DDP", "ZeRO-1", "ZeRO-2", "FSDP", "hybrid FSDP"};
    int group = en->cl->per_host / base.tp;  /* one machine's dp ranks */
    int hybrid = en->cl->hosts > 1 && base.dp > group && group > 1 && base.dp % group == 0;
    for (int k = 0; k < (base.dp > 1 ? 4 + hybrid : 1); k++) {
        PlanLayout l = base;
        KEY(&l, "%s", keys[k]);
        if (k == 4) KEY(&l, " fsdp=true shard_strategy=hybrid shard_group_size=%d", group);
        l.strategy = names[k];
        options(en, l, k >= 3);
    }
}

static void batches(Enum *en, PlanLayout base, int per_rank) {
    const ModelConfig mc = model_config_of(en->base);
    static const char *scheds[] = {"1f1b", "gpipe", "interleaved", "zb1"};
    for (int K = 1; K <= per_rank; K++) {
        if (per_rank % K) continue;
        int B = per_rank / K;
        PlanLayout l = base;
        l.B = B, l.K = K;
        KEY(&l, " batch_size=%d", B);
        if (K > 1) KEY(&l, " grad_accum_steps=%d", K);
        if (l.pp == 1) { strategies(en, l); continue; }
        for (int m = l.pp; m <= B; m++) {
            if (B % m) continue;
            for (int s = 0; s < 4; s++) {
                if (s == 2 && 2 * l.pp > mc.n_layers + 1) continue;  /* interleaved's 2 chunks a rank need the layers */
                PlanLayout q = l;
                q.m = m, q.sched = scheds[s];
                KEY(&q, " micro_batches=%d", m);
                KEY(&q, " pipeline_schedule=%s", scheds[s]);
                strategies(en, q);
            }
        }
    }
}

/* Fastest first: a layout's measured step where try= ran it, else its prediction scaled as
 * the measured ones were off (profile_correction); those over memory last. */
static double g_corr = 1;
static int cmp_layout(const void *a, const void *b) {
    const PlanLayout *x = a, *y = b;
    if (x->fits != y->fits) return y->fits - x->fits;
    double tx = x->measured > 0 ? x->measured : x->cost.step * g_corr;
    double ty = y->measured > 0 ? y->measured : y->cost.step * g_corr;
    return (tx > ty) - (tx < ty);
}

void plan_enumerate(const char *model, const Config *base, const Cluster *cl, Profile *p, PlanList *out) {
    memset(out, 0, sizeof *out);
    Enum en = {model, base, cl, p, out};
    const ModelConfig mc = model_config_of(base);
    int G = base->global_batch;
    int most = cl->hosts * cl->per_host;
    /* GPUs: the whole cluster; CPU ranks: any number up to it (fewer ranks get more threads each) */
    for (int W = cl->gpu ? most : 1; W <= most; W++)
        for (int tp = 1; tp <= W; tp++) {
            if (W % tp) continue;
            for (int pp = 1; pp <= W / tp && pp <= mc.n_layers + 1; pp++) {
                if ((W / tp) % pp) continue;
                int dp = W / (tp * pp);
                if (G % dp) continue;
                for (int ep = 1; ep <= dp; ep++) {
                    if (dp % ep || (ep > 1 && (!mc.moe_experts || mc.moe_experts % ep))) continue;
                    for (int sp = tp > 1 ? 0 : 1; sp < 2; sp++) {
                        PlanLayout l;
                        memset(&l, 0, sizeof l);
                        l.world = W, l.dp = dp, l.tp = tp, l.pp = pp, l.ep = ep, l.sp = sp;
                        if (tp > 1) KEY(&l, " tensor_parallel_size=%d", tp);
                        if (tp > 1 && !sp) KEY(&l, " sequence_parallel=false");
                        if (pp > 1) KEY(&l, " pipeline_parallel_size=%d", pp);
                        if (ep > 1) KEY(&l, " expert_parallel_size=%d", ep);
                        batches(&en, l, G / dp);
                    }
                }
            }
        }
    g_corr = profile_correction(p, NULL);
    qsort(out->v, (size_t)out->n, sizeof *out->v, cmp_layout);
}

void plan_list_free(PlanList *l) {
    free(l->v);
    memset(l, 0, sizeof *l);
}
