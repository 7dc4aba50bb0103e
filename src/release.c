/* Release requests between the processes of a ledger, and the walk that
 * frees memory across them in one order: least recently used VBAR first,
 * whichever process holds it, never one with pinned pages.
 *
 * A request is a slot in the segment (ledger.h): the requester claims a
 * free one, fills it (bytes, `before`), posts it and bumps the holder's
 * wake word; the holder's service thread, asleep on that word (it never
 * polls), takes it, evicts its own pages of VBARs last used no later than
 * `before` (through the pager, under its device lock, waiting for its own
 * fences), and answers what it freed on the request's word (both sleep in
 * vp__os_word_wait). The requester waits at most the ledger timeout, then
 * gives the request up (a holder still serving it frees the slot when
 * done) and skips that holder for a second. Nobody touches another process's memory.
 *
 * Locks: a requester holds no device lock while it waits (api.c and
 * stream.c call vp__release_ask after unlocking), so two processes asking
 * each other at once both get answers; between steps it takes its own
 * device lock only to re-measure free memory. The service thread takes its
 * device lock only to serve. Neither takes the membership lock, except to
 * reap a participant found dead. */
#include <stdlib.h>
#include <string.h>

#include "ledger.h"

#define ULL(x) ((unsigned long long)(x))

static ledger_part_t *own_part(vp__ledger_t *l) {
  return &l->seg->part[l->part];
}

/* ------------------------------------------------------------ serving */

/* VBARs a free-memory call must not evict (its keep list): handles of this
 * process, of any of its devices. */
typedef struct keep {
  const vp_vbar_t *vbar;
  size_t n;
} keep_t;

static bool kept(const keep_t *k, uint64_t id) {
  for (size_t i = 0; k && i < k->n; i++)
    if (k->vbar[i].id == id) return true;
  return false;
}

typedef struct victim {
  vp__vbar_t *vb;
  uint64_t last_use;
} victim_t;

static int victim_cmp(const void *a, const void *b) {
  const victim_t *x = a, *y = b;
  return x->last_use < y->last_use ? -1 : x->last_use > y->last_use;
}

/* Evict up to `bytes` from our VBARs last used no later than `before`
 * that have no pinned page, least recently used first (device lock held).
 * Eviction lowers their watermarks as pressure does. */
static uint64_t serve_evict(vp__device_t *dev, uint64_t bytes,
                            uint64_t before) {
  size_t n = 0, cap = 0;
  for (vp__vbar_t *vb = dev->top; vb; vb = vb->down) cap++;
  victim_t *v = cap ? malloc(cap * sizeof *v) : NULL;
  if (!v) return 0;
  for (vp__vbar_t *vb = dev->top; vb; vb = vb->down)
    if (!vb->pinned && vb->resident && vb->last_use <= before)
      v[n++] = (victim_t){vb, vb->last_use};
  qsort(v, n, sizeof *v, victim_cmp);
  uint64_t freed = 0;
  for (size_t i = 0; i < n && freed < bytes; i++)
    if (vp__vbar_evict(v[i].vb, bytes - freed, 0, &freed)) break;
  free(v);
  return freed;
}

static void serve_one(vp__ledger_t *l, ledger_req_t *r) {
  vp__device_t *dev = l->dev;
  uint64_t bytes = atomic_load(&r->bytes), before = atomic_load(&r->before);
  uint64_t freed = 0;
  vp__os_mutex_lock(&dev->lock);
  if (!dev->broken) freed = serve_evict(dev, bytes, before);
  vp__ledger_sync(dev);
  vp__unlock(dev, VP_OK);
  ledger_part_t *p = own_part(l);
  atomic_fetch_add(&p->served, 1);
  atomic_fetch_add(&p->released, freed);
  vp__lreq_answer(l->shm, l->seg, r, freed);
  vp__log(VP_LOG_DEBUG, dev->caps.name, "ledger: released %llu of %llu "
          "bytes asked", ULL(freed), ULL(bytes));
}

static void serve_all(vp__ledger_t *l) {
  for (int i = 0; i < LEDGER_REQS; i++) {
    ledger_req_t *r = &l->seg->req[i];
    uint32_t s = REQ_POSTED;
    if (atomic_load(&r->state) != REQ_POSTED ||
        atomic_load(&r->to) != (uint32_t)l->part ||
        atomic_load(&r->to_serial) != l->serial ||
        !atomic_compare_exchange_strong(&r->state, &s, REQ_TAKEN))
      continue;
    serve_one(l, r);
  }
}

/* Sleeps on its wake word: requests and the stop flag bump it. */
static void *service_main(void *arg) {
  vp__ledger_t *l = arg;
  _Atomic uint32_t *wake = &own_part(l)->wake;
  for (;;) {
    uint32_t seen = atomic_load(wake);
    if (atomic_load(&l->stop)) break;
    serve_all(l);
    vp__os_word_wait(l->shm, l->seg, wake, seen, VP__OS_FOREVER);
  }
  return NULL;
}

static void wake_part(vp__ledger_t *l, ledger_part_t *p) {
  atomic_fetch_add(&p->wake, 1);
  vp__os_word_wake(l->shm, l->seg, &p->wake);
}

/* The thread takes no signals: they are the application's. */
int vp__release_start(vp__device_t *dev) {
  vp__ledger_t *l = dev->ledger;
  if (!l) return VP_OK;
  if (vp__os_thread_start(&l->thread, service_main, l,
                          VP__OS_THREAD_NO_SIGNALS))
    return VP_ENOMEM;
  l->thread_started = true;
  return VP_OK;
}

void vp__release_stop(vp__device_t *dev) {
  vp__ledger_t *l = dev->ledger;
  if (!l || !l->thread_started || l->pid != vp__os_pid()) return;
  atomic_store(&l->stop, true);
  wake_part(l, own_part(l));
  vp__os_thread_join(&l->thread);
  l->thread_started = false;
}

/* ------------------------------------------------------------- asking */

/* Device free memory now (the device lock taken briefly), published for
 * everyone; false when the device cannot say. */
static bool measure(vp__device_t *dev, uint64_t *free_bytes) {
  uint64_t allowed;
  vp__os_mutex_lock(&dev->lock);
  vp__budget_invalidate(dev);
  bool ok = !dev->broken && vp__budget_allowed(dev, &allowed) == VP_OK;
  *free_bytes = dev->budget.free_at_poll;
  if (ok) vp__ledger_put_memory(dev->ledger, *free_bytes, dev->budget.total);
  vp__unlock(dev, VP_OK);
  return ok;
}

static bool skipped(vp__ledger_t *l, uint32_t part, uint64_t serial) {
  vp__os_mutex_lock(&l->skip_mu);
  bool skip = l->skip[part].serial == serial &&
              vp__os_now_ns() < l->skip[part].until;
  vp__os_mutex_unlock(&l->skip_mu);
  return skip;
}

static void skip_for_a_while(vp__ledger_t *l, uint32_t part,
                             uint64_t serial) {
  vp__os_mutex_lock(&l->skip_mu);
  l->skip[part].serial = serial;
  l->skip[part].until = vp__os_now_ns() + LEDGER_SKIP_NS;
  vp__os_mutex_unlock(&l->skip_mu);
}

/* A VBAR some participant might release. */
typedef struct cand {
  uint32_t part;
  uint64_t serial, id, last_use;
} cand_t;

static int cand_cmp(const void *a, const void *b) {
  const cand_t *x = a, *y = b;
  if (x->last_use != y->last_use) return x->last_use < y->last_use ? -1 : 1;
  return x->part < y->part ? -1 : x->part > y->part;
}

static bool cand_add(cand_t **c, size_t *n, size_t *cap, cand_t v) {
  if (*n == *cap) {
    size_t ncap = *cap ? *cap * 2 : 32;
    cand_t *g = realloc(*c, ncap * sizeof *g);
    if (!g) return false;
    *c = g;
    *cap = ncap;
  }
  (*c)[(*n)++] = v;
  return true;
}

/* One participant's entries that may go: no pinned page, something to
 * reclaim, last used no later than `before`. */
static void collect_part(vp__ledger_t *l, uint32_t i, uint64_t before,
                         const keep_t *keep, cand_t **c, size_t *n,
                         size_t *cap) {
  ledger_part_t *p = &l->seg->part[i];
  uint64_t serial = atomic_load(&p->serial);
  if (keep && !vp__lpart_ours(p, (int32_t)l->pid)) keep = NULL;
  for (int v = 0; v < LEDGER_VBARS; v++) {
    ledger_vbar_view_t e;
    if (!vp__lvbar_read(&p->vbar[v], &e) || e.pinned || !e.reclaimable ||
        e.last_use > before || kept(keep, e.id))
      continue;
    if (!cand_add(c, n, cap, (cand_t){i, serial, e.id, e.last_use})) return;
  }
}

/* Every candidate VBAR of the live participants (ours only when `self`),
 * least recently used first. Participants found dead are reaped. */
static size_t collect(vp__ledger_t *l, uint64_t before, bool self,
                      const keep_t *keep, cand_t **out) {
  size_t n = 0, cap = 0;
  bool dead = false;
  *out = NULL;
  for (uint32_t i = 0; i < LEDGER_PARTS; i++) {
    ledger_part_t *p = &l->seg->part[i];
    if (atomic_load(&p->state) != PART_LIVE) continue;
    bool me = i == (uint32_t)l->part;
    if (me ? !self : skipped(l, i, atomic_load(&p->serial))) continue;
    size_t first = n;
    collect_part(l, i, before, keep, out, &n, &cap);
    if (n > first && !me && !vp__lpart_alive(p)) n = first, dead = true;
  }
  if (dead && vp__lseg_lock(l) == VP_OK) {
    vp__lseg_reap(l->seg);
    vp__lseg_unlock(l);
  }
  if (n) qsort(*out, n, sizeof **out, cand_cmp);
  return n;
}

static ledger_req_t *post(vp__ledger_t *l, const cand_t *c, uint64_t bytes) {
  for (int i = 0; i < LEDGER_REQS; i++) {
    ledger_req_t *r = &l->seg->req[i];
    uint32_t s = REQ_FREE;
    if (!atomic_compare_exchange_strong(&r->state, &s, REQ_CLAIMED)) continue;
    atomic_store(&r->from, (uint32_t)l->part);
    atomic_store(&r->from_serial, l->serial);
    atomic_store(&r->to, c->part);
    atomic_store(&r->to_serial, c->serial);
    atomic_store(&r->bytes, bytes);
    atomic_store(&r->before, c->last_use);
    atomic_store(&r->freed, 0);
    atomic_store(&r->posted, vp__os_coarse_ns());
    atomic_store(&r->state, REQ_POSTED);
    wake_part(l, &l->seg->part[c->part]);
    return r;
  }
  return NULL;
}

/* Take the answer of a DONE request and free its slot. */
static bool answer(ledger_req_t *r, uint64_t *freed) {
  *freed = atomic_load(&r->freed);
  atomic_store(&r->state, REQ_FREE);
  return true;
}

/* Wait for the answer at most the timeout; then give the request up (a
 * holder still serving it frees the slot itself). */
#define AWAIT_SLICE_NS 10000000ull /* how often the holder is looked at */
/* A holder that took the request is alive and evicting: it gets this much
 * more per GiB asked (on the H200, evicting 2 MiB pages took ~23 ms/GiB:
 * a 50 ms timeout skipped every holder asked for more than 2 GiB). */
#define TAKEN_NS_PER_GIB 40000000ull

/* No more than it published as reclaimable, at most 64 GiB (2.6 s). */
static uint64_t taken_extra(vp__ledger_t *l, ledger_req_t *r,
                            const cand_t *c) {
  uint64_t bytes = atomic_load(&r->bytes);
  uint64_t has = atomic_load(&l->seg->part[c->part].reclaimable);
  if (bytes > has) bytes = has;
  if (bytes > (64ull << 30)) bytes = 64ull << 30;
  return (bytes >> 20) * (TAKEN_NS_PER_GIB >> 10);
}

static bool await(vp__ledger_t *l, ledger_req_t *r, const cand_t *c,
                  uint64_t *freed, bool *left_us) {
  uint64_t deadline = vp__os_now_ns() + l->timeout_ns;
  bool extended = false;
  for (;;) {
    uint32_t s = atomic_load(&r->state);
    if (s == REQ_DONE) return answer(r, freed);
    if (s == REQ_TAKEN && !extended) {
      extended = true;
      deadline += taken_extra(l, r, c);
    }
    uint64_t now = vp__os_now_ns();
    if (now >= deadline || (s != REQ_POSTED && s != REQ_TAKEN)) break;
    if (!vp__lslot_live(l->seg, c->part, c->serial) ||
        (extended && !vp__lpart_alive(&l->seg->part[c->part]))) {
      *left_us = true; /* it left (or was reaped) meanwhile: no answer */
      break;
    }
    uint64_t left = deadline - now;
    if (left > AWAIT_SLICE_NS) left = AWAIT_SLICE_NS;
    vp__os_word_wait(l->shm, l->seg, &r->state, s, left);
  }
  uint32_t s = REQ_POSTED;
  if (atomic_compare_exchange_strong(&r->state, &s, REQ_FREE)) return false;
  if (s == REQ_TAKEN &&
      atomic_compare_exchange_strong(&r->state, &s, REQ_ABANDONED))
    return false;
  return s == REQ_DONE ? answer(r, freed) : false;
}

static bool ask_peer(vp__ledger_t *l, const cand_t *c, uint64_t bytes,
                     uint64_t *got) {
  if (skipped(l, c->part, c->serial)) return false;
  ledger_req_t *r = post(l, c, bytes);
  if (!r) {
    vp__log(VP_LOG_DEBUG, "ledger", "every request slot is in use");
    return false;
  }
  bool gone = false;
  if (await(l, r, c, got, &gone)) return true;
  if (gone) return false;
  skip_for_a_while(l, c->part, c->serial);
  vp__log(VP_LOG_WARN, l->dev->caps.name, "ledger %s: participant %u (pid "
          "%d) did not answer a release request within %llu us; skipping "
          "it for a second", l->name, c->part,
          (int)atomic_load(&l->seg->part[c->part].pid),
          ULL(l->timeout_ns / 1000));
  return false;
}

/* One of our own VBARs, in the cross-process order. */
static uint64_t evict_own(vp__device_t *dev, uint64_t id, uint64_t bytes) {
  uint64_t freed = 0;
  vp__os_mutex_lock(&dev->lock);
  vp__vbar_t *vb = vp__table_get(&dev->vbars, id);
  if (vb && vb->listed && !vb->pinned && !dev->broken)
    vp__vbar_evict(vb, bytes, 0, &freed);
  vp__ledger_sync(dev);
  vp__unlock(dev, VP_OK);
  return freed;
}

/* Least recently used first until device free memory reaches `target`,
 * freeing at most what it lacked at the start; re-measures after every
 * step and asks each holder only for what is still missing. Returns the
 * bytes freed. */
static uint64_t walk(vp__ledger_t *l, uint64_t target, uint64_t before,
                     bool self, const keep_t *keep) {
  vp__device_t *dev = l->dev;
  cand_t *c = NULL;
  uint64_t free_now = 0, freed = 0;
  size_t n = collect(l, before, self, keep, &c);
  bool ok = n && measure(dev, &free_now);
  uint64_t cap = ok && free_now < target ? target - free_now : 0;
  for (size_t i = 0; ok && i < n && free_now < target && freed < cap; i++) {
    uint64_t want = target - free_now, got = 0;
    if (want > cap - freed) want = cap - freed;
    if (c[i].part == (uint32_t)l->part) got = evict_own(dev, c[i].id, want);
    else if (!ask_peer(l, &c[i], want, &got)) continue;
    freed += got;
    ok = measure(dev, &free_now);
  }
  free(c);
  return freed;
}

/* The last use of our VBARs below the faulting one that could give pages:
 * other processes' VBARs older than that go first. */
static uint64_t own_oldest(vp__device_t *dev, uint64_t vbar, uint64_t now) {
  uint64_t oldest = now;
  vp__os_mutex_lock(&dev->lock);
  vp__vbar_t *vb = vp__table_get(&dev->vbars, vbar);
  for (vp__vbar_t *w = vb && vb->listed ? vb->down : NULL; w; w = w->down)
    if (w->resident > w->pinned && w->last_use < oldest) oldest = w->last_use;
  vp__unlock(dev, VP_OK);
  return oldest;
}

/* Whether another live participant publishes anything reclaimable: a
 * fault asks nobody, and drops no lock, when none does. Reads only the
 * segment (any locks may be held). */
bool vp__release_may_help(vp__device_t *dev) {
  vp__ledger_t *l = dev->ledger;
  for (int i = 0; l && i < LEDGER_PARTS; i++) {
    const ledger_part_t *p = &l->seg->part[i];
    if (i != l->part && atomic_load(&p->state) == PART_LIVE &&
        atomic_load_explicit(&p->reclaimable, memory_order_relaxed))
      return true;
  }
  return false;
}

/* Two steps: others' VBARs older than our own candidates, enough for the
 * whole shortfall; then, if our own pages still could not cover the rest,
 * any of theirs not in use, for the part ours cannot. */
void vp__release_ask(vp__device_t *dev, const vp__ask_t *ask) {
  vp__ledger_t *l = dev->ledger;
  if (!l || !ask->pending || !vp__release_may_help(dev)) return;
  uint64_t now = vp__os_coarse_ns(), before = own_oldest(dev, ask->vbar, now);
  uint64_t freed = walk(l, ask->target, before, false, NULL);
  if (before < now && ask->own < ask->target)
    freed += walk(l, ask->target - ask->own, now, false, NULL);
  vp__log(VP_LOG_DEBUG, dev->caps.name, "ledger: other processes released "
          "%llu bytes toward %llu free", ULL(freed), ULL(ask->target));
}

/* Without a ledger: our own VBARs, lowest priority first (no last-use
 * stamps without one), the keep list's left alone. */
static int free_alone(vp__device_t *dev, uint64_t bytes, const keep_t *keep,
                      uint64_t *done) {
  if (!keep->n) return vp__device_evict(dev, bytes, done);
  int rc = VP_OK;
  for (vp__vbar_t *vb = dev->bottom; vb && *done < bytes && !rc; vb = vb->up)
    if (vb->resident > vb->pinned && !kept(keep, vb->id))
      rc = vp__vbar_evict(vb, bytes - *done, 0, done);
  return rc;
}

/* Both public calls, after VP__ENTER (so messages name the one called). */
static int free_memory(vp_device_t h, uint64_t bytes, const vp_vbar_t *keep,
                       size_t nkeep, uint64_t *freed) {
  vp__device_t *dev = NULL;
  uint64_t done = 0, start = 0;
  keep_t k = {keep, nkeep};
  int rc = vp__dev_enter(h, &dev);
  if (rc) return rc;
  if (freed) *freed = 0;
  if (!dev->ledger) {
    rc = free_alone(dev, bytes, &k, &done);
    if (freed) *freed = done;
    return vp__unlock(dev, rc);
  }
  vp__ledger_sync(dev);
  vp__unlock(dev, VP_OK);
  if (!measure(dev, &start)) return vp__broken(dev);
  uint64_t target = start > UINT64_MAX - bytes ? UINT64_MAX : start + bytes;
  done = walk(dev->ledger, target, vp__os_coarse_ns(), true, &k);
  if (done < bytes)
    vp__log(VP_LOG_INFO, dev->caps.name, "ledger: freed %llu of the %llu "
            "bytes asked; nothing else is reclaimable now", ULL(done),
            ULL(bytes));
  if (freed) *freed = done;
  return VP_OK;
}

int vp_ledger_free_memory_keep(vp_device_t h, uint64_t bytes,
                               const vp_vbar_t *keep, size_t nkeep,
                               uint64_t *freed) {
  VP__ENTER();
  VP__NEED(keep || nkeep == 0, "keep is NULL");
  return free_memory(h, bytes, keep, nkeep, freed);
}

int vp_ledger_free_memory(vp_device_t h, uint64_t bytes, uint64_t *freed) {
  VP__ENTER();
  return free_memory(h, bytes, NULL, 0, freed);
}
