/* Devices: open and close, the composition root that starts and stops every
 * service in order (so no lower layer calls up to tear another down), and
 * the device's public getters and setters. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define ULL(x) ((unsigned long long)(x))

/* The sim device's sizes come from options; a GPU's from the driver. */
static const char *sim_option(const vp__device_t *dev, const char *name) {
  return strcmp(dev->caps.name, "sim") == 0 ? name : "";
}

static int check_geometry(vp__device_t *dev) {
  const vp_options_t *o = &dev->opts;
  if (o->page_size % dev->caps.granularity)
    return vp__err(VP_EINVAL, "option page_size (VPAGER_PAGE_SIZE): %llu "
                   "bytes (%s) is not a multiple of the %s device's "
                   "granularity%s: %llu bytes (%s)", ULL(o->page_size),
                   vp__size(o->page_size).s, dev->caps.name,
                   sim_option(dev, " (option sim_granularity)"),
                   ULL(dev->caps.granularity),
                   vp__size(dev->caps.granularity).s);
  /* No page of that size could ever be committed: every fault would miss. */
  if (o->page_size > dev->caps.total_memory)
    return vp__err(VP_EINVAL, "option page_size (VPAGER_PAGE_SIZE): %llu "
                   "bytes (%s) is larger than the %s device's memory%s: %llu "
                   "bytes (%s)", ULL(o->page_size), vp__size(o->page_size).s,
                   dev->caps.name, sim_option(dev, " (option sim_capacity)"),
                   ULL(dev->caps.total_memory),
                   vp__size(dev->caps.total_memory).s);
  if (o->headroom < -1)
    return vp__err(VP_EINVAL, "option headroom (VPAGER_HEADROOM): %lld is "
                   "negative", (long long)o->headroom);
  /* Keeping the whole device free leaves no room for one page. */
  if (o->headroom >= 0 &&
      (uint64_t)o->headroom + o->page_size > dev->caps.total_memory)
    return vp__err(VP_EINVAL, "option headroom (VPAGER_HEADROOM): %llu bytes "
                   "(%s) leaves no room for one page of %s on the %s "
                   "device's memory%s: %llu bytes (%s)", ULL(o->headroom),
                   vp__size((uint64_t)o->headroom).s, vp__size(o->page_size).s,
                   dev->caps.name, sim_option(dev, " (option sim_capacity)"),
                   ULL(dev->caps.total_memory),
                   vp__size(dev->caps.total_memory).s);
  dev->page_size = o->page_size;
  dev->page_shift = __builtin_ctzll(o->page_size);
  return VP_OK;
}

static int device_create(const vp_options_t *opts, vp__device_t **out) {
  int rc = vp__options_check(opts);
  if (rc) return rc;
  vp__inject_t inject = {opts->sim_fail_nth};
  vp__device_t *dev = NULL;
  if (vp__inject_fail(&inject) || !(dev = calloc(1, sizeof *dev)))
    return vp__err(VP_ENOMEM, "no memory for the device");
  dev->opts = *opts;
  dev->inject = inject;
  rc = vp__be_open(dev);
  if (rc) goto free_dev;
  rc = check_geometry(dev);
  if (rc) goto close_backend;
  if (vp__os_mutex_init(&dev->lock)) {
    rc = vp__err(VP_ENOMEM, "cannot make the device lock");
    goto close_backend;
  }
  if (vp__os_mutex_init(&dev->reader_lock)) {
    rc = vp__err(VP_ENOMEM, "cannot make the file reader's lock");
    goto destroy_device_lock;
  }
  vp__budget_init(dev);
  vp__hostmem_init(dev);
  dev->lookahead = opts->lookahead;
  dev->stats.size = sizeof dev->stats;
  dev->stats.version = 1;
  rc = vp__registry_add(dev);
  if (rc) goto destroy_lock;
  /* The ledger last: joining never fails the open, and from here on the
   * service thread may serve other processes' requests. */
  vp__ledger_open(dev);
  vp__ledger_put_headroom(dev); /* before the service thread shares dev */
  if (vp__release_start(dev)) {
    vp__ledger_close(dev);
    snprintf(dev->ledger_why, sizeof dev->ledger_why,
             "the ledger's service thread could not start");
    vp__log(VP_LOG_WARN, dev->caps.name, "%s; this device runs alone",
            dev->ledger_why);
  }
  vp__hostmem_share(dev); /* the machine's pin budget: never fails */
  vp__log(VP_LOG_INFO, dev->caps.name,
          "device %d open: page %s, memory %s, headroom %s",
          opts->device_index, vp__size(dev->page_size).s,
          vp__size(dev->caps.total_memory).s,
          vp__size((uint64_t)dev->budget.headroom).s);
  *out = dev;
  return VP_OK;
destroy_lock:
  vp__os_mutex_destroy(&dev->reader_lock);
destroy_device_lock:
  vp__os_mutex_destroy(&dev->lock);
close_backend:
  vp__be_close(dev);
free_dev:
  free(dev);
  return rc;
}

/* Top down: the ledger's service thread first (it evicts under the device
 * lock), files and copies (they read VBARs and host memory), then the
 * weights, the VBARs, host memory, fences and the backend. */
static void device_destroy(vp__device_t *dev) {
  vp__registry_remove(dev);
  /* Work the caller queued and did not wait for (copies, launches) may
   * still touch pages: it finishes before anything is freed. */
  vp__be_stream_synchronize(dev, 0);
  for (uint32_t i = 0; i < dev->nstreams; i++)
    vp__be_stream_synchronize(dev, dev->streams[i]);
  vp__release_stop(dev);
  vp__ledger_close(dev);
  vp__pins_close(dev); /* its thread touches host buffers */
  vp__st_close_all(dev);
  vp__fileio_close(dev);
  vp__staging_close(dev);
  vp__weights_close(dev);
  vp__pager_close(dev);
  free(dev->streams);
  vp__hostmem_close(dev);
  vp__fence_pool_free(dev);
  vp__be_close(dev);
  vp__os_mutex_destroy(&dev->reader_lock);
  vp__os_mutex_destroy(&dev->lock);
  free(dev);
}

int vp_device_open(const vp_options_t *opts, vp_device_t *out) {
  VP__ENTER();
  VP__NEED(out, "out is NULL");
  vp_options_t defaults;
  if (!opts) {
    vp__options_defaults(&defaults);
    opts = &defaults;
  }
  vp__device_t *dev = NULL;
  int rc = device_create(opts, &dev);
  if (rc) return rc;
  out->id = dev->id;
  return VP_OK;
}

int vp_device_close(vp_device_t h) {
  VP__ENTER();
  vp__device_t *dev = NULL;
  int rc = vp__dev_lock(h, &dev);
  if (rc) return rc;
  vp__unlock(dev, VP_OK);
  device_destroy(dev);
  return VP_OK;
}

const char *vp_device_backend(vp_device_t h) {
  VP__ENTER();
  vp__device_t *dev = NULL;
  if (vp__dev_lock(h, &dev)) return NULL;
  const char *name = dev->caps.name;
  vp__unlock(dev, VP_OK);
  return name;
}

int vp_device_info(vp_device_t h, vp_device_info_t *info) {
  VP__ENTER();
  VP__NEED(info, "info is NULL");
  vp__device_t *dev = NULL;
  int rc = vp__dev_enter(h, &dev);
  if (rc) return rc;
  uint64_t allowed;
  rc = vp__budget_allowed(dev, &allowed);
  if (rc) return vp__unlock(dev, vp__err(rc, "polling free memory failed"));
  *info = (vp_device_info_t){
      .page_size = dev->page_size,
      .granularity = dev->caps.granularity,
      .total_memory = dev->budget.total,
      .free_memory = dev->budget.free_at_poll,
      .committed = dev->committed,
      .budget = allowed,
      .headroom = dev->budget.headroom,
      .async_copies = dev->caps.async_copies,
      .shared_headroom = dev->budget.shared_headroom,
      .kept_free = vp__budget_kept(dev),
      .staging_wraps = vp__staging_wraps(dev),
  };
  return vp__unlock(dev, VP_OK);
}

int vp_device_free_memory(vp_device_t h, uint64_t bytes, uint64_t *freed) {
  VP__ENTER();
  vp__device_t *dev = NULL;
  int rc = vp__dev_enter(h, &dev);
  if (rc) return rc;
  uint64_t done = 0;
  rc = vp__device_evict(dev, bytes, &done);
  if (freed) *freed = done;
  vp__ledger_sync(dev);
  return vp__unlock(dev, rc);
}

int vp_device_reclaimable(vp_device_t h, uint64_t *bytes) {
  VP__ENTER();
  VP__NEED(bytes, "bytes is NULL");
  vp__device_t *dev = NULL;
  int rc = vp__dev_enter(h, &dev);
  if (rc) return rc;
  uint64_t pages = 0;
  for (vp__vbar_t *vb = dev->top; vb; vb = vb->down)
    pages += vb->resident - vb->pinned;
  *bytes = pages << dev->page_shift;
  return vp__unlock(dev, VP_OK);
}

/* ------------------------------------------------------------ setters */

/* One device setting, changed under the lock on a working device. */
#define DEVICE_SETTER(fname, type, check, assign)                              \
  int fname(vp_device_t h, type bytes) {                                       \
    VP__ENTER();                                                               \
    check;                                                                     \
    vp__device_t *dev = NULL;                                                  \
    int rc = vp__dev_enter(h, &dev);                                           \
    if (rc) return rc;                                                         \
    assign;                                                                    \
    return vp__unlock(dev, VP_OK);                                             \
  }

/* A new headroom follows torch's allocator, which changed what is free
 * too (an emptied cache): the next check polls the device again, or the
 * budget would be the new headroom less a free count from before. */
DEVICE_SETTER(vp_device_set_headroom, int64_t,
              if (bytes < 0) return vp__err(VP_EINVAL, "%lld is negative",
                                            (long long)bytes),
              (dev->budget.headroom = bytes, dev->budget.headroom_given = true,
               vp__budget_invalidate(dev), vp__ledger_put_headroom(dev)))
DEVICE_SETTER(vp_device_set_shared_headroom, int64_t,
              if (bytes < -1) return vp__err(VP_EINVAL, "%lld is below -1 "
                                             "(-1: the headroom)",
                                             (long long)bytes),
              (dev->budget.shared_headroom = bytes,
               vp__ledger_put_headroom(dev)))
DEVICE_SETTER(vp_device_set_limit, uint64_t, (void)0,
              dev->budget.limit = bytes)
DEVICE_SETTER(vp_device_set_lookahead, uint64_t, (void)0,
              dev->lookahead = bytes)
DEVICE_SETTER(vp_device_set_pin_budget, uint64_t, (void)0,
              vp__pins_set_budget(dev, bytes))
DEVICE_SETTER(vp_device_set_external_reserved, uint64_t, (void)0,
              (dev->external_reserved = bytes, vp__ledger_sync(dev)))

/* A new staging ring size: the ring is given back and the next miss opens
 * it at the new size. */
int vp_device_set_staging_size(vp_device_t h, uint64_t bytes) {
  VP__ENTER();
  if (!bytes) return vp__err(VP_EINVAL, "bytes is 0");
  vp__device_t *dev = NULL;
  int rc = vp__dev_enter(h, &dev);
  if (rc) return rc;
  if ((rc = vp__staging_free(dev)) == VP_OK) dev->opts.staging_size = bytes;
  return vp__unlock(dev, rc);
}

int vp_device_reset_limits(vp_device_t h) {
  VP__ENTER();
  vp__device_t *dev = NULL;
  int rc = vp__dev_enter(h, &dev);
  if (rc) return rc;
  for (vp__vbar_t *vb = dev->top; vb; vb = vb->down) vb->limit = vb->npages;
  return vp__unlock(dev, VP_OK);
}
