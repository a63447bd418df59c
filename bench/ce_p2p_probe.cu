/* ce_p2p_probe — how fast one GPU's blocks reach every other GPU of the machine, the pattern of
 * tensor parallel's fused sums and gathers: each GPU sends a block of B bytes to each
 * of the G - 1 others, all at once. At tp = 4 the fused gathers' copies (one copy engine copy a
 * peer, on a side stream each) waited 0.10-0.18 ms for 8.4 MB blocks, slower than NCCL's
 * kernels (bench/results/tensor-parallel-h200x2-2026-11.md); this asks what would be faster. Variants, each the
 * median of REPS rounds (every GPU sending at once; the host waits for all):
 *   ce S    each block cut into S pieces, each piece a cudaMemcpyPeerAsync on its own stream of
 *           the sender (S streams a peer: more copy engines at once?)
 *   sm C    one kernel a peer on the sender, C CTAs storing 16-byte vectors into the peer's
 *           memory (the SMs drive the copy, as NCCL's kernels do)
 *   local   then, on each GPU, the G - 1 blocks received copied within the GPU (as the fused
 *           gathers copy each slot into place), one a stream at once: by cudaMemcpyAsync
 *           (D2D: a copy engine's local copy was reported at a twentieth of an SM copy's
 *           speed, NVIDIA/nccl issue 2177), and by a kernel of C CTAs
 *   ring    timed on the GPU (events on each sender, no host wait): the G - 1 blocks one after
 *           another on one stream, to r - 1 first, then r - 2, ... (each step a shift: every
 *           GPU receives one block at a time, block r + i on receiver r arriving at step i,
 *           the order tensor parallel's gathers read them in), against all at once (one stream
 *           a peer, as above); the time each block (by step) is complete, the slowest sender's;
 *           "ring halves": each step's block in two halves on two streams (two copy engines);
 *           "pull ring" / "pull at once": the same blocks copied by the receiver's copy engines
 *           (its streams read each sender's memory: from r + 1 first, then r + 2, ...; or one
 *           stream a peer), the time each step's block is in, the slowest receiver's
 * Prints microseconds a round and GB/s out of each GPU ((G - 1) B / time).
 * Usage: ce_p2p_probe [BYTES ...]   (default 8388608 16777216: a tp = 4 and a tp = 2 block of
 * the TP-efficiency model). Needs two or more GPUs with peer access. */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { MAXG = 8, MAXS = 8, REPS = 21 };

static void ck(cudaError_t e, const char *call) {
    if (e == cudaSuccess) return;
    fprintf(stderr, "ce_p2p_probe: %s: %s\n", call, cudaGetErrorString(e));
    exit(1);
}

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static __global__ void copy16_kernel(uint4 *dst, const uint4 *src, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = src[i];
}

static int G;
static char *src[MAXG], *dst[MAXG], *loc[MAXG];  /* GPU g: its G - 1 blocks to send; the G - 1 it receives; their place */
static cudaStream_t st[MAXG][MAXG][MAXS];

/* slot of sender s on receiver d (0 .. G - 2) */
static size_t slot(int d, int s) { return (size_t)((s - d - 1 + G) % G); }

static void sync_all(void) {
    for (int g = 0; g < G; g++) {
        ck(cudaSetDevice(g), "cudaSetDevice");
        ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    }
}

/* one round: every GPU sends its blocks; mode 0 copy engines in `parts` pieces, 1 a kernel of
 * `parts` CTAs a peer; 2 and 3 the local copies (received slots into loc) by cudaMemcpyAsync
 * or a kernel of `parts` CTAs */
static void round_once(size_t B, int mode, int parts) {
    if (mode >= 2) {
        for (int g = 0; g < G; g++) {
            ck(cudaSetDevice(g), "cudaSetDevice");
            for (int k = 0; k < G - 1; k++) {
                cudaStream_t s1 = st[g][(g + 1 + k) % G][0];
                if (mode == 2)
                    ck(cudaMemcpyAsync(loc[g] + (size_t)k * B, dst[g] + (size_t)k * B, B, cudaMemcpyDeviceToDevice, s1),
                       "cudaMemcpyAsync");
                else {
                    copy16_kernel<<<parts, 512, 0, s1>>>((uint4 *)(loc[g] + (size_t)k * B), (const uint4 *)(dst[g] + (size_t)k * B),
                                                         B / 16);
                    ck(cudaGetLastError(), "copy16_kernel");
                }
            }
        }
        sync_all();
        return;
    }
    for (int s = 0; s < G; s++) {
        ck(cudaSetDevice(s), "cudaSetDevice");
        for (int d = 0; d < G; d++) {
            if (d == s) continue;
            char *from = src[s] + slot(s, d) * B, *to = dst[d] + slot(d, s) * B;
            if (mode == 0) {
                size_t piece = (B / (size_t)parts + 255) & ~(size_t)255;
                for (int k = 0; k < parts; k++) {
                    size_t off = (size_t)k * piece, n = off >= B ? 0 : (B - off < piece ? B - off : piece);
                    if (n) ck(cudaMemcpyPeerAsync(to + off, d, from + off, s, n, st[s][d][k]), "cudaMemcpyPeerAsync");
                }
            } else {
                copy16_kernel<<<parts, 512, 0, st[s][d][0]>>>((uint4 *)to, (const uint4 *)from, B / 16);
                ck(cudaGetLastError(), "copy16_kernel");
            }
        }
    }
    sync_all();
}

static void measure(size_t B, int mode, int parts) {
    double t[REPS];
    round_once(B, mode, parts);  /* (warm-up) */
    for (int r = 0; r < REPS; r++) {
        double t0 = now_us();
        round_once(B, mode, parts);
        t[r] = now_us() - t0;
    }
    qsort(t, REPS, sizeof t[0], cmp_double);
    double us = t[REPS / 2];
    const char *name[] = {"ce", "sm", "local memcpy", "local kernel"};
    printf("  %-12s %3d   %8.1f us   %6.1f GB/s %s each GPU\n", name[mode], mode == 2 ? 1 : parts, us,
           (double)(G - 1) * (double)B / us / 1e3, mode >= 2 ? "copied within" : "out of");
}

/* ring (see the head): per step k (1 .. G - 1), the median over REPS of the slowest sender's
 * time from its start to its k-th block complete; ring != 0 one stream in shift order, else
 * one stream a peer, all at once (then "step" k is peer r - k's copy). */
static void measure_events(size_t B, int ring) {
    static cudaEvent_t e0[MAXG], ek[MAXG][MAXG], half[MAXG][2];
    static int made;
    if (!made) {
        for (int g = 0; g < G; g++) {
            ck(cudaSetDevice(g), "cudaSetDevice");
            ck(cudaEventCreate(&e0[g]), "cudaEventCreate");
            for (int k = 0; k < G; k++) ck(cudaEventCreate(&ek[g][k]), "cudaEventCreate");
            for (int k = 0; k < 2; k++) ck(cudaEventCreateWithFlags(&half[g][k], cudaEventDisableTiming), "cudaEventCreate");
        }
        made = 1;
    }
    double t[MAXG][REPS];
    for (int rep = -1; rep < REPS; rep++) {
        for (int s = 0; s < G; s++) {
            ck(cudaSetDevice(s), "cudaSetDevice");
            cudaStream_t s0 = st[s][(s + 1) % G][0];
            ck(cudaEventRecord(e0[s], s0), "cudaEventRecord");
            for (int k = 1; k < G; k++) {
                int d = (s - k + G) % G;
                if (ring >= 3) {  /* s receives: from s + k, on its own streams (its copy engines read the peer) */
                    int p = (s + k) % G;
                    cudaStream_t sk = ring == 3 ? s0 : st[s][p][0];
                    if (ring == 4) ck(cudaStreamWaitEvent(sk, e0[s], 0), "cudaStreamWaitEvent");
                    ck(cudaMemcpyPeerAsync(dst[s] + slot(s, p) * B, s, src[p] + slot(p, s) * B, p, B, sk), "cudaMemcpyPeerAsync");
                    ck(cudaEventRecord(ek[s][k], sk), "cudaEventRecord");
                    continue;
                }
                cudaStream_t sk = ring ? s0 : st[s][d][0];
                if (!ring) ck(cudaStreamWaitEvent(sk, e0[s], 0), "cudaStreamWaitEvent");
                if (ring == 2) {  /* each step in two halves on two streams (two copy engines), then joined */
                    cudaStream_t s1 = st[s][(s + 1) % G][1];
                    size_t h = (B / 2 + 255) & ~(size_t)255;
                    if (k == 1) ck(cudaStreamWaitEvent(s1, e0[s], 0), "cudaStreamWaitEvent");
                    ck(cudaMemcpyPeerAsync(dst[d] + slot(d, s) * B, d, src[s] + slot(s, d) * B, s, h, s0), "cudaMemcpyPeerAsync");
                    ck(cudaMemcpyPeerAsync(dst[d] + slot(d, s) * B + h, d, src[s] + slot(s, d) * B + h, s, B - h, s1),
                       "cudaMemcpyPeerAsync");
                    ck(cudaEventRecord(half[s][1], s1), "cudaEventRecord");
                    ck(cudaStreamWaitEvent(s0, half[s][1], 0), "cudaStreamWaitEvent");
                    ck(cudaEventRecord(half[s][0], s0), "cudaEventRecord");
                    ck(cudaStreamWaitEvent(s1, half[s][0], 0), "cudaStreamWaitEvent");
                } else
                    ck(cudaMemcpyPeerAsync(dst[d] + slot(d, s) * B, d, src[s] + slot(s, d) * B, s, B, sk), "cudaMemcpyPeerAsync");
                ck(cudaEventRecord(ek[s][k], sk), "cudaEventRecord");
            }
        }
        sync_all();
        if (rep < 0) continue;
        for (int k = 1; k < G; k++) {
            double most = 0;
            for (int s = 0; s < G; s++) {
                float ms = 0;
                ck(cudaEventElapsedTime(&ms, e0[s], ek[s][k]), "cudaEventElapsedTime");
                most = ms * 1e3 > most ? ms * 1e3 : most;
            }
            t[k][rep] = most;
        }
    }
    const char *names[] = {"at once", "ring", "ring halves", "pull ring", "pull at once"};
    printf("  %-12s", names[ring]);
    for (int k = 1; k < G; k++) {
        qsort(t[k], REPS, sizeof t[k][0], cmp_double);
        printf("  step %d %7.1f us", k, t[k][REPS / 2]);
    }
    printf("   (events)\n");
}

int main(int argc, char **argv) {
    ck(cudaGetDeviceCount(&G), "cudaGetDeviceCount");
    if (G < 2) {
        fprintf(stderr, "ce_p2p_probe: needs two or more GPUs (%d visible)\n", G);
        return 1;
    }
    if (G > MAXG) G = MAXG;
    size_t sizes[8] = {8388608, 16777216};
    int n_sizes = argc > 1 ? argc - 1 : 2;
    for (int i = 0; i < n_sizes && i < 8 && argc > 1; i++) sizes[i] = (size_t)strtoull(argv[i + 1], NULL, 10) & ~(size_t)15;
    if (n_sizes > 8) n_sizes = 8;
    size_t most = 0;
    for (int i = 0; i < n_sizes; i++) most = sizes[i] > most ? sizes[i] : most;
    for (int g = 0; g < G; g++) {
        ck(cudaSetDevice(g), "cudaSetDevice");
        for (int p = 0; p < G; p++) {
            int can = 0;
            if (p == g) continue;
            ck(cudaDeviceCanAccessPeer(&can, g, p), "cudaDeviceCanAccessPeer");
            if (!can) {
                fprintf(stderr, "ce_p2p_probe: GPU %d cannot access GPU %d\n", g, p);
                return 1;
            }
            cudaError_t e = cudaDeviceEnablePeerAccess(p, 0);
            if (e != cudaErrorPeerAccessAlreadyEnabled) ck(e, "cudaDeviceEnablePeerAccess");
            for (int k = 0; k < MAXS; k++) ck(cudaStreamCreateWithFlags(&st[g][p][k], cudaStreamNonBlocking), "cudaStreamCreate");
        }
        ck(cudaMalloc((void **)&src[g], (size_t)(G - 1) * most), "cudaMalloc");
        ck(cudaMalloc((void **)&dst[g], (size_t)(G - 1) * most), "cudaMalloc");
        ck(cudaMalloc((void **)&loc[g], (size_t)(G - 1) * most), "cudaMalloc");
        ck(cudaMemset(src[g], g + 1, (size_t)(G - 1) * most), "cudaMemset");
    }
    cudaDeviceProp prop;
    ck(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    printf("%d x %s (%d copy engines each)\n", G, prop.name, prop.asyncEngineCount);
    for (int i = 0; i < n_sizes; i++) {
        printf("block %zu bytes to each of %d peers, all GPUs at once:\n", sizes[i], G - 1);
        int ce[] = {1, 2, 4, 8}, sm[] = {8, 16, 32, 66};
        for (int k = 0; k < 4; k++) measure(sizes[i], 0, ce[k]);
        for (int k = 0; k < 4; k++) measure(sizes[i], 1, sm[k]);
        measure(sizes[i], 2, 1);
        measure(sizes[i], 3, 66);
        measure(sizes[i], 3, 132);
        measure_events(sizes[i], 0);
        measure_events(sizes[i], 1);
        measure_events(sizes[i], 2);
        measure_events(sizes[i], 3);
        measure_events(sizes[i], 4);
    }
    /* the bytes arrived (the last round's; the local copies leave the slots as they are): sender s's value in s's slot */
    for (int d = 0; d < G; d++) {
        ck(cudaSetDevice(d), "cudaSetDevice");
        for (int s = 0; s < G; s++) {
            unsigned char v = 0;
            if (s == d) continue;
            ck(cudaMemcpy(&v, dst[d] + slot(d, s) * sizes[n_sizes - 1] + sizes[n_sizes - 1] - 1, 1, cudaMemcpyDeviceToHost),
               "cudaMemcpy");
            unsigned char u = 0;
            ck(cudaMemcpy(&u, loc[d] + slot(d, s) * sizes[n_sizes - 1], 1, cudaMemcpyDeviceToHost), "cudaMemcpy");
            if (v != (unsigned char)(s + 1) || u != v) {
                fprintf(stderr, "ce_p2p_probe: GPU %d's block from GPU %d holds %d (its local copy %d), not %d\n", d, s, v,
                        u, s + 1);
                return 1;
            }
        }
    }
    printf("every block arrived\n");
    return 0;
}
