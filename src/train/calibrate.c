#include "calibrate.h"
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "comm.h"
#include "env.h"
#include "ops.h"
#include "plan.h"
#include "profile.h"
#include "util.h"

/* Each figure is the fastest of repetitions after two warm-ups, repeated until they add up
 * to MIN_SECONDS (at least MIN_REPS, at most MAX_REPS). The fastest, not the median: on a
 * shared machine a repetition can only lose time (a thread of the op's team preempted, its
 * wake-up after the buffers were filled), and the median of a few short ones was 20x an op's
 * time inside a training step. */
#define MIN_SECONDS 0.05
#define MIN_REPS 3
#define MAX_REPS 50
#define WARM_SECONDS 0.15

typedef struct { void *a[8]; float *f[3]; int *ids; } Bufs;

static void *filled(size_t n, unsigned *seed) {
    float *h = xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) h[i] = ((float)(rand_r(seed) % 2001) - 1000.0f) * 1e-4f;
    void *d = op_alloc(n * ops_act_size());
    op_upload_state(d, h, n);  /* (fp32 on the cpu; the values only need to be ordinary numbers) */
    free(h);
    return d;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Runs one op of profile.h's names at shape d once (buffers from alloc_for). */
static void run_op(const char *name, const long *d, Bufs *b) {
    int a = (int)d[0], c = (int)d[1], e = (int)d[2], f = (int)d[3];
    if (!strcmp(name, "matmul_forward")) op_matmul_forward(b->a[0], b->a[1], b->a[2], a, c, e);
    else if (!strcmp(name, "matmul_backward")) op_matmul_backward(b->a[0], b->a[3], b->a[1], b->a[4], b->a[2], a, c, e);
    else if (!strcmp(name, "attention_forward")) op_attention_forward(b->a[0], b->f[0], b->a[1], a, c, e, f);
    else if (!strcmp(name, "attention_backward"))
        op_attention_rope_backward_set(b->a[0], b->a[1], b->a[2], b->a[3], b->f[0], b->f[1], b->f[2], a, c, e, f);
    else if (!strcmp(name, "rope_forward")) op_rope_forward(b->a[0], b->f[1], b->f[2], a, c, e, f);
    else if (!strcmp(name, "rmsnorm_forward")) op_rmsnorm_forward(b->a[0], b->f[0], b->a[1], b->a[2], a, c, MODEL_RMS_EPS);
    else if (!strcmp(name, "add_rmsnorm_forward"))
        op_add_rmsnorm_forward(b->a[0], b->a[1], b->f[0], b->a[3], b->a[2], a, c, MODEL_RMS_EPS);
    else if (!strcmp(name, "rmsnorm_backward")) op_rmsnorm_backward(b->a[0], b->a[3], b->a[1], b->a[4], b->a[2], b->f[0], a, c);
    else if (!strcmp(name, "swiglu_forward")) op_swiglu_forward(b->a[0], b->a[1], a, c);
    else if (!strcmp(name, "swiglu_backward")) op_swiglu_backward_set(b->a[0], b->a[1], b->a[2], a, c);
    else if (!strcmp(name, "crossentropy")) op_crossentropy_forward_backward(b->f[0], b->a[0], b->ids, a, c, 1e-3f);
    else if (!strcmp(name, "embedding_forward")) op_embedding_forward(b->a[0], b->ids, b->a[1], a, c);
    else if (!strcmp(name, "embedding_backward")) op_embedding_backward(b->a[1], b->a[0], b->ids, a, c);
    else if (!strcmp(name, "adamw")) op_adamw(b->a[0], b->a[1], b->a[2], b->a[3], (size_t)a, 1e-4f, 0.9f, 0.999f, 1e-8f, 0.01f, 1, 1);
}

/* Buffers large enough for the op at shape d (each the largest operand it may touch). */
static void alloc_for(const char *name, const long *d, Bufs *b, int vocab, unsigned *seed) {
    memset(b, 0, sizeof *b);
    size_t a = (size_t)d[0], c = (size_t)d[1], e = (size_t)d[2], f = (size_t)d[3];
    size_t big = a * c, rows = a;
    if (!strncmp(name, "matmul", 6)) {  /* out or dinp, dout: [N, OC] or [N, C]; w, dw: [OC, C]; inp [N, C] */
        size_t io = a * (e > c ? e : c);
        b->a[0] = filled(io, seed), b->a[1] = filled(io, seed), b->a[2] = filled(e * c, seed);
        b->a[3] = filled(e * c, seed), b->a[4] = filled(a * c, seed);
        return;
    }
    if (!strncmp(name, "attention", 9) || !strcmp(name, "rope_forward")) {
        big = a * c * 3 * e * f, rows = a * e * c;
        for (int i = 0; i < 4; i++) b->a[i] = filled(big, seed);
        b->f[0] = xcalloc(rows, sizeof(float));
        b->f[1] = xcalloc(c * f, sizeof(float)), b->f[2] = xcalloc(c * f, sizeof(float));
        op_rope_tables(b->f[1], b->f[2], (int)c, (int)f, MODEL_ROPE_BASE);
        if (ops_host_memory() == 0) {  /* the tables and statistics live on the device */
            float *h[3] = {b->f[0], b->f[1], b->f[2]};
            size_t n[3] = {rows, c * f, c * f};
            for (int i = 0; i < 3; i++) {
                b->f[i] = op_alloc(n[i] * sizeof(float));
                op_upload(b->f[i], h[i], n[i] * sizeof(float));
                free(h[i]);
            }
        }
        if (!strcmp(name, "attention_backward")) op_attention_forward(b->a[3], b->f[0], b->a[2], (int)a, (int)c, (int)e, (int)f);
        return;
    }
    if (!strncmp(name, "swiglu", 6)) big = a * 2 * c;
    if (!strcmp(name, "adamw")) big = a;
    if (!strncmp(name, "embedding", 9)) big = (size_t)vocab * c > a * c ? (size_t)vocab * c : a * c;
    for (int i = 0; i < 5; i++) b->a[i] = filled(big, seed);
    b->f[0] = ops_host_memory() ? xcalloc(rows, sizeof(float)) : op_alloc(rows * sizeof(float));
    int *ids = xmalloc(rows * sizeof(int));
    int top = !strcmp(name, "crossentropy") ? (int)c : vocab;
    for (size_t i = 0; i < rows; i++) ids[i] = (int)(rand_r(seed) % (unsigned)(top > 0 ? top : 1));
    b->ids = op_alloc(rows * sizeof(int));
    op_upload(b->ids, ids, rows * sizeof(int));
    free(ids);
    if (!strcmp(name, "rmsnorm_backward")) op_rmsnorm_forward(b->a[3], b->f[0], b->a[4], b->a[2], (int)a, (int)c, MODEL_RMS_EPS);
}

static void free_bufs(Bufs *b) {
    for (int i = 0; i < 8; i++) op_free(b->a[i]);
    for (int i = 0; i < 3; i++) {
        if (ops_host_memory()) free(b->f[i]);
        else op_free(b->f[i]);
    }
    op_free(b->ids);
}

typedef void (*Fn)(void *ctx);
/* reps > 0: exactly that many (a collective: every rank must call it as often) */
static double timed_n(Fn fn, void *ctx, int reps) {
    double t[MAX_REPS], total = 0;
    int n = 0;
    /* warm-ups: first touches, and the op's thread team running on its cores (on a loaded
     * machine a team that slept while the buffers were filled takes a scheduler's slice,
     * ~10 ms, for each of its first parallel regions; a training step keeps it awake) */
    double w0 = now_seconds();
    for (int i = 0; i < 2 || (reps == 0 && i < 2000 && now_seconds() - w0 < WARM_SECONDS); i++) fn(ctx);
    ops_synchronize();
    while (reps > 0 ? n < reps : n < MAX_REPS && (n < MIN_REPS || total < MIN_SECONDS)) {
        double t0 = now_seconds();
        fn(ctx);
        ops_synchronize();
        t[n] = now_seconds() - t0;
        total += t[n++];
    }
    qsort(t, (size_t)n, sizeof(double), cmp_d);
    return reps > 0 ? t[n / 2] : t[0];  /* (a collective's median: its ranks wait for each other) */
}
static double timed(Fn fn, void *ctx) { return timed_n(fn, ctx, 0); }

typedef struct { const char *name; const long *d; Bufs *b; } OpRun;
static void op_once(void *ctx) {
    OpRun *r = ctx;
    run_op(r->name, r->d, r->b);
}

typedef struct { void *dst, *src; size_t n; int dir; } Copy;
static void copy_once(void *ctx) {
    Copy *c = ctx;
    if (c->dir == 0) memcpy(c->dst, c->src, c->n);
    else if (c->dir == 1) op_upload(c->dst, c->src, c->n);
    else op_download(c->dst, c->src, c->n);
}

/* ---- collectives: under mpirun, every group of the first g ranks ---- */

typedef struct { const Comm *c; float *buf, *recv; size_t n; int kind; double t; } CollRun;
static void coll_call(CollRun *r) {
    if (r->kind == COLL_ALLREDUCE) comm_allreduce(r->c, r->buf, r->n, COMM_SUM);
    else if (r->kind == COLL_ALLGATHER) comm_allgather(r->c, r->buf, r->n / (size_t)r->c->size);
    else if (r->kind == COLL_REDUCE_SCATTER) comm_reduce_scatter(r->c, r->buf, r->recv, r->n / (size_t)r->c->size, COMM_SUM);
    else if (r->c->rank == 0) comm_send(r->c, r->buf, r->n * 4, 1, 7), comm_recv(r->c, r->buf, r->n * 4, 1, 7);
    else if (r->c->rank == 1) comm_recv(r->c, r->buf, r->n * 4, 0, 7), comm_send(r->c, r->buf, r->n * 4, 0, 7);
}

/* Each collective after a millisecond of computing, as a training step's come after its ops:
 * a peer that computed is not waiting hot in the collective, and on a loaded machine the
 * time until every rank is there is what a step pays. Only the collective is timed (r->t). */
static volatile double g_sink;
static void coll_once(void *ctx) {
    CollRun *r = ctx;
    double t0 = now_seconds(), x = 0;
    while (now_seconds() - t0 < 1e-3) x += 1e-9;
    g_sink = x;
    t0 = now_seconds();
    coll_call(r);
    r->t += now_seconds() - t0;
}

/* latency + bytes / rate: the rate between the two larger sizes, the latency what the
 * smallest leaves (a least-squares line lets the large sizes decide the latency too, which
 * small messages, tensor parallel's, then miss) */
static void fit(const double *bytes, const double *t, int n, double *lat, double *bw) {
    double slope = (t[n - 1] - t[n - 2]) / (bytes[n - 1] - bytes[n - 2]);
    if (slope <= 0) slope = t[n - 1] / bytes[n - 1];
    *bw = 1 / slope;
    *lat = t[0] - bytes[0] * slope;
    if (*lat < 0.1 * t[0]) *lat = 0.1 * t[0];
}

static int collectives(const char *out) {
    Comm world;
    comm_world_init(&world, 600);
    set_log_rank(world.rank, world.size);
    Profile p;
    char err[512];
    int have = world.rank == 0 && access(out, F_OK) == 0 && profile_read(&p, out, err, sizeof err) == 0;
    if (world.rank == 0 && !have) profile_init(&p, "cpu", omp_get_num_procs());
    static const size_t sizes[] = {1024, 65536, 1048576};  /* floats */
    float *buf = xcalloc(sizes[2], sizeof(float)), *recv = xcalloc(sizes[2], sizeof(float));
    for (int g = 2; g <= world.size; g++) {
        Comm sub;
        comm_split(&world, world.rank < g ? 0 : 1, world.rank, "calibrate", &sub);
        if (world.rank < g)
            for (int k = 0; k < COLL_KINDS; k++) {
                if (k == COLL_SENDRECV && g > 2) continue;  /* (a message between two ranks) */
                double bytes[3], t[3];
                for (int i = 0; i < 3; i++) {
                    size_t n = sizes[i] / (size_t)g * (size_t)g;
                    int reps = i < 2 ? 30 : 10;
                    CollRun r = {&sub, buf, recv, n, k, 0};
                    coll_once(&r);
                    r.t = 0;
                    for (int j = 0; j < reps; j++) coll_once(&r);
                    t[i] = r.t / reps;
                    if (k == COLL_SENDRECV) t[i] /= 2;  /* (there and back) */
                    bytes[i] = (double)n * 4;
                }
                double lat, bw;
                fit(bytes, t, 3, &lat, &bw);
                if (world.rank == 0) profile_add_coll(&p, (CollKind)k, g, lat, bw);
            }
        comm_barrier(&world);
        comm_free(&sub);
    }
    free(buf);
    free(recv);
    int rc = 0;
    if (world.rank == 0) {
        if (profile_write(&p, out, err, sizeof err)) fprintf(stderr, "meshtrain: %s\n", err), rc = EXIT_RUN_FAILURE;
        for (int i = 0; i < p.n_coll; i++)
            printf("  %-14s over %d ranks: %7.1f us + bytes at %6.2f GB/s\n", coll_kind_name((CollKind)p.coll[i].kind),
                   p.coll[i].ranks, p.coll[i].lat * 1e6, p.coll[i].bw / 1e9);
        profile_free(&p);
    }
    comm_world_finalize();
    return rc;
}

/* The child that times the collectives: this program again, under mpirun over `ranks`. */
static int spawn_collectives(const Config *c, int ranks, const char *out) {
    char self[1024], np[16], a_out[600], a_dev[32];
    if (self_exe(self, sizeof self)) return -1;
    snprintf(np, sizeof np, "%d", ranks);
    snprintf(a_out, sizeof a_out, "out=%s", out);
    snprintf(a_dev, sizeof a_dev, "device=%s", c->device);
    char *argv[] = {"mpirun", "-np", np, "--bind-to", "none", "--oversubscribe", self, "calibrate", a_out, a_dev, NULL};
    return run_child(argv, NULL) == 0 ? 0 : -1;
}

int calibrate_run(const Config *c, const char *model, const Cluster *cl, const char *out) {
    int rank, size;
    if (env_launcher(&rank, &size) && size > 1) return collectives(out);
    if (c->global_batch <= 0)
        die(EXIT_BAD_INPUT, "calibrate: give global_batch= (the shapes measured are those the layouts of that batch need)");
    char err[512];
    if (ops_init(c->device, 0, err, sizeof err)) die(EXIT_BAD_INPUT, "calibrate: %s", err);
    int gpu = cl->gpu;
    /* the shapes: every op the cost model asks for over the plan's layouts */
    Profile want;
    profile_init(&want, c->device, cl->cores);
    want.collect = 1;
    PlanList pl;
    double t0 = now_seconds();
    plan_enumerate(model, c, cl, &want, &pl);
    plan_list_free(&pl);
    Profile p;
    profile_init(&p, c->device, cl->cores);
    if (access(out, F_OK) == 0 && profile_read(&p, out, err, sizeof err) == 0 && strcmp(p.device, c->device)) {
        profile_free(&p);
        profile_init(&p, c->device, cl->cores);
    }
    p.cores = cl->cores;
    printf("calibrate: %d op shapes the layouts need (device=%s, %d cores)\n", want.n_wanted, c->device, cl->cores);
    unsigned seed = 1;
    /* CPU: every shape on one thread, then each thread count's speedup on the largest product
     * the layouts run (a small op timed alone on a team of threads on a loaded machine waits
     * for its threads to be scheduled, ~10 ms a call, which a training step's busy team does not) */
    if (!gpu && ops_init("cpu", 1, err, sizeof err)) die(EXIT_BAD_INPUT, "calibrate: %s", err);
    int biggest = -1, threads_wanted[PROF_MAX_THREADS + 1] = {0};
    double most = 0;
    for (int i = 0; i < want.n_wanted; i++) {
        const ProfOp *o = &want.wanted[i];
        if (!strcmp(o->name, "adamw_host")) continue;  /* (below) */
        int th = gpu ? 0 : 1;
        if (!gpu && o->threads > 1 && o->threads <= PROF_MAX_THREADS) threads_wanted[o->threads] = 1;
        int done = 0;
        for (int j = 0; j < p.n_ops && !done; j++)
            done = !strcmp(p.ops[j].name, o->name) && p.ops[j].threads == th && !memcmp(p.ops[j].d, o->d, sizeof o->d);
        if (done) continue;
        Bufs b;
        alloc_for(o->name, o->d, &b, c->vocab_size, &seed);
        OpRun r = {o->name, o->d, &b};
        double t = timed(op_once, &r);
        free_bufs(&b);
        profile_add_op(&p, o->name, th, o->d, t);
        if (!strncmp(o->name, "matmul_forward", 14) && (double)o->d[0] * o->d[1] * o->d[2] > most)
            most = (double)o->d[0] * o->d[1] * o->d[2], biggest = i;
    }
    for (int th = 2; !gpu && biggest >= 0 && th <= PROF_MAX_THREADS; th++) {
        if (!threads_wanted[th]) continue;
        const ProfOp *o = &want.wanted[biggest];
        Bufs b;
        alloc_for(o->name, o->d, &b, c->vocab_size, &seed);
        OpRun r = {o->name, o->d, &b};
        /* three rounds of one thread against th, the best ratio: a loaded machine's other work
         * comes and goes between the two timings, and only ever slows one of them */
        double best = 0;
        for (int round = 0; round < 3; round++) {
            if (ops_init("cpu", 1, err, sizeof err)) die(EXIT_BAD_INPUT, "calibrate: %s", err);
            double t1 = timed(op_once, &r);
            if (ops_init("cpu", th, err, sizeof err)) die(EXIT_BAD_INPUT, "calibrate: %s", err);
            double tt = timed(op_once, &r);
            if (t1 / tt > best) best = t1 / tt;
        }
        free_bufs(&b);
        p.speedup[th] = best;
        printf("  %d threads: %.2fx one thread's speed (%s at %ld x %ld x %ld)\n", th, p.speedup[th], o->name, o->d[0],
               o->d[1], o->d[2]);
    }
    /* host copies (offload on the cpu; the gradients zeroed), and on a GPU the copies both ways */
    size_t n = (size_t)64 << 20;
    char *h1 = xcalloc(n, 1), *h2 = xcalloc(n, 1);
    Copy cp = {h1, h2, n, 0};
    p.copy = (double)n / timed(copy_once, &cp);
    if (gpu) {
        void *d = op_alloc(n), *pin = op_host_alloc(n);
        Copy up = {d, pin ? pin : h1, n, 1}, down = {pin ? pin : h1, d, n, 2};
        p.h2d = (double)n / timed(copy_once, &up);
        p.d2h = (double)n / timed(copy_once, &down);
        op_free(d);
        if (pin) op_host_free(pin);
        /* offload's optimizer runs on the host's cores: the cpu backend's AdamW there */
        for (int i = 0; i < want.n_wanted; i++) {
            const ProfOp *o = &want.wanted[i];
            if (strcmp(o->name, "adamw_host")) continue;
            size_t m = (size_t)o->d[0];
            float *a[4];
            for (int j = 0; j < 4; j++) a[j] = xcalloc(m, sizeof(float));
            omp_set_num_threads(o->threads > 0 ? o->threads : 1);
            double ts = now_seconds();
            ops_backend_cpu.adamw(a[0], a[1], a[2], a[3], m, 1e-4f, 0.9f, 0.999f, 1e-8f, 0.01f, 1, 1);
            profile_add_op(&p, o->name, o->threads, o->d, now_seconds() - ts);
            for (int j = 0; j < 4; j++) free(a[j]);
        }
    }
    free(h1);
    free(h2);
    profile_free(&want);
    printf("  %d op shapes measured in %.1f s; host copies %.2f GB/s", p.n_ops, now_seconds() - t0, p.copy / 1e9);
    if (gpu) printf(", host to device %.2f GB/s, back %.2f GB/s", p.h2d / 1e9, p.d2h / 1e9);
    printf("\n");
    if (profile_write(&p, out, err, sizeof err)) die(EXIT_RUN_FAILURE, "%s", err);
    profile_free(&p);
    /* the collectives of CPU ranks: groups of 2 .. devices_per_host, in a child under mpirun */
    if (!gpu && cl->per_host > 1) {
        printf("collectives over 2 to %d CPU ranks (mpirun):\n", cl->per_host);
        if (spawn_collectives(c, cl->per_host, out))
            die(EXIT_RUN_FAILURE, "calibrate: the collectives' run under mpirun failed (is mpirun on the PATH? as root "
                "Open MPI wants OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)");
    } else if (gpu) {
        printf("(collectives between GPUs are not timed here: the plan uses link_intra= and link_inter=, or the defaults)\n");
    }
    printf("profile: %s\n", out);
    return 0;
}
