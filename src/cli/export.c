/* export — a checkpoint as a Hugging Face model folder: weights in model.safetensors (fp32),
 * config.json, and the GPT-2 tokenizer's files, so that `transformers` loads it with
 * from_pretrained. A dense model is a LlamaForCausalLM; a mixture of experts with a softmax
 * router a MixtralForCausalLM (every layer MoE, no shared experts) or else a
 * Qwen2MoeForCausalLM (hf_class). A sigmoid router has no class here and is refused.
 *
 * meshtrain's model is HF's Llama with three differences of layout, undone here:
 * - qkv_proj is one [3E, E] matrix (rows: q, then k, then v); HF has q/k/v_proj [E, E].
 * - RoPE rotates interleaved pairs (x[2i], x[2i+1]) of each head; HF's rotate_half rotates
 *   (x[i], x[i + d/2]). Permuting the rows of each q and k head so that pair i's two rows
 *   land at i and i + d/2 makes HF's rotation compute meshtrain's (q.k is unchanged by the
 *   same permutation of q and k, and v is not rotated). It is the `permute` of HF's
 *   convert_llama_weights_to_hf.py, which converts Meta's interleaved checkpoints.
 * - gate_proj and up_proj are adjacent halves of one [2H, E] matrix.
 * Every other tensor ([out, in] as nn.Linear, or a norm's weight) is copied as it is; the
 * MoE classes' attention and norms are Llama's. What Qwen2-MoE has beyond meshtrain's model
 * (q/k/v biases, a gate on the shared expert, a shared expert always) is written so that
 * it changes nothing, exactly: zero biases, a zero gate weight (sigmoid 0 = 0.5) with the
 * shared expert's down_proj doubled, a zero shared expert of width 1.
 *
 * With moe_capacity_factor > 0 training dropped routed choices past an expert's capacity;
 * transformers' MoE classes are dropless, and so is the exported model (the printout says
 * so). */
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

/* The Hugging Face class a checkpoint is exported as (hf_class). */
typedef enum { HF_LLAMA, HF_MIXTRAL, HF_QWEN2_MOE } HfClass;
static const char *const HF_NAME[] = {"LlamaForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM"};

/* Mixtral is every layer sparse with routed experts only; Qwen2-MoE adds what Mixtral lacks:
 * dense layers between the sparse ones (decoder_sparse_step) and a shared expert. Both
 * route by a softmax over all experts, top k, renormalised over the k (Mixtral always,
 * Qwen2-MoE with norm_topk_prob), as meshtrain's softmax router does. */
static HfClass hf_class(const ModelConfig *c) {
    if (c->moe_experts <= 0) return HF_LLAMA;
    return c->moe_shared_experts == 0 && c->moe_every == 1 ? HF_MIXTRAL : HF_QWEN2_MOE;
}

/* How an exported tensor's values are made: copied; rows permuted from interleaved RoPE
 * pairs to halves; zeros (a tensor HF's class has and meshtrain's model has not); doubled
 * (exact in fp32: Qwen2-MoE's shared expert output is halved by its gate, below). */
typedef enum { SRC_COPY, SRC_ROPE, SRC_ZERO, SRC_DOUBLE } SrcOp;

/* One exported tensor: rows [row0, row0 + rows) of a meshtrain tensor at `offset` in the
 * flat parameters (unused by SRC_ZERO), made by op. */
typedef struct { size_t offset; int row0; SrcOp op; } Source;

/* meshtrain's name (model_tensors, "%d" = layer, then expert) -> HF's, for the tensors
 * exported whole. The dense ones are the same in the three classes. */
typedef struct { const char *mt, *hf; SrcOp op; } Rename;
static const Rename RENAME[] = {
    {"tok_embed.weight", "model.embed_tokens.weight", SRC_COPY},
    {"blocks.%d.att_norm.w", "model.layers.%d.input_layernorm.weight", SRC_COPY},
    {"blocks.%d.att_out_proj.weight", "model.layers.%d.self_attn.o_proj.weight", SRC_COPY},
    {"blocks.%d.ffn_norm.w", "model.layers.%d.post_attention_layernorm.weight", SRC_COPY},
    {"blocks.%d.ffn.gate_proj.weight", "model.layers.%d.mlp.gate_proj.weight", SRC_COPY},
    {"blocks.%d.ffn.up_proj.weight", "model.layers.%d.mlp.up_proj.weight", SRC_COPY},
    {"blocks.%d.ffn.down_proj.weight", "model.layers.%d.mlp.down_proj.weight", SRC_COPY},
    {"output_norm.w", "model.norm.weight", SRC_COPY},
    {"lm_head.weight", "lm_head.weight", SRC_COPY},
};
/* Mixtral's experts are w1 (gate), w3 (up), w2 (down). transformers 5 keeps each layer's
 * experts as stacked gate_up_proj / down_proj tensors, and its checkpoint conversion for
 * model_type mixtral (conversion_mapping.py) reads these per-expert names into them, so
 * these load in the versions before and after that change. */
static const Rename RENAME_MIXTRAL[] = {
    {"blocks.%d.ffn.router.weight", "model.layers.%d.block_sparse_moe.gate.weight", SRC_COPY},
    {"blocks.%d.ffn.experts.%d.gate_proj.weight", "model.layers.%d.block_sparse_moe.experts.%d.w1.weight", SRC_COPY},
    {"blocks.%d.ffn.experts.%d.up_proj.weight", "model.layers.%d.block_sparse_moe.experts.%d.w3.weight", SRC_COPY},
    {"blocks.%d.ffn.experts.%d.down_proj.weight", "model.layers.%d.block_sparse_moe.experts.%d.w2.weight", SRC_COPY},
};
/* Qwen2-MoE multiplies its shared expert's output by sigmoid(shared_expert_gate . h); the
 * gate is exported as zeros (sigmoid 0 = 0.5 exactly) and down_proj doubled, which gives
 * meshtrain's ungated shared experts exactly. */
static const Rename RENAME_QWEN2_MOE[] = {
    {"blocks.%d.ffn.router.weight", "model.layers.%d.mlp.gate.weight", SRC_COPY},
    {"blocks.%d.ffn.experts.%d.gate_proj.weight", "model.layers.%d.mlp.experts.%d.gate_proj.weight", SRC_COPY},
    {"blocks.%d.ffn.experts.%d.up_proj.weight", "model.layers.%d.mlp.experts.%d.up_proj.weight", SRC_COPY},
    {"blocks.%d.ffn.experts.%d.down_proj.weight", "model.layers.%d.mlp.experts.%d.down_proj.weight", SRC_COPY},
    {"blocks.%d.ffn.shared.gate_proj.weight", "model.layers.%d.mlp.shared_expert.gate_proj.weight", SRC_COPY},
    {"blocks.%d.ffn.shared.up_proj.weight", "model.layers.%d.mlp.shared_expert.up_proj.weight", SRC_COPY},
    {"blocks.%d.ffn.shared.down_proj.weight", "model.layers.%d.mlp.shared_expert.down_proj.weight", SRC_DOUBLE},
};

/* The tensors planned so far (plan_tensors). */
typedef struct { StTensor *t; Source *src; int n, max; } Plan;

static void plan_add(Plan *p, int ndim, int rows, int cols, Source src, const char *fmt, int a, int b) {
    if (p->n == p->max) die(EXIT_RUN_FAILURE, "internal: more tensors than planned");
    StTensor *t = &p->t[p->n];
    /* a norm's weight (one row) and a bias are 1-D in HF */
    *t = ndim == 1 ? (StTensor){.ndim = 1, .shape = {cols}} : (StTensor){.ndim = 2, .shape = {rows, cols}};
    snprintf(t->name, sizeof t->name, fmt, a, b);
    p->src[p->n++] = src;
}

/* name with each all-digit component ("blocks.3.", "experts.5.") put back as "%d" into fmt,
 * its numbers into num[0..1] */
static void name_template(const char *name, char *fmt, size_t len, int *num) {
    size_t o = 0;
    int k = 0;
    num[0] = num[1] = 0;
    for (const char *s = name; *s && o + 3 < len;) {
        size_t d = strspn(s, "0123456789");
        if (d && (s == name || s[-1] == '.') && (s[d] == '.' || !s[d]) && k < 2) {
            num[k++] = atoi(s);
            fmt[o++] = '%', fmt[o++] = 'd';
            s += d;
        } else fmt[o++] = *s++;
    }
    fmt[o] = 0;
}

static const Rename *find_rename(const Rename *table, size_t n, const char *fmt) {
    for (size_t r = 0; r < n; r++)
        if (!strcmp(table[r].mt, fmt)) return &table[r];
    return NULL;
}

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* HF's tensors in file order and where each comes from; returns the count. */
static int plan_tensors(const Model *m, HfClass cls, StTensor *out, Source *src, int max) {
    int nt = model_n_tensors(&m->c);
    TensorInfo *ti = xmalloc((size_t)nt * sizeof *ti);
    nt = model_tensors(m, ti, nt);
    Plan p = {out, src, 0, max};
    const Rename *moe = cls == HF_MIXTRAL ? RENAME_MIXTRAL : RENAME_QWEN2_MOE;
    size_t n_moe = cls == HF_MIXTRAL ? COUNT(RENAME_MIXTRAL) : COUNT(RENAME_QWEN2_MOE);
    const Source zero = {0, 0, SRC_ZERO};
    for (int i = 0; i < nt; i++) {
        const TensorInfo *t = &ti[i];
        char fmt[96];
        int num[2];
        name_template(t->name, fmt, sizeof fmt, num);
        if (!strcmp(fmt, "blocks.%d.qkv_proj.weight")) {
            static const char *part[3] = {"q_proj", "k_proj", "v_proj"};
            for (int q = 0; q < 3; q++) {
                char hf[96];
                snprintf(hf, sizeof hf, "model.layers.%%d.self_attn.%s.weight", part[q]);
                Source from = {t->offset, q * m->E, q < 2 ? SRC_ROPE : SRC_COPY};
                plan_add(&p, 2, m->E, t->cols, from, hf, num[0], 0);
            }
            /* Qwen2-MoE's q, k and v projections have biases (qkv_bias, true in every
             * version; older ones have no switch): zero */
            if (cls == HF_QWEN2_MOE)
                for (int q = 0; q < 3; q++) {
                    char hf[96];
                    snprintf(hf, sizeof hf, "model.layers.%%d.self_attn.%s.bias", part[q]);
                    plan_add(&p, 1, 1, m->E, zero, hf, num[0], 0);
                }
            continue;
        }
        const Rename *r = find_rename(RENAME, COUNT(RENAME), fmt);
        if (!r && cls != HF_LLAMA) r = find_rename(moe, n_moe, fmt);
        if (!r) die(EXIT_RUN_FAILURE, "internal: no %s name for %s", HF_NAME[cls], t->name);
        /* a norm's weight (".w") is 1-D; a router or an expert may have one row */
        size_t len = strlen(fmt);
        int ndim = len > 2 && !strcmp(fmt + len - 2, ".w") ? 1 : 2;
        plan_add(&p, ndim, t->rows, t->cols, (Source){t->offset, 0, r->op}, r->hf, num[0], num[1]);
        if (cls == HF_QWEN2_MOE && !strcmp(fmt, "blocks.%d.ffn.router.weight")) {
            int l = num[0];
            plan_add(&p, 2, 1, m->E, zero, "model.layers.%d.mlp.shared_expert_gate.weight", l, 0);
            /* Qwen2-MoE always has a shared expert; without meshtrain's, one of width 1 whose
             * weights are zero adds exactly 0 (down(silu(0) * 0) = 0) */
            if (!m->Hs) {
                plan_add(&p, 2, 1, m->E, zero, "model.layers.%d.mlp.shared_expert.gate_proj.weight", l, 0);
                plan_add(&p, 2, 1, m->E, zero, "model.layers.%d.mlp.shared_expert.up_proj.weight", l, 0);
                plan_add(&p, 2, m->E, 1, zero, "model.layers.%d.mlp.shared_expert.down_proj.weight", l, 0);
            }
        }
    }
    free(ti);
    return p.n;
}

/* HF row h*HD + half*HD/2 + i holds meshtrain row h*HD + 2i + half (pair i's two rows). */
static void permute_rope_rows(float *dst, const float *w, int rows, int cols, int HD) {
    for (int r = 0; r < rows; r++) {
        int h = r / HD, j = r % HD, half = j / (HD / 2), i = j % (HD / 2);
        memcpy(dst + (size_t)r * cols, w + ((size_t)h * HD + 2 * i + half) * cols, (size_t)cols * sizeof(float));
    }
}

/* Returns the file's size; *zeros: the values of the tensors written as zeros. */
static size_t write_weights(const Model *m, HfClass cls, const char *path, size_t *zeros) {
    char err[1024];
    /* per layer: q, k, v for qkv_proj (+2), Qwen2-MoE's biases (+3), shared expert gate and
     * a zero shared expert (+4) */
    int max = model_n_tensors(&m->c) + 9 * m->L;
    StTensor *t = xmalloc((size_t)max * sizeof *t);
    Source *src = xmalloc((size_t)max * sizeof *src);
    int n = plan_tensors(m, cls, t, src, max);
    size_t scratch_n = 1;
    *zeros = 0;
    for (int i = 0; i < n; i++) {
        if (src[i].op != SRC_COPY && st_numel(&t[i]) > scratch_n) scratch_n = st_numel(&t[i]);
        if (src[i].op == SRC_ZERO) *zeros += st_numel(&t[i]);
    }
    float *scratch = xmalloc(scratch_n * sizeof(float));
    StWriter w;
    if (st_open(&w, path, t, n, err, sizeof err)) die(EXIT_BAD_INPUT, "%s", err);
    for (int i = 0; i < n; i++) {
        int cols = t[i].ndim == 2 ? (int)t[i].shape[1] : (int)t[i].shape[0];
        size_t numel = st_numel(&t[i]);
        const float *p = m->params + src[i].offset + (size_t)src[i].row0 * cols;
        switch (src[i].op) {
        case SRC_COPY: break;
        case SRC_ROPE: permute_rope_rows(scratch, p, (int)t[i].shape[0], cols, m->HD), p = scratch; break;
        case SRC_ZERO: memset(scratch, 0, numel * sizeof(float)), p = scratch; break;
        case SRC_DOUBLE:
            for (size_t k = 0; k < numel; k++) scratch[k] = 2.0f * p[k];
            p = scratch;
            break;
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

/* tokenizer.json: the GPT-2 tokenizer as the `tokenizers` library serializes it (as
 * openai-community/gpt2 has it): byte-level BPE, its vocab encoder.json, its merges the lines
 * of vocab.bpe after "#version". transformers 5's AutoTokenizer takes a mixtral model's
 * tokenizer from this file alone (TokenizersBackend), ignoring tokenizer_config's
 * tokenizer_class; the other classes' tokenizers read it too when it is there. */
static void write_tokenizer_json(const char *dir, const char *enc_path, const char *bpe_path) {
    char err[1400];
    size_t enc_len, bpe_len;
    char *enc = read_file(enc_path, &enc_len, err, sizeof err);
    if (!enc) die(EXIT_BAD_INPUT, "%s", err);
    char *bpe = read_file(bpe_path, &bpe_len, err, sizeof err);
    if (!bpe) die(EXIT_BAD_INPUT, "%s", err);
    while (enc_len && (enc[enc_len - 1] == '\n' || enc[enc_len - 1] == '\r' || enc[enc_len - 1] == ' ')) enc_len--;
    size_t cap = enc_len + 6 * bpe_len + 2048, n = 0;  /* (a byte of a merge is 6 at most, as \u00XX) */
    char *out = xmalloc(cap);
    n += (size_t)snprintf(out + n, cap - n,
                          "{\"version\": \"1.0\", \"truncation\": null, \"padding\": null,\n"
                          " \"added_tokens\": [{\"id\": %d, \"content\": \"<|endoftext|>\", \"single_word\": false, "
                          "\"lstrip\": false, \"rstrip\": false, \"normalized\": true, \"special\": true}],\n"
                          " \"normalizer\": null,\n"
                          " \"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, "
                          "\"trim_offsets\": true, \"use_regex\": true},\n"
                          " \"post_processor\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true, "
                          "\"trim_offsets\": false, \"use_regex\": true},\n"
                          " \"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true, "
                          "\"trim_offsets\": true, \"use_regex\": true},\n"
                          " \"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": null, "
                          "\"continuing_subword_prefix\": \"\", \"end_of_word_suffix\": \"\", \"fuse_unk\": false, "
                          "\"byte_fallback\": false,\n  \"vocab\": ",
                          TOKEN_EOT);
    memcpy(out + n, enc, enc_len), n += enc_len;
    n += (size_t)snprintf(out + n, cap - n, ",\n  \"merges\": [");
    int first = 1;
    for (char *line = bpe, *end = bpe + bpe_len; line < end;) {
        char *nl = memchr(line, '\n', (size_t)(end - line));
        size_t len = nl ? (size_t)(nl - line) : (size_t)(end - line);
        char *next = nl ? nl + 1 : end;
        if (len && line[len - 1] == '\r') len--;
        if (!len || (line == bpe && !strncmp(line, "#version", 8))) { line = next; continue; }
        n += (size_t)snprintf(out + n, cap - n, "%s\"", first ? "" : ", ");
        first = 0;
        for (size_t i = 0; i < len; i++) {
            unsigned char ch = (unsigned char)line[i];
            if (ch == '"' || ch == '\\') out[n++] = '\\', out[n++] = (char)ch;
            else if (ch < 0x20) n += (size_t)snprintf(out + n, cap - n, "\\u%04x", ch);
            else out[n++] = (char)ch;
        }
        out[n++] = '"';
        line = next;
    }
    n += (size_t)snprintf(out + n, cap - n, "]}}\n");
    write_text(dir, "tokenizer.json", out, n);
    free(out); free(bpe); free(enc);
}

/* Creates dir (and its parents) or exits 2 naming why. */
static void make_out_dir(const char *dir) {
    struct stat st;
    mkdir_p(dir);
    /* mkdir_p is quiet; this last mkdir gives the folder's own errno */
    if (mkdir(dir, 0755) && errno != EEXIST) die(EXIT_BAD_INPUT, "out=%s: cannot create it: %s", dir, strerror(errno));
    if (stat(dir, &st) || !S_ISDIR(st.st_mode)) die(EXIT_BAD_INPUT, "out=%s is not a folder", dir);
}

/* A float as JSON that parses back as a float, not an integer ("0.0", not "0"): the typed
 * configs of recent transformers check a field's type. */
static const char *json_float(char *buf, size_t len, double v) {
    snprintf(buf, len, "%g", v);
    if (!strpbrk(buf, ".e")) strncat(buf, ".0", len - strlen(buf) - 1);
    return buf;
}

/* config.json of a MoE model as Mixtral's or Qwen2-MoE's; returns its length. rope_theta is
 * also given as rope_parameters, which transformers 5 reads first: Mixtral's default theta
 * there is 1e6, not meshtrain's 1e4, so nothing is left to a default. Qwen2-MoE's dense
 * layers have the dense FFN's width (intermediate_size); sliding-window attention is off. */
static int moe_config(const Model *m, const CkptHeader *h, HfClass cls, char *json, size_t len) {
    char aux[32];
    const ModelConfig *c = &m->c;
    int n = snprintf(json, len,
                     "{\n  \"architectures\": [\"%s\"],\n  \"model_type\": \"%s\",\n"
                     "  \"hidden_size\": %d,\n  \"intermediate_size\": %d,\n  \"num_attention_heads\": %d,\n"
                     "  \"num_key_value_heads\": %d,\n  \"num_hidden_layers\": %d,\n",
                     HF_NAME[cls], cls == HF_MIXTRAL ? "mixtral" : "qwen2_moe", m->E,
                     cls == HF_MIXTRAL ? m->He : m->H, m->NH, m->NH, m->L);
    if (cls == HF_MIXTRAL) n += snprintf(json + n, len - (size_t)n, "  \"head_dim\": %d,\n", m->HD);
    n += snprintf(json + n, len - (size_t)n,
                  "  \"vocab_size\": %d,\n  \"max_position_embeddings\": %d,\n  \"rms_norm_eps\": %g,\n"
                  "  \"rope_theta\": %.1f,\n"
                  "  \"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": %.1f},\n"
                  "  \"hidden_act\": \"silu\",\n  \"attention_dropout\": 0.0,\n",
                  m->V, c->context_len, (double)MODEL_RMS_EPS, (double)MODEL_ROPE_BASE, (double)MODEL_ROPE_BASE);
    if (cls == HF_MIXTRAL)
        n += snprintf(json + n, len - (size_t)n,
                      "  \"sliding_window\": null,\n  \"num_local_experts\": %d,\n  \"num_experts_per_tok\": %d,\n"
                      "  \"router_jitter_noise\": 0.0,\n",
                      m->X, m->K);
    else
        n += snprintf(json + n, len - (size_t)n,
                      "  \"qkv_bias\": true,\n  \"use_sliding_window\": false,\n  \"sliding_window\": null,\n"
                      "  \"max_window_layers\": %d,\n  \"decoder_sparse_step\": %d,\n  \"mlp_only_layers\": [],\n"
                      "  \"num_experts\": %d,\n  \"num_experts_per_tok\": %d,\n  \"moe_intermediate_size\": %d,\n"
                      "  \"shared_expert_intermediate_size\": %d,\n  \"norm_topk_prob\": true,\n",
                      m->L, c->moe_every, m->X, m->K, m->He, m->Hs ? m->Hs : 1);
    n += snprintf(json + n, len - (size_t)n,
                  "  \"router_aux_loss_coef\": %s,\n  \"output_router_logits\": false,\n"
                  "  \"tie_word_embeddings\": %s,\n  \"bos_token_id\": %d,\n  \"eos_token_id\": %d,\n"
                  "  \"initializer_range\": 0.02,\n  \"use_cache\": true,\n  \"torch_dtype\": \"float32\"\n}\n",
                  json_float(aux, sizeof aux, h->moe_aux_loss), c->tie_embeddings ? "true" : "false", TOKEN_EOT,
                  TOKEN_EOT);
    if ((size_t)n >= len) die(EXIT_RUN_FAILURE, "internal: config.json longer than its buffer");
    return n;
}

/* What a MoE export maps to what, printed under the header. */
static void print_moe(const Model *m, HfClass cls) {
    const ModelConfig *c = &m->c;
    printf("  mixture of experts: %d experts of width %d, top %d by a softmax renormalised over the k, ", m->X, m->He,
           m->K);
    if (cls == HF_MIXTRAL)
        printf("in every layer: Mixtral's block_sparse_moe (experts' w1, w3, w2 = gate, up, down)\n");
    else {
        if (c->moe_every > 1) {
            printf("in layers");
            for (int l = c->moe_every - 1, k = 0; l < m->L; l += c->moe_every, k++)
                if (k < 4) printf("%s %d", k ? "," : "", l);
                else if (k == 4) printf(", ...");
            printf(" (decoder_sparse_step %d; the others dense)", c->moe_every);
        } else printf("in every layer");
        if (m->Hs)
            printf("; shared experts (width %d) as Qwen2-MoE's shared_expert, its gate 0 (sigmoid 0.5), down_proj x 2",
                   m->Hs);
        else printf("; Qwen2-MoE's shared_expert all zero (width 1: adds 0)");
        printf("; q, k, v biases zero\n");
    }
    if (c->moe_capacity_factor > 0)
        printf("  note: training with moe_capacity_factor=%g drops routed choices past an expert's capacity; the "
               "export, as transformers runs it, is dropless: every token goes to its top %d experts\n",
               (double)c->moe_capacity_factor, m->K);
}

int cmd_export(Config *c) {
    char err[1024], enc[1100], bpe[1100], json[4096];
    if (!c->out[0]) snprintf(c->out, sizeof c->out, "runs/hf");  /* the shared key's default for export */
    /* Everything is read and checked before the folder is made. */
    Model m;
    CkptHeader h;
    if (ckpt_load_model(c->checkpoint, &h, &m, err, sizeof err)) die(EXIT_BAD_INPUT, "%s", err);
    free(m.grads);  /* nothing is trained: a big model's host copy takes half the memory */
    m.grads = NULL;
    model_point_units(&m, m.params, NULL);
    HfClass cls = hf_class(&m.c);
    /* A sigmoid router (scores sigmoid(z), top k, renormalised) is DeepSeek-V3's, whose class
     * also brings its own attention (MLA), which cannot express this model's. */
    if (m.c.moe_experts > 0 && m.c.moe_router_sigmoid)
        die(EXIT_BAD_INPUT,
            "export: moe_router=sigmoid has no Hugging Face model class here (Mixtral and Qwen2-MoE route by a "
            "softmax; DeepSeek-V3's sigmoid router comes with its own attention): %s cannot be exported",
            c->checkpoint);
    /* selection biases change which experts a token gets, and neither class has them */
    if (m.c.moe_experts > 0 && (h.flags & CKPT_MOE_BIAS))
        die(EXIT_BAD_INPUT,
            "export: %s routes with expert selection biases (moe_bias_balance), which Mixtral and Qwen2-MoE cannot "
            "express",
            c->checkpoint);
    snprintf(enc, sizeof enc, "%s/encoder.json", c->tokenizer_dir);
    snprintf(bpe, sizeof bpe, "%s/vocab.bpe", c->tokenizer_dir);
    Tokenizer *tok = tokenizer_load(enc, bpe, err, sizeof err);
    if (!tok) die(EXIT_BAD_INPUT, "%s", err);
    if (m.V != tokenizer_vocab_size(tok))
        die(EXIT_BAD_INPUT, "checkpoint %s has vocab_size=%d; the GPT-2 tokenizer it would be exported with has %d",
            c->checkpoint, m.V, tokenizer_vocab_size(tok));
    tokenizer_free(tok);
    make_out_dir(c->out);

    printf("exporting %s (step %d) to %s as a Hugging Face %s:\n", c->checkpoint, h.step, c->out, HF_NAME[cls]);
    if (cls != HF_LLAMA) print_moe(&m, cls);
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
    if (cls != HF_LLAMA) write_tokenizer_json(c->out, enc, bpe);

    char path[1200];
    snprintf(path, sizeof path, "%s/model.safetensors", c->out);
    size_t zeros;
    size_t bytes = write_weights(&m, cls, path, &zeros);
    char extra[64] = "";
    if (zeros) snprintf(extra, sizeof extra, " and %zu zeros of the class's own", zeros);
    printf("  %-24s %zu bytes (%zu fp32 parameters%s%s)\n", "model.safetensors", bytes, m.n_params, extra,
           m.c.tie_embeddings ? ", lm_head tied to embed_tokens" : "");

    /* config.json last: a folder that has it has every file. */
    if (cls != HF_LLAMA) n = moe_config(&m, &h, cls, json, sizeof json);
    else
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
