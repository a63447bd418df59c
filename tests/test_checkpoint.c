/* Checkpoint round trip, corruption detection and atomic replacement. */
#include <dirent.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "checkpoint.h"
#include "ops.h"
#include "test.h"
#include "util.h"

static const ModelConfig CFG = {101, 16, 2, 2, 8, 0};

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

static int count_tmp_files(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d))) n += strstr(e->d_name, ".tmp.") != NULL;
    if (d) closedir(d);
    return n;
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
    CkptHeader h = {0}, hb;
    h.vocab_size = 101; h.embed_dim = 16; h.n_heads = 2; h.n_layers = 2; h.context_len = 8;
    h.batch_size = 4; h.step = 5; h.adam_step = 17; h.loader_epoch = 2; h.loader_window = 9;
    CHECK(ckpt_save(path, &h, &a, &oa, err, sizeof err) == 0, "%s", err);
    CHECK(count_tmp_files(dir) == 0, "no temporary file left");
    CHECK(ckpt_load(path, &hb, &b, &ob, err, sizeof err) == 0, "%s", err);
    CHECK(hb.step == 5 && hb.loader_epoch == 2 && hb.loader_window == 9 && ob.step == 17, "header fields");
    TensorInfo ta[32], tb[32];
    int n = model_tensors(&a, ta, 32);
    model_tensors(&b, tb, 32);
    for (int i = 0; i < n; i++) {
        size_t k = (size_t)ta[i].rows * ta[i].cols;
        CHECK(!memcmp(a.params + ta[i].offset, b.params + tb[i].offset, k * 4), "params of %s", ta[i].name);
        CHECK(!memcmp(oa.m + ta[i].offset, ob.m + tb[i].offset, k * 4), "m of %s", ta[i].name);
        CHECK(!memcmp(oa.v + ta[i].offset, ob.v + tb[i].offset, k * 4), "v of %s", ta[i].name);
    }
    /* Overwriting replaces the file whole. */
    h.step = 6;
    CHECK(ckpt_save(path, &h, &a, &oa, err, sizeof err) == 0, "%s", err);
    CHECK(ckpt_read_header(path, &hb, err, sizeof err) == 0 && hb.step == 6, "overwrite");
    unlink(path);
    rmdir(dir);
    adam_free(&oa); adam_free(&ob); model_free(&a); model_free(&b);
}

static void test_corruption_detected(void) {
    char dir[] = "/tmp/mtck.XXXXXX", path[256], err[512];
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    snprintf(path, sizeof path, "%s/c.bin", dir);
    Model a;
    AdamState oa;
    model_init_layout(&a, &CFG, 1, 1);
    adam_alloc(&oa, a.n_flat);
    fill(&a, &oa);
    CkptHeader h = {0}, hb;
    h.vocab_size = 101; h.embed_dim = 16; h.n_heads = 2; h.n_layers = 2; h.context_len = 8; h.batch_size = 1;
    CHECK(ckpt_save(path, &h, &a, &oa, err, sizeof err) == 0, "%s", err);
    size_t len;
    char *buf = read_file(path, &len, err, sizeof err);
    /* a flipped byte in the moments */
    buf[len - 100] ^= 1;
    CHECK(write_file_atomic(path, buf, len, err, sizeof err) == 0, "%s", err);
    CHECK(ckpt_load(path, &hb, &a, &oa, err, sizeof err) != 0 && strstr(err, "checksum"), "flip: %s", err);
    CHECK(ckpt_load(path, &hb, &a, NULL, err, sizeof err) != 0, "params-only load still verifies the file");
    buf[len - 100] ^= 1;
    /* truncated */
    CHECK(write_file_atomic(path, buf, len - 9, err, sizeof err) == 0, "%s", err);
    CHECK(ckpt_read_header(path, &hb, err, sizeof err) != 0 && strstr(err, "truncated"), "trunc: %s", err);
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
    /* saving where the directory does not exist fails cleanly */
    char nodir[300];
    snprintf(nodir, sizeof nodir, "%s/missing/c.bin", dir);
    CHECK(ckpt_save(nodir, &h, &a, &oa, err, sizeof err) != 0 && err[0], "save into a missing dir");
    CHECK(count_tmp_files(dir) == 0, "no temporary file left");
    free(buf);
    unlink(path);
    rmdir(dir);
    adam_free(&oa); model_free(&a);
}

int main(void) {
    ops_init(1);
    RUN(test_round_trip_other_padding);
    RUN(test_corruption_detected);
    return TEST_SUMMARY();
}
