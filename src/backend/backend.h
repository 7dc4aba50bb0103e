/* The device interface: the only way from the pager to a device.
 *
 * Rules, for every operation below:
 *  - Each returns VP_OK or a negative VP_E* code, and sets no message: the
 *    caller (src/page.c, src/pager.c, src/api.c) names the address, size and
 *    call in its message. VP_EOOM means out of device memory, VP_EAGAIN a
 *    transient failure worth a bounded retry, VP_EDEVICE a broken device;
 *    anything else is a bug in the caller's arguments.
 *  - Addresses and sizes given to the memory operations are multiples of
 *    caps.granularity and non-zero; a mapping covers exactly one physical
 *    allocation (a page). Where caps.map_twice, a page may be mapped and
 *    made accessible at a second address too, unmapped there first.
 *  - A page is usable only after phys_create, map and set_access, in that
 *    order; it is undone by unmap then phys_release. Undoing drops the data
 *    and removes access, so a later touch faults.
 *  - Streams and events: work on one stream runs in order; an event recorded
 *    on a stream completes when everything queued before it has. event_query
 *    returns VP_OK when complete, VP_EAGAIN when not yet. Stream 0 is the
 *    backend's default stream. Nothing here synchronises the whole device.
 *  - The backend holds no lock of the pager's; the pager calls it with its
 *    device lock held, except for the copy and launch operations.
 *  - ctx is the backend's own per-device state, made by open.
 */
#ifndef VPAGER_BACKEND_H
#define VPAGER_BACKEND_H

#include <stdbool.h>
#include <stdint.h>

#include "vpager.h"

/* A physical allocation (CUmemGenericAllocationHandle; HIP's handle, a
 * pointer, as an integer) and an event (CUevent, hipEvent_t, or the
 * simulated equivalent). */
typedef uint64_t vp__phys_t;
typedef uint64_t vp__event_t;

/* Counts down the calls that may fail under fault injection (tests walk
 * every failure rung of open this way). nth <= 0 disables it. Shared by the
 * backend's calls and the pager's allocations. */
typedef struct vp__inject {
  int64_t nth;
} vp__inject_t;
/* true when this call must fail (the countdown reached zero). */
bool vp__inject_fail(vp__inject_t *inj);
/* options.c: the headroom a GPU keeps free when the user gives none (wddm:
 * the card serves a Windows desktop, WSL2's included). */
uint64_t vp__default_headroom(uint64_t total, bool wddm);

typedef struct vp__caps {
  const char *name;        /* "cuda", "hip" or "sim": in logs and stats */
  uint64_t granularity;    /* bytes; page sizes are multiples of it */
  uint64_t total_memory;   /* bytes of device memory */
  uint64_t default_headroom; /* headroom when the user gives none */
  bool async_copies;       /* copies may complete after the call returns */
  bool map_twice;          /* a page may be mapped (and made accessible) at
                              a second address: two views of one memory */
} vp__caps_t;

typedef struct vp__backend {
  const char *name;
  /* Open the device of opts (device_index, sim_* fields) and fill caps.
   * VP_ENODEV when this backend has no usable device. */
  int (*open)(const vp_options_t *opts, vp__inject_t *inj, void **ctx,
              vp__caps_t *caps);
  void (*close)(void *ctx); /* every page and range already freed */

  /* Device-wide memory (every process's use counts). */
  int (*mem_info)(void *ctx, uint64_t *free_bytes, uint64_t *total_bytes);

  int (*va_reserve)(void *ctx, uint64_t size, uint64_t *va);
  int (*va_free)(void *ctx, uint64_t va, uint64_t size);
  int (*phys_create)(void *ctx, uint64_t size, vp__phys_t *phys);
  int (*phys_release)(void *ctx, vp__phys_t phys, uint64_t size);
  int (*map)(void *ctx, uint64_t va, uint64_t size, vp__phys_t phys);
  int (*unmap)(void *ctx, uint64_t va, uint64_t size);
  int (*set_access)(void *ctx, uint64_t va, uint64_t size);

  int (*stream_create)(void *ctx, vp_stream_t *stream);
  int (*stream_destroy)(void *ctx, vp_stream_t stream);
  int (*stream_synchronize)(void *ctx, vp_stream_t stream);
  /* Wait for all work queued on the device so far, every stream's (on
   * CUDA the context's, so the framework's streams too). */
  int (*synchronize)(void *ctx);
  /* The stream waits (on the device, not the host) for the event. */
  int (*stream_wait_event)(void *ctx, vp_stream_t stream, vp__event_t ev);

  int (*event_create)(void *ctx, vp__event_t *ev);
  int (*event_destroy)(void *ctx, vp__event_t ev);
  int (*event_record)(void *ctx, vp__event_t ev, vp_stream_t stream);
  int (*event_query)(void *ctx, vp__event_t ev);
  int (*event_synchronize)(void *ctx, vp__event_t ev);

  int (*copy_htod)(void *ctx, uint64_t dst, const void *src, uint64_t size,
                   vp_stream_t stream);
  int (*copy_dtoh)(void *ctx, void *dst, uint64_t src, uint64_t size,
                   vp_stream_t stream);
  /* copy_htod's bytes read by `programs` thread blocks of a kernel (the
   * device's SMs pull them over the link) instead of the copy engine,
   * which takes copies in queue order whatever their stream: a client's
   * own copies then do not wait behind these. VP_EUNSUPPORTED, nothing
   * queued, where it cannot (the caller copies as usual); NULL: never. */
  int (*copy_htod_sm)(void *ctx, uint64_t dst, const void *src, uint64_t size,
                      vp_stream_t stream, uint32_t programs);
  /* Page-lock existing host memory for fast copies (VP_EUNSUPPORTED: the
   * memory stays pageable, which is still correct). */
  int (*host_register)(void *ctx, void *ptr, uint64_t size);
  int (*host_unregister)(void *ctx, void *ptr);

  /* Simulated device only (NULL elsewhere): run fn(arg) in stream order,
   * and fault injection (vp_sim_inject_kind_t). */
  int (*launch)(void *ctx, vp_stream_t stream, void (*fn)(void *), void *arg);
  int (*inject)(void *ctx, int kind, uint64_t n);
} vp__backend_t;

/* The backends, in the order VP_BACKEND_AUTO tries them. */
extern const vp__backend_t vp__backend_cuda;
extern const vp__backend_t vp__backend_hip;
extern const vp__backend_t vp__backend_sim;

/* The GPU backends (vmm.c: CUDA's and HIP's operations): why the last
 * open on this thread failed ("" if unknown); the driver's name for ctx's
 * last failing call; the device's UUID as text after prefix ("GPU-"; 48
 * bytes with the NUL). */
const char *vp__vmm_open_reason(void);
const char *vp__vmm_error_name(void *ctx);
void vp__vmm_uuid_text(const void *ctx, const char *prefix, char out[48]);

/* CUDA backend extras (src/backend/cuda.c). CUDA devices the driver sees
 * (0 without a driver or a device, and then vp__vmm_open_reason says why);
 * never fails but for VP_ENOMEM. Device memory as NVML sees it and this
 * process's own use. */
int vp__cuda_device_count(int *count);
/* HIP devices the runtime sees (0 without one, and then
 * vp__vmm_open_reason says why); never fails. Tests: load `name` instead
 * of the runtime's file names (before the process's first load). */
int vp__hip_device_count(int *count);
void vp__hip_use_library(const char *name);
int vp__cuda_nvml_info(void *ctx, uint64_t *dev_used, uint64_t *dev_total,
                       uint64_t *proc_used);
/* The platform's soft memory limit for this process on the device (bytes,
 * 0: none): NVML's for our cgroup on CUDA; VP_SIM_SET_SOFT_LIMIT's on the
 * simulated device. */
int vp__cuda_soft_limit(void *ctx, uint64_t *bytes);
int vp__sim_soft_limit(void *ctx, uint64_t *bytes);

#endif /* VPAGER_BACKEND_H */
