/* Internal types and the index of internal functions, grouped by layer and
 * by the file that defines them. Nothing here is installed.
 *
 * Layers (src/layers.txt is the table `make check-layers` proves from the
 * object files): a file calls only files of lower layers, or files of its
 * own layer listed before it; nothing calls layer 4.
 *   L0  os_posix or os_win32 (the platform layer, os.h: the only files
 *       that include an OS header), diagnostics (log, error), options,
 *       json, registry, inject, shm (named shared-memory segments and
 *       their robust lock: shm.h)
 *   L1  backend/: the sim backend; vmm (the GPU operations) and its CUDA
 *       and HIP drivers; backend.c, their one door
 *   L2  handles, fence, budget, page, pager, stats, invariants, entry
 *   L3  ledger, release, ledger_view (the per-GPU ledger shared by
 *       processes), pins (the machine's pinned-host budget shared by
 *       processes), hostmem, weights, staging, fileio, stream, safetensors
 *   L4  device (open/close: the composition root) and api
 *
 * Glossary (see include/vpager.h for the public terms)
 *   vp__device_t  an open device: backend, lock, VBAR table, priority list,
 *                 budget, fence pool, counters.
 *   vp__vbar_t    a VBAR: its address range, pages, eviction order.
 *   vp__page_t    one page of a VBAR.
 *   vp__fence_t   a shared, reference-counted event recorded at unpin.
 *   vp__ask_t     what a fault that found no room needs from other
 *                 processes (pager.c fills it, release.c asks for it).
 *   vp__ledger_t  this device's membership of its GPU's ledger (ledger.h).
 */
#ifndef VPAGER_INTERNAL_H
#define VPAGER_INTERNAL_H

#include "os.h"
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "backend.h"
#include "vpager.h"

#define VP__MAX_DEVICES 64
#define VP__COMMIT_RETRIES 3 /* transient commit failures before a miss */

/* Handle ids: bits 0-5 device slot, 6-25 VBAR slot, 26-63 a serial unique in
 * the process, so a stale or foreign id never matches a live object. */
#define VP__SLOT_BITS 6
#define VP__VBAR_BITS 20
#define VP__SERIAL_SHIFT (VP__SLOT_BITS + VP__VBAR_BITS)

typedef struct vp__fence {
  vp__event_t event;
  vp_stream_t stream;      /* where it was recorded */
  uint64_t seq;            /* recording order on the device */
  uint32_t refs;           /* pages pointing at it */
  struct vp__fence *next;  /* free list */
} vp__fence_t;

typedef struct vp__page {
  vp__phys_t phys;
  vp__fence_t *fence; /* last unpin's fence; it implies all earlier ones */
  vp__fence_t *fill;  /* the copy stream's last write into it (prefetch):
                         kept apart, so it never hides a reader's fence */
  uint32_t gen;       /* generation of the current commit */
  uint32_t pins;
  bool resident;
} vp__page_t;

typedef struct vp__device vp__device_t;

/* A slot table of objects that start with their uint64_t id. */
typedef struct vp__table {
  void **slots;
  uint32_t n;
} vp__table_t;

typedef struct vp__vbar {
  uint64_t id;
  vp__device_t *dev;
  uint64_t va;       /* base device address */
  uint64_t size;     /* bytes, whole pages */
  uint64_t mirror;   /* reserved after the range for a second view of its
                        pages: 0 or size (the staging ring's) */
  bool mirrored;     /* every resident page has that second view */
  uint32_t npages;
  vp__page_t *pages;
  uint32_t *rank;    /* page -> rank (0 is evicted last) */
  uint32_t *order;   /* rank -> page */
  int order_kind;    /* vp_evict_order_t */
  /* Non-resident pages ranked >= min(watermark, limit) are misses. */
  uint32_t watermark;
  uint32_t limit;
  uint32_t resident; /* page counts */
  uint32_t pinned;
  struct vp__vbar *up, *down; /* priority list neighbours (up = higher) */
  bool listed;       /* in the priority list (internal VBARs are not) */
  vp_stats_t stats;
  uint64_t epoch;    /* counts page commits and evictions */
  /* weights.c: weights sorted by offset, the same in the order they were
   * created (the order of use a model gives them: what prefetch looks
   * ahead in, whatever their addresses), and how many are acquired */
  struct vp__weight **weights, **use;
  uint32_t nweights, weights_cap;
  uint32_t acquired;
  /* stream.c: the last prefetch scan of the whole VBAR found nothing to
   * copy, at pages epoch prefetch_epoch; a lost staging slot clears it. */
  bool prefetch_idle;
  uint64_t prefetch_epoch;
  /* stream.c: skip[i] = the first weight at or after vb->use[i] that a
   * prefetch scan must look at (skip[nweights] = nweights): the ones
   * between are resident with their last fill, not from prefetch, or have
   * no source. Built at pages epoch skip_epoch; skip_ok = false (a weight
   * added or removed, or a fill undone) rebuilds it. */
  uint32_t *skip;
  uint64_t skip_epoch;
  bool skip_ok;
  /* stream.c: the window of the last scan, weights [win_from, win_to) in
   * scan order (win_all: all of them; win_ring: it ended where the ring
   * was full), win_bytes of them needing copies, at pages epoch
   * win_epoch; win_used: bytes acquired since that were staged or copied
   * (what the window had queued, or a miss it did not cover). While
   * the next acquire is in the window, used < a chunk of the lookahead and
   * what is left of it still covers the lookahead less a chunk, nothing is
   * scanned: prefetch tops the window up a chunk at a time, in one batch
   * (merged copies, one fence), not a weight per acquire. win_ok = false:
   * scan at the next acquire (a miss, a lost slot, a fill undone).
   * win_freed: ring bytes released since the scan; when a window the ring
   * cut short gets a chunk of room back, the release scans from
   * acq_index (the use index of the last weight acquired), so the copy
   * engine need not wait for the next acquire (a forward's end). */
  uint32_t win_from, win_to, acq_index;
  bool win_all, win_ring, win_ok;
  /* stream.c: the last acquire's own lookahead (vp_acquire_ahead), which
   * the release top-up runs with; !acq_ahead_set: the window of
   * use[acq_index] (vp_weight_set_lookahead), else the device's. */
  bool acq_ahead_set;
  uint64_t acq_ahead;
  uint64_t win_epoch, win_bytes, win_used, win_freed;
  /* ledger.c: the label, the VBAR's entry in the ledger (index + 1; 0 =
   * none yet) and its last use (CLOCK_MONOTONIC_COARSE ns), stamped by the
   * public calls that use it, never by the pager's hot path. */
  char label[VP_LABEL_MAX];
  uint32_t ledger_entry;
  uint64_t last_use;
} vp__vbar_t;

typedef struct vp__budget {
  uint64_t poll_interval_ns;
  uint64_t last_poll_ns;   /* 0 = poll at the next check */
  uint64_t free_at_poll;   /* device-wide free memory at the last poll */
  uint64_t ours_at_poll;   /* our committed bytes at the last poll */
  uint64_t total;
  int64_t headroom;        /* what this handle keeps free */
  bool headroom_given;     /* by the options or vp_device_set_headroom */
  /* The headroom shared through the ledger: what this handle asks every
   * vpager process on the device to keep free (-1: its headroom), and the
   * largest that the device's other live participants ask (ledger.c). */
  int64_t shared_headroom;
  uint64_t peers_headroom;
  uint64_t limit;          /* cap on our own commits */
  bool over_limit;         /* the staging ring's commit: limit not applied */
} vp__budget_t;

/* A fault that found no room, for the ledger to take to other processes.
 * The caller of vp__fault picks the mode; make_room (pager.c) fills the
 * rest. FIRST: a shortfall other processes could cover makes vp__fault
 * return VP__ASK before anything is evicted, so the caller can ask them
 * without the device lock and fault again (api.c). AFTER: a budget miss
 * only records what was missing, to ask once the call is done (stream.c). */
enum { VP__ASK_OFF = 0, VP__ASK_FIRST = 1, VP__ASK_AFTER = 2 };
#define VP__ASK 2 /* vp__fault in mode FIRST: ask other processes first */

typedef struct vp__ask {
  int mode;
  bool pending;    /* a fault filled the fields below */
  uint64_t vbar;   /* the faulting VBAR's id */
  uint64_t target; /* device free memory that would let the fault commit */
  uint64_t own;    /* bytes the device's own eviction could add to that */
} vp__ask_t;

struct vp__ledger;

struct vp__device {
  uint64_t id;
  vp__os_mutex_t lock; /* guards everything below */
  const vp__backend_t *be;
  void *ctx;
  vp__caps_t caps;
  vp__inject_t inject;
  vp_options_t opts;
  uint64_t page_size;
  int page_shift;
  atomic_bool broken;   /* a backend call reported VP_EDEVICE */
  uint64_t committed;   /* bytes of pages we hold */
  uint32_t gen_counter;
  vp__table_t vbars;
  vp__vbar_t *top, *bottom; /* priority list */
  vp__budget_t budget;
  vp__fence_t *free_fences;
  uint64_t fence_seq;
  vp_stats_t stats;
  vp_stream_t *streams;   /* made by vp_stream_create, not yet destroyed */
  uint32_t nstreams, streams_cap;
  /* hostmem.c */
  uint64_t pin_budget;   /* host bytes we may page-lock */
  uint64_t pinned_host;  /* host bytes we have page-locked */
  vp__table_t hostbufs;
  uint32_t copies_unlocked; /* public copies being enqueued without the
                               device lock: no chunk is unpinned then */
  struct vp__pins *pins; /* pins.c: the machine's pin ledger (NULL: none) */
  /* weights.c, staging.c, stream.c */
  vp_stream_t copy_stream; /* 0 until first needed */
  uint64_t copy_done_seq;  /* the copy stream's fences up to this seq are
                              complete (they complete in order) */
  vp__table_t weights;
  struct vp__staging *staging;
  bool ring_over_said;     /* the ring went over the limit once: logged */
  bool ring_wrap_failed;   /* mapping the ring twice failed: logged, and
                              rings open without wrapping from then on */
  uint64_t lookahead;
  /* fileio.c, safetensors.c */
  struct vp__file_ring *file_ring;   /* the pager's reads (device lock) */
  /* The public readers' own ring (vp_file_read_to_*): reader_lock held
   * around it, the device lock only between preads (a read of a file must
   * not stall the device's faults); taken before the device lock. */
  struct vp__file_ring *reader_ring;
  vp__os_mutex_t reader_lock;
  vp__table_t sts;
  /* ledger.c, release.c: the device's membership of its GPU's ledger
   * (NULL: none; ledger_why says why), the framework allocator's
   * reservation it publishes, and the question a fault left. */
  struct vp__ledger *ledger;
  char ledger_why[192];
  uint64_t external_reserved;
  vp__ask_t ask;
};

/* ================================================================ L0 */

/* log.c */
void vp__log(int level, const char *who, const char *fmt, ...)
    VP__PRINTF(3, 4);
#define vp__log_on(level) ((level) <= vp_get_log_level())
void vp__log_set_level(int level);

/* error.c: messages start with the public call this thread is in. Every
 * public function begins with VP__ENTER(); lower layers never name one. */
void vp__api_enter(const char *fn);
#define VP__ENTER() vp__api_enter(__func__)
int vp__err(int code, const char *fmt, ...) VP__PRINTF(2, 3);
void vp__clear_error(void);
/* An argument check of a public function. */
#define VP__NEED(cond, what)                                                   \
  do {                                                                         \
    if (!(cond)) return vp__err(VP_EINVAL, "%s", what);                        \
  } while (0)

/* out.c: formatted text appended to buf[len]; pos counts what it would
 * need, also past the end. */
typedef struct vp__out {
  char *buf;
  size_t len, pos;
} vp__out_t;
void vp__put(vp__out_t *o, const char *fmt, ...) VP__PRINTF(2, 3);
/* A size as people read it, in one rule everywhere: "32 MiB", "1 GiB",
 * "1.5 GiB", "0 B" (the largest binary unit it reaches, one decimal when
 * not whole). The text lives in the returned value: vp__size(n).s is valid
 * until the end of the full expression. */
typedef struct vp__size_text {
  char s[24];
} vp__size_text_t;
vp__size_text_t vp__size(uint64_t bytes);

/* options.c */
void vp__options_defaults(vp_options_t *opts); /* and VPAGER_* variables */
int vp__options_check(const vp_options_t *opts);

/* registry.c: the table of open devices, which lets a stale device handle be
 * detected instead of dereferenced. */
int vp__registry_add(vp__device_t *dev);
void vp__registry_remove(vp__device_t *dev);
vp__device_t *vp__registry_get(uint64_t id);
uint64_t vp__serial_next(void);

/* ================================================================ L1 */

/* backend/backend.c: the only caller of a backend. Each vp__be_<op> calls
 * the device's backend and applies the broken-device rule (VP_EDEVICE marks
 * the device broken); codes as in backend.h, no message. */
int vp__be_open(vp__device_t *dev); /* picks the backend (message on error) */
/* Devices of backend `kind` (VP_BACKEND_CUDA or _SIM), none opened. */
int vp__be_device_count(int kind, int *count);
/* The platform's soft memory limit for us on dev (bytes, 0: none). */
int vp__be_soft_limit(vp__device_t *dev, uint64_t *bytes);
void vp__be_close(vp__device_t *dev);
const char *vp__be_error_detail(vp__device_t *dev); /* the driver's last */
int vp__be_nvml_info(vp__device_t *dev, uint64_t *dev_used,
                     uint64_t *dev_total, uint64_t *proc_used);
int vp__be_mem_info(vp__device_t *dev, uint64_t *free_bytes, uint64_t *total);
int vp__be_va_reserve(vp__device_t *dev, uint64_t size, uint64_t *va);
int vp__be_va_free(vp__device_t *dev, uint64_t va, uint64_t size);
int vp__be_phys_create(vp__device_t *dev, uint64_t size, vp__phys_t *phys);
int vp__be_phys_release(vp__device_t *dev, vp__phys_t phys, uint64_t size);
int vp__be_map(vp__device_t *dev, uint64_t va, uint64_t size, vp__phys_t phys);
int vp__be_unmap(vp__device_t *dev, uint64_t va, uint64_t size);
int vp__be_set_access(vp__device_t *dev, uint64_t va, uint64_t size);
int vp__be_stream_create(vp__device_t *dev, vp_stream_t *stream);
int vp__be_stream_destroy(vp__device_t *dev, vp_stream_t stream);
int vp__be_stream_synchronize(vp__device_t *dev, vp_stream_t stream);
int vp__be_synchronize(vp__device_t *dev); /* all work, every stream's */
int vp__be_stream_wait_event(vp__device_t *dev, vp_stream_t s, vp__event_t ev);
int vp__be_event_create(vp__device_t *dev, vp__event_t *ev);
int vp__be_event_destroy(vp__device_t *dev, vp__event_t ev);
int vp__be_event_record(vp__device_t *dev, vp__event_t ev, vp_stream_t stream);
int vp__be_event_query(vp__device_t *dev, vp__event_t ev);
int vp__be_event_synchronize(vp__device_t *dev, vp__event_t ev);
int vp__be_copy_htod(vp__device_t *dev, uint64_t dst, const void *src,
                     uint64_t size, vp_stream_t stream);
/* The backend's copy by SMs (backend.h); VP_EUNSUPPORTED where it has
 * none or cannot. */
int vp__be_copy_htod_sm(vp__device_t *dev, uint64_t dst, const void *src,
                        uint64_t size, vp_stream_t stream, uint32_t programs);
int vp__be_copy_dtoh(vp__device_t *dev, void *dst, uint64_t src, uint64_t size,
                     vp_stream_t stream);
int vp__be_host_register(vp__device_t *dev, void *ptr, uint64_t size);
int vp__be_host_unregister(vp__device_t *dev, void *ptr);
int vp__be_launch(vp__device_t *dev, vp_stream_t stream, void (*fn)(void *),
                  void *arg); /* VP_EUNSUPPORTED off the simulated device */
int vp__be_inject(vp__device_t *dev, int kind, uint64_t n);
/* The name of the physical device's ledger: "GPU-<uuid>" on CUDA,
 * "sim-<sim_shared>" on a shared simulated device; VP_EUNSUPPORTED when
 * the device has no identity others could share (an unshared sim). */
int vp__be_ledger_key(vp__device_t *dev, char *out, size_t len);

/* ================================================================ L2 */

/* handles.c: slot tables of objects found by id. */
int vp__table_add(vp__device_t *dev, vp__table_t *t, void *obj, uint64_t *id);
void *vp__table_get(const vp__table_t *t, uint64_t id);
void vp__table_remove(vp__table_t *t, uint64_t id);
void vp__table_free(vp__table_t *t);
/* Room for one more element in *arr (*cap elements of `size`, `used` in
 * use), doubling; VP_ENOMEM with a message. */
int vp__grow(vp__device_t *dev, void **arr, size_t *cap, size_t used,
             size_t size);

/* fence.c */
int vp__fence_get(vp__device_t *dev, vp_stream_t stream, vp__fence_t **out);
void vp__fence_put(vp__device_t *dev, vp__fence_t *f);
int vp__fence_wait(vp__device_t *dev, vp__fence_t *f);
void vp__fence_pool_free(vp__device_t *dev);

/* budget.c */
void vp__budget_init(vp__device_t *dev);
int vp__budget_allowed(vp__device_t *dev, uint64_t *allowed);
void vp__budget_invalidate(vp__device_t *dev);
/* Bytes kept free now: the larger of our headroom and the peers' shared
 * one. */
uint64_t vp__budget_kept(const vp__device_t *dev);
/* When more device free memory would let `want` more bytes be committed
 * (neither the limit nor the device's size is what stops it), the free
 * memory that would: *target. */
bool vp__budget_free_bound(vp__device_t *dev, uint64_t want,
                           uint64_t *target);

/* page.c: committing and evicting one page. */
int vp__page_commit(vp__vbar_t *vb, uint32_t p);
int vp__page_evict(vp__vbar_t *vb, uint32_t p);
/* A VBAR reserved with a mirror: its pages mapped a second time, page p at
 * va + size + p * page, so a range may run past its end into its start.
 * All or none: on error every page is mapped once again (the message
 * names the page). vp__page_evict unmaps a mirrored page's second view. */
int vp__vbar_mirror(vp__vbar_t *vb);
void vp__vbar_unmirror(vp__vbar_t *vb); /* every second view unmapped */

/* pager.c */
int vp__vbar_new(vp__device_t *dev, uint64_t size, vp__vbar_t **out);
/* A VBAR for the library's own use (the staging ring): not in the priority
 * list, so it is never chosen for eviction and never listed in reports.
 * mirror: its reservation runs its size further (vp__vbar_mirror). */
int vp__vbar_new_internal(vp__device_t *dev, uint64_t size, bool mirror,
                          vp__vbar_t **out);
int vp__vbar_check_free(const vp__vbar_t *vb); /* VP_EBUSY while pinned */
int vp__vbar_free(vp__vbar_t *vb);
void vp__pager_close(vp__device_t *dev); /* every VBAR, pinned or not */
/* The eviction order. mark (may be NULL) says which pages weights join:
 * mark[p] is GROUP_START where a weight starts a group, GROUP_JOINED where
 * a weight spans p and the page before; interleaved order then takes whole
 * groups. */
enum { VP__PAGE_GROUP_START = 1, VP__PAGE_GROUP_JOINED = 2 };
void vp__vbar_set_order(vp__vbar_t *vb, int kind, const uint8_t *mark);
int vp__vbar_set_ranks(vp__vbar_t *vb, const uint32_t *pages, size_t n);
void vp__vbar_to_top(vp__vbar_t *vb);
void vp__vbar_to_bottom(vp__vbar_t *vb);
/* VP_OK, VP_MISS, an error, or VP__ASK in dev->ask.mode FIRST. */
int vp__fault(vp__vbar_t *vb, uint32_t p0, uint32_t p1, uint32_t *gens);
int vp__unpin(vp__vbar_t *vb, uint32_t p0, uint32_t p1, vp_stream_t stream);
/* vp__unpin in steps, so one fence can serve many ranges: check pins, order
 * `stream` after other streams' fences on the pages, then (after recording
 * the fence on `stream`) attach it and drop the pins. */
int vp__unpin_check(vp__vbar_t *vb, uint32_t p0, uint32_t p1);
int vp__order_after(vp__vbar_t *vb, uint32_t p0, uint32_t p1,
                    vp_stream_t stream);
void vp__unpin_attach(vp__vbar_t *vb, uint32_t p0, uint32_t p1,
                      vp__fence_t *f);
/* The same for pages the copy stream filled: f (on the copy stream) goes to
 * the pages' fill fence; their readers' fence stays. */
void vp__unpin_attach_fill(vp__vbar_t *vb, uint32_t p0, uint32_t p1,
                           vp__fence_t *f);
void vp__unpin_nofence(vp__vbar_t *vb, uint32_t p0, uint32_t p1);
int vp__vbar_evict(vp__vbar_t *vb, uint64_t bytes, uint32_t min_rank,
                   uint64_t *freed);
int vp__device_evict(vp__device_t *dev, uint64_t bytes, uint64_t *freed);

/* stats.c */
int vp__report(vp__device_t *dev, int json, char *buf, size_t len,
               size_t *needed);

/* invariants.c: re-derive the page counts of every VBAR and of the device
 * from the page tables, check the staging ring and the prefetch skip
 * index; on a mismatch print a dump and abort. Called by
 * vp__unlock in debug builds (make DEBUG=1) only. */
void vp__check_invariants(vp__device_t *dev);

/* entry.c: find a handle and lock its device (VP_EHANDLE); the _enter forms
 * also refuse a broken device (VP_EDEVICE). vp__unlock returns rc. */
int vp__dev_lock(vp_device_t h, vp__device_t **out);
int vp__dev_enter(vp_device_t h, vp__device_t **out);
int vp__vbar_lock(vp_vbar_t h, vp__vbar_t **out);
int vp__vbar_enter(vp_vbar_t h, vp__vbar_t **out);
/* The live object `id` of the table at byte offset `table` of its device;
 * `what` names its kind in the message. */
int vp__handle_lock(uint64_t id, size_t table, const char *what,
                    vp__device_t **dev, void **out);
int vp__unlock(vp__device_t *dev, int rc);
int vp__broken(vp__device_t *dev); /* VP_EDEVICE with its message */
#define VP__DEVICE_ENTER(h, dev)                                               \
  do {                                                                         \
    int rc_ = vp__dev_enter(h, &dev);                                          \
    if (rc_) return rc_;                                                       \
  } while (0)
#define VP__VBAR_ENTER(h, vb)                                                  \
  do {                                                                         \
    int rc_ = vp__vbar_enter(h, &vb);                                          \
    if (rc_) return rc_;                                                       \
  } while (0)

/* ================================================================ L3 */

/* ledger.c: joining the GPU's ledger (never fatal: a device that cannot
 * join runs alone and says why in dev->ledger_why), leaving it, and
 * publishing the device's VBARs. _used stamps vb's last use and publishes
 * its entry; _sync publishes every VBAR (ranks, destroyed ones); both are
 * no-ops without a ledger and need the device lock. */
void vp__ledger_open(vp__device_t *dev);
void vp__ledger_close(vp__device_t *dev);
void vp__ledger_used(vp__device_t *dev, vp__vbar_t *vb);
void vp__ledger_sync(vp__device_t *dev);

/* ledger.c: the headroom shared through the ledger. _put
 * publishes ours and reads the peers' now (after a setting changed, and
 * at open); _refresh does the same at most every LEDGER_HEADROOM_NS (the
 * ledger's publishing calls it). Device lock held; no-ops without a
 * ledger. */
void vp__ledger_put_headroom(vp__device_t *dev);
void vp__ledger_refresh_headroom(vp__device_t *dev);

/* release.c: release requests between processes. The service thread
 * answers other processes' requests. vp__release_ask takes a fault's
 * question (a copy of dev->ask made under the lock) to the other
 * participants; it must be called without the device lock, which it takes
 * only between steps, and waits at most the ledger timeout per peer. */
int vp__release_start(vp__device_t *dev);
void vp__release_stop(vp__device_t *dev);
void vp__release_ask(vp__device_t *dev, const vp__ask_t *ask);
/* Whether another participant has anything to release (reads the
 * segment only; callable with the device lock held). */
bool vp__release_may_help(vp__device_t *dev);

/* pins.c: one pinned-host budget for the machine, counted in a host-wide
 * segment (NULL dev->pins: the device counts alone, against pin_budget).
 * open/close never fail; take (device lock held; lock-free across
 * processes) reserves `size` bytes within the machine's budget (false:
 * over it, or a forked child's copy; *budget and *used say why); put
 * gives bytes back; releasable
 * publishes a change of what this device could give back; ask (no device
 * lock held) has other participants give back pinned bytes until `size`
 * more would fit, through their `give` callback (called by their service
 * thread without the device lock), and returns the bytes they gave. */
typedef struct vp__pins vp__pins_t;
typedef uint64_t (*vp__pins_give_t)(vp__device_t *dev, uint64_t bytes);
uint64_t vp__pins_default_budget(void);
void vp__pins_open(vp__device_t *dev, vp__pins_give_t give);
void vp__pins_close(vp__device_t *dev);
uint64_t vp__pins_budget(const vp__device_t *dev);
void vp__pins_set_budget(vp__device_t *dev, uint64_t bytes);
uint64_t vp__pins_machine(const vp__device_t *dev); /* every process's */
bool vp__pins_take(vp__device_t *dev, uint64_t size, uint64_t *budget,
                   uint64_t *used);
void vp__pins_put(vp__device_t *dev, uint64_t size);
void vp__pins_releasable(vp__device_t *dev, int64_t delta);
bool vp__pins_may_help(const vp__device_t *dev);
uint64_t vp__pins_ask(vp__device_t *dev, uint64_t size);

/* hostmem.c: page-locking within the device's pin budget. *pinned says
 * whether it happened; failing to pin is not an error. */
void vp__hostmem_init(vp__device_t *dev);
void vp__hostmem_share(vp__device_t *dev); /* joins the pin ledger */
void vp__pin_host(vp__device_t *dev, void *ptr, uint64_t size, bool *pinned);
void vp__unpin_host(vp__device_t *dev, void *ptr, uint64_t size);
/* Page-aligned host memory, pinned if the budget allows (bounce slots). */
int vp__host_alloc(vp__device_t *dev, uint64_t size, void **ptr, bool *pinned);
void vp__host_free(vp__device_t *dev, void *ptr, uint64_t size, bool pinned);
void vp__hostmem_close(vp__device_t *dev); /* frees every hostbuf */
/* The id of the host buffer whose memory holds ptr, 0 if none (device lock
 * held): vpager's own registration, which vp_host_unregister refuses. */
uint64_t vp__hostbuf_holding(vp__device_t *dev, const void *ptr);
/* Host<->device copies split at host buffer chunk edges: CUDA refuses one
 * whose host range spans two registrations, or registered and unregistered
 * memory. locked: the caller holds the device lock. Backend codes, no
 * message. vp__host_piece (lock held): the bytes one copy may take. */
int vp__copy_htod(vp__device_t *dev, uint64_t dst, const void *src,
                  uint64_t size, vp_stream_t stream, bool locked);
/* vp__copy_htod with its pinned pieces read by `programs` blocks of SMs
 * where the backend can (0: the copy engine, as vp__copy_htod). */
int vp__copy_htod_sm(vp__device_t *dev, uint64_t dst, const void *src,
                     uint64_t size, vp_stream_t stream, bool locked,
                     uint32_t programs);
int vp__copy_dtoh(vp__device_t *dev, void *dst, uint64_t src, uint64_t size,
                  vp_stream_t stream, bool locked);
uint64_t vp__host_piece(vp__device_t *dev, const void *ptr, uint64_t size);

/* weights.c, staging.c, stream.c share these. */
typedef struct vp__slot vp__slot_t;

/* The acquires of one weight on one stream: a release on that stream ends
 * one of them, so each release fence covers the readers of what it ends. */
typedef struct vp__hold {
  vp_stream_t stream;
  uint32_t resident, staged; /* holding page pins / its staging slot */
} vp__hold_t;

#define FEW_HOLDS 2 /* streams per weight held without an allocation */

typedef struct vp__weight {
  uint64_t id;
  vp__vbar_t *vb;
  uint64_t offset, size;
  vp_source_t src;
  uint32_t p0, p1;        /* its pages */
  uint32_t *gens;         /* pages' generations when last filled; 0 = never */
  uint32_t acq_resident;  /* acquires holding page pins (all streams) */
  uint32_t acq_staged;    /* acquires holding its staging slot */
  vp__hold_t *holds;      /* per stream: few_holds or an allocation */
  uint32_t nholds, holds_cap;
  vp__hold_t few_holds[FEW_HOLDS];
  uint32_t listed;        /* vp_release: times the call lists it so far */
  vp__slot_t *slot;       /* staged copy, if any (acquired, cached or
                             prefetched) */
  vp__fence_t *copy_fence; /* copy stream fence of its last fill, until seen
                              complete */
  bool prefetched;        /* its fill or slot came from prefetch, unused */
  uint64_t lookahead;     /* the prefetch window after acquiring it;
                             VP_LOOKAHEAD_DEVICE: the device's */
  uint32_t index;         /* in vb->weights */
  uint32_t use_index;     /* in vb->use */
} vp__weight_t;

struct vp__slot {
  uint64_t off, size;
  vp__weight_t *owner; /* NULL once the weight let go of it */
  vp__fence_t *fence;  /* release fence: readers of the slot */
  uint32_t refs;       /* acquires holding it */
  bool prefetched;     /* filled ahead of need and not acquired yet */
  bool lent;           /* in lent memory: off is its device address */
  uint64_t used;       /* when last acquired or released (LRU) */
};

/* A range of the caller's device memory lent to the ring
 * (vp_device_lend_staging): slots are cut from it in order, never reused. */
typedef struct vp__lent {
  uint64_t addr, size, next;
} vp__lent_t;

typedef struct vp__staging {
  vp__vbar_t *vb;    /* internal VBAR, every page pinned; mirrored: the
                        ring wraps, its last slot may run past the end
                        into the start */
  uint64_t size;
  vp__slot_t **slots; /* sorted by offset */
  size_t n, cap;
  uint64_t clock;    /* ticks at each use, for LRU */
  uint64_t taken;    /* bytes in slots: no gap fits more than size - taken */
  uint64_t next;     /* where the last slot ended: prefetch allocates on
                        from here, so a batch's slots follow each other */
  vp__lent_t lent[VP_LENT_RANGES]; /* lent memory, nlent ranges */
  size_t nlent;
  bool lent_open;    /* a prefetch stages there first */
  vp__slot_t **lslots; /* the slots in lent memory, in order cut */
  size_t nlslots, lcap;
} vp__staging_t;


static inline bool vp__gens_equal(const vp__weight_t *w) {
  for (uint32_t p = w->p0; p < w->p1; p++)
    if (w->gens[p - w->p0] != w->vb->pages[p].gen) return false;
  return w->gens[0] != 0;
}

static inline bool vp__all_resident(const vp__weight_t *w) {
  for (uint32_t p = w->p0; p < w->p1; p++)
    if (!w->vb->pages[p].resident) return false;
  return true;
}

/* Resident with the bytes of its last fill: nothing to do ahead of use. */
static inline bool vp__ready_in_place(const vp__weight_t *w) {
  return vp__all_resident(w) && vp__gens_equal(w);
}

static inline void vp__gens_take(vp__weight_t *w) {
  for (uint32_t p = w->p0; p < w->p1; p++)
    w->gens[p - w->p0] = w->vb->pages[p].gen;
}


/* weights.c */
/* True while w's last fill may still be running on the copy stream. */
bool vp__weight_copy_pending(vp__device_t *dev, vp__weight_t *w);
/* vp_unpin drops only pins that faults took: VP_ENOTPINNED for a page whose
 * pins all belong to acquired weights. */
int vp__unpin_check_owned(const vp__vbar_t *vb, uint32_t p0, uint32_t p1);
vp__hold_t *vp__hold_find(const vp__weight_t *w, vp_stream_t stream);
/* w's hold on `stream`, added (empty) if it has none; vp__hold_trim forgets
 * it once it holds nothing. */
int vp__hold_get(vp__device_t *dev, vp__weight_t *w, vp_stream_t stream,
                 vp__hold_t **out);
void vp__hold_trim(vp__weight_t *w, vp_stream_t stream);
int vp__weights_find(vp__device_t *dev, const vp_weight_t *h, size_t n,
                     vp__weight_t **ws);
void vp__weights_set_order(vp__vbar_t *vb, int kind); /* vp__vbar_set_order
                                                          told the weights */
int vp__weights_vbar_destroy(vp__vbar_t *vb); /* with its weights */
void vp__weights_close(vp__device_t *dev);

/* staging.c: the ring and the copy stream. */
int vp__copy_stream(vp__device_t *dev, vp_stream_t *out);
int vp__staging_open(vp__device_t *dev);
/* Whether the ring's slots wrap (its own, or the next one's to open). */
bool vp__staging_wraps(const vp__device_t *dev);
/* The sizes of the weights a prefetch means to stage after the one it asks
 * a slot for, in its order (a few): in lent memory of several ranges, the
 * slot goes where the most of them still find room. */
#define VP_LENT_AHEAD 8
typedef struct vp__ahead {
  uint64_t size[VP_LENT_AHEAD];
  size_t n;
} vp__ahead_t;
/* A slot for w. VP_MISS when the ring has no room (for prefetch, which never
 * drops other prefetched slots); VP_ELIMIT for an acquire. ahead: NULL, or
 * what the prefetch stages next (vp__ahead_t). */
int vp__ring_alloc(vp__device_t *dev, vp__weight_t *w, bool prefetch,
                   const vp__ahead_t *ahead, vp__slot_t **out);
uint64_t vp__slot_addr(vp__device_t *dev, const vp__slot_t *s);
bool vp__staging_holds(vp__device_t *dev, uint64_t addr, uint64_t size);
/* Whether a copy to dst continues one that ends at `end`: dst is `end`, or
 * in a ring that wraps, dst in it is `end` seen through its second view
 * (a copy there may run on across the seam). */
bool vp__staging_continues(vp__device_t *dev, uint64_t end, uint64_t dst);
/* The device range [addr, +size) a caller may write or read: all pinned in
 * one VBAR, or in a staging slot an acquire holds (VP_ENOTPINNED/ERANGE). */
int vp__pinned_range(vp__device_t *dev, uint64_t addr, uint64_t size);
/* Lent memory (vp_device_lend_staging, vp_device_reclaim_staging). */
int vp__staging_lend(vp__device_t *dev, uint64_t addr, uint64_t size,
                     vp_stream_t stream);
int vp__staging_reclaim(vp__device_t *dev, vp_stream_t stream, bool force);
/* The ring given back, once the copy stream and the ring's readers are
 * done (the copy stream stays); VP_EBUSY while an acquire holds a slot. */
int vp__staging_free(vp__device_t *dev);
void vp__staging_close(vp__device_t *dev);

/* fileio.c: copy a file region to device memory at dst in `stream` order
 * through the device's pinned bounce ring (made on first use). `what`
 * names the file in messages. Checks the file has not changed size. */
int vp__file_read(vp__device_t *dev, int fd, uint64_t offset, uint64_t size,
                  uint64_t dst, vp_stream_t stream, const char *what);
void vp__fileio_close(vp__device_t *dev);
/* pread all n bytes: 0, an errno, or -1 if the file ends first. */
int vp__pread_exact(int fd, void *buf, uint64_t n, uint64_t off,
                    uint64_t *got);

/* safetensors.c */
void vp__st_close_all(vp__device_t *dev);

/* Count an event on both the VBAR and its device. */
#define VP__COUNT(vb, field, n)                                                \
  do {                                                                         \
    (vb)->stats.field += (n);                                                  \
    (vb)->dev->stats.field += (n);                                             \
  } while (0)

#endif /* VPAGER_INTERNAL_H */
