/* How much may be committed now:
 *   allowed = min(min(free_at_poll + ours_at_poll, total) - kept, limit)
 * where kept is the larger of our headroom and the largest headroom the
 * device's other vpager processes share through the ledger.
 * Device-wide free memory (every process) is polled no more often than the
 * poll interval; between polls our own commits are accounted exactly, which
 * the formula does by fixing ours at the poll. The min() matters when the
 * device shrinks below what is committed (free reads 0). */
#include "internal.h"

void vp__budget_init(vp__device_t *dev) {
  vp__budget_t *b = &dev->budget;
  b->poll_interval_ns = (uint64_t)dev->opts.poll_interval_us * 1000;
  b->last_poll_ns = 0;
  b->total = dev->caps.total_memory;
  b->headroom_given = dev->opts.headroom >= 0;
  b->headroom = b->headroom_given ? dev->opts.headroom
                                  : (int64_t)dev->caps.default_headroom;
  b->shared_headroom = -1;
  b->peers_headroom = 0;
  b->limit = UINT64_MAX;
}

uint64_t vp__budget_kept(const vp__device_t *dev) {
  const vp__budget_t *b = &dev->budget;
  uint64_t own = (uint64_t)b->headroom;
  return own > b->peers_headroom ? own : b->peers_headroom;
}

/* The next check polls the device again. */
void vp__budget_invalidate(vp__device_t *dev) { dev->budget.last_poll_ns = 0; }

static int poll(vp__device_t *dev, uint64_t now) {
  vp__budget_t *b = &dev->budget;
  uint64_t free_bytes, total;
  int rc = vp__be_mem_info(dev, &free_bytes, &total);
  if (rc) return rc;
  b->free_at_poll = free_bytes;
  b->ours_at_poll = dev->committed;
  b->total = total;
  b->last_poll_ns = now ? now : 1;
  dev->stats.budget_polls++;
  return VP_OK;
}

int vp__budget_allowed(vp__device_t *dev, uint64_t *allowed) {
  vp__budget_t *b = &dev->budget;
  uint64_t now = vp__os_now_ns();
  if (b->last_poll_ns == 0 || now - b->last_poll_ns >= b->poll_interval_ns) {
    int rc = poll(dev, now);
    if (rc) return rc;
  }
  uint64_t cap = b->free_at_poll + b->ours_at_poll;
  if (cap > b->total) cap = b->total;
  uint64_t head = vp__budget_kept(dev);
  *allowed = cap > head ? cap - head : 0;
  if (*allowed > b->limit && !b->over_limit) *allowed = b->limit;
  return VP_OK;
}

/* Others' memory can help only when device free memory is what binds:
 * committed + want <= free + committed - headroom needs free >= want +
 * headroom, and the device and the limit must hold the result. */
bool vp__budget_free_bound(vp__device_t *dev, uint64_t want,
                           uint64_t *target) {
  const vp__budget_t *b = &dev->budget;
  uint64_t head = vp__budget_kept(dev), after = dev->committed + want;
  if (after > b->limit || after > b->total || head > b->total - after)
    return false;
  *target = want + head;
  return true;
}
