#include "jsonlog.h"
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "util.h"

/* A log opened to append to: cut a last line that has no newline (a writer killed mid-line). */
static int drop_torn_line(int fd) {
    off_t end = lseek(fd, 0, SEEK_END);
    if (end <= 0) return 0;
    char tail[4096];
    off_t pos = end;
    while (pos > 0) {
        size_t n = pos < (off_t)sizeof tail ? (size_t)pos : sizeof tail;
        pos -= (off_t)n;
        if (pread(fd, tail, n, pos) != (ssize_t)n) return -1;
        if (pos + (off_t)n == end && tail[n - 1] == '\n') return 0;  /* whole lines */
        for (size_t i = n; i-- > 0;)
            if (tail[i] == '\n') return ftruncate(fd, pos + (off_t)i + 1);
    }
    return ftruncate(fd, 0);  /* one torn line and nothing else */
}

int jsonlog_open(JsonLog *l, const char *path, int append, char *err, size_t errlen) {
    memset(l, 0, sizeof *l);
    snprintf(l->path, sizeof l->path, "%s", path);
    l->fd = open(path, O_RDWR | O_CREAT | (append ? 0 : O_TRUNC), 0644);
    if (l->fd < 0) return set_err(err, errlen, "cannot write the log file %s (log_file): %s", path, strerror(errno));
    if (append && drop_torn_line(l->fd)) {
        int e = errno;
        close(l->fd);
        l->fd = -1;
        return set_err(err, errlen, "cannot repair the log file %s (log_file): %s", path, strerror(e));
    }
    return 0;
}

static void grow(JsonLog *l, size_t more) {
    if (l->len + more + 1 <= l->cap) return;
    while (l->len + more + 1 > l->cap) l->cap = l->cap ? 2 * l->cap : 1024;
    l->buf = xrealloc(l->buf, l->cap);
}

static void vappend(JsonLog *l, const char *fmt, va_list ap) {
    va_list ap2;
    va_copy(ap2, ap);
    int n = vsnprintf(NULL, 0, fmt, ap2);
    va_end(ap2);
    if (n <= 0) return;
    grow(l, (size_t)n);
    vsnprintf(l->buf + l->len, (size_t)n + 1, fmt, ap);
    l->len += (size_t)n;
}

void jsonlog_raw(JsonLog *l, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vappend(l, fmt, ap);
    va_end(ap);
}

void jsonlog_begin(JsonLog *l) {
    l->len = 0;
    jsonlog_raw(l, "{");
}

/* a field after another gets a comma; the first of an object (after its '{') none */
static const char *sep(const JsonLog *l) { return l->len && l->buf[l->len - 1] != '{' ? "," : ""; }

void jsonlog_num(JsonLog *l, const char *key, const char *fmt, double v) {
    jsonlog_raw(l, "%s\"%s\":", sep(l), key);
    if (!isfinite(v)) { jsonlog_raw(l, "null"); return; }
    char num[64];
    snprintf(num, sizeof num, fmt, v);
    jsonlog_raw(l, "%s", num);
}

void jsonlog_str(JsonLog *l, const char *key, const char *v) {
    jsonlog_raw(l, "%s\"%s\":\"", sep(l), key);
    for (const unsigned char *p = (const unsigned char *)v; *p; p++) {
        if (*p == '"' || *p == '\\') jsonlog_raw(l, "\\%c", *p);
        else if (*p < 0x20) jsonlog_raw(l, "\\u%04x", *p);
        else jsonlog_raw(l, "%c", *p);
    }
    jsonlog_raw(l, "\"");
}

int jsonlog_end(JsonLog *l) {
    jsonlog_raw(l, "}\n");
    if (l->fd < 0 || l->err_no) return -1;
    off_t at = lseek(l->fd, 0, SEEK_END);
    size_t done = 0;
    while (done < l->len) {
        ssize_t w = write(l->fd, l->buf + done, l->len - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            l->err_no = w < 0 ? errno : ENOSPC;
            if (at >= 0 && ftruncate(l->fd, at)) { /* the file keeps the part; nothing more can be done */ }
            return -1;
        }
        done += (size_t)w;
    }
    return 0;
}

const char *jsonlog_error(const JsonLog *l) { return l->err_no ? strerror(l->err_no) : NULL; }

void jsonlog_close(JsonLog *l) {
    if (l->fd >= 0) close(l->fd);
    l->fd = -1;
    free(l->buf);
    l->buf = NULL;
    l->len = l->cap = 0;
}
