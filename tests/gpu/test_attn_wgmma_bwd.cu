/* GPU test of the Hopper wgmma attention backward (src/ops/cuda/attn_wgmma_bwd.cu) against the tested
 * mma.sync kernel attn_bf16_backward (src/ops/cuda/attn_bf16.cu) on the same random bf16 inputs (out
 * and lse from attn_bf16_forward): dq, dk and dv each by max abs error and norm-wise relative error
 * (||x - ref|| / ||ref||, tolerance TOL_NORM); acc = 0 (the output starts as NaN: every element must
 * be written) and acc = 1 (the output starts as a random base that must be added to, compared with
 * attn_bf16_backward's acc = 1 on the same base); deterministic 1 and 0; in deterministic mode two
 * runs must be bitwise equal; nothing written past the end of dqkv or of the workspace (guard
 * regions). HD 64, 96, 128 and 256 at T = 1, 7, 64, 127, 128, 129, 300, 1000, 2048, and shapes with more
 * blocks than SMs (deterministic mode's semaphores across waves of blocks). With RoPE's tables
 * (the fused backward, acc = 0) at odd T = 1 .. 2049: against an fp64 CPU reference (attention's
 * backward, then RoPE's), attn_bf16_backward's fused RoPE and the two passes (test_rope_shape).
 * HD 96 and 256, which attn_bf16 does not take: out and lse from an fp64 CPU forward (rounded as the
 * kernels round them), and everything against the fp64 CPU reference (acc = 1: the base plus it) and,
 * with RoPE, the two passes; the shapes with more blocks than SMs smaller (the reference's time).
 * HD 256's key tiles are 64 (not 128) keys: T = 64, 127, 129, 300, 1000 are (not) whole key tiles
 * there too, and 2 x 12 x 1000 is 16 key tiles x 24 heads = 384 blocks (several waves).
 * A hang (a lost barrier) is a FAIL, not a stuck test: the kernels' mbarrier and semaphore waits fault
 * after 4 s (device watchdog), and every synchronisation here gives up after HANG_S seconds.
 * Prints "ok   <check>" / "FAIL <check>" per check and "RESULT <passed> <failed>" last. A device other
 * than compute capability 9.0 skips everything (RESULT 0 0).
 * Usage: gpu_test_attn_wgmma_bwd [--perf] [--perf-only] [--hd N]
 *   --hd N: the checks at head_dim N only (HD 256's fp64 CPU references take minutes).
 *   --perf: afterwards, TFLOP/s (causal backward: 2.5 x 4 B NH T^2 HD / 2 FLOPs) of wgmma
 *   deterministic, wgmma not deterministic (atomic adds) and attn_bf16_backward ("own"), each call
 *   whole (memset, preprocess, main kernel, postprocess), median of several.
 * ATTN_WGMMA_BWD_DEBUG=1: first tiny cases (B=1 NH=1) against an fp64 CPU reference, printing the
 * first mismatching elements of dq, dk, dv: random inputs, and dO = 0 except one element (row r0,
 * column c0): then only dq's row r0, dk's rows <= r0 and dv's column c0 (rows <= r0) are nonzero,
 * which tells a layout error from a numerical one. */
#include "attn_bf16.h"
#include "attn_test_util.h"
#include "attn_wgmma_bwd.h"
#include "cu_report.h"
#include "ops.h" /* bf16_round, bf16_widen */

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define TOL_NORM 2e-2 /* ||x - ref|| / ||ref|| per gradient (bf16 results of two bf16 kernels) */
#define ZERO_TOL 1e-5 /* max abs error where the reference is all zero (T = 1's dq, dk) */
#define GUARD 4096    /* bf16 elements past dqkv's end (and bytes past the workspace's) that must stay 0xff */
#define HANG_S 30.0   /* a synchronisation that takes longer is a hang: FAIL and exit */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}
/* waits for the device with a timeout: a hang (e.g. a named barrier that never completes, which the
 * device watchdog does not cover) becomes a FAIL and exit (the context cannot be recovered) */
static void sync_or_die(const char *where, int line) {
    CK(cudaGetLastError());
    cudaEvent_t ev;
    CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    CK(cudaEventRecord(ev, 0));
    const double t0 = now_s();
    for (;;) {
        const cudaError_t e = cudaEventQuery(ev);
        if (e == cudaSuccess) break;
        if (e != cudaErrorNotReady) CK(e);
        if (now_s() - t0 > HANG_S) {
            printf("FAIL %s (line %d): the device did not finish in %.0f s (a hang)\n", where, line, HANG_S);
            printf("RESULT %d %d\n", n_passed, n_failed + 1);
            fflush(stdout);
            _exit(1);
        }
        usleep(200);
    }
    cudaEventDestroy(ev);
    CK(cudaDeviceSynchronize());
}
#define SYNC(where) sync_or_die(where, __LINE__)

/* ---------------------------------------------------------------------------------------------- */
/* comparisons                                                                                     */

/* gradient part `part` (0 q, 1 k, 2 v) of [B*T, 3C] bf16 x against ref (bf16, or with ref64 the fp64
 * reference): max abs err, max |ref|, norm-wise relative error, non-finite count, first non-finite
 * index */
struct Cmp {
    double md, mr, nrel;
    size_t nonfinite, first_bad;
};
static Cmp compare_part(const uint16_t *x, const uint16_t *ref, size_t rows, int C, int part,
                        const double *ref64 = NULL) {
    Cmp r = {0, 0, 0, 0, (size_t)-1};
    double sd = 0, sr = 0;
    for (size_t t = 0; t < rows; t++)
        for (int c = 0; c < C; c++) {
            const size_t i = t * 3 * (size_t)C + (size_t)part * C + c;
            const double a = bf16_widen(x[i]), y = ref64 ? ref64[i] : bf16_widen(ref[i]);
            if (!isfinite(a)) {
                if (!r.nonfinite++) r.first_bad = t * C + c;
                continue;
            }
            const double d = fabs(a - y);
            if (d > r.md) r.md = d;
            if (fabs(y) > r.mr) r.mr = fabs(y);
            sd += d * d, sr += y * y;
        }
    r.nrel = r.nonfinite ? INFINITY : sqrt(sd / fmax(sr, 1e-30));
    return r;
}

/* ---------------------------------------------------------------------------------------------- */
/* fp64 CPU references                                                                             */

/* causal attention's backward in fp64 from bf16 qkv [B*T, 3C] and dO [B*T, C]: ref [B*T, 3C] = dq, dk,
 * dv (scores scaled by 1/sqrt(HD)). One (batch, head) pair per OpenMP thread, every loop over rows
 * (dk and dv summed query row by query row), so that head_dim 256's references take seconds. */
static void cpu_attn_backward(const uint16_t *h, const uint16_t *hdo, int B, int T, int NH, int HD, double *ref) {
    const int C = NH * HD;
    const double sc = 1.0 / sqrt((double)HD);
#pragma omp parallel for collapse(2) schedule(dynamic)
    for (int b = 0; b < B; b++)
        for (int hh = 0; hh < NH; hh++) {
            const uint16_t *x = h + (size_t)b * T * 3 * C + (size_t)hh * HD, *g = hdo + (size_t)b * T * C + (size_t)hh * HD;
            double *r = ref + (size_t)b * T * 3 * C + (size_t)hh * HD;
            /* this pair's q, k, v, dO widened, and the row of P and dS */
            double *Q = (double *)malloc((size_t)T * HD * sizeof(double)), *K = (double *)malloc((size_t)T * HD * sizeof(double));
            double *V = (double *)malloc((size_t)T * HD * sizeof(double)), *G = (double *)malloc((size_t)T * HD * sizeof(double));
            double *P = (double *)malloc((size_t)T * sizeof(double)), *S = (double *)malloc((size_t)T * sizeof(double));
            double *dk = (double *)calloc((size_t)T * HD, sizeof(double)), *dv = (double *)calloc((size_t)T * HD, sizeof(double));
            for (int t = 0; t < T; t++)
                for (int d = 0; d < HD; d++) {
                    Q[(size_t)t * HD + d] = bf16_widen(x[(size_t)t * 3 * C + d]);
                    K[(size_t)t * HD + d] = bf16_widen(x[(size_t)t * 3 * C + C + d]);
                    V[(size_t)t * HD + d] = bf16_widen(x[(size_t)t * 3 * C + 2 * C + d]);
                    G[(size_t)t * HD + d] = bf16_widen(g[(size_t)t * C + d]);
                }
            for (int i = 0; i < T; i++) {
                const double *qi = Q + (size_t)i * HD, *gi = G + (size_t)i * HD;
                double mx = -1e300, sum = 0;
                for (int j = 0; j <= i; j++) {
                    double s = 0;
                    for (int d = 0; d < HD; d++) s += qi[d] * K[(size_t)j * HD + d];
                    P[j] = s * sc;
                    mx = fmax(mx, s * sc);
                }
                for (int j = 0; j <= i; j++) sum += exp(P[j] - mx);
                for (int j = 0; j <= i; j++) P[j] = exp(P[j] - mx) / sum;
                double Di = 0;
                for (int d = 0; d < HD; d++) {
                    double o = 0;
                    for (int j = 0; j <= i; j++) o += P[j] * V[(size_t)j * HD + d];
                    Di += o * gi[d];
                }
                for (int j = 0; j <= i; j++) {
                    double s = 0;
                    for (int d = 0; d < HD; d++) s += gi[d] * V[(size_t)j * HD + d];
                    S[j] = P[j] * (s - Di); /* dS */
                }
                for (int d = 0; d < HD; d++) {
                    double q = 0;
                    for (int j = 0; j <= i; j++) q += S[j] * K[(size_t)j * HD + d];
                    r[(size_t)i * 3 * C + d] = q * sc;
                }
                for (int j = 0; j <= i; j++)
                    for (int d = 0; d < HD; d++)
                        dk[(size_t)j * HD + d] += S[j] * qi[d], dv[(size_t)j * HD + d] += P[j] * gi[d];
            }
            for (int t = 0; t < T; t++)
                for (int d = 0; d < HD; d++) {
                    r[(size_t)t * 3 * C + C + d] = dk[(size_t)t * HD + d] * sc;
                    r[(size_t)t * 3 * C + 2 * C + d] = dv[(size_t)t * HD + d];
                }
            free(Q), free(K), free(V), free(G), free(P), free(S), free(dk), free(dv);
        }
}

/* causal attention's forward in fp64 from bf16 qkv [B*T, 3C]: out [B*T, C] rounded to bf16, lse
 * [B, NH, T] (natural log of the sum of exp(scores / sqrt(HD))) rounded to fp32 */
static void cpu_attn_forward(const uint16_t *h, int B, int T, int NH, int HD, uint16_t *out, float *lse) {
    const int C = NH * HD;
    const double sc = 1.0 / sqrt((double)HD);
#pragma omp parallel for collapse(2) schedule(dynamic)
    for (int b = 0; b < B; b++)
        for (int hh = 0; hh < NH; hh++) {
            double *P = (double *)malloc((size_t)T * sizeof(double)), *o = (double *)malloc((size_t)HD * sizeof(double));
            const uint16_t *x = h + (size_t)b * T * 3 * C + (size_t)hh * HD;
            for (int i = 0; i < T; i++) {
                double mx = -1e300, sum = 0;
                for (int j = 0; j <= i; j++) {
                    double s = 0;
                    for (int d = 0; d < HD; d++)
                        s += bf16_widen(x[(size_t)i * 3 * C + d]) * bf16_widen(x[(size_t)j * 3 * C + C + d]);
                    P[j] = s * sc;
                    mx = fmax(mx, s * sc);
                }
                for (int j = 0; j <= i; j++) sum += (P[j] = exp(P[j] - mx));
                for (int d = 0; d < HD; d++) o[d] = 0;
                for (int j = 0; j <= i; j++)
                    for (int d = 0; d < HD; d++) o[d] += P[j] * bf16_widen(x[(size_t)j * 3 * C + 2 * C + d]);
                for (int d = 0; d < HD; d++) out[((size_t)b * T + i) * C + (size_t)hh * HD + d] = bf16_round((float)(o[d] / sum));
                lse[((size_t)b * NH + hh) * T + i] = (float)(mx + log(sum));
            }
            free(P), free(o);
        }
}

/* out and lse on the device for qkv (h_qkv on the host): attn_bf16_forward where it takes HD, else
 * cpu_attn_forward's */
static void forward_for(void *out, float *lse, const void *qkv, const uint16_t *h_qkv, int B, int T, int NH, int HD) {
    if (attn_bf16_supported(HD)) {
        attn_bf16_forward(out, lse, qkv, B, T, NH, HD, NULL);
        return;
    }
    const size_t nout = (size_t)B * T * NH * HD, nlse = (size_t)B * NH * T;
    uint16_t *ho = (uint16_t *)malloc(nout * 2);
    float *hl = (float *)malloc(nlse * 4);
    cpu_attn_forward(h_qkv, B, T, NH, HD, ho, hl);
    CK(cudaMemcpy(out, ho, nout * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(lse, hl, nlse * 4, cudaMemcpyHostToDevice));
    free(ho), free(hl);
}

/* RoPE's tables as op_rope_tables computes them (cpu_rope_tables, base 10000): [T, HD/2] */
static void rope_tables(float *cs, float *sn, int T, int HD) {
    const int half = HD / 2;
    for (int i = 0; i < half; i++) {
        const float inv = 1.0f / powf(10000.0f, (float)(2 * i) / (float)HD);
        for (int t = 0; t < T; t++) {
            const float f = (float)t * inv;
            cs[(size_t)t * half + i] = cosf(f), sn[(size_t)t * half + i] = sinf(f);
        }
    }
}

/* RoPE's backward (dir = -1) on the q and k parts of ref [B*T, 3C] in fp64: each interleaved pair
 * (x, y) of position t -> (x c + y s, -x s + y c) */
static void cpu_rope_backward(double *ref, const float *cs, const float *sn, int B, int T, int NH, int HD) {
    const int C = NH * HD, half = HD / 2;
    for (size_t bt = 0; bt < (size_t)B * T; bt++)
        for (int p = 0; p < 2 * NH * half; p++) {
            const int t = (int)(bt % T), i = p % half;
            double *x = ref + bt * 3 * C + 2 * (size_t)p;
            const double c = cs[(size_t)t * half + i], s = sn[(size_t)t * half + i], a = x[0], b = x[1];
            x[0] = a * c + b * s, x[1] = -a * s + b * c;
        }
}

/* ---------------------------------------------------------------------------------------------- */
/* against attn_bf16_backward                                                                      */

static void test_shape(int B, int NH, int T, int HD) {
    const int C = NH * HD, own = attn_bf16_supported(HD); /* else against the fp64 CPU reference */
    const size_t rows = (size_t)B * T, n3 = rows * 3 * C, nout = rows * C, nlse = (size_t)B * NH * T;
    char name[128];
    snprintf(name, sizeof name, "attn_wgmma_bwd B=%d NH=%d T=%d HD=%d", B, NH, T, HD);

    uint16_t *h_qkv = (uint16_t *)malloc(n3 * 2), *h_do = (uint16_t *)malloc(nout * 2);
    for (size_t i = 0; i < n3; i++) h_qkv[i] = bf16_round((float)nrand());
    for (size_t i = 0; i < nout; i++) h_do[i] = bf16_round((float)nrand());
    void *qkv, *dout, *out, *dref, *dw, *wsr, *wsw;
    float *lse;
    const size_t wsr_bytes = own ? attn_bf16_workspace_bytes(B, T, NH, HD) : 16;
    const size_t ws_bytes = attn_wgmma_bwd_workspace_bytes(B, T, NH, HD);
    CK(cudaMalloc(&qkv, n3 * 2));
    CK(cudaMalloc(&dout, nout * 2));
    CK(cudaMalloc(&out, nout * 2));
    CK(cudaMalloc((void **)&lse, nlse * 4));
    CK(cudaMalloc(&dref, n3 * 2));
    CK(cudaMalloc(&dw, (n3 + GUARD) * 2));
    CK(cudaMalloc(&wsr, wsr_bytes));
    CK(cudaMalloc(&wsw, ws_bytes + GUARD));
    CK(cudaMemcpy(qkv, h_qkv, n3 * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dout, h_do, nout * 2, cudaMemcpyHostToDevice));
    CK(cudaMemset((char *)wsw + ws_bytes, 0xff, GUARD));
    forward_for(out, lse, qkv, h_qkv, B, T, NH, HD);
    SYNC("forward");

    /* references: acc = 0, and acc = 1 on a random base of about the gradients' size (per part):
     * attn_bf16_backward's, or (!own) the fp64 CPU reference (ref64) and the base plus it (ref64a) */
    uint16_t *ref0 = (uint16_t *)malloc(n3 * 2), *ref1 = (uint16_t *)malloc(n3 * 2), *hbase = (uint16_t *)malloc(n3 * 2);
    double *ref64 = NULL, *ref64a = NULL;
    if (own) {
        CK(cudaMemset(dref, 0, n3 * 2));
        attn_bf16_backward(dref, dout, qkv, out, lse, wsr, B, T, NH, HD, 0, NULL, NULL, NULL);
        SYNC("attn_bf16_backward acc=0");
        CK(cudaMemcpy(ref0, dref, n3 * 2, cudaMemcpyDeviceToHost));
    } else {
        ref64 = (double *)calloc(n3, sizeof(double)), ref64a = (double *)calloc(n3, sizeof(double));
        cpu_attn_backward(h_qkv, h_do, B, T, NH, HD, ref64);
    }
    double rms[3] = {0, 0, 0};
    for (size_t i = 0; i < n3; i++) {
        const double v = own ? bf16_widen(ref0[i]) : ref64[i];
        rms[(i % (3 * (size_t)C)) / C] += v * v;
    }
    /* a part whose exact gradient is zero (T = 1's dq, dk) is judged by absolute error, at acc = 1
     * too: its base, scaled by that zero, is about 1e-6, the size of fp32's rounding noise in dS */
    int zero_part[3];
    for (int p = 0; p < 3; p++) zero_part[p] = !own && rms[p] == 0.0;
    for (int p = 0; p < 3; p++) rms[p] = sqrt(rms[p] / (double)(rows * C)) + 1e-6;
    for (size_t i = 0; i < n3; i++) hbase[i] = bf16_round((float)(nrand() * rms[(i % (3 * (size_t)C)) / C]));
    if (own) {
        CK(cudaMemcpy(dref, hbase, n3 * 2, cudaMemcpyHostToDevice));
        attn_bf16_backward(dref, dout, qkv, out, lse, wsr, B, T, NH, HD, 1, NULL, NULL, NULL);
        SYNC("attn_bf16_backward acc=1");
        CK(cudaMemcpy(ref1, dref, n3 * 2, cudaMemcpyDeviceToHost));
    } else {
        for (size_t i = 0; i < n3; i++) ref64a[i] = bf16_widen(hbase[i]) + ref64[i];
    }

    uint16_t *hw = (uint16_t *)malloc((n3 + GUARD) * 2), *hw2 = (uint16_t *)malloc(n3 * 2);
    unsigned char *hg = (unsigned char *)malloc(GUARD);
    static const char *pn[3] = {"dq", "dk", "dv"};
    for (int acc = 0; acc < 2; acc++)
        for (int det = 1; det >= 0; det--) {
            char cn[200];
            snprintf(cn, sizeof cn, "%s acc=%d det=%d", name, acc, det);
            /* the output: NaN (acc = 0) or the base (acc = 1); the guard past it: 0xff */
            CK(cudaMemset(dw, 0xff, (n3 + GUARD) * 2));
            if (acc) CK(cudaMemcpy(dw, hbase, n3 * 2, cudaMemcpyHostToDevice));
            attn_wgmma_backward(dw, dout, qkv, out, lse, wsw, B, T, NH, HD, acc, det, NULL, NULL, NULL);
            SYNC(cn);
            CK(cudaMemcpy(hw, dw, (n3 + GUARD) * 2, cudaMemcpyDeviceToHost));
            const uint16_t *ref = acc ? ref1 : ref0;
            for (int p = 0; p < 3; p++) {
                const Cmp r = own ? compare_part(hw, ref, rows, C, p) : compare_part(hw, NULL, rows, C, p, acc ? ref64a : ref64);
                if (r.nonfinite)
                    printf("info %s %s: %zu non-finite elements, the first at token %zu column %zu\n", cn, pn[p],
                           r.nonfinite, r.first_bad / C, r.first_bad % C);
                /* against the fp64 reference, T = 1's all-zero dq and dk by absolute error (as below) */
                const int zero = zero_part[p];
                report(zero ? r.md < ZERO_TOL : r.nrel < TOL_NORM,
                       "%s %s%s: max abs err %.3e (max |ref| %.3e), norm-wise %.2e (tol %.0e%s)", cn, pn[p],
                       own ? "" : " vs fp64 CPU reference", r.md, r.mr, r.nrel, zero ? ZERO_TOL : TOL_NORM,
                       zero ? " absolute: the exact gradient is zero" : "");
            }
            int guard_ok = 1;
            for (size_t i = 0; i < GUARD; i++) guard_ok &= hw[n3 + i] == 0xffff;
            CK(cudaMemcpy(hg, (char *)wsw + ws_bytes, GUARD, cudaMemcpyDeviceToHost));
            for (size_t i = 0; i < GUARD; i++) guard_ok &= hg[i] == 0xff;
            report(guard_ok, "%s: nothing written past dqkv and the workspace", cn);
            if (det) { /* a second run from the same start: bitwise the same */
                CK(cudaMemset(dw, 0xff, n3 * 2));
                if (acc) CK(cudaMemcpy(dw, hbase, n3 * 2, cudaMemcpyHostToDevice));
                attn_wgmma_backward(dw, dout, qkv, out, lse, wsw, B, T, NH, HD, acc, det, NULL, NULL, NULL);
                SYNC(cn);
                CK(cudaMemcpy(hw2, dw, n3 * 2, cudaMemcpyDeviceToHost));
                size_t ndiff = 0, first = 0;
                for (size_t i = 0; i < n3; i++)
                    if (hw[i] != hw2[i] && !ndiff++) first = i;
                if (ndiff)
                    printf("info %s: %zu elements differ between two runs, the first at token %zu column %zu\n", cn,
                           ndiff, first / (3 * (size_t)C), first % (3 * (size_t)C));
                report(!ndiff, "%s: two runs bitwise equal", cn);
            }
        }

    free(h_qkv), free(h_do), free(ref0), free(ref1), free(hbase), free(hw), free(hw2), free(hg), free(ref64), free(ref64a);
    cudaFree(qkv), cudaFree(dout), cudaFree(out), cudaFree(lse), cudaFree(dref), cudaFree(dw), cudaFree(wsr);
    cudaFree(wsw);
}

/* ---------------------------------------------------------------------------------------------- */
/* RoPE's backward fused (cos_t, sin_t given; acc = 0, the only mode it takes)                     */

/* Against: the fp64 CPU reference (attention's backward, then RoPE's) where `cpu`; attn_bf16_backward
 * with the same tables; and the two passes (this kernel without RoPE, then RoPE's backward applied to
 * its bf16 output as rope8_kernel does, rounded again), which the fused path may differ from only by
 * that extra rounding: per interleaved pair of dq and dk, |fused - two passes| <= 2^-6 of the pair's
 * norm (two bf16 half-ulps of the norm and the rotated first rounding, 3 x 2^-8, with a margin);
 * dv bitwise the same as without RoPE. The output starts as NaN (every element written), guard
 * regions past dqkv and the workspace stay untouched, and deterministic mode is bitwise
 * reproducible. */
static void test_rope_shape(int B, int NH, int T, int HD, int cpu) {
    const int C = NH * HD, half = HD / 2, own = attn_bf16_supported(HD); /* !own: the CPU reference only */
    if (!own) cpu = 1;
    const size_t rows = (size_t)B * T, n3 = rows * 3 * C, nout = rows * C, nlse = (size_t)B * NH * T;
    const size_t ntab = (size_t)T * half;
    char name[128];
    snprintf(name, sizeof name, "attn_wgmma_bwd rope B=%d NH=%d T=%d HD=%d", B, NH, T, HD);

    uint16_t *h_qkv = (uint16_t *)malloc(n3 * 2), *h_do = (uint16_t *)malloc(nout * 2);
    for (size_t i = 0; i < n3; i++) h_qkv[i] = bf16_round((float)nrand());
    for (size_t i = 0; i < nout; i++) h_do[i] = bf16_round((float)nrand());
    float *h_cs = (float *)malloc(ntab * 4), *h_sn = (float *)malloc(ntab * 4);
    rope_tables(h_cs, h_sn, T, HD);
    void *qkv, *dout, *out, *dref, *dw, *wsr, *wsw;
    float *lse, *cs, *sn;
    const size_t wsr_bytes = own ? attn_bf16_workspace_bytes(B, T, NH, HD) : 16;
    const size_t ws_bytes = attn_wgmma_bwd_workspace_bytes(B, T, NH, HD);
    CK(cudaMalloc(&qkv, n3 * 2));
    CK(cudaMalloc(&dout, nout * 2));
    CK(cudaMalloc(&out, nout * 2));
    CK(cudaMalloc((void **)&lse, nlse * 4));
    CK(cudaMalloc((void **)&cs, ntab * 4));
    CK(cudaMalloc((void **)&sn, ntab * 4));
    CK(cudaMalloc(&dref, n3 * 2));
    CK(cudaMalloc(&dw, (n3 + GUARD) * 2));
    CK(cudaMalloc(&wsr, wsr_bytes));
    CK(cudaMalloc(&wsw, ws_bytes + GUARD));
    CK(cudaMemcpy(qkv, h_qkv, n3 * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dout, h_do, nout * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(cs, h_cs, ntab * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(sn, h_sn, ntab * 4, cudaMemcpyHostToDevice));
    CK(cudaMemset((char *)wsw + ws_bytes, 0xff, GUARD));
    forward_for(out, lse, qkv, h_qkv, B, T, NH, HD);
    SYNC("forward");

    /* references: attn_bf16_backward with the tables (where it takes HD); this kernel without them (deterministic), and
     * the second pass on its output on the host (rope8_kernel's operations, then bf16) */
    uint16_t *owner = (uint16_t *)malloc(n3 * 2), *plain = (uint16_t *)malloc(n3 * 2), *two = (uint16_t *)malloc(n3 * 2);
    if (own) {
        CK(cudaMemset(dref, 0xff, n3 * 2));
        attn_bf16_backward(dref, dout, qkv, out, lse, wsr, B, T, NH, HD, 0, cs, sn, NULL);
        SYNC("attn_bf16_backward rope");
        CK(cudaMemcpy(owner, dref, n3 * 2, cudaMemcpyDeviceToHost));
    }
    CK(cudaMemset(dref, 0xff, n3 * 2));
    attn_wgmma_backward(dref, dout, qkv, out, lse, wsw, B, T, NH, HD, 0, 1, NULL, NULL, NULL);
    SYNC("attn_wgmma_backward without rope");
    CK(cudaMemcpy(plain, dref, n3 * 2, cudaMemcpyDeviceToHost));
    memcpy(two, plain, n3 * 2);
    for (size_t bt = 0; bt < rows; bt++)
        for (int p = 0; p < 2 * NH * half; p++) {
            const int t = (int)(bt % T), i = p % half;
            uint16_t *x = two + bt * 3 * C + 2 * (size_t)p;
            const float c = h_cs[(size_t)t * half + i], s = -h_sn[(size_t)t * half + i];
            const float a = bf16_widen(x[0]), b = bf16_widen(x[1]);
            const volatile float ac = a * c, bs = b * s, as = a * s, bc = b * c; /* no FMA, as the kernel */
            x[0] = bf16_round(ac - bs), x[1] = bf16_round(as + bc);
        }
    double *ref64 = NULL;
    if (cpu) {
        ref64 = (double *)calloc(n3, sizeof(double));
        cpu_attn_backward(h_qkv, h_do, B, T, NH, HD, ref64);
        cpu_rope_backward(ref64, h_cs, h_sn, B, T, NH, HD);
    }

    uint16_t *hw = (uint16_t *)malloc((n3 + GUARD) * 2), *hw2 = (uint16_t *)malloc(n3 * 2);
    unsigned char *hg = (unsigned char *)malloc(GUARD);
    static const char *pn[3] = {"dq", "dk", "dv"};
    for (int det = 1; det >= 0; det--) {
        char cn[200];
        snprintf(cn, sizeof cn, "%s det=%d", name, det);
        CK(cudaMemset(dw, 0xff, (n3 + GUARD) * 2));
        attn_wgmma_backward(dw, dout, qkv, out, lse, wsw, B, T, NH, HD, 0, det, cs, sn, NULL);
        SYNC(cn);
        CK(cudaMemcpy(hw, dw, (n3 + GUARD) * 2, cudaMemcpyDeviceToHost));
        for (int p = 0; p < 3; p++) {
            const Cmp r = cpu ? compare_part(hw, NULL, rows, C, p, ref64) : compare_part(hw, owner, rows, C, p);
            if (r.nonfinite)
                printf("info %s %s: %zu non-finite elements, the first at token %zu column %zu\n", cn, pn[p],
                       r.nonfinite, r.first_bad / C, r.first_bad % C);
            /* at T = 1 dq and dk are exactly zero (one key: dS = P (dP - D) = 0), which the kernel
             * gets to within its rounding of dP - D: there the absolute error is what is checked */
            const int zero = r.mr == 0.0;
            report(zero ? r.md < ZERO_TOL : r.nrel < TOL_NORM,
                   "%s %s vs %s: max abs err %.3e (max |ref| %.3e), norm-wise %.2e (tol %.0e%s)", cn, pn[p],
                   cpu ? "fp64 CPU attention + rope backward" : "attn_bf16_backward rope", r.md, r.mr, r.nrel,
                   zero ? ZERO_TOL : TOL_NORM, zero ? " absolute: the reference is zero" : "");
            if (cpu && own) { /* and the mma.sync kernel's fused RoPE */
                const Cmp o = compare_part(hw, owner, rows, C, p);
                report(o.nrel < TOL_NORM, "%s %s vs attn_bf16_backward rope: norm-wise %.2e (tol %.0e)", cn, pn[p],
                       o.nrel, TOL_NORM);
            }
        }
        /* against the two passes: dq and dk within the extra rounding, dv bitwise */
        for (int p = 0; p < 2; p++) {
            size_t nbad = 0, ndiff = 0, first = 0;
            double worst = 0;
            for (size_t bt = 0; bt < rows; bt++)
                for (int e = 0; e < C; e += 2) {
                    const size_t i = bt * 3 * C + (size_t)p * C + e;
                    const double f0 = bf16_widen(hw[i]), f1 = bf16_widen(hw[i + 1]);
                    const double a0 = bf16_widen(two[i]), a1 = bf16_widen(two[i + 1]);
                    const double nrm = sqrt(a0 * a0 + a1 * a1), d = fmax(fabs(f0 - a0), fabs(f1 - a1));
                    ndiff += hw[i] != two[i] || hw[i + 1] != two[i + 1];
                    if (nrm > 0 && d / nrm > worst) worst = d / nrm;
                    if (!(d <= nrm / 64 + 1e-30) && !nbad++) first = i;
                }
            if (nbad)
                printf("info %s %s: %zu pairs off the two passes by more than 2^-6 of their norm, the first at token "
                       "%zu column %zu\n",
                       cn, pn[p], nbad, first / (3 * (size_t)C), first % (3 * (size_t)C));
            report(!nbad, "%s %s vs the two passes: %zu pairs differ, at most %.2e of the pair's norm (tol 2^-6)", cn,
                   pn[p], ndiff, worst);
        }
        size_t vdiff = 0;
        for (size_t bt = 0; bt < rows; bt++)
            for (int e = 0; e < C; e++) vdiff += hw[bt * 3 * C + 2 * (size_t)C + e] != plain[bt * 3 * C + 2 * (size_t)C + e];
        report(!vdiff, "%s dv bitwise as without RoPE (%zu differ)", cn, vdiff);
        int guard_ok = 1;
        for (size_t i = 0; i < GUARD; i++) guard_ok &= hw[n3 + i] == 0xffff;
        CK(cudaMemcpy(hg, (char *)wsw + ws_bytes, GUARD, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < GUARD; i++) guard_ok &= hg[i] == 0xff;
        report(guard_ok, "%s: nothing written past dqkv and the workspace", cn);
        if (det) { /* a second run: bitwise the same */
            CK(cudaMemset(dw, 0xff, n3 * 2));
            attn_wgmma_backward(dw, dout, qkv, out, lse, wsw, B, T, NH, HD, 0, det, cs, sn, NULL);
            SYNC(cn);
            CK(cudaMemcpy(hw2, dw, n3 * 2, cudaMemcpyDeviceToHost));
            size_t ndiff = 0, first = 0;
            for (size_t i = 0; i < n3; i++)
                if (hw[i] != hw2[i] && !ndiff++) first = i;
            if (ndiff)
                printf("info %s: %zu elements differ between two runs, the first at token %zu column %zu\n", cn, ndiff,
                       first / (3 * (size_t)C), first % (3 * (size_t)C));
            report(!ndiff, "%s: two runs bitwise equal", cn);
        }
    }

    free(h_qkv), free(h_do), free(h_cs), free(h_sn), free(owner), free(plain), free(two), free(ref64), free(hw);
    free(hw2), free(hg);
    cudaFree(qkv), cudaFree(dout), cudaFree(out), cudaFree(lse), cudaFree(cs), cudaFree(sn), cudaFree(dref);
    cudaFree(dw), cudaFree(wsr), cudaFree(wsw);
}

/* ---------------------------------------------------------------------------------------------- */
/* ATTN_WGMMA_BWD_DEBUG: tiny cases against an fp64 CPU reference, mismatches printed               */

/* one_hot < 0: random dO; else dO = 0 except row one_hot, column 5 (= 1) */
static void debug_case(int T, int HD, int one_hot, int det) {
    const int B = 1, NH = 1, C = NH * HD;
    const size_t n3 = (size_t)T * 3 * C, nout = (size_t)T * C;
    uint16_t *h = (uint16_t *)malloc(n3 * 2), *hdo = (uint16_t *)malloc(nout * 2);
    for (size_t i = 0; i < n3; i++) h[i] = bf16_round((float)nrand());
    for (size_t i = 0; i < nout; i++) hdo[i] = one_hot < 0 ? bf16_round((float)nrand()) : 0;
    if (one_hot >= 0) hdo[(size_t)one_hot * C + 5] = bf16_round(1.f);
    /* reference in fp64 from the bf16 inputs */
    double *ref = (double *)calloc(n3, sizeof(double));
    cpu_attn_backward(h, hdo, B, T, NH, HD, ref);
    void *qkv, *dout, *out, *dw, *ws;
    float *lse;
    CK(cudaMalloc(&qkv, n3 * 2));
    CK(cudaMalloc(&dout, nout * 2));
    CK(cudaMalloc(&out, nout * 2));
    CK(cudaMalloc((void **)&lse, (size_t)T * 4));
    CK(cudaMalloc(&dw, n3 * 2));
    CK(cudaMalloc(&ws, attn_wgmma_bwd_workspace_bytes(B, T, NH, HD)));
    CK(cudaMemcpy(qkv, h, n3 * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dout, hdo, nout * 2, cudaMemcpyHostToDevice));
    CK(cudaMemset(dw, 0xff, n3 * 2));
    forward_for(out, lse, qkv, h, B, T, NH, HD);
    attn_wgmma_backward(dw, dout, qkv, out, lse, ws, B, T, NH, HD, 0, det, NULL, NULL, NULL);
    SYNC("debug case");
    uint16_t *hw = (uint16_t *)malloc(n3 * 2);
    CK(cudaMemcpy(hw, dw, n3 * 2, cudaMemcpyDeviceToHost));
    char what[128];
    snprintf(what, sizeof what, "debug T=%d HD=%d %s det=%d", T, HD, one_hot < 0 ? "random dO" : "one-hot dO", det);
    if (one_hot >= 0)
        printf("info %s: dO = 0 except row %d column 5; expected nonzero: dq row %d, dk rows <= %d, dv column 5 "
               "rows <= %d\n",
               what, one_hot, one_hot, one_hot, one_hot);
    static const char *pn[3] = {"dq", "dk", "dv"};
    for (int p = 0; p < 3; p++) {
        double mref = 0, md = 0;
        for (int t = 0; t < T; t++)
            for (int d = 0; d < HD; d++) mref = fmax(mref, fabs(ref[(size_t)t * 3 * C + p * C + d]));
        int shown = 0, bad = 0;
        for (int t = 0; t < T; t++)
            for (int d = 0; d < HD; d++) {
                const size_t i = (size_t)t * 3 * C + p * C + d;
                const double x = bf16_widen(hw[i]), y = ref[i], e = fabs(x - y);
                if (!(e <= 1e-2 * mref + 2e-2 * fabs(y))) {
                    if (shown++ < 12)
                        printf("info %s %s: token %d col %d: wgmma %.6f, reference %.6f\n", what, pn[p], t, d, x, y);
                    bad++;
                }
                if (!(e <= md)) md = e;
            }
        report(!bad, "%s %s: %d of %d elements off, max abs err %.3e (max |ref| %.3e)", what, pn[p], bad, T * HD, md,
               mref);
    }
    free(h), free(hdo), free(ref), free(hw);
    cudaFree(qkv), cudaFree(dout), cudaFree(out), cudaFree(lse), cudaFree(dw), cudaFree(ws);
}

/* ---------------------------------------------------------------------------------------------- */
/* timing                                                                                          */

#define REPS 7
struct Bufs {
    void *qkv, *dout, *out, *dqkv, *ws, *wsr;
    float *lse;
    int B, T, NH, HD;
};
/* which: 0 wgmma deterministic, 1 wgmma not deterministic, 2 attn_bf16_backward */
static void run_bwd(int which, const Bufs &b) {
    if (which < 2)
        attn_wgmma_backward(b.dqkv, b.dout, b.qkv, b.out, b.lse, b.ws, b.B, b.T, b.NH, b.HD, 0, which == 0, NULL, NULL,
                            NULL);
    else attn_bf16_backward(b.dqkv, b.dout, b.qkv, b.out, b.lse, b.wsr, b.B, b.T, b.NH, b.HD, 0, NULL, NULL, NULL);
}
static float time_one(int which, const Bufs &b, cudaEvent_t e0, cudaEvent_t e1) {
    float ms[REPS];
    run_bwd(which, b);
    SYNC("timing warm-up");
    for (int i = 0; i < REPS; i++) {
        CK(cudaEventRecord(e0));
        run_bwd(which, b);
        CK(cudaEventRecord(e1));
        SYNC("timing");
        CK(cudaEventElapsedTime(&ms[i], e0, e1));
    }
    qsort(ms, REPS, sizeof ms[0], cmp_float);
    return ms[REPS / 2];
}

#define MAX_PERF 8
static struct {
    int B, NH, T, HD;
    double td, ta, to; /* TFLOP/s: wgmma det, wgmma atomic, own; < 0: not run */
} perf_rows[MAX_PERF];
static int n_perf;

/* lse = v everywhere (timing at a head dim no forward here takes) */
static __global__ void fill_const(float *x, size_t n, float v) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) x[i] = v;
}

static void time_shape(int B, int NH, int T, int HD) {
    Bufs b;
    b.B = B, b.T = T, b.NH = NH, b.HD = HD;
    const int C = NH * HD;
    const size_t n3 = (size_t)B * T * 3 * C, nout = (size_t)B * T * C;
    CK(cudaMalloc(&b.qkv, n3 * 2));
    CK(cudaMalloc(&b.dout, nout * 2));
    CK(cudaMalloc(&b.out, nout * 2));
    CK(cudaMalloc(&b.dqkv, n3 * 2));
    CK(cudaMalloc((void **)&b.lse, (size_t)B * NH * T * 4));
    CK(cudaMalloc(&b.ws, attn_wgmma_bwd_workspace_bytes(B, T, NH, HD)));
    const int own = attn_bf16_supported(HD); /* else "own" is not timed */
    CK(cudaMalloc(&b.wsr, own ? attn_bf16_workspace_bytes(B, T, NH, HD) : 16));
    fill_random<<<1024, 256>>>((__nv_bfloat16 *)b.qkv, n3, 1);
    fill_random<<<1024, 256>>>((__nv_bfloat16 *)b.dout, nout, 2);
    if (own) attn_bf16_forward(b.out, b.lse, b.qkv, B, T, NH, HD, NULL);
    else { /* (HD 96, 256) no forward here: a random out, lse about the size of a real one (log T + 1) */
        fill_random<<<1024, 256>>>((__nv_bfloat16 *)b.out, nout, 3);
        fill_const<<<1024, 256>>>(b.lse, (size_t)B * NH * T, logf((float)T) + 1.f);
    }
    SYNC("timing forward");
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    const char *why = attn_wgmma_bwd_unlaunchable(HD);
    const double fl = 2.5 * 4.0 * B * NH * (double)T * T * HD / 2;
    const float md = why ? -1.f : time_one(0, b, e0, e1), ma = why ? -1.f : time_one(1, b, e0, e1);
    const float mo = own ? time_one(2, b, e0, e1) : -1.f;
    const double td = why ? -1 : fl / md * 1e-9, ta = why ? -1 : fl / ma * 1e-9, to = own ? fl / mo * 1e-9 : -1;
    if (why)
        printf("perf backward B=%d NH=%d T=%d HD=%d: wgmma skipped (%s), own %.1f TFLOP/s (%.3f ms)\n", B, NH, T, HD,
               why, to, mo);
    else if (!own)
        printf("perf backward B=%d NH=%d T=%d HD=%d: wgmma det %.1f TFLOP/s (%.3f ms), wgmma atomic %.1f TFLOP/s "
               "(%.3f ms), own: no such head dim\n",
               B, NH, T, HD, td, md, ta, ma);
    else
        printf("perf backward B=%d NH=%d T=%d HD=%d: wgmma det %.1f TFLOP/s (%.3f ms), wgmma atomic %.1f TFLOP/s "
               "(%.3f ms), own %.1f TFLOP/s (%.3f ms)\n",
               B, NH, T, HD, td, md, ta, ma, to, mo);
    fflush(stdout);
    if (n_perf < MAX_PERF) {
        perf_rows[n_perf].B = B, perf_rows[n_perf].NH = NH, perf_rows[n_perf].T = T, perf_rows[n_perf].HD = HD;
        perf_rows[n_perf].td = td, perf_rows[n_perf].ta = ta, perf_rows[n_perf].to = to;
        n_perf++;
    }
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    cudaFree(b.qkv), cudaFree(b.dout), cudaFree(b.out), cudaFree(b.dqkv), cudaFree(b.lse), cudaFree(b.ws);
    cudaFree(b.wsr);
}

int main(int argc, char **argv) {
    int perf = 0, checks = 1, only_hd = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--perf")) perf = 1;
        else if (!strcmp(argv[i], "--perf-only")) perf = 1, checks = 0;
        else if (!strcmp(argv[i], "--hd") && i + 1 < argc && atoi(argv[i + 1]) > 0) only_hd = atoi(argv[++i]);
        else {
            printf("usage: %s [--perf] [--perf-only] [--hd N]\n", argv[0]);
            return 2;
        }
    }
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("FAIL attn_wgmma_bwd: no usable GPU\n");
        printf("RESULT 0 1\n");
        return 1;
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("info attn_wgmma_bwd on %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor,
           prop.multiProcessorCount);
    if (!attn_wgmma_device_ok()) {
        printf("info attn_wgmma_bwd: not compute capability 9.0, skipped\n");
        printf("RESULT 0 0\n");
        return 0;
    }
    static const int HDs[] = {64, 96, 128, 256};
    const int nhd = (int)(sizeof HDs / sizeof HDs[0]);
    int launchable[nhd];
    for (int hi = 0; hi < nhd; hi++) {
        const char *why = attn_wgmma_bwd_unlaunchable(HDs[hi]);
        launchable[hi] = !why;
        report(!why, "attn_wgmma_bwd HD=%d launchable%s%s", HDs[hi], why ? ": " : "", why ? why : "");
    }
    const char *dbg = getenv("ATTN_WGMMA_BWD_DEBUG");
    if (dbg && *dbg && strcmp(dbg, "0")) {
        for (int hi = 0; hi < nhd; hi++) {
            if (!launchable[hi]) continue;
            debug_case(64, HDs[hi], 37, 1);
            debug_case(64, HDs[hi], -1, 1);
            debug_case(200, HDs[hi], 150, 0);
            debug_case(200, HDs[hi], -1, 0);
            debug_case(200, HDs[hi], -1, 1);
        }
    }
    if (checks) {
        report(attn_wgmma_bwd_supported(64) && attn_wgmma_bwd_supported(96) && attn_wgmma_bwd_supported(128) &&
                   attn_wgmma_bwd_supported(256) && !attn_wgmma_bwd_supported(32) && !attn_wgmma_bwd_supported(80) &&
                   !attn_wgmma_bwd_supported(192) && !attn_wgmma_bwd_supported(512),
               "attn_wgmma_bwd_supported: 64, 96, 128 and 256 yes, 32, 80, 192 and 512 no");
        static const int Ts[] = {1, 7, 64, 127, 128, 129, 300, 1000, 2048};
        for (int hi = 0; hi < nhd; hi++) {
            const int cpu_only = !attn_bf16_supported(HDs[hi]); /* HD 96, 256: the fp64 CPU reference's time */
            if (!launchable[hi]) continue; /* its shapes would only die at the launch */
            if (only_hd && HDs[hi] != only_hd) continue;
            for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
                const int T = Ts[ti];
                if (T >= 2048) test_shape(1, 2, T, HDs[hi]);
                else test_shape(2, 3, T, HDs[hi]);
            }
            /* more blocks than SMs: several waves, the deterministic order across them */
            if (!cpu_only) test_shape(4, 8, 2048, HDs[hi]);
            test_shape(2, 12, 1000, HDs[hi]); /* 8 key tiles x 24 heads: 192 blocks (HD 256: 16 x 24) */
            /* RoPE's fused backward: odd T (no tile multiples: 1, one past a query / key tile, several
             * tiles), B * NH > 1; against the fp64 CPU reference up to T = 1001, then (the reference
             * too slow) against attn_bf16_backward's RoPE, also over several waves of blocks */
            static const int RTs[] = {1, 7, 65, 129, 301, 1001};
            for (size_t ti = 0; ti < sizeof RTs / sizeof RTs[0]; ti++)
                test_rope_shape(RTs[ti] > 1000 ? 1 : 2, RTs[ti] > 1000 ? 2 : 3, RTs[ti], HDs[hi], 1);
            test_rope_shape(1, 2, 2049, HDs[hi], 0); /* (HD 96, 256: against the CPU reference too) */
            if (cpu_only) test_rope_shape(2, 12, 1001, HDs[hi], 1);
            else test_rope_shape(4, 8, 1001, HDs[hi], 0);
        }
    }
    if (perf) {
        time_shape(8, 8, 4096, 128);
        time_shape(2, 8, 10000, 128);
        time_shape(32, 8, 1024, 128);
        time_shape(8, 16, 4096, 64);
        time_shape(8, 8, 4096, 96);
        time_shape(32, 8, 1024, 96);
        time_shape(16, 4, 4096, 256);
        time_shape(8, 4, 1024, 256);
        printf("perf summary (causal backward, TFLOP/s = 2.5 x 2 B NH T^2 HD / time; cuDNN on an H100 for reference:\n"
               "perf   deterministic 385-403 at HD 128 T >= 4096, 281 at T 1024, 263 at 8x16x4096x64, 297.7 at\n"
               "perf   8x8x4096x96, 221 at 32x8x1024x96, 283.7 at 16x4x4096x256; atomics 429-474, 329 and 230 at\n"
               "perf   those HD 96 shapes, 336 at 16x4x4096x256 (torch's cuDNN backward there: 310.6)):\n");
        printf("perf   B  NH      T   HD   wgmma det   wgmma atomic    own\n");
        for (int i = 0; i < n_perf; i++)
            printf("perf %3d %3d %6d %4d   %9.1f   %12.1f   %5.1f\n", perf_rows[i].B, perf_rows[i].NH, perf_rows[i].T,
                   perf_rows[i].HD, perf_rows[i].td, perf_rows[i].ta, perf_rows[i].to);
    }
    printf("RESULT %d %d\n", n_passed, n_failed);
    return n_failed ? 1 : 0;
}
