/* The host AdamW of offload=optimizer (the cpu backend's kernels, OpenMP): ns per element
 * over N elements, fp32 gradients (adamw) and lean bf16 gradients (adamw_host16, which also
 * writes the bf16 parameters). `bench_host_adamw [N] [steps]` (threads: OMP_NUM_THREADS).
 * Memory-bound: extrapolate by the host's memory bandwidth, not only its cores. */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include "ops.h"
#include "util.h"

int main(int argc, char **argv) {
    size_t n = argc > 1 ? (size_t)strtod(argv[1], NULL) : (size_t)1e8;
    int steps = argc > 2 ? atoi(argv[2]) : 3;
    float *p = xaligned_alloc(n * sizeof(float)), *m = xaligned_alloc(n * sizeof(float));
    float *v = xaligned_alloc(n * sizeof(float)), *g = xaligned_alloc(n * sizeof(float));
    uint16_t *g16 = xaligned_alloc(n * sizeof(uint16_t));
#pragma omp parallel for
    for (size_t i = 0; i < n; i++) p[i] = 0.01f * (float)(i % 97), m[i] = v[i] = 0, g[i] = 1e-3f, g16[i] = bf16_round(1e-3f);
    for (int k = 0; k < 2; k++) {
        double best = 1e30;
        for (int s = 1; s <= steps; s++) {
            if (k == 1)
#pragma omp parallel for
                for (size_t i = 0; i < n; i++) g16[i] = bf16_round(1e-3f);  /* the kernel wrote parameters there */
            double t0 = now_seconds();
            if (k == 0) ops_backend_cpu.adamw(p, g, m, v, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, s, 1.0f);
            else ops_backend_cpu.adamw_host16(p, g16, m, v, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, s, 1.0f);
            double dt = now_seconds() - t0;
            if (dt < best) best = dt;
        }
        size_t bytes = 28;  /* read p m v g and write p m v (fp32 g); or g16 read and written (bf16) */
        printf("%-13s %zu elements, %d threads: %.3f s, %.2f ns/element, %.1f GB/s\n",
               k == 0 ? "adamw" : "adamw_host16", n, omp_get_max_threads(), best, best / (double)n * 1e9,
               (double)bytes * (double)n / best / 1e9);
    }
    free(p); free(m); free(v); free(g); free(g16);
    return 0;
}
