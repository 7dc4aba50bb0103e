/* Holds per stream: a release ends a hold taken on its own stream, never
 * more holds than the weight has, and only streams vp_stream_create made
 * can be destroyed. The sequences are the ones a fuzzer found (issue 11). */
#include "test.h"

/* One weight of one page in its own VBAR, its source in *buf. */
typedef struct one {
  vp_vbar_t v;
  vp_weight_t w;
  unsigned char *buf;
} one_t;

static vp_device_t open_small(test_ctx_t *ctx) {
  vp_options_t o;
  test_options(ctx, &o);
  o.staging_size = 4 * o.page_size;
  o.lookahead = 0;
  return test_open(ctx, &o);
}

static void one_init(one_t *m, vp_device_t dev, uint64_t page) {
  m->v = test_vbar(dev, 4 * page);
  m->buf = malloc(page);
  ASSERT_NOT_NULL(m->buf);
  test_pattern(m->buf, page, 7);
  uint64_t off = 0, size = page;
  vp_source_t src = {.kind = VP_SOURCE_HOST, .host = m->buf};
  ASSERT_OK(vp_weights_create(m->v, 1, &off, &size, &src, &m->w));
}

static void one_free(one_t *m) {
  ASSERT_OK(vp_weight_destroy(m->w));
  ASSERT_OK(vp_vbar_destroy(m->v));
  free(m->buf);
}

TEST(release_ends_own_stream_hold, TEST_ALL_BACKENDS) {
  vp_device_t dev = open_small(ctx);
  uint64_t page = test_page_size(ctx);
  one_t m;
  one_init(&m, dev, page);
  vp_stream_t s1, s2, s3;
  ASSERT_OK(vp_stream_create(dev, &s1));
  ASSERT_OK(vp_stream_create(dev, &s2));
  ASSERT_OK(vp_stream_create(dev, &s3));
  uint64_t ptr;
  uint8_t fl;
  ASSERT_OK(vp_vbar_set_watermark(m.v, 0)); /* every miss is staged */
  ASSERT_OK(vp_acquire(dev, &m.w, 1, s1, &ptr, &fl));
  ASSERT_TRUE(fl & VP_ACQUIRED_STAGED);
  ASSERT_OK(vp_acquire(dev, &m.w, 1, s2, &ptr, &fl));
  ASSERT_TRUE(fl & VP_ACQUIRED_STAGED);
  ASSERT_OK(vp_vbar_prioritize(m.v));
  ASSERT_OK(vp_acquire(dev, &m.w, 1, s3, &ptr, &fl));
  ASSERT_TRUE(fl & VP_ACQUIRED_RESIDENT);
  ASSERT_OK(vp_release(dev, &m.w, 1, s1)); /* ends s1's staged hold only */
  ASSERT_TRUE(test_resid(m.v, 0) & VP_PAGE_PINNED);
  uint64_t freed = 1;
  ASSERT_OK(vp_vbar_free_memory(m.v, 4 * page, &freed));
  ASSERT_EQ_U64(freed, 0); /* s3 still reads it in place */
  ASSERT_TRUE(test_check_pattern(dev, ptr, page, 7));
  ASSERT_RC(vp_release(dev, &m.w, 1, s1), VP_ENOTPINNED);
  ASSERT_STR_CONTAINS(vp_last_error(), "vp_release");
  ASSERT_RC(vp_release(dev, &m.w, 1, 0), VP_ENOTPINNED); /* never held */
  ASSERT_OK(vp_release(dev, &m.w, 1, s3));
  ASSERT_FALSE(test_resid(m.v, 0) & VP_PAGE_PINNED);
  ASSERT_RC(vp_weight_destroy(m.w), VP_EBUSY); /* s2 holds it */
  ASSERT_OK(vp_release(dev, &m.w, 1, s2));
  ASSERT_RC(vp_release(dev, &m.w, 1, s2), VP_ENOTPINNED);
  ASSERT_OK(vp_stream_synchronize(dev, s1));
  ASSERT_OK(vp_stream_synchronize(dev, s2));
  ASSERT_OK(vp_stream_synchronize(dev, s3));
  one_free(&m);
  ASSERT_OK(vp_stream_destroy(dev, s1));
  ASSERT_OK(vp_stream_destroy(dev, s2));
  ASSERT_OK(vp_stream_destroy(dev, s3));
  ASSERT_OK(vp_device_close(dev));
}

/* One call listing a weight more times than it is held changes nothing. */
static void repeats_case(test_ctx_t *ctx, bool staged) {
  vp_device_t dev = open_small(ctx);
  uint64_t page = test_page_size(ctx);
  one_t m;
  one_init(&m, dev, page);
  if (staged) ASSERT_OK(vp_vbar_set_watermark(m.v, 0));
  uint64_t ptr[3];
  uint8_t fl[3];
  vp_weight_t three[3] = {m.w, m.w, m.w};
  ASSERT_OK(vp_acquire(dev, &m.w, 1, 0, ptr, fl));
  ASSERT_TRUE(fl[0] & (staged ? VP_ACQUIRED_STAGED : VP_ACQUIRED_RESIDENT));
  ASSERT_RC(vp_release(dev, three, 3, 0), VP_ENOTPINNED);
  ASSERT_STR_CONTAINS(vp_last_error(), "(2 listed, 1 held)");
  ASSERT_RC(vp_release(dev, three, 2, 0), VP_ENOTPINNED);
  ASSERT_OK(vp_release(dev, three, 1, 0)); /* the one hold is still there */
  ASSERT_RC(vp_release(dev, &m.w, 1, 0), VP_ENOTPINNED);
  ASSERT_FALSE(test_resid(m.v, 0) & VP_PAGE_PINNED);
  /* Held twice by one call: two listings release both. */
  ASSERT_OK(vp_acquire(dev, three, 2, 0, ptr, fl));
  ASSERT_RC(vp_release(dev, three, 3, 0), VP_ENOTPINNED);
  ASSERT_OK(vp_release(dev, three, 2, 0));
  ASSERT_OK(vp_stream_synchronize(dev, 0));
  one_free(&m); /* not busy: no hold leaked */
  ASSERT_OK(vp_device_close(dev));
}

TEST(release_repeats_beyond_holds, TEST_ALL_BACKENDS) {
  repeats_case(ctx, false);
  repeats_case(ctx, true);
}

TEST(stream_destroy_only_created, TEST_ALL_BACKENDS) {
  vp_device_t dev = open_small(ctx);
  vp_stream_t s1;
  ASSERT_OK(vp_stream_create(dev, &s1));
  ASSERT_RC(vp_stream_destroy(dev, s1 - 1), VP_EINVAL);
  ASSERT_STR_CONTAINS(vp_last_error(), "vp_stream_destroy");
  ASSERT_RC(vp_stream_destroy(dev, s1 + 1), VP_EINVAL);
  ASSERT_RC(vp_stream_destroy(dev, 0), VP_EINVAL);
  ASSERT_OK(vp_stream_synchronize(dev, 0)); /* the default stream lives */
  ASSERT_OK(vp_stream_destroy(dev, s1));
  ASSERT_RC(vp_stream_destroy(dev, s1), VP_EINVAL);
  /* The copy stream is made by the library: never the caller's to destroy,
   * and no value near a user stream reaches it. */
  one_t m;
  uint64_t page = test_page_size(ctx);
  one_init(&m, dev, page);
  vp_stream_t s2;
  ASSERT_OK(vp_stream_create(dev, &s2));
  uint64_t ptr;
  ASSERT_OK(vp_acquire(dev, &m.w, 1, s2, &ptr, NULL));
  ASSERT_OK(vp_release(dev, &m.w, 1, s2));
  for (int d = -3; d <= 3; d++)
    if (d) ASSERT_RC(vp_stream_destroy(dev, s2 + (vp_stream_t)d), VP_EINVAL);
  ASSERT_OK(vp_stream_synchronize(dev, 0));
  ASSERT_OK(vp_acquire(dev, &m.w, 1, 0, &ptr, NULL)); /* copy stream works */
  ASSERT_OK(vp_release(dev, &m.w, 1, 0));
  ASSERT_OK(vp_stream_synchronize(dev, 0));
  ASSERT_OK(vp_stream_destroy(dev, s2));
  one_free(&m);
  ASSERT_OK(vp_device_close(dev));
}

/* vp_unpin drops only pins that vp_fault took: over a page that only an
 * acquired weight holds it fails, and the release still works (found by the
 * api fuzzer: the raw unpin took the acquire's pin, the release then
 * wrapped the page's pin count). A fault's own pin beside the acquire's can
 * still be dropped. */
TEST(unpin_leaves_acquire_pins, TEST_ALL_BACKENDS) {
  vp_device_t dev = open_small(ctx);
  uint64_t page = test_page_size(ctx);
  one_t m;
  one_init(&m, dev, page);
  uint64_t ptr;
  uint8_t fl;
  ASSERT_OK(vp_acquire(dev, &m.w, 1, 0, &ptr, &fl));
  ASSERT_TRUE(fl & VP_ACQUIRED_RESIDENT);
  ASSERT_RC(vp_unpin(m.v, 256, 897, 0), VP_ENOTPINNED);
  ASSERT_STR_CONTAINS(vp_last_error(), "vp_unpin");
  ASSERT_STR_CONTAINS(vp_last_error(), "acquired weights");
  ASSERT_OK(vp_fault(m.v, 0, page, NULL, 0));
  ASSERT_OK(vp_unpin(m.v, 0, page, 0)); /* the fault's pin */
  ASSERT_RC(vp_unpin(m.v, 0, page, 0), VP_ENOTPINNED);
  ASSERT_TRUE(test_resid(m.v, 0) & VP_PAGE_PINNED);
  ASSERT_OK(vp_release(dev, &m.w, 1, 0));
  ASSERT_FALSE(test_resid(m.v, 0) & VP_PAGE_PINNED);
  ASSERT_RC(vp_unpin(m.v, 0, page, 0), VP_ENOTPINNED);
  ASSERT_OK(vp_stream_synchronize(dev, 0));
  one_free(&m);
  ASSERT_OK(vp_device_close(dev));
}
