/* train_report — `meshtrain train`'s summary: tokens/s, FLOP/s and MFU, the peak memory
 * beside the estimate (per pipeline stage too), the offload and communication shares, the
 * final losses; the log's last line. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include "layer_graphs.h"
#include "ops.h"
#include "run.h"
#include "tensor.h"
#include "train_run.h"
#include "util.h"

/* Max, min and (mean non-NULL) mean of a per-rank value over the world. */
static void world_stats(const Comm *w, double v, double *mx, double *mn, double *mean) {
    double *all = xcalloc((size_t)w->size, sizeof(double));
    all[w->rank] = v;
    comm_allreduce_double(w, all, (size_t)w->size);
    double sum = *mx = *mn = all[0];
    for (int i = 1; i < w->size; i++) { *mx = fmax(*mx, all[i]); *mn = fmin(*mn, all[i]); sum += all[i]; }
    if (mean) *mean = sum / w->size;
    free(all);
}

int train_report(TrainRun *r, const TrainTotals *t) {
    const Config *c = r->c;
    char b1[32], b2[32];
    int done = t->done, timed_steps = t->timed_steps, final_log_error = 0;
    double t_timed = t->t_timed, comm_timed = t->comm_timed, upd_timed = t->upd_timed, uwait_timed = t->uwait_timed;
    double val_loss = t->val_loss, tokens_per_step = (double)r->G * r->T;
    float loss = t->loss;
    double tok_s = timed_steps ? tokens_per_step * timed_steps / t_timed : 0;
    double rss_max, rss_min;
    world_stats(&r->world, (double)max_rss_bytes(), &rss_max, &rss_min, NULL);
    /* each rank's share of the timed steps spent blocked in communication (on CPU ranks, its
     * idle time: a pipeline's bubble, a straggler's peers): the mean over the ranks, the most */
    double blocked, blocked_max, blocked_min;
    world_stats(&r->world, t_timed > 0 ? t->blocked_timed / t_timed : 0.0, &blocked_max, &blocked_min, &blocked);
    /* pipeline: every stage's peak (its largest rank) beside its own estimate */
    double *stage_mem = NULL;
    /* GPU: the high-water mark of the bytes op_alloc held (comparable to the estimate), and
     * of the card's used memory seen at each allocation (the CUDA context included). */
    size_t gpu_alloc = 0, gpu_used = 0;
    if (r->gpu) ops_device_peak(&gpu_alloc, &gpu_used);
    if (r->PP > 1) {
        stage_mem = xcalloc(2 * (size_t)r->world.size, sizeof(double));
        stage_mem[2 * r->world.rank] = r->gpu ? (double)gpu_alloc : (double)max_rss_bytes();
        stage_mem[2 * r->world.rank + 1] = (double)r->est.total;
        comm_allreduce_double(&r->world, stage_mem, 2 * (size_t)r->world.size);
    }
    if (r->lead) {
        double flops = tok_s * r->est.flops_per_token;
        jsonlog_begin(r->log);
        jsonlog_raw(r->log, "\"done\":true,\"steps\":%d,\"world\":%d", done - r->start, r->world.size);
        jsonlog_str(r->log, "strategy", parallel_kind_name(r->kind));
        jsonlog_num(r->log, "tokens_per_s", "%.1f", tok_s);
        jsonlog_num(r->log, "gflops", "%.2f", flops / 1e9);
        jsonlog_num(r->log, "comm_wait_fraction", "%.4f", t_timed > 0 ? comm_timed / t_timed : 0.0);
        if (r->world.size > 1) {  /* rank 0's, through MPI, all the run: set-up, steps, validation, checkpoints */
            jsonlog_raw(r->log, ",\"comm_bytes_total\":%llu", (unsigned long long)comm_bytes_sent());
            jsonlog_num(r->log, "blocked_fraction", "%.4f", blocked);
            jsonlog_num(r->log, "blocked_fraction_max", "%.4f", blocked_max);
        }
        jsonlog_raw(r->log, ",\"max_rss_bytes\":%.0f,\"min_rss_bytes\":%.0f,\"estimate_bytes\":%zu", rss_max, rss_min,
                    r->est.total);
        if (r->oc.offload) {
            jsonlog_raw(r->log, ",\"host_estimate_bytes\":%zu", r->est.host);
            jsonlog_num(r->log, "host_update_ms", "%.2f", timed_steps ? upd_timed / timed_steps * 1e3 : 0.0);
            jsonlog_num(r->log, "update_wait_ms", "%.2f", timed_steps ? uwait_timed / timed_steps * 1e3 : 0.0);
        }
        const LossScaler *ls = optim_loss_scaler(parallel_optimizer(r->par));
        if (ls->c.kind) {  /* (skipped: in all, a resumed run's earlier ones too) */
            jsonlog_raw(r->log, ",\"skipped_steps\":%d", ls->skipped);
            jsonlog_num(r->log, "loss_scale", "%.9g", ls->scale);
        }
        jsonlog_num(r->log, "loss", "%.6f", loss);
        jsonlog_num(r->log, "val_loss", "%.6f", val_loss);
        if (r->peak > 0) {
            jsonlog_num(r->log, "mfu", "%.6f", flops / (r->peak * r->world.size));
            jsonlog_num(r->log, "peak_flops", "%.4g", r->peak);
        }
        if (r->gpu) {
            jsonlog_str(r->log, "device", ops_device_name());
            jsonlog_raw(r->log, ",\"gpu_peak_alloc_bytes\":%zu,\"gpu_peak_used_bytes\":%zu", gpu_alloc, gpu_used);
        }
        if (jsonlog_end(r->log)) final_log_error = 1;
        char b3[32], b4[32], b5[32], vbuf[32];
        if (isfinite(val_loss)) snprintf(vbuf, sizeof vbuf, "%.4f", val_loss);
        else snprintf(vbuf, sizeof vbuf, "none (stopped first)");
        char mfu[128];
        if (r->peak > 0)
            snprintf(mfu, sizeof mfu, ", MFU %.2f%% of %.4g TFLOP/s per %s", 100 * flops / (r->peak * r->world.size), r->peak / 1e12,
                     r->gpu ? "GPU" : "rank");
        else if (r->gpu)
            snprintf(mfu, sizeof mfu, ", no MFU: the card's peak is not known (peak_tflops= gives it)");
        else mfu[0] = 0;
        if (r->gpu)
            printf("done: %d steps | %.0f tokens/s (%.2f TFLOP/s%s, first step excluded) | "
                   "peak GPU memory %s allocated (estimate %s), %s used on the card | host max RSS %s%s%s%s | final "
                   "loss %.4f | val_loss %s\n", done - r->start, tok_s, flops / 1e12, mfu, fmt_bytes(b1, (double)gpu_alloc),
                   fmt_bytes(b2, (double)r->est.total), fmt_bytes(b3, (double)gpu_used), fmt_bytes(b4, rss_max),
                   r->oc.offload ? " (offloaded state estimate " : "", r->oc.offload ? fmt_bytes(b5, (double)r->est.host) : "",
                   r->oc.offload ? ")" : "", loss, vbuf);
        else
            printf("done: %d steps | %.0f tokens/s (%.1f GFLOP/s%s, first step excluded) | peak memory per rank %s max, "
                   "%s min (max RSS; estimate %s) | final loss %.4f | val_loss %s\n", done - r->start, tok_s,
                   flops / 1e9, mfu, fmt_bytes(b1, rss_max), fmt_bytes(b2, rss_min), fmt_bytes(b3, (double)r->est.total), loss,
                   vbuf);
        if (r->oc.offload && timed_steps)
            printf("offload: the host's update took %.1f ms a step on %s; the forward waited %.1f ms a step for it "
                   "(%.1f%% of the step)\n", upd_timed / timed_steps * 1e3,
                   parallel_offload_lean(r->kind, &r->oc) && r->prec == OPS_MIXED ? "bf16 gradients" : "fp32 gradients",
                   uwait_timed / timed_steps * 1e3, t_timed > 0 ? 100 * uwait_timed / t_timed : 0.0);
        if (r->world.size > 1 || comm_timed > 0)
            printf("communication: waited on collectives with no compute left to run %.1f%% of the step "
                   "(overlap=%s); each rank blocked in communication %.1f%% of the step on average, %.1f%% at "
                   "most\n", t_timed > 0 ? 100 * comm_timed / t_timed : 0.0, c->overlap ? "true" : "false",
                   100 * blocked, 100 * blocked_max);
        if (r->tp_fused)
            printf("tensor parallel: %llu sums fused into the products\n", tensor_parallel_fused_count());
        if (r->m.graphs) {
            long rep, rec, eager;
            layer_graphs_counts(r->m.graphs, &rep, &rec, &eager);
            printf("layer graphs: %ld recorded, %ld replayed, %ld layer calls op by op (cuda_graphs=false: every "
                   "layer op by op)\n", rec, rep, eager);
        }
        for (int s = 0; s < r->PP && stage_mem; s++) {
            double stage_peak = 0, e = 0;
            for (int w = 0; w < r->world.size; w++)  /* world rank w is on stage w / (tp x dp) */
                if (w / (r->mesh.tp_size * r->dp) == s && stage_mem[2 * w] > stage_peak)
                    stage_peak = stage_mem[2 * w], e = stage_mem[2 * w + 1];
            printf("pipeline stage %d: peak memory %s (%s of its ranks), estimate %s\n", s, fmt_bytes(b1, stage_peak),
                   r->gpu ? "GPU allocator high-water mark" : "max RSS",
                   fmt_bytes(b2, e));
        }
        if (ls->c.kind)
            printf("loss scale: %d step%s skipped for an overflow%s; the scale is now %g\n", ls->skipped,
                   ls->skipped == 1 ? "" : "s", r->resuming ? " (in all, the resumed run's included)" : "", ls->scale);
        printf("checkpoint: %s\n", r->saving ? c->ckpt_path : "none (ckpt_path=none)");
        fflush(stdout);
        if (final_log_error)
            fprintf(stderr, "meshtrain: cannot write the log file %s: %s (the run finished%s)\n", c->log_file,
                    jsonlog_error(r->log), r->saving ? "; its checkpoint is saved" : "");
        jsonlog_close(r->log);
    }
    free(stage_mem);
    return t->stopped ? 128 + t->stopped : final_log_error ? EXIT_RUN_FAILURE : 0;
}

