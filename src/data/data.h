/* data — token shards and the data loader.
 * Shard file: a 64-byte little-endian header
 *   magic "MTSHARD1" (8 bytes), uint32 version (1), uint32 vocab_size, uint64 n_tokens,
 *   uint64 fnv1a64 checksum of the token bytes, 32 bytes reserved (zero)
 * then n_tokens uint16 tokens. */
#ifndef MESHTRAIN_DATA_H
#define MESHTRAIN_DATA_H
#include <stddef.h>
#include <stdint.h>
#include "tokenizer.h"

#define SHARD_HEADER_BYTES 64
#define SHARD_VERSION 1

int shard_write(const char *path, const uint16_t *tokens, size_t n, int vocab_size, char *err, size_t errlen);

typedef struct {
    const uint16_t *tokens;  /* mmapped */
    size_t n_tokens;
    int vocab_size;
    void *map; size_t map_len;
} Shard;
/* mmaps and validates a shard: magic, version, size matches n_tokens, checksum, every
 * token < vocab_size. A missing, truncated, foreign or corrupt file is an error naming it. */
int shard_open(Shard *s, const char *path, char *err, size_t errlen);
void shard_close(Shard *s);

typedef struct {
    size_t n_stories, n_train_tokens, n_val_tokens, n_bytes;
    double seconds;
} PrepareStats;
/* TinyStories text (stories separated by lines "<|endoftext|>") -> out_dir/train.bin and
 * out_dir/val.bin. Every story is stripped of surrounding whitespace and preceded by
 * TOKEN_EOT. The last ceil(val_fraction * n_stories) stories (at least 1) are the
 * validation part. Refuses empty input, input with no complete story, and non-UTF-8 text. */
int data_prepare(const Tokenizer *tok, const char *text_path, const char *out_dir, double val_fraction,
                 PrepareStats *stats, char *err, size_t errlen);

/* The loader cuts the shard into windows of T+1 tokens starting every T tokens
 * (n_windows = (n_tokens - 1) / T). Each epoch visits the windows in an order shuffled by
 * (seed, epoch) (or in order when shuffle == 0); global batch g takes windows
 * [g*B*world, (g+1)*B*world) of that order, and rank r gets the r-th block of B of them,
 * so ranks never overlap. An epoch ends when fewer than B*world windows remain.
 * The position is counted in windows, not batches, so a run can resume with another
 * world size or batch size without losing or repeating a window. */
typedef struct {
    uint64_t epoch;   /* epochs completed */
    uint64_t window;  /* windows of this epoch's order already taken (by all ranks) */
} LoaderState;

typedef struct {
    const Shard *shard;
    int B, T, rank, world, shuffle;
    uint64_t seed;
    size_t n_windows, batches_per_epoch;
    uint32_t *order;  /* window order of the current epoch */
    LoaderState st;
} Loader;

/* Fails (err names B, T and the shard's size) when the shard has fewer than B*world windows. */
int loader_init(Loader *l, const Shard *s, int B, int T, int rank, int world, uint64_t seed, int shuffle,
                char *err, size_t errlen);
void loader_free(Loader *l);
/* Fills inputs[B*T] and targets[B*T] (the window shifted by one) and advances. */
void loader_next(Loader *l, int *inputs, int *targets);
/* The distinct input tokens below V of the global batch that the next loader_next takes
 * from (every rank's part of it, the same on every rank), ascending, into rows (room for
 * V); returns how many. seen: V bytes of scratch. */
size_t loader_batch_tokens(const Loader *l, int V, unsigned char *seen, int *rows);
LoaderState loader_get_state(const Loader *l);
/* Restores a position saved by loader_get_state (same shard, T and seed; B and world may
 * differ: when the rest of the epoch is shorter than one global batch, the next epoch starts). */
int loader_set_state(Loader *l, LoaderState st, char *err, size_t errlen);
#endif
