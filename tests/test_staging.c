/* The staging ring: slot reuse after release fences, a full ring. */
#include <sched.h>
#include <stdatomic.h>

#include "stream_fixture.h"

/* ----------------------------------------------------- ring reuse fences */

/* Weights of exactly one page each; the ring holds two. Every weight is a
 * miss (watermark 0). */
static vp_device_t ring_setup(test_ctx_t *ctx, model_t *m, size_t n) {
  vp_options_t o;
  sopts(ctx, &o, 2, 0, VP_SIM_WORKER);
  vp_device_t dev = test_open_cap(ctx, &o, 16);
  model_uniform(m, dev, n * o.page_size, n, o.page_size, SRC_SCATTER, 7);
  ASSERT_OK(vp_vbar_set_watermark(m->v, 0));
  return dev;
}

/* units_setup's model on a device already open. */
static void units_setup_on(vp_device_t dev, model_t *m,
                           const uint64_t *units, size_t n, uint64_t key,
                           uint64_t *u) {
  vp_device_info_t info;
  ASSERT_OK(vp_device_info(dev, &info));
  uint64_t ps = info.page_size, off[16], size[16];
  ASSERT_TRUE(n <= 16);
  *u = ps / 4;
  for (size_t i = 0; i < n; i++) {
    off[i] = i * ps;
    size[i] = units[i] * *u;
  }
  model_init(m, dev, n * ps, n, off, size, SRC_SCATTER, key);
  ASSERT_OK(vp_vbar_set_watermark(m->v, 0));
}

/* ring_setup's device (a ring of 2 pages), its model's weights a page
 * apart, weight i of units[i] quarter pages: *u gets the quarter page. */
static vp_device_t units_setup(test_ctx_t *ctx, model_t *m,
                               const uint64_t *units, size_t n, uint64_t key,
                               uint64_t *u) {
  vp_options_t o;
  sopts(ctx, &o, 2, 0, VP_SIM_WORKER);
  vp_device_t dev = test_open_cap(ctx, &o, 16);
  units_setup_on(dev, m, units, n, key, u);
  return dev;
}

TEST(stream_ring_reuse_after_fence, TEST_SIM_ONLY) {
  model_t m;
  vp_device_t dev = ring_setup(ctx, &m, 4);
  uint64_t ps = m.size[0];
  vp_stream_t a = 0, b = 0;
  ASSERT_OK(vp_stream_create(dev, &a));
  ASSERT_OK(vp_stream_create(dev, &b));
  checks_t c = {0};
  uint64_t p0 = 0, p1 = 0, p2 = 0;
  uint8_t f = 0;
  ASSERT_OK(vp_acquire(dev, &m.w[0], 1, a, &p0, &f));
  ASSERT_EQ_INT(f, VP_ACQUIRED_STAGED | VP_ACQUIRED_COPIED);
  slow_t k = {.ptr = p0, .size = ps, .ms = 100, .expect = m.srcs[0].host};
  ASSERT_OK(vp_sim_launch(dev, a, slow_fn, &k));
  ASSERT_OK(vp_release(dev, &m.w[0], 1, a));

  ASSERT_OK(vp_acquire(dev, &m.w[1], 1, b, &p1, &f));
  ASSERT_EQ_INT(f, VP_ACQUIRED_STAGED | VP_ACQUIRED_COPIED);
  ASSERT_NE_U64(p1, p0);
  launch_check(dev, b, p1, m.srcs[1].host, ps, &c);
  ASSERT_OK(vp_release(dev, &m.w[1], 1, b));

  /* The ring is full: w2 takes w0's slot (the least recently used), whose
   * reader is still asleep on stream a. The copy must wait for it; the CPU
   * must not. */
  uint64_t t0 = test_now_ms();
  ASSERT_OK(vp_acquire(dev, &m.w[2], 1, b, &p2, &f));
  uint64_t took = test_now_ms() - t0;
  ASSERT_EQ_INT(f, VP_ACQUIRED_STAGED | VP_ACQUIRED_COPIED);
  ASSERT_EQ_U64(p2, p0);
  ASSERT_FALSE(slow_done(&k)); /* vp_acquire did not block */
  test_log("acquire with a ring wait took %" PRIu64 " ms", took);
  launch_check(dev, b, p2, m.srcs[2].host, ps, &c);
  ASSERT_OK(vp_release(dev, &m.w[2], 1, b));

  checks_expect_clean(dev, b, &c);
  ASSERT_OK(vp_stream_synchronize(dev, a));
  ASSERT_TRUE(slow_done(&k));
  ASSERT_TRUE(slow_ok(&k)); /* w0's slot was not overwritten early */
  vp_stats_t st = dstats(dev);
  ASSERT_GE_U64(st.ring_waits, 1);
  ASSERT_EQ_U64(st.weight_staged, 3);

  /* A released slot whose fence completed is reused without a wait. */
  uint64_t waits = st.ring_waits, p3 = 0;
  ASSERT_OK(vp_acquire(dev, &m.w[3], 1, b, &p3, &f));
  ASSERT_TRUE(p3 == p1 || p3 == p2);
  ASSERT_EQ_U64(dstats(dev).ring_waits, waits);
  launch_check(dev, b, p3, m.srcs[3].host, ps, &c);
  ASSERT_OK(vp_release(dev, &m.w[3], 1, b));
  checks_expect_clean(dev, b, &c);
  ASSERT_OK(vp_stream_destroy(dev, a));
  ASSERT_OK(vp_stream_destroy(dev, b));
  ASSERT_OK(vp_device_close(dev));
  model_free(&m);
}

/* One staged weight acquired on two streams and released on both: its slot
 * is reused only after both streams' work read it. */
TEST(stream_ring_reuse_two_streams, TEST_SIM_ONLY) {
  model_t m;
  vp_device_t dev = ring_setup(ctx, &m, 4);
  uint64_t ps = m.size[0];
  vp_stream_t a = 0, b = 0;
  ASSERT_OK(vp_stream_create(dev, &a));
  ASSERT_OK(vp_stream_create(dev, &b));
  uint64_t pa = 0, pb = 0, p = 0;
  uint8_t f = 0;
  ASSERT_OK(vp_acquire(dev, &m.w[0], 1, a, &pa, &f));
  ASSERT_OK(vp_acquire(dev, &m.w[0], 1, b, &pb, &f));
  ASSERT_EQ_U64(pa, pb); /* the cached slot */
  slow_t k = {.ptr = pa, .size = ps, .ms = 150, .expect = m.srcs[0].host};
  ASSERT_OK(vp_sim_launch(dev, a, slow_fn, &k));
  ASSERT_OK(vp_release(dev, &m.w[0], 1, a)); /* reader still asleep on a */
  ASSERT_OK(vp_release(dev, &m.w[0], 1, b)); /* b: nothing queued */
  /* Fill the ring past w0's slot. */
  ASSERT_OK(vp_acquire(dev, &m.w[1], 1, b, &p, &f));
  ASSERT_OK(vp_release(dev, &m.w[1], 1, b));
  ASSERT_OK(vp_acquire(dev, &m.w[2], 1, b, &p, &f));
  ASSERT_EQ_U64(p, pa);
  ASSERT_OK(vp_release(dev, &m.w[2], 1, b));
  ASSERT_OK(vp_stream_synchronize(dev, a));
  ASSERT_OK(vp_stream_synchronize(dev, b));
  ASSERT_TRUE(slow_done(&k));
  ASSERT_TRUE(slow_ok(&k)); /* the reader saw its bytes */
  ASSERT_OK(vp_stream_destroy(dev, a));
  ASSERT_OK(vp_stream_destroy(dev, b));
  ASSERT_OK(vp_device_close(dev));
  model_free(&m);
}

/* A weight acquired staged on stream a (a slow reader queued there), then
 * resident on stream b, and released on b first: the release on b ends
 * b's use (the resident one); the staged slot a still reads must not be
 * reused before a's work is done. */
TEST(stream_release_mixed_kinds_two_streams, TEST_SIM_ONLY) {
  vp_options_t o;
  sopts(ctx, &o, 2, 0, VP_SIM_WORKER);
  vp_device_t dev = test_open_cap(ctx, &o, 16);
  uint64_t ps = o.page_size;
  model_t wa, xb;
  model_uniform(&wa, dev, ps, 1, ps, SRC_SCATTER, 15);
  model_uniform(&xb, dev, 2 * ps, 2, ps, SRC_SCATTER, 16);
  ASSERT_OK(vp_vbar_set_watermark(wa.v, 0));
  ASSERT_OK(vp_vbar_set_watermark(xb.v, 0));
  vp_stream_t a = 0, b = 0;
  ASSERT_OK(vp_stream_create(dev, &a));
  ASSERT_OK(vp_stream_create(dev, &b));
  uint64_t pa = 0, pb = 0, p = 0;
  uint8_t f = 0;
  ASSERT_OK(vp_acquire(dev, wa.w, 1, a, &pa, &f));
  ASSERT_EQ_INT(f, VP_ACQUIRED_STAGED | VP_ACQUIRED_COPIED);
  slow_t k = {.ptr = pa, .size = ps, .ms = 150, .expect = wa.srcs[0].host};
  ASSERT_OK(vp_sim_launch(dev, a, slow_fn, &k));
  ASSERT_OK(vp_vbar_prioritize(wa.v));
  ASSERT_OK(vp_acquire(dev, wa.w, 1, b, &pb, &f));
  ASSERT_EQ_INT(f, VP_ACQUIRED_RESIDENT | VP_ACQUIRED_COPIED);
  checks_t c = {0};
  launch_check(dev, b, pb, wa.srcs[0].host, ps, &c);
  ASSERT_OK(vp_release(dev, wa.w, 1, b));
  /* Two more misses, one at a time, through the two-page ring. */
  for (int i = 0; i < 2; i++) {
    ASSERT_OK(vp_acquire(dev, &xb.w[i], 1, b, &p, &f));
    launch_check(dev, b, p, xb.srcs[i].host, ps, &c);
    ASSERT_OK(vp_release(dev, &xb.w[i], 1, b));
  }
  ASSERT_OK(vp_release(dev, wa.w, 1, a));
  checks_expect_clean(dev, b, &c);
  ASSERT_OK(vp_stream_synchronize(dev, a));
  ASSERT_TRUE(slow_done(&k));
  ASSERT_TRUE(slow_ok(&k)); /* the reader saw its bytes */
  ASSERT_FALSE(map_has_pin(wa.v));
  ASSERT_OK(vp_device_close(dev));
  model_free(&wa);
  model_free(&xb);
}

/* A source-NONE weight staged into a reused slot is filled by the caller on
 * its stream: that stream must not write the slot before the old reader
 * (on another stream) is done. */
TEST(stream_ring_reuse_empty_fill, TEST_SIM_ONLY) {
  vp_options_t o;
  sopts(ctx, &o, 2, 0, VP_SIM_WORKER);
  vp_device_t dev = test_open_cap(ctx, &o, 16);
  uint64_t ps = o.page_size;
  model_t m;
  model_uniform(&m, dev, 2 * ps, 2, ps, SRC_SCATTER, 9);
  vp_vbar_t vn = test_vbar(dev, ps);
  vp_weight_t wn;
  uint64_t zero = 0;
  ASSERT_OK(vp_weights_create(vn, 1, &zero, &ps, NULL, &wn));
  ASSERT_OK(vp_vbar_set_watermark(m.v, 0));
  ASSERT_OK(vp_vbar_set_watermark(vn, 0));
  vp_stream_t a = 0, b = 0;
  ASSERT_OK(vp_stream_create(dev, &a));
  ASSERT_OK(vp_stream_create(dev, &b));
  uint64_t p0 = 0, p1 = 0, pn = 0;
  uint8_t f = 0;
  ASSERT_OK(vp_acquire(dev, &m.w[0], 1, a, &p0, &f));
  slow_t k = {.ptr = p0, .size = ps, .ms = 150, .expect = m.srcs[0].host};
  ASSERT_OK(vp_sim_launch(dev, a, slow_fn, &k));
  ASSERT_OK(vp_release(dev, &m.w[0], 1, a));
  ASSERT_OK(vp_acquire(dev, &m.w[1], 1, b, &p1, &f));
  ASSERT_OK(vp_release(dev, &m.w[1], 1, b));
  ASSERT_OK(vp_acquire(dev, &wn, 1, b, &pn, &f));
  ASSERT_EQ_INT(f, VP_ACQUIRED_STAGED | VP_ACQUIRED_EMPTY);
  ASSERT_EQ_U64(pn, p0);
  unsigned char *junk = malloc(ps);
  ASSERT_NOT_NULL(junk);
  test_pattern(junk, ps, 4242);
  fill_t fl = {pn, ps, junk};
  ASSERT_OK(vp_sim_launch(dev, b, fill_fn, &fl));
  ASSERT_OK(vp_release(dev, &wn, 1, b));
  ASSERT_OK(vp_stream_synchronize(dev, a));
  ASSERT_OK(vp_stream_synchronize(dev, b));
  ASSERT_TRUE(slow_ok(&k)); /* the reader saw its bytes */
  ASSERT_OK(vp_device_close(dev));
  free(junk);
  model_free(&m);
}

/* ------------------------------------------------------------- ring full */

TEST(stream_ring_full, TEST_ALL_BACKENDS) {
  vp_options_t o;
  sopts(ctx, &o, 2, 0, VP_SIM_SYNC);
  vp_device_t dev = test_open_cap(ctx, &o, 16);
  uint64_t ps = o.page_size;
  model_t m;
  model_uniform(&m, dev, 8 * ps, 8, ps, SRC_SCATTER, 3);
  ASSERT_OK(vp_vbar_set_watermark(m.v, 0));
  uint64_t ptrs[8] = {0};
  uint8_t fl[8] = {0};

  /* Three pages of misses in one call, a ring of two. */
  ASSERT_RC(vp_acquire(dev, m.w, 3, 0, ptrs, fl), VP_ELIMIT);
  ASSERT_STR_CONTAINS(vp_last_error(), "staging_size");
  ASSERT_FALSE(map_has_pin(m.v));
  /* Nothing stayed acquired: two fit now, and can be released once. */
  ASSERT_OK(vp_acquire(dev, m.w, 2, 0, ptrs, fl));
  ASSERT_EQ_INT(fl[0] & VP_ACQUIRED_STAGED, VP_ACQUIRED_STAGED);
  ASSERT_EQ_INT(fl[1] & VP_ACQUIRED_STAGED, VP_ACQUIRED_STAGED);
  if (is_sim(ctx)) {
    verify_staged_sim(dev, 0, ptrs[0], m.srcs[0].host, ps);
    verify_staged_sim(dev, 0, ptrs[1], m.srcs[1].host, ps);
  }
  /* Held: a third does not fit beside them. */
  ASSERT_RC(vp_acquire(dev, &m.w[2], 1, 0, ptrs + 2, fl + 2), VP_ELIMIT);
  ASSERT_STR_CONTAINS(vp_last_error(), "staging_size");
  ASSERT_RC(vp_weight_destroy(m.w[2]), VP_OK); /* it was not left acquired */
  ASSERT_RC(vp_acquire(dev, &m.w[2], 1, 0, ptrs + 2, fl + 2), VP_EHANDLE);
  ASSERT_OK(vp_release(dev, m.w, 2, 0));
  ASSERT_RC(vp_release(dev, m.w, 1, 0), VP_ENOTPINNED);
  ASSERT_OK(vp_acquire(dev, &m.w[3], 1, 0, ptrs + 3, fl + 3));
  if (is_sim(ctx)) verify_staged_sim(dev, 0, ptrs[3], m.srcs[3].host, ps);
  ASSERT_OK(vp_release(dev, &m.w[3], 1, 0));

  /* A weight larger than the whole ring never fits. */
  vp_vbar_t big = test_vbar(dev, 4 * ps);
  vp_weight_t wb;
  uint64_t zero = 0, bsz = 3 * ps;
  unsigned char *bsrc = calloc(1, bsz);
  ASSERT_NOT_NULL(bsrc);
  vp_source_t bs = {.kind = VP_SOURCE_HOST, .host = bsrc};
  ASSERT_OK(vp_weights_create(big, 1, &zero, &bsz, &bs, &wb));
  ASSERT_OK(vp_vbar_set_watermark(big, 0));
  uint64_t bp = 0;
  ASSERT_RC(vp_acquire(dev, &wb, 1, 0, &bp, NULL), VP_ELIMIT);
  ASSERT_STR_CONTAINS(vp_last_error(), "staging_size");
  /* Resident weights in the same failed call are let go as well. */
  ASSERT_OK(vp_vbar_prioritize(m.v));
  vp_weight_t mix[2] = {m.w[4], wb};
  ASSERT_RC(vp_acquire(dev, mix, 2, 0, ptrs, fl), VP_ELIMIT);
  ASSERT_FALSE(map_has_pin(m.v));
  ASSERT_OK(vp_weight_destroy(m.w[4]));
  ASSERT_OK(vp_vbar_destroy(big));
  ASSERT_OK(vp_vbar_destroy(m.v));
  ASSERT_OK(vp_device_close(dev));
  free(bsrc);
  model_free(&m);
}

/* Slots of three quarter pages in a ring of two pages: the third does not
 * fit before the end. A ring that wraps (its pages mapped twice) puts it
 * right after the second, running on into the start over the first one's
 * (reclaimed) room, and its bytes read back whole across the seam; one
 * that does not (staging_wrap 0, or a backend that cannot map a page
 * twice) starts it at 0. */
TEST(stream_ring_wraps, TEST_ALL_BACKENDS) {
  for (int wrap = 1; wrap >= 0; wrap--) {
    vp_options_t o;
    sopts(ctx, &o, 2, 0, VP_SIM_SYNC);
    o.staging_wrap = wrap;
    vp_device_t dev = test_open_cap(ctx, &o, 16);
    const uint64_t units[5] = {3, 3, 3, 3, 3};
    uint64_t q = 0, p[5] = {0};
    model_t m;
    units_setup_on(dev, &m, units, 5, 21 + wrap, &q);
    vp_device_info_t info;
    ASSERT_OK(vp_device_info(dev, &info));
    bool wraps = info.staging_wraps;
#ifndef _WIN32 /* the simulated device maps a page twice on Linux only */
    if (wrap && is_sim(ctx)) ASSERT_TRUE(wraps);
#endif
    if (!wrap) ASSERT_FALSE(wraps);
    for (int i = 0; i < 5; i++) {
      uint8_t f = 0;
      ASSERT_OK(vp_acquire(dev, &m.w[i], 1, 0, &p[i], &f));
      ASSERT_EQ_INT(f, VP_ACQUIRED_STAGED | VP_ACQUIRED_COPIED);
      /* Read back through the device (vp_copy_to_host: a held slot). */
      verify_resident(dev, 0, p[i], m.srcs[i].host, 3 * q);
      ASSERT_OK(vp_release(dev, &m.w[i], 1, 0));
    }
    ASSERT_EQ_U64(p[1], p[0] + 3 * q);
    if (wraps) {
      ASSERT_EQ_U64(p[2], p[0] + 6 * q); /* runs 1q past the end */
      ASSERT_EQ_U64(p[3], p[0] + q);     /* from where it ended */
      ASSERT_EQ_U64(p[4], p[0] + 4 * q);
    } else {
      ASSERT_EQ_U64(p[2], p[0]);
      ASSERT_EQ_U64(p[3], p[0] + 3 * q);
      ASSERT_EQ_U64(p[4], p[0]);
    }
    ASSERT_OK(vp_device_info(dev, &info));
    ASSERT_EQ_INT(info.staging_wraps, wraps);
    ASSERT_OK(vp_device_close(dev));
    model_free(&m);
  }
}

/* A driver that maps a page twice but not as one memory (the simulated
 * device told to, VP_SIM_MAP_APART): the ring reads its probe back
 * through the second view, finds other bytes, and opens as one that does
 * not wrap; slots and bytes are first fit's. */
TEST(stream_ring_second_view_checked, TEST_SIM_ONLY) {
  vp_options_t o;
  sopts(ctx, &o, 2, 0, VP_SIM_SYNC);
  vp_device_t dev = test_open_cap(ctx, &o, 16);
  ASSERT_OK(vp_sim_inject(dev, VP_SIM_MAP_APART, 1));
  const uint64_t units[3] = {3, 3, 3};
  uint64_t q = 0, p[3] = {0};
  model_t m;
  units_setup_on(dev, &m, units, 3, 41, &q);
  for (int i = 0; i < 3; i++) {
    uint8_t f = 0;
    ASSERT_OK(vp_acquire(dev, &m.w[i], 1, 0, &p[i], &f));
    verify_resident(dev, 0, p[i], m.srcs[i].host, 3 * q);
    ASSERT_OK(vp_release(dev, &m.w[i], 1, 0));
  }
  ASSERT_EQ_U64(p[2], p[0]); /* at 0, not past the end */
  vp_device_info_t info;
  ASSERT_OK(vp_device_info(dev, &info));
  ASSERT_FALSE(info.staging_wraps);
  /* A ring opened again (another size) does not try again. */
  ASSERT_OK(vp_device_set_staging_size(dev, 3 * info.page_size));
  ASSERT_OK(vp_acquire(dev, &m.w[0], 1, 0, &p[0], NULL));
  ASSERT_OK(vp_release(dev, &m.w[0], 1, 0));
  ASSERT_OK(vp_device_info(dev, &info));
  ASSERT_FALSE(info.staging_wraps);
  ASSERT_OK(vp_device_close(dev));
  model_free(&m);
}

/* Streamed in order through a ring that holds no whole number of them:
 * in a ring that wraps, a prefetch batch runs on across the seam in one
 * copy (adjacent sources, and the ring's second view continues the slot
 * that ran past its end), so it never takes more copies than a ring whose
 * slots start again at 0, and every pass takes the same. */
TEST(stream_ring_wrap_merges_copies, TEST_ALL_BACKENDS) {
  uint64_t copies[2][3] = {{0}};
  bool wraps = false;
  for (int wrap = 0; wrap <= 1; wrap++) {
    vp_options_t o;
    sopts(ctx, &o, 4, 0, VP_SIM_SYNC);
    o.staging_wrap = wrap;
    uint64_t ps = o.page_size, ws = 3 * ps / 64; /* 85 1/3 to the ring */
    o.lookahead = 2 * ps;
    vp_device_t dev = test_open_cap(ctx, &o, 4); /* only the ring fits */
    vp_device_info_t info;
    ASSERT_OK(vp_device_info(dev, &info));
    if (wrap) wraps = info.staging_wraps;
    model_t m;
    size_t n = 160; /* 7.5 pages */
    model_uniform(&m, dev, 8 * ps, n, ws, SRC_CONTIG, 32 + wrap);
    for (int pass = 0; pass < 3; pass++) {
      vp_stats_t before = dstats(dev);
      for (size_t i = 0; i < n; i++) {
        uint64_t ptr;
        uint8_t fl;
        ASSERT_OK(vp_acquire(dev, &m.w[i], 1, 0, &ptr, &fl));
        ASSERT_TRUE(fl & VP_ACQUIRED_STAGED);
        verify_resident(dev, 0, ptr, m.srcs[i].host, ws); /* read back */
        ASSERT_OK(vp_release(dev, &m.w[i], 1, 0));
      }
      copies[wrap][pass] = dstats(dev).copies - before.copies;
      test_log("staging_wrap %d, pass %d: %" PRIu64 " copies", wrap, pass,
                copies[wrap][pass]);
    }
    ASSERT_OK(vp_device_close(dev));
    model_free(&m);
  }
  for (int pass = 1; pass < 3; pass++)
    ASSERT_TRUE(copies[1][pass] <= copies[0][pass]);
  if (wraps) ASSERT_EQ_U64(copies[1][2], copies[1][1]);
}

/* A small weight whose cached slot is the oldest in the ring, held while
 * other misses are staged: the rest of the ring (unreferenced cached
 * slots) is still usable, so a weight that fits beside it gets a slot. */
TEST(stream_ring_held_oldest_slot, TEST_ALL_BACKENDS) {
  vp_options_t o;
  sopts(ctx, &o, 2, 0, VP_SIM_SYNC);
  vp_device_t dev = test_open_cap(ctx, &o, 16);
  uint64_t ps = o.page_size, hs = ps / 2;
  model_t m;
  model_uniform(&m, dev, 4 * ps, 8, hs, SRC_SCATTER, 14);
  ASSERT_OK(vp_vbar_set_watermark(m.v, 0));
  uint64_t p[2];
  uint8_t f[2];
  /* Fill the ring with four released (cached) slots. */
  for (int i = 0; i < 4; i++) {
    ASSERT_OK(vp_acquire(dev, &m.w[i], 1, 0, p, f));
    ASSERT_OK(vp_release(dev, &m.w[i], 1, 0));
  }
  /* w0 (a cached hit, the oldest slot) with a new miss, in one call. */
  vp_weight_t two[2] = {m.w[0], m.w[4]};
  ASSERT_OK(vp_acquire(dev, two, 2, 0, p, f));
  ASSERT_EQ_INT(f[0], VP_ACQUIRED_STAGED);
  ASSERT_EQ_INT(f[1], VP_ACQUIRED_STAGED | VP_ACQUIRED_COPIED);
  if (is_sim(ctx)) {
    verify_staged_sim(dev, 0, p[0], m.srcs[0].host, hs);
    verify_staged_sim(dev, 0, p[1], m.srcs[4].host, hs);
  }
  ASSERT_OK(vp_release(dev, &m.w[4], 1, 0));
  /* w0 still held: more misses, one call each. */
  for (int i = 5; i < 8; i++) {
    ASSERT_OK(vp_acquire(dev, &m.w[i], 1, 0, p + 1, f + 1));
    if (is_sim(ctx)) {
      verify_staged_sim(dev, 0, p[1], m.srcs[i].host, hs);
      verify_staged_sim(dev, 0, p[0], m.srcs[0].host, hs);
    }
    ASSERT_OK(vp_release(dev, &m.w[i], 1, 0));
  }
  ASSERT_OK(vp_release(dev, &m.w[0], 1, 0));
  ASSERT_OK(vp_device_close(dev));
  model_free(&m);
}

/* A weight held staged by one call, then acquired resident in a call that
 * fails: the failed call must undo its own (resident) acquire, not the
 * earlier staged one. */
TEST(stream_error_undo_keeps_earlier_acquire, TEST_SIM_ONLY) {
  vp_options_t o;
  sopts(ctx, &o, 2, 0, VP_SIM_SYNC);
  vp_device_t dev = test_open_cap(ctx, &o, 16);
  uint64_t ps = o.page_size;
  model_t a, b;
  model_uniform(&a, dev, 2 * ps, 2, ps, SRC_SCATTER, 11);
  model_uniform(&b, dev, 3 * ps, 3, ps, SRC_SCATTER, 12);
  ASSERT_OK(vp_vbar_set_watermark(a.v, 0));
  ASSERT_OK(vp_vbar_set_watermark(b.v, 0));
  uint64_t pw = 0, p[3] = {0};
  uint8_t f = 0, fl[3] = {0};
  ASSERT_OK(vp_acquire(dev, &a.w[0], 1, 0, &pw, &f)); /* held, staged */
  ASSERT_EQ_INT(f, VP_ACQUIRED_STAGED | VP_ACQUIRED_COPIED);
  ASSERT_OK(vp_vbar_prioritize(a.v)); /* a.w[0] can be resident now */
  vp_weight_t call[3] = {a.w[0], b.w[0], b.w[1]};
  ASSERT_RC(vp_acquire(dev, call, 3, 0, p, fl), VP_ELIMIT);
  /* Nothing of the failed call stays: a.w[0]'s page is not pinned. */
  ASSERT_EQ_STR(test_map(a.v), "#.");
  /* The first acquire still holds its slot: staging b's weights (one at a
   * time, in the other page of the ring) never takes it. */
  for (int i = 0; i < 3; i++) {
    ASSERT_OK(vp_acquire(dev, &b.w[i], 1, 0, p, fl));
    ASSERT_NE_U64(p[0], pw);
    verify_staged_sim(dev, 0, p[0], b.srcs[i].host, ps);
    verify_staged_sim(dev, 0, pw, a.srcs[0].host, ps);
    ASSERT_OK(vp_release(dev, &b.w[i], 1, 0));
  }
  ASSERT_OK(vp_release(dev, &a.w[0], 1, 0));
  ASSERT_RC(vp_release(dev, &a.w[0], 1, 0), VP_ENOTPINNED);
  ASSERT_FALSE(map_has_pin(a.v));
  ASSERT_OK(vp_device_close(dev));
  model_free(&a);
  model_free(&b);
}

/* A call whose copies fail part way (fuzz_api, 2026-12-01): the copies it
 * had queued must have run when it returns, since it unpins their pages at
 * once. Here the first copy queues behind a slow reader (its ring slot's
 * last user), the second fills a resident page, the third cannot read its
 * file. Before the fix the call returned while both were queued; freeing
 * the resident page then made the worker write into an unmapped page. */
TEST(stream_failed_copies_drain_before_unpin, TEST_SIM_ONLY) {
  vp_options_t o;
  sopts(ctx, &o, 2, 0, VP_SIM_WORKER);
  vp_device_t dev = test_open_cap(ctx, &o, 16);
  uint64_t ps = o.page_size;
  model_t a, b;
  model_uniform(&a, dev, 3 * ps, 3, ps, SRC_SCATTER, 13);
  model_uniform(&b, dev, 2 * ps, 2, ps, SRC_SCATTER, 14);
  ASSERT_OK(vp_vbar_set_watermark(a.v, 0)); /* a streams, b stays */
  vp_source_t unreadable = {.kind = VP_SOURCE_FILE, .fd = 999};
  ASSERT_OK(vp_weight_set_source(b.w[1], &unreadable));
  vp_stream_t s = 0, t = 0;
  ASSERT_OK(vp_stream_create(dev, &s));
  ASSERT_OK(vp_stream_create(dev, &t));
  uint64_t p[3] = {0};
  uint8_t fl[3] = {0};
  ASSERT_OK(vp_acquire(dev, &a.w[0], 1, s, p, fl));
  slow_t k = {.ptr = p[0], .size = ps, .ms = 100, .expect = a.srcs[0].host};
  ASSERT_OK(vp_sim_launch(dev, s, slow_fn, &k));
  ASSERT_OK(vp_release(dev, &a.w[0], 1, s));
  ASSERT_OK(vp_acquire(dev, &a.w[1], 1, t, p, fl));
  ASSERT_OK(vp_release(dev, &a.w[1], 1, t));
  /* a.w[2] takes a.w[0]'s slot: its copy waits for the slow reader. */
  vp_weight_t call[3] = {a.w[2], b.w[0], b.w[1]};
  ASSERT_TRUE(vp_acquire(dev, call, 3, t, p, fl) < 0);
  ASSERT_TRUE(slow_done(&k)); /* the queued copies ran first */
  ASSERT_TRUE(slow_ok(&k));
  ASSERT_FALSE(map_has_pin(b.v));
  uint64_t freed = 0;
  ASSERT_OK(vp_vbar_free_memory(b.v, UINT64_MAX, &freed));
  ASSERT_OK(vp_stream_synchronize(dev, t));
  /* Nothing was marked filled by the failed call: b.w[0] is filled again. */
  ASSERT_OK(vp_acquire(dev, &b.w[0], 1, t, p, fl));
  ASSERT_TRUE(fl[0] & VP_ACQUIRED_COPIED);
  verify_resident(dev, t, p[0], b.srcs[0].host, ps);
  ASSERT_OK(vp_release(dev, &b.w[0], 1, t));
  ASSERT_OK(vp_stream_destroy(dev, s));
  ASSERT_OK(vp_stream_destroy(dev, t));
  ASSERT_OK(vp_device_close(dev));
  model_free(&a);
  model_free(&b);
}

/* vp_device_set_staging_size: refused while a staged weight is held; the
 * ring is given back (a slow reader finished first) and the next miss
 * opens it at the new size, whose limits then hold. */
TEST(stream_ring_resize, TEST_SIM_ONLY) {
  model_t m;
  vp_device_t dev = ring_setup(ctx, &m, 4);
  uint64_t ps = m.size[0];
  vp_stream_t a = 0;
  ASSERT_OK(vp_stream_create(dev, &a));
  uint64_t p[2] = {0, 0};
  uint8_t f[2] = {0, 0};
  ASSERT_RC(vp_device_set_staging_size(dev, 0), VP_EINVAL);
  ASSERT_OK(vp_acquire(dev, &m.w[0], 1, a, &p[0], &f[0]));
  slow_t k = {.ptr = p[0], .size = ps, .ms = 50, .expect = m.srcs[0].host};
  ASSERT_OK(vp_sim_launch(dev, a, slow_fn, &k));
  ASSERT_RC(vp_device_set_staging_size(dev, ps), VP_EBUSY);
  ASSERT_OK(vp_release(dev, &m.w[0], 1, a));
  vp_device_info_t before = test_info(dev);
  ASSERT_OK(vp_device_set_staging_size(dev, ps));
  ASSERT_TRUE(slow_done(&k)); /* its reader was waited for */
  ASSERT_TRUE(slow_ok(&k));
  vp_device_info_t after = test_info(dev);
  ASSERT_EQ_U64(before.committed - after.committed, 2 * ps);
  /* One page now: two weights at once no longer fit. */
  ASSERT_RC(vp_acquire(dev, m.w, 2, a, p, f), VP_ELIMIT);
  checks_t c = {0};
  ASSERT_OK(vp_acquire(dev, &m.w[1], 1, a, &p[1], &f[1]));
  ASSERT_EQ_INT(f[1], VP_ACQUIRED_STAGED | VP_ACQUIRED_COPIED);
  launch_check(dev, a, p[1], m.srcs[1].host, ps, &c);
  ASSERT_OK(vp_release(dev, &m.w[1], 1, a));
  checks_expect_clean(dev, a, &c);
  ASSERT_OK(vp_device_set_staging_size(dev, 2 * ps));
  ASSERT_OK(vp_acquire(dev, m.w, 2, a, p, f));
  ASSERT_OK(vp_release(dev, m.w, 2, a));
  ASSERT_OK(vp_stream_synchronize(dev, a));
  ASSERT_OK(vp_device_close(dev));
  model_free(&m);
}

/* A prefetch that finds no room (held slots between the free-able ones,
 * none of them wide enough) reclaims nothing: the weights the ring keeps
 * are acquired again without a copy, and the copy stream waits for no
 * reader. Ring of 4 pages: [A kept][B held][C kept][D held]; E is 2. */
TEST(stream_ring_prefetch_no_room_keeps, TEST_SIM_ONLY) {
  vp_options_t o;
  sopts(ctx, &o, 4, 0, VP_SIM_WORKER);
  uint64_t ps = o.page_size;
  vp_device_t dev = test_open_cap(ctx, &o, 4); /* only the ring fits */
  uint64_t off[5] = {0, ps, 2 * ps, 3 * ps, 4 * ps};
  uint64_t size[5] = {ps, ps, ps, ps, 2 * ps};
  model_t m;
  model_init(&m, dev, 6 * ps, 5, off, size, SRC_SCATTER, 61);
  vp_stream_t s = 0;
  ASSERT_OK(vp_stream_create(dev, &s));
  uint64_t ptr[5];
  uint8_t fl[5];
  ASSERT_OK(vp_acquire(dev, &m.w[0], 1, s, &ptr[0], &fl[0]));
  ASSERT_OK(vp_release(dev, &m.w[0], 1, s));
  ASSERT_OK(vp_acquire(dev, &m.w[1], 1, s, &ptr[1], &fl[1]));
  ASSERT_OK(vp_acquire(dev, &m.w[2], 1, s, &ptr[2], &fl[2]));
  /* A and C are released behind a slow reader: reclaiming them would
   * make the copy stream wait for it. */
  slow_t k = {.ptr = ptr[2], .size = ps, .ms = 300, .expect = m.srcs[2].host};
  ASSERT_OK(vp_sim_launch(dev, s, slow_fn, &k));
  ASSERT_OK(vp_release(dev, &m.w[2], 1, s));
  ASSERT_OK(vp_device_set_lookahead(dev, 2 * ps));
  ASSERT_OK(vp_acquire(dev, &m.w[3], 1, s, &ptr[3], &fl[3])); /* E: no room */
  vp_stats_t st = dstats(dev);
  ASSERT_EQ_U64(st.ring_waits, 0);
  ASSERT_EQ_U64(st.prefetch_bytes, 0);
  ASSERT_OK(vp_device_set_lookahead(dev, 0));
  ASSERT_OK(vp_release(dev, &m.w[1], 1, s));
  ASSERT_OK(vp_release(dev, &m.w[3], 1, s));
  for (int i = 0; i < 3; i += 2) { /* A and C: still staged */
    uint64_t p = 0;
    uint8_t f = 0;
    ASSERT_OK(vp_acquire(dev, &m.w[i], 1, s, &p, &f));
    ASSERT_EQ_U64(p, ptr[i]);
    ASSERT_EQ_INT(f & (VP_ACQUIRED_STAGED | VP_ACQUIRED_COPIED),
                  VP_ACQUIRED_STAGED);
    ASSERT_OK(vp_release(dev, &m.w[i], 1, s));
  }
  ASSERT_EQ_U64(dstats(dev).copies, st.copies);
  ASSERT_OK(vp_stream_synchronize(dev, s));
  ASSERT_TRUE(slow_ok(&k)); /* C's bytes were not overwritten under it */
  ASSERT_OK(vp_device_close(dev));
  model_free(&m);
}

/* The limit leaves no room for the ring (torch took what the budget meant
 * for vpager: on the H200 a LoRA's patch math did, and every forward of
 * the ComfyUI node failed with VP_EOOM). The ring is committed over the
 * limit, within the device's memory; staged weights still arrive whole.
 * A ring the device itself cannot hold is still VP_EOOM. */
TEST(stream_ring_over_limit, TEST_SIM_ONLY) {
  model_t m;
  vp_device_t dev = ring_setup(ctx, &m, 4);
  uint64_t ps = m.size[0];
  ASSERT_OK(vp_device_set_limit(dev, ps)); /* the ring is 2 pages */
  checks_t c = {0};
  uint64_t p = 0;
  uint8_t f = 0;
  for (int i = 0; i < 4; i++) {
    ASSERT_OK(vp_acquire(dev, &m.w[i], 1, 0, &p, &f));
    ASSERT_EQ_INT(f, VP_ACQUIRED_STAGED | VP_ACQUIRED_COPIED);
    launch_check(dev, 0, p, m.srcs[i].host, ps, &c);
    ASSERT_OK(vp_release(dev, &m.w[i], 1, 0));
  }
  checks_expect_clean(dev, 0, &c);
  ASSERT_EQ_U64(test_info(dev).committed, 2 * ps);
  /* A ring larger than the whole device: refused as before. */
  ASSERT_OK(vp_device_set_staging_size(dev, 32 * ps));
  ASSERT_RC(vp_acquire(dev, &m.w[0], 1, 0, &p, &f), VP_EOOM);
  ASSERT_STR_CONTAINS(vp_last_error(), "staging ring");
  ASSERT_OK(vp_device_close(dev));
  model_free(&m);
}

/* ------------------------------------------------------------ lent memory */

/* `pages` pages of a second VBAR of dev, pinned: the caller's memory to
 * lend (on a GPU: blocks of torch's cache); its address. */
static uint64_t lent_setup(vp_device_t dev, uint64_t pages, vp_vbar_t *lv) {
  uint64_t ps = 0, addr = 0;
  vp_device_info_t info;
  ASSERT_OK(vp_device_info(dev, &info));
  ps = info.page_size;
  ASSERT_OK(vp_vbar_create(dev, pages * ps, lv));
  ASSERT_OK(vp_fault(*lv, 0, pages * ps, NULL, 0));
  ASSERT_OK(vp_vbar_base(*lv, &addr));
  return addr;
}

/* lent_setup's VBAR unpinned behind `s`'s work and freed. */
static void lent_teardown(vp_device_t dev, vp_vbar_t lv, uint64_t size,
                          vp_stream_t s) {
  ASSERT_OK(vp_unpin(lv, 0, size, s));
  ASSERT_OK(vp_stream_synchronize(dev, s));
  ASSERT_OK(vp_vbar_destroy(lv));
}

/* Memory lent to the ring (vp_device_lend_staging): while the loan is
 * open a prefetch stages there first, its window larger by the bytes
 * lent; the weights staged there arrive whole, the first acquire of one
 * closes the loan, and reclaiming it waits for the acquires (force: drops
 * the ones not acquired) and orders the caller's next use after every
 * copy into it and every reader. The lent memory is a pinned range of a
 * second VBAR (on a GPU: blocks of torch's cache). */
TEST(stream_ring_lent_memory, TEST_SIM_ONLY) {
  model_t m;
  vp_device_t dev = ring_setup(ctx, &m, 6); /* ring of 2 pages */
  uint64_t ps = m.size[0];
  vp_vbar_t lv;
  uint64_t lent = lent_setup(dev, 8, &lv);
  vp_stream_t s = 0, s2 = 0;
  ASSERT_OK(vp_stream_create(dev, &s));
  ASSERT_OK(vp_stream_create(dev, &s2));
  /* Nothing streamed yet, no ring: nothing is lent. */
  ASSERT_OK(vp_device_lend_staging(dev, lent, 4 * ps, s));
  ASSERT_OK(vp_device_reclaim_staging(dev, s, 0));

  ASSERT_OK(vp_device_set_lookahead(dev, ps));
  uint64_t p[6] = {0};
  uint8_t f[6] = {0};
  ASSERT_OK(vp_acquire(dev, &m.w[0], 1, s, &p[0], &f[0])); /* w1 ahead */
  ASSERT_OK(vp_release(dev, &m.w[0], 1, s));
  ASSERT_OK(vp_stream_synchronize(dev, s));

  /* Bad ranges, refused with the call's name. */
  ASSERT_RC(vp_device_lend_staging(dev, 0, ps, s), VP_EINVAL);
  ASSERT_RC(vp_device_lend_staging(dev, lent + 8, ps, s), VP_EINVAL);
  ASSERT_RC(vp_device_lend_staging(dev, lent, 0, s), VP_EINVAL);
  ASSERT_TRUE(strstr(vp_last_error(), "vp_device_lend_staging") != NULL);
  ASSERT_RC(vp_device_lend_staging(dev, p[0], ps, s), VP_EINVAL); /* ring */

  ASSERT_OK(vp_device_lend_staging(dev, lent, 2 * ps, s));
  ASSERT_RC(vp_device_lend_staging(dev, lent + ps, 2 * ps, s), VP_EINVAL);
  ASSERT_OK(vp_device_lend_staging(dev, lent + 4 * ps, ps, s));
  /* w1's acquire prefetches the loan's three pages and its page of
   * window: w2, w3, w4 there, then w5 in the ring. */
  uint64_t before = dstats(dev).prefetch_bytes;
  ASSERT_OK(vp_acquire(dev, &m.w[1], 1, s, &p[1], &f[1]));
  ASSERT_EQ_U64(dstats(dev).prefetch_bytes - before, 4 * ps);

  checks_t c = {0};
  launch_check(dev, s, p[1], m.srcs[1].host, ps, &c);
  for (int i = 2; i <= 3; i++) {
    ASSERT_OK(vp_acquire(dev, &m.w[i], 1, s, &p[i], &f[i]));
    ASSERT_EQ_INT(f[i], VP_ACQUIRED_STAGED | VP_ACQUIRED_COPIED);
    ASSERT_TRUE(p[i] >= lent && p[i] < lent + 8 * ps);
    launch_check(dev, s, p[i], m.srcs[i].host, ps, &c);
  }
  /* The loan closed at w2's acquire. */
  ASSERT_RC(vp_device_lend_staging(dev, lent + 6 * ps, ps, s), VP_EBUSY);
  slow_t k = {.ptr = p[3], .size = ps, .ms = 200, .expect = m.srcs[3].host};
  ASSERT_OK(vp_sim_launch(dev, s, slow_fn, &k));
  ASSERT_RC(vp_device_reclaim_staging(dev, s2, 1), VP_EBUSY); /* w3 held */
  for (int i = 1; i <= 3; i++) ASSERT_OK(vp_release(dev, &m.w[i], 1, s));
  /* w4 waits there for its acquire; force drops it. */
  ASSERT_RC(vp_device_reclaim_staging(dev, s2, 0), VP_EBUSY);
  ASSERT_OK(vp_device_reclaim_staging(dev, s2, 1));
  /* The caller's next use of the memory, on s2, comes after w3's reader. */
  unsigned char junk[256];
  memset(junk, 0xA5, sizeof junk);
  ASSERT_OK(vp_copy_to_device(dev, p[3], junk, sizeof junk, s2));
  ASSERT_OK(vp_stream_synchronize(dev, s2));
  ASSERT_TRUE(slow_done(&k));
  ASSERT_TRUE(slow_ok(&k));
  ASSERT_OK(vp_device_reclaim_staging(dev, s2, 0)); /* nothing lent */

  /* w4 stages again, in the ring, whole. */
  ASSERT_OK(vp_acquire(dev, &m.w[4], 1, s, &p[4], &f[4]));
  ASSERT_TRUE(p[4] < lent || p[4] >= lent + 8 * ps);
  ASSERT_EQ_INT(f[4] & VP_ACQUIRED_COPIED, VP_ACQUIRED_COPIED);
  launch_check(dev, s, p[4], m.srcs[4].host, ps, &c);
  ASSERT_OK(vp_release(dev, &m.w[4], 1, s));
  checks_expect_clean(dev, s, &c);

  /* A ring freed with memory lent forgets the loan, after its copies. */
  ASSERT_OK(vp_device_lend_staging(dev, lent, 8 * ps, s));
  ASSERT_OK(vp_device_set_staging_size(dev, 2 * ps));
  ASSERT_OK(vp_device_reclaim_staging(dev, s, 0));
  for (int i = 0; i < VP_LENT_RANGES + 1 && i < 6; i++) {
    ASSERT_OK(vp_acquire(dev, &m.w[i], 1, s, &p[i], &f[i]));
    ASSERT_OK(vp_release(dev, &m.w[i], 1, s));
  }
  ASSERT_OK(vp_stream_synchronize(dev, s));
  for (int i = 0; i < VP_LENT_RANGES; i++) /* apart: ranges of their own */
    ASSERT_OK(vp_device_lend_staging(dev, lent + i * 512, 256, s));
  ASSERT_RC(vp_device_lend_staging(dev, lent + 4 * ps, 256, s), VP_EBUSY);
  /* One that continues a range lent lengthens it: no range more. */
  ASSERT_OK(vp_device_lend_staging(dev, lent + 256, 256, s));
  ASSERT_OK(vp_device_reclaim_staging(dev, s, 1));

  lent_teardown(dev, lv, 8 * ps, s);
  ASSERT_OK(vp_stream_destroy(dev, s));
  ASSERT_OK(vp_stream_destroy(dev, s2));
  ASSERT_OK(vp_device_close(dev));
  model_free(&m);
}

/* A gate on a stream: a kernel that runs until the test opens it (or
 * gives up after GATE_MS, which the test then fails on). */
#define GATE_MS 10000
typedef struct gate {
  atomic_bool open, gave_up;
} gate_t;

static void gate_fn(void *arg) {
  gate_t *g = arg;
  uint64_t t0 = test_now_ms();
  while (!atomic_load(&g->open)) {
    if (test_now_ms() - t0 > GATE_MS) {
      atomic_store(&g->gave_up, true);
      return;
    }
    sched_yield();
  }
}

/* Reclaiming a loan orders the caller's stream after the copies into it
 * only, not after the ring's copies queued since (a window ahead on a
 * GPU: the forward would stall until they land). w2 stages in the loan;
 * w5's prefetch reuses w3's ring slot, whose reader is a gate on s3, so
 * the copy stream waits for the gate; s2 reclaims the loan and its work
 * runs while the gate is shut. */
TEST(stream_ring_lent_reclaim_waits_for_its_copies_only, TEST_SIM_ONLY) {
  model_t m;
  vp_device_t dev = ring_setup(ctx, &m, 6); /* ring of 2 pages */
  uint64_t ps = m.size[0];
  vp_vbar_t lv;
  uint64_t lent = lent_setup(dev, 1, &lv);
  vp_stream_t s = 0, s2 = 0, s3 = 0;
  ASSERT_OK(vp_stream_create(dev, &s));
  ASSERT_OK(vp_stream_create(dev, &s2));
  ASSERT_OK(vp_stream_create(dev, &s3));
  ASSERT_OK(vp_device_set_lookahead(dev, ps));
  uint64_t p[6] = {0};
  uint8_t f[6] = {0};
  checks_t c = {0};
  ASSERT_OK(vp_acquire(dev, &m.w[0], 1, s, &p[0], &f[0])); /* w1 ahead */
  ASSERT_OK(vp_release(dev, &m.w[0], 1, s));
  ASSERT_OK(vp_stream_synchronize(dev, s));
  ASSERT_OK(vp_device_lend_staging(dev, lent, ps, s));
  ASSERT_OK(vp_acquire(dev, &m.w[1], 1, s, &p[1], &f[1])); /* w2 lent */
  ASSERT_OK(vp_acquire(dev, &m.w[2], 1, s, &p[2], &f[2]));
  ASSERT_EQ_U64(p[2], lent);
  launch_check(dev, s, p[2], m.srcs[2].host, ps, &c);
  ASSERT_OK(vp_release(dev, &m.w[1], 1, s));
  ASSERT_OK(vp_release(dev, &m.w[2], 1, s));
  checks_expect_clean(dev, s, &c);

  gate_t g = {0};
  ASSERT_OK(vp_acquire(dev, &m.w[3], 1, s3, &p[3], &f[3]));
  ASSERT_OK(vp_sim_launch(dev, s3, gate_fn, &g));
  ASSERT_OK(vp_release(dev, &m.w[3], 1, s3));
  ASSERT_OK(vp_acquire(dev, &m.w[4], 1, s, &p[4], &f[4])); /* w5 gated */
  ASSERT_OK(vp_device_reclaim_staging(dev, s2, 0));
  ASSERT_OK(vp_stream_synchronize(dev, s2));
  ASSERT_FALSE(atomic_load(&g.gave_up));
  atomic_store(&g.open, true);

  launch_check(dev, s, p[4], m.srcs[4].host, ps, &c);
  ASSERT_OK(vp_release(dev, &m.w[4], 1, s));
  ASSERT_OK(vp_acquire(dev, &m.w[5], 1, s, &p[5], &f[5]));
  ASSERT_EQ_U64(p[5], p[3]);
  ASSERT_EQ_INT(f[5], VP_ACQUIRED_STAGED | VP_ACQUIRED_COPIED);
  launch_check(dev, s, p[5], m.srcs[5].host, ps, &c);
  ASSERT_OK(vp_release(dev, &m.w[5], 1, s));
  checks_expect_clean(dev, s, &c);
  ASSERT_OK(vp_stream_synchronize(dev, s3));
  lent_teardown(dev, lv, ps, s);
  ASSERT_OK(vp_stream_destroy(dev, s));
  ASSERT_OK(vp_stream_destroy(dev, s2));
  ASSERT_OK(vp_stream_destroy(dev, s3));
  ASSERT_OK(vp_device_close(dev));
  model_free(&m);
}

/* The loan-packing tests' setting: units_setup's device and model, a
 * loan VBAR of `pages` pages (lent_setup) and one stream, the window a
 * page. */
typedef struct {
  model_t m;
  vp_device_t dev;
  uint64_t u, lent, pages;
  vp_vbar_t lv;
  vp_stream_t s;
  checks_t c;
} loan_fixture_t;

static void loan_open(test_ctx_t *ctx, loan_fixture_t *x,
                      const uint64_t *units, size_t n, uint64_t key,
                      uint64_t pages) {
  memset(x, 0, sizeof *x);
  x->dev = units_setup(ctx, &x->m, units, n, key, &x->u);
  x->pages = pages;
  x->lent = lent_setup(x->dev, pages, &x->lv);
  ASSERT_OK(vp_stream_create(x->dev, &x->s));
  ASSERT_OK(vp_device_set_lookahead(x->dev, 4 * x->u));
}

/* Weight i acquired (staged and copied), its bytes checked on the
 * device, released: where it was staged. */
static uint64_t loan_use(loan_fixture_t *x, size_t i) {
  uint64_t p = 0;
  uint8_t f = 0;
  ASSERT_OK(vp_acquire(x->dev, &x->m.w[i], 1, x->s, &p, &f));
  ASSERT_EQ_INT(f, VP_ACQUIRED_STAGED | VP_ACQUIRED_COPIED);
  launch_check(x->dev, x->s, p, x->m.srcs[i].host, x->m.size[i], &x->c);
  ASSERT_OK(vp_release(x->dev, &x->m.w[i], 1, x->s));
  return p;
}

/* The loan back unforced, every check clean, all freed. */
static void loan_close(loan_fixture_t *x) {
  ASSERT_OK(vp_device_reclaim_staging(x->dev, x->s, 0));
  checks_expect_clean(x->dev, x->s, &x->c);
  lent_teardown(x->dev, x->lv, x->pages * 4 * x->u, x->s);
  ASSERT_OK(vp_stream_destroy(x->dev, x->s));
  ASSERT_OK(vp_device_close(x->dev));
  model_free(&x->m);
}

/* A loan of two ranges takes as many of the next weights as fit in order,
 * a slot never spanning two: with ranges of 10 and 6 units and weights of
 * 3, 3, 1, 4, 4, 1 units after the ring's, the 1 goes to the second
 * range so that both 4s fit (first fit would strand 3 units in the first
 * range and 2 in the second, and the second 4 would wait for the ring);
 * Flux's blocks of 189 and 107 MB and weights of 56, 56, 19, 75, 75 MB
 * alike. Bytes checked at each acquire; the loan comes back unforced. */
TEST(stream_ring_lent_ranges_packed, TEST_SIM_ONLY) {
  enum { N = 9 };
  const uint64_t units[N] = {4, 4, 3, 3, 1, 4, 4, 1, 4};
  loan_fixture_t x;
  loan_open(ctx, &x, units, N, 11, 5);
  vp_device_t dev = x.dev;
  uint64_t u = x.u, lent = x.lent, p = 0;
  ASSERT_OK(vp_acquire(dev, &x.m.w[0], 1, x.s, &p, NULL)); /* w1 ahead */
  ASSERT_OK(vp_release(dev, &x.m.w[0], 1, x.s));
  ASSERT_OK(vp_stream_synchronize(dev, x.s));
  ASSERT_OK(vp_device_lend_staging(dev, lent, 10 * u, x.s));
  ASSERT_OK(vp_device_lend_staging(dev, lent + 12 * u, 6 * u, x.s));
  for (size_t i = 1; i < N; i++) {
    p = loan_use(&x, i);
    /* w2..w7 (16 units) in the loan, w8 in the ring. */
    ASSERT_EQ_INT(p >= lent && p < lent + 18 * u, i >= 2 && i <= 7);
  }
  loan_close(&x);
}

/* A loan lent in two steps, the second range starting where the first
 * ends, is one range: a slot may run on across the seam. Units of 4, 4,
 * 4, 3, 4, 4, a ring of 8 units held full (w0 acquired, w1 staged): lent
 * [0, 6) the prefetch stages w2 at 0 and w3 finds 2 units; lent [6, 12)
 * then, w3 goes at 4 (across 6: as a range of its own it would start at
 * 6) and w4 at 7. Bytes checked at each acquire; back unforced. */
TEST(stream_ring_lent_range_lengthened, TEST_SIM_ONLY) {
  enum { N = 6 };
  const uint64_t units[N] = {4, 4, 4, 3, 4, 4};
  loan_fixture_t x;
  loan_open(ctx, &x, units, N, 13, 3);
  vp_device_t dev = x.dev;
  uint64_t u = x.u, lent = x.lent, p = 0;
  ASSERT_OK(vp_acquire(dev, &x.m.w[0], 1, x.s, &p, NULL)); /* w1 ahead */
  ASSERT_OK(vp_device_lend_staging(dev, lent, 6 * u, x.s));
  ASSERT_OK(vp_prefetch(dev, x.m.w[0]));
  uint64_t before = dstats(dev).prefetch_bytes;
  ASSERT_OK(vp_device_lend_staging(dev, lent + 6 * u, 6 * u, x.s));
  ASSERT_OK(vp_prefetch(dev, x.m.w[0]));
  ASSERT_EQ_U64(dstats(dev).prefetch_bytes - before, 7 * u); /* w3, w4 */
  ASSERT_OK(vp_release(dev, &x.m.w[0], 1, x.s));
  const uint64_t at[N] = {0, 0, 0, 4, 7, 0};
  for (size_t i = 1; i < N; i++) {
    p = loan_use(&x, i);
    if (i >= 2 && i <= 4) ASSERT_EQ_U64(p, lent + at[i] * u);
    else ASSERT_FALSE(p >= lent && p < lent + 12 * u);
  }
  loan_close(&x);
}

/* Slots in lent memory start SLOT_ALIGN (256 bytes) apart as the ring's
 * do (vp__ring_alloc rounds a slot's size for both): a weight of 1000
 * bytes staged there leaves the next one at +1024 (kernels read a weight
 * from an aligned start: a copy by SMs needs 16 bytes); bytes checked. */
TEST(stream_ring_lent_slots_aligned, TEST_SIM_ONLY) {
  vp_options_t o;
  sopts(ctx, &o, 2, 0, VP_SIM_WORKER);
  vp_device_t dev = test_open_cap(ctx, &o, 16);
  uint64_t ps = o.page_size;
  const uint64_t off[4] = {0, ps, 2 * ps, 3 * ps};
  const uint64_t size[4] = {ps, 1000, 4096, ps};
  model_t m;
  model_init(&m, dev, 4 * ps, 4, off, size, SRC_SCATTER, 17);
  ASSERT_OK(vp_vbar_set_watermark(m.v, 0));
  vp_vbar_t lv;
  uint64_t lent = lent_setup(dev, 1, &lv);
  vp_stream_t s = 0;
  ASSERT_OK(vp_stream_create(dev, &s));
  uint64_t p[4] = {0};
  uint8_t f[4] = {0};
  checks_t c = {0};
  ASSERT_OK(vp_acquire(dev, &m.w[0], 1, s, &p[0], &f[0])); /* no window */
  ASSERT_OK(vp_device_lend_staging(dev, lent, ps, s));
  ASSERT_OK(vp_prefetch_ahead(dev, m.w[0], ps)); /* w1, w2 in the loan */
  ASSERT_OK(vp_release(dev, &m.w[0], 1, s));
  for (size_t i = 1; i <= 2; i++) {
    ASSERT_OK(vp_acquire(dev, &m.w[i], 1, s, &p[i], &f[i]));
    ASSERT_EQ_INT(f[i], VP_ACQUIRED_STAGED | VP_ACQUIRED_COPIED);
    launch_check(dev, s, p[i], m.srcs[i].host, size[i], &c);
    ASSERT_OK(vp_release(dev, &m.w[i], 1, s));
  }
  ASSERT_EQ_U64(p[1], lent);
  ASSERT_EQ_U64(p[2], lent + 1024);
  ASSERT_OK(vp_device_reclaim_staging(dev, s, 0));
  checks_expect_clean(dev, s, &c);
  lent_teardown(dev, lv, ps, s);
  ASSERT_OK(vp_stream_destroy(dev, s));
  ASSERT_OK(vp_device_close(dev));
  model_free(&m);
}

/* A window topped up after a release while a loan is open counts the
 * weights staged there: the ring then takes its own share after them.
 * Ring of 2 pages, a window of 1, a loan of 2: w1's acquire stages w2
 * and w3 in the loan and finds the ring full (w0 and w1 held); w0's
 * release tops the window up with w4 in the ring. */
TEST(stream_ring_lent_memory_topped_up, TEST_SIM_ONLY) {
  model_t m;
  vp_device_t dev = ring_setup(ctx, &m, 6);
  uint64_t ps = m.size[0];
  vp_vbar_t lv;
  uint64_t lent = lent_setup(dev, 2, &lv);
  vp_stream_t s = 0;
  ASSERT_OK(vp_stream_create(dev, &s));
  ASSERT_OK(vp_device_set_lookahead(dev, ps));
  uint64_t p[5] = {0};
  uint8_t f[5] = {0};
  ASSERT_OK(vp_acquire(dev, &m.w[0], 1, s, &p[0], &f[0])); /* w1 ahead */
  ASSERT_OK(vp_device_lend_staging(dev, lent, 2 * ps, s));
  uint64_t before = dstats(dev).prefetch_bytes;
  ASSERT_OK(vp_acquire(dev, &m.w[1], 1, s, &p[1], &f[1]));
  ASSERT_EQ_U64(dstats(dev).prefetch_bytes - before, 2 * ps); /* w2, w3 */
  ASSERT_OK(vp_release(dev, &m.w[0], 1, s));
  ASSERT_EQ_U64(dstats(dev).prefetch_bytes - before, 3 * ps); /* w4 */
  checks_t c = {0};
  for (int i = 2; i <= 4; i++) {
    ASSERT_OK(vp_acquire(dev, &m.w[i], 1, s, &p[i], &f[i]));
    ASSERT_EQ_INT(f[i], VP_ACQUIRED_STAGED | VP_ACQUIRED_COPIED);
    ASSERT_EQ_INT(p[i] >= lent && p[i] < lent + 2 * ps, i < 4);
    launch_check(dev, s, p[i], m.srcs[i].host, ps, &c);
  }
  for (int i = 1; i <= 4; i++) ASSERT_OK(vp_release(dev, &m.w[i], 1, s));
  ASSERT_OK(vp_device_reclaim_staging(dev, s, 0));
  checks_expect_clean(dev, s, &c);
  lent_teardown(dev, lv, 2 * ps, s);
  ASSERT_OK(vp_stream_destroy(dev, s));
  ASSERT_OK(vp_device_close(dev));
  model_free(&m);
}
