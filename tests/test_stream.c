/* Streaming: vp_acquire / vp_release and prefetch (the fixture is in
 * stream_fixture.c, the ring's tests in test_staging.c, the weights' in
 * test_weights.c).
 *
 * Data checks: on the simulated device a "kernel" (vp_sim_launch) queued on
 * the caller's stream compares the bytes at each acquired pointer with the
 * weight's source at the moment the stream reaches it; in worker mode the
 * copy stream and the caller's stream are different threads, so a missing
 * wait shows up as wrong bytes (and as a race under TSan). On CUDA staged
 * pointers cannot be read through the API, so resident weights are read
 * back with vp_copy_to_host while acquired (their pages are pinned). */
#include "stream_fixture.h"

/* ---------------------------------------------------------------- basics */

TEST(stream_basic, TEST_ALL_BACKENDS) {
  vp_options_t o;
  sopts(ctx, &o, 4, 0, VP_SIM_SYNC);
  vp_device_t dev = test_open_cap(ctx, &o, 16);
  uint64_t ps = o.page_size, hs = ps / 2;
  vp_stream_t s = 0;
  ASSERT_OK(vp_stream_create(dev, &s));
  model_t m;
  model_uniform(&m, dev, 8 * ps, 16, hs, SRC_SCATTER, 1);
  vp_stats_t s0 = dstats(dev);
  ASSERT_EQ_U64(s0.acquires, 0);

  /* Pass 1: every weight is committed and filled in place. */
  for (size_t l = 0; l < 8; l++) {
    uint64_t ptrs[2] = {0};
    uint8_t fl[2] = {0};
    ASSERT_OK(vp_acquire(dev, &m.w[2 * l], 2, s, ptrs, fl));
    for (int j = 0; j < 2; j++) {
      size_t i = 2 * l + j;
      ASSERT_EQ_INT(fl[j], VP_ACQUIRED_RESIDENT | VP_ACQUIRED_COPIED);
      ASSERT_EQ_U64(ptrs[j], m.base + m.off[i]);
      verify_resident(dev, s, ptrs[j], m.srcs[i].host, hs);
    }
    ASSERT_EQ_INT(test_resid(m.v, l), VP_PAGE_RESIDENT | VP_PAGE_PINNED);
    ASSERT_OK(vp_release(dev, &m.w[2 * l], 2, s));
    ASSERT_EQ_INT(test_resid(m.v, l), VP_PAGE_RESIDENT);
  }
  vp_stats_t s1 = dstats(dev);
  ASSERT_EQ_U64(s1.acquires, 16);
  ASSERT_EQ_U64(s1.weight_fills, 16);
  ASSERT_EQ_U64(s1.fill_bytes, 16 * hs);
  ASSERT_EQ_U64(s1.weight_staged, 0);
  ASSERT_EQ_U64(s1.staged_bytes, 0);
  ASSERT_EQ_U64(s1.copies, 16); /* scattered sources: no merging */
  ASSERT_GE_U64(s1.stream_waits, 8);
  ASSERT_EQ_U64(s1.prefetch_bytes, 0);
  vp_stats_t vs = test_vbar_stats(m.v);
  ASSERT_EQ_U64(vs.acquires, 16);
  ASSERT_EQ_U64(vs.weight_fills, 16);
  ASSERT_EQ_STR(test_map(m.v), "########");

  /* Pass 2: everything resident and filled: no copy at all. */
  for (size_t l = 0; l < 8; l++) {
    uint64_t ptrs[2] = {0};
    uint8_t fl[2] = {0xff, 0xff};
    ASSERT_OK(vp_acquire(dev, &m.w[2 * l], 2, s, ptrs, fl));
    for (int j = 0; j < 2; j++) {
      ASSERT_EQ_INT(fl[j], VP_ACQUIRED_RESIDENT);
      ASSERT_EQ_U64(ptrs[j], m.base + m.off[2 * l + j]);
      verify_resident(dev, s, ptrs[j], m.srcs[2 * l + j].host, hs);
    }
    ASSERT_OK(vp_release(dev, &m.w[2 * l], 2, s));
  }
  vp_stats_t s2 = dstats(dev);
  ASSERT_EQ_U64(s2.acquires, 32);
  ASSERT_EQ_U64(s2.weight_fills, s1.weight_fills);
  ASSERT_EQ_U64(s2.fill_bytes, s1.fill_bytes);
  ASSERT_EQ_U64(s2.copies, s1.copies);
  ASSERT_EQ_U64(s2.stream_waits, s1.stream_waits); /* copies were done */

  /* Evict everything: the watermark falls to 0, every weight is a miss and
   * goes through the staging ring. */
  ASSERT_OK(vp_vbar_free_memory(m.v, 8 * ps, NULL));
  ASSERT_EQ_STR(test_map(m.v), "........");
  uint64_t sp[2] = {0};
  uint8_t sf[2] = {0};
  ASSERT_OK(vp_acquire(dev, &m.w[0], 2, s, sp, sf));
  for (int j = 0; j < 2; j++) {
    ASSERT_EQ_INT(sf[j], VP_ACQUIRED_STAGED | VP_ACQUIRED_COPIED);
    ASSERT_FALSE(in_vbar(&m, sp[j]));
    ASSERT_EQ_U64(sp[j] % 256, 0);
    if (is_sim(ctx)) verify_staged_sim(dev, s, sp[j], m.srcs[j].host, hs);
  }
  ASSERT_NE_U64(sp[0], sp[1]);
  ASSERT_EQ_STR(test_map(m.v), "........");
  vp_stats_t s3 = dstats(dev);
  ASSERT_EQ_U64(s3.acquires, 34);
  ASSERT_EQ_U64(s3.weight_staged, 2);
  ASSERT_EQ_U64(s3.staged_bytes, 2 * hs);
  ASSERT_EQ_U64(s3.copies, s2.copies + 2);
  ASSERT_EQ_U64(s3.weight_fills, s2.weight_fills);
  ASSERT_OK(vp_release(dev, &m.w[0], 2, s));

  /* Acquired again while the ring still holds them: no copy. */
  uint64_t sp2[2] = {0};
  uint8_t sf2[2] = {0};
  ASSERT_OK(vp_acquire(dev, &m.w[0], 2, s, sp2, sf2));
  for (int j = 0; j < 2; j++) {
    ASSERT_EQ_INT(sf2[j], VP_ACQUIRED_STAGED);
    ASSERT_EQ_U64(sp2[j], sp[j]);
    if (is_sim(ctx)) verify_staged_sim(dev, s, sp2[j], m.srcs[j].host, hs);
  }
  vp_stats_t s4 = dstats(dev);
  ASSERT_EQ_U64(s4.weight_staged, 2);
  ASSERT_EQ_U64(s4.copies, s3.copies);
  ASSERT_OK(vp_release(dev, &m.w[0], 2, s));

  /* Watermark lifted: resident again, refilled (new generations). */
  ASSERT_OK(vp_vbar_prioritize(m.v));
  uint64_t rp[2] = {0};
  uint8_t rf[2] = {0};
  ASSERT_OK(vp_acquire(dev, &m.w[0], 2, s, rp, rf));
  for (int j = 0; j < 2; j++) {
    ASSERT_EQ_INT(rf[j], VP_ACQUIRED_RESIDENT | VP_ACQUIRED_COPIED);
    verify_resident(dev, s, rp[j], m.srcs[j].host, hs);
  }
  ASSERT_EQ_U64(dstats(dev).weight_fills, s4.weight_fills + 2);
  ASSERT_OK(vp_release(dev, &m.w[0], 2, s));
  ASSERT_FALSE(map_has_pin(m.v));
  ASSERT_OK(vp_stream_destroy(dev, s));
  ASSERT_OK(vp_device_close(dev));
  model_free(&m);
}

/* -------------------------------------------------------------- ordering */

static void ordering_run(test_ctx_t *ctx, uint64_t lookahead_pages,
                         uint64_t seed) {
  vp_options_t o;
  sopts(ctx, &o, 4, 0, VP_SIM_WORKER);
  uint64_t ps = o.page_size;
  o.lookahead = lookahead_pages * ps;
  vp_device_t dev = test_open_cap(ctx, &o, 12);
  test_rng_t rng;
  test_rng_seed(&rng, seed);
  model_t m;
  model_random(&m, dev, 20 * ps, ps / 8, 3 * ps / 4, SRC_CONTIG, &rng, seed);
  vp_stream_t s = 0;
  ASSERT_OK(vp_stream_create(dev, &s));
  checks_t c = {0};
  uint64_t passes = test_scale(20);
  for (uint64_t pass = 0; pass < passes; pass++) {
    test_note("lookahead %" PRIu64 " pages, pass %" PRIu64, lookahead_pages,
              pass);
    if (pass && test_rand_below(&rng, 2)) {
      /* Some pages are recommitted: resident weights need refills. */
      ASSERT_OK(vp_vbar_free_memory(m.v, (1 + test_rand_below(&rng, 6)) * ps,
                                    NULL));
      ASSERT_OK(vp_vbar_prioritize(m.v));
    }
    for (size_t i = 0; i < m.n;) {
      size_t k = 1 + test_rand_below(&rng, 3);
      if (i + k > m.n) k = m.n - i;
      uint64_t ptrs[3] = {0};
      uint8_t fl[3] = {0};
      ASSERT_OK(vp_acquire(dev, &m.w[i], k, s, ptrs, fl));
      for (size_t j = 0; j < k; j++) {
        ASSERT_TRUE(fl[j] & (VP_ACQUIRED_RESIDENT | VP_ACQUIRED_STAGED));
        launch_check(dev, s, ptrs[j], m.srcs[i + j].host, m.size[i + j], &c);
      }
      ASSERT_OK(vp_release(dev, &m.w[i], k, s));
      i += k;
    }
  }
  checks_expect_clean(dev, s, &c);
  vp_stats_t st = dstats(dev);
  /* With a long lookahead, prefetch may stage and fill everything ahead. */
  ASSERT_GT_U64(st.weight_staged + st.weight_fills + st.prefetch_bytes, 0);
  ASSERT_GT_U64(st.stream_waits, 0);
  if (lookahead_pages) {
    ASSERT_GT_U64(st.prefetch_bytes, 0);
  } else {
    ASSERT_GT_U64(st.weight_staged, 0);
    ASSERT_EQ_U64(st.prefetch_bytes, 0);
  }
  test_log("lookahead %" PRIu64 ": %" PRIu64 " checks, staged %" PRIu64
           ", fills %" PRIu64 ", copies %" PRIu64 ", ring waits %" PRIu64
           ", prefetch %" PRIu64 " used %" PRIu64,
           lookahead_pages, (uint64_t)atomic_load(&c.runs), st.weight_staged,
           st.weight_fills, st.copies, st.ring_waits, st.prefetch_bytes,
           st.prefetch_used_bytes);
  ASSERT_OK(vp_stream_destroy(dev, s));
  ASSERT_OK(vp_device_close(dev));
  model_free(&m);
}

TEST(stream_ordering_worker, TEST_SIM_ONLY) {
  uint64_t seed = test_seed();
  test_note("seed %" PRIu64, seed);
  ordering_run(ctx, 0, seed);
  ordering_run(ctx, 1, seed + 1);
  ordering_run(ctx, 64, seed + 2);
}

/* ------------------------------------------------------ random integrity */

typedef struct held {
  size_t n;
  int vb[4];
  size_t idx[4];
  uint64_t ptr[4];
  uint8_t fl[4];
} held_t;

static void integrity_run(test_ctx_t *ctx, int sim_streams, uint64_t seed) {
  test_note("seed %" PRIu64 ", %s streams", seed,
            sim_streams == VP_SIM_WORKER ? "worker" : "sync");
  bool sim = is_sim(ctx);
  vp_options_t o;
  sopts(ctx, &o, 6, 0, sim_streams);
  uint64_t ps = o.page_size;
  const uint64_t cap = 16;
  vp_device_t dev = test_open_cap(ctx, &o, cap);
  int64_t base_headroom = test_info(dev).headroom;
  test_rng_t rng;
  test_rng_seed(&rng, seed);
  model_t m[2];
  model_random(&m[0], dev, 12 * ps, ps / 16, ps / 3, SRC_SCATTER, &rng,
               seed * 2);
  model_random(&m[1], dev, 8 * ps, ps / 16, ps / 3, SRC_CONTIG, &rng,
               seed * 2 + 1);
  vp_stream_t s = 0;
  ASSERT_OK(vp_stream_create(dev, &s));

  /* Open the staging ring now (a miss), so later squeezes cannot keep it
   * from being allocated. */
  ASSERT_OK(vp_vbar_set_watermark(m[0].v, 0));
  {
    uint64_t p = 0;
    uint8_t f = 0;
    ASSERT_OK(vp_acquire(dev, &m[0].w[0], 1, s, &p, &f));
    ASSERT_EQ_INT(f, VP_ACQUIRED_STAGED | VP_ACQUIRED_COPIED);
    ASSERT_OK(vp_release(dev, &m[0].w[0], 1, s));
    ASSERT_OK(vp_vbar_prioritize(m[0].v));
  }

  checks_t c = {0};
  held_t held[2];
  memset(held, 0, sizeof held);
  size_t nheld = 0, cursor[2] = {0, 0};
  uint64_t steps = test_scale(1500), acquired = 0, shared = 0;
  for (uint64_t step = 0; step < steps; step++) {
    test_note("seed %" PRIu64 ", %s streams, step %" PRIu64, seed,
              sim_streams == VP_SIM_WORKER ? "worker" : "sync", step);
    int r = (int)test_rand_below(&rng, 100);
    int which = (int)test_rand_below(&rng, 2);
    if (r < 6) {
      ASSERT_OK(vp_device_set_headroom(
          dev, base_headroom + (int64_t)(test_rand_below(&rng, 10) * ps)));
    } else if (r < 10 && sim) {
      ASSERT_OK(vp_sim_inject(dev, VP_SIM_SET_CAPACITY,
                              (6 + test_rand_below(&rng, 14)) * ps));
    } else if (r < 18) {
      uint64_t freed = 0;
      ASSERT_OK(vp_vbar_free_memory(m[which].v,
                                    (1 + test_rand_below(&rng, 6)) * ps,
                                    &freed));
    } else if (r < 22) {
      ASSERT_OK(vp_device_free_memory(dev, (1 + test_rand_below(&rng, 8)) * ps,
                                      NULL));
    } else if (r < 32) {
      ASSERT_OK(vp_vbar_prioritize(m[which].v));
    } else if (r < 35) {
      ASSERT_OK(vp_vbar_deprioritize(m[which].v));
    } else if (r < 40) {
      static const uint64_t la[] = {0, 1, 4}; /* half pages */
      ASSERT_OK(vp_device_set_lookahead(
          dev, la[test_rand_below(&rng, 3)] * ps / 2));
    } else {
      /* A layer: the next 1-3 weights of one VBAR, sometimes plus a weight
       * another held layer has acquired too (shared). */
      model_t *mm = &m[which];
      held_t h = {0};
      size_t k = 1 + test_rand_below(&rng, 3);
      for (size_t j = 0; j < k; j++) {
        h.vb[h.n] = which;
        h.idx[h.n++] = cursor[which];
        cursor[which] = (cursor[which] + 1) % mm->n;
      }
      if (nheld && test_rand_below(&rng, 3) == 0) {
        const held_t *o2 = &held[test_rand_below(&rng, nheld)];
        size_t pick = test_rand_below(&rng, o2->n);
        bool dup = false;
        for (size_t j = 0; j < h.n; j++)
          dup |= h.vb[j] == o2->vb[pick] && h.idx[j] == o2->idx[pick];
        if (!dup) {
          h.vb[h.n] = o2->vb[pick];
          h.idx[h.n++] = o2->idx[pick];
          shared++;
        }
      }
      vp_weight_t ws[4];
      for (size_t j = 0; j < h.n; j++) ws[j] = m[h.vb[j]].w[h.idx[j]];
      /* At most two layers (8 weights of <= ps/3) are held, so however
       * they lie in the 6-page ring a gap of ps/3 is left: no VP_ELIMIT. */
      ASSERT_OK(vp_acquire(dev, ws, h.n, s, h.ptr, h.fl));
      acquired += h.n;
      for (size_t j = 0; j < h.n; j++) {
        model_t *wm = &m[h.vb[j]];
        size_t i = h.idx[j];
        ASSERT_EQ_INT(!!(h.fl[j] & VP_ACQUIRED_RESIDENT) +
                          !!(h.fl[j] & VP_ACQUIRED_STAGED), 1);
        ASSERT_FALSE(h.fl[j] & VP_ACQUIRED_EMPTY);
        if (h.fl[j] & VP_ACQUIRED_RESIDENT)
          ASSERT_EQ_U64(h.ptr[j], wm->base + wm->off[i]);
        if (sim)
          launch_check(dev, s, h.ptr[j], wm->srcs[i].host, wm->size[i], &c);
        else
          verify_acquired(ctx, dev, s, h.ptr[j], h.fl[j], wm->srcs[i].host,
                          wm->size[i]);
      }
      held[nheld++] = h;
      /* Keep at most one layer held across steps, sometimes none. */
      while (nheld > 1 || (nheld && test_rand_below(&rng, 3) == 0)) {
        vp_weight_t rw[4];
        for (size_t j = 0; j < held[0].n; j++)
          rw[j] = m[held[0].vb[j]].w[held[0].idx[j]];
        ASSERT_OK(vp_release(dev, rw, held[0].n, s));
        held[0] = held[1];
        nheld--;
      }
    }
  }
  for (size_t t = 0; t < nheld; t++) {
    vp_weight_t rw[4];
    for (size_t j = 0; j < held[t].n; j++)
      rw[j] = m[held[t].vb[j]].w[held[t].idx[j]];
    ASSERT_OK(vp_release(dev, rw, held[t].n, s));
  }
  if (sim) checks_expect_clean(dev, s, &c);
  ASSERT_OK(vp_stream_synchronize(dev, s));
  ASSERT_FALSE(map_has_pin(m[0].v));
  ASSERT_FALSE(map_has_pin(m[1].v));
  /* No staging slot stayed referenced: with everything released and the
   * headroom back, stream the whole of m[1] through the ring twice, one
   * weight at a time. */
  test_note("seed %" PRIu64 ", final ring sweep", seed);
  ASSERT_OK(vp_device_set_headroom(dev, base_headroom));
  if (sim) ASSERT_OK(vp_sim_inject(dev, VP_SIM_SET_CAPACITY, cap * ps));
  ASSERT_OK(vp_device_set_lookahead(dev, 0));
  ASSERT_OK(vp_vbar_free_memory(m[1].v, 8 * ps, NULL));
  ASSERT_OK(vp_vbar_set_watermark(m[1].v, 0));
  for (size_t i = 0; i < 2 * m[1].n; i++) {
    size_t j = i % m[1].n;
    uint64_t p = 0;
    uint8_t f = 0;
    ASSERT_OK(vp_acquire(dev, &m[1].w[j], 1, s, &p, &f));
    ASSERT_TRUE(f & VP_ACQUIRED_STAGED);
    if (sim) launch_check(dev, s, p, m[1].srcs[j].host, m[1].size[j], &c);
    ASSERT_OK(vp_release(dev, &m[1].w[j], 1, s));
  }
  if (sim) checks_expect_clean(dev, s, &c);
  vp_stats_t st = dstats(dev);
  ASSERT_EQ_U64(st.acquires, acquired + 1 + 2 * m[1].n);
  ASSERT_GT_U64(st.weight_staged, 1);
  ASSERT_GT_U64(st.weight_fills, 0);
  test_log("%s: %" PRIu64 " acquires (%" PRIu64 " shared), staged %" PRIu64
           ", fills %" PRIu64 ", copies %" PRIu64 ", ring waits %" PRIu64
           ", evicted %" PRIu64,
           sim_streams == VP_SIM_WORKER ? "worker" : "sync", st.acquires,
           shared, st.weight_staged, st.weight_fills, st.copies, st.ring_waits,
           st.pages_evicted);
  /* Weights can be destroyed now, and the VBARs with the rest. */
  ASSERT_OK(vp_weight_destroy(m[0].w[0]));
  ASSERT_OK(vp_vbar_destroy(m[0].v));
  ASSERT_OK(vp_vbar_destroy(m[1].v));
  ASSERT_OK(vp_stream_destroy(dev, s));
  ASSERT_OK(vp_device_close(dev));
  model_free(&m[0]);
  model_free(&m[1]);
}

TEST(stream_integrity_random, TEST_ALL_BACKENDS) {
  uint64_t seed = test_seed();
  integrity_run(ctx, VP_SIM_SYNC, seed);
  if (is_sim(ctx)) integrity_run(ctx, VP_SIM_WORKER, seed + 17);
}

/* -------------------------------------------------------------- prefetch */

TEST(stream_prefetch, TEST_ALL_BACKENDS) {
  vp_options_t o;
  sopts(ctx, &o, 4, 0, VP_SIM_SYNC);
  uint64_t ps = o.page_size, hs = ps / 2;
  o.lookahead = ps; /* one layer of two weights */
  vp_device_t dev = test_open_cap(ctx, &o, 16);
  model_t m;
  model_uniform(&m, dev, 8 * ps, 16, hs, SRC_SCATTER, 5);
  uint64_t ptrs[2];
  uint8_t fl[2];

  /* Resident: layer 0 is filled by its acquire, layer 1 by prefetch. */
  ASSERT_OK(vp_acquire(dev, m.w, 2, 0, ptrs, fl));
  ASSERT_EQ_INT(fl[0], VP_ACQUIRED_RESIDENT | VP_ACQUIRED_COPIED);
  vp_stats_t st = dstats(dev);
  ASSERT_EQ_U64(st.weight_fills, 2);
  ASSERT_EQ_U64(st.prefetch_bytes, ps);
  ASSERT_EQ_U64(st.copies, 4);
  ASSERT_EQ_STR(test_map(m.v), "P#......");
  ASSERT_OK(vp_release(dev, m.w, 2, 0));
  for (size_t l = 1; l < 8; l++) {
    test_note("resident layer %zu", l);
    vp_stats_t before = dstats(dev);
    ASSERT_EQ_INT(test_resid(m.v, l), VP_PAGE_RESIDENT); /* prefetched */
    ASSERT_OK(vp_acquire(dev, &m.w[2 * l], 2, 0, ptrs, fl));
    vp_stats_t after = dstats(dev);
    for (int j = 0; j < 2; j++) {
      ASSERT_EQ_INT(fl[j], VP_ACQUIRED_RESIDENT | VP_ACQUIRED_COPIED);
      verify_resident(dev, 0, ptrs[j], m.srcs[2 * l + j].host, hs);
    }
    ASSERT_EQ_U64(after.weight_fills, before.weight_fills);
    ASSERT_EQ_U64(after.prefetch_used_bytes, before.prefetch_used_bytes + ps);
    /* The only copies are the next layer's prefetch (none after the last
     * layer: layer 0 is still resident and filled). */
    uint64_t next = l < 7 ? ps : 0;
    ASSERT_EQ_U64(after.prefetch_bytes, before.prefetch_bytes + next);
    ASSERT_EQ_U64(after.copies, before.copies + next / hs);
    if (l < 7) ASSERT_EQ_INT(test_resid(m.v, l + 1), VP_PAGE_RESIDENT);
    ASSERT_OK(vp_release(dev, &m.w[2 * l], 2, 0));
  }
  st = dstats(dev);
  ASSERT_EQ_U64(st.prefetch_used_bytes, st.prefetch_bytes);
  ASSERT_EQ_U64(st.prefetch_dropped_bytes, 0);

  /* Second pass, all resident: no copies, no prefetch, flags plain. */
  for (size_t l = 0; l < 8; l++) {
    ASSERT_OK(vp_acquire(dev, &m.w[2 * l], 2, 0, ptrs, fl));
    ASSERT_EQ_INT(fl[0], VP_ACQUIRED_RESIDENT);
    ASSERT_EQ_INT(fl[1], VP_ACQUIRED_RESIDENT);
    ASSERT_OK(vp_release(dev, &m.w[2 * l], 2, 0));
  }
  vp_stats_t st2 = dstats(dev);
  ASSERT_EQ_U64(st2.copies, st.copies);
  ASSERT_EQ_U64(st2.prefetch_bytes, st.prefetch_bytes);

  /* Staged: every weight a miss; the next layer is staged ahead. */
  ASSERT_OK(vp_vbar_free_memory(m.v, 8 * ps, NULL));
  ASSERT_EQ_U64(test_watermark(m.v), 0);
  ASSERT_OK(vp_acquire(dev, m.w, 2, 0, ptrs, fl));
  ASSERT_EQ_INT(fl[0], VP_ACQUIRED_STAGED | VP_ACQUIRED_COPIED);
  if (is_sim(ctx)) verify_staged_sim(dev, 0, ptrs[0], m.srcs[0].host, hs);
  ASSERT_EQ_U64(dstats(dev).prefetch_bytes, st2.prefetch_bytes + ps);
  ASSERT_OK(vp_release(dev, m.w, 2, 0));
  for (size_t l = 1; l < 8; l++) {
    test_note("staged layer %zu", l);
    vp_stats_t before = dstats(dev);
    ASSERT_OK(vp_acquire(dev, &m.w[2 * l], 2, 0, ptrs, fl));
    vp_stats_t after = dstats(dev);
    for (int j = 0; j < 2; j++) {
      ASSERT_EQ_INT(fl[j], VP_ACQUIRED_STAGED | VP_ACQUIRED_COPIED);
      if (is_sim(ctx))
        verify_staged_sim(dev, 0, ptrs[j], m.srcs[2 * l + j].host, hs);
    }
    ASSERT_EQ_U64(after.weight_staged, before.weight_staged);
    ASSERT_EQ_U64(after.prefetch_used_bytes, before.prefetch_used_bytes + ps);
    ASSERT_EQ_U64(after.copies - before.copies,
                  (after.prefetch_bytes - before.prefetch_bytes) / hs);
    ASSERT_OK(vp_release(dev, &m.w[2 * l], 2, 0));
  }
  ASSERT_FALSE(map_has_pin(m.v));
  ASSERT_OK(vp_device_close(dev));
  model_free(&m);

  /* Lookahead 0: nothing is prefetched, until it is turned on. */
  sopts(ctx, &o, 4, 0, VP_SIM_SYNC);
  dev = test_open_cap(ctx, &o, 16);
  model_uniform(&m, dev, 8 * ps, 16, hs, SRC_SCATTER, 6);
  for (size_t l = 0; l < 8; l++) {
    ASSERT_OK(vp_acquire(dev, &m.w[2 * l], 2, 0, ptrs, fl));
    ASSERT_OK(vp_release(dev, &m.w[2 * l], 2, 0));
  }
  st = dstats(dev);
  ASSERT_EQ_U64(st.prefetch_bytes, 0);
  ASSERT_EQ_U64(st.copies, 16);
  ASSERT_OK(vp_vbar_free_memory(m.v, 8 * ps, NULL));
  ASSERT_OK(vp_vbar_prioritize(m.v));
  ASSERT_OK(vp_device_set_lookahead(dev, ps));
  ASSERT_OK(vp_acquire(dev, m.w, 2, 0, ptrs, fl));
  ASSERT_EQ_U64(dstats(dev).prefetch_bytes, ps);
  ASSERT_OK(vp_release(dev, m.w, 2, 0));
  ASSERT_OK(vp_device_set_lookahead(dev, 0));
  uint64_t pb = dstats(dev).prefetch_bytes;
  ASSERT_OK(vp_acquire(dev, &m.w[2], 2, 0, ptrs, fl));
  ASSERT_EQ_INT(fl[0], VP_ACQUIRED_RESIDENT | VP_ACQUIRED_COPIED);
  ASSERT_OK(vp_release(dev, &m.w[2], 2, 0));
  ASSERT_OK(vp_acquire(dev, &m.w[4], 2, 0, ptrs, fl));
  ASSERT_OK(vp_release(dev, &m.w[4], 2, 0));
  ASSERT_EQ_U64(dstats(dev).prefetch_bytes, pb);
  ASSERT_OK(vp_device_close(dev));
  model_free(&m);
}

/* Prefetched work that is never used is counted as dropped: a staged
 * prefetch whose slot is reclaimed, and a resident prefetch whose pages are
 * evicted before the weight is acquired. */
TEST(stream_prefetch_dropped, TEST_ALL_BACKENDS) {
  vp_options_t o;
  sopts(ctx, &o, 2, 0, VP_SIM_SYNC);
  uint64_t ps = o.page_size;
  o.lookahead = ps;
  vp_device_t dev = test_open_cap(ctx, &o, 16);
  model_t m, x, y;
  model_uniform(&m, dev, 4 * ps, 4, ps, SRC_SCATTER, 17);
  model_uniform(&x, dev, 4 * ps, 4, ps, SRC_SCATTER, 18);
  model_uniform(&y, dev, ps, 1, ps, SRC_SCATTER, 19);
  uint64_t p = 0;
  uint8_t f = 0;

  /* Staged: x1 is staged ahead, then an unexpected miss takes its slot. */
  ASSERT_OK(vp_vbar_set_watermark(x.v, 0));
  ASSERT_OK(vp_vbar_set_watermark(y.v, 0));
  ASSERT_OK(vp_acquire(dev, &x.w[0], 1, 0, &p, &f));
  ASSERT_EQ_U64(dstats(dev).prefetch_bytes, ps);
  ASSERT_OK(vp_device_set_lookahead(dev, 0));
  ASSERT_OK(vp_acquire(dev, y.w, 1, 0, &p, &f)); /* the ring: x0 + y */
  ASSERT_OK(vp_release(dev, y.w, 1, 0));
  ASSERT_OK(vp_release(dev, &x.w[0], 1, 0));
  ASSERT_EQ_U64(dstats(dev).prefetch_dropped_bytes, ps);
  ASSERT_OK(vp_acquire(dev, &x.w[1], 1, 0, &p, &f));
  ASSERT_EQ_INT(f, VP_ACQUIRED_STAGED | VP_ACQUIRED_COPIED);
  if (is_sim(ctx)) verify_staged_sim(dev, 0, p, x.srcs[1].host, ps);
  ASSERT_OK(vp_release(dev, &x.w[1], 1, 0));
  vp_stats_t st = dstats(dev);
  ASSERT_EQ_U64(st.prefetch_used_bytes, 0);
  ASSERT_EQ_U64(st.weight_staged, 3);

  /* Resident: m1 is filled ahead, then evicted before use. */
  ASSERT_OK(vp_device_set_lookahead(dev, ps));
  ASSERT_OK(vp_acquire(dev, &m.w[0], 1, 0, &p, &f));
  ASSERT_EQ_U64(dstats(dev).prefetch_bytes, 2 * ps);
  ASSERT_OK(vp_device_set_lookahead(dev, 0));
  ASSERT_OK(vp_release(dev, &m.w[0], 1, 0));
  ASSERT_OK(vp_vbar_free_memory(m.v, ps, NULL)); /* page 1: m1's */
  ASSERT_EQ_STR(test_map(m.v), "#...");
  ASSERT_OK(vp_vbar_prioritize(m.v));
  ASSERT_OK(vp_acquire(dev, &m.w[1], 1, 0, &p, &f));
  ASSERT_EQ_INT(f, VP_ACQUIRED_RESIDENT | VP_ACQUIRED_COPIED);
  verify_resident(dev, 0, p, m.srcs[1].host, ps);
  ASSERT_OK(vp_release(dev, &m.w[1], 1, 0));
  st = dstats(dev);
  ASSERT_EQ_U64(st.prefetch_used_bytes, 0);
  /* Every prefetched byte was either used or dropped. */
  ASSERT_EQ_U64(st.prefetch_dropped_bytes, 2 * ps);
  ASSERT_EQ_U64(st.prefetch_bytes,
                st.prefetch_used_bytes + st.prefetch_dropped_bytes);
  ASSERT_OK(vp_device_close(dev));
  model_free(&m);
  model_free(&x);
  model_free(&y);
}

/* A device whose prefetch looks one page ahead; *ps gets its page size. */
static vp_device_t one_page_lookahead(test_ctx_t *ctx, uint64_t *ps) {
  vp_options_t o;
  sopts(ctx, &o, 4, 0, VP_SIM_SYNC);
  *ps = o.page_size;
  o.lookahead = *ps;
  return test_open_cap(ctx, &o, 16);
}

/* Prefetch wraps around to the start of the VBAR for the next pass. */
TEST(stream_prefetch_wraps, TEST_ALL_BACKENDS) {
  uint64_t ps;
  vp_device_t dev = one_page_lookahead(ctx, &ps);
  model_t m;
  model_uniform(&m, dev, 4 * ps, 4, ps, SRC_SCATTER, 8);
  uint64_t p = 0;
  uint8_t f = 0;
  /* Acquire the last weight first: the prefetch goes to weight 0. */
  ASSERT_OK(vp_acquire(dev, &m.w[3], 1, 0, &p, &f));
  ASSERT_OK(vp_release(dev, &m.w[3], 1, 0));
  ASSERT_EQ_STR(test_map(m.v), "#..#");
  ASSERT_OK(vp_acquire(dev, &m.w[0], 1, 0, &p, &f));
  ASSERT_EQ_INT(f, VP_ACQUIRED_RESIDENT | VP_ACQUIRED_COPIED);
  verify_resident(dev, 0, p, m.srcs[0].host, ps);
  ASSERT_EQ_U64(dstats(dev).weight_fills, 1);
  ASSERT_OK(vp_release(dev, &m.w[0], 1, 0));
  ASSERT_OK(vp_device_close(dev));
  model_free(&m);
}

/* Four one-page weights created in order at VBAR pages page_of[i] (of a
 * VBAR of 4 pages), each from its page of a new host buffer whose bytes
 * are i * mul + add; *buf gets that buffer (the caller frees it). */
static vp_vbar_t four_pages(vp_device_t dev, uint64_t ps,
                            const uint64_t page_of[4], unsigned mul,
                            unsigned add, unsigned char **buf,
                            vp_weight_t w[4]) {
  vp_vbar_t v;
  ASSERT_OK(vp_vbar_create(dev, 4 * ps, &v));
  unsigned char *b = malloc(4 * ps);
  ASSERT_TRUE(b != NULL);
  for (uint64_t i = 0; i < 4 * ps; i++) b[i] = (unsigned char)(i * mul + add);
  uint64_t off[4], size[4] = {ps, ps, ps, ps};
  vp_source_t src[4];
  for (int i = 0; i < 4; i++) {
    off[i] = page_of[i] * ps;
    src[i] = (vp_source_t){.kind = VP_SOURCE_HOST, .host = b + i * ps};
  }
  ASSERT_OK(vp_weights_create(v, 4, off, size, src, w));
  *buf = b;
  return v;
}

/* Prefetch looks ahead in the order the weights were created (the order
 * of use), not by offset: weights A, B, C, D made at pages 0, 2, 1, 3. */
TEST(stream_prefetch_follows_creation_order, TEST_ALL_BACKENDS) {
  uint64_t ps;
  vp_device_t dev = one_page_lookahead(ctx, &ps);
  static const uint64_t pages[4] = {0, 2, 1, 3};
  unsigned char *buf;
  vp_weight_t w[4];
  vp_vbar_t v = four_pages(dev, ps, pages, 7, 3, &buf, w);
  uint64_t p = 0;
  uint8_t f = 0;
  static const char *after[4] = {"#.#.", "###.", "####", "####"};
  for (int i = 0; i < 4; i++) {
    test_note("weight %d", i);
    ASSERT_OK(vp_acquire(dev, &w[i], 1, 0, &p, &f));
    ASSERT_EQ_INT(f & VP_ACQUIRED_RESIDENT, VP_ACQUIRED_RESIDENT);
    verify_resident(dev, 0, p, buf + i * ps, ps);
    ASSERT_OK(vp_release(dev, &w[i], 1, 0));
    ASSERT_EQ_STR(test_map(v), after[i]); /* the next one came ahead */
  }
  ASSERT_EQ_U64(dstats(dev).weight_fills, 1); /* A; B, C, D by prefetch */
  /* Destroying one keeps the order of the others. */
  ASSERT_OK(vp_weight_destroy(w[1]));
  ASSERT_OK(vp_vbar_free_memory(v, 4 * ps, NULL));
  ASSERT_OK(vp_vbar_prioritize(v));
  ASSERT_OK(vp_acquire(dev, &w[0], 1, 0, &p, &f));
  ASSERT_OK(vp_release(dev, &w[0], 1, 0));
  ASSERT_EQ_STR(test_map(v), "##..");
  ASSERT_OK(vp_device_close(dev));
  free(buf);
}

/* vp_prefetch: the prefetch an acquire of that weight would run, with
 * nothing acquired; a no-op with lookahead 0; bad handles fail, naming the
 * call. */
TEST(stream_prefetch_without_acquire, TEST_ALL_BACKENDS) {
  uint64_t ps;
  vp_device_t dev = one_page_lookahead(ctx, &ps);
  static const uint64_t pages[4] = {0, 1, 2, 3};
  unsigned char *buf;
  vp_weight_t w[4];
  vp_vbar_t v = four_pages(dev, ps, pages, 5, 1, &buf, w);
  uint64_t p = 0;
  uint8_t f = 0;
  ASSERT_OK(vp_acquire(dev, &w[0], 1, 0, &p, &f));
  ASSERT_OK(vp_release(dev, &w[0], 1, 0));
  ASSERT_EQ_STR(test_map(v), "##..");
  /* Pages changed: the scan from w1 fills what follows it, not w1. */
  ASSERT_OK(vp_vbar_free_memory(v, 4 * ps, NULL));
  ASSERT_OK(vp_vbar_prioritize(v));
  ASSERT_OK(vp_prefetch(dev, w[1]));
  ASSERT_EQ_STR(test_map(v), "..#.");
  ASSERT_RC(vp_release(dev, &w[1], 1, 0), VP_ENOTPINNED); /* not held */
  /* w2 lies in the window that scan queued: nothing more until used. */
  ASSERT_OK(vp_prefetch(dev, w[2]));
  ASSERT_EQ_STR(test_map(v), "..#.");
  ASSERT_OK(vp_acquire(dev, &w[2], 1, 0, &p, &f));
  ASSERT_EQ_INT(f, VP_ACQUIRED_RESIDENT | VP_ACQUIRED_COPIED);
  verify_resident(dev, 0, p, buf + 2 * ps, ps);
  ASSERT_OK(vp_release(dev, &w[2], 1, 0));
  ASSERT_EQ_STR(test_map(v), "..##");
  ASSERT_EQ_U64(dstats(dev).weight_fills, 1); /* w0; w1, w2, w3 ahead */
  /* Lookahead 0: nothing. */
  ASSERT_OK(vp_vbar_free_memory(v, 4 * ps, NULL));
  ASSERT_OK(vp_device_set_lookahead(dev, 0));
  ASSERT_OK(vp_prefetch(dev, w[0]));
  ASSERT_EQ_STR(test_map(v), "....");
  /* Bad handles. */
  ASSERT_OK(vp_weight_destroy(w[3]));
  ASSERT_RC(vp_prefetch(dev, w[3]), VP_EHANDLE);
  ASSERT_TRUE(strncmp(vp_last_error(), "vp_prefetch: ", 13) == 0);
  ASSERT_RC(vp_prefetch((vp_device_t){0}, w[0]), VP_EHANDLE);
  ASSERT_OK(vp_device_close(dev));
  free(buf);
}

/* Three one-page weights A, B, C of a 3-page VBAR (B at its end, page 2)
 * over the first three of `pages` host pages of distinct bytes (the rest
 * for new sources), each acquired and released once: all resident. */
typedef struct three {
  vp_device_t dev;
  vp_vbar_t v;
  uint64_t ps;
  unsigned char *buf;
  vp_source_t src[3];
  vp_weight_t w[3];
} three_t;

static void three_weights(test_ctx_t *ctx, three_t *t, uint64_t pages) {
  vp_options_t o;
  sopts(ctx, &o, 4, 0, VP_SIM_SYNC);
  uint64_t ps = t->ps = o.page_size;
  t->dev = test_open_cap(ctx, &o, 16);
  ASSERT_OK(vp_vbar_create(t->dev, 3 * ps, &t->v));
  t->buf = malloc(pages * ps);
  ASSERT_TRUE(t->buf != NULL);
  for (uint64_t i = 0; i < pages * ps; i++)
    t->buf[i] = (unsigned char)(i * 13 + 1);
  uint64_t off[3] = {0, 2 * ps, ps}, size[3] = {ps, ps, ps};
  for (int i = 0; i < 3; i++)
    t->src[i] = (vp_source_t){.kind = VP_SOURCE_HOST, .host = t->buf + i * ps};
  ASSERT_OK(vp_weights_create(t->v, 3, off, size, t->src, t->w));
  uint64_t p = 0;
  uint8_t f = 0;
  for (int i = 0; i < 3; i++) {
    ASSERT_OK(vp_acquire(t->dev, &t->w[i], 1, 0, &p, &f));
    ASSERT_OK(vp_release(t->dev, &t->w[i], 1, 0));
  }
}

/* vp_weight_set_source: the weight's next acquire fills it from the new
 * source, the others keep their pages and fills, and it keeps its place in
 * the order prefetch looks ahead in. Bad input and a held weight fail. */
TEST(stream_weight_set_source, TEST_ALL_BACKENDS) {
  three_t t;
  three_weights(ctx, &t, 4); /* A, B, C, then B's new bytes */
  vp_device_t dev = t.dev;
  vp_vbar_t v = t.v;
  uint64_t ps = t.ps;
  unsigned char *buf = t.buf;
  vp_source_t *src = t.src;
  vp_weight_t *w = t.w;
  uint64_t p = 0;
  uint8_t f = 0;
  ASSERT_EQ_U64(dstats(dev).weight_fills, 3);
  vp_source_t nb = {.kind = VP_SOURCE_HOST, .host = buf + 3 * ps};
  ASSERT_OK(vp_weight_set_source(w[1], &nb));
  for (int i = 0; i < 3; i++) {
    test_note("weight %d", i);
    ASSERT_OK(vp_acquire(dev, &w[i], 1, 0, &p, &f));
    ASSERT_EQ_INT(f & VP_ACQUIRED_RESIDENT, VP_ACQUIRED_RESIDENT);
    ASSERT_EQ_INT(!!(f & VP_ACQUIRED_COPIED), i == 1); /* only B again */
    verify_resident(dev, 0, p, i == 1 ? buf + 3 * ps : buf + i * ps, ps);
    /* Held: its source cannot change. */
    if (i == 1) ASSERT_RC(vp_weight_set_source(w[1], &src[1]), VP_EBUSY);
    ASSERT_OK(vp_release(dev, &w[i], 1, 0));
  }
  ASSERT_EQ_U64(dstats(dev).weight_fills, 4);
  /* Its place in the order of use stays: after A comes B (page 2). */
  ASSERT_OK(vp_vbar_free_memory(v, 3 * ps, NULL));
  ASSERT_OK(vp_vbar_prioritize(v));
  ASSERT_OK(vp_device_set_lookahead(dev, ps));
  ASSERT_OK(vp_acquire(dev, &w[0], 1, 0, &p, &f));
  ASSERT_OK(vp_release(dev, &w[0], 1, 0));
  ASSERT_EQ_STR(test_map(v), "#.#");
  ASSERT_OK(vp_device_set_lookahead(dev, 0));
  ASSERT_OK(vp_acquire(dev, &w[1], 1, 0, &p, &f));
  verify_resident(dev, 0, p, buf + 3 * ps, ps); /* prefetched, new bytes */
  ASSERT_OK(vp_release(dev, &w[1], 1, 0));
  /* Bad input. */
  ASSERT_RC(vp_weight_set_source(w[0], NULL), VP_EINVAL);
  ASSERT_TRUE(strncmp(vp_last_error(), "vp_weight_set_source: ", 22) == 0);
  vp_source_t bad = {.kind = VP_SOURCE_HOST, .host = NULL};
  ASSERT_RC(vp_weight_set_source(w[0], &bad), VP_EINVAL);
  bad = (vp_source_t){.kind = 77};
  ASSERT_RC(vp_weight_set_source(w[0], &bad), VP_EINVAL);
  ASSERT_OK(vp_weight_destroy(w[2]));
  ASSERT_RC(vp_weight_set_source(w[2], &nb), VP_EHANDLE);
  ASSERT_OK(vp_device_close(dev));
  free(buf);
}

/* vp_weight_swap_source: the new source holds the bytes the weight's last
 * acquire used, so what an acquire used stays (resident pages, a staged
 * slot: no copy, the bytes as they were); what prefetch copied ahead of an
 * acquire is filled again from the new source. Bad input and a held
 * weight fail. */
TEST(stream_weight_swap_source, TEST_ALL_BACKENDS) {
  three_t t;
  three_weights(ctx, &t, 5); /* A, B, C, then two others */
  vp_device_t dev = t.dev;
  vp_vbar_t v = t.v;
  uint64_t ps = t.ps;
  unsigned char *buf = t.buf;
  vp_source_t *src = t.src;
  vp_weight_t *w = t.w;
  uint64_t p = 0;
  uint8_t f = 0;
  /* Resident: its pages stay as the acquire left them (the bytes differ
   * here only to show that nothing was copied). */
  vp_source_t d = {.kind = VP_SOURCE_HOST, .host = buf + 3 * ps};
  ASSERT_OK(vp_weight_swap_source(w[1], &d));
  ASSERT_OK(vp_acquire(dev, &w[1], 1, 0, &p, &f));
  ASSERT_EQ_INT(f, VP_ACQUIRED_RESIDENT);
  verify_resident(dev, 0, p, buf + ps, ps);
  ASSERT_RC(vp_weight_swap_source(w[1], &src[1]), VP_EBUSY);
  ASSERT_OK(vp_release(dev, &w[1], 1, 0));
  ASSERT_EQ_U64(dstats(dev).weight_fills, 3);
  /* Prefetched in place, not yet acquired: dropped, filled again. */
  ASSERT_OK(vp_vbar_free_memory(v, 3 * ps, NULL));
  ASSERT_OK(vp_vbar_prioritize(v));
  ASSERT_OK(vp_device_set_lookahead(dev, ps));
  ASSERT_OK(vp_acquire(dev, &w[0], 1, 0, &p, &f));
  ASSERT_OK(vp_release(dev, &w[0], 1, 0));
  ASSERT_EQ_STR(test_map(v), "#.#"); /* w[1] (page 2) filled ahead */
  ASSERT_OK(vp_device_set_lookahead(dev, 0));
  uint64_t dropped = dstats(dev).prefetch_dropped_bytes;
  vp_source_t e = {.kind = VP_SOURCE_HOST, .host = buf + 4 * ps};
  ASSERT_OK(vp_weight_swap_source(w[1], &e));
  ASSERT_EQ_U64(dstats(dev).prefetch_dropped_bytes, dropped + ps);
  ASSERT_OK(vp_acquire(dev, &w[1], 1, 0, &p, &f));
  ASSERT_EQ_INT(f, VP_ACQUIRED_RESIDENT | VP_ACQUIRED_COPIED);
  verify_resident(dev, 0, p, buf + 4 * ps, ps);
  ASSERT_OK(vp_release(dev, &w[1], 1, 0));
  /* Bad input. */
  ASSERT_RC(vp_weight_swap_source(w[0], NULL), VP_EINVAL);
  ASSERT_TRUE(strncmp(vp_last_error(), "vp_weight_swap_source: ", 23) == 0);
  vp_source_t bad = {.kind = VP_SOURCE_HOST, .host = NULL};
  ASSERT_RC(vp_weight_swap_source(w[0], &bad), VP_EINVAL);
  ASSERT_OK(vp_weight_destroy(w[2]));
  ASSERT_RC(vp_weight_swap_source(w[2], &d), VP_EHANDLE);
  ASSERT_OK(vp_device_close(dev));
  free(buf);
}

/* vp_weight_swap_source on a streamed weight: a slot an acquire used keeps
 * its bytes (a hit, no copy); a slot prefetch filled ahead is dropped and
 * the weight copied again from the new source. */
TEST(stream_weight_swap_source_staged, TEST_SIM_ONLY) {
  vp_options_t o;
  sopts(ctx, &o, 4, 0, VP_SIM_SYNC);
  uint64_t ps = o.page_size;
  vp_device_t dev = test_open_cap(ctx, &o, 16);
  model_t m;
  model_uniform(&m, dev, 3 * ps, 3, ps, SRC_SCATTER, 23);
  ASSERT_OK(vp_vbar_set_watermark(m.v, 0)); /* every weight streams */
  unsigned char *other = malloc(ps);
  ASSERT_TRUE(other != NULL);
  memset(other, 0x5a, ps);
  vp_source_t d = {.kind = VP_SOURCE_HOST, .host = other};
  uint64_t p = 0, q = 0;
  uint8_t f = 0;
  ASSERT_OK(vp_acquire(dev, &m.w[0], 1, 0, &p, &f));
  ASSERT_EQ_INT(f, VP_ACQUIRED_STAGED | VP_ACQUIRED_COPIED);
  ASSERT_OK(vp_release(dev, &m.w[0], 1, 0));
  ASSERT_OK(vp_weight_swap_source(m.w[0], &d));
  ASSERT_OK(vp_acquire(dev, &m.w[0], 1, 0, &q, &f));
  ASSERT_EQ_INT(f, VP_ACQUIRED_STAGED); /* its slot: a hit */
  ASSERT_EQ_U64(q, p);
  verify_resident(dev, 0, q, m.srcs[0].host, ps);
  ASSERT_OK(vp_release(dev, &m.w[0], 1, 0));
  /* w[1] staged ahead by the prefetch after w[0], then swapped. */
  ASSERT_OK(vp_device_set_lookahead(dev, ps));
  ASSERT_OK(vp_acquire(dev, &m.w[0], 1, 0, &p, &f));
  ASSERT_OK(vp_release(dev, &m.w[0], 1, 0));
  ASSERT_OK(vp_device_set_lookahead(dev, 0));
  ASSERT_OK(vp_weight_swap_source(m.w[1], &d));
  ASSERT_OK(vp_acquire(dev, &m.w[1], 1, 0, &q, &f));
  ASSERT_EQ_INT(f, VP_ACQUIRED_STAGED | VP_ACQUIRED_COPIED);
  verify_resident(dev, 0, q, other, ps);
  ASSERT_OK(vp_release(dev, &m.w[1], 1, 0));
  ASSERT_OK(vp_device_close(dev));
  model_free(&m);
  free(other);
}

/* Weights that stayed resident do not count toward the lookahead: after
 * them, the first weight that needs a copy is prefetched. Weights filled
 * ahead do count. */
TEST(stream_prefetch_skips_ready, TEST_ALL_BACKENDS) {
  vp_options_t o;
  sopts(ctx, &o, 4, 0, VP_SIM_SYNC);
  uint64_t ps = o.page_size;
  vp_device_t dev = test_open_cap(ctx, &o, 16);
  model_t m;
  model_uniform(&m, dev, 6 * ps, 6, ps, SRC_SCATTER, 21);
  uint64_t p = 0;
  uint8_t f = 0;
  for (int i = 0; i < 4; i++) {
    ASSERT_OK(vp_acquire(dev, &m.w[i], 1, 0, &p, &f));
    ASSERT_OK(vp_release(dev, &m.w[i], 1, 0));
  }
  ASSERT_EQ_STR(test_map(m.v), "####..");
  ASSERT_EQ_U64(dstats(dev).prefetch_bytes, 0);
  ASSERT_OK(vp_device_set_lookahead(dev, ps));
  ASSERT_OK(vp_acquire(dev, &m.w[0], 1, 0, &p, &f));
  ASSERT_EQ_INT(f, VP_ACQUIRED_RESIDENT);
  ASSERT_OK(vp_release(dev, &m.w[0], 1, 0));
  ASSERT_EQ_STR(test_map(m.v), "#####.");
  ASSERT_EQ_U64(dstats(dev).prefetch_bytes, ps);
  /* w4, filled ahead, fills the window: w5 waits. */
  ASSERT_OK(vp_acquire(dev, &m.w[1], 1, 0, &p, &f));
  ASSERT_OK(vp_release(dev, &m.w[1], 1, 0));
  ASSERT_EQ_U64(dstats(dev).prefetch_bytes, ps);
  /* Its page goes before its use: counted as dropped and filled again. */
  ASSERT_OK(vp_vbar_free_memory(m.v, ps, NULL));
  ASSERT_EQ_STR(test_map(m.v), "####..");
  ASSERT_OK(vp_vbar_set_watermark(m.v, 6 * ps)); /* w4 may come back */
  ASSERT_OK(vp_acquire(dev, &m.w[2], 1, 0, &p, &f));
  ASSERT_OK(vp_release(dev, &m.w[2], 1, 0));
  ASSERT_EQ_STR(test_map(m.v), "#####.");
  ASSERT_EQ_U64(dstats(dev).prefetch_bytes, 2 * ps);
  ASSERT_EQ_U64(dstats(dev).prefetch_dropped_bytes, ps);
  ASSERT_OK(vp_device_set_lookahead(dev, 0));
  ASSERT_OK(vp_acquire(dev, &m.w[4], 1, 0, &p, &f));
  ASSERT_EQ_INT(f, VP_ACQUIRED_RESIDENT | VP_ACQUIRED_COPIED); /* ahead */
  verify_resident(dev, 0, p, m.srcs[4].host, ps);
  ASSERT_EQ_U64(dstats(dev).weight_fills, 4); /* the acquire copied none */
  ASSERT_OK(vp_release(dev, &m.w[4], 1, 0));
  ASSERT_EQ_U64(dstats(dev).prefetch_used_bytes, ps);

  /* All resident and filled: scans find nothing (and stop scanning) until
   * a page goes; then the next acquire's prefetch fills it again. */
  ASSERT_OK(vp_device_set_lookahead(dev, ps));
  for (int pass = 0; pass < 2; pass++)
    for (int i = 0; i < 6; i++) {
      ASSERT_OK(vp_acquire(dev, &m.w[i], 1, 0, &p, &f));
      ASSERT_OK(vp_release(dev, &m.w[i], 1, 0));
    }
  ASSERT_EQ_STR(test_map(m.v), "######");
  uint64_t pb = dstats(dev).prefetch_bytes;
  ASSERT_OK(vp_acquire(dev, &m.w[0], 1, 0, &p, &f));
  ASSERT_OK(vp_release(dev, &m.w[0], 1, 0));
  ASSERT_EQ_U64(dstats(dev).prefetch_bytes, pb);
  ASSERT_OK(vp_vbar_free_memory(m.v, ps, NULL));
  ASSERT_EQ_STR(test_map(m.v), "#####.");
  ASSERT_OK(vp_vbar_set_watermark(m.v, 6 * ps));
  ASSERT_OK(vp_acquire(dev, &m.w[0], 1, 0, &p, &f));
  ASSERT_OK(vp_release(dev, &m.w[0], 1, 0));
  ASSERT_EQ_U64(dstats(dev).prefetch_bytes, pb + ps);
  ASSERT_EQ_STR(test_map(m.v), "######");
  ASSERT_OK(vp_device_close(dev));
  model_free(&m);
}

/* Small weights, all streamed, acquired one at a time in order: prefetch
 * keeps the window ahead of the acquires and tops it up a chunk (an eighth
 * of the lookahead) at a time, so the copies of one top-up merge (one copy
 * per chunk, not per weight) and no acquire misses after the first pass;
 * the bytes are right in every pass. With resident weights between the
 * streamed ones (one page in two freed), the scan steps over them. */
TEST(stream_prefetch_window, TEST_ALL_BACKENDS) {
  vp_options_t o;
  sopts(ctx, &o, 4, 0, VP_SIM_SYNC);
  uint64_t ps = o.page_size, ws = ps / 32;
  o.lookahead = 2 * ps;                    /* 64 weights; a chunk is 8 */
  vp_device_t dev = test_open_cap(ctx, &o, 4); /* only the ring fits */
  model_t m;
  size_t n = 256;                          /* 8 pages */
  model_uniform(&m, dev, 8 * ps, n, ws, SRC_CONTIG, 31);
  uint64_t ptr;
  uint8_t fl;
  for (int pass = 0; pass < 3; pass++) {
    vp_stats_t before = dstats(dev);
    for (size_t i = 0; i < n; i++) {
      ASSERT_OK(vp_acquire(dev, &m.w[i], 1, 0, &ptr, &fl));
      ASSERT_TRUE(fl & VP_ACQUIRED_STAGED);
      verify_acquired(ctx, dev, 0, ptr, fl, m.srcs[i].host, ws);
      ASSERT_OK(vp_release(dev, &m.w[i], 1, 0));
    }
    vp_stats_t after = dstats(dev);
    uint64_t copies = after.copies - before.copies;
    test_note("pass %d: %" PRIu64 " copies, %" PRIu64 " staged at acquire",
              pass, copies, after.weight_staged - before.weight_staged);
    /* merged: one copy per top-up of a chunk (8 weights; adjacent ring
     * slots), two where the ring wraps */
    ASSERT_TRUE(copies <= n / 8 + 8);
    if (pass) ASSERT_EQ_U64(after.weight_staged, before.weight_staged);
  }
  /* A larger lookahead is taken up at the next acquire, not a chunk
   * later; a smaller one keeps the window. */
  ASSERT_OK(vp_device_set_lookahead(dev, 3 * ps));
  vp_stats_t st = dstats(dev);
  ASSERT_OK(vp_acquire(dev, &m.w[0], 1, 0, &ptr, &fl));
  ASSERT_OK(vp_release(dev, &m.w[0], 1, 0));
  ASSERT_TRUE(dstats(dev).prefetch_bytes - st.prefetch_bytes >= ps / 2);
  ASSERT_OK(vp_device_set_lookahead(dev, ps));
  st = dstats(dev);
  ASSERT_OK(vp_acquire(dev, &m.w[1], 1, 0, &ptr, &fl));
  ASSERT_OK(vp_release(dev, &m.w[1], 1, 0));
  ASSERT_EQ_U64(dstats(dev).prefetch_bytes, st.prefetch_bytes);
  ASSERT_OK(vp_device_set_lookahead(dev, 2 * ps));

  /* After a pass in another order the least recently used slots lie all
   * over the ring: prefetch still gives a batch adjacent slots (it goes
   * on where the last slot ended), so its copies still merge. */
  for (size_t i = 0; i < n; i++) {
    size_t j = (i * 97) % n;                /* 97 and 256: a permutation */
    ASSERT_OK(vp_acquire(dev, &m.w[j], 1, 0, &ptr, &fl));
    verify_acquired(ctx, dev, 0, ptr, fl, m.srcs[j].host, ws);
    ASSERT_OK(vp_release(dev, &m.w[j], 1, 0));
  }
  for (int pass = 0; pass < 2; pass++) {
    st = dstats(dev);
    for (size_t i = 0; i < n; i++) {
      ASSERT_OK(vp_acquire(dev, &m.w[i], 1, 0, &ptr, &fl));
      verify_acquired(ctx, dev, 0, ptr, fl, m.srcs[i].host, ws);
      ASSERT_OK(vp_release(dev, &m.w[i], 1, 0));
    }
    test_note("pass %d in order after a shuffled one: %" PRIu64 " copies",
              pass, dstats(dev).copies - st.copies);
  }
  ASSERT_TRUE(dstats(dev).copies - st.copies <= n / 8 + 8);
  ASSERT_OK(vp_device_close(dev));
  model_free(&m);

  /* Pages 0, 2, 4, 6 resident, 1, 3, 5, 7 streamed. */
  o.lookahead = ps;
  dev = test_open_cap(ctx, &o, 8);
  model_uniform(&m, dev, 8 * ps, n, ws, SRC_CONTIG, 32);
  uint32_t ranks[8] = {0, 2, 4, 6, 1, 3, 5, 7}; /* evicted last first */
  ASSERT_OK(vp_vbar_set_ranks(m.v, ranks, 8));
  for (int pass = 0; pass < 3; pass++) {
    vp_stats_t before = dstats(dev);
    for (size_t i = 0; i < n; i++) {
      ASSERT_OK(vp_acquire(dev, &m.w[i], 1, 0, &ptr, &fl));
      verify_acquired(ctx, dev, 0, ptr, fl, m.srcs[i].host, ws);
      ASSERT_OK(vp_release(dev, &m.w[i], 1, 0));
    }
    vp_stats_t after = dstats(dev);
    uint64_t staged = after.weight_staged - before.weight_staged;
    test_note("pass %d: %" PRIu64 " copies, %" PRIu64 " staged at acquire, "
              "%" PRIu64 " pages committed", pass, after.copies - before.copies,
              staged, after.pages_committed - before.pages_committed);
    if (pass) {
      ASSERT_EQ_U64(after.pages_committed, before.pages_committed);
      ASSERT_TRUE(after.copies - before.copies <= n / 8);
      ASSERT_EQ_U64(staged, 0);
    }
  }
  ASSERT_OK(vp_device_close(dev));
  model_free(&m);
}

/* Streamed weights that all fit in the ring stay staged: later passes
 * copy nothing (the ring takes free room before reclaiming a slot). */
TEST(stream_ring_keeps_what_fits, TEST_ALL_BACKENDS) {
  vp_options_t o;
  sopts(ctx, &o, 4, 0, VP_SIM_SYNC);
  uint64_t ps = o.page_size, hs = ps / 2;
  o.lookahead = 4 * ps;
  vp_device_t dev = test_open_cap(ctx, &o, 4); /* only the ring fits */
  model_t m;
  model_uniform(&m, dev, 4 * ps, 7, hs, SRC_SCATTER, 43); /* 3.5 pages */
  uint64_t ptr;
  uint8_t fl;
  for (int pass = 0; pass < 3; pass++) {
    vp_stats_t st = dstats(dev);
    for (size_t i = 0; i < 7; i++) {
      ASSERT_OK(vp_acquire(dev, &m.w[i], 1, 0, &ptr, &fl));
      verify_acquired(ctx, dev, 0, ptr, fl, m.srcs[i].host, hs);
      ASSERT_OK(vp_release(dev, &m.w[i], 1, 0));
    }
    test_note("pass %d: %" PRIu64 " copies", pass,
              dstats(dev).copies - st.copies);
    if (pass) ASSERT_EQ_U64(dstats(dev).copies, st.copies);
  }
  ASSERT_OK(vp_device_close(dev));
  model_free(&m);
}

/* A window the ring cut short is topped up by the release that gives a
 * chunk of ring room back, not only at the next acquire: at a forward's
 * end the next forward's first weights are copied while nothing is
 * acquired. A 2-slot ring, four one-page weights, lookahead 8 pages (a
 * chunk is one weight); with a ring that holds them all, a release copies
 * nothing. */
TEST(stream_release_refills_ring, TEST_ALL_BACKENDS) {
  for (int big = 0; big < 2; big++) {
    vp_options_t o;
    sopts(ctx, &o, big ? 4 : 2, 0, VP_SIM_SYNC);
    uint64_t ps = o.page_size;
    o.lookahead = 8 * ps;
    vp_device_t dev = test_open_cap(ctx, &o, big ? 4 : 2); /* the ring */
    model_t m;
    model_uniform(&m, dev, 4 * ps, 4, ps, SRC_SCATTER, 44);
    uint64_t p;
    uint8_t f;
    for (int pass = 0; pass < 2; pass++) {
      for (size_t i = 0; i < 4; i++) {
        ASSERT_OK(vp_acquire(dev, &m.w[i], 1, 0, &p, &f));
        ASSERT_TRUE(f & VP_ACQUIRED_STAGED);
        verify_acquired(ctx, dev, 0, p, f, m.srcs[i].host, ps);
        vp_stats_t st = dstats(dev);
        ASSERT_OK(vp_release(dev, &m.w[i], 1, 0));
        uint64_t copied = dstats(dev).prefetch_bytes - st.prefetch_bytes;
        /* The ring: w[i + 1] staged ahead and w[i] released. Its slot
         * goes to w[i + 2] (the next pass's first one at the end). */
        if (big)
          ASSERT_EQ_U64(copied, 0);
        else if (pass || i)
          ASSERT_EQ_U64(copied, ps);
      }
      if (!big) /* every acquire after the first found its copy queued */
        ASSERT_EQ_U64(dstats(dev).weight_staged, 1);
    }
    ASSERT_OK(vp_device_close(dev));
    model_free(&m);
  }
}

/* Weights destroyed (or re-placed: vpager.torch does so after its first
 * forward) while prefetch had staged them: their slots serve nobody and
 * must not keep the ring from later prefetches. */
TEST(stream_prefetch_orphans, TEST_ALL_BACKENDS) {
  vp_options_t o;
  sopts(ctx, &o, 4, 0, VP_SIM_SYNC);
  uint64_t ps = o.page_size;
  o.lookahead = 4 * ps;
  vp_device_t dev = test_open_cap(ctx, &o, 4); /* only the ring fits */
  model_t a, b;
  model_uniform(&a, dev, 4 * ps, 4, ps, SRC_SCATTER, 41);
  uint64_t ptr;
  uint8_t fl;
  ASSERT_OK(vp_acquire(dev, &a.w[0], 1, 0, &ptr, &fl));
  ASSERT_OK(vp_release(dev, &a.w[0], 1, 0));
  ASSERT_EQ_U64(dstats(dev).prefetch_bytes, 3 * ps); /* a.w[1..3] */
  for (int i = 0; i < 4; i++) ASSERT_OK(vp_weight_destroy(a.w[i]));
  vp_stats_t st = dstats(dev);
  ASSERT_EQ_U64(st.prefetch_dropped_bytes, 3 * ps);
  model_uniform(&b, dev, 8 * ps, 8, ps, SRC_SCATTER, 42);
  ASSERT_OK(vp_acquire(dev, &b.w[0], 1, 0, &ptr, &fl));
  verify_acquired(ctx, dev, 0, ptr, fl, b.srcs[0].host, ps);
  ASSERT_OK(vp_release(dev, &b.w[0], 1, 0));
  /* The ring's other three slots go to b's next weights, and b.w[0]'s,
   * released, to the one after (stream_release_refills_ring). */
  ASSERT_EQ_U64(dstats(dev).prefetch_bytes - st.prefetch_bytes, 4 * ps);
  for (size_t i = 1; i < 4; i++) {
    ASSERT_OK(vp_acquire(dev, &b.w[i], 1, 0, &ptr, &fl));
    ASSERT_EQ_INT(fl, VP_ACQUIRED_STAGED | VP_ACQUIRED_COPIED);
    verify_acquired(ctx, dev, 0, ptr, fl, b.srcs[i].host, ps);
    ASSERT_OK(vp_release(dev, &b.w[i], 1, 0));
  }
  ASSERT_OK(vp_device_close(dev));
  model_free(&a);
  model_free(&b);
}

/* ----------------------------------------------------------------- merge */

TEST(stream_merge, TEST_ALL_BACKENDS) {
  vp_options_t o;
  sopts(ctx, &o, 4, 0, VP_SIM_SYNC);
  vp_device_t dev = test_open_cap(ctx, &o, 16);
  uint64_t ps = o.page_size, qs = ps / 4;
  model_t c, s;
  model_uniform(&c, dev, 4 * ps, 16, qs, SRC_CONTIG, 21);
  model_uniform(&s, dev, 4 * ps, 16, qs, SRC_SCATTER, 22);
  uint64_t ptrs[16];
  uint8_t fl[16];

  /* Contiguous in the VBAR and at the source: one copy for 16 weights. */
  ASSERT_OK(vp_acquire(dev, c.w, 16, 0, ptrs, fl));
  vp_stats_t st = dstats(dev);
  ASSERT_EQ_U64(st.copies, 1);
  ASSERT_EQ_U64(st.weight_fills, 16);
  for (int i = 0; i < 16; i++) {
    ASSERT_EQ_INT(fl[i], VP_ACQUIRED_RESIDENT | VP_ACQUIRED_COPIED);
    verify_resident(dev, 0, ptrs[i], c.srcs[i].host, qs);
  }
  ASSERT_OK(vp_release(dev, c.w, 16, 0));

  /* Scattered sources: one copy each. */
  ASSERT_OK(vp_acquire(dev, s.w, 16, 0, ptrs, fl));
  ASSERT_EQ_U64(dstats(dev).copies, st.copies + 16);
  for (int i = 0; i < 16; i++)
    verify_resident(dev, 0, ptrs[i], s.srcs[i].host, qs);
  ASSERT_OK(vp_release(dev, s.w, 16, 0));

  /* Staged, contiguous sources: the ring slots follow each other too. */
  ASSERT_OK(vp_vbar_free_memory(c.v, 4 * ps, NULL));
  st = dstats(dev);
  ASSERT_OK(vp_acquire(dev, c.w, 8, 0, ptrs, fl));
  ASSERT_EQ_U64(dstats(dev).copies, st.copies + 1);
  for (int i = 0; i < 8; i++) {
    ASSERT_EQ_INT(fl[i], VP_ACQUIRED_STAGED | VP_ACQUIRED_COPIED);
    if (i) ASSERT_EQ_U64(ptrs[i], ptrs[i - 1] + qs);
    if (is_sim(ctx)) verify_staged_sim(dev, 0, ptrs[i], c.srcs[i].host, qs);
  }
  ASSERT_OK(vp_release(dev, c.w, 8, 0));
  ASSERT_OK(vp_device_close(dev));
  model_free(&c);
  model_free(&s);

  /* Contiguous sources, but gaps in the VBAR: no merging. */
  dev = test_open_cap(ctx, &o, 16);
  uint64_t off[8], sz[8];
  for (int i = 0; i < 8; i++) off[i] = i * (qs + 256), sz[i] = qs;
  model_t g;
  model_init(&g, dev, 4 * ps, 8, off, sz, SRC_CONTIG, 23);
  ASSERT_OK(vp_acquire(dev, g.w, 8, 0, ptrs, fl));
  ASSERT_EQ_U64(dstats(dev).copies, 8);
  for (int i = 0; i < 8; i++)
    verify_resident(dev, 0, ptrs[i], g.srcs[i].host, qs);
  ASSERT_OK(vp_release(dev, g.w, 8, 0));
  ASSERT_OK(vp_device_close(dev));
  model_free(&g);
}

/* Many small weights merged into one copy: more weights than copies in
 * the copy list, resident and staged. */
TEST(stream_merge_many, TEST_ALL_BACKENDS) {
  vp_options_t o;
  sopts(ctx, &o, 4, 0, VP_SIM_SYNC);
  vp_device_t dev = test_open_cap(ctx, &o, 16);
  uint64_t ps = o.page_size, ws = ps / 32;
  model_t m;
  model_uniform(&m, dev, 4 * ps, 128, ws, SRC_CONTIG, 24);
  uint64_t ptrs[128];
  uint8_t fl[128];
  ASSERT_OK(vp_acquire(dev, m.w, 100, 0, ptrs, fl));
  ASSERT_EQ_U64(dstats(dev).copies, 1);
  for (int i = 0; i < 100; i++) {
    ASSERT_EQ_INT(fl[i], VP_ACQUIRED_RESIDENT | VP_ACQUIRED_COPIED);
    verify_resident(dev, 0, ptrs[i], m.srcs[i].host, ws);
  }
  ASSERT_OK(vp_release(dev, m.w, 100, 0));
  /* Prefetch of many small contiguous weights (a long lookahead): one
   * copy for the acquire, one for the 127 weights after it. */
  ASSERT_OK(vp_vbar_free_memory(m.v, 4 * ps, NULL));
  ASSERT_OK(vp_vbar_prioritize(m.v));
  ASSERT_OK(vp_device_set_lookahead(dev, 4 * ps));
  vp_stats_t st = dstats(dev);
  ASSERT_OK(vp_acquire(dev, m.w, 1, 0, ptrs, fl));
  ASSERT_OK(vp_release(dev, m.w, 1, 0));
  vp_stats_t st2 = dstats(dev);
  ASSERT_EQ_U64(st2.prefetch_bytes - st.prefetch_bytes, 127 * ws);
  ASSERT_EQ_U64(st2.copies - st.copies, 2);
  ASSERT_EQ_STR(test_map(m.v), "####");
  for (int i = 1; i < 128; i++) {
    ASSERT_OK(vp_acquire(dev, &m.w[i], 1, 0, ptrs, fl));
    ASSERT_EQ_INT(fl[0], VP_ACQUIRED_RESIDENT | VP_ACQUIRED_COPIED);
    verify_resident(dev, 0, ptrs[0], m.srcs[i].host, ws);
    ASSERT_OK(vp_release(dev, &m.w[i], 1, 0));
  }
  ASSERT_EQ_U64(dstats(dev).copies, st2.copies);
  ASSERT_OK(vp_device_set_lookahead(dev, 0));
  /* Staged: 64 weights (two pages) into a fresh ring. */
  ASSERT_OK(vp_vbar_free_memory(m.v, 4 * ps, NULL));
  st = dstats(dev);
  ASSERT_OK(vp_acquire(dev, m.w, 64, 0, ptrs, fl));
  ASSERT_EQ_U64(dstats(dev).copies, st.copies + 1);
  for (int i = 0; i < 64; i++) {
    ASSERT_EQ_INT(fl[i], VP_ACQUIRED_STAGED | VP_ACQUIRED_COPIED);
    if (is_sim(ctx)) verify_staged_sim(dev, 0, ptrs[i], m.srcs[i].host, ws);
  }
  ASSERT_OK(vp_release(dev, m.w, 64, 0));
  ASSERT_OK(vp_device_close(dev));
  model_free(&m);
}

/* ------------------------------------------------- injected failures */

/* One run with the nth failable call failing: stream a model twice (some
 * weights resident, some staged, prefetch on). Every acquire that fails
 * leaves nothing acquired; every one that succeeds gives the right bytes.
 * Returns true when nothing failed. */
static bool fail_rung(test_ctx_t *ctx, int streams, int64_t nth) {
  vp_options_t o;
  sopts(ctx, &o, 2, 0, streams);
  uint64_t ps = o.page_size;
  o.lookahead = ps;
  o.sim_capacity = 8 * ps;
  o.sim_fail_nth = nth;
  bool ok = true;
  vp_device_t dev;
  if (vp_device_open(&o, &dev) != VP_OK) return false;
  vp_vbar_t v;
  if (vp_vbar_create(dev, 8 * ps, &v) != VP_OK) {
    ASSERT_OK(vp_device_close(dev));
    return false;
  }
  enum { N = 16 };
  uint64_t off[N], sz[N];
  unsigned char *buf = malloc(N * ps / 2);
  ASSERT_NOT_NULL(buf);
  vp_source_t srcs[N];
  for (int i = 0; i < N; i++) {
    off[i] = i * ps / 2;
    sz[i] = ps / 2;
    srcs[i] = (vp_source_t){.kind = VP_SOURCE_HOST,
                            .host = buf + i * (ps / 2)};
  }
  test_pattern(buf, N * ps / 2, 1234);
  vp_weight_t w[N];
  int rc = vp_weights_create(v, N, off, sz, srcs, w);
  if (rc == VP_OK) rc = vp_vbar_set_watermark(v, 4 * ps);
  bool dead = false; /* the device broke: every call fails from now */
  for (int pass = 0; pass < 2 && rc == VP_OK && !dead; pass++) {
    for (int l = 0; l < N / 2 && !dead; l++) {
      uint64_t p[2];
      uint8_t f[2];
      test_note("sim_fail_nth %" PRId64 " (streams %d): pass %d layer %d",
                nth, streams, pass, l);
      int arc = vp_acquire(dev, &w[2 * l], 2, 0, p, f);
      if (arc != VP_OK) {
        ok = false;
        ASSERT_LT_INT(arc, 0);
        ASSERT_TRUE(vp_last_error()[0] != '\0');
        ASSERT_FALSE(map_has_pin(v));
        dead = arc == VP_EDEVICE;
        continue;
      }
      vp_stream_synchronize(dev, 0);
      for (int j = 0; j < 2; j++)
        ASSERT_MEM_EQ((const void *)(uintptr_t)p[j], srcs[2 * l + j].host,
                      ps / 2);
      int rrc = vp_release(dev, &w[2 * l], 2, 0);
      if (rrc != VP_OK) {
        ok = false;
        ASSERT_LT_INT(rrc, 0);
        dead = rrc == VP_EDEVICE;
        if (!dead) ASSERT_OK(vp_release(dev, &w[2 * l], 2, 0));
      }
    }
  }
  if (rc != VP_OK) ok = false;
  test_note("sim_fail_nth %" PRId64 " (streams %d): close", nth, streams);
  ASSERT_OK(vp_device_close(dev));
  free(buf);
  return ok;
}

TEST(stream_fail_walk, TEST_SIM_ONLY) {
  for (int streams = 0; streams < 2; streams++) {
    int clean = 0, nth;
    for (nth = 1; nth < 2000 && clean < 8; nth++)
      clean = fail_rung(ctx, streams, nth) ? clean + 1 : 0;
    test_log("streams %d: %d rungs", streams, nth - clean);
    ASSERT_EQ_INT(clean, 8);
  }
}

/* A page shared by two weights: one's reader is still queued on stream a
 * when prefetch fills the other into the same page from the copy stream.
 * The copy's fence must not replace the reader's, or eviction frees the
 * page under the reader (found by bench/soak.py). */
TEST(stream_prefetch_keeps_readers_fence, TEST_SIM_ONLY) {
  vp_options_t o;
  sopts(ctx, &o, 4, 0, VP_SIM_WORKER);
  vp_device_t dev = test_open_cap(ctx, &o, 16);
  uint64_t ps = o.page_size;
  /* w0 alone on page 1; w1 and w2 share page 0. */
  uint64_t off[3] = {ps, 0, 1024}, size[3] = {ps, 1000, 1024};
  model_t m;
  model_init(&m, dev, 4 * ps, 3, off, size, SRC_SCATTER, 11);
  vp_stream_t a = 0, b = 0;
  ASSERT_OK(vp_stream_create(dev, &a));
  ASSERT_OK(vp_stream_create(dev, &b));
  uint64_t p1 = 0, p0 = 0;
  uint8_t f = 0;
  ASSERT_OK(vp_acquire(dev, &m.w[1], 1, a, &p1, &f));
  ASSERT_TRUE(f & VP_ACQUIRED_RESIDENT);
  slow_t k = {.ptr = p1, .size = 1000, .ms = 150, .expect = m.srcs[1].host};
  ASSERT_OK(vp_sim_launch(dev, a, slow_fn, &k));
  ASSERT_OK(vp_release(dev, &m.w[1], 1, a));
  ASSERT_OK(vp_device_set_lookahead(dev, 1 << 20));
  ASSERT_OK(vp_acquire(dev, &m.w[0], 1, b, &p0, &f)); /* prefetches w2 */
  ASSERT_OK(vp_release(dev, &m.w[0], 1, b));
  vp_stats_t st = dstats(dev);
  ASSERT_GT_U64(st.prefetch_bytes, 0);
  uint64_t freed = 0;
  ASSERT_OK(vp_device_free_memory(dev, 1ull << 30, &freed));
  ASSERT_TRUE(slow_done(&k)); /* eviction waited for the reader */
  ASSERT_TRUE(slow_ok(&k));
  ASSERT_OK(vp_stream_synchronize(dev, a));
  ASSERT_OK(vp_stream_synchronize(dev, b));
  ASSERT_OK(vp_stream_destroy(dev, a));
  ASSERT_OK(vp_stream_destroy(dev, b));
  model_free(&m);
  ASSERT_OK(vp_device_close(dev));
}

/* One call listing a weight many times while its fill is still copying (a
 * fuzzer finding): a later listing can see the copy done and let go of the
 * weight's fence, so the call must hold its own reference to the fence it
 * waits for, or the fence is put back into the pool twice. The race is
 * timing-dependent here; tests/fuzz/corpus/api keeps the fuzzer's input. */
TEST(stream_repeat_listing_while_copying, TEST_SIM_ONLY) {
  vp_options_t o;
  sopts(ctx, &o, 4, 0, VP_SIM_WORKER);
  vp_device_t dev = test_open_cap(ctx, &o, 16);
  model_t m;
  model_uniform(&m, dev, 4 * o.page_size, 1, o.page_size, SRC_CONTIG, 5);
  vp_weight_t many[64];
  uint64_t ptrs[64];
  for (int i = 0; i < 64; i++) many[i] = m.w[0];
  for (uint64_t r = 0; r < test_scale(200); r++) {
    uint64_t freed;
    ASSERT_OK(vp_vbar_free_memory(m.v, 4 * o.page_size, &freed));
    ASSERT_OK(vp_acquire(dev, m.w, 1, 0, ptrs, NULL)); /* refills it */
    ASSERT_OK(vp_acquire(dev, many, 64, 0, ptrs, NULL));
    ASSERT_OK(vp_release(dev, many, 64, 0));
    verify_resident(dev, 0, ptrs[0], m.srcs[0].host, m.size[0]);
    ASSERT_OK(vp_release(dev, m.w, 1, 0));
  }
  ASSERT_OK(vp_stream_synchronize(dev, 0));
  model_free(&m);
  ASSERT_OK(vp_device_close(dev));
}

/* A failed acquire undoes what it handed out EMPTY: nobody wrote those
 * bytes, so the next acquire says EMPTY again (a fuzzer finding). */
TEST(stream_failed_acquire_keeps_empty, TEST_SIM_ONLY) {
  vp_options_t o;
  sopts(ctx, &o, 2, 0, VP_SIM_SYNC);
  vp_device_t dev = test_open_cap(ctx, &o, 6);
  uint64_t ps = o.page_size;
  vp_vbar_t v = test_vbar(dev, 8 * ps);
  unsigned char *host = calloc(1, 5 * ps);
  ASSERT_NOT_NULL(host);
  uint64_t off[2] = {1024, 1024 + 5 * ps}, size[2] = {5 * ps, 4096};
  vp_source_t src[2] = {{.kind = VP_SOURCE_HOST, .host = host},
                        {.kind = VP_SOURCE_NONE}};
  vp_weight_t w[2];
  ASSERT_OK(vp_weights_create(v, 2, off, size, src, w));
  vp_weight_t order[2] = {w[1], w[0]};
  uint64_t ptrs[2];
  uint8_t fl[2];
  ASSERT_RC(vp_acquire(dev, order, 2, 0, ptrs, fl), VP_ELIMIT);
  ASSERT_OK(vp_acquire(dev, &w[1], 1, 0, ptrs, fl));
  ASSERT_TRUE(fl[0] & VP_ACQUIRED_EMPTY);
  ASSERT_OK(vp_release(dev, &w[1], 1, 0));
  /* The caller wrote it then: a failed call must not forget that. */
  ASSERT_RC(vp_acquire(dev, order, 2, 0, ptrs, NULL), VP_ELIMIT);
  ASSERT_OK(vp_acquire(dev, &w[1], 1, 0, ptrs, fl));
  ASSERT_FALSE(fl[0] & VP_ACQUIRED_EMPTY);
  ASSERT_OK(vp_release(dev, &w[1], 1, 0));
  /* Handed out EMPTY by a call that fails with flags NULL: undone too. */
  uint64_t freed;
  ASSERT_OK(vp_vbar_free_memory(v, 8 * ps, &freed));
  ASSERT_RC(vp_acquire(dev, order, 2, 0, ptrs, NULL), VP_ELIMIT);
  ASSERT_OK(vp_acquire(dev, &w[1], 1, 0, ptrs, fl));
  ASSERT_TRUE(fl[0] & VP_ACQUIRED_EMPTY);
  ASSERT_OK(vp_release(dev, &w[1], 1, 0));
  /* Staged and listed twice before the call fails: the second listing
   * reuses the slot the first handed out EMPTY; undone, it is dropped. */
  ASSERT_OK(vp_vbar_set_watermark(v, 0));
  uint64_t off2 = 7 * ps, size2 = 4096;
  vp_source_t none = {.kind = VP_SOURCE_NONE};
  vp_weight_t w2;
  ASSERT_OK(vp_weights_create(v, 1, &off2, &size2, &none, &w2));
  vp_weight_t twice[3] = {w2, w2, w[0]};
  ASSERT_RC(vp_acquire(dev, twice, 3, 0, ptrs, NULL), VP_ELIMIT);
  ASSERT_OK(vp_acquire(dev, &w2, 1, 0, ptrs, fl));
  ASSERT_TRUE(fl[0] & VP_ACQUIRED_STAGED);
  ASSERT_TRUE(fl[0] & VP_ACQUIRED_EMPTY);
  ASSERT_OK(vp_release(dev, &w2, 1, 0));
  ASSERT_OK(vp_stream_synchronize(dev, 0));
  ASSERT_OK(vp_weight_destroy(w2));
  ASSERT_OK(vp_weight_destroy(w[0]));
  ASSERT_OK(vp_weight_destroy(w[1]));
  ASSERT_OK(vp_vbar_destroy(v));
  free(host);
  ASSERT_OK(vp_device_close(dev));
}

/* Closing a device with a copy still queued on a worker stream waits for
 * it instead of freeing the page under it (a fuzzer finding). */
TEST(stream_close_waits_for_queued_copy, TEST_SIM_ONLY) {
  vp_options_t o;
  sopts(ctx, &o, 2, 0, VP_SIM_WORKER);
  vp_device_t dev = test_open_cap(ctx, &o, 16);
  uint64_t ps = o.page_size;
  vp_vbar_t v = test_vbar(dev, 4 * ps);
  unsigned char *buf = malloc(4 * ps);
  ASSERT_NOT_NULL(buf);
  test_pattern(buf, 4 * ps, 3);
  ASSERT_OK(vp_fault(v, 0, 4 * ps, NULL, 0));
  ASSERT_OK(vp_copy_to_device(dev, test_vbar_base(v), buf, 4 * ps, 0));
  ASSERT_OK(vp_device_close(dev)); /* no synchronize first */
  free(buf);
}
