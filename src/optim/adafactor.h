/* adafactor — Adafactor (Shazeer & Stern 2018, as Hugging Face transformers' Adafactor
 * implements it) as an optimizer of the layer (optim_impl.h: adafactor.c fills its table),
 * the plan of its step over the model's flat units, and its scalar arithmetic. The step
 * strings the op_adafactor_* kernels together, with two sums over the ranks between them
 * (optim_stats: its two statistics rounds, which the strategy's ranks sum).
 *
 * Every 2-D tensor (model_tensors) keeps a row statistic R [rows] and a column statistic
 * C [cols], running averages of the row and column means of g^2 + eps1; a vector (a norm's
 * weight, rows == 1) keeps its full second moment v [cols]. They live in one fp32 array of
 * n_stats values (tensor k's at stat). A rank that updates only its shard of each unit
 * (ZeRO, FSDP) covers part of some tensors, possibly from the middle of a row: its
 * segments (AdafactorSeg, ops.h) are those parts, and the partial row and column sums of
 * g^2, and the per-tensor sums of u^2 and param^2, are summed over the shard group before
 * use, so every rank holds the same statistics and takes the update one process would.
 * Tensor parallel is the same on another axis: a tp rank holds a slice of a matrix (rows:
 * qkv's heads, gate's and up's units, the vocabulary; columns: att_out's and down's) but
 * keeps the whole matrix's statistics (rows, cols and numel below are the whole tensor's);
 * a row slice's segments are parts of the whole matrix (its rows land in their own row
 * statistics, zeros in the others'), a column slice's are of its own matrix with col0
 * (ops.h), and the sums are summed over the tp group too, the tensors every tp rank holds
 * alike (replicated) counted by tp rank 0 alone.
 *
 * In a checkpoint the statistics take the place of AdamW's v, in packed order: tensor k's
 * R then C (or v) are the values at the first rows + cols (cols) packed positions of the
 * tensor, the rest 0; the first moment (or 0 without one) takes m's. So they are saved and
 * read by whichever ranks own those positions, on any layout. */
#ifndef MESHTRAIN_ADAFACTOR_H
#define MESHTRAIN_ADAFACTOR_H
#include <stddef.h>
#include <stdint.h>
#include "model.h"
#include "ops.h"
#include "optim.h"

#define ADAFACTOR_EPS1 1e-30  /* added to g^2 (the paper's eps1) */
#define ADAFACTOR_EPS2 1e-3   /* the least parameter scale (eps2) */

typedef struct {
    int rows, cols, unit; /* the whole tensor's shape (a tensor-parallel rank holds a slice) */
    size_t offset;        /* in its unit, in this layout (elements) */
    size_t stat;          /* its statistics in the stats array */
    uint64_t packed;      /* its first element in packed order (checkpoints) */
    int replicated;       /* tensor parallel: every tp rank holds it alike (the norms) */
} AfTensor;

typedef struct {
    int n_tensors, n_units;
    AfTensor *t;
    size_t n_stats;
    /* this rank's parts of the tensors, unit by unit: unit u's are segs[useg[u] .. useg[u+1]),
     * with offsets relative to the start of what the rank updates of unit u; seg_tensor[i]
     * is segment i's tensor */
    AdafactorSeg *segs;
    int *seg_tensor, *useg, n_segs;
    int tp_rank;  /* of the layout (0 without tensor parallel) */
} AfPlan;

/* The tensors of the units this layout holds (n_padded > 0), and the segments of a rank
 * that updates elements [r * n_padded / D, (r + 1) * n_padded / D) of every unit (D = 1:
 * whole units), of this layout's tensor-parallel slices. */
void af_plan_init(AfPlan *p, const Model *m, int D, int r);
void af_plan_free(AfPlan *p);
/* Statistics of a layout's tensors, the whole tensors' under tensor parallel (for the estimate). */
size_t af_stats_count(const Model *m);
/* Statistics count of one tensor. */
static inline size_t af_tensor_stats(int rows, int cols) { return rows == 1 ? (size_t)cols : (size_t)rows + cols; }

/* Optimizer step t (from 1): beta2_t = 1 - t^-decay; the step size before parameter
 * scaling: the lr schedule's rate for step t, or with af_relative_step min(1e-2, 1/sqrt t). */
float af_beta2(const OptimConfig *c, int t);
double af_rate(const OptimConfig *c, int t);
/* A tensor's coefficients of op_adafactor_update from its sums over all ranks: su2 of u^2
 * and sp2 of param^2, over numel elements: lr_t = rate (x max(eps2, RMS(param)) with
 * parameter scaling), coef = lr_t / max(1, RMS(u) / d), decay = 1 - lr_t weight_decay. */
void af_coef(const OptimConfig *c, double rate, double su2, double sp2, size_t numel, float *coef, float *decay);

/* The plan of an Adafactor optimizer's rank (NULL for another optimizer). */
const AfPlan *adafactor_plan(const Optimizer *o);

/* Checkpoints: the values of packed positions [start, start + n) of the statistics'
 * section (stats: host copy of the n_stats values), and the ranges of packed order that
 * hold them (one per tensor: [packed, packed + af_tensor_stats)). */
void af_pack(const AfPlan *p, const float *stats, uint64_t start, uint64_t n, float *out);
#endif
