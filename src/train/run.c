#include "run.h"
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include "ops.h"
#include "util.h"

ModelConfig model_config_of(const Config *c) {
    return (ModelConfig){c->vocab_size, c->embed_dim, c->n_heads, c->n_layers, c->context_len, c->tie_embeddings,
                         c->moe_experts, c->moe_top_k, c->moe_expert_dim, c->moe_shared_experts, c->moe_every,
                         !strcmp(c->moe_router, "sigmoid"), (float)c->moe_capacity_factor};
}

OptimConfig optim_config_of(const Config *c) {
    LossScaleConfig ls;
    if (config_loss_scale(c, &ls, NULL, 0)) ls.kind = LOSS_SCALE_NONE;  /* (validated before: never) */
    return (OptimConfig){c->lr, c->min_lr, c->beta1, c->beta2, c->eps, c->weight_decay, c->grad_clip, c->warmup_steps,
                         c->lr_decay_steps, !strcmp(c->lr_schedule, "cosine"),
                         !strcmp(c->optimizer, "adafactor") ? OPTIM_ADAFACTOR : OPTIM_ADAMW, c->adafactor_beta1,
                         c->adafactor_clip_threshold, c->adafactor_decay_rate, c->adafactor_relative_step,
                         c->adafactor_scale_parameter,
                         !strcmp(c->offload, "params") ? OFFLOAD_PARAMS
                         : !strcmp(c->offload, "optimizer") ? OFFLOAD_OPTIMIZER : OFFLOAD_NONE, ls};
}

EstimateInput estimate_input_of(const Config *c, int world, int shard_size, const OptimConfig *oc) {
    EstimateInput in = {0};
    in.model = model_config_of(c);
    in.B = c->batch_size;
    in.T = c->context_len;
    in.training = train_acts_mode(c);
    in.kind = strategy_of(c);
    in.world = world;
    in.shard_size = shard_size;
    in.tp = c->tensor_parallel_size;
    in.ep = c->expert_parallel_size;
    in.sp = c->sequence_parallel;
    in.gpu = !strcmp(c->device, "cuda");
    in.prec = precision_of(c);
    in.oc = oc;
    in.ops = ops_options_of(c);
    in.versions = !strcmp(c->pipeline_schedule, "2bw") ? 2 : 1;
    if (!strcmp(c->pipeline_schedule, "pipedream"))
        in.versions = c->pipeline_parallel_size == 1 ? (c->pipedream_depth > 1 ? c->pipedream_depth : 1)
                      : c->pipedream_vertical_sync ? ESTIMATE_VERSIONS_STAGES
                                                   : ESTIMATE_VERSIONS_IN_FLIGHT;
    return in;
}

double card_peak_flops(const char *name) {
    /* dense (no sparsity) bf16 with fp32 accumulation; the more specific names first */
    static const struct { const char *has; double tflops; } CARDS[] = {
        {"GH200", 989.4},    {"H200 NVL", 835.0}, {"H200", 989.4}, {"H100 NVL", 835.0}, {"H100 PCIe", 756.0},
        {"H100", 989.4},     {"H800", 989.4},     {"B200", 2250.0}, {"B100", 1750.0},   {"A100", 312.0},
        {"A800", 312.0},     {"L40S", 362.1},     {"L40", 181.0},  {"L4", 121.0},      {"A10G", 70.0},
        {"A10", 125.0},
    };
    if (!name) return 0;
    for (size_t i = 0; i < sizeof CARDS / sizeof CARDS[0]; i++)
        if (strstr(name, CARDS[i].has)) return CARDS[i].tflops * 1e12;
    return 0;
}

void ops_init_or_die(const char *device, int threads) {
    char err[512];
    if (ops_init(device, threads, err, sizeof err)) die(EXIT_BAD_INPUT, "%s", err);
}

OpsOptions ops_options_of(const Config *c) {
    OpsOptions o = {OPS_ATTN_AUTO, c->deterministic};
    if (!strcmp(c->attention, "cudnn")) o.attention = OPS_ATTN_CUDNN;
    else if (!strcmp(c->attention, "own")) o.attention = OPS_ATTN_OWN;
    return o;
}

OpsPrecision precision_of(const Config *c) {
    if (!strcmp(c->precision, "bf16")) return OPS_BF16;
    if (!strcmp(c->precision, "mixed") || (!strcmp(c->precision, "auto") && !strcmp(c->device, "cuda")))
        return OPS_MIXED;
    return OPS_FP32;
}

TpComm tp_comm_of(const Config *c) {
    if (!strcmp(c->tp_comm, "collectives")) return TP_COMM_COLLECTIVES;
    return !strcmp(c->tp_comm, "fused") ? TP_COMM_FUSED : TP_COMM_AUTO;
}

int train_acts_mode(const Config *c) { return c->activation_checkpointing ? ACTS_RECOMPUTE : 1; }

ParallelKind strategy_of(const Config *c) {
    if (c->fsdp) {
        if (!strcmp(c->shard_strategy, "no")) return PAR_DDP;
        if (!strcmp(c->shard_strategy, "grad_op")) return PAR_ZERO2;
        if (!strcmp(c->shard_strategy, "hybrid")) return PAR_HYBRID;
        return PAR_FSDP;
    }
    return c->zero_opt ? PAR_ZERO1 : PAR_DDP;
}

void mkdir_p(const char *dir) {
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", dir);
    for (char *p = buf + 1; *p; p++)
        if (*p == '/') { *p = 0; mkdir(buf, 0755); *p = '/'; }
    mkdir(buf, 0755);
}

void mkdir_parent(const char *path) {
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", path);
    char *s = strrchr(buf, '/');
    if (s && s != buf) { *s = 0; mkdir_p(buf); }
}

int open_shard_checked(Shard *s, const char *path, const char *what, int vocab, Fail *f) {
    char err[512];
    if (shard_open(s, path, err, sizeof err)) {
        if (access(path, F_OK) != 0)
            return fail_set(f, EXIT_BAD_INPUT, "%s data %s not found (run 'meshtrain prepare' or 'make data' first)",
                            what, path);
        return fail_set(f, EXIT_BAD_INPUT, "%s", err);
    }
    if (vocab > 0 && s->vocab_size > vocab) {
        fail_set(f, EXIT_BAD_INPUT, "%s data %s holds a %d-token vocabulary; the model's vocab_size=%d is smaller", what,
                 path, s->vocab_size, vocab);
        shard_close(s);
        return -1;
    }
    return 0;
}

void open_shard_or_die(Shard *s, const char *path, const char *what) {
    Fail f = {0};
    if (open_shard_checked(s, path, what, 0, &f)) die(f.code, "%s", f.msg);
}

int check_writable(const char *path, const char *what, Fail *f) {
    char probe[1100];
    mkdir_parent(path);
    if (snprintf(probe, sizeof probe, "%s.probe.%d", path, (int)getpid()) >= (int)sizeof probe)
        return fail_set(f, EXIT_BAD_INPUT, "%s %s: path too long", what, path);
    int fd = open(probe, O_WRONLY | O_CREAT | O_EXCL, 0644);
    if (fd < 0)
        return fail_set(f, EXIT_BAD_INPUT, "cannot write %s %s: %s", what, path, strerror(errno));
    close(fd);
    unlink(probe);
    return 0;
}

/* check_disk_space's per-need record, as doubles for one allreduce: 32-bit halves of the
 * machine's and the file system's ids (exact in a double), the bytes needed and free. */
enum { DN_HOST_HI, DN_HOST_LO, DN_FS_HI, DN_FS_LO, DN_BYTES, DN_FREE, DN_FIELDS, DN_MAX = 4 };

static void folder_of(char *dir, size_t len, const char *path) {
    snprintf(dir, len, "%s", path);
    char *slash = strrchr(dir, '/');
    if (!slash) snprintf(dir, len, ".");
    else if (slash == dir) dir[1] = 0;
    else *slash = 0;
}

int check_disk_space(const Comm *world, const DiskNeed *needs, int n, Fail *f) {
    if (n > DN_MAX) die(EXIT_RUN_FAILURE, "internal: %d disk needs", n);
    char host[256] = {0};
    if (gethostname(host, sizeof host - 1)) host[0] = 0;
    uint64_t hid = fnv1a64(host, strlen(host), FNV1A64_INIT);
    size_t per_rank = DN_MAX * DN_FIELDS, total = (size_t)world->size * per_rank;
    double *all = xcalloc(total, sizeof(double));
    double *mine = all + (size_t)world->rank * per_rank;
    for (int i = 0; i < n; i++) {
        char dir[1100];
        folder_of(dir, sizeof dir, needs[i].path);
        struct statvfs sv;
        if (needs[i].bytes <= 0 || statvfs(dir, &sv)) continue;  /* nothing to write, or unknown: not checked */
        uint64_t fs = (uint64_t)sv.f_fsid;
        double *d = mine + (size_t)i * DN_FIELDS;
        d[DN_HOST_HI] = (double)(hid >> 32); d[DN_HOST_LO] = (double)(hid & 0xffffffffu);
        d[DN_FS_HI] = (double)(fs >> 32) + 1; d[DN_FS_LO] = (double)(fs & 0xffffffffu);  /* +1: 0 = no record */
        d[DN_BYTES] = needs[i].bytes;
        d[DN_FREE] = (double)sv.f_bavail * (double)sv.f_frsize;
    }
    comm_allreduce_double(world, all, total);
    /* Every rank walks the same records in the same order, and the needs' paths and names are
     * the same on every rank (only the bytes differ): the same verdict and message everywhere. */
    size_t records = (size_t)world->size * DN_MAX;
    unsigned char *seen = xcalloc(records, 1);
    int rc = 0;
    for (size_t a = 0; a < records && !rc; a++) {
        const double *ra = all + a * DN_FIELDS;
        if (seen[a] || ra[DN_FS_HI] == 0) continue;
        double need = 0, free_b = ra[DN_FREE];
        int count[DN_MAX] = {0};
        for (size_t b = a; b < records; b++) {
            const double *rb = all + b * DN_FIELDS;
            if (rb[DN_FS_HI] == 0 || memcmp(ra, rb, 4 * sizeof(double))) continue;
            seen[b] = 1;
            need += rb[DN_BYTES];
            count[b % DN_MAX]++;
            if (rb[DN_FREE] < free_b) free_b = rb[DN_FREE];
        }
        if (need <= free_b) continue;
        char b1[32], b2[32], what[512] = "", dir[1100];
        size_t w = 0;
        int kinds = 0, k = 0;
        for (int i = 0; i < n; i++) kinds += count[i] > 0;
        for (int i = 0; i < n; i++) {
            if (!count[i]) continue;
            k++;
            w += (size_t)snprintf(what + w, sizeof what - w, "%s%s", k == 1 ? "" : k == kinds ? " and " : ", ",
                                  needs[i].what);
            if (count[i] > 1 && w < sizeof what) w += (size_t)snprintf(what + w, sizeof what - w, " (%d ranks' shards)", count[i]);
            if (w >= sizeof what) break;
        }
        folder_of(dir, sizeof dir, needs[a % DN_MAX].path);
        rc = fail_set(f, EXIT_BAD_INPUT, "not enough disk space in %s: %s will take about %s there, and only %s is "
                      "free (free some, or write elsewhere: ckpt_path, log_file, out_dir)", dir, what,
                      fmt_bytes(b1, need), fmt_bytes(b2, free_b));
    }
    free(seen);
    free(all);
    return rc;
}

size_t shard_windows(const Shard *s, int T) { return s->n_tokens > 1 ? (s->n_tokens - 1) / (size_t)T : 0; }

double evaluate(Model *m, Acts *a, const Shard *val, int max_batches, int rank, int world, const UnitHooks *hooks) {
    Loader l;
    char err[256];
    if (loader_init(&l, val, a->B, a->T, rank, world, 0, 0, err, sizeof err)) return NAN;
    int n = (int)(l.batches_per_epoch < (size_t)max_batches ? l.batches_per_epoch : (size_t)max_batches);
    double sum = 0;
    for (int i = 0; i < n; i++) {
        loader_next(&l, a->inputs, a->targets);
        sum += model_step(m, a, 0, 0.0f, hooks);
    }
    loader_free(&l);
    return sum / n;
}
