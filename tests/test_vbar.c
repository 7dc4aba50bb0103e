/* VBARs: any size, addresses, page counts, residency map, loaded size. */
#include "test.h"

#define MiB (1024ull * 1024)

TEST(vbar_basic, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  vp_device_info_t info = test_info(dev);
  uint64_t ps = info.page_size;
  vp_vbar_t v = test_vbar(dev, 4 * ps);
  uint64_t base = test_vbar_base(v), size = 0, pages = 0, loaded = 7;
  ASSERT_NE_U64(base, 0);
  ASSERT_EQ_U64(base % info.granularity, 0);
  ASSERT_OK(vp_vbar_size(v, &size));
  ASSERT_EQ_U64(size, 4 * ps);
  ASSERT_OK(vp_vbar_page_count(v, &pages));
  ASSERT_EQ_U64(pages, 4);
  vp_device_t owner;
  ASSERT_OK(vp_vbar_device(v, &owner));
  ASSERT_EQ_U64(owner.id, dev.id);
  ASSERT_OK(vp_vbar_loaded_size(v, &loaded));
  ASSERT_EQ_U64(loaded, 0);
  ASSERT_EQ_STR(test_map(v), "....");

  ASSERT_OK(vp_fault(v, ps, 2 * ps, NULL, 0));
  ASSERT_EQ_STR(test_map(v), ".PP.");
  uint8_t flags[4];
  ASSERT_OK(vp_vbar_residency(v, flags, 4));
  ASSERT_EQ_INT(flags[0], 0);
  ASSERT_EQ_INT(flags[1], VP_PAGE_RESIDENT | VP_PAGE_PINNED);
  ASSERT_EQ_INT(flags[3], 0);
  ASSERT_OK(vp_vbar_loaded_size(v, &loaded));
  ASSERT_EQ_U64(loaded, 2 * ps);
  ASSERT_OK(vp_unpin(v, ps, ps, 0));
  ASSERT_OK(vp_vbar_residency(v, flags, 4));
  ASSERT_EQ_INT(flags[1], VP_PAGE_RESIDENT);
  ASSERT_EQ_INT(flags[2], VP_PAGE_RESIDENT | VP_PAGE_PINNED);
  /* A prefix of the map. */
  memset(flags, 0xee, sizeof flags);
  ASSERT_OK(vp_vbar_residency(v, flags, 2));
  ASSERT_EQ_INT(flags[1], VP_PAGE_RESIDENT);
  ASSERT_EQ_INT(flags[2], 0xee);
  ASSERT_OK(vp_unpin(v, 2 * ps, ps, 0));
  ASSERT_EQ_U64(test_info(dev).committed, 2 * ps);
  ASSERT_OK(vp_vbar_destroy(v));
  ASSERT_EQ_U64(test_info(dev).committed, 0);
  ASSERT_OK(vp_device_close(dev));
}

TEST(vbar_size_rounding, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx), size = 0, pages = 0;
  vp_vbar_t v = test_vbar(dev, ps + 1);
  ASSERT_OK(vp_vbar_page_count(v, &pages));
  ASSERT_EQ_U64(pages, 2);
  ASSERT_OK(vp_vbar_size(v, &size));
  ASSERT_TRUE(size == ps + 1 || size == 2 * ps);
  ASSERT_OK(vp_fault(v, ps, 1, NULL, 0));
  ASSERT_OK(vp_unpin(v, ps, 1, 0));
  vp_vbar_t w = test_vbar(dev, 1);
  ASSERT_OK(vp_vbar_page_count(w, &pages));
  ASSERT_EQ_U64(pages, 1);
  ASSERT_OK(vp_fault(w, 0, 1, NULL, 0));
  test_write_pattern(dev, test_vbar_base(w), 1, 3);
  ASSERT_OK(vp_unpin(w, 0, 1, 0));
  ASSERT_OK(vp_vbar_destroy(v));
  ASSERT_OK(vp_vbar_destroy(w));
  ASSERT_OK(vp_device_close(dev));
}

TEST(vbar_huge, TEST_ALL_BACKENDS) {
  /* 1 TiB of address space on a device of 4 pages of 8 MiB (TSan cannot
   * map that much: 64 GiB there). */
  const uint64_t huge = TEST_TSAN ? (64ull << 30) : (1ull << 40);
  vp_options_t opts;
  test_options(ctx, &opts);
  opts.page_size = 8 * MiB;
  vp_device_t dev = test_open_cap(ctx, &opts, 4);
  vp_vbar_t v = test_vbar(dev, huge);
  uint64_t size = 0, pages = 0;
  ASSERT_OK(vp_vbar_size(v, &size));
  ASSERT_EQ_U64(size, huge);
  ASSERT_OK(vp_vbar_page_count(v, &pages));
  ASSERT_EQ_U64(pages, huge / (8 * MiB));
  uint64_t base = test_vbar_base(v);
  ASSERT_EQ_U64(base % test_info(dev).granularity, 0);
  /* A second one does not overlap the first. */
  vp_vbar_t w = test_vbar(dev, huge);
  uint64_t wbase = test_vbar_base(w);
  ASSERT_TRUE(wbase >= base + huge || wbase + huge <= base);
  /* The last page and the first can be used. */
  ASSERT_OK(vp_fault(v, huge - 8 * MiB, 8 * MiB, NULL, 0));
  test_write_pattern(dev, base + huge - 64, 64, 1);
  ASSERT_OK(vp_fault(v, 0, 1, NULL, 0));
  ASSERT_EQ_U64(test_info(dev).committed, 16 * MiB);
  uint64_t loaded = 0;
  ASSERT_OK(vp_vbar_loaded_size(v, &loaded));
  ASSERT_EQ_U64(loaded, 16 * MiB);
  uint8_t flags[3];
  ASSERT_OK(vp_vbar_residency(v, flags, 3));
  ASSERT_EQ_INT(flags[0], VP_PAGE_RESIDENT | VP_PAGE_PINNED);
  ASSERT_EQ_INT(flags[1], 0);
  ASSERT_RC(vp_unpin(v, 0, huge, 0), VP_ENOTPINNED);
  ASSERT_OK(vp_unpin(v, huge - 1, 1, 0));
  ASSERT_OK(vp_unpin(v, 0, 1, 0));
  ASSERT_OK(vp_vbar_destroy(w));
  ASSERT_OK(vp_vbar_destroy(v));
  ASSERT_OK(vp_device_close(dev));
}

TEST(vbar_many, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open_cap(ctx, NULL, 8);
  uint64_t ps = test_page_size(ctx);
  enum { N = 100 };
  vp_vbar_t v[N];
  uint64_t base[N];
  test_rng_t rng;
  test_rng_seed(&rng, test_seed());
  for (int i = 0; i < N; i++) {
    v[i] = test_vbar(dev, (uint64_t)(1 + i % 5) * ps);
    base[i] = test_vbar_base(v[i]);
    for (int j = 0; j < i; j++) ASSERT_NE_U64(base[i], base[j]);
    if (i % 7 == 0) test_load_pages(v[i], 0, 1);
  }
  /* Destroy in a random order; the survivors keep working. */
  int order[N];
  for (int i = 0; i < N; i++) order[i] = i;
  for (int i = N - 1; i > 0; i--) {
    int j = (int)test_rand_below(&rng, (uint64_t)i + 1), t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
  for (int k = 0; k < N; k++) {
    ASSERT_OK(vp_vbar_destroy(v[order[k]]));
    if (k + 1 < N) {
      vp_vbar_t s = v[order[k + 1]];
      ASSERT_OK(vp_vbar_prioritize(s)); /* it may have been squeezed */
      ASSERT_OK(vp_fault(s, 0, 1, NULL, 0));
      ASSERT_OK(vp_unpin(s, 0, 1, 0));
    }
  }
  ASSERT_EQ_U64(test_info(dev).committed, 0);
  ASSERT_OK(vp_device_close(dev));
}

TEST(vbar_destroy_frees, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open_cap(ctx, NULL, 4);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t a = test_vbar(dev, 4 * ps);
  test_load_pages(a, 0, 4);
  uint64_t r = 0;
  ASSERT_OK(vp_device_reclaimable(dev, &r));
  ASSERT_EQ_U64(r, 4 * ps);
  ASSERT_EQ_U64(test_info(dev).committed, 4 * ps);
  ASSERT_OK(vp_vbar_destroy(a));
  ASSERT_EQ_U64(test_info(dev).committed, 0);
  ASSERT_OK(vp_device_reclaimable(dev, &r));
  ASSERT_EQ_U64(r, 0);
  /* The whole capacity is free for the next VBAR, without evictions. */
  vp_vbar_t b = test_vbar(dev, 4 * ps);
  vp_stats_t before = test_dev_stats(dev);
  test_load_pages(b, 0, 4);
  ASSERT_EQ_U64(test_dev_stats(dev).pages_evicted, before.pages_evicted);
  ASSERT_OK(vp_device_close(dev));
}
