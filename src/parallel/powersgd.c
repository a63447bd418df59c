/* powersgd — PowerSGD (Vogels et al. 2019), with the semantics of PyTorch's powerSGD_hook:
 * for a bucket of the flat gradient on W ranks,
 *   x += e (this rank's error of the bucket, all of it); keep x;
 *   every matrix M [n, m] of the bucket worth compressing (n m > (n + m) r min_rate, r =
 *   min(n, m, rank)): P = M Q (Q [m, r], this rank's from the step before: warm start; at the
 *   first, normal draws from a seed every rank shares, orthogonalised); P summed over the ranks;
 *   P's columns orthogonalised; Q = M^T P, summed over the ranks and divided by W; M := P Q^T;
 *   the rest of the bucket (vectors, the norms' weights, a unit's padding): averaged whole;
 *   e := the kept x - the bucket now (the same for both parts, as the hook's).
 * At full rank P P^T is the projection on M's columns and the result is the mean. The matrices
 * are the model's tensors (model_tensors: row-major [rows, cols]); the products go through the
 * ops (CPU ranks). State: e, and every matrix's Q, which a checkpoint keeps (compress_state). */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "compress_impl.h"
#include "ops.h"
#include "util.h"

/* Gram-Schmidt on the r columns of a [n, r] row-major matrix (in place, sums in double); a
 * column with no norm left becomes zero (the hook's epsilon 0) */
static void orthogonalize(float *a, size_t n, int r) {
    for (int j = 0; j < r; j++) {
        double s = 0;
        for (size_t i = 0; i < n; i++) s += (double)a[i * r + j] * a[i * r + j];
        double inv = s > 0 ? 1.0 / sqrt(s) : 0.0;
        for (size_t i = 0; i < n; i++) a[i * r + j] = (float)(a[i * r + j] * inv);
        for (int k = j + 1; k < r; k++) {
            double d = 0;
            for (size_t i = 0; i < n; i++) d += (double)a[i * r + j] * a[i * r + k];
            for (size_t i = 0; i < n; i++) a[i * r + k] -= (float)(d * a[i * r + j]);
        }
    }
}

void psgd_init(Compressor *c, const Model *m, int rank, double min_rate) {
    int max = model_n_tensors(&m->c);
    TensorInfo *t = xcalloc((size_t)max, sizeof *t);
    int nt = model_tensors(m, t, max);
    c->mats = xcalloc((size_t)nt + 1, sizeof *c->mats);
    size_t q = 0;
    for (int i = 0; i < nt; i++) {
        size_t rows = (size_t)t[i].rows, cols = (size_t)t[i].cols;
        if (!m->units[t[i].unit].n || rows < 2 || cols < 2) continue;
        int r = rank;
        if ((size_t)r > rows) r = (int)rows;
        if ((size_t)r > cols) r = (int)cols;
        if ((double)rows * cols <= (double)(rows + cols) * r * min_rate) continue;  /* not worth it */
        c->mats[c->n_mats++] = (PsgdMatrix){t[i].offset, rows, cols, r, q};
        q += cols * (size_t)r;
    }
    free(t);
    c->n_q = q;
    c->qt = xcalloc(q + 1, sizeof(float));
    /* Q^T [r, cols] of each: normal draws from one seed, the same on every rank, rows orthonormal */
    Rng g;
    rng_seed(&g, 0x9e3779b97f4a7c15ULL);
    for (int k = 0; k < c->n_mats; k++) {
        const PsgdMatrix *x = &c->mats[k];
        float *qt = c->qt + x->q;
        for (size_t i = 0; i < x->cols * (size_t)x->r; i++) qt[i] = rng_normal(&g);
        /* its rows are Q's columns: orthogonalise Q = qt^T [cols, r], i.e. qt's rows */
        float *tmp = xmalloc(x->cols * (size_t)x->r * sizeof(float));
        for (int j = 0; j < x->r; j++)
            for (size_t i = 0; i < x->cols; i++) tmp[i * x->r + j] = qt[(size_t)j * x->cols + i];
        orthogonalize(tmp, x->cols, x->r);
        for (int j = 0; j < x->r; j++)
            for (size_t i = 0; i < x->cols; i++) qt[(size_t)j * x->cols + i] = tmp[i * x->r + j];
        free(tmp);
    }
}

int psgd_allreduce(Compressor *c, const Comm *g, float *buf, size_t off, size_t n) {
    int W = g->size;
    /* the bucket's matrices (whole tensors: a bucket is whole units) */
    int k0 = 0, k1;
    while (k0 < c->n_mats && c->mats[k0].offset < off) k0++;
    for (k1 = k0; k1 < c->n_mats && c->mats[k1].offset < off + n; k1++)
        if (c->mats[k1].offset + c->mats[k1].rows * c->mats[k1].cols > off + n) return 0;
    size_t np = 0, nq = 0, nu = n;
    for (int k = k0; k < k1; k++) {
        np += c->mats[k].rows * (size_t)c->mats[k].r;
        nq += c->mats[k].cols * (size_t)c->mats[k].r;
        nu -= c->mats[k].rows * c->mats[k].cols;
    }
    float *e = c->e + off, *keep = xmalloc(n * sizeof(float)), *p = xmalloc((np + 1) * sizeof(float));
    float *qs = xmalloc((nq + 1) * sizeof(float)), *rest = xmalloc((nu + 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) keep[i] = buf[i] += e[i];
    /* P = M Q of every matrix, summed over the ranks in one all-reduce */
    size_t pp = 0;
    for (int k = k0; k < k1; k++) {
        const PsgdMatrix *x = &c->mats[k];
        op_matmul_forward(p + pp, buf + (x->offset - off), c->qt + x->q, (int)x->rows, (int)x->cols, x->r);
        pp += x->rows * (size_t)x->r;
    }
    CommReq q = {0};
    if (np) {
        comm_iallreduce(g, p, np, COMM_F32, COMM_SUM, &q, "PowerSGD all-reduce (P)");
        comm_wait(&q);
    }
    /* Q = M^T P (P's columns orthonormal), summed over the ranks, / W */
    pp = 0;
    size_t qq = 0;
    for (int k = k0; k < k1; k++) {
        const PsgdMatrix *x = &c->mats[k];
        orthogonalize(p + pp, x->rows, x->r);
        memset(qs + qq, 0, x->cols * (size_t)x->r * sizeof(float));
        op_matmul_backward_set(NULL, qs + qq, p + pp, buf + (x->offset - off), NULL, (int)x->rows, (int)x->cols, x->r);
        pp += x->rows * (size_t)x->r, qq += x->cols * (size_t)x->r;
    }
    if (nq) {
        comm_iallreduce(g, qs, nq, COMM_F32, COMM_SUM, &q, "PowerSGD all-reduce (Q)");
        comm_wait(&q);
    }
    for (size_t i = 0; i < nq; i++) qs[i] /= (float)W;
    /* the rest of the bucket (what lies between the matrices), averaged whole */
    size_t at = 0, u = 0;
    for (int k = k0; k <= k1; k++) {
        size_t end = k < k1 ? c->mats[k].offset - off : n;
        memcpy(rest + u, buf + at, (end - at) * sizeof(float));
        u += end - at;
        if (k < k1) at = end + c->mats[k].rows * c->mats[k].cols;
    }
    if (nu) {
        comm_iallreduce(g, rest, nu, COMM_F32, COMM_AVG, &q, "PowerSGD all-reduce (vectors)");
        comm_wait(&q);
    }
    at = 0, u = 0;
    for (int k = k0; k <= k1; k++) {
        size_t end = k < k1 ? c->mats[k].offset - off : n;
        memcpy(buf + at, rest + u, (end - at) * sizeof(float));
        u += end - at;
        if (k < k1) at = end + c->mats[k].rows * c->mats[k].cols;
    }
    /* M = P Q^T; the new Q kept for the next step (warm start) */
    pp = 0, qq = 0;
    for (int k = k0; k < k1; k++) {
        const PsgdMatrix *x = &c->mats[k];
        memcpy(c->qt + x->q, qs + qq, x->cols * (size_t)x->r * sizeof(float));
        op_matmul_backward_set(buf + (x->offset - off), NULL, p + pp, NULL, c->qt + x->q, (int)x->rows, (int)x->cols,
                               x->r);
        pp += x->rows * (size_t)x->r, qq += x->cols * (size_t)x->r;
    }
    for (size_t i = 0; i < n; i++) e[i] = keep[i] - buf[i];
    free(keep); free(p); free(qs); free(rest);
    return 1;
}
