/* The step timeline of trace.h: CUDA timing events, kept in a fixed table. */
#include "trace.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef MESHTRAIN_CUDA
#include <cuda_runtime_api.h>
#include "ops_cuda.h"

#define MAX_MARKS 512
typedef struct {
    cudaEvent_t ev, end;  /* end: spans only */
    char label[48];
    int comm;             /* on the communication stream */
    size_t bytes;
} Mark;
static Mark g_marks[MAX_MARKS];
static int g_n, g_armed, g_target = -1;

void trace_step(int step) {
    if (g_target < 0) {
        const char *e = getenv("MESHTRAIN_TIMELINE");
        g_target = e ? atoi(e) : 0;
    }
    g_armed = g_target > 0 && step == g_target;
    g_n = 0;
    if (g_armed) trace_mark(NULL, "step starts");
}

int trace_active(void) { return g_armed; }

static Mark *new_mark(void *stream, const char *label) {
    if (!g_armed || g_n == MAX_MARKS) return NULL;
    Mark *m = &g_marks[g_n];
    memset(m, 0, sizeof *m);
    if (cudaEventCreate(&m->ev) != cudaSuccess) return NULL;
    snprintf(m->label, sizeof m->label, "%s", label);
    m->comm = stream != NULL;
    cudaEventRecord(m->ev, stream ? (cudaStream_t)stream : (cudaStream_t)cuda_stream());
    g_n++;
    return m;
}

void trace_mark(void *stream, const char *label) { new_mark(stream, label); }

int trace_span_begin(void *stream, const char *what, size_t bytes) {
    Mark *m = new_mark(stream, what);
    if (!m) return -1;
    m->bytes = bytes;
    return (int)(m - g_marks);
}

void trace_span_end(void *stream, int span) {
    if (!g_armed || span < 0 || span >= g_n) return;
    Mark *m = &g_marks[span];
    if (cudaEventCreate(&m->end) != cudaSuccess) return;
    cudaEventRecord(m->end, (cudaStream_t)stream);
}

static int by_time(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

void trace_dump(int rank) {
    if (!g_armed) return;
    cudaDeviceSynchronize();
    struct { float t; int i; } order[MAX_MARKS];
    for (int i = 0; i < g_n; i++) {
        order[i].i = i;
        if (cudaEventElapsedTime(&order[i].t, g_marks[0].ev, g_marks[i].ev) != cudaSuccess) order[i].t = -1;
    }
    qsort(order, (size_t)g_n, sizeof order[0], by_time);
    for (int k = 0; k < g_n; k++) {
        Mark *m = &g_marks[order[k].i];
        float dur = -1;
        if (m->end) cudaEventElapsedTime(&dur, m->ev, m->end);
        if (m->end && dur >= 0)
            fprintf(stderr, "timeline rank %d: %9.3f ms  %-7s %-34s %7.3f ms  %8.1f MB  %6.1f GB/s\n", rank,
                    order[k].t, "comm", m->label, dur, m->bytes / 1e6, dur > 0 ? m->bytes / 1e6 / dur : 0.0);
        else
            fprintf(stderr, "timeline rank %d: %9.3f ms  %-7s %s\n", rank, order[k].t, m->comm ? "comm" : "compute",
                    m->label);
    }
    for (int i = 0; i < g_n; i++) {
        cudaEventDestroy(g_marks[i].ev);
        if (g_marks[i].end) cudaEventDestroy(g_marks[i].end);
    }
    g_n = 0;
    g_armed = 0;
}

#else
void trace_step(int step) { (void)step; }
int trace_active(void) { return 0; }
void trace_mark(void *stream, const char *label) { (void)stream, (void)label; }
int trace_span_begin(void *stream, const char *what, size_t bytes) { (void)stream, (void)what, (void)bytes; return -1; }
void trace_span_end(void *stream, int span) { (void)stream, (void)span; }
void trace_dump(int rank) { (void)rank; }
#endif
