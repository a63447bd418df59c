#include "safetensors.h"
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Raw fp32 and the length go out as the host holds them, which is what the format wants. */
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data are little-endian");

size_t st_numel(const StTensor *t) {
    size_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= (size_t)t->shape[d];
    return n;
}

/* Appends to a growing string. */
typedef struct { char *s; size_t len, cap; } Buf;
static void buf_printf(Buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void buf_printf(Buf *b, const char *fmt, ...) {
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int k = vsnprintf(b->s + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (k >= 0 && (size_t)k < b->cap - b->len) { b->len += (size_t)k; return; }
        b->cap = b->cap * 2 + (k > 0 ? (size_t)k : 0) + 64;
        b->s = xrealloc(b->s, b->cap);
    }
}

int st_open(StWriter *w, const char *path, const StTensor *t, int n, char *err, size_t errlen) {
    memset(w, 0, sizeof *w);
    w->t = t;
    w->n = n;
    Buf b = {xmalloc(256), 0, 256};
    b.s[0] = 0;
    buf_printf(&b, "{");
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        size_t bytes = st_numel(&t[i]) * sizeof(float);
        /* Names come from the exporter's table (letters, digits, '.', '_'): nothing to escape. */
        buf_printf(&b, "\"%s\":{\"dtype\":\"F32\",\"shape\":[", t[i].name);
        for (int d = 0; d < t[i].ndim; d++) buf_printf(&b, "%s%lld", d ? "," : "", (long long)t[i].shape[d]);
        buf_printf(&b, "],\"data_offsets\":[%zu,%zu]},", off, off + bytes);
        off += bytes;
    }
    buf_printf(&b, "\"__metadata__\":{\"format\":\"pt\"}}");
    /* The data start 8-byte aligned (the format asks it; readers may map them in place). */
    while (b.len % 8) buf_printf(&b, " ");
    uint64_t hlen = b.len;
    if (atomic_open(&w->f, path, err, errlen)) { free(b.s); return -1; }
    atomic_write(&w->f, &hlen, sizeof hlen);
    atomic_write(&w->f, b.s, b.len);
    w->bytes = sizeof hlen + b.len + off;
    free(b.s);
    return 0;
}

void st_write(StWriter *w, const float *data) {
    if (w->next >= w->n) die(EXIT_RUN_FAILURE, "internal: st_write past the %d tensors of %s", w->n, w->f.path);
    atomic_write(&w->f, data, st_numel(&w->t[w->next]) * sizeof(float));
    w->next++;
}

int st_commit(StWriter *w, char *err, size_t errlen) {
    if (w->next != w->n) {  /* a short file must not replace a good one: fail the commit */
        if (!w->f.err_no) w->f.err_no = EIO;
        atomic_commit(&w->f, NULL, 0);
        return set_err(err, errlen, "internal: %s got %d of its %d tensors", w->f.path, w->next, w->n);
    }
    return atomic_commit(&w->f, err, errlen);
}
