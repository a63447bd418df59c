#include "versions.h"
#include <stdlib.h>
#include <string.h>
#include "ops.h"
#include "util.h"

void versions_init(Versions *v, Model *m, const UnitHooks *hooks, const int *delay) {
    memset(v, 0, sizeof *v);
    v->m = m;
    v->hooks = hooks;
    int n = m->n_units;
    v->delay = xcalloc((size_t)n, sizeof(int));
    v->live = xcalloc((size_t)n, sizeof(void *));
    v->bytes = xcalloc((size_t)n, sizeof(size_t));
    for (int u = 0; u < n; u++) {
        v->live[u] = m->ucompute[u];
        /* (a unit this rank does not hold, or whose weights the strategy keeps nowhere whole) */
        if (!m->units[u].n_padded || !unit_weights(m, u)) continue;
        v->delay[u] = delay[u] > 0 ? delay[u] : 0;
        if (v->delay[u] > v->max_delay) v->max_delay = v->delay[u];
        /* ucompute NULL: the ops read the parameters, in the state type */
        v->bytes[u] = m->units[u].n_padded * (m->ucompute[u] ? ops_act_size() : ops_state_size());
    }
    v->copy = xcalloc((size_t)n * (size_t)(v->max_delay ? v->max_delay : 1), sizeof(void *));
    for (int u = 0; u < n; u++)
        for (int k = 0; k < v->delay[u]; k++) {
            void *c = v->copy[u * v->max_delay + k] = op_alloc(v->bytes[u]);
            if (v->hooks->gather) v->hooks->gather(v->hooks->ctx, u, -1);
            op_copy(c, unit_weights(m, u), v->bytes[u]);
        }
}

void versions_use(Versions *v, long long index) {
    for (int u = 0; u < v->m->n_units; u++) {
        int d = v->delay[u];
        if (!d) continue;
        long long k = index - d < 0 ? 0 : index - d;
        if (k > v->updates || k < v->updates - d)
            die(EXIT_RUN_FAILURE, "internal: micro-batch %lld wants version %lld of unit %d, which holds %lld to %lld",
                index, k, u, v->updates - d, v->updates);
        v->m->ucompute[u] = k == v->updates ? v->live[u] : v->copy[u * v->max_delay + (int)(k % d)];
    }
}

void versions_use_newest(Versions *v) {
    for (int u = 0; u < v->m->n_units; u++)
        if (v->delay[u]) v->m->ucompute[u] = v->live[u];
}

void versions_keep_newest(Versions *v) {
    Model *m = v->m;
    versions_use_newest(v);
    for (int u = 0; u < m->n_units; u++) {
        int d = v->delay[u];
        if (!d) continue;
        if (v->hooks->gather) v->hooks->gather(v->hooks->ctx, u, -1);  /* the last update is in, its compute copy made */
        op_copy(v->copy[u * v->max_delay + (int)(v->updates % d)], unit_weights(m, u), v->bytes[u]);
    }
    v->updates++;
}

int versions_count(const Versions *v) {
    int n = 0;
    for (int u = 0; v->delay && u < v->m->n_units; u++) n += v->delay[u];
    return n;
}

int versions_held(const Versions *v) { return v->max_delay + 1; }

int versions_pieces(const Versions *v, void **piece, size_t *bytes, int max) {
    int n = 0;
    for (int u = 0; v->delay && u < v->m->n_units; u++)
        for (int k = 0; k < v->delay[u] && n < max; k++) piece[n] = v->copy[u * v->max_delay + k], bytes[n++] = v->bytes[u];
    return n;
}

void versions_free(Versions *v) {
    if (!v->delay) return;
    versions_use_newest(v);
    for (int u = 0; u < v->m->n_units; u++)
        for (int k = 0; k < v->delay[u]; k++) op_free(v->copy[u * v->max_delay + k]);
    free(v->copy); free(v->delay); free(v->live); free(v->bytes);
    memset(v, 0, sizeof *v);
}
