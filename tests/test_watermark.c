/* Watermarks: lowered by eviction, misses at once above it, lifted by
 * prioritize; set_watermark, the limit, reset_limits; no thrash. */
#include "test.h"

TEST(watermark_initial, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx), lim = 0;
  vp_vbar_t v = test_vbar(dev, 6 * ps);
  ASSERT_EQ_U64(test_watermark(v), 6);
  ASSERT_OK(vp_vbar_get_watermark_limit(v, &lim));
  ASSERT_GE_U64(lim, 6); /* no limit */
  test_load_pages(v, 0, 6); /* every page is allowed */
  ASSERT_OK(vp_device_close(dev));
}

TEST(watermark_lowered_by_eviction, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 8 * ps);
  test_load_pages(v, 0, 8);
  ASSERT_OK(vp_vbar_free_memory(v, 3 * ps, NULL)); /* pages 7, 6, 5 */
  ASSERT_EQ_U64(test_watermark(v), 5);
  vp_stats_t s0 = test_vbar_stats(v);
  vp_device_info_t i0 = test_info(dev);
  /* Pages at or above the watermark miss at once: nothing committed. */
  ASSERT_RC(test_fault_page(v, 6, NULL), VP_MISS);
  ASSERT_RC(test_fault_page(v, 5, NULL), VP_MISS);
  ASSERT_RC(vp_fault(v, 4 * ps, 2 * ps, NULL, 0), VP_MISS); /* 4 and 5 */
  vp_stats_t s1 = test_vbar_stats(v);
  ASSERT_EQ_U64(s1.watermark_misses, s0.watermark_misses + 3);
  ASSERT_EQ_U64(s1.misses, s0.misses + 3);
  ASSERT_EQ_U64(s1.budget_misses, s0.budget_misses); /* not the budget's */
  ASSERT_EQ_U64(s1.pages_committed, s0.pages_committed);
  ASSERT_EQ_U64(s1.pages_evicted, s0.pages_evicted);
  ASSERT_EQ_U64(test_info(dev).committed, i0.committed);
  ASSERT_EQ_STR(test_map(v), "#####...");
  /* Below it, and resident pages anywhere, are fine. */
  ASSERT_OK(test_fault_page(v, 4, NULL));
  ASSERT_OK(vp_unpin(v, 4 * ps, ps, 0));
  /* Evicting a page ranked above the watermark leaves it where it is. */
  ASSERT_OK(vp_vbar_free_memory(v, ps, NULL)); /* page 4 */
  ASSERT_EQ_U64(test_watermark(v), 4);
  /* prioritize lifts it. */
  ASSERT_OK(vp_vbar_prioritize(v));
  ASSERT_EQ_U64(test_watermark(v), 8);
  ASSERT_OK(vp_fault(v, 4 * ps, 4 * ps, NULL, 0));
  ASSERT_OK(vp_unpin(v, 4 * ps, 4 * ps, 0));
  ASSERT_EQ_STR(test_map(v), "########");
  ASSERT_OK(vp_device_close(dev));
}

TEST(watermark_set, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 8 * ps);
  test_load_pages(v, 5, 1);
  ASSERT_OK(vp_vbar_set_watermark(v, 3 * ps + 100)); /* rounds down */
  ASSERT_EQ_U64(test_watermark(v), 3);
  ASSERT_RC(test_fault_page(v, 3, NULL), VP_MISS);
  ASSERT_OK(test_fault_page(v, 2, NULL));
  ASSERT_OK(test_fault_page(v, 5, NULL)); /* resident: a hit */
  ASSERT_EQ_STR(test_map(v), "..P..P..");
  ASSERT_OK(vp_unpin(v, 2 * ps, ps, 0));
  ASSERT_OK(vp_unpin(v, 5 * ps, ps, 0));
  /* An explicit set also raises it; prioritize lifts it to the whole VBAR. */
  ASSERT_OK(vp_vbar_set_watermark(v, 4 * ps));
  ASSERT_EQ_U64(test_watermark(v), 4);
  ASSERT_RC(test_fault_page(v, 4, NULL), VP_MISS);
  ASSERT_OK(vp_vbar_prioritize(v));
  ASSERT_EQ_U64(test_watermark(v), 8);
  ASSERT_OK(test_fault_page(v, 4, NULL));
  ASSERT_OK(vp_unpin(v, 4 * ps, ps, 0));
  /* The whole VBAR is the most it may be; 0 stops every new page. */
  ASSERT_OK(vp_vbar_set_watermark(v, 8 * ps));
  ASSERT_EQ_U64(test_watermark(v), 8);
  ASSERT_FAILS(vp_vbar_set_watermark(v, 8 * ps + ps));
  ASSERT_OK(vp_vbar_set_watermark(v, 0));
  ASSERT_EQ_U64(test_watermark(v), 0);
  ASSERT_RC(test_fault_page(v, 0, NULL), VP_MISS);
  ASSERT_OK(test_fault_page(v, 5, NULL)); /* still resident */
  ASSERT_OK(vp_unpin(v, 5 * ps, ps, 0));
  ASSERT_OK(vp_device_close(dev));
}

TEST(watermark_limit, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx), lim = 0;
  vp_vbar_t v = test_vbar(dev, 8 * ps), w = test_vbar(dev, 8 * ps);
  test_load_pages(v, 6, 1);
  ASSERT_OK(vp_vbar_set_watermark_limit(v, 2 * ps + 1));
  ASSERT_OK(vp_vbar_get_watermark_limit(v, &lim));
  ASSERT_EQ_U64(lim, 2);
  ASSERT_OK(vp_vbar_set_watermark_limit(w, 3 * ps));
  ASSERT_EQ_U64(test_watermark(v), 8); /* a separate number */
  ASSERT_RC(test_fault_page(v, 2, NULL), VP_MISS);
  ASSERT_EQ_U64(test_vbar_stats(v).watermark_misses, 1);
  ASSERT_OK(test_fault_page(v, 1, NULL));
  ASSERT_OK(test_fault_page(v, 6, NULL)); /* resident: fine */
  ASSERT_OK(vp_unpin(v, ps, ps, 0));
  ASSERT_OK(vp_unpin(v, 6 * ps, ps, 0));
  /* prioritize does not lift a limit. */
  ASSERT_OK(vp_vbar_prioritize(v));
  ASSERT_RC(test_fault_page(v, 2, NULL), VP_MISS);
  ASSERT_OK(vp_vbar_get_watermark_limit(v, &lim));
  ASSERT_EQ_U64(lim, 2);
  /* The lower of watermark and limit counts. */
  ASSERT_OK(vp_vbar_set_watermark_limit(v, 4 * ps));
  ASSERT_OK(vp_vbar_set_watermark(v, 2 * ps));
  ASSERT_RC(test_fault_page(v, 3, NULL), VP_MISS); /* watermark 2 */
  ASSERT_OK(vp_vbar_prioritize(v));
  test_load_pages(v, 3, 1);
  ASSERT_RC(test_fault_page(v, 4, NULL), VP_MISS); /* limit 4 */
  ASSERT_EQ_U64(test_watermark(v), 8);
  /* UINT64_MAX is no limit. */
  ASSERT_OK(vp_vbar_set_watermark_limit(v, UINT64_MAX));
  ASSERT_OK(vp_vbar_get_watermark_limit(v, &lim));
  ASSERT_GE_U64(lim, 8);
  test_load_pages(v, 4, 1);
  /* reset_limits lifts every VBAR's limit. */
  ASSERT_OK(vp_vbar_set_watermark_limit(v, 0));
  ASSERT_RC(test_fault_page(v, 0, NULL), VP_MISS);
  ASSERT_RC(test_fault_page(w, 3, NULL), VP_MISS);
  ASSERT_OK(vp_device_reset_limits(dev));
  ASSERT_OK(vp_vbar_get_watermark_limit(v, &lim));
  ASSERT_GE_U64(lim, 8);
  ASSERT_OK(vp_vbar_get_watermark_limit(w, &lim));
  ASSERT_GE_U64(lim, 8);
  test_load_pages(v, 0, 8);
  test_load_pages(w, 0, 8);
  ASSERT_OK(vp_device_close(dev));
}

/* Two VBARs that together exceed the device, used in turn, page by page
 * (as two models run one after the other): after the first round the
 * watermark keeps each one's resident set stable, so evictions stop. */
TEST(watermark_stops_thrash, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open_cap(ctx, NULL, 8);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t a = test_vbar(dev, 6 * ps), b = test_vbar(dev, 6 * ps);
  uint64_t evicted[8] = {0}, wmisses[8] = {0};
  char map_a[8][16], map_b[8][16];
  for (int round = 0; round < 8; round++) {
    vp_vbar_t pair[2] = {a, b};
    for (int m = 0; m < 2; m++) {
      for (uint64_t p = 0; p < 6; p++) {
        if (test_fault_page(pair[m], p, NULL) == VP_OK)
          ASSERT_OK(vp_unpin(pair[m], p * ps, ps, 0));
      }
    }
    vp_stats_t s = test_dev_stats(dev);
    evicted[round] = s.pages_evicted;
    wmisses[round] = s.watermark_misses;
    snprintf(map_a[round], sizeof map_a[round], "%s", test_map(a));
    snprintf(map_b[round], sizeof map_b[round], "%s", test_map(b));
    test_log("round %d: evicted %" PRIu64 " a=%s b=%s", round,
             evicted[round], map_a[round], map_b[round]);
    ASSERT_LE_U64(test_info(dev).committed, 8 * ps);
  }
  ASSERT_GT_U64(evicted[0], 0);
  for (int r = 2; r < 8; r++) {
    ASSERT_EQ_U64(evicted[r], evicted[1]);
    ASSERT_EQ_STR(map_a[r], map_a[1]);
    ASSERT_EQ_STR(map_b[r], map_b[1]);
    ASSERT_GT_U64(wmisses[r], wmisses[r - 1]); /* misses at once */
  }
  ASSERT_OK(vp_device_close(dev));
}

/* One interleaved VBAR larger than the device, run pass after pass: it
 * evicts its own pages ranked above what it needs in the first pass, then
 * its watermark keeps the resident set fixed. */
TEST(watermark_stable_interleaved, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open_cap(ctx, NULL, 8);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 16 * ps);
  ASSERT_OK(vp_vbar_set_order(v, VP_ORDER_INTERLEAVED));
  uint64_t evicted[6];
  char maps[6][32];
  for (int pass = 0; pass < 6; pass++) {
    for (uint64_t p = 0; p < 16; p++)
      if (test_fault_page(v, p, NULL) == VP_OK)
        ASSERT_OK(vp_unpin(v, p * ps, ps, 0));
    evicted[pass] = test_vbar_stats(v).pages_evicted;
    snprintf(maps[pass], sizeof maps[pass], "%s", test_map(v));
    test_log("pass %d: evicted %" PRIu64 " %s wm %" PRIu64, pass,
             evicted[pass], maps[pass], test_watermark(v));
  }
  for (int pass = 2; pass < 6; pass++) {
    ASSERT_EQ_U64(evicted[pass], evicted[1]);
    ASSERT_EQ_STR(maps[pass], maps[1]);
  }
  ASSERT_EQ_U64(test_resident_count(v), 8);
  /* The resident pages are spread: every pair of neighbours has one. */
  for (int p = 0; p < 16; p += 2)
    ASSERT_TRUE(maps[5][p] != '.' || maps[5][p + 1] != '.');
  ASSERT_OK(vp_device_close(dev));
}
