/* Tests of src/data/data.c: shard round trip and corruption, the loader's windows, order, rank
 * slices and resume, and prepare on small texts and the mirrored TinyStories head. */
#include "data.h"
#include "test.h"
#include "util.h"
#include <ftw.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char tmpdir[256];
static char err[1024];

static const char *tpath(const char *name) {
    static char bufs[4][512];
    static int k;
    char *b = bufs[k++ & 3];
    snprintf(b, 512, "%s/%s", tmpdir, name);
    return b;
}

static void write_bytes(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) { perror(path); exit(1); }
    if (n) fwrite(p, 1, n, f);
    fclose(f);
}

static int file_exists(const char *path) { struct stat st; return stat(path, &st) == 0; }

static int has(const char *hay, const char *needle) { return strstr(hay, needle) != NULL; }

/* ---------------------------------------------------------------- shards */

static uint16_t *seq_tokens(size_t n, uint16_t mod) {
    uint16_t *t = xmalloc(n * sizeof *t);
    for (size_t i = 0; i < n; i++) t[i] = (uint16_t)(i % mod);
    return t;
}

static void test_shard_roundtrip(void) {
    size_t n = 1000;
    uint16_t *tok = xmalloc(n * sizeof *tok);
    Rng r;
    rng_seed(&r, 7);
    for (size_t i = 0; i < n; i++) tok[i] = (uint16_t)(rng_u64(&r) % GPT2_VOCAB_SIZE);
    tok[0] = 0; tok[1] = GPT2_VOCAB_SIZE - 1;
    const char *p = tpath("rt.bin");
    CHECK(shard_write(p, tok, n, GPT2_VOCAB_SIZE, err, sizeof err) == 0, "%s", err);

    size_t len;
    unsigned char *raw = (unsigned char *)read_file(p, &len, err, sizeof err);
    CHECK(raw && len == SHARD_HEADER_BYTES + 2 * n, "size %zu", len);
    if (raw && len >= 64) {
        CHECK(memcmp(raw, "MTSHARD1", 8) == 0, "magic");
        CHECK(raw[8] == 1 && raw[9] == 0 && raw[10] == 0 && raw[11] == 0, "version le");
        CHECK(raw[12] == (50257 & 255) && raw[13] == (50257 >> 8) && raw[14] == 0, "vocab le");
        CHECK(raw[16] == (1000 & 255) && raw[17] == (1000 >> 8) && raw[18] == 0, "n le");
        uint64_t sum = 0;
        for (int i = 7; i >= 0; i--) sum = (sum << 8) | raw[24 + i];
        CHECK(sum == fnv1a64(tok, 2 * n, FNV1A64_INIT), "checksum field");
        int zero = 1;
        for (int i = 32; i < 64; i++) zero &= raw[i] == 0;
        CHECK(zero, "reserved bytes zero");
        CHECK(raw[64] == (tok[0] & 255) && raw[66] == (tok[1] & 255) && raw[67] == (tok[1] >> 8), "tokens le");
    }
    free(raw);

    Shard s;
    CHECK(shard_open(&s, p, err, sizeof err) == 0, "%s", err);
    CHECK(s.n_tokens == n && s.vocab_size == GPT2_VOCAB_SIZE, "n %zu vocab %d", s.n_tokens, s.vocab_size);
    CHECK(s.tokens && memcmp(s.tokens, tok, 2 * n) == 0, "tokens differ");
    shard_close(&s);
    CHECK(s.map == NULL && s.tokens == NULL, "close clears");
    CHECK(!file_exists(tpath("rt.bin.tmp")), "no temp left");

    /* Overwriting an existing shard, and an empty one. */
    CHECK(shard_write(p, tok, 0, 300, err, sizeof err) == 0, "%s", err);
    CHECK(shard_open(&s, p, err, sizeof err) == 0, "%s", err);
    CHECK(s.n_tokens == 0 && s.vocab_size == 300, "empty shard");
    shard_close(&s);

    /* shard_write refuses what shard_open would refuse. */
    err[0] = 0;
    CHECK(shard_write(p, tok, n, 1000, err, sizeof err) != 0, "token >= vocab written");
    CHECK(has(err, "out of range") && has(err, p), "err: %s", err);
    CHECK(shard_write(p, tok, n, 70000, err, sizeof err) != 0, "vocab 70000 written");
    CHECK(shard_write(tpath("no/such/dir/x.bin"), tok, n, GPT2_VOCAB_SIZE, err, sizeof err) != 0, "bad dir written");
    CHECK(has(err, "no/such/dir"), "err: %s", err);
    free(tok);
}

/* Writes a valid shard of n tokens to name, returns its bytes (caller frees). */
static unsigned char *valid_shard_bytes(const char *name, size_t n, size_t *len) {
    uint16_t *tok = seq_tokens(n, 50000);
    CHECK(shard_write(tpath(name), tok, n, GPT2_VOCAB_SIZE, err, sizeof err) == 0, "%s", err);
    free(tok);
    return (unsigned char *)read_file(tpath(name), len, err, sizeof err);
}

static void expect_open_fails(const char *path, const char *what) {
    Shard s;
    memset(&s, 0x5a, sizeof s);
    err[0] = 0;
    int rc = shard_open(&s, path, err, sizeof err);
    CHECK(rc != 0, "%s: opened", path);
    CHECK(has(err, what), "expected \"%s\" in: %s", what, err);
    CHECK(has(err, path), "path missing from: %s", err);
    CHECK(s.map == NULL && s.tokens == NULL && s.n_tokens == 0, "shard not cleared on failure");
    if (rc == 0) shard_close(&s);
}

static void test_shard_corruption(void) {
    size_t len, n = 1000;
    unsigned char *b = valid_shard_bytes("ok.bin", n, &len);
    if (!b) return;
    unsigned char *c = xmalloc(len);

    memcpy(c, b, len); c[0] = 'X';
    write_bytes(tpath("magic.bin"), c, len);
    expect_open_fails(tpath("magic.bin"), "not a meshtrain shard");

    write_bytes(tpath("trunc.bin"), b, len - 20);
    expect_open_fails(tpath("trunc.bin"), "truncated: header says 1000 tokens, file holds 990");

    write_bytes(tpath("trunc_header.bin"), b, 30);
    expect_open_fails(tpath("trunc_header.bin"), "truncated");

    write_bytes(tpath("short_foreign.bin"), "hello\n", 6);
    expect_open_fails(tpath("short_foreign.bin"), "not a meshtrain shard");

    memcpy(c, b, len);
    write_bytes(tpath("long.bin"), c, len - 1); /* odd length: 999.5 tokens */
    expect_open_fails(tpath("long.bin"), "truncated");
    unsigned char *l2 = xmalloc(len + 2);
    memcpy(l2, b, len); l2[len] = l2[len + 1] = 0;
    write_bytes(tpath("extra.bin"), l2, len + 2);
    expect_open_fails(tpath("extra.bin"), "size mismatch");
    free(l2);

    memcpy(c, b, len); c[64 + 2 * 500] ^= 0x01;
    write_bytes(tpath("flip.bin"), c, len);
    expect_open_fails(tpath("flip.bin"), "checksum mismatch");

    memcpy(c, b, len); c[8] = 2;
    write_bytes(tpath("version.bin"), c, len);
    expect_open_fails(tpath("version.bin"), "version 2");

    memcpy(c, b, len); c[40] = 1;
    write_bytes(tpath("reserved.bin"), c, len);
    expect_open_fails(tpath("reserved.bin"), "reserved");

    /* A token >= vocab_size under a correct checksum. */
    memcpy(c, b, len);
    c[64 + 2 * 7] = 60000 & 255; c[64 + 2 * 7 + 1] = 60000 >> 8;
    uint64_t sum = fnv1a64(c + 64, 2 * n, FNV1A64_INIT);
    for (int i = 0; i < 8; i++) c[24 + i] = (unsigned char)(sum >> (8 * i));
    write_bytes(tpath("range.bin"), c, len);
    expect_open_fails(tpath("range.bin"), "token 60000 out of range");

    write_bytes(tpath("empty.bin"), "", 0);
    expect_open_fails(tpath("empty.bin"), "empty");

    expect_open_fails(tpath("missing.bin"), "No such file");
    expect_open_fails(tmpdir, "not a regular file");

    Shard s;
    CHECK(shard_open(&s, tpath("ok.bin"), err, sizeof err) == 0, "%s", err);
    shard_close(&s);
    free(b);
    free(c);
}

/* ---------------------------------------------------------------- loader */

/* tokens[i] = i, so a window's first input is its start position. */
static Shard seq_shard(const char *name, size_t n) {
    uint16_t *tok = seq_tokens(n, 50000);
    Shard s;
    memset(&s, 0, sizeof s);
    CHECK(shard_write(tpath(name), tok, n, GPT2_VOCAB_SIZE, err, sizeof err) == 0, "%s", err);
    CHECK(shard_open(&s, tpath(name), err, sizeof err) == 0, "%s", err);
    free(tok);
    return s;
}

static void test_loader_windows(void) {
    Shard s = seq_shard("seq.bin", 2000);
    Loader l;
    int B = 4, T = 16;
    CHECK(loader_init(&l, &s, B, T, 0, 1, 42, 1, err, sizeof err) == 0, "%s", err);
    CHECK(l.n_windows == 1999 / 16 && l.batches_per_epoch == 1999 / 16 / 4, "n_windows %zu bpe %zu", l.n_windows,
          l.batches_per_epoch);
    int in[64], tg[64];
    char *seen = xcalloc(2000, 1);
    for (size_t g = 0; g < l.batches_per_epoch; g++) {
        loader_next(&l, in, tg);
        for (int b = 0; b < B; b++) {
            int start = in[b * T];
            CHECK(start % T == 0 && start / T < (int)l.n_windows, "window start %d", start);
            CHECK(!seen[start], "window %d repeated within an epoch", start);
            seen[start] = 1;
            for (int t = 0; t < T; t++) {
                CHECK(in[b * T + t] == s.tokens[start + t], "input");
                CHECK(tg[b * T + t] == s.tokens[start + t + 1], "target not shifted by one");
            }
        }
    }
    LoaderState st = loader_get_state(&l);
    CHECK(st.epoch == 1 && st.window == 0, "after one epoch: epoch %llu window %llu", (unsigned long long)st.epoch,
          (unsigned long long)st.window);
    /* The last window may end on the shard's last token. */
    size_t nw = l.n_windows;
    CHECK((nw - 1) * T + T < s.n_tokens, "last window fits");
    free(seen);
    loader_free(&l);

    /* A shard of exactly k*T + 1 tokens has k windows and uses its last token as a target. */
    Shard s2 = seq_shard("exact.bin", 4 * 8 + 1);
    CHECK(loader_init(&l, &s2, 4, 8, 0, 1, 1, 0, err, sizeof err) == 0, "%s", err);
    int in2[32], tg2[32];
    loader_next(&l, in2, tg2);
    CHECK(tg2[31] == 32 && in2[0] == 0, "exact windows: last target %d", tg2[31]);
    loader_free(&l);
    shard_close(&s2);
    shard_close(&s);
}

static void run_loader(Loader *l, int n, int *out) {
    int *tg = xmalloc((size_t)l->B * l->T * sizeof *tg);
    for (int i = 0; i < n; i++) loader_next(l, out + (size_t)i * l->B * l->T, tg);
    free(tg);
}

static void test_loader_order(void) {
    Shard s = seq_shard("seq.bin", 2000);
    int B = 4, T = 16, nb = 70, per = B * T; /* 70 batches cross two epoch boundaries (31 per epoch) */
    int *a = xmalloc((size_t)nb * per * sizeof *a), *b = xmalloc((size_t)nb * per * sizeof *b);
    Loader l1, l2;

    CHECK(loader_init(&l1, &s, B, T, 0, 1, 42, 1, err, sizeof err) == 0, "%s", err);
    CHECK(loader_init(&l2, &s, B, T, 0, 1, 42, 1, err, sizeof err) == 0, "%s", err);
    run_loader(&l1, nb, a);
    run_loader(&l2, nb, b);
    CHECK(memcmp(a, b, (size_t)nb * per * sizeof *a) == 0, "same seed, different batches");
    /* Each epoch is shuffled differently. */
    CHECK(memcmp(a, a + 31 * per, (size_t)31 * per * sizeof *a) != 0, "epochs 0 and 1 in the same order");
    loader_free(&l1); loader_free(&l2);

    CHECK(loader_init(&l1, &s, B, T, 0, 1, 43, 1, err, sizeof err) == 0, "%s", err);
    run_loader(&l1, nb, b);
    CHECK(memcmp(a, b, (size_t)per * sizeof *a) != 0, "seeds 42 and 43 give the same first batch");
    loader_free(&l1);

    /* shuffle = 0: windows in file order, every epoch. */
    CHECK(loader_init(&l1, &s, B, T, 0, 1, 42, 0, err, sizeof err) == 0, "%s", err);
    run_loader(&l1, nb, a);
    int ok = 1;
    for (int g = 0; g < nb; g++)
        for (int k = 0; k < B; k++) ok &= a[(size_t)g * per + k * T] == ((g % 31) * B + k) * T;
    CHECK(ok, "unshuffled order");
    loader_free(&l1);
    free(a); free(b);
    shard_close(&s);
}

/* Ranks of world 2 and 4 together take exactly the single-process global batch. */
static void test_loader_ranks(void) {
    Shard s = seq_shard("seq.bin", 2000);
    int G = 8, T = 16, nb = 40; /* 124 windows -> 15 global batches per epoch */
    int *ref = xmalloc((size_t)nb * G * T * sizeof *ref);
    Loader l;
    CHECK(loader_init(&l, &s, G, T, 0, 1, 5, 1, err, sizeof err) == 0, "%s", err);
    CHECK(l.batches_per_epoch == 15, "bpe %zu", l.batches_per_epoch);
    run_loader(&l, nb, ref);
    loader_free(&l);
    for (int world = 2; world <= 4; world *= 2) {
        int B = G / world;
        int *got = xmalloc((size_t)nb * G * T * sizeof *got);
        for (int r = 0; r < world; r++) {
            int *mine = xmalloc((size_t)nb * B * T * sizeof *mine);
            CHECK(loader_init(&l, &s, B, T, r, world, 5, 1, err, sizeof err) == 0, "%s", err);
            CHECK(l.batches_per_epoch == 15, "bpe %zu", l.batches_per_epoch);
            run_loader(&l, nb, mine);
            loader_free(&l);
            for (int g = 0; g < nb; g++)
                memcpy(got + ((size_t)g * G + (size_t)r * B) * T, mine + (size_t)g * B * T, (size_t)B * T * sizeof *got);
            free(mine);
        }
        CHECK(memcmp(got, ref, (size_t)nb * G * T * sizeof *got) == 0, "world %d: ranks' union is not the global batch", world);
        /* Disjoint: within a global batch no two ranks (no two rows) share a window. */
        int disjoint = 1;
        for (int g = 0; g < nb; g++)
            for (int i = 0; i < G; i++)
                for (int j = i + 1; j < G; j++) disjoint &= got[((size_t)g * G + i) * T] != got[((size_t)g * G + j) * T];
        CHECK(disjoint, "world %d: ranks overlap", world);
        free(got);
    }
    free(ref);
    shard_close(&s);
}

/* loader_batch_tokens, on any rank, before each loader_next: exactly the distinct input
 * tokens of the global batch (the union of every rank's inputs), ascending; across an
 * epoch's end too. Tokens repeat (i*i mod 97), so the sets are small. */
static void test_loader_batch_tokens(void) {
    size_t n = 3000;
    uint16_t *tok = xmalloc(n * sizeof *tok);
    for (size_t i = 0; i < n; i++) tok[i] = (uint16_t)((i * i) % 97);
    Shard s;
    memset(&s, 0, sizeof s);
    CHECK(shard_write(tpath("sq.bin"), tok, n, GPT2_VOCAB_SIZE, err, sizeof err) == 0, "%s", err);
    CHECK(shard_open(&s, tpath("sq.bin"), err, sizeof err) == 0, "%s", err);
    int world = 4, B = 2, T = 8, V = 90, G = B * world;  /* V < 97: tokens >= V are left out */
    Loader ls[4];
    for (int r = 0; r < world; r++) CHECK(loader_init(&ls[r], &s, B, T, r, world, 3, 1, err, sizeof err) == 0, "%s", err);
    unsigned char *seen = xmalloc((size_t)V);
    int *rows = xmalloc((size_t)V * sizeof *rows), *in = xmalloc((size_t)G * T * sizeof *in);
    int *tg = xmalloc((size_t)B * T * sizeof *tg), ok = 1, steps = (int)(2 * ls[0].batches_per_epoch + 1);
    for (int k = 0; k < steps; k++) {
        size_t got = loader_batch_tokens(&ls[k % world], V, seen, rows);
        for (int r = 0; r < world; r++) loader_next(&ls[r], in + (size_t)r * B * T, tg);
        unsigned char want[97] = {0};
        for (int i = 0; i < G * T; i++) want[in[i]] = 1;
        size_t m = 0;
        for (int v = 0; v < V; v++)
            if (want[v]) ok &= m < got && rows[m++] == v;
        ok &= m == got;
    }
    CHECK(ok, "the batch's tokens differ from the union of the ranks' inputs");
    for (int r = 0; r < world; r++) loader_free(&ls[r]);
    free(tok); free(seen); free(rows); free(in); free(tg);
    shard_close(&s);
}

static void test_loader_resume(void) {
    Shard s = seq_shard("seq.bin", 2000);
    int B = 2, T = 16, per = B * T;
    for (int world = 1; world <= 2; world++) {
        Loader a, b;
        CHECK(loader_init(&a, &s, B, T, world - 1, world, 9, 1, err, sizeof err) == 0, "%s", err);
        int *x = xmalloc((size_t)100 * per * sizeof *x), *y = xmalloc((size_t)100 * per * sizeof *y);
        size_t k = a.batches_per_epoch + 3; /* resume inside the second epoch */
        run_loader(&a, (int)k, x);
        LoaderState st = loader_get_state(&a);
        CHECK(st.epoch == 1 && st.window == 3u * B * world, "state %llu/%llu", (unsigned long long)st.epoch,
              (unsigned long long)st.window);
        run_loader(&a, 100, x);
        CHECK(loader_init(&b, &s, B, T, world - 1, world, 9, 1, err, sizeof err) == 0, "%s", err);
        CHECK(loader_set_state(&b, st, err, sizeof err) == 0, "%s", err);
        run_loader(&b, 100, y);
        CHECK(memcmp(x, y, (size_t)100 * per * sizeof *x) == 0, "world %d: resumed loader differs", world);
        LoaderState sa = loader_get_state(&a), sb = loader_get_state(&b);
        CHECK(sa.epoch == sb.epoch && sa.window == sb.window, "states differ after resume");

        LoaderState bad = {0, b.n_windows + 1};
        err[0] = 0;
        CHECK(loader_set_state(&b, bad, err, sizeof err) != 0, "window past the epoch accepted");
        CHECK(has(err, "window"), "err: %s", err);
        loader_free(&a); loader_free(&b);
        free(x); free(y);
    }
    shard_close(&s);
}

/* A position saved by 2 ranks of B=2 continues on 1 rank of B=4 and on 4 ranks of B=1 with
 * the same windows: the global batch is the same, only its split differs. */
static void test_loader_resume_other_world(void) {
    Shard s = seq_shard("seq.bin", 2000);
    int T = 16;
    Loader a0, a1;
    CHECK(loader_init(&a0, &s, 2, T, 0, 2, 5, 1, err, sizeof err) == 0, "%s", err);
    CHECK(loader_init(&a1, &s, 2, T, 1, 2, 5, 1, err, sizeof err) == 0, "%s", err);
    int in[4 * 16], tg[4 * 16];
    for (int i = 0; i < 5; i++) { loader_next(&a0, in, tg); loader_next(&a1, in, tg); }
    LoaderState st = loader_get_state(&a0);
    Loader one, ref;
    CHECK(loader_init(&one, &s, 4, T, 0, 1, 5, 1, err, sizeof err) == 0, "%s", err);
    CHECK(loader_init(&ref, &s, 4, T, 0, 1, 5, 1, err, sizeof err) == 0, "%s", err);
    for (int i = 0; i < 5; i++) loader_next(&ref, in, tg);
    CHECK(loader_set_state(&one, st, err, sizeof err) == 0, "%s", err);
    int want[4 * 16], got[4 * 16], part[16];
    for (int i = 0; i < 3; i++) {
        loader_next(&ref, want, tg);
        loader_next(&one, got, tg);
        CHECK(!memcmp(want, got, sizeof want), "1 rank after 2: batch %d differs", i);
        /* and 4 ranks of B=1 from the same state */
        for (int r = 0; r < 4; r++) {
            Loader q;
            CHECK(loader_init(&q, &s, 1, T, r, 4, 5, 1, err, sizeof err) == 0, "%s", err);
            LoaderState sq = st;
            sq.window += (uint64_t)i * 4;
            CHECK(loader_set_state(&q, sq, err, sizeof err) == 0, "%s", err);
            loader_next(&q, part, tg);
            CHECK(!memcmp(want + r * T, part, sizeof part), "rank %d of 4: batch %d differs", r, i);
            loader_free(&q);
        }
    }
    loader_free(&a0); loader_free(&a1); loader_free(&one); loader_free(&ref);
    shard_close(&s);
}

static void test_loader_init_failure(void) {
    Shard s = seq_shard("small.bin", 100); /* 6 windows of T=16 */
    Loader l;
    err[0] = 0;
    CHECK(loader_init(&l, &s, 4, 16, 0, 2, 1, 1, err, sizeof err) != 0, "8 windows from 6");
    CHECK(has(err, "batch_size 4") && has(err, "context_len 16") && has(err, "100 tokens"), "err: %s", err);
    CHECK(l.order == NULL, "order allocated on failure");
    CHECK(loader_init(&l, &s, 3, 16, 1, 2, 1, 1, err, sizeof err) == 0, "6 windows for 2 ranks of 3: %s", err);
    CHECK(l.batches_per_epoch == 1, "bpe %zu", l.batches_per_epoch);
    loader_free(&l);
    CHECK(loader_init(&l, &s, 0, 16, 0, 1, 1, 1, err, sizeof err) != 0, "B = 0");
    CHECK(loader_init(&l, &s, 1, 0, 0, 1, 1, 1, err, sizeof err) != 0, "T = 0");
    CHECK(loader_init(&l, &s, 1, 16, 2, 2, 1, 1, err, sizeof err) != 0, "rank 2 of 2");
    shard_close(&s);
    Shard e = seq_shard("empty_shard.bin", 0);
    CHECK(loader_init(&l, &e, 1, 1, 0, 1, 1, 1, err, sizeof err) != 0, "empty shard");
    Shard one = seq_shard("one.bin", 1);
    CHECK(loader_init(&l, &one, 1, 1, 0, 1, 1, 1, err, sizeof err) != 0, "one token has no window");
    shard_close(&one);
    Shard two = seq_shard("two.bin", 2);
    CHECK(loader_init(&l, &two, 1, 1, 0, 1, 1, 1, err, sizeof err) == 0, "two tokens: one window: %s", err);
    int in, tg;
    loader_next(&l, &in, &tg);
    loader_next(&l, &in, &tg);
    CHECK(in == 0 && tg == 1 && l.st.epoch == 2, "one-window epochs");
    loader_free(&l);
    shard_close(&two);
    shard_close(&e);
}

/* ---------------------------------------------------------------- prepare */

static Tokenizer *tok;

static int *shard_ints(const char *path, size_t *n) {
    Shard s;
    *n = 0;
    if (shard_open(&s, path, err, sizeof err) != 0) { CHECK(0, "%s", err); return NULL; }
    int *v = xmalloc((s.n_tokens + 1) * sizeof *v);
    for (size_t i = 0; i < s.n_tokens; i++) v[i] = s.tokens[i];
    *n = s.n_tokens;
    CHECK(s.vocab_size == GPT2_VOCAB_SIZE, "vocab %d", s.vocab_size);
    shard_close(&s);
    return v;
}

/* EOT + encode(story) for each story, as one id list. */
static TokenBuf expected_ids(const char *const *stories, int n) {
    TokenBuf b = {0};
    for (int i = 0; i < n; i++) {
        TokenBuf one = {0};
        CHECK(tokenizer_encode(tok, stories[i], strlen(stories[i]), &one, err, sizeof err) == 0, "%s", err);
        b.ids = xrealloc(b.ids, (b.n + one.n + 1) * sizeof *b.ids);
        b.ids[b.n++] = TOKEN_EOT;
        memcpy(b.ids + b.n, one.ids, one.n * sizeof *one.ids);
        b.n += one.n;
        tokenbuf_free(&one);
    }
    return b;
}

static void check_shard_is(const char *path, const char *const *stories, int n) {
    size_t got_n;
    int *got = shard_ints(path, &got_n);
    TokenBuf want = expected_ids(stories, n);
    CHECK(got && got_n == want.n && memcmp(got, want.ids, want.n * sizeof *got) == 0, "%s: %zu tokens, expected %zu", path,
          got_n, want.n);
    /* And the decoded text is "<|endoftext|>story" for each story. */
    size_t dlen = 0;
    char *dec = got ? tokenizer_decode(tok, got, got_n, &dlen, err, sizeof err) : NULL;
    size_t elen = 0;
    for (int i = 0; i < n; i++) elen += 13 + strlen(stories[i]);
    char *exp = xmalloc(elen + 1), *p = exp;
    for (int i = 0; i < n; i++) p += sprintf(p, "<|endoftext|>%s", stories[i]);
    CHECK(dec && dlen == elen && memcmp(dec, exp, elen) == 0, "%s decodes to [%s]", path, dec ? dec : err);
    free(exp); free(dec); free(got);
    tokenbuf_free(&want);
}

static void test_prepare_small(void) {
    if (!tok) { CHECK(0, "no tokenizer"); return; }
    const char *text =
        "Once upon a time there was a cat.\n"
        "<|endoftext|>\n"
        "  The dog ran \xe2\x80\x94 fast; caf\xc3\xa9 \xf0\x9f\x90\xb6 \xe6\x97\xa5\xe6\x9c\xac \xf4\x8f\xbf\xbf.  \n"
        "<|endoftext|>\r\n"
        "\n \t\n"
        "<|endoftext|>\n"
        "Third story\r\nwith two lines.\n"
        "   <|endoftext|>  \n"
        "Fourth has <|endoftext|> inside a line, and a \"quote\".\n"
        "<|endoftext|>\n"
        "\n"
        "A fifth story cut off by trunc";
    const char *stories[] = {
        "Once upon a time there was a cat.",
        "The dog ran \xe2\x80\x94 fast; caf\xc3\xa9 \xf0\x9f\x90\xb6 \xe6\x97\xa5\xe6\x9c\xac \xf4\x8f\xbf\xbf.",
        "Third story\r\nwith two lines.",
        "Fourth has <|endoftext|> inside a line, and a \"quote\".",
    };
    write_bytes(tpath("small.txt"), text, strlen(text));
    PrepareStats st;
    char out[512];
    snprintf(out, sizeof out, "%s", tpath("prep/a/b"));
    double t0 = now_seconds();
    CHECK(data_prepare(tok, tpath("small.txt"), out, 0.3, &st, err, sizeof err) == 0, "%s", err);
    double around = now_seconds() - t0;
    CHECK(st.n_stories == 4, "stories %zu", st.n_stories);
    CHECK(st.n_bytes == strlen(text), "bytes %zu", st.n_bytes);
    char tp[600], vp[600];
    snprintf(tp, sizeof tp, "%s/train.bin", out);
    snprintf(vp, sizeof vp, "%s/val.bin", out);
    check_shard_is(tp, stories, 2); /* ceil(0.3 * 4) = 2 validation stories */
    check_shard_is(vp, stories + 2, 2);
    size_t nt, nv;
    free(shard_ints(tp, &nt));
    free(shard_ints(vp, &nv));
    CHECK(st.n_train_tokens == nt && st.n_val_tokens == nv, "stats %zu/%zu vs %zu/%zu", st.n_train_tokens,
          st.n_val_tokens, nt, nv);
    /* seconds is this call's own duration, in seconds: more than nothing, and no more than the
     * time measured around the call (not a clock reading, milliseconds, or left at 0) */
    CHECK(st.seconds > 0 && st.seconds <= around, "seconds %g, but the call took %g s", st.seconds, around);

    /* At least one validation story, and at least one left to train on. */
    CHECK(data_prepare(tok, tpath("small.txt"), out, 0.0, &st, err, sizeof err) == 0, "%s", err);
    check_shard_is(tp, stories, 3);
    check_shard_is(vp, stories + 3, 1);
    CHECK(data_prepare(tok, tpath("small.txt"), out, 0.99, &st, err, sizeof err) == 0, "%s", err);
    check_shard_is(tp, stories, 1);
    check_shard_is(vp, stories + 1, 3);
    /* 0.7 * 10 must not round up to 8 */
    char ten[400] = "";
    for (int i = 0; i < 10; i++) sprintf(ten + strlen(ten), "Story %d.\n<|endoftext|>\n", i);
    write_bytes(tpath("ten.txt"), ten, strlen(ten));
    CHECK(data_prepare(tok, tpath("ten.txt"), out, 0.7, &st, err, sizeof err) == 0, "%s", err);
    const char *tens[] = {"Story 0.", "Story 1.", "Story 2.", "Story 3.", "Story 4.",
                          "Story 5.", "Story 6.", "Story 7.", "Story 8.", "Story 9."};
    check_shard_is(tp, tens, 3);
    check_shard_is(vp, tens + 3, 7);
    CHECK(data_prepare(tok, tpath("ten.txt"), out, 0.1, &st, err, sizeof err) == 0, "%s", err);
    check_shard_is(vp, tens + 9, 1);
    CHECK(data_prepare(tok, tpath("ten.txt"), out, 0.11, &st, err, sizeof err) == 0, "%s", err);
    check_shard_is(vp, tens + 8, 2);
}

static void expect_prepare_fails(const char *name, const void *bytes, size_t n, const char *what) {
    if (bytes) write_bytes(tpath(name), bytes, n);
    char out[512];
    snprintf(out, sizeof out, "%s", tpath("refused"));
    err[0] = 0;
    CHECK(data_prepare(tok, tpath(name), out, 0.1, NULL, err, sizeof err) != 0, "%s accepted", name);
    CHECK(has(err, what), "%s: expected \"%s\" in: %s", name, what, err);
    CHECK(has(err, tpath(name)), "%s: path missing from: %s", name, err);
    CHECK(!file_exists(out), "%s: output written on failure", name);
}

static void test_prepare_refuses(void) {
    if (!tok) { CHECK(0, "no tokenizer"); return; }
    expect_prepare_fails("empty.txt", "", 0, "empty");
    expect_prepare_fails("missing.txt", NULL, 0, "No such file");
    const char bad1[] = "Hello.\n<|endoftext|>\nWorld \xff.\n<|endoftext|>\n";
    expect_prepare_fails("bad1.txt", bad1, sizeof bad1 - 1, "byte offset 27");
    const char bad2[] = "caf\xc3\xa9 ok\n<|endoftext|>\nX\xc0\xaf\n<|endoftext|>\n"; /* overlong '/' */
    expect_prepare_fails("bad2.txt", bad2, sizeof bad2 - 1, "byte offset 24");
    const char bad3[] = "a\n<|endoftext|>\nb\xed\xa0\x80\n<|endoftext|>\n"; /* surrogate */
    expect_prepare_fails("bad3.txt", bad3, sizeof bad3 - 1, "byte offset 17");
    const char bad4[] = "a\n<|endoftext|>\nb\xe2\x82\n<|endoftext|>\n"; /* a cut sequence inside a story */
    expect_prepare_fails("bad4.txt", bad4, sizeof bad4 - 1, "byte offset 17");
    const char bad5[] = "a\n<|endoftext|>\n\xf4\x90\x80\x80\n<|endoftext|>\n"; /* above U+10FFFF */
    expect_prepare_fails("bad5.txt", bad5, sizeof bad5 - 1, "UTF-8");
    const char bad6[] = "a\n<|endoftext|>\n\x80\n<|endoftext|>\n"; /* lone continuation byte */
    expect_prepare_fails("bad6.txt", bad6, sizeof bad6 - 1, "byte offset 16");
    const char none[] = "Just one story with no separator after it.\n";
    expect_prepare_fails("none.txt", none, sizeof none - 1, "no complete story");
    const char seps[] = "<|endoftext|>\n  \n<|endoftext|>\n";
    expect_prepare_fails("seps.txt", seps, sizeof seps - 1, "no complete story");
    const char inline_sep[] = "a story <|endoftext|> with the separator inside a line\n";
    expect_prepare_fails("inline.txt", inline_sep, sizeof inline_sep - 1, "no complete story");
    const char one[] = "Only story.\n<|endoftext|>\nand a cut one";
    expect_prepare_fails("one.txt", one, sizeof one - 1, "only 1");
    const char two[] = "A.\n<|endoftext|>\nB.\n<|endoftext|>\n";
    write_bytes(tpath("two.txt"), two, sizeof two - 1);
    CHECK(data_prepare(tok, tpath("two.txt"), tpath("refused"), 1.0, NULL, err, sizeof err) != 0, "val_fraction 1");
    CHECK(data_prepare(tok, tpath("two.txt"), tpath("refused"), -0.1, NULL, err, sizeof err) != 0, "val_fraction -0.1");
    CHECK(!file_exists(tpath("refused")), "output written on failure");
    /* A file cut in the middle of a character (head -c) loses only its cut-off last story. */
    const char cut[] = "A.\n<|endoftext|>\nB \xe2\x80\x94.\n<|endoftext|>\nC \xf0\x9f\x90";
    write_bytes(tpath("cut.txt"), cut, sizeof cut - 1);
    PrepareStats st;
    CHECK(data_prepare(tok, tpath("cut.txt"), tpath("cut"), 0.5, &st, err, sizeof err) == 0, "%s", err);
    CHECK(st.n_stories == 2, "stories %zu", st.n_stories);
    const char cut2[] = "A.\n<|endoftext|>\nB.\n<|endoftext|>\nC \xf0\x9f\x41";
    expect_prepare_fails("cut2.txt", cut2, sizeof cut2 - 1, "byte offset 36");
    /* The output directory must be creatable. */
    write_bytes(tpath("afile"), "x", 1);
    err[0] = 0;
    CHECK(data_prepare(tok, tpath("two.txt"), tpath("afile/sub"), 0.5, NULL, err, sizeof err) != 0, "out_dir under a file");
    CHECK(has(err, "afile"), "err: %s", err);
}

static void test_prepare_tinystories(void) {
    if (!tok) { CHECK(0, "no tokenizer"); return; }
    const char *path = "data/tinystories/TinyStories-train.head-2MiB.txt";
    if (!file_exists(path)) { CHECK(0, "%s missing: run make data", path); return; }
    PrepareStats st;
    char out[512];
    snprintf(out, sizeof out, "%s", tpath("ts"));
    CHECK(data_prepare(tok, path, out, 0.05, &st, err, sizeof err) == 0, "%s", err);
    /* 2316 separator lines, each closing a non-empty story; the cut story after the last is dropped */
    CHECK(st.n_stories == 2316, "stories %zu", st.n_stories);
    CHECK(st.n_bytes == 2097152, "bytes %zu", st.n_bytes);
    size_t total = st.n_train_tokens + st.n_val_tokens;
    CHECK(total > 400000 && total < 700000, "tokens %zu", total);
    CHECK(st.n_val_tokens > total / 40 && st.n_val_tokens < total / 10, "val tokens %zu of %zu", st.n_val_tokens, total);
    printf("     TinyStories head: %zu stories, %zu train + %zu val tokens, %.2f s\n", st.n_stories, st.n_train_tokens,
           st.n_val_tokens, st.seconds);
    size_t n;
    int *v = shard_ints(tpath("ts/train.bin"), &n);
    CHECK(v && n == st.n_train_tokens && v[0] == TOKEN_EOT, "train shard");
    size_t eots = 0;
    for (size_t i = 0; v && i < n; i++) eots += v[i] == TOKEN_EOT;
    CHECK(eots == 2316 - 116, "train EOTs %zu (ceil(0.05 * 2316) = 116 val stories)", eots);
    free(v);
    v = shard_ints(tpath("ts/val.bin"), &n);
    CHECK(v && n == st.n_val_tokens && v[0] == TOKEN_EOT, "val shard");
    free(v);
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb; (void)flag; (void)ftw;
    return remove(path);
}

int main(void) {
    snprintf(tmpdir, sizeof tmpdir, "/tmp/meshtrain-test-data-XXXXXX");
    if (!mkdtemp(tmpdir)) { perror("mkdtemp"); return 1; }
    RUN(test_shard_roundtrip);
    RUN(test_shard_corruption);
    RUN(test_loader_windows);
    RUN(test_loader_order);
    RUN(test_loader_ranks);
    RUN(test_loader_batch_tokens);
    RUN(test_loader_resume);
    RUN(test_loader_resume_other_world);
    RUN(test_loader_init_failure);
    tok = tokenizer_load("data/gpt2/encoder.json", "data/gpt2/vocab.bpe", err, sizeof err);
    if (!tok) fprintf(stderr, "  cannot load the tokenizer: %s\n", err);
    RUN(test_prepare_small);
    RUN(test_prepare_refuses);
    RUN(test_prepare_tinystories);
    if (tok) tokenizer_free(tok);
    nftw(tmpdir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    return TEST_SUMMARY();
}
