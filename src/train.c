#include "commands.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "checkpoint.h"
#include "data.h"
#include "estimate.h"
#include "model.h"
#include "ops.h"
#include "optim.h"
#include "util.h"

static ModelConfig model_config_of(const Config *c) {
    return (ModelConfig){c->vocab_size, c->embed_dim, c->n_heads, c->n_layers, c->context_len, c->tie_embeddings};
}

static void mkdir_p(const char *dir) {
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", dir);
    for (char *p = buf + 1; *p; p++)
        if (*p == '/') { *p = 0; mkdir(buf, 0755); *p = '/'; }
    mkdir(buf, 0755);
}

static void parent_dir(const char *path, char *out, size_t n) {
    snprintf(out, n, "%s", path);
    char *s = strrchr(out, '/');
    if (s) *s = 0; else snprintf(out, n, ".");
}

static void open_shard_or_die(Shard *s, const char *path, const char *what) {
    char err[512];
    if (shard_open(s, path, err, sizeof err)) {
        if (access(path, F_OK) != 0)
            die(EXIT_BAD_INPUT, "%s data %s not found (run 'meshtrain prepare' or 'make data' first)", what, path);
        die(EXIT_BAD_INPUT, "%s", err);
    }
}

/* Mean loss over up to max_batches sequential batches of the validation shard. */
static double evaluate(Model *m, Acts *a, const Shard *val, int max_batches) {
    Loader l;
    char err[256];
    if (loader_init(&l, val, a->B, a->T, 0, 1, 0, 0, err, sizeof err)) return NAN;
    int n = (int)(l.batches_per_epoch < (size_t)max_batches ? l.batches_per_epoch : (size_t)max_batches);
    double sum = 0;
    for (int i = 0; i < n; i++) {
        loader_next(&l, a->inputs, a->targets);
        sum += model_step(m, a, 0, 0.0f);
    }
    loader_free(&l);
    return sum / n;
}

/* The batch the validation shard can serve: at most B windows of T+1 tokens. */
static int val_batch_size(const Shard *val, int B, int T) {
    size_t windows = val->n_tokens > 1 ? (val->n_tokens - 1) / (size_t)T : 0;
    return (int)(windows < (size_t)B ? windows : (size_t)B);
}

/* Model keys given on the command line must agree with a checkpoint's. */
static void check_against_ckpt(const Config *c, const CkptHeader *h, const char *path) {
    struct { const char *key; int want, have; } k[] = {
        {"vocab_size", c->vocab_size, h->vocab_size}, {"embed_dim", c->embed_dim, h->embed_dim},
        {"n_heads", c->n_heads, h->n_heads},          {"n_layers", c->n_layers, h->n_layers},
        {"context_len", c->context_len, h->context_len}, {"tie_embeddings", c->tie_embeddings, h->tie_embeddings},
        {"batch_size", c->batch_size, h->batch_size}, {"seed", c->seed, h->seed},
    };
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++)
        if (config_was_set(k[i].key) && k[i].want != k[i].have)
            die(EXIT_BAD_INPUT, "%s=%d differs from checkpoint %s (%s=%d)", k[i].key, k[i].want, path, k[i].key,
                k[i].have);
}

/* A resumed run takes the model, data order and optimizer settings from its checkpoint;
 * optimizer and schedule keys given on the command line override them. */
static void config_from_ckpt(Config *c, const CkptHeader *h) {
    c->vocab_size = h->vocab_size; c->embed_dim = h->embed_dim; c->n_heads = h->n_heads;
    c->n_layers = h->n_layers; c->context_len = h->context_len; c->tie_embeddings = h->tie_embeddings;
    c->batch_size = h->batch_size; c->seed = h->seed;
#define FROM(key, val) if (!config_was_set(#key)) c->key = (val)
    FROM(lr, h->lr); FROM(min_lr, h->min_lr); FROM(beta1, h->beta1); FROM(beta2, h->beta2); FROM(eps, h->eps);
    FROM(weight_decay, h->weight_decay); FROM(grad_clip, h->grad_clip); FROM(warmup_steps, h->warmup_steps);
    FROM(steps, h->total_steps);
#undef FROM
    if (!config_was_set("lr_schedule")) snprintf(c->lr_schedule, sizeof c->lr_schedule, "%s", h->cosine ? "cosine" : "constant");
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

int cmd_train(Config *c) {
    char err[1024], b1[32], b2[32];
    CkptHeader resume_h;
    int resuming = c->resume[0] != 0;
    if (resuming) {
        if (ckpt_read_header(c->resume, &resume_h, err, sizeof err)) die(EXIT_BAD_INPUT, "%s", err);
        check_against_ckpt(c, &resume_h, c->resume);
        config_from_ckpt(c, &resume_h);
        if (config_validate(c, CMD_TRAIN, err, sizeof err)) die(EXIT_BAD_INPUT, "%s", err);
        if (resume_h.step >= c->steps)
            die(EXIT_BAD_INPUT, "checkpoint %s is at step %d; steps=%d leaves nothing to run", c->resume,
                resume_h.step, c->steps);
    }
    ModelConfig mc = model_config_of(c);
    int B = c->batch_size, T = c->context_len;

    Shard train, val;
    open_shard_or_die(&train, c->train_data, "training");
    open_shard_or_die(&val, c->val_data, "validation");
    if (train.vocab_size > c->vocab_size)
        die(EXIT_BAD_INPUT, "%s holds a %d-token vocabulary; vocab_size=%d is smaller", c->train_data,
            train.vocab_size, c->vocab_size);
    Loader loader;
    if (loader_init(&loader, &train, B, T, 0, 1, (uint64_t)c->seed, 1, err, sizeof err))
        die(EXIT_BAD_INPUT, "%s", err);
    int val_B = val_batch_size(&val, B, T);
    if (val_B < 1)
        die(EXIT_BAD_INPUT, "validation data %s (%zu tokens) is shorter than context_len=%d", c->val_data,
            val.n_tokens, T);

    MemEstimate est;
    size_t data_bytes = (train.n_tokens + val.n_tokens) * 2;
    estimate_memory(&mc, B, T, 1, data_bytes, &est);
    size_t limit = c->max_memory_gb > 0 ? (size_t)(c->max_memory_gb * 1e9) : available_memory_bytes();
    if (limit && est.total > limit)
        die(EXIT_BAD_INPUT, "this run needs about %s but only %s is available (lower batch_size or the model size)",
            fmt_bytes(b1, (double)est.total), fmt_bytes(b2, (double)limit));

    ops_init(c->threads);
    printf("meshtrain train  (device %s, 1 process: dp=1 tp=1 pp=1)\n", ops_backend_name());
    config_print(c, CMD_TRAIN);
    printf("data: %s (%s tokens, %zu batches/epoch), %s (%s tokens)\n", c->train_data,
           fmt_commas(b1, (long long)train.n_tokens), loader.batches_per_epoch, c->val_data,
           fmt_commas(b2, (long long)val.n_tokens));
    estimate_print(&mc, B, T, &est);

    Model m;
    model_init_layout(&m, &mc, 1, 1);
    AdamState opt;
    adam_alloc(&opt, m.n_flat);
    Acts a;
    acts_alloc(&a, &m, B, T, 1);
    int start = 0;
    if (resuming) {
        if (ckpt_load(c->resume, &resume_h, &m, &opt, err, sizeof err)) die(EXIT_BAD_INPUT, "%s", err);
        LoaderState ls = {resume_h.loader_epoch, resume_h.loader_window};
        if (loader_set_state(&loader, ls, err, sizeof err)) die(EXIT_BAD_INPUT, "%s: %s", c->resume, err);
        start = resume_h.step;
        printf("resumed from %s at step %d\n", c->resume, start);
    } else {
        model_init_weights(&m, (uint64_t)c->seed);
    }

    OptimConfig oc = {c->lr, c->min_lr, c->beta1, c->beta2, c->eps, c->weight_decay, c->grad_clip,
                      c->warmup_steps, c->steps, !strcmp(c->lr_schedule, "cosine")};
    char dir[1024];
    mkdir_p(c->out_dir);
    parent_dir(c->log_file, dir, sizeof dir); mkdir_p(dir);
    parent_dir(c->ckpt_path, dir, sizeof dir); mkdir_p(dir);
    FILE *log = fopen(c->log_file, resuming ? "a" : "w");
    if (!log) die(EXIT_BAD_INPUT, "cannot open log file %s", c->log_file);

    CkptHeader h = {0};
    h.vocab_size = mc.vocab_size; h.embed_dim = mc.embed_dim; h.n_heads = mc.n_heads; h.n_layers = mc.n_layers;
    h.context_len = mc.context_len; h.tie_embeddings = mc.tie_embeddings;
    h.batch_size = B; h.world = 1; h.seed = c->seed;
    h.lr = oc.lr; h.min_lr = oc.min_lr; h.beta1 = oc.beta1; h.beta2 = oc.beta2; h.eps = oc.eps;
    h.weight_decay = oc.weight_decay; h.grad_clip = oc.grad_clip; h.warmup_steps = oc.warmup_steps;
    h.total_steps = oc.total_steps; h.cosine = oc.cosine;

    const char *fault = getenv("MESHTRAIN_FAULT_NAN_STEP");  /* test hook: poison one step's loss */
    int nan_step = fault ? atoi(fault) : -1;
    Progress pr = {c->progress && isatty(2), now_seconds(), start, c->steps};
    double tokens_per_step = (double)B * T, flops_per_step = est.flops_per_token * tokens_per_step;
    int warm = start + 1;  /* the first step of a run warms caches and threads: not timed */
    double t_timed = 0, val_loss = NAN;
    int timed_steps = 0;
    float loss = 0;
    for (int step = start; step < c->steps; step++) {
        double t0 = now_seconds();
        loader_next(&loader, a.inputs, a.targets);
        memset(m.grads, 0, m.n_flat * sizeof(float));
        loss = model_step(&m, &a, 1, 1.0f);
        if (step + 1 == nan_step) loss = NAN;
        double norm = grad_norm(m.grads, m.n_flat);
        if (!isfinite(loss) || !isfinite(norm)) {
            progress_clear(&pr);
            fprintf(log, "{\"step\":%d,\"error\":\"non-finite loss\"}\n", step + 1);
            fclose(log);
            die(EXIT_RUN_FAILURE, "step %d: loss is %s (grad_norm %g); stopping. The last checkpoint, if any, "
                "is intact: %s", step + 1, isnan(loss) ? "NaN" : "infinite", norm, c->ckpt_path);
        }
        double lr = adam_step(&opt, &oc, m.params, m.grads, clip_scale(&oc, norm));
        double dt = now_seconds() - t0;
        if (step + 1 > warm) { t_timed += dt; timed_steps++; }
        double tok_s = tokens_per_step / dt, gflops = flops_per_step / dt / 1e9;
        fprintf(log, "{\"step\":%d,\"loss\":%.6f,\"lr\":%.6e,\"grad_norm\":%.6f,\"ms\":%.2f,\"tokens_per_s\":%.1f,"
                "\"gflops\":%.2f}\n", step + 1, loss, lr, norm, dt * 1e3, tok_s, gflops);
        fflush(log);
        if ((step + 1) % c->log_every == 0 || step + 1 == c->steps || step == start) {
            progress_clear(&pr);
            printf("step %5d/%d | loss %.4f | lr %.2e | grad_norm %7.4f | %7.1f ms | %8.0f tok/s | %6.1f GFLOP/s\n",
                   step + 1, c->steps, loss, lr, norm, dt * 1e3, tok_s, gflops);
            fflush(stdout);
        }
        int last = step + 1 == c->steps;
        if ((c->val_every && (step + 1) % c->val_every == 0) || last) {
            val_loss = evaluate(&m, &a, &val, c->val_batches);
            progress_clear(&pr);
            printf("step %5d/%d | val_loss %.4f\n", step + 1, c->steps, val_loss);
            fprintf(log, "{\"step\":%d,\"val_loss\":%.6f}\n", step + 1, val_loss);
            fflush(log);
        }
        if ((c->ckpt_every && (step + 1) % c->ckpt_every == 0) || last) {
            LoaderState ls = loader_get_state(&loader);
            h.step = step + 1; h.adam_step = opt.step; h.loader_epoch = ls.epoch; h.loader_window = ls.window;
            h.last_loss = loss;
            if (ckpt_save(c->ckpt_path, &h, &m, &opt, err, sizeof err)) die(EXIT_RUN_FAILURE, "%s", err);
        }
        progress_draw(&pr, step + 1, loss, tok_s);
    }
    progress_clear(&pr);
    double tok_s = timed_steps ? tokens_per_step * timed_steps / t_timed : 0;
    long rss = max_rss_bytes();
    fprintf(log, "{\"done\":true,\"steps\":%d,\"tokens_per_s\":%.1f,\"gflops\":%.2f,\"max_rss_bytes\":%ld,"
            "\"estimate_bytes\":%zu,\"loss\":%.6f,\"val_loss\":%.6f}\n", c->steps - start, tok_s,
            tok_s * est.flops_per_token / 1e9, rss, est.total, loss, val_loss);
    fclose(log);
    printf("done: %d steps | %.0f tokens/s (%.1f GFLOP/s, first step excluded) | peak memory %s (max RSS; "
           "estimate %s) | final loss %.4f | val_loss %.4f\n", c->steps - start, tok_s,
           tok_s * est.flops_per_token / 1e9, fmt_bytes(b1, (double)rss), fmt_bytes(b2, (double)est.total), loss,
           val_loss);
    printf("checkpoint: %s\n", c->ckpt_path);
    acts_free(&a);
    adam_free(&opt);
    model_free(&m);
    loader_free(&loader);
    shard_close(&train);
    shard_close(&val);
    return 0;
}

/* Builds a model from a checkpoint's config and loads its parameters. */
static void load_model(const char *path, Model *m, CkptHeader *h) {
    char err[1024];
    if (ckpt_read_header(path, h, err, sizeof err)) die(EXIT_BAD_INPUT, "%s", err);
    ModelConfig mc;
    ckpt_model_config(h, &mc);
    model_init_layout(m, &mc, 1, 1);
    if (ckpt_load(path, h, m, NULL, err, sizeof err)) die(EXIT_BAD_INPUT, "%s", err);
}

int cmd_eval(Config *c) {
    Model m;
    CkptHeader h;
    ops_init(c->threads);
    load_model(c->checkpoint, &m, &h);
    int T = config_was_set("context_len") ? c->context_len : h.context_len;
    Shard val;
    open_shard_or_die(&val, c->val_data, "validation");
    if (val.vocab_size > h.vocab_size)
        die(EXIT_BAD_INPUT, "%s holds a %d-token vocabulary; the model has %d", c->val_data, val.vocab_size,
            h.vocab_size);
    int B = val_batch_size(&val, c->batch_size, T);
    if (B < 1) die(EXIT_BAD_INPUT, "validation data %s is shorter than context_len=%d", c->val_data, T);
    Acts a;
    acts_alloc(&a, &m, B, T, 0);
    double loss = evaluate(&m, &a, &val, c->val_batches);
    size_t windows = (val.n_tokens - 1) / (size_t)T;
    size_t batches = windows / (size_t)B < (size_t)c->val_batches ? windows / (size_t)B : (size_t)c->val_batches;
    printf("val_loss %.4f  (%s, step %d, %zu batches of %d x %d tokens from %s)\n", loss, c->checkpoint, h.step,
           batches, B, T, c->val_data);
    acts_free(&a);
    shard_close(&val);
    model_free(&m);
    return 0;
}

int cmd_sample(Config *c) {
    char err[1024];
    char enc[1100], bpe[1100];
    snprintf(enc, sizeof enc, "%s/encoder.json", c->tokenizer_dir);
    snprintf(bpe, sizeof bpe, "%s/vocab.bpe", c->tokenizer_dir);
    Tokenizer *tok = tokenizer_load(enc, bpe, err, sizeof err);
    if (!tok) die(EXIT_BAD_INPUT, "%s", err);
    Model m;
    CkptHeader h;
    ops_init(c->threads);
    load_model(c->checkpoint, &m, &h);
    if (h.vocab_size != tokenizer_vocab_size(tok))
        die(EXIT_BAD_INPUT, "checkpoint %s has vocab_size=%d; the GPT-2 tokenizer has %d", c->checkpoint,
            h.vocab_size, tokenizer_vocab_size(tok));
    TokenBuf ids = {0};
    if (tokenizer_encode_special(tok, c->prompt, strlen(c->prompt), &ids, err, sizeof err))
        die(EXIT_BAD_INPUT, "%s", err);
    /* A story begins after <|endoftext|>, as in training. */
    int T = h.context_len, V = h.vocab_size;
    int *ctx = xmalloc(((size_t)ids.n + c->length + 1) * sizeof(int));
    int n = 0;
    ctx[n++] = TOKEN_EOT;
    for (size_t i = 0; i < ids.n; i++) ctx[n++] = ids.ids[i];
    Acts a;
    acts_alloc(&a, &m, 1, T, 0);
    float *logits = xmalloc((size_t)V * sizeof(float));
    float *probs = xmalloc((size_t)V * sizeof(float));
    int *idx = xmalloc((size_t)V * sizeof(int));
    Rng r;
    rng_seed(&r, (uint64_t)c->seed);
    fwrite(c->prompt, 1, strlen(c->prompt), stdout);
    fflush(stdout);
    for (int g = 0; g < c->length; g++) {
        int start = n > T ? n - T : 0;
        model_last_logits(&m, &a, ctx + start, n - start, logits);
        int next = 0;
        if (c->temperature <= 0) {
            for (int v = 1; v < V; v++) if (logits[v] > logits[next]) next = v;
        } else {
            /* top-k by partial selection, then softmax at the temperature. */
            int k = c->top_k > 0 && c->top_k < V ? c->top_k : V;
            for (int v = 0; v < V; v++) idx[v] = v;
            for (int i = 0; i < k && k < V; i++) {
                int best = i;
                for (int j = i + 1; j < V; j++) if (logits[idx[j]] > logits[idx[best]]) best = j;
                int t = idx[i]; idx[i] = idx[best]; idx[best] = t;
            }
            float mx = -INFINITY;
            for (int i = 0; i < k; i++) mx = fmaxf(mx, logits[idx[i]]);
            double sum = 0;
            for (int i = 0; i < k; i++) { probs[i] = expf((logits[idx[i]] - mx) / (float)c->temperature); sum += probs[i]; }
            double u = rng_uniform(&r) * sum, acc = 0;
            next = idx[k - 1];
            for (int i = 0; i < k; i++) { acc += probs[i]; if (u < acc) { next = idx[i]; break; } }
        }
        if (next == TOKEN_EOT) break;
        ctx[n++] = next;
        size_t len;
        const char *bytes = tokenizer_token_bytes(tok, next, &len);
        fwrite(bytes, 1, len, stdout);
        fflush(stdout);
    }
    printf("\n");
    free(idx); free(probs); free(logits); free(ctx);
    tokenbuf_free(&ids);
    acts_free(&a);
    model_free(&m);
    tokenizer_free(tok);
    return 0;
}

int cmd_estimate(Config *c) {
    ModelConfig mc = model_config_of(c);
    MemEstimate e;
    estimate_memory(&mc, c->batch_size, c->context_len, 1, 0, &e);
    estimate_print(&mc, c->batch_size, c->context_len, &e);
    size_t avail = c->max_memory_gb > 0 ? (size_t)(c->max_memory_gb * 1e9) : available_memory_bytes();
    char b1[32];
    if (avail) printf("fits in %s available: %s\n", fmt_bytes(b1, (double)avail), e.total <= avail ? "yes" : "no");
    return 0;
}
