/* plot — `meshtrain plot`: one self-contained SVG picture of a training run, drawn from
 * its JSON-lines log (runlog.c): three panels sharing the step axis — training loss with
 * the validation losses as markers, the learning rate, and tokens/s — then one for a
 * mixture of experts' router (its load-balancing loss and the largest max/mean load) and one
 * for a loss scaler (log2 of the scale, the steps it skipped as markers), where the log has
 * them. The SVG is plain text written here, so the picture needs no library and opens in
 * any browser. */
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include "commands.h"
#include "runlog.h"
#include "util.h"

/* --- a growing text buffer ------------------------------------------------------------ */

typedef struct { char *p; size_t n, cap; } Buf;

static void bprintf(Buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void bprintf(Buf *b, const char *fmt, ...) {
    va_list ap, ap2;
    va_start(ap, fmt);
    va_copy(ap2, ap);
    int need = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (b->n + (size_t)need + 1 > b->cap) {
        while (b->n + (size_t)need + 1 > b->cap) b->cap = b->cap ? 2 * b->cap : 1 << 16;
        b->p = xrealloc(b->p, b->cap);
    }
    vsnprintf(b->p + b->n, b->cap - b->n, fmt, ap2);
    va_end(ap2);
    b->n += (size_t)need;
}

/* Length of the valid UTF-8 sequence at s (at most n bytes), or 0. */
static int utf8_len(const unsigned char *s, size_t n) {
    int len = s[0] < 0x80 ? 1 : (s[0] & 0xE0) == 0xC0 ? 2 : (s[0] & 0xF0) == 0xE0 ? 3 : (s[0] & 0xF8) == 0xF0 ? 4 : 0;
    if (!len || (size_t)len > n || (len == 2 && s[0] < 0xC2)) return 0;
    for (int i = 1; i < len; i++)
        if ((s[i] & 0xC0) != 0x80) return 0;
    return len;
}

/* Text as XML character data. A title or path may hold anything; what XML cannot carry
 * (control characters, bytes that are not UTF-8) becomes '?', so the file stays
 * well-formed. */
static void put_text(Buf *b, const char *text) {
    const unsigned char *s = (const unsigned char *)text;
    for (size_t n = strlen(text); n;) {
        int len = utf8_len(s, n);
        if (*s == '&') bprintf(b, "&amp;");
        else if (*s == '<') bprintf(b, "&lt;");
        else if (*s == '>') bprintf(b, "&gt;");
        else if (*s == '"') bprintf(b, "&quot;");
        else if (!len || (*s < 0x20 && *s != '\t')) bprintf(b, "?");
        else bprintf(b, "%.*s", len, (const char *)s);
        s += len ? len : 1;
        n -= len ? (size_t)len : 1;
    }
}

/* Width of text in em, estimated from DejaVu Sans' advances (the first font asked for;
 * the fallbacks are narrower), so that a title can be fitted without a font library. */
static double text_em(const unsigned char *s, size_t n, int bold) {
    double w = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = s[i];
        if ((ch & 0xC0) == 0x80) continue;  /* one code point, one advance */
        w += ch == ' ' ? 0.32 : strchr("ijl.,:;'|!", ch) ? 0.3 : strchr("/()[]", ch) ? 0.38 : strchr("rtf", ch) ? 0.42
             : strchr("sczxyvk_", ch) ? 0.55 : ch == '=' ? 0.84 : strchr("mwMW", ch) ? 0.95
             : ch >= 'A' && ch <= 'Z' ? 0.72 : 0.63;
    }
    return bold ? w * 1.1 : w;
}

/* A line of text fitted into `width` px: set at `size`, smaller when it is too long (to
 * 12 px), and beyond that cut from the left behind an ellipsis (a path's end says most). */
static void put_fitted(Buf *b, const char *id, int x, int y, double size, int bold, const char *fill, const char *text,
                       double width) {
    const unsigned char *s = (const unsigned char *)text;
    size_t n = strlen(text);
    double em = text_em(s, n, bold);
    if (em * size > width) size = fmax(12, 0.999 * width / em);
    int cut = 0;  /* the ellipsis takes about 1 em */
    while (n && (text_em(s, n, bold) + cut) * size > width) {
        do s++, n--; while (n && (*s & 0xC0) == 0x80);
        cut = 1;
    }
    bprintf(b, "<text id=\"%s\" x=\"%d\" y=\"%d\" font-size=\"%.1f\"%s fill=\"%s\">%s", id, x, y, size,
            bold ? " font-weight=\"bold\"" : "", fill, cut ? "\xe2\x80\xa6" : "");
    put_text(b, (const char *)s);
    bprintf(b, "</text>\n");
}

/* --- axes ------------------------------------------------------------------------------- */

typedef struct { double lo, hi, step; } Axis;

/* An axis over [lo, hi] ending on multiples of a 1-2-5 step, with about `ticks` intervals
 * (the step nearest to range/ticks: from 2/3 to 1.5 times as many). An empty range (one
 * step, a constant series) is widened first so that the line lies inside a real axis;
 * `integer` keeps the step at 1 or more (steps are counts). */
static Axis nice_axis(double lo, double hi, int ticks, int integer) {
    if (!(hi > lo)) {
        double pad = integer ? 1 : lo != 0 ? fabs(lo) * 0.05 : 0.5;
        lo -= pad, hi += pad;
    }
    double rough = (hi - lo) / ticks, mag = pow(10, floor(log10(rough))), r = rough / mag;
    double step = (r < 1.5 ? 1 : r < 3 ? 2 : r < 7 ? 5 : 10) * mag;
    if (integer && step < 1) step = 1;
    /* 1e-9: an end already on a multiple (up to rounding) is not pushed a step further */
    return (Axis){floor(lo / step + 1e-9) * step, ceil(hi / step - 1e-9) * step, step};
}

static int tick_count(const Axis *a) { return (int)floor((a->hi - a->lo) / a->step + 0.5) + 1; }
static double tick_value(const Axis *a, int i) {
    double v = a->lo + i * a->step;
    return fabs(v) < a->step * 1e-6 ? 0 : v;  /* -0 and 1e-19 are 0 */
}

/* Digits after the point that tell multiples of `step` apart. */
static int decimals_for(double step) { int d = (int)ceil(-log10(step) - 1e-9); return d > 0 ? d : 0; }

/* "%.*f" without trailing zeros: 2.50 -> 2.5, 3.0 -> 3. */
static void fixed_trim(char *buf, size_t n, double v, int decimals) {
    snprintf(buf, n, "%.*f", decimals, v);
    if (strchr(buf, '.')) {
        char *e = buf + strlen(buf) - 1;
        while (*e == '0') *e-- = 0;
        if (*e == '.') *e = 0;
    }
    if (!strcmp(buf, "-0")) strcpy(buf, "0");
}

/* A tick label, short: 3e-4 and 1.5e-3 on an axis of small numbers, 250k and 1.2M for
 * large ones, 3.5 otherwise; `step` (the tick spacing) says how many digits matter. */
static void fmt_tick(char *buf, size_t n, double v, double step, double axis_max) {
    double a = fabs(v);
    if (a == 0) { snprintf(buf, n, "0"); return; }
    if (axis_max < 1e-2) {
        int e = (int)floor(log10(a) + 1e-9);
        char m[32];
        fixed_trim(m, sizeof m, v / pow(10, e), decimals_for(step / pow(10, e)));
        snprintf(buf, n, "%se%d", m, e);
    } else if (a >= 1e3) {
        static const char suffix[] = "kMGTP";
        int i = 0;
        while (i < 4 && a >= 1e6 * pow(1e3, i)) i++;
        double unit = 1e3 * pow(1e3, i);
        char m[32];
        fixed_trim(m, sizeof m, v / unit, decimals_for(step / unit));
        snprintf(buf, n, "%s%c", m, suffix[i]);
    } else {
        fixed_trim(buf, n, v, decimals_for(step));
    }
}

/* --- the picture ------------------------------------------------------------------------ */

enum { WIDTH = 960, LEFT = 86, RIGHT = 28, TOP = 84 };
#define FONT "font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\""

typedef struct {
    const char *id, *label;
    int top, height;
    Axis y;
} Panel;

typedef struct { const Axis *x; const Panel *p; } Frame;

/* Axis ends sit INSET px inside the frame, so that a line at an axis's end stays clear of
 * the frame and a marker there is not cut in half. */
enum { INSET = 8 };
static double px(const Frame *f, double x) {
    return LEFT + INSET + (x - f->x->lo) / (f->x->hi - f->x->lo) * (WIDTH - LEFT - RIGHT - 2 * INSET);
}
static double py(const Frame *f, double y) {
    const Panel *p = f->p;
    return p->top + p->height - INSET - (y - p->y.lo) / (p->y.hi - p->y.lo) * (p->height - 2 * INSET);
}

/* The y axis of one series (and of `extra`, the validation losses, on the loss panel). */
static Axis series_axis(const RunLog *log, size_t off, const RunVal *extra, int n_extra, int ticks, int from_zero) {
    double lo = INFINITY, hi = -INFINITY;
    for (int i = 0; i < log->n_steps; i++) {
        double v = *(const double *)((const char *)&log->steps[i] + off);
        if (isfinite(v)) lo = fmin(lo, v), hi = fmax(hi, v);
    }
    for (int i = 0; i < n_extra; i++)
        if (isfinite(extra[i].val_loss)) lo = fmin(lo, extra[i].val_loss), hi = fmax(hi, extra[i].val_loss);
    if (lo > hi) lo = 0, hi = 1;  /* nothing to show: an empty axis */
    if (from_zero) lo = fmin(lo, 0), hi = fmax(hi, 0);
    return nice_axis(lo, hi, ticks, 0);
}

/* The router panel's axis: both of its series (they share a scale: 1 is balanced for each). */
static Axis router_axis(const RunLog *log) {
    double lo = INFINITY, hi = -INFINITY;
    for (int i = 0; i < log->n_steps; i++) {
        double a = log->steps[i].moe_aux, m = log->steps[i].moe_imbalance;
        if (isfinite(a)) lo = fmin(lo, a), hi = fmax(hi, a);
        if (isfinite(m)) lo = fmin(lo, m), hi = fmax(hi, m);
    }
    if (lo > hi) lo = 0, hi = 1;
    return nice_axis(lo, hi, 4, 0);
}

/* The panel's frame, grid, tick labels and name; the step labels under the last one. */
static void draw_panel(Buf *b, const Frame *f, int last) {
    const Panel *p = f->p;
    int x0 = LEFT, x1 = WIDTH - RIGHT, y0 = p->top, y1 = p->top + p->height;
    bprintf(b, "<g class=\"panel\" id=\"panel-%s\">\n", p->id);
    bprintf(b, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"#fbfbfd\"/>\n", x0, y0, x1 - x0, y1 - y0);
    double ymax = fmax(fabs(p->y.lo), fabs(p->y.hi));
    for (int i = 0; i < tick_count(&p->y); i++) {
        double v = tick_value(&p->y, i), y = py(f, v);
        char label[48];
        fmt_tick(label, sizeof label, v, p->y.step, ymax);
        bprintf(b, "<g class=\"ytick\"><line x1=\"%d\" x2=\"%d\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#e3e3e8\"/>"
                   "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%s</text></g>\n", x0, x1, y, y, x0 - 7, y + 4, label);
    }
    for (int i = 0; i < tick_count(f->x); i++) {
        double v = tick_value(f->x, i), x = px(f, v);
        bprintf(b, "<line class=\"xgrid\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%d\" y2=\"%d\" stroke=\"#e3e3e8\"/>\n", x, x, y0, y1);
        if (!last) continue;
        char label[48];
        fmt_tick(label, sizeof label, v, f->x->step, fmax(fabs(f->x->lo), fabs(f->x->hi)));
        bprintf(b, "<text class=\"xtick\" x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">%s</text>\n", x, y1 + 18, label);
    }
    bprintf(b, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"none\" stroke=\"#9a9aa6\"/>\n", x0, y0,
            x1 - x0, y1 - y0);
    bprintf(b, "<text x=\"22\" y=\"%d\" transform=\"rotate(-90 22 %d)\" text-anchor=\"middle\" font-size=\"14\" "
               "fill=\"#333\">%s</text>\n", (y0 + y1) / 2, (y0 + y1) / 2, p->label);
    if (last) bprintf(b, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\" font-size=\"14\" fill=\"#333\">step</text>\n",
                      (x0 + x1) / 2, y1 + 40);
    bprintf(b, "</g>\n");
}

/* One series as a polyline through its finite values (a gap is bridged), or a dot when
 * there is only one. */
static void draw_series(Buf *b, const Frame *f, const RunLog *log, size_t off, const char *id, const char *colour) {
    int n = 0;
    double lx = 0, ly = 0;
    bprintf(b, "<polyline id=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"1.8\" stroke-linejoin=\"round\" "
               "points=\"", id, colour);
    for (int i = 0; i < log->n_steps; i++) {
        double v = *(const double *)((const char *)&log->steps[i] + off);
        if (!isfinite(v)) continue;
        lx = px(f, log->steps[i].step), ly = py(f, v);
        bprintf(b, "%s%.1f,%.1f", n++ ? " " : "", lx, ly);
    }
    bprintf(b, "\"/>\n");
    if (n == 1) bprintf(b, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3.5\" fill=\"%s\"/>\n", lx, ly, colour);
    if (n == 0)
        bprintf(b, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\" fill=\"#888\">no values in the log</text>\n",
                (LEFT + WIDTH - RIGHT) / 2, f->p->top + f->p->height / 2 + 5);
}

/* Validation losses: markers joined by a dashed line; each says its value on hover. */
static void draw_vals(Buf *b, const Frame *f, const RunLog *log, const char *colour) {
    bprintf(b, "<polyline id=\"val-line\" fill=\"none\" stroke=\"%s\" stroke-width=\"1.2\" stroke-dasharray=\"5 4\" "
               "points=\"", colour);
    int n = 0;
    for (int i = 0; i < log->n_vals; i++)
        if (isfinite(log->vals[i].val_loss))
            bprintf(b, "%s%.1f,%.1f", n++ ? " " : "", px(f, log->vals[i].step), py(f, log->vals[i].val_loss));
    bprintf(b, "\"/>\n");
    for (int i = 0; i < log->n_vals; i++) {
        if (!isfinite(log->vals[i].val_loss)) continue;
        bprintf(b, "<circle class=\"val-marker\" cx=\"%.1f\" cy=\"%.1f\" r=\"4.5\" fill=\"%s\" stroke=\"#fff\" "
                   "stroke-width=\"1.5\"><title>step %d: validation loss %.4f</title></circle>\n",
                px(f, log->vals[i].step), py(f, log->vals[i].val_loss), colour, log->vals[i].step, log->vals[i].val_loss);
    }
}

/* How much of the loss panel's lines runs through a box (points sampled along each
 * segment, as a sparse log has long ones): the legend goes to the emptier corner. */
static int points_in(const Frame *f, const RunLog *log, double x0, double y0, double x1, double y1) {
    int n = 0;
    for (int series = 0; series < 2; series++) {
        int count = series ? log->n_vals : log->n_steps, have = 0;
        double lx = 0, ly = 0;
        for (int i = 0; i < count; i++) {
            int step = series ? log->vals[i].step : log->steps[i].step;
            double v = series ? log->vals[i].val_loss : log->steps[i].loss;
            if (!isfinite(v)) continue;
            double x = px(f, step), y = py(f, v);
            for (int k = have ? 1 : 10; k <= 10; k++) {
                double sx = lx + (x - lx) * k / 10, sy = ly + (y - ly) * k / 10;
                n += sx >= x0 && sx <= x1 && sy >= y0 && sy <= y1;
            }
            lx = x, ly = y, have = 1;
        }
    }
    return n;
}

static void draw_legend(Buf *b, const Frame *f, const RunLog *log, const char *c_loss, const char *c_val) {
    int rows = 1 + (log->n_vals > 0), w = 156, h = 10 + 20 * rows;
    double right = WIDTH - RIGHT - 10 - w, top = f->p->top + 10;
    double x = right, y = top;
    double bottom = f->p->top + f->p->height - 10 - h, left = LEFT + 10;
    if (points_in(f, log, left, bottom, left + w, bottom + h) < points_in(f, log, right, top, right + w, top + h))
        x = left, y = bottom;
    bprintf(b, "<g id=\"legend\" font-size=\"13\">\n<rect x=\"%.1f\" y=\"%.1f\" width=\"%d\" height=\"%d\" fill=\"#fff\" "
               "fill-opacity=\"0.9\" stroke=\"#c8c8d0\" rx=\"3\"/>\n", x, y, w, h);
    bprintf(b, "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2\"/>"
               "<text x=\"%.1f\" y=\"%.1f\">training loss</text>\n", x + 10, x + 34, y + 15, y + 15, c_loss, x + 42, y + 19.5);
    if (log->n_vals)
        bprintf(b, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"4.5\" fill=\"%s\" stroke=\"#fff\" stroke-width=\"1.5\"/>"
                   "<text x=\"%.1f\" y=\"%.1f\">validation loss</text>\n", x + 22, y + 35, c_val, x + 42, y + 39.5);
    bprintf(b, "</g>\n");
}

/* The steps a loss scaler skipped for an overflow: a marker each on the scale's line (the
 * scale that step's gradient overflowed at), which says its step on hover. */
static void draw_skips(Buf *b, const Frame *f, const RunLog *log, const char *colour) {
    for (int i = 0; i < log->n_steps; i++) {
        const RunStep *s = &log->steps[i];
        if (!s->skipped || !isfinite(s->scale_log2)) continue;
        bprintf(b, "<circle class=\"skip-marker\" cx=\"%.1f\" cy=\"%.1f\" r=\"4\" fill=\"%s\" stroke=\"#fff\" "
                   "stroke-width=\"1.2\"><title>step %d: overflow, skipped (scale 2^%g)</title></circle>\n",
                px(f, s->step), py(f, s->scale_log2), colour, s->step, s->scale_log2);
    }
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* "500 steps | last loss 3.2012 | validation loss 3.3700 (step 500) | median 2,462 tokens/s" */
static void subtitle(Buf *b, const RunLog *log) {
    char c1[32];
    int first = log->steps[0].step, last = log->steps[log->n_steps - 1].step;
    bprintf(b, "%d step%s", log->n_steps, log->n_steps == 1 ? "" : "s");
    if (first != 1) bprintf(b, " (%d to %d)", first, last);
    for (int i = log->n_steps - 1; i >= 0; i--)
        if (isfinite(log->steps[i].loss)) { bprintf(b, "  |  last loss %.4f", log->steps[i].loss); break; }
    for (int i = log->n_vals - 1; i >= 0; i--)
        if (isfinite(log->vals[i].val_loss)) {
            bprintf(b, "  |  validation loss %.4f (step %d)", log->vals[i].val_loss, log->vals[i].step);
            break;
        }
    double *t = xmalloc((size_t)log->n_steps * sizeof *t);
    int n = 0;
    for (int i = 0; i < log->n_steps; i++)
        if (isfinite(log->steps[i].tokens_per_s)) t[n++] = log->steps[i].tokens_per_s;
    qsort(t, (size_t)n, sizeof *t, cmp_double);
    if (n) bprintf(b, "  |  median %s tokens/s", fmt_commas(c1, llround(n % 2 ? t[n / 2] : (t[n / 2 - 1] + t[n / 2]) / 2)));
    free(t);
    if (log->resumes) bprintf(b, "  |  resumed %d time%s", log->resumes, log->resumes == 1 ? "" : "s");
}

static void render(Buf *b, const RunLog *log, const char *title) {
    const char *c_loss = "#1f6fb4", *c_val = "#d6382b", *c_lr = "#2a9d5c", *c_tok = "#7b4fb0", *c_aux = "#c07a12",
               *c_imb = "#555566", *c_scale = "#2b7f86";
    int lo = log->steps[0].step, hi = log->steps[log->n_steps - 1].step;
    if (log->n_vals) {
        if (log->vals[0].step < lo) lo = log->vals[0].step;
        if (log->vals[log->n_vals - 1].step > hi) hi = log->vals[log->n_vals - 1].step;
    }
    Axis x = nice_axis(lo, hi, 10, 1);
    /* the panels the log has, each below the last */
    enum { P_LOSS, P_LR, P_TOKENS, P_ROUTER, P_SCALE, P_ALL };
    Panel all[P_ALL] = {
        {"loss", "loss", 0, 260, series_axis(log, offsetof(RunStep, loss), log->vals, log->n_vals, 6, 0)},
        {"lr", "learning rate", 0, 130, series_axis(log, offsetof(RunStep, lr), NULL, 0, 4, 1)},
        {"tokens", "tokens/s", 0, 130, series_axis(log, offsetof(RunStep, tokens_per_s), NULL, 0, 4, 1)},
        {"router", "router", 0, 130, router_axis(log)},
        {"scale", "log2 loss scale", 0, 130, series_axis(log, offsetof(RunStep, scale_log2), NULL, 0, 4, 0)},
    };
    const char *colours[P_ALL] = {c_loss, c_lr, c_tok, c_aux, c_scale};
    const char *ids[P_ALL] = {"loss-line", "lr-line", "tokens-line", "moe-aux-line", "scale-line"};
    size_t offs[P_ALL] = {offsetof(RunStep, loss), offsetof(RunStep, lr), offsetof(RunStep, tokens_per_s),
                          offsetof(RunStep, moe_aux), offsetof(RunStep, scale_log2)};
    int kinds[P_ALL], np = 0;
    Panel panels[P_ALL];
    for (int k = 0; k < P_ALL; k++) {
        if ((k == P_ROUTER && !log->moe) || (k == P_SCALE && !log->scaled)) continue;
        panels[np] = all[k];
        panels[np].top = np ? panels[np - 1].top + panels[np - 1].height + 28 : TOP;
        kinds[np++] = k;
    }
    int height = panels[np - 1].top + panels[np - 1].height + 56;
    bprintf(b, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
               "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" " FONT
               " font-size=\"12\" fill=\"#222\">\n", WIDTH, height, WIDTH, height);
    bprintf(b, "<rect width=\"%d\" height=\"%d\" fill=\"#fff\"/>\n", WIDTH, height);
    Buf sub = {0};
    subtitle(&sub, log);
    put_fitted(b, "title", LEFT, 34, 19, 1, "#222", title, WIDTH - LEFT - RIGHT);
    put_fitted(b, "subtitle", LEFT, 60, 13, 0, "#555", sub.p, WIDTH - LEFT - RIGHT);
    free(sub.p);
    for (int i = 0; i < np; i++) {
        int k = kinds[i];
        Frame f = {&x, &panels[i]};
        draw_panel(b, &f, i == np - 1);
        draw_series(b, &f, log, offs[k], ids[k], colours[k]);
        if (k == P_LOSS) {
            draw_vals(b, &f, log, c_val);
            draw_legend(b, &f, log, c_loss, c_val);
        }
        if (k == P_ROUTER) {  /* the router: its load-balancing loss and the largest max/mean load */
            draw_series(b, &f, log, offsetof(RunStep, moe_imbalance), "moe-imbalance-line", c_imb);
            bprintf(b, "<g id=\"router-legend\" font-size=\"12\"><text x=\"%d\" y=\"%d\" fill=\"%s\">load-balancing "
                       "loss</text><text x=\"%d\" y=\"%d\" fill=\"%s\">largest max/mean load</text></g>\n",
                    LEFT + 10, panels[i].top + 16, c_aux, LEFT + 150, panels[i].top + 16, c_imb);
        }
        if (k == P_SCALE) draw_skips(b, &f, log, c_val);
    }
    bprintf(b, "</svg>\n");
}

/* out= by default: log.svg beside the log. */
static void default_out(char *dst, size_t n, const char *log) {
    const char *slash = strrchr(log, '/');
    if (!slash) snprintf(dst, n, "log.svg");
    else snprintf(dst, n, "%.*s/log.svg", (int)(slash - log), log);
}

int cmd_plot(Config *c) {
    char err[1024], out[sizeof c->out + 16];
    if (c->out[0]) snprintf(out, sizeof out, "%s", c->out);
    else default_out(out, sizeof out, c->log);
    /* the log is the one thing a mistyped out= could destroy */
    struct stat sl, so;
    if (!stat(c->log, &sl) && !stat(out, &so) && sl.st_dev == so.st_dev && sl.st_ino == so.st_ino)
        die(EXIT_BAD_INPUT, "out=%s is the log itself", out);
    RunLog log;
    if (runlog_read(&log, c->log, err, sizeof err)) die(EXIT_BAD_INPUT, "%s", err);
    if (!log.n_steps) die(EXIT_BAD_INPUT, "%s: no step lines (is it the log.jsonl of 'meshtrain train'?)", c->log);
    Buf b = {0};
    render(&b, &log, c->title[0] ? c->title : c->log);
    if (write_file_atomic(out, b.p, b.n, err, sizeof err)) die(EXIT_BAD_INPUT, "out=%s: %s", out, err);
    printf("plot: %s -> %s (%d step%s, %d validation%s", c->log, out, log.n_steps, log.n_steps == 1 ? "" : "s",
           log.n_vals, log.n_vals == 1 ? "" : "s");
    if (log.resumes) printf(", resumed %d time%s", log.resumes, log.resumes == 1 ? "" : "s");
    if (log.skipped) printf(", %d unreadable line%s skipped, the first line %d", log.skipped,
                            log.skipped == 1 ? "" : "s", log.first_skipped);
    printf(")\n");
    free(b.p);
    runlog_free(&log);
    return 0;
}
