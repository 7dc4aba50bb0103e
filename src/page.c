/* Committing and evicting pages: the only file that calls the backend's
 * memory operations. It undoes partial steps, counts, and turns a backend
 * error into a message naming the VBAR, page and call. */
#include "internal.h"

static int commit_once(vp__vbar_t *vb, uint64_t va, vp__phys_t *phys) {
  vp__device_t *dev = vb->dev;
  uint64_t size = dev->page_size;
  int rc = vp__be_phys_create(dev, size, phys);
  if (rc) return rc;
  rc = vp__be_map(dev, va, size, *phys);
  if (rc) goto release;
  rc = vp__be_set_access(dev, va, size);
  if (rc) goto unmap;
  if (vb->mirrored) { /* its second view too (vp__vbar_mirror) */
    rc = vp__be_map(dev, va + vb->size, size, *phys);
    if (rc == VP_OK && (rc = vp__be_set_access(dev, va + vb->size, size)))
      vp__be_unmap(dev, va + vb->size, size);
    if (rc) goto unmap;
  }
  return VP_OK;
unmap:
  vp__be_unmap(dev, va, size);
release:
  vp__be_phys_release(dev, *phys, size);
  return rc;
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
  vb->epoch++;
  dev->committed += dev->page_size;
  VP__COUNT(vb, pages_committed, 1);
  return VP_OK;
}

/* Wait for one of page p's fences, then let it go. On a broken device
 * nothing queued will run again: the page is freed anyway. */
static int fence_done(vp__vbar_t *vb, uint32_t p, vp__fence_t **slot) {
  vp__device_t *dev = vb->dev;
  vp__fence_t *f = *slot;
  if (!f) return VP_OK;
  if (vp__be_event_query(dev, f->event) != VP_OK) {
    VP__COUNT(vb, evict_waits, 1);
    int rc = vp__fence_wait(dev, f);
    uint64_t va = vb->va + ((uint64_t)p << dev->page_shift);
    if (rc && !dev->broken)
      return vp__err(rc, "evicting page %u at 0x%llx: waiting for its fence "
                     "failed", p, (unsigned long long)va);
  }
  vp__fence_put(dev, f);
  *slot = NULL;
  return VP_OK;
}

/* Evict page p (resident, unpinned): wait for its fences only (its readers'
 * and the copy stream's), then unmap and release. The wait is what keeps
 * queued work from touching a freed page. */
int vp__page_evict(vp__vbar_t *vb, uint32_t p) {
  vp__device_t *dev = vb->dev;
  vp__page_t *pg = &vb->pages[p];
  uint64_t va = vb->va + ((uint64_t)p << dev->page_shift);
  int rc = fence_done(vb, p, &pg->fence);
  if (rc == VP_OK) rc = fence_done(vb, p, &pg->fill);
  if (rc) return rc;
  if (vb->mirrored) vp__be_unmap(dev, va + vb->size, dev->page_size);
  vp__be_unmap(dev, va, dev->page_size);
  vp__be_phys_release(dev, pg->phys, dev->page_size);
  pg->resident = false;
  vb->resident--;
  vb->epoch++;
  dev->committed -= dev->page_size;
  VP__COUNT(vb, pages_evicted, 1);
  return VP_OK;
}

/* The second views of vb's resident pages before page `end` unmapped. */
static void unmirror(vp__vbar_t *vb, uint32_t end) {
  vp__device_t *dev = vb->dev;
  for (uint32_t q = 0; q < end; q++)
    if (vb->pages[q].resident)
      vp__be_unmap(dev, vb->va + vb->size + ((uint64_t)q << dev->page_shift),
                   dev->page_size);
}

/* Each resident page's second view, at va + size: map, then access. */
int vp__vbar_mirror(vp__vbar_t *vb) {
  vp__device_t *dev = vb->dev;
  uint64_t page = dev->page_size;
  if (vb->mirror != vb->size)
    return vp__err(VP_EINVAL, "the VBAR has no room reserved for a mirror");
  int rc = VP_OK;
  uint32_t p = 0;
  for (; p < vb->npages && rc == VP_OK; p++) {
    if (!vb->pages[p].resident) continue;
    uint64_t at = vb->va + vb->size + ((uint64_t)p << dev->page_shift);
    rc = vp__be_map(dev, at, page, vb->pages[p].phys);
    if (rc == VP_OK && (rc = vp__be_set_access(dev, at, page)))
      vp__be_unmap(dev, at, page);
    if (rc)
      rc = vp__err(rc, "mapping page %u a second time at 0x%llx failed", p,
                   (unsigned long long)at);
  }
  if (rc == VP_OK) {
    vb->mirrored = true;
    return VP_OK;
  }
  unmirror(vb, p - 1); /* p - 1 failed and is undone */
  return rc;
}

void vp__vbar_unmirror(vp__vbar_t *vb) {
  if (vb->mirrored) unmirror(vb, vb->npages);
  vb->mirrored = false;
}
