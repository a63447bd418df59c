/* layer_moe: a mixture-of-experts layer's FFN, forward and backward, and the state a MoE
 * model keeps beside its parameters (the step's router statistics, the selection biases).
 *
 * Forward: the router's fp32 logits, top-k routing, the dispatch (each expert's tokens one
 * contiguous group of rows), the experts' products on their groups, and the combine (each
 * token's k outputs weighted by their gates, in a fixed order) into the residual stream,
 * beside the shared experts (a dense SwiGLU FFN). The gate multiplies the experts' outputs in
 * the forward; the backward folds it into the down product's input instead (op_moe_gate_backward),
 * so neither the gathered inputs nor the experts' outputs are kept: the backward gathers the
 * rows again, and keeps only the experts' gate|up outputs and the routing.
 *
 * The load-balancing loss (Switch Transformer's: X sum_e f_e P_e, f_e the share of the
 * choices expert e got, P_e its mean normalised score) and the z-loss (the mean squared
 * log-sum-exp of the logits) are the global micro-batch's: their statistics are summed over
 * the data-parallel ranks once per stage and micro-batch (moe_stage_stats), so a layout
 * computes the same losses and gradients as one process on the whole batch.
 *
 * Under tensor parallel (expert tensor parallel, Megatron-LM's) each rank holds He / tp of
 * every expert's hidden units and Hs / tp of the shared experts', split as the dense FFN is,
 * and the router whole. Every rank routes all N tokens alike (the FFN's input gathered whole
 * under sequence parallel), its experts' outputs are its part of a sum over the tp ranks,
 * which joins the dense FFN's (all-reduce, or reduce-scatter under sequence parallel), and so
 * are the input gradients and the gates' gradients (sums over the hidden units). */
#include "model_layer.h"
#include <stdlib.h>
#include <string.h>
#include "util.h"

/* ---- the experts' rows: where they are computed ----
 * Without expert parallel the experts take the dispatch's P rows where they are, one group
 * of rows an expert (off = hcnt[2X ..]). Under it (ep_size ranks, Xl experts each), a rank's
 * rows for rank j's experts (experts j Xl .. (j + 1) Xl - 1: one contiguous block of the
 * dispatch's rows) are exchanged by all-to-all: first their counts, then the rows. A rank's
 * experts then hold R rows from every rank of the group, in rank order and within each by
 * expert: a group of rows per (sender, expert), computed sender by sender. The results go
 * back the same way, into the dispatch's order. */

/* Under expert parallel: the rows each rank of the group sends each of this rank's experts
 * (hcnt[3X + 1 ..]), from the counts every rank's dispatch kept (hcnt[X .. 2X)). */
static void exchange_counts(const Model *m, int *hcnt) {
    int G = m->ep_size, X = m->X;
    size_t *bytes = xmalloc((size_t)G * sizeof *bytes);
    for (int j = 0; j < G; j++) bytes[j] = (size_t)m->Xl * sizeof(int);
    m->moe.exchange(m->moe.ctx, hcnt + X, bytes, hcnt + 3 * X + 1, bytes, "expert-parallel all-to-all (counts)");
    free(bytes);
}

/* The rows of this rank's experts: P (the dispatch's) without expert parallel, else R. */
static int expert_rows(const Model *m, const int *hcnt) {
    if (m->ep_size == 1) return hcnt[3 * m->X];
    int R = 0;
    for (int i = 0; i < m->X; i++) R += hcnt[3 * m->X + 1 + i];
    return R;
}

/* The groups of rows from sender j (one sender without expert parallel): the row they start
 * at, and off[0 .. n] (n experts) from there; returns n. */
static int sender_groups(const Model *m, const int *hcnt, int j, int *base, int *off) {
    int X = m->X;
    if (m->ep_size == 1) {
        memcpy(off, hcnt + 2 * X, ((size_t)X + 1) * sizeof(int));
        *base = 0;
        return X;
    }
    const int *rc = hcnt + 3 * X + 1;
    int b = 0;
    for (int i = 0; i < j * m->Xl; i++) b += rc[i];
    off[0] = 0;
    for (int e = 0; e < m->Xl; e++) off[e + 1] = off[e] + rc[j * m->Xl + e];
    *base = b;
    return m->Xl;
}

/* The experts' products over their rows, sender by sender: forward (out = inp @ w_e^T) or
 * backward (dinp, dw from dout, inp, w; either may be NULL as op_moe_matmul_backward takes). */
static void experts_forward(const Model *m, const int *hcnt, void *out, const void *inp, const void *w, int C, int OC) {
    int *off = xmalloc(((size_t)m->X + 1) * sizeof(int)), base;
    for (int j = 0; j < m->ep_size; j++) {
        int n = sender_groups(m, hcnt, j, &base, off);
        if (off[n])
            op_moe_matmul_forward(act_at(out, (size_t)base * OC), act_at(inp, (size_t)base * C), w,
                                  m->moe_layer.expert_n, off, n, C, OC);
    }
    free(off);
}

static void experts_backward(const Model *m, const int *hcnt, void *dinp, void *dw, const void *dout, const void *inp,
                             const void *w, int C, int OC) {
    int *off = xmalloc(((size_t)m->X + 1) * sizeof(int)), base;
    for (int j = 0; j < m->ep_size; j++) {
        int n = sender_groups(m, hcnt, j, &base, off);
        if (off[n])
            op_moe_matmul_backward(dinp ? act_at(dinp, (size_t)base * C) : NULL, dw, m->moe_layer.expert_n,
                                   act_at(dout, (size_t)base * OC), inp ? act_at(inp, (size_t)base * C) : NULL, w, off,
                                   n, C, OC);
    }
    free(off);
}

/* Under expert parallel: rows of row_bytes from the dispatch's order to the experts' ranks
 * (back = 0), or the experts' rows back into the dispatch's order (back = 1). */
static void exchange_rows(const Model *m, const int *hcnt, const void *send, void *recv, size_t row_bytes, int back,
                          const char *what) {
    int G = m->ep_size, X = m->X, Xl = m->Xl;
    const int *off = hcnt + 2 * X, *rc = hcnt + 3 * X + 1;
    size_t *mine = xmalloc(2 * (size_t)G * sizeof *mine), *theirs = mine + G;
    for (int j = 0; j < G; j++) {
        size_t r = 0;
        for (int e = 0; e < Xl; e++) r += (size_t)rc[j * Xl + e];
        mine[j] = (size_t)(off[(j + 1) * Xl] - off[j * Xl]) * row_bytes;  /* this rank's rows for j's experts */
        theirs[j] = r * row_bytes;                                         /* j's rows for this rank's */
    }
    m->moe.exchange(m->moe.ctx, send, back ? theirs : mine, recv, back ? mine : theirs, what);
    free(mine);
}

void moe_ffn_forward(const Model *m, const Acts *a, int l, const LayerActs *la, int N, int recompute) {
    const LayerLayout *ly = &m->moe_layer;
    const void *w = unit_weights(m, unit_of_layer(l));
    const MoeActs *q = &la->moe;
    int E = m->E, X = m->X, K = m->K, He = m->Het, Hs = m->Hst, ep = m->ep_size > 1;
    size_t row = (size_t)E * ops_act_size();
    const float *bias = m->moe_bias ? m->moe_bias + (size_t)model_moe_layers_before(&m->c, l) * X : NULL;
    const void *xin = seq_gather(m, a->gath, la->xn2, N);  /* the N rows whole */
    op_moe_router_forward(q->logits, xin, act_at(w, ly->router), N, E, X);
    op_moe_topk(q->probs, q->idx, q->gate, q->lse, q->logits, bias, N, X, K, m->c.moe_router_sigmoid);
    op_moe_dispatch(q->cnt, q->pos, q->rowtok, q->grow, q->idx, q->gate, N, K, X, model_moe_capacity(&m->c, N));
    if (!recompute) op_moe_stats(q->stats, q->cnt, q->probs, q->lse, N, X);
    /* the experts' products are launched by their groups' sizes: the host reads them */
    op_download(q->hcnt, q->cnt, (3 * (size_t)X + 1) * sizeof(int));
    if (ep) exchange_counts(m, q->hcnt);
    int P = q->hcnt[3 * X], R = expert_rows(m, q->hcnt);
    /* the experts' input rows: gathered (xa), and under expert parallel exchanged (into xb) */
    op_gather_rows(a->moe_xa, xin, q->rowtok, (size_t)P, row);
    if (ep) exchange_rows(m, q->hcnt, a->moe_xa, a->moe_xb, row, 0, "expert-parallel all-to-all (tokens)");
    experts_forward(m, q->hcnt, q->gu, ep ? a->moe_xb : a->moe_xa, act_at(w, ly->experts), E, 2 * He);
    if (Hs) {
        op_matmul_forward(la->gu, xin, act_at(w, ly->gate_up), N, E, 2 * Hs);
        op_swiglu_forward(la->hsw, la->gu, N, Hs);
    }
    if (recompute) return;
    op_swiglu_forward(a->moe_h1, q->gu, R, He);
    /* the experts' outputs (xb; under expert parallel made in xa and sent back into xb) */
    void *y = ep ? a->moe_xa : a->moe_xb;
    experts_forward(m, q->hcnt, y, a->moe_h1, act_at(w, ly->experts + 2 * (size_t)He * E), He, E);
    if (ep) exchange_rows(m, q->hcnt, y, a->moe_xb, row, 1, "expert-parallel all-to-all (outputs)");
    /* the FFN's output, under tensor parallel this rank's part of the sum (into the staging
     * buffer under sequence parallel); the residual added once, as the dense FFN's: by tp rank
     * 0 into its part, or under sequence parallel into each rank's rows after the sum */
    void *o = m->sp ? a->full : la->out;
    const void *res = m->sp || m->tp_rank ? NULL : la->mid;
    if (Hs && res) op_matmul_forward_add(o, la->hsw, act_at(w, ly->down), res, N, Hs, E);
    else if (Hs) op_matmul_forward(o, la->hsw, act_at(w, ly->down), N, Hs, E);
    else if (res) op_copy(o, res, (size_t)N * row);
    else op_zero(o, (size_t)N * row);
    op_moe_combine(o, a->moe_xb, q->gate, q->pos, N, K, E);
    if (m->tp_size == 1) return;
    branch_sum(m, la->out, o, N);
    if (m->sp) op_add(la->out, la->mid, held_rows(m, (size_t)N) * E);
}

void moe_ffn_backward(Model *m, Acts *a, int l, const LayerActs *la) {
    const LayerLayout *ly = &m->moe_layer;
    const void *w = unit_weights(m, unit_of_layer(l));
    void *g = unit_grads(m, unit_of_layer(l));
    const MoeActs *q = &la->moe;
    int N = (int)a->N, E = m->E, X = m->X, K = m->K, He = m->Het, Hs = m->Hst, ep = m->ep_size > 1;
    size_t row = (size_t)E * ops_act_size(), down = ly->experts + 2 * (size_t)He * E;
    int P = q->hcnt[3 * X], R = expert_rows(m, q->hcnt);
    size_t Rm = ep ? model_moe_expert_rows(&m->c, (int)a->N, m->ep_size) : 0;
    /* d(loss)/d(the FFN's output) and the FFN's input, whole (gathered under sequence
     * parallel); dx: the input gradient, under tensor parallel this rank's part of the sum
     * into dxn (in the staging buffer under sequence parallel, where dout was: dout's last
     * reader, the shared experts' down product, runs before dx is written) */
    const void *dout = seq_gather(m, a->full, a->dres, N), *xin = seq_gather(m, a->gath, la->xn2, N);
    void *dx = m->sp ? a->full : a->dxn;
    /* the routed experts: d(ungated output) per row, through the down product; the gates'
     * gradient, and the gate folded into the down product's input and its gradient. Under
     * expert parallel the rows' output gradients and gates go to the experts' ranks, and the
     * input gradients and the gates' gradients come back. */
    op_gather_rows(a->moe_xa, dout, q->rowtok, (size_t)P, row);
    if (Hs) {  /* the shared experts: their input gradient written into dx */
        op_matmul_backward_set(a->dh, st_at(g, ly->down), dout, la->hsw, act_at(w, ly->down), N, Hs, E);
        op_swiglu_backward_set(a->dgu, a->dh, la->gu, N, Hs);
        op_matmul_backward_set(dx, st_at(g, ly->gate_up), a->dgu, xin, act_at(w, ly->gate_up), N, E, 2 * Hs);
    }
    const void *dy = a->moe_xa;
    const float *gates = q->grow;
    float *dgates = a->moe_dgate;
    if (ep) {
        exchange_rows(m, q->hcnt, a->moe_xa, a->moe_xb, row, 0, "expert-parallel all-to-all (output gradients)");
        exchange_rows(m, q->hcnt, q->grow, a->moe_rgate, sizeof(float), 0, "expert-parallel all-to-all (gates)");
        dy = a->moe_xb, gates = a->moe_rgate, dgates = a->moe_rgate + Rm;
    }
    experts_backward(m, q->hcnt, a->moe_h1, NULL, dy, NULL, act_at(w, down), He, E);
    op_swiglu_forward(a->moe_h2, q->gu, R, He);
    op_moe_gate_backward(dgates, a->moe_h2, a->moe_h1, gates, R, He);
    experts_backward(m, q->hcnt, NULL, st_at(g, down), dy, a->moe_h2, NULL, He, E);
    op_swiglu_backward_set(a->moe_dgu, a->moe_h1, q->gu, R, He);
    /* the experts' input rows again (the forward kept none): into xb, or under expert
     * parallel gathered into xa (sent) and exchanged into xb */
    op_gather_rows(ep ? a->moe_xa : a->moe_xb, xin, q->rowtok, (size_t)P, row);
    if (ep) exchange_rows(m, q->hcnt, a->moe_xa, a->moe_xb, row, 0, "expert-parallel all-to-all (tokens)");
    experts_backward(m, q->hcnt, a->moe_xa, st_at(g, ly->experts), a->moe_dgu, a->moe_xb, act_at(w, ly->experts), E,
                     2 * He);
    const void *dxs = a->moe_xa;
    if (ep) {
        exchange_rows(m, q->hcnt, a->moe_xa, a->moe_xb, row, 1, "expert-parallel all-to-all (input gradients)");
        exchange_rows(m, q->hcnt, dgates, a->moe_dgate, sizeof(float), 1, "expert-parallel all-to-all (gate gradients)");
        dxs = a->moe_xb;
    }
    op_moe_unpermute(dx, dxs, q->pos, N, K, E, Hs > 0);
    if (m->tp_size > 1) {
        /* the gates' gradients <dh, h> summed over the hidden units of every tp rank: the
         * router's gradients are then the same on each */
        tp_join(m, m->tp.allreduce_begin(m->tp.ctx, a->moe_dgate, (size_t)P, 1));
        branch_sum(m, a->dxn, dx, N);
    }
    /* the router: the gates', the load-balancing loss's and the z-loss's gradients. Each
     * rank's gradient is averaged over the data-parallel ranks afterwards, so it carries dp
     * times its share of the global micro-batch's losses (whose means run over N dp rows). */
    double Ng = (double)N * m->moe.dp;
    float aux_scale = (float)(m->moe_aux * X / (Ng * K * N) * a->grad_scale);
    float z_scale = (float)(m->moe_z * 2.0 / N * a->grad_scale);
    op_moe_route_backward(a->moe_dlogits, a->moe_dgate, q->pos, q->logits, q->probs, q->idx, q->gate, q->lse, q->stats,
                          aux_scale, z_scale, N, X, K, m->c.moe_router_sigmoid);
    /* Its weight's and input's gradients from the rows this rank holds, after the sum over tp:
     * under sequence parallel its own rows (the strategy sums the replicated weights' gradients
     * over tp, as the norms'), else all of them, alike on every rank (as the norms' too). */
    size_t NS = held_rows(m, (size_t)N), r0 = m->sp ? (size_t)m->tp_rank * NS : 0;
    op_moe_router_backward(a->dxn, st_at(g, ly->router), a->moe_dlogits + r0 * X, act_at(xin, r0 * E),
                           act_at(w, ly->router), (int)NS, E, X);
}

void moe_stage_stats(const Model *m, const Acts *a, int l0, int n) {
    const ModelConfig *c = &m->c;
    int first = model_moe_layers_before(c, l0), nm = model_moe_layers_before(c, l0 + n) - first, X = m->X;
    if (nm <= 0) return;
    if (m->moe.allreduce) m->moe.allreduce(m->moe.ctx, a->moe_stats, (size_t)nm * (2 * (size_t)X + 2));
    if (!m->moe_acc) return;
    int rows = (int)a->N * m->moe.dp;
    for (int i = 0; i < nm; i++)
        op_moe_accumulate(m->moe_acc + (size_t)(first + i) * (X + 3), a->moe_stats + (size_t)i * (2 * X + 2), rows, X,
                          m->K);
}

void model_moe_alloc(Model *m, int bias) {
    if (!m->n_moe) return;
    m->moe_acc = op_alloc((size_t)m->n_moe * (m->X + 3) * sizeof(float));
    if (bias) {
        m->moe_bias = op_alloc((size_t)m->n_moe * m->X * sizeof(float));
        m->moe_bias_host = xcalloc((size_t)m->n_moe * m->X, sizeof(float));
    }
}

void model_moe_free(Model *m) {
    op_free(m->moe_acc);
    op_free(m->moe_bias);
    free(m->moe_bias_host);
    m->moe_acc = m->moe_bias = m->moe_bias_host = NULL;
}

void model_moe_set_training(Model *m, float aux, float z, float bias_rate) {
    m->moe_aux = aux, m->moe_z = z, m->moe_bias_rate = bias_rate;
}

void model_moe_set_bias(Model *m, const float *host) {
    if (!m->moe_bias) return;
    size_t bytes = (size_t)m->n_moe * m->X * sizeof(float);
    if (host != m->moe_bias_host) memcpy(m->moe_bias_host, host, bytes);
    op_upload(m->moe_bias, m->moe_bias_host, bytes);
}

void model_moe_balance(Model *m, const double *stats) {
    float rate = m->moe_bias_rate;
    if (!m->moe_bias || rate <= 0) return;
    int X = m->X;
    for (int i = 0; i < m->n_moe; i++) {
        const double *load = stats + (size_t)i * (X + 3);
        double mean = 0;
        for (int e = 0; e < X; e++) mean += load[e];
        mean /= X;
        float *b = m->moe_bias_host + (size_t)i * X;
        for (int e = 0; e < X; e++) b[e] += load[e] < mean ? rate : load[e] > mean ? -rate : 0.0f;
    }
    model_moe_set_bias(m, m->moe_bias_host);
}

void model_moe_take_stats(Model *m, float *host) {
    size_t bytes = (size_t)m->n_moe * (m->X + 3) * sizeof(float);
    if (!m->moe_acc || !bytes) return;
    op_download(host, m->moe_acc, bytes);
    op_zero(m->moe_acc, bytes);
}
