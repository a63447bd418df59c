/* model: the parameters' layout in units (embedding, layers, head), their initialisation and
 * named tensors; the activations are acts.c's, the forward and backward layer.c's and stage.c's. */
#include "model.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "layer_graphs.h"
#include "ops.h"
#include "util.h"

/* Layer l's parameters on one of tp tensor-parallel ranks (tp = 1: the whole layer). A MoE
 * layer: the attention (the rank's heads), the norms, the router (whole), the shared experts'
 * FFN and the experts (one ep-th of them on an expert-parallel rank; each the rank's He / tp
 * hidden units). */
static size_t layer_param_count_split(const ModelConfig *c, int l, int tp, int ep) {
    size_t E = (size_t)c->embed_dim, H = (size_t)(1.5 * c->embed_dim), Et = E / (size_t)tp, Ht = H / (size_t)tp;
    if (model_layer_is_moe(c, l)) {
        size_t He = (size_t)model_moe_expert_dim(c), Hs = He * (size_t)c->moe_shared_experts, X = (size_t)c->moe_experts;
        return 2 * E + 3 * Et * E + E * Et + X * E + 3 * Hs / (size_t)tp * E + X / (size_t)ep * 3 * He / (size_t)tp * E;
    }
    return 2 * E + 3 * Et * E + E * Et + 2 * Ht * E + E * Ht;
}
static size_t layer_param_count(const ModelConfig *c, int l) { return layer_param_count_split(c, l, 1, 1); }

size_t model_param_count(const ModelConfig *c) {
    size_t VE = (size_t)c->vocab_size * c->embed_dim, n = VE + c->embed_dim + (c->tie_embeddings ? 0 : VE);
    for (int l = 0; l < c->n_layers; l++) n += layer_param_count(c, l);
    return n;
}

size_t model_active_param_count(const ModelConfig *c) {
    size_t n = model_param_count(c);
    if (c->moe_experts > 0) {
        size_t idle = (size_t)(c->moe_experts - c->moe_top_k) * 3 * (size_t)model_moe_expert_dim(c) * c->embed_dim;
        n -= (size_t)model_moe_layers_before(c, c->n_layers) * idle;
    }
    return n;
}

int model_moe_check(const ModelConfig *c, char *err, size_t errlen) {
    if (c->moe_experts <= 0) return 0;
    /* (the keys' ranges refuse these first; a checkpoint's header meets them here) */
    if (c->moe_expert_dim < 0 || c->moe_shared_experts < 0 || (unsigned)c->moe_router_sigmoid > 1 ||
        !(c->moe_capacity_factor >= 0))
        return set_err(err, errlen, "invalid mixture-of-experts settings");
    if (c->moe_top_k < 1 || c->moe_top_k > c->moe_experts)
        return set_err(err, errlen, "moe_top_k=%d must be between 1 and moe_experts=%d", c->moe_top_k, c->moe_experts);
    if (c->moe_every < 1 || c->moe_every > c->n_layers)
        return set_err(err, errlen, "moe_every=%d leaves no MoE layer among n_layers=%d", c->moe_every, c->n_layers);
    if (model_moe_expert_dim(c) < 1)
        return set_err(err, errlen, "moe_expert_dim: 1.5 x embed_dim / moe_top_k is 0; give moe_expert_dim");
    return 0;
}

int model_moe_capacity(const ModelConfig *c, int N) {
    if (c->moe_capacity_factor <= 0) return 0;
    double cap = ceil(c->moe_capacity_factor * (double)N * c->moe_top_k / c->moe_experts);
    return cap > N ? N : (int)cap;  /* (an expert takes a token at most once) */
}

size_t model_moe_max_rows(const ModelConfig *c, int N) {
    size_t all = (size_t)N * c->moe_top_k;
    int cap = model_moe_capacity(c, N);
    return cap > 0 && (size_t)cap * c->moe_experts < all ? (size_t)cap * c->moe_experts : all;
}

size_t model_moe_expert_rows(const ModelConfig *c, int N, int ep) {
    if (ep <= 1) return model_moe_max_rows(c, N);
    /* each of the ep ranks sends at most min(k, Xl) choices a token (a token's k are distinct
     * experts), and at most each expert's capacity of them */
    size_t Xl = (size_t)(c->moe_experts / ep), k = (size_t)c->moe_top_k < Xl ? (size_t)c->moe_top_k : Xl;
    size_t all = (size_t)N * k;
    int cap = model_moe_capacity(c, N);
    if (cap > 0 && (size_t)cap * Xl < all) all = (size_t)cap * Xl;
    return (size_t)ep * all;
}

int model_n_tensors(const ModelConfig *c) {
    int n = 2 + (c->tie_embeddings ? 0 : 1);
    for (int l = 0; l < c->n_layers; l++)
        n += model_layer_is_moe(c, l) ? 5 + 3 * c->moe_experts + (c->moe_shared_experts ? 3 : 0) : 7;
    return n;
}

static size_t round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

int model_tp_check(const ModelConfig *c, int tp, char *err, size_t errlen) {
    int ffn = (int)(1.5 * c->embed_dim), vp = model_vocab_padded(c->vocab_size);
    if (tp < 1) return set_err(err, errlen, "tensor_parallel_size=%d is not positive", tp);
    if (tp > 1 && c->moe_experts > 0 && model_moe_expert_dim(c) % tp)
        return set_err(err, errlen, "tensor_parallel_size=%d does not divide the experts' width moe_expert_dim = %d", tp,
                       model_moe_expert_dim(c));
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
    model_init_layout_ep(m, c, pad_multiple, alloc, s, n_stages, tp_size, tp_rank, 1, 0);
}

void model_init_layout_ep(Model *m, const ModelConfig *c, int pad_multiple, int alloc, const Stage *s, int n_stages,
                          int tp_size, int tp_rank, int ep_size, int ep_rank) {
    memset(m, 0, sizeof *m);
    m->c = *c;
    m->E = c->embed_dim; m->NH = c->n_heads; m->HD = c->embed_dim / c->n_heads;
    m->H = (int)(1.5 * c->embed_dim); m->V = c->vocab_size; m->L = c->n_layers;
    char err[256];
    if (tp_rank < 0 || tp_rank >= tp_size || model_tp_check(c, tp_size, err, sizeof err))
        die(EXIT_RUN_FAILURE, "internal: tensor-parallel rank %d of %d: %s", tp_rank, tp_size, err);
    if (ep_rank < 0 || ep_rank >= ep_size || (ep_size > 1 && c->moe_experts % ep_size))
        die(EXIT_RUN_FAILURE, "internal: expert-parallel rank %d of %d for %d experts", ep_rank, ep_size, c->moe_experts);
    m->ep_size = ep_size; m->ep_rank = ep_rank;
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
    if (c->moe_experts > 0) {  /* (tp_size divides He: model_tp_check) */
        m->X = c->moe_experts, m->K = c->moe_top_k, m->He = model_moe_expert_dim(c);
        m->Xl = m->X / ep_size, m->x0 = ep_rank * m->Xl;
        m->Hs = m->He * c->moe_shared_experts;
        m->Het = m->He / tp_size, m->Hst = m->Hs / tp_size;
        m->n_moe = model_moe_layers_before(c, m->L);
        m->moe.dp = 1;  /* (one rank until expert_parallel_attach) */
        size_t He = (size_t)m->Het, Hs = (size_t)m->Hst;  /* (this rank's) */
        LayerLayout *my = &m->moe_layer;
        my->att_norm = ly->att_norm, my->qkv = ly->qkv, my->att_out = ly->att_out, my->ffn_norm = ly->ffn_norm;
        my->router = my->ffn_norm + E;
        my->gate_up = my->router + (size_t)m->X * E;
        my->down = my->gate_up + 2 * Hs * E;
        my->experts = my->down + E * Hs;
        my->expert_n = 3 * He * E;
    }
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
        size_t n = u == 0 ? V * E : u <= m->L ? layer_param_count(c, u - 1) : E + (c->tie_embeddings ? 0 : V * E);
        m->packed[u] = packed;
        packed += n;
        m->n_params += n;
        /* this rank's slices, and its vocabulary rows */
        n = u == 0 ? Vr * E : u <= m->L ? layer_param_count_split(c, u - 1, tp_size, ep_size) : E + (c->tie_embeddings ? 0 : Vr * E);
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
    model_moe_free(m);
    free(m->params);
    free(m->grads);
    free(m->units);
    free(m->packed);
    free(m->uparams);
    free(m->ugrads);
    free(m->ucompute);
    memset(m, 0, sizeof *m);
}

/* A MoE layer's FFN tensors (the router, the shared experts, the experts) from out[n] on (up
 * to max); returns the new count. (A tensor-parallel rank's slices: its hidden units' rows of
 * gate_proj and up_proj, their columns of down_proj.) */
static int moe_ffn_tensors(const Model *m, int l, size_t b, TensorInfo *out, int n, int max) {
    const LayerLayout *ly = &m->moe_layer;
    int E = m->E, He = m->Het, Hs = m->Hst, u = unit_of_layer(l);
#define T(off, r, cc, ...)                                                        \
    do {                                                                          \
        if (n < max) {                                                            \
            snprintf(out[n].name, sizeof out[n].name, __VA_ARGS__);               \
            out[n].offset = b + (off); out[n].rows = (r); out[n].cols = (cc);     \
            out[n].unit = u;                                                      \
        }                                                                         \
        n++;                                                                      \
    } while (0)
    T(ly->router, m->X, E, "blocks.%d.ffn.router.weight", l);
    if (Hs) {
        T(ly->gate_up, Hs, E, "blocks.%d.ffn.shared.gate_proj.weight", l);
        T(ly->gate_up + (size_t)Hs * E, Hs, E, "blocks.%d.ffn.shared.up_proj.weight", l);
        T(ly->down, E, Hs, "blocks.%d.ffn.shared.down_proj.weight", l);
    }
    for (int e = 0; e < m->Xl; e++) {  /* this rank's experts, named by their place among all */
        size_t x = ly->experts + (size_t)e * ly->expert_n;
        T(x, He, E, "blocks.%d.ffn.experts.%d.gate_proj.weight", l, m->x0 + e);
        T(x + (size_t)He * E, He, E, "blocks.%d.ffn.experts.%d.up_proj.weight", l, m->x0 + e);
        T(x + 2 * (size_t)He * E, E, He, "blocks.%d.ffn.experts.%d.down_proj.weight", l, m->x0 + e);
    }
#undef T
    return n;
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
        const LayerLayout *ly = layer_layout(m, l);
        ADD("blocks.%d.att_norm.w", l, b + ly->att_norm, 1, m->E);
        /* a tensor-parallel rank's slices: its heads' rows, its FFN rows and columns */
        int Et = m->NHt * m->HD, Ht = m->Ht;
        ADD("blocks.%d.qkv_proj.weight", l, b + ly->qkv, 3 * Et, m->E);
        ADD("blocks.%d.att_out_proj.weight", l, b + ly->att_out, m->E, Et);
        ADD("blocks.%d.ffn_norm.w", l, b + ly->ffn_norm, 1, m->E);
        if (model_layer_is_moe(&m->c, l)) {
            n = moe_ffn_tensors(m, l, b, out, n, max);
            continue;
        }
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

/* (a MoE layer under tensor parallel: besides the attention's, a column run per row of each
 * down_proj, the shared experts' and each of the rank's experts') */
int model_tp_max_runs(const Model *m) {
    int dense = 2 * m->E + 8;
    if (!m->n_moe || m->tp_size == 1) return dense;
    int moe = (m->Xl + 2) * m->E + 3 * m->Xl + 12;
    return moe > dense ? moe : dense;
}

int model_tp_runs(const Model *m, int u, TpRun *out, int max) {
    const Unit *un = &m->units[u];
    if (!un->n) return 0;
    int n = 0;
#define RUN(l, g, len, rep)                                                    \
    do {                                                                       \
        if (n >= max) die(EXIT_RUN_FAILURE, "internal: model_tp_runs: max %d", max); \
        out[n++] = (TpRun){(l), (g), (len), (rep)};                            \
    } while (0)
    /* everything but a MoE layer's experts is every ep rank's alike (expert parallel) */
    int ep = m->ep_size > 1 ? TP_REPL_EP : 0, tp = TP_REPL_TP | ep;
    if (m->tp_size == 1 && m->ep_size > 1) {
        /* a MoE layer's experts are the rank's piece of the whole layer's */
        int l = layer_of_unit(u);
        if (!unit_is_layer(m, u) || !model_layer_is_moe(&m->c, l)) {
            RUN(0, 0, un->n, ep);
            return n;
        }
        const LayerLayout *ly = &m->moe_layer;
        size_t each = (size_t)m->Xl * ly->expert_n;
        RUN(0, 0, ly->experts, ep);
        RUN(ly->experts, ly->experts + (size_t)m->x0 * ly->expert_n, each, 0);
        return n;
    }
    if (m->tp_size == 1) {
        RUN(0, 0, un->n, !unit_is_layer(m, u));  /* a whole layer: nothing of it is another rank's */
        return n;
    }
    /* the vocabulary rows [v0, v0 + Vr) of tok_embed and lm_head; output_norm whole */
    size_t rows = (size_t)m->v0 * m->E, nr = (size_t)m->Vr * m->E;
    if (u == UNIT_EMBEDDING) {
        RUN(0, rows, nr, ep);
        return n;
    }
    if (u == unit_head(m)) {
        RUN(m->head_out_norm, 0, (size_t)m->E, tp);
        if (!m->c.tie_embeddings) RUN(m->head_lm, m->head_lm + rows, nr, ep);
        return n;
    }
    size_t E = m->E, H = m->H, Et = (size_t)m->NHt * m->HD, Ht = m->Ht, r = (size_t)m->tp_rank;
    int moe = model_layer_is_moe(&m->c, layer_of_unit(u));
    const LayerLayout *ly = moe ? &m->moe_layer : &m->layer;
    /* the whole layer's offsets (LayerLayout at tp = 1) */
    size_t gqkv = E, gatt = gqkv + 3 * E * E, gffn = gatt + E * E, ggu = gffn + E, gdown = ggu + 2 * H * E;
    RUN(ly->att_norm, 0, E, tp);
    for (size_t p = 0; p < 3; p++) RUN(ly->qkv + p * Et * E, gqkv + (p * E + r * Et) * E, Et * E, ep);  /* q, k, v */
    for (size_t i = 0; i < E; i++) RUN(ly->att_out + i * Et, gatt + i * E + r * Et, Et, ep);
    RUN(ly->ffn_norm, gffn, E, tp);
    if (!moe) {
        for (size_t p = 0; p < 2; p++) RUN(ly->gate_up + p * Ht * E, ggu + (p * H + r * Ht) * E, Ht * E, ep);  /* gate, up */
        for (size_t i = 0; i < E; i++) RUN(ly->down + i * Ht, gdown + i * H + r * Ht, Ht, ep);
        return n;
    }
    /* a MoE layer: the router whole (every tp rank's alike); the shared experts and each
     * expert split as the dense FFN is (a SwiGLU of width Hs or He) */
    size_t X = (size_t)m->X, He = (size_t)m->He, Hs = (size_t)m->Hs, Het = (size_t)m->Het, Hst = (size_t)m->Hst;
    size_t grouter = gffn + E, gsgu = grouter + X * E, gsdown = gsgu + 2 * Hs * E, gexp = gsdown + E * Hs;
    size_t each = 3 * He * E;  /* an expert of the whole layer */
    RUN(ly->router, grouter, X * E, tp);
    if (Hs) {
        for (size_t p = 0; p < 2; p++) RUN(ly->gate_up + p * Hst * E, gsgu + (p * Hs + r * Hst) * E, Hst * E, ep);
        for (size_t i = 0; i < E; i++) RUN(ly->down + i * Hst, gsdown + i * Hs + r * Hst, Hst, ep);
    }
    for (size_t e = 0; e < (size_t)m->Xl; e++) {
        size_t lx = ly->experts + e * ly->expert_n, gx = gexp + ((size_t)m->x0 + e) * each;
        for (size_t p = 0; p < 2; p++) RUN(lx + p * Het * E, gx + (p * He + r * Het) * E, Het * E, 0);  /* gate, up */
        for (size_t i = 0; i < E; i++) RUN(lx + 2 * Het * E + i * Het, gx + 2 * He * E + i * He + r * Het, Het, 0);
    }
#undef RUN
    return n;
}

void model_init_range(const Model *m, int u, size_t lo, size_t hi, float *buf, uint64_t seed) {
    if (m->tp_size > 1 || m->ep_size > 1) {
        init_range_tp(m, u, lo, hi, buf, seed);
        return;
    }
    const Unit *un = &m->units[u];
    memset(buf, 0, (hi - lo) * sizeof(float));
    int max = model_n_tensors(&m->c);
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

const void *model_lm_head(const Model *m) {
    return m->c.tie_embeddings ? unit_weights(m, UNIT_EMBEDDING) : act_at(unit_weights(m, unit_head(m)), m->head_lm);
}

double model_flops_per_token(const ModelConfig *c, int T) {
    /* As the PyTorch peer counts it (PaLM): 6 x non-embedding params + 12 L E T (a MoE model's
     * active parameters). */
    double n = (double)model_active_param_count(c) - (double)c->vocab_size * c->embed_dim;
    if (c->tie_embeddings) n += (double)c->vocab_size * c->embed_dim;  /* lm_head still multiplies */
    return 6.0 * n + 12.0 * c->n_layers * c->embed_dim * (double)T;
}

