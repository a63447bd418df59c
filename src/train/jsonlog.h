/* jsonlog — the training run's JSON-lines log, written a whole line at a time: a line is
 * built in memory and goes to the file in one write, so a full disk or a kill never leaves
 * half a line behind (a write that fails part-way is cut back off the file). The first
 * failed write is kept and reported; the lines after it are dropped, not written out of
 * order. Opening a log to append to it (a resumed run) drops a torn last line left by a
 * run that was killed mid-write. */
#ifndef MESHTRAIN_JSONLOG_H
#define MESHTRAIN_JSONLOG_H
#include <stddef.h>

typedef struct {
    int fd, err_no;
    char *buf;
    size_t len, cap;
    char path[1024];
} JsonLog;

/* append = 0 truncates. Returns 0, or -1 with err set. */
int jsonlog_open(JsonLog *l, const char *path, int append, char *err, size_t errlen);
/* A line: begin, then fields, then end, which writes it. jsonlog_raw appends text as it is
 * (an opening key, a nested object), jsonlog_num ",\"key\":value" (null where v is not
 * finite: JSON has no NaN), jsonlog_str ",\"key\":\"value\"" escaped. */
void jsonlog_begin(JsonLog *l);
void jsonlog_raw(JsonLog *l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void jsonlog_num(JsonLog *l, const char *key, const char *fmt, double v);
void jsonlog_str(JsonLog *l, const char *key, const char *v);
/* Closes the object and writes the line. 0, or -1 when this or an earlier write failed. */
int jsonlog_end(JsonLog *l);
/* The first failed write's reason ("No space left on device"), or NULL. */
const char *jsonlog_error(const JsonLog *l);
void jsonlog_close(JsonLog *l);
#endif
