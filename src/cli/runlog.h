/* runlog — reads the JSON-lines log `meshtrain train` writes into the series a picture of
 * the run needs. The log's lines are flat objects; this module parses them itself (no
 * JSON library), tolerating what real logs hold: null values, keys it does not know, a
 * last line cut short by a killed run, and a resumed run appended to the same file. */
#ifndef MESHTRAIN_RUNLOG_H
#define MESHTRAIN_RUNLOG_H
#include <stddef.h>

/* One training step (a value the log lacks or holds as null is NAN): a mixture of experts'
 * router too (moe_aux, moe_imbalance; NAN in a dense run's log), and a loss scaler's scale
 * as log2 (NAN without one) and whether the step was skipped for an overflow. */
typedef struct { int step; double loss, lr, tokens_per_s, moe_aux, moe_imbalance, scale_log2; int skipped; } RunStep;
/* One validation. */
typedef struct { int step; double val_loss; } RunVal;

typedef struct {
    RunStep *steps;   /* ascending by step, one per step */
    RunVal *vals;     /* ascending by step, one per step */
    int n_steps, n_vals;
    int moe;          /* some step holds the router's values (a mixture of experts' run) */
    int scaled;       /* some step holds a loss scale */
    int resumes;      /* times a resumed run appended to the log: its start lines that say
                       * resumed, or in logs without start lines, times a step came again */
    int skipped;      /* lines that are not flat JSON objects (a cut-short last line included) */
    int first_skipped;/* line number (from 1) of the first of them */
} RunLog;

/* Reads a log. A step that appears again (a resumed run logs the steps after its
 * checkpoint again) starts the timeline over from there: the later lines win and what the
 * earlier run logged past that point is dropped. Returns 0, or -1 with err set when the
 * file cannot be read. A log without step lines is not an error here (n_steps == 0). */
int runlog_read(RunLog *log, const char *path, char *err, size_t errlen);
void runlog_free(RunLog *log);

/* Flat-object parsing, exposed for the runlog's own use and its tests: the value of the
 * known keys of one line. Returns 0, or -1 when [s, end) is not one flat JSON object
 * (nested arrays and objects are skipped, not refused). */
typedef struct {
    int has_step, has_loss, has_val_loss, done, error;
    int run_start, resumed;  /* a run's first line ("run":"train"), and its "resumed":true */
    double step, loss, lr, tokens_per_s, val_loss, moe_aux, moe_imbalance, loss_scale;
    int skipped;  /* "skipped":true */
} RunLine;
int runlog_parse_line(const char *s, const char *end, RunLine *out);
#endif
