/* config — every key=value setting of every command: one table with type, default, range
 * and help, so parsing, validation and `meshtrain help` can never disagree. (In train/: the
 * runs read it; the command line, above, only parses into it.) Validation happens before
 * any allocation; a bad key or value is one line naming the key, exit status 2. */
#ifndef MESHTRAIN_CONFIG_H
#define MESHTRAIN_CONFIG_H
#include <stddef.h>

typedef struct {
    /* model */
    int vocab_size, embed_dim, n_heads, n_layers, context_len, tie_embeddings;
    int moe_experts, moe_top_k, moe_expert_dim, moe_shared_experts, moe_every;
    char moe_router[16];            /* softmax | sigmoid */
    double moe_capacity_factor, moe_aux_loss, moe_z_loss, moe_bias_balance;
    /* batch and schedule */
    int batch_size, grad_accum_steps, steps, seed, warmup_steps, lr_decay_steps;
    double lr, min_lr, beta1, beta2, eps, weight_decay, grad_clip;
    char lr_schedule[16];           /* constant | cosine */
    char optimizer[16];             /* adamw | adafactor */
    char offload[16];               /* none | optimizer | params */
    double adafactor_beta1, adafactor_clip_threshold, adafactor_decay_rate;
    int adafactor_relative_step, adafactor_scale_parameter;
    char loss_scale[32];            /* auto | none | dynamic | a fixed scale (config_loss_scale) */
    double loss_scale_init, loss_scale_min;
    int loss_scale_window, loss_scale_hysteresis;
    /* data */
    char data_dir[512], train_data[512], val_data[512], tokenizer_dir[512], input[512];
    double val_fraction;
    int val_every, val_batches;
    /* run */
    int threads, log_every, ckpt_every, progress;
    char out_dir[512], log_file[512], ckpt_path[512], resume[512], checkpoint[512], device[16], precision[16];
    char attention[16];             /* auto | cudnn | own */
    int deterministic;
    char cuda_graphs[16];           /* auto | true | false */
    double max_memory_gb;
    /* parallelism */
    int activation_checkpointing;
    int fsdp, zero_opt, shard_group_size, tensor_parallel_size, sequence_parallel, pipeline_parallel_size, overlap,
        expert_parallel_size,
        world_size;
    int copy_engines;
    char shard_strategy[16];
    char dp_allreduce[16];
    char grad_compression[16];
    int powersgd_rank, powersgd_warmup;
    double powersgd_min_compression_rate;
    char tp_comm[16];               /* auto | collectives | fused */
    int micro_batches, virtual_stages, zb1_max_in_flight, pp_copy_engines, pipedream_vertical_sync, pipedream_depth;
    char pipeline_schedule[16], pipeline_split[256];
    double comm_timeout, bucket_mb;
    double peak_tflops;             /* MFU's reference (0: by the card's name) */
    char config[512];               /* a file of key=value lines, read before the command line */
    /* sample / tokenize */
    char prompt[2048];
    int length, top_k, decode;
    double temperature;
    /* export, plot */
    char log[512], out[512], title[256];
    /* plan, calibrate: the run and the machines (byte sizes and rates in bytes, bytes/s) */
    int global_batch, hosts, devices_per_host, top, try, try_steps;
    char cluster[16], profile[512];
    double device_memory, host_memory, link_intra, link_inter;
} Config;

/* Subcommands a key belongs to (bit mask). */
enum {
    CMD_TRAIN = 1, CMD_PREPARE = 2, CMD_TOKENIZE = 4, CMD_SAMPLE = 8, CMD_EVAL = 16, CMD_ESTIMATE = 32,
    CMD_EXPORT = 64,
    CMD_PLOT = 128,
    CMD_PLAN = 256,
    CMD_CALIBRATE = 512,
    CMD_ALL = 1023
};

void config_defaults(Config *c);
/* Parses key=value arguments for subcommand `cmd` (a CMD_ bit) and validates every value
 * and the combinations. Returns 0, or -1 with a one-line message in err. */
int config_parse(Config *c, int cmd, int argc, char **argv, char *err, size_t errlen);
/* Checks shapes and combinations (also used after loading a checkpoint's config). */
int config_validate(const Config *c, int cmd, char *err, size_t errlen);
/* Was this key given explicitly in the last config_parse? */
int config_was_set(const char *key);
/* The loss scaling the keys ask for (loss_scale and its loss_scale_* keys; auto resolved by
 * precision). 0, or -1 with a one-line message naming the key. */
struct LossScaleConfig;
int config_loss_scale(const Config *c, struct LossScaleConfig *out, char *err, size_t errlen);
/* Chunks per pipeline rank: virtual_stages, or its default (2 with interleaved, else 1). */
int config_virtual_stages(const Config *c);
/* Prints every key of the subcommands in mask with its default and meaning. */
void config_print_help(int mask);
/* Calls fn for every key of the subcommands in mask with its value as text (numbers as
 * they parse back to the same value; is_text: a string or choice), in the table's order. */
void config_each(const Config *c, int mask, void (*fn)(void *ctx, const char *key, const char *value, int is_text),
                 void *ctx);
/* One line "key=value key=value ..." of the model/training keys, for run headers. */
void config_print(const Config *c, int cmd);
#endif
