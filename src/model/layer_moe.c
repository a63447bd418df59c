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
 * computes the same losses and gradients as one process on the whole batch. */
#include "model_layer.h"
#include <stdlib.h>
#include <string.h>
#include "util.h"

void moe_ffn_forward(const Model *m, const Acts *a, int l, const LayerActs *la, int N, int recompute) {
    const LayerLayout *ly = &m->moe_layer;
    const void *w = unit_weights(m, unit_of_layer(l));
    const MoeActs *q = &la->moe;
    int E = m->E, X = m->X, K = m->K, He = m->He, Hs = m->Hs;
    size_t row = (size_t)E * ops_act_size();
    const float *bias = m->moe_bias ? m->moe_bias + (size_t)model_moe_layers_before(&m->c, l) * X : NULL;
    op_moe_router_forward(q->logits, la->xn2, act_at(w, ly->router), N, E, X);
    op_moe_topk(q->probs, q->idx, q->gate, q->lse, q->logits, bias, N, X, K, m->c.moe_router_sigmoid);
    op_moe_dispatch(q->cnt, q->pos, q->rowtok, q->grow, q->idx, q->gate, N, K, X, model_moe_capacity(&m->c, N));
    if (!recompute) op_moe_stats(q->stats, q->cnt, q->probs, q->lse, N, X);
    /* the experts' products are launched by their groups' sizes: the host reads them */
    op_download(q->hcnt, q->cnt, (3 * (size_t)X + 1) * sizeof(int));
    const int *off = q->hcnt + 2 * X;
    int P = off[X];
    op_gather_rows(a->moe_xa, la->xn2, q->rowtok, (size_t)P, row);
    op_moe_matmul_forward(q->gu, a->moe_xa, act_at(w, ly->experts), ly->expert_n, off, X, E, 2 * He);
    if (Hs) {
        op_matmul_forward(la->gu, la->xn2, act_at(w, ly->gate_up), N, E, 2 * Hs);
        op_swiglu_forward(la->hsw, la->gu, N, Hs);
    }
    if (recompute) return;
    op_swiglu_forward(a->moe_h1, q->gu, P, He);
    op_moe_matmul_forward(a->moe_xb, a->moe_h1, act_at(w, ly->experts + 2 * (size_t)He * E), ly->expert_n, off, X, He,
                          E);
    if (Hs) op_matmul_forward_add(la->out, la->hsw, act_at(w, ly->down), la->mid, N, Hs, E);
    else op_copy(la->out, la->mid, (size_t)N * row);
    op_moe_combine(la->out, a->moe_xb, q->gate, q->pos, N, K, E);
}

void moe_ffn_backward(Model *m, Acts *a, int l, const LayerActs *la) {
    const LayerLayout *ly = &m->moe_layer;
    const void *w = unit_weights(m, unit_of_layer(l));
    void *g = unit_grads(m, unit_of_layer(l));
    const MoeActs *q = &la->moe;
    int N = (int)a->N, E = m->E, X = m->X, K = m->K, He = m->He, Hs = m->Hs;
    size_t row = (size_t)E * ops_act_size(), down = ly->experts + 2 * (size_t)He * E;
    const int *off = q->hcnt + 2 * X;
    int P = off[X];
    const void *dout = a->dres;  /* d(loss)/d(the FFN's output) */
    if (Hs) {  /* the shared experts: their input gradient written into dxn */
        op_matmul_backward_set(a->dh, st_at(g, ly->down), dout, la->hsw, act_at(w, ly->down), N, Hs, E);
        op_swiglu_backward_set(a->dgu, a->dh, la->gu, N, Hs);
        op_matmul_backward_set(a->dxn, st_at(g, ly->gate_up), a->dgu, la->xn2, act_at(w, ly->gate_up), N, E, 2 * Hs);
    }
    /* the routed experts: d(ungated output) per row, through the down product; the gates'
     * gradient, and the gate folded into the down product's input and its gradient */
    op_gather_rows(a->moe_xa, dout, q->rowtok, (size_t)P, row);
    op_moe_matmul_backward(a->moe_h1, NULL, ly->expert_n, a->moe_xa, NULL, act_at(w, down), off, X, He, E);
    op_swiglu_forward(a->moe_h2, q->gu, P, He);
    op_moe_gate_backward(a->moe_dgate, a->moe_h2, a->moe_h1, q->grow, P, He);
    op_moe_matmul_backward(NULL, st_at(g, down), ly->expert_n, a->moe_xa, a->moe_h2, NULL, off, X, He, E);
    op_swiglu_backward_set(a->moe_dgu, a->moe_h1, q->gu, P, He);
    op_gather_rows(a->moe_xb, la->xn2, q->rowtok, (size_t)P, row);
    op_moe_matmul_backward(a->moe_xa, st_at(g, ly->experts), ly->expert_n, a->moe_dgu, a->moe_xb,
                           act_at(w, ly->experts), off, X, E, 2 * He);
    op_moe_unpermute(a->dxn, a->moe_xa, q->pos, N, K, E, Hs > 0);
    /* the router: the gates', the load-balancing loss's and the z-loss's gradients. Each
     * rank's gradient is averaged over the data-parallel ranks afterwards, so it carries dp
     * times its share of the global micro-batch's losses (whose means run over N dp rows). */
    double Ng = (double)N * m->moe.dp;
    float aux_scale = (float)(m->moe_aux * X / (Ng * K * N) * a->grad_scale);
    float z_scale = (float)(m->moe_z * 2.0 / N * a->grad_scale);
    op_moe_route_backward(a->moe_dlogits, a->moe_dgate, q->pos, q->logits, q->probs, q->idx, q->gate, q->lse, q->stats,
                          aux_scale, z_scale, N, X, K, m->c.moe_router_sigmoid);
    op_moe_router_backward(a->dxn, st_at(g, ly->router), a->moe_dlogits, la->xn2, act_at(w, ly->router), N, E, X);
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
