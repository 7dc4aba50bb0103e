/* One pinned-host budget for the machine: the host bytes vpager page-locks,
 * across every vpager process and GPU on the host, stay under one budget,
 * counted in a host-wide shared-memory segment (/dev/shm/vpager-pins-v2-<name>:
 * "host" on CUDA, the simulated device's shared name on a shared simulated
 * device, the ledger option's name when one is given; none when the ledger
 * is "off" or the simulated device is not shared: then the device counts
 * alone against its own budget, as hostmem.c did before).
 *
 * The segment's layout is in pins.h.
 *
 * Counting, without the lock (a take runs under the device lock: no
 * cross-process wait may sit there): a participant first publishes the
 * bytes it is taking, then sums every live participant's pinned and taking
 * bytes, and counts them pinned only if that sum is within the budget. Of
 * two takers at once at least one sees both, so what is pinned never
 * passes the budget, not even for a moment (both may back off: pageable,
 * tried again later). A process that died holding pins is left out of the
 * sum (and reaped at the next join or leave, under the lock); bytes go
 * back without the lock too (a count only falls).
 *
 * Asking: a participant short of budget posts a request to each other live
 * participant that publishes something to give back (the pinned chunks of
 * its host buffers, which stay usable pageable) and waits at most its
 * timeout for each; the holder's service thread, asleep on its wake word,
 * unpins through the callback hostmem.c gave (pins_give_t) and answers.
 * As in release.c the requester holds no device lock while it waits. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pins.h"
#include "shm.h"

#define ULL(x) ((unsigned long long)(x))
#define RELAXED memory_order_relaxed
#define GiB (1ull << 30)
#define PINS_LOCK_MS 1000 /* the lock is held for microseconds */
#define PINS_NS_PER_GIB 60000000ull /* unpinning: ~19 ms/GiB, and a sync */
#define PINS_SKIP_NS 1000000000ull  /* a peer that did not answer: skipped */

struct vp__pins {
  pins_seg_t *seg;
  vp__device_t *dev;
  vp__pins_give_t give;
  int part;
  uint64_t serial;
  int32_t pid; /* the process that joined; a forked child is not it */
  char shm[112];
  vp__os_plock_t lock; /* our handle to seg->lock */
  uint64_t timeout_ns;
  vp__os_thread_t thread;
  bool thread_started;
  atomic_bool stop;
  /* A silent peer costs one timeout, then it is not asked for a second. */
  _Atomic uint64_t skip_serial[PINS_PARTS], skip_until[PINS_PARTS];
};

/* ------------------------------------------------------ default budget */

/* Half of the memory we may use: RAM (MemTotal), or our cgroup's limit
 * when lower (page-locked pages are charged to it, and the OOM killer acts
 * at it). Why half: pinned pages cannot be reclaimed, and the rest is what
 * keeps a model's file in the page cache, torch's own host tensors and the
 * desktop alive; the peer's users report OOM kills with pinning allowed
 * to 90% of RAM (FACTS.md), and 50% still pins a 22 GiB model whole on a
 * 64 GiB desktop (16 GiB of one on 32 GiB: the rest streams pageable).
 * MemAvailable is not used: it is what happens to be free when the first
 * process starts, and the budget outlives that moment; it is logged. */
uint64_t vp__pins_default_budget(void) {
  uint64_t ram = vp__os_ram_total(); /* 0, unknown: pin nothing */
  uint64_t cg = vp__os_memory_limit();
  return (cg && cg < ram ? cg : ram) / 2;
}

/* ------------------------------------------------------------ the lock */

static void part_clear(pins_part_t *p) {
  atomic_store(&p->pinned, 0);
  atomic_store(&p->taking, 0);
  atomic_store(&p->releasable, 0);
  atomic_store(&p->serial, 0);
  atomic_store(&p->pid, 0);
  atomic_store(&p->state, PART_FREE);
}

static bool part_alive(const pins_part_t *p) {
  return vp__os_proc_alive(atomic_load(&p->pid), atomic_load(&p->start),
                           atomic_load(&p->pidns));
}

static bool slot_live(const pins_seg_t *seg, uint32_t slot, uint64_t serial) {
  return slot < PINS_PARTS &&
         atomic_load(&seg->part[slot].state) == PART_LIVE &&
         atomic_load(&seg->part[slot].serial) == serial;
}

/* Live participants' counts; the dead are cleared, and requests whose
 * requester is gone freed (lock held). */
static void reap(pins_seg_t *seg) {
  for (int i = 0; i < PINS_PARTS; i++) {
    pins_part_t *p = &seg->part[i];
    if (atomic_load(&p->state) != PART_LIVE || part_alive(p)) continue;
    vp__log(VP_LOG_INFO, "pins", "reaped participant %d (pid %d): its "
            "process is gone, its %llu pinned bytes with it", i,
            (int)atomic_load(&p->pid), ULL(atomic_load(&p->pinned)));
    part_clear(p);
  }
  for (int i = 0; i < PINS_REQS; i++) {
    ledger_req_t *r = &seg->req[i];
    uint32_t s = atomic_load(&r->state);
    if (s == REQ_FREE) continue;
    bool from = slot_live(seg, atomic_load(&r->from),
                          atomic_load(&r->from_serial));
    bool to = slot_live(seg, atomic_load(&r->to), atomic_load(&r->to_serial));
    if (!from && s == REQ_TAKEN && to)
      atomic_compare_exchange_strong(&r->state, &s, REQ_ABANDONED);
    else if (!from || (!to && s == REQ_ABANDONED))
      atomic_compare_exchange_strong(&r->state, &s, REQ_FREE);
  }
}

/* Bounded: VP_EAGAIN after PINS_LOCK_MS, VP_EDEVICE for a lock word of
 * another kind. A holder that died: its participant is reaped. */
static int seg_lock(vp__pins_t *pn) {
  bool dead;
  int r = vp__shm_lock(&pn->lock, PINS_LOCK_MS, 0, NULL, &dead);
  if (dead) reap(pn->seg);
  return r == VP_EINVAL ? VP_EDEVICE : r;
}

static void seg_unlock(vp__pins_t *pn) { vp__shm_unlock(&pn->lock, NULL); }

/* ----------------------------------------------------------- mapping */

static void seg_init(void *p, const char *shm, const void *arg) {
  pins_seg_t *seg = p;
  (void)shm;
  atomic_store(&seg->version, PINS_VERSION);
  atomic_store(&seg->size, sizeof(pins_seg_t));
  atomic_store(&seg->budget, *(const uint64_t *)arg);
}

static int check_header(void *p, const char *shm, char *why, size_t len) {
  pins_seg_t *seg = p;
  if (atomic_load_explicit(&seg->magic, memory_order_acquire) == PINS_MAGIC &&
      atomic_load(&seg->version) == PINS_VERSION &&
      atomic_load(&seg->size) == sizeof(pins_seg_t))
    return VP_OK;
  snprintf(why, len, "%s is not a vpager pin ledger of this layout", shm);
  return VP_EUNSUPPORTED;
}

static const vp__shm_kind_t seg_kind = {
    sizeof(pins_seg_t), offsetof(pins_seg_t, lock), PINS_MAGIC, seg_init,
    check_header};

/* ----------------------------------------------------------- joining */

static int join_locked(vp__pins_t *pn) {
  pins_seg_t *seg = pn->seg;
  if (atomic_load(&seg->unlinked)) return VP_EAGAIN;
  reap(seg);
  for (int i = 0; i < PINS_PARTS; i++) {
    pins_part_t *p = &seg->part[i];
    if (atomic_load(&p->state) != PART_FREE) continue;
    uint64_t start, pidns;
    vp__os_proc_self(&start, &pidns);
    part_clear(p);
    pn->serial = atomic_fetch_add(&seg->serials, 1) + 1;
    atomic_store(&p->pid, vp__os_pid());
    atomic_store(&p->uid, vp__os_uid());
    atomic_store(&p->start, start);
    atomic_store(&p->pidns, pidns);
    atomic_store(&p->serial, pn->serial);
    atomic_store(&p->served, 0);
    atomic_store(&p->released, 0);
    atomic_store(&p->state, PART_LIVE);
    pn->part = i;
    return VP_OK;
  }
  return VP_ELIMIT;
}

static int join(vp__pins_t *pn, uint64_t budget, char *why, size_t len) {
  for (int tries = 0; tries < 20; tries++) {
    void *p = NULL;
    int rc = vp__shm_attach(pn->shm, &seg_kind, &budget, &p, why, len);
    if (rc) return rc;
    pn->seg = p;
    int e = vp__os_plock_open(&pn->lock, pn->shm, &pn->seg->lock);
    rc = e ? VP_EDEVICE : seg_lock(pn);
    if (rc == VP_OK) {
      rc = join_locked(pn);
      seg_unlock(pn);
      if (rc == VP_ELIMIT)
        snprintf(why, len, "all %d participant slots of %s are taken",
                 PINS_PARTS, pn->shm);
    } else { /* a stopped holder, or a hostile lock word: alone, at once */
      snprintf(why, len, "the lock of %s %s", pn->shm, rc == VP_EAGAIN ?
               "stayed taken" : "cannot be used (a corrupt segment?)");
      rc = VP_EUNSUPPORTED;
    }
    if (rc == VP_OK) return VP_OK;
    if (!e) vp__os_plock_close(&pn->lock);
    vp__shm_unmap(pn->seg, &seg_kind);
    pn->seg = NULL;
    if (rc != VP_EAGAIN) return VP_EUNSUPPORTED;
  }
  snprintf(why, len, "%s kept appearing and vanishing", pn->shm);
  return VP_EUNSUPPORTED;
}

/* The segment's name: the ledger option's, else "host" on a GPU (one
 * budget spans every GPU) and the shared simulated device's name. */
static bool pins_name(vp__device_t *dev, char *out, size_t len) {
  const char *opt = dev->opts.ledger;
  char key[80];
  if (strcmp(opt, "off") == 0) return false;
  if (opt[0]) return snprintf(out, len, PINS_PREFIX "%s", opt), true;
  if (vp__be_ledger_key(dev, key, sizeof key) != VP_OK) return false;
  snprintf(out, len, PINS_PREFIX "%s",
           strncmp(key, "sim-", 4) == 0 ? key : "host");
  return true;
}

static ledger_req_t *next_request(vp__pins_t *pn) {
  for (int i = 0; i < PINS_REQS; i++) {
    ledger_req_t *r = &pn->seg->req[i];
    uint32_t s = REQ_POSTED;
    if (atomic_load(&r->state) == REQ_POSTED &&
        atomic_load(&r->to) == (uint32_t)pn->part &&
        atomic_load(&r->to_serial) == pn->serial &&
        atomic_compare_exchange_strong(&r->state, &s, REQ_TAKEN))
      return r;
  }
  return NULL;
}

/* Sleeps on its wake word; gives back what is asked of it, as it can. */
static void *service_main(void *arg) {
  vp__pins_t *pn = arg;
  pins_part_t *me = &pn->seg->part[pn->part];
  for (;;) {
    uint32_t seen = atomic_load(&me->wake);
    if (atomic_load(&pn->stop)) break;
    for (ledger_req_t *r; (r = next_request(pn));) {
      uint64_t bytes = atomic_load(&r->bytes);
      uint64_t freed = pn->give(pn->dev, bytes);
      atomic_fetch_add(&me->served, 1);
      atomic_fetch_add(&me->released, freed);
      vp__lreq_answer(pn->shm, pn->seg, r, freed);
      vp__log(VP_LOG_DEBUG, pn->dev->caps.name, "pins: gave back %llu of "
              "%llu pinned bytes asked", ULL(freed), ULL(bytes));
    }
    vp__os_word_wait(pn->shm, pn->seg, &me->wake, seen, VP__OS_FOREVER);
  }
  return NULL;
}

static void wake_part(vp__pins_t *pn, pins_part_t *p) {
  atomic_fetch_add(&p->wake, 1);
  vp__os_word_wake(pn->shm, pn->seg, &p->wake);
}

/* Give our slot back; requests posted to us answered "nothing"; the last
 * one out removes the name. */
static void leave(vp__pins_t *pn) {
  pins_seg_t *seg = pn->seg;
  bool locked = seg_lock(pn) == VP_OK;
  pins_part_t *me = &seg->part[pn->part];
  if (atomic_load(&me->serial) == pn->serial) part_clear(me);
  for (int i = 0; i < PINS_REQS; i++) {
    ledger_req_t *r = &seg->req[i];
    uint32_t s = REQ_POSTED;
    if (atomic_load(&r->to) == (uint32_t)pn->part &&
        atomic_load(&r->to_serial) == pn->serial &&
        atomic_compare_exchange_strong(&r->state, &s, REQ_TAKEN))
      vp__lreq_answer(pn->shm, seg, r, 0);
  }
  if (!locked) return;
  reap(seg);
  bool live = false;
  for (int i = 0; i < PINS_PARTS && !live; i++)
    live = atomic_load(&seg->part[i].state) == PART_LIVE;
  if (!live) {
    atomic_store(&seg->unlinked, 1);
    vp__shm_remove(pn->shm);
  }
  seg_unlock(pn);
}

void vp__pins_open(vp__device_t *dev, vp__pins_give_t give) {
  char why[192] = "no memory for the pin ledger";
  vp__pins_t *pn = calloc(1, sizeof *pn);
  if (pn && !pins_name(dev, pn->shm, sizeof pn->shm)) {
    free(pn);
    return;
  }
  int rc = pn ? VP_OK : VP_ENOMEM;
  uint64_t budget = dev->pin_budget;
  if (rc == VP_OK) {
    pn->dev = dev;
    pn->give = give;
    pn->pid = vp__os_pid();
    uint32_t us = dev->opts.ledger_timeout_us;
    pn->timeout_ns = (uint64_t)(us ? us : LEDGER_TIMEOUT_US) * 1000;
    rc = join(pn, budget, why, sizeof why);
  }
  if (rc == VP_OK) {
    /* An explicit budget is the machine's from now on (the last one set
     * wins); the default keeps what the segment holds. */
    if (dev->opts.pin_budget) atomic_store(&pn->seg->budget, budget);
    dev->pins = pn; /* before the thread: it reads it under the lock */
    int e = vp__os_thread_start(&pn->thread, service_main, pn,
                                VP__OS_THREAD_NO_SIGNALS);
    pn->thread_started = e == 0;
    if (e) {
      dev->pins = NULL;
      leave(pn);
      vp__os_plock_close(&pn->lock);
      vp__shm_unmap(pn->seg, &seg_kind);
      snprintf(why, sizeof why, "its service thread could not start");
      rc = VP_ENOMEM;
    }
  }
  if (rc) {
    vp__log(VP_LOG_WARN, dev->caps.name, "not joining the pin ledger %s: "
            "%s; this device counts its pinned memory alone",
            pn ? pn->shm : "", why);
    free(pn);
    return;
  }
  vp__log(VP_LOG_INFO, dev->caps.name, "joined pin ledger %s as "
          "participant %d: the machine's pin budget is %s (%s available "
          "now)", pn->shm, pn->part,
          vp__size(atomic_load(&pn->seg->budget)).s,
          vp__size(vp__os_ram_available()).s);
}

/* A forked child's copy only unmaps. */
void vp__pins_close(vp__device_t *dev) {
  vp__pins_t *pn = dev->pins;
  if (!pn) return;
  dev->pins = NULL;
  if (pn->pid == vp__os_pid()) {
    if (pn->thread_started) {
      atomic_store(&pn->stop, true);
      wake_part(pn, &pn->seg->part[pn->part]);
      vp__os_thread_join(&pn->thread);
    }
    leave(pn);
  }
  vp__os_plock_close(&pn->lock);
  vp__shm_unmap(pn->seg, &seg_kind);
  free(pn);
}

/* --------------------------------------------------------- counting */

uint64_t vp__pins_budget(const vp__device_t *dev) {
  return dev->pins ? atomic_load(&dev->pins->seg->budget) : dev->pin_budget;
}

void vp__pins_set_budget(vp__device_t *dev, uint64_t bytes) {
  dev->pin_budget = bytes;
  if (dev->pins) atomic_store(&dev->pins->seg->budget, bytes);
}

/* a + b, at most UINT64_MAX (a corrupt count must not wrap to room). */
static uint64_t add_sat(uint64_t a, uint64_t b) {
  return a + b < a ? UINT64_MAX : a + b;
}

/* The live participants' pinned bytes (lock-free), and with `taking` the
 * bytes their takes hold; those of processes that died are left out, not
 * reaped, when `alive` (a look at each one's process: dearer, so a take
 * looks only when the plain sum is over). */
static uint64_t live_sum(const vp__pins_t *pn, bool alive, bool taking) {
  uint64_t sum = 0;
  for (int i = 0; i < PINS_PARTS; i++) {
    const pins_part_t *p = &pn->seg->part[i];
    if (atomic_load(&p->state) != PART_LIVE ||
        (alive && i != pn->part && !part_alive(p)))
      continue;
    /* taking before pinned: a take moves its bytes from one to the other
     * in the other order (pinned += size, then taking -= size), so one
     * that moves between these loads is seen in one of them (seq_cst);
     * read the other way round a take could be in neither, and two
     * concurrent takes each miss the other's bytes. */
    uint64_t t = taking ? atomic_load(&p->taking) : 0;
    sum = add_sat(add_sat(sum, atomic_load(&p->pinned)), t);
  }
  return sum;
}

uint64_t vp__pins_machine(const vp__device_t *dev) {
  return dev->pins ? live_sum(dev->pins, true, false) : dev->pinned_host;
}

/* A forked child's copy of a device is not the participant: it pins
 * nothing more and gives nothing back in the parent's name. */
static bool ours(const vp__pins_t *pn) {
  return pn && pn->pid == vp__os_pid();
}

bool vp__pins_take(vp__device_t *dev, uint64_t size, uint64_t *budget,
                   uint64_t *used) {
  vp__pins_t *pn = dev->pins;
  *budget = atomic_load(&pn->seg->budget);
  *used = UINT64_MAX; /* unknown: a forked child's copy counts nothing */
  if (!ours(pn)) return false;
  pins_part_t *mine = &pn->seg->part[pn->part];
  atomic_fetch_add(&mine->taking, size);
  uint64_t sum = live_sum(pn, false, true);
  *budget = atomic_load(&pn->seg->budget);
  if (sum > *budget) sum = live_sum(pn, true, true);
  bool ok = sum <= *budget;
  if (ok) atomic_fetch_add(&mine->pinned, size); /* before taking falls */
  atomic_fetch_sub(&mine->taking, size);
  *used = sum - size; /* what the others and we held before this take */
  return ok;
}

void vp__pins_put(vp__device_t *dev, uint64_t size) {
  if (ours(dev->pins))
    atomic_fetch_sub(&dev->pins->seg->part[dev->pins->part].pinned, size);
}

void vp__pins_releasable(vp__device_t *dev, int64_t delta) {
  if (ours(dev->pins))
    atomic_fetch_add(&dev->pins->seg->part[dev->pins->part].releasable,
                     (uint64_t)delta);
}

/* ----------------------------------------------------------- asking */

/* Wait for the answer at most the timeout (more once taken, by what was
 * asked); then give the request up, as release.c's await does. */
static uint64_t await(vp__pins_t *pn, ledger_req_t *r, uint32_t to,
                      uint64_t serial, uint64_t bytes, bool *answered) {
  uint64_t deadline = vp__os_now_ns() + pn->timeout_ns;
  bool extended = false;
  for (;;) {
    uint32_t s = atomic_load(&r->state);
    if (s == REQ_DONE) break;
    if (s == REQ_TAKEN && !extended) {
      extended = true;
      uint64_t gib = bytes / GiB + 1;
      deadline += (gib > 64 ? 64 : gib) * PINS_NS_PER_GIB;
    }
    uint64_t now = vp__os_now_ns();
    if (now >= deadline || (s != REQ_POSTED && s != REQ_TAKEN) ||
        !slot_live(pn->seg, to, serial))
      break;
    uint64_t left = deadline - now;
    if (left > 10000000ull) left = 10000000ull;
    vp__os_word_wait(pn->shm, pn->seg, &r->state, s, left);
  }
  uint32_t s = REQ_POSTED;
  if (atomic_compare_exchange_strong(&r->state, &s, REQ_FREE)) return 0;
  if (s == REQ_TAKEN &&
      atomic_compare_exchange_strong(&r->state, &s, REQ_ABANDONED))
    return 0;
  if (s != REQ_DONE) return 0;
  uint64_t freed = atomic_load(&r->freed);
  atomic_store(&r->state, REQ_FREE);
  *answered = true;
  return freed;
}

static uint64_t ask_one(vp__pins_t *pn, uint32_t to, uint64_t bytes) {
  pins_seg_t *seg = pn->seg;
  pins_part_t *p = &seg->part[to];
  uint64_t serial = atomic_load(&p->serial);
  for (int i = 0; i < PINS_REQS; i++) {
    ledger_req_t *r = &seg->req[i];
    uint32_t s = REQ_FREE;
    if (!atomic_compare_exchange_strong(&r->state, &s, REQ_CLAIMED)) continue;
    atomic_store(&r->from, (uint32_t)pn->part);
    atomic_store(&r->from_serial, pn->serial);
    atomic_store(&r->to, to);
    atomic_store(&r->to_serial, serial);
    atomic_store(&r->bytes, bytes);
    atomic_store(&r->before, 0);
    atomic_store(&r->freed, 0);
    atomic_store(&r->posted, vp__os_coarse_ns());
    atomic_store(&r->state, REQ_POSTED);
    wake_part(pn, p);
    bool answered = false;
    uint64_t freed = await(pn, r, to, serial, bytes, &answered);
    if (!answered && slot_live(seg, to, serial)) {
      atomic_store(&pn->skip_serial[to], serial);
      atomic_store(&pn->skip_until[to], vp__os_now_ns() + PINS_SKIP_NS);
      vp__log(VP_LOG_WARN, pn->dev->caps.name, "pin ledger %s: participant "
              "%u (pid %d) did not answer within %llu us; skipping it for "
              "a second", pn->shm, to, (int)atomic_load(&p->pid),
              ULL(pn->timeout_ns / 1000));
    }
    return freed;
  }
  /* Every request slot is in use: some may be requests of processes that
   * died, which only a join, a leave or the lock's dead holder reaps;
   * reap them now (the lock, bounded): the next ask finds them free. */
  if (seg_lock(pn) == VP_OK) {
    reap(seg);
    seg_unlock(pn);
  }
  return 0;
}

bool vp__pins_may_help(const vp__device_t *dev) {
  const vp__pins_t *pn = dev->pins;
  for (int i = 0; pn && i < PINS_PARTS; i++) {
    const pins_part_t *p = &pn->seg->part[i];
    if (i != pn->part && atomic_load(&p->state) == PART_LIVE &&
        atomic_load(&p->releasable))
      return true;
  }
  return false;
}

/* The others, largest giver first, until `size` more bytes fit the budget
 * (no device lock held). Returns what they gave back. */
uint64_t vp__pins_ask(vp__device_t *dev, uint64_t size) {
  vp__pins_t *pn = dev->pins;
  if (!ours(pn)) return 0;
  pins_seg_t *seg = pn->seg;
  bool asked[PINS_PARTS] = {false};
  uint64_t got = 0;
  for (;;) {
    uint64_t used = vp__pins_machine(dev), budget = atomic_load(&seg->budget);
    if (size > budget) return got; /* no release makes it fit */
    if (used <= budget - size) return got;
    uint64_t want = used - (budget - size);
    int best = -1;
    uint64_t most = 0;
    for (int i = 0; i < PINS_PARTS; i++) {
      pins_part_t *p = &seg->part[i];
      uint64_t has = atomic_load(&p->releasable);
      if (i == pn->part || asked[i] || atomic_load(&p->state) != PART_LIVE ||
          has <= most || !part_alive(p) ||
          (atomic_load(&pn->skip_serial[i]) == atomic_load(&p->serial) &&
           vp__os_now_ns() < atomic_load(&pn->skip_until[i])))
        continue;
      best = i;
      most = has;
    }
    if (best < 0) return got;
    asked[best] = true;
    got += ask_one(pn, (uint32_t)best, want);
  }
}
