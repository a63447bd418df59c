/* infer — the subcommands that use a trained model or only its shape: eval, sample,
 * estimate. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "checkpoint.h"
#include "commands.h"
#include "layout.h"
#include "estimate.h"
#include "ops.h"
#include "pipeline.h"
#include "schedule.h"
#include "run.h"
#include "tensor.h"
#include "tokenizer.h"
#include "util.h"

/* Builds a model from a checkpoint's config and loads its parameters (into host memory).
 * On a device backend they then move there: the units point at the device copy, which is
 * returned for the caller to op_free (NULL on the cpu). */
static float *load_model(const char *path, Model *m, CkptHeader *h) {
    char err[1024];
    if (ckpt_load_model(path, h, m, err, sizeof err)) die(EXIT_BAD_INPUT, "%s", err);
    if (ops_host_memory()) return NULL;
    float *dev = op_alloc(m->n_flat * sizeof(float));
    op_upload(dev, m->params, m->n_flat * sizeof(float));
    model_point_units(m, dev, NULL);
    return dev;
}

int cmd_eval(Config *c) {
    Model m;
    CkptHeader h;
    OpsOptions oo = ops_options_of(c);  /* attention's kernels on cuda */
    ops_set_options(&oo);
    ops_init_or_die(c->device, c->threads);
    float *dev_params = load_model(c->checkpoint, &m, &h);
    int T = config_was_set("context_len") ? c->context_len : h.context_len;
    Shard val;
    open_shard_or_die(&val, c->val_data, "validation");
    if (val.vocab_size > h.vocab_size)
        die(EXIT_BAD_INPUT, "%s holds a %d-token vocabulary; the model has %d", c->val_data, val.vocab_size,
            h.vocab_size);
    /* By default the batches the training run validated on: its global batch of one
     * micro-batch (what its ranks' validation slices make together), as many as it took, so
     * that the loss is the run's last val_loss. */
    int run_batch = h.global_batch ? h.global_batch / (h.grad_accum_steps > 0 ? h.grad_accum_steps : 1)
                                   : h.batch_size * h.world;
    int want_B = config_was_set("batch_size") || run_batch < 1 ? c->batch_size : run_batch;
    int want_batches = config_was_set("val_batches") || h.val_batches < 1 ? c->val_batches : h.val_batches;
    size_t windows = shard_windows(&val, T);
    int B = (int)(windows < (size_t)want_B ? windows : (size_t)want_B);
    if (B < 1) die(EXIT_BAD_INPUT, "validation data %s is shorter than context_len=%d", c->val_data, T);
    Acts a;
    acts_alloc(&a, &m, B, T, 0);
    double loss = evaluate(&m, &a, &val, want_batches, 0, 1, NULL);
    size_t batches = windows / (size_t)B < (size_t)want_batches ? windows / (size_t)B : (size_t)want_batches;
    printf("val_loss %.4f  (%s, step %d, %zu batches of %d x %d tokens from %s%s)\n", loss, c->checkpoint, h.step,
           batches, B, T, c->val_data,
           config_was_set("batch_size") || config_was_set("val_batches") ? "" : "; the training run's validation batches");
    acts_free(&a);
    shard_close(&val);
    op_free(dev_params);
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
    OpsOptions oo = ops_options_of(c);  /* attention's kernels on cuda */
    ops_set_options(&oo);
    ops_init_or_die(c->device, c->threads);
    float *dev_params = load_model(c->checkpoint, &m, &h);
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
    op_free(dev_params);
    model_free(&m);
    tokenizer_free(tok);
    return 0;
}

int cmd_estimate(Config *c) {
    char err[512], desc[512];
    Layout L;
    if (layout_init(&L, c, c->world_size, err, sizeof err)) die(EXIT_BAD_INPUT, "%s", err);
    ModelConfig mc = model_config_of(c);
    const MemEstimate e = L.whole;
    int PP = L.pp, TP = L.tp, dp = L.dp, gpu = !strcmp(c->device, "cuda");
    estimate_print(&L.ein, dp, &e);
    if (c->grad_accum_steps > 1 && PP == 1)  /* the same memory: one micro-batch's activations, gradients in place */
        printf("gradient accumulation: %d micro-batches of %d a step, global batch %lld sequences; the memory above is "
               "one micro-batch's\n", c->grad_accum_steps, c->batch_size,
               (long long)c->batch_size * c->grad_accum_steps * dp);
    else if (c->grad_accum_steps > 1)  /* a pipeline: one schedule of k x m micro-batches (in flight: below) */
        printf("gradient accumulation: %d rounds of %d micro-batches in one schedule a step, global batch %lld "
               "sequences\n", c->grad_accum_steps, c->micro_batches,
               (long long)c->batch_size * c->grad_accum_steps * dp);
    estimate_print_offload(&L.ein, dp);
    if (TP > 1)
        printf("tensor parallel: %d ranks (x %d data-parallel); each holds 1/%d of every layer's attention heads and FFN "
               "units and their activations, of the vocabulary rows of the embedding and lm_head and of the logits%s\n",
               TP, dp, TP, c->sequence_parallel ? ", and (sequence parallel) of the residual stream and the norms" : "");
    char b1[32], b2[32], b3[32], b4[32];
    size_t most = L.most;
    if (PP > 1) {  /* each stage's share, as a pipeline run holds it */
        printf("per pipeline stage (%d stages x %d data-parallel, %s%s, %d micro-batches of %d sequences):\n", PP, dp,
               c->pipeline_schedule, L.v > 1 ? " over virtual stages" : "", L.M, L.BM);
        int split = 0;
        for (int s = 0; s < PP; s++) {
            const MemEstimate *es = &L.stage_mem[s];
            const Schedule *sc = &L.sc[s];
            Stage mine[SCHED_MAX_CHUNKS];
            split |= L.sched == SCHED_INTERLEAVED && sc->split_backward;
            pipeline_rank_stages(L.stages, PP, L.v, s, mine);
            pipeline_describe(&mc, mine, L.v, desc, sizeof desc);
            char vers[48] = "";
            if (es->versions > 1) snprintf(vers, sizeof vers, " (%d weight versions)", es->versions);
            printf("  stage %d (%s): parameters + gradients + optimizer %s%s, activations %s (%d micro-batch%s "
                   "in flight), ", s, desc, fmt_bytes(b1, (double)(es->params + es->grads + es->optim + es->compute + es->stash)),
                   vers,
                   fmt_bytes(b2, (double)(es->acts + es->logits)), sc->max_in_flight, sc->max_in_flight > 1 ? "es" : "");
            if (es->p2p) printf("receive rings %s, ", fmt_bytes(b1, (double)es->p2p));
            printf("total %s\n", fmt_bytes(b3, (double)es->total));
        }
        if (split) printf("  (interleaved with its backward split, as a run takes it: weight passes fill the bubble)\n");
    }
    /* No GPU is asked here (estimate runs anywhere): on cuda only an explicit limit is checked. */
    size_t avail = c->max_memory_gb > 0 ? (size_t)(c->max_memory_gb * 1e9) : gpu ? 0 : available_memory_bytes();
    if (avail) printf("fits in %s available: %s\n", fmt_bytes(b4, (double)avail), most <= avail ? "yes" : "no");
    if (gpu && e.offload) {  /* the offloaded state against this machine's memory (ranks on one machine: each holds its own) */
        size_t host = available_memory_bytes();
        if (host) printf("offloaded state (per rank) fits in this machine's %s available: %s\n", fmt_bytes(b4, (double)host),
                         e.host <= host ? "yes" : "no");
    }
    layout_free(&L);
    return 0;
}
