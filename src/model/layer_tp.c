/* layer_tp: tensor parallel's collectives around a layer's matrix products - sums and
 * gathers by chunk of rows, fused into the products, in row groups, or in two interleaved
 * halves. */
#include "model_layer.h"
#include "util.h"

int model_tp_keep_gathered(void) { return env_flag("MESHTRAIN_TP_KEEP_GATHERED", 0); }

/* Tensor parallel's collectives. branch_sum: the sum over the tensor-parallel ranks of what
 * each computed from its own heads or FFN units (Megatron-LM's g in the forward, after
 * att_out and down; its conjugate f in the backward, at the input gradients of qkv and
 * gate_up): an all-reduce, or under sequence parallel a reduce-scatter (this rank's rows of
 * the sum), with f's other half an all-gather (seq_gather), so the residual stream and the
 * norms hold N / tp_size rows. Each runs as c collectives, one per chunk of rows (Chunks),
 * so that a product can start on the chunks that have arrived, or the sum of its first
 * chunks travel while it computes the rest (async tensor parallel). */
void tp_flush(const Model *m) {
    if (m->tp_size > 1 && m->tp.flush) m->tp.flush(m->tp.ctx);
}
/* Each collective is begun (tensor.c): the ticket to join before its result is used (-1:
 * none was needed); the plain forms join at once. */
void tp_join(const Model *m, long t) {
    if (t >= 0) m->tp.join(m->tp.ctx, t);
}
void tp_join_all(const Model *m, const Tickets *ts) {
    for (int j = 0; j < ts->n; j++) tp_join(m, ts->t[j]);
}

/* The largest count up to `asked` (and TP_MAX_CHUNKS, Tickets' size) that divides n rows. */
static int rows_count(int asked, size_t n) {
    int c = asked < 1 ? 1 : asked > TP_MAX_CHUNKS ? TP_MAX_CHUNKS : asked;
    while (n % (size_t)c) c--;  /* c = 1 divides anything */
    return c;
}
int model_tp_chunks(const Model *m, size_t N) {
    return m->tp_size > 1 ? rows_count(m->tp_chunks, held_rows(m, N)) : 1;
}
Chunks tp_chunks(const Model *m, int N) {
    int c = model_tp_chunks(m, (size_t)N);
    return (Chunks){c, (size_t)N / (size_t)c, held_rows(m, (size_t)N) / (size_t)c};
}
/* Where this rank's rows of chunk j are among the whole N (the first row); at j * held
 * among its own. */
size_t mine_row(const Model *m, const Chunks *k, int j) {
    return (size_t)j * k->rows + (m->sp ? (size_t)m->tp_rank * k->held : 0);
}

/* Chunk j of the sum over the ranks of src ([N, E], each rank's part) into dst: dst's rows
 * under sequence parallel (src is then scratch), else src itself (dst == src) in place. */
static long branch_sum_chunk(const Model *m, const Chunks *k, void *dst, void *src, int j) {
    size_t E = m->E;
    if (m->sp)
        return m->tp.reduce_scatter_begin(m->tp.ctx, act_at(src, (size_t)j * k->rows * E),
                                          act_at(dst, (size_t)j * k->held * E), k->held * E);
    return m->tp.allreduce_begin(m->tp.ctx, act_at(dst, (size_t)j * k->rows * E), k->rows * E);
}
/* TpRowsFn over a whole [N, E] buffer (branch_sum's, of no product): its rows copied, plus add */
typedef struct { const void *src; size_t E; } RowsOf;
static void copy_rows(const void *arg, size_t r0, size_t rows, void *out, const void *add, int res) {
    (void)res;
    const RowsOf *c = arg;
    const void *from = act_at(c->src, r0 * c->E);
    size_t n = rows * c->E;
    if (out != from) op_copy(out, from, n * ops_act_size());
    if (add) op_add(out, add, n);
}
static void branch_sum_begin(const Model *m, void *dst, void *src, int N, Tickets *ts) {
    ts->n = ts->rot = 0;
    if (m->tp_size == 1) return;
    Chunks k = tp_chunks(m, N);
    if (k.c == 1 && m->tp.fused_sum_begin) {  /* the rows moved by copy engine, summed by op_add */
        RowsOf c = {src, (size_t)m->E};
        long t = m->tp.fused_sum_begin(m->tp.ctx, copy_rows, &c, sizeof c, dst, (size_t)N, (size_t)m->E, m->sp, 0);
        if (t != -1) {
            ts->t[ts->n++] = t;
            return;
        }
    }
    for (int j = 0; j < k.c; j++) ts->t[ts->n++] = branch_sum_chunk(m, &k, dst, src, j);
}
static void halves_sum(const Model *m, void *dst, void *src, size_t N);
static void halves_gather(const Model *m, void *buf, const void *part, size_t N);
void branch_sum(const Model *m, void *dst, void *src, int N) {
    if (model_tp_halves(m, (size_t)N)) {
        halves_sum(m, dst, src, (size_t)N);
        return;
    }
    Tickets ts;
    branch_sum_begin(m, dst, src, N, &ts);
    tp_join_all(m, &ts);
}
/* The whole [N, E] of which this rank holds rows `part` (sequence parallel), gathered into
 * buf chunk by chunk (part == buf: the rank's rows are already in their places there);
 * returns where the whole is: buf, or without sequence parallel `part`, already whole
 * (nothing begun). */
const void *seq_gather_begin(const Model *m, void *buf, const void *part, int N, Tickets *ts) {
    ts->n = ts->rot = 0;
    if (!m->sp) return part;
    Chunks k = tp_chunks(m, N);
    size_t n = k.held * m->E;
    for (int j = 0; j < k.c; j++) {
        void *mine = act_at(buf, mine_row(m, &k, j) * m->E);
        if (part != buf) op_copy(mine, act_at(part, (size_t)j * n), n * ops_act_size());
    }
    /* fused (one chunk): the product starts on this rank's rows while the others' travel */
    if (k.c == 1 && m->tp.fused_gather_begin && m->tp_size <= TP_MAX_CHUNKS &&
        (ts->n = m->tp.fused_gather_begin(m->tp.ctx, buf, (size_t)N, (size_t)m->E, ts->t))) {
        ts->rot = 1;
        return buf;
    }
    /* begun after every copy: the first chunk's product then waits for no later copy */
    for (int j = 0; j < k.c; j++)
        ts->t[ts->n++] = m->tp.allgather_begin(m->tp.ctx, act_at(buf, (size_t)j * k.rows * m->E), n, 0);
    return buf;
}
const void *seq_gather(const Model *m, void *buf, const void *part, int N) {
    if (model_tp_halves(m, (size_t)N)) {
        halves_gather(m, buf, part, (size_t)N);
        return buf;
    }
    Tickets ts;
    const void *whole = seq_gather_begin(m, buf, part, N, &ts);
    tp_join_all(m, &ts);
    return whole;
}
/* Where a layer's norm output is gathered: kept for the backward (xg), or the shared scratch */
void *gath_of(const Acts *a, void *kept) { return kept ? kept : a->gath; }
/* The gathered norm output a weight gradient needs: the kept one, or gathered again */
const void *gathered(const Model *m, const Acts *a, void *kept, const void *part, int N) {
    return kept ? kept : seq_gather(m, a->gath, part, N);
}

static void product_rows(const Product *p, size_t r0, size_t rows) {
    size_t ci = (size_t)(p->bwd ? p->OC : p->C), co = (size_t)(p->bwd ? p->C : p->OC);
    void *out = act_at(p->out, r0 * co);
    const void *inp = act_at(p->inp, r0 * ci);
    if (p->bwd) op_matmul_backward_set(out, NULL, inp, NULL, p->w, (int)rows, p->C, p->OC);
    else if (p->res) op_matmul_forward_add(out, inp, p->w, act_at(p->res, r0 * co), (int)rows, p->C, p->OC);
    else op_matmul_forward(out, inp, p->w, (int)rows, p->C, p->OC);
}
/* Collective, then product: p's input gathered under tickets ts (seq_gather_begin; none:
 * whole already), each chunk's product run as soon as its rows have arrived, while the
 * later chunks still travel. */
void product_after(const Model *m, const Product *p, const Tickets *ts, int N) {
    if (!ts->n) {
        product_rows(p, 0, (size_t)N);
        return;
    }
    if (ts->rot && (p->bwd ? p->C : p->OC) <= m->tp.gather_whole_cols) {
        tp_join_all(m, ts);
        product_rows(p, 0, (size_t)N);
        return;
    }
    Chunks k = tp_chunks(m, N);
    if (ts->rot) k.rows = (size_t)N / (size_t)m->tp_size;
    for (int j = 0; j < ts->n; j++) {
        tp_join(m, ts->t[j]);
        product_rows(p, (size_t)(ts->rot ? (m->tp_rank + j) % m->tp_size : j) * k.rows, k.rows);
    }
}
/* Product, then collective: p's output ([N, E], this rank's part of a branch) summed over
 * the ranks into dst (branch_sum) chunk by chunk, each chunk's sum begun as soon as its
 * product is queued, so that it travels while the next chunk's product runs; ts: the
 * tickets to join before dst is read. At tp_size = 1 the product alone. */
/* TpRowsFn over a Product: rows [r0, r0 + rows) of it into out (rows contiguous), plus add
 * (the others' parts of the sum) or with res the residual */
static void fused_rows(const void *arg, size_t r0, size_t rows, void *out, const void *add, int res) {
    const Product *p = arg;
    const void *inp = act_at(p->inp, r0 * (size_t)(p->bwd ? p->OC : p->C));
    if (p->bwd) {
        if (add) op_matmul_backward_add(out, inp, p->w, add, (int)rows, p->C, p->OC);
        else op_matmul_backward_set(out, NULL, inp, NULL, p->w, (int)rows, p->C, p->OC);
        return;
    }
    const void *plus = add ? add : res && p->res ? act_at(p->res, r0 * (size_t)p->OC) : NULL;
    if (plus) op_matmul_forward_add(out, inp, p->w, plus, (int)rows, p->C, p->OC);
    else op_matmul_forward(out, inp, p->w, (int)rows, p->C, p->OC);
}
/* p->res, the residual, is added once: by tensor-parallel rank 0 into its part (the fused sum
 * puts it into one rank's part of each block). */
void product_then_sum(const Model *m, const Product *p, void *dst, int N, Tickets *ts, int fill) {
    ts->n = ts->rot = 0;
    Chunks k = tp_chunks(m, N);
    if (m->tp_size > 1 && k.c == 1 && m->tp.fused_sum_begin) {
        long t = m->tp.fused_sum_begin(m->tp.ctx, fused_rows, p, sizeof *p, dst, (size_t)N, (size_t)m->E, m->sp, fill);
        if (t != -1) {
            ts->t[ts->n++] = t;
            return;
        }
    }
    Product mine = *p;
    if (m->tp_rank != 0) mine.res = NULL;
    for (int j = 0; j < k.c; j++) {
        product_rows(&mine, (size_t)j * k.rows, k.rows);
        if (m->tp_size > 1) ts->t[ts->n++] = branch_sum_chunk(m, &k, dst, p->out, j);
    }
}

/* A norm's input gradient through gate_up or qkv (dx = dout @ w, into the rank's rows of
 * a->dxn once summed over tp) and that product's weight gradient (dw += dout^T @ inp; NULL:
 * deferred). Under tensor parallel each chunk's sum is begun as soon as its part of dx is,
 * and the weight gradient computed while the sums run (inp, gathered under gx, joined
 * first). */
void input_then_weight(const Model *m, Acts *a, void *dx, void *dw, const void *dout, const void *inp,
                       const Tickets *gx, const void *w, int N, int C, int OC) {
    if (m->tp_size == 1) {
        op_matmul_backward_set(dx, dw, dout, inp, w, N, C, OC);
        return;
    }
    Tickets ts;
    product_then_sum(m, &(Product){1, dx, dout, w, NULL, C, OC}, a->dxn, N, &ts, dw != NULL);
    if (dw) {
        tp_join_all(m, gx);
        op_matmul_backward(NULL, dw, dout, inp, NULL, N, C, OC);
    }
    tp_join_all(m, &ts);
}

/* ---- Two interleaved halves (Model's tp_halves, MESHTRAIN_TP_HALVES=1) ----
 * Under sequence parallel the N rows are two chunks (tp_chunks 2): half h is rows
 * [h N/2, (h+1) N/2) of the gathered buffers, and this rank's NS/2 of them lie at h NS/2 of its
 * own (mine_row). Each collective of a half is one fused sum or gather of its N/2 rows, and
 * the layer runs each section for half 0, then for half 1 (gather both, then each one's
 * product; each one's product and sum, then each one's join and norm), so that one half's
 * transfers travel while the other half's products run, at the sections' seams too, where
 * today's layer waits (everything after a sum needs it). Products after a gather run on the
 * half's rows whole. The same ops on the same rows; weight gradients summed over the two
 * halves. */
int model_tp_halves(const Model *m, size_t N) {
    return m->tp_halves && m->sp && m->tp_size > 1 && m->tp.fused_sum_next && m->tp.fused_gather_begin &&
           model_tp_chunks(m, N) == 2;
}
/* Half h of the whole [N, E] of which this rank holds rows `part`, gathered into buf. */
static void half_gather_begin(const Model *m, void *buf, const void *part, size_t N, int h, Tickets *ts) {
    size_t E = m->E, n = N / 2, held = n / (size_t)m->tp_size;
    void *hb = act_at(buf, (size_t)h * n * E);
    if (part != buf)  /* (part == buf: this rank's rows are in their places already) */
        op_copy(act_at(hb, (size_t)m->tp_rank * held * E), act_at(part, (size_t)h * held * E), held * E * ops_act_size());
    ts->n = m->tp.fused_gather_begin(m->tp.ctx, hb, n, E, ts->t);
    ts->rot = 1;
    if (!ts->n) {
        ts->t[ts->n++] = m->tp.allgather_begin(m->tp.ctx, hb, held * E, 0);
        ts->rot = 0;
    }
}
/* Product p on half h's rows, once its input (gathered under ts) is whole. */
static void half_product(const Model *m, const Product *p, const Tickets *ts, size_t N, int h) {
    tp_join_all(m, ts);
    product_rows(p, (size_t)h * (N / 2), N / 2);
}
/* Half h of product p ([N, E] summed into this rank's rows of dst), begun: a fused sum that
 * may stay pending beside the other half's (fused_sum_next), or the product and a
 * reduce-scatter where the fused sum declines. */
static void half_sum_begin(const Model *m, const Product *p, void *dst, size_t N, int h, Tickets *ts, int fill) {
    size_t E = m->E, n = N / 2, held = n / (size_t)m->tp_size, r0 = (size_t)h * n;
    size_t ci = (size_t)(p->bwd ? p->OC : p->C), co = (size_t)(p->bwd ? p->C : p->OC);
    Product q = *p;
    q.inp = act_at(p->inp, r0 * ci), q.out = act_at(p->out, r0 * co), q.res = p->res ? act_at(p->res, r0 * co) : NULL;
    void *d = act_at(dst, (size_t)h * held * E);
    ts->n = ts->rot = 0;
    long t = m->tp.fused_sum_next(m->tp.ctx, fused_rows, &q, sizeof q, d, n, E, 1, fill);
    if (t == -1) {
        if (m->tp_rank != 0) q.res = NULL;
        product_rows(&q, 0, n);
        t = m->tp.reduce_scatter_begin(m->tp.ctx, q.out, d, held * E);
    }
    ts->t[ts->n++] = t;
}

/* branch_sum's and seq_gather's under tp_halves (the embedding, the head): each half fused */
static void halves_sum(const Model *m, void *dst, void *src, size_t N) {
    size_t E = m->E, n = N / 2, held = n / (size_t)m->tp_size;
    Tickets s[2];
    for (int h = 0; h < 2; h++) {
        RowsOf c = {act_at(src, (size_t)h * n * E), E};
        void *d = act_at(dst, (size_t)h * held * E);
        s[h].n = 1, s[h].rot = 0;
        s[h].t[0] = m->tp.fused_sum_next(m->tp.ctx, copy_rows, &c, sizeof c, d, n, E, 1, 0);
        if (s[h].t[0] == -1) s[h].t[0] = m->tp.reduce_scatter_begin(m->tp.ctx, (void *)c.src, d, held * E);
    }
    for (int h = 0; h < 2; h++) tp_join_all(m, &s[h]);
}
static void halves_gather(const Model *m, void *buf, const void *part, size_t N) {
    Tickets g[2];
    for (int h = 0; h < 2; h++) half_gather_begin(m, buf, part, N, h, &g[h]);
    for (int h = 0; h < 2; h++) tp_join_all(m, &g[h]);
}

/* Half h of hp's sums joined and its residual added (the layer's output rows, the next one's input). */
void halves_pend_join(const Model *m, HalvesPend *hp, size_t N, int h) {
    if (!hp || !hp->on) return;
    size_t E = m->E, hs = held_rows(m, N) / 2;
    tp_join_all(m, &hp->s[h]);
    op_add(act_at(hp->out, (size_t)h * hs * E), act_at(hp->mid, (size_t)h * hs * E), hs * E);
    if (h == 1) hp->on = 0;
}

/* layer_forward's (and its recompute's) under tp_halves. hp (training, where every fused sum
 * makes its parts at its begin, ModelTp's fused_made: the join then reads neither the weights
 * nor the input, which the hooks may release): the layer before's down sums are joined half by
 * half here, each just before its half's norm, and this layer's are left in hp, so that one
 * half's last transfers travel while the other half starts the next layer; NULL: joined here. */
void layer_forward_halves(const Model *m, const Acts *a, int l, const LayerActs *la, int B, int T,
                          int recompute, HalvesPend *hp) {
    const void *w = unit_weights(m, unit_of_layer(l));
    const LayerLayout *ly = &m->layer;
    size_t N = (size_t)B * T, n = N / 2, hs = held_rows(m, N) / 2, E = m->E, H = m->Ht, Et = (size_t)m->NHt * m->HD;
    Tickets g[2], s[2];
    void *gath1 = gath_of(a, la->xg1), *gath2 = gath_of(a, la->xg2);
    for (int h = 0; h < 2; h++) {
        halves_pend_join(m, hp, N, h);
        op_rmsnorm_forward(act_at(la->xn1, h * hs * E), la->rstd1 + h * hs, act_at(la->x, h * hs * E),
                           act_at(w, ly->att_norm), (int)hs, (int)E, RMS_EPS);
        half_gather_begin(m, gath1, la->xn1, N, h, &g[h]);
    }
    for (int h = 0; h < 2; h++)
        half_product(m, &(Product){0, la->qkv, gath1, act_at(w, ly->qkv), NULL, (int)E, (int)(3 * Et)}, &g[h], N, h);
    op_rope_forward(la->qkv, a->rope_cos, a->rope_sin, B, T, m->NHt, m->HD);
    op_attention_forward(la->att, la->lse, la->qkv, B, T, m->NHt, m->HD);
    for (int h = 0; h < 2; h++)
        half_sum_begin(m, &(Product){0, a->full, la->att, act_at(w, ly->att_out), NULL, (int)Et, (int)E}, la->mid, N,
                       h, &s[h], 0);
    for (int h = 0; h < 2; h++) {
        tp_join_all(m, &s[h]);
        op_add_rmsnorm_forward(act_at(la->mid, h * hs * E), act_at(la->xn2, h * hs * E), la->rstd2 + h * hs,
                               act_at(la->x, h * hs * E), act_at(w, ly->ffn_norm), (int)hs, (int)E, RMS_EPS);
        half_gather_begin(m, gath2, la->xn2, N, h, &g[h]);
    }
    HalvesPend mine = {.on = !recompute, .out = la->out, .mid = la->mid};
    for (int h = 0; h < 2; h++) {
        half_product(m, &(Product){0, la->gu, gath2, act_at(w, ly->gate_up), NULL, (int)E, (int)(2 * H)}, &g[h], N, h);
        op_swiglu_forward(act_at(la->hsw, h * n * H), act_at(la->gu, h * n * 2 * H), (int)n, (int)H);
        if (!recompute)
            half_sum_begin(m, &(Product){0, a->full, la->hsw, act_at(w, ly->down), NULL, (int)H, (int)E}, la->out, N,
                           h, &mine.s[h], 0);
    }
    if (hp) *hp = mine;
    else
        for (int h = 0; h < 2; h++) halves_pend_join(m, &mine, N, h);
}

/* input_then_weight's for half h: the sum of dout @ w into the rank's rows of a->dxn begun
 * (s), then dw += dout^T @ inp on the half (inp gathered under gx; dw NULL: deferred). */
static void half_input_then_weight(const Model *m, Acts *a, void *dw, const void *dout, const void *inp,
                                   const Tickets *gx, const void *w, size_t N, int h, int C, int OC, Tickets *s) {
    size_t n = N / 2, r0 = (size_t)h * n;
    half_sum_begin(m, &(Product){1, a->full, dout, w, NULL, C, OC}, a->dxn, N, h, s, dw != NULL);
    if (!dw) return;
    tp_join_all(m, gx);
    op_matmul_backward(NULL, dw, act_at(dout, r0 * (size_t)OC), act_at(inp, r0 * (size_t)C), NULL, (int)n, C, OC);
}
/* Half h of a norm's backward once its output gradient's sum (s) is in a->dxn: into dres. */
static void half_norm_backward(const Model *m, Acts *a, const Tickets *s, void *dw, const void *x, const void *w,
                               const float *rstd, size_t N, int h) {
    size_t E = m->E, hs = held_rows(m, N) / 2, o = (size_t)h * hs * E;
    tp_join_all(m, s);
    op_rmsnorm_backward(act_at(a->dres, o), dw, act_at(a->dxn, o), act_at(x, o), w, rstd + (size_t)h * hs, (int)hs,
                        (int)E);
}

/* layer_backward's under tp_halves. carry (in training without recompute, where a layer comes
 * next in the stage): d(output)'s gathers were begun by the layer after (carry->on), and the
 * gathers of d(input) for the layer before are begun here, each half just after its norm's
 * backward, so that half 0's travels while half 1's sum is joined. */
void layer_backward_halves(Model *m, Acts *a, int l, const LayerActs *la, int defer, HalvesCarry *carry,
                           int more) {
    const void *w = unit_weights(m, unit_of_layer(l));
    void *g = unit_grads(m, unit_of_layer(l));
    const LayerLayout *ly = &m->layer;
    int B = a->B, T = a->T;
    size_t N = (size_t)B * T, n = N / 2, E = m->E, H = m->Ht, Et = (size_t)m->NHt * m->HD;
    Tickets td[2], gx[2], s[2];
    for (int h = 0; h < 2; h++) {
        if (carry && carry->on) td[h] = carry->td[h];
        else half_gather_begin(m, a->full, a->dres, N, h, &td[h]);
        gx[h].n = 0;
        if (!defer && !la->xg2) half_gather_begin(m, a->gath, la->xn2, N, h, &gx[h]);
    }
    for (int h = 0; h < 2; h++) {
        size_t r0 = (size_t)h * n;
        half_product(m, &(Product){1, a->dh, a->full, act_at(w, ly->down), NULL, (int)H, (int)E}, &td[h], N, h);
        op_matmul_backward(NULL, st_at(g, ly->down), act_at(a->full, r0 * E), act_at(la->hsw, r0 * H), NULL, (int)n,
                           (int)H, (int)E);
        op_swiglu_backward_set(act_at(a->dgu, r0 * 2 * H), act_at(a->dh, r0 * H), act_at(la->gu, r0 * 2 * H), (int)n,
                               (int)H);
        half_input_then_weight(m, a, defer ? NULL : st_at(g, ly->gate_up), a->dgu, gath_of(a, la->xg2), &gx[h],
                               act_at(w, ly->gate_up), N, h, (int)E, (int)(2 * H), &s[h]);
    }
    for (int h = 0; h < 2; h++) {
        half_norm_backward(m, a, &s[h], st_at(g, ly->ffn_norm), la->mid, act_at(w, ly->ffn_norm), la->rstd2, N, h);
        half_gather_begin(m, a->full, a->dres, N, h, &td[h]);
    }
    for (int h = 0; h < 2; h++) {
        gx[h].n = 0;
        if (!defer && !la->xg1) half_gather_begin(m, a->gath, la->xn1, N, h, &gx[h]);
    }
    for (int h = 0; h < 2; h++) {
        size_t r0 = (size_t)h * n;
        half_product(m, &(Product){1, a->datt, a->full, act_at(w, ly->att_out), NULL, (int)Et, (int)E}, &td[h], N, h);
        op_matmul_backward(NULL, st_at(g, ly->att_out), act_at(a->full, r0 * E), act_at(la->att, r0 * Et), NULL,
                           (int)n, (int)Et, (int)E);
    }
    op_attention_rope_backward_set(a->dqkv, a->datt, la->qkv, la->att, la->lse, a->rope_cos, a->rope_sin, B, T, m->NHt,
                                   m->HD);
    for (int h = 0; h < 2; h++)
        half_input_then_weight(m, a, defer ? NULL : st_at(g, ly->qkv), a->dqkv, gath_of(a, la->xg1), &gx[h],
                               act_at(w, ly->qkv), N, h, (int)E, (int)(3 * Et), &s[h]);
    for (int h = 0; h < 2; h++) {
        half_norm_backward(m, a, &s[h], st_at(g, ly->att_norm), la->x, act_at(w, ly->att_norm), la->rstd1, N, h);
        if (carry && more) half_gather_begin(m, a->full, a->dres, N, h, &carry->td[h]);
    }
    if (carry) carry->on = more;
}

int model_tp_groups(const Model *m, size_t N) {
    return m->tp_size > 1 && !m->sp ? rows_count(m->tp_groups, N) : 1;
}

/* Tensor parallel without sequence parallel, the forward in G groups of rows (G > 1:
 * model_tp_groups). Every op of a layer but attention works row by row, so each group's
 * all-reduce travels while the next group's products run: att_out's sum of group g beside
 * group g + 1's att_out product and group g - 1's FFN; down's sum of group g beside the FFN
 * of group g + 1 and, for the last group, the next layer's norm and qkv product of the
 * groups before it. pend holds down's sums still travelling: the previous layer's on entry
 * (group g's joined before group g's rows are read), this layer's on return (none with
 * recompute, which stops before down). The same ops on the same rows as layer_forward's,
 * each product on a group's rows. */
void layer_forward_groups(const Model *m, const Acts *a, int l, const LayerActs *la, int B, int T, int G,
                          int recompute, Tickets *pend) {
    const void *w = unit_weights(m, unit_of_layer(l));
    const LayerLayout *ly = &m->layer;
    size_t N = (size_t)B * T, R = N / (size_t)G, E = m->E, H = m->Ht, Et = (size_t)m->NHt * m->HD;
    for (int g = 0; g < G; g++) {
        size_t r0 = (size_t)g * R;
        if (g < pend->n) tp_join(m, pend->t[g]);
        op_rmsnorm_forward(act_at(la->xn1, r0 * E), la->rstd1 + r0, act_at(la->x, r0 * E),
                           act_at(w, ly->att_norm), (int)R, (int)E, RMS_EPS);
        op_matmul_forward(act_at(la->qkv, r0 * 3 * Et), act_at(la->xn1, r0 * E), act_at(w, ly->qkv), (int)R, (int)E,
                          (int)(3 * Et));
    }
    tp_join_all(m, pend);  /* (a count that differed: none left behind) */
    pend->n = 0;
    op_rope_forward(la->qkv, a->rope_cos, a->rope_sin, B, T, m->NHt, m->HD);
    op_attention_forward(la->att, la->lse, la->qkv, B, T, m->NHt, m->HD);
    Tickets t1 = {.n = 0};
    for (int g = 0; g < G; g++) {
        size_t r0 = (size_t)g * R;
        op_matmul_forward(act_at(la->mid, r0 * E), act_at(la->att, r0 * Et), act_at(w, ly->att_out), (int)R, (int)Et,
                          (int)E);
        t1.t[t1.n++] = m->tp.allreduce_begin(m->tp.ctx, act_at(la->mid, r0 * E), R * E);
    }
    for (int g = 0; g < G; g++) {
        size_t r0 = (size_t)g * R;
        tp_join(m, t1.t[g]);
        op_add_rmsnorm_forward(act_at(la->mid, r0 * E), act_at(la->xn2, r0 * E), la->rstd2 + r0, act_at(la->x, r0 * E),
                               act_at(w, ly->ffn_norm), (int)R, (int)E, RMS_EPS);
        op_matmul_forward(act_at(la->gu, r0 * 2 * H), act_at(la->xn2, r0 * E), act_at(w, ly->gate_up), (int)R, (int)E,
                          (int)(2 * H));
        op_swiglu_forward(act_at(la->hsw, r0 * H), act_at(la->gu, r0 * 2 * H), (int)R, (int)H);
        if (recompute) continue;
        /* the residual added once, by tensor-parallel rank 0, into its part of the sum */
        void *out = act_at(la->out, r0 * E);
        if (m->tp_rank == 0)
            op_matmul_forward_add(out, act_at(la->hsw, r0 * H), act_at(w, ly->down), act_at(la->mid, r0 * E), (int)R,
                                  (int)H, (int)E);
        else op_matmul_forward(out, act_at(la->hsw, r0 * H), act_at(w, ly->down), (int)R, (int)H, (int)E);
        pend->t[pend->n++] = m->tp.allreduce_begin(m->tp.ctx, out, R * E);
    }
}

