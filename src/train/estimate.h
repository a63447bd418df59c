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
    size_t p2p; /* pipeline send/receive on the copy engines: the rings and counters (in total) */
    size_t stash;    /* 2bw, pipedream: the weight versions before the newest, as compute weights (in total) */
    int versions;    /* ... the versions held, the newest counted (1: none kept) */
    size_t tp_fused; /* tensor parallel's fused sums: each rank's slots for the others' parts (in total) */
    size_t attn_elsewhere; /* runtime assumes attention's backward on our Hopper kernel (an H100 or
                            * H200): what cuDNN's engine needs more on other GPUs (0: the same) */
} MemEstimate;

/* What a run is, for its estimate: the model, the batch, the layout, the precision, and the
 * paths its keys choose. Per rank. training != 0: parameters, gradients, the optimizer's
 * state (oc; NULL = AdamW: its moments; Adafactor: its statistics, and its first moment if
 * any), activations for backward (training = ACTS_RECOMPUTE: with activation checkpointing,
 * see model.h), as the strategy `kind` over `world` data-parallel ranks (shard_size of them
 * per shard group) holds them. data_bytes: the shards the run maps (they count in RSS as
 * they are read). gpu != 0: the same plan in the GPU's memory, where the runtime is the
 * cuBLASLt workspace and the ops' scratch (the CUDA context is outside the allocator). tp:
 * tensor-parallel ranks; each holds its slices of every layer and its vocabulary rows of the
 * embedding and lm_head (model_init_layout_tp), its heads' and FFN units' activations and
 * its columns of the logits; sp: sequence parallel, where it also holds 1/tp of the
 * residual stream and the norms' activations. */
typedef struct {
    ModelConfig model;
    int B, T, training;
    size_t data_bytes;
    ParallelKind kind;
    int world, shard_size, tp, sp, gpu;
    /* expert parallel: a MoE layer's experts shared out over ep ranks (model_init_layout_ep),
     * the strategy over the shard_size / ep ranks holding the same experts, and the experts'
     * rows from the whole ep group (model_moe_expert_rows) */
    int ep;
    OpsPrecision prec;
    const OptimConfig *oc;
    OpsOptions ops;       /* the keys attention and deterministic: the attention path the cuda backend takes */
    /* DDP's all-reduces on GPUs take the copy-engine path, whose all-to-all buffer (comm_alloc
     * in comm.h) counts as `comm`. `meshtrain estimate` assumes they will (ranks on one
     * machine, NCCL 2.28 or later); a training run asks comm_copy_engines_possible. */
    int ddp_copy_engines;
    /* a pipeline stage's send/receive on the copy engines: estimate_stage counts a receive
     * ring and its counters (comm_p2p_ce_bytes of a micro-batch's residual stream) for each
     * direction the stage receives in. A run counts it wherever it is asked on GPUs; where a
     * link falls back to NCCL the estimate is high by its ring. */
    int pp_copy_engines;
    /* tensor parallel's sums fused into the products (tp_comm, tensor.h): the IPC block of
     * slots for the other ranks' parts, the staging and the mapped buffers' pages count as
     * tp_fused */
    int tp_fused;
    /* weight versions held (pipeline_schedule=2bw: 2, the version before kept as compute
     * weights beside the newest; pipedream on one process: its depth, an upper bound; else 1),
     * or ESTIMATE_VERSIONS_IN_FLIGHT (pipedream on a pipeline: as many as the stage's schedule
     * keeps micro-batches in flight) or ESTIMATE_VERSIONS_STAGES (pipedream with vertical sync:
     * as many as stages) */
    int versions;
} EstimateInput;

enum { ESTIMATE_VERSIONS_IN_FLIGHT = -1, ESTIMATE_VERSIONS_STAGES = -2 };
void estimate_memory(const EstimateInput *in, MemEstimate *e);
/* A pipeline rank's share instead of the whole model's (e from estimate_memory, redone in
 * place): the units of its stages s[0..sched->chunks) (and a tied embedding's copy with the
 * last stage), as the strategy holds them, and the activations its schedule keeps in
 * flight: sched->in_flight[c] micro-batches of B_micro sequences on chunk c (1F1B's first
 * stage holds the most), and zb1's weight-pass inputs of max_pending_w of them. */
void estimate_stage(MemEstimate *e, const EstimateInput *in, const Stage *s, const Schedule *sched, int B_micro);
/* dp: the data-parallel group's size (world / (tp x pp)), which the strategy spans */
void estimate_print(const EstimateInput *in, int dp, const MemEstimate *e);
/* `meshtrain estimate`'s table: the GPU's (or rank's) total and the host's offloaded state
 * for every offload setting and optimizer, the others as given. */
void estimate_print_offload(const EstimateInput *in, int dp);
/* Bytes of memory available to this process (MemAvailable), 0 if unknown. */
size_t available_memory_bytes(void);
#endif
