/* The GPU backends' common part (vmm.h): the backend operations over a
 * driver with CUDA's virtual memory API, for cuda.c and hip.c.
 *
 * Every driver call is made with the device current (the driver's enter
 * and leave around it), its result mapped through the driver's code table.
 * Nothing here synchronises a context or the device but synchronize.
 */
#include "vmm.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "os.h"

/* ---------------------------------------------------------- results */

/* Why the last failed open on this thread failed (open sets no message). */
static _Thread_local char open_reason[192];

int vp__vmm_open_fail(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(open_reason, sizeof open_reason, fmt, ap);
  va_end(ap);
  return code;
}

const char *vp__vmm_open_reason(void) { return open_reason; }

void vp__vmm_open_reset(void) { open_reason[0] = '\0'; }

vp__vmm_t *vp__vmm_open_begin(const vp_options_t *opts, vp__inject_t *inj,
                              void **ctx, vp__caps_t *caps, size_t size,
                              int *rc) {
  vp__vmm_open_reset();
  if (!opts || !ctx || !caps) {
    *rc = vp__vmm_open_fail(VP_EINVAL, "NULL argument");
    return NULL;
  }
  if (vp__inject_fail(inj)) {
    *rc = vp__vmm_open_fail(VP_ENOMEM, "injected failure");
    return NULL;
  }
  vp__vmm_t *g = calloc(1, size);
  if (!g) {
    *rc = vp__vmm_open_fail(VP_ENOMEM, "out of host memory");
    return NULL;
  }
  g->inj = inj;
  *rc = VP_OK;
  return g;
}

/* The one mapping from a driver result to VP_E*: the driver's table, and
 * VP_EDEVICE for the rest (sticky or unexplained errors, codes newer than
 * us: retrying or carrying on could corrupt data). */
static int map_result(const vp__vmm_driver_t *drv, vp_cu_result_t r) {
  for (size_t i = 0; i < drv->n_codes; i++)
    if (r >= drv->codes[i].first && r <= drv->codes[i].last)
      return drv->codes[i].rc;
  return VP_EDEVICE;
}

/* Map r, remembering it for vp__vmm_error_name(). Not-ready is the normal
 * answer of a query and would hide the interesting error. */
int vp__vmm_result(vp__vmm_t *g, vp_cu_result_t r) {
  if (r != VP_CU_SUCCESS && r != g->drv->not_ready)
    atomic_store_explicit(&g->last_error, r, memory_order_relaxed);
  return map_result(g->drv, r);
}

static const char *error_name(const vp__vmm_t *g, vp_cu_result_t r) {
  return g->drv->error_name(g, r);
}

/* Name of the last failing result of this device (the driver's name of
 * success if none): for the pager's log line after a backend error. */
const char *vp__vmm_error_name(void *ctx) {
  vp__vmm_t *g = ctx;
  return error_name(
      g, atomic_load_explicit(&g->last_error, memory_order_relaxed));
}

/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (NVML's and nvidia-smi's
 * form, with prefix "GPU-"). */
void vp__vmm_uuid_text(const void *ctx, const char *prefix, char out[48]) {
  const vp__vmm_t *g = ctx;
  const unsigned char *b = (const unsigned char *)g->uuid.bytes;
  int n = snprintf(out, 48, "%s", prefix);
  for (int i = 0; i < 16 && n < 47; i++) {
    n += snprintf(out + n, (size_t)(48 - n), "%02x", b[i]);
    if ((i == 3 || i == 5 || i == 7 || i == 9) && n < 47) out[n++] = '-';
  }
  out[n < 48 ? n : 47] = '\0';
}

/* rc = the VP_ code of `call` made with the device current. `call` runs
 * only if entering succeeded, and leaving follows it. */
#define ON_DEVICE(g, rc, call)                                                 \
  do {                                                                         \
    vp_cu_result_t r_ = (g)->drv->enter(g);                                    \
    if (r_ == VP_CU_SUCCESS) r_ = (g)->drv->leave((g), (call));                \
    (rc) = vp__vmm_result((g), r_);                                            \
  } while (0)

/* Fault injection (tests): fail this call with `code`. The codes are the
 * simulated backend's for the same operation, so one test walks the same
 * rungs on both: VP_EOOM for phys_create, VP_EDEVICE elsewhere. Undo
 * operations never inject (they must not fail), nor do the ones called
 * outside the pager's lock (copies, event_synchronize): the countdown is
 * not atomic. */
#define INJECT(g, code)                                                        \
  do {                                                                         \
    if (vp__inject_fail((g)->inj)) return (code);                              \
  } while (0)

static vp_cu_stream_t as_stream(vp_stream_t s) {
  return (vp_cu_stream_t)(uintptr_t)s; /* 0: the default stream */
}

static vp_cu_event_t as_event(vp__event_t e) {
  return (vp_cu_event_t)(uintptr_t)e;
}

/* ------------------------------------------------------------- open */

static int device_attribute(vp__vmm_t *g, unsigned int attr, int *value) {
  vp_cu_result_t r = g->api.device_get_attribute(value, attr, g->dev);
  if (r == VP_CU_SUCCESS) return VP_OK;
  return vp__vmm_open_fail(vp__vmm_result(g, r), "%s(%u): %s",
                           g->drv->calls.attribute, attr, error_name(g, r));
}

int vp__vmm_count_devices(vp__vmm_t *g, int *n) {
  *n = 0;
  vp_cu_result_t r = g->api.init(0);
  if (r != VP_CU_SUCCESS)
    return vp__vmm_open_fail(VP_ENODEV, "%s: %s", g->drv->calls.init,
                             error_name(g, r));
  r = g->api.device_get_count(n);
  if (r == VP_CU_SUCCESS) return VP_OK;
  *n = 0;
  return vp__vmm_open_fail(VP_ENODEV, "%s: %s", g->drv->calls.count,
                           error_name(g, r));
}

int vp__vmm_find_device(vp__vmm_t *g, int index) {
  int n = 0;
  if (vp__vmm_count_devices(g, &n)) return VP_ENODEV; /* the reason is set */
  if (index < 0 || index >= n)
    return vp__vmm_open_fail(VP_ENODEV, "device %d out of range (%d %s "
                             "device%s)", index, n, g->drv->what,
                             n == 1 ? "" : "s");
  vp_cu_result_t r = g->api.device_get(&g->dev, index);
  if (r != VP_CU_SUCCESS)
    return vp__vmm_open_fail(VP_ENODEV, "%s(%d): %s", g->drv->calls.get,
                             index, error_name(g, r));
  g->ordinal = index;
  int vmm = 0, integrated = 0;
  int rc = device_attribute(g, g->drv->attr_vmm, &vmm);
  if (rc == VP_OK && !vmm)
    rc = vp__vmm_open_fail(VP_ENODEV, "device %d has no virtual memory "
                           "management (%s)", index, g->drv->calls.vmm);
  if (rc == VP_OK)
    rc = device_attribute(g, g->drv->attr_integrated, &integrated);
  g->integrated = integrated != 0;
  return rc;
}

/* Room left for everyone else on the card when the user sets none (the
 * figures: vp__default_headroom): the display, other programs, and the
 * framework's activations, workspaces and the driver's page tables. Under
 * WDDM (Windows, and WSL2's /dev/dxg) the card serves the desktop and
 * spills to system memory when it is full. */
static uint64_t default_headroom(uint64_t total) {
  return vp__default_headroom(total, vp__os_gpu_wddm());
}

static void fill_props(vp__vmm_t *g) {
  memset(&g->prop, 0, sizeof g->prop);
  g->prop.type = VP_CU_MEM_ALLOCATION_TYPE_PINNED;
  g->prop.requested_handle_types = VP_CU_MEM_HANDLE_TYPE_NONE;
  g->prop.location.type = VP_CU_MEM_LOCATION_TYPE_DEVICE;
  g->prop.location.id = g->ordinal;
  g->access.location = g->prop.location;
  g->access.flags = VP_CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
}

int vp__vmm_query_caps(vp__vmm_t *g, vp__caps_t *caps) {
  fill_props(g);
  size_t gran = 0, total = 0;
  vp_cu_result_t r = g->drv->enter(g);
  if (r == VP_CU_SUCCESS) {
    r = g->api.mem_get_allocation_granularity(
        &gran, &g->prop, VP_CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (r == VP_CU_SUCCESS) r = g->api.device_total_mem(&total, g->dev);
    if (r == VP_CU_SUCCESS) r = g->api.device_get_uuid(&g->uuid, g->dev);
    r = g->drv->leave(g, r);
  }
  if (r != VP_CU_SUCCESS)
    return vp__vmm_open_fail(vp__vmm_result(g, r), "device %d: granularity, "
                             "memory size or UUID: %s", g->ordinal,
                             error_name(g, r));
  if (gran == 0 || total == 0)
    return vp__vmm_open_fail(VP_EDEVICE, "device %d: granularity %zu, "
                             "memory %zu", g->ordinal, gran, total);
  g->granularity = gran;
  g->total = total;
  *caps = (vp__caps_t){.name = g->drv->name,
                       .granularity = gran,
                       .total_memory = total,
                       .default_headroom = default_headroom(total),
                       .async_copies = true,
                       .map_twice = g->drv->map_twice};
  return VP_OK;
}

/* ----------------------------------------------------------- memory */

/* Device-wide on Linux: every process's allocations count. An integrated
 * GPU shares host memory, where the driver's figure misses reclaimable
 * page cache; the RAM available (MemAvailable) is what can really be had. */
int vp__vmm_mem_info(void *ctx, uint64_t *free_bytes, uint64_t *total_bytes) {
  vp__vmm_t *g = ctx;
  INJECT(g, VP_EDEVICE);
  uint64_t avail;
  if (g->integrated && (avail = vp__os_ram_available())) {
    *free_bytes = avail < g->total ? avail : g->total;
    *total_bytes = g->total;
    return VP_OK;
  }
  size_t f = 0, t = 0;
  int rc;
  ON_DEVICE(g, rc, g->api.mem_get_info(&f, &t));
  if (rc == VP_OK) {
    *free_bytes = f;
    *total_bytes = t;
  }
  return rc;
}

int vp__vmm_va_reserve(void *ctx, uint64_t size, uint64_t *va) {
  vp__vmm_t *g = ctx;
  INJECT(g, VP_EDEVICE);
  vp_cu_deviceptr_t p = 0;
  int rc;
  ON_DEVICE(g, rc, g->api.mem_address_reserve(&p, size, g->granularity, 0, 0));
  if (rc == VP_OK) *va = p;
  return rc;
}

int vp__vmm_va_free(void *ctx, uint64_t va, uint64_t size) {
  vp__vmm_t *g = ctx;
  int rc;
  ON_DEVICE(g, rc, g->api.mem_address_free(va, size));
  return rc;
}

int vp__vmm_phys_create(void *ctx, uint64_t size, vp__phys_t *phys) {
  vp__vmm_t *g = ctx;
  INJECT(g, VP_EOOM);
  vp_cu_mem_handle_t h = 0;
  int rc;
  ON_DEVICE(g, rc, g->api.mem_create(&h, size, &g->prop, 0));
  if (rc == VP_OK) *phys = h;
  return rc;
}

int vp__vmm_phys_release(void *ctx, vp__phys_t phys, uint64_t size) {
  vp__vmm_t *g = ctx;
  (void)size;
  int rc;
  ON_DEVICE(g, rc, g->api.mem_release(phys));
  return rc;
}

int vp__vmm_map(void *ctx, uint64_t va, uint64_t size, vp__phys_t phys) {
  vp__vmm_t *g = ctx;
  INJECT(g, VP_EDEVICE);
  int rc;
  ON_DEVICE(g, rc, g->api.mem_map(va, size, 0, phys, 0));
  return rc;
}

int vp__vmm_unmap(void *ctx, uint64_t va, uint64_t size) {
  vp__vmm_t *g = ctx;
  int rc;
  ON_DEVICE(g, rc, g->api.mem_unmap(va, size));
  return rc;
}

int vp__vmm_set_access(void *ctx, uint64_t va, uint64_t size) {
  vp__vmm_t *g = ctx;
  INJECT(g, VP_EDEVICE);
  int rc;
  ON_DEVICE(g, rc, g->api.mem_set_access(va, size, &g->access, 1));
  return rc;
}

/* ---------------------------------------------------------- streams */

/* Non-blocking: our copy streams never wait for, or hold up, the legacy
 * default stream other code may be using. */
int vp__vmm_stream_create(void *ctx, vp_stream_t *stream) {
  vp__vmm_t *g = ctx;
  INJECT(g, VP_EDEVICE);
  vp_cu_stream_t s = NULL;
  int rc;
  ON_DEVICE(g, rc, g->api.stream_create(&s, VP_CU_STREAM_NON_BLOCKING));
  if (rc == VP_OK) *stream = (vp_stream_t)(uintptr_t)s;
  return rc;
}

int vp__vmm_stream_destroy(void *ctx, vp_stream_t stream) {
  vp__vmm_t *g = ctx;
  int rc;
  ON_DEVICE(g, rc, g->api.stream_destroy(as_stream(stream)));
  return rc;
}

/* Waits even when injected to fail: callers free memory after it. */
int vp__vmm_stream_synchronize(void *ctx, vp_stream_t stream) {
  vp__vmm_t *g = ctx;
  bool injected = vp__inject_fail(g->inj);
  int rc;
  ON_DEVICE(g, rc, g->api.stream_synchronize(as_stream(stream)));
  return injected && rc == VP_OK ? VP_EDEVICE : rc;
}

int vp__vmm_synchronize(void *ctx) {
  vp__vmm_t *g = ctx;
  bool injected = vp__inject_fail(g->inj);
  int rc;
  ON_DEVICE(g, rc, g->api.synchronize());
  return injected && rc == VP_OK ? VP_EDEVICE : rc;
}

int vp__vmm_stream_wait_event(void *ctx, vp_stream_t stream, vp__event_t ev) {
  vp__vmm_t *g = ctx;
  INJECT(g, VP_EDEVICE);
  int rc;
  ON_DEVICE(g, rc,
            g->api.stream_wait_event(as_stream(stream), as_event(ev), 0));
  return rc;
}

/* No timing: cheaper to record and query, and all a fence needs. */
int vp__vmm_event_create(void *ctx, vp__event_t *ev) {
  vp__vmm_t *g = ctx;
  INJECT(g, VP_EDEVICE);
  vp_cu_event_t e = NULL;
  int rc;
  ON_DEVICE(g, rc, g->api.event_create(&e, VP_CU_EVENT_DISABLE_TIMING));
  if (rc == VP_OK) *ev = (vp__event_t)(uintptr_t)e;
  return rc;
}

int vp__vmm_event_destroy(void *ctx, vp__event_t ev) {
  vp__vmm_t *g = ctx;
  int rc;
  ON_DEVICE(g, rc, g->api.event_destroy(as_event(ev)));
  return rc;
}

int vp__vmm_event_record(void *ctx, vp__event_t ev, vp_stream_t stream) {
  vp__vmm_t *g = ctx;
  INJECT(g, VP_EDEVICE);
  int rc;
  ON_DEVICE(g, rc, g->api.event_record(as_event(ev), as_stream(stream)));
  return rc;
}

/* VP_OK when complete; not-ready maps to VP_EAGAIN. */
int vp__vmm_event_query(void *ctx, vp__event_t ev) {
  vp__vmm_t *g = ctx;
  INJECT(g, VP_EDEVICE);
  int rc;
  ON_DEVICE(g, rc, g->api.event_query(as_event(ev)));
  return rc;
}

int vp__vmm_event_synchronize(void *ctx, vp__event_t ev) {
  vp__vmm_t *g = ctx;
  int rc;
  ON_DEVICE(g, rc, g->api.event_synchronize(as_event(ev)));
  return rc;
}

/* ----------------------------------------------------------- copies */

int vp__vmm_copy_htod(void *ctx, uint64_t dst, const void *src, uint64_t size,
                      vp_stream_t stream) {
  vp__vmm_t *g = ctx;
  int rc;
  ON_DEVICE(g, rc, g->api.memcpy_htod_async(dst, src, size, as_stream(stream)));
  return rc;
}

int vp__vmm_copy_dtoh(void *ctx, void *dst, uint64_t src, uint64_t size,
                      vp_stream_t stream) {
  vp__vmm_t *g = ctx;
  int rc;
  ON_DEVICE(g, rc, g->api.memcpy_dtoh_async(dst, src, size, as_stream(stream)));
  return rc;
}

/* PORTABLE: one registration serves every context, so a host copy of the
 * weights can feed several devices (the driver's host_register_flags:
 * CUDA's add DEVICEMAP, for the copies by SMs). Memory that cannot be
 * pinned for writing (a read-only file mapping: a safetensors file used
 * in place) is refused at once and stays pageable: CUDA's READ_ONLY flag
 * would pin it, but on the H200 VM (driver 580) that call did not return
 * for a 64 MiB piece of a file mapping in page cache (bench/RESULTS.md,
 * 2026-12-05), and a load that hangs is worse than a copy. Pinning is only an
 * optimisation: any refusal short of a broken device (already registered
 * by someone else, RLIMIT_MEMLOCK, memory that cannot be pinned) is
 * VP_EUNSUPPORTED, and the memory stays as it was, which is still correct.
 * The caller must not unregister what it did not register. */
int vp__vmm_host_register(void *ctx, void *ptr, uint64_t size) {
  vp__vmm_t *g = ctx;
  INJECT(g, VP_EDEVICE);
  int rc;
  ON_DEVICE(g, rc, g->api.mem_host_register(ptr, size,
                                            g->drv->host_register_flags));
  if (rc != VP_OK && rc != VP_EDEVICE) rc = VP_EUNSUPPORTED;
  return rc;
}

int vp__vmm_host_unregister(void *ctx, void *ptr) {
  vp__vmm_t *g = ctx;
  int rc;
  ON_DEVICE(g, rc, g->api.mem_host_unregister(ptr));
  return rc;
}
