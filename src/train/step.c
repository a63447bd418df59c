#include "step.h"
#include <stdlib.h>
#include <string.h>
#include "ops.h"
#include "trace.h"
#include "util.h"

/* The strategy's wish for the rows of the embedding the next step's global batch uses,
 * found on the host (while the device runs this step's update), so that only those are
 * reduced. The loader's next batch is the next step's only with one micro-batch a step. */
static void next_rows(Step *st) {
    if (st->erows && st->micro == 1)
        parallel_set_embedding_rows(st->par, st->erows, loader_batch_tokens(st->loader, st->m->V, st->eseen, st->erows));
}

int step_init(Step *st, Model *m, Stage s, Parallel *par, Loader *loader, Acts *a, int micro, char *err,
              size_t errlen) {
    memset(st, 0, sizeof *st);
    st->m = m; st->stage = s; st->par = par; st->hooks = parallel_hooks(par); st->loader = loader; st->a = a;
    st->micro = micro;
    if (schedule_build(&st->sched, SCHED_1F1B, 1, 0, micro, err, errlen)) return -1;
    st->own_losses = a->losses;
    if (micro > 1) {
        st->dev_losses = op_alloc((size_t)micro * a->N * sizeof(float));
        st->host_losses = xmalloc((size_t)micro * a->N * sizeof(float));
    }
    if (parallel_wants_embedding_rows(par) && micro == 1) {
        st->eseen = xmalloc((size_t)m->V);
        st->erows = xmalloc((size_t)m->V * sizeof *st->erows);
        next_rows(st);
    }
    return 0;
}

/* The mean of the step's per-row losses, summed in order in double (one micro-batch:
 * model_loss, as a single batch). */
static double step_loss(Step *st) {
    if (st->micro == 1) return model_loss(st->a);
    size_t n = (size_t)st->micro * st->a->N;
    op_download(st->host_losses, st->dev_losses, n * sizeof(float));
    double sum = 0;
    for (size_t i = 0; i < n; i++) sum += st->host_losses[i];
    return sum / (double)n;
}

double step_run(Step *st, const OptimConfig *oc, double *norm, double *lr) {
    Acts *a = st->a;
    /* each micro-batch's gradient is that of its mean loss / micro: the step's gradient is
     * that of the mean over all its tokens (every micro-batch has as many) */
    float scale = 1.0f / (float)st->micro;
    parallel_begin_step(st->par);
    for (int i = 0; i < st->sched.n; i++) {
        const Action *act = &st->sched.actions[i];
        switch (act->kind) {
        case ACT_FORWARD:
            loader_next(st->loader, a->inputs, a->targets);
            if (st->micro > 1) parallel_begin_micro(st->par, act->micro, st->micro);
            if (st->dev_losses) a->losses = st->dev_losses + (size_t)act->micro * a->N;
            model_forward(st->m, &st->stage, a, 1, scale, st->hooks);
            break;
        case ACT_BACKWARD:
            model_backward(st->m, &st->stage, a, st->hooks);
            break;
        case ACT_OPTIM_STEP:
            /* queued before the loss is read: the device goes from the backward into the
             * update while the host waits */
            trace_mark(NULL, "optimizer step");
            *norm = parallel_step(st->par, oc, lr);
            trace_mark(NULL, "optimizer step enqueued");
            next_rows(st);
            break;
        default:  /* sends and receives: pipeline stages, which one process does not have */
            die(EXIT_RUN_FAILURE, "internal: action %s in a one-stage schedule", action_name(act->kind));
        }
    }
    double loss = step_loss(st);
    a->losses = st->own_losses;
    return loss;
}

void step_free(Step *st) {
    schedule_free(&st->sched);
    op_free(st->dev_losses);
    free(st->host_losses);
    free(st->eseen);
    free(st->erows);
    memset(st, 0, sizeof *st);
}
