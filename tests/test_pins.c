/* One pinned-host budget for the machine (src/pins.c): processes that name
 * the same ledger count their page-locked host memory in one segment, never
 * lock beyond the budget, give pinned memory back when another asks, and a
 * dead process's count is reaped.
 *
 * Peers are forked before the test opens a device of its own (a device
 * with a pin ledger has a thread; TSan lets no child of a threaded process
 * start threads) and obey one-byte commands, answering with a number. */
#include "test.h"
#include "compat.h"

#include <signal.h>

#include "internal.h" /* copies_unlocked */
#include "peer.h"
#include "pins.h"

#define MiB (1ull << 20)

static void pins_opts(test_ctx_t *ctx, vp_options_t *o, const char *name,
                      uint64_t budget) {
  test_options(ctx, o);
  snprintf(o->ledger, sizeof o->ledger, "%s", name);
  o->pin_budget = budget;
  o->ledger_timeout_us = 2000000; /* generous: sanitizers are slow */
}

static void pins_name(char *buf, size_t n, const char *what) {
  static int counter;
  snprintf(buf, n, "vpp-%s-%d-%d", what, (int)getpid(), counter++);
}

static uint64_t machine_pinned(vp_device_t dev) {
  return test_dev_stats(dev).machine_pinned_bytes;
}

static uint64_t hb_pinned(vp_hostbuf_t hb) {
  vp_hostbuf_info_t info;
  ASSERT_OK(vp_hostbuf_info(hb, &info));
  return info.pinned_bytes;
}

/* ---------------------------------------------------------------- peers */

/* Host buffers made and freed many times, two at once; returns the most
 * the machine had pinned at any check. */
static uint64_t churn(vp_device_t dev) {
  uint64_t most = 0;
  for (int i = 0; i < 60; i++) {
    vp_hostbuf_t a, b;
    ASSERT_OK(vp_hostbuf_alloc(dev, 4 * MiB, 4 * MiB, &a));
    ASSERT_OK(vp_hostbuf_alloc(dev, 8 * MiB, 8 * MiB, &b));
    uint64_t now = machine_pinned(dev);
    if (now > most) most = now;
    ASSERT_OK(vp_hostbuf_free(b));
    ASSERT_OK(vp_hostbuf_free(a));
  }
  return most;
}

/* The pin ledger `name` mapped as it is (the test's own view of it,
 * through the platform layer: a named segment on either platform). */
static pins_seg_t *seg_map(const char *name) {
  char shm[128];
  snprintf(shm, sizeof shm, PINS_PREFIX "%s", name);
  void *p = NULL;
  ASSERT_EQ_INT(vp__os_shm_open(shm, true, sizeof(pins_seg_t), &p, NULL), 0);
  return p;
}

/* Commands: 'A' allocate a host buffer of `size` (answers its pinned
 * bytes), 'P' its pinned bytes now, 'K' whether its bytes are intact,
 * 'M' the machine's pinned bytes, 'L' churn(), 'H' take the pin ledger's
 * lock and keep it, 'U' give it back, 'D' take it and die, 'F' free it,
 * 'Q' quit. */
typedef struct pins_peer {
  char name[64]; /* no pointers: a Windows peer gets a copy */
  uint64_t budget, size;
} pins_peer_t;

static void peer_main(test_ctx_t *ctx, const void *arg, int in, int out) {
  const pins_peer_t *c = arg;
  const char *name = c->name;
  uint64_t budget = c->budget, size = c->size;
  vp_options_t o;
  pins_opts(ctx, &o, name, budget);
  vp_device_t dev = test_open(ctx, &o);
  vp_hostbuf_t hb = {0};
  vp_hostbuf_info_t info = {0};
  pins_seg_t *held = NULL;
  vp__os_plock_t held_lock; /* our handle to held->lock */
  put_u64(out, 0); /* ready */
  for (;;) {
    char cmd = 0;
    if (read(in, &cmd, 1) != 1) break;
    uint64_t v = 0;
    if (cmd == 'A') {
      ASSERT_OK(vp_hostbuf_alloc(dev, size, size, &hb));
      ASSERT_OK(vp_hostbuf_info(hb, &info));
      test_pattern(info.ptr, size, 7);
      v = info.pinned_bytes;
    }
    if (cmd == 'P') v = hb_pinned(hb);
    if (cmd == 'K') {
      char *want = malloc(size);
      ASSERT_NOT_NULL(want);
      test_pattern(want, size, 7);
      v = memcmp(want, info.ptr, size) == 0;
      free(want);
    }
    if (cmd == 'M') v = machine_pinned(dev);
    if (cmd == 'L') v = churn(dev);
    if (cmd == 'H' || cmd == 'D') {
      pins_seg_t *seg = seg_map(name);
      char shm[128];
      snprintf(shm, sizeof shm, PINS_PREFIX "%s", name);
      ASSERT_EQ_INT(vp__os_plock_open(&held_lock, shm, &seg->lock), 0);
      ASSERT_EQ_INT(vp__os_plock_lock(&held_lock, 10000), 0);
      if (cmd == 'D') _exit(0); /* holding it */
      held = seg;
    }
    if (cmd == 'U') {
      vp__os_plock_unlock(&held_lock);
      vp__os_plock_close(&held_lock);
      vp__os_shm_unmap(held, sizeof *held);
    }
    if (cmd == 'F') ASSERT_OK(vp_hostbuf_free(hb));
    if (cmd == 'Q') break;
    put_u64(out, v);
  }
  ASSERT_OK(vp_device_close(dev));
  exit(0);
}

static peer_t pins_peer(test_ctx_t *ctx, const char *name, uint64_t budget,
                        uint64_t size) {
  pins_peer_t c = {"", budget, size};
  snprintf(c.name, sizeof c.name, "%s", name);
  return peer_start(ctx, peer_main, &c, sizeof c);
}

/* ---------------------------------------------------------------- tests */

/* Two processes' pinned bytes are one count, which each sees. */
TEST(pins_count_across_processes, TEST_SIM_ONLY) {
  char name[64];
  pins_name(name, sizeof name, "count");
  peer_t peer = pins_peer(ctx, name, 64 * MiB, 16 * MiB);
  ASSERT_EQ_U64(peer_do(&peer, 'A'), 16 * MiB);
  vp_options_t o;
  pins_opts(ctx, &o, name, 64 * MiB);
  vp_device_t dev = test_open(ctx, &o);
  ASSERT_EQ_U64(machine_pinned(dev), 16 * MiB);
  vp_hostbuf_t hb;
  ASSERT_OK(vp_hostbuf_alloc(dev, 8 * MiB, 8 * MiB, &hb));
  ASSERT_EQ_U64(hb_pinned(hb), 8 * MiB);
  ASSERT_EQ_U64(machine_pinned(dev), 24 * MiB);
  ASSERT_EQ_U64(peer_do(&peer, 'M'), 24 * MiB);
  ASSERT_OK(vp_hostbuf_free(hb));
  ASSERT_EQ_U64(peer_do(&peer, 'M'), 16 * MiB);
  peer_do(&peer, 'F');
  ASSERT_EQ_U64(machine_pinned(dev), 0);
  peer_quit(&peer);
  ASSERT_OK(vp_device_close(dev));
}

/* Short of budget, a process asks: the other gives its host buffer's pins
 * back (its bytes intact, pageable), and the sum stays within the budget. */
TEST(pins_other_process_gives_back, TEST_SIM_ONLY) {
  char name[64];
  pins_name(name, sizeof name, "ask");
  peer_t peer = pins_peer(ctx, name, 32 * MiB, 24 * MiB);
  ASSERT_EQ_U64(peer_do(&peer, 'A'), 24 * MiB);
  vp_options_t o;
  pins_opts(ctx, &o, name, 32 * MiB);
  vp_device_t dev = test_open(ctx, &o);
  vp_hostbuf_t hb;
  ASSERT_OK(vp_hostbuf_alloc(dev, 16 * MiB, 16 * MiB, &hb));
  ASSERT_EQ_U64(hb_pinned(hb), 16 * MiB);
  ASSERT_EQ_U64(peer_do(&peer, 'P'), 0);
  ASSERT_EQ_U64(peer_do(&peer, 'K'), 1);
  ASSERT_EQ_U64(machine_pinned(dev), 16 * MiB);
  ASSERT_EQ_U64(test_dev_stats(dev).pin_fallback_bytes, 0);
  peer_do(&peer, 'F');
  peer_quit(&peer);
  ASSERT_OK(vp_hostbuf_free(hb));
  ASSERT_OK(vp_device_close(dev));
}

/* Nothing is locked beyond the budget: what does not fit stays pageable
 * (a usable buffer, counted as a fallback), whoever holds the rest. */
TEST(pins_never_beyond_budget, TEST_SIM_ONLY) {
  char name[64];
  pins_name(name, sizeof name, "cap");
  peer_t peer = pins_peer(ctx, name, 32 * MiB, 24 * MiB);
  ASSERT_EQ_U64(peer_do(&peer, 'A'), 24 * MiB);
  vp_options_t o;
  pins_opts(ctx, &o, name, 32 * MiB);
  vp_device_t dev = test_open(ctx, &o);
  /* More than the whole budget: no release makes it fit, nobody asked. */
  vp_hostbuf_t big;
  ASSERT_OK(vp_hostbuf_alloc(dev, 40 * MiB, 40 * MiB, &big));
  ASSERT_EQ_U64(hb_pinned(big), 0);
  ASSERT_EQ_U64(peer_do(&peer, 'P'), 24 * MiB);
  ASSERT_EQ_U64(test_dev_stats(dev).pin_fallback_bytes, 40 * MiB);
  ASSERT_OK(vp_hostbuf_free(big));
  /* Budget lowered below what is pinned (by either process: it is the
   * machine's): the other is asked, and only what then fits is pinned. */
  ASSERT_OK(vp_device_set_pin_budget(dev, 8 * MiB));
  vp_hostbuf_t small;
  ASSERT_OK(vp_hostbuf_alloc(dev, 4 * MiB, 4 * MiB, &small));
  ASSERT_LE_U64(machine_pinned(dev), 24 * MiB);
  ASSERT_LE_U64(hb_pinned(small) + peer_do(&peer, 'P'), 24 * MiB);
  ASSERT_OK(vp_hostbuf_free(small));
  /* Many small buffers from both: the sum never passes the budget. */
  ASSERT_OK(vp_device_set_pin_budget(dev, 32 * MiB));
  vp_hostbuf_t many[12];
  for (int i = 0; i < 12; i++) {
    ASSERT_OK(vp_hostbuf_alloc(dev, 4 * MiB, 4 * MiB, &many[i]));
    ASSERT_LE_U64(machine_pinned(dev), 32 * MiB);
    ASSERT_LE_U64(peer_do(&peer, 'M'), 32 * MiB);
  }
  for (int i = 0; i < 12; i++) ASSERT_OK(vp_hostbuf_free(many[i]));
  peer_do(&peer, 'F');
  peer_quit(&peer);
  ASSERT_OK(vp_device_close(dev));
}

/* Both processes pin and free at once, asking each other: the machine's
 * total never passes the budget at any check, and ends at nothing. */
TEST(pins_budget_holds_under_churn, TEST_SIM_ONLY) {
  char name[64];
  pins_name(name, sizeof name, "churn");
  peer_t peer = pins_peer(ctx, name, 16 * MiB, 4 * MiB);
  vp_options_t o;
  pins_opts(ctx, &o, name, 16 * MiB);
  vp_device_t dev = test_open(ctx, &o);
  char cmd = 'L';
  ASSERT_EQ_INT(write(peer.to, &cmd, 1), 1);
  uint64_t ours = churn(dev), theirs = get_u64(peer.from);
  ASSERT_LE_U64(ours, 16 * MiB);
  ASSERT_LE_U64(theirs, 16 * MiB);
  ASSERT_EQ_U64(machine_pinned(dev), 0);
  peer_quit(&peer);
  ASSERT_OK(vp_device_close(dev));
}

/* A peer that does not answer (stopped) costs one timeout: what does not
 * fit stays pageable, and the peer is not asked again for a while. */
TEST(pins_silent_peer_skipped, TEST_SIM_ONLY) {
  char name[64];
  pins_name(name, sizeof name, "silent");
  peer_t peer = pins_peer(ctx, name, 32 * MiB, 24 * MiB);
  ASSERT_EQ_U64(peer_do(&peer, 'A'), 24 * MiB);
  ASSERT_EQ_INT(kill(peer.pid, SIGSTOP), 0);
  int st = 0; /* stopped for sure, its service thread too, not signalled */
  ASSERT_EQ_INT(waitpid(peer.pid, &st, WUNTRACED), peer.pid);
  ASSERT_TRUE(WIFSTOPPED(st));
  vp_options_t o;
  pins_opts(ctx, &o, name, 32 * MiB);
  o.ledger_timeout_us = 20000;
  vp_device_t dev = test_open(ctx, &o);
  vp_hostbuf_t a, b;
  uint64_t t0 = test_now_ms();
  ASSERT_OK(vp_hostbuf_alloc(dev, 16 * MiB, 16 * MiB, &a));
  uint64_t t1 = test_now_ms();
  ASSERT_OK(vp_hostbuf_alloc(dev, 16 * MiB, 16 * MiB, &b));
  uint64_t t2 = test_now_ms();
  ASSERT_EQ_U64(hb_pinned(a), 0);
  ASSERT_EQ_U64(hb_pinned(b), 0);
  ASSERT_GE_U64(t1 - t0, 20);
  if (!TEST_SANITIZED) ASSERT_LT_U64(t2 - t1, 20); /* skipped: no wait */
  kill(peer.pid, SIGCONT);
  ASSERT_EQ_U64(peer_do(&peer, 'P'), 24 * MiB);
  ASSERT_OK(vp_hostbuf_free(a));
  ASSERT_OK(vp_hostbuf_free(b));
  peer_do(&peer, 'F');
  peer_quit(&peer);
  ASSERT_OK(vp_device_close(dev));
}

/* The pin ledger's lock held by a stopped process: pinning goes on at once
 * (a take needs no lock: the device lock never waits on another process);
 * a holder that dies with it: the next one to join recovers it and reaps
 * the dead. */
TEST(pins_lock_stuck_or_owner_dead, TEST_SIM_ONLY) {
  char name[64];
  pins_name(name, sizeof name, "lock");
  peer_t peer = pins_peer(ctx, name, 32 * MiB, 4 * MiB);
  peer_t dying = pins_peer(ctx, name, 32 * MiB, 4 * MiB);
  vp_options_t o;
  pins_opts(ctx, &o, name, 32 * MiB);
  vp_device_t dev = test_open(ctx, &o);
  peer_do(&peer, 'H');
  vp_hostbuf_t a, b;
  uint64_t t0 = test_now_ms();
  ASSERT_OK(vp_hostbuf_alloc(dev, 4 * MiB, 4 * MiB, &a));
  uint64_t t1 = test_now_ms();
  ASSERT_OK(vp_hostbuf_alloc(dev, 4 * MiB, 4 * MiB, &b));
  uint64_t t2 = test_now_ms();
  ASSERT_EQ_U64(hb_pinned(a), 4 * MiB);
  ASSERT_EQ_U64(hb_pinned(b), 4 * MiB);
  ASSERT_LT_U64(t1 - t0, 500);
  ASSERT_LT_U64(t2 - t1, 500);
  ASSERT_OK(vp_hostbuf_free(a));
  ASSERT_OK(vp_hostbuf_free(b));
  peer_do(&peer, 'U');
  peer_quit(&peer);
  ASSERT_OK(vp_device_close(dev));
  /* The dying one takes the lock to its grave; a new device recovers. */
  ASSERT_EQ_U64(peer_do(&dying, 'A'), 4 * MiB);
  char d = 'D';
  ASSERT_EQ_INT(write(dying.to, &d, 1), 1);
  test_wait(dying.pid);
  close(dying.to);
  close(dying.from);
  dev = test_open(ctx, &o);
  ASSERT_EQ_U64(machine_pinned(dev), 0);
  ASSERT_OK(vp_hostbuf_alloc(dev, 4 * MiB, 4 * MiB, &a));
  ASSERT_EQ_U64(hb_pinned(a), 4 * MiB);
  ASSERT_OK(vp_hostbuf_free(a));
  ASSERT_OK(vp_device_close(dev));
}

/* A device opened while the pin ledger's lock stays taken waits one lock
 * timeout, not one per join attempt, and counts its pinned memory alone. */
TEST(pins_open_with_lock_stuck, TEST_SIM_ONLY) {
  char name[64];
  pins_name(name, sizeof name, "stuckopen");
  peer_t peer = pins_peer(ctx, name, 32 * MiB, 4 * MiB);
  peer_do(&peer, 'H');
  vp_options_t o;
  pins_opts(ctx, &o, name, 8 * MiB);
  uint64_t t0 = test_now_ms();
  vp_device_t dev = test_open(ctx, &o);
  ASSERT_LT_U64(test_now_ms() - t0, 3000);
  vp_hostbuf_t hb;
  ASSERT_OK(vp_hostbuf_alloc(dev, 4 * MiB, 4 * MiB, &hb));
  ASSERT_EQ_U64(hb_pinned(hb), 4 * MiB);
  ASSERT_EQ_U64(machine_pinned(dev), 4 * MiB); /* its own count alone */
  ASSERT_OK(vp_hostbuf_free(hb));
  ASSERT_OK(vp_device_close(dev));
  peer_do(&peer, 'U');
  peer_quit(&peer);
}

/* The lock held by a stopped process while the budget is spent: the
 * others are still asked, give back, and the bytes are taken (asking and
 * taking need no lock), never past the budget. */
TEST(pins_lock_stuck_others_still_give, TEST_SIM_ONLY) {
  char name[64];
  pins_name(name, sizeof name, "stuckask");
  peer_t giver = pins_peer(ctx, name, 32 * MiB, 24 * MiB);
  peer_t holder = pins_peer(ctx, name, 32 * MiB, 4 * MiB);
  ASSERT_EQ_U64(peer_do(&giver, 'A'), 24 * MiB);
  vp_options_t o;
  pins_opts(ctx, &o, name, 32 * MiB);
  vp_device_t dev = test_open(ctx, &o);
  peer_do(&holder, 'H');
  vp_hostbuf_t hb;
  ASSERT_OK(vp_hostbuf_alloc(dev, 16 * MiB, 16 * MiB, &hb));
  ASSERT_EQ_U64(hb_pinned(hb), 16 * MiB);
  uint64_t kept = peer_do(&giver, 'P');
  ASSERT_LE_U64(kept, 16 * MiB);
  ASSERT_LE_U64(machine_pinned(dev), 32 * MiB);
  ASSERT_OK(vp_hostbuf_free(hb));
  peer_do(&holder, 'U');
  peer_quit(&holder);
  peer_do(&giver, 'F');
  peer_quit(&giver);
  ASSERT_OK(vp_device_close(dev));
}

/* A process killed with pins held: its count goes with it. */
TEST(pins_dead_process_reaped, TEST_SIM_ONLY) {
  char name[64];
  pins_name(name, sizeof name, "dead");
  peer_t peer = pins_peer(ctx, name, 32 * MiB, 24 * MiB);
  ASSERT_EQ_U64(peer_do(&peer, 'A'), 24 * MiB);
  kill(peer.pid, SIGKILL);
  test_wait(peer.pid);
  close(peer.to);
  close(peer.from);
  vp_options_t o;
  pins_opts(ctx, &o, name, 32 * MiB);
  vp_device_t dev = test_open(ctx, &o); /* joining reaps it */
  ASSERT_EQ_U64(machine_pinned(dev), 0);
  vp_hostbuf_t hb;
  ASSERT_OK(vp_hostbuf_alloc(dev, 24 * MiB, 24 * MiB, &hb));
  ASSERT_EQ_U64(hb_pinned(hb), 24 * MiB);
  ASSERT_OK(vp_hostbuf_free(hb));
  ASSERT_OK(vp_device_close(dev));
}

/* The ledger off: the device counts alone, within its own budget. */
/* A build of the earlier layout (version 1, its segment under the name
 * without the version) on the host: this build's devices still share one
 * ledger and one budget among themselves. */
TEST(pins_older_layout_beside, TEST_SIM_ONLY) {
  char name[64], old[128];
  pins_name(name, sizeof name, "old");
  snprintf(old, sizeof old, "/vpager-pins-%s", name);
  void *seg = NULL;
  ASSERT_EQ_INT(vp__os_shm_create(old, 4096, NULL, NULL, &seg), 0);
  vp_options_t o;
  pins_opts(ctx, &o, name, 8 * MiB);
  vp_device_t a = test_open(ctx, &o), b = test_open(ctx, &o);
  vp_hostbuf_t ha, hb;
  ASSERT_OK(vp_hostbuf_alloc(a, 6 * MiB, 6 * MiB, &ha));
  ASSERT_OK(vp_hostbuf_alloc(b, 6 * MiB, 6 * MiB, &hb));
  ASSERT_LE_U64(hb_pinned(ha) + hb_pinned(hb), 8 * MiB);
  ASSERT_EQ_U64(machine_pinned(a), hb_pinned(ha) + hb_pinned(hb));
  ASSERT_OK(vp_hostbuf_free(ha));
  ASSERT_OK(vp_hostbuf_free(hb));
  ASSERT_OK(vp_device_close(a));
  ASSERT_OK(vp_device_close(b));
  vp__os_shm_unmap(seg, 4096);
  vp__os_shm_unlink(old);
}

/* Two devices of this process on one pin ledger (budget 8 MiB), the
 * first holding a 6 MiB pinned host buffer. */
typedef struct pins_pair {
  vp_device_t a, b;
  vp_hostbuf_t ha, hb, hc;
} pins_pair_t;

static pins_pair_t pair_open(test_ctx_t *ctx, const char *name) {
  pins_pair_t p;
  vp_options_t o;
  pins_opts(ctx, &o, name, 8 * MiB);
  p.a = test_open(ctx, &o);
  p.b = test_open(ctx, &o);
  ASSERT_OK(vp_hostbuf_alloc(p.a, 6 * MiB, 6 * MiB, &p.ha));
  ASSERT_EQ_U64(hb_pinned(p.ha), 6 * MiB);
  return p;
}

/* The second, after a 6 MiB buffer of its own (hb), asks for 4 MiB more:
 * the first gives pinned memory back; then everything is closed. */
static void pair_ask_and_close(pins_pair_t *p) {
  ASSERT_OK(vp_hostbuf_alloc(p->b, 4 * MiB, 4 * MiB, &p->hc));
  ASSERT_LT_U64(hb_pinned(p->ha), 6 * MiB);
  ASSERT_LE_U64(machine_pinned(p->a), 8 * MiB);
  ASSERT_OK(vp_hostbuf_free(p->hc));
  ASSERT_OK(vp_hostbuf_free(p->hb));
  ASSERT_OK(vp_hostbuf_free(p->ha));
  ASSERT_OK(vp_device_close(p->b));
  ASSERT_OK(vp_device_close(p->a));
}

/* A public copy being enqueued without the device lock (counted in
 * copies_unlocked from choosing its piece to having enqueued it) holds off
 * a give-back: it could read a chunk while the chunk is unregistered. Once
 * it is enqueued, the next ask gets the chunks. */
static void copies_unlocked(vp_device_t dev, int by) {
  vp__device_t *d = vp__registry_get(dev.id);
  ASSERT_NOT_NULL(d);
  vp__os_mutex_lock(&d->lock);
  d->copies_unlocked += (uint32_t)by;
  vp__os_mutex_unlock(&d->lock);
}

TEST(pins_no_give_back_under_an_unlocked_copy, TEST_SIM_ONLY) {
  char name[64];
  pins_name(name, sizeof name, "copy");
  pins_pair_t p = pair_open(ctx, name);
  copies_unlocked(p.a, 1);
  ASSERT_OK(vp_hostbuf_alloc(p.b, 6 * MiB, 6 * MiB, &p.hb));
  ASSERT_EQ_U64(hb_pinned(p.ha), 6 * MiB);
  ASSERT_LE_U64(hb_pinned(p.hb), 2 * MiB);
  copies_unlocked(p.a, -1);
  pair_ask_and_close(&p);
}

/* Every request slot held by requests of processes that died (answered,
 * never freed): an ask that finds no slot reaps them, and the next ask
 * gets memory given back. */
TEST(pins_dead_requests_reaped_by_an_ask, TEST_SIM_ONLY) {
  char name[64];
  pins_name(name, sizeof name, "reqs");
  pins_pair_t p = pair_open(ctx, name);
  pins_seg_t *seg = seg_map(name);
  for (int i = 0; i < PINS_REQS; i++) {
    atomic_store(&seg->req[i].from, PINS_PARTS - 1); /* no one there */
    atomic_store(&seg->req[i].state, REQ_DONE);
  }
  vp__os_shm_unmap(seg, sizeof *seg);
  ASSERT_OK(vp_hostbuf_alloc(p.b, 6 * MiB, 6 * MiB, &p.hb));
  pair_ask_and_close(&p);
}

TEST(pins_alone_without_ledger, TEST_SIM_ONLY) {
  vp_options_t o;
  pins_opts(ctx, &o, "off", 8 * MiB);
  vp_device_t dev = test_open(ctx, &o);
  vp_hostbuf_t a, b;
  ASSERT_OK(vp_hostbuf_alloc(dev, 8 * MiB, 8 * MiB, &a));
  ASSERT_OK(vp_hostbuf_alloc(dev, 4 * MiB, 4 * MiB, &b));
  ASSERT_EQ_U64(hb_pinned(a), 8 * MiB);
  ASSERT_EQ_U64(hb_pinned(b), 0);
  ASSERT_EQ_U64(machine_pinned(dev), 8 * MiB);
  ASSERT_OK(vp_hostbuf_free(a));
  ASSERT_OK(vp_hostbuf_free(b));
  ASSERT_OK(vp_device_close(dev));
}
