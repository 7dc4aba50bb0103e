/* fuzz_safetensors: vp_st_open and everything after it on arbitrary files.
 *
 * Input: one byte of flags, then the file. The file is written to a memfd
 * and opened through /proc/self/fd/N on a simulated device. A file that
 * fails to open must fail with VP_EINVAL or VP_ENOMEM and a message naming
 * it. A file that opens must list sane tensors (checked against the file
 * itself, independently of the parser): known dtypes, shape x dtype size
 * = data size, data inside the file after the header, in offset order
 * without overlaps, names unique and found by vp_st_find, sources at the
 * data; vp_st_mmap shows the file's bytes. Flags then load tensors into a
 * VBAR (vp_st_load) and make weights of them (vp_st_source + vp_acquire),
 * and both must read back the file's bytes.
 *
 * Flags: bit 0 load, bit 1 weights, bit 2 open it twice, bit 3 drop
 * pages, bits 4-5 file reader slot size, bit 6 worker streams. */
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fuzz_common.h"

#define KiB 1024ull
#define PAGE (64 * KiB)
#define MAXLOAD 4
#define MAXSZ (256 * KiB)

static int fd = -1;
static char path[64];
static uint8_t *rbuf;

/* dtype sizes in bits, from the safetensors format (not the parser). */
static const struct {
  const char *name;
  unsigned bits;
} dtypes[] = {
    {"BOOL", 8},     {"U8", 8},     {"I8", 8},     {"F8_E5M2", 8},
    {"F8_E4M3", 8},  {"F8_E8M0", 8}, {"F8_E4M3FNUZ", 8}, {"F8_E5M2FNUZ", 8},
    {"I16", 16},     {"U16", 16},   {"F16", 16},   {"BF16", 16},
    {"I32", 32},     {"U32", 32},   {"F32", 32},   {"C64", 64},
    {"F64", 64},     {"I64", 64},   {"U64", 64},   {"F4", 4},
    {"F6_E2M3", 6},  {"F6_E3M2", 6},
};

static unsigned dtype_bits(const char *d) {
  for (size_t i = 0; i < sizeof dtypes / sizeof *dtypes; i++)
    if (strcmp(dtypes[i].name, d) == 0) return dtypes[i].bits;
  return 0;
}

#define CHECK(cond, ...)                                                       \
  do {                                                                         \
    if (!(cond)) fz_fail(__VA_ARGS__);                                         \
  } while (0)

static void check_tensors(vp_st_t st, const uint8_t *file, size_t n,
                          size_t *count) {
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = hlen << 8 | file[i];
  int rc = FZ_CALL(false, vp_st_count(st, count), "st");
  CHECK(rc == VP_OK, "vp_st_count: %s", fz_name(rc));
  CHECK(*count <= n, "%zu tensors in a %zu-byte file", *count, n);
  uint64_t prev_off = 0, far_end = 0;
  for (size_t i = 0; i < *count; i++) {
    vp_st_tensor_t t;
    rc = FZ_CALL(false, vp_st_tensor(st, i, &t), "st, %zu", i);
    CHECK(rc == VP_OK, "vp_st_tensor(%zu): %s", i, fz_name(rc));
    CHECK(t.name && t.name[0], "tensor %zu has an empty name", i);
    CHECK(memchr(t.dtype, 0, sizeof t.dtype), "tensor %zu dtype not "
          "terminated", i);
    unsigned bits = dtype_bits(t.dtype);
    CHECK(bits, "tensor %zu (%s): dtype \"%s\" is not a safetensors dtype", i,
          t.name, t.dtype);
    CHECK(t.ndim <= 8, "tensor %zu: ndim %u", i, t.ndim);
    unsigned __int128 elems = 1;
    for (uint32_t d = 0; d < t.ndim; d++) {
      elems *= t.shape[d];
      if (elems > ((unsigned __int128)1 << 80)) elems = (unsigned __int128)1
                                                        << 80;
    }
    unsigned __int128 nbits = elems * bits;
    CHECK(nbits % 8 == 0 && nbits / 8 == t.size, "tensor %zu (%s): %s shape "
          "holds %llu bits, size %llu bytes", i, t.name, t.dtype,
          (unsigned long long)nbits, (unsigned long long)t.size);
    CHECK(t.offset >= 8 + hlen && t.offset <= n && t.size <= n - t.offset,
          "tensor %zu (%s): [%llu, +%llu) is not in the data of a %zu-byte "
          "file with a %llu-byte header", i, t.name,
          (unsigned long long)t.offset, (unsigned long long)t.size, n,
          (unsigned long long)hlen);
    CHECK(t.offset >= prev_off, "tensor %zu is listed out of offset order",
          i);
    if (t.size) {
      CHECK(t.offset >= far_end, "tensor %zu (%s) overlaps an earlier one", i,
            t.name);
      far_end = t.offset + t.size;
    }
    prev_off = t.offset;
    size_t at = SIZE_MAX;
    rc = FZ_CALL(false, vp_st_find(st, t.name, &at), "st, \"%.40s\"", t.name);
    CHECK(rc == VP_OK && at == i, "vp_st_find(\"%s\") = %s, index %zu, not "
          "%zu", t.name, fz_name(rc), at, i);
    vp_source_t src;
    rc = FZ_CALL(false, vp_st_source(st, i, &src), "st, %zu", i);
    CHECK(rc == VP_OK && src.kind == VP_SOURCE_FILE && src.fd >= 0 &&
          src.file_offset == t.offset, "vp_st_source(%zu)", i);
  }
  vp_st_tensor_t t;
  rc = FZ_CALL(false, vp_st_tensor(st, *count, &t), "st, %zu (past)", *count);
  CHECK(rc == VP_ERANGE, "vp_st_tensor past the end: %s", fz_name(rc));
  vp_source_t src;
  rc = FZ_CALL(false, vp_st_source(st, *count, &src), "st, past");
  CHECK(rc == VP_ERANGE, "vp_st_source past the end: %s", fz_name(rc));
  size_t at;
  rc = FZ_CALL(false, vp_st_find(st, "\x01no such tensor", &at), "st");
  CHECK(rc == VP_EINVAL, "vp_st_find of a missing name: %s", fz_name(rc));
  const void *base = NULL;
  uint64_t msize = 0;
  rc = FZ_CALL(false, vp_st_mmap(st, &base, &msize), "st");
  CHECK(rc == VP_OK && msize == n && (!n || memcmp(base, file, n) == 0),
        "vp_st_mmap: %s, %llu bytes", fz_name(rc),
        (unsigned long long)msize);
}

/* Up to MAXLOAD small tensors, laid out in a VBAR with gaps; loaded with
 * vp_st_load, read back through faults; then (flag) as weights. */
static void load_tensors(vp_device_t dev, vp_st_t st, const uint8_t *file,
                         size_t count, uint8_t flags) {
  size_t idx[MAXLOAD], k = 0;
  uint64_t offs[MAXLOAD], sizes[MAXLOAD], srcoff[MAXLOAD], at = 0;
  for (size_t i = 0; i < count && k < MAXLOAD; i++) {
    vp_st_tensor_t t;
    if (vp_st_tensor(st, i, &t) || !t.size || t.size > MAXSZ) continue;
    idx[k] = i;
    offs[k] = at + (i * 40) % 4096;
    sizes[k] = t.size;
    srcoff[k] = t.offset;
    at = offs[k] + t.size;
    k++;
  }
  if (!k) return;
  vp_vbar_t v;
  int rc = FZ_CALL(false, vp_vbar_create(dev, at, &v), "%llu",
                   (unsigned long long)at);
  CHECK(rc == VP_OK, "vp_vbar_create: %s", fz_name(rc));
  uint64_t base;
  vp_vbar_base(v, &base);
  if (flags & 1) {
    rc = FZ_CALL(true, vp_st_load(st, k, idx, v, offs, 0), "st, %zu", k);
    CHECK(rc == VP_OK, "vp_st_load of %zu tensors: %s", k, fz_name(rc));
    for (size_t j = 0; j < k; j++) {
      rc = FZ_CALL(true, vp_fault(v, offs[j], sizes[j], NULL, 0), "%llu",
                   (unsigned long long)offs[j]);
      CHECK(rc == VP_OK, "vp_fault after vp_st_load: %s", fz_name(rc));
      rc = FZ_CALL(false, vp_copy_to_host(dev, rbuf, base + offs[j], sizes[j],
                                          0), "%zu", j);
      CHECK(rc == VP_OK, "vp_copy_to_host: %s", fz_name(rc));
      vp_stream_synchronize(dev, 0);
      CHECK(memcmp(rbuf, file + srcoff[j], sizes[j]) == 0,
            "tensor %zu loaded with other bytes than the file's", idx[j]);
      rc = FZ_CALL(false, vp_unpin(v, offs[j], sizes[j], 0), "%zu", j);
      CHECK(rc == VP_OK, "vp_unpin: %s", fz_name(rc));
    }
  }
  if (flags & 2) {
    vp_source_t src[MAXLOAD];
    vp_weight_t w[MAXLOAD];
    uint64_t ptrs[MAXLOAD];
    for (size_t j = 0; j < k; j++) vp_st_source(st, idx[j], &src[j]);
    rc = FZ_CALL(false, vp_weights_create(v, k, offs, sizes, src, w), "%zu",
                 k);
    CHECK(rc == VP_OK, "vp_weights_create: %s", fz_name(rc));
    uint64_t freed; /* evict the loaded bytes: the sources must be read */
    vp_vbar_free_memory(v, UINT64_MAX, &freed);
    rc = FZ_CALL(false, vp_acquire(dev, w, k, 0, ptrs, NULL), "%zu", k);
    CHECK(rc == VP_OK, "vp_acquire of tensor weights: %s", fz_name(rc));
    for (size_t j = 0; j < k; j++) {
      rc = FZ_CALL(false, vp_copy_to_host(dev, rbuf, ptrs[j], sizes[j], 0),
                   "%zu", j);
      CHECK(rc == VP_OK, "vp_copy_to_host: %s", fz_name(rc));
      vp_stream_synchronize(dev, 0);
      CHECK(memcmp(rbuf, file + srcoff[j], sizes[j]) == 0,
            "weight of tensor %zu acquired with other bytes than the file's",
            idx[j]);
    }
    rc = FZ_CALL(false, vp_release(dev, w, k, 0), "%zu", k);
    CHECK(rc == VP_OK, "vp_release: %s", fz_name(rc));
  }
  rc = FZ_CALL(false, vp_vbar_destroy(v), "v");
  CHECK(rc == VP_OK, "vp_vbar_destroy: %s", fz_name(rc));
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  vp_set_log_level(VP_LOG_NONE);
  fz_trace_live = getenv("FUZZ_TRACE") != NULL;
  fz_dump_on_death();
  fd = memfd_create("vpager-fuzz-st", MFD_CLOEXEC);
  rbuf = malloc(MAXSZ);
  if (fd < 0 || !rbuf) abort();
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  uint8_t flags = data[0];
  const uint8_t *file = data + 1;
  size_t n = size - 1;
  fz_trace_reset();
  if (ftruncate(fd, 0) || (n && pwrite(fd, file, n, 0) != (ssize_t)n))
    abort();
  vp_options_t o;
  vp_options_init(&o);
  o.backend = VP_BACKEND_SIM;
  o.page_size = PAGE;
  o.sim_granularity = PAGE;
  o.sim_capacity = 64 * PAGE;
  o.sim_streams = (flags & 0x40) ? VP_SIM_WORKER : VP_SIM_SYNC;
  o.sim_shared[0] = '\0';
  o.staging_size = 2 * MAXSZ;
  o.lookahead = 0;
  o.file_slots = 2;
  o.file_slot_size = 4096ull << ((flags >> 4) & 3) * 2;
  vp_device_t dev;
  int rc = FZ_CALL(false, vp_device_open(&o, &dev), "sim");
  CHECK(rc == VP_OK, "vp_device_open: %s", fz_name(rc));
  vp_st_t st, st2;
  rc = FZ_CALL(false, vp_st_open(dev, path, &st), "%zu bytes", n);
  if (rc) {
    CHECK(rc == VP_EINVAL || rc == VP_ENOMEM, "vp_st_open: %s", fz_name(rc));
    CHECK(strstr(vp_last_error(), path), "vp_st_open's message does not name "
          "the file: %s", vp_last_error());
  } else {
    size_t count = 0;
    check_tensors(st, file, n, &count);
    if (flags & 4) {
      rc = FZ_CALL(false, vp_st_open(dev, path, &st2), "again");
      CHECK(rc == VP_OK, "second vp_st_open: %s", fz_name(rc));
      size_t c2 = 0;
      vp_st_count(st2, &c2);
      CHECK(c2 == count, "second open: %zu tensors, first %zu", c2, count);
    }
    if (flags & 3) load_tensors(dev, st, file, count, flags);
    if (flags & 8) {
      rc = FZ_CALL(false, vp_st_drop_pages(st), "st");
      CHECK(rc == VP_OK, "vp_st_drop_pages: %s", fz_name(rc));
    }
    rc = FZ_CALL(false, vp_st_close(st), "st");
    CHECK(rc == VP_OK, "vp_st_close: %s", fz_name(rc));
    rc = FZ_CALL(false, vp_st_close(st), "st again");
    CHECK(rc == VP_EHANDLE, "second vp_st_close: %s", fz_name(rc));
    /* st2 (flag 4) is left open: closing the device closes it. */
  }
  rc = FZ_CALL(false, vp_device_close(dev), "dev");
  CHECK(rc == VP_OK, "vp_device_close: %s", fz_name(rc));
  return 0;
}
