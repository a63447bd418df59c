/* profile — what one machine's ops, collectives, copies and optimizer take, as `calibrate`
 * measured them, in a small text file; and the stated defaults where it has no figure. The
 * planner's cost model reads every time through here, and each lookup is counted as
 * measured (the shape itself), interpolated (the same op at other sizes or thread counts)
 * or a default, so a plan can say which of its numbers it measured.
 *
 * The file, one record a line ('#' starts a comment):
 *   device cpu|cuda                      cores N
 *   op NAME THREADS D0 D1 D2 D3 SECONDS  (an op at one shape; NAME as ops.h's, D unused = 0)
 *   coll KIND RANKS LATENCY_S BYTES_PER_S (allreduce, allgather, reduce_scatter, sendrecv: time = latency + bytes / rate,
 *                                          bytes the buffer's, the whole data for allgather and reduce_scatter)
 *   rate NAME BYTES_PER_S               (copy: host memory copies; h2d, d2h: host-device copies)
 *   speedup THREADS FACTOR              (CPU: an op on THREADS threads takes its one-thread time / FACTOR)
 *   measured SECONDS PREDICTED_S WORLD KEYS...   (a layout run by plan try=: its step and the model's prediction) */
#ifndef MESHTRAIN_PROFILE_H
#define MESHTRAIN_PROFILE_H
#include <stddef.h>

#define PROF_MAX_THREADS 256
typedef enum { SRC_MEASURED, SRC_INTERPOLATED, SRC_DEFAULT, SRC_KINDS } ProfSource;
typedef enum { COLL_ALLREDUCE, COLL_ALLGATHER, COLL_REDUCE_SCATTER, COLL_SENDRECV, COLL_KINDS } CollKind;

typedef struct { char name[32]; int threads; long d[4]; double s; } ProfOp;
typedef struct { int kind, ranks; double lat, bw; } ProfColl;
typedef struct { double s, predicted; int world; char *keys; } ProfRun;

typedef struct {
    char device[8];
    int cores;
    ProfOp *ops;
    int n_ops, cap_ops;
    ProfColl *coll;
    int n_coll, cap_coll;
    double copy, h2d, d2h;   /* bytes/s; 0: not measured */
    double speedup[PROF_MAX_THREADS + 1];  /* [t]: t threads over one on the largest product (0: not measured) */
    ProfRun *runs;
    int n_runs, cap_runs;
    /* what lookups found, since profile_tally_reset: ops and collectives by source */
    int tally_ops[SRC_KINDS], tally_coll[SRC_KINDS];
    /* collecting: every op lookup's shape is added to `wanted` (what calibrate should measure) */
    int collect;
    ProfOp *wanted;
    int n_wanted, cap_wanted;
} Profile;

/* An empty profile of the device (the defaults answer everything). */
void profile_init(Profile *p, const char *device, int cores);
/* Reads path into p (profile_init'ed by it); -1 with a one-line err naming the file and line. */
int profile_read(Profile *p, const char *path, char *err, size_t errlen);
/* Writes p whole; -1 with err. */
int profile_write(const Profile *p, const char *path, char *err, size_t errlen);
void profile_free(Profile *p);

void profile_add_op(Profile *p, const char *name, int threads, const long d[4], double s);
void profile_add_coll(Profile *p, CollKind kind, int ranks, double lat, double bw);
void profile_add_run(Profile *p, double s, double predicted, int world, const char *keys);
/* The time of op `name` at shape d on `threads` threads (0 on a GPU). A figure measured at
 * another size is scaled by the op's work (its FLOPs, or the bytes it moves), which is also
 * what the defaults divide; on several threads without a figure of their own, the one-thread
 * figure over the measured speedup. */
double profile_op(Profile *p, const char *name, int threads, const long d[4]);
/* A collective of `bytes` over `ranks` ranks; link_bw (bytes/s, 0: none given): the
 * cluster's stated bandwidth, which replaces the measured rate. */
double profile_coll(Profile *p, CollKind kind, int ranks, double bytes, double link_bw);
/* Bytes per second of a host memory copy, a host-to-device and a device-to-host copy. */
double profile_rate(Profile *p, const char *name);
/* A layout's measured step (profile_add_run's, same world and keys), or 0. */
double profile_run_of(const Profile *p, int world, const char *keys);
/* The median of measured over predicted of the runs folded in (1 without any), and their count. */
double profile_correction(const Profile *p, int *n);
void profile_tally_reset(Profile *p);
const char *coll_kind_name(CollKind k);
#endif
