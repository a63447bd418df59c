#include "schedule_sim.h"
#include <stdlib.h>
#include "util.h"

/* A sweep of the ranks runs each one's next actions while their inputs are done; an action
 * whose input is not yet computed stops that rank until a later sweep. Start times depend
 * only on the ends of the actions they wait for, so the sweeps' order does not change them. */
int schedule_simulate(const Schedule *sc, int p, const double *cost, double link, SimStep *out, FILE *trace) {
    int v = sc[0].chunks, m = sc[0].micro_batches, G = p * v;
    double *fend = xmalloc(sizeof(double) * (size_t)G * m), *bend = xmalloc(sizeof(double) * (size_t)G * m);
    double *free_at = xcalloc((size_t)p, sizeof(double)), *busy = xcalloc((size_t)p, sizeof(double));
    int *next = xcalloc((size_t)p, sizeof(int));
    for (int i = 0; i < G * m; i++) fend[i] = bend[i] = -1;
    for (int progress = 1; progress;) {
        progress = 0;
        for (int r = 0; r < p; r++) {
            const Schedule *s = &sc[r];
            while (next[r] < s->n) {
                Action a = s->actions[next[r]];
                if (a.kind != ACT_FORWARD && a.kind != ACT_BACKWARD && a.kind != ACT_WEIGHT) { next[r]++; continue; }
                int i = a.micro, g = a.chunk * p + r;
                double ready = free_at[r];
                if (a.kind == ACT_FORWARD && g > 0) {
                    double e = fend[(g - 1) * m + i];
                    if (e < 0) break;
                    if (e + link > ready) ready = e + link;
                }
                if (a.kind == ACT_BACKWARD) {
                    if (fend[g * m + i] < 0) break;
                    if (g < G - 1) {
                        double e = bend[(g + 1) * m + i];
                        if (e < 0) break;
                        if (e + link > ready) ready = e + link;
                    }
                }
                if (a.kind == ACT_WEIGHT && bend[g * m + i] < 0) break;
                double d = cost[g * 3 + (a.kind == ACT_FORWARD ? 0 : a.kind == ACT_BACKWARD ? 1 : 2)];
                if (a.kind == ACT_BACKWARD && !s->split_backward) d += cost[g * 3 + 2];
                if (trace)
                    fprintf(trace, "  rank %d %c%d.%d@%.2f\n", r, a.kind == ACT_FORWARD ? 'F' : a.kind == ACT_BACKWARD ? 'B' : 'W',
                            i, a.chunk, ready);
                free_at[r] = ready + d;
                busy[r] += d;
                if (a.kind == ACT_FORWARD) fend[g * m + i] = free_at[r];
                if (a.kind == ACT_BACKWARD) bend[g * m + i] = free_at[r];
                next[r]++;
                progress = 1;
            }
        }
    }
    int rc = 0;
    SimStep st = {0};
    for (int r = 0; r < p; r++) {
        if (next[r] < sc[r].n) rc = -1;
        if (free_at[r] > st.makespan) st.makespan = free_at[r];
        if (busy[r] > st.busy_max) st.busy_max = busy[r];
        st.busy_mean += busy[r] / p;
    }
    st.bubble = st.makespan - st.busy_max;
    if (out) *out = st;
    free(fend); free(bend); free(free_at); free(busy); free(next);
    return rc;
}
