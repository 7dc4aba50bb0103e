/* Per-weight prefetch windows (vp_weight_set_lookahead) and the per-call
 * lookahead (vp_acquire_ahead): the prefetch after an acquire runs the
 * call's window, else its last weight's, else the device's lookahead, so
 * models sharing a device keep their own windows without writing the
 * device's setting. On the simulated device each test runs with sync and
 * worker streams (copies on another thread: the acquired bytes are
 * checked when the caller's stream reaches them). */
#include "stream_fixture.h"

enum { NW = 8 }; /* one-page weights per model */

/* Each page of v: '#' resident (pinned or not), '.' not. */
static const char *resident_map(vp_vbar_t v) {
  static char buf[64];
  uint8_t flags[64];
  uint64_t n = 0;
  ASSERT_OK(vp_vbar_page_count(v, &n));
  ASSERT_TRUE(n < sizeof buf);
  ASSERT_OK(vp_vbar_residency(v, flags, n));
  for (uint64_t i = 0; i < n; i++)
    buf[i] = flags[i] & VP_PAGE_RESIDENT ? '#' : '.';
  buf[n] = '\0';
  return buf;
}

/* The map after acquiring weight i of NW with `ahead` pages prefetched
 * after it (wrapping to the start). */
static const char *window_map(size_t i, uint64_t ahead) {
  static char buf[NW + 1];
  memset(buf, '.', NW);
  buf[NW] = '\0';
  for (uint64_t k = 0; k <= ahead && k < NW; k++) buf[(i + k) % NW] = '#';
  return buf;
}

static int stream_modes(test_ctx_t *ctx, int modes[2]) {
  modes[0] = VP_SIM_SYNC;
  modes[1] = VP_SIM_WORKER;
  return is_sim(ctx) ? 2 : 1;
}

/* A device whose own lookahead is `lookahead_pages`, room for every page
 * of two models (prefetch fills in place), a 4-page ring. */
static vp_device_t open_dev(test_ctx_t *ctx, int mode, uint64_t lookahead_pages,
                            uint64_t *ps) {
  vp_options_t o;
  sopts(ctx, &o, 4, 0, mode);
  *ps = o.page_size;
  o.lookahead = lookahead_pages * *ps;
  return test_open_cap(ctx, &o, 4 * NW);
}

/* Evict m, acquire its weight i on s (checking the bytes), release it and
 * wait: returns the bytes the acquire's prefetch queued. */
static uint64_t acquire_cold(test_ctx_t *ctx, vp_device_t dev, vp_stream_t s,
                             model_t *m, size_t i, uint64_t ps) {
  uint64_t p = 0;
  uint8_t f = 0;
  ASSERT_OK(vp_vbar_free_memory(m->v, NW * ps, NULL));
  ASSERT_OK(vp_vbar_prioritize(m->v));
  vp_stats_t st0 = {.size = sizeof st0}, st1 = {.size = sizeof st1};
  ASSERT_OK(vp_vbar_stats(m->v, &st0));
  ASSERT_OK(vp_acquire(dev, &m->w[i], 1, s, &p, &f));
  ASSERT_OK(vp_vbar_stats(m->v, &st1));
  ASSERT_EQ_INT(f, VP_ACQUIRED_RESIDENT | VP_ACQUIRED_COPIED);
  verify_acquired(ctx, dev, s, p, f, m->srcs[i].host, ps);
  ASSERT_OK(vp_release(dev, &m->w[i], 1, s));
  ASSERT_OK(vp_stream_synchronize(dev, s));
  return st1.prefetch_bytes - st0.prefetch_bytes;
}

/* Weights carrying different windows: the prefetch after each acquire
 * queues exactly its weight's window; a weight without one
 * (VP_LOOKAHEAD_DEVICE) uses the device's lookahead, which a window of 0
 * overrides; windows read back as set; setting one back to the device's
 * follows the device's lookahead again. */
TEST(lookahead_per_weight, TEST_ALL_BACKENDS) {
  static const uint64_t D = VP_LOOKAHEAD_DEVICE;
  static const uint64_t win[NW] = {1, 3, D, 0, 2, 5, D, 1}; /* pages */
  int modes[2];
  for (int k = 0, nk = stream_modes(ctx, modes); k < nk; k++) {
    test_note("sim streams %s", modes[k] == VP_SIM_WORKER ? "worker" : "sync");
    for (uint64_t dev_la = 0; dev_la <= 2; dev_la += 2) {
      uint64_t ps;
      vp_device_t dev = open_dev(ctx, modes[k], dev_la, &ps);
      vp_stream_t s;
      ASSERT_OK(vp_stream_create(dev, &s));
      model_t m;
      model_uniform(&m, dev, NW * ps, NW, ps, SRC_SCATTER, 70 + dev_la);
      for (size_t i = 0; i < NW; i++) {
        uint64_t got = 0;
        ASSERT_OK(vp_weight_get_lookahead(m.w[i], &got));
        ASSERT_EQ_U64(got, D); /* a new weight: the device's */
        ASSERT_OK(vp_weight_set_lookahead(m.w[i], win[i] == D ? D : win[i] * ps));
        ASSERT_OK(vp_weight_get_lookahead(m.w[i], &got));
        ASSERT_EQ_U64(got, win[i] == D ? D : win[i] * ps);
      }
      for (int pass = 0; pass < 2; pass++)
        for (size_t i = 0; i < NW; i++) {
          uint64_t pages = win[i] == D ? dev_la : win[i];
          test_note("device lookahead %" PRIu64 ", weight %zu, window %" PRIu64,
                    dev_la, i, pages);
          ASSERT_EQ_U64(acquire_cold(ctx, dev, s, &m, i, ps), pages * ps);
          ASSERT_EQ_STR(resident_map(m.v), window_map(i, pages));
        }
      /* Back to the device's: weight 1 follows the device's lookahead. */
      ASSERT_OK(vp_weight_set_lookahead(m.w[1], D));
      ASSERT_EQ_U64(acquire_cold(ctx, dev, s, &m, 1, ps), dev_la * ps);
      ASSERT_OK(vp_device_set_lookahead(dev, 4 * ps));
      ASSERT_EQ_U64(acquire_cold(ctx, dev, s, &m, 1, ps), 4 * ps);
      ASSERT_EQ_U64(acquire_cold(ctx, dev, s, &m, 0, ps), ps); /* its own */
      /* vp_prefetch after a weight runs its window too. */
      ASSERT_OK(vp_vbar_free_memory(m.v, NW * ps, NULL));
      ASSERT_OK(vp_vbar_prioritize(m.v));
      ASSERT_OK(vp_prefetch(dev, m.w[4]));
      ASSERT_EQ_STR(resident_map(m.v), ".....##.");
      ASSERT_OK(vp_stream_synchronize(dev, s));
      ASSERT_OK(vp_stream_destroy(dev, s));
      ASSERT_OK(vp_device_close(dev));
      model_free(&m);
    }
  }
}

/* Two VBARs on one device with different windows, used in turns (two
 * models sharing a GPU): each prefetches its own windows, whatever the
 * other acquired last. */
TEST(lookahead_two_vbars, TEST_ALL_BACKENDS) {
  int modes[2];
  for (int k = 0, nk = stream_modes(ctx, modes); k < nk; k++) {
    test_note("sim streams %s", modes[k] == VP_SIM_WORKER ? "worker" : "sync");
    uint64_t ps;
    vp_device_t dev = open_dev(ctx, modes[k], 2, &ps);
    vp_stream_t s;
    ASSERT_OK(vp_stream_create(dev, &s));
    model_t a, b, c; /* c: no windows, the device's 2 pages */
    model_uniform(&a, dev, NW * ps, NW, ps, SRC_SCATTER, 81);
    model_uniform(&b, dev, NW * ps, NW, ps, SRC_SCATTER, 82);
    model_uniform(&c, dev, NW * ps, NW, ps, SRC_SCATTER, 83);
    for (size_t i = 0; i < NW; i++) {
      ASSERT_OK(vp_weight_set_lookahead(a.w[i], 1 * ps));
      ASSERT_OK(vp_weight_set_lookahead(b.w[i], 3 * ps));
    }
    for (int pass = 0; pass < 2; pass++)
      for (size_t i = 0; i < NW; i++) {
        test_note("pass %d, weight %zu", pass, i);
        ASSERT_EQ_U64(acquire_cold(ctx, dev, s, &a, i, ps), 1 * ps);
        ASSERT_EQ_U64(acquire_cold(ctx, dev, s, &b, i, ps), 3 * ps);
        ASSERT_EQ_U64(acquire_cold(ctx, dev, s, &c, i, ps), 2 * ps);
        ASSERT_EQ_STR(resident_map(a.v), window_map(i, 1));
        ASSERT_EQ_STR(resident_map(b.v), window_map(i, 3));
        ASSERT_EQ_STR(resident_map(c.v), window_map(i, 2));
      }
    /* Warm passes, the models' acquires interleaved: every weight after
     * a model's first was queued by its own window (hits, no fills). */
    for (int pass = 0; pass < 2; pass++)
      for (size_t i = 0; i < NW; i++) {
        model_t *ms[3] = {&a, &b, &c};
        for (int j = 0; j < 3; j++) {
          uint64_t p;
          uint8_t f;
          ASSERT_OK(vp_acquire(dev, &ms[j]->w[i], 1, s, &p, &f));
          ASSERT_TRUE(f & VP_ACQUIRED_RESIDENT);
          verify_acquired(ctx, dev, s, p, f, ms[j]->srcs[i].host, ps);
          ASSERT_OK(vp_release(dev, &ms[j]->w[i], 1, s));
        }
      }
    ASSERT_OK(vp_stream_synchronize(dev, s));
    ASSERT_OK(vp_stream_destroy(dev, s));
    ASSERT_OK(vp_device_close(dev));
    model_free(&a);
    model_free(&b);
    model_free(&c);
  }
}

/* vp_acquire_ahead: the call's lookahead instead of the weight's window
 * (0: no prefetch at all), and the release top-up after it uses the same
 * (the ring test of test_stream.c's stream_release_refills_ring with the
 * device's lookahead 0: the call's, or the weights', 8 pages). */
TEST(lookahead_acquire_ahead, TEST_ALL_BACKENDS) {
  int modes[2];
  for (int k = 0, nk = stream_modes(ctx, modes); k < nk; k++) {
    uint64_t ps;
    vp_device_t dev = open_dev(ctx, modes[k], 2, &ps);
    vp_stream_t s;
    ASSERT_OK(vp_stream_create(dev, &s));
    model_t m;
    model_uniform(&m, dev, NW * ps, NW, ps, SRC_SCATTER, 91);
    for (size_t i = 0; i < NW; i++)
      ASSERT_OK(vp_weight_set_lookahead(m.w[i], 3 * ps));
    uint64_t p;
    uint8_t f;
    for (uint64_t ahead = 0; ahead <= 5; ahead += 5) {
      ASSERT_OK(vp_vbar_free_memory(m.v, NW * ps, NULL));
      ASSERT_OK(vp_vbar_prioritize(m.v));
      ASSERT_OK(vp_acquire_ahead(dev, &m.w[2], 1, s, &p, &f, ahead * ps));
      verify_acquired(ctx, dev, s, p, f, m.srcs[2].host, ps);
      ASSERT_OK(vp_release(dev, &m.w[2], 1, s));
      ASSERT_EQ_STR(resident_map(m.v), window_map(2, ahead));
    }
    ASSERT_RC(vp_acquire_ahead(dev, m.w, 0, s, &p, &f, 0), VP_EINVAL);
    ASSERT_TRUE(strncmp(vp_last_error(), "vp_acquire_ahead: ", 18) == 0);
    /* vp_prefetch_ahead: the prefetch that acquire would run. */
    for (uint64_t ahead = 0; ahead <= 5; ahead += 5) {
      ASSERT_OK(vp_vbar_free_memory(m.v, NW * ps, NULL));
      ASSERT_OK(vp_vbar_prioritize(m.v));
      ASSERT_OK(vp_prefetch_ahead(dev, m.w[2], ahead * ps));
      ASSERT_OK(vp_stream_synchronize(dev, s));
      char want[NW + 1];
      for (size_t i = 0; i < NW; i++)
        want[i] = i > 2 && i <= 2 + ahead ? '#' : '.';
      want[NW] = 0;
      ASSERT_EQ_STR(resident_map(m.v), want);
    }
    ASSERT_OK(vp_stream_synchronize(dev, s));
    ASSERT_OK(vp_stream_destroy(dev, s));
    ASSERT_OK(vp_device_close(dev));
    model_free(&m);
  }
  for (int own = 0; own < 2; own++) {
    vp_options_t o;
    sopts(ctx, &o, 2, 0, VP_SIM_SYNC);
    uint64_t ps = o.page_size;
    vp_device_t dev = test_open_cap(ctx, &o, 2); /* the ring */
    model_t m;
    model_uniform(&m, dev, 4 * ps, 4, ps, SRC_SCATTER, 92);
    if (own)
      for (size_t i = 0; i < 4; i++)
        ASSERT_OK(vp_weight_set_lookahead(m.w[i], 8 * ps));
    uint64_t p;
    uint8_t f;
    for (int pass = 0; pass < 2; pass++)
      for (size_t i = 0; i < 4; i++) {
        test_note("own %d, pass %d, weight %zu", own, pass, i);
        if (own)
          ASSERT_OK(vp_acquire(dev, &m.w[i], 1, 0, &p, &f));
        else
          ASSERT_OK(vp_acquire_ahead(dev, &m.w[i], 1, 0, &p, &f, 8 * ps));
        ASSERT_TRUE(f & VP_ACQUIRED_STAGED);
        verify_acquired(ctx, dev, 0, p, f, m.srcs[i].host, ps);
        vp_stats_t st = dstats(dev);
        ASSERT_OK(vp_release(dev, &m.w[i], 1, 0));
        if (pass || i) /* the release gave a slot to the next but one */
          ASSERT_EQ_U64(dstats(dev).prefetch_bytes - st.prefetch_bytes, ps);
      }
    ASSERT_OK(vp_device_close(dev));
    model_free(&m);
  }
}

/* Bad handles and arguments fail naming the call; a window may change
 * while the weight is acquired. */
/* vp_prefetch_sm: the prefetch vp_prefetch_ahead runs, its copies from
 * page-locked memory read by SMs where the backend can (the simulated
 * device, as a GPU; a GPU by its kernel: stats' sm_copy_bytes counts
 * them), the bytes the same (checked at the weights' acquires); from
 * memory not page-locked, and on HIP, by the copy engine; lookahead 0:
 * the weight's own window; programs 0 or past VP_SM_PROGRAMS_MAX
 * refused. */
TEST(lookahead_prefetch_by_sm, TEST_ALL_BACKENDS) {
  int modes[2];
  for (int k = 0, nk = stream_modes(ctx, modes); k < nk; k++) {
    uint64_t ps;
    vp_device_t dev = open_dev(ctx, modes[k], 0, &ps);
    vp_stream_t s;
    ASSERT_OK(vp_stream_create(dev, &s));
    model_t m;
    model_uniform(&m, dev, NW * ps, NW, ps, SRC_SCATTER, 93);
    uint64_t sm0 = dstats(dev).sm_copy_bytes;
    bool sm = ctx->backend != VP_BACKEND_HIP; /* HIP: the copy engine's */
    for (int locked = 0; locked < 2; locked++) {
      vp_hostbuf_t hb = {0};
      if (locked)
        ASSERT_OK(vp_hostbuf_register(dev, m.buf, m.buf_size, &hb));
      ASSERT_OK(vp_vbar_free_memory(m.v, NW * ps, NULL));
      ASSERT_OK(vp_vbar_prioritize(m.v));
      ASSERT_OK(vp_prefetch_sm(dev, m.w[2], 2 * ps, 8));
      ASSERT_OK(vp_stream_synchronize(dev, s));
      ASSERT_EQ_STR(resident_map(m.v), "...##...");
      ASSERT_EQ_U64(dstats(dev).sm_copy_bytes - sm0,
                    locked && sm ? 2 * ps : 0);
      for (size_t i = 3; i <= 4; i++) {
        uint64_t p = 0;
        uint8_t f = 0;
        ASSERT_OK(vp_acquire(dev, &m.w[i], 1, s, &p, &f));
        ASSERT_TRUE(f & VP_ACQUIRED_RESIDENT);      /* filled ahead */
        verify_acquired(ctx, dev, s, p, f, m.srcs[i].host, ps);
        ASSERT_OK(vp_release(dev, &m.w[i], 1, s));
      }
      /* lookahead 0: the weight's own window, one page after it */
      ASSERT_OK(vp_weight_set_lookahead(m.w[5], ps));
      ASSERT_OK(vp_prefetch_sm(dev, m.w[5], 0, 1));
      ASSERT_OK(vp_stream_synchronize(dev, s));
      ASSERT_EQ_STR(resident_map(m.v), "...##.#.");  /* w6 */
      ASSERT_EQ_U64(dstats(dev).sm_copy_bytes - sm0,
                    locked && sm ? 3 * ps : 0);
      ASSERT_OK(vp_weight_set_lookahead(m.w[5], VP_LOOKAHEAD_DEVICE));
      if (locked) ASSERT_OK(vp_hostbuf_free(hb));
      sm0 = dstats(dev).sm_copy_bytes;
    }
    ASSERT_RC(vp_prefetch_sm(dev, m.w[2], ps, 0), VP_EINVAL);
    ASSERT_TRUE(strncmp(vp_last_error(), "vp_prefetch_sm: ", 16) == 0);
    ASSERT_RC(vp_prefetch_sm(dev, m.w[2], ps, VP_SM_PROGRAMS_MAX + 1),
              VP_EINVAL);
    ASSERT_OK(vp_stream_destroy(dev, s));
    ASSERT_OK(vp_device_close(dev));
    model_free(&m);
  }
}

TEST(lookahead_errors, TEST_ALL_BACKENDS) {
  uint64_t ps;
  vp_device_t dev = open_dev(ctx, VP_SIM_SYNC, 0, &ps);
  model_t m;
  model_uniform(&m, dev, NW * ps, NW, ps, SRC_SCATTER, 93);
  uint64_t p, got;
  uint8_t f;
  ASSERT_OK(vp_acquire(dev, &m.w[0], 1, 0, &p, &f));
  ASSERT_OK(vp_weight_set_lookahead(m.w[0], ps)); /* held: allowed */
  ASSERT_OK(vp_release(dev, &m.w[0], 1, 0));
  ASSERT_RC(vp_weight_get_lookahead(m.w[0], NULL), VP_EINVAL);
  ASSERT_TRUE(strncmp(vp_last_error(), "vp_weight_get_lookahead: ", 25) == 0);
  ASSERT_OK(vp_weight_destroy(m.w[1]));
  ASSERT_RC(vp_weight_set_lookahead(m.w[1], ps), VP_EHANDLE);
  ASSERT_TRUE(strncmp(vp_last_error(), "vp_weight_set_lookahead: ", 25) == 0);
  ASSERT_RC(vp_weight_get_lookahead(m.w[1], &got), VP_EHANDLE);
  ASSERT_RC(vp_weight_set_lookahead((vp_weight_t){0}, ps), VP_EHANDLE);
  ASSERT_RC(vp_acquire_ahead(dev, &m.w[1], 1, 0, &p, &f, ps), VP_EHANDLE);
  ASSERT_RC(vp_acquire_ahead(dev, NULL, 1, 0, &p, &f, ps), VP_EINVAL);
  ASSERT_RC(vp_acquire_ahead(dev, m.w, 1, 0, NULL, &f, ps), VP_EINVAL);
  ASSERT_RC(vp_acquire_ahead((vp_device_t){0}, m.w, 1, 0, &p, &f, ps),
            VP_EHANDLE);
  ASSERT_OK(vp_device_close(dev));
  ASSERT_RC(vp_weight_set_lookahead(m.w[0], ps), VP_EHANDLE);
  model_free(&m);
}

/* A lookahead past what the ring holds: the window the ring cuts short is
 * topped up as its slots come free, so every streamed weight after the
 * first is staged by prefetch ahead of its acquire, none at its acquire.
 * (Its chunk was an eighth of the lookahead, which never came free: the
 * window's next weight missed, every time.) */
TEST(lookahead_past_the_ring, TEST_ALL_BACKENDS) {
  int modes[2];
  for (int k = 0, nk = stream_modes(ctx, modes); k < nk; k++) {
    test_note("sim streams %s", modes[k] == VP_SIM_WORKER ? "worker" : "sync");
    uint64_t ps;
    vp_device_t dev = open_dev(ctx, modes[k], 64, &ps); /* a 4-page ring */
    model_t m;
    model_uniform(&m, dev, 2 * NW * ps, 2 * NW, ps, SRC_SCATTER, 90);
    ASSERT_OK(vp_vbar_set_watermark(m.v, 0)); /* every weight streamed */
    vp_stats_t st0 = {.size = sizeof st0}, st1 = {.size = sizeof st1};
    for (int pass = 0; pass < 2; pass++)
      for (size_t i = 0; i < 2 * NW; i++) {
        uint64_t p = 0;
        uint8_t f = 0;
        if (pass == 0 && i == 1) ASSERT_OK(vp_vbar_stats(m.v, &st0));
        ASSERT_OK(vp_acquire(dev, &m.w[i], 1, 0, &p, &f));
        ASSERT_TRUE(f & VP_ACQUIRED_STAGED);
        verify_acquired(ctx, dev, 0, p, f, m.srcs[i].host, ps);
        ASSERT_OK(vp_release(dev, &m.w[i], 1, 0));
      }
    ASSERT_OK(vp_vbar_stats(m.v, &st1));
    test_log("staged at acquire %" PRIu64 ", by prefetch %" PRIu64,
             st1.staged_bytes - st0.staged_bytes,
             st1.prefetch_bytes - st0.prefetch_bytes);
    ASSERT_EQ_U64(st1.staged_bytes - st0.staged_bytes, 0);
    ASSERT_OK(vp_stream_synchronize(dev, 0));
    ASSERT_OK(vp_device_close(dev));
    model_free(&m);
  }
}
