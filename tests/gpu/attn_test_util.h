/* Functions of the standalone nvcc-built attention GPU test (tests/gpu/test_attn_wgmma_bwd.cu): host
 * random numbers (xorshift64*: urand uniform in (0, 1), nrand standard normal), a device fill of bf16
 * arrays with roughly N(0, 1) values (for the timings), and the float comparison for qsort (medians). */
#ifndef MESHTRAIN_ATTN_TEST_UTIL_H
#define MESHTRAIN_ATTN_TEST_UTIL_H
#include <cuda_bf16.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static double urand(void) { /* xorshift64*, uniform in (0, 1) */
    rng_state ^= rng_state >> 12, rng_state ^= rng_state << 25, rng_state ^= rng_state >> 27;
    return ((double)((rng_state * 2685821657736338717ull) >> 11) + 0.5) / 9007199254740992.0;
}
static double nrand(void) { return sqrt(-2.0 * log(urand())) * cos(6.283185307179586 * urand()); }

static __global__ void fill_random(__nv_bfloat16 *x, size_t n, uint32_t seed) { /* roughly N(0, 1) */
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed;
        h ^= h >> 15, h *= 2246822519u, h ^= h >> 13, h *= 3266489917u, h ^= h >> 16;
        x[i] = __float2bfloat16(((float)(h & 0xffffff) / 16777216.f - 0.5f) * 3.4641f);
    }
}

static int cmp_float(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}
#endif
