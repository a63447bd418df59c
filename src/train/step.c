#include "step.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "ops.h"
#include "pipeline.h"
#include "run.h"
#include "trace.h"
#include "util.h"

static int piped(const Step *st) { return st->pipe.pipe && st->pipe.pipe->size > 1; }

/* The strategy's wish for the rows of the embedding the next step's global batch uses,
 * found on the host (while the device runs this step's update), so that only those are
 * reduced. The loader's next batch is the next step's only with one micro-batch a step. */
static void next_rows(Step *st) {
    if (!st->erows || st->micro != 1) return;
    const Model *m = st->m;
    size_t n = loader_batch_tokens(st->loader, m->V, st->eseen, st->erows), k = 0;
    for (size_t i = 0; i < n; i++)  /* vocabulary parallel: this rank's rows, numbered from its first */
        if ((unsigned)(st->erows[i] - m->v0) < (unsigned)m->Vr) st->erows[k++] = st->erows[i] - m->v0;
    parallel_set_embedding_rows(st->par, st->erows, k);
}

/* The pipeline's ring in two-rank groups ("links"): link j joins rank j, which sends on
 * it, and rank j + dir (mod p), which receives. A rank sends on one link and receives on
 * another, so on GPUs a send waiting in its stream for the peer's receive never holds up
 * a receive of this rank (one stream for both, around the ring of interleaved stages, can
 * wait in a circle). The links are made in up to three splits whose links share no rank
 * (even links, odd links, and with odd p the last one); each is ready for send/receive
 * before the next split, so both members set up each link together (and release it
 * together: step_free goes in the same order). */
static int link_color(int j, int p) { return p % 2 && j == p - 1 ? 2 : j % 2; }

/* Bytes of a message on a link: one micro-batch's residual stream (a's rows this rank holds),
 * or its gradient. */
static size_t msg_bytes(const Model *m, const Acts *a) { return model_stage_rows(m, a) * (size_t)m->E * ops_act_size(); }

static void make_links(Step *st, int dir, const char *name, Comm *out, Comm *in, size_t out_bytes, size_t in_bytes) {
    const Comm *pipe = st->pipe.pipe;
    int p = pipe->size, r = pipe->rank, from = ((r - dir) % p + p) % p;  /* the rank whose link reaches r */
    for (int k = 0; k < 3; k++) {
        int color = -1, key = 0;
        Comm *dst = NULL;
        if (link_color(r, p) == k) color = r, key = 0, dst = out;
        else if (link_color(from, p) == k) color = from, key = 1, dst = in;
        Comm tmp;
        comm_split(pipe, color, key, name, &tmp);
        if (dst) {
            *dst = tmp;
            comm_p2p_init(dst, dst == out ? out_bytes : in_bytes, st->pipe.copy_engines);
            st->link_order[st->n_links++] = dst;
        } else {
            comm_free(&tmp);
        }
    }
}

/* The versions' index of micro-batch j of this step (2bw: the step's; its micro-batches
 * m.. are the next step's) */
static long long version_index(const Step *st, int j) {
    return st->each ? st->mb_base + j : (st->mb_base + j) / st->micro;
}

int step_init(Step *st, Model *m, const Stage *s, int n_stages, Parallel *par, Loader *loader, Acts *a, int micro,
              const StepPipeline *pipe, char *err, size_t errlen) {
    memset(st, 0, sizeof *st);
    st->m = m; st->par = par; st->hooks = parallel_hooks(par); st->loader = loader;
    st->micro = micro;
    st->n_chunks = n_stages;
    st->head_chunk = -1;
    for (int c = 0; c < n_stages; c++) {
        st->chunk[c] = s[c];
        if (stage_has_head(m, &s[c])) st->head_chunk = c;
    }
    if (pipe) st->pipe = *pipe;
    int stages = piped(st) ? st->pipe.pipe->size : 1, me = piped(st) ? st->pipe.pipe->rank : 0;
    st->drain = 1;
    st->versions = pipe && schedule_no_flush(pipe->kind);
    st->each = pipe && pipe->kind == SCHED_PIPEDREAM;
    if (st->versions) {
        for (int k = 0; k < 4; k++)
            if ((st->each ? schedule_build_pipedream : schedule_build_2bw)(&st->lists[k], stages, me, micro, k / 2, k % 2,
                                                                        err, errlen))
                return -1;
        st->sched = st->lists[3];
    } else if (schedule_build(&st->sched, piped(st) ? st->pipe.kind : SCHED_1F1B, stages, me, micro, n_stages,
                       pipeline_split_backward_ok(&m->c, a->B * a->T, a->recompute),
                       piped(st) ? st->pipe.zb1_max_in_flight : 0, piped(st) ? st->pipe.cost : NULL, err, errlen))
        return -1;
    if (piped(st)) {
        /* each link's messages: one micro-batch's residual stream or its gradient, or none */
        size_t bytes = msg_bytes(m, a);
        int fwd, bwd;
        pipeline_rank_messages(&m->c, s, n_stages, &fwd, &bwd);
        make_links(st, +1, "pp-act", &st->act_out, &st->act_in, fwd ? bytes : 0, bwd ? bytes : 0);
        make_links(st, -1, "pp-grad", &st->grad_out, &st->grad_in, bwd ? bytes : 0, fwd ? bytes : 0);
    }
    size_t N = a->N;
    for (int c = 0; c < n_stages; c++) {
        /* one micro-batch's activations at a time on one stage; a pipeline stage keeps those
         * of every micro-batch between its forward and its backward (or weight pass) */
        int n = piped(st) || st->sched.split_backward ? st->sched.in_flight[c] : 1;
        st->n_acts[c] = n < 1 ? 1 : n;
        st->acts[c] = xcalloc((size_t)st->n_acts[c], sizeof(Acts));
        for (int i = 0; i < st->n_acts[c]; i++) {
            if (c == 0 && i == 0) st->acts[c][i] = *a;
            else
                acts_alloc_stage(&st->acts[c][i], m, &s[c], a->B, a->T,
                                 (a->recompute ? ACTS_RECOMPUTE : 1) | (st->sched.head_split ? ACTS_HEAD_SPLIT : 0));
        }
        st->sent_out[c] = xcalloc((size_t)st->n_acts[c], sizeof(CommP2P));
        st->sent_grad[c] = xcalloc((size_t)st->n_acts[c], sizeof(CommP2P));
        st->recv_in[c] = xcalloc((size_t)st->n_acts[c], sizeof(CommP2P));
        st->recv_grad[c] = xcalloc((size_t)st->n_acts[c], sizeof(CommP2P));
    }
    if (st->sched.split_backward) {  /* a ring: the W passes run in their B passes' order */
        size_t wb = 0;
        for (int c = 0; c < n_stages; c++) {
            size_t b = model_wgrad_bytes(&m->c, &s[c], a->B, a->T, ops_act_size());
            if (b > wb) wb = b;
        }
        st->n_wbuf = st->sched.max_pending_w < 1 ? 1 : st->sched.max_pending_w;
        st->wbuf = xcalloc((size_t)st->n_wbuf, sizeof(void *));
        for (int i = 0; i < st->n_wbuf; i++) st->wbuf[i] = model_tp_alloc(m, wb);
    }
    /* 2bw: the next step's micro-batches too, whose first forwards run in this step */
    st->mb_inputs = xmalloc((size_t)(st->versions ? 2 : 1) * micro * N * sizeof(int));
    st->mb_targets = xmalloc((size_t)(st->versions ? 2 : 1) * micro * N * sizeof(int));
    if (st->versions) {
        int *delay = xcalloc((size_t)m->n_units, sizeof(int));
        for (int u = 0; u < m->n_units; u++) delay[u] = st->pipe.unit_delay ? st->pipe.unit_delay[u] : 1;
        versions_init(&st->ver, m, st->hooks, delay);
        free(delay);
    }
    if (st->head_chunk >= 0) {
        int h = st->head_chunk;
        st->own_losses = xcalloc((size_t)st->n_acts[h], sizeof(float *));
        for (int i = 0; i < st->n_acts[h]; i++) st->own_losses[i] = st->acts[h][i].losses;
        if (micro > 1) {
            st->dev_losses = op_alloc((size_t)micro * N * sizeof(float));
            st->host_losses = xmalloc((size_t)micro * N * sizeof(float));
        }
    }
    if (m->n_moe) {
        size_t n = (size_t)m->n_moe * (m->X + 3);
        st->moe_host = xcalloc(n, sizeof(float));
        st->moe_stats = xcalloc(n, sizeof(double));
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
    if (st->head_chunk < 0) return 0;
    if (st->micro == 1) return model_loss(&st->acts[st->head_chunk][0]);
    size_t n = (size_t)st->micro * st->acts[0][0].N;
    op_download(st->host_losses, st->dev_losses, n * sizeof(float));
    double sum = 0;
    for (size_t i = 0; i < n; i++) sum += st->host_losses[i];
    return sum / (double)n;
}

static int holds_embedding(const Step *st) { return stage_has_embedding(&st->chunk[0]); }

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
    int copy = !holds_embedding(t->st);
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

/* Before a slot of chunk c is used again: its sends of an earlier micro-batch are done. */
static void slot_free(Step *st, int c, int i) {
    comm_p2p_wait(&st->sent_out[c][i]);
    comm_p2p_wait(&st->sent_grad[c][i]);
}

/* ... and every receive is complete (where the host did not wait for them: here a peer
 * that never sends ends the job, before a wait with no bound, comm.h) */
static void free_all_slots(Step *st) {
    for (int c = 0; c < st->n_chunks; c++)
        for (int k = 0; k < st->n_acts[c]; k++) {
            slot_free(st, c, k);
            comm_p2p_wait(&st->recv_in[c][k]);
            comm_p2p_wait(&st->recv_grad[c][k]);
        }
    for (int i = 0; i < st->n_links; i++) comm_p2p_drain(st->link_order[i]);
}

/* The peer on a link: the other of its two ranks. A message's tag names the stage it goes
 * to and its micro-batch, the same on both sides (MPI matches by it; NCCL keeps each
 * link's order, which the schedule's is; MPI tags stop at 32767, where the order on the
 * link tells the rest apart). */
static int peer(const Comm *link) { return 1 - link->rank; }
static int msg_tag(int to_stage, int micro, int n_micro) { return (to_stage * n_micro + micro) % 32768; }
static int tag(const Step *st, const Action *a) {
    int p = st->sched.stages, g = a->chunk * p + st->sched.stage;
    int to = a->kind == ACT_RECV_INPUT ? g : a->kind == ACT_SEND_OUTPUT ? g + 1 : a->kind == ACT_RECV_GRAD ? g : g - 1;
    /* (2bw: micro-batch m + j of a step is j of the next, where its neighbour may receive it) */
    return msg_tag(to, a->micro % st->micro, st->micro);
}

/* A receive into slot i of chunk c (the input, or the output's gradient): its earlier one
 * into the slot completed first (long since consumed; this is where a dead peer is noticed),
 * then the new one waited for: by the host (MPI, NCCL's kernels), or on the copy engines by
 * the compute stream on the device (comm.h). */
static void recv_slot(CommP2P *slots, int i, const Comm *link, void *buf, size_t bytes, int tag) {
    comm_p2p_wait(&slots[i]);
    comm_irecv(link, buf, bytes, peer(link), tag, &slots[i], "pipeline receive");
    comm_p2p_wait(&slots[i]);
}

double step_run(Step *st, const OptimConfig *oc, double *norm, double *lr) {
    Model *m = st->m;
    /* each micro-batch's gradient is that of its mean loss / micro: the step's gradient is
     * that of the mean over all its tokens (every micro-batch has as many); times the loss
     * scale, which the update divides back out. Under expert parallel also / ep_size: the
     * gradients are averaged over the ranks that hold the same experts and summed over the ep
     * group (its experts' rows come from all of it). */
    Optimizer *opt = parallel_optimizer(st->par);
    float scale = optim_loss_scale(opt) / (float)(st->each ? 1 : st->micro) / (float)m->ep_size;
    /* pipedream: m updates a step, the schedule's counts in steps (each update a 1/m of one) */
    OptimConfig ocu = *oc;
    if (st->each) ocu.warmup_steps *= st->micro, ocu.decay_steps *= st->micro;
    double last_norm = 0;
    size_t N = st->acts[0][0].N, act_bytes = msg_bytes(m, &st->acts[0][0]);
    TieHooks tie = {st, 0, 0, *st->hooks};
    const UnitHooks *hooks = st->hooks;
    if (st->pipe.tie) {
        tie.hooks = (UnitHooks){.ctx = &tie, .gather = tie_gather, .release = tie_release, .grad_begin = tie_grad_begin,
                                .grad_ready = st->hooks->grad_ready ? tie_grad_ready : NULL,
                                .embed_last = st->hooks->embed_last};
        hooks = &tie.hooks;
    }
    /* every rank reads the step's micro-batches (the loaders stay in step); each chunk's
     * forward takes its micro-batch's tokens from here */
    int fill = !st->filled, ahead = st->versions && !st->drain;
    if (st->versions) st->sched = st->lists[fill * 2 + !ahead];
    for (int i = fill ? 0 : st->micro; i < (ahead ? 2 : 1) * st->micro; i++)
        loader_next(st->loader, st->mb_inputs + (size_t)i * N, st->mb_targets + (size_t)i * N);
    parallel_begin_step(st->par);
    parallel_set_micro_batches(st->par, st->each ? 1 : st->micro);
    int n_b = 0, n_w = 0;  /* split backward: B and W passes so far (their wbuf ring's places) */
    for (int i = 0; i < st->sched.n; i++) {
        const Action *act = &st->sched.actions[i];
        int c = act->chunk, slot = act->micro >= 0 ? (st->slot_base + act->micro) % st->n_acts[c] : 0;
        Acts *a = &st->acts[c][slot];
        const Stage *s = &st->chunk[c];
        if (trace_active() && (act->kind == ACT_FORWARD || act->kind == ACT_BACKWARD || act->kind == ACT_WEIGHT)) {
            char label[48];  /* the schedule's actions on the timeline (MESHTRAIN_TIMELINE) */
            snprintf(label, sizeof label, "%s%d.%d", action_name(act->kind), act->micro, c);
            trace_mark(NULL, label);
        }
        switch (act->kind) {
        case ACT_RECV_INPUT:
            slot_free(st, c, slot);
            recv_slot(st->recv_in[c], slot, &st->act_in, model_stage_input(m, a), act_bytes, tag(st, act));
            break;
        case ACT_FORWARD:
            slot_free(st, c, slot);
            memcpy(a->inputs, st->mb_inputs + (size_t)act->micro * N, N * sizeof(int));
            memcpy(a->targets, st->mb_targets + (size_t)act->micro * N, N * sizeof(int));
            if (st->dev_losses && c == st->head_chunk) a->losses = st->dev_losses + (size_t)act->micro * N;
            if (st->versions) versions_use(&st->ver, version_index(st, act->micro));
            model_forward(m, s, a, 1, scale, hooks);
            break;
        case ACT_SEND_OUTPUT:
            comm_isend(&st->act_out, model_stage_output(m, s, a, 1), act_bytes, peer(&st->act_out), tag(st, act),
                       &st->sent_out[c][slot], "pipeline send");
            break;
        case ACT_RECV_GRAD:
            recv_slot(st->recv_grad[c], slot, &st->grad_in, model_stage_grad(a), act_bytes, tag(st, act));
            break;
        case ACT_BACKWARD:
            if (st->versions) versions_use(&st->ver, version_index(st, act->micro));  /* its forward's */
            if (st->sched.split_backward) model_backward_input(m, s, a, st->wbuf[n_b++ % st->n_wbuf], hooks);
            else model_backward(m, s, a, hooks);
            break;
        case ACT_SEND_GRAD:
            comm_isend(&st->grad_out, model_stage_grad(a), act_bytes, peer(&st->grad_out), tag(st, act),
                       &st->sent_grad[c][slot], "pipeline send");
            break;
        case ACT_WEIGHT:
            model_backward_weight(m, s, a, st->wbuf[n_w++ % st->n_wbuf], hooks);
            break;
        case ACT_OPTIM_STEP: {
            /* (2bw running on: the next step's first activations are still on their way to a
             * stage that takes them after this update, which waits for every stage's gradient
             * norm; their slots wait for them before reuse) */
            int last = act->micro < 0 || act->micro == st->micro - 1;  /* pipedream: one a micro-batch */
            if (!ahead && last) free_all_slots(st);
            if (tie.last_pending) {  /* the copy's last gradient: summed with the first stage's now */
                tie.emb_ready--;
                tie_grad_ready(&tie, UNIT_EMBEDDING);
            }
            /* queued before the loss is read: the device goes from the backward into the
             * update while the host waits */
            if (st->versions) versions_keep_newest(&st->ver);  /* the newest is kept, then updated */
            trace_mark(NULL, "optimizer step");
            last_norm = parallel_step(st->par, &ocu, lr);
            *norm = last_norm;
            trace_mark(NULL, "optimizer step enqueued");
            if (!last) {  /* pipedream: the next micro-batch's gradient, alone */
                parallel_begin_step(st->par);
                parallel_set_micro_batches(st->par, 1);
            } else {
                next_rows(st);
            }
            break;
        }
        }
    }
    if (st->versions) versions_use_newest(&st->ver);  /* (evaluation, sampling, checkpoints: the newest) */
    if (st->each && piped(st)) {
        /* each stage's update used its own norm; the step's is the last update's, all stages' */
        double sq = last_norm * last_norm;
        comm_allreduce_double(st->pipe.pipe, &sq, 1);
        *norm = sqrt(sq);
    }
    if (st->versions) {  /* the next step's first micro-batches: read, and some already in flight */
        if (ahead) {
            memmove(st->mb_inputs, st->mb_inputs + (size_t)st->micro * N, (size_t)st->micro * N * sizeof(int));
            memmove(st->mb_targets, st->mb_targets + (size_t)st->micro * N, (size_t)st->micro * N * sizeof(int));
        }
        st->filled = ahead;
        st->slot_base = ahead ? (st->slot_base + st->micro) % st->n_acts[0] : 0;
        st->mb_base += st->micro;
    }
    double loss = step_loss(st);
    if (m->n_moe) {  /* a pipeline stage has its own layers' statistics: the stages' put together */
        size_t n = (size_t)m->n_moe * (m->X + 3);
        model_moe_take_stats(m, st->moe_host);
        for (size_t i = 0; i < n; i++) st->moe_stats[i] = st->moe_host[i];
        if (piped(st)) comm_allreduce_double(st->pipe.pipe, st->moe_stats, n);
        /* (the next step chooses with the moved biases; a skipped step moves nothing) */
        if (!optim_loss_scaler(opt)->last_skipped) model_moe_balance(m, st->moe_stats);
    }
    if (st->head_chunk >= 0)
        for (int k = 0; k < st->n_acts[st->head_chunk]; k++) st->acts[st->head_chunk][k].losses = st->own_losses[k];
    return loss;
}

/* Forward only, one batch at a time through every stage in order: chunk c of this rank
 * takes its input from the stage before and passes its output on, and the head's stage
 * sums the losses. */
double step_eval(Step *st, Acts *va, const Shard *val, int max_batches, int dp_rank, int dp) {
    if (!piped(st)) return evaluate(st->m, va, val, max_batches, dp_rank, dp, st->hooks);
    Model *m = st->m;
    Loader l;
    char err[256];
    if (loader_init(&l, val, va->B, va->T, dp_rank, dp, 0, 0, err, sizeof err)) return 0;
    int n = (int)(l.batches_per_epoch < (size_t)max_batches ? l.batches_per_epoch : (size_t)max_batches);
    size_t bytes = msg_bytes(m, va);
    double sum = 0;
    for (int i = 0; i < n; i++) {
        int *inputs = NULL, *targets = NULL;
        for (int c = 0; c < st->n_chunks; c++) {
            const Stage *s = &st->chunk[c];
            Acts v;
            acts_view(&v, &st->acts[c][0], m, va->B);
            if (c == 0) {
                loader_next(&l, v.inputs, v.targets);
                inputs = v.inputs, targets = v.targets;
            } else {
                memcpy(v.inputs, inputs, v.N * sizeof(int));
                memcpy(v.targets, targets, v.N * sizeof(int));
            }
            CommP2P r;
            int g = c * st->sched.stages + st->sched.stage;  /* tags: the receiving stage's, as in a step */
            if (!stage_has_embedding(s)) {
                comm_irecv(&st->act_in, model_stage_input(m, &v), bytes, peer(&st->act_in), msg_tag(g, i, n), &r, "pipeline receive");
                comm_p2p_wait(&r);
                comm_p2p_drain(&st->act_in);  /* (the loss's download below waits with no bound) */
            }
            model_forward(m, s, &v, 0, 0.0f, st->hooks);
            if (c != st->head_chunk) {
                comm_isend(&st->act_out, model_stage_output(m, s, &v, 0), bytes, peer(&st->act_out), msg_tag(g + 1, i, n), &r,
                           "pipeline send");
                comm_p2p_wait(&r);
            } else {
                sum += model_loss(&v);
            }
        }
    }
    loader_free(&l);
    return st->head_chunk >= 0 && n ? sum / n : 0;
}

int step_stash_pieces(const Step *st, void **piece, size_t *bytes, int max) {
    return st->versions ? versions_pieces(&st->ver, piece, bytes, max) : 0;
}

int step_stash_count(const Step *st) { return st->versions ? versions_count(&st->ver) : 0; }

void step_set_start(Step *st, int step, long long updates) {
    if (!st->versions) return;
    /* pipedream: a version and a micro-batch index an update; 2bw: a step */
    st->mb_base = st->each ? updates : (long long)step * st->micro;
    st->ver.updates = st->each ? updates : step;
}

void step_free(Step *st) {
    if (st->versions && st->filled && piped(st) && !holds_embedding(st)) {
        /* the run ended after a step that left forwards in flight (a stop on a signal): the
         * stage before sent one more input than this stage took (the next step's micro-batch
         * w, w this stage's forwards ahead); taken, so that its send completes */
        int w = st->sched.stages - st->sched.stage - 1, slot = (st->slot_base + w) % st->n_acts[0];
        Action a = {ACT_RECV_INPUT, w, 0};
        recv_slot(st->recv_in[0], slot, &st->act_in, model_stage_input(st->m, &st->acts[0][slot]),
                  msg_bytes(st->m, &st->acts[0][0]), tag(st, &a));
    }
    free_all_slots(st);
    for (int c = 0; c < st->n_chunks; c++) {
        for (int i = 0; i < st->n_acts[c]; i++)
            if (c || i) acts_free(&st->acts[c][i]);
        free(st->acts[c]);
        free(st->sent_out[c]);
        free(st->sent_grad[c]);
        free(st->recv_in[c]);
        free(st->recv_grad[c]);
    }
    for (int i = 0; i < st->n_wbuf; i++) model_tp_free(st->m, st->wbuf[i]);
    free(st->wbuf);
    free(st->own_losses);
    free(st->mb_inputs);
    free(st->mb_targets);
    /* in the order they were made: NCCL's release of a link waits for its peer's, so both
     * ranks of every link must come to it in the same turn (as at set-up) */
    for (int i = 0; i < st->n_links; i++) comm_free(st->link_order[i]);
    if (st->versions) {
        st->sched.actions = NULL;  /* one of lists[] */
        for (int k = 0; k < 4; k++) schedule_free(&st->lists[k]);
        versions_free(&st->ver);
    }
    schedule_free(&st->sched);
    op_free(st->dev_losses);
    free(st->host_losses);
    free(st->eseen);
    free(st->erows);
    free(st->moe_host);
    free(st->moe_stats);
    memset(st, 0, sizeof *st);
}
