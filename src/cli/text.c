#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "commands.h"
#include "data.h"
#include "tokenizer.h"
#include "util.h"

static Tokenizer *load_tokenizer(const Config *c) {
    char err[1024], enc[1100], bpe[1100];
    snprintf(enc, sizeof enc, "%s/encoder.json", c->tokenizer_dir);
    snprintf(bpe, sizeof bpe, "%s/vocab.bpe", c->tokenizer_dir);
    Tokenizer *tok = tokenizer_load(enc, bpe, err, sizeof err);
    if (!tok) die(EXIT_BAD_INPUT, "%s", err);
    return tok;
}

int cmd_prepare(Config *c) {
    char err[1024], b1[32], b2[32];
    Tokenizer *tok = load_tokenizer(c);
    PrepareStats st;
    if (data_prepare(tok, c->input, c->data_dir, c->val_fraction, &st, err, sizeof err))
        die(EXIT_BAD_INPUT, "%s", err);
    printf("prepared %s: %zu stories, %s train tokens -> %s/train.bin, %s val tokens -> %s/val.bin "
           "(%.1f MB/s)\n", c->input, st.n_stories, fmt_commas(b1, (long long)st.n_train_tokens), c->data_dir,
           fmt_commas(b2, (long long)st.n_val_tokens), c->data_dir,
           st.seconds > 0 ? st.n_bytes / st.seconds / 1e6 : 0.0);
    tokenizer_free(tok);
    return 0;
}

/* tokenize: text on stdin -> ids on one line; decode=true: ids -> text. */
int cmd_tokenize(Config *c) {
    char err[1024];
    Tokenizer *tok = load_tokenizer(c);
    size_t cap = 1 << 16, n = 0;
    char *in = xmalloc(cap + 1);
    size_t got;
    while ((got = fread(in + n, 1, cap - n, stdin)) > 0) {
        n += got;
        if (n == cap) { cap *= 2; in = xrealloc(in, cap + 1); }
    }
    in[n] = 0;
    if (c->decode) {
        TokenBuf ids = {0};
        char *p = in, *end;
        for (;;) {
            while (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r') p++;
            if (!*p) break;
            long v = strtol(p, &end, 10);
            if (end == p || (*end && *end != ' ' && *end != '\n' && *end != '\t' && *end != '\r'))
                die(EXIT_BAD_INPUT, "tokenize decode=true: '%.20s' is not a token id", p);
            if (v < 0 || v >= tokenizer_vocab_size(tok))
                die(EXIT_BAD_INPUT, "tokenize decode=true: id %ld is out of range [0, %d)", v, tokenizer_vocab_size(tok));
            if (ids.n == ids.cap) { ids.cap = ids.cap ? 2 * ids.cap : 1024; ids.ids = xrealloc(ids.ids, ids.cap * sizeof(int)); }
            ids.ids[ids.n++] = (int)v;
            p = end;
        }
        size_t len;
        char *text = tokenizer_decode(tok, ids.ids, ids.n, &len, err, sizeof err);
        if (!text) die(EXIT_BAD_INPUT, "%s", err);
        fwrite(text, 1, len, stdout);
        free(text);
        tokenbuf_free(&ids);
    } else {
        TokenBuf ids = {0};
        if (tokenizer_encode_special(tok, in, n, &ids, err, sizeof err)) die(EXIT_BAD_INPUT, "%s", err);
        for (size_t i = 0; i < ids.n; i++) printf(i ? " %d" : "%d", ids.ids[i]);
        printf("\n");
        tokenbuf_free(&ids);
    }
    free(in);
    tokenizer_free(tok);
    return 0;
}
