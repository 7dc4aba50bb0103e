/* Room for the desktop (issue 29 point 4): a GPU keeps a default headroom
 * when the user gives none (vp__default_headroom; on the simulated device
 * VP_SIM_SET_DESKTOP stands for the desktop a GPU serves), and every
 * vpager process on a device keeps free the largest headroom any live one
 * shares through the ledger, so two processes with no budget flags leave
 * the default free together, and one given less keeps the other's.
 *
 * The peer (tests/peer.c) is forked before the test opens a device of its
 * own (a device with a ledger has a thread; see peer.h). */
#include "test.h"
#include "compat.h"

#include <signal.h>

#include "ledger.h" /* LEDGER_HEADROOM_NS; internal.h */
#include "peer.h"

#define CAP 16 /* pages of the shared device */

static void shared_name(char *buf, size_t n, const char *what) {
  static int counter;
  snprintf(buf, n, "vph-%s-%d-%d", what, (int)getpid(), counter++);
}

/* A shared device of CAP pages, the headroom left to the backend. */
static void shared_opts(test_ctx_t *ctx, vp_options_t *o, const char *name) {
  test_options(ctx, o);
  o->sim_capacity = CAP * o->page_size;
  o->headroom = -1;
  snprintf(o->sim_shared, sizeof o->sim_shared, "%s", name);
  o->ledger_timeout_us = 2000000;
}

/* Fault (and keep pinned: no release request can take them) pages of v
 * one by one until one misses; returns how many became resident. */
static uint64_t fill(vp_vbar_t v, uint64_t ps, uint64_t pages) {
  uint64_t n = 0;
  for (; n < pages; n++) {
    int rc = vp_fault(v, n * ps, ps, NULL, 0);
    ASSERT_RC2(rc, VP_OK, VP_MISS);
    if (rc == VP_MISS) break;
  }
  return n;
}

/* A process with a desktop's default headroom (desktop: VP_SIM_SET_DESKTOP)
 * that fills up to `pages` pages, pinned or not (then others' release
 * requests may take them); 'N' answers how many it holds, 'Q' closes its
 * device, and killed it dies holding it. */
typedef struct headroom_peer {
  char name[64]; /* no pointers: a Windows peer gets a copy */
  uint64_t desktop, pages;
  bool pinned;
} headroom_peer_t;

static void peer_main(test_ctx_t *ctx, const void *arg, int in, int out) {
  const headroom_peer_t *c = arg;
  vp_options_t o;
  shared_opts(ctx, &o, c->name);
  vp_device_t dev = test_open(ctx, &o);
  ASSERT_OK(vp_sim_inject(dev, VP_SIM_SET_DESKTOP, c->desktop));
  vp_vbar_t v = test_vbar(dev, c->pages * o.page_size);
  uint64_t n = fill(v, o.page_size, c->pages);
  if (!c->pinned && n) ASSERT_OK(vp_unpin(v, 0, n * o.page_size, 0));
  put_u64(out, 0); /* ready */
  for (char cmd = 0; read(in, &cmd, 1) == 1 && cmd != 'Q';)
    put_u64(out, cmd == 'N' ? n : 0);
  ASSERT_OK(vp_device_close(dev));
  exit(0);
}

static peer_t peer_start_pinned(test_ctx_t *ctx, const char *name,
                                uint64_t desktop, uint64_t pages,
                                bool pinned) {
  headroom_peer_t c = {"", desktop, pages, pinned};
  snprintf(c.name, sizeof c.name, "%s", name);
  return peer_start(ctx, peer_main, &c, sizeof c);
}

static peer_t headroom_peer(test_ctx_t *ctx, const char *name,
                            uint64_t desktop, uint64_t pages) {
  return peer_start_pinned(ctx, name, desktop, pages, true);
}

static void peer_kill(peer_t *p) {
  ASSERT_EQ_INT(kill(p->pid, SIGKILL), 0);
  peer_wait(p);
}

/* ------------------------------------------------------------ tests */

/* The figures: the larger of a floor and a share of the card, at most a
 * quarter of it; larger under WDDM. */
TEST(default_headroom_figures, TEST_SIM_ONLY) {
  const uint64_t M = 1ull << 20, G = 1ull << 30;
  ASSERT_EQ_U64(vp__default_headroom(8 * G, false), 512 * M);
  ASSERT_EQ_U64(vp__default_headroom(24 * G, false), 512 * M);
  ASSERT_EQ_U64(vp__default_headroom(48 * G, false), 48 * G / 50);
  ASSERT_EQ_U64(vp__default_headroom(141 * G, false), 141 * G / 50);
  ASSERT_EQ_U64(vp__default_headroom(8 * G, true), 768 * M);
  ASSERT_EQ_U64(vp__default_headroom(32 * G, true), 32 * G / 25);
  ASSERT_EQ_U64(vp__default_headroom(1 * G, false), 256 * M);
  ASSERT_EQ_U64(vp__default_headroom(2 * G, true), 512 * M);
  ASSERT_EQ_U64(vp__default_headroom(0, true), 0);
  for (uint64_t t = 1 * G; t <= 200 * G; t += 3 * G) {
    ASSERT_GE_U64(vp__default_headroom(t, true),
                  vp__default_headroom(t, false));
    ASSERT_LE_U64(vp__default_headroom(t, true), t / 4);
  }
}

/* A device opened with no headroom keeps its desktop's default; a headroom
 * the user gave stays whatever the desktop. */
TEST(desktop_default_headroom, TEST_SIM_ONLY) {
  vp_options_t o;
  test_options(ctx, &o);
  o.sim_capacity = CAP * o.page_size;
  o.headroom = -1;
  uint64_t ps = o.page_size, want = vp__default_headroom(CAP * ps, false);
  vp_device_t dev = test_open(ctx, &o);
  ASSERT_EQ_INT(test_info(dev).headroom, 0); /* the sim serves no desktop */
  ASSERT_OK(vp_sim_inject(dev, VP_SIM_SET_DESKTOP, 1));
  vp_device_info_t info = test_info(dev);
  ASSERT_EQ_INT(info.headroom, (int64_t)want);
  ASSERT_EQ_U64(info.kept_free, want);
  ASSERT_EQ_INT(info.shared_headroom, -1);
  vp_vbar_t v = test_vbar(dev, CAP * ps);
  ASSERT_EQ_U64(fill(v, ps, CAP), (CAP * ps - want) / ps);
  ASSERT_GE_U64(test_info(dev).free_memory, want);
  ASSERT_OK(vp_sim_inject(dev, VP_SIM_SET_DESKTOP, 2));
  ASSERT_EQ_INT(test_info(dev).headroom,
                (int64_t)vp__default_headroom(CAP * ps, true));
  ASSERT_RC(vp_sim_inject(dev, VP_SIM_SET_DESKTOP, 3), VP_EINVAL);
  ASSERT_OK(vp_sim_inject(dev, VP_SIM_SET_DESKTOP, 0));
  ASSERT_EQ_INT(test_info(dev).headroom, 0);
  ASSERT_OK(vp_device_set_headroom(dev, (int64_t)ps));
  ASSERT_OK(vp_sim_inject(dev, VP_SIM_SET_DESKTOP, 1));
  ASSERT_EQ_INT(test_info(dev).headroom, (int64_t)ps); /* the user's */
  ASSERT_OK(vp_device_close(dev));

  test_options(ctx, &o);
  o.sim_capacity = CAP * o.page_size;
  o.headroom = 0; /* given: the desktop's default does not replace it */
  dev = test_open(ctx, &o);
  ASSERT_OK(vp_sim_inject(dev, VP_SIM_SET_DESKTOP, 2));
  ASSERT_EQ_INT(test_info(dev).headroom, 0);
  ASSERT_OK(vp_device_close(dev));
}

/* Two processes, no budget flags: the second keeps the first's default
 * headroom free although its own is 0, so the device ends with the default
 * free; when the first leaves (or dies), its headroom goes with it. */
TEST(shared_headroom_two_processes, TEST_SIM_ONLY) {
  char name[64];
  shared_name(name, sizeof name, "two");
  vp_options_t o;
  shared_opts(ctx, &o, name);
  uint64_t ps = o.page_size, want = vp__default_headroom(CAP * ps, false);
  ASSERT_EQ_U64(want, 4 * ps);
  peer_t p = headroom_peer(ctx, name, 1, 6);
  ASSERT_EQ_U64(peer_do(&p, 'N'), 6);
  vp_device_t dev = test_open(ctx, &o);
  vp_device_info_t info = test_info(dev);
  ASSERT_EQ_INT(info.headroom, 0);
  ASSERT_EQ_U64(info.kept_free, want); /* the peer's */
  vp_vbar_t v = test_vbar(dev, CAP * ps);
  ASSERT_EQ_U64(fill(v, ps, CAP), CAP - 6 - 4);
  info = test_info(dev);
  ASSERT_EQ_U64(info.free_memory, want);
  size_t need = 0, len = 1 << 16;
  char *snap = malloc(len);
  ASSERT_NOT_NULL(snap);
  ASSERT_OK(vp_ledger_snapshot(dev, snap, len, &need));
  char field[64];
  snprintf(field, sizeof field, "\"headroom\":%llu", (unsigned long long)want);
  ASSERT_STR_CONTAINS(snap, field);
  free(snap);

  /* It leaves: a setting's change reads the ledger again at once. */
  peer_quit(&p);
  ASSERT_OK(vp_device_set_shared_headroom(dev, -1));
  ASSERT_EQ_U64(test_info(dev).kept_free, 0);
  ASSERT_EQ_U64(fill(v, ps, CAP), CAP); /* the rest of the device */
  ASSERT_OK(vp_unpin(v, 0, CAP * ps, 0));
  ASSERT_OK(vp_device_close(dev));
}

/* A peer that dies holding its slot: its headroom is no longer kept, read
 * again within LEDGER_HEADROOM_NS while the survivor works. And a shared
 * headroom set apart from the headroom is what the other side keeps. */
TEST(shared_headroom_dead_peer, TEST_SIM_ONLY) {
  char name[64];
  shared_name(name, sizeof name, "dead");
  vp_options_t o;
  shared_opts(ctx, &o, name);
  uint64_t ps = o.page_size, want = vp__default_headroom(CAP * ps, true);
  peer_t p = headroom_peer(ctx, name, 2, 2);
  ASSERT_EQ_U64(peer_do(&p, 'N'), 2);
  vp_device_t dev = test_open(ctx, &o);
  ASSERT_EQ_U64(test_info(dev).kept_free, want);
  peer_kill(&p);
  vp_vbar_t v = test_vbar(dev, CAP * ps);
  ASSERT_EQ_U64(fill(v, ps, 1), 1);
  test_sleep_ms(LEDGER_HEADROOM_NS / 1000000 + 20);
  ASSERT_OK(vp_unpin(v, 0, ps, 0)); /* a publishing call: reads again */
  ASSERT_EQ_U64(test_info(dev).kept_free, 0);
  ASSERT_OK(vp_device_set_headroom(dev, (int64_t)(3 * ps)));
  ASSERT_OK(vp_device_set_shared_headroom(dev, (int64_t)ps));
  vp_device_info_t info = test_info(dev);
  ASSERT_EQ_INT(info.shared_headroom, (int64_t)ps);
  ASSERT_EQ_U64(info.kept_free, 3 * ps); /* its own is larger */
  ASSERT_RC(vp_device_set_shared_headroom(dev, -2), VP_EINVAL);
  ASSERT_STR_CONTAINS(vp_last_error(), "vp_device_set_shared_headroom");
  ASSERT_OK(vp_device_close(dev));
  ASSERT_RC(vp_device_set_shared_headroom(dev, 0), VP_EHANDLE);
}

/* Without a ledger the shared headroom changes nothing but what info()
 * says. */
TEST(shared_headroom_no_ledger, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  ASSERT_OK(vp_device_set_shared_headroom(dev, 1 << 20));
  vp_device_info_t info = test_info(dev);
  ASSERT_EQ_INT(info.shared_headroom, 1 << 20);
  ASSERT_EQ_U64(info.kept_free, (uint64_t)info.headroom);
  ASSERT_OK(vp_device_close(dev));
}

/* On a GPU: a device opened without a headroom keeps the GPU's default
 * (WDDM's when the GPU serves a Windows desktop, WSL2's /dev/dxg), and a
 * second handle on the same GPU given none of its own (headroom 0) keeps
 * the first's, through the GPU's ledger. Other processes on the GPU may
 * ask more: at least. */
TEST(gpu_default_headroom_shared, TEST_GPU_ONLY) {
  vp_options_t o;
  test_options(ctx, &o);
  o.headroom = -1;
  vp_device_t a = test_open(ctx, &o);
  vp_device_info_t ia = test_info(a);
  uint64_t want =
      vp__default_headroom(ia.total_memory, access("/dev/dxg", F_OK) == 0);
  test_log("GPU %llu MiB: default headroom %llu MiB",
           (unsigned long long)(ia.total_memory >> 20),
           (unsigned long long)(want >> 20));
  ASSERT_EQ_INT(ia.headroom, (int64_t)want);
  ASSERT_GE_U64(ia.kept_free, want);
  test_options(ctx, &o);
  o.headroom = 0;
  vp_device_t b = test_open(ctx, &o);
  vp_device_info_t ib = test_info(b);
  ASSERT_EQ_INT(ib.headroom, 0);
  char why[64] = "";
  size_t need = 0, len = 1 << 20;
  char *snap = malloc(len);
  ASSERT_NOT_NULL(snap);
  ASSERT_OK(vp_ledger_snapshot(b, snap, len, &need));
  bool joined = strstr(snap, "\"joined\":true") != NULL;
  free(snap);
  snprintf(why, sizeof why, "%s", joined ? "joined" : "no ledger");
  test_log("second handle: %s, kept free %llu MiB", why,
           (unsigned long long)(ib.kept_free >> 20));
  if (joined) ASSERT_GE_U64(ib.kept_free, want);
  ASSERT_OK(vp_device_close(b));
  ASSERT_OK(vp_device_close(a));
}

/* A process that opens its device after another filled it (no budget
 * flags, unpinned pages) gets room for its staging ring at its first
 * acquire: the ring's miss asks the other process, and vp_acquire tries
 * once more after asking (before: VP_EOOM, "no device memory for the
 * staging ring", the first forward of the second process failed). */
TEST(shared_ring_after_a_full_peer, TEST_SIM_ONLY) {
  char name[64];
  shared_name(name, sizeof name, "ring");
  vp_options_t o;
  shared_opts(ctx, &o, name);
  uint64_t ps = o.page_size;
  peer_t p = peer_start_pinned(ctx, name, 0, CAP, false);
  ASSERT_EQ_U64(peer_do(&p, 'N'), CAP); /* the whole device */
  o.staging_size = 2 * ps;
  o.lookahead = 0;
  vp_device_t dev = test_open(ctx, &o);
  vp_vbar_t v = test_vbar(dev, 2 * ps);
  unsigned char *host = malloc(2 * ps), *back = malloc(2 * ps);
  ASSERT_NOT_NULL(host);
  ASSERT_NOT_NULL(back);
  test_pattern(host, 2 * ps, 29);
  uint64_t off[1] = {0}, size[1] = {2 * ps};
  vp_source_t src[1] = {{.kind = VP_SOURCE_HOST, .host = host}};
  vp_weight_t w[1];
  ASSERT_OK(vp_weights_create(v, 1, off, size, src, w));
  uint64_t ptr[1];
  uint8_t flags[1];
  ASSERT_OK(vp_acquire(dev, w, 1, 0, ptr, flags));
  ASSERT_OK(vp_copy_to_host(dev, back, ptr[0], 2 * ps, 0));
  ASSERT_OK(vp_stream_synchronize(dev, 0));
  ASSERT_MEM_EQ(back, host, 2 * ps);
  ASSERT_OK(vp_release(dev, w, 1, 0));
  peer_quit(&p);
  ASSERT_OK(vp_device_close(dev));
  free(back);
  free(host);
}
