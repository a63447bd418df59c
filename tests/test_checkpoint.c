/* Checkpoint round trips (one process, and shards of W ranks read back on other layouts),
 * corruption and missing-shard detection, atomic replacement and clean-up. */
#include <dirent.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "checkpoint.h"
#include "ops.h"
#include "test.h"
#include "util.h"

static const ModelConfig CFG = MODEL_CONFIG(101, 16, 2, 2, 8, 0);

static void fill(Model *m, AdamState *o) {
    Rng r;
    rng_seed(&r, 3);
    for (size_t i = 0; i < m->n_flat; i++) {
        o->m[i] = rng_normal(&r);
        o->v[i] = rng_uniform(&r);
    }
    model_init_weights(m, 11);
    o->step = 17;
}

static CkptHeader header(int step) {
    CkptHeader h = {0};
    h.vocab_size = 101; h.embed_dim = 16; h.n_heads = 2; h.n_layers = 2; h.context_len = 8;
    h.batch_size = 4; h.step = step; h.adam_step = 17; h.loader_epoch = 2; h.loader_window = 9; h.has_optim = 1;
    return h;
}

/* Files in dir whose name contains `part`. */
static int count_files(const char *dir, const char *part) {
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d))) n += e->d_name[0] != '.' && strstr(e->d_name, part) != NULL;
    if (d) closedir(d);
    return n;
}

static void remove_dir(const char *dir) {
    DIR *d = opendir(dir);
    struct dirent *e;
    char p[512];
    while (d && (e = readdir(d)))
        if (e->d_name[0] != '.') { snprintf(p, sizeof p, "%s/%s", dir, e->d_name); unlink(p); }
    if (d) closedir(d);
    rmdir(dir);
}

static void shard_name(char *out, size_t len, const char *path, int step, int rank, int world) {
    snprintf(out, len, "%s.s%08d.r%d-of-%d", path, step, rank, world);
}

/* Byte `off` of a file, xor `x`. */
static void flip_byte(const char *path, long off, int x) {
    size_t len;
    char err[256], *buf = read_file(path, &len, err, sizeof err);
    if (off < 0) off += (long)len;
    buf[off] ^= (char)x;
    write_file_atomic(path, buf, len, err, sizeof err);
    free(buf);
}

/* Keeps the first `keep` bytes (keep < 0: all but the last -keep). */
static void truncate_file(const char *path, long keep) {
    size_t len;
    char err[256], *buf = read_file(path, &len, err, sizeof err);
    write_file_atomic(path, buf, keep < 0 ? len - (size_t)-keep : (size_t)keep, err, sizeof err);
    free(buf);
}

static int same_state(const Model *a, const AdamState *oa, const Model *b, const AdamState *ob) {
    TensorInfo ta[32], tb[32];
    int n = model_tensors(a, ta, 32), bad = 0;
    model_tensors(b, tb, 32);
    for (int i = 0; i < n; i++) {
        size_t k = (size_t)ta[i].rows * ta[i].cols * 4;
        bad += memcmp(a->params + ta[i].offset, b->params + tb[i].offset, k) != 0;
        if (ob)
            bad += memcmp(oa->m + ta[i].offset, ob->m + tb[i].offset, k) ||
                   memcmp(oa->v + ta[i].offset, ob->v + tb[i].offset, k);
    }
    return !bad;
}

/* Rank r of W's share of every unit: [r*s, (r+1)*s) of the unit's packed range with
 * s = ceil(n/W), the last shorter (empty ones left out). Pointers go to p/m/v at the model's
 * flat offsets (flat = 1) or at packed offsets (flat = 0, for one buffer per rank). */
static int shard_ranges(const Model *a, int r, int W, float *p, float *m, float *v, int flat, StateRange *out) {
    int n = 0;
    uint64_t packed = 0;
    for (int u = 0; u < a->n_units; u++) {
        uint64_t nu = a->units[u].n, s = (nu + W - 1) / W, lo = r * s, hi = lo + s < nu ? lo + s : nu;
        if (lo < hi) {
            size_t at = (flat ? a->units[u].offset : packed) + lo;
            out[n++] = (StateRange){packed + lo, hi - lo, p + at, m ? m + at : NULL, v ? v + at : NULL};
        }
        packed += nu;
    }
    return n;
}

/* Writes a checkpoint of `a` as W ranks would: W shards, then the manifest. */
static int save_as_ranks(const char *path, int step, int W, const Model *a, const AdamState *oa, char *err) {
    CkptHeader h = header(step);
    StateRange r[16];
    for (int k = 0; k < W; k++) {
        int n = shard_ranges(a, k, W, a->params, oa->m, oa->v, 1, r);
        if (ckpt_write_rank_file(path, &h, k, W, r, n, err, 512)) return -1;
    }
    return ckpt_write_manifest(path, &h, W, err, 512);
}

static void test_full_ranges_match_tensors(void) {
    Model a;
    model_init_layout(&a, &CFG, 7, 1);
    StateRange r[8];
    int n = ckpt_full_ranges(&a, a.params, NULL, NULL, r, 8);
    CHECK(n == a.n_units && ckpt_full_ranges(&a, a.params, NULL, NULL, r, a.n_units - 1) == -1, "count %d", n);
    CHECK(r[0].m == NULL && r[0].v == NULL, "no moments");
    TensorInfo t[32];
    int nt = model_tensors(&a, t, 32), u = 0;
    uint64_t packed = 0;
    for (int i = 0; i < nt; i++) {  /* packed order = model_tensors order without padding */
        while (u < n && packed >= r[u].start + r[u].count) u++;
        CHECK(u < n && r[u].params + (packed - r[u].start) == a.params + t[i].offset, "tensor %s", t[i].name);
        packed += (uint64_t)t[i].rows * t[i].cols;
    }
    CHECK(packed == a.n_params && r[n - 1].start + r[n - 1].count == a.n_params, "covers n_params");
    model_free(&a);
}

static void test_round_trip_other_padding(void) {
    char dir[] = "/tmp/mtck.XXXXXX", path[256], err[512];
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    snprintf(path, sizeof path, "%s/c.bin", dir);
    Model a, b;
    AdamState oa, ob;
    model_init_layout(&a, &CFG, 1, 1);
    model_init_layout(&b, &CFG, 7, 1);  /* a different padding reads the same file */
    adam_alloc(&oa, a.n_flat);
    adam_alloc(&ob, b.n_flat);
    fill(&a, &oa);
    CkptHeader h = header(5), hb;
    CHECK(ckpt_save(path, &h, &a, &oa, err, sizeof err) == 0, "%s", err);
    CHECK(count_files(dir, ".tmp.") == 0, "no temporary file left");
    CHECK(count_files(dir, "c.bin.s00000005.r0-of-1") == 1, "one shard");
    CHECK(ckpt_load(path, &hb, &b, &ob, err, sizeof err) == 0, "%s", err);
    CHECK(hb.step == 5 && hb.loader_epoch == 2 && hb.loader_window == 9 && ob.step == 17 && hb.world == 1,
          "header fields");
    CHECK(same_state(&a, &oa, &b, &ob), "state differs");
    /* Overwriting replaces the checkpoint whole and removes the old shard. */
    h.step = 6;
    CHECK(ckpt_save(path, &h, &a, &oa, err, sizeof err) == 0, "%s", err);
    CHECK(ckpt_read_header(path, &hb, err, sizeof err) == 0 && hb.step == 6, "overwrite");
    CHECK(count_files(dir, ".s00000005.") == 0 && count_files(dir, ".s00000006.r0-of-1") == 1, "old shard removed");
    /* A params-only save is read back params-only; asking it for moments is an error. */
    Model c;
    model_init_layout(&c, &CFG, 3, 1);
    CHECK(ckpt_save(path, &h, &a, NULL, err, sizeof err) == 0, "%s", err);
    CHECK(ckpt_load(path, &hb, &c, NULL, err, sizeof err) == 0 && same_state(&a, NULL, &c, NULL), "%s", err);
    CHECK(ckpt_load(path, &hb, &b, &ob, err, sizeof err) != 0 && strstr(err, "no optimizer state"), "%s", err);
    remove_dir(dir);
    adam_free(&oa); adam_free(&ob); model_free(&a); model_free(&b); model_free(&c);
}

static void test_dist_world_of_one(void) {
    char dir[] = "/tmp/mtck.XXXXXX", path[256], err[512];
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    snprintf(path, sizeof path, "%s/c.bin", dir);
    Model a, b;
    AdamState oa, ob;
    model_init_layout(&a, &CFG, 1, 1);
    model_init_layout(&b, &CFG, 5, 1);
    adam_alloc(&oa, a.n_flat);
    adam_alloc(&ob, b.n_flat);
    fill(&a, &oa);
    Comm one = {.rank = 0, .size = 1, .impl = NULL, .name = "world"};
    StateRange r[8];
    int n = ckpt_full_ranges(&a, a.params, oa.m, oa.v, r, 8);
    CkptHeader h = header(3), hb;
    CHECK(ckpt_save_dist(path, &h, &one, r, n, err, sizeof err) == 0, "%s", err);
    n = ckpt_full_ranges(&b, b.params, ob.m, ob.v, r, 8);
    CHECK(ckpt_load_dist(path, &hb, r, n, 1, err, sizeof err) == 0 && hb.step == 3, "%s", err);
    CHECK(same_state(&a, &oa, &b, &ob), "state differs");
    /* ranges that do not cover the model are refused before anything is written */
    CHECK(ckpt_save_dist(path, &h, &one, r, n - 1, err, sizeof err) != 0 && strstr(err, "values"), "%s", err);
    h.step = 4;
    r[1].count += 1;  /* covers too much: the total check refuses it */
    CHECK(ckpt_save_dist(path, &h, &one, r, n, err, sizeof err) != 0, "overlong range accepted");
    CHECK(count_files(dir, ".s00000004.") == 0 && count_files(dir, ".tmp.") == 0, "nothing written");
    remove_dir(dir);
    adam_free(&oa); adam_free(&ob); model_free(&a); model_free(&b);
}

/* Saved by W ranks, read back by the whole model and by every rank of a 1..4-way split. */
static void test_resharding(void) {
    char dir[] = "/tmp/mtck.XXXXXX", path[256], err[512];
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    snprintf(path, sizeof path, "%s/ck.bin", dir);
    Model a, b;
    AdamState oa, ob;
    model_init_layout(&a, &CFG, 1, 1);
    model_init_layout(&b, &CFG, 7, 1);
    adam_alloc(&oa, a.n_flat);
    adam_alloc(&ob, b.n_flat);
    fill(&a, &oa);
    size_t N = a.n_params;
    float *p = xmalloc(N * 4), *m = xmalloc(N * 4), *v = xmalloc(N * 4);
    for (int W = 2; W <= 3; W++) {
        CHECK(save_as_ranks(path, 10 + W, W, &a, &oa, err) == 0, "W=%d: %s", W, err);
        CHECK(count_files(dir, "ck.bin.s") == W, "W=%d: only this checkpoint's shards remain", W);
        CkptHeader h;
        StateRange r[16];
        memset(ob.m, 0, b.n_flat * 4);
        int n = ckpt_full_ranges(&b, b.params, ob.m, ob.v, r, 16);
        CHECK(ckpt_load_dist(path, &h, r, n, 1, err, sizeof err) == 0 && h.world == W && h.step == 10 + W, "%s", err);
        CHECK(same_state(&a, &oa, &b, &ob), "W=%d: whole model differs", W);
        for (int L = 1; L <= 4; L++)
            for (int k = 0; k < L; k++) {
                for (size_t i = 0; i < N; i++) p[i] = m[i] = v[i] = -7.0f;  /* untouched marker */
                n = shard_ranges(&a, k, L, p, m, v, 0, r);
                int optim = (k + L) % 2;  /* params-only reads too */
                CHECK(ckpt_load_dist(path, &h, r, n, optim, err, sizeof err) == 0, "W=%d L=%d: %s", W, L, err);
                int bad = 0, j = 0;
                uint64_t packed = 0;
                for (int u = 0; u < a.n_units; u++)
                    for (size_t i = 0; i < a.units[u].n; i++, packed++) {
                        size_t f = a.units[u].offset + i;
                        int mine = j < n && packed >= r[j].start && packed < r[j].start + r[j].count;
                        if (j < n && packed + 1 == r[j].start + r[j].count) j++;
                        if (mine)
                            bad += p[packed] != a.params[f] ||
                                   (optim ? m[packed] != oa.m[f] || v[packed] != oa.v[f] : m[packed] != -7.0f);
                        else
                            bad += p[packed] != -7.0f || m[packed] != -7.0f || v[packed] != -7.0f;
                    }
                CHECK(bad == 0, "saved by %d, read by rank %d of %d: %d values wrong", W, k, L, bad);
            }
    }
    free(p); free(m); free(v);
    remove_dir(dir);
    adam_free(&oa); adam_free(&ob); model_free(&a); model_free(&b);
}

/* ZeRO's needs: every unit's params (m = v = NULL) plus this rank's shard with moments. */
static void test_params_only_needs_beside_moment_shards(void) {
    char dir[] = "/tmp/mtck.XXXXXX", path[256], err[512];
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    snprintf(path, sizeof path, "%s/ck.bin", dir);
    Model a, b;
    AdamState oa, ob;
    model_init_layout(&a, &CFG, 1, 1);
    model_init_layout(&b, &CFG, 1, 1);
    adam_alloc(&oa, a.n_flat);
    adam_alloc(&ob, b.n_flat);
    fill(&a, &oa);
    CHECK(save_as_ranks(path, 1, 3, &a, &oa, err) == 0, "%s", err);
    for (int k = 0; k < 2; k++) {
        StateRange r[16];
        for (size_t i = 0; i < b.n_flat; i++) b.params[i] = ob.m[i] = ob.v[i] = -7.0f;
        int n = shard_ranges(&b, k, 2, b.params, ob.m, ob.v, 1, r);
        n += ckpt_full_ranges(&b, b.params, NULL, NULL, r + n, 16 - n);
        CkptHeader h;
        CHECK(ckpt_load_dist(path, &h, r, n, 1, err, sizeof err) == 0, "%s", err);
        CHECK(same_state(&a, NULL, &b, NULL), "rank %d: params", k);
        int bad = 0;
        for (int u = 0; u < a.n_units; u++)
            for (size_t i = 0, s = (a.units[u].n + 1) / 2; i < a.units[u].n; i++) {
                size_t f = a.units[u].offset + i;
                int mine = i / s == (size_t)k;
                bad += mine ? ob.m[f] != oa.m[f] || ob.v[f] != oa.v[f] : ob.m[f] != -7.0f || ob.v[f] != -7.0f;
            }
        CHECK(bad == 0, "rank %d: %d moments wrong", k, bad);
        r[0].v = NULL;  /* m without v is a caller's bug */
        CHECK(ckpt_load_dist(path, &h, r, n, 1, err, sizeof err) != 0 && strstr(err, "no buffer"), "%s", err);
    }
    remove_dir(dir);
    adam_free(&oa); adam_free(&ob); model_free(&a); model_free(&b);
}

static void test_corruption_detected(void) {
    char dir[] = "/tmp/mtck.XXXXXX", path[256], shard[300], err[512];
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    snprintf(path, sizeof path, "%s/c.bin", dir);
    shard_name(shard, sizeof shard, path, 0, 0, 1);
    Model a;
    AdamState oa;
    model_init_layout(&a, &CFG, 1, 1);
    adam_alloc(&oa, a.n_flat);
    fill(&a, &oa);
    CkptHeader h = header(0), hb;
    CHECK(ckpt_save(path, &h, &a, &oa, err, sizeof err) == 0, "%s", err);
    long data = (long)(sizeof(CkptShardHeader) + a.n_units * sizeof(CkptRange) + 8);
    /* a flipped byte in the parameters: every load fails */
    flip_byte(shard, data + 100, 1);
    CHECK(ckpt_load(path, &hb, &a, &oa, err, sizeof err) != 0 && strstr(err, "checksum") && strstr(err, shard),
          "flip: %s", err);
    CHECK(ckpt_load(path, &hb, &a, NULL, err, sizeof err) != 0 && strstr(err, "checksum"), "params-only: %s", err);
    flip_byte(shard, data + 100, 1);
    /* in the moments: a resume fails; a params-only load reads (and checks) only the params */
    flip_byte(shard, -100, 1);
    CHECK(ckpt_load(path, &hb, &a, &oa, err, sizeof err) != 0 && strstr(err, "checksum"), "flip m/v: %s", err);
    CHECK(ckpt_load(path, &hb, &a, NULL, err, sizeof err) == 0, "params-only load of intact params: %s", err);
    flip_byte(shard, -100, 1);
    /* in the shard's range table */
    flip_byte(shard, (long)sizeof(CkptShardHeader) + 3, 1);
    CHECK(ckpt_load(path, &hb, &a, &oa, err, sizeof err) != 0 && strstr(err, "checksum"), "table: %s", err);
    flip_byte(shard, (long)sizeof(CkptShardHeader) + 3, 1);
    CHECK(ckpt_load(path, &hb, &a, &oa, err, sizeof err) == 0, "restored: %s", err);
    /* in the manifest */
    flip_byte(path, 300, 4);
    CHECK(ckpt_read_header(path, &hb, err, sizeof err) != 0 && strstr(err, "checksum"), "manifest: %s", err);
    flip_byte(path, 300, 4);
    /* truncated manifest, truncated shard */
    size_t len;
    char *buf = read_file(path, &len, err, sizeof err);
    CHECK(write_file_atomic(path, buf, len - 9, err, sizeof err) == 0, "%s", err);
    CHECK(ckpt_read_header(path, &hb, err, sizeof err) != 0 && strstr(err, "truncated"), "trunc: %s", err);
    CHECK(write_file_atomic(path, buf, 100, err, sizeof err) == 0, "%s", err);
    CHECK(ckpt_read_header(path, &hb, err, sizeof err) != 0 && strstr(err, "truncated"), "trunc: %s", err);
    CHECK(write_file_atomic(path, buf, len, err, sizeof err) == 0, "%s", err);
    truncate_file(shard, -4);
    CHECK(ckpt_load(path, &hb, &a, NULL, err, sizeof err) != 0 && strstr(err, "truncated") && strstr(err, shard),
          "shard trunc: %s", err);
    truncate_file(shard, 100);  /* inside the range table */
    CHECK(ckpt_load(path, &hb, &a, NULL, err, sizeof err) != 0 && strstr(err, "truncated"), "shard trunc: %s", err);
    CHECK(write_file_atomic(shard, "MTCKRA", 6, err, sizeof err) == 0, "%s", err);
    CHECK(ckpt_load(path, &hb, &a, NULL, err, sizeof err) != 0 && strstr(err, "not a meshtrain"), "shard: %s", err);
    /* foreign */
    CHECK(write_file_atomic(path, "hello", 5, err, sizeof err) == 0, "%s", err);
    CHECK(ckpt_read_header(path, &hb, err, sizeof err) != 0 && strstr(err, "not a meshtrain checkpoint"), "%s", err);
    /* a header that lies about its model */
    CkptHeader bad;
    memcpy(&bad, buf, sizeof bad);
    bad.n_heads = 3;
    memcpy(buf, &bad, sizeof bad);
    CHECK(write_file_atomic(path, buf, len, err, sizeof err) == 0, "%s", err);
    CHECK(ckpt_read_header(path, &hb, err, sizeof err) != 0, "invalid header accepted");
    /* an older format */
    bad.n_heads = 2; bad.version = 1;
    memcpy(buf, &bad, sizeof bad);
    CHECK(write_file_atomic(path, buf, len, err, sizeof err) == 0, "%s", err);
    CHECK(ckpt_read_header(path, &hb, err, sizeof err) != 0 && strstr(err, "version 1"), "%s", err);
    /* the right version with a header of another size: corrupt, not "version 2 ... reads version 2" */
    bad.version = CKPT_VERSION; bad.header_bytes += 1u << 16;
    memcpy(buf, &bad, sizeof bad);
    CHECK(write_file_atomic(path, buf, len, err, sizeof err) == 0, "%s", err);
    CHECK(ckpt_read_header(path, &hb, err, sizeof err) != 0 && strstr(err, "invalid header") && !strstr(err, "version"),
          "%s", err);
    /* saving where the directory does not exist fails cleanly */
    char nodir[300];
    snprintf(nodir, sizeof nodir, "%s/missing/c.bin", dir);
    CHECK(ckpt_save(nodir, &h, &a, &oa, err, sizeof err) != 0 && err[0], "save into a missing dir");
    CHECK(count_files(dir, ".tmp.") == 0, "no temporary file left");
    free(buf);
    remove_dir(dir);
    adam_free(&oa); model_free(&a);
}

static void test_shard_failures(void) {
    char dir[] = "/tmp/mtck.XXXXXX", path[256], s1[300], s2[300], saved[300], err[512];
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    snprintf(path, sizeof path, "%s/ckpt.bin", dir);
    snprintf(saved, sizeof saved, "%s/saved", dir);
    Model a, b;
    AdamState oa, ob;
    model_init_layout(&a, &CFG, 1, 1);
    model_init_layout(&b, &CFG, 1, 1);
    adam_alloc(&oa, a.n_flat);
    adam_alloc(&ob, b.n_flat);
    fill(&a, &oa);
    CkptHeader h = header(1), hb;
    CHECK(save_as_ranks(path, 1, 2, &a, &oa, err) == 0, "%s", err);
    /* A crash after the step-2 shards, before their manifest: step 1 still loads whole. */
    StateRange r[16];
    for (int k = 0; k < 2; k++) {
        oa.m[k] += 1;  /* step 2 differs from step 1 */
        h.step = 2;
        int n = shard_ranges(&a, k, 2, a.params, oa.m, oa.v, 1, r);
        CHECK(ckpt_write_rank_file(path, &h, k, 2, r, n, err, sizeof err) == 0, "%s", err);
        oa.m[k] -= 1;
    }
    CHECK(count_files(dir, "ckpt.bin.s") == 4, "both checkpoints' shards");
    CHECK(ckpt_load(path, &hb, &b, &ob, err, sizeof err) == 0 && hb.step == 1, "%s", err);
    CHECK(same_state(&a, &oa, &b, &ob), "step 1 intact");
    /* a shard of another step under this step's name */
    shard_name(s1, sizeof s1, path, 1, 1, 2);
    shard_name(s2, sizeof s2, path, 2, 1, 2);
    CHECK(rename(s1, saved) == 0 && link(s2, s1) == 0, "swap");
    CHECK(ckpt_load(path, &hb, &b, &ob, err, sizeof err) != 0 && strstr(err, "step 2") && strstr(err, s1), "%s", err);
    unlink(s1);
    /* missing */
    CHECK(ckpt_load(path, &hb, &b, NULL, err, sizeof err) != 0 && strstr(err, "missing") && strstr(err, s1),
          "%s", err);
    CHECK(ckpt_read_header(path, &hb, err, sizeof err) == 0, "the manifest alone still reads: %s", err);
    CHECK(rename(saved, s1) == 0, "restore");
    /* a shard rewritten after its manifest (same step, other values) */
    StateRange r2[16];
    h.step = 1;
    int n = shard_ranges(&a, 1, 2, a.params, oa.v, oa.m, 1, r2);
    CHECK(ckpt_write_rank_file(path, &h, 1, 2, r2, n, err, sizeof err) == 0, "%s", err);
    CHECK(ckpt_load(path, &hb, &b, &ob, err, sizeof err) != 0 && strstr(err, "manifest recorded"), "%s", err);
    n = shard_ranges(&a, 1, 2, a.params, oa.m, oa.v, 1, r2);
    CHECK(ckpt_write_rank_file(path, &h, 1, 2, r2, n, err, sizeof err) == 0, "%s", err);
    CHECK(ckpt_load(path, &hb, &b, &ob, err, sizeof err) == 0, "%s", err);
    /* The step-2 manifest commits step 2 and removes step 1's shards and stale temporaries,
     * nothing else. */
    char keep[2][320], stale[320];
    snprintf(keep[0], sizeof keep[0], "%s.keep", s1);
    snprintf(keep[1], sizeof keep[1], "%s/ckpt.bim.s00000001.r0-of-1", dir);
    snprintf(stale, sizeof stale, "%s.tmp.123", s1);
    for (int i = 0; i < 3; i++)
        CHECK(write_file_atomic(i < 2 ? keep[i] : stale, "x", 1, err, sizeof err) == 0, "%s", err);
    h.step = 2;
    CHECK(ckpt_write_manifest(path, &h, 2, err, sizeof err) == 0, "%s", err);
    CHECK(count_files(dir, "ckpt.bin.s00000001.r") == 1 && count_files(dir, "ckpt.bin.s00000002.r") == 2 &&
          access(keep[0], F_OK) == 0 && access(keep[1], F_OK) == 0, "clean-up");
    CHECK(ckpt_load(path, &hb, &b, &ob, err, sizeof err) == 0 && hb.step == 2 && ob.m[b.units[0].offset] ==
          oa.m[0] + 1, "%s", err);
    /* A manifest over shards whose ranges overlap (and so leave a gap) is refused. */
    h.step = 3;
    uint64_t half = a.n_params / 2;
    StateRange o[2] = {{0, half + 1, a.params, oa.m, oa.v}, {half, a.n_params - half - 1, a.params, oa.m, oa.v}};
    CHECK(ckpt_write_rank_file(path, &h, 0, 2, &o[0], 1, err, sizeof err) == 0, "%s", err);
    CHECK(ckpt_write_rank_file(path, &h, 1, 2, &o[1], 1, err, sizeof err) == 0, "%s", err);
    CHECK(ckpt_write_manifest(path, &h, 2, err, sizeof err) != 0 && strstr(err, "overlap"), "%s", err);
    CHECK(ckpt_read_header(path, &hb, err, sizeof err) == 0 && hb.step == 2, "step 2 stays: %s", err);
    /* needs outside the model */
    StateRange far = {a.n_params - 1, 2, b.params, NULL, NULL};
    CHECK(ckpt_load_dist(path, &hb, &far, 1, 0, err, sizeof err) != 0 && strstr(err, "outside"), "%s", err);
    remove_dir(dir);
    adam_free(&oa); adam_free(&ob); model_free(&a); model_free(&b);
}

int main(void) {
    ops_init("cpu", 1, NULL, 0);
    RUN(test_full_ranges_match_tensors);
    RUN(test_round_trip_other_padding);
    RUN(test_dist_world_of_one);
    RUN(test_resharding);
    RUN(test_params_only_needs_beside_moment_shards);
    RUN(test_corruption_detected);
    RUN(test_shard_failures);
    return TEST_SUMMARY();
}
