/* Debug builds (make DEBUG=1) re-derive the counts the pager keeps by hand
 * from the page tables after every public call, check the staging ring's
 * slots and the prefetch skip index against what they summarize, and
 * abort with a dump on the first mismatch. The release library never
 * aborts. */
#include <stdio.h>
#include <stdlib.h>

#include "internal.h"

static void dump_and_abort(const vp__device_t *dev, const vp__vbar_t *vb,
                           const char *what, uint64_t kept, uint64_t real) {
  fprintf(stderr, "vpager invariant broken: %s is %llu, the page tables say "
          "%llu (last error: %s)\n", what, (unsigned long long)kept,
          (unsigned long long)real, vp_last_error());
  if (vb)
    fprintf(stderr, "  VBAR 0x%llx: %u pages, resident %u, pinned %u, "
            "%u weights, %u acquired\n", (unsigned long long)vb->id,
            vb->npages, vb->resident, vb->pinned, vb->nweights, vb->acquired);
  fprintf(stderr, "  device %s: committed %llu bytes, page %llu\n",
          dev->caps.name, (unsigned long long)dev->committed,
          (unsigned long long)dev->page_size);
  abort();
}

/* Checks one VBAR; returns its resident pages. */
static uint64_t check_vbar(const vp__device_t *dev, const vp__vbar_t *vb) {
  uint32_t resident = 0, pinned = 0;
  for (uint32_t p = 0; p < vb->npages; p++) {
    const vp__page_t *pg = &vb->pages[p];
    if (pg->pins && !pg->resident)
      dump_and_abort(dev, vb, "pins of a page that is not resident",
                     pg->pins, 0);
    resident += pg->resident;
    pinned += pg->pins != 0;
  }
  if (resident != vb->resident)
    dump_and_abort(dev, vb, "vbar->resident", vb->resident, resident);
  if (pinned != vb->pinned)
    dump_and_abort(dev, vb, "vbar->pinned", vb->pinned, pinned);
  return resident;
}

/* The prefetch skip index, while current (stream.c): a weight it steps
 * over passes every scan until the pages change (no source, or resident
 * with its last fill, not filled ahead), and a step lands on the end of
 * its run. */
static void check_skip(const vp__device_t *dev, const vp__vbar_t *vb) {
  uint32_t n = vb->nweights;
  if (!vb->skip_ok || vb->skip_epoch != vb->epoch || !vb->skip) return;
  if (vb->skip[n] != n)
    dump_and_abort(dev, vb, "skip[nweights]", vb->skip[n], n);
  for (uint32_t i = 0; i < n; i++) {
    const vp__weight_t *w = vb->use[i];
    uint32_t to = vb->skip[i];
    if (to == i) continue;
    if (to < i || to != vb->skip[i + 1])
      dump_and_abort(dev, vb, "a skip index step", to, vb->skip[i + 1]);
    if (w->src.kind != VP_SOURCE_NONE && (w->prefetched ||
                                          !vp__ready_in_place(w)))
      dump_and_abort(dev, vb, "a weight the skip index steps over that a "
                     "scan must look at (index)", i, i);
  }
}

/* The staging ring: its slots in offset order, inside it, apart (in a
 * ring that wraps, the last may run on into its start, up to the first);
 * `taken` their sum; a slot's weight points back at it. */
static void check_ring(const vp__device_t *dev) {
  const vp__staging_t *st = dev->staging;
  if (!st) return;
  uint64_t taken = 0, end = 0;
  for (size_t k = 0; k < st->n; k++) {
    const vp__slot_t *s = st->slots[k];
    uint64_t room = st->size - s->off; /* inside, or wrapped to the first */
    if (st->vb->mirrored && s->off < st->size && k == st->n - 1)
      room += k ? st->slots[0]->off : s->off;
    if (s->off < end || s->off >= st->size || s->size > room)
      dump_and_abort(dev, NULL, "a staging slot's offset (after the last "
                     "one's end, inside the ring)", s->off, end);
    if (s->owner && s->owner->slot != s)
      dump_and_abort(dev, NULL, "a staging slot whose weight has another "
                     "(slot index)", k, k);
    end = s->off + s->size;
    taken += s->size;
  }
  if (taken != st->taken)
    dump_and_abort(dev, NULL, "staging->taken", st->taken, taken);
  if (st->next > st->size)
    dump_and_abort(dev, NULL, "staging->next", st->next, st->size);
}

void vp__check_invariants(vp__device_t *dev) {
  uint64_t pages = 0;
  for (uint32_t s = 0; s < dev->vbars.n; s++)
    if (dev->vbars.slots[s]) {
      pages += check_vbar(dev, dev->vbars.slots[s]);
      check_skip(dev, dev->vbars.slots[s]);
    }
  check_ring(dev);
  if (pages << dev->page_shift != dev->committed)
    dump_and_abort(dev, NULL, "device->committed", dev->committed,
                   pages << dev->page_shift);
}
