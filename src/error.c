/* Error codes, their names and texts, and the per-thread last message. */
#include <stdarg.h>
#include <stdio.h>

#include "internal.h"

static _Thread_local char last_error[512];

const char *vp_strerror(int code) {
  switch (code) {
  case VP_OK: return "success";
  case VP_MISS: return "range cannot be made resident now";
#define VP__ERR_TEXT(name, value, text) case VP_##name: return text;
  VP_ERRNO_MAP(VP__ERR_TEXT)
#undef VP__ERR_TEXT
  }
  return "unknown error code";
}

const char *vp_err_name(int code) {
  switch (code) {
  case VP_OK: return "VP_OK";
  case VP_MISS: return "VP_MISS";
#define VP__ERR_NAME(name, value, text) case VP_##name: return "VP_" #name;
  VP_ERRNO_MAP(VP__ERR_NAME)
#undef VP__ERR_NAME
  }
  return "VP_UNKNOWN";
}

const char *vp_last_error(void) { return last_error; }

void vp__clear_error(void) { last_error[0] = '\0'; }

/* The public function this thread is in (VP__ENTER), named by every
 * message it leaves. */
static _Thread_local const char *entry_name;

void vp__api_enter(const char *fn) { entry_name = fn; }

/* Record "entry: message (VP_CODE)" for this thread; returns code. */
int vp__err(int code, const char *fmt, ...) {
  size_t len = sizeof last_error;
  int n = snprintf(last_error, len, "%s: ", entry_name ? entry_name : "vpager");
  va_list ap;
  va_start(ap, fmt);
  int m = vsnprintf(last_error + n, len - (size_t)n, fmt, ap);
  va_end(ap);
  if (m >= 0 && (size_t)(n + m) < len)
    snprintf(last_error + n + m, len - (size_t)(n + m), " (%s)",
             vp_err_name(code));
  vp__log(VP_LOG_DEBUG, NULL, "%s", last_error);
  return code;
}
