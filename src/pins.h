/* The pin ledger's segment (src/pins.c has what it is for): one per
 * machine, shared by every vpager process. Private to pins.c, and to
 * tests/fuzz/fuzz_ledger.c, which builds hostile ones.
 *
 * Layout, version PINS_VERSION (magic, version and size first):
 *   header  magic, version, size, serials, the machine's budget, the lock
 *           (os.h's robust lock)
 *   req[]   release requests: ledger.h's request state machine
 *   part[]  participants, one per device handle
 *
 * Who writes what: a participant's counts, only that participant,
 * without the lock (a take publishes its bytes in `taking`, sums every
 * live participant's pinned and taking, then moves them to `pinned` if
 * they fit: pins.c vp__pins_take); state and identity, only under the
 * lock (join, leave, reap); requests, by compare-and-swap on their
 * state; the budget, any participant (vp_device_set_pin_budget). Every field is atomic and every
 * index read from the segment is bounded before use. */
#ifndef VPAGER_PINS_H
#define VPAGER_PINS_H

#include "ledger.h"

#define PINS_MAGIC 0x736e697072657076ull /* "vprepins" */
#define PINS_VERSION 2u
#define PINS_PARTS 128
#define PINS_REQS 64
/* The layout's version is in the name: a build of another layout on the
 * host keeps a ledger of its own (refused at a name they shared, every
 * device of this build would count alone against a budget of its own). */
#define PINS_PREFIX "/vpager-pins-v2-"

typedef struct pins_part {
  _Atomic uint32_t state; /* PART_FREE / PART_LIVE, under the lock */
  _Atomic uint32_t wake;  /* bumped to wake its service thread */
  _Atomic int32_t pid;
  _Atomic uint32_t uid;
  lword_t start, pidns, serial;
  lword_t pinned;      /* bytes it page-locked: only it writes */
  lword_t taking;      /* bytes a take of its holds while it sums */
  lword_t releasable;  /* of those pinned, what it could give back */
  lword_t served, released;
} pins_part_t;

typedef struct pins_seg {
  lword_t magic; /* PINS_MAGIC, stored last at creation */
  _Atomic uint32_t version;
  _Atomic uint32_t unlinked; /* the name was removed: open it anew */
  lword_t size;
  lword_t serials;
  lword_t budget; /* the machine's budget, bytes */
  /* With pad, 104 bytes: version 1's pthread_mutex_t (40 bytes on x86-64
   * glibc, the first of these) and its pad[64], as in ledger.h. */
  vp__os_plock_shared_t lock;
  char pad[40];
  ledger_req_t req[PINS_REQS];
  pins_part_t part[PINS_PARTS];
} pins_seg_t;

#endif /* VPAGER_PINS_H */
