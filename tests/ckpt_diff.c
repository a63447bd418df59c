/* ckpt_diff [-v] A B: loads two checkpoints (any world size or strategy) and prints the
 * largest relative difference of their parameters, tensor by tensor:
 * "max_rel_diff X" (norm-wise per tensor). Used by tests/test_parallel.sh. With -v, first a
 * line for each tensor that differs at all: its name, how many of its values differ, the
 * largest absolute difference and the relative one (for telling where two runs that should
 * be bitwise alike part). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "checkpoint.h"
#include "util.h"

static void load(const char *path, Model *m) {
    char err[1024];
    CkptHeader h;
    if (ckpt_read_header(path, &h, err, sizeof err)) die(2, "%s", err);
    ModelConfig c;
    ckpt_model_config(&h, &c);
    model_init_layout(m, &c, 1, 1);
    if (ckpt_load(path, &h, m, NULL, err, sizeof err)) die(2, "%s", err);
}

int main(int argc, char **argv) {
    int verbose = argc == 4 && !strcmp(argv[1], "-v");
    if (argc != 3 + verbose) die(2, "usage: ckpt_diff [-v] A B");
    Model a, b;
    load(argv[1 + verbose], &a);
    load(argv[2 + verbose], &b);
    if (a.n_params != b.n_params) die(1, "different models");
    TensorInfo t[8 + 7 * 512];
    int n = model_tensors(&a, t, (int)(sizeof t / sizeof t[0]));
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
    printf("max_rel_diff %.3g\n", worst);
    model_free(&a);
    model_free(&b);
    return 0;
}
