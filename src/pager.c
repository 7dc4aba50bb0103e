/* The pager: devices, VBARs, the priority list, watermarks, fault, unpin and
 * eviction. Every function here runs with the device lock held (except
 * device create/destroy, which own the device alone). */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define VP__MAX_PAGES (1u << 22) /* per VBAR: bounds the page tables */

/* ------------------------------------------------------- priority list */

static void list_unlink(vp__vbar_t *vb) {
  vp__device_t *dev = vb->dev;
  if (!vb->listed) return;
  vb->listed = false;
  if (vb->up) vb->up->down = vb->down; else dev->top = vb->down;
  if (vb->down) vb->down->up = vb->up; else dev->bottom = vb->up;
  vb->up = vb->down = NULL;
}

static void list_push_top(vp__vbar_t *vb) {
  vp__device_t *dev = vb->dev;
  vb->listed = true;
  vb->up = NULL;
  vb->down = dev->top;
  if (dev->top) dev->top->up = vb; else dev->bottom = vb;
  dev->top = vb;
}

void vp__vbar_to_top(vp__vbar_t *vb) {
  if (vb->dev->top == vb || !vb->listed) return;
  list_unlink(vb);
  list_push_top(vb);
}

void vp__vbar_to_bottom(vp__vbar_t *vb) {
  vp__device_t *dev = vb->dev;
  if (dev->bottom == vb || !vb->listed) return;
  list_unlink(vb);
  vb->listed = true;
  vb->up = dev->bottom;
  if (dev->bottom) dev->bottom->down = vb; else dev->top = vb;
  dev->bottom = vb;
}

/* -------------------------------------------------------------- VBARs */

static uint32_t bit_reverse(uint32_t v, int bits) {
  uint32_t r = 0;
  for (int i = 0; i < bits; i++, v >>= 1) r = (r << 1) | (v & 1);
  return r;
}

/* Interleaved, once the VBAR has weights: pages joined by a weight form a
 * group, groups are taken in bit-reversed order so those evicted first are
 * spread evenly, and a group's pages get consecutive ranks, so eviction
 * takes whole weights (its tail first) instead of a page of many. Pages no
 * weight touches rank last. False when there are no weights (or no memory:
 * the plain order is as correct, only slower to stream). */
static bool order_groups(vp__vbar_t *vb, const uint8_t *mark) {
  uint32_t n = vb->npages, ng = 0, r = 0;
  uint32_t *start = mark ? malloc(n * sizeof *start) : NULL;
  if (!start) return false;
  for (uint32_t p = 0; p < n; p++)
    if (mark[p] == VP__PAGE_GROUP_START) start[ng++] = p;
  int bits = 0;
  while ((1ull << bits) < ng) bits++;
  for (uint64_t i = 0; ng && i < (1ull << bits); i++) {
    uint32_t g = bit_reverse((uint32_t)i, bits);
    if (g >= ng) continue;
    uint32_t p = start[g];
    do vb->order[r++] = p++;
    while (p < n && mark[p] == VP__PAGE_GROUP_JOINED);
  }
  for (uint32_t p = 0; p < n; p++)
    if (!mark[p]) vb->order[r++] = p;
  free(start);
  return true;
}

/* Fill rank/order. Interleaved: bit-reversed page index (or weight groups,
 * see order_groups), so the pages evicted first (highest ranks) are spread
 * evenly through the model. */
void vp__vbar_set_order(vp__vbar_t *vb, int kind, const uint8_t *mark) {
  uint32_t n = vb->npages, r = 0;
  if (kind == VP_ORDER_TAIL_FIRST) {
    for (r = 0; r < n; r++) vb->order[r] = r;
  } else if (!order_groups(vb, mark)) {
    int bits = 0;
    while ((1ull << bits) < n) bits++;
    for (uint64_t i = 0; i < (1ull << bits); i++) {
      uint32_t p = bit_reverse((uint32_t)i, bits);
      if (p < n) vb->order[r++] = p;
    }
  }
  for (r = 0; r < n; r++) vb->rank[vb->order[r]] = r;
  vb->order_kind = kind;
}

/* The caller's order (VP_ORDER_CUSTOM): pages[r] is the page of rank r.
 * Checked to be a permutation before anything changes. */
int vp__vbar_set_ranks(vp__vbar_t *vb, const uint32_t *pages, size_t n) {
  uint32_t np = vb->npages;
  if (n != np)
    return vp__err(VP_EINVAL, "%zu ranks given for a VBAR of %u pages", n, np);
  uint8_t *seen = vp__inject_fail(&vb->dev->inject) ? NULL : calloc(np, 1);
  if (!seen) return vp__err(VP_ENOMEM, "no memory for %u pages", np);
  for (uint32_t r = 0; r < np; r++) {
    if (pages[r] >= np || seen[pages[r]]) {
      free(seen);
      return vp__err(VP_EINVAL, "pages[%u] = %u is %s", r, pages[r],
                     pages[r] >= np ? "past the VBAR" : "listed twice");
    }
    seen[pages[r]] = 1;
  }
  free(seen);
  for (uint32_t r = 0; r < np; r++) {
    vb->order[r] = pages[r];
    vb->rank[pages[r]] = r;
  }
  vb->order_kind = VP_ORDER_CUSTOM;
  return VP_OK;
}

static int vbar_alloc(vp__device_t *dev, uint32_t npages, vp__vbar_t **out) {
  vp__vbar_t *vb = NULL;
  if (vp__inject_fail(&dev->inject) || !(vb = calloc(1, sizeof *vb)))
    goto fail;
  vb->pages = calloc(npages, sizeof *vb->pages);
  vb->rank = malloc(npages * sizeof *vb->rank);
  vb->order = malloc(npages * sizeof *vb->order);
  if (vp__inject_fail(&dev->inject) || !vb->pages || !vb->rank || !vb->order)
    goto fail;
  *out = vb;
  return VP_OK;
fail:
  if (vb) free(vb->pages), free(vb->rank), free(vb->order);
  free(vb);
  return vp__err(VP_ENOMEM, "no memory for %u pages", npages);
}

static void vbar_free_struct(vp__vbar_t *vb) {
  free(vb->pages);
  free(vb->rank);
  free(vb->order);
  free(vb);
}

/* A VBAR of `size` bytes whose reservation runs `mirror` bytes further
 * (0, or its size: room for a second view of its pages). */
static int vbar_new(vp__device_t *dev, uint64_t size, bool mirror,
                    vp__vbar_t **out) {
  uint64_t npages = (size >> dev->page_shift) +
                    ((size & (dev->page_size - 1)) != 0);
  if (npages > VP__MAX_PAGES)
    return vp__err(VP_ELIMIT, "%llu bytes is %llu pages; at most %u pages of "
                   "%llu bytes per VBAR", (unsigned long long)size,
                   (unsigned long long)npages, VP__MAX_PAGES,
                   (unsigned long long)dev->page_size);
  vp__vbar_t *vb = NULL;
  int rc = vbar_alloc(dev, (uint32_t)npages, &vb);
  if (rc) return rc;
  vb->dev = dev;
  vb->npages = (uint32_t)npages;
  vb->size = npages << dev->page_shift;
  vb->mirror = mirror ? vb->size : 0;
  rc = vp__be_va_reserve(dev, vb->size + vb->mirror, &vb->va);
  if (rc) {
    vbar_free_struct(vb);
    return vp__err(rc, "reserving %llu bytes of address space failed",
                   (unsigned long long)(npages << dev->page_shift));
  }
  rc = vp__table_add(dev, &dev->vbars, vb, &vb->id);
  if (rc) {
    vp__be_va_free(dev, vb->va, vb->size + vb->mirror);
    vbar_free_struct(vb);
    return rc;
  }
  vp__vbar_set_order(vb, dev->opts.evict_order, NULL);
  vb->watermark = vb->limit = vb->npages;
  vb->stats.size = sizeof vb->stats;
  vb->stats.version = 1;
  list_push_top(vb);
  *out = vb;
  return VP_OK;
}

/* Evict every page (waiting for fences), free the range and the VBAR. */
static void vbar_release(vp__vbar_t *vb) {
  vp__device_t *dev = vb->dev;
  for (uint32_t p = 0; p < vb->npages; p++)
    if (vb->pages[p].resident) vp__page_evict(vb, p);
  vp__be_va_free(dev, vb->va, vb->size + vb->mirror);
  list_unlink(vb);
  vp__table_remove(&dev->vbars, vb->id);
  vbar_free_struct(vb);
}

int vp__vbar_new(vp__device_t *dev, uint64_t size, vp__vbar_t **out) {
  return vbar_new(dev, size, false, out);
}

int vp__vbar_new_internal(vp__device_t *dev, uint64_t size, bool mirror,
                          vp__vbar_t **out) {
  int rc = vbar_new(dev, size, mirror, out);
  if (rc == VP_OK) list_unlink(*out);
  return rc;
}

int vp__vbar_check_free(const vp__vbar_t *vb) {
  if (vb->pinned)
    return vp__err(VP_EBUSY, "%u pages are still pinned; unpin them first",
                   vb->pinned);
  return VP_OK;
}

int vp__vbar_free(vp__vbar_t *vb) {
  int rc = vp__vbar_check_free(vb);
  if (rc == VP_OK) vbar_release(vb);
  return rc;
}

/* Device close: every VBAR goes, pinned or not (the caller has waited for
 * the work that used them). */
void vp__pager_close(vp__device_t *dev) {
  for (uint32_t s = 0; s < dev->vbars.n; s++) {
    vp__vbar_t *vb = dev->vbars.slots[s];
    if (!vb) continue;
    for (uint32_t p = 0; p < vb->npages; p++) vb->pages[p].pins = 0;
    vb->pinned = 0;
    vbar_release(vb);
  }
  vp__table_free(&dev->vbars);
}

/* ------------------------------------------------------------ eviction */

/* Evict unpinned pages of vb ranked >= min_rank, highest rank first, until
 * `bytes` are freed. Each eviction lowers the watermark to the page's rank,
 * so the VBAR stops faulting back what pressure just took. */
int vp__vbar_evict(vp__vbar_t *vb, uint64_t bytes, uint32_t min_rank,
                   uint64_t *freed) {
  uint64_t page = vb->dev->page_size, done = 0;
  for (uint32_t r = vb->npages; r-- > min_rank && done < bytes;) {
    uint32_t p = vb->order[r];
    vp__page_t *pg = &vb->pages[p];
    if (!pg->resident || pg->pins) continue;
    int rc = vp__page_evict(vb, p);
    if (rc) {
      *freed += done;
      return rc;
    }
    done += page;
    if (vb->watermark > r) vb->watermark = r;
  }
  *freed += done;
  return VP_OK;
}

/* Evict lowest priority first until `bytes` are freed (or nothing more can
 * be). Stops below `stop` (exclusive), which may be NULL. */
static int evict_below(vp__device_t *dev, vp__vbar_t *stop, uint64_t bytes,
                       uint64_t *freed) {
  for (vp__vbar_t *vb = dev->bottom; vb && vb != stop && *freed < bytes;
       vb = vb->up) {
    if (vb->resident == vb->pinned) continue;
    int rc = vp__vbar_evict(vb, bytes - *freed, 0, freed);
    if (rc) return rc;
  }
  return VP_OK;
}

int vp__device_evict(vp__device_t *dev, uint64_t bytes, uint64_t *freed) {
  return evict_below(dev, NULL, bytes, freed);
}

/* Pages that make_room could evict for vb: unpinned resident pages of
 * lower-priority VBARs and of vb itself ranked above max_rank. */
static uint64_t evictable_for(vp__vbar_t *vb, uint32_t max_rank) {
  uint64_t pages = 0;
  for (vp__vbar_t *w = vb->dev->bottom; w && w != vb; w = w->up)
    pages += w->resident - w->pinned;
  for (uint32_t r = max_rank + 1; r < vb->npages; r++) {
    const vp__page_t *pg = &vb->pages[vb->order[r]];
    pages += pg->resident && !pg->pins;
  }
  return pages;
}

/* Leave the shortfall in dev->ask for the ledger to take to other
 * processes, when their memory could cover it; keeps the largest of a
 * call's shortfalls. */
static bool note_ask(vp__vbar_t *vb, uint64_t want, uint64_t own) {
  vp__device_t *dev = vb->dev;
  vp__ask_t *a = &dev->ask;
  uint64_t target;
  if (!dev->ledger || !vp__budget_free_bound(dev, want, &target)) return false;
  if (!a->pending || target > a->target)
    *a = (vp__ask_t){a->mode, true, vb->id, target, own};
  return true;
}

/* Make room for `npages` more pages for vb, whose needed pages rank at most
 * max_rank: lower-priority VBARs first, then vb's own pages ranked above
 * max_rank, never a higher-priority VBAR. VP_MISS, evicting nothing, when
 * that cannot free enough: a miss must not cost others their pages. In ask
 * mode FIRST, VP__ASK before any eviction: other processes go first. */
static int make_room(vp__vbar_t *vb, uint32_t npages, uint32_t max_rank) {
  vp__device_t *dev = vb->dev;
  uint64_t allowed, want = (uint64_t)npages << dev->page_shift;
  int rc = vp__budget_allowed(dev, &allowed);
  if (rc) return rc;
  if (dev->committed + want <= allowed) return VP_OK;
  uint64_t need = dev->committed + want - allowed, freed = 0;
  uint64_t own = evictable_for(vb, max_rank) << dev->page_shift;
  if (dev->ask.mode == VP__ASK_FIRST && note_ask(vb, want, own))
    return VP__ASK;
  if (own < need) {
    if (dev->ask.mode == VP__ASK_AFTER) note_ask(vb, want, own);
    return VP_MISS;
  }
  rc = evict_below(dev, vb, need, &freed);
  if (rc == VP_OK && freed < need)
    rc = vp__vbar_evict(vb, need - freed, max_rank + 1, &freed);
  if (rc) return rc;
  return freed >= need ? VP_OK : VP_MISS;
}

/* ------------------------------------------------------- fault / unpin */

static void pin(vp__vbar_t *vb, vp__page_t *pg) {
  if (pg->pins++ == 0) vb->pinned++;
}

static void unpin_one(vp__vbar_t *vb, vp__page_t *pg) {
  if (--pg->pins == 0) vb->pinned--;
}

/* A fault that could not get memory is a miss; any other failure is the
 * device's, and an error. */
static int miss_or_error(vp__vbar_t *vb, int rc) {
  if (rc == VP_MISS || rc == VP_EOOM || rc == VP_EAGAIN) {
    VP__COUNT(vb, misses, 1);
    VP__COUNT(vb, budget_misses, 1);
    return VP_MISS;
  }
  return vp__err(rc, "the %s device failed while making pages resident",
                 vb->dev->caps.name);
}

/* Commit the missing pages of [p0, p1) and pin the whole range. Resident
 * pages are pinned first so making room cannot evict them. */
static int fault_fill(vp__vbar_t *vb, uint32_t p0, uint32_t p1,
                      uint32_t missing, uint32_t max_rank) {
  for (uint32_t p = p0; p < p1; p++)
    if (vb->pages[p].resident) pin(vb, &vb->pages[p]);
  int rc = make_room(vb, missing, max_rank);
  for (uint32_t p = p0; p < p1 && rc == VP_OK; p++) {
    if (vb->pages[p].resident) continue;
    rc = vp__page_commit(vb, p);
    if (rc == VP_OK) pin(vb, &vb->pages[p]);
  }
  if (rc == VP_OK) return VP_OK;
  for (uint32_t p = p0; p < p1; p++)
    if (vb->pages[p].resident) unpin_one(vb, &vb->pages[p]);
  return rc;
}

static int fault_range(vp__vbar_t *vb, uint32_t p0, uint32_t p1,
                       uint32_t *gens) {
  uint32_t lim = vb->watermark < vb->limit ? vb->watermark : vb->limit;
  uint32_t missing = 0, max_rank = 0;
  for (uint32_t p = p0; p < p1; p++) {
    vp__page_t *pg = &vb->pages[p];
    if (pg->pins == UINT32_MAX)
      return vp__err(VP_ELIMIT, "page %u is pinned 2^32-1 times", p);
    if (pg->resident) continue;
    if (vb->rank[p] >= lim) {
      VP__COUNT(vb, misses, 1);
      VP__COUNT(vb, watermark_misses, 1);
      return VP_MISS;
    }
    missing++;
    if (vb->rank[p] > max_rank) max_rank = vb->rank[p];
  }
  if (missing == 0) {
    for (uint32_t p = p0; p < p1; p++) pin(vb, &vb->pages[p]);
    VP__COUNT(vb, hits, 1);
  } else {
    int rc = fault_fill(vb, p0, p1, missing, max_rank);
    if (rc == VP__ASK) return rc;
    if (rc) return miss_or_error(vb, rc);
    VP__COUNT(vb, fills, 1);
  }
  if (gens)
    for (uint32_t p = p0; p < p1; p++) gens[p - p0] = vb->pages[p].gen;
  return VP_OK;
}

/* A fault that returns VP__ASK is made again after the ask: it counts
 * once, then. */
int vp__fault(vp__vbar_t *vb, uint32_t p0, uint32_t p1, uint32_t *gens) {
  int rc = fault_range(vb, p0, p1, gens);
  if (rc != VP__ASK) VP__COUNT(vb, faults, 1);
  return rc;
}

int vp__unpin_check(vp__vbar_t *vb, uint32_t p0, uint32_t p1) {
  for (uint32_t p = p0; p < p1; p++)
    if (vb->pages[p].pins == 0)
      return vp__err(VP_ENOTPINNED, "page %u (offset %llu) is not pinned", p,
                     (unsigned long long)p << vb->dev->page_shift);
  return VP_OK;
}

/* Work on other streams that still uses these pages must finish before the
 * new fence completes, so that one fence per page is enough. */
int vp__order_after(vp__vbar_t *vb, uint32_t p0, uint32_t p1,
                    vp_stream_t stream) {
  vp__device_t *dev = vb->dev;
  vp__fence_t *last = NULL;
  for (uint32_t p = p0; p < p1; p++) {
    vp__fence_t *f = vb->pages[p].fence;
    if (!f || f == last || f->stream == stream) continue;
    last = f;
    if (vp__be_event_query(dev, f->event) == VP_OK) continue;
    int rc = vp__be_stream_wait_event(dev, stream, f->event);
    if (rc)
      return vp__err(rc, "ordering stream 0x%llx after earlier work failed",
                     (unsigned long long)stream);
  }
  return VP_OK;
}

void vp__unpin_attach(vp__vbar_t *vb, uint32_t p0, uint32_t p1,
                      vp__fence_t *f) {
  for (uint32_t p = p0; p < p1; p++) {
    vp__page_t *pg = &vb->pages[p];
    if (pg->fence) vp__fence_put(vb->dev, pg->fence);
    pg->fence = f;
    f->refs++;
    unpin_one(vb, pg);
  }
}

void vp__unpin_attach_fill(vp__vbar_t *vb, uint32_t p0, uint32_t p1,
                           vp__fence_t *f) {
  for (uint32_t p = p0; p < p1; p++) {
    vp__page_t *pg = &vb->pages[p];
    if (pg->fill) vp__fence_put(vb->dev, pg->fill);
    pg->fill = f; /* the copy stream is in order: f implies the older fill */
    f->refs++;
    unpin_one(vb, pg);
  }
}

/* Drop pins that no queued work used (the page keeps its last fence). */
void vp__unpin_nofence(vp__vbar_t *vb, uint32_t p0, uint32_t p1) {
  for (uint32_t p = p0; p < p1; p++) unpin_one(vb, &vb->pages[p]);
}

int vp__unpin(vp__vbar_t *vb, uint32_t p0, uint32_t p1, vp_stream_t stream) {
  vp__fence_t *f;
  int rc = vp__unpin_check(vb, p0, p1);
  if (rc || (rc = vp__order_after(vb, p0, p1, stream)) ||
      (rc = vp__fence_get(vb->dev, stream, &f)))
    return rc;
  vp__unpin_attach(vb, p0, p1, f);
  vp__fence_put(vb->dev, f);
  VP__COUNT(vb, unpins, 1);
  return VP_OK;
}
