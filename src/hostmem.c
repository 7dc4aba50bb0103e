/* Host memory: page-locking within a per-device pin budget, internal
 * bounce buffers, and the public host buffers (vp_hostbuf_*).
 *
 * Pinned memory copies to the device at full link speed, pageable memory at
 * a fraction of it, but page-locked memory cannot be reclaimed by the OS: the
 * budget keeps a large model from taking the whole machine. When pinning is
 * refused (budget spent, backend cannot, driver error) the memory simply
 * stays pageable: copies are correct, only slower, and the bytes are counted
 * in stats.pin_fallback_bytes. It is never an error.
 *
 * Registration costs ~41 ms/GiB (and unregistration ~19 ms/GiB, see
 * shared/FACTS.md), so the public calls drop the device lock around it: a
 * model loading beside one that serves does not stall the other's faults.
 * The host buffer is marked busy meanwhile (VP_EBUSY for grow and free).
 *
 * A grow pins only its new part, as a chunk of its own. CUDA refuses a copy
 * whose host range spans two registrations (or registered and pageable
 * memory), so host<->device copies go through vp__copy_htod/dtoh, which
 * split them at chunk edges. */
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define ULL(x) ((unsigned long long)(x))
#define GiB (1ull << 30)
#define MiB (1ull << 20)

/* A range registered (or not) as one piece: each must be unregistered by
 * its own base pointer, so growth adds chunks instead of re-registering. */
typedef struct hb_chunk {
  uint8_t *ptr;
  uint64_t size;
  bool pinned;
} hb_chunk_t;

typedef struct hostbuf {
  uint64_t id; /* first: handle tables find objects by their id */
  vp__device_t *dev;
  uint8_t *ptr;
  uint64_t size;      /* usable bytes */
  uint64_t max_size;  /* bytes it may grow to */
  uint64_t committed; /* readable and writable bytes from ptr (whole pages) */
  uint64_t reserved;  /* bytes of address space we mapped; 0: caller's memory */
  hb_chunk_t *chunks;
  uint32_t nchunks, cap;
  bool busy; /* a registration runs with the device lock dropped */
} hostbuf_t;

/* Round up to whole host pages; 0 when that would overflow. */
static uint64_t page_round(uint64_t n) {
  uint64_t pg = vp__os_page_size();
  if (n > UINT64_MAX - (pg - 1)) return 0;
  return (n + pg - 1) & ~(pg - 1);
}

/* ------------------------------------------------------------ budget */

static uint64_t give_back(vp__device_t *dev, uint64_t bytes);

/* Called from device create, before the device is in the registry. The
 * budget becomes the machine's (pins.c) if the device joins the pin
 * ledger (vp__hostmem_share). */
void vp__hostmem_init(vp__device_t *dev) {
  dev->pin_budget = dev->opts.pin_budget ? dev->opts.pin_budget
                                         : vp__pins_default_budget();
  dev->pinned_host = 0;
}

/* Join the machine's pin ledger once the device is open (its service
 * thread may call give_back from then on). */
void vp__hostmem_share(vp__device_t *dev) {
  vp__pins_open(dev, give_back);
  vp__log(VP_LOG_DEBUG, dev->caps.name, "pin budget %llu MiB%s",
          ULL(vp__pins_budget(dev) / MiB),
          dev->pins ? " (the machine's)" : " (this device's)");
}

/* Count bytes left pageable; the first time on this device, say why (once:
 * a load may fall back for thousands of buffers). */
static void fallback(vp__device_t *dev, uint64_t size, const char *fmt, ...)
    VP__PRINTF(3, 4);
static void fallback(vp__device_t *dev, uint64_t size, const char *fmt, ...) {
  if (dev->stats.pin_fallback_bytes == 0 && vp__log_on(VP_LOG_INFO)) {
    char why[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    vp__log(VP_LOG_INFO, dev->caps.name,
            "host memory stays pageable (slower copies to the device): %s; "
            "later cases are only counted in stats.pin_fallback_bytes", why);
  }
  dev->stats.pin_fallback_bytes += size;
}

/* Device lock held. Take size bytes of the budget (the machine's, or this
 * device's alone) for a registration about to be tried; false when it is
 * spent, counted as a fallback unless `quiet` (the caller asks others to
 * give some back first and tries again). */
static bool pin_reserve(vp__device_t *dev, uint64_t size, bool quiet) {
  uint64_t budget = dev->pin_budget, used = dev->pinned_host;
  bool ok = dev->pins ? vp__pins_take(dev, size, &budget, &used)
                      : size <= budget && used <= budget - size;
  if (ok) {
    dev->pinned_host += size;
    return true;
  }
  if (quiet) return false;
  if (used == UINT64_MAX)
    fallback(dev, size, "this is a forked child's copy of the device: "
             "it pins nothing in the parent's name");
  else
    fallback(dev, size, "the %spin budget of %llu MiB is spent (%llu MiB "
             "pinned, %llu bytes more asked)", dev->pins ? "machine's " : "",
             ULL(budget / MiB), ULL(used / MiB), ULL(size));
  return false;
}

/* Device lock held. Account the outcome rc of a reserved registration;
 * true when the memory is pinned. */
static bool pin_finish(vp__device_t *dev, uint64_t size, int rc) {
  if (rc == VP_OK) {
    dev->stats.host_pinned_bytes += size;
    return true;
  }
  dev->pinned_host -= size; /* give the reservation back */
  vp__pins_put(dev, size);
  const char *detail = vp__be_error_detail(dev);
  fallback(dev, size, "page-locking %llu bytes failed: %s%s%s", ULL(size),
           vp_err_name(rc), *detail ? ", " : "", detail);
  return false;
}

/* Device lock held. */
void vp__pin_host(vp__device_t *dev, void *ptr, uint64_t size, bool *pinned) {
  *pinned = false;
  if (!ptr || !size || !pin_reserve(dev, size, false)) return;
  *pinned = pin_finish(dev, size, vp__be_host_register(dev, ptr, size));
}

/* The bookkeeping half of unpinning (device lock held). stats.host_pinned_bytes
 * is a "now" value, so it goes down too. */
static void unpin_account(vp__device_t *dev, uint64_t size) {
  dev->pinned_host -= size;
  vp__pins_put(dev, size);
  dev->stats.host_pinned_bytes -= size;
}

/* Device lock held; ptr and size as pinned. An unregister failure leaves
 * nothing to do: the memory is unmapped or handed back next anyway. */
void vp__unpin_host(vp__device_t *dev, void *ptr, uint64_t size) {
  vp__be_host_unregister(dev, ptr);
  unpin_account(dev, size);
}

/* ------------------------------------------------- internal allocations */

/* Page-aligned, zeroed memory for bounce buffers (device lock held). */
int vp__host_alloc(vp__device_t *dev, uint64_t size, void **ptr, bool *pinned) {
  uint64_t len = page_round(size);
  if (!len) return vp__err(VP_EINVAL, "host buffer of %llu bytes", ULL(size));
  void *p = NULL;
  if (len > SIZE_MAX || vp__inject_fail(&dev->inject) ||
      vp__os_vm_alloc((size_t)len, &p))
    return vp__err(VP_ENOMEM, "no host memory for a %llu-byte buffer",
                   ULL(size));
  vp__pin_host(dev, p, len, pinned);
  *ptr = p;
  return VP_OK;
}

void vp__host_free(vp__device_t *dev, void *ptr, uint64_t size, bool pinned) {
  if (!ptr) return;
  uint64_t len = page_round(size);
  if (pinned) vp__unpin_host(dev, ptr, len);
  vp__os_vm_free(ptr, (size_t)len);
}

/* --------------------------------------------------------- host buffers */

/* Look up a host buffer and lock its device. */
static int hb_lock(vp_hostbuf_t h, hostbuf_t **out) {
  vp__device_t *dev;
  return vp__handle_lock(h.id, offsetof(vp__device_t, hostbufs),
                         "host buffer", &dev, (void **)out);
}

/* Room for one more chunk (device lock held). */
static int chunk_room(vp__device_t *dev, hostbuf_t *hb) {
  if (hb->nchunks < hb->cap) return VP_OK;
  uint32_t cap = hb->cap ? hb->cap * 2 : 4;
  hb_chunk_t *grown = NULL;
  if (vp__inject_fail(&dev->inject) ||
      !(grown = realloc(hb->chunks, cap * sizeof *grown)))
    return vp__err(VP_ENOMEM, "no memory for %u chunk records", cap);
  hb->chunks = grown;
  hb->cap = cap;
  return VP_OK;
}

/* A new, empty host buffer in the table, busy until its memory is pinned
 * (device lock held). */
static int hb_new(vp__device_t *dev, hostbuf_t **out) {
  hostbuf_t *hb = NULL;
  if (vp__inject_fail(&dev->inject) || !(hb = calloc(1, sizeof *hb)))
    return vp__err(VP_ENOMEM, "no memory for a host buffer");
  hb->dev = dev;
  hb->busy = true;
  int rc = chunk_room(dev, hb);
  if (!rc) rc = vp__table_add(dev, &dev->hostbufs, hb, &hb->id);
  if (rc) {
    free(hb->chunks);
    free(hb);
    return rc;
  }
  *out = hb;
  return VP_OK;
}

/* Unregister and unmap hb's memory; returns the bytes that were pinned, for
 * the caller to account under the device lock. Needs no lock. */
static uint64_t hb_release_memory(vp__device_t *dev, hostbuf_t *hb) {
  uint64_t pinned = 0;
  for (uint32_t i = 0; i < hb->nchunks; i++) {
    if (!hb->chunks[i].pinned) continue;
    vp__be_host_unregister(dev, hb->chunks[i].ptr);
    pinned += hb->chunks[i].size;
  }
  if (hb->reserved) vp__os_vm_release(hb->ptr, (size_t)hb->reserved);
  return pinned;
}

static void hb_delete(hostbuf_t *hb) {
  free(hb->chunks);
  free(hb);
}

/* Undo hb_new and whatever memory it got (device lock held; nothing of it
 * is pinned yet). */
static void hb_abandon(vp__device_t *dev, hostbuf_t *hb) {
  vp__table_remove(&dev->hostbufs, hb->id);
  hb_release_memory(dev, hb);
  hb_delete(hb);
}

#define HUGE_ALIGN (2 * MiB) /* a transparent huge page on x86-64, arm64 */

/* Reserve `max` bytes of address space: no memory, no commit charge. A
 * reservation of a huge page or more starts on a huge-page boundary and asks
 * for transparent huge pages: faulting in and page-locking 2 MiB at a time
 * instead of 4 KiB is what a model's host copy costs at load. */
static int hb_reserve(vp__device_t *dev, hostbuf_t *hb, uint64_t max) {
  uint64_t len = page_round(max);
  uint64_t slack = len >= HUGE_ALIGN ? HUGE_ALIGN : 0;
  void *p = NULL;
  if (!len || len > SIZE_MAX - slack || vp__inject_fail(&dev->inject) ||
      vp__os_vm_reserve((size_t)len, (size_t)slack, &p))
    return vp__err(VP_ENOMEM, "cannot reserve %llu bytes of address space",
                   ULL(max));
  if (slack) vp__os_vm_hint_huge(p, (size_t)len);
  hb->ptr = p;
  hb->reserved = len;
  hb->max_size = max;
  return VP_OK;
}

/* Make the pages up to `size` usable (zero-filled) as a new unpinned chunk,
 * if any page is new (device lock held; room for the chunk made). */
static int hb_commit(vp__device_t *dev, hostbuf_t *hb, uint64_t size) {
  uint64_t end = page_round(size);
  if (end <= hb->committed) return VP_OK;
  uint8_t *p = hb->ptr + hb->committed;
  uint64_t len = end - hb->committed;
  if (vp__inject_fail(&dev->inject) || vp__os_vm_commit(p, (size_t)len))
    return vp__err(VP_ENOMEM, "cannot commit %llu bytes of host memory",
                   ULL(len));
  hb->chunks[hb->nchunks++] = (hb_chunk_t){p, len, false};
  hb->committed = end;
  return VP_OK;
}

/* ---------------------------------------------- faulting pages in first */

#define PREFAULT_MIN ((uint64_t)256 << 20) /* per thread, at least */
#define PREFAULT_THREADS 8

typedef struct {
  uint8_t *p;
  uint64_t len;
} span_t;

static void *prefault_span(void *arg) {
  span_t *s = arg;
  (void)vp__os_vm_populate(s->p, (size_t)s->len); /* a hint here */
  return NULL;
}

/* Fault in [p, p+len) of our own zeroed memory over a few threads before
 * it is registered: registering untouched memory faults it in on one
 * thread (~550 ms/GiB in a VM, FACTS.md), touched memory registers at
 * ~41 ms/GiB. Never for the caller's memory (the fallback writes). */
static void prefault(uint8_t *p, uint64_t len) {
  uint64_t n = len / PREFAULT_MIN, cpus = vp__os_cpu_count();
  if (n > PREFAULT_THREADS) n = PREFAULT_THREADS;
  if (n > cpus) n = cpus;
  if (n < 2) return; /* the registration does it as fast */
  span_t s[PREFAULT_THREADS];
  vp__os_thread_t t[PREFAULT_THREADS];
  bool started[PREFAULT_THREADS] = {false};
  uint64_t step = (len / n + 4095) & ~(uint64_t)4095;
  for (uint64_t i = 0; i < n; i++) {
    uint64_t at = i * step, end = at + step < len ? at + step : len;
    s[i] = (span_t){p + at, end > at ? end - at : 0};
    started[i] = i > 0 && s[i].len &&
                 vp__os_thread_start(&t[i], prefault_span, &s[i], 0) == 0;
  }
  for (uint64_t i = 0; i < n; i++) /* this thread: the first and any */
    if (!started[i] && s[i].len) prefault_span(&s[i]); /* not started */
  for (uint64_t i = 0; i < n; i++)
    if (started[i]) vp__os_thread_join(&t[i]);
}

/* Pin chunk i, dropping the device lock around the registration (and the
 * faulting in, for our own memory: `ours`), and around asking other
 * processes to give pinned memory back when the machine's budget is spent.
 * hb is busy, so no other call frees it or moves its chunk array
 * meanwhile. */
static void pin_chunk(vp__device_t *dev, hostbuf_t *hb, uint32_t i,
                      bool ours) {
  hb_chunk_t c = hb->chunks[i];
  bool ask = dev->pins && vp__pins_may_help(dev);
  if (!pin_reserve(dev, c.size, ask)) {
    if (!ask) return;
    vp__os_mutex_unlock(&dev->lock);
    vp__pins_ask(dev, c.size);
    vp__os_mutex_lock(&dev->lock);
    if (!pin_reserve(dev, c.size, false)) return;
  }
  vp__os_mutex_unlock(&dev->lock);
  if (ours) prefault(c.ptr, c.size);
  int rc = vp__be_host_register(dev, c.ptr, c.size);
  vp__os_mutex_lock(&dev->lock);
  hb->chunks[i].pinned = pin_finish(dev, c.size, rc);
  if (hb->chunks[i].pinned) vp__pins_releasable(dev, (int64_t)c.size);
}

/* A pin ledger's request (pins.c's service thread, no lock held): make
 * pinned chunks of host buffers pageable until `bytes` are given back.
 * Their bytes stay where they are, so copies from them stay correct, only
 * slower. Busy buffers (a registration in flight) are skipped. Under the
 * device lock, after all work queued on the device finished (on CUDA the
 * context's: torch's streams too, which copy from a drop-in HostBuffer):
 * no copy of ours reads a chunk while it is unregistered (stream.c copies
 * under the lock; a public copy enqueued without it, vp_copy_to_device,
 * counts itself in copies_unlocked from choosing its piece to having
 * enqueued it: then nothing is given back, as that copy could come after
 * the synchronize and read a chunk being unregistered). */
static uint64_t give_back(vp__device_t *dev, uint64_t bytes) {
  uint64_t freed = 0;
  bool synced = false;
  vp__os_mutex_lock(&dev->lock);
  if (dev->copies_unlocked) bytes = 0;
  for (uint32_t s = 0; s < dev->hostbufs.n && freed < bytes; s++) {
    hostbuf_t *hb = dev->hostbufs.slots[s];
    if (!hb || hb->busy || dev->broken) continue;
    for (uint32_t i = 0; i < hb->nchunks && freed < bytes; i++) {
      hb_chunk_t *c = &hb->chunks[i];
      if (!c->pinned) continue;
      if (!synced) { /* every stream's copies, the framework's too */
        vp__be_synchronize(dev);
        synced = true;
      }
      vp__be_host_unregister(dev, c->ptr);
      c->pinned = false;
      unpin_account(dev, c->size);
      dev->stats.pin_fallback_bytes += c->size;
      freed += c->size;
    }
  }
  vp__pins_releasable(dev, -(int64_t)freed);
  if (freed)
    vp__log(VP_LOG_INFO, dev->caps.name, "gave %s of pinned host memory "
            "back to another vpager process (those host buffers stay "
            "pageable: slower copies)", vp__size(freed).s);
  vp__os_mutex_unlock(&dev->lock);
  return freed;
}

/* Bytes of [0, size) inside pinned chunks. */
static uint64_t hb_pinned_bytes(const hostbuf_t *hb) {
  uint64_t n = 0;
  for (uint32_t i = 0; i < hb->nchunks; i++) {
    const hb_chunk_t *c = &hb->chunks[i];
    uint64_t start = (uint64_t)(c->ptr - hb->ptr);
    if (!c->pinned || start >= hb->size) continue;
    n += c->size < hb->size - start ? c->size : hb->size - start;
  }
  return n;
}

/* ------------------------------------------------------------- copies */

/* Whether a lies in [c, c+len) (unsigned wrap-around does the a < c case). */
static bool inside(uintptr_t a, uintptr_t c, uint64_t len) {
  return a - c < len;
}

uint64_t vp__hostbuf_holding(vp__device_t *dev, const void *ptr) {
  for (uint32_t s = 0; s < dev->hostbufs.n; s++) {
    const hostbuf_t *hb = dev->hostbufs.slots[s];
    if (!hb) continue;
    uint64_t span = hb->reserved ? hb->reserved : hb->committed;
    if (inside((uintptr_t)ptr, (uintptr_t)hb->ptr, span)) return hb->id;
  }
  return 0;
}

/* n, shortened so that [a, a+n) does not cross an edge of the chunk
 * [c, c+len): up to its end when a is inside it, else up to its start. */
static uint64_t clip(uintptr_t a, uint64_t n, uintptr_t c, uint64_t len) {
  if (inside(a, c, len)) return len - (a - c) < n ? len - (a - c) : n;
  if (inside(c, a, n)) return c - a;
  return n;
}

/* The longest prefix of [ptr, +size) that crosses no chunk edge of a host
 * buffer (device lock held). CUDA refuses (CUDA_ERROR_INVALID_VALUE) a copy
 * whose host range spans two registrations, or registered and unregistered
 * memory, so every chunk edge splits, pinned or not: that also holds while
 * a chunk's registration is in flight. Never 0 for size > 0. *pinned:
 * the piece lies in a chunk page-locked now. */
static uint64_t host_piece(vp__device_t *dev, const void *ptr, uint64_t size,
                           bool *pinned) {
  uintptr_t a = (uintptr_t)ptr;
  *pinned = false;
  for (uint32_t s = 0; s < dev->hostbufs.n; s++) {
    const hostbuf_t *hb = dev->hostbufs.slots[s];
    if (!hb) continue;
    uintptr_t base = (uintptr_t)hb->ptr;
    uint64_t span = hb->reserved ? hb->reserved : hb->committed;
    if (!inside(a, base, span) && !inside(base, a, size)) continue;
    for (uint32_t i = 0; i < hb->nchunks; i++) {
      const hb_chunk_t *c = &hb->chunks[i];
      size = clip(a, size, (uintptr_t)c->ptr, c->size);
      if (inside(a, (uintptr_t)c->ptr, c->size)) *pinned = c->pinned;
    }
  }
  return size;
}

uint64_t vp__host_piece(vp__device_t *dev, const void *ptr, uint64_t size) {
  bool pinned;
  return host_piece(dev, ptr, size, &pinned);
}

/* One backend copy per piece; the backend's code on failure. programs
 * (host to device only): a pinned piece is read by that many blocks of
 * SMs where the backend can (vp__be_copy_htod_sm), counted in
 * stats.sm_copy_bytes; the copy engine copies the rest. */
static int copy_pieces(vp__device_t *dev, bool htod, uint64_t addr,
                       uint8_t *host, uint64_t size, vp_stream_t stream,
                       bool locked, uint32_t programs) {
  while (size) {
    if (!locked) {
      vp__os_mutex_lock(&dev->lock);
      dev->copies_unlocked++; /* give_back waits: see there */
    }
    bool pinned;
    uint64_t n = host_piece(dev, host, size, &pinned);
    if (!locked) vp__os_mutex_unlock(&dev->lock);
    int rc = VP_EUNSUPPORTED;
    if (htod && programs && pinned)
      rc = vp__be_copy_htod_sm(dev, addr, host, n, stream, programs);
    bool by_sm = rc == VP_OK;
    if (rc == VP_EUNSUPPORTED)
      rc = htod ? vp__be_copy_htod(dev, addr, host, n, stream)
                : vp__be_copy_dtoh(dev, host, addr, n, stream);
    if (!locked) {
      vp__os_mutex_lock(&dev->lock);
      dev->copies_unlocked--;
    }
    if (by_sm) dev->stats.sm_copy_bytes += n;
    if (!locked) vp__os_mutex_unlock(&dev->lock);
    if (rc) return rc;
    addr += n;
    host += n;
    size -= n;
  }
  return VP_OK;
}

int vp__copy_htod(vp__device_t *dev, uint64_t dst, const void *src,
                  uint64_t size, vp_stream_t stream, bool locked) {
  return copy_pieces(dev, true, dst, (uint8_t *)(uintptr_t)src, size, stream,
                     locked, 0);
}

int vp__copy_htod_sm(vp__device_t *dev, uint64_t dst, const void *src,
                     uint64_t size, vp_stream_t stream, bool locked,
                     uint32_t programs) {
  return copy_pieces(dev, true, dst, (uint8_t *)(uintptr_t)src, size, stream,
                     locked, programs);
}

int vp__copy_dtoh(vp__device_t *dev, void *dst, uint64_t src, uint64_t size,
                  vp_stream_t stream, bool locked) {
  return copy_pieces(dev, false, src, dst, size, stream, locked, 0);
}

int vp_hostbuf_alloc(vp_device_t h, uint64_t size, uint64_t max_size,
                     vp_hostbuf_t *out) {
  VP__ENTER();
  if (!out) return vp__err(VP_EINVAL, "out is NULL");
  out->id = 0;
  if (!size) return vp__err(VP_EINVAL, "size is 0");
  if (max_size < size)
    return vp__err(VP_EINVAL, "max_size %llu is below size %llu",
                   ULL(max_size), ULL(size));
  vp__device_t *dev = NULL;
  int rc = vp__dev_enter(h, &dev);
  if (rc) return rc;
  hostbuf_t *hb = NULL;
  rc = hb_new(dev, &hb);
  if (rc) return vp__unlock(dev, rc);
  rc = hb_reserve(dev, hb, max_size);
  if (!rc) rc = hb_commit(dev, hb, size);
  if (rc) {
    hb_abandon(dev, hb);
    return vp__unlock(dev, rc);
  }
  hb->size = size;
  pin_chunk(dev, hb, 0, true);
  hb->busy = false;
  out->id = hb->id;
  return vp__unlock(dev, VP_OK);
}

int vp_hostbuf_register(vp_device_t h, void *ptr, uint64_t size,
                        vp_hostbuf_t *out) {
  VP__ENTER();
  if (!out) return vp__err(VP_EINVAL, "out is NULL");
  out->id = 0;
  if (!ptr) return vp__err(VP_EINVAL, "ptr is NULL");
  if (!size) return vp__err(VP_EINVAL, "size is 0");
  if ((uintptr_t)ptr > UINTPTR_MAX - size)
    return vp__err(VP_EINVAL, "[%p, +%llu) wraps around", ptr, ULL(size));
  vp__device_t *dev = NULL;
  int rc = vp__dev_enter(h, &dev);
  if (rc) return rc;
  hostbuf_t *hb = NULL;
  rc = hb_new(dev, &hb);
  if (rc) return vp__unlock(dev, rc);
  /* The caller's memory: one chunk, nothing reserved, nothing to unmap. */
  hb->ptr = ptr;
  hb->size = hb->max_size = hb->committed = size;
  hb->chunks[hb->nchunks++] = (hb_chunk_t){ptr, size, false};
  pin_chunk(dev, hb, 0, false);
  hb->busy = false;
  out->id = hb->id;
  return vp__unlock(dev, VP_OK);
}

/* Why hb cannot grow to size, or VP_OK (also for "no change"). */
static int grow_check(const hostbuf_t *hb, uint64_t size) {
  if (hb->dev->broken)
    return vp__err(VP_EDEVICE, "the %s device is broken; close it",
                   hb->dev->caps.name);
  if (hb->busy)
    return vp__err(VP_EBUSY, "host buffer 0x%llx is being pinned by another "
                   "thread", ULL(hb->id));
  if (size < hb->size)
    return vp__err(VP_EINVAL, "%llu is below the size %llu (buffers do not "
                   "shrink)", ULL(size), ULL(hb->size));
  if (size > hb->size && !hb->reserved)
    return vp__err(VP_EINVAL, "host buffer 0x%llx is registered caller memory, "
                   "which cannot grow", ULL(hb->id));
  if (size > hb->max_size)
    return vp__err(VP_ERANGE, "%llu is past max_size %llu", ULL(size),
                   ULL(hb->max_size));
  return VP_OK;
}

int vp_hostbuf_grow(vp_hostbuf_t h, uint64_t size) {
  VP__ENTER();
  hostbuf_t *hb = NULL;
  int rc = hb_lock(h, &hb);
  if (rc) return rc;
  vp__device_t *dev = hb->dev;
  rc = grow_check(hb, size);
  if (rc || size == hb->size) return vp__unlock(dev, rc);
  rc = chunk_room(dev, hb);
  uint64_t old_committed = hb->committed;
  uint32_t old_chunks = hb->nchunks;
  if (!rc) rc = hb_commit(dev, hb, size);
  if (rc) return vp__unlock(dev, rc);
  /* Bytes past the old size in its last page may have been written. */
  uint64_t tail_end = size < old_committed ? size : old_committed;
  if (tail_end > hb->size) memset(hb->ptr + hb->size, 0, tail_end - hb->size);
  hb->size = size;
  if (hb->nchunks > old_chunks) {
    hb->busy = true;
    pin_chunk(dev, hb, old_chunks, true);
    hb->busy = false;
  }
  return vp__unlock(dev, VP_OK);
}

int vp_host_memory(vp_host_memory_t *out) {
  VP__ENTER();
  if (!out) return vp__err(VP_EINVAL, "out is NULL");
  *out = (vp_host_memory_t){.total = vp__os_ram_total(),
                            .available = vp__os_ram_available(),
                            .limit = vp__os_memory_limit()};
  return VP_OK;
}

typedef struct mappings_out {
  vp_host_mapping_t *out;
  size_t cap, n;
} mappings_out_t;

static bool take_mapping(const vp__os_mapping_t *m, void *ctx) {
  mappings_out_t *o = ctx;
  if (o->n < o->cap) {
    vp_host_mapping_t *d = &o->out[o->n];
    *d = (vp_host_mapping_t){
        .start = m->start, .size = m->size, .file_offset = m->file_offset,
        .file_id = m->file_id,
        .flags = (m->writable ? VP_MAPPING_WRITABLE : 0u) |
                 (m->private_ ? VP_MAPPING_PRIVATE : 0u) |
                 (m->written ? VP_MAPPING_WRITTEN : 0u)};
    memcpy(d->path, m->path, sizeof d->path);
  }
  o->n++;
  return true;
}

int vp_host_mappings(vp_host_mapping_t *out, size_t cap, size_t *n) {
  VP__ENTER();
  if (!n) return vp__err(VP_EINVAL, "n is NULL");
  if (!out && cap) return vp__err(VP_EINVAL, "out is NULL with cap %zu", cap);
  mappings_out_t o = {out, cap, 0};
  int e = vp__os_file_mappings(true, take_mapping, &o);
  if (e) return vp__err(VP_EUNSUPPORTED, "this process's mappings cannot be "
                        "read (%s)", strerror(e));
  *n = o.n;
  return VP_OK;
}

/* The read-only file mappings, start and end, in address order, and
 * whether each is private (its pages may have been written before it was
 * made read-only: a library's relocations, then mprotect). */
typedef struct ro_maps {
  uint64_t (*span)[3]; /* start, end, private */
  size_t n, cap;
  bool oom;
} ro_maps_t;

static bool take_read_only(const vp__os_mapping_t *m, void *ctx) {
  ro_maps_t *r = ctx;
  if (m->writable) return true;
  if (r->n == r->cap) {
    size_t cap = r->cap ? 2 * r->cap : 256;
    void *p = realloc(r->span, cap * sizeof *r->span);
    if (!p) return !(r->oom = true);
    r->span = p, r->cap = cap;
  }
  r->span[r->n][0] = m->start;
  r->span[r->n][1] = m->start + m->size;
  r->span[r->n][2] = m->private_;
  r->n++;
  return true;
}

/* The mapping of r holding [a, b) whole, or NULL. */
static const uint64_t *read_only_mapped(const ro_maps_t *r, uint64_t a,
                                        uint64_t b) {
  size_t lo = 0, hi = r->n; /* the last mapping starting at or below a */
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (r->span[mid][0] <= a) lo = mid + 1;
    else hi = mid;
  }
  return lo > 0 && b <= r->span[lo - 1][1] ? r->span[lo - 1] : NULL;
}

int vp_host_drop_resident(size_t n, const uint64_t *addrs,
                          const uint64_t *sizes, uint64_t *dropped) {
  VP__ENTER();
  if (n && (!addrs || !sizes))
    return vp__err(VP_EINVAL, "addrs or sizes is NULL with n %zu", n);
  if (dropped) *dropped = 0;
  if (!n) return VP_OK;
  ro_maps_t r = {0};
  int e = vp__os_file_mappings(false, take_read_only, &r);
  if (e || r.oom) {
    free(r.span);
    return e ? vp__err(VP_EUNSUPPORTED, "this process's mappings cannot be "
                       "read (%s)", strerror(e))
             : vp__err(VP_ENOMEM, "no host memory for the mappings' list");
  }
  uint64_t page = vp__os_page_size(), sum = 0;
  for (size_t i = 0; i < n; i++) {
    uint64_t a = addrs[i], b = a + sizes[i];
    uint64_t lo = (a + page - 1) / page * page, hi = b / page * page;
    const uint64_t *m = b < a || hi <= lo ? NULL
                        : read_only_mapped(&r, a, b);
    const void *p = (const void *)(uintptr_t)lo;
    if (m && !(m[2] ? vp__os_drop_unwritten(p, hi - lo)
                    : vp__os_file_map_drop(p, hi - lo)))
      sum += hi - lo;
  }
  free(r.span);
  if (dropped) *dropped = sum;
  return VP_OK;
}

int vp_hostbuf_info(vp_hostbuf_t h, vp_hostbuf_info_t *info) {
  VP__ENTER();
  if (!info) return vp__err(VP_EINVAL, "info is NULL");
  hostbuf_t *hb = NULL;
  int rc = hb_lock(h, &hb);
  if (rc) return rc;
  *info = (vp_hostbuf_info_t){
      .ptr = hb->ptr,
      .size = hb->size,
      .max_size = hb->max_size,
      .pinned_bytes = hb_pinned_bytes(hb),
  };
  return vp__unlock(hb->dev, VP_OK);
}

/* Works on a broken device too: freeing is how the caller cleans up. */
int vp_hostbuf_free(vp_hostbuf_t h) {
  VP__ENTER();
  hostbuf_t *hb = NULL;
  int rc = hb_lock(h, &hb);
  if (rc) return rc;
  vp__device_t *dev = hb->dev;
  if (hb->busy)
    return vp__unlock(dev, vp__err(VP_EBUSY, "host buffer 0x%llx is being "
                                   "pinned by another thread", ULL(hb->id)));
  /* Out of the table first: no one else can reach it while unlocked. */
  vp__table_remove(&dev->hostbufs, hb->id);
  vp__os_mutex_unlock(&dev->lock);
  uint64_t pinned = hb_release_memory(dev, hb);
  hb_delete(hb);
  vp__os_mutex_lock(&dev->lock);
  unpin_account(dev, pinned);
  vp__pins_releasable(dev, -(int64_t)pinned);
  return vp__unlock(dev, VP_OK);
}

/* Device close: free every host buffer still open, then the table. The
 * device is out of the registry, so no lock is needed. */
void vp__hostmem_close(vp__device_t *dev) {
  for (uint32_t s = 0; s < dev->hostbufs.n; s++) {
    hostbuf_t *hb = dev->hostbufs.slots[s];
    if (!hb) continue;
    uint64_t pinned = hb_release_memory(dev, hb);
    unpin_account(dev, pinned);
    vp__pins_releasable(dev, -(int64_t)pinned);
    hb_delete(hb);
  }
  vp__table_free(&dev->hostbufs);
}
