/* The CUDA backend: NVIDIA GPUs through the driver's virtual memory API.
 *
 * The driver is loaded at run time (libcuda.so.1, nvcuda.dll) and every entry
 * point is resolved with cuGetProcAddress at VP_CU_ABI_VERSION, so vpager
 * builds and runs with no CUDA anywhere; src/cuda_abi.h declares the part
 * of the ABI we use. Without a usable GPU, open returns VP_ENODEV quietly
 * (that is how VP_BACKEND_AUTO falls back to the simulated device) and
 * vp__cuda_open_reason() says why.
 *
 * Each device owns its GPU's primary context: retained at open, pushed
 * around every driver call and popped after it, released at close. So a
 * thread that has another device (or another context) current still talks
 * to the right GPU, and the caller's current context is left as it was.
 * Nothing here synchronises a context or the device.
 */
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cuda_abi.h"
#include "os.h"

#define MiB (1024ull * 1024)

/* The driver's and NVML's file names (docs/windows.md: Windows loads them
 * from System32 by these names). */
#ifdef _WIN32
#define CUDA_LIBRARY "nvcuda.dll"
#define NVML_LIBRARY "nvml.dll"
#else
#define CUDA_LIBRARY "libcuda.so.1"
#define NVML_LIBRARY "libnvidia-ml.so.1"
#endif

_Static_assert(sizeof(size_t) == sizeof(uint64_t), "LP64 only");
_Static_assert(sizeof(void *) == sizeof(vp_cu_init_fn),
               "function pointers are stored from cuGetProcAddress's void *");

typedef struct cu_api {
#define VP__CU_MEMBER(field, symbol, version, params) vp_cu_##field##_fn field;
  VP_CU_ENTRY_POINTS(VP__CU_MEMBER)
#undef VP__CU_MEMBER
} cu_api_t;

/* NVML, loaded on first use (nvmlInit costs ~10 ms) and only if present. */
typedef struct nvml {
  vp__os_mutex_t lock; /* guards everything below */
  bool tried;
  void *lib; /* non-NULL: loaded, initialised, device found */
  vp_nvml_device_t dev;
  vp_nvml_shutdown_fn shutdown;
  vp_nvml_get_memory_info_fn memory_info;
  vp_nvml_get_compute_procs_fn compute_procs; /* may be NULL */
  vp_nvml_get_memory_limits_fn memory_limits; /* may be NULL */
} nvml_t;

typedef struct cuda {
  cu_api_t cu; /* read-only after open */
  void *lib;
  vp__inject_t *inj;
  vp_cu_device_t dev;
  int ordinal;
  vp_cu_context_t pctx; /* the retained primary context */
  bool integrated;      /* shares host memory: free memory from the OS */
  uint64_t granularity;
  uint64_t total;
  vp_cu_mem_alloc_prop_t prop;     /* pinned memory on this device */
  vp_cu_mem_access_desc_t access;  /* read-write for this device */
  vp_cu_uuid_t uuid;
  atomic_uint last_error; /* last failing CUresult, for logs */
  nvml_t nvml;
} cuda_t;

/* ---------------------------------------------------------- results */

/* Why the last failed open on this thread failed (open sets no message). */
static _Thread_local char open_reason[192];

static int open_fail(int code, const char *fmt, ...) VP__PRINTF(2, 3);
static int open_fail(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(open_reason, sizeof open_reason, fmt, ap);
  va_end(ap);
  return code;
}

/* The one mapping from CUresult to VP_E*. */
static int map_result(vp_cu_result_t r) {
  switch (r) {
  case VP_CU_SUCCESS:
    return VP_OK;
  case VP_CU_ERROR_OUT_OF_MEMORY:
    return VP_EOOM;
  /* Worth a bounded retry: work still running, a timed-out wait, an MPS
   * server that is starting or full. */
  case VP_CU_ERROR_NOT_READY:
  case VP_CU_ERROR_TIMEOUT:
  case VP_CU_ERROR_MPS_SERVER_NOT_READY:
  case VP_CU_ERROR_MPS_MAX_CLIENTS_REACHED:
  case VP_CU_ERROR_MPS_MAX_CONNECTIONS_REACHED:
    return VP_EAGAIN;
  /* The caller's arguments or call order; the context is still fine. */
  case VP_CU_ERROR_INVALID_VALUE:
  case VP_CU_ERROR_INVALID_HANDLE:
  case VP_CU_ERROR_INVALID_DEVICE:
  case VP_CU_ERROR_ALREADY_MAPPED:
  case VP_CU_ERROR_NOT_MAPPED:
  case VP_CU_ERROR_NOT_FOUND:
  case VP_CU_ERROR_ILLEGAL_STATE:
  case VP_CU_ERROR_NOT_PERMITTED:
  case VP_CU_ERROR_NOT_SUPPORTED:
  case VP_CU_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
  case VP_CU_ERROR_HOST_MEMORY_NOT_REGISTERED:
    return VP_EINVAL;
  default:
    break;
  }
  /* Stream capture misuse (900-908) is the caller's too. */
  if (r >= VP_CU_ERROR_STREAM_CAPTURE_UNSUPPORTED &&
      r <= VP_CU_ERROR_STREAM_CAPTURE_WRONG_THREAD)
    return VP_EINVAL;
  /* The rest (ILLEGAL_ADDRESS, LAUNCH_FAILED, ECC_UNCORRECTABLE, ASSERT,
   * CONTEXT_IS_DESTROYED, DEINITIALIZED, MPS client loss, UNKNOWN, codes
   * newer than us, ...) are sticky or unexplained: retrying or carrying
   * on could corrupt data, so the device counts as broken. */
  return VP_EDEVICE;
}

/* Map r, remembering it for vp__cuda_error_name(). NOT_READY is the normal
 * answer of a query and would hide the interesting error. */
static int result(cuda_t *c, vp_cu_result_t r) {
  if (r != VP_CU_SUCCESS && r != VP_CU_ERROR_NOT_READY)
    atomic_store_explicit(&c->last_error, r, memory_order_relaxed);
  return map_result(r);
}

static const char *error_name(cuda_t *c, vp_cu_result_t r) {
  const char *name = NULL;
  if (!c->cu.get_error_name || c->cu.get_error_name(r, &name) || !name)
    return "unknown CUresult";
  return name;
}

/* --------------------------------------------------------- contexts */

/* Make our context current on this thread for one driver call. */
static vp_cu_result_t enter(cuda_t *c) {
  return c->cu.ctx_push_current(c->pctx);
}

/* Undo enter(); keeps the call's result r unless only the pop failed. */
static vp_cu_result_t leave(cuda_t *c, vp_cu_result_t r) {
  vp_cu_context_t popped;
  vp_cu_result_t p = c->cu.ctx_pop_current(&popped);
  return r != VP_CU_SUCCESS ? r : p;
}

/* rc = the VP_ code of `call` made with our context current. `call` runs
 * only if the push succeeded, and the pop follows it. */
#define IN_CTX(c, rc, call)                                                    \
  do {                                                                         \
    vp_cu_result_t r_ = enter(c);                                              \
    if (r_ == VP_CU_SUCCESS) r_ = leave((c), (call));                          \
    (rc) = result((c), r_);                                                    \
  } while (0)

/* Fault injection (tests): fail this call with `code`. The codes are the
 * simulated backend's for the same operation, so one test walks the same
 * rungs on both: VP_EOOM for phys_create, VP_EDEVICE elsewhere. Undo
 * operations never inject (they must not fail), nor do the ones called
 * outside the pager's lock (copies, event_synchronize): the countdown is
 * not atomic. */
#define INJECT(c, code)                                                        \
  do {                                                                         \
    if (vp__inject_fail((c)->inj)) return (code);                              \
  } while (0)

static vp_cu_stream_t as_stream(vp_stream_t s) {
  return (vp_cu_stream_t)(uintptr_t)s; /* 0: the legacy default stream */
}

static vp_cu_event_t as_event(vp__event_t e) {
  return (vp_cu_event_t)(uintptr_t)e;
}

/* ------------------------------------------------------------- open */

static const struct entry_point {
  const char *name;
  size_t offset;
} entry_points[] = {
#define VP__CU_ENTRY(field, symbol, version, params)                           \
  {#symbol, offsetof(cu_api_t, field)},
    VP_CU_ENTRY_POINTS(VP__CU_ENTRY)
#undef VP__CU_ENTRY
};

/* Base names plus our ABI version: the driver picks the variant (e.g.
 * cuMemGetInfo_v2), and LEGACY_STREAM the non-_ptsz one, so stream 0 is
 * the legacy default stream as in any program built without
 * --default-stream per-thread. */
static int resolve(cuda_t *c, vp_cu_get_proc_address_fn gpa) {
  for (size_t i = 0; i < sizeof entry_points / sizeof *entry_points; i++) {
    const struct entry_point *e = &entry_points[i];
    void *fn = NULL;
    vp_cu_proc_query_result_t status = VP_CU_GET_PROC_ADDRESS_SUCCESS;
    vp_cu_result_t r = gpa(e->name, &fn, VP_CU_ABI_VERSION,
                           VP_CU_GET_PROC_ADDRESS_LEGACY_STREAM, &status);
    if (r == VP_CU_ERROR_STUB_LIBRARY)
      return open_fail(VP_ENODEV, CUDA_LIBRARY " is the toolkit's stub "
                       "library, not a driver");
    if (r != VP_CU_SUCCESS || !fn ||
        status != VP_CU_GET_PROC_ADDRESS_SUCCESS)
      return open_fail(VP_ENODEV, "driver has no %s for CUDA %d (CUresult "
                       "%u, status %u)", e->name, VP_CU_ABI_VERSION, r,
                       status);
    memcpy((char *)&c->cu + e->offset, &fn, sizeof fn);
  }
  return VP_OK;
}

/* Load and resolve; undoes itself on failure. The driver starts threads at
 * cuInit and must never be unmapped under them: vp__os_dl_open's library
 * is never unloaded for good. */
static int load_driver(cuda_t *c) {
  char why[160];
  c->lib = vp__os_dl_open(CUDA_LIBRARY, why, sizeof why);
  if (!c->lib) return open_fail(VP_ENODEV, "%s", why);
  void *sym = vp__os_dl_sym(c->lib, "cuGetProcAddress_v2");
  int rc;
  if (!sym) {
    rc = open_fail(VP_ENODEV, CUDA_LIBRARY " has no cuGetProcAddress_v2 "
                   "(driver older than CUDA 12.0)");
  } else {
    vp_cu_get_proc_address_fn gpa;
    memcpy(&gpa, &sym, sizeof gpa);
    rc = resolve(c, gpa);
  }
  if (rc != VP_OK) vp__os_dl_close(c->lib);
  return rc;
}

static int device_attribute(cuda_t *c, vp_cu_device_attribute_t attr,
                            int *value) {
  vp_cu_result_t r = c->cu.device_get_attribute(value, attr, c->dev);
  if (r == VP_CU_SUCCESS) return VP_OK;
  return open_fail(result(c, r), "cuDeviceGetAttribute(%u): %s", attr,
                   error_name(c, r));
}

/* cuInit and the number of devices (*n: 0 on failure). */
static int count_devices(cuda_t *c, int *n) {
  *n = 0;
  vp_cu_result_t r = c->cu.init(0);
  if (r != VP_CU_SUCCESS)
    return open_fail(VP_ENODEV, "cuInit: %s", error_name(c, r));
  r = c->cu.device_get_count(n);
  if (r == VP_CU_SUCCESS) return VP_OK;
  *n = 0;
  return open_fail(VP_ENODEV, "cuDeviceGetCount: %s", error_name(c, r));
}

/* cuInit, the ordinal, and whether the GPU can do what we need. */
static int find_device(cuda_t *c, int index) {
  int n = 0;
  if (count_devices(c, &n)) return VP_ENODEV; /* open_reason says why */
  vp_cu_result_t r;
  if (index < 0 || index >= n)
    return open_fail(VP_ENODEV, "device %d out of range (%d CUDA device%s)",
                     index, n, n == 1 ? "" : "s");
  r = c->cu.device_get(&c->dev, index);
  if (r != VP_CU_SUCCESS)
    return open_fail(VP_ENODEV, "cuDeviceGet(%d): %s", index,
                     error_name(c, r));
  c->ordinal = index;
  int vmm = 0, integrated = 0;
  int rc = device_attribute(
      c, VP_CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, &vmm);
  if (rc == VP_OK && !vmm)
    rc = open_fail(VP_ENODEV, "device %d has no virtual memory management "
                   "(cuMemCreate/cuMemMap)", index);
  if (rc == VP_OK)
    rc = device_attribute(c, VP_CU_DEVICE_ATTRIBUTE_INTEGRATED, &integrated);
  c->integrated = integrated != 0;
  return rc;
}

/* A GPU taken by another process (exclusive mode) or unlicensed is not
 * usable: VP_ENODEV, so AUTO moves on. */
static int retain_context(cuda_t *c) {
  vp_cu_result_t r = c->cu.primary_ctx_retain(&c->pctx, c->dev);
  if (r == VP_CU_SUCCESS) return VP_OK;
  int rc = result(c, r);
  if (r == VP_CU_ERROR_DEVICE_UNAVAILABLE || r == VP_CU_ERROR_NO_DEVICE ||
      r == VP_CU_ERROR_DEVICE_NOT_LICENSED)
    rc = VP_ENODEV;
  return open_fail(rc, "cuDevicePrimaryCtxRetain(%d): %s", c->ordinal,
                   error_name(c, r));
}

/* Room left for everyone else on the card when the user sets none (the
 * figures: vp__default_headroom): the display, other programs, and the
 * framework's activations, workspaces and the driver's page tables. Under
 * WSL2 the card serves the Windows desktop through WDDM (/dev/dxg), which
 * spills to system memory when the card is full. */
static uint64_t default_headroom(uint64_t total) {
  return vp__default_headroom(total, vp__os_gpu_wddm());
}

static void fill_props(cuda_t *c) {
  memset(&c->prop, 0, sizeof c->prop);
  c->prop.type = VP_CU_MEM_ALLOCATION_TYPE_PINNED;
  c->prop.requested_handle_types = VP_CU_MEM_HANDLE_TYPE_NONE;
  c->prop.location.type = VP_CU_MEM_LOCATION_TYPE_DEVICE;
  c->prop.location.id = c->ordinal;
  c->access.location = c->prop.location;
  c->access.flags = VP_CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
}

static int query_caps(cuda_t *c, vp__caps_t *caps) {
  fill_props(c);
  size_t gran = 0, total = 0;
  vp_cu_result_t r = enter(c);
  if (r == VP_CU_SUCCESS) {
    r = c->cu.mem_get_allocation_granularity(
        &gran, &c->prop, VP_CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (r == VP_CU_SUCCESS) r = c->cu.device_total_mem(&total, c->dev);
    if (r == VP_CU_SUCCESS) r = c->cu.device_get_uuid(&c->uuid, c->dev);
    r = leave(c, r);
  }
  if (r != VP_CU_SUCCESS)
    return open_fail(result(c, r), "device %d: granularity, memory size or "
                     "UUID: %s", c->ordinal, error_name(c, r));
  if (gran == 0 || total == 0)
    return open_fail(VP_EDEVICE, "device %d: granularity %zu, memory %zu",
                     c->ordinal, gran, total);
  c->granularity = gran;
  c->total = total;
  *caps = (vp__caps_t){.name = "cuda",
                       .granularity = gran,
                       .total_memory = total,
                       .default_headroom = default_headroom(total),
                       .async_copies = true};
  return VP_OK;
}

/* Injected failures of open are VP_ENOMEM, never VP_ENODEV: AUTO would
 * fall back to the simulated device and hide the rung under test. */
static int cuda_open(const vp_options_t *opts, vp__inject_t *inj, void **ctx,
                     vp__caps_t *caps) {
  open_reason[0] = '\0';
  if (!opts || !ctx || !caps) return open_fail(VP_EINVAL, "NULL argument");
  if (vp__inject_fail(inj)) return open_fail(VP_ENOMEM, "injected failure");
  cuda_t *c = calloc(1, sizeof *c);
  if (!c) return open_fail(VP_ENOMEM, "out of host memory");
  c->inj = inj;
  int rc = load_driver(c);
  if (rc != VP_OK) goto fail_free;
  rc = find_device(c, opts->device_index);
  if (rc != VP_OK) goto fail_unload;
  if (vp__inject_fail(inj)) {
    rc = open_fail(VP_ENOMEM, "injected failure");
    goto fail_unload;
  }
  rc = retain_context(c);
  if (rc != VP_OK) goto fail_unload;
  if (vp__inject_fail(inj)) {
    rc = open_fail(VP_ENOMEM, "injected failure");
    goto fail_release;
  }
  rc = query_caps(c, caps);
  if (rc != VP_OK) goto fail_release;
  if (vp__os_mutex_init(&c->nvml.lock) != 0) {
    rc = open_fail(VP_ENOMEM, "cannot make the NVML lock");
    goto fail_release;
  }
  *ctx = c;
  return VP_OK;

fail_release:
  c->cu.primary_ctx_release(c->dev);
fail_unload:
  vp__os_dl_close(c->lib);
fail_free:
  free(c);
  return rc;
}

static void nvml_unload(cuda_t *c);

static void cuda_close(void *ctx) {
  cuda_t *c = ctx;
  if (!c) return;
  nvml_unload(c);
  vp__os_mutex_destroy(&c->nvml.lock);
  c->cu.primary_ctx_release(c->dev);
  vp__os_dl_close(c->lib);
  free(c);
}

/* ----------------------------------------------------------- memory */

/* Device-wide on Linux: every process's allocations count. An integrated
 * GPU shares host memory, where cuMemGetInfo misses reclaimable page
 * cache; MemAvailable is what can really be had. */
static int cuda_mem_info(void *ctx, uint64_t *free_bytes,
                         uint64_t *total_bytes) {
  cuda_t *c = ctx;
  INJECT(c, VP_EDEVICE);
  uint64_t avail;
  if (c->integrated && (avail = vp__os_ram_available())) {
    *free_bytes = avail < c->total ? avail : c->total;
    *total_bytes = c->total;
    return VP_OK;
  }
  size_t f = 0, t = 0;
  int rc;
  IN_CTX(c, rc, c->cu.mem_get_info(&f, &t));
  if (rc == VP_OK) {
    *free_bytes = f;
    *total_bytes = t;
  }
  return rc;
}

static int cuda_va_reserve(void *ctx, uint64_t size, uint64_t *va) {
  cuda_t *c = ctx;
  INJECT(c, VP_EDEVICE);
  vp_cu_deviceptr_t p = 0;
  int rc;
  IN_CTX(c, rc, c->cu.mem_address_reserve(&p, size, c->granularity, 0, 0));
  if (rc == VP_OK) *va = p;
  return rc;
}

static int cuda_va_free(void *ctx, uint64_t va, uint64_t size) {
  cuda_t *c = ctx;
  int rc;
  IN_CTX(c, rc, c->cu.mem_address_free(va, size));
  return rc;
}

static int cuda_phys_create(void *ctx, uint64_t size, vp__phys_t *phys) {
  cuda_t *c = ctx;
  INJECT(c, VP_EOOM);
  vp_cu_mem_handle_t h = 0;
  int rc;
  IN_CTX(c, rc, c->cu.mem_create(&h, size, &c->prop, 0));
  if (rc == VP_OK) *phys = h;
  return rc;
}

static int cuda_phys_release(void *ctx, vp__phys_t phys, uint64_t size) {
  cuda_t *c = ctx;
  (void)size;
  int rc;
  IN_CTX(c, rc, c->cu.mem_release(phys));
  return rc;
}

static int cuda_map(void *ctx, uint64_t va, uint64_t size, vp__phys_t phys) {
  cuda_t *c = ctx;
  INJECT(c, VP_EDEVICE);
  int rc;
  IN_CTX(c, rc, c->cu.mem_map(va, size, 0, phys, 0));
  return rc;
}

static int cuda_unmap(void *ctx, uint64_t va, uint64_t size) {
  cuda_t *c = ctx;
  int rc;
  IN_CTX(c, rc, c->cu.mem_unmap(va, size));
  return rc;
}

static int cuda_set_access(void *ctx, uint64_t va, uint64_t size) {
  cuda_t *c = ctx;
  INJECT(c, VP_EDEVICE);
  int rc;
  IN_CTX(c, rc, c->cu.mem_set_access(va, size, &c->access, 1));
  return rc;
}

/* ---------------------------------------------------------- streams */

/* Non-blocking: our copy streams never wait for, or hold up, the legacy
 * default stream other code may be using. */
static int cuda_stream_create(void *ctx, vp_stream_t *stream) {
  cuda_t *c = ctx;
  INJECT(c, VP_EDEVICE);
  vp_cu_stream_t s = NULL;
  int rc;
  IN_CTX(c, rc, c->cu.stream_create(&s, VP_CU_STREAM_NON_BLOCKING));
  if (rc == VP_OK) *stream = (vp_stream_t)(uintptr_t)s;
  return rc;
}

static int cuda_stream_destroy(void *ctx, vp_stream_t stream) {
  cuda_t *c = ctx;
  int rc;
  IN_CTX(c, rc, c->cu.stream_destroy(as_stream(stream)));
  return rc;
}

/* Waits even when injected to fail: callers free memory after it. */
static int cuda_stream_synchronize(void *ctx, vp_stream_t stream) {
  cuda_t *c = ctx;
  bool injected = vp__inject_fail(c->inj);
  int rc;
  IN_CTX(c, rc, c->cu.stream_synchronize(as_stream(stream)));
  return injected && rc == VP_OK ? VP_EDEVICE : rc;
}

static int cuda_synchronize(void *ctx) {
  cuda_t *c = ctx;
  bool injected = vp__inject_fail(c->inj);
  int rc;
  IN_CTX(c, rc, c->cu.ctx_synchronize());
  return injected && rc == VP_OK ? VP_EDEVICE : rc;
}

static int cuda_stream_wait_event(void *ctx, vp_stream_t stream,
                                  vp__event_t ev) {
  cuda_t *c = ctx;
  INJECT(c, VP_EDEVICE);
  int rc;
  IN_CTX(c, rc, c->cu.stream_wait_event(as_stream(stream), as_event(ev), 0));
  return rc;
}

/* No timing: cheaper to record and query, and all a fence needs. */
static int cuda_event_create(void *ctx, vp__event_t *ev) {
  cuda_t *c = ctx;
  INJECT(c, VP_EDEVICE);
  vp_cu_event_t e = NULL;
  int rc;
  IN_CTX(c, rc, c->cu.event_create(&e, VP_CU_EVENT_DISABLE_TIMING));
  if (rc == VP_OK) *ev = (vp__event_t)(uintptr_t)e;
  return rc;
}

static int cuda_event_destroy(void *ctx, vp__event_t ev) {
  cuda_t *c = ctx;
  int rc;
  IN_CTX(c, rc, c->cu.event_destroy(as_event(ev)));
  return rc;
}

static int cuda_event_record(void *ctx, vp__event_t ev, vp_stream_t stream) {
  cuda_t *c = ctx;
  INJECT(c, VP_EDEVICE);
  int rc;
  IN_CTX(c, rc, c->cu.event_record(as_event(ev), as_stream(stream)));
  return rc;
}

/* VP_OK when complete; NOT_READY maps to VP_EAGAIN. */
static int cuda_event_query(void *ctx, vp__event_t ev) {
  cuda_t *c = ctx;
  INJECT(c, VP_EDEVICE);
  int rc;
  IN_CTX(c, rc, c->cu.event_query(as_event(ev)));
  return rc;
}

static int cuda_event_synchronize(void *ctx, vp__event_t ev) {
  cuda_t *c = ctx;
  int rc;
  IN_CTX(c, rc, c->cu.event_synchronize(as_event(ev)));
  return rc;
}

/* ----------------------------------------------------------- copies */

static int cuda_copy_htod(void *ctx, uint64_t dst, const void *src,
                          uint64_t size, vp_stream_t stream) {
  cuda_t *c = ctx;
  int rc;
  IN_CTX(c, rc, c->cu.memcpy_htod_async(dst, src, size, as_stream(stream)));
  return rc;
}

static int cuda_copy_dtoh(void *ctx, void *dst, uint64_t src, uint64_t size,
                          vp_stream_t stream) {
  cuda_t *c = ctx;
  int rc;
  IN_CTX(c, rc, c->cu.memcpy_dtoh_async(dst, src, size, as_stream(stream)));
  return rc;
}

/* PORTABLE: one registration serves every context, so a host copy of the
 * weights can feed several devices. Memory that cannot be pinned for
 * writing (a read-only file mapping: a safetensors file used in place) is
 * pinned READ_ONLY (CUDA 11.1+): the device only reads host sources.
 * Pinning is only an optimisation: any refusal short of a broken device
 * (already registered by someone else, RLIMIT_MEMLOCK, memory that cannot
 * be pinned) is VP_EUNSUPPORTED, and the memory stays as it was, which is
 * still correct. The caller must not unregister what it did not
 * register. */
static int cuda_host_register(void *ctx, void *ptr, uint64_t size) {
  cuda_t *c = ctx;
  INJECT(c, VP_EDEVICE);
  int rc;
  IN_CTX(c, rc,
         c->cu.mem_host_register(ptr, size, VP_CU_MEMHOSTREGISTER_PORTABLE));
  if (rc != VP_OK && rc != VP_EDEVICE)
    IN_CTX(c, rc,
           c->cu.mem_host_register(ptr, size,
                                   VP_CU_MEMHOSTREGISTER_PORTABLE |
                                       VP_CU_MEMHOSTREGISTER_READ_ONLY));
  if (rc != VP_OK && rc != VP_EDEVICE) rc = VP_EUNSUPPORTED;
  return rc;
}

static int cuda_host_unregister(void *ctx, void *ptr) {
  cuda_t *c = ctx;
  int rc;
  IN_CTX(c, rc, c->cu.mem_host_unregister(ptr));
  return rc;
}

/* ------------------------------------------------------------- NVML */

/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", NVML's form of the UUID. */
static void format_uuid(const vp_cu_uuid_t *u, const char *prefix,
                        char out[48]) {
  const unsigned char *b = (const unsigned char *)u->bytes;
  int n = snprintf(out, 48, "%s", prefix);
  for (int i = 0; i < 16 && n < 47; i++) {
    n += snprintf(out + n, (size_t)(48 - n), "%02x", b[i]);
    if ((i == 3 || i == 5 || i == 7 || i == 9) && n < 47) out[n++] = '-';
  }
  out[n < 48 ? n : 47] = '\0';
}

void vp__cuda_uuid(void *ctx, char out[48]) {
  cuda_t *c = ctx;
  format_uuid(&c->uuid, "GPU-", out);
}

/* By UUID, not index: NVML and CUDA may number GPUs differently
 * (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER). A MIG instance is "MIG-". */
static bool nvml_find(cuda_t *c, vp_nvml_get_handle_by_uuid_fn by_uuid) {
  static const char *const prefixes[] = {"GPU-", "MIG-"};
  for (size_t i = 0; i < 2; i++) {
    char text[48];
    format_uuid(&c->uuid, prefixes[i], text);
    if (by_uuid(text, &c->nvml.dev) == VP_NVML_SUCCESS) return true;
  }
  return false;
}

/* Called once, with nvml.lock held. Leaves nvml.lib NULL on any failure:
 * NVML is optional. */
static void nvml_load(cuda_t *c) {
  nvml_t *n = &c->nvml;
  n->tried = true;
  void *lib = vp__os_dl_open(NVML_LIBRARY, NULL, 0);
  if (!lib) return;
  vp_nvml_init_fn init;
  vp_nvml_get_handle_by_uuid_fn by_uuid;
  void *s_init = vp__os_dl_sym(lib, "nvmlInit_v2");
  void *s_shut = vp__os_dl_sym(lib, "nvmlShutdown");
  void *s_uuid = vp__os_dl_sym(lib, "nvmlDeviceGetHandleByUUID");
  void *s_mem = vp__os_dl_sym(lib, "nvmlDeviceGetMemoryInfo");
  void *s_procs = vp__os_dl_sym(lib, "nvmlDeviceGetComputeRunningProcesses_v3");
  if (!s_init || !s_shut || !s_uuid || !s_mem) goto fail_close;
  memcpy(&init, &s_init, sizeof init);
  memcpy(&n->shutdown, &s_shut, sizeof n->shutdown);
  memcpy(&by_uuid, &s_uuid, sizeof by_uuid);
  memcpy(&n->memory_info, &s_mem, sizeof n->memory_info);
  memcpy(&n->compute_procs, &s_procs, sizeof n->compute_procs);
  void *s_limits = vp__os_dl_sym(lib, "nvmlDeviceGetMemoryLimits_v1");
  memcpy(&n->memory_limits, &s_limits, sizeof n->memory_limits);
  if (init() != VP_NVML_SUCCESS) goto fail_close;
  if (!nvml_find(c, by_uuid)) goto fail_shutdown;
  n->lib = lib;
  return;

fail_shutdown:
  n->shutdown();
fail_close:
  vp__os_dl_close(lib);
}

static void nvml_unload(cuda_t *c) {
  if (!c->nvml.lib) return;
  c->nvml.shutdown();
  vp__os_dl_close(c->nvml.lib);
  c->nvml.lib = NULL;
}

/* Sum of this process's entries; UINT64_MAX when unknown (no _v3 entry
 * point, or our pid is not listed, e.g. from inside a PID namespace). */
static uint64_t nvml_proc_used(cuda_t *c) {
  if (!c->nvml.compute_procs) return UINT64_MAX;
  vp_nvml_process_info_t small[32], *infos = small;
  unsigned int count = 32;
  vp_nvml_return_t r = c->nvml.compute_procs(c->nvml.dev, &count, infos);
  if (r == VP_NVML_ERROR_INSUFFICIENT_SIZE) {
    count += 16; /* room for processes starting meanwhile */
    infos = calloc(count, sizeof *infos);
    if (!infos) return UINT64_MAX;
    r = c->nvml.compute_procs(c->nvml.dev, &count, infos);
  }
  uint64_t used = UINT64_MAX;
  unsigned int pid = (unsigned int)vp__os_pid();
  for (unsigned int i = 0; r == VP_NVML_SUCCESS && i < count; i++)
    if (infos[i].pid == pid && infos[i].used_gpu_memory != UINT64_MAX)
      used = (used == UINT64_MAX ? 0 : used) + infos[i].used_gpu_memory;
  if (infos != small) free(infos);
  return used;
}

/* The soft limit NVML reports for this process's cgroup on this GPU
 * (bytes); 0 when there is none: no NVML, a driver without
 * nvmlDeviceGetMemoryLimits_v1, no cgroup v2, no MPS v3 / dmem limit. */
int vp__cuda_soft_limit(void *ctx, uint64_t *bytes) {
  cuda_t *c = ctx;
  *bytes = 0;
  char cg[600];
  if (!vp__os_cgroup_path(cg, sizeof cg)) return VP_OK;
  vp__os_mutex_lock(&c->nvml.lock);
  if (!c->nvml.tried) nvml_load(c);
  vp_nvml_memory_limits_t lim;
  memset(&lim, 0, sizeof lim);
  lim.name_space = cg;
  if (c->nvml.lib && c->nvml.memory_limits &&
      c->nvml.memory_limits(c->nvml.dev, &lim) == VP_NVML_SUCCESS)
    *bytes = lim.soft_limit;
  vp__os_mutex_unlock(&c->nvml.lock);
  return VP_OK;
}

/* Device memory as NVML sees it (used, total) and this process's own use
 * (UINT64_MAX: unknown). VP_EUNSUPPORTED without NVML. The first call loads
 * NVML (~10 ms); later ones cost a few µs. Thread-safe. */
int vp__cuda_nvml_info(void *ctx, uint64_t *dev_used, uint64_t *dev_total,
                       uint64_t *proc_used) {
  cuda_t *c = ctx;
  int rc = VP_EUNSUPPORTED;
  vp__os_mutex_lock(&c->nvml.lock);
  if (!c->nvml.tried) nvml_load(c);
  vp_nvml_memory_t mem;
  if (c->nvml.lib &&
      c->nvml.memory_info(c->nvml.dev, &mem) == VP_NVML_SUCCESS) {
    *dev_used = mem.used;
    *dev_total = mem.total;
    *proc_used = nvml_proc_used(c);
    rc = VP_OK;
  }
  vp__os_mutex_unlock(&c->nvml.lock);
  return rc;
}

/* ---------------------------------------------------------- helpers */

const char *vp__cuda_open_reason(void) { return open_reason; }

int vp__cuda_device_count(int *count) {
  *count = 0;
  open_reason[0] = '\0';
  cuda_t *c = calloc(1, sizeof *c);
  if (!c) return open_fail(VP_ENOMEM, "out of host memory");
  int rc = load_driver(c);
  if (rc == VP_OK) {
    count_devices(c, count); /* on failure 0, and open_reason says why */
    vp__os_dl_close(c->lib);
  }
  free(c);
  return VP_OK; /* no driver, or no device: 0, and open_reason says why */
}

/* Name of the last failing CUresult of this device ("CUDA_SUCCESS" if
 * none): for the pager's log line after a backend error. */
const char *vp__cuda_error_name(void *ctx) {
  cuda_t *c = ctx;
  return error_name(
      c, atomic_load_explicit(&c->last_error, memory_order_relaxed));
}

const vp__backend_t vp__backend_cuda = {
    .name = "cuda",
    .open = cuda_open,
    .close = cuda_close,
    .mem_info = cuda_mem_info,
    .va_reserve = cuda_va_reserve,
    .va_free = cuda_va_free,
    .phys_create = cuda_phys_create,
    .phys_release = cuda_phys_release,
    .map = cuda_map,
    .unmap = cuda_unmap,
    .set_access = cuda_set_access,
    .stream_create = cuda_stream_create,
    .stream_destroy = cuda_stream_destroy,
    .stream_synchronize = cuda_stream_synchronize,
    .synchronize = cuda_synchronize,
    .stream_wait_event = cuda_stream_wait_event,
    .event_create = cuda_event_create,
    .event_destroy = cuda_event_destroy,
    .event_record = cuda_event_record,
    .event_query = cuda_event_query,
    .event_synchronize = cuda_event_synchronize,
    .copy_htod = cuda_copy_htod,
    .copy_dtoh = cuda_copy_dtoh,
    .host_register = cuda_host_register,
    .host_unregister = cuda_host_unregister,
    .launch = NULL,
    .inject = NULL,
};
