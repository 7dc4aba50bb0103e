/* Weights: bad input, source NONE, interleaved weight groups, destroy and
 * close. */
#include "stream_fixture.h"
#include "compat.h"

/* ------------------------------------------------------------- bad input */

TEST(stream_bad_input, TEST_ALL_BACKENDS) {
  vp_options_t o;
  sopts(ctx, &o, 2, 0, VP_SIM_SYNC);
  vp_device_t dev = test_open_cap(ctx, &o, 16);
  uint64_t ps = o.page_size;
  vp_vbar_t v = test_vbar(dev, 4 * ps);
  unsigned char *src = malloc(4 * ps);
  ASSERT_NOT_NULL(src);
  test_pattern(src, 4 * ps, 77);
  uint64_t off[4] = {0, ps, 2 * ps, 3 * ps}, sz[4] = {ps, ps, ps, ps};
  vp_source_t srcs[4];
  for (int i = 0; i < 4; i++)
    srcs[i] = (vp_source_t){.kind = VP_SOURCE_HOST, .host = src + i * ps};
  vp_weight_t w[4], extra = {0};
  uint64_t ptr = 0;
  uint8_t fl = 0;

  /* vp_weights_create argument checks; all or nothing. */
  ASSERT_RC(vp_weights_create(v, 0, off, sz, srcs, w), VP_EINVAL);
  ASSERT_RC(vp_weights_create(v, 1, NULL, sz, srcs, w), VP_EINVAL);
  ASSERT_RC(vp_weights_create(v, 1, off, NULL, srcs, w), VP_EINVAL);
  ASSERT_RC(vp_weights_create(v, 1, off, sz, srcs, NULL), VP_EINVAL);
  ASSERT_RC(vp_weights_create((vp_vbar_t){0}, 1, off, sz, srcs, w),
            VP_EHANDLE);
  uint64_t zsz = 0;
  ASSERT_RC(vp_weights_create(v, 1, off, &zsz, srcs, w), VP_EINVAL);
  uint64_t far = 4 * ps, tail = 3 * ps + 1;
  ASSERT_FAILS(vp_weights_create(v, 1, &far, sz, srcs, w));
  ASSERT_RC(vp_weights_create(v, 1, &far, sz, srcs, w), VP_ERANGE);
  ASSERT_RC(vp_weights_create(v, 1, &tail, sz, srcs, w), VP_ERANGE);
  uint64_t big = 5 * ps;
  ASSERT_RC(vp_weights_create(v, 1, off, &big, srcs, w), VP_ERANGE);
  vp_source_t nullhost = {.kind = VP_SOURCE_HOST, .host = NULL};
  ASSERT_RC(vp_weights_create(v, 1, off, sz, &nullhost, w), VP_EINVAL);
  vp_source_t badfd = {.kind = VP_SOURCE_FILE, .fd = -1};
  ASSERT_RC(vp_weights_create(v, 1, off, sz, &badfd, w), VP_EINVAL);
  vp_source_t badkind = {.kind = 42, .host = src};
  ASSERT_RC(vp_weights_create(v, 1, off, sz, &badkind, w), VP_EINVAL);
  /* Overlap inside one call: [0, 2ps) and [ps, 2ps). */
  uint64_t ooff[2] = {0, ps}, osz[2] = {2 * ps, ps};
  ASSERT_RC(vp_weights_create(v, 2, ooff, osz, srcs, w), VP_EINVAL);
  /* A bad second weight: the first is not created either. */
  uint64_t boff[2] = {0, 9 * ps};
  ASSERT_RC(vp_weights_create(v, 2, boff, sz, srcs, w), VP_ERANGE);
  ASSERT_OK(vp_weights_create(v, 4, off, sz, srcs, w));
  /* Overlap with existing weights, also by one byte. */
  uint64_t in = ps + 100, small = 10, edge = ps - 1, two = 2;
  ASSERT_RC(vp_weights_create(v, 1, &in, &small, srcs, &extra), VP_EINVAL);
  ASSERT_RC(vp_weights_create(v, 1, &edge, &two, srcs, &extra), VP_EINVAL);

  /* vp_acquire / vp_release argument checks. */
  ASSERT_RC(vp_acquire(dev, NULL, 1, 0, &ptr, &fl), VP_EINVAL);
  ASSERT_RC(vp_acquire(dev, w, 0, 0, &ptr, &fl), VP_EINVAL);
  ASSERT_RC(vp_acquire(dev, w, 1, 0, NULL, &fl), VP_EINVAL);
  ASSERT_RC(vp_release(dev, NULL, 1, 0), VP_EINVAL);
  ASSERT_RC(vp_release(dev, w, 0, 0), VP_EINVAL);
  vp_weight_t bogus = {0}, made_up = {w[0].id ^ (1ull << 40)};
  ASSERT_RC(vp_acquire(dev, &bogus, 1, 0, &ptr, &fl), VP_EHANDLE);
  ASSERT_RC(vp_acquire(dev, &made_up, 1, 0, &ptr, &fl), VP_EHANDLE);
  ASSERT_RC(vp_release(dev, &bogus, 1, 0), VP_EHANDLE);
  ASSERT_RC(vp_weight_destroy(bogus), VP_EHANDLE);
  ASSERT_RC(vp_acquire((vp_device_t){0}, w, 1, 0, &ptr, &fl), VP_EHANDLE);
  ASSERT_RC(vp_device_set_lookahead((vp_device_t){0}, 0), VP_EHANDLE);
  /* A good handle after a bad one: nothing acquired. */
  vp_weight_t mixed[2] = {w[0], bogus};
  uint64_t mp[2];
  ASSERT_RC(vp_acquire(dev, mixed, 2, 0, mp, NULL), VP_EHANDLE);
  ASSERT_FALSE(map_has_pin(v));
  ASSERT_OK(vp_weight_destroy(w[0])); /* not acquired: destroyable */
  ASSERT_OK(vp_weights_create(v, 1, &off[0], &sz[0], &srcs[0], &w[0]));

  /* Foreign device: its weights are not ours. */
  vp_options_t o2;
  sopts(ctx, &o2, 2, 0, VP_SIM_SYNC);
  vp_device_t dev2 = test_open_cap(ctx, &o2, 8);
  vp_vbar_t v2 = test_vbar(dev2, ps);
  vp_weight_t w2;
  ASSERT_OK(vp_weights_create(v2, 1, off, sz, srcs, &w2));
  ASSERT_RC(vp_acquire(dev, &w2, 1, 0, &ptr, &fl), VP_EHANDLE);
  ASSERT_RC(vp_acquire(dev2, &w[0], 1, 0, &ptr, &fl), VP_EHANDLE);
  ASSERT_OK(vp_acquire(dev2, &w2, 1, 0, &ptr, &fl));
  ASSERT_RC(vp_release(dev, &w2, 1, 0), VP_EHANDLE);
  ASSERT_OK(vp_release(dev2, &w2, 1, 0));
  ASSERT_OK(vp_device_close(dev2));
  /* ... and after its device closed, stale. */
  ASSERT_RC(vp_weight_destroy(w2), VP_EHANDLE);
  ASSERT_RC(vp_acquire(dev, &w2, 1, 0, &ptr, &fl), VP_EHANDLE);

  /* Release of a weight not acquired; of more than were acquired. */
  ASSERT_RC(vp_release(dev, &w[1], 1, 0), VP_ENOTPINNED);
  ASSERT_OK(vp_acquire(dev, &w[0], 1, 0, &ptr, &fl));
  vp_weight_t rel[2] = {w[0], w[1]};
  ASSERT_RC(vp_release(dev, rel, 2, 0), VP_ENOTPINNED);
  /* nothing changed: w[0] is still acquired */
  ASSERT_RC(vp_weight_destroy(w[0]), VP_EBUSY);
  ASSERT_RC(vp_vbar_destroy(v), VP_EBUSY);
  ASSERT_FAILS(vp_vbar_destroy(v));
  ASSERT_OK(vp_release(dev, &w[0], 1, 0));
  ASSERT_RC(vp_release(dev, &w[0], 1, 0), VP_ENOTPINNED);

  /* Twice acquired: busy until both releases. */
  ASSERT_OK(vp_acquire(dev, &w[1], 1, 0, &ptr, &fl));
  ASSERT_OK(vp_acquire(dev, &w[1], 1, 0, &ptr, &fl));
  ASSERT_OK(vp_release(dev, &w[1], 1, 0));
  ASSERT_RC(vp_weight_destroy(w[1]), VP_EBUSY);
  ASSERT_OK(vp_release(dev, &w[1], 1, 0));
  ASSERT_OK(vp_weight_destroy(w[1]));
  ASSERT_RC(vp_weight_destroy(w[1]), VP_EHANDLE);
  ASSERT_RC(vp_acquire(dev, &w[1], 1, 0, &ptr, &fl), VP_EHANDLE);
  ASSERT_RC(vp_release(dev, &w[1], 1, 0), VP_EHANDLE);
  /* Its range is free again. */
  ASSERT_OK(vp_weights_create(v, 1, &off[1], &sz[1], &srcs[1], &w[1]));

  /* A staged weight held: the VBAR cannot go. */
  ASSERT_OK(vp_vbar_free_memory(v, 4 * ps, NULL));
  ASSERT_OK(vp_acquire(dev, &w[2], 1, 0, &ptr, &fl));
  ASSERT_EQ_INT(fl & VP_ACQUIRED_STAGED, VP_ACQUIRED_STAGED);
  ASSERT_RC(vp_weight_destroy(w[2]), VP_EBUSY);
  ASSERT_RC(vp_vbar_destroy(v), VP_EBUSY);
  ASSERT_OK(vp_release(dev, &w[2], 1, 0));

  /* The device still works; a VBAR destroy takes its weights. */
  ASSERT_OK(vp_vbar_prioritize(v));
  uint64_t p4[4];
  ASSERT_OK(vp_acquire(dev, w, 4, 0, p4, NULL));
  for (int i = 0; i < 4; i++)
    verify_resident(dev, 0, p4[i], srcs[i].host, ps);
  ASSERT_OK(vp_release(dev, w, 4, 0));
  ASSERT_OK(vp_vbar_destroy(v));
  for (int i = 0; i < 4; i++) {
    ASSERT_RC(vp_weight_destroy(w[i]), VP_EHANDLE);
    ASSERT_RC(vp_acquire(dev, &w[i], 1, 0, &ptr, &fl), VP_EHANDLE);
  }
  ASSERT_OK(vp_device_close(dev));
  ASSERT_RC(vp_acquire(dev, w, 1, 0, &ptr, &fl), VP_EHANDLE);
  ASSERT_RC(vp_release(dev, w, 1, 0), VP_EHANDLE);
  ASSERT_RC(vp_device_set_lookahead(dev, 1), VP_EHANDLE);
  free(src);
}

/* An acquire that fails at the stream wait (a stream that does not exist)
 * leaves nothing acquired. */
TEST(stream_bad_stream_nothing_acquired, TEST_SIM_ONLY) {
  vp_options_t o;
  sopts(ctx, &o, 2, 0, VP_SIM_SYNC);
  vp_device_t dev = test_open_cap(ctx, &o, 16);
  uint64_t ps = o.page_size;
  model_t m;
  model_uniform(&m, dev, 2 * ps, 2, ps, SRC_SCATTER, 13);
  vp_stream_t dead = 0;
  ASSERT_OK(vp_stream_create(dev, &dead));
  ASSERT_OK(vp_stream_destroy(dev, dead));
  uint64_t p = 0;
  uint8_t f = 0;
  ASSERT_FAILS(vp_acquire(dev, m.w, 1, dead, &p, &f));
  ASSERT_EQ_STR(test_map(m.v), "#.");
  ASSERT_RC(vp_release(dev, m.w, 1, 0), VP_ENOTPINNED);
  ASSERT_OK(vp_weight_destroy(m.w[0]));
  ASSERT_OK(vp_device_close(dev));
  model_free(&m);
}

/* ----------------------------------------------------------- source none */

TEST(stream_source_none, TEST_ALL_BACKENDS) {
  vp_options_t o;
  sopts(ctx, &o, 2, 0, VP_SIM_SYNC);
  uint64_t ps = o.page_size;
  o.lookahead = 8 * ps; /* prefetch skips NONE weights */
  vp_device_t dev = test_open_cap(ctx, &o, 16);
  vp_vbar_t v = test_vbar(dev, 4 * ps);
  uint64_t base = test_vbar_base(v);
  uint64_t off[3] = {0, ps, 2 * ps + 512}, sz[3] = {ps, ps / 2, ps};
  vp_weight_t w[3];
  ASSERT_OK(vp_weights_create(v, 3, off, sz, NULL, w));
  unsigned char *data = malloc(3 * ps);
  ASSERT_NOT_NULL(data);
  test_pattern(data, 3 * ps, 99);
  uint64_t ptrs[3];
  uint8_t fl[3];

  ASSERT_OK(vp_acquire(dev, w, 3, 0, ptrs, fl));
  for (int i = 0; i < 3; i++) {
    ASSERT_EQ_INT(fl[i], VP_ACQUIRED_RESIDENT | VP_ACQUIRED_EMPTY);
    ASSERT_EQ_U64(ptrs[i], base + off[i]);
    ASSERT_OK(vp_copy_to_device(dev, ptrs[i], data + i * ps, sz[i], 0));
  }
  ASSERT_OK(vp_release(dev, w, 3, 0));
  vp_stats_t st = dstats(dev);
  ASSERT_EQ_U64(st.weight_fills, 0);
  ASSERT_EQ_U64(st.copies, 0);
  ASSERT_EQ_U64(st.prefetch_bytes, 0);

  /* Resident and unchanged: not EMPTY, the caller's bytes are there. */
  ASSERT_OK(vp_acquire(dev, w, 3, 0, ptrs, fl));
  for (int i = 0; i < 3; i++) {
    ASSERT_EQ_INT(fl[i], VP_ACQUIRED_RESIDENT);
    verify_resident(dev, 0, ptrs[i], data + i * ps, sz[i]);
  }
  ASSERT_OK(vp_release(dev, w, 3, 0));

  /* Page 2 evicted (it holds part of w[2]): w[2] is EMPTY again, the
   * others not. */
  ASSERT_OK(vp_vbar_free_memory(v, ps, NULL)); /* page 3, then ... */
  ASSERT_OK(vp_vbar_free_memory(v, ps, NULL)); /* page 2 */
  ASSERT_EQ_STR(test_map(v), "##..");
  ASSERT_OK(vp_vbar_prioritize(v));
  ASSERT_OK(vp_acquire(dev, w, 3, 0, ptrs, fl));
  ASSERT_EQ_INT(fl[0], VP_ACQUIRED_RESIDENT);
  ASSERT_EQ_INT(fl[1], VP_ACQUIRED_RESIDENT);
  ASSERT_EQ_INT(fl[2], VP_ACQUIRED_RESIDENT | VP_ACQUIRED_EMPTY);
  ASSERT_OK(vp_copy_to_device(dev, ptrs[2], data + 2 * ps, sz[2], 0));
  ASSERT_OK(vp_release(dev, w, 3, 0));
  ASSERT_OK(vp_acquire(dev, &w[2], 1, 0, ptrs, fl));
  ASSERT_EQ_INT(fl[0], VP_ACQUIRED_RESIDENT);
  verify_resident(dev, 0, ptrs[0], data + 2 * ps, sz[2]);
  ASSERT_OK(vp_release(dev, &w[2], 1, 0));

  /* A miss: a staged EMPTY slot for the caller to fill. */
  ASSERT_OK(vp_vbar_free_memory(v, 4 * ps, NULL));
  ASSERT_OK(vp_acquire(dev, w, 1, 0, ptrs, fl));
  ASSERT_EQ_INT(fl[0], VP_ACQUIRED_STAGED | VP_ACQUIRED_EMPTY);
  ASSERT_EQ_U64(dstats(dev).copies, 0);
  ASSERT_OK(vp_release(dev, w, 1, 0));
  ASSERT_OK(vp_device_close(dev));
  free(data);
}

/* ---------------------------------------------- interleaved groups */

/* Interleaved order with weights: eviction takes whole weights (pages a
 * weight spans stay together), spread through the VBAR; weights sharing a
 * page are one group; pages without a weight go first. */
TEST(stream_interleaved_weight_groups, TEST_ALL_BACKENDS) {
  vp_options_t o;
  sopts(ctx, &o, 4, 0, VP_SIM_SYNC);
  uint64_t ps = o.page_size;
  o.evict_order = VP_ORDER_INTERLEAVED;
  vp_device_t dev = test_open_cap(ctx, &o, 32);
  uint64_t p = 0;
  uint8_t f = 0;

  /* Four page-aligned weights of 4 pages: groups 0, 2, 1, 3 by rank. */
  model_t m;
  model_uniform(&m, dev, 16 * ps, 4, 4 * ps, SRC_SCATTER, 22);
  for (int i = 0; i < 4; i++) {
    ASSERT_OK(vp_acquire(dev, &m.w[i], 1, 0, &p, &f));
    ASSERT_OK(vp_release(dev, &m.w[i], 1, 0));
  }
  ASSERT_EQ_STR(test_map(m.v), "################");
  ASSERT_OK(vp_vbar_free_memory(m.v, 4 * ps, NULL));
  ASSERT_EQ_STR(test_map(m.v), "############....");
  ASSERT_OK(vp_vbar_free_memory(m.v, 2 * ps, NULL)); /* a group's tail */
  ASSERT_EQ_STR(test_map(m.v), "######..####....");
  ASSERT_OK(vp_vbar_free_memory(m.v, 2 * ps, NULL));
  ASSERT_EQ_STR(test_map(m.v), "####....####....");
  ASSERT_OK(vp_acquire(dev, &m.w[2], 1, 0, &p, &f)); /* whole and in place */
  ASSERT_EQ_INT(f, VP_ACQUIRED_RESIDENT);
  verify_resident(dev, 0, p, m.srcs[2].host, 4 * ps);
  ASSERT_OK(vp_release(dev, &m.w[2], 1, 0));

  /* Weights of 1.5 pages share pages: pages 0-2 and 3-5 are two groups;
   * pages 6-7 hold no weight and are evicted first. */
  model_t x;
  model_uniform(&x, dev, 8 * ps, 4, ps + ps / 2, SRC_SCATTER, 23);
  ASSERT_OK(vp_fault(x.v, 0, 8 * ps, NULL, 0));
  ASSERT_OK(vp_unpin(x.v, 0, 8 * ps, 0));
  ASSERT_OK(vp_vbar_free_memory(x.v, 2 * ps, NULL));
  ASSERT_EQ_STR(test_map(x.v), "######..");
  ASSERT_OK(vp_vbar_free_memory(x.v, 3 * ps, NULL));
  ASSERT_EQ_STR(test_map(x.v), "###.....");

  ASSERT_OK(vp_device_close(dev));
  model_free(&m);
  model_free(&x);
}

/* --------------------------------------------------------- destroy/close */

static void close_run(test_ctx_t *ctx, int sim_streams, int variant) {
  vp_options_t o;
  sopts(ctx, &o, 4, 0, sim_streams);
  uint64_t ps = o.page_size;
  o.lookahead = 64 * ps;
  vp_device_t dev = test_open_cap(ctx, &o, 10);
  model_t m;
  model_uniform(&m, dev, 12 * ps, 24, ps / 2, SRC_SCATTER, 31 + variant);
  vp_stream_t s = 0;
  ASSERT_OK(vp_stream_create(dev, &s));
  uint64_t ptrs[4];
  uint8_t fl[4];
  slow_t k = {0};
  switch (variant) {
  case 0: /* resident weights acquired, never released */
    ASSERT_OK(vp_acquire(dev, m.w, 4, s, ptrs, fl));
    break;
  case 1: /* staged weights acquired, prefetches queued */
    ASSERT_OK(vp_vbar_set_watermark(m.v, 0));
    ASSERT_OK(vp_acquire(dev, m.w, 4, s, ptrs, fl));
    ASSERT_EQ_INT(fl[0] & VP_ACQUIRED_STAGED, VP_ACQUIRED_STAGED);
    break;
  case 2: /* a slow reader of a released staged weight still running */
    ASSERT_OK(vp_vbar_set_watermark(m.v, 0));
    ASSERT_OK(vp_acquire(dev, m.w, 1, s, ptrs, fl));
    k = (slow_t){.ptr = ptrs[0], .size = ps / 2, .ms = 50,
                 .expect = m.srcs[0].host};
    ASSERT_OK(vp_sim_launch(dev, s, slow_fn, &k));
    ASSERT_OK(vp_release(dev, m.w, 1, s));
    /* more acquires that wait on the ring behind the reader */
    for (size_t i = 1; i + 2 <= m.n; i += 2) {
      ASSERT_OK(vp_acquire(dev, &m.w[i], 2, s, ptrs, fl));
      ASSERT_OK(vp_release(dev, &m.w[i], 2, s));
    }
    break;
  case 3: /* a slow reader of a released resident weight */
    ASSERT_OK(vp_acquire(dev, m.w, 2, s, ptrs, fl));
    k = (slow_t){.ptr = ptrs[1], .size = ps / 2, .ms = 50,
                 .expect = m.srcs[1].host};
    ASSERT_OK(vp_sim_launch(dev, s, slow_fn, &k));
    ASSERT_OK(vp_release(dev, m.w, 2, s));
    break;
  }
  /* Some acquired, some released, prefetch in flight: close. */
  ASSERT_OK(vp_device_close(dev));
  if (variant >= 2) {
    ASSERT_TRUE(slow_done(&k));
    ASSERT_TRUE(slow_ok(&k)); /* the reader saw its bytes */
  }
  model_free(&m);
}

TEST(stream_destroy_cleanup, TEST_SIM_ONLY) {
  for (int variant = 0; variant < 4; variant++) {
    test_note("variant %d", variant);
    close_run(ctx, VP_SIM_SYNC, variant);
    close_run(ctx, VP_SIM_WORKER, variant);
  }
  /* VBAR destroy with weights that were prefetched and staged. */
  vp_options_t o;
  sopts(ctx, &o, 4, 0, VP_SIM_WORKER);
  uint64_t ps = o.page_size;
  o.lookahead = 64 * ps;
  vp_device_t dev = test_open_cap(ctx, &o, 10);
  model_t m;
  model_uniform(&m, dev, 12 * ps, 24, ps / 2, SRC_SCATTER, 40);
  uint64_t ptrs[2];
  uint8_t fl[2];
  ASSERT_OK(vp_vbar_set_watermark(m.v, 4));
  for (size_t i = 0; i < m.n; i += 2) {
    ASSERT_OK(vp_acquire(dev, &m.w[i], 2, 0, ptrs, fl));
    ASSERT_OK(vp_release(dev, &m.w[i], 2, 0));
  }
  ASSERT_OK(vp_acquire(dev, m.w, 2, 0, ptrs, fl));
  ASSERT_OK(vp_release(dev, m.w, 2, 0));
  ASSERT_OK(vp_vbar_destroy(m.v));
  ASSERT_OK(vp_stream_synchronize(dev, 0));
  /* The ring still works for another VBAR. */
  model_t m2;
  model_uniform(&m2, dev, 4 * ps, 4, ps / 2, SRC_SCATTER, 41);
  ASSERT_OK(vp_vbar_set_watermark(m2.v, 0));
  checks_t c = {0};
  ASSERT_OK(vp_acquire(dev, m2.w, 2, 0, ptrs, fl));
  for (int j = 0; j < 2; j++) {
    ASSERT_EQ_INT(fl[j], VP_ACQUIRED_STAGED | VP_ACQUIRED_COPIED);
    launch_check(dev, 0, ptrs[j], m2.srcs[j].host, ps / 2, &c);
  }
  ASSERT_OK(vp_release(dev, m2.w, 2, 0));
  checks_expect_clean(dev, 0, &c);
  ASSERT_OK(vp_device_close(dev));
  model_free(&m);
  model_free(&m2);
}

/* A weight's host source may be freed once vp_weight_destroy returned, even
 * when a prefetch copy of it was still queued on the copy stream. The copy
 * stream is held back by a ring reuse waiting for a slow reader. */
TEST(stream_destroy_then_free_source, TEST_SIM_ONLY) {
  vp_options_t o;
  sopts(ctx, &o, 2, 0, VP_SIM_WORKER);
  uint64_t ps = o.page_size;
  o.lookahead = ps;
  vp_device_t dev = test_open_cap(ctx, &o, 16);
  vp_vbar_t v = test_vbar(dev, 3 * ps);
  /* Each source in its own mapping, so a late read of a freed one faults
   * in every build. */
  unsigned char *src[3];
  vp_source_t srcs[3];
  uint64_t off[3] = {0, ps, 2 * ps}, sz[3] = {ps, ps, ps};
  for (int i = 0; i < 3; i++) {
    src[i] = mmap(NULL, ps, PROT_READ | PROT_WRITE,
                  MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_TRUE(src[i] != MAP_FAILED);
    test_pattern(src[i], ps, 50 + i);
    srcs[i] = (vp_source_t){.kind = VP_SOURCE_HOST, .host = src[i]};
  }
  vp_weight_t w[3];
  ASSERT_OK(vp_weights_create(v, 3, off, sz, srcs, w));
  ASSERT_OK(vp_vbar_set_watermark(v, 0));
  vp_stream_t a = 0, b = 0;
  ASSERT_OK(vp_stream_create(dev, &a));
  ASSERT_OK(vp_stream_create(dev, &b));
  uint64_t p = 0;
  uint8_t f = 0;
  /* w0 staged (slot 0), its reader sleeps on a; prefetch stages w1. */
  ASSERT_OK(vp_acquire(dev, &w[0], 1, a, &p, &f));
  slow_t k = {.ptr = p, .size = ps, .ms = 150, .expect = src[0]};
  ASSERT_OK(vp_sim_launch(dev, a, slow_fn, &k));
  ASSERT_OK(vp_release(dev, &w[0], 1, a));
  /* w1 (prefetched) acquired; its prefetch of w2 must reuse w0's slot,
   * so the copy stream waits for the reader on a. */
  ASSERT_OK(vp_acquire(dev, &w[1], 1, b, &p, &f));
  ASSERT_OK(vp_release(dev, &w[1], 1, b));
  test_log("ring waits %" PRIu64 ", prefetch %" PRIu64,
           dstats(dev).ring_waits, dstats(dev).prefetch_bytes);
  ASSERT_FALSE(slow_done(&k));
  ASSERT_OK(vp_weight_destroy(w[2]));
  ASSERT_EQ_INT(munmap(src[2], ps), 0); /* the caller's right now */
  ASSERT_OK(vp_stream_synchronize(dev, a));
  ASSERT_OK(vp_stream_synchronize(dev, b));
  ASSERT_OK(vp_device_close(dev));
  munmap(src[0], ps);
  munmap(src[1], ps);
}

/* ------------------------------------------------------------------ move */

/* vp_weights_move: weights left in place keep their fill (no copy), moved
 * ones are filled anew at their new place, two may swap places in one
 * call; bad calls change nothing. */
TEST(weights_move, TEST_ALL_BACKENDS) {
  vp_options_t o;
  sopts(ctx, &o, 2, 0, VP_SIM_SYNC);
  uint64_t ps = o.page_size;
  vp_device_t dev = test_open_cap(ctx, &o, 16);
  vp_vbar_t v = test_vbar(dev, 8 * ps), other = test_vbar(dev, 2 * ps);
  uint64_t base = test_vbar_base(v);
  unsigned char *src = malloc(4 * ps);
  ASSERT_NOT_NULL(src);
  test_pattern(src, 4 * ps, 31);
  uint64_t off[4] = {0, ps, 2 * ps, 3 * ps}, sz[4] = {ps, ps, ps, ps / 2};
  vp_source_t srcs[4];
  for (int i = 0; i < 4; i++)
    srcs[i] = (vp_source_t){.kind = VP_SOURCE_HOST, .host = src + i * ps};
  vp_weight_t w[4], x;
  ASSERT_OK(vp_weights_create(v, 4, off, sz, srcs, w));
  uint64_t xoff = 0;
  ASSERT_OK(vp_weights_create(other, 1, &xoff, sz, srcs, &x));
  uint64_t ptrs[4];
  uint8_t fl[4];
  ASSERT_OK(vp_acquire(dev, w, 4, 0, ptrs, fl));
  ASSERT_OK(vp_release(dev, w, 4, 0));
  uint64_t fills = dstats(dev).weight_fills;

  /* Bad calls: nothing moves. */
  uint64_t to[4] = {0, 5 * ps, 4 * ps, 3 * ps};
  vp_weight_t twice[2] = {w[1], w[1]}, foreign[2] = {w[1], x};
  ASSERT_RC(vp_weights_move(v, 0, w, to), VP_EINVAL);
  ASSERT_RC(vp_weights_move(v, 1, NULL, to), VP_EINVAL);
  ASSERT_RC(vp_weights_move(v, 1, w, NULL), VP_EINVAL);
  ASSERT_RC(vp_weights_move((vp_vbar_t){0}, 1, w, to), VP_EHANDLE);
  ASSERT_RC(vp_weights_move(v, 2, twice, &to[1]), VP_EINVAL);
  ASSERT_RC(vp_weights_move(v, 2, foreign, &to[1]), VP_EINVAL);
  uint64_t onto[1] = {3 * ps + 8}; /* over w[3], which is not listed */
  ASSERT_RC(vp_weights_move(v, 1, &w[1], onto), VP_EINVAL);
  uint64_t past[1] = {7 * ps + 1};
  ASSERT_RC(vp_weights_move(v, 1, &w[1], past), VP_ERANGE);
  ASSERT_OK(vp_acquire(dev, &w[2], 1, 0, ptrs, fl));
  ASSERT_RC(vp_weights_move(v, 4, w, to), VP_EBUSY);
  ASSERT_OK(vp_release(dev, &w[2], 1, 0));
  ASSERT_OK(vp_acquire(dev, w, 4, 0, ptrs, fl));
  for (int i = 0; i < 4; i++) {
    ASSERT_EQ_INT(fl[i], VP_ACQUIRED_RESIDENT);
    ASSERT_EQ_U64(ptrs[i], base + off[i]);
  }
  ASSERT_OK(vp_release(dev, w, 4, 0));
  ASSERT_EQ_U64(dstats(dev).weight_fills, fills);

  /* w[0], w[3] stay; w[1] and w[2] move past them; then w[1] and w[2]
   * swap places in one call. */
  for (int round = 0; round < 2; round++) {
    if (round == 1) {
      to[1] = 4 * ps;
      to[2] = 5 * ps;
    }
    vp_weight_t order[4] = {w[3], w[0], w[2], w[1]};
    uint64_t oto[4] = {to[3], to[0], to[2], to[1]};
    ASSERT_OK(vp_weights_move(v, 4, order, oto));
    ASSERT_OK(vp_acquire(dev, w, 4, 0, ptrs, fl));
    for (int i = 0; i < 4; i++) {
      bool moved = i == 1 || i == 2;
      ASSERT_EQ_U64(ptrs[i], base + to[i]);
      ASSERT_EQ_INT(fl[i] & VP_ACQUIRED_COPIED, moved ? VP_ACQUIRED_COPIED
                                                      : 0);
      verify_resident(dev, 0, ptrs[i], src + i * ps, sz[i]);
    }
    ASSERT_OK(vp_release(dev, w, 4, 0));
    fills += 2;
    ASSERT_EQ_U64(dstats(dev).weight_fills, fills);
  }
  /* Moved onto resident pages of its own, the fill still is anew. */
  ASSERT_OK(vp_weights_move(v, 1, &w[1], &off[1]));
  ASSERT_OK(vp_acquire(dev, &w[1], 1, 0, ptrs, fl));
  ASSERT_EQ_INT(fl[0], VP_ACQUIRED_RESIDENT | VP_ACQUIRED_COPIED);
  verify_resident(dev, 0, ptrs[0], src + ps, ps);
  ASSERT_OK(vp_release(dev, &w[1], 1, 0));
  ASSERT_OK(vp_device_close(dev));
  free(src);
}
