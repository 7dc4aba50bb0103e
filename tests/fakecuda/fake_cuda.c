/* A stand-in for NVIDIA's driver library (libcuda.so.1) over host memory,
 * so that the CUDA backend (src/backend/cuda.c and vmm.c under it) runs the
 * pager suite on a machine without a GPU: `make check-cuda-fake` builds it
 * as $(BUILD)/fakecuda/libcuda.so.1 and runs `runner cuda/` with that
 * folder first on LD_LIBRARY_PATH, so cuda.c loads it by its usual name.
 *
 * cuGetProcAddress_v2 is the one export cuda.c looks up; it hands out the
 * entry points of cuda_abi.h's list, each the variant the real driver
 * gives at its version (older requests are refused, as are the per-thread
 * default stream variants nobody here implements). Device memory is
 * tests/fakegpu/fake_vmm.c's. Two devices of 1 GiB.
 *
 * Strict where the driver is, and where cuda.c could go wrong: nothing but
 * cuGetProcAddress, cuGetErrorName and cuDriverGetVersion before cuInit;
 * contexts are the devices' primary ones, pushed and popped on a
 * per-thread stack, gone when their last retain is released; memory
 * information, streams, events, copies, host registration and
 * cuCtxSynchronize need a live context current, and a stream or event of
 * another context than the current one is refused (the CUDA_ERROR_INVALID_
 * HANDLE of using a resource across contexts); copies need their device
 * range mapped and made accessible. The virtual memory calls need no
 * context, as in the driver (they name their device), but the memory must
 * be made on the device its context-free properties name: the current
 * context's cuMemGetInfo counts it there. Copies run at once, but an event's
 * first query after its record says CUDA_ERROR_NOT_READY, as work still
 * queued on a GPU may, unless a wait (stream, event or context
 * synchronize) in its context came between: after one, every event
 * recorded before it is complete (more than a GPU promises, never less).
 *
 * vp_fake_cuda_driver marks the stand-in: the runner skips the tests that
 * load PTX and call the driver themselves (test_gpu.c) when it sees it.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "cuda_abi.h"
#include "fake_vmm.h"

#define EXPORT __attribute__((visibility("default")))
#define DRIVER_VERSION 12040
#define CONTEXT_DEPTH 32
#define STREAMS 256
#define EVENTS 4096

/* The marker the runner looks for (tests/runner.c). */
EXPORT const char vp_fake_cuda_driver[] = "tests/fakecuda/fake_cuda.c";

struct vp_cu_ctx_st {
  int device;
  int retains; /* 0: inactive, its streams and events gone */
};
/* A stream's or event's place in its table: first in both. */
typedef struct slot {
  vp_cu_context_t ctx;
  bool live;
} slot_t;
struct vp_cu_stream_st {
  slot_t slot;
};
struct vp_cu_event_st {
  slot_t slot;
  bool queued; /* recorded, not yet seen complete */
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER; /* all below */
static bool initialized;
static struct vp_cu_ctx_st contexts[FV_DEVICES];
static struct vp_cu_stream_st streams[STREAMS];
static struct vp_cu_event_st events[EVENTS];

/* The thread's context stack: the current context on top. */
static _Thread_local vp_cu_context_t stack[CONTEXT_DEPTH];
static _Thread_local int depth;

static vp_cu_result_t from_fv(fv_status_t st) {
  switch (st) {
  case FV_OK: return VP_CU_SUCCESS;
  case FV_OUT_OF_MEMORY: return VP_CU_ERROR_OUT_OF_MEMORY;
  case FV_INVALID_DEVICE: return VP_CU_ERROR_INVALID_DEVICE;
  case FV_INVALID_HANDLE: return VP_CU_ERROR_INVALID_HANDLE;
  case FV_NOT_MAPPED: return VP_CU_ERROR_NOT_MAPPED;
  case FV_ALREADY_MAPPED: return VP_CU_ERROR_ALREADY_MAPPED;
  case FV_HOST_REGISTERED: return VP_CU_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
  case FV_HOST_NOT_REGISTERED: return VP_CU_ERROR_HOST_MEMORY_NOT_REGISTERED;
  default: return VP_CU_ERROR_INVALID_VALUE;
  }
}

static vp_cu_result_t ready(void) {
  pthread_mutex_lock(&lock);
  bool ok = initialized;
  pthread_mutex_unlock(&lock);
  return ok ? VP_CU_SUCCESS : VP_CU_ERROR_NOT_INITIALIZED;
}

static bool valid_device(vp_cu_device_t dev) {
  return dev >= 0 && dev < FV_DEVICES;
}

/* A question about device dev, its answer to go to out. */
static vp_cu_result_t device_query(const void *out, vp_cu_device_t dev) {
  vp_cu_result_t r = ready();
  if (r != VP_CU_SUCCESS) return r;
  if (!out) return VP_CU_ERROR_INVALID_VALUE;
  return valid_device(dev) ? VP_CU_SUCCESS : VP_CU_ERROR_INVALID_DEVICE;
}

/* The current context, live; lock held. */
static vp_cu_result_t current_locked(vp_cu_context_t *ctx) {
  if (!initialized) return VP_CU_ERROR_NOT_INITIALIZED;
  if (depth == 0) return VP_CU_ERROR_INVALID_CONTEXT;
  *ctx = stack[depth - 1];
  return (*ctx)->retains ? VP_CU_SUCCESS : VP_CU_ERROR_CONTEXT_IS_DESTROYED;
}

static vp_cu_result_t current(vp_cu_context_t *ctx) {
  pthread_mutex_lock(&lock);
  vp_cu_result_t r = current_locked(ctx);
  pthread_mutex_unlock(&lock);
  return r;
}

/* A stream usable now: the default stream (NULL) or a live stream of the
 * current context; lock held. */
static vp_cu_result_t stream_here(vp_cu_stream_t s, vp_cu_context_t *ctx) {
  vp_cu_result_t r = current_locked(ctx);
  if (r == VP_CU_SUCCESS && s && (!s->slot.live || s->slot.ctx != *ctx))
    r = VP_CU_ERROR_INVALID_HANDLE;
  return r;
}

/* A wait in ctx: everything recorded there so far is complete. Lock
 * held. */
static void settle(vp_cu_context_t ctx) {
  for (int i = 0; i < EVENTS; i++)
    if (events[i].slot.ctx == ctx) events[i].queued = false;
}

/* wait: the call waits for the stream (see settle). */
static vp_cu_result_t use_stream(vp_cu_stream_t s, bool wait) {
  vp_cu_context_t ctx;
  pthread_mutex_lock(&lock);
  vp_cu_result_t r = stream_here(s, &ctx);
  if (r == VP_CU_SUCCESS && wait) settle(ctx);
  pthread_mutex_unlock(&lock);
  return r;
}

/* ------------------------------------------------- driver and devices */

static vp_cu_result_t fake_init(unsigned int flags) {
  if (flags) return VP_CU_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&lock);
  initialized = true;
  for (int d = 0; d < FV_DEVICES; d++) contexts[d].device = d;
  pthread_mutex_unlock(&lock);
  return VP_CU_SUCCESS;
}

static vp_cu_result_t fake_driver_get_version(int *version) {
  if (!version) return VP_CU_ERROR_INVALID_VALUE;
  *version = DRIVER_VERSION;
  return VP_CU_SUCCESS;
}

static vp_cu_result_t fake_device_get_count(int *count) {
  vp_cu_result_t r = ready();
  if (r == VP_CU_SUCCESS && !count) r = VP_CU_ERROR_INVALID_VALUE;
  if (r == VP_CU_SUCCESS) *count = FV_DEVICES;
  return r;
}

static vp_cu_result_t fake_device_get(vp_cu_device_t *dev, int ordinal) {
  vp_cu_result_t r = device_query(dev, ordinal);
  if (r == VP_CU_SUCCESS) *dev = ordinal;
  return r;
}

static vp_cu_result_t fake_device_total_mem(size_t *bytes, vp_cu_device_t dev) {
  vp_cu_result_t r = device_query(bytes, dev);
  if (r == VP_CU_SUCCESS) *bytes = FV_MEMORY;
  return r;
}

static vp_cu_result_t fake_device_get_attribute(int *value,
                                                vp_cu_device_attribute_t attr,
                                                vp_cu_device_t dev) {
  vp_cu_result_t r = device_query(value, dev);
  /* VMM supported; not integrated (it has memory of its own). */
  if (r == VP_CU_SUCCESS)
    *value = attr == VP_CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED;
  return r;
}

static vp_cu_result_t fake_device_get_uuid(vp_cu_uuid_t *uuid,
                                           vp_cu_device_t dev) {
  vp_cu_result_t r = device_query(uuid, dev);
  if (r == VP_CU_SUCCESS) memset(uuid->bytes, 0xc0 + dev, sizeof uuid->bytes);
  return r;
}

/* ----------------------------------------------------------- contexts */

static vp_cu_result_t fake_primary_ctx_retain(vp_cu_context_t *ctx,
                                              vp_cu_device_t dev) {
  vp_cu_result_t r = device_query(ctx, dev);
  if (r != VP_CU_SUCCESS) return r;
  pthread_mutex_lock(&lock);
  contexts[dev].retains++;
  *ctx = &contexts[dev];
  pthread_mutex_unlock(&lock);
  return VP_CU_SUCCESS;
}

/* The last release makes the context inactive: its streams and events go
 * with it. */
static vp_cu_result_t fake_primary_ctx_release(vp_cu_device_t dev) {
  vp_cu_result_t r = ready();
  if (r != VP_CU_SUCCESS) return r;
  if (!valid_device(dev)) return VP_CU_ERROR_INVALID_DEVICE;
  pthread_mutex_lock(&lock);
  vp_cu_context_t ctx = &contexts[dev];
  if (ctx->retains == 0) {
    r = VP_CU_ERROR_INVALID_CONTEXT;
  } else if (--ctx->retains == 0) {
    for (int i = 0; i < STREAMS; i++)
      if (streams[i].slot.ctx == ctx) streams[i].slot.live = false;
    for (int i = 0; i < EVENTS; i++)
      if (events[i].slot.ctx == ctx) events[i].slot.live = false;
  }
  pthread_mutex_unlock(&lock);
  return r;
}

/* Not vpager's: for tests/test_cuda.c, whether the backend let go of its
 * retains (cuDevicePrimaryCtxGetState). */
typedef vp_cu_result_t (*primary_ctx_get_state_fn)(vp_cu_device_t dev,
                                                   unsigned int *flags,
                                                   int *active);
static vp_cu_result_t fake_primary_ctx_get_state(vp_cu_device_t dev,
                                                 unsigned int *flags,
                                                 int *active) {
  vp_cu_result_t r = device_query(flags, dev);
  if (r != VP_CU_SUCCESS) return r;
  if (!active) return VP_CU_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&lock);
  *flags = 0;
  *active = contexts[dev].retains > 0;
  pthread_mutex_unlock(&lock);
  return VP_CU_SUCCESS;
}

static vp_cu_result_t fake_ctx_push_current(vp_cu_context_t ctx) {
  vp_cu_result_t r = ready();
  if (r != VP_CU_SUCCESS) return r;
  bool known = false;
  for (int d = 0; d < FV_DEVICES; d++) known |= ctx == &contexts[d];
  if (!known) return VP_CU_ERROR_INVALID_CONTEXT;
  if (depth == CONTEXT_DEPTH) return VP_CU_ERROR_OUT_OF_MEMORY;
  pthread_mutex_lock(&lock);
  bool active = ctx->retains > 0;
  pthread_mutex_unlock(&lock);
  if (!active) return VP_CU_ERROR_INVALID_CONTEXT;
  stack[depth++] = ctx;
  return VP_CU_SUCCESS;
}

static vp_cu_result_t fake_ctx_pop_current(vp_cu_context_t *ctx) {
  vp_cu_result_t r = ready();
  if (r != VP_CU_SUCCESS) return r;
  if (depth == 0) return VP_CU_ERROR_INVALID_CONTEXT;
  vp_cu_context_t top = stack[--depth];
  if (ctx) *ctx = top;
  return VP_CU_SUCCESS;
}

static vp_cu_result_t fake_synchronize(void) {
  vp_cu_context_t ctx;
  pthread_mutex_lock(&lock);
  vp_cu_result_t r = current_locked(&ctx);
  if (r == VP_CU_SUCCESS) settle(ctx);
  pthread_mutex_unlock(&lock);
  return r;
}

/* ------------------------------------------------------------- memory */

static vp_cu_result_t fake_mem_get_info(size_t *free_bytes, size_t *total) {
  vp_cu_context_t ctx;
  vp_cu_result_t r = current(&ctx);
  if (r != VP_CU_SUCCESS) return r;
  if (!free_bytes || !total) return VP_CU_ERROR_INVALID_VALUE;
  *free_bytes = FV_MEMORY - fv_used(ctx->device);
  *total = FV_MEMORY;
  return VP_CU_SUCCESS;
}

/* Pinned device memory, no shareable handle, on a device that exists. */
static bool valid_prop(const vp_cu_mem_alloc_prop_t *prop) {
  return prop && prop->type == VP_CU_MEM_ALLOCATION_TYPE_PINNED &&
         prop->requested_handle_types == VP_CU_MEM_HANDLE_TYPE_NONE &&
         prop->location.type == VP_CU_MEM_LOCATION_TYPE_DEVICE &&
         valid_device(prop->location.id);
}

static vp_cu_result_t fake_mem_get_allocation_granularity(
    size_t *granularity, const vp_cu_mem_alloc_prop_t *prop,
    vp_cu_granularity_flags_t option) {
  vp_cu_result_t r = ready();
  if (r != VP_CU_SUCCESS) return r;
  if (!granularity || !valid_prop(prop) || option > 1)
    return VP_CU_ERROR_INVALID_VALUE;
  *granularity = FV_GRANULARITY;
  return VP_CU_SUCCESS;
}

static vp_cu_result_t fake_mem_address_reserve(vp_cu_deviceptr_t *ptr,
                                               size_t size, size_t alignment,
                                               vp_cu_deviceptr_t addr,
                                               unsigned long long flags) {
  vp_cu_result_t r = ready();
  if (r != VP_CU_SUCCESS) return r;
  if (!ptr) return VP_CU_ERROR_INVALID_VALUE;
  void *p = NULL;
  r = from_fv(fv_reserve(size, alignment, (uintptr_t)addr, flags, &p));
  if (r == VP_CU_SUCCESS) *ptr = (vp_cu_deviceptr_t)(uintptr_t)p;
  return r;
}

static vp_cu_result_t fake_mem_address_free(vp_cu_deviceptr_t ptr,
                                            size_t size) {
  vp_cu_result_t r = ready();
  if (r != VP_CU_SUCCESS) return r;
  return from_fv(fv_address_free((void *)(uintptr_t)ptr, size));
}

static vp_cu_result_t fake_mem_create(vp_cu_mem_handle_t *handle, size_t size,
                                      const vp_cu_mem_alloc_prop_t *prop,
                                      unsigned long long flags) {
  vp_cu_result_t r = ready();
  if (r != VP_CU_SUCCESS) return r;
  if (!handle || !valid_prop(prop) || flags) return VP_CU_ERROR_INVALID_VALUE;
  fv_handle_t *h = NULL;
  r = from_fv(fv_create(size, prop->location.id, &h));
  if (r == VP_CU_SUCCESS) *handle = (vp_cu_mem_handle_t)(uintptr_t)h;
  return r;
}

static fv_handle_t *as_handle(vp_cu_mem_handle_t h) {
  return (fv_handle_t *)(uintptr_t)h;
}

static vp_cu_result_t fake_mem_release(vp_cu_mem_handle_t handle) {
  vp_cu_result_t r = ready();
  if (r != VP_CU_SUCCESS) return r;
  return from_fv(fv_release(as_handle(handle)));
}

static vp_cu_result_t fake_mem_map(vp_cu_deviceptr_t ptr, size_t size,
                                   size_t offset, vp_cu_mem_handle_t handle,
                                   unsigned long long flags) {
  vp_cu_result_t r = ready();
  if (r != VP_CU_SUCCESS) return r;
  if (flags) return VP_CU_ERROR_INVALID_VALUE;
  return from_fv(fv_map((void *)(uintptr_t)ptr, size, offset,
                        as_handle(handle)));
}

static vp_cu_result_t fake_mem_unmap(vp_cu_deviceptr_t ptr, size_t size) {
  vp_cu_result_t r = ready();
  if (r != VP_CU_SUCCESS) return r;
  return from_fv(fv_unmap((void *)(uintptr_t)ptr, size));
}

static vp_cu_result_t fake_mem_set_access(vp_cu_deviceptr_t ptr, size_t size,
                                          const vp_cu_mem_access_desc_t *desc,
                                          size_t count) {
  vp_cu_result_t r = ready();
  if (r != VP_CU_SUCCESS) return r;
  if (!desc || count != 1 ||
      desc->location.type != VP_CU_MEM_LOCATION_TYPE_DEVICE ||
      !valid_device(desc->location.id) ||
      desc->flags != VP_CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    return VP_CU_ERROR_INVALID_VALUE;
  return from_fv(fv_set_access((void *)(uintptr_t)ptr, size,
                               desc->location.id));
}

/* ---------------------------------------------------- streams, events */

/* A free place of a table of n objects of `size` bytes, each starting
 * with its slot_t, zeroed and given to the current context. */
static vp_cu_result_t take_slot(void *table, size_t n, size_t size,
                                void **out) {
  vp_cu_context_t ctx;
  pthread_mutex_lock(&lock);
  vp_cu_result_t r = current_locked(&ctx);
  if (r == VP_CU_SUCCESS) r = VP_CU_ERROR_OUT_OF_MEMORY;
  for (size_t i = 0; r == VP_CU_ERROR_OUT_OF_MEMORY && i < n; i++) {
    slot_t *slot = (slot_t *)((char *)table + i * size);
    if (slot->live) continue;
    memset(slot, 0, size);
    *slot = (slot_t){ctx, true};
    *out = slot;
    r = VP_CU_SUCCESS;
  }
  pthread_mutex_unlock(&lock);
  return r;
}

static vp_cu_result_t fake_stream_create(vp_cu_stream_t *stream,
                                         unsigned int flags) {
  if (!stream || flags > VP_CU_STREAM_NON_BLOCKING)
    return VP_CU_ERROR_INVALID_VALUE;
  void *s = NULL;
  vp_cu_result_t r = take_slot(streams, STREAMS, sizeof *streams, &s);
  if (r == VP_CU_SUCCESS) *stream = s;
  return r;
}

/* A live stream or event, with a context current (any: a stream or an
 * event may be destroyed, an event queried, from another); lock held. */
static vp_cu_result_t live_slot(const slot_t *slot) {
  vp_cu_context_t ctx;
  vp_cu_result_t r = current_locked(&ctx);
  if (r == VP_CU_SUCCESS && (!slot || !slot->live))
    r = VP_CU_ERROR_INVALID_HANDLE;
  return r;
}

static vp_cu_result_t drop_slot(slot_t *slot) {
  pthread_mutex_lock(&lock);
  vp_cu_result_t r = live_slot(slot);
  if (r == VP_CU_SUCCESS) slot->live = false;
  pthread_mutex_unlock(&lock);
  return r;
}

static vp_cu_result_t fake_stream_destroy(vp_cu_stream_t stream) {
  return drop_slot(stream ? &stream->slot : NULL);
}

static vp_cu_result_t fake_stream_synchronize(vp_cu_stream_t stream) {
  return use_stream(stream, true);
}

static vp_cu_result_t fake_stream_wait_event(vp_cu_stream_t stream,
                                             vp_cu_event_t event,
                                             unsigned int flags) {
  vp_cu_context_t ctx;
  pthread_mutex_lock(&lock);
  vp_cu_result_t r = stream_here(stream, &ctx);
  if (r == VP_CU_SUCCESS && flags) r = VP_CU_ERROR_INVALID_VALUE;
  if (r == VP_CU_SUCCESS && (!event || !event->slot.live))
    r = VP_CU_ERROR_INVALID_HANDLE; /* an event of any context will do */
  pthread_mutex_unlock(&lock);
  return r;
}

static vp_cu_result_t fake_event_create(vp_cu_event_t *event,
                                        unsigned int flags) {
  if (!event || flags & ~3u) return VP_CU_ERROR_INVALID_VALUE;
  void *e = NULL;
  vp_cu_result_t r = take_slot(events, EVENTS, sizeof *events, &e);
  if (r == VP_CU_SUCCESS) *event = e;
  return r;
}

static vp_cu_result_t event_here(vp_cu_event_t event) {
  return live_slot(event ? &event->slot : NULL);
}

static vp_cu_result_t fake_event_destroy(vp_cu_event_t event) {
  return drop_slot(event ? &event->slot : NULL);
}

/* The event, the stream and the current context must all be one. */
static vp_cu_result_t fake_event_record(vp_cu_event_t event,
                                        vp_cu_stream_t stream) {
  vp_cu_context_t ctx;
  pthread_mutex_lock(&lock);
  vp_cu_result_t r = stream_here(stream, &ctx);
  if (r == VP_CU_SUCCESS &&
      (!event || !event->slot.live || event->slot.ctx != ctx))
    r = VP_CU_ERROR_INVALID_HANDLE;
  if (r == VP_CU_SUCCESS) event->queued = true;
  pthread_mutex_unlock(&lock);
  return r;
}

/* Not ready the first time after a record, as if the GPU were busy. */
static vp_cu_result_t fake_event_query(vp_cu_event_t event) {
  pthread_mutex_lock(&lock);
  vp_cu_result_t r = event_here(event);
  if (r == VP_CU_SUCCESS && event->queued) {
    event->queued = false;
    r = VP_CU_ERROR_NOT_READY;
  }
  pthread_mutex_unlock(&lock);
  return r;
}

static vp_cu_result_t fake_event_synchronize(vp_cu_event_t event) {
  pthread_mutex_lock(&lock);
  vp_cu_result_t r = event_here(event);
  if (r == VP_CU_SUCCESS) settle(event->slot.ctx);
  pthread_mutex_unlock(&lock);
  return r;
}

/* ------------------------------------------------------------- copies */

static vp_cu_result_t fake_memcpy_htod_async(vp_cu_deviceptr_t dst,
                                             const void *src, size_t size,
                                             vp_cu_stream_t stream) {
  vp_cu_result_t r = use_stream(stream, false);
  if (r == VP_CU_SUCCESS && !src) r = VP_CU_ERROR_INVALID_VALUE;
  if (r == VP_CU_SUCCESS) r = from_fv(fv_accessible(dst, size));
  if (r == VP_CU_SUCCESS) memcpy((void *)(uintptr_t)dst, src, size);
  return r;
}

static vp_cu_result_t fake_memcpy_dtoh_async(void *dst, vp_cu_deviceptr_t src,
                                             size_t size,
                                             vp_cu_stream_t stream) {
  vp_cu_result_t r = use_stream(stream, false);
  if (r == VP_CU_SUCCESS && !dst) r = VP_CU_ERROR_INVALID_VALUE;
  if (r == VP_CU_SUCCESS) r = from_fv(fv_accessible(src, size));
  if (r == VP_CU_SUCCESS) memcpy(dst, (const void *)(uintptr_t)src, size);
  return r;
}

/* PORTABLE, DEVICEMAP, IOMEMORY, READ_ONLY: the flags cuMemHostRegister
 * knows. */
static vp_cu_result_t fake_mem_host_register(void *ptr, size_t size,
                                             unsigned int flags) {
  vp_cu_context_t ctx;
  vp_cu_result_t r = current(&ctx);
  if (r != VP_CU_SUCCESS) return r;
  if (flags & ~15u) return VP_CU_ERROR_INVALID_VALUE;
  bool read_only = flags & VP_CU_MEMHOSTREGISTER_READ_ONLY;
  return from_fv(fv_host_register(ptr, size, read_only));
}

static vp_cu_result_t fake_mem_host_unregister(void *ptr) {
  vp_cu_context_t ctx;
  vp_cu_result_t r = current(&ctx);
  if (r != VP_CU_SUCCESS) return r;
  return from_fv(fv_host_unregister(ptr));
}

/* ------------------------------------------------- the copy by SMs */

/* One module, one function: vp_pull (src/backend/pull.cu), which copies
 * as cuMemcpyHtoDAsync does. */
static struct vp_cu_mod_st { int unused; } pull_module;
static struct vp_cu_func_st { int unused; } pull_fn;

static vp_cu_result_t fake_module_load_data(vp_cu_module_t *module,
                                            const void *image) {
  vp_cu_context_t ctx;
  vp_cu_result_t r = current(&ctx);
  if (r != VP_CU_SUCCESS) return r;
  if (!module || !image || !strstr(image, ".entry vp_pull"))
    return VP_CU_ERROR_INVALID_VALUE;
  *module = &pull_module;
  return VP_CU_SUCCESS;
}

static vp_cu_result_t fake_module_unload(vp_cu_module_t module) {
  return module == &pull_module ? VP_CU_SUCCESS : VP_CU_ERROR_INVALID_HANDLE;
}

static vp_cu_result_t fake_module_get_function(vp_cu_function_t *fn,
                                               vp_cu_module_t module,
                                               const char *name) {
  if (!fn || module != &pull_module || !name) return VP_CU_ERROR_INVALID_VALUE;
  if (strcmp(name, "vp_pull") != 0) return VP_CU_ERROR_NOT_FOUND;
  *fn = &pull_fn;
  return VP_CU_SUCCESS;
}

/* vp_pull(dst, src, n): the host bytes must be registered (mapped). */
static vp_cu_result_t fake_launch_kernel(
    vp_cu_function_t fn, unsigned int gx, unsigned int gy, unsigned int gz,
    unsigned int bx, unsigned int by, unsigned int bz, unsigned int shmem,
    vp_cu_stream_t stream, void **params, void **extra) {
  (void)shmem;
  if (fn != &pull_fn || !params || extra || !gx || !gy || !gz || !bx ||
      !by || !bz || bx * by * bz > 1024)
    return VP_CU_ERROR_INVALID_VALUE;
  vp_cu_deviceptr_t dst = *(vp_cu_deviceptr_t *)params[0];
  vp_cu_deviceptr_t src = *(vp_cu_deviceptr_t *)params[1];
  unsigned long long n = *(unsigned long long *)params[2];
  if ((dst | src) & 15 ||
      from_fv(fv_host_registered((const void *)(uintptr_t)src)) !=
          VP_CU_SUCCESS)
    return VP_CU_ERROR_ILLEGAL_ADDRESS;     /* as the kernel would fault */
  return fake_memcpy_htod_async(dst, (const void *)(uintptr_t)src, n, stream);
}

static vp_cu_result_t fake_mem_host_get_device_pointer(vp_cu_deviceptr_t *dp,
                                                       void *p,
                                                       unsigned int flags) {
  if (!dp || flags) return VP_CU_ERROR_INVALID_VALUE;
  if (from_fv(fv_host_registered(p)) != VP_CU_SUCCESS)
    return VP_CU_ERROR_INVALID_VALUE;
  *dp = (vp_cu_deviceptr_t)(uintptr_t)p;    /* unified addressing */
  return VP_CU_SUCCESS;
}

/* -------------------------------------------------------------- names */

static vp_cu_result_t fake_get_error_name(vp_cu_result_t error,
                                          const char **name) {
  static const struct {
    vp_cu_result_t code;
    const char *name;
  } names[] = {
      {VP_CU_SUCCESS, "CUDA_SUCCESS"},
      {VP_CU_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE"},
      {VP_CU_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY"},
      {VP_CU_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED"},
      {VP_CU_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE"},
      {VP_CU_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT"},
      {VP_CU_ERROR_ALREADY_MAPPED, "CUDA_ERROR_ALREADY_MAPPED"},
      {VP_CU_ERROR_NOT_MAPPED, "CUDA_ERROR_NOT_MAPPED"},
      {VP_CU_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE"},
      {VP_CU_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND"},
      {VP_CU_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY"},
      {VP_CU_ERROR_CONTEXT_IS_DESTROYED, "CUDA_ERROR_CONTEXT_IS_DESTROYED"},
      {VP_CU_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
       "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"},
      {VP_CU_ERROR_HOST_MEMORY_NOT_REGISTERED,
       "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"},
  };
  if (!name) return VP_CU_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < sizeof names / sizeof *names; i++)
    if (names[i].code == error) {
      *name = names[i].name;
      return VP_CU_SUCCESS;
    }
  *name = NULL; /* the driver's answer for a code it does not know */
  return VP_CU_ERROR_INVALID_VALUE;
}

/* ---------------------------------------------------- cuGetProcAddress */

/* Every entry point of cuda_abi.h's list, of its function type there. */
static const struct fakes {
#define FAKE_MEMBER(field, symbol, version, params) vp_cu_##field##_fn field;
  VP_CU_ENTRY_POINTS(FAKE_MEMBER)
  VP_CU_PULL_ENTRY_POINTS(FAKE_MEMBER)
#undef FAKE_MEMBER
  primary_ctx_get_state_fn primary_ctx_get_state;
} fakes = {
#define FAKE_FILL(field, symbol, version, params) .field = fake_##field,
    VP_CU_ENTRY_POINTS(FAKE_FILL)
    VP_CU_PULL_ENTRY_POINTS(FAKE_FILL)
#undef FAKE_FILL
    .primary_ctx_get_state = fake_primary_ctx_get_state,
};

static const struct {
  const char *symbol;
  int version; /* the first CUDA version that hands out this variant */
  size_t offset; /* in fakes */
} entry_points[] = {
#define FAKE_ENTRY(field, symbol, version, params)                             \
  {#symbol, version, offsetof(struct fakes, field)},
    VP_CU_ENTRY_POINTS(FAKE_ENTRY)
    VP_CU_PULL_ENTRY_POINTS(FAKE_ENTRY)
#undef FAKE_ENTRY
    {"cuDevicePrimaryCtxGetState", 7000,
     offsetof(struct fakes, primary_ctx_get_state)},
};

/* Legacy default stream variants only (flags 1, or 0: the default, which
 * is legacy too for a program built without per-thread streams). */
EXPORT vp_cu_result_t cuGetProcAddress_v2(const char *symbol, void **pfn,
                                          int cuda_version, uint64_t flags,
                                          vp_cu_proc_query_result_t *status) {
  vp_cu_proc_query_result_t st = VP_CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  vp_cu_result_t r = VP_CU_ERROR_NOT_FOUND;
  if (!symbol || !pfn || flags > 2) return VP_CU_ERROR_INVALID_VALUE;
  *pfn = NULL;
  for (size_t i = 0; flags != 2 && i < sizeof entry_points /
                                        sizeof *entry_points; i++) {
    if (strcmp(symbol, entry_points[i].symbol) != 0) continue;
    if (cuda_version < entry_points[i].version) {
      st = VP_CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
      break;
    }
    memcpy(pfn, (const char *)&fakes + entry_points[i].offset, sizeof *pfn);
    st = VP_CU_GET_PROC_ADDRESS_SUCCESS;
    r = VP_CU_SUCCESS;
    break;
  }
  if (status) *status = st;
  return r;
}
