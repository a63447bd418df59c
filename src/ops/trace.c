/* The step timeline of trace.h, kept in a fixed table: CUDA timing events on a device,
 * host clock readings on the CPU backend (whose ops run when called, so a mark's time is
 * when the work before it ended; its collectives progress on the host, so a span has only
 * its start there). */
#include "trace.h"
#include "env.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "ops.h"
#include "util.h"
#ifdef MESHTRAIN_CUDA
#include <cuda_runtime_api.h>
#include "ops_cuda.h"
#endif

#define MAX_MARKS 512
typedef struct {
    double t;           /* host: seconds */
    void *ev, *end;     /* device: cudaEvent_t; end only for spans */
    char label[48];
    int comm, span;     /* on the communication stream; a collective */
    size_t bytes;
} Mark;
static Mark g_marks[MAX_MARKS];
static int g_n, g_armed, g_target = -1;

void trace_step(int step) {
    if (g_target < 0) {
        g_target = (int)hook_int(HOOK_TIMELINE, 0);
    }
    g_armed = g_target > 0 && step == g_target;
    g_n = 0;
    if (g_armed) trace_mark(NULL, "step starts");
}

int trace_active(void) { return g_armed; }

static Mark *new_mark(void *stream, const char *label, int comm) {
    if (!g_armed || g_n == MAX_MARKS) return NULL;
    Mark *m = &g_marks[g_n];
    memset(m, 0, sizeof *m);
    snprintf(m->label, sizeof m->label, "%s", label);
    m->comm = comm;
    m->t = now_seconds();
#ifdef MESHTRAIN_CUDA
    if (!ops_host_memory()) {
        cudaEvent_t ev;
        if (cudaEventCreate(&ev) != cudaSuccess) return NULL;
        cudaEventRecord(ev, stream ? (cudaStream_t)stream : (cudaStream_t)cuda_stream());
        m->ev = (void *)ev;
    }
#else
    (void)stream;
#endif
    g_n++;
    return m;
}

void trace_mark(void *stream, const char *label) { new_mark(stream, label, stream != NULL); }

int trace_span_begin(void *stream, const char *what, size_t bytes) {
    Mark *m = new_mark(stream, what, 1);
    if (!m) return -1;
    m->span = 1;
    m->bytes = bytes;
    return (int)(m - g_marks);
}

void trace_span_end(void *stream, int span) {
    if (!g_armed || span < 0 || span >= g_n) return;
#ifdef MESHTRAIN_CUDA
    Mark *m = &g_marks[span];
    cudaEvent_t end;
    if (!m->ev || cudaEventCreate(&end) != cudaSuccess) return;
    cudaEventRecord(end, stream ? (cudaStream_t)stream : (cudaStream_t)cuda_stream());
    m->end = (void *)end;
#else
    (void)stream;
#endif
}

/* ms from the step's start; the duration of a span, -1 where unknown */
static double at_ms(const Mark *m) {
#ifdef MESHTRAIN_CUDA
    float t = 0;
    if (m->ev && g_marks[0].ev && cudaEventElapsedTime(&t, (cudaEvent_t)g_marks[0].ev, (cudaEvent_t)m->ev) == cudaSuccess)
        return t;
#endif
    return 1e3 * (m->t - g_marks[0].t);
}
static double span_ms(const Mark *m) {
#ifdef MESHTRAIN_CUDA
    float t = 0;
    if (m->ev && m->end && cudaEventElapsedTime(&t, (cudaEvent_t)m->ev, (cudaEvent_t)m->end) == cudaSuccess) return t;
#else
    (void)m;
#endif
    return -1;
}

typedef struct { double t; int i; } Order;
static int by_time(const void *a, const void *b) {
    const Order *x = a, *y = b;
    return x->t < y->t ? -1 : x->t > y->t ? 1 : x->i - y->i;
}

void trace_dump(int rank) {
    if (!g_armed) return;
    ops_synchronize();
    Order order[MAX_MARKS];
    for (int i = 0; i < g_n; i++) order[i] = (Order){at_ms(&g_marks[i]), i};
    qsort(order, (size_t)g_n, sizeof order[0], by_time);
    for (int k = 0; k < g_n; k++) {
        const Mark *m = &g_marks[order[k].i];
        double dur = span_ms(m);
        if (m->span && dur >= 0)
            fprintf(stderr, "timeline rank %d: %9.3f ms  comm     %-34s %7.3f ms  %8.1f MB  %6.1f GB/s\n", rank,
                    order[k].t, m->label, dur, m->bytes / 1e6, dur > 0 ? m->bytes / 1e6 / dur : 0.0);
        else if (m->span)
            fprintf(stderr, "timeline rank %d: %9.3f ms  comm     %-34s starts     %8.1f MB\n", rank, order[k].t,
                    m->label, m->bytes / 1e6);
        else
            fprintf(stderr, "timeline rank %d: %9.3f ms  %-8s %s\n", rank, order[k].t, m->comm ? "comm" : "compute",
                    m->label);
    }
#ifdef MESHTRAIN_CUDA
    /* whether the host kept ahead: a compute mark the GPU reached within 0.05 ms of its
     * enqueue found the queue empty, so the GPU waited on the host's calls there */
    if (!ops_host_memory()) {
        int n = 0, near = 0, each = hook_on(HOOK_TIMELINE_LEADS);
        double lag_min = 1e30, host_end = 0;
        const char *at = "";
        for (int i = 1; i < g_n; i++) {
            const Mark *m = &g_marks[i];
            if (m->span || m->comm || !m->ev || !strncmp(m->label, "host:", 5)) continue;
            double h = 1e3 * (m->t - g_marks[0].t), lag = at_ms(m) - h;
            if (each)
                fprintf(stderr, "timeline rank %d: lead %7.3f ms (host %9.3f)  %s\n", rank, lag, h, m->label);
            n++, near += lag < 0.05, host_end = h;
            if (lag < lag_min) lag_min = lag, at = m->label;
        }
        if (n)
            fprintf(stderr, "timeline rank %d: host enqueued up to the last mark in %.3f ms; the GPU was within 0.05 ms "
                    "of the host at %d of %d compute marks (least lead %.3f ms, at '%s')\n", rank, host_end, near, n,
                    lag_min, at);
    }
    for (int i = 0; i < g_n; i++) {
        if (g_marks[i].ev) cudaEventDestroy((cudaEvent_t)g_marks[i].ev);
        if (g_marks[i].end) cudaEventDestroy((cudaEvent_t)g_marks[i].end);
    }
#endif
    g_n = 0;
    g_armed = 0;
}
