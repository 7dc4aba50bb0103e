/* A named shared-memory segment of one fixed layout, shared by processes
 * that each map it whole: the ledger (ledger.c) and the pin ledger
 * (pins.c). What they share lives here, once, over os.h's segments and
 * robust lock.
 *
 * A segment begins with its magic word (a uint64_t at offset 0), stored
 * last, with release order, by its creator: a joiner that sees it sees the
 * header the creator wrote before it (where the OS lets a joiner open a
 * segment before its creator is done). It holds a robust lock
 * (vp__os_plock_shared_t): a holder that dies leaves it to the next taker,
 * who is told so (and removes the dead holder's traces). */
#ifndef VPAGER_SHM_H
#define VPAGER_SHM_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "os.h"

typedef struct vp__shm_kind {
  size_t size;     /* the layout's sizeof: the file's size */
  size_t lock_off; /* offsetof its vp__os_plock_shared_t */
  uint64_t magic;  /* at offset 0, published last */
  /* The creator's header (version, size, ...), before the magic; arg is
   * vp__shm_create's. */
  void (*init)(void *seg, const char *shm, const void *arg);
  /* A joiner's check of the header once the magic is there (or the
   * creator's bounded wait ran out): VP_OK, else VP_EUNSUPPORTED and why. */
  int (*check)(void *seg, const char *shm, char *why, size_t len);
} vp__shm_kind_t;

/* Create `shm` exclusively: sized (a full /dev/shm fails here, not later
 * with SIGBUS), mapped, zeroed, the lock made, init, then the magic, all
 * before the name appears where the OS allows (vp__os_shm_create).
 * VP_EAGAIN: it exists; VP_EUNSUPPORTED and why: it cannot be made. */
int vp__shm_create(const char *shm, const vp__shm_kind_t *k, const void *arg,
                   void **out, char *why, size_t len);
/* Map an existing segment after checking its owner (when writable), its
 * size and, through k->check, its header. VP_ENODEV: it is not there. */
int vp__shm_join(const char *shm, const vp__shm_kind_t *k, bool writable,
                 void **out, char *why, size_t len);
/* Create it, else join it (read-write), as long as it keeps being made and
 * removed by others meanwhile (a bounded number of times). */
int vp__shm_attach(const char *shm, const vp__shm_kind_t *k, const void *arg,
                   void **out, char *why, size_t len);
void vp__shm_unmap(void *seg, const vp__shm_kind_t *k);
/* Remove the name (the last user out): a joiner after it creates anew. */
void vp__shm_remove(const char *shm);

/* The segment's robust lock, through this process's handle to it
 * (vp__os_plock_open). vp__shm_lock tries, then waits up to `ms`; with
 * `gen` (a word the holder bumps at every unlock), a lock that others took
 * and gave back meanwhile is busy, not stuck: it waits on, up to `busy_ms`
 * in all. *dead: its holder died; the lock is taken and made consistent,
 * and the caller removes the dead. VP_EAGAIN: it stayed taken; VP_EINVAL:
 * a lock word of another kind (never used: glibc may abort on one);
 * VP_EDEVICE: another failure. */
int vp__shm_lock(vp__os_plock_t *l, int ms, int busy_ms,
                 _Atomic uint64_t *gen, bool *dead);
void vp__shm_unlock(vp__os_plock_t *l, _Atomic uint64_t *gen);

#endif /* VPAGER_SHM_H */
