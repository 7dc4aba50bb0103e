/* Streaming: weights, vp_acquire / vp_release, the staging ring, prefetch.
 *
 * Data checks: on the simulated device a "kernel" (vp_sim_launch) queued on
 * the caller's stream compares the bytes at each acquired pointer with the
 * weight's source at the moment the stream reaches it; in worker mode the
 * copy stream and the caller's stream are different threads, so a missing
 * wait shows up as wrong bytes (and as a race under TSan). On CUDA staged
 * pointers cannot be read through the API, so resident weights are read
 * back with vp_copy_to_host while acquired (their pages are pinned). */
#include "test.h"

#include <stdatomic.h>
#include <sys/mman.h>

/* ------------------------------------------------------------- helpers */

static bool is_sim(test_ctx_t *ctx) { return ctx->backend == VP_BACKEND_SIM; }

/* test_options plus the streaming options; staging in pages. */
static void sopts(test_ctx_t *ctx, vp_options_t *o, uint64_t staging_pages,
                  uint64_t lookahead, int sim_streams) {
  test_options(ctx, o);
  o->staging_size = staging_pages * o->page_size;
  o->lookahead = lookahead;
  o->sim_streams = sim_streams;
}

/* A VBAR with n weights whose sources live in one host buffer. */
typedef struct model {
  vp_vbar_t v;
  uint64_t base;
  size_t n;
  uint64_t *off, *size;
  unsigned char *buf; /* sources */
  uint64_t buf_size;
  vp_source_t *srcs;
  vp_weight_t *w;
} model_t;

enum { SRC_CONTIG = 0, SRC_SCATTER = 1 };

/* Weights i at off[i] with size[i] (given); sources filled with patterns,
 * laid out back to back (SRC_CONTIG) or with a 4 KiB gap after each
 * (SRC_SCATTER), so copies merge or never do. */
static void model_init(model_t *m, vp_device_t dev, uint64_t vbar_size,
                       size_t n, const uint64_t *off, const uint64_t *size,
                       int layout, uint64_t key) {
  memset(m, 0, sizeof *m);
  m->v = test_vbar(dev, vbar_size);
  m->base = test_vbar_base(m->v);
  m->n = n;
  m->off = malloc(n * sizeof *m->off);
  m->size = malloc(n * sizeof *m->size);
  m->srcs = calloc(n, sizeof *m->srcs);
  m->w = calloc(n, sizeof *m->w);
  ASSERT_TRUE(m->off && m->size && m->srcs && m->w);
  uint64_t gap = layout == SRC_SCATTER ? 4096 : 0, total = 0;
  for (size_t i = 0; i < n; i++) total += size[i] + gap;
  m->buf_size = total;
  m->buf = malloc(total);
  ASSERT_NOT_NULL(m->buf);
  uint64_t at = 0;
  for (size_t i = 0; i < n; i++) {
    m->off[i] = off[i];
    m->size[i] = size[i];
    test_pattern(m->buf + at, size[i], key * 1000003 + i + 1);
    m->srcs[i] = (vp_source_t){.kind = VP_SOURCE_HOST, .host = m->buf + at};
    at += size[i] + gap;
  }
  ASSERT_OK(vp_weights_create(m->v, n, m->off, m->size, m->srcs, m->w));
}

/* n equal weights of `size` back to back from offset 0. */
static void model_uniform(model_t *m, vp_device_t dev, uint64_t vbar_size,
                          size_t n, uint64_t size, int layout, uint64_t key) {
  uint64_t *off = malloc(n * sizeof *off), *sz = malloc(n * sizeof *sz);
  ASSERT_TRUE(off && sz);
  for (size_t i = 0; i < n; i++) off[i] = i * size, sz[i] = size;
  model_init(m, dev, vbar_size, n, off, sz, layout, key);
  free(off);
  free(sz);
}

/* Random sizes in [lo, hi] (multiples of 16), small random gaps, as many as
 * fit in vbar_size. */
static void model_random(model_t *m, vp_device_t dev, uint64_t vbar_size,
                         uint64_t lo, uint64_t hi, int layout,
                         test_rng_t *rng, uint64_t key) {
  size_t cap = 16, n = 0;
  uint64_t *off = malloc(cap * sizeof *off), *sz = malloc(cap * sizeof *sz);
  ASSERT_TRUE(off && sz);
  uint64_t at = 0;
  for (;;) {
    uint64_t s = (lo + test_rand_below(rng, hi - lo + 1)) & ~(uint64_t)15;
    if (s == 0) s = 16;
    if (at + s > vbar_size) break;
    if (n == cap) {
      cap *= 2;
      off = realloc(off, cap * sizeof *off);
      sz = realloc(sz, cap * sizeof *sz);
      ASSERT_TRUE(off && sz);
    }
    off[n] = at;
    sz[n] = s;
    n++;
    at += s + (test_rand_below(rng, 4) == 0 ? 16 * test_rand_below(rng, 17)
                                             : 0);
  }
  model_init(m, dev, vbar_size, n, off, sz, layout, key);
  free(off);
  free(sz);
}

static void model_free(model_t *m) {
  free(m->off);
  free(m->size);
  free(m->buf);
  free(m->srcs);
  free(m->w);
}

static vp_stats_t dstats(vp_device_t dev) { return test_dev_stats(dev); }

/* A kernel: compare the bytes at ptr with src when the stream gets here. */
typedef struct checks {
  atomic_uint_fast64_t fails, runs, launched;
} checks_t;

typedef struct chk {
  const unsigned char *src;
  uint64_t ptr, size;
  checks_t *c;
} chk_t;

static void chk_fn(void *arg) {
  chk_t *k = arg;
  if (memcmp((const void *)(uintptr_t)k->ptr, k->src, k->size) != 0)
    atomic_fetch_add(&k->c->fails, 1);
  atomic_fetch_add(&k->c->runs, 1);
  free(k);
}

static void launch_check(vp_device_t dev, vp_stream_t s, uint64_t ptr,
                         const void *src, uint64_t size, checks_t *c) {
  chk_t *k = malloc(sizeof *k);
  ASSERT_NOT_NULL(k);
  *k = (chk_t){src, ptr, size, c};
  atomic_fetch_add(&c->launched, 1);
  ASSERT_OK(vp_sim_launch(dev, s, chk_fn, k));
}

static void checks_expect_clean(vp_device_t dev, vp_stream_t s, checks_t *c) {
  ASSERT_OK(vp_stream_synchronize(dev, s));
  uint64_t runs = atomic_load(&c->runs), launched = atomic_load(&c->launched);
  uint64_t wrong = atomic_load(&c->fails);
  ASSERT_EQ_U64(runs, launched);
  ASSERT_EQ_U64(wrong, 0); /* kernels that saw wrong bytes */
}

/* Read back an acquired resident weight (pinned) on `s` and compare. */
static void verify_resident(vp_device_t dev, vp_stream_t s, uint64_t ptr,
                            const void *src, uint64_t size) {
  void *buf = malloc(size);
  ASSERT_NOT_NULL(buf);
  memset(buf, 0xee, size);
  ASSERT_OK(vp_copy_to_host(dev, buf, ptr, size, s));
  ASSERT_OK(vp_stream_synchronize(dev, s));
  ASSERT_MEM_EQ(buf, src, size);
  free(buf);
}

/* Sim only: a staged pointer is host memory; read it after a sync. */
static void verify_staged_sim(vp_device_t dev, vp_stream_t s, uint64_t ptr,
                              const void *src, uint64_t size) {
  ASSERT_OK(vp_stream_synchronize(dev, s));
  ASSERT_MEM_EQ((const void *)(uintptr_t)ptr, src, size);
}

/* Check an acquired weight in whatever way the backend allows. */
static void verify_acquired(test_ctx_t *ctx, vp_device_t dev, vp_stream_t s,
                            uint64_t ptr, uint8_t flags, const void *src,
                            uint64_t size) {
  if (flags & VP_ACQUIRED_RESIDENT) verify_resident(dev, s, ptr, src, size);
  else if (is_sim(ctx)) verify_staged_sim(dev, s, ptr, src, size);
}

static bool in_vbar(const model_t *m, uint64_t ptr) {
  uint64_t size = 0;
  ASSERT_OK(vp_vbar_size(m->v, &size));
  return ptr >= m->base && ptr < m->base + size;
}

static bool map_has_pin(vp_vbar_t v) { return strchr(test_map(v), 'P'); }

/* -------------------------------------------------------- 1. basics */

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

/* -------------------------------------------------------- 2. ordering */

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

/* ----------------------------------------------- 3. random integrity */

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

/* ---------------------------------------------- 4. ring reuse fences */

/* A slow reader: sleeps, then checksums the bytes at ptr. */
typedef struct slow {
  uint64_t ptr, size;
  unsigned ms;
  const unsigned char *expect;
  atomic_int done;
  atomic_int ok; /* 1 = the bytes matched */
} slow_t;

static bool slow_ok(slow_t *k) { return atomic_load(&k->ok) == 1; }
static bool slow_done(slow_t *k) { return atomic_load(&k->done) == 1; }

static void slow_fn(void *arg) {
  slow_t *k = arg;
  test_sleep_ms(k->ms);
  atomic_store(&k->ok, memcmp((const void *)(uintptr_t)k->ptr, k->expect,
                              k->size) == 0);
  atomic_store(&k->done, 1);
}

/* A kernel that writes a pattern (a caller filling an EMPTY weight). */
typedef struct fill {
  uint64_t ptr, size;
  const void *src;
} fill_t;

static void fill_fn(void *arg) {
  fill_t *f = arg;
  memcpy((void *)(uintptr_t)f->ptr, f->src, f->size);
}

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

/* -------------------------------------------------------- 5. ring full */

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

/* ---------------------------------------------------------- 6. prefetch */

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

/* Prefetch wraps around to the start of the VBAR for the next pass. */
TEST(stream_prefetch_wraps, TEST_ALL_BACKENDS) {
  vp_options_t o;
  sopts(ctx, &o, 4, 0, VP_SIM_SYNC);
  uint64_t ps = o.page_size;
  o.lookahead = ps;
  vp_device_t dev = test_open_cap(ctx, &o, 16);
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

/* --------------------------------------------------------- 7. bad input */

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

/* ------------------------------------------------------- 8. source none */

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

/* ------------------------------------------------------------ 9. merge */

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

/* --------------------------------------------------- 10. destroy/close */

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
