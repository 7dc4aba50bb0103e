/* The public API of streams, copies, VBARs and statistics: argument checks,
 * the device lock, and the messages for vp_last_error(); the work itself is
 * in the layers below (device.c has the device's own calls). */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define ULL(x) ((unsigned long long)(x))

/* ------------------------------------------------------------ streams */

/* The streams vp_stream_create made, which alone vp_stream_destroy takes. */
static int streams_add(vp__device_t *dev, vp_stream_t s) {
  if (dev->nstreams == dev->streams_cap) {
    uint32_t cap = dev->streams_cap ? dev->streams_cap * 2 : 8;
    vp_stream_t *l = NULL;
    if (vp__inject_fail(&dev->inject) ||
        !(l = realloc(dev->streams, cap * sizeof *l)))
      return vp__err(VP_ENOMEM, "no memory for the stream list");
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
  VP__ENTER();
  VP__NEED(out, "out is NULL");
  vp__device_t *dev = NULL;
  VP__DEVICE_ENTER(h, dev);
  vp_stream_t s = 0;
  int rc = vp__be_stream_create(dev, &s);
  if (rc) {
    rc = vp__err(rc, "the %s backend failed", dev->caps.name);
  } else if ((rc = streams_add(dev, s))) {
    vp__be_stream_destroy(dev, s);
  } else {
    *out = s;
  }
  return vp__unlock(dev, rc);
}

int vp_stream_destroy(vp_device_t h, vp_stream_t stream) {
  VP__ENTER();
  VP__NEED(stream != 0,
           "stream 0 is the default stream and cannot be destroyed");
  vp__device_t *dev = NULL;
  int rc = vp__dev_lock(h, &dev);
  if (rc) return rc;
  if (!streams_remove(dev, stream))
    return vp__unlock(dev, vp__err(VP_EINVAL, "stream 0x%llx was not made by "
                                   "vp_stream_create on this device, or is "
                                   "destroyed", ULL(stream)));
  vp__unlock(dev, VP_OK); /* destroying waits for the stream's work */
  rc = vp__be_stream_destroy(dev, stream);
  if (rc) return vp__err(rc, "stream 0x%llx: %s", ULL(stream), vp_strerror(rc));
  return VP_OK;
}

int vp_stream_synchronize(vp_device_t h, vp_stream_t stream) {
  VP__ENTER();
  vp__device_t *dev = NULL;
  int rc = vp__dev_lock(h, &dev);
  if (rc) return rc;
  vp__unlock(dev, VP_OK); /* waiting must not hold the device */
  rc = vp__be_stream_synchronize(dev, stream);
  if (rc) return vp__err(rc, "stream 0x%llx: %s", ULL(stream), vp_strerror(rc));
  return VP_OK;
}

int vp_copy_to_device(vp_device_t h, uint64_t dst, const void *src,
                      uint64_t size, vp_stream_t stream) {
  VP__ENTER();
  VP__NEED(src, "src is NULL");
  vp__device_t *dev = NULL;
  VP__DEVICE_ENTER(h, dev);
  int rc = vp__unlock(dev, vp__pinned_range(dev, dst, size));
  if (rc) return rc;
  rc = vp__copy_htod(dev, dst, src, size, stream, false);
  if (rc) return vp__err(rc, "%llu bytes to 0x%llx on stream 0x%llx failed",
                         ULL(size), ULL(dst), ULL(stream));
  return VP_OK;
}

int vp_copy_to_host(vp_device_t h, void *dst, uint64_t src, uint64_t size,
                    vp_stream_t stream) {
  VP__ENTER();
  VP__NEED(dst, "dst is NULL");
  vp__device_t *dev = NULL;
  VP__DEVICE_ENTER(h, dev);
  int rc = vp__unlock(dev, vp__pinned_range(dev, src, size));
  if (rc) return rc;
  rc = vp__copy_dtoh(dev, dst, src, size, stream, false);
  if (rc) return vp__err(rc, "%llu bytes from 0x%llx on stream 0x%llx failed",
                         ULL(size), ULL(src), ULL(stream));
  return VP_OK;
}

int vp_sim_launch(vp_device_t h, vp_stream_t stream, void (*fn)(void *),
                  void *arg) {
  VP__ENTER();
  VP__NEED(fn, "fn is NULL");
  vp__device_t *dev = NULL;
  VP__DEVICE_ENTER(h, dev);
  vp__unlock(dev, VP_OK);
  int rc = vp__be_launch(dev, stream, fn, arg);
  if (rc == VP_EUNSUPPORTED)
    return vp__err(rc, "the %s backend runs no host functions", dev->caps.name);
  if (rc) return vp__err(rc, "stream 0x%llx", ULL(stream));
  return VP_OK;
}

int vp_sim_inject(vp_device_t h, int kind, uint64_t n) {
  VP__ENTER();
  vp__device_t *dev = NULL;
  int rc = vp__dev_lock(h, &dev);
  if (rc) return rc;
  rc = vp__be_inject(dev, kind, n);
  if (rc == VP_EUNSUPPORTED)
    return vp__unlock(dev, vp__err(rc, "the %s backend has no fault injection",
                                   dev->caps.name));
  if (rc) return vp__unlock(dev, vp__err(rc, "kind %d", kind));
  vp__budget_invalidate(dev); /* capacity may have changed */
  if (kind == VP_SIM_SET_DESKTOP) {
    dev->caps.default_headroom =
        n ? vp__default_headroom(dev->caps.total_memory, n == 2) : 0;
    if (!dev->budget.headroom_given)
      dev->budget.headroom = (int64_t)dev->caps.default_headroom;
    vp__ledger_put_headroom(dev);
  }
  return vp__unlock(dev, VP_OK);
}

/* --------------------------------------------------------------- VBAR */

int vp_set_log_level(int level) {
  VP__ENTER();
  if (level < VP_LOG_NONE || level > VP_LOG_TRACE)
    return vp__err(VP_EINVAL, "level %d is not 0-5", level);
  vp__log_set_level(level);
  return VP_OK;
}

int vp_vbar_create(vp_device_t h, uint64_t size, vp_vbar_t *out) {
  VP__ENTER();
  VP__NEED(out, "out is NULL");
  if (size == 0) return vp__err(VP_EINVAL, "size is 0");
  vp__device_t *dev = NULL;
  VP__DEVICE_ENTER(h, dev);
  vp__vbar_t *vb = NULL;
  int rc = vp__vbar_new(dev, size, &vb);
  if (rc == VP_OK) {
    out->id = vb->id;
    vp__ledger_used(dev, vb);
  }
  return vp__unlock(dev, rc);
}

int vp_vbar_destroy(vp_vbar_t h) {
  VP__ENTER();
  vp__vbar_t *vb = NULL;
  int rc = vp__vbar_lock(h, &vb);
  if (rc) return rc;
  vp__device_t *dev = vb->dev;
  rc = vp__weights_vbar_destroy(vb);
  vp__ledger_sync(dev);
  return vp__unlock(dev, rc);
}

/* Labels are printable ASCII without quotes or backslashes, so reports and
 * the ledger show them as they are. */
int vp_vbar_set_label(vp_vbar_t h, const char *label) {
  VP__ENTER();
  VP__NEED(label, "label is NULL");
  size_t n = strnlen(label, VP_LABEL_MAX);
  if (n == VP_LABEL_MAX)
    return vp__err(VP_EINVAL, "the label is longer than %d bytes",
                   VP_LABEL_MAX - 1);
  for (size_t i = 0; i < n; i++)
    if (label[i] < 0x20 || label[i] > 0x7e || label[i] == '"' ||
        label[i] == '\\')
      return vp__err(VP_EINVAL, "byte %zu of the label (0x%02x) is not "
                     "printable ASCII other than \" and \\", i,
                     (unsigned char)label[i]);
  vp__vbar_t *vb = NULL;
  VP__VBAR_ENTER(h, vb);
  memcpy(vb->label, label, n + 1);
  vp__ledger_sync(vb->dev);
  return vp__unlock(vb->dev, VP_OK);
}

int vp_vbar_label(vp_vbar_t h, char *buf, size_t len) {
  VP__ENTER();
  VP__NEED(buf, "buf is NULL");
  vp__vbar_t *vb = NULL;
  int rc = vp__vbar_lock(h, &vb);
  if (rc) return rc;
  size_t n = strlen(vb->label);
  if (n >= len)
    rc = vp__err(VP_ERANGE, "the label needs %zu bytes, the buffer has %zu",
                 n + 1, len);
  else
    memcpy(buf, vb->label, n + 1);
  return vp__unlock(vb->dev, rc);
}

/* Read one field of a VBAR. */
#define VBAR_GETTER(fname, type, expr)                                         \
  int fname(vp_vbar_t h, type *out) {                                          \
    VP__ENTER();                                                               \
    VP__NEED(out, "out is NULL");                                              \
    vp__vbar_t *vb;                                                            \
    int rc = vp__vbar_lock(h, &vb);                                            \
    if (rc) return rc;                                                         \
    *out = (expr);                                                             \
    return vp__unlock(vb->dev, VP_OK);                                         \
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
  VP__ENTER();
  vp__vbar_t *vb = NULL;
  VP__VBAR_ENTER(h, vb);
  vp__vbar_to_top(vb);
  vb->watermark = vb->npages;
  vp__ledger_sync(vb->dev);
  return vp__unlock(vb->dev, VP_OK);
}

int vp_vbar_deprioritize(vp_vbar_t h) {
  VP__ENTER();
  vp__vbar_t *vb = NULL;
  VP__VBAR_ENTER(h, vb);
  vp__vbar_to_bottom(vb);
  vp__ledger_sync(vb->dev);
  return vp__unlock(vb->dev, VP_OK);
}

int vp_vbar_set_order(vp_vbar_t h, int order) {
  VP__ENTER();
  if (order != VP_ORDER_TAIL_FIRST && order != VP_ORDER_INTERLEAVED)
    return vp__err(VP_EINVAL, "order %d is unknown", order);
  vp__vbar_t *vb = NULL;
  VP__VBAR_ENTER(h, vb);
  if (vb->resident)
    return vp__unlock(vb->dev, vp__err(VP_EBUSY, "%u pages are resident; free "
                                       "them first", vb->resident));
  vp__weights_set_order(vb, order);
  return vp__unlock(vb->dev, VP_OK);
}

int vp_vbar_set_ranks(vp_vbar_t h, const uint32_t *pages, size_t n) {
  VP__ENTER();
  if (!pages || !n) return vp__err(VP_EINVAL, "pages is NULL or n is 0");
  vp__vbar_t *vb = NULL;
  VP__VBAR_ENTER(h, vb);
  return vp__unlock(vb->dev, vp__vbar_set_ranks(vb, pages, n));
}

int vp_vbar_set_watermark(vp_vbar_t h, uint64_t bytes) {
  VP__ENTER();
  vp__vbar_t *vb = NULL;
  VP__VBAR_ENTER(h, vb);
  uint64_t pages = bytes >> vb->dev->page_shift;
  if (pages > vb->npages)
    return vp__unlock(vb->dev, vp__err(VP_ERANGE, "%llu bytes is more than the "
                                       "VBAR's %llu", ULL(bytes),
                                       ULL(vb->size)));
  vb->watermark = (uint32_t)pages;
  return vp__unlock(vb->dev, VP_OK);
}

int vp_vbar_set_watermark_limit(vp_vbar_t h, uint64_t bytes) {
  VP__ENTER();
  vp__vbar_t *vb = NULL;
  VP__VBAR_ENTER(h, vb);
  uint64_t pages = bytes >> vb->dev->page_shift;
  vb->limit = pages < vb->npages ? (uint32_t)pages : vb->npages;
  return vp__unlock(vb->dev, VP_OK);
}

/* Pages [*p0, *p1) of the range, or VP_EINVAL / VP_ERANGE. */
static int page_range(vp__vbar_t *vb, uint64_t off, uint64_t size,
                      uint32_t *p0, uint32_t *p1) {
  if (size == 0) return vp__err(VP_EINVAL, "size is 0");
  if (off >= vb->size || size > vb->size - off)
    return vp__err(VP_ERANGE, "[%llu, +%llu) is outside the VBAR of %llu bytes",
                   ULL(off), ULL(size), ULL(vb->size));
  int shift = vb->dev->page_shift;
  *p0 = (uint32_t)(off >> shift);
  *p1 = (uint32_t)(((off + size - 1) >> shift) + 1);
  return VP_OK;
}

/* A fault that other processes' memory could serve asks them first,
 * without the device lock (they may be asking us at the same time), then
 * faults again, taking its own pages only for what is still missing. If
 * the VBAR goes while unlocked, *vbp is NULL and nothing is locked. */
static int fault_asking(vp_vbar_t h, vp__vbar_t **vbp, uint32_t p0,
                        uint32_t p1, uint32_t *gens) {
  vp__device_t *dev = (*vbp)->dev;
  dev->ask = (vp__ask_t){.mode = VP__ASK_FIRST};
  int rc = vp__fault(*vbp, p0, p1, gens);
  vp__ask_t ask = dev->ask;
  dev->ask = (vp__ask_t){.mode = VP__ASK_OFF};
  if (rc != VP__ASK) return rc;
  if (!vp__release_may_help(dev)) return vp__fault(*vbp, p0, p1, gens);
  vp__unlock(dev, VP_OK);
  vp__release_ask(dev, &ask);
  rc = vp__vbar_enter(h, vbp);
  if (rc) {
    *vbp = NULL;
    return rc;
  }
  return vp__fault(*vbp, p0, p1, gens);
}

/* vp_fault and vp_fault_range, after VP__ENTER: with `zero_tail`, gens
 * past the range's pages (up to ngens) are set to 0 on VP_OK. */
static int fault_call(vp_vbar_t h, uint64_t offset, uint64_t size,
                      uint32_t *gens, size_t ngens, bool zero_tail) {
  vp__vbar_t *vb = NULL;
  uint32_t p0, p1;
  VP__VBAR_ENTER(h, vb);
  int rc = page_range(vb, offset, size, &p0, &p1);
  if (rc == VP_OK && gens && ngens < p1 - p0)
    rc = vp__err(VP_EINVAL, "the range has %u pages but gens has room for %zu",
                 p1 - p0, ngens);
  if (rc == VP_OK) rc = fault_asking(h, &vb, p0, p1, gens);
  if (rc == VP_OK && gens && zero_tail)
    memset(gens + (p1 - p0), 0, (ngens - (p1 - p0)) * sizeof *gens);
  if (!vb) return rc;
  if (rc >= 0) vp__ledger_used(vb->dev, vb);
  return vp__unlock(vb->dev, rc);
}

int vp_fault(vp_vbar_t h, uint64_t offset, uint64_t size, uint32_t *gens,
             size_t ngens) {
  VP__ENTER();
  return fault_call(h, offset, size, gens, ngens, false);
}

/* vp_unpin and vp_unpin_range, after VP__ENTER. */
static int unpin_call(vp_vbar_t h, uint64_t offset, uint64_t size,
                      vp_stream_t stream) {
  vp__vbar_t *vb = NULL;
  uint32_t p0, p1;
  VP__VBAR_ENTER(h, vb);
  int rc = page_range(vb, offset, size, &p0, &p1);
  if (rc == VP_OK) rc = vp__unpin_check_owned(vb, p0, p1);
  if (rc == VP_OK) rc = vp__unpin(vb, p0, p1, stream);
  if (rc == VP_OK) vp__ledger_used(vb->dev, vb);
  return vp__unlock(vb->dev, rc);
}

int vp_unpin(vp_vbar_t h, uint64_t offset, uint64_t size, vp_stream_t stream) {
  VP__ENTER();
  return unpin_call(h, offset, size, stream);
}

/* The same two calls on a range the caller describes once: a binding
 * passes one pointer instead of converting three arguments per call. */
int vp_fault_range(const vp_range_t *range, uint32_t *gens, size_t ngens) {
  VP__ENTER();
  VP__NEED(range, "range is NULL");
  return fault_call(range->vbar, range->offset, range->size, gens, ngens,
                    true);
}

int vp_unpin_range(const vp_range_t *range, vp_stream_t stream) {
  VP__ENTER();
  VP__NEED(range, "range is NULL");
  return unpin_call(range->vbar, range->offset, range->size, stream);
}

int vp_vbar_free_memory(vp_vbar_t h, uint64_t bytes, uint64_t *freed) {
  VP__ENTER();
  vp__vbar_t *vb = NULL;
  VP__VBAR_ENTER(h, vb);
  uint64_t done = 0;
  int rc = vp__vbar_evict(vb, bytes, 0, &done);
  if (freed) *freed = done;
  vp__ledger_sync(vb->dev);
  return vp__unlock(vb->dev, rc);
}

int vp_vbar_residency(vp_vbar_t h, uint8_t *flags, size_t n) {
  VP__ENTER();
  VP__NEED(flags || n == 0, "flags is NULL");
  vp__vbar_t *vb = NULL;
  int rc = vp__vbar_lock(h, &vb);
  if (rc) return rc;
  if (n > vb->npages)
    return vp__unlock(vb->dev, vp__err(VP_ERANGE, "%zu flags asked of %u pages",
                                       n, vb->npages));
  for (size_t i = 0; i < n; i++)
    flags[i] = (uint8_t)((vb->pages[i].resident ? VP_PAGE_RESIDENT : 0) |
                         (vb->pages[i].pins ? VP_PAGE_PINNED : 0));
  return vp__unlock(vb->dev, VP_OK);
}

/* -------------------------------------------------------------- stats */

/* Copy as much of src as the caller's struct holds (its size field). */
static int stats_out(vp_stats_t *dst, const vp_stats_t *src) {
  if (dst->size < offsetof(vp_stats_t, faults))
    return vp__err(VP_EINVAL, "stats->size %u is too small (set it to "
                   "sizeof(vp_stats_t))", dst->size);
  uint32_t size = dst->size < sizeof *src ? dst->size : sizeof *src;
  memcpy(dst, src, size);
  dst->size = size;
  return VP_OK;
}

int vp_device_stats(vp_device_t h, vp_stats_t *stats) {
  VP__ENTER();
  VP__NEED(stats, "stats is NULL");
  vp__device_t *dev = NULL;
  int rc = vp__dev_lock(h, &dev);
  if (rc) return rc;
  vp_stats_t s = dev->stats;
  s.committed_bytes = dev->committed;
  s.machine_pinned_bytes = vp__pins_machine(dev);
  for (vp__vbar_t *vb = dev->top; vb; vb = vb->down)
    s.pinned_bytes += (uint64_t)vb->pinned << dev->page_shift;
  return vp__unlock(dev, stats_out(stats, &s));
}

int vp_vbar_stats(vp_vbar_t h, vp_stats_t *stats) {
  VP__ENTER();
  VP__NEED(stats, "stats is NULL");
  vp__vbar_t *vb = NULL;
  int rc = vp__vbar_lock(h, &vb);
  if (rc) return rc;
  vp_stats_t s = vb->stats;
  s.committed_bytes = (uint64_t)vb->resident << vb->dev->page_shift;
  s.pinned_bytes = (uint64_t)vb->pinned << vb->dev->page_shift;
  return vp__unlock(vb->dev, stats_out(stats, &s));
}

int vp_device_report(vp_device_t h, int json, char *buf, size_t len,
                     size_t *needed) {
  VP__ENTER();
  VP__NEED(buf || len == 0, "buf is NULL");
  vp__device_t *dev = NULL;
  int rc = vp__dev_lock(h, &dev);
  if (rc) return rc;
  return vp__unlock(dev, vp__report(dev, json, buf, len, needed));
}

int vp_device_count(int backend, int *count) {
  VP__ENTER();
  VP__NEED(count, "count is NULL");
  *count = 0;
  if (backend != VP_BACKEND_CUDA && backend != VP_BACKEND_SIM &&
      backend != VP_BACKEND_HIP)
    return vp__err(VP_EINVAL, "backend %d is not VP_BACKEND_CUDA (1), "
                   "VP_BACKEND_SIM (2) or VP_BACKEND_HIP (3)", backend);
  int rc = vp__be_device_count(backend, count);
  if (rc) return vp__err(rc, "counting the devices failed");
  return VP_OK;
}

int vp_device_soft_limit(vp_device_t h, uint64_t *bytes) {
  VP__ENTER();
  VP__NEED(bytes, "bytes is NULL");
  *bytes = 0;
  vp__device_t *dev = NULL;
  VP__DEVICE_ENTER(h, dev);
  vp__unlock(dev, VP_OK); /* NVML's first load takes ~10 ms */
  int rc = vp__be_soft_limit(dev, bytes);
  if (rc) return vp__err(rc, "reading the soft limit failed");
  return VP_OK;
}

int vp_host_unregister(vp_device_t h, void *ptr) {
  VP__ENTER();
  VP__NEED(ptr, "ptr is NULL");
  vp__device_t *dev = NULL;
  VP__DEVICE_ENTER(h, dev);
  /* Ours to drop, not a client's: unregistered under a live host buffer,
   * its copies would fail (or, pinned again, count twice). */
  uint64_t hb = vp__hostbuf_holding(dev, ptr);
  if (hb)
    return vp__unlock(dev, vp__err(VP_EBUSY, "%p is in vpager's host buffer "
                                   "%llu: vp_hostbuf_free drops its "
                                   "registration", ptr, ULL(hb)));
  vp__unlock(dev, VP_OK); /* the driver call needs none of our state */
  int rc = vp__be_host_unregister(dev, ptr);
  if (rc == VP_EINVAL)
    return vp__err(rc, "%p is not registered host memory", ptr);
  if (rc) return vp__err(rc, "unregistering %p failed", ptr);
  return VP_OK;
}
