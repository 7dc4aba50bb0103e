/* Host address space a caller reserves once and commits by range, and
 * read-only maps of files: the calls comfy_aimdo's host buffers and model
 * mappings need (python/compat), one set for POSIX and Windows over the
 * os layer, so the drop-in needs no libc of its own. Needs no device. */
#include <errno.h>
#include <string.h>

#include "internal.h"
#include "os.h"

/* An OS error of `what` as a vpager code: out of memory (the commit
 * limit, the kernel's mapping count) is VP_ENOMEM, anything else a range
 * the OS refused (not this process's, not reserved): VP_EINVAL. */
static int os_fail(int e, const char *what, const void *addr, uint64_t size) {
  return vp__err(e == ENOMEM ? VP_ENOMEM : VP_EINVAL,
                 "%s of [%p, +%llu): %s", what, addr,
                 (unsigned long long)size, strerror(e));
}

/* addr and size on page boundaries, the range not wrapping. */
static int check_range(const void *addr, uint64_t size) {
  uint64_t page = vp__os_page_size(), a = (uint64_t)(uintptr_t)addr;
  if (!addr) return vp__err(VP_EINVAL, "addr is NULL");
  if (a % page || size % page)
    return vp__err(VP_EINVAL, "addr %p or size %llu is not a multiple of "
                   "the page size (%llu)", addr, (unsigned long long)size,
                   (unsigned long long)page);
  if (size > SIZE_MAX || a + size < a)
    return vp__err(VP_EINVAL, "[%p, +%llu) wraps around", addr,
                   (unsigned long long)size);
  return VP_OK;
}

int vp_host_page_size(uint64_t *bytes) {
  VP__ENTER();
  VP__NEED(bytes, "bytes is NULL");
  *bytes = vp__os_page_size();
  return VP_OK;
}

int vp_host_reserve(uint64_t size, uint64_t align, void **addr) {
  VP__ENTER();
  VP__NEED(addr, "addr is NULL");
  *addr = NULL;
  if (!size || size > SIZE_MAX / 2)
    return vp__err(VP_EINVAL, "size %llu (give 1 byte to half the address "
                   "space)", (unsigned long long)size);
  if (align & (align - 1))
    return vp__err(VP_EINVAL, "align %llu is not a power of two",
                   (unsigned long long)align);
  uint64_t page = vp__os_page_size();
  size = (size + page - 1) / page * page;
  int e = vp__os_vm_reserve((size_t)size, (size_t)align, addr);
  if (e) {
    *addr = NULL;
    return os_fail(e, "reserving", NULL, size);
  }
  return VP_OK;
}

/* One OS call over a checked range; a size of 0 does nothing. */
static int range_call(void *addr, uint64_t size, int (*call)(void *, size_t),
                      const char *what) {
  int rc = check_range(addr, size);
  if (rc || !size) return rc;
  int e = call(addr, (size_t)size);
  return e ? os_fail(e, what, addr, size) : VP_OK;
}

int vp_host_commit(void *addr, uint64_t size) {
  VP__ENTER();
  return range_call(addr, size, vp__os_vm_commit, "committing");
}

int vp_host_populate(void *addr, uint64_t size) {
  VP__ENTER();
  return range_call(addr, size, vp__os_vm_populate, "faulting in");
}

int vp_host_discard(void *addr, uint64_t size) {
  VP__ENTER();
  return range_call(addr, size, vp__os_vm_discard, "discarding");
}

int vp_host_decommit(void *addr, uint64_t size) {
  VP__ENTER();
  return range_call(addr, size, vp__os_vm_decommit, "decommitting");
}

int vp_host_advise_huge(void *addr, uint64_t size) {
  VP__ENTER();
  int rc = check_range(addr, size);
  if (rc || !size) return rc;
  vp__os_vm_hint_huge(addr, (size_t)size); /* a hint: THP may be off */
  return VP_OK;
}

int vp_host_release(void *addr, uint64_t size) {
  VP__ENTER();
  int rc = check_range(addr, size);
  if (rc) return rc;
  if (!size) return vp__err(VP_EINVAL, "size is 0");
  int e = vp__os_vm_release(addr, (size_t)size);
  return e ? os_fail(e, "releasing", addr, size) : VP_OK;
}

int vp_file_map(int fd, uint64_t size, const void **addr) {
  VP__ENTER();
  VP__NEED(addr, "addr is NULL");
  *addr = NULL;
  if (fd < 0) return vp__err(VP_EINVAL, "fd %d", fd);
  if (!size) return vp__err(VP_EINVAL, "size is 0");
  vp__os_file_info_t info;
  int e = vp__os_file_stat(fd, &info);
  if (e) return vp__err(VP_EINVAL, "fd %d: %s", fd, strerror(e));
  if (!info.regular || size > info.size)
    return vp__err(VP_EINVAL, "fd %d: %llu bytes asked of a %s of %llu",
                   fd, (unsigned long long)size,
                   info.regular ? "file" : "non-regular file",
                   (unsigned long long)info.size);
  e = vp__os_file_map(fd, size, addr);
  if (e) {
    *addr = NULL;
    return os_fail(e, "mapping fd's bytes", NULL, size);
  }
  return VP_OK;
}

int vp_file_unmap(const void *addr, uint64_t size) {
  VP__ENTER();
  VP__NEED(addr, "addr is NULL");
  VP__NEED(size, "size is 0");
  vp__os_file_unmap(addr, size);
  return VP_OK;
}

int vp_file_read_at(int fd, void *buf, uint64_t n, uint64_t offset,
                    uint64_t *got) {
  VP__ENTER();
  VP__NEED(got, "got is NULL");
  *got = 0;
  if (fd < 0) return vp__err(VP_EINVAL, "fd %d", fd);
  if (n && !buf) return vp__err(VP_EINVAL, "buf is NULL with n %llu",
                                (unsigned long long)n);
  if (n > SIZE_MAX || offset > INT64_MAX)
    return vp__err(VP_EINVAL, "n %llu or offset %llu is too large",
                   (unsigned long long)n, (unsigned long long)offset);
  if (!n) return VP_OK;
  size_t r = 0;
  int e = vp__os_file_read_at(fd, buf, (size_t)n, offset, &r);
  if (e) return vp__err(e == ENOMEM ? VP_ENOMEM : VP_EINVAL,
                        "fd %d at %llu: %s", fd,
                        (unsigned long long)offset, strerror(e));
  *got = r;
  return VP_OK;
}
