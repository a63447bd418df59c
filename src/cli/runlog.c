#include "runlog.h"
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "util.h"

/* --- one line: a flat JSON object --------------------------------------------------- */

typedef struct { const char *p, *end; } Cursor;

static void skip_ws(Cursor *c) {
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\r' || *c->p == '\n')) c->p++;
}

static int at(Cursor *c, char ch) { return c->p < c->end && *c->p == ch; }

static int literal(Cursor *c, const char *word) {
    size_t n = strlen(word);
    if ((size_t)(c->end - c->p) < n || memcmp(c->p, word, n)) return 0;
    c->p += n;
    return 1;
}

static int is_digit(Cursor *c) { return c->p < c->end && *c->p >= '0' && *c->p <= '9'; }

/* A string; sets [*s, *e) to its raw contents (escapes left as they are: the keys this
 * reader looks for have none). */
static int string(Cursor *c, const char **s, const char **e) {
    if (!at(c, '"')) return -1;
    c->p++;
    *s = c->p;
    while (c->p < c->end && *c->p != '"') {
        unsigned char ch = (unsigned char)*c->p;
        if (ch < 0x20) return -1;
        if (ch == '\\') {
            c->p++;
            if (c->p >= c->end) return -1;
            if (*c->p == 'u') {
                for (int i = 1; i <= 4; i++)
                    if (c->p + i >= c->end || !strchr("0123456789abcdefABCDEF", c->p[i]) || !c->p[i]) return -1;
                c->p += 4;
            } else if (!strchr("\"\\/bfnrt", *c->p) || !*c->p) return -1;
        }
        c->p++;
    }
    if (c->p >= c->end) return -1;
    *e = c->p++;
    return 0;
}

/* A number by JSON's grammar, read with strtod. train.c prints doubles with printf, which
 * writes a non-finite one as nan, -nan, inf or -inf: those read as NAN (no value), so one
 * infinite grad_norm does not cost the line its loss. */
static int number(Cursor *c, double *v) {
    if (literal(c, "nan") || literal(c, "-nan") || literal(c, "inf") || literal(c, "-inf")) { *v = NAN; return 0; }
    const char *start = c->p;
    if (at(c, '-')) c->p++;
    if (at(c, '0')) c->p++;
    else if (is_digit(c)) while (is_digit(c)) c->p++;
    else return -1;
    if (at(c, '.')) {
        c->p++;
        if (!is_digit(c)) return -1;
        while (is_digit(c)) c->p++;
    }
    if (at(c, 'e') || at(c, 'E')) {
        c->p++;
        if (at(c, '+') || at(c, '-')) c->p++;
        if (!is_digit(c)) return -1;
        while (is_digit(c)) c->p++;
    }
    /* strtod needs a terminated string; a number is short, so copy it */
    char buf[64];
    size_t n = (size_t)(c->p - start);
    if (n >= sizeof buf) return -1;
    memcpy(buf, start, n);
    buf[n] = 0;
    *v = strtod(buf, NULL);
    return 0;
}

enum { V_NUMBER, V_NULL, V_OTHER };

/* Any value; returns its kind (a number's value in *v), or -1. Nested containers are
 * walked and dropped, to a bounded depth. */
static int value(Cursor *c, double *v, int depth) {
    const char *s, *e;
    *v = NAN;
    if (at(c, '"')) return string(c, &s, &e) ? -1 : V_OTHER;
    if (literal(c, "null")) return V_NULL;
    if (literal(c, "true") || literal(c, "false")) return V_OTHER;
    if (at(c, '{') || at(c, '[')) {
        char close = *c->p == '{' ? '}' : ']';
        if (depth > 32) return -1;
        c->p++;
        skip_ws(c);
        if (at(c, close)) { c->p++; return V_OTHER; }
        for (;;) {
            double ignored;
            if (close == '}') {
                if (string(c, &s, &e)) return -1;
                skip_ws(c);
                if (!at(c, ':')) return -1;
                c->p++;
                skip_ws(c);
            }
            if (value(c, &ignored, depth + 1) < 0) return -1;
            skip_ws(c);
            if (at(c, close)) { c->p++; return V_OTHER; }
            if (!at(c, ',')) return -1;
            c->p++;
            skip_ws(c);
        }
    }
    return number(c, v) ? -1 : V_NUMBER;
}

static int key_is(const char *s, const char *e, const char *name) {
    return (size_t)(e - s) == strlen(name) && !memcmp(s, name, (size_t)(e - s));
}

int runlog_parse_line(const char *s, const char *end, RunLine *out) {
    memset(out, 0, sizeof *out);
    out->step = out->loss = out->lr = out->tokens_per_s = out->val_loss = out->moe_aux = out->moe_imbalance = NAN;
    out->loss_scale = NAN;
    Cursor c = {s, end};
    skip_ws(&c);
    if (!at(&c, '{')) return -1;
    c.p++;
    skip_ws(&c);
    int first = 1;
    while (!at(&c, '}')) {
        if (!first) {
            if (!at(&c, ',')) return -1;
            c.p++;
            skip_ws(&c);
        }
        first = 0;
        const char *ks, *ke;
        double v;
        if (string(&c, &ks, &ke)) return -1;
        skip_ws(&c);
        if (!at(&c, ':')) return -1;
        c.p++;
        skip_ws(&c);
        const char *vstart = c.p;
        int kind = value(&c, &v, 0);
        if (kind < 0) return -1;
        skip_ws(&c);
        /* a known key with a value of the wrong type makes the line unreadable, not zero */
        int num_or_null = kind == V_NUMBER || kind == V_NULL;
        if (key_is(ks, ke, "step")) {
            if (kind != V_NUMBER) return -1;
            out->has_step = 1, out->step = v;
        } else if (key_is(ks, ke, "loss")) {
            if (!num_or_null) return -1;
            out->has_loss = 1, out->loss = v;
        } else if (key_is(ks, ke, "val_loss")) {
            if (!num_or_null) return -1;
            out->has_val_loss = 1, out->val_loss = v;
        } else if (key_is(ks, ke, "lr")) {
            if (!num_or_null) return -1;
            out->lr = v;
        } else if (key_is(ks, ke, "tokens_per_s")) {
            if (!num_or_null) return -1;
            out->tokens_per_s = v;
        } else if (key_is(ks, ke, "moe_aux")) {
            if (!num_or_null) return -1;
            out->moe_aux = v;
        } else if (key_is(ks, ke, "moe_imbalance")) {
            if (!num_or_null) return -1;
            out->moe_imbalance = v;
        } else if (key_is(ks, ke, "loss_scale")) {
            if (!num_or_null) return -1;
            out->loss_scale = v;
        } else if (key_is(ks, ke, "skipped")) {
            out->skipped = c.p - vstart >= 4 && !memcmp(vstart, "true", 4);
        } else if (key_is(ks, ke, "done")) {
            out->done = c.p - vstart >= 4 && !memcmp(vstart, "true", 4);
        } else if (key_is(ks, ke, "run")) {
            out->run_start = 1;
        } else if (key_is(ks, ke, "resumed")) {
            out->resumed = c.p - vstart >= 4 && !memcmp(vstart, "true", 4);
        } else if (key_is(ks, ke, "error")) {
            out->error = 1;
        }
    }
    c.p++;
    skip_ws(&c);
    return c.p == c.end ? 0 : -1;
}

/* --- the whole log -------------------------------------------------------------------- */

static void add_step(RunLog *log, int *cap, RunStep st) {
    /* A step at or before the last one: a resumed run. It replaces everything from there on,
     * its validations included (they come after their step's line). */
    if (log->n_steps && st.step <= log->steps[log->n_steps - 1].step) {
        log->resumes++;
        while (log->n_steps && log->steps[log->n_steps - 1].step >= st.step) log->n_steps--;
        while (log->n_vals && log->vals[log->n_vals - 1].step >= st.step) log->n_vals--;
    }
    if (log->n_steps == *cap) {
        *cap = *cap ? 2 * *cap : 256;
        log->steps = xrealloc(log->steps, (size_t)*cap * sizeof *log->steps);
    }
    log->steps[log->n_steps++] = st;
}

static void add_val(RunLog *log, int *cap, RunVal v) {
    while (log->n_vals && log->vals[log->n_vals - 1].step >= v.step) log->n_vals--;
    if (log->n_vals == *cap) {
        *cap = *cap ? 2 * *cap : 64;
        log->vals = xrealloc(log->vals, (size_t)*cap * sizeof *log->vals);
    }
    log->vals[log->n_vals++] = v;
}

int runlog_read(RunLog *log, const char *path, char *err, size_t errlen) {
    memset(log, 0, sizeof *log);
    size_t len;
    char *text = read_file(path, &len, err, errlen);
    if (!text) return -1;
    int step_cap = 0, val_cap = 0, line_no = 0, starts = 0, resumed_starts = 0;
    for (const char *p = text, *end = text + len; p < end;) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *e = nl ? nl : end;
        line_no++;
        const char *q = p;
        while (q < e && (*q == ' ' || *q == '\t' || *q == '\r')) q++;
        RunLine l;
        if (q == e) {
            /* a blank line says nothing */
        } else if (runlog_parse_line(p, e, &l) || (l.has_step && (l.step != floor(l.step) || l.step < 0 ||
                                                                      l.step > INT_MAX))) {
            if (!log->skipped++) log->first_skipped = line_no;
        } else if (l.run_start) {
            starts++;
            resumed_starts += l.resumed;
        } else if (l.has_step && !l.done && !l.error) {
            /* a step line has "loss" (the final line has "steps", not "step") */
            if (l.has_loss) {
                double scale_log2 = l.loss_scale > 0 ? log2(l.loss_scale) : NAN;  /* (NAN stays NAN) */
                add_step(log, &step_cap, (RunStep){(int)l.step, l.loss, l.lr, l.tokens_per_s, l.moe_aux, l.moe_imbalance,
                                                   scale_log2, l.skipped});
                log->moe |= isfinite(l.moe_aux) || isfinite(l.moe_imbalance);
                log->scaled |= isfinite(scale_log2);
            }
            else if (l.has_val_loss) add_val(log, &val_cap, (RunVal){(int)l.step, l.val_loss});
        }
        p = nl ? nl + 1 : end;
    }
    free(text);
    /* a resume that repeated no step (it continued where the last run's log ended) shows only
     * in its start line */
    if (starts) log->resumes = resumed_starts;
    return 0;
}

void runlog_free(RunLog *log) {
    free(log->steps);
    free(log->vals);
    memset(log, 0, sizeof *log);
}
