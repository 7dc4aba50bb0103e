/* fuzz_api: call sequences on the simulated device.
 *
 * Input: a header of 8 bytes (the device's options), then operations, one
 * opcode byte and its argument bytes each, up to MAX_OPS of them. Header
 * byte 0 bit 0 picks the mode:
 *
 *  strict (0)  a model of the device follows every call: weights and the
 *              bytes of their sources, holds per weight and stream (how
 *              many; of them how many are surely / at most in place),
 *              raw pins per page, page generations, scratch bytes written
 *              through raw faults. Every result is checked against it:
 *              return codes, vp_acquire's flags and pointers, the bytes
 *              read back through vp_copy_to_host (and by simulated
 *              kernels queued on the stream, which in worker mode run
 *              after the release), residency and pin flags, freed bytes,
 *              stats. Rules the model holds the library to:
 *                - a release on stream S ends a hold taken on S;
 *                  VP_ENOTPINNED (nothing changes) when S holds the weight
 *                  fewer times than the call lists it;
 *                - vp_stream_destroy of a value vp_stream_create did not
 *                  return (or already destroyed) fails;
 *                - a page pinned since its generation was read keeps it,
 *                  and bytes written under a generation stay while it does;
 *                - VP_ACQUIRED_EMPTY exactly when a NONE weight's bytes at
 *                  that place were never filled since (re)commit;
 *                - a new source (vp_weight_set_source; or the weight
 *                  destroyed and made anew over its range): VP_EBUSY while
 *                  acquired; else the next acquire copies (COPIED) and
 *                  reads the new bytes (EMPTY for NONE), while a kernel
 *                  queued on a hold's stream before its release still
 *                  reads the old ones (slow kernels, worker streams);
 *                - the same bytes from a new place
 *                  (vp_weight_swap_source): VP_EBUSY while acquired; else
 *                  nothing is filled anew and the old place may be freed
 *                  at once;
 *                - a weight's window (vp_weight_set_lookahead) reads back
 *                  as set, held or not; VP_EHANDLE once destroyed.
 *  wild (1)    arbitrary arguments: live, stale, made-up and foreign
 *              handles, streams and addresses, odd sizes, NULL outputs.
 *              Checks only for crashes, sanitizer reports, leaks, hangs
 *              and the error-code rule.
 *
 * In both modes every call obeys the error-code rule (fuzz_common.h), and
 * the device is closed at the end of each input so leaks show.
 * FUZZ_TRACE=1 prints each call as it is made; a failed check prints the
 * whole trace. FUZZ_SKIP=... leaves out named checks (README.md). */
#include <fcntl.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fuzz_common.h"

#define KiB (1024ull)
#define MiB (1024ull * KiB)
#define MAX_OPS 400

/* Source bytes of every HOST and FILE weight: arena (and the same bytes in
 * the memfd arena_fd), at an offset per weight. */
#define ARENA_SIZE (16 * MiB)
static uint8_t *arena;
static int arena_fd = -1;
static uint8_t *rbuf;  /* read-back buffer */
static uint8_t *pbuf;  /* pattern buffer */
static char st_path[64]; /* a small valid safetensors file (wild mode) */
static int st_fd = -1;

static bool skip_fake_destroy, skip_cross_release, skip_repeat_release;
static bool skip_empty_after_fail, skip_fail_nth, skip_set_source;

/* ------------------------------------------------------------- config */

static const struct {
  uint64_t gran, page;
} geometry[4] = {
    {2 * MiB, 2 * MiB}, {2 * MiB, 4 * MiB}, {64 * KiB, 64 * KiB},
    {64 * KiB, 128 * KiB}};

typedef struct cfg {
  bool wild, worker, interleaved, hostbuf, tidy, second_dev;
  bool pins_shared; /* wild: the devices join one pin ledger (pins.c) */
  bool first_fit;   /* staging_wrap 0: the ring's slots do not wrap */
  int streams; /* strict: streams created before the first op */
  uint64_t gran, page;
  int shift;
  uint32_t cap_pages;
  uint64_t staging, lookahead;
  int64_t fail_nth;
  uint32_t file_slots;
  uint64_t file_slot_size;
  uint32_t poll_us;
  int64_t headroom;
  uint64_t pin_budget;
} cfg_t;

static void cfg_read(fz_reader_t *r, cfg_t *c) {
  uint8_t b[8];
  for (int i = 0; i < 8; i++) b[i] = fz_u8(r);
  memset(c, 0, sizeof *c);
  c->wild = b[0] & 1;
  c->worker = b[0] & 2;
  c->gran = geometry[(b[0] >> 2) & 3].gran;
  c->page = geometry[(b[0] >> 2) & 3].page;
  c->shift = __builtin_ctzll(c->page);
  c->interleaved = b[0] & 0x10;
  c->hostbuf = b[0] & 0x20;
  c->tidy = b[0] & 0x40;
  c->cap_pages = 3 + b[1] % 30;
  c->staging = (b[2] & 3) * c->page + ((b[2] >> 2) & 7) * (c->page / 8);
  c->lookahead = b[3] < 64 ? 0 : b[3] == 255 ? UINT64_MAX
                                             : (uint64_t)(b[3] - 64) * 16 * KiB;
  c->fail_nth = (b[0] & 0x80) ? 1 + (int64_t)b[4] * (1 + (b[5] & 3)) : 0;
  c->file_slots = 2 + (b[5] >> 2) % 3;
  c->file_slot_size = 4096ull << ((b[5] >> 4) % 6);
  c->poll_us = (b[6] & 1) ? 0 : 5000;
  c->headroom = (b[6] & 2) ? 0 : -1;
  c->pin_budget = (b[6] & 4) ? 64 * KiB : 0;
  if (skip_fail_nth) c->fail_nth = 0;
  c->second_dev = b[7] & 1;
  c->streams = (b[7] >> 1) & 3;
  c->pins_shared = c->wild && (b[7] & 8);
  c->first_fit = b[7] & 0x10;
}

static void cfg_options(const cfg_t *c, vp_options_t *o) {
  vp_options_init(o);
  o->backend = VP_BACKEND_SIM;
  o->page_size = c->page;
  o->sim_granularity = c->gran;
  o->sim_capacity = (uint64_t)c->cap_pages * c->page;
  o->sim_streams = c->worker ? VP_SIM_WORKER : VP_SIM_SYNC;
  o->sim_shared[0] = '\0';
  o->sim_fail_nth = c->fail_nth;
  o->evict_order = c->interleaved ? VP_ORDER_INTERLEAVED : VP_ORDER_TAIL_FIRST;
  o->staging_size = c->staging;
  o->staging_wrap = !c->first_fit;
  o->lookahead = c->lookahead;
  o->file_slots = c->file_slots;
  o->file_slot_size = c->file_slot_size;
  o->poll_interval_us = c->poll_us;
  o->headroom = c->headroom;
  o->pin_budget = c->pin_budget;
  /* A ledger of our own name: both devices count their pinned memory in
   * one pin ledger and ask each other for it (and share a GPU ledger). */
  if (c->pins_shared)
    snprintf(o->ledger, sizeof o->ledger, "fz-pins-%d", (int)getpid());
}

/* ------------------------------------------------------------ patterns */

__attribute__((no_sanitize("coverage"))) static uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

/* Bytes of pattern `pat` (never the arena's, never all zero). Helpers
 * that touch every byte are left out of coverage instrumentation: they
 * would otherwise take most of the time. */
#define FZ_FAST __attribute__((no_sanitize("coverage")))

FZ_FAST static void pattern(uint8_t *buf, uint64_t n, uint32_t pat) {
  uint64_t x = mix(0x9e3779b97f4a7c15ull * (pat + 1)), i = 0;
  for (; i + 8 <= n; i += 8) {
    x = mix(x + i);
    uint64_t y = x | 0x0101010101010101ull;
    memcpy(buf + i, &y, 8);
  }
  x = mix(x + i) | 0x0101010101010101ull;
  memcpy(buf + i, &x, n - i);
}

/* ------------------------------------------------------------- kernels */

/* A simulated kernel: compares the bytes at ptr with expect when the
 * stream runs it; the first mismatch is recorded (op number + 1). A slow
 * one first sleeps KERN_SLOW_US on its worker stream, so the calls after
 * its release (a new source, a new acquire filling the same pages) run
 * while it is still queued, as a long kernel on a GPU would be. */
#define KERN_SLOW_US 3000
typedef struct kern {
  struct kern *next;
  const uint8_t *ptr;
  uint64_t size;
  const uint8_t *expect; /* arena, or the copy after this struct */
  unsigned op;
  bool slow;
} kern_t;

static atomic_uint kern_bad;

static void kern_fn(void *arg) {
  kern_t *k = arg;
  if (k->slow) usleep(KERN_SLOW_US);
  if (memcmp(k->ptr, k->expect, k->size) != 0) {
    unsigned zero = 0;
    atomic_compare_exchange_strong(&kern_bad, &zero, k->op + 1);
  }
}

static void kern_noop(void *arg) { (void)arg; }

/* --------------------------------------------------------------- model */

#define MAXS 8  /* stream slots, 0 = the default stream */
#define MAXV 8
#define MAXW 40
#define MAXP 16
#define MAXRAW 24
#define MAXSCR 8

typedef struct fstream {
  vp_stream_t h;
  bool live;
} fstream_t;

typedef struct fvbar {
  vp_vbar_t h;
  bool live;
  uint64_t size, base, wlimit, cursor;
  uint32_t npages;
  uint32_t rawpins[MAXP];
  uint32_t gen[MAXP];
  bool gen_known[MAXP];
} fvbar_t;

enum { K_HOST = 0, K_FILE = 1, K_NONE = 2 };
static const char *const kind_name[] = {"host", "file", "none"};

typedef struct fweight {
  vp_weight_t h;
  bool live;
  int v, kind;
  uint64_t off, size, aoff;
  uint32_t p0, p1;
  /* holds on stream slot s: n in all, of which between rmin and rmax in
   * place (pins) and the rest staged (the weight's one slot) */
  uint32_t n[MAXS], rmin[MAXS], rmax[MAXS];
  uint64_t staged_ptr;
  bool staged_ptr_set;
  /* NONE weights: the pattern last written in place / in its slot */
  uint32_t inplace_pat, staged_pat;
  bool inplace_known, staged_known;
  /* FUZZ_SKIP=empty-after-failed-acquire: a failed acquire listed it, so
   * its next non-EMPTY acquire is not checked (the bytes are rewritten) */
  bool resync_inplace, resync_staged;
  /* a HOST or FILE source set (vp_weight_set_source, or made anew over
   * the range) since its last acquire: that one must come back COPIED */
  bool must_copy;
  /* after vp_weight_swap_source: the HOST bytes it reads now, a malloc'd
   * copy of its last ones, freed at its next swap or new source (copies
   * from it are waited for then) or when the input ends */
  uint8_t *own;
} fweight_t;

typedef struct fraw {
  int v;
  uint64_t off, size;
} fraw_t;

typedef struct fscr {
  bool live;
  int v;
  uint64_t off, size;
  uint32_t gens[MAXP];
  uint8_t *bytes;
} fscr_t;

static struct state {
  cfg_t cfg;
  vp_device_t dev;
  bool open;
  bool broken;       /* VP_SIM_BREAK: every call fails with VP_EDEVICE */
  bool maybe_broken; /* an injected failure reported VP_EDEVICE: stop */
  bool fail_seen;    /* the one injected failure (sim_fail_nth) was seen */
  bool staging_seen; /* an acquire staged something: the ring exists */
  unsigned op;
  fstream_t S[MAXS];
  int nS;
  fvbar_t V[MAXV];
  int nV;
  fweight_t W[MAXW];
  int nW;
  fraw_t raw[MAXRAW];
  int nraw;
  fscr_t scr[MAXSCR];
  uint32_t next_pat;
  kern_t *kerns;
  int kern_w; /* 1 + the weight the last kernel checked; 0: none yet */
} g;

#define CHECK(cond, ...)                                                       \
  do {                                                                         \
    if (!(cond)) fz_fail(__VA_ARGS__);                                         \
  } while (0)

static void pages_of(uint64_t off, uint64_t size, uint32_t *p0, uint32_t *p1) {
  *p0 = (uint32_t)(off >> g.cfg.shift);
  *p1 = (uint32_t)(((off + size - 1) >> g.cfg.shift) + 1);
}

/* Lower and upper bounds of page p's pin count. */
FZ_FAST static void pin_bounds(int v, uint32_t p, uint64_t *lo, uint64_t *hi) {
  *lo = *hi = g.V[v].rawpins[p];
  for (int i = 0; i < g.nW; i++) {
    const fweight_t *w = &g.W[i];
    if (!w->live || w->v != v || p < w->p0 || p >= w->p1) continue;
    for (int s = 0; s < MAXS; s++) *lo += w->rmin[s], *hi += w->rmax[s];
  }
}

static bool range_surely_pinned(int v, uint32_t p0, uint32_t p1) {
  for (uint32_t p = p0; p < p1; p++) {
    uint64_t lo, hi;
    pin_bounds(v, p, &lo, &hi);
    if (!lo) return false;
  }
  return true;
}

static uint32_t holds_total(const fweight_t *w) {
  uint32_t t = 0;
  for (int s = 0; s < MAXS; s++) t += w->n[s];
  return t;
}

static uint32_t holds_on_stream(int s) {
  uint32_t t = 0;
  for (int i = 0; i < g.nW; i++) t += g.W[i].n[s];
  return t;
}

/* Holds that are surely staged / surely in place. */
static uint32_t surely_staged(const fweight_t *w) {
  uint32_t t = 0;
  for (int s = 0; s < MAXS; s++) t += w->n[s] - w->rmax[s];
  return t;
}

static uint32_t surely_resident(const fweight_t *w) {
  uint32_t t = 0;
  for (int s = 0; s < MAXS; s++) t += w->rmin[s];
  return t;
}

static bool vbar_busy(int v) {
  for (uint32_t p = 0; p < g.V[v].npages; p++)
    if (g.V[v].rawpins[p]) return true;
  for (int i = 0; i < g.nW; i++)
    if (g.W[i].live && g.W[i].v == v && holds_total(&g.W[i])) return true;
  return false;
}

static const uint8_t *weight_src(const fweight_t *w) {
  return w->own ? w->own : arena + w->aoff;
}

/* An error the model did not predict: tolerated once when sim_fail_nth
 * may explain it (then the state is as before the call), else a finding. */
static void unexpected(const char *what, int rc, const char *expected) {
  if (g.maybe_broken && rc == VP_EDEVICE) return; /* the op ends anyway */
  if (g.cfg.fail_nth && !g.fail_seen &&
      (rc == VP_ENOMEM || rc == VP_EDEVICE || rc == VP_EOOM ||
       rc == VP_EAGAIN)) {
    g.fail_seen = true;
    if (rc == VP_EDEVICE) g.maybe_broken = true;
    fz_trace("  (%s: %s taken as the injected failure)", what,
             vp_err_name(rc));
    return;
  }
  fz_fail("op %u: %s returned %s, expected %s", g.op, what, vp_err_name(rc),
          expected);
}

/* rc must be `want` (or an injected failure). True when it is `want`. */
static bool expect_rc(const char *what, int rc, int want) {
  if (rc == want) return true;
  char buf[64];
  snprintf(buf, sizeof buf, "%s", vp_err_name(want));
  unexpected(what, rc, buf);
  return false;
}

/* ------------------------------------------------------ consistency */

static void residency(int v, uint8_t *flags) {
  fvbar_t *b = &g.V[v];
  int rc = FZ_CALL(false, vp_vbar_residency(b->h, flags, b->npages), "v%d, %u",
                   v, b->npages);
  CHECK(rc == VP_OK, "op %u: vp_vbar_residency(v%d) = %s", g.op, v,
        vp_err_name(rc));
}

/* Pin flags against the model's bounds; RESIDENT where PINNED; loaded
 * size; forget generations of pages that may have been unpinned. */
static void check_vbar(int v) {
  fvbar_t *b = &g.V[v];
  uint8_t flags[MAXP];
  residency(v, flags);
  uint32_t resident = 0;
  for (uint32_t p = 0; p < b->npages; p++) {
    uint64_t lo, hi;
    pin_bounds(v, p, &lo, &hi);
    bool pinned = flags[p] & VP_PAGE_PINNED;
    resident += (flags[p] & VP_PAGE_RESIDENT) != 0;
    CHECK(!(lo && !pinned), "op %u: v%d page %u is not pinned, but the model "
          "holds %llu..%llu pins on it (raw %u)", g.op, v, p,
          (unsigned long long)lo, (unsigned long long)hi, b->rawpins[p]);
    CHECK(!(hi == 0 && pinned), "op %u: v%d page %u is pinned, but nothing "
          "the model knows pins it", g.op, v, p);
    CHECK(!(pinned && !(flags[p] & VP_PAGE_RESIDENT)), "op %u: v%d page %u "
          "is pinned but not resident", g.op, v, p);
    if (!lo) b->gen_known[p] = false;
  }
  uint64_t loaded = 0;
  int rc = FZ_CALL(false, vp_vbar_loaded_size(b->h, &loaded), "v%d", v);
  CHECK(rc == VP_OK && loaded == (uint64_t)resident << g.cfg.shift,
        "op %u: v%d loaded size %llu, residency shows %u pages", g.op, v,
        (unsigned long long)loaded, resident);
}

static void check_all(void) {
  fz_quiet = true; /* not in the trace: after every op */
  for (int v = 0; v < g.nV; v++)
    if (g.V[v].live) check_vbar(v);
  fz_quiet = false;
  unsigned bad = atomic_load(&kern_bad);
  CHECK(!bad, "a kernel queued at op %u read wrong bytes", bad - 1);
}

/* ----------------------------------------------------------- pickers */

static int pick_stream(fz_reader_t *r) {
  int live[MAXS], n = 0;
  for (int s = 0; s < g.nS; s++)
    if (g.S[s].live) live[n++] = s;
  return live[fz_u8(r) % n];
}

/* A weight index: bit 7 set: a live one if any; else any ever made. */
static int weight_of(uint8_t b) {
  if (!g.nW) return -1;
  if (b & 0x80) {
    int live[MAXW], n = 0;
    for (int i = 0; i < g.nW; i++)
      if (g.W[i].live) live[n++] = i;
    if (n) return live[(b & 0x7f) % n];
  }
  return (b & 0x7f) % g.nW;
}

static int pick_weight(fz_reader_t *r) { return weight_of(fz_u8(r)); }

static int pick_vbar(fz_reader_t *r) {
  uint8_t b = fz_u8(r);
  if (!g.nV) return -1;
  if (b & 0x80) {
    int live[MAXV], n = 0;
    for (int i = 0; i < g.nV; i++)
      if (g.V[i].live) live[n++] = i;
    if (n) return live[(b & 0x7f) % n];
  }
  return (b & 0x7f) % g.nV;
}

/* ----------------------------------------------------- host <-> device */

/* Read [ptr, +size) on stream slot s and compare with want. */
static void read_check(const char *what, uint64_t ptr, uint64_t size, int s,
                       const uint8_t *want) {
  int rc = FZ_CALL(false, vp_copy_to_host(g.dev, rbuf, ptr, size, g.S[s].h),
                   "0x%llx, %llu, s%d", (unsigned long long)ptr,
                   (unsigned long long)size, s);
  if (!expect_rc("vp_copy_to_host", rc, VP_OK)) return;
  rc = FZ_CALL(false, vp_stream_synchronize(g.dev, g.S[s].h), "s%d", s);
  if (!expect_rc("vp_stream_synchronize", rc, VP_OK)) return;
  if (memcmp(rbuf, want, size) != 0) {
    uint64_t i = 0;
    while (rbuf[i] == want[i]) i++;
    fz_fail("op %u: %s: byte %llu of %llu at 0x%llx is 0x%02x, expected "
            "0x%02x", g.op, what, (unsigned long long)i,
            (unsigned long long)size, (unsigned long long)ptr, rbuf[i],
            want[i]);
  }
}

/* Write pattern pat to [ptr, +size) on stream slot s. */
static bool write_pat(uint64_t ptr, uint64_t size, int s, uint32_t pat) {
  pattern(pbuf, size, pat);
  int rc = FZ_CALL(false, vp_copy_to_device(g.dev, ptr, pbuf, size, g.S[s].h),
                   "0x%llx, pat %u, %llu, s%d", (unsigned long long)ptr, pat,
                   (unsigned long long)size, s);
  if (!expect_rc("vp_copy_to_device", rc, VP_OK)) return false;
  rc = FZ_CALL(false, vp_stream_synchronize(g.dev, g.S[s].h), "s%d", s);
  return expect_rc("vp_stream_synchronize", rc, VP_OK);
}

/* want: the arena (never written: a source's old bytes stay there for a
 * kernel still queued after the weight got a new source), else copied
 * (a swapped source's copy is freed at the next swap). */
static void launch_check(int widx, uint64_t ptr, int s, const uint8_t *want,
                         bool slow) {
  fweight_t *w = &g.W[widx];
  bool copy = want < arena || want >= arena + ARENA_SIZE;
  kern_t *k = malloc(sizeof *k + (copy ? w->size : 0));
  if (!k) return;
  *k = (kern_t){.ptr = (const uint8_t *)(uintptr_t)ptr, .size = w->size,
                .expect = want, .op = g.op, .next = g.kerns, .slow = slow};
  if (copy) {
    memcpy(k + 1, want, w->size);
    k->expect = (const uint8_t *)(k + 1);
  }
  g.kerns = k;
  g.kern_w = widx + 1;
  int rc = FZ_CALL(false, vp_sim_launch(g.dev, g.S[s].h, kern_fn, k),
                   "s%d, %scheck w%d at 0x%llx", s, slow ? "slow " : "",
                   widx, (unsigned long long)ptr);
  expect_rc("vp_sim_launch", rc, VP_OK);
}

/* ------------------------------------------------------------ device */

static bool device_open(void) {
  vp_options_t o;
  cfg_options(&g.cfg, &o);
  int rc = FZ_CALL(false, vp_device_open(&o, &g.dev),
                   "%s, gran %llu, page %llu, cap %u pages, staging %llu, "
                   "lookahead %llu, fail_nth %lld",
                   g.cfg.worker ? "worker" : "sync",
                   (unsigned long long)g.cfg.gran,
                   (unsigned long long)g.cfg.page, g.cfg.cap_pages,
                   (unsigned long long)g.cfg.staging,
                   (unsigned long long)g.cfg.lookahead,
                   (long long)g.cfg.fail_nth);
  if (rc) {
    if (!g.cfg.fail_nth) fz_fail("vp_device_open: %s", vp_err_name(rc));
    return false;
  }
  g.open = true;
  g.S[0] = (fstream_t){0, true};
  g.nS = 1;
  return true;
}

/* The arena as a registered host buffer (freed by close). */
static void maybe_register_arena(void) {
  if (!g.cfg.hostbuf) return;
  vp_hostbuf_t hb;
  int rc = FZ_CALL(false, vp_hostbuf_register(g.dev, arena, ARENA_SIZE, &hb),
                   "arena, %llu", (unsigned long long)ARENA_SIZE);
  if (rc) unexpected("vp_hostbuf_register", rc, "VP_OK");
}

/* ------------------------------------------------------- strict ops */

enum {
  OP_VBAR_CREATE, OP_WEIGHTS_CREATE, OP_ACQUIRE, OP_RELEASE, OP_RELEASE_HELD,
  OP_FAULT, OP_UNPIN, OP_SCRATCH_WRITE, OP_SCRATCH_CHECK, OP_FREE_VBAR,
  OP_FREE_DEVICE, OP_PRIORITIZE, OP_DEPRIORITIZE, OP_SET_WATERMARK,
  OP_SET_WM_LIMIT, OP_SET_LIMIT, OP_SET_HEADROOM, OP_SET_LOOKAHEAD,
  OP_STREAM_CREATE, OP_STREAM_DESTROY, OP_STREAM_DESTROY_FAKE, OP_STREAM_SYNC,
  OP_WEIGHT_DESTROY, OP_VBAR_DESTROY, OP_INJECT, OP_CHECK_HELD, OP_STATS,
  OP_SET_ORDER, OP_RESET_LIMITS, OP_BREAK, OP_ACQUIRE_EACH, OP_COUNT,
  /* Ops added since (at most 8; new ones go at the end): opcode bytes
   * 31-38 (OP_COUNT + k), which picked ops 0-7 through % OP_COUNT before
   * and no input of corpus/api used as an opcode, pick them in turn
   * (OP_SET_SOURCE + (byte - 31) % their count). Every other byte decodes
   * as it always did (byte % OP_COUNT), so older inputs, the findings'
   * among them, replay as they did. */
  OP_SET_SOURCE = OP_COUNT, OP_RECREATE, OP_SET_WINDOW, OP_MOVE,
  OP_SWAP_SOURCE, OP_ALL
};
#define OP_EXT_SPAN 8

static uint8_t op_decode(uint8_t b) {
  if (b >= OP_COUNT && b < OP_COUNT + OP_EXT_SPAN)
    return OP_COUNT + (b - OP_COUNT) % (OP_ALL - OP_COUNT);
  return b % OP_COUNT;
}

static void s_vbar_create(fz_reader_t *r) {
  uint8_t b = fz_u8(r);
  if (g.nV == MAXV) return;
  uint32_t npages = 1 + b % 12;
  uint64_t size = (uint64_t)npages << g.cfg.shift;
  if (b & 0x80) size -= (g.cfg.page / 2 + 1); /* rounded up again */
  if (size == 0) size = 1;
  fvbar_t *v = &g.V[g.nV];
  memset(v, 0, sizeof *v);
  int rc = FZ_CALL(false, vp_vbar_create(g.dev, size, &v->h), "%llu -> v%d",
                   (unsigned long long)size, g.nV);
  if (rc) return unexpected("vp_vbar_create", rc, "VP_OK");
  v->live = true;
  v->npages = npages;
  v->size = (uint64_t)npages << g.cfg.shift;
  v->wlimit = v->size - v->size / 8 - 16;
  uint64_t x;
  rc = FZ_CALL(false, vp_vbar_base(v->h, &v->base), "v%d", g.nV);
  CHECK(rc == VP_OK && v->base, "vp_vbar_base");
  rc = FZ_CALL(false, vp_vbar_size(v->h, &x), "v%d", g.nV);
  CHECK(rc == VP_OK && x == v->size, "vp_vbar_size %llu, expected %llu",
        (unsigned long long)x, (unsigned long long)v->size);
  rc = FZ_CALL(false, vp_vbar_page_count(v->h, &x), "v%d", g.nV);
  CHECK(rc == VP_OK && x == npages, "vp_vbar_page_count");
  vp_device_t d;
  rc = FZ_CALL(false, vp_vbar_device(v->h, &d), "v%d", g.nV);
  CHECK(rc == VP_OK && d.id == g.dev.id, "vp_vbar_device");
  g.nV++;
}

/* A source of kind k: arena bytes at a (HOST), the same in the memfd
 * (FILE), or none. */
static vp_source_t source_of(int k, uint64_t a) {
  return (vp_source_t){.kind = k == K_HOST ? VP_SOURCE_HOST
                       : k == K_FILE ? VP_SOURCE_FILE
                                     : VP_SOURCE_NONE,
                       .host = k == K_HOST ? arena + a : NULL,
                       .fd = k == K_FILE ? arena_fd : -1,
                       .file_offset = k == K_FILE ? a : 0};
}

/* New weights appended after the VBAR's cursor (a gap each), sources from
 * the arena; sometimes one overlapping an existing weight or running past
 * the VBAR (then the call fails and creates none: all or nothing, checked
 * by creating the good ones after). */
static void s_weights_create(fz_reader_t *r) {
  int v = pick_vbar(r);
  uint8_t nb = fz_u8(r);
  if (v < 0) return;
  fvbar_t *b = &g.V[v];
  size_t n = 1 + nb % 6;
  int bad = (nb >> 3) % 8; /* 1: overlap, 2: past the end, else none */
  uint64_t off[8], size[8];
  int kind[8];
  uint64_t aoff[8];
  vp_source_t src[8];
  vp_weight_t out[8];
  uint64_t cur = b->cursor;
  size_t made = 0;
  for (size_t i = 0; i < n; i++) {
    uint16_t gap = fz_u16(r), sz = fz_u16(r);
    uint8_t kb = fz_u8(r);
    uint16_t ab = fz_u16(r);
    uint64_t s = (kb & 0x80) ? g.cfg.page / 2 + (uint64_t)sz * 64
                             : 1 + (uint64_t)sz * ((kb & 0x40) ? 16 : 1);
    uint64_t o = cur + (gap % 4 == 0 ? 0 : (gap >> 2) * 16 % g.cfg.page);
    if (o >= b->wlimit || s > b->wlimit - o) break;
    int k = (kb & 3) == 3 ? K_HOST : kb & 3;
    uint64_t a;
    if (made && (kb & 0x20) && kind[made - 1] == k && k != K_NONE &&
        aoff[made - 1] + size[made - 1] + s <= ARENA_SIZE)
      a = aoff[made - 1] + size[made - 1]; /* contiguous: copies merge */
    else
      a = ((uint64_t)ab * 256) % (ARENA_SIZE - s);
    off[made] = o;
    size[made] = s;
    kind[made] = k;
    aoff[made] = a;
    src[made] = source_of(k, a);
    cur = o + s;
    made++;
  }
  if (!made || g.nW + (int)made > MAXW) return;
  bool dead = !b->live;
  int want = VP_OK;
  if (bad == 1 || bad == 2) {
    /* One more, bad, entry at the end. */
    uint64_t o = 0, s = 1;
    int other = -1;
    for (int i = 0; i < g.nW; i++)
      if (g.W[i].live && g.W[i].v == v) other = i;
    if (bad == 1 && other >= 0) {
      o = g.W[other].off + g.W[other].size / 2;
      s = g.W[other].size < b->size - o ? g.W[other].size : b->size - o;
      want = VP_EINVAL;
    } else if (bad == 1) {
      o = off[0];
      s = size[0];
      want = VP_EINVAL; /* overlaps an entry of the same call */
    } else {
      o = b->size - 8;
      s = 64;
      want = VP_ERANGE;
    }
    off[made] = o;
    size[made] = s;
    src[made] = (vp_source_t){.kind = VP_SOURCE_NONE, .fd = -1};
    int rc = FZ_CALL(false, vp_weights_create(b->h, made + 1, off, size, src,
                                              out),
                     "v%d, %zu weights, last bad [%llu, +%llu)", v, made + 1,
                     (unsigned long long)o, (unsigned long long)s);
    if (dead) want = VP_EHANDLE;
    if (rc != want) return unexpected("vp_weights_create", rc,
                                      vp_err_name(want));
  }
  int rc = FZ_CALL(false, vp_weights_create(b->h, made, off, size, src, out),
                   "v%d, %zu weights at %llu.. -> w%d..", v, made,
                   (unsigned long long)off[0], g.nW);
  if (dead) {
    expect_rc("vp_weights_create (dead VBAR)", rc, VP_EHANDLE);
    return;
  }
  if (rc) return unexpected("vp_weights_create", rc, "VP_OK");
  for (size_t i = 0; i < made; i++) {
    fweight_t *w = &g.W[g.nW];
    memset(w, 0, sizeof *w);
    w->h = out[i];
    w->live = true;
    w->v = v;
    w->kind = kind[i];
    w->off = off[i];
    w->size = size[i];
    w->aoff = aoff[i];
    pages_of(w->off, w->size, &w->p0, &w->p1);
    fz_trace("  w%d: v%d [%llu, +%llu) %s @%llu", g.nW, v,
             (unsigned long long)w->off, (unsigned long long)w->size,
             kind_name[w->kind], (unsigned long long)w->aoff);
    g.nW++;
  }
  b->cursor = cur;
}

typedef struct seen {
  int w;
  bool res, res_empty, stg, stg_empty;
} seen_t;

static void s_acquire_on(int s, const int *idx, size_t n);

/* The next s_acquire_on calls vp_acquire_ahead with this lookahead
 * (s_set_window), then vp_acquire again. */
static bool ahead_next;
static uint64_t ahead_bytes;

static void s_acquire(fz_reader_t *r) {
  int s = pick_stream(r);
  size_t n = 1 + fz_u8(r) % 4;
  int idx[4];
  for (size_t i = 0; i < n; i++)
    if ((idx[i] = pick_weight(r)) < 0) return;
  s_acquire_on(s, idx, n);
}

/* The same weights acquired on 2-4 live streams in turn, one call each
 * (several streams running one layer). */
static void s_acquire_each(fz_reader_t *r) {
  uint8_t k = fz_u8(r);
  size_t n = 1 + (k & 1);
  int idx[2];
  for (size_t i = 0; i < n; i++)
    if ((idx[i] = pick_weight(r)) < 0) return;
  int live[MAXS], nl = 0;
  for (int s = 0; s < g.nS; s++)
    if (g.S[s].live) live[nl++] = s;
  int count = 2 + (k >> 1) % 3, first = (k >> 3) % nl;
  for (int j = 0; j < count && j < nl; j++)
    s_acquire_on(live[(first + j) % nl], idx, n);
}

static void s_acquire_on(int s, const int *idx, size_t n) {
  vp_weight_t hs[4];
  bool dead = false, must_res[4], must_copy[4];
  char names[64] = "";
  for (size_t i = 0; i < n; i++) {
    hs[i] = g.W[idx[i]].h;
    dead |= !g.W[idx[i]].live;
    size_t len = strlen(names);
    snprintf(names + len, sizeof names - len, "%sw%d", i ? "," : "", idx[i]);
  }
  for (size_t i = 0; i < n; i++) {
    fweight_t *w = &g.W[idx[i]];
    must_res[i] = !dead && range_surely_pinned(w->v, w->p0, w->p1);
    /* the first listing of a weight with a new source copies it */
    must_copy[i] = w->must_copy;
    for (size_t j = 0; j < i; j++) must_copy[i] &= idx[j] != idx[i];
  }
  uint64_t ptrs[4] = {0};
  uint8_t flags[4] = {0};
  bool ahead = ahead_next;
  ahead_next = false;
  int rc = ahead ? FZ_CALL(false, vp_acquire_ahead(g.dev, hs, n, g.S[s].h,
                                                   ptrs, flags, ahead_bytes),
                           "[%s], s%d, %llu", names, s,
                           (unsigned long long)ahead_bytes)
                 : FZ_CALL(false, vp_acquire(g.dev, hs, n, g.S[s].h, ptrs,
                                             flags),
                           "[%s], s%d", names, s);
  if (dead) {
    expect_rc("vp_acquire (a destroyed weight)", rc, VP_EHANDLE);
    return;
  }
  /* (after a failure, whether the copy stayed is not modelled) */
  for (size_t i = 0; i < n; i++) g.W[idx[i]].must_copy = false;
  if (rc && skip_empty_after_fail)
    for (size_t i = 0; i < n; i++)
      g.W[idx[i]].resync_inplace = g.W[idx[i]].resync_staged = true;
  if (rc == VP_ELIMIT || rc == VP_EOOM) return; /* staging cannot take it */
  if (rc) return unexpected("vp_acquire", rc, "VP_OK, VP_ELIMIT or VP_EOOM");
  seen_t seen[4];
  int nseen = 0;
  for (size_t i = 0; i < n; i++) {
    fweight_t *w = &g.W[idx[i]];
    uint8_t f = flags[i];
    bool res = f & VP_ACQUIRED_RESIDENT, stg = f & VP_ACQUIRED_STAGED;
    fz_trace("  w%d: %s%s%s ptr 0x%llx", idx[i], res ? "resident" : "",
             stg ? "staged" : "", (f & VP_ACQUIRED_EMPTY) ? " empty"
             : (f & VP_ACQUIRED_COPIED) ? " copied" : "",
             (unsigned long long)ptrs[i]);
    CHECK(res != stg && !(f & ~0xfu), "op %u: w%d flags 0x%x: not exactly "
          "one of RESIDENT and STAGED", g.op, idx[i], f);
    CHECK(!((f & VP_ACQUIRED_EMPTY) && w->kind != K_NONE), "op %u: w%d has "
          "a %s source but came back EMPTY", g.op, idx[i], kind_name[w->kind]);
    CHECK(!((f & VP_ACQUIRED_COPIED) && w->kind == K_NONE), "op %u: w%d has "
          "no source but came back COPIED", g.op, idx[i]);
    CHECK(!(must_res[i] && !res), "op %u: every page of w%d is pinned, yet "
          "it was staged", g.op, idx[i]);
    CHECK(!(must_copy[i] && !(f & VP_ACQUIRED_COPIED)), "op %u: w%d's first "
          "acquire since it got a new source did not copy it", g.op, idx[i]);
    if (res) {
      uint64_t want = g.V[w->v].base + w->off;
      CHECK(ptrs[i] == want, "op %u: w%d in place at 0x%llx, expected 0x%llx",
            g.op, idx[i], (unsigned long long)ptrs[i],
            (unsigned long long)want);
      CHECK(!((f & VP_ACQUIRED_EMPTY) && surely_resident(w)), "op %u: w%d "
            "came back EMPTY in place while another hold kept its pages "
            "pinned", g.op, idx[i]);
      w->rmin[s]++;
      w->rmax[s]++;
    } else {
      for (int v = 0; v < g.nV; v++)
        CHECK(!(g.V[v].live && ptrs[i] >= g.V[v].base &&
                ptrs[i] < g.V[v].base + g.V[v].size),
              "op %u: w%d staged at 0x%llx, inside v%d", g.op, idx[i],
              (unsigned long long)ptrs[i], v);
      if (surely_staged(w)) {
        CHECK(w->staged_ptr == ptrs[i], "op %u: w%d staged at 0x%llx while "
              "its slot at 0x%llx is held", g.op, idx[i],
              (unsigned long long)ptrs[i],
              (unsigned long long)w->staged_ptr);
        CHECK(!(f & VP_ACQUIRED_EMPTY), "op %u: w%d came back EMPTY in its "
              "held staging slot", g.op, idx[i]);
      }
      w->staged_ptr = ptrs[i];
      w->staged_ptr_set = true;
      g.staging_seen = true;
    }
    w->n[s]++;
    int k = 0;
    while (k < nseen && seen[k].w != idx[i]) k++;
    if (k == nseen) seen[nseen++] = (seen_t){.w = idx[i]};
    if (res) {
      seen[k].res = true;
      seen[k].res_empty |= (f & VP_ACQUIRED_EMPTY) != 0;
    } else {
      seen[k].stg = true;
      seen[k].stg_empty |= (f & VP_ACQUIRED_EMPTY) != 0;
    }
  }
  /* The bytes, once per weight and place. */
  for (int k = 0; k < nseen; k++) {
    fweight_t *w = &g.W[seen[k].w];
    for (int place = 0; place < 2; place++) {
      bool at = place ? seen[k].stg : seen[k].res;
      if (!at) continue;
      uint64_t ptr = place ? w->staged_ptr : g.V[w->v].base + w->off;
      char what[80];
      snprintf(what, sizeof what, "w%d (%s) %s", seen[k].w,
               kind_name[w->kind], place ? "staged" : "in place");
      if (w->kind != K_NONE) {
        read_check(what, ptr, w->size, s, weight_src(w));
        continue;
      }
      bool empty = place ? seen[k].stg_empty : seen[k].res_empty;
      bool *known = place ? &w->staged_known : &w->inplace_known;
      uint32_t *pat = place ? &w->staged_pat : &w->inplace_pat;
      bool *resync = place ? &w->resync_staged : &w->resync_inplace;
      if (empty || *resync) {
        *resync = false;
        *known = false;
        uint32_t p = ++g.next_pat;
        if (write_pat(ptr, w->size, s, p)) *known = true, *pat = p;
      } else {
        CHECK(*known, "op %u: %s: not EMPTY, but its bytes were never "
              "written there", g.op, what);
        pattern(pbuf + ARENA_SIZE / 2, w->size, *pat);
        read_check(what, ptr, w->size, s, pbuf + ARENA_SIZE / 2);
      }
    }
  }
}

/* Release n[] listed weights on slot s, checking the code against the
 * model and applying it. */
static void s_release_list(int s, const int *idx, size_t n) {
  vp_weight_t hs[8];
  bool dead = false;
  char names[64] = "";
  for (size_t i = 0; i < n; i++) {
    hs[i] = g.W[idx[i]].h;
    dead |= !g.W[idx[i]].live;
    size_t len = strlen(names);
    snprintf(names + len, sizeof names - len, "%sw%d", i ? "," : "", idx[i]);
  }
  int want = dead ? VP_EHANDLE : VP_OK;
  const char *why = dead ? "a destroyed weight" : "held";
  bool skip = false;
  for (size_t i = 0; i < n && want == VP_OK; i++) {
    uint32_t c = 0;
    for (size_t j = 0; j < n; j++) c += idx[j] == idx[i];
    const fweight_t *w = &g.W[idx[i]];
    if (c > w->n[s]) {
      want = VP_ENOTPINNED;
      if (c > 1 && w->n[s]) {
        why = "listed more often than held";
        skip = skip_repeat_release;
      } else if (holds_total(w) >= c) {
        why = "held on other streams only";
        skip = skip_cross_release;
      } else {
        why = c > 1 ? "listed more often than held" : "not held";
        skip = c > 1 && skip_repeat_release;
      }
    }
  }
  if (skip) return; /* FUZZ_SKIP: a known bug's case */
  int rc = FZ_CALL(false, vp_release(g.dev, hs, n, g.S[s].h), "[%s], s%d",
                   names, s);
  if (rc != want) {
    char buf[96];
    snprintf(buf, sizeof buf, "%s (%s)", vp_err_name(want), why);
    return unexpected("vp_release", rc, buf);
  }
  if (rc) return;
  for (size_t i = 0; i < n; i++) {
    fweight_t *w = &g.W[idx[i]];
    uint32_t nn = w->n[s];
    w->rmin[s] = w->rmin[s] ? w->rmin[s] - 1 : 0;
    w->rmax[s] = w->rmax[s] < nn ? w->rmax[s] : w->rmax[s] - 1;
    w->n[s] = nn - 1;
  }
}

static void s_release(fz_reader_t *r) {
  int s = pick_stream(r);
  size_t n = 1 + fz_u8(r) % 4;
  int idx[4];
  for (size_t i = 0; i < n; i++)
    if ((idx[i] = pick_weight(r)) < 0) return;
  s_release_list(s, idx, n);
}

/* The k-th hold (weight, stream) of the model, if any. */
static bool pick_hold(uint8_t k, int *wi, int *si) {
  int count = 0;
  for (int i = 0; i < g.nW; i++)
    for (int s = 0; s < MAXS; s++) count += g.W[i].n[s] != 0;
  if (!count) return false;
  int want = k % count;
  for (int i = 0; i < g.nW; i++)
    for (int s = 0; s < MAXS; s++)
      if (g.W[i].n[s] && want-- == 0) {
        *wi = i;
        *si = s;
        return true;
      }
  return false;
}

/* Releases of a held weight: once; once more than held (in one call);
 * on a stream that does not hold it; all its holds on the stream. */
static void s_release_held(fz_reader_t *r) {
  uint8_t k = fz_u8(r), var = fz_u8(r);
  int wi, s;
  if (!pick_hold(k, &wi, &s)) return;
  int idx[8];
  uint32_t held = g.W[wi].n[s];
  switch (var % 4) {
  case 0:
    idx[0] = wi;
    s_release_list(s, idx, 1);
    break;
  case 1:
    if (held + 1 > 8) return;
    for (uint32_t i = 0; i <= held; i++) idx[i] = wi;
    s_release_list(s, idx, held + 1);
    break;
  case 2:
    for (int s2 = 0; s2 < g.nS; s2++)
      if (g.S[s2].live && !g.W[wi].n[s2]) {
        idx[0] = wi;
        s_release_list(s2, idx, 1);
        break;
      }
    break;
  default:
    if (held > 8) return;
    for (uint32_t i = 0; i < held; i++) idx[i] = wi;
    s_release_list(s, idx, held);
  }
}

/* gens of pages [p0, p1) from a successful fault: nonzero, unchanged for a
 * page pinned all along since its generation was last read. */
static void gens_seen(int v, uint32_t p0, uint32_t p1, const uint32_t *gens) {
  fvbar_t *b = &g.V[v];
  for (uint32_t p = p0; p < p1; p++) {
    uint32_t gen = gens[p - p0];
    CHECK(gen != 0, "op %u: v%d page %u has generation 0", g.op, v, p);
    CHECK(!(b->gen_known[p] && b->gen[p] != gen), "op %u: v%d page %u stayed "
          "pinned, yet its generation went from %u to %u", g.op, v, p,
          b->gen[p], gen);
    b->gen[p] = gen;
    b->gen_known[p] = true;
  }
}

/* vp_fault of [off, +size) of v: VP_OK (pins counted, gens checked) or
 * VP_MISS (only if some page may be unpinned). True on VP_OK. */
static bool do_fault(int v, uint64_t off, uint64_t size, uint32_t *gens) {
  fvbar_t *b = &g.V[v];
  uint32_t p0, p1;
  pages_of(off, size, &p0, &p1);
  bool must = range_surely_pinned(v, p0, p1);
  int rc = FZ_CALL(true, vp_fault(b->h, off, size, gens, MAXP),
                   "v%d, %llu, %llu", v, (unsigned long long)off,
                   (unsigned long long)size);
  if (rc == VP_MISS) {
    CHECK(!must, "op %u: vp_fault missed pages that are all pinned", g.op);
    return false;
  }
  if (rc) {
    unexpected("vp_fault", rc, "VP_OK or VP_MISS");
    return false;
  }
  gens_seen(v, p0, p1, gens);
  for (uint32_t p = p0; p < p1; p++) b->rawpins[p]++;
  return true;
}

static bool do_unpin(int v, uint64_t off, uint64_t size, int s) {
  fvbar_t *b = &g.V[v];
  uint32_t p0, p1;
  pages_of(off, size, &p0, &p1);
  int rc = FZ_CALL(false, vp_unpin(b->h, off, size, g.S[s].h),
                   "v%d, %llu, %llu, s%d", v, (unsigned long long)off,
                   (unsigned long long)size, s);
  if (!expect_rc("vp_unpin", rc, VP_OK)) return false;
  for (uint32_t p = p0; p < p1; p++) b->rawpins[p]--;
  return true;
}

static void s_fault(fz_reader_t *r) {
  int v = pick_vbar(r);
  uint32_t a = fz_u32(r), c = fz_u32(r);
  if (v < 0) return;
  fvbar_t *b = &g.V[v];
  uint32_t gens[MAXP];
  if (!b->live) {
    int rc = FZ_CALL(true, vp_fault(b->h, 0, 1, gens, MAXP), "v%d (dead)", v);
    expect_rc("vp_fault (destroyed VBAR)", rc, VP_EHANDLE);
    return;
  }
  if (g.nraw == MAXRAW) return;
  uint64_t off = a % b->size, room = b->size - off;
  uint64_t len = 1 + c % (room < 3 * g.cfg.page ? room : 3 * g.cfg.page);
  if (do_fault(v, off, len, gens))
    g.raw[g.nraw++] = (fraw_t){v, off, len};
}

static void s_unpin(fz_reader_t *r) {
  uint8_t k = fz_u8(r);
  int s = pick_stream(r);
  uint32_t a = fz_u32(r), c = fz_u32(r);
  if (!(k & 1)) {
    if (!g.nraw) return;
    int i = (k >> 1) % g.nraw;
    fraw_t x = g.raw[i];
    if (do_unpin(x.v, x.off, x.size, s)) g.raw[i] = g.raw[--g.nraw];
    return;
  }
  /* A range with a page nothing pins: VP_ENOTPINNED, nothing changes. */
  int v = pick_vbar(r);
  if (v < 0 || !g.V[v].live) return;
  fvbar_t *b = &g.V[v];
  uint64_t off = a % b->size, len = 1 + c % (b->size - off);
  uint32_t p0, p1;
  pages_of(off, len, &p0, &p1);
  bool free_page = false;
  for (uint32_t p = p0; p < p1 && !free_page; p++) {
    uint64_t lo, hi;
    pin_bounds(v, p, &lo, &hi);
    free_page = hi == 0;
  }
  if (!free_page) return;
  int rc = FZ_CALL(false, vp_unpin(b->h, off, len, g.S[s].h),
                   "v%d, %llu, %llu, s%d (a page is unpinned)", v,
                   (unsigned long long)off, (unsigned long long)len, s);
  expect_rc("vp_unpin", rc, VP_ENOTPINNED);
}

/* Scratch: bytes of a VBAR's tail, where no weight lies, written through
 * raw faults (a pattern, or a file region) and checked later while the
 * pages keep their generations. */
static void scratch_drop(int v, uint64_t off, uint64_t size) {
  for (int i = 0; i < MAXSCR; i++) {
    fscr_t *x = &g.scr[i];
    if (x->live && (v < 0 || (x->v == v && x->off < off + size &&
                              off < x->off + x->size))) {
      free(x->bytes);
      x->bytes = NULL;
      x->live = false;
    }
  }
}

static void s_scratch_write(fz_reader_t *r) {
  int v = pick_vbar(r);
  int s = pick_stream(r);
  uint32_t a = fz_u32(r), c = fz_u16(r);
  uint8_t var = fz_u8(r);
  uint32_t fo = fz_u32(r);
  if (v < 0 || !g.V[v].live || g.nraw == MAXRAW) return;
  fvbar_t *b = &g.V[v];
  uint64_t off = b->wlimit + a % (b->size - b->wlimit);
  uint64_t room = b->size - off, len = 1 + c % (room < 65536 ? room : 65536);
  uint32_t gens[MAXP];
  if (!do_fault(v, off, len, gens)) return;
  uint8_t *bytes = malloc(len);
  CHECK(bytes, "malloc");
  uint64_t ptr = b->base + off;
  bool ok;
  if (var & 1) {
    uint64_t foff = fo % (ARENA_SIZE - len);
    int rc;
    if (var & 2) { /* the same through vp_file_read_to_address, threaded */
      uint32_t threads = 1 + (var >> 2) % 4;
      rc = FZ_CALL(false, vp_file_read_to_address(g.dev, arena_fd, foff, len,
                                                  ptr, g.S[s].h, threads),
                   "arena_fd, %llu, %llu, 0x%llx, s%d, %u",
                   (unsigned long long)foff, (unsigned long long)len,
                   (unsigned long long)ptr, s, threads);
    } else {
      rc = FZ_CALL(false, vp_file_read_to_device(g.dev, arena_fd, foff, len,
                                                 ptr, g.S[s].h),
                   "arena_fd, %llu, %llu, 0x%llx, s%d",
                   (unsigned long long)foff, (unsigned long long)len,
                   (unsigned long long)ptr, s);
    }
    ok = expect_rc("vp_file_read*", rc, VP_OK);
    memcpy(bytes, arena + foff, len);
    scratch_drop(v, off, len);
    if (ok) read_check("scratch read from a file", ptr, len, s, bytes);
  } else {
    uint32_t pat = ++g.next_pat;
    scratch_drop(v, off, len);
    ok = write_pat(ptr, len, s, pat);
    pattern(bytes, len, pat);
  }
  int slot = -1;
  for (int i = 0; i < MAXSCR && slot < 0; i++)
    if (!g.scr[i].live) slot = i;
  if (ok && slot >= 0) {
    fscr_t *x = &g.scr[slot];
    *x = (fscr_t){.live = true, .v = v, .off = off, .size = len,
                  .bytes = bytes};
    memcpy(x->gens, gens, sizeof gens);
    bytes = NULL;
  }
  free(bytes);
  /* do_fault checked there is room (MAXRAW) unless called from here with
   * the table full: then unpin now. */
  if ((var & 2) && g.nraw < MAXRAW) g.raw[g.nraw++] = (fraw_t){v, off, len};
  else if (!do_unpin(v, off, len, s) && g.nraw < MAXRAW)
    g.raw[g.nraw++] = (fraw_t){v, off, len}; /* still pinned */
}

static void s_scratch_check(fz_reader_t *r) {
  uint8_t k = fz_u8(r);
  int s = pick_stream(r);
  int live[MAXSCR], n = 0;
  for (int i = 0; i < MAXSCR; i++)
    if (g.scr[i].live) live[n++] = i;
  if (!n) return;
  if (g.nraw == MAXRAW) return;
  fscr_t *x = &g.scr[live[k % n]];
  uint32_t gens[MAXP], p0, p1;
  pages_of(x->off, x->size, &p0, &p1);
  if (!do_fault(x->v, x->off, x->size, gens)) return;
  int v = x->v;
  uint64_t off = x->off, size = x->size;
  if (!memcmp(gens, x->gens, (p1 - p0) * sizeof *gens))
    read_check("scratch bytes under unchanged generations",
               g.V[v].base + off, size, s, x->bytes);
  else
    scratch_drop(v, off, size); /* recommitted: the bytes went */
  if (!do_unpin(v, off, size, s) && g.nraw < MAXRAW)
    g.raw[g.nraw++] = (fraw_t){v, off, size}; /* still pinned */
}

/* Free `bytes` of VBAR v (v < 0: the device): the count freed must be
 * what residency shows went, at least `bytes` unless nothing unpinned is
 * left, and less than a page more. */
static void do_free(int v, uint64_t bytes) {
  uint8_t before[MAXV][MAXP], after[MAXV][MAXP];
  uint64_t evictable = 0, gone = 0, freed = 0;
  for (int i = 0; i < g.nV; i++) {
    if (!g.V[i].live || (v >= 0 && i != v)) continue;
    residency(i, before[i]);
    for (uint32_t p = 0; p < g.V[i].npages; p++)
      evictable += before[i][p] == VP_PAGE_RESIDENT;
  }
  int rc;
  if (v >= 0) {
    rc = FZ_CALL(false, vp_vbar_free_memory(g.V[v].h, bytes, &freed),
                 "v%d, %llu", v, (unsigned long long)bytes);
  } else {
    uint64_t recl = 0;
    rc = FZ_CALL(false, vp_device_reclaimable(g.dev, &recl), "dev");
    if (!expect_rc("vp_device_reclaimable", rc, VP_OK)) return;
    CHECK(recl == evictable << g.cfg.shift, "op %u: reclaimable %llu bytes, "
          "residency shows %llu unpinned pages", g.op,
          (unsigned long long)recl, (unsigned long long)evictable);
    rc = FZ_CALL(false, vp_device_free_memory(g.dev, bytes, &freed), "%llu",
                 (unsigned long long)bytes);
  }
  if (!expect_rc("vp_*_free_memory", rc, VP_OK)) return;
  for (int i = 0; i < g.nV; i++) {
    if (!g.V[i].live || (v >= 0 && i != v)) continue;
    residency(i, after[i]);
    for (uint32_t p = 0; p < g.V[i].npages; p++) {
      bool was = before[i][p] & VP_PAGE_RESIDENT;
      bool is = after[i][p] & VP_PAGE_RESIDENT;
      CHECK(!(is && !was), "op %u: freeing memory made v%d page %u resident",
            g.op, i, p);
      gone += was && !is;
    }
  }
  uint64_t page = g.cfg.page;
  fz_trace("  freed %llu (%llu pages went, %llu were unpinned)",
           (unsigned long long)freed, (unsigned long long)gone,
           (unsigned long long)evictable);
  CHECK(freed == gone * page, "op %u: freed %llu bytes, but %llu pages went",
        g.op, (unsigned long long)freed, (unsigned long long)gone);
  if (bytes >= evictable * page)
    CHECK(gone == evictable, "op %u: asked for %llu bytes, %llu pages could "
          "go, %llu went", g.op, (unsigned long long)bytes,
          (unsigned long long)evictable, (unsigned long long)gone);
  else
    CHECK(freed >= bytes && freed < bytes + page, "op %u: asked for %llu "
          "bytes, freed %llu", g.op, (unsigned long long)bytes,
          (unsigned long long)freed);
}

static uint64_t pick_bytes(fz_reader_t *r) {
  uint8_t b = fz_u8(r);
  switch (b % 6) {
  case 0: return 0;
  case 1: return 1;
  case 2: return g.cfg.page * (1 + (b >> 3) % 4);
  case 3: return g.cfg.page * (b >> 3) + 1;
  default: return UINT64_MAX;
  }
}

static void s_free_vbar(fz_reader_t *r) {
  int v = pick_vbar(r);
  uint64_t bytes = pick_bytes(r);
  if (v < 0) return;
  if (!g.V[v].live) {
    int rc = FZ_CALL(false, vp_vbar_free_memory(g.V[v].h, bytes, NULL),
                     "v%d (dead)", v);
    expect_rc("vp_vbar_free_memory (destroyed VBAR)", rc, VP_EHANDLE);
    return;
  }
  do_free(v, bytes);
}

static void s_free_device(fz_reader_t *r) { do_free(-1, pick_bytes(r)); }

static void s_prioritize(fz_reader_t *r, bool up) {
  int v = pick_vbar(r);
  if (v < 0) return;
  fvbar_t *b = &g.V[v];
  int rc = up ? FZ_CALL(false, vp_vbar_prioritize(b->h), "v%d", v)
              : FZ_CALL(false, vp_vbar_deprioritize(b->h), "v%d", v);
  if (!expect_rc(up ? "vp_vbar_prioritize" : "vp_vbar_deprioritize", rc,
                 b->live ? VP_OK : VP_EHANDLE) || !b->live || !up)
    return;
  uint64_t wm = 0;
  rc = FZ_CALL(false, vp_vbar_get_watermark(b->h, &wm), "v%d", v);
  CHECK(rc == VP_OK && wm == b->npages, "op %u: watermark %llu after "
        "vp_vbar_prioritize, expected %u", g.op, (unsigned long long)wm,
        b->npages);
}

static void s_set_watermark(fz_reader_t *r, bool limit) {
  int v = pick_vbar(r);
  uint8_t k = fz_u8(r), extra = fz_u8(r);
  if (v < 0 || !g.V[v].live) return;
  fvbar_t *b = &g.V[v];
  uint64_t pages = k % (b->npages + 2);
  uint64_t bytes = (pages << g.cfg.shift) + extra;
  if (limit && k == 255) bytes = UINT64_MAX;
  int rc = limit ? FZ_CALL(false, vp_vbar_set_watermark_limit(b->h, bytes),
                           "v%d, %llu", v, (unsigned long long)bytes)
                 : FZ_CALL(false, vp_vbar_set_watermark(b->h, bytes),
                           "v%d, %llu", v, (unsigned long long)bytes);
  if (!limit && pages > b->npages) {
    expect_rc("vp_vbar_set_watermark", rc, VP_ERANGE);
    return;
  }
  if (!expect_rc("vp_vbar_set_watermark*", rc, VP_OK)) return;
  uint64_t got = 0, want = pages;
  if (limit && (bytes == UINT64_MAX || pages > b->npages)) want = b->npages;
  rc = limit ? FZ_CALL(false, vp_vbar_get_watermark_limit(b->h, &got), "v%d",
                       v)
             : FZ_CALL(false, vp_vbar_get_watermark(b->h, &got), "v%d", v);
  CHECK(rc == VP_OK && got == want, "op %u: watermark%s reads %llu, set %llu",
        g.op, limit ? " limit" : "", (unsigned long long)got,
        (unsigned long long)want);
}

static void s_device_setting(fz_reader_t *r, int which) {
  uint8_t k = fz_u8(r);
  uint64_t bytes = k == 255 ? UINT64_MAX : (uint64_t)(k % 40) * g.cfg.page;
  int rc;
  switch (which) {
  case 0:
    rc = FZ_CALL(false, vp_device_set_limit(g.dev, bytes), "%llu",
                 (unsigned long long)bytes);
    expect_rc("vp_device_set_limit", rc, VP_OK);
    break;
  case 1: {
    int64_t h = k == 255 ? -1 - (int64_t)(k & 3) : (int64_t)(k % 8) * 4096 * 64;
    rc = FZ_CALL(false, vp_device_set_headroom(g.dev, h), "%lld", (long long)h);
    expect_rc("vp_device_set_headroom", rc, h < 0 ? VP_EINVAL : VP_OK);
    /* The shared headroom: -1 is its headroom, below is wrong. */
    int64_t sh = k == 254 ? -2 : (k & 1) ? -1 : h;
    rc = FZ_CALL(false, vp_device_set_shared_headroom(g.dev, sh), "%lld",
                 (long long)sh);
    expect_rc("vp_device_set_shared_headroom", rc,
              sh < -1 ? VP_EINVAL : VP_OK);
    break;
  }
  default:
    bytes = k == 255 ? UINT64_MAX : (uint64_t)(k % 64) * 16 * KiB;
    rc = FZ_CALL(false, vp_device_set_lookahead(g.dev, bytes), "%llu",
                 (unsigned long long)bytes);
    expect_rc("vp_device_set_lookahead", rc, VP_OK);
  }
}

static void s_stream_create(void) {
  if (g.nS == MAXS) return;
  vp_stream_t st = 0;
  int rc = FZ_CALL(false, vp_stream_create(g.dev, &st), "-> s%d", g.nS);
  if (rc) return unexpected("vp_stream_create", rc, "VP_OK");
  for (int s = 0; s < g.nS; s++)
    CHECK(!(g.S[s].h == st && g.S[s].live), "op %u: vp_stream_create gave "
          "0x%llx, the value of live s%d", g.op, (unsigned long long)st, s);
  CHECK(st != 0, "op %u: vp_stream_create gave 0", g.op);
  g.S[g.nS++] = (fstream_t){st, true};
}

static void s_stream_destroy(fz_reader_t *r) {
  uint8_t k = fz_u8(r);
  int cand[MAXS], n = 0;
  for (int s = 1; s < g.nS; s++)
    if (g.S[s].live && !holds_on_stream(s)) cand[n++] = s;
  if (!n) return;
  int s = cand[k % n];
  int rc = FZ_CALL(false, vp_stream_destroy(g.dev, g.S[s].h), "s%d", s);
  if (expect_rc("vp_stream_destroy", rc, VP_OK)) g.S[s].live = false;
}

static bool is_live_stream(vp_stream_t v) {
  for (int s = 0; s < g.nS; s++)
    if (g.S[s].live && g.S[s].h == v) return true;
  return false;
}

/* A value vp_stream_create did not return (or that was destroyed):
 * refused, and every live stream, the default one first, still works. */
static void s_stream_destroy_fake(fz_reader_t *r) {
  uint8_t var = fz_u8(r), k = fz_u8(r);
  uint64_t rnd = fz_u64(r);
  if (skip_fake_destroy) return;
  vp_stream_t base = g.nS > 1 ? g.S[1 + k % (g.nS - 1)].h : 0;
  vp_stream_t v;
  switch (var % 8) {
  case 0: v = base - 1; break;
  case 1: v = base + 1; break;
  case 2: v = base ^ (1ull << 24); break;
  case 3: v = base ^ (1ull << (32 + k % 16)); break;
  case 4: v = base & ~0xffffffull; break;
  case 5: v = rnd; break;
  case 6: v = 0; break;
  default: v = base; break; /* only if destroyed */
  }
  if (is_live_stream(v) && v != 0) return;
  int rc = FZ_CALL(false, vp_stream_destroy(g.dev, v), "0x%llx (never "
                   "created or destroyed)", (unsigned long long)v);
  if (rc != VP_EINVAL && rc != VP_EHANDLE)
    unexpected("vp_stream_destroy of a value vp_stream_create did not give",
               rc, "VP_EINVAL or VP_EHANDLE");
  for (int s = 0; s < g.nS; s++) {
    if (!g.S[s].live) continue;
    rc = FZ_CALL(false, vp_stream_synchronize(g.dev, g.S[s].h), "s%d", s);
    if (rc) {
      char what[96];
      snprintf(what, sizeof what, "vp_stream_synchronize(s%d) after "
               "vp_stream_destroy(0x%llx)", s, (unsigned long long)v);
      unexpected(what, rc, "VP_OK");
    }
  }
}

static void s_stream_sync(fz_reader_t *r) {
  int s = pick_stream(r);
  int rc = FZ_CALL(false, vp_stream_synchronize(g.dev, g.S[s].h), "s%d", s);
  expect_rc("vp_stream_synchronize", rc, VP_OK);
}

static void s_weight_destroy(fz_reader_t *r) {
  int i = pick_weight(r);
  if (i < 0) return;
  fweight_t *w = &g.W[i];
  int want = !w->live ? VP_EHANDLE : holds_total(w) ? VP_EBUSY : VP_OK;
  int rc = FZ_CALL(false, vp_weight_destroy(w->h), "w%d", i);
  if (expect_rc("vp_weight_destroy", rc, want) && rc == VP_OK)
    w->live = false;
}

/* An arena offset for `size` new source bytes, from ab: bytes other than
 * `old` (the weight's present source, NULL if none), so that a kernel
 * still reading the old ones tells them apart. The arena is never
 * written: every source stays readable for the harness's lifetime. */
static uint64_t fresh_aoff(uint64_t size, const uint8_t *old, uint16_t ab) {
  uint64_t span = ARENA_SIZE - size, a = ((uint64_t)ab * 256) % span;
  for (int t = 0; t < 8 && old && !memcmp(arena + a, old, size); t++)
    a = (a + 4096 + 8) % span;
  return a;
}

/* The model after w's bytes moved or changed: a NONE one's were never
 * written (EMPTY wherever acquired next); a HOST or FILE one's next
 * acquire copies them. */
static void refill_expected(fweight_t *w) {
  w->inplace_known = w->staged_known = false;
  w->resync_inplace = w->resync_staged = false;
  w->must_copy = w->kind != K_NONE;
}

/* The model after w got source (k, a): its bytes are those from now on,
 * filled anew at the next acquire. */
static void source_changed(fweight_t *w, int k, uint64_t a) {
  free(w->own);
  w->own = NULL;
  w->kind = k;
  w->aoff = a;
  refill_expected(w);
}

/* The weight of a set-source or make-anew op: byte k picks it (var bit 2:
 * k picks a hold, so mostly an acquired weight; var bit 4: the weight the
 * last kernel checked, maybe still queued). */
static int pick_target(uint8_t k, uint8_t var) {
  int wi = weight_of(k), s;
  if (var & 0x10) return g.kern_w - 1;
  if ((var & 4) && !pick_hold(k, &wi, &s)) return -1;
  return wi;
}

/* var bit 4, after a new source: the weight acquired at once on the live
 * stream k picks, its bytes checked (and a kernel checking the old ones
 * maybe still queued: s_check_held var 0x0a, then this, is the whole
 * refill race in two ops). It stays held. */
static void acquire_after(uint8_t k, uint8_t var, int wi) {
  if (!(var & 0x10)) return;
  int live[MAXS], n = 0;
  for (int s = 0; s < g.nS; s++)
    if (g.S[s].live) live[n++] = s;
  s_acquire_on(live[k % n], &wi, 1);
}

/* vp_weight_set_source: a weight (live, destroyed or held: pick_target)
 * gets other arena bytes (var & 3: 0 HOST, 1 FILE, 2 NONE, 3 HOST) or,
 * var >> 5 of 6 and 7, an invalid source (a HOST one without bytes, var
 * bit 3 a FILE one without an fd; NULL). VP_EBUSY while acquired, and
 * nothing changes.
 * Then the model's bytes are the new ones (acquires read them back, COPIED
 * the first time), while kernels queued on a hold's stream before its
 * release still read the old ones (s_check_held, launch_check): the
 * refill must wait for them. var bit 4: acquire_after. */
static void s_set_source(fz_reader_t *r) {
  uint8_t k = fz_u8(r), var = fz_u8(r);
  uint16_t ab = fz_u16(r);
  int wi = pick_target(k, var);
  if (wi < 0 || skip_set_source) return;
  fweight_t *w = &g.W[wi];
  int kind = (var & 3) == 3 ? K_HOST : var & 3;
  uint64_t a = fresh_aoff(w->size, w->kind == K_NONE ? NULL : weight_src(w),
                          ab);
  vp_source_t src = source_of(kind, a);
  const vp_source_t *sp = &src;
  int want = !w->live ? VP_EHANDLE : holds_total(w) ? VP_EBUSY : VP_OK;
  int also = want; /* an invalid source: which check comes first is open */
  char what[48];
  snprintf(what, sizeof what, kind == K_NONE ? "%s" : "%s @%llu",
           kind_name[kind], (unsigned long long)a);
  if (var >> 5 == 7) {
    sp = NULL, want = VP_EINVAL;
    snprintf(what, sizeof what, "NULL");
  } else if (var >> 5 == 6) {
    src = (vp_source_t){.kind = (var & 8) ? VP_SOURCE_FILE : VP_SOURCE_HOST,
                        .fd = -1};
    want = VP_EINVAL;
    snprintf(what, sizeof what, "%s", (var & 8) ? "file, fd -1"
                                                : "host, NULL bytes");
  }
  int rc = FZ_CALL(false, vp_weight_set_source(w->h, sp), "w%d, %s", wi,
                   what);
  if (rc != want && rc == also && want == VP_EINVAL) return;
  if (!expect_rc("vp_weight_set_source", rc, want) || rc) return;
  source_changed(w, kind, a);
  acquire_after(k, var, wi);
}

/* vp_weight_swap_source: a weight (live, destroyed or held: pick_target)
 * takes the same bytes from a new place: a HOST or FILE one from a
 * malloc'd copy of what it reads now (HOST), a NONE one from NONE again;
 * var >> 5 of 7, NULL (VP_EINVAL). VP_EBUSY while acquired, and nothing
 * changes. Nothing is filled anew (its pages, a staged copy and what a
 * NONE weight's caller wrote stay valid), so the model's bytes stay; the
 * copy it read before is freed at once (copies from it are waited for),
 * where ASan sees a read the library did not wait for. var bit 4:
 * acquire_after. */
static void s_swap_source(fz_reader_t *r) {
  uint8_t k = fz_u8(r), var = fz_u8(r);
  int wi = pick_target(k, var);
  if (wi < 0 || skip_set_source) return;
  fweight_t *w = &g.W[wi];
  bool none = w->kind == K_NONE;
  uint8_t *copy = NULL;
  vp_source_t src = {.kind = VP_SOURCE_NONE, .fd = -1};
  if (!none) {
    if (!(copy = malloc(w->size))) abort();
    memcpy(copy, weight_src(w), w->size);
    src = (vp_source_t){.kind = VP_SOURCE_HOST, .host = copy, .fd = -1};
  }
  bool null = var >> 5 == 7;
  int want = null ? VP_EINVAL
             : !w->live ? VP_EHANDLE
             : holds_total(w) ? VP_EBUSY : VP_OK;
  int rc = FZ_CALL(false, vp_weight_swap_source(w->h, null ? NULL : &src),
                   "w%d, %s", wi, null ? "NULL" : none ? "none" : "a copy");
  if (rc != want && null && (rc == VP_EHANDLE || rc == VP_EBUSY)) rc = want;
  if (!expect_rc("vp_weight_swap_source", rc, want) || rc) {
    free(copy);
    return;
  }
  if (!none) {
    free(w->own);
    w->own = copy;
    w->kind = K_HOST;
  }
  acquire_after(k, var, wi);
}

/* vp_weight_set_lookahead: a weight (live, destroyed or held:
 * pick_target) gets its own prefetch window (var >> 5: none, 1-4 pages,
 * 16 KiB steps, the device's, all), read back with
 * vp_weight_get_lookahead. var bit 4: acquire_after through
 * vp_acquire_ahead with the window in the next byte (0: no prefetch). */
static void s_set_window(fz_reader_t *r) {
  uint8_t k = fz_u8(r), var = fz_u8(r), a = fz_u8(r);
  int wi = pick_target(k, var);
  if (wi < 0) return;
  fweight_t *w = &g.W[wi];
  uint64_t page = g.cfg.page, bytes;
  switch (var >> 5) {
  case 0: bytes = 0; break;
  case 1: case 2: case 3: case 4: bytes = (var >> 5) * page; break;
  case 5: bytes = (uint64_t)(var & 7) * 16 * KiB; break;
  case 6: bytes = VP_LOOKAHEAD_DEVICE; break;
  default: bytes = UINT64_MAX - 1;
  }
  int want = w->live ? VP_OK : VP_EHANDLE; /* held: allowed */
  int rc = FZ_CALL(false, vp_weight_set_lookahead(w->h, bytes), "w%d, %llu",
                   wi, (unsigned long long)bytes);
  if (!expect_rc("vp_weight_set_lookahead", rc, want) || rc) return;
  uint64_t got = 0;
  rc = FZ_CALL(false, vp_weight_get_lookahead(w->h, &got), "w%d", wi);
  if (!expect_rc("vp_weight_get_lookahead", rc, VP_OK)) return;
  CHECK(got == bytes, "op %u: w%d's window reads %llu, set %llu", g.op, wi,
        (unsigned long long)got, (unsigned long long)bytes);
  ahead_next = (var & 0x10) != 0;
  ahead_bytes = (uint64_t)(a & 0x7f) * (a & 0x80 ? page : 16 * KiB);
  acquire_after(k, var, wi);
  ahead_next = false;
}

/* vp_weight_destroy, then vp_weights_create over the same range (var bit
 * 3: its first half) with another source (var & 3 as in s_set_source): a
 * caller swapping a layer's weights. A held weight: VP_EBUSY, and the new
 * one overlaps it (VP_EINVAL). The new weight (the next w<n>) may find its
 * pages resident with the old bytes, still read by kernels queued before
 * the old weight's release: its first acquire fills them anew (COPIED,
 * the new bytes; or EMPTY for NONE, then written on the acquire's stream)
 * and must not overwrite them under those kernels. var bit 4:
 * acquire_after. */
static void s_recreate(fz_reader_t *r) {
  uint8_t k = fz_u8(r), var = fz_u8(r);
  uint16_t ab = fz_u16(r);
  int wi = pick_target(k, var);
  if (wi < 0 || !g.W[wi].live || g.nW == MAXW || skip_set_source) return;
  fweight_t *old = &g.W[wi];
  int v = old->v;
  int kind = (var & 3) == 3 ? K_HOST : var & 3;
  uint64_t off = old->off;
  uint64_t size = (var & 8) ? (old->size + 1) / 2 : old->size;
  uint64_t a = fresh_aoff(size, old->kind == K_NONE ? NULL : weight_src(old),
                          ab);
  vp_source_t src = source_of(kind, a);
  bool busy = holds_total(old) != 0;
  int rc = FZ_CALL(false, vp_weight_destroy(old->h), "w%d (to make anew)",
                   wi);
  if (!expect_rc("vp_weight_destroy", rc, busy ? VP_EBUSY : VP_OK)) return;
  vp_weight_t h;
  if (busy) {
    rc = FZ_CALL(false, vp_weights_create(g.V[v].h, 1, &off, &size, &src, &h),
                 "v%d, [%llu, +%llu) over held w%d", v,
                 (unsigned long long)off, (unsigned long long)size, wi);
    expect_rc("vp_weights_create (overlaps a held weight)", rc, VP_EINVAL);
    return;
  }
  old->live = false;
  rc = FZ_CALL(false, vp_weights_create(g.V[v].h, 1, &off, &size, &src, &h),
               "v%d, [%llu, +%llu) where w%d was -> w%d", v,
               (unsigned long long)off, (unsigned long long)size, wi, g.nW);
  if (rc) return unexpected("vp_weights_create", rc, "VP_OK");
  fweight_t *w = &g.W[g.nW];
  memset(w, 0, sizeof *w);
  w->h = h;
  w->live = true;
  w->v = v;
  w->off = off;
  w->size = size;
  pages_of(w->off, w->size, &w->p0, &w->p1);
  source_changed(w, kind, a);
  fz_trace("  w%d: v%d [%llu, +%llu) %s @%llu", g.nW, v,
           (unsigned long long)w->off, (unsigned long long)w->size,
           kind_name[w->kind], (unsigned long long)w->aoff);
  g.nW++;
  acquire_after(k, var, g.nW - 1);
}

/* vp_weights_move of one weight (pick_target) to, by var >> 5: 0 its own
 * offset (it keeps its fill), 1 past its VBAR (VP_ERANGE), else an offset
 * below the VBAR's scratch tail from a (VP_EINVAL where another live
 * weight lies). VP_EBUSY while held, VP_EHANDLE once it (or its VBAR) is
 * destroyed: nothing changes then. Moved, its next acquire copies
 * (COPIED; a NONE weight's bytes there were never written: EMPTY), as
 * after a new source. var bit 4: acquire_after. */
static void s_move(fz_reader_t *r) {
  uint8_t k = fz_u8(r), var = fz_u8(r);
  uint16_t a = fz_u16(r);
  int wi = pick_target(k, var);
  if (wi < 0 || skip_set_source) return;
  fweight_t *w = &g.W[wi];
  fvbar_t *b = &g.V[w->v];
  uint64_t off = w->off;
  if (var >> 5 == 1) {
    off = b->size + a % 64;
  } else if (var >> 5) {
    if (w->size > b->wlimit) return;
    off = ((uint64_t)a * 16) % (b->wlimit - w->size + 1);
  }
  bool overlap = false;
  for (int i = 0; i < g.nW; i++) {
    const fweight_t *o = &g.W[i];
    if (i != wi && o->live && o->v == w->v && o->off < off + w->size &&
        off < o->off + o->size)
      overlap = true;
  }
  int want = !b->live || !w->live ? VP_EHANDLE
             : holds_total(w) ? VP_EBUSY
             : off >= b->size || w->size > b->size - off ? VP_ERANGE
             : overlap ? VP_EINVAL : VP_OK;
  int rc = FZ_CALL(false, vp_weights_move(b->h, 1, &w->h, &off),
                   "v%d, w%d to %llu", w->v, wi, (unsigned long long)off);
  if (!expect_rc("vp_weights_move", rc, want) || rc) return;
  if (off != w->off) {
    w->off = off;
    pages_of(w->off, w->size, &w->p0, &w->p1);
    refill_expected(w);
    if (b->cursor < off + w->size) /* new weights go after it */
      b->cursor = off + w->size;
  }
  acquire_after(k, var, wi);
}

static void s_vbar_destroy(fz_reader_t *r) {
  int v = pick_vbar(r);
  if (v < 0) return;
  fvbar_t *b = &g.V[v];
  int want = !b->live ? VP_EHANDLE : vbar_busy(v) ? VP_EBUSY : VP_OK;
  int rc = FZ_CALL(false, vp_vbar_destroy(b->h), "v%d", v);
  if (!expect_rc("vp_vbar_destroy", rc, want) || rc != VP_OK) return;
  b->live = false;
  for (int i = 0; i < g.nW; i++)
    if (g.W[i].v == v) g.W[i].live = false;
  scratch_drop(v, 0, UINT64_MAX);
}

static void s_inject(fz_reader_t *r) {
  uint8_t k = fz_u8(r), n = fz_u8(r);
  int kind;
  uint64_t val;
  switch (k % 5) {
  case 0: kind = VP_SIM_FAIL_COMMIT; val = 1 + n % 4; break;
  case 3: kind = VP_SIM_MAP_APART; val = n & 1; break; /* the ring checks */
  case 1: kind = VP_SIM_TRANSIENT; val = 1 + n % 6; break;
  case 2:
    kind = VP_SIM_SET_CAPACITY;
    val = (uint64_t)(n % (g.cfg.cap_pages + 3)) << g.cfg.shift;
    break;
  default:
    kind = VP_SIM_SET_CAPACITY;
    val = (uint64_t)g.cfg.cap_pages << g.cfg.shift;
  }
  int rc = FZ_CALL(false, vp_sim_inject(g.dev, kind, val), "kind %d, %llu",
                   kind, (unsigned long long)val);
  expect_rc("vp_sim_inject", rc, VP_OK);
}

/* A held weight's bytes: read back, or checked by a kernel on its stream
 * (then maybe released at once, and its pages freed: the release fence
 * must keep them until the kernel ran). var bit 3, worker streams: a slow
 * kernel, still queued while the next ops give the weight a new source
 * or make it anew and fill its pages again (which must wait for it). */
static void s_check_held(fz_reader_t *r) {
  uint8_t k = fz_u8(r), var = fz_u8(r);
  int wi, s;
  if (!pick_hold(k, &wi, &s)) return;
  fweight_t *w = &g.W[wi];
  bool inplace;
  if (w->rmin[s] && (!(var & 4) || w->rmax[s] == w->n[s])) inplace = true;
  else if (w->rmax[s] < w->n[s]) inplace = false;
  else return; /* which kind the holds are is unknown */
  uint64_t ptr = inplace ? g.V[w->v].base + w->off : w->staged_ptr;
  const uint8_t *want = weight_src(w);
  if (w->kind == K_NONE) {
    bool known = inplace ? w->inplace_known : w->staged_known;
    if (!known) return;
    pattern(pbuf + ARENA_SIZE / 2, w->size,
            inplace ? w->inplace_pat : w->staged_pat);
    want = pbuf + ARENA_SIZE / 2;
  }
  char what[64];
  snprintf(what, sizeof what, "held w%d %s", wi, inplace ? "in place"
                                                         : "staged");
  if ((var & 3) == 0) return read_check(what, ptr, w->size, s, want);
  launch_check(wi, ptr, s, want, (var & 8) && g.cfg.worker);
  if ((var & 3) == 1) return;
  int idx[1] = {wi};
  s_release_list(s, idx, 1);
  if ((var & 3) == 3) do_free(-1, UINT64_MAX);
}

static void s_stats(fz_reader_t *r) {
  uint8_t k = fz_u8(r);
  vp_stats_t st = {.size = sizeof st};
  int rc = FZ_CALL(false, vp_device_stats(g.dev, &st), "dev");
  if (!expect_rc("vp_device_stats", rc, VP_OK)) return;
  uint64_t pinned = 0, resident = 0;
  for (int v = 0; v < g.nV; v++) {
    if (!g.V[v].live) continue;
    uint8_t f[MAXP];
    residency(v, f);
    for (uint32_t p = 0; p < g.V[v].npages; p++) {
      pinned += (f[p] & VP_PAGE_PINNED) != 0;
      resident += (f[p] & VP_PAGE_RESIDENT) != 0;
    }
  }
  CHECK(st.pinned_bytes == pinned << g.cfg.shift, "op %u: stats pinned_bytes "
        "%llu, residency shows %llu pinned pages", g.op,
        (unsigned long long)st.pinned_bytes, (unsigned long long)pinned);
  /* A device without a pin ledger is the machine's only pinner, within
   * its budget. */
  CHECK(st.machine_pinned_bytes == st.host_pinned_bytes &&
        (!g.cfg.pin_budget || st.machine_pinned_bytes <= g.cfg.pin_budget),
        "op %u: stats machine_pinned_bytes %llu, host_pinned_bytes %llu, "
        "pin budget %llu", g.op, (unsigned long long)st.machine_pinned_bytes,
        (unsigned long long)st.host_pinned_bytes,
        (unsigned long long)g.cfg.pin_budget);
  uint64_t ring = (g.cfg.staging < g.cfg.page ? g.cfg.page
                   : (g.cfg.staging + g.cfg.page - 1) & ~(g.cfg.page - 1));
  uint64_t res = resident << g.cfg.shift;
  CHECK(st.committed_bytes == res || st.committed_bytes == res + ring,
        "op %u: stats committed_bytes %llu; VBAR pages hold %llu, staging "
        "%llu", g.op, (unsigned long long)st.committed_bytes,
        (unsigned long long)res, (unsigned long long)ring);
  vp_device_info_t info;
  rc = FZ_CALL(false, vp_device_info(g.dev, &info), "dev");
  if (!expect_rc("vp_device_info", rc, VP_OK)) return;
  CHECK(info.page_size == g.cfg.page && info.granularity == g.cfg.gran &&
        info.committed == st.committed_bytes, "op %u: vp_device_info page "
        "%llu gran %llu committed %llu", g.op,
        (unsigned long long)info.page_size,
        (unsigned long long)info.granularity,
        (unsigned long long)info.committed);
  static char rep[1 << 16];
  size_t need = 0, len = (k & 1) ? sizeof rep : 1 + k % 64;
  rc = FZ_CALL(false, vp_device_report(g.dev, (k >> 1) & 1, rep, len, &need),
               "json %d, len %zu", (k >> 1) & 1, len);
  if (rc == VP_ERANGE && need >= len) {
    CHECK(strnlen(rep, len) < len, "op %u: truncated report is not "
          "terminated", g.op);
  } else if (expect_rc("vp_device_report", rc, VP_OK)) {
    CHECK(strlen(rep) == need, "op %u: report is %zu bytes, needed says %zu",
          g.op, strlen(rep), need);
  }
}

static void s_set_order(fz_reader_t *r) {
  int v = pick_vbar(r);
  uint8_t k = fz_u8(r);
  if (v < 0 || !g.V[v].live) return;
  int order = k % 3 == 2 ? (int)k : k % 3;
  uint8_t f[MAXP];
  residency(v, f);
  bool any = false;
  for (uint32_t p = 0; p < g.V[v].npages; p++)
    any |= (f[p] & VP_PAGE_RESIDENT) != 0;
  int want = order > 1 ? VP_EINVAL : any ? VP_EBUSY : VP_OK;
  int rc = FZ_CALL(false, vp_vbar_set_order(g.V[v].h, order), "v%d, %d", v,
                   order);
  expect_rc("vp_vbar_set_order", rc, want);
}

static void s_reset_limits(void) {
  int rc = FZ_CALL(false, vp_device_reset_limits(g.dev), "dev");
  if (!expect_rc("vp_device_reset_limits", rc, VP_OK)) return;
  for (int v = 0; v < g.nV; v++) {
    if (!g.V[v].live) continue;
    uint64_t lim = 0;
    rc = FZ_CALL(false, vp_vbar_get_watermark_limit(g.V[v].h, &lim), "v%d",
                 v);
    CHECK(rc == VP_OK && lim == g.V[v].npages, "op %u: limit %llu after "
          "reset", g.op, (unsigned long long)lim);
  }
}

/* A broken device: calls that use the device fail with VP_EDEVICE. */
static void s_break(fz_reader_t *r) {
  if (fz_u8(r) != 0x42) return;
  int rc = FZ_CALL(false, vp_sim_inject(g.dev, VP_SIM_BREAK, 0), "break");
  if (!expect_rc("vp_sim_inject", rc, VP_OK)) return;
  g.broken = true;
  vp_vbar_t vb;
  rc = FZ_CALL(false, vp_vbar_create(g.dev, g.cfg.page, &vb), "broken");
  expect_rc("vp_vbar_create on a broken device", rc, VP_EDEVICE);
  for (int i = 0; i < g.nW; i++) {
    if (!g.W[i].live) continue;
    uint64_t ptr;
    rc = FZ_CALL(false, vp_acquire(g.dev, &g.W[i].h, 1, 0, &ptr, NULL),
                 "w%d, broken", i);
    expect_rc("vp_acquire on a broken device", rc, VP_EDEVICE);
    uint32_t gens[MAXP];
    rc = FZ_CALL(true, vp_fault(g.V[g.W[i].v].h, g.W[i].off, g.W[i].size,
                                gens, MAXP), "w%d's range, broken", i);
    expect_rc("vp_fault on a broken device", rc, VP_EDEVICE);
    break;
  }
}

/* Give everything back in order: holds, raw pins, weights, VBARs, streams;
 * each must succeed, and nothing stays pinned. */
static void s_tidy(void) {
  for (int i = 0; i < g.nW; i++)
    for (int s = 0; s < MAXS; s++) {
      int idx[8];
      while (g.W[i].n[s]) {
        uint32_t n = g.W[i].n[s] < 8 ? g.W[i].n[s] : 8;
        for (uint32_t j = 0; j < n; j++) idx[j] = i;
        uint32_t before = g.W[i].n[s];
        s_release_list(s, idx, n);
        if (g.W[i].n[s] == before) return; /* tolerated failure */
      }
    }
  while (g.nraw) {
    fraw_t x = g.raw[g.nraw - 1];
    if (!do_unpin(x.v, x.off, x.size, 0)) return;
    g.nraw--;
  }
  check_all();
  for (int i = 0; i < g.nW; i++) {
    if (!g.W[i].live) continue;
    int rc = FZ_CALL(false, vp_weight_destroy(g.W[i].h), "w%d", i);
    if (!expect_rc("vp_weight_destroy", rc, VP_OK)) return;
    g.W[i].live = false;
  }
  for (int v = 0; v < g.nV; v++) {
    if (!g.V[v].live) continue;
    int rc = FZ_CALL(false, vp_vbar_destroy(g.V[v].h), "v%d", v);
    if (!expect_rc("vp_vbar_destroy", rc, VP_OK)) return;
    g.V[v].live = false;
  }
  for (int s = 1; s < g.nS; s++) {
    if (!g.S[s].live) continue;
    int rc = FZ_CALL(false, vp_stream_destroy(g.dev, g.S[s].h), "s%d", s);
    if (!expect_rc("vp_stream_destroy", rc, VP_OK)) return;
    g.S[s].live = false;
  }
  vp_stats_t st = {.size = sizeof st};
  int rc = FZ_CALL(false, vp_device_stats(g.dev, &st), "dev");
  CHECK(rc == VP_OK && st.pinned_bytes == 0, "tidy: %llu bytes still pinned",
        (unsigned long long)st.pinned_bytes);
}

static void s_stream_create(void);

static void run_strict(fz_reader_t *r) {
  if (!device_open()) return;
  maybe_register_arena();
  for (int i = 0; i < g.cfg.streams; i++) s_stream_create();
  while (fz_more(r) && g.op < MAX_OPS && !g.broken && !g.maybe_broken) {
    uint8_t op = op_decode(fz_u8(r));
    fz_opno = ++g.op;
    switch (op) {
    case OP_VBAR_CREATE: s_vbar_create(r); break;
    case OP_WEIGHTS_CREATE: s_weights_create(r); break;
    case OP_ACQUIRE: s_acquire(r); break;
    case OP_RELEASE: s_release(r); break;
    case OP_RELEASE_HELD: s_release_held(r); break;
    case OP_FAULT: s_fault(r); break;
    case OP_UNPIN: s_unpin(r); break;
    case OP_SCRATCH_WRITE: s_scratch_write(r); break;
    case OP_SCRATCH_CHECK: s_scratch_check(r); break;
    case OP_FREE_VBAR: s_free_vbar(r); break;
    case OP_FREE_DEVICE: s_free_device(r); break;
    case OP_PRIORITIZE: s_prioritize(r, true); break;
    case OP_DEPRIORITIZE: s_prioritize(r, false); break;
    case OP_SET_WATERMARK: s_set_watermark(r, false); break;
    case OP_SET_WM_LIMIT: s_set_watermark(r, true); break;
    case OP_SET_LIMIT: s_device_setting(r, 0); break;
    case OP_SET_HEADROOM: s_device_setting(r, 1); break;
    case OP_SET_LOOKAHEAD: s_device_setting(r, 2); break;
    case OP_STREAM_CREATE: s_stream_create(); break;
    case OP_STREAM_DESTROY: s_stream_destroy(r); break;
    case OP_STREAM_DESTROY_FAKE: s_stream_destroy_fake(r); break;
    case OP_STREAM_SYNC: s_stream_sync(r); break;
    case OP_WEIGHT_DESTROY: s_weight_destroy(r); break;
    case OP_VBAR_DESTROY: s_vbar_destroy(r); break;
    case OP_INJECT: s_inject(r); break;
    case OP_CHECK_HELD: s_check_held(r); break;
    case OP_STATS: s_stats(r); break;
    case OP_SET_ORDER: s_set_order(r); break;
    case OP_RESET_LIMITS: s_reset_limits(); break;
    case OP_BREAK: s_break(r); break;
    case OP_ACQUIRE_EACH: s_acquire_each(r); break;
    case OP_SET_SOURCE: s_set_source(r); break;
    case OP_RECREATE: s_recreate(r); break;
    case OP_SET_WINDOW: s_set_window(r); break;
    case OP_MOVE: s_move(r); break;
    case OP_SWAP_SOURCE: s_swap_source(r); break;
    }
    if (!g.maybe_broken) check_all();
  }
  if (g.broken || g.maybe_broken) return;
  for (int s = 0; s < g.nS; s++) {
    if (!g.S[s].live) continue;
    int rc = FZ_CALL(false, vp_stream_synchronize(g.dev, g.S[s].h), "s%d", s);
    expect_rc("vp_stream_synchronize", rc, VP_OK);
  }
  check_all();
  if (g.cfg.tidy && !g.maybe_broken) s_tidy();
}

/* --------------------------------------------------------------- wild */

typedef struct pool {
  uint64_t v[32];
  int n;
} pool_t;

static struct wild {
  pool_t dev, vbar, w, s, hb, st;
  uint64_t wsize[32]; /* the size of weight w.v[i] (0: not known) */
  struct wvb { uint64_t id, base, size; } vb[32];
  int nvb;
  struct whold { uint64_t w, s, ptr; } hold[64];
  int nhold;
  struct wpin { uint64_t v, off, size; } pin[64];
  int npin;
  vp_device_t devs[8];
  int ndevs;
  vp_device_t cur; /* the device most calls use */
  int big;         /* VBARs of more than 4096 pages made */
} wl;

static void push(pool_t *p, uint64_t id) {
  if (p->n < 32) p->v[p->n++] = id;
  else p->v[id % 32] = id;
}

/* push(&wl.w, id), keeping its size beside it. */
static void push_weight(uint64_t id, uint64_t size) {
  int i = wl.w.n < 32 ? wl.w.n : (int)(id % 32);
  push(&wl.w, id);
  wl.wsize[i] = size;
}

/* The size a weight was made with; 0 if the handle is not one made. */
static uint64_t weight_size(uint64_t id) {
  for (int i = 0; i < wl.w.n; i++)
    if (wl.w.v[i] == id) return wl.wsize[i];
  return 0;
}

static pool_t *const wild_pools[] = {&wl.dev, &wl.vbar, &wl.w, &wl.s, &wl.hb,
                                     &wl.st};

/* A handle: mostly one made (live or not); else one with a bit flipped, a
 * random value, 0, or a handle of another kind. */
static uint64_t pick_id(fz_reader_t *r, pool_t *p) {
  uint8_t b = fz_u8(r);
  if (b < 160 && p->n) return p->v[b % p->n];
  if (b < 192 && p->n) return p->v[b % p->n] ^ (1ull << (fz_u8(r) % 64));
  if (b < 224) return fz_u64(r);
  if (b < 240) return 0;
  pool_t *q = wild_pools[b % 6];
  return q->n ? q->v[fz_u8(r) % q->n] : 0;
}

static vp_stream_t pick_wstream(fz_reader_t *r) {
  uint8_t b = fz_u8(r);
  uint64_t base = wl.s.n ? wl.s.v[(b >> 3) % wl.s.n] : 0;
  switch (b % 8) {
  case 0: return 0;
  case 1: case 2: case 3: return base;
  case 4: return base + ((b & 0x40) ? 1 : -1ull);
  case 5: return base ^ (1ull << 24);
  case 6: return fz_u64(r);
  default: return wl.nhold ? wl.hold[b % wl.nhold].s : UINT64_MAX;
  }
}

static vp_device_t pick_dev(fz_reader_t *r) {
  uint8_t b = fz_u8(r);
  if (b < 200) return wl.cur;
  return (vp_device_t){pick_id(r, &wl.dev)};
}

static uint64_t pick_size(fz_reader_t *r) {
  uint64_t page = g.cfg.page;
  switch (fz_u8(r) % 14) {
  case 0: return 0;
  case 1: return 1;
  case 2: return fz_u16(r);
  case 3: return page;
  case 4: return page * (1 + fz_u8(r) % 16);
  case 5: return page * (1 + fz_u8(r) % 4) - 1 - fz_u8(r);
  case 6: return UINT64_MAX;
  case 7: return UINT64_MAX - fz_u16(r);
  case 8: return 1ull << (fz_u8(r) % 64);
  case 9: return fz_u64(r);
  case 10: return fz_u32(r);
  case 11: return page * fz_u8(r) + fz_u16(r);
  case 12: return (1ull << 63) + fz_u8(r);
  default: return 1 + fz_u16(r) % 4096;
  }
}

/* A device address: in a known VBAR, a held weight's, or made up. */
static uint64_t pick_addr(fz_reader_t *r) {
  uint8_t b = fz_u8(r);
  if (b < 140 && wl.nvb) {
    int i = b % wl.nvb;
    return wl.vb[i].base + (fz_u8(r) & 1 ? fz_below(r, wl.vb[i].size + 2)
                                         : pick_size(r));
  }
  if (b < 200 && wl.nhold) return wl.hold[b % wl.nhold].ptr + fz_u8(r) % 4;
  return fz_u64(r);
}

static size_t pick_n(fz_reader_t *r) {
  uint8_t b = fz_u8(r);
  if (b < 8) return 0;
  if (b < 16) return 65 + b % 6; /* past the library's on-stack arrays */
  return 1 + b % 8;
}

#define W(miss_ok, call, ...) FZ_CALL(miss_ok, call, __VA_ARGS__)
#define X(v) ((unsigned long long)(v))

static bool wild_open(const cfg_t *c, vp_device_t *out) {
  vp_options_t o;
  cfg_options(c, &o);
  int rc = W(false, vp_device_open(&o, out), "%s, page %llu, fail_nth %lld",
             c->worker ? "worker" : "sync", X(c->page), (long long)c->fail_nth);
  if (rc) return false;
  push(&wl.dev, out->id);
  if (wl.ndevs == 8) { /* keep every open device known, to close it */
    W(false, vp_device_close(*out), "0x%llx (too many)", X(out->id));
    return false;
  }
  wl.devs[wl.ndevs++] = *out;
  return true;
}

static void forget_dev(vp_device_t d) {
  for (int i = 0; i < wl.ndevs; i++)
    if (wl.devs[i].id == d.id) wl.devs[i] = wl.devs[--wl.ndevs];
}

static void w_vbar_create(fz_reader_t *r) {
  vp_device_t d = pick_dev(r);
  uint8_t b = fz_u8(r);
  uint64_t size = b < 230 ? g.cfg.page * (1 + b % 16) - (b & 1) * 4097
                          : pick_size(r);
  if (size / g.cfg.page > 4096 && wl.big++) size = g.cfg.page;
  vp_vbar_t v = {0};
  int rc = W(false, vp_vbar_create(d, size, (b & 0x40) && b > 250 ? NULL : &v),
             "dev 0x%llx, %llu", X(d.id), X(size));
  if (rc) return;
  uint64_t base = 0, sz = 0;
  W(false, vp_vbar_base(v, &base), "0x%llx", X(v.id));
  W(false, vp_vbar_size(v, &sz), "0x%llx", X(v.id));
  /* VP_DEBUG's check after every call walks every page table: a VBAR of
   * millions of pages made each later call of the input take 0.1 s (an
   * input of 27 s, past -timeout=20). Made, looked at, given back. */
  if (sz / g.cfg.page > (1u << 18)) {
    W(false, vp_vbar_destroy(v), "0x%llx (huge)", X(v.id));
    return;
  }
  push(&wl.vbar, v.id);
  if (wl.nvb < 32) wl.vb[wl.nvb++] = (struct wvb){v.id, base, sz};
}

/* A source for a weight of `size` bytes: host bytes in the arena (when
 * they fit; never for size 0, a weight whose size is not known), a NULL
 * host, the arena or safetensors file, bad fds, bad
 * kinds, none. */
static void w_source(fz_reader_t *r, uint64_t size, vp_source_t *src) {
  uint8_t k = fz_u8(r);
  uint64_t a = fz_u32(r);
  *src = (vp_source_t){.kind = VP_SOURCE_NONE, .fd = -1};
  switch (k % 8) {
  case 0:
    if (size && size <= ARENA_SIZE) {
      src->kind = VP_SOURCE_HOST;
      src->host = arena + a % (ARENA_SIZE - size + 1);
    }
    break;
  case 1: src->kind = VP_SOURCE_HOST; break; /* NULL host */
  case 2:
    src->kind = VP_SOURCE_FILE;
    src->fd = arena_fd;
    src->file_offset = (k & 8) ? fz_u64(r) : a % ARENA_SIZE;
    break;
  case 3:
    src->kind = VP_SOURCE_FILE;
    src->fd = st_fd;
    src->file_offset = a % 256;
    break;
  case 4: src->kind = VP_SOURCE_FILE; src->fd = (k & 8) ? -1 : 999; break;
  case 5: break;
  case 6: src->kind = (int)(k >> 3) - 4; break;
  default: src->kind = VP_SOURCE_NONE;
  }
}

static void w_weights_create(fz_reader_t *r) {
  static uint64_t off[72], size[72];
  static vp_source_t src[72];
  static vp_weight_t out[72];
  vp_vbar_t v = {pick_id(r, &wl.vbar)};
  size_t n = pick_n(r);
  uint8_t flags = fz_u8(r);
  uint64_t vsize = 1ull << 30, cur = 0;
  for (int i = 0; i < wl.nvb; i++)
    if (wl.vb[i].id == v.id) vsize = wl.vb[i].size;
  for (size_t i = 0; i < n; i++) {
    uint8_t m = fz_u8(r);
    switch (m % 4) {
    case 0: case 1:
      off[i] = cur + (m >> 2) * 16;
      size[i] = 1 + fz_u16(r) % (vsize / 4 + 1);
      cur = off[i] + size[i];
      break;
    case 2:
      off[i] = pick_size(r);
      size[i] = pick_size(r);
      break;
    default:
      off[i] = i ? off[i - 1] + fz_u8(r) : 0;
      size[i] = i ? size[i - 1] : 1;
    }
    w_source(r, size[i], &src[i]);
  }
  int rc = W(false, vp_weights_create(v, n, (flags & 1) ? NULL : off,
                                      (flags & 2) && n ? NULL : size,
                                      (flags & 4) ? NULL : src,
                                      (flags & 8) && n ? NULL : out),
             "vbar 0x%llx, %zu, flags %u", X(v.id), n, flags);
  if (rc == VP_OK && !(flags & 8))
    for (size_t i = 0; i < n; i++)
      push_weight(out[i].id, (flags & 2) ? 0 : size[i]);
}

static void w_acquire(fz_reader_t *r) {
  static vp_weight_t ws[72];
  static uint64_t ptrs[72];
  static uint8_t flags[72];
  vp_device_t d = pick_dev(r);
  size_t n = pick_n(r);
  uint8_t f = fz_u8(r);
  for (size_t i = 0; i < n; i++) ws[i].id = pick_id(r, &wl.w);
  vp_stream_t s = pick_wstream(r);
  /* f bit 3: vp_acquire_ahead, its lookahead (f >> 4) x 16 KiB */
  int rc = (f & 8) ? W(false, vp_acquire_ahead(d, (f & 1) ? NULL : ws, n, s,
                                               (f & 2) ? NULL : ptrs,
                                               (f & 4) ? NULL : flags,
                                               (uint64_t)(f >> 4) * 16 * KiB),
                       "dev 0x%llx, %zu, stream 0x%llx, f %u", X(d.id), n,
                       X(s), f)
                   : W(false, vp_acquire(d, (f & 1) ? NULL : ws, n, s,
                                         (f & 2) ? NULL : ptrs,
                                         (f & 4) ? NULL : flags),
                       "dev 0x%llx, %zu, stream 0x%llx, f %u", X(d.id), n,
                       X(s), f);
  if (rc || (f & 3)) return;
  for (size_t i = 0; i < n && wl.nhold < 64; i++)
    wl.hold[wl.nhold++] = (struct whold){ws[i].id, s, ptrs[i]};
}

static void w_release(fz_reader_t *r) {
  static vp_weight_t ws[72];
  vp_device_t d = pick_dev(r);
  uint8_t b = fz_u8(r);
  if (b < 128 && wl.nhold) {
    int i = b % wl.nhold;
    vp_weight_t w = {wl.hold[i].w};
    int rc = W(false, vp_release(d, &w, 1, wl.hold[i].s), "held 0x%llx on "
               "0x%llx", X(w.id), X(wl.hold[i].s));
    if (rc == VP_OK) wl.hold[i] = wl.hold[--wl.nhold];
    return;
  }
  size_t n = pick_n(r);
  for (size_t i = 0; i < n; i++)
    ws[i].id = (b & 1) && wl.nhold ? wl.hold[fz_u8(r) % wl.nhold].w
                                   : pick_id(r, &wl.w);
  vp_stream_t s = pick_wstream(r);
  W(false, vp_release(d, (b & 2) ? NULL : ws, n, s), "%zu, stream 0x%llx", n,
    X(s));
}

static void w_fault(fz_reader_t *r) {
  static uint32_t gens[64];
  vp_vbar_t v = {pick_id(r, &wl.vbar)};
  uint8_t b = fz_u8(r);
  uint64_t off, size;
  int known = -1;
  for (int i = 0; i < wl.nvb; i++)
    if (wl.vb[i].id == v.id) known = i;
  if (known >= 0 && b < 200) {
    off = fz_below(r, wl.vb[known].size);
    size = 1 + fz_below(r, wl.vb[known].size - off);
  } else {
    off = pick_size(r);
    size = pick_size(r);
  }
  size_t ngens = (b & 1) ? fz_u8(r) % 65 : 64;
  int rc = W(true, vp_fault(v, off, size, (b & 2) ? NULL : gens, ngens),
             "vbar 0x%llx, %llu, %llu, ngens %zu", X(v.id), X(off), X(size),
             ngens);
  if (rc == VP_OK && wl.npin < 64)
    wl.pin[wl.npin++] = (struct wpin){v.id, off, size};
}

static void w_unpin(fz_reader_t *r) {
  uint8_t b = fz_u8(r);
  vp_stream_t s = pick_wstream(r);
  if (b < 160 && wl.npin) {
    int i = b % wl.npin;
    int rc = W(false, vp_unpin((vp_vbar_t){wl.pin[i].v}, wl.pin[i].off,
                               wl.pin[i].size, s),
               "pinned 0x%llx %llu %llu, stream 0x%llx", X(wl.pin[i].v),
               X(wl.pin[i].off), X(wl.pin[i].size), X(s));
    if (rc == VP_OK) wl.pin[i] = wl.pin[--wl.npin];
    return;
  }
  vp_vbar_t v = {pick_id(r, &wl.vbar)};
  uint64_t off = pick_size(r), size = pick_size(r);
  W(false, vp_unpin(v, off, size, s), "0x%llx, %llu, %llu, 0x%llx", X(v.id),
    X(off), X(size), X(s));
}

static void w_free(fz_reader_t *r) {
  uint8_t b = fz_u8(r);
  uint64_t bytes = pick_size(r), freed;
  if (b & 1) {
    vp_vbar_t v = {pick_id(r, &wl.vbar)};
    W(false, vp_vbar_free_memory(v, bytes, (b & 2) ? NULL : &freed),
      "0x%llx, %llu", X(v.id), X(bytes));
  } else {
    vp_device_t d = pick_dev(r);
    W(false, vp_device_free_memory(d, bytes, (b & 2) ? NULL : &freed),
      "0x%llx, %llu", X(d.id), X(bytes));
  }
}

static void w_vbar_misc(fz_reader_t *r) {
  uint8_t b = fz_u8(r);
  vp_vbar_t v = {pick_id(r, &wl.vbar)};
  uint64_t x = 0;
  static uint8_t flags[80];
  vp_device_t d;
  vp_stats_t st[2];
  switch (b % 16) {
  case 0: W(false, vp_vbar_prioritize(v), "0x%llx", X(v.id)); break;
  case 1: W(false, vp_vbar_deprioritize(v), "0x%llx", X(v.id)); break;
  case 2: {
    int o = (int)(int8_t)fz_u8(r) % 4;
    W(false, vp_vbar_set_order(v, o), "0x%llx, %d", X(v.id), o);
    break;
  }
  case 3:
    x = pick_size(r);
    W(false, vp_vbar_set_watermark(v, x), "0x%llx, %llu", X(v.id), X(x));
    break;
  case 4:
    x = pick_size(r);
    W(false, vp_vbar_set_watermark_limit(v, x), "0x%llx, %llu", X(v.id), X(x));
    break;
  case 5: {
    size_t n = fz_u8(r) % 81;
    W(false, vp_vbar_residency(v, (b & 0x10) ? NULL : flags, n),
      "0x%llx, %zu", X(v.id), n);
    break;
  }
  case 6: W(false, vp_vbar_base(v, (b & 0x10) ? NULL : &x), "0x%llx", X(v.id));
    break;
  case 7: W(false, vp_vbar_size(v, (b & 0x10) ? NULL : &x), "0x%llx", X(v.id));
    break;
  case 8: W(false, vp_vbar_page_count(v, (b & 0x10) ? NULL : &x), "0x%llx",
            X(v.id));
    break;
  case 9: W(false, vp_vbar_device(v, (b & 0x10) ? NULL : &d), "0x%llx",
            X(v.id));
    break;
  case 10: W(false, vp_vbar_get_watermark(v, (b & 0x10) ? NULL : &x),
             "0x%llx", X(v.id));
    break;
  case 11: W(false, vp_vbar_get_watermark_limit(v, (b & 0x10) ? NULL : &x),
             "0x%llx", X(v.id));
    break;
  case 12: W(false, vp_vbar_loaded_size(v, (b & 0x10) ? NULL : &x), "0x%llx",
             X(v.id));
    break;
  case 13:
    st[0].size = fz_u8(r) % (sizeof st[0] + 16);
    W(false, vp_vbar_stats(v, (b & 0x10) ? NULL : st), "0x%llx, size %u",
      X(v.id), st[0].size);
    break;
  case 14: W(false, vp_vbar_destroy(v), "0x%llx", X(v.id)); break;
  default: {
    if (b & 0x80) { /* vp_weights_move: any handles, offsets, NULLs */
      static vp_weight_t ws[72];
      static uint64_t offs[72];
      size_t n = pick_n(r);
      for (size_t i = 0; i < n; i++) {
        ws[i].id = pick_id(r, &wl.w);
        offs[i] = pick_size(r);
      }
      W(false, vp_weights_move(v, n, (b & 0x20) ? NULL : ws,
                               (b & 0x40) ? NULL : offs),
        "0x%llx, %zu", X(v.id), n);
      break;
    }
    vp_weight_t w = {pick_id(r, &wl.w)};
    if (!(b & 0x10)) {
      if ((b & 0x60) == 0x60) {
        vp_device_t d = pick_dev(r);
        uint64_t ahead = pick_size(r);
        if (fz_u8(r) & 1) {     /* programs past the most among them */
          uint32_t programs = (uint32_t)(pick_size(r) % 1100);
          W(false, vp_prefetch_sm(d, w, ahead, programs),
            "0x%llx, %llu, %u", X(w.id), (unsigned long long)ahead,
            programs);
        } else {
          W(false, vp_prefetch_ahead(d, w, ahead), "0x%llx, %llu", X(w.id),
            (unsigned long long)ahead);
        }
      } else if (b & 0x40) {
        W(false, vp_prefetch(pick_dev(r), w), "0x%llx", X(w.id));
      } else {
        W(false, vp_weight_destroy(w), "0x%llx", X(w.id));
      }
      break;
    }
    vp_source_t src;
    w_source(r, weight_size(w.id), &src);
    if ((b & 0x60) == 0x20)
      W(false, vp_weight_swap_source(w, &src), "0x%llx, kind %d", X(w.id),
        src.kind);
    else
      W(false, vp_weight_set_source(w, (b & 0x60) == 0x60 ? NULL : &src),
        "0x%llx, kind %d", X(w.id), src.kind);
  }
  }
}

static void w_device_misc(fz_reader_t *r) {
  static char rep[1 << 16];
  uint8_t b = fz_u8(r);
  vp_device_t d = pick_dev(r);
  uint64_t x = 0;
  vp_device_info_t info;
  vp_stats_t st[2];
  switch (b % 12) {
  case 0: {
    int64_t h = (int64_t)pick_size(r);
    W(false, vp_device_set_headroom(d, h), "0x%llx, %lld", X(d.id),
      (long long)h);
    W(false, vp_device_set_shared_headroom(d, h), "0x%llx, %lld", X(d.id),
      (long long)h);
    break;
  }
  case 1: x = pick_size(r);
    W(false, vp_device_set_limit(d, x), "0x%llx, %llu", X(d.id), X(x));
    break;
  case 2: x = pick_size(r);
    W(false, vp_device_set_lookahead(d, x), "0x%llx, %llu", X(d.id), X(x));
    break;
  case 3: x = pick_size(r);
    W(false, vp_device_set_pin_budget(d, x), "0x%llx, %llu", X(d.id), X(x));
    break;
  case 4: W(false, vp_device_reset_limits(d), "0x%llx", X(d.id)); break;
  case 5: W(false, vp_device_reclaimable(d, (b & 0x10) ? NULL : &x), "0x%llx",
            X(d.id));
    break;
  case 6: W(false, vp_device_info(d, (b & 0x10) ? NULL : &info), "0x%llx",
            X(d.id));
    break;
  case 7:
    st[0].size = fz_u8(r) % (sizeof st[0] + 16);
    W(false, vp_device_stats(d, (b & 0x10) ? NULL : st), "0x%llx, size %u",
      X(d.id), st[0].size);
    break;
  case 8: {
    size_t len = (b & 0x10) ? sizeof rep : fz_u8(r) % 200, need;
    int json = (b >> 5) & 1;
    int rc = W(false, vp_device_report(d, json, (b & 0x40) && !len ? NULL : rep,
                                       len, (b & 0x80) ? NULL : &need),
               "0x%llx, json %d, len %zu", X(d.id), json, len);
    if ((rc == VP_OK || rc == VP_ERANGE) && len && !memchr(rep, 0, len))
      fz_fail("vp_device_report: %s and the buffer is not terminated",
              vp_err_name(rc));
    break;
  }
  case 9: {
    const char *name = vp_device_backend(d);
    fz_trace("vp_device_backend(0x%llx) = %s", X(d.id), name ? name : "NULL");
    if (name && strcmp(name, "sim") != 0)
      fz_fail("vp_device_backend: \"%s\"", name);
    break;
  }
  case 10: {
    int kind = (int)(fz_u8(r) % 7) - 1;
    uint64_t n = kind == VP_SIM_SET_CAPACITY ? pick_size(r) : fz_u8(r) % 8;
    if (kind == VP_SIM_TRANSIENT && (b & 0x10)) n = fz_u64(r);
    W(false, vp_sim_inject(d, kind, n), "0x%llx, kind %d, %llu", X(d.id),
      kind, X(n));
    break;
  }
  default: {
    vp_stream_t s = pick_wstream(r);
    W(false, vp_sim_launch(d, s, (b & 0x10) ? NULL : kern_noop, NULL),
      "0x%llx, stream 0x%llx", X(d.id), X(s));
  }
  }
}

static void w_stream(fz_reader_t *r) {
  uint8_t b = fz_u8(r);
  vp_device_t d = pick_dev(r);
  vp_stream_t s;
  switch (b % 3) {
  case 0: {
    int rc = W(false, vp_stream_create(d, (b & 0x10) ? NULL : &s), "0x%llx",
               X(d.id));
    if (rc == VP_OK && !(b & 0x10)) push(&wl.s, s);
    break;
  }
  case 1:
    s = pick_wstream(r);
    W(false, vp_stream_destroy(d, s), "0x%llx, 0x%llx", X(d.id), X(s));
    break;
  default:
    s = pick_wstream(r);
    W(false, vp_stream_synchronize(d, s), "0x%llx, 0x%llx", X(d.id), X(s));
  }
}

static void w_copy(fz_reader_t *r) {
  uint8_t b = fz_u8(r);
  vp_device_t d = pick_dev(r);
  uint64_t addr = pick_addr(r);
  uint64_t size = (b & 0x10) ? pick_size(r) : 1 + fz_u16(r);
  vp_stream_t s = pick_wstream(r);
  /* The host side must hold `size` bytes: ours are ARENA_SIZE. */
  bool fits = size <= ARENA_SIZE;
  switch (b % 3) {
  case 0:
    W(false, vp_copy_to_device(d, addr, fits && !(b & 0x20) ? arena : NULL,
                               size, s),
      "0x%llx, 0x%llx, %llu, 0x%llx", X(d.id), X(addr), X(size), X(s));
    break;
  case 1:
    W(false, vp_copy_to_host(d, fits && !(b & 0x20) ? rbuf : NULL, addr, size,
                             s),
      "0x%llx, 0x%llx, %llu, 0x%llx", X(d.id), X(addr), X(size), X(s));
    break;
  default: {
    int fds[4] = {arena_fd, st_fd, -1, 999};
    int fd = fds[(b >> 5) & 3];
    uint64_t off = (b & 0x80) ? pick_size(r) : fz_below(r, ARENA_SIZE);
    if (!(b & 0x08)) {
      W(false, vp_file_read_to_device(d, fd, off, size, addr, s),
        "0x%llx, fd %d, %llu, %llu, 0x%llx, 0x%llx", X(d.id), fd, X(off),
        X(size), X(addr), X(s));
      break;
    }
    /* Memory outside every VBAR is written as the caller's own: only our
     * scratch buffer (or 0) may be the destination. */
    uint64_t dst = fits && (b & 0x40) ? (uint64_t)(uintptr_t)rbuf : 0;
    uint32_t threads = fz_u8(r) % (VP_FILE_THREADS_MAX + 6);
    W(false, vp_file_read_to_address(d, fd, off, size, dst, s, threads),
      "0x%llx, fd %d, %llu, %llu, 0x%llx, 0x%llx, %u", X(d.id), fd, X(off),
      X(size), X(dst), X(s), threads);
    if (b & 0x04)
      W(false, vp_file_reader_release(d), "0x%llx", X(d.id));
    if (b & 0x02) {
      int kind = (int)(fz_u8(r) % 4), n = 0;
      W(false, vp_device_count(kind, (b & 0x01) ? NULL : &n), "%d", kind);
      /* The simulated device registers nothing: any pointer is fine. */
      W(false, vp_host_unregister(d, (b & 0x01) ? NULL : rbuf), "0x%llx",
        X(d.id));
      uint64_t soft = 0;
      W(false, vp_device_soft_limit(d, (b & 0x01) ? NULL : &soft), "0x%llx",
        X(d.id));
      /* This process's mappings (a short list: counted all the same), and
       * any spans dropped from the resident set: only shared read-only
       * file pages go (a safetensors file's mapping), nothing written. */
      static vp_host_mapping_t maps[2];
      size_t nm = 0, cap = fz_u8(r) % 3;
      W(false, vp_host_mappings((b & 0x01) && cap ? NULL : maps, cap, &nm),
        "%zu", cap);
      uint64_t addrs[3] = {(uint64_t)(uintptr_t)rbuf, pick_size(r),
                           cap ? maps[0].start + fz_u16(r) : 0};
      uint64_t sizes[3] = {pick_size(r), pick_size(r),
                           cap ? maps[0].size : 0};
      W(false, vp_host_drop_resident(3, (b & 0x01) ? NULL : addrs, sizes,
                                     &soft), "3 spans");
      /* Host address space: reserved at any alignment, a range of it (any
       * offset and size: a misaligned one refused) committed, then
       * faulted in, discarded and decommitted, the reservation released
       * whole. */
      uint64_t len = (fz_u8(r) % 16 + 1) * 4096ull;
      uint64_t align = (b & 0x08) ? 1ull << (fz_u8(r) % 24) : fz_u16(r);
      void *base = NULL;
      int rc = W(false, vp_host_reserve(len, align, (b & 0x01) ? NULL : &base),
                 "%llu, %llu", X(len), X(align));
      if (rc == VP_OK && base) {
        uint64_t o = fz_below(r, len), n = fz_below(r, len - o + 1);
        char *at = (char *)base + o;
        if (W(false, vp_host_commit(at, n), "+%llu, %llu", X(o), X(n)) ==
            VP_OK) {
          W(false, vp_host_populate(at, n), "+%llu, %llu", X(o), X(n));
          W(false, vp_host_discard(at, n), "+%llu, %llu", X(o), X(n));
          W(false, vp_host_decommit(at, n), "+%llu, %llu", X(o), X(n));
        }
        W(false, vp_host_release(base, len), "%llu", X(len));
      }
    }
  }
  }
}

static void w_hostbuf(fz_reader_t *r) {
  uint8_t b = fz_u8(r);
  vp_device_t d = pick_dev(r);
  vp_hostbuf_t hb = {0};
  vp_hostbuf_info_t info;
  switch (b % 5) {
  case 0: {
    uint64_t size = (b & 0x10) ? pick_size(r) : fz_u16(r) * 64ull;
    uint64_t max = (b & 0x20) ? pick_size(r) : size + fz_u16(r) * 64ull;
    if (size > 64 * MiB && size < (1ull << 46)) size = 64 * MiB;
    if (max > 256 * MiB && max < (1ull << 46)) max = 256 * MiB;
    int rc = W(false, vp_hostbuf_alloc(d, size, max, (b & 0x40) ? NULL : &hb),
               "0x%llx, %llu, %llu", X(d.id), X(size), X(max));
    if (rc == VP_OK && !(b & 0x40)) push(&wl.hb, hb.id);
    break;
  }
  case 1: {
    uint64_t off = fz_below(r, ARENA_SIZE);
    uint64_t size = (b & 0x10) ? pick_size(r) : 1 + fz_below(r,
                                                             ARENA_SIZE - off);
    int rc = W(false, vp_hostbuf_register(d, (b & 0x20) ? NULL : arena + off,
                                          size, (b & 0x40) ? NULL : &hb),
               "0x%llx, arena+%llu, %llu", X(d.id), X(off), X(size));
    if (rc == VP_OK && !(b & 0x40)) push(&wl.hb, hb.id);
    break;
  }
  case 2: {
    hb.id = pick_id(r, &wl.hb);
    uint64_t size = (b & 0x10) ? pick_size(r) : fz_u16(r) * 256ull;
    if (size > 256 * MiB && size < (1ull << 46)) size = 256 * MiB;
    W(false, vp_hostbuf_grow(hb, size), "0x%llx, %llu", X(hb.id), X(size));
    break;
  }
  case 3:
    hb.id = pick_id(r, &wl.hb);
    W(false, vp_hostbuf_info(hb, (b & 0x10) ? NULL : &info), "0x%llx",
      X(hb.id));
    break;
  default:
    hb.id = pick_id(r, &wl.hb);
    W(false, vp_hostbuf_free(hb), "0x%llx", X(hb.id));
  }
}

static void w_st(fz_reader_t *r) {
  uint8_t b = fz_u8(r);
  vp_st_t st = {pick_id(r, &wl.st)};
  size_t idx = fz_u8(r) % 5;
  switch (b % 8) {
  case 0: {
    char other[64];
    snprintf(other, sizeof other, "/proc/self/fd/%d", arena_fd);
    const char *paths[4] = {st_path, "/nonexistent/x.safetensors", other, ""};
    vp_device_t d = pick_dev(r);
    const char *p = (b & 0x80) ? NULL : paths[(b >> 3) & 3];
    int rc = W(false, vp_st_open(d, p, (b & 0x40) ? NULL : &st), "0x%llx, %s",
               X(d.id), p ? p : "NULL");
    if (rc == VP_OK && !(b & 0x40)) push(&wl.st, st.id);
    break;
  }
  case 1: W(false, vp_st_close(st), "0x%llx", X(st.id)); break;
  case 2: {
    size_t n;
    W(false, vp_st_count(st, (b & 0x10) ? NULL : &n), "0x%llx", X(st.id));
    vp_st_tensor_t t;
    int rc = W(false, vp_st_tensor(st, idx, (b & 0x20) ? NULL : &t),
               "0x%llx, %zu", X(st.id), idx);
    if (rc == VP_OK && !(b & 0x20) && (!t.name || !memchr(t.dtype, 0, 16)))
      fz_fail("vp_st_tensor: bad name or dtype");
    break;
  }
  case 3: {
    const char *names[4] = {"a", "b.weight", "zz", ""};
    size_t i;
    const char *nm = (b & 0x40) ? NULL : names[(b >> 4) & 3];
    W(false, vp_st_find(st, nm, (b & 0x80) ? NULL : &i), "0x%llx, %s",
      X(st.id), nm ? nm : "NULL");
    break;
  }
  case 4: {
    vp_source_t src;
    int rc = W(false, vp_st_source(st, idx, (b & 0x10) ? NULL : &src),
               "0x%llx, %zu", X(st.id), idx);
    if (rc == VP_OK && !(b & 0x10)) {
      vp_vbar_t v = {pick_id(r, &wl.vbar)};
      uint64_t off = fz_u16(r), size = 1 + fz_u8(r) % 64;
      vp_weight_t w;
      rc = W(false, vp_weights_create(v, 1, &off, &size, &src, &w),
             "0x%llx, st source %zu at %llu", X(v.id), idx, X(off));
      if (rc == VP_OK) push(&wl.w, w.id);
    }
    break;
  }
  case 5: {
    size_t n = fz_u8(r) % 5, ind[4];
    uint64_t offs[4];
    for (size_t i = 0; i < 4; i++) {
      ind[i] = fz_u8(r) % 5;
      offs[i] = (b & 0x10) ? pick_size(r) : fz_u16(r) * 16ull;
    }
    vp_vbar_t v = {pick_id(r, &wl.vbar)};
    vp_stream_t s = pick_wstream(r);
    W(true, vp_st_load(st, n, (b & 0x20) && n ? NULL : ind, v,
                       (b & 0x40) && n ? NULL : offs, s),
      "0x%llx, %zu, vbar 0x%llx, stream 0x%llx", X(st.id), n, X(v.id), X(s));
    break;
  }
  case 6: {
    const void *base;
    uint64_t size;
    int rc = W(false, vp_st_mmap(st, (b & 0x10) ? NULL : &base,
                                 (b & 0x20) ? NULL : &size), "0x%llx",
               X(st.id));
    if (rc == VP_OK && !(b & 0x30) && size && !base)
      fz_fail("vp_st_mmap: NULL base");
    break;
  }
  default: W(false, vp_st_drop_pages(st), "0x%llx", X(st.id));
  }
}

/* Close a device (usually the current one) and open another, whose
 * options the input may change; old handles stay in the pools. */
/* Close a device only once its streams are idle (the documented rule for
 * acquired weights; pinned pages are no different: close frees them
 * before it stops the streams, see README.md). */
static void w_sync_all(vp_device_t d) {
  fz_quiet = true;
  W(false, vp_stream_synchronize(d, 0), "0x%llx, 0", X(d.id));
  for (int i = 0; i < wl.s.n; i++)
    W(false, vp_stream_synchronize(d, wl.s.v[i]), "0x%llx, 0x%llx", X(d.id),
      X(wl.s.v[i]));
  fz_quiet = false;
}

static void w_close_reopen(fz_reader_t *r) {
  uint8_t b = fz_u8(r);
  vp_device_t d = pick_dev(r);
  w_sync_all(d);
  int rc = W(false, vp_device_close(d), "0x%llx", X(d.id));
  if (rc == VP_OK) forget_dev(d);
  if (rc || d.id != wl.cur.id) return;
  rc = W(false, vp_device_close(d), "0x%llx (again)", X(d.id));
  if (rc != VP_EHANDLE) fz_fail("a second vp_device_close gave %s",
                                vp_err_name(rc));
  cfg_t c = g.cfg;
  if (b & 1) c.worker = !c.worker;
  if ((b & 2) && !skip_fail_nth) c.fail_nth = 1 + fz_u8(r);
  else c.fail_nth = 0;
  if (b & 4) c.lookahead = 0;
  wl.cur = (vp_device_t){0};
  if (wild_open(&c, &wl.cur)) {
    g.cfg.worker = c.worker;
  }
}

enum {
  WOP_VBAR_CREATE, WOP_WEIGHTS_CREATE, WOP_ACQUIRE, WOP_ACQUIRE2, WOP_RELEASE,
  WOP_RELEASE2, WOP_FAULT, WOP_UNPIN, WOP_FREE, WOP_VBAR_MISC, WOP_DEVICE_MISC,
  WOP_STREAM, WOP_COPY, WOP_HOSTBUF, WOP_ST, WOP_CLOSE_REOPEN, WOP_COUNT
};

static void run_wild(fz_reader_t *r) {
  memset(&wl, 0, sizeof wl);
  if (!wild_open(&g.cfg, &wl.cur)) return;
  if (g.cfg.second_dev) {
    /* A second device, for foreign handles. */
    cfg_t c = g.cfg;
    c.fail_nth = 0;
    vp_device_t d2;
    if (wild_open(&c, &d2)) {
      vp_vbar_t v;
      vp_stream_t s;
      if (W(false, vp_vbar_create(d2, c.page * 2, &v), "second") == VP_OK) {
        push(&wl.vbar, v.id);
        uint64_t off = 0, size = 4096;
        vp_weight_t w;
        if (W(false, vp_weights_create(v, 1, &off, &size, NULL, &w),
              "second") == VP_OK)
          push(&wl.w, w.id);
      }
      if (W(false, vp_stream_create(d2, &s), "second") == VP_OK)
        push(&wl.s, s);
    }
  }
  unsigned ops = 0;
  while (fz_more(r) && ops++ < MAX_OPS) {
    fz_opno = g.op = ops;
    switch (fz_u8(r) % WOP_COUNT) {
    case WOP_VBAR_CREATE: w_vbar_create(r); break;
    case WOP_WEIGHTS_CREATE: w_weights_create(r); break;
    case WOP_ACQUIRE: case WOP_ACQUIRE2: w_acquire(r); break;
    case WOP_RELEASE: case WOP_RELEASE2: w_release(r); break;
    case WOP_FAULT: w_fault(r); break;
    case WOP_UNPIN: w_unpin(r); break;
    case WOP_FREE: w_free(r); break;
    case WOP_VBAR_MISC: w_vbar_misc(r); break;
    case WOP_DEVICE_MISC: w_device_misc(r); break;
    case WOP_STREAM: w_stream(r); break;
    case WOP_COPY: w_copy(r); break;
    case WOP_HOSTBUF: w_hostbuf(r); break;
    case WOP_ST: w_st(r); break;
    case WOP_CLOSE_REOPEN: w_close_reopen(r); break;
    }
  }
  for (int i = 0; i < wl.ndevs; i++) {
    w_sync_all(wl.devs[i]);
    int rc = W(false, vp_device_close(wl.devs[i]), "0x%llx (end)",
               X(wl.devs[i].id));
    if (rc) fz_fail("vp_device_close of an open device: %s", vp_err_name(rc));
  }
}

/* ---------------------------------------------------------- libFuzzer */

static void make_st_file(void) {
  /* Three tensors: a F32[2,2] (16 bytes), b.weight U8[5], zz F16[0]. */
  const char *hdr = "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],"
                    "\"data_offsets\":[0,16]},\"b.weight\":{\"dtype\":\"U8\","
                    "\"shape\":[5],\"data_offsets\":[16,21]},\"zz\":{\"dtype\":"
                    "\"F16\",\"shape\":[0],\"data_offsets\":[21,21]},"
                    "\"__metadata__\":{\"format\":\"pt\"}}";
  uint64_t hl = strlen(hdr);
  uint8_t len[8];
  for (int i = 0; i < 8; i++) len[i] = (uint8_t)(hl >> (8 * i));
  st_fd = memfd_create("vpager-fuzz-st", MFD_CLOEXEC);
  if (st_fd < 0) abort();
  if (write(st_fd, len, 8) != 8 || write(st_fd, hdr, hl) != (ssize_t)hl ||
      write(st_fd, arena, 21) != 21)
    abort();
  snprintf(st_path, sizeof st_path, "/proc/self/fd/%d", st_fd);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  vp_set_log_level(getenv("FUZZ_LOG") ? atoi(getenv("FUZZ_LOG"))
                                      : VP_LOG_NONE);
  fz_trace_live = getenv("FUZZ_TRACE") != NULL;
  fz_dump_on_death();
  skip_fake_destroy = fz_skip("fake-stream-destroy");
  skip_cross_release = fz_skip("cross-stream-release");
  skip_repeat_release = fz_skip("repeat-release");
  skip_empty_after_fail = fz_skip("empty-after-failed-acquire");
  skip_fail_nth = fz_skip("fail-nth");
  skip_set_source = fz_skip("set-source");
  arena = mmap(NULL, ARENA_SIZE, PROT_READ | PROT_WRITE,
               MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  rbuf = malloc(ARENA_SIZE);
  pbuf = malloc(ARENA_SIZE);
  if (arena == MAP_FAILED || !rbuf || !pbuf) abort();
  uint64_t x = 0x1234567;
  for (uint64_t i = 0; i < ARENA_SIZE; i += 8) {
    x = mix(x + i);
    memcpy(arena + i, &x, 8);
  }
  arena_fd = memfd_create("vpager-fuzz-arena", MFD_CLOEXEC);
  if (arena_fd < 0) abort();
  for (uint64_t done = 0; done < ARENA_SIZE;) {
    ssize_t n = write(arena_fd, arena + done, ARENA_SIZE - done);
    if (n <= 0) abort();
    done += (uint64_t)n;
  }
  make_st_file();
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fz_reader_t r = {data, size, 0};
  memset(&g, 0, sizeof g);
  atomic_store(&kern_bad, 0);
  fz_trace_reset();
  cfg_read(&r, &g.cfg);
  if (g.cfg.wild) {
    run_wild(&r);
  } else {
    run_strict(&r);
    if (g.open) {
      for (int s = 0; s < g.nS; s++)
        if (g.S[s].live) vp_stream_synchronize(g.dev, g.S[s].h);
      int rc = FZ_CALL(false, vp_device_close(g.dev), "end");
      CHECK(rc == VP_OK, "vp_device_close: %s", vp_err_name(rc));
      rc = FZ_CALL(false, vp_device_close(g.dev), "again");
      CHECK(rc == VP_EHANDLE, "second vp_device_close: %s", vp_err_name(rc));
      unsigned bad = atomic_load(&kern_bad);
      CHECK(!bad, "a kernel queued at op %u read wrong bytes", bad - 1);
    }
    scratch_drop(-1, 0, 0);
  }
  for (int i = 0; i < g.nW; i++) free(g.W[i].own);
  while (g.kerns) {
    kern_t *k = g.kerns;
    g.kerns = k->next;
    free(k);
  }
  return 0;
}
