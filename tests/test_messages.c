/* Messages name the call the user made: each public entry below is made to
 * fail in a lower layer (the sim's fail-nth injection walks every failable
 * step), and its vp_last_error() must start with "<entry>: ", whichever
 * layer wrote the rest. */
#include "test.h"
#include "compat.h"

typedef struct walk {
  int64_t nth;
  bool all_ok;
  int failures; /* calls that failed and were checked */
} walk_t;

static int check(walk_t *w, int rc, const char *entry) {
  if (rc == VP_OK || rc == VP_MISS) {
    if (rc == VP_MISS) w->all_ok = false;
    return rc;
  }
  w->all_ok = false;
  w->failures++;
  test_note("sim_fail_nth %" PRId64 ": %s returned %s: %s", w->nth, entry,
            vp_err_name(rc), vp_last_error());
  char want[64];
  snprintf(want, sizeof want, "%s: ", entry);
  ASSERT_TRUE(strncmp(vp_last_error(), want, strlen(want)) == 0);
  return rc;
}

#define CALL(w, fn, ...) check((w), fn(__VA_ARGS__), #fn)

/* Host buffer, weights (one staged, one in place), acquire and release,
 * fault, copy, unpin, a file read, and teardown, with call nth failing. */
static void run(test_ctx_t *ctx, walk_t *w, int fd) {
  vp_options_t o;
  test_options(ctx, &o);
  o.staging_size = 2 * o.page_size;
  o.lookahead = o.page_size;
  o.sim_fail_nth = w->nth;
  uint64_t ps = o.page_size;
  vp_device_t dev;
  if (CALL(w, vp_device_open, &o, &dev)) return;
  vp_hostbuf_t hb;
  void *host = NULL;
  vp_vbar_t v;
  vp_stream_t s = 0;
  if (CALL(w, vp_hostbuf_alloc, dev, 2 * ps, 4 * ps, &hb) == VP_OK) {
    vp_hostbuf_info_t hi;
    if (CALL(w, vp_hostbuf_info, hb, &hi) == VP_OK) host = hi.ptr;
    CALL(w, vp_hostbuf_grow, hb, 3 * ps);
  }
  if (CALL(w, vp_vbar_create, dev, 8 * ps, &v)) goto close;
  CALL(w, vp_stream_create, dev, &s);
  uint64_t off[2] = {0, 4 * ps}, size[2] = {ps, ps};
  vp_source_t src[2] = {{.kind = VP_SOURCE_NONE}, {.kind = VP_SOURCE_NONE}};
  if (host) {
    src[0] = (vp_source_t){.kind = VP_SOURCE_HOST, .host = host};
    src[1] = (vp_source_t){.kind = VP_SOURCE_HOST,
                           .host = (char *)host + ps};
  }
  vp_weight_t wt[2];
  if (CALL(w, vp_weights_create, v, 2, off, size, src, wt) == VP_OK) {
    CALL(w, vp_vbar_set_watermark, v, 2 * ps); /* the second one stages */
    uint64_t ptr[2];
    if (CALL(w, vp_acquire, dev, wt, 2, s, ptr, NULL) == VP_OK)
      CALL(w, vp_release, dev, wt, 2, s);
    CALL(w, vp_prefetch, dev, wt[0]);
    CALL(w, vp_prefetch_ahead, dev, wt[0], ps);
    CALL(w, vp_prefetch_sm, dev, wt[0], ps, 4);
    CALL(w, vp_vbar_prioritize, v);
  }
  if (CALL(w, vp_fault, v, 2 * ps, ps, NULL, 0) == VP_OK) {
    char buf[64] = {1, 2, 3};
    uint64_t base = test_vbar_base(v) + 2 * ps;
    CALL(w, vp_copy_to_device, dev, base, buf, sizeof buf, s);
    CALL(w, vp_file_read_to_device, dev, fd, 0, 4096, base, s);
    CALL(w, vp_copy_to_host, dev, buf, base, sizeof buf, s);
    CALL(w, vp_stream_synchronize, dev, s);
    CALL(w, vp_unpin, v, 2 * ps, ps, s);
  }
  uint64_t freed;
  CALL(w, vp_vbar_free_memory, v, 8 * ps, &freed);
  vp_device_info_t info;
  CALL(w, vp_device_info, dev, &info);
  CALL(w, vp_vbar_destroy, v);
  if (s) CALL(w, vp_stream_destroy, dev, s);
close:
  ASSERT_OK(vp_device_close(dev));
}

TEST(messages_name_the_entry, TEST_SIM_ONLY) {
  char path[] = "/tmp/vpager-msg-XXXXXX";
  int fd = mkstemp(path);
  ASSERT_TRUE(fd >= 0);
  unlink(path);
  char page[4096] = {7};
  ASSERT_EQ_INT(write(fd, page, sizeof page), (int)sizeof page);
  int clean = 0, failures = 0;
  int64_t nth;
  for (nth = 1; nth < 2000 && clean < 8; nth++) {
    walk_t w = {nth, true, 0};
    run(ctx, &w, fd);
    failures += w.failures;
    clean = w.all_ok ? clean + 1 : 0;
  }
  close(fd);
  test_log("%" PRId64 " rungs, %d failures checked", nth - clean, failures);
  ASSERT_EQ_INT(clean, 8);
  ASSERT_GT_INT(failures, 20);
}

/* The cases the issue names: a failure deep in vp_acquire (its staging ring
 * is a VBAR) reports vp_acquire, not vp_vbar_create. */
TEST(messages_acquire_ring, TEST_SIM_ONLY) {
  vp_options_t o;
  test_options(ctx, &o);
  o.staging_size = 64 * o.page_size; /* more than the device has */
  vp_device_t dev = test_open(ctx, &o);
  uint64_t ps = o.page_size;
  vp_vbar_t v = test_vbar(dev, 4 * ps);
  uint64_t off = 0, size = ps;
  vp_weight_t wt;
  ASSERT_OK(vp_weights_create(v, 1, &off, &size, NULL, &wt));
  ASSERT_OK(vp_vbar_set_watermark(v, 0));
  uint64_t ptr;
  ASSERT_FAILS(vp_acquire(dev, &wt, 1, 0, &ptr, NULL));
  ASSERT_TRUE(strncmp(vp_last_error(), "vp_acquire: ", 12) == 0);
  ASSERT_STR_CONTAINS(vp_last_error(), "staging ring");
  ASSERT_OK(vp_weight_destroy(wt));
  ASSERT_OK(vp_vbar_destroy(v));
  ASSERT_OK(vp_device_close(dev));
}
