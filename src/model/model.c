#include "model.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "layer_graphs.h"
#include "ops.h"
#include "trace.h"
#include "util.h"

#define RMS_EPS MODEL_RMS_EPS
#define ROPE_BASE MODEL_ROPE_BASE

/* A layer's parameters on one of tp tensor-parallel ranks (tp = 1: the whole layer). */
static size_t layer_param_count_tp(const ModelConfig *c, int tp) {
    size_t E = (size_t)c->embed_dim, H = (size_t)(1.5 * c->embed_dim), Et = E / (size_t)tp, Ht = H / (size_t)tp;
    return 2 * E + 3 * Et * E + E * Et + 2 * Ht * E + E * Ht;
}
static size_t layer_param_count(const ModelConfig *c) { return layer_param_count_tp(c, 1); }

size_t model_param_count(const ModelConfig *c) {
    size_t VE = (size_t)c->vocab_size * c->embed_dim;
    return VE + (size_t)c->n_layers * layer_param_count(c) + c->embed_dim + (c->tie_embeddings ? 0 : VE);
}

static size_t round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

int model_tp_check(const ModelConfig *c, int tp, char *err, size_t errlen) {
    int ffn = (int)(1.5 * c->embed_dim), vp = model_vocab_padded(c->vocab_size);
    if (tp < 1) return set_err(err, errlen, "tensor_parallel_size=%d is not positive", tp);
    if (c->n_heads % tp) return set_err(err, errlen, "tensor_parallel_size=%d does not divide n_heads=%d", tp, c->n_heads);
    if (ffn % tp)
        return set_err(err, errlen, "tensor_parallel_size=%d does not divide the FFN width 1.5 x embed_dim = %d", tp, ffn);
    if (tp == 1) return 0;
    if (vp % tp)
        return set_err(err, errlen, "tensor_parallel_size=%d does not divide the padded vocabulary %d (vocab_size=%d "
                       "rounded up to a multiple of 64)", tp, vp, c->vocab_size);
    if ((tp - 1) * (vp / tp) >= c->vocab_size)  /* the last rank's rows would all be padding */
        return set_err(err, errlen, "tensor_parallel_size=%d leaves the last rank no vocabulary rows (vocab_size=%d, "
                       "%d rows a rank)", tp, c->vocab_size, vp / tp);
    return 0;
}

void model_init_layout(Model *m, const ModelConfig *c, int pad_multiple, int alloc) {
    model_init_layout_stage(m, c, pad_multiple, alloc, NULL, 0);
}

/* Whether stages s[0..n) (NULL: the whole model) hold unit u: their own, and lm_head's copy
 * of a tied embedding on the stage with the head. */
static int stage_holds(const ModelConfig *c, const Stage *s, int n, int u) {
    if (!s) return 1;
    for (int i = 0; i < n; i++)
        if ((u >= s[i].first && u <= s[i].last) ||
            (u == UNIT_EMBEDDING && c->tie_embeddings && s[i].last == c->n_layers + 1))
            return 1;
    return 0;
}

void model_init_layout_stage(Model *m, const ModelConfig *c, int pad_multiple, int alloc, const Stage *s, int n_stages) {
    model_init_layout_tp(m, c, pad_multiple, alloc, s, n_stages, 1, 0);
}

void model_init_layout_tp(Model *m, const ModelConfig *c, int pad_multiple, int alloc, const Stage *s, int n_stages,
                          int tp_size, int tp_rank) {
    memset(m, 0, sizeof *m);
    m->c = *c;
    m->E = c->embed_dim; m->NH = c->n_heads; m->HD = c->embed_dim / c->n_heads;
    m->H = (int)(1.5 * c->embed_dim); m->V = c->vocab_size; m->L = c->n_layers;
    char err[256];
    if (tp_rank < 0 || tp_rank >= tp_size || model_tp_check(c, tp_size, err, sizeof err))
        die(EXIT_RUN_FAILURE, "internal: tensor-parallel rank %d of %d: %s", tp_rank, tp_size, err);
    m->tp_size = tp_size; m->tp_rank = tp_rank;
    m->NHt = m->NH / tp_size; m->Ht = m->H / tp_size;
    m->Vt = tp_size == 1 ? m->V : model_vocab_padded(m->V) / tp_size;
    m->v0 = tp_rank * m->Vt;
    m->Vr = m->V - m->v0 < m->Vt ? m->V - m->v0 : m->Vt;
    size_t E = m->E, Et = (size_t)m->NHt * m->HD, Ht = m->Ht, V = m->V, Vr = (size_t)m->Vr;
    LayerLayout *ly = &m->layer;
    ly->att_norm = 0;
    ly->qkv = ly->att_norm + E;
    ly->att_out = ly->qkv + 3 * Et * E;
    ly->ffn_norm = ly->att_out + E * Et;
    ly->gate_up = ly->ffn_norm + E;
    ly->down = ly->gate_up + 2 * Ht * E;
    m->head_out_norm = 0;
    m->head_lm = E;

    m->n_units = m->L + 2;
    m->units = xcalloc((size_t)m->n_units, sizeof(Unit));
    /* Each unit divides by the data-parallel size and stays 64-byte aligned: lcm(16, pad). */
    size_t pad = (size_t)(pad_multiple > 0 ? pad_multiple : 1), a = 16, b = pad;
    while (b) { size_t t = a % b; a = b; b = t; }
    pad = 16 * pad / a;
    size_t off = 0, packed = 0;
    m->packed = xcalloc((size_t)m->n_units, sizeof(size_t));
    for (int u = 0; u < m->n_units; u++) {
        size_t n = u == 0 ? V * E : u <= m->L ? layer_param_count(c) : E + (c->tie_embeddings ? 0 : V * E);
        m->packed[u] = packed;
        packed += n;
        m->n_params += n;
        /* this rank's slices, and its vocabulary rows */
        n = u == 0 ? Vr * E : u <= m->L ? layer_param_count_tp(c, tp_size) : E + (c->tie_embeddings ? 0 : Vr * E);
        if (!stage_holds(c, s, n_stages, u)) n = 0;  /* another pipeline stage's unit: no storage here */
        /* Padding also keeps every unit 64-byte aligned. */
        m->units[u] = (Unit){off, n, round_up(n, pad)};
        off += m->units[u].n_padded;
    }
    m->n_flat = off;
    m->uparams = xcalloc((size_t)m->n_units, sizeof(void *));
    m->ugrads = xcalloc((size_t)m->n_units, sizeof(void *));
    m->ucompute = xcalloc((size_t)m->n_units, sizeof(void *));
    if (alloc) {
        m->params = xaligned_alloc(m->n_flat * sizeof(float));
        m->grads = xaligned_alloc(m->n_flat * sizeof(float));
        model_point_units(m, m->params, m->grads);
    }
}

void model_point_units(Model *m, void *params, void *grads) {
    for (int u = 0; u < m->n_units; u++) {
        m->uparams[u] = params ? st_at(params, m->units[u].offset) : NULL;
        m->ugrads[u] = grads ? st_at(grads, m->units[u].offset) : NULL;
    }
}

void model_free(Model *m) {
    layer_graphs_free(m->graphs);
    free(m->params);
    free(m->grads);
    free(m->units);
    free(m->packed);
    free(m->uparams);
    free(m->ugrads);
    free(m->ucompute);
    memset(m, 0, sizeof *m);
}

int model_tensors(const Model *m, TensorInfo *out, int max) {
    int n = 0;
#define ADD(nm_fmt, idx, off, r, cc)                                          \
    do {                                                                      \
        if (n < max) {                                                        \
            snprintf(out[n].name, sizeof out[n].name, nm_fmt, idx);           \
            out[n].offset = (off); out[n].rows = (r); out[n].cols = (cc);     \
            out[n].unit = unit_;                                              \
        }                                                                     \
        n++;                                                                  \
    } while (0)
    int unit_ = UNIT_EMBEDDING;
    ADD("tok_embed.weight%.0d", 0, m->units[UNIT_EMBEDDING].offset, m->Vr, m->E);  /* (the rank's rows) */
    for (int l = 0; l < m->L; l++) {
        unit_ = unit_of_layer(l);
        size_t b = m->units[unit_of_layer(l)].offset;
        const LayerLayout *ly = &m->layer;
        ADD("blocks.%d.att_norm.w", l, b + ly->att_norm, 1, m->E);
        /* a tensor-parallel rank's slices: its heads' rows, its FFN rows and columns */
        int Et = m->NHt * m->HD, Ht = m->Ht;
        ADD("blocks.%d.qkv_proj.weight", l, b + ly->qkv, 3 * Et, m->E);
        ADD("blocks.%d.att_out_proj.weight", l, b + ly->att_out, m->E, Et);
        ADD("blocks.%d.ffn_norm.w", l, b + ly->ffn_norm, 1, m->E);
        ADD("blocks.%d.ffn.gate_proj.weight", l, b + ly->gate_up, Ht, m->E);
        ADD("blocks.%d.ffn.up_proj.weight", l, b + ly->gate_up + (size_t)Ht * m->E, Ht, m->E);
        ADD("blocks.%d.ffn.down_proj.weight", l, b + ly->down, m->E, Ht);
    }
    size_t hb = m->units[unit_head(m)].offset;
    unit_ = unit_head(m);
    ADD("output_norm.w%.0d", 0, hb + m->head_out_norm, 1, m->E);
    if (!m->c.tie_embeddings) ADD("lm_head.weight%.0d", 0, hb + m->head_lm, m->Vr, m->E);
#undef ADD
    return n;
}

/* Elements are drawn in blocks of this many, each from its own jump into the tensor's
 * stream: the values do not depend on the blocking or the thread count. */
#define INIT_BLOCK ((size_t)1 << 18)

/* A tensor-parallel rank's slices take the values the whole model's init gives them: each
 * run (model_tp_runs) is drawn from the whole layout at its global place. Runs are drawn in
 * spans of the whole layout, up to TP_SPAN values at once: a matrix split by columns is E
 * runs, and drawing each alone starts at its block's jump (INIT_BLOCK values), which took
 * minutes at embed_dim=4096. */
#define TP_SPAN ((size_t)1 << 24)
/* ... and only across gaps (other ranks' values, drawn and dropped) of up to TP_GAP: the
 * head's output_norm and its vocabulary rows, or qkv's q, k and v blocks, lie far apart,
 * and one span over them held the other ranks' rows too (12 MiB of a tiny model's 90, past
 * the estimate) */
#define TP_GAP ((size_t)1 << 16)
static void init_range_tp(const Model *m, int u, size_t lo, size_t hi, float *buf, uint64_t seed) {
    memset(buf, 0, (hi - lo) * sizeof(float));
    Model g;
    model_init_layout(&g, &m->c, 1, 0);
    int max = model_tp_max_runs(m);
    TpRun *r = xmalloc((size_t)max * sizeof *r);
    int n = model_tp_runs(m, u, r, max);
    size_t *a = xmalloc((size_t)n * sizeof *a), *b = xmalloc((size_t)n * sizeof *b);
    for (int i = 0; i < n; i++) tp_run_clip(&r[i], lo, hi, &a[i], &b[i]);  /* run i's part in [lo, hi) */
    for (int i = 0; i < n;) {
        if (a[i] >= b[i]) { i++; continue; }
        size_t g0 = r[i].global + (a[i] - r[i].local), g1 = g0 + (b[i] - a[i]);
        int j = i + 1;  /* runs i..j-1 share one span: later in the whole layout, within TP_SPAN */
        for (; j < n && a[j] < b[j]; j++) {
            size_t s = r[j].global + (a[j] - r[j].local);
            if (s < g1 || s - g1 > TP_GAP || s + (b[j] - a[j]) - g0 > TP_SPAN) break;
            g1 = s + (b[j] - a[j]);
        }
        if (j == i + 1) {  /* one run (a vocabulary range, a long one): drawn straight into place */
            model_init_range(&g, u, g0, g1, buf + (a[i] - lo), seed);
        } else {
            float *tmp = xmalloc((g1 - g0) * sizeof *tmp);
            model_init_range(&g, u, g0, g1, tmp, seed);
            for (int k = i; k < j; k++)
                memcpy(buf + (a[k] - lo), tmp + (r[k].global + (a[k] - r[k].local) - g0), (b[k] - a[k]) * sizeof(float));
            free(tmp);
        }
        i = j;
    }
    free(a); free(b); free(r);
    model_free(&g);
}

int model_tp_max_runs(const Model *m) { return 2 * m->E + 8; }

int model_tp_runs(const Model *m, int u, TpRun *out, int max) {
    const Unit *un = &m->units[u];
    if (!un->n) return 0;
    int n = 0;
#define RUN(l, g, len, rep)                                                    \
    do {                                                                       \
        if (n >= max) die(EXIT_RUN_FAILURE, "internal: model_tp_runs: max %d", max); \
        out[n++] = (TpRun){(l), (g), (len), (rep)};                            \
    } while (0)
    if (m->tp_size == 1) {
        RUN(0, 0, un->n, !unit_is_layer(m, u));  /* a whole layer: nothing of it is another rank's */
        return n;
    }
    /* the vocabulary rows [v0, v0 + Vr) of tok_embed and lm_head; output_norm whole */
    size_t rows = (size_t)m->v0 * m->E, nr = (size_t)m->Vr * m->E;
    if (u == UNIT_EMBEDDING) {
        RUN(0, rows, nr, 0);
        return n;
    }
    if (u == unit_head(m)) {
        RUN(m->head_out_norm, 0, (size_t)m->E, 1);
        if (!m->c.tie_embeddings) RUN(m->head_lm, m->head_lm + rows, nr, 0);
        return n;
    }
    size_t E = m->E, H = m->H, Et = (size_t)m->NHt * m->HD, Ht = m->Ht, r = (size_t)m->tp_rank;
    const LayerLayout *ly = &m->layer;
    /* the whole layer's offsets (LayerLayout at tp = 1) */
    size_t gqkv = E, gatt = gqkv + 3 * E * E, gffn = gatt + E * E, ggu = gffn + E, gdown = ggu + 2 * H * E;
    RUN(ly->att_norm, 0, E, 1);
    for (size_t p = 0; p < 3; p++) RUN(ly->qkv + p * Et * E, gqkv + (p * E + r * Et) * E, Et * E, 0);  /* q, k, v */
    for (size_t i = 0; i < E; i++) RUN(ly->att_out + i * Et, gatt + i * E + r * Et, Et, 0);
    RUN(ly->ffn_norm, gffn, E, 1);
    for (size_t p = 0; p < 2; p++) RUN(ly->gate_up + p * Ht * E, ggu + (p * H + r * Ht) * E, Ht * E, 0);  /* gate, up */
    for (size_t i = 0; i < E; i++) RUN(ly->down + i * Ht, gdown + i * H + r * Ht, Ht, 0);
#undef RUN
    return n;
}

void model_init_range(const Model *m, int u, size_t lo, size_t hi, float *buf, uint64_t seed) {
    if (m->tp_size > 1) {
        init_range_tp(m, u, lo, hi, buf, seed);
        return;
    }
    const Unit *un = &m->units[u];
    memset(buf, 0, (hi - lo) * sizeof(float));
    int max = 8 + 7 * m->L;
    TensorInfo *t = xmalloc((size_t)max * sizeof *t);
    int nt = model_tensors(m, t, max);
    float resid_std = 0.02f / sqrtf(2.0f * (float)m->L);
    for (int i = 0; i < nt; i++) {
        if (t[i].unit != u) continue;
        /* Each tensor has its own stream, so any unit, or any range of it, can be built
         * alone (FSDP ranks initialise only their shard). */
        size_t t0 = t[i].offset - un->offset, n = (size_t)t[i].rows * t[i].cols;
        if (hi <= t0 || lo >= t0 + n) continue;
        size_t a = lo > t0 ? lo - t0 : 0, b = hi < t0 + n ? hi - t0 : n;  /* [a, b) of the tensor */
        float *p = buf + (t0 + a - lo);  /* element a of the tensor */
        if (strstr(t[i].name, "norm")) {
            for (size_t j = 0; j < b - a; j++) p[j] = 1.0f;
            continue;
        }
        float std = (strstr(t[i].name, "att_out_proj") || strstr(t[i].name, "down_proj")) ? resid_std : 0.02f;
        uint64_t s = seed * 1000003ULL + (uint64_t)i;
        long nb = (long)((b - 1) / INIT_BLOCK - a / INIT_BLOCK + 1);
#pragma omp parallel for schedule(dynamic, 1)
        for (long k = 0; k < nb; k++) {
            size_t j0 = (a / INIT_BLOCK + (size_t)k) * INIT_BLOCK, j1 = j0 + INIT_BLOCK;
            if (j0 < a) j0 = a;
            if (j1 > b) j1 = b;
            Rng r;
            rng_seed(&r, s);
            rng_jump(&r, 2 * (uint64_t)j0);  /* two draws per normal */
            for (size_t j = j0; j < j1; j++) p[j - a] = std * rng_normal(&r);
        }
    }
    free(t);
}

void model_init_unit(const Model *m, int u, float *buf, uint64_t seed) {
    model_init_range(m, u, 0, m->units[u].n_padded, buf, seed);
}

void model_init_weights(Model *m, uint64_t seed) {
    for (int u = 0; u < m->n_units; u++) model_init_unit(m, u, m->params + m->units[u].offset, seed);
}

/* ---- activations ---- */

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
static int acts_plan(const ModelConfig *c, int n_layers, int head, int B, int T, int training, size_t act_size,
                     Acts *a, Slot *s, size_t *logit_n, int tp, int sp) {
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
        P(gu, Ls * N * 2 * H); P(hsw, Ls * N * H);
    }
    if (sp && layers) {
        if (training && model_tp_keep_gathered()) C(xg, Ls * 2 * N * E, 1);
        else C(gath, N * E, 1);
        C(full, N * E, 1);
    }
    if (head) { C(xf, N * E, sp); F(rstdf, NS); P(logits, lrows * ldl); F(losses, N); }
    if (head && tp > 1) F(ce_stats, (size_t)tp * rows * 3);
    if (layers) { F(rope_cos, (size_t)T * HD / 2); F(rope_sin, (size_t)T * HD / 2); }
    if (training) {
        P(dres, NS * E);
        if (layers) { P(dqkv, N * 3 * Et); P(datt, N * Et); }
        if (head) C(dxf, N * E, tp > 1);
        if (layers) { P(dgu, N * 2 * H); P(dh, N * H); }
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
    return acts_bytes_tp(c, st, B, T, training, act_size, logit_bytes, 1, 0);
}

size_t acts_bytes_tp(const ModelConfig *c, const Stage *st, int B, int T, int training, size_t act_size,
                     size_t *logit_bytes, int tp, int sp) {
    Acts a;
    Slot s[32];
    size_t logit_n, total = acts_extra_bytes(B, T, c->vocab_size);
    int n = acts_plan(c, stage_n_layers(c, st), st->last == c->n_layers + 1, B, T, training, act_size, &a, s, &logit_n,
                      tp, sp);
    for (int i = 0; i < n; i++) total += (slot_bytes(&s[i], act_size) + 63) / 64 * 64;
    if (logit_bytes) *logit_bytes = logit_n * act_size;
    return total;
}

size_t acts_tp_first_window_bytes(const ModelConfig *c, const Stage *st, int B, int T, int training, size_t act_size,
                                  int tp, int sp) {
    Acts a;
    Slot s[32];
    size_t logit_n;
    int n = acts_plan(c, stage_n_layers(c, st), st->last == c->n_layers + 1, B, T, training, act_size, &a, s, &logit_n,
                      tp, sp);
    for (int i = 0; i < n; i++)
        if (s[i].coll) return slot_bytes(&s[i], act_size);
    return 0;
}

size_t acts_tp_coll_extra(const ModelConfig *c, const Stage *st, int B, int T, int training, size_t act_size, int tp,
                          int sp, size_t (*extra)(size_t bytes)) {
    Acts a;
    Slot s[32];
    size_t logit_n, sum = 0;
    int n = acts_plan(c, stage_n_layers(c, st), st->last == c->n_layers + 1, B, T, training, act_size, &a, s, &logit_n,
                      tp, sp);
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
    Slot s[32];
    size_t logit_n;
    int head = stage_has_head(m, st);
    int n = acts_plan(&m->c, stage_n_layers(&m->c, st), head, B, T, training, ops_act_size(), a, s, &logit_n,
                      m->tp_size, m->sp);
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
                   a->rope_cos, a->rope_sin, a->ce_stats, a->gath, a->full, a->xg};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        if (a->buf_free) a->buf_free(all[i]);
        else op_free(all[i]);
    }
    op_free(a->dev_inputs);
    op_free(a->dev_targets);
    op_free(a->dev_emb_index);
    free(a->emb_index);
    free(a->emb_count);
    free(a->inputs);
    free(a->targets);
    free(a->host_losses);
    memset(a, 0, sizeof *a);
}

/* ---- forward / backward ---- */

/* Per-layer activation pointers: the layer's input and output in residual slots r and r+1,
 * everything else in layer slot `slot`. */
typedef struct { void *x, *xn1, *qkv, *att, *mid, *xn2, *gu, *hsw, *out; float *rstd1, *lse, *rstd2; void *xg1, *xg2; } LayerActs;
/* A layer's gradients that the split backward's weight pass needs, kept by its input pass
 * (model_backward_input; wgrad_at) */
typedef struct { void *dout, *dgu, *dxn2, *dmid, *dqkv, *dxn1; } WGrad;

/* Rows of the residual stream a rank holds for N tokens: all of them, or under sequence
 * parallel its N / tp_size (the rows tp_rank * N / tp_size onwards). */
static size_t held_rows(const Model *m, size_t N) { return m->sp ? N / (size_t)m->tp_size : N; }

static LayerActs layer_acts(const Model *m, const Acts *a, int slot, int r) {
    size_t E = m->E, H = m->Ht, Et = (size_t)m->NHt * m->HD;  /* this tensor-parallel rank's widths */
    size_t s = (size_t)slot, NA = a->N, NS = held_rows(m, NA);  /* slots are strided by the planned N */
    LayerActs la = {
        .x = act_at(a->res, (size_t)r * NS * E), .xn1 = act_at(a->xn1, s * NS * E), .rstd1 = a->rstd1 + s * NS,
        .qkv = act_at(a->qkv, s * NA * 3 * Et), .att = act_at(a->att, s * NA * Et),
        .lse = a->lse + s * (size_t)a->B * m->NHt * a->T, .mid = act_at(a->mid, s * NS * E),
        .xn2 = act_at(a->xn2, s * NS * E), .rstd2 = a->rstd2 + s * NS, .gu = act_at(a->gu, s * NA * 2 * H),
        .hsw = act_at(a->hsw, s * NA * H), .out = act_at(a->res, ((size_t)r + 1) * NS * E),
        .xg1 = a->xg ? act_at(a->xg, 2 * s * NA * E) : NULL, .xg2 = a->xg ? act_at(a->xg, (2 * s + 1) * NA * E) : NULL,
    };
    return la;
}

int model_tp_keep_gathered(void) { return env_flag("MESHTRAIN_TP_KEEP_GATHERED", 0); }

/* Tensor parallel's collectives. branch_sum: the sum over the tensor-parallel ranks of what
 * each computed from its own heads or FFN units (Megatron-LM's g in the forward, after
 * att_out and down; its conjugate f in the backward, at the input gradients of qkv and
 * gate_up): an all-reduce, or under sequence parallel a reduce-scatter (this rank's rows of
 * the sum), with f's other half an all-gather (seq_gather), so the residual stream and the
 * norms hold N / tp_size rows. Each runs as c collectives, one per chunk of rows (Chunks),
 * so that a product can start on the chunks that have arrived, or the sum of its first
 * chunks travel while it computes the rest (async tensor parallel). */
static void tp_flush(const Model *m) {
    if (m->tp_size > 1 && m->tp.flush) m->tp.flush(m->tp.ctx);
}
/* Each collective is begun (tensor.c): the ticket to join before its result is used (-1:
 * none was needed); the plain forms join at once. */
static void tp_join(const Model *m, long t) {
    if (t >= 0) m->tp.join(m->tp.ctx, t);
}
/* The tickets of one collective's chunks (n = 0: nothing was begun); rot: a fused gather's,
 * ticket i for the block of rows (tp_rank + i) % tp_size (ModelTp's fused_gather_begin). */
typedef struct { long t[TP_MAX_CHUNKS]; int n, rot; } Tickets;
static void tp_join_all(const Model *m, const Tickets *ts) {
    for (int j = 0; j < ts->n; j++) tp_join(m, ts->t[j]);
}

/* N rows as c chunks of `rows` rows; under sequence parallel a rank holds `held` of each
 * (Model's sp says which), else held = rows. */
typedef struct { int c; size_t rows, held; } Chunks;
/* The largest count up to `asked` (and TP_MAX_CHUNKS, Tickets' size) that divides n rows. */
static int rows_count(int asked, size_t n) {
    int c = asked < 1 ? 1 : asked > TP_MAX_CHUNKS ? TP_MAX_CHUNKS : asked;
    while (n % (size_t)c) c--;  /* c = 1 divides anything */
    return c;
}
int model_tp_chunks(const Model *m, size_t N) {
    return m->tp_size > 1 ? rows_count(m->tp_chunks, held_rows(m, N)) : 1;
}
static Chunks tp_chunks(const Model *m, int N) {
    int c = model_tp_chunks(m, (size_t)N);
    return (Chunks){c, (size_t)N / (size_t)c, held_rows(m, (size_t)N) / (size_t)c};
}
/* Where this rank's rows of chunk j are among the whole N (the first row); at j * held
 * among its own. */
static size_t mine_row(const Model *m, const Chunks *k, int j) {
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
static void branch_sum(const Model *m, void *dst, void *src, int N) {
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
static const void *seq_gather_begin(const Model *m, void *buf, const void *part, int N, Tickets *ts) {
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
static const void *seq_gather(const Model *m, void *buf, const void *part, int N) {
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
static void *gath_of(const Acts *a, void *kept) { return kept ? kept : a->gath; }
/* The gathered norm output a weight gradient needs: the kept one, or gathered again */
static const void *gathered(const Model *m, const Acts *a, void *kept, const void *part, int N) {
    return kept ? kept : seq_gather(m, a->gath, part, N);
}

/* One matrix product of a layer, to be run a chunk of rows at a time: the forward's
 * out = inp @ w^T (+ res when res: out and res [N, OC], inp [N, C]), or with bwd the input
 * gradient out = inp @ w (inp = d(output) [N, OC], out [N, C]; written, not added). */
typedef struct { int bwd; void *out; const void *inp, *w, *res; int C, OC; } Product;
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
static void product_after(const Model *m, const Product *p, const Tickets *ts, int N) {
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
static void product_then_sum(const Model *m, const Product *p, void *dst, int N, Tickets *ts, int fill) {
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
static void input_then_weight(const Model *m, Acts *a, void *dx, void *dw, const void *dout, const void *inp,
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

/* A layer's down-projection sums left travelling into the next layer (layer_forward_halves
 * with hp), and where their rows' residual add goes once they are in. */
typedef struct { Tickets s[2]; void *out, *mid; int on; } HalvesPend;
/* Half h of hp's sums joined and its residual added (the layer's output rows, the next one's input). */
static void halves_pend_join(const Model *m, HalvesPend *hp, size_t N, int h) {
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
static void layer_forward_halves(const Model *m, const Acts *a, int l, const LayerActs *la, int B, int T,
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
typedef struct { Tickets td[2]; int on; } HalvesCarry;
static void layer_backward_halves(Model *m, Acts *a, int l, const LayerActs *la, int defer, HalvesCarry *carry,
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

/* recompute != 0 (activation checkpointing, in the backward): everything the backward
 * reads, but not the layer's output, which is already in the residual stream. On a
 * tensor-parallel rank the heads and FFN units are its own (Et = its heads' width, H = its
 * FFN units), and the two branch outputs are summed over the ranks before the residual;
 * under sequence parallel the norms run on the rank's rows (NS) and their outputs are
 * gathered for the matrix products (a->gath), whose outputs (a->full) are reduce-scattered.
 * Each collective is chunked beside its product (product_after, product_then_sum). */
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
static void layer_forward_groups(const Model *m, const Acts *a, int l, const LayerActs *la, int B, int T, int G,
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

/* pend: see layer_forward_groups; NULL: every collective joined before the return. */
static void layer_forward(const Model *m, const Acts *a, int l, const LayerActs *la, int B, int T, int recompute,
                          Tickets *pend) {
    int G = model_tp_groups(m, (size_t)B * T);
    if (G > 1) {
        Tickets mine = {.n = 0};
        layer_forward_groups(m, a, l, la, B, T, G, recompute, pend ? pend : &mine);
        tp_join_all(m, &mine);
        return;
    }
    if (pend) {
        tp_join_all(m, pend);
        pend->n = 0;
    }
    if (model_tp_halves(m, (size_t)B * T)) {
        layer_forward_halves(m, a, l, la, B, T, recompute, NULL);
        return;
    }
    const void *w = unit_weights(m, unit_of_layer(l));
    const LayerLayout *ly = &m->layer;
    int N = B * T, NS = (int)held_rows(m, (size_t)N), E = m->E, H = m->Ht, Et = m->NHt * m->HD;
    Tickets ts;
    op_rmsnorm_forward(la->xn1, la->rstd1, la->x, act_at(w, ly->att_norm), NS, E, RMS_EPS);
    const void *xn = seq_gather_begin(m, gath_of(a, la->xg1), la->xn1, N, &ts);
    product_after(m, &(Product){0, la->qkv, xn, act_at(w, ly->qkv), NULL, E, 3 * Et}, &ts, N);
    op_rope_forward(la->qkv, a->rope_cos, a->rope_sin, B, T, m->NHt, m->HD);
    op_attention_forward(la->att, la->lse, la->qkv, B, T, m->NHt, m->HD);
    void *y = m->sp ? a->full : la->mid;
    product_then_sum(m, &(Product){0, y, la->att, act_at(w, ly->att_out), NULL, Et, E}, la->mid, N, &ts, 0);
    tp_join_all(m, &ts);
    op_add_rmsnorm_forward(la->mid, la->xn2, la->rstd2, la->x, act_at(w, ly->ffn_norm), NS, E, RMS_EPS);
    xn = seq_gather_begin(m, gath_of(a, la->xg2), la->xn2, N, &ts);
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
 * them, chunk by chunk beside the product's input gradient: product_after). defer != 0:
 * leaves out the weight gradients of gate_up and qkv, for layer_backward_deferred (their
 * inputs, dgu and dqkv, stay in the scratch until the next layer_backward). */
static void layer_backward(Model *m, Acts *a, int l, const LayerActs *la, int defer) {
    if (model_tp_halves(m, (size_t)a->B * a->T)) {
        layer_backward_halves(m, a, l, la, defer, NULL, 0);
        return;
    }
    const void *w = unit_weights(m, unit_of_layer(l));
    void *g = unit_grads(m, unit_of_layer(l));
    const LayerLayout *ly = &m->layer;
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
    const void *d = seq_gather_begin(m, a->full, a->dres, N, &td);
    if (!defer && !la->xg2) seq_gather_begin(m, a->gath, la->xn2, N, &gx);
    product_after(m, &(Product){1, a->dh, d, act_at(w, ly->down), NULL, H, E}, &td, N);
    op_matmul_backward(NULL, st_at(g, ly->down), d, la->hsw, NULL, N, H, E);
    op_swiglu_backward_set(a->dgu, a->dh, la->gu, N, H);
    input_then_weight(m, a, dx, defer ? NULL : st_at(g, ly->gate_up), a->dgu, m->sp ? gath_of(a, la->xg2) : la->xn2, &gx,
                      act_at(w, ly->gate_up), N, E, 2 * H);
    op_rmsnorm_backward(a->dres, st_at(g, ly->ffn_norm), a->dxn, la->mid, act_at(w, ly->ffn_norm), la->rstd2, NS, E);
    d = seq_gather_begin(m, a->full, a->dres, N, &td);
    if (!defer && !la->xg1) seq_gather_begin(m, a->gath, la->xn1, N, &gx);
    product_after(m, &(Product){1, a->datt, d, act_at(w, ly->att_out), NULL, Et, E}, &td, N);
    op_matmul_backward(NULL, st_at(g, ly->att_out), d, la->att, NULL, N, Et, E);
    op_attention_rope_backward_set(a->dqkv, a->datt, la->qkv, la->att, la->lse, a->rope_cos, a->rope_sin, B, T, m->NHt,
                                   m->HD);
    input_then_weight(m, a, dx, defer ? NULL : st_at(g, ly->qkv), a->dqkv, m->sp ? gath_of(a, la->xg1) : la->xn1, &gx,
                      act_at(w, ly->qkv), N, E, 3 * Et);
    op_rmsnorm_backward(a->dres, st_at(g, ly->att_norm), a->dxn, la->x, act_at(w, ly->att_norm), la->rstd1, NS, E);
}

/* The two weight gradients layer_backward(..., defer = 1) left out; they need no weights. */
static void layer_backward_deferred(Model *m, Acts *a, int l, const LayerActs *la) {
    void *g = unit_grads(m, unit_of_layer(l));
    const LayerLayout *ly = &m->layer;
    int N = a->B * a->T, E = m->E, H = m->Ht, Et = m->NHt * m->HD;
    op_matmul_backward(NULL, st_at(g, ly->gate_up), a->dgu, gathered(m, a, la->xg2, la->xn2, N), NULL, N, E, 2 * H);
    op_matmul_backward(NULL, st_at(g, ly->qkv), a->dqkv, gathered(m, a, la->xg1, la->xn1, N), NULL, N, E, 3 * Et);
}

/* ---- layers as recorded graphs (model_use_graphs, layer_graphs.h) ----
 * Only on one tensor-parallel rank, where a layer's ops are the device's alone (no
 * collective, no host wait inside). The key: every pointer the layer's ops read or write
 * and every shape and flag they depend on. */
enum { LG_FORWARD, LG_RECOMPUTE, LG_BACKWARD, LG_INPUT, LG_WEIGHT };  /* (the last two: the split passes) */
typedef struct {
    int kind, l, B, T, defer;
    LayerActs la;
    WGrad wg;  /* the split passes' (zero for the others) */
    const void *w, *g, *cos, *sin, *full, *gath, *dres, *dxn, *dh, *dgu, *datt, *dqkv;
} LayerKey;
typedef struct { Model *m; Acts *a; int l, defer; const LayerActs *la; const WGrad *wg; } LayerCall;

static void layer_backward_input(Model *m, Acts *a, int l, const LayerActs *la, const WGrad *wg);
static void layer_backward_weight(Model *m, Acts *a, int l, const LayerActs *la, const WGrad *wg);
static void lg_forward(void *ctx) {
    LayerCall *c = ctx;
    layer_forward(c->m, c->a, c->l, c->la, c->a->B, c->a->T, 0, NULL);
}
static void lg_recompute(void *ctx) {
    LayerCall *c = ctx;
    layer_forward(c->m, c->a, c->l, c->la, c->a->B, c->a->T, 1, NULL);
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
static int layer_graphed(const Model *m) { return m->graphs && m->tp_size == 1; }
/* layer l's pass `kind` through its recording; wg: the split passes' set (NULL for the others) */
static void layer_run_graphed(Model *m, Acts *a, int l, const LayerActs *la, const WGrad *wg, int kind, int defer) {
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
    /* down's sums of the layer before, still travelling (layer_forward_groups); out of
     * training each layer's output is copied to the next one's input slot, so joined first */
    Tickets pend = {.n = 0};
    /* tp_halves: each layer's down sums left travelling into the next one, where that is safe */
    HalvesPend hp = {.on = 0};
    int carry = training && model_tp_halves(m, (size_t)N) && m->tp.fused_made;
    for (int i = 0; i < nl; i++) {
        int l = l0 + i, slot = training && !a->recompute ? i : 0, r = training ? i : 0;
        LayerActs la = layer_acts(m, a, slot, r);
        if (!training && i > 0) op_copy(la.x, la.out, held_rows(m, (size_t)N) * m->E * ops_act_size());
        HOOK(h, gather, unit_of_layer(l), i + 1 < nl ? unit_of_layer(l + 1) : after);
        if (trace_active()) {  /* (the timeline's: where a layer's forward starts) */
            char label[48];
            snprintf(label, sizeof label, "layer %d forward", l);
            trace_mark(NULL, label);
        }
        if (carry) layer_forward_halves(m, a, l, &la, B, T, 0, &hp);
        else if (training && layer_graphed(m)) layer_run_graphed(m, a, l, &la, NULL, LG_FORWARD, 0);
        else layer_forward(m, a, l, &la, B, T, 0, training ? &pend : NULL);
        HOOK(h, release, unit_of_layer(l));
    }
    tp_join_all(m, &pend);
    for (int hh = 0; hh < 2; hh++) halves_pend_join(m, &hp, (size_t)N, hh);
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
    /* sequence parallel: the norm on the rank's rows, each chunk's written into its place in
     * xf and gathered: every rank's lm_head columns take every row */
    int NS = (int)held_rows(m, (size_t)N);
    Chunks k = tp_chunks(m, N);
    if (!m->sp) k = (Chunks){1, (size_t)N, (size_t)N};
    for (int j = 0; j < k.c; j++)
        op_rmsnorm_forward(act_at(a->xf, mine_row(m, &k, j) * E), a->rstdf + (size_t)j * k.held,
                           act_at(last, (size_t)j * k.held * E), w_out_norm, (int)k.held, E, RMS_EPS);
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
    trunk_forward(m, s, a, B, T, grad, h);
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
    /* tp_halves without recompute (whose sums may write a->full, where the carried gathers land):
     * each layer begins the next one's first gathers (layer_backward_halves) */
    HalvesCarry hc = {.on = 0};
    int carry = !a->recompute && model_tp_halves(m, (size_t)N);
    for (int i = nl - 1; i >= 0; i--) {
        int l = l0 + i;
        LayerActs la = layer_acts(m, a, a->recompute ? 0 : i, i);
        HOOK(h, gather, unit_of_layer(l), i > 0 ? unit_of_layer(l - 1) : -1);
        if (a->recompute && layer_graphed(m)) layer_run_graphed(m, a, l, &la, NULL, LG_RECOMPUTE, 0);
        else if (a->recompute) layer_forward(m, a, l, &la, B, T, 1, NULL);
        HOOK(h, grad_begin, unit_of_layer(l));
        if (trace_active()) {
            char label[48];
            snprintf(label, sizeof label, "layer %d backward", l);
            trace_mark(NULL, label);
        }
        if (carry) layer_backward_halves(m, a, l, &la, i == 0 && defer, &hc, i > 0);
        else if (layer_graphed(m)) layer_run_graphed(m, a, l, &la, NULL, LG_BACKWARD, i == 0 && defer);
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
static WGrad wgrad_at(const Model *m, void *buf, int i, size_t N) {
    size_t E = m->E, H = m->Ht, Et = (size_t)m->NHt * m->HD, per = N * (4 * E + 3 * Et + 2 * H);
    void *b = act_at(buf, (size_t)i * per);
    WGrad w = {b, act_at(b, N * E), act_at(b, N * (E + 2 * H)), act_at(b, N * (2 * E + 2 * H)),
               act_at(b, N * (3 * E + 2 * H)), act_at(b, N * (3 * E + 3 * Et + 2 * H))};
    return w;
}

/* A layer's input-gradient pass (model_backward_input): d(its input) into dres, and the
 * gradients its weight pass needs into wg. */
static void layer_backward_input(Model *m, Acts *a, int l, const LayerActs *la, const WGrad *wg) {
    int B = a->B, T = a->T, N = B * T, NS = (int)held_rows(m, (size_t)N), E = m->E, H = m->Ht, Et = m->NHt * m->HD;
    size_t bytes = (size_t)N * E * ops_act_size();
    const LayerLayout *ly = &m->layer;
    const void *w = unit_weights(m, unit_of_layer(l));
    /* (sequence parallel: dout and dmid kept whole, dxn2 and dxn1 the rank's rows) */
    void *dx2 = m->sp ? a->full : wg->dxn2, *dx1 = m->sp ? a->full : wg->dxn1;
    /* d(output) gathered straight into dout (copied without sequence parallel), each
     * chunk's input gradient computed as it arrives; the sums chunked beside theirs */
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
static void layer_backward_weight(Model *m, Acts *a, int l, const LayerActs *la, const WGrad *wg) {
    int N = a->B * a->T, NS = (int)held_rows(m, (size_t)N), E = m->E, H = m->Ht, Et = m->NHt * m->HD;
    const LayerLayout *ly = &m->layer;
    void *g = unit_grads(m, unit_of_layer(l));
    op_matmul_backward(NULL, st_at(g, ly->down), wg->dout, la->hsw, NULL, N, H, E);
    op_matmul_backward(NULL, st_at(g, ly->gate_up), wg->dgu, gathered(m, a, la->xg2, la->xn2, N), NULL, N, E, 2 * H);
    op_rmsnorm_backward(NULL, st_at(g, ly->ffn_norm), wg->dxn2, la->mid, NULL, la->rstd2, NS, E);
    op_matmul_backward(NULL, st_at(g, ly->att_out), wg->dmid, la->att, NULL, N, Et, E);
    op_matmul_backward(NULL, st_at(g, ly->qkv), wg->dqkv, gathered(m, a, la->xg1, la->xn1, N), NULL, N, E, 3 * Et);
    op_rmsnorm_backward(NULL, st_at(g, ly->att_norm), wg->dxn1, la->x, NULL, la->rstd1, NS, E);
}

void model_backward_input(Model *m, const Stage *s, Acts *a, void *wbuf, const UnitHooks *h) {
    int l0 = stage_first_layer(s), nl = stage_n_layers(&m->c, s);
    if (a->head_split && stage_has_head(m, s)) head_backward(m, s, a, 1, 0, h);
    for (int i = nl - 1; i >= 0; i--) {
        int l = l0 + i;
        LayerActs la = layer_acts(m, a, i, i);
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
        LayerActs la = layer_acts(m, a, i, i);
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

const void *model_lm_head(const Model *m) {
    return m->c.tie_embeddings ? unit_weights(m, UNIT_EMBEDDING) : act_at(unit_weights(m, unit_head(m)), m->head_lm);
}

double model_flops_per_token(const ModelConfig *c, int T) {
    /* As the PyTorch peer counts it (PaLM): 6 x non-embedding params + 12 L E T. */
    double n = (double)model_param_count(c) - (double)c->vocab_size * c->embed_dim;
    if (c->tie_embeddings) n += (double)c->vocab_size * c->embed_dim;  /* lm_head still multiplies */
    return 6.0 * n + 12.0 * c->n_layers * c->embed_dim * (double)T;
}
