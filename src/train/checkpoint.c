#include "checkpoint.h"
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "util.h"

typedef unsigned long long ull;
enum { PATH_BUF = 4300, NAME_MAX_LEN = 4096, MAX_SHARDS = 1 << 20 };
#define CHUNK_FLOATS ((uint64_t)1 << 24)  /* values read at a time: bounds the loader's buffer */

void ckpt_model_config(const CkptHeader *h, ModelConfig *c) {
    *c = (ModelConfig){h->vocab_size, h->embed_dim, h->n_heads, h->n_layers, h->context_len, h->tie_embeddings,
                       h->moe_experts, h->moe_top_k, h->moe_expert_dim, h->moe_shared_experts, h->moe_every,
                       h->moe_router_sigmoid, h->moe_capacity_factor};
    if (c->moe_experts <= 0) c->moe_experts = 0, c->moe_every = 1;
}

int ckpt_full_ranges(const Model *m, float *params, float *mom1, float *mom2, StateRange *out, int max) {
    if (max < m->n_units) return -1;
    uint64_t packed = 0;
    for (int u = 0; u < m->n_units; u++) {
        size_t o = m->units[u].offset;
        out[u] = (StateRange){packed, m->units[u].n, params ? params + o : NULL, mom1 ? mom1 + o : NULL,
                              mom2 ? mom2 + o : NULL};
        packed += m->units[u].n;
    }
    return m->n_units;
}

/* ---- names ---- */

static const char *base_name(const char *path) {
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

/* "<dir of path>/<base>.s<step>.r<rank>-of-<world>": shards live beside their manifest. */
static int shard_path(char *out, size_t len, const char *path, const char *base, int step, int rank, int world) {
    int n = snprintf(out, len, "%.*s%s.s%08d.r%d-of-%d", (int)(base_name(path) - path), path, base, step, rank, world);
    return n < 0 || (size_t)n >= len ? -1 : 0;
}

/* After a new manifest is committed: removes the shards (and stale temporaries) of every
 * other checkpoint written at path. Failures only leave garbage behind, so they are ignored. */
static void remove_stale_shards(const char *path, int step, int world) {
    const char *base = base_name(path);
    size_t blen = strlen(base);
    int dlen = (int)(base - path);
    char dir[PATH_BUF], full[PATH_BUF];
    snprintf(dir, sizeof dir, "%.*s", dlen ? dlen : 1, dlen ? path : ".");
    DIR *d = opendir(dir);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        int s, r, w, n = 0;
        if (strncmp(e->d_name, base, blen)) continue;
        /* the settings, router biases and loss scaler a run wrote with an earlier checkpoint
         * (ckpt_write_settings, ckpt_write_moe_bias, ckpt_write_loss_scale, ckpt_write_grad_ef) */
        static const char *const beside[] = {".s%d.settings%n", ".s%d.moebias%n", ".s%d.lossscale%n", ".s%d.ef%*d%n",
                                             ".s%d.stash%*d%n"};
        int other = 0;
        for (int k = 0; k < 5 && !other; k++) {
            n = 0;  /* (set only where the whole pattern matched) */
            other = sscanf(e->d_name + blen, beside[k], &s, &n) == 1 && n > 0 && s != step &&
                    (!e->d_name[blen + n] || !strncmp(e->d_name + blen + n, ".tmp.", 5));
        }
        if (other) {
            if (snprintf(full, sizeof full, "%.*s%s", dlen, path, e->d_name) < (int)sizeof full) unlink(full);
            continue;
        }
        n = 0;
        if (sscanf(e->d_name + blen, ".s%d.r%d-of-%d%n", &s, &r, &w, &n) != 3) continue;
        const char *rest = e->d_name + blen + n;
        int tmp = !strncmp(rest, ".tmp.", 5);
        if ((*rest && !tmp) || (!tmp && s == step && w == world && r >= 0 && r < world)) continue;
        if (snprintf(full, sizeof full, "%.*s%s", dlen, path, e->d_name) < (int)sizeof full) unlink(full);
    }
    if (d) closedir(d);
}

int ckpt_write_settings(const char *path, int step, const char *text, char *err, size_t errlen) {
    char name[PATH_BUF];
    int n = snprintf(name, sizeof name, "%s.s%08d.settings", path, step);
    if (n < 0 || (size_t)n >= sizeof name) return set_err(err, errlen, "checkpoint path too long: %s", path);
    return write_file_atomic(name, text, strlen(text), err, errlen);
}

#define GRAD_EF_MAGIC "MTGREF01"
typedef struct { char magic[8]; int32_t rank, world, kind, reserved; uint64_t n_e, n_f; } GradEfHead;

static int grad_ef_path(char *name, size_t len, const char *path, int step, int rank) {
    int n = snprintf(name, len, "%s.s%08d.ef%d", path, step, rank);
    return n < 0 || (size_t)n >= len ? -1 : 0;
}

int ckpt_write_grad_ef(const char *path, int step, int rank, int world, int kind, const float *e, size_t n_e,
                       const float *f, size_t n_f, char *err, size_t errlen) {
    char name[PATH_BUF];
    if (grad_ef_path(name, sizeof name, path, step, rank)) return set_err(err, errlen, "checkpoint path too long: %s", path);
    GradEfHead hd = {GRAD_EF_MAGIC, rank, world, kind, 0, n_e, n_f};
    size_t bytes = sizeof hd + (n_e + n_f) * sizeof(float) + 8;
    char *buf = xmalloc(bytes);
    memcpy(buf, &hd, sizeof hd);
    memcpy(buf + sizeof hd, e, n_e * sizeof(float));
    memcpy(buf + sizeof hd + n_e * sizeof(float), f, n_f * sizeof(float));
    uint64_t hash = fnv1a64(buf, bytes - 8, FNV1A64_INIT);
    memcpy(buf + bytes - 8, &hash, 8);
    int rc = write_file_atomic(name, buf, bytes, err, errlen);
    free(buf);
    return rc;
}

int ckpt_load_grad_ef(const char *path, const CkptHeader *h, int rank, int world, int kind, float *e, size_t n_e,
                      float *f, size_t n_f, char *err, size_t errlen) {
    if (!(h->flags & CKPT_GRAD_EF) || (int)h->world != world) return 0;
    char name[PATH_BUF], msg[512];
    if (grad_ef_path(name, sizeof name, path, h->step, rank))
        return set_err(err, errlen, "checkpoint path too long: %s", path);
    size_t len;
    char *buf = read_file(name, &len, msg, sizeof msg);
    if (!buf) return set_err(err, errlen, "checkpoint %s keeps its gradient compression's residuals beside it, but %s",
                             path, msg);
    GradEfHead hd;
    memset(&hd, 0, sizeof hd);
    uint64_t hash = 0;
    if (len >= sizeof hd + 8) memcpy(&hd, buf, sizeof hd), memcpy(&hash, buf + len - 8, 8);
    int bad = len < sizeof hd + 8 || memcmp(hd.magic, GRAD_EF_MAGIC, 8) || hd.rank != rank || hd.world != world ||
              len != sizeof hd + (hd.n_e + hd.n_f) * sizeof(float) + 8 || hash != fnv1a64(buf, len - 8, FNV1A64_INIT);
    int same = !bad && hd.kind == kind && hd.n_e == n_e && hd.n_f == n_f;
    if (same) {
        memcpy(e, buf + sizeof hd, n_e * sizeof(float));
        memcpy(f, buf + sizeof hd + n_e * sizeof(float), n_f * sizeof(float));
    }
    free(buf);
    if (bad) return set_err(err, errlen, "%s (rank %d's gradient compression residuals of checkpoint %s) is corrupt", name,
                            rank, path);
    return same;
}

static size_t pread_all(int fd, void *buf, size_t n, uint64_t off);
#define STASH_MAGIC "MTSTSH01"
typedef struct { char magic[8]; int32_t rank, world; uint64_t bytes; } StashHead;

static int stash_path(char *name, size_t len, const char *path, int step, int rank) {
    int n = snprintf(name, len, "%s.s%08d.stash%d", path, step, rank);
    return n < 0 || (size_t)n >= len ? -1 : 0;
}

static size_t sum_bytes(const size_t *bytes, int n) {
    size_t t = 0;
    for (int i = 0; i < n; i++) t += bytes[i];
    return t;
}

int ckpt_write_stash(const char *path, int step, int rank, int world, void *const *piece, const size_t *bytes, int n,
                     char *err, size_t errlen) {
    char name[PATH_BUF];
    if (stash_path(name, sizeof name, path, step, rank)) return set_err(err, errlen, "checkpoint path too long: %s", path);
    StashHead hd = {STASH_MAGIC, rank, world, sum_bytes(bytes, n)};
    AtomicFile f;
    if (atomic_open(&f, name, err, errlen)) return -1;
    uint64_t hash = fnv1a64(&hd, sizeof hd, FNV1A64_INIT);
    atomic_write(&f, &hd, sizeof hd);
    for (int i = 0; i < n; i++) {
        hash = fnv1a64(piece[i], bytes[i], hash);
        atomic_write(&f, piece[i], bytes[i]);
    }
    atomic_write(&f, &hash, 8);
    return atomic_commit(&f, err, errlen);
}

int ckpt_load_stash(const char *path, const CkptHeader *h, int rank, int world, void *const *piece,
                    const size_t *bytes, int n, char *err, size_t errlen) {
    if (!(h->flags & (CKPT_2BW | CKPT_PIPEDREAM))) return 0;
    const char *kind = h->flags & CKPT_2BW ? "2bw" : "pipedream";
    if ((int)h->world != world)
        return set_err(err, errlen, "checkpoint %s was saved by pipeline_schedule=%s on %d ranks: its weight versions "
                       "before the newest are each rank's, so it resumes with %s on %d ranks only", path, kind, h->world,
                       kind, h->world);
    char name[PATH_BUF];
    if (stash_path(name, sizeof name, path, h->step, rank)) return set_err(err, errlen, "checkpoint path too long: %s", path);
    int fd = open(name, O_RDONLY);
    if (fd < 0)
        return set_err(err, errlen, "checkpoint %s keeps %s's weight versions before the newest beside it, but %s: %s", path, kind, name,
                       strerror(errno));
    StashHead hd;
    memset(&hd, 0, sizeof hd);
    size_t total = sum_bytes(bytes, n);
    uint64_t off = sizeof hd, hash, want = 0;
    int bad = pread_all(fd, &hd, sizeof hd, 0) != sizeof hd || memcmp(hd.magic, STASH_MAGIC, 8) || hd.rank != rank ||
              hd.world != world || hd.bytes != total;
    hash = fnv1a64(&hd, sizeof hd, FNV1A64_INIT);
    for (int i = 0; i < n && !bad; i++) {
        bad = pread_all(fd, piece[i], bytes[i], off) != bytes[i];
        hash = fnv1a64(piece[i], bytes[i], hash);
        off += bytes[i];
    }
    bad = bad || pread_all(fd, &want, 8, off) != 8 || want != hash;
    close(fd);
    return bad ? set_err(err, errlen, "%s (rank %d's %s weight versions of checkpoint %s) is corrupt or of another "
                         "layout", name, rank, kind, path)
               : 1;
}

#define MOE_BIAS_MAGIC "MTMOEB01"
static int moe_bias_path(char *name, size_t len, const char *path, int step) {
    int n = snprintf(name, len, "%s.s%08d.moebias", path, step);
    return n < 0 || (size_t)n >= len ? -1 : 0;
}

int ckpt_write_moe_bias(const char *path, int step, const float *bias, int n_moe, int X, char *err, size_t errlen) {
    char name[PATH_BUF];
    if (moe_bias_path(name, sizeof name, path, step)) return set_err(err, errlen, "checkpoint path too long: %s", path);
    size_t vals = (size_t)n_moe * X, bytes = 8 + 2 * sizeof(int32_t) + vals * sizeof(float) + 8;
    char *buf = xmalloc(bytes);
    int32_t shape[2] = {n_moe, X};
    memcpy(buf, MOE_BIAS_MAGIC, 8);
    memcpy(buf + 8, shape, sizeof shape);
    memcpy(buf + 16, bias, vals * sizeof(float));
    uint64_t hash = fnv1a64(buf, bytes - 8, FNV1A64_INIT);
    memcpy(buf + bytes - 8, &hash, 8);
    int rc = write_file_atomic(name, buf, bytes, err, errlen);
    free(buf);
    return rc;
}

int ckpt_load_moe_bias(const char *path, const CkptHeader *h, Model *m, char *err, size_t errlen) {
    if (!(h->flags & CKPT_MOE_BIAS) || !m->n_moe) return 0;
    char name[PATH_BUF], e[512];
    if (moe_bias_path(name, sizeof name, path, h->step)) return set_err(err, errlen, "checkpoint path too long: %s", path);
    int n_moe = m->n_moe, X = m->X;
    size_t len, vals = (size_t)n_moe * X, want = 8 + 2 * sizeof(int32_t) + vals * sizeof(float) + 8;
    char *buf = read_file(name, &len, e, sizeof e);
    if (!buf) return set_err(err, errlen, "checkpoint %s keeps its MoE router biases beside it, but %s", path, e);
    int32_t shape[2] = {0, 0};
    uint64_t hash = 0;
    if (len == want) memcpy(shape, buf + 8, sizeof shape), memcpy(&hash, buf + len - 8, 8);
    int bad = len != want || memcmp(buf, MOE_BIAS_MAGIC, 8) || shape[0] != n_moe || shape[1] != X ||
              hash != fnv1a64(buf, len - 8, FNV1A64_INIT);
    if (!bad) {
        if (!m->moe_bias) model_moe_alloc(m, 1);
        memcpy(m->moe_bias_host, buf + 16, vals * sizeof(float));
        model_moe_set_bias(m, m->moe_bias_host);
    }
    free(buf);
    return bad ? set_err(err, errlen, "%s (the MoE router biases of checkpoint %s) is corrupt or of another model", name,
                         path)
               : 0;
}

/* The loss scaler's file: the keys (kind: LossScaleKind), then the state. */
#define LOSS_SCALE_MAGIC "MTLSCL01"
typedef struct {
    char magic[8];
    int32_t kind, window, hysteresis;
    int32_t growth, hysteresis_left, skipped;
    float scale;
    int32_t reserved;
    double init, min;
    uint64_t hash;  /* FNV-1a of everything before */
} LossScaleFile;
_Static_assert(sizeof(LossScaleFile) == 64, "loss scale file layout");

static int loss_scale_path(char *name, size_t len, const char *path, int step) {
    int n = snprintf(name, len, "%s.s%08d.lossscale", path, step);
    return n < 0 || (size_t)n >= len ? -1 : 0;
}

int ckpt_write_loss_scale(const char *path, int step, const LossScaler *s, char *err, size_t errlen) {
    char name[PATH_BUF];
    if (loss_scale_path(name, sizeof name, path, step)) return set_err(err, errlen, "checkpoint path too long: %s", path);
    LossScaleFile f;
    memset(&f, 0, sizeof f);
    memcpy(f.magic, LOSS_SCALE_MAGIC, 8);
    f.kind = (int32_t)s->c.kind, f.window = s->c.window, f.hysteresis = s->c.hysteresis;
    f.growth = s->growth, f.hysteresis_left = s->hysteresis, f.skipped = s->skipped;
    f.scale = s->scale;
    f.init = s->c.init, f.min = s->c.min;
    f.hash = fnv1a64(&f, offsetof(LossScaleFile, hash), FNV1A64_INIT);
    return write_file_atomic(name, &f, sizeof f, err, errlen);
}

int ckpt_load_loss_scale(const char *path, const CkptHeader *h, LossScaler *s, char *err, size_t errlen) {
    if (!(h->flags & CKPT_LOSS_SCALE)) return 0;
    char name[PATH_BUF], e[512];
    if (loss_scale_path(name, sizeof name, path, h->step)) return set_err(err, errlen, "checkpoint path too long: %s", path);
    size_t len;
    char *buf = read_file(name, &len, e, sizeof e);
    if (!buf) return set_err(err, errlen, "checkpoint %s keeps its loss scaler beside it, but %s", path, e);
    LossScaleFile f;
    memset(&f, 0, sizeof f);
    if (len == sizeof f) memcpy(&f, buf, sizeof f);
    free(buf);
    if (len != sizeof f || memcmp(f.magic, LOSS_SCALE_MAGIC, 8) || f.hash != fnv1a64(&f, offsetof(LossScaleFile, hash), FNV1A64_INIT) ||
        f.kind <= LOSS_SCALE_NONE || f.kind > LOSS_SCALE_DYNAMIC || f.window < 1 || f.hysteresis < 1 || f.growth < 0 ||
        f.hysteresis_left < 0 || f.skipped < 0 || !(f.scale > 0) || !(f.init > 0) || !(f.min > 0))
        return set_err(err, errlen, "%s (the loss scaler of checkpoint %s) is corrupt", name, path);
    *s = (LossScaler){{(LossScaleKind)f.kind, f.init, f.min, f.window, f.hysteresis}, f.scale, f.growth,
                      f.hysteresis_left, f.skipped, 0};
    return 1;
}

/* ---- reading ---- */

static size_t pread_all(int fd, void *buf, size_t n, uint64_t off) {
    size_t done = 0;
    while (done < n) {
        ssize_t r = pread(fd, (char *)buf + done, n - done, (off_t)(off + done));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        done += (size_t)r;
    }
    return done;
}

static uint64_t fd_size(int fd) {
    struct stat st;
    return fstat(fd, &st) == 0 ? (uint64_t)st.st_size : 0;
}

static int header_invalid(const CkptHeader *h) {
    if (h->vocab_size < 2 || h->embed_dim < 2 || h->n_heads < 1 || h->n_layers < 1 || h->context_len < 1 ||
        h->embed_dim % h->n_heads || h->step < 0 || h->adam_step < 0 || h->batch_size < 1 || h->optimizer < 0 ||
        h->optimizer > OPTIM_ADAFACTOR)
        return 1;
    ModelConfig c;
    ckpt_model_config(h, &c);
    return model_moe_check(&c, NULL, 0) != 0;
}

static int size_err(char *err, size_t errlen, const char *what, const char *path, uint64_t have, uint64_t want) {
    return set_err(err, errlen, "%s %s is %s: %llu bytes, expected %llu", what, path,
                   have < want ? "truncated" : "too long", (ull)have, (ull)want);
}

static int parse_manifest(int fd, const char *path, CkptHeader *h, CkptShardEntry **shards, char *base, char *err,
                          size_t errlen) {
    size_t got = pread_all(fd, h, sizeof *h, 0);
    if (got < 8 || memcmp(h->magic, CKPT_MAGIC, 8))
        return set_err(err, errlen, "%s is not a meshtrain checkpoint", path);
    if (got != sizeof *h) return set_err(err, errlen, "checkpoint %s is truncated (no complete header)", path);
    if (h->version != CKPT_VERSION)
        return set_err(err, errlen, "checkpoint %s has version %u; this meshtrain reads version %d", path, h->version,
                       CKPT_VERSION);
    if (h->header_bytes != sizeof *h)  /* (the version's own header has one size: corrupt) */
        return set_err(err, errlen, "checkpoint %s has an invalid header (%u header bytes, expected %zu)", path,
                       h->header_bytes, sizeof *h);
    if (header_invalid(h) || h->world < 1 || h->world > MAX_SHARDS || h->name_len < 1 || h->name_len > NAME_MAX_LEN)
        return set_err(err, errlen, "checkpoint %s has an invalid header", path);
    ModelConfig c;
    ckpt_model_config(h, &c);
    if (h->n_params != model_param_count(&c))
        return set_err(err, errlen, "checkpoint %s: header holds %llu parameters, its config needs %zu", path,
                       (ull)h->n_params, model_param_count(&c));
    size_t table = (size_t)h->world * sizeof(CkptShardEntry), rest = table + h->name_len + 8;
    uint64_t have = fd_size(fd);
    if (have != sizeof *h + rest) return size_err(err, errlen, "checkpoint", path, have, sizeof *h + rest);
    unsigned char *buf = xmalloc(rest);
    uint64_t stored = 0, total = 0;
    int rc = 0;
    if (pread_all(fd, buf, rest, sizeof *h) != rest) rc = set_err(err, errlen, "cannot read checkpoint %s", path);
    uint64_t hash = fnv1a64(buf, rest - 8, fnv1a64(h, sizeof *h, FNV1A64_INIT));
    memcpy(&stored, buf + rest - 8, 8);
    if (!rc && stored != hash) rc = set_err(err, errlen, "checkpoint %s is corrupt (checksum mismatch)", path);
    if (!rc) {
        *shards = xmalloc(table);
        memcpy(*shards, buf, table);
        memcpy(base, buf + table, h->name_len);
        base[h->name_len] = 0;
        for (int s = 0; s < h->world; s++)
            total += (*shards)[s].n_values <= h->n_params ? (*shards)[s].n_values : h->n_params + 1;
        if (strlen(base) != h->name_len || strchr(base, '/') || total != h->n_params)
            rc = set_err(err, errlen, "checkpoint %s has an invalid shard list", path);
    }
    free(buf);
    return rc;
}

/* Reads and checks the manifest; hands out its shard list and base name when asked. */
static int read_manifest(const char *path, CkptHeader *h, CkptShardEntry **shards, char *base, char *err,
                         size_t errlen) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) return set_err(err, errlen, "cannot open checkpoint %s: %s", path, strerror(errno));
    CkptShardEntry *s = NULL;
    char b[NAME_MAX_LEN + 1];
    int rc = parse_manifest(fd, path, h, &s, base ? base : b, err, errlen);
    close(fd);
    if (rc || !shards) free(s);
    else *shards = s;
    return rc;
}

int ckpt_read_header(const char *path, CkptHeader *h, char *err, size_t errlen) {
    return read_manifest(path, h, NULL, NULL, err, errlen);
}

/* Checks shard `rank` of checkpoint h (manifest `ck`): its header, its table's checksum and
 * bounds, its length, and, given `want`, that it is the very file the manifest recorded. */
static int check_shard(int fd, const char *ck, const char *name, const CkptHeader *h, int rank,
                       const CkptShardEntry *want, CkptShardEntry *got, CkptRange **table, char *err, size_t errlen) {
    CkptShardHeader sh;
    uint64_t size = fd_size(fd);
    size_t n = pread_all(fd, &sh, sizeof sh, 0);
    if (n < 8 || memcmp(sh.magic, CKPT_SHARD_MAGIC, 8))
        return set_err(err, errlen, "checkpoint %s: %s is not a meshtrain checkpoint shard", ck, name);
    if (n < sizeof sh || size < sizeof sh + 8)
        return size_err(err, errlen, "checkpoint shard", name, size, sizeof sh + 8);
    if (sh.version != CKPT_VERSION)
        return set_err(err, errlen, "checkpoint %s: shard %s has version %u", ck, name, sh.version);
    if (sh.step != h->step)
        return set_err(err, errlen, "checkpoint %s: shard %s is from step %d, the manifest from step %d", ck, name,
                       sh.step, h->step);
    if (sh.rank != (uint32_t)rank || sh.world != (uint32_t)h->world || sh.has_optim != (uint32_t)h->has_optim)
        return set_err(err, errlen, "checkpoint %s: shard %s belongs to another checkpoint", ck, name);
    uint64_t meta = sizeof sh + 8;
    if (sh.n_ranges > (size - meta) / sizeof(CkptRange))
        return set_err(err, errlen, "checkpoint shard %s is truncated (in its range table)", name);
    size_t tbytes = (size_t)sh.n_ranges * sizeof(CkptRange);
    meta += tbytes;
    CkptRange *t = *table = xmalloc(tbytes);
    uint64_t stored = 0, hash;
    if (pread_all(fd, t, tbytes, sizeof sh) != tbytes || pread_all(fd, &stored, 8, sizeof sh + tbytes) != 8)
        return set_err(err, errlen, "cannot read checkpoint shard %s", name);
    hash = fnv1a64(t, tbytes, fnv1a64(&sh, sizeof sh, FNV1A64_INIT));
    if (hash != stored) return set_err(err, errlen, "checkpoint shard %s is corrupt (checksum mismatch)", name);
    if (want && (hash != want->meta_hash || sh.n_ranges != want->n_ranges))
        return set_err(err, errlen, "checkpoint %s: shard %s is not the one its manifest recorded", ck, name);
    uint64_t total = 0;
    for (uint64_t i = 0; i < sh.n_ranges; i++) {
        if (t[i].start > h->n_params || t[i].count > h->n_params - t[i].start || t[i].count > h->n_params - total)
            return set_err(err, errlen, "checkpoint shard %s holds a range outside the model", name);
        total += t[i].count;
    }
    if (total != sh.n_values) return set_err(err, errlen, "checkpoint shard %s has an invalid header", name);
    uint64_t expect = meta + total * sizeof(float) * (h->has_optim ? 3 : 1);
    if (size != expect) return size_err(err, errlen, "checkpoint shard", name, size, expect);
    *got = (CkptShardEntry){size, hash, total, sh.n_ranges};
    return 0;
}

static int open_shard(const char *ck, const char *name, const CkptHeader *h, int rank, const CkptShardEntry *want,
                      CkptShardEntry *got, CkptRange **table, int *fd_out, char *err, size_t errlen) {
    int fd = open(name, O_RDONLY);
    if (fd < 0 && errno == ENOENT) return set_err(err, errlen, "checkpoint %s: shard %s is missing", ck, name);
    if (fd < 0) return set_err(err, errlen, "checkpoint %s: cannot open shard %s: %s", ck, name, strerror(errno));
    *table = NULL;
    if (check_shard(fd, ck, name, h, rank, want, got, table, err, errlen)) {
        close(fd);
        free(*table);
        return -1;
    }
    *fd_out = fd;
    return 0;
}

static int overlaps(uint64_t a, uint64_t an, uint64_t b, uint64_t bn) { return a < b + bn && b < a + an; }

/* Reads one shard range whole, section by section (params, m, v), CHUNK_FLOATS at a time;
 * copies what overlaps the needed ranges and verifies each section's checksum. */
static int load_range(int fd, const char *name, uint64_t off, const CkptRange *t, const StateRange *need, int n_need,
                      int sections, uint64_t *covered, char *err, size_t errlen) {
    uint64_t chunk = t->count < CHUNK_FLOATS ? t->count : CHUNK_FLOATS;
    float *buf = xmalloc((size_t)chunk * sizeof(float));
    const uint64_t want[3] = {t->hash_params, t->hash_m, t->hash_v};
    int rc = 0;
    for (int s = 0; s < sections && !rc; s++) {
        uint64_t hash = FNV1A64_INIT;
        for (uint64_t c0 = 0; c0 < t->count && !rc; c0 += chunk) {
            uint64_t n = t->count - c0 < chunk ? t->count - c0 : chunk, lo0 = t->start + c0;
            size_t bytes = (size_t)n * sizeof(float);
            if (pread_all(fd, buf, bytes, off + ((uint64_t)s * t->count + c0) * sizeof(float)) != bytes) {
                rc = set_err(err, errlen, "cannot read checkpoint shard %s", name);
                break;
            }
            hash = fnv1a64(buf, bytes, hash);
            for (int i = 0; i < n_need; i++) {
                const StateRange *r = &need[i];
                if (!overlaps(lo0, n, r->start, r->count)) continue;
                uint64_t lo = lo0 > r->start ? lo0 : r->start;
                uint64_t hi = lo0 + n < r->start + r->count ? lo0 + n : r->start + r->count;
                float *dst = s == 0 ? r->params : s == 1 ? r->m : r->v;
                if (!dst) continue;  /* a range that wants params only */
                memcpy(dst + (lo - r->start), buf + (lo - lo0), (size_t)(hi - lo) * sizeof(float));
                if (s == 0) covered[i] += hi - lo;
            }
        }
        if (!rc && hash != want[s])
            rc = set_err(err, errlen, "checkpoint shard %s is corrupt (checksum mismatch in values [%llu, %llu))",
                         name, (ull)t->start, (ull)(t->start + t->count));
    }
    free(buf);
    return rc;
}

int ckpt_load_dist(const char *path, CkptHeader *h, const StateRange *need, int n_need, int want_optim, char *err,
                   size_t errlen) {
    CkptShardEntry *shards = NULL;
    char base[NAME_MAX_LEN + 1];
    if (read_manifest(path, h, &shards, base, err, errlen)) return -1;
    int rc = 0;
    if (want_optim && !h->has_optim) rc = set_err(err, errlen, "checkpoint %s holds no optimizer state", path);
    for (int i = 0; i < n_need && !rc; i++) {
        const StateRange *r = &need[i];
        if (r->start > h->n_params || r->count > h->n_params - r->start ||
            (r->count && (!r->params || (want_optim && !r->m != !r->v))))
            rc = set_err(err, errlen, "checkpoint %s: needed range [%llu, +%llu) is outside its %llu values or has "
                         "no buffer", path, (ull)r->start, (ull)r->count, (ull)h->n_params);
    }
    uint64_t *covered = xcalloc((size_t)n_need + 1, sizeof *covered);
    int k = h->has_optim ? 3 : 1;
    for (int s = 0; s < h->world && !rc; s++) {
        char name[PATH_BUF];
        CkptRange *t;
        CkptShardEntry got;
        int fd;
        if (shard_path(name, sizeof name, path, base, h->step, s, h->world)) {
            rc = set_err(err, errlen, "checkpoint path too long: %s", path);
            break;
        }
        if ((rc = open_shard(path, name, h, s, &shards[s], &got, &t, &fd, err, errlen))) break;
        uint64_t off = sizeof(CkptShardHeader) + got.n_ranges * sizeof(CkptRange) + 8;
        for (uint64_t i = 0; i < got.n_ranges && !rc; i++) {
            int sections = 0;  /* 1: read its params; 3: its moments too */
            for (int j = 0; j < n_need; j++)
                if (overlaps(t[i].start, t[i].count, need[j].start, need[j].count) && sections < 3)
                    sections = want_optim && need[j].m ? 3 : 1;
            if (sections) rc = load_range(fd, name, off, &t[i], need, n_need, sections, covered, err, errlen);
            off += t[i].count * sizeof(float) * k;
        }
        close(fd);
        free(t);
    }
    for (int i = 0; i < n_need && !rc; i++)
        if (covered[i] != need[i].count)
            rc = set_err(err, errlen, "checkpoint %s does not hold values [%llu, %llu)", path, (ull)need[i].start,
                         (ull)(need[i].start + need[i].count));
    free(covered);
    free(shards);
    return rc;
}

/* ---- writing ---- */

/* The manifest's header: the caller's, checked, with the format fields filled in. */
static int manifest_header(const char *path, const CkptHeader *h, int world, CkptHeader *out, char *err,
                           size_t errlen) {
    size_t name_len = strlen(base_name(path));
    if (header_invalid(h)) return set_err(err, errlen, "checkpoint %s: invalid header (model config or step)", path);
    if (world < 1 || world > MAX_SHARDS) return set_err(err, errlen, "checkpoint %s: world of %d ranks", path, world);
    if (name_len < 1 || name_len > NAME_MAX_LEN) return set_err(err, errlen, "checkpoint path %s: bad file name", path);
    *out = *h;
    memcpy(out->magic, CKPT_MAGIC, 8);
    out->version = CKPT_VERSION;
    out->header_bytes = sizeof *out;
    out->world = world;
    out->has_optim = h->has_optim != 0;
    ModelConfig c;
    ckpt_model_config(h, &c);
    out->n_params = model_param_count(&c);
    out->name_len = (uint32_t)name_len;
    out->flags = h->flags & (CKPT_MOE_BIAS | CKPT_LOSS_SCALE | CKPT_GRAD_EF | CKPT_2BW | CKPT_PIPEDREAM);
    if (h->moe_experts <= 0) {  /* identical runs write identical manifests: a dense model's MoE fields are zero */
        out->moe_experts = out->moe_expert_dim = 0;
        out->moe_top_k = out->moe_shared_experts = out->moe_every = out->moe_router_sigmoid = 0;
        out->moe_capacity_factor = out->moe_aux_loss = out->moe_z_loss = out->moe_bias_balance = 0;
    }
    return 0;
}

int ckpt_write_rank_file(const char *path, const CkptHeader *h, int rank, int world, const StateRange *r, int n,
                         char *err, size_t errlen) {
    CkptHeader mh;
    char name[PATH_BUF];
    if (manifest_header(path, h, world, &mh, err, errlen)) return -1;
    if (rank < 0 || rank >= world || n < 0)
        return set_err(err, errlen, "checkpoint %s: rank %d of %d with %d ranges", path, rank, world, n);
    if (shard_path(name, sizeof name, path, base_name(path), mh.step, rank, world))
        return set_err(err, errlen, "checkpoint path too long: %s", path);
    int optim = mh.has_optim;
    CkptShardHeader sh = {.version = CKPT_VERSION, .rank = (uint32_t)rank, .world = (uint32_t)world,
                          .has_optim = (uint32_t)optim, .step = mh.step, .n_ranges = (uint64_t)n};
    memcpy(sh.magic, CKPT_SHARD_MAGIC, 8);
    CkptRange *t = xcalloc((size_t)n + 1, sizeof *t);
    int rc = 0;
    for (int i = 0; i < n && !rc; i++) {
        const StateRange *s = &r[i];
        size_t bytes = (size_t)s->count * sizeof(float);
        if (s->start > mh.n_params || s->count > mh.n_params - s->start ||
            (s->count && (!s->params || (optim && (!s->m || !s->v))))) {
            rc = set_err(err, errlen, "checkpoint %s: rank %d's range [%llu, +%llu) is outside the model's %llu "
                         "values or has no buffer", path, rank, (ull)s->start, (ull)s->count, (ull)mh.n_params);
            break;
        }
        t[i] = (CkptRange){s->start, s->count, fnv1a64(s->params, bytes, FNV1A64_INIT),
                           optim ? fnv1a64(s->m, bytes, FNV1A64_INIT) : 0,
                           optim ? fnv1a64(s->v, bytes, FNV1A64_INIT) : 0};
        sh.n_values += s->count;
    }
    AtomicFile f;
    if (!rc) rc = atomic_open(&f, name, err, errlen);
    if (!rc) {
        uint64_t hash = fnv1a64(t, (size_t)n * sizeof *t, fnv1a64(&sh, sizeof sh, FNV1A64_INIT));
        atomic_write(&f, &sh, sizeof sh);
        atomic_write(&f, t, (size_t)n * sizeof *t);
        atomic_write(&f, &hash, sizeof hash);
        for (int i = 0; i < n; i++) {
            size_t bytes = (size_t)r[i].count * sizeof(float);
            atomic_write(&f, r[i].params, bytes);
            if (optim) { atomic_write(&f, r[i].m, bytes); atomic_write(&f, r[i].v, bytes); }
        }
        rc = atomic_commit(&f, err, errlen);
    }
    free(t);
    return rc;
}

uint64_t ckpt_rank_file_bytes(uint64_t n_ranges, uint64_t n_values, int has_optim) {
    return sizeof(CkptShardHeader) + n_ranges * sizeof(CkptRange) + sizeof(uint64_t) +
           n_values * sizeof(float) * (has_optim ? 3 : 1);
}

uint64_t ckpt_manifest_bytes(const char *path, int world) {
    return sizeof(CkptHeader) + (uint64_t)world * sizeof(CkptShardEntry) + strlen(base_name(path)) + sizeof(uint64_t);
}

typedef struct { uint64_t start, count; } Span;
static int span_cmp(const void *a, const void *b) {
    uint64_t x = ((const Span *)a)->start, y = ((const Span *)b)->start;
    return (x > y) - (x < y);
}

int ckpt_write_manifest(const char *path, const CkptHeader *h, int world, char *err, size_t errlen) {
    CkptHeader mh;
    if (manifest_header(path, h, world, &mh, err, errlen)) return -1;
    const char *base = base_name(path);
    CkptShardEntry *e = xcalloc((size_t)world, sizeof *e);
    Span *all = NULL;
    size_t n_all = 0;
    int rc = 0;
    for (int s = 0; s < world && !rc; s++) {
        char name[PATH_BUF];
        CkptRange *t;
        int fd;
        if (shard_path(name, sizeof name, path, base, mh.step, s, world)) {
            rc = set_err(err, errlen, "checkpoint path too long: %s", path);
            break;
        }
        if ((rc = open_shard(path, name, &mh, s, NULL, &e[s], &t, &fd, err, errlen))) break;
        close(fd);
        all = xrealloc(all, (n_all + e[s].n_ranges + 1) * sizeof *all);
        for (uint64_t i = 0; i < e[s].n_ranges; i++) all[n_all++] = (Span){t[i].start, t[i].count};
        free(t);
    }
    /* The shards together must hold every value exactly once. */
    uint64_t end = 0;
    if (!rc) qsort(all, n_all, sizeof *all, span_cmp);
    for (size_t i = 0; i < n_all && !rc; i++) {
        if (all[i].count && all[i].start != end)
            rc = set_err(err, errlen, "checkpoint %s: the ranks' ranges %s at value %llu", path,
                         all[i].start < end ? "overlap" : "leave a gap", (ull)end);
        end += all[i].count;
    }
    if (!rc && end != mh.n_params)
        rc = set_err(err, errlen, "checkpoint %s: the ranks hold %llu values, the model has %llu", path, (ull)end,
                     (ull)mh.n_params);
    AtomicFile f;
    if (!rc) rc = atomic_open(&f, path, err, errlen);
    if (!rc) {
        uint64_t hash = fnv1a64(&mh, sizeof mh, FNV1A64_INIT);
        hash = fnv1a64(base, mh.name_len, fnv1a64(e, (size_t)world * sizeof *e, hash));
        atomic_write(&f, &mh, sizeof mh);
        atomic_write(&f, e, (size_t)world * sizeof *e);
        atomic_write(&f, base, mh.name_len);
        atomic_write(&f, &hash, sizeof hash);
        rc = atomic_commit(&f, err, errlen);
    }
    if (!rc) remove_stale_shards(path, mh.step, world);
    free(all);
    free(e);
    return rc;
}

/* Agreement: 1 on every rank if any rank failed. */
static int any_failed(const Comm *world, int failed) {
    comm_allreduce_max_int(world, &failed, 1);
    return failed;
}

int ckpt_save_dist(const char *path, const CkptHeader *h, const Comm *world, const StateRange *mine, int n_mine,
                   char *err, size_t errlen) {
    /* Every rank makes the same three collective calls whatever fails, so none is left waiting. */
    CkptHeader mh;
    int failed = manifest_header(path, h, world->size, &mh, err, errlen) != 0;
    double total = 0;
    for (int i = 0; i < n_mine; i++) total += (double)mine[i].count;
    comm_allreduce_double(world, &total, 1);
    if (!failed && total != (double)mh.n_params)
        failed = set_err(err, errlen, "checkpoint %s: the ranks hold %.0f values, the model has %llu", path, total,
                         (ull)mh.n_params) != 0;
    if (!failed) failed = ckpt_write_rank_file(path, h, world->rank, world->size, mine, n_mine, err, errlen) != 0;
    if (any_failed(world, failed))
        return failed ? -1 : set_err(err, errlen, "checkpoint %s: another rank failed to write its shard", path);
    if (world->rank == 0) failed = ckpt_write_manifest(path, h, world->size, err, errlen) != 0;
    /* Also the final barrier: no rank returns before the manifest and the clean-up are done. */
    if (any_failed(world, failed))
        return failed ? -1 : set_err(err, errlen, "checkpoint %s: rank 0 failed to write the manifest", path);
    return 0;
}

/* ---- a world of one ---- */

int ckpt_save(const char *path, const CkptHeader *h, const Model *m, const AdamState *opt, char *err, size_t errlen) {
    StateRange *r = xmalloc((size_t)m->n_units * sizeof *r);
    int n = ckpt_full_ranges(m, m->params, opt ? opt->m : NULL, opt ? opt->v : NULL, r, m->n_units);
    CkptHeader hh = *h;
    hh.has_optim = opt != NULL;
    Comm one = {.rank = 0, .size = 1, .impl = NULL, .name = "world"};
    int rc = ckpt_save_dist(path, &hh, &one, r, n, err, errlen);
    free(r);
    return rc;
}

int ckpt_load(const char *path, CkptHeader *h, Model *m, AdamState *opt, char *err, size_t errlen) {
    if (ckpt_read_header(path, h, err, errlen)) return -1;
    if (m->n_params != h->n_params) return set_err(err, errlen, "checkpoint %s does not match the model", path);
    StateRange *r = xmalloc((size_t)m->n_units * sizeof *r);
    int n = ckpt_full_ranges(m, m->params, opt ? opt->m : NULL, opt ? opt->v : NULL, r, m->n_units);
    int rc = ckpt_load_dist(path, h, r, n, opt != NULL, err, errlen);
    if (!rc && opt) opt->step = h->adam_step;
    free(r);
    return rc;
}

int ckpt_load_model(const char *path, CkptHeader *h, Model *m, char *err, size_t errlen) {
    if (ckpt_read_header(path, h, err, errlen)) return -1;
    ModelConfig mc;
    ckpt_model_config(h, &mc);
    model_init_layout(m, &mc, 1, 1);
    if (!ckpt_load(path, h, m, NULL, err, errlen) && !ckpt_load_moe_bias(path, h, m, err, errlen)) return 0;
    model_free(m);
    return -1;
}
