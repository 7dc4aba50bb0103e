/* A weight rewritten in place waits for the readers its pages' last
 * release left queued (vp_release: "reused only after it completes"): a
 * new source, a weight made anew over the same resident pages, a prefetch
 * filling it ahead, or a caller writing an empty weight. Each trigger runs
 * here on the simulated device with worker streams, and in test_gpu.c on
 * CUDA with a spinning kernel as the reader. */
#include <stdlib.h>
#include <string.h>

#include "refill.h"
#include "stream_fixture.h"

const char *const refill_names[REFILL_VARIANTS] = {
    "set_source, other stream", "set_source, same stream",
    "set_source, prefetch", "destroy + create", "made anew empty"};

/* w[1] rewritten by `variant`; the acquire's stream in *s, pointer in *p. */
static void rewrite(vp_device_t dev, vp_vbar_t v, vp_weight_t *w,
                    const uint64_t *off, const uint64_t *size,
                    const vp_source_t *fresh, int variant, vp_stream_t a,
                    vp_stream_t b, vp_stream_t *s, uint64_t *p) {
  uint8_t f = 0;
  *s = variant == REFILL_SAME_STREAM ? a : b;
  switch (variant) {
  case REFILL_OTHER_STREAM:
  case REFILL_SAME_STREAM:
    ASSERT_OK(vp_weight_set_source(w[1], fresh));
    break;
  case REFILL_PREFETCH: /* acquiring w[0] fills w[1] ahead */
    ASSERT_OK(vp_weight_set_source(w[1], fresh));
    ASSERT_OK(vp_device_set_lookahead(dev, 2 * size[1]));
    ASSERT_OK(vp_acquire(dev, &w[0], 1, b, p, &f));
    ASSERT_OK(vp_release(dev, &w[0], 1, b));
    ASSERT_GE_U64(dstats(dev).prefetch_bytes, size[1]);
    break;
  case REFILL_RECREATE:
  case REFILL_EMPTY:
    ASSERT_OK(vp_weight_destroy(w[1]));
    ASSERT_OK(vp_weights_create(v, 1, &off[1], &size[1],
                                variant == REFILL_EMPTY ? NULL : fresh, &w[1]));
    break;
  }
  ASSERT_OK(vp_acquire(dev, &w[1], 1, *s, p, &f));
  ASSERT_EQ_INT(f & VP_ACQUIRED_RESIDENT, VP_ACQUIRED_RESIDENT);
  if (variant == REFILL_EMPTY) { /* the caller writes it, on its stream */
    ASSERT_EQ_INT(f & VP_ACQUIRED_EMPTY, VP_ACQUIRED_EMPTY);
    ASSERT_OK(vp_copy_to_device(dev, *p, fresh->host, size[1], *s));
  } else {
    ASSERT_EQ_INT(f & VP_ACQUIRED_COPIED, VP_ACQUIRED_COPIED);
  }
}

void refill_run(test_ctx_t *ctx, vp_options_t *o, int variant,
                refill_reader_t *reader) {
  (void)ctx;
  uint64_t ps = o->page_size;
  vp_device_t dev = test_open_cap(ctx, o, 16);
  vp_vbar_t v = test_vbar(dev, 2 * ps);
  unsigned char *buf = malloc(3 * ps); /* w0, w1, then w1's new bytes */
  ASSERT_NOT_NULL(buf);
  for (int i = 0; i < 3; i++) test_pattern(buf + i * ps, ps, 70 + i);
  uint64_t off[2] = {0, ps}, size[2] = {ps, ps};
  vp_source_t src[2], fresh = {.kind = VP_SOURCE_HOST, .host = buf + 2 * ps};
  for (int i = 0; i < 2; i++)
    src[i] = (vp_source_t){.kind = VP_SOURCE_HOST, .host = buf + i * ps};
  vp_weight_t w[2];
  ASSERT_OK(vp_weights_create(v, 2, off, size, src, w));
  vp_stream_t a = 0, b = 0, s = 0;
  ASSERT_OK(vp_stream_create(dev, &a));
  ASSERT_OK(vp_stream_create(dev, &b));
  uint64_t p = 0;
  uint8_t f = 0;
  ASSERT_OK(vp_acquire(dev, w, 2, a, (uint64_t[2]){0}, NULL));
  ASSERT_OK(vp_release(dev, w, 2, a));
  ASSERT_OK(vp_acquire(dev, &w[1], 1, a, &p, &f));
  ASSERT_EQ_INT(f & VP_ACQUIRED_RESIDENT, VP_ACQUIRED_RESIDENT);
  reader->launch(reader, dev, a, p, ps, buf + ps);
  ASSERT_OK(vp_release(dev, &w[1], 1, a));

  rewrite(dev, v, w, off, size, &fresh, variant, a, b, &s, &p);
  /* Else this run proves nothing: the reader must still be queued. */
  ASSERT_TRUE(reader->running(reader));
  verify_resident(dev, s, p, buf + 2 * ps, ps); /* the new bytes */
  ASSERT_OK(vp_release(dev, &w[1], 1, s));
  ASSERT_OK(vp_stream_synchronize(dev, a));
  ASSERT_TRUE(reader->saw_expected(reader)); /* the old ones */
  ASSERT_OK(vp_stream_destroy(dev, a));
  ASSERT_OK(vp_stream_destroy(dev, b));
  ASSERT_OK(vp_device_close(dev));
  free(buf);
}

/* ------------------------------------------------- the simulated reader */

static void sim_launch(refill_reader_t *r, vp_device_t dev, vp_stream_t s,
                       uint64_t ptr, uint64_t size, const void *expect) {
  slow_t *k = r->state;
  *k = (slow_t){.ptr = ptr, .size = size, .ms = 200, .expect = expect};
  ASSERT_OK(vp_sim_launch(dev, s, slow_fn, k));
}
static bool sim_running(refill_reader_t *r) { return !slow_done(r->state); }
static bool sim_saw(refill_reader_t *r) {
  return slow_done(r->state) && slow_ok(r->state);
}

TEST(refill_waits_for_readers, TEST_SIM_ONLY) {
  for (int variant = 0; variant < REFILL_VARIANTS; variant++) {
    test_note("%s", refill_names[variant]);
    vp_options_t o;
    sopts(ctx, &o, 4, 0, VP_SIM_WORKER);
    slow_t k;
    refill_reader_t r = {sim_launch, sim_running, sim_saw, &k};
    refill_run(ctx, &o, variant, &r);
  }
}
