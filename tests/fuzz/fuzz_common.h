/* Shared by the libFuzzer harnesses: a byte reader over the input, a trace
 * of the calls made (printed when a check fails), and the error-code rule.
 *
 * The error-code rule (include/vpager.h, Conventions): every call returns
 * VP_OK or a negative VP_E* code (VP_MISS only where documented), and
 * after a failure vp_last_error() is a non-empty message. The harness
 * clears the message before each call when it can reach the library's
 * internal vp__clear_error (a weak reference: the harness still builds if
 * it goes away, and then only checks that some message is there). */
#ifndef VP_FUZZ_COMMON_H
#define VP_FUZZ_COMMON_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vpager.h"

/* ---------------------------------------------------------------- reader */

typedef struct fz_reader {
  const uint8_t *p;
  size_t n, i;
} fz_reader_t;

static inline bool fz_more(const fz_reader_t *r) { return r->i < r->n; }

static inline uint8_t fz_u8(fz_reader_t *r) {
  return r->i < r->n ? r->p[r->i++] : 0;
}

static inline uint16_t fz_u16(fz_reader_t *r) {
  uint16_t v = fz_u8(r);
  return (uint16_t)(v | (uint16_t)fz_u8(r) << 8);
}

static inline uint32_t fz_u32(fz_reader_t *r) {
  uint32_t v = fz_u16(r);
  return v | (uint32_t)fz_u16(r) << 16;
}

static inline uint64_t fz_u64(fz_reader_t *r) {
  uint64_t v = fz_u32(r);
  return v | (uint64_t)fz_u32(r) << 32;
}

/* 0 .. n-1 (0 when n is 0), reading as few bytes as n needs. */
static inline uint64_t fz_below(fz_reader_t *r, uint64_t n) {
  if (n <= 1) return 0;
  if (n <= 256) return fz_u8(r) % n;
  if (n <= 65536) return fz_u16(r) % n;
  if (n <= (1ull << 32)) return fz_u32(r) % n;
  return fz_u64(r) % n;
}

/* ----------------------------------------------------------------- trace */

#define FZ_TRACE_LINES 1024
#define FZ_TRACE_WIDTH 200

static char fz_trace_buf[FZ_TRACE_LINES][FZ_TRACE_WIDTH];
static unsigned fz_trace_n;  /* lines written for this input */
static bool fz_trace_live;   /* FUZZ_TRACE=1: print each line as it comes */
static bool fz_quiet;        /* FZ_CALL leaves no trace line (checks) */
static unsigned fz_opno;     /* the harness's operation number, shown */

static inline void fz_trace_reset(void) { fz_trace_n = 0, fz_opno = 0; }

__attribute__((format(printf, 1, 2))) static inline void
fz_trace(const char *fmt, ...) {
  char *line = fz_trace_buf[fz_trace_n++ % FZ_TRACE_LINES];
  int at = snprintf(line, FZ_TRACE_WIDTH, "#%-3u ", fz_opno);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line + at, FZ_TRACE_WIDTH - (size_t)at, fmt, ap);
  va_end(ap);
  if (fz_trace_live) fprintf(stderr, "trace: %s\n", line);
}

static inline void fz_trace_dump(void) {
  unsigned n = fz_trace_n, first = n > FZ_TRACE_LINES ? n - FZ_TRACE_LINES : 0;
  fprintf(stderr, "==== call trace (%u lines%s) ====\n", n,
          first ? ", oldest dropped" : "");
  for (unsigned i = first; i < n; i++)
    fprintf(stderr, "  %s\n", fz_trace_buf[i % FZ_TRACE_LINES]);
  fprintf(stderr, "==== end of trace ====\n");
}

/* AddressSanitizer reports (a crash in a worker thread too) come with the
 * trace. (libFuzzer owns the death callback; UBSan reports have no hook:
 * rerun with FUZZ_TRACE=1 to see the calls.) */
void __asan_set_error_report_callback(void (*callback)(const char *));

static inline void fz_trace_dump_report(const char *report) {
  (void)report;
  fz_trace_dump();
}

static inline void fz_dump_on_death(void) {
  __asan_set_error_report_callback(fz_trace_dump_report);
}

/* A check failed: print the trace and the reason, then abort (libFuzzer
 * saves the input as a crash). */
__attribute__((format(printf, 1, 2), noreturn)) static inline void
fz_fail(const char *fmt, ...) {
  if (!fz_trace_live) fz_trace_dump();
  fprintf(stderr, "FUZZ CHECK FAILED: ");
  va_list ap;
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fprintf(stderr, "\n  vp_last_error: \"%s\"\n", vp_last_error());
  fflush(stderr);
  abort();
}

/* ------------------------------------------------------ error-code rule */

extern void vp__clear_error(void) __attribute__((weak));

static inline void fz_pre(void) {
  if (vp__clear_error) vp__clear_error();
}

static inline const char *fz_name(int rc) { return vp_err_name(rc); }

/* Checks the rule for one result; returns rc. miss_ok: VP_MISS is a
 * documented outcome of this function. */
static inline int fz_rule(const char *fn, int rc, bool miss_ok) {
  bool known = rc == VP_OK || (miss_ok && rc == VP_MISS) ||
               (rc <= VP_EINVAL && rc >= VP_ELIMIT);
  if (!known) fz_fail("%s returned %d (%s), not VP_OK%s or a VP_E* code", fn,
                      rc, vp_err_name(rc), miss_ok ? "/VP_MISS" : "");
  if (rc < 0) {
    const char *m = vp_last_error();
    if (!m || !m[0])
      fz_fail("%s returned %s with an empty vp_last_error()", fn,
              vp_err_name(rc));
    if (!memchr(m, '\0', 512))
      fz_fail("%s: vp_last_error() is not terminated", fn);
  }
  return rc;
}

/* Call, check the rule, trace "name(args) = CODE". */
#define FZ_CALL(miss_ok, call, ...)                                            \
  (fz_pre(), fz_after(#call, (call), (miss_ok), __VA_ARGS__))

__attribute__((format(printf, 4, 5))) static inline int
fz_after(const char *text, int rc, bool miss_ok, const char *fmt, ...) {
  const char *paren = strchr(text, '(');
  int fnlen = paren ? (int)(paren - text) : (int)strlen(text);
  if (!fz_quiet) {
    char args[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    fz_trace("%.*s(%s) = %s", fnlen, text, args, vp_err_name(rc));
  }
  if (rc == VP_OK) return rc;
  char fn[64];
  snprintf(fn, sizeof fn, "%.*s", fnlen, text);
  fz_rule(fn, rc, miss_ok);
  return rc;
}

/* FUZZ_SKIP=name,name: checks a campaign leaves out while a known bug is
 * open (documented in README.md). */
static inline bool fz_skip(const char *name) {
  const char *s = getenv("FUZZ_SKIP");
  if (!s) return false;
  size_t n = strlen(name);
  for (const char *p = s; (p = strstr(p, name)); p += n)
    if ((p == s || p[-1] == ',') && (p[n] == '\0' || p[n] == ','))
      return true;
  return false;
}

#endif /* VP_FUZZ_COMMON_H */
