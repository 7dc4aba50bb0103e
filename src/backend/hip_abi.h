/* Our own declarations of the small part of HIP (ROCm's runtime,
 * libamdhip64) that src/backend/hip.c uses, so vpager builds with no ROCm.
 * The runtime is loaded at run time and each entry point found with dlsym
 * (ROCm has no hipGetProcAddress before 6.2, and its exported names carry
 * no version suffix).
 *
 * HIP's virtual memory API has the shape of CUDA's, so this header reuses
 * cuda_abi.h's types where HIP's are the same in C (results, devices,
 * streams, events, the UUID, the allocation property and access
 * descriptor): hip.c hands those entry points to vmm.c as they are. HIP's
 * device pointers (void *) and allocation handles (a pointer) differ from
 * CUDA's integers; hip.c converts them. tools/hip_abi_check.c compares
 * every function type, layout and constant here with ROCm's
 * hip/hip_runtime_api.h (`make check-hip`); run it when anything here
 * changes.
 *
 * hipError_t, hipDeviceAttribute_t and hipMemAllocationGranularity_flags
 * have only non-negative values, so their compatible type is unsigned int,
 * as cuda_abi.h's enumerations are.
 */
#ifndef VPAGER_HIP_ABI_H
#define VPAGER_HIP_ABI_H

#include <stddef.h>
#include <stdint.h>

#include "cuda_abi.h"

/* HIP_VERSION (major * 10000000 + minor * 100000 + patch) of ROCm 5.3,
 * the first whose hipMemAllocationProp has CUDA's layout (type,
 * requestedHandleType, location, win32HandleMetaData, allocFlags), which
 * vp_cu_mem_alloc_prop_t is. ROCm 5.2 put compressionType first and the
 * rest in another order: hip.c refuses runtimes older than this. */
#define VP_HIP_MIN_VERSION 50300000
/* The first runtime whose virtual memory API pages as vmm.c does (read in
 * ROCm's sources, never run here): 5.3-6.0 say no to it on Linux
 * (hipDeviceAttributeVirtualMemoryManagementSupported 0); 6.1's hipMemMap
 * maps the whole reservation, not the page asked for; 6.2's hipMemRelease
 * never frees the physical memory (an eviction gives nothing back). */
#define VP_HIP_PAGING_VERSION 60300000

typedef vp_cu_result_t vp_hip_result_t;         /* hipError_t */
typedef struct vp_hip_mem_handle_st *vp_hip_mem_handle_t;
                                      /* hipMemGenericAllocationHandle_t */

/* --------------------------------------------------------- constants */

/* hipError_t numbers its values as CUresult does where both have one
 * (hipErrorNotReady is 600 as CUDA_ERROR_NOT_READY is): hip.c names them
 * by cuda_abi.h's VP_CU_ERROR_*, and the check compares each with HIP's.
 * HIP's own, without a CUDA twin: */
enum { VP_HIP_ERROR_INVALID_DEVICE_POINTER = 17 };

enum { /* hipDeviceAttribute_t */
  VP_HIP_ATTR_INTEGRATED = 16, /* hipDeviceAttributeIntegrated */
  /* hipDeviceAttributeVirtualMemoryManagementSupported: ROCm 5.3 added it
   * (89 there and since); 5.2's headers lack it, so the check cannot
   * compare it: hip.c asks only runtimes of VP_HIP_MIN_VERSION or later. */
  VP_HIP_ATTR_VMM = 89
};

/* ------------------------------------------------------ entry points */

/* Signatures spell each handle and struct type as VP_HIP_T(ours, HIP's):
 * ours here, HIP's own in tools/hip_abi_check.c (it defines VP_HIP_THEIRS
 * before it includes this header), so the function types it compares are
 * exact; it checks separately that our types have the same layout. */
#ifdef VP_HIP_THEIRS
#define VP_HIP_T(ours, theirs) theirs
#else
#define VP_HIP_T(ours, theirs) ours
#endif

/* X(field, symbol, parameter list): the field names the function type
 * vp_hip_<field>_fn; a field vmm.h's VP_VMM_CALLS also names is the same
 * call as CUDA's. */
#define VP_HIP_ENTRY_POINTS(X)                                                 \
  X(init, hipInit, (unsigned int flags))                                       \
  X(runtime_get_version, hipRuntimeGetVersion, (int *version))                 \
  X(device_get_count, hipGetDeviceCount, (int *count))                         \
  X(device_get, hipDeviceGet, (vp_cu_device_t *dev, int ordinal))              \
  X(device_get_attribute, hipDeviceGetAttribute,                               \
    (int *value, vp_cu_device_attribute_t attr, int device))                   \
  X(device_total_mem, hipDeviceTotalMem, (size_t *bytes, vp_cu_device_t dev))  \
  X(device_get_uuid, hipDeviceGetUuid,                                         \
    (VP_HIP_T(vp_cu_uuid_t, hipUUID) *uuid, vp_cu_device_t dev))               \
  X(device_get_pci_bus_id, hipDeviceGetPCIBusId,                               \
    (char *bus_id, int len, int device))                                       \
  X(get_device, hipGetDevice, (int *device))                                   \
  X(set_device, hipSetDevice, (int device))                                    \
  X(mem_get_info, hipMemGetInfo, (size_t *free_bytes, size_t *total))          \
  X(mem_get_allocation_granularity, hipMemGetAllocationGranularity,            \
    (size_t *granularity,                                                      \
     const VP_HIP_T(vp_cu_mem_alloc_prop_t, hipMemAllocationProp) *prop,       \
     vp_cu_granularity_flags_t option))                                        \
  X(mem_address_reserve, hipMemAddressReserve,                                 \
    (void **ptr, size_t size, size_t alignment, void *addr,                    \
     unsigned long long flags))                                                \
  X(mem_address_free, hipMemAddressFree, (void *ptr, size_t size))             \
  X(mem_create, hipMemCreate,                                                  \
    (VP_HIP_T(vp_hip_mem_handle_t, hipMemGenericAllocationHandle_t) *handle,   \
     size_t size,                                                              \
     const VP_HIP_T(vp_cu_mem_alloc_prop_t, hipMemAllocationProp) *prop,       \
     unsigned long long flags))                                                \
  X(mem_release, hipMemRelease,                                                \
    (VP_HIP_T(vp_hip_mem_handle_t, hipMemGenericAllocationHandle_t) handle))   \
  X(mem_map, hipMemMap,                                                        \
    (void *ptr, size_t size, size_t offset,                                    \
     VP_HIP_T(vp_hip_mem_handle_t, hipMemGenericAllocationHandle_t) handle,    \
     unsigned long long flags))                                                \
  X(mem_unmap, hipMemUnmap, (void *ptr, size_t size))                          \
  X(mem_set_access, hipMemSetAccess,                                           \
    (void *ptr, size_t size,                                                   \
     const VP_HIP_T(vp_cu_mem_access_desc_t, hipMemAccessDesc) *desc,          \
     size_t count))                                                            \
  X(stream_create, hipStreamCreateWithFlags,                                   \
    (VP_HIP_T(vp_cu_stream_t, hipStream_t) *stream, unsigned int flags))       \
  X(stream_destroy, hipStreamDestroy,                                          \
    (VP_HIP_T(vp_cu_stream_t, hipStream_t) stream))                            \
  X(stream_synchronize, hipStreamSynchronize,                                  \
    (VP_HIP_T(vp_cu_stream_t, hipStream_t) stream))                            \
  X(stream_wait_event, hipStreamWaitEvent,                                     \
    (VP_HIP_T(vp_cu_stream_t, hipStream_t) stream,                             \
     VP_HIP_T(vp_cu_event_t, hipEvent_t) event, unsigned int flags))           \
  X(event_create, hipEventCreateWithFlags,                                     \
    (VP_HIP_T(vp_cu_event_t, hipEvent_t) *event, unsigned int flags))          \
  X(event_destroy, hipEventDestroy,                                            \
    (VP_HIP_T(vp_cu_event_t, hipEvent_t) event))                               \
  X(event_record, hipEventRecord,                                              \
    (VP_HIP_T(vp_cu_event_t, hipEvent_t) event,                                \
     VP_HIP_T(vp_cu_stream_t, hipStream_t) stream))                            \
  X(event_query, hipEventQuery, (VP_HIP_T(vp_cu_event_t, hipEvent_t) event))   \
  X(event_synchronize, hipEventSynchronize,                                    \
    (VP_HIP_T(vp_cu_event_t, hipEvent_t) event))                               \
  X(memcpy_htod_async, hipMemcpyHtoDAsync,                                     \
    (void *dst, void *src, size_t size,                                        \
     VP_HIP_T(vp_cu_stream_t, hipStream_t) stream))                            \
  X(memcpy_dtoh_async, hipMemcpyDtoHAsync,                                     \
    (void *dst, void *src, size_t size,                                        \
     VP_HIP_T(vp_cu_stream_t, hipStream_t) stream))                            \
  X(mem_host_register, hipHostRegister,                                        \
    (void *ptr, size_t size, unsigned int flags))                              \
  X(mem_host_unregister, hipHostUnregister, (void *ptr))                       \
  X(synchronize, hipDeviceSynchronize, (void))

#define VP_HIP__FN_TYPE(field, symbol, params)                                 \
  typedef vp_hip_result_t(*vp_hip_##field##_fn) params;
VP_HIP_ENTRY_POINTS(VP_HIP__FN_TYPE)
#undef VP_HIP__FN_TYPE

/* hipGetErrorName returns the name itself, not a hipError_t. */
typedef const char *(*vp_hip_get_error_name_fn)(vp_hip_result_t error);

#endif /* VPAGER_HIP_ABI_H */
