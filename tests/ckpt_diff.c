/* ckpt_diff [-v] A B: loads two checkpoints (any world size or strategy) and prints the
 * largest relative difference of their parameters, tensor by tensor:
 * "max_rel_diff X" (norm-wise per tensor). Used by tests/test_parallel.sh. With -v, first a
 * line for each tensor that differs at all: its name, how many of its values differ, the
 * largest absolute difference and the relative one (for telling where two runs that should
 * be bitwise alike part).
 *
 * ckpt_diff -s A B: the whole training state, bitwise: the parameters and both optimizer
 * states (AdamW's moments m and v, or Adafactor's first moment and statistics in their
 * places), tensor by tensor, and the counters a resumed run continues from (step, optimizer
 * step, optimizer, data-loader position, last loss). A line for each tensor's part and each
 * counter that differs ("NAME m: K of N values differ, max_abs_diff X"; "adam_step: 5 against
 * 4"), then "state_diff N", N the differing values and counters (0: bitwise alike). Values
 * are compared as bits, so -0 against 0 and NaN payloads count; the rest of the header (the
 * settings) is not compared. Used by bench/same_as_commit.sh. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "checkpoint.h"
#include "util.h"

static void load(const char *path, Model *m, CkptHeader *h, AdamState *opt) {
    char err[1024];
    if (ckpt_read_header(path, h, err, sizeof err)) die(2, "%s", err);
    ModelConfig c;
    ckpt_model_config(h, &c);
    model_init_layout(m, &c, 1, 1);
    if (opt) {
        if (!h->has_optim) die(2, "checkpoint %s holds no optimizer state", path);
        adam_alloc(opt, m->n_flat);
    }
    if (ckpt_load(path, h, m, opt, err, sizeof err)) die(2, "%s", err);
}

/* -s: the differing values of n floats at a and b, as bits; a line when any */
static size_t state_part(const char *name, const char *part, const float *a, const float *b, size_t n) {
    size_t differ = 0;
    double most = 0;
    for (size_t j = 0; j < n; j++) {
        uint32_t x, y;
        memcpy(&x, a + j, 4);
        memcpy(&y, b + j, 4);
        if (x == y) continue;
        differ++;
        most = fmax(most, fabs((double)a[j] - b[j]));
    }
    if (differ) printf("%s %s: %zu of %zu values differ, max_abs_diff %.3g\n", name, part, differ, n, most);
    return differ;
}

static size_t state_counter(const char *name, long long a, long long b) {
    if (a == b) return 0;
    printf("%s: %lld against %lld\n", name, a, b);
    return 1;
}

static int state_diff(const char *pa, const char *pb) {
    Model a, b;
    CkptHeader ha, hb;
    AdamState oa, ob;
    load(pa, &a, &ha, &oa);
    load(pb, &b, &hb, &ob);
    if (a.n_params != b.n_params || memcmp(&a.c, &b.c, sizeof a.c)) die(1, "different models");
    size_t differ = 0;
    differ += state_counter("step", ha.step, hb.step);
    differ += state_counter("adam_step", ha.adam_step, hb.adam_step);
    differ += state_counter("optimizer", ha.optimizer, hb.optimizer);
    differ += state_counter("loader_epoch", (long long)ha.loader_epoch, (long long)hb.loader_epoch);
    differ += state_counter("loader_window", (long long)ha.loader_window, (long long)hb.loader_window);
    if (memcmp(&ha.last_loss, &hb.last_loss, sizeof ha.last_loss)) {
        printf("last_loss: %.9g against %.9g\n", ha.last_loss, hb.last_loss);
        differ++;
    }
    int n = model_n_tensors(&a.c);
    TensorInfo *t = xmalloc((size_t)n * sizeof *t);
    n = model_tensors(&a, t, n);
    for (int i = 0; i < n; i++) {
        size_t o = t[i].offset, vals = (size_t)t[i].rows * t[i].cols;
        differ += state_part(t[i].name, "params", a.params + o, b.params + o, vals);
        differ += state_part(t[i].name, "m", oa.m + o, ob.m + o, vals);
        differ += state_part(t[i].name, "v", oa.v + o, ob.v + o, vals);
    }
    free(t);
    printf("state_diff %zu\n", differ);
    adam_free(&oa);
    adam_free(&ob);
    model_free(&a);
    model_free(&b);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 4 && !strcmp(argv[1], "-s")) return state_diff(argv[2], argv[3]);
    int verbose = argc == 4 && !strcmp(argv[1], "-v");
    if (argc != 3 + verbose) die(2, "usage: ckpt_diff [-v | -s] A B");
    Model a, b;
    CkptHeader ha, hb;
    load(argv[1 + verbose], &a, &ha, NULL);
    load(argv[2 + verbose], &b, &hb, NULL);
    if (a.n_params != b.n_params) die(1, "different models");
    int n = model_n_tensors(&a.c);
    TensorInfo *t = xmalloc((size_t)n * sizeof *t);
    n = model_tensors(&a, t, n);
    double worst = 0;
    for (int i = 0; i < n; i++) {
        double d = 0, s = 0, most = 0;
        size_t differ = 0, vals = (size_t)t[i].rows * t[i].cols;
        for (size_t j = 0; j < vals; j++) {
            double x = a.params[t[i].offset + j], y = b.params[t[i].offset + j];
            d += (x - y) * (x - y);
            s += y * y;
            differ += x != y;
            most = fmax(most, fabs(x - y));
        }
        double r = sqrt(d) / fmax(sqrt(s), 1e-30);
        if (verbose && differ)
            printf("%s: %zu of %zu values differ, max_abs_diff %.3g, rel_diff %.3g\n", t[i].name, differ, vals, most, r);
        if (r > worst) worst = r;
    }
    free(t);
    printf("max_rel_diff %.3g\n", worst);
    model_free(&a);
    model_free(&b);
    return 0;
}
