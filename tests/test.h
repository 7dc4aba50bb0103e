/* vpager's C test framework.
 *
 * Each tests/test_*.c file defines tests with TEST(name, flags); a
 * constructor registers them, so there is no central list to edit. The
 * runner (tests/runner.c) runs every test in its own child process with a
 * timeout, once per backend the flags allow, and ends with the line
 * "N passed, N failed".
 *
 * An assert that fails prints both operands with file:line and ends the
 * child at once with exit status 1 (from any thread). A test ends with its
 * devices closed: the ASan run's LeakSanitizer checks that nothing leaked.
 *
 * Environment: TEST_SCALE (a factor for iteration counts; sanitizer builds
 * use 0.25 by default), TEST_TIMEOUT (seconds per test), TEST_SEED (seed of
 * the randomized tests).
 */
#ifndef VP_TEST_H
#define VP_TEST_H

#include <inttypes.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compat.h" /* what tests use of POSIX, on Windows too */
#include "os.h"     /* VP__PRINTF: C99's formats, mingw-w64 too */
#include "vpager.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define TEST_SANITIZED 1
#endif
#endif
#ifndef TEST_SANITIZED
#define TEST_SANITIZED 0
#endif

#if defined(__SANITIZE_THREAD__)
#define TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TEST_TSAN 1
#endif
#endif
#ifndef TEST_TSAN
#define TEST_TSAN 0
#endif

/* ------------------------------------------------------------ registry */

enum {
  TEST_ALL_BACKENDS = 0x1, /* once per backend present */
  TEST_SIM_ONLY = 0x2,     /* the simulated device only */
  TEST_GPU_ONLY = 0x4,     /* the GPU backends only (CUDA, HIP) */
  TEST_CUDA_ONLY = 0x8     /* the CUDA backend only: it calls the driver */
};

typedef struct test_ctx {
  const char *name;    /* the test's name, without backend */
  const char *backend_name; /* "sim", "cuda" or "hip" */
  int backend;         /* VP_BACKEND_SIM, _CUDA or _HIP */
} test_ctx_t;

typedef void (*test_fn_t)(test_ctx_t *ctx);

void test_register(const char *name, test_fn_t fn, int flags,
                   const char *file, int line);

#define TEST(name, flags)                                                      \
  static void test_fn_##name(test_ctx_t *ctx __attribute__((unused)));         \
  __attribute__((constructor)) static void test_reg_##name(void) {             \
    test_register(#name, test_fn_##name, (flags), __FILE__, __LINE__);         \
  }                                                                            \
  static void test_fn_##name(test_ctx_t *ctx __attribute__((unused)))

/* A test this platform cannot run (it needs what the platform lacks, said
 * in `why`): the runner lists it, with why, where it would have run, and
 * counts it as skipped. Used under #ifdef _WIN32 in place of the TEST. */
void test_exclude(const char *name, int flags, const char *why,
                  const char *file, int line);
#define TEST_EXCLUDED(name, flags, why)                                        \
  __attribute__((constructor)) static void test_reg_##name(void) {             \
    test_exclude(#name, (flags), (why), __FILE__, __LINE__);                   \
  }

/* ------------------------------------------------------------- asserts */

/* Print "file:line: message" (and the note, if any) and end the test. */
__attribute__((noreturn)) VP__PRINTF(3, 4) void
test_fail(const char *file, int line, const char *fmt, ...);
/* A line printed with every failure from now on (seed, step, ...). */
VP__PRINTF(1, 2) void test_note(const char *fmt, ...);
/* Printed only when the test fails or the runner runs with -v. */
VP__PRINTF(1, 2) void test_log(const char *fmt, ...);

#define TEST_FAIL(...) test_fail(__FILE__, __LINE__, __VA_ARGS__)

#define ASSERT_TRUE(c)                                                         \
  do {                                                                         \
    if (!(c)) TEST_FAIL("ASSERT_TRUE(%s)", #c);                                \
  } while (0)
#define ASSERT_FALSE(c)                                                        \
  do {                                                                         \
    if (c) TEST_FAIL("ASSERT_FALSE(%s)", #c);                                  \
  } while (0)

#define TEST_CMP_U64_(name, a, op, b)                                          \
  do {                                                                         \
    uint64_t a_ = (uint64_t)(a), b_ = (uint64_t)(b);                           \
    if (!(a_ op b_))                                                           \
      TEST_FAIL(name "(%s, %s): %" PRIu64 " (0x%" PRIx64 ") vs %" PRIu64       \
                     " (0x%" PRIx64 ")",                                       \
                #a, #b, a_, a_, b_, b_);                                       \
  } while (0)
#define ASSERT_EQ_U64(a, b) TEST_CMP_U64_("ASSERT_EQ_U64", a, ==, b)
#define ASSERT_NE_U64(a, b) TEST_CMP_U64_("ASSERT_NE_U64", a, !=, b)
#define ASSERT_LT_U64(a, b) TEST_CMP_U64_("ASSERT_LT_U64", a, <, b)
#define ASSERT_LE_U64(a, b) TEST_CMP_U64_("ASSERT_LE_U64", a, <=, b)
#define ASSERT_GT_U64(a, b) TEST_CMP_U64_("ASSERT_GT_U64", a, >, b)
#define ASSERT_GE_U64(a, b) TEST_CMP_U64_("ASSERT_GE_U64", a, >=, b)

#define TEST_CMP_INT_(name, a, op, b)                                          \
  do {                                                                         \
    long long a_ = (long long)(a), b_ = (long long)(b);                        \
    if (!(a_ op b_))                                                           \
      TEST_FAIL(name "(%s, %s): %lld vs %lld", #a, #b, a_, b_);                \
  } while (0)
#define ASSERT_EQ_INT(a, b) TEST_CMP_INT_("ASSERT_EQ_INT", a, ==, b)
#define ASSERT_NE_INT(a, b) TEST_CMP_INT_("ASSERT_NE_INT", a, !=, b)
#define ASSERT_LT_INT(a, b) TEST_CMP_INT_("ASSERT_LT_INT", a, <, b)
#define ASSERT_LE_INT(a, b) TEST_CMP_INT_("ASSERT_LE_INT", a, <=, b)
#define ASSERT_GT_INT(a, b) TEST_CMP_INT_("ASSERT_GT_INT", a, >, b)
#define ASSERT_GE_INT(a, b) TEST_CMP_INT_("ASSERT_GE_INT", a, >=, b)

#define ASSERT_EQ_PTR(a, b)                                                    \
  do {                                                                         \
    const void *a_ = (a), *b_ = (b);                                           \
    if (a_ != b_) TEST_FAIL("ASSERT_EQ_PTR(%s, %s): %p vs %p", #a, #b, a_, b_); \
  } while (0)
#define ASSERT_NULL(a) ASSERT_EQ_PTR(a, NULL)
#define ASSERT_NOT_NULL(a)                                                     \
  do {                                                                         \
    if ((a) == NULL) TEST_FAIL("ASSERT_NOT_NULL(%s)", #a);                     \
  } while (0)

#define ASSERT_EQ_STR(a, b)                                                    \
  do {                                                                         \
    const char *a_ = (a), *b_ = (b);                                           \
    if (!a_ || !b_ || strcmp(a_, b_) != 0)                                     \
      TEST_FAIL("ASSERT_EQ_STR(%s, %s): \"%s\" vs \"%s\"", #a, #b,             \
                a_ ? a_ : "(null)", b_ ? b_ : "(null)");                       \
  } while (0)
#define ASSERT_STR_CONTAINS(hay, needle)                                       \
  do {                                                                         \
    const char *a_ = (hay), *b_ = (needle);                                    \
    if (!a_ || !strstr(a_, b_))                                                \
      TEST_FAIL("ASSERT_STR_CONTAINS(%s, %s): \"%s\" lacks \"%s\"", #hay,      \
                #needle, a_ ? a_ : "(null)", b_);                              \
  } while (0)

/* Compare n bytes; on a difference print the first differing offset. */
#define ASSERT_MEM_EQ(a, b, n) test_assert_mem_eq(__FILE__, __LINE__, #a, #b, (a), (b), (n))
void test_assert_mem_eq(const char *file, int line, const char *an,
                        const char *bn, const void *a, const void *b,
                        size_t n);

/* A call that must return VP_OK. */
#define ASSERT_OK(call)                                                        \
  do {                                                                         \
    int rc_ = (call);                                                          \
    if (rc_ != VP_OK)                                                          \
      TEST_FAIL("%s returned %d (%s), expected VP_OK; last error: %s", #call,  \
                rc_, vp_err_name(rc_), vp_last_error());                       \
  } while (0)
/* A call that must return `code`. */
#define ASSERT_RC(call, code)                                                  \
  do {                                                                         \
    int rc_ = (call), want_ = (code);                                          \
    if (rc_ != want_)                                                          \
      TEST_FAIL("%s returned %d (%s), expected %d (%s); last error: %s",       \
                #call, rc_, vp_err_name(rc_), want_, vp_err_name(want_),       \
                vp_last_error());                                              \
  } while (0)
/* A call that must return one of two codes (where the header allows both). */
#define ASSERT_RC2(call, c1, c2)                                               \
  do {                                                                         \
    int rc_ = (call), w1_ = (c1), w2_ = (c2);                                  \
    if (rc_ != w1_ && rc_ != w2_)                                              \
      TEST_FAIL("%s returned %d (%s), expected %s or %s; last error: %s",      \
                #call, rc_, vp_err_name(rc_), vp_err_name(w1_),                \
                vp_err_name(w2_), vp_last_error());                            \
  } while (0)
/* A call that must fail with a negative code and leave a message. */
#define ASSERT_FAILS(call)                                                     \
  do {                                                                         \
    int rc_ = (call);                                                          \
    if (rc_ >= 0)                                                              \
      TEST_FAIL("%s returned %d (%s), expected an error", #call, rc_,          \
                vp_err_name(rc_));                                             \
    if (vp_last_error()[0] == '\0')                                            \
      TEST_FAIL("%s failed with %s but vp_last_error() is empty", #call,       \
                vp_err_name(rc_));                                             \
  } while (0)

/* ------------------------------------------------------------- helpers */

/* Iteration counts: n scaled by TEST_SCALE (0.25 under sanitizers), >= 1. */
uint64_t test_scale(uint64_t n);
/* The seed for randomized tests: TEST_SEED, else a fixed default. */
uint64_t test_seed(void);
/* Milliseconds since an arbitrary start (CLOCK_MONOTONIC). */
uint64_t test_now_ms(void);
void test_sleep_ms(unsigned ms);

/* A deterministic PRNG (splitmix64 seeding an xoshiro256**). */
typedef struct test_rng {
  uint64_t s[4];
} test_rng_t;
void test_rng_seed(test_rng_t *r, uint64_t seed);
uint64_t test_rand(test_rng_t *r);
/* Uniform in [0, n); n > 0. */
uint64_t test_rand_below(test_rng_t *r, uint64_t n);

/* Options for the backend under test, small and deterministic: page size
 * 64 KiB (sim; 2 MiB on CUDA), sim granularity 64 KiB, sim capacity 16
 * pages, headroom 0, poll_interval_us 0, tail-first order, sync streams. */
void test_options(test_ctx_t *ctx, vp_options_t *opts);
/* Open with opts (test_options when NULL); asserts success. */
vp_device_t test_open(test_ctx_t *ctx, vp_options_t *opts);
/* Open a device whose budget is `pages` pages of opts->page_size (sim: the
 * capacity; CUDA: the headroom is set so). */
vp_device_t test_open_cap(test_ctx_t *ctx, vp_options_t *opts, uint64_t pages);
/* The page size test_options gives for this backend. */
uint64_t test_page_size(test_ctx_t *ctx);

vp_vbar_t test_vbar(vp_device_t dev, uint64_t size);
uint64_t test_vbar_base(vp_vbar_t v);
/* Residency flags of page `page` of v. */
uint8_t test_resid(vp_vbar_t v, uint64_t page);
/* A string of the residency map: '.', '#', 'P' per page (static buffer). */
const char *test_map(vp_vbar_t v);
/* Number of resident pages (per the residency map). */
uint64_t test_resident_count(vp_vbar_t v);
vp_stats_t test_dev_stats(vp_device_t dev);
vp_stats_t test_vbar_stats(vp_vbar_t v);
vp_device_info_t test_info(vp_device_t dev);
uint64_t test_watermark(vp_vbar_t v);

/* Fault one page (by index); returns the fault's rc and its generation. */
int test_fault_page(vp_vbar_t v, uint64_t page, uint32_t *gen);
/* Fault and unpin every page in [first, first+n), one by one, each must be
 * VP_OK. */
void test_load_pages(vp_vbar_t v, uint64_t first, uint64_t n);

/* Deterministic bytes from a key. */
void test_pattern(void *buf, size_t size, uint64_t key);
/* Write the pattern of `key` into `size` bytes at device address `addr`
 * (pinned) on stream 0 and synchronise; then read it back and compare. */
void test_write_pattern(vp_device_t dev, uint64_t addr, uint64_t size,
                        uint64_t key);
/* true when the `size` bytes at `addr` hold the pattern of `key`. */
bool test_check_pattern(vp_device_t dev, uint64_t addr, uint64_t size,
                        uint64_t key);

/* Remove every VPAGER_* variable from the environment. */
void test_clear_vpager_env(void);
/* Wait for a child process; returns its wait status. */
int test_wait(int pid);
/* The path of the running test binary (for re-exec). */
const char *test_self_path(void);

/* A new temporary directory /tmp/vpager-<tag>-XXXXXX (dir gets its path),
 * and its removal with the files and empty folders in it. */
void test_make_dir(char *dir, size_t len, const char *tag);
void test_rm_dir(const char *dir);
/* Write size bytes of buf to a new file at path (replacing any). */
void test_write_file(const char *path, const void *buf, size_t size);

#endif /* VP_TEST_H */
