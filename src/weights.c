/* Weights: the registry of a VBAR's weights (sorted by offset, in the
 * order created, found by handle), their sources, fill generations and
 * per-stream holds. */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* True while w's last fill may still be running on the copy stream. */
bool vp__weight_copy_pending(vp__device_t *dev, vp__weight_t *w) {
  if (!w->copy_fence) return false;
  /* Copy-stream fences complete in order: one seen done answers for the
   * older ones (the weights of one merged batch share a fence) without
   * asking the device again. */
  if (w->copy_fence->seq > dev->copy_done_seq) {
    if (vp__be_event_query(dev, w->copy_fence->event) != VP_OK)
      return true;
    dev->copy_done_seq = w->copy_fence->seq;
  }
  vp__fence_put(dev, w->copy_fence);
  w->copy_fence = NULL;
  return false;
}


/* The copy of w's last fill waited for (its source may go after). */
static void weight_wait_copy(vp__device_t *dev, vp__weight_t *w) {
  if (w->copy_fence) {
    if (vp__weight_copy_pending(dev, w)) vp__fence_wait(dev, w->copy_fence);
    if (w->copy_fence) vp__fence_put(dev, w->copy_fence);
    w->copy_fence = NULL;
  }
}

/* w lets go of the bytes its source gave it: its staging slot, if any,
 * becomes anyone's, and copies from the source that may still be queued
 * are waited for (the caller may free the source next). */
static void weight_drop_bytes(vp__device_t *dev, vp__weight_t *w) {
  if (w->slot) { /* its bytes serve nobody now: reclaimable by anyone */
    if (w->slot->prefetched)
      VP__COUNT(w->vb, prefetch_dropped_bytes, w->size);
    w->slot->prefetched = false;
    w->slot->owner = NULL;
    w->slot = NULL;
  }
  weight_wait_copy(dev, w);
}

static void weight_free(vp__device_t *dev, vp__weight_t *w) {
  weight_drop_bytes(dev, w);
  vp__table_remove(&dev->weights, w->id);
  if (w->holds != w->few_holds) free(w->holds);
  free(w->gens);
  free(w);
}

/* ---------------------------------------------------------------- holds */

vp__hold_t *vp__hold_find(const vp__weight_t *w, vp_stream_t stream) {
  for (uint32_t i = 0; i < w->nholds; i++)
    if (w->holds[i].stream == stream) return &w->holds[i];
  return NULL;
}

/* w's hold on `stream`, added (empty) if it has none. */
int vp__hold_get(vp__device_t *dev, vp__weight_t *w, vp_stream_t stream,
                    vp__hold_t **out) {
  if ((*out = vp__hold_find(w, stream))) return VP_OK;
  if (w->nholds == w->holds_cap) {
    uint32_t cap = w->holds_cap * 2;
    vp__hold_t *l = NULL;
    if (vp__inject_fail(&dev->inject) || !(l = malloc(cap * sizeof *l)))
      return vp__err(VP_ENOMEM, "no memory for a weight's holds");
    memcpy(l, w->holds, w->nholds * sizeof *l);
    if (w->holds != w->few_holds) free(w->holds);
    w->holds = l;
    w->holds_cap = cap;
  }
  *out = &w->holds[w->nholds++];
  **out = (vp__hold_t){.stream = stream};
  return VP_OK;
}

/* Forget w's hold on `stream` once nothing is held on it. */
void vp__hold_trim(vp__weight_t *w, vp_stream_t stream) {
  vp__hold_t *h = vp__hold_find(w, stream);
  if (h && !h->resident && !h->staged) *h = w->holds[--w->nholds];
}

static int source_check(const vp_source_t *s, size_t i) {
  if (s->kind == VP_SOURCE_NONE) return VP_OK;
  if (s->kind == VP_SOURCE_HOST && s->host) return VP_OK;
  if (s->kind == VP_SOURCE_FILE && s->fd >= 0) return VP_OK;
  return vp__err(VP_EINVAL, "weight %zu: source kind %d with %s", i, s->kind,
                 s->kind == VP_SOURCE_HOST ? "a NULL host pointer"
                 : s->kind == VP_SOURCE_FILE ? "a negative fd"
                 : "an unknown kind");
}

/* Index of the first weight of vb at or after offset. */
static uint32_t lower_bound(const vp__vbar_t *vb, uint64_t offset) {
  uint32_t lo = 0, hi = vb->nweights;
  while (lo < hi) {
    uint32_t mid = lo + (hi - lo) / 2;
    if (vb->weights[mid]->offset < offset) lo = mid + 1; else hi = mid;
  }
  return lo;
}

/* Pins that acquires of weights hold on page p: each resident acquire pins
 * every page of its weight once. Weights do not overlap, so only the one
 * before the first weight starting in p can reach into it. */
static uint32_t weight_pins(const vp__vbar_t *vb, uint32_t p) {
  uint32_t i = lower_bound(vb, (uint64_t)p << vb->dev->page_shift), n = 0;
  if (i > 0 && vb->weights[i - 1]->p1 > p) n += vb->weights[i - 1]->acq_resident;
  for (; i < vb->nweights && vb->weights[i]->p0 <= p; i++)
    n += vb->weights[i]->acq_resident;
  return n;
}

int vp__unpin_check_owned(const vp__vbar_t *vb, uint32_t p0, uint32_t p1) {
  if (vb->acquired == 0) return VP_OK; /* every pin is a fault's */
  for (uint32_t p = p0; p < p1; p++)
    if (vb->pages[p].pins && vb->pages[p].pins <= weight_pins(vb, p))
      return vp__err(VP_ENOTPINNED, "page %u (offset %llu) is pinned only by "
                     "acquired weights, which a release ends", p,
                     (unsigned long long)p << vb->dev->page_shift);
  return VP_OK;
}

static bool overlaps_existing(const vp__vbar_t *vb, uint64_t off,
                              uint64_t size) {
  uint32_t i = lower_bound(vb, off);
  if (i < vb->nweights && vb->weights[i]->offset < off + size) return true;
  return i > 0 &&
         vb->weights[i - 1]->offset + vb->weights[i - 1]->size > off;
}

static int weights_check(vp__vbar_t *vb, size_t n, const uint64_t *offsets,
                         const uint64_t *sizes, const vp_source_t *srcs) {
  for (size_t i = 0; i < n; i++) {
    uint64_t off = offsets[i], size = sizes[i];
    if (size == 0 || off >= vb->size || size > vb->size - off)
      return vp__err(size ? VP_ERANGE : VP_EINVAL, "weight %zu [%llu, +%llu) "
                     "is empty or outside the VBAR of %llu bytes", i,
                     (unsigned long long)off, (unsigned long long)size,
                     (unsigned long long)vb->size);
    if (srcs && source_check(&srcs[i], i)) return VP_EINVAL;
    if (overlaps_existing(vb, off, size))
      return vp__err(VP_EINVAL, "weight %zu at %llu overlaps an existing "
                     "weight", i, (unsigned long long)off);
    for (size_t j = 0; j < i; j++)
      if (offsets[j] < off + size && off < offsets[j] + sizes[j])
        return vp__err(VP_EINVAL, "weights %zu and %zu overlap", j, i);
  }
  return VP_OK;
}

static int weight_new(vp__vbar_t *vb, uint64_t off, uint64_t size,
                      const vp_source_t *src, vp__weight_t **out) {
  vp__device_t *dev = vb->dev;
  vp__weight_t *w = NULL;
  int shift = dev->page_shift;
  uint32_t p0 = (uint32_t)(off >> shift);
  uint32_t p1 = (uint32_t)(((off + size - 1) >> shift) + 1);
  if (vp__inject_fail(&dev->inject) || !(w = calloc(1, sizeof *w)) ||
      !(w->gens = calloc(p1 - p0, sizeof *w->gens))) {
    if (w) free(w);
    return vp__err(VP_ENOMEM, "no memory for a weight");
  }
  *w = (vp__weight_t){.vb = vb, .offset = off, .size = size, .p0 = p0,
                      .p1 = p1, .gens = w->gens, .holds_cap = FEW_HOLDS,
                      .lookahead = VP_LOOKAHEAD_DEVICE};
  w->holds = w->few_holds;
  if (src) w->src = *src;
  int rc = vp__table_add(dev, &dev->weights, w, &w->id);
  if (rc) {
    free(w->gens);
    free(w);
    return rc;
  }
  *out = w;
  return VP_OK;
}

static int weight_list_reserve(vp__vbar_t *vb, size_t more) {
  if (vb->nweights + more <= vb->weights_cap) return VP_OK;
  size_t cap = vb->weights_cap ? vb->weights_cap : 16;
  while (cap < vb->nweights + more) cap *= 2;
  vp__weight_t **l = NULL, **u = NULL;
  if (cap > UINT32_MAX || vp__inject_fail(&vb->dev->inject) ||
      !(l = realloc(vb->weights, cap * sizeof *l)))
    return vp__err(VP_ENOMEM, "no memory for the list");
  vb->weights = l;
  if (!(u = realloc(vb->use, cap * sizeof *u))) /* both or the old cap */
    return vp__err(VP_ENOMEM, "no memory for the list");
  vb->use = u;
  vb->weights_cap = (uint32_t)cap;
  return VP_OK;
}

static void weight_list_insert(vp__vbar_t *vb, vp__weight_t *w) {
  uint32_t i = lower_bound(vb, w->offset);
  memmove(&vb->weights[i + 1], &vb->weights[i],
          (vb->nweights - i) * sizeof *vb->weights);
  vb->weights[i] = w;
  w->use_index = vb->nweights;
  vb->use[vb->nweights++] = w;
  vb->skip_ok = false;
  for (uint32_t j = i; j < vb->nweights; j++) vb->weights[j]->index = j;
}

int vp_weights_create(vp_vbar_t h, size_t n, const uint64_t *offsets,
                      const uint64_t *sizes, const vp_source_t *srcs,
                      vp_weight_t *out) {
  VP__ENTER();
  if (!n || !offsets || !sizes || !out)
    return vp__err(VP_EINVAL, "n is 0 or an array is NULL");
  vp__vbar_t *vb = NULL;
  int rc = vp__vbar_enter(h, &vb);
  if (rc) return rc;
  vp__device_t *dev = vb->dev;
  if ((rc = weights_check(vb, n, offsets, sizes, srcs)) ||
      (rc = weight_list_reserve(vb, n)))
    return vp__unlock(dev, rc);
  size_t made = 0;
  vp__weight_t **ws = malloc(n * sizeof *ws);
  if (!ws) return vp__unlock(dev, vp__err(VP_ENOMEM, "no memory"));
  for (; made < n && rc == VP_OK; made++)
    rc = weight_new(vb, offsets[made], sizes[made], srcs ? &srcs[made] : NULL,
                    &ws[made]);
  if (rc) {
    for (size_t i = 0; i + 1 < made; i++) weight_free(dev, ws[i]);
  } else {
    for (size_t i = 0; i < n; i++) {
      weight_list_insert(vb, ws[i]);
      out[i].id = ws[i]->id;
    }
    vb->prefetch_idle = false;
    vb->win_ok = false;
    /* Interleaved ranks follow the weights while nothing is resident. */
    if (vb->order_kind == VP_ORDER_INTERLEAVED && !vb->resident)
      vp__weights_set_order(vb, VP_ORDER_INTERLEAVED);
  }
  free(ws);
  return vp__unlock(dev, rc);
}

/* vp_weights_move: the places the VBAR's weights will have, sorted, with
 * no two overlapping. */
typedef struct {
  uint64_t offset, size;
} place_t;

static int place_cmp(const void *a, const void *b) {
  const place_t *x = a, *y = b;
  return x->offset < y->offset ? -1 : x->offset > y->offset;
}

static int by_offset(const void *a, const void *b) {
  const vp__weight_t *x = *(vp__weight_t *const *)a;
  const vp__weight_t *y = *(vp__weight_t *const *)b;
  return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Checks for vp_weights_move, before anything changes: every weight of vb,
 * listed once, not acquired, and the new places inside the VBAR and apart
 * from each other and from the weights that stay. moved[i]: ws[i] changes
 * its offset. */
static int move_check(vp__vbar_t *vb, size_t n, vp__weight_t **ws,
                      const uint64_t *offsets, bool *moved) {
  uint32_t nw = vb->nweights;
  uint8_t *listed = calloc(nw ? nw : 1, 1);
  place_t *pl = malloc((nw ? nw : 1) * sizeof *pl);
  int rc = VP_OK;
  if (vp__inject_fail(&vb->dev->inject) || !listed || !pl) {
    rc = vp__err(VP_ENOMEM, "no memory to check the places");
    goto out;
  }
  for (size_t i = 0; i < n && rc == VP_OK; i++) {
    vp__weight_t *w = ws[i];
    if (w->vb != vb)
      rc = vp__err(VP_EINVAL, "weights[%zu] belongs to another VBAR", i);
    else if (listed[w->index]++)
      rc = vp__err(VP_EINVAL, "weights[%zu] is listed twice", i);
    else if (w->acq_resident || w->acq_staged)
      rc = vp__err(VP_EBUSY, "weights[%zu] is acquired; release it first", i);
    else if (offsets[i] >= vb->size || w->size > vb->size - offsets[i])
      rc = vp__err(VP_ERANGE, "weights[%zu] at %llu (+%llu) is outside the "
                   "VBAR of %llu bytes", i, (unsigned long long)offsets[i],
                   (unsigned long long)w->size,
                   (unsigned long long)vb->size);
    else
      moved[i] = offsets[i] != w->offset;
  }
  if (rc) goto out;
  for (uint32_t j = 0; j < nw; j++)
    pl[j] = (place_t){vb->weights[j]->offset, vb->weights[j]->size};
  for (size_t i = 0; i < n; i++) pl[ws[i]->index].offset = offsets[i];
  qsort(pl, nw, sizeof *pl, place_cmp);
  for (uint32_t j = 1; j < nw && rc == VP_OK; j++)
    if (pl[j - 1].offset + pl[j - 1].size > pl[j].offset)
      rc = vp__err(VP_EINVAL, "the new places overlap at offset %llu",
                   (unsigned long long)pl[j].offset);
out:
  free(listed);
  free(pl);
  return rc;
}

int vp_weights_move(vp_vbar_t h, size_t n, const vp_weight_t *w,
                    const uint64_t *offsets) {
  VP__ENTER();
  if (!n || !w || !offsets)
    return vp__err(VP_EINVAL, "n is 0 or an array is NULL");
  vp__vbar_t *vb = NULL;
  int rc = vp__vbar_enter(h, &vb);
  if (rc) return rc;
  vp__device_t *dev = vb->dev;
  int shift = dev->page_shift;
  vp__weight_t **ws = calloc(n, sizeof *ws), **use = NULL;
  uint32_t **gens = calloc(n, sizeof *gens);
  bool *moved = calloc(n, sizeof *moved);
  if (vp__inject_fail(&dev->inject) || !ws || !gens || !moved ||
      !(use = malloc((vb->nweights ? vb->nweights : 1) * sizeof *use))) {
    rc = vp__err(VP_ENOMEM, "no memory to move %zu weights", n);
    goto out;
  }
  if ((rc = vp__weights_find(dev, w, n, ws)) ||
      (rc = move_check(vb, n, ws, offsets, moved)))
    goto out;
  for (size_t i = 0; i < n; i++) { /* the new pages' generations */
    if (!moved[i]) continue;
    uint64_t p0 = offsets[i] >> shift;
    uint64_t p1 = ((offsets[i] + ws[i]->size - 1) >> shift) + 1;
    if (!(gens[i] = calloc(p1 - p0, sizeof **gens))) {
      rc = vp__err(VP_ENOMEM, "no memory to move %zu weights", n);
      goto out;
    }
  }
  /* Nothing fails from here on. */
  vp__weight_t *last = vb->acq_index < vb->nweights ? vb->use[vb->acq_index]
                                                    : NULL;
  for (size_t i = 0; i < n; i++) {
    vp__weight_t *x = ws[i];
    if (!moved[i]) continue;
    /* Its bytes stay where they were: filled anew at its new place. */
    weight_drop_bytes(dev, x);
    if (x->prefetched) {
      VP__COUNT(vb, prefetch_dropped_bytes, x->size);
      x->prefetched = false;
    }
    free(x->gens);
    x->gens = gens[i];
    gens[i] = NULL;
    x->offset = offsets[i];
    x->p0 = (uint32_t)(x->offset >> shift);
    x->p1 = (uint32_t)(((x->offset + x->size - 1) >> shift) + 1);
  }
  /* Prefetch order: the listed weights as given, then the others. */
  uint32_t k = 0;
  for (size_t i = 0; i < n; i++) ws[i]->listed = 1;
  for (size_t i = 0; i < n; i++) use[k++] = ws[i];
  for (uint32_t j = 0; j < vb->nweights; j++)
    if (!vb->use[j]->listed) use[k++] = vb->use[j];
  for (size_t i = 0; i < n; i++) ws[i]->listed = 0;
  memcpy(vb->use, use, k * sizeof *use);
  for (uint32_t j = 0; j < k; j++) vb->use[j]->use_index = j;
  qsort(vb->weights, vb->nweights, sizeof *vb->weights, by_offset);
  for (uint32_t j = 0; j < vb->nweights; j++) vb->weights[j]->index = j;
  if (last) vb->acq_index = last->use_index;
  vb->skip_ok = vb->win_ok = vb->prefetch_idle = false;
  if (vb->order_kind == VP_ORDER_INTERLEAVED && !vb->resident)
    vp__weights_set_order(vb, VP_ORDER_INTERLEAVED);
out:
  if (gens)
    for (size_t i = 0; i < n; i++) free(gens[i]);
  free(gens);
  free(moved);
  free(use);
  free(ws);
  return vp__unlock(dev, rc);
}

/* mark[p] for each page of vb that a weight touches: GROUP_START, or
 * GROUP_JOINED when a weight spans it and the page before. */
static void mark_pages(const vp__vbar_t *vb, uint8_t *mark) {
  for (uint32_t i = 0; i < vb->nweights; i++) {
    const vp__weight_t *w = vb->weights[i];
    if (!mark[w->p0]) mark[w->p0] = VP__PAGE_GROUP_START;
    for (uint32_t p = w->p0 + 1; p < w->p1; p++)
      mark[p] = VP__PAGE_GROUP_JOINED;
  }
}

/* The pager's order, told where the weights are: interleaved eviction then
 * takes whole weights (without memory for the marks, pages one by one). */
void vp__weights_set_order(vp__vbar_t *vb, int kind) {
  uint8_t *mark = NULL;
  if (kind == VP_ORDER_INTERLEAVED && vb->nweights &&
      (mark = calloc(vb->npages, 1)))
    mark_pages(vb, mark);
  vp__vbar_set_order(vb, kind, mark);
  free(mark);
}

static void weight_unlist(vp__weight_t *w) {
  vp__vbar_t *vb = w->vb;
  memmove(&vb->weights[w->index], &vb->weights[w->index + 1],
          (vb->nweights - w->index - 1) * sizeof *vb->weights);
  memmove(&vb->use[w->use_index], &vb->use[w->use_index + 1],
          (vb->nweights - w->use_index - 1) * sizeof *vb->use);
  vb->nweights--;
  vb->skip_ok = vb->win_ok = false;
  for (uint32_t j = w->index; j < vb->nweights; j++)
    vb->weights[j]->index = j;
  for (uint32_t j = w->use_index; j < vb->nweights; j++)
    vb->use[j]->use_index = j;
}

/* Lock the device of weight h; VP_EBUSY (unlocked again) while it is
 * acquired. */
static int weight_lock_idle(vp_weight_t h, vp__device_t **dev,
                            vp__weight_t **w) {
  int rc = vp__handle_lock(h.id, offsetof(vp__device_t, weights), "weight",
                           dev, (void **)w);
  if (rc) return rc;
  if ((*w)->acq_resident || (*w)->acq_staged)
    return vp__unlock(*dev, vp__err(VP_EBUSY, "the weight is acquired; "
                                    "release it first"));
  return VP_OK;
}

/* Weight h takes its bytes from *src from now on (vp_weight_set_source,
 * vp_weight_swap_source). `same`: src holds what its last acquire used (as
 * the caller left them), so its pages and a staged slot an acquire used
 * stay; else they hold the old bytes: "never filled", so the next acquire
 * fills them from src (and prefetch looks at it again). Bytes copied ahead
 * of an acquire (prefetch, in place or staged) go either way: the caller
 * never saw them. */
static int weight_change_source(vp_weight_t h, const vp_source_t *src,
                                bool same) {
  if (!src) return vp__err(VP_EINVAL, "src is NULL");
  if (source_check(src, 0)) return VP_EINVAL;
  vp__device_t *dev;
  vp__weight_t *w;
  int rc = weight_lock_idle(h, &dev, &w);
  if (rc) return rc;
  bool refill = !same || w->prefetched;
  if (!same || (w->slot && w->slot->prefetched))
    weight_drop_bytes(dev, w);
  else
    weight_wait_copy(dev, w);
  if (w->prefetched) {
    VP__COUNT(w->vb, prefetch_dropped_bytes, w->size);
    w->prefetched = false;
  }
  if (refill) memset(w->gens, 0, (size_t)(w->p1 - w->p0) * sizeof *w->gens);
  w->src = *src;
  vp__vbar_t *vb = w->vb;
  vb->skip_ok = vb->win_ok = vb->prefetch_idle = false;
  return vp__unlock(dev, VP_OK);
}

int vp_weight_set_source(vp_weight_t h, const vp_source_t *src) {
  VP__ENTER();
  return weight_change_source(h, src, false);
}

int vp_weight_swap_source(vp_weight_t h, const vp_source_t *src) {
  VP__ENTER();
  return weight_change_source(h, src, true);
}

/* A window is read only by the prefetch that follows an acquire (and by
 * the release top-up), so it may change while the weight is acquired. */
int vp_weight_set_lookahead(vp_weight_t h, uint64_t bytes) {
  VP__ENTER();
  vp__device_t *dev;
  vp__weight_t *w;
  int rc = vp__handle_lock(h.id, offsetof(vp__device_t, weights), "weight",
                           &dev, (void **)&w);
  if (rc) return rc;
  w->lookahead = bytes;
  return vp__unlock(dev, VP_OK);
}

int vp_weight_get_lookahead(vp_weight_t h, uint64_t *bytes) {
  VP__ENTER();
  if (!bytes) return vp__err(VP_EINVAL, "bytes is NULL");
  vp__device_t *dev;
  vp__weight_t *w;
  int rc = vp__handle_lock(h.id, offsetof(vp__device_t, weights), "weight",
                           &dev, (void **)&w);
  if (rc) return rc;
  *bytes = w->lookahead;
  return vp__unlock(dev, VP_OK);
}

int vp_weight_destroy(vp_weight_t h) {
  VP__ENTER();
  vp__device_t *dev;
  vp__weight_t *w;
  int rc = weight_lock_idle(h, &dev, &w);
  if (rc) return rc;
  weight_unlist(w);
  weight_free(dev, w);
  return vp__unlock(dev, VP_OK);
}

static void drop_vbar(vp__vbar_t *vb) {
  for (uint32_t i = 0; i < vb->nweights; i++)
    weight_free(vb->dev, vb->weights[i]);
  free(vb->weights);
  free(vb->use);
  free(vb->skip);
  vb->weights = vb->use = NULL;
  vb->skip = NULL;
  vb->skip_ok = false;
  vb->nweights = vb->weights_cap = 0;
}

/* Look up n weight handles of dev. */
int vp__weights_find(vp__device_t *dev, const vp_weight_t *h, size_t n,
                     vp__weight_t **ws) {
  for (size_t i = 0; i < n; i++)
    if (!(ws[i] = vp__table_get(&dev->weights, h[i].id)))
      return vp__err(VP_EHANDLE, "weights[%zu] (0x%llx) is not a live weight "
                     "of this device", i, (unsigned long long)h[i].id);
  return VP_OK;
}


/* vp_vbar_destroy: a VBAR goes with its weights, once none is acquired and
 * no page is pinned. */
int vp__weights_vbar_destroy(vp__vbar_t *vb) {
  int rc = vp__vbar_check_free(vb);
  if (rc) return rc;
  if (vb->acquired)
    return vp__err(VP_EBUSY, "%u of its weights are still acquired; release "
                   "them first", vb->acquired);
  drop_vbar(vb);
  return vp__vbar_free(vb);
}

/* Device close: every VBAR's weights (the copy stream is idle by now). */
void vp__weights_close(vp__device_t *dev) {
  for (uint32_t s = 0; s < dev->vbars.n; s++)
    if (dev->vbars.slots[s]) drop_vbar(dev->vbars.slots[s]);
  vp__table_free(&dev->weights);
}
