/* Named shared-memory segments and their robust lock (shm.h says what a
 * segment is; ledger.c and pins.c say what is in theirs). */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "shm.h"
#include "vpager.h"

#define ATTACH_TRIES 20
#define CREATOR_WAIT_MS 250 /* a creator between open and its magic */

static _Atomic uint64_t *magic_of(void *seg) { return seg; }

/* ------------------------------------------------------------ the lock */

/* Bounded, so a stopped holder costs a timeout, never a hang. */
int vp__shm_lock(vp__os_plock_t *l, int ms, int busy_ms,
                 _Atomic uint64_t *gen, bool *dead) {
  *dead = false;
  /* A try first: it is uncontended nearly always, and TSan follows a
   * trylock's EOWNERDEAD (not a timedlock's). */
  int r = vp__os_plock_lock(l, 0);
  for (int waited = 0; r == EBUSY || (r == ETIMEDOUT && waited < busy_ms);
       waited += ms) {
    uint64_t g = gen ? atomic_load(gen) : 0;
    r = vp__os_plock_lock(l, (uint32_t)ms);
    if (r == ETIMEDOUT && (!gen || atomic_load(gen) == g)) break;
  }
  if (r == EOWNERDEAD) { /* still held by us: the caller reaps under it */
    *dead = true;
    return VP_OK;
  }
  return r == 0            ? VP_OK
         : r == ETIMEDOUT  ? VP_EAGAIN
         : r == EINVAL     ? VP_EINVAL
                           : VP_EDEVICE;
}

void vp__shm_unlock(vp__os_plock_t *l, _Atomic uint64_t *gen) {
  if (gen) atomic_fetch_add(gen, 1);
  vp__os_plock_unlock(l);
}

/* --------------------------------------------------------- segments */

typedef struct make_arg {
  const vp__shm_kind_t *k;
  const char *shm;
  const void *arg;
} make_arg_t;

/* The lock, the creator's header, then the magic. */
static int make(void *seg, void *arg) {
  make_arg_t *m = arg;
  int e = vp__os_plock_init((vp__os_plock_shared_t *)(void *)(
      (char *)seg + m->k->lock_off));
  if (e) return e;
  m->k->init(seg, m->shm, m->arg);
  atomic_store_explicit(magic_of(seg), m->k->magic, memory_order_release);
  return 0;
}

int vp__shm_create(const char *shm, const vp__shm_kind_t *k, const void *arg,
                   void **out, char *why, size_t len) {
  make_arg_t m = {k, shm, arg};
  int e = vp__os_shm_create(shm, k->size, make, &m, out);
  if (e == EEXIST) return VP_EAGAIN;
  if (e) {
    snprintf(why, len, "cannot make %s: %s", shm, strerror(e));
    return VP_EUNSUPPORTED;
  }
  return VP_OK;
}

static int open_fail(char *why, size_t len, const char *shm, int e,
                     const vp__os_shm_info_t *info, size_t size) {
  if (e == ENOENT) return VP_ENODEV;
  if (e == EACCES)
    snprintf(why, len, "%s belongs to another user and is not open to us",
             shm);
  else if (e == EPERM)
    snprintf(why, len, "%s belongs to uid %u, not to us (uid %u)", shm,
             (unsigned)info->owner, (unsigned)vp__os_uid());
  else if (e == EMSGSIZE)
    snprintf(why, len, "%s is %llu bytes, not %zu: truncated, or another "
             "layout version", shm, (unsigned long long)info->size, size);
  else
    snprintf(why, len, "cannot open %s: %s", shm, strerror(e));
  return VP_EUNSUPPORTED;
}

int vp__shm_join(const char *shm, const vp__shm_kind_t *k, bool writable,
                 void **out, char *why, size_t len) {
  void *p = NULL;
  vp__os_shm_info_t info = {0, 0};
  int e = vp__os_shm_open(shm, writable, k->size, &p, &info);
  if (e) return open_fail(why, len, shm, e, &info, k->size);
  /* A creator that could not hide its segment until done (an older build,
   * or an OS without link) may not have published it yet. */
  /* (By the clock: a 1 ms sleep may last a 15.6 ms timer tick.) */
  uint64_t until = vp__os_now_ns() + CREATOR_WAIT_MS * 1000000ull;
  while (!atomic_load_explicit(magic_of(p), memory_order_acquire) &&
         vp__os_now_ns() < until)
    vp__os_sleep_ns(1000000);
  int rc = k->check(p, shm, why, len);
  if (rc) vp__os_shm_unmap(p, k->size);
  else *out = p;
  return rc;
}

int vp__shm_attach(const char *shm, const vp__shm_kind_t *k, const void *arg,
                   void **out, char *why, size_t len) {
  for (int tries = 0; tries < ATTACH_TRIES; tries++) {
    int rc = vp__shm_create(shm, k, arg, out, why, len);
    if (rc != VP_EAGAIN) return rc;
    rc = vp__shm_join(shm, k, true, out, why, len);
    if (rc != VP_ENODEV) return rc; /* ENODEV: it went away meanwhile */
  }
  snprintf(why, len, "%s kept appearing and vanishing", shm);
  return VP_EUNSUPPORTED;
}

void vp__shm_unmap(void *seg, const vp__shm_kind_t *k) {
  vp__os_shm_unmap(seg, k->size);
}

void vp__shm_remove(const char *shm) { vp__os_shm_unlink(shm); }
