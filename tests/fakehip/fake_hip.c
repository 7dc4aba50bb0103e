/* A stand-in for ROCm's libamdhip64 over host memory, so that the HIP
 * backend (src/backend/hip.c and vmm.c under it) runs the pager suite on a
 * machine without an AMD GPU: `make check-hip` builds it as
 * libfakehip.so and runs `runner hip/` with TEST_HIP_LIBRARY naming it.
 *
 * Only the entry points hip_abi.h declares, with HIP's C types (void *
 * device pointers, pointer handles). Device memory is host memory: a
 * reservation is a PROT_NONE mapping, an allocation a shared anonymous
 * mapping (no file descriptor: tests count theirs), a map puts a second
 * view of its pages there (mremap of size 0), set-access makes it
 * read-write, unmap puts the PROT_NONE mapping back, so touching an
 * unmapped page faults as on a GPU. Copies run at
 * once (streams and events are tokens, always complete). Two devices of
 * 1 GiB; each allocation must be made with its device current, as the
 * real runtime binds them (hipErrorInvalidDevice otherwise). Linux only.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int err_t; /* hipError_t's values, as hip_runtime_api.h numbers them */
enum {
  OK = 0,
  INVALID_VALUE = 1,
  OUT_OF_MEMORY = 2,
  INVALID_DEVICE = 101,
  NOT_MAPPED = 211,
  HOST_ALREADY_REGISTERED = 712,
  HOST_NOT_REGISTERED = 713,
};

#define EXPORT __attribute__((visibility("default")))
#define DEVICES 2
#define MEMORY (1ull << 30)
#define GRANULARITY (2ull << 20)

typedef struct { char bytes[16]; } uuid_t_;
typedef struct { int type, id; } location_t;
typedef struct { /* hipMemAllocationProp, ROCm 5.3 and later */
  int type, requested_handle_type;
  location_t location;
  void *win32;
  unsigned char compression, rdma;
  unsigned short usage;
} prop_t;
typedef struct { location_t location; int flags; } access_t;
typedef struct handle {
  char *pages; /* the allocation's own view */
  size_t size;
  int device;
} handle_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t used[DEVICES];    /* bytes allocated per device */
static _Thread_local int current; /* the thread's device */

/* Host registrations: a small table is enough for the tests. */
static struct { char *p; size_t n; } pinned[256];

EXPORT err_t hipInit(unsigned flags) { return flags ? INVALID_VALUE : OK; }
EXPORT err_t hipRuntimeGetVersion(int *v) { return *v = 60200000, OK; }
EXPORT err_t hipGetDeviceCount(int *n) { return *n = DEVICES, OK; }
EXPORT err_t hipDeviceGet(int *dev, int ordinal) {
  if (ordinal < 0 || ordinal >= DEVICES) return INVALID_DEVICE;
  return *dev = ordinal, OK;
}
EXPORT err_t hipGetDevice(int *dev) { return *dev = current, OK; }
EXPORT err_t hipSetDevice(int dev) {
  if (dev < 0 || dev >= DEVICES) return INVALID_DEVICE;
  return current = dev, OK;
}

/* 89: virtual memory management supported; 16: integrated (no). */
EXPORT err_t hipDeviceGetAttribute(int *value, unsigned attr, int dev) {
  if (dev < 0 || dev >= DEVICES) return INVALID_DEVICE;
  *value = attr == 89;
  return OK;
}
EXPORT err_t hipDeviceTotalMem(size_t *bytes, int dev) {
  if (dev < 0 || dev >= DEVICES) return INVALID_DEVICE;
  return *bytes = MEMORY, OK;
}
EXPORT err_t hipDeviceGetUuid(uuid_t_ *u, int dev) {
  if (dev < 0 || dev >= DEVICES) return INVALID_DEVICE;
  memset(u->bytes, 0xf0 + dev, sizeof u->bytes);
  return OK;
}
EXPORT err_t hipMemGetInfo(size_t *free_bytes, size_t *total) {
  pthread_mutex_lock(&lock);
  *free_bytes = MEMORY - used[current];
  pthread_mutex_unlock(&lock);
  *total = MEMORY;
  return OK;
}
EXPORT err_t hipMemGetAllocationGranularity(size_t *g, const prop_t *prop,
                                            unsigned option) {
  (void)option;
  if (prop->location.id < 0 || prop->location.id >= DEVICES)
    return INVALID_DEVICE;
  return *g = GRANULARITY, OK;
}

/* -------------------------------------------------------- virtual memory */

static int protect_none(void *p, size_t n) {
  int how = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED;
  void *q = mmap(p, n, PROT_NONE, how, -1, 0);
  return q == p ? OK : OUT_OF_MEMORY;
}

EXPORT err_t hipMemAddressReserve(void **ptr, size_t size, size_t align,
                                  void *addr, unsigned long long flags) {
  if (!size || size % GRANULARITY || addr || flags) return INVALID_VALUE;
  if (align < GRANULARITY) align = GRANULARITY;
  char *p = mmap(NULL, size + align, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return OUT_OF_MEMORY;
  char *a = (char *)(((uintptr_t)p + align - 1) & ~(uintptr_t)(align - 1));
  if (a > p) munmap(p, (size_t)(a - p));
  munmap(a + size, (size_t)(p + size + align - (a + size)));
  *ptr = a;
  return OK;
}

EXPORT err_t hipMemAddressFree(void *ptr, size_t size) {
  return ptr && size && munmap(ptr, size) == 0 ? OK : INVALID_VALUE;
}

EXPORT err_t hipMemCreate(handle_t **out, size_t size, const prop_t *prop,
                          unsigned long long flags) {
  if (!size || size % GRANULARITY || flags || prop->type != 1)
    return INVALID_VALUE;
  if (prop->location.type != 1 || prop->location.id != current)
    return INVALID_DEVICE; /* made on another device than the current one */
  pthread_mutex_lock(&lock);
  int full = used[current] + size > MEMORY;
  if (!full) used[current] += size;
  pthread_mutex_unlock(&lock);
  if (full) return OUT_OF_MEMORY;
  handle_t *h = calloc(1, sizeof *h);
  char *pages = mmap(NULL, size, PROT_READ | PROT_WRITE,
                     MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (!h || pages == MAP_FAILED) {
    if (pages != MAP_FAILED) munmap(pages, size);
    free(h);
    pthread_mutex_lock(&lock);
    used[current] -= size;
    pthread_mutex_unlock(&lock);
    return OUT_OF_MEMORY;
  }
  *h = (handle_t){pages, size, current};
  *out = h;
  return OK;
}

EXPORT err_t hipMemRelease(handle_t *h) {
  if (!h) return INVALID_VALUE;
  pthread_mutex_lock(&lock);
  used[h->device] -= h->size;
  pthread_mutex_unlock(&lock);
  munmap(h->pages, h->size);
  free(h);
  return OK;
}

EXPORT err_t hipMemMap(void *ptr, size_t size, size_t offset, handle_t *h,
                       unsigned long long flags) {
  if (!ptr || !h || flags || offset + size > h->size) return INVALID_VALUE;
  void *q = mremap(h->pages + offset, 0, size, MREMAP_MAYMOVE | MREMAP_FIXED,
                   ptr);
  if (q != ptr) return OUT_OF_MEMORY;
  return mprotect(ptr, size, PROT_NONE) == 0 ? OK : OUT_OF_MEMORY;
}

EXPORT err_t hipMemSetAccess(void *ptr, size_t size, const access_t *desc,
                             size_t count) {
  if (count != 1 || desc->flags != 3 || desc->location.id != current)
    return INVALID_VALUE;
  return mprotect(ptr, size, PROT_READ | PROT_WRITE) == 0 ? OK : NOT_MAPPED;
}

EXPORT err_t hipMemUnmap(void *ptr, size_t size) {
  return ptr && size ? protect_none(ptr, size) : INVALID_VALUE;
}

/* ------------------------------------------------- streams, events, copies */

/* Streams and events are distinct non-NULL tokens, nothing allocated: a
 * stream a test leaves to its context is no leak. */
static void *token(void) {
  static _Atomic uintptr_t next = 1;
  return (void *)(atomic_fetch_add(&next, 1) * 16);
}

EXPORT err_t hipStreamCreateWithFlags(void **s, unsigned flags) {
  (void)flags;
  return *s = token(), OK;
}
EXPORT err_t hipStreamDestroy(void *s) { return s ? OK : INVALID_VALUE; }
EXPORT err_t hipStreamSynchronize(void *s) { return (void)s, OK; }
EXPORT err_t hipStreamWaitEvent(void *s, void *e, unsigned flags) {
  return (void)s, (void)e, flags ? INVALID_VALUE : OK;
}
EXPORT err_t hipEventCreateWithFlags(void **e, unsigned flags) {
  if (flags != 2) return INVALID_VALUE; /* hipEventDisableTiming */
  return *e = token(), OK;
}
EXPORT err_t hipEventDestroy(void *e) { return e ? OK : INVALID_VALUE; }
EXPORT err_t hipEventRecord(void *e, void *s) {
  return (void)s, e ? OK : INVALID_VALUE;
}
EXPORT err_t hipEventQuery(void *e) { return e ? OK : INVALID_VALUE; }
EXPORT err_t hipEventSynchronize(void *e) { return e ? OK : INVALID_VALUE; }
EXPORT err_t hipDeviceSynchronize(void) { return OK; }

EXPORT err_t hipMemcpyHtoDAsync(void *dst, void *src, size_t n, void *s) {
  (void)s;
  memcpy(dst, src, n);
  return OK;
}
EXPORT err_t hipMemcpyDtoHAsync(void *dst, void *src, size_t n, void *s) {
  (void)s;
  memcpy(dst, src, n);
  return OK;
}

EXPORT err_t hipHostRegister(void *ptr, size_t n, unsigned flags) {
  if (!ptr || !n || flags != 1) return INVALID_VALUE; /* Portable only */
  err_t r = OUT_OF_MEMORY;
  pthread_mutex_lock(&lock);
  for (size_t i = 0; i < 256; i++) {
    char *p = pinned[i].p;
    if (p && (char *)ptr < p + pinned[i].n && p < (char *)ptr + n) {
      r = HOST_ALREADY_REGISTERED;
      break;
    }
  }
  for (size_t i = 0; r == OUT_OF_MEMORY && i < 256; i++)
    if (!pinned[i].p) {
      pinned[i].p = ptr;
      pinned[i].n = n;
      r = OK;
    }
  pthread_mutex_unlock(&lock);
  return r;
}

EXPORT err_t hipHostUnregister(void *ptr) {
  err_t r = HOST_NOT_REGISTERED;
  pthread_mutex_lock(&lock);
  for (size_t i = 0; i < 256; i++)
    if (ptr && pinned[i].p == ptr) {
      pinned[i].p = NULL;
      r = OK;
    }
  pthread_mutex_unlock(&lock);
  return r;
}

EXPORT const char *hipGetErrorName(err_t e) {
  switch (e) {
  case OK: return "hipSuccess";
  case INVALID_VALUE: return "hipErrorInvalidValue";
  case OUT_OF_MEMORY: return "hipErrorOutOfMemory";
  case INVALID_DEVICE: return "hipErrorInvalidDevice";
  case NOT_MAPPED: return "hipErrorNotMapped";
  case HOST_ALREADY_REGISTERED: return "hipErrorHostMemoryAlreadyRegistered";
  case HOST_NOT_REGISTERED: return "hipErrorHostMemoryNotRegistered";
  default: return "hipErrorUnknown";
  }
}
