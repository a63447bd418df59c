/* acts: the activations of a forward and backward - their plan, sizes and allocation. */
#include "model_layer.h"
#include <stdlib.h>
#include <string.h>
#include "util.h"

size_t acts_logit_rows(const ModelConfig *c, int B, int T, size_t act_size) {
    /* About 64 MiB of fp32 logits at a time: the full [N, V] matrix is never held. In bf16
     * (on a GPU) up to 1 GiB, in chunks of equal size: every chunk reads and writes
     * lm_head's whole gradient once (206 MB in fp32 at the post's size: 13 chunks of 256 MiB
     * moved 5.4 GB a step, 4 move 1.6 GB), and larger chunks make its matmuls efficient. */
    size_t budget = act_size == sizeof(float) ? (size_t)64 << 20 : (size_t)1 << 30;
    size_t N = (size_t)B * T, rows = budget / ((size_t)ops_logit_stride(c->vocab_size) * act_size);
    if (rows < 16) rows = 16;
    if (act_size != sizeof(float) && rows < N) {  /* N split evenly: no small last chunk */
        size_t chunks = (N + rows - 1) / rows;
        rows = (N + chunks - 1) / chunks;
        rows = (rows + 63) / 64 * 64;
    }
    /* a multiple of 64 rows: the chunk is the inner dimension of lm_head's weight gradient,
     * and cuBLASLt's fast kernels want it aligned (as the vocabulary showed, ops_cuda.cu) */
    if (rows >= 128) rows = rows / 64 * 64;
    return rows < N ? rows : N;
}

/* One buffer of the plan: where its pointer goes, its length, whether it holds
 * activations (act_size bytes each) or fp32 statistics, and whether tensor parallel's
 * collectives run over it (coll: ModelTp's alloc gives its memory). */
typedef struct { void **p; size_t n; int act, coll; } Slot;

/* One list of buffers shared by acts_bytes and acts_alloc, so the estimate is the plan:
 * for a stage of n_layers layers, with the head's buffers (final norm, logits, losses)
 * where it holds the head. */
static int acts_plan(const ModelConfig *c, int l0, int n_layers, int head, int B, int T, int training,
                     size_t act_size, Acts *a, Slot *s, size_t *logit_n, int tp, int sp, int ep) {
    size_t N = (size_t)B * T, E = c->embed_dim, H = (size_t)(1.5 * c->embed_dim);
    /* logit rows are padded; a tensor-parallel rank's are its vocabulary rows' (the first rank's, the widest) */
    size_t ldl = (size_t)ops_logit_stride(tp > 1 ? model_vocab_padded(c->vocab_size) / tp : c->vocab_size);
    size_t NH = c->n_heads, HD = E / NH;
    /* a tensor-parallel rank: its heads (NH / tp, E / tp wide) and FFN units (H / tp) */
    size_t Et = E / (size_t)tp;
    NH /= (size_t)tp;
    H /= (size_t)tp;
    sp = sp && tp > 1;
    size_t NS = sp ? N / (size_t)tp : N;  /* the rows of the residual stream and the norms */
    /* Training keeps every layer's activations for backward; inference, and training that
     * recomputes them, use one layer's worth. The residual stream keeps every layer's input
     * when training. */
    int keep = training & ACTS_HEAD_SPLIT;
    training &= ~ACTS_HEAD_SPLIT;
    size_t Ls = training == 1 ? (size_t)n_layers : 1, Lr = training ? (size_t)n_layers : 1;
    int layers = n_layers > 0;  /* a stage holding the head alone: no layer's buffers, its input its only slot */
    if (!layers) Ls = Lr = 0;
    size_t rows = head ? acts_logit_rows(c, B, T, act_size) : 0, lrows = head && keep && training ? N : rows;
    /* the stage's MoE layers and dense ones: each kind has its own FFN activations */
    size_t nm = (size_t)(model_moe_layers_before(c, l0 + n_layers) - model_moe_layers_before(c, l0));
    size_t nd = (size_t)n_layers - nm, Lsd = training == 1 ? nd : nd > 0, Lsm = training == 1 ? nm : nm > 0;
    /* (a tensor-parallel rank's: its He / tp of each expert's hidden units, Hs / tp of the shared experts') */
    size_t He = nm ? (size_t)model_moe_expert_dim(c) / (size_t)tp : 0, Hs = He * (size_t)c->moe_shared_experts;
    size_t Hd = Hs > H ? Hs : H;  /* the widest FFN of the stage's backward scratch: the dense one's, or the shared experts' */
    int n = 0;
#define P(field, count) s[n++] = (Slot){&a->field, (count), 1, 0}
#define F(field, count) s[n++] = (Slot){(void **)&a->field, (count), 0, 0}
    /* what the tensor-parallel collectives run over (C): without sequence parallel the
     * residual stream (the embedding's and down_proj's sums, in place), mid (att_out_proj's)
     * and dxn (the input gradients of gate_up and qkv); under it the staging buffers (gath
     * and full: gathers, and the partial sums a reduce-scatter sends) and the head's xf
     * (gathered); dxf (the head input's gradient, summed) in both */
    int nsp = tp > 1 && !sp;
#define C(field, count, on) s[n++] = (Slot){&a->field, (count), 1, (on)}
    C(res, (Lr + 1) * NS * E, nsp);
    if (layers) {
        P(xn1, Ls * NS * E); F(rstd1, Ls * NS); P(qkv, Ls * N * 3 * Et); P(att, Ls * N * Et);
        F(lse, Ls * B * NH * T); C(mid, Ls * NS * E, nsp); P(xn2, Ls * NS * E); F(rstd2, Ls * NS);
        P(gu, Lsd * N * 2 * H); P(hsw, Lsd * N * H);
    }
    if (nm) {
        /* Pm: the rows this rank's tokens send to experts; Rm: the rows its experts take (the
         * same without expert parallel; under it, from every rank of the ep group) */
        size_t X = (size_t)c->moe_experts, K = (size_t)c->moe_top_k, Pm = model_moe_max_rows(c, (int)N);
        size_t Rm = model_moe_expert_rows(c, (int)N, ep), Qm = Pm > Rm ? Pm : Rm;
        F(moe_logits, Lsm * N * X); F(moe_probs, Lsm * N * X); F(moe_gate, Lsm * N * K); F(moe_lse, Lsm * N);
        F(moe_idx, Lsm * N * K); F(moe_pos, Lsm * N * K); F(moe_rowtok, Lsm * Pm); F(moe_grow, Lsm * Pm);
        F(moe_cnt, Lsm * (3 * X + 1)); F(moe_stats, nm * (2 * X + 2));
        P(moe_gu, Lsm * Rm * 2 * He);
        if (Hs) { P(sgu, Lsm * N * 2 * Hs); P(shsw, Lsm * N * Hs); }
        P(moe_xa, Qm * E); P(moe_xb, Qm * E); P(moe_h1, Rm * He); P(moe_h2, Rm * He);
        if (training) { P(moe_dgu, Rm * 2 * He); F(moe_dlogits, N * X); F(moe_dgate, Pm); }
        if (training && ep > 1) F(moe_rgate, 2 * Rm);  /* the experts' rows' gates, and their gradients */
    }
    if (sp && layers) { C(gath, N * E, 1); C(full, N * E, 1); }
    if (head) { C(xf, N * E, sp); F(rstdf, NS); P(logits, lrows * ldl); F(losses, N); }
    if (head && tp > 1) F(ce_stats, (size_t)tp * rows * 3);
    if (layers) { F(rope_cos, (size_t)T * HD / 2); F(rope_sin, (size_t)T * HD / 2); }
    if (training) {
        P(dres, NS * E);
        if (layers) { P(dqkv, N * 3 * Et); P(datt, N * Et); }
        if (head) C(dxf, N * E, tp > 1);
        if (layers) { P(dgu, N * 2 * Hd); P(dh, N * Hd); }  /* (a MoE layer's shared experts' too) */
        C(dxn, NS * E, nsp);  /* (the head's too, under sequence parallel) */
    }
#undef P
#undef F
#undef C
    *logit_n = lrows * ldl;
    return n;
}

/* Besides the plan's buffers: the tokens (inputs, targets) on the host and on the device,
 * and the per-row losses on the host. */
/* inputs and targets (host and op_alloc), host_losses, and the embedding's row index (host
 * and op_alloc, 3N + 1 ints each, with V ints of scratch) */
static size_t acts_extra_bytes(int B, int T, int V) {
    size_t N = (size_t)B * T;
    return N * (4 * sizeof(int) + sizeof(float)) + (2 * (3 * N + 1) + (size_t)V) * sizeof(int);
}

static size_t slot_bytes(const Slot *s, size_t act_size) { return s->n * (s->act ? act_size : sizeof(float)); }

size_t acts_bytes(const ModelConfig *c, int B, int T, int training, size_t act_size, size_t *logit_bytes) {
    Stage whole = {UNIT_EMBEDDING, c->n_layers + 1};
    return acts_bytes_stage(c, &whole, B, T, training, act_size, logit_bytes);
}

size_t acts_bytes_stage(const ModelConfig *c, const Stage *st, int B, int T, int training, size_t act_size,
                        size_t *logit_bytes) {
    return acts_bytes_tp(c, st, B, T, training, act_size, logit_bytes, 1, 0, 1);
}

size_t acts_bytes_tp(const ModelConfig *c, const Stage *st, int B, int T, int training, size_t act_size,
                     size_t *logit_bytes, int tp, int sp, int ep) {
    Acts a;
    Slot s[64];
    size_t logit_n, total = acts_extra_bytes(B, T, c->vocab_size);
    int n = acts_plan(c, stage_first_layer(st), stage_n_layers(c, st), st->last == c->n_layers + 1, B, T, training,
                      act_size, &a, s, &logit_n, tp, sp, ep);
    for (int i = 0; i < n; i++) total += (slot_bytes(&s[i], act_size) + 63) / 64 * 64;
    if (logit_bytes) *logit_bytes = logit_n * act_size;
    return total;
}

size_t acts_tp_coll_extra(const ModelConfig *c, const Stage *st, int B, int T, int training, size_t act_size, int tp,
                          int sp, size_t (*extra)(size_t bytes)) {
    Acts a;
    Slot s[64];
    size_t logit_n, sum = 0;
    int n = acts_plan(c, stage_first_layer(st), stage_n_layers(c, st), st->last == c->n_layers + 1, B, T, training,
                      act_size, &a, s, &logit_n, tp, sp, 1);
    for (int i = 0; i < n; i++)
        if (s[i].coll) sum += extra(slot_bytes(&s[i], act_size));
    return sum;
}

void *model_tp_alloc(const Model *m, size_t bytes) {
    return m->tp_size > 1 && m->tp.alloc ? m->tp.alloc(m->tp.ctx, bytes) : op_alloc(bytes);
}
void model_tp_free(const Model *m, void *p) {
    if (m->tp_size > 1 && m->tp.free) m->tp.free(p);
    else op_free(p);
}

void acts_alloc(Acts *a, const Model *m, int B, int T, int training) {
    Stage whole = model_whole(m);
    acts_alloc_stage(a, m, &whole, B, T, training);
}

void acts_alloc_stage(Acts *a, const Model *m, const Stage *st, int B, int T, int training) {
    memset(a, 0, sizeof *a);
    Slot s[64];
    size_t logit_n;
    int head = stage_has_head(m, st);
    int n = acts_plan(&m->c, stage_first_layer(st), stage_n_layers(&m->c, st), head, B, T, training, ops_act_size(),
                      a, s, &logit_n, m->tp_size, m->sp, m->ep_size);
    a->B = B; a->T = T; a->N = (size_t)B * T;
    a->recompute = (training & ~ACTS_HEAD_SPLIT) == ACTS_RECOMPUTE;
    a->head_split = head && (training & ACTS_HEAD_SPLIT) && (training & ~ACTS_HEAD_SPLIT);
    a->logit_rows = head ? acts_logit_rows(&m->c, B, T, ops_act_size()) : 0;
    a->inputs = xcalloc(a->N, sizeof(int));
    a->targets = xcalloc(a->N, sizeof(int));
    a->host_losses = xcalloc(a->N, sizeof(float));
    a->dev_inputs = op_alloc(a->N * sizeof(int));
    a->dev_targets = op_alloc(a->N * sizeof(int));
    a->emb_index = xcalloc(3 * a->N + 1, sizeof(int));
    a->emb_count = xcalloc((size_t)m->V, sizeof(int));
    a->dev_emb_index = op_alloc((3 * a->N + 1) * sizeof(int));
    a->bytes = acts_extra_bytes(B, T, m->V);
    for (int i = 0; i < n; i++) {
        size_t bytes = slot_bytes(&s[i], ops_act_size());
        *s[i].p = s[i].coll ? model_tp_alloc(m, bytes) : op_alloc(bytes);
        a->bytes += (bytes + 63) / 64 * 64;
    }
    if (m->tp_size > 1 && m->tp.alloc) a->buf_free = m->tp.free;  /* (it frees op_alloc memory too) */
    int l0 = stage_first_layer(st), nm = model_moe_layers_before(&m->c, l0 + stage_n_layers(&m->c, st)) -
                                         model_moe_layers_before(&m->c, l0);
    if (nm) {  /* the dispatch's counts on the host: the experts' products are launched by them */
        int slots = (training & ~ACTS_HEAD_SPLIT) == 1 ? nm : 1;
        a->moe_hcnt = xcalloc((size_t)slots * MOE_HCNT(m->X), sizeof(int));
    }
    if (a->rope_cos) op_rope_tables(a->rope_cos, a->rope_sin, T, m->HD, ROPE_BASE);  /* (none without layers) */
}

void acts_view(Acts *v, const Acts *a, const Model *m, int B) {
    *v = *a;
    v->B = B;
    v->N = (size_t)B * a->T;
    size_t rows = acts_logit_rows(&m->c, B, a->T, ops_act_size());
    v->logit_rows = rows < a->logit_rows ? rows : a->logit_rows;  /* the logits buffer's rows */
}

void acts_free(Acts *a) {
    void *all[] = {a->res, a->xn1, a->rstd1, a->qkv, a->att, a->lse, a->mid, a->xn2,
                   a->rstd2, a->gu, a->hsw, a->xf, a->rstdf, a->logits, a->losses,
                   a->dres, a->dxf, a->dqkv, a->datt, a->dgu, a->dh, a->dxn,
                   a->rope_cos, a->rope_sin, a->ce_stats, a->gath, a->full,
                   a->moe_logits, a->moe_probs, a->moe_gate, a->moe_lse, a->moe_grow, a->moe_stats, a->moe_idx,
                   a->moe_pos, a->moe_rowtok, a->moe_cnt, a->moe_gu, a->sgu, a->shsw, a->moe_xa, a->moe_xb,
                   a->moe_h1, a->moe_h2, a->moe_dgu, a->moe_dlogits, a->moe_dgate, a->moe_rgate};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        if (a->buf_free) a->buf_free(all[i]);
        else op_free(all[i]);
    }
    op_free(a->dev_inputs);
    op_free(a->dev_targets);
    op_free(a->dev_emb_index);
    free(a->emb_index);
    free(a->moe_hcnt);
    free(a->emb_count);
    free(a->inputs);
    free(a->targets);
    free(a->host_losses);
    memset(a, 0, sizeof *a);
}

