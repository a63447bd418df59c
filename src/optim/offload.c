/* The host placement of an Optimizer (offload=optimizer|params): what the rank updates
 * (everything under DDP, its shard of every unit under ZeRO and FSDP) has its fp32 master
 * copy, its optimizer state and a copy of its gradient in host memory (pinned on a GPU), and
 * the update runs on the CPU cores with the cpu backend's kernels, beside the device's work.
 *
 * A step, unit by unit:
 * - the gradient goes out to the host on the ops' "out" copy queue as soon as its strategy
 *   says it is complete (optim_grad_final, polled at the unit boundaries of the backward:
 *   the copy overlaps the rest of the backward), or at the update for those still in flight;
 * - the strategy computes the global norm on the device before any update starts (clipping
 *   needs it: the update is not deferred, it starts once the norm is known);
 * - an elementwise optimizer's update (AdamW) runs in a worker thread, unit by unit in the
 *   order the strategy hands them over (the next forward's: the embedding first), and copies
 *   each one's parameters back to the device on the "in" queue;
 * - the next forward's gather hook of a unit waits for that unit alone (optim_ready): the
 *   update of the later units overlaps the forward of the first.
 * An optimizer with statistics (Adafactor) needs whole tensors' statistics, with
 * collectives between its passes: it runs on the calling thread, at the step, on the host
 * buffers, once every gradient is in (optim_host_grads_in).
 * On the cpu backend the copies are plain copies and the same code runs, worker included.
 *
 * offload=params: the master copy is the parameters themselves (FSDP's shards: its gathers
 * read them from here, and nothing is copied back).
 *
 * Lean (OptimSetup.lean: DDP with AdamW) keeps the host and the device small enough for a
 * 7B model on one GPU: the master copy is the only fp32 copy of the parameters (no device
 * fp32 parameters under precision=mixed, only the bf16 copy the ops read), and the host's
 * gradient copy is in the compute type. With precision=mixed a unit's final fp32 gradient is
 * rounded to bf16 into one of two device staging buffers and copied out from there (half
 * the PCIe bytes and host memory); the worker's AdamW (adamw_host16) reads the bf16
 * gradient, updates the fp32 master and moments, and writes the parameters' bf16 copy over
 * that gradient, which the "in" queue then copies into the device's compute copy. The
 * host's bf16 buffer is free for it: the next copy out into it follows the next forward's
 * gather of the unit, which waits for the copy in. With fp32 the gradient goes out as it is
 * and the master comes back as it is (bitwise the run without offload). */
#include <omp.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include "env.h"
#include "optim_impl.h"
#include "util.h"

struct OptimHost {
    int n_units, threads;
    size_t n;                   /* host elements per buffer: what this rank updates */
    float *master;              /* the fp32 master copy */
    void *grad;                 /* the gradient's copy (fp32; lean: the compute type, act bytes) */
    size_t act;                 /* bytes of one element of grad (and, lean, of the device's dparam) */
    /* lean with a bf16 gradient copy: two device buffers of the largest unit in the compute
     * type, which gradients are rounded into on their way out (stage_unit: the unit whose
     * copy out last read each, -1 none) */
    void *stage[2];
    int stage_unit[2], stage_next;
    double update_s, wait_s;    /* the worker's time in updates, the main thread's waiting for them (totals) */
    void **dparam;              /* per unit: where its updated parameters go on the device (OptimUnit.param) */
    const void **dgrad;         /* ... its gradient on the device */
    unsigned char *out;         /* per unit: its gradient went out this step */
    int *state;                 /* per unit: IDLE, QUEUED (for the worker), UPLOADED */
    /* the worker: a queue of units and the step they are updated with (a copy) */
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    int *queue, queued, next, quit, started;
    OptimStep args;
    OptimConfig oc;
    int step_queued;            /* this step's first units went to the worker */
    int grads_in;               /* this step's gradients are all in the host's copy */
};

enum { IDLE, QUEUED, UPLOADED };

/* ---- the host's kernels: the cpu backend's, with the op_* wrappers' guards ---- */

static void host_adamw(void *param, const void *grad, void *m, void *v, size_t n, float lr, float beta1, float beta2,
                       float eps, float weight_decay, int step, float grad_scale) {
    ops_backend_cpu.adamw(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, step, grad_scale);
}
static void host_adamw16(float *param, uint16_t *g16, float *m, float *v, size_t n, float lr, float beta1, float beta2,
                         float eps, float weight_decay, int step, float grad_scale) {
    ops_backend_cpu.adamw_host16(param, g16, m, v, n, lr, beta1, beta2, eps, weight_decay, step, grad_scale);
}
static void host_af_sums(float *sums, const void *grad, const AdafactorSeg *s, float grad_scale) {
    if (s->n) ops_backend_cpu.adafactor_sums(sums, grad, s, grad_scale);
}
static void host_af_stats(float *stat, float *fac, const float *sums, int rows, int cols, float beta2t, float eps1) {
    ops_backend_cpu.adafactor_stats(stat, fac, sums, rows, cols, beta2t, eps1);
}
static void host_af_rms(double *out, const void *param, const void *grad, const float *fac, const AdafactorSeg *s,
                        float grad_scale) {
    if (!s->n) out[0] = out[1] = 0;
    else ops_backend_cpu.adafactor_rms(out, param, grad, fac, s, grad_scale);
}
static void host_af_update(void *param, const void *grad, void *m, const float *fac, const AdafactorSeg *s,
                           float grad_scale, float coef, float decay, float beta1) {
    if (s->n) ops_backend_cpu.adafactor_update(param, grad, m, fac, s, grad_scale, coef, decay, beta1);
}
static void host_zero(void *p, size_t bytes) {
    if (bytes) memset(p, 0, bytes);
}

const OptimKernels optim_host_kernels = {
    .adamw = host_adamw,
    .adamw16 = host_adamw16,
    .af_sums = host_af_sums,
    .af_stats = host_af_stats,
    .af_rms = host_af_rms,
    .af_update = host_af_update,
    .zero = host_zero,
    .alloc = optim_host_alloc,
    .free = op_host_free,
};

void *optim_host_alloc(size_t bytes, const char *what) {
    if (!bytes) return NULL;
    /* MESHTRAIN_FAULT_HOST_ALLOC (a test hook): the allocation is refused, as a pinned one
     * can be where the driver will not lock that much */
    void *q = hook_on(HOOK_FAULT_HOST_ALLOC) ? NULL : op_host_alloc(bytes);
    char b[32];
    if (!q)
        die(EXIT_BAD_INPUT, "offload: cannot allocate %s of %s in %shost memory (%s); lower the model size, or shard "
            "it over more ranks", fmt_bytes(b, (double)bytes), what, ops_host_memory() ? "" : "pinned ",
            ops_host_memory() ? "out of memory" : "cudaHostAlloc refused it");
    return q;
}

/* ---- the worker ---- */

/* One unit: its gradient has landed (the out mark), the update over the host buffers, and
 * the parameters back to the device (the in mark). */
static void update_unit(Optimizer *o, int u) {
    OptimHost *h = o->host;
    size_t at = o->at[u], n = o->len[u];
    op_copy_sync(u, 0);
    OptimRange r = {u, u + 1, h->master + at, (char *)h->grad + at * h->act, optim_at(o->mom[0], at),
                    optim_at(o->mom[1], at), at, n, NULL, h->act == 2};
    o->impl->update(o, &r, &h->args);
    if (h->act == 2) {  /* lean, bf16: the parameters' bf16 copy replaces the gradient, and goes in from there */
        if (n) op_copy_in(h->dparam[u], (uint16_t *)h->grad + at, n * 2, u);
        return;
    }
    if (!o->params_host && n) op_copy_in(h->dparam[u], h->master + at, n * sizeof(float), u);
}

static void *worker(void *arg) {
    Optimizer *o = arg;
    OptimHost *h = o->host;
    omp_set_num_threads(h->threads);  /* a new thread starts from OpenMP's default, not the run's */
    pthread_mutex_lock(&h->mu);
    for (;;) {
        while (!h->quit && h->next == h->queued) pthread_cond_wait(&h->work, &h->mu);
        if (h->next == h->queued) break;  /* quit, nothing left */
        int u = h->queue[h->next];
        pthread_mutex_unlock(&h->mu);
        double t0 = now_seconds();
        update_unit(o, u);
        double dt = now_seconds() - t0;
        pthread_mutex_lock(&h->mu);
        h->update_s += dt;
        h->next++;
        h->state[u] = UPLOADED;
        pthread_cond_broadcast(&h->done);
    }
    pthread_mutex_unlock(&h->mu);
    return NULL;
}

/* ---- set-up ---- */

void optim_host_setup(Optimizer *o) {
    const Model *m = o->m;
    int U = m->n_units;
    OptimHost *h = o->host = xcalloc(1, sizeof *h);
    h->n_units = U;
    h->act = o->lean ? ops_act_size() : sizeof(float);
    h->dparam = xcalloc((size_t)U, sizeof *h->dparam);
    h->dgrad = xcalloc((size_t)U, sizeof *h->dgrad);
    h->out = xcalloc((size_t)U, 1);
    h->state = xcalloc((size_t)U, sizeof *h->state);
    h->queue = xcalloc((size_t)U, sizeof *h->queue);
    size_t largest = 0;
    for (int u = 0; u < U; u++) {
        h->dparam[u] = o->units[u].param;
        h->dgrad[u] = o->units[u].grad;
        if (o->at[u] + o->len[u] > h->n) h->n = o->at[u] + o->len[u];
        if (m->units[u].n_padded > largest) largest = m->units[u].n_padded;
    }
    h->master = optim_host_alloc(h->n * sizeof(float), "fp32 master weights");
    h->grad = optim_host_alloc(h->n * h->act, h->act == 2 ? "the gradients' bf16 copy" : "the gradients' copy");
    /* test hook (=1): the staging buffers in fp32 too, so that the cpu's tests run their code */
    if (o->lean && (h->act != sizeof(float) || hook_on(HOOK_OFFLOAD_STAGING)))
        for (int i = 0; i < 2; i++) h->stage[i] = op_alloc(largest * h->act), h->stage_unit[i] = -1;
    op_copy_reserve(U);
    /* the cpu backend's thread count (threads=); beside a GPU every core but the one that
     * drives the device */
    h->threads = ops_host_memory() ? omp_get_max_threads() : omp_get_num_procs() > 1 ? omp_get_num_procs() - 1 : 1;
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->work, NULL);
    pthread_cond_init(&h->done, NULL);
    if (o->impl->elementwise) {  /* the others' update runs on the calling thread */
        if (pthread_create(&h->thread, NULL, worker, o))
            die(EXIT_RUN_FAILURE, "offload: cannot start the update thread");
        h->started = 1;
    }
}

void optim_host_free(Optimizer *o) {
    OptimHost *h = o->host;
    optim_finish(o);
    if (h->started) {
        pthread_mutex_lock(&h->mu);
        h->quit = 1;
        pthread_cond_broadcast(&h->work);
        pthread_mutex_unlock(&h->mu);
        pthread_join(h->thread, NULL);
    }
    ops_synchronize();  /* no copy in flight from or into the host buffers */
    pthread_mutex_destroy(&h->mu);
    pthread_cond_destroy(&h->work);
    pthread_cond_destroy(&h->done);
    op_host_free(h->master);
    op_host_free(h->grad);
    op_free(h->stage[0]);
    op_free(h->stage[1]);
    free(h->dparam); free(h->dgrad); free(h->out); free(h->state); free(h->queue);
    free(h);
    o->host = NULL;
}

void optim_host_params_written(Optimizer *o) {
    OptimHost *h = o->host;
    if (o->params_host) return;  /* offload=params: the master copy is the parameters */
    optim_finish(o);
    ops_synchronize();  /* no copy in flight into or out of the host's buffers */
    for (int u = 0; u < h->n_units; u++) {
        size_t at = o->at[u], n = o->len[u];
        if (!o->lean) op_download(h->master + at, h->dparam[u], n * sizeof(float));
        else if (h->act == sizeof(float)) op_upload(h->dparam[u], h->master + at, n * sizeof(float));
        else {  /* rounded to bf16 in the gradients' host copy (free until the next backward), then up */
            uint16_t *g16 = (uint16_t *)h->grad + at;
            const float *src = h->master + at;
#pragma omp parallel for schedule(static)
            for (size_t i = 0; i < n; i++) g16[i] = bf16_round(src[i]);
            op_upload(h->dparam[u], g16, n * 2);
        }
    }
}

/* ---- a step ---- */

void optim_host_begin(Optimizer *o) {
    o->host->step_queued = 0;
    o->host->grads_in = 0;
}

void optim_host_new_grads(Optimizer *o) {
    OptimHost *h = o->host;
    /* the device's gradients are cleared or overwritten from here on: their copies out of
     * the last step come first */
    for (int u = 0; u < h->n_units; u++) {
        if (h->out[u]) op_copy_wait(u, 0);
        h->out[u] = 0;
    }
}

static void grad_out(Optimizer *o, int u) {
    OptimHost *h = o->host;
    if (h->out[u]) return;
    size_t n = o->len[u];
    void *dst = (char *)h->grad + o->at[u] * h->act;
    if (!h->stage[0]) op_copy_out(dst, h->dgrad[u], n * h->act, u);
    else if (n) {
        /* the main queue rounds it into a staging buffer once that buffer's last copy out is
         * done, and the out queue copies it from there */
        int s = h->stage_next;
        h->stage_next ^= 1;
        if (h->stage_unit[s] >= 0) op_copy_wait(h->stage_unit[s], 0);
        op_to_act(h->stage[s], h->dgrad[u], n);
        op_copy_out(dst, h->stage[s], n * h->act, u);
        h->stage_unit[s] = u;
    }
    h->out[u] = 1;
}

void optim_host_grad_final(Optimizer *o, int u) { grad_out(o, u); }
int optim_host_grad_wanted(const Optimizer *o, int u) { return !o->host->out[u]; }

void optim_host_grad_changed(Optimizer *o, int u) {
    o->host->out[u] = 0;
    grad_out(o, u);
}

void optim_host_grads_in(Optimizer *o) {
    OptimHost *h = o->host;
    if (h->grads_in) return;
    h->grads_in = 1;
    optim_finish(o);
    for (int u = 0; u < h->n_units; u++) grad_out(o, u);
    for (int u = 0; u < h->n_units; u++) op_copy_sync(u, 0);
}

void optim_host_update(Optimizer *o, int u0, int u1) {
    OptimHost *h = o->host;
    if (o->impl->elementwise) {  /* on the worker, unit by unit */
        if (!h->step_queued) {
            h->step_queued = 1;
            optim_finish(o);  /* the last step's updates are all in (they are, after a forward) */
            pthread_mutex_lock(&h->mu);
            h->oc = *o->cur.oc;
            h->args = o->cur;
            h->args.oc = &h->oc;
            h->queued = h->next = 0;
            pthread_mutex_unlock(&h->mu);
        }
        for (int u = u0; u < u1; u++) {
            grad_out(o, u);  /* before the worker may wait for its mark */
            pthread_mutex_lock(&h->mu);
            h->state[u] = QUEUED;
            h->queue[h->queued++] = u;
            pthread_cond_signal(&h->work);
            pthread_mutex_unlock(&h->mu);
        }
        return;
    }
    /* here, then every unit's parameters back to the device (waited for at optim_ready) */
    optim_host_grads_in(o);
    if (u0 >= u1) return;
    OptimRange r = {u0, u1, h->master + o->at[u0], (float *)h->grad + o->at[u0], optim_at(o->mom[0], o->at[u0]),
                    optim_at(o->mom[1], o->at[u0]), o->at[u0], 0, NULL, 0};
    for (int u = u0; u < u1; u++) r.n += o->len[u];
    o->impl->update(o, &r, &o->cur);
    for (int u = u0; u < u1; u++) {
        if (!o->params_host) op_copy_in(h->dparam[u], h->master + o->at[u], o->len[u] * sizeof(float), u);
        pthread_mutex_lock(&h->mu);
        h->state[u] = UPLOADED;
        pthread_mutex_unlock(&h->mu);
    }
}

int optim_host_ready(Optimizer *o, int u, int wait) {
    OptimHost *h = o->host;
    pthread_mutex_lock(&h->mu);
    double t0 = h->state[u] == QUEUED && wait ? now_seconds() : 0;
    while (h->state[u] == QUEUED) {
        if (!wait) {
            pthread_mutex_unlock(&h->mu);
            return 0;
        }
        pthread_cond_wait(&h->done, &h->mu);
    }
    if (t0 > 0) h->wait_s += now_seconds() - t0;
    int up = h->state[u] == UPLOADED;
    h->state[u] = IDLE;
    pthread_mutex_unlock(&h->mu);
    if (up) op_copy_wait(u, 1);
    return 1;
}

float *optim_host_master(const Optimizer *o) { return o->host->master; }

float *optim_host_grad(const Optimizer *o) {
    if (o->host->act != sizeof(float)) die(EXIT_RUN_FAILURE, "internal: the gradients' host copy is not fp32");
    return o->host->grad;
}

void optim_host_times(Optimizer *o, double *update_s, double *wait_s) {
    OptimHost *h = o->host;
    *update_s = *wait_s = 0;
    if (!h) return;
    pthread_mutex_lock(&h->mu);
    *update_s = h->update_s;
    *wait_s = h->wait_s;
    pthread_mutex_unlock(&h->mu);
}
