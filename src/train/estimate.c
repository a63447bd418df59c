#include "estimate.h"
#include "env.h"
#include "tensor.h"
#include "attn_cudnn.h"      /* the dP buffer of cuDNN's deterministic attention backward */
#include "attn_wgmma_bwd.h" /* our Hopper backward's, where auto takes it (attn_wgmma_bwd_auto) */
#include "ops_cuda.h"       /* rmsnorm's backward blocks */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "comm.h"
#include "util.h"

/* What a CPU process holds besides the plan: code and libraries, OpenMP and OpenBLAS
 * thread stacks and buffers, the allocator's slack. Measured on the 2-core CI machine
 * (max RSS of `meshtrain train` with a tiny model); see bench/results/cpu-train-epyc-2core-2026-11.md. */
#define RUNTIME_BYTES ((size_t)8 << 20)
/* Open MPI's own share of a rank (shared-memory transport, progress buffers), measured
 * the same way with 2 and 4 ranks. */
#define MPI_RUNTIME_BYTES ((size_t)14 << 20)
/* What the cuda backend allocates besides the plan: the cuBLASLt workspace (ops_cuda.cu's
 * WORKSPACE_BYTES); its scratch is added per shape below. */
#define CUDA_WORKSPACE_BYTES ((size_t)32 << 20)
/* ... and, in a model with experts, one more workspace per extra queue the experts' products are
 * spread over (ops_cuda.cu's MOE_STREAMS - 1; made on the first product small enough to spread,
 * counted for any model with experts: 96 MiB where none is) */
#define CUDA_MOE_QUEUES 3
static size_t cuda_workspaces(const ModelConfig *c) {
    return CUDA_WORKSPACE_BYTES * (c->moe_experts ? 1 + CUDA_MOE_QUEUES : 1);
}

/* The largest scratch buffer the cuda ops take for a B x T step: rmsnorm's dw partials (one row
 * of E per 16 tokens, per 8 on the wide-row kernels, at most 1024 rows: ops_cuda.h), attention
 * backward's row terms (B T NH), sumsq's 1025 doubles; in bf16, where attention's backward runs on
 * our Hopper kernel (attn_wgmma_bwd_auto, as on an H100 or H200) its workspace, or on cuDNN's
 * deterministic engine (ops_cuda.cu's auto choice, attn_cudnn_auto; our mma.sync kernels take head
 * dims 64 and 128, the Hopper backward 64, 96, 128 and 256) its workspace and row terms instead.
 * A tensor-parallel rank runs attention on its NH / tp heads (the deterministic engine's
 * workspace, B NH T^2, may then fit where the whole model's did not). */
static size_t cuda_scratch_bytes(const ModelConfig *c, int B, int T, OpsPrecision prec, int tp, OpsOptions o,
                                 size_t *elsewhere) {
    int nh = c->n_heads / (tp > 0 ? tp : 1);
    /* rmsnorm's backward: its blocks' dw partials (ops_cuda.h) */
    size_t nb = (size_t)cuda_rmsnorm_blocks((size_t)B * T, cuda_rmsnorm_wide(c->embed_dim));
    size_t a = nb * c->embed_dim * sizeof(float), b = (size_t)B * T * nh * sizeof(float), hb = 0;
    size_t s = 1025 * sizeof(double);
    /* the backward's path as ops_cuda picks it under the options: auto's choice by shape, or
     * cuDNN wherever it runs (cudnn), or our kernels' terms (own) */
    int hd = c->n_heads > 0 ? c->embed_dim / c->n_heads : 0;
    int ours = hd == 64 || hd == 128, bf = prec != OPS_FP32 && hd > 0; /* ours: attn_bf16's head dims */
    int aut = o.attention == OPS_ATTN_AUTO;
    int hopper = bf && aut && attn_wgmma_bwd_auto(T, hd, o.deterministic, 1); /* the step fuses RoPE */
    int dnn = bf && (o.attention == OPS_ATTN_CUDNN || (aut && attn_cudnn_auto(1, B, T, nh, hd, ours)));
    if (hopper) hb = (attn_wgmma_bwd_workspace_bytes(B, T, nh, hd) + 255) & ~(size_t)255;
    if (dnn && o.attention == OPS_ATTN_CUDNN && !o.deterministic)  /* cuDNN's atomic engine */
        b = attn_cudnn_atomic_extra_bytes(B, T, nh, hd);
    else if (dnn) {
        int bc = attn_cudnn_det_batch(B, T, nh, ATTN_CUDNN_DET_MAX_BYTES);  /* long contexts: the batch in pieces */
        if (bc < 1) bc = B;  /* forced where one row's dP is over the limit: cuDNN takes or refuses it whole */
        b = ((attn_cudnn_det_workspace_bytes(bc, T, nh) + 255) & ~(size_t)255) +
            (((size_t)bc * T * nh * sizeof(float) + 255) & ~(size_t)255);
    }
    size_t rest = a > s ? a : s, other = b > rest ? b : rest, mine = hopper ? (hb > rest ? hb : rest) : other;
    if (elsewhere) *elsewhere = other > mine ? other - mine : 0;  /* the GPUs our Hopper kernel does not run on */
    return mine;
}

void estimate_memory(const EstimateInput *in, MemEstimate *e) {
    const ModelConfig *c = &in->model;
    int B = in->B, T = in->T, training = in->training, world = in->world, shard_size = in->shard_size, tp = in->tp;
    int sp = in->sp, gpu = in->gpu;
    ParallelKind kind = in->kind;
    OpsPrecision prec = in->prec;
    const OptimConfig *oc = in->oc;
    memset(e, 0, sizeof *e);
    int af = oc && oc->kind == OPTIM_ADAFACTOR;
    snprintf(e->optim_what, sizeof e->optim_what, "%s", !af ? "AdamW m, v" : optim_moments(oc) ? "Adafactor R, C, m"
                                                                                              : "Adafactor R, C");
    if (oc && oc->offload) {  /* what stays on the device: Adafactor's sums to reduce, or nothing */
        size_t l = strlen(e->optim_what);
        snprintf(e->optim_what + l, sizeof e->optim_what - l, ", on the host");
    }
    e->gpu = gpu;
    e->prec = prec;
    size_t act_size = ops_act_size_of(prec), state_size = ops_state_size_of(prec);
    Model m;
    int ep = in->ep > 1 ? in->ep : 1, group = shard_size >= ep ? shard_size / ep : 1;  /* the ranks a unit is sharded over */
    model_init_layout_ep(&m, c, shard_size, 0, NULL, 0, tp, 0, ep, 0);
    e->n_params = m.n_params;
    size_t held = 0;  /* the parameters a tensor-parallel rank holds */
    for (int u = 0; u < m.n_units; u++) held += m.units[u].n;
    e->flops_per_token = model_flops_per_token(c, T);
    ParallelBytes pb = parallel_bytes(kind, &m, group, state_size, prec == OPS_MIXED ? 2 : 0, oc);
    e->params = training ? pb.params : m.n_flat * state_size;
    e->grads = training ? pb.grads : 0;
    e->optim = training ? pb.optim : 0;
    e->compute = training ? pb.compute : 0;
    e->host = training ? pb.host : 0;
    e->offload = oc ? oc->offload : 0;
    e->lean = training && parallel_offload_lean(kind, oc);
    size_t logit_bytes;
    Stage whole = {UNIT_EMBEDDING, c->n_layers + 1};
    size_t acts = acts_bytes_tp(c, &whole, B, T, training, act_size, &logit_bytes, tp, sp, ep);
    e->logits = logit_bytes;
    e->acts = acts - logit_bytes;
    e->data = gpu ? 0 : in->data_bytes;
    e->runtime = gpu ? cuda_workspaces(c) + cuda_scratch_bytes(c, B, T, prec, tp, in->ops, &e->attn_elsewhere)
                     : RUNTIME_BYTES + (world > 1 ? MPI_RUNTIME_BYTES : 0);
    e->comm = gpu && training && kind == PAR_DDP && world > 1 && in->ddp_copy_engines ? comm_ce_buffer_bytes(e->grads) : 0;
    int fused = gpu && tp > 1 && in->tp_fused;
    e->tp_fused = fused ? tensor_parallel_fused_bytes(tp, (size_t)B * T, (size_t)c->embed_dim, act_size) : 0;
    if (fused && training)  /* the mapped buffers' pages (tensor.h) */
        e->tp_fused += acts_tp_coll_extra(c, &whole, B, T, training, act_size, tp, sp, tensor_parallel_buffer_extra);
    /* 2bw, pipedream: the versions before the newest, copies of what the ops compute with
     * (versions.c); the whole model as one stage: the first's count */
    e->versions = training ? in->versions > 0 ? in->versions : 1 : 1;
    e->stash = (size_t)(e->versions - 1) * m.n_flat * (prec == OPS_MIXED ? act_size : state_size);
    e->total = e->params + e->grads + e->optim + e->compute + e->acts + e->logits + e->data + e->runtime + e->comm +
               e->tp_fused + e->stash + (gpu ? 0 : e->host);
    model_free(&m);
    /* The usual formula (ZeRO paper): weights + grads + Adam = 4 values of 4 bytes (2 in
     * pure bf16) per param, divided as the strategy shards them over N ranks, and per layer
     * s*b*h*(34 + 5*a*s/h) bytes of 16-bit activations (Korthikanti et al.), doubled for
     * fp32 activations; with tensor parallel over t ranks, the parameters a rank holds and
     * s*b*h*(10 + 24/t + 5*a*s/(h*t)) (their eq. 2), with sequence parallel too
     * s*b*h*(34/t + 5*a*s/(h*t)) (eq. 4). */
    double P = (double)held * (double)state_size, N = shard_size, w;
    switch (kind) {
    case PAR_DDP: w = 4 * P; break;
    case PAR_ZERO1: w = 2 * P + 2 * P / N; break;
    case PAR_ZERO2: w = P + 3 * P / N; break;
    default: w = 4 * P / N;
    }
    double s = T, b = B, h = c->embed_dim, a = c->n_heads;
    int spt = sp && tp > 1 ? tp : 1;  /* what sequence parallel divides */
    double act_factor = prec != OPS_FP32 ? 1.0 : 2.0,
           layer = s * b * h * (10.0 / spt + 24.0 / tp + 5 * a * s / (h * tp));
    /* with activation checkpointing: each layer's 16-bit input, and one layer in full */
    double acts_f = training == ACTS_RECOMPUTE ? c->n_layers * 2 * s * b * h / spt + layer : c->n_layers * layer;
    e->formula = (training ? w : P) + (training ? act_factor * acts_f : 0);
}

void estimate_stage(MemEstimate *e, const EstimateInput *in, const Stage *s, const Schedule *sched, int B_micro) {
    const ModelConfig *c = &in->model;
    int T = in->T, training = in->training, shard_size = in->shard_size, tp = in->tp, sp = in->sp;
    ParallelKind kind = in->kind;
    OpsPrecision prec = in->prec;
    const OptimConfig *oc = in->oc;
    int gpu = in->gpu, fused = gpu && tp > 1 && in->tp_fused;
    size_t act_size = ops_act_size_of(prec), state_size = ops_state_size_of(prec);
    Model m;
    int ep = in->ep > 1 ? in->ep : 1;
    model_init_layout_ep(&m, c, shard_size, 0, s, sched->chunks, tp, 0, ep, 0);
    ParallelBytes pb = parallel_bytes(kind, &m, shard_size >= ep ? shard_size / ep : 1, state_size, prec == OPS_MIXED ? 2 : 0, oc);
    e->params = training ? pb.params : m.n_flat * state_size;
    e->grads = training ? pb.grads : 0;
    e->optim = training ? pb.optim : 0;
    e->compute = training ? pb.compute : 0;
    e->host = training ? pb.host : 0;
    /* every micro-batch in flight has activations of its own (Acts), logits chunk included
     * (all its logits' gradient where the head's backward waits for B: ACTS_HEAD_SPLIT) */
    e->logits = e->acts = 0;
    if (sched->head_split && training) training |= ACTS_HEAD_SPLIT;
    /* under the fused sums on GPUs the collectives' buffers are mapped, in whole pages (tensor.h) */
    int mapped = fused && training;
    size_t pages = 0;
    for (int k = 0; k < sched->chunks; k++) {
        size_t logit_bytes, acts = acts_bytes_tp(c, &s[k], B_micro, T, training, act_size, &logit_bytes, tp, sp, ep);
        size_t n = (size_t)(sched->in_flight[k] > 0 ? sched->in_flight[k] : 1);
        e->logits += logit_bytes * n;
        e->acts += (acts - logit_bytes) * n;
        if (mapped)
            pages += n * acts_tp_coll_extra(c, &s[k], B_micro, T, training, act_size, tp, sp, tensor_parallel_buffer_extra);
    }
    if (sched->split_backward) {  /* step.c's ring: max_pending_w of the largest chunk's */
        size_t wb = 0, n = (size_t)(sched->max_pending_w > 0 ? sched->max_pending_w : 1);
        for (int k = 0; k < sched->chunks; k++) {
            size_t b = model_wgrad_bytes(c, &s[k], B_micro, T, act_size);
            if (b > wb) wb = b;
        }
        e->acts += n * wb;
        if (mapped) pages += n * tensor_parallel_buffer_extra(wb);
    }
    /* the ops' scratch is a micro-batch's (rmsnorm's partials and attention's terms grow with B) */
    if (e->gpu)
        e->runtime = cuda_workspaces(c) + cuda_scratch_bytes(c, B_micro, T, prec, tp, in->ops, &e->attn_elsewhere);
    e->comm = 0;  /* (DDP's copy-engine path takes no pipeline stage) */
    e->p2p = 0;  /* step.c's links: a ring per direction this stage receives in, of its residual stream */
    if (gpu && in->pp_copy_engines && training) {
        int fwd, bwd;
        pipeline_rank_messages(c, s, sched->chunks, &fwd, &bwd);
        size_t rows = (size_t)B_micro * T / (size_t)(sp && tp > 1 ? tp : 1);
        e->p2p = (size_t)(fwd + bwd) * comm_p2p_ce_bytes(rows * c->embed_dim * act_size);
    }
    e->tp_fused = (fused ? tensor_parallel_fused_bytes(tp, (size_t)B_micro * T, (size_t)c->embed_dim, act_size) : 0) +
                  pages;
    e->versions = !training ? 1
                  : in->versions == ESTIMATE_VERSIONS_IN_FLIGHT ? sched->in_flight[0]
                  : in->versions == ESTIMATE_VERSIONS_STAGES    ? sched->stages
                  : in->versions > 0                            ? in->versions
                                                                : 1;
    e->stash = (size_t)(e->versions - 1) * m.n_flat * (prec == OPS_MIXED ? act_size : state_size);
    e->total = e->params + e->grads + e->optim + e->compute + e->acts + e->logits + e->data + e->runtime + e->comm +
               e->p2p + e->tp_fused + e->stash + (e->gpu ? 0 : e->host);
    model_free(&m);
}

void estimate_print(const EstimateInput *in, int dp, const MemEstimate *e) {
    const ModelConfig *c = &in->model;
    int B = in->B, T = in->T, world = in->world;
    ParallelKind kind = in->kind;
    char b1[32], b2[32];
    printf("model: embed_dim=%d n_heads=%d n_layers=%d vocab=%d context_len=%d%s\n", c->embed_dim, c->n_heads,
           c->n_layers, c->vocab_size, c->context_len, c->tie_embeddings ? " (tied embeddings)" : "");
    if (c->moe_experts) {
        printf("mixture of experts: %d experts of width %d, top %d, %d shared, every %d layer%s (%d MoE layers), "
               "router %s, %s\n", c->moe_experts, model_moe_expert_dim(c), c->moe_top_k, c->moe_shared_experts,
               c->moe_every, c->moe_every > 1 ? "s" : "", model_moe_layers_before(c, c->n_layers),
               c->moe_router_sigmoid ? "sigmoid" : "softmax", c->moe_capacity_factor > 0 ? "capacity-limited" : "dropless");
        printf("parameters: %s total, %s active (a token's: the routed experts but its top %d left out)\n",
               fmt_commas(b1, (long long)e->n_params), fmt_commas(b2, (long long)model_active_param_count(c)),
               c->moe_top_k);
    } else {
        printf("parameters: %s\n", fmt_commas(b1, (long long)e->n_params));
    }
    printf("FLOPs per token (fwd+bwd): %.3g   per step (B=%d, T=%d): %.3g\n", e->flops_per_token, B, T,
           e->flops_per_token * B * T);
    static const char *pnames[] = {"fp32", "mixed: bf16 compute, fp32 master weights",
                                   "bf16: bf16 weights, gradients and optimizer"};
    /* the strategy's group is the data-parallel one; tensor and pipeline parallel split the rest */
    char of[96] = "";
    if (dp != world) snprintf(of, sizeof of, " of the %d in all", world);
    if (in->ep > 1) {  /* the strategy spans the ranks holding the same experts */
        size_t l = strlen(of);
        snprintf(of + l, sizeof of - l, "; expert parallel over %d, so over %d", in->ep, dp / in->ep);
    }
    printf("memory per %s (%s, %s; %s over %d data-parallel rank%s%s):\n", e->gpu ? "GPU" : "rank", pnames[e->prec],
           e->gpu ? "cuda" : "cpu", parallel_kind_name(kind), dp, dp > 1 ? "s" : "", of);
    char optim[64];
    snprintf(optim, sizeof optim, "optimizer (%s)", e->optim_what[0] ? e->optim_what : "AdamW m, v");
    const char *names[] = {"parameters", "gradients", optim, "bf16 weight copies",
                           "activations", "logits (chunked)", "data (mapped shards)",
                           e->gpu ? "runtime (cuBLASLt, scratch)" : "runtime (code, threads)",
                           "all-to-all buffer", "pipeline receive rings", "fused-sum slots",
                           e->versions > 2 ? "weight versions before" : "weight version before"};
    size_t vals[] = {e->params, e->grads, e->optim, e->compute, e->acts, e->logits, e->data, e->runtime, e->comm, e->p2p,
                     e->tp_fused, e->stash};
    for (int i = 0; i < 12; i++)
        if (!(e->gpu && i == 6) && !(e->prec != OPS_MIXED && i == 3) && !(i == 8 && !e->comm) && !(i == 9 && !e->p2p) &&
            !(i == 10 && !e->tp_fused) && !(i == 11 && !e->stash))
            printf("  %-26s %12s\n", names[i], fmt_bytes(b1, (double)vals[i]));
    /* lean (DDP, AdamW): the master is the only fp32 copy, the gradients' copy in the compute type */
    const char *what = !e->lean ? "fp32 master weights, gradients' copy, optimizer state"
                       : e->prec == OPS_MIXED ? "fp32 master weights and optimizer state, bf16 gradients' copy"
                                              : "fp32 master weights (the only copy), gradients' copy, optimizer state";
    if (e->offload && !e->gpu)
        printf("  %-26s %12s   (offload: %s)\n", "offloaded state", fmt_bytes(b1, (double)e->host), what);
    printf("  %-26s %12s   (the usual formula, %d B/param sharded as ZeRO + activations: %s)\n", "total",
           fmt_bytes(b1, (double)e->total), (int)(4 * ops_state_size_of(e->prec)),
           fmt_bytes(b2, e->formula));
    if (e->gpu) printf("  (besides: the CUDA context and libraries on the card, a few hundred MiB)\n");
    if (e->gpu && e->attn_elsewhere)
        printf("  (attention's backward as on an H100 or H200, our Hopper kernel; on other GPUs cuDNN's engine "
               "needs %s more)\n", fmt_bytes(b1, (double)e->attn_elsewhere));
    if (e->offload && e->gpu)
        printf("host memory per GPU (offload): %s pinned (%s)\n", fmt_bytes(b1, (double)e->host), what);
    if (e->lean && e->gpu && e->prec == OPS_MIXED)
        printf("  (offload: no fp32 parameters on the GPU; gradients include two bf16 staging buffers of the largest "
               "unit)\n");
}

void estimate_print_offload(const EstimateInput *in, int dp) {
    ParallelKind kind = in->kind;
    int gpu = in->gpu;
    OpsPrecision prec = in->prec;
    const OptimConfig *oc = in->oc;
    static const char *names[] = {"none", "optimizer", "params"};
    int last = kind == PAR_FSDP || kind == PAR_HYBRID ? OFFLOAD_PARAMS : OFFLOAD_OPTIMIZER;
    char b1[32], b2[32];
    printf("by offload and optimizer (%s over %d data-parallel rank%s):\n", parallel_kind_name(kind), dp,
           dp > 1 ? "s" : "");
    printf("  %-19s %-10s %12s %14s\n", "offload", "optimizer", gpu ? "GPU" : "rank total", "host (offload)");
    for (int off = OFFLOAD_NONE; off <= last; off++)
        for (int k = OPTIM_ADAMW; k <= OPTIM_ADAFACTOR; k++) {
            OptimConfig o = *oc;
            o.offload = off;
            o.kind = (OptimKind)k;
            MemEstimate e;
            EstimateInput io = *in;
            io.data_bytes = 0;
            io.oc = &o;
            estimate_memory(&io, &e);
            /* offload keeps fp32 master weights: none with precision=bf16 */
            int na = off && prec == OPS_BF16;
            printf("  offload=%-11s %-10s %12s %14s\n", names[off], optim_kind_name(o.kind),
                   na ? "n/a" : fmt_bytes(b1, (double)e.total), na ? "n/a" : fmt_bytes(b2, (double)e.host));
        }
}

size_t available_memory_bytes(void) {
    if (hook_on(HOOK_FAKE_MEMAVAILABLE)) return (size_t)hook_int(HOOK_FAKE_MEMAVAILABLE, 0);  /* a test hook */
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char line[256];
    size_t kb = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %zu kB", &kb) == 1) break;
    fclose(f);
    return kb * 1024;
}
