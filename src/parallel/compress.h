/* compress — the data-parallel gradient all-reduce with compressed messages (bf16, or int8
 * with a scale per block of values; or PowerSGD's low-rank factors, powersgd.c) and error
 * feedback: what a value lost to the compression is added to it the next time it is sent, on
 * the sending rank and on the rank that sends the block's mean back (compress.c says how). The
 * residuals are state: a checkpoint keeps them, each rank's own (compress_state). CPU ranks
 * (host memory). */
#ifndef MESHTRAIN_COMPRESS_H
#define MESHTRAIN_COMPRESS_H
#include <stddef.h>
#include "comm.h"
#include "model.h"

typedef enum { COMPRESS_NONE, COMPRESS_BF16, COMPRESS_INT8, COMPRESS_POWERSGD } CompressKind;
const char *compress_kind_name(CompressKind k);

typedef struct Compressor Compressor;
/* For a flat gradient of n_flat values all-reduced over groups of W ranks. */
Compressor *compress_create(CompressKind kind, size_t n_flat, int W);
/* PowerSGD (powersgd.c) of m's gradient (whole units: tensor parallel off) over W ranks, at
 * rank `rank`, compressing the matrices with rows x cols > (rows + cols) rank min_rate. */
Compressor *compress_create_powersgd(const Model *m, int W, int rank, double min_rate);
void compress_free(Compressor *c);
CompressKind compress_kind(const Compressor *c);
/* buf (n values at element `off` of the flat gradient) averaged over g, in place, the same on
 * every rank; blocking. 0 where it cannot (n or off not divisible by W): the caller reduces
 * buf uncompressed instead. Every rank of g calls it together. */
int compress_allreduce(Compressor *c, const Comm *g, float *buf, size_t off, size_t n);
/* The reduce-scatter alone (ZeRO and FSDP's gradient): buf's W blocks compressed with this
 * rank's residuals and sent to their ranks; out (n / W values) gets the mean of this rank's
 * block, summed in rank order. 0 where it cannot (PowerSGD, n not divisible by W). */
int compress_reduce_scatter(Compressor *c, const Comm *g, float *buf, size_t off, size_t n, float *out);
/* The state: this rank's residuals of every value it sends (*n_e = n_flat, returned), and of
 * its block of every bucket's mean, or PowerSGD's Q of every matrix (*n_f,
 * compress_server_state). */
float *compress_state(Compressor *c, size_t *n_e, size_t *n_f);
float *compress_server_state(Compressor *c);
#endif
