/* Formatted text appended to a caller's fixed buffer, counting what it
 * would need past the end (reports and JSON snapshots). */
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
