/* Options: defaults, VPAGER_* environment variables, vp_parse_size, the
 * log level. */
#include "test.h"
#include "compat.h"

#define KiB (1024ull)
#define MiB (1024ull * 1024)
#define GiB (1024ull * 1024 * 1024)

static vp_options_t init_with(const char *name, const char *value) {
  vp_options_t o;
  test_clear_vpager_env();
  if (name) setenv(name, value, 1);
  ASSERT_OK(vp_options_init(&o));
  if (name) unsetenv(name);
  return o;
}

TEST(options_defaults, TEST_SIM_ONLY) {
  vp_options_t o;
  test_clear_vpager_env();
  memset(&o, 0xab, sizeof o);
  ASSERT_OK(vp_options_init(&o));
  ASSERT_EQ_U64(o.size, sizeof o);
  ASSERT_EQ_INT(o.backend, VP_BACKEND_AUTO);
  ASSERT_EQ_INT(o.device_index, 0);
  ASSERT_EQ_U64(o.page_size, 32 * MiB);
  ASSERT_EQ_INT(o.headroom, -1);
  ASSERT_EQ_U64(o.poll_interval_us, 5000);
  ASSERT_TRUE(o.evict_order == VP_ORDER_TAIL_FIRST ||
              o.evict_order == VP_ORDER_INTERLEAVED);
  ASSERT_EQ_U64(o.sim_capacity, 4 * GiB);
  ASSERT_EQ_U64(o.sim_granularity, 2 * MiB);
  ASSERT_TRUE(o.sim_streams == VP_SIM_SYNC || o.sim_streams == VP_SIM_WORKER);
  ASSERT_EQ_STR(o.sim_shared, "");
  ASSERT_EQ_INT(o.sim_fail_nth, 0);
  /* Nothing failed. */
  ASSERT_EQ_STR(vp_last_error(), "");
}

TEST(options_env, TEST_SIM_ONLY) {
  ASSERT_EQ_INT(init_with("VPAGER_BACKEND", "sim").backend, VP_BACKEND_SIM);
  ASSERT_EQ_INT(init_with("VPAGER_BACKEND", "cuda").backend, VP_BACKEND_CUDA);
  ASSERT_EQ_INT(init_with("VPAGER_BACKEND", "auto").backend, VP_BACKEND_AUTO);
  ASSERT_EQ_U64(init_with("VPAGER_SIM_CAPACITY", "64M").sim_capacity, 64 * MiB);
  ASSERT_EQ_U64(init_with("VPAGER_SIM_CAPACITY", "3G").sim_capacity, 3 * GiB);
  ASSERT_EQ_U64(init_with("VPAGER_SIM_CAPACITY", "512K").sim_capacity,
                512 * KiB);
  ASSERT_EQ_U64(init_with("VPAGER_SIM_CAPACITY", "1048576").sim_capacity, MiB);
  ASSERT_EQ_U64(init_with("VPAGER_PAGE_SIZE", "2M").page_size, 2 * MiB);
  ASSERT_EQ_INT(init_with("VPAGER_HEADROOM", "1G").headroom, (int64_t)GiB);
  ASSERT_EQ_INT(init_with("VPAGER_HEADROOM", "0").headroom, 0);
  ASSERT_EQ_U64(init_with("VPAGER_POLL_US", "100").poll_interval_us, 100);
  ASSERT_EQ_INT(init_with("VPAGER_ORDER", "interleaved").evict_order,
                VP_ORDER_INTERLEAVED);
  ASSERT_EQ_INT(init_with("VPAGER_ORDER", "tail").evict_order,
                VP_ORDER_TAIL_FIRST);
  ASSERT_EQ_INT(init_with("VPAGER_SIM_STREAMS", "worker").sim_streams,
                VP_SIM_WORKER);
  ASSERT_EQ_INT(init_with("VPAGER_SIM_STREAMS", "sync").sim_streams,
                VP_SIM_SYNC);
  ASSERT_EQ_U64(init_with("VPAGER_SIM_GRANULARITY", "64K").sim_granularity,
                64 * KiB);
  ASSERT_EQ_INT(init_with("VPAGER_DEVICE", "1").device_index, 1);
  ASSERT_EQ_STR(init_with("VPAGER_SIM_SHARED", "abc-1").sim_shared, "abc-1");

  /* Several at once. */
  test_clear_vpager_env();
  setenv("VPAGER_PAGE_SIZE", "256K", 1);
  setenv("VPAGER_SIM_CAPACITY", "8M", 1);
  vp_options_t o;
  ASSERT_OK(vp_options_init(&o));
  ASSERT_EQ_U64(o.page_size, 256 * KiB);
  ASSERT_EQ_U64(o.sim_capacity, 8 * MiB);
  test_clear_vpager_env();
}

TEST(options_env_bad_keeps_default, TEST_SIM_ONLY) {
  ASSERT_EQ_INT(init_with("VPAGER_BACKEND", "bogus").backend, VP_BACKEND_AUTO);
  ASSERT_EQ_INT(init_with("VPAGER_BACKEND", "").backend, VP_BACKEND_AUTO);
  ASSERT_EQ_U64(init_with("VPAGER_SIM_CAPACITY", "12Q").sim_capacity, 4 * GiB);
  ASSERT_EQ_U64(init_with("VPAGER_SIM_CAPACITY", "-5").sim_capacity, 4 * GiB);
  ASSERT_EQ_U64(init_with("VPAGER_SIM_CAPACITY", "M").sim_capacity, 4 * GiB);
  ASSERT_EQ_U64(init_with("VPAGER_SIM_CAPACITY", "99999999999999T").sim_capacity,
                4 * GiB);
  ASSERT_EQ_U64(init_with("VPAGER_PAGE_SIZE", "abc").page_size, 32 * MiB);
  ASSERT_EQ_INT(init_with("VPAGER_HEADROOM", "xyz").headroom, -1);
  ASSERT_EQ_U64(init_with("VPAGER_POLL_US", "soon").poll_interval_us, 5000);
  ASSERT_EQ_INT(init_with("VPAGER_ORDER", "random").evict_order,
                init_with(NULL, NULL).evict_order);
  ASSERT_EQ_INT(init_with("VPAGER_SIM_STREAMS", "maybe").sim_streams,
                init_with(NULL, NULL).sim_streams);
  /* Values no device opens with (issue 27): kept out at the variable. */
  ASSERT_EQ_U64(init_with("VPAGER_SIM_CAPACITY", "0").sim_capacity, 4 * GiB);
  ASSERT_EQ_U64(init_with("VPAGER_SIM_GRANULARITY", "3M").sim_granularity,
                2 * MiB);
  ASSERT_EQ_U64(init_with("VPAGER_SIM_GRANULARITY", "1K").sim_granularity,
                2 * MiB);
  ASSERT_EQ_U64(init_with("VPAGER_PAGE_SIZE", "48M").page_size, 32 * MiB);
  ASSERT_EQ_U64(init_with("VPAGER_PAGE_SIZE", "0").page_size, 32 * MiB);
  /* One bad value does not spoil the good ones. */
  test_clear_vpager_env();
  setenv("VPAGER_PAGE_SIZE", "huge", 1);
  setenv("VPAGER_SIM_CAPACITY", "8M", 1);
  vp_options_t o;
  ASSERT_OK(vp_options_init(&o));
  ASSERT_EQ_U64(o.page_size, 32 * MiB);
  ASSERT_EQ_U64(o.sim_capacity, 8 * MiB);
  test_clear_vpager_env();
}

TEST(options_env_open, TEST_SIM_ONLY) {
  /* vp_device_open(NULL, ...) takes its options from the environment. */
  test_clear_vpager_env();
  setenv("VPAGER_BACKEND", "sim", 1);
  setenv("VPAGER_SIM_CAPACITY", "2M", 1);
  setenv("VPAGER_SIM_GRANULARITY", "64K", 1);
  setenv("VPAGER_PAGE_SIZE", "256K", 1);
  setenv("VPAGER_HEADROOM", "256K", 1);
  vp_device_t dev;
  ASSERT_OK(vp_device_open(NULL, &dev));
  ASSERT_EQ_STR(vp_device_backend(dev), "sim");
  vp_device_info_t info = test_info(dev);
  ASSERT_EQ_U64(info.page_size, 256 * KiB);
  ASSERT_EQ_U64(info.granularity, 64 * KiB);
  ASSERT_EQ_U64(info.total_memory, 2 * MiB);
  ASSERT_EQ_INT(info.headroom, 256 * KiB);
  /* 2M - 256K headroom = 7 pages of 256K. */
  vp_vbar_t v = test_vbar(dev, 16 * 256 * KiB);
  ASSERT_OK(vp_fault(v, 0, 7 * 256 * KiB, NULL, 0));
  ASSERT_RC(vp_fault(v, 7 * 256 * KiB, 1, NULL, 0), VP_MISS);
  ASSERT_OK(vp_unpin(v, 0, 7 * 256 * KiB, 0));
  ASSERT_OK(vp_device_close(dev));
  test_clear_vpager_env();
}

/* Issue 27: a page larger than the device was accepted, and then every
 * fault missed with no message. vp_device_open refuses it, naming the
 * option and both sizes; a page as large as the device still opens. */
TEST(open_page_over_memory, TEST_SIM_ONLY) {
  vp_options_t o;
  test_options(ctx, &o);
  o.sim_capacity = 16 * MiB;
  o.sim_granularity = 2 * MiB;
  o.page_size = 32 * MiB;
  vp_device_t dev = {0};
  ASSERT_RC(vp_device_open(&o, &dev), VP_EINVAL);
  const char *msg = vp_last_error();
  ASSERT_TRUE(strncmp(msg, "vp_device_open: ", 16) == 0);
  ASSERT_STR_CONTAINS(msg, "page_size");
  ASSERT_STR_CONTAINS(msg, "33554432 bytes (32 MiB)");
  ASSERT_STR_CONTAINS(msg, "sim_capacity");
  ASSERT_STR_CONTAINS(msg, "16777216 bytes (16 MiB)");
  ASSERT_EQ_U64(dev.id, 0); /* nothing opened */

  /* One page the size of the whole device: opens, and that page commits. */
  o.page_size = 16 * MiB;
  dev = test_open(ctx, &o);
  ASSERT_EQ_U64(test_info(dev).page_size, 16 * MiB);
  vp_vbar_t v = test_vbar(dev, 32 * MiB);
  ASSERT_OK(vp_fault(v, 0, 1, NULL, 0));
  ASSERT_RC(vp_fault(v, 16 * MiB, 1, NULL, 0), VP_MISS);
  ASSERT_OK(vp_unpin(v, 0, 1, 0));
  ASSERT_OK(vp_device_close(dev));

  /* The case: VPAGER_PAGE_SIZE=1T on a 1 GiB device. */
  test_clear_vpager_env();
  setenv("VPAGER_BACKEND", "sim", 1);
  setenv("VPAGER_SIM_CAPACITY", "1G", 1);
  setenv("VPAGER_PAGE_SIZE", "1T", 1);
  ASSERT_RC(vp_device_open(NULL, &dev), VP_EINVAL);
  test_clear_vpager_env();
  ASSERT_STR_CONTAINS(vp_last_error(), "option page_size (VPAGER_PAGE_SIZE): "
                      "1099511627776 bytes (1 TiB) is larger than the sim "
                      "device's memory (option sim_capacity): 1073741824 "
                      "bytes (1 GiB)");
}

/* The simulated device's options, given in the struct, name themselves. */
TEST(open_sim_options_named, TEST_SIM_ONLY) {
  vp_options_t o;
  vp_device_t dev;
  test_clear_vpager_env();
  ASSERT_OK(vp_options_init(&o));
  o.backend = VP_BACKEND_SIM;
  o.sim_capacity = 0;
  ASSERT_RC(vp_device_open(&o, &dev), VP_EINVAL);
  ASSERT_STR_CONTAINS(vp_last_error(), "option sim_capacity");
  o.sim_capacity = 64 * MiB;
  o.sim_granularity = 3 * MiB;
  ASSERT_RC(vp_device_open(&o, &dev), VP_EINVAL);
  ASSERT_STR_CONTAINS(vp_last_error(), "option sim_granularity");
}

/* On every backend: a page one power of two above the device's memory is
 * refused (on a GPU, above its total memory). */
TEST(open_page_over_memory_any, TEST_ALL_BACKENDS) {
  vp_options_t o;
  test_options(ctx, &o);
  vp_device_t dev = test_open(ctx, &o);
  uint64_t total = test_info(dev).total_memory;
  ASSERT_OK(vp_device_close(dev));
  uint64_t page = o.page_size;
  while (page <= total) page <<= 1;
  if (page > (1ull << 40)) {
    test_log("skipped: the device has over 512 GiB");
    return;
  }
  o.page_size = page;
  ASSERT_RC(vp_device_open(&o, &dev), VP_EINVAL);
  char want[64];
  snprintf(want, sizeof want, "%llu bytes", (unsigned long long)page);
  ASSERT_STR_CONTAINS(vp_last_error(), "page_size");
  ASSERT_STR_CONTAINS(vp_last_error(), want);
}

/* Issue 27: a headroom of the whole device was accepted, and then every
 * fault missed. vp_device_open refuses a headroom that leaves no room for
 * one page; one page's room is enough. */
TEST(open_headroom_over_memory, TEST_SIM_ONLY) {
  vp_options_t o;
  test_options(ctx, &o);
  o.sim_capacity = 64 * MiB;
  o.sim_granularity = 2 * MiB;
  o.page_size = 2 * MiB;
  o.headroom = 64 * MiB;
  vp_device_t dev = {0};
  ASSERT_RC(vp_device_open(&o, &dev), VP_EINVAL);
  ASSERT_STR_CONTAINS(vp_last_error(), "option headroom (VPAGER_HEADROOM): "
                      "67108864 bytes (64 MiB) leaves no room for one page "
                      "of 2 MiB on the sim device's memory (option "
                      "sim_capacity): 67108864 bytes (64 MiB)");
  o.headroom = 62 * MiB;
  dev = test_open(ctx, &o);
  vp_vbar_t v = test_vbar(dev, 8 * MiB);
  ASSERT_OK(vp_fault(v, 0, 1, NULL, 0));
  ASSERT_OK(vp_unpin(v, 0, 1, 0));
  ASSERT_OK(vp_device_close(dev));
}

TEST(parse_size, TEST_SIM_ONLY) {
  static const struct {
    const char *text;
    uint64_t value;
  } good[] = {
      {"0", 0},           {"1", 1},
      {"4096", 4096},     {"4K", 4 * KiB},
      {"1M", MiB},        {"2G", 2 * GiB},
      {"1T", 1024 * GiB}, {"16k", 16 * KiB},
      {"32m", 32 * MiB},  {"18446744073709551615", UINT64_MAX},
      {"16383T", 16383ull << 40}, {"20GB", 20000000000ull},
      {"20GiB", 20 * GiB}, {"20gib", 20 * GiB}, {"3KB", 3000},
      {"3KiB", 3 * KiB},  {"2MB", 2000000},  {"2MiB", 2 * MiB},
      {"1TB", 1000000000000ull},
  };
  for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
    uint64_t v = 12345;
    test_note("parse_size(\"%s\")", good[i].text);
    ASSERT_OK(vp_parse_size(good[i].text, &v));
    ASSERT_EQ_U64(v, good[i].value);
  }
  static const char *const bad[] = {
      "",    "K",   "abc", "12Q", "-1", "1.5G", "1 G x", "0x10",
      "16777216T", "18446744073709551616", "99999999999999999999", "1KK",
      "1Ki", "1GiBB", "1BG", "18446744073709551615KB"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    uint64_t v = 777;
    test_note("parse_size(\"%s\")", bad[i]);
    ASSERT_RC(vp_parse_size(bad[i], &v), VP_EINVAL);
    ASSERT_TRUE(vp_last_error()[0] != '\0');
    ASSERT_EQ_U64(v, 777); /* untouched */
  }
}

/* The initial log level of a fresh process with VPAGER_LOG=value. */
#ifdef _WIN32
/* No fork: the runner started through _popen, with the variable set here
 * for it to inherit (this test's process ends with the test). */
static int initial_level(const char *value) {
  if (value) setenv("VPAGER_LOG", value, 1);
  else unsetenv("VPAGER_LOG");
  char cmd[4200]; /* cmd.exe /c drops the outer quotes */
  snprintf(cmd, sizeof cmd, "\"\"%s\" --print-log-level\"",
           test_self_path());
  fflush(stdout);
  fflush(stderr);
  /* (Under Wine on a busy machine _popen now and then fails to start
   * cmd.exe: tried three times.) */
  FILE *p = NULL;
  for (int i = 0; i < 3 && !p; i++) p = _popen(cmd, "r");
  ASSERT_NOT_NULL(p);
  char buf[32] = {0};
  size_t got = fread(buf, 1, sizeof buf - 1, p);
  ASSERT_EQ_INT(_pclose(p), 0);
  ASSERT_GT_U64(got, 0);
  return atoi(buf);
}
#else
static int initial_level(const char *value) {
  int fds[2];
  ASSERT_EQ_INT(pipe(fds), 0);
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  ASSERT_GE_INT(pid, 0);
  if (pid == 0) {
    dup2(fds[1], STDOUT_FILENO);
    close(fds[0]);
    close(fds[1]);
    if (value) setenv("VPAGER_LOG", value, 1);
    else unsetenv("VPAGER_LOG");
    execl(test_self_path(), test_self_path(), "--print-log-level",
          (char *)NULL);
    _exit(127);
  }
  close(fds[1]);
  char buf[32] = {0};
  size_t got = 0;
  ssize_t r;
  while (got < sizeof buf - 1 &&
         (r = read(fds[0], buf + got, sizeof buf - 1 - got)) > 0)
    got += (size_t)r;
  close(fds[0]);
  int st = test_wait(pid);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  ASSERT_GT_U64(got, 0);
  return atoi(buf);
}
#endif

TEST(log_level, TEST_SIM_ONLY) {
  ASSERT_EQ_INT(initial_level(NULL), VP_LOG_WARN);
  ASSERT_EQ_INT(initial_level("debug"), VP_LOG_DEBUG);
  ASSERT_EQ_INT(initial_level("trace"), VP_LOG_TRACE);
  ASSERT_EQ_INT(initial_level("none"), VP_LOG_NONE);
  ASSERT_EQ_INT(initial_level("error"), VP_LOG_ERROR);
  ASSERT_EQ_INT(initial_level("info"), VP_LOG_INFO);
  ASSERT_EQ_INT(initial_level("0"), VP_LOG_NONE);
  ASSERT_EQ_INT(initial_level("3"), VP_LOG_INFO);
  ASSERT_EQ_INT(initial_level("bogus"), VP_LOG_WARN);
  ASSERT_EQ_INT(initial_level("9"), VP_LOG_WARN);

  ASSERT_OK(vp_set_log_level(VP_LOG_INFO));
  ASSERT_EQ_INT(vp_get_log_level(), VP_LOG_INFO);
  ASSERT_RC(vp_set_log_level(6), VP_EINVAL);
  ASSERT_RC(vp_set_log_level(-1), VP_EINVAL);
  ASSERT_EQ_INT(vp_get_log_level(), VP_LOG_INFO);
  ASSERT_OK(vp_set_log_level(VP_LOG_NONE));
  ASSERT_EQ_INT(vp_get_log_level(), VP_LOG_NONE);
}

/* What the library writes to stderr while fn runs. */
static char *capture_stderr(test_ctx_t *ctx, void (*fn)(test_ctx_t *)) {
  fflush(stderr);
  FILE *tmp = tmpfile();
  ASSERT_NOT_NULL(tmp);
  int saved = dup(STDERR_FILENO);
  ASSERT_GE_INT(saved, 0);
  ASSERT_GE_INT(dup2(fileno(tmp), STDERR_FILENO), 0);
  fn(ctx);
  fflush(stderr);
  ASSERT_GE_INT(dup2(saved, STDERR_FILENO), 0);
  close(saved);
  long n = ftell(tmp);
  ASSERT_GE_INT(n, 0);
  char *text = calloc(1, (size_t)n + 1);
  ASSERT_NOT_NULL(text);
  rewind(tmp);
  ASSERT_EQ_U64(fread(text, 1, (size_t)n, tmp), (uint64_t)n);
  fclose(tmp);
  return text;
}

static void open_and_use(test_ctx_t *ctx) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 2 * ps);
  ASSERT_OK(vp_fault(v, 0, ps, NULL, 0));
  ASSERT_OK(vp_unpin(v, 0, ps, 0));
  ASSERT_OK(vp_device_close(dev));
}

TEST(log_output, TEST_SIM_ONLY) {
  ASSERT_OK(vp_set_log_level(VP_LOG_TRACE));
  char *text = capture_stderr(ctx, open_and_use);
  ASSERT_STR_CONTAINS(text, "vpager[sim]");
  free(text);
  ASSERT_OK(vp_set_log_level(VP_LOG_NONE));
  text = capture_stderr(ctx, open_and_use);
  ASSERT_EQ_STR(text, "");
  free(text);
}
