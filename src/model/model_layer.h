/* model_layer.h: what the model's own files share (not for the rest of the program): a layer's
 * activations, its forward and backward (layer.c), tensor parallel's collectives around its
 * matrix products (layer_tp.c), used by the stages' forward and backward (stage.c). */
#ifndef MESHTRAIN_MODEL_LAYER_H
#define MESHTRAIN_MODEL_LAYER_H
#include "model.h"
#include "ops.h"

#define RMS_EPS MODEL_RMS_EPS
#define ROPE_BASE MODEL_ROPE_BASE

/* Per-layer activation pointers: the layer's input and output in residual slots r and r+1,
 * everything else in layer slot `slot`. A MoE layer's FFN (layer_moe.c): gu and hsw are its
 * shared experts' (NULL without), and the routing's, the experts' and the statistics'
 * buffers (Acts' moe_*) are in MoeActs. */
/* A MoE layer's dispatch counts on the host (hcnt), per layer: op_moe_dispatch's 3X + 1,
 * then under expert parallel the rows each rank of the ep group sends each of this rank's
 * experts (X: Xl a rank, in rank order). */
#define MOE_HCNT(X) (4 * (size_t)(X) + 1)
typedef struct {
    float *logits, *probs, *gate, *lse, *grow, *stats;
    int *idx, *pos, *rowtok, *cnt, *hcnt;
    void *gu;
} MoeActs;
typedef struct {
    void *x, *xn1, *qkv, *att, *mid, *xn2, *gu, *hsw, *out;
    float *rstd1, *lse, *rstd2;
    MoeActs moe;
} LayerActs;
/* A layer's gradients that the split backward's weight pass needs, kept by its input pass
 * (model_backward_input; wgrad_at) */
typedef struct { void *dout, *dgu, *dxn2, *dmid, *dqkv, *dxn1; } WGrad;

/* Rows of the residual stream a rank holds for N tokens: all of them, or under sequence
 * parallel its N / tp_size (the rows tp_rank * N / tp_size onwards). */
static inline size_t held_rows(const Model *m, size_t N) { return m->sp ? N / (size_t)m->tp_size : N; }

/* The tickets of one collective (n = 0: nothing was begun); rot: a fused gather's, ticket i
 * for the block of rows (tp_rank + i) % tp_size (ModelTp's fused_gather_begin). */
typedef struct { long t[TP_MAX_TICKETS]; int n, rot; } Tickets;
/* One matrix product of a layer: the forward's out = inp @ w^T (+ res when res: out and res
 * [N, OC], inp [N, C]), or with bwd the input gradient out = inp @ w (inp = d(output)
 * [N, OC], out [N, C]; written, not added); a fused sum or gather runs it a block of rows at
 * a time. */
typedef struct { int bwd; void *out; const void *inp, *w, *res; int C, OC; } Product;

/* ---- a layer (layer.c) ---- */

/* Layer l's: slot is its index in the stage (every layer's activations kept) or 0 (one
 * layer's, reused), r its index in the stage while training (0 in inference). */
LayerActs layer_acts(const Model *m, const Acts *a, int l, int slot, int r);
/* recompute: activation checkpointing's forward in the backward */
void layer_forward(const Model *m, const Acts *a, int l, const LayerActs *la, int B, int T, int recompute);
/* defer: leaves the weight gradients of gate_up and qkv to layer_backward_deferred */
void layer_backward(Model *m, Acts *a, int l, const LayerActs *la, int defer);
void layer_backward_deferred(Model *m, Acts *a, int l, const LayerActs *la);
/* the backward split in two (zero-bubble schedules): the input pass keeps wg for the weight pass */
WGrad wgrad_at(const Model *m, void *buf, int i, size_t N);
void layer_backward_input(Model *m, Acts *a, int l, const LayerActs *la, const WGrad *wg);
void layer_backward_weight(Model *m, Acts *a, int l, const LayerActs *la, const WGrad *wg);
/* the passes of a layer as recorded graphs (layer_graphs.h), where layer_graphed says */
enum { LG_FORWARD, LG_RECOMPUTE, LG_BACKWARD, LG_INPUT, LG_WEIGHT };  /* (the last two: the split passes) */
int layer_graphed(const Model *m);
void layer_run_graphed(Model *m, Acts *a, int l, const LayerActs *la, const WGrad *wg, int kind, int defer);

/* ---- a MoE layer's FFN (layer_moe.c): from la->xn2 into la->out (la->mid + the FFN; with
 * recompute only what the backward needs), and its backward from a->dres into a->dxn (written)
 * and the layer's weight gradients. moe_stage_stats: after a training forward of the stage's
 * layers [l0, l0 + n), their router statistics summed over the data-parallel ranks (one
 * collective) and added to the step's (moe_acc). ---- */
void moe_ffn_forward(const Model *m, const Acts *a, int l, const LayerActs *la, int N, int recompute);
void moe_ffn_backward(Model *m, Acts *a, int l, const LayerActs *la);
void moe_stage_stats(const Model *m, const Acts *a, int l0, int n);

/* ---- tensor parallel's collectives in a layer (layer_tp.c) ---- */

void tp_flush(const Model *m);
void tp_join(const Model *m, long t);
void tp_join_all(const Model *m, const Tickets *ts);
/* the sum over the tp ranks of their parts (all-reduce, or under sequence parallel reduce-scatter) */
void branch_sum(const Model *m, void *dst, void *src, int N);
/* the whole of what the ranks hold a row range each (sequence parallel), begun, or joined */
const void *seq_gather_begin(const Model *m, void *buf, const void *part, int N, Tickets *ts);
const void *seq_gather(const Model *m, void *buf, const void *part, int N);
/* a product on gathered rows, or a product whose output is summed */
void product_after(const Model *m, const Product *p, const Tickets *ts, int N);
void product_then_sum(const Model *m, const Product *p, void *dst, int N, Tickets *ts, int fill);
void input_then_weight(const Model *m, Acts *a, void *dx, void *dw, const void *dout, const void *inp,
                       const Tickets *gx, const void *w, int N, int C, int OC);

#endif
