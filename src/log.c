/* Logging: one process-wide level (the library's only global setting),
 * read lazily from VPAGER_LOG. */
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define LEVEL_UNSET (-1)
static atomic_int log_level = LEVEL_UNSET;

static const char *const level_names[] = {"none", "error", "warn",
                                          "info", "debug", "trace"};

static int parse_level(const char *s) {
  if (!s || !*s) return LEVEL_UNSET;
  for (int i = 0; i <= VP_LOG_TRACE; i++)
    if (vp__os_strcasecmp(s, level_names[i]) == 0) return i;
  char *end;
  long v = strtol(s, &end, 10);
  if (*end == '\0' && v >= VP_LOG_NONE && v <= VP_LOG_TRACE) return (int)v;
  return LEVEL_UNSET - 1;
}

int vp_get_log_level(void) {
  int level = atomic_load_explicit(&log_level, memory_order_relaxed);
  if (level != LEVEL_UNSET) return level;
  const char *env = getenv("VPAGER_LOG");
  level = parse_level(env);
  if (level < 0) {
    if (level != LEVEL_UNSET)
      fprintf(stderr, "vpager: warning: VPAGER_LOG=%s is not a level "
              "(none/error/warn/info/debug/trace or 0-5); using warn\n", env);
    level = VP_LOG_WARN;
  }
  int expected = LEVEL_UNSET;
  atomic_compare_exchange_strong(&log_level, &expected, level);
  return atomic_load(&log_level);
}

void vp__log_set_level(int level) { atomic_store(&log_level, level); }

void vp__log(int level, const char *who, const char *fmt, ...) {
  if (!vp__log_on(level)) return;
  char line[640];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  fprintf(stderr, "vpager[%s] %s: %s\n", who ? who : "-",
          level_names[level], line);
}
