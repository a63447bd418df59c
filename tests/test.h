/* Minimal test harness: each TEST is a function; a test passes when none of its CHECKs
 * fail. Each binary ends with "RESULT <passed> <failed>", which scripts/run-tests.sh sums. */
#ifndef MESHTRAIN_TEST_H
#define MESHTRAIN_TEST_H
#include <math.h>
#include <stddef.h>
#include <stdio.h>

static int test_failed_checks_;
static int tests_passed_, tests_failed_;

#define CHECK(cond, ...)                                                                     \
    do {                                                                                     \
        if (!(cond)) {                                                                       \
            test_failed_checks_++;                                                           \
            fprintf(stderr, "  FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);               \
            fprintf(stderr, __VA_ARGS__);                                                    \
            fputc('\n', stderr);                                                             \
        }                                                                                    \
    } while (0)

#define RUN(fn)                                                                              \
    do {                                                                                     \
        test_failed_checks_ = 0;                                                             \
        fn();                                                                                \
        if (test_failed_checks_) { tests_failed_++; printf("FAIL %s\n", #fn); }             \
        else { tests_passed_++; printf("ok   %s\n", #fn); }                                 \
        fflush(stdout);                                                                      \
    } while (0)

#define TEST_SUMMARY()                                                                       \
    (printf("RESULT %d %d\n", tests_passed_, tests_failed_), tests_failed_ ? 1 : 0)

/* norm-wise relative error ||a - ref|| / ||ref|| of two float arrays, in double (0 when
 * they are equal, even both zero) */
static inline double norm_rel_err(const float *a, const float *ref, size_t n) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return num == 0.0 ? 0.0 : sqrt(num) / fmax(sqrt(den), 1e-300);
}

/* Cross-entropy edge rows on CE_SPECIAL_N rows of V >= 61 random logits: row 1 gets a NaN,
 * row 2 a +inf, row 3 is all -inf, row 4 has some -inf (not at its target); targets are
 * 3..8. The caller puts row 5's target out of range (V) after the CPU reference, which does
 * not check it. ce_special_nan(n): rows 1, 2, 3 and 5 give a NaN loss and gradient. */
enum { CE_SPECIAL_N = 6 };
static inline void ce_special_rows(float *logits, int V, int tgt[CE_SPECIAL_N]) {
    for (int n = 0; n < CE_SPECIAL_N; n++) tgt[n] = 3 + n;
    logits[1 * V + 50] = NAN;
    logits[2 * V + 60] = INFINITY;
    for (int j = 0; j < V; j++) logits[3 * V + j] = -INFINITY;
    for (int j = 0; j < V; j += 3) logits[4 * V + j] = -INFINITY; /* target 8 is not one of them */
}
static inline int ce_special_nan(int n) { return n == 1 || n == 2 || n == 3 || n == 5; }

/* relative error with an absolute floor, for comparing to references */
static inline double rel_err(double a, double b) {
    double d = fabs(a - b), s = fmax(fabs(a), fabs(b));
    return d / fmax(s, 1e-6);
}
#endif
