/* The debug build's invariant checks (make DEBUG=1, src/invariants.c): a
 * count the pager keeps by hand that disagrees with the page tables ends
 * the process at the next public call, with a dump. The release build never
 * aborts, so there the test only runs the same calls. */
#include "test.h"
#include "compat.h"

#include <signal.h>

#include "internal.h"
#include "peer.h"

/* The VBAR behind handle v (the test links the static library). */
static vp__vbar_t *vbar_of(vp_device_t dev, vp_vbar_t v) {
  vp__device_t *d = vp__registry_get(dev.id);
  ASSERT_NOT_NULL(d);
  vp__vbar_t *vb = vp__table_get(&d->vbars, v.id);
  ASSERT_NOT_NULL(vb);
  return vb;
}

/* In a peer: corrupt one count (which: the arg), then make a public
 * call. */
static void corrupt_child(test_ctx_t *ctx, const void *arg, int in,
                          int out) {
  (void)in;
  int which = *(const int *)arg;
  put_u64(out, 0);
  vp_options_t o;
  test_options(ctx, &o);
  uint64_t ps = o.page_size;
  o.staging_size = ps;
  vp_device_t dev = test_open(ctx, &o);
  vp_vbar_t v = test_vbar(dev, 4 * ps);
  test_load_pages(v, 0, 2);
  vp__vbar_t *vb = vbar_of(dev, v);
  if (which == 0) vb->resident++;
  else if (which == 1) vb->pinned++;
  else if (which == 2) vb->dev->committed += vb->dev->page_size;
  else if (which == 3) { /* the ring's bytes in slots */
    ASSERT_OK(vp__staging_open(vb->dev));
    vb->dev->staging->taken += 256;
  } else { /* a skip index stepping over a weight that is not resident */
    static char src[64];
    uint64_t off = 2 * ps, size = sizeof src;
    vp_source_t s = {.kind = VP_SOURCE_HOST, .host = src};
    vp_weight_t w;
    ASSERT_OK(vp_weights_create(v, 1, &off, &size, &s, &w));
    vb->skip = malloc(2 * sizeof *vb->skip);
    ASSERT_NOT_NULL(vb->skip);
    vb->skip[0] = vb->skip[1] = 1;
    vb->skip_ok = true;
    vb->skip_epoch = vb->epoch;
  }
  vp_vbar_prioritize(v);
  _exit(0);
}

static int corrupt_and_call(test_ctx_t *ctx, int which) {
  peer_t p = peer_start(ctx, corrupt_child, &which, sizeof which);
  return peer_wait(&p);
}

TEST(invariants_abort_on_mismatch, TEST_SIM_ONLY) {
  for (int which = 0; which < 5; which++) {
    test_note("count %d", which);
    int status = corrupt_and_call(ctx, which);
#ifdef VP_DEBUG
    ASSERT_TRUE(WIFSIGNALED(status));
    ASSERT_EQ_INT(WTERMSIG(status), SIGABRT);
#else
    ASSERT_TRUE(WIFEXITED(status));
    ASSERT_EQ_INT(WEXITSTATUS(status), 0);
#endif
  }
}
