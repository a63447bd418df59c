#include "checkpoint.h"
#include <errno.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "util.h"

void ckpt_model_config(const CkptHeader *h, ModelConfig *c) {
    *c = (ModelConfig){h->vocab_size, h->embed_dim, h->n_heads, h->n_layers, h->context_len, h->tie_embeddings};
}

/* Calls fn on each tensor's flat slice in model order: the unpadded file order. */
typedef int (*SliceFn)(float *p, size_t n, void *ctx);
static int for_each_tensor(const Model *m, float *base, SliceFn fn, void *ctx) {
    TensorInfo t[8 + 7 * 4096];
    int nt = model_tensors(m, t, (int)(sizeof t / sizeof t[0]));
    for (int i = 0; i < nt; i++)
        if (fn(base + t[i].offset, (size_t)t[i].rows * t[i].cols, ctx)) return -1;
    return 0;
}

typedef struct { FILE *f; AtomicFile *out; uint64_t hash; } Stream;

static int write_slice(float *p, size_t n, void *ctx) {
    Stream *s = ctx;
    s->hash = fnv1a64(p, n * sizeof(float), s->hash);
    atomic_write(s->out, p, n * sizeof(float));
    return s->out->err_no ? -1 : 0;
}

static int read_slice(float *p, size_t n, void *ctx) {
    Stream *s = ctx;
    if (fread(p, sizeof(float), n, s->f) != n) return -1;
    s->hash = fnv1a64(p, n * sizeof(float), s->hash);
    return 0;
}

int ckpt_save(const char *path, const CkptHeader *h0, const Model *m, const AdamState *opt, char *err, size_t errlen) {
    CkptHeader h = *h0;
    memcpy(h.magic, CKPT_MAGIC, 8);
    h.version = CKPT_VERSION;
    h.header_bytes = sizeof h;
    h.n_params = m->n_params;
    h.has_optim = opt != NULL;
    AtomicFile out;
    if (atomic_open(&out, path, err, errlen)) return -1;
    Stream s = {NULL, &out, FNV1A64_INIT};
    s.hash = fnv1a64(&h, sizeof h, s.hash);
    atomic_write(&out, &h, sizeof h);
    for_each_tensor(m, m->params, write_slice, &s);
    if (opt) {
        for_each_tensor(m, opt->m, write_slice, &s);
        for_each_tensor(m, opt->v, write_slice, &s);
    }
    atomic_write(&out, &s.hash, sizeof s.hash);
    return atomic_commit(&out, err, errlen);
}

static long long file_size(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 ? (long long)st.st_size : -1;
}

int ckpt_read_header(const char *path, CkptHeader *h, char *err, size_t errlen) {
    FILE *f = fopen(path, "rb");
    if (!f) return set_err(err, errlen, "cannot open checkpoint %s: %s", path, strerror(errno));
    size_t got = fread(h, 1, sizeof *h, f);
    fclose(f);
    if (got < 8 || memcmp(h->magic, CKPT_MAGIC, 8))
        return set_err(err, errlen, "%s is not a meshtrain checkpoint", path);
    if (got != sizeof *h) return set_err(err, errlen, "checkpoint %s is truncated (no complete header)", path);
    if (h->version != CKPT_VERSION || h->header_bytes != sizeof *h)
        return set_err(err, errlen, "checkpoint %s has version %u; this meshtrain reads version %d", path, h->version,
                       CKPT_VERSION);
    if (h->vocab_size < 2 || h->embed_dim < 2 || h->n_heads < 1 || h->n_layers < 1 || h->context_len < 1 ||
        h->embed_dim % h->n_heads || h->step < 0 || h->adam_step < 0 || h->batch_size < 1)
        return set_err(err, errlen, "checkpoint %s has an invalid header", path);
    ModelConfig c;
    ckpt_model_config(h, &c);
    if (h->n_params != model_param_count(&c))
        return set_err(err, errlen, "checkpoint %s: header holds %llu parameters, its config needs %zu", path,
                       (unsigned long long)h->n_params, model_param_count(&c));
    long long want = (long long)sizeof *h + (long long)h->n_params * 4 * (h->has_optim ? 3 : 1) + 8;
    long long have = file_size(path);
    if (have != want)
        return set_err(err, errlen, "checkpoint %s is %s: %lld bytes, expected %lld", path,
                       have < want ? "truncated" : "too long", have, want);
    return 0;
}

int ckpt_load(const char *path, CkptHeader *h, Model *m, AdamState *opt, char *err, size_t errlen) {
    if (ckpt_read_header(path, h, err, errlen)) return -1;
    if (m->n_params != h->n_params) return set_err(err, errlen, "checkpoint %s does not match the model", path);
    if (opt && !h->has_optim) return set_err(err, errlen, "checkpoint %s holds no optimizer state", path);
    FILE *f = fopen(path, "rb");
    if (!f) return set_err(err, errlen, "cannot open checkpoint %s: %s", path, strerror(errno));
    Stream s = {f, NULL, FNV1A64_INIT};
    CkptHeader hh;
    int bad = fread(&hh, sizeof hh, 1, f) != 1;
    s.hash = fnv1a64(&hh, sizeof hh, s.hash);
    if (!bad) bad = for_each_tensor(m, m->params, read_slice, &s);
    if (!bad && h->has_optim) {
        /* The moments are read (and hashed) even when not wanted, to verify the file. */
        AdamState tmp = {0};
        AdamState *o = opt;
        if (!o) { adam_alloc(&tmp, m->n_flat); o = &tmp; }
        bad = for_each_tensor(m, o->m, read_slice, &s) || for_each_tensor(m, o->v, read_slice, &s);
        if (o == &tmp) adam_free(&tmp);
    }
    uint64_t stored = 0;
    if (!bad) bad = fread(&stored, sizeof stored, 1, f) != 1;
    fclose(f);
    if (bad) return set_err(err, errlen, "checkpoint %s is truncated", path);
    if (stored != s.hash) return set_err(err, errlen, "checkpoint %s is corrupt (checksum mismatch)", path);
    if (opt) opt->step = h->adam_step;
    return 0;
}
