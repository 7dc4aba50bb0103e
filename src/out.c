/* Formatted text appended to a caller's fixed buffer, counting what it
 * would need past the end (reports and JSON snapshots), and sizes as people
 * read them. */
#include <stdarg.h>
#include <stdio.h>

#include "internal.h"

void vp__put(vp__out_t *o, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  size_t room = o->pos < o->len ? o->len - o->pos : 0;
  int n = vsnprintf(room ? o->buf + o->pos : NULL, room, fmt, ap);
  va_end(ap);
  if (n > 0) o->pos += (size_t)n;
}

/* The largest binary unit the size reaches; a whole number when exact,
 * else one decimal (rounded up into the next unit when it would read
 * 1024.0). */
vp__size_text_t vp__size(uint64_t bytes) {
  static const char *const unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  vp__size_text_t t;
  int u = 0;
  while (u < 4 && bytes >> (10 * (u + 1))) u++;
  uint64_t one = 1ull << (10 * u);
  if (bytes % one == 0) {
    snprintf(t.s, sizeof t.s, "%llu %s", (unsigned long long)(bytes / one),
             unit[u]);
    return t;
  }
  double v = (double)bytes / (double)one;
  if (u < 4 && v >= 1023.95) v /= 1024, u++;
  snprintf(t.s, sizeof t.s, "%.1f %s", v, unit[u]);
  return t;
}
