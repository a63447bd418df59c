/* versions — the weight versions of a pipeline without a flush (pipeline_schedule=2bw and
 * pipedream). Version k of a unit is its weights after k updates; the model's own weights
 * are the newest (the optimizer updates them in place), and a unit with delay d keeps copies
 * of the d versions before it. A micro-batch of index i computes unit u, forward and
 * backward, on version max(0, i - delay[u]) (weight stashing): what its index says, whenever
 * the schedule runs it, so that a drain before validation or a checkpoint changes the timing
 * and never the arithmetic. 2bw: delay 1 and the index a step's; pipedream: the index a
 * micro-batch's, one update after each, delay the micro-batches its stage runs ahead. */
#ifndef MESHTRAIN_VERSIONS_H
#define MESHTRAIN_VERSIONS_H
#include <stddef.h>
#include "model.h"

typedef struct {
    Model *m;
    const UnitHooks *hooks;  /* the strategy's: its gather makes a unit's newest whole and current */
    int max_delay;
    int *delay;              /* per unit (0: no copies: not held, or never stale) */
    void **copy;             /* [u * max_delay + k % delay[u]]: version k of unit u, the delay[u] before the newest */
    void **live;             /* per unit: the ucompute the strategy set (NULL: the ops read the parameters) */
    size_t *bytes;           /* per unit: one copy's bytes (the compute type) */
    long long updates;       /* the newest is version `updates` */
} Versions;

/* delay: per unit of m (copied). Every copy starts as the newest weights (the first
 * micro-batches compute on the initial weights; a run resumed from a checkpoint without
 * versions starts its staleness there). */
void versions_init(Versions *v, Model *m, const UnitHooks *hooks, const int *delay);
/* The ops compute micro-batch index i: each unit's version max(0, i - delay[u]), which must
 * be held (the newest, or one of the delay[u] before it). */
void versions_use(Versions *v, long long index);
void versions_use_newest(Versions *v);
/* Before an update of the newest: it is copied (after the strategy's gather), replacing the
 * version delay[u] before it, which no micro-batch needs any more; the update then makes
 * version updates + 1. */
void versions_keep_newest(Versions *v);
/* The copies, unit by unit and oldest slot first: up to max pieces; returns the count. */
int versions_pieces(const Versions *v, void **piece, size_t *bytes, int max);
int versions_count(const Versions *v);
/* The largest number of versions a unit of this rank holds, the newest counted. */
int versions_held(const Versions *v);
void versions_free(Versions *v);
#endif
