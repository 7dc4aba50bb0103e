/* Fault injection on the simulated device: failed and transient commits,
 * a broken device, and every failure rung of open walked one by one. */
#include "test.h"
#include "compat.h"

#include <errno.h>
#include <pthread.h>

TEST(inject_fail_commit, TEST_SIM_ONLY) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 4 * ps);
  ASSERT_OK(vp_sim_inject(dev, VP_SIM_FAIL_COMMIT, 1));
  ASSERT_RC(test_fault_page(v, 0, NULL), VP_MISS);
  vp_stats_t s = test_vbar_stats(v);
  ASSERT_EQ_U64(s.misses, 1);
  ASSERT_EQ_U64(s.commit_failures, 1);
  ASSERT_EQ_U64(s.pages_committed, 0);
  ASSERT_EQ_STR(test_map(v), "....");
  ASSERT_EQ_U64(test_info(dev).committed, 0);
  /* The device still works. */
  ASSERT_OK(test_fault_page(v, 0, NULL));
  test_write_pattern(dev, test_vbar_base(v), ps, 1);
  ASSERT_OK(vp_unpin(v, 0, ps, 0));

  /* The second commit of a three-page fault fails: a miss, nothing
   * pinned, the page committed before it stays resident. */
  ASSERT_OK(vp_sim_inject(dev, VP_SIM_FAIL_COMMIT, 2));
  ASSERT_RC(vp_fault(v, ps, 3 * ps, NULL, 0), VP_MISS);
  ASSERT_EQ_STR(test_map(v), "##..");
  ASSERT_EQ_U64(test_info(dev).committed, 2 * ps);
  uint32_t gens[3];
  ASSERT_OK(vp_fault(v, ps, 3 * ps, gens, 3));
  ASSERT_EQ_STR(test_map(v), "#PPP");
  ASSERT_OK(vp_unpin(v, ps, 3 * ps, 0));
  /* Page 0's data survived all that. */
  ASSERT_OK(test_fault_page(v, 0, NULL));
  ASSERT_TRUE(test_check_pattern(dev, test_vbar_base(v), ps, 1));
  ASSERT_OK(vp_unpin(v, 0, ps, 0));
  ASSERT_OK(vp_device_close(dev));
}

TEST(inject_transient, TEST_SIM_ONLY) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  vp_vbar_t v = test_vbar(dev, 4 * ps);
  /* One transient failure is retried. */
  ASSERT_OK(vp_sim_inject(dev, VP_SIM_TRANSIENT, 1));
  ASSERT_OK(test_fault_page(v, 0, NULL));
  vp_stats_t s = test_vbar_stats(v);
  ASSERT_EQ_U64(s.commit_retries, 1);
  ASSERT_EQ_U64(s.misses, 0);
  ASSERT_OK(vp_unpin(v, 0, ps, 0));
  /* In a multi-page fault too. */
  ASSERT_OK(vp_sim_inject(dev, VP_SIM_TRANSIENT, 1));
  ASSERT_OK(vp_fault(v, ps, 2 * ps, NULL, 0));
  ASSERT_EQ_U64(test_vbar_stats(v).commit_retries, 2);
  ASSERT_OK(vp_unpin(v, ps, 2 * ps, 0));
  /* Endless transient failures: a miss after bounded retries. */
  ASSERT_OK(vp_sim_inject(dev, VP_SIM_TRANSIENT, 1000000));
  ASSERT_RC(test_fault_page(v, 3, NULL), VP_MISS);
  s = test_vbar_stats(v);
  ASSERT_EQ_U64(s.misses, 1);
  ASSERT_GE_U64(s.commit_failures, 1);
  ASSERT_GT_U64(s.commit_retries, 2);
  ASSERT_LT_U64(s.commit_retries, 1000);
  ASSERT_EQ_INT(test_resid(v, 3), 0);
  ASSERT_OK(vp_sim_inject(dev, VP_SIM_TRANSIENT, 0));
  ASSERT_OK(test_fault_page(v, 3, NULL));
  ASSERT_OK(vp_unpin(v, 3 * ps, ps, 0));
  ASSERT_OK(vp_device_close(dev));
}

TEST(inject_break, TEST_SIM_ONLY) {
  for (int worker = 0; worker < 2; worker++) {
    vp_options_t opts;
    test_options(ctx, &opts);
    opts.sim_streams = worker ? VP_SIM_WORKER : VP_SIM_SYNC;
    vp_device_t dev = test_open(ctx, &opts);
    uint64_t ps = opts.page_size;
    vp_vbar_t v = test_vbar(dev, 4 * ps);
    vp_stream_t s;
    ASSERT_OK(vp_stream_create(dev, &s));
    test_load_pages(v, 0, 2);
    ASSERT_OK(test_fault_page(v, 0, NULL));
    ASSERT_OK(vp_sim_inject(dev, VP_SIM_BREAK, 0));
    char buf[16] = {0};
    vp_vbar_t w;
    ASSERT_RC(test_fault_page(v, 3, NULL), VP_EDEVICE);
    ASSERT_TRUE(vp_last_error()[0] != '\0');
    ASSERT_RC(vp_vbar_create(dev, ps, &w), VP_EDEVICE);
    ASSERT_RC(vp_copy_to_device(dev, test_vbar_base(v), buf, 16, s),
              VP_EDEVICE);
    ASSERT_RC(vp_fault(v, 2 * ps, ps, NULL, 0), VP_EDEVICE);
    ASSERT_RC(vp_stream_create(dev, &s), VP_EDEVICE);
    /* Close still works and frees everything (pinned page included). */
    ASSERT_OK(vp_device_close(dev));
    ASSERT_RC(vp_device_close(dev), VP_EHANDLE);
  }
}

/* Open file descriptors (handles) and threads of this process. */
static int fds(void) {
  int n = test_fd_count();
  ASSERT_GE_INT(n, 0);
  return n;
}

static int threads(void) {
  int n = test_thread_count();
  ASSERT_GE_INT(n, 0);
  return n;
}

typedef struct rung {
  bool opened, all_ok;
} rung_t;

static void fail_step(int rc, bool *all_ok, const char *what, int64_t nth) {
  if (rc == VP_OK) return;
  *all_ok = false;
  if (rc == VP_MISS) return;
  test_note("sim_fail_nth %" PRId64 ": %s returned %s", nth, what,
            vp_err_name(rc));
  ASSERT_LT_INT(rc, 0);
  ASSERT_TRUE(vp_last_error()[0] != '\0');
  ASSERT_NOT_NULL(vp_err_name(rc));
}

/* Open, create a VBAR and a stream, fault, copy, unpin, destroy, close,
 * with the nth failable call failing. */
static rung_t run_rung(test_ctx_t *ctx, int streams, const char *shared,
                       int64_t nth) {
  vp_options_t opts;
  test_options(ctx, &opts);
  opts.sim_streams = streams;
  snprintf(opts.sim_shared, sizeof opts.sim_shared, "%s", shared);
  opts.sim_fail_nth = nth;
  uint64_t ps = opts.page_size;
  rung_t r = {false, true};
  vp_device_t dev;
  int rc = vp_device_open(&opts, &dev);
  fail_step(rc, &r.all_ok, "open", nth);
  if (rc) return r;
  r.opened = true;
  vp_vbar_t v;
  vp_stream_t s = 0;
  rc = vp_vbar_create(dev, 4 * ps, &v);
  fail_step(rc, &r.all_ok, "vbar_create", nth);
  if (rc == VP_OK) {
    int src = vp_stream_create(dev, &s);
    fail_step(src, &r.all_ok, "stream_create", nth);
    if (src) s = 0;
    int frc = vp_fault(v, 0, 2 * ps, NULL, 0);
    fail_step(frc, &r.all_ok, "fault", nth);
    if (frc == VP_OK) {
      char buf[64] = {1, 2, 3};
      fail_step(vp_copy_to_device(dev, test_vbar_base(v), buf, sizeof buf, s),
                &r.all_ok, "copy_to_device", nth);
      fail_step(vp_stream_synchronize(dev, s), &r.all_ok, "synchronize", nth);
      fail_step(vp_unpin(v, 0, 2 * ps, s), &r.all_ok, "unpin", nth);
    }
    int drc = vp_vbar_destroy(v);
    if (drc != VP_EBUSY) fail_step(drc, &r.all_ok, "vbar_destroy", nth);
    else r.all_ok = false;
    if (s) fail_step(vp_stream_destroy(dev, s), &r.all_ok, "stream_destroy",
                     nth);
  }
  test_note("sim_fail_nth %" PRId64 ": close", nth);
  ASSERT_OK(vp_device_close(dev));
  return r;
}

static void *nop_thread(void *arg) { return arg; }

static void walk_rungs(test_ctx_t *ctx, int streams, const char *shared) {
  /* A first thread makes TSan start its own helper thread now, so the
   * thread count below is a stable baseline. */
  pthread_t th;
  ASSERT_EQ_INT(pthread_create(&th, NULL, nop_thread, NULL), 0);
  ASSERT_EQ_INT(pthread_join(th, NULL), 0);
  char shm[128] = "";
  if (shared[0]) snprintf(shm, sizeof shm, "/vpager-sim-%s", shared);
  int fds0 = fds();
  /* That joined thread can linger in /proc for a moment too: the baseline
   * is the count once it held still for 20 ms (at most 1 s). */
  int tasks0 = threads();
  for (int i = 0, still = 0; i < 1000 && still < 20; i++) {
    test_sleep_ms(1);
    int n = threads();
    still = n == tasks0 ? still + 1 : 0;
    tasks0 = n;
  }
  int clean = 0, failed_opens = 0, nth;
  for (nth = 1; nth < 1000 && clean < 8; nth++) {
    rung_t r = run_rung(ctx, streams, shared, nth);
    test_note("sim_fail_nth %d (streams %d, shared '%s')", nth, streams,
              shared);
    /* Nothing left behind: descriptors, threads, the shared segment. */
    ASSERT_EQ_INT(fds(), fds0);
    /* A joined thread can linger in /proc for a moment: allow 1 s. */
    for (int i = 0; i < 1000 && threads() != tasks0; i++)
      test_sleep_ms(1);
    ASSERT_EQ_INT(threads(), tasks0);
    if (shm[0]) { /* the segment is gone (whatever its size) */
      void *p = NULL;
      ASSERT_EQ_INT(vp__os_shm_open(shm, false, 1, &p, NULL), ENOENT);
    }
    failed_opens += !r.opened;
    clean = r.all_ok ? clean + 1 : 0;
  }
  test_log("streams %d shared '%s': %d rungs, %d failed opens", streams,
           shared, nth - clean, failed_opens);
  ASSERT_EQ_INT(clean, 8);
  ASSERT_GT_INT(failed_opens, 0);
}

TEST(inject_open_rungs, TEST_SIM_ONLY) {
  char name[64];
  snprintf(name, sizeof name, "vptest-rungs-%d", (int)getpid());
  walk_rungs(ctx, VP_SIM_SYNC, "");
  walk_rungs(ctx, VP_SIM_WORKER, "");
  walk_rungs(ctx, VP_SIM_SYNC, name);
  walk_rungs(ctx, VP_SIM_WORKER, name);
}
