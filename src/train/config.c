#include "config.h"
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "model.h"
#include "ops.h"
#include "run.h"
#include "util.h"

/* T_BYTES and T_RATE: a double with a unit ("80GB", "1TiB"; a rate "450GB/s") */
typedef enum { T_INT, T_FLOAT, T_BOOL, T_STR, T_ENUM, T_BYTES, T_RATE } KeyType;

typedef struct {
    const char *name;
    KeyType type;
    size_t off, size;     /* where it lives in Config; size for strings */
    const char *def;      /* default, as text */
    double lo, hi;        /* inclusive range for numbers */
    const char *choices;  /* "a|b|c" for T_ENUM */
    int cmds;             /* CMD_ bits that accept it */
    const char *help;
} Key;

#define TR CMD_TRAIN
#define MODEL_CMDS (CMD_TRAIN | CMD_ESTIMATE)
/* the keys that say what the model is: plan and calibrate take them too */
#define SHAPE_CMDS (MODEL_CMDS | CMD_PLAN | CMD_CALIBRATE)
#define I(n, d, lo, hi, cmds, h) {#n, T_INT, offsetof(Config, n), 0, d, lo, hi, NULL, cmds, h}
#define F(n, d, lo, hi, cmds, h) {#n, T_FLOAT, offsetof(Config, n), 0, d, lo, hi, NULL, cmds, h}
#define B(n, d, cmds, h) {#n, T_BOOL, offsetof(Config, n), 0, d, 0, 1, NULL, cmds, h}
#define S(n, d, cmds, h) {#n, T_STR, offsetof(Config, n), sizeof(((Config *)0)->n), d, 0, 0, NULL, cmds, h}
#define E(n, d, ch, cmds, h) {#n, T_ENUM, offsetof(Config, n), sizeof(((Config *)0)->n), d, 0, 0, ch, cmds, h}
#define Z(n, d, cmds, h) {#n, T_BYTES, offsetof(Config, n), 0, d, 0, 1e21, NULL, cmds, h}
#define R(n, d, cmds, h) {#n, T_RATE, offsetof(Config, n), 0, d, 0, 1e18, NULL, cmds, h}

static const Key KEYS[] = {
    I(vocab_size, "50257", 2, 65536, SHAPE_CMDS, "vocabulary size (50257 = GPT-2; smaller only for tests)"),
    I(embed_dim, "1024", 2, 65536, SHAPE_CMDS, "model width E"),
    I(n_heads, "8", 1, 4096, SHAPE_CMDS, "attention heads (must divide embed_dim; head_dim must be even, and at most 256 with device=cuda)"),
    I(n_layers, "16", 1, 4096, SHAPE_CMDS, "transformer layers"),
    I(context_len, "256", 1, 1 << 20, SHAPE_CMDS | CMD_EVAL,
      "sequence length T of a training window (eval: the checkpoint's unless given)"),
    B(tie_embeddings, "false", SHAPE_CMDS, "share tok_embed and lm_head"),
    I(moe_experts, "0", 0, 4096, SHAPE_CMDS,
      "mixture of experts: routed experts of each MoE layer (0 = every layer's FFN dense; see README)"),
    I(moe_top_k, "2", 1, 16, SHAPE_CMDS, "MoE: experts each token is routed to"),
    I(moe_expert_dim, "0", 0, 1 << 20, SHAPE_CMDS,
      "MoE: each expert's SwiGLU width (0 = 1.5 x embed_dim / moe_top_k, the dense FFN's width among the top k)"),
    I(moe_shared_experts, "0", 0, 64, SHAPE_CMDS,
      "MoE: always-on experts of moe_expert_dim each, beside the routed ones (one SwiGLU FFN of their summed width)"),
    I(moe_every, "1", 1, 4096, SHAPE_CMDS,
      "MoE: every n-th layer is a MoE layer (layers n-1, 2n-1, ...), the others keep the dense FFN"),
    E(moe_router, "softmax", "softmax|sigmoid", SHAPE_CMDS,
      "MoE: the router's scores, softmax over the experts or each expert's sigmoid (in fp32); the top k are chosen "
      "and their scores renormalised into the gates"),
    F(moe_capacity_factor, "0", 0, 1000, SHAPE_CMDS,
      "MoE: 0 = dropless; > 0: an expert takes at most ceil(factor x tokens x top_k / experts) of a rank's "
      "micro-batch, the first in token order, and the rest of its choices are dropped (the log says how many)"),
    F(moe_aux_loss, "0.01", 0, 1e3, TR,
      "MoE: weight of the load-balancing loss (Switch Transformer's: experts x sum_e f_e P_e per MoE layer, over "
      "the global micro-batch), added to the loss the gradient is of"),
    F(moe_z_loss, "0", 0, 1e3, TR,
      "MoE: weight of the router z-loss (the mean squared log-sum-exp of the router's logits, per MoE layer)"),
    F(moe_bias_balance, "0", 0, 1, TR,
      "MoE: aux-loss-free balancing (DeepSeek-V3): after each step every expert's selection bias moves this much "
      "toward its layer's mean load (0 = off; 0.001 is DeepSeek-V3's); the bias chooses experts, never weighs them"),
    I(batch_size, "128", 1, 1 << 24, MODEL_CMDS | CMD_EVAL, "sequences per data-parallel rank per step"),
    I(grad_accum_steps, "1", 1, 1 << 16, TR | CMD_ESTIMATE,
      "micro-batches of batch_size per optimizer step (gradient accumulation): the global batch is batch_size x "
      "grad_accum_steps x dp"),
    I(steps, "100", 1, INT_MAX, TR, "optimizer steps to run (total, counting resumed ones)"),
    I(seed, "1337", 0, INT_MAX, TR | CMD_SAMPLE, "seed for init, data order and sampling"),
    E(optimizer, "adamw", "adamw|adafactor", TR | CMD_ESTIMATE | CMD_PLAN,
      "adamw, or adafactor: factored second moments, no first moment unless adafactor_beta1 (see README)"),
    E(offload, "none", "none|optimizer|params", TR | CMD_ESTIMATE,
      "optimizer = fp32 master weights and optimizer state in host memory, updated on the CPU cores beside the "
      "GPU's work; params = with fsdp (full or hybrid) the parameter shards there too (see README)"),
    F(lr, "3e-4", 0, 10, TR, "peak learning rate (also Adafactor's step size, unless adafactor_relative_step)"),
    F(min_lr, "0", 0, 10, TR, "final learning rate of the cosine schedule"),
    E(lr_schedule, "constant", "constant|cosine", TR, "constant, or linear warmup then cosine decay to min_lr"),
    I(warmup_steps, "0", 0, INT_MAX, TR, "linear warmup steps"),
    I(lr_decay_steps, "0", 0, INT_MAX, TR,
      "step at which the cosine reaches min_lr, min_lr after it (0 = steps; a resumed run keeps its checkpoint's "
      "unless given)"),
    F(beta1, "0.9", 0, 0.999999, TR, "AdamW beta1"),
    F(beta2, "0.999", 0, 0.999999999, TR, "AdamW beta2"),
    F(eps, "1e-8", 0, 1, TR, "AdamW epsilon"),
    F(weight_decay, "0.01", 0, 10, TR, "decoupled weight decay (AdamW's; Adafactor's too: p -= lr wd p)"),
    F(adafactor_beta1, "0", 0, 0.999999, TR | CMD_ESTIMATE,
      "Adafactor: first-moment decay (0 = no first moment, the paper's default)"),
    F(adafactor_clip_threshold, "1", 1e-6, 1e9, TR, "Adafactor: clip the update's RMS to this (d)"),
    F(adafactor_decay_rate, "0.8", 0.01, 10, TR, "Adafactor: beta2 at step t is 1 - t^-decay_rate"),
    B(adafactor_relative_step, "false", TR,
      "Adafactor: step size min(1e-2, 1/sqrt(t)) instead of the lr schedule (with scale_parameter: the paper's)"),
    B(adafactor_scale_parameter, "false", TR, "Adafactor: multiply the step size by max(1e-3, RMS of the tensor)"),
    F(grad_clip, "0", 0, 1e9, TR, "clip the global gradient norm to this (0 = off)"),
    S(loss_scale, "auto", TR,
      "loss scaling: none; dynamic (PyTorch's GradScaler, Megatron-LM's with loss_scale_hysteresis > 1); or a "
      "fixed scale (a number > 0); auto = dynamic with precision=fp16, else none. A step whose gradient overflows "
      "is skipped (see README)"),
    F(loss_scale_init, "65536", 1e-6, 1e30, TR, "loss_scale=dynamic: the scale at the start"),
    I(loss_scale_window, "2000", 1, INT_MAX, TR,
      "loss_scale=dynamic: steps without an overflow before the scale doubles"),
    I(loss_scale_hysteresis, "1", 1, 1 << 20, TR,
      "loss_scale=dynamic: overflows since the scale last grew before it halves (1 = PyTorch's: every one; "
      "Megatron-LM's default is 2); every overflow skips its step"),
    F(loss_scale_min, "1", 1e-6, 1e30, TR, "loss_scale=dynamic: the scale never halves below this"),
    S(data_dir, "data/tinystories", TR | CMD_PREPARE | CMD_EVAL | CMD_PLAN, "folder of train.bin / val.bin (prepare writes here)"),
    S(train_data, "", TR, "training shard (default <data_dir>/train.bin)"),
    S(val_data, "", TR | CMD_EVAL, "validation shard (default <data_dir>/val.bin)"),
    S(tokenizer_dir, "data/gpt2", TR | CMD_PREPARE | CMD_TOKENIZE | CMD_SAMPLE | CMD_EXPORT,
      "folder of encoder.json and vocab.bpe"),
    S(input, "data/tinystories/TinyStories-train.head-2MiB.txt", CMD_PREPARE, "TinyStories text to prepare"),
    F(val_fraction, "0.05", 1e-6, 0.9, CMD_PREPARE, "share of stories held out for validation"),
    I(val_every, "0", 0, INT_MAX, TR, "validation loss every N steps (0 = only at the end)"),
    I(val_batches, "8", 1, INT_MAX, TR | CMD_EVAL, "batches of the validation shard per evaluation (capped by its size)"),
    I(threads, "0", 0, 4096, TR | CMD_SAMPLE | CMD_EVAL, "CPU threads (0 = all cores)"),
    I(log_every, "1", 1, INT_MAX, TR, "print a step line every N steps"),
    I(ckpt_every, "0", 0, INT_MAX, TR, "checkpoint every N steps (0 = only at the end)"),
    B(progress, "true", TR, "progress bar when stderr is a terminal"),
    S(out_dir, "runs", TR, "folder for the log and checkpoints"),
    S(log_file, "", TR, "JSON-lines log (default <out_dir>/log.jsonl)"),
    S(ckpt_path, "", TR, "checkpoint file (default <out_dir>/ckpt.bin; none = save no checkpoint)"),
    S(resume, "", TR, "checkpoint to continue from (model keys come from it)"),
    S(checkpoint, "runs/ckpt.bin", CMD_SAMPLE | CMD_EVAL | CMD_EXPORT, "checkpoint to sample from / evaluate / export"),
    E(device, "cpu", "cpu|cuda", TR | CMD_SAMPLE | CMD_EVAL | CMD_ESTIMATE | CMD_PLAN | CMD_CALIBRATE,
      "compute device (cuda: one GPU per process; several with mpirun and NCCL)"),
    E(precision, "auto", "auto|fp32|mixed|bf16|fp16", TR | CMD_ESTIMATE,
      "auto = mixed on cuda, fp32 on cpu; mixed = bf16 compute, fp32 master weights and AdamW; "
      "bf16 = bf16 weights, gradients and AdamW state; fp16 = fp16 compute with loss scaling (not built yet: "
      "refused)"),
    E(attention, "auto", "auto|cudnn|own", TR | CMD_SAMPLE | CMD_EVAL | CMD_ESTIMATE,
      "cuda, bf16: attention's kernels: auto = cuDNN's fused flash attention or ours, whichever was faster for "
      "the shape (see README); cudnn = cuDNN's wherever it runs; own = never cuDNN's"),
    B(deterministic, "true", TR | CMD_ESTIMATE,
      "cuda: every op bitwise repeatable; false = faster: attention's backward may sum with atomics, and after "
      "the first step each product shape may take a faster cuBLASLt algorithm (a run's last bits then vary)"),
    E(cuda_graphs, "auto", "auto|true|false", TR,
      "cuda: from the second step each layer's forward and backward recorded once as a CUDA graph and replayed "
      "(auto = on for one process, off for several; layers split over tensor-parallel ranks run op by op)"),
    F(max_memory_gb, "0", 0, 1e9, TR | CMD_ESTIMATE,
      "refuse runs whose estimate exceeds this (0 = available RAM, or the GPU's free memory)"),
    B(activation_checkpointing, "false", TR | CMD_ESTIMATE,
      "keep only each layer's input; the backward recomputes the rest (less memory, one more forward)"),
    B(fsdp, "false", MODEL_CMDS, "fully sharded data parallel (see shard_strategy)"),
    E(shard_strategy, "full", "full|grad_op|no|hybrid", MODEL_CMDS,
      "with fsdp: full = ZeRO-3, grad_op = ZeRO-2, no = DDP, hybrid = ZeRO-3 inside shard groups"),
    I(shard_group_size, "0", 0, 1 << 20, MODEL_CMDS, "hybrid: ranks per shard group (0 = ranks per node)"),
    B(zero_opt, "false", MODEL_CMDS, "without fsdp: shard AdamW's moments over dp (ZeRO-1)"),
    E(grad_compression, "none", "none|bf16|int8|powersgd", TR,
      "the data-parallel gradient compressed, with error feedback (what compression lost is sent with the next "
      "step's): bf16, or int8 with a scale per 256 values (DDP's all-reduce, machine by machine only the hop across "
      "machines; ZeRO's and FSDP's reduce-scatter; hybrid FSDP's all-reduce across replicas), or PowerSGD's rank-r "
      "factors of each matrix (DDP) (CPU ranks; the residuals are kept in checkpoints)"),
    I(powersgd_rank, "1", 1, 1024, TR, "grad_compression=powersgd: the rank r of each matrix's factors"),
    I(powersgd_warmup, "10", 0, INT_MAX, TR,
      "grad_compression=powersgd: the first optimizer steps all-reduced uncompressed (PyTorch's start_powerSGD_iter)"),
    F(powersgd_min_compression_rate, "2", 0, 1e9, TR,
      "grad_compression=powersgd: a matrix [n, m] is compressed where n m > (n + m) r times this, else averaged whole"),
    E(dp_allreduce, "auto", "auto|flat|hierarchical", TR,
      "DDP's gradient all-reduce: flat over dp, or hierarchical (reduce-scatter inside each machine, all-reduce "
      "across machines, all-gather inside) where dp spans machines with as many ranks on each; auto = hierarchical "
      "there on CPU ranks"),
    I(tensor_parallel_size, "1", 1, 4096, MODEL_CMDS,
      "tensor parallel ranks (Megatron-LM: heads, FFN units and the vocabulary split; must divide n_heads, the FFN "
      "width, the vocabulary padded to a multiple of 64 and a MoE model's moe_expert_dim)"),
    B(sequence_parallel, "true", MODEL_CMDS,
      "with tensor_parallel_size > 1: the residual stream and the norms split along the sequence too (Megatron-LM's "
      "sequence parallel; tensor_parallel_size must divide context_len)"),
    E(tp_comm, "auto", "auto|collectives|fused", MODEL_CMDS,
      "with tensor_parallel_size > 1: how its sums and gathers travel: collectives (NCCL's or MPI's), or fused "
      "into the matrix products (one machine's GPUs: copy engines and CUDA IPC; CPU ranks: MPI messages); auto = "
      "fused on GPUs at tensor_parallel_size 2 and 4, else collectives"),
    I(expert_parallel_size, "1", 1, 4096, MODEL_CMDS,
      "MoE: data-parallel ranks that share out each MoE layer's experts (moe_experts / this each), tokens exchanged by "
      "all-to-all; must divide moe_experts and the data-parallel size"),
    I(pipeline_parallel_size, "1", 1, 4096, MODEL_CMDS,
      "pipeline stages: contiguous layers, the embedding on the first, the head on the last"),
    I(micro_batches, "1", 1, 1 << 16, TR | CMD_ESTIMATE,
      "pipeline: micro-batches each data-parallel rank's batch_size is cut into (at least pipeline_parallel_size)"),
    E(pipeline_schedule, "1f1b", "gpipe|1f1b|interleaved|zb1|2bw|pipedream", TR | CMD_ESTIMATE,
      "pipeline: gpipe = every forward, then every backward; 1f1b = one forward, one backward in turn; "
      "interleaved = 1f1b over virtual_stages chunks per rank; zb1 = zero bubble (ZB-H1: the backward split, "
      "weight gradients fill the bubble); 2bw = PipeDream-2BW: 1f1b without a flush between steps, two weight "
      "versions, each update one step stale (also on one process, as its reference); pipedream = PipeDream: the "
      "same order, an update after every micro-batch's backward, each stage keeping as many weight versions as it "
      "has micro-batches in flight (weight stashing)"),
    B(pipedream_vertical_sync, "false", TR | CMD_ESTIMATE,
      "pipedream: every stage computes a micro-batch on the version the first stage used for it (stages - 1 updates "
      "back; every stage then keeps pipeline_parallel_size versions)"),
    I(pipedream_depth, "0", 0, 4096, TR | CMD_ESTIMATE,
      "pipedream on one process (its reference): the depth of the pipeline whose arithmetic it reproduces, each "
      "unit as stale as its stage would be (the stages as pipeline_split gives them; 0 = none, no staleness)"),
    I(virtual_stages, "0", 0, 8, TR | CMD_ESTIMATE,
      "interleaved: stages (chunks of layers) per pipeline rank (0 = 2 with interleaved, else 1)"),
    S(pipeline_split, "auto", TR | CMD_ESTIMATE,
      "pipeline: layers per stage, e.g. 5,4,4,3 (a last 0, 5,6,5,0: the last stage holds the head alone); auto: the split whose simulated step (the schedule over the stages' "
      "estimated FLOPs, embedding and head counted) is shortest"),
    I(zb1_max_in_flight, "0", 0, 1 << 16, TR | CMD_ESTIMATE,
      "zb1: the most micro-batches a pipeline rank holds from a forward to its weight pass (0 = p + 3; p + 1 is "
      "ZB-H1's memory, fewer is less memory and a longer step)"),
    B(pp_copy_engines, "true", TR | CMD_ESTIMATE,
      "pipeline on one machine's GPUs: send/receive on the copy engines (CUDA IPC rings; no SM held), not NCCL's "
      "send/receive kernels"),
    B(overlap, "true", TR, "overlap gradient collectives with the backward (false: wait for each)"),
    F(bucket_mb, "100", 0, 1e6, TR,
      "DDP: all-reduce the gradients of units that finish one after another together, up to this many MB "
      "(0 = one all-reduce per unit)"),
    B(copy_engines, "true", TR | CMD_ESTIMATE,
      "DDP on one machine's GPUs: all-reduce the gradients on the copy engines (an all-to-all, a sum kernel, an "
      "all-gather; NCCL 2.28+), not NCCL's all-reduce kernels on the SMs"),
    F(comm_timeout, "600", 0, 1e9, TR, "seconds a collective may wait for a peer before the job aborts (0 = forever)"),
    F(peak_tflops, "0", 0, 1e6, TR,
      "MFU's reference: the GPU's dense bf16 peak in TFLOP/s (0 = by the card's name; a card not known prints no MFU)"),
    I(world_size, "1", 1, 1 << 20, CMD_ESTIMATE, "ranks to estimate for (train takes it from the launcher)"),
    S(prompt, "Once upon a time", CMD_SAMPLE, "text to continue"),
    I(length, "200", 1, 1 << 20, CMD_SAMPLE, "tokens to generate"),
    F(temperature, "0.8", 0, 100, CMD_SAMPLE, "sampling temperature (0 = greedy)"),
    I(top_k, "40", 0, 1 << 20, CMD_SAMPLE, "sample from the k most likely tokens (0 = all)"),
    B(decode, "false", CMD_TOKENIZE, "read ids on stdin and print the text"),
    S(log, "runs/log.jsonl", CMD_PLOT, "training log to plot (the JSON lines train writes)"),
    /* one key for every command that writes one output */
    S(out, "", CMD_EXPORT | CMD_PLOT | CMD_CALIBRATE,
      "output path: export's folder (default runs/hf), plot's SVG (default <log's folder>/log.svg), calibrate's "
      "profile (default profile.txt)"),
    /* plan: the run to lay out and the machines it may use */
    I(global_batch, "0", 0, 1 << 24, CMD_PLAN | CMD_CALIBRATE,
      "plan: sequences per optimizer step over all data-parallel ranks (batch_size x grad_accum_steps x dp); required"),
    E(cluster, "none", "none|this", CMD_PLAN | CMD_CALIBRATE,
      "plan: this = read this machine (its cores or GPUs and memory); none = the keys below describe it (they also "
      "override what this reads)"),
    I(hosts, "1", 1, 1 << 16, CMD_PLAN, "plan: machines"),
    I(devices_per_host, "0", 0, 4096, CMD_PLAN | CMD_CALIBRATE,
      "plan: GPUs per machine (device=cuda), or CPU ranks per machine (device=cpu; 0 = its cores with cluster=this); "
      "calibrate: the largest CPU rank group whose collectives it times (0 = the cores)"),
    Z(device_memory, "0", CMD_PLAN, "plan: memory of one GPU, e.g. 80GB (cluster=this: the GPU's)"),
    Z(host_memory, "0", CMD_PLAN, "plan: memory of one machine, e.g. 1TB (cluster=this: what is available)"),
    R(link_intra, "0", CMD_PLAN,
      "plan: bandwidth between the devices of one machine, e.g. 450GB/s (0 = the profile's measured collectives)"),
    R(link_inter, "0", CMD_PLAN, "plan: bandwidth between machines, e.g. 25GB/s (0 = the profile's, or 12.5GB/s)"),
    S(profile, "", CMD_PLAN,
      "plan: a profile written by calibrate (op, collective, copy and optimizer times); none = the stated defaults"),
    I(top, "5", 0, 1 << 20, CMD_PLAN, "plan: layouts to print, fastest first (0 = every one, those over memory last)"),
    I(try, "0", 0, 64, CMD_PLAN,
      "plan: run the best K layouts for try_steps steps each, print measured beside predicted, and fold the "
      "measurements into profile="),
    I(try_steps, "5", 2, 1000, CMD_PLAN, "plan: steps of each layout try= runs (the first is not timed)"),
    S(title, "", CMD_PLOT, "title of the picture (default: the log's path)"),
    S(config, "", CMD_ALL,
      "a file of key=value lines (blank lines and # comments allowed), read first: keys on the command line "
      "override it"),
};
#define N_KEYS ((int)(sizeof KEYS / sizeof KEYS[0]))
static unsigned char key_set[N_KEYS];

/* "80GB" (1000-based: KB MB GB TB), "512MiB" (1024-based: KiB MiB GiB TiB), a plain number
 * of bytes; Gbit/Mbit count bits. A rate with a unit ends in "/s". */
static int parse_size(const char *v, int rate, double *out) {
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (end == v || errno || !isfinite(x) || x < 0) return -1;
    static const struct { const char *u; double f; } UNITS[] = {
        {"", 1}, {"B", 1}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12}, {"KiB", 1024.0},
        {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}, {"Mbit", 1e6 / 8}, {"Gbit", 1e9 / 8}};
    size_t n = strlen(end);
    if (rate && n) {  /* (a bare number: bytes/s) */
        if (n < 2 || strcmp(end + n - 2, "/s")) return -1;
        n -= 2;
    }
    for (size_t i = 0; i < sizeof UNITS / sizeof UNITS[0]; i++)
        if (strlen(UNITS[i].u) == n && !strncmp(end, UNITS[i].u, n) && (rate || strstr(UNITS[i].u, "bit") == NULL)) {
            *out = x * UNITS[i].f;
            return 0;
        }
    return -1;
}

static int set_value(Config *c, const Key *k, const char *v, char *err, size_t errlen) {
    char *p = (char *)c + k->off;
    char *end;
    switch (k->type) {
    case T_INT: {
        errno = 0;
        long long x = strtoll(v, &end, 10);
        if (!*v || *end || errno) return set_err(err, errlen, "%s=%s: not an integer", k->name, v);
        if (x < k->lo || x > k->hi)
            return set_err(err, errlen, "%s=%s: out of range [%.0f, %.0f]", k->name, v, k->lo, k->hi);
        *(int *)p = (int)x;
        return 0;
    }
    case T_FLOAT: {
        errno = 0;
        double x = strtod(v, &end);
        if (!*v || *end || errno || !isfinite(x)) return set_err(err, errlen, "%s=%s: not a number", k->name, v);
        if (x < k->lo || x > k->hi) return set_err(err, errlen, "%s=%s: out of range [%g, %g]", k->name, v, k->lo, k->hi);
        *(double *)p = x;
        return 0;
    }
    case T_BYTES:
    case T_RATE: {
        double x;
        if (parse_size(v, k->type == T_RATE, &x) || x < k->lo || x > k->hi)
            return set_err(err, errlen, "%s=%s: expected %s", k->name, v,
                           k->type == T_RATE ? "a rate such as 450GB/s, 25Gbit/s or 800MiB/s"
                                             : "a size such as 80GB, 1TB or 512MiB");
        *(double *)p = x;
        return 0;
    }
    case T_BOOL:
        if (!strcmp(v, "true") || !strcmp(v, "1")) *(int *)p = 1;
        else if (!strcmp(v, "false") || !strcmp(v, "0")) *(int *)p = 0;
        else return set_err(err, errlen, "%s=%s: expected true or false", k->name, v);
        return 0;
    case T_ENUM: {
        size_t n = strlen(v);
        const char *ch = k->choices;
        int ok = 0;
        while (*ch) {
            size_t len = strcspn(ch, "|");
            if (len == n && n && !strncmp(ch, v, n)) ok = 1;
            ch += len + (ch[len] == '|');
        }
        if (!ok) return set_err(err, errlen, "%s=%s: expected one of %s", k->name, v, k->choices);
    }
    /* fall through */
    case T_STR:
        if (strlen(v) >= k->size) return set_err(err, errlen, "%s: value longer than %zu bytes", k->name, k->size - 1);
        strcpy(p, v);
        return 0;
    }
    return -1;
}

void config_defaults(Config *c) {
    memset(c, 0, sizeof *c);
    for (int i = 0; i < N_KEYS; i++)
        if (set_value(c, &KEYS[i], KEYS[i].def, NULL, 0)) die(EXIT_RUN_FAILURE, "bad default for %s", KEYS[i].name);
}

int config_was_set(const char *key) {
    for (int i = 0; i < N_KEYS; i++)
        if (!strcmp(KEYS[i].name, key)) return key_set[i];
    return 0;
}

static int default_path(char *dst, size_t n, const char *dir, const char *file, char *err, size_t errlen) {
    if (!dst[0] && snprintf(dst, n, "%s/%s", dir, file) >= (int)n)
        return set_err(err, errlen, "path %s/%s is too long", dir, file);
    return 0;
}

/* One key=value setting from `where` (NULL: the command line; else "config file F line N"). A
 * key the file set may be set again on the command line (it wins); twice from one source is
 * an error. */
static unsigned char key_from_file[N_KEYS];
static int apply(Config *c, int cmd, const char *kv, size_t klen_max, const char *where, char *err, size_t errlen) {
    char at[640] = "";
    if (where) snprintf(at, sizeof at, "%s: ", where);
    const char *eq = strchr(kv, '=');
    if (!eq || eq == kv || (size_t)(eq - kv) > klen_max)
        return set_err(err, errlen, "%s'%s': expected key=value (see 'meshtrain help')", at, kv);
    size_t klen = (size_t)(eq - kv);
    int found = -1;
    for (int i = 0; i < N_KEYS; i++)
        if (strlen(KEYS[i].name) == klen && !strncmp(KEYS[i].name, kv, klen)) found = i;
    if (found < 0) return set_err(err, errlen, "%sunknown key '%.*s' (see 'meshtrain help')", at, (int)klen, kv);
    if (!(KEYS[found].cmds & cmd))
        return set_err(err, errlen, "%skey '%s' does not apply to this subcommand", at, KEYS[found].name);
    if (where && !strcmp(KEYS[found].name, "config"))
        return set_err(err, errlen, "%sa config file cannot name another (config=)", at);
    if (key_set[found] && (where || !key_from_file[found]))
        return set_err(err, errlen, "%skey '%s' given twice", at, KEYS[found].name);
    char msg[512];
    if (set_value(c, &KEYS[found], eq + 1, msg, sizeof msg)) return set_err(err, errlen, "%s%s", at, msg);
    key_set[found] = 1;
    key_from_file[found] = where != NULL;
    return 0;
}

/* config=FILE: each line "key=value" (spaces around '=' and at the ends are dropped, and a
 * value in double quotes loses them); blank lines and lines starting with # are skipped. */
static int read_config_file(Config *c, int cmd, const char *path, char *err, size_t errlen) {
    char rerr[512];
    size_t len;
    char *text = read_file(path, &len, rerr, sizeof rerr);
    if (!text) return set_err(err, errlen, "config=%s: %s", path, rerr);
    int rc = 0, line_no = 0;
    for (char *p = text, *end = text + len; p < end && !rc;) {
        char *nl = memchr(p, '\n', (size_t)(end - p));
        char *e = nl ? nl : end;
        line_no++;
        while (p < e && (*p == ' ' || *p == '\t')) p++;
        while (e > p && (e[-1] == ' ' || e[-1] == '\t' || e[-1] == '\r')) e--;
        if (p < e && *p != '#') {
            char kv[2600], where[600];
            char *eq = memchr(p, '=', (size_t)(e - p));
            char *ke = eq ? eq : e, *vs = eq ? eq + 1 : e;
            while (ke > p && (ke[-1] == ' ' || ke[-1] == '\t')) ke--;
            while (vs < e && (*vs == ' ' || *vs == '\t')) vs++;
            if (e - vs >= 2 && *vs == '"' && e[-1] == '"') vs++, e--;
            snprintf(where, sizeof where, "config file %s line %d", path, line_no);
            if ((size_t)(ke - p) + (size_t)(e - vs) + 2 > sizeof kv) rc = set_err(err, errlen, "%s: line too long", where);
            else {
                snprintf(kv, sizeof kv, "%.*s%s%.*s", (int)(ke - p), p, eq ? "=" : "", (int)(e - vs), vs);
                rc = apply(c, cmd, kv, (size_t)(ke - p), where, err, errlen);
            }
        }
        p = nl ? nl + 1 : end;
    }
    free(text);
    return rc;
}

int config_parse(Config *c, int cmd, int argc, char **argv, char *err, size_t errlen) {
    memset(key_set, 0, sizeof key_set);
    memset(key_from_file, 0, sizeof key_from_file);
    /* the file first, wherever config= stands: the command line overrides it */
    for (int a = 0; a < argc; a++)
        if (!strncmp(argv[a], "config=", 7)) {
            if (argv[a][7] && read_config_file(c, cmd, argv[a] + 7, err, errlen)) return -1;
            break;
        }
    for (int a = 0; a < argc; a++)
        if (apply(c, cmd, argv[a], strlen(argv[a]), NULL, err, errlen)) return -1;
    if (default_path(c->train_data, sizeof c->train_data, c->data_dir, "train.bin", err, errlen) ||
        default_path(c->val_data, sizeof c->val_data, c->data_dir, "val.bin", err, errlen) ||
        default_path(c->log_file, sizeof c->log_file, c->out_dir, "log.jsonl", err, errlen) ||
        default_path(c->ckpt_path, sizeof c->ckpt_path, c->out_dir, "ckpt.bin", err, errlen))
        return -1;
    return config_validate(c, cmd, err, errlen);
}

int config_validate(const Config *c, int cmd, char *err, size_t errlen) {
    if (cmd & (CMD_TRAIN | CMD_ESTIMATE)) {
        if (c->embed_dim % c->n_heads)
            return set_err(err, errlen, "n_heads=%d does not divide embed_dim=%d", c->n_heads, c->embed_dim);
        if ((c->embed_dim / c->n_heads) % 2)
            return set_err(err, errlen, "head_dim = embed_dim/n_heads = %d is odd; RoPE needs an even head_dim",
                           c->embed_dim / c->n_heads);
        if (c->vocab_size > 65536) return set_err(err, errlen, "vocab_size=%d: shards hold uint16 tokens", c->vocab_size);
        if (!strcmp(c->device, "cuda") && c->embed_dim / c->n_heads > OPS_CUDA_MAX_HEAD_DIM)
            return set_err(err, errlen, "head_dim = embed_dim/n_heads = %d: device=cuda's attention takes heads of up "
                           "to %d (more n_heads)", c->embed_dim / c->n_heads, OPS_CUDA_MAX_HEAD_DIM);
        if (!strcmp(c->device, "cuda") && c->moe_experts > OPS_CUDA_MAX_EXPERTS)
            return set_err(err, errlen, "moe_experts=%d: device=cuda's routing takes up to %d experts", c->moe_experts,
                           OPS_CUDA_MAX_EXPERTS);
        int tp = c->tensor_parallel_size;
        ModelConfig mc = model_config_of(c);
        if (model_moe_check(&mc, err, errlen)) return -1;
        if (!c->moe_experts) {
            static const char *moe_keys[] = {"moe_top_k", "moe_expert_dim", "moe_shared_experts", "moe_every",
                                             "moe_router", "moe_capacity_factor", "moe_aux_loss", "moe_z_loss",
                                             "moe_bias_balance"};
            for (size_t i = 0; i < sizeof moe_keys / sizeof moe_keys[0]; i++)
                if (config_was_set(moe_keys[i]))
                    return set_err(err, errlen, "%s applies to a mixture of experts: give moe_experts= too", moe_keys[i]);
        }
        int ep = c->expert_parallel_size;
        if (ep > 1) {
            if (!c->moe_experts && !c->resume[0])  /* (a resume's model is its checkpoint's: checked again then) */
                return set_err(err, errlen, "expert_parallel_size=%d applies to a mixture of experts: give moe_experts= "
                               "too", ep);
            if (c->moe_experts % ep)
                return set_err(err, errlen, "expert_parallel_size=%d does not divide moe_experts=%d", ep, c->moe_experts);
            if (strcmp(c->device, "cpu"))
                return set_err(err, errlen, "expert_parallel_size=%d: expert parallel runs on CPU ranks (device=cpu) "
                               "for now; on GPUs use data or pipeline parallel", ep);
            if (c->fsdp && !strcmp(c->shard_strategy, "hybrid"))
                return set_err(err, errlen, "expert_parallel_size=%d does not combine with shard_strategy=hybrid; use "
                               "full, grad_op or no", ep);
        }
        if (c->moe_experts && c->pipeline_parallel_size > 1 && !strcmp(c->pipeline_schedule, "zb1"))
            return set_err(err, errlen, "pipeline_schedule=zb1 does not take MoE layers yet (their backward is not split "
                           "into input and weight passes); use 1f1b or interleaved");
        if (model_tp_check(&mc, tp, err, errlen)) return -1;
        if (tp > 1 && c->sequence_parallel && c->context_len % tp)
            return set_err(err, errlen, "sequence_parallel=true: tensor_parallel_size=%d does not divide context_len=%d "
                           "(or set sequence_parallel=false)", tp, c->context_len);
        if ((long long)c->batch_size * c->context_len > INT_MAX / 4)
            return set_err(err, errlen, "batch_size x context_len = %lld tokens is too many for one step",
                           (long long)c->batch_size * c->context_len);
        if (strcmp(c->precision, "auto") && strcmp(c->precision, "fp32") && !strcmp(c->device, "cpu"))
            return set_err(err, errlen, "precision=%s needs a GPU; the cpu device computes in fp32", c->precision);
        if (!strcmp(c->precision, "fp16"))
            return set_err(err, errlen, "precision=fp16: fp16 compute is not built yet (the cuda backend has no fp16 "
                           "kernels); precision=mixed computes in bf16, which needs no loss scaling");
        LossScaleConfig ls;
        if ((cmd & CMD_TRAIN) && config_loss_scale(c, &ls, err, errlen)) return -1;
        int decay = c->lr_decay_steps ? c->lr_decay_steps : c->steps;
        if (c->warmup_steps > decay && !strcmp(c->lr_schedule, "cosine"))
            return set_err(err, errlen, "warmup_steps=%d exceeds %s=%d", c->warmup_steps,
                           c->lr_decay_steps ? "lr_decay_steps" : "steps", decay);
        /* a constant schedule warms up too: a warmup longer than the run never reaches lr (a
         * cosine's horizon is lr_decay_steps, which a run may end before, to be resumed) */
        if (c->warmup_steps > c->steps && strcmp(c->lr_schedule, "cosine"))
            return set_err(err, errlen, "warmup_steps=%d exceeds steps=%d: the run would end before its warmup",
                           c->warmup_steps, c->steps);
        if (c->min_lr > c->lr) return set_err(err, errlen, "min_lr=%g exceeds lr=%g", c->min_lr, c->lr);
        /* keys of the other optimizer, where the optimizer is given (a resume takes it from
         * its checkpoint otherwise, and checks there) */
        if (config_was_set("optimizer")) {
            static const char *adamw_only[] = {"beta1", "beta2", "eps"}, *af_only[] = {
                "adafactor_beta1", "adafactor_clip_threshold", "adafactor_decay_rate", "adafactor_relative_step",
                "adafactor_scale_parameter"};
            int af = !strcmp(c->optimizer, "adafactor");
            for (int i = 0; i < (af ? 3 : 5); i++) {
                const char *k = af ? adamw_only[i] : af_only[i];
                if (config_was_set(k))
                    return set_err(err, errlen, "%s applies to optimizer=%s, not optimizer=%s%s", k,
                                   af ? "adamw" : "adafactor", c->optimizer,
                                   af && !strcmp(k, "beta1") ? " (Adafactor's first moment: adafactor_beta1)" : "");
            }
        }
        if (strcmp(c->offload, "none")) {
            if (!strcmp(c->precision, "bf16"))
                return set_err(err, errlen, "offload=%s keeps fp32 master weights, which precision=bf16 has none of; "
                               "use precision=mixed", c->offload);
            if (!strcmp(c->offload, "params") &&
                !(c->fsdp && (!strcmp(c->shard_strategy, "full") || !strcmp(c->shard_strategy, "hybrid"))))
                return set_err(err, errlen, "offload=params needs fsdp=true with shard_strategy=full or hybrid (the "
                               "others keep whole parameters on the device); use offload=optimizer");
        }
        if ((cmd & CMD_TRAIN) && c->ckpt_every && !strcmp(c->ckpt_path, "none"))
            return set_err(err, errlen, "ckpt_every=%d saves nothing with ckpt_path=none", c->ckpt_every);
        if (c->fsdp && c->zero_opt)
            return set_err(err, errlen, "zero_opt=true applies without fsdp; with fsdp=true choose shard_strategy");
        if (config_was_set("shard_strategy") && !c->fsdp)
            return set_err(err, errlen, "shard_strategy=%s needs fsdp=true", c->shard_strategy);
        if (!strcmp(c->dp_allreduce, "hierarchical") && (c->fsdp || c->zero_opt || c->expert_parallel_size > 1 ||
                                                         strcmp(c->device, "cpu")))
            return set_err(err, errlen, "dp_allreduce=hierarchical applies to DDP (fsdp and zero_opt off, no expert "
                           "parallel) on CPU ranks (device=cpu)");
        if (strcmp(c->grad_compression, "powersgd"))
            for (int i = 0; i < 3; i++) {
                static const char *k[] = {"powersgd_rank", "powersgd_warmup", "powersgd_min_compression_rate"};
                if (config_was_set(k[i])) return set_err(err, errlen, "%s applies to grad_compression=powersgd", k[i]);
            }
        if (strcmp(c->grad_compression, "none")) {
            if (c->expert_parallel_size > 1 || strcmp(c->device, "cpu"))
                return set_err(err, errlen, "grad_compression=%s runs on CPU ranks (device=cpu), without expert "
                               "parallel", c->grad_compression);
            if (!strcmp(c->grad_compression, "powersgd") && (c->fsdp || c->zero_opt))
                return set_err(err, errlen, "grad_compression=powersgd compresses an all-reduce: DDP only (fsdp and "
                               "zero_opt off); bf16 and int8 take every strategy");
        }
        if (config_was_set("shard_group_size") && !(c->fsdp && !strcmp(c->shard_strategy, "hybrid")))
            return set_err(err, errlen, "shard_group_size applies to fsdp=true shard_strategy=hybrid only");
        int pp = c->pipeline_parallel_size;
        {
            int bw = !strcmp(c->pipeline_schedule, "2bw"), pd = !strcmp(c->pipeline_schedule, "pipedream");
            if (pp == 1 && (c->micro_batches > 1 || (config_was_set("pipeline_schedule") && !bw && !pd) ||
                            (config_was_set("pipeline_split") && !(pd && c->pipedream_depth > 1)) ||
                            config_was_set("virtual_stages")))
                return set_err(err, errlen, "micro_batches, pipeline_schedule (but 2bw and pipedream), virtual_stages and "
                               "pipeline_split (but with pipedream_depth) apply with pipeline_parallel_size > 1 (for "
                               "accumulation on one stage: grad_accum_steps)");
            if ((config_was_set("pipedream_vertical_sync") || config_was_set("pipedream_depth")) && !pd)
                return set_err(err, errlen, "pipedream_vertical_sync and pipedream_depth apply with pipeline_schedule=pipedream");
            if (pd && pp > 1 && c->pipedream_depth && c->pipedream_depth != pp)
                return set_err(err, errlen, "pipedream_depth=%d: on a pipeline it is its depth, pipeline_parallel_size=%d "
                               "(or 0)", c->pipedream_depth, pp);
            if (pd && pp == 1 && c->pipedream_depth > c->n_layers + 1)
                return set_err(err, errlen, "pipedream_depth=%d exceeds n_layers=%d + 1: every stage but the last needs a "
                               "layer", c->pipedream_depth, c->n_layers);
            /* each stage updates on its own after each micro-batch: a norm over every stage, a
             * tied copy's sum, a loss scaler's common decision or a step of several rounds
             * would each make every update wait for every stage */
            if (pd && (c->grad_clip > 0 || c->tie_embeddings || c->grad_accum_steps > 1 ||
                       (strcmp(c->loss_scale, "none") && strcmp(c->loss_scale, "auto")) || !strcmp(c->precision, "fp16")))
                return set_err(err, errlen, "pipeline_schedule=pipedream updates each stage on its own after every "
                               "micro-batch: it runs without grad_clip, tie_embeddings, grad_accum_steps > 1 or a loss "
                               "scale (precision=fp16)");
            if (pp == 1 && config_was_set("pp_copy_engines"))
                return set_err(err, errlen, "pp_copy_engines applies with pipeline_parallel_size > 1");
            if (config_was_set("zb1_max_in_flight") && strcmp(c->pipeline_schedule, "zb1"))
                return set_err(err, errlen, "zb1_max_in_flight applies with pipeline_schedule=zb1, not "
                               "pipeline_schedule=%s", c->pipeline_schedule);
            if (pp > 1 && c->micro_batches < pp)
                return set_err(err, errlen, "micro_batches=%d is fewer than pipeline_parallel_size=%d: the pipeline "
                               "would never be full", c->micro_batches, pp);
            if (pp > 1 && c->batch_size % c->micro_batches)
                return set_err(err, errlen, "micro_batches=%d does not divide batch_size=%d", c->micro_batches,
                               c->batch_size);
            int il = !strcmp(c->pipeline_schedule, "interleaved");
            if (c->virtual_stages > 1 && !il)
                return set_err(err, errlen, "virtual_stages=%d applies with pipeline_schedule=interleaved",
                               c->virtual_stages);
            if (il && c->virtual_stages == 1)
                return set_err(err, errlen, "pipeline_schedule=interleaved needs virtual_stages >= 2 (1 is 1f1b)");
            /* a version is a copy of a unit's whole compute weights: FSDP holds a unit whole only
             * between its gathers; offload's updates land unit by unit later than the copy */
            if ((bw || pd) && ((c->fsdp && (!strcmp(c->shard_strategy, "full") || !strcmp(c->shard_strategy, "hybrid"))) ||
                               strcmp(c->offload, "none") || c->moe_experts || !strcmp(c->cuda_graphs, "true")))
                return set_err(err, errlen, "pipeline_schedule=%s runs with DDP, ZeRO-1 (zero_opt) or ZeRO-2 "
                               "(shard_strategy=grad_op), not FSDP's full or hybrid sharding, offload, MoE layers or "
                               "cuda_graphs=true", c->pipeline_schedule);
            if (pp > 1 && !strcmp(c->pipeline_schedule, "zb1") && c->activation_checkpointing)
                return set_err(err, errlen, "pipeline_schedule=zb1 keeps every layer's activations for its weight "
                               "pass: it does not combine with activation_checkpointing=true");
        }
        /* the last stage may hold the head alone (pipeline_split): one stage more than layers */
        if (pp > 1 && pp > c->n_layers + 1)
            return set_err(err, errlen, "pipeline_parallel_size=%d exceeds n_layers=%d + 1: every stage but the last "
                           "needs a layer", pp, c->n_layers);
        int v = config_virtual_stages(c);
        if (v > 1 && pp * v > c->n_layers + 1)
            return set_err(err, errlen, "pipeline_parallel_size=%d x virtual_stages=%d = %d stages exceeds n_layers=%d "
                           "+ 1: every stage but the last needs a layer", pp, v, pp * v, c->n_layers);
    }
    return 0;
}

int config_loss_scale(const Config *c, LossScaleConfig *out, char *err, size_t errlen) {
    *out = (LossScaleConfig){LOSS_SCALE_NONE, c->loss_scale_init, c->loss_scale_min, c->loss_scale_window,
                             c->loss_scale_hysteresis};
    const char *v = c->loss_scale;
    if (!strcmp(v, "dynamic") || (!strcmp(v, "auto") && !strcmp(c->precision, "fp16"))) out->kind = LOSS_SCALE_DYNAMIC;
    else if (strcmp(v, "none") && strcmp(v, "auto")) {
        char *end;
        errno = 0;
        double x = strtod(v, &end);
        if (!*v || *end || errno || !isfinite(x) || x <= 0 || x > 1e30)
            return set_err(err, errlen, "loss_scale=%s: expected none, dynamic, auto or a scale (a number in (0, 1e30])",
                           v);
        out->kind = LOSS_SCALE_FIXED;
        out->init = x;
    }
    static const char *dynamic_only[] = {"loss_scale_init", "loss_scale_window", "loss_scale_hysteresis",
                                         "loss_scale_min"};
    for (size_t i = 0; i < sizeof dynamic_only / sizeof dynamic_only[0]; i++)
        if (out->kind != LOSS_SCALE_DYNAMIC && config_was_set(dynamic_only[i]))
            return set_err(err, errlen, "%s applies with loss_scale=dynamic (loss_scale=%s)", dynamic_only[i], v);
    if (out->kind == LOSS_SCALE_DYNAMIC && c->loss_scale_min > c->loss_scale_init)
        return set_err(err, errlen, "loss_scale_min=%g exceeds loss_scale_init=%g", c->loss_scale_min,
                       c->loss_scale_init);
    return 0;
}

int config_virtual_stages(const Config *c) {
    if (c->virtual_stages) return c->virtual_stages;
    return !strcmp(c->pipeline_schedule, "interleaved") ? 2 : 1;
}

static void print_value(const Config *c, const Key *k) {
    const char *p = (const char *)c + k->off;
    switch (k->type) {
    case T_INT: printf("%d", *(const int *)p); break;
    case T_FLOAT: printf("%g", *(const double *)p); break;
    case T_BYTES: case T_RATE: printf("%g%s", *(const double *)p, k->type == T_RATE ? "B/s" : "B"); break;
    case T_BOOL: printf("%s", *(const int *)p ? "true" : "false"); break;
    default: printf("%s", p);
    }
}

void config_print_help(int mask) {
    for (int i = 0; i < N_KEYS; i++) {
        const Key *k = &KEYS[i];
        if (!(k->cmds & mask)) continue;
        char left[96];
        /* eval reads the model's context from its checkpoint: no default to claim */
        int from_ckpt = mask == CMD_EVAL && (!strcmp(k->name, "context_len") || !strcmp(k->name, "batch_size") ||
                                             !strcmp(k->name, "val_batches"));
        snprintf(left, sizeof left, "%s=%s", k->name, from_ckpt ? "<checkpoint's>" : k->def[0] ? k->def : "\"\"");
        printf("  %-34s %s", left, k->help);
        if (k->type == T_ENUM) printf(" [%s]", k->choices);
        printf("\n");
    }
}

void config_each(const Config *c, int mask, void (*fn)(void *ctx, const char *key, const char *value, int is_text),
                 void *ctx) {
    for (int i = 0; i < N_KEYS; i++) {
        const Key *k = &KEYS[i];
        if (!(k->cmds & mask)) continue;
        const char *p = (const char *)c + k->off;
        char num[64];
        switch (k->type) {
        case T_INT: snprintf(num, sizeof num, "%d", *(const int *)p); fn(ctx, k->name, num, 0); break;
        case T_FLOAT: {  /* the shortest text that reads back as the same double */
            double v = *(const double *)p;
            for (int digits = 1; digits <= 17; digits++) {
                snprintf(num, sizeof num, "%.*g", digits, v);
                if (strtod(num, NULL) == v) break;
            }
            fn(ctx, k->name, num, 0);
            break;
        }
        case T_BOOL: fn(ctx, k->name, *(const int *)p ? "true" : "false", 0); break;
        case T_BYTES: case T_RATE: snprintf(num, sizeof num, "%.17g", *(const double *)p); fn(ctx, k->name, num, 0); break;
        default: fn(ctx, k->name, p, 1);
        }
    }
}

void config_print(const Config *c, int cmd) {
    int col = 0;
    for (int i = 0; i < N_KEYS; i++) {
        if (!(KEYS[i].cmds & cmd) || KEYS[i].type == T_STR) continue;
        if (!c->moe_experts && !strncmp(KEYS[i].name, "moe_", 4)) continue;  /* (a dense model's header) */
        if (strcmp(c->loss_scale, "dynamic") && !strncmp(KEYS[i].name, "loss_scale_", 11)) continue;
        if (col > 88) { printf("\n"); col = 0; }
        col += printf("%s%s=", col ? " " : "  ", KEYS[i].name);
        print_value(c, &KEYS[i]);
        col += 6;
    }
    printf("\n");
}
