/* util — small shared helpers: errors, allocation, checksums, timing, memory. */
#ifndef MESHTRAIN_UTIL_H
#define MESHTRAIN_UTIL_H
#include <stddef.h>
#include <stdint.h>

/* Exit codes: 2 for bad input (config, files, shapes), 1 for a failure during a run. */
enum { EXIT_BAD_INPUT = 2, EXIT_RUN_FAILURE = 1 };

/* Prints "meshtrain: <message>" on stderr (with "rank R: " when there are several ranks)
 * and exits with `code`. */
_Noreturn void die(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* This process's rank and the job's size, for messages (before MPI starts: the launcher's
 * view, env_launcher, so that errors met before then can be printed once). */
void set_log_rank(int rank, int world);
/* An error that every rank meets alike (a bad key, say): rank 0 prints it, the other ranks
 * exit with the same code without a word, a moment later so that the launcher does not
 * end rank 0 before it has printed. */
_Noreturn void die_once(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* A failure found during a run's set-up, kept to be agreed on by all ranks
 * (comm_exit_if_failed) before anything is printed: code 0 = none. */
typedef struct { int code; char msg[1024]; } Fail;
/* Records the first failure only; returns -1. */
int fail_set(Fail *f, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Prints "meshtrain: [rank R: ]msg" on stderr, rank given explicitly (the one that saw it). */
void print_error(int rank, int world, const char *msg);

/* Error reporting for library-style code: formats into a caller's buffer and returns -1. */
int set_err(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

void *xmalloc(size_t n);            /* dies with exit 2 ("cannot allocate N bytes") on failure */
void *xcalloc(size_t n, size_t sz); /* zeroed */
void *xrealloc(void *p, size_t n);
/* 64-byte aligned, zeroed; free with free(). Dies on failure. */
void *xaligned_alloc(size_t n);

/* Reads a whole file; NULL with err set when missing/unreadable. Caller frees. */
char *read_file(const char *path, size_t *len, char *err, size_t errlen);

/* A file written atomically: bytes go to "<path>.tmp.<pid>"; commit fsyncs it, renames it
 * over path and fsyncs the directory, so readers see the old file or the whole new one.
 * After the first failed write the rest are skipped and commit reports the error. */
typedef struct { int fd, err_no; char tmp[4200]; const char *path; } AtomicFile;
int atomic_open(AtomicFile *f, const char *path, char *err, size_t errlen);
void atomic_write(AtomicFile *f, const void *data, size_t len);
int atomic_commit(AtomicFile *f, char *err, size_t errlen);  /* also cleans up on failure */
/* Writes `len` bytes to path atomically (the three calls above). */
int write_file_atomic(const char *path, const void *data, size_t len, char *err, size_t errlen);

uint64_t fnv1a64(const void *data, size_t n, uint64_t h); /* start with FNV1A64_INIT */
#define FNV1A64_INIT 0xcbf29ce484222325ULL

double now_seconds(void);        /* monotonic clock */
/* This program's own path (/proc/self/exe) into buf; -1 where it cannot be read. */
int self_exe(char *buf, size_t len);
/* Runs argv (argv[0] searched on the PATH) as a child process, its stdout and stderr into the
 * file out_path (NULL: this process's), and waits for it: its exit status, or -1 where it
 * could not start or did not exit (a signal). */
int run_child(char *const argv[], const char *out_path);
long max_rss_bytes(void);        /* peak resident set size of this process */
long current_rss_bytes(void);    /* from /proc/self/statm */

/* Deterministic RNG (xorshift64* + Box-Muller), used for init and sampling. */
typedef struct { uint64_t s; } Rng;
void rng_seed(Rng *r, uint64_t seed);
uint64_t rng_u64(Rng *r);
float rng_uniform(Rng *r);       /* [0, 1) */
float rng_normal(Rng *r);        /* N(0, 1); draws exactly two rng_u64 */
/* Advances r as `steps` calls of rng_u64 would (xorshift is linear over GF(2): the step's
 * 64x64 bit matrix raised to `steps` by squaring), so that blocks of one stream can be
 * generated in parallel, or a shard of it alone. */
void rng_jump(Rng *r, uint64_t steps);

/* Formats 1234567 as "1,234,567" into buf (size >= 32). */
const char *fmt_commas(char *buf, long long v);
/* Formats bytes as "123.4 MiB". */
const char *fmt_bytes(char *buf, double bytes);
#endif
