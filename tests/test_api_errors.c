/* Bad input: every call with a bad argument returns a clear error code,
 * sets vp_last_error(), and leaves the device usable. */
#include "test.h"

#include <pthread.h>

/* A fault of page `page` works: the device survived whatever came before. */
static void assert_usable(vp_device_t dev) {
  vp_device_info_t info = test_info(dev);
  vp_vbar_t v = test_vbar(dev, 2 * info.page_size);
  ASSERT_OK(vp_fault(v, 0, 2 * info.page_size, NULL, 0));
  test_write_pattern(dev, test_vbar_base(v), 2 * info.page_size, 7);
  ASSERT_OK(vp_unpin(v, 0, 2 * info.page_size, 0));
  ASSERT_OK(vp_vbar_destroy(v));
}

TEST(error_names, TEST_SIM_ONLY) {
#define CHECK_CODE(name, code, text)                                           \
  ASSERT_EQ_INT(VP_##name, code);                                              \
  ASSERT_EQ_STR(vp_err_name(code), "VP_" #name);                               \
  ASSERT_EQ_STR(vp_strerror(code), text);
  VP_ERRNO_MAP(CHECK_CODE)
#undef CHECK_CODE
  ASSERT_EQ_STR(vp_err_name(VP_OK), "VP_OK");
  ASSERT_EQ_STR(vp_err_name(VP_MISS), "VP_MISS");
  ASSERT_NOT_NULL(vp_strerror(VP_OK));
  ASSERT_NOT_NULL(vp_strerror(VP_MISS));
  ASSERT_TRUE(vp_strerror(VP_MISS)[0] != '\0');
  /* Unknown codes still give a string. */
  int odd[] = {-13, -999, 2, 12345, -2147483647 - 1};
  for (size_t i = 0; i < sizeof odd / sizeof odd[0]; i++) {
    ASSERT_NOT_NULL(vp_err_name(odd[i]));
    ASSERT_NOT_NULL(vp_strerror(odd[i]));
  }
}

static void *thread_last_error(void *arg) {
  char *out = arg;
  /* Nothing failed in this thread yet. */
  if (vp_last_error()[0] != '\0') {
    snprintf(out, 256, "not empty at start: %s", vp_last_error());
    return NULL;
  }
  vp_device_t bogus = {0x7777};
  int rc = vp_device_info(bogus, &(vp_device_info_t){0});
  if (rc != VP_EHANDLE) {
    snprintf(out, 256, "vp_device_info(bogus) gave %s", vp_err_name(rc));
    return NULL;
  }
  if (vp_last_error()[0] == '\0') {
    snprintf(out, 256, "empty after a failure");
    return NULL;
  }
  snprintf(out, 256, "ok");
  return NULL;
}

TEST(last_error_per_thread, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  /* A failure in this thread names the function. */
  ASSERT_RC(vp_vbar_create(dev, 0, &(vp_vbar_t){0}), VP_EINVAL);
  char mine[512];
  snprintf(mine, sizeof mine, "%s", vp_last_error());
  ASSERT_TRUE(mine[0] != '\0');
  ASSERT_STR_CONTAINS(mine, "vbar_create");
  /* Another thread starts empty, and its failure does not touch ours. */
  char result[256] = "";
  pthread_t th;
  ASSERT_EQ_INT(pthread_create(&th, NULL, thread_last_error, result), 0);
  ASSERT_EQ_INT(pthread_join(th, NULL), 0);
  ASSERT_EQ_STR(result, "ok");
  ASSERT_EQ_STR(vp_last_error(), mine);
  ASSERT_OK(vp_device_close(dev));
}

TEST(null_out_pointers, TEST_ALL_BACKENDS) {
  vp_options_t opts;
  test_options(ctx, &opts);
  ASSERT_RC(vp_options_init(NULL), VP_EINVAL);
  ASSERT_RC(vp_device_open(&opts, NULL), VP_EINVAL);
  ASSERT_TRUE(vp_last_error()[0] != '\0');
  uint64_t x;
  ASSERT_RC(vp_parse_size(NULL, &x), VP_EINVAL);
  ASSERT_RC(vp_parse_size("1", NULL), VP_EINVAL);

  vp_device_t dev = test_open(ctx, &opts);
  uint64_t ps = opts.page_size;
  vp_vbar_t v = test_vbar(dev, 4 * ps);
  ASSERT_FAILS(vp_device_info(dev, NULL));
  ASSERT_FAILS(vp_device_reclaimable(dev, NULL));
  ASSERT_FAILS(vp_stream_create(dev, NULL));
  ASSERT_FAILS(vp_vbar_create(dev, ps, NULL));
  ASSERT_FAILS(vp_vbar_base(v, NULL));
  ASSERT_FAILS(vp_vbar_size(v, NULL));
  ASSERT_FAILS(vp_vbar_page_count(v, NULL));
  ASSERT_FAILS(vp_vbar_device(v, NULL));
  ASSERT_FAILS(vp_vbar_get_watermark(v, NULL));
  ASSERT_FAILS(vp_vbar_get_watermark_limit(v, NULL));
  ASSERT_FAILS(vp_vbar_loaded_size(v, NULL));
  ASSERT_FAILS(vp_device_stats(dev, NULL));
  ASSERT_FAILS(vp_vbar_stats(v, NULL));
  ASSERT_FAILS(vp_vbar_residency(v, NULL, 1));
  ASSERT_RC(vp_device_info(dev, NULL), VP_EINVAL);
  ASSERT_RC(vp_vbar_base(v, NULL), VP_EINVAL);
  ASSERT_RC(vp_vbar_create(dev, ps, NULL), VP_EINVAL);

  /* Copies with NULL host pointers, on a pinned page. */
  uint64_t base = test_vbar_base(v);
  ASSERT_OK(vp_fault(v, 0, ps, NULL, 0));
  ASSERT_RC(vp_copy_to_device(dev, base, NULL, 16, 0), VP_EINVAL);
  ASSERT_RC(vp_copy_to_host(dev, NULL, base, 16, 0), VP_EINVAL);
  if (ctx->backend == VP_BACKEND_SIM)
    ASSERT_RC(vp_sim_launch(dev, 0, NULL, NULL), VP_EINVAL);
  ASSERT_OK(vp_unpin(v, 0, ps, 0));

  /* `freed` may be NULL. */
  ASSERT_OK(vp_vbar_free_memory(v, ps, NULL));
  ASSERT_OK(vp_device_free_memory(dev, ps, NULL));
  /* gens may be NULL (with any ngens). */
  ASSERT_OK(vp_vbar_prioritize(v)); /* lift the watermark */
  ASSERT_OK(vp_fault(v, 0, 2 * ps, NULL, 0));
  ASSERT_OK(vp_unpin(v, 0, 2 * ps, 0));

  assert_usable(dev);
  ASSERT_OK(vp_vbar_destroy(v));
  ASSERT_OK(vp_device_close(dev));
}

static void nop_fn(void *arg) { (void)arg; }

/* Every handle-taking call with this device handle gives VP_EHANDLE. */
static void assert_bad_device(vp_device_t d) {
  vp_device_info_t info;
  vp_vbar_t v;
  vp_stream_t s;
  uint64_t u;
  vp_stats_t st = {.size = sizeof st};
  char buf[64];
  ASSERT_RC(vp_device_info(d, &info), VP_EHANDLE);
  ASSERT_TRUE(vp_last_error()[0] != '\0');
  ASSERT_NULL(vp_device_backend(d));
  ASSERT_RC(vp_device_set_headroom(d, 0), VP_EHANDLE);
  ASSERT_RC(vp_device_free_memory(d, 1, &u), VP_EHANDLE);
  ASSERT_RC(vp_device_reclaimable(d, &u), VP_EHANDLE);
  ASSERT_RC(vp_device_reset_limits(d), VP_EHANDLE);
  ASSERT_RC(vp_stream_create(d, &s), VP_EHANDLE);
  ASSERT_RC(vp_stream_destroy(d, 1), VP_EHANDLE);
  ASSERT_RC(vp_stream_synchronize(d, 0), VP_EHANDLE);
  ASSERT_RC(vp_copy_to_device(d, 1 << 20, buf, 8, 0), VP_EHANDLE);
  ASSERT_RC(vp_copy_to_host(d, buf, 1 << 20, 8, 0), VP_EHANDLE);
  ASSERT_RC(vp_vbar_create(d, 1 << 20, &v), VP_EHANDLE);
  ASSERT_RC(vp_device_stats(d, &st), VP_EHANDLE);
  ASSERT_RC(vp_device_report(d, 0, buf, sizeof buf, NULL), VP_EHANDLE);
  ASSERT_RC(vp_sim_launch(d, 0, nop_fn, NULL), VP_EHANDLE);
  ASSERT_RC(vp_sim_inject(d, VP_SIM_FAIL_COMMIT, 1), VP_EHANDLE);
  ASSERT_RC(vp_device_close(d), VP_EHANDLE);
}

/* Every call taking this VBAR handle gives VP_EHANDLE. */
static void assert_bad_vbar(vp_vbar_t v) {
  uint64_t u;
  vp_device_t d;
  uint8_t flags[4];
  uint32_t gens[4];
  vp_stats_t st = {.size = sizeof st};
  ASSERT_RC(vp_fault(v, 0, 1, gens, 4), VP_EHANDLE);
  ASSERT_TRUE(vp_last_error()[0] != '\0');
  ASSERT_RC(vp_unpin(v, 0, 1, 0), VP_EHANDLE);
  ASSERT_RC(vp_vbar_base(v, &u), VP_EHANDLE);
  ASSERT_RC(vp_vbar_size(v, &u), VP_EHANDLE);
  ASSERT_RC(vp_vbar_page_count(v, &u), VP_EHANDLE);
  ASSERT_RC(vp_vbar_device(v, &d), VP_EHANDLE);
  ASSERT_RC(vp_vbar_prioritize(v), VP_EHANDLE);
  ASSERT_RC(vp_vbar_deprioritize(v), VP_EHANDLE);
  ASSERT_RC(vp_vbar_set_order(v, VP_ORDER_TAIL_FIRST), VP_EHANDLE);
  ASSERT_RC(vp_vbar_set_watermark(v, 0), VP_EHANDLE);
  ASSERT_RC(vp_vbar_get_watermark(v, &u), VP_EHANDLE);
  ASSERT_RC(vp_vbar_set_watermark_limit(v, 0), VP_EHANDLE);
  ASSERT_RC(vp_vbar_get_watermark_limit(v, &u), VP_EHANDLE);
  ASSERT_RC(vp_vbar_free_memory(v, 1, &u), VP_EHANDLE);
  ASSERT_RC(vp_vbar_loaded_size(v, &u), VP_EHANDLE);
  ASSERT_RC(vp_vbar_residency(v, flags, 1), VP_EHANDLE);
  ASSERT_RC(vp_vbar_stats(v, &st), VP_EHANDLE);
  ASSERT_RC(vp_vbar_destroy(v), VP_EHANDLE);
}

TEST(bad_handles, TEST_ALL_BACKENDS) {
  /* Made-up handles, before any device exists and after. */
  vp_device_t made_up[] = {{0}, {1}, {0x12345678}, {UINT64_MAX}};
  vp_vbar_t made_up_v[] = {{0}, {1}, {0x12345678}, {UINT64_MAX}};
  for (size_t i = 0; i < 4; i++) assert_bad_device(made_up[i]);
  for (size_t i = 0; i < 4; i++) assert_bad_vbar(made_up_v[i]);

  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 4 * ps);
  for (size_t i = 0; i < 4; i++)
    if (made_up[i].id != dev.id) assert_bad_device(made_up[i]);
  for (size_t i = 0; i < 4; i++)
    if (made_up_v[i].id != v.id) assert_bad_vbar(made_up_v[i]);
  /* A VBAR handle is no device handle and the other way round. */
  if (v.id != dev.id) {
    assert_bad_device((vp_device_t){v.id});
    assert_bad_vbar((vp_vbar_t){dev.id});
  }
  /* Neighbouring ids of live handles are not handles. */
  assert_bad_vbar((vp_vbar_t){v.id + 1});
  assert_bad_vbar((vp_vbar_t){v.id ^ (1ull << 40)});
  assert_bad_device((vp_device_t){dev.id ^ (1ull << 40)});

  /* A destroyed VBAR stays stale, even after another is created. */
  vp_vbar_t dead = v;
  ASSERT_OK(vp_vbar_destroy(v));
  assert_bad_vbar(dead);
  vp_vbar_t v2 = test_vbar(dev, 4 * ps);
  ASSERT_NE_U64(v2.id, dead.id);
  assert_bad_vbar(dead);
  ASSERT_EQ_U64(test_resident_count(v2), 0);

  /* A closed device and its VBARs stay stale, even after a new open. */
  vp_device_t dead_dev = dev;
  vp_vbar_t orphan = v2;
  ASSERT_OK(vp_device_close(dev));
  assert_bad_device(dead_dev);
  assert_bad_vbar(orphan);
  vp_device_t dev2 = test_open(ctx, NULL);
  ASSERT_NE_U64(dev2.id, dead_dev.id);
  assert_bad_device(dead_dev);
  assert_bad_vbar(orphan);
  assert_usable(dev2);
  ASSERT_OK(vp_device_close(dev2));
}

TEST(foreign_handles, TEST_ALL_BACKENDS) {
  uint64_t ps = test_page_size(ctx);
  vp_device_t a = test_open(ctx, NULL), b = test_open(ctx, NULL);
  vp_vbar_t va = test_vbar(a, 4 * ps), vb = test_vbar(b, 4 * ps);
  vp_device_t owner;
  ASSERT_OK(vp_vbar_device(va, &owner));
  ASSERT_EQ_U64(owner.id, a.id);
  ASSERT_OK(vp_vbar_device(vb, &owner));
  ASSERT_EQ_U64(owner.id, b.id);

  /* An address of a's VBAR, pinned there, is no address of b. */
  uint64_t base_a = test_vbar_base(va);
  ASSERT_OK(vp_fault(va, 0, ps, NULL, 0));
  char buf[64] = {0};
  ASSERT_FAILS(vp_copy_to_device(b, base_a, buf, sizeof buf, 0));
  ASSERT_FAILS(vp_copy_to_host(b, buf, base_a, sizeof buf, 0));
  ASSERT_OK(vp_unpin(va, 0, ps, 0));

  /* Closing a leaves b and its VBAR alone; a's VBAR is stale. */
  ASSERT_OK(vp_device_close(a));
  assert_bad_vbar(va);
  ASSERT_OK(vp_fault(vb, 0, ps, NULL, 0));
  ASSERT_OK(vp_unpin(vb, 0, ps, 0));
  assert_usable(b);
  ASSERT_OK(vp_device_close(b));
}

TEST(range_errors, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 4 * ps);
  uint32_t gens[8];

  /* Out of range. */
  ASSERT_RC(vp_fault(v, 4 * ps, 1, gens, 8), VP_ERANGE);
  ASSERT_TRUE(vp_last_error()[0] != '\0');
  ASSERT_RC(vp_fault(v, 3 * ps, 2 * ps, gens, 8), VP_ERANGE);
  ASSERT_RC(vp_fault(v, 0, 4 * ps + 1, gens, 8), VP_ERANGE);
  ASSERT_RC(vp_fault(v, UINT64_MAX / 2, ps, gens, 8), VP_ERANGE);
  ASSERT_RC(vp_unpin(v, 4 * ps, 1, 0), VP_ERANGE);
  ASSERT_RC(vp_unpin(v, 0, 5 * ps, 0), VP_ERANGE);
  /* Zero size. */
  ASSERT_RC2(vp_fault(v, 0, 0, gens, 8), VP_EINVAL, VP_ERANGE);
  ASSERT_RC2(vp_unpin(v, 0, 0, 0), VP_EINVAL, VP_ERANGE);
  /* offset + size overflows. */
  ASSERT_RC2(vp_fault(v, ps, UINT64_MAX, gens, 8), VP_ERANGE, VP_EINVAL);
  ASSERT_RC2(vp_fault(v, UINT64_MAX, 2, gens, 8), VP_ERANGE, VP_EINVAL);
  ASSERT_RC2(vp_fault(v, UINT64_MAX - ps + 1, 2 * ps, gens, 8), VP_ERANGE,
             VP_EINVAL);
  ASSERT_RC2(vp_unpin(v, ps, UINT64_MAX, 0), VP_ERANGE, VP_EINVAL);
  /* Nothing of that left a page resident. */
  ASSERT_EQ_STR(test_map(v), "....");

  /* ngens too small for the range: EINVAL, nothing pinned. */
  ASSERT_RC(vp_fault(v, 0, 2 * ps, gens, 1), VP_EINVAL);
  ASSERT_RC(vp_fault(v, ps - 1, 2, gens, 1), VP_EINVAL); /* pages 0 and 1 */
  ASSERT_EQ_STR(test_map(v), "....");
  ASSERT_OK(vp_fault(v, ps - 1, 2, gens, 2));
  ASSERT_EQ_STR(test_map(v), "PP..");
  ASSERT_OK(vp_unpin(v, ps - 1, 2, 0));
  /* A sub-page range is its page. */
  ASSERT_OK(vp_fault(v, 3 * ps + 100, 10, gens, 1));
  ASSERT_EQ_STR(test_map(v), "##.P");

  /* Copies outside the VBAR or past its end. */
  uint64_t base = test_vbar_base(v);
  char *buf = calloc(1, 2 * ps);
  ASSERT_NOT_NULL(buf);
  ASSERT_FAILS(vp_copy_to_device(dev, base + 3 * ps, buf, 2 * ps, 0));
  ASSERT_FAILS(vp_copy_to_host(dev, buf, base + 3 * ps, 2 * ps, 0));
  ASSERT_FAILS(vp_copy_to_device(dev, base + 4 * ps, buf, 1, 0));
  ASSERT_FAILS(vp_copy_to_device(dev, 0, buf, 1, 0));
  ASSERT_FAILS(vp_copy_to_device(dev, UINT64_MAX - 3, buf, 8, 0));
  ASSERT_FAILS(vp_copy_to_host(dev, buf, UINT64_MAX - 3, 8, 0));
  /* Spanning two VBARs: first is pinned, the second too. */
  vp_vbar_t w = test_vbar(dev, 4 * ps);
  uint64_t wbase = test_vbar_base(w);
  ASSERT_OK(vp_fault(w, 0, 4 * ps, NULL, 0));
  if (wbase == base + 4 * ps)
    ASSERT_FAILS(vp_copy_to_device(dev, base + 3 * ps, buf, 2 * ps, 0));
  ASSERT_OK(vp_unpin(w, 0, 4 * ps, 0));
  ASSERT_OK(vp_vbar_destroy(w));
  /* In range: fine. */
  ASSERT_OK(vp_copy_to_device(dev, base + 3 * ps + 1, buf, ps - 1, 0));
  ASSERT_OK(vp_stream_synchronize(dev, 0));
  ASSERT_OK(vp_unpin(v, 3 * ps + 100, 10, 0));
  free(buf);

  /* Watermark beyond the VBAR; residency beyond its pages. */
  ASSERT_FAILS(vp_vbar_set_watermark(v, 5 * ps));
  ASSERT_EQ_U64(test_watermark(v), 4);
  uint8_t flags[8];
  ASSERT_FAILS(vp_vbar_residency(v, flags, 5));
  ASSERT_OK(vp_vbar_residency(v, flags, 4));
  ASSERT_OK(vp_vbar_residency(v, flags, 0));

  /* A zero-size VBAR; an impossible one. */
  vp_vbar_t bad;
  ASSERT_RC(vp_vbar_create(dev, 0, &bad), VP_EINVAL);
  ASSERT_FAILS(vp_vbar_create(dev, UINT64_MAX, &bad));
  ASSERT_FAILS(vp_vbar_create(dev, UINT64_MAX - ps + 2, &bad));

  assert_usable(dev);
  ASSERT_OK(vp_vbar_destroy(v));
  ASSERT_OK(vp_device_close(dev));
}

TEST(open_bad_page_size, TEST_ALL_BACKENDS) {
  vp_options_t opts;
  vp_device_t dev;
  uint64_t gran = ctx->backend == VP_BACKEND_SIM ? (64u << 10) : (2u << 20);
  uint64_t bad[] = {0, 3 * gran, gran + gran / 2, 5 * gran, gran / 2, 1, 3,
                    (1ull << 63) + gran};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    test_options(ctx, &opts);
    opts.page_size = bad[i];
    test_note("page_size %" PRIu64, bad[i]);
    ASSERT_RC(vp_device_open(&opts, &dev), VP_EINVAL);
    ASSERT_TRUE(vp_last_error()[0] != '\0');
  }
  test_note("%s", "");
  /* A power of two and a multiple of the granularity: fine. */
  test_options(ctx, &opts);
  opts.page_size = 4 * gran;
  dev = test_open(ctx, &opts);
  ASSERT_EQ_U64(test_info(dev).page_size, 4 * gran);
  assert_usable(dev);
  ASSERT_OK(vp_device_close(dev));
}

TEST(open_bad_options, TEST_SIM_ONLY) {
  vp_options_t opts;
  vp_device_t dev;
  test_options(ctx, &opts);
  opts.size = 0; /* not from vp_options_init */
  ASSERT_RC(vp_device_open(&opts, &dev), VP_EINVAL);
  test_options(ctx, &opts);
  opts.sim_capacity = 0;
  ASSERT_FAILS(vp_device_open(&opts, &dev));
  test_options(ctx, &opts);
  opts.headroom = -2;
  ASSERT_FAILS(vp_device_open(&opts, &dev));
  test_options(ctx, &opts);
  opts.backend = 99;
  ASSERT_FAILS(vp_device_open(&opts, &dev));
  test_options(ctx, &opts);
  opts.evict_order = 7;
  ASSERT_FAILS(vp_device_open(&opts, &dev));
  test_options(ctx, &opts);
  opts.sim_streams = 5;
  ASSERT_FAILS(vp_device_open(&opts, &dev));
  /* Granularity not a power of two; page size not a multiple of it. */
  test_options(ctx, &opts);
  opts.sim_granularity = 3 * 4096;
  ASSERT_FAILS(vp_device_open(&opts, &dev));
  test_options(ctx, &opts);
  opts.sim_granularity = 128u << 10;
  opts.page_size = 64u << 10;
  ASSERT_RC(vp_device_open(&opts, &dev), VP_EINVAL);
  /* NULL options: the defaults (sim on a machine without a GPU). */
  ASSERT_OK(vp_device_open(NULL, &dev));
  const char *name = vp_device_backend(dev);
  ASSERT_NOT_NULL(name);
  ASSERT_TRUE(strcmp(name, "sim") == 0 || strcmp(name, "cuda") == 0 ||
              strcmp(name, "hip") == 0);
  ASSERT_OK(vp_device_close(dev));
}

TEST(double_destroy_close, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 2 * ps);
  test_load_pages(v, 0, 2);
  ASSERT_OK(vp_vbar_destroy(v));
  ASSERT_RC(vp_vbar_destroy(v), VP_EHANDLE);
  ASSERT_TRUE(vp_last_error()[0] != '\0');
  assert_usable(dev);
  /* Closing with a live VBAR (pages resident) frees it too. */
  vp_vbar_t w = test_vbar(dev, 2 * ps);
  test_load_pages(w, 0, 2);
  ASSERT_OK(vp_device_close(dev));
  ASSERT_RC(vp_device_close(dev), VP_EHANDLE);
  ASSERT_RC(vp_vbar_destroy(w), VP_EHANDLE);
}

TEST(destroy_pinned_busy, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 4 * ps);
  uint32_t g1 = 0, g1b = 0;
  ASSERT_OK(test_fault_page(v, 1, &g1));
  test_write_pattern(dev, test_vbar_base(v) + ps, ps, 11);
  ASSERT_RC(vp_vbar_destroy(v), VP_EBUSY);
  ASSERT_TRUE(vp_last_error()[0] != '\0');
  /* Nothing changed: still pinned, data intact, the VBAR works. */
  ASSERT_EQ_STR(test_map(v), ".P..");
  ASSERT_TRUE(test_check_pattern(dev, test_vbar_base(v) + ps, ps, 11));
  ASSERT_OK(test_fault_page(v, 2, NULL));
  ASSERT_OK(test_fault_page(v, 1, &g1b));
  ASSERT_EQ_U64(g1b, g1);
  ASSERT_RC(vp_vbar_destroy(v), VP_EBUSY);
  ASSERT_OK(vp_unpin(v, ps, 2 * ps, 0));
  ASSERT_RC(vp_vbar_destroy(v), VP_EBUSY); /* page 1 still has a pin */
  ASSERT_EQ_STR(test_map(v), ".P#.");
  ASSERT_OK(vp_unpin(v, ps, ps, 0));
  ASSERT_OK(vp_vbar_destroy(v));
  ASSERT_EQ_U64(test_info(dev).committed, 0);
  /* Closing a device with pinned pages is fine and frees them. */
  vp_vbar_t w = test_vbar(dev, 4 * ps);
  ASSERT_OK(vp_fault(w, 0, 3 * ps, NULL, 0));
  ASSERT_OK(vp_device_close(dev));
}

TEST(unpin_errors, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 4 * ps);
  ASSERT_RC(vp_unpin(v, 0, ps, 0), VP_ENOTPINNED);
  ASSERT_TRUE(vp_last_error()[0] != '\0');
  ASSERT_OK(test_fault_page(v, 0, NULL));
  /* Page 1 is not pinned: nothing changes, page 0 keeps its pin. */
  ASSERT_RC(vp_unpin(v, 0, 2 * ps, 0), VP_ENOTPINNED);
  ASSERT_EQ_STR(test_map(v), "P...");
  /* Resident but unpinned is not pinned either. */
  test_load_pages(v, 1, 1);
  ASSERT_RC(vp_unpin(v, ps, ps, 0), VP_ENOTPINNED);
  ASSERT_RC(vp_unpin(v, 0, 2 * ps, 0), VP_ENOTPINNED);
  ASSERT_EQ_STR(test_map(v), "P#..");
  ASSERT_OK(vp_unpin(v, 0, ps, 0));
  ASSERT_RC(vp_unpin(v, 0, ps, 0), VP_ENOTPINNED);
  ASSERT_EQ_STR(test_map(v), "##..");
  assert_usable(dev);
  ASSERT_OK(vp_vbar_destroy(v));
  ASSERT_OK(vp_device_close(dev));
}

TEST(set_order_errors, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 4 * ps);
  ASSERT_RC(vp_vbar_set_order(v, 2), VP_EINVAL);
  ASSERT_RC(vp_vbar_set_order(v, -1), VP_EINVAL);
  ASSERT_OK(vp_vbar_set_order(v, VP_ORDER_INTERLEAVED));
  ASSERT_OK(vp_vbar_set_order(v, VP_ORDER_TAIL_FIRST));
  test_load_pages(v, 2, 1);
  ASSERT_RC(vp_vbar_set_order(v, VP_ORDER_INTERLEAVED), VP_EBUSY);
  ASSERT_OK(vp_vbar_free_memory(v, 4 * ps, NULL));
  ASSERT_EQ_U64(test_resident_count(v), 0);
  ASSERT_OK(vp_vbar_set_order(v, VP_ORDER_INTERLEAVED));
  assert_usable(dev);
  ASSERT_OK(vp_vbar_destroy(v));
  ASSERT_OK(vp_device_close(dev));
}

TEST(stream_errors, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  vp_stream_t s = 0;
  ASSERT_OK(vp_stream_create(dev, &s));
  ASSERT_NE_U64(s, 0);
  ASSERT_OK(vp_stream_synchronize(dev, s));
  ASSERT_OK(vp_stream_synchronize(dev, 0));
  ASSERT_OK(vp_stream_destroy(dev, s));
  if (ctx->backend == VP_BACKEND_SIM) {
    /* CUDA streams are the caller's; the sim checks its own. */
    ASSERT_FAILS(vp_stream_destroy(dev, s));
    ASSERT_FAILS(vp_stream_synchronize(dev, s));
    ASSERT_FAILS(vp_stream_destroy(dev, 0x5151));
  }
  /* A stream left alive is freed by close. */
  ASSERT_OK(vp_stream_create(dev, &s));
  assert_usable(dev);
  ASSERT_OK(vp_device_close(dev));
}

TEST(sim_inject_errors, TEST_SIM_ONLY) {
  vp_device_t dev = test_open(ctx, NULL);
  ASSERT_RC(vp_sim_inject(dev, 0, 1), VP_EINVAL);
  ASSERT_RC(vp_sim_inject(dev, 99, 1), VP_EINVAL);
  ASSERT_TRUE(vp_last_error()[0] != '\0');
  assert_usable(dev);
  ASSERT_OK(vp_device_close(dev));
}

TEST(gpu_sim_calls_unsupported, TEST_GPU_ONLY) {
  vp_device_t dev = test_open(ctx, NULL);
  ASSERT_RC(vp_sim_inject(dev, VP_SIM_FAIL_COMMIT, 1), VP_EUNSUPPORTED);
  ASSERT_RC(vp_sim_launch(dev, 0, nop_fn, NULL), VP_EUNSUPPORTED);
  ASSERT_OK(vp_device_close(dev));
}

/* JSON's structure: strings closed, braces and brackets balanced and
 * properly nested, one top-level object. */
static bool json_balanced(const char *s) {
  char stack[64];
  int depth = 0, tops = 0;
  bool in_str = false;
  for (; *s; s++) {
    char c = *s;
    if (in_str) {
      if (c == '\\' && s[1]) s++;
      else if (c == '"') in_str = false;
      else if ((unsigned char)c < 0x20) return false;
      continue;
    }
    if (c == '"') in_str = true;
    else if (c == '{' || c == '[') {
      if (depth == 0) tops++;
      if (depth == (int)sizeof stack) return false;
      stack[depth++] = c;
    } else if (c == '}' || c == ']') {
      if (depth == 0 || stack[--depth] != (c == '}' ? '{' : '[')) return false;
    }
  }
  return !in_str && depth == 0 && tops == 1;
}

TEST(report, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 4 * ps);
  test_load_pages(v, 0, 1);
  ASSERT_OK(test_fault_page(v, 1, NULL));
  for (int json = 0; json < 2; json++) {
    size_t need = 0;
    char small[16];
    memset(small, 'x', sizeof small);
    ASSERT_RC(vp_device_report(dev, json, small, sizeof small, &need),
              VP_ERANGE);
    ASSERT_GT_U64(need, sizeof small);
    ASSERT_EQ_U64(strlen(small), sizeof small - 1);
    char *buf = malloc(need + 1);
    ASSERT_NOT_NULL(buf);
    size_t need2 = 0;
    ASSERT_OK(vp_device_report(dev, json, buf, need + 1, &need2));
    ASSERT_EQ_U64(need2, need);
    ASSERT_EQ_U64(strlen(buf), need);
    ASSERT_EQ_INT(memcmp(buf, small, sizeof small - 1), 0);
    ASSERT_STR_CONTAINS(buf, ctx->backend_name);
    ASSERT_STR_CONTAINS(buf, "#P..");
    if (json) {
      ASSERT_TRUE(json_balanced(buf));
      ASSERT_STR_CONTAINS(buf, "\"faults\"");
      ASSERT_EQ_INT(buf[0], '{');
      size_t n = strlen(buf);
      while (n && (buf[n - 1] == '\n' || buf[n - 1] == ' ')) n--;
      ASSERT_EQ_INT(buf[n - 1], '}');
    }
    /* One byte short is too small. */
    ASSERT_RC(vp_device_report(dev, json, buf, need, NULL), VP_ERANGE);
    ASSERT_EQ_U64(strlen(buf), need - 1);
    free(buf);
  }
  ASSERT_OK(vp_unpin(v, ps, ps, 0));
  ASSERT_OK(vp_device_close(dev));
}

TEST(stats_counts, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open_cap(ctx, NULL, 4);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 8 * ps);
  vp_stats_t s = test_vbar_stats(v);
  ASSERT_EQ_U64(s.version, 1);
  ASSERT_EQ_U64(s.size, sizeof s);
  ASSERT_EQ_U64(s.faults, 0);
  ASSERT_OK(vp_fault(v, 0, 2 * ps, NULL, 0)); /* fill */
  ASSERT_OK(vp_fault(v, 0, ps, NULL, 0));     /* hit */
  ASSERT_OK(vp_fault(v, ps, 2 * ps, NULL, 0)); /* fill, page 2 */
  s = test_vbar_stats(v);
  ASSERT_EQ_U64(s.faults, 3);
  ASSERT_EQ_U64(s.hits, 1);
  ASSERT_EQ_U64(s.fills, 2);
  ASSERT_EQ_U64(s.misses, 0);
  ASSERT_EQ_U64(s.pages_committed, 3);
  ASSERT_EQ_U64(s.committed_bytes, 3 * ps);
  ASSERT_EQ_U64(s.pinned_bytes, 3 * ps);
  char buf[100];
  ASSERT_OK(vp_copy_to_device(dev, test_vbar_base(v), buf, sizeof buf, 0));
  ASSERT_OK(vp_copy_to_host(dev, buf, test_vbar_base(v), sizeof buf, 0));
  ASSERT_OK(vp_stream_synchronize(dev, 0));
  ASSERT_OK(vp_unpin(v, 0, 2 * ps, 0));
  ASSERT_OK(vp_unpin(v, 0, ps, 0));
  ASSERT_OK(vp_unpin(v, ps, 2 * ps, 0));
  /* Capacity 4: page 3 fits; page 4 would have to evict a page of this
   * VBAR ranked below it (tail-first: rank = page), so it misses. */
  ASSERT_OK(test_fault_page(v, 3, NULL));
  ASSERT_RC(test_fault_page(v, 4, NULL), VP_MISS);
  s = test_vbar_stats(v);
  ASSERT_EQ_U64(s.faults, 5);
  ASSERT_EQ_U64(s.fills, 3);
  ASSERT_EQ_U64(s.misses, 1);
  ASSERT_EQ_U64(s.budget_misses, 1);
  ASSERT_EQ_U64(s.unpins, 3);
  ASSERT_EQ_U64(s.bytes_copied, 2 * sizeof buf);
  ASSERT_EQ_U64(s.pinned_bytes, ps);
  ASSERT_EQ_U64(s.committed_bytes, 4 * ps);
  ASSERT_OK(vp_vbar_free_memory(v, ps, NULL)); /* page 2 */
  s = test_vbar_stats(v);
  ASSERT_EQ_U64(s.pages_evicted, 1);
  ASSERT_EQ_U64(s.committed_bytes, 3 * ps);
  ASSERT_OK(vp_unpin(v, 3 * ps, ps, 0));
  /* Device totals include destroyed VBARs. */
  ASSERT_OK(vp_vbar_destroy(v));
  vp_stats_t d = test_dev_stats(dev);
  ASSERT_EQ_U64(d.version, 1);
  ASSERT_EQ_U64(d.faults, 5);
  ASSERT_EQ_U64(d.hits, 1);
  ASSERT_EQ_U64(d.fills, 3);
  ASSERT_EQ_U64(d.misses, 1);
  ASSERT_EQ_U64(d.unpins, 4);
  ASSERT_EQ_U64(d.pages_committed, 4);
  ASSERT_EQ_U64(d.committed_bytes, 0);
  ASSERT_EQ_U64(d.pinned_bytes, 0);
  ASSERT_OK(vp_device_close(dev));
}

/* A call that shares its work with another public call names itself:
 * vp_ledger_free_memory is not reported as vp_ledger_free_memory_keep. */
TEST(shared_calls_name_the_caller, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  ASSERT_OK(vp_device_close(dev));
  uint64_t freed = 1;
  ASSERT_RC(vp_ledger_free_memory(dev, 1, &freed), VP_EHANDLE);
  ASSERT_TRUE(strncmp(vp_last_error(), "vp_ledger_free_memory: ", 23) == 0);
  ASSERT_RC(vp_ledger_free_memory_keep(dev, 1, NULL, 0, &freed), VP_EHANDLE);
  ASSERT_TRUE(strncmp(vp_last_error(), "vp_ledger_free_memory_keep: ", 28) ==
              0);
}
