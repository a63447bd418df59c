/* train_setup — `meshtrain train` up to its first step: the keys (a resumed run's from its
 * checkpoint), the mesh, the pipeline's stages and schedule, the data, the device, the
 * memory estimate and every check that can refuse a run before it starts (memory, disk, the
 * files it will write), the header, the model and its strategy. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "config.h"
#include "env.h"
#include "compress.h"
#include "expert.h"
#include "layer_graphs.h"
#include "ops.h"
#include "run.h"
#include "tensor.h"
#include "train_run.h"
#include "train_state.h"
#include "util.h"

/* cuda_graphs: true records each layer's forward and backward as graphs of ops and replays
 * them (model_use_graphs) in any run, false never; auto: in one-process runs on a GPU (checked
 * bitwise against op by op on one GPU; on several GPUs only where asked, until measured
 * there). A layer split over tensor-parallel ranks always runs op by op; on the cpu, which
 * records nothing, every layer does (through the recordings' cache, which true exercises). */
static int graphs_wanted(const Config *c, int world_size, int gpu) {
    return !strcmp(c->cuda_graphs, "auto") ? gpu && world_size == 1 : !strcmp(c->cuda_graphs, "true");
}

/* Model keys and the seed given on the command line must agree with a checkpoint's. */
static int check_against_ckpt(const Config *c, const CkptHeader *h, const char *path, Fail *f) {
    struct { const char *key; int want, have; } k[] = {
        {"vocab_size", c->vocab_size, h->vocab_size}, {"embed_dim", c->embed_dim, h->embed_dim},
        {"n_heads", c->n_heads, h->n_heads},          {"n_layers", c->n_layers, h->n_layers},
        {"context_len", c->context_len, h->context_len}, {"tie_embeddings", c->tie_embeddings, h->tie_embeddings},
        {"seed", c->seed, h->seed},
        {"moe_experts", c->moe_experts, h->moe_experts}, {"moe_top_k", c->moe_top_k, h->moe_top_k},
        {"moe_expert_dim", c->moe_expert_dim, h->moe_expert_dim},
        {"moe_shared_experts", c->moe_shared_experts, h->moe_shared_experts},
        {"moe_every", c->moe_every, h->moe_every},
        {"moe_router", !strcmp(c->moe_router, "sigmoid"), h->moe_router_sigmoid},
    };
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++)
        if (config_was_set(k[i].key) && k[i].want != k[i].have)
            return fail_set(f, EXIT_BAD_INPUT, "%s=%d differs from checkpoint %s (%s=%d)", k[i].key, k[i].want, path,
                            k[i].key, k[i].have);
    if (config_was_set("moe_capacity_factor") && (float)c->moe_capacity_factor != h->moe_capacity_factor)
        return fail_set(f, EXIT_BAD_INPUT, "moe_capacity_factor=%g differs from checkpoint %s (moe_capacity_factor=%g)",
                        c->moe_capacity_factor, path, (double)h->moe_capacity_factor);
    /* the optimizer's state is one optimizer's: the other cannot continue from it */
    const char *have = optim_kind_name((OptimKind)h->optimizer);
    if (config_was_set("optimizer") && strcmp(c->optimizer, have))
        return fail_set(f, EXIT_BAD_INPUT, "optimizer=%s cannot resume checkpoint %s, which holds %s state", c->optimizer,
                        path, have);
    return 0;
}

/* A resumed run takes the model, data order and optimizer settings from its checkpoint;
 * optimizer and schedule keys given on the command line override them. It keeps the
 * checkpoint's global batch on any number of data-parallel ranks (batch_size per rank
 * follows) unless batch_size is given, and its schedule's horizon unless lr_decay_steps
 * is: a larger `steps` runs on at min_lr rather than stretching the cosine anew. Its
 * validation (val_every, val_batches) is kept too, unless given. */
static int config_from_ckpt(Config *c, const CkptHeader *h, int dp, Fail *f) {
    c->vocab_size = h->vocab_size; c->embed_dim = h->embed_dim; c->n_heads = h->n_heads;
    c->n_layers = h->n_layers; c->context_len = h->context_len; c->tie_embeddings = h->tie_embeddings;
    c->seed = h->seed;
    if (h->moe_experts > 0) {
        c->moe_experts = h->moe_experts; c->moe_top_k = h->moe_top_k; c->moe_expert_dim = h->moe_expert_dim;
        c->moe_shared_experts = h->moe_shared_experts; c->moe_every = h->moe_every;
        snprintf(c->moe_router, sizeof c->moe_router, "%s", h->moe_router_sigmoid ? "sigmoid" : "softmax");
        c->moe_capacity_factor = h->moe_capacity_factor;
        if (!config_was_set("moe_aux_loss")) c->moe_aux_loss = h->moe_aux_loss;
        if (!config_was_set("moe_z_loss")) c->moe_z_loss = h->moe_z_loss;
        if (!config_was_set("moe_bias_balance")) c->moe_bias_balance = h->moe_bias_balance;
    }
    if (!config_was_set("grad_accum_steps")) c->grad_accum_steps = h->grad_accum_steps ? h->grad_accum_steps : 1;
    if (!config_was_set("batch_size")) {
        int global = h->global_batch ? h->global_batch : h->batch_size * h->world, per = dp * c->grad_accum_steps;
        if (global % per)
            return fail_set(f, EXIT_BAD_INPUT, "the checkpoint's global batch of %d sequences does not divide over %d "
                            "data-parallel ranks x grad_accum_steps=%d; give batch_size= (per rank and micro-batch) "
                            "to choose another global batch", global, dp, c->grad_accum_steps);
        c->batch_size = global / per;
    }
#define FROM(key, val) if (!config_was_set(#key)) c->key = (val)
    FROM(lr, h->lr); FROM(min_lr, h->min_lr); FROM(beta1, h->beta1); FROM(beta2, h->beta2); FROM(eps, h->eps);
    FROM(weight_decay, h->weight_decay); FROM(grad_clip, h->grad_clip); FROM(warmup_steps, h->warmup_steps);
    FROM(steps, h->total_steps);
    FROM(lr_decay_steps, h->lr_decay_steps ? h->lr_decay_steps : h->total_steps);
    snprintf(c->optimizer, sizeof c->optimizer, "%s", optim_kind_name((OptimKind)h->optimizer));
    if (h->optimizer == OPTIM_ADAFACTOR) {
        FROM(adafactor_beta1, h->af_beta1); FROM(adafactor_clip_threshold, h->af_clip);
        FROM(adafactor_decay_rate, h->af_decay);
        FROM(adafactor_relative_step, h->af_flags & 1); FROM(adafactor_scale_parameter, (h->af_flags >> 1) & 1);
    }
    if (h->val_batches > 0) { FROM(val_every, h->val_every); FROM(val_batches, h->val_batches); }  /* (files that keep them) */
#undef FROM
    if (!config_was_set("lr_schedule")) snprintf(c->lr_schedule, sizeof c->lr_schedule, "%s", h->cosine ? "cosine" : "constant");
    return 0;
}

/* A resumed run keeps its checkpoint's loss scaling unless loss_scale is given (its scale
 * and trackers then continue, train_setup), and reads the scaler's file beside it now. */
static int loss_scale_from_ckpt(Config *c, TrainRun *r, Fail *f) {
    char err[1024];
    int kept = ckpt_load_loss_scale(c->resume, &r->resume_h, &r->resume_scaler, err, sizeof err);
    if (kept < 0) return fail_set(f, EXIT_BAD_INPUT, "%s", err);
    r->resume_has_scaler = kept;
    if (!kept || config_was_set("loss_scale")) return 0;
    const LossScaleConfig *k = &r->resume_scaler.c;
    loss_scale_name(k, c->loss_scale, sizeof c->loss_scale);
    c->loss_scale_init = k->init, c->loss_scale_min = k->min;
    c->loss_scale_window = k->window, c->loss_scale_hysteresis = k->hysteresis;
    return 0;
}

/* The log's first line of a run (and of each resumed part of it): every key in force. */
static void log_key(void *ctx, const char *key, const char *value, int is_text) {
    JsonLog *l = ctx;
    if (is_text) jsonlog_str(l, key, value);
    else jsonlog_raw(l, "%s\"%s\":%s", l->buf[l->len - 1] == '{' ? "" : ",", key, value);  /* (as jsonlog's fields) */
}

static void log_hook(void *ctx, const char *name, const char *value, int wrong) {
    (void)wrong;
    log_key(ctx, name, value, 1);
}

/* ... and every hook set (env.h), so that the log says how its run can be made again */
static int log_header(JsonLog *l, const Config *c, int start, int resumed, int world) {
    jsonlog_begin(l);
    jsonlog_raw(l, "\"run\":\"train\",\"start_step\":%d,\"resumed\":%s,\"world\":%d,\"config\":{", start,
                resumed ? "true" : "false", world);
    config_each(c, CMD_TRAIN, log_key, l);
    jsonlog_raw(l, "},\"hooks\":{");
    hooks_each(log_hook, l);
    jsonlog_raw(l, "}");
    return jsonlog_end(l);
}

/* The run's header names every hook set; those that make results wrong or inject a fault
 * say so. */
static void print_hook(void *ctx, const char *name, const char *value, int wrong) {
    int *n = ctx;
    printf("%s%s=%s%s", (*n)++ ? ", " : "hooks set (environment): ", name, value,
           wrong ? " (a fault or timing hook: this run's results are not a training run's)" : "");
}

/* What would shrink the largest part of an estimate that does not fit. */
static const char *estimate_remedy(const MemEstimate *e, const Config *c) {
    size_t acts = e->acts + e->logits, state = e->params + e->grads + e->optim + e->compute;
    if (acts > state) {
        if (!c->activation_checkpointing)
            return "most of it is activations: activation_checkpointing=true, or a smaller batch_size with "
                   "grad_accum_steps, or tensor_parallel_size with sequence_parallel";
        return "most of it is activations: a smaller batch_size with grad_accum_steps, or tensor_parallel_size with "
               "sequence_parallel";
    }
    if (!c->fsdp) return "most of it is parameters, gradients and optimizer state: shard them, fsdp=true (or "
                         "zero_opt=true), or offload=optimizer on a GPU, or lower the model size";
    return "most of it is parameters, gradients and optimizer state: shard them over more ranks, offload=optimizer "
           "on a GPU, or lower the model size";
}

/* The run's first lines: the device and the mesh, the keys and hooks, the batch, the
 * pipeline, the schedule, the data and the estimate. */
static void print_header(const TrainRun *r) {
    const Config *c = r->c;
    char b1[32], b2[32];
    printf("meshtrain train  (device %s%s%s%s, %d process%s: dp=%d tp=%d pp=%d, %s%s)\n", ops_backend_name(),
           r->gpu ? " (" : "", ops_device_name(), r->gpu ? ")" : "", r->world.size, r->world.size > 1 ? "es" : "", r->dp,
           r->mesh.tp_size, r->mesh.pp_size, parallel_kind_name(r->kind),
           r->mesh.tp_size > 1 && c->sequence_parallel ? ", sequence parallel" : "");
    if (r->kind == PAR_HYBRID) printf("hybrid sharding: groups of %d ranks, %d replicas\n", r->mesh.shard_size,
                                   r->dp / r->mesh.shard_size);
    if (!strcmp(c->grad_compression, "powersgd") && r->dp > 1)
        printf("gradient all-reduce: PowerSGD at rank %d after %d steps uncompressed, with error feedback (each "
               "matrix's factors summed over the ranks; vectors averaged whole)\n", c->powersgd_rank, c->powersgd_warmup);
    else if (strcmp(c->grad_compression, "none") && r->dp > 1)
        printf("gradient %s: %scompressed to %s with error feedback (%s; what it loses is sent with the next "
               "step's)\n", r->kind == PAR_DDP ? "all-reduce" : r->kind == PAR_HYBRID ? "all-reduce across replicas"
                                                                               : "reduce-scatter",
               r->mesh.hier_allreduce && r->kind == PAR_DDP ? "across machines " : "", c->grad_compression,
               !strcmp(c->grad_compression, "bf16") ? "2 bytes a value" : "a byte a value and a scale per 256 of them");
    if (r->mesh.hier_allreduce)
        printf("gradient all-reduce: inside each of %d machines (%d ranks), then across them\n", r->mesh.cross.size,
               r->mesh.node.size);
    if (r->mesh.ep_size > 1)
        printf("expert parallel: %d ranks share out each MoE layer's %d experts (%d each); %s over the %d ranks that "
               "hold the same experts\n", r->mesh.ep_size, r->mc.moe_experts, r->mc.moe_experts / r->mesh.ep_size,
               parallel_kind_name(r->kind), r->mesh.edp_size);
    config_print(c, CMD_TRAIN);
    int hooks = 0;
    hooks_each(print_hook, &hooks);
    if (hooks) printf("\n");
    printf("global batch: %d sequences (batch_size %d x grad_accum_steps %d x dp %d) = %s tokens per step", r->G, r->B, r->K,
           r->dp, fmt_commas(b1, (long long)r->G * r->T));
    if (r->resuming && r->ckpt_global != r->G) printf("; the checkpoint's run had %d", r->ckpt_global);
    printf("\n");
    /* Open MPI's mpirun forwards Ctrl-C / SIGTERM to the ranks, then kills them 1 s later:
     * too soon to finish a step and save, unless told to wait */
    if (r->world.size > 1 && env_open_mpi() && !env_mpirun_kill_delay_set())
        printf("note: on Ctrl-C or SIGTERM mpirun kills the ranks 1 s after passing it on; "
               "OMPI_MCA_odls_base_sigkill_timeout=600 gives them time to finish the step and save\n");
    if (r->oc.offload && !r->gpu)
        printf("note: offload=%s on device=cpu keeps the state in more of the same memory: it saves nothing "
               "(allowed: the same code runs as on a GPU, which is how the tests check it)\n", c->offload);
    if (r->PP > 1) {
        printf("pipeline: %d stages, schedule %s", r->PP, c->pipeline_schedule);
        if (r->V > 1) printf(" over %d virtual stages per rank", r->V);
        if (r->sched == SCHED_INTERLEAVED && r->sc.split_backward) printf(" (backward split: weight passes fill the bubble)");
        printf(", %d micro-batches of %d sequences per data-parallel rank;", r->M, r->BM);
        for (int i = 0; i < r->PP; i++) {
            Stage rs[SCHED_MAX_CHUNKS];
            char desc[512];
            pipeline_rank_stages(r->stages, r->PP, r->V, i, rs);
            pipeline_describe(&r->mc, rs, r->V, desc, sizeof desc);
            printf(" stage %d: %s%s", i, desc, i + 1 < r->PP ? ";" : "\n");
        }
        /* the bubble the schedule leaves, for one stage's time per micro-batch in the steady state */
        if (schedule_no_flush(r->sched))
            printf("pipeline bubble: none between steps (%s: the pipeline fills once and drains at the end, and around "
                   "validation and checkpoints)\n", c->pipeline_schedule);
        else if (r->sched == SCHED_ZB1)  /* ZB-H1: (p-1)(F+B-W) idle of m(F+B+W), with F = B = W */
            printf("pipeline bubble: %.1f%% of the step predicted ((p-1)/(3m+p-1), ZB-H1 with equal F, B, W)\n",
                   100.0 * (r->PP - 1) / (3.0 * r->M + r->PP - 1));
        else
            printf("pipeline bubble: %.1f%% of the step predicted ((p-1)%s/(m+(p-1)%s))\n",
                   100.0 * (1.0 - (double)r->M / (r->M + (double)(r->PP - 1) / r->V)), r->V > 1 ? "/v" : "", r->V > 1 ? "/v" : "");
    }
    if (r->sched == SCHED_2BW)
        printf("weight versions: 2 (PipeDream-2BW): step t computes its gradient on the weights of update t - 1 and "
               "applies it to those of update t (one step stale)\n");
    if (r->sched == SCHED_PIPEDREAM) {
        int depth = r->PP > 1 ? r->PP : c->pipedream_depth > 1 ? c->pipedream_depth : 1;
        printf("weight versions (PipeDream, weight stashing): an update after every micro-batch (%d a step); ", r->M);
        if (c->pipedream_vertical_sync)
            printf("vertical sync: every stage computes micro-batch i on its weights of update i - %d, %d versions on "
                   "each stage", depth - 1, depth);
        else
            for (int i = 0; i < depth; i++)
                printf("stage %d computes micro-batch i on its weights of update i - %d, %d version%s%s", i, depth - 1 - i,
                       depth - i, depth - i > 1 ? "s" : "", i + 1 < depth ? "; " : "");
        printf("%s\n", r->PP > 1 ? "" : " (one process: the pipeline's reference)");
    }
    const LossScaleConfig *ls = &r->oc.loss_scale;
    if (ls->kind == LOSS_SCALE_FIXED)
        printf("loss scale: fixed at %g; a step whose gradient overflows is skipped\n", ls->init);
    if (ls->kind == LOSS_SCALE_DYNAMIC)
        printf("loss scale: dynamic (init %g), x2 after %d steps without an overflow, x0.5 (not below %g) at each "
               "overflow from the %d%s since it last grew; a step whose gradient overflows is skipped\n", ls->init,
               ls->window, ls->min, ls->hysteresis, ls->hysteresis == 1 ? "st" : ls->hysteresis == 2 ? "nd"
                                                                     : ls->hysteresis == 3 ? "rd" : "th");
    if (!strcmp(c->lr_schedule, "cosine"))
        printf("schedule: warmup %d steps, cosine from %g to %g at step %d (lr_decay_steps)%s\n", c->warmup_steps,
               c->lr, c->min_lr, c->lr_decay_steps, c->lr_decay_steps < c->steps ? ", then min_lr" : "");
    printf("data: %s (%s tokens, %zu global batches/epoch), %s (%s tokens)\n", c->train_data,
           fmt_commas(b1, (long long)r->train.n_tokens), r->loader.batches_per_epoch, c->val_data,
           fmt_commas(b2, (long long)r->val.n_tokens));
    estimate_print(&r->ein, r->dp, &r->est);
}

/* pipedream: each unit's delay (versions.h), what its stage's place in the pipeline makes it:
 * a stage runs stages - stage - 1 micro-batches ahead, so its forward of micro-batch i comes
 * after the update of micro-batch i - (stages - stage - 1) - 1 and computes on that version;
 * under vertical sync every stage takes the first stage's. One process with pipedream_depth:
 * the stages of a pipeline of that depth, as pipeline_split cuts it. */
static int unit_delays(const TrainRun *r, const Config *c, int **out, char *err, size_t errlen) {
    int n = r->m.n_units, depth = r->PP > 1 ? r->PP : c->pipedream_depth, vs = c->pipedream_vertical_sync;
    int *d = *out = xcalloc((size_t)n, sizeof(int));
    if (r->PP > 1) {
        for (int u = 0; u < n; u++) d[u] = vs ? r->PP - 1 : r->PP - 1 - r->mesh.pp_rank;
        return 0;
    }
    if (depth < 2) return 0;
    Stage *st = xcalloc((size_t)depth, sizeof(Stage));
    int rc = pipeline_split(&r->mc, r->T, depth, c->pipeline_split, st, err, errlen);
    for (int s = 0; !rc && s < depth; s++)
        for (int u = st[s].first; u <= st[s].last && u < n; u++) d[u] = vs ? depth - 1 : depth - 1 - s;
    free(st);
    return rc;
}

void train_setup(TrainRun *r, Config *c) {
    memset(r, 0, sizeof *r);
    r->c = c;
    char err[1024], b1[32], b2[32];
    /* pp_copy_engines=true (the default): pipeline send/receive on the copy engines, whose streams wait in
     * memory operations, each holding one of the device's hardware queues; with the default 8
     * other streams would share a queue with (and wait behind) one of them. CUDA reads
     * CUDA_DEVICE_MAX_CONNECTIONS when the context is made (cuda_init, in ops_init): set here, before MPI_Init
     * too (a CUDA-aware MPI may start CUDA), unless the user set it. Tensor parallel's fused
     * sums (tp_comm) wait so on the compute stream: the comm stream, whose NCCL kernels a
     * peer may be waiting for, must not wait behind it. */
    r->pp_ce = c->pp_copy_engines;
    r->gpu = !strcmp(c->device, "cuda");
    r->tp_fused_wanted = tensor_parallel_fused_wanted(tp_comm_of(c), c->tensor_parallel_size, r->gpu);
    if (r->gpu && ((r->pp_ce && c->pipeline_parallel_size > 1) || r->tp_fused_wanted))
        env_default("CUDA_DEVICE_MAX_CONNECTIONS", "32");
    comm_world_init(&r->world, c->comm_timeout);
    set_log_rank(r->world.rank, r->world.size);
    r->graphs = graphs_wanted(c, r->world.size, r->gpu);
    ScheduleKind kind;
    if (!schedule_kind_parse(c->pipeline_schedule, &kind) && schedule_no_flush(kind))
        r->graphs = 0;  /* a recorded layer keeps one version's weights */
    /* Set-up failures are gathered in f and agreed on by every rank (comm_exit_if_failed)
     * before anything is allocated, so that an error every rank meets prints once. */
    Fail f = {0};
#ifndef MESHTRAIN_NCCL
    if (r->gpu && r->world.size > 1)
        /* Several GPUs: the collectives on device buffers need NCCL (comm.c). */
        fail_set(&f, EXIT_BAD_INPUT, "device=cuda with %d processes needs NCCL, and this build has no NCCL "
                 "(nccl.h or libnccl was not found at build time); run one process, or rebuild with NCCL", r->world.size);
#endif
    comm_exit_if_failed(&r->world, &f);
    if (mesh_init(&r->mesh, &r->world, c->tensor_parallel_size, c->pipeline_parallel_size,
                  c->fsdp && !strcmp(c->shard_strategy, "hybrid")
                      ? (c->shard_group_size ? c->shard_group_size : comm_local_size()) : 0,
                  c->expert_parallel_size, err, sizeof err))
        fail_set(&f, EXIT_BAD_INPUT, "%s", err);
    if (!f.code && !strcmp(c->dp_allreduce, "hierarchical") && !r->mesh.dp_hosts)
        fail_set(&f, EXIT_BAD_INPUT, "dp_allreduce=hierarchical: the %d data-parallel ranks do not span several "
                 "machines with as many (more than one) on each; use dp_allreduce=auto or flat", r->mesh.dp_size);
    /* DDP only (zero_opt and fsdp reduce-scatter; hybrid FSDP is their machine-aware form) */
    r->mesh.hier_allreduce = r->mesh.dp_hosts && !c->fsdp && !c->zero_opt && r->mesh.ep_size == 1 &&
                             !strcmp(c->device, "cpu") && strcmp(c->dp_allreduce, "flat");
    comm_exit_if_failed(&r->world, &f);
    r->lead = r->world.rank == 0;
    r->dp = r->mesh.dp_size;

    r->resuming = c->resume[0] != 0;
    if (r->resuming) {
        if (ckpt_read_header(c->resume, &r->resume_h, err, sizeof err)) fail_set(&f, EXIT_BAD_INPUT, "%s", err);
        else if (!check_against_ckpt(c, &r->resume_h, c->resume, &f) && !config_from_ckpt(c, &r->resume_h, r->dp, &f) &&
                 !loss_scale_from_ckpt(c, r, &f)) {
            r->ckpt_global = r->resume_h.global_batch ? r->resume_h.global_batch : r->resume_h.batch_size * r->resume_h.world;
            if (config_validate(c, CMD_TRAIN, err, sizeof err)) fail_set(&f, EXIT_BAD_INPUT, "%s", err);
            else if (r->resume_h.step >= c->steps)
                fail_set(&f, EXIT_BAD_INPUT, "checkpoint %s is at step %d; steps=%d leaves nothing to run", c->resume,
                         r->resume_h.step, c->steps);
        }
    }
    if (!c->lr_decay_steps) c->lr_decay_steps = c->steps;
    r->oc = optim_config_of(c);
    r->mc = model_config_of(c);
    r->B = c->batch_size, r->T = c->context_len, r->K = c->grad_accum_steps;
    r->G = r->B * r->dp * r->K;
    r->kind = strategy_of(c);
    /* Pipeline parallel: this rank's stage; each micro-batch is B / micro_batches sequences,
     * and grad_accum_steps = K makes the step's schedule K x micro_batches of them long (the
     * same update as K rounds, with one fill and drain of the pipeline instead of K) */
    r->PP = r->mesh.pp_size;
    r->M = r->PP > 1 ? c->micro_batches * r->K : r->K;
    r->BM = r->PP > 1 ? r->B / c->micro_batches : r->B;
    r->sched = SCHED_1F1B;
    schedule_kind_parse(c->pipeline_schedule, &r->sched);  /* the key's choices are the kinds */
    /* interleaved: V stages per rank (chunks), stages c x PP + pp_rank of the split */
    r->V = r->PP > 1 ? config_virtual_stages(c) : 1;
    r->stages = xcalloc((size_t)r->PP * r->V, sizeof(Stage));
    r->mine[0] = (Stage){0, r->mc.n_layers + 1};
    r->stage_cost = xcalloc((size_t)r->PP * r->V * 3, sizeof(double));  /* each stage's F, B, W estimate */
    int split_ok = pipeline_split_backward_ok(&r->mc, r->BM * r->T, c->activation_checkpointing);
    if (!f.code && r->PP > 1) {
        if (pipeline_split_schedule(&r->mc, r->T, r->PP, r->V, r->sched, r->M, split_ok, c->zb1_max_in_flight,
                                    pipeline_head_placement(r->sched, r->PP), c->pipeline_split, r->stages, err, sizeof err))
            fail_set(&f, EXIT_BAD_INPUT, "%s", err);
        else pipeline_rank_stages(r->stages, r->PP, r->V, r->mesh.pp_rank, r->mine);
        if (!f.code) pipeline_stage_costs(&r->mc, r->T, r->stages, r->PP * r->V, pipeline_head_placement(r->sched, r->PP), r->stage_cost);
        if (!f.code && schedule_build(&r->sc, r->sched, r->PP, r->mesh.pp_rank, r->M, r->V, split_ok, c->zb1_max_in_flight,
                                      r->stage_cost, err, sizeof err))
            fail_set(&f, EXIT_BAD_INPUT, "%s", err);
    }
    for (int i = 0; i < r->V; i++) r->holds_head |= r->mine[i].last == r->mc.n_layers + 1;

    if (!f.code && !open_shard_checked(&r->train, c->train_data, "training", c->vocab_size, &f) &&
        !open_shard_checked(&r->val, c->val_data, "validation", c->vocab_size, &f)) {
        if (loader_init(&r->loader, &r->train, r->BM, r->T, r->mesh.dp_rank, r->dp, (uint64_t)c->seed, 1, err, sizeof err))
            fail_set(&f, EXIT_BAD_INPUT, "%s", err);
        /* Validation: the same global batches as one process with batch B x dp would take. */
        size_t val_windows = shard_windows(&r->val, r->T);
        r->val_B = (int)(val_windows / (size_t)r->dp < (size_t)r->B ? val_windows / (size_t)r->dp : (size_t)r->B);
        if (r->val_B < 1)
            fail_set(&f, EXIT_BAD_INPUT, "validation data %s (%zu tokens) is too short for context_len=%d on %d ranks",
                     c->val_data, r->val.n_tokens, r->T, r->dp);
    }
    comm_exit_if_failed(&r->world, &f);

    OpsOptions ops_opts = ops_options_of(c);
    ops_set_options(&ops_opts);
    if (ops_init(c->device, c->threads, err, sizeof err)) fail_set(&f, EXIT_BAD_INPUT, "%s", err);
    comm_exit_if_failed(&r->world, &f);
    r->prec = precision_of(c);
    if (ops_set_precision(r->prec, err, sizeof err)) fail_set(&f, EXIT_BAD_INPUT, "%s", err);
    comm_exit_if_failed(&r->world, &f);
    size_t data_bytes = (r->train.n_tokens + r->val.n_tokens) * 2, dev_free = 0;
    /* the all-to-all buffer counts only where the copy engines will take it: one machine, NCCL 2.28+ */
    comm_set_copy_engines(c->copy_engines);
    r->ein = estimate_input_of(c, r->world.size, r->mesh.shard_size, &r->oc);
    r->ein.data_bytes = data_bytes;
    r->ein.ddp_copy_engines = r->gpu && r->kind == PAR_DDP && r->dp > 1 && comm_copy_engines_possible(&r->mesh.dp);
    r->ein.pp_copy_engines = r->pp_ce && r->PP > 1;  /* (counted where asked: the links decide at step_init) */
    r->ein.tp_fused = r->gpu && r->tp_fused_wanted;  /* (likewise) */
    estimate_memory(&r->ein, &r->est);
    /* a pipeline stage: its units, and the micro-batches its schedule keeps in flight */
    if (r->PP > 1) estimate_stage(&r->est, &r->ein, r->mine, &r->sc, r->BM);
    if (r->gpu && ops_device_memory(&dev_free, NULL)) dev_free = 0;
    /* Ranks on one machine share its memory: each host's need is its ranks' sum (the host's
     * offloaded state always; a cpu rank's whole estimate, when no max_memory_gb caps it per
     * rank). Collective: every rank asks, whatever failed above. */
    size_t host_avail = available_memory_bytes();
    int local = comm_local_size();
    double host_need = comm_local_sum(r->oc.offload ? (double)r->est.host : 0.0);
    double local_need = comm_local_sum((double)r->est.total);
    if (r->oc.offload && host_avail && host_need > (double)host_avail)
        fail_set(&f, EXIT_BAD_INPUT, "offload=%s keeps about %s in host memory on this machine (%d rank%s) but only %s "
                 "is available (shard it over more ranks or machines, or lower the model size)", c->offload,
                 fmt_bytes(b1, host_need), local, local > 1 ? "s" : "", fmt_bytes(b2, (double)host_avail));
    size_t limit = c->max_memory_gb > 0 ? (size_t)(c->max_memory_gb * 1e9) : r->gpu ? dev_free : host_avail;
    int per_host = !r->gpu && c->max_memory_gb <= 0 && local > 1;
    double need = per_host ? local_need : (double)r->est.total;
    if (limit && need > (double)limit) {
        char b3[32], where[96];
        if (per_host) snprintf(where, sizeof where, "per rank, %s for the %d ranks on this machine,",
                               fmt_bytes(b3, local_need), local);
        else snprintf(where, sizeof where, "per %s", r->gpu ? "GPU" : "rank");
        fail_set(&f, EXIT_BAD_INPUT, "this run needs about %s %s but only %s is available (%s)",
                 fmt_bytes(b1, (double)r->est.total), where, fmt_bytes(b2, (double)limit), estimate_remedy(&r->est, c));
    }

    /* Everything the run will write, checked now rather than after its last step: each
     * rank writes its own checkpoint shard beside ckpt_path; rank 0 the log and manifest. */
    r->saving = strcmp(c->ckpt_path, "none") != 0;
    if (!f.code && r->saving) check_writable(c->ckpt_path, "the checkpoint (ckpt_path)", &f);
    if (!f.code && r->lead) {
        mkdir_p(c->out_dir);
        mkdir_parent(c->log_file);
        if (jsonlog_open(&r->log_store, c->log_file, r->resuming, err, sizeof err)) fail_set(&f, EXIT_BAD_INPUT, "%s", err);
        else r->log = &r->log_store;
    }
    comm_exit_if_failed(&r->world, &f);

    if (r->lead) print_header(r);

    /* a pipeline stage holds its own units, and the last one a copy of a tied embedding */
    model_init_layout_ep(&r->m, &r->mc, r->mesh.shard_size, 0, r->mine, r->V, r->mesh.tp_size, r->mesh.tp_rank,
                         r->mesh.ep_size, r->mesh.ep_rank);
    /* tensor parallel: each rank holds its slices of every layer */
    tensor_parallel_attach(&r->m, &r->mesh, &(TpOptions){c->sequence_parallel, r->tp_fused_wanted});
    /* mixture of experts: the router's statistics over the data-parallel ranks, the step's
     * statistics, the losses' weights */
    expert_parallel_attach(&r->m, &r->mesh);
    /* selection biases: balanced after each step, kept from the checkpoint resumed (even where
     * the balancing stops), or skewed on purpose (a test hook) */
    int skew = r->m.n_moe && hook_int(HOOK_MOE_SKEW, 0) > 0;
    int kept_bias = r->resuming && (r->resume_h.flags & CKPT_MOE_BIAS);
    model_moe_alloc(&r->m, skew || kept_bias || c->moe_bias_balance > 0);
    model_moe_set_training(&r->m, (float)c->moe_aux_loss, (float)c->moe_z_loss, (float)c->moe_bias_balance);
    if (skew) {  /* a router skewed on purpose (tests): expert 0 favoured most, the last not at all */
        int X = r->m.X;
        double s = (double)hook_int(HOOK_MOE_SKEW, 0) / 1000.0;
        for (int i = 0; i < r->m.n_moe * X; i++) r->m.moe_bias_host[i] = X > 1 ? (float)(s * (X - 1 - i % X) / (X - 1)) : 0.0f;
        model_moe_set_bias(&r->m, r->m.moe_bias_host);
    }
    r->tied_copy = r->mc.tie_embeddings && r->PP > 1 && !stage_has_embedding(&r->mine[0]) && r->holds_head;
    r->par = parallel_create(r->kind, &r->m, &r->mesh, c->overlap, &r->oc);
    parallel_set_bucket(r->par, (size_t)(c->bucket_mb * 1e6));
    r->compress = !strcmp(c->grad_compression, "bf16")       ? COMPRESS_BF16
                  : !strcmp(c->grad_compression, "int8")     ? COMPRESS_INT8
                  : !strcmp(c->grad_compression, "powersgd") ? COMPRESS_POWERSGD
                                                             : COMPRESS_NONE;
    if (r->dp > 1 && parallel_set_compression(r->par, r->compress, c->powersgd_rank, c->powersgd_warmup,
                                              c->powersgd_min_compression_rate, err, sizeof err))
        fail_set(&f, EXIT_BAD_INPUT, "%s", err);
    comm_exit_if_failed(&r->world, &f);
    if (r->lead && r->kind == PAR_DDP && r->gpu && r->dp > 1)
        printf("gradient all-reduce: %s\n", comm_copy_engines_active(&r->mesh.dp)
                   ? "copy engines (NCCL all-to-all, sum kernel, all-gather; copy_engines=true)"
                   : "NCCL all-reduce kernels");
    /* pipedream: each stage's update on its own gradient alone (no norm across the stages) */
    parallel_set_stages(r->par, r->sched == SCHED_PIPEDREAM ? NULL : &r->mesh.pp, !r->tied_copy);
    /* a tied embedding's two copies (the first and the last stage) sum their gradients */
    r->tie_member = r->mc.tie_embeddings && r->PP > 1 && (stage_has_embedding(&r->mine[0]) || r->tied_copy);
    if (r->PP > 1 && r->mc.tie_embeddings)
        comm_split(&r->world, r->tie_member ? r->mesh.dp_rank * r->mesh.tp_size + r->mesh.tp_rank : r->world.size + r->world.rank,
                   r->mesh.pp_rank, "tie", &r->tie);
    acts_alloc_stage(&r->a, &r->m, &r->mine[0], r->BM, r->T, train_acts_mode(c) | (r->sc.head_split ? ACTS_HEAD_SPLIT : 0));
    r->tp_fused = tensor_parallel_fused_open(&r->m, &r->mesh, r->a.N);  /* (where tp_comm asks for it) */
    if (r->lead && r->mesh.tp_size > 1)
        printf("tensor parallel sums: %s (tp_comm=%s)\n",
               !r->tp_fused_wanted ? "collectives"
               : !r->tp_fused      ? "collectives, the GPUs cannot map each other's memory here"
               : !r->gpu           ? "fused into the products, MPI messages"
               : tensor_parallel_gathers_direct() ? "fused into the products, copy engines and CUDA IPC"
                                                  : "fused into the products, copy engines and CUDA IPC, the gathers "
                                                    "through slots", c->tp_comm);
    if (r->resuming) {
        if (train_state_load(c->resume, &r->resume_h, r->par, &r->m, err, sizeof err)) fail_set(&f, EXIT_BAD_INPUT, "%s", err);
        else if (ckpt_load_moe_bias(c->resume, &r->resume_h, &r->m, err, sizeof err))
            fail_set(&f, EXIT_BAD_INPUT, "%s", err);
        size_t n_e, n_f;
        float *ff, *e = parallel_compression_state(r->par, &n_e, &ff, &n_f);
        if (!f.code && e) {  /* each rank's residuals, where the checkpoint's layout and compression are this run's */
            int kept = ckpt_load_grad_ef(c->resume, &r->resume_h, r->world.rank, r->world.size, r->compress, e, n_e, ff,
                                         n_f, err, sizeof err);
            if (kept < 0) fail_set(&f, EXIT_BAD_INPUT, "%s", err);
            else if (!kept && r->lead && (r->resume_h.flags & CKPT_GRAD_EF))
                printf("note: the checkpoint's gradient compression residuals are of another layout or compression; "
                       "they start at zero\n");
        }
        LoaderState ls = {r->resume_h.loader_epoch, r->resume_h.loader_window};
        if (!f.code && loader_set_state(&r->loader, ls, err, sizeof err))
            fail_set(&f, EXIT_BAD_INPUT, "%s: %s", c->resume, err);
        comm_exit_if_failed(&r->world, &f);
        parallel_params_changed(r->par);
        parallel_set_adam_steps(r->par, r->resume_h.adam_step);
        if (r->resume_has_scaler) {  /* the steps skipped so far; a dynamic scale goes on where it was */
            LossScaler *ls = optim_loss_scaler(parallel_optimizer(r->par)), *was = &r->resume_scaler;
            ls->skipped = was->skipped;
            if (ls->c.kind == LOSS_SCALE_DYNAMIC && was->c.kind == LOSS_SCALE_DYNAMIC && !config_was_set("loss_scale_init"))
                ls->scale = was->scale, ls->growth = was->growth, ls->hysteresis = was->hysteresis;
        }
        r->start = r->resume_h.step;
        if (r->lead)
            printf("resumed from %s at step %d (saved by %d rank%s)\n", c->resume, r->start, r->resume_h.world,
                   r->resume_h.world > 1 ? "s" : "");
    } else {
        parallel_init_weights(r->par, (uint64_t)c->seed);
    }

    /* The disk space the run will write (each rank's checkpoint shard, rank 0's manifest and
     * log), checked now rather than found short after the last step. A save keeps the
     * previous checkpoint until the new one is whole, so the new one needs its full size. */
    {
        double log_bytes = r->lead ? 4096.0 + 320.0 * (c->steps - r->start) : 0;  /* a step's line is about 250 bytes */
        double ckpt_bytes = r->saving ? (double)train_state_save_bytes(r->par, &r->m, r->tied_copy) +
                                         (r->lead ? (double)ckpt_manifest_bytes(c->ckpt_path, r->world.size) + 65536 : 0)
                                : 0;  /* (and the settings beside it) */
        DiskNeed needs[2] = {{c->ckpt_path, "the checkpoint", ckpt_bytes}, {c->log_file, "the log", log_bytes}};
        check_disk_space(&r->world, needs, 2, &f);
    }
    if (!f.code && r->log) {
        if (log_header(r->log, c, r->start, r->resuming, r->world.size))
            fail_set(&f, EXIT_BAD_INPUT, "cannot write the log file %s (log_file): %s", c->log_file,
                     jsonlog_error(r->log));
        else {  /* (the line is still in the log's buffer) */
            r->settings = xmalloc(r->log->len + 1);
            memcpy(r->settings, r->log->buf, r->log->len);
            r->settings[r->log->len] = 0;
        }
    }
    comm_exit_if_failed(&r->world, &f);
    if (r->lead && r->resuming && r->oc.cosine && r->oc.min_lr == 0 && r->start >= r->oc.decay_steps)
        printf("note: step %d is past the schedule's end (lr_decay_steps=%d): the cosine has reached min_lr=0, so the "
               "steps to %d train at learning rate 0; give lr_decay_steps= (a longer cosine) or min_lr=\n", r->start,
               r->oc.decay_steps, c->steps);

    comm_barrier(&r->world);  /* the checkpoint folder exists before any rank writes to it */

    r->h.vocab_size = r->mc.vocab_size; r->h.embed_dim = r->mc.embed_dim; r->h.n_heads = r->mc.n_heads; r->h.n_layers = r->mc.n_layers;
    r->h.context_len = r->mc.context_len; r->h.tie_embeddings = r->mc.tie_embeddings;
    r->h.batch_size = r->B; r->h.world = r->world.size; r->h.seed = c->seed; r->h.has_optim = 1;
    r->h.global_batch = r->G;
    r->h.grad_accum_steps = r->K;
    r->h.lr = r->oc.lr; r->h.min_lr = r->oc.min_lr; r->h.beta1 = r->oc.beta1; r->h.beta2 = r->oc.beta2; r->h.eps = r->oc.eps;
    r->h.weight_decay = r->oc.weight_decay; r->h.grad_clip = r->oc.grad_clip; r->h.warmup_steps = r->oc.warmup_steps;
    r->h.total_steps = c->steps; r->h.lr_decay_steps = r->oc.decay_steps; r->h.cosine = r->oc.cosine;
    r->h.optimizer = r->oc.kind; r->h.af_beta1 = r->oc.af_beta1; r->h.af_clip = r->oc.af_clip; r->h.af_decay = r->oc.af_decay;
    r->h.af_flags = r->oc.af_relative_step | r->oc.af_scale_parameter << 1;
    r->h.val_every = c->val_every; r->h.val_batches = c->val_batches;
    if (r->mc.moe_experts) {
        r->h.moe_experts = r->mc.moe_experts; r->h.moe_expert_dim = r->mc.moe_expert_dim;
        r->h.moe_top_k = (int16_t)r->mc.moe_top_k; r->h.moe_shared_experts = (int16_t)r->mc.moe_shared_experts;
        r->h.moe_every = (int16_t)r->mc.moe_every; r->h.moe_router_sigmoid = (int16_t)r->mc.moe_router_sigmoid;
        r->h.moe_capacity_factor = r->mc.moe_capacity_factor;
        r->h.moe_aux_loss = (float)c->moe_aux_loss; r->h.moe_z_loss = (float)c->moe_z_loss;
        r->h.moe_bias_balance = (float)c->moe_bias_balance;
        if (r->m.moe_bias) r->h.flags |= CKPT_MOE_BIAS;
    }
    if (r->oc.loss_scale.kind) r->h.flags |= CKPT_LOSS_SCALE;
    if (r->compress && r->dp > 1) r->h.flags |= CKPT_GRAD_EF;
    if (r->sched == SCHED_2BW) r->h.flags |= CKPT_2BW;
    if (r->sched == SCHED_PIPEDREAM) r->h.flags |= CKPT_PIPEDREAM;

    /* MFU's reference: the key, or the card's dense bf16 peak by its name (an fp32 run reaches a
     * small fraction of it, as the PyTorch peers count it); none for an unknown card or the cpu */
    r->peak = c->peak_tflops > 0 ? c->peak_tflops * 1e12 : r->gpu ? card_peak_flops(ops_device_name()) : 0;
    int *delay = NULL;
    if (r->sched == SCHED_PIPEDREAM && unit_delays(r, c, &delay, err, sizeof err)) die(EXIT_BAD_INPUT, "%s", err);
    StepPipeline pipe = {&r->mesh.pp, r->tie_member ? &r->tie : NULL, r->sched, r->stage_cost, c->zb1_max_in_flight,
                         r->pp_ce, delay};
    if (step_init(&r->st, &r->m, r->mine, r->V, r->par, &r->loader, &r->a, r->M,
                  r->PP > 1 || schedule_no_flush(r->sched) ? &pipe : NULL, err, sizeof err))
        die(EXIT_BAD_INPUT, "%s", err);
    free(delay);
    /* 2bw or pipedream resumed from a checkpoint of the same: the versions before the newest,
     * as each rank saved them (another schedule resumes on the newest alone; a 2bw or pipedream
     * run from another checkpoint starts its staleness there, every version being the newest) */
    if (r->resuming) {
        step_set_start(&r->st, r->start, r->resume_h.adam_step);
        unsigned want = r->sched == SCHED_2BW ? CKPT_2BW : r->sched == SCHED_PIPEDREAM ? CKPT_PIPEDREAM : 0;
        if ((r->resume_h.flags & want) &&
            train_stash_load(c->resume, &r->resume_h, r->world.rank, r->world.size, &r->st, err, sizeof err) < 0)
            fail_set(&f, EXIT_BAD_INPUT, "%s", err);
        comm_exit_if_failed(&r->world, &f);
    }
    if (r->PP > 1) {  /* the path the links that carry messages took, over every rank */
        int took[2] = {0, 0};  /* some link on NCCL (or MPI); some on the copy engines */
        for (int i = 0; i < r->st.n_links; i++) {
            int k = comm_p2p_on_copy_engines(r->st.link_order[i]);
            if (k >= 0) took[k] = 1;
        }
        comm_allreduce_max_int(&r->world, took, 2);
        if (r->lead)
            printf("pipeline send/receive: %s\n",
                   !r->gpu ? "MPI (host memory)"
                   : !r->pp_ce ? "NCCL kernels (pp_copy_engines=false)"
                   : !took[0] ? "copy engines (CUDA IPC rings, stream memory operations; no SM)"
                   : took[1] ? "copy engines on some links, NCCL kernels on the others (a link's two GPUs must be on "
                               "one machine, with peer access)"
                             : "NCCL kernels (the copy engines cannot take them here: a link's two GPUs must be on one "
                               "machine, with peer access and 64-bit stream memory operations)");
        if (r->lead && took[1] && comm_p2p_skip_copies())  /* (where the copy engines carry a link: there only) */
            printf("pipeline send/receive: MESHTRAIN_PP_SKIP_COPIES=1: the messages are NOT copied (a timing "
                   "experiment: this run's results are wrong)\n");
    }
}
