/* src/ops/cuda/queues.cuh: what runs beside or instead of the main stream's ops one by one: recorded
 * graphs, MESHTRAIN_PROFILE=events' marks, the side queue, offload's copy queues (C entry points,
 * inside ops_cuda.cu's extern "C").
 * Part of ops_cuda.cu, which includes it at this point of its one translation unit (after
 * the state and helpers it uses): not a header to include anywhere else. */
/* op_graph_* (ops.h): the main stream captured into a CUDA graph (relaxed mode: the ops'
 * own non-stream calls, attribute settings and plan lookups, stay allowed), replayed on it.
 * A graph holds the pointers it was recorded with: one recorded before the scratch grew
 * (its old buffer freed) or the matmuls were tuned (other algorithms) is stale, and
 * op_graph_run refuses it; one whose recording saw either happen is not kept. */
struct OpsGraph { cudaGraphExec_t exec; unsigned epoch; };
static unsigned g_graph_begun;
static int cuda_graph_begin(void) {
    if (g.stream != g.main || g.sync_each) return -1;  /* not inside the side queue; not when each op waits */
    if (cudaStreamBeginCapture(g.main, cudaStreamCaptureModeRelaxed) != cudaSuccess) {
        (void)cudaGetLastError();
        return -1;
    }
    g_graph_begun = g.graph_epoch;
    return 0;
}
static OpsGraph *cuda_graph_end(void) {
    static int said;
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    cudaError_t e = cudaStreamEndCapture(g.main, &graph);
    while (g_n_retired > 0) cuda_free(g_scratch_retired[--g_n_retired]);
    if (e == cudaSuccess && g.graph_epoch != g_graph_begun) e = cudaErrorInvalidValue;  /* (not said: expected) */
    else if (e == cudaSuccess) e = cudaGraphInstantiate(&exec, graph, 0);
    if (graph) cudaGraphDestroy(graph);
    if (e != cudaSuccess || !exec) {
        if (g.graph_epoch == g_graph_begun && !said++)
            fprintf(stderr, "meshtrain: cuda: a graph of ops could not be recorded (the ops run one by one): %s\n",
                    cudaGetErrorString(e));
        (void)cudaGetLastError();
        return NULL;
    }
    OpsGraph *gr = (OpsGraph *)malloc(sizeof *gr);
    if (!gr) die(1, "cuda: out of host memory for a graph");
    gr->exec = exec;
    gr->epoch = g.graph_epoch;
    return gr;
}
static int cuda_graph_run(OpsGraph *gr) {
    if (gr->epoch != g.graph_epoch || g.stream != g.main) return -1;
    CUDA_CHECK(cudaGraphLaunch(gr->exec, g.main));
    return 0;
}
static void cuda_graph_free(OpsGraph *gr) {
    CUDA_CHECK(cudaGraphExecDestroy(gr->exec));
    free(gr);
}

/* MESHTRAIN_PROFILE=events' pool (ops.h): events made on first use, recorded on the stream
 * the op runs on */
#define PROF_EVENTS 32768
static cudaEvent_t g_prof_ev[PROF_EVENTS];
static void cuda_prof_mark(int i) {
    if (i < 0 || i >= PROF_EVENTS) die(1, "cuda: profile event %d outside the pool", i);
    if (!g_prof_ev[i]) CUDA_CHECK(cudaEventCreate(&g_prof_ev[i]));
    CUDA_CHECK(cudaEventRecord(g_prof_ev[i], g.stream));
}
static double cuda_prof_span(int a, int b) {
    float ms = 0;
    CUDA_CHECK(cudaEventSynchronize(g_prof_ev[b]));
    CUDA_CHECK(cudaEventElapsedTime(&ms, g_prof_ev[a], g_prof_ev[b]));
    return ms / 1e3;
}

/* The side queue (ops.h): a second stream, entered after the main one's work so far. Its
 * ops must not use scratch(), which belongs to the main stream (AdamW does not). */
void cuda_side_begin(void) {
    if (!g.side) {
        CUDA_CHECK(cudaStreamCreateWithFlags(&g.side, cudaStreamNonBlocking));
        CUDA_CHECK(cudaEventCreateWithFlags(&g.side_in, cudaEventDisableTiming));
        for (int k = 0; k < OPS_SIDE_MARKS; k++) CUDA_CHECK(cudaEventCreateWithFlags(&g.side_ev[k], cudaEventDisableTiming));
    }
    CUDA_CHECK(cudaEventRecord(g.side_in, g.main));
    CUDA_CHECK(cudaStreamWaitEvent(g.side, g.side_in, 0));
    g.stream = g.side;
    g.side_used = 1;
}
void cuda_side_end(void) { g.stream = g.main; }
void cuda_side_mark(int k) { CUDA_CHECK(cudaEventRecord(g.side_ev[k], g.side)); }
void cuda_side_wait(int k) { CUDA_CHECK(cudaStreamWaitEvent(g.main, g.side_ev[k], 0)); }

static thread_local int t_device = -1;

static void copy_thread_device(void) {
    if (t_device != g.device) {
        CUDA_CHECK(cudaSetDevice(g.device));
        t_device = g.device;
    }
}

static void *cuda_host_alloc(size_t bytes) {
    void *p = NULL;
    if (cudaHostAlloc(&p, bytes, cudaHostAllocDefault) != cudaSuccess) {
        (void)cudaGetLastError(); /* refused: the caller says so, the next call must not see it */
        return NULL;
    }
    memset(p, 0, bytes);
    return p;
}

static void cuda_host_free(void *p) { CUDA_CHECK(cudaFreeHost(p)); }

static void copy_free(void) {
    for (int d = 0; d < 2 && g_copy.q[0]; d++) {
        CUDA_CHECK(cudaStreamSynchronize(g_copy.q[d]));
        CUDA_CHECK(cudaStreamDestroy(g_copy.q[d]));
        for (int k = 0; k < g_copy.n; k++) CUDA_CHECK(cudaEventDestroy(g_copy.ev[d][k]));
        free(g_copy.ev[d]);
    }
    if (g_copy.q[0]) CUDA_CHECK(cudaEventDestroy(g_copy.main_ev));
    memset(&g_copy, 0, sizeof g_copy);
}

/* At set-up, on the ops' thread, before any copy: nothing is in flight to invalidate. */
static void cuda_copy_reserve(int n) {
    if (n <= g_copy.n) return;
    copy_free();
    for (int d = 0; d < 2; d++) {
        CUDA_CHECK(cudaStreamCreateWithFlags(&g_copy.q[d], cudaStreamNonBlocking));
        g_copy.ev[d] = (cudaEvent_t *)calloc((size_t)n, sizeof(cudaEvent_t));
        if (!g_copy.ev[d]) die(2, "cannot allocate %d copy events: out of memory", n);
        for (int k = 0; k < n; k++) CUDA_CHECK(cudaEventCreateWithFlags(&g_copy.ev[d][k], cudaEventDisableTiming));
    }
    CUDA_CHECK(cudaEventCreateWithFlags(&g_copy.main_ev, cudaEventDisableTiming));
    g_copy.n = n;
}

static void copy_check(int k) {
    if (k < 0 || k >= g_copy.n) die(1, "internal: copy mark %d outside the %d reserved", k, g_copy.n);
}

static void cuda_copy_out(void *dst, const void *src, size_t bytes, int k) {
    copy_check(k);
    CUDA_CHECK(cudaEventRecord(g_copy.main_ev, g.main));
    CUDA_CHECK(cudaStreamWaitEvent(g_copy.q[0], g_copy.main_ev, 0));
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, g_copy.q[0]));
    CUDA_CHECK(cudaEventRecord(g_copy.ev[0][k], g_copy.q[0]));
}

static void cuda_copy_in(void *dst, const void *src, size_t bytes, int k) {
    copy_check(k);
    copy_thread_device();
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, g_copy.q[1]));
    CUDA_CHECK(cudaEventRecord(g_copy.ev[1][k], g_copy.q[1]));
}

static void cuda_copy_sync(int k, int in) {
    copy_check(k);
    copy_thread_device();
    CUDA_CHECK(cudaEventSynchronize(g_copy.ev[in != 0][k]));
}

static void cuda_copy_in_main(void *dst, const void *src, size_t bytes) {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, g.main));
}

static void cuda_copy_wait(int k, int in) {
    copy_check(k);
    CUDA_CHECK(cudaStreamWaitEvent(g.main, g_copy.ev[in != 0][k], 0));
}

int cuda_idle(void) {
    cudaError_t e = cudaStreamQuery(g.main);
    if (e == cudaErrorNotReady) return 0;
    CUDA_CHECK(e);
    return 1;
}
