/* offload=optimizer: what the rank updates (its shard of every unit under ZeRO and FSDP,
 * everything under DDP) has its fp32 master copy, its optimizer state and a copy of its
 * gradient in host memory (pinned on a GPU), and the update runs on the CPU cores with the
 * cpu backend's kernels, in a worker thread beside the device's work.
 *
 * A step, unit by unit:
 * - the gradient goes out to the host on the ops' "out" copy queue as soon as its
 *   reduction is done (par_offload_poll, from the unit boundaries of the backward: the
 *   copy overlaps the rest of the backward), or at the step for those still in flight;
 * - the global norm is computed on the device before any update starts (clipping needs
 *   it: the update is not deferred, it starts once the norm is known);
 * - the worker updates the units in the order the next forward needs them (the embedding
 *   first) and copies each one's parameters back to the device on the "in" queue;
 * - the next forward's gather hook of a unit waits for that unit alone
 *   (par_offload_ready): the update of the later units overlaps the forward of the first.
 * Adafactor's update needs whole tensors' statistics, with collectives between its
 * passes: it runs on the ops' thread, at the step (par_adafactor, on the host buffers).
 * On the cpu backend the copies are plain copies and the same code runs, worker included.
 *
 * Lean (p->lean: DDP with AdamW) keeps the host and the device small enough for a 7B model
 * on one GPU: the master copy is the only fp32 copy of the parameters (no device fp32
 * parameters under precision=mixed, only the bf16 copy the ops read), and the host's
 * gradient copy is in the compute type. With precision=mixed a unit's final fp32 gradient is
 * rounded to bf16 into one of two device staging buffers and copied out from there (half
 * the PCIe bytes and host memory); the worker's AdamW (adamw_host16) reads the bf16
 * gradient, updates the fp32 master and moments, and writes the parameters' bf16 copy over
 * that gradient, which the "in" queue then copies into the device's compute copy. The
 * host's bf16 buffer is free for it: the next copy out into it follows the next forward's
 * gather of the unit, which waits for the copy in. With fp32 the gradient goes out as it is
 * and the master comes back as it is (bitwise the run without offload, as before). */
#include <omp.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include "ops.h"
#include "env.h"
#include "parallel_impl.h"
#include "util.h"

struct Offload {
    int n_units, threads;
    int params_host;            /* offload=params: the master copy is the parameter shard itself */
    size_t n;                   /* host elements per buffer: what this rank updates */
    float *master;              /* host: the fp32 master copy */
    void *grad;                 /* host: the gradient's copy (fp32; lean: the compute type, act bytes) */
    size_t act;                 /* bytes of one element of grad (and, lean, of the device's dparam) */
    int lean;
    /* lean with a bf16 gradient copy: two device buffers of the largest unit in the compute
     * type, which gradients are rounded into on their way out (stage_unit: the unit whose
     * copy out last read each, -1 none) */
    void *stage[2];
    int stage_unit[2], stage_next;
    double update_s, wait_s;    /* the worker's time in updates, the main thread's waiting for them (totals) */
    float *m1, *m2;             /* host: AdamW's moments (the Parallel's mom1, mom2) */
    void **dparam;              /* per unit: the device parameters of what the rank updates (lean:
                                 * the compute copy, act bytes an element) */
    const void **dgrad;         /* ... its gradient on the device */
    size_t *hoff, *hn;          /* ... its offset and length in the host buffers */
    CommReq **dreq;             /* per unit: the request that ends its last reduction (or NULL) */
    unsigned char *out;         /* per unit: its gradient went out this step */
    int *state;                 /* per unit: IDLE, QUEUED (for the worker), UPLOADED */
    /* the worker: a queue of units and this step's AdamW arguments */
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    int *queue, queued, next, quit, started;
    float lr, b1, b2, eps, wd, scale;
    int step;
};

enum { IDLE, QUEUED, UPLOADED };

/* One unit: its gradient has landed (the out mark), AdamW over the host buffers, and the
 * parameters back to the device (the in mark). */
static void update_unit(Offload *o, int u) {
    size_t h = o->hoff[u], n = o->hn[u];
    op_copy_sync(u, 0);
    if (o->act == 2) {  /* lean, bf16: the parameters' bf16 copy replaces the gradient, and goes in from there */
        uint16_t *g16 = (uint16_t *)o->grad + h;
        ops_backend_cpu.adamw_host16(o->master + h, g16, o->m1 + h, o->m2 + h, n, o->lr, o->b1, o->b2, o->eps, o->wd,
                                     o->step, o->scale);
        if (n) op_copy_in(o->dparam[u], g16, n * 2, u);
        return;
    }
    ops_backend_cpu.adamw(o->master + h, (float *)o->grad + h, o->m1 + h, o->m2 + h, n, o->lr, o->b1, o->b2, o->eps,
                          o->wd, o->step, o->scale);
    if (!o->params_host && n) op_copy_in(o->dparam[u], o->master + h, n * sizeof(float), u);
}

static void *worker(void *arg) {
    Offload *o = arg;
    omp_set_num_threads(o->threads);  /* a new thread starts from OpenMP's default, not the run's */
    pthread_mutex_lock(&o->mu);
    for (;;) {
        while (!o->quit && o->next == o->queued) pthread_cond_wait(&o->work, &o->mu);
        if (o->next == o->queued) break;  /* quit, nothing left */
        int u = o->queue[o->next];
        pthread_mutex_unlock(&o->mu);
        double t0 = now_seconds();
        update_unit(o, u);
        double dt = now_seconds() - t0;
        pthread_mutex_lock(&o->mu);
        o->update_s += dt;
        o->next++;
        o->state[u] = UPLOADED;
        pthread_cond_broadcast(&o->done);
    }
    pthread_mutex_unlock(&o->mu);
    return NULL;
}

void *par_host_alloc(size_t bytes, const char *what) {
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

void par_offload_setup(Parallel *p) {
    if (ops_state_size() != sizeof(float))
        die(EXIT_RUN_FAILURE, "internal: offload keeps fp32 state, and this run's state is not fp32");
    const Model *m = p->m;
    int U = m->n_units;
    if (p->offload == OFFLOAD_PARAMS && (p->pshard || p->params))
        die(EXIT_RUN_FAILURE, "internal: offload=params with a strategy that keeps parameters on the device");
    Offload *o = p->off = xcalloc(1, sizeof *o);
    o->n_units = U;
    o->lean = p->lean;
    o->act = p->lean ? ops_act_size() : sizeof(float);
    o->dparam = xcalloc((size_t)U, sizeof *o->dparam);
    o->dgrad = xcalloc((size_t)U, sizeof *o->dgrad);
    o->hoff = xcalloc((size_t)U, sizeof *o->hoff);
    o->hn = xcalloc((size_t)U, sizeof *o->hn);
    o->dreq = xcalloc((size_t)U, sizeof *o->dreq);
    o->out = xcalloc((size_t)U, 1);
    o->state = xcalloc((size_t)U, sizeof *o->state);
    o->queue = xcalloc((size_t)U, sizeof *o->queue);
    for (int u = 0; u < U; u++) {
        void *param, *m1;
        const void *grad;
        size_t own;
        par_owned(p, u, &param, &grad, &m1, &own);
        /* lean: the update comes back into what the ops read (the compute copy, or the params in fp32) */
        o->dparam[u] = !p->lean ? param : m->ucompute[u] ? m->ucompute[u] : param;
        o->dgrad[u] = grad;
        o->hoff[u] = own;
        o->hn[u] = p->gshard ? shard_len(p, u) : m->units[u].n_padded;
        if (o->hoff[u] + o->hn[u] > o->n) o->n = o->hoff[u] + o->hn[u];
    }
    o->master = par_host_alloc(o->n * sizeof(float), "fp32 master weights");
    o->params_host = p->offload == OFFLOAD_PARAMS;
    if (o->params_host) p->hshard = o->master;
    if (o->lean) p->hparams = o->master;
    o->grad = par_host_alloc(o->n * o->act, o->act == 2 ? "the gradients' bf16 copy" : "the gradients' copy");
    /* test hook (=1): the staging buffers in fp32 too, so that the cpu's tests run their code */
    if (o->lean && (o->act != sizeof(float) || hook_on(HOOK_OFFLOAD_STAGING))) {
        size_t caps[N_SLOTS];
        par_slot_caps(m, 0, caps);  /* caps[0]: the largest unit */
        for (int i = 0; i < 2; i++) o->stage[i] = op_alloc(caps[0] * o->act), o->stage_unit[i] = -1;
    }
    o->m1 = p->mom1;
    o->m2 = p->mom2;
    op_copy_reserve(U);
    /* the cpu backend's thread count (threads=); beside a GPU every core but the one that
     * drives the device */
    o->threads = ops_host_memory() ? omp_get_max_threads() : omp_get_num_procs() > 1 ? omp_get_num_procs() - 1 : 1;
    pthread_mutex_init(&o->mu, NULL);
    pthread_cond_init(&o->work, NULL);
    pthread_cond_init(&o->done, NULL);
    if (p->optim != OPTIM_ADAFACTOR) {  /* Adafactor's update runs on the ops' thread */
        if (pthread_create(&o->thread, NULL, worker, o)) die(EXIT_RUN_FAILURE, "offload: cannot start the update thread");
        o->started = 1;
    }
}

void par_offload_free(Parallel *p) {
    Offload *o = p->off;
    if (!o) return;
    par_offload_finish(p);
    if (o->started) {
        pthread_mutex_lock(&o->mu);
        o->quit = 1;
        pthread_cond_broadcast(&o->work);
        pthread_mutex_unlock(&o->mu);
        pthread_join(o->thread, NULL);
    }
    ops_synchronize();  /* no copy in flight from or into the host buffers */
    pthread_mutex_destroy(&o->mu);
    pthread_cond_destroy(&o->work);
    pthread_cond_destroy(&o->done);
    op_host_free(o->master);
    op_host_free(o->grad);
    op_free(o->stage[0]);
    op_free(o->stage[1]);
    free(o->dparam); free(o->dgrad); free(o->hoff); free(o->hn); free(o->dreq); free(o->out); free(o->state);
    free(o->queue);
    free(o);
    p->off = NULL;
}

void par_offload_params_written(Parallel *p) {
    Offload *o = p->off;
    if (!o || o->params_host) return;  /* offload=params: the master copy is the parameters */
    par_offload_finish(p);
    ops_synchronize();  /* no copy in flight into or out of the host's buffers */
    for (int u = 0; u < o->n_units; u++) {
        size_t h = o->hoff[u], n = o->hn[u];
        if (!o->lean) op_download(o->master + h, o->dparam[u], n * sizeof(float));
        else if (o->act == sizeof(float)) op_upload(o->dparam[u], o->master + h, n * sizeof(float));
        else {  /* rounded to bf16 in the gradients' host copy (free until the next backward), then up */
            uint16_t *g16 = (uint16_t *)o->grad + h;
            const float *src = o->master + h;
#pragma omp parallel for schedule(static)
            for (size_t i = 0; i < n; i++) g16[i] = bf16_round(src[i]);
            op_upload(o->dparam[u], g16, n * 2);
        }
    }
}

int par_offload_lean(const Parallel *p) {
    return p->offload == OFFLOAD_OPTIMIZER && p->optim == OPTIM_ADAMW && p->s->lean_offload;
}

void par_offload_begin_step(Parallel *p) {
    Offload *o = p->off;
    if (!o) return;
    /* the device's gradients are cleared or overwritten from here on: their copies out of
     * the last step come first */
    for (int u = 0; u < o->n_units; u++) {
        if (o->out[u]) op_copy_wait(u, 0);
        o->out[u] = 0;
        o->dreq[u] = NULL;
    }
}

void par_offload_grad_request(Parallel *p, int u, CommReq *r) {
    if (p->off) p->off->dreq[u] = r;
}

static void grad_out(Offload *o, int u) {
    if (o->out[u]) return;
    size_t n = o->hn[u];
    void *dst = (char *)o->grad + o->hoff[u] * o->act;
    if (!o->stage[0]) op_copy_out(dst, o->dgrad[u], n * o->act, u);
    else if (n) {
        /* the main queue rounds it into a staging buffer once that buffer's last copy out is
         * done, and the out queue copies it from there */
        int s = o->stage_next;
        o->stage_next ^= 1;
        if (o->stage_unit[s] >= 0) op_copy_wait(o->stage_unit[s], 0);
        op_to_act(o->stage[s], o->dgrad[u], n);
        op_copy_out(dst, o->stage[s], n * o->act, u);
        o->stage_unit[s] = u;
    }
    o->out[u] = 1;
}

void par_offload_grad_changed(Parallel *p, int u) {
    Offload *o = p->off;
    if (!o) return;
    o->out[u] = 0;
    grad_out(o, u);
}

void par_offload_poll(Parallel *p) {
    Offload *o = p->off;
    if (!o) return;
    for (int u = 0; u < o->n_units; u++)
        if (o->dreq[u] && !o->out[u] && comm_test(o->dreq[u])) grad_out(o, u);
}

void par_offload_adamw(Parallel *p, const OptimConfig *oc, double lr, int step, float scale) {
    Offload *o = p->off;
    par_offload_finish(p);  /* the last step's updates are all in (they are, after a forward) */
    pthread_mutex_lock(&o->mu);
    o->lr = (float)lr, o->b1 = (float)oc->beta1, o->b2 = (float)oc->beta2, o->eps = (float)oc->eps;
    o->wd = (float)oc->weight_decay, o->step = step, o->scale = scale;
    o->queued = o->next = 0;
    pthread_mutex_unlock(&o->mu);
    /* the next forward needs the embedding first: the units go in that order */
    for (int u = 0; u < o->n_units; u++) {
        grad_out(o, u);  /* before the worker may wait for its mark */
        pthread_mutex_lock(&o->mu);
        o->state[u] = QUEUED;
        o->queue[o->queued++] = u;
        pthread_cond_signal(&o->work);
        pthread_mutex_unlock(&o->mu);
    }
}

void par_offload_grads_in(Parallel *p) {
    Offload *o = p->off;
    par_offload_finish(p);
    for (int u = 0; u < o->n_units; u++) grad_out(o, u);
    for (int u = 0; u < o->n_units; u++) op_copy_sync(u, 0);
}

void par_offload_params_out(Parallel *p) {
    Offload *o = p->off;
    for (int u = 0; u < o->n_units; u++) {
        if (!o->params_host) op_copy_in(o->dparam[u], o->master + o->hoff[u], o->hn[u] * sizeof(float), u);
        pthread_mutex_lock(&o->mu);
        o->state[u] = UPLOADED;
        pthread_mutex_unlock(&o->mu);
    }
}

int par_offload_ready(Parallel *p, int u, int wait) {
    Offload *o = p->off;
    if (!o) return 1;
    pthread_mutex_lock(&o->mu);
    double t0 = o->state[u] == QUEUED && wait ? now_seconds() : 0;
    while (o->state[u] == QUEUED) {
        if (!wait) {
            pthread_mutex_unlock(&o->mu);
            return 0;
        }
        pthread_cond_wait(&o->done, &o->mu);
    }
    if (t0 > 0) o->wait_s += now_seconds() - t0;
    int up = o->state[u] == UPLOADED;
    o->state[u] = IDLE;
    pthread_mutex_unlock(&o->mu);
    if (up) op_copy_wait(u, 1);
    return 1;
}

void par_offload_finish(Parallel *p) {
    if (!p->off) return;
    for (int u = 0; u < p->off->n_units; u++) par_offload_ready(p, u, 1);
}

float *par_offload_master(const Parallel *p) { return p->off ? p->off->master : NULL; }
float *par_offload_grad(const Parallel *p) {
    if (p->off && p->off->act != sizeof(float)) die(EXIT_RUN_FAILURE, "internal: the gradients' host copy is not fp32");
    return p->off ? p->off->grad : NULL;
}

void parallel_offload_times(Parallel *p, double *update_s, double *wait_s) {
    Offload *o = p->off;
    *update_s = *wait_s = 0;
    if (!o) return;
    pthread_mutex_lock(&o->mu);
    *update_s = o->update_s;
    *wait_s = o->wait_s;
    pthread_mutex_unlock(&o->mu);
}
