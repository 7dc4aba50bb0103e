/* The fixture of the streaming tests: see stream_fixture.h. */
#include "stream_fixture.h"

bool is_sim(test_ctx_t *ctx) { return ctx->backend == VP_BACKEND_SIM; }

/* test_options plus the streaming options; staging in pages. */
void sopts(test_ctx_t *ctx, vp_options_t *o, uint64_t staging_pages,
                  uint64_t lookahead, int sim_streams) {
  test_options(ctx, o);
  o->staging_size = staging_pages * o->page_size;
  o->lookahead = lookahead;
  o->sim_streams = sim_streams;
}

/* Weights i at off[i] with size[i] (given); sources filled with patterns,
 * laid out back to back (SRC_CONTIG) or with a 4 KiB gap after each
 * (SRC_SCATTER), so copies merge or never do. */
void model_init(model_t *m, vp_device_t dev, uint64_t vbar_size,
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
void model_uniform(model_t *m, vp_device_t dev, uint64_t vbar_size,
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
void model_random(model_t *m, vp_device_t dev, uint64_t vbar_size,
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

void model_free(model_t *m) {
  free(m->off);
  free(m->size);
  free(m->buf);
  free(m->srcs);
  free(m->w);
}

vp_stats_t dstats(vp_device_t dev) { return test_dev_stats(dev); }

void chk_fn(void *arg) {
  chk_t *k = arg;
  if (memcmp((const void *)(uintptr_t)k->ptr, k->src, k->size) != 0)
    atomic_fetch_add(&k->c->fails, 1);
  atomic_fetch_add(&k->c->runs, 1);
  free(k);
}

void launch_check(vp_device_t dev, vp_stream_t s, uint64_t ptr,
                         const void *src, uint64_t size, checks_t *c) {
  chk_t *k = malloc(sizeof *k);
  ASSERT_NOT_NULL(k);
  *k = (chk_t){src, ptr, size, c};
  atomic_fetch_add(&c->launched, 1);
  ASSERT_OK(vp_sim_launch(dev, s, chk_fn, k));
}

void checks_expect_clean(vp_device_t dev, vp_stream_t s, checks_t *c) {
  ASSERT_OK(vp_stream_synchronize(dev, s));
  uint64_t runs = atomic_load(&c->runs), launched = atomic_load(&c->launched);
  uint64_t wrong = atomic_load(&c->fails);
  ASSERT_EQ_U64(runs, launched);
  ASSERT_EQ_U64(wrong, 0); /* kernels that saw wrong bytes */
}

/* Read back an acquired resident weight (pinned) on `s` and compare. */
void verify_resident(vp_device_t dev, vp_stream_t s, uint64_t ptr,
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
void verify_staged_sim(vp_device_t dev, vp_stream_t s, uint64_t ptr,
                              const void *src, uint64_t size) {
  ASSERT_OK(vp_stream_synchronize(dev, s));
  ASSERT_MEM_EQ((const void *)(uintptr_t)ptr, src, size);
}

/* Check an acquired weight in whatever way the backend allows. */
void verify_acquired(test_ctx_t *ctx, vp_device_t dev, vp_stream_t s,
                            uint64_t ptr, uint8_t flags, const void *src,
                            uint64_t size) {
  if (flags & VP_ACQUIRED_RESIDENT) verify_resident(dev, s, ptr, src, size);
  else if (is_sim(ctx)) verify_staged_sim(dev, s, ptr, src, size);
}

bool in_vbar(const model_t *m, uint64_t ptr) {
  uint64_t size = 0;
  ASSERT_OK(vp_vbar_size(m->v, &size));
  return ptr >= m->base && ptr < m->base + size;
}

bool map_has_pin(vp_vbar_t v) { return strchr(test_map(v), 'P'); }

bool slow_ok(slow_t *k) { return atomic_load(&k->ok) == 1; }
bool slow_done(slow_t *k) { return atomic_load(&k->done) == 1; }

void slow_fn(void *arg) {
  slow_t *k = arg;
  test_sleep_ms(k->ms);
  atomic_store(&k->ok, memcmp((const void *)(uintptr_t)k->ptr, k->expect,
                              k->size) == 0);
  atomic_store(&k->done, 1);
}

void fill_fn(void *arg) {
  fill_t *f = arg;
  memcpy((void *)(uintptr_t)f->ptr, f->src, f->size);
}
