/* plan — every layout meshtrain can run a model in on a cluster for a global batch: data x
 * tensor x pipeline (x expert) parallel degrees, the data-parallel strategy, the pipeline's
 * schedule and micro-batches, gradient accumulation, activation checkpointing, offload and
 * precision. Each candidate is written as the keys of its `meshtrain train` command and
 * parsed and checked exactly as that command's start-up would (config_parse, layout_init),
 * its memory is the estimate's, and the ones that fit get a predicted step (plan_cost). */
#ifndef MESHTRAIN_PLAN_H
#define MESHTRAIN_PLAN_H
#include "config.h"
#include "plan_cost.h"
#include "profile.h"

typedef struct {
    int world, dp, tp, pp, ep, sp, B, K, m, ac;
    const char *strategy, *sched, *offload, *prec;  /* names (sched NULL without a pipeline) */
    char keys[768];    /* the train keys of the layout, beyond the model's (and threads=) */
    char what[192];    /* one line: degrees, strategy, batch, schedule, options */
    size_t mem;        /* the largest rank's estimate (what `estimate` prints as its total) */
    size_t host;       /* the largest machine's need of host memory (its ranks' estimates on the cpu;
                        * the offloaded state on GPUs) */
    int fits;
    StepCost cost;
    int src_ops[SRC_KINDS], src_coll[SRC_KINDS];  /* where the prediction's numbers came from */
    double measured;   /* the step a try= measured (the profile's), or 0 */
} PlanLayout;

typedef struct {
    PlanLayout *v;
    int n, cap;
    int candidates, refused, too_big;  /* written; refused by the checks; over memory */
    char first_refusal[1400];
} PlanList;

/* model: the model's keys as the user gave them ("embed_dim=128 n_heads=4 ..."), base their
 * parsed config (device, optimizer, ...). Every candidate whose checks pass is added, with
 * fits set; those that fit are costed with p. Ordered fastest first (those that do not fit
 * last). */
void plan_enumerate(const char *model, const Config *base, const Cluster *cl, Profile *p, PlanList *out);
void plan_list_free(PlanList *l);
/* The argv of a layout's train command (model keys, layout keys, threads=): n words into
 * words (pointers into buf). */
int plan_words(const char *model, const PlanLayout *l, int threads, char *buf, size_t len, char **words, int max);
#endif
