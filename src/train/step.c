#include "step.h"
#include <stdlib.h>
#include <string.h>
#include "ops.h"
#include "run.h"
#include "trace.h"
#include "util.h"

static int piped(const Step *st) { return st->pipe.pipe && st->pipe.pipe->size > 1; }

/* The strategy's wish for the rows of the embedding the next step's global batch uses,
 * found on the host (while the device runs this step's update), so that only those are
 * reduced. The loader's next batch is the next step's only with one micro-batch a step. */
static void next_rows(Step *st) {
    if (st->erows && st->micro == 1)
        parallel_set_embedding_rows(st->par, st->erows, loader_batch_tokens(st->loader, st->m->V, st->eseen, st->erows));
}

int step_init(Step *st, Model *m, Stage s, Parallel *par, Loader *loader, Acts *a, int micro,
              const StepPipeline *pipe, char *err, size_t errlen) {
    memset(st, 0, sizeof *st);
    st->m = m; st->stage = s; st->par = par; st->hooks = parallel_hooks(par); st->loader = loader;
    st->micro = micro;
    if (pipe) st->pipe = *pipe;
    int stages = piped(st) ? st->pipe.pipe->size : 1, me = piped(st) ? st->pipe.pipe->rank : 0;
    if (schedule_build(&st->sched, piped(st) ? st->pipe.kind : SCHED_1F1B, stages, me, micro, err, errlen)) return -1;
    /* one micro-batch's activations at a time on one stage; a pipeline stage keeps those
     * of every micro-batch between its forward and its backward */
    st->n_acts = piped(st) ? st->sched.max_in_flight : 1;
    if (piped(st)) {
        /* one group per direction: on GPUs each has its own stream, where a stage's sends
         * wait for the peer's receives; one stream for both would deadlock 1F1B (a send
         * queued before a receive that the peer needs first) */
        comm_split(st->pipe.pipe, 0, me, "pp-fwd", &st->fwd);
        comm_split(st->pipe.pipe, 0, me, "pp-bwd", &st->bwd);
        comm_p2p_init(&st->fwd);
        comm_p2p_init(&st->bwd);
    }
    st->acts = xcalloc((size_t)st->n_acts, sizeof *st->acts);
    st->acts[0] = *a;
    for (int i = 1; i < st->n_acts; i++)
        acts_alloc_stage(&st->acts[i], m, &s, a->B, a->T, a->recompute ? ACTS_RECOMPUTE : 1);
    st->sent_out = xcalloc((size_t)st->n_acts, sizeof(CommP2P));
    st->sent_grad = xcalloc((size_t)st->n_acts, sizeof(CommP2P));
    st->own_losses = xcalloc((size_t)st->n_acts, sizeof(float *));
    for (int i = 0; i < st->n_acts; i++) st->own_losses[i] = st->acts[i].losses;
    if (micro > 1 && stage_has_head(m, &s)) {
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
    if (!stage_has_head(st->m, &st->stage)) return 0;
    if (st->micro == 1) return model_loss(&st->acts[0]);
    size_t n = (size_t)st->micro * st->acts[0].N;
    op_download(st->host_losses, st->dev_losses, n * sizeof(float));
    double sum = 0;
    for (size_t i = 0; i < n; i++) sum += st->host_losses[i];
    return sum / (double)n;
}

/* A tied embedding's gradient is made on two stages (the embedding's backward on the first,
 * lm_head's on the last): once both are complete they are summed between the two, before
 * the strategy reduces them over data-parallel ranks, so both copies take the same update. */
static void tie_sum(Step *st) {
    const Unit *e = &st->m->units[UNIT_EMBEDDING];
    comm_allreduce(st->pipe.tie, unit_grads(st->m, UNIT_EMBEDDING), e->n_padded, COMM_SUM);
}

/* The model's grad_ready, through the step where a tied embedding spans two stages: the
 * last micro-batch's is held back until the two halves are summed. On the last stage the
 * copy's gradient (lm_head's) is complete with the head's, in each micro-batch's forward
 * (the model, which has no embedding backward there, does not say so itself); its last
 * waits for the optimizer step, where the stage has sent everything the first stage
 * needs to finish its own (a sum inside the forward would wait for a backward of the
 * first stage that waits for this stage's). */
typedef struct { Step *st; int emb_ready, last_pending; UnitHooks hooks; } TieHooks;

static void tie_grad_ready(void *ctx, int u) {
    TieHooks *t = ctx;
    const UnitHooks *h = t->st->hooks;
    int copy = !stage_has_embedding(&t->st->stage);
    if (u == UNIT_EMBEDDING && ++t->emb_ready == t->st->micro) {
        if (copy && !t->last_pending) { t->last_pending = 1; return; }
        tie_sum(t->st);
    }
    h->grad_ready(h->ctx, u);
    if (u == unit_head(t->st->m) && copy) tie_grad_ready(ctx, UNIT_EMBEDDING);
}
static void tie_gather(void *ctx, int u, int next) {
    const UnitHooks *h = ((TieHooks *)ctx)->st->hooks;
    if (h->gather) h->gather(h->ctx, u, next);
}
static void tie_release(void *ctx, int u) {
    const UnitHooks *h = ((TieHooks *)ctx)->st->hooks;
    if (h->release) h->release(h->ctx, u);
}
static void tie_grad_begin(void *ctx, int u) {
    const UnitHooks *h = ((TieHooks *)ctx)->st->hooks;
    if (h->grad_begin) h->grad_begin(h->ctx, u);
}

/* Before acts slot i is used again: its sends of an earlier micro-batch are done. */
static void slot_free(Step *st, int i) {
    comm_p2p_wait(&st->sent_out[i]);
    comm_p2p_wait(&st->sent_grad[i]);
}

double step_run(Step *st, const OptimConfig *oc, double *norm, double *lr) {
    Model *m = st->m;
    /* each micro-batch's gradient is that of its mean loss / micro: the step's gradient is
     * that of the mean over all its tokens (every micro-batch has as many) */
    float scale = 1.0f / (float)st->micro;
    const Comm *pp = st->pipe.pipe;
    int me = pp ? pp->rank : 0;
    size_t act_bytes = st->acts[0].N * (size_t)m->E * ops_act_size();
    TieHooks tie = {st, 0, 0, *st->hooks};
    const UnitHooks *hooks = st->hooks;
    if (st->pipe.tie) {
        tie.hooks = (UnitHooks){.ctx = &tie, .gather = tie_gather, .release = tie_release, .grad_begin = tie_grad_begin,
                                .grad_ready = st->hooks->grad_ready ? tie_grad_ready : NULL,
                                .embed_last = st->hooks->embed_last};
        hooks = &tie.hooks;
    }
    parallel_begin_step(st->par);
    parallel_set_micro_batches(st->par, st->micro);
    for (int i = 0; i < st->sched.n; i++) {
        const Action *act = &st->sched.actions[i];
        int slot = act->micro >= 0 ? act->micro % st->n_acts : 0;
        Acts *a = &st->acts[slot];
        CommP2P r;
        switch (act->kind) {
        case ACT_RECV_INPUT:
            slot_free(st, slot);
            comm_irecv(&st->fwd, model_stage_input(m, a), act_bytes, me - 1, act->micro, &r, "pipeline receive");
            comm_p2p_wait(&r);
            break;
        case ACT_FORWARD:
            slot_free(st, slot);
            loader_next(st->loader, a->inputs, a->targets);  /* every stage: the batches stay in step */
            if (st->dev_losses) a->losses = st->dev_losses + (size_t)act->micro * a->N;
            model_forward(m, &st->stage, a, 1, scale, hooks);
            break;
        case ACT_SEND_OUTPUT:
            comm_isend(&st->fwd, model_stage_output(m, &st->stage, a, 1), act_bytes, me + 1, act->micro, &st->sent_out[slot],
                       "pipeline send");
            break;
        case ACT_RECV_GRAD:
            comm_irecv(&st->bwd, model_stage_grad(a), act_bytes, me + 1, act->micro, &r, "pipeline receive");
            comm_p2p_wait(&r);
            break;
        case ACT_BACKWARD:
            model_backward(m, &st->stage, a, hooks);
            break;
        case ACT_SEND_GRAD:
            comm_isend(&st->bwd, model_stage_grad(a), act_bytes, me - 1, act->micro, &st->sent_grad[slot], "pipeline send");
            break;
        case ACT_OPTIM_STEP:
            for (int k = 0; k < st->n_acts; k++) slot_free(st, k);
            if (tie.last_pending) {  /* the copy's last gradient: summed with the first stage's now */
                tie.emb_ready--;
                tie_grad_ready(&tie, UNIT_EMBEDDING);
            }
            /* queued before the loss is read: the device goes from the backward into the
             * update while the host waits */
            trace_mark(NULL, "optimizer step");
            *norm = parallel_step(st->par, oc, lr);
            trace_mark(NULL, "optimizer step enqueued");
            next_rows(st);
            break;
        }
    }
    double loss = step_loss(st);
    for (int k = 0; k < st->n_acts; k++) st->acts[k].losses = st->own_losses[k];
    return loss;
}

double step_eval(Step *st, Acts *va, const Shard *val, int max_batches, int dp_rank, int dp) {
    if (!piped(st)) return evaluate(st->m, va, val, max_batches, dp_rank, dp, st->hooks);
    Model *m = st->m;
    const Comm *pp = st->pipe.pipe;
    int me = pp->rank, last = me == pp->size - 1;
    Loader l;
    char err[256];
    if (loader_init(&l, val, va->B, va->T, dp_rank, dp, 0, 0, err, sizeof err)) return 0;
    int n = (int)(l.batches_per_epoch < (size_t)max_batches ? l.batches_per_epoch : (size_t)max_batches);
    size_t bytes = va->N * (size_t)m->E * ops_act_size();
    double sum = 0;
    for (int i = 0; i < n; i++) {
        CommP2P r;
        loader_next(&l, va->inputs, va->targets);
        if (me > 0) {
            comm_irecv(&st->fwd, model_stage_input(m, va), bytes, me - 1, i, &r, "pipeline receive");
            comm_p2p_wait(&r);
        }
        model_forward(m, &st->stage, va, 0, 0.0f, st->hooks);
        if (!last) {
            comm_isend(&st->fwd, model_stage_output(m, &st->stage, va, 0), bytes, me + 1, i, &r, "pipeline send");
            comm_p2p_wait(&r);
        } else {
            sum += model_loss(va);
        }
    }
    loader_free(&l);
    return last && n ? sum / n : 0;
}

void step_free(Step *st) {
    for (int k = 0; k < st->n_acts; k++) slot_free(st, k);
    for (int i = 1; i < st->n_acts; i++) acts_free(&st->acts[i]);
    free(st->acts);
    free(st->sent_out);
    free(st->sent_grad);
    free(st->own_losses);
    comm_free(&st->fwd);
    comm_free(&st->bwd);
    schedule_free(&st->sched);
    op_free(st->dev_losses);
    free(st->host_losses);
    free(st->eseen);
    free(st->erows);
    memset(st, 0, sizeof *st);
}
