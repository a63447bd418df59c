/* The Optimizer (optim.h), run through its optimizer's table (optim_impl.h), and the device
 * placement's kernels. Nothing here names an optimizer, except impl_of; nothing names the
 * host placement's workings (offload.c), only where it takes over. */
#include "optim_impl.h"
#include <stdlib.h>
#include <string.h>
#include "util.h"

/* The one place that maps a kind to its optimizer. */
static const OptimImpl *impl_of(OptimKind k) {
    static const OptimImpl *const table[] = {[OPTIM_ADAMW] = &optim_adamw, [OPTIM_ADAFACTOR] = &optim_adafactor};
    return table[k];
}

const char *optim_kind_name(OptimKind k) { return k == OPTIM_ADAFACTOR ? "adafactor" : "adamw"; }

int optim_moments(const OptimConfig *c) { return impl_of(c ? c->kind : OPTIM_ADAMW)->moments(c); }

static void *device_alloc(size_t bytes, const char *what) {
    (void)what;
    return op_alloc(bytes);
}

const OptimKernels optim_device_kernels = {
    .adamw = op_adamw,
    .adamw_cast = op_adamw_cast,
    .af_sums = op_adafactor_sums,
    .af_stats = op_adafactor_stats,
    .af_rms = op_adafactor_rms,
    .af_update = op_adafactor_update,
    .zero = op_zero,
    .alloc = device_alloc,
    .free = op_free,
};

Optimizer *optim_create(const OptimSetup *s) {
    static const OptimConfig adamw = {0};
    const OptimConfig *oc = s->oc ? s->oc : &adamw;
    const Model *m = s->m;
    if (oc->offload && ops_state_size() != sizeof(float))
        die(EXIT_RUN_FAILURE, "internal: offload keeps fp32 state, and this run's state is not fp32");
    Optimizer *o = xcalloc(1, sizeof *o);
    o->impl = impl_of(oc->kind);
    o->k = oc->offload ? &optim_host_kernels : &optim_device_kernels;
    o->m = m;
    o->n_units = m->n_units;
    o->D = s->D;
    o->r = s->r;
    o->summed = s->summed;
    o->lean = s->lean;
    o->params_host = oc->offload == OFFLOAD_PARAMS;
    o->af_beta1 = oc->kind == OPTIM_ADAFACTOR ? oc->af_beta1 : 0;
    o->n = m->n_flat / (size_t)s->D;
    o->at = xcalloc((size_t)m->n_units, sizeof *o->at);
    o->len = xcalloc((size_t)m->n_units, sizeof *o->len);
    o->units = xcalloc((size_t)m->n_units, sizeof *o->units);
    for (int u = 0; u < m->n_units; u++) {
        o->at[u] = m->units[u].offset / (size_t)s->D;
        o->len[u] = m->units[u].n_padded / (size_t)s->D;
        o->units[u] = s->units[u];
    }
    size_t bytes = o->n * ops_state_size();
    for (int k = 0; k < o->impl->moments(oc); k++) o->mom[k] = o->k->alloc(bytes, o->impl->moment_name[k]);
    if (o->impl->setup) o->impl->setup(o);
    if (oc->offload) optim_host_setup(o);
    loss_scaler_init(&o->scaler, &oc->loss_scale);
    return o;
}

void optim_free(Optimizer *o) {
    if (!o) return;
    if (o->host) optim_host_free(o);  /* first: its thread and copies use what follows */
    if (o->impl->free) o->impl->free(o);
    for (int k = 0; k < 2; k++) o->k->free(o->mom[k]);
    free(o->at); free(o->len); free(o->units);
    free(o);
}

OptimKind optim_kind(const Optimizer *o) { return o->impl->kind; }
int optim_steps(const Optimizer *o) { return o->steps; }
void optim_set_steps(Optimizer *o, int steps) { o->steps = steps; }
void *optim_moment(const Optimizer *o, int k) { return k >= 0 && k < 2 ? o->mom[k] : NULL; }

void *optim_param_of(const Optimizer *o, int u) {
    return o->host ? (void *)(optim_host_master(o) + o->at[u]) : o->units[u].param;
}
const void *optim_grad_of(const Optimizer *o, int u) {
    return o->host ? (const void *)(optim_host_grad(o) + o->at[u]) : o->units[u].grad;
}

/* ---- a step ---- */

double optim_begin(Optimizer *o, const OptimConfig *oc) {
    if (oc->kind != o->impl->kind)
        die(EXIT_RUN_FAILURE, "internal: the optimizer step is not the one whose state was allocated");
    int t = ++o->steps;
    o->cur = (OptimStep){o->impl->rate(oc, t), t, 1.0f, oc};
    if (o->host) optim_host_begin(o);
    return o->cur.lr;
}

int optim_stat_rounds(const Optimizer *o) { return o->impl->rounds; }

OptimSums optim_stats(Optimizer *o, int round, float scale) {
    o->cur.scale = scale;
    if (o->host) optim_host_grads_in(o);
    return o->impl->stats(o, round, scale);
}

void optim_stats_summed(Optimizer *o, int round) { o->impl->stats_summed(o, round); }

int optim_update(Optimizer *o, int u0, int u1, float scale) {
    o->cur.scale = scale;
    if (o->host) {
        optim_host_update(o, u0, u1);
        return 0;
    }
    if (u0 >= u1) return 0;
    OptimRange r = {u0, u1, o->units[u0].param, o->units[u0].grad, optim_at(o->mom[0], o->at[u0]),
                    optim_at(o->mom[1], o->at[u0]), o->at[u0], 0, o->units[u0].act, 0};
    for (int u = u0; u < u1; u++) r.n += o->len[u];
    return o->impl->update(o, &r, &o->cur);
}

float optim_loss_scale(const Optimizer *o) { return o->scaler.scale; }
LossScaler *optim_loss_scaler(Optimizer *o) { return &o->scaler; }

int optim_loss_scale_step(Optimizer *o, int overflow) {
    if (loss_scaler_update(&o->scaler, overflow)) return 1;
    /* skipped: uncounted, so the next step takes this one's number and rate; the host
     * placement's begin only reset its per-step flags, and nothing was queued */
    o->steps--;
    return 0;
}

int optim_updates_in_parts(const Optimizer *o) { return !o->host && o->impl->elementwise; }

/* ---- the placement ---- */

int optim_on_host(const Optimizer *o) { return o->host != NULL; }
float *optim_master(const Optimizer *o) { return o->host ? optim_host_master(o) : NULL; }
void optim_new_grads(Optimizer *o) { if (o->host) optim_host_new_grads(o); }
void optim_grad_final(Optimizer *o, int u) { if (o->host) optim_host_grad_final(o, u); }
int optim_grad_wanted(const Optimizer *o, int u) { return o->host && optim_host_grad_wanted(o, u); }
void optim_grad_changed(Optimizer *o, int u) { if (o->host) optim_host_grad_changed(o, u); }
int optim_ready(Optimizer *o, int u, int wait) { return o->host ? optim_host_ready(o, u, wait) : 1; }
int optim_updates_later(const Optimizer *o) { return o->host != NULL; }
void optim_params_written(Optimizer *o) { if (o->host) optim_host_params_written(o); }

void optim_finish(Optimizer *o) {
    if (!o->host) return;
    for (int u = 0; u < o->n_units; u++) optim_host_ready(o, u, 1);
}

size_t optim_tensor_state_count(const Optimizer *o) {
    size_t n = 0;
    if (o->impl->tensor_state) o->impl->tensor_state(o, &n);
    return n;
}

void optim_tensor_state(Optimizer *o, float *host, int upload) {
    size_t n = 0;
    float *t = o->impl->tensor_state ? o->impl->tensor_state(o, &n) : NULL;
    size_t bytes = n * sizeof(float);
    if (!bytes) return;
    if (o->host) {  /* host memory already */
        optim_finish(o);
        if (upload) memcpy(t, host, bytes);
        else memcpy(host, t, bytes);
    } else if (upload) op_upload(t, host, bytes);
    else {
        ops_synchronize();
        op_download(host, t, bytes);
    }
}

/* ---- sizes ---- */

OptimBytes optim_bytes(const OptimConfig *oc, const Model *layout, size_t n, size_t state_size, size_t grad_copy_size,
                       int summed) {
    const OptimImpl *im = impl_of(oc ? oc->kind : OPTIM_ADAMW);
    size_t state = n * state_size * (size_t)im->moments(oc) + (im->tensor_bytes ? im->tensor_bytes(layout) : 0);
    if (!oc || !oc->offload) return (OptimBytes){state, 0};
    /* the master copy (fp32: the state type with offload) and the gradients' copy beside the state */
    return (OptimBytes){summed && im->summed_bytes ? im->summed_bytes(layout) : 0,
                        state + n * state_size + n * grad_copy_size};
}

int optim_lean_possible(const OptimConfig *oc) {
    return oc && oc->offload == OFFLOAD_OPTIMIZER && impl_of(oc->kind)->lean;
}
