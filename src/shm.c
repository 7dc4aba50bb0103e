/* Named POSIX shared-memory segments and their robust lock (shm.h says
 * what a segment is; ledger.c and pins.c say what is in theirs). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "shm.h"
#include "vpager.h"

#define ATTACH_TRIES 20
#define CREATOR_WAIT_MS 250 /* a creator between open and its magic */

static void nap_ms(long ms) {
  struct timespec ts = {0, ms * 1000000L};
  nanosleep(&ts, NULL);
}

static _Atomic uint64_t *magic_of(void *seg) { return seg; }

static pthread_mutex_t *lock_of(void *seg, const vp__shm_kind_t *k) {
  return (pthread_mutex_t *)((char *)seg + k->lock_off);
}

/* ------------------------------------------------------------ the lock */

int vp__shm_lock_init(pthread_mutex_t *m) {
  pthread_mutexattr_t a;
  if (pthread_mutexattr_init(&a)) return -1;
  int r = pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
  if (!r) r = pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
  if (!r) r = pthread_mutex_init(m, &a);
  pthread_mutexattr_destroy(&a);
  return r;
}

/* Whether the lock word's kind (glibc: type, robust, shared and protocol
 * bits) is the one vp__shm_lock_init makes. Another (a priority protocol
 * with a bogus ceiling, in a corrupt segment) has glibc abort the process
 * inside pthread_mutex_trylock, so such a lock is never used. Not checked
 * with other C libraries. */
static bool lock_kind_ok(pthread_mutex_t *m) {
#ifdef __GLIBC__
  static _Atomic int want; /* 0 until made once */
  int k = atomic_load_explicit(&want, memory_order_relaxed);
  if (!k) {
    pthread_mutex_t made;
    if (vp__shm_lock_init(&made)) return true; /* cannot tell */
    k = made.__data.__kind;
    pthread_mutex_destroy(&made);
    atomic_store_explicit(&want, k, memory_order_relaxed);
  }
  return __atomic_load_n(&m->__data.__kind, __ATOMIC_RELAXED) == k;
#else
  (void)m;
  return true;
#endif
}

/* Bounded, so a stopped holder costs a timeout, never a hang. */
int vp__shm_lock(pthread_mutex_t *m, int ms, int busy_ms,
                 _Atomic uint64_t *gen, bool *dead) {
  *dead = false;
  if (!lock_kind_ok(m)) return VP_EINVAL;
  /* trylock first: it is uncontended nearly always, and TSan follows a
   * trylock's EOWNERDEAD (not a timedlock's). */
  int r = pthread_mutex_trylock(m);
  for (int waited = 0; r == EBUSY || (r == ETIMEDOUT && waited < busy_ms);
       waited += ms) {
    uint64_t g = gen ? atomic_load(gen) : 0;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += (ms % 1000) * 1000000L;
    ts.tv_sec += ms / 1000 + ts.tv_nsec / 1000000000L;
    ts.tv_nsec %= 1000000000L;
    r = pthread_mutex_timedlock(m, &ts);
    if (r == ETIMEDOUT && (!gen || atomic_load(gen) == g)) break;
  }
  if (r == EOWNERDEAD) {
    /* Still held by us: the caller reaps under it. */
    pthread_mutex_consistent(m);
    *dead = true;
    return VP_OK;
  }
  return r == 0 ? VP_OK : r == ETIMEDOUT ? VP_EAGAIN : VP_EDEVICE;
}

void vp__shm_unlock(pthread_mutex_t *m, _Atomic uint64_t *gen) {
  if (gen) atomic_fetch_add(gen, 1);
  pthread_mutex_unlock(m);
}

/* --------------------------------------------------------- segments */

int vp__shm_create(const char *shm, const vp__shm_kind_t *k, const void *arg,
                   void **out, char *why, size_t len) {
  int fd = shm_open(shm, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    if (errno == EEXIST) return VP_EAGAIN;
    snprintf(why, len, "cannot create %s: %s", shm, strerror(errno));
    return VP_EUNSUPPORTED;
  }
  /* posix_fallocate, not ftruncate: a full /dev/shm fails here, not with
   * SIGBUS at a later touch. */
  int e = posix_fallocate(fd, 0, (off_t)k->size);
  void *p = e ? MAP_FAILED : mmap(NULL, k->size, PROT_READ | PROT_WRITE,
                                  MAP_SHARED, fd, 0);
  if (!e && p == MAP_FAILED) e = errno;
  close(fd);
  if (!e && vp__shm_lock_init(lock_of(p, k))) e = ENOMEM;
  if (e) {
    if (p != MAP_FAILED) munmap(p, k->size);
    shm_unlink(shm);
    snprintf(why, len, "cannot make %s: %s", shm, strerror(e));
    return VP_EUNSUPPORTED;
  }
  k->init(p, shm, arg);
  atomic_store_explicit(magic_of(p), k->magic, memory_order_release);
  *out = p;
  return VP_OK;
}

/* The file's size once its creator has sized it (it may be racing us). */
static int wait_sized(int fd, off_t *size) {
  struct stat st;
  for (int i = 0; i < CREATOR_WAIT_MS; i++, nap_ms(1)) {
    if (fstat(fd, &st)) return errno;
    if (st.st_size != 0) break;
  }
  *size = st.st_size;
  return 0;
}

static int open_fail(char *why, size_t len, const char *shm, int e) {
  if (e == ENOENT) return VP_ENODEV;
  if (e == EACCES)
    snprintf(why, len, "%s belongs to another user and is not open to us",
             shm);
  else
    snprintf(why, len, "cannot open %s: %s", shm, strerror(e));
  return VP_EUNSUPPORTED;
}

int vp__shm_join(const char *shm, const vp__shm_kind_t *k, bool writable,
                 void **out, char *why, size_t len) {
  int fd = shm_open(shm, (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC, 0);
  if (fd < 0) return open_fail(why, len, shm, errno);
  struct stat st;
  off_t size = 0;
  int e = fstat(fd, &st) ? errno : wait_sized(fd, &size);
  void *p = MAP_FAILED;
  if (e) {
    snprintf(why, len, "cannot stat %s: %s", shm, strerror(e));
  } else if (writable && st.st_uid != geteuid()) {
    snprintf(why, len, "%s belongs to uid %u, not to us (uid %u)", shm,
             (unsigned)st.st_uid, (unsigned)geteuid());
  } else if (size != (off_t)k->size) {
    snprintf(why, len, "%s is %lld bytes, not %zu: truncated, or another "
             "layout version", shm, (long long)size, k->size);
  } else {
    p = mmap(NULL, k->size, PROT_READ | (writable ? PROT_WRITE : 0),
             MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
      snprintf(why, len, "cannot map %s: %s", shm, strerror(errno));
  }
  close(fd);
  if (p == MAP_FAILED) return VP_EUNSUPPORTED;
  /* A creator that sized the file may not have published it yet. */
  for (int i = 0; i < CREATOR_WAIT_MS; i++, nap_ms(1))
    if (atomic_load_explicit(magic_of(p), memory_order_acquire)) break;
  int rc = k->check(p, shm, why, len);
  if (rc) munmap(p, k->size);
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
  munmap(seg, k->size);
}

void vp__shm_remove(const char *shm) { shm_unlink(shm); }
