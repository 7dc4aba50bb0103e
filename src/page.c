/* Committing and evicting pages: the only file that calls the backend's
 * memory operations. It undoes partial steps, counts, and turns a backend
 * error into a message naming the VBAR, page and call. */
#include "internal.h"

/* Note a backend failure: VP_EDEVICE marks the device broken for good. */
int vp__be_result(vp__device_t *dev, int rc, const char *what) {
  if (rc == VP_OK) return VP_OK;
  if (rc == VP_EDEVICE && !dev->broken) {
    dev->broken = true;
    vp__log(VP_LOG_ERROR, dev->caps.name, "%s: device is broken", what);
  }
  return rc;
}

static int commit_once(vp__vbar_t *vb, uint64_t va, vp__phys_t *phys) {
  vp__device_t *dev = vb->dev;
  const vp__backend_t *be = dev->be;
  uint64_t size = dev->page_size;
  int rc = be->phys_create(dev->ctx, size, phys);
  if (rc) return vp__be_result(dev, rc, "phys_create");
  rc = be->map(dev->ctx, va, size, *phys);
  if (rc) goto release;
  rc = be->set_access(dev->ctx, va, size);
  if (rc) goto unmap;
  return VP_OK;
unmap:
  be->unmap(dev->ctx, va, size);
release:
  be->phys_release(dev->ctx, *phys, size);
  return vp__be_result(dev, rc, "map/set_access");
}

/* Commit page p of vb: VP_OK, VP_EOOM / VP_EAGAIN (a miss for the caller)
 * or VP_EDEVICE. Transient errors are retried a bounded number of times. */
int vp__page_commit(vp__vbar_t *vb, uint32_t p) {
  vp__device_t *dev = vb->dev;
  vp__page_t *pg = &vb->pages[p];
  uint64_t va = vb->va + ((uint64_t)p << dev->page_shift);
  int rc;
  for (int attempt = 0;; attempt++) {
    rc = commit_once(vb, va, &pg->phys);
    if (rc != VP_EAGAIN || attempt == VP__COMMIT_RETRIES) break;
    VP__COUNT(vb, commit_retries, 1);
  }
  if (rc) {
    VP__COUNT(vb, commit_failures, 1);
    vp__log(VP_LOG_DEBUG, dev->caps.name, "commit of page %u at 0x%llx: %s",
            p, (unsigned long long)va, vp_err_name(rc));
    if (rc == VP_EOOM) vp__budget_invalidate(dev); /* someone else grew */
    return rc;
  }
  if (++dev->gen_counter == 0) dev->gen_counter = 1; /* 0 = never */
  pg->gen = dev->gen_counter;
  pg->resident = true;
  vb->resident++;
  vb->prefetch_idle = false;
  dev->committed += dev->page_size;
  VP__COUNT(vb, pages_committed, 1);
  return VP_OK;
}

/* Evict page p (resident, unpinned): wait for its fence only, then unmap and
 * release. The wait is what keeps queued work from reading a freed page. */
int vp__page_evict(vp__vbar_t *vb, uint32_t p) {
  vp__device_t *dev = vb->dev;
  vp__page_t *pg = &vb->pages[p];
  uint64_t va = vb->va + ((uint64_t)p << dev->page_shift);
  if (pg->fence) {
    if (dev->be->event_query(dev->ctx, pg->fence->event) != VP_OK) {
      VP__COUNT(vb, evict_waits, 1);
      int rc = vp__be_result(dev, vp__fence_wait(dev, pg->fence),
                             "event_synchronize");
      /* On a broken device nothing queued will run again: free anyway. */
      if (rc && !dev->broken)
        return vp__err(rc, "evicting page %u at 0x%llx: waiting for its "
                       "fence failed", p, (unsigned long long)va);
    }
    vp__fence_put(dev, pg->fence);
    pg->fence = NULL;
  }
  dev->be->unmap(dev->ctx, va, dev->page_size);
  dev->be->phys_release(dev->ctx, pg->phys, dev->page_size);
  pg->resident = false;
  vb->resident--;
  vb->prefetch_idle = false;
  dev->committed -= dev->page_size;
  VP__COUNT(vb, pages_evicted, 1);
  return VP_OK;
}
