#include "train_state.h"
#include <stdlib.h>
#include "adafactor.h"
#include "ops.h"
#include "util.h"

/* The strategy's ranges in the checkpoint's packed order. Their pointers are the strategy's
 * (state type); on the cpu that is fp32 host memory, which the checkpoint reads directly,
 * and on a device they are staged (below) before the checkpoint sees them. */
static int ckpt_ranges(const Parallel *par, const Model *m, int write, StateRange *out, int max) {
    OwnedRange *o = xmalloc((size_t)max * sizeof *o);
    int n = parallel_ranges(par, write, o, max), k = 0;
    int nr = model_tp_max_runs(m);
    TpRun *runs = xmalloc((size_t)nr * sizeof *runs);
    /* packed order is the whole model's, whichever units this rank holds (a pipeline stage);
     * a tensor-parallel rank's slices are strided pieces of it (model_tp_runs), an
     * expert-parallel rank's experts one piece, and what every rank of the tp (or ep) group
     * holds alike is saved by its rank 0 alone */
    for (int i = 0; i < n; i++) {
        if (o[i].hi <= o[i].lo) continue;
        int nu = model_tp_runs(m, o[i].unit, runs, nr);
        for (int j = 0; j < nu; j++) {
            const TpRun *r = &runs[j];
            size_t a = o[i].lo > r->local ? o[i].lo : r->local, b = o[i].hi < r->local + r->n ? o[i].hi : r->local + r->n;
            if (a >= b || (write && (((r->replicated & TP_REPL_TP) && m->tp_rank != 0) ||
                                     ((r->replicated & TP_REPL_EP) && m->ep_rank != 0))))
                continue;
            if (k >= max) die(EXIT_RUN_FAILURE, "internal: more than %d checkpoint ranges", max);
            size_t d = a - o[i].lo;
            out[k++] = (StateRange){m->packed[o[i].unit] + r->global + (a - r->local), b - a,
                                    o[i].params ? st_at(o[i].params, d) : NULL, o[i].m ? st_at(o[i].m, d) : NULL,
                                    o[i].v ? st_at(o[i].v, d) : NULL};
        }
    }
    free(runs);
    free(o);
    return k;
}

/* Checkpoints read and write host memory. On a device backend the ranges are staged
 * through one host buffer: downloaded before a save, uploaded after a load. On the cpu the
 * ranges are used as they are (no copy, no extra memory); so are the moments, and the
 * parameters, where they are host memory already (offload). */
typedef struct { StateRange *host; float *buf; int moments_host, params_host; } Staging;

/* on_host: parallel_state_on_host */
static const StateRange *stage(const StateRange *r, int n, Staging *s, int on_host) {
    int moments_host = on_host > 0, params_host = on_host > 1;
    s->host = NULL;
    s->buf = NULL;
    s->moments_host = moments_host;
    s->params_host = params_host;
    if (ops_host_memory()) return r;
    size_t total = 0;
    for (int i = 0; i < n; i++)
        total += r[i].count * (!params_host + (!moments_host && r[i].m != NULL) + (!moments_host && r[i].v != NULL));
    s->host = xmalloc((size_t)(n ? n : 1) * sizeof *s->host);
    s->buf = xmalloc((total ? total : 1) * sizeof(float));
    float *p = s->buf;
    for (int i = 0; i < n; i++) {
        float **dev[3] = {&s->host[i].params, &s->host[i].m, &s->host[i].v};
        s->host[i] = r[i];
        for (int k = params_host; k < (moments_host ? 1 : 3); k++)
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
        for (int k = s->params_host; k < (s->moments_host ? 1 : 3); k++) {
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
/* ... each split into the runs of a tensor-parallel rank's slices. */
static int max_ranges(const Model *m) { return (2 * m->n_units + 2) * model_tp_max_runs(m); }

/* The ranges train_state_save writes: this rank's, less the tied embedding's copy that
 * another stage saves (its packed range is [0, V E)). */
static int save_ranges(const Parallel *par, const Model *m, int skip_embedding, StateRange *ranges, int max) {
    int n = ckpt_ranges(par, m, 1, ranges, max);
    if (skip_embedding) {
        int k = 0;
        for (int i = 0; i < n; i++)
            if (ranges[i].start >= m->packed[UNIT_EMBEDDING + 1]) ranges[k++] = ranges[i];
        n = k;
    }
    return n;
}

uint64_t train_state_save_bytes(const Parallel *par, const Model *m, int skip_embedding) {
    int max = max_ranges(m);
    StateRange *ranges = xmalloc((size_t)max * sizeof *ranges);
    int n = save_ranges(par, m, skip_embedding, ranges, max);
    uint64_t values = 0;
    for (int i = 0; i < n; i++) values += ranges[i].count;
    free(ranges);
    return ckpt_rank_file_bytes((uint64_t)n, values, 1);  /* a training checkpoint holds the optimizer's state */
}

int train_state_save(const char *path, const CkptHeader *h, const Comm *world, const Parallel *par, const Model *m,
                     int skip_embedding, char *err, size_t errlen) {
    int max = max_ranges(m);
    StateRange *ranges = xmalloc((size_t)max * sizeof *ranges);
    int n = save_ranges(par, m, skip_embedding, ranges, max);
    Staging st;
    const StateRange *mine = stage(ranges, n, &st, parallel_state_on_host(par));
    stage_copy(ranges, n, &st, 1);
    StateRange *af = NULL;
    float *vbuf = NULL, *zeros = NULL;
    Optimizer *opt = parallel_optimizer(par);
    if (optim_kind(opt) == OPTIM_ADAFACTOR) {
        /* m: the first moment, or zeros; v: the statistics at their packed positions */
        const AfPlan *plan = adafactor_plan(opt);
        float *stats = xmalloc((plan->n_stats + 1) * sizeof(float));
        optim_tensor_state(opt, stats, 0);
        size_t total = 0, most = 0;
        for (int i = 0; i < n; i++) {
            total += mine[i].count;
            if (mine[i].count > most) most = mine[i].count;
        }
        af = xmalloc((size_t)(n ? n : 1) * sizeof *af);
        vbuf = xmalloc((total + 1) * sizeof(float));
        zeros = xcalloc(most + 1, sizeof(float));
        for (int i = 0, off = 0; i < n; off += (int)mine[i].count, i++) {
            af[i] = mine[i];
            af[i].v = vbuf + off;
            af_pack(plan, stats, af[i].start, af[i].count, af[i].v);
            if (!af[i].m) af[i].m = zeros;
        }
        free(stats);
        mine = af;
    }
    int rc = ckpt_save_dist(path, h, world, mine, n, err, errlen);
    free(af); free(vbuf); free(zeros);
    stage_free(&st);
    free(ranges);
    return rc;
}

/* Adafactor's statistics: each tensor's from its packed positions (whoever saved them). The
 * ranges need parameter and first-moment buffers too: one scratch buffer takes them all. */
static int load_af_stats(const char *path, CkptHeader *h, const Parallel *par, char *err, size_t errlen) {
    Optimizer *opt = parallel_optimizer(par);
    const AfPlan *plan = adafactor_plan(opt);
    if (!plan->n_tensors) return 0;
    size_t most = 0;
    for (int k = 0; k < plan->n_tensors; k++)
        if (af_tensor_stats(plan->t[k].rows, plan->t[k].cols) > most) most = af_tensor_stats(plan->t[k].rows, plan->t[k].cols);
    float *stats = xcalloc(plan->n_stats + 1, sizeof(float)), *scratch = xmalloc(most * sizeof(float));
    StateRange *r = xmalloc((size_t)plan->n_tensors * sizeof *r);
    for (int k = 0; k < plan->n_tensors; k++) {
        const AfTensor *t = &plan->t[k];
        r[k] = (StateRange){t->packed, af_tensor_stats(t->rows, t->cols), scratch, scratch, stats + t->stat};
    }
    int rc = ckpt_load_dist(path, h, r, plan->n_tensors, 1, err, errlen);
    if (!rc) optim_tensor_state(opt, stats, 1);
    free(r); free(scratch); free(stats);
    return rc;
}

int train_state_load(const char *path, CkptHeader *h, const Parallel *par, const Model *m, char *err, size_t errlen) {
    int max = max_ranges(m);
    StateRange *ranges = xmalloc((size_t)max * sizeof *ranges);
    int n = ckpt_ranges(par, m, 0, ranges, max);
    Staging st;
    StateRange *need = (StateRange *)stage(ranges, n, &st, parallel_state_on_host(par));
    float *scratch = NULL;
    OptimKind kind = optim_kind(parallel_optimizer(par));
    int af = kind == OPTIM_ADAFACTOR;
    if (af) {  /* v's place holds the statistics (load_af_stats): read into scratch, dropped */
        size_t most = 0;
        for (int i = 0; i < n; i++)
            if (need[i].m && need[i].count > most) most = need[i].count;
        scratch = xmalloc((most + 1) * sizeof(float));
        for (int i = 0; i < n; i++)
            if (need[i].m) need[i].v = scratch;
    }
    int rc = ckpt_load_dist(path, h, need, n, 1, err, errlen);
    if (!rc && h->optimizer != (int)kind)
        rc = set_err(err, errlen, "checkpoint %s holds %s state; this run's optimizer is %s", path,
                     optim_kind_name((OptimKind)h->optimizer), optim_kind_name(kind));
    if (!rc && af) rc = load_af_stats(path, h, par, err, errlen);
    free(scratch);
    if (!rc) stage_copy(ranges, n, &st, -1);
    stage_free(&st);
    free(ranges);
    return rc;
}

/* the step's stash, as pieces in host memory: the units' own on the cpu, else copies */
static int stash_host(const Step *st, void ***piece, size_t **bytes, void ***dev) {
    int max = step_stash_count(st);
    *piece = xcalloc((size_t)max + 1, sizeof **piece);
    *dev = xcalloc((size_t)max + 1, sizeof **dev);
    *bytes = xcalloc((size_t)max + 1, sizeof **bytes);
    int n = step_stash_pieces(st, *dev, *bytes, max);
    for (int i = 0; i < n; i++) (*piece)[i] = ops_host_memory() ? (*dev)[i] : xmalloc((*bytes)[i] ? (*bytes)[i] : 1);
    return n;
}

static void stash_host_free(void **piece, size_t *bytes, void **dev, int n) {
    for (int i = 0; i < n && !ops_host_memory(); i++) free(piece[i]);
    free(piece); free(bytes); free(dev);
}

int train_stash_save(const char *path, int step, int rank, int world, const Step *st, char *err, size_t errlen) {
    void **piece, **dev;
    size_t *bytes;
    int n = stash_host(st, &piece, &bytes, &dev), rc = 0;
    if (n) {
        for (int i = 0; i < n && !ops_host_memory(); i++) op_download(piece[i], dev[i], bytes[i]);
        rc = ckpt_write_stash(path, step, rank, world, piece, bytes, n, err, errlen);
    }
    stash_host_free(piece, bytes, dev, n);
    return rc;
}

int train_stash_load(const char *path, const CkptHeader *h, int rank, int world, Step *st, char *err, size_t errlen) {
    void **piece, **dev;
    size_t *bytes;
    int n = stash_host(st, &piece, &bytes, &dev), rc = 0;
    if (n) {
        rc = ckpt_load_stash(path, h, rank, world, piece, bytes, n, err, errlen);
        for (int i = 0; rc == 1 && i < n && !ops_host_memory(); i++) op_upload(dev[i], piece[i], bytes[i]);
    }
    stash_host_free(piece, bytes, dev, n);
    return rc;
}
