/* Tests for the GPT-2 BPE tokenizer: llama.cpp's reference vectors, hand-checked ids,
 * round trips on TinyStories and on arbitrary bytes, the heap merge path against the
 * array path, concurrent use, and load/decode errors. Run from the repository root. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* memmem */
#endif
#include "test.h"
#include "tokenizer.h"
#include "util.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define ENC_JSON "data/gpt2/encoder.json"
#define VOCAB_BPE "data/gpt2/vocab.bpe"
#define VEC_INP "data/test_vectors/llamacpp-ggml-vocab-gpt-2.gguf.inp"
#define VEC_OUT "data/test_vectors/llamacpp-ggml-vocab-gpt-2.gguf.out"
#define TINY "data/tinystories/TinyStories-train.head-2MiB.txt"

/* Test hook in tokenizer.c: small_max = 0 sends every piece through the heap merge pass. */
void tokenizer_debug_config(Tokenizer *tok, size_t small_max, int use_cache);

static Tokenizer *g_tok;

static Tokenizer *load_default(void) {
    char err[512] = "";
    Tokenizer *t = tokenizer_load(ENC_JSON, VOCAB_BPE, err, sizeof err);
    if (!t) fprintf(stderr, "  cannot load tokenizer: %s\n", err);
    return t;
}

/* Encodes text (special: <|endoftext|> -> EOT) into a fresh buffer; returns -1 on error. */
static int enc(const Tokenizer *t, const char *text, size_t len, int special, TokenBuf *b) {
    char err[256] = "";
    memset(b, 0, sizeof *b);
    int rc = special ? tokenizer_encode_special(t, text, len, b, err, sizeof err)
                     : tokenizer_encode(t, text, len, b, err, sizeof err);
    if (rc) fprintf(stderr, "  encode failed: %s\n", err);
    return rc;
}

/* decode(encode(x)) == x, and every id is in range. */
static int round_trips(const Tokenizer *t, const char *text, size_t len, int special) {
    TokenBuf b;
    if (enc(t, text, len, special, &b)) return 0;
    for (size_t i = 0; i < b.n; i++)
        if (b.ids[i] < 0 || b.ids[i] >= GPT2_VOCAB_SIZE) { tokenbuf_free(&b); return 0; }
    char err[256] = "";
    size_t dl = 0;
    char *d = tokenizer_decode(t, b.ids, b.n, &dl, err, sizeof err);
    int ok = d && dl == len && memcmp(d, text, len) == 0 && d[dl] == 0;
    if (!ok && d) {
        size_t k = 0;
        while (k < len && k < dl && d[k] == text[k]) k++;
        fprintf(stderr, "  round trip differs at byte %zu (len %zu vs %zu)\n", k, len, dl);
    }
    free(d);
    tokenbuf_free(&b);
    return ok;
}

static int ids_equal(const TokenBuf *b, const int *want, size_t n) {
    return b->n == n && (n == 0 || memcmp(b->ids, want, n * sizeof(int)) == 0);
}

static void print_ids(const char *what, const int *ids, size_t n) {
    fprintf(stderr, "  %s:", what);
    for (size_t i = 0; i < n && i < 64; i++) fprintf(stderr, " %d", ids[i]);
    fprintf(stderr, n > 64 ? " ...\n" : "\n");
}

static void test_load(void) {
    CHECK(g_tok != NULL, "load %s + %s", ENC_JSON, VOCAB_BPE);
    if (!g_tok) return;
    CHECK(tokenizer_vocab_size(g_tok) == GPT2_VOCAB_SIZE, "%d", tokenizer_vocab_size(g_tok));
    size_t l = 0;
    const char *s = tokenizer_token_bytes(g_tok, TOKEN_EOT, &l);
    CHECK(s && l == 13 && memcmp(s, "<|endoftext|>", 13) == 0, "EOT bytes");
    s = tokenizer_token_bytes(g_tok, 220, &l);           /* "Ġ" = the space byte */
    CHECK(s && l == 1 && s[0] == ' ', "token 220 is a space");
    s = tokenizer_token_bytes(g_tok, 188, &l);           /* "Ā" = byte 0x00 */
    CHECK(s && l == 1 && s[0] == 0, "token 188 is NUL");
    s = tokenizer_token_bytes(g_tok, 15496, &l);
    CHECK(s && l == 5 && memcmp(s, "Hello", 5) == 0, "token 15496 is Hello");
    CHECK(tokenizer_token_bytes(g_tok, -1, &l) == NULL, "id -1");
    CHECK(tokenizer_token_bytes(g_tok, GPT2_VOCAB_SIZE, &l) == NULL, "id 50257");
}

/* llama.cpp's vectors: inputs are each followed by "\n__ggml_vocab_test__\n" (so the file
 * ends with the separator); .out holds one line of space-separated ids per input. */
static void test_reference_vectors(void) {
    if (!g_tok) { CHECK(0, "no tokenizer"); return; }
    char err[256] = "";
    size_t ni, no;
    char *inp = read_file(VEC_INP, &ni, err, sizeof err);
    CHECK(inp != NULL, "%s", err);
    char *out = read_file(VEC_OUT, &no, err, sizeof err);
    CHECK(out != NULL, "%s", err);
    if (!inp || !out) { free(inp); free(out); return; }
    const char *sep = "\n__ggml_vocab_test__\n";
    size_t sl = strlen(sep), pos = 0, opos = 0, count = 0;
    while (pos < ni) {
        const char *hit = memmem(inp + pos, ni - pos, sep, sl);
        CHECK(hit != NULL, "input %zu is not followed by the separator", count);
        if (!hit) break;
        size_t len = (size_t)(hit - (inp + pos));
        /* the matching line of .out */
        CHECK(opos < no, "no output line for input %zu", count);
        if (opos >= no) break;
        char *nl = memchr(out + opos, '\n', no - opos);
        size_t lend = nl ? (size_t)(nl - out) : no;
        int want[1024];
        size_t nw = 0;
        char *p = out + opos;
        while (p < out + lend) {
            while (p < out + lend && *p == ' ') p++;
            if (p >= out + lend) break;
            char *q;
            long v = strtol(p, &q, 10);
            if (q == p || nw >= 1024) { CHECK(0, "bad .out line %zu", count + 1); break; }
            want[nw++] = (int)v;
            p = q;
        }
        opos = lend + 1;
        TokenBuf b;
        if (enc(g_tok, inp + pos, len, 0, &b) == 0) {
            CHECK(ids_equal(&b, want, nw), "vector %zu (%zu bytes) differs", count + 1, len);
            if (!ids_equal(&b, want, nw)) { print_ids("got ", b.ids, b.n); print_ids("want", want, nw); }
        } else {
            CHECK(0, "vector %zu: encode failed", count + 1);
        }
        tokenbuf_free(&b);
        CHECK(round_trips(g_tok, inp + pos, len, 0), "vector %zu round trip", count + 1);
        count++;
        pos += len + sl;
    }
    CHECK(count == 46, "%zu vectors (expected 46)", count);
    CHECK(opos >= no, "output lines left over after %zu vectors", count);
    free(inp);
    free(out);
}

static void test_hand_checked(void) {
    if (!g_tok) { CHECK(0, "no tokenizer"); return; }
    TokenBuf b;
    static const int hello[] = {15496, 995};
    CHECK(enc(g_tok, "Hello world", 11, 0, &b) == 0 && ids_equal(&b, hello, 2), "Hello world");
    tokenbuf_free(&b);
    CHECK(enc(g_tok, "Hello world", 11, 1, &b) == 0 && ids_equal(&b, hello, 2), "Hello world (special)");
    tokenbuf_free(&b);

    static const int sp_eot[] = {220, TOKEN_EOT};
    const char *s = " <|endoftext|>";
    CHECK(enc(g_tok, s, strlen(s), 1, &b) == 0 && ids_equal(&b, sp_eot, 2), "' <|endoftext|>' special");
    if (!ids_equal(&b, sp_eot, 2)) print_ids("got", b.ids, b.n);
    tokenbuf_free(&b);
    /* As ordinary text: pieces " <|", "endoftext", "|>" -> several ordinary tokens; the ids
     * are those of OpenAI's encoder.py (run offline on the same files). */
    static const int sp_eot_plain[] = {1279, 91, 437, 1659, 5239, 91, 29};
    CHECK(enc(g_tok, s, strlen(s), 0, &b) == 0 && ids_equal(&b, sp_eot_plain, 7), "plain encode");
    CHECK(b.n > 1, "%zu tokens", b.n);
    for (size_t i = 0; i < b.n; i++) CHECK(b.ids[i] != TOKEN_EOT, "EOT in plain encoding at %zu", i);
    tokenbuf_free(&b);
    CHECK(round_trips(g_tok, s, strlen(s), 0), "plain round trip");
    CHECK(round_trips(g_tok, s, strlen(s), 1), "special round trip");

    static const int multi[] = {TOKEN_EOT, 64, TOKEN_EOT, TOKEN_EOT, 198};  /* 'a' = 64, '\n' = 198 */
    s = "<|endoftext|>a<|endoftext|><|endoftext|>\n";
    CHECK(enc(g_tok, s, strlen(s), 1, &b) == 0 && ids_equal(&b, multi, 5), "several EOTs");
    tokenbuf_free(&b);
    /* A partial marker is ordinary text. */
    s = "<|endoftext|";
    CHECK(enc(g_tok, s, strlen(s), 1, &b) == 0 && b.n > 1, "partial marker");
    for (size_t i = 0; i < b.n; i++) CHECK(b.ids[i] != TOKEN_EOT, "EOT from a partial marker");
    tokenbuf_free(&b);

    /* Contractions are case-sensitive as in GPT-2; a lone NUL is token 188. */
    static const int dont[] = {9099, 470};                 /* "don" "'t" */
    CHECK(enc(g_tok, "don't", 5, 0, &b) == 0 && ids_equal(&b, dont, 2), "don't");
    if (!ids_equal(&b, dont, 2)) print_ids("got", b.ids, b.n);
    tokenbuf_free(&b);
    static const int nul[] = {188};
    CHECK(enc(g_tok, "\0", 1, 0, &b) == 0 && ids_equal(&b, nul, 1), "NUL");
    tokenbuf_free(&b);
}

static void test_empty(void) {
    if (!g_tok) { CHECK(0, "no tokenizer"); return; }
    TokenBuf b;
    CHECK(enc(g_tok, "", 0, 0, &b) == 0 && b.n == 0, "empty encode");
    tokenbuf_free(&b);
    CHECK(enc(g_tok, NULL, 0, 1, &b) == 0 && b.n == 0, "NULL, 0 encode");
    tokenbuf_free(&b);
    char err[128] = "";
    size_t l = 99;
    char *d = tokenizer_decode(g_tok, NULL, 0, &l, err, sizeof err);
    CHECK(d && l == 0 && d[0] == 0, "empty decode");
    free(d);
    CHECK(round_trips(g_tok, "", 0, 0), "empty round trip");
    /* Appending: encode adds to what the buffer holds. */
    memset(&b, 0, sizeof b);
    CHECK(tokenizer_encode(g_tok, "Hello", 5, &b, err, sizeof err) == 0, "%s", err);
    CHECK(tokenizer_encode(g_tok, " world", 6, &b, err, sizeof err) == 0, "%s", err);
    static const int hello[] = {15496, 995};
    CHECK(ids_equal(&b, hello, 2), "appended ids");
    tokenbuf_free(&b);
    CHECK(b.ids == NULL && b.n == 0 && b.cap == 0, "tokenbuf_free resets");
    tokenbuf_free(&b);
}

static void test_tinystories_round_trip(void) {
    if (!g_tok) { CHECK(0, "no tokenizer"); return; }
    char err[256] = "";
    size_t n;
    char *text = read_file(TINY, &n, err, sizeof err);
    CHECK(text != NULL, "%s", err);
    if (!text) return;
    CHECK(round_trips(g_tok, text, n, 0), "plain");
    CHECK(round_trips(g_tok, text, n, 1), "special");
    /* The special encoding has one EOT per marker and is shorter than the plain one. */
    size_t markers = 0;
    for (const char *p = text; (p = memmem(p, n - (size_t)(p - text), "<|endoftext|>", 13)); p += 13) markers++;
    TokenBuf a, b;
    CHECK(enc(g_tok, text, n, 1, &a) == 0 && enc(g_tok, text, n, 0, &b) == 0, "encode");
    size_t eots = 0;
    for (size_t i = 0; i < a.n; i++) eots += a.ids[i] == TOKEN_EOT;
    for (size_t i = 0; i < b.n; i++) CHECK(b.ids[i] != TOKEN_EOT, "EOT in the plain encoding");
    CHECK(markers > 2000 && eots == markers, "%zu EOT tokens for %zu markers", eots, markers);
    CHECK(a.n < b.n, "special %zu vs plain %zu tokens", a.n, b.n);
    /* about 4 bytes per token on English prose */
    CHECK(a.n > n / 6 && a.n < n / 3, "%zu tokens for %zu bytes", a.n, n);
    /* Warm cache gives the same ids as the cold one. */
    TokenBuf c;
    CHECK(enc(g_tok, text, n, 1, &c) == 0 && ids_equal(&c, a.ids, a.n), "second encode differs");
    tokenbuf_free(&a);
    tokenbuf_free(&b);
    tokenbuf_free(&c);
    free(text);
}

/* Random bytes biased towards the UTF-8 edge cases. */
static size_t random_text(Rng *r, char *buf, size_t maxlen) {
    static const char *const frags[] = {
        "\x80", "\xbf", "\xc0\x80", "\xc1\xbf", "\xe0\x80\x80", "\xf0\x80\x80\x80", "\xed\xa0\x80",
        "\xf4\x90\x80\x80", "\xf5", "\xff", "\xfe", "\xc3", "\xe2\x82", "\xf0\x9f\x98", "\xc3\xa9",
        "\xe2\x82\xac", "\xf0\x9f\x98\x81", "\xe4\xb8\xad", "\xd0\xbd", " ", "  ", "\n", "\t", "\r\n",
        "\xc2\xa0", "\xe3\x80\x80", "'s", "'t", "'ll", "'", "Hello", " world", "123", " 45", "!!", "\0",
        "<|endoftext|>", "<|", "\xe1\x9e\x80", "\xef\xbb\xbf", "\xcc\x81",
    };
    size_t nf = sizeof frags / sizeof frags[0], len = (size_t)(rng_u64(r) % (maxlen + 1)), w = 0;
    int mode = (int)(rng_u64(r) % 3);
    while (w < len) {
        if (mode == 0 || rng_u64(r) % 2) {
            buf[w++] = (char)(rng_u64(r) & 0xff);
        } else {
            size_t k = (size_t)(rng_u64(r) % nf);
            size_t fl = k == 35 ? 1 : strlen(frags[k]);   /* frags[35] is a NUL byte */
            if (w + fl > len) fl = len - w;
            memcpy(buf + w, frags[k], fl);
            w += fl;
        }
    }
    return len;
}

static void test_random_bytes_round_trip(void) {
    if (!g_tok) { CHECK(0, "no tokenizer"); return; }
    Rng r;
    rng_seed(&r, 12345);
    char *buf = xmalloc(1 << 20);
    int bad = 0;
    for (int it = 0; it < 3000; it++) {
        size_t len = random_text(&r, buf, it < 2000 ? 64 : 4096);
        if (!round_trips(g_tok, buf, len, it & 1)) {
            bad++;
            if (bad <= 3) CHECK(0, "random string %d (%zu bytes)", it, len);
        }
    }
    CHECK(bad == 0, "%d random strings failed", bad);
    /* 1 MiB of uniformly random bytes */
    for (size_t i = 0; i < (1 << 20); i++) buf[i] = (char)(rng_u64(&r) & 0xff);
    CHECK(round_trips(g_tok, buf, 1 << 20, 0), "1 MiB random bytes");
    /* every single byte value alone, and all 256 in a row */
    for (int v = 0; v < 256; v++) {
        char c = (char)v;
        CHECK(round_trips(g_tok, &c, 1, 0), "byte 0x%02x", v);
        buf[v] = c;
    }
    CHECK(round_trips(g_tok, buf, 256, 0), "bytes 0..255");
    free(buf);
}

/* Long pieces go through the heap pass; they must neither hang nor change the result. */
static void test_long_pieces(void) {
    if (!g_tok) { CHECK(0, "no tokenizer"); return; }
    size_t n = 1 << 20;
    char *buf = xmalloc(n + 1);
    const char fills[] = {' ', 'a', '-', '7', '\n', '\xff'};
    for (size_t f = 0; f < sizeof fills; f++) {
        memset(buf, fills[f], n);
        buf[n] = 'x';
        double t0 = now_seconds();
        CHECK(round_trips(g_tok, buf, n, 0), "1 MiB of 0x%02x", (unsigned char)fills[f]);
        CHECK(round_trips(g_tok, buf, n + 1, 0), "1 MiB of 0x%02x + x", (unsigned char)fills[f]);
        CHECK(now_seconds() - t0 < 10, "too slow on fill 0x%02x", (unsigned char)fills[f]);
    }
    /* long mixed letters: compare with an all-heap tokenizer below via the same text */
    free(buf);
}

/* Every piece through the heap pass (no cache) must give the same ids as the default. */
static void test_heap_path_matches(void) {
    if (!g_tok) { CHECK(0, "no tokenizer"); return; }
    Tokenizer *h = load_default();
    CHECK(h != NULL, "second load");
    if (!h) return;
    tokenizer_debug_config(h, 0, 0);
    char err[256] = "";
    size_t n;
    char *text = read_file(TINY, &n, err, sizeof err);
    CHECK(text != NULL, "%s", err);
    if (text) {
        size_t m = n < (512u << 10) ? n : (512u << 10);
        TokenBuf a, b;
        CHECK(enc(g_tok, text, m, 1, &a) == 0 && enc(h, text, m, 1, &b) == 0, "encode");
        CHECK(ids_equal(&a, b.ids, b.n), "TinyStories: heap %zu vs array %zu tokens", b.n, a.n);
        tokenbuf_free(&a);
        tokenbuf_free(&b);
        free(text);
    }
    text = read_file(VEC_INP, &n, err, sizeof err);
    if (text) {
        TokenBuf a, b;
        CHECK(enc(g_tok, text, n, 0, &a) == 0 && enc(h, text, n, 0, &b) == 0, "encode");
        CHECK(ids_equal(&a, b.ids, b.n), "vectors: heap path differs");
        tokenbuf_free(&a);
        tokenbuf_free(&b);
        free(text);
    }
    Rng r;
    rng_seed(&r, 777);
    char *buf = xmalloc(4096);
    int bad = 0;
    for (int it = 0; it < 500; it++) {
        size_t len = random_text(&r, buf, 300);
        TokenBuf a, b;
        if (enc(g_tok, buf, len, 0, &a) || enc(h, buf, len, 0, &b) || !ids_equal(&a, b.ids, b.n)) bad++;
        tokenbuf_free(&a);
        tokenbuf_free(&b);
    }
    CHECK(bad == 0, "%d random strings differ between the heap and array passes", bad);
    free(buf);
    tokenizer_free(h);
}

typedef struct { const Tokenizer *t; const char *text; size_t len; TokenBuf out; int rc; } Job;

static void *encode_job(void *arg) {
    Job *j = arg;
    char err[256];
    memset(&j->out, 0, sizeof j->out);
    j->rc = tokenizer_encode_special(j->t, j->text, j->len, &j->out, err, sizeof err);
    return NULL;
}

/* A const Tokenizer (with its shared piece cache) used from several threads at once. */
static void test_threads(void) {
    if (!g_tok) { CHECK(0, "no tokenizer"); return; }
    Tokenizer *t = load_default();
    CHECK(t != NULL, "load");
    if (!t) return;
    char err[256] = "";
    size_t n;
    char *text = read_file(TINY, &n, err, sizeof err);
    CHECK(text != NULL, "%s", err);
    if (!text) { tokenizer_free(t); return; }
    enum { NT = 4 };
    Job jobs[NT];
    pthread_t th[NT];
    size_t part = n / NT;
    for (int i = 0; i < NT; i++) {
        /* overlapping slices, so threads race to cache the same pieces */
        jobs[i] = (Job){t, text + (size_t)i * part / 2, part, {0}, -1};
        CHECK(pthread_create(&th[i], NULL, encode_job, &jobs[i]) == 0, "pthread_create");
    }
    for (int i = 0; i < NT; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < NT; i++) {
        TokenBuf want;
        CHECK(jobs[i].rc == 0, "thread %d failed", i);
        CHECK(enc(g_tok, jobs[i].text, jobs[i].len, 1, &want) == 0, "reference");
        CHECK(ids_equal(&jobs[i].out, want.ids, want.n), "thread %d differs", i);
        tokenbuf_free(&want);
        tokenbuf_free(&jobs[i].out);
    }
    free(text);
    tokenizer_free(t);
}

static void write_bytes(const char *path, const char *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return;
    fwrite(data, 1, n, f);
    fclose(f);
}

/* Expects tokenizer_load to fail with a message naming `names`. */
static void expect_load_error(const char *enc_path, const char *bpe_path, const char *names, const char *what) {
    char err[512] = "";
    Tokenizer *t = tokenizer_load(enc_path, bpe_path, err, sizeof err);
    CHECK(t == NULL, "%s: load should fail", what);
    tokenizer_free(t);
    CHECK(err[0] != 0, "%s: empty message", what);
    CHECK(strstr(err, names) != NULL, "%s: message does not name %s: %s", what, names, err);
    CHECK(strchr(err, '\n') == NULL, "%s: message has several lines: %s", what, err);
}

static void test_load_errors(void) {
    char err[256] = "";
    size_t ne = 0, nb = 0;
    char *ej = read_file(ENC_JSON, &ne, err, sizeof err);
    char *vb = read_file(VOCAB_BPE, &nb, err, sizeof err);
    CHECK(ej && vb, "%s", err);
    if (!ej || !vb) { free(ej); free(vb); return; }
    char pe[64], pb[64];
    snprintf(pe, sizeof pe, "/tmp/meshtrain_tok_%d_enc.json", (int)getpid());
    snprintf(pb, sizeof pb, "/tmp/meshtrain_tok_%d_vocab.bpe", (int)getpid());

    expect_load_error("/tmp/meshtrain_no_such_encoder.json", VOCAB_BPE, "no_such_encoder.json", "missing encoder");
    expect_load_error(ENC_JSON, "/tmp/meshtrain_no_such_vocab.bpe", "no_such_vocab.bpe", "missing vocab");

    /* truncated encoder.json, at several points */
    size_t cuts[] = {0, 1, 1000, ne / 2, ne - 1};
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
        write_bytes(pe, ej, cuts[i]);
        expect_load_error(pe, VOCAB_BPE, pe, "truncated encoder.json");
    }
    /* one entry too few: drop the last entry */
    {
        char *last = strstr(ej, ", \"<|endoftext|>\": 50256}");
        CHECK(last != NULL, "EOT entry");
        if (last) {
            size_t k = (size_t)(last - ej);
            char *m = xmalloc(k + 2);
            memcpy(m, ej, k);
            m[k] = '}';
            write_bytes(pe, m, k + 1);
            expect_load_error(pe, VOCAB_BPE, pe, "50256 entries");
            /* duplicate id: the last entry says 50255 */
            char *m2 = xmalloc(ne + 8);
            memcpy(m2, ej, ne);
            memcpy(m2 + ne - 6, "50255}", 6);
            write_bytes(pe, m2, ne);
            expect_load_error(pe, VOCAB_BPE, pe, "duplicate id");
            /* id out of range */
            memcpy(m2 + ne - 6, "50257}", 6);
            write_bytes(pe, m2, ne);
            expect_load_error(pe, VOCAB_BPE, pe, "id 50257");
            /* a float id */
            memcpy(m2, ej, ne);
            memcpy(m2 + ne - 1, ".0}", 3);
            write_bytes(pe, m2, ne + 2);
            expect_load_error(pe, VOCAB_BPE, pe, "float id");
            /* trailing garbage */
            memcpy(m2, ej, ne);
            memcpy(m2 + ne, " x", 2);
            write_bytes(pe, m2, ne + 2);
            expect_load_error(pe, VOCAB_BPE, pe, "trailing garbage");
            free(m);
            free(m2);
        }
    }
    /* bad escapes */
    {
        const char *bad[] = {"{\"\\q\": 0}", "{\"\\u00\": 0}", "{\"\\ud800\": 0}", "{\"a\" 0}", "[]",
                             "{\"\\u2603\": 0}", "{\"a\": -1}", "{\"\x01\": 0}", "{\"\xff\": 0}", "{}"};
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
            write_bytes(pe, bad[i], strlen(bad[i]));
            expect_load_error(pe, VOCAB_BPE, pe, bad[i]);
        }
    }
    /* vocab.bpe without its header line */
    {
        const char *nl = memchr(vb, '\n', nb);
        CHECK(nl != NULL, "header line");
        if (nl) {
            size_t skip = (size_t)(nl - vb) + 1;
            write_bytes(pb, vb + skip, nb - skip);
            expect_load_error(ENC_JSON, pb, pb, "no header");
        }
        /* header only */
        write_bytes(pb, "#version: 0.2\n", 14);
        expect_load_error(ENC_JSON, pb, pb, "no merges");
        write_bytes(pb, "", 0);
        expect_load_error(ENC_JSON, pb, pb, "empty vocab.bpe");
        /* truncated: the last merge line cut */
        write_bytes(pb, vb, nb - 20);
        expect_load_error(ENC_JSON, pb, pb, "truncated vocab.bpe");
        /* a merge of unknown symbols */
        char *m = xmalloc(nb + 64);
        memcpy(m, vb, nb);
        memcpy(m + nb, "zzzq yyyq\n", 10);
        write_bytes(pb, m, nb + 10);
        expect_load_error(ENC_JSON, pb, pb, "unknown symbols");
        /* a line with three symbols */
        memcpy(m, vb, nb);
        char *l2 = (char *)memchr(m, '\n', nb) + 1;   /* "Ġ t" */
        char *sp = memchr(l2, ' ', 8);
        if (sp) *sp = '\n';                    /* "Ġ\nt": lines with one symbol */
        write_bytes(pb, m, nb);
        expect_load_error(ENC_JSON, pb, pb, "one-symbol line");
        free(m);
    }
    /* CRLF line endings are accepted */
    {
        char *m = xmalloc(2 * nb + 2);
        size_t w = 0;
        for (size_t i = 0; i < nb; i++) {
            if (vb[i] == '\n') m[w++] = '\r';
            m[w++] = vb[i];
        }
        write_bytes(pb, m, w);
        Tokenizer *t = tokenizer_load(ENC_JSON, pb, err, sizeof err);
        CHECK(t != NULL, "CRLF vocab.bpe: %s", err);
        tokenizer_free(t);
        free(m);
    }
    remove(pe);
    remove(pb);
    free(ej);
    free(vb);
}

static void test_decode_errors(void) {
    if (!g_tok) { CHECK(0, "no tokenizer"); return; }
    char err[256] = "";
    size_t l = 0;
    int ids[] = {15496, GPT2_VOCAB_SIZE};
    char *d = tokenizer_decode(g_tok, ids, 2, &l, err, sizeof err);
    CHECK(d == NULL, "id 50257 decoded");
    CHECK(err[0] != 0, "empty message");
    free(d);
    err[0] = 0;
    int neg[] = {-1};
    d = tokenizer_decode(g_tok, neg, 1, &l, err, sizeof err);
    CHECK(d == NULL && err[0] != 0, "id -1 decoded");
    free(d);
    int big[] = {0x7fffffff};
    d = tokenizer_decode(g_tok, big, 1, &l, err, sizeof err);
    CHECK(d == NULL, "INT_MAX decoded");
    free(d);
    int ok[] = {15496, 995, TOKEN_EOT};
    d = tokenizer_decode(g_tok, ok, 3, &l, err, sizeof err);
    CHECK(d && l == 24 && strcmp(d, "Hello world<|endoftext|>") == 0, "decode");
    free(d);
}

int main(void) {
    g_tok = load_default();
    RUN(test_load);
    RUN(test_reference_vectors);
    RUN(test_hand_checked);
    RUN(test_empty);
    RUN(test_tinystories_round_trip);
    RUN(test_random_bytes_round_trip);
    RUN(test_long_pieces);
    RUN(test_heap_path_matches);
    RUN(test_threads);
    RUN(test_load_errors);
    RUN(test_decode_errors);
    tokenizer_free(g_tok);
    return TEST_SUMMARY();
}
