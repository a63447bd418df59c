/* model — the Llama-style decoder: shapes, the flat-unit parameter layout, init, and
 * explicit forward/backward one unit at a time through the ops interface. It knows
 * nothing of ranks, optimizers or files.
 *
 * Units (FSDP's FlatParameter): UNIT_EMBEDDING = tok_embed; unit_of_layer(0..L-1) = the
 * layers; unit_head(m) = the head (output_norm, lm_head unless tied). Each unit is a contiguous slice of one flat
 * buffer, padded to a multiple of `pad_multiple` floats so it divides evenly by the
 * data-parallel size. Gradients (and the optimizer's moments) mirror the same layout. */
#ifndef MESHTRAIN_MODEL_H
#define MESHTRAIN_MODEL_H
#include <stddef.h>
#include <stdint.h>

/* Mixture of experts (moe_experts > 0): every moe_every-th layer (layers moe_every - 1,
 * 2 moe_every - 1, ...) has, in place of the dense FFN, a router (an [X, E] product, in
 * fp32) that sends each token to moe_top_k of moe_experts SwiGLU experts of width
 * moe_expert_dim, whose outputs are summed weighted by the gates (the chosen scores,
 * renormalised over the k), plus moe_shared_experts always-on experts of the same width (one
 * SwiGLU FFN of their summed width). moe_router_sigmoid: sigmoid scores instead of softmax.
 * moe_capacity_factor > 0: each expert takes at most ceil(factor N k / X) of a micro-batch's
 * N tokens on a rank, the first in token order; the rest of its choices are dropped (the
 * residual passes them). 0: dropless. */
typedef struct {
    int vocab_size, embed_dim, n_heads, n_layers, context_len, tie_embeddings;
    int moe_experts, moe_top_k, moe_expert_dim, moe_shared_experts, moe_every, moe_router_sigmoid;
    float moe_capacity_factor;  /* (a float, as the checkpoint keeps it) */
} ModelConfig;
/* A dense model's config as an initializer (its MoE fields zero: no MoE layer). */
#define MODEL_CONFIG(V, E, NH, L, T, TIE)                                                          \
    {.vocab_size = (V), .embed_dim = (E), .n_heads = (NH), .n_layers = (L), .context_len = (T),   \
     .tie_embeddings = (TIE)}
/* Whether layer l of c is a mixture-of-experts layer. */
static inline int model_layer_is_moe(const ModelConfig *c, int l) {
    return c->moe_experts > 0 && l % c->moe_every == c->moe_every - 1;
}
/* The MoE layers among layers [0, l): a MoE layer's index among the model's MoE layers. */
static inline int model_moe_layers_before(const ModelConfig *c, int l) {
    return c->moe_experts > 0 ? l / c->moe_every : 0;
}
/* A MoE layer's expert width: moe_expert_dim, or the dense FFN's width over the top k. */
static inline int model_moe_expert_dim(const ModelConfig *c) {
    return c->moe_expert_dim > 0 ? c->moe_expert_dim : (int)(1.5 * c->embed_dim) / c->moe_top_k;
}
/* The most rows a MoE layer's experts take for N tokens (every choice kept, or each
 * expert's capacity). */
int model_moe_capacity(const ModelConfig *c, int N);
size_t model_moe_max_rows(const ModelConfig *c, int N);
/* The most rows one rank's experts take under expert parallel over ep ranks, each sending
 * it its N tokens' choices of the rank's moe_experts / ep experts (model_moe_max_rows at
 * ep = 1). */
size_t model_moe_expert_rows(const ModelConfig *c, int N, int ep);
/* Fixed by the model's definition (DESIGN.md), not by keys; export writes them out. */
#define MODEL_RMS_EPS 1e-5f
#define MODEL_ROPE_BASE 10000.0f

typedef struct { size_t offset, n, n_padded; } Unit;  /* in floats, into the flat buffer */

/* Offsets of tensors inside their unit (floats). gate_proj and up_proj are adjacent so
 * they form one [2H, E] matrix (one matmul); their rows stay exactly PyTorch's. */
typedef struct {
    size_t att_norm, qkv, att_out, ffn_norm, gate_up, down;
    /* a MoE layer's (MoeLayout): gate_up and down are its shared experts' (one FFN of their
     * summed width; unused without), router [X, E], and the experts from `experts` on, expert
     * e's gate_proj, up_proj [He, E] and down_proj [E, He] at experts + e * expert_n */
    size_t router, experts, expert_n;
} LayerLayout;

/* Tensor parallel (Megatron-LM): how the model reaches the other ranks of its tensor-parallel
 * group, given from outside (src/parallel/tensor.c). Each collective is begun and returns a
 * ticket; join(ticket) makes the ops queued after it see the result (the ops queued between
 * may run while the collective does, and must not touch its buffers); it may still be in
 * flight on the host's side, and flush waits for every one, at the end of a stage's forward
 * or backward, before the host reads a result. Activations are of the ops' activation type.
 * allreduce: buf summed over the group, in place, the same on every rank (stats: fp32
 * statistics, else activations). allgather: in
 * place, buf holds tp_size blocks of n elements, this rank's at tp_rank * n, every block
 * filled from its rank (stats: fp32 statistics, else activations). reduce_scatter: send holds
 * tp_size blocks of n activations, recv gets the sum of block tp_rank; send is scratch
 * afterwards (sequence parallel only). */
/* The most tickets one collective returns (a fused gather's: one a rank of the group). */
#define TP_MAX_TICKETS 16
/* alloc (may be NULL: op_alloc): the memory of the activation buffers that the collectives
 * run over (Slot's coll in acts_plan: the branch outputs and input gradients summed in
 * place without sequence parallel; under it the staging buffers gath and full, the head's
 * xf and dxf), zeroed, called with the same sizes in the same order on every rank of the
 * group; free frees it (and op_alloc memory). tensor.c gives them under the fused sums on
 * GPUs: buffers every rank of the group maps, so that a gather writes each rank's rows
 * straight into the others' buffers. */
/* fused_sum_begin (NULL: none; tensor.c gives it where the sums are fused): a
 * row-parallel product's output summed over the group with no collective. N rows of E are
 * cut into tp_size blocks of N / tp_size; the rank computes each other rank's block of its
 * part (rows(arg, r0, rows, out, NULL, res)), which goes into that rank's memory, and its own
 * block, to which the others' parts are added (in the product, rows(arg, r0, rows, out, add,
 * 0) with add: rows of the sum so far, or after it), into dst: dst's rows with scatter
 * (sequence parallel), else block tp_rank of dst [N, E], then gathered whole. res asks for the product's residual too:
 * given in exactly one rank's part of each block. arg (arg_bytes) is copied. Returns the
 * ticket to join, or -1 where it cannot (the caller then sums by the collectives). fill: the
 * caller queues other work before the join (a weight gradient), under which the others'
 * parts travel; else the rank's own rows are made at once and the parts added after them.
 * A sum begun joins the one before it first. */
typedef void (*TpRowsFn)(const void *arg, size_t r0, size_t rows, void *out, const void *add, int res);
/* fused_gather_begin (NULL: none; with fused_sum_begin): buf [N, E] gathered in place, as
 * allgather_begin, in tp_size blocks of N / tp_size rows, this rank's (block tp_rank) in place
 * already; tickets[i] (i < tp_size) to join before block (tp_rank + i) % tp_size is read
 * (-1: nothing to wait for; tickets[0], this rank's own, always), so that a product can run
 * on this rank's rows while the others' travel (on GPUs by the copy engines, no SM). Returns
 * tp_size, or 0 where it cannot (the caller then gathers by the collective). */
typedef struct {
    void *ctx;
    long (*fused_sum_begin)(void *ctx, TpRowsFn rows, const void *arg, size_t arg_bytes, void *dst, size_t N,
                            size_t E, int scatter, int fill);
    int (*fused_gather_begin)(void *ctx, void *buf, size_t N, size_t E, long *tickets);
    void *(*alloc)(void *ctx, size_t bytes);
    void (*free)(void *p);
    long (*allreduce_begin)(void *ctx, void *buf, size_t n, int stats);
    long (*allgather_begin)(void *ctx, void *buf, size_t n, int stats);
    long (*reduce_scatter_begin)(void *ctx, void *send, void *recv, size_t n);
    void (*join)(void *ctx, long ticket);
    void (*flush)(void *ctx);
} ModelTp;

/* A run of a unit's elements that is contiguous both in this rank's unit (local, from the
 * unit's start) and in the whole model's unit (global, the single-process layout): a
 * tensor-parallel rank's slices are strided pieces of the whole, an expert-parallel rank's
 * experts one piece. replicated: the groups whose every rank holds the same values, bits of
 * TP_REPL_TP (the tensor-parallel group: the norms' weights, the router, the head's
 * output_norm) and TP_REPL_EP (expert parallel's ep group: everything but the experts). */
typedef struct { size_t local, global, n; int replicated; } TpRun;
enum { TP_REPL_TP = 1, TP_REPL_EP = 2 };
/* The part of run r within local elements [lo, hi): [*a, *b), and whether it is not empty. */
static inline int tp_run_clip(const TpRun *r, size_t lo, size_t hi, size_t *a, size_t *b) {
    *a = lo > r->local ? lo : r->local;
    *b = hi < r->local + r->n ? hi : r->local + r->n;
    return *a < *b;
}

/* Mixture of experts: how a stage's MoE layers reach the other ranks that share their
 * experts, given from outside (src/parallel/expert.c). allreduce: buf (n fp32 values on the
 * backend) summed over the data-parallel group, in place, the same on every rank, ordered
 * with the ops (the router's statistics: the load-balancing loss is the whole global
 * micro-batch's, whatever the layout). dp: that group's size. NULL allreduce: one rank. */
typedef struct {
    void *ctx;
    void (*allreduce)(void *ctx, float *buf, size_t n);
    int dp;  /* (1 for a MoE model until attached) */
    /* Expert parallel (the model's ep_size > 1): an all-to-all over the ep group, blocking,
     * with the ops' buffers (host memory: CPU ranks). Block j of send (send_bytes[j] bytes,
     * blocks back to back in rank order) goes to rank j, and rank j's block for this rank
     * arrives as block j of recv (recv_bytes[j]). Every rank of the group calls it together. */
    void (*exchange)(void *ctx, const void *send, const size_t *send_bytes, void *recv, const size_t *recv_bytes,
                     const char *what);
} ModelMoe;

typedef struct {
    ModelConfig c;
    int E, NH, HD, H, V, L;  /* embed_dim, heads, head_dim, ffn hidden, vocab, layers */
    /* Tensor parallel: this rank is tp_rank of tp_size and holds heads NHt (= NH / tp_size) of
     * the attention and Ht (= H / tp_size) of the FFN's hidden units in every layer: the q, k,
     * v rows of its heads in qkv_proj and the matching columns of att_out_proj, its rows of
     * gate_proj and up_proj and its columns of down_proj. tp_size = 1: the whole layer. */
    int tp_size, tp_rank, NHt, Ht;
    /* Vocabulary parallel (tp_size > 1): the vocabulary padded to a multiple of 64
     * (model_vocab_padded) is split into tp_size ranges of Vt rows; this rank holds rows
     * [v0, v0 + Vr) of tok_embed and lm_head (Vr < Vt where the range reaches into the
     * padding, which no rank stores). tp_size = 1: v0 = 0, Vt = Vr = V. */
    int Vt, v0, Vr;
    /* Sequence parallel (tp_size > 1, set with m->tp): the residual stream, the norms and the
     * stage's input and output hold this rank's N / tp_size rows of the N = B*T tokens, the
     * rows tp_rank * N / tp_size onwards (tp_size divides context_len); the norms' outputs
     * are all-gathered before qkv_proj, gate_up and lm_head, and the branch outputs
     * reduce-scattered after att_out_proj and down_proj (and the embedding). The norms'
     * weight gradients are then each rank's rows' part, summed over the tp ranks by the
     * strategy before the gradient norm (parallel.c). */
    int sp;
    ModelTp tp;
    /* Mixture of experts: X experts of width He, top K, Hs = the shared experts' width;
     * n_moe the model's MoE layers; moe_layer the layout of a MoE layer (m->layer a dense
     * one's: layer_layout). moe: how the router's statistics reach the other data-parallel
     * ranks (ModelMoe). moe_aux, moe_z: the weights of the load-balancing and z losses, and
     * moe_bias_rate the balancing biases' step (model_moe_set_training). moe_acc: the step's router statistics, per MoE layer X + 3
     * floats (op_moe_accumulate's), on the backend; moe_bias: the experts' selection biases,
     * X per MoE layer (the aux-loss-free balancing; NULL: none), on the backend. */
    int X, He, K, Hs, n_moe;
    /* Expert tensor parallel: this tensor-parallel rank's Het = He / tp_size of each expert's
     * hidden units (its rows of gate_proj and up_proj, its columns of down_proj) and Hst =
     * Hs / tp_size of the shared experts'; the router is whole on every rank (replicated). */
    int Het, Hst;
    /* Expert parallel: this rank is ep_rank of ep_size ranks that share out the experts; its
     * MoE layers hold experts [x0, x0 + Xl) (Xl = X / ep_size, x0 = ep_rank Xl), everything else
     * whole, like every rank of its group. ep_size = 1: every expert. */
    int ep_size, ep_rank, Xl, x0;
    LayerLayout moe_layer;
    ModelMoe moe;
    float moe_aux, moe_z, moe_bias_rate;
    float *moe_acc, *moe_bias, *moe_bias_host;  /* (moe_bias_host: moe_bias's host copy) */
    int n_units;
    Unit *units;
    LayerLayout layer;
    size_t head_out_norm, head_lm;  /* offsets inside the head unit; head_lm unused if tied */
    size_t n_params;                /* real parameters (of the whole model, whatever this layout holds) */
    size_t *packed;                 /* per unit: where it starts in the packed order (checkpoints) */
    size_t n_flat;                  /* flat buffer length incl. padding */
    float *params, *grads;          /* host fp32 flat buffers (model_init_layout with alloc) */
    /* Where each unit's parameters and gradients are now, in the ops' state type (fp32, or
     * bf16 with precision=bf16: ops_state_size). The model reads only these, so a parallel
     * strategy can point a unit at a gathered copy (FSDP) or a gradient slot. */
    void **uparams, **ugrads;
    /* With precision=mixed: where each unit's bf16 copy of its parameters is, which the ops
     * read instead of uparams; the strategy that owns the parameters keeps it current. NULL
     * entries (fp32, and bf16 whose parameters are the compute weights): the ops read uparams. */
    void **ucompute;
    /* Each layer's forward and backward as recorded graphs of ops (model_use_graphs; NULL:
     * op by op) */
    struct LayerGraphs *graphs;
} Model;

/* Units by name: the embedding, layer l, the head (output_norm and lm_head). */
#define UNIT_EMBEDDING 0
static inline int unit_of_layer(int l) { return 1 + l; }
static inline int unit_head(const Model *m) { return m->L + 1; }
static inline int unit_is_layer(const Model *m, int u) { return u > UNIT_EMBEDDING && u < unit_head(m); }
static inline int layer_of_unit(int u) { return u - 1; }

/* A stage: the contiguous units [first, last] that one pipeline stage computes. The
 * stage that holds the embedding reads the tokens; the one that holds the head computes the
 * loss. Its input (the residual stream from the stage before) and output (to the stage
 * after), and their gradients, are plain [N, E] activation buffers of its Acts
 * (model_stage_input, model_stage_output, model_stage_grad; under sequence parallel the
 * rank's model_stage_rows of the N). One process is the stage
 * holding every unit (model_whole). The last pipeline stage may hold the head alone
 * (first = last = unit_head: stage_n_layers 0, its input the head's). */
typedef struct { int first, last; } Stage;
static inline Stage model_whole(const Model *m) { return (Stage){UNIT_EMBEDDING, unit_head(m)}; }
static inline int stage_has_embedding(const Stage *s) { return s->first == UNIT_EMBEDDING; }
static inline int stage_has_head(const Model *m, const Stage *s) { return s->last == unit_head(m); }
/* The layers a stage holds: [first_layer, first_layer + n). */
static inline int stage_first_layer(const Stage *s) { return s->first == UNIT_EMBEDDING ? 0 : layer_of_unit(s->first); }
static inline int stage_n_layers(const ModelConfig *c, const Stage *s) {
    int last = s->last == c->n_layers + 1 ? c->n_layers - 1 : layer_of_unit(s->last);  /* the head is unit L + 1 */
    return last - stage_first_layer(s) + 1;
}

/* Called by the model at unit boundaries, so that a strategy applied from outside can
 * gather parameters, start gradient reductions and overlap them with compute. Any hook may
 * be NULL. `next` is the unit the model will need after this one (-1: none), for prefetch. */
typedef struct {
    void *ctx;
    void (*gather)(void *ctx, int unit, int next);  /* parameters of unit needed from now */
    void (*release)(void *ctx, int unit);           /* ... no longer needed for now */
    void (*grad_begin)(void *ctx, int unit);        /* gradient of unit about to accumulate */
    void (*grad_ready)(void *ctx, int unit);        /* gradient of unit is complete */
    /* 0: layer 0's last weight gradients wait until after the embedding's backward, so that
     * the embedding's reduction (the largest unit's) overlaps them. 1: layer 0 completes
     * first, and its reduction overlaps the embedding's backward (DDP, when it reduces only
     * the embedding rows a step uses, which are few). */
    int embed_last;
} UnitHooks;

/* One named tensor of the model, for checkpoints, fixtures and printing. */
typedef struct { char name[64]; size_t offset; int rows, cols, unit; } TensorInfo;
/* Fills up to max entries (in flat order); returns the count (model_n_tensors). */
int model_tensors(const Model *m, TensorInfo *out, int max);
/* How many model_tensors lists: 2 + 7 per dense layer + per MoE layer 5 + 3 X (+ 3 with
 * shared experts) + (tied ? 0 : 1). */
int model_n_tensors(const ModelConfig *c);
/* The layout of layer l's tensors in its unit (dense or MoE). */
static inline const LayerLayout *layer_layout(const Model *m, int l) {
    return model_layer_is_moe(&m->c, l) ? &m->moe_layer : &m->layer;
}

/* Parameter count without building anything (estimate uses it). */
size_t model_param_count(const ModelConfig *c);
/* ... of them, those a token computes with: every routed expert but its top_k left out. */
size_t model_active_param_count(const ModelConfig *c);
/* Mixture of experts' settings checked (top_k <= experts, shapes, every field in its range);
 * 0 or -1 with a one-line message naming the key. Dense configs pass. */
int model_moe_check(const ModelConfig *c, char *err, size_t errlen);
/* Sets shapes and layout; allocates params and grads (zeroed, host memory: for tools and
 * tests that hold a whole model on the host) unless alloc == 0. The trainer's strategies
 * allocate on the backend instead (op_alloc) and point the units there. */
void model_init_layout(Model *m, const ModelConfig *c, int pad_multiple, int alloc);
/* The same, holding only the units of stages s[0..n_stages) (one pipeline rank's: one, or
 * its chunks when interleaved), and, with the last stage, a copy of a tied embedding for
 * lm_head: the others keep their index but have no storage (n = n_padded = 0). s = NULL:
 * every unit. */
void model_init_layout_stage(Model *m, const ModelConfig *c, int pad_multiple, int alloc, const Stage *s, int n_stages);
/* The same for tensor-parallel rank tp_rank of tp_size (which divides n_heads, the FFN
 * width and the padded vocabulary, model_tp_check): each layer unit holds its slices only,
 * in the layer's order (LayerLayout's offsets are then this rank's); the embedding and
 * lm_head hold the rank's vocabulary rows (Model's v0, Vr), output_norm is whole
 * (replicated). The tensor-parallel collectives are set afterwards in m->tp. */
void model_init_layout_tp(Model *m, const ModelConfig *c, int pad_multiple, int alloc, const Stage *s, int n_stages,
                          int tp_size, int tp_rank);
/* The same for expert-parallel rank ep_rank of ep_size too (which divides moe_experts): each
 * MoE layer unit holds the rank's experts (Model's x0, Xl; under tensor parallel their slices)
 * after its other tensors, which every rank of the ep group holds alike (replicated runs of
 * model_tp_runs, TP_REPL_EP). */
void model_init_layout_ep(Model *m, const ModelConfig *c, int pad_multiple, int alloc, const Stage *s, int n_stages,
                          int tp_size, int tp_rank, int ep_size, int ep_rank);
/* Unit u's elements as runs (TpRun) in local order, covering [0, units[u].n); returns the
 * count (at most model_tp_max_runs), 0 for a unit this layout does not hold. */
int model_tp_runs(const Model *m, int u, TpRun *out, int max);
/* The vocabulary padded for vocabulary parallel: vocab_size rounded up to 64 (the logits'
 * row stride). */
static inline int model_vocab_padded(int V) { return (V + 63) / 64 * 64; }
/* 0 when tp ranks can split this model (tp divides n_heads, the FFN width, the padded
 * vocabulary and a MoE model's expert width, and every rank gets vocabulary rows); else -1
 * with a one-line message. */
int model_tp_check(const ModelConfig *c, int tp, char *err, size_t errlen);
int model_tp_max_runs(const Model *m);
/* on != 0: from here each layer's training forward and backward on one tensor-parallel rank
 * (tp_size 1) are recorded once per buffer set as a graph of ops and replayed (layer_graphs.h):
 * bitwise the same work, launched at once. Call between steps, once the first steps have
 * set the ops' plans (and tuned the matmuls). 0: op by op again. */
void model_use_graphs(Model *m, int on);
void model_free(Model *m);
/* GPT-2 init: normal(0, 0.02); att_out_proj and down_proj scaled by 1/sqrt(2L); norms 1. */
void model_init_weights(Model *m, uint64_t seed);
/* The same init for unit u alone, into buf (n_padded floats, padding zeroed). */
void model_init_unit(const Model *m, int u, float *buf, uint64_t seed);
/* ... for elements [lo, hi) of unit u alone (offsets within the unit), into buf[0, hi-lo):
 * the same values as those elements of model_init_unit, at a fraction of the work. */
void model_init_range(const Model *m, int u, size_t lo, size_t hi, float *buf, uint64_t seed);

static inline void *unit_params(const Model *m, int u) { return m->uparams[u]; }
/* The weights the ops compute with: the bf16 copy when there is one, else the parameters. */
static inline const void *unit_weights(const Model *m, int u) {
    return m->ucompute[u] ? (const void *)m->ucompute[u] : (const void *)m->uparams[u];
}
static inline void *unit_grads(const Model *m, int u) { return m->ugrads[u]; }
/* Points every unit at its slice of the flat buffers params/grads, of the ops' state type
 * (either may be NULL). */
void model_point_units(Model *m, void *params, void *grads);
/* lm_head's compute weights: tok_embed's when tied. */
const void *model_lm_head(const Model *m);

/* Activations for a B x T batch, planned once. Every buffer is op_alloc memory (on the
 * backend's device) except inputs, targets and host_losses. `void *` buffers hold
 * activations (fp32 or bf16: ops_act_size()), `float *` ones fp32 statistics. */
typedef struct {
    int B, T;
    int recompute;          /* activation checkpointing: see ACTS_RECOMPUTE */
    int head_split;         /* ACTS_HEAD_SPLIT: the head's backward waits for B and W, its
                             * logits' gradient kept whole ([N, V]) in logits meanwhile */
    size_t N, logit_rows;   /* N = B*T; logits are computed logit_rows rows at a time */
    int *inputs, *targets;  /* host: the loader fills them; model_step uploads them */
    int *dev_inputs, *dev_targets;
    /* the inputs grouped by token (embedding_rows_index), for the embedding's backward:
     * built on the host (emb_count: V ints of scratch), uploaded to dev_emb_index */
    int *emb_index, *emb_count, *dev_emb_index, emb_nr;
    float *host_losses;     /* [N] per-row losses, downloaded for the mean */
    void *res;              /* [L+1][N*E] residual stream: input of each layer, then the last output */
    void *xn1, *qkv, *att, *mid, *xn2, *gu, *hsw;  /* per layer */
    float *rstd1, *lse, *rstd2;
    void *xf;               /* final norm output */
    float *rstdf;
    void *logits;           /* [logit_rows, V] (tensor parallel: [logit_rows, the rank's Vr]) */
    float *ce_stats;        /* tensor parallel: [tp][logit_rows][3], each rank's cross-entropy statistics */
    float *losses;          /* [N] */
    void *dres, *dxf, *dqkv, *datt, *dgu, *dh, *dxn;  /* backward scratch, reused per layer */
    /* sequence parallel: [N, E] scratch for a gathered norm output (gath) and for a
     * product's partial sum or a gathered gradient (full) */
    void *gath, *full;
    float *rope_cos, *rope_sin;
    /* Mixture of experts, per MoE layer of the stage (one where the forward is recomputed or
     * only inferred; their routing is the forward's, made again): the router's logits and
     * scores [N, X], its choices idx, their gates and rows pos [N, K], lse [N], the rows'
     * tokens and gates [P], the dispatch's counts cnt [3X + 1] (also on the host: moe_hcnt),
     * the experts' gate|up outputs moe_gu [P, 2 He], and the shared experts' sgu [N, 2 Hs],
     * shsw [N, Hs]; the router's statistics moe_stats [2X + 2] per MoE layer always (kept for
     * the backward, and made once per micro-batch). Scratch for one layer: moe_xa, moe_xb [P, E],
     * moe_h1, moe_h2 [P, He], moe_dgu [P, 2 He], moe_dlogits [N, X], moe_dgate [P]. P is
     * model_moe_max_rows. grad_scale: the forward's, for the backward's router. */
    float *moe_logits, *moe_probs, *moe_gate, *moe_lse, *moe_grow, *moe_stats;
    int *moe_idx, *moe_pos, *moe_rowtok, *moe_cnt, *moe_hcnt;
    void *moe_gu, *sgu, *shsw;
    void *moe_xa, *moe_xb, *moe_h1, *moe_h2, *moe_dgu;
    float *moe_dlogits, *moe_dgate, *moe_rgate;
    float grad_scale;
    size_t bytes;
    void (*buf_free)(void *p);  /* frees the buffers where ModelTp's alloc made some (NULL: op_free) */
} Acts;

/* `training`: 0 = inference (one layer's activations, reused), 1 = training (every layer's
 * activations kept for backward), ACTS_RECOMPUTE = training with activation checkpointing:
 * only each layer's input is kept, and the backward recomputes the layer's forward into
 * one layer's buffers before its backward (one more forward of the layers per step).
 * Bytes the activations of a B x T step take with act_size-byte activations (4: fp32,
 * 2: bf16); the estimator and acts_alloc share it. */
#define ACTS_RECOMPUTE 2
/* Or'd into `training` for a pipeline's last stage under GPipe and zb1: the forward computes
 * the logits' gradient (as the fused head does) but keeps it, N x V per micro-batch in flight,
 * and the head's backward runs with the stage's backward (B: d(head input); W, or B where the
 * schedule has no W: the weight gradients of lm_head and output_norm). A last stage whose
 * forward held the whole head's forward and backward (three matrix products of V x E) stalled
 * the schedules that separate forwards from backwards (bench/pp_sim.c). */
#define ACTS_HEAD_SPLIT 4
size_t acts_bytes(const ModelConfig *c, int B, int T, int training, size_t act_size, size_t *logit_bytes);
size_t acts_logit_rows(const ModelConfig *c, int B, int T, size_t act_size);
void acts_alloc(Acts *a, const Model *m, int B, int T, int training);
/* The same for one stage: its own layers' activations, and the head's buffers only where
 * it holds the head. */
size_t acts_bytes_stage(const ModelConfig *c, const Stage *s, int B, int T, int training, size_t act_size,
                        size_t *logit_bytes);
/* ... on a tensor-parallel rank of tp ranks (the layers' head and FFN activations and the
 * logits shrink; with sp, sequence parallel, the residual stream and the norms too). */
/* ep: expert parallel's ranks (a MoE layer's experts take the rows every rank of the ep
 * group sends them: model_moe_expert_rows). */
size_t acts_bytes_tp(const ModelConfig *c, const Stage *s, int B, int T, int training, size_t act_size,
                     size_t *logit_bytes, int tp, int sp, int ep);
void acts_alloc_stage(Acts *a, const Model *m, const Stage *s, int B, int T, int training);
/* What the buffers ModelTp's alloc gives take beyond the plan's bytes (acts_bytes_tp), summed,
 * where a buffer of b bytes takes extra(b) more (tensor.c's mapped buffers: whole pages). */
size_t acts_tp_coll_extra(const ModelConfig *c, const Stage *st, int B, int T, int training, size_t act_size, int tp,
                          int sp, size_t (*extra)(size_t bytes));
/* Memory the tensor-parallel collectives may run over (ModelTp's alloc, else op_alloc; the
 * zero-bubble weight pass's buffer), and its free. */
void *model_tp_alloc(const Model *m, size_t bytes);
void model_tp_free(const Model *m, void *p);
/* A smaller batch (B <= a->B) in a's buffers, for a forward without gradients (the
 * validation batch of a short shard): every buffer of a holds it. Not to be freed. */
void acts_view(Acts *v, const Acts *a, const Model *m, int B);
void acts_free(Acts *a);

/* One micro-batch through a stage (a schedule's forward and backward actions).
 * model_forward: the stage holding the embedding reads a->inputs (and uploads a->targets
 * when it also holds the head); any other stage reads model_stage_input(a). The layers run,
 * and a stage without the head leaves its output in model_stage_output(a). The stage with
 * the head computes the per-row losses (model_loss reads their mean) and, with grad != 0,
 * already the head's backward (fused per chunk of logits, scaled so the gradient is that of
 * the mean loss times grad_scale), leaving d(loss)/d(trunk output) in model_stage_grad(a).
 * model_backward (after model_forward with grad != 0): a stage without the head expects
 * d(loss)/d(its output) in model_stage_grad(a); the layers' backward ACCUMULATES parameter
 * gradients into the units' gradients, and a stage without the embedding leaves
 * d(loss)/d(its input) in model_stage_grad(a). Nothing waits for the device. */
void model_forward(Model *m, const Stage *s, Acts *a, int grad, float grad_scale, const UnitHooks *hooks);
void model_backward(Model *m, const Stage *s, Acts *a, const UnitHooks *hooks);
/* The backward split in two, for the zero-bubble schedule (zb1). model_backward_input:
 * model_backward's d(loss)/d(input) (left in model_stage_grad(a)) without any weight
 * gradient; what the weight gradients need is kept in wbuf (model_wgrad_bytes). Then
 * model_backward_weight ACCUMULATES the weight gradients from wbuf and a's activations
 * (the embedding's too, on the first stage), needing no weights: a's activations and wbuf
 * stay untouched in between. The hooks: gather/release in the first, grad_begin/grad_ready
 * in the second. Activation checkpointing is not supported (the layers' activations must
 * all be kept). */
size_t model_wgrad_bytes(const ModelConfig *c, const Stage *s, int B, int T, size_t act_size);
void model_backward_input(Model *m, const Stage *s, Acts *a, void *wbuf, const UnitHooks *hooks);
void model_backward_weight(Model *m, const Stage *s, Acts *a, void *wbuf, const UnitHooks *hooks);
void *model_stage_input(const Model *m, const Acts *a);
/* training: as model_forward's grad (a forward without gradients leaves it elsewhere) */
void *model_stage_output(const Model *m, const Stage *s, const Acts *a, int training);
void *model_stage_grad(const Acts *a);
/* The rows of those three buffers (of E activations each): a->N, or this rank's a->N /
 * tp_size under sequence parallel. */
size_t model_stage_rows(const Model *m, const Acts *a);

/* Forward over a->inputs; mean cross-entropy against a->targets. With grad != 0 also runs
 * the backward and ACCUMULATES parameter gradients into m->grads (scaled so the gradient is
 * that of the mean loss times grad_scale). The whole model as one stage. */
float model_step(Model *m, Acts *a, int grad, float grad_scale, const UnitHooks *hooks);
/* model_step in two halves: the work enqueued on the device (nothing waits for it), then the
 * mean loss (waits for everything queued). Training reads the loss after the optimizer step
 * is queued, so that the device goes from the backward into the update without a pause. */
void model_enqueue_step(Model *m, Acts *a, int grad, float grad_scale, const UnitHooks *hooks);
float model_loss(Acts *a);
/* Forward of T tokens (B = 1 prefix) giving logits [V] of the last position only, into the
 * host buffer `logits` (fp32 whatever the activations' type). */
void model_last_logits(Model *m, Acts *a, const int *tokens, int T, float *logits);
/* FLOPs per token of forward+backward (6 x matmul params + causal attention), for MFU: a
 * MoE model's active parameters only. */
double model_flops_per_token(const ModelConfig *c, int T);

/* ---- mixture of experts' state beyond the parameters (model_moe.c) ----
 * model_moe_alloc: moe_acc (zeroed) and, with bias balancing, moe_bias (zero) on the
 * backend, for every MoE layer of the model; nothing for a dense model.
 * model_moe_set_training: the weights of the load-balancing and z losses in the gradient, and
 * the rate of the selection biases' steps (model_moe_balance).
 * model_moe_take_stats: the step's moe_acc downloaded into host (n_moe (X + 3) floats, zero for
 * layers this process does not hold) and zeroed for the next step. */
void model_moe_alloc(Model *m, int bias);
void model_moe_free(Model *m);
void model_moe_set_training(Model *m, float aux, float z, float bias_rate);
/* moe_bias (model_moe_alloc's with bias) from host: n_moe x X floats. */
void model_moe_set_bias(Model *m, const float *host);
/* The aux-loss-free balancing's step (DeepSeek-V3's): each expert's bias moves by rate toward
 * the mean load, up where the expert had fewer than its layer's mean of the step's choices,
 * down where more (stats: n_moe (X + 3) values as model_moe_take_stats gives them, the same on
 * every rank, so every rank moves its biases alike); rate moe_bias_rate. */
void model_moe_balance(Model *m, const double *stats);
void model_moe_take_stats(Model *m, float *host);
#endif
