/* Eviction: lowest priority first, each VBAR's order, never a pinned page,
 * free-memory amounts, reclaimable bytes, faults that need memory. */
#include "test.h"

/* Evict one page at a time with vp_vbar_free_memory and return the order in
 * which pages went (n pages, all resident and unpinned at the start). */
static void eviction_sequence(vp_vbar_t v, uint64_t n, uint64_t *seq) {
  vp_device_t dev;
  ASSERT_OK(vp_vbar_device(v, &dev));
  uint64_t ps = test_info(dev).page_size;
  uint8_t *before = malloc(n), *after = malloc(n);
  ASSERT_NOT_NULL(before);
  ASSERT_NOT_NULL(after);
  ASSERT_OK(vp_vbar_residency(v, before, n));
  for (uint64_t k = 0; k < n; k++) {
    uint64_t freed = 0;
    ASSERT_OK(vp_vbar_free_memory(v, 1, &freed));
    ASSERT_EQ_U64(freed, ps);
    ASSERT_OK(vp_vbar_residency(v, after, n));
    uint64_t gone = n;
    for (uint64_t p = 0; p < n; p++) {
      if ((before[p] & VP_PAGE_RESIDENT) && !(after[p] & VP_PAGE_RESIDENT)) {
        ASSERT_EQ_U64(gone, n); /* exactly one */
        gone = p;
      }
    }
    ASSERT_LT_U64(gone, n);
    seq[k] = gone;
    memcpy(before, after, n);
  }
  free(before);
  free(after);
}

static uint64_t bitrev(uint64_t v, int bits) {
  uint64_t r = 0;
  for (int i = 0; i < bits; i++, v >>= 1) r = (r << 1) | (v & 1);
  return r;
}

TEST(evict_tail_first_order, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  vp_vbar_t v = test_vbar(dev, 8 * test_page_size(ctx));
  test_load_pages(v, 0, 8);
  uint64_t seq[8];
  eviction_sequence(v, 8, seq);
  for (uint64_t k = 0; k < 8; k++) ASSERT_EQ_U64(seq[k], 7 - k);
  ASSERT_OK(vp_device_close(dev));
}

TEST(evict_interleaved_order, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 8 * ps);
  ASSERT_OK(vp_vbar_set_order(v, VP_ORDER_INTERLEAVED));
  test_load_pages(v, 0, 8);
  uint64_t seq[16];
  eviction_sequence(v, 8, seq);
  static const uint64_t want8[8] = {7, 3, 5, 1, 6, 2, 4, 0};
  for (int k = 0; k < 8; k++) ASSERT_EQ_U64(seq[k], want8[k]);
  ASSERT_OK(vp_vbar_destroy(v));

  /* 16 pages, from the device default. */
  vp_options_t opts;
  test_options(ctx, &opts);
  opts.evict_order = VP_ORDER_INTERLEAVED;
  vp_device_t d2 = test_open(ctx, &opts);
  vp_vbar_t w = test_vbar(d2, 16 * ps);
  test_load_pages(w, 0, 16);
  eviction_sequence(w, 16, seq);
  for (uint64_t k = 0; k < 16; k++) ASSERT_EQ_U64(seq[k], bitrev(15 - k, 4));
  ASSERT_OK(vp_device_close(d2));

  /* A page count that is no power of two: a permutation, page 0 last. */
  vp_vbar_t x = test_vbar(dev, 6 * ps);
  ASSERT_OK(vp_vbar_set_order(x, VP_ORDER_INTERLEAVED));
  test_load_pages(x, 0, 6);
  eviction_sequence(x, 6, seq);
  unsigned seen = 0;
  for (int k = 0; k < 6; k++) seen |= 1u << seq[k];
  ASSERT_EQ_U64(seen, 0x3f);
  ASSERT_EQ_U64(seq[5], 0);
  ASSERT_OK(vp_device_close(dev));
}

/* The caller's ranking: pages go highest rank first; the watermark follows
 * it (a squeezed VBAR keeps the pages ranked first); new weights keep it;
 * vp_vbar_set_order() replaces it; bad permutations change nothing. */
TEST(evict_custom_ranks, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 6 * ps);
  static const uint32_t ranks[6] = {4, 0, 5, 2, 1, 3};
  static const uint32_t dup[6] = {4, 0, 5, 2, 1, 4};
  static const uint32_t past[6] = {4, 0, 5, 2, 1, 6};
  ASSERT_RC(vp_vbar_set_ranks(v, ranks, 5), VP_EINVAL);
  ASSERT_RC(vp_vbar_set_ranks(v, dup, 6), VP_EINVAL);
  ASSERT_RC(vp_vbar_set_ranks(v, past, 6), VP_EINVAL);
  ASSERT_RC(vp_vbar_set_ranks(v, NULL, 6), VP_EINVAL);
  ASSERT_OK(vp_vbar_set_ranks(v, ranks, 6));
  uint64_t off[2] = {0, 3 * ps}, size[2] = {2 * ps, ps};
  vp_weight_t ws[2];
  ASSERT_OK(vp_weights_create(v, 2, off, size, NULL, ws));
  test_load_pages(v, 0, 6);
  ASSERT_OK(vp_vbar_set_ranks(v, ranks, 6)); /* resident pages stay */
  ASSERT_EQ_STR(test_map(v), "######");
  uint64_t seq[6];
  eviction_sequence(v, 6, seq);
  for (int k = 0; k < 6; k++) ASSERT_EQ_U64(seq[k], ranks[5 - k]);
  char *rep = malloc(1 << 16);
  ASSERT_NOT_NULL(rep);
  ASSERT_OK(vp_device_report(dev, 0, rep, 1 << 16, NULL));
  ASSERT_NOT_NULL(strstr(rep, "custom"));
  free(rep);
  /* Squeezed: the watermark keeps pages 4 and 0 (ranks 0, 1) and no more. */
  ASSERT_OK(vp_vbar_prioritize(v));
  test_load_pages(v, 4, 1);
  test_load_pages(v, 0, 1);
  uint64_t wm = 0;
  ASSERT_OK(vp_vbar_set_watermark(v, 2 * ps));
  ASSERT_OK(vp_vbar_get_watermark(v, &wm));
  ASSERT_EQ_U64(wm, 2);
  uint32_t g[1];
  ASSERT_RC(vp_fault(v, 5 * ps, ps, g, 1), VP_MISS);   /* rank 2 */
  ASSERT_OK(vp_fault(v, 4 * ps, ps, g, 1));
  ASSERT_OK(vp_unpin(v, 4 * ps, ps, 0));
  ASSERT_OK(vp_vbar_free_memory(v, 6 * ps, NULL));
  ASSERT_OK(vp_vbar_set_order(v, VP_ORDER_TAIL_FIRST));
  ASSERT_OK(vp_vbar_prioritize(v));
  test_load_pages(v, 0, 6);
  eviction_sequence(v, 6, seq);
  for (uint64_t k = 0; k < 6; k++) ASSERT_EQ_U64(seq[k], 5 - k);
  ASSERT_OK(vp_device_close(dev));
}

TEST(evict_never_pinned, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 8 * ps), w = test_vbar(dev, 4 * ps);
  test_load_pages(v, 0, 8);
  test_load_pages(w, 0, 4);
  ASSERT_OK(test_fault_page(v, 7, NULL));
  ASSERT_OK(test_fault_page(v, 5, NULL));
  ASSERT_OK(test_fault_page(w, 0, NULL));
  uint64_t freed = 0, r = 0;
  ASSERT_OK(vp_device_reclaimable(dev, &r));
  ASSERT_EQ_U64(r, 9 * ps);
  ASSERT_OK(vp_vbar_free_memory(v, 8 * ps, &freed));
  ASSERT_EQ_U64(freed, 6 * ps);
  ASSERT_EQ_STR(test_map(v), ".....P.P");
  ASSERT_OK(vp_device_free_memory(dev, UINT64_MAX, &freed));
  ASSERT_EQ_U64(freed, 3 * ps);
  ASSERT_EQ_STR(test_map(w), "P...");
  ASSERT_OK(vp_device_reclaimable(dev, &r));
  ASSERT_EQ_U64(r, 0);
  ASSERT_EQ_U64(test_info(dev).committed, 3 * ps);
  ASSERT_OK(vp_unpin(v, 5 * ps, ps, 0));
  ASSERT_OK(vp_unpin(v, 7 * ps, ps, 0));
  ASSERT_OK(vp_unpin(w, 0, ps, 0));
  ASSERT_OK(vp_device_reclaimable(dev, &r));
  ASSERT_EQ_U64(r, 3 * ps);
  ASSERT_OK(vp_device_close(dev));
}

TEST(evict_free_amounts, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t a = test_vbar(dev, 4 * ps), b = test_vbar(dev, 4 * ps);
  test_load_pages(a, 0, 4);
  test_load_pages(b, 0, 4);
  uint64_t freed = 77, loaded = 0;
  /* Nothing asked, nothing freed. */
  ASSERT_OK(vp_vbar_free_memory(a, 0, &freed));
  ASSERT_EQ_U64(freed, 0);
  ASSERT_OK(vp_device_free_memory(dev, 0, &freed));
  ASSERT_EQ_U64(freed, 0);
  ASSERT_EQ_U64(test_info(dev).committed, 8 * ps);
  /* Whole pages, at least what was asked. */
  ASSERT_OK(vp_vbar_free_memory(b, ps + 1, &freed));
  ASSERT_EQ_U64(freed, 2 * ps);
  ASSERT_OK(vp_vbar_loaded_size(b, &loaded));
  ASSERT_EQ_U64(loaded, 2 * ps);
  ASSERT_OK(vp_vbar_free_memory(b, 1, &freed));
  ASSERT_EQ_U64(freed, ps);
  /* More than there is: all of it, and no error. */
  ASSERT_OK(vp_vbar_free_memory(b, 100 * ps, &freed));
  ASSERT_EQ_U64(freed, ps);
  ASSERT_OK(vp_vbar_free_memory(b, 100 * ps, &freed));
  ASSERT_EQ_U64(freed, 0);
  ASSERT_OK(vp_device_free_memory(dev, 3 * ps - 1, &freed));
  ASSERT_EQ_U64(freed, 3 * ps);
  ASSERT_EQ_STR(test_map(a), "#...");
  ASSERT_OK(vp_device_free_memory(dev, UINT64_MAX, &freed));
  ASSERT_EQ_U64(freed, ps);
  ASSERT_EQ_U64(test_info(dev).committed, 0);
  vp_stats_t s = test_dev_stats(dev);
  ASSERT_EQ_U64(s.pages_evicted, 8);
  ASSERT_OK(vp_device_close(dev));
}

TEST(evict_lowest_priority_first, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  /* Created in order: c is on top, a at the bottom. */
  vp_vbar_t a = test_vbar(dev, 3 * ps), b = test_vbar(dev, 3 * ps),
            c = test_vbar(dev, 3 * ps);
  test_load_pages(c, 0, 3);
  test_load_pages(a, 0, 3);
  test_load_pages(b, 0, 3);
  uint64_t freed = 0;
  ASSERT_OK(vp_device_free_memory(dev, ps, &freed));
  ASSERT_EQ_STR(test_map(a), "##.");
  ASSERT_EQ_STR(test_map(b), "###");
  ASSERT_OK(vp_device_free_memory(dev, 3 * ps, &freed));
  ASSERT_EQ_U64(freed, 3 * ps);
  ASSERT_EQ_STR(test_map(a), "...");
  ASSERT_EQ_STR(test_map(b), "##.");
  ASSERT_EQ_STR(test_map(c), "###");
  ASSERT_OK(vp_device_free_memory(dev, 3 * ps, &freed));
  ASSERT_EQ_STR(test_map(b), "...");
  ASSERT_EQ_STR(test_map(c), "##.");
  ASSERT_OK(vp_device_close(dev));
}

TEST(evict_fault_needs_memory, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open_cap(ctx, NULL, 8);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t low = test_vbar(dev, 4 * ps);
  vp_vbar_t high = test_vbar(dev, 8 * ps); /* on top */
  test_load_pages(low, 0, 4);
  test_load_pages(high, 0, 4);
  ASSERT_EQ_U64(test_info(dev).committed, 8 * ps);
  /* The top VBAR's faults take the low one's pages, tail first. */
  test_load_pages(high, 4, 1);
  ASSERT_EQ_STR(test_map(low), "###.");
  test_load_pages(high, 5, 3);
  ASSERT_EQ_STR(test_map(low), "....");
  ASSERT_EQ_STR(test_map(high), "########");
  ASSERT_EQ_U64(test_info(dev).committed, 8 * ps);

  /* A fault of the low VBAR never takes the high one's pages. */
  vp_vbar_t low2 = test_vbar(dev, 4 * ps);
  ASSERT_OK(vp_vbar_deprioritize(low2));
  vp_stats_t before = test_dev_stats(dev);
  ASSERT_RC(test_fault_page(low2, 0, NULL), VP_MISS);
  vp_stats_t after = test_dev_stats(dev);
  ASSERT_EQ_U64(after.pages_evicted, before.pages_evicted);
  ASSERT_EQ_U64(after.misses, before.misses + 1);
  ASSERT_EQ_U64(after.budget_misses, before.budget_misses + 1);
  ASSERT_EQ_STR(test_map(high), "########");
  ASSERT_EQ_STR(test_map(low2), "....");
  /* Once the high one is lowest, it gives way. */
  ASSERT_OK(vp_vbar_deprioritize(high));
  ASSERT_OK(test_fault_page(low2, 0, NULL));
  ASSERT_EQ_STR(test_map(high), "#######.");
  ASSERT_OK(vp_unpin(low2, 0, ps, 0));
  ASSERT_OK(vp_device_close(dev));
}

TEST(evict_own_pages_above, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open_cap(ctx, NULL, 8);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 10 * ps);
  /* Pages 2-9 fill the device. */
  test_load_pages(v, 2, 8);
  ASSERT_EQ_STR(test_map(v), "..########");
  /* Page 0 (rank 0) may take the VBAR's own page 9 (rank 9). */
  ASSERT_OK(test_fault_page(v, 0, NULL));
  ASSERT_EQ_STR(test_map(v), "P.#######.");
  ASSERT_EQ_U64(test_watermark(v), 9);
  ASSERT_OK(test_fault_page(v, 1, NULL));
  ASSERT_EQ_STR(test_map(v), "PP######..");
  ASSERT_EQ_U64(test_watermark(v), 8);
  /* Page 9 is now at the watermark: a miss at once. */
  vp_stats_t before = test_vbar_stats(v);
  ASSERT_RC(test_fault_page(v, 9, NULL), VP_MISS);
  vp_stats_t after = test_vbar_stats(v);
  ASSERT_EQ_U64(after.watermark_misses, before.watermark_misses + 1);
  ASSERT_EQ_U64(after.pages_evicted, before.pages_evicted);
  /* Pinned pages are not taken: with 0-7 pinned, page 8 misses. */
  ASSERT_OK(vp_vbar_prioritize(v));
  ASSERT_EQ_U64(test_watermark(v), 10);
  ASSERT_OK(vp_fault(v, 2 * ps, 6 * ps, NULL, 0));
  ASSERT_RC(test_fault_page(v, 8, NULL), VP_MISS);
  ASSERT_EQ_STR(test_map(v), "PPPPPPPP..");
  /* Unpinned, pages 0-7 rank below page 8: still a miss, nothing taken. */
  ASSERT_OK(vp_unpin(v, 0, 8 * ps, 0));
  before = test_vbar_stats(v);
  ASSERT_RC(test_fault_page(v, 8, NULL), VP_MISS);
  after = test_vbar_stats(v);
  ASSERT_EQ_U64(after.pages_evicted, before.pages_evicted);
  ASSERT_EQ_U64(after.budget_misses, before.budget_misses + 1);
  ASSERT_EQ_STR(test_map(v), "########..");
  ASSERT_OK(vp_device_close(dev));
}

/* A fault that cannot get enough memory evicts nothing: a miss must not
 * cost a lower-priority VBAR its pages (or its watermark). */
TEST(evict_nothing_for_a_miss, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open_cap(ctx, NULL, 4);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t low = test_vbar(dev, 4 * ps);
  vp_vbar_t top = test_vbar(dev, 8 * ps);
  test_load_pages(low, 0, 2);
  ASSERT_OK(vp_fault(top, 0, 2 * ps, NULL, 0)); /* pinned */
  vp_stats_t before = test_dev_stats(dev);
  ASSERT_RC(vp_fault(top, 2 * ps, 3 * ps, NULL, 0), VP_MISS);
  vp_stats_t after = test_dev_stats(dev);
  ASSERT_EQ_U64(after.pages_evicted, before.pages_evicted);
  ASSERT_EQ_STR(test_map(low), "##..");
  ASSERT_EQ_U64(test_watermark(low), 4);
  /* Two more pages do fit once the low VBAR gives its two. */
  ASSERT_OK(vp_fault(top, 2 * ps, 2 * ps, NULL, 0));
  ASSERT_EQ_STR(test_map(low), "....");
  ASSERT_OK(vp_unpin(top, 0, 4 * ps, 0));
  ASSERT_OK(vp_device_close(dev));
}
