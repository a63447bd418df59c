/* train_loop — `meshtrain train`'s steps: each step's loss agreed over the ranks, the log
 * line and the progress bar, validation, checkpoints, and the ways a run stops (a signal on
 * any rank, a non-finite number, a log or checkpoint that cannot be written). */
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "env.h"
#include "layer_graphs.h"
#include "ops.h"
#include "trace.h"
#include "train_run.h"
#include "train_state.h"
#include "util.h"

/* ---- progress display ---- */

typedef struct { int on; double t0; int first_step, steps; } Progress;

static void progress_draw(Progress *p, int step, float loss, double tok_s) {
    if (!p->on) return;
    int width = 30, done = (int)((double)(step - p->first_step) / (p->steps - p->first_step) * width);
    double elapsed = now_seconds() - p->t0;
    double eta = step > p->first_step ? elapsed / (step - p->first_step) * (p->steps - step) : 0;
    char bar[64];
    for (int i = 0; i < width; i++) bar[i] = i < done ? '#' : '.';
    bar[width] = 0;
    fprintf(stderr, "\r\033[K[%s] %d/%d loss %.4f %.0f tok/s eta %dm%02ds", bar, step, p->steps, loss, tok_s,
            (int)eta / 60, (int)eta % 60);
    fflush(stderr);
}

static void progress_clear(Progress *p) {
    if (p->on) fprintf(stderr, "\r\033[K");
}


/* Test hooks for fault handling: MESHTRAIN_FAULT_KILL / _HANG = "rank:step" make that
 * rank die (SIGKILL) or stop responding at the start of that step. */
static void inject_fault(int rank, int step) {
    int r, s;
    if (hook_rank_step(HOOK_FAULT_KILL, &r, &s) && r == rank && s == step) raise(SIGKILL);
    if (hook_rank_step(HOOK_FAULT_HANG, &r, &s) && r == rank && s == step)
        for (;;) sleep(1000);
}

/* A non-finite loss (training or validation) or gradient norm ends the run before anything
 * is saved: the last checkpoint stays the last good one. Every rank sees the same value
 * (reduced), so all stop here together. */
static _Noreturn void stop_non_finite(Progress *pr, JsonLog *log, int step, const char *what, double v, int lead,
                                      const char *ckpt) {
    progress_clear(pr);
    if (log) {  /* the log's last word, if it can still be written (the error below is the one that counts) */
        jsonlog_begin(log);
        jsonlog_raw(log, "\"step\":%d,\"error\":\"non-finite %s\"", step, what);
        (void)jsonlog_end(log);
        jsonlog_close(log);
    }
    if (lead) {
        if (ckpt) fprintf(stderr, "meshtrain: step %d: the %s is %s; stopping. The last checkpoint, if any, is intact: %s\n",
                          step, what, isnan(v) ? "NaN" : "infinite", ckpt);
        else fprintf(stderr, "meshtrain: step %d: the %s is %s; stopping (ckpt_path=none: no checkpoint)\n", step, what,
                     isnan(v) ? "NaN" : "infinite");
    }
    comm_world_finalize();
    exit(EXIT_RUN_FAILURE);
}

/* ---- the router of a mixture of experts, from the step's statistics (Step's moe_stats) ---- */

typedef struct { double aux, z, drop, imb; } MoeSummary;

/* The JSON log's router fields: "moe" (per layer the tokens the least and the most loaded
 * expert got and their imbalance, the most over the mean), and flat beside it, for plot and
 * tools, moe_aux and moe_z (the load-balancing and z losses, each the mean over the MoE layers
 * of the step's mean over its micro-batches; 1 is a balanced router's moe_aux), moe_imbalance
 * (the largest layer's) and moe_drop (the share of the choices dropped by capacity). */
static MoeSummary moe_log(const TrainRun *r, JsonLog *log) {
    const Model *m = &r->m;
    const double *s = r->st.moe_stats;
    int X = m->X, micro = r->st.micro;
    MoeSummary sum = {0, 0, 0, 0};
    double routed = 0, kept = 0;
    if (log) jsonlog_raw(log, ",\"moe\":{\"layers\":[");
    for (int i = 0; i < m->n_moe; i++) {
        const double *a = s + (size_t)i * (X + 3);
        double lo = a[0], hi = a[0], tot = 0;
        for (int e = 0; e < X; e++) lo = a[e] < lo ? a[e] : lo, hi = a[e] > hi ? a[e] : hi, tot += a[e];
        double imb = tot > 0 ? hi / (tot / X) : 0;
        sum.aux += a[X] / micro / m->n_moe, sum.z += a[X + 1] / micro / m->n_moe;
        sum.imb = imb > sum.imb ? imb : sum.imb;
        routed += tot, kept += a[X + 2];
        if (log) jsonlog_raw(log, "%s{\"min\":%.0f,\"max\":%.0f,\"imbalance\":%.4f}", i ? "," : "", lo, hi, imb);
    }
    sum.drop = routed > 0 ? 1 - kept / routed : 0;
    if (log) {
        jsonlog_raw(log, "]}");
        jsonlog_num(log, "moe_aux", "%.6f", sum.aux);
        jsonlog_num(log, "moe_z", "%.6f", sum.z);
        jsonlog_num(log, "moe_imbalance", "%.4f", sum.imb);
        jsonlog_num(log, "moe_drop", "%.6f", sum.drop);
    }
    return sum;
}

/* ---- signals: the first SIGINT or SIGTERM ends the run after the current step, with a
 * checkpoint; a second one ends the process at once ---- */

static volatile sig_atomic_t g_signal;
static int g_signal_lead;  /* this rank prints the handler's note */

static void on_signal(int sig) {
    if (g_signal) _exit(128 + sig);
    g_signal = sig;
    /* (the ranks agree on stopping after the step; whether a checkpoint can then be saved is
     * only known there: a lost peer rank ends the job instead) */
    static const char note[] = "\nmeshtrain: signal received: stopping after this step "
                               "(send it again to stop at once)\n";
    if (g_signal_lead) {
        ssize_t w = write(2, note, sizeof note - 1);
        (void)w;
    }
}

static void catch_signals(int lead) {
    g_signal_lead = lead;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

/* Why the run stops after this step, agreed by every rank: the signal any rank has received
 * (0: none), and whether rank 0's log could not be written. */
typedef struct { int signal, log_failed; } StopReason;
static StopReason stop_agreed(const Comm *world, int log_failed) {
    int v[2] = {g_signal, log_failed};
    if (world->size > 1) comm_allreduce_max_int(world, v, 2);
    return (StopReason){v[0], v[1]};
}

TrainTotals train_loop(TrainRun *r) {
    Config *c = r->c;
    char err[1024];
    /* test hooks: poison one step's training loss, or its validation loss */
    int nan_step = (int)hook_int(HOOK_FAULT_NAN_STEP, -1), nan_val_step = (int)hook_int(HOOK_FAULT_NAN_VAL_STEP, -1);
    /* ... or send rank 0 a SIGTERM as that step's validation begins (a signal mid-validation) */
    int term_val_step = (int)hook_int(HOOK_FAULT_TERM_VAL_STEP, -1);
    Progress pr = {r->lead && c->progress && isatty(2), now_seconds(), r->start, c->steps};
    double tokens_per_step = (double)r->G * r->T, flops_per_step = r->est.flops_per_token * tokens_per_step;
    int warm = r->start + 1;  /* the first step of a run warms caches and threads: not timed */
    double t_timed = 0, comm_timed = 0, val_loss = NAN;
    /* offload: the update thread's time and the forward's wait for it, totals (upd0, wait0: at
     * the last step's end); the update of step s runs beside step s + 1, and is counted there */
    double upd0 = 0, uwait0 = 0, upd_timed = 0, uwait_timed = 0;
    double blocked_timed = 0;  /* the timed steps' time blocked in communication (comm_blocked_seconds) */
    int timed_steps = 0;
    float loss = 0;
    int stopped = 0, late_signal = 0, log_failed = 0, done = r->start;
    /* The losses are summed over every rank that must agree on stopping at a non-finite one:
     * the data-parallel group, or the world where pipeline stages (which give 0 but the
     * head's) or tensor-parallel ranks (each holding the same loss) are in it. */
    const Comm *loss_group = r->PP > 1 || r->mesh.tp_size > 1 ? &r->world : &r->mesh.dp;
    int loss_ranks = r->dp * r->mesh.tp_size;  /* the head's stage: every dp x tp rank of it holds the loss */
    catch_signals(r->lead);
    for (int step = r->start; step < c->steps; step++) {
        if (step == r->start + 1) {  /* every product of a step has met cuBLASLt by now: tune them, untimed */
            char rep[384];
            if (op_tune_matmuls(rep, sizeof rep) >= 0 && r->lead) {
                progress_clear(&pr);
                printf("%s\n", rep);
            }
            /* the plans are made and the matmuls tuned: the layers may be recorded */
            if (r->graphs) model_use_graphs(&r->m, 1);
        }
        double t0 = now_seconds(), blocked0 = comm_blocked_seconds();
        uint64_t sent0 = comm_bytes_sent();
        inject_fault(r->world.rank, step + 1);
        if (hook_rank_at_step(HOOK_FAULT_OVERFLOW, r->world.rank, step + 1)) parallel_inject_overflow(r->par);
        LossScaler *scaler = optim_loss_scaler(parallel_optimizer(r->par));
        float loss_scale = scaler->scale;  /* this step's (its decision moves it for the next) */
        trace_step(step + 1);
        if (step == r->start + 1) ops_profile_reset();
        /* A non-finite loss still stops the run before anything is saved; so does a non-finite
         * gradient norm, unless a loss scaler skipped the step for it (every rank alike). */
        /* 2bw: the pipeline runs on into the next step unless this one ends the run or
         * precedes validation or a checkpoint, which want nothing in flight */
        r->st.drain = step + 1 == c->steps || (c->val_every && (step + 1) % c->val_every == 0) ||
                      (r->saving && c->ckpt_every && (step + 1) % c->ckpt_every == 0);
        double lr, norm, l = step_run(&r->st, &r->oc, &norm, &lr);
        if (step + 1 == nan_step && r->lead) l = NAN;
        /* the mean loss of the global batch: the head's stage has it, the others give 0 */
        comm_allreduce_double(loss_group, &l, 1);
        loss = (float)(l / loss_ranks);
        if (!isfinite(loss) || (!isfinite(norm) && !scaler->last_skipped)) {
            parallel_sync(r->par);  /* offload: no update thread left running into the exit */
            stop_non_finite(&pr, r->log, step + 1, !isfinite(loss) ? "loss" : "gradient norm", !isfinite(loss) ? loss : norm,
                            r->lead, r->saving ? c->ckpt_path : NULL);
        }
        /* a device runs the optimizer step asynchronously: time it, but for the units DDP
         * updates beside the next forward (ops' side queue), which count in the next step */
        ops_synchronize_main();
        trace_mark(NULL, "host: step synchronised");  /* an idle queue: the event takes the host's time */
        trace_dump(r->world.rank);
        double dt = now_seconds() - t0, wait = parallel_comm_wait(r->par), upd1, uwait1;
        parallel_offload_times(r->par, &upd1, &uwait1);
        double upd = upd1 - upd0, uwait = uwait1 - uwait0;
        upd0 = upd1, uwait0 = uwait1;
        if (step + 1 > warm) {
            t_timed += dt, comm_timed += wait, upd_timed += upd, uwait_timed += uwait, timed_steps++;
            blocked_timed += comm_blocked_seconds() - blocked0;
        }
        double tok_s = tokens_per_step / dt, gflops = flops_per_step / dt / 1e9;
        if (r->log) {
            jsonlog_begin(r->log);
            jsonlog_raw(r->log, "\"step\":%d", step + 1);
            jsonlog_num(r->log, "loss", "%.6f", loss);
            jsonlog_num(r->log, "lr", "%.6e", lr);
            jsonlog_num(r->log, "grad_norm", "%.6f", norm);  /* (null where the step overflowed) */
            if (scaler->c.kind) {  /* this step's scale, then the trackers after its decision */
                jsonlog_num(r->log, "loss_scale", "%.9g", loss_scale);
                jsonlog_raw(r->log, ",\"skipped\":%s,\"skipped_steps\":%d,\"loss_scale_growth\":%d,"
                            "\"loss_scale_hysteresis\":%d", scaler->last_skipped ? "true" : "false", scaler->skipped,
                            scaler->growth, scaler->hysteresis);
            }
            jsonlog_num(r->log, "ms", "%.2f", dt * 1e3);
            jsonlog_num(r->log, "comm_wait_ms", "%.2f", wait * 1e3);
            if (r->world.size > 1)  /* this rank's, through MPI (comm_bytes_sent) */
                jsonlog_raw(r->log, ",\"comm_bytes\":%llu", (unsigned long long)(comm_bytes_sent() - sent0));
            jsonlog_num(r->log, "tokens_per_s", "%.1f", tok_s);
            jsonlog_num(r->log, "gflops", "%.2f", gflops);
            if (r->peak > 0) jsonlog_num(r->log, "mfu", "%.6f", gflops * 1e9 / (r->peak * r->world.size));
            if (r->oc.offload) {  /* the last step's host update, run beside this one, and the wait for it */
                jsonlog_num(r->log, "host_update_ms", "%.2f", upd * 1e3);
                jsonlog_num(r->log, "update_wait_ms", "%.2f", uwait * 1e3);
            }
        }
        MoeSummary moe = {0, 0, 0, 0};
        if (r->m.n_moe) moe = moe_log(r, r->log);
        if (r->log) log_failed |= jsonlog_end(r->log) != 0;
        if (r->lead && ((step + 1) % c->log_every == 0 || step + 1 == c->steps || step == r->start)) {
            progress_clear(&pr);
            printf("step %5d/%d | loss %.4f | lr %.2e | grad_norm %7.4f | %7.1f ms | %8.0f tok/s | ", step + 1, c->steps,
                   loss, lr, norm, dt * 1e3, tok_s);
            if (scaler->c.kind) printf("scale %g%s | ", loss_scale, scaler->last_skipped ? " overflow: skipped" : "");
            if (r->gpu) printf("%6.2f TFLOP/s", gflops / 1e3);
            else printf("%6.1f GFLOP/s", gflops);
            if (r->peak > 0) printf(" | MFU %5.2f%%", 100 * gflops * 1e9 / (r->peak * r->world.size));
            if (r->m.n_moe) {
                printf(" | aux %.4f | max/mean %.2f", moe.aux, moe.imb);
                if (r->mc.moe_capacity_factor > 0) printf(" | dropped %.2f%%", 100 * moe.drop);
            }
            printf("\n");
            fflush(stdout);
        }
        int last = step + 1 == c->steps;
        if ((c->val_every && (step + 1) % c->val_every == 0) || last) {
            if (step + 1 == term_val_step && r->lead) raise(SIGTERM);
            Acts va;  /* a short validation shard: a smaller batch, in the training buffers */
            acts_view(&va, &r->a, &r->m, r->PP > 1 ? r->BM : r->val_B);
            val_loss = step_eval(&r->st, &va, &r->val, r->PP > 1 ? c->val_batches * c->micro_batches : c->val_batches,
                                 r->mesh.dp_rank, r->dp);
            if (step + 1 == nan_val_step && r->lead) val_loss = NAN;
            comm_allreduce_double(loss_group, &val_loss, 1);
            val_loss /= loss_ranks;
            if (!isfinite(val_loss))
                stop_non_finite(&pr, r->log, step + 1, "validation loss", val_loss, r->lead, r->saving ? c->ckpt_path : NULL);
            if (r->lead) {
                progress_clear(&pr);
                printf("step %5d/%d | val_loss %.4f\n", step + 1, c->steps, val_loss);
                jsonlog_begin(r->log);
                jsonlog_raw(r->log, "\"step\":%d", step + 1);
                jsonlog_num(r->log, "val_loss", "%.6f", val_loss);
                log_failed |= jsonlog_end(r->log) != 0;
            }
        }
        /* a signal on any rank, or a log rank 0 could not write: every rank ends after this
         * step, with a checkpoint. After the last step a signal changes nothing: the run is
         * complete (its checkpoint is saved below as at any end). */
        StopReason why = stop_agreed(&r->world, log_failed);
        done = step + 1;
        if (why.signal && last) late_signal = why.signal;
        else stopped = why.signal;
        if (r->saving && ((c->ckpt_every && (step + 1) % c->ckpt_every == 0) || last || why.signal || why.log_failed)) {
            LoaderState ls = loader_get_state(&r->loader);
            r->h.step = step + 1; r->h.adam_step = parallel_adam_steps(r->par);
            r->h.loader_epoch = ls.epoch; r->h.loader_window = ls.window;
            r->h.last_loss = loss;
            parallel_sync(r->par);  /* offload: every unit's update is in */
            /* the settings first: a save that fails leaves the last manifest, whose own stay */
            int unsaved = r->lead && r->settings && ckpt_write_settings(c->ckpt_path, step + 1, r->settings, err, sizeof err);
            if (!unsaved && r->lead && r->m.moe_bias)  /* (the same on every rank) */
                unsaved = ckpt_write_moe_bias(c->ckpt_path, step + 1, r->m.moe_bias_host, r->m.n_moe, r->m.X, err,
                                              sizeof err) != 0;
            if (!unsaved && r->lead && scaler->c.kind)  /* (likewise) */
                unsaved = ckpt_write_loss_scale(c->ckpt_path, step + 1, scaler, err, sizeof err) != 0;
            size_t n_e, n_f;
            float *ef, *e = parallel_compression_state(r->par, &n_e, &ef, &n_f);
            int ef_unsaved = !unsaved && e && (r->h.flags & CKPT_GRAD_EF) &&  /* (each rank its own) */
                             ckpt_write_grad_ef(c->ckpt_path, step + 1, r->world.rank, r->world.size, r->compress, e,
                                                n_e, ef, n_f, err, sizeof err) != 0;
            if (!unsaved && !ef_unsaved)  /* 2bw: each rank's version before the newest */
                ef_unsaved = train_stash_save(c->ckpt_path, step + 1, r->world.rank, r->world.size, &r->st, err,
                                              sizeof err) != 0;
            int own = unsaved || ef_unsaved, failed[2] = {unsaved, ef_unsaved ? r->world.rank + 1 : 0};
            comm_allreduce_max_int(&r->world, failed, 2);
            unsaved = failed[0] || failed[1];
            if (unsaved && !own)  /* (a rank that failed says why itself) */
                snprintf(err, sizeof err, failed[0] ? "rank 0 could not write the checkpoint's settings"
                                                    : "rank %d could not write its state beside the checkpoint",
                         failed[1] - 1);
            /* every rank gets the same answer: one of them says it */
            if (unsaved || train_state_save(c->ckpt_path, &r->h, &r->world, r->par, &r->m, r->tied_copy, err, sizeof err)) {
                progress_clear(&pr);
                if (r->lead && why.log_failed)
                    fprintf(stderr, "meshtrain: step %d: cannot write the log file %s: %s; nor the checkpoint: %s (the "
                            "last checkpoint, if any, is intact)\n", step + 1, c->log_file, jsonlog_error(r->log), err);
                else if (r->lead) fprintf(stderr, "meshtrain: step %d: %s\n", step + 1, err);
                comm_world_finalize();
                exit(EXIT_RUN_FAILURE);
            }
        }
        if (why.log_failed) {
            progress_clear(&pr);
            if (r->lead && r->saving)
                fprintf(stderr, "meshtrain: step %d: cannot write the log file %s: %s; stopped here with a checkpoint "
                        "(continue with resume=%s once the log can be written)\n", step + 1, c->log_file,
                        jsonlog_error(r->log), c->ckpt_path);
            else if (r->lead)
                fprintf(stderr, "meshtrain: step %d: cannot write the log file %s: %s; stopped here (ckpt_path=none: no "
                        "checkpoint)\n", step + 1, c->log_file, jsonlog_error(r->log));
            comm_world_finalize();
            exit(EXIT_RUN_FAILURE);
        }
        if (stopped) break;
        progress_draw(&pr, step + 1, loss, tok_s);
    }
    progress_clear(&pr);
    if (stopped && r->lead) {
        const char *name = stopped == SIGINT ? "SIGINT" : stopped == SIGTERM ? "SIGTERM" : "a signal";
        jsonlog_begin(r->log);
        jsonlog_raw(r->log, "\"step\":%d", done);
        jsonlog_str(r->log, "stopped", name);
        (void)jsonlog_end(r->log);  /* a failure is reported with the final line's */
        if (r->saving && schedule_no_flush(r->sched))  /* (the next micro-batches were read and are in flight) */
            printf("stopped by %s after step %d of %d: checkpoint saved (the newest weights; pipeline_schedule=%s does "
                   "not resume)\n", name, done, c->steps, c->pipeline_schedule);
        else if (r->saving) printf("stopped by %s after step %d of %d: checkpoint saved; continue with resume=%s\n", name, done,
                           c->steps, c->ckpt_path);
        else printf("stopped by %s after step %d of %d (ckpt_path=none: no checkpoint)\n", name, done, c->steps);
    }
    if (late_signal && r->lead)
        printf("%s received after the last step: the run is complete\n",
               late_signal == SIGINT ? "SIGINT" : late_signal == SIGTERM ? "SIGTERM" : "a signal");
    return (TrainTotals){done,        timed_steps, stopped,     late_signal,   t_timed, comm_timed,
                         upd_timed,   uwait_timed, blocked_timed, val_loss,    loss};
}
