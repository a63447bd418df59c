/* comm_hier — the hierarchical all-reduce (comm.h's comm_iallreduce_hier): a reduce-scatter
 * inside the machine, an all-reduce of the rank's block across machines, an all-gather inside
 * the machine. Only 1/node of the buffer crosses the slow link, from every rank at once.
 *
 * Each stage is a collective of its own (the rings of the transport), begun once the stage
 * before it is done, which a comm_test of the request finds out. The transports' rings are
 * matched by the order they are begun on a group, so each stage has a group of its own (the
 * machine's reduce-scatters on node, its all-gathers on node_gather, the all-reduces across on
 * cross), and the stages of all hierarchical all-reduces in flight are begun in the order the
 * all-reduces were: a stage of one is begun only after the same stage of every one begun
 * before it (the queue below), whichever request a rank happens to test first. */
#include <stdlib.h>
#include <string.h>
#include "comm_impl.h"
#include "util.h"

typedef struct Chain {
    const Comm *node, *node_gather, *cross;
    char *buf;
    size_t n, blk, esz;
    CommType t;
    CommOp op;
    const char *what;
    int stage;  /* the stage begun last: 0 reduce-scatter, 1 all-reduce, 2 all-gather; 3 done */
    CommReq sub;
    CommReq *owner;
} Chain;

/* the all-reduces in flight, in the order they were begun */
#define MAX_CHAINS 1024
static Chain *g_queue[MAX_CHAINS];
static int g_n;

static void begin_stage(Chain *c) {
    char *mine = c->buf + (size_t)c->node->rank * c->blk * c->esz;
    /* averages: inside the machine, then across (equal groups: the mean of all) */
    if (c->stage == 0) comm_ireduce_scatter(c->node, c->buf, mine, c->blk, c->t, c->op, &c->sub, c->what);
    else if (c->stage == 1) comm_iallreduce(c->cross, mine, c->blk, c->t, c->op, &c->sub, c->what);
    else comm_iallgather(c->node_gather, c->buf, c->blk, c->t, &c->sub, c->what);
}

/* Moves every chain as far as it may: chain i begins stage s only after chain i - 1 has. */
static void advance_all(void) {
    int prev_stage = 3;
    for (int i = 0; i < g_n; i++) {
        Chain *c = g_queue[i];
        while (c->stage < 3 && comm_test(&c->sub)) {
            if (c->stage + 1 < 3 && c->stage + 1 > prev_stage) break;  /* the one before has not begun it */
            if (++c->stage < 3) begin_stage(c);
        }
        prev_stage = c->stage;
    }
    /* finished chains leave the queue's front (those behind keep their order) */
    int k = 0;
    for (int i = 0; i < g_n; i++)
        if (g_queue[i]->stage < 3) g_queue[k++] = g_queue[i];
        else g_queue[i]->owner->active = 0;
    g_n = k;
}

void comm_iallreduce_hier(const Comm *node, const Comm *node_gather, const Comm *cross, void *buf, size_t n, CommType t,
                          CommOp op, CommReq *r, const char *what) {
    if (n % (size_t)node->size)
        die(EXIT_RUN_FAILURE, "internal: %s: %zu elements do not divide over %d ranks of a machine", what, n, node->size);
    if (g_n == MAX_CHAINS) comm_abort(EXIT_RUN_FAILURE, "internal: too many hierarchical all-reduces in flight");
    Chain *c = xcalloc(1, sizeof *c);
    *c = (Chain){node, node_gather, cross, buf, n, n / (size_t)node->size, type_size(t), t, op, what, 0, {0}, r};
    memset(r, 0, sizeof *r);
    r->c = node;
    r->what = what;
    r->active = 1;
    r->chain = c;
    g_queue[g_n++] = c;
    begin_stage(c);
    advance_all();
}

int comm_hier_test(CommReq *r) {
    Chain *c = r->chain;
    advance_all();
    if (r->active) return 0;
    free(c);
    r->chain = NULL;
    return 1;
}

int comm_split_hosts(const Comm *c, Comm *node, Comm *node_gather, Comm *cross) {
    int local, per, first = comm_host_first(c, &local, &per);
    /* every machine must hold as many of c's ranks, and more than one, and there must be more
     * than one machine */
    int lo = per, hi = per;
    comm_allreduce_min_int(c, &lo, 1);
    comm_allreduce_max_int(c, &hi, 1);
    int ok = lo == hi && per > 1 && per < c->size;
    comm_split(c, ok ? first : -1, local, "node", node);
    comm_split(c, ok ? first : -1, local, "node", node_gather);
    comm_split(c, ok ? local : -1, c->rank, "cross", cross);
    return ok;
}
