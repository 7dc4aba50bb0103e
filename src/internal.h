/* Internal types and the index of internal functions, grouped by the file
 * that defines them. Nothing here is installed.
 *
 * Glossary (see include/vpager.h for the public terms)
 *   vp__device_t  an open device: backend, lock, VBAR table, priority list,
 *                 budget, fence pool, counters.
 *   vp__vbar_t    a VBAR: its address range, pages, eviction order.
 *   vp__page_t    one page of a VBAR.
 *   vp__fence_t   a shared, reference-counted event recorded at unpin.
 */
#ifndef VPAGER_INTERNAL_H
#define VPAGER_INTERNAL_H

#include <pthread.h>
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
  /* stream.c: weights sorted by offset, and how many are acquired */
  struct vp__weight **weights;
  uint32_t nweights, weights_cap;
  uint32_t acquired;
  /* The last prefetch scan of the whole VBAR found nothing to copy; page
   * commits and evictions and lost staging slots clear it. */
  bool prefetch_idle;
} vp__vbar_t;

typedef struct vp__budget {
  uint64_t poll_interval_ns;
  uint64_t last_poll_ns;   /* 0 = poll at the next check */
  uint64_t free_at_poll;   /* device-wide free memory at the last poll */
  uint64_t ours_at_poll;   /* our committed bytes at the last poll */
  uint64_t total;
  int64_t headroom;
  uint64_t limit;          /* cap on our own commits */
} vp__budget_t;

struct vp__device {
  uint64_t id;
  pthread_mutex_t lock; /* guards everything below */
  const vp__backend_t *be;
  void *ctx;
  vp__caps_t caps;
  vp__inject_t inject;
  vp_options_t opts;
  uint64_t page_size;
  int page_shift;
  bool broken;          /* a backend call reported VP_EDEVICE */
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
  /* stream.c */
  vp_stream_t copy_stream; /* 0 until first needed */
  vp__table_t weights;
  struct vp__staging *staging;
  uint64_t lookahead;
  /* fileio.c, safetensors.c */
  struct vp__file_ring *file_ring;
  vp__table_t sts;
};

/* error.c */
int vp__err(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void vp__clear_error(void);

/* log.c */
void vp__log(int level, const char *who, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
#define vp__log_on(level) ((level) <= vp_get_log_level())

/* options.c */
int vp__options_check(const vp_options_t *opts);

/* registry.c: the table of open devices, which lets a stale device handle be
 * detected instead of dereferenced. */
int vp__registry_add(vp__device_t *dev);
void vp__registry_remove(vp__device_t *dev);
vp__device_t *vp__registry_get(uint64_t id);
uint64_t vp__serial_next(void);

/* handles.c */
int vp__table_add(vp__device_t *dev, vp__table_t *t, void *obj, uint64_t *id);
void *vp__table_get(const vp__table_t *t, uint64_t id);
void vp__table_remove(vp__table_t *t, uint64_t id);
void vp__table_free(vp__table_t *t);
int vp__handle_enter(uint64_t id, size_t table, const char *fn,
                     const char *what, vp__device_t **dev, void **out);

/* pager.c */
int vp__device_create(const vp_options_t *opts, vp__device_t **out);
void vp__device_destroy(vp__device_t *dev);
int vp__vbar_new(vp__device_t *dev, uint64_t size, vp__vbar_t **out);
int vp__vbar_free(vp__vbar_t *vb);
void vp__vbar_set_order(vp__vbar_t *vb, int kind);
/* stream.c: mark[p] for each page of vb that a weight touches: GROUP_START,
 * or GROUP_JOINED when a weight spans it and the page before. */
enum { VP__PAGE_GROUP_START = 1, VP__PAGE_GROUP_JOINED = 2 };
void vp__weights_mark_pages(const vp__vbar_t *vb, uint8_t *mark);
void vp__vbar_to_top(vp__vbar_t *vb);
void vp__vbar_to_bottom(vp__vbar_t *vb);
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
void vp__unpin_nofence(vp__vbar_t *vb, uint32_t p0, uint32_t p1);
/* A VBAR for the library's own use (the staging ring): not in the priority
 * list, so it is never chosen for eviction and never listed in reports. */
int vp__vbar_new_internal(vp__device_t *dev, uint64_t size, vp__vbar_t **out);
int vp__vbar_evict(vp__vbar_t *vb, uint64_t bytes, uint32_t min_rank,
                   uint64_t *freed);
int vp__device_evict(vp__device_t *dev, uint64_t bytes, uint64_t *freed);

/* api.c: look up a handle and lock its device (VP_EHANDLE, or VP_EDEVICE
 * for a broken device); vp__unlock returns rc. */
int vp__dev_enter(vp_device_t h, const char *fn, vp__device_t **out);
int vp__vbar_enter(vp_vbar_t h, const char *fn, vp__vbar_t **out);
int vp__unlock(vp__device_t *dev, int rc);
/* The VBAR range [addr, +size) must be pinned (VP_ENOTPINNED/VP_ERANGE). */
int vp__pinned_range(vp__device_t *dev, uint64_t addr, uint64_t size,
                     const char *fn);

/* hostmem.c: page-locking within the device's pin budget. *pinned says
 * whether it happened; failing to pin is not an error. */
void vp__hostmem_init(vp__device_t *dev);
void vp__pin_host(vp__device_t *dev, void *ptr, uint64_t size, bool *pinned);
void vp__unpin_host(vp__device_t *dev, void *ptr, uint64_t size);
/* Page-aligned host memory, pinned if the budget allows (bounce slots). */
int vp__host_alloc(vp__device_t *dev, uint64_t size, void **ptr, bool *pinned);
void vp__host_free(vp__device_t *dev, void *ptr, uint64_t size, bool pinned);
void vp__hostmem_close(vp__device_t *dev); /* frees every hostbuf */
/* Host<->device copies split at host buffer chunk edges: CUDA refuses one
 * whose host range spans two registrations, or registered and unregistered
 * memory. locked: the caller holds the device lock. Backend codes, no
 * message. vp__host_piece (lock held): the bytes one copy may take. */
int vp__copy_htod(vp__device_t *dev, uint64_t dst, const void *src,
                  uint64_t size, vp_stream_t stream, bool locked);
int vp__copy_dtoh(vp__device_t *dev, void *dst, uint64_t src, uint64_t size,
                  vp_stream_t stream, bool locked);
uint64_t vp__host_piece(vp__device_t *dev, const void *ptr, uint64_t size);

/* stream.c */
int vp__copy_stream(vp__device_t *dev, vp_stream_t *out);
bool vp__staging_holds(vp__device_t *dev, uint64_t addr, uint64_t size);
void vp__weights_drop_vbar(vp__vbar_t *vb); /* its weights, at destroy */
void vp__stream_close(vp__device_t *dev);

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

/* page.c: the only file that calls the backend's memory operations. */
int vp__page_commit(vp__vbar_t *vb, uint32_t p);
int vp__page_evict(vp__vbar_t *vb, uint32_t p);
int vp__be_result(vp__device_t *dev, int rc, const char *what);

/* fence.c */
int vp__fence_get(vp__device_t *dev, vp_stream_t stream, vp__fence_t **out);
void vp__fence_put(vp__device_t *dev, vp__fence_t *f);
int vp__fence_wait(vp__device_t *dev, vp__fence_t *f);
void vp__fence_pool_free(vp__device_t *dev);

/* budget.c */
void vp__budget_init(vp__device_t *dev);
int vp__budget_allowed(vp__device_t *dev, uint64_t *allowed);
void vp__budget_invalidate(vp__device_t *dev);
uint64_t vp__now_ns(void);

/* stats.c */
int vp__report(vp__device_t *dev, int json, char *buf, size_t len,
               size_t *needed);

/* Count an event on both the VBAR and its device. */
#define VP__COUNT(vb, field, n)                                                \
  do {                                                                         \
    (vb)->stats.field += (n);                                                  \
    (vb)->dev->stats.field += (n);                                             \
  } while (0)

#endif /* VPAGER_INTERNAL_H */
