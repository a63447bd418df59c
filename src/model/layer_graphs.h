/* layer_graphs — a layer's forward or backward recorded once as a graph of ops (op_graph_*)
 * and replayed at every later call with the same key, so that its dozen or more kernels go to
 * the device in one launch: at small micro-batches (a pipeline's, accumulation's) the
 * launches, not the kernels, set the pace (bench/results/layer-graphs-h200-2026-11.md). The key must hold
 * everything the recorded ops depend on: every buffer and weight pointer, every shape and
 * flag; the values behind the pointers may change freely (a replay reads them anew). */
#ifndef MESHTRAIN_LAYER_GRAPHS_H
#define MESHTRAIN_LAYER_GRAPHS_H
#include <stddef.h>

typedef struct LayerGraphs LayerGraphs;

LayerGraphs *layer_graphs_new(void);
void layer_graphs_free(LayerGraphs *lg);  /* NULL: nothing */
/* fn(ctx) through the recording for key (n bytes): replayed where one was made, else
 * recorded now and run; where the backend cannot record, the recording failed or went
 * stale, or the cache is full, fn(ctx) runs as it is. lg NULL: fn(ctx). */
void layer_graphs_run(LayerGraphs *lg, const void *key, size_t n, void (*fn)(void *ctx), void *ctx);
/* recordings replayed, made, and calls run one op at a time (for the run's report) */
void layer_graphs_counts(const LayerGraphs *lg, long *replayed, long *recorded, long *eager);

#endif
