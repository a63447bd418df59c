/* stage: the forward and backward of a contiguous range of units (embedding, layers, head
 * and loss) for one micro-batch, with the strategy's hooks around each unit. */
#include "model_layer.h"
#include <stdio.h>
#include "trace.h"
#include "util.h"

#define HOOK(h, fn, ...) do { if ((h) && (h)->fn) (h)->fn((h)->ctx, __VA_ARGS__); } while (0)

/* The embedding (on the stage that holds it) and the stage's layers for B x T tokens,
 * leaving the last layer's output; unit by unit, each gathered just before use and
 * released after. Layer l of the stage uses activation slot l - first (residual slots
 * l - first and l - first + 1): a stage's Acts hold its own layers only. */
static void trunk_forward(Model *m, const Stage *s, Acts *a, int B, int T, int training, const UnitHooks *h) {
    int N = B * T, l0 = stage_first_layer(s), nl = stage_n_layers(&m->c, s);
    int after = stage_has_head(m, s) ? unit_head(m) : -1;  /* the unit after the stage's last layer */
    if (stage_has_embedding(s)) {
        HOOK(h, gather, UNIT_EMBEDDING, nl > 0 ? unit_of_layer(l0) : after);
        if (m->tp_size == 1) op_embedding_forward(a->res, a->dev_inputs, unit_weights(m, UNIT_EMBEDDING), N, m->E);
        else {  /* vocabulary parallel: each rank's rows, zeros elsewhere, summed */
            void *y = m->sp ? a->full : a->res;
            op_embedding_forward_shard(y, a->dev_inputs, unit_weights(m, UNIT_EMBEDDING), N, m->E, m->v0, m->Vr);
            branch_sum(m, a->res, y, N);
        }
        HOOK(h, release, UNIT_EMBEDDING);
    }
    for (int i = 0; i < nl; i++) {
        int l = l0 + i, slot = training && !a->recompute ? i : 0, r = training ? i : 0;
        LayerActs la = layer_acts(m, a, l, slot, r);
        if (!training && i > 0) op_copy(la.x, la.out, held_rows(m, (size_t)N) * m->E * ops_act_size());
        HOOK(h, gather, unit_of_layer(l), i + 1 < nl ? unit_of_layer(l + 1) : after);
        if (trace_active()) {  /* (the timeline's: where a layer's forward starts) */
            char label[48];
            snprintf(label, sizeof label, "layer %d forward", l);
            trace_mark(NULL, label);
        }
        if (training && layer_graphed(m)) layer_run_graphed(m, a, l, &la, NULL, LG_FORWARD, 0);
        else layer_forward(m, a, l, &la, B, T, 0);
        HOOK(h, release, unit_of_layer(l));
    }
}

static const void *trunk_output(const Model *m, const Stage *s, const Acts *a, int training) {
    int nl = stage_n_layers(&m->c, s);
    return act_at(a->res, (size_t)(training ? nl : nl > 0) * held_rows(m, a->N) * m->E);
}

void *model_stage_input(const Model *m, const Acts *a) { (void)m; return a->res; }
void *model_stage_output(const Model *m, const Stage *s, const Acts *a, int training) {
    return (void *)trunk_output(m, s, a, training);
}
void *model_stage_grad(const Acts *a) { return a->dres; }
size_t model_stage_rows(const Model *m, const Acts *a) { return held_rows(m, a->N); }

/* The per-row losses are read only at the end of the step, so that on a device the
 * download (which waits for the queued work) does not stall the backward. Summed in row
 * order in double. */
float model_loss(Acts *a) {
    op_download(a->host_losses, a->losses, a->N * sizeof(float));
    double sum = 0;
    for (size_t i = 0; i < a->N; i++) sum += a->host_losses[i];
    return (float)(sum / (double)a->N);
}

float model_step(Model *m, Acts *a, int grad, float grad_scale, const UnitHooks *h) {
    model_enqueue_step(m, a, grad, grad_scale, h);
    return model_loss(a);
}

void model_enqueue_step(Model *m, Acts *a, int grad, float grad_scale, const UnitHooks *h) {
    Stage whole = model_whole(m);
    model_forward(m, &whole, a, grad, grad_scale, h);
    if (grad) model_backward(m, &whole, a, h);
}

/* The unit a stage's backward needs after its head: its last layer, or none where the stage
 * holds the head alone (the layer before is another stage's: nothing to prefetch). */
static int unit_before_head(const Model *m, const Stage *s) {
    return stage_n_layers(&m->c, s) > 0 ? unit_head(m) - 1 : -1;
}

/* The head: output_norm, then lm_head (tok_embed's matrix when tied), and the loss; with
 * grad, fused with its backward per chunk of logits, ending with d(loss)/d(last) in dres.
 * before: unit_before_head. */
static void head_forward_backward(Model *m, Acts *a, const void *last, int grad, float grad_scale, int before,
                                  const UnitHooks *h) {
    int N = a->B * a->T, E = m->E, V = m->Vr, HU = unit_head(m), tied = m->c.tie_embeddings;
    HOOK(h, gather, HU, tied ? UNIT_EMBEDDING : before);
    if (tied) HOOK(h, gather, UNIT_EMBEDDING, before);
    if (grad && !a->head_split) {
        HOOK(h, grad_begin, HU);
        if (tied) HOOK(h, grad_begin, UNIT_EMBEDDING);
    }
    trace_mark(NULL, "trunk forward done, head");
    const void *w_out_norm = act_at(unit_weights(m, HU), m->head_out_norm);
    /* sequence parallel: the norm on the rank's rows, written into their place in xf and
     * gathered: every rank's lm_head columns take every row */
    int NS = (int)held_rows(m, (size_t)N);
    op_rmsnorm_forward(act_at(a->xf, (size_t)(m->sp ? m->tp_rank : 0) * NS * E), a->rstdf, last, w_out_norm, NS, E,
                       RMS_EPS);
    seq_gather(m, a->xf, a->xf, N);
    const void *wlm = model_lm_head(m);
    void *glm = tied ? unit_grads(m, UNIT_EMBEDDING) : st_at(unit_grads(m, HU), m->head_lm);
    if (grad && !a->head_split) op_zero(a->dxf, (size_t)N * E * ops_act_size());
    /* Head forward and backward fused per chunk of rows: the logits of a chunk are turned
     * into their gradient in place and consumed at once. Vocabulary parallel: a rank's
     * logits are its vocabulary rows' (V = Vr columns); the cross-entropy's statistics
     * (max, sum of exponentials, target logit) of every rank are all-gathered per chunk, and
     * the head input's gradient, a sum over the ranks' rows, all-reduced at the end. */
    float scale = grad ? grad_scale / (float)N : 0.0f;
    int ldl = ops_logit_stride(V);  /* logit rows padded: aligned for the tensor cores */
    int keep = grad && a->head_split;  /* the logits' gradient kept for head_backward */
    for (size_t r0 = 0; r0 < (size_t)N; r0 += a->logit_rows) {
        int rows = (int)((size_t)N - r0 < a->logit_rows ? (size_t)N - r0 : a->logit_rows);
        const void *x = act_at(a->xf, r0 * E);
        void *lg = keep ? act_at(a->logits, r0 * (size_t)ldl) : a->logits;
        op_matmul_forward_ld(lg, ldl, x, wlm, rows, E, V);
        if (m->tp_size == 1)
            op_crossentropy_forward_backward_ld(a->losses + r0, lg, ldl, a->dev_targets + r0, rows, V, scale);
        else {
            size_t blk = 3 * (size_t)rows;
            op_crossentropy_shard_stats(a->ce_stats + (size_t)m->tp_rank * blk, lg, ldl, a->dev_targets + r0,
                                        rows, V, m->v0);
            tp_join(m, m->tp.allgather_begin(m->tp.ctx, a->ce_stats, blk, 1));
            op_crossentropy_shard_backward(a->losses + r0, lg, ldl, a->dev_targets + r0, rows, V, m->v0,
                                           a->ce_stats, m->tp_size, scale);
        }
        if (grad && !keep) op_matmul_backward_ld(act_at(a->dxf, r0 * E), glm, lg, ldl, x, wlm, rows, E, V);
    }
    if (grad && !keep) {
        void *dx = m->sp ? a->dxn : a->dxf;  /* the rank's rows of the sum */
        branch_sum(m, dx, a->dxf, N);
        op_zero(a->dres, (size_t)NS * E * ops_act_size());
        op_rmsnorm_backward(a->dres, st_at(unit_grads(m, HU), m->head_out_norm), dx, last, w_out_norm, a->rstdf, NS,
                            E);
        HOOK(h, grad_ready, HU);
    }
    if (tied) HOOK(h, release, UNIT_EMBEDDING);
    HOOK(h, release, HU);
}

/* The head's backward where the forward kept the logits' gradient (a->head_split). input:
 * d(head input) into dres (lm_head's and output_norm's input gradients), for B; weight: the
 * weight gradients of lm_head (tok_embed's when tied) and output_norm, for W. The same
 * products as the fused head's, so the same values. */
static void head_backward(Model *m, const Stage *s, Acts *a, int input, int weight, const UnitHooks *h) {
    int N = (int)a->N, E = m->E, V = m->Vr, HU = unit_head(m), tied = m->c.tie_embeddings;
    int ldl = ops_logit_stride(V);
    const void *last = trunk_output(m, s, a, 1);
    if (input) {
        int before = unit_before_head(m, s);
        HOOK(h, gather, HU, tied ? UNIT_EMBEDDING : before);
        if (tied) HOOK(h, gather, UNIT_EMBEDDING, before);
    }
    if (weight) {
        HOOK(h, grad_begin, HU);
        if (tied) HOOK(h, grad_begin, UNIT_EMBEDDING);
    }
    trace_mark(NULL, input ? "head backward" : "head weight gradients");
    const void *wlm = input ? model_lm_head(m) : NULL;
    const void *w_out_norm = input ? act_at(unit_weights(m, HU), m->head_out_norm) : NULL;
    void *glm = !weight ? NULL : tied ? unit_grads(m, UNIT_EMBEDDING) : st_at(unit_grads(m, HU), m->head_lm);
    if (input) op_zero(a->dxf, (size_t)N * E * ops_act_size());
    for (size_t r0 = 0; r0 < (size_t)N; r0 += a->logit_rows) {
        int rows = (int)((size_t)N - r0 < a->logit_rows ? (size_t)N - r0 : a->logit_rows);
        op_matmul_backward_ld(input ? act_at(a->dxf, r0 * E) : NULL, glm, act_at(a->logits, r0 * (size_t)ldl), ldl,
                              act_at(a->xf, r0 * E), wlm, rows, E, V);
    }
    int NS = (int)held_rows(m, (size_t)N);  /* sequence parallel: the norm's rows are the rank's */
    if (input) {
        void *dx = m->sp ? a->dxn : a->dxf;  /* the rank's rows of the sum over tp */
        branch_sum(m, dx, a->dxf, N);
        if (dx != a->dxf) op_copy(a->dxf, dx, (size_t)NS * E * ops_act_size());  /* dxn: the layers' scratch */
        op_zero(a->dres, (size_t)NS * E * ops_act_size());
    }
    op_rmsnorm_backward(input ? a->dres : NULL, weight ? st_at(unit_grads(m, HU), m->head_out_norm) : NULL, a->dxf,
                        last, w_out_norm, a->rstdf, NS, E);
    if (weight) HOOK(h, grad_ready, HU);
    if (input) {
        if (tied) HOOK(h, release, UNIT_EMBEDDING);
        HOOK(h, release, HU);
    }
}

void model_forward(Model *m, const Stage *s, Acts *a, int grad, float grad_scale, const UnitHooks *h) {
    int B = a->B, T = a->T, N = B * T;
    if (stage_has_embedding(s)) {
        op_upload(a->dev_inputs, a->inputs, (size_t)N * sizeof(int));
        if (grad) {  /* the embedding's backward goes by row */
            a->emb_nr = embedding_rows_index_shard(a->inputs, N, m->v0, m->Vr, a->emb_count, a->emb_index);
            op_upload(a->dev_emb_index, a->emb_index, (2 * (size_t)a->emb_nr + 1 + (size_t)N) * sizeof(int));
        }
    }
    if (stage_has_head(m, s)) op_upload(a->dev_targets, a->targets, (size_t)N * sizeof(int));
    a->grad_scale = grad_scale;
    trunk_forward(m, s, a, B, T, grad, h);
    if (grad) moe_stage_stats(m, a, stage_first_layer(s), stage_n_layers(&m->c, s));
    if (stage_has_head(m, s)) head_forward_backward(m, a, trunk_output(m, s, a, grad), grad, grad_scale, unit_before_head(m, s), h);
    tp_flush(m);
}

void model_backward(Model *m, const Stage *s, Acts *a, const UnitHooks *h) {
    int B = a->B, T = a->T, N = B * T, l0 = stage_first_layer(s), nl = stage_n_layers(&m->c, s);
    int emb = stage_has_embedding(s);
    /* Unless the hooks ask for the embedding last, layer 0's last two weight gradients wait
     * until after the embedding's backward: the embedding's gradient is then not the step's
     * last, and its reduction (the largest unit's, otherwise exposed at the end of the step)
     * overlaps them. */
    int defer = emb && nl > 0 && !(h && h->embed_last);
    LayerActs la0 = {0};  /* layer 0's, set below where it is the stage's (defer) */
    if (a->head_split && stage_has_head(m, s)) head_backward(m, s, a, 1, 1, h);
    trace_mark(NULL, "head done, layers' backward");
    for (int i = nl - 1; i >= 0; i--) {
        int l = l0 + i;
        LayerActs la = layer_acts(m, a, l, a->recompute ? 0 : i, i);
        HOOK(h, gather, unit_of_layer(l), i > 0 ? unit_of_layer(l - 1) : -1);
        if (a->recompute && layer_graphed(m)) layer_run_graphed(m, a, l, &la, NULL, LG_RECOMPUTE, 0);
        else if (a->recompute) layer_forward(m, a, l, &la, B, T, 1);
        HOOK(h, grad_begin, unit_of_layer(l));
        if (trace_active()) {
            char label[48];
            snprintf(label, sizeof label, "layer %d backward", l);
            trace_mark(NULL, label);
        }
        if (layer_graphed(m)) layer_run_graphed(m, a, l, &la, NULL, LG_BACKWARD, i == 0 && defer);
        else layer_backward(m, a, l, &la, i == 0 && defer);
        if (i > 0 || !defer) HOOK(h, grad_ready, unit_of_layer(l));
        HOOK(h, release, unit_of_layer(l));  /* the deferred gradients need no weights */
        if (i == 0) la0 = la;
    }
    tp_flush(m);
    if (!emb) return;  /* dres holds d(loss)/d(the stage's input), for the stage before */
    /* The embedding's backward needs only the tokens, not its parameters. */
    trace_mark(NULL, "embedding backward");
    HOOK(h, grad_begin, UNIT_EMBEDDING);
    op_embedding_backward_rows(unit_grads(m, UNIT_EMBEDDING), seq_gather(m, a->full, a->dres, N), a->dev_emb_index,
                               a->emb_nr, N, m->E);
    HOOK(h, grad_ready, UNIT_EMBEDDING);
    if (defer) {
        trace_mark(NULL, "layer 0 deferred weight gradients");
        layer_backward_deferred(m, a, l0, &la0);
        HOOK(h, grad_ready, unit_of_layer(l0));
    }
    trace_mark(NULL, "backward done");
}

void model_backward_input(Model *m, const Stage *s, Acts *a, void *wbuf, const UnitHooks *h) {
    int l0 = stage_first_layer(s), nl = stage_n_layers(&m->c, s);
    if (a->head_split && stage_has_head(m, s)) head_backward(m, s, a, 1, 0, h);
    for (int i = nl - 1; i >= 0; i--) {
        int l = l0 + i;
        LayerActs la = layer_acts(m, a, l, i, i);
        WGrad wg = wgrad_at(m, wbuf, i, a->N);
        HOOK(h, gather, unit_of_layer(l), i > 0 ? unit_of_layer(l - 1) : -1);
        if (layer_graphed(m)) layer_run_graphed(m, a, l, &la, &wg, LG_INPUT, 0);
        else layer_backward_input(m, a, l, &la, &wg);
        HOOK(h, release, unit_of_layer(l));
    }
    tp_flush(m);
    /* dres now holds d(loss)/d(the stage's input): sent to the stage before, or, on the
     * first stage, the embedding's gradient (taken in the weight pass) */
}

void model_backward_weight(Model *m, const Stage *s, Acts *a, void *wbuf, const UnitHooks *h) {
    int N = a->B * a->T, l0 = stage_first_layer(s), nl = stage_n_layers(&m->c, s);
    if (a->head_split && stage_has_head(m, s)) head_backward(m, s, a, 0, 1, h);
    for (int i = nl - 1; i >= 0; i--) {
        int u = unit_of_layer(l0 + i);
        LayerActs la = layer_acts(m, a, l0 + i, i, i);
        WGrad wg = wgrad_at(m, wbuf, i, a->N);
        HOOK(h, grad_begin, u);
        if (layer_graphed(m)) layer_run_graphed(m, a, l0 + i, &la, &wg, LG_WEIGHT, 0);
        else layer_backward_weight(m, a, l0 + i, &la, &wg);
        HOOK(h, grad_ready, u);
    }
    if (!stage_has_embedding(s)) return;
    HOOK(h, grad_begin, UNIT_EMBEDDING);
    op_embedding_backward_rows(unit_grads(m, UNIT_EMBEDDING), seq_gather(m, a->full, a->dres, N), a->dev_emb_index,
                               a->emb_nr, N, m->E);
    HOOK(h, grad_ready, UNIT_EMBEDDING);
}

void model_last_logits(Model *m, Acts *a, const int *tokens, int T, float *logits) {
    if (T > a->T) die(EXIT_RUN_FAILURE, "internal: %d tokens exceed the planned context %d", T, a->T);
    if (m->tp_size > 1) die(EXIT_RUN_FAILURE, "internal: model_last_logits is for one process");
    op_upload(a->dev_inputs, tokens, (size_t)T * sizeof(int));
    Stage whole = model_whole(m);
    trunk_forward(m, &whole, a, 1, T, 0, NULL);
    const void *last = act_at(trunk_output(m, &whole, a, 0), (size_t)(T - 1) * m->E);
    op_rmsnorm_forward(a->xf, a->rstdf, last, act_at(unit_weights(m, unit_head(m)), m->head_out_norm), 1, m->E,
                       RMS_EPS);
    op_matmul_forward(a->logits, a->xf, model_lm_head(m), 1, m->E, m->V);
    op_download_act(logits, a->logits, (size_t)m->V);
}

