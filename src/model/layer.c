/* layer: one transformer layer's forward, backward, the backward split in two (zero-bubble
 * schedules), and each pass as a recorded graph. */
#include "model_layer.h"
#include <string.h>
#include "layer_graphs.h"
#include "util.h"

LayerActs layer_acts(const Model *m, const Acts *a, int l, int slot, int r) {
    size_t E = m->E, H = m->Ht, Et = (size_t)m->NHt * m->HD;  /* this tensor-parallel rank's widths */
    size_t s = (size_t)slot, NA = a->N, NS = held_rows(m, NA);  /* slots are strided by the planned N */
    LayerActs la = {
        .x = act_at(a->res, (size_t)r * NS * E), .xn1 = act_at(a->xn1, s * NS * E), .rstd1 = a->rstd1 + s * NS,
        .qkv = act_at(a->qkv, s * NA * 3 * Et), .att = act_at(a->att, s * NA * Et),
        .lse = a->lse + s * (size_t)a->B * m->NHt * a->T, .mid = act_at(a->mid, s * NS * E),
        .xn2 = act_at(a->xn2, s * NS * E), .rstd2 = a->rstd2 + s * NS, .out = act_at(a->res, ((size_t)r + 1) * NS * E),
    };
    /* the FFN's: the dense layers' slots and the MoE layers' are numbered apart (the stage's
     * layers before this one of its kind) */
    const ModelConfig *c = &m->c;
    int moe = model_layer_is_moe(c, l), mb = model_moe_layers_before(c, l) - model_moe_layers_before(c, l - slot);
    size_t ks = (size_t)(moe ? mb : slot - mb);
    if (!moe) {
        la.gu = act_at(a->gu, ks * NA * 2 * H), la.hsw = act_at(a->hsw, ks * NA * H);
        return la;
    }
    size_t X = (size_t)m->X, K = (size_t)m->K, Pm = model_moe_max_rows(c, (int)NA), Hs = (size_t)m->Hst;
    MoeActs *q = &la.moe;
    q->logits = a->moe_logits + ks * NA * X, q->probs = a->moe_probs + ks * NA * X;
    q->gate = a->moe_gate + ks * NA * K, q->lse = a->moe_lse + ks * NA, q->idx = a->moe_idx + ks * NA * K;
    q->pos = a->moe_pos + ks * NA * K, q->rowtok = a->moe_rowtok + ks * Pm, q->grow = a->moe_grow + ks * Pm;
    q->cnt = a->moe_cnt + ks * (3 * X + 1), q->hcnt = a->moe_hcnt + ks * MOE_HCNT(X);
    q->gu = act_at(a->moe_gu, ks * model_moe_expert_rows(c, (int)NA, m->ep_size) * 2 * (size_t)m->Het);
    /* the statistics are every MoE layer's of the stage, whatever the slots */
    q->stats = a->moe_stats + (size_t)(model_moe_layers_before(c, l) - model_moe_layers_before(c, l - r)) * (2 * X + 2);
    if (Hs) la.gu = act_at(a->sgu, ks * NA * 2 * Hs), la.hsw = act_at(a->shsw, ks * NA * Hs);
    return la;
}

/* recompute != 0 (activation checkpointing, in the backward): everything the backward
 * reads, but not the layer's output, which is already in the residual stream. On a
 * tensor-parallel rank the heads and FFN units are its own (Et = its heads' width, H = its
 * FFN units), and the two branch outputs are summed over the ranks before the residual;
 * under sequence parallel the norms run on the rank's rows (NS) and their outputs are
 * gathered for the matrix products (a->gath), whose outputs (a->full) are reduce-scattered
 * (product_after, product_then_sum). */
void layer_forward(const Model *m, const Acts *a, int l, const LayerActs *la, int B, int T, int recompute) {
    const void *w = unit_weights(m, unit_of_layer(l));
    const LayerLayout *ly = layer_layout(m, l);
    int N = B * T, NS = (int)held_rows(m, (size_t)N), E = m->E, H = m->Ht, Et = m->NHt * m->HD;
    Tickets ts;
    op_rmsnorm_forward(la->xn1, la->rstd1, la->x, act_at(w, ly->att_norm), NS, E, RMS_EPS);
    const void *xn = seq_gather_begin(m, a->gath, la->xn1, N, &ts);
    product_after(m, &(Product){0, la->qkv, xn, act_at(w, ly->qkv), NULL, E, 3 * Et}, &ts, N);
    op_rope_forward(la->qkv, a->rope_cos, a->rope_sin, B, T, m->NHt, m->HD);
    op_attention_forward(la->att, la->lse, la->qkv, B, T, m->NHt, m->HD);
    void *y = m->sp ? a->full : la->mid;
    product_then_sum(m, &(Product){0, y, la->att, act_at(w, ly->att_out), NULL, Et, E}, la->mid, N, &ts, 0);
    tp_join_all(m, &ts);
    op_add_rmsnorm_forward(la->mid, la->xn2, la->rstd2, la->x, act_at(w, ly->ffn_norm), NS, E, RMS_EPS);
    if (model_layer_is_moe(&m->c, l)) {
        moe_ffn_forward(m, a, l, la, N, recompute);
        return;
    }
    xn = seq_gather_begin(m, a->gath, la->xn2, N, &ts);
    product_after(m, &(Product){0, la->gu, xn, act_at(w, ly->gate_up), NULL, E, 2 * H}, &ts, N);
    op_swiglu_forward(la->hsw, la->gu, N, H);
    if (recompute) return;
    /* the residual is added once: in the product (one rank, tensor-parallel rank 0 under
     * tensor parallel, adds it into the sum), or into the rows each rank holds after the
     * reduce-scatter */
    y = m->sp ? a->full : la->out;
    const void *res = !m->sp ? la->mid : NULL;
    product_then_sum(m, &(Product){0, y, la->hsw, act_at(w, ly->down), res, H, E}, la->out, N, &ts, 0);
    tp_join_all(m, &ts);
    if (m->sp) op_add(la->out, la->mid, (size_t)NS * E);
}

/* dres holds d(loss)/d(layer output) on entry and d(loss)/d(layer input) on return (the
 * rank's rows under sequence parallel, gathered whole into a->full where a product needs
 * them: product_after). defer != 0:
 * leaves out the weight gradients of gate_up and qkv, for layer_backward_deferred (their
 * inputs, dgu and dqkv, stay in the scratch until the next layer_backward). */
void layer_backward(Model *m, Acts *a, int l, const LayerActs *la, int defer) {
    const void *w = unit_weights(m, unit_of_layer(l));
    void *g = unit_grads(m, unit_of_layer(l));
    const LayerLayout *ly = layer_layout(m, l);
    int B = a->B, T = a->T, N = B * T, NS = (int)held_rows(m, (size_t)N), E = m->E, H = m->Ht, Et = m->NHt * m->HD;
    /* The branch gradients (dh, dgu, dxn, datt, dqkv) are written by the _set ops, not zeroed
     * and added to; dres, the residual stream's gradient, accumulates. On a tensor-parallel
     * rank each norm's output gradient (dxn) is summed over the ranks first: the norms'
     * gradients are then the same on every rank (under sequence parallel, each rank's rows'
     * part: summed over the ranks by the strategy, parallel.c). */
    void *dx = m->sp ? a->full : a->dxn;  /* the input gradients of gate_up and qkv, before the sum */
    /* under sequence parallel the norms' outputs, which the weight gradients need whole, are
     * gathered while the products before them run (begun after d's gathers, needed first) */
    Tickets td, gx = {.n = 0, .rot = 0};
    const void *d;
    if (model_layer_is_moe(&m->c, l)) {  /* (its gathers and sums its own) */
        moe_ffn_backward(m, a, l, la);
    } else {
        d = seq_gather_begin(m, a->full, a->dres, N, &td);
        if (!defer) seq_gather_begin(m, a->gath, la->xn2, N, &gx);
        product_after(m, &(Product){1, a->dh, d, act_at(w, ly->down), NULL, H, E}, &td, N);
        op_matmul_backward(NULL, st_at(g, ly->down), d, la->hsw, NULL, N, H, E);
        op_swiglu_backward_set(a->dgu, a->dh, la->gu, N, H);
        input_then_weight(m, a, dx, defer ? NULL : st_at(g, ly->gate_up), a->dgu, m->sp ? a->gath : la->xn2, &gx,
                          act_at(w, ly->gate_up), N, E, 2 * H);
    }
    op_rmsnorm_backward(a->dres, st_at(g, ly->ffn_norm), a->dxn, la->mid, act_at(w, ly->ffn_norm), la->rstd2, NS, E);
    d = seq_gather_begin(m, a->full, a->dres, N, &td);
    if (!defer) seq_gather_begin(m, a->gath, la->xn1, N, &gx);
    product_after(m, &(Product){1, a->datt, d, act_at(w, ly->att_out), NULL, Et, E}, &td, N);
    op_matmul_backward(NULL, st_at(g, ly->att_out), d, la->att, NULL, N, Et, E);
    op_attention_rope_backward_set(a->dqkv, a->datt, la->qkv, la->att, la->lse, a->rope_cos, a->rope_sin, B, T, m->NHt,
                                   m->HD);
    input_then_weight(m, a, dx, defer ? NULL : st_at(g, ly->qkv), a->dqkv, m->sp ? a->gath : la->xn1, &gx,
                      act_at(w, ly->qkv), N, E, 3 * Et);
    op_rmsnorm_backward(a->dres, st_at(g, ly->att_norm), a->dxn, la->x, act_at(w, ly->att_norm), la->rstd1, NS, E);
}

/* The two weight gradients layer_backward(..., defer = 1) left out; they need no weights. (A
 * MoE layer's FFN defers none of its own.) */
void layer_backward_deferred(Model *m, Acts *a, int l, const LayerActs *la) {
    void *g = unit_grads(m, unit_of_layer(l));
    const LayerLayout *ly = layer_layout(m, l);
    int N = a->B * a->T, E = m->E, H = m->Ht, Et = m->NHt * m->HD;
    if (!model_layer_is_moe(&m->c, l))
        op_matmul_backward(NULL, st_at(g, ly->gate_up), a->dgu, seq_gather(m, a->gath, la->xn2, N), NULL, N, E, 2 * H);
    op_matmul_backward(NULL, st_at(g, ly->qkv), a->dqkv, seq_gather(m, a->gath, la->xn1, N), NULL, N, E, 3 * Et);
}

/* ---- layers as recorded graphs (model_use_graphs, layer_graphs.h) ----
 * Only on one tensor-parallel rank, where a layer's ops are the device's alone (no
 * collective, no host wait inside). The key: every pointer the layer's ops read or write
 * and every shape and flag they depend on. */
typedef struct {
    int kind, l, B, T, defer;
    LayerActs la;
    WGrad wg;  /* the split passes' (zero for the others) */
    const void *w, *g, *cos, *sin, *full, *gath, *dres, *dxn, *dh, *dgu, *datt, *dqkv;
} LayerKey;
typedef struct { Model *m; Acts *a; int l, defer; const LayerActs *la; const WGrad *wg; } LayerCall;

static void lg_forward(void *ctx) {
    LayerCall *c = ctx;
    layer_forward(c->m, c->a, c->l, c->la, c->a->B, c->a->T, 0);
}
static void lg_recompute(void *ctx) {
    LayerCall *c = ctx;
    layer_forward(c->m, c->a, c->l, c->la, c->a->B, c->a->T, 1);
}
static void lg_backward(void *ctx) {
    LayerCall *c = ctx;
    layer_backward(c->m, c->a, c->l, c->la, c->defer);
}
static void lg_input(void *ctx) {
    LayerCall *c = ctx;
    layer_backward_input(c->m, c->a, c->l, c->la, c->wg);
}
static void lg_weight(void *ctx) {
    LayerCall *c = ctx;
    layer_backward_weight(c->m, c->a, c->l, c->la, c->wg);
}
/* (not a MoE model's: its layers' products are launched by the routing's counts, read on the host) */
int layer_graphed(const Model *m) { return m->graphs && m->tp_size == 1 && !m->n_moe; }
/* layer l's pass `kind` through its recording; wg: the split passes' set (NULL for the others) */
void layer_run_graphed(Model *m, Acts *a, int l, const LayerActs *la, const WGrad *wg, int kind, int defer) {
    static void (*const fn[])(void *) = {lg_forward, lg_recompute, lg_backward, lg_input, lg_weight};
    LayerKey k;
    memset(&k, 0, sizeof k);  /* (padding too: the key is compared as bytes) */
    k.kind = kind, k.l = l, k.B = a->B, k.T = a->T, k.defer = defer, k.la = *la;
    if (wg) k.wg = *wg;
    k.w = kind == LG_WEIGHT ? NULL : unit_weights(m, unit_of_layer(l));
    k.g = kind == LG_BACKWARD || kind == LG_WEIGHT ? unit_grads(m, unit_of_layer(l)) : NULL;
    k.cos = a->rope_cos, k.sin = a->rope_sin, k.full = a->full, k.gath = a->gath, k.dres = a->dres;
    k.dxn = a->dxn, k.dh = a->dh, k.dgu = a->dgu, k.datt = a->datt, k.dqkv = a->dqkv;
    LayerCall c = {m, a, l, defer, la, wg};
    layer_graphs_run(m->graphs, &k, sizeof k, fn[kind], &c);
}

void model_use_graphs(Model *m, int on) {
    if (on && !m->graphs) m->graphs = layer_graphs_new();
    if (!on) {
        layer_graphs_free(m->graphs);
        m->graphs = NULL;
    }
}

/* ---- the backward split in two (zero-bubble schedules) ----
 * The input-gradient pass computes every d(input) of a layer but no weight gradient, and
 * keeps what the weight gradients need beside the layer's activations: the gradients at
 * the outputs of its four matrix products and at its two norms' outputs (WGrad), one set per
 * layer of the stage. The weight pass then needs neither the weights nor the next layer. */

size_t model_wgrad_bytes(const ModelConfig *c, const Stage *s, int B, int T, size_t act_size) {
    size_t E = c->embed_dim, H = (size_t)(int)(1.5 * c->embed_dim);
    return (size_t)stage_n_layers(c, s) * (size_t)B * T * (7 * E + 2 * H) * act_size;
}

/* (on a tensor-parallel rank dgu and dqkv are its own units' and heads': the set fits in
 * model_wgrad_bytes's) */
WGrad wgrad_at(const Model *m, void *buf, int i, size_t N) {
    size_t E = m->E, H = m->Ht, Et = (size_t)m->NHt * m->HD, per = N * (4 * E + 3 * Et + 2 * H);
    void *b = act_at(buf, (size_t)i * per);
    WGrad w = {b, act_at(b, N * E), act_at(b, N * (E + 2 * H)), act_at(b, N * (2 * E + 2 * H)),
               act_at(b, N * (3 * E + 2 * H)), act_at(b, N * (3 * E + 3 * Et + 2 * H))};
    return w;
}

/* A layer's input-gradient pass (model_backward_input): d(its input) into dres, and the
 * gradients its weight pass needs into wg. */
void layer_backward_input(Model *m, Acts *a, int l, const LayerActs *la, const WGrad *wg) {
    int B = a->B, T = a->T, N = B * T, NS = (int)held_rows(m, (size_t)N), E = m->E, H = m->Ht, Et = m->NHt * m->HD;
    size_t bytes = (size_t)N * E * ops_act_size();
    const LayerLayout *ly = &m->layer;
    const void *w = unit_weights(m, unit_of_layer(l));
    /* (sequence parallel: dout and dmid kept whole, dxn2 and dxn1 the rank's rows) */
    void *dx2 = m->sp ? a->full : wg->dxn2, *dx1 = m->sp ? a->full : wg->dxn1;
    /* d(output) gathered straight into dout (copied without sequence parallel), each
     * block's input gradient computed as it arrives after a fused gather */
    Tickets ts;
    if (!m->sp) op_copy(wg->dout, a->dres, bytes);
    seq_gather_begin(m, wg->dout, a->dres, N, &ts);
    product_after(m, &(Product){1, a->dh, wg->dout, act_at(w, ly->down), NULL, H, E}, &ts, N);
    op_swiglu_backward_set(wg->dgu, a->dh, la->gu, N, H);
    product_then_sum(m, &(Product){1, dx2, wg->dgu, act_at(w, ly->gate_up), NULL, E, 2 * H}, wg->dxn2, N, &ts, 0);
    tp_join_all(m, &ts);
    op_rmsnorm_backward(a->dres, NULL, wg->dxn2, la->mid, act_at(w, ly->ffn_norm), la->rstd2, NS, E);
    if (!m->sp) op_copy(wg->dmid, a->dres, bytes);
    seq_gather_begin(m, wg->dmid, a->dres, N, &ts);
    product_after(m, &(Product){1, a->datt, wg->dmid, act_at(w, ly->att_out), NULL, Et, E}, &ts, N);
    op_attention_rope_backward_set(wg->dqkv, a->datt, la->qkv, la->att, la->lse, a->rope_cos, a->rope_sin, B, T, m->NHt,
                                   m->HD);
    product_then_sum(m, &(Product){1, dx1, wg->dqkv, act_at(w, ly->qkv), NULL, E, 3 * Et}, wg->dxn1, N, &ts, 0);
    tp_join_all(m, &ts);
    op_rmsnorm_backward(a->dres, NULL, wg->dxn1, la->x, act_at(w, ly->att_norm), la->rstd1, NS, E);
}

/* A layer's weight pass (model_backward_weight): its weight gradients from wg and its
 * activations; no weights needed. */
void layer_backward_weight(Model *m, Acts *a, int l, const LayerActs *la, const WGrad *wg) {
    int N = a->B * a->T, NS = (int)held_rows(m, (size_t)N), E = m->E, H = m->Ht, Et = m->NHt * m->HD;
    const LayerLayout *ly = &m->layer;
    void *g = unit_grads(m, unit_of_layer(l));
    op_matmul_backward(NULL, st_at(g, ly->down), wg->dout, la->hsw, NULL, N, H, E);
    op_matmul_backward(NULL, st_at(g, ly->gate_up), wg->dgu, seq_gather(m, a->gath, la->xn2, N), NULL, N, E, 2 * H);
    op_rmsnorm_backward(NULL, st_at(g, ly->ffn_norm), wg->dxn2, la->mid, NULL, la->rstd2, NS, E);
    op_matmul_backward(NULL, st_at(g, ly->att_out), wg->dmid, la->att, NULL, N, Et, E);
    op_matmul_backward(NULL, st_at(g, ly->qkv), wg->dqkv, seq_gather(m, a->gath, la->xn1, N), NULL, N, E, 3 * Et);
    op_rmsnorm_backward(NULL, st_at(g, ly->att_norm), wg->dxn1, la->x, NULL, la->rstd1, NS, E);
}

