/* Debug builds (make DEBUG=1) re-derive the counts the pager keeps by hand
 * from the page tables after every public call, and abort with a dump on
 * the first mismatch. The release library never aborts. */
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

void vp__check_invariants(vp__device_t *dev) {
  uint64_t pages = 0;
  for (uint32_t s = 0; s < dev->vbars.n; s++)
    if (dev->vbars.slots[s]) pages += check_vbar(dev, dev->vbars.slots[s]);
  if (pages << dev->page_shift != dev->committed)
    dump_and_abort(dev, NULL, "device->committed", dev->committed,
                   pages << dev->page_shift);
}
