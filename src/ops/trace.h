/* trace — the timeline of one training step, for seeing how compute and collectives
 * overlap. MESHTRAIN_TIMELINE=S makes every rank record, during step S, where each layer's
 * backward begins on the compute stream and when each collective starts (its inputs ready)
 * and ends on the communication stream: CUDA events on a GPU; on the CPU backend host
 * clock readings (a collective's start only: the MPI rings progress on the host). After the
 * step it prints them in time order, in ms from the step's start, with each collective's
 * duration and bandwidth where known (stderr, "timeline rank R: ..."), then on a device a
 * line on how far the host kept ahead of the GPU (MESHTRAIN_TIMELINE_LEADS=1: the lead at
 * every compute mark; one near 0 means the GPU waited for the host there). Without the
 * variable every call returns at once; only step S pays for the events (microseconds). */
#ifndef MESHTRAIN_TRACE_H
#define MESHTRAIN_TRACE_H
#include <stddef.h>

/* At a step's start (step counts from 1): arms tracing if it is step S; marks the start. */
void trace_step(int step);
int trace_active(void);
/* A point on the compute stream (stream NULL) or on the given CUDA stream. */
void trace_mark(void *stream, const char *label);
/* A collective of `bytes` on `stream` (NULL: the compute stream; also a wait there): call
 * _begin when the stream has waited for its inputs, _end after it is enqueued. Returns a
 * handle for _end (-1 when not tracing). */
int trace_span_begin(void *stream, const char *what, size_t bytes);
void trace_span_end(void *stream, int span);
/* After the traced step's synchronize: prints the timeline and disarms. */
void trace_dump(int rank);

#endif
