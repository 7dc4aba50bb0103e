/* Streaming: weights and their sources, vp_acquire / vp_release, the VRAM
 * staging ring for misses, and prefetch.
 *
 * Every copy runs on the device's copy stream; a caller's stream waits for
 * it on the device (an event), so the CPU never waits for a copy and the
 * copy engine works while the caller's kernels run. After each acquire the
 * next weights of the VBAR that need a copy (up to lookahead bytes of them,
 * in offset order, wrapping to the start for the next pass) are filled or
 * staged ahead of need.
 *
 * The staging ring is an internal VBAR whose pages stay pinned. Its slots
 * are kept sorted by offset; a new one takes the first gap that fits, and
 * when none does the least recently used slot no acquire holds is
 * reclaimed. A slot keeps its weight's bytes until reclaimed, so a staged
 * weight acquired again soon costs no copy. A slot is reused only after its
 * release fence: the copy stream waits for that fence on the device. */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define SLOT_ALIGN 256 /* staging slots start at aligned device addresses */

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
  uint32_t index;         /* in vb->weights */
} vp__weight_t;

struct vp__slot {
  uint64_t off, size;
  vp__weight_t *owner; /* NULL once the weight let go of it */
  vp__fence_t *fence;  /* release fence: readers of the slot */
  uint32_t refs;       /* acquires holding it */
  bool prefetched;     /* filled ahead of need and not acquired yet */
  uint64_t used;       /* when last acquired or released (LRU) */
};

typedef struct vp__staging {
  vp__vbar_t *vb;    /* internal VBAR, every page pinned */
  uint64_t size;
  vp__slot_t **slots; /* sorted by offset */
  size_t n, cap;
  uint64_t clock;    /* ticks at each use, for LRU */
} vp__staging_t;

/* A pending host-to-device copy; adjacent ones are merged. */
typedef struct copy {
  uint64_t dst, size;
  const vp_source_t *src;
  uint64_t src_off; /* into the source */
} copy_t;

/* What the caller's stream must wait for: the newest copy-stream fence of
 * the weights it takes, or (tail) everything queued on the copy stream. */
typedef struct waits {
  vp__fence_t *newest;
  bool tail;
} waits_t;

typedef struct batch {
  copy_t *c;
  size_t n, cap;
  vp__weight_t **filled; /* weights whose copies these are */
  size_t nfilled, filled_cap;
} batch_t;

/* Room for one more element in *arr (of *cap elements of `size`). */
static int grow(vp__device_t *dev, void **arr, size_t *cap, size_t used,
                size_t size) {
  if (used < *cap) return VP_OK;
  size_t n = *cap ? *cap * 2 : 16;
  void *p = NULL;
  if (vp__inject_fail(&dev->inject) || !(p = realloc(*arr, n * size)))
    return vp__err(VP_ENOMEM, "vp_acquire: no memory for the copy list");
  *arr = p;
  *cap = n;
  return VP_OK;
}

/* ------------------------------------------------------------ copies */

int vp__copy_stream(vp__device_t *dev, vp_stream_t *out) {
  if (!dev->copy_stream) {
    int rc = dev->be->stream_create(dev->ctx, &dev->copy_stream);
    if (rc) {
      dev->copy_stream = 0;
      return vp__err(vp__be_result(dev, rc, "stream_create"),
                     "creating the copy stream failed");
    }
  }
  *out = dev->copy_stream;
  return VP_OK;
}

static int batch_add(vp__device_t *dev, batch_t *b, vp__weight_t *w,
                     uint64_t dst) {
  int rc = grow(dev, (void **)&b->c, &b->cap, b->n, sizeof *b->c);
  if (rc || (rc = grow(dev, (void **)&b->filled, &b->filled_cap, b->nfilled,
                       sizeof *b->filled)))
    return rc;
  copy_t *last = b->n ? &b->c[b->n - 1] : NULL;
  b->filled[b->nfilled++] = w;
  /* Merge with the previous copy when both ends continue it. */
  if (last && last->dst + last->size == dst && last->src->kind == w->src.kind &&
      ((w->src.kind == VP_SOURCE_HOST &&
        (const char *)last->src->host + last->src_off + last->size ==
            (const char *)w->src.host) ||
       (w->src.kind == VP_SOURCE_FILE && last->src->fd == w->src.fd &&
        last->src->file_offset + last->src_off + last->size ==
            w->src.file_offset))) {
    last->size += w->size;
    return VP_OK;
  }
  b->c[b->n++] = (copy_t){dst, w->size, &w->src, 0};
  return VP_OK;
}

static int copy_one(vp__device_t *dev, const copy_t *c, vp_stream_t cs) {
  if (c->src->kind == VP_SOURCE_FILE)
    return vp__file_read(dev, c->src->fd, c->src->file_offset + c->src_off,
                         c->size, c->dst, cs, "a weight's source file");
  /* Split at host buffer chunk edges: CUDA copies cannot span two. */
  int rc = vp__copy_htod(dev, c->dst, (const char *)c->src->host + c->src_off,
                         c->size, cs, true);
  if (rc)
    return vp__err(vp__be_result(dev, rc, "copy_htod"),
                   "copying %llu bytes to 0x%llx failed",
                   (unsigned long long)c->size, (unsigned long long)c->dst);
  return VP_OK;
}

/* Issue the batch on the copy stream and record one fence after it, which
 * every weight filled by the batch keeps until it is seen complete.
 * *fence (may be NULL) gets a reference to it. */
static int batch_issue(vp__device_t *dev, batch_t *b, vp__fence_t **fence) {
  vp_stream_t cs;
  vp__fence_t *f;
  int rc = vp__copy_stream(dev, &cs);
  for (size_t i = 0; i < b->n && rc == VP_OK; i++) {
    rc = copy_one(dev, &b->c[i], cs);
    if (rc == VP_OK) dev->stats.copies++;
  }
  if (rc == VP_OK) rc = vp__fence_get(dev, cs, &f);
  if (rc) return rc;
  for (size_t i = 0; i < b->nfilled; i++) {
    vp__weight_t *w = b->filled[i];
    if (w->copy_fence) vp__fence_put(dev, w->copy_fence);
    w->copy_fence = f;
    f->refs++;
  }
  b->n = b->nfilled = 0;
  if (fence) *fence = f; else vp__fence_put(dev, f);
  return VP_OK;
}

/* True while w's last fill may still be running on the copy stream. */
static bool copy_pending(vp__device_t *dev, vp__weight_t *w) {
  if (!w->copy_fence) return false;
  if (dev->be->event_query(dev->ctx, w->copy_fence->event) != VP_OK)
    return true;
  vp__fence_put(dev, w->copy_fence);
  w->copy_fence = NULL;
  return false;
}

/* The caller waits for w's fill only if it may still be running, and then
 * only for the newest such fill among the weights it takes. */
static void wait_for_copy(vp__device_t *dev, vp__weight_t *w, waits_t *wait) {
  if (copy_pending(dev, w) &&
      (!wait->newest || w->copy_fence->seq > wait->newest->seq))
    wait->newest = w->copy_fence;
}

/* ------------------------------------------------------- staging ring */

static int staging_open(vp__device_t *dev) {
  vp__staging_t *st = NULL;
  vp__vbar_t *vb = NULL;
  uint64_t size = dev->opts.staging_size;
  if (size < dev->page_size) size = dev->page_size;
  if (vp__inject_fail(&dev->inject) || !(st = calloc(1, sizeof *st)))
    return vp__err(VP_ENOMEM, "vp_acquire: no memory for the staging ring");
  int rc = vp__vbar_new_internal(dev, size, &vb);
  if (rc) goto fail;
  rc = vp__fault(vb, 0, vb->npages, NULL);
  if (rc) {
    vp__vbar_free(vb);
    if (rc == VP_MISS)
      rc = vp__err(VP_EOOM, "vp_acquire: no device memory for the %llu MiB "
                   "staging ring (lower staging_size or free memory)",
                   (unsigned long long)(size >> 20));
    goto fail;
  }
  st->vb = vb;
  st->size = vb->size;
  dev->staging = st;
  return VP_OK;
fail:
  free(st);
  return rc;
}

/* Free slot k: its next user writes it on the copy stream, so the copy
 * stream waits (on the device) for the readers' release fence. */
static int ring_reclaim(vp__device_t *dev, vp__staging_t *st, size_t k) {
  vp__slot_t *s = st->slots[k];
  if (s->fence) {
    if (dev->be->event_query(dev->ctx, s->fence->event) != VP_OK) {
      vp_stream_t cs;
      int rc = vp__copy_stream(dev, &cs);
      if (rc == VP_OK)
        rc = dev->be->stream_wait_event(dev->ctx, cs, s->fence->event);
      if (rc) return vp__be_result(dev, rc, "stream_wait_event");
      dev->stats.ring_waits++;
    }
    vp__fence_put(dev, s->fence);
  }
  if (s->owner) {
    if (s->prefetched)
      VP__COUNT(s->owner->vb, prefetch_dropped_bytes, s->owner->size);
    s->owner->slot = NULL;
    s->owner->vb->prefetch_idle = false;
  }
  free(s);
  memmove(&st->slots[k], &st->slots[k + 1],
          (st->n - k - 1) * sizeof *st->slots);
  st->n--;
  return VP_OK;
}

/* Index before which a slot of `size` fits (its offset in *off), or
 * SIZE_MAX: the first gap that is large enough. */
static size_t ring_fit(const vp__staging_t *st, uint64_t size, uint64_t *off) {
  uint64_t end = 0;
  for (size_t k = 0; k <= st->n; k++) {
    uint64_t next = k < st->n ? st->slots[k]->off : st->size;
    if (next - end >= size) return *off = end, k;
    if (k < st->n) end = st->slots[k]->off + st->slots[k]->size;
  }
  return SIZE_MAX;
}

/* The least recently used slot that may be reclaimed, or SIZE_MAX. Held
 * slots never are; prefetched ones not by another prefetch. */
static size_t ring_victim(const vp__staging_t *st, bool keep_prefetch) {
  size_t best = SIZE_MAX;
  for (size_t k = 0; k < st->n; k++) {
    const vp__slot_t *s = st->slots[k];
    if (s->refs || (keep_prefetch && s->prefetched)) continue;
    if (best == SIZE_MAX || s->used < st->slots[best]->used) best = k;
  }
  return best;
}

/* A staging slot for w. VP_MISS when the ring has no room (for prefetch,
 * which never drops other prefetched slots); VP_ELIMIT for an acquire. */
static int ring_alloc(vp__device_t *dev, vp__weight_t *w, bool prefetch,
                      vp__slot_t **out) {
  int rc = dev->staging ? VP_OK : staging_open(dev);
  if (rc) return rc;
  vp__staging_t *st = dev->staging;
  uint64_t size = (w->size + SLOT_ALIGN - 1) & ~(uint64_t)(SLOT_ALIGN - 1);
  uint64_t off = 0;
  size_t k, victim;
  while ((k = ring_fit(st, size, &off)) == SIZE_MAX) {
    if ((victim = ring_victim(st, prefetch)) == SIZE_MAX) {
      if (prefetch) return VP_MISS;
      return vp__err(VP_ELIMIT, "vp_acquire: a weight of %llu bytes does not "
                     "fit in the %llu-byte staging ring beside the weights "
                     "acquired and not released (raise staging_size)",
                     (unsigned long long)w->size,
                     (unsigned long long)st->size);
    }
    if ((rc = ring_reclaim(dev, st, victim))) return rc;
  }
  vp__slot_t *s = NULL;
  if ((rc = grow(dev, (void **)&st->slots, &st->cap, st->n, sizeof s)) ||
      vp__inject_fail(&dev->inject) || !(s = calloc(1, sizeof *s)))
    return rc ? rc : vp__err(VP_ENOMEM, "vp_acquire: no memory for a slot");
  *s = (vp__slot_t){.off = off, .size = size, .owner = w, .used = ++st->clock};
  memmove(&st->slots[k + 1], &st->slots[k], (st->n - k) * sizeof s);
  st->slots[k] = s;
  st->n++;
  w->slot = s;
  *out = s;
  return VP_OK;
}

static uint64_t slot_addr(vp__device_t *dev, const vp__slot_t *s) {
  return dev->staging->vb->va + s->off;
}

/* ------------------------------------------------------------- weights */

static bool gens_equal(const vp__weight_t *w) {
  for (uint32_t p = w->p0; p < w->p1; p++)
    if (w->gens[p - w->p0] != w->vb->pages[p].gen) return false;
  return w->gens[0] != 0;
}

static bool all_resident(const vp__weight_t *w) {
  for (uint32_t p = w->p0; p < w->p1; p++)
    if (!w->vb->pages[p].resident) return false;
  return true;
}

/* Resident with the bytes of its last fill: nothing to do ahead of use. */
static bool ready_in_place(const vp__weight_t *w) {
  return all_resident(w) && gens_equal(w);
}

static void gens_take(vp__weight_t *w) {
  for (uint32_t p = w->p0; p < w->p1; p++)
    w->gens[p - w->p0] = w->vb->pages[p].gen;
}

/* Copies from w's source may still be queued: the caller may free the
 * source once the weight is gone, so wait for them. */
static void weight_free(vp__device_t *dev, vp__weight_t *w) {
  if (w->slot) w->slot->owner = NULL;
  if (w->copy_fence) {
    if (copy_pending(dev, w)) vp__fence_wait(dev, w->copy_fence);
    if (w->copy_fence) vp__fence_put(dev, w->copy_fence);
  }
  vp__table_remove(&dev->weights, w->id);
  if (w->holds != w->few_holds) free(w->holds);
  free(w->gens);
  free(w);
}

/* ---------------------------------------------------------------- holds */

static vp__hold_t *hold_find(const vp__weight_t *w, vp_stream_t stream) {
  for (uint32_t i = 0; i < w->nholds; i++)
    if (w->holds[i].stream == stream) return &w->holds[i];
  return NULL;
}

/* w's hold on `stream`, added (empty) if it has none. */
static int hold_get(vp__device_t *dev, vp__weight_t *w, vp_stream_t stream,
                    vp__hold_t **out) {
  if ((*out = hold_find(w, stream))) return VP_OK;
  if (w->nholds == w->holds_cap) {
    uint32_t cap = w->holds_cap * 2;
    vp__hold_t *l = NULL;
    if (vp__inject_fail(&dev->inject) || !(l = malloc(cap * sizeof *l)))
      return vp__err(VP_ENOMEM, "vp_acquire: no memory for a weight's holds");
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
static void hold_trim(vp__weight_t *w, vp_stream_t stream) {
  vp__hold_t *h = hold_find(w, stream);
  if (h && !h->resident && !h->staged) *h = w->holds[--w->nholds];
}

static int source_check(const vp_source_t *s, size_t i) {
  if (s->kind == VP_SOURCE_NONE) return VP_OK;
  if (s->kind == VP_SOURCE_HOST && s->host) return VP_OK;
  if (s->kind == VP_SOURCE_FILE && s->fd >= 0) return VP_OK;
  return vp__err(VP_EINVAL, "vp_weights_create: weight %zu: source kind %d "
                 "with %s", i, s->kind,
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
      return vp__err(size ? VP_ERANGE : VP_EINVAL, "vp_weights_create: "
                     "weight %zu [%llu, +%llu) is empty or outside the VBAR "
                     "of %llu bytes", i, (unsigned long long)off,
                     (unsigned long long)size, (unsigned long long)vb->size);
    if (srcs && source_check(&srcs[i], i)) return VP_EINVAL;
    if (overlaps_existing(vb, off, size))
      return vp__err(VP_EINVAL, "vp_weights_create: weight %zu at %llu "
                     "overlaps an existing weight", i, (unsigned long long)off);
    for (size_t j = 0; j < i; j++)
      if (offsets[j] < off + size && off < offsets[j] + sizes[j])
        return vp__err(VP_EINVAL, "vp_weights_create: weights %zu and %zu "
                       "overlap", j, i);
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
    return vp__err(VP_ENOMEM, "vp_weights_create: no memory for a weight");
  }
  *w = (vp__weight_t){.vb = vb, .offset = off, .size = size, .p0 = p0,
                      .p1 = p1, .gens = w->gens, .holds_cap = FEW_HOLDS};
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
  vp__weight_t **l = NULL;
  if (cap > UINT32_MAX || vp__inject_fail(&vb->dev->inject) ||
      !(l = realloc(vb->weights, cap * sizeof *l)))
    return vp__err(VP_ENOMEM, "vp_weights_create: no memory for the list");
  vb->weights = l;
  vb->weights_cap = (uint32_t)cap;
  return VP_OK;
}

static void weight_list_insert(vp__vbar_t *vb, vp__weight_t *w) {
  uint32_t i = lower_bound(vb, w->offset);
  memmove(&vb->weights[i + 1], &vb->weights[i],
          (vb->nweights - i) * sizeof *vb->weights);
  vb->weights[i] = w;
  vb->nweights++;
  for (uint32_t j = i; j < vb->nweights; j++) vb->weights[j]->index = j;
}

int vp_weights_create(vp_vbar_t h, size_t n, const uint64_t *offsets,
                      const uint64_t *sizes, const vp_source_t *srcs,
                      vp_weight_t *out) {
  if (!n || !offsets || !sizes || !out)
    return vp__err(VP_EINVAL, "vp_weights_create: n is 0 or an array is "
                   "NULL");
  vp__vbar_t *vb = NULL;
  int rc = vp__vbar_enter(h, "vp_weights_create", &vb);
  if (rc) return rc;
  vp__device_t *dev = vb->dev;
  if ((rc = weights_check(vb, n, offsets, sizes, srcs)) ||
      (rc = weight_list_reserve(vb, n)))
    return vp__unlock(dev, rc);
  size_t made = 0;
  vp__weight_t **ws = malloc(n * sizeof *ws);
  if (!ws) return vp__unlock(dev, vp__err(VP_ENOMEM, "vp_weights_create: "
                                          "no memory"));
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
    /* Interleaved ranks follow the weights while nothing is resident. */
    if (vb->order_kind == VP_ORDER_INTERLEAVED && !vb->resident)
      vp__vbar_set_order(vb, VP_ORDER_INTERLEAVED);
  }
  free(ws);
  return vp__unlock(dev, rc);
}

void vp__weights_mark_pages(const vp__vbar_t *vb, uint8_t *mark) {
  for (uint32_t i = 0; i < vb->nweights; i++) {
    const vp__weight_t *w = vb->weights[i];
    if (!mark[w->p0]) mark[w->p0] = VP__PAGE_GROUP_START;
    for (uint32_t p = w->p0 + 1; p < w->p1; p++)
      mark[p] = VP__PAGE_GROUP_JOINED;
  }
}

static void weight_unlist(vp__weight_t *w) {
  vp__vbar_t *vb = w->vb;
  memmove(&vb->weights[w->index], &vb->weights[w->index + 1],
          (vb->nweights - w->index - 1) * sizeof *vb->weights);
  vb->nweights--;
  for (uint32_t j = w->index; j < vb->nweights; j++)
    vb->weights[j]->index = j;
}

int vp_weight_destroy(vp_weight_t h) {
  vp__device_t *dev;
  vp__weight_t *w;
  int rc = vp__handle_enter(h.id, offsetof(vp__device_t, weights),
                            "vp_weight_destroy", "weight", &dev, (void **)&w);
  if (rc) return rc;
  if (w->acq_resident || w->acq_staged)
    return vp__unlock(dev, vp__err(VP_EBUSY, "vp_weight_destroy: the weight "
                                   "is acquired; release it first"));
  weight_unlist(w);
  weight_free(dev, w);
  return vp__unlock(dev, VP_OK);
}

void vp__weights_drop_vbar(vp__vbar_t *vb) {
  for (uint32_t i = 0; i < vb->nweights; i++)
    weight_free(vb->dev, vb->weights[i]);
  free(vb->weights);
  vb->weights = NULL;
  vb->nweights = vb->weights_cap = 0;
}

/* ------------------------------------------------------------- acquire */

/* Use w in place: its pages are pinned; fill them if they were recommitted
 * since its last fill. */
static int acquire_resident(vp__device_t *dev, vp__weight_t *w, batch_t *b,
                            vp__hold_t *hold, uint64_t *ptr, uint8_t *flags,
                            waits_t *wait) {
  uint8_t f = VP_ACQUIRED_RESIDENT;
  *ptr = w->vb->va + w->offset;
  if (!gens_equal(w)) {
    if (w->src.kind == VP_SOURCE_NONE) {
      f |= VP_ACQUIRED_EMPTY;
    } else {
      int rc = batch_add(dev, b, w, *ptr);
      if (rc) return rc;
      f |= VP_ACQUIRED_COPIED;
      VP__COUNT(w->vb, weight_fills, 1);
      VP__COUNT(w->vb, fill_bytes, w->size);
    }
    gens_take(w);
    if (w->prefetched) VP__COUNT(w->vb, prefetch_dropped_bytes, w->size);
    w->prefetched = false;
  } else if (w->prefetched) {
    f |= VP_ACQUIRED_COPIED;
    w->prefetched = false;
    VP__COUNT(w->vb, prefetch_used_bytes, w->size);
  }
  wait_for_copy(dev, w, wait);
  w->acq_resident++;
  hold->resident++;
  *flags = f;
  return VP_OK;
}

/* Use w from the staging ring: its slot if it still has one, else a new
 * slot filled from the source. */
static int acquire_staged(vp__device_t *dev, vp__weight_t *w, batch_t *b,
                          vp__hold_t *hold, uint64_t *ptr, uint8_t *flags,
                          waits_t *wait) {
  uint8_t f = VP_ACQUIRED_STAGED;
  vp__slot_t *s = w->slot;
  if (s) {
    if (s->prefetched) {
      f |= VP_ACQUIRED_COPIED;
      s->prefetched = false;
      VP__COUNT(w->vb, prefetch_used_bytes, w->size);
    }
    wait_for_copy(dev, w, wait);
  } else {
    int rc = ring_alloc(dev, w, false, &s);
    if (rc) return rc;
    if (w->src.kind == VP_SOURCE_NONE) {
      /* The caller writes the slot on its stream: through the copy stream
       * it then waits for the slot's last readers too. */
      f |= VP_ACQUIRED_EMPTY;
      wait->tail = true;
    } else {
      if ((rc = batch_add(dev, b, w, slot_addr(dev, s)))) {
        s->owner = NULL; /* holds no data: reclaimed like a released slot */
        w->slot = NULL;
        return rc;
      }
      f |= VP_ACQUIRED_COPIED;
    }
    VP__COUNT(w->vb, weight_staged, 1);
    VP__COUNT(w->vb, staged_bytes, w->size);
  }
  s->refs++;
  s->used = ++dev->staging->clock;
  w->acq_staged++;
  hold->staged++;
  *ptr = slot_addr(dev, s);
  *flags = f;
  return VP_OK;
}

static int acquire_one(vp__device_t *dev, vp__weight_t *w, batch_t *b,
                       vp_stream_t stream, uint64_t *ptr, uint8_t *flags,
                       waits_t *wait) {
  vp__hold_t *hold;
  int rc = hold_get(dev, w, stream, &hold);
  if (rc) return rc;
  VP__COUNT(w->vb, acquires, 1);
  rc = vp__fault(w->vb, w->p0, w->p1, NULL);
  if (rc == VP_OK) {
    rc = acquire_resident(dev, w, b, hold, ptr, flags, wait);
    if (rc) vp__unpin_nofence(w->vb, w->p0, w->p1);
  } else if (rc == VP_MISS) {
    rc = acquire_staged(dev, w, b, hold, ptr, flags, wait);
  }
  if (rc) hold_trim(w, stream);
  return rc;
}

/* Undo the first n acquires of a failed vp_acquire. Copies already listed
 * are issued and the pins dropped behind a copy-stream fence; if issuing
 * fails, those weights are left unfilled instead. */
static void acquire_undo(vp__device_t *dev, vp__weight_t **ws, size_t n,
                         vp_stream_t stream, const uint64_t *ptrs,
                         batch_t *b) {
  vp__fence_t *f = NULL;
  bool issued = batch_issue(dev, b, &f) == VP_OK;
  for (size_t i = 0; i < n; i++) {
    vp__weight_t *w = ws[i];
    vp__hold_t *hold = hold_find(w, stream);
    w->vb->acquired--;
    if (ptrs[i] != w->vb->va + w->offset) { /* this call staged it */
      w->acq_staged--;
      hold->staged--;
      w->slot->refs--;
    } else {
      w->acq_resident--;
      hold->resident--;
      if (f) vp__unpin_attach(w->vb, w->p0, w->p1, f);
      else vp__unpin_nofence(w->vb, w->p0, w->p1);
    }
    hold_trim(w, stream);
  }
  for (size_t i = 0; !issued && i < b->nfilled; i++) {
    vp__weight_t *w = b->filled[i];
    w->vb->prefetch_idle = false;
    w->gens[0] = 0;
    w->prefetched = false;
    if (w->slot && !w->slot->refs) {
      w->slot->owner = NULL;
      w->slot = NULL;
    }
  }
  if (f) vp__fence_put(dev, f);
}

/* Look up n weight handles of dev. */
static int weights_find(vp__device_t *dev, const vp_weight_t *h, size_t n,
                        vp__weight_t **ws, const char *fn) {
  for (size_t i = 0; i < n; i++)
    if (!(ws[i] = vp__table_get(&dev->weights, h[i].id)))
      return vp__err(VP_EHANDLE, "%s: weights[%zu] (0x%llx) is not a live "
                     "weight of this device", fn, i,
                     (unsigned long long)h[i].id);
  return VP_OK;
}

static void prefetch(vp__device_t *dev, vp__weight_t *last);

/* Weights handles of one call, on the stack when few. */
#define FEW 64

static int acquire_locked(vp__device_t *dev, vp__weight_t **ws, size_t n,
                          vp_stream_t stream, uint64_t *ptrs, uint8_t *flags) {
  batch_t b = {0};
  waits_t wait = {NULL, false};
  size_t i;
  int rc = VP_OK;
  /* Commit the staging ring before this call pins anything, so making
   * room for it may still evict: a layer may need both. */
  for (i = 0; i < n && !dev->staging && rc == VP_OK; i++)
    if (!all_resident(ws[i])) rc = staging_open(dev);
  if (rc) return rc;
  for (i = 0; i < n && rc == VP_OK; i++) {
    uint8_t f = 0;
    rc = acquire_one(dev, ws[i], &b, stream, &ptrs[i], &f, &wait);
    if (flags) flags[i] = f;
    if (rc == VP_OK) ws[i]->vb->acquired++;
  }
  if (rc) {
    acquire_undo(dev, ws, i - 1, stream, ptrs, &b);
  } else if (b.nfilled || wait.tail || wait.newest) {
    /* A fence after this call's copies covers every earlier fill too. */
    vp__fence_t *f = wait.newest;
    if (b.nfilled || wait.tail) rc = batch_issue(dev, &b, &f);
    else f->refs++;
    if (rc == VP_OK) {
      rc = dev->be->stream_wait_event(dev->ctx, stream, f->event);
      if (rc) rc = vp__err(vp__be_result(dev, rc, "stream_wait_event"),
                           "vp_acquire: stream 0x%llx cannot wait for the "
                           "copy stream", (unsigned long long)stream);
      dev->stats.stream_waits++;
      vp__fence_put(dev, f);
    }
    if (rc) acquire_undo(dev, ws, n, stream, ptrs, &b); /* nothing stays acquired */
  }
  free(b.c);
  free(b.filled);
  if (rc == VP_OK && dev->lookahead) prefetch(dev, ws[n - 1]);
  return rc;
}

int vp_acquire(vp_device_t h, const vp_weight_t *w, size_t n,
               vp_stream_t stream, uint64_t *ptrs, uint8_t *flags) {
  if (!n || !w || !ptrs)
    return vp__err(VP_EINVAL, "vp_acquire: n is 0 or weights/ptrs is NULL");
  vp__weight_t *few[FEW], **ws = n <= FEW ? few : malloc(n * sizeof *ws);
  if (!ws) return vp__err(VP_ENOMEM, "vp_acquire: no memory for %zu handles",
                          n);
  vp__device_t *dev = NULL;
  int rc = vp__dev_enter(h, "vp_acquire", &dev);
  if (rc == VP_OK) {
    rc = weights_find(dev, w, n, ws, "vp_acquire");
    if (rc == VP_OK) rc = acquire_locked(dev, ws, n, stream, ptrs, flags);
    vp__unlock(dev, rc);
  }
  if (ws != few) free(ws);
  return rc;
}

/* ------------------------------------------------------------- release */

/* A slot keeps one release fence: readers on another stream must finish
 * before the new one completes (as vp__order_after does for pages). */
static int slot_order_after(vp__device_t *dev, vp__slot_t *s,
                            vp_stream_t stream) {
  vp__fence_t *f = s->fence;
  if (!f || f->stream == stream ||
      dev->be->event_query(dev->ctx, f->event) == VP_OK)
    return VP_OK;
  int rc = dev->be->stream_wait_event(dev->ctx, stream, f->event);
  if (rc)
    return vp__err(vp__be_result(dev, rc, "stream_wait_event"), "vp_release: "
                   "ordering stream 0x%llx after earlier readers failed",
                   (unsigned long long)stream);
  return VP_OK;
}

/* A release on `stream` ends one of the weight's holds on that stream, a
 * staged one first; its fence covers that hold's readers. The k-th listing
 * (from 1) of a weight in one call ends a staged hold when k <= staged. */
static bool ends_staged(const vp__hold_t *h, uint32_t k) {
  return k <= h->staged;
}

/* Every entry must be held on `stream` as many times as the call lists it;
 * nothing changes otherwise. Orders `stream` after the other readers. */
static int release_check(vp__weight_t **ws, size_t n, vp_stream_t stream) {
  int rc = VP_OK;
  size_t i;
  for (i = 0; i < n && rc == VP_OK; i++) {
    vp__weight_t *w = ws[i];
    const vp__hold_t *h = hold_find(w, stream);
    uint32_t k = ++w->listed;
    if (!h || k > h->resident + h->staged) {
      rc = vp__err(VP_ENOTPINNED, "vp_release: weights[%zu] is not "
                   "acquired on stream 0x%llx as often as listed (%u listed, "
                   "%u held)", i, (unsigned long long)stream, k,
                   h ? h->resident + h->staged : 0);
      break;
    }
    rc = ends_staged(h, k) ? slot_order_after(w->vb->dev, w->slot, stream)
                           : vp__order_after(w->vb, w->p0, w->p1, stream);
  }
  for (size_t j = 0; j < n; j++) ws[j]->listed = 0;
  return rc;
}

static void release_one(vp__device_t *dev, vp__weight_t *w, vp__fence_t *f,
                        vp_stream_t stream) {
  vp__hold_t *h = hold_find(w, stream);
  w->vb->acquired--;
  if (ends_staged(h, 1)) {
    vp__slot_t *s = w->slot;
    w->acq_staged--;
    h->staged--;
    s->refs--;
    s->used = ++dev->staging->clock;
    if (s->fence) vp__fence_put(dev, s->fence);
    s->fence = f;
    f->refs++;
  } else {
    w->acq_resident--;
    h->resident--;
    vp__unpin_attach(w->vb, w->p0, w->p1, f);
  }
  hold_trim(w, stream);
}

int vp_release(vp_device_t h, const vp_weight_t *w, size_t n,
               vp_stream_t stream) {
  if (!n || !w)
    return vp__err(VP_EINVAL, "vp_release: n is 0 or weights is NULL");
  vp__weight_t *few[FEW], **ws = n <= FEW ? few : malloc(n * sizeof *ws);
  if (!ws) return vp__err(VP_ENOMEM, "vp_release: no memory for %zu handles",
                          n);
  vp__device_t *dev = NULL;
  vp__fence_t *f;
  int rc = vp__dev_enter(h, "vp_release", &dev);
  if (rc == VP_OK) {
    if ((rc = weights_find(dev, w, n, ws, "vp_release")) == VP_OK &&
        (rc = release_check(ws, n, stream)) == VP_OK &&
        (rc = vp__fence_get(dev, stream, &f)) == VP_OK) {
      for (size_t i = 0; i < n; i++) release_one(dev, ws[i], f, stream);
      vp__fence_put(dev, f);
    }
    vp__unlock(dev, rc);
  }
  if (ws != few) free(ws);
  return rc;
}

/* ------------------------------------------------------------ prefetch */

/* Fill u's pages ahead of need (pinned until the batch is issued) or stage
 * it in a free ring slot. VP_MISS: nothing more fits now. */
static int prefetch_one(vp__device_t *dev, vp__weight_t *u, batch_t *b) {
  int rc = vp__fault(u->vb, u->p0, u->p1, NULL);
  if (rc == VP_OK) {
    if (gens_equal(u)) {
      vp__unpin_nofence(u->vb, u->p0, u->p1);
      return VP_OK;
    }
    rc = batch_add(dev, b, u, u->vb->va + u->offset);
    if (rc) {
      vp__unpin_nofence(u->vb, u->p0, u->p1);
      return rc;
    }
    gens_take(u);
    u->prefetched = true;
    return VP_OK;
  }
  if (rc != VP_MISS || u->slot) return rc;
  vp__slot_t *s;
  if ((rc = ring_alloc(dev, u, true, &s))) return rc;
  if ((rc = batch_add(dev, b, u, slot_addr(dev, s)))) {
    s->owner = NULL; /* reclaimed like any released slot */
    u->slot = NULL;
    return rc;
  }
  s->prefetched = true;
  return VP_OK;
}

/* Issue the prefetch copies; pages filled ahead are unpinned behind their
 * copies. If issuing fails, the weights are left unfilled. */
static void prefetch_finish(vp__device_t *dev, batch_t *b) {
  vp__fence_t *f = NULL;
  size_t n = b->nfilled;
  vp__weight_t **filled = b->filled;
  if (!n || batch_issue(dev, b, &f) != VP_OK) f = NULL;
  for (size_t i = 0; i < n; i++) {
    vp__weight_t *u = filled[i];
    if (u->slot && u->slot->prefetched && !f) {
      u->slot->owner = NULL;
      u->slot = NULL;
    } else if (!u->slot) {
      if (f) {
        vp__unpin_attach(u->vb, u->p0, u->p1, f);
      } else {
        vp__unpin_nofence(u->vb, u->p0, u->p1);
        u->gens[0] = 0;
        u->prefetched = false;
      }
    }
  }
  if (f) vp__fence_put(dev, f);
}

/* Start the weights after `last` in its VBAR (wrapping to the start, for
 * the next pass) until lookahead bytes of them are staged or filled ahead.
 * Weights that stayed resident cost nothing and do not count: with the
 * resident weights first, the copy engine starts on the streamed ones while
 * the resident ones compute. A scan looks at each weight at most once. */
static void prefetch(vp__device_t *dev, vp__weight_t *last) {
  vp__vbar_t *vb = last->vb;
  if (vb->prefetch_idle) return; /* all resident and filled: no scan */
  batch_t b = {0};
  uint64_t bytes = 0;
  bool work = false;
  int rc = VP_OK;
  for (uint32_t k = 1; k < vb->nweights && rc == VP_OK; k++) {
    vp__weight_t *u = vb->weights[(last->index + k) % vb->nweights];
    if (u->acq_resident || u->acq_staged || u->src.kind == VP_SOURCE_NONE)
      continue;
    bool ready = ready_in_place(u);
    if (u->prefetched && !ready) { /* its pages went before its use */
      VP__COUNT(u->vb, prefetch_dropped_bytes, u->size);
      u->prefetched = false;
    }
    if (ready && !u->prefetched) continue; /* stayed resident: no copy */
    work = true;
    if (bytes >= dev->lookahead) break;
    bytes += u->size;
    if (u->slot || u->prefetched) continue; /* staged or filled ahead */
    size_t before = b.nfilled;
    rc = prefetch_one(dev, u, &b);
    if (b.nfilled > before) VP__COUNT(u->vb, prefetch_bytes, u->size);
  }
  if (!work) vb->prefetch_idle = true; /* until a page or slot changes */
  prefetch_finish(dev, &b);
  if (rc < 0) vp__log(VP_LOG_DEBUG, dev->caps.name, "prefetch stopped: %s",
                      vp_last_error());
  free(b.c);
  free(b.filled);
}

int vp_device_set_lookahead(vp_device_t h, uint64_t bytes) {
  vp__device_t *dev = NULL;
  int rc = vp__dev_enter(h, "vp_device_set_lookahead", &dev);
  if (rc) return rc;
  dev->lookahead = bytes;
  return vp__unlock(dev, VP_OK);
}

/* Device close: wait for the copy stream and every staging reader, then
 * free the ring and the stream. Weights go with their VBARs. */
void vp__stream_close(vp__device_t *dev) {
  if (dev->copy_stream) dev->be->stream_synchronize(dev->ctx, dev->copy_stream);
  vp__staging_t *st = dev->staging;
  if (st) {
    for (size_t k = 0; k < st->n; k++) {
      vp__slot_t *s = st->slots[k];
      if (s->fence) {
        vp__fence_wait(dev, s->fence);
        vp__fence_put(dev, s->fence);
      }
      if (s->owner) {
        s->owner->slot = NULL;
        s->owner->vb->prefetch_idle = false;
      }
      free(s);
    }
    vp__unpin_nofence(st->vb, 0, st->vb->npages);
    vp__vbar_free(st->vb);
    free(st->slots);
    free(st);
    dev->staging = NULL;
  }
  if (dev->copy_stream) dev->be->stream_destroy(dev->ctx, dev->copy_stream);
  dev->copy_stream = 0;
  vp__table_free(&dev->weights);
}

/* True if [addr, +size) lies in a staging slot an acquire holds (the
 * caller may fill or read it, as for VP_ACQUIRED_EMPTY). */
bool vp__staging_holds(vp__device_t *dev, uint64_t addr, uint64_t size) {
  vp__staging_t *st = dev->staging;
  if (!st || addr < st->vb->va) return false;
  uint64_t off = addr - st->vb->va;
  for (size_t k = 0; k < st->n; k++) {
    const vp__slot_t *s = st->slots[k];
    if (s->refs && off >= s->off && off - s->off <= s->size &&
        size <= s->size - (off - s->off))
      return true;
  }
  return false;
}
