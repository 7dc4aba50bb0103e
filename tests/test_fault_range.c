/* vp_fault_range / vp_unpin_range: vp_fault / vp_unpin on a range
 * described once (the comfy_aimdo binding's hit path), the zeroed tail of
 * the generations, and the same errors. */
#include "test.h"

TEST(fault_range_same_as_fault, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 8 * ps);
  /* Half a page into page 1 to half a page into page 4: pages 1-4. */
  vp_range_t r = {.vbar = v, .offset = ps + ps / 2, .size = 3 * ps};
  uint32_t gens[7], ref[4] = {0};
  memset(gens, 0xab, sizeof gens);
  ASSERT_OK(vp_fault_range(&r, gens, 7));
  ASSERT_EQ_STR(test_map(v), ".PPPP...");
  for (int i = 0; i < 4; i++) ASSERT_NE_U64(gens[i], 0);
  for (int i = 4; i < 7; i++) ASSERT_EQ_U64(gens[i], 0); /* the tail */
  ASSERT_OK(vp_fault(v, r.offset, r.size, ref, 4));
  ASSERT_MEM_EQ(ref, gens, sizeof ref);
  ASSERT_EQ_STR(test_map(v), ".PPPP...");
  ASSERT_OK(vp_unpin_range(&r, 0));
  ASSERT_EQ_STR(test_map(v), ".PPPP..."); /* counted: one pin left */
  ASSERT_OK(vp_unpin(v, r.offset, r.size, 0));
  ASSERT_EQ_STR(test_map(v), ".####...");
  ASSERT_RC(vp_unpin_range(&r, 0), VP_ENOTPINNED);
  vp_stats_t s = test_vbar_stats(v);
  ASSERT_EQ_U64(s.fills, 1);
  ASSERT_EQ_U64(s.hits, 1);
  ASSERT_EQ_U64(s.unpins, 2);

  /* ngens exactly the page count, and gens NULL, work as in vp_fault. */
  uint32_t again[4] = {0};
  ASSERT_OK(vp_fault_range(&r, again, 4));
  ASSERT_MEM_EQ(again, ref, sizeof ref);
  ASSERT_OK(vp_fault_range(&r, NULL, 0));
  ASSERT_OK(vp_unpin_range(&r, 0));
  ASSERT_OK(vp_unpin_range(&r, 0));

  /* A refilled page changes its generation in the range's gens; one
   * byte of a page is a range of one page. */
  vp_range_t last = {.vbar = v, .offset = 4 * ps + ps - 1, .size = 1};
  uint32_t g1[3] = {0}, g2[3] = {0};
  ASSERT_OK(vp_fault_range(&last, g1, 3));
  ASSERT_EQ_U64(g1[0], ref[3]);
  ASSERT_EQ_U64(g1[1], 0);
  ASSERT_OK(vp_unpin_range(&last, 0));
  uint64_t freed = 0;
  ASSERT_OK(vp_vbar_free_memory(v, 8 * ps, &freed));
  ASSERT_EQ_U64(freed, 4 * ps);
  ASSERT_OK(vp_vbar_prioritize(v)); /* lift the watermark */
  ASSERT_OK(vp_fault_range(&last, g2, 3));
  ASSERT_NE_U64(g2[0], g1[0]);
  ASSERT_NE_U64(g2[0], 0);
  ASSERT_OK(vp_unpin_range(&last, 0));
  ASSERT_OK(vp_device_close(dev));
}

TEST(fault_range_miss_pins_nothing, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open_cap(ctx, NULL, 2);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 4 * ps);
  vp_range_t all = {.vbar = v, .offset = 0, .size = 4 * ps};
  uint32_t gens[6];
  ASSERT_RC(vp_fault_range(&all, gens, 6), VP_MISS);
  ASSERT_TRUE(strchr(test_map(v), 'P') == NULL);
  ASSERT_RC(vp_unpin_range(&all, 0), VP_ENOTPINNED);
  ASSERT_OK(vp_device_close(dev));
}

TEST(fault_range_errors, TEST_SIM_ONLY) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 4 * ps);
  uint32_t gens[8];
  ASSERT_RC(vp_fault_range(NULL, gens, 8), VP_EINVAL);
  ASSERT_TRUE(strncmp(vp_last_error(), "vp_fault_range: ", 16) == 0);
  ASSERT_RC(vp_unpin_range(NULL, 0), VP_EINVAL);
  ASSERT_TRUE(strncmp(vp_last_error(), "vp_unpin_range: ", 16) == 0);
  vp_range_t r = {.vbar = v, .offset = 0, .size = 2 * ps};
  ASSERT_RC(vp_fault_range(&r, gens, 1), VP_EINVAL); /* room for 1 of 2 */
  ASSERT_TRUE(strncmp(vp_last_error(), "vp_fault_range: ", 16) == 0);
  r.size = 0;
  ASSERT_RC(vp_fault_range(&r, gens, 8), VP_EINVAL);
  ASSERT_RC(vp_unpin_range(&r, 0), VP_EINVAL);
  r.offset = 3 * ps;
  r.size = 2 * ps;
  ASSERT_RC(vp_fault_range(&r, gens, 8), VP_ERANGE);
  ASSERT_RC(vp_unpin_range(&r, 0), VP_ERANGE);
  r.offset = ps;
  r.size = UINT64_MAX;
  ASSERT_RC(vp_fault_range(&r, gens, 8), VP_ERANGE);
  ASSERT_TRUE(strchr(test_map(v), 'P') == NULL);
  /* A stale handle (the VBAR destroyed) and a foreign one are errors. */
  vp_range_t stale = {.vbar = v, .offset = 0, .size = ps};
  ASSERT_OK(vp_vbar_destroy(v));
  ASSERT_RC(vp_fault_range(&stale, gens, 8), VP_EHANDLE);
  ASSERT_TRUE(strncmp(vp_last_error(), "vp_fault_range: ", 16) == 0);
  ASSERT_RC(vp_unpin_range(&stale, 0), VP_EHANDLE);
  vp_range_t foreign = {.vbar = {.id = 0x5a5a5a5a5a5a5a5aull}, .size = 1};
  ASSERT_RC(vp_fault_range(&foreign, gens, 8), VP_EHANDLE);
  ASSERT_RC(vp_unpin_range(&foreign, 0), VP_EHANDLE);
  ASSERT_OK(vp_device_close(dev));
}
