/* src/ops/cuda/memory.cuh: the card's memory: allocations and their high-water marks, the pinned
 * staging of small uploads, copies and zeroing (C entry points, inside ops_cuda.cu's extern "C").
 * Part of ops_cuda.cu, which includes it at this point of its one translation unit (after
 * the state and helpers it uses): not a header to include anywhere else. */
/* Live allocations, for the high-water mark of the bytes held on the card (cudaFree does
 * not say how big a block was). They are few and long-lived, so a list does. Kept apart
 * from g: the marks survive cuda_shutdown. */
typedef struct { void *p; size_t bytes; } LiveAlloc;
static LiveAlloc *g_live;
static size_t g_n_live, g_cap_live, g_live_bytes, g_peak_alloc, g_peak_used;

static void track_alloc(void *p, size_t bytes) {
    if (g_n_live == g_cap_live) {
        size_t cap = g_cap_live ? 2 * g_cap_live : 64;
        void *q = realloc(g_live, cap * sizeof *g_live);
        if (!q) die(2, "cannot allocate %zu bytes: out of memory", cap * sizeof *g_live);
        g_live = (LiveAlloc *)q;
        g_cap_live = cap;
    }
    g_live[g_n_live].p = p;
    g_live[g_n_live++].bytes = bytes;
    g_live_bytes += bytes;
    if (g_live_bytes > g_peak_alloc) g_peak_alloc = g_live_bytes;
    size_t fr = 0, tot = 0;
    if (cudaMemGetInfo(&fr, &tot) == cudaSuccess && tot - fr > g_peak_used) g_peak_used = tot - fr;
}

static void track_free(void *p) {
    for (size_t i = 0; i < g_n_live; i++)
        if (g_live[i].p == p) {
            g_live_bytes -= g_live[i].bytes;
            g_live[i] = g_live[--g_n_live];
            return;
        }
}

void *cuda_malloc(size_t bytes) {
    if (bytes == 0) return NULL;
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
        size_t fr = 0, tot = 0;
        (void)cudaGetLastError(); /* clear the allocation error before asking */
        cudaMemGetInfo(&fr, &tot);
        die(2, "cuda: cannot allocate %zu bytes on the GPU: %s (%zu MiB free of %zu MiB)", bytes,
            cudaGetErrorString(e), fr >> 20, tot >> 20);
    }
    track_alloc(p, bytes);
    return p;
}

void cuda_free(void *p) {
    if (!p) return;
    cuda_synchronize(); /* kernels in flight, on either queue, may still use it */
    CUDA_CHECK(cudaFree(p));
    track_free(p);
}

void cuda_note_alloc(void *p, size_t bytes) { if (p) track_alloc(p, bytes); }
void cuda_note_free(void *p) { if (p) track_free(p); }

void cuda_memory_peak(size_t *allocated, size_t *used) {
    if (allocated) *allocated = g_peak_alloc;
    if (used) *used = g_peak_used;
}

int cuda_memory_info(size_t *free_bytes, size_t *total_bytes) {
    size_t fr = 0, tot = 0;
    if (cudaMemGetInfo(&fr, &tot) != cudaSuccess) return -1;
    if (free_bytes) *free_bytes = fr;
    if (total_bytes) *total_bytes = tot;
    return 0;
}

/* Small uploads (a micro-batch's tokens, targets and embedding index) go through a ring of
 * pinned staging buffers and are not waited for: the host copies into the next buffer and
 * moves on, so it keeps queueing work ahead of the device (waiting for each upload left the
 * device idle while the next micro-batch's kernels were being queued). A buffer is reused
 * only once its copy, STAGE_SLOTS uploads ago, is done. Large ones (parameters) wait. */
#define STAGE_SLOTS 16
#define STAGE_MAX ((size_t)1 << 20)
static struct {
    void *buf[STAGE_SLOTS];
    cudaEvent_t ev[STAGE_SLOTS];
    int next;
} g_stage;

static void stage_free(void) {
    for (int k = 0; k < STAGE_SLOTS; k++) {
        if (g_stage.buf[k]) CUDA_CHECK(cudaFreeHost(g_stage.buf[k]));
        if (g_stage.ev[k]) CUDA_CHECK(cudaEventDestroy(g_stage.ev[k]));
    }
    memset(&g_stage, 0, sizeof g_stage);
}

void cuda_memcpy_h2d(void *dst, const void *src, size_t bytes) {
    if (!bytes) return;
    if (bytes <= STAGE_MAX) {
        int k = g_stage.next;
        g_stage.next = (k + 1) % STAGE_SLOTS;
        if (!g_stage.buf[k]) {
            CUDA_CHECK(cudaMallocHost(&g_stage.buf[k], STAGE_MAX));
            CUDA_CHECK(cudaEventCreateWithFlags(&g_stage.ev[k], cudaEventDisableTiming));
        } else {
            CUDA_CHECK(cudaEventSynchronize(g_stage.ev[k]));
        }
        memcpy(g_stage.buf[k], src, bytes);
        CUDA_CHECK(cudaMemcpyAsync(dst, g_stage.buf[k], bytes, cudaMemcpyHostToDevice, g.stream));
        CUDA_CHECK(cudaEventRecord(g_stage.ev[k], g.stream));
        if (g.sync_each) CUDA_CHECK(cudaStreamSynchronize(g.stream));
        return;
    }
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, g.stream));
    CUDA_CHECK(cudaStreamSynchronize(g.stream));
}

void cuda_memcpy_d2h(void *dst, const void *src, size_t bytes) {
    if (!bytes) return;
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, g.stream));
    CUDA_CHECK(cudaStreamSynchronize(g.stream));
}

void cuda_memcpy_d2d(void *dst, const void *src, size_t bytes) {
    if (bytes) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, g.stream));
}

void cuda_memset_zero(void *p, size_t bytes) {
    if (bytes) CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, g.stream));
}
