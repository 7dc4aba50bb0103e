/* Fences: eviction waits for work queued before an unpin (worker-thread
 * streams), only for that work, and destroy/close wait too. */
#include "test.h"

#include <stdatomic.h>

/* A "kernel" that sleeps, then reads a page and checksums it. */
typedef struct slow_read {
  const unsigned char *addr;
  size_t size;
  unsigned ms;
  uint64_t sum;
  atomic_int done;
} slow_read_t;

static uint64_t checksum(const unsigned char *p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

static void slow_read_fn(void *arg) {
  slow_read_t *r = arg;
  test_sleep_ms(r->ms);
  r->sum = checksum(r->addr, r->size);
  atomic_store(&r->done, 1);
}

static uint64_t pattern_sum(size_t size, uint64_t key) {
  unsigned char *b = malloc(size);
  ASSERT_NOT_NULL(b);
  test_pattern(b, size, key);
  uint64_t s = checksum(b, size);
  free(b);
  return s;
}

static vp_device_t open_worker(test_ctx_t *ctx, uint64_t cap_pages) {
  vp_options_t opts;
  test_options(ctx, &opts);
  opts.sim_streams = VP_SIM_WORKER;
  return test_open_cap(ctx, &opts, cap_pages);
}

static void start_read(vp_device_t dev, vp_stream_t s, slow_read_t *r,
                       uint64_t addr, size_t size, unsigned ms) {
  r->addr = (const unsigned char *)(uintptr_t)addr;
  r->size = size;
  r->ms = ms;
  r->sum = 0;
  atomic_store(&r->done, 0);
  ASSERT_OK(vp_sim_launch(dev, s, slow_read_fn, r));
}

TEST(fence_evict_waits, TEST_SIM_ONLY) {
  vp_device_t dev = open_worker(ctx, 16);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 2 * ps);
  uint64_t base = test_vbar_base(v);
  vp_stream_t s;
  ASSERT_OK(vp_stream_create(dev, &s));
  ASSERT_OK(test_fault_page(v, 0, NULL));
  test_write_pattern(dev, base, ps, 1234);
  slow_read_t r;
  start_read(dev, s, &r, base, ps, 100);
  ASSERT_OK(vp_unpin(v, 0, ps, s));
  uint64_t freed = 0;
  ASSERT_OK(vp_vbar_free_memory(v, ps, &freed));
  ASSERT_EQ_U64(freed, ps);
  /* It returned only after the reader finished, which read intact data. */
  ASSERT_EQ_INT(atomic_load(&r.done), 1);
  ASSERT_EQ_U64(r.sum, pattern_sum(ps, 1234));
  ASSERT_EQ_INT(test_resid(v, 0), 0);
  ASSERT_EQ_U64(test_vbar_stats(v).evict_waits, 1);
  /* A fence already passed costs no wait. */
  ASSERT_OK(vp_vbar_prioritize(v));
  ASSERT_OK(test_fault_page(v, 0, NULL));
  ASSERT_OK(vp_unpin(v, 0, ps, s));
  ASSERT_OK(vp_stream_synchronize(dev, s));
  ASSERT_OK(vp_vbar_free_memory(v, ps, NULL));
  ASSERT_EQ_U64(test_vbar_stats(v).evict_waits, 1);
  ASSERT_OK(vp_stream_destroy(dev, s));
  ASSERT_OK(vp_device_close(dev));
}

TEST(fence_pressure_waits, TEST_SIM_ONLY) {
  /* Eviction by another VBAR's fault waits too. */
  vp_device_t dev = open_worker(ctx, 2);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 2 * ps);
  uint64_t base = test_vbar_base(v);
  vp_stream_t s;
  ASSERT_OK(vp_stream_create(dev, &s));
  ASSERT_OK(vp_fault(v, 0, 2 * ps, NULL, 0));
  test_write_pattern(dev, base, 2 * ps, 77);
  slow_read_t r;
  start_read(dev, s, &r, base, 2 * ps, 150);
  ASSERT_OK(vp_unpin(v, 0, 2 * ps, s));
  vp_vbar_t w = test_vbar(dev, 2 * ps); /* on top */
  ASSERT_OK(vp_fault(w, 0, 2 * ps, NULL, 0));
  ASSERT_EQ_INT(atomic_load(&r.done), 1);
  ASSERT_EQ_U64(r.sum, pattern_sum(2 * ps, 77));
  ASSERT_EQ_STR(test_map(v), "..");
  ASSERT_GE_U64(test_dev_stats(dev).evict_waits, 1);
  ASSERT_OK(vp_unpin(w, 0, 2 * ps, 0));
  ASSERT_OK(vp_device_close(dev));
}

TEST(fence_two_streams, TEST_SIM_ONLY) {
  vp_device_t dev = open_worker(ctx, 16);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 2 * ps);
  uint64_t base = test_vbar_base(v);
  vp_stream_t a, b;
  ASSERT_OK(vp_stream_create(dev, &a));
  ASSERT_OK(vp_stream_create(dev, &b));
  for (int variant = 0; variant < 2; variant++) {
    ASSERT_OK(vp_vbar_prioritize(v));
    ASSERT_OK(test_fault_page(v, 0, NULL));
    test_write_pattern(dev, base, ps, 5);
    if (variant == 1) ASSERT_OK(test_fault_page(v, 0, NULL)); /* 2 pins */
    slow_read_t ra, rb;
    /* The slow one first: the last fence alone would not cover it. */
    start_read(dev, a, &ra, base, ps, 300);
    ASSERT_OK(vp_unpin(v, 0, ps, a));
    if (variant == 0) ASSERT_OK(test_fault_page(v, 0, NULL)); /* a hit */
    start_read(dev, b, &rb, base, ps, 10);
    ASSERT_OK(vp_unpin(v, 0, ps, b));
    ASSERT_OK(vp_vbar_free_memory(v, ps, NULL));
    ASSERT_EQ_INT(atomic_load(&ra.done), 1);
    ASSERT_EQ_INT(atomic_load(&rb.done), 1);
    ASSERT_EQ_U64(ra.sum, pattern_sum(ps, 5));
    ASSERT_EQ_U64(rb.sum, pattern_sum(ps, 5));
    ASSERT_EQ_INT(test_resid(v, 0), 0);
  }
  ASSERT_OK(vp_device_close(dev)); /* destroys the streams too */
}

TEST(fence_only_its_own, TEST_SIM_ONLY) {
  vp_device_t dev = open_worker(ctx, 16);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 2 * ps);
  uint64_t base = test_vbar_base(v);
  vp_stream_t a;
  ASSERT_OK(vp_stream_create(dev, &a));
  ASSERT_OK(vp_fault(v, 0, 2 * ps, NULL, 0));
  test_write_pattern(dev, base, 2 * ps, 8);
  slow_read_t r;
  start_read(dev, a, &r, base, ps, 800);
  ASSERT_OK(vp_unpin(v, 0, ps, a));
  ASSERT_OK(vp_unpin(v, ps, ps, 0)); /* stream 0 is idle */
  /* Page 1 goes first (tail-first) and does not wait for stream a. */
  uint64_t t0 = test_now_ms(), freed = 0;
  ASSERT_OK(vp_vbar_free_memory(v, ps, &freed));
  uint64_t took = test_now_ms() - t0;
  ASSERT_EQ_U64(freed, ps);
  ASSERT_EQ_STR(test_map(v), "#.");
  ASSERT_EQ_INT(atomic_load(&r.done), 0); /* it did not wait for a */
  test_log("freeing the idle page took %" PRIu64 " ms", took);
  /* Page 0 waits for it. */
  ASSERT_OK(vp_vbar_free_memory(v, ps, &freed));
  ASSERT_EQ_INT(atomic_load(&r.done), 1);
  ASSERT_EQ_U64(r.sum, pattern_sum(ps, 8));
  ASSERT_OK(vp_device_close(dev));
}

TEST(fence_destroy_close_wait, TEST_SIM_ONLY) {
  vp_device_t dev = open_worker(ctx, 16);
  uint64_t ps = test_page_size(ctx);
  vp_stream_t s;
  ASSERT_OK(vp_stream_create(dev, &s));
  /* vp_vbar_destroy waits for the fences of its pages. */
  vp_vbar_t v = test_vbar(dev, ps);
  ASSERT_OK(test_fault_page(v, 0, NULL));
  test_write_pattern(dev, test_vbar_base(v), ps, 31);
  slow_read_t r;
  start_read(dev, s, &r, test_vbar_base(v), ps, 100);
  ASSERT_OK(vp_unpin(v, 0, ps, s));
  ASSERT_OK(vp_vbar_destroy(v));
  ASSERT_EQ_INT(atomic_load(&r.done), 1);
  ASSERT_EQ_U64(r.sum, pattern_sum(ps, 31));
  /* vp_device_close waits too, also for a page pinned again since. */
  vp_vbar_t w = test_vbar(dev, 2 * ps);
  uint64_t wb = test_vbar_base(w);
  ASSERT_OK(vp_fault(w, 0, 2 * ps, NULL, 0));
  test_write_pattern(dev, wb, 2 * ps, 32);
  slow_read_t r0, r1;
  start_read(dev, s, &r0, wb, ps, 100);
  start_read(dev, s, &r1, wb + ps, ps, 50);
  ASSERT_OK(vp_unpin(w, 0, 2 * ps, s));
  ASSERT_OK(test_fault_page(w, 1, NULL)); /* pinned again */
  ASSERT_OK(vp_device_close(dev));
  ASSERT_EQ_INT(atomic_load(&r0.done), 1);
  ASSERT_EQ_INT(atomic_load(&r1.done), 1);
  ASSERT_EQ_U64(r0.sum, pattern_sum(ps, 32));
  uint64_t want1;
  {
    unsigned char *b = malloc(2 * ps);
    ASSERT_NOT_NULL(b);
    test_pattern(b, 2 * ps, 32);
    want1 = checksum(b + ps, ps);
    free(b);
  }
  ASSERT_EQ_U64(r1.sum, want1);
}

/* Work queued on one stream runs in order: a copy, then a launch that
 * reads what it wrote. */
typedef struct check_arg {
  const unsigned char *addr;
  size_t size;
  uint64_t want;
  atomic_int ok;
} check_arg_t;

static void check_fn(void *arg) {
  check_arg_t *c = arg;
  atomic_store(&c->ok, checksum(c->addr, c->size) == c->want ? 1 : -1);
}

TEST(fence_stream_order, TEST_SIM_ONLY) {
  vp_device_t dev = open_worker(ctx, 16);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 4 * ps);
  uint64_t base = test_vbar_base(v);
  vp_stream_t s;
  ASSERT_OK(vp_stream_create(dev, &s));
  ASSERT_OK(vp_fault(v, 0, 4 * ps, NULL, 0));
  unsigned char *src = malloc(4 * ps);
  ASSERT_NOT_NULL(src);
  check_arg_t c[8];
  for (int i = 0; i < 8; i++) {
    test_pattern(src, 4 * ps, 100 + (uint64_t)i);
    c[i].addr = (const unsigned char *)(uintptr_t)base;
    c[i].size = 4 * ps;
    c[i].want = checksum(src, 4 * ps);
    atomic_store(&c[i].ok, 0);
    ASSERT_OK(vp_copy_to_device(dev, base, src, 4 * ps, s));
    ASSERT_OK(vp_sim_launch(dev, s, check_fn, &c[i]));
    ASSERT_OK(vp_stream_synchronize(dev, s)); /* src is reused */
    ASSERT_EQ_INT(atomic_load(&c[i].ok), 1);
  }
  free(src);
  ASSERT_OK(vp_unpin(v, 0, 4 * ps, s));
  ASSERT_OK(vp_device_close(dev));
}
