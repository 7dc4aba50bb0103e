/* The VRAM staging ring for weights that miss, and the device's copy
 * stream that fills it.
 *
 * The ring is an internal VBAR whose pages stay pinned. Its slots are kept
 * sorted by offset; a new one takes the first gap that fits, and when none
 * does the least recently used slot no acquire holds is reclaimed. A slot
 * keeps its weight's bytes until reclaimed, so a staged weight acquired
 * again soon costs no copy. A slot is reused only after its release fence:
 * the copy stream waits for that fence on the device. */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define SLOT_ALIGN 256 /* staging slots start at aligned device addresses */
#define ULL(x) ((unsigned long long)(x))

int vp__copy_stream(vp__device_t *dev, vp_stream_t *out) {
  if (!dev->copy_stream) {
    int rc = vp__be_stream_create(dev, &dev->copy_stream);
    if (rc) {
      dev->copy_stream = 0;
      return vp__err(rc, "creating the copy stream failed");
    }
  }
  *out = dev->copy_stream;
  return VP_OK;
}


/* The limit has no room for the ring: torch (a LoRA's patch math, large
 * activations) or other processes hold what the budget meant for vpager.
 * Every miss streams through the ring, so without it each forward would
 * fail: it is committed over the limit, within the device's free memory
 * less the headroom, and said once. Resident pages then miss or make room
 * as usual until the limit has room again. */
static int ring_over_limit(vp__device_t *dev, vp__vbar_t *vb) {
  dev->budget.over_limit = true;
  int rc = vp__fault(vb, 0, vb->npages, NULL);
  dev->budget.over_limit = false;
  if (rc == VP_OK && !dev->ring_over_said) {
    dev->ring_over_said = true;
    vp__log(VP_LOG_WARN, dev->caps.name, "the limit (%s) has no room for "
            "the %s staging ring: it is committed over the limit",
            vp__size(dev->budget.limit).s, vp__size(vb->size).s);
  }
  return rc;
}

bool vp__staging_wraps(const vp__device_t *dev) {
  return dev->staging ? dev->staging->vb->mirrored
                      : dev->opts.staging_wrap && dev->caps.map_twice &&
                            !dev->ring_wrap_failed;
}

/* Bytes written through the ring's first view read back through its
 * second: a driver that mapped a page twice but not as one memory would
 * hand every slot that runs past the end other bytes than its copy's. */
static int views_agree(vp__device_t *dev, vp__vbar_t *vb) {
  uint64_t probe[2] = {0x7670616765727731ull ^ vb->va, ~vb->va};
  uint64_t back[2] = {0, 0};
  vp_stream_t cs = 0;
  int rc = vp__copy_stream(dev, &cs);
  if (rc == VP_OK)
    rc = vp__be_copy_htod(dev, vb->va, probe, sizeof probe, cs);
  if (rc == VP_OK)
    rc = vp__be_copy_dtoh(dev, back, vb->va + vb->size, sizeof back, cs);
  int done = vp__be_stream_synchronize(dev, cs); /* probe and back live */
  if (rc == VP_OK) rc = done;
  if (rc)
    return vp__err(rc, "checking the staging ring's second view failed");
  if (memcmp(probe, back, sizeof probe))
    return vp__err(VP_EDEVICE, "the staging ring's second view shows other "
                   "bytes than its first");
  return VP_OK;
}

/* The ring's pages mapped again after it, so a slot that does not fit
 * before its end runs on into its start instead of leaving the tail
 * unused: the whole ring holds slots. Where the driver refuses, or the
 * second view does not show the first's bytes, the ring works as one
 * that does not wrap, said once. */
static void ring_mirror(vp__device_t *dev, vp__vbar_t *vb) {
  int rc = vp__vbar_mirror(vb);
  if (rc == VP_OK && (rc = views_agree(dev, vb))) vp__vbar_unmirror(vb);
  if (rc == VP_OK) return;
  dev->ring_wrap_failed = true;
  vp__log(VP_LOG_WARN, dev->caps.name, "the staging ring's slots do not "
          "wrap: %s", vp_last_error());
}

int vp__staging_open(vp__device_t *dev) {
  vp__staging_t *st = NULL;
  vp__vbar_t *vb = NULL;
  uint64_t size = dev->opts.staging_size;
  if (size < dev->page_size) size = dev->page_size;
  if (vp__inject_fail(&dev->inject) || !(st = calloc(1, sizeof *st)))
    return vp__err(VP_ENOMEM, "no memory for the staging ring");
  bool wrap = vp__staging_wraps(dev);
  int rc = vp__vbar_new_internal(dev, size, wrap, &vb);
  if (rc) goto fail;
  rc = vp__fault(vb, 0, vb->npages, NULL);
  if (rc == VP_MISS) rc = ring_over_limit(dev, vb);
  if (rc == VP_OK && wrap) ring_mirror(dev, vb);
  if (rc) {
    vp__vbar_free(vb);
    if (rc == VP_MISS)
      rc = vp__err(VP_EOOM, "no device memory for the %llu MiB staging ring "
                   "(lower staging_size or free memory)",
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

/* Forget slot s, its copies and readers done or waited for: its weight
 * stages again when next needed. */
static void slot_drop(vp__device_t *dev, vp__slot_t *s) {
  if (s->fence) vp__fence_put(dev, s->fence);
  if (s->owner) {
    if (s->prefetched)
      VP__COUNT(s->owner->vb, prefetch_dropped_bytes, s->owner->size);
    s->owner->slot = NULL;
    s->owner->vb->prefetch_idle = false;
    s->owner->vb->win_ok = false;
  }
  free(s);
}

/* Free slot k: its next user writes it on the copy stream, so the copy
 * stream waits (on the device) for the readers' release fence. */
static int ring_reclaim(vp__device_t *dev, vp__staging_t *st, size_t k) {
  vp__slot_t *s = st->slots[k];
  if (s->fence) {
    if (vp__be_event_query(dev, s->fence->event) != VP_OK) {
      vp_stream_t cs = 0;
      int rc = vp__copy_stream(dev, &cs);
      if (rc == VP_OK)
        rc = vp__be_stream_wait_event(dev, cs, s->fence->event);
      if (rc) return rc;
      dev->stats.ring_waits++;
    }
  }
  st->taken -= s->size;
  slot_drop(dev, s);
  memmove(&st->slots[k], &st->slots[k + 1],
          (st->n - k - 1) * sizeof *st->slots);
  st->n--;
  return VP_OK;
}

/* Where slot s ends: past the ring's end only in a wrapping ring. */
static uint64_t slot_end(const vp__slot_t *s) { return s->off + s->size; }

/* The bytes at the ring's start that its last slot runs into (a wrapping
 * ring's slot may go on past the end, into the second view). */
static uint64_t wrapped(const vp__staging_t *st) {
  uint64_t end = st->n ? slot_end(st->slots[st->n - 1]) : 0;
  return end > st->size ? end - st->size : 0;
}

/* The free bytes before slot k (k = n: after the last one, as far as a
 * wrapping ring's first slot), from *off. */
static uint64_t gap(const vp__staging_t *st, size_t k, uint64_t *off) {
  *off = k ? slot_end(st->slots[k - 1]) : wrapped(st);
  uint64_t limit = k < st->n ? st->slots[k]->off : st->size;
  if (k == st->n && k) {
    if (*off >= st->size) return 0; /* gap 0 starts where it ends */
    if (st->vb->mirrored) limit += st->slots[0]->off;
  }
  return limit > *off ? limit - *off : 0;
}

/* The gap before slot k, if `size` fits in it. */
static bool gap_fits(const vp__staging_t *st, size_t k, uint64_t size,
                     uint64_t *off) {
  uint64_t at = 0;
  if (gap(st, k, &at) < size) return false;
  *off = at;
  return true;
}

/* Index before which a slot of `size` fits (its offset in *off), or
 * SIZE_MAX: the first gap that is large enough. */
static size_t ring_fit(const vp__staging_t *st, uint64_t size, uint64_t *off) {
  if (st->size - st->taken < size) return SIZE_MAX; /* no gap that large */
  for (size_t k = 0; k <= st->n; k++)
    if (gap_fits(st, k, size, off)) return k;
  return SIZE_MAX;
}

/* Whether slot s may be reclaimed: not held, and (for a prefetch) not
 * staged ahead for a weight that is still there. A prefetched slot whose
 * weight let go of it (destroyed, or re-placed by vpager.torch) is: it
 * would otherwise keep its room from every later prefetch. */
static bool reclaimable(const vp__slot_t *s, bool keep_prefetch) {
  return !s->refs && !(keep_prefetch && s->prefetched && s->owner);
}

/* The least recently used slot an acquire may reclaim (any not held), or
 * SIZE_MAX. */
static size_t ring_victim(const vp__staging_t *st) {
  size_t best = SIZE_MAX;
  for (size_t k = 0; k < st->n; k++) {
    const vp__slot_t *s = st->slots[k];
    if (!reclaimable(s, false)) continue;
    if (best == SIZE_MAX || s->used < st->slots[best]->used) best = k;
  }
  return best;
}

/* How far on from `at` slot s starts (0 when it covers `at`) and ends,
 * going round a ring of `size` bytes. */
static uint64_t ahead_start(uint64_t size, const vp__slot_t *s, uint64_t at) {
  uint64_t back = (at + size - s->off) % size; /* from its start to at */
  return back < s->size ? 0 : size - back;
}

static uint64_t ahead_end(uint64_t size, const vp__slot_t *s, uint64_t at) {
  uint64_t back = (at + size - s->off) % size;
  return back < s->size ? s->size - back : size - back + s->size;
}

/* The slots in [at, at + len) (which may run past the end of a ring that
 * wraps): *count of them, from index *first on, going round. Slots are
 * apart and in offset order, so those an arc meets are a run of indices:
 * the one that covers `at` (a wrapping ring's last may, from the start)
 * or else the first after it, and on while they start before at + len. */
static void in_way(const vp__staging_t *st, uint64_t at, uint64_t len,
                   size_t *first, size_t *count) {
  size_t lo = 0, hi = st->n; /* the first slot that ends after `at` */
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (slot_end(st->slots[mid]) <= at) lo = mid + 1;
    else hi = mid;
  }
  if (at < wrapped(st)) lo = st->n - 1;
  else if (lo == st->n) lo = 0;
  *first = lo;
  *count = 0;
  while (*count < st->n &&
         ahead_start(st->size, st->slots[(lo + *count) % st->n], at) < len)
    ++*count;
}

/* Index before which a slot of `size` goes at st->next (in a ring that
 * does not wrap, at 0 when it does not fit before the end), or SIZE_MAX.
 * reclaim = false: only if nothing is in the way. reclaim = true: the
 * slots in the way are reclaimed (*rc: an error doing so); one that may
 * not be (held, or staged ahead) is stepped over, like a clock hand, at
 * most once round the ring. In order of use the slots after st->next are
 * the oldest, so this is the LRU choice for a model streamed in order,
 * and consecutive allocations (one prefetch batch) get adjacent slots:
 * their copies merge when the sources are adjacent too. */
static size_t ring_next(vp__device_t *dev, vp__staging_t *st, uint64_t size,
                        bool reclaim, uint64_t *off, int *rc) {
  uint64_t ring = st->size;
  if (size > ring) return SIZE_MAX;
  uint64_t at = st->next, moved = 0;
  for (;;) {
    if (at >= ring) at -= ring;
    if (!st->vb->mirrored && at > ring - size) {
      moved += ring - at;
      at = 0;
    }
    if (moved >= ring) return SIZE_MAX; /* went round */
    size_t first = 0, count = 0, c = 0;
    in_way(st, at, size, &first, &count);
    if (count && !reclaim) return SIZE_MAX;
    while (c < count && reclaimable(st->slots[(first + c) % st->n], true))
      c++;
    if (c < count) { /* the first one in the way that must stay */
      uint64_t step = ahead_end(ring, st->slots[(first + c) % st->n], at);
      moved += step;
      at += step;
      continue;
    }
    /* Each reclaim moves the run's next slot to `first`, or (past the
     * last index) to 0. */
    for (; count; count--)
      if ((*rc = ring_reclaim(dev, st, first < st->n ? first : 0)))
        return SIZE_MAX;
    size_t lo = 0, hi = st->n; /* the first slot after `at` */
    while (lo < hi) {
      size_t mid = lo + (hi - lo) / 2;
      if (st->slots[mid]->off < at) lo = mid + 1;
      else hi = mid;
    }
    *off = at;
    return lo;
  }
}

static uint64_t slot_size(uint64_t size) {
  return (size + SLOT_ALIGN - 1) & ~(uint64_t)(SLOT_ALIGN - 1);
}

/* The lent range for a slot of `size` bytes: of those with room, the one
 * after which the most of the weights ahead still find room in order,
 * each in the first range that holds it (ties: the first range). A slot
 * never spans two ranges, so first fit alone can strand room: Flux's
 * 56, 56, 19, 75, 75 MB in lent blocks of 189 and 107 MB stop at the
 * second 75 that way, and all fit as 56 + 56 + 75 and 19 + 75. SIZE_MAX
 * when no range has room. */
static size_t lent_pick(const vp__staging_t *st, uint64_t size,
                        const vp__ahead_t *ahead) {
  size_t best = SIZE_MAX, best_fit = 0;
  for (size_t r = 0; r < st->nlent; r++) {
    if (st->lent[r].size - st->lent[r].next < size) continue;
    uint64_t room[VP_LENT_RANGES];
    for (size_t q = 0; q < st->nlent; q++)
      room[q] = st->lent[q].size - st->lent[q].next;
    room[r] -= size;
    size_t fit = 0;
    for (; ahead && fit < ahead->n; fit++) {
      uint64_t need = slot_size(ahead->size[fit]);
      size_t q = 0;
      while (q < st->nlent && room[q] < need) q++;
      if (q == st->nlent) break;
      room[q] -= need;
    }
    if (best == SIZE_MAX || fit > best_fit) {
      best = r;
      best_fit = fit;
    }
  }
  return best;
}

/* A slot in lent memory for a prefetch, cut where the last one in its
 * range ended (lent_pick's range); VP_MISS when no lent range has room. */
static int lent_alloc(vp__device_t *dev, vp__staging_t *st, vp__weight_t *w,
                      uint64_t size, const vp__ahead_t *ahead,
                      vp__slot_t **out) {
  size_t r = st->lent_open ? lent_pick(st, size, ahead) : SIZE_MAX;
  if (r == SIZE_MAX) return VP_MISS;
  vp__lent_t *l = &st->lent[r];
  vp__slot_t *s = NULL;
  int rc = vp__grow(dev, (void **)&st->lslots, &st->lcap, st->nlslots,
                    sizeof s);
  if (rc || vp__inject_fail(&dev->inject) || !(s = calloc(1, sizeof *s)))
    return rc ? rc : vp__err(VP_ENOMEM, "no memory for a slot");
  *s = (vp__slot_t){.off = l->addr + l->next, .size = size, .owner = w,
                    .lent = true, .used = ++st->clock};
  l->next += size;
  st->lslots[st->nlslots++] = s;
  w->slot = s;
  *out = s;
  return VP_OK;
}

/* A staging slot for w. VP_MISS when the ring has no room for a prefetch
 * (which never drops other prefetched slots); VP_ELIMIT for an acquire. */
int vp__ring_alloc(vp__device_t *dev, vp__weight_t *w, bool prefetch,
                   const vp__ahead_t *ahead, vp__slot_t **out) {
  int rc = dev->staging ? VP_OK : vp__staging_open(dev);
  if (rc) return rc;
  vp__staging_t *st = dev->staging;
  uint64_t size = slot_size(w->size);
  uint64_t off = 0;
  /* While a loan is open a prefetch stages there first: the weights it
   * copies then are the next forward's first, used (and the loan given
   * back) before those the ring takes after them. */
  if (prefetch && st->lent_open) {
    rc = lent_alloc(dev, st, w, size, ahead, out);
    if (rc != VP_MISS) return rc;
    rc = VP_OK;
  }
  /* Free room first (at st->next, else the first gap): what the ring
   * holds may be acquired again without a copy. Then, for prefetch, the
   * clock hand; for an acquire, the least recently used slots. */
  size_t victim, k = ring_next(dev, st, size, false, &off, &rc);
  if (k == SIZE_MAX) k = ring_fit(st, size, &off);
  if (k == SIZE_MAX && prefetch) k = ring_next(dev, st, size, true, &off, &rc);
  if (rc) return rc;
  /* The clock hand went round without finding room among the slots a
   * prefetch may take, so reclaiming them one by one cannot make any: it
   * would only drop what they hold and make the copy stream wait for
   * their readers. */
  if (k == SIZE_MAX && prefetch) return VP_MISS;
  while (k == SIZE_MAX) {
    if ((victim = ring_victim(st)) == SIZE_MAX)
      return vp__err(VP_ELIMIT, "a weight of %llu bytes does not fit in the "
                     "%llu-byte staging ring beside the weights acquired and "
                     "not released (raise staging_size)",
                     (unsigned long long)w->size, (unsigned long long)st->size);
    if ((rc = ring_reclaim(dev, st, victim))) return rc;
    /* At st->next, as before; else no other gap fitted before, so the
     * first that fits now, if any, is the one the victim left (joined
     * with its neighbours). */
    k = ring_next(dev, st, size, false, &off, &rc);
    if (k == SIZE_MAX && gap_fits(st, victim, size, &off)) k = victim;
  }
  vp__slot_t *s = NULL;
  if ((rc = vp__grow(dev, (void **)&st->slots, &st->cap, st->n, sizeof s)) ||
      vp__inject_fail(&dev->inject) || !(s = calloc(1, sizeof *s)))
    return rc ? rc : vp__err(VP_ENOMEM, "no memory for a slot");
  *s = (vp__slot_t){.off = off, .size = size, .owner = w, .used = ++st->clock};
  memmove(&st->slots[k + 1], &st->slots[k], (st->n - k) * sizeof s);
  st->slots[k] = s;
  st->n++;
  st->taken += size;
  st->next = off + size < st->size ? off + size : off + size - st->size;
  w->slot = s;
  *out = s;
  return VP_OK;
}

uint64_t vp__slot_addr(vp__device_t *dev, const vp__slot_t *s) {
  return s->lent ? s->off : dev->staging->vb->va + s->off;
}

bool vp__staging_continues(vp__device_t *dev, uint64_t end, uint64_t dst) {
  const vp__staging_t *st = dev->staging;
  if (end == dst) return true;
  return st && st->vb->mirrored && dst >= st->vb->va &&
         dst - st->vb->va < st->size && end == dst + st->size;
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


/* The VBAR holding [addr, addr+size), if every page of it is pinned. */
int vp__pinned_range(vp__device_t *dev, uint64_t addr, uint64_t size) {
  if (size == 0) return vp__err(VP_EINVAL, "size is 0");
  for (vp__vbar_t *vb = dev->top; vb; vb = vb->down) {
    if (addr < vb->va || addr - vb->va >= vb->size) continue;
    uint64_t off = addr - vb->va;
    if (size > vb->size - off)
      return vp__err(VP_ERANGE, "[0x%llx, +%llu) runs past its VBAR",
                     ULL(addr), ULL(size));
    for (uint64_t p = off >> dev->page_shift;
         p <= (off + size - 1) >> dev->page_shift; p++)
      if (!vb->pages[p].pins)
        return vp__err(VP_ENOTPINNED, "page %llu of the range at 0x%llx is not "
                       "pinned", ULL(p), ULL(addr));
    VP__COUNT(vb, bytes_copied, size);
    return VP_OK;
  }
  if (vp__staging_holds(dev, addr, size)) {
    dev->stats.bytes_copied += size;
    return VP_OK;
  }
  return vp__err(VP_ERANGE, "0x%llx is in no VBAR of this device", ULL(addr));
}

/* The lent slots and ranges forgotten (the caller ordered their copies
 * and readers before the memory's next use). */
static void lent_drop(vp__device_t *dev, vp__staging_t *st) {
  for (size_t k = 0; k < st->nlslots; k++) slot_drop(dev, st->lslots[k]);
  st->nlslots = st->nlent = 0;
  st->lent_open = false;
}

/* Wait for the copy stream and every staging reader, then free the ring
 * and forget the lent memory (the copy stream stays). */
static void ring_free(vp__device_t *dev) {
  if (dev->copy_stream) vp__be_stream_synchronize(dev, dev->copy_stream);
  vp__staging_t *st = dev->staging;
  if (!st) return;
  for (size_t k = 0; k < st->nlslots; k++)
    if (st->lslots[k]->fence) vp__fence_wait(dev, st->lslots[k]->fence);
  lent_drop(dev, st);
  free(st->lslots);
  for (size_t k = 0; k < st->n; k++) {
    vp__slot_t *s = st->slots[k];
    if (s->fence) vp__fence_wait(dev, s->fence);
    s->prefetched = false; /* not counted dropped, as before */
    slot_drop(dev, s);
  }
  vp__unpin_nofence(st->vb, 0, st->vb->npages);
  vp__vbar_free(st->vb);
  free(st->slots);
  free(st);
  dev->staging = NULL;
}

int vp__staging_free(vp__device_t *dev) {
  vp__staging_t *st = dev->staging;
  if (!st) return VP_OK;
  for (size_t k = 0; k < st->n + st->nlslots; k++)
    if ((k < st->n ? st->slots[k] : st->lslots[k - st->n])->refs)
      return vp__err(VP_EBUSY, "a staged weight is acquired; release it "
                     "first");
  ring_free(dev);
  return VP_OK;
}

/* `a` waits on the device for the work queued on `b` so far. */
static int stream_after(vp__device_t *dev, vp_stream_t a, vp_stream_t b) {
  if (a == b) return VP_OK;
  vp__fence_t *f = NULL;
  int rc = vp__fence_get(dev, b, &f);
  if (rc == VP_OK) {
    rc = vp__be_stream_wait_event(dev, a, f->event);
    vp__fence_put(dev, f);
  }
  return rc;
}

static bool overlaps(uint64_t a, uint64_t an, uint64_t b, uint64_t bn) {
  return a < b + bn && b < a + an;
}

int vp__staging_lend(vp__device_t *dev, uint64_t addr, uint64_t size,
                     vp_stream_t stream) {
  if (!addr || !size || addr % SLOT_ALIGN || size > UINT64_MAX - addr)
    return vp__err(VP_EINVAL, "the range at 0x%llx of %llu bytes is empty, "
                   "not %d-byte aligned or wraps", ULL(addr), ULL(size),
                   SLOT_ALIGN);
  vp__staging_t *st = dev->staging;
  if (!st) return VP_OK; /* nothing streamed yet: nothing to stage */
  if (st->nlent && !st->lent_open)
    return vp__err(VP_EBUSY, "the loan was closed (an acquire took a weight "
                   "staged there); reclaim it first");
  /* A range that continues one lent already lengthens it: its slots may
   * run on across the seam (a loan lent in two steps). */
  size_t grows = SIZE_MAX;
  for (size_t r = 0; r < st->nlent && grows == SIZE_MAX; r++)
    if (st->lent[r].addr + st->lent[r].size == addr) grows = r;
  if (grows == SIZE_MAX && st->nlent == VP_LENT_RANGES)
    return vp__err(VP_EBUSY, "%d ranges are lent already; reclaim them first",
                   VP_LENT_RANGES);
  if (overlaps(addr, size, st->vb->va, st->vb->size + st->vb->mirror))
    return vp__err(VP_EINVAL, "the range at 0x%llx overlaps the staging ring",
                   ULL(addr));
  for (size_t r = 0; r < st->nlent; r++)
    if (overlaps(addr, size, st->lent[r].addr, st->lent[r].size))
      return vp__err(VP_EINVAL, "the range at 0x%llx overlaps one lent "
                     "already", ULL(addr));
  vp_stream_t cs = 0;
  int rc = vp__copy_stream(dev, &cs);
  if (rc == VP_OK && (rc = stream_after(dev, cs, stream)))
    rc = vp__err(rc, "the copy stream cannot wait for stream 0x%llx",
                 ULL(stream));
  if (rc) return rc;
  if (grows != SIZE_MAX)
    st->lent[grows].size += size;
  else
    st->lent[st->nlent++] = (vp__lent_t){.addr = addr, .size = size};
  st->lent_open = true;
  return VP_OK;
}

int vp__staging_reclaim(vp__device_t *dev, vp_stream_t stream, bool force) {
  vp__staging_t *st = dev->staging;
  if (!st || !st->nlent) return VP_OK;
  st->lent_open = false;
  for (size_t k = 0; k < st->nlslots; k++) {
    const vp__slot_t *s = st->lslots[k];
    if (s->refs)
      return vp__err(VP_EBUSY, "a weight staged in lent memory is acquired; "
                     "release it first");
    if (!force && s->prefetched && s->owner)
      return vp__err(VP_EBUSY, "a weight staged in lent memory waits for its "
                     "acquire");
  }
  /* The copies into the ranges, then their readers, before the caller's
   * next use of the memory: the newest copy still running into a slot
   * (copy-stream fences complete in order), not the copy stream's whole
   * queue, whose ring copies may run a window ahead. A slot its weight
   * let go of has none running (the weight waited for it, or its batch
   * was never issued). */
  vp__fence_t *newest = NULL;
  for (size_t k = 0; k < st->nlslots; k++) {
    vp__weight_t *w = st->lslots[k]->owner;
    if (w && vp__weight_copy_pending(dev, w) &&
        (!newest || w->copy_fence->seq > newest->seq))
      newest = w->copy_fence;
  }
  int rc = newest ? vp__be_stream_wait_event(dev, stream, newest->event)
                  : VP_OK;
  for (size_t k = 0; k < st->nlslots && rc == VP_OK; k++) {
    const vp__fence_t *f = st->lslots[k]->fence;
    if (f && f->stream != stream &&
        vp__be_event_query(dev, f->event) != VP_OK)
      rc = vp__be_stream_wait_event(dev, stream, f->event);
  }
  if (rc)
    return vp__err(rc, "stream 0x%llx cannot wait for the lent memory's "
                   "copies and readers", ULL(stream));
  lent_drop(dev, st);
  return VP_OK;
}

/* Device close: the ring, then the copy stream. */
void vp__staging_close(vp__device_t *dev) {
  ring_free(dev);
  if (dev->copy_stream) vp__be_stream_destroy(dev, dev->copy_stream);
  dev->copy_stream = 0;
}
