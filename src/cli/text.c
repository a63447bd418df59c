#include <errno.h>
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

/* A word of the input for an error message: at most out_len - 4 bytes of it, with what is not
 * printable ASCII written as '?', and "..." where it was cut. */
static void quote_word(char *out, size_t out_len, const char *w, size_t n) {
    size_t k = 0, keep = n < out_len - 4 ? n : out_len - 4;
    for (size_t i = 0; i < keep; i++) out[k++] = w[i] >= 0x20 && w[i] < 0x7f ? w[i] : '?';
    if (keep < n) { out[k++] = '.'; out[k++] = '.'; out[k++] = '.'; }
    out[k] = 0;
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
            /* the whitespace-delimited word is the token: an error quotes it alone */
            size_t wlen = strcspn(p, " \n\t\r");
            char word[48];
            quote_word(word, sizeof word, p, wlen);
            errno = 0;
            long long v = strtoll(p, &end, 10);
            if (end != p + wlen || !wlen) die(EXIT_BAD_INPUT, "tokenize decode=true: '%s' is not a token id", word);
            if (errno == ERANGE || v < 0 || v >= tokenizer_vocab_size(tok))
                die(EXIT_BAD_INPUT, "tokenize decode=true: id %s is out of range [0, %d)", word, tokenizer_vocab_size(tok));
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
