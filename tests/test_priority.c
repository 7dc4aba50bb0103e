/* Priority order: new VBARs on top; prioritize / deprioritize change who is
 * evicted first, both by vp_device_free_memory and by faults. */
#include "test.h"

/* Which of the VBARs lost a page in the last step (index, -1 none). */
static int who_lost(vp_vbar_t *v, int n, uint64_t *before) {
  int who = -1;
  for (int i = 0; i < n; i++) {
    uint64_t now = test_resident_count(v[i]);
    if (now < before[i]) {
      ASSERT_EQ_INT(who, -1);
      who = i;
    }
    before[i] = now;
  }
  return who;
}

TEST(priority_free_memory_order, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v[3];
  uint64_t count[3];
  for (int i = 0; i < 3; i++) {
    v[i] = test_vbar(dev, 2 * ps);
    test_load_pages(v[i], 0, 2);
    count[i] = 2;
  }
  /* top -> bottom: 2 1 0. */
  ASSERT_OK(vp_device_free_memory(dev, 1, NULL));
  ASSERT_EQ_INT(who_lost(v, 3, count), 0);
  /* deprioritize 2: 1 0 2. */
  ASSERT_OK(vp_vbar_deprioritize(v[2]));
  ASSERT_OK(vp_device_free_memory(dev, 1, NULL));
  ASSERT_EQ_INT(who_lost(v, 3, count), 2);
  /* prioritize 0: 0 1 2; 2 has one page left. */
  ASSERT_OK(vp_vbar_prioritize(v[0]));
  ASSERT_OK(vp_device_free_memory(dev, 1, NULL));
  ASSERT_EQ_INT(who_lost(v, 3, count), 2);
  ASSERT_OK(vp_device_free_memory(dev, 1, NULL));
  ASSERT_EQ_INT(who_lost(v, 3, count), 1);
  ASSERT_OK(vp_device_free_memory(dev, 1, NULL));
  ASSERT_EQ_INT(who_lost(v, 3, count), 1);
  ASSERT_OK(vp_device_free_memory(dev, 1, NULL));
  ASSERT_EQ_INT(who_lost(v, 3, count), 0);
  /* Prioritizing the top one, or deprioritizing the bottom one, is fine. */
  ASSERT_OK(vp_vbar_prioritize(v[0]));
  ASSERT_OK(vp_vbar_prioritize(v[0]));
  ASSERT_OK(vp_vbar_deprioritize(v[2]));
  ASSERT_OK(vp_vbar_deprioritize(v[2]));
  ASSERT_OK(vp_device_close(dev));
}

TEST(priority_fault_order, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open_cap(ctx, NULL, 6);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v[3];
  uint64_t count[3];
  for (int i = 0; i < 3; i++) {
    v[i] = test_vbar(dev, 4 * ps);
    test_load_pages(v[i], 0, 2);
    count[i] = 2;
  }
  vp_vbar_t top = test_vbar(dev, 8 * ps);
  /* top, 2, 1, 0: top's faults take 0's pages, then 1's. */
  test_load_pages(top, 0, 1);
  ASSERT_EQ_INT(who_lost(v, 3, count), 0);
  ASSERT_OK(vp_vbar_deprioritize(v[1])); /* top 2 0 1 */
  test_load_pages(top, 1, 1);
  ASSERT_EQ_INT(who_lost(v, 3, count), 1);
  ASSERT_OK(vp_vbar_prioritize(v[0])); /* 0 top 2 1 */
  test_load_pages(top, 2, 1);
  ASSERT_EQ_INT(who_lost(v, 3, count), 1);
  test_load_pages(top, 3, 1);
  ASSERT_EQ_INT(who_lost(v, 3, count), 2);
  test_load_pages(top, 4, 1);
  ASSERT_EQ_INT(who_lost(v, 3, count), 2);
  /* 0 is above top now: top's next fault takes its own pages ranked above
   * (none: it has 0-4), so it misses and 0 keeps its page. */
  ASSERT_RC(test_fault_page(top, 5, NULL), VP_MISS);
  ASSERT_EQ_INT(who_lost(v, 3, count), -1);
  ASSERT_EQ_U64(count[0], 1);
  /* 0 itself may take top's pages. */
  test_load_pages(v[0], 1, 1);
  ASSERT_EQ_STR(test_map(top), "####....");
  ASSERT_OK(vp_device_close(dev));
}
