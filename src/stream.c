/* Streaming: vp_acquire / vp_release and prefetch.
 *
 * Every copy runs on the device's copy stream; a caller's stream waits for
 * it on the device (an event), so the CPU never waits for a copy and the
 * copy engine works while the caller's kernels run. After each acquire the
 * next weights of the VBAR that need a copy (up to the acquire's window of
 * them: the call's own, else the last weight's, else the device's
 * lookahead; in the order of use, wrapping to the start for the next pass)
 * are filled or staged ahead of need, in place or in the staging ring
 * (staging.c). */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* A pending host-to-device copy; adjacent ones are merged. */
typedef struct copy {
  uint64_t dst, size;
  const vp_source_t *src;
  uint64_t src_off; /* into the source */
  size_t nw;        /* weights it fills: the next nw of batch.filled */
} copy_t;

/* Prefetch records a copy-stream fence after each copy that ends this many
 * bytes after the last fence (and after the batch), so an acquire waits for
 * its own weight's copy (~40 us of link), not for everything one window
 * top-up queued with it (up to lookahead / 8: milliseconds). */
#define FENCE_SPLIT (2ull << 20)

/* What the caller's stream must wait for: the newest copy-stream fence of
 * the weights it takes, or (tail) everything queued on the copy stream. */
typedef struct waits {
  vp__fence_t *newest;
  bool tail;
} waits_t;

typedef struct batch {
  copy_t *c;
  size_t n, cap;
  uint32_t programs; /* its host copies by SMs (vp_prefetch_sm); 0: not */
  vp__weight_t **filled; /* weights whose copies these are */
  size_t nfilled, filled_cap;
  int failed; /* an issue stopped part way: its error; not issued again */
} batch_t;


/* ------------------------------------------------------------ copies */

static int batch_add(vp__device_t *dev, batch_t *b, vp__weight_t *w,
                     uint64_t dst) {
  int rc = vp__grow(dev, (void **)&b->c, &b->cap, b->n, sizeof *b->c);
  if (rc || (rc = vp__grow(dev, (void **)&b->filled, &b->filled_cap, b->nfilled,
                       sizeof *b->filled)))
    return rc;
  copy_t *last = b->n ? &b->c[b->n - 1] : NULL;
  b->filled[b->nfilled++] = w;
  /* Merge with the previous copy when both ends continue it (the ring's
   * second view continues a slot that ran past its end). */
  if (last && vp__staging_continues(dev, last->dst + last->size, dst) &&
      last->src->kind == w->src.kind &&
      ((w->src.kind == VP_SOURCE_HOST &&
        (const char *)last->src->host + last->src_off + last->size ==
            (const char *)w->src.host) ||
       (w->src.kind == VP_SOURCE_FILE && last->src->fd == w->src.fd &&
        last->src->file_offset + last->src_off + last->size ==
            w->src.file_offset))) {
    last->size += w->size;
    last->nw++;
    return VP_OK;
  }
  b->c[b->n++] = (copy_t){dst, w->size, &w->src, 0, 1};
  return VP_OK;
}

static int copy_one(vp__device_t *dev, const copy_t *c, vp_stream_t cs,
                    uint32_t programs) {
  if (c->src->kind == VP_SOURCE_FILE)
    return vp__file_read(dev, c->src->fd, c->src->file_offset + c->src_off,
                         c->size, c->dst, cs, "a weight's source file");
  /* Split at host buffer chunk edges: CUDA copies cannot span two. */
  int rc = vp__copy_htod_sm(dev, c->dst,
                            (const char *)c->src->host + c->src_off, c->size,
                            cs, true, programs);
  if (rc)
    return vp__err(rc, "copying %llu bytes to 0x%llx failed",
                   (unsigned long long)c->size, (unsigned long long)c->dst);
  return VP_OK;
}

/* filled[from, to) keep f until it is seen complete. */
static void fence_filled(vp__device_t *dev, batch_t *b, size_t from,
                         size_t to, vp__fence_t *f) {
  for (size_t i = from; i < to; i++) {
    vp__weight_t *w = b->filled[i];
    if (w->copy_fence) vp__fence_put(dev, w->copy_fence);
    w->copy_fence = f;
    f->refs++;
  }
}

/* Issue the batch on the copy stream and record a fence after it, which
 * every weight filled by the batch keeps until it is seen complete; with
 * `split`, also one after each copy FENCE_SPLIT bytes past the last fence,
 * which the weights of the copies before it keep instead (copy-stream
 * fences complete in order). *fence (may be NULL) gets a reference to the
 * last. On failure the copies issued have completed when it returns (the
 * caller unpins their pages at once: a copy still queued would write into
 * pages freed meanwhile, or into a slot given to another weight), and the
 * weights of the copies issued keep their fences. */
static int batch_issue(vp__device_t *dev, batch_t *b, bool split,
                       vp__fence_t **fence) {
  vp_stream_t cs;
  vp__fence_t *f = NULL;
  size_t from = 0, to = 0; /* filled[from, to): copied since the last fence */
  uint64_t bytes = 0;
  if (b->failed) return b->failed;
  int rc = vp__copy_stream(dev, &cs);
  bool drain = rc == VP_OK;
  for (size_t i = 0; i < b->n && rc == VP_OK; i++) {
    if ((rc = copy_one(dev, &b->c[i], cs, b->programs))) break;
    dev->stats.copies++;
    to += b->c[i].nw;
    bytes += b->c[i].size;
    if (i + 1 < b->n && !(split && bytes >= FENCE_SPLIT)) continue;
    if (f) vp__fence_put(dev, f);
    if ((rc = vp__fence_get(dev, cs, &f))) {
      f = NULL;
      break;
    }
    fence_filled(dev, b, from, to, f);
    from = to;
    bytes = 0;
  }
  if (rc == VP_OK && !f) rc = vp__fence_get(dev, cs, &f); /* no copy */
  if (rc) {
    if (f) vp__fence_put(dev, f);
    if (drain) vp__be_stream_synchronize(dev, cs); /* waits even when failing */
    return b->failed = rc;
  }
  b->n = b->nfilled = 0;
  if (fence) *fence = f; else vp__fence_put(dev, f);
  return VP_OK;
}


/* The caller waits for w's fill only if it may still be running, and then
 * only for the newest such fill among the weights it takes. */
static void wait_for_copy(vp__device_t *dev, vp__weight_t *w, waits_t *wait) {
  if (vp__weight_copy_pending(dev, w) &&
      (!wait->newest || w->copy_fence->seq > wait->newest->seq)) {
    /* Our own reference: a later listing of the same weight may see the
     * copy done and let go of the weight's. */
    if (wait->newest) vp__fence_put(dev, wait->newest);
    wait->newest = w->copy_fence;
    wait->newest->refs++;
  }
}


/* ------------------------------------------------------------- acquire */

/* Bytes about to be rewritten in place (a new source, a weight made anew
 * over resident pages) may still be read by work queued before their last
 * release: the copy stream waits for the pages' release fences first, as
 * eviction waits for them and staging waits for a slot's. */
static int order_refill(vp__device_t *dev, vp__weight_t *w) {
  vp_stream_t cs = 0;
  int rc = vp__copy_stream(dev, &cs);
  return rc ? rc : vp__order_after(w->vb, w->p0, w->p1, cs);
}

/* Use w in place: its pages are pinned; fill them if they were recommitted
 * since its last fill. */
static int acquire_resident(vp__device_t *dev, vp__weight_t *w, batch_t *b,
                            vp_stream_t stream, vp__hold_t *hold,
                            uint64_t *ptr, uint8_t *flags, waits_t *wait) {
  uint8_t f = VP_ACQUIRED_RESIDENT;
  *ptr = w->vb->va + w->offset;
  if (!vp__gens_equal(w)) {
    if (w->src.kind == VP_SOURCE_NONE) {
      /* The caller writes the pages on its stream. */
      int rc = vp__order_after(w->vb, w->p0, w->p1, stream);
      if (rc) return rc;
      f |= VP_ACQUIRED_EMPTY;
    } else {
      int rc = order_refill(dev, w);
      if (rc || (rc = batch_add(dev, b, w, *ptr))) return rc;
      f |= VP_ACQUIRED_COPIED;
      w->vb->win_ok = false; /* prefetch did not cover it: scan again */
      VP__COUNT(w->vb, weight_fills, 1);
      VP__COUNT(w->vb, fill_bytes, w->size);
    }
    vp__gens_take(w);
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
    if (s->lent) dev->staging->lent_open = false; /* the pause is over */
    wait_for_copy(dev, w, wait);
  } else {
    int rc = vp__ring_alloc(dev, w, false, NULL, &s);
    if (rc) return rc;
    if (w->src.kind == VP_SOURCE_NONE) {
      /* The caller writes the slot on its stream: through the copy stream
       * it then waits for the slot's last readers too. */
      f |= VP_ACQUIRED_EMPTY;
      wait->tail = true;
    } else {
      if ((rc = batch_add(dev, b, w, vp__slot_addr(dev, s)))) {
        s->owner = NULL; /* holds no data: reclaimed like a released slot */
        w->slot = NULL;
        return rc;
      }
      f |= VP_ACQUIRED_COPIED;
    }
    w->vb->win_ok = false; /* prefetch did not cover it: scan again */
    VP__COUNT(w->vb, weight_staged, 1);
    VP__COUNT(w->vb, staged_bytes, w->size);
  }
  s->refs++;
  s->used = ++dev->staging->clock;
  w->acq_staged++;
  hold->staged++;
  *ptr = vp__slot_addr(dev, s);
  *flags = f;
  return VP_OK;
}

static int acquire_one(vp__device_t *dev, vp__weight_t *w, batch_t *b,
                       vp_stream_t stream, uint64_t *ptr, uint8_t *flags,
                       waits_t *wait) {
  vp__hold_t *hold;
  int rc = vp__hold_get(dev, w, stream, &hold);
  if (rc) return rc;
  VP__COUNT(w->vb, acquires, 1);
  rc = vp__fault(w->vb, w->p0, w->p1, NULL);
  if (rc == VP_OK) {
    rc = acquire_resident(dev, w, b, stream, hold, ptr, flags, wait);
    if (rc) vp__unpin_nofence(w->vb, w->p0, w->p1);
  } else if (rc == VP_MISS) {
    rc = acquire_staged(dev, w, b, hold, ptr, flags, wait);
  }
  if (rc) vp__hold_trim(w, stream);
  return rc;
}

/* Undo the first n acquires of a failed vp_acquire. Copies already listed
 * are issued and the pins dropped behind a copy-stream fence; if issuing
 * fails, those weights are left unfilled instead. */
static void acquire_undo(vp__device_t *dev, vp__weight_t **ws, size_t n,
                         vp_stream_t stream, const uint64_t *ptrs,
                         const uint8_t *flags, batch_t *b) {
  vp__fence_t *f = NULL;
  bool issued = batch_issue(dev, b, false, &f) == VP_OK;
  for (size_t i = 0; i < n; i++) {
    vp__weight_t *w = ws[i];
    vp__hold_t *hold = vp__hold_find(w, stream);
    w->vb->acquired--;
    if (ptrs[i] != w->vb->va + w->offset) { /* this call staged it */
      w->acq_staged--;
      hold->staged--;
      w->slot->refs--;
    } else {
      w->acq_resident--;
      hold->resident--;
      if (flags[i] & VP_ACQUIRED_EMPTY) { /* nobody wrote it */
        w->gens[0] = 0;
        w->vb->skip_ok = false;
      }
      if (f) vp__unpin_attach_fill(w->vb, w->p0, w->p1, f);
      else vp__unpin_nofence(w->vb, w->p0, w->p1);
    }
    vp__hold_trim(w, stream);
  }
  /* A slot this call handed out EMPTY holds nothing anyone wrote: once no
   * hold is left (later listings of the weight included), it is reclaimed
   * like a free one. */
  for (size_t i = 0; i < n; i++) {
    vp__slot_t *s = ws[i]->slot;
    if ((flags[i] & VP_ACQUIRED_EMPTY) && s && !s->refs &&
        ptrs[i] != ws[i]->vb->va + ws[i]->offset) {
      s->owner = NULL;
      ws[i]->slot = NULL;
    }
  }
  for (size_t i = 0; !issued && i < b->nfilled; i++) {
    vp__weight_t *w = b->filled[i];
    w->vb->prefetch_idle = false;
    w->vb->win_ok = false;
    w->vb->skip_ok = false;
    w->gens[0] = 0;
    w->prefetched = false;
    if (w->slot && !w->slot->refs) {
      w->slot->owner = NULL;
      w->slot = NULL;
    }
  }
  if (f) vp__fence_put(dev, f);
}


static void prefetch(vp__device_t *dev, vp__weight_t *last,
                     uint64_t lookahead, uint32_t programs);

/* The window of the prefetch after acquiring w: its own, else the
 * device's. */
static uint64_t window_of(const vp__device_t *dev, const vp__weight_t *w) {
  return w->lookahead == VP_LOOKAHEAD_DEVICE ? dev->lookahead : w->lookahead;
}

/* The lookahead a release top-up of vb runs with: its last acquire's. */
static uint64_t acquired_window(const vp__device_t *dev,
                                const vp__vbar_t *vb) {
  return vb->acq_ahead_set ? vb->acq_ahead
                           : window_of(dev, vb->use[vb->acq_index]);
}

/* The chunk of the window acquires may use up before a scan tops it up:
 * an eighth, so at least 7/8 of it stays queued ahead. Of what the ring
 * holds, when the lookahead is more: a window the ring cuts short is
 * topped up as its slots come free (a chunk of an unreachable lookahead
 * never came free: every window's next weight missed, staged at its
 * acquire). */
static uint64_t window_chunk(const vp__device_t *dev, uint64_t lookahead) {
  uint64_t ring = dev->staging ? dev->staging->size : 0;
  return (ring && ring < lookahead ? ring : lookahead) / 8;
}

/* Weights handles of one call, on the stack when few. */
#define FEW 64

/* ahead: the call's own lookahead (vp_acquire_ahead), or NULL: the last
 * weight's window. */
static int acquire_locked(vp__device_t *dev, vp__weight_t **ws, size_t n,
                          vp_stream_t stream, uint64_t *ptrs, uint8_t *flags,
                          const uint64_t *ahead) {
  batch_t b = {0};
  waits_t wait = {NULL, false};
  size_t i;
  int rc = VP_OK;
  /* Commit the staging ring before this call pins anything, so making
   * room for it may still evict: a layer may need both. */
  for (i = 0; i < n && !dev->staging && rc == VP_OK; i++)
    if (!vp__all_resident(ws[i])) rc = vp__staging_open(dev);
  if (rc) return rc;
  for (i = 0; i < n && rc == VP_OK; i++) {
    flags[i] = 0;
    rc = acquire_one(dev, ws[i], &b, stream, &ptrs[i], &flags[i], &wait);
    if (rc == VP_OK) {
      ws[i]->vb->acquired++;
      if (flags[i] & (VP_ACQUIRED_STAGED | VP_ACQUIRED_COPIED))
        ws[i]->vb->win_used += ws[i]->size; /* copied for it: the window
                                               moved on */
    }
  }
  if (rc) {
    acquire_undo(dev, ws, i - 1, stream, ptrs, flags, &b);
  } else if (b.nfilled || wait.tail || wait.newest) {
    /* A fence after this call's copies covers every earlier fill too. */
    vp__fence_t *f = wait.newest;
    if (b.nfilled || wait.tail) rc = batch_issue(dev, &b, false, &f);
    else f->refs++;
    if (rc == VP_OK) {
      rc = vp__be_stream_wait_event(dev, stream, f->event);
      if (rc) rc = vp__err(rc, "stream 0x%llx cannot wait for the copy stream",
                           (unsigned long long)stream);
      dev->stats.stream_waits++;
      vp__fence_put(dev, f);
    }
    if (rc) /* nothing stays acquired */
      acquire_undo(dev, ws, n, stream, ptrs, flags, &b);
  }
  if (wait.newest) vp__fence_put(dev, wait.newest);
  free(b.c);
  free(b.filled);
  if (rc == VP_OK) {
    vp__weight_t *last = ws[n - 1];
    vp__vbar_t *vb = last->vb;
    vb->acq_index = last->use_index;
    vb->acq_ahead_set = ahead != NULL;
    vb->acq_ahead = ahead ? *ahead : 0;
    uint64_t lookahead = ahead ? *ahead : window_of(dev, last);
    if (lookahead) prefetch(dev, last, lookahead, 0);
  }
  return rc;
}

/* Tell the ledger which VBARs were used (weights come a VBAR at a time). */
static void ledger_used(vp__device_t *dev, vp__weight_t **ws, size_t n) {
  for (size_t i = 0; dev->ledger && i < n; i++)
    if (i == 0 || ws[i]->vb != ws[i - 1]->vb) vp__ledger_used(dev, ws[i]->vb);
}

static int acquire(vp_device_t h, const vp_weight_t *w, size_t n,
                   vp_stream_t stream, uint64_t *ptrs, uint8_t *flags,
                   const uint64_t *ahead) {
  if (!n || !w || !ptrs)
    return vp__err(VP_EINVAL, "n is 0 or weights/ptrs is NULL");
  /* Flags are kept even when the caller wants none: undoing a failed call
   * needs to know which weights it handed out EMPTY. */
  vp__weight_t *few[FEW], **ws = n <= FEW ? few : malloc(n * sizeof *ws);
  uint8_t few_flags[FEW], *fl = flags ? flags
                                : n <= FEW ? few_flags : malloc(n);
  vp__device_t *dev = NULL;
  vp__ask_t ask = {0};
  int rc = ws && fl ? vp__dev_enter(h, &dev)
                    : vp__err(VP_ENOMEM, "no memory for %zu handles", n);
  for (int tries = 0; rc == VP_OK; tries++) {
    rc = vp__weights_find(dev, w, n, ws);
    /* Budget misses that our own pages could not cover are taken to
     * other processes after the call, unlocked: the next acquire finds
     * the room. */
    dev->ask = (vp__ask_t){.mode = VP__ASK_AFTER};
    if (rc == VP_OK) rc = acquire_locked(dev, ws, n, stream, ptrs, fl, ahead);
    ask = dev->ask;
    dev->ask = (vp__ask_t){.mode = VP__ASK_OFF};
    if (rc == VP_OK) ledger_used(dev, ws, n);
    vp__unlock(dev, rc);
    vp__release_ask(dev, &ask);
    /* The staging ring (VP_EOOM: every miss needs it) found no room that
     * other processes hold: they were just asked, so once more (another
     * process that filled the device before our first miss). */
    if (rc != VP_EOOM || !ask.pending || tries > 0) break;
    rc = vp__dev_enter(h, &dev);
  }
  if (ws != few) free(ws);
  if (fl != flags && fl != few_flags) free(fl);
  return rc;
}

int vp_acquire(vp_device_t h, const vp_weight_t *w, size_t n,
               vp_stream_t stream, uint64_t *ptrs, uint8_t *flags) {
  VP__ENTER();
  return acquire(h, w, n, stream, ptrs, flags, NULL);
}

int vp_acquire_ahead(vp_device_t h, const vp_weight_t *w, size_t n,
                     vp_stream_t stream, uint64_t *ptrs, uint8_t *flags,
                     uint64_t lookahead) {
  VP__ENTER();
  return acquire(h, w, n, stream, ptrs, flags, &lookahead);
}


/* What vp_acquire's last step does for `after`, without acquiring it: a
 * caller that keeps weights acquired across several layers (vpager.torch
 * holds a model's resident layers for a whole forward) still tops the
 * window up at each of them. */
/* vp_prefetch's work: ahead, the call's window, or NULL: the weight's;
 * programs: its copies by SMs (vp_prefetch_sm). */
static int prefetch_after(vp_device_t h, vp_weight_t after,
                          const uint64_t *ahead, uint32_t programs) {
  vp__device_t *dev = NULL;
  int rc = vp__dev_enter(h, &dev);
  if (rc) return rc;
  vp__weight_t *w = NULL;
  rc = vp__weights_find(dev, &after, 1, &w);
  uint64_t lookahead = rc != VP_OK ? 0 : ahead ? *ahead : window_of(dev, w);
  if (lookahead) prefetch(dev, w, lookahead, programs);
  vp__unlock(dev, rc);
  return rc;
}

int vp_prefetch(vp_device_t h, vp_weight_t after) {
  VP__ENTER();
  return prefetch_after(h, after, NULL, 0);
}

int vp_prefetch_ahead(vp_device_t h, vp_weight_t after, uint64_t lookahead) {
  VP__ENTER();
  return prefetch_after(h, after, &lookahead, 0);
}

int vp_prefetch_sm(vp_device_t h, vp_weight_t after, uint64_t lookahead,
                   uint32_t programs) {
  VP__ENTER();
  if (programs == 0 || programs > VP_SM_PROGRAMS_MAX)
    return vp__err(VP_EINVAL, "programs %u is not 1 to %u", programs,
                   VP_SM_PROGRAMS_MAX);
  return prefetch_after(h, after, lookahead ? &lookahead : NULL, programs);
}


/* ------------------------------------------------------------- release */

/* A slot keeps one release fence: readers on another stream must finish
 * before the new one completes (as vp__order_after does for pages). */
static int slot_order_after(vp__device_t *dev, vp__slot_t *s,
                            vp_stream_t stream) {
  vp__fence_t *f = s->fence;
  if (!f || f->stream == stream ||
      vp__be_event_query(dev, f->event) == VP_OK)
    return VP_OK;
  int rc = vp__be_stream_wait_event(dev, stream, f->event);
  if (rc)
    return vp__err(rc, "ordering stream 0x%llx after earlier readers failed",
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
    const vp__hold_t *h = vp__hold_find(w, stream);
    uint32_t k = ++w->listed;
    if (!h || k > h->resident + h->staged) {
      rc = vp__err(VP_ENOTPINNED, "weights[%zu] is not acquired on stream "
                   "0x%llx as often as listed (%u listed, %u held)", i,
                   (unsigned long long)stream, k,
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
  vp__hold_t *h = vp__hold_find(w, stream);
  w->vb->acquired--;
  if (ends_staged(h, 1)) {
    vp__slot_t *s = w->slot;
    w->acq_staged--;
    h->staged--;
    s->refs--;
    s->used = ++dev->staging->clock;
    w->vb->win_freed += w->size;
    if (s->fence) vp__fence_put(dev, s->fence);
    s->fence = f;
    f->refs++;
  } else {
    w->acq_resident--;
    h->resident--;
    vp__unpin_attach(w->vb, w->p0, w->p1, f);
  }
  vp__hold_trim(w, stream);
}

/* A window the ring cut short, with a chunk of ring room released since
 * its scan: queue the next copies now, from the last acquire on. Without
 * this the room waits for the next acquire that uses up a chunk, and at a
 * forward's end that is the next forward's first streamed unit: the copy
 * engine stands idle while the resident units before it compute. The
 * copies wait on the device for the slots' release fences. */
static void refill_after_release(vp__device_t *dev, vp__vbar_t *vb) {
  if (!vb->win_ok || !vb->win_ring || vb->win_all ||
      vb->win_epoch != vb->epoch || vb->acq_index >= vb->nweights)
    return;
  uint64_t lookahead = acquired_window(dev, vb);
  if (!lookahead || vb->win_freed < window_chunk(dev, lookahead)) return;
  vb->win_ok = false; /* scan, whatever the window says */
  prefetch(dev, vb->use[vb->acq_index], lookahead, 0);
}

int vp_release(vp_device_t h, const vp_weight_t *w, size_t n,
               vp_stream_t stream) {
  VP__ENTER();
  if (!n || !w)
    return vp__err(VP_EINVAL, "n is 0 or weights is NULL");
  vp__weight_t *few[FEW], **ws = n <= FEW ? few : malloc(n * sizeof *ws);
  if (!ws) return vp__err(VP_ENOMEM, "no memory for %zu handles", n);
  vp__device_t *dev = NULL;
  vp__fence_t *f;
  int rc = vp__dev_enter(h, &dev);
  if (rc == VP_OK) {
    if ((rc = vp__weights_find(dev, w, n, ws)) == VP_OK &&
        (rc = release_check(ws, n, stream)) == VP_OK &&
        (rc = vp__fence_get(dev, stream, &f)) == VP_OK) {
      for (size_t i = 0; i < n; i++) release_one(dev, ws[i], f, stream);
      vp__fence_put(dev, f);
      ledger_used(dev, ws, n);
      refill_after_release(dev, ws[n - 1]->vb);
    }
    vp__unlock(dev, rc);
  }
  if (ws != few) free(ws);
  return rc;
}


/* ------------------------------------------------------------ lending */

int vp_device_lend_staging(vp_device_t h, uint64_t addr, uint64_t size,
                           vp_stream_t stream) {
  VP__ENTER();
  vp__device_t *dev = NULL;
  int rc = vp__dev_enter(h, &dev);
  if (rc) return rc;
  rc = vp__staging_lend(dev, addr, size, stream);
  return vp__unlock(dev, rc);
}

int vp_device_reclaim_staging(vp_device_t h, vp_stream_t stream, int force) {
  VP__ENTER();
  vp__device_t *dev = NULL;
  int rc = vp__dev_enter(h, &dev);
  if (rc) return rc;
  return vp__unlock(dev, vp__staging_reclaim(dev, stream, force != 0));
}


/* ------------------------------------------------------------ prefetch */

/* Fill u's pages ahead of need (pinned until the batch is issued) or stage
 * it in a free ring slot. VP_MISS: nothing more fits now. */
static int prefetch_one(vp__device_t *dev, vp__weight_t *u,
                        const vp__ahead_t *ahead, batch_t *b) {
  int rc = vp__fault(u->vb, u->p0, u->p1, NULL);
  if (rc == VP_OK) {
    if (vp__gens_equal(u)) {
      vp__unpin_nofence(u->vb, u->p0, u->p1);
      return VP_OK;
    }
    rc = order_refill(dev, u);
    if (rc == VP_OK) rc = batch_add(dev, b, u, u->vb->va + u->offset);
    if (rc) {
      vp__unpin_nofence(u->vb, u->p0, u->p1);
      return rc;
    }
    vp__gens_take(u);
    u->prefetched = true;
    return VP_OK;
  }
  if (rc != VP_MISS || u->slot) return rc;
  vp__slot_t *s;
  if ((rc = vp__ring_alloc(dev, u, true, ahead, &s))) return rc;
  if ((rc = batch_add(dev, b, u, vp__slot_addr(dev, s)))) {
    s->owner = NULL; /* reclaimed like any released slot */
    u->slot = NULL;
    return rc;
  }
  s->prefetched = true;
  return VP_OK;
}

/* What the scan below stages after use[i] (up to VP_LENT_AHEAD weights:
 * not held, not resident with their bytes, not staged yet), in its order:
 * on to `end`, then, in the first run, from the start up to `at`. The
 * packing of a loan's ranges reads it (lent_pick). */
static void staged_ahead(const vp__vbar_t *vb, const uint32_t *skip,
                         uint32_t i, uint32_t end, uint32_t at, int run,
                         vp__ahead_t *ahead) {
  ahead->n = 0;
  uint32_t j = i + 1;
  for (; run < 2; run++, j = 0, end = at) {
    for (; ahead->n < VP_LENT_AHEAD; j++) {
      if (skip && j < end) j = skip[j];
      if (j >= end) break;
      const vp__weight_t *u = vb->use[j];
      if (u->acq_resident || u->acq_staged ||
          u->src.kind == VP_SOURCE_NONE || u->slot || u->prefetched ||
          vp__ready_in_place(u))
        continue;
      ahead->size[ahead->n++] = u->size;
    }
  }
}

/* Issue the prefetch copies; pages filled ahead are unpinned behind their
 * copies. If issuing fails, the weights are left unfilled. */
static void prefetch_finish(vp__device_t *dev, batch_t *b) {
  vp__fence_t *f = NULL;
  size_t n = b->nfilled;
  vp__weight_t **filled = b->filled;
  if (!n || batch_issue(dev, b, true, &f) != VP_OK) f = NULL;
  for (size_t i = 0; i < n; i++) {
    vp__weight_t *u = filled[i];
    if (!f) u->vb->win_ok = false; /* not queued after all */
    if (u->slot && u->slot->prefetched && !f) {
      u->slot->owner = NULL;
      u->slot = NULL;
    } else if (!u->slot) {
      if (f) { /* behind its own copy's fence */
        vp__unpin_attach_fill(u->vb, u->p0, u->p1, u->copy_fence);
      } else {
        vp__unpin_nofence(u->vb, u->p0, u->p1);
        u->vb->skip_ok = false;
        u->gens[0] = 0;
        u->prefetched = false;
      }
    }
  }
  if (f) vp__fence_put(dev, f);
}

/* True if a prefetch scan passes u by whatever happens until the pages
 * change: resident with its last fill, that fill not from prefetch (a
 * fill ahead of need is counted until used), or nothing to copy. */
static bool scan_passes(const vp__weight_t *u) {
  return u->src.kind == VP_SOURCE_NONE ||
         (!u->prefetched && vp__ready_in_place(u));
}

/* vb->skip for the pages as they are: O(weights), once per page change,
 * so a scan steps over the resident weights between the streamed ones in
 * one jump instead of looking at each (with small weights mostly
 * resident a scan would otherwise look at hundreds per acquire). NULL:
 * no memory, the scan looks at each weight. */
static const uint32_t *skip_index(vp__vbar_t *vb) {
  uint32_t n = vb->nweights;
  if (vb->skip_ok && vb->skip_epoch == vb->epoch) return vb->skip;
  if (!vb->skip_ok) { /* the number of weights may have changed */
    free(vb->skip);
    vb->skip = malloc(((size_t)n + 1) * sizeof *vb->skip);
  }
  if (!vb->skip) return NULL;
  vb->skip[n] = n;
  for (uint32_t i = n; i-- > 0;)
    vb->skip[i] = scan_passes(vb->use[i]) ? vb->skip[i + 1] : i;
  vb->skip_ok = true;
  vb->skip_epoch = vb->epoch;
  return vb->skip;
}

/* True if the last scan's window still stands and `last` lies in it:
 * what it queued is still ahead of the acquires, minus less than a
 * chunk. */
static bool window_holds(const vp__vbar_t *vb, const vp__weight_t *last,
                         uint64_t lookahead) {
  uint64_t chunk = window_chunk(vb->dev, lookahead);
  if (!vb->win_ok || vb->win_epoch != vb->epoch || vb->win_used >= chunk)
    return false;
  if (vb->win_all) return true;
  /* A larger lookahead than the window covers (the caller changed it):
   * scan, unless the ring is what limits the window. */
  if (!vb->win_ring && vb->win_bytes - vb->win_used + chunk < lookahead)
    return false;
  uint32_t n = vb->nweights;
  uint32_t at = (last->use_index + n - vb->win_from) % n;
  return at < (vb->win_to + n - vb->win_from) % n;
}

static void window_set(vp__vbar_t *vb, uint32_t from, uint32_t to, bool all,
                       bool ring, uint64_t bytes) {
  vb->win_from = from;
  vb->win_to = to;
  vb->win_all = all;
  vb->win_ring = ring;
  vb->win_ok = true;
  vb->win_epoch = vb->epoch;
  vb->win_bytes = bytes;
  vb->win_used = 0;
  vb->win_freed = 0;
}

/* Start the weights after `last` in its VBAR's order of use (the order
 * they were created; wrapping to the start, for the next pass) until
 * lookahead bytes of them (the window of the acquire) are staged or filled
 * ahead. Weights that stayed resident cost nothing and do not count: with the
 * resident weights first, the copy engine starts on the streamed ones while
 * the resident ones compute. A scan looks at each weight at most once, and
 * steps over runs of resident ones (skip_index); none runs while the
 * last scan's window holds. */
static void prefetch(vp__device_t *dev, vp__weight_t *last,
                     uint64_t lookahead, uint32_t programs) {
  vp__vbar_t *vb = last->vb;
  /* An open loan's bytes come on top of the window: the weights staged
   * there are the window's first, and the ring is to take as many after
   * them as the window would have it take (a top-up after a release
   * counts them too). */
  const vp__staging_t *st = dev->staging;
  for (size_t r = 0; st && st->lent_open && r < st->nlent; r++)
    lookahead += st->lent[r].size;
  /* All resident and filled at the last scan, and no page changed since:
   * nothing to scan. */
  if (vb->prefetch_idle && vb->prefetch_epoch == vb->epoch) return;
  if (window_holds(vb, last, lookahead)) return;
  batch_t b = {.programs = programs};
  uint64_t bytes = 0;
  bool work = false;
  int rc = VP_OK;
  const uint32_t *skip = skip_index(vb);
  uint32_t n = vb->nweights, at = last->use_index, stop = at;
  bool broke = false; /* stopped at use[stop], which is not queued */
  /* Two runs: after `last` to the end, then from the start up to it. */
  for (int run = 0; run < 2 && rc == VP_OK; run++) {
    uint32_t i = run ? 0 : at + 1, end = run ? at : n;
    for (; rc == VP_OK; i++) {
      if (skip && i < end) i = skip[i];
      if (i >= end) break;
      stop = i;
      vp__weight_t *u = vb->use[i];
      if (u->acq_resident || u->acq_staged || u->src.kind == VP_SOURCE_NONE)
        continue;
      bool ready = vp__ready_in_place(u);
      if (u->prefetched && !ready) { /* its pages went before its use */
        VP__COUNT(u->vb, prefetch_dropped_bytes, u->size);
        u->prefetched = false;
      }
      if (ready && !u->prefetched) continue; /* stayed resident: no copy */
      work = true;
      if (bytes >= lookahead) {
        broke = true;
        goto done;
      }
      bytes += u->size;
      if (u->slot || u->prefetched) continue; /* staged or filled ahead */
      size_t before = b.nfilled;
      vp__ahead_t ahead, *lent = NULL;
      if (st && st->lent_open && st->nlent > 1) { /* where in the loan */
        staged_ahead(vb, skip, i, end, at, run, &ahead);
        lent = &ahead;
      }
      rc = prefetch_one(dev, u, lent, &b);
      if (b.nfilled > before) VP__COUNT(u->vb, prefetch_bytes, u->size);
      if (rc) broke = true;
    }
  }
done:
  /* The window: from after `last` to the weight the scan stopped at (not
   * queued: over the lookahead, no ring room, or an error), or all. */
  if (rc >= 0 && n)
    window_set(vb, (at + 1) % n, stop, !broke, rc == VP_MISS, bytes);
  else
    vb->win_ok = false;
  if (!work) { /* until a page or a staging slot changes */
    vb->prefetch_idle = true;
    vb->prefetch_epoch = vb->epoch;
  }
  prefetch_finish(dev, &b);
  if (rc < 0) vp__log(VP_LOG_DEBUG, dev->caps.name, "prefetch stopped: %s",
                      vp_last_error());
  free(b.c);
  free(b.filled);
}
