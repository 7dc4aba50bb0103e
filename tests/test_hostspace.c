/* Host address space reserved, committed, given back by range, and files
 * mapped and read (src/hostspace.c): the same calls on Linux and, under
 * Wine, Windows (make check-windows WIN_TESTS=host_space). */
#include "test.h"
#include "compat.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static bool all_bytes(const uint8_t *p, size_t n, uint8_t v) {
  for (size_t i = 0; i < n; i++)
    if (p[i] != v) return false;
  return true;
}

/* A reservation at a 2 MiB boundary; its first pages committed, written,
 * faulted in; one discarded (zeros, still writable), one decommitted and
 * committed again (zeros); the rest untouched; released whole. Bad ranges
 * refused, naming the call. */
TEST(host_space_reserve_commit_release, TEST_SIM_ONLY) {
  (void)ctx;
  uint64_t page = 0;
  ASSERT_OK(vp_host_page_size(&page));
  ASSERT_TRUE(page >= 4096 && !(page & (page - 1)));
  uint64_t align = 2 << 20, size = 16 * page + 1, whole = 17 * page;
  void *base = NULL;
  ASSERT_OK(vp_host_reserve(size, align, &base));
  ASSERT_TRUE(base && (uintptr_t)base % align == 0);
  uint8_t *p = base;
  ASSERT_OK(vp_host_commit(p, 4 * page));
  ASSERT_OK(vp_host_advise_huge(p, 4 * page));
  ASSERT_OK(vp_host_populate(p, 4 * page));
  ASSERT_TRUE(all_bytes(p, 4 * page, 0));
  memset(p, 0xab, 4 * page);
  ASSERT_OK(vp_host_discard(p + page, page));
  ASSERT_TRUE(all_bytes(p + page, page, 0) && all_bytes(p, page, 0xab));
  p[page] = 1; /* still read-write */
  ASSERT_OK(vp_host_decommit(p + 2 * page, 2 * page));
  ASSERT_OK(vp_host_commit(p + 2 * page, page));
  ASSERT_TRUE(all_bytes(p + 2 * page, page, 0) && p[page] == 1);
  ASSERT_OK(vp_host_commit(p, 0)); /* nothing to do */
  /* Misaligned, NULL, not a power of two: refused. */
  ASSERT_RC(vp_host_commit(p + 1, page), VP_EINVAL);
  ASSERT_TRUE(strncmp(vp_last_error(), "vp_host_commit: ", 16) == 0);
  ASSERT_RC(vp_host_discard(p, page + 1), VP_EINVAL);
  ASSERT_RC(vp_host_decommit(NULL, page), VP_EINVAL);
  ASSERT_RC(vp_host_populate(p, UINT64_MAX / page * page), VP_EINVAL);
  void *none = (void *)1;
  ASSERT_RC(vp_host_reserve(page, 3 * page, &none), VP_EINVAL);
  ASSERT_TRUE(none == NULL);
  ASSERT_RC(vp_host_reserve(0, 0, &none), VP_EINVAL);
  ASSERT_RC(vp_host_reserve(page, 0, NULL), VP_EINVAL);
  ASSERT_RC(vp_host_release(p, 0), VP_EINVAL);
  ASSERT_RC(vp_host_page_size(NULL), VP_EINVAL);
  ASSERT_OK(vp_host_release(base, whole));
  /* Any alignment the OS gives by itself. */
  ASSERT_OK(vp_host_reserve(page, 0, &base));
  ASSERT_OK(vp_host_commit(base, page));
  ((uint8_t *)base)[page - 1] = 9;
  ASSERT_OK(vp_host_release(base, page));
}

/* A file mapped read-only shows its bytes; read at offsets, the reads
 * stop at its end; bad fds and sizes refused. */
TEST(host_space_file_map_and_read, TEST_SIM_ONLY) {
  (void)ctx;
  char dir[256], path[320];
  test_make_dir(dir, sizeof dir, "space");
  snprintf(path, sizeof path, "%s/weights.bin", dir);
  size_t size = 3 * 4096 + 77;
  uint8_t *want = malloc(size), *got = malloc(size);
  ASSERT_TRUE(want && got);
  test_pattern(want, size, 11);
  test_write_file(path, want, size);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  ASSERT_GE_INT(fd, 0);
  const void *m = NULL;
  ASSERT_OK(vp_file_map(fd, size, &m));
  ASSERT_TRUE(m && !memcmp(m, want, size));
  ASSERT_OK(vp_file_unmap(m, size));
  ASSERT_RC(vp_file_map(fd, size + 1, &m), VP_EINVAL);
  ASSERT_TRUE(m == NULL);
  ASSERT_TRUE(strncmp(vp_last_error(), "vp_file_map: ", 13) == 0);
  ASSERT_RC(vp_file_map(-1, size, &m), VP_EINVAL);
  ASSERT_RC(vp_file_map(fd, 0, &m), VP_EINVAL);
  ASSERT_RC(vp_file_unmap(NULL, size), VP_EINVAL);
  uint64_t n = 0;
  ASSERT_OK(vp_file_read_at(fd, got, 5000, 100, &n));
  ASSERT_EQ_U64(n, 5000);
  ASSERT_TRUE(!memcmp(got, want + 100, 5000));
  ASSERT_OK(vp_file_read_at(fd, got, 1000, size - 10, &n));
  ASSERT_EQ_U64(n, 10);
  ASSERT_OK(vp_file_read_at(fd, got, 1000, size, &n));
  ASSERT_EQ_U64(n, 0);
  ASSERT_OK(vp_file_read_at(fd, NULL, 0, 0, &n));
  ASSERT_RC(vp_file_read_at(fd, NULL, 8, 0, &n), VP_EINVAL);
  ASSERT_RC(vp_file_read_at(-3, got, 8, 0, &n), VP_EINVAL);
  ASSERT_RC(vp_file_read_at(fd, got, 8, 0, NULL), VP_EINVAL);
  ASSERT_EQ_INT(close(fd), 0);
  test_rm_dir(dir);
  free(want);
  free(got);
}
