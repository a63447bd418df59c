/* parallel — the data-parallel strategies, applied to the model from outside through its
 * unit hooks and flat units: DDP, ZeRO-1, ZeRO-2, FSDP (ZeRO-3) and hybrid FSDP. One
 * process is DDP over a group of one. Each strategy is one table of functions with its own
 * state, in its own file (ddp.c, zero.c, fsdp.c); parallel.c runs this interface through
 * the table and holds what they share (parallel_impl.h: shards, slots, norms, and the
 * optimizer of what the rank updates: src/optim's Optimizer, its state where its
 * placement puts it). */
#ifndef MESHTRAIN_PARALLEL_H
#define MESHTRAIN_PARALLEL_H
#include <stddef.h>
#include <stdint.h>
#include "mesh.h"
#include "model.h"
#include "optim.h"

typedef enum { PAR_DDP, PAR_ZERO1, PAR_ZERO2, PAR_FSDP, PAR_HYBRID } ParallelKind;
const char *parallel_kind_name(ParallelKind k);

typedef struct Parallel Parallel;

/* Builds the strategy's storage for a model laid out with pad_multiple = the shard group
 * size (model_init_layout(..., alloc = 0)); points the model's units at it. overlap = 0
 * waits for every collective as soon as it starts (for measuring what overlap buys). oc
 * says which optimizer's state to keep (its kind; Adafactor's beta1) and where (offload);
 * NULL = AdamW on the device. Every parallel_step must then pass an OptimConfig of the
 * same kind. */
Parallel *parallel_create(ParallelKind kind, Model *m, Mesh *mesh, int overlap, const OptimConfig *oc);
void parallel_free(Parallel *p);
/* DDP: gradients of units that finish one after another (adjacent in the flat buffer) are
 * all-reduced together until they hold at least `bytes` (0 = one collective per unit). */
void parallel_set_bucket(Parallel *p, size_t bytes);
/* DDP over several ranks with an untied embedding: whether the trainer should say, before
 * each step, which embedding rows the step's global batch uses (ascending, distinct: from
 * loader_batch_tokens). That step's embedding gradient is then all-reduced in those rows
 * only, the others being zero on every rank; with more rows than a quarter of the
 * vocabulary, or without the call, the whole unit is. For one step. */
int parallel_wants_embedding_rows(const Parallel *p);
void parallel_set_embedding_rows(Parallel *p, const int *rows, size_t n);
const UnitHooks *parallel_hooks(Parallel *p);

/* grad_compression: DDP's gradient all-reduce compressed (bf16, or int8 with block scales, or
 * PowerSGD after its warmup steps), with error feedback (compress.h), on CPU ranks; kind 0 =
 * none. Returns -1 with err where the strategy or layout does not take it.
 * parallel_compression_state: its state (this rank's residuals e[n_e] of the values it sends;
 * f[n_f]: of its blocks of the means, or PowerSGD's Q), NULL without. */
int parallel_set_compression(Parallel *p, int kind, int rank, int warmup, double min_rate, char *err, size_t errlen);
float *parallel_compression_state(Parallel *p, size_t *n_e, float **f, size_t *n_f);

/* The model's init (model_init_unit), into whatever this rank holds. */
void parallel_init_weights(Parallel *p, uint64_t seed);

/* Before a step's forward: clears gradients. */
void parallel_begin_step(Parallel *p);
/* After parallel_begin_step: the step runs n micro-batches (gradient accumulation, pipeline
 * parallel; 1 needs no call). Where the strategy keeps whole gradients (DDP, ZeRO-1) a
 * unit's accumulate locally and are reduced once, when its n-th is complete (whatever order
 * the schedule runs the micro-batches in); where each unit's gradient is reduce-scattered
 * into this rank's shard as soon as it is complete (ZeRO-2, FSDP, hybrid) every
 * micro-batch's is added into the shard. */
void parallel_set_micro_batches(Parallel *p, int n);
/* Pipeline parallel: this rank holds one stage of a pipeline whose stages are `stages`
 * (a group of one: no pipeline); the gradient norm is summed over them. count_embedding = 0
 * on the last stage that holds a copy of the tied embedding (the first stage counts it). */
void parallel_set_stages(Parallel *p, const Comm *stages, int count_embedding);
/* After the backward: finishes the gradient reductions, computes the global gradient norm,
 * clips, runs the optimizer's update on what this rank owns, and makes parameters whole
 * again where the strategy keeps them whole (ZeRO: started here, waited for by the next
 * forward's gather hooks). Returns the norm (before clipping); *lr gets the rate used. */
double parallel_step(Parallel *p, const OptimConfig *oc, double *lr);
/* A fault hook for tests (MESHTRAIN_FAULT_OVERFLOW): in the step about to run, the first
 * unit gradient this rank completes other than the embedding's gets a non-finite element
 * (its last, which lies in the last shard of the unit), before any reduction, as an fp16
 * overflow in the backward would. */
void parallel_inject_overflow(Parallel *p);
/* offload=optimizer: waits until every unit's update is done and its parameters are
 * back on the device (before a checkpoint reads them); nothing to do without offload. */
void parallel_sync(Parallel *p);
/* offload=optimizer: the update thread's time in updates, and this thread's time waiting
 * for them before a unit's forward (totals in seconds since the start; 0 without offload). */
void parallel_offload_times(Parallel *p, double *update_s, double *wait_s);
/* 1 when the optimizer's state (the moments in parallel_ranges, its per-tensor state) is
 * host memory (offload): read and written directly, not staged; 2 when the parameters of
 * parallel_ranges are too (offload=params, and lean offload=optimizer: DDP with AdamW,
 * whose host master copy is the parameters' only fp32 copy). */
int parallel_state_on_host(const Parallel *p);
/* The optimizer's completed steps (a checkpoint's adam_step). */
int parallel_adam_steps(const Parallel *p);
void parallel_set_adam_steps(Parallel *p, int steps);
/* The parameters were written from outside (a checkpoint loaded into parallel_ranges):
 * copies made from them (precision=mixed's bf16 weights) are remade before next use. */
void parallel_params_changed(Parallel *p);
/* Seconds of the last step this rank waited on collectives with nothing left queued on its
 * device: communication the compute did not hide. */
double parallel_comm_wait(const Parallel *p);

/* The optimizer of what this rank updates (its kind, its per-tensor state for a checkpoint:
 * optim.h; Adafactor's plan: adafactor.h). */
Optimizer *parallel_optimizer(const Parallel *p);

/* What this rank holds, in the model's packed order (for checkpoints): per unit u, the
 * element range [lo, hi) of u's unpadded parameters and pointers to params, m, v of that
 * range (each may be NULL: m and v are the optimizer's elementwise arrays, AdamW's moments
 * or Adafactor's first moment and NULL; adafactor.h says what its checkpoint holds there).
 * `write` = the disjoint ranges this rank saves; otherwise the ranges it must fill on load. */
typedef struct { int unit; size_t lo, hi; void *params, *m, *v; } OwnedRange;  /* state type */
int parallel_ranges(const Parallel *p, int write, OwnedRange *out, int max);

/* Bytes per rank of parameters, gradients, optimizer state and the compute copy of the
 * weights (for the estimate). state_size: bytes per element of the parameter state (4, or
 * 2 with precision=bf16); compute_size: bytes per element of the compute copy (2 with
 * precision=mixed), or 0 where the ops compute with the parameters themselves. */
typedef struct { size_t params, grads, optim, compute, host; } ParallelBytes;
/* oc: the optimizer (NULL = AdamW): `optim` is its elementwise arrays, sharded as the
 * strategy shards them, and its per-tensor state (optim_bytes). With oc->offload they are
 * in `host` instead (host memory), with the fp32 master copy and the gradients' copy of what
 * the rank updates; `optim` then holds what stays on the device (Adafactor's sums to reduce). */
ParallelBytes parallel_bytes(ParallelKind kind, const Model *layout, int shard_size, size_t state_size,
                             size_t compute_size, const OptimConfig *oc);
/* Whether offload under this strategy and optimizer is lean (oc->offload == optimizer, an
 * optimizer that can be (optim_lean_possible: AdamW), a strategy that updates every
 * parameter it holds (DDP)): the host's master is the only fp32 copy of the parameters and
 * the gradients' host copy is in the compute type (bf16 with precision=mixed). */
int parallel_offload_lean(ParallelKind kind, const OptimConfig *oc);
#endif
