/* Compile-only check that src/backend/cuda_abi.h matches the CUDA toolkit's cuda.h:
 * sizes and member offsets of every type, the value of every constant, and
 * the exact type of every entry point. It produces no object; a mismatch is
 * a compile error. Not part of the test runner (it needs the toolkit):
 *
 *   gcc -std=c11 -Wall -Wextra -Werror -Wincompatible-pointer-types \
 *       -I/usr/local/cuda/include -Isrc/backend -Iinclude -fsyntax-only \
 *       tools/cuda_abi_check.c
 */
#include <stdalign.h>
#include <stddef.h>

#include <cuda.h>
#include <cudaTypedefs.h>

/* Build our function types from cuda.h's handle and struct types (see
 * cuda_abi.h), so comparing them with cuda.h's is exact; the layouts of our
 * own handle and struct types are checked below. */
#define VP_CU_SIG_CONTEXT CUcontext
#define VP_CU_SIG_STREAM CUstream
#define VP_CU_SIG_EVENT CUevent
#define VP_CU_SIG_UUID CUuuid
#define VP_CU_SIG_PROP CUmemAllocationProp
#define VP_CU_SIG_ACCESS CUmemAccessDesc
#define VP_CU_SIG_MODULE CUmodule
#define VP_CU_SIG_FUNCTION CUfunction
#include "cuda_abi.h"

#include "abi_check.h" /* SAME, SAME_TYPE, SAME_SIZE, SAME_MEMBER */

/* ------------------------------------------------------------- types */

SAME(VP_CU_ABI_VERSION <= CUDA_VERSION, 1);
SAME_TYPE(vp_cu_result_t, CUresult);
SAME_TYPE(vp_cu_device_t, CUdevice);
SAME_TYPE(vp_cu_deviceptr_t, CUdeviceptr);
SAME_TYPE(vp_cu_mem_handle_t, CUmemGenericAllocationHandle);
SAME_TYPE(vp_cu_device_attribute_t, CUdevice_attribute);
SAME_TYPE(vp_cu_granularity_flags_t, CUmemAllocationGranularity_flags);
SAME_TYPE(vp_cu_proc_query_result_t, CUdriverProcAddressQueryResult);
SAME_SIZE(vp_cu_context_t, CUcontext);
SAME_SIZE(vp_cu_stream_t, CUstream);
SAME_SIZE(vp_cu_event_t, CUevent);
SAME_SIZE(vp_cu_module_t, CUmodule);
SAME_SIZE(vp_cu_function_t, CUfunction);

SAME_UUID(CUuuid);
SAME_LOCATION(CUmemLocation);

SAME_SIZE(vp_cu_mem_alloc_prop_t, CUmemAllocationProp);
SAME_ALLOC_PROP(CUmemAllocationProp, requestedHandleTypes);
SAME_MEMBER(vp_cu_mem_alloc_prop_t, alloc_flags, CUmemAllocationProp,
            allocFlags);
SAME_MEMBER(vp_cu_mem_alloc_prop_t, alloc_flags.reserved,
            CUmemAllocationProp, allocFlags.reserved);

SAME_ACCESS_DESC(CUmemAccessDesc);

/* --------------------------------------------------------- constants */

#define SAME_CONST(name) SAME(VP_##name, name)
SAME(VP_CU_SUCCESS, CUDA_SUCCESS);
SAME(VP_CU_ERROR_INVALID_VALUE, CUDA_ERROR_INVALID_VALUE);
SAME(VP_CU_ERROR_OUT_OF_MEMORY, CUDA_ERROR_OUT_OF_MEMORY);
SAME(VP_CU_ERROR_NOT_INITIALIZED, CUDA_ERROR_NOT_INITIALIZED);
SAME(VP_CU_ERROR_DEINITIALIZED, CUDA_ERROR_DEINITIALIZED);
SAME(VP_CU_ERROR_STUB_LIBRARY, CUDA_ERROR_STUB_LIBRARY);
SAME(VP_CU_ERROR_DEVICE_UNAVAILABLE, CUDA_ERROR_DEVICE_UNAVAILABLE);
SAME(VP_CU_ERROR_NO_DEVICE, CUDA_ERROR_NO_DEVICE);
SAME(VP_CU_ERROR_INVALID_DEVICE, CUDA_ERROR_INVALID_DEVICE);
SAME(VP_CU_ERROR_DEVICE_NOT_LICENSED, CUDA_ERROR_DEVICE_NOT_LICENSED);
SAME(VP_CU_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_CONTEXT);
SAME(VP_CU_ERROR_ALREADY_MAPPED, CUDA_ERROR_ALREADY_MAPPED);
SAME(VP_CU_ERROR_NOT_MAPPED, CUDA_ERROR_NOT_MAPPED);
SAME(VP_CU_ERROR_ECC_UNCORRECTABLE, CUDA_ERROR_ECC_UNCORRECTABLE);
SAME(VP_CU_ERROR_NVLINK_UNCORRECTABLE, CUDA_ERROR_NVLINK_UNCORRECTABLE);
SAME(VP_CU_ERROR_CONTAINED, CUDA_ERROR_CONTAINED);
SAME(VP_CU_ERROR_OPERATING_SYSTEM, CUDA_ERROR_OPERATING_SYSTEM);
SAME(VP_CU_ERROR_INVALID_HANDLE, CUDA_ERROR_INVALID_HANDLE);
SAME(VP_CU_ERROR_ILLEGAL_STATE, CUDA_ERROR_ILLEGAL_STATE);
SAME(VP_CU_ERROR_NOT_FOUND, CUDA_ERROR_NOT_FOUND);
SAME(VP_CU_ERROR_NOT_READY, CUDA_ERROR_NOT_READY);
SAME(VP_CU_ERROR_ILLEGAL_ADDRESS, CUDA_ERROR_ILLEGAL_ADDRESS);
SAME(VP_CU_ERROR_LAUNCH_TIMEOUT, CUDA_ERROR_LAUNCH_TIMEOUT);
SAME(VP_CU_ERROR_CONTEXT_IS_DESTROYED, CUDA_ERROR_CONTEXT_IS_DESTROYED);
SAME(VP_CU_ERROR_ASSERT, CUDA_ERROR_ASSERT);
SAME(VP_CU_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
     CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
SAME(VP_CU_ERROR_HOST_MEMORY_NOT_REGISTERED,
     CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
SAME(VP_CU_ERROR_HARDWARE_STACK_ERROR, CUDA_ERROR_HARDWARE_STACK_ERROR);
SAME(VP_CU_ERROR_ILLEGAL_INSTRUCTION, CUDA_ERROR_ILLEGAL_INSTRUCTION);
SAME(VP_CU_ERROR_MISALIGNED_ADDRESS, CUDA_ERROR_MISALIGNED_ADDRESS);
SAME(VP_CU_ERROR_INVALID_ADDRESS_SPACE, CUDA_ERROR_INVALID_ADDRESS_SPACE);
SAME(VP_CU_ERROR_INVALID_PC, CUDA_ERROR_INVALID_PC);
SAME(VP_CU_ERROR_LAUNCH_FAILED, CUDA_ERROR_LAUNCH_FAILED);
SAME(VP_CU_ERROR_NOT_PERMITTED, CUDA_ERROR_NOT_PERMITTED);
SAME(VP_CU_ERROR_NOT_SUPPORTED, CUDA_ERROR_NOT_SUPPORTED);
SAME(VP_CU_ERROR_SYSTEM_NOT_READY, CUDA_ERROR_SYSTEM_NOT_READY);
SAME(VP_CU_ERROR_SYSTEM_DRIVER_MISMATCH, CUDA_ERROR_SYSTEM_DRIVER_MISMATCH);
SAME(VP_CU_ERROR_MPS_CONNECTION_FAILED, CUDA_ERROR_MPS_CONNECTION_FAILED);
SAME(VP_CU_ERROR_MPS_RPC_FAILURE, CUDA_ERROR_MPS_RPC_FAILURE);
SAME(VP_CU_ERROR_MPS_SERVER_NOT_READY, CUDA_ERROR_MPS_SERVER_NOT_READY);
SAME(VP_CU_ERROR_MPS_MAX_CLIENTS_REACHED,
     CUDA_ERROR_MPS_MAX_CLIENTS_REACHED);
SAME(VP_CU_ERROR_MPS_MAX_CONNECTIONS_REACHED,
     CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED);
SAME(VP_CU_ERROR_MPS_CLIENT_TERMINATED, CUDA_ERROR_MPS_CLIENT_TERMINATED);
SAME(VP_CU_ERROR_STREAM_CAPTURE_UNSUPPORTED,
     CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
SAME(VP_CU_ERROR_STREAM_CAPTURE_WRONG_THREAD,
     CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD);
SAME(VP_CU_ERROR_TIMEOUT, CUDA_ERROR_TIMEOUT);
SAME(VP_CU_ERROR_EXTERNAL_DEVICE, CUDA_ERROR_EXTERNAL_DEVICE);
SAME(VP_CU_ERROR_UNKNOWN, CUDA_ERROR_UNKNOWN);

SAME_CONST(CU_GET_PROC_ADDRESS_LEGACY_STREAM);
SAME_CONST(CU_GET_PROC_ADDRESS_SUCCESS);
SAME_CONST(CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
SAME_CONST(CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
SAME_CONST(CU_DEVICE_ATTRIBUTE_INTEGRATED);
SAME_CONST(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED);
SAME_CONST(CU_MEM_ALLOCATION_TYPE_PINNED);
SAME_CONST(CU_MEM_HANDLE_TYPE_NONE);
SAME_CONST(CU_MEM_LOCATION_TYPE_DEVICE);
SAME_CONST(CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
SAME_CONST(CU_MEM_ALLOC_GRANULARITY_MINIMUM);
SAME_CONST(CU_STREAM_NON_BLOCKING);
SAME_CONST(CU_EVENT_DISABLE_TIMING);
SAME_CONST(CU_MEMHOSTREGISTER_PORTABLE);
SAME_CONST(CU_MEMHOSTREGISTER_DEVICEMAP);

/* ------------------------------------------------------ entry points */

/* The variant cuGetProcAddress returns at our ABI version must have our
 * type: cudaTypedefs.h names each variant PFN_<symbol>_v<version>. */
SAME_TYPE(vp_cu_get_proc_address_fn, PFN_cuGetProcAddress_v12000);
#define CHECK_PFN(field, symbol, version, params)                              \
  SAME_TYPE(vp_cu_##field##_fn, PFN_##symbol##_v##version);
VP_CU_ENTRY_POINTS(CHECK_PFN)
VP_CU_PULL_ENTRY_POINTS(CHECK_PFN)

/* cuda.h's own prototypes (its macros pick the newest variant, e.g.
 * cuMemGetInfo_v2) must also fit our types: assigning a function of another
 * type is a -Wincompatible-pointer-types error under -Werror. If a future
 * toolkit adds a newer variant with another signature, this part fails
 * while CHECK_PFN still passes: then our ABI version still holds, and only
 * a move to the new variant needs new declarations. (External linkage, so
 * no compiler calls them unused; -fsyntax-only emits nothing.) */
const vp_cu_get_proc_address_fn vp__check_get_proc_address = cuGetProcAddress;
#define CHECK_PROTO(field, symbol, version, params)                            \
  const vp_cu_##field##_fn vp__check_##field = symbol;
VP_CU_ENTRY_POINTS(CHECK_PROTO)
VP_CU_PULL_ENTRY_POINTS(CHECK_PROTO)

/* ------------------------------------------------------------- NVML */

#if __has_include(<nvml.h>)
#include <nvml.h>
SAME_TYPE(vp_nvml_return_t, nvmlReturn_t);
SAME_SIZE(vp_nvml_memory_t, nvmlMemory_t);
SAME_MEMBER(vp_nvml_memory_t, total, nvmlMemory_t, total);
SAME_MEMBER(vp_nvml_memory_t, free, nvmlMemory_t, free);
SAME_MEMBER(vp_nvml_memory_t, used, nvmlMemory_t, used);
SAME_SIZE(vp_nvml_process_info_t, nvmlProcessInfo_t);
SAME_MEMBER(vp_nvml_process_info_t, pid, nvmlProcessInfo_t, pid);
SAME_MEMBER(vp_nvml_process_info_t, used_gpu_memory, nvmlProcessInfo_t,
            usedGpuMemory);
SAME_MEMBER(vp_nvml_process_info_t, gpu_instance_id, nvmlProcessInfo_t,
            gpuInstanceId);
SAME_MEMBER(vp_nvml_process_info_t, compute_instance_id, nvmlProcessInfo_t,
            computeInstanceId);
SAME(VP_NVML_SUCCESS, NVML_SUCCESS);
SAME(VP_NVML_ERROR_INSUFFICIENT_SIZE, NVML_ERROR_INSUFFICIENT_SIZE);
SAME_SIZE(vp_nvml_device_t, nvmlDevice_t);
#endif
