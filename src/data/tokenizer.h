/* tokenizer — GPT-2 byte-level BPE: pre-tokenization with the GPT-2 regex (PCRE2, JIT),
 * then merges by rank, from encoder.json + vocab.bpe. */
#ifndef MESHTRAIN_TOKENIZER_H
#define MESHTRAIN_TOKENIZER_H
#include <stddef.h>

#define TOKEN_EOT 50256          /* <|endoftext|> */
#define GPT2_VOCAB_SIZE 50257

typedef struct Tokenizer Tokenizer;

/* Loads the two files; NULL with a one-line message in err when a file is missing,
 * malformed, or does not hold exactly the GPT-2 vocabulary. */
Tokenizer *tokenizer_load(const char *encoder_json_path, const char *vocab_bpe_path, char *err, size_t errlen);
void tokenizer_free(Tokenizer *tok);
int tokenizer_vocab_size(const Tokenizer *tok);

/* Token-id growing buffer. */
typedef struct { int *ids; size_t n, cap; } TokenBuf;
void tokenbuf_free(TokenBuf *b);

/* Appends the ids of `len` bytes of text to out. Any bytes are accepted (invalid UTF-8
 * included); the text "<|endoftext|>" is ordinary text here. Returns 0, -1 with err set. */
int tokenizer_encode(const Tokenizer *tok, const char *text, size_t len, TokenBuf *out, char *err, size_t errlen);
/* Same, but each literal "<|endoftext|>" becomes the single token TOKEN_EOT. */
int tokenizer_encode_special(const Tokenizer *tok, const char *text, size_t len, TokenBuf *out, char *err, size_t errlen);

/* The bytes of one token (not NUL-terminated); NULL for an id out of range. */
const char *tokenizer_token_bytes(const Tokenizer *tok, int id, size_t *len);
/* Decodes ids into a malloc'd buffer (NUL-terminated; *len excludes the NUL). Returns NULL
 * with err set if an id is out of range. */
char *tokenizer_decode(const Tokenizer *tok, const int *ids, size_t n, size_t *len, char *err, size_t errlen);
#endif
