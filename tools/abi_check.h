/* The static assertions of the compile-only ABI checks
 * (tools/cuda_abi_check.c, tools/hip_abi_check.c): a mismatch is a compile
 * error naming both sides. Values are compared as integers: our enums and
 * the vendor's are distinct types. */
#ifndef VPAGER_ABI_CHECK_H
#define VPAGER_ABI_CHECK_H

#include <stdalign.h>
#include <stddef.h>

#define SAME(a, b)                                                             \
  _Static_assert((long long)(a) == (long long)(b), #a " != " #b)
#define SAME_TYPE(a, b)                                                        \
  _Static_assert(__builtin_types_compatible_p(a, b), #a " is not " #b)
#define SAME_SIZE(a, b)                                                        \
  SAME(sizeof(a), sizeof(b));                                                  \
  SAME(alignof(a), alignof(b))
#define SAME_MEMBER(a, am, b, bm)                                              \
  SAME(offsetof(a, am), offsetof(b, bm));                                      \
  SAME(sizeof(((a *)0)->am), sizeof(((b *)0)->bm))

/* cuda_abi.h's UUID, memory location and access descriptor, which HIP's
 * calls take too, against a vendor's type t. */
#define SAME_UUID(t)                                                           \
  SAME_SIZE(vp_cu_uuid_t, t);                                                  \
  SAME_MEMBER(vp_cu_uuid_t, bytes, t, bytes)
#define SAME_LOCATION(t)                                                       \
  SAME_SIZE(vp_cu_mem_location_t, t);                                          \
  SAME_MEMBER(vp_cu_mem_location_t, type, t, type);                            \
  SAME_MEMBER(vp_cu_mem_location_t, id, t, id)
#define SAME_ACCESS_DESC(t)                                                    \
  SAME_SIZE(vp_cu_mem_access_desc_t, t);                                       \
  SAME_MEMBER(vp_cu_mem_access_desc_t, location, t, location);                 \
  SAME_MEMBER(vp_cu_mem_access_desc_t, flags, t, flags)
/* cuda_abi.h's allocation property against t, member by member but for
 * the requested handle types (named `requested` in t) and what only CUDA
 * has (allocFlags.reserved). */
#define SAME_ALLOC_PROP(t, requested)                                          \
  SAME_MEMBER(vp_cu_mem_alloc_prop_t, type, t, type);                          \
  SAME_MEMBER(vp_cu_mem_alloc_prop_t, requested_handle_types, t, requested);   \
  SAME_MEMBER(vp_cu_mem_alloc_prop_t, location, t, location);                  \
  SAME_MEMBER(vp_cu_mem_alloc_prop_t, win32_handle_meta_data, t,               \
              win32HandleMetaData);                                            \
  SAME_MEMBER(vp_cu_mem_alloc_prop_t, alloc_flags.compression_type, t,         \
              allocFlags.compressionType);                                     \
  SAME_MEMBER(vp_cu_mem_alloc_prop_t, alloc_flags.gpu_direct_rdma_capable, t,  \
              allocFlags.gpuDirectRDMACapable);                                \
  SAME_MEMBER(vp_cu_mem_alloc_prop_t, alloc_flags.usage, t, allocFlags.usage)

#endif /* VPAGER_ABI_CHECK_H */
