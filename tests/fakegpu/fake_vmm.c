/* The stand-in drivers' device memory over host memory (fake_vmm.h). */
#define _GNU_SOURCE
#include "fake_vmm.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

/* Every record lives on a list reachable from here: what a test leaves to
 * the driver at exit is no leak to LeakSanitizer. */
struct fv_handle {
  char *pages; /* the allocation's own view */
  size_t size;
  int device;
  int maps;      /* live mappings of it */
  bool released; /* freed at its last unmap */
  fv_handle_t *next;
};

typedef struct range {
  char *va;
  size_t size;
  fv_handle_t *handle; /* mappings only */
  bool accessible;     /* mappings only: set-access made it read-write */
  struct range *next;
} range_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static fv_handle_t *handles;
static range_t *reservations, *mappings;
static uint64_t used[FV_DEVICES];

/* Host registrations: a small table is enough for the tests. */
static struct { char *p; size_t n; } pinned[256];

static bool aligned(uintptr_t v) { return v % FV_GRANULARITY == 0; }

static bool overlaps(const char *a, size_t an, const char *b, size_t bn) {
  return a < b + bn && b < a + an;
}

static int protect_none(void *p, size_t n) {
  int how = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED;
  return mmap(p, n, PROT_NONE, how, -1, 0) == p ? 0 : -1;
}

/* The mapping that holds address p; NULL if none. Lock held. */
static range_t *mapping_at(const char *p) {
  for (range_t *m = mappings; m; m = m->next)
    if (p >= m->va && p < m->va + m->size) return m;
  return NULL;
}

/* What a call asks of each mapping in its range: the mapping, where the
 * walk stands in it, the range's end, and the call's argument. */
typedef fv_status_t check_fn(range_t *m, const char *at, const char *end,
                             int arg);

/* Every byte of [p, p + size) mapped, and each mapping passing check.
 * Lock held. */
static fv_status_t each_mapping(const char *p, size_t size, check_fn *check,
                                int arg) {
  for (const char *c = p; c < p + size;) {
    range_t *m = mapping_at(c);
    if (!m) return FV_NOT_MAPPED;
    fv_status_t st = check(m, c, p + size, arg);
    if (st != FV_OK) return st;
    c = m->va + m->size;
  }
  return FV_OK;
}

static fv_status_t on_device(range_t *m, const char *at, const char *end,
                             int device) {
  (void)at, (void)end;
  return m->handle->device == device ? FV_OK : FV_INVALID_DEVICE;
}

static fv_status_t make_accessible(range_t *m, const char *at,
                                   const char *end, int unused) {
  (void)at, (void)end, (void)unused;
  m->accessible = true;
  return FV_OK;
}

static fv_status_t whole(range_t *m, const char *at, const char *end,
                         int unused) {
  (void)unused;
  return m->va == at && m->va + m->size <= end ? FV_OK : FV_INVALID;
}

static fv_status_t usable(range_t *m, const char *at, const char *end,
                          int unused) {
  (void)at, (void)end, (void)unused;
  return m->accessible ? FV_OK : FV_NO_ACCESS;
}

/* -------------------------------------------------------- reservations */

fv_status_t fv_reserve(size_t size, size_t align, uintptr_t addr,
                       unsigned long long flags, void **ptr) {
  if (!ptr || !size || !aligned(size) || addr || flags ||
      (align & (align - 1)))
    return FV_INVALID;
  if (align < FV_GRANULARITY) align = FV_GRANULARITY;
  range_t *r = calloc(1, sizeof *r);
  char *p = mmap(NULL, size + align, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (!r || p == MAP_FAILED) {
    free(r);
    return FV_OUT_OF_MEMORY;
  }
  char *a = (char *)(((uintptr_t)p + align - 1) & ~(uintptr_t)(align - 1));
  if (a > p) munmap(p, (size_t)(a - p));
  munmap(a + size, (size_t)(p + size + align - (a + size)));
  pthread_mutex_lock(&lock);
  *r = (range_t){.va = a, .size = size, .next = reservations};
  reservations = r;
  pthread_mutex_unlock(&lock);
  *ptr = a;
  return FV_OK;
}

/* The whole reservation, as reserved, and nothing mapped in it any more
 * (stricter than the drivers' documentation, which does not say: the
 * pager unmaps every page before it frees the range). */
fv_status_t fv_address_free(void *ptr, size_t size) {
  fv_status_t st = FV_INVALID;
  pthread_mutex_lock(&lock);
  for (range_t **r = &reservations; *r; r = &(*r)->next) {
    if ((*r)->va != ptr || (*r)->size != size) continue;
    for (range_t *m = mappings; m; m = m->next)
      if (overlaps(m->va, m->size, ptr, size)) goto out;
    range_t *dead = *r;
    *r = dead->next;
    free(dead);
    munmap(ptr, size);
    st = FV_OK;
    break;
  }
out:
  pthread_mutex_unlock(&lock);
  return st;
}

/* --------------------------------------------------------- allocations */

fv_status_t fv_create(size_t size, int device, fv_handle_t **out) {
  if (!out || !size || !aligned(size)) return FV_INVALID;
  if (device < 0 || device >= FV_DEVICES) return FV_INVALID;
  fv_handle_t *h = calloc(1, sizeof *h);
  char *pages = mmap(NULL, size, PROT_READ | PROT_WRITE,
                     MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  pthread_mutex_lock(&lock);
  bool made = h && pages != MAP_FAILED && used[device] + size <= FV_MEMORY;
  if (made) {
    used[device] += size;
    *h = (fv_handle_t){pages, size, device, 0, false, handles};
    handles = h;
    *out = h;
  }
  pthread_mutex_unlock(&lock);
  if (made) return FV_OK;
  if (pages != MAP_FAILED) munmap(pages, size);
  free(h);
  return FV_OUT_OF_MEMORY;
}

/* Lock held. */
static bool live(const fv_handle_t *h) {
  for (const fv_handle_t *x = handles; x; x = x->next)
    if (x == h) return !x->released;
  return false;
}

/* Lock held: gone for good once released and unmapped. */
static void free_if_done(fv_handle_t *h) {
  if (!h->released || h->maps) return;
  for (fv_handle_t **x = &handles; *x; x = &(*x)->next)
    if (*x == h) {
      *x = h->next;
      break;
    }
  used[h->device] -= h->size;
  munmap(h->pages, h->size);
  free(h);
}

fv_status_t fv_release(fv_handle_t *h) {
  pthread_mutex_lock(&lock);
  bool ok = live(h);
  if (ok) {
    h->released = true;
    free_if_done(h);
  }
  pthread_mutex_unlock(&lock);
  return ok ? FV_OK : FV_INVALID_HANDLE;
}

uint64_t fv_used(int device) {
  if (device < 0 || device >= FV_DEVICES) return 0;
  pthread_mutex_lock(&lock);
  uint64_t n = used[device];
  pthread_mutex_unlock(&lock);
  return n;
}

/* ------------------------------------------------------------ mappings */

/* Whole granules of a live allocation, inside one reservation, over
 * nothing mapped. */
fv_status_t fv_map(void *ptr, size_t size, size_t offset, fv_handle_t *h) {
  char *p = ptr;
  if (!p || !size || !aligned((uintptr_t)p) || !aligned(size) ||
      !aligned(offset))
    return FV_INVALID;
  range_t *m = calloc(1, sizeof *m);
  if (!m) return FV_OUT_OF_MEMORY;
  fv_status_t st = FV_OK;
  pthread_mutex_lock(&lock);
  bool inside = false;
  for (range_t *r = reservations; r; r = r->next)
    inside |= p >= r->va && p + size <= r->va + r->size;
  if (!live(h)) st = FV_INVALID_HANDLE;
  else if (offset > h->size || size > h->size - offset || !inside)
    st = FV_INVALID;
  for (range_t *x = mappings; st == FV_OK && x; x = x->next)
    if (overlaps(x->va, x->size, p, size)) st = FV_ALREADY_MAPPED;
  if (st == FV_OK) {
    void *q = mremap(h->pages + offset, 0, size,
                     MREMAP_MAYMOVE | MREMAP_FIXED, p);
    if (q != p || mprotect(p, size, PROT_NONE) != 0) st = FV_OUT_OF_MEMORY;
  }
  if (st == FV_OK) {
    *m = (range_t){.va = p, .size = size, .handle = h, .next = mappings};
    mappings = m;
    h->maps++;
    m = NULL;
  }
  pthread_mutex_unlock(&lock);
  free(m);
  return st;
}

/* Every byte of the range mapped, on `device`. */
fv_status_t fv_set_access(void *ptr, size_t size, int device) {
  char *p = ptr;
  if (!p || !size || !aligned((uintptr_t)p) || !aligned(size))
    return FV_INVALID;
  pthread_mutex_lock(&lock);
  fv_status_t st = each_mapping(p, size, on_device, device);
  if (st == FV_OK && mprotect(p, size, PROT_READ | PROT_WRITE) != 0)
    st = FV_OUT_OF_MEMORY;
  if (st == FV_OK) each_mapping(p, size, make_accessible, 0);
  pthread_mutex_unlock(&lock);
  return st;
}

/* Whole mappings only: "cuMemUnmap cannot unmap a sub-range of an address
 * range mapped by cuMemCreate/cuMemMap". */
fv_status_t fv_unmap(void *ptr, size_t size) {
  char *p = ptr;
  if (!p || !size || !aligned((uintptr_t)p) || !aligned(size))
    return FV_INVALID;
  pthread_mutex_lock(&lock);
  fv_status_t st = each_mapping(p, size, whole, 0);
  if (st == FV_OK && protect_none(p, size) != 0) st = FV_OUT_OF_MEMORY;
  for (range_t **m = &mappings; st == FV_OK && *m;) {
    range_t *x = *m;
    if (!overlaps(x->va, x->size, p, size)) {
      m = &x->next;
      continue;
    }
    *m = x->next;
    x->handle->maps--;
    free_if_done(x->handle);
    free(x);
  }
  pthread_mutex_unlock(&lock);
  return st;
}

fv_status_t fv_accessible(uintptr_t ptr, size_t size) {
  pthread_mutex_lock(&lock);
  fv_status_t st = each_mapping((const char *)ptr, size, usable, 0);
  pthread_mutex_unlock(&lock);
  return st;
}

/* ------------------------------------------------- host registration */

/* Every page of the range in the process's mappings, and writable. */
static fv_status_t host_pages(const char *p, size_t n) {
  FILE *f = fopen("/proc/self/maps", "r");
  if (!f) return FV_INVALID;
  const char *want = p, *end = p + n;
  bool writable = true;
  char line[512];
  unsigned long lo, hi;
  char perms[8];
  while (want < end && fgets(line, sizeof line, f)) {
    if (sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) != 3) continue;
    if ((const char *)lo > want || (const char *)hi <= want) continue;
    writable &= perms[1] == 'w';
    want = (const char *)hi;
  }
  fclose(f);
  if (want < end) return FV_INVALID; /* a hole: not memory of ours */
  return writable ? FV_OK : FV_HOST_READ_ONLY;
}

fv_status_t fv_host_register(void *ptr, size_t n, bool read_only) {
  if (!ptr || !n) return FV_INVALID;
  fv_status_t st = host_pages(ptr, n);
  if (st == FV_HOST_READ_ONLY && read_only) st = FV_OK;
  if (st != FV_OK) return st;
  st = FV_OUT_OF_MEMORY;
  pthread_mutex_lock(&lock);
  for (size_t i = 0; i < 256; i++)
    if (pinned[i].p && overlaps(ptr, n, pinned[i].p, pinned[i].n)) {
      st = FV_HOST_REGISTERED;
      break;
    }
  for (size_t i = 0; st == FV_OUT_OF_MEMORY && i < 256; i++)
    if (!pinned[i].p) {
      pinned[i].p = ptr;
      pinned[i].n = n;
      st = FV_OK;
    }
  pthread_mutex_unlock(&lock);
  return st;
}

fv_status_t fv_host_registered(const void *ptr) {
  fv_status_t st = FV_HOST_NOT_REGISTERED;
  pthread_mutex_lock(&lock);
  for (size_t i = 0; i < 256; i++)
    if (pinned[i].p && (const char *)ptr >= (const char *)pinned[i].p &&
        (const char *)ptr < (const char *)pinned[i].p + pinned[i].n)
      st = FV_OK;
  pthread_mutex_unlock(&lock);
  return st;
}

fv_status_t fv_host_unregister(void *ptr) {
  fv_status_t st = FV_HOST_NOT_REGISTERED;
  pthread_mutex_lock(&lock);
  for (size_t i = 0; i < 256; i++)
    if (ptr && pinned[i].p == ptr) {
      pinned[i].p = NULL;
      st = FV_OK;
    }
  pthread_mutex_unlock(&lock);
  return st;
}
