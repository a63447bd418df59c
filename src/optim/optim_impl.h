/* The optimizer layer's inside: the Optimizer, the table each optimizer fills (adamw.c,
 * adafactor.c), and the placement's pieces (the kernels it runs, its memory; offload.c for
 * the host's). optim.c runs the public interface (optim.h) through the table and never
 * names an optimizer, except in the one lookup from OptimKind to table. */
#ifndef MESHTRAIN_OPTIM_IMPL_H
#define MESHTRAIN_OPTIM_IMPL_H
#include <stdint.h>
#include "ops.h"
#include "optim.h"

/* The kernels of a placement: the ops' on the device; the cpu backend's on the host (which
 * the op_* wrappers' guards for empty segments are repeated around). */
typedef struct {
    void (*adamw)(void *param, const void *grad, void *m, void *v, size_t n, float lr, float beta1, float beta2,
                  float eps, float weight_decay, int step, float grad_scale);
    /* adamw, and act := the updated parameters in the compute type (NULL on the host) */
    void (*adamw_cast)(void *param, const void *grad, void *m, void *v, size_t n, float lr, float beta1, float beta2,
                       float eps, float weight_decay, int step, float grad_scale, void *act);
    /* adamw on a bf16 gradient, the bf16 parameters written over it (the host's; NULL on the device) */
    void (*adamw16)(float *param, uint16_t *g16, float *m, float *v, size_t n, float lr, float beta1, float beta2,
                    float eps, float weight_decay, int step, float grad_scale);
    void (*af_sums)(float *sums, const void *grad, const AdafactorSeg *s, float grad_scale);
    void (*af_stats)(float *stat, float *fac, const float *sums, int rows, int cols, float beta2t, float eps1);
    void (*af_rms)(double *out, const void *param, const void *grad, const float *fac, const AdafactorSeg *s,
                   float grad_scale);
    void (*af_update)(void *param, const void *grad, void *m, const float *fac, const AdafactorSeg *s,
                      float grad_scale, float coef, float decay, float beta1);
    void (*zero)(void *p, size_t bytes);
    /* The placement's memory for state: the device's, or host memory (pinned on a GPU; a
     * one-line exit 2 where it cannot be had). */
    void *(*alloc)(size_t bytes, const char *what);
    void (*free)(void *p);
} OptimKernels;

extern const OptimKernels optim_device_kernels;  /* optim.c */
extern const OptimKernels optim_host_kernels;    /* offload.c */

/* The step: its rate, its number (from 1), the gradient's factor, its config. */
typedef struct {
    double lr;
    int step;
    float scale;
    const OptimConfig *oc;
} OptimStep;

/* What one update covers: units [u0, u1), contiguous in the buffers below, from element at
 * of the elementwise state; pointers at the range's start. On the host param is the master
 * copy and grad the gradients' copy, fp32, or bf16 where grad16 (lean: the update writes
 * the bf16 parameters over it). act: the compute copy to write too, or NULL. */
typedef struct {
    int u0, u1;
    void *param;
    const void *grad;
    void *m1, *m2;
    size_t at, n;
    void *act;
    int grad16;
} OptimRange;

/* One optimizer. */
typedef struct {
    const char *name;
    OptimKind kind;
    /* elementwise arrays (optim_moments) and what host-allocation errors call them */
    int (*moments)(const OptimConfig *c);
    const char *moment_name[2];
    /* 1: a range's update reads nothing but its own elements (AdamW): it may run in parts,
     * and on the host unit by unit on the update thread */
    int elementwise;
    /* 1: its host update can read a bf16 gradient and write the bf16 parameters (lean) */
    int lean;
    /* Optional: its per-tensor state over o's layout (o->state), allocated with o->k; freed. */
    void (*setup)(Optimizer *o);
    void (*free)(Optimizer *o);
    /* Bytes of the per-tensor state of a layout, and of what of it is summed over ranks
     * through device memory when the state is on the host (the estimate). */
    size_t (*tensor_bytes)(const Model *layout);
    size_t (*summed_bytes)(const Model *layout);
    /* The fp32 values of the per-tensor state a checkpoint keeps (NULL: none) and their count. */
    float *(*tensor_state)(const Optimizer *o, size_t *n);
    /* The rate of step t (from 1). */
    double (*rate)(const OptimConfig *c, int t);
    /* statistics rounds before the update (optim_stats, optim_stats_summed) */
    int rounds;
    OptimSums (*stats)(Optimizer *o, int round, float scale);
    void (*stats_summed)(Optimizer *o, int round);
    /* The update of a range with the placement's kernels (o->k); 1 where it wrote r->act. */
    int (*update)(Optimizer *o, const OptimRange *r, const OptimStep *s);
} OptimImpl;

extern const OptimImpl optim_adamw;      /* adamw.c */
extern const OptimImpl optim_adafactor;  /* adafactor.c */

typedef struct OptimHost OptimHost;  /* offload.c */

struct Optimizer {
    const OptimImpl *impl;
    const OptimKernels *k;  /* the placement's */
    const Model *m;
    int n_units, D, r, summed, lean, params_host;
    double af_beta1;        /* Adafactor's first moment (OptimConfig.af_beta1) */
    size_t n;               /* elements of each elementwise array */
    size_t *at, *len;       /* per unit: its part's first element in them (and in the host's buffers), its length */
    OptimUnit *units;       /* per unit: the device's side */
    void *mom[2];           /* the elementwise arrays (NULL past the optimizer's moments) */
    void *state;            /* the optimizer's per-tensor state (its setup) */
    int steps;
    OptimStep cur;          /* the step begun last */
    LossScaler scaler;      /* the loss scale of the steps (OptimConfig.loss_scale) */
    OptimHost *host;        /* the host placement, NULL on the device */
};

/* Unit u's parameters and gradient as this placement's update reads them: the device's,
 * or the host's master copy and gradients' copy (fp32). */
void *optim_param_of(const Optimizer *o, int u);
const void *optim_grad_of(const Optimizer *o, int u);
/* Element i of the state type array a (host buffers are fp32, the state type there). */
static inline void *optim_at(void *a, size_t i) { return a ? st_at(a, i) : NULL; }

/* ---- the host placement (offload.c) ---- */
/* Host memory for the offloaded state (pinned on a GPU), or a one-line exit 2. */
void *optim_host_alloc(size_t bytes, const char *what);
/* After the state: the master copy, the gradients' copy, the update thread. */
void optim_host_setup(Optimizer *o);
void optim_host_free(Optimizer *o);
/* A step begins (optim_begin). */
void optim_host_begin(Optimizer *o);
/* Before the first host computation of a step on this thread that reads gradients (the
 * statistics, an update that is not elementwise): every unit's gradient in the host's copy. */
void optim_host_grads_in(Optimizer *o);
/* optim_update on the host: an elementwise optimizer's units queued for the update thread,
 * else updated here and their parameters sent back to the device. */
void optim_host_update(Optimizer *o, int u0, int u1);
void optim_host_new_grads(Optimizer *o);
void optim_host_grad_final(Optimizer *o, int u);
int optim_host_grad_wanted(const Optimizer *o, int u);
void optim_host_grad_changed(Optimizer *o, int u);
int optim_host_ready(Optimizer *o, int u, int wait);
void optim_host_params_written(Optimizer *o);
float *optim_host_master(const Optimizer *o);
float *optim_host_grad(const Optimizer *o);
#endif
