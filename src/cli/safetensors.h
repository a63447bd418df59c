/* safetensors — writes fp32 tensors in Hugging Face's safetensors format: an 8-byte
 * little-endian header length N, N bytes of JSON (each tensor's dtype, shape and byte range
 * in the data, plus "__metadata__"), padded with spaces to a multiple of 8, then the raw
 * little-endian data. The header goes first, so tensors are streamed one at a time (export
 * builds each in a scratch buffer instead of holding a second copy of the model). */
#ifndef MESHTRAIN_SAFETENSORS_H
#define MESHTRAIN_SAFETENSORS_H
#include <stddef.h>
#include <stdint.h>
#include "util.h"

typedef struct { char name[96]; int ndim; int64_t shape[2]; } StTensor;  /* ndim 1 or 2 */

typedef struct {
    AtomicFile f;
    const StTensor *t;
    int n, next;      /* tensors, and the next one st_write expects */
    size_t bytes;     /* the whole file */
} StWriter;

/* Opens path (atomically: see AtomicFile) and writes the header for tensors t[0..n), whose
 * data then follow in this order. t must stay valid until st_commit. */
int st_open(StWriter *w, const char *path, const StTensor *t, int n, char *err, size_t errlen);
/* The next tensor's elements (product of its shape), row-major fp32. */
void st_write(StWriter *w, const float *data);
/* Checks that every tensor was written, then commits the file (or removes it on error). */
int st_commit(StWriter *w, char *err, size_t errlen);
size_t st_numel(const StTensor *t);
#endif
