/* The ledger segment: one per physical device, shared by every process
 * that uses the device. Private to ledger.c (joining, leaving, reaping,
 * publishing), release.c (release requests and the service thread) and
 * ledger_view.c (the JSON snapshot).
 *
 * Layout, version LEDGER_VERSION (magic, version and size stay at offsets
 * 0, 8 and 16 in every version, so any version can tell another apart):
 *   header  magic, version, size, the membership lock (os.h's robust
 *           lock), device memory as last measured, name
 *   req[]   release requests, each a small state machine on a word that
 *           its waiters sleep on (vp__os_word_wait)
 *   part[]  participants, one per device handle, each with its VBARs
 *
 * Who writes what:
 *   - a participant's counters and VBAR entries: only that participant,
 *     under its own device lock; readers take them lock-free (a sequence
 *     number per entry makes an entry's words one snapshot);
 *   - a participant's state and identity: only under the membership lock
 *     (join, leave, reap);
 *   - requests: by compare-and-swap on their state.
 * Every field is atomic, so nobody (another process, `vpager top`, a
 * hostile segment) sees a torn word, and every index read from the segment
 * is bounded before use. */
#ifndef VPAGER_LEDGER_H
#define VPAGER_LEDGER_H

#include "internal.h"

#define LEDGER_MAGIC 0x72656764656c7076ull /* "vpledger" */
#define LEDGER_VERSION 3u /* 2: external_floor, lock_gen; 3: headroom */
#define LEDGER_PARTS 64   /* device handles per GPU */
#define LEDGER_VBARS 128  /* published VBARs per participant */
#define LEDGER_REQS 64    /* release requests in flight per GPU */
#define LEDGER_WORDS(bytes) ((bytes) / 8)
/* The layout version in the name, in step with LEDGER_VERSION: a segment
 * an older build left behind (its last process killed) never keeps this
 * build's devices apart; builds of two layouts each share their own. */
#define LEDGER_PREFIX "/vpager-ledger-v3-"
#define LEDGER_LOCK_MS 500   /* longest wait for a membership lock that
                                nobody else takes meanwhile (stuck) */
#define LEDGER_LOCK_BUSY_MS 10000 /* longest wait for one others take */
#define LEDGER_SKIP_NS 1000000000ull /* a peer that timed out is skipped */
#define LEDGER_TIMEOUT_US 50000u     /* default wait per peer */
#define LEDGER_HEADROOM_NS 100000000ull /* the peers' headroom: reread */

typedef _Atomic uint64_t lword_t;

enum { PART_FREE = 0, PART_LIVE = 1 };
enum { REQ_FREE = 0, REQ_CLAIMED, REQ_POSTED, REQ_TAKEN, REQ_DONE,
       REQ_ABANDONED };

typedef struct ledger_vbar {
  _Atomic uint32_t seq;  /* odd while its participant writes the entry */
  _Atomic uint32_t rank; /* place in its process's priority list, 0 = top */
  lword_t id;            /* the VBAR's handle id; 0 = a free entry */
  lword_t size, resident, pinned, reclaimable; /* bytes */
  lword_t last_use;      /* CLOCK_MONOTONIC_COARSE ns */
  lword_t hits, misses;
  lword_t label[LEDGER_WORDS(VP_LABEL_MAX)]; /* NUL-padded */
} ledger_vbar_t;

typedef struct ledger_part {
  _Atomic uint32_t state; /* PART_*, under the lock */
  _Atomic uint32_t wake;  /* bumped to wake its service thread */
  _Atomic int32_t pid;
  _Atomic uint32_t uid;
  lword_t start;          /* its start time (vp__os_proc_self); 0 unknown */
  lword_t pidns;          /* its pid namespace (vp__os_proc_self) */
  lword_t serial;         /* new at every join: a respawn is a new one */
  lword_t joined;         /* CLOCK_MONOTONIC_COARSE ns */
  lword_t committed, external_reserved, page_size;
  lword_t external_floor; /* what the framework keeps at least (warmed up) */
  lword_t served, released; /* requests answered, bytes they freed */
  lword_t reclaimable;    /* the sum over its entries: a quick "anything?" */
  lword_t headroom;       /* bytes it asks every participant to keep free */
  lword_t command[LEDGER_WORDS(64)];
  ledger_vbar_t vbar[LEDGER_VBARS];
} ledger_part_t;

typedef struct ledger_req {
  _Atomic uint32_t state; /* REQ_*; the word the requester waits on */
  _Atomic uint32_t from, to;   /* participant slots */
  lword_t from_serial, to_serial;
  lword_t bytes;   /* asked for */
  lword_t before;  /* evict only VBARs last used no later than this */
  lword_t freed;   /* the answer */
  lword_t posted;  /* CLOCK_MONOTONIC_COARSE ns */
} ledger_req_t;

typedef struct ledger_seg {
  lword_t magic;   /* LEDGER_MAGIC, stored last at creation */
  _Atomic uint32_t version;
  _Atomic uint32_t unlinked; /* the name was removed: open it anew */
  lword_t size;    /* sizeof(ledger_seg_t) */
  lword_t serials; /* the last participant serial given */
  lword_t lock_gen; /* bumped at every unlock: a busy lock, not a stuck one */
  lword_t total, free, measured; /* device memory, and when (coarse ns) */
  lword_t name[LEDGER_WORDS(80)];
  /* Membership: join, leave, reap. With pad, 104 bytes: version 3's
   * pthread_mutex_t (40 bytes on x86-64 glibc, the first of these) and
   * its pad[64], so the layout there is the same as before. */
  vp__os_plock_shared_t lock;
  char pad[40];
  ledger_req_t req[LEDGER_REQS];
  ledger_part_t part[LEDGER_PARTS];
} ledger_seg_t;

/* A device's membership (process-local). */
typedef struct vp__ledger {
  ledger_seg_t *seg;
  vp__device_t *dev;
  int part;           /* our participant slot */
  uint64_t serial;    /* our serial */
  int32_t pid;        /* the process that joined; a forked child is not it */
  char name[80];      /* the ledger's name ("GPU-...", "sim-...") */
  char shm[112];      /* LEDGER_PREFIX name */
  vp__os_plock_t lock; /* our handle to seg->lock */
  uint64_t timeout_ns;
  bool warned_full;   /* more VBARs than entries, said once */
  uint64_t free_published; /* device free memory we last published */
  uint64_t headroom_read;  /* when we last read the peers' headroom (coarse) */
  uint32_t entries;   /* of our part's entries in use */
  /* release.c */
  vp__os_thread_t thread;
  bool thread_started;
  atomic_bool stop;
  vp__os_mutex_t skip_mu; /* guards skip[] (requesting threads share it) */
  struct { uint64_t serial, until; } skip[LEDGER_PARTS];
} vp__ledger_t;

/* ledger.c */
int vp__lseg_map(const char *shm, bool writable, ledger_seg_t **out,
                 char *why, size_t len);
void vp__lseg_unmap(ledger_seg_t *seg);
/* The membership lock of l's segment. VP_EAGAIN after LEDGER_LOCK_MS;
 * VP_EDEVICE: a lock word it cannot use. */
int vp__lseg_lock(vp__ledger_t *l);
void vp__lseg_unlock(vp__ledger_t *l);
void vp__lseg_reap(ledger_seg_t *seg); /* lock held */
bool vp__lpart_alive(const ledger_part_t *p);
bool vp__lpart_ours(const ledger_part_t *p, int32_t pid);
/* Whether participant `slot` is live with that serial (not left, reaped or
 * replaced). */
bool vp__lslot_live(const ledger_seg_t *seg, uint32_t slot, uint64_t serial);
/* Answer a request its holder took (REQ_TAKEN): `freed` bytes, then DONE;
 * if the requester gave up meanwhile (ABANDONED), the slot is freed. r
 * lies in segment `shm`, mapped here at `seg`: its waiter is woken. */
void vp__lreq_answer(const char *shm, const void *seg, ledger_req_t *r,
                     uint64_t freed);
/* Device memory as a participant measured it, for everyone to see. */
void vp__ledger_put_memory(vp__ledger_t *l, uint64_t free_bytes,
                           uint64_t total);
/* One entry read lock-free: false when it is free or kept changing. */
typedef struct ledger_vbar_view {
  uint64_t id, size, resident, pinned, reclaimable, last_use, hits, misses;
  uint32_t rank;
  char label[VP_LABEL_MAX];
} ledger_vbar_view_t;
bool vp__lvbar_read(const ledger_vbar_t *e, ledger_vbar_view_t *v);
/* Text words to a string: printable ASCII kept, the rest '?'. */
void vp__ltext_get(const lword_t *w, size_t nwords, char *out);

#endif /* VPAGER_LEDGER_H */
