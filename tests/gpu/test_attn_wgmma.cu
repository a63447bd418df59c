/* GPU test of the Hopper wgmma attention forward (src/ops/cuda/attn_wgmma.cu) against the tested
 * mma.sync kernel attn_bf16_forward (src/ops/cuda/attn_bf16.cu) on the same random bf16 inputs:
 * out (max |err| / max |ref| and the norm-wise relative error), lse (max abs error), every output
 * element written (outputs start as NaN), nothing written past the ends (guard regions), two runs
 * bitwise equal; HD 64 and 128 at T = 1 .. 4096, and B=4 NH=8 T=2048 and B=2 NH=12 T=1000 (more
 * work items than SMs: the persistent grid's dynamic scheduler; the former's second run comes
 * after more launches than the scheduler has counter slots, so a slot left dirty would show),
 * some of them again with MESHTRAIN_WGMMA_GRID=blocks (one block per item). Then times the
 * forwards (median of several launches; causal FLOPs 4 B NH T^2 HD / 2): wgmma persistent, wgmma
 * one block per item, attn_bf16, each shape on its own (a head dim whose wgmma kernel cannot
 * launch is a FAIL once in the checks and "skipped" in the timings; the rest still run), then a
 * summary table of their TFLOP/s side by side. Prints "ok   <check>" / "FAIL <check>" per check and
 * "RESULT <passed> <failed>" last, like tests/test.h. A device other than compute capability 9.0
 * skips everything (RESULT 0 0).
 * Usage: gpu_test_attn_wgmma [--no-perf] [--perf-only] [--perf]
 * ATTN_WGMMA_DEBUG=1: first a tiny case (B=1 NH=1 T=64 HD=64) against an fp64 CPU reference,
 * printing the first mismatching elements, once with q = k = 0 (uniform attention: exercises
 * only the P V product and V's layout) and once random. */
#include "attn_bf16.h"
#include "attn_test_util.h"
#include "attn_wgmma.h"
#include "cu_report.h"
#include "ops.h" /* bf16_round, bf16_widen */

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOL_MAX 2e-2  /* max |x - ref| / max |ref| (bf16 outputs of two bf16 kernels) */
#define TOL_NORM 1e-2 /* ||x - ref|| / ||ref|| */
#define TOL_LSE 1e-3  /* max |lse - ref| */
#define GUARD 4096    /* elements past each output's end that must stay untouched */

/* the wgmma grid (MESHTRAIN_WGMMA_GRID, read by every launch): NULL = the default (persistent) */
static const char *grid_mode;
static void set_grid(const char *mode) {
    grid_mode = mode;
    if (mode) setenv("MESHTRAIN_WGMMA_GRID", mode, 1);
    else unsetenv("MESHTRAIN_WGMMA_GRID");
}

#define SYNC()                                                                                    \
    do {                                                                                          \
        CK(cudaGetLastError());                                                                   \
        CK(cudaDeviceSynchronize());                                                              \
    } while (0)

/* outputs with guard regions: out [nout + GUARD] bf16, lse [nlse + GUARD] fp32, all bytes 0xff (NaN) */
struct Outs {
    void *out;
    float *lse;
};
static Outs outs_alloc(size_t nout, size_t nlse) {
    Outs o;
    CK(cudaMalloc(&o.out, (nout + GUARD) * 2));
    CK(cudaMalloc((void **)&o.lse, (nlse + GUARD) * 4));
    return o;
}
static void outs_poison(Outs o, size_t nout, size_t nlse) {
    CK(cudaMemset(o.out, 0xff, (nout + GUARD) * 2));
    CK(cudaMemset(o.lse, 0xff, (nlse + GUARD) * 4));
}
static int guards_intact(const uint16_t *out, const float *lse, size_t nout, size_t nlse) {
    for (size_t i = 0; i < GUARD; i++) {
        uint32_t w;
        memcpy(&w, &lse[nlse + i], 4);
        if (out[nout + i] != 0xffff || w != 0xffffffffu) return 0;
    }
    return 1;
}

/* ---------------------------------------------------------------------------------------------- */
/* against attn_bf16_forward                                                                       */

/* extra: launches on the same inputs between the two runs that are compared bitwise */
static void test_shape(int B, int NH, int T, int HD, int extra = 0) {
    const int C = NH * HD;
    const size_t nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C, nlse = (size_t)B * NH * T;
    char name[128];
    snprintf(name, sizeof name, "attn_wgmma B=%d NH=%d T=%d HD=%d%s%s", B, NH, T, HD, grid_mode ? " grid=" : "",
             grid_mode ? grid_mode : "");

    uint16_t *h_qkv = (uint16_t *)malloc(nqkv * 2);
    for (size_t i = 0; i < nqkv; i++) h_qkv[i] = bf16_round((float)nrand());
    void *qkv;
    CK(cudaMalloc(&qkv, nqkv * 2));
    CK(cudaMemcpy(qkv, h_qkv, nqkv * 2, cudaMemcpyHostToDevice));
    Outs w = outs_alloc(nout, nlse), r = outs_alloc(nout, nlse);
    outs_poison(w, nout, nlse);
    outs_poison(r, nout, nlse);

    attn_bf16_forward(r.out, r.lse, qkv, B, T, NH, HD, NULL);
    SYNC();
    attn_wgmma_forward(w.out, w.lse, qkv, B, T, NH, HD, NULL);
    SYNC();

    uint16_t *ho = (uint16_t *)malloc((nout + GUARD) * 2), *ro = (uint16_t *)malloc((nout + GUARD) * 2);
    float *hl = (float *)malloc((nlse + GUARD) * 4), *rl = (float *)malloc((nlse + GUARD) * 4);
    CK(cudaMemcpy(ho, w.out, (nout + GUARD) * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hl, w.lse, (nlse + GUARD) * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(ro, r.out, nout * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(rl, r.lse, nlse * 4, cudaMemcpyDeviceToHost));

    double md = 0, mr = 0, sd = 0, sr = 0;
    size_t nonfinite = 0, first_bad = (size_t)-1;
    for (size_t i = 0; i < nout; i++) {
        const double x = bf16_widen(ho[i]), y = bf16_widen(ro[i]);
        if (!isfinite(x)) {
            if (!nonfinite++) first_bad = i;
            continue;
        }
        const double d = fabs(x - y);
        if (d > md) md = d;
        if (fabs(y) > mr) mr = fabs(y);
        sd += d * d, sr += y * y;
    }
    const double rel = nonfinite ? INFINITY : md / fmax(mr, 1e-3), nrel = nonfinite ? INFINITY : sqrt(sd / fmax(sr, 1e-30));
    if (nonfinite)
        printf("info %s: %zu non-finite out elements, the first at token %zu column %zu\n", name, nonfinite,
               first_bad / C, first_bad % C);
    report(rel < TOL_MAX && nrel < TOL_NORM,
           "%s out: max abs err %.3e, max/max|ref| %.2e (tol %.0e), norm-wise %.2e (tol %.0e)", name, md, rel,
           TOL_MAX, nrel, TOL_NORM);
    double el = 0;
    size_t worst = 0;
    for (size_t i = 0; i < nlse; i++) {
        const double d = isfinite(hl[i]) ? fabs((double)hl[i] - rl[i]) : INFINITY;
        if (d > el) el = d, worst = i;
    }
    report(el < TOL_LSE, "%s lse: max abs err %.2e (tol %.0e)%s", name, el, TOL_LSE,
           el < TOL_LSE ? "" : " (see info)");
    if (!(el < TOL_LSE))
        printf("info %s: worst lse at bh %zu t %zu: %.6f vs %.6f\n", name, worst / T, worst % T, hl[worst],
               rl[worst]);
    report(guards_intact(ho, hl, nout, nlse), "%s: nothing written past out and lse", name);

    /* a second run over NaN (after `extra` more): bitwise the same */
    uint16_t *ho2 = (uint16_t *)malloc(nout * 2);
    float *hl2 = (float *)malloc(nlse * 4);
    for (int i = 0; i < extra; i++) attn_wgmma_forward(w.out, w.lse, qkv, B, T, NH, HD, NULL);
    SYNC();
    outs_poison(w, nout, nlse);
    attn_wgmma_forward(w.out, w.lse, qkv, B, T, NH, HD, NULL);
    SYNC();
    CK(cudaMemcpy(ho2, w.out, nout * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hl2, w.lse, nlse * 4, cudaMemcpyDeviceToHost));
    report(!memcmp(ho, ho2, nout * 2) && !memcmp(hl, hl2, nlse * 4), "%s: two runs bitwise equal%s", name,
           extra ? " (launches between)" : "");

    free(h_qkv), free(ho), free(ro), free(hl), free(rl), free(ho2), free(hl2);
    cudaFree(qkv), cudaFree(w.out), cudaFree(w.lse), cudaFree(r.out), cudaFree(r.lse);
}

/* ---------------------------------------------------------------------------------------------- */
/* ATTN_WGMMA_DEBUG: a tiny case against an fp64 CPU reference, mismatches printed                  */

static void debug_case(int zero_qk) {
    const int B = 1, NH = 1, T = 64, HD = 64, C = NH * HD;
    const size_t nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C, nlse = (size_t)B * NH * T;
    uint16_t *h = (uint16_t *)malloc(nqkv * 2);
    for (size_t i = 0; i < nqkv; i++) {
        const int part = (int)(i % (3 * C)) / C;
        h[i] = bf16_round(zero_qk && part < 2 ? 0.f : (float)nrand());
    }
    /* reference: out [T][HD], lse [T] */
    double *ref = (double *)calloc(nout, sizeof(double)), *rlse = (double *)calloc(nlse, sizeof(double));
    double *sc = (double *)malloc(T * sizeof(double));
    for (int i = 0; i < T; i++) {
        double mx = -1e300, sum = 0;
        for (int j = 0; j <= i; j++) {
            double s = 0;
            for (int d = 0; d < HD; d++) s += (double)bf16_widen(h[i * 3 * C + d]) * bf16_widen(h[j * 3 * C + C + d]);
            sc[j] = s / sqrt((double)HD);
            mx = fmax(mx, sc[j]);
        }
        for (int j = 0; j <= i; j++) sum += exp(sc[j] - mx);
        rlse[i] = mx + log(sum);
        for (int d = 0; d < HD; d++) {
            double o = 0;
            for (int j = 0; j <= i; j++) o += exp(sc[j] - mx) / sum * bf16_widen(h[j * 3 * C + 2 * C + d]);
            ref[i * C + d] = o;
        }
    }
    void *qkv;
    CK(cudaMalloc(&qkv, nqkv * 2));
    CK(cudaMemcpy(qkv, h, nqkv * 2, cudaMemcpyHostToDevice));
    Outs w = outs_alloc(nout, nlse);
    outs_poison(w, nout, nlse);
    attn_wgmma_forward(w.out, w.lse, qkv, B, T, NH, HD, NULL);
    SYNC();
    uint16_t *ho = (uint16_t *)malloc(nout * 2);
    float *hl = (float *)malloc(nlse * 4);
    CK(cudaMemcpy(ho, w.out, nout * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hl, w.lse, nlse * 4, cudaMemcpyDeviceToHost));
    const char *what = zero_qk ? "debug q=k=0 (uniform attention: P V only)" : "debug random";
    int shown = 0, bad = 0;
    double md = 0;
    for (size_t i = 0; i < nout; i++) {
        const double x = bf16_widen(ho[i]), d = fabs(x - ref[i]);
        if (!(d <= 2e-2 * (1 + fabs(ref[i])))) {
            if (shown++ < 16)
                printf("info %s: out token %zu col %zu: wgmma %.5f, reference %.5f\n", what, i / C, i % C, x, ref[i]);
            bad++;
        }
        if (!(d <= md)) md = d;
    }
    int badl = 0;
    for (size_t i = 0; i < nlse; i++)
        if (!(fabs(hl[i] - rlse[i]) <= 1e-3)) {
            if (badl++ < 8) printf("info %s: lse token %zu: wgmma %.6f, reference %.6f\n", what, i, hl[i], rlse[i]);
        }
    report(!bad, "%s out: %d of %zu elements off, max abs err %.3e", what, bad, nout, md);
    report(!badl, "%s lse: %d of %zu off", what, badl, nlse);
    free(h), free(ref), free(rlse), free(sc), free(ho), free(hl);
    cudaFree(qkv), cudaFree(w.out), cudaFree(w.lse);
}

/* ---------------------------------------------------------------------------------------------- */
/* timing                                                                                          */

#define REPS 9
/* median ms of REPS launches of one forward (which = 0: wgmma, 1: attn_bf16) */
static float time_one(int which, void *out, float *lse, const void *qkv, int B, int T, int NH, int HD,
                      cudaEvent_t e0, cudaEvent_t e1) {
    float ms[REPS];
    for (int i = 0; i < 2; i++) { /* warm-up */
        if (which == 0) attn_wgmma_forward(out, lse, qkv, B, T, NH, HD, NULL);
        else attn_bf16_forward(out, lse, qkv, B, T, NH, HD, NULL);
    }
    SYNC();
    for (int i = 0; i < REPS; i++) {
        CK(cudaEventRecord(e0));
        if (which == 0) attn_wgmma_forward(out, lse, qkv, B, T, NH, HD, NULL);
        else attn_bf16_forward(out, lse, qkv, B, T, NH, HD, NULL);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        CK(cudaEventElapsedTime(&ms[i], e0, e1));
    }
    SYNC();
    qsort(ms, REPS, sizeof ms[0], cmp_float);
    return ms[REPS / 2];
}

/* one perf line per shape, wgmma and own side by side; a shape whose wgmma kernel cannot launch
 * times own alone and says why (the other shapes still run). Kept for the summary at the end. */
#define MAX_PERF 16
static struct {
    int B, NH, T, HD;
    float mw, mb, mo; /* ms (wgmma persistent, wgmma one block per item, own); mw < 0: wgmma not run */
    double tw, tb, to; /* TFLOP/s */
} perf_rows[MAX_PERF];
static int n_perf;

static void time_shape(int B, int NH, int T, int HD) {
    const int C = NH * HD;
    const char *why = attn_wgmma_unlaunchable(HD);
    const size_t nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C;
    void *qkv, *out;
    float *lse;
    CK(cudaMalloc(&qkv, nqkv * 2));
    CK(cudaMalloc(&out, nout * 2));
    CK(cudaMalloc((void **)&lse, (size_t)B * NH * T * 4));
    fill_random<<<1024, 256>>>((__nv_bfloat16 *)qkv, nqkv, 1);
    SYNC();
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    const float mw = why ? -1.f : time_one(0, out, lse, qkv, B, T, NH, HD, e0, e1);
    set_grid("blocks");
    const float mb = why ? -1.f : time_one(0, out, lse, qkv, B, T, NH, HD, e0, e1);
    set_grid(NULL);
    const float mo = time_one(1, out, lse, qkv, B, T, NH, HD, e0, e1);
    const double fl = 4.0 * B * NH * (double)T * T * HD / 2;
    if (why)
        printf("perf forward B=%d NH=%d T=%d HD=%d: wgmma skipped (%s), own (attn_bf16) %.4f ms %.1f TFLOP/s\n", B,
               NH, T, HD, why, mo, fl / mo * 1e-9);
    else
        printf("perf forward B=%d NH=%d T=%d HD=%d: wgmma %.1f TFLOP/s (%.4f ms), wgmma grid=blocks %.1f TFLOP/s "
               "(%.4f ms), own (attn_bf16) %.1f TFLOP/s (%.4f ms), speed-up %.2fx\n",
               B, NH, T, HD, fl / mw * 1e-9, mw, fl / mb * 1e-9, mb, fl / mo * 1e-9, mo, mo / mw);
    fflush(stdout);
    if (n_perf < MAX_PERF) {
        perf_rows[n_perf].B = B, perf_rows[n_perf].NH = NH, perf_rows[n_perf].T = T, perf_rows[n_perf].HD = HD;
        perf_rows[n_perf].mw = mw, perf_rows[n_perf].mb = mb, perf_rows[n_perf].mo = mo;
        perf_rows[n_perf].tw = why ? 0 : fl / mw * 1e-9, perf_rows[n_perf].tb = why ? 0 : fl / mb * 1e-9;
        perf_rows[n_perf].to = fl / mo * 1e-9;
        n_perf++;
    }
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    cudaFree(qkv), cudaFree(out), cudaFree(lse);
}

int main(int argc, char **argv) {
    int perf = 1, checks = 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--no-perf")) perf = 0;
        else if (!strcmp(argv[i], "--perf-only")) checks = 0;
        else if (!strcmp(argv[i], "--perf")) perf = 1;
        else {
            printf("usage: %s [--no-perf] [--perf-only] [--perf]\n", argv[0]);
            return 2;
        }
    }
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("FAIL attn_wgmma: no usable GPU\n");
        printf("RESULT 0 1\n");
        return 1;
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("info attn_wgmma on %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
    if (!attn_wgmma_device_ok()) {
        printf("info attn_wgmma: not compute capability 9.0, skipped\n");
        printf("RESULT 0 0\n");
        return 0;
    }
    const char *dbg = getenv("ATTN_WGMMA_DEBUG");
    if (dbg && *dbg && strcmp(dbg, "0")) {
        debug_case(1);
        debug_case(0);
    }
    if (checks) {
        report(attn_wgmma_supported(64) && attn_wgmma_supported(128) && !attn_wgmma_supported(32) &&
                   !attn_wgmma_supported(96) && !attn_wgmma_supported(256),
               "attn_wgmma_supported: 64 and 128 yes, 32, 96 and 256 no");
        static const int Ts[] = {1, 7, 64, 127, 128, 129, 300, 1000, 4096};
        static const int HDs[] = {64, 128};
        for (int hi = 0; hi < 2; hi++) {
            const char *why = attn_wgmma_unlaunchable(HDs[hi]);
            report(!why, "attn_wgmma HD=%d launchable%s%s", HDs[hi], why ? ": " : "", why ? why : "");
            if (why) continue; /* its shapes would only die at the launch */
            for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
                const int T = Ts[ti];
                if (T >= 4096) test_shape(1, 2, T, HDs[hi]);
                else test_shape(2, 3, T, HDs[hi]);
            }
            /* more work items (query tiles x heads) than SMs: the persistent grid's blocks take
             * several, of different heads and lengths, from the dynamic scheduler; 70 launches
             * before the second run (more than its 64 counter slots: each must be left reset) */
            test_shape(4, 8, 2048, HDs[hi], 70);
            test_shape(2, 12, 1000, HDs[hi]);
            /* one block per item (several waves of blocks) */
            set_grid("blocks");
            test_shape(4, 8, 2048, HDs[hi]);
            test_shape(2, 12, 1000, HDs[hi]);
            test_shape(1, 2, 4096, HDs[hi]);
            set_grid(NULL);
        }
    }
    if (perf) {
        time_shape(8, 8, 4096, 128);
        time_shape(2, 8, 10000, 128);
        time_shape(32, 8, 1024, 128);
        time_shape(16, 16, 1024, 128);
        time_shape(8, 8, 4096, 64);
        time_shape(8, 16, 4096, 64);
        printf("perf summary (causal forward, TFLOP/s = 2 B NH T^2 HD / time):\n");
        printf("perf   B  NH      T   HD   wgmma TFLOP/s   wgmma grid=blocks   own TFLOP/s   speed-up\n");
        for (int i = 0; i < n_perf; i++) {
            if (perf_rows[i].mw < 0)
                printf("perf %3d %3d %6d %4d   %13s   %17s   %11.1f   %8s\n", perf_rows[i].B, perf_rows[i].NH,
                       perf_rows[i].T, perf_rows[i].HD, "skipped", "skipped", perf_rows[i].to, "-");
            else
                printf("perf %3d %3d %6d %4d   %13.1f   %17.1f   %11.1f   %7.2fx\n", perf_rows[i].B, perf_rows[i].NH,
                       perf_rows[i].T, perf_rows[i].HD, perf_rows[i].tw, perf_rows[i].tb, perf_rows[i].to,
                       perf_rows[i].mo / perf_rows[i].mw);
        }
    }
    printf("RESULT %d %d\n", n_passed, n_failed);
    return n_failed ? 1 : 0;
}
