/* What compress.c and powersgd.c share: the compressor's state. */
#ifndef MESHTRAIN_COMPRESS_IMPL_H
#define MESHTRAIN_COMPRESS_IMPL_H
#include "compress.h"

/* One matrix PowerSGD compresses: a tensor [rows, cols] at offset of the flat gradient, at
 * rank r; its Q^T [r, cols] at qt + q. */
typedef struct { size_t offset, rows, cols; int r; size_t q; } PsgdMatrix;

struct Compressor {
    CompressKind kind;
    size_t n_flat;
    int W;
    float *e, *f;                 /* residuals: e[n_flat] this rank's; f[n_flat / W] its blocks' (bf16, int8) */
    unsigned char *q, *in, *out;  /* send, receive, the all-gather's W copies (bf16, int8) */
    float *s;                     /* a rank block's sum */
    size_t cap;                   /* bytes of q, in and out */
    PsgdMatrix *mats;             /* PowerSGD: the matrices it compresses, in flat order */
    int n_mats;
    float *qt;                    /* ... their Q^T, n_q values */
    size_t n_q;
};

/* powersgd.c: the matrices of m's tensors worth compressing at rank (min_rate: PyTorch's
 * min_compression_rate), their Q; the bucket's PowerSGD all-reduce (compress_allreduce). */
void psgd_init(Compressor *c, const Model *m, int rank, double min_rate);
int psgd_allreduce(Compressor *c, const Comm *g, float *buf, size_t off, size_t n);
#endif
