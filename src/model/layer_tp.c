/* layer_tp: tensor parallel's collectives around a layer's matrix products - one collective
 * each, or the sums and gathers fused into the products (ModelTp's fused_sum_begin and
 * fused_gather_begin). */
#include "model_layer.h"

/* Tensor parallel's collectives. branch_sum: the sum over the tensor-parallel ranks of what
 * each computed from its own heads or FFN units (Megatron-LM's g in the forward, after
 * att_out and down; its conjugate f in the backward, at the input gradients of qkv and
 * gate_up): an all-reduce, or under sequence parallel a reduce-scatter (this rank's rows of
 * the sum), with f's other half an all-gather (seq_gather), so the residual stream and the
 * norms hold N / tp_size rows. */
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

/* The sum over the ranks of src ([N, E], each rank's part) into dst by a collective: dst's
 * rows under sequence parallel (src is then scratch), else src itself (dst == src) in place. */
static long branch_sum_collective(const Model *m, void *dst, void *src, int N) {
    size_t E = m->E;
    if (m->sp) return m->tp.reduce_scatter_begin(m->tp.ctx, src, dst, held_rows(m, (size_t)N) * E);
    return m->tp.allreduce_begin(m->tp.ctx, dst, (size_t)N * E, 0);
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
void branch_sum(const Model *m, void *dst, void *src, int N) {
    if (m->tp_size == 1) return;
    long t = -1;
    if (m->tp.fused_sum_begin) {  /* the rows moved by copy engine, summed by op_add */
        RowsOf c = {src, (size_t)m->E};
        t = m->tp.fused_sum_begin(m->tp.ctx, copy_rows, &c, sizeof c, dst, (size_t)N, (size_t)m->E, m->sp, 0);
    }
    if (t == -1) t = branch_sum_collective(m, dst, src, N);
    tp_join(m, t);
}
/* The whole [N, E] of which this rank holds rows `part` (sequence parallel), gathered into
 * buf (part == buf: the rank's rows are already in their place there); returns where the
 * whole is: buf, or without sequence parallel `part`, already whole (nothing begun). */
const void *seq_gather_begin(const Model *m, void *buf, const void *part, int N, Tickets *ts) {
    ts->n = ts->rot = 0;
    if (!m->sp) return part;
    size_t n = held_rows(m, (size_t)N) * m->E;
    if (part != buf) op_copy(act_at(buf, (size_t)m->tp_rank * n), part, n * ops_act_size());
    /* fused: the product starts on this rank's rows while the others' travel */
    if (m->tp.fused_gather_begin && m->tp_size <= TP_MAX_TICKETS &&
        (ts->n = m->tp.fused_gather_begin(m->tp.ctx, buf, (size_t)N, (size_t)m->E, ts->t))) {
        ts->rot = 1;
        return buf;
    }
    ts->t[ts->n++] = m->tp.allgather_begin(m->tp.ctx, buf, n, 0);
    return buf;
}
const void *seq_gather(const Model *m, void *buf, const void *part, int N) {
    Tickets ts;
    const void *whole = seq_gather_begin(m, buf, part, N, &ts);
    tp_join_all(m, &ts);
    return whole;
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
 * whole already). After a fused gather each block's product runs as soon as its rows have
 * arrived, this rank's own first, while the later blocks still travel. */
void product_after(const Model *m, const Product *p, const Tickets *ts, int N) {
    if (!ts->rot) {
        tp_join_all(m, ts);
        product_rows(p, 0, (size_t)N);
        return;
    }
    size_t R = (size_t)N / (size_t)m->tp_size;
    for (int j = 0; j < ts->n; j++) {
        tp_join(m, ts->t[j]);
        product_rows(p, (size_t)((m->tp_rank + j) % m->tp_size) * R, R);
    }
}
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
/* Product, then collective: p's output ([N, E], this rank's part of a branch) summed over
 * the ranks into dst (branch_sum); ts: the tickets to join before dst is read. At
 * tp_size = 1 the product alone. p->res, the residual, is added once: by tensor-parallel
 * rank 0 into its part (the fused sum puts it into one rank's part of each block). */
void product_then_sum(const Model *m, const Product *p, void *dst, int N, Tickets *ts, int fill) {
    ts->n = ts->rot = 0;
    if (m->tp_size > 1 && m->tp.fused_sum_begin) {
        long t = m->tp.fused_sum_begin(m->tp.ctx, fused_rows, p, sizeof *p, dst, (size_t)N, (size_t)m->E, m->sp, fill);
        if (t != -1) {
            ts->t[ts->n++] = t;
            return;
        }
    }
    Product mine = *p;
    if (m->tp_rank != 0) mine.res = NULL;
    product_rows(&mine, 0, (size_t)N);
    if (m->tp_size > 1) ts->t[ts->n++] = branch_sum_collective(m, dst, p->out, N);
}

/* A norm's input gradient through gate_up or qkv (dx = dout @ w, into the rank's rows of
 * a->dxn once summed over tp) and that product's weight gradient (dw += dout^T @ inp; NULL:
 * deferred). Under tensor parallel the sum is begun as soon as dx is, and the weight
 * gradient computed while it runs (inp, gathered under gx, joined first). */
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
