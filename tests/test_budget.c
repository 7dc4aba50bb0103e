/* The budget: headroom at run time, capacity shrinking at run time, and
 * bounded free-memory polls. */
#include "test.h"

TEST(budget_info, TEST_SIM_ONLY) {
  vp_options_t opts;
  test_options(ctx, &opts);
  opts.headroom = 3 * opts.page_size;
  vp_device_t dev = test_open_cap(ctx, &opts, 10);
  uint64_t ps = opts.page_size;
  vp_device_info_t info = test_info(dev);
  ASSERT_EQ_U64(info.page_size, ps);
  ASSERT_EQ_U64(info.granularity, 64u << 10);
  ASSERT_EQ_U64(info.total_memory, 10 * ps);
  ASSERT_EQ_U64(info.committed, 0);
  ASSERT_EQ_INT(info.headroom, 3 * ps);
  ASSERT_LE_U64(info.free_memory, 10 * ps);
  ASSERT_LE_U64(info.budget, 7 * ps);
  ASSERT_EQ_INT(info.async_copies, 0);
  vp_vbar_t v = test_vbar(dev, 16 * ps);
  ASSERT_OK(vp_fault(v, 0, 7 * ps, NULL, 0));
  ASSERT_RC(vp_fault(v, 7 * ps, ps, NULL, 0), VP_MISS);
  info = test_info(dev);
  ASSERT_EQ_U64(info.committed, 7 * ps);
  ASSERT_EQ_U64(info.free_memory, 3 * ps);
  ASSERT_OK(vp_unpin(v, 0, 7 * ps, 0));
  ASSERT_OK(vp_device_close(dev));

  /* Worker streams copy asynchronously. */
  test_options(ctx, &opts);
  opts.sim_streams = VP_SIM_WORKER;
  dev = test_open(ctx, &opts);
  ASSERT_EQ_INT(test_info(dev).async_copies, 1);
  ASSERT_OK(vp_device_close(dev));
}

TEST(budget_headroom_runtime, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open_cap(ctx, NULL, 8);
  uint64_t ps = test_page_size(ctx);
  int64_t base_head = test_info(dev).headroom; /* CUDA: test_open_cap's */
  vp_vbar_t v = test_vbar(dev, 8 * ps);
  test_load_pages(v, 0, 8);
  uint64_t committed0 = test_info(dev).committed;
  ASSERT_EQ_U64(committed0, 8 * ps);
  /* 3 more pages of headroom: the next commit first gets down to 5. */
  ASSERT_OK(vp_device_set_headroom(dev, base_head + 3 * (int64_t)ps));
  ASSERT_EQ_INT(test_info(dev).headroom, base_head + 3 * (int64_t)ps);
  vp_vbar_t w = test_vbar(dev, 4 * ps); /* on top */
  ASSERT_OK(test_fault_page(w, 0, NULL));
  ASSERT_EQ_U64(test_info(dev).committed, 5 * ps);
  ASSERT_EQ_STR(test_map(v), "####....");
  /* All pinned: nothing can go, a new page misses. */
  ASSERT_OK(vp_fault(v, 0, 4 * ps, NULL, 0));
  vp_stats_t s0 = test_dev_stats(dev);
  ASSERT_RC(test_fault_page(w, 1, NULL), VP_MISS);
  ASSERT_EQ_U64(test_dev_stats(dev).budget_misses, s0.budget_misses + 1);
  ASSERT_EQ_U64(test_info(dev).committed, 5 * ps);
  /* A headroom that is no whole number of pages: 8 - 2.5 = 5.5 pages. */
  ASSERT_OK(vp_device_set_headroom(dev, base_head + 5 * (int64_t)ps / 2));
  ASSERT_RC(test_fault_page(w, 1, NULL), VP_MISS);
  ASSERT_OK(vp_device_set_headroom(dev, base_head + 2 * (int64_t)ps - 1));
  ASSERT_OK(test_fault_page(w, 1, NULL));
  ASSERT_EQ_U64(test_info(dev).committed, 6 * ps);
  /* Negative headroom is refused. */
  ASSERT_RC(vp_device_set_headroom(dev, -5), VP_EINVAL);
  ASSERT_OK(vp_unpin(v, 0, 4 * ps, 0));
  ASSERT_OK(vp_unpin(w, 0, 2 * ps, 0));
  ASSERT_OK(vp_device_close(dev));
}

/* After every fault that filled, committed <= capacity - headroom. */
static void check_after_fault(vp_device_t dev, uint64_t cap, uint64_t head,
                              uint64_t *fills) {
  uint64_t f = test_dev_stats(dev).fills;
  vp_device_info_t info = test_info(dev);
  if (f != *fills) ASSERT_LE_U64(info.committed + head, cap);
  *fills = f;
}

TEST(budget_capacity_shrinks, TEST_SIM_ONLY) {
  vp_options_t opts;
  test_options(ctx, &opts);
  uint64_t ps = opts.page_size, head = ps;
  opts.headroom = (int64_t)head;
  vp_device_t dev = test_open_cap(ctx, &opts, 16);
  vp_vbar_t v[3];
  for (int i = 0; i < 3; i++) v[i] = test_vbar(dev, 8 * ps);
  test_rng_t rng;
  uint64_t seed = test_seed();
  test_rng_seed(&rng, seed);
  test_note("seed %" PRIu64, seed);
  static const uint64_t caps[] = {16, 10, 6, 3, 12, 5, 1, 16, 8};
  uint64_t fills = 0;
  for (size_t c = 0; c < sizeof caps / sizeof caps[0]; c++) {
    uint64_t cap = caps[c] * ps;
    ASSERT_OK(vp_sim_inject(dev, VP_SIM_SET_CAPACITY, cap));
    for (int i = 0; i < 200; i++) {
      int k = (int)test_rand_below(&rng, 3);
      uint64_t p = test_rand_below(&rng, 8), n = 1 + test_rand_below(&rng, 3);
      if (p + n > 8) n = 8 - p;
      if (test_rand_below(&rng, 8) == 0) ASSERT_OK(vp_vbar_prioritize(v[k]));
      int rc = vp_fault(v[k], p * ps, n * ps, NULL, 0);
      ASSERT_TRUE(rc == VP_OK || rc == VP_MISS);
      check_after_fault(dev, cap, head, &fills);
      if (rc == VP_OK) ASSERT_OK(vp_unpin(v[k], p * ps, n * ps, 0));
    }
    vp_device_info_t info = test_info(dev);
    ASSERT_EQ_U64(info.total_memory, cap);
  }
  ASSERT_GT_U64(fills, 0);
  ASSERT_OK(vp_device_close(dev));
}

TEST(budget_shrink_with_pins, TEST_SIM_ONLY) {
  vp_options_t opts;
  test_options(ctx, &opts);
  uint64_t ps = opts.page_size;
  vp_device_t dev = test_open_cap(ctx, &opts, 8);
  vp_vbar_t v = test_vbar(dev, 8 * ps), w = test_vbar(dev, 8 * ps);
  ASSERT_OK(vp_fault(v, 0, 6 * ps, NULL, 0)); /* pinned */
  test_load_pages(w, 0, 2);
  /* Shrink below what is pinned: nothing can be committed, no crash. */
  ASSERT_OK(vp_sim_inject(dev, VP_SIM_SET_CAPACITY, 4 * ps));
  ASSERT_RC(test_fault_page(w, 2, NULL), VP_MISS);
  ASSERT_RC(test_fault_page(v, 6, NULL), VP_MISS);
  ASSERT_EQ_U64(test_info(dev).committed, 8 * ps); /* nothing forced out */
  /* Hits still work. */
  ASSERT_OK(vp_fault(v, 0, ps, NULL, 0));
  ASSERT_OK(vp_unpin(v, 0, ps, 0));
  /* Unpinned and grown again: commits resume, within the new size. */
  ASSERT_OK(vp_unpin(v, 0, 6 * ps, 0));
  ASSERT_OK(vp_vbar_prioritize(w));
  ASSERT_OK(test_fault_page(w, 2, NULL));
  ASSERT_LE_U64(test_info(dev).committed, 4 * ps);
  ASSERT_OK(vp_unpin(w, 2 * ps, ps, 0));
  ASSERT_OK(vp_sim_inject(dev, VP_SIM_SET_CAPACITY, 12 * ps));
  ASSERT_OK(vp_vbar_prioritize(v));
  ASSERT_OK(vp_fault(v, 0, 8 * ps, NULL, 0));
  ASSERT_LE_U64(test_info(dev).committed, 12 * ps);
  ASSERT_OK(vp_unpin(v, 0, 8 * ps, 0));
  ASSERT_OK(vp_device_close(dev));
}

TEST(budget_polls_bounded, TEST_ALL_BACKENDS) {
  vp_options_t opts;
  test_options(ctx, &opts);
  opts.poll_interval_us = 10u * 1000 * 1000; /* 10 s */
  vp_device_t dev = test_open_cap(ctx, &opts, 4);
  uint64_t ps = opts.page_size;
  vp_vbar_t v = test_vbar(dev, 8 * ps);
  vp_stats_t s0 = test_dev_stats(dev);
  uint64_t t0 = test_now_ms();
  int n = (int)test_scale(400);
  for (int i = 0; i < n; i++) {
    /* Each round commits 1-4 pages anew and frees them. */
    uint64_t p = (uint64_t)i % 5, k = 1 + (uint64_t)i % 4;
    ASSERT_OK(vp_vbar_prioritize(v));
    ASSERT_OK(vp_fault(v, p * ps, k * ps, NULL, 0));
    ASSERT_LE_U64(test_info(dev).committed, 4 * ps);
    ASSERT_OK(vp_unpin(v, p * ps, k * ps, 0));
    ASSERT_OK(vp_vbar_free_memory(v, UINT64_MAX, NULL));
  }
  vp_stats_t s1 = test_dev_stats(dev);
  uint64_t ms = test_now_ms() - t0;
  test_log("%d faults, %" PRIu64 " fills, %" PRIu64 " polls in %" PRIu64
           " ms",
           n, s1.fills - s0.fills, s1.budget_polls - s0.budget_polls, ms);
  ASSERT_EQ_U64(s1.fills - s0.fills, (uint64_t)n);
  if (ms < 9000) ASSERT_LE_U64(s1.budget_polls - s0.budget_polls, 2);
  ASSERT_OK(vp_device_close(dev));

  /* With no interval, the device is asked at every commit that needs it. */
  test_options(ctx, &opts);
  dev = test_open_cap(ctx, &opts, 4);
  v = test_vbar(dev, 8 * ps);
  s0 = test_dev_stats(dev);
  test_load_pages(v, 0, 4);
  s1 = test_dev_stats(dev);
  ASSERT_GE_U64(s1.budget_polls - s0.budget_polls, 1);
  ASSERT_OK(vp_device_close(dev));
}

/* A new headroom polls the device at the next check (torch's allocator
 * that moved it moved what is free too), however long the interval. */
TEST(budget_headroom_polls_again, TEST_ALL_BACKENDS) {
  vp_options_t opts;
  test_options(ctx, &opts);
  opts.poll_interval_us = 10u * 1000 * 1000; /* 10 s */
  vp_device_t dev = test_open_cap(ctx, &opts, 4);
  (void)test_info(dev);                      /* polled once */
  uint64_t t0 = test_now_ms();
  vp_stats_t s0 = test_dev_stats(dev);
  (void)test_info(dev);
  vp_stats_t s1 = test_dev_stats(dev);
  ASSERT_OK(vp_device_set_headroom(dev, (int64_t)opts.page_size));
  (void)test_info(dev);
  vp_stats_t s2 = test_dev_stats(dev);
  if (test_now_ms() - t0 < 9000)
    ASSERT_EQ_U64(s1.budget_polls - s0.budget_polls, 0);
  ASSERT_EQ_U64(s2.budget_polls - s1.budget_polls, 1);
  ASSERT_OK(vp_device_close(dev));
}

/* A limit caps our own commits whatever the device's free memory. */
TEST(budget_limit, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open_cap(ctx, NULL, 8);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 8 * ps);
  ASSERT_OK(vp_device_set_limit(dev, 2 * ps + ps / 2));
  test_load_pages(v, 0, 2);
  ASSERT_RC(vp_fault(v, 6 * ps, ps, NULL, 0), VP_MISS); /* rank 6 > own */
  ASSERT_EQ_U64(test_info(dev).committed, 2 * ps);
  ASSERT_EQ_U64(test_info(dev).budget, 2 * ps + ps / 2);
  ASSERT_OK(vp_device_set_limit(dev, UINT64_MAX));
  ASSERT_OK(vp_vbar_prioritize(v));
  test_load_pages(v, 2, 4);
  ASSERT_EQ_U64(test_info(dev).committed, 6 * ps);
  ASSERT_RC(vp_device_set_limit((vp_device_t){0}, 1), VP_EHANDLE);
  ASSERT_OK(vp_device_close(dev));
}
