/* Fault and unpin: hits, generations, pin counts, ranges, copies. */
#include "test.h"

TEST(fault_hit_after_fill, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 4 * ps);
  uint32_t g1 = 0, g2 = 0;
  ASSERT_OK(test_fault_page(v, 0, &g1));
  ASSERT_NE_U64(g1, 0);
  vp_stats_t s = test_vbar_stats(v);
  ASSERT_EQ_U64(s.fills, 1);
  ASSERT_EQ_U64(s.hits, 0);
  ASSERT_EQ_U64(s.pages_committed, 1);
  ASSERT_EQ_INT(test_resid(v, 0), VP_PAGE_RESIDENT | VP_PAGE_PINNED);
  ASSERT_OK(vp_unpin(v, 0, ps, 0));
  ASSERT_EQ_INT(test_resid(v, 0), VP_PAGE_RESIDENT);
  ASSERT_OK(test_fault_page(v, 0, &g2));
  ASSERT_EQ_U64(g2, g1);
  s = test_vbar_stats(v);
  ASSERT_EQ_U64(s.fills, 1);
  ASSERT_EQ_U64(s.hits, 1);
  ASSERT_EQ_U64(s.pages_committed, 1);
  ASSERT_OK(vp_unpin(v, 0, ps, 0));
  ASSERT_OK(vp_device_close(dev));
}

TEST(fault_generations, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 4 * ps), w = test_vbar(dev, 4 * ps);
  uint32_t gens[4] = {0}, again[4] = {0};
  ASSERT_OK(vp_fault(v, 0, 4 * ps, gens, 4));
  for (int i = 0; i < 4; i++) ASSERT_NE_U64(gens[i], 0);
  ASSERT_OK(vp_unpin(v, 0, 4 * ps, 0));
  /* Fault, unpin, fault again: the same generations, many times. */
  for (int round = 0; round < 5; round++) {
    ASSERT_OK(vp_fault(v, 0, 4 * ps, again, 4));
    ASSERT_MEM_EQ(again, gens, sizeof gens);
    ASSERT_OK(vp_unpin(v, 0, 4 * ps, 0));
  }
  /* Other VBARs' commits and evictions leave them alone. */
  test_load_pages(w, 0, 4);
  ASSERT_OK(vp_vbar_free_memory(w, 4 * ps, NULL));
  ASSERT_OK(vp_fault(v, 0, 4 * ps, again, 4));
  ASSERT_MEM_EQ(again, gens, sizeof gens);
  ASSERT_OK(vp_unpin(v, 0, 4 * ps, 0));

  /* Evict pages 3 and 2; they get new generations, 0 and 1 keep theirs. */
  uint64_t freed = 0;
  ASSERT_OK(vp_vbar_free_memory(v, 2 * ps, &freed));
  ASSERT_EQ_U64(freed, 2 * ps);
  ASSERT_EQ_STR(test_map(v), "##..");
  ASSERT_OK(vp_vbar_prioritize(v)); /* lift the watermark */
  ASSERT_OK(vp_fault(v, 0, 4 * ps, again, 4));
  ASSERT_EQ_U64(again[0], gens[0]);
  ASSERT_EQ_U64(again[1], gens[1]);
  ASSERT_NE_U64(again[2], gens[2]);
  ASSERT_NE_U64(again[3], gens[3]);
  ASSERT_NE_U64(again[2], 0);
  ASSERT_NE_U64(again[3], 0);
  ASSERT_OK(vp_unpin(v, 0, 4 * ps, 0));

  /* Every recommit of one page gives a generation it never had. */
  uint32_t seen[32];
  int nseen = 0;
  for (int i = 0; i < 32; i++) {
    uint32_t g = 0;
    ASSERT_OK(vp_vbar_prioritize(v));
    ASSERT_OK(test_fault_page(v, 3, &g));
    for (int j = 0; j < nseen; j++) ASSERT_NE_U64(g, seen[j]);
    seen[nseen++] = g;
    uint32_t h = 0;
    ASSERT_OK(vp_unpin(v, 3 * ps, ps, 0));
    ASSERT_OK(test_fault_page(v, 3, &h)); /* no recommit: same */
    ASSERT_EQ_U64(h, g);
    ASSERT_OK(vp_unpin(v, 3 * ps, ps, 0));
    ASSERT_OK(vp_vbar_free_memory(v, ps, NULL));
    ASSERT_EQ_INT(test_resid(v, 3), 0);
  }
  ASSERT_OK(vp_device_close(dev));
}

TEST(fault_pin_refcount, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 2 * ps);
  ASSERT_OK(test_fault_page(v, 1, NULL));
  ASSERT_OK(test_fault_page(v, 1, NULL));
  ASSERT_OK(vp_unpin(v, ps, ps, 0));
  ASSERT_EQ_INT(test_resid(v, 1), VP_PAGE_RESIDENT | VP_PAGE_PINNED);
  /* Still pinned: eviction cannot take it. */
  uint64_t freed = 99;
  ASSERT_OK(vp_vbar_free_memory(v, 2 * ps, &freed));
  ASSERT_EQ_U64(freed, 0);
  ASSERT_OK(vp_device_free_memory(dev, 2 * ps, &freed));
  ASSERT_EQ_U64(freed, 0);
  ASSERT_EQ_INT(test_resid(v, 1), VP_PAGE_RESIDENT | VP_PAGE_PINNED);
  ASSERT_OK(vp_unpin(v, ps, ps, 0));
  ASSERT_EQ_INT(test_resid(v, 1), VP_PAGE_RESIDENT);
  ASSERT_RC(vp_unpin(v, ps, ps, 0), VP_ENOTPINNED);
  ASSERT_EQ_INT(test_resid(v, 1), VP_PAGE_RESIDENT);
  /* Many pins, as many unpins. */
  for (int i = 0; i < 100; i++) ASSERT_OK(vp_fault(v, 0, 2 * ps, NULL, 0));
  for (int i = 0; i < 99; i++) ASSERT_OK(vp_unpin(v, 0, 2 * ps, 0));
  ASSERT_EQ_STR(test_map(v), "PP");
  ASSERT_OK(vp_unpin(v, 0, ps, 0));
  ASSERT_EQ_STR(test_map(v), "#P");
  ASSERT_OK(vp_unpin(v, ps, ps, 0));
  ASSERT_EQ_STR(test_map(v), "##");
  ASSERT_OK(vp_device_close(dev));
}

TEST(fault_range, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 8 * ps);
  uint32_t gens[8] = {0}, g2[8] = {0};
  /* Half a page into page 1 to half a page into page 4: pages 1-4. */
  ASSERT_OK(vp_fault(v, ps + ps / 2, 3 * ps, gens, 4));
  ASSERT_EQ_STR(test_map(v), ".PPPP...");
  vp_stats_t s = test_vbar_stats(v);
  ASSERT_EQ_U64(s.fills, 1);
  ASSERT_EQ_U64(s.pages_committed, 4);
  /* A range over resident and new pages: one fill, new pages only. */
  ASSERT_OK(vp_fault(v, 3 * ps, 3 * ps, g2, 3)); /* pages 3-5 */
  ASSERT_EQ_U64(g2[0], gens[2]);
  ASSERT_EQ_U64(g2[1], gens[3]);
  ASSERT_NE_U64(g2[2], 0);
  s = test_vbar_stats(v);
  ASSERT_EQ_U64(s.fills, 2);
  ASSERT_EQ_U64(s.pages_committed, 5);
  ASSERT_EQ_STR(test_map(v), ".PPPPP..");
  /* Unpin by another range shape covering the same pages. */
  ASSERT_OK(vp_unpin(v, ps, 4 * ps, 0));          /* pages 1-4 */
  ASSERT_EQ_STR(test_map(v), ".##PPP..");
  ASSERT_OK(vp_unpin(v, 3 * ps + 5, 2 * ps, 0));  /* pages 3-5 */
  ASSERT_EQ_STR(test_map(v), ".#####..");
  /* The whole VBAR in one fault. */
  uint32_t all[8] = {0};
  ASSERT_OK(vp_fault(v, 0, 8 * ps, all, 8));
  ASSERT_EQ_STR(test_map(v), "PPPPPPPP");
  for (int i = 1; i <= 4; i++) ASSERT_EQ_U64(all[i], gens[i - 1]);
  ASSERT_OK(vp_unpin(v, 0, 8 * ps, 0));
  ASSERT_OK(vp_device_close(dev));
}

TEST(fault_copy_roundtrip, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 4 * ps);
  uint64_t base = test_vbar_base(v);
  uint32_t gens[2], again[2];
  ASSERT_OK(vp_fault(v, ps, 2 * ps, gens, 2));
  test_write_pattern(dev, base + ps, 2 * ps, 42);
  ASSERT_EQ_U64(test_vbar_stats(v).bytes_copied, 4 * ps);
  ASSERT_OK(vp_unpin(v, ps, 2 * ps, 0));
  /* Data stays while the generations do. */
  for (int i = 0; i < 3; i++) {
    ASSERT_OK(vp_fault(v, ps, 2 * ps, again, 2));
    ASSERT_MEM_EQ(again, gens, sizeof gens);
    ASSERT_TRUE(test_check_pattern(dev, base + ps, 2 * ps, 42));
    ASSERT_OK(vp_unpin(v, ps, 2 * ps, 0));
  }
  /* Sub-page copies at odd offsets, across the page boundary. */
  ASSERT_OK(vp_fault(v, ps, 2 * ps, NULL, 0));
  char src[300], back[300];
  test_pattern(src, sizeof src, 5);
  ASSERT_OK(vp_copy_to_device(dev, base + 2 * ps - 150, src, sizeof src, 0));
  ASSERT_OK(vp_copy_to_host(dev, back, base + 2 * ps - 150, sizeof back, 0));
  ASSERT_OK(vp_stream_synchronize(dev, 0));
  ASSERT_MEM_EQ(back, src, sizeof src);
  ASSERT_OK(vp_unpin(v, ps, 2 * ps, 0));
  ASSERT_OK(vp_device_close(dev));
}

TEST(fault_copy_streams, TEST_ALL_BACKENDS) {
  vp_options_t opts;
  test_options(ctx, &opts);
  opts.sim_streams = VP_SIM_WORKER;
  vp_device_t dev = test_open(ctx, &opts);
  uint64_t ps = opts.page_size;
  vp_vbar_t v = test_vbar(dev, 4 * ps);
  uint64_t base = test_vbar_base(v);
  vp_stream_t s1, s2;
  ASSERT_OK(vp_stream_create(dev, &s1));
  ASSERT_OK(vp_stream_create(dev, &s2));
  ASSERT_OK(vp_fault(v, 0, 4 * ps, NULL, 0));
  unsigned char *src = malloc(4 * ps), *back = malloc(4 * ps);
  ASSERT_NOT_NULL(src);
  ASSERT_NOT_NULL(back);
  test_pattern(src, 4 * ps, 9);
  /* Queued copies in stream order: write then read on s1. */
  ASSERT_OK(vp_copy_to_device(dev, base, src, 2 * ps, s1));
  ASSERT_OK(vp_copy_to_device(dev, base + 2 * ps, src + 2 * ps, 2 * ps, s2));
  memset(back, 0, 4 * ps);
  ASSERT_OK(vp_copy_to_host(dev, back, base, 2 * ps, s1));
  ASSERT_OK(vp_stream_synchronize(dev, s1));
  ASSERT_OK(vp_stream_synchronize(dev, s2));
  ASSERT_OK(vp_copy_to_host(dev, back + 2 * ps, base + 2 * ps, 2 * ps, s2));
  ASSERT_OK(vp_stream_synchronize(dev, s2));
  ASSERT_MEM_EQ(back, src, 4 * ps);
  ASSERT_OK(vp_unpin(v, 0, 2 * ps, s1));
  ASSERT_OK(vp_unpin(v, 2 * ps, 2 * ps, s2));
  ASSERT_OK(vp_stream_destroy(dev, s1));
  ASSERT_OK(vp_stream_destroy(dev, s2));
  ASSERT_OK(vp_device_close(dev));
  free(src);
  free(back);
}

TEST(copy_unpinned, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 4 * ps);
  uint64_t base = test_vbar_base(v);
  char buf[64] = {0};
  /* Never resident. */
  ASSERT_RC(vp_copy_to_device(dev, base, buf, sizeof buf, 0), VP_ENOTPINNED);
  ASSERT_RC(vp_copy_to_host(dev, buf, base, sizeof buf, 0), VP_ENOTPINNED);
  ASSERT_TRUE(vp_last_error()[0] != '\0');
  /* Resident but unpinned. */
  test_load_pages(v, 0, 2);
  ASSERT_RC(vp_copy_to_device(dev, base, buf, sizeof buf, 0), VP_ENOTPINNED);
  ASSERT_RC(vp_copy_to_host(dev, buf, base + ps, sizeof buf, 0),
            VP_ENOTPINNED);
  /* Straddling a pinned and an unpinned page. */
  ASSERT_OK(test_fault_page(v, 0, NULL));
  ASSERT_RC(vp_copy_to_device(dev, base + ps - 8, buf, 16, 0), VP_ENOTPINNED);
  ASSERT_RC(vp_copy_to_host(dev, buf, base + ps - 8, 16, 0), VP_ENOTPINNED);
  ASSERT_OK(vp_copy_to_device(dev, base + ps - 16, buf, 16, 0));
  ASSERT_OK(vp_stream_synchronize(dev, 0));
  ASSERT_OK(vp_unpin(v, 0, ps, 0));
  ASSERT_RC(vp_copy_to_device(dev, base, buf, sizeof buf, 0), VP_ENOTPINNED);
  ASSERT_OK(vp_device_close(dev));
}
