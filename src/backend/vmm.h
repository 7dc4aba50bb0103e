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
  X(memcpy_dtoh_async) X(mem_host_register) X(mem_host_unregister)             \
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
#define VP_VMM_CODE(code, rc) {(code), (code), (rc)}
#define VP_VMM_CODES(table)                                                    \
  .codes = (table), .n_codes = sizeof(table) / sizeof *(table)

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
  const vp__vmm_code_t *codes; /* VP_VMM_CODES(table) */
  size_t n_codes;
  vp_cu_result_t not_ready;         /* an event query's "not yet" */
  unsigned int attr_vmm;            /* device attribute: VMM supported */
  unsigned int attr_integrated;     /* device attribute: shares host memory */
  unsigned int host_register_flags; /* PORTABLE (and CUDA's DEVICEMAP) */
  bool map_twice;                   /* caps.map_twice */
  /* The driver's names of the calls open's messages name, and of its
   * virtual memory calls ("cuMemCreate/cuMemMap"). */
  struct {
    const char *init, *count, *get, *attribute, *vmm;
  } calls;
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

/* An entry point the adapter looks up by name, and where it goes in its
 * table of function pointers. */
typedef struct vp__vmm_symbol {
  const char *name;
  size_t offset;
} vp__vmm_symbol_t;

/* Why the last failed open on this thread failed (open sets no message;
 * vp__vmm_open_reason, backend.h, reads it): open_fail records it and
 * returns code; open_reset clears it. */
int vp__vmm_open_fail(int code, const char *fmt, ...) VP__PRINTF(2, 3);
void vp__vmm_open_reset(void);
/* The start of every GPU backend's open: clears the reason, checks the
 * arguments, takes open's first injected failure, and allocates the
 * adapter's state (`size` zeroed bytes that start with a vp__vmm_t, its
 * inj set). NULL and *rc on failure. Injected failures of open are
 * VP_ENOMEM, never VP_ENODEV: AUTO would fall back to the simulated device
 * and hide the rung under test. */
vp__vmm_t *vp__vmm_open_begin(const vp_options_t *opts, vp__inject_t *inj,
                              void **ctx, vp__caps_t *caps, size_t size,
                              int *rc);

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

/* The backend operations vmm.c implements, for ctx = a vp__vmm_t: every
 * member of vp__backend_t (backend.h) but open and close (the adapter's)
 * and launch and inject (the simulated device's only). Each is
 * vp__vmm_<op>, of the member's type. */
#define VP_VMM_OPS(X)                                                          \
  X(mem_info) X(va_reserve) X(va_free) X(phys_create) X(phys_release) X(map)   \
  X(unmap) X(set_access) X(stream_create) X(stream_destroy)                    \
  X(stream_synchronize) X(synchronize) X(stream_wait_event) X(event_create)    \
  X(event_destroy) X(event_record) X(event_query) X(event_synchronize)         \
  X(copy_htod) X(copy_dtoh) X(host_register) X(host_unregister)

#define VP__VMM_DECLARE(op)                                                    \
  extern __typeof__(*((vp__backend_t *)0)->op) vp__vmm_##op;
VP_VMM_OPS(VP__VMM_DECLARE)
#undef VP__VMM_DECLARE

/* A GPU backend's table: the adapter's name, open and close, its copy by
 * SMs (NULL: none), and vmm.c's operations (vp__backend_cuda,
 * vp__backend_hip). */
#define VP__VMM_MEMBER_OP(op) .op = vp__vmm_##op,
#define VP_VMM_BACKEND(name_, open_, close_, copy_htod_sm_)                    \
  {.name = (name_), .open = (open_), .close = (close_),                        \
   VP_VMM_OPS(VP__VMM_MEMBER_OP) .copy_htod_sm = (copy_htod_sm_),              \
   .launch = NULL, .inject = NULL}

#endif /* VPAGER_VMM_H */
