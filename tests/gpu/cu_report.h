/* The standalone nvcc-built GPU tests' (tests/gpu/test_*.cu) reporting: "ok"/"FAIL" lines, a
 * RESULT line, and CK, which turns any CUDA error (a faulting or trapping kernel included)
 * into FAIL, the RESULT line and exit 1. */
#ifndef MESHTRAIN_CU_REPORT_H
#define MESHTRAIN_CU_REPORT_H
#include <cuda_runtime.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

static int n_passed, n_failed;

static void report(int ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void report(int ok, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf(ok ? "ok   " : "FAIL ");
    vprintf(fmt, ap);
    printf("\n");
    fflush(stdout);
    va_end(ap);
    if (ok) n_passed++;
    else n_failed++;
}

#define CK(call)                                                                                  \
    do {                                                                                          \
        cudaError_t e_ = (call);                                                                  \
        if (e_ != cudaSuccess) {                                                                  \
            printf("FAIL %s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));   \
            printf("RESULT %d %d\n", n_passed, n_failed + 1);                                     \
            fflush(stdout);                                                                       \
            exit(1);                                                                              \
        }                                                                                         \
    } while (0)
#endif
