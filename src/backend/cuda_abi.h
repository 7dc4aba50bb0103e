/* Our own declarations of the small part of the CUDA driver API (and of
 * NVML) that src/backend_cuda.c uses, so vpager builds with no CUDA toolkit.
 * The driver is loaded at run time and every entry point is resolved with
 * cuGetProcAddress at VP_CU_ABI_VERSION, so the signatures below are those
 * of the variant the driver hands out at that version (the third column of
 * VP_CU_ENTRY_POINTS: cudaTypedefs.h's PFN_<symbol>_v<version>).
 *
 * Every name is ours (vp_cu_*, VP_CU_*, vp_nvml_*, VP_NVML_*), so this
 * header and cuda.h may be included together. tools/cuda_abi_check.c
 * compares sizes, member offsets, constants and every function type with
 * cuda.h; run it when anything here changes.
 *
 * Enumerations of cuda.h are unsigned int here: every CUDA enum has only
 * non-negative values, so GCC and Clang give it unsigned int as its
 * compatible type, and the check can compare function types exactly.
 */
#ifndef VPAGER_CUDA_ABI_H
#define VPAGER_CUDA_ABI_H

#include <stddef.h>
#include <stdint.h>

/* The CUDA version whose ABI we ask cuGetProcAddress for. 12.0 is the first
 * release with cuGetProcAddress_v2; nothing we call changed after it. */
#define VP_CU_ABI_VERSION 12000

/* ------------------------------------------------------------- types */

typedef unsigned int vp_cu_result_t;       /* CUresult */
typedef int vp_cu_device_t;                /* CUdevice (an ordinal) */
typedef unsigned long long vp_cu_deviceptr_t; /* CUdeviceptr (LP64) */
/* CUmemGenericAllocationHandle */
typedef unsigned long long vp_cu_mem_handle_t;
typedef struct vp_cu_ctx_st *vp_cu_context_t;     /* CUcontext */
typedef struct vp_cu_stream_st *vp_cu_stream_t;   /* CUstream */
typedef struct vp_cu_event_st *vp_cu_event_t;     /* CUevent */
typedef struct vp_cu_mod_st *vp_cu_module_t;       /* CUmodule */
typedef struct vp_cu_func_st *vp_cu_function_t;    /* CUfunction */
typedef unsigned int vp_cu_device_attribute_t;    /* CUdevice_attribute */
/* CUmemAllocationGranularity_flags */
typedef unsigned int vp_cu_granularity_flags_t;
/* CUdriverProcAddressQueryResult */
typedef unsigned int vp_cu_proc_query_result_t;

typedef struct vp_cu_uuid { /* CUuuid */
  char bytes[16];
} vp_cu_uuid_t;

typedef struct vp_cu_mem_location { /* CUmemLocation */
  unsigned int type; /* CUmemLocationType */
  int id;
} vp_cu_mem_location_t;

typedef struct vp_cu_mem_alloc_prop { /* CUmemAllocationProp */
  unsigned int type;                   /* CUmemAllocationType */
  unsigned int requested_handle_types; /* CUmemAllocationHandleType */
  vp_cu_mem_location_t location;
  void *win32_handle_meta_data;
  struct {
    unsigned char compression_type;
    unsigned char gpu_direct_rdma_capable;
    unsigned short usage;
    unsigned char reserved[4];
  } alloc_flags;
} vp_cu_mem_alloc_prop_t;

typedef struct vp_cu_mem_access_desc { /* CUmemAccessDesc */
  vp_cu_mem_location_t location;
  unsigned int flags; /* CUmemAccess_flags */
} vp_cu_mem_access_desc_t;

/* --------------------------------------------------------- constants */

enum { /* CUresult values we tell apart */
  VP_CU_SUCCESS = 0,
  VP_CU_ERROR_INVALID_VALUE = 1,
  VP_CU_ERROR_OUT_OF_MEMORY = 2,
  VP_CU_ERROR_NOT_INITIALIZED = 3,
  VP_CU_ERROR_DEINITIALIZED = 4,
  VP_CU_ERROR_STUB_LIBRARY = 34,
  VP_CU_ERROR_DEVICE_UNAVAILABLE = 46,
  VP_CU_ERROR_NO_DEVICE = 100,
  VP_CU_ERROR_INVALID_DEVICE = 101,
  VP_CU_ERROR_DEVICE_NOT_LICENSED = 102,
  VP_CU_ERROR_INVALID_CONTEXT = 201,
  VP_CU_ERROR_ALREADY_MAPPED = 208,
  VP_CU_ERROR_NOT_MAPPED = 211,
  VP_CU_ERROR_ECC_UNCORRECTABLE = 214,
  VP_CU_ERROR_NVLINK_UNCORRECTABLE = 220,
  VP_CU_ERROR_CONTAINED = 226,
  VP_CU_ERROR_OPERATING_SYSTEM = 304,
  VP_CU_ERROR_INVALID_HANDLE = 400,
  VP_CU_ERROR_ILLEGAL_STATE = 401,
  VP_CU_ERROR_NOT_FOUND = 500,
  VP_CU_ERROR_NOT_READY = 600,
  VP_CU_ERROR_ILLEGAL_ADDRESS = 700,
  VP_CU_ERROR_LAUNCH_TIMEOUT = 702,
  VP_CU_ERROR_CONTEXT_IS_DESTROYED = 709,
  VP_CU_ERROR_ASSERT = 710,
  VP_CU_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
  VP_CU_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
  VP_CU_ERROR_HARDWARE_STACK_ERROR = 714,
  VP_CU_ERROR_ILLEGAL_INSTRUCTION = 715,
  VP_CU_ERROR_MISALIGNED_ADDRESS = 716,
  VP_CU_ERROR_INVALID_ADDRESS_SPACE = 717,
  VP_CU_ERROR_INVALID_PC = 718,
  VP_CU_ERROR_LAUNCH_FAILED = 719,
  VP_CU_ERROR_NOT_PERMITTED = 800,
  VP_CU_ERROR_NOT_SUPPORTED = 801,
  VP_CU_ERROR_SYSTEM_NOT_READY = 802,
  VP_CU_ERROR_SYSTEM_DRIVER_MISMATCH = 803,
  VP_CU_ERROR_MPS_CONNECTION_FAILED = 805,
  VP_CU_ERROR_MPS_RPC_FAILURE = 806,
  VP_CU_ERROR_MPS_SERVER_NOT_READY = 807,
  VP_CU_ERROR_MPS_MAX_CLIENTS_REACHED = 808,
  VP_CU_ERROR_MPS_MAX_CONNECTIONS_REACHED = 809,
  VP_CU_ERROR_MPS_CLIENT_TERMINATED = 810,
  VP_CU_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
  VP_CU_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908,
  VP_CU_ERROR_TIMEOUT = 909,
  VP_CU_ERROR_EXTERNAL_DEVICE = 911,
  VP_CU_ERROR_UNKNOWN = 999
};

enum {
  VP_CU_GET_PROC_ADDRESS_LEGACY_STREAM = 1, /* CUdriverProcAddress_flags */
  VP_CU_GET_PROC_ADDRESS_SUCCESS = 0,       /* CUdriverProcAddressQueryResult */
  VP_CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1,
  VP_CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2,
  VP_CU_DEVICE_ATTRIBUTE_INTEGRATED = 18,   /* CUdevice_attribute */
  VP_CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102,
  VP_CU_MEM_ALLOCATION_TYPE_PINNED = 1,     /* CUmemAllocationType */
  VP_CU_MEM_HANDLE_TYPE_NONE = 0,           /* CUmemAllocationHandleType */
  VP_CU_MEM_LOCATION_TYPE_DEVICE = 1,       /* CUmemLocationType */
  VP_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3, /* CUmemAccess_flags */
  VP_CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0,  /* CUmemAllocationGranularity_f. */
  VP_CU_STREAM_NON_BLOCKING = 1,            /* CUstream_flags */
  VP_CU_EVENT_DISABLE_TIMING = 2,           /* CUevent_flags */
  VP_CU_MEMHOSTREGISTER_PORTABLE = 1,       /* cuMemHostRegister flags */
  VP_CU_MEMHOSTREGISTER_DEVICEMAP = 2,
  VP_CU_MEMHOSTREGISTER_READ_ONLY = 8
};

/* ------------------------------------------------------ entry points */

/* Signatures spell the handle and struct types through these macros.
 * tools/cuda_abi_check.c defines them as cuda.h's own types before it
 * includes this header, so the function types it compares with cuda.h are
 * exact; it checks separately that our types have the same layout. */
#ifndef VP_CU_SIG_CONTEXT
#define VP_CU_SIG_CONTEXT vp_cu_context_t
#define VP_CU_SIG_STREAM vp_cu_stream_t
#define VP_CU_SIG_EVENT vp_cu_event_t
#define VP_CU_SIG_UUID vp_cu_uuid_t
#define VP_CU_SIG_PROP vp_cu_mem_alloc_prop_t
#define VP_CU_SIG_ACCESS vp_cu_mem_access_desc_t
#define VP_CU_SIG_MODULE vp_cu_module_t
#define VP_CU_SIG_FUNCTION vp_cu_function_t
#endif

/* cuGetProcAddress_v2, the one symbol found with dlsym. */
typedef vp_cu_result_t (*vp_cu_get_proc_address_fn)(
    const char *symbol, void **pfn, int cuda_version, uint64_t flags,
    vp_cu_proc_query_result_t *status);

/* X(field, base symbol, version of the variant returned at
 *   VP_CU_ABI_VERSION, parameter list). The field names the function type
 * vp_cu_<field>_fn; cuGetProcAddress takes the base symbol. */
#define VP_CU_ENTRY_POINTS(X)                                                  \
  X(init, cuInit, 2000, (unsigned int flags))                                  \
  X(driver_get_version, cuDriverGetVersion, 2020, (int *version))              \
  X(device_get_count, cuDeviceGetCount, 2000, (int *count))                    \
  X(device_get, cuDeviceGet, 2000, (vp_cu_device_t *dev, int ordinal))         \
  X(device_get_attribute, cuDeviceGetAttribute, 2000,                          \
    (int *value, vp_cu_device_attribute_t attr, vp_cu_device_t dev))           \
  X(device_total_mem, cuDeviceTotalMem, 3020,                                  \
    (size_t *bytes, vp_cu_device_t dev))                                       \
  X(device_get_uuid, cuDeviceGetUuid, 11040,                                   \
    (VP_CU_SIG_UUID *uuid, vp_cu_device_t dev))                                \
  X(primary_ctx_retain, cuDevicePrimaryCtxRetain, 7000,                        \
    (VP_CU_SIG_CONTEXT *ctx, vp_cu_device_t dev))                              \
  X(primary_ctx_release, cuDevicePrimaryCtxRelease, 11000,                     \
    (vp_cu_device_t dev))                                                      \
  X(ctx_push_current, cuCtxPushCurrent, 4000, (VP_CU_SIG_CONTEXT ctx))         \
  X(ctx_pop_current, cuCtxPopCurrent, 4000, (VP_CU_SIG_CONTEXT *ctx))          \
  X(get_error_name, cuGetErrorName, 6000,                                      \
    (vp_cu_result_t error, const char **name))                                 \
  X(mem_get_info, cuMemGetInfo, 3020, (size_t *free_bytes, size_t *total))     \
  X(mem_get_allocation_granularity, cuMemGetAllocationGranularity, 10020,      \
    (size_t *granularity, const VP_CU_SIG_PROP *prop,                          \
     vp_cu_granularity_flags_t option))                                        \
  X(mem_address_reserve, cuMemAddressReserve, 10020,                           \
    (vp_cu_deviceptr_t *ptr, size_t size, size_t alignment,                    \
     vp_cu_deviceptr_t addr, unsigned long long flags))                        \
  X(mem_address_free, cuMemAddressFree, 10020,                                 \
    (vp_cu_deviceptr_t ptr, size_t size))                                      \
  X(mem_create, cuMemCreate, 10020,                                            \
    (vp_cu_mem_handle_t *handle, size_t size, const VP_CU_SIG_PROP *prop,      \
     unsigned long long flags))                                                \
  X(mem_release, cuMemRelease, 10020, (vp_cu_mem_handle_t handle))             \
  X(mem_map, cuMemMap, 10020,                                                  \
    (vp_cu_deviceptr_t ptr, size_t size, size_t offset,                        \
     vp_cu_mem_handle_t handle, unsigned long long flags))                     \
  X(mem_unmap, cuMemUnmap, 10020, (vp_cu_deviceptr_t ptr, size_t size))        \
  X(mem_set_access, cuMemSetAccess, 10020,                                     \
    (vp_cu_deviceptr_t ptr, size_t size, const VP_CU_SIG_ACCESS *desc,         \
     size_t count))                                                            \
  X(stream_create, cuStreamCreate, 2000,                                       \
    (VP_CU_SIG_STREAM *stream, unsigned int flags))                            \
  X(stream_destroy, cuStreamDestroy, 4000, (VP_CU_SIG_STREAM stream))          \
  X(stream_synchronize, cuStreamSynchronize, 2000, (VP_CU_SIG_STREAM stream))  \
  X(stream_wait_event, cuStreamWaitEvent, 3020,                                \
    (VP_CU_SIG_STREAM stream, VP_CU_SIG_EVENT event, unsigned int flags))      \
  X(event_create, cuEventCreate, 2000,                                         \
    (VP_CU_SIG_EVENT *event, unsigned int flags))                              \
  X(event_destroy, cuEventDestroy, 4000, (VP_CU_SIG_EVENT event))              \
  X(event_record, cuEventRecord, 2000,                                         \
    (VP_CU_SIG_EVENT event, VP_CU_SIG_STREAM stream))                          \
  X(event_query, cuEventQuery, 2000, (VP_CU_SIG_EVENT event))                  \
  X(event_synchronize, cuEventSynchronize, 2000, (VP_CU_SIG_EVENT event))      \
  X(memcpy_htod_async, cuMemcpyHtoDAsync, 3020,                                \
    (vp_cu_deviceptr_t dst, const void *src, size_t size,                      \
     VP_CU_SIG_STREAM stream))                                                 \
  X(memcpy_dtoh_async, cuMemcpyDtoHAsync, 3020,                                \
    (void *dst, vp_cu_deviceptr_t src, size_t size, VP_CU_SIG_STREAM stream))  \
  X(mem_host_register, cuMemHostRegister, 6050,                                \
    (void *ptr, size_t size, unsigned int flags))                              \
  X(mem_host_unregister, cuMemHostUnregister, 4000, (void *ptr))             \
  X(synchronize, cuCtxSynchronize, 2000, (void))

/* The copies by SMs (cuda.c, copy_htod_sm; pull.cu): optional, as the
 * list above is not; a driver without one of them copies by the copy
 * engine only. */
#define VP_CU_PULL_ENTRY_POINTS(X)                                             \
  X(module_load_data, cuModuleLoadData, 2000,                                  \
    (VP_CU_SIG_MODULE *module, const void *image))                             \
  X(module_unload, cuModuleUnload, 2000, (VP_CU_SIG_MODULE module))            \
  X(module_get_function, cuModuleGetFunction, 2000,                            \
    (VP_CU_SIG_FUNCTION *fn, VP_CU_SIG_MODULE module, const char *name))       \
  X(launch_kernel, cuLaunchKernel, 4000,                                       \
    (VP_CU_SIG_FUNCTION fn, unsigned int grid_x, unsigned int grid_y,          \
     unsigned int grid_z, unsigned int block_x, unsigned int block_y,          \
     unsigned int block_z, unsigned int shared_bytes,                          \
     VP_CU_SIG_STREAM stream, void **params, void **extra))                    \
  X(mem_host_get_device_pointer, cuMemHostGetDevicePointer, 3020,              \
    (vp_cu_deviceptr_t *dptr, void *p, unsigned int flags))

#define VP_CU__FN_TYPE(field, symbol, version, params)                         \
  typedef vp_cu_result_t(*vp_cu_##field##_fn) params;
VP_CU_ENTRY_POINTS(VP_CU__FN_TYPE)
VP_CU_PULL_ENTRY_POINTS(VP_CU__FN_TYPE)
#undef VP_CU__FN_TYPE

/* -------------------------------------------------------------- NVML */

/* libnvidia-ml.so.1 (optional). No nvml.h ships with the toolkit here; the
 * layouts below are those of nvml.h (NVML_API_VERSION 12), pinned by the
 * static assertions that follow. */
typedef unsigned int vp_nvml_return_t; /* nvmlReturn_t */
typedef struct vp_nvml_device_st *vp_nvml_device_t;

typedef struct vp_nvml_memory { /* nvmlMemory_t (v1) */
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
} vp_nvml_memory_t;

typedef struct vp_nvml_process_info { /* nvmlProcessInfo_t (= _v2_t) */
  unsigned int pid;
  unsigned long long used_gpu_memory; /* ULLONG_MAX: not available */
  unsigned int gpu_instance_id;
  unsigned int compute_instance_id;
} vp_nvml_process_info_t;

_Static_assert(sizeof(vp_nvml_memory_t) == 24, "nvmlMemory_t");
_Static_assert(sizeof(vp_nvml_process_info_t) == 24, "nvmlProcessInfo_t");
_Static_assert(offsetof(vp_nvml_process_info_t, used_gpu_memory) == 8,
               "nvmlProcessInfo_t.usedGpuMemory");

enum {
  VP_NVML_SUCCESS = 0,
  VP_NVML_ERROR_INSUFFICIENT_SIZE = 7
};

typedef vp_nvml_return_t (*vp_nvml_init_fn)(void);     /* nvmlInit_v2 */
typedef vp_nvml_return_t (*vp_nvml_shutdown_fn)(void); /* nvmlShutdown */
typedef vp_nvml_return_t (*vp_nvml_get_handle_by_uuid_fn)(
    const char *uuid, vp_nvml_device_t *dev); /* nvmlDeviceGetHandleByUUID */
typedef vp_nvml_return_t (*vp_nvml_get_memory_info_fn)(
    vp_nvml_device_t dev, vp_nvml_memory_t *mem); /* nvmlDeviceGetMemoryInfo */
/* nvmlDeviceGetComputeRunningProcesses_v3 */
typedef vp_nvml_return_t (*vp_nvml_get_compute_procs_fn)(
    vp_nvml_device_t dev, unsigned int *count, vp_nvml_process_info_t *infos);
/* nvmlDeviceGetMemoryLimits_v1 (newer drivers: a cgroup's memory limits on
 * a GPU, MPS v3 / dmem): the namespace (a cgroup's path) in, the limits
 * out; room to spare at the end, as vpager.torch's ledger passed it. */
typedef struct vp_nvml_memory_limits {
  const char *name_space;
  unsigned long long soft_limit, hard_limit, current_used;
  unsigned long long spare[16];
} vp_nvml_memory_limits_t;
typedef vp_nvml_return_t (*vp_nvml_get_memory_limits_fn)(
    vp_nvml_device_t dev, vp_nvml_memory_limits_t *limits);

#endif /* VPAGER_CUDA_ABI_H */
