/* Tokenizer throughput: encodes the 2 MiB TinyStories head N times (default 10) with
 * encode_special, single-threaded, and prints MB/s and tokens. The first pass (cold piece
 * cache, on a freshly loaded tokenizer) is reported separately; decode is timed too.
 * Usage: build/bench/bench_tokenizer [N] [text-file]   (run from the repository root) */
#include "tokenizer.h"
#include "util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 10;
    const char *path = argc > 2 ? argv[2] : "data/tinystories/TinyStories-train.head-2MiB.txt";
    if (reps < 1) die(EXIT_BAD_INPUT, "N must be a positive integer, not '%s'", argv[1]);
    char err[512];
    double t0 = now_seconds();
    Tokenizer *tok = tokenizer_load("data/gpt2/encoder.json", "data/gpt2/vocab.bpe", err, sizeof err);
    if (!tok) die(EXIT_BAD_INPUT, "%s", err);
    double t_load = now_seconds() - t0;
    size_t n;
    char *text = read_file(path, &n, err, sizeof err);
    if (!text) die(EXIT_BAD_INPUT, "%s", err);

    TokenBuf b = {0};
    t0 = now_seconds();
    if (tokenizer_encode_special(tok, text, n, &b, err, sizeof err)) die(EXIT_RUN_FAILURE, "%s", err);
    double t_cold = now_seconds() - t0;
    size_t ntok = b.n;

    double t_best = 1e30, t_sum = 0;
    for (int r = 0; r < reps; r++) {
        b.n = 0;
        t0 = now_seconds();
        if (tokenizer_encode_special(tok, text, n, &b, err, sizeof err)) die(EXIT_RUN_FAILURE, "%s", err);
        double dt = now_seconds() - t0;
        t_sum += dt;
        if (dt < t_best) t_best = dt;
        if (b.n != ntok) die(EXIT_RUN_FAILURE, "token count changed between passes: %zu vs %zu", b.n, ntok);
    }

    t0 = now_seconds();
    size_t dl;
    char *dec = tokenizer_decode(tok, b.ids, b.n, &dl, err, sizeof err);
    double t_dec = now_seconds() - t0;
    if (!dec) die(EXIT_RUN_FAILURE, "%s", err);
    int same = dl == n && memcmp(dec, text, n) == 0;

    double mb = (double)n / 1e6;
    printf("tokenizer load: %.1f ms\n", t_load * 1e3);
    printf("text: %s, %.2f MB, %zu tokens (%.2f bytes/token)\n", path, mb, ntok, (double)n / (double)ntok);
    printf("encode, cold cache: %.1f MB/s (%.1f ms)\n", mb / t_cold, t_cold * 1e3);
    printf("encode, warm x%d: best %.1f MB/s, mean %.1f MB/s, %.2f Mtokens/s\n", reps, mb / t_best,
           mb * reps / t_sum, (double)ntok / t_best / 1e6);
    printf("decode: %.1f MB/s, round trip %s\n", mb / t_dec, same ? "ok" : "DIFFERS");
    free(dec);
    tokenbuf_free(&b);
    free(text);
    tokenizer_free(tok);
    return same ? 0 : 1;
}
