/* The public API: argument and handle validation, the device lock, and the
 * messages for vp_last_error(). The work itself is in pager.c. */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define ULL(x) ((unsigned long long)(x))

/* ------------------------------------------------------------ handles */

/* Look up and lock the device of handle h. */
static int device_lock(vp_device_t h, const char *fn, vp__device_t **out) {
  vp__device_t *dev = vp__registry_get(h.id);
  if (!dev || dev->id != h.id)
    return vp__err(VP_EHANDLE, "%s: device handle 0x%llx is not an open "
                   "device", fn, ULL(h.id));
  pthread_mutex_lock(&dev->lock);
  *out = dev;
  return VP_OK;
}

/* Look up a VBAR and lock its device. */
static int vbar_lock(vp_vbar_t h, const char *fn, vp__vbar_t **out) {
  vp__device_t *dev;
  return vp__handle_enter(h.id, offsetof(vp__device_t, vbars), fn, "VBAR",
                          &dev, (void **)out);
}

static int unlock(vp__device_t *dev, int rc) {
  pthread_mutex_unlock(&dev->lock);
  return rc;
}

int vp__unlock(vp__device_t *dev, int rc) { return unlock(dev, rc); }

static int broken(vp__device_t *dev, const char *fn) {
  return vp__err(VP_EDEVICE, "%s: the %s device is broken; close it", fn,
                 dev->caps.name);
}

#define NEED(cond, fn, what)                                                   \
  do {                                                                         \
    if (!(cond)) return vp__err(VP_EINVAL, "%s: %s", fn, what);                \
  } while (0)

/* Lock the VBAR's device; fail if the device is broken. */
#define VBAR_ENTER(h, fn, vb)                                                  \
  do {                                                                         \
    int rc_ = vbar_lock(h, fn, &vb);                                           \
    if (rc_) return rc_;                                                       \
    if (vb->dev->broken) return unlock(vb->dev, broken(vb->dev, fn));          \
  } while (0)

#define DEVICE_ENTER(h, fn, dev)                                               \
  do {                                                                         \
    int rc_ = device_lock(h, fn, &dev);                                        \
    if (rc_) return rc_;                                                       \
    if (dev->broken) return unlock(dev, broken(dev, fn));                      \
  } while (0)

int vp__dev_enter(vp_device_t h, const char *fn, vp__device_t **out) {
  vp__device_t *dev = NULL;
  DEVICE_ENTER(h, fn, dev);
  *out = dev;
  return VP_OK;
}

int vp__vbar_enter(vp_vbar_t h, const char *fn, vp__vbar_t **out) {
  vp__vbar_t *vb = NULL;
  VBAR_ENTER(h, fn, vb);
  *out = vb;
  return VP_OK;
}

/* ------------------------------------------------------------- device */

int vp_device_open(const vp_options_t *opts, vp_device_t *out) {
  NEED(out, "vp_device_open", "out is NULL");
  vp_options_t defaults;
  if (!opts) {
    vp_options_init(&defaults);
    opts = &defaults;
  }
  vp__device_t *dev = NULL;
  int rc = vp__device_create(opts, &dev);
  if (rc) return rc;
  out->id = dev->id;
  return VP_OK;
}

int vp_device_close(vp_device_t h) {
  vp__device_t *dev = NULL;
  int rc = device_lock(h, "vp_device_close", &dev);
  if (rc) return rc;
  pthread_mutex_unlock(&dev->lock);
  vp__device_destroy(dev);
  return VP_OK;
}

const char *vp_device_backend(vp_device_t h) {
  vp__device_t *dev = NULL;
  if (device_lock(h, "vp_device_backend", &dev)) return NULL;
  const char *name = dev->caps.name;
  unlock(dev, VP_OK);
  return name;
}

int vp_device_info(vp_device_t h, vp_device_info_t *info) {
  NEED(info, "vp_device_info", "info is NULL");
  vp__device_t *dev = NULL;
  DEVICE_ENTER(h, "vp_device_info", dev);
  uint64_t allowed;
  int rc = vp__budget_allowed(dev, &allowed);
  if (rc) return unlock(dev, vp__err(rc, "vp_device_info: polling free "
                                     "memory failed"));
  *info = (vp_device_info_t){
      .page_size = dev->page_size,
      .granularity = dev->caps.granularity,
      .total_memory = dev->budget.total,
      .free_memory = dev->budget.free_at_poll,
      .committed = dev->committed,
      .budget = allowed,
      .headroom = dev->budget.headroom,
      .async_copies = dev->caps.async_copies,
  };
  return unlock(dev, VP_OK);
}

int vp_device_set_headroom(vp_device_t h, int64_t bytes) {
  vp__device_t *dev = NULL;
  if (bytes < 0)
    return vp__err(VP_EINVAL, "vp_device_set_headroom: %lld is negative",
                   (long long)bytes);
  DEVICE_ENTER(h, "vp_device_set_headroom", dev);
  dev->budget.headroom = bytes;
  return unlock(dev, VP_OK);
}

int vp_device_set_limit(vp_device_t h, uint64_t bytes) {
  vp__device_t *dev = NULL;
  DEVICE_ENTER(h, "vp_device_set_limit", dev);
  dev->budget.limit = bytes;
  return unlock(dev, VP_OK);
}

int vp_device_free_memory(vp_device_t h, uint64_t bytes, uint64_t *freed) {
  vp__device_t *dev = NULL;
  DEVICE_ENTER(h, "vp_device_free_memory", dev);
  uint64_t done = 0;
  int rc = vp__device_evict(dev, bytes, &done);
  if (freed) *freed = done;
  return unlock(dev, rc);
}

int vp_device_reclaimable(vp_device_t h, uint64_t *bytes) {
  NEED(bytes, "vp_device_reclaimable", "bytes is NULL");
  vp__device_t *dev = NULL;
  DEVICE_ENTER(h, "vp_device_reclaimable", dev);
  uint64_t pages = 0;
  for (vp__vbar_t *vb = dev->top; vb; vb = vb->down)
    pages += vb->resident - vb->pinned;
  *bytes = pages << dev->page_shift;
  return unlock(dev, VP_OK);
}

int vp_device_reset_limits(vp_device_t h) {
  vp__device_t *dev = NULL;
  DEVICE_ENTER(h, "vp_device_reset_limits", dev);
  for (vp__vbar_t *vb = dev->top; vb; vb = vb->down) vb->limit = vb->npages;
  return unlock(dev, VP_OK);
}

/* ------------------------------------------------------------ streams */

/* The streams vp_stream_create made, which alone vp_stream_destroy takes. */
static int streams_add(vp__device_t *dev, vp_stream_t s) {
  if (dev->nstreams == dev->streams_cap) {
    uint32_t cap = dev->streams_cap ? dev->streams_cap * 2 : 8;
    vp_stream_t *l = NULL;
    if (vp__inject_fail(&dev->inject) ||
        !(l = realloc(dev->streams, cap * sizeof *l)))
      return vp__err(VP_ENOMEM, "vp_stream_create: no memory for the "
                     "stream list");
    dev->streams = l;
    dev->streams_cap = cap;
  }
  dev->streams[dev->nstreams++] = s;
  return VP_OK;
}

static bool streams_remove(vp__device_t *dev, vp_stream_t s) {
  for (uint32_t i = 0; i < dev->nstreams; i++)
    if (dev->streams[i] == s) {
      dev->streams[i] = dev->streams[--dev->nstreams];
      return true;
    }
  return false;
}

int vp_stream_create(vp_device_t h, vp_stream_t *out) {
  NEED(out, "vp_stream_create", "out is NULL");
  vp__device_t *dev = NULL;
  DEVICE_ENTER(h, "vp_stream_create", dev);
  vp_stream_t s = 0;
  int rc = dev->be->stream_create(dev->ctx, &s);
  if (rc) {
    rc = vp__err(vp__be_result(dev, rc, "stream_create"),
                 "vp_stream_create: the %s backend failed", dev->caps.name);
  } else if ((rc = streams_add(dev, s))) {
    dev->be->stream_destroy(dev->ctx, s);
  } else {
    *out = s;
  }
  return unlock(dev, rc);
}

int vp_stream_destroy(vp_device_t h, vp_stream_t stream) {
  NEED(stream != 0, "vp_stream_destroy",
       "stream 0 is the default stream and cannot be destroyed");
  vp__device_t *dev = NULL;
  int rc = device_lock(h, "vp_stream_destroy", &dev);
  if (rc) return rc;
  if (!streams_remove(dev, stream))
    return unlock(dev, vp__err(VP_EINVAL, "vp_stream_destroy: stream 0x%llx "
                               "was not made by vp_stream_create on this "
                               "device, or is destroyed", ULL(stream)));
  unlock(dev, VP_OK); /* destroying waits for the stream's work */
  rc = dev->be->stream_destroy(dev->ctx, stream);
  if (rc) return vp__err(rc, "vp_stream_destroy: stream 0x%llx: %s",
                         ULL(stream), vp_strerror(rc));
  return VP_OK;
}

int vp_stream_synchronize(vp_device_t h, vp_stream_t stream) {
  vp__device_t *dev = NULL;
  int rc = device_lock(h, "vp_stream_synchronize", &dev);
  if (rc) return rc;
  unlock(dev, VP_OK); /* waiting must not hold the device */
  rc = dev->be->stream_synchronize(dev->ctx, stream);
  if (rc) return vp__err(rc, "vp_stream_synchronize: stream 0x%llx: %s",
                         ULL(stream), vp_strerror(rc));
  return VP_OK;
}

/* The VBAR holding [addr, addr+size), if every page of it is pinned. */
int vp__pinned_range(vp__device_t *dev, uint64_t addr, uint64_t size,
                     const char *fn) {
  if (size == 0) return vp__err(VP_EINVAL, "%s: size is 0", fn);
  for (vp__vbar_t *vb = dev->top; vb; vb = vb->down) {
    if (addr < vb->va || addr - vb->va >= vb->size) continue;
    uint64_t off = addr - vb->va;
    if (size > vb->size - off)
      return vp__err(VP_ERANGE, "%s: [0x%llx, +%llu) runs past its VBAR", fn,
                     ULL(addr), ULL(size));
    for (uint64_t p = off >> dev->page_shift;
         p <= (off + size - 1) >> dev->page_shift; p++)
      if (!vb->pages[p].pins)
        return vp__err(VP_ENOTPINNED, "%s: page %llu of the range at 0x%llx "
                       "is not pinned", fn, ULL(p), ULL(addr));
    VP__COUNT(vb, bytes_copied, size);
    return VP_OK;
  }
  if (vp__staging_holds(dev, addr, size)) {
    dev->stats.bytes_copied += size;
    return VP_OK;
  }
  return vp__err(VP_ERANGE, "%s: 0x%llx is in no VBAR of this device", fn,
                 ULL(addr));
}

int vp_copy_to_device(vp_device_t h, uint64_t dst, const void *src,
                      uint64_t size, vp_stream_t stream) {
  NEED(src, "vp_copy_to_device", "src is NULL");
  vp__device_t *dev = NULL;
  DEVICE_ENTER(h, "vp_copy_to_device", dev);
  int rc = unlock(dev, vp__pinned_range(dev, dst, size, "vp_copy_to_device"));
  if (rc) return rc;
  rc = vp__copy_htod(dev, dst, src, size, stream, false);
  if (rc) return vp__err(rc, "vp_copy_to_device: %llu bytes to 0x%llx on "
                         "stream 0x%llx failed", ULL(size), ULL(dst),
                         ULL(stream));
  return VP_OK;
}

int vp_copy_to_host(vp_device_t h, void *dst, uint64_t src, uint64_t size,
                    vp_stream_t stream) {
  NEED(dst, "vp_copy_to_host", "dst is NULL");
  vp__device_t *dev = NULL;
  DEVICE_ENTER(h, "vp_copy_to_host", dev);
  int rc = unlock(dev, vp__pinned_range(dev, src, size, "vp_copy_to_host"));
  if (rc) return rc;
  rc = vp__copy_dtoh(dev, dst, src, size, stream, false);
  if (rc) return vp__err(rc, "vp_copy_to_host: %llu bytes from 0x%llx on "
                         "stream 0x%llx failed", ULL(size), ULL(src),
                         ULL(stream));
  return VP_OK;
}

int vp_sim_launch(vp_device_t h, vp_stream_t stream, void (*fn)(void *),
                  void *arg) {
  NEED(fn, "vp_sim_launch", "fn is NULL");
  vp__device_t *dev = NULL;
  DEVICE_ENTER(h, "vp_sim_launch", dev);
  unlock(dev, VP_OK);
  if (!dev->be->launch)
    return vp__err(VP_EUNSUPPORTED, "vp_sim_launch: the %s backend runs no "
                   "host functions", dev->caps.name);
  int rc = dev->be->launch(dev->ctx, stream, fn, arg);
  if (rc) return vp__err(rc, "vp_sim_launch: stream 0x%llx", ULL(stream));
  return VP_OK;
}

int vp_sim_inject(vp_device_t h, int kind, uint64_t n) {
  vp__device_t *dev = NULL;
  int rc = device_lock(h, "vp_sim_inject", &dev);
  if (rc) return rc;
  if (!dev->be->inject)
    return unlock(dev, vp__err(VP_EUNSUPPORTED, "vp_sim_inject: the %s "
                               "backend has no fault injection",
                               dev->caps.name));
  rc = dev->be->inject(dev->ctx, kind, n);
  if (rc) return unlock(dev, vp__err(rc, "vp_sim_inject: kind %d", kind));
  vp__budget_invalidate(dev); /* capacity may have changed */
  return unlock(dev, VP_OK);
}

/* --------------------------------------------------------------- VBAR */

int vp_vbar_create(vp_device_t h, uint64_t size, vp_vbar_t *out) {
  NEED(out, "vp_vbar_create", "out is NULL");
  if (size == 0) return vp__err(VP_EINVAL, "vp_vbar_create: size is 0");
  vp__device_t *dev = NULL;
  DEVICE_ENTER(h, "vp_vbar_create", dev);
  vp__vbar_t *vb = NULL;
  int rc = vp__vbar_new(dev, size, &vb);
  if (rc == VP_OK) out->id = vb->id;
  return unlock(dev, rc);
}

int vp_vbar_destroy(vp_vbar_t h) {
  vp__vbar_t *vb = NULL;
  int rc = vbar_lock(h, "vp_vbar_destroy", &vb);
  if (rc) return rc;
  vp__device_t *dev = vb->dev;
  return unlock(dev, vp__vbar_free(vb));
}

/* Read one field of a VBAR. */
#define VBAR_GETTER(fname, type, expr)                                         \
  int fname(vp_vbar_t h, type *out) {                                          \
    NEED(out, #fname, "out is NULL");                                          \
    vp__vbar_t *vb;                                                            \
    int rc = vbar_lock(h, #fname, &vb);                                        \
    if (rc) return rc;                                                         \
    *out = (expr);                                                             \
    return unlock(vb->dev, VP_OK);                                             \
  }

VBAR_GETTER(vp_vbar_base, uint64_t, vb->va)
VBAR_GETTER(vp_vbar_size, uint64_t, vb->size)
VBAR_GETTER(vp_vbar_page_count, uint64_t, vb->npages)
VBAR_GETTER(vp_vbar_device, vp_device_t, (vp_device_t){vb->dev->id})
VBAR_GETTER(vp_vbar_get_watermark, uint64_t, vb->watermark)
VBAR_GETTER(vp_vbar_get_watermark_limit, uint64_t, vb->limit)
VBAR_GETTER(vp_vbar_loaded_size, uint64_t,
            (uint64_t)vb->resident << vb->dev->page_shift)

int vp_vbar_prioritize(vp_vbar_t h) {
  vp__vbar_t *vb = NULL;
  VBAR_ENTER(h, "vp_vbar_prioritize", vb);
  vp__vbar_to_top(vb);
  vb->watermark = vb->npages;
  return unlock(vb->dev, VP_OK);
}

int vp_vbar_deprioritize(vp_vbar_t h) {
  vp__vbar_t *vb = NULL;
  VBAR_ENTER(h, "vp_vbar_deprioritize", vb);
  vp__vbar_to_bottom(vb);
  return unlock(vb->dev, VP_OK);
}

int vp_vbar_set_order(vp_vbar_t h, int order) {
  if (order != VP_ORDER_TAIL_FIRST && order != VP_ORDER_INTERLEAVED)
    return vp__err(VP_EINVAL, "vp_vbar_set_order: order %d is unknown", order);
  vp__vbar_t *vb = NULL;
  VBAR_ENTER(h, "vp_vbar_set_order", vb);
  if (vb->resident)
    return unlock(vb->dev, vp__err(VP_EBUSY, "vp_vbar_set_order: %u pages "
                                   "are resident; free them first",
                                   vb->resident));
  vp__vbar_set_order(vb, order);
  return unlock(vb->dev, VP_OK);
}

int vp_vbar_set_watermark(vp_vbar_t h, uint64_t bytes) {
  vp__vbar_t *vb = NULL;
  VBAR_ENTER(h, "vp_vbar_set_watermark", vb);
  uint64_t pages = bytes >> vb->dev->page_shift;
  if (pages > vb->npages)
    return unlock(vb->dev, vp__err(VP_ERANGE, "vp_vbar_set_watermark: %llu "
                                   "bytes is more than the VBAR's %llu",
                                   ULL(bytes), ULL(vb->size)));
  vb->watermark = (uint32_t)pages;
  return unlock(vb->dev, VP_OK);
}

int vp_vbar_set_watermark_limit(vp_vbar_t h, uint64_t bytes) {
  vp__vbar_t *vb = NULL;
  VBAR_ENTER(h, "vp_vbar_set_watermark_limit", vb);
  uint64_t pages = bytes >> vb->dev->page_shift;
  vb->limit = pages < vb->npages ? (uint32_t)pages : vb->npages;
  return unlock(vb->dev, VP_OK);
}

/* Pages [*p0, *p1) of the range, or VP_EINVAL / VP_ERANGE. */
static int page_range(vp__vbar_t *vb, uint64_t off, uint64_t size,
                      const char *fn, uint32_t *p0, uint32_t *p1) {
  if (size == 0) return vp__err(VP_EINVAL, "%s: size is 0", fn);
  if (off >= vb->size || size > vb->size - off)
    return vp__err(VP_ERANGE, "%s: [%llu, +%llu) is outside the VBAR of %llu "
                   "bytes", fn, ULL(off), ULL(size), ULL(vb->size));
  int shift = vb->dev->page_shift;
  *p0 = (uint32_t)(off >> shift);
  *p1 = (uint32_t)(((off + size - 1) >> shift) + 1);
  return VP_OK;
}

int vp_fault(vp_vbar_t h, uint64_t offset, uint64_t size, uint32_t *gens,
             size_t ngens) {
  vp__vbar_t *vb = NULL;
  uint32_t p0, p1;
  VBAR_ENTER(h, "vp_fault", vb);
  int rc = page_range(vb, offset, size, "vp_fault", &p0, &p1);
  if (rc == VP_OK && gens && ngens < p1 - p0)
    rc = vp__err(VP_EINVAL, "vp_fault: the range has %u pages but gens has "
                 "room for %zu", p1 - p0, ngens);
  if (rc == VP_OK) rc = vp__fault(vb, p0, p1, gens);
  return unlock(vb->dev, rc);
}

int vp_unpin(vp_vbar_t h, uint64_t offset, uint64_t size, vp_stream_t stream) {
  vp__vbar_t *vb = NULL;
  uint32_t p0, p1;
  VBAR_ENTER(h, "vp_unpin", vb);
  int rc = page_range(vb, offset, size, "vp_unpin", &p0, &p1);
  if (rc == VP_OK) rc = vp__unpin(vb, p0, p1, stream);
  return unlock(vb->dev, rc);
}

int vp_vbar_free_memory(vp_vbar_t h, uint64_t bytes, uint64_t *freed) {
  vp__vbar_t *vb = NULL;
  VBAR_ENTER(h, "vp_vbar_free_memory", vb);
  uint64_t done = 0;
  int rc = vp__vbar_evict(vb, bytes, 0, &done);
  if (freed) *freed = done;
  return unlock(vb->dev, rc);
}

int vp_vbar_residency(vp_vbar_t h, uint8_t *flags, size_t n) {
  NEED(flags || n == 0, "vp_vbar_residency", "flags is NULL");
  vp__vbar_t *vb = NULL;
  int rc = vbar_lock(h, "vp_vbar_residency", &vb);
  if (rc) return rc;
  if (n > vb->npages)
    return unlock(vb->dev, vp__err(VP_ERANGE, "vp_vbar_residency: %zu flags "
                                   "asked of %u pages", n, vb->npages));
  for (size_t i = 0; i < n; i++)
    flags[i] = (uint8_t)((vb->pages[i].resident ? VP_PAGE_RESIDENT : 0) |
                         (vb->pages[i].pins ? VP_PAGE_PINNED : 0));
  return unlock(vb->dev, VP_OK);
}

/* -------------------------------------------------------------- stats */

/* Copy as much of src as the caller's struct holds (its size field). */
static int stats_out(vp_stats_t *dst, const vp_stats_t *src, const char *fn) {
  if (dst->size < offsetof(vp_stats_t, faults))
    return vp__err(VP_EINVAL, "%s: stats->size %u is too small (set it to "
                   "sizeof(vp_stats_t))", fn, dst->size);
  uint32_t size = dst->size < sizeof *src ? dst->size : sizeof *src;
  memcpy(dst, src, size);
  dst->size = size;
  return VP_OK;
}

int vp_device_stats(vp_device_t h, vp_stats_t *stats) {
  NEED(stats, "vp_device_stats", "stats is NULL");
  vp__device_t *dev = NULL;
  int rc = device_lock(h, "vp_device_stats", &dev);
  if (rc) return rc;
  vp_stats_t s = dev->stats;
  s.committed_bytes = dev->committed;
  for (vp__vbar_t *vb = dev->top; vb; vb = vb->down)
    s.pinned_bytes += (uint64_t)vb->pinned << dev->page_shift;
  return unlock(dev, stats_out(stats, &s, "vp_device_stats"));
}

int vp_vbar_stats(vp_vbar_t h, vp_stats_t *stats) {
  NEED(stats, "vp_vbar_stats", "stats is NULL");
  vp__vbar_t *vb = NULL;
  int rc = vbar_lock(h, "vp_vbar_stats", &vb);
  if (rc) return rc;
  vp_stats_t s = vb->stats;
  s.committed_bytes = (uint64_t)vb->resident << vb->dev->page_shift;
  s.pinned_bytes = (uint64_t)vb->pinned << vb->dev->page_shift;
  return unlock(vb->dev, stats_out(stats, &s, "vp_vbar_stats"));
}

int vp_device_report(vp_device_t h, int json, char *buf, size_t len,
                     size_t *needed) {
  NEED(buf || len == 0, "vp_device_report", "buf is NULL");
  vp__device_t *dev = NULL;
  int rc = device_lock(h, "vp_device_report", &dev);
  if (rc) return rc;
  return unlock(dev, vp__report(dev, json, buf, len, needed));
}
