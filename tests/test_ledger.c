/* The per-GPU ledger on the simulated device (VPAGER_SIM_SHARED): processes
 * that share one device's memory give each other memory back, least
 * recently used first, and survive peers that die, stop, or leave a bad
 * segment behind.
 *
 * Most tests fork peers: each holds one device and one VBAR and obeys
 * one-byte commands from the test (peer_main), answering with a number.
 * Peers are forked before the test opens a device of its own: a device
 * with a ledger has a thread, and TSan lets no child of a threaded
 * process start threads. */
#include "test.h"
#include "compat.h"

#include <errno.h>
#include <signal.h>
#include <time.h>

#include "ledger.h"
#include "peer.h"

#define PAGES_CAP 12 /* shared capacity of most tests, in pages */

/* ------------------------------------------------------------ helpers */

static void ledger_name(char *buf, size_t n, const char *what) {
  static int counter;
  snprintf(buf, n, "vpl-%s-%d-%d", what, (int)getpid(), counter++);
}

/* Options of a shared device named `name` of `cap` pages. */
static void shared_opts(test_ctx_t *ctx, vp_options_t *o, const char *name,
                        uint64_t cap) {
  test_options(ctx, o);
  o->sim_capacity = cap * o->page_size;
  snprintf(o->sim_shared, sizeof o->sim_shared, "%s", name);
  o->ledger_timeout_us = 2000000; /* generous: sanitizers are slow */
}

/* Others may change the ledger between two calls: grow until it fits. */
static char *snapshot(vp_device_t dev) {
  size_t len = 4096, need = 0;
  for (;;) {
    char *buf = malloc(len);
    ASSERT_NOT_NULL(buf);
    int rc = vp_ledger_snapshot(dev, buf, len, &need);
    if (rc == VP_OK) return buf;
    ASSERT_RC(rc, VP_ERANGE);
    free(buf);
    len = 2 * (need + 1);
  }
}

/* How many times `needle` occurs in s. */
static int count_of(const char *s, const char *needle) {
  int n = 0;
  for (const char *p = s; (p = strstr(p, needle)); p += strlen(needle)) n++;
  return n;
}

/* ---------------------------------------------------------------- peers */

/* No pointers: a Windows peer gets a copy of these bytes. */
typedef struct peer_cfg {
  char name[64];      /* the shared device */
  uint64_t cap;       /* its capacity, pages */
  uint64_t pages;     /* the peer's model */
  uint64_t key;       /* its bytes' pattern */
  char label[VP_LABEL_MAX]; /* "": none */
  int streams;        /* vp_sim_streams_t */
} peer_cfg_t;

static peer_cfg_t cfg(const char *name, uint64_t cap, uint64_t pages,
                      uint64_t key, const char *label, int streams) {
  peer_cfg_t c = {.cap = cap, .pages = pages, .key = key, .streams = streams};
  snprintf(c.name, sizeof c.name, "%s", name);
  snprintf(c.label, sizeof c.label, "%s", label ? label : "");
  return c;
}

typedef struct model {
  vp_device_t dev;
  vp_vbar_t v;
  uint64_t ps, pages, key;
  uint32_t gens[64];
} model_t;

/* One pass over the model: pages that fault are filled when their
 * generation changed and checked bitwise either way. Returns the pages
 * that were resident (faulted) in the pass. */
static uint64_t model_pass(model_t *m, bool keep_pinned) {
  uint64_t ok = 0;
  for (uint64_t p = 0; p < m->pages; p++) {
    uint32_t gen = 0;
    int rc = test_fault_page(m->v, p, &gen);
    ASSERT_RC2(rc, VP_OK, VP_MISS);
    if (rc == VP_MISS) continue;
    uint64_t addr = test_vbar_base(m->v) + p * m->ps;
    if (gen != m->gens[p]) test_write_pattern(m->dev, addr, m->ps, m->key + p);
    ASSERT_TRUE(test_check_pattern(m->dev, addr, m->ps, m->key + p));
    m->gens[p] = gen;
    ok++;
    if (!keep_pinned) ASSERT_OK(vp_unpin(m->v, p * m->ps, m->ps, 0));
  }
  return ok;
}

static void model_unpin_all(model_t *m) {
  for (uint64_t p = 0; p < m->pages; p++)
    if (test_resid(m->v, p) & VP_PAGE_PINNED)
      ASSERT_OK(vp_unpin(m->v, p * m->ps, m->ps, 0));
}

static void model_open(test_ctx_t *ctx, const peer_cfg_t *c, model_t *m) {
  vp_options_t o;
  shared_opts(ctx, &o, c->name, c->cap);
  o.sim_streams = c->streams;
  memset(m, 0, sizeof *m);
  m->dev = test_open(ctx, &o);
  m->ps = o.page_size;
  m->pages = c->pages;
  m->key = c->key;
  m->v = test_vbar(m->dev, c->pages * m->ps);
  if (c->label[0]) ASSERT_OK(vp_vbar_set_label(m->v, c->label));
}

static void sleep_fn(void *arg) {
  (void)arg;
  test_sleep_ms(10000);
}

/* The last page, unpinned on a stream that is busy for 10 s: evicting it
 * (it goes first, tail-first) waits that long under the device lock. */
static uint64_t slow_fence(model_t *m) {
  vp_stream_t s = 0;
  uint64_t p = m->pages - 1;
  ASSERT_OK(vp_stream_create(m->dev, &s));
  ASSERT_OK(test_fault_page(m->v, p, NULL));
  ASSERT_OK(vp_sim_launch(m->dev, s, sleep_fn, NULL));
  ASSERT_OK(vp_unpin(m->v, p * m->ps, m->ps, s));
  return 0;
}

/* Commands: R run a pass (prioritized first), T touch (a pass as it is),
 * P a pass keeping pages pinned, U unpin, C resident page count, W a slow
 * fence on the last page, Q quit. Each answers a number. */
static void peer_main(test_ctx_t *ctx, const void *arg, int in, int out) {
  const peer_cfg_t *c = arg;
  model_t m;
  model_open(ctx, c, &m);
  put_u64(out, 0); /* joined */
  for (;;) {
    char cmd = 0;
    if (read(in, &cmd, 1) != 1) break;
    uint64_t v = 0;
    if (cmd == 'R') ASSERT_OK(vp_vbar_prioritize(m.v));
    if (cmd == 'R' || cmd == 'T' || cmd == 'P') v = model_pass(&m, cmd == 'P');
    if (cmd == 'U') model_unpin_all(&m);
    if (cmd == 'C') v = test_resident_count(m.v);
    if (cmd == 'W') v = slow_fence(&m);
    if (cmd == 'Q') break;
    put_u64(out, v);
  }
  model_unpin_all(&m);
  ASSERT_OK(vp_device_close(m.dev));
  exit(0);
}

/* ---------------------------------------------------------------- tests */

/* A keep list names this process's VBARs: a participant with our pid in
 * another pid namespace (a container sharing /dev/shm) is not ours. */
#ifndef _WIN32
TEST(ledger_ours_needs_our_pid_namespace, TEST_SIM_ONLY) {
  (void)ctx;
  struct stat st;
  if (stat("/proc/self/ns/pid", &st) != 0) return; /* no namespaces here */
  ledger_part_t p;
  memset(&p, 0, sizeof p);
  atomic_store(&p.pid, (int32_t)getpid());
  atomic_store(&p.pidns, (uint64_t)st.st_ino);
  ASSERT_TRUE(vp__lpart_ours(&p, (int32_t)getpid()));
  ASSERT_FALSE(vp__lpart_ours(&p, (int32_t)getpid() + 1));
  atomic_store(&p.pidns, (uint64_t)st.st_ino + 1);
  ASSERT_FALSE(vp__lpart_ours(&p, (int32_t)getpid()));
}
#else
TEST_EXCLUDED(ledger_ours_needs_our_pid_namespace, TEST_SIM_ONLY,
              "pid namespaces are Linux's (under Wine the host's /proc is "
              "visible)")
#endif

/* Two devices of one process on one shared device: the idle one's pages
 * go to the one that faults; the snapshot shows both, with labels. */
TEST(ledger_two_devices, TEST_SIM_ONLY) {
  char name[64];
  ledger_name(name, sizeof name, "two");
  peer_cfg_t ca = cfg(name, 8, 6, 100, "idle-model", VP_SIM_SYNC);
  peer_cfg_t cb = cfg(name, 8, 6, 200, "busy-model", VP_SIM_SYNC);
  model_t a, b;
  model_open(ctx, &ca, &a);
  model_open(ctx, &cb, &b);
  ASSERT_EQ_U64(model_pass(&a, false), 6);
  /* b gets the 2 free pages, then 4 of a's, least recently used first. */
  ASSERT_EQ_U64(model_pass(&b, false), 6);
  ASSERT_EQ_U64(test_resident_count(a.v), 2);
  ASSERT_EQ_STR(test_map(a.v), "##....");
  vp_stats_t sa = test_vbar_stats(a.v);
  ASSERT_EQ_U64(sa.pages_evicted, 4);
  char *s = snapshot(b.dev);
  ASSERT_STR_CONTAINS(s, "\"joined\":true");
  ASSERT_STR_CONTAINS(s, "\"label\":\"idle-model\"");
  ASSERT_STR_CONTAINS(s, "\"label\":\"busy-model\"");
  ASSERT_EQ_INT(count_of(s, "\"slot\":"), 2);
  free(s);
  /* a's remaining pages are still a's bytes. */
  ASSERT_EQ_U64(model_pass(&a, false), 2);
  char label[VP_LABEL_MAX];
  ASSERT_OK(vp_vbar_label(a.v, label, sizeof label));
  ASSERT_EQ_STR(label, "idle-model");
  ASSERT_OK(vp_device_close(a.dev));
  ASSERT_OK(vp_device_close(b.dev));
}

/* Three processes whose models together are twice the shared capacity (one
 * alone is larger than it) take turns: the one whose turn it is gets every
 * page the idle ones hold, and every byte is checked in every pass. */
TEST(ledger_alternating_processes, TEST_SIM_ONLY) {
  char name[64];
  ledger_name(name, sizeof name, "alt");
  static const uint64_t sizes[3] = {8, 8, 16};
  peer_t p[3];
  for (int i = 0; i < 3; i++) {
    peer_cfg_t c = cfg(name, PAGES_CAP, sizes[i], 1000u * (i + 1), NULL,
                       i == 1 ? VP_SIM_WORKER : VP_SIM_SYNC);
    p[i] = peer_start(ctx, peer_main, &c, sizeof c);
  }
  uint64_t rounds = test_scale(6);
  for (uint64_t r = 0; r < rounds; r++)
    for (int i = 0; i < 3; i++) {
      uint64_t want = sizes[i] < PAGES_CAP ? sizes[i] : PAGES_CAP;
      test_note("round %" PRIu64 ", process %d", r, i);
      ASSERT_EQ_U64(peer_do(&p[i], 'R'), want);
      uint64_t held = 0;
      for (int j = 0; j < 3; j++) held += peer_do(&p[j], 'C');
      ASSERT_LE_U64(held, PAGES_CAP);
    }
  for (int i = 0; i < 3; i++) peer_quit(&p[i]);
}

/* The order is least recently used first over every process: a model
 * loaded long ago in an idle process goes before a busy process's, and a
 * model with pinned pages is never a victim. */
TEST(ledger_idle_before_active, TEST_SIM_ONLY) {
  char name[64];
  ledger_name(name, sizeof name, "lru");
  peer_cfg_t ci = cfg(name, PAGES_CAP, 4, 10, "idle", VP_SIM_SYNC);
  peer_cfg_t cb = cfg(name, PAGES_CAP, 4, 20, "busy", VP_SIM_SYNC);
  peer_t idle = peer_start(ctx, peer_main, &ci, sizeof ci);
  peer_t busy = peer_start(ctx, peer_main, &cb, sizeof cb);
  ASSERT_EQ_U64(peer_do(&idle, 'R'), 4);
  test_sleep_ms(20); /* coarse clocks: make "less recently" unambiguous */
  ASSERT_EQ_U64(peer_do(&busy, 'R'), 4);
  test_sleep_ms(20);
  peer_cfg_t cr = cfg(name, PAGES_CAP, 12, 30, "requester", VP_SIM_SYNC);
  model_t m;
  model_open(ctx, &cr, &m);
  m.pages = 6; /* 4 free, 2 from the idle process */
  ASSERT_EQ_U64(model_pass(&m, false), 6);
  ASSERT_EQ_U64(peer_do(&idle, 'C'), 2);
  ASSERT_EQ_U64(peer_do(&busy, 'C'), 4);
  ASSERT_EQ_U64(peer_do(&busy, 'T'), 4); /* busy again */
  m.pages = 8; /* 2 more: the idle process's last two */
  ASSERT_EQ_U64(model_pass(&m, false), 8);
  ASSERT_EQ_U64(peer_do(&idle, 'C'), 0);
  ASSERT_EQ_U64(peer_do(&busy, 'C'), 4);
  /* busy pins its pages: nothing more to be had, a miss. */
  ASSERT_EQ_U64(peer_do(&busy, 'P'), 4);
  m.pages = 10;
  ASSERT_EQ_U64(model_pass(&m, false), 8);
  ASSERT_EQ_U64(peer_do(&busy, 'C'), 4);
  ASSERT_EQ_U64(peer_do(&busy, 'U'), 0);
  ASSERT_EQ_U64(model_pass(&m, false), 10);
  ASSERT_EQ_U64(peer_do(&busy, 'C'), 2);
  peer_quit(&idle);
  peer_quit(&busy);
  ASSERT_OK(vp_device_close(m.dev));
}

/* Our own older VBAR goes before another process's newer one; theirs
 * older than ours goes first. */
TEST(ledger_own_older_first, TEST_SIM_ONLY) {
  char name[64];
  ledger_name(name, sizeof name, "own");
  peer_cfg_t cp = cfg(name, 8, 4, 40, "peer", VP_SIM_SYNC);
  /* forked before we have threads */
  peer_t peer = peer_start(ctx, peer_main, &cp, sizeof cp);
  peer_cfg_t cr = cfg(name, 8, 4, 30, "old-own", VP_SIM_SYNC);
  model_t old;
  model_open(ctx, &cr, &old);
  ASSERT_EQ_U64(model_pass(&old, false), 4);
  test_sleep_ms(20);
  ASSERT_EQ_U64(peer_do(&peer, 'R'), 4);
  test_sleep_ms(20);
  /* A second VBAR of ours, above `old` in our priority list. */
  model_t cur = old;
  cur.v = test_vbar(old.dev, 4 * old.ps);
  cur.key = 50;
  memset(cur.gens, 0, sizeof cur.gens);
  ASSERT_EQ_U64(model_pass(&cur, false), 4);
  ASSERT_EQ_U64(test_resident_count(old.v), 0);
  ASSERT_EQ_U64(peer_do(&peer, 'C'), 4);
  peer_quit(&peer);
  ASSERT_OK(vp_device_close(old.dev));
}

/* ------------------------------------------------------------- faults */

static void shm_of(char *buf, size_t n, const char *name) {
  snprintf(buf, n, LEDGER_PREFIX "sim-%s", name);
}

static int count_pid(const char *snap, pid_t pid) {
  char key[32];
  snprintf(key, sizeof key, "\"pid\":%d,", (int)pid);
  return count_of(snap, key);
}

/* A peer that loads its model, takes the ledger's lock and waits to be
 * killed holding it (ready: it holds the lock). */
static void lock_holder(test_ctx_t *ctx, const void *arg, int in, int out) {
  const peer_cfg_t *c = arg;
  char shm[128];
  shm_of(shm, sizeof shm, c->name);
  model_t m;
  model_open(ctx, c, &m);
  ASSERT_EQ_U64(model_pass(&m, false), 3);
  ledger_seg_t *seg = NULL;
  char why[192];
  ASSERT_OK(vp__lseg_map(shm, true, &seg, why, sizeof why));
  vp__ledger_t l = {.seg = seg};
  ASSERT_EQ_INT(vp__os_plock_open(&l.lock, shm, &seg->lock), 0);
  ASSERT_OK(vp__lseg_lock(&l));
  put_u64(out, 0);
  char cmd;
  while (read(in, &cmd, 1) == 1) {
  }
  _exit(0);
}

/* A process killed while it holds the ledger's lock: the next one to take
 * it recovers it (EOWNERDEAD) and reaps the dead at once; the memory the
 * dead held comes back as the driver frees it (the sim: within 100 ms). */
TEST(ledger_sigkill_lock_holder, TEST_SIM_ONLY) {
  char name[64];
  ledger_name(name, sizeof name, "kill");
  peer_cfg_t ck = cfg(name, 8, 3, 10, "doomed", VP_SIM_SYNC);
  peer_t p = peer_start(ctx, lock_holder, &ck, sizeof ck);
  pid_t k = p.pid;
  ASSERT_EQ_INT(kill(k, SIGKILL), 0);
  peer_wait(&p);
  uint64_t t0 = test_now_ms();
  vp_options_t o;
  shared_opts(ctx, &o, name, 8);
  vp_device_t dev = test_open(ctx, &o);
  uint64_t joined_ms = test_now_ms() - t0;
  char *s = snapshot(dev);
  test_note("%s", s);
  ASSERT_STR_CONTAINS(s, "\"joined\":true");
  ASSERT_EQ_INT(count_pid(s, k), 0);
  free(s);
  ASSERT_LT_U64(joined_ms, 1000);
  while (test_info(dev).free_memory != 8 * o.page_size) {
    ASSERT_LT_U64(test_now_ms() - t0, 1000);
    test_sleep_ms(5);
  }
  vp_vbar_t v = test_vbar(dev, 8 * o.page_size);
  test_load_pages(v, 0, 8);
  ASSERT_OK(vp_device_close(dev));
}

/* A holder killed while it answers (its eviction waits for a fence): the
 * requester gives up after the timeout and goes on; the dead one's memory
 * and its place in the ledger come back. */
TEST(ledger_sigkill_while_answering, TEST_SIM_ONLY) {
  char name[64];
  ledger_name(name, sizeof name, "mid");
  peer_cfg_t cp = cfg(name, 8, 4, 10, "slow", VP_SIM_WORKER);
  peer_t p = peer_start(ctx, peer_main, &cp, sizeof cp);
  ASSERT_EQ_U64(peer_do(&p, 'R'), 4);
  ASSERT_EQ_U64(peer_do(&p, 'W'), 0);
  vp_options_t o;
  shared_opts(ctx, &o, name, 8);
  o.ledger_timeout_us = 200000;
  vp_device_t dev = test_open(ctx, &o);
  vp_vbar_t v = test_vbar(dev, 8 * o.page_size);
  test_load_pages(v, 0, 4);
  uint64_t t0 = test_now_ms();
  ASSERT_RC(test_fault_page(v, 4, NULL), VP_MISS); /* the peer is stuck */
  uint64_t waited = test_now_ms() - t0;
  ASSERT_GE_U64(waited, 150);
  ASSERT_LT_U64(waited, 1000);
  ASSERT_EQ_INT(kill(p.pid, SIGKILL), 0);
  peer_wait(&p); /* killed: reap it */
  t0 = test_now_ms();
  while (test_fault_page(v, 4, NULL) != VP_OK) {
    ASSERT_LT_U64(test_now_ms() - t0, 1000);
    test_sleep_ms(5);
  }
  ASSERT_OK(vp_unpin(v, 4 * o.page_size, o.page_size, 0));
  vp_device_t other = test_open(ctx, &o); /* joining reaps the dead */
  char *s = snapshot(other);
  test_note("%s", s);
  ASSERT_EQ_INT(count_pid(s, p.pid), 0);
  ASSERT_STR_CONTAINS(s, "\"requests\":[]");
  free(s);
  ASSERT_OK(vp_device_close(other));
  ASSERT_OK(vp_device_close(dev));
}

/* A stopped holder: the request times out, the requester goes on (a miss)
 * and skips the holder for a second instead of waiting again; once it runs
 * again it answers. */
TEST(ledger_sigstop_peer, TEST_SIM_ONLY) {
  char name[64];
  ledger_name(name, sizeof name, "stop");
  peer_cfg_t cp = cfg(name, 8, 4, 10, "stopped", VP_SIM_SYNC);
  peer_t p = peer_start(ctx, peer_main, &cp, sizeof cp);
  ASSERT_EQ_U64(peer_do(&p, 'R'), 4);
  vp_options_t o;
  shared_opts(ctx, &o, name, 8);
  o.ledger_timeout_us = 100000;
  vp_device_t dev = test_open(ctx, &o);
  vp_vbar_t v = test_vbar(dev, 8 * o.page_size);
  test_load_pages(v, 0, 4);
  ASSERT_EQ_INT(kill(p.pid, SIGSTOP), 0);
  int st = 0; /* stopped for sure, not just signalled */
  ASSERT_EQ_INT(waitpid(p.pid, &st, WUNTRACED), p.pid);
  ASSERT_TRUE(WIFSTOPPED(st));
  uint64_t t0 = test_now_ms();
  ASSERT_RC(test_fault_page(v, 4, NULL), VP_MISS);
  uint64_t first = test_now_ms() - t0;
  t0 = test_now_ms();
  ASSERT_RC(test_fault_page(v, 4, NULL), VP_MISS);
  uint64_t second = test_now_ms() - t0;
  ASSERT_GE_U64(first, 90);
  ASSERT_LT_U64(first, 1000);
  ASSERT_LT_U64(second, 50);

  ASSERT_EQ_INT(kill(p.pid, SIGCONT), 0);
  test_sleep_ms(1100); /* the skip ends */
  ASSERT_OK(test_fault_page(v, 4, NULL));
  ASSERT_OK(vp_unpin(v, 4 * o.page_size, o.page_size, 0));
  ASSERT_EQ_U64(peer_do(&p, 'C'), 3);
  peer_quit(&p);
  ASSERT_OK(vp_device_close(dev));
}

/* A bad segment's first words: garbage, or a magic and a version. */
typedef struct bad_header {
  uint64_t magic;
  uint32_t version;
  bool garbage;
} bad_header_t;

#ifdef _WIN32
static int write_header(void *base, void *arg) {
  const bad_header_t *h = arg;
  if (h->garbage) {
    memset(base, 0xa5, 24);
  } else {
    memcpy(base, &h->magic, 8);
    memcpy((char *)base + 8, &h->version, 4);
  }
  return 0;
}
#endif

/* Write a segment by hand: `size` bytes, the header words given. Returns
 * the maker's view on Windows, where a segment lives while it is mapped
 * (NULL on POSIX, where it lives until its unlink). */
static void *bad_segment(const char *shm, off_t size, bad_header_t h) {
#ifdef _WIN32
  void *p = NULL;
  ASSERT_EQ_INT(vp__os_shm_create(shm, (size_t)size, write_header, &h, &p), 0);
  return p;
#else
  shm_unlink(shm);
  int fd = shm_open(shm, O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE_INT(fd, 0);
  ASSERT_EQ_INT(ftruncate(fd, size), 0);
  unsigned char buf[24];
  memset(buf, h.garbage ? 0xa5 : 0, sizeof buf);
  if (!h.garbage) {
    memcpy(buf, &h.magic, 8);
    memcpy(buf + 8, &h.version, 4);
  }
  if (size >= (off_t)sizeof buf)
    ASSERT_EQ_INT(pwrite(fd, buf, sizeof buf, 0), (int)sizeof buf);
  close(fd);
  return NULL;
#endif
}

/* The bad segment is still there, `size` bytes; then it goes. */
static void bad_segment_remove(const char *shm, off_t size, void *view) {
#ifdef _WIN32
  void *p = NULL;
  ASSERT_EQ_INT(vp__os_shm_open(shm, false, (size_t)size, &p, NULL), 0);
  vp__os_shm_unmap(p, (size_t)size);
  vp__os_shm_unmap(view, (size_t)size);
#else
  (void)view;
  struct stat st;
  int fd = shm_open(shm, O_RDONLY, 0);
  ASSERT_GE_INT(fd, 0);
  ASSERT_EQ_INT(fstat(fd, &st), 0);
  ASSERT_EQ_INT(st.st_size, size);
  close(fd);
  ASSERT_EQ_INT(shm_unlink(shm), 0);
#endif
}

/* A truncated, corrupt or other-version segment is not joined: the device
 * works alone and says why; the segment is left as it is. Windows has no
 * empty section and keeps sizes in whole pages: the 0- and 100-byte cases
 * are POSIX's only. */
TEST(ledger_bad_segment, TEST_SIM_ONLY) {
  static const struct {
    off_t size;
    bad_header_t h;
    const char *why;
  } cases[] = {
      {0, {0, 0, false}, "is 0 bytes"},
      {100, {0, 0, true}, "is 100 bytes, not"},
      {sizeof(ledger_seg_t), {0, 0, true}, "not a vpager ledger"},
      {sizeof(ledger_seg_t), {LEDGER_MAGIC, LEDGER_VERSION + 1, false},
       "version 3"},
      {sizeof(ledger_seg_t) + 4096, {LEDGER_MAGIC, LEDGER_VERSION, false},
       "bytes, not"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
#ifdef _WIN32
    if (cases[i].size < 4096) continue;
#endif
    char name[64], shm[128];
    ledger_name(name, sizeof name, "bad");
    snprintf(shm, sizeof shm, LEDGER_PREFIX "%s", name);
    test_note("case %zu: %s", i, cases[i].why);
    void *view = bad_segment(shm, cases[i].size, cases[i].h);
    vp_options_t o;
    test_options(ctx, &o);
    snprintf(o.ledger, sizeof o.ledger, "%s", name); /* asked for */
    vp_device_t dev = test_open(ctx, &o);
    char *s = snapshot(dev);
    ASSERT_STR_CONTAINS(s, "\"joined\":false");
    ASSERT_STR_CONTAINS(s, cases[i].why);
    free(s);
    vp_vbar_t v = test_vbar(dev, 4 * o.page_size);
    test_load_pages(v, 0, 4);
    char buf[4096];
    ASSERT_FAILS(vp_ledger_read(name, buf, sizeof buf, NULL));
    ASSERT_STR_CONTAINS(vp_last_error(), cases[i].why);
    ASSERT_OK(vp_device_close(dev));
    bad_segment_remove(shm, cases[i].size, view);
  }
}

/* A segment an earlier layout left under the name without the version
 * (its build's last process killed): this build's devices still join one
 * ledger of their own and see each other. */
TEST(ledger_older_layout_beside, TEST_SIM_ONLY) {
  char name[64], old[128];
  ledger_name(name, sizeof name, "old");
  snprintf(old, sizeof old, "/vpager-ledger-%s", name);
  void *seg = NULL;
  ASSERT_EQ_INT(vp__os_shm_create(old, 4096, NULL, NULL, &seg), 0);
  vp_options_t o;
  test_options(ctx, &o);
  snprintf(o.ledger, sizeof o.ledger, "%s", name);
  vp_device_t a = test_open(ctx, &o), b = test_open(ctx, &o);
  char *s = snapshot(a);
  ASSERT_STR_CONTAINS(s, "\"joined\":true");
  ASSERT_EQ_INT(count_pid(s, getpid()), 2);
  free(s);
  ASSERT_OK(vp_device_close(b));
  ASSERT_OK(vp_device_close(a));
  vp__os_shm_unmap(seg, 4096);
  vp__os_shm_unlink(old);
}

/* A segment whose lock word is of another kind (here a priority protocol
 * with a ceiling past any priority: glibc aborts in pthread_mutex_trylock
 * on it) is not locked: a device opened on it runs alone and says why;
 * one that had joined leaves without the lock. glibc's layout, or on
 * Windows the mark of os_win32.c's lock (a named mutex) overwritten. */
TEST(ledger_bad_lock_kind, TEST_SIM_ONLY) {
#if defined(__GLIBC__) || defined(_WIN32)
  char name[64], shm[128];
  ledger_name(name, sizeof name, "lockkind");
  snprintf(shm, sizeof shm, LEDGER_PREFIX "%s", name);
  vp_options_t o;
  test_options(ctx, &o);
  snprintf(o.ledger, sizeof o.ledger, "%s", name);
  vp_device_t joined = test_open(ctx, &o);
  void *p = NULL; /* the test's own view, through the platform layer */
  ASSERT_EQ_INT(vp__os_shm_open(shm, true, sizeof(ledger_seg_t), &p, NULL), 0);
  ledger_seg_t *seg = p;
#ifdef _WIN32
  /* os_win32.c's lock: the named mutex, marked made in seg->lock */
  unsigned char mark[8];
  memcpy(mark, &seg->lock, sizeof mark);
  memset(&seg->lock, 0xa5, sizeof mark);
#else
  /* os_posix.c's lock: a pthread mutex at the start of seg->lock */
  pthread_mutex_t *m = (pthread_mutex_t *)(void *)&seg->lock;
  int kind = m->__data.__kind;
  /* glibc: PTHREAD_MUTEX_PRIO_PROTECT_NP (64), not robust (16), ceiling
   * (bits 19 up) 4095 */
  m->__data.__kind = (kind & ~16) | 64 | (int)(0xfffu << 19);
#endif
  vp_device_t alone = test_open(ctx, &o);
  char *s = snapshot(alone);
  ASSERT_STR_CONTAINS(s, "\"joined\":false");
  ASSERT_STR_CONTAINS(s, "cannot be used");
  free(s);
  vp_vbar_t v = test_vbar(alone, 4 * o.page_size); /* alone, it works */
  test_load_pages(v, 0, 4);
  ASSERT_OK(vp_device_close(alone));
  ASSERT_OK(vp_device_close(joined));
#ifdef _WIN32
  memcpy(&seg->lock, mark, sizeof mark);
#else
  m->__data.__kind = kind;
#endif
  vp__os_shm_unmap(seg, sizeof *seg);
#ifndef _WIN32
  ASSERT_EQ_INT(shm_unlink(shm), 0); /* left without the lock: not removed */
#endif
#else
  (void)ctx;
#endif
}

/* A segment another user made (0600, theirs) is not joined: the device
 * runs alone and says whose it is; the owner's ledger is left alone. As
 * root (CI) a child that became nobody makes it; otherwise our own segment
 * with no permissions stands in for a foreign one (the open fails). */
#ifndef _WIN32
TEST(ledger_other_users_segment, TEST_SIM_ONLY) {
  char name[64], shm[128];
  ledger_name(name, sizeof name, "user");
  snprintf(shm, sizeof shm, LEDGER_PREFIX "%s", name);
  vp_options_t o;
  test_options(ctx, &o);
  snprintf(o.ledger, sizeof o.ledger, "%s", name);
  int up[2], down[2];
  ASSERT_EQ_INT(pipe(up), 0);
  ASSERT_EQ_INT(pipe(down), 0);
  bool root = geteuid() == 0;
  pid_t child = -1;
  const char *why = "is not open to us";
  if (root) {
    why = "belongs to uid 65534, not to us (uid 0)";
    fflush(stdout);
    fflush(stderr);
    child = fork();
    ASSERT_GE_INT(child, 0);
    if (child == 0) {
      if (setgid(65534) != 0 || setuid(65534) != 0) _exit(3);
      vp_device_t d = test_open(ctx, &o);
      put_u64(up[1], 1);
      char c;
      if (read(down[0], &c, 1) != 1) _exit(4);
      ASSERT_OK(vp_device_close(d));
      _exit(0);
    }
    ASSERT_EQ_U64(get_u64(up[0]), 1);
  } else {
    bad_segment(shm, sizeof(ledger_seg_t),
                (bad_header_t){LEDGER_MAGIC, LEDGER_VERSION, false});
    char path[160];
    snprintf(path, sizeof path, "/dev/shm%s", shm);
    ASSERT_EQ_INT(chmod(path, 0), 0);
  }
  vp_device_t dev = test_open(ctx, &o);
  char *s = snapshot(dev);
  test_note("%s", s);
  ASSERT_STR_CONTAINS(s, "\"joined\":false");
  ASSERT_STR_CONTAINS(s, why);
  free(s);
  vp_vbar_t v = test_vbar(dev, 4 * o.page_size); /* alone, it works */
  test_load_pages(v, 0, 4);
  ASSERT_OK(vp_device_close(dev));
  if (root) {
    char buf[1 << 16]; /* `vpager top` (read only) still sees it */
    char ledger[96];
    snprintf(ledger, sizeof ledger, "%s", name);
    ASSERT_OK(vp_ledger_read(ledger, buf, sizeof buf, NULL));
    ASSERT_STR_CONTAINS(buf, "\"joined\":false");
    ASSERT_EQ_INT(write(down[1], "q", 1), 1);
    int st = test_wait(child);
    ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  } else {
    ASSERT_EQ_INT(shm_unlink(shm), 0);
  }
  int fd = shm_open(shm, O_RDONLY, 0); /* the owner's last one removed it */
  ASSERT_LT_INT(fd, 0);
  for (int i = 0; i < 2; i++) {
    close(up[i]);
    close(down[i]);
  }
}
#else
TEST_EXCLUDED(ledger_other_users_segment, TEST_SIM_ONLY,
              "needs a segment of another user (a setuid child): Windows "
              "segments have no owner here (uid 0)")
#endif

/* --------------------------------------------------------- membership */

/* The live participant of this process with the highest (`newest`) or
 * lowest serial. */
static int own_part_of(ledger_seg_t *seg, bool newest) {
  int best = -1;
  for (int i = 0; i < LEDGER_PARTS; i++) {
    ledger_part_t *p = &seg->part[i];
    if (atomic_load(&p->state) != PART_LIVE ||
        atomic_load(&p->pid) != (int32_t)getpid())
      continue;
    if (best < 0 || (atomic_load(&p->serial) >
                     atomic_load(&seg->part[best].serial)) == newest)
      best = i;
  }
  ASSERT_GE_INT(best, 0);
  return best;
}

static void put_request(ledger_seg_t *seg, int k, int from, int to,
                        uint32_t state, uint64_t freed) {
  ledger_req_t *r = &seg->req[k];
  atomic_store(&r->from, (uint32_t)from);
  atomic_store(&r->from_serial, atomic_load(&seg->part[from].serial));
  atomic_store(&r->to, (uint32_t)to);
  atomic_store(&r->to_serial, atomic_load(&seg->part[to].serial));
  atomic_store(&r->bytes, 1);
  atomic_store(&r->freed, freed);
  atomic_store(&r->state, state);
}

/* A participant that leaves answers "nothing" to what is still posted to
 * it, and leaves an answer it gave before, not yet read, as it was. */
TEST(ledger_leave_keeps_answers, TEST_SIM_ONLY) {
  char name[64], shm[128];
  ledger_name(name, sizeof name, "answers");
  snprintf(shm, sizeof shm, LEDGER_PREFIX "%s", name);
  vp_options_t o;
  shared_opts(ctx, &o, name, 8);
  snprintf(o.ledger, sizeof o.ledger, "%s", name);
  vp_device_t stay = test_open(ctx, &o), go = test_open(ctx, &o);
  void *p = NULL; /* the test's own view, through the platform layer */
  ASSERT_EQ_INT(vp__os_shm_open(shm, true, sizeof(ledger_seg_t), &p, NULL), 0);
  ledger_seg_t *seg = p;
  int from = own_part_of(seg, false), to = own_part_of(seg, true);
  ASSERT_TRUE(from != to);
  put_request(seg, 0, from, to, REQ_DONE, 12345); /* answered, unread */
  put_request(seg, 1, from, to, REQ_POSTED, 777); /* never served */
  ASSERT_OK(vp_device_close(go));
  ASSERT_EQ_INT((int)atomic_load(&seg->req[0].state), REQ_DONE);
  ASSERT_EQ_U64(atomic_load(&seg->req[0].freed), 12345);
  ASSERT_EQ_INT((int)atomic_load(&seg->req[1].state), REQ_DONE);
  ASSERT_EQ_U64(atomic_load(&seg->req[1].freed), 0);
  for (int k = 0; k < 2; k++) atomic_store(&seg->req[k].state, REQ_FREE);
  vp__os_shm_unmap(seg, sizeof *seg);
  ASSERT_OK(vp_device_close(stay));
}


/* Room for two pinned pages of every slot at once: the test is about
 * joining and leaving, not about a full device (64 pages filled up under
 * load, and a join's pages missed). */
#define CHURN_PAGES (2 * LEDGER_PARTS)

typedef struct churn_cfg {
  char name[64];
  uint64_t loops;
  int seed;
} churn_cfg_t;

static void churn_child(test_ctx_t *ctx, const void *arg, int in, int out) {
  (void)in;
  const churn_cfg_t *c = arg;
  uint64_t loops = c->loops;
  int seed = c->seed;
  put_u64(out, 0);
  vp_options_t o;
  shared_opts(ctx, &o, c->name, CHURN_PAGES);
  for (uint64_t i = 0; i < loops; i++) {
    vp_device_t dev = test_open(ctx, &o);
    vp_vbar_t v = test_vbar(dev, 2 * o.page_size);
    ASSERT_OK(vp_vbar_set_label(v, "churn"));
    if ((i + (uint64_t)seed) % 2) test_load_pages(v, 0, 2);
    char *s = snapshot(dev);
    ASSERT_STR_CONTAINS(s, "\"joined\":true");
    free(s);
    ASSERT_OK(vp_device_close(dev));
  }
  exit(0);
}

/* As many processes as the ledger has slots join and leave in a loop, two
 * of them (looping until then) killed on the way:
 * every join succeeds, and once all are gone the ledger goes too. */
TEST(ledger_join_leave_many, TEST_SIM_ONLY) {
  char name[64];
  ledger_name(name, sizeof name, "churn");
  enum { N = LEDGER_PARTS }; /* every slot, in and out */
  uint64_t loops = test_scale(12);
  peer_t peers[N];
  for (int i = 0; i < N; i++) {
    churn_cfg_t c = {"", i < 2 ? UINT64_MAX : loops, i};
    snprintf(c.name, sizeof c.name, "%s", name);
    peers[i] = peer_start(ctx, churn_child, &c, sizeof c);
  }
  test_sleep_ms(5);
  kill(peers[0].pid, SIGKILL);
  kill(peers[1].pid, SIGKILL);
  for (int i = 0; i < N; i++) {
    int st = peer_wait(&peers[i]);
    if (i >= 2) ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  }
  /* A last one reaps whoever was killed inside and removes the name. */
  vp_options_t o;
  shared_opts(ctx, &o, name, CHURN_PAGES);
  vp_device_t dev = test_open(ctx, &o);
  char *s = snapshot(dev);
  test_note("%s", s);
  ASSERT_EQ_INT(count_of(s, "\"slot\":"), 1);
  ASSERT_STR_CONTAINS(s, "\"requests\":[]");
  free(s);
  ASSERT_OK(vp_device_close(dev));
  char buf[256], ledger[96];
  snprintf(ledger, sizeof ledger, "sim-%s", name);
  ASSERT_RC(vp_ledger_read(ledger, buf, sizeof buf, NULL), VP_ENODEV);
}

/* ------------------------------------------------------- the model API */

/* Asking for more than every participant could free frees what can be
 * freed, once (no loop), and says how much that was. */
TEST(ledger_free_memory_too_much, TEST_SIM_ONLY) {
  char name[64];
  ledger_name(name, sizeof name, "much");
  peer_cfg_t cp = cfg(name, 8, 4, 10, "peer", VP_SIM_SYNC);
  peer_t p = peer_start(ctx, peer_main, &cp, sizeof cp);
  ASSERT_EQ_U64(peer_do(&p, 'R'), 4);
  vp_options_t o;
  shared_opts(ctx, &o, name, 8);
  vp_device_t dev = test_open(ctx, &o);
  uint64_t ps = o.page_size, freed = 0;
  vp_vbar_t v = test_vbar(dev, 4 * ps), pinned = test_vbar(dev, ps);
  test_load_pages(v, 0, 2);
  ASSERT_OK(test_fault_page(pinned, 0, NULL));
  uint64_t t0 = test_now_ms();
  ASSERT_OK(vp_ledger_free_memory(dev, 100 * ps, &freed));
  ASSERT_LT_U64(test_now_ms() - t0, 1000);
  ASSERT_EQ_U64(freed, 6 * ps); /* the peer's 4 and our 2; not the pinned */
  ASSERT_EQ_U64(peer_do(&p, 'C'), 0);
  char *s = snapshot(dev); /* the peer was asked once: no loop */
  ASSERT_STR_CONTAINS(s, "\"served\":1,");
  free(s);
  ASSERT_EQ_U64(test_resident_count(v), 0);
  ASSERT_EQ_U64(test_resident_count(pinned), 1);
  ASSERT_OK(vp_ledger_free_memory(dev, 100 * ps, &freed));
  ASSERT_EQ_U64(freed, 0);
  s = snapshot(dev); /* nothing reclaimable: nobody asked at all */
  ASSERT_STR_CONTAINS(s, "\"served\":1,");
  ASSERT_EQ_INT(count_of(s, "\"served\":0,"), 1); /* we served nothing */
  free(s);
  /* Exactly what is asked, least recently used first: ours went last. As
   * under pressure, eviction lowered our watermark: prioritize lifts it. */
  ASSERT_EQ_U64(peer_do(&p, 'R'), 4);
  test_sleep_ms(20);
  ASSERT_OK(vp_vbar_prioritize(v));
  test_load_pages(v, 0, 2);
  ASSERT_OK(vp_ledger_free_memory(dev, 3 * ps, &freed));
  ASSERT_EQ_U64(freed, 3 * ps);
  ASSERT_EQ_U64(peer_do(&p, 'C'), 1);
  ASSERT_EQ_U64(test_resident_count(v), 2);
  ASSERT_OK(vp_unpin(pinned, 0, ps, 0));
  peer_quit(&p);
  ASSERT_OK(vp_device_close(dev));
}

/* A keep list: the kept VBARs (ours, of two devices of this process) stay
 * whole; the others go least recently used first, the peer's too. Without
 * a ledger the keep list holds as well. */
TEST(ledger_free_memory_keep, TEST_SIM_ONLY) {
  char name[64];
  ledger_name(name, sizeof name, "keep");
  peer_cfg_t cp = cfg(name, 12, 3, 10, "peer", VP_SIM_SYNC);
  peer_t p = peer_start(ctx, peer_main, &cp, sizeof cp);
  ASSERT_EQ_U64(peer_do(&p, 'R'), 3);
  vp_options_t o;
  shared_opts(ctx, &o, name, 12);
  uint64_t ps = o.page_size, freed = 0;
  vp_device_t d1 = test_open(ctx, &o), d2 = test_open(ctx, &o);
  vp_vbar_t a = test_vbar(d1, 3 * ps), b = test_vbar(d1, 3 * ps);
  vp_vbar_t c = test_vbar(d2, 3 * ps);
  test_load_pages(a, 0, 3);
  test_load_pages(b, 0, 3);
  test_load_pages(c, 0, 3);
  vp_vbar_t keep[2] = {a, c};
  ASSERT_RC(vp_ledger_free_memory_keep(d1, ps, NULL, 1, &freed), VP_EINVAL);
  ASSERT_OK(vp_ledger_free_memory_keep(d1, 100 * ps, keep, 2, &freed));
  ASSERT_EQ_U64(freed, 6 * ps); /* the peer's 3 and b's 3 */
  ASSERT_EQ_U64(peer_do(&p, 'C'), 0);
  ASSERT_EQ_U64(test_resident_count(a), 3);
  ASSERT_EQ_U64(test_resident_count(b), 0);
  ASSERT_EQ_U64(test_resident_count(c), 3);
  ASSERT_OK(vp_device_set_external_floor(d1, 777));
  char *s = snapshot(d1);
  ASSERT_STR_CONTAINS(s, "\"external_floor\":777");
  free(s);
  peer_quit(&p);
  ASSERT_OK(vp_device_close(d2));
  ASSERT_OK(vp_device_close(d1));
  vp_device_t alone = test_open(ctx, NULL);
  uint64_t aps = test_info(alone).page_size;
  vp_vbar_t x = test_vbar(alone, 2 * aps), y = test_vbar(alone, 2 * aps);
  test_load_pages(x, 0, 2);
  test_load_pages(y, 0, 2);
  ASSERT_OK(vp_ledger_free_memory_keep(alone, 100 * aps, &x, 1, &freed));
  ASSERT_EQ_U64(freed, 2 * aps);
  ASSERT_EQ_U64(test_resident_count(x), 2);
  ASSERT_EQ_U64(test_resident_count(y), 0);
  ASSERT_OK(vp_device_set_external_floor(alone, 1)); /* no ledger: kept nowhere */
  ASSERT_OK(vp_device_close(alone));
}

/* vp_acquire's misses that our own pages could not cover are taken to the
 * other processes after the call: the next acquire finds the room. */
TEST(ledger_acquire_asks_after, TEST_SIM_ONLY) {
  char name[64];
  ledger_name(name, sizeof name, "acq");
  peer_cfg_t cp = cfg(name, 8, 6, 10, "peer", VP_SIM_SYNC);
  peer_t p = peer_start(ctx, peer_main, &cp, sizeof cp);
  ASSERT_EQ_U64(peer_do(&p, 'R'), 6);
  vp_options_t o;
  shared_opts(ctx, &o, name, 8);
  uint64_t ps = o.page_size;
  o.staging_size = ps;
  o.lookahead = 0;
  vp_device_t dev = test_open(ctx, &o);
  vp_vbar_t v = test_vbar(dev, 2 * ps);
  unsigned char *host = malloc(2 * ps);
  ASSERT_NOT_NULL(host);
  test_pattern(host, 2 * ps, 77);
  uint64_t off[2] = {0, ps}, size[2] = {ps, ps};
  vp_source_t src[2] = {{.kind = VP_SOURCE_HOST, .host = host},
                        {.kind = VP_SOURCE_HOST, .host = host + ps}};
  vp_weight_t w[2];
  ASSERT_OK(vp_weights_create(v, 2, off, size, src, w));
  uint64_t ptr[2];
  uint8_t flags[2];
  /* The ring takes one free page, weight 0 the other; weight 1 misses. */
  ASSERT_OK(vp_acquire(dev, w, 2, 0, ptr, flags));
  ASSERT_EQ_INT(flags[0] & VP_ACQUIRED_RESIDENT, VP_ACQUIRED_RESIDENT);
  ASSERT_EQ_INT(flags[1] & VP_ACQUIRED_STAGED, VP_ACQUIRED_STAGED);
  ASSERT_OK(vp_release(dev, w, 2, 0));
  ASSERT_EQ_U64(peer_do(&p, 'C'), 5);
  ASSERT_OK(vp_acquire(dev, w, 2, 0, ptr, flags));
  ASSERT_EQ_INT(flags[1] & VP_ACQUIRED_RESIDENT, VP_ACQUIRED_RESIDENT);
  unsigned char *back = malloc(ps);
  ASSERT_NOT_NULL(back);
  ASSERT_OK(vp_copy_to_host(dev, back, ptr[1], ps, 0));
  ASSERT_OK(vp_stream_synchronize(dev, 0));
  ASSERT_MEM_EQ(back, host + ps, ps);
  ASSERT_OK(vp_release(dev, w, 2, 0));
  peer_quit(&p);
  ASSERT_OK(vp_device_close(dev));
  free(back);
  free(host);
}

/* What `vpager top` reads: the list of ledgers, one by name (read only),
 * the reservation a framework published, and a device without a ledger. */
TEST(ledger_views, TEST_SIM_ONLY) {
  char name[64], ledger[96];
  ledger_name(name, sizeof name, "view");
  snprintf(ledger, sizeof ledger, "sim-%s", name);
  vp_options_t o;
  shared_opts(ctx, &o, name, 8);
  vp_device_t dev = test_open(ctx, &o);
  vp_vbar_t v = test_vbar(dev, 2 * o.page_size);
  ASSERT_OK(vp_vbar_set_label(v, "unet (fp16)"));
  test_load_pages(v, 0, 1);
  ASSERT_OK(vp_device_set_external_reserved(dev, 12345));
  char buf[1 << 16];
  size_t need = 0;
  ASSERT_OK(vp_ledger_list(buf, sizeof buf, NULL));
  char quoted[112];
  snprintf(quoted, sizeof quoted, "\"%s\"", ledger);
  ASSERT_STR_CONTAINS(buf, quoted);
  ASSERT_OK(vp_ledger_read(ledger, buf, sizeof buf, &need));
  ASSERT_EQ_U64(strlen(buf), need);
  ASSERT_STR_CONTAINS(buf, "\"joined\":false"); /* a reader is no member */
  ASSERT_STR_CONTAINS(buf, "\"label\":\"unet (fp16)\"");
  ASSERT_STR_CONTAINS(buf, "\"external_reserved\":12345");
  ASSERT_STR_CONTAINS(buf, "\"resident\":65536");
  ASSERT_RC(vp_ledger_read(ledger, buf, 8, NULL), VP_ERANGE);
  ASSERT_RC(vp_ledger_read("no/such", buf, sizeof buf, NULL), VP_EINVAL);
  ASSERT_RC(vp_ledger_read("sim-none-here", buf, sizeof buf, NULL),
            VP_ENODEV);
  ASSERT_RC(vp_vbar_set_label(v, "quote\""), VP_EINVAL);
  char big[VP_LABEL_MAX + 1];
  memset(big, 'x', VP_LABEL_MAX);
  big[VP_LABEL_MAX] = '\0';
  ASSERT_RC(vp_vbar_set_label(v, big), VP_EINVAL);
  ASSERT_RC(vp_vbar_label(v, buf, 4), VP_ERANGE);
  ASSERT_OK(vp_device_close(dev));
  vp_device_t alone = test_open(ctx, NULL);
  char *s = snapshot(alone);
  ASSERT_STR_CONTAINS(s, "\"joined\":false");
  ASSERT_STR_CONTAINS(s, "not shared");
  free(s);
  uint64_t freed = 1;
  ASSERT_OK(vp_ledger_free_memory(alone, 1, &freed));
  ASSERT_EQ_U64(freed, 0);
  ASSERT_OK(vp_device_close(alone));
}

/* vp__os_shm_create's init for a creator killed while it makes the
 * segment. */
static int die_midway(void *base, void *arg) {
  (void)base;
  (void)arg;
  kill(getpid(), SIGKILL);
  return 0;
}

static void unlink_each(const char *name, void *arg) {
  char path[320];
  snprintf(path, sizeof path, "/%s", name);
  vp__os_shm_unlink(path);
  (*(int *)arg)++;
}

/* A peer that creates the segment named by its arg and is killed while
 * it makes it. */
static void midway_creator(test_ctx_t *ctx, const void *arg, int in,
                           int out) {
  (void)ctx;
  (void)in;
  put_u64(out, 0);
  void *p;
  vp__os_shm_create(arg, sizeof(ledger_seg_t), die_midway, NULL, &p);
  _exit(1);
}

/* A creator killed while it makes a ledger leaves nothing under the
 * ledger's name (POSIX: a segment is made under a temporary name and
 * linked into place once whole; Windows: the section goes with its
 * creator), so the next device makes the ledger anew and joins; a 0-byte
 * segment there made every later device run alone. */
TEST(ledger_creator_killed_midway, TEST_SIM_ONLY) {
  char name[64], shm[128], tmp[64];
  ledger_name(name, sizeof name, "midway");
  snprintf(shm, sizeof shm, LEDGER_PREFIX "%s", name);
  peer_t child = peer_start(ctx, midway_creator, shm, sizeof shm);
  int st = peer_wait(&child);
  ASSERT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
  void *p = NULL;
  ASSERT_EQ_INT(vp__os_shm_open(shm, false, sizeof(ledger_seg_t), &p, NULL),
                ENOENT);
  int left = 0; /* the killed creator's temporary segment */
  snprintf(tmp, sizeof tmp, ".vpager-new-%d-", (int)child.pid);
  ASSERT_EQ_INT(vp__os_shm_list(tmp, unlink_each, &left), 0);
#ifdef _WIN32
  ASSERT_EQ_INT(left, 0); /* none is made */
#else
  ASSERT_EQ_INT(left, 1);
#endif
  vp_options_t o;
  test_options(ctx, &o);
  snprintf(o.ledger, sizeof o.ledger, "%s", name);
  vp_device_t dev = test_open(ctx, &o);
  char *s = snapshot(dev);
  ASSERT_STR_CONTAINS(s, "\"joined\":true");
  free(s);
  ASSERT_OK(vp_device_close(dev));
}
