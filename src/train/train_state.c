#include "train_state.h"
#include <stdlib.h>
#include "ops.h"
#include "util.h"

/* The strategy's ranges in the checkpoint's packed order. Their pointers are the strategy's
 * (state type); on the cpu that is fp32 host memory, which the checkpoint reads directly,
 * and on a device they are staged (below) before the checkpoint sees them. */
static int ckpt_ranges(const Parallel *par, const Model *m, int write, StateRange *out, int max) {
    OwnedRange *o = xmalloc((size_t)max * sizeof *o);
    int n = parallel_ranges(par, write, o, max), k = 0;
    /* packed order is the whole model's, whichever units this rank holds (a pipeline stage) */
    for (int i = 0; i < n; i++)
        if (o[i].hi > o[i].lo)
            out[k++] = (StateRange){m->packed[o[i].unit] + o[i].lo, o[i].hi - o[i].lo, o[i].params, o[i].m, o[i].v};
    free(o);
    return k;
}

/* Checkpoints read and write host memory. On a device backend the ranges are staged
 * through one host buffer: downloaded before a save, uploaded after a load. On the cpu the
 * ranges are used as they are (no copy, no extra memory). */
typedef struct { StateRange *host; float *buf; } Staging;

static const StateRange *stage(const StateRange *r, int n, Staging *s) {
    s->host = NULL;
    s->buf = NULL;
    if (ops_host_memory()) return r;
    size_t total = 0;
    for (int i = 0; i < n; i++) total += r[i].count * (1 + (r[i].m != NULL) + (r[i].v != NULL));
    s->host = xmalloc((size_t)(n ? n : 1) * sizeof *s->host);
    s->buf = xmalloc((total ? total : 1) * sizeof(float));
    float *p = s->buf;
    for (int i = 0; i < n; i++) {
        float **dev[3] = {&s->host[i].params, &s->host[i].m, &s->host[i].v};
        s->host[i] = r[i];
        for (int k = 0; k < 3; k++)
            if (*dev[k]) { *dev[k] = p; p += r[i].count; }
    }
    return s->host;
}

/* dir > 0: device -> host (before a save); dir < 0: host -> device (after a load). */
static void stage_copy(const StateRange *r, int n, const Staging *s, int dir) {
    if (!s->host) return;
    ops_synchronize();  /* DDP may still be updating units on the ops' side queue */
    for (int i = 0; i < n; i++) {
        void *dev[3] = {r[i].params, r[i].m, r[i].v};
        float *host[3] = {s->host[i].params, s->host[i].m, s->host[i].v};
        for (int k = 0; k < 3; k++) {
            if (!dev[k]) continue;
            if (dir > 0) op_download_state(host[k], dev[k], r[i].count);  /* widened from bf16 */
            else op_upload_state(dev[k], host[k], r[i].count);            /* rounded to bf16 */
        }
    }
}

static void stage_free(Staging *s) {
    free(s->host);
    free(s->buf);
}

/* At most: one range per unit and write side, and the head's and embedding's extras. */
static int max_ranges(const Model *m) { return 2 * m->n_units + 2; }

int train_state_save(const char *path, const CkptHeader *h, const Comm *world, const Parallel *par, const Model *m,
                     int skip_embedding, char *err, size_t errlen) {
    int max = max_ranges(m);
    StateRange *ranges = xmalloc((size_t)max * sizeof *ranges);
    int n = ckpt_ranges(par, m, 1, ranges, max);
    if (skip_embedding) {  /* the embedding's packed range is [0, V E): another stage saves it */
        int k = 0;
        for (int i = 0; i < n; i++)
            if (ranges[i].start >= m->packed[UNIT_EMBEDDING + 1]) ranges[k++] = ranges[i];
        n = k;
    }
    Staging st;
    const StateRange *mine = stage(ranges, n, &st);
    stage_copy(ranges, n, &st, 1);
    int rc = ckpt_save_dist(path, h, world, mine, n, err, errlen);
    stage_free(&st);
    free(ranges);
    return rc;
}

int train_state_load(const char *path, CkptHeader *h, const Parallel *par, const Model *m, char *err, size_t errlen) {
    int max = max_ranges(m);
    StateRange *ranges = xmalloc((size_t)max * sizeof *ranges);
    int n = ckpt_ranges(par, m, 0, ranges, max);
    Staging st;
    const StateRange *need = stage(ranges, n, &st);
    int rc = ckpt_load_dist(path, h, need, n, 1, err, errlen);
    if (!rc) stage_copy(ranges, n, &st, -1);
    stage_free(&st);
    free(ranges);
    return rc;
}
