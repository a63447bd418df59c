/* export — a checkpoint as a Hugging Face Llama model folder (LlamaForCausalLM): weights in
 * model.safetensors (fp32), config.json, and the GPT-2 tokenizer's files, so that
 * `transformers` loads it with from_pretrained.
 *
 * meshtrain's model is HF's Llama with three differences of layout, undone here:
 * - qkv_proj is one [3E, E] matrix (rows: q, then k, then v); HF has q/k/v_proj [E, E].
 * - RoPE rotates interleaved pairs (x[2i], x[2i+1]) of each head; HF's rotate_half rotates
 *   (x[i], x[i + d/2]). Permuting the rows of each q and k head so that pair i's two rows
 *   land at i and i + d/2 makes HF's rotation compute meshtrain's (q.k is unchanged by the
 *   same permutation of q and k, and v is not rotated). It is the `permute` of HF's
 *   convert_llama_weights_to_hf.py, which converts Meta's interleaved checkpoints.
 * - gate_proj and up_proj are adjacent halves of one [2H, E] matrix.
 * Every other tensor ([out, in] as nn.Linear, or a norm's weight) is copied as it is. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include "checkpoint.h"
#include "commands.h"
#include "run.h"
#include "safetensors.h"
#include "tokenizer.h"
#include "util.h"

/* One exported tensor: rows [row0, row0 + rows) of a meshtrain tensor at `offset` in the
 * flat parameters; rope != 0 permutes each head's rows from interleaved to halves. */
typedef struct { size_t offset; int row0, rope; } Source;

/* meshtrain's name (model_tensors, "%d" = layer) -> HF's, for the tensors copied whole. */
static const struct { const char *mt, *hf; } RENAME[] = {
    {"tok_embed.weight", "model.embed_tokens.weight"},
    {"blocks.%d.att_norm.w", "model.layers.%d.input_layernorm.weight"},
    {"blocks.%d.att_out_proj.weight", "model.layers.%d.self_attn.o_proj.weight"},
    {"blocks.%d.ffn_norm.w", "model.layers.%d.post_attention_layernorm.weight"},
    {"blocks.%d.ffn.gate_proj.weight", "model.layers.%d.mlp.gate_proj.weight"},
    {"blocks.%d.ffn.up_proj.weight", "model.layers.%d.mlp.up_proj.weight"},
    {"blocks.%d.ffn.down_proj.weight", "model.layers.%d.mlp.down_proj.weight"},
    {"output_norm.w", "model.norm.weight"},
    {"lm_head.weight", "lm_head.weight"},
};

/* A norm's weight (one row) is 1-D in HF. */
static void set_tensor(StTensor *t, const TensorInfo *ti, int rows, const char *fmt, int layer) {
    if (ti->rows == 1) *t = (StTensor){.ndim = 1, .shape = {ti->cols}};
    else *t = (StTensor){.ndim = 2, .shape = {rows, ti->cols}};
    snprintf(t->name, sizeof t->name, fmt, layer);
}

/* HF's tensors in file order and where each comes from; returns the count. */
static int plan_tensors(const Model *m, StTensor *out, Source *src, int max) {
    int nt = model_n_tensors(&m->c);
    TensorInfo *ti = xmalloc((size_t)nt * sizeof *ti);
    nt = model_tensors(m, ti, nt);
    int n = 0;
    for (int i = 0; i < nt; i++) {
        int layer = 0;
        char fmt[64];
        /* the name with its layer number put back as "%d" */
        if (sscanf(ti[i].name, "blocks.%d.", &layer) == 1)
            snprintf(fmt, sizeof fmt, "blocks.%%d%s", strchr(ti[i].name + 7, '.'));
        else snprintf(fmt, sizeof fmt, "%s", ti[i].name);
        if (n + 3 > max) die(EXIT_RUN_FAILURE, "internal: more tensors than planned");
        if (!strcmp(fmt, "blocks.%d.qkv_proj.weight")) {
            static const char *part[3] = {"q_proj", "k_proj", "v_proj"};
            for (int p = 0; p < 3; p++) {
                char hf[96];
                snprintf(hf, sizeof hf, "model.layers.%%d.self_attn.%s.weight", part[p]);
                set_tensor(&out[n], &ti[i], m->E, hf, layer);
                src[n++] = (Source){ti[i].offset, p * m->E, p < 2};
            }
            continue;
        }
        size_t r = 0;
        while (r < sizeof RENAME / sizeof RENAME[0] && strcmp(RENAME[r].mt, fmt)) r++;
        if (r == sizeof RENAME / sizeof RENAME[0]) die(EXIT_RUN_FAILURE, "internal: no HF name for %s", ti[i].name);
        set_tensor(&out[n], &ti[i], ti[i].rows, RENAME[r].hf, layer);
        src[n++] = (Source){ti[i].offset, 0, 0};
    }
    free(ti);
    return n;
}

/* HF row h*HD + half*HD/2 + i holds meshtrain row h*HD + 2i + half (pair i's two rows). */
static void permute_rope_rows(float *dst, const float *w, int rows, int cols, int HD) {
    for (int r = 0; r < rows; r++) {
        int h = r / HD, j = r % HD, half = j / (HD / 2), i = j % (HD / 2);
        memcpy(dst + (size_t)r * cols, w + ((size_t)h * HD + 2 * i + half) * cols, (size_t)cols * sizeof(float));
    }
}

static size_t write_weights(const Model *m, const char *path) {
    char err[1024];
    int max = 8 + 9 * m->L;
    StTensor *t = xmalloc((size_t)max * sizeof *t);
    Source *src = xmalloc((size_t)max * sizeof *src);
    int n = plan_tensors(m, t, src, max);
    float *scratch = xmalloc((size_t)m->E * m->E * sizeof(float));
    StWriter w;
    if (st_open(&w, path, t, n, err, sizeof err)) die(EXIT_BAD_INPUT, "%s", err);
    for (int i = 0; i < n; i++) {
        int cols = t[i].ndim == 2 ? (int)t[i].shape[1] : (int)t[i].shape[0];
        const float *p = m->params + src[i].offset + (size_t)src[i].row0 * cols;
        if (src[i].rope) {
            permute_rope_rows(scratch, p, (int)t[i].shape[0], cols, m->HD);
            p = scratch;
        }
        st_write(&w, p);
    }
    if (st_commit(&w, err, sizeof err)) die(EXIT_BAD_INPUT, "%s", err);
    size_t bytes = w.bytes;
    free(scratch); free(src); free(t);
    return bytes;
}

static void write_text(const char *dir, const char *name, const char *text, size_t len) {
    char path[1200], err[1400];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (write_file_atomic(path, text, len, err, sizeof err)) die(EXIT_BAD_INPUT, "%s", err);
    printf("  %-24s %zu bytes\n", name, len);
}

static void copy_file(const char *dir, const char *name, const char *from) {
    char err[1400];
    size_t len;
    char *text = read_file(from, &len, err, sizeof err);
    if (!text) die(EXIT_BAD_INPUT, "%s", err);
    write_text(dir, name, text, len);
    free(text);
}

/* Creates dir (and its parents) or exits 2 naming why. */
static void make_out_dir(const char *dir) {
    struct stat st;
    mkdir_p(dir);
    /* mkdir_p is quiet; this last mkdir gives the folder's own errno */
    if (mkdir(dir, 0755) && errno != EEXIST) die(EXIT_BAD_INPUT, "out=%s: cannot create it: %s", dir, strerror(errno));
    if (stat(dir, &st) || !S_ISDIR(st.st_mode)) die(EXIT_BAD_INPUT, "out=%s is not a folder", dir);
}

int cmd_export(Config *c) {
    char err[1024], enc[1100], bpe[1100], json[2048];
    if (!c->out[0]) snprintf(c->out, sizeof c->out, "runs/hf");  /* the shared key's default for export */
    /* Everything is read and checked before the folder is made. */
    Model m;
    CkptHeader h;
    if (ckpt_load_model(c->checkpoint, &h, &m, err, sizeof err)) die(EXIT_BAD_INPUT, "%s", err);
    if (m.n_moe) die(EXIT_BAD_INPUT, "export: %s is a mixture-of-experts model, which export does not write yet",
                     c->checkpoint);
    free(m.grads);  /* nothing is trained: a big model's host copy takes half the memory */
    m.grads = NULL;
    model_point_units(&m, m.params, NULL);
    snprintf(enc, sizeof enc, "%s/encoder.json", c->tokenizer_dir);
    snprintf(bpe, sizeof bpe, "%s/vocab.bpe", c->tokenizer_dir);
    Tokenizer *tok = tokenizer_load(enc, bpe, err, sizeof err);
    if (!tok) die(EXIT_BAD_INPUT, "%s", err);
    if (m.V != tokenizer_vocab_size(tok))
        die(EXIT_BAD_INPUT, "checkpoint %s has vocab_size=%d; the GPT-2 tokenizer it would be exported with has %d",
            c->checkpoint, m.V, tokenizer_vocab_size(tok));
    tokenizer_free(tok);
    make_out_dir(c->out);

    printf("exporting %s (step %d) to %s as a Hugging Face LlamaForCausalLM:\n", c->checkpoint, h.step, c->out);
    /* The tokenizer's files are the GPT-2 ones renamed: vocab.bpe keeps its "#version" first
     * line, which GPT2Tokenizer skips. */
    copy_file(c->out, "vocab.json", enc);
    copy_file(c->out, "merges.txt", bpe);
    int n = snprintf(json, sizeof json,
                     "{\n  \"tokenizer_class\": \"GPT2Tokenizer\",\n  \"bos_token\": \"<|endoftext|>\",\n"
                     "  \"eos_token\": \"<|endoftext|>\",\n  \"unk_token\": \"<|endoftext|>\",\n"
                     "  \"add_bos_token\": false,\n  \"add_prefix_space\": false,\n  \"model_max_length\": %d\n}\n",
                     m.c.context_len);
    write_text(c->out, "tokenizer_config.json", json, (size_t)n);
    n = snprintf(json, sizeof json,
                 "{\n  \"bos_token\": \"<|endoftext|>\",\n  \"eos_token\": \"<|endoftext|>\",\n"
                 "  \"unk_token\": \"<|endoftext|>\"\n}\n");
    write_text(c->out, "special_tokens_map.json", json, (size_t)n);
    n = snprintf(json, sizeof json, "{\n  \"bos_token_id\": %d,\n  \"eos_token_id\": %d\n}\n", TOKEN_EOT, TOKEN_EOT);
    write_text(c->out, "generation_config.json", json, (size_t)n);

    char path[1200];
    snprintf(path, sizeof path, "%s/model.safetensors", c->out);
    size_t bytes = write_weights(&m, path);
    printf("  %-24s %zu bytes (%zu fp32 parameters%s)\n", "model.safetensors", bytes, m.n_params,
           m.c.tie_embeddings ? ", lm_head tied to embed_tokens" : "");

    /* config.json last: a folder that has it has every file. */
    n = snprintf(json, sizeof json,
                 "{\n  \"architectures\": [\"LlamaForCausalLM\"],\n  \"model_type\": \"llama\",\n"
                 "  \"hidden_size\": %d,\n  \"intermediate_size\": %d,\n  \"num_attention_heads\": %d,\n"
                 "  \"num_key_value_heads\": %d,\n  \"num_hidden_layers\": %d,\n  \"head_dim\": %d,\n"
                 "  \"vocab_size\": %d,\n  \"max_position_embeddings\": %d,\n  \"rms_norm_eps\": %g,\n"
                 "  \"rope_theta\": %.1f,\n  \"hidden_act\": \"silu\",\n  \"attention_bias\": false,\n"
                 "  \"attention_dropout\": 0.0,\n  \"mlp_bias\": false,\n  \"tie_word_embeddings\": %s,\n"
                 "  \"bos_token_id\": %d,\n  \"eos_token_id\": %d,\n  \"initializer_range\": 0.02,\n"
                 "  \"use_cache\": true,\n  \"torch_dtype\": \"float32\"\n}\n",
                 m.E, m.H, m.NH, m.NH, m.L, m.HD, m.V, m.c.context_len, (double)MODEL_RMS_EPS,
                 (double)MODEL_ROPE_BASE, m.c.tie_embeddings ? "true" : "false", TOKEN_EOT, TOKEN_EOT);
    write_text(c->out, "config.json", json, (size_t)n);
    model_free(&m);
    return 0;
}
