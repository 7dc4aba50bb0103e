/* The simulated device: device memory is host memory.
 *
 * Reserve = a host reservation with no access (costs nothing); commit =
 * count a page against the capacity; set_access = commit it read/write;
 * unmap = decommit: drop the contents and remove access, so a later touch faults as an illegal
 * address does on a GPU. A page mapped at a second address (caps.map_twice,
 * Linux) makes both views one shared mapping's (os.h's vp__os_vm_share);
 * unmapping a view drops that view.
 *
 * Streams: in VP_SIM_SYNC mode every op runs at once in the caller; in
 * VP_SIM_WORKER mode each stream (0 included) is a thread draining a FIFO
 * of ops. An event is a ticket "stream S has finished its first N ops", so
 * recording costs no allocation and a re-record simply replaces the ticket.
 *
 * Locking: one mutex (c->mu) guards the whole ctx; a worker drops it while
 * it runs an op. With opts->sim_shared the used-memory count lives in a
 * POSIX shared-memory segment shared by every process opening that name.
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "os.h"

/* ------------------------------------------------------------- handles */

/* A handle is tag (16 bits) | generation (24) | slot index (24): a stale,
 * foreign or made-up value fails the lookup instead of being dereferenced.
 * The tag mixes a per-kind constant with bits of the ctx address, so a
 * handle of another sim device is (very likely) refused too. */
#define SIM_IDX_BITS 24
#define SIM_IDX_LIMIT (1u << SIM_IDX_BITS)
#define SIM_GEN_MASK 0xffffffu
#define SIM_NONE UINT32_MAX

enum { SIM_TAG_STREAM = 0x5354, SIM_TAG_EVENT = 0x4556, SIM_TAG_PHYS = 0x5048 };

typedef struct sim_stream sim_stream_t;

/* Complete once stream slot sidx, still at generation sgen, has finished
 * its first n ops; sgen 0 (never recorded) is always complete. A destroyed
 * stream was drained first, so its tickets are complete too. */
typedef struct sim_ticket {
  uint32_t sidx, sgen;
  uint64_t n;
} sim_ticket_t;

typedef struct sim_slot {
  uint32_t gen;  /* odd while live */
  uint32_t next; /* next dead slot (free list) */
  union {
    sim_stream_t *stream; /* stays with the slot (and is reused) when dead */
    sim_ticket_t ev;      /* an event's latest record */
    struct {
      uint64_t size;      /* a physical allocation's size */
      uint64_t va;        /* where it was mapped first; 0: not yet */
    } phys;
  } u;
} sim_slot_t;

typedef struct sim_table {
  sim_slot_t *s;
  uint32_t n, cap, free;
  uint64_t tag;
} sim_table_t;

/* ----------------------------------------------------------- the ctx */

typedef enum { SIM_OP_COPY, SIM_OP_LAUNCH, SIM_OP_WAIT } sim_op_kind_t;

typedef struct sim_op {
  struct sim_op *next;
  sim_op_kind_t kind;
  union {
    struct { void *dst; const void *src; size_t n; } copy;
    struct { void (*fn)(void *); void *arg; } launch;
    sim_ticket_t wait;
  } u;
} sim_op_t;

struct sim_stream {
  struct sim_ctx *c;
  vp__os_thread_t thr;
  bool running;            /* a worker thread exists */
  bool stop;               /* takes no more work; worker exits once drained */
  vp__os_cond_t work_cv;  /* work queued or stop set */
  sim_op_t *head, *tail;
  uint64_t enq, done;      /* ops queued and finished, ever (worker mode) */
};

typedef struct sim_range {
  uint64_t va, size;
} sim_range_t;

/* Shared-memory segment "/vpager-sim-<name>". Slot pids change only under
 * `lock`; `used` is the sum of the slots' used, charged lock-free. */
#define SIM_SHM_MAGIC 0x316d687372706776ull /* "vgprshm1" */
#define SIM_SHM_SLOTS 64

typedef struct sim_shm_slot {
  _Atomic int32_t pid;   /* 0 = free */
  _Atomic uint64_t used; /* bytes the device in this slot holds */
} sim_shm_slot_t;

typedef struct sim_shm {
  _Atomic uint64_t magic;   /* SIM_SHM_MAGIC once initialised */
  _Atomic uint64_t size;    /* sizeof(sim_shm_t): the layout's version */
  _Atomic int32_t lock;     /* pid holding the attach lock, 0 = free */
  _Atomic int32_t unlinked; /* the name was removed: open it anew */
  _Atomic uint64_t capacity;
  _Atomic uint64_t used;
  sim_shm_slot_t slot[SIM_SHM_SLOTS];
} sim_shm_t;

typedef struct sim_ctx {
  vp__os_mutex_t mu;
  vp__os_cond_t done_cv; /* an op finished on some stream */
  vp__inject_t *inj;
  uint64_t gran;
  bool worker;
  bool broken;            /* VP_SIM_BREAK */
  uint64_t capacity;      /* without a shared segment */
  uint64_t used;          /* bytes this ctx holds */
  uint64_t fail_commit;   /* the nth phys_create from now fails; 0 = off */
  uint64_t transient;     /* phys_create calls left to fail with EAGAIN */
  uint64_t soft_limit;    /* VP_SIM_SET_SOFT_LIMIT; 0 = none */
  bool map_apart;         /* VP_SIM_MAP_APART: a second view is not shared */
  sim_table_t streams, events, phys;
  sim_range_t *res;       /* live reserves */
  size_t nres, capres;
  sim_range_t *views;     /* both views of each page mapped twice */
  size_t nviews, capviews;
  sim_shm_t *shm;
  int slot;               /* ours in shm->slot */
  int32_t pid;            /* the opener (a forked child owns no workers) */
  char shm_name[96];
  uint64_t reaped_ns;     /* when dead processes' memory was last freed */
} sim_ctx_t;

/* ------------------------------------------------------------- tables */

static void tab_init(sim_table_t *t, uint16_t base, const void *salt) {
  uintptr_t a = (uintptr_t)salt;
  uint16_t tag = (uint16_t)(base ^ (a >> 4) ^ (a >> 20) ^ (a >> 36));
  t->tag = tag ? tag : base;
  t->free = SIM_NONE;
}

static int tab_alloc(sim_table_t *t, uint32_t *idx) {
  if (t->free != SIM_NONE) {
    *idx = t->free;
    t->free = t->s[*idx].next;
  } else {
    if (t->n == SIM_IDX_LIMIT) return VP_ELIMIT;
    if (t->n == t->cap) {
      uint32_t cap = t->cap ? t->cap * 2 : 16;
      sim_slot_t *s = realloc(t->s, cap * sizeof *s);
      if (!s) return VP_ENOMEM;
      t->s = s;
      t->cap = cap;
    }
    *idx = t->n++;
    memset(&t->s[*idx], 0, sizeof t->s[0]);
  }
  t->s[*idx].gen++; /* even -> odd: live */
  return VP_OK;
}

static void tab_free(sim_table_t *t, uint32_t idx) {
  t->s[idx].gen++;
  t->s[idx].next = t->free;
  t->free = idx;
}

static uint64_t tab_handle(const sim_table_t *t, uint32_t idx) {
  return t->tag << 48 | (uint64_t)(t->s[idx].gen & SIM_GEN_MASK) << 24 | idx;
}

/* The slot index of a live handle, or -1. */
static int64_t tab_find(const sim_table_t *t, uint64_t h) {
  uint32_t idx = (uint32_t)(h & (SIM_IDX_LIMIT - 1));
  uint32_t gen = (uint32_t)(h >> 24) & SIM_GEN_MASK;
  if (h >> 48 != t->tag || idx >= t->n) return -1;
  uint32_t g = t->s[idx].gen;
  if (!(g & 1) || (g & SIM_GEN_MASK) != gen) return -1;
  return idx;
}

/* ------------------------------------------------------------ helpers */

static void sim_lock(sim_ctx_t *c) { vp__os_mutex_lock(&c->mu); }
static void sim_unlock(sim_ctx_t *c) { vp__os_mutex_unlock(&c->mu); }

/* Every failable op starts here (c->mu held): a broken device, or the
 * fault-injection countdown, fails it with `fail`. */
static int sim_enter(sim_ctx_t *c, int fail) {
  if (c->broken) return VP_EDEVICE;
  return vp__inject_fail(c->inj) ? fail : VP_OK;
}

static bool sim_aligned(const sim_ctx_t *c, uint64_t size) {
  return size != 0 && (size & (c->gran - 1)) == 0;
}

/* The live reserve holding [va, va+size), or NULL. */
static sim_range_t *sim_reserve_of(sim_ctx_t *c, uint64_t va, uint64_t size) {
  for (size_t i = 0; i < c->nres; i++) {
    sim_range_t *r = &c->res[i];
    if (va >= r->va && size <= r->size && va - r->va <= r->size - size)
      return r;
  }
  return NULL;
}

/* Whether [va, va+size) touches any live reserve. */
static bool sim_touches_reserve(const sim_ctx_t *c, uint64_t va,
                                uint64_t size) {
  for (size_t i = 0; i < c->nres; i++) {
    const sim_range_t *r = &c->res[i];
    if (va < r->va + r->size && va + size > r->va) return true;
  }
  return false;
}

static bool ticket_done(const sim_ctx_t *c, sim_ticket_t t) {
  if (!t.sgen) return true;
  const sim_slot_t *sl = &c->streams.s[t.sidx];
  return sl->gen != t.sgen || sl->u.stream->done >= t.n;
}

/* The stream of handle h (0 = the default stream) that still takes work. */
static sim_stream_t *sim_stream_get(sim_ctx_t *c, vp_stream_t h,
                                    uint32_t *idx) {
  int64_t i = h == 0 ? 0 : tab_find(&c->streams, h);
  if (i < 0) return NULL;
  sim_stream_t *s = c->streams.s[i].u.stream;
  if (s->stop) return NULL;
  if (idx) *idx = (uint32_t)i;
  return s;
}

/* A ticket for everything queued on stream idx so far. */
static sim_ticket_t sim_ticket_now(const sim_ctx_t *c, uint32_t idx) {
  const sim_slot_t *sl = &c->streams.s[idx];
  return (sim_ticket_t){idx, sl->gen, sl->u.stream->enq};
}

static void sim_wait_ticket(sim_ctx_t *c, sim_ticket_t t) {
  while (!ticket_done(c, t)) vp__os_cond_wait(&c->done_cv, &c->mu);
}

/* ----------------------------------------------------------- workers */

static void sim_op_run(const sim_op_t *op) {
  if (op->kind == SIM_OP_COPY && op->u.copy.n)
    memcpy(op->u.copy.dst, op->u.copy.src, op->u.copy.n);
  else if (op->kind == SIM_OP_LAUNCH)
    op->u.launch.fn(op->u.launch.arg);
}

static void *sim_worker(void *arg) {
  sim_stream_t *s = arg;
  sim_ctx_t *c = s->c;
  sim_lock(c);
  for (;;) {
    while (!s->head && !s->stop) vp__os_cond_wait(&s->work_cv, &c->mu);
    sim_op_t *op = s->head;
    if (!op) break; /* stopped and drained */
    if (op->kind == SIM_OP_WAIT) sim_wait_ticket(c, op->u.wait);
    s->head = op->next;
    if (!s->head) s->tail = NULL;
    sim_unlock(c);
    sim_op_run(op);
    free(op);
    sim_lock(c);
    s->done++;
    vp__os_cond_broadcast(&c->done_cv);
  }
  sim_unlock(c);
  return NULL;
}

static void sim_enqueue(sim_stream_t *s, sim_op_t *op) {
  op->next = NULL;
  if (s->tail) s->tail->next = op;
  else s->head = op;
  s->tail = op;
  s->enq++;
  vp__os_cond_signal(&s->work_cv);
}

static sim_stream_t *sim_stream_alloc(sim_ctx_t *c, vp__inject_t *inj) {
  if (vp__inject_fail(inj)) return NULL;
  sim_stream_t *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  if (vp__os_cond_init(&s->work_cv)) {
    free(s);
    return NULL;
  }
  s->c = c;
  return s;
}

/* A new stream in a fresh or reused slot, its worker started (c->mu held,
 * or open). inj: open's allocation rungs; NULL elsewhere. */
static int sim_stream_new(sim_ctx_t *c, vp__inject_t *inj, uint32_t *idx) {
  if (vp__inject_fail(inj)) return VP_ENOMEM;
  int rc = tab_alloc(&c->streams, idx);
  if (rc) return rc;
  sim_slot_t *sl = &c->streams.s[*idx];
  if (!sl->u.stream && !(sl->u.stream = sim_stream_alloc(c, inj))) {
    tab_free(&c->streams, *idx);
    return VP_ENOMEM;
  }
  sim_stream_t *s = sl->u.stream;
  s->stop = false;
  if (c->worker) {
    if (vp__inject_fail(inj) || vp__os_thread_start(&s->thr, sim_worker, s, 0)) {
      tab_free(&c->streams, *idx);
      return VP_ENOMEM;
    }
    s->running = true;
  }
  return VP_OK;
}

/* Stop a stream's worker after it drained its queue (c->mu held; dropped
 * while joining). */
static void sim_stream_stop(sim_ctx_t *c, sim_stream_t *s) {
  s->stop = true;
  vp__os_cond_signal(&s->work_cv);
  if (!s->running) return;
  sim_unlock(c);
  vp__os_thread_join(&s->thr);
  sim_lock(c);
  s->running = false;
}

/* ------------------------------------------------------ shared memory */

static void sim_nap(void) { vp__os_sleep_ns(50 * 1000); }

static bool pid_dead(int32_t pid) {
  return pid > 0 && !vp__os_pid_exists(pid);
}

/* The attach lock: a pid in the segment; a dead holder's lock is taken
 * over. Held for microseconds, but its holder may be preempted among many
 * processes on few cores: give up after 30 s (by the clock: a nap may
 * last a timer tick, 15.6 ms on Windows). */
static bool shm_lock(sim_shm_t *m) {
  int32_t me = vp__os_pid();
  uint64_t until = vp__os_now_ns() + 30000000000ull;
  for (;;) {
    int32_t cur = 0;
    if (atomic_compare_exchange_strong(&m->lock, &cur, me)) return true;
    if (pid_dead(cur)) atomic_compare_exchange_strong(&m->lock, &cur, 0);
    else if (vp__os_now_ns() > until) return false;
    else sim_nap();
  }
}

static void shm_unlock(sim_shm_t *m) { atomic_store(&m->lock, 0); }

static void shm_sub(_Atomic uint64_t *v, uint64_t n) {
  uint64_t cur = atomic_load(v);
  while (!atomic_compare_exchange_weak(v, &cur, cur > n ? cur - n : 0)) {}
}

static bool shm_charge(sim_shm_t *m, uint64_t size) {
  uint64_t cap = atomic_load(&m->capacity), cur = atomic_load(&m->used);
  do {
    if (cur > cap || size > cap - cur) return false;
  } while (!atomic_compare_exchange_weak(&m->used, &cur, cur + size));
  return true;
}

static void shm_free_slot(sim_shm_t *m, int i) {
  shm_sub(&m->used, atomic_exchange(&m->slot[i].used, 0));
  atomic_store(&m->slot[i].pid, 0);
}

/* The slots whose process looks dead, asked of the OS without the lock
 * (dead[i]: its pid, else 0); true if any. A question costs a call per
 * pid (on Windows three, through Wine's one server): asked under the lock
 * for the 64 slots of a full segment at every join and every 100 ms, it
 * held the lock long enough for 64 churning processes under Wine to give
 * up waiting (sim/ledger_join_leave_many). */
static bool shm_dead_slots(sim_shm_t *m, int32_t dead[SIM_SHM_SLOTS]) {
  bool any = false;
  for (int i = 0; i < SIM_SHM_SLOTS; i++) {
    int32_t pid = atomic_load(&m->slot[i].pid);
    dead[i] = pid && pid_dead(pid) ? pid : 0;
    any |= dead[i] != 0;
  }
  return any;
}

/* Give back the usage of the processes shm_dead_slots() found dead (lock
 * held): a slot still theirs is asked again (given since to a new process
 * that got the pid again, it is that one's); returns the slots left. */
static int shm_reclaim(sim_shm_t *m, const int32_t dead[SIM_SHM_SLOTS]) {
  int live = 0;
  for (int i = 0; i < SIM_SHM_SLOTS; i++) {
    int32_t pid = atomic_load(&m->slot[i].pid);
    if (pid && pid == dead[i] && pid_dead(pid)) shm_free_slot(m, i);
    else if (pid) live++;
  }
  return live;
}

static int shm_errno(int e) {
  return e == ENOMEM || e == ENOSPC || e == EMFILE || e == ENFILE
             ? VP_ENOMEM : VP_EDEVICE;
}

/* Open (or create: zeroed, shm_join initialises it) the segment and map
 * it. VP_EAGAIN: it appeared or vanished meanwhile; open it again. */
static int shm_map(sim_ctx_t *c) {
  void *p = NULL;
  vp__os_shm_info_t info = {0, 0};
  int e = vp__os_shm_open(c->shm_name, true, sizeof(sim_shm_t), &p, &info);
  if (e == ENOENT) {
    e = vp__os_shm_create(c->shm_name, sizeof(sim_shm_t), NULL, NULL, &p);
    if (e == EEXIST) return VP_EAGAIN;
  } else if (e == EMSGSIZE && info.size == 0) {
    vp__os_shm_unlink(c->shm_name); /* an older build's killed creator's */
    return VP_EAGAIN;
  }
  if (e) return e == EMSGSIZE || e == EPERM ? VP_EDEVICE : shm_errno(e);
  c->shm = p;
  return VP_OK;
}

static int shm_claim(sim_ctx_t *c) {
  sim_shm_t *m = c->shm;
  for (int i = 0; i < SIM_SHM_SLOTS; i++) {
    if (atomic_load(&m->slot[i].pid)) continue;
    atomic_store(&m->slot[i].used, 0);
    atomic_store(&m->slot[i].pid, (int32_t)c->pid);
    c->slot = i;
    return VP_OK;
  }
  return VP_ELIMIT;
}

/* Join the mapped segment (under its lock): initialise it when nobody live
 * uses it (first opener, or every user died), then take a slot.
 * VP_EAGAIN: the segment was unlinked meanwhile; open the name again. */
static int shm_join(sim_ctx_t *c, uint64_t capacity) {
  sim_shm_t *m = c->shm;
  int32_t dead[SIM_SHM_SLOTS];
  shm_dead_slots(m, dead);
  if (!shm_lock(m)) return VP_EDEVICE;
  int rc = VP_OK;
  uint64_t magic = atomic_load(&m->magic);
  if (atomic_load(&m->unlinked)) rc = VP_EAGAIN;
  else if (magic && (magic != SIM_SHM_MAGIC ||
                     atomic_load(&m->size) != sizeof(sim_shm_t)))
    rc = VP_EDEVICE;
  else if (!magic || shm_reclaim(m, dead) == 0) {
    atomic_store(&m->size, sizeof(sim_shm_t));
    atomic_store(&m->capacity, capacity);
    atomic_store(&m->used, 0);
    atomic_store(&m->magic, SIM_SHM_MAGIC);
  }
  if (!rc) rc = shm_claim(c);
  shm_unlock(m);
  return rc;
}

static int shm_attach(sim_ctx_t *c, const vp_options_t *o) {
  snprintf(c->shm_name, sizeof c->shm_name, "/vpager-sim-%s", o->sim_shared);
  for (int tries = 0; tries < 100; tries++) {
    if (vp__inject_fail(c->inj)) return VP_ENOMEM;
    int rc = shm_map(c);
    if (rc == VP_EAGAIN) continue;
    if (rc) return rc;
    rc = shm_join(c, o->sim_capacity);
    if (rc == VP_OK) return VP_OK;
    vp__os_shm_unmap(c->shm, sizeof(sim_shm_t));
    c->shm = NULL;
    if (rc != VP_EAGAIN) return rc;
  }
  return VP_EDEVICE;
}

/* Free our slot; the last user removes the name, so a stale segment does
 * not outlive its devices (a crashed run's is re-initialised on attach). */
static void shm_detach(sim_ctx_t *c) {
  sim_shm_t *m = c->shm;
  if (vp__os_pid() == c->pid) { /* a forked child's slot is its parent's */
    int32_t dead[SIM_SHM_SLOTS];
    shm_dead_slots(m, dead);
    bool locked = shm_lock(m);
    shm_free_slot(m, c->slot);
    if (locked && shm_reclaim(m, dead) == 0) {
      atomic_store(&m->unlinked, 1);
      vp__os_shm_unlink(c->shm_name);
    }
    if (locked) shm_unlock(m);
  }
  vp__os_shm_unmap(m, sizeof(sim_shm_t));
  c->shm = NULL;
}

/* ----------------------------------------------------- open and close */

static int sim_check_opts(const vp_options_t *o) {
  uint64_t g = o->sim_granularity, page = vp__os_page_size();
  if (g < 4096 || g < page || (g & (g - 1))) return VP_EINVAL;
  if (o->sim_capacity == 0) return VP_EINVAL;
  if (o->sim_streams != VP_SIM_SYNC && o->sim_streams != VP_SIM_WORKER)
    return VP_EINVAL;
  size_t len = strnlen(o->sim_shared, sizeof o->sim_shared);
  if (len == sizeof o->sim_shared || memchr(o->sim_shared, '/', len))
    return VP_EINVAL;
  return VP_OK;
}

static sim_ctx_t *sim_ctx_new(const vp_options_t *o, vp__inject_t *inj) {
  sim_ctx_t *c = vp__inject_fail(inj) ? NULL : calloc(1, sizeof *c);
  if (!c) return NULL;
  if (vp__os_mutex_init(&c->mu)) goto fail_mu;
  if (vp__os_cond_init(&c->done_cv)) goto fail_cv;
  c->inj = inj;
  c->gran = o->sim_granularity;
  c->worker = o->sim_streams == VP_SIM_WORKER;
  c->capacity = o->sim_capacity;
  c->pid = vp__os_pid();
  tab_init(&c->streams, SIM_TAG_STREAM, c);
  tab_init(&c->events, SIM_TAG_EVENT, c);
  tab_init(&c->phys, SIM_TAG_PHYS, c);
  return c;
fail_cv:
  vp__os_mutex_destroy(&c->mu);
fail_mu:
  free(c);
  return NULL;
}

/* Frees whatever c holds: used by close and by a failed open. A forked
 * child has no workers, and its copies of the mutex and condition
 * variables may show the parent's waiters: it only frees memory. */
static void sim_teardown(sim_ctx_t *c) {
  bool owner = vp__os_pid() == c->pid;
  for (uint32_t i = 0; owner && i < c->streams.n; i++) {
    sim_stream_t *s = c->streams.s[i].u.stream;
    if (!s) continue;
    sim_lock(c);
    sim_stream_stop(c, s);
    sim_unlock(c);
  }
  for (uint32_t i = 0; i < c->streams.n; i++) {
    sim_stream_t *s = c->streams.s[i].u.stream;
    if (s && owner) vp__os_cond_destroy(&s->work_cv);
    free(s);
  }
  for (size_t i = 0; i < c->nres; i++)
    vp__os_vm_release((void *)(uintptr_t)c->res[i].va, c->res[i].size);
  if (c->shm) shm_detach(c);
  free(c->streams.s);
  free(c->events.s);
  free(c->phys.s);
  free(c->res);
  free(c->views);
  if (owner) {
    vp__os_cond_destroy(&c->done_cv);
    vp__os_mutex_destroy(&c->mu);
  }
  free(c);
}

static int sim_open(const vp_options_t *o, vp__inject_t *inj, void **out,
                    vp__caps_t *caps) {
  if (!o || !out || !caps) return VP_EINVAL;
  int rc = sim_check_opts(o);
  if (rc) return rc;
  if (vp__inject_fail(inj)) return VP_ENOMEM;
  sim_ctx_t *c = sim_ctx_new(o, inj);
  if (!c) return VP_ENOMEM;
  uint32_t idx = 0;
  rc = sim_stream_new(c, inj, &idx); /* the default stream: slot 0 */
  if (!rc && o->sim_shared[0]) rc = shm_attach(c, o);
  if (rc) {
    sim_teardown(c);
    return rc;
  }
  caps->name = "sim";
  caps->granularity = c->gran;
  caps->total_memory = c->shm ? atomic_load(&c->shm->capacity) : c->capacity;
  caps->default_headroom = 0;
  caps->async_copies = c->worker;
  caps->map_twice = vp__os_vm_can_share();
  *out = c;
  return VP_OK;
}

static void sim_close(void *ctx) {
  if (ctx) sim_teardown(ctx);
}

/* ------------------------------------------------------------- memory */

/* A process that died holding device memory gives it back, as the driver
 * does at its exit: looked for at most every 100 ms, when free memory is
 * read (c->mu held). */
static void sim_reap_dead(sim_ctx_t *c) {
  uint64_t now = vp__os_now_ns();
  if (!c->shm || now - c->reaped_ns < 100000000ull) return;
  c->reaped_ns = now;
  int32_t dead[SIM_SHM_SLOTS];
  if (!shm_dead_slots(c->shm, dead) || !shm_lock(c->shm)) return;
  shm_reclaim(c->shm, dead);
  shm_unlock(c->shm);
}

static int sim_mem_info(void *ctx, uint64_t *free_bytes, uint64_t *total) {
  sim_ctx_t *c = ctx;
  if (!free_bytes || !total) return VP_EINVAL;
  sim_lock(c);
  sim_reap_dead(c);
  int rc = sim_enter(c, VP_EDEVICE);
  uint64_t cap = c->capacity, used = c->used;
  if (c->shm) {
    cap = atomic_load(&c->shm->capacity);
    used = atomic_load(&c->shm->used);
  }
  sim_unlock(c);
  if (rc) return rc;
  *free_bytes = used < cap ? cap - used : 0;
  *total = cap;
  return VP_OK;
}

static int sim_res_add(sim_ctx_t *c, uint64_t va, uint64_t size) {
  if (c->nres == c->capres) {
    size_t cap = c->capres ? c->capres * 2 : 8;
    sim_range_t *r = realloc(c->res, cap * sizeof *r);
    if (!r) return VP_ENOMEM;
    c->res = r;
    c->capres = cap;
  }
  c->res[c->nres++] = (sim_range_t){va, size};
  return VP_OK;
}

/* A reservation of size bytes aligned to the granularity. */
static int sim_reserve_aligned(uint64_t size, uint64_t gran, uint64_t *va) {
  void *p = NULL;
  if (size > UINT64_MAX - gran || size + gran > SIZE_MAX ||
      vp__os_vm_reserve((size_t)size, (size_t)gran, &p))
    return VP_ENOMEM;
  *va = (uint64_t)(uintptr_t)p;
  return VP_OK;
}

static int sim_va_reserve(void *ctx, uint64_t size, uint64_t *va) {
  sim_ctx_t *c = ctx;
  if (!va || !sim_aligned(c, size)) return VP_EINVAL;
  sim_lock(c);
  int rc = sim_enter(c, VP_EDEVICE);
  uint64_t a = 0;
  if (!rc) rc = sim_reserve_aligned(size, c->gran, &a);
  if (!rc && (rc = sim_res_add(c, a, size)))
    vp__os_vm_release((void *)(uintptr_t)a, size);
  sim_unlock(c);
  if (!rc) *va = a;
  return rc;
}

static int sim_va_free(void *ctx, uint64_t va, uint64_t size) {
  sim_ctx_t *c = ctx;
  sim_lock(c);
  sim_range_t *r = sim_reserve_of(c, va, size);
  int rc = r && r->va == va && r->size == size ? VP_OK : VP_EINVAL;
  if (!rc) {
    vp__os_vm_release((void *)(uintptr_t)va, size);
    *r = c->res[--c->nres];
  }
  sim_unlock(c);
  return rc;
}

/* Injected commit failures (c->mu held): every call counts toward
 * VP_SIM_FAIL_COMMIT; VP_SIM_TRANSIENT fails the next n with EAGAIN. */
static int sim_commit_faults(sim_ctx_t *c) {
  if (c->fail_commit && --c->fail_commit == 0) return VP_EOOM;
  if (c->transient) {
    c->transient--;
    return VP_EAGAIN;
  }
  return VP_OK;
}

static bool sim_charge(sim_ctx_t *c, uint64_t size) {
  if (c->shm) {
    if (!shm_charge(c->shm, size)) return false;
    atomic_fetch_add(&c->shm->slot[c->slot].used, size);
  } else if (c->used > c->capacity || size > c->capacity - c->used) {
    return false;
  }
  c->used += size;
  return true;
}

static void sim_uncharge(sim_ctx_t *c, uint64_t size) {
  if (c->shm) {
    shm_sub(&c->shm->slot[c->slot].used, size);
    shm_sub(&c->shm->used, size);
  }
  c->used -= size;
}

static int sim_phys_create(void *ctx, uint64_t size, vp__phys_t *phys) {
  sim_ctx_t *c = ctx;
  if (!phys || !sim_aligned(c, size)) return VP_EINVAL;
  sim_lock(c);
  uint32_t idx = 0;
  int rc = sim_enter(c, VP_EOOM);
  if (!rc) rc = sim_commit_faults(c);
  if (!rc) rc = tab_alloc(&c->phys, &idx);
  if (!rc && !sim_charge(c, size)) {
    tab_free(&c->phys, idx);
    rc = VP_EOOM;
  }
  if (!rc) {
    c->phys.s[idx].u.phys.size = size;
    c->phys.s[idx].u.phys.va = 0;
    *phys = tab_handle(&c->phys, idx);
  }
  sim_unlock(c);
  return rc;
}

static int sim_phys_release(void *ctx, vp__phys_t phys, uint64_t size) {
  sim_ctx_t *c = ctx;
  sim_lock(c);
  int64_t i = tab_find(&c->phys, phys);
  int rc = i >= 0 && c->phys.s[i].u.phys.size == size ? VP_OK : VP_EINVAL;
  if (!rc) {
    sim_uncharge(c, size);
    tab_free(&c->phys, (uint32_t)i);
  }
  sim_unlock(c);
  return rc;
}

/* A second view of a page (its phys mapped at `first` already): both
 * become views of one memory, the first's bytes kept; the new one has no
 * access until set_access. */
static int sim_map_again(sim_ctx_t *c, uint64_t first, uint64_t va,
                         uint64_t size) {
  if (c->nviews + 2 > c->capviews) {
    size_t cap = c->capviews ? c->capviews * 2 : 8;
    sim_range_t *v = realloc(c->views, cap * sizeof *v);
    if (!v) return VP_ENOMEM;
    c->views = v;
    c->capviews = cap;
  }
  void *a = (void *)(uintptr_t)first, *b = (void *)(uintptr_t)va;
  int e = vp__os_vm_share(a, b, size);
  if (e) return e == ENOSYS ? VP_EUNSUPPORTED : VP_EOOM;
  c->views[c->nviews++] = (sim_range_t){first, size};
  c->views[c->nviews++] = (sim_range_t){va, size};
  return vp__os_vm_decommit(b, size) ? VP_EDEVICE : VP_OK;
}

static int sim_map(void *ctx, uint64_t va, uint64_t size, vp__phys_t phys) {
  sim_ctx_t *c = ctx;
  sim_lock(c);
  int64_t i = tab_find(&c->phys, phys);
  int rc = sim_enter(c, VP_EDEVICE);
  if (!rc && (i < 0 || c->phys.s[i].u.phys.size != size ||
              !sim_reserve_of(c, va, size) || (va & (c->gran - 1))))
    rc = VP_EINVAL;
  if (!rc) {
    uint64_t *first = &c->phys.s[i].u.phys.va;
    if (!*first) *first = va;
    else if (*first != va && !c->map_apart)
      rc = sim_map_again(c, *first, va, size);
  }
  sim_unlock(c);
  return rc;
}

static int sim_set_access(void *ctx, uint64_t va, uint64_t size) {
  sim_ctx_t *c = ctx;
  sim_lock(c);
  int rc = sim_enter(c, VP_EDEVICE);
  if (!rc && (!sim_aligned(c, size) || !sim_reserve_of(c, va, size)))
    rc = VP_EINVAL;
  /* ENOMEM: the kernel's mapping count or commit limit; out of memory. */
  int e = rc ? 0 : vp__os_vm_commit((void *)(uintptr_t)va, size);
  if (e) rc = e == ENOMEM ? VP_EOOM : VP_EDEVICE;
  sim_unlock(c);
  return rc;
}

/* An undo op: never injected, works on a broken device. Access goes first,
 * so a racing touch faults rather than reading dropped (zeroed) data. */
static int sim_unmap(void *ctx, uint64_t va, uint64_t size) {
  sim_ctx_t *c = ctx;
  void *p = (void *)(uintptr_t)va;
  sim_lock(c);
  int rc = sim_aligned(c, size) && sim_reserve_of(c, va, size) ? VP_OK
                                                               : VP_EINVAL;
  size_t k = 0; /* a view of a page mapped twice: dropped, not decommitted */
  while (k < c->nviews && (c->views[k].va != va || c->views[k].size != size))
    k++;
  if (!rc && k < c->nviews) {
    if (vp__os_vm_unshare(p, size)) rc = VP_EDEVICE;
    c->views[k] = c->views[--c->nviews];
  } else if (!rc && vp__os_vm_decommit(p, size)) {
    rc = VP_EDEVICE;
  }
  sim_unlock(c);
  return rc;
}

/* ------------------------------------------------------------ streams */

static int sim_stream_create(void *ctx, vp_stream_t *stream) {
  sim_ctx_t *c = ctx;
  if (!stream) return VP_EINVAL;
  sim_lock(c);
  uint32_t idx = 0;
  int rc = sim_enter(c, VP_EDEVICE);
  if (!rc) rc = sim_stream_new(c, NULL, &idx);
  if (!rc) *stream = tab_handle(&c->streams, idx);
  sim_unlock(c);
  return rc;
}

/* Waits for the stream's work, then frees its slot. */
static int sim_stream_destroy(void *ctx, vp_stream_t stream) {
  sim_ctx_t *c = ctx;
  sim_lock(c);
  uint32_t idx = 0;
  sim_stream_t *s = stream ? sim_stream_get(c, stream, &idx) : NULL;
  if (idx == 0) s = NULL; /* the default stream, however it is spelled */
  if (s) {
    sim_stream_stop(c, s);
    tab_free(&c->streams, idx); /* its tickets are complete from now */
    vp__os_cond_broadcast(&c->done_cv);
  }
  sim_unlock(c);
  return s ? VP_OK : VP_EINVAL;
}

/* Waits for everything queued so far, even when the device is broken or
 * the call is injected to fail: callers free memory after it. */
static int sim_stream_synchronize(void *ctx, vp_stream_t stream) {
  sim_ctx_t *c = ctx;
  sim_lock(c);
  uint32_t idx = 0;
  int rc = sim_stream_get(c, stream, &idx) ? VP_OK : VP_EINVAL;
  if (!rc) {
    bool fail = vp__inject_fail(c->inj);
    sim_wait_ticket(c, sim_ticket_now(c, idx));
    rc = c->broken || fail ? VP_EDEVICE : VP_OK;
  }
  sim_unlock(c);
  return rc;
}

/* Every live stream's work so far; waits even when failing, as a stream
 * synchronize does. */
static int sim_synchronize(void *ctx) {
  sim_ctx_t *c = ctx;
  sim_lock(c);
  bool fail = vp__inject_fail(c->inj);
  for (uint32_t i = 0; i < c->streams.n; i++) {
    sim_stream_t *s = c->streams.s[i].u.stream;
    if (s && !s->stop) sim_wait_ticket(c, sim_ticket_now(c, i));
  }
  int rc = c->broken || fail ? VP_EDEVICE : VP_OK;
  sim_unlock(c);
  return rc;
}

/* Sync mode: every recorded event is already complete, so nothing to do.
 * Worker mode: a marker op holds the stream until the ticket is done. */
static int sim_stream_wait_event(void *ctx, vp_stream_t stream,
                                 vp__event_t ev) {
  sim_ctx_t *c = ctx;
  sim_lock(c);
  sim_stream_t *s = sim_stream_get(c, stream, NULL);
  int64_t i = tab_find(&c->events, ev);
  int rc = sim_enter(c, VP_EDEVICE);
  if (!rc && (!s || i < 0)) rc = VP_EINVAL;
  if (!rc && !ticket_done(c, c->events.s[i].u.ev)) {
    sim_op_t *op = calloc(1, sizeof *op);
    if (!op) rc = VP_ENOMEM;
    else {
      op->kind = SIM_OP_WAIT;
      op->u.wait = c->events.s[i].u.ev;
      sim_enqueue(s, op);
    }
  }
  sim_unlock(c);
  return rc;
}

/* ------------------------------------------------------------- events */

static int sim_event_create(void *ctx, vp__event_t *ev) {
  sim_ctx_t *c = ctx;
  if (!ev) return VP_EINVAL;
  sim_lock(c);
  uint32_t idx = 0;
  int rc = sim_enter(c, VP_EDEVICE);
  if (!rc) rc = tab_alloc(&c->events, &idx);
  if (!rc) {
    c->events.s[idx].u.ev = (sim_ticket_t){0, 0, 0}; /* complete */
    *ev = tab_handle(&c->events, idx);
  }
  sim_unlock(c);
  return rc;
}

/* Pending waits hold a copy of the ticket, so an event may go any time. */
static int sim_event_destroy(void *ctx, vp__event_t ev) {
  sim_ctx_t *c = ctx;
  sim_lock(c);
  int64_t i = tab_find(&c->events, ev);
  if (i >= 0) tab_free(&c->events, (uint32_t)i);
  sim_unlock(c);
  return i >= 0 ? VP_OK : VP_EINVAL;
}

static int sim_event_record(void *ctx, vp__event_t ev, vp_stream_t stream) {
  sim_ctx_t *c = ctx;
  sim_lock(c);
  uint32_t idx = 0;
  sim_stream_t *s = sim_stream_get(c, stream, &idx);
  int64_t i = tab_find(&c->events, ev);
  int rc = sim_enter(c, VP_EDEVICE);
  if (!rc && (!s || i < 0)) rc = VP_EINVAL;
  if (!rc) c->events.s[i].u.ev = sim_ticket_now(c, idx);
  sim_unlock(c);
  return rc;
}

static int sim_event_query(void *ctx, vp__event_t ev) {
  sim_ctx_t *c = ctx;
  sim_lock(c);
  int64_t i = tab_find(&c->events, ev);
  int rc = sim_enter(c, VP_EDEVICE);
  if (!rc && i < 0) rc = VP_EINVAL;
  if (!rc && !ticket_done(c, c->events.s[i].u.ev)) rc = VP_EAGAIN;
  sim_unlock(c);
  return rc;
}

/* May run on several threads at once, outside the pager's lock, so it
 * leaves the injection countdown alone (the pager's allocations share it).
 * Waits even on a broken device, then says so. */
static int sim_event_synchronize(void *ctx, vp__event_t ev) {
  sim_ctx_t *c = ctx;
  sim_lock(c);
  int64_t i = tab_find(&c->events, ev);
  if (i >= 0) sim_wait_ticket(c, c->events.s[i].u.ev);
  int rc = i < 0 ? VP_EINVAL : c->broken ? VP_EDEVICE : VP_OK;
  sim_unlock(c);
  return rc;
}

/* ------------------------------------------------------ copies, launch */

/* Runs op in stream order: at once in sync mode, else on the worker.
 * Device range [va, va+size) must lie in a reserve: a bad address would
 * otherwise scribble over host memory. Called outside the pager's lock,
 * possibly from several threads, so no injection countdown here. */
static int sim_submit(sim_ctx_t *c, vp_stream_t stream, const sim_op_t *op,
                      uint64_t va, uint64_t size) {
  sim_op_t *q = c->worker ? malloc(sizeof *q) : NULL;
  if (c->worker && !q) return VP_ENOMEM;
  sim_lock(c);
  sim_stream_t *s = sim_stream_get(c, stream, NULL);
  int rc = c->broken ? VP_EDEVICE : VP_OK;
  /* A range in no reserve is memory another allocator made (a client's
   * tensor); on the simulated device all memory is host memory. One that
   * straddles a reserve's edge is a bad address, as on a GPU. */
  if (!rc && (!s || (size && !sim_reserve_of(c, va, size) &&
                     (va > UINT64_MAX - size ||
                      sim_touches_reserve(c, va, size)))))
    rc = VP_EINVAL;
  if (!rc && q) {
    *q = *op;
    sim_enqueue(s, q);
    q = NULL;
  }
  sim_unlock(c);
  free(q);
  if (!rc && !c->worker) sim_op_run(op);
  return rc;
}

static int sim_copy_htod(void *ctx, uint64_t dst, const void *src,
                         uint64_t size, vp_stream_t stream) {
  if (size && !src) return VP_EINVAL;
  if (size > SIZE_MAX) return VP_EINVAL;
  sim_op_t op = {.kind = SIM_OP_COPY};
  op.u.copy.dst = (void *)(uintptr_t)dst;
  op.u.copy.src = src;
  op.u.copy.n = (size_t)size;
  return sim_submit(ctx, stream, &op, dst, size);
}

/* As a GPU's copy by SMs: the same bytes in stream order, refused (the
 * caller copies as usual) where a GPU's would be: an address not 16-byte
 * aligned. */
static int sim_copy_htod_sm(void *ctx, uint64_t dst, const void *src,
                            uint64_t size, vp_stream_t stream,
                            uint32_t programs) {
  if (!programs || ((dst | (uint64_t)(uintptr_t)src) & 15))
    return VP_EUNSUPPORTED;
  return sim_copy_htod(ctx, dst, src, size, stream);
}

static int sim_copy_dtoh(void *ctx, void *dst, uint64_t src, uint64_t size,
                         vp_stream_t stream) {
  if (size && !dst) return VP_EINVAL;
  if (size > SIZE_MAX) return VP_EINVAL;
  sim_op_t op = {.kind = SIM_OP_COPY};
  op.u.copy.dst = dst;
  op.u.copy.src = (const void *)(uintptr_t)src;
  op.u.copy.n = (size_t)size;
  return sim_submit(ctx, stream, &op, src, size);
}

static int sim_launch(void *ctx, vp_stream_t stream, void (*fn)(void *),
                      void *arg) {
  if (!fn) return VP_EINVAL;
  sim_op_t op = {.kind = SIM_OP_LAUNCH};
  op.u.launch.fn = fn;
  op.u.launch.arg = arg;
  return sim_submit(ctx, stream, &op, 0, 0);
}

/* Host memory is already as good as pinned for the simulated device. */
static int sim_host_register(void *ctx, void *ptr, uint64_t size) {
  sim_ctx_t *c = ctx;
  if (!ptr || !size) return VP_EINVAL;
  sim_lock(c);
  int rc = sim_enter(c, VP_EDEVICE);
  sim_unlock(c);
  return rc;
}

static int sim_host_unregister(void *ctx, void *ptr) {
  (void)ctx;
  return ptr ? VP_OK : VP_EINVAL;
}

/* ----------------------------------------------------- fault injection */

/* The test's own control: not counted by the injection countdown and
 * still obeyed on a broken device. */
int vp__sim_soft_limit(void *ctx, uint64_t *bytes) {
  sim_ctx_t *c = ctx;
  sim_lock(c);
  *bytes = c->soft_limit;
  sim_unlock(c);
  return VP_OK;
}

static int sim_inject(void *ctx, int kind, uint64_t n) {
  sim_ctx_t *c = ctx;
  int rc = VP_OK;
  sim_lock(c);
  switch (kind) {
  case VP_SIM_FAIL_COMMIT: c->fail_commit = n; break;
  case VP_SIM_TRANSIENT: c->transient = n; break;
  case VP_SIM_SET_CAPACITY:
    if (c->shm) atomic_store(&c->shm->capacity, n);
    else c->capacity = n;
    break;
  case VP_SIM_BREAK: c->broken = true; break;
  case VP_SIM_SET_SOFT_LIMIT: c->soft_limit = n; break;
  case VP_SIM_SET_DESKTOP: rc = n <= 2 ? VP_OK : VP_EINVAL; break;
  case VP_SIM_MAP_APART: c->map_apart = n != 0; break;
  default: rc = VP_EINVAL;
  }
  sim_unlock(c);
  return rc;
}

const vp__backend_t vp__backend_sim = {
    .name = "sim",
    .open = sim_open,
    .close = sim_close,
    .mem_info = sim_mem_info,
    .va_reserve = sim_va_reserve,
    .va_free = sim_va_free,
    .phys_create = sim_phys_create,
    .phys_release = sim_phys_release,
    .map = sim_map,
    .unmap = sim_unmap,
    .set_access = sim_set_access,
    .stream_create = sim_stream_create,
    .stream_destroy = sim_stream_destroy,
    .stream_synchronize = sim_stream_synchronize,
    .synchronize = sim_synchronize,
    .stream_wait_event = sim_stream_wait_event,
    .event_create = sim_event_create,
    .event_destroy = sim_event_destroy,
    .event_record = sim_event_record,
    .event_query = sim_event_query,
    .event_synchronize = sim_event_synchronize,
    .copy_htod = sim_copy_htod,
    .copy_htod_sm = sim_copy_htod_sm,
    .copy_dtoh = sim_copy_dtoh,
    .host_register = sim_host_register,
    .host_unregister = sim_host_unregister,
    .launch = sim_launch,
    .inject = sim_inject,
};
