/* Compile-only check that src/backend/hip_abi.h matches ROCm's
 * hip/hip_runtime_api.h: the exact type of every entry point, the sizes
 * and member offsets of the types we share with cuda_abi.h, and the value
 * of every constant. It produces no object; a mismatch is a compile error.
 * `make check-hip` runs it (Debian: apt-get install libamdhip64-dev, the
 * ROCm 5.2 headers):
 *
 *   gcc -std=c11 -Wall -Wextra -Werror -Wincompatible-pointer-types \
 *       -D__HIP_PLATFORM_AMD__ -Isrc -Isrc/backend -Iinclude \
 *       -fsyntax-only tools/hip_abi_check.c
 */
#include <hip/hip_runtime_api.h>
#include <hip/hip_version.h>

/* Build our function types from HIP's own handle and struct types (see
 * hip_abi.h), so comparing them with the header's is exact; the layouts of
 * our types are checked below. */
#define VP_HIP_THEIRS
#include "hip_abi.h"

#include "abi_check.h" /* SAME, SAME_TYPE, SAME_SIZE, SAME_MEMBER */

/* ------------------------------------------------------------- types */

SAME_TYPE(vp_hip_result_t, hipError_t);
SAME_TYPE(vp_cu_device_t, hipDevice_t);
SAME_TYPE(vp_cu_device_attribute_t, hipDeviceAttribute_t);
SAME_TYPE(vp_cu_granularity_flags_t, hipMemAllocationGranularity_flags);
SAME_SIZE(vp_cu_stream_t, hipStream_t);
SAME_SIZE(vp_cu_event_t, hipEvent_t);
SAME_SIZE(vp_hip_mem_handle_t, hipMemGenericAllocationHandle_t);
/* hip.c carries device pointers and handles in CUDA's integers. */
SAME_SIZE(vp_cu_deviceptr_t, hipDeviceptr_t);
SAME(sizeof(vp_cu_mem_handle_t), sizeof(hipMemGenericAllocationHandle_t));

SAME_UUID(hipUUID);
SAME_LOCATION(hipMemLocation);
SAME_ACCESS_DESC(hipMemAccessDesc);

/* hipMemAllocationProp: CUDA's layout from ROCm 5.3 on (hip_abi.h), which
 * hip.c requires of the runtime. Older headers declare the other one:
 * then check that it is the layout we know and refuse. */
SAME_SIZE(vp_cu_mem_alloc_prop_t, hipMemAllocationProp);
#if HIP_VERSION >= VP_HIP_MIN_VERSION
SAME_ALLOC_PROP(hipMemAllocationProp, requestedHandleType);
#else
_Static_assert(offsetof(hipMemAllocationProp, compressionType) == 0 &&
                   offsetof(hipMemAllocationProp, location) == 4 &&
                   offsetof(hipMemAllocationProp, requestedHandleType) == 12 &&
                   offsetof(hipMemAllocationProp, type) == 16 &&
                   offsetof(hipMemAllocationProp, usage) == 20 &&
                   offsetof(hipMemAllocationProp, win32HandleMetaData) == 24,
               "the pre-5.3 hipMemAllocationProp hip.c refuses");
#endif

/* --------------------------------------------------------- constants */

/* The results hip.c's table names by their CUDA twins (hip_abi.h). */
SAME(VP_CU_SUCCESS, hipSuccess);
SAME(VP_CU_ERROR_INVALID_VALUE, hipErrorInvalidValue);
SAME(VP_CU_ERROR_OUT_OF_MEMORY, hipErrorOutOfMemory);
SAME(VP_CU_ERROR_INVALID_DEVICE, hipErrorInvalidDevice);
SAME(VP_CU_ERROR_ALREADY_MAPPED, hipErrorAlreadyMapped);
SAME(VP_CU_ERROR_NOT_MAPPED, hipErrorNotMapped);
SAME(VP_CU_ERROR_INVALID_HANDLE, hipErrorInvalidHandle);
SAME(VP_CU_ERROR_ILLEGAL_STATE, hipErrorIllegalState);
SAME(VP_CU_ERROR_NOT_FOUND, hipErrorNotFound);
SAME(VP_CU_ERROR_NOT_READY, hipErrorNotReady);
SAME(VP_CU_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
     hipErrorHostMemoryAlreadyRegistered);
SAME(VP_CU_ERROR_HOST_MEMORY_NOT_REGISTERED, hipErrorHostMemoryNotRegistered);
SAME(VP_CU_ERROR_NOT_SUPPORTED, hipErrorNotSupported);
SAME(VP_CU_ERROR_STREAM_CAPTURE_UNSUPPORTED, hipErrorStreamCaptureUnsupported);
SAME(VP_CU_ERROR_STREAM_CAPTURE_WRONG_THREAD,
     hipErrorStreamCaptureWrongThread);
SAME(VP_HIP_ERROR_INVALID_DEVICE_POINTER, hipErrorInvalidDevicePointer);
SAME(VP_HIP_ATTR_INTEGRATED, hipDeviceAttributeIntegrated);
#if HIP_VERSION >= VP_HIP_MIN_VERSION
SAME(VP_HIP_ATTR_VMM, hipDeviceAttributeVirtualMemoryManagementSupported);
#endif

/* vmm.c passes cuda_abi.h's constants to both drivers. */
SAME(VP_CU_MEM_ALLOCATION_TYPE_PINNED, hipMemAllocationTypePinned);
SAME(VP_CU_MEM_HANDLE_TYPE_NONE, hipMemHandleTypeNone);
SAME(VP_CU_MEM_LOCATION_TYPE_DEVICE, hipMemLocationTypeDevice);
SAME(VP_CU_MEM_ACCESS_FLAGS_PROT_READWRITE, hipMemAccessFlagsProtReadWrite);
SAME(VP_CU_MEM_ALLOC_GRANULARITY_MINIMUM, hipMemAllocationGranularityMinimum);
SAME(VP_CU_STREAM_NON_BLOCKING, hipStreamNonBlocking);
SAME(VP_CU_EVENT_DISABLE_TIMING, hipEventDisableTiming);
SAME(VP_CU_MEMHOSTREGISTER_PORTABLE, hipHostRegisterPortable);

/* ------------------------------------------------------ entry points */

/* Each of our function types must be the declared function's type. */
#define CHECK_TYPE(field, symbol, params)                                      \
  SAME_TYPE(vp_hip_##field##_fn, __typeof__(&symbol));
VP_HIP_ENTRY_POINTS(CHECK_TYPE)
SAME_TYPE(vp_hip_get_error_name_fn, __typeof__(&hipGetErrorName));

/* And the declarations must fit our types: assigning a function of another
 * type is a -Wincompatible-pointer-types error under -Werror. (External
 * linkage, so no compiler calls them unused; -fsyntax-only emits
 * nothing.) */
#define CHECK_PROTO(field, symbol, params)                                     \
  const vp_hip_##field##_fn vp__check_##field = symbol;
VP_HIP_ENTRY_POINTS(CHECK_PROTO)
const vp_hip_get_error_name_fn vp__check_get_error_name = hipGetErrorName;
