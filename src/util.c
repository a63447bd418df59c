#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "util.h"
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int g_rank, g_world = 1;
void set_log_rank(int rank, int world) { g_rank = rank; g_world = world; }

void print_error(int rank, int world, const char *msg) {
    if (world > 1) fprintf(stderr, "meshtrain: rank %d: %s\n", rank, msg);
    else fprintf(stderr, "meshtrain: %s\n", msg);
    fflush(stderr);
}

/* "meshtrain: [rank R: ]<formatted>" from this rank */
static void print_errorv(const char *fmt, va_list ap) {
    char msg[2048];
    vsnprintf(msg, sizeof msg, fmt, ap);
    print_error(g_rank, g_world, msg);
}

void die(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    print_errorv(fmt, ap);
    va_end(ap);
    exit(code);
}

void die_once(int code, const char *fmt, ...) {
    if (g_rank == 0) {
        va_list ap;
        va_start(ap, fmt);
        print_errorv(fmt, ap);
        va_end(ap);
    } else {
        struct timespec ts = {1, 0};
        nanosleep(&ts, NULL);
    }
    exit(code);
}

int fail_set(Fail *f, int code, const char *fmt, ...) {
    if (f->code) return -1;
    f->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(f->msg, sizeof f->msg, fmt, ap);
    va_end(ap);
    return -1;
}

int set_err(char *err, size_t errlen, const char *fmt, ...) {
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return -1;
}

void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) die(EXIT_BAD_INPUT, "cannot allocate %zu bytes: out of memory", n);
    return p;
}

void *xcalloc(size_t n, size_t sz) {
    void *p = calloc(n ? n : 1, sz ? sz : 1);
    if (!p) die(EXIT_BAD_INPUT, "cannot allocate %zu bytes: out of memory", n * sz);
    return p;
}

void *xrealloc(void *p, size_t n) {
    void *q = realloc(p, n ? n : 1);
    if (!q) die(EXIT_BAD_INPUT, "cannot allocate %zu bytes: out of memory", n);
    return q;
}

void *xaligned_alloc(size_t n) {
    size_t rounded = (n + 63) / 64 * 64;
    void *p = aligned_alloc(64, rounded ? rounded : 64);
    if (!p) die(EXIT_BAD_INPUT, "cannot allocate %zu bytes: out of memory", n);
    memset(p, 0, rounded ? rounded : 64);
    return p;
}

char *read_file(const char *path, size_t *len, char *err, size_t errlen) {
    FILE *f = fopen(path, "rb");
    if (!f) { set_err(err, errlen, "cannot open %s: %s", path, strerror(errno)); return NULL; }
    size_t cap = 1 << 16, n = 0;
    char *buf = xmalloc(cap + 1);
    for (;;) {
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (n < cap) break;
        cap *= 2;
        buf = xrealloc(buf, cap + 1);
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) { free(buf); set_err(err, errlen, "cannot read %s", path); return NULL; }
    buf[n] = 0;
    if (len) *len = n;
    return buf;
}

int atomic_open(AtomicFile *f, const char *path, char *err, size_t errlen) {
    f->path = path;
    f->err_no = 0;
    if (snprintf(f->tmp, sizeof f->tmp, "%s.tmp.%d", path, (int)getpid()) >= (int)sizeof f->tmp)
        return set_err(err, errlen, "path too long: %s", path);
    f->fd = open(f->tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (f->fd < 0) return set_err(err, errlen, "cannot create %s: %s", f->tmp, strerror(errno));
    return 0;
}

void atomic_write(AtomicFile *f, const void *data, size_t len) {
    const char *p = data;
    while (len && !f->err_no) {
        ssize_t w = write(f->fd, p, len > (1u << 30) ? (1u << 30) : len);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) { f->err_no = w < 0 ? errno : EIO; break; }
        p += w;
        len -= (size_t)w;
    }
}

int atomic_commit(AtomicFile *f, char *err, size_t errlen) {
    if (!f->err_no && fsync(f->fd) != 0) f->err_no = errno;
    if (close(f->fd) != 0 && !f->err_no) f->err_no = errno;
    if (f->err_no) {
        unlink(f->tmp);
        return set_err(err, errlen, "cannot write %s: %s", f->tmp, strerror(f->err_no));
    }
    if (rename(f->tmp, f->path) != 0) {
        int e = errno;
        unlink(f->tmp);
        return set_err(err, errlen, "cannot rename %s to %s: %s", f->tmp, f->path, strerror(e));
    }
    /* The rename is durable only once the directory entry is on disk. */
    char dirbuf[4200];
    snprintf(dirbuf, sizeof dirbuf, "%s", f->path);
    int dfd = open(dirname(dirbuf), O_RDONLY | O_DIRECTORY);
    if (dfd >= 0) { fsync(dfd); close(dfd); }
    return 0;
}

int write_file_atomic(const char *path, const void *data, size_t len, char *err, size_t errlen) {
    AtomicFile f;
    if (atomic_open(&f, path, err, errlen)) return -1;
    atomic_write(&f, data, len);
    return atomic_commit(&f, err, errlen);
}

uint64_t fnv1a64(const void *data, size_t n, uint64_t h) {
    const unsigned char *p = data;
    /* 8 independent-lane variant would be faster; checkpoints are small enough. */
    for (size_t i = 0; i < n; i++) { h ^= p[i]; h *= 0x100000001b3ULL; }
    return h;
}

double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

long max_rss_bytes(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss * 1024L;
}

long current_rss_bytes(void) {
    FILE *f = fopen("/proc/self/statm", "r");
    long pages = 0, rss = 0;
    if (f) {
        if (fscanf(f, "%ld %ld", &pages, &rss) != 2) rss = 0;
        fclose(f);
    }
    return rss * sysconf(_SC_PAGESIZE);
}

void rng_seed(Rng *r, uint64_t seed) {
    r->s = seed * 0x9E3779B97F4A7C15ULL + 0x2545F4914F6CDD1DULL;
    if (!r->s) r->s = 1;
    for (int i = 0; i < 4; i++) rng_u64(r);
}

/* One xorshift step of the state: rng_u64 takes it, rng_jump takes its powers. */
static uint64_t xs_step(uint64_t x) {
    x ^= x >> 12; x ^= x << 25; x ^= x >> 27;
    return x;
}

uint64_t rng_u64(Rng *r) {
    r->s = xs_step(r->s);
    return r->s * 0x2545F4914F6CDD1DULL;
}

/* The linear map with columns col (col[i] = image of bit i) applied to v. */
static uint64_t gf2_apply(const uint64_t col[64], uint64_t v) {
    uint64_t r = 0;
    for (int i = 0; v; i++, v >>= 1)
        if (v & 1) r ^= col[i];
    return r;
}

void rng_jump(Rng *r, uint64_t steps) {
    uint64_t p[64], q[64];  /* p = the step's matrix raised to 2^b */
    for (int i = 0; i < 64; i++) p[i] = xs_step(1ULL << i);
    for (; steps; steps >>= 1) {
        if (steps & 1) r->s = gf2_apply(p, r->s);
        if (steps > 1) {
            for (int i = 0; i < 64; i++) q[i] = gf2_apply(p, p[i]);
            memcpy(p, q, sizeof p);
        }
    }
}

float rng_uniform(Rng *r) { return (float)((rng_u64(r) >> 40) * (1.0 / 16777216.0)); }

float rng_normal(Rng *r) {
    double u1 = ((rng_u64(r) >> 11) + 1.0) * (1.0 / 9007199254740993.0);
    double u2 = (rng_u64(r) >> 11) * (1.0 / 9007199254740992.0);
    return (float)(sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2));
}

const char *fmt_commas(char *buf, long long v) {
    char tmp[32];
    int n = snprintf(tmp, sizeof tmp, "%lld", v < 0 ? -v : v), o = 0;
    if (v < 0) buf[o++] = '-';
    for (int i = 0; i < n; i++) {
        buf[o++] = tmp[i];
        if ((n - i - 1) % 3 == 0 && i != n - 1) buf[o++] = ',';
    }
    buf[o] = 0;
    return buf;
}

const char *fmt_bytes(char *buf, double b) {
    const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int i = 0;
    while (b >= 1024 && i < 4) { b /= 1024; i++; }
    snprintf(buf, 32, i ? "%.1f %s" : "%.0f %s", b, u[i]);
    return buf;
}

int self_exe(char *buf, size_t len) {
    ssize_t k = len ? readlink("/proc/self/exe", buf, len - 1) : -1;
    if (k <= 0) return -1;
    buf[k] = 0;
    return 0;
}

int run_child(char *const argv[], const char *out_path) {
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        if (out_path) {
            FILE *o = freopen(out_path, "w", stdout);
            if (o) dup2(fileno(stdout), 2);
        }
        execvp(argv[0], argv);
        _exit(127);
    }
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) < 0 || !WIFEXITED(status)) return -1;
    return WEXITSTATUS(status);
}
