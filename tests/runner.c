/* The test runner: every registered test in a child process, per backend.
 *
 *   runner [-l] [-v] [filter...]
 *     -l       list the tests (backend/name) and exit
 *     -v       show every test's output, not only a failing one's
 *     filter   run only tests whose "backend/name" contains one of these
 *
 * One line per test ("ok   sim/fault_basic", "FAIL sim/x (signal 11)"),
 * one "skip" line per missing backend (and per test_gpu.c test on the
 * stand-in CUDA driver of make check-cuda-fake), then "N skipped" and last
 * "N passed, N failed". Exit status 1 if any test failed.
 *
 * A child gets its own process group (so a test's own children die with
 * it), a timeout (alarm; TEST_TIMEOUT seconds, default 60, 300 under
 * sanitizers), and its stdout and stderr in a temporary file that the
 * runner prints when the test fails. On Windows, which has no fork, the
 * child is this program started again with "--child backend/name", in a
 * job object (its children die with it), timed by the runner
 * (child_win32.c); a test TEST_EXCLUDED there is listed with its reason
 * ("excluded sim/x: why") and counted as skipped.
 *
 * Also the shared helpers of test.h.
 */
#include "test.h"

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <time.h>

#include "backend.h" /* vp__hip_use_library */
#include "compat.h"
#include "peer.h"

extern char **environ;

/* ------------------------------------------------------------ registry */

typedef struct test_entry {
  const char *name;
  test_fn_t fn;
  int flags;
  const char *file;
  int line;
  const char *excluded; /* why this platform cannot run it; NULL: it can */
} test_entry_t;

static test_entry_t *g_tests;
static size_t g_ntests, g_cap;

void test_register(const char *name, test_fn_t fn, int flags,
                   const char *file, int line) {
  if (g_ntests == g_cap) {
    g_cap = g_cap ? 2 * g_cap : 64;
    g_tests = realloc(g_tests, g_cap * sizeof *g_tests);
    if (!g_tests) abort();
  }
  g_tests[g_ntests++] = (test_entry_t){name, fn, flags, file, line, NULL};
}

void test_exclude(const char *name, int flags, const char *why,
                  const char *file, int line) {
  test_register(name, NULL, flags, file, line);
  g_tests[g_ntests - 1].excluded = why;
}

static int entry_cmp(const void *a, const void *b) {
  const test_entry_t *x = a, *y = b;
  int c = strcmp(x->file, y->file);
  if (c) return c;
  return x->line - y->line;
}

/* ------------------------------------------------------------- asserts */

static char g_note[512];

void test_note(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_note, sizeof g_note, fmt, ap);
  va_end(ap);
}

void test_log(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vprintf(fmt, ap);
  va_end(ap);
  putchar('\n');
  fflush(stdout);
}

void test_fail(const char *file, int line, const char *fmt, ...) {
  va_list ap;
  fflush(stdout);
  fprintf(stderr, "%s:%d: ", file, line);
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputc('\n', stderr);
  if (g_note[0]) fprintf(stderr, "  note: %s\n", g_note);
  fflush(stderr);
  /* _exit: no LeakSanitizer report of what a failed test left open. */
  _exit(1);
}

void test_assert_mem_eq(const char *file, int line, const char *an,
                        const char *bn, const void *a, const void *b,
                        size_t n) {
  const unsigned char *x = a, *y = b;
  for (size_t i = 0; i < n; i++) {
    if (x[i] != y[i])
      test_fail(file, line,
                "ASSERT_MEM_EQ(%s, %s, %zu): first difference at byte %zu: "
                "0x%02x vs 0x%02x",
                an, bn, n, i, x[i], y[i]);
  }
}

/* ------------------------------------------------------------- helpers */

uint64_t test_scale(uint64_t n) {
  double f = TEST_SANITIZED ? 0.25 : 1.0;
  const char *e = getenv("TEST_SCALE");
  if (e && *e) {
    char *end;
    double v = strtod(e, &end);
    if (end != e && v > 0) f = v;
  }
  double r = (double)n * f;
  return r < 1 ? 1 : (uint64_t)r;
}

uint64_t test_seed(void) {
  const char *e = getenv("TEST_SEED");
  if (e && *e) return strtoull(e, NULL, 0);
  return 20261129;
}

uint64_t test_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

void test_sleep_ms(unsigned ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

static uint64_t splitmix64(uint64_t *x) {
  uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void test_rng_seed(test_rng_t *r, uint64_t seed) {
  for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&seed);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t test_rand(test_rng_t *r) {
  uint64_t *s = r->s;
  uint64_t result = rotl(s[1] * 5, 7) * 9;
  uint64_t t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = rotl(s[3], 45);
  return result;
}

uint64_t test_rand_below(test_rng_t *r, uint64_t n) {
  return n ? test_rand(r) % n : 0;
}

uint64_t test_page_size(test_ctx_t *ctx) {
  return ctx->backend == VP_BACKEND_SIM ? (64u << 10) : (2u << 20);
}

void test_options(test_ctx_t *ctx, vp_options_t *opts) {
  ASSERT_OK(vp_options_init(opts));
  opts->backend = ctx->backend;
  opts->page_size = test_page_size(ctx);
  opts->headroom = 0;
  opts->poll_interval_us = 0;
  opts->evict_order = VP_ORDER_TAIL_FIRST;
  opts->sim_capacity = 16 * opts->page_size;
  opts->sim_granularity = 64u << 10;
  opts->sim_streams = VP_SIM_SYNC;
  opts->sim_shared[0] = '\0';
  opts->sim_fail_nth = 0;
}

vp_device_t test_open(test_ctx_t *ctx, vp_options_t *opts) {
  vp_options_t o;
  if (!opts) {
    test_options(ctx, &o);
    opts = &o;
  }
  vp_device_t dev = {0};
  ASSERT_OK(vp_device_open(opts, &dev));
  return dev;
}

vp_device_t test_open_cap(test_ctx_t *ctx, vp_options_t *opts,
                          uint64_t pages) {
  vp_options_t o;
  if (!opts) {
    test_options(ctx, &o);
    opts = &o;
  }
  if (ctx->backend == VP_BACKEND_SIM) {
    opts->sim_capacity = pages * opts->page_size;
    return test_open(ctx, opts);
  }
  /* A real GPU: keep everything but `pages` pages free as headroom. */
  vp_device_t dev = test_open(ctx, opts);
  vp_device_info_t info = test_info(dev);
  uint64_t want = pages * opts->page_size;
  ASSERT_GE_U64(info.free_memory, want);
  ASSERT_OK(vp_device_set_headroom(dev, (int64_t)(info.free_memory - want)));
  return dev;
}

vp_vbar_t test_vbar(vp_device_t dev, uint64_t size) {
  vp_vbar_t v = {0};
  ASSERT_OK(vp_vbar_create(dev, size, &v));
  return v;
}

uint64_t test_vbar_base(vp_vbar_t v) {
  uint64_t base = 0;
  ASSERT_OK(vp_vbar_base(v, &base));
  return base;
}

uint8_t test_resid(vp_vbar_t v, uint64_t page) {
  uint64_t n = 0;
  ASSERT_OK(vp_vbar_page_count(v, &n));
  ASSERT_LT_U64(page, n);
  uint8_t *flags = calloc(page + 1, 1);
  ASSERT_NOT_NULL(flags);
  ASSERT_OK(vp_vbar_residency(v, flags, page + 1));
  uint8_t f = flags[page];
  free(flags);
  return f;
}

const char *test_map(vp_vbar_t v) {
  static char buf[1024];
  uint64_t n = 0;
  ASSERT_OK(vp_vbar_page_count(v, &n));
  if (n > sizeof buf - 1) n = sizeof buf - 1;
  uint8_t flags[sizeof buf];
  ASSERT_OK(vp_vbar_residency(v, flags, n));
  for (uint64_t i = 0; i < n; i++)
    buf[i] = (flags[i] & VP_PAGE_PINNED)     ? 'P'
             : (flags[i] & VP_PAGE_RESIDENT) ? '#'
                                             : '.';
  buf[n] = '\0';
  return buf;
}

uint64_t test_resident_count(vp_vbar_t v) {
  uint64_t n = 0, c = 0;
  ASSERT_OK(vp_vbar_page_count(v, &n));
  uint8_t *flags = calloc(n ? n : 1, 1);
  ASSERT_NOT_NULL(flags);
  ASSERT_OK(vp_vbar_residency(v, flags, n));
  for (uint64_t i = 0; i < n; i++) c += (flags[i] & VP_PAGE_RESIDENT) != 0;
  free(flags);
  return c;
}

vp_stats_t test_dev_stats(vp_device_t dev) {
  vp_stats_t s;
  memset(&s, 0, sizeof s);
  s.size = sizeof s;
  ASSERT_OK(vp_device_stats(dev, &s));
  return s;
}

vp_stats_t test_vbar_stats(vp_vbar_t v) {
  vp_stats_t s;
  memset(&s, 0, sizeof s);
  s.size = sizeof s;
  ASSERT_OK(vp_vbar_stats(v, &s));
  return s;
}

vp_device_info_t test_info(vp_device_t dev) {
  vp_device_info_t info;
  memset(&info, 0, sizeof info);
  ASSERT_OK(vp_device_info(dev, &info));
  return info;
}

uint64_t test_watermark(vp_vbar_t v) {
  uint64_t w = 0;
  ASSERT_OK(vp_vbar_get_watermark(v, &w));
  return w;
}

/* The page size of v's device, without a device call (works on a broken
 * device too). */
static uint64_t vbar_page_size(vp_vbar_t v) {
  uint64_t size = 0, pages = 0;
  ASSERT_OK(vp_vbar_size(v, &size));
  ASSERT_OK(vp_vbar_page_count(v, &pages));
  ASSERT_GT_U64(pages, 0);
  return size / pages;
}

int test_fault_page(vp_vbar_t v, uint64_t page, uint32_t *gen) {
  uint64_t ps = vbar_page_size(v);
  uint32_t g = 0;
  int rc = vp_fault(v, page * ps, ps, &g, 1);
  if (gen) *gen = g;
  return rc;
}

void test_load_pages(vp_vbar_t v, uint64_t first, uint64_t n) {
  uint64_t ps = vbar_page_size(v);
  for (uint64_t p = first; p < first + n; p++) {
    ASSERT_OK(vp_fault(v, p * ps, ps, NULL, 0));
    ASSERT_OK(vp_unpin(v, p * ps, ps, 0));
  }
}

void test_pattern(void *buf, size_t size, uint64_t key) {
  uint64_t x = key * 0x2545f4914f6cdd1dull + 1;
  unsigned char *b = buf;
  size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    uint64_t v = splitmix64(&x);
    memcpy(b + i, &v, 8);
  }
  if (i < size) {
    uint64_t v = splitmix64(&x);
    memcpy(b + i, &v, size - i);
  }
}

void test_write_pattern(vp_device_t dev, uint64_t addr, uint64_t size,
                        uint64_t key) {
  unsigned char *src = malloc(size), *back = malloc(size);
  ASSERT_NOT_NULL(src);
  ASSERT_NOT_NULL(back);
  test_pattern(src, size, key);
  ASSERT_OK(vp_copy_to_device(dev, addr, src, size, 0));
  ASSERT_OK(vp_stream_synchronize(dev, 0));
  memset(back, 0, size);
  ASSERT_OK(vp_copy_to_host(dev, back, addr, size, 0));
  ASSERT_OK(vp_stream_synchronize(dev, 0));
  ASSERT_MEM_EQ(back, src, size);
  free(src);
  free(back);
}

bool test_check_pattern(vp_device_t dev, uint64_t addr, uint64_t size,
                        uint64_t key) {
  unsigned char *want = malloc(size), *got = malloc(size);
  ASSERT_NOT_NULL(want);
  ASSERT_NOT_NULL(got);
  test_pattern(want, size, key);
  memset(got, 0, size);
  ASSERT_OK(vp_copy_to_host(dev, got, addr, size, 0));
  ASSERT_OK(vp_stream_synchronize(dev, 0));
  bool same = memcmp(want, got, size) == 0;
  free(want);
  free(got);
  return same;
}

void test_clear_vpager_env(void) {
  for (;;) {
    char **e = environ, name[256];
    for (; e && *e; e++)
      if (strncmp(*e, "VPAGER_", 7) == 0) break;
    if (!e || !*e) return;
    size_t n = strcspn(*e, "=");
    if (n >= sizeof name) n = sizeof name - 1;
    memcpy(name, *e, n);
    name[n] = '\0';
    unsetenv(name);
  }
}

int test_wait(int pid) {
  int st = 0;
  while (waitpid(pid, &st, 0) < 0) {
    if (errno != EINTR) TEST_FAIL("waitpid(%d): %s", pid, strerror(errno));
  }
  return st;
}

static char g_self[4096];

const char *test_self_path(void) { return g_self; }

/* ------------------------------------------------------------- backends */

typedef struct backend {
  const char *name;
  int kind;
  bool present;
  bool stand_in; /* CUDA's driver is tests/fakecuda's */
  char reason[512];
} backend_t;

/* Why a TEST_CUDA_ONLY test does not run on the stand-in driver. */
#define STAND_IN_SKIP                                                          \
  "the CUDA driver is the stand-in of tests/fakecuda (no PTX, no driver "     \
  "calls of the test's own)"

/* Open and close a GPU of backend `kind`: VP_OK, else the code and why in
 * msg. */
static int open_gpu(int kind, char *msg, size_t len) {
  vp_options_t o;
  int rc = vp_options_init(&o);
  if (rc == VP_OK) {
    vp_device_t dev;
    o.backend = kind;
    o.page_size = 2u << 20;
    rc = vp_device_open(&o, &dev);
    if (rc == VP_OK) rc = vp_device_close(dev);
  }
  snprintf(msg, len, "%s", rc == VP_OK ? "" : vp_last_error());
  return rc;
}

/* What the probe's open said, as b's presence or the reason it is not. */
static void probe_result(backend_t *b, int rc, const char *rest) {
  if (rc == VP_OK) {
    b->present = true;
  } else if (rc == VP_ENODEV) {
    snprintf(b->reason, sizeof b->reason, "%s", *rest ? rest : "VP_ENODEV");
  } else {
    snprintf(b->reason, sizeof b->reason, "open failed: %s: %s",
             vp_err_name(rc), rest);
  }
}

#ifdef _WIN32
/* Each test is a new process here: the runner may initialise the GPU. Quiet:
 * the skip line says why it failed. */
static void probe_gpu(backend_t *b) {
  char msg[512];
  int level = vp_get_log_level();
  vp_set_log_level(VP_LOG_NONE);
  int rc = open_gpu(b->kind, msg, sizeof msg);
  vp_set_log_level(level);
  probe_result(b, rc, msg);
}
#else
/* Probe a GPU backend in a child: CUDA (or HIP) must not be initialised in
 * the runner, or no forked test could use it. */
static void probe_gpu(backend_t *b) {
  int fds[2];
  if (pipe(fds) != 0) {
    snprintf(b->reason, sizeof b->reason, "pipe: %s", strerror(errno));
    return;
  }
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    int devnull = open("/dev/null", O_WRONLY);
    if (devnull >= 0) dup2(devnull, STDERR_FILENO); /* the backend's log */
    char msg[512], why[480];
    int rc = open_gpu(b->kind, why, sizeof why);
    /* The stand-in driver (make check-cuda-fake) says what it is. */
    void *cuda = b->kind == VP_BACKEND_CUDA && rc == VP_OK
                     ? dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD)
                     : NULL;
    int stand_in = cuda && dlsym(cuda, "vp_fake_cuda_driver");
    int n = snprintf(msg, sizeof msg, "%d %d %s", rc, stand_in, why);
    if (n > 0 && write(fds[1], msg, (size_t)n) < 0) _exit(2);
    _exit(0);
  }
  close(fds[1]);
  char buf[512] = {0};
  size_t got = 0;
  ssize_t r;
  while (got < sizeof buf - 1 &&
         (r = read(fds[0], buf + got, sizeof buf - 1 - got)) != 0) {
    if (r < 0) {
      if (errno == EINTR) continue;
      break;
    }
    got += (size_t)r;
  }
  close(fds[0]);
  int st = 0;
  while (pid > 0 && waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  int rc = VP_ENODEV;
  char *rest = buf;
  if (got > 0) rc = (int)strtol(buf, &rest, 10);
  b->stand_in = strtol(rest, &rest, 10) != 0;
  while (*rest == ' ') rest++;
  if (pid < 0 || got == 0)
    snprintf(b->reason, sizeof b->reason, "probe process failed");
  else
    probe_result(b, rc, rest);
}
#endif

/* ------------------------------------------------------------- running */

static unsigned timeout_s(void) {
  const char *e = getenv("TEST_TIMEOUT");
  if (e && *e) {
    long v = strtol(e, NULL, 10);
    if (v > 0) return (unsigned)v;
  }
  return TEST_SANITIZED ? 300 : 60;
}

static bool selected(const char *full, int argc, char **filters) {
  if (argc == 0) return true;
  for (int i = 0; i < argc; i++)
    if (strstr(full, filters[i])) return true;
  return false;
}

static void print_output(FILE *f) {
  char line[4096];
  fflush(f);
  rewind(f);
  while (fgets(line, sizeof line, f)) {
    fputs("    ", stdout);
    fputs(line, stdout);
    size_t n = strlen(line);
    if (n && line[n - 1] != '\n') putchar('\n');
  }
}

/* The test itself, in its child process: from a clean VPAGER_ environment
 * (tests choose their options; only the log level comes from outside).
 * Exits 0 when it passed; a failed assert exits 1 first. */
static void child_run(const test_entry_t *t, const backend_t *b) {
  const char *log = getenv("VPAGER_LOG");
  char logbuf[64] = "";
  if (log) snprintf(logbuf, sizeof logbuf, "%s", log);
  test_clear_vpager_env();
  if (logbuf[0]) setenv("VPAGER_LOG", logbuf, 1);
  test_ctx_t ctx = {t->name, b->name, b->kind};
  t->fn(&ctx);
  fflush(stdout);
  fflush(stderr);
  exit(0);
}

/* How the test went, printed: true when it passed. */
static bool report(const test_entry_t *t, const backend_t *b, bool verbose,
                   const char *why, uint64_t ms, FILE *out) {
  bool ok = why[0] == '\0';
  if (ok)
    printf("ok   %s/%s\n", b->name, t->name);
  else
    printf("FAIL %s/%s (%s)\n", b->name, t->name, why);
  if (verbose) printf("    (%" PRIu64 " ms)\n", ms);
  if (!ok || verbose) print_output(out);
  fflush(stdout);
  fclose(out);
  return ok;
}

#ifdef _WIN32
/* Run one test in a child: this program again, with --child. */
static bool run_one(const test_entry_t *t, const backend_t *b, bool verbose) {
  char full[256], why[64] = "";
  snprintf(full, sizeof full, "%s/%s", b->name, t->name);
  fflush(stdout);
  fflush(stderr);
  uint64_t t0 = test_now_ms();
  FILE *out = test_child_run(g_self, full, timeout_s(), why, sizeof why);
  if (!out) {
    printf("FAIL %s (%s)\n", full, why);
    return false;
  }
  return report(t, b, verbose, why, test_now_ms() - t0, out);
}
#else
/* Run one test in a child; true when it passed. */
static bool run_one(const test_entry_t *t, const backend_t *b, bool verbose) {
  FILE *out = tmpfile();
  if (!out) {
    printf("FAIL %s/%s (tmpfile: %s)\n", b->name, t->name, strerror(errno));
    return false;
  }
  fflush(stdout);
  fflush(stderr);
  uint64_t t0 = test_now_ms();
  pid_t pid = fork();
  if (pid < 0) {
    printf("FAIL %s/%s (fork: %s)\n", b->name, t->name, strerror(errno));
    fclose(out);
    return false;
  }
  if (pid == 0) {
    setpgid(0, 0);
    dup2(fileno(out), STDOUT_FILENO);
    dup2(fileno(out), STDERR_FILENO);
    setvbuf(stdout, NULL, _IOLBF, 0);
    alarm(timeout_s());
    child_run(t, b);
  }
  setpgid(pid, pid);
  int st = 0;
  while (waitpid(pid, &st, 0) < 0) {
    if (errno != EINTR) break;
  }
  kill(-pid, SIGKILL); /* whatever the test left running */
  uint64_t ms = test_now_ms() - t0;
  char why[64] = "";
  if (WIFEXITED(st) && WEXITSTATUS(st) != 0)
    snprintf(why, sizeof why, "exit %d", WEXITSTATUS(st));
  else if (WIFSIGNALED(st) && WTERMSIG(st) == SIGALRM)
    snprintf(why, sizeof why, "timeout");
  else if (WIFSIGNALED(st))
    snprintf(why, sizeof why, "signal %d", WTERMSIG(st));
  return report(t, b, verbose, why, ms, out);
}
#endif

/* Hidden mode for test_options.c: print the initial log level. */
static int print_log_level(void) {
  printf("%d\n", vp_get_log_level());
  return 0;
}

/* The name filters; a file-scope pointer, so the forked test children,
 * which exit without freeing it, do not leak it for LeakSanitizer (at -O2
 * main's copy of the pointer may be gone from its stack). */
static char **g_filters;

#ifdef _WIN32
/* The test named `full` ("backend/name") and its backend: false if none. */
static bool find_test(const backend_t *backends, int nb, const char *full,
                      const test_entry_t **t, const backend_t **b) {
  for (int bi = 0; bi < nb; bi++) {
    size_t n = strlen(backends[bi].name);
    if (strncmp(full, backends[bi].name, n) != 0 || full[n] != '/') continue;
    for (size_t i = 0; i < g_ntests; i++) {
      if (g_tests[i].fn && strcmp(g_tests[i].name, full + n + 1) == 0) {
        *t = &g_tests[i];
        *b = &backends[bi];
        return true;
      }
    }
  }
  fprintf(stderr, "runner: no test %s\n", full);
  return false;
}

/* The modes of Windows' runner started again, in place of a fork: a test
 * (--child backend/name), or a peer of one (--peer backend/name OFFSET
 * IN OUT, peer.c). Neither returns on success. */
static int run_child(const backend_t *backends, int nb, const char *full) {
  const test_entry_t *t;
  const backend_t *b;
  if (find_test(backends, nb, full, &t, &b)) child_run(t, b);
  return 2;
}

static int run_peer(const backend_t *backends, int nb, char **argv) {
  const test_entry_t *t;
  const backend_t *b;
  if (!find_test(backends, nb, argv[0], &t, &b)) return 2;
  test_ctx_t ctx = {t->name, b->name, b->kind};
  uintptr_t offset = (uintptr_t)strtoull(argv[1], NULL, 16);
  int in = _open_osfhandle((intptr_t)strtoull(argv[2], NULL, 10),
                           _O_RDONLY | _O_BINARY);
  int out = _open_osfhandle((intptr_t)strtoull(argv[3], NULL, 10),
                            _O_WRONLY | _O_BINARY);
  if (in < 0 || out < 0) return 2;
  peer_serve(&ctx, offset, in, out);
}
#endif

int main(int argc, char **argv) {
  bool list = false, verbose = false;
  int nf = 0;
  g_filters = calloc((size_t)argc + 1, sizeof *g_filters);
  char **filters = g_filters;
  if (!filters) return 2;
  /* A stand-in HIP runtime (make check-hip: tests/fakehip/), for the
   * runner, its probe and every test it starts. */
  const char *hip = getenv("TEST_HIP_LIBRARY");
  if (hip && *hip) vp__hip_use_library(hip);
#ifdef _WIN32
  _fmode = _O_BINARY; /* the tests' files hold bytes, not text */
  _setmode(_fileno(stdout), _O_BINARY); /* "\n" lines, as make check reads */
  _setmode(_fileno(stderr), _O_BINARY);
  test_self_exe(g_self, sizeof g_self);
#else
  ssize_t n = readlink("/proc/self/exe", g_self, sizeof g_self - 1);
  if (n > 0) g_self[n] = '\0';
  else snprintf(g_self, sizeof g_self, "%s", argv[0]);
#endif
  backend_t backends[] = {{"sim", VP_BACKEND_SIM, true, false, ""},
                          {"cuda", VP_BACKEND_CUDA, false, false, ""},
                          {"hip", VP_BACKEND_HIP, false, false, ""}};
  const int nb = (int)(sizeof backends / sizeof *backends);
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--print-log-level") == 0) {
      free(filters);
      return print_log_level();
    }
#ifdef _WIN32
    if (strcmp(argv[i], "--child") == 0 && i + 1 < argc) {
      free(filters);
      test_child_guard();
      setvbuf(stdout, NULL, _IOLBF, 0);
      return run_child(backends, nb, argv[i + 1]);
    }
    if (strcmp(argv[i], "--peer") == 0 && i + 4 < argc) {
      free(filters);
      test_child_guard();
      setvbuf(stdout, NULL, _IOLBF, 0);
      return run_peer(backends, 2, argv + i + 1);
    }
#endif
    if (strcmp(argv[i], "-l") == 0) list = true;
    else if (strcmp(argv[i], "-v") == 0) verbose = true;
    else filters[nf++] = argv[i];
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  qsort(g_tests, g_ntests, sizeof *g_tests, entry_cmp);
  for (int bi = 1; bi < nb; bi++) probe_gpu(&backends[bi]);

  int passed = 0, failed = 0, skipped = 0, excluded = 0;
  for (int bi = 0; bi < nb; bi++) {
    backend_t *b = &backends[bi];
    int want = 0;
    for (size_t i = 0; i < g_ntests; i++) {
      const test_entry_t *t = &g_tests[i];
      bool sim = b->kind == VP_BACKEND_SIM;
      if ((t->flags & TEST_SIM_ONLY) && !sim) continue;
      if ((t->flags & TEST_GPU_ONLY) && sim) continue;
      if ((t->flags & TEST_CUDA_ONLY) && b->kind != VP_BACKEND_CUDA) continue;
      char full[256];
      snprintf(full, sizeof full, "%s/%s", b->name, t->name);
      if (!selected(full, nf, filters)) continue;
      want++;
      if (!b->present) continue;
      if (t->excluded) {
        if (!list) printf("excluded %s: %s\n", full, t->excluded);
        excluded++;
        continue;
      }
      if ((t->flags & TEST_CUDA_ONLY) && b->stand_in) {
        if (!list) printf("skip %s (%s)\n", full, STAND_IN_SKIP);
        skipped++;
        continue;
      }
      if (list) {
        printf("%s\n", full);
        continue;
      }
      if (run_one(t, b, verbose)) passed++;
      else failed++;
    }
    if (!b->present && want > 0) {
      printf("skip %s/* (%s)\n", b->name, b->reason);
      skipped += want;
    }
  }
  free(filters);
  if (list) return 0;
  if (excluded) printf("%d excluded on this platform\n", excluded);
  printf("%d skipped\n", skipped + excluded);
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}

#ifndef _WIN32
/* The entries of a /proc folder (its own DIR's descriptor among them:
 * counts compare, they are not values). */
static int count_dir(const char *path) {
  DIR *d = opendir(path);
  if (!d) return -1;
  int n = 0;
  for (struct dirent *e; (e = readdir(d));)
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n;
}

int test_fd_count(void) { return count_dir("/proc/self/fd"); }
int test_thread_count(void) { return count_dir("/proc/self/task"); }

uint64_t test_vm_size(void) {
  FILE *f = fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  uint64_t kb = 0;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "VmSize: %" SCNu64, &kb) == 1) break;
  fclose(f);
  return kb * 1024;
}
#endif

void test_make_dir(char *dir, size_t len, const char *tag) {
  snprintf(dir, len, "%s/vpager-%s-XXXXXX", test_tmp_dir(), tag);
  ASSERT_NOT_NULL(mkdtemp(dir));
}

void test_write_file(const char *path, const void *buf, size_t size) {
  FILE *f = fopen(path, "wb");
  ASSERT_NOT_NULL(f);
  ASSERT_EQ_U64(fwrite(buf, 1, size, f), size);
  ASSERT_EQ_INT(fclose(f), 0);
}

void test_rm_dir(const char *dir) {
  DIR *d = opendir(dir);
  ASSERT_NOT_NULL(d);
  struct dirent *e;
  char path[512];
  while ((e = readdir(d))) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    if (unlink(path) != 0) ASSERT_EQ_INT(rmdir(path), 0);
  }
  closedir(d);
  ASSERT_EQ_INT(rmdir(dir), 0);
}
