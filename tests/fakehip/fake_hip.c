/* A stand-in for ROCm's libamdhip64 over host memory, so that the HIP
 * backend (src/backend/hip.c and vmm.c under it) runs the pager suite on a
 * machine without an AMD GPU: `make check-hip` builds it as
 * libfakehip.so and runs `runner hip/` with TEST_HIP_LIBRARY naming it.
 *
 * Only the entry points hip_abi.h declares, with HIP's C types (void *
 * device pointers, pointer handles). Device memory is host memory,
 * tests/fakegpu/fake_vmm.c's (shared with the CUDA stand-in): touching an
 * unmapped page faults as on a GPU. Copies run at once (streams and events
 * are tokens, always complete). Two devices of 1 GiB; each allocation must
 * be made with its device current, as the real runtime binds them
 * (hipErrorInvalidDevice otherwise). Linux only.
 */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fake_vmm.h"

typedef int err_t; /* hipError_t's values, as hip_runtime_api.h numbers them */
enum {
  OK = 0,
  INVALID_VALUE = 1,
  OUT_OF_MEMORY = 2,
  INVALID_DEVICE = 101,
  NOT_MAPPED = 211,
  INVALID_HANDLE = 400,
  HOST_ALREADY_REGISTERED = 712,
  HOST_NOT_REGISTERED = 713,
};

#define EXPORT __attribute__((visibility("default")))
#define DEVICES FV_DEVICES

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

static _Thread_local int current; /* the thread's device */

static err_t from_fv(fv_status_t st) {
  switch (st) {
  case FV_OK: return OK;
  case FV_OUT_OF_MEMORY: return OUT_OF_MEMORY;
  case FV_INVALID_DEVICE: return INVALID_DEVICE;
  case FV_INVALID_HANDLE: return INVALID_HANDLE;
  case FV_NOT_MAPPED: return NOT_MAPPED;
  case FV_HOST_REGISTERED: return HOST_ALREADY_REGISTERED;
  case FV_HOST_NOT_REGISTERED: return HOST_NOT_REGISTERED;
  default: return INVALID_VALUE;
  }
}

EXPORT err_t hipInit(unsigned flags) { return flags ? INVALID_VALUE : OK; }
/* FAKEHIP_VERSION: another HIP_VERSION (a test of the refusal). */
EXPORT err_t hipRuntimeGetVersion(int *v) {
  const char *e = getenv("FAKEHIP_VERSION");
  *v = e ? atoi(e) : 60300000;
  return OK;
}
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
  return *bytes = FV_MEMORY, OK;
}
/* FAKEHIP_NO_UUID: as a GPU without one ("XX", then zeros). */
EXPORT err_t hipDeviceGetUuid(uuid_t_ *u, int dev) {
  if (dev < 0 || dev >= DEVICES) return INVALID_DEVICE;
  memset(u->bytes, 0xf0 + dev, sizeof u->bytes);
  if (getenv("FAKEHIP_NO_UUID")) {
    memset(u->bytes, 0, sizeof u->bytes);
    u->bytes[0] = u->bytes[1] = 'X';
  }
  return OK;
}
EXPORT err_t hipDeviceGetPCIBusId(char *bus, int len, int dev) {
  if (dev < 0 || dev >= DEVICES) return INVALID_DEVICE;
  if (!bus || len < 13) return INVALID_VALUE;
  snprintf(bus, (size_t)len, "0000:%02x:00.0", 0x41 + dev);
  return OK;
}
EXPORT err_t hipMemGetInfo(size_t *free_bytes, size_t *total) {
  *free_bytes = FV_MEMORY - fv_used(current);
  *total = FV_MEMORY;
  return OK;
}
EXPORT err_t hipMemGetAllocationGranularity(size_t *g, const prop_t *prop,
                                            unsigned option) {
  (void)option;
  if (prop->location.id < 0 || prop->location.id >= DEVICES)
    return INVALID_DEVICE;
  return *g = FV_GRANULARITY, OK;
}

/* -------------------------------------------------------- virtual memory */

EXPORT err_t hipMemAddressReserve(void **ptr, size_t size, size_t align,
                                  void *addr, unsigned long long flags) {
  return from_fv(fv_reserve(size, align, (uintptr_t)addr, flags, ptr));
}

EXPORT err_t hipMemAddressFree(void *ptr, size_t size) {
  return from_fv(fv_address_free(ptr, size));
}

EXPORT err_t hipMemCreate(fv_handle_t **out, size_t size, const prop_t *prop,
                          unsigned long long flags) {
  if (flags || prop->type != 1) return INVALID_VALUE;
  if (prop->location.type != 1 || prop->location.id != current)
    return INVALID_DEVICE; /* made on another device than the current one */
  return from_fv(fv_create(size, current, out));
}

EXPORT err_t hipMemRelease(fv_handle_t *h) { return from_fv(fv_release(h)); }

EXPORT err_t hipMemMap(void *ptr, size_t size, size_t offset, fv_handle_t *h,
                       unsigned long long flags) {
  if (flags) return INVALID_VALUE;
  return from_fv(fv_map(ptr, size, offset, h));
}

EXPORT err_t hipMemSetAccess(void *ptr, size_t size, const access_t *desc,
                             size_t count) {
  if (count != 1 || desc->flags != 3 || desc->location.id != current)
    return INVALID_VALUE;
  return from_fv(fv_set_access(ptr, size, current));
}

EXPORT err_t hipMemUnmap(void *ptr, size_t size) {
  return from_fv(fv_unmap(ptr, size));
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

/* hipHostRegisterPortable only: the runtime has no read-only flag. */
EXPORT err_t hipHostRegister(void *ptr, size_t n, unsigned flags) {
  if (flags != 1) return INVALID_VALUE;
  return from_fv(fv_host_register(ptr, n, false));
}

EXPORT err_t hipHostUnregister(void *ptr) {
  return from_fv(fv_host_unregister(ptr));
}

EXPORT const char *hipGetErrorName(err_t e) {
  switch (e) {
  case OK: return "hipSuccess";
  case INVALID_VALUE: return "hipErrorInvalidValue";
  case OUT_OF_MEMORY: return "hipErrorOutOfMemory";
  case INVALID_DEVICE: return "hipErrorInvalidDevice";
  case NOT_MAPPED: return "hipErrorNotMapped";
  case INVALID_HANDLE: return "hipErrorInvalidHandle";
  case HOST_ALREADY_REGISTERED: return "hipErrorHostMemoryAlreadyRegistered";
  case HOST_NOT_REGISTERED: return "hipErrorHostMemoryNotRegistered";
  default: return "hipErrorUnknown";
  }
}
