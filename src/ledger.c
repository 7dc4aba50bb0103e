/* The per-GPU ledger: every device handle on a physical device joins one
 * shared-memory segment (ledger.h has its layout) and publishes its
 * process and its VBARs there. This file checks the segment (shm.c
 * creates and maps it, and keeps its robust lock: a holder that dies is
 * detected and the lock recovered), reaps dead participants by pid and
 * start time, joins, leaves, and publishes.
 *
 * Publishing costs the hot path nothing: the pager keeps its counts as
 * before; the public calls that used a VBAR stamp its last use and copy its
 * counts into the entry with plain atomic stores (no lock: an entry has one
 * writer, its participant, under the device lock). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ledger.h"
#include "shm.h"

#define ULL(x) ((unsigned long long)(x))
#define RELAXED memory_order_relaxed

/* ------------------------------------------------------------- text */

static void text_put(lword_t *w, size_t nwords, const char *s) {
  char buf[128] = {0};
  size_t n = strnlen(s, nwords * 8 - 1);
  memcpy(buf, s, n);
  for (size_t i = 0; i < nwords; i++) {
    uint64_t v;
    memcpy(&v, buf + 8 * i, 8);
    atomic_store_explicit(&w[i], v, RELAXED);
  }
}

void vp__ltext_get(const lword_t *w, size_t nwords, char *out) {
  size_t i = 0;
  for (; i < nwords; i++) {
    uint64_t v = atomic_load_explicit(&w[i], RELAXED);
    memcpy(out + 8 * i, &v, 8);
  }
  out[8 * nwords - 1] = '\0';
  for (char *c = out; *c; c++)
    if (*c < 0x20 || *c > 0x7e) *c = '?';
}

/* ------------------------------------------------------- processes */

/* Live while a process with its pid and start time exists (os.h). */
bool vp__lpart_alive(const ledger_part_t *p) {
  return vp__os_proc_alive(atomic_load_explicit(&p->pid, RELAXED),
                           atomic_load_explicit(&p->start, RELAXED),
                           atomic_load_explicit(&p->pidns, RELAXED));
}

/* One of this process's participants: our pid in our pid namespace (a
 * container sharing /dev/shm may hold the same pid in its own). */
bool vp__lpart_ours(const ledger_part_t *p, int32_t pid) {
  uint64_t pidns;
  vp__os_proc_self(NULL, &pidns);
  return atomic_load_explicit(&p->pid, RELAXED) == pid &&
         atomic_load_explicit(&p->pidns, RELAXED) == pidns;
}

/* ------------------------------------------------------------ reaping */

static void part_clear(ledger_part_t *p) {
  for (int v = 0; v < LEDGER_VBARS; v++)
    atomic_store_explicit(&p->vbar[v].id, 0, RELAXED);
  atomic_store(&p->reclaimable, 0);
  atomic_store(&p->state, PART_FREE);
  atomic_store(&p->serial, 0);
  atomic_store(&p->pid, 0);
}

bool vp__lslot_live(const ledger_seg_t *seg, uint32_t slot,
                    uint64_t serial) {
  return slot < LEDGER_PARTS &&
         atomic_load(&seg->part[slot].state) == PART_LIVE &&
         atomic_load(&seg->part[slot].serial) == serial;
}

void vp__lreq_answer(const char *shm, const void *seg, ledger_req_t *r,
                     uint64_t freed) {
  atomic_store(&r->freed, freed);
  uint32_t s = REQ_TAKEN;
  if (!atomic_compare_exchange_strong(&r->state, &s, REQ_DONE)) {
    s = REQ_ABANDONED; /* the requester gave up: the slot is ours to free */
    atomic_compare_exchange_strong(&r->state, &s, REQ_FREE);
  }
  vp__os_word_wake(shm, seg, &r->state);
}

/* Requests whose requester is gone are freed; one a live peer is serving
 * is left for it to free (ABANDONED); one whose server is gone is freed
 * once its requester gave up on it. */
static void reap_request(ledger_seg_t *seg, ledger_req_t *r) {
  uint32_t s = atomic_load(&r->state);
  if (s == REQ_FREE) return;
  bool from = vp__lslot_live(seg, atomic_load(&r->from),
                        atomic_load(&r->from_serial));
  bool to = vp__lslot_live(seg, atomic_load(&r->to), atomic_load(&r->to_serial));
  if (!from && s == REQ_TAKEN && to)
    atomic_compare_exchange_strong(&r->state, &s, REQ_ABANDONED);
  else if (!from || (!to && s == REQ_ABANDONED))
    atomic_compare_exchange_strong(&r->state, &s, REQ_FREE);
}

/* True if participant i is live; one whose process is gone is reaped. */
static bool part_live(ledger_seg_t *seg, int i) {
  ledger_part_t *p = &seg->part[i];
  if (atomic_load(&p->state) != PART_LIVE) return false;
  if (vp__lpart_alive(p)) return true;
  vp__log(VP_LOG_INFO, "ledger", "reaped participant %d (pid %d): its "
          "process is gone", i, (int)atomic_load(&p->pid));
  part_clear(p);
  return false;
}

void vp__lseg_reap(ledger_seg_t *seg) {
  for (int i = 0; i < LEDGER_PARTS; i++) part_live(seg, i);
  for (int i = 0; i < LEDGER_REQS; i++) reap_request(seg, &seg->req[i]);
}

/* The participants whose process looks gone, asked of the OS before the
 * lock is taken (gone[i]: its serial, else 0). A question is a call per
 * process (three on Windows, through Wine's one server): asked under the
 * lock at every join for the 64 slots of a full segment, it held the lock
 * long enough that 64 processes joining and leaving under Wine gave up
 * waiting for it (sim/ledger_join_leave_many). */
static void find_gone(ledger_seg_t *seg, uint64_t gone[LEDGER_PARTS]) {
  for (int i = 0; i < LEDGER_PARTS; i++) {
    ledger_part_t *p = &seg->part[i];
    uint64_t serial = atomic_load(&p->serial);
    gone[i] = atomic_load(&p->state) == PART_LIVE && !vp__lpart_alive(p)
                  ? serial
                  : 0;
  }
}

/* vp__lseg_reap() of the participants find_gone() found (lock held): one
 * still in its slot is asked again; requests as vp__lseg_reap(). */
static void reap_gone(ledger_seg_t *seg, const uint64_t gone[LEDGER_PARTS]) {
  for (int i = 0; i < LEDGER_PARTS; i++)
    if (gone[i] && atomic_load(&seg->part[i].serial) == gone[i])
      part_live(seg, i);
  for (int i = 0; i < LEDGER_REQS; i++) reap_request(seg, &seg->req[i]);
}

/* ---------------------------------------------------- membership lock */

/* A holder that died: remove the dead participants (whatever the holder
 * was doing was its own slot or a reap). Bounded, so a stopped holder
 * costs a timeout, never a hang; a lock that others took and gave back
 * meanwhile is busy (many processes joining at once on few CPUs), not
 * stuck: waited on up to LEDGER_LOCK_BUSY_MS. A lock of another kind is
 * not taken (VP_EDEVICE). */
int vp__lseg_lock(vp__ledger_t *l) {
  ledger_seg_t *seg = l->seg;
  bool dead;
  int r = vp__shm_lock(&l->lock, LEDGER_LOCK_MS, LEDGER_LOCK_BUSY_MS,
                       &seg->lock_gen, &dead);
  if (r == VP_EINVAL) {
    vp__log(VP_LOG_WARN, "ledger", "the ledger's lock is not of the kind "
            "this library makes (a corrupt segment?); going on without it");
    return VP_EDEVICE;
  }
  if (dead) {
    vp__log(VP_LOG_WARN, "ledger", "a process died holding the ledger lock; "
            "recovered it and reaped the dead");
    vp__lseg_reap(seg);
  }
  if (r == VP_EAGAIN)
    vp__log(VP_LOG_WARN, "ledger", "the ledger lock stayed taken (%d ms "
            "with nobody else taking it, or %d ms in all: a stopped "
            "process?); going on without it", LEDGER_LOCK_MS,
            LEDGER_LOCK_BUSY_MS);
  return r;
}

void vp__lseg_unlock(vp__ledger_t *l) {
  vp__shm_unlock(&l->lock, &l->seg->lock_gen);
}

/* --------------------------------------------------------- mapping */

static void seg_init(void *p, const char *shm, const void *arg) {
  ledger_seg_t *seg = p;
  (void)arg;
  atomic_store(&seg->version, LEDGER_VERSION);
  atomic_store(&seg->size, sizeof(ledger_seg_t));
  text_put(seg->name, LEDGER_WORDS(80), shm + strlen(LEDGER_PREFIX));
}

/* Refuse a segment that is not this layout: why says what it is. */
static int check_header(void *p, const char *shm, char *why, size_t len) {
  ledger_seg_t *seg = p;
  uint64_t magic = atomic_load_explicit(&seg->magic, memory_order_acquire);
  uint32_t version = atomic_load(&seg->version);
  if (magic != LEDGER_MAGIC)
    snprintf(why, len, "%s is not a vpager ledger (corrupt header)", shm);
  else if (version != LEDGER_VERSION)
    snprintf(why, len, "%s has ledger layout version %u; this library "
             "uses version %u", shm, version, LEDGER_VERSION);
  else if (atomic_load(&seg->size) != sizeof(ledger_seg_t))
    snprintf(why, len, "%s has a %llu-byte layout; this library's is %zu "
             "(another build)", shm, ULL(atomic_load(&seg->size)),
             sizeof(ledger_seg_t));
  else
    return VP_OK;
  return VP_EUNSUPPORTED;
}

static const vp__shm_kind_t seg_kind = {
    sizeof(ledger_seg_t), offsetof(ledger_seg_t, lock), LEDGER_MAGIC,
    seg_init, check_header};

int vp__lseg_map(const char *shm, bool writable, ledger_seg_t **out,
                 char *why, size_t len) {
  void *p = NULL;
  int rc = writable ? vp__shm_attach(shm, &seg_kind, NULL, &p, why, len)
                    : vp__shm_join(shm, &seg_kind, false, &p, why, len);
  if (rc == VP_OK) *out = p;
  return rc;
}

void vp__lseg_unmap(ledger_seg_t *seg) { vp__shm_unmap(seg, &seg_kind); }

/* ---------------------------------------------------------- joining */

/* `vpager top` shows our command line. */
static void part_fill(vp__ledger_t *l, ledger_part_t *p, uint64_t start,
                      uint64_t pidns) {
  char cmd[64];
  vp__os_proc_command(cmd, sizeof cmd);
  part_clear(p); /* a dead predecessor's entries */
  l->serial = atomic_fetch_add(&l->seg->serials, 1) + 1;
  atomic_store(&p->pid, vp__os_pid());
  atomic_store(&p->uid, vp__os_uid());
  atomic_store(&p->start, start);
  atomic_store(&p->pidns, pidns);
  atomic_store(&p->serial, l->serial);
  atomic_store(&p->joined, vp__os_coarse_ns());
  atomic_store(&p->page_size, l->dev->page_size);
  atomic_store(&p->committed, 0);
  atomic_store(&p->external_reserved, 0);
  atomic_store(&p->external_floor, 0);
  atomic_store(&p->served, 0);
  atomic_store(&p->released, 0);
  text_put(p->command, LEDGER_WORDS(64), cmd);
}

/* Take a free participant slot (lock held). VP_EAGAIN: the segment was
 * unlinked since we opened it; open the name again. */
static int join_locked(vp__ledger_t *l, const uint64_t gone[LEDGER_PARTS],
                       char *why, size_t len) {
  ledger_seg_t *seg = l->seg;
  if (atomic_load(&seg->unlinked)) return VP_EAGAIN;
  uint64_t start, pidns;
  vp__os_proc_self(&start, &pidns);
  reap_gone(seg, gone);
  for (int i = 0; i < LEDGER_PARTS; i++) {
    ledger_part_t *p = &seg->part[i];
    if (atomic_load(&p->state) != PART_FREE) continue;
    part_fill(l, p, start, pidns);
    atomic_store(&p->state, PART_LIVE);
    l->part = i;
    return VP_OK;
  }
  snprintf(why, len, "all %d participant slots of %s are taken", LEDGER_PARTS,
           l->shm);
  return VP_ELIMIT;
}

static int join(vp__ledger_t *l, char *why, size_t len) {
  for (int tries = 0; tries < 20; tries++) {
    int rc = vp__lseg_map(l->shm, true, &l->seg, why, len);
    if (rc) return rc;
    int e = vp__os_plock_open(&l->lock, l->shm, &l->seg->lock);
    uint64_t gone[LEDGER_PARTS];
    find_gone(l->seg, gone);
    rc = e ? VP_EDEVICE : vp__lseg_lock(l);
    if (rc == VP_OK) {
      rc = join_locked(l, gone, why, len);
      vp__lseg_unlock(l);
    } else { /* a stopped holder, or a hostile lock word: alone, at once */
      if (rc == VP_EAGAIN)
        snprintf(why, len, "the lock of %s stayed taken (%d ms idle, or "
                 "%d busy)", l->shm, LEDGER_LOCK_MS, LEDGER_LOCK_BUSY_MS);
      else
        snprintf(why, len, "the lock of %s cannot be used (a corrupt "
                 "segment?)", l->shm);
      rc = VP_EUNSUPPORTED;
    }
    if (rc == VP_OK) return VP_OK;
    if (!e) vp__os_plock_close(&l->lock);
    vp__lseg_unmap(l->seg);
    l->seg = NULL;
    if (rc != VP_EAGAIN) return rc;
  }
  snprintf(why, len, "%s kept being removed while we joined", l->shm);
  return VP_EUNSUPPORTED;
}

/* The ledger's name: the option, else the backend's key for the device. */
static bool ledger_name(vp__device_t *dev, char *out, size_t len) {
  const char *opt = dev->opts.ledger;
  if (strcmp(opt, "off") == 0) {
    snprintf(dev->ledger_why, sizeof dev->ledger_why,
             "the ledger is off (the ledger option)");
    return false;
  }
  if (opt[0]) return snprintf(out, len, "%s", opt), true;
  if (vp__be_ledger_key(dev, out, len) == VP_OK) return true;
  snprintf(dev->ledger_why, sizeof dev->ledger_why,
           "the simulated device is not shared (sim_shared), so it has no "
           "ledger");
  return false;
}

void vp__ledger_open(vp__device_t *dev) {
  char name[80], why[192] = "no memory for the ledger";
  if (!ledger_name(dev, name, sizeof name)) return;
  vp__ledger_t *l = calloc(1, sizeof *l);
  int rc = !l || vp__os_mutex_init(&l->skip_mu) ? VP_ENOMEM : VP_OK;
  if (rc == VP_OK) {
    snprintf(l->name, sizeof l->name, "%s", name);
    snprintf(l->shm, sizeof l->shm, LEDGER_PREFIX "%s", name);
    l->dev = dev;
    l->pid = vp__os_pid();
    uint32_t us = dev->opts.ledger_timeout_us;
    l->timeout_ns = (uint64_t)(us ? us : LEDGER_TIMEOUT_US) * 1000;
    rc = join(l, why, sizeof why);
    if (rc) vp__os_mutex_destroy(&l->skip_mu);
  }
  if (rc) {
    vp__log(VP_LOG_WARN, dev->caps.name, "not joining ledger %s: %s; this "
            "device runs alone", name, why);
    snprintf(dev->ledger_why, sizeof dev->ledger_why, "%s", why);
    free(l);
    return;
  }
  vp__log(VP_LOG_INFO, dev->caps.name, "joined ledger %s as participant %d",
          name, l->part);
  dev->ledger = l;
}

/* Give our slot back; the last one out removes the name, so a stale
 * segment does not outlive its users (a crashed run's dead are reaped at
 * the next join). Without the lock we still clear our own slot. */
static void leave(vp__ledger_t *l) {
  ledger_seg_t *seg = l->seg;
  bool locked = vp__lseg_lock(l) == VP_OK;
  ledger_part_t *p = &seg->part[l->part];
  if (atomic_load(&p->serial) == l->serial) part_clear(p);
  /* Requests posted to us that nobody will serve now: taken and answered
   * "nothing", as the service thread would (requesters also notice the
   * slot change while they wait). Only those still posted: an answer
   * given before, not yet read, stays as it is. */
  for (int i = 0; i < LEDGER_REQS; i++) {
    ledger_req_t *r = &seg->req[i];
    uint32_t s = REQ_POSTED;
    if (atomic_load(&r->state) == REQ_POSTED &&
        atomic_load(&r->to) == (uint32_t)l->part &&
        atomic_load(&r->to_serial) == l->serial &&
        atomic_compare_exchange_strong(&r->state, &s, REQ_TAKEN))
      vp__lreq_answer(l->shm, seg, r, 0);
  }
  if (!locked) return;
  /* Whether anyone is left: the first live one ends the search (the dead
   * met before it are reaped). With nobody left the name goes: nobody
   * reads its requests again (a joiner sees `unlinked` and opens anew). */
  bool live = false;
  for (int i = 0; i < LEDGER_PARTS && !live; i++) live = part_live(seg, i);
  if (!live) {
    atomic_store(&seg->unlinked, 1);
    vp__shm_remove(l->shm);
  }
  vp__lseg_unlock(l);
}

/* A forked child's copy of the device is not a participant: it only
 * unmaps. */
void vp__ledger_close(vp__device_t *dev) {
  vp__ledger_t *l = dev->ledger;
  if (!l) return;
  dev->ledger = NULL;
  if (l->pid == vp__os_pid()) leave(l);
  vp__os_plock_close(&l->lock);
  vp__lseg_unmap(l->seg);
  vp__os_mutex_destroy(&l->skip_mu);
  free(l);
}

/* ------------------------------------------------------- publishing */

#define RANK_KEEP UINT32_MAX

static bool entry_take(vp__ledger_t *l, vp__vbar_t *vb) {
  ledger_part_t *p = &l->seg->part[l->part];
  for (uint32_t i = 0; l->entries < LEDGER_VBARS && i < LEDGER_VBARS; i++) {
    if (atomic_load_explicit(&p->vbar[i].id, RELAXED)) continue;
    vb->ledger_entry = i + 1;
    l->entries++;
    return true;
  }
  if (!l->warned_full)
    vp__log(VP_LOG_INFO, "ledger", "more than %d VBARs: the others are not "
            "published", LEDGER_VBARS);
  l->warned_full = true;
  return false;
}

/* Write vb's entry (device lock held). The sequence number is odd while
 * the words change, so a reader takes all of them from one write. */
static void entry_put(vp__ledger_t *l, vp__vbar_t *vb, uint32_t rank,
                      bool label) {
  if (!vb->ledger_entry && !entry_take(l, vb)) return;
  ledger_vbar_t *e = &l->seg->part[l->part].vbar[vb->ledger_entry - 1];
  int shift = vb->dev->page_shift;
  uint32_t seq = atomic_load_explicit(&e->seq, RELAXED) | 1;
  atomic_store_explicit(&e->seq, seq, RELAXED);
  atomic_thread_fence(memory_order_release);
  if (label || !atomic_load_explicit(&e->id, RELAXED)) {
    text_put(e->label, LEDGER_WORDS(VP_LABEL_MAX), vb->label);
    atomic_store_explicit(&e->size, vb->size, RELAXED);
  }
  atomic_store_explicit(&e->id, vb->id, RELAXED);
  atomic_store_explicit(&e->resident, (uint64_t)vb->resident << shift,
                        RELAXED);
  atomic_store_explicit(&e->pinned, (uint64_t)vb->pinned << shift, RELAXED);
  uint64_t was = atomic_load_explicit(&e->reclaimable, RELAXED);
  uint64_t now = (uint64_t)(vb->resident - vb->pinned) << shift;
  atomic_store_explicit(&e->reclaimable, now, RELAXED);
  atomic_store_explicit(&e->last_use, vb->last_use, RELAXED);
  atomic_store_explicit(&e->hits, vb->stats.hits, RELAXED);
  atomic_store_explicit(&e->misses, vb->stats.misses, RELAXED);
  if (rank != RANK_KEEP) atomic_store_explicit(&e->rank, rank, RELAXED);
  atomic_store_explicit(&e->seq, seq + 1, memory_order_release);
  lword_t *sum = &l->seg->part[l->part].reclaimable;
  atomic_store_explicit(sum, atomic_load_explicit(sum, RELAXED) + now - was,
                        RELAXED);
}

static void entry_free(vp__ledger_t *l, ledger_vbar_t *e) {
  lword_t *sum = &l->seg->part[l->part].reclaimable;
  uint32_t seq = atomic_load_explicit(&e->seq, RELAXED) | 1;
  atomic_store_explicit(&e->seq, seq, RELAXED);
  atomic_store_explicit(sum, atomic_load_explicit(sum, RELAXED) -
                        atomic_load_explicit(&e->reclaimable, RELAXED),
                        RELAXED);
  atomic_store_explicit(&e->reclaimable, 0, RELAXED);
  atomic_store_explicit(&e->id, 0, memory_order_release);
  atomic_store_explicit(&e->seq, seq + 1, memory_order_release);
  l->entries--;
}

bool vp__lvbar_read(const ledger_vbar_t *e, ledger_vbar_view_t *v) {
  for (int tries = 0; tries < 16; tries++) {
    uint32_t seq = atomic_load_explicit(&e->seq, memory_order_acquire);
    if (seq & 1) continue;
    v->id = atomic_load_explicit(&e->id, RELAXED);
    v->size = atomic_load_explicit(&e->size, RELAXED);
    v->resident = atomic_load_explicit(&e->resident, RELAXED);
    v->pinned = atomic_load_explicit(&e->pinned, RELAXED);
    v->reclaimable = atomic_load_explicit(&e->reclaimable, RELAXED);
    v->last_use = atomic_load_explicit(&e->last_use, RELAXED);
    v->hits = atomic_load_explicit(&e->hits, RELAXED);
    v->misses = atomic_load_explicit(&e->misses, RELAXED);
    v->rank = atomic_load_explicit(&e->rank, RELAXED);
    vp__ltext_get(e->label, LEDGER_WORDS(VP_LABEL_MAX), v->label);
    atomic_thread_fence(memory_order_acquire);
    if (atomic_load_explicit(&e->seq, RELAXED) == seq) return v->id != 0;
  }
  return false;
}

/* Our counts, and device free memory as we know it: the last poll less
 * what we committed since (stored only when it changed: every participant
 * writes these words). */
static void part_put(vp__ledger_t *l, vp__device_t *dev) {
  ledger_part_t *p = &l->seg->part[l->part];
  const vp__budget_t *b = &dev->budget;
  atomic_store_explicit(&p->committed, dev->committed, RELAXED);
  atomic_store_explicit(&p->external_reserved, dev->external_reserved,
                        RELAXED);
  uint64_t have = b->free_at_poll + b->ours_at_poll;
  uint64_t free_now = have > dev->committed ? have - dev->committed : 0;
  if (b->last_poll_ns && free_now != l->free_published) {
    l->free_published = free_now;
    vp__ledger_put_memory(l, free_now, b->total);
  }
  vp__ledger_refresh_headroom(dev);
}

void vp__ledger_used(vp__device_t *dev, vp__vbar_t *vb) {
  vp__ledger_t *l = dev->ledger;
  if (!l || !vb->listed) return;
  vb->last_use = vp__os_coarse_ns();
  entry_put(l, vb, RANK_KEEP, false);
  part_put(l, dev);
}

/* Every listed VBAR with its rank; entries of VBARs that are gone are
 * freed. */
void vp__ledger_sync(vp__device_t *dev) {
  vp__ledger_t *l = dev->ledger;
  if (!l) return;
  uint64_t live[LEDGER_VBARS / 64] = {0};
  uint32_t rank = 0;
  for (vp__vbar_t *vb = dev->top; vb; vb = vb->down, rank++) {
    entry_put(l, vb, rank, true);
    uint32_t e = vb->ledger_entry;
    if (e) live[(e - 1) / 64] |= 1ull << ((e - 1) % 64);
  }
  ledger_part_t *p = &l->seg->part[l->part];
  for (uint32_t i = 0; i < LEDGER_VBARS; i++)
    if (!(live[i / 64] >> (i % 64) & 1) &&
        atomic_load_explicit(&p->vbar[i].id, RELAXED))
      entry_free(l, &p->vbar[i]);
  part_put(l, dev);
}

void vp__ledger_put_memory(vp__ledger_t *l, uint64_t free_bytes,
                           uint64_t total) {
  atomic_store_explicit(&l->seg->free, free_bytes, RELAXED);
  atomic_store_explicit(&l->seg->total, total, RELAXED);
  atomic_store_explicit(&l->seg->measured, vp__os_coarse_ns(), RELAXED);
}

/* The framework allocator's floor: what it holds at least once warmed up
 * (torch's context, workspaces), measured once. Only the ledger keeps it. */
int vp_device_set_external_floor(vp_device_t h, uint64_t bytes) {
  VP__ENTER();
  vp__device_t *dev = NULL;
  int rc = vp__dev_enter(h, &dev);
  if (rc) return rc;
  vp__ledger_t *l = dev->ledger;
  if (l) atomic_store_explicit(&l->seg->part[l->part].external_floor, bytes,
                               RELAXED);
  return vp__unlock(dev, VP_OK);
}

/* --------------------------------------------------- shared headroom */

/* Each participant publishes the headroom it asks every vpager process on
 * the device to keep free (its shared headroom; by default its own
 * headroom, the backend's default when the user gave none), and keeps
 * free the largest any other live participant asks: one process's room
 * for the display and other programs is not filled by another vpager
 * process that was given less. Reading is a scan of the slots (atomic
 * loads), at most every LEDGER_HEADROOM_NS from the publishing calls and
 * at once when a setting changes; a slot that would raise the figure is
 * first checked to be alive. A value over the device's size (a hostile
 * segment) counts as the device's size. */
static uint64_t own_shared_headroom(const vp__device_t *dev) {
  const vp__budget_t *b = &dev->budget;
  return (uint64_t)(b->shared_headroom >= 0 ? b->shared_headroom
                                            : b->headroom);
}

static void headroom_exchange(vp__ledger_t *l, vp__device_t *dev) {
  ledger_seg_t *seg = l->seg;
  l->headroom_read = vp__os_coarse_ns();
  if (l->pid != vp__os_pid()) return; /* a forked child's copy: not a member */
  atomic_store_explicit(&seg->part[l->part].headroom,
                        own_shared_headroom(dev), RELAXED);
  uint64_t most = 0, total = dev->caps.total_memory;
  for (int i = 0; i < LEDGER_PARTS; i++) {
    ledger_part_t *p = &seg->part[i];
    if (i == l->part || atomic_load(&p->state) != PART_LIVE) continue;
    uint64_t h = atomic_load_explicit(&p->headroom, RELAXED);
    if (h > total) h = total;
    if (h > most && vp__lpart_alive(p)) most = h;
  }
  dev->budget.peers_headroom = most;
}

void vp__ledger_put_headroom(vp__device_t *dev) {
  if (dev->ledger) headroom_exchange(dev->ledger, dev);
}

void vp__ledger_refresh_headroom(vp__device_t *dev) {
  vp__ledger_t *l = dev->ledger;
  if (l && vp__os_coarse_ns() - l->headroom_read >= LEDGER_HEADROOM_NS)
    headroom_exchange(l, dev);
}
