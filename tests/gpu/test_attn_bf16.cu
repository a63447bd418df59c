/* GPU test of the bf16 flash attention (src/ops/cuda/attn_bf16.cu) against a naive fp32/fp64 reference
 * computed on the GPU from the same bf16 inputs: out, lse, dq, dk, dv at small odd shapes and a
 * training-like one; forward outputs fully overwritten (they start as NaN); the backward's +=
 * into dqkv; bitwise determinism of two runs. Then times forward and backward at the training
 * shapes (informational: timings never fail). Prints "ok   <check>" / "FAIL <check>" per check and
 * "RESULT <passed> <failed>" last, like tests/test.h.
 * Usage: gpu_test_attn_bf16 [--no-perf] [--small] [--perf-only] [--profile]. */
#include "attn_bf16.h"
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

#define TOL_BF16 2e-2 /* max |x - ref| / max |ref| for bf16 outputs */
#define TOL_LSE 1e-3  /* max |lse - ref| */

/* ---------------------------------------------------------------------------------------------- */
/* host helpers                                                                                    */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static double urand(void) { /* xorshift64*, uniform in (0, 1) */
    rng_state ^= rng_state >> 12, rng_state ^= rng_state << 25, rng_state ^= rng_state >> 27;
    return ((double)((rng_state * 2685821657736338717ull) >> 11) + 0.5) / 9007199254740992.0;
}
static double nrand(void) { return sqrt(-2.0 * log(urand())) * cos(6.283185307179586 * urand()); }

/* ---------------------------------------------------------------------------------------------- */
/* naive reference kernels (fp64 accumulation, from the bf16 inputs)                              */

static __device__ double bfd(const __nv_bfloat16 x) { return (double)__bfloat162float(x); }

/* one block per (query i, head bh): scores -> causal softmax -> P row [T] and out [HD], lse */
__global__ void ref_forward(float *out, float *lse, float *P, const __nv_bfloat16 *qkv, int T, int NH, int HD) {
    extern __shared__ double sc[];
    const int i = blockIdx.x, bh = blockIdx.y, b = bh / NH, h = bh % NH, C = NH * HD;
    const double scale = 1.0 / sqrt((double)HD);
    const __nv_bfloat16 *q = qkv + ((size_t)b * T + i) * 3 * C + h * HD;
    for (int j = threadIdx.x; j <= i; j += blockDim.x) {
        const __nv_bfloat16 *k = qkv + ((size_t)b * T + j) * 3 * C + C + h * HD;
        double s = 0;
        for (int d = 0; d < HD; d++) s += bfd(q[d]) * bfd(k[d]);
        sc[j] = s * scale;
    }
    __syncthreads();
    __shared__ double mx, sum;
    if (threadIdx.x == 0) {
        mx = -1e300, sum = 0;
        for (int j = 0; j <= i; j++) mx = fmax(mx, sc[j]);
        for (int j = 0; j <= i; j++) sum += exp(sc[j] - mx);
        lse[(size_t)bh * T + i] = (float)(mx + log(sum));
    }
    __syncthreads();
    for (int j = threadIdx.x; j < T; j += blockDim.x)
        P[((size_t)bh * T + i) * T + j] = j <= i ? (float)(exp(sc[j] - mx) / sum) : 0.f;
    __syncthreads();
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        double o = 0;
        for (int j = 0; j <= i; j++)
            o += (exp(sc[j] - mx) / sum) * bfd(qkv[((size_t)b * T + j) * 3 * C + 2 * C + h * HD + d]);
        out[((size_t)b * T + i) * C + h * HD + d] = (float)o;
    }
}

/* dS[bh, i, j] = P (dP - D) with dP = dO_i . v_j, D_i = sum_j P_ij dP_ij: one thread per (i, bh) */
__global__ void ref_dS(float *dS, const float *P, const __nv_bfloat16 *qkv, const __nv_bfloat16 *dout, int B, int T,
                       int NH, int HD) {
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)B * NH * T) return;
    const int i = (int)(idx % T), bh = (int)(idx / T), b = bh / NH, h = bh % NH, C = NH * HD;
    const __nv_bfloat16 *dO = dout + ((size_t)b * T + i) * C + h * HD;
    const float *Pi = P + ((size_t)bh * T + i) * T;
    float *dSi = dS + ((size_t)bh * T + i) * T;
    double D = 0;
    for (int j = 0; j <= i; j++) {
        const __nv_bfloat16 *v = qkv + ((size_t)b * T + j) * 3 * C + 2 * C + h * HD;
        double dp = 0;
        for (int d = 0; d < HD; d++) dp += bfd(dO[d]) * bfd(v[d]);
        dSi[j] = (float)dp;
        D += Pi[j] * dp;
    }
    for (int j = 0; j < T; j++) dSi[j] = j <= i ? (float)(Pi[j] * (dSi[j] - D)) : 0.f;
}

/* dqkv_ref [B, T, 3C] fp32: one thread per (b, row x, head, d) */
__global__ void ref_grads(float *dqkv, const float *P, const float *dS, const __nv_bfloat16 *qkv,
                          const __nv_bfloat16 *dout, int B, int T, int NH, int HD) {
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)B * T * NH * HD) return;
    const int d = (int)(idx % HD), h = (int)(idx / HD % NH), x = (int)(idx / ((size_t)HD * NH) % T);
    const int b = (int)(idx / ((size_t)HD * NH * T)), bh = b * NH + h, C = NH * HD;
    const double scale = 1.0 / sqrt((double)HD);
    const __nv_bfloat16 *base = qkv + (size_t)b * T * 3 * C + h * HD + d;
    double dq = 0, dk = 0, dv = 0;
    for (int j = 0; j <= x; j++) dq += dS[((size_t)bh * T + x) * T + j] * bfd(base[(size_t)j * 3 * C + C]);
    for (int i = x; i < T; i++) {
        dk += dS[((size_t)bh * T + i) * T + x] * bfd(base[(size_t)i * 3 * C]);
        dv += P[((size_t)bh * T + i) * T + x] * bfd(dout[((size_t)b * T + i) * C + h * HD + d]);
    }
    float *r = dqkv + ((size_t)b * T + x) * 3 * C + h * HD + d;
    r[0] = (float)(dq * scale), r[C] = (float)(dk * scale), r[2 * C] = (float)dv;
}

/* ---------------------------------------------------------------------------------------------- */
/* comparisons                                                                                     */

/* max |a - ref| / max |ref| over rows of n elements taken every `stride` from `off`; non-finite -> inf */
static double rel_err_bf16(const uint16_t *a, const float *ref, size_t rows, int n, size_t stride, size_t off,
                           double *refmax) {
    double md = 0, mr = 0;
    *refmax = 0;
    for (size_t r = 0; r < rows; r++)
        for (int k = 0; k < n; k++) {
            const double x = bf16_widen(a[r * stride + off + k]), y = ref[r * stride + off + k];
            if (!isfinite(x)) md = INFINITY;
            md = fmax(md, fabs(x - y)), mr = fmax(mr, fabs(y));
        }
    *refmax = mr;
    return md / fmax(mr, 1e-3); /* the floor: at T = 1, dq and dk are 0 up to rounding noise */
}

static void test_shape(int B, int NH, int T, int HD) {
    const int C = NH * HD;
    const size_t nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C, nlse = (size_t)B * NH * T;
    const size_t nP = (size_t)B * NH * T * T;
    char name[96];
    snprintf(name, sizeof name, "attn_bf16 B=%d NH=%d T=%d HD=%d", B, NH, T, HD);

    uint16_t *h_qkv = (uint16_t *)malloc(nqkv * 2), *h_dout = (uint16_t *)malloc(nout * 2);
    for (size_t i = 0; i < nqkv; i++) h_qkv[i] = bf16_round((float)nrand());
    for (size_t i = 0; i < nout; i++) h_dout[i] = bf16_round((float)nrand());

    void *qkv, *dout, *out, *dqkv, *ws;
    float *lse, *r_out, *r_lse, *P, *dS, *r_dqkv;
    const size_t wsb = attn_bf16_workspace_bytes(B, T, NH, HD);
    CK(cudaMalloc(&qkv, nqkv * 2));
    CK(cudaMalloc(&dout, nout * 2));
    CK(cudaMalloc(&out, nout * 2));
    CK(cudaMalloc(&dqkv, nqkv * 2));
    CK(cudaMalloc(&ws, wsb ? wsb : 1));
    CK(cudaMalloc(&lse, nlse * 4));
    CK(cudaMalloc(&r_out, nout * 4));
    CK(cudaMalloc(&r_lse, nlse * 4));
    CK(cudaMalloc(&P, nP * 4));
    CK(cudaMalloc(&dS, nP * 4));
    CK(cudaMalloc(&r_dqkv, nqkv * 4));
    CK(cudaMemcpy(qkv, h_qkv, nqkv * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dout, h_dout, nout * 2, cudaMemcpyHostToDevice));

    /* reference */
    ref_forward<<<dim3(T, B * NH), 128, T * sizeof(double)>>>(r_out, r_lse, P, (const __nv_bfloat16 *)qkv, T, NH, HD);
    CK(cudaGetLastError());
    ref_dS<<<(unsigned)((B * NH * T + 127) / 128), 128>>>(dS, P, (const __nv_bfloat16 *)qkv,
                                                          (const __nv_bfloat16 *)dout, B, T, NH, HD);
    CK(cudaGetLastError());
    ref_grads<<<(unsigned)((nout + 127) / 128), 128>>>(r_dqkv, P, dS, (const __nv_bfloat16 *)qkv,
                                                       (const __nv_bfloat16 *)dout, B, T, NH, HD);
    CK(cudaGetLastError());
    float *hr_out = (float *)malloc(nout * 4), *hr_lse = (float *)malloc(nlse * 4);
    float *hr_dqkv = (float *)malloc(nqkv * 4);
    CK(cudaMemcpy(hr_out, r_out, nout * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hr_lse, r_lse, nlse * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hr_dqkv, r_dqkv, nqkv * 4, cudaMemcpyDeviceToHost));

    /* forward, outputs starting as NaN */
    uint16_t *h_out = (uint16_t *)malloc(nout * 2), *h_out2 = (uint16_t *)malloc(nout * 2);
    float *h_lse = (float *)malloc(nlse * 4), *h_lse2 = (float *)malloc(nlse * 4);
    CK(cudaMemset(out, 0xff, nout * 2));
    CK(cudaMemset(lse, 0xff, nlse * 4));
    attn_bf16_forward(out, lse, qkv, B, T, NH, HD, NULL);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(h_out, out, nout * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h_lse, lse, nlse * 4, cudaMemcpyDeviceToHost));
    double mr, e = rel_err_bf16(h_out, hr_out, (size_t)B * T, C, C, 0, &mr);
    report(e < TOL_BF16, "%s forward out: rel err %.2e (tol %.0e, max |ref| %.3g)", name, e, TOL_BF16, mr);
    double el = 0;
    for (size_t i = 0; i < nlse; i++) el = isfinite(h_lse[i]) ? fmax(el, fabs(h_lse[i] - hr_lse[i])) : INFINITY;
    report(el < TOL_LSE, "%s forward lse: max abs err %.2e (tol %.0e)", name, el, TOL_LSE);

    CK(cudaMemset(out, 0xff, nout * 2));
    attn_bf16_forward(out, lse, qkv, B, T, NH, HD, NULL);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(h_out2, out, nout * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h_lse2, lse, nlse * 4, cudaMemcpyDeviceToHost));
    report(!memcmp(h_out, h_out2, nout * 2) && !memcmp(h_lse, h_lse2, nlse * 4),
           "%s forward: two runs bitwise equal", name);

    /* backward into zeros: the gradients themselves */
    uint16_t *h_d = (uint16_t *)malloc(nqkv * 2), *h_d2 = (uint16_t *)malloc(nqkv * 2);
    uint16_t *h_pre = (uint16_t *)malloc(nqkv * 2);
    CK(cudaMemset(dqkv, 0, nqkv * 2));
    CK(cudaMemset(ws, 0xff, wsb));
    attn_bf16_backward(dqkv, dout, qkv, out, lse, ws, B, T, NH, HD, 1, NULL, NULL, NULL);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(h_d, dqkv, nqkv * 2, cudaMemcpyDeviceToHost));
    static const char *part[3] = {"dq", "dk", "dv"};
    for (int p = 0; p < 3; p++) {
        e = rel_err_bf16(h_d, hr_dqkv, (size_t)B * T, C, 3 * (size_t)C, (size_t)p * C, &mr);
        report(e < TOL_BF16, "%s backward %s: rel err %.2e (tol %.0e, max |ref| %.3g)", name, part[p], e,
               TOL_BF16, mr);
    }
    CK(cudaMemset(dqkv, 0, nqkv * 2));
    attn_bf16_backward(dqkv, dout, qkv, out, lse, ws, B, T, NH, HD, 1, NULL, NULL, NULL);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(h_d2, dqkv, nqkv * 2, cudaMemcpyDeviceToHost));
    report(!memcmp(h_d, h_d2, nqkv * 2), "%s backward: two runs bitwise equal", name);
    /* acc = 0 writes every element: over NaN, the same bits as accumulating into zeros */
    CK(cudaMemset(dqkv, 0xff, nqkv * 2));
    attn_bf16_backward(dqkv, dout, qkv, out, lse, ws, B, T, NH, HD, 0, NULL, NULL, NULL);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(h_d2, dqkv, nqkv * 2, cudaMemcpyDeviceToHost));
    report(!memcmp(h_d, h_d2, nqkv * 2), "%s backward written (acc=0) over NaN: bitwise the result into zeros", name);

    /* backward into a known prefill: result = bf16(prefill + gradient), within bf16 rounding of the sum */
    for (size_t i = 0; i < nqkv; i++) h_pre[i] = bf16_round((float)((int)(i % 7) - 3) * 0.25f);
    CK(cudaMemcpy(dqkv, h_pre, nqkv * 2, cudaMemcpyHostToDevice));
    attn_bf16_backward(dqkv, dout, qkv, out, lse, ws, B, T, NH, HD, 1, NULL, NULL, NULL);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(h_d2, dqkv, nqkv * 2, cudaMemcpyDeviceToHost));
    size_t bad = 0;
    double worst = 0;
    for (size_t i = 0; i < nqkv; i++) {
        const double pre = bf16_widen(h_pre[i]), g = bf16_widen(h_d[i]), r = bf16_widen(h_d2[i]);
        const double tol = (fabs(pre + g) + fabs(g)) * (1.01 / 256) + 1e-30; /* two roundings, half an ulp each */
        const double d = fabs(r - (pre + g));
        if (!(d <= tol)) bad++;
        worst = fmax(worst, d / tol);
    }
    report(bad == 0, "%s backward accumulates (+=) into dqkv: %zu of %zu off (worst %.2f of tolerance)", name, bad,
           nqkv, worst);

    free(h_qkv), free(h_dout), free(hr_out), free(hr_lse), free(hr_dqkv), free(h_out), free(h_out2);
    free(h_lse), free(h_lse2), free(h_d), free(h_d2), free(h_pre);
    cudaFree(qkv), cudaFree(dout), cudaFree(out), cudaFree(dqkv), cudaFree(ws), cudaFree(lse), cudaFree(r_out);
    cudaFree(r_lse), cudaFree(P), cudaFree(dS), cudaFree(r_dqkv);
}

/* ---------------------------------------------------------------------------------------------- */
/* timing                                                                                          */

__global__ void fill_random(__nv_bfloat16 *x, size_t n, uint32_t seed) { /* roughly N(0, 1) */
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed;
        h ^= h >> 15, h *= 2246822519u, h ^= h >> 13, h *= 3266489917u, h ^= h >> 16;
        x[i] = __float2bfloat16(((float)(h & 0xffffff) / 16777216.f - 0.5f) * 3.4641f);
    }
}

/* reps = 0: one forward and one backward, no timing (under a profiler) */
static void time_shape(int B, int NH, int T, int HD, int reps) {
    const int C = NH * HD;
    const size_t nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C;
    void *qkv, *dout, *out, *dqkv, *ws;
    float *lse;
    CK(cudaMalloc(&qkv, nqkv * 2));
    CK(cudaMalloc(&dout, nout * 2));
    CK(cudaMalloc(&out, nout * 2));
    CK(cudaMalloc(&dqkv, nqkv * 2));
    CK(cudaMalloc(&ws, attn_bf16_workspace_bytes(B, T, NH, HD)));
    CK(cudaMalloc(&lse, (size_t)B * NH * T * 4));
    fill_random<<<1024, 256>>>((__nv_bfloat16 *)qkv, nqkv, 1);
    fill_random<<<1024, 256>>>((__nv_bfloat16 *)dout, nout, 2);
    CK(cudaMemset(dqkv, 0, nqkv * 2));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    float ms_f, ms_b;
    if (reps == 0) {
        attn_bf16_forward(out, lse, qkv, B, T, NH, HD, NULL);
        attn_bf16_backward(dqkv, dout, qkv, out, lse, ws, B, T, NH, HD, 1, NULL, NULL, NULL);
        CK(cudaDeviceSynchronize());
        return;
    }
    for (int i = 0; i < 3; i++) attn_bf16_forward(out, lse, qkv, B, T, NH, HD, NULL);
    CK(cudaEventRecord(e0));
    for (int i = 0; i < reps; i++) attn_bf16_forward(out, lse, qkv, B, T, NH, HD, NULL);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    CK(cudaEventElapsedTime(&ms_f, e0, e1));
    for (int i = 0; i < 3; i++) attn_bf16_backward(dqkv, dout, qkv, out, lse, ws, B, T, NH, HD, 1, NULL, NULL, NULL);
    CK(cudaEventRecord(e0));
    for (int i = 0; i < reps; i++) attn_bf16_backward(dqkv, dout, qkv, out, lse, ws, B, T, NH, HD, 1, NULL, NULL, NULL);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    CK(cudaEventElapsedTime(&ms_b, e0, e1));
    CK(cudaGetLastError());
    ms_f /= reps, ms_b /= reps;
    /* causal FLOPs: forward 2 matmuls of B*NH*T*T*HD/2 multiply-adds; backward 2.5x that */
    const double fl = 4.0 * B * NH * (double)T * T * HD / 2, by_f = (nqkv + 2.0 * nout) * 2;
    printf("perf attn_bf16 B=%d NH=%d T=%d HD=%d forward:  %.4f ms, %.1f TFLOP/s, %.0f GB/s (qkv + out)\n", B,
           NH, T, HD, ms_f, fl / ms_f * 1e-9, by_f / ms_f * 1e-6);
    printf("perf attn_bf16 B=%d NH=%d T=%d HD=%d backward: %.4f ms, %.1f TFLOP/s (2.5x forward FLOPs)\n", B, NH, T, HD,
           ms_b, 2.5 * fl / ms_b * 1e-9);
    fflush(stdout);
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    cudaFree(qkv), cudaFree(dout), cudaFree(out), cudaFree(dqkv), cudaFree(ws), cudaFree(lse);
}

int main(int argc, char **argv) {
    /* --no-perf: skip the timings; --small: only the small shapes (for sanitizers); --perf-only: only
     * the timings; --profile: one forward and one backward at B=128 NH=8 T=256 HD=128 (for profilers) */
    int perf = 1, small = 0, checks = 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--no-perf")) perf = 0;
        else if (!strcmp(argv[i], "--small")) small = 1, perf = 0;
        else if (!strcmp(argv[i], "--perf-only")) checks = 0;
        else if (!strcmp(argv[i], "--profile")) checks = 0, perf = 2;
    }
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("FAIL attn_bf16: no usable GPU\n");
        printf("RESULT 0 1\n");
        return 1;
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("info attn_bf16 on %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);

    if (perf == 2) {
        time_shape(128, 8, 256, 128, 0);
        return 0;
    }
    if (checks) {
        report(attn_bf16_supported(64) && attn_bf16_supported(128) && !attn_bf16_supported(32) &&
                   !attn_bf16_supported(96),
               "attn_bf16_supported: 64 and 128 yes, 32 and 96 no");
        test_shape(2, 3, 1, 64);
        test_shape(2, 2, 77, 64);
        test_shape(1, 4, 300, 128);
        if (!small) test_shape(2, 8, 256, 128);
        test_shape(3, 2, 129, 128);
        test_shape(1, 2, 200, 64);
    }
    if (perf) {
        time_shape(128, 8, 256, 128, 20);
        time_shape(8, 32, 256, 128, 20);
    }
    printf("RESULT %d %d\n", n_passed, n_failed);
    return n_failed ? 1 : 0;
}
