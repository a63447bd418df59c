/* estimate — memory and FLOPs of a run, computed before anything is allocated, from the
 * same plan the trainer allocates (model layout, acts_bytes). */
#ifndef MESHTRAIN_ESTIMATE_H
#define MESHTRAIN_ESTIMATE_H
#include <stddef.h>
#include "model.h"

typedef struct {
    size_t n_params;
    double flops_per_token;
    size_t params, grads, optim, acts, logits, data, runtime, total;  /* bytes */
    double formula;  /* the usual rule of thumb: 16 bytes/param + Korthikanti activations */
} MemEstimate;

/* training != 0: parameters, gradients, AdamW moments, activations for backward.
 * data_bytes: the shards the run maps (they count in RSS as they are read). */
void estimate_memory(const ModelConfig *c, int B, int T, int training, size_t data_bytes, MemEstimate *e);
void estimate_print(const ModelConfig *c, int B, int T, const MemEstimate *e);
/* Bytes of memory available to this process (MemAvailable), 0 if unknown. */
size_t available_memory_bytes(void);
#endif
