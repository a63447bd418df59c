#include "layer_graphs.h"
#include <stdlib.h>
#include <string.h>
#include "ops.h"
#include "util.h"

/* A pipeline stage keeps a few activation slots per layer and FSDP a few gathered weight
 * buffers, so a run needs (layers) x (forward, backward, recompute) x (slots) recordings:
 * hundreds at most. Past the cap, calls run one op at a time. */
#define LG_MAX 4096
#define LG_KEY 384 /* bytes: layer.c's keys are 280 on 64-bit */

typedef struct {
    unsigned char key[LG_KEY];
    size_t n;
    unsigned long hash;
    OpsGraph *gr;
    int fails;  /* recordings that did not run: from the second, none is tried */
} LgEntry;

struct LayerGraphs {
    LgEntry *e;
    int n, cap;
    long replayed, recorded, eager;
};

LayerGraphs *layer_graphs_new(void) { return xcalloc(1, sizeof(LayerGraphs)); }

void layer_graphs_free(LayerGraphs *lg) {
    if (!lg) return;
    for (int i = 0; i < lg->n; i++) op_graph_free(lg->e[i].gr);
    free(lg->e);
    free(lg);
}

void layer_graphs_counts(const LayerGraphs *lg, long *replayed, long *recorded, long *eager) {
    *replayed = lg ? lg->replayed : 0;
    *recorded = lg ? lg->recorded : 0;
    *eager = lg ? lg->eager : 0;
}

static unsigned long fnv(const void *p, size_t n) {
    const unsigned char *b = p;
    unsigned long h = 1469598103934665603UL;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211UL;
    return h;
}

/* fn run as a new recording into e (made or replaced); 0 when it ran so */
static int record(LayerGraphs *lg, LgEntry *e, void (*fn)(void *), void *ctx) {
    op_graph_free(e->gr);
    e->gr = NULL;
    if (e->fails >= 2 || op_graph_begin()) return -1;
    fn(ctx);
    e->gr = op_graph_end();
    if (!e->gr || op_graph_run(e->gr)) {
        e->fails++;
        return -1;
    }
    lg->recorded++;
    return 0;
}

/* key's entry: the one made before, else a new one (NULL where the key is too long or the
 * cache is full) */
static LgEntry *entry(LayerGraphs *lg, const void *key, size_t n) {
    if (n > LG_KEY) return NULL;
    unsigned long h = fnv(key, n);
    for (int i = 0; i < lg->n; i++) {
        LgEntry *e = &lg->e[i];
        if (e->hash == h && e->n == n && !memcmp(e->key, key, n)) return e;
    }
    if (lg->n == LG_MAX) return NULL;
    if (lg->n == lg->cap) {
        lg->cap = lg->cap ? 2 * lg->cap : 64;
        lg->e = xrealloc(lg->e, (size_t)lg->cap * sizeof *lg->e);
    }
    LgEntry *e = &lg->e[lg->n++];
    memset(e, 0, sizeof *e);
    memcpy(e->key, key, n);
    e->n = n;
    e->hash = h;
    return e;
}

void layer_graphs_run(LayerGraphs *lg, const void *key, size_t n, void (*fn)(void *), void *ctx) {
    if (!lg) {
        fn(ctx);
        return;
    }
    LgEntry *e = entry(lg, key, n);
    if (e && e->gr && !op_graph_run(e->gr)) {
        lg->replayed++;
        return;
    }
    if (e && !record(lg, e, fn, ctx)) return;  /* new, or stale: recorded (again) */
    lg->eager++;
    fn(ctx);
}
