/* estimate — memory and FLOPs of a run, computed before anything is allocated, from the
 * same plan the trainer allocates (model layout, acts_bytes). */
#ifndef MESHTRAIN_ESTIMATE_H
#define MESHTRAIN_ESTIMATE_H
#include <stddef.h>
#include "model.h"
#include "ops.h"
#include "parallel.h"
#include "pipeline.h"
#include "schedule.h"

typedef struct {
    size_t n_params;
    double flops_per_token;
    size_t params, grads, optim, compute, acts, logits, data, runtime, comm, total;  /* bytes */
    double formula;  /* the usual rule of thumb: 16 bytes/param + Korthikanti activations */
    int gpu;         /* the plan is on a GPU (device=cuda): data and the host's runtime don't count */
    OpsPrecision prec; /* fp32; mixed: bf16 activations and weight copies; bf16: everything */
    char optim_what[48]; /* what `optim` holds: "AdamW m, v", "Adafactor R, C", ... */
    /* offload (oc->offload): the state kept in host memory (master weights, the gradients'
     * copy, the optimizer's state), pinned on a GPU; on the cpu it is in `total` too (one
     * memory), on a GPU not */
    size_t host;
    int offload;
    int lean;  /* offload is lean (parallel_offload_lean): the host's master is the only fp32 copy */
    int ce_tp; /* EST_CE_TP was asked: estimate_stage counts the stage's all-to-all buffer */
    int ce_pp; /* EST_CE_PP was asked: estimate_stage counts the stage's receive rings */
    size_t p2p; /* pipeline send/receive on the copy engines: the rings and counters (in total) */
    int tp_fused_asked; /* EST_TP_FUSED was asked: estimate_stage counts the stage's slots */
    size_t tp_fused; /* tensor parallel's fused sums: each rank's slots for the others' parts (in total) */
    size_t attn_elsewhere; /* runtime assumes attention's backward on our Hopper kernel (an H100 or
                            * H200): what cuDNN's engine needs more on other GPUs (0: the same) */
} MemEstimate;

/* Per rank. training != 0: parameters, gradients, the optimizer's state (oc; NULL = AdamW:
 * its moments; Adafactor: its statistics, and its first moment if any), activations for
 * backward (training = ACTS_RECOMPUTE: with activation checkpointing, see model.h), as the strategy `kind` over `world` data-parallel ranks (shard_size of them
 * per shard group) holds them. data_bytes: the shards the run maps (they count in RSS as
 * they are read). gpu != 0: the same plan in the GPU's memory, where the runtime is the
 * cuBLASLt workspace and the ops' scratch (the CUDA context is outside the allocator). */
/* copy_engines: EST_CE_DDP, DDP's all-reduces on GPUs take the copy-engine path, whose
 * all-to-all buffer (comm_alloc in comm.h) counts as `comm`; EST_CE_TP (or'd), so do tensor
 * parallel's collectives (MESHTRAIN_TP_CE=1, tensor.h): their buffers are activations the
 * plan counts already, and the tp group's all-to-all buffer counts as `comm` too.
 * `meshtrain estimate` assumes they will (ranks on one machine, NCCL 2.28 or later); a
 * training run asks comm_copy_engines_possible (tensor_parallel_ce_possible). */
#define EST_CE_DDP 1
#define EST_CE_TP 2
/* EST_CE_PP (or'd): a pipeline stage's send/receive take the copy engines (MESHTRAIN_PP_CE=1,
 * comm.h): estimate_stage counts a receive ring and its counters (comm_p2p_ce_bytes of a
 * micro-batch's residual stream) for each direction the stage receives in. A run counts it wherever it is
 * asked on GPUs; where a link falls back to NCCL the estimate is high by its ring. */
#define EST_CE_PP 4
/* EST_TP_FUSED (or'd): tensor parallel's sums fused into the products (MESHTRAIN_TP_FUSED=1 on
 * GPUs, tensor.h): the IPC block of slots for the other ranks' parts counts as tp_fused. */
#define EST_TP_FUSED 8
/* tp: tensor-parallel ranks; each holds its slices of every layer and its vocabulary rows
 * of the embedding and lm_head (model_init_layout_tp), its heads' and FFN units'
 * activations and its columns of the logits; sp: sequence parallel, where it also holds
 * 1/tp of the residual stream and the norms' activations. */
void estimate_memory(const ModelConfig *c, int B, int T, int training, size_t data_bytes, ParallelKind kind,
                     int world, int shard_size, int tp, int sp, int gpu, OpsPrecision prec, int copy_engines,
                     const OptimConfig *oc, MemEstimate *e);
/* A pipeline rank's share instead of the whole model's (e from estimate_memory, redone in
 * place): the units of its stages s[0..sched->chunks) (and a tied embedding's copy with the
 * last stage), as the strategy holds them, and the activations its schedule keeps in
 * flight: sched->in_flight[c] micro-batches of B_micro sequences on chunk c (1F1B's first
 * stage holds the most), and zb1's weight-pass inputs of max_pending_w of them. */
void estimate_stage(MemEstimate *e, const ModelConfig *c, const Stage *s, const Schedule *sched, int B_micro, int T,
                    int training, ParallelKind kind, int shard_size, int tp, int sp, OpsPrecision prec,
                    const OptimConfig *oc);
/* world: every rank; dp: the data-parallel group's size (world / (tp x pp)), which the strategy spans */
void estimate_print(const ModelConfig *c, int B, int T, ParallelKind kind, int world, int dp, const MemEstimate *e);
/* `meshtrain estimate`'s table: the GPU's (or rank's) total and the host's offloaded state
 * for every offload setting and optimizer, the others as given (arguments as
 * estimate_memory's). */
void estimate_print_offload(const ModelConfig *c, int B, int T, int training, ParallelKind kind, int world, int dp,
                            int shard_size, int tp, int sp, int gpu, OpsPrecision prec, int copy_engines,
                            const OptimConfig *oc);
/* Bytes of memory available to this process (MemAvailable), 0 if unknown. */
size_t available_memory_bytes(void);
#endif
