/* compress — the data-parallel gradient all-reduce with compressed messages and error
 * feedback (compress.h). A bucket of n values over W ranks, n divisible by W:
 *   1. x += e (this rank's residual of the values it sent before); q = Q(x); e = x - Q^-1(q);
 *   2. all-to-all: block j of q to rank j;
 *   3. rank j: s = the mean of the W blocks it got, dequantised and summed in rank order (fp32);
 *      s += f (its residual of what it sent back before); q2 = Q(s); f = s - Q^-1(q2);
 *   4. q2 to every rank (an all-to-all of W copies), each dequantises every rank's block.
 * Every rank ends with the same values (the same q2 blocks). Q is bf16 (round to nearest
 * even) or int8 with an fp32 scale per block of COMPRESS_BLOCK values (max |x| / 127, rounded
 * to nearest). e and f are kept for the whole flat gradient (e: n_flat values; f: n_flat / W,
 * this rank's block of each bucket), at the bucket's place, so that each value's residual meets
 * it again next step. The residual is x - Q^-1(q) in fp32, which is exact (the two are within
 * a factor of two of each other, or Q^-1(q) is 0), so what was sent plus the residual is the
 * input exactly. */
#include "compress_impl.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "util.h"

#define COMPRESS_BLOCK 256

const char *compress_kind_name(CompressKind k) {
    return k == COMPRESS_BF16 ? "bf16" : k == COMPRESS_INT8 ? "int8" : k == COMPRESS_POWERSGD ? "powersgd" : "none";
}

/* bytes of len values compressed */
static size_t packed_bytes(CompressKind k, size_t len) {
    if (k == COMPRESS_BF16) return 2 * len;
    return (len + COMPRESS_BLOCK - 1) / COMPRESS_BLOCK * sizeof(float) + len;
}

Compressor *compress_create(CompressKind kind, size_t n_flat, int W) {
    Compressor *c = xcalloc(1, sizeof *c);
    c->kind = kind, c->n_flat = n_flat, c->W = W;
    c->e = xcalloc(n_flat ? n_flat : 1, sizeof(float));
    c->f = xcalloc(n_flat / (size_t)W + 1, sizeof(float));
    return c;
}

Compressor *compress_create_powersgd(const Model *m, int W, int rank, double min_rate) {
    Compressor *c = xcalloc(1, sizeof *c);
    c->kind = COMPRESS_POWERSGD, c->n_flat = m->n_flat, c->W = W;
    c->e = xcalloc(m->n_flat ? m->n_flat : 1, sizeof(float));
    psgd_init(c, m, rank, min_rate);
    return c;
}

CompressKind compress_kind(const Compressor *c) { return c->kind; }

void compress_free(Compressor *c) {
    if (!c) return;
    free(c->e); free(c->f); free(c->q); free(c->in); free(c->out); free(c->s);
    free(c->mats); free(c->qt);
    free(c);
}

static void reserve(Compressor *c, size_t bytes, size_t block) {
    if (bytes <= c->cap) return;
    free(c->q); free(c->in); free(c->out); free(c->s);
    c->q = xmalloc(bytes);
    c->in = xmalloc(bytes);
    c->out = xmalloc(bytes);
    c->s = xmalloc(block * sizeof(float));
    c->cap = bytes;
}

static uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* x[len] (+= res first) into dst, res := x - what dst holds. A value that is not finite (an
 * overflow) is sent as one (a NaN scale for its int8 block) and leaves its residual as it was,
 * so the step's norm sees it (a loss scaler then skips the step) and nothing stays poisoned. */
static void pack(CompressKind k, float *x, size_t len, float *res, unsigned char *dst) {
    if (k == COMPRESS_BF16) {
        uint16_t *d = (uint16_t *)dst;
        for (size_t i = 0; i < len; i++) {
            float y = x[i] + res[i];
            d[i] = to_bf16(y);
            if (isfinite(y)) res[i] = y - from_bf16(d[i]);
        }
        return;
    }
    size_t nb = (len + COMPRESS_BLOCK - 1) / COMPRESS_BLOCK;
    float *scales = (float *)dst;
    signed char *v = (signed char *)(dst + nb * sizeof(float));
    for (size_t b = 0; b < nb; b++) {
        size_t lo = b * COMPRESS_BLOCK, hi = lo + COMPRESS_BLOCK < len ? lo + COMPRESS_BLOCK : len;
        float m = 0;
        int finite = 1;
        for (size_t i = lo; i < hi; i++) {
            float y = x[i] + res[i];
            finite &= isfinite(y) != 0;
            m = fmaxf(m, fabsf(y));
        }
        float s = m / 127.0f;
        scales[b] = finite && isfinite(s) ? s : NAN;
        for (size_t i = lo; i < hi; i++) {
            if (!finite || !isfinite(s)) { v[i] = 0; continue; }
            float y = x[i] + res[i], r = s > 0 ? nearbyintf(y / s) : 0.0f;
            r = r > 127 ? 127 : r < -127 ? -127 : r;
            v[i] = (signed char)r;
            res[i] = y - (float)v[i] * s;
        }
    }
}

/* dst[len] (+)= the values src holds */
static void unpack(CompressKind k, const unsigned char *src, size_t len, float *dst, int add) {
    if (k == COMPRESS_BF16) {
        const uint16_t *d = (const uint16_t *)src;
        for (size_t i = 0; i < len; i++) dst[i] = (add ? dst[i] : 0.0f) + from_bf16(d[i]);
        return;
    }
    size_t nb = (len + COMPRESS_BLOCK - 1) / COMPRESS_BLOCK;
    const float *scales = (const float *)src;
    const signed char *v = (const signed char *)(src + nb * sizeof(float));
    for (size_t i = 0; i < len; i++) dst[i] = (add ? dst[i] : 0.0f) + (float)v[i] * scales[i / COMPRESS_BLOCK];  /* (0 x NaN: NaN) */
}

/* The first half of both exchanges: buf's W blocks (n values) compressed with this rank's
 * residuals at element off and sent to their ranks; out (n / W; NULL: the compressor's own
 * block buffer) gets the mean of this rank's block, summed in rank order. bytes (W entries)
 * gets each message's size. */
static void reduce_blocks(Compressor *c, const Comm *g, float *buf, size_t off, size_t n, float *out, size_t *bytes) {
    int W = g->size;
    size_t blk = n / (size_t)W, pb = packed_bytes(c->kind, blk);
    reserve(c, pb * (size_t)W, blk);
    if (!out) out = c->s;  /* (after reserve, which may move it) */
    for (int j = 0; j < W; j++) bytes[j] = pb;
    for (int j = 0; j < W; j++) pack(c->kind, buf + (size_t)j * blk, blk, c->e + off + (size_t)j * blk, c->q + (size_t)j * pb);
    comm_alltoallv(g, c->q, bytes, c->in, bytes, "compressed gradient all-to-all");
    for (int i = 0; i < W; i++) unpack(c->kind, c->in + (size_t)i * pb, blk, out, i > 0);
    for (size_t i = 0; i < blk; i++) out[i] /= (float)W;
}

int compress_allreduce(Compressor *c, const Comm *g, float *buf, size_t off, size_t n) {
    int W = g->size;
    if (W != c->W || off + n > c->n_flat) return 0;
    if (c->kind == COMPRESS_POWERSGD) return psgd_allreduce(c, g, buf, off, n);
    if (n % (size_t)W || off % (size_t)W) return 0;
    size_t blk = n / (size_t)W, *bytes = xmalloc((size_t)W * sizeof *bytes);
    /* 1-3: this rank's block, the mean of every rank's, compressed again with its own residual */
    reduce_blocks(c, g, buf, off, n, NULL, bytes);
    size_t pb = bytes[0];
    pack(c->kind, c->s, blk, c->f + off / (size_t)W, c->q);
    /* 4: to every rank */
    for (int j = 0; j < W; j++) memcpy(c->out + (size_t)j * pb, c->q, pb);
    comm_alltoallv(g, c->out, bytes, c->in, bytes, "compressed gradient all-gather");
    for (int j = 0; j < W; j++) unpack(c->kind, c->in + (size_t)j * pb, blk, buf + (size_t)j * blk, 0);
    free(bytes);
    return 1;
}

int compress_reduce_scatter(Compressor *c, const Comm *g, float *buf, size_t off, size_t n, float *out) {
    int W = g->size;
    if (c->kind == COMPRESS_POWERSGD || W != c->W || n % (size_t)W || off + n > c->n_flat) return 0;
    size_t *bytes = xmalloc((size_t)W * sizeof *bytes);
    reduce_blocks(c, g, buf, off, n, out, bytes);
    free(bytes);
    return 1;
}

float *compress_state(Compressor *c, size_t *n_e, size_t *n_f) {
    *n_e = c->n_flat;
    *n_f = c->kind == COMPRESS_POWERSGD ? c->n_q : c->n_flat / (size_t)c->W;
    return c->e;
}

float *compress_server_state(Compressor *c) { return c->kind == COMPRESS_POWERSGD ? c->qt : c->f; }
