/* Host buffers: allocation with address-stable growth, registration of the
 * caller's memory, the pin budget and its pageable fallback, bad input,
 * cleanup at device close, injected allocation failures, threads. */
#include "test.h"
#include "compat.h"
#include "internal.h" /* vp__host_piece */

#include <pthread.h>

#define KiB 1024ull
#define MiB (1024ull * 1024)

static uint64_t host_page(void) { return (uint64_t)sysconf(_SC_PAGESIZE); }
static uint64_t round_page(uint64_t n) {
  return (n + host_page() - 1) / host_page() * host_page();
}

static vp_hostbuf_info_t hb_info(vp_hostbuf_t hb) {
  vp_hostbuf_info_t info;
  memset(&info, 0xee, sizeof info);
  ASSERT_OK(vp_hostbuf_info(hb, &info));
  return info;
}

static bool all_zero(const uint8_t *p, uint64_t n) {
  for (uint64_t i = 0; i < n; i++)
    if (p[i]) return false;
  return true;
}

/* The error message names the function (`fn`). */
#define ASSERT_ERR(call, code, fn)                                             \
  do {                                                                         \
    ASSERT_RC(call, code);                                                     \
    ASSERT_STR_CONTAINS(vp_last_error(), fn);                                  \
  } while (0)

/* Copy src -> a VBAR page -> dst (a fresh buffer when NULL); compare. */
static void roundtrip_to(vp_device_t dev, const void *src, void *dst,
                         uint64_t n) {
  uint64_t ps = test_info(dev).page_size;
  ASSERT_LE_U64(n, ps);
  vp_vbar_t v = test_vbar(dev, ps);
  ASSERT_OK(vp_fault(v, 0, ps, NULL, 0));
  uint8_t *want = malloc(n), *back = dst ? dst : malloc(n);
  ASSERT_NOT_NULL(want);
  ASSERT_NOT_NULL(back);
  memcpy(want, src, n);
  ASSERT_OK(vp_copy_to_device(dev, test_vbar_base(v), src, n, 0));
  ASSERT_OK(vp_stream_synchronize(dev, 0)); /* src and dst may overlap */
  if (dst) memset(dst, 0, n);
  ASSERT_OK(vp_copy_to_host(dev, back, test_vbar_base(v), n, 0));
  ASSERT_OK(vp_stream_synchronize(dev, 0));
  ASSERT_MEM_EQ(back, want, n);
  if (!dst) free(back);
  free(want);
  ASSERT_OK(vp_unpin(v, 0, ps, 0));
  ASSERT_OK(vp_vbar_destroy(v));
}

static void roundtrip(vp_device_t dev, const void *src, uint64_t n) {
  roundtrip_to(dev, src, NULL, n);
}

/* vp_host_memory: the machine's RAM with no device open (Linux's
 * /proc/meminfo, Windows' GlobalMemoryStatusEx under Wine): some RAM, some
 * of it available; a limit below 2^60 or none (a v1 cgroup's "none" is a
 * huge number, not a limit); NULL refused, naming the call. */
TEST(host_memory_without_a_device, TEST_SIM_ONLY) {
  (void)ctx;
  vp_host_memory_t m;
  memset(&m, 0xee, sizeof m);
  ASSERT_OK(vp_host_memory(&m));
  test_log("RAM %llu MiB, available %llu MiB, limit %llu MiB",
           (unsigned long long)(m.total / MiB),
           (unsigned long long)(m.available / MiB),
           (unsigned long long)(m.limit / MiB));
  ASSERT_TRUE(m.total >= 64 * MiB);
  ASSERT_TRUE(m.available > 0 && m.available <= m.total);
  ASSERT_TRUE(m.limit < (1ull << 60));
  ASSERT_RC(vp_host_memory(NULL), VP_EINVAL);
  ASSERT_TRUE(strncmp(vp_last_error(), "vp_host_memory: ", 16) == 0);
}

/* The mapping of [p, +1) in vp_host_mappings' list, or NULL. */
static const vp_host_mapping_t *mapping_at(const vp_host_mapping_t *m,
                                           size_t n, const void *p) {
  uint64_t a = (uint64_t)(uintptr_t)p;
  for (size_t i = 0; i < n; i++)
    if (m[i].start <= a && a - m[i].start < m[i].size) return &m[i];
  return NULL;
}

/* This process's mappings, *n of them (malloc'd). */
static vp_host_mapping_t *all_mappings(size_t *n) {
  size_t cap = 0;
  vp_host_mapping_t *m = NULL;
  for (;;) {
    ASSERT_OK(vp_host_mappings(m, cap, n));
    if (*n <= cap) return m;
    cap = *n + 16;
    free(m);
    m = calloc(cap, sizeof *m);
    ASSERT_NOT_NULL(m);
  }
}

static bool ends_with(const char *s, const char *tail) {
  size_t a = strlen(s), b = strlen(tail);
  return a >= b && !strcmp(s + a - b, tail);
}

/* vp_host_mappings with no device: a file mapped read-only and shared, and
 * the same file mapped copy-on-write, are found where they lie with their
 * path, the file offset of each address (0 at the start; on Linux a view
 * from the second page too) and their flags (the copy-on-write one
 * WRITTEN once a page of it is); vp_host_drop_resident drops
 * the read-only one's pages only (and a private one's made read-only
 * only while none was written); a list too short still counts them
 * all; unmapped, they are gone; NULLs refused, naming the call. */
TEST(host_mappings_of_a_file, TEST_SIM_ONLY) {
  (void)ctx;
  char dir[256], path[320];
  test_make_dir(dir, sizeof dir, "maps");
  snprintf(path, sizeof path, "%s/weights.bin", dir);
  size_t page = (size_t)host_page(), size = 3 * page + 100;
  uint8_t *want = malloc(size);
  ASSERT_NOT_NULL(want);
  test_pattern(want, size, 7);
  test_write_file(path, want, size);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  ASSERT_GE_INT(fd, 0);
  uint8_t *ro = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
  uint8_t *cow = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  ASSERT_TRUE(ro != MAP_FAILED && cow != MAP_FAILED);
  ASSERT_TRUE(!memcmp(ro, want, size) && !memcmp(cow, want, size));
  uint8_t *from2 = MAP_FAILED;
#ifndef _WIN32 /* a view's offset is told on Linux only */
  from2 = mmap(NULL, page, PROT_READ, MAP_SHARED, fd, (off_t)page);
  ASSERT_TRUE(from2 != MAP_FAILED);
#endif
  size_t n;
  vp_host_mapping_t *m = all_mappings(&n);
  const vp_host_mapping_t *a = mapping_at(m, n, ro + page + 5),
                          *b = mapping_at(m, n, cow + 2 * page),
                          *c = mapping_at(m, n, from2);
  ASSERT_TRUE(a && b && a != b);
  test_log("%zu mappings; the file's: %s at +%llu, flags %u / %u", n,
           a->path, (unsigned long long)a->file_offset, a->flags, b->flags);
  ASSERT_TRUE(ends_with(a->path, "weights.bin") && !strcmp(a->path, b->path));
  ASSERT_EQ_U64(a->file_offset + ((uintptr_t)ro - a->start), 0);
  ASSERT_EQ_U64(b->file_offset + ((uintptr_t)cow - b->start), 0);
  ASSERT_TRUE(a->size >= size && a->file_id && a->file_id == b->file_id);
  ASSERT_EQ_U64(a->flags, 0);
  ASSERT_EQ_U64(b->flags, VP_MAPPING_WRITABLE | VP_MAPPING_PRIVATE);
#ifndef _WIN32
  struct stat st;
  ASSERT_EQ_INT(fstat(fd, &st), 0);
  ASSERT_EQ_U64(a->file_id, (uint64_t)st.st_ino);
  ASSERT_TRUE(c && c->file_id == a->file_id);
  ASSERT_EQ_U64(c->file_offset + ((uintptr_t)from2 - c->start), page);
  ASSERT_EQ_INT(munmap(from2, page), 0);
#else
  (void)c;
#endif
  /* Dropped from the resident set: the read-only map's whole pages (and
   * its bytes read back the same), nothing of the copy-on-write one (its
   * writes would go) nor of memory no file backs. */
  cow[1] ^= 0x5a; /* that page is the process's copy now */
  free(m);
  m = all_mappings(&n);
  b = mapping_at(m, n, cow);
  a = mapping_at(m, n, ro);
  ASSERT_TRUE(a && b && a->flags == 0);
  ASSERT_EQ_U64(b->flags, VP_MAPPING_WRITABLE | VP_MAPPING_PRIVATE |
                              VP_MAPPING_WRITTEN);
  uint64_t addrs[3] = {(uintptr_t)ro, (uintptr_t)cow, (uintptr_t)want},
           sizes[3] = {size, size, size}, dropped = 7;
  ASSERT_OK(vp_host_drop_resident(1, addrs, sizes, &dropped));
  ASSERT_EQ_U64(dropped, 3 * page);
  ASSERT_OK(vp_host_drop_resident(2, addrs + 1, sizes + 1, &dropped));
  ASSERT_EQ_U64(dropped, 0);
  ASSERT_TRUE(!memcmp(ro, want, size) && cow[1] == (want[1] ^ 0x5a));
#ifndef _WIN32
  /* A private map made read-only: dropped while never written; not once a
   * page was written before (its copy would go: a library's relocations). */
  uint8_t *rop = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  ASSERT_TRUE(rop != MAP_FAILED);
  ASSERT_EQ_INT(mprotect(rop, size, PROT_READ), 0);
  uint64_t rop_at = (uintptr_t)rop;
  ASSERT_OK(vp_host_drop_resident(1, &rop_at, sizes, &dropped));
  ASSERT_EQ_U64(dropped, 3 * page);
  ASSERT_EQ_INT(mprotect(rop, size, PROT_READ | PROT_WRITE), 0);
  rop[page + 3] ^= 0x77;
  ASSERT_EQ_INT(mprotect(rop, size, PROT_READ), 0);
  ASSERT_OK(vp_host_drop_resident(1, &rop_at, sizes, &dropped));
  ASSERT_EQ_U64(dropped, 0);
  ASSERT_TRUE(rop[page + 3] == (want[page + 3] ^ 0x77));
  ASSERT_EQ_INT(munmap(rop, size), 0);
#endif
  ASSERT_OK(vp_host_drop_resident(0, NULL, NULL, NULL));
  ASSERT_RC(vp_host_drop_resident(1, NULL, sizes, &dropped), VP_EINVAL);
  ASSERT_TRUE(strncmp(vp_last_error(), "vp_host_drop_resident: ", 23) == 0);
  /* A list of one still counts them all. */
  vp_host_mapping_t one;
  size_t n1 = 0;
  ASSERT_OK(vp_host_mappings(&one, 1, &n1));
  ASSERT_TRUE(n1 >= 2 && one.size > 0);
  ASSERT_EQ_INT(munmap(ro, size), 0);
  ASSERT_EQ_INT(munmap(cow, size), 0);
  free(m);
  m = all_mappings(&n);
  ASSERT_TRUE(!mapping_at(m, n, ro) && !mapping_at(m, n, cow));
  free(m);
  ASSERT_RC(vp_host_mappings(NULL, 0, NULL), VP_EINVAL);
  ASSERT_TRUE(strncmp(vp_last_error(), "vp_host_mappings: ", 18) == 0);
  ASSERT_RC(vp_host_mappings(NULL, 3, &n), VP_EINVAL);
  ASSERT_EQ_INT(close(fd), 0);
  free(want);
  test_rm_dir(dir);
}

TEST(hostbuf_alloc_grow, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  const uint64_t size = 100 * KiB + 123, max = 1 * MiB + 7;
  vp_hostbuf_t hb;
  ASSERT_OK(vp_hostbuf_alloc(dev, size, max, &hb));
  vp_hostbuf_info_t info = hb_info(hb);
  uint8_t *p = info.ptr;
  ASSERT_NOT_NULL(p);
  ASSERT_EQ_U64((uintptr_t)p % host_page(), 0);
  ASSERT_EQ_U64(info.size, size);
  ASSERT_EQ_U64(info.max_size, max);
  ASSERT_EQ_U64(info.pinned_bytes, size);
  ASSERT_TRUE(all_zero(p, size));
  vp_stats_t s = test_dev_stats(dev);
  ASSERT_EQ_U64(s.host_pinned_bytes, round_page(size));
  ASSERT_EQ_U64(s.pin_fallback_bytes, 0);

  test_pattern(p, size, 1);
  /* Bytes past the size in its last page: a grow zeroes them anyway. */
  memset(p + size, 0x5a, round_page(size) - size);
  const uint64_t size2 = 300 * KiB + 1;
  ASSERT_OK(vp_hostbuf_grow(hb, size2));
  info = hb_info(hb);
  ASSERT_EQ_PTR(info.ptr, p);
  ASSERT_EQ_U64(info.size, size2);
  ASSERT_EQ_U64(info.pinned_bytes, size2);
  uint8_t *want = malloc(max);
  ASSERT_NOT_NULL(want);
  test_pattern(want, size, 1);
  ASSERT_MEM_EQ(p, want, size);
  ASSERT_TRUE(all_zero(p + size, size2 - size));
  ASSERT_EQ_U64(test_dev_stats(dev).host_pinned_bytes, round_page(size2));
  /* A copy across the registration boundary of the grown part. */
  test_pattern(p, size2, 9);
  roundtrip(dev, p + round_page(size) - 1000, 2000);
  test_pattern(p, size, 1);
  memset(p + size, 0, size2 - size);

  /* Growing within the committed last page, to the same size, to max. */
  ASSERT_OK(vp_hostbuf_grow(hb, size2 + 1));
  ASSERT_OK(vp_hostbuf_grow(hb, size2 + 1));
  ASSERT_OK(vp_hostbuf_grow(hb, max));
  info = hb_info(hb);
  ASSERT_EQ_PTR(info.ptr, p);
  ASSERT_EQ_U64(info.size, max);
  ASSERT_EQ_U64(info.pinned_bytes, max);
  ASSERT_MEM_EQ(p, want, size);
  ASSERT_TRUE(all_zero(p + size, max - size));
  test_pattern(p, max, 2); /* every byte up to max is writable */
  test_pattern(want, max, 2);
  ASSERT_MEM_EQ(p, want, max);
  ASSERT_EQ_U64(test_dev_stats(dev).host_pinned_bytes, round_page(max));
  ASSERT_RC(vp_hostbuf_grow(hb, max + 1), VP_ERANGE);

  ASSERT_OK(vp_hostbuf_free(hb));
  s = test_dev_stats(dev);
  ASSERT_EQ_U64(s.host_pinned_bytes, 0);
  ASSERT_EQ_U64(s.pin_fallback_bytes, 0);
  free(want);
  ASSERT_OK(vp_device_close(dev));
}

/* A fixed-size buffer (size == max_size) and many small grows. */
/* A large buffer is faulted in over a few threads before it is pinned
 * (src/hostmem.c prefault): it reads as zeros, is pinned whole, and so is
 * a large grow of it. */
TEST(hostbuf_large_prefaulted, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  const uint64_t size = 600 * MiB + 5, max = 1200 * MiB;
  vp_hostbuf_t hb;
  ASSERT_OK(vp_hostbuf_alloc(dev, size, max, &hb));
  vp_hostbuf_info_t info = hb_info(hb);
  uint8_t *p = info.ptr;
  ASSERT_EQ_U64(info.pinned_bytes, size);
  /* on a huge-page boundary, so transparent huge pages can back it */
  ASSERT_EQ_U64((uintptr_t)p % (2 * MiB), 0);
  ASSERT_TRUE(all_zero(p, size));
  p[size - 1] = 7;
  ASSERT_OK(vp_hostbuf_grow(hb, max));
  info = hb_info(hb);
  ASSERT_EQ_U64(info.pinned_bytes, max);
  ASSERT_EQ_INT(p[size - 1], 7);
  ASSERT_TRUE(all_zero(p + size, max - size));
  ASSERT_OK(vp_hostbuf_free(hb));
  ASSERT_OK(vp_device_close(dev));
}

TEST(hostbuf_many_grows, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  vp_hostbuf_t fixed, hb;
  ASSERT_OK(vp_hostbuf_alloc(dev, 1, 1, &fixed));
  ASSERT_EQ_U64(hb_info(fixed).pinned_bytes, 1);
  ASSERT_RC(vp_hostbuf_grow(fixed, 2), VP_ERANGE);
  const uint64_t step = host_page() + 17;
  const int n = 40;
  ASSERT_OK(vp_hostbuf_alloc(dev, step, n * step, &hb));
  uint8_t *p = hb_info(hb).ptr;
  for (int i = 1; i <= n; i++) {
    if (i > 1) ASSERT_OK(vp_hostbuf_grow(hb, (uint64_t)i * step));
    memset(p + (uint64_t)(i - 1) * step, i, step);
  }
  for (int i = 1; i <= n; i++) {
    const uint8_t *q = p + (uint64_t)(i - 1) * step;
    ASSERT_EQ_INT(q[0], i);
    ASSERT_EQ_INT(q[step - 1], i);
  }
  vp_hostbuf_info_t info = hb_info(hb);
  ASSERT_EQ_PTR(info.ptr, p);
  ASSERT_EQ_U64(info.pinned_bytes, n * step);
  /* Copies across many registration chunks, both ways (CUDA refuses one
   * copy over two registrations: the library splits it). */
  uint64_t span = n * step / 2 - 64;
  if (span > test_page_size(ctx)) span = test_page_size(ctx);
  test_pattern(p, n * step, 8);
  roundtrip_to(dev, p + 5, p + n * step / 2, span);
  roundtrip_to(dev, p + 5, NULL, span);
  ASSERT_OK(vp_hostbuf_free(hb));
  ASSERT_OK(vp_hostbuf_free(fixed));
  ASSERT_EQ_U64(test_dev_stats(dev).host_pinned_bytes, 0);
  ASSERT_OK(vp_device_close(dev));
}

TEST(hostbuf_register, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  const uint64_t size = 256 * KiB + 5;
  uint8_t *mem = malloc(size), *want = malloc(size);
  ASSERT_NOT_NULL(mem);
  ASSERT_NOT_NULL(want);
  test_pattern(mem, size, 3);
  memcpy(want, mem, size);
  vp_hostbuf_t hb;
  ASSERT_OK(vp_hostbuf_register(dev, mem, size, &hb));
  vp_hostbuf_info_t info = hb_info(hb);
  ASSERT_EQ_PTR(info.ptr, mem);
  ASSERT_EQ_U64(info.size, size);
  ASSERT_EQ_U64(info.max_size, size);
  ASSERT_EQ_U64(info.pinned_bytes, size);
  ASSERT_MEM_EQ(mem, want, size); /* registering keeps the contents */
  ASSERT_EQ_U64(test_dev_stats(dev).host_pinned_bytes, size);
  /* The caller's memory cannot grow. */
  ASSERT_ERR(vp_hostbuf_grow(hb, size + 1), VP_EINVAL, "vp_hostbuf_grow");
  ASSERT_OK(vp_hostbuf_grow(hb, size)); /* no change is fine */
  ASSERT_OK(vp_hostbuf_free(hb));
  ASSERT_EQ_U64(test_dev_stats(dev).host_pinned_bytes, 0);
  /* Still the caller's: readable, writable, unchanged. */
  ASSERT_MEM_EQ(mem, want, size);
  memset(mem, 1, size);
  free(mem);
  free(want);
  ASSERT_OK(vp_device_close(dev));
}

/* Memory that cannot be written (a read-only file mapping used in place)
 * is registered as it is, pageable on a GPU: the driver's read-only flag
 * is never asked for (on the H200 VM it did not return), and copies from
 * the memory still work. The simulated device pins anything. */
TEST(hostbuf_register_read_only_stays_pageable, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  const size_t len = 4 * host_page();
  void *p = mmap(NULL, len, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_TRUE(p != MAP_FAILED);
  bool gpu = strcmp(vp_device_backend(dev), "sim") != 0;
  vp_hostbuf_t hb;
  ASSERT_OK(vp_hostbuf_register(dev, p, len, &hb));
  ASSERT_EQ_U64(hb_info(hb).pinned_bytes, gpu ? 0 : len);
  roundtrip(dev, p, len < test_page_size(ctx) ? len : test_page_size(ctx));
  ASSERT_OK(vp_hostbuf_free(hb));
  ASSERT_OK(vp_device_close(dev));
  munmap(p, len);
}

TEST(hostbuf_pin_budget_fallback, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  const uint64_t size = 64 * KiB + 3;
  vp_hostbuf_t a, b, c, r;
  ASSERT_OK(vp_hostbuf_alloc(dev, size, 4 * size, &a));
  ASSERT_EQ_U64(hb_info(a).pinned_bytes, size);
  uint64_t pinned0 = test_dev_stats(dev).host_pinned_bytes;
  ASSERT_EQ_U64(pinned0, round_page(size));

  /* A tiny budget: later buffers stay pageable, earlier ones stay pinned. */
  ASSERT_OK(vp_device_set_pin_budget(dev, 1));
  ASSERT_OK(vp_hostbuf_alloc(dev, size, size, &b));
  vp_hostbuf_info_t info = hb_info(b);
  ASSERT_EQ_U64(info.size, size);
  ASSERT_EQ_U64(info.pinned_bytes, 0);
  vp_stats_t s = test_dev_stats(dev);
  ASSERT_EQ_U64(s.pin_fallback_bytes, round_page(size));
  ASSERT_EQ_U64(s.host_pinned_bytes, pinned0);
  /* The grown part of a pinned buffer falls back too. */
  ASSERT_OK(vp_hostbuf_grow(a, 3 * size));
  info = hb_info(a);
  ASSERT_EQ_U64(info.pinned_bytes, round_page(size));
  s = test_dev_stats(dev);
  ASSERT_EQ_U64(s.pin_fallback_bytes, round_page(size) + round_page(3 * size) -
                                          round_page(size));
  ASSERT_EQ_U64(s.host_pinned_bytes, pinned0);
  /* Registered memory as well. */
  uint8_t *mem = malloc(size);
  ASSERT_NOT_NULL(mem);
  test_pattern(mem, size, 5);
  ASSERT_OK(vp_hostbuf_register(dev, mem, size, &r));
  ASSERT_EQ_U64(hb_info(r).pinned_bytes, 0);
  uint64_t fallback = test_dev_stats(dev).pin_fallback_bytes;

  /* Pageable buffers still work as copy sources. */
  uint8_t *pb = hb_info(b).ptr;
  test_pattern(pb, size, 4);
  roundtrip(dev, pb, size < test_page_size(ctx) ? size : test_page_size(ctx));
  roundtrip(dev, mem, size < test_page_size(ctx) ? size : test_page_size(ctx));
  uint8_t *pa = hb_info(a).ptr;
  test_pattern(pa, 3 * size, 6);
  roundtrip(dev, pa + size, 2 * size < test_page_size(ctx)
                                ? 2 * size
                                : test_page_size(ctx));

  /* A budget that holds exactly one more page-rounded buffer. */
  ASSERT_OK(vp_hostbuf_free(b));
  ASSERT_OK(vp_device_set_pin_budget(dev, pinned0 + round_page(size)));
  ASSERT_OK(vp_hostbuf_alloc(dev, size, size, &b));
  ASSERT_EQ_U64(hb_info(b).pinned_bytes, size);
  ASSERT_OK(vp_hostbuf_alloc(dev, size, size, &c));
  ASSERT_EQ_U64(hb_info(c).pinned_bytes, 0);
  ASSERT_EQ_U64(test_dev_stats(dev).pin_fallback_bytes,
                fallback + round_page(size));
  /* Freeing pinned memory gives budget back. */
  ASSERT_OK(vp_hostbuf_free(b));
  ASSERT_OK(vp_hostbuf_alloc(dev, size, size, &b));
  ASSERT_EQ_U64(hb_info(b).pinned_bytes, size);
  ASSERT_EQ_U64(test_dev_stats(dev).host_pinned_bytes,
                pinned0 + round_page(size));

  ASSERT_OK(vp_hostbuf_free(a));
  ASSERT_OK(vp_hostbuf_free(b));
  ASSERT_OK(vp_hostbuf_free(c));
  ASSERT_OK(vp_hostbuf_free(r));
  ASSERT_EQ_U64(test_dev_stats(dev).host_pinned_bytes, 0);
  free(mem);
  ASSERT_OK(vp_device_close(dev));
}

/* opts.pin_budget applies from open. */
TEST(hostbuf_pin_budget_option, TEST_ALL_BACKENDS) {
  vp_options_t opts;
  test_options(ctx, &opts);
  opts.pin_budget = 2 * host_page();
  vp_device_t dev = test_open(ctx, &opts);
  vp_hostbuf_t a, b;
  ASSERT_OK(vp_hostbuf_alloc(dev, 2 * host_page(), 8 * host_page(), &a));
  ASSERT_EQ_U64(hb_info(a).pinned_bytes, 2 * host_page());
  ASSERT_OK(vp_hostbuf_grow(a, 3 * host_page()));
  ASSERT_EQ_U64(hb_info(a).pinned_bytes, 2 * host_page());
  ASSERT_OK(vp_hostbuf_alloc(dev, 1, 1, &b));
  ASSERT_EQ_U64(hb_info(b).pinned_bytes, 0);
  vp_stats_t s = test_dev_stats(dev);
  ASSERT_EQ_U64(s.host_pinned_bytes, 2 * host_page());
  ASSERT_EQ_U64(s.pin_fallback_bytes, 2 * host_page());
  /* Raising the budget affects later pinning only. */
  ASSERT_OK(vp_device_set_pin_budget(dev, 1ull << 40));
  ASSERT_EQ_U64(hb_info(a).pinned_bytes, 2 * host_page());
  ASSERT_OK(vp_hostbuf_grow(a, 4 * host_page()));
  ASSERT_EQ_U64(hb_info(a).pinned_bytes, 3 * host_page());
  ASSERT_OK(vp_device_close(dev)); /* frees both */
}

TEST(hostbuf_bad_input, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  vp_hostbuf_t hb = {123}, bad = {0};
  vp_hostbuf_info_t info;
  int x = 0;
  ASSERT_ERR(vp_hostbuf_alloc(dev, 1, 1, NULL), VP_EINVAL, "vp_hostbuf_alloc");
  ASSERT_ERR(vp_hostbuf_alloc(dev, 0, 10, &hb), VP_EINVAL, "vp_hostbuf_alloc");
  ASSERT_EQ_U64(hb.id, 0); /* out is cleared on failure */
  ASSERT_ERR(vp_hostbuf_alloc(dev, 0, 0, &hb), VP_EINVAL, "size is 0");
  ASSERT_ERR(vp_hostbuf_alloc(dev, 11, 10, &hb), VP_EINVAL, "max_size 10");
  ASSERT_ERR(vp_hostbuf_alloc(dev, 1, UINT64_MAX, &hb), VP_ENOMEM,
             "vp_hostbuf_alloc");
  ASSERT_ERR(vp_hostbuf_alloc(dev, 1, 1ull << 62, &hb), VP_ENOMEM,
             "vp_hostbuf_alloc");
  ASSERT_ERR(vp_hostbuf_alloc((vp_device_t){0x4242}, 1, 1, &hb), VP_EHANDLE,
             "vp_hostbuf_alloc");
  ASSERT_ERR(vp_hostbuf_register(dev, NULL, 4, &hb), VP_EINVAL,
             "vp_hostbuf_register");
  ASSERT_ERR(vp_hostbuf_register(dev, &x, 0, &hb), VP_EINVAL,
             "vp_hostbuf_register");
  ASSERT_ERR(vp_hostbuf_register(dev, &x, sizeof x, NULL), VP_EINVAL,
             "vp_hostbuf_register");
  ASSERT_ERR(vp_hostbuf_register(dev, (void *)(uintptr_t)-16, 64, &hb),
             VP_EINVAL, "wraps");
  ASSERT_ERR(vp_hostbuf_register((vp_device_t){0}, &x, sizeof x, &hb),
             VP_EHANDLE, "vp_hostbuf_register");
  ASSERT_ERR(vp_device_set_pin_budget((vp_device_t){0x4242}, 1), VP_EHANDLE,
             "vp_device_set_pin_budget");
  /* Never-created handles. */
  ASSERT_ERR(vp_hostbuf_info(bad, &info), VP_EHANDLE, "vp_hostbuf_info");
  ASSERT_ERR(vp_hostbuf_grow(bad, 1), VP_EHANDLE, "vp_hostbuf_grow");
  ASSERT_ERR(vp_hostbuf_free(bad), VP_EHANDLE, "vp_hostbuf_free");
  ASSERT_ERR(vp_hostbuf_free((vp_hostbuf_t){dev.id}), VP_EHANDLE,
             "vp_hostbuf_free");

  ASSERT_OK(vp_hostbuf_alloc(dev, 100, 1000, &hb));
  ASSERT_ERR(vp_hostbuf_info(hb, NULL), VP_EINVAL, "vp_hostbuf_info");
  ASSERT_ERR(vp_hostbuf_grow(hb, 99), VP_EINVAL, "99");
  ASSERT_ERR(vp_hostbuf_grow(hb, 1001), VP_ERANGE, "1001");
  ASSERT_EQ_U64(hb_info(hb).size, 100); /* nothing changed */
  /* A VBAR handle is not a host buffer, and the other way round. */
  vp_vbar_t v = test_vbar(dev, test_page_size(ctx));
  ASSERT_ERR(vp_hostbuf_free((vp_hostbuf_t){v.id}), VP_EHANDLE,
             "vp_hostbuf_free");
  ASSERT_RC(vp_vbar_destroy((vp_vbar_t){hb.id}), VP_EHANDLE);
  ASSERT_OK(vp_vbar_destroy(v));
  /* A handle of another device. */
  vp_device_t dev2 = test_open(ctx, NULL);
  vp_hostbuf_t other;
  ASSERT_OK(vp_hostbuf_alloc(dev2, 10, 10, &other));
  ASSERT_OK(vp_device_close(dev2));
  ASSERT_ERR(vp_hostbuf_info(other, &info), VP_EHANDLE, "vp_hostbuf_info");
  ASSERT_ERR(vp_hostbuf_free(other), VP_EHANDLE, "vp_hostbuf_free");
  /* Stale: freed, then every call, and a double free. */
  ASSERT_OK(vp_hostbuf_free(hb));
  ASSERT_ERR(vp_hostbuf_info(hb, &info), VP_EHANDLE, "vp_hostbuf_info");
  ASSERT_ERR(vp_hostbuf_grow(hb, 200), VP_EHANDLE, "vp_hostbuf_grow");
  ASSERT_ERR(vp_hostbuf_free(hb), VP_EHANDLE, "vp_hostbuf_free");
  /* A new buffer in the reused slot does not revive the old handle. */
  vp_hostbuf_t again;
  ASSERT_OK(vp_hostbuf_alloc(dev, 100, 100, &again));
  ASSERT_NE_U64(again.id, hb.id);
  ASSERT_ERR(vp_hostbuf_free(hb), VP_EHANDLE, "vp_hostbuf_free");
  ASSERT_OK(vp_hostbuf_free(again));
  ASSERT_EQ_U64(test_dev_stats(dev).host_pinned_bytes, 0);
  ASSERT_OK(vp_device_close(dev));
  /* A closed device. */
  ASSERT_ERR(vp_hostbuf_alloc(dev, 1, 1, &hb), VP_EHANDLE, "vp_hostbuf_alloc");
  ASSERT_ERR(vp_device_set_pin_budget(dev, 1), VP_EHANDLE,
             "vp_device_set_pin_budget");
}

/* Host buffers left open are freed by close (LeakSanitizer checks in the
 * ASan run); registered memory stays the caller's. */
TEST(hostbuf_close_frees, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  vp_hostbuf_t a, b, c;
  ASSERT_OK(vp_hostbuf_alloc(dev, 10 * KiB, 1 * MiB, &a));
  ASSERT_OK(vp_hostbuf_grow(a, 500 * KiB));
  ASSERT_OK(vp_hostbuf_alloc(dev, 1, 1, &b));
  uint8_t *mem = malloc(64 * KiB);
  ASSERT_NOT_NULL(mem);
  ASSERT_OK(vp_hostbuf_register(dev, mem, 64 * KiB, &c));
  ASSERT_GT_U64(test_dev_stats(dev).host_pinned_bytes, 0);
  ASSERT_OK(vp_device_close(dev));
  ASSERT_RC(vp_hostbuf_info(a, &(vp_hostbuf_info_t){0}), VP_EHANDLE);
  ASSERT_RC(vp_hostbuf_free(c), VP_EHANDLE);
  memset(mem, 7, 64 * KiB);
  free(mem);
}

/* The address space in use: an unmapped reservation would show here. */
static uint64_t vm_size(void) {
  uint64_t n = test_vm_size();
  ASSERT_GT_U64(n, 0);
  return n;
}

/* One rung: open, alloc, grow, register, free, close with the nth failable
 * call failing. Returns true when nothing failed. */
static bool hostbuf_rung(test_ctx_t *ctx, int64_t nth, void *mem,
                         uint64_t reserve) {
  vp_options_t opts;
  test_options(ctx, &opts);
  opts.sim_fail_nth = nth;
  vp_device_t dev;
  if (vp_device_open(&opts, &dev) != VP_OK) return false;
  bool clean = true;
  vp_hostbuf_t a, r;
  int rc = vp_hostbuf_alloc(dev, 3 * host_page(), reserve, &a);
  if (rc) {
    ASSERT_RC(rc, VP_ENOMEM);
    ASSERT_TRUE(vp_last_error()[0] != '\0');
    ASSERT_EQ_U64(a.id, 0);
    clean = false;
  } else {
    vp_hostbuf_info_t info = hb_info(a);
    clean &= info.pinned_bytes == info.size;
    for (uint64_t n = 4; n <= 12 && rc == VP_OK; n += 4) {
      rc = vp_hostbuf_grow(a, n * host_page());
      if (rc) {
        ASSERT_RC2(rc, VP_ENOMEM, VP_EDEVICE);
        ASSERT_TRUE(vp_last_error()[0] != '\0');
        clean = false;
      }
    }
    info = hb_info(a);
    clean &= info.pinned_bytes == info.size;
    ASSERT_TRUE(all_zero(info.ptr, info.size));
    ASSERT_OK(vp_hostbuf_free(a));
  }
  rc = vp_hostbuf_register(dev, mem, 8 * KiB, &r);
  if (rc) {
    ASSERT_RC2(rc, VP_ENOMEM, VP_EDEVICE);
    clean = false;
  } else {
    clean &= hb_info(r).pinned_bytes == 8 * KiB;
    ASSERT_OK(vp_hostbuf_free(r));
  }
  ASSERT_EQ_U64(test_dev_stats(dev).host_pinned_bytes, 0);
  ASSERT_OK(vp_device_close(dev));
  return clean;
}

/* Every failable step of alloc, grow and register fails once: a clean
 * error or a pageable fallback, never a leak (LeakSanitizer) or a mapping
 * left behind (VmSize). */
TEST(hostbuf_inject_walk, TEST_SIM_ONLY) {
  const uint64_t reserve = 1ull << 30; /* large, so a leak shows in VmSize */
  uint8_t *mem = malloc(8 * KiB);
  ASSERT_NOT_NULL(mem);
  hostbuf_rung(ctx, 0, mem, reserve); /* warm up lazy allocations */
  uint64_t vm0 = vm_size();
  int clean = 0;
  int64_t nth;
  for (nth = 1; nth < 500 && clean < 4; nth++) {
    test_note("sim_fail_nth %" PRId64, nth);
    clean = hostbuf_rung(ctx, nth, mem, reserve) ? clean + 1 : 0;
    ASSERT_LT_U64(vm_size(), vm0 + reserve / 2);
  }
  ASSERT_LT_INT(nth, 500);
  free(mem);
}

/* Threads allocating, growing, registering and freeing on one device while
 * the budget changes and VBAR pages fault: registration runs with the
 * device lock dropped, so TSan checks the hand-over. */
typedef struct hb_thread {
  vp_device_t dev;
  vp_hostbuf_t shared;
  int seed;
} hb_thread_t;

static void *hb_worker(void *arg) {
  hb_thread_t *t = arg;
  uint64_t pg = host_page();
  uint8_t *mem = malloc(4 * pg);
  ASSERT_NOT_NULL(mem);
  for (uint64_t i = 0; i < test_scale(200); i++) {
    vp_hostbuf_t hb, r;
    ASSERT_OK(vp_hostbuf_alloc(t->dev, pg, 8 * pg, &hb));
    uint8_t *p = hb_info(hb).ptr;
    p[0] = (uint8_t)t->seed;
    ASSERT_OK(vp_hostbuf_grow(hb, pg + (i % 8) * pg - i % 2));
    ASSERT_EQ_INT(p[0], (uint8_t)t->seed);
    ASSERT_OK(vp_hostbuf_register(t->dev, mem, 4 * pg, &r));
    /* The shared buffer: grows race; EBUSY or EINVAL (another grew it
     * further) are the only refusals. */
    int rc = vp_hostbuf_grow(t->shared, (i % 64 + 1) * pg);
    if (rc != VP_OK && rc != VP_EBUSY) ASSERT_RC(rc, VP_EINVAL);
    if (i % 16 == 0)
      ASSERT_OK(vp_device_set_pin_budget(t->dev,
                                         (i & 16) ? 4 * pg : 1ull << 40));
    ASSERT_OK(vp_hostbuf_free(r));
    ASSERT_OK(vp_hostbuf_free(hb));
  }
  free(mem);
  return NULL;
}

TEST(hostbuf_threads, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  vp_hostbuf_t shared;
  ASSERT_OK(vp_hostbuf_alloc(dev, 1, 64 * host_page(), &shared));
  enum { N = 4 };
  hb_thread_t t[N];
  pthread_t th[N];
  for (int i = 0; i < N; i++) {
    t[i] = (hb_thread_t){dev, shared, i + 1};
    ASSERT_EQ_INT(pthread_create(&th[i], NULL, hb_worker, &t[i]), 0);
  }
  vp_vbar_t v = test_vbar(dev, 2 * ps);
  for (uint64_t i = 0; i < test_scale(200); i++) {
    ASSERT_OK(vp_fault(v, (i % 2) * ps, ps, NULL, 0));
    ASSERT_OK(vp_unpin(v, (i % 2) * ps, ps, 0));
  }
  for (int i = 0; i < N; i++) ASSERT_EQ_INT(pthread_join(th[i], NULL), 0);
  vp_hostbuf_info_t info = hb_info(shared);
  ASSERT_GE_U64(info.size, host_page());
  ASSERT_LE_U64(info.size, 64 * host_page());
  ASSERT_LE_U64(info.pinned_bytes, info.size);
  ASSERT_TRUE(all_zero(info.ptr, info.size));
  ASSERT_OK(vp_hostbuf_free(shared));
  ASSERT_EQ_U64(test_dev_stats(dev).host_pinned_bytes, 0);
  ASSERT_OK(vp_vbar_destroy(v));
  ASSERT_OK(vp_device_close(dev));
}

/* Where copies are split: at every chunk edge of every host buffer, and
 * nowhere else (internal helper; the device lock is not needed here, as no
 * other thread runs). */
TEST(hostbuf_copy_pieces, TEST_SIM_ONLY) {
  vp_device_t dev = test_open(ctx, NULL);
  vp__device_t *d = vp__registry_get(dev.id);
  ASSERT_NOT_NULL(d);
  const uint64_t pg = host_page();
  vp_hostbuf_t hb, r;
  ASSERT_OK(vp_hostbuf_alloc(dev, pg, 4 * pg, &hb));
  ASSERT_OK(vp_hostbuf_grow(hb, 2 * pg + 1)); /* chunks [0, pg), [pg, 3pg) */
  uint8_t *p = hb_info(hb).ptr;
  ASSERT_EQ_U64(vp__host_piece(d, p, 3 * pg), pg);
  ASSERT_EQ_U64(vp__host_piece(d, p + 10, 3 * pg), pg - 10);
  ASSERT_EQ_U64(vp__host_piece(d, p + 10, 20), 20);
  ASSERT_EQ_U64(vp__host_piece(d, p + pg, 5 * pg), 2 * pg);
  ASSERT_EQ_U64(vp__host_piece(d, p + 3 * pg - 1, 5 * pg), 1);
  ASSERT_EQ_U64(vp__host_piece(d, p - 100, 1000), 100);
  uint8_t *mem = malloc(3 * pg), other[64];
  ASSERT_NOT_NULL(mem);
  ASSERT_OK(vp_hostbuf_register(dev, mem + 7, 2 * pg, &r));
  ASSERT_EQ_U64(vp__host_piece(d, mem, 3 * pg), 7);
  ASSERT_EQ_U64(vp__host_piece(d, mem + 8, 3 * pg - 8), 2 * pg - 1);
  ASSERT_EQ_U64(vp__host_piece(d, other, sizeof other), sizeof other);
  /* A freed buffer no longer splits. */
  ASSERT_OK(vp_hostbuf_free(r));
  ASSERT_EQ_U64(vp__host_piece(d, mem, 3 * pg), 3 * pg);
  free(mem);
  ASSERT_OK(vp_device_close(dev));
}
