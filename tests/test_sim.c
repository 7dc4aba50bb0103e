/* The simulated device itself: touching an evicted or never-committed page
 * crashes (as on a GPU), launches, and the device-wide used-memory count
 * shared between processes. The other processes are peers (peer.h). */
#include "test.h"
#include "compat.h"
#include "peer.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>

/* ------------------------------------------------------- touch crashes */

#ifndef _WIN32
/* Windows ends the peer with the access violation's code instead, which
 * test_wait reads as SIGSEGV. */
static void segv_handler(int sig) {
  (void)sig;
  _exit(77);
}

static void catch_segv(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = segv_handler;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, NULL);
  sigaction(SIGBUS, &sa, NULL);
}
#endif

static void read_byte_fn(void *arg) {
  volatile const unsigned char *p = arg;
  unsigned char c = *p;
  (void)c;
}

enum { TOUCH_EVICTED, TOUCH_NEVER, TOUCH_LAUNCH, TOUCH_WORKER, TOUCH_DESTROYED,
       TOUCH_RESIDENT };

/* In a peer: set up a page per `how` (the arg) and touch it. Exit 77 = it
 * faulted, 0 = the touch went through. */
static void touch_child(test_ctx_t *ctx, const void *arg, int in, int out) {
  (void)in;
  int how = *(const int *)arg;
  put_u64(out, 0); /* ready: what follows ends it */
#ifndef _WIN32
  catch_segv();
#endif
  vp_options_t opts;
  test_options(ctx, &opts);
  if (how == TOUCH_WORKER) opts.sim_streams = VP_SIM_WORKER;
  vp_device_t dev = test_open(ctx, &opts);
  uint64_t ps = opts.page_size;
  vp_vbar_t v = test_vbar(dev, 4 * ps);
  uint64_t base = test_vbar_base(v);
  ASSERT_OK(vp_fault(v, 0, ps, NULL, 0));
  test_write_pattern(dev, base, ps, 3);
  ASSERT_OK(vp_unpin(v, 0, ps, 0));
  uint64_t addr = base + 100;
  switch (how) {
  case TOUCH_NEVER:
    addr = base + 2 * ps + 100;
    break;
  case TOUCH_DESTROYED:
    ASSERT_OK(vp_vbar_destroy(v));
    break;
  case TOUCH_RESIDENT:
    break;
  default:
    ASSERT_OK(vp_vbar_free_memory(v, ps, NULL));
    ASSERT_EQ_INT(test_resid(v, 0), 0);
  }
  if (how == TOUCH_LAUNCH || how == TOUCH_WORKER) {
    ASSERT_OK(vp_sim_launch(dev, 0, read_byte_fn, (void *)(uintptr_t)addr));
    ASSERT_OK(vp_stream_synchronize(dev, 0));
  } else {
    read_byte_fn((void *)(uintptr_t)addr);
  }
  ASSERT_OK(vp_device_close(dev));
  fflush(stdout);
  _exit(0);
}

static int touch(test_ctx_t *ctx, int how) {
  peer_t p = peer_start(ctx, touch_child, &how, sizeof how);
  int st = peer_wait(&p);
  if (WIFEXITED(st) && WEXITSTATUS(st) == 77) return 1;
  if (WIFSIGNALED(st) &&
      (WTERMSIG(st) == SIGSEGV || WTERMSIG(st) == SIGBUS))
    return 1;
  if (WIFEXITED(st) && WEXITSTATUS(st) == 0) return 0;
  TEST_FAIL("touch child %d ended oddly: status 0x%x", how, st);
}

TEST(sim_touch_crashes, TEST_SIM_ONLY) {
  ASSERT_EQ_INT(touch(ctx, TOUCH_RESIDENT), 0); /* the control */
  ASSERT_EQ_INT(touch(ctx, TOUCH_EVICTED), 1);
  ASSERT_EQ_INT(touch(ctx, TOUCH_NEVER), 1);
  ASSERT_EQ_INT(touch(ctx, TOUCH_LAUNCH), 1);
  ASSERT_EQ_INT(touch(ctx, TOUCH_WORKER), 1);
  ASSERT_EQ_INT(touch(ctx, TOUCH_DESTROYED), 1);
}

/* --------------------------------------------------------------- launch */

typedef struct launch_arg {
  pthread_t caller;
  atomic_int ran, same_thread;
} launch_arg_t;

static void launch_fn(void *arg) {
  launch_arg_t *a = arg;
  atomic_store(&a->same_thread, pthread_equal(a->caller, pthread_self()));
  atomic_store(&a->ran, 1);
}

TEST(sim_launch_modes, TEST_SIM_ONLY) {
  for (int worker = 0; worker < 2; worker++) {
    vp_options_t opts;
    test_options(ctx, &opts);
    opts.sim_streams = worker ? VP_SIM_WORKER : VP_SIM_SYNC;
    vp_device_t dev = test_open(ctx, &opts);
    vp_stream_t s;
    ASSERT_OK(vp_stream_create(dev, &s));
    vp_stream_t streams[2] = {0, s};
    for (int i = 0; i < 2; i++) {
      launch_arg_t a;
      a.caller = pthread_self();
      atomic_store(&a.ran, 0);
      atomic_store(&a.same_thread, -1);
      ASSERT_OK(vp_sim_launch(dev, streams[i], launch_fn, &a));
      if (!worker) {
        ASSERT_EQ_INT(atomic_load(&a.ran), 1); /* at once */
        ASSERT_EQ_INT(atomic_load(&a.same_thread), 1);
      }
      ASSERT_OK(vp_stream_synchronize(dev, streams[i]));
      ASSERT_EQ_INT(atomic_load(&a.ran), 1);
      if (worker) ASSERT_EQ_INT(atomic_load(&a.same_thread), 0);
    }
    /* A destroyed or made-up stream takes no work. */
    ASSERT_OK(vp_stream_destroy(dev, s));
    launch_arg_t b;
    b.caller = pthread_self();
    atomic_store(&b.ran, 0);
    ASSERT_FAILS(vp_sim_launch(dev, s, launch_fn, &b));
    ASSERT_FAILS(vp_sim_launch(dev, 0xabcdef, launch_fn, &b));
    ASSERT_OK(vp_device_close(dev));
    ASSERT_EQ_INT(atomic_load(&b.ran), 0);
  }
}

/* ------------------------------------------------------- shared memory */

static void shared_name(char *buf, size_t n, const char *what) {
  static int counter;
  snprintf(buf, n, "vptest-%s-%d-%d", what, (int)getpid(), counter++);
}

TEST(sim_shared_same_process, TEST_SIM_ONLY) {
  vp_options_t opts;
  test_options(ctx, &opts);
  uint64_t ps = opts.page_size;
  opts.sim_capacity = 8 * ps;
  shared_name(opts.sim_shared, sizeof opts.sim_shared, "same");
  /* The shared count alone: with the ledger, b would have a's idle pages
   * released to it (test_ledger.c). */
  snprintf(opts.ledger, sizeof opts.ledger, "off");
  vp_device_t a = test_open(ctx, &opts), b = test_open(ctx, &opts);
  vp_vbar_t va = test_vbar(a, 8 * ps), vb = test_vbar(b, 8 * ps);
  ASSERT_OK(vp_fault(va, 0, 6 * ps, NULL, 0));
  /* b sees a's commits: its budget is the 2 pages left. */
  vp_device_info_t ib = test_info(b);
  ASSERT_EQ_U64(ib.total_memory, 8 * ps);
  ASSERT_EQ_U64(ib.free_memory, 2 * ps);
  ASSERT_EQ_U64(ib.committed, 0);
  ASSERT_LE_U64(ib.budget, 2 * ps);
  ASSERT_OK(vp_fault(vb, 0, 2 * ps, NULL, 0));
  ASSERT_RC(test_fault_page(vb, 2, NULL), VP_MISS);
  ASSERT_EQ_U64(test_info(a).free_memory, 0);
  ASSERT_EQ_U64(test_info(b).committed, 2 * ps);
  /* a's pages go; b may use them. */
  ASSERT_OK(vp_unpin(va, 0, 6 * ps, 0));
  ASSERT_OK(vp_vbar_free_memory(va, 3 * ps, NULL));
  ASSERT_OK(vp_fault(vb, 2 * ps, 3 * ps, NULL, 0));
  ASSERT_RC(test_fault_page(vb, 5, NULL), VP_MISS);
  ASSERT_OK(vp_device_close(a));
  ASSERT_OK(test_fault_page(vb, 5, NULL));
  ASSERT_EQ_U64(test_info(b).free_memory, 2 * ps);
  ASSERT_OK(vp_device_close(b));
}

static void write_byte(int fd, char c) {
  ASSERT_EQ_INT(write(fd, &c, 1), 1);
}

static char read_byte(int fd) {
  char c = 0;
  ASSERT_EQ_INT(read(fd, &c, 1), 1);
  return c;
}

/* B of sim_shared_processes (the arg: the options): opens after A holds 6
 * pages ('a'), takes the 2 left ('b'); once A closed ('c'), all 8. */
static void shared_b(test_ctx_t *ctx, const void *arg, int in, int out) {
  vp_options_t opts = *(const vp_options_t *)arg;
  uint64_t ps = opts.page_size;
  put_u64(out, 0);
  ASSERT_EQ_INT(read_byte(in), 'a');
  vp_device_t b = test_open(ctx, &opts);
  vp_vbar_t v = test_vbar(b, 8 * ps);
  ASSERT_EQ_U64(test_info(b).free_memory, 2 * ps);
  ASSERT_OK(vp_fault(v, 0, 2 * ps, NULL, 0));
  ASSERT_RC(test_fault_page(v, 2, NULL), VP_MISS);
  write_byte(out, 'b');
  /* A closes; its memory comes back. */
  ASSERT_EQ_INT(read_byte(in), 'c');
  ASSERT_OK(vp_fault(v, 2 * ps, 6 * ps, NULL, 0));
  ASSERT_EQ_U64(test_info(b).free_memory, 0);
  ASSERT_OK(vp_unpin(v, 0, 8 * ps, 0));
  ASSERT_OK(vp_device_close(b));
  fflush(stdout);
  exit(0);
}

TEST(sim_shared_processes, TEST_SIM_ONLY) {
  vp_options_t opts;
  test_options(ctx, &opts);
  uint64_t ps = opts.page_size;
  opts.sim_capacity = 8 * ps;
  shared_name(opts.sim_shared, sizeof opts.sim_shared, "procs");
  peer_t b = peer_start(ctx, shared_b, &opts, sizeof opts);
  vp_device_t a = test_open(ctx, &opts);
  vp_vbar_t v = test_vbar(a, 8 * ps);
  ASSERT_OK(vp_fault(v, 0, 6 * ps, NULL, 0));
  write_byte(b.to, 'a');
  ASSERT_EQ_INT(read_byte(b.from), 'b');
  /* A sees B's two pages. */
  vp_device_info_t ia = test_info(a);
  ASSERT_EQ_U64(ia.free_memory, 0);
  ASSERT_EQ_U64(ia.committed, 6 * ps);
  ASSERT_RC(test_fault_page(v, 6, NULL), VP_MISS);
  ASSERT_OK(vp_device_close(a));
  write_byte(b.to, 'c');
  int st = peer_wait(&b);
  ASSERT_TRUE(WIFEXITED(st));
  ASSERT_EQ_INT(WEXITSTATUS(st), 0);
}

/* A process that opens the shared device, faults 5 pages and exits without
 * closing it. */
static void dying_b(test_ctx_t *ctx, const void *arg, int in, int out) {
  (void)in;
  vp_options_t opts = *(const vp_options_t *)arg;
  put_u64(out, 0);
  vp_device_t b = test_open(ctx, &opts);
  vp_vbar_t v = test_vbar(b, 8 * opts.page_size);
  ASSERT_OK(vp_fault(v, 0, 5 * opts.page_size, NULL, 0));
  write_byte(out, 'x');
  _exit(0); /* no close */
}

TEST(sim_shared_dead_process, TEST_SIM_ONLY) {
  /* A process that dies holding memory gives it back. */
  vp_options_t opts;
  test_options(ctx, &opts);
  uint64_t ps = opts.page_size;
  opts.sim_capacity = 8 * ps;
  shared_name(opts.sim_shared, sizeof opts.sim_shared, "dead");
  /* No ledger: its service thread would make the fork below one of a
   * threaded process, whose child TSan does not let start threads. */
  snprintf(opts.ledger, sizeof opts.ledger, "off");
  vp_device_t a = test_open(ctx, &opts);
  peer_t b = peer_start(ctx, dying_b, &opts, sizeof opts);
  ASSERT_EQ_INT(read_byte(b.from), 'x');
  peer_wait(&b);
  vp_vbar_t v = test_vbar(a, 8 * ps);
  /* The next open of the name reclaims what dead openers held. */
  vp_device_t c = test_open(ctx, &opts);
  ASSERT_OK(vp_fault(v, 0, 8 * ps, NULL, 0));
  ASSERT_OK(vp_unpin(v, 0, 8 * ps, 0));
  ASSERT_OK(vp_device_close(c));
  ASSERT_OK(vp_device_close(a));
}
