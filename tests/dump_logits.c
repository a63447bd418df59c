/* dump_logits CKPT OUT ID...: loads a checkpoint (any layout that wrote it) and writes the
 * fp32 logits of every position of the token sequence ID... to OUT, row-major [T, V], raw
 * little-endian. They come from the model's own forward on the cpu backend: position t's
 * row is model_last_logits of the prefix 0..t (causal, so the same as one full forward).
 * Used by tests/test_export.sh against the exported Hugging Face model. */
#include <stdio.h>
#include <stdlib.h>
#include "checkpoint.h"
#include "run.h"
#include "util.h"

int main(int argc, char **argv) {
    if (argc < 4) die(EXIT_BAD_INPUT, "usage: dump_logits CKPT OUT ID...");
    char err[1024];
    ops_init_or_die("cpu", 2);
    Model m;
    CkptHeader h;
    if (ckpt_load_model(argv[1], &h, &m, err, sizeof err)) die(EXIT_BAD_INPUT, "%s", err);
    int T = argc - 3, V = m.V;
    if (T > h.context_len) die(EXIT_BAD_INPUT, "%d tokens exceed context_len=%d", T, h.context_len);
    int *ids = xmalloc((size_t)T * sizeof(int));
    for (int t = 0; t < T; t++) {
        char *end;
        long v = strtol(argv[3 + t], &end, 10);
        if (*end || v < 0 || v >= V) die(EXIT_BAD_INPUT, "bad token id '%s'", argv[3 + t]);
        ids[t] = (int)v;
    }
    Acts a;
    acts_alloc(&a, &m, 1, T, 0);
    float *logits = xmalloc((size_t)T * V * sizeof(float));
    for (int t = 0; t < T; t++) model_last_logits(&m, &a, ids, t + 1, logits + (size_t)t * V);
    if (write_file_atomic(argv[2], logits, (size_t)T * V * sizeof(float), err, sizeof err))
        die(EXIT_RUN_FAILURE, "%s", err);
    free(logits); free(ids);
    acts_free(&a);
    model_free(&m);
    return 0;
}
