/* The common part of the stand-in GPU drivers (tests/fakehip/fake_hip.c,
 * tests/fakecuda/fake_cuda.c): device memory as host memory, with the
 * checks CUDA's and HIP's virtual memory calls make.
 *
 * A reservation is a PROT_NONE mapping; an allocation a shared anonymous
 * mapping (no file descriptor: tests count theirs); a map puts a second
 * view of its pages at the reserved address (mremap of size 0), still
 * PROT_NONE; set-access makes it read-write; unmap puts PROT_NONE back, so
 * touching an unmapped page faults as on a GPU. Each call checks what the
 * drivers check (granularity, a map inside a reservation and over no
 * other, an unmap of whole mappings), and a handle released while mapped
 * is freed at its last unmap, as cuMemRelease documents.
 *
 * Each driver turns the fv_ codes into its own. Linux only.
 */
#ifndef VPAGER_FAKE_VMM_H
#define VPAGER_FAKE_VMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define FV_DEVICES 2
#define FV_MEMORY (1ull << 30)     /* per device */
#define FV_GRANULARITY (2ull << 20)

typedef enum fv_status {
  FV_OK,
  FV_INVALID,          /* bad size, alignment, range or flags */
  FV_OUT_OF_MEMORY,
  FV_INVALID_HANDLE,   /* not a live allocation */
  FV_NOT_MAPPED,       /* part of the range is not mapped */
  FV_ALREADY_MAPPED,   /* part of the range is mapped already */
  FV_NO_ACCESS,        /* mapped, but set-access never made it usable */
  FV_INVALID_DEVICE,   /* memory of another device: no peer access here */
  FV_HOST_REGISTERED,  /* overlaps a registration */
  FV_HOST_NOT_REGISTERED,
  FV_HOST_READ_ONLY    /* cannot be pinned for writing */
} fv_status_t;

typedef struct fv_handle fv_handle_t;

fv_status_t fv_reserve(size_t size, size_t align, uintptr_t addr,
                       unsigned long long flags, void **ptr);
fv_status_t fv_address_free(void *ptr, size_t size);
fv_status_t fv_create(size_t size, int device, fv_handle_t **out);
fv_status_t fv_release(fv_handle_t *h);
fv_status_t fv_map(void *ptr, size_t size, size_t offset, fv_handle_t *h);
/* Read-write for `device`, which must be the memory's own: the stand-in
 * GPUs have no peer access. */
fv_status_t fv_set_access(void *ptr, size_t size, int device);
fv_status_t fv_unmap(void *ptr, size_t size);
/* Bytes allocated on a device (released handles still mapped count). */
uint64_t fv_used(int device);
/* FV_OK when every byte of [ptr, ptr + size) is mapped and accessible:
 * what a copy to or from device memory needs. */
fv_status_t fv_accessible(uintptr_t ptr, size_t size);
/* read_only: the driver's read-only flag was given, so memory that cannot
 * be written may be pinned. */
fv_status_t fv_host_register(void *ptr, size_t size, bool read_only);
fv_status_t fv_host_unregister(void *ptr);
/* FV_OK when ptr lies in registered host memory. */
fv_status_t fv_host_registered(const void *ptr);

#endif /* VPAGER_FAKE_VMM_H */
