/* tokenizer — GPT-2 byte-level BPE.
 *
 * Loading: encoder.json (token string -> id, parsed by a small strict JSON-object parser)
 * and vocab.bpe ("#version" line, then one merge "a b" per line, rank = line order).
 * Token strings are in GPT-2's bytes_to_unicode alphabet; they are mapped back to raw
 * bytes at load time, so everything below works on raw bytes and token ids.
 *
 * Encoding: the GPT-2 regex (PCRE2, UTF + UCP + MATCH_INVALID_UTF, JIT) splits the text
 * into pieces; bytes the regex cannot match (invalid UTF-8) form pieces of their own, so
 * every input byte lands in exactly one piece and decode(encode(x)) == x for any bytes.
 * Each piece starts as one byte-token per byte and is merged pair by pair, always the
 * lowest-ranked adjacent pair first (leftmost on ties), which gives the same result as
 * GPT-2's encoder.py. Short pieces use a small array pass; long ones a heap (n log n).
 * Results for short pieces are memoised in a fixed-size, insert-only, lock-free cache,
 * so a const Tokenizer may be used from several threads at once. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* memmem */
#endif
#include "tokenizer.h"
#include "util.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N_MERGES (GPT2_VOCAB_SIZE - 257)
#define MERGE_BITS 17          /* merge-rank table: 131072 slots for 50000 pairs */
#define TOKMAP_BITS 17         /* bytes -> id table: 131072 slots for 50257 tokens */
#define CACHE_BITS 17          /* piece cache: 131072 slots */
#define CACHE_PROBES 8
#define CACHE_MAX_LEN 64       /* pieces longer than this are not cached */
#define SMALL_MAX 128          /* pieces up to this many bytes use the array pass */
#define LONG_CHUNK (1u << 30)  /* pieces longer than 1 GiB are merged in 1 GiB chunks */
#define NO_RANK UINT32_MAX
#define NONE UINT32_MAX

/* GPT-2's pattern,
 *   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * with \s spelled out as Unicode's White_Space set, which is what Python's `regex` (used by
 * GPT-2's encoder.py) matches: PCRE2's UCP \s also matches U+180E, which Unicode dropped
 * from White_Space in 6.3. */
#define WS "\\t\\n\\x{0B}\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}"
static const char GPT2_PATTERN[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^" WS "\\p{L}\\p{N}]+|[" WS "]+(?![^" WS "])|[" WS "]+";
static const char EOT_TEXT[] = "<|endoftext|>";

typedef struct { uint64_t key; uint32_t rank; int32_t merged; } MergeSlot; /* merged<0: empty */

typedef struct CacheEntry {
    uint64_t hash;
    uint32_t len, nids;
    int ids[];              /* nids ids, then len key bytes */
} CacheEntry;

struct Tokenizer {
    int n_vocab;
    unsigned char *bytes;   /* arena of all token bytes */
    uint32_t *off, *len;    /* per id: offset into bytes, length */
    int32_t byte_tok[256];  /* id of the one-byte token for each byte */
    int32_t *tokmap;        /* bytes -> id, open addressing, -1 empty */
    MergeSlot *merges;      /* (left id, right id) -> rank, merged id */
    pcre2_code *re;
    int jit;
    _Atomic(CacheEntry *) *cache;
    size_t small_max;       /* array pass up to this length (tests lower it to 0) */
    int use_cache;
};

/* ---------------------------------------------------------------- small helpers */

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

static inline uint64_t hash_bytes(const unsigned char *p, size_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ (uint64_t)n;
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        h = (h ^ v) * 0xff51afd7ed558ccdULL;
        h ^= h >> 32;
        p += 8; n -= 8;
    }
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++) v |= (uint64_t)p[i] << (8 * i);
    return mix64(h ^ v);
}

/* GPT-2's bytes_to_unicode(): printable Latin-1 bytes map to themselves, the other 68
 * bytes to U+0100.. in byte order. */
static void byte_maps(uint32_t b2u[256], int16_t u2b[324]) {
    int n = 0;
    for (int i = 0; i < 324; i++) u2b[i] = -1;
    for (int b = 0; b < 256; b++) {
        int keep = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        uint32_t c = keep ? (uint32_t)b : 256u + (uint32_t)n++;
        b2u[b] = c;
        u2b[c] = (int16_t)b;
    }
}

/* Decodes one UTF-8 code point at s[*i] (s has n bytes); -1 if invalid. */
static long utf8_next(const unsigned char *s, size_t n, size_t *i) {
    size_t k = *i;
    unsigned c = s[k];
    long cp;
    int extra;
    if (c < 0x80) { *i = k + 1; return c; }
    else if (c >= 0xC2 && c <= 0xDF) { cp = c & 0x1F; extra = 1; }
    else if (c >= 0xE0 && c <= 0xEF) { cp = c & 0x0F; extra = 2; }
    else if (c >= 0xF0 && c <= 0xF4) { cp = c & 0x07; extra = 3; }
    else return -1;
    if (n - k - 1 < (size_t)extra) return -1;
    for (int j = 1; j <= extra; j++) {
        unsigned d = s[k + j];
        if ((d & 0xC0) != 0x80) return -1;
        cp = (cp << 6) | (d & 0x3F);
    }
    if ((extra == 2 && cp < 0x800) || (extra == 3 && (cp < 0x10000 || cp > 0x10FFFF)) ||
        (cp >= 0xD800 && cp <= 0xDFFF))
        return -1;
    *i = k + 1 + (size_t)extra;
    return cp;
}

static inline void tb_reserve(TokenBuf *b, size_t extra) {
    if (b->n + extra <= b->cap) return;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + extra) cap *= 2;
    b->ids = xrealloc(b->ids, cap * sizeof(int));
    b->cap = cap;
}

static inline void tb_push(TokenBuf *b, int id) {
    if (b->n == b->cap) tb_reserve(b, 1);
    b->ids[b->n++] = id;
}

void tokenbuf_free(TokenBuf *b) {
    if (!b) return;
    free(b->ids);
    b->ids = NULL;
    b->n = b->cap = 0;
}

/* ---------------------------------------------------------------- hash tables */

static int32_t tokmap_find(const Tokenizer *t, const unsigned char *p, size_t n) {
    size_t mask = ((size_t)1 << TOKMAP_BITS) - 1, i = hash_bytes(p, n) & mask;
    for (;;) {
        int32_t id = t->tokmap[i];
        if (id < 0) return -1;
        if (t->len[id] == n && memcmp(t->bytes + t->off[id], p, n) == 0) return id;
        i = (i + 1) & mask;
    }
}

/* Inserts id; returns the id already holding the same bytes, or -1. */
static int32_t tokmap_insert(Tokenizer *t, int32_t id) {
    const unsigned char *p = t->bytes + t->off[id];
    size_t n = t->len[id];
    size_t mask = ((size_t)1 << TOKMAP_BITS) - 1, i = hash_bytes(p, n) & mask;
    for (;;) {
        int32_t o = t->tokmap[i];
        if (o < 0) { t->tokmap[i] = id; return -1; }
        if (t->len[o] == n && memcmp(t->bytes + t->off[o], p, n) == 0) return o;
        i = (i + 1) & mask;
    }
}

static inline uint64_t pair_key(int a, int b) { return ((uint64_t)(uint32_t)a << 32) | (uint32_t)b; }
static inline size_t pair_slot(uint64_t key) {
    return (size_t)((key * 0x9E3779B97F4A7C15ULL) >> (64 - MERGE_BITS));
}

static inline const MergeSlot *merge_find(const Tokenizer *t, int a, int b) {
    uint64_t key = pair_key(a, b);
    size_t mask = ((size_t)1 << MERGE_BITS) - 1, i = pair_slot(key);
    for (;;) {
        const MergeSlot *s = &t->merges[i];
        if (s->merged < 0) return NULL;
        if (s->key == key) return s;
        i = (i + 1) & mask;
    }
}

/* 0 on success, -1 if the pair is already there. */
static int merge_insert(Tokenizer *t, int a, int b, uint32_t rank, int merged) {
    uint64_t key = pair_key(a, b);
    size_t mask = ((size_t)1 << MERGE_BITS) - 1, i = pair_slot(key);
    for (;;) {
        MergeSlot *s = &t->merges[i];
        if (s->merged < 0) { s->key = key; s->rank = rank; s->merged = merged; return 0; }
        if (s->key == key) return -1;
        i = (i + 1) & mask;
    }
}

static inline const unsigned char *entry_bytes(const CacheEntry *e) {
    return (const unsigned char *)(e->ids + e->nids);
}

static const CacheEntry *cache_get(const Tokenizer *t, const unsigned char *p, size_t n, uint64_t h) {
    size_t mask = ((size_t)1 << CACHE_BITS) - 1;
    for (size_t k = 0; k < CACHE_PROBES; k++) {
        const CacheEntry *e = atomic_load_explicit(&t->cache[(h + k) & mask], memory_order_acquire);
        if (!e) return NULL;
        if (e->hash == h && e->len == n && memcmp(entry_bytes(e), p, n) == 0) return e;
    }
    return NULL;
}

/* Best effort: when the probe window is full the result is simply not cached. */
static void cache_put(const Tokenizer *t, const unsigned char *p, size_t n, uint64_t h,
                      const int *ids, size_t nids) {
    size_t mask = ((size_t)1 << CACHE_BITS) - 1;
    CacheEntry *e = xmalloc(sizeof(CacheEntry) + nids * sizeof(int) + n);
    e->hash = h;
    e->len = (uint32_t)n;
    e->nids = (uint32_t)nids;
    memcpy(e->ids, ids, nids * sizeof(int));
    memcpy((unsigned char *)(e->ids + nids), p, n);
    for (size_t k = 0; k < CACHE_PROBES; k++) {
        _Atomic(CacheEntry *) *slot = &t->cache[(h + k) & mask];
        CacheEntry *cur = NULL;
        if (atomic_compare_exchange_strong_explicit(slot, &cur, e, memory_order_acq_rel,
                                                    memory_order_acquire))
            return;
        if (cur->hash == h && cur->len == n && memcmp(entry_bytes(cur), p, n) == 0) break;
    }
    free(e);
}

/* ---------------------------------------------------------------- BPE */

static inline uint32_t pair_rank(const Tokenizer *t, int a, int b, int *merged) {
    const MergeSlot *s = merge_find(t, a, b);
    if (!s) return NO_RANK;
    *merged = s->merged;
    return s->rank;
}

/* Array pass for n <= SMALL_MAX bytes; writes the ids to ids[], returns their count. */
static size_t bpe_small(const Tokenizer *t, const unsigned char *p, size_t n, int *ids) {
    uint32_t rk[SMALL_MAX];
    int mg[SMALL_MAX];
    size_t m = n;
    for (size_t i = 0; i < n; i++) ids[i] = t->byte_tok[p[i]];
    for (size_t i = 0; i + 1 < m; i++) rk[i] = pair_rank(t, ids[i], ids[i + 1], &mg[i]);
    while (m > 1) {
        size_t best = 0;
        uint32_t br = NO_RANK;
        for (size_t i = 0; i + 1 < m; i++)
            if (rk[i] < br) { br = rk[i]; best = i; }
        if (br == NO_RANK) break;
        ids[best] = mg[best];
        /* drop symbol best+1 and pair entry best+1 (old pair (best+1, best+2)) */
        if (m - best > 2) {
            memmove(&ids[best + 1], &ids[best + 2], (m - best - 2) * sizeof(int));
            if (m - best > 3) {
                memmove(&rk[best + 1], &rk[best + 2], (m - best - 3) * sizeof(uint32_t));
                memmove(&mg[best + 1], &mg[best + 2], (m - best - 3) * sizeof(int));
            }
        }
        m--;
        if (best > 0) rk[best - 1] = pair_rank(t, ids[best - 1], ids[best], &mg[best - 1]);
        if (best + 1 < m) rk[best] = pair_rank(t, ids[best], ids[best + 1], &mg[best]);
    }
    return m;
}

static inline void heap_push(uint64_t *h, size_t *hn, uint64_t v) {
    size_t i = (*hn)++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (h[parent] <= v) break;
        h[i] = h[parent];
        i = parent;
    }
    h[i] = v;
}

static inline uint64_t heap_pop(uint64_t *h, size_t *hn) {
    uint64_t top = h[0], v = h[--(*hn)];
    size_t n = *hn, i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && h[c + 1] < h[c]) c++;
        if (h[c] >= v) break;
        h[i] = h[c];
        i = c;
    }
    if (n) h[i] = v;
    return top;
}

/* Heap pass for long pieces (n <= LONG_CHUNK): linked list of symbols and a min-heap of
 * (rank << 32 | left position) with lazy deletion. Appends the ids to out. */
static void bpe_long(const Tokenizer *t, const unsigned char *p, size_t n, TokenBuf *out) {
    int32_t *id = xmalloc(n * sizeof(int32_t));
    uint32_t *nx = xmalloc(n * sizeof(uint32_t)), *pv = xmalloc(n * sizeof(uint32_t));
    size_t hcap = n, hn = 0;
    uint64_t *heap = xmalloc(hcap * sizeof(uint64_t));
    int mg;
    for (size_t i = 0; i < n; i++) {
        id[i] = t->byte_tok[p[i]];
        nx[i] = i + 1 < n ? (uint32_t)(i + 1) : NONE;
        pv[i] = i > 0 ? (uint32_t)(i - 1) : NONE;
    }
    for (size_t i = 0; i + 1 < n; i++) {
        uint32_t r = pair_rank(t, id[i], id[i + 1], &mg);
        if (r != NO_RANK) heap_push(heap, &hn, (uint64_t)r << 32 | i);
    }
    while (hn) {
        uint64_t top = heap_pop(heap, &hn);
        uint32_t r = (uint32_t)(top >> 32), i = (uint32_t)top;
        if (id[i] < 0) continue;
        uint32_t j = nx[i];
        if (j == NONE) continue;
        const MergeSlot *s = merge_find(t, id[i], id[j]);
        if (!s || s->rank != r) continue;   /* stale entry */
        id[i] = s->merged;
        id[j] = -1;
        nx[i] = nx[j];
        if (nx[j] != NONE) pv[nx[j]] = i;
        if (hn + 2 > hcap) { hcap *= 2; heap = xrealloc(heap, hcap * sizeof(uint64_t)); }
        if (pv[i] != NONE) {
            uint32_t r2 = pair_rank(t, id[pv[i]], id[i], &mg);
            if (r2 != NO_RANK) heap_push(heap, &hn, (uint64_t)r2 << 32 | pv[i]);
        }
        if (nx[i] != NONE) {
            uint32_t r2 = pair_rank(t, id[i], id[nx[i]], &mg);
            if (r2 != NO_RANK) heap_push(heap, &hn, (uint64_t)r2 << 32 | i);
        }
    }
    for (uint32_t i = 0; i != NONE; i = nx[i]) tb_push(out, id[i]);
    free(id); free(nx); free(pv); free(heap);
}

static void encode_piece(const Tokenizer *t, const unsigned char *p, size_t n, TokenBuf *out) {
    if (n == 1) { tb_push(out, t->byte_tok[p[0]]); return; }
    int cacheable = t->use_cache && n <= CACHE_MAX_LEN;
    uint64_t h = 0;
    if (cacheable) {
        h = hash_bytes(p, n);
        const CacheEntry *e = cache_get(t, p, n, h);
        if (e) {
            tb_reserve(out, e->nids);
            memcpy(out->ids + out->n, e->ids, e->nids * sizeof(int));
            out->n += e->nids;
            return;
        }
    }
    size_t start = out->n;
    if (n <= t->small_max) {
        tb_reserve(out, n);
        out->n += bpe_small(t, p, n, out->ids + out->n);
    } else {
        while (n) {
            size_t c = n < LONG_CHUNK ? n : LONG_CHUNK;
            bpe_long(t, p, c, out);
            p += c; n -= c;
            cacheable = 0;
        }
    }
    if (cacheable) cache_put(t, p, n, h, out->ids + start, out->n - start);
}

/* ---------------------------------------------------------------- encode / decode */

static int encode_ordinary(const Tokenizer *t, const unsigned char *s, size_t len, TokenBuf *out,
                           pcre2_match_data *md, char *err, size_t errlen) {
    size_t off = 0;
    while (off < len) {
        int rc = t->jit ? pcre2_jit_match(t->re, s, len, off, 0, md, NULL)
                        : pcre2_match(t->re, s, len, off, 0, md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) { encode_piece(t, s + off, len - off, out); break; }
        if (rc < 0) {
            PCRE2_UCHAR msg[160];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return set_err(err, errlen, "tokenizer: regex match failed at byte %zu: %s", off, (char *)msg);
        }
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t a = ov[0], b = ov[1];
        if (a < off || b <= a || b > len)
            return set_err(err, errlen, "tokenizer: internal error: bad regex match [%zu, %zu) at byte %zu", a, b, off);
        if (a > off) encode_piece(t, s + off, a - off, out);   /* bytes the regex skipped */
        encode_piece(t, s + a, b - a, out);
        off = b;
    }
    return 0;
}

static int encode_impl(const Tokenizer *tok, const char *text, size_t len, TokenBuf *out,
                       int special, char *err, size_t errlen) {
    if (!tok || !out) return set_err(err, errlen, "tokenizer: NULL tokenizer or output buffer");
    if (len == 0) return 0;
    if (!text) return set_err(err, errlen, "tokenizer: NULL text with length %zu", len);
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(tok->re, NULL);
    if (!md) return set_err(err, errlen, "tokenizer: cannot allocate PCRE2 match data");
    const unsigned char *s = (const unsigned char *)text;
    int rc = 0;
    if (!special) {
        rc = encode_ordinary(tok, s, len, out, md, err, errlen);
    } else {
        const size_t el = sizeof EOT_TEXT - 1;
        size_t off = 0;
        while (off < len && rc == 0) {
            const unsigned char *hit = memmem(s + off, len - off, EOT_TEXT, el);
            size_t end = hit ? (size_t)(hit - s) : len;
            rc = encode_ordinary(tok, s + off, end - off, out, md, err, errlen);
            if (hit && rc == 0) { tb_push(out, TOKEN_EOT); end += el; }
            off = end;
        }
    }
    pcre2_match_data_free(md);
    return rc;
}

int tokenizer_encode(const Tokenizer *tok, const char *text, size_t len, TokenBuf *out, char *err, size_t errlen) {
    return encode_impl(tok, text, len, out, 0, err, errlen);
}

int tokenizer_encode_special(const Tokenizer *tok, const char *text, size_t len, TokenBuf *out, char *err,
                             size_t errlen) {
    return encode_impl(tok, text, len, out, 1, err, errlen);
}

const char *tokenizer_token_bytes(const Tokenizer *tok, int id, size_t *len) {
    if (!tok || id < 0 || id >= tok->n_vocab) return NULL;
    if (len) *len = tok->len[id];
    return (const char *)tok->bytes + tok->off[id];
}

char *tokenizer_decode(const Tokenizer *tok, const int *ids, size_t n, size_t *len, char *err, size_t errlen) {
    if (!tok) { set_err(err, errlen, "tokenizer: NULL tokenizer"); return NULL; }
    if (n && !ids) { set_err(err, errlen, "tokenizer: NULL ids with count %zu", n); return NULL; }
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= tok->n_vocab) {
            set_err(err, errlen, "tokenizer: token id %d at position %zu is out of range [0, %d)", ids[i], i,
                    tok->n_vocab);
            return NULL;
        }
        total += tok->len[ids[i]];
    }
    char *buf = xmalloc(total + 1), *w = buf;
    for (size_t i = 0; i < n; i++) {
        memcpy(w, tok->bytes + tok->off[ids[i]], tok->len[ids[i]]);
        w += tok->len[ids[i]];
    }
    *w = 0;
    if (len) *len = total;
    return buf;
}

int tokenizer_vocab_size(const Tokenizer *tok) { return tok ? tok->n_vocab : 0; }

/* Test hook (not in the header): small_max = 0 sends every piece through the heap pass. */
void tokenizer_debug_config(Tokenizer *tok, size_t small_max, int use_cache);
void tokenizer_debug_config(Tokenizer *tok, size_t small_max, int use_cache) {
    tok->small_max = small_max < SMALL_MAX ? small_max : SMALL_MAX;
    tok->use_cache = use_cache;
}

/* ---------------------------------------------------------------- loading */

typedef struct {
    const unsigned char *s;
    size_t n, i;
    const char *path;
    char *err;
    size_t errlen;
} JsonParser;

static int json_fail(JsonParser *jp, const char *what) {
    size_t line = 1, col = 1, end = jp->i < jp->n ? jp->i : jp->n;
    for (size_t k = 0; k < end; k++) {
        if (jp->s[k] == '\n') { line++; col = 1; } else col++;
    }
    if (jp->i >= jp->n)
        return set_err(jp->err, jp->errlen, "%s: malformed JSON: %s (unexpected end of file)", jp->path, what);
    return set_err(jp->err, jp->errlen, "%s: malformed JSON at line %zu, column %zu: %s", jp->path, line, col,
                   what);
}

static void json_ws(JsonParser *jp) {
    while (jp->i < jp->n) {
        unsigned char c = jp->s[jp->i];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
        jp->i++;
    }
}

static int hex4(const unsigned char *s, long *v) {
    long x = 0;
    for (int k = 0; k < 4; k++) {
        unsigned char c = s[k];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return -1;
        x = x * 16 + d;
    }
    *v = x;
    return 0;
}

/* Parses a JSON string at jp->i, mapping each character through GPT-2's byte alphabet
 * into raw bytes at dst; *dlen gets their count. */
static int json_token_string(JsonParser *jp, const int16_t u2b[324], unsigned char *dst, size_t *dlen) {
    if (jp->i >= jp->n || jp->s[jp->i] != '"') return json_fail(jp, "expected a string");
    jp->i++;
    size_t w = 0;
    for (;;) {
        if (jp->i >= jp->n) return json_fail(jp, "unterminated string");
        unsigned char c = jp->s[jp->i];
        long cp;
        if (c == '"') { jp->i++; break; }
        if (c < 0x20) return json_fail(jp, "control character inside a string");
        if (c == '\\') {
            if (jp->i + 1 >= jp->n) { jp->i = jp->n; return json_fail(jp, "unterminated escape"); }
            unsigned char e = jp->s[jp->i + 1];
            switch (e) {
            case '"': cp = '"'; break;
            case '\\': cp = '\\'; break;
            case '/': cp = '/'; break;
            case 'b': cp = '\b'; break;
            case 'f': cp = '\f'; break;
            case 'n': cp = '\n'; break;
            case 'r': cp = '\r'; break;
            case 't': cp = '\t'; break;
            case 'u':
                if (jp->n - jp->i < 6) { jp->i = jp->n; return json_fail(jp, "truncated \\u escape"); }
                if (hex4(jp->s + jp->i + 2, &cp)) return json_fail(jp, "bad \\u escape");
                if (cp >= 0xDC00 && cp <= 0xDFFF) return json_fail(jp, "lone low surrogate in \\u escape");
                if (cp >= 0xD800 && cp <= 0xDBFF) {
                    long lo;
                    if (jp->n - jp->i < 12 || jp->s[jp->i + 6] != '\\' || jp->s[jp->i + 7] != 'u' ||
                        hex4(jp->s + jp->i + 8, &lo) || lo < 0xDC00 || lo > 0xDFFF)
                        return json_fail(jp, "high surrogate not followed by a low surrogate");
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                    jp->i += 6;
                }
                jp->i += 4;
                break;
            default: return json_fail(jp, "unknown escape");
            }
            jp->i += 2;
        } else if (c < 0x80) {
            cp = c;
            jp->i++;
        } else {
            size_t k = jp->i;
            cp = utf8_next(jp->s, jp->n, &k);
            if (cp < 0) return json_fail(jp, "invalid UTF-8 inside a string");
            jp->i = k;
        }
        if (cp >= 324 || u2b[cp] < 0) {
            char what[96];
            snprintf(what, sizeof what, "character U+%04lX is not in GPT-2's byte alphabet", (unsigned long)cp);
            return json_fail(jp, what);
        }
        dst[w++] = (unsigned char)u2b[cp];
    }
    *dlen = w;
    return 0;
}

static int json_token_id(JsonParser *jp, long *out) {
    if (jp->i >= jp->n) return json_fail(jp, "expected a token id");
    unsigned char c = jp->s[jp->i];
    if (c == '-') return json_fail(jp, "negative token id");
    if (c < '0' || c > '9') return json_fail(jp, "expected a token id (non-negative integer)");
    if (c == '0' && jp->i + 1 < jp->n && jp->s[jp->i + 1] >= '0' && jp->s[jp->i + 1] <= '9')
        return json_fail(jp, "number with a leading zero");
    long v = 0;
    size_t start = jp->i;
    while (jp->i < jp->n && jp->s[jp->i] >= '0' && jp->s[jp->i] <= '9') {
        if (v < 1000000000L) v = v * 10 + (jp->s[jp->i] - '0');
        jp->i++;
    }
    if (jp->i < jp->n && (jp->s[jp->i] == '.' || jp->s[jp->i] == 'e' || jp->s[jp->i] == 'E'))
        return json_fail(jp, "token id is not an integer");
    if (v >= GPT2_VOCAB_SIZE) {
        jp->i = start;
        char what[96];
        snprintf(what, sizeof what, "token id %s%ld out of range [0, %d)", v >= 1000000000L ? ">" : "", v,
                 GPT2_VOCAB_SIZE);
        return json_fail(jp, what);
    }
    *out = v;
    return 0;
}

static int load_encoder(Tokenizer *t, const char *path, const int16_t u2b[324], char *err, size_t errlen) {
    size_t n;
    char *text = read_file(path, &n, err, errlen);
    if (!text) return -1;
    JsonParser jp = {(const unsigned char *)text, n, 0, path, err, errlen};
    t->bytes = xmalloc(n + 1);
    t->off = xmalloc(GPT2_VOCAB_SIZE * sizeof(uint32_t));
    t->len = xmalloc(GPT2_VOCAB_SIZE * sizeof(uint32_t));
    for (int i = 0; i < GPT2_VOCAB_SIZE; i++) t->len[i] = UINT32_MAX;
    size_t used = 0, count = 0;
    int rc = -1;
    json_ws(&jp);
    if (jp.i >= jp.n || jp.s[jp.i] != '{') { json_fail(&jp, "expected '{'"); goto done; }
    jp.i++;
    json_ws(&jp);
    if (jp.i < jp.n && jp.s[jp.i] == '}') {
        jp.i++;
    } else {
        for (;;) {
            size_t klen = 0;
            long id = 0;
            json_ws(&jp);
            if (json_token_string(&jp, u2b, t->bytes + used, &klen)) goto done;
            json_ws(&jp);
            if (jp.i >= jp.n || jp.s[jp.i] != ':') { json_fail(&jp, "expected ':'"); goto done; }
            jp.i++;
            json_ws(&jp);
            if (json_token_id(&jp, &id)) goto done;
            if (klen == 0) { set_err(err, errlen, "%s: token %ld is the empty string", path, id); goto done; }
            if (t->len[id] != UINT32_MAX) {
                set_err(err, errlen, "%s: token id %ld appears more than once", path, id);
                goto done;
            }
            t->off[id] = (uint32_t)used;
            t->len[id] = (uint32_t)klen;
            used += klen;
            count++;
            json_ws(&jp);
            if (jp.i < jp.n && jp.s[jp.i] == ',') { jp.i++; continue; }
            if (jp.i < jp.n && jp.s[jp.i] == '}') { jp.i++; break; }
            json_fail(&jp, "expected ',' or '}'");
            goto done;
        }
    }
    json_ws(&jp);
    if (jp.i != jp.n) { json_fail(&jp, "trailing characters after the object"); goto done; }
    if (count != GPT2_VOCAB_SIZE) {
        set_err(err, errlen, "%s: holds %zu tokens, expected the %d of GPT-2", path, count, GPT2_VOCAB_SIZE);
        goto done;
    }
    /* count == 50257 distinct ids in [0, 50256]: every id is present. */
    t->tokmap = xmalloc(((size_t)1 << TOKMAP_BITS) * sizeof(int32_t));
    for (size_t i = 0; i < ((size_t)1 << TOKMAP_BITS); i++) t->tokmap[i] = -1;
    for (int id = 0; id < GPT2_VOCAB_SIZE; id++) {
        int32_t o = tokmap_insert(t, id);
        if (o >= 0) { set_err(err, errlen, "%s: ids %d and %d name the same token", path, o, id); goto done; }
    }
    for (int b = 0; b < 256; b++) {
        unsigned char c = (unsigned char)b;
        t->byte_tok[b] = tokmap_find(t, &c, 1);
        if (t->byte_tok[b] < 0) { set_err(err, errlen, "%s: no token for byte 0x%02x", path, b); goto done; }
    }
    if (t->len[TOKEN_EOT] != sizeof EOT_TEXT - 1 ||
        memcmp(t->bytes + t->off[TOKEN_EOT], EOT_TEXT, sizeof EOT_TEXT - 1) != 0) {
        set_err(err, errlen, "%s: id %d is not %s", path, TOKEN_EOT, EOT_TEXT);
        goto done;
    }
    t->n_vocab = GPT2_VOCAB_SIZE;
    rc = 0;
done:
    free(text);
    return rc;
}

/* Maps a merge symbol (UTF-8 in GPT-2's byte alphabet) to raw bytes; -1 if impossible. */
static long symbol_bytes(const unsigned char *s, size_t n, const int16_t u2b[324], unsigned char *dst) {
    size_t i = 0, w = 0;
    while (i < n) {
        long cp = utf8_next(s, n, &i);
        if (cp < 0 || cp >= 324 || u2b[cp] < 0) return -1;
        dst[w++] = (unsigned char)u2b[cp];
    }
    return (long)w;
}

static int load_merges(Tokenizer *t, const char *path, const int16_t u2b[324], char *err, size_t errlen) {
    size_t n;
    char *text = read_file(path, &n, err, errlen);
    if (!text) return -1;
    const unsigned char *s = (const unsigned char *)text;
    t->merges = xmalloc(((size_t)1 << MERGE_BITS) * sizeof(MergeSlot));
    for (size_t i = 0; i < ((size_t)1 << MERGE_BITS); i++) t->merges[i].merged = -1;
    unsigned char *buf = xmalloc(2 * n + 2);   /* room for both halves and their concatenation */
    int rc = -1;
    size_t pos = 0, lineno = 0, count = 0, blank_at = 0;
    while (pos < n) {
        const unsigned char *nl = memchr(s + pos, '\n', n - pos);
        size_t end = nl ? (size_t)(nl - s) : n, ll = end - pos;
        const unsigned char *line = s + pos;
        pos = nl ? end + 1 : n;
        lineno++;
        if (ll && line[ll - 1] == '\r') ll--;
        if (lineno == 1) {
            if (ll < 9 || memcmp(line, "#version:", 9) != 0) {
                set_err(err, errlen, "%s: line 1 is not a '#version:' header", path);
                goto done;
            }
            continue;
        }
        if (ll == 0) { if (!blank_at) blank_at = lineno; continue; }
        if (blank_at) { set_err(err, errlen, "%s: line %zu: blank line inside the merges", path, blank_at); goto done; }
        const unsigned char *sp = memchr(line, ' ', ll);
        if (!sp || sp == line || sp == line + ll - 1 || memchr(sp + 1, ' ', (size_t)(line + ll - sp - 1))) {
            set_err(err, errlen, "%s: line %zu: expected two symbols separated by one space", path, lineno);
            goto done;
        }
        size_t la = (size_t)(sp - line), lb = ll - la - 1;
        long ba = symbol_bytes(line, la, u2b, buf), bb = symbol_bytes(sp + 1, lb, u2b, buf + ba);
        if (ba < 0 || bb < 0) {
            set_err(err, errlen, "%s: line %zu: symbol outside GPT-2's byte alphabet", path, lineno);
            goto done;
        }
        int32_t a = tokmap_find(t, buf, (size_t)ba), b = tokmap_find(t, buf + ba, (size_t)bb);
        int32_t m = tokmap_find(t, buf, (size_t)(ba + bb));
        if (a < 0 || b < 0 || m < 0) {
            set_err(err, errlen, "%s: line %zu: %s is not in the vocabulary", path, lineno,
                    a < 0 ? "the first symbol" : b < 0 ? "the second symbol" : "the merged symbol");
            goto done;
        }
        if (count >= N_MERGES) {
            set_err(err, errlen, "%s: holds more than the %d merges of GPT-2", path, N_MERGES);
            goto done;
        }
        if (merge_insert(t, a, b, (uint32_t)count, m)) {
            set_err(err, errlen, "%s: line %zu: duplicate merge", path, lineno);
            goto done;
        }
        count++;
    }
    if (lineno == 0) { set_err(err, errlen, "%s: empty file", path); goto done; }
    if (count != N_MERGES) {
        set_err(err, errlen, "%s: holds %zu merges, expected the %d of GPT-2", path, count, N_MERGES);
        goto done;
    }
    rc = 0;
done:
    free(buf);
    free(text);
    return rc;
}

Tokenizer *tokenizer_load(const char *encoder_json_path, const char *vocab_bpe_path, char *err, size_t errlen) {
    if (err && errlen) err[0] = 0;
    if (!encoder_json_path || !vocab_bpe_path) {
        set_err(err, errlen, "tokenizer: missing path to encoder.json or vocab.bpe");
        return NULL;
    }
    uint32_t b2u[256];
    int16_t u2b[324];
    byte_maps(b2u, u2b);
    Tokenizer *t = xcalloc(1, sizeof *t);
    t->small_max = SMALL_MAX;
    t->use_cache = 1;
    if (load_encoder(t, encoder_json_path, u2b, err, errlen) || load_merges(t, vocab_bpe_path, u2b, err, errlen)) {
        tokenizer_free(t);
        return NULL;
    }
    int ecode;
    PCRE2_SIZE eoff;
    t->re = pcre2_compile((PCRE2_SPTR)GPT2_PATTERN, PCRE2_ZERO_TERMINATED,
                          PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &ecode, &eoff, NULL);
    if (!t->re) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(ecode, msg, sizeof msg);
        set_err(err, errlen, "tokenizer: cannot compile the GPT-2 regex with PCRE2: %s", (char *)msg);
        tokenizer_free(t);
        return NULL;
    }
    t->jit = pcre2_jit_compile(t->re, PCRE2_JIT_COMPLETE) == 0;
    t->cache = xmalloc(((size_t)1 << CACHE_BITS) * sizeof(*t->cache));
    for (size_t i = 0; i < ((size_t)1 << CACHE_BITS); i++) atomic_init(&t->cache[i], NULL);
    return t;
}

void tokenizer_free(Tokenizer *tok) {
    if (!tok) return;
    if (tok->cache) {
        for (size_t i = 0; i < ((size_t)1 << CACHE_BITS); i++)
            free(atomic_load_explicit(&tok->cache[i], memory_order_relaxed));
        free((void *)tok->cache);
    }
    if (tok->re) pcre2_code_free(tok->re);
    free(tok->bytes);
    free(tok->off);
    free(tok->len);
    free(tok->tokmap);
    free(tok->merges);
    free(tok);
}
