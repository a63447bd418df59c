/* train — the training loop: one process or many (mpirun), any data-parallel strategy. */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "checkpoint.h"
#include "commands.h"
#include "comm.h"
#include "env.h"
#include "estimate.h"
#include "jsonlog.h"
#include "layer_graphs.h"
#include "mesh.h"
#include "ops.h"
#include "trace.h"
#include "optim.h"
#include "parallel.h"
#include "pipeline.h"
#include "run.h"
#include "step.h"
#include "tensor.h"
#include "train_state.h"
#include "util.h"

/* MESHTRAIN_GRAPHS: 1 records each layer's forward and backward as graphs of ops and replays
 * them (model_use_graphs) in any run, 0 never; unset: in one-process runs on a GPU (checked
 * bitwise against op by op on one GPU; on several GPUs only where asked, until measured
 * there). A layer split over tensor-parallel ranks always runs op by op; on the cpu, which
 * records nothing, every layer does (through the recordings' cache, which 1 exercises). */
static int graphs_wanted(int world_size, int gpu) { return env_flag("MESHTRAIN_GRAPHS", gpu && world_size == 1); }

/* Model keys and the seed given on the command line must agree with a checkpoint's. */
static int check_against_ckpt(const Config *c, const CkptHeader *h, const char *path, Fail *f) {
    struct { const char *key; int want, have; } k[] = {
        {"vocab_size", c->vocab_size, h->vocab_size}, {"embed_dim", c->embed_dim, h->embed_dim},
        {"n_heads", c->n_heads, h->n_heads},          {"n_layers", c->n_layers, h->n_layers},
        {"context_len", c->context_len, h->context_len}, {"tie_embeddings", c->tie_embeddings, h->tie_embeddings},
        {"seed", c->seed, h->seed},
    };
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++)
        if (config_was_set(k[i].key) && k[i].want != k[i].have)
            return fail_set(f, EXIT_BAD_INPUT, "%s=%d differs from checkpoint %s (%s=%d)", k[i].key, k[i].want, path,
                            k[i].key, k[i].have);
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

/* ---- progress display ---- */

typedef struct { int on; double t0; int first_step, steps; } Progress;

static void progress_draw(Progress *p, int step, float loss, double tok_s) {
    if (!p->on) return;
    int width = 30, done = (int)((double)(step - p->first_step) / (p->steps - p->first_step) * width);
    double elapsed = now_seconds() - p->t0;
    double eta = step > p->first_step ? elapsed / (step - p->first_step) * (p->steps - step) : 0;
    char bar[64];
    for (int i = 0; i < width; i++) bar[i] = i < done ? '#' : '.';
    bar[width] = 0;
    fprintf(stderr, "\r\033[K[%s] %d/%d loss %.4f %.0f tok/s eta %dm%02ds", bar, step, p->steps, loss, tok_s,
            (int)eta / 60, (int)eta % 60);
    fflush(stderr);
}

static void progress_clear(Progress *p) {
    if (p->on) fprintf(stderr, "\r\033[K");
}

/* MFU's reference on a GPU: the H100 SXM's dense bf16 tensor-core peak, as the PyTorch peer
 * and the post count it (an fp32 run reaches a small fraction of it). */
#define GPU_PEAK_FLOPS 989e12

/* Test hooks for fault handling: MESHTRAIN_FAULT_KILL / _HANG = "rank:step" make that
 * rank die (SIGKILL) or stop responding at the start of that step. */
static void inject_fault(int rank, int step) {
    int r, s;
    if (hook_rank_step(HOOK_FAULT_KILL, &r, &s) && r == rank && s == step) raise(SIGKILL);
    if (hook_rank_step(HOOK_FAULT_HANG, &r, &s) && r == rank && s == step)
        for (;;) sleep(1000);
}

/* Max and min of a per-rank value over the world. */
static void world_max_min(const Comm *w, double v, double *mx, double *mn) {
    double *all = xcalloc((size_t)w->size, sizeof(double));
    all[w->rank] = v;
    comm_allreduce_double(w, all, (size_t)w->size);
    *mx = *mn = all[0];
    for (int i = 1; i < w->size; i++) { *mx = fmax(*mx, all[i]); *mn = fmin(*mn, all[i]); }
    free(all);
}

/* A non-finite loss (training or validation) or gradient norm ends the run before anything
 * is saved: the last checkpoint stays the last good one. Every rank sees the same value
 * (reduced), so all stop here together. */
static _Noreturn void stop_non_finite(Progress *pr, JsonLog *log, int step, const char *what, double v, int lead,
                                      const char *ckpt) {
    progress_clear(pr);
    if (log) {  /* the log's last word, if it can still be written (the error below is the one that counts) */
        jsonlog_begin(log);
        jsonlog_raw(log, "\"step\":%d,\"error\":\"non-finite %s\"", step, what);
        (void)jsonlog_end(log);
        jsonlog_close(log);
    }
    if (lead) {
        if (ckpt) fprintf(stderr, "meshtrain: step %d: the %s is %s; stopping. The last checkpoint, if any, is intact: %s\n",
                          step, what, isnan(v) ? "NaN" : "infinite", ckpt);
        else fprintf(stderr, "meshtrain: step %d: the %s is %s; stopping (ckpt_path=none: no checkpoint)\n", step, what,
                     isnan(v) ? "NaN" : "infinite");
    }
    comm_world_finalize();
    exit(EXIT_RUN_FAILURE);
}

/* ---- signals: the first SIGINT or SIGTERM ends the run after the current step, with a
 * checkpoint; a second one ends the process at once ---- */

static volatile sig_atomic_t g_signal;
static int g_signal_lead;  /* this rank prints the handler's note */

static void on_signal(int sig) {
    if (g_signal) _exit(128 + sig);
    g_signal = sig;
    /* (the ranks agree on stopping after the step; whether a checkpoint can then be saved is
     * only known there: a lost peer rank ends the job instead) */
    static const char note[] = "\nmeshtrain: signal received: stopping after this step "
                               "(send it again to stop at once)\n";
    if (g_signal_lead) {
        ssize_t w = write(2, note, sizeof note - 1);
        (void)w;
    }
}

static void catch_signals(int lead) {
    g_signal_lead = lead;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

/* Why the run stops after this step, agreed by every rank: the signal any rank has received
 * (0: none), and whether rank 0's log could not be written. */
typedef struct { int signal, log_failed; } StopReason;
static StopReason stop_agreed(const Comm *world, int log_failed) {
    int v[2] = {g_signal, log_failed};
    if (world->size > 1) comm_allreduce_max_int(world, v, 2);
    return (StopReason){v[0], v[1]};
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

int cmd_train(Config *c) {
    char err[1024], b1[32], b2[32];
    Comm world;
    /* pp_copy_engines=true (the default): pipeline send/receive on the copy engines, whose streams wait in
     * memory operations, each holding one of the device's hardware queues; with the default 8
     * other streams would share a queue with (and wait behind) one of them. CUDA reads
     * CUDA_DEVICE_MAX_CONNECTIONS when the context is made (cuda_init, in ops_init): set here, before MPI_Init
     * too (a CUDA-aware MPI may start CUDA), unless the user set it. Tensor parallel's fused
     * sums (tensor_parallel_fused_mode) wait so on the compute stream: the comm stream, whose
     * NCCL kernels a peer may be waiting for, must not wait behind it. */
    int pp_ce = c->pp_copy_engines, gpu = !strcmp(c->device, "cuda");
    if (gpu && ((pp_ce && c->pipeline_parallel_size > 1) || tensor_parallel_fused_early(c->tensor_parallel_size, gpu)))
        env_default("CUDA_DEVICE_MAX_CONNECTIONS", "32");
    comm_world_init(&world, c->comm_timeout);
    set_log_rank(world.rank, world.size);
    int fused_mode = tensor_parallel_fused_mode(c->tensor_parallel_size, gpu);  /* (a bad value: one line) */
    int graphs = graphs_wanted(world.size, gpu);  /* (likewise) */
    /* Set-up failures are gathered in f and agreed on by every rank (comm_exit_if_failed)
     * before anything is allocated, so that an error every rank meets prints once. */
    Fail f = {0};
#ifndef MESHTRAIN_NCCL
    if (gpu && world.size > 1)
        /* Several GPUs: the collectives on device buffers need NCCL (comm.c). */
        fail_set(&f, EXIT_BAD_INPUT, "device=cuda with %d processes needs NCCL, and this build has no NCCL "
                 "(nccl.h or libnccl was not found at build time); run one process, or rebuild with NCCL", world.size);
#endif
    comm_exit_if_failed(&world, &f);
    Mesh mesh;
    if (mesh_init(&mesh, &world, c->tensor_parallel_size, c->pipeline_parallel_size,
                  c->fsdp && !strcmp(c->shard_strategy, "hybrid")
                      ? (c->shard_group_size ? c->shard_group_size : comm_local_size()) : 0,
                  err, sizeof err))
        fail_set(&f, EXIT_BAD_INPUT, "%s", err);
    comm_exit_if_failed(&world, &f);
    int lead = world.rank == 0, dp = mesh.dp_size;

    CkptHeader resume_h;
    int resuming = c->resume[0] != 0, ckpt_global = 0;
    if (resuming) {
        if (ckpt_read_header(c->resume, &resume_h, err, sizeof err)) fail_set(&f, EXIT_BAD_INPUT, "%s", err);
        else if (!check_against_ckpt(c, &resume_h, c->resume, &f) && !config_from_ckpt(c, &resume_h, dp, &f)) {
            ckpt_global = resume_h.global_batch ? resume_h.global_batch : resume_h.batch_size * resume_h.world;
            if (config_validate(c, CMD_TRAIN, err, sizeof err)) fail_set(&f, EXIT_BAD_INPUT, "%s", err);
            else if (resume_h.step >= c->steps)
                fail_set(&f, EXIT_BAD_INPUT, "checkpoint %s is at step %d; steps=%d leaves nothing to run", c->resume,
                         resume_h.step, c->steps);
        }
    }
    if (!c->lr_decay_steps) c->lr_decay_steps = c->steps;
    OptimConfig oc = optim_config_of(c);
    ModelConfig mc = model_config_of(c);
    int B = c->batch_size, T = c->context_len, K = c->grad_accum_steps, G = B * dp * K;  /* G: the global batch */
    ParallelKind kind = strategy_of(c);
    /* Pipeline parallel: this rank's stage; each micro-batch is B / micro_batches sequences,
     * and grad_accum_steps = K makes the step's schedule K x micro_batches of them long (the
     * same update as K rounds, with one fill and drain of the pipeline instead of K) */
    int PP = mesh.pp_size, M = PP > 1 ? c->micro_batches * K : K, BM = PP > 1 ? B / c->micro_batches : B;
    ScheduleKind sched = SCHED_1F1B;
    schedule_kind_parse(c->pipeline_schedule, &sched);  /* the key's choices are the kinds */
    /* interleaved: V stages per rank (chunks), stages c x PP + pp_rank of the split */
    int V = PP > 1 ? config_virtual_stages(c) : 1;
    Stage *stages = xcalloc((size_t)PP * V, sizeof(Stage)), mine[SCHED_MAX_CHUNKS] = {{0, mc.n_layers + 1}};
    Schedule sc = {0};
    double *stage_cost = xcalloc((size_t)PP * V * 3, sizeof(double));  /* each stage's F, B, W estimate */
    int split_ok = pipeline_split_backward_ok(&mc, BM * T, c->activation_checkpointing);
    if (!f.code && PP > 1) {
        if (pipeline_split_schedule(&mc, T, PP, V, sched, M, split_ok, c->zb1_max_in_flight,
                                    pipeline_head_placement(sched, PP), c->pipeline_split, stages, err, sizeof err))
            fail_set(&f, EXIT_BAD_INPUT, "%s", err);
        else pipeline_rank_stages(stages, PP, V, mesh.pp_rank, mine);
        if (!f.code) pipeline_stage_costs(&mc, T, stages, PP * V, pipeline_head_placement(sched, PP), stage_cost);
        if (!f.code && schedule_build(&sc, sched, PP, mesh.pp_rank, M, V, split_ok, c->zb1_max_in_flight, stage_cost,
                                      err, sizeof err))
            fail_set(&f, EXIT_BAD_INPUT, "%s", err);
    }
    int holds_head = 0;
    for (int i = 0; i < V; i++) holds_head |= mine[i].last == mc.n_layers + 1;

    Shard train = {0}, val = {0};
    Loader loader = {0};
    int val_B = 0;
    if (!f.code && !open_shard_checked(&train, c->train_data, "training", c->vocab_size, &f) &&
        !open_shard_checked(&val, c->val_data, "validation", c->vocab_size, &f)) {
        if (loader_init(&loader, &train, BM, T, mesh.dp_rank, dp, (uint64_t)c->seed, 1, err, sizeof err))
            fail_set(&f, EXIT_BAD_INPUT, "%s", err);
        /* Validation: the same global batches as one process with batch B x dp would take. */
        size_t val_windows = shard_windows(&val, T);
        val_B = (int)(val_windows / (size_t)dp < (size_t)B ? val_windows / (size_t)dp : (size_t)B);
        if (val_B < 1)
            fail_set(&f, EXIT_BAD_INPUT, "validation data %s (%zu tokens) is too short for context_len=%d on %d ranks",
                     c->val_data, val.n_tokens, T, dp);
    }
    comm_exit_if_failed(&world, &f);

    if (ops_init(c->device, c->threads, err, sizeof err)) fail_set(&f, EXIT_BAD_INPUT, "%s", err);
    comm_exit_if_failed(&world, &f);
    OpsPrecision prec = precision_of(c);
    if (ops_set_precision(prec, err, sizeof err)) fail_set(&f, EXIT_BAD_INPUT, "%s", err);
    comm_exit_if_failed(&world, &f);
    MemEstimate est;
    size_t data_bytes = (train.n_tokens + val.n_tokens) * 2, dev_free = 0;
    /* the all-to-all buffer counts only where the copy engines will take it: one machine, NCCL 2.28+ */
    comm_set_copy_engines(c->copy_engines);
    EstimateInput ein = estimate_input_of(c, world.size, mesh.shard_size, &oc);
    ein.data_bytes = data_bytes;
    ein.ddp_copy_engines = gpu && kind == PAR_DDP && dp > 1 && comm_copy_engines_possible(&mesh.dp);
    int tp_ce = tensor_parallel_ce_possible(&mesh);  /* (MESHTRAIN_TP_CE=1 on GPUs) */
    ein.tp_copy_engines = tp_ce;
    ein.pp_copy_engines = pp_ce && PP > 1;  /* (counted where asked: the links decide at step_init) */
    ein.tp_fused = gpu && fused_mode;       /* (likewise) */
    estimate_memory(&ein, &est);
    /* a pipeline stage: its units, and the micro-batches its schedule keeps in flight */
    if (PP > 1) estimate_stage(&est, &ein, mine, &sc, BM);
    if (gpu && ops_device_memory(&dev_free, NULL)) dev_free = 0;
    /* Ranks on one machine share its memory: each host's need is its ranks' sum (the host's
     * offloaded state always; a cpu rank's whole estimate, when no max_memory_gb caps it per
     * rank). Collective: every rank asks, whatever failed above. */
    size_t host_avail = available_memory_bytes();
    int local = comm_local_size();
    double host_need = comm_local_sum(oc.offload ? (double)est.host : 0.0);
    double local_need = comm_local_sum((double)est.total);
    if (oc.offload && host_avail && host_need > (double)host_avail)
        fail_set(&f, EXIT_BAD_INPUT, "offload=%s keeps about %s in host memory on this machine (%d rank%s) but only %s "
                 "is available (shard it over more ranks or machines, or lower the model size)", c->offload,
                 fmt_bytes(b1, host_need), local, local > 1 ? "s" : "", fmt_bytes(b2, (double)host_avail));
    size_t limit = c->max_memory_gb > 0 ? (size_t)(c->max_memory_gb * 1e9) : gpu ? dev_free : host_avail;
    int per_host = !gpu && c->max_memory_gb <= 0 && local > 1;
    double need = per_host ? local_need : (double)est.total;
    if (limit && need > (double)limit) {
        char b3[32], where[96];
        if (per_host) snprintf(where, sizeof where, "per rank, %s for the %d ranks on this machine,",
                               fmt_bytes(b3, local_need), local);
        else snprintf(where, sizeof where, "per %s", gpu ? "GPU" : "rank");
        fail_set(&f, EXIT_BAD_INPUT, "this run needs about %s %s but only %s is available (%s)",
                 fmt_bytes(b1, (double)est.total), where, fmt_bytes(b2, (double)limit), estimate_remedy(&est, c));
    }

    /* Everything the run will write, checked now rather than after its last step: each
     * rank writes its own checkpoint shard beside ckpt_path; rank 0 the log and manifest. */
    int saving = strcmp(c->ckpt_path, "none") != 0;
    JsonLog log_store, *log = NULL;
    if (!f.code && saving) check_writable(c->ckpt_path, "the checkpoint (ckpt_path)", &f);
    if (!f.code && lead) {
        mkdir_p(c->out_dir);
        mkdir_parent(c->log_file);
        if (jsonlog_open(&log_store, c->log_file, resuming, err, sizeof err)) fail_set(&f, EXIT_BAD_INPUT, "%s", err);
        else log = &log_store;
    }
    comm_exit_if_failed(&world, &f);

    if (lead) {
        printf("meshtrain train  (device %s%s%s%s, %d process%s: dp=%d tp=%d pp=%d, %s%s)\n", ops_backend_name(),
               gpu ? " (" : "", ops_device_name(), gpu ? ")" : "", world.size, world.size > 1 ? "es" : "", dp,
               mesh.tp_size, mesh.pp_size, parallel_kind_name(kind),
               mesh.tp_size > 1 && c->sequence_parallel ? ", sequence parallel" : "");
        if (kind == PAR_HYBRID) printf("hybrid sharding: groups of %d ranks, %d replicas\n", mesh.shard_size,
                                       dp / mesh.shard_size);
        config_print(c, CMD_TRAIN);
        int hooks = 0;
        hooks_each(print_hook, &hooks);
        if (hooks) printf("\n");
        printf("global batch: %d sequences (batch_size %d x grad_accum_steps %d x dp %d) = %s tokens per step", G, B, K,
               dp, fmt_commas(b1, (long long)G * T));
        if (resuming && ckpt_global != G) printf("; the checkpoint's run had %d", ckpt_global);
        printf("\n");
        /* Open MPI's mpirun forwards Ctrl-C / SIGTERM to the ranks, then kills them 1 s later:
         * too soon to finish a step and save, unless told to wait */
        if (world.size > 1 && env_open_mpi() && !env_mpirun_kill_delay_set())
            printf("note: on Ctrl-C or SIGTERM mpirun kills the ranks 1 s after passing it on; "
                   "OMPI_MCA_odls_base_sigkill_timeout=600 gives them time to finish the step and save\n");
        if (oc.offload && !gpu)
            printf("note: offload=%s on device=cpu keeps the state in more of the same memory: it saves nothing "
                   "(allowed: the same code runs as on a GPU, which is how the tests check it)\n", c->offload);
        if (PP > 1) {
            printf("pipeline: %d stages, schedule %s", PP, c->pipeline_schedule);
            if (V > 1) printf(" over %d virtual stages per rank", V);
            if (sched == SCHED_INTERLEAVED && sc.split_backward) printf(" (backward split: weight passes fill the bubble)");
            printf(", %d micro-batches of %d sequences per data-parallel rank;", M, BM);
            for (int i = 0; i < PP; i++) {
                Stage rs[SCHED_MAX_CHUNKS];
                char desc[512];
                pipeline_rank_stages(stages, PP, V, i, rs);
                pipeline_describe(&mc, rs, V, desc, sizeof desc);
                printf(" stage %d: %s%s", i, desc, i + 1 < PP ? ";" : "\n");
            }
            /* the bubble the schedule leaves, for one stage's time per micro-batch in the steady state */
            if (sched == SCHED_ZB1)  /* ZB-H1: (p-1)(F+B-W) idle of m(F+B+W), with F = B = W */
                printf("pipeline bubble: %.1f%% of the step predicted ((p-1)/(3m+p-1), ZB-H1 with equal F, B, W)\n",
                       100.0 * (PP - 1) / (3.0 * M + PP - 1));
            else
                printf("pipeline bubble: %.1f%% of the step predicted ((p-1)%s/(m+(p-1)%s))\n",
                       100.0 * (1.0 - (double)M / (M + (double)(PP - 1) / V)), V > 1 ? "/v" : "", V > 1 ? "/v" : "");
        }
        if (!strcmp(c->lr_schedule, "cosine"))
            printf("schedule: warmup %d steps, cosine from %g to %g at step %d (lr_decay_steps)%s\n", c->warmup_steps,
                   c->lr, c->min_lr, c->lr_decay_steps, c->lr_decay_steps < c->steps ? ", then min_lr" : "");
        printf("data: %s (%s tokens, %zu global batches/epoch), %s (%s tokens)\n", c->train_data,
               fmt_commas(b1, (long long)train.n_tokens), loader.batches_per_epoch, c->val_data,
               fmt_commas(b2, (long long)val.n_tokens));
        estimate_print(&ein, dp, &est);
    }

    Model m;
    /* a pipeline stage holds its own units, and the last one a copy of a tied embedding */
    model_init_layout_tp(&m, &mc, mesh.shard_size, 0, mine, V, mesh.tp_size, mesh.tp_rank);
    /* tensor parallel: each rank holds its slices of every layer */
    tensor_parallel_attach(&m, &mesh, c->sequence_parallel, tp_ce);
    int tied_copy = mc.tie_embeddings && PP > 1 && !stage_has_embedding(&mine[0]) && holds_head;
    Parallel *par = parallel_create(kind, &m, &mesh, c->overlap, &oc);
    parallel_set_bucket(par, (size_t)(c->bucket_mb * 1e6));
    if (lead && kind == PAR_DDP && gpu && dp > 1)
        printf("gradient all-reduce: %s\n", comm_copy_engines_active(&mesh.dp)
                   ? "copy engines (NCCL all-to-all, sum kernel, all-gather; copy_engines=true)"
                   : "NCCL all-reduce kernels");
    parallel_set_stages(par, &mesh.pp, !tied_copy);
    /* a tied embedding's two copies (the first and the last stage) sum their gradients */
    Comm tie = {0};
    int tie_member = mc.tie_embeddings && PP > 1 && (stage_has_embedding(&mine[0]) || tied_copy);
    if (PP > 1 && mc.tie_embeddings)
        comm_split(&world, tie_member ? mesh.dp_rank * mesh.tp_size + mesh.tp_rank : world.size + world.rank,
                   mesh.pp_rank, "tie", &tie);
    Acts a;
    acts_alloc_stage(&a, &m, &mine[0], BM, T, train_acts_mode(c) | (sc.head_split ? ACTS_HEAD_SPLIT : 0));
    int tp_fused = tensor_parallel_fused_open(&m, &mesh, a.N);  /* (where fused_mode is not 0) */
    if (lead && mesh.tp_size > 1 && (gpu || fused_mode))
        printf("tensor parallel sums: %s (MESHTRAIN_TP_FUSED=%d)\n",
               !fused_mode ? "collectives"
               : !tp_fused ? "collectives (fused asked, but the GPUs cannot map each other's memory here)"
               : !gpu ? "fused into the products (the other ranks' rows as MPI messages)"
               : fused_mode == 1 ? "fused into the products (each product writes the other ranks' rows into their memory, "
                                   "CUDA IPC)"
               : fused_mode == 2 ? "fused into the products (the other ranks' rows by copy engine into their memory, "
                                   "CUDA IPC)"
               : fused_mode == 3 ? "fused into the products (whole products, then the other ranks' rows by copy engine "
                                   "into their memory, CUDA IPC)"
                                 : "fused into the products (in groups of two blocks of rows, then the other ranks' rows "
                                   "by copy engine into their memory, CUDA IPC)", fused_mode);
    if (lead && mesh.tp_size > 1 && m.sp && model_tp_keep_gathered())
        printf("tensor parallel: each layer's gathered norm outputs kept for the backward's weight gradients "
               "(MESHTRAIN_TP_KEEP_GATHERED=1)\n");
    if (lead && tp_fused && tensor_parallel_whole_cols() && fused_mode != 3)
        printf("tensor parallel: the products after a gather with at most %d output columns run once on all rows "
               "(MESHTRAIN_TP_WHOLE_COLS)\n", tensor_parallel_whole_cols());
    if (lead && tp_fused && gpu)
        printf("tensor parallel gathers: %s\n", tensor_parallel_gathers_direct()
                   ? "each rank's rows by copy engine straight into the others' buffers, one peer after another"
                   : "by copy engine into slots, then into place");
    if (lead && mesh.tp_size > 1) {
        int chunks = model_tp_chunks(&m, a.N);
        int groups = model_tp_groups(&m, a.N);
        printf("tensor parallel: each collective in %d chunk%s of %zu rows (MESHTRAIN_TP_CHUNKS=%d)\n", chunks,
               chunks > 1 ? "s" : "", a.N / (size_t)chunks, m.tp_chunks);
        if (groups > 1)
            printf("tensor parallel: the forward in %d groups of %zu rows, each group's all-reduces beside the next "
                   "group's products (MESHTRAIN_TP_OVERLAP=%d)\n", groups, a.N / (size_t)groups, m.tp_groups);
        if (model_tp_halves(&m, a.N))
            printf("tensor parallel: each layer in two halves of rows, interleaved: one half's sums and gathers "
                   "travel while the other half's products run (MESHTRAIN_TP_HALVES=1)\n");
    }
    /* which path the collectives take: on GPUs, and wherever MESHTRAIN_TP_CE=1 was asked */
    if (lead && mesh.tp_size > 1 && (gpu || tensor_parallel_ce_asked()))
        printf("tensor parallel collectives: %s\n",
               tensor_parallel_on_copy_engines(&mesh) ? "copy engines (MESHTRAIN_TP_CE=1: activations in NCCL windows; all-to-all, sum kernel, "
                       "all-gather)"
               : !gpu ? "MPI (MESHTRAIN_TP_CE=1 takes GPUs)"
               : tensor_parallel_ce_asked() ? "NCCL kernels (MESHTRAIN_TP_CE=1, but the copy engines cannot take "
                                              "them here: one machine, NCCL 2.28+, copy_engines=true)"
                                            : "NCCL kernels (MESHTRAIN_TP_CE=1 puts them on the copy engines)");
    int start = 0;
    if (resuming) {
        if (train_state_load(c->resume, &resume_h, par, &m, err, sizeof err)) fail_set(&f, EXIT_BAD_INPUT, "%s", err);
        LoaderState ls = {resume_h.loader_epoch, resume_h.loader_window};
        if (!f.code && loader_set_state(&loader, ls, err, sizeof err))
            fail_set(&f, EXIT_BAD_INPUT, "%s: %s", c->resume, err);
        comm_exit_if_failed(&world, &f);
        parallel_params_changed(par);
        parallel_set_adam_steps(par, resume_h.adam_step);
        start = resume_h.step;
        if (lead)
            printf("resumed from %s at step %d (saved by %d rank%s)\n", c->resume, start, resume_h.world,
                   resume_h.world > 1 ? "s" : "");
    } else {
        parallel_init_weights(par, (uint64_t)c->seed);
    }

    /* The disk space the run will write (each rank's checkpoint shard, rank 0's manifest and
     * log), checked now rather than found short after the last step. A save keeps the
     * previous checkpoint until the new one is whole, so the new one needs its full size. */
    {
        double log_bytes = lead ? 4096.0 + 320.0 * (c->steps - start) : 0;  /* a step's line is about 250 bytes */
        double ckpt_bytes = saving ? (double)train_state_save_bytes(par, &m, tied_copy) +
                                         (lead ? (double)ckpt_manifest_bytes(c->ckpt_path, world.size) : 0) : 0;
        DiskNeed needs[2] = {{c->ckpt_path, "the checkpoint", ckpt_bytes}, {c->log_file, "the log", log_bytes}};
        check_disk_space(&world, needs, 2, &f);
    }
    if (!f.code && log && log_header(log, c, start, resuming, world.size))
        fail_set(&f, EXIT_BAD_INPUT, "cannot write the log file %s (log_file): %s", c->log_file, jsonlog_error(log));
    comm_exit_if_failed(&world, &f);
    if (lead && resuming && oc.cosine && oc.min_lr == 0 && start >= oc.decay_steps)
        printf("note: step %d is past the schedule's end (lr_decay_steps=%d): the cosine has reached min_lr=0, so the "
               "steps to %d train at learning rate 0; give lr_decay_steps= (a longer cosine) or min_lr=\n", start,
               oc.decay_steps, c->steps);

    comm_barrier(&world);  /* the checkpoint folder exists before any rank writes to it */

    CkptHeader h = {0};
    h.vocab_size = mc.vocab_size; h.embed_dim = mc.embed_dim; h.n_heads = mc.n_heads; h.n_layers = mc.n_layers;
    h.context_len = mc.context_len; h.tie_embeddings = mc.tie_embeddings;
    h.batch_size = B; h.world = world.size; h.seed = c->seed; h.has_optim = 1;
    h.global_batch = G;
    h.grad_accum_steps = K;
    h.lr = oc.lr; h.min_lr = oc.min_lr; h.beta1 = oc.beta1; h.beta2 = oc.beta2; h.eps = oc.eps;
    h.weight_decay = oc.weight_decay; h.grad_clip = oc.grad_clip; h.warmup_steps = oc.warmup_steps;
    h.total_steps = c->steps; h.lr_decay_steps = oc.decay_steps; h.cosine = oc.cosine;
    h.optimizer = oc.kind; h.af_beta1 = oc.af_beta1; h.af_clip = oc.af_clip; h.af_decay = oc.af_decay;
    h.af_flags = oc.af_relative_step | oc.af_scale_parameter << 1;
    h.val_every = c->val_every; h.val_batches = c->val_batches;

    /* test hooks: poison one step's training loss, or its validation loss */
    int nan_step = (int)hook_int(HOOK_FAULT_NAN_STEP, -1), nan_val_step = (int)hook_int(HOOK_FAULT_NAN_VAL_STEP, -1);
    /* ... or send rank 0 a SIGTERM as that step's validation begins (a signal mid-validation) */
    int term_val_step = (int)hook_int(HOOK_FAULT_TERM_VAL_STEP, -1);
    Progress pr = {lead && c->progress && isatty(2), now_seconds(), start, c->steps};
    double tokens_per_step = (double)G * T, flops_per_step = est.flops_per_token * tokens_per_step;
    int warm = start + 1;  /* the first step of a run warms caches and threads: not timed */
    double t_timed = 0, comm_timed = 0, val_loss = NAN;
    /* offload: the update thread's time and the forward's wait for it, totals (upd0, wait0: at
     * the last step's end); the update of step s runs beside step s + 1, and is counted there */
    double upd0 = 0, uwait0 = 0, upd_timed = 0, uwait_timed = 0;
    int timed_steps = 0;
    float loss = 0;
    Step st;
    StepPipeline pipe = {&mesh.pp, tie_member ? &tie : NULL, sched, stage_cost, c->zb1_max_in_flight, pp_ce};
    if (step_init(&st, &m, mine, V, par, &loader, &a, M, PP > 1 ? &pipe : NULL, err, sizeof err))
        die(EXIT_BAD_INPUT, "%s", err);
    if (PP > 1) {  /* the path the links that carry messages took, over every rank */
        int took[2] = {0, 0};  /* some link on NCCL (or MPI); some on the copy engines */
        for (int i = 0; i < st.n_links; i++) {
            int k = comm_p2p_on_copy_engines(st.link_order[i]);
            if (k >= 0) took[k] = 1;
        }
        comm_allreduce_max_int(&world, took, 2);
        if (lead)
            printf("pipeline send/receive: %s\n",
                   !gpu ? "MPI (host memory)"
                   : !pp_ce ? "NCCL kernels (pp_copy_engines=false)"
                   : !took[0] ? "copy engines (CUDA IPC rings, stream memory operations; no SM)"
                   : took[1] ? "copy engines on some links, NCCL kernels on the others (a link's two GPUs must be on "
                               "one machine, with peer access)"
                             : "NCCL kernels (the copy engines cannot take them here: a link's two GPUs must be on one "
                               "machine, with peer access and 64-bit stream memory operations)");
        if (lead && took[1] && comm_p2p_skip_copies())  /* (where the copy engines carry a link: there only) */
            printf("pipeline send/receive: MESHTRAIN_PP_SKIP_COPIES=1: the messages are NOT copied (a timing "
                   "experiment: this run's results are wrong)\n");
    }
    int stopped = 0, late_signal = 0, log_failed = 0, final_log_error = 0, done = start;
    /* The losses are summed over every rank that must agree on stopping at a non-finite one:
     * the data-parallel group, or the world where pipeline stages (which give 0 but the
     * head's) or tensor-parallel ranks (each holding the same loss) are in it. */
    const Comm *loss_group = PP > 1 || mesh.tp_size > 1 ? &world : &mesh.dp;
    int loss_ranks = dp * mesh.tp_size;  /* the head's stage: every dp x tp rank of it holds the loss */
    catch_signals(lead);
    for (int step = start; step < c->steps; step++) {
        if (step == start + 1) {  /* every product of a step has met cuBLASLt by now: tune them, untimed */
            char rep[384];
            if (op_tune_matmuls(rep, sizeof rep) >= 0 && lead) {
                progress_clear(&pr);
                printf("%s\n", rep);
            }
            /* the plans are made and the matmuls tuned: the layers may be recorded */
            if (graphs) model_use_graphs(&m, 1);
        }
        double t0 = now_seconds();
        inject_fault(world.rank, step + 1);
        trace_step(step + 1);
        if (step == start + 1) ops_profile_reset();
        /* A non-finite loss still stops the run before anything is saved. */
        double lr, norm, l = step_run(&st, &oc, &norm, &lr);
        if (step + 1 == nan_step && lead) l = NAN;
        /* the mean loss of the global batch: the head's stage has it, the others give 0 */
        comm_allreduce_double(loss_group, &l, 1);
        loss = (float)(l / loss_ranks);
        if (!isfinite(loss) || !isfinite(norm)) {
            parallel_sync(par);  /* offload: no update thread left running into the exit */
            stop_non_finite(&pr, log, step + 1, !isfinite(loss) ? "loss" : "gradient norm", !isfinite(loss) ? loss : norm,
                            lead, saving ? c->ckpt_path : NULL);
        }
        /* a device runs the optimizer step asynchronously: time it, but for the units DDP
         * updates beside the next forward (ops' side queue), which count in the next step */
        ops_synchronize_main();
        trace_mark(NULL, "host: step synchronised");  /* an idle queue: the event takes the host's time */
        trace_dump(world.rank);
        double dt = now_seconds() - t0, wait = parallel_comm_wait(par), upd1, uwait1;
        parallel_offload_times(par, &upd1, &uwait1);
        double upd = upd1 - upd0, uwait = uwait1 - uwait0;
        upd0 = upd1, uwait0 = uwait1;
        if (step + 1 > warm) { t_timed += dt; comm_timed += wait; upd_timed += upd; uwait_timed += uwait; timed_steps++; }
        double tok_s = tokens_per_step / dt, gflops = flops_per_step / dt / 1e9;
        if (log) {
            jsonlog_begin(log);
            jsonlog_raw(log, "\"step\":%d", step + 1);
            jsonlog_num(log, "loss", "%.6f", loss);
            jsonlog_num(log, "lr", "%.6e", lr);
            jsonlog_num(log, "grad_norm", "%.6f", norm);
            jsonlog_num(log, "ms", "%.2f", dt * 1e3);
            jsonlog_num(log, "comm_wait_ms", "%.2f", wait * 1e3);
            jsonlog_num(log, "tokens_per_s", "%.1f", tok_s);
            jsonlog_num(log, "gflops", "%.2f", gflops);
            if (gpu) jsonlog_num(log, "mfu", "%.6f", gflops * 1e9 / (GPU_PEAK_FLOPS * world.size));
            if (oc.offload) {  /* the last step's host update, run beside this one, and the wait for it */
                jsonlog_num(log, "host_update_ms", "%.2f", upd * 1e3);
                jsonlog_num(log, "update_wait_ms", "%.2f", uwait * 1e3);
            }
            log_failed |= jsonlog_end(log) != 0;
        }
        if (lead && ((step + 1) % c->log_every == 0 || step + 1 == c->steps || step == start)) {
            progress_clear(&pr);
            printf("step %5d/%d | loss %.4f | lr %.2e | grad_norm %7.4f | %7.1f ms | %8.0f tok/s | ", step + 1, c->steps,
                   loss, lr, norm, dt * 1e3, tok_s);
            if (gpu) printf("%6.2f TFLOP/s | MFU %5.2f%%\n", gflops / 1e3, 100 * gflops * 1e9 / (GPU_PEAK_FLOPS * world.size));
            else printf("%6.1f GFLOP/s\n", gflops);
            fflush(stdout);
        }
        int last = step + 1 == c->steps;
        if ((c->val_every && (step + 1) % c->val_every == 0) || last) {
            if (step + 1 == term_val_step && lead) raise(SIGTERM);
            Acts va;  /* a short validation shard: a smaller batch, in the training buffers */
            acts_view(&va, &a, &m, PP > 1 ? BM : val_B);
            val_loss = step_eval(&st, &va, &val, PP > 1 ? c->val_batches * c->micro_batches : c->val_batches,
                                 mesh.dp_rank, dp);
            if (step + 1 == nan_val_step && lead) val_loss = NAN;
            comm_allreduce_double(loss_group, &val_loss, 1);
            val_loss /= loss_ranks;
            if (!isfinite(val_loss))
                stop_non_finite(&pr, log, step + 1, "validation loss", val_loss, lead, saving ? c->ckpt_path : NULL);
            if (lead) {
                progress_clear(&pr);
                printf("step %5d/%d | val_loss %.4f\n", step + 1, c->steps, val_loss);
                jsonlog_begin(log);
                jsonlog_raw(log, "\"step\":%d", step + 1);
                jsonlog_num(log, "val_loss", "%.6f", val_loss);
                log_failed |= jsonlog_end(log) != 0;
            }
        }
        /* a signal on any rank, or a log rank 0 could not write: every rank ends after this
         * step, with a checkpoint. After the last step a signal changes nothing: the run is
         * complete (its checkpoint is saved below as at any end). */
        StopReason why = stop_agreed(&world, log_failed);
        done = step + 1;
        if (why.signal && last) late_signal = why.signal;
        else stopped = why.signal;
        if (saving && ((c->ckpt_every && (step + 1) % c->ckpt_every == 0) || last || why.signal || why.log_failed)) {
            LoaderState ls = loader_get_state(&loader);
            h.step = step + 1; h.adam_step = parallel_adam_steps(par);
            h.loader_epoch = ls.epoch; h.loader_window = ls.window;
            h.last_loss = loss;
            parallel_sync(par);  /* offload: every unit's update is in */
            /* every rank gets the same answer: one of them says it */
            if (train_state_save(c->ckpt_path, &h, &world, par, &m, tied_copy, err, sizeof err)) {
                progress_clear(&pr);
                if (lead && why.log_failed)
                    fprintf(stderr, "meshtrain: step %d: cannot write the log file %s: %s; nor the checkpoint: %s (the "
                            "last checkpoint, if any, is intact)\n", step + 1, c->log_file, jsonlog_error(log), err);
                else if (lead) fprintf(stderr, "meshtrain: step %d: %s\n", step + 1, err);
                comm_world_finalize();
                exit(EXIT_RUN_FAILURE);
            }
        }
        if (why.log_failed) {
            progress_clear(&pr);
            if (lead && saving)
                fprintf(stderr, "meshtrain: step %d: cannot write the log file %s: %s; stopped here with a checkpoint "
                        "(continue with resume=%s once the log can be written)\n", step + 1, c->log_file,
                        jsonlog_error(log), c->ckpt_path);
            else if (lead)
                fprintf(stderr, "meshtrain: step %d: cannot write the log file %s: %s; stopped here (ckpt_path=none: no "
                        "checkpoint)\n", step + 1, c->log_file, jsonlog_error(log));
            comm_world_finalize();
            exit(EXIT_RUN_FAILURE);
        }
        if (stopped) break;
        progress_draw(&pr, step + 1, loss, tok_s);
    }
    progress_clear(&pr);
    if (stopped && lead) {
        const char *name = stopped == SIGINT ? "SIGINT" : stopped == SIGTERM ? "SIGTERM" : "a signal";
        jsonlog_begin(log);
        jsonlog_raw(log, "\"step\":%d", done);
        jsonlog_str(log, "stopped", name);
        (void)jsonlog_end(log);  /* a failure is reported with the final line's */
        if (saving) printf("stopped by %s after step %d of %d: checkpoint saved; continue with resume=%s\n", name, done,
                           c->steps, c->ckpt_path);
        else printf("stopped by %s after step %d of %d (ckpt_path=none: no checkpoint)\n", name, done, c->steps);
    }
    if (late_signal && lead)
        printf("%s received after the last step: the run is complete\n",
               late_signal == SIGINT ? "SIGINT" : late_signal == SIGTERM ? "SIGTERM" : "a signal");
    double tok_s = timed_steps ? tokens_per_step * timed_steps / t_timed : 0;
    double rss_max, rss_min;
    world_max_min(&world, (double)max_rss_bytes(), &rss_max, &rss_min);
    /* pipeline: every stage's peak (its largest rank) beside its own estimate */
    double *stage_mem = NULL;
    /* GPU: the high-water mark of the bytes op_alloc held (comparable to the estimate), and
     * of the card's used memory seen at each allocation (the CUDA context included). */
    size_t gpu_alloc = 0, gpu_used = 0;
    if (gpu) ops_device_peak(&gpu_alloc, &gpu_used);
    if (PP > 1) {
        stage_mem = xcalloc(2 * (size_t)world.size, sizeof(double));
        stage_mem[2 * world.rank] = gpu ? (double)gpu_alloc : (double)max_rss_bytes();
        stage_mem[2 * world.rank + 1] = (double)est.total;
        comm_allreduce_double(&world, stage_mem, 2 * (size_t)world.size);
    }
    if (lead) {
        double flops = tok_s * est.flops_per_token;
        jsonlog_begin(log);
        jsonlog_raw(log, "\"done\":true,\"steps\":%d,\"world\":%d", done - start, world.size);
        jsonlog_str(log, "strategy", parallel_kind_name(kind));
        jsonlog_num(log, "tokens_per_s", "%.1f", tok_s);
        jsonlog_num(log, "gflops", "%.2f", flops / 1e9);
        jsonlog_num(log, "comm_wait_fraction", "%.4f", t_timed > 0 ? comm_timed / t_timed : 0.0);
        jsonlog_raw(log, ",\"max_rss_bytes\":%.0f,\"min_rss_bytes\":%.0f,\"estimate_bytes\":%zu", rss_max, rss_min,
                    est.total);
        if (oc.offload) {
            jsonlog_raw(log, ",\"host_estimate_bytes\":%zu", est.host);
            jsonlog_num(log, "host_update_ms", "%.2f", timed_steps ? upd_timed / timed_steps * 1e3 : 0.0);
            jsonlog_num(log, "update_wait_ms", "%.2f", timed_steps ? uwait_timed / timed_steps * 1e3 : 0.0);
        }
        jsonlog_num(log, "loss", "%.6f", loss);
        jsonlog_num(log, "val_loss", "%.6f", val_loss);
        if (gpu) {
            jsonlog_str(log, "device", ops_device_name());
            jsonlog_raw(log, ",\"mfu\":%.6f,\"gpu_peak_alloc_bytes\":%zu,\"gpu_peak_used_bytes\":%zu",
                        flops / (GPU_PEAK_FLOPS * world.size), gpu_alloc, gpu_used);
        }
        if (jsonlog_end(log)) final_log_error = 1;
        char b3[32], b4[32], b5[32], vbuf[32];
        if (isfinite(val_loss)) snprintf(vbuf, sizeof vbuf, "%.4f", val_loss);
        else snprintf(vbuf, sizeof vbuf, "none (stopped first)");
        if (gpu)
            printf("done: %d steps | %.0f tokens/s (%.2f TFLOP/s, MFU %.2f%% of %.0f TFLOP/s per GPU, first step excluded) | "
                   "peak GPU memory %s allocated (estimate %s), %s used on the card | host max RSS %s%s%s%s | final "
                   "loss %.4f | val_loss %s\n", done - start, tok_s, flops / 1e12,
                   100 * flops / (GPU_PEAK_FLOPS * world.size), GPU_PEAK_FLOPS / 1e12, fmt_bytes(b1, (double)gpu_alloc),
                   fmt_bytes(b2, (double)est.total), fmt_bytes(b3, (double)gpu_used), fmt_bytes(b4, rss_max),
                   oc.offload ? " (offloaded state estimate " : "", oc.offload ? fmt_bytes(b5, (double)est.host) : "",
                   oc.offload ? ")" : "", loss, vbuf);
        else
            printf("done: %d steps | %.0f tokens/s (%.1f GFLOP/s, first step excluded) | peak memory per rank %s max, "
                   "%s min (max RSS; estimate %s) | final loss %.4f | val_loss %s\n", done - start, tok_s,
                   flops / 1e9, fmt_bytes(b1, rss_max), fmt_bytes(b2, rss_min), fmt_bytes(b3, (double)est.total), loss,
                   vbuf);
        if (oc.offload && timed_steps)
            printf("offload: the host's update took %.1f ms a step on %s; the forward waited %.1f ms a step for it "
                   "(%.1f%% of the step)\n", upd_timed / timed_steps * 1e3,
                   parallel_offload_lean(kind, &oc) && prec == OPS_MIXED ? "bf16 gradients" : "fp32 gradients",
                   uwait_timed / timed_steps * 1e3, t_timed > 0 ? 100 * uwait_timed / t_timed : 0.0);
        if (world.size > 1 || comm_timed > 0)
            printf("communication: waited on collectives with no compute left to run %.1f%% of the step "
                   "(overlap=%s)\n", t_timed > 0 ? 100 * comm_timed / t_timed : 0.0, c->overlap ? "true" : "false");
        if (tp_fused)
            printf("tensor parallel: %llu sums fused into the products\n", tensor_parallel_fused_count());
        if (m.graphs) {
            long rep, rec, eager;
            layer_graphs_counts(m.graphs, &rep, &rec, &eager);
            printf("layer graphs: %ld recorded, %ld replayed, %ld layer calls op by op (MESHTRAIN_GRAPHS=0: every "
                   "layer op by op)\n", rec, rep, eager);
        }
        for (int s = 0; s < PP && stage_mem; s++) {
            double peak = 0, e = 0;
            for (int r = 0; r < world.size; r++)  /* world rank r is on stage r / (tp x dp) */
                if (r / (mesh.tp_size * dp) == s && stage_mem[2 * r] > peak) peak = stage_mem[2 * r], e = stage_mem[2 * r + 1];
            printf("pipeline stage %d: peak memory %s (%s of its ranks), estimate %s\n", s, fmt_bytes(b1, peak),
                   gpu ? "GPU allocator high-water mark" : "max RSS",
                   fmt_bytes(b2, e));
        }
        printf("checkpoint: %s\n", saving ? c->ckpt_path : "none (ckpt_path=none)");
        fflush(stdout);
        if (final_log_error)
            fprintf(stderr, "meshtrain: cannot write the log file %s: %s (the run finished%s)\n", c->log_file,
                    jsonlog_error(log), saving ? "; its checkpoint is saved" : "");
        jsonlog_close(log);
    }
    step_free(&st);
    tensor_parallel_fused_close();
    parallel_free(par);  /* first: it waits for collectives still in flight into the buffers */
    acts_free(&a);
    model_free(&m);
    loader_free(&loader);
    shard_close(&train);
    shard_close(&val);
    free(stage_mem);
    comm_free(&tie);
    free(stages);
    schedule_free(&sc);
    free(stage_cost);
    mesh_free(&mesh);
    comm_free(&world);
    comm_world_finalize();
    return stopped ? 128 + stopped : final_log_error ? EXIT_RUN_FAILURE : 0;
}
