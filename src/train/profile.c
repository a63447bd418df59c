#include "profile.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "util.h"

/* The stated defaults, used where a profile has no figure for an op or collective (and said
 * so in the plan). CPU: one core of the 2-core development machine (an AMD EPYC) running the
 * cpu backend, rounded down; GPU: an H100's sustained (not peak) bf16 rates. */
static const struct {
    const char *device;
    double matmul, attention, bandwidth;  /* per thread on the cpu: FLOP/s, FLOP/s, bytes/s */
    double coll_lat, coll_bw, copy, h2d;  /* seconds; bytes/s */
} DEFAULTS[] = {
    {"cpu", 12e9, 3e9, 2e9, 30e-6, 3e9, 4e9, 4e9},
    {"cuda", 600e12, 350e12, 2.5e12, 15e-6, 150e9, 1e12, 25e9},
};

static int dflt(const Profile *p) { return strcmp(p->device, "cuda") == 0; }

const char *coll_kind_name(CollKind k) {
    static const char *n[] = {"allreduce", "allgather", "reduce_scatter", "sendrecv"};
    return n[k];
}

/* An op's work at shape d: FLOPs (*flops = 1) or bytes moved (fp32), the measure its time
 * scales with across shapes. */
static double op_work(const char *name, const long *d, int *flops) {
    double a = (double)d[0], b = (double)d[1], c = (double)d[2], e = (double)d[3];
    *flops = 1;
    if (!strcmp(name, "matmul_forward")) return 2 * a * b * c;
    if (!strcmp(name, "matmul_backward")) return 4 * a * b * c;
    if (!strcmp(name, "attention_forward")) return 2 * a * c * b * b * e;  /* B NH T^2 HD: causal halves QK and PV */
    if (!strcmp(name, "attention_backward")) return 5 * a * c * b * b * e;
    *flops = 0;
    if (!strcmp(name, "rope_forward")) return 16 * a * b * c * e;
    if (!strcmp(name, "rmsnorm_forward") || !strcmp(name, "embedding_forward") || !strcmp(name, "embedding_backward"))
        return 8 * a * b;
    if (!strcmp(name, "add_rmsnorm_forward") || !strcmp(name, "rmsnorm_backward")) return 16 * a * b;
    if (!strcmp(name, "swiglu_forward")) return 12 * a * b;
    if (!strcmp(name, "swiglu_backward")) return 20 * a * b;
    if (!strcmp(name, "crossentropy")) return 8 * a * b;
    if (!strcmp(name, "adamw")) return 28 * a;
    return 4 * a;
}

void profile_init(Profile *p, const char *device, int cores) {
    memset(p, 0, sizeof *p);
    snprintf(p->device, sizeof p->device, "%s", device);
    p->cores = cores;
}

void profile_free(Profile *p) {
    for (int i = 0; i < p->n_runs; i++) free(p->runs[i].keys);
    free(p->ops); free(p->coll); free(p->runs); free(p->wanted);
    memset(p, 0, sizeof *p);
}

static void push_op(ProfOp **v, int *n, int *cap, const char *name, int threads, const long d[4], double s) {
    if (*n == *cap) *cap = *cap ? 2 * *cap : 64, *v = xrealloc(*v, (size_t)*cap * sizeof **v);
    ProfOp *o = &(*v)[(*n)++];
    memset(o, 0, sizeof *o);
    snprintf(o->name, sizeof o->name, "%s", name);
    o->threads = threads;
    memcpy(o->d, d, sizeof o->d);
    o->s = s;
}

void profile_add_op(Profile *p, const char *name, int threads, const long d[4], double s) {
    for (int i = 0; i < p->n_ops; i++) {
        ProfOp *o = &p->ops[i];
        if (!strcmp(o->name, name) && o->threads == threads && !memcmp(o->d, d, sizeof o->d)) { o->s = s; return; }
    }
    push_op(&p->ops, &p->n_ops, &p->cap_ops, name, threads, d, s);
}

void profile_add_coll(Profile *p, CollKind kind, int ranks, double lat, double bw) {
    for (int i = 0; i < p->n_coll; i++)
        if (p->coll[i].kind == (int)kind && p->coll[i].ranks == ranks) { p->coll[i].lat = lat, p->coll[i].bw = bw; return; }
    if (p->n_coll == p->cap_coll) p->cap_coll = p->cap_coll ? 2 * p->cap_coll : 16, p->coll = xrealloc(p->coll, (size_t)p->cap_coll * sizeof *p->coll);
    p->coll[p->n_coll++] = (ProfColl){(int)kind, ranks, lat, bw};
}

static char *dup_text(const char *s) {
    size_t n = strlen(s) + 1;
    return memcpy(xmalloc(n), s, n);
}

void profile_add_run(Profile *p, double s, double predicted, int world, const char *keys) {
    for (int i = 0; i < p->n_runs; i++)
        if (p->runs[i].world == world && !strcmp(p->runs[i].keys, keys)) { p->runs[i].s = s, p->runs[i].predicted = predicted; return; }
    if (p->n_runs == p->cap_runs) p->cap_runs = p->cap_runs ? 2 * p->cap_runs : 8, p->runs = xrealloc(p->runs, (size_t)p->cap_runs * sizeof *p->runs);
    p->runs[p->n_runs++] = (ProfRun){s, predicted, world, dup_text(keys)};
}

int profile_read(Profile *p, const char *path, char *err, size_t errlen) {
    size_t len;
    char rerr[512];
    char *text = read_file(path, &len, rerr, sizeof rerr);
    if (!text) return set_err(err, errlen, "profile=%s: %s", path, rerr);
    profile_init(p, "cpu", 0);
    int line_no = 0, rc = 0;
    for (char *s = text, *end = text + len; s < end && !rc;) {
        char *nl = memchr(s, '\n', (size_t)(end - s));
        if (nl) *nl = 0;
        line_no++;
        char name[64], what[64];
        long d[4];
        int th, n, ranks, world;
        double x, y;
        while (*s == ' ' || *s == '\t') s++;
        if (!*s || *s == '#') {
        } else if (sscanf(s, "device %7s %n", p->device, &n) == 1) {
            if (strcmp(p->device, "cpu") && strcmp(p->device, "cuda")) rc = -1;
        } else if (sscanf(s, "cores %d %n", &p->cores, &n) == 1) {
        } else if (sscanf(s, "op %31s %d %ld %ld %ld %ld %lf %n", name, &th, &d[0], &d[1], &d[2], &d[3], &x, &n) == 7 && x >= 0) {
            profile_add_op(p, name, th, d, x);
        } else if (sscanf(s, "coll %31s %d %lf %lf %n", what, &ranks, &x, &y, &n) == 4 && y > 0) {
            int k = 0;
            while (k < COLL_KINDS && strcmp(coll_kind_name((CollKind)k), what)) k++;
            if (k == COLL_KINDS) rc = -1;
            else profile_add_coll(p, (CollKind)k, ranks, x, y);
        } else if (sscanf(s, "rate %31s %lf %n", what, &x, &n) == 2 && x > 0) {
            if (!strcmp(what, "copy")) p->copy = x;
            else if (!strcmp(what, "h2d")) p->h2d = x;
            else if (!strcmp(what, "d2h")) p->d2h = x;
            else rc = -1;
        } else if (sscanf(s, "speedup %d %lf %n", &th, &x, &n) == 2 && th > 1 && th <= PROF_MAX_THREADS && x > 0) {
            p->speedup[th] = x;
        } else if (sscanf(s, "measured %lf %lf %d %n", &x, &y, &world, &n) == 3 && x > 0) {
            profile_add_run(p, x, y, world, s + n);
        } else {
            rc = -1;
        }
        s = nl ? nl + 1 : end;
    }
    free(text);
    if (rc) {
        profile_free(p);
        return set_err(err, errlen, "profile=%s line %d: not a profile record (see docs/plan.md)", path, line_no);
    }
    return 0;
}

/* Formatted in memory, then written atomically: a plan's try= rewrites the profile it read,
 * which an interrupted write must not leave half written. */
int profile_write(const Profile *p, const char *path, char *err, size_t errlen) {
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) return set_err(err, errlen, "cannot write the profile %s", path);
    fprintf(f, "# meshtrain profile (meshtrain calibrate; docs/plan.md says what each record is)\n");
    fprintf(f, "device %s\ncores %d\n", p->device, p->cores);
    if (p->copy > 0) fprintf(f, "rate copy %.6g\n", p->copy);
    if (p->h2d > 0) fprintf(f, "rate h2d %.6g\n", p->h2d);
    if (p->d2h > 0) fprintf(f, "rate d2h %.6g\n", p->d2h);
    for (int t = 2; t <= PROF_MAX_THREADS; t++)
        if (p->speedup[t] > 0) fprintf(f, "speedup %d %.6g\n", t, p->speedup[t]);
    for (int i = 0; i < p->n_coll; i++)
        fprintf(f, "coll %s %d %.6g %.6g\n", coll_kind_name((CollKind)p->coll[i].kind), p->coll[i].ranks, p->coll[i].lat,
                p->coll[i].bw);
    for (int i = 0; i < p->n_ops; i++) {
        const ProfOp *o = &p->ops[i];
        fprintf(f, "op %s %d %ld %ld %ld %ld %.6g\n", o->name, o->threads, o->d[0], o->d[1], o->d[2], o->d[3], o->s);
    }
    for (int i = 0; i < p->n_runs; i++)
        fprintf(f, "measured %.6g %.6g %d %s\n", p->runs[i].s, p->runs[i].predicted, p->runs[i].world, p->runs[i].keys);
    int bad = ferror(f);
    bad |= fclose(f) != 0;
    char werr[512];
    if (!bad && write_file_atomic(path, text, len, werr, sizeof werr)) {
        free(text);
        return set_err(err, errlen, "cannot write the profile %s: %s", path, werr);
    }
    free(text);
    return bad ? set_err(err, errlen, "cannot write the profile %s", path) : 0;
}

void profile_tally_reset(Profile *p) {
    memset(p->tally_ops, 0, sizeof p->tally_ops);
    memset(p->tally_coll, 0, sizeof p->tally_coll);
}

/* The op's time from the records (src: what it came from). */
static double lookup(const Profile *p, const char *name, int threads, const long d[4], ProfSource *src) {
    int flops;
    double work = op_work(name, d, &flops);
    /* the shape itself; else the same op and widths at the nearest sizes (d[0]: tokens or
     * sequences), interpolated; else the same op at its nearest work, scaled by the work and
     * the threads */
    const ProfOp *lo = NULL, *hi = NULL, *near = NULL;
    double near_gap = INFINITY;
    for (int i = 0; i < p->n_ops; i++) {
        const ProfOp *o = &p->ops[i];
        if (strcmp(o->name, name)) continue;
        if (o->threads == threads && !memcmp(o->d, d, 4 * sizeof(long))) { *src = SRC_MEASURED; return o->s; }
        if (o->threads == threads && !memcmp(o->d + 1, d + 1, 3 * sizeof(long))) {
            if (o->d[0] < d[0] && (!lo || o->d[0] > lo->d[0])) lo = o;
            if (o->d[0] > d[0] && (!hi || o->d[0] < hi->d[0])) hi = o;
        }
        int f;
        double w = op_work(name, o->d, &f);
        double gap = fabs(log((w + 1) / (work + 1))) + (o->threads != threads ? 10 : 0);
        if (gap < near_gap) near_gap = gap, near = o;
    }
    *src = SRC_INTERPOLATED;
    if (lo && hi) {
        double t = (double)(d[0] - lo->d[0]) / (double)(hi->d[0] - lo->d[0]);
        return lo->s + t * (hi->s - lo->s);
    }
    if (lo || hi || near) {
        const ProfOp *o = lo ? lo : hi ? hi : near;
        int f;
        double w = op_work(name, o->d, &f), s = o->s * (w > 0 ? work / w : 1);
        if (o->threads > 0 && threads > 0) s *= (double)o->threads / threads;
        return s;
    }
    *src = SRC_DEFAULT;
    int g = dflt(p);
    double rate = flops ? (strstr(name, "attention") ? DEFAULTS[g].attention : DEFAULTS[g].matmul) : DEFAULTS[g].bandwidth;
    if (!g && threads > 0) rate *= threads;
    return work / rate + (g ? 5e-6 : 2e-6);  /* (a launch or a parallel region's start) */
}

double profile_op(Profile *p, const char *name, int threads, const long d[4]) {
    if (p->collect) {
        int seen = 0;
        for (int i = 0; i < p->n_wanted && !seen; i++)
            seen = !strcmp(p->wanted[i].name, name) && p->wanted[i].threads == threads && !memcmp(p->wanted[i].d, d, 4 * sizeof(long));
        if (!seen) push_op(&p->wanted, &p->n_wanted, &p->cap_wanted, name, threads, d, 0);
    }
    ProfSource src;
    double s = lookup(p, name, threads, d, &src);
    /* several threads: the one-thread figure over the measured speedup, where the shape has
     * none of its own on them */
    if (src != SRC_MEASURED && threads > 1 && threads <= PROF_MAX_THREADS && p->speedup[threads] > 0) {
        ProfSource one;
        double s1 = lookup(p, name, 1, d, &one);
        if (one != SRC_DEFAULT) s = s1 / p->speedup[threads], src = SRC_INTERPOLATED;
    }
    p->tally_ops[src]++;
    return s;
}

/* A ring's share of the buffer each rank sends: all-reduce 2 (g - 1) / g, the others (g - 1) / g. */
static double ring_factor(CollKind k, int g) {
    if (k == COLL_SENDRECV) return 1;
    return (k == COLL_ALLREDUCE ? 2.0 : 1.0) * (g - 1) / g;
}

double profile_coll(Profile *p, CollKind kind, int ranks, double bytes, double link_bw) {
    if (ranks <= 1 && kind != COLL_SENDRECV) return 0;
    const ProfColl *best = NULL;
    for (int i = 0; i < p->n_coll; i++) {
        const ProfColl *c = &p->coll[i];
        if (c->kind != (int)kind) continue;
        if (!best || abs(c->ranks - ranks) < abs(best->ranks - ranks)) best = c;
    }
    int g = dflt(p);
    double lat = DEFAULTS[g].coll_lat, bw = DEFAULTS[g].coll_bw / ring_factor(kind, ranks > 1 ? ranks : 2);
    ProfSource src = SRC_DEFAULT;
    if (best) {  /* another group size: its latency per ring step and its link rate */
        int r0 = best->ranks > 1 ? best->ranks : 2, r = ranks > 1 ? ranks : 2;
        double steps = kind == COLL_SENDRECV ? 1 : (double)(r - 1) / (r0 - 1);
        lat = best->lat * steps;
        bw = best->bw * ring_factor(kind, r0) / ring_factor(kind, r);
        src = best->ranks == ranks ? SRC_MEASURED : SRC_INTERPOLATED;
    }
    if (link_bw > 0) bw = link_bw / ring_factor(kind, ranks > 1 ? ranks : 2);  /* the cluster's stated link */
    p->tally_coll[src]++;
    return lat + bytes / bw;
}

double profile_rate(Profile *p, const char *name) {
    double v = !strcmp(name, "copy") ? p->copy : !strcmp(name, "h2d") ? p->h2d : p->d2h;
    if (v > 0) return v;
    return !strcmp(name, "copy") ? DEFAULTS[dflt(p)].copy : DEFAULTS[dflt(p)].h2d;
}

double profile_run_of(const Profile *p, int world, const char *keys) {
    for (int i = 0; i < p->n_runs; i++)
        if (p->runs[i].world == world && !strcmp(p->runs[i].keys, keys)) return p->runs[i].s;
    return 0;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double profile_correction(const Profile *p, int *n) {
    double *r = xmalloc(sizeof(double) * (size_t)(p->n_runs + 1));
    int k = 0;
    for (int i = 0; i < p->n_runs; i++)
        if (p->runs[i].predicted > 0) r[k++] = p->runs[i].s / p->runs[i].predicted;
    qsort(r, (size_t)k, sizeof(double), cmp_double);
    double c = k ? (k % 2 ? r[k / 2] : 0.5 * (r[k / 2 - 1] + r[k / 2])) : 1;
    free(r);
    if (n) *n = k;
    return c;
}
