/* checkpoint — one file with the model config, training position, parameters and AdamW
 * moments, written atomically (temporary file, fsync, rename, fsync of the directory) and
 * closed by an FNV-1a 64 checksum of everything before it. Tensors are stored in model
 * order without the flat layout's padding, so the file does not depend on the padding.
 *
 * Layout: CkptHeader (256 bytes) | params [n_params] | m [n_params] | v [n_params] (fp32,
 * little-endian; m and v only when has_optim) | uint64 checksum. */
#ifndef MESHTRAIN_CHECKPOINT_H
#define MESHTRAIN_CHECKPOINT_H
#include <stddef.h>
#include <stdint.h>
#include "model.h"
#include "optim.h"

#define CKPT_MAGIC "MTCKPT01"
#define CKPT_VERSION 1

typedef struct {
    char magic[8];
    uint32_t version, header_bytes;
    int32_t vocab_size, embed_dim, n_heads, n_layers, context_len, tie_embeddings;
    int32_t batch_size, world, seed, step;     /* step = optimizer steps completed */
    int32_t adam_step, has_optim;
    uint64_t loader_epoch, loader_window;
    uint64_t n_params;
    double last_loss;
    /* the optimizer and schedule, so a resumed run continues the same run */
    double lr, min_lr, beta1, beta2, eps, weight_decay, grad_clip;
    int32_t warmup_steps, total_steps, cosine, reserved0;
    char reserved[256 - 8 - 8 - 12 * 4 - 3 * 8 - 8 - 7 * 8 - 4 * 4];
} CkptHeader;
_Static_assert(sizeof(CkptHeader) == 256, "checkpoint header is 256 bytes");

int ckpt_save(const char *path, const CkptHeader *h, const Model *m, const AdamState *opt, char *err, size_t errlen);
/* Reads and checks the header alone (magic, version, sizes, file length). */
int ckpt_read_header(const char *path, CkptHeader *h, char *err, size_t errlen);
/* Loads params (and moments when opt != NULL) into a model built from the header's config;
 * verifies the checksum over the whole file first. */
int ckpt_load(const char *path, CkptHeader *h, Model *m, AdamState *opt, char *err, size_t errlen);
void ckpt_model_config(const CkptHeader *h, ModelConfig *c);
#endif
