/* data — token shards (written atomically, mmapped and validated), TinyStories text ->
 * shards, and the data-parallel loader. */
#include "data.h"
#include "util.h"
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* Shards are mmapped and used in place, so the host byte order must be the file's. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "meshtrain shards are little-endian; big-endian hosts are not supported"
#endif

static const char SHARD_MAGIC[8] = {'M', 'T', 'S', 'H', 'A', 'R', 'D', '1'};

static void put_u32(unsigned char *p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i)); }
static void put_u64(unsigned char *p, uint64_t v) { for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i)); }
static uint32_t get_u32(const unsigned char *p) {
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}
static uint64_t get_u64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* ---------------------------------------------------------------- writing shards */

typedef struct { const uint16_t *p; size_t n; } TokSpan;

/* One shard from several token spans, without gathering them into one buffer first (a
 * full TinyStories shard is about a gigabyte). Same atomicity as write_file_atomic:
 * a temp file, fsync, rename, fsync of the directory. */
static int write_shard_spans(const char *path, const TokSpan *spans, size_t nspans, int vocab_size,
                             char *err, size_t errlen) {
    if (vocab_size < 1 || vocab_size > 65536)
        return set_err(err, errlen, "cannot write shard %s: vocab_size %d does not fit 16-bit tokens", path, vocab_size);
    uint64_t sum = FNV1A64_INIT;
    size_t total = 0;
    for (size_t s = 0; s < nspans; s++) {
        for (size_t i = 0; i < spans[s].n; i++)
            if (spans[s].p[i] >= vocab_size)
                return set_err(err, errlen, "cannot write shard %s: token %u at position %zu is out of range (vocab_size %d)",
                               path, spans[s].p[i], total + i, vocab_size);
        sum = fnv1a64(spans[s].p, spans[s].n * sizeof(uint16_t), sum);
        total += spans[s].n;
    }
    unsigned char hdr[SHARD_HEADER_BYTES] = {0};
    memcpy(hdr, SHARD_MAGIC, 8);
    put_u32(hdr + 8, SHARD_VERSION);
    put_u32(hdr + 12, (uint32_t)vocab_size);
    put_u64(hdr + 16, (uint64_t)total);
    put_u64(hdr + 24, sum);

    AtomicFile f;
    if (atomic_open(&f, path, err, errlen)) return -1;
    atomic_write(&f, hdr, sizeof hdr);
    for (size_t s = 0; s < nspans; s++) atomic_write(&f, spans[s].p, spans[s].n * sizeof(uint16_t));
    return atomic_commit(&f, err, errlen);
}

int shard_write(const char *path, const uint16_t *tokens, size_t n, int vocab_size, char *err, size_t errlen) {
    TokSpan span = {tokens, n};
    return write_shard_spans(path, &span, 1, vocab_size, err, errlen);
}

/* ---------------------------------------------------------------- reading shards */

int shard_open(Shard *s, const char *path, char *err, size_t errlen) {
    memset(s, 0, sizeof *s);
    int fd = open(path, O_RDONLY);
    if (fd < 0) return set_err(err, errlen, "cannot open shard %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return set_err(err, errlen, "cannot stat shard %s: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) { close(fd); return set_err(err, errlen, "%s: not a regular file, not a meshtrain shard", path); }
    size_t size = (size_t)st.st_size;
    if (size == 0) { close(fd); return set_err(err, errlen, "%s: empty file, not a meshtrain shard", path); }
    if (size < SHARD_HEADER_BYTES) {
        unsigned char head[8] = {0};
        ssize_t got = pread(fd, head, size < 8 ? size : 8, 0);
        close(fd);
        if (got > 0 && memcmp(head, SHARD_MAGIC, (size_t)got) == 0)
            return set_err(err, errlen, "%s: truncated: %zu bytes, shorter than the %d-byte shard header", path, size,
                           SHARD_HEADER_BYTES);
        return set_err(err, errlen, "%s: not a meshtrain shard (%zu bytes, no MTSHARD1 header)", path, size);
    }
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int map_errno = errno;
    close(fd);
    if (map == MAP_FAILED) return set_err(err, errlen, "cannot mmap shard %s: %s", path, strerror(map_errno));

    const unsigned char *h = map;
    const char *why = NULL;
    char buf[256];
    uint32_t version = get_u32(h + 8), vocab = get_u32(h + 12);
    uint64_t n = get_u64(h + 16), stored_sum = get_u64(h + 24);
    size_t payload = size - SHARD_HEADER_BYTES;
    int reserved_zero = 1;
    for (int i = 32; i < SHARD_HEADER_BYTES; i++) reserved_zero &= h[i] == 0;
    if (memcmp(h, SHARD_MAGIC, 8) != 0) {
        why = "not a meshtrain shard (no MTSHARD1 magic)";
    } else if (version != SHARD_VERSION) {
        snprintf(buf, sizeof buf, "shard version %u, but this build reads version %d", version, SHARD_VERSION);
        why = buf;
    } else if (vocab == 0 || vocab > 65536) {
        snprintf(buf, sizeof buf, "corrupt header: vocab_size %u", vocab);
        why = buf;
    } else if (!reserved_zero) {
        why = "corrupt header: reserved bytes are not zero";
    } else if (n > payload / sizeof(uint16_t)) {
        snprintf(buf, sizeof buf, "truncated: header says %llu tokens, file holds %zu", (unsigned long long)n,
                 payload / sizeof(uint16_t));
        why = buf;
    } else if (n * sizeof(uint16_t) != payload) {
        snprintf(buf, sizeof buf, "size mismatch: header says %llu tokens (%llu bytes), file holds %zu bytes after the header",
                 (unsigned long long)n, (unsigned long long)n * 2, payload);
        why = buf;
    } else {
        const uint16_t *tok = (const uint16_t *)(h + SHARD_HEADER_BYTES);
        uint64_t sum = fnv1a64(tok, payload, FNV1A64_INIT);
        if (sum != stored_sum) {
            snprintf(buf, sizeof buf, "checksum mismatch (header %016llx, tokens %016llx): the file is corrupt",
                     (unsigned long long)stored_sum, (unsigned long long)sum);
            why = buf;
        } else {
            for (size_t i = 0; i < n; i++)
                if (tok[i] >= vocab) {
                    snprintf(buf, sizeof buf, "token %u out of range at position %zu (vocab_size %u)", tok[i], i, vocab);
                    why = buf;
                    break;
                }
        }
    }
    if (why) {
        munmap(map, size);
        return set_err(err, errlen, "%s: %s", path, why);
    }
    s->tokens = (const uint16_t *)(h + SHARD_HEADER_BYTES);
    s->n_tokens = (size_t)n;
    s->vocab_size = (int)vocab;
    s->map = map;
    s->map_len = size;
    return 0;
}

void shard_close(Shard *s) {
    if (s->map) munmap(s->map, s->map_len);
    memset(s, 0, sizeof *s);
}

/* ---------------------------------------------------------------- prepare */

/* Offset of the first byte that is not part of well-formed UTF-8 (RFC 3629: no overlong
 * forms, no surrogates, nothing above U+10FFFF), or len when all of it is valid.
 * *cut_at_end tells whether that byte starts a sequence that is only cut short by the end. */
static size_t utf8_invalid_offset(const unsigned char *s, size_t len, int *cut_at_end) {
    size_t i = 0;
    *cut_at_end = 0;
    while (i < len) {
        if (i + 8 <= len) {
            uint64_t w;
            memcpy(&w, s + i, 8);
            if (!(w & 0x8080808080808080ULL)) { i += 8; continue; }
        }
        unsigned c = s[i];
        if (c < 0x80) { i++; continue; }
        size_t need;
        unsigned lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF) need = 1;
        else if (c >= 0xE0 && c <= 0xEF) {
            need = 2;
            if (c == 0xE0) lo = 0xA0;
            if (c == 0xED) hi = 0x9F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            need = 3;
            if (c == 0xF0) lo = 0x90;
            if (c == 0xF4) hi = 0x8F;
        } else return i;
        size_t have = len - i - 1 < need ? len - i - 1 : need;
        if (have >= 1 && (s[i + 1] < lo || s[i + 1] > hi)) return i;
        for (size_t k = 2; k <= have; k++)
            if ((s[i + k] & 0xC0) != 0x80) return i;
        if (have < need) { *cut_at_end = 1; return i; }
        i += need + 1;
    }
    return len;
}

static int is_space(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

typedef struct { size_t off, len; } Story;

/* A run of consecutive stories encoded by one thread. */
typedef struct {
    size_t first, count;
    uint16_t *tokens;
    size_t n_tokens;
    char err[512];
} Chunk;

static int mkdir_p(const char *dir, char *err, size_t errlen) {
    char path[4096];
    if (snprintf(path, sizeof path, "%s", dir) >= (int)sizeof path) return set_err(err, errlen, "path too long: %s", dir);
    size_t len = strlen(path);
    for (size_t i = 1; i <= len; i++) {
        if (path[i] != '/' && path[i] != 0) continue;
        char saved = path[i];
        path[i] = 0;
        if (mkdir(path, 0755) != 0 && errno != EEXIST)
            return set_err(err, errlen, "cannot create directory %s: %s", path, strerror(errno));
        path[i] = saved;
    }
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) return set_err(err, errlen, "cannot create directory %s: not a directory", dir);
    return 0;
}

/* The input text, mmapped when it is a regular file. */
typedef struct { const char *p; size_t n; void *map; char *buf; } Text;

static int text_open(Text *t, const char *path, char *err, size_t errlen) {
    memset(t, 0, sizeof *t);
    int fd = open(path, O_RDONLY);
    if (fd < 0) return set_err(err, errlen, "cannot open %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
        t->n = (size_t)st.st_size;
        if (t->n == 0) { close(fd); return set_err(err, errlen, "%s: empty file, nothing to prepare", path); }
        t->map = mmap(NULL, t->n, PROT_READ, MAP_PRIVATE, fd, 0);
        int e = errno;
        close(fd);
        if (t->map == MAP_FAILED) { t->map = NULL; return set_err(err, errlen, "cannot mmap %s: %s", path, strerror(e)); }
        t->p = t->map;
        return 0;
    }
    close(fd);
    t->buf = read_file(path, &t->n, err, errlen); /* a pipe or a device */
    if (!t->buf) return -1;
    if (t->n == 0) { free(t->buf); t->buf = NULL; return set_err(err, errlen, "%s: empty file, nothing to prepare", path); }
    t->p = t->buf;
    return 0;
}

static void text_close(Text *t) {
    if (t->map) munmap(t->map, t->n);
    free(t->buf);
    memset(t, 0, sizeof *t);
}

/* Stories are the text between separator lines. Text after the last separator is a story
 * cut off by truncation (the mirrored head files stop mid-story), so it is dropped. */
static Story *split_stories(const char *p, size_t n, size_t *n_stories, size_t *tail_start) {
    static const char SEP[] = "<|endoftext|>";
    const size_t seplen = sizeof SEP - 1;
    size_t cap = 1024, count = 0, story_start = 0, ls = 0;
    Story *st = xmalloc(cap * sizeof *st);
    while (ls < n) {
        const char *nl = memchr(p + ls, '\n', n - ls);
        size_t le = nl ? (size_t)(nl - p) : n, next = nl ? le + 1 : n;
        size_t a = ls, b = le;
        while (a < b && is_space((unsigned char)p[a])) a++;
        while (b > a && is_space((unsigned char)p[b - 1])) b--;
        if (b - a == seplen && memcmp(p + a, SEP, seplen) == 0) {
            size_t s0 = story_start, s1 = ls;
            while (s0 < s1 && is_space((unsigned char)p[s0])) s0++;
            while (s1 > s0 && is_space((unsigned char)p[s1 - 1])) s1--;
            if (s1 > s0) {
                if (count == cap) { cap *= 2; st = xrealloc(st, cap * sizeof *st); }
                st[count].off = s0;
                st[count].len = s1 - s0;
                count++;
            }
            story_start = next;
        }
        ls = next;
    }
    *n_stories = count;
    *tail_start = story_start;
    return st;
}

static void encode_chunk(const Tokenizer *tok, const char *text, const Story *stories, Chunk *c, int vocab) {
    TokenBuf tb = {0};
    for (size_t s = c->first; s < c->first + c->count; s++) {
        if (tb.n == tb.cap) {
            tb.cap = tb.cap ? tb.cap * 2 : 4096;
            tb.ids = xrealloc(tb.ids, tb.cap * sizeof *tb.ids);
        }
        tb.ids[tb.n++] = TOKEN_EOT;
        if (tokenizer_encode(tok, text + stories[s].off, stories[s].len, &tb, c->err, sizeof c->err) != 0) {
            if (!c->err[0]) set_err(c->err, sizeof c->err, "tokenizer_encode failed");
            tokenbuf_free(&tb);
            return;
        }
    }
    c->tokens = xmalloc(tb.n * sizeof *c->tokens);
    for (size_t i = 0; i < tb.n; i++) {
        if (tb.ids[i] < 0 || tb.ids[i] >= vocab) {
            set_err(c->err, sizeof c->err, "tokenizer returned id %d, outside the vocabulary of %d", tb.ids[i], vocab);
            free(c->tokens); c->tokens = NULL;
            tokenbuf_free(&tb);
            return;
        }
        c->tokens[i] = (uint16_t)tb.ids[i];
    }
    c->n_tokens = tb.n;
    tokenbuf_free(&tb);
}

int data_prepare(const Tokenizer *tok, const char *text_path, const char *out_dir, double val_fraction,
                 PrepareStats *stats, char *err, size_t errlen) {
    double t0 = now_seconds();
    if (stats) memset(stats, 0, sizeof *stats);
    if (!(val_fraction >= 0.0 && val_fraction < 1.0))
        return set_err(err, errlen, "val_fraction %g: must be at least 0 and below 1", val_fraction);
    int vocab = tokenizer_vocab_size(tok);
    if (vocab <= TOKEN_EOT || vocab > 65536)
        return set_err(err, errlen, "vocabulary of %d tokens: shards need TOKEN_EOT (%d) and 16-bit ids", vocab, TOKEN_EOT);

    Text text;
    if (text_open(&text, text_path, err, errlen) != 0) return -1;
    size_t n_stories, tail_start;
    Story *stories = split_stories(text.p, text.n, &n_stories, &tail_start);
    /* A character cut by the end of the file is part of the dropped cut-off story. */
    int cut_at_end;
    size_t bad = utf8_invalid_offset((const unsigned char *)text.p, text.n, &cut_at_end);
    if (bad != text.n && !(cut_at_end && bad >= tail_start)) {
        set_err(err, errlen, "%s: not valid UTF-8 at byte offset %zu (byte 0x%02x)", text_path, bad, (unsigned char)text.p[bad]);
        free(stories);
        text_close(&text);
        return -1;
    }
    int rc = -1;
    Chunk *chunks = NULL;
    size_t n_chunks = 0;
    if (n_stories == 0) {
        set_err(err, errlen, "%s: no complete story (stories must be followed by a line \"<|endoftext|>\")", text_path);
        goto done;
    }
    if (n_stories < 2) {
        set_err(err, errlen, "%s: only 1 complete story; need at least 2 (one to train on, one to validate)", text_path);
        goto done;
    }
    /* The epsilon keeps 0.7 * 10 from rounding up to 8. */
    size_t n_val = (size_t)ceil(val_fraction * (double)n_stories - 1e-9);
    if (n_val < 1) n_val = 1;
    if (n_val > n_stories - 1) n_val = n_stories - 1;
    size_t n_train = n_stories - n_val;

    /* Chunks of about 64 KiB of text, breaking at the train/val boundary. */
    const size_t chunk_bytes = 1 << 16;
    size_t cap = 64, split_chunk = 0;
    chunks = xcalloc(cap, sizeof *chunks);
    for (size_t s = 0; s < n_stories;) {
        if (n_chunks == cap) {
            chunks = xrealloc(chunks, 2 * cap * sizeof *chunks);
            memset(chunks + cap, 0, cap * sizeof *chunks);
            cap *= 2;
        }
        if (s == n_train) split_chunk = n_chunks;
        size_t end = s < n_train ? n_train : n_stories, bytes = 0, e = s;
        while (e < end && (e == s || bytes + stories[e].len <= chunk_bytes)) bytes += stories[e++].len;
        chunks[n_chunks].first = s;
        chunks[n_chunks].count = e - s;
        n_chunks++;
        s = e;
    }

    /* tokenizer_encode only reads the tokenizer, so stories encode in parallel. */
    int failed = 0;
    #pragma omp parallel for schedule(dynamic, 1)
    for (size_t c = 0; c < n_chunks; c++) {
        int stop;
        #pragma omp atomic read
        stop = failed;
        if (stop) continue;
        encode_chunk(tok, text.p, stories, &chunks[c], vocab);
        if (!chunks[c].tokens) {
            #pragma omp atomic write
            failed = 1;
        }
    }
    for (size_t c = 0; c < n_chunks; c++)
        if (!chunks[c].tokens && chunks[c].err[0]) {
            set_err(err, errlen, "%s: cannot encode stories %zu-%zu: %s", text_path, chunks[c].first + 1,
                    chunks[c].first + chunks[c].count, chunks[c].err);
            goto done;
        }

    if (mkdir_p(out_dir, err, errlen) != 0) goto done;
    TokSpan *spans = xmalloc(n_chunks * sizeof *spans);
    size_t n_train_tokens = 0, n_val_tokens = 0;
    for (size_t c = 0; c < n_chunks; c++) {
        spans[c].p = chunks[c].tokens;
        spans[c].n = chunks[c].n_tokens;
        if (c < split_chunk) n_train_tokens += chunks[c].n_tokens;
        else n_val_tokens += chunks[c].n_tokens;
    }
    char path[4096];
    int wrc = 0;
    if (snprintf(path, sizeof path, "%s/train.bin", out_dir) >= (int)sizeof path)
        wrc = set_err(err, errlen, "path too long: %s", out_dir);
    if (!wrc) wrc = write_shard_spans(path, spans, split_chunk, vocab, err, errlen);
    if (!wrc) {
        snprintf(path, sizeof path, "%s/val.bin", out_dir);
        wrc = write_shard_spans(path, spans + split_chunk, n_chunks - split_chunk, vocab, err, errlen);
    }
    free(spans);
    if (wrc) goto done;
    if (stats) {
        stats->n_stories = n_stories;
        stats->n_train_tokens = n_train_tokens;
        stats->n_val_tokens = n_val_tokens;
        stats->n_bytes = text.n;
        stats->seconds = now_seconds() - t0;
    }
    rc = 0;
done:
    for (size_t c = 0; c < n_chunks; c++) free(chunks[c].tokens);
    free(chunks);
    free(stories);
    text_close(&text);
    return rc;
}

/* ---------------------------------------------------------------- loader */

static uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

/* The order depends on (seed, epoch, n_windows) only, so every rank builds the same one. */
static void build_order(Loader *l) {
    for (size_t i = 0; i < l->n_windows; i++) l->order[i] = (uint32_t)i;
    if (!l->shuffle) return;
    Rng rng;
    rng_seed(&rng, splitmix64(l->seed ^ splitmix64(l->st.epoch)));
    for (size_t i = l->n_windows - 1; i > 0; i--) {
        size_t j = (size_t)(rng_u64(&rng) % (uint64_t)(i + 1));
        uint32_t t = l->order[i];
        l->order[i] = l->order[j];
        l->order[j] = t;
    }
}

int loader_init(Loader *l, const Shard *s, int B, int T, int rank, int world, uint64_t seed, int shuffle,
                char *err, size_t errlen) {
    memset(l, 0, sizeof *l);
    if (B < 1 || T < 1) return set_err(err, errlen, "loader: batch_size %d and context_len %d must be positive", B, T);
    if (world < 1 || rank < 0 || rank >= world)
        return set_err(err, errlen, "loader: rank %d is not in a world of %d", rank, world);
    size_t n_windows = s->n_tokens > 0 ? (s->n_tokens - 1) / (size_t)T : 0;
    size_t per_batch = (size_t)B * (size_t)world;
    if (n_windows < per_batch)
        return set_err(err, errlen,
                       "shard of %zu tokens holds %zu windows of context_len %d + 1, fewer than one global batch "
                       "needs (batch_size %d x %d ranks = %zu)",
                       s->n_tokens, n_windows, T, B, world, per_batch);
    if (n_windows > UINT32_MAX)
        return set_err(err, errlen, "shard of %zu tokens holds %zu windows of context_len %d, more than the loader indexes",
                       s->n_tokens, n_windows, T);
    l->shard = s;
    l->B = B; l->T = T; l->rank = rank; l->world = world; l->shuffle = shuffle;
    l->seed = seed;
    l->n_windows = n_windows;
    l->batches_per_epoch = n_windows / per_batch;
    l->order = xmalloc(n_windows * sizeof *l->order);
    build_order(l);
    return 0;
}

void loader_free(Loader *l) {
    free(l->order);
    memset(l, 0, sizeof *l);
}

void loader_next(Loader *l, int *inputs, int *targets) {
    const int B = l->B, T = l->T;
    const uint16_t *tok = l->shard->tokens;
    size_t per_batch = (size_t)B * (size_t)l->world;
    size_t base = (size_t)l->st.window + (size_t)l->rank * (size_t)B;
    for (int b = 0; b < B; b++) {
        const uint16_t *w = tok + (size_t)l->order[base + (size_t)b] * (size_t)T;
        int *in = inputs + (size_t)b * T, *tg = targets + (size_t)b * T;
        for (int t = 0; t < T; t++) {
            in[t] = w[t];
            tg[t] = w[t + 1];
        }
    }
    /* Roll over as soon as the epoch's last batch is taken, so a saved state always
     * points at a batch that exists. */
    l->st.window += per_batch;
    if (l->st.window + per_batch > l->n_windows) {
        l->st.window = 0;
        l->st.epoch++;
        build_order(l);
    }
}

size_t loader_batch_tokens(const Loader *l, int V, unsigned char *seen, int *rows) {
    memset(seen, 0, (size_t)V);
    size_t per_batch = (size_t)l->B * (size_t)l->world;
    for (size_t i = 0; i < per_batch; i++) {
        const uint16_t *w = l->shard->tokens + (size_t)l->order[l->st.window + i] * (size_t)l->T;
        for (int t = 0; t < l->T; t++)
            if (w[t] < V) seen[w[t]] = 1;
    }
    size_t n = 0;
    for (int v = 0; v < V; v++)
        if (seen[v]) rows[n++] = v;
    return n;
}

LoaderState loader_get_state(const Loader *l) { return l->st; }

int loader_set_state(Loader *l, LoaderState st, char *err, size_t errlen) {
    if (st.window > l->n_windows)
        return set_err(err, errlen, "loader state: window %llu of an epoch of %zu windows (is this the same data "
                       "and context_len?)", (unsigned long long)st.window, l->n_windows);
    l->st = st;
    if (l->st.window + (size_t)l->B * l->world > l->n_windows) {
        l->st.window = 0;
        l->st.epoch++;
    }
    build_order(l);
    return 0;
}
