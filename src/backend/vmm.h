/* The GPU backends' common part: a driver with CUDA's virtual memory API.
 *
 * CUDA's driver API and HIP (ROCm) have the same virtual memory management
 * calls (reserve, create, map, set access, unmap, release), streams, events
 * and host registration, with the same argument shapes. So the backend
 * operations are written once, in vmm.c, against the entry points of
 * vp__vmm_api_t, in CUDA's shape (cuda_abi.h's function types); cuda.c and
 * hip.c are driver adapters: they load their library, fill the table, and
 * describe their driver in a vp__vmm_driver_t (how to make the device
 * current, what each result code means, a few names and constants).
 *
 * A backend's ctx starts with a vp__vmm_t, which the shared operations
 * take as their ctx.
 */
#ifndef VPAGER_VMM_H
#define VPAGER_VMM_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "cuda_abi.h"
#include "os.h"

/* The entry points both drivers have, by their field names in
 * VP_CU_ENTRY_POINTS (and in hip_abi.h's list). */
#define VP_VMM_CALLS(X)                                                        \
  X(init) X(device_get_count) X(device_get) X(device_get_attribute)            \
  X(device_total_mem) X(device_get_uuid) X(mem_get_info)                       \
  X(mem_get_allocation_granularity) X(mem_address_reserve)                     \
  X(mem_address_free) X(mem_create) X(mem_release) X(mem_map) X(mem_unmap)     \
  X(mem_set_access) X(stream_create) X(stream_destroy) X(stream_synchronize)   \
  X(stream_wait_event) X(event_create) X(event_destroy) X(event_record)        \
  X(event_query) X(event_synchronize) X(memcpy_htod_async)                     \
  X(memcpy_dtoh_async) X(mem_host_register) X(mem_host_unregister)            \
  X(synchronize)

typedef struct vp__vmm_api {
#define VP__VMM_MEMBER(field) vp_cu_##field##_fn field;
  VP_VMM_CALLS(VP__VMM_MEMBER)
#undef VP__VMM_MEMBER
} vp__vmm_api_t;

/* Result codes first..last mean rc to the pager. A code no row names is a
 * broken device (VP_EDEVICE): sticky or unexplained. */
typedef struct vp__vmm_code {
  unsigned int first, last;
  int rc;
} vp__vmm_code_t;

typedef struct vp__vmm vp__vmm_t;

typedef struct vp__vmm_driver {
  const char *name;       /* caps.name: "cuda", "hip" */
  const char *what;       /* in messages: "CUDA", "HIP" */
  /* Make the device current on this thread for one call; leave undoes
   * enter and keeps the call's result r unless only leaving failed. */
  vp_cu_result_t (*enter)(vp__vmm_t *g);
  vp_cu_result_t (*leave)(vp__vmm_t *g, vp_cu_result_t r);
  /* The driver's name of a result ("unknown ..." when it has none). */
  const char *(*error_name)(const vp__vmm_t *g, vp_cu_result_t r);
  const vp__vmm_code_t *codes;
  size_t n_codes;
  vp_cu_result_t not_ready;         /* an event query's "not yet" */
  unsigned int attr_vmm;            /* device attribute: VMM supported */
  unsigned int attr_integrated;     /* device attribute: shares host memory */
  unsigned int host_register_read_only; /* 0: the driver has no such flag */
  /* The driver's names of the calls open's messages name, and of its
   * virtual memory calls ("cuMemCreate/cuMemMap"). */
  const char *init_call, *count_call, *get_call, *attribute_call;
  const char *vmm_calls;
} vp__vmm_driver_t;

struct vp__vmm {
  const vp__vmm_driver_t *drv;
  vp__vmm_api_t api; /* read-only after open */
  vp__inject_t *inj;
  vp_cu_device_t dev;
  int ordinal;
  bool integrated; /* shares host memory: free memory from the OS */
  uint64_t granularity;
  uint64_t total;
  vp_cu_mem_alloc_prop_t prop;    /* pinned memory on this device */
  vp_cu_mem_access_desc_t access; /* read-write for this device */
  vp_cu_uuid_t uuid;
  atomic_uint last_error; /* last failing result, for logs */
};

/* Why the last failed open on this thread failed (open sets no message;
 * vp__vmm_open_reason, backend.h, reads it): open_fail records it and
 * returns code; open_reset clears it. */
int vp__vmm_open_fail(int code, const char *fmt, ...) VP__PRINTF(2, 3);
void vp__vmm_open_reset(void);

/* Open's steps after the driver is loaded (each sets the open reason on
 * failure): the driver's init and its number of devices (*n: 0 on
 * failure); the device of ordinal index and whether it can do what we
 * need; granularity, memory size and UUID into g and caps (the device
 * made current around them). */
int vp__vmm_count_devices(vp__vmm_t *g, int *n);
int vp__vmm_find_device(vp__vmm_t *g, int index);
int vp__vmm_query_caps(vp__vmm_t *g, vp__caps_t *caps);

/* The VP_ code of result r, remembering r for vp__vmm_error_name
 * (backend.h). */
int vp__vmm_result(vp__vmm_t *g, vp_cu_result_t r);

/* The backend operations (backend.h), for ctx = a vp__vmm_t. */
int vp__vmm_mem_info(void *ctx, uint64_t *free_bytes, uint64_t *total_bytes);
int vp__vmm_va_reserve(void *ctx, uint64_t size, uint64_t *va);
int vp__vmm_va_free(void *ctx, uint64_t va, uint64_t size);
int vp__vmm_phys_create(void *ctx, uint64_t size, vp__phys_t *phys);
int vp__vmm_phys_release(void *ctx, vp__phys_t phys, uint64_t size);
int vp__vmm_map(void *ctx, uint64_t va, uint64_t size, vp__phys_t phys);
int vp__vmm_unmap(void *ctx, uint64_t va, uint64_t size);
int vp__vmm_set_access(void *ctx, uint64_t va, uint64_t size);
int vp__vmm_stream_create(void *ctx, vp_stream_t *stream);
int vp__vmm_stream_destroy(void *ctx, vp_stream_t stream);
int vp__vmm_stream_synchronize(void *ctx, vp_stream_t stream);
int vp__vmm_synchronize(void *ctx);
int vp__vmm_stream_wait_event(void *ctx, vp_stream_t stream, vp__event_t ev);
int vp__vmm_event_create(void *ctx, vp__event_t *ev);
int vp__vmm_event_destroy(void *ctx, vp__event_t ev);
int vp__vmm_event_record(void *ctx, vp__event_t ev, vp_stream_t stream);
int vp__vmm_event_query(void *ctx, vp__event_t ev);
int vp__vmm_event_synchronize(void *ctx, vp__event_t ev);
int vp__vmm_copy_htod(void *ctx, uint64_t dst, const void *src, uint64_t size,
                      vp_stream_t stream);
int vp__vmm_copy_dtoh(void *ctx, void *dst, uint64_t src, uint64_t size,
                      vp_stream_t stream);
int vp__vmm_host_register(void *ctx, void *ptr, uint64_t size);
int vp__vmm_host_unregister(void *ctx, void *ptr);

/* The operations above, as a backend's table: open and close are the
 * adapter's; launch and inject are the simulated device's only. */
#define VP_VMM_BACKEND_OPS                                                     \
  .mem_info = vp__vmm_mem_info, .va_reserve = vp__vmm_va_reserve,              \
  .va_free = vp__vmm_va_free, .phys_create = vp__vmm_phys_create,              \
  .phys_release = vp__vmm_phys_release, .map = vp__vmm_map,                    \
  .unmap = vp__vmm_unmap, .set_access = vp__vmm_set_access,                    \
  .stream_create = vp__vmm_stream_create,                                      \
  .stream_destroy = vp__vmm_stream_destroy,                                    \
  .stream_synchronize = vp__vmm_stream_synchronize,                            \
  .synchronize = vp__vmm_synchronize,                                          \
  .stream_wait_event = vp__vmm_stream_wait_event,                              \
  .event_create = vp__vmm_event_create,                                        \
  .event_destroy = vp__vmm_event_destroy,                                      \
  .event_record = vp__vmm_event_record, .event_query = vp__vmm_event_query,    \
  .event_synchronize = vp__vmm_event_synchronize,                              \
  .copy_htod = vp__vmm_copy_htod, .copy_dtoh = vp__vmm_copy_dtoh,              \
  .host_register = vp__vmm_host_register,                                      \
  .host_unregister = vp__vmm_host_unregister, .launch = NULL, .inject = NULL

#endif /* VPAGER_VMM_H */
