/* safetensors: a valid file (listing, find, sources, load, mmap), every
 * malformed case with its message, loads that must be all or nothing (a
 * file changed under us, injected failures), and handle errors. */
#include "test.h"
#include "compat.h"

#include <dirent.h>
#include <pthread.h>


static void write_raw(const char *path, const void *data, size_t size) {
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  ASSERT_GE_INT(fd, 0);
  if (size) ASSERT_EQ_INT(write(fd, data, size), (long long)size);
  ASSERT_EQ_INT(close(fd), 0);
}

/* An 8-byte little-endian length, the header (padded with spaces to a
 * multiple of 8, as writers do), then the data. */
static void write_st(const char *path, const char *json, const void *data,
                     size_t dlen) {
  size_t jlen = strlen(json), padded = (jlen + 7) / 8 * 8;
  size_t total = 8 + padded + dlen;
  unsigned char *buf = malloc(total);
  ASSERT_NOT_NULL(buf);
  for (int i = 0; i < 8; i++) buf[i] = (unsigned char)(padded >> (8 * i));
  memcpy(buf + 8, json, jlen);
  memset(buf + 8 + jlen, ' ', padded - jlen);
  if (dlen) memcpy(buf + 8 + padded, data, dlen);
  write_raw(path, buf, total);
  free(buf);
}

static int count_fds(void) {
  int n = test_fd_count();
  ASSERT_GE_INT(n, 0);
  return n;
}

/* Opening path fails with `code`, a message naming the file, `needle` and
 * (if not NULL) the tensor, and leaves no handle and no descriptor. */
static void expect_bad(vp_device_t dev, const char *path, int code,
                       const char *needle, const char *tensor) {
  test_note("%s: expecting \"%s\"", path, needle);
  int fds = count_fds();
  vp_st_t st = {777};
  ASSERT_RC(vp_st_open(dev, path, &st), code);
  ASSERT_EQ_U64(st.id, 777);
  ASSERT_STR_CONTAINS(vp_last_error(), "vp_st_open");
  ASSERT_STR_CONTAINS(vp_last_error(), path);
  ASSERT_STR_CONTAINS(vp_last_error(), needle);
  if (tensor) {
    char q[256];
    snprintf(q, sizeof q, "tensor \"%s\"", tensor);
    ASSERT_STR_CONTAINS(vp_last_error(), q);
  }
  ASSERT_EQ_INT(count_fds(), fds);
  test_note("%s", "");
}

/* ------------------------------------------------------ the valid file */

/* Listed out of offset order, with whitespace, metadata, escapes, a
 * scalar, an empty tensor, a sub-byte dtype and a gap in the data. */
static const char valid_json[] =
    "{\"__metadata__\": {\"format\": \"pt\", \"note\": \"a\\nb \\u00e9\"},\n"
    " \"big\": {\"dtype\": \"U8\", \"shape\": [70000], "
    "\"data_offsets\": [104, 70104]},\n"
    " \"a.bias\": {\"dtype\": \"BF16\", \"shape\": [7], "
    "\"data_offsets\": [60, 74]},\n"
    " \"b.weight\": {\"shape\": [3, 5], \"dtype\": \"F32\", "
    "\"data_offsets\": [0, 60]},\n"
    " \"scalar\": {\"dtype\": \"I64\", \"shape\": [], "
    "\"data_offsets\": [80, 88]},\n"
    " \"empty\": {\"dtype\": \"F16\", \"shape\": [0, 4], "
    "\"data_offsets\": [88, 88]},\n"
    " \"f4\": {\"dtype\": \"F4\", \"shape\": [2, 3], "
    "\"data_offsets\": [88, 91]},\n"
    " \"caf\\u00e9 \\\"q\\\" \\ud83d\\ude00\": {\"dtype\": \"U16\", "
    "\"shape\": [2], \"data_offsets\": [96, 100]}\n"
    "}";
#define VALID_DATA 70104

static const struct {
  const char *name, *dtype;
  uint32_t ndim;
  uint64_t shape[2], begin, end;
} valid_tensors[] = {
    /* in data offset order */
    {"b.weight", "F32", 2, {3, 5}, 0, 60},
    {"a.bias", "BF16", 1, {7}, 60, 74},
    {"scalar", "I64", 0, {0}, 80, 88},
    {"empty", "F16", 2, {0, 4}, 88, 88},
    {"f4", "F4", 2, {2, 3}, 88, 91},
    {"caf\xc3\xa9 \"q\" \xf0\x9f\x98\x80", "U16", 1, {2}, 96, 100},
    {"big", "U8", 1, {70000}, 104, 70104},
};
#define NVALID (sizeof valid_tensors / sizeof valid_tensors[0])

static uint64_t valid_header_len(void) {
  return (strlen(valid_json) + 7) / 8 * 8;
}

static unsigned char *make_valid(const char *path) {
  unsigned char *data = malloc(VALID_DATA);
  ASSERT_NOT_NULL(data);
  test_pattern(data, VALID_DATA, 3);
  for (size_t i = 0; i < VALID_DATA; i++) data[i] |= 1; /* never 0 */
  write_st(path, valid_json, data, VALID_DATA);
  return data;
}

/* VBAR offsets for the tensors (index order): "big" crosses pages. */
static void valid_offsets(uint64_t ps, uint64_t *off) {
  static const uint64_t small[] = {0, 1000, 2000, 3000, 3100, 3200};
  for (size_t i = 0; i < NVALID - 1; i++) off[i] = small[i];
  off[NVALID - 1] = ps - 100;
}

/* Fault each tensor's range, read it back, compare with the file's data,
 * unpin. */
static void check_loaded(vp_device_t dev, vp_vbar_t v, const uint64_t *off,
                         const unsigned char *data, vp_stream_t s) {
  uint64_t base = test_vbar_base(v);
  for (size_t i = 0; i < NVALID; i++) {
    uint64_t size = valid_tensors[i].end - valid_tensors[i].begin;
    if (!size) continue;
    unsigned char *back = malloc(size);
    ASSERT_NOT_NULL(back);
    ASSERT_OK(vp_fault(v, off[i], size, NULL, 0));
    ASSERT_OK(vp_copy_to_host(dev, back, base + off[i], size, s));
    ASSERT_OK(vp_stream_synchronize(dev, s));
    test_note("tensor %s", valid_tensors[i].name);
    ASSERT_MEM_EQ(back, data + valid_tensors[i].begin, size);
    ASSERT_OK(vp_unpin(v, off[i], size, s));
    free(back);
  }
  test_note("%s", "");
}

static void valid_file(test_ctx_t *ctx, int streams) {
  vp_options_t o;
  test_options(ctx, &o);
  o.file_slots = 3;
  o.file_slot_size = 8192;
  o.sim_streams = streams;
  vp_device_t dev = test_open(ctx, &o);
  uint64_t ps = test_page_size(ctx);
  char dir[64], path[128];
  test_make_dir(dir, sizeof dir, "st");
  snprintf(path, sizeof path, "%s/model.safetensors", dir);
  unsigned char *data = make_valid(path);
  uint64_t start = 8 + valid_header_len();
  int fds = count_fds();

  vp_st_t st;
  ASSERT_OK(vp_st_open(dev, path, &st));
  size_t n = 0;
  ASSERT_OK(vp_st_count(st, &n));
  ASSERT_EQ_U64(n, NVALID);
  for (size_t i = 0; i < NVALID; i++) {
    vp_st_tensor_t t;
    ASSERT_OK(vp_st_tensor(st, i, &t));
    ASSERT_EQ_STR(t.name, valid_tensors[i].name);
    ASSERT_EQ_STR(t.dtype, valid_tensors[i].dtype);
    ASSERT_EQ_U64(t.ndim, valid_tensors[i].ndim);
    for (uint32_t d = 0; d < t.ndim; d++)
      ASSERT_EQ_U64(t.shape[d], valid_tensors[i].shape[d]);
    ASSERT_EQ_U64(t.offset, start + valid_tensors[i].begin);
    ASSERT_EQ_U64(t.size, valid_tensors[i].end - valid_tensors[i].begin);
    size_t idx = 99;
    ASSERT_OK(vp_st_find(st, valid_tensors[i].name, &idx));
    ASSERT_EQ_U64(idx, i);
    /* The source reads the same bytes. */
    vp_source_t src;
    ASSERT_OK(vp_st_source(st, i, &src));
    ASSERT_EQ_INT(src.kind, VP_SOURCE_FILE);
    ASSERT_EQ_U64(src.file_offset, t.offset);
    unsigned char buf[128];
    if (t.size && t.size <= sizeof buf) {
      ASSERT_EQ_INT(pread(src.fd, buf, t.size, (off_t)src.file_offset),
                    (long long)t.size);
      ASSERT_MEM_EQ(buf, data + valid_tensors[i].begin, t.size);
    }
  }
  vp_st_tensor_t t;
  size_t idx;
  ASSERT_RC(vp_st_tensor(st, NVALID, &t), VP_ERANGE);
  ASSERT_RC(vp_st_source(st, NVALID, &(vp_source_t){0}), VP_ERANGE);
  ASSERT_RC(vp_st_find(st, "nope", &idx), VP_EINVAL);
  ASSERT_STR_CONTAINS(vp_last_error(), "nope");
  ASSERT_RC(vp_st_find(st, "big ", &idx), VP_EINVAL);
  ASSERT_RC(vp_st_find(st, "__metadata__", &idx), VP_EINVAL);

  /* Load every tensor, on a stream of our own in worker mode. */
  vp_stream_t s = 0;
  if (streams == VP_SIM_WORKER) ASSERT_OK(vp_stream_create(dev, &s));
  vp_vbar_t v = test_vbar(dev, 4 * ps);
  size_t all[NVALID];
  uint64_t off[NVALID];
  for (size_t i = 0; i < NVALID; i++) all[i] = i;
  valid_offsets(ps, off);
  uint64_t total = 0;
  for (size_t i = 0; i < NVALID; i++)
    total += valid_tensors[i].end - valid_tensors[i].begin;
  vp_stats_t before = test_dev_stats(dev);
  ASSERT_OK(vp_st_load(st, NVALID, all, v, off, s));
  ASSERT_EQ_U64(test_dev_stats(dev).file_bytes_read - before.file_bytes_read,
                total);
  ASSERT_EQ_U64(test_vbar_stats(v).file_bytes_read, total);
  ASSERT_EQ_U64(test_vbar_stats(v).pinned_bytes, 0);
  check_loaded(dev, v, off, data, s);
  /* Again, in another order, into a second VBAR. */
  vp_vbar_t w = test_vbar(dev, 4 * ps);
  size_t rev[NVALID];
  uint64_t roff[NVALID], woff[NVALID];
  valid_offsets(ps, woff);
  for (size_t i = 0; i < NVALID; i++) {
    rev[i] = NVALID - 1 - i;
    roff[i] = woff[NVALID - 1 - i];
  }
  ASSERT_OK(vp_st_load(st, NVALID, rev, w, roff, s));
  check_loaded(dev, w, woff, data, s);
  ASSERT_OK(vp_st_load(st, 0, NULL, w, NULL, s));

  /* The mapping holds the file. */
  const void *base = NULL, *again = NULL;
  uint64_t size = 0;
  ASSERT_OK(vp_st_mmap(st, &base, &size));
  ASSERT_EQ_U64(size, start + VALID_DATA);
  ASSERT_MEM_EQ((const unsigned char *)base + start, data, VALID_DATA);
  ASSERT_EQ_INT(((const unsigned char *)base)[0], (int)(valid_header_len() & 0xff));
  ASSERT_OK(vp_st_mmap(st, &again, &size));
  ASSERT_EQ_PTR(again, base);
  ASSERT_OK(vp_st_drop_pages(st));
  ASSERT_MEM_EQ((const unsigned char *)base + start, data, VALID_DATA);

  if (s) ASSERT_OK(vp_stream_destroy(dev, s));
  ASSERT_OK(vp_st_close(st));
  ASSERT_EQ_INT(count_fds(), fds);
  ASSERT_RC(vp_st_close(st), VP_EHANDLE);
  ASSERT_RC(vp_st_count(st, &n), VP_EHANDLE);
  ASSERT_RC(vp_st_load(st, 1, all, v, off, 0), VP_EHANDLE);
  /* A second open, left for the device close to free. */
  ASSERT_OK(vp_st_open(dev, path, &st));
  ASSERT_OK(vp_st_drop_pages(st)); /* no mapping yet */
  ASSERT_OK(vp_st_mmap(st, &base, &size));
  ASSERT_OK(vp_device_close(dev));
  /* On CUDA the close also drops the driver's own descriptors, opened with
   * the device before `fds` was counted: none of ours may remain. */
  if (ctx->backend == VP_BACKEND_SIM) ASSERT_EQ_INT(count_fds(), fds);
  else ASSERT_LE_INT(count_fds(), fds);
  free(data);
  test_rm_dir(dir);
}

TEST(st_valid, TEST_ALL_BACKENDS) { valid_file(ctx, VP_SIM_SYNC); }
TEST(st_valid_worker, TEST_ALL_BACKENDS) { valid_file(ctx, VP_SIM_WORKER); }

TEST(st_edge_cases_valid, TEST_SIM_ONLY) {
  vp_device_t dev = test_open(ctx, NULL);
  char dir[64], path[128];
  test_make_dir(dir, sizeof dir, "st");
  snprintf(path, sizeof path, "%s/x.safetensors", dir);
  vp_st_t st;
  size_t n = 9, idx;
  /* No tensors at all, and leading whitespace. */
  write_st(path, " \n{}", NULL, 0);
  ASSERT_OK(vp_st_open(dev, path, &st));
  ASSERT_OK(vp_st_count(st, &n));
  ASSERT_EQ_U64(n, 0);
  ASSERT_RC(vp_st_find(st, "a", &idx), VP_EINVAL);
  ASSERT_OK(vp_st_close(st));
  /* Only metadata; data after the last tensor is allowed. */
  write_st(path, "{\"__metadata__\":{}}", "abc", 3);
  ASSERT_OK(vp_st_open(dev, path, &st));
  ASSERT_OK(vp_st_count(st, &n));
  ASSERT_EQ_U64(n, 0);
  ASSERT_OK(vp_st_close(st));
  /* A 1024-byte name, every dtype, zero-size tensors sharing an offset. */
  static const char *const dts[] = {
      "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ",
      "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32",
      "C64", "F64", "I64", "U64"};
  static const int bytes[] = {1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2,
                              4, 4, 4, 8, 8, 8, 8};
  size_t cap = 8192, at = 0;
  char *json = malloc(cap);
  ASSERT_NOT_NULL(json);
  at += (size_t)snprintf(json + at, cap - at, "{\"");
  for (int i = 0; i < 1024; i++) json[at++] = 'n';
  at += (size_t)snprintf(json + at, cap - at, "\":{\"dtype\":\"U8\","
                         "\"shape\":[1],\"data_offsets\":[0,1]}");
  uint64_t pos = 8;
  for (size_t i = 0; i < sizeof dts / sizeof dts[0]; i++) {
    at += (size_t)snprintf(json + at, cap - at, ",\"t%zu\":{\"dtype\":\"%s\","
                           "\"shape\":[2,1],\"data_offsets\":[%llu,%llu]}", i,
                           dts[i], (unsigned long long)pos,
                           (unsigned long long)(pos + 2 * bytes[i]));
    pos += 2 * bytes[i];
  }
  at += (size_t)snprintf(json + at, cap - at,
                         ",\"z1\":{\"dtype\":\"F32\",\"shape\":[0],"
                         "\"data_offsets\":[4,4]},\"z2\":{\"dtype\":\"F6_E2M3\","
                         "\"shape\":[4],\"data_offsets\":[1,4]},\"z3\":{"
                         "\"dtype\":\"F6_E3M2\",\"shape\":[0,5],"
                         "\"data_offsets\":[4,4]}}");
  ASSERT_LT_U64(at, cap);
  unsigned char data[256];
  memset(data, 0x5a, sizeof data);
  write_st(path, json, data, pos);
  ASSERT_OK(vp_st_open(dev, path, &st));
  ASSERT_OK(vp_st_count(st, &n));
  ASSERT_EQ_U64(n, 1 + sizeof dts / sizeof dts[0] + 3);
  vp_st_tensor_t t;
  ASSERT_OK(vp_st_tensor(st, 0, &t));
  ASSERT_EQ_U64(strlen(t.name), 1024);
  ASSERT_OK(vp_st_find(st, "t6", &idx));
  ASSERT_OK(vp_st_tensor(st, idx, &t));
  ASSERT_EQ_STR(t.dtype, "F8_E4M3FNUZ");
  ASSERT_OK(vp_st_find(st, "z2", &idx));
  ASSERT_OK(vp_st_tensor(st, idx, &t));
  ASSERT_EQ_U64(t.size, 3);
  ASSERT_OK(vp_st_close(st));
  free(json);
  ASSERT_OK(vp_device_close(dev));
  test_rm_dir(dir);
}

/* -------------------------------------------------------- malformed */

#define W_OK_FIELDS "\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]"

static const struct bad_case {
  const char *label, *json, *needle, *tensor;
} bad_cases[] = {
    /* JSON syntax */
    {"trailing_comma", "{\"a\":{" W_OK_FIELDS "},}",
     "trailing comma in an object", NULL},
    {"trailing_comma_array",
     "{\"a\":{\"dtype\":\"U8\",\"shape\":[4,],\"data_offsets\":[0,4]}}",
     "trailing comma in an array", "a"},
    {"trailing_comma_fields", "{\"a\":{" W_OK_FIELDS ",}}",
     "trailing comma in an object", "a"},
    {"unterminated", "{\"a\":{\"dtype\":\"U8", "unterminated string", "a"},
    {"unterminated_key", "{\"abc", "unterminated string", NULL},
    {"bad_escape", "{\"a\\q\":{}}", "invalid escape", NULL},
    {"bad_u_escape", "{\"a\\u12G4\":{}}", "four hex digits", NULL},
    {"short_u_escape", "{\"a\\u12\":{}}", "four hex digits", NULL},
    {"lone_high_surrogate", "{\"a\\ud800\":{}}", "high surrogate", NULL},
    {"lone_low_surrogate", "{\"a\\udc00\":{}}", "low surrogate", NULL},
    {"nul_escape", "{\"a\\u0000b\":{}}", "NUL", NULL},
    {"control_char", "{\"a\tb\":{}}", "control character", NULL},
    {"bad_utf8", "{\"a\xff\":{}}", "invalid UTF-8", NULL},
    {"overlong_utf8", "{\"a\xc0\xaf\":{}}", "invalid UTF-8", NULL},
    {"utf8_surrogate", "{\"a\xed\xa0\x80\":{}}", "invalid UTF-8", NULL},
    {"not_object", "[1,2]", "not a JSON object", NULL},
    {"string_top", "\"x\"", "not a JSON object", NULL},
    {"empty_header", "", "not a JSON object (it is empty)", NULL},
    {"blank_header", "        ", "not a JSON object (it is empty)", NULL},
    {"data_after", "{} {}", "data after the JSON value", NULL},
    {"missing_colon", "{\"a\" {}}", "expected ':'", NULL},
    {"missing_comma", "{\"a\":{\"dtype\":\"U8\" \"shape\":[4]}}",
     "expected ',' or '}'", "a"},
    {"array_missing_comma",
     "{\"a\":{\"dtype\":\"U8\",\"shape\":[4 4],\"data_offsets\":[0,4]}}",
     "expected ',' or ']'", "a"},
    {"unclosed", "{\"a\":{" W_OK_FIELDS "}", "unexpected end", NULL},
    {"key_not_string", "{a:1}", "expected a string key", NULL},
    {"comment", "{/* x */}", "expected a string key", NULL},
    /* dtypes and shapes */
    {"unknown_dtype",
     "{\"w\":{\"dtype\":\"F128\",\"shape\":[4],\"data_offsets\":[0,4]}}",
     "unknown dtype \"F128\"", "w"},
    {"lowercase_dtype",
     "{\"w\":{\"dtype\":\"f32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
     "unknown dtype \"f32\"", "w"},
    {"dtype_not_string",
     "{\"w\":{\"dtype\":5,\"shape\":[4],\"data_offsets\":[0,4]}}",
     "\"dtype\" is not a string", "w"},
    {"size_mismatch",
     "{\"w\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}",
     "is 12 bytes but data_offsets [0, 8] hold 8", "w"},
    {"size_mismatch_2d",
     "{\"w\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[0,4]}}",
     "shape [2, 2] of BF16 is 8 bytes", "w"},
    {"negative_shape",
     "{\"w\":{\"dtype\":\"U8\",\"shape\":[-1],\"data_offsets\":[0,4]}}",
     "negative number", "w"},
    {"float_shape",
     "{\"w\":{\"dtype\":\"U8\",\"shape\":[1.5],\"data_offsets\":[0,4]}}",
     "fraction or exponent", "w"},
    {"exponent_shape",
     "{\"w\":{\"dtype\":\"U8\",\"shape\":[4e0],\"data_offsets\":[0,4]}}",
     "fraction or exponent", "w"},
    {"string_shape",
     "{\"w\":{\"dtype\":\"U8\",\"shape\":[\"4\"],\"data_offsets\":[0,4]}}",
     "expected a non-negative integer", "w"},
    {"null_shape",
     "{\"w\":{\"dtype\":\"U8\",\"shape\":null,\"data_offsets\":[0,4]}}",
     "\"shape\" is not an array", "w"},
    {"leading_zero",
     "{\"w\":{\"dtype\":\"U8\",\"shape\":[04],\"data_offsets\":[0,4]}}",
     "leading zero", "w"},
    {"too_many_dims",
     "{\"w\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,4],"
     "\"data_offsets\":[0,4]}}",
     "\"shape\" has more than 8 entries", "w"},
    {"shape_overflow",
     "{\"w\":{\"dtype\":\"U8\",\"shape\":[4294967296,4294967296,2],"
     "\"data_offsets\":[0,4]}}",
     "overflows 64 bits", "w"},
    {"bytes_overflow",
     "{\"w\":{\"dtype\":\"F64\",\"shape\":[4611686018427387904],"
     "\"data_offsets\":[0,4]}}",
     "overflows 64 bits", "w"},
    {"f4_half_byte",
     "{\"w\":{\"dtype\":\"F4\",\"shape\":[3],\"data_offsets\":[0,2]}}",
     "not a whole number of bytes", "w"},
    /* offsets */
    {"float_offset",
     "{\"w\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4.0]}}",
     "fraction or exponent", "w"},
    {"negative_offset",
     "{\"w\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[-4,0]}}",
     "negative number", "w"},
    {"huge_offset",
     "{\"w\":{\"dtype\":\"U8\",\"shape\":[4],"
     "\"data_offsets\":[0,99999999999999999999]}}",
     "does not fit in 64 bits", "w"},
    {"offsets_out_of_range",
     "{\"w\":{\"dtype\":\"U8\",\"shape\":[16],\"data_offsets\":[0,16]}}",
     "run past the end of the file", "w"},
    {"offsets_far_out",
     "{\"w\":{\"dtype\":\"U8\",\"shape\":[4],"
     "\"data_offsets\":[18446744073709551610,18446744073709551614]}}",
     "run past the end of the file", "w"},
    {"begin_after_end",
     "{\"w\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[4,2]}}",
     "begin is after end", "w"},
    {"offsets_three",
     "{\"w\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4,8]}}",
     "\"data_offsets\" has more than 2 entries", "w"},
    {"offsets_one",
     "{\"w\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[4]}}",
     "\"data_offsets\" has 1 entries", "w"},
    {"overlap",
     "{\"a\":{" W_OK_FIELDS "},\"b\":{\"dtype\":\"U8\",\"shape\":[4],"
     "\"data_offsets\":[2,6]}}",
     "overlap those of tensor \"a\"", "b"},
    {"overlap_inside",
     "{\"a\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[0,8]},"
     "\"c\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[6,7]},"
     "\"b\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[2,4]}}",
     "overlap those of tensor \"a\"", "b"},
    /* structure */
    {"duplicate_name",
     "{\"a\":{" W_OK_FIELDS "},\"x\":{\"dtype\":\"U8\",\"shape\":[4],"
     "\"data_offsets\":[4,8]},\"a\":{\"dtype\":\"U8\",\"shape\":[4],"
     "\"data_offsets\":[4,8]}}",
     "the name appears twice", "a"},
    {"duplicate_field",
     "{\"w\":{\"dtype\":\"U8\",\"dtype\":\"U8\",\"shape\":[4],"
     "\"data_offsets\":[0,4]}}",
     "\"dtype\" appears twice", "w"},
    {"missing_offsets", "{\"w\":{\"dtype\":\"U8\",\"shape\":[4]}}",
     "missing \"data_offsets\"", "w"},
    {"missing_dtype", "{\"w\":{\"shape\":[4],\"data_offsets\":[0,4]}}",
     "missing \"dtype\"", "w"},
    {"missing_shape", "{\"w\":{\"dtype\":\"U8\",\"data_offsets\":[0,4]}}",
     "missing \"shape\"", "w"},
    {"unknown_field", "{\"w\":{" W_OK_FIELDS ",\"foo\":1}}",
     "unknown field \"foo\"", "w"},
    {"tensor_not_object", "{\"w\":5}", "its value is not an object", "w"},
    {"metadata_not_string", "{\"__metadata__\":{\"k\":1}}",
     "\"__metadata__\" value of \"k\" is not a string", NULL},
    {"metadata_null", "{\"__metadata__\":{\"k\":null}}",
     "\"__metadata__\" value of \"k\" is not a string", NULL},
    {"metadata_not_object", "{\"__metadata__\":\"x\"}",
     "\"__metadata__\" is not an object", NULL},
    {"metadata_twice", "{\"__metadata__\":{},\"__metadata__\":{}}",
     "\"__metadata__\" appears twice", NULL},
    {"metadata_dup_key", "{\"__metadata__\":{\"k\":\"a\",\"k\":\"b\"}}",
     "has the key \"k\" twice", NULL},
    {"empty_name", "{\"\":{" W_OK_FIELDS "}}", "a tensor name is empty",
     NULL},
};

TEST(st_malformed, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  char dir[64], path[160];
  test_make_dir(dir, sizeof dir, "st");
  unsigned char data[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  for (size_t i = 0; i < sizeof bad_cases / sizeof bad_cases[0]; i++) {
    snprintf(path, sizeof path, "%s/%s.safetensors", dir, bad_cases[i].label);
    write_st(path, bad_cases[i].json, data, sizeof data);
    expect_bad(dev, path, VP_EINVAL, bad_cases[i].needle, bad_cases[i].tensor);
  }

  /* A name over 1024 bytes. */
  char *json = malloc(2048);
  ASSERT_NOT_NULL(json);
  int at = snprintf(json, 2048, "{\"");
  for (int i = 0; i < 1025; i++) json[at++] = 'x';
  snprintf(json + at, 2048 - (size_t)at, "\":{" W_OK_FIELDS "}}");
  snprintf(path, sizeof path, "%s/long_name.safetensors", dir);
  write_st(path, json, data, sizeof data);
  expect_bad(dev, path, VP_EINVAL, "the name is 1025 bytes; at most 1024",
             NULL);
  free(json);

  /* The length field. */
  unsigned char raw[64];
  memset(raw, 0, sizeof raw);
  snprintf(path, sizeof path, "%s/empty.safetensors", dir);
  write_raw(path, raw, 0);
  expect_bad(dev, path, VP_EINVAL, "too short for the 8-byte header length",
             NULL);
  snprintf(path, sizeof path, "%s/five.safetensors", dir);
  write_raw(path, raw, 5);
  expect_bad(dev, path, VP_EINVAL, "is 5 bytes, too short", NULL);
  uint64_t lens[] = {200ull << 20, (100ull << 20) + 1, UINT64_MAX};
  for (size_t k = 0; k < 3; k++) {
    for (int i = 0; i < 8; i++) raw[i] = (unsigned char)(lens[k] >> (8 * i));
    snprintf(path, sizeof path, "%s/huge%zu.safetensors", dir, k);
    write_raw(path, raw, sizeof raw);
    expect_bad(dev, path, VP_EINVAL, "over the limit", NULL);
  }
  for (int i = 0; i < 8; i++) raw[i] = (unsigned char)((uint64_t)100 >> (8 * i));
  memcpy(raw + 8, "{}", 2);
  snprintf(path, sizeof path, "%s/past_end.safetensors", dir);
  write_raw(path, raw, 28);
  expect_bad(dev, path, VP_EINVAL,
             "header length 100 runs past the end of the file (28 bytes)",
             NULL);

  /* Not a file. */
  snprintf(path, sizeof path, "%s/missing.safetensors", dir);
  expect_bad(dev, path, VP_EINVAL, "cannot open", NULL);
  snprintf(path, sizeof path, "%s/subdir", dir);
  ASSERT_EQ_INT(mkdir(path, 0700), 0);
  expect_bad(dev, path, VP_EINVAL, "not a regular file", NULL);

  /* Arguments. */
  vp_st_t st;
  ASSERT_RC(vp_st_open(dev, NULL, &st), VP_EINVAL);
  ASSERT_RC(vp_st_open(dev, path, NULL), VP_EINVAL);
  ASSERT_RC(vp_st_open((vp_device_t){4242}, path, &st), VP_EHANDLE);
  ASSERT_OK(vp_device_close(dev));
  test_rm_dir(dir);
}

/* ------------------------------------------------------------- loads */

static vp_st_t open_valid(vp_device_t dev, const char *dir, const char *name,
                          unsigned char **data, char *path, size_t plen) {
  snprintf(path, plen, "%s/%s", dir, name);
  *data = make_valid(path);
  vp_st_t st;
  ASSERT_OK(vp_st_open(dev, path, &st));
  return st;
}

TEST(st_load_errors, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  char dir[64], path[128];
  test_make_dir(dir, sizeof dir, "st");
  unsigned char *data;
  vp_st_t st = open_valid(dev, dir, "m.safetensors", &data, path, sizeof path);
  vp_vbar_t v = test_vbar(dev, 2 * ps);
  size_t idx[2] = {0, 1};
  uint64_t off[2] = {0, 1000};
  ASSERT_RC(vp_st_load(st, 1, NULL, v, off, 0), VP_EINVAL);
  ASSERT_RC(vp_st_load(st, 1, idx, v, NULL, 0), VP_EINVAL);
  size_t badidx[2] = {0, NVALID};
  ASSERT_RC(vp_st_load(st, 2, badidx, v, off, 0), VP_EINVAL);
  ASSERT_STR_CONTAINS(vp_last_error(), "indices[1]");
  uint64_t far[2] = {0, 2 * ps - 10}; /* a.bias is 14 bytes */
  ASSERT_RC(vp_st_load(st, 2, idx, v, far, 0), VP_ERANGE);
  ASSERT_STR_CONTAINS(vp_last_error(), "tensor \"a.bias\"");
  ASSERT_STR_CONTAINS(vp_last_error(), path);
  uint64_t beyond[2] = {0, UINT64_MAX - 3};
  ASSERT_RC(vp_st_load(st, 2, idx, v, beyond, 0), VP_ERANGE);
  uint64_t clash[2] = {100, 150}; /* b.weight is 60 bytes */
  ASSERT_RC(vp_st_load(st, 2, idx, v, clash, 0), VP_EINVAL);
  ASSERT_STR_CONTAINS(vp_last_error(), "overlaps");
  ASSERT_STR_CONTAINS(vp_last_error(), "\"b.weight\"");
  ASSERT_STR_CONTAINS(vp_last_error(), "\"a.bias\"");
  size_t same[2] = {1, 1};
  uint64_t near[2] = {100, 105}; /* a.bias twice, 14 bytes each */
  ASSERT_RC(vp_st_load(st, 2, same, v, near, 0), VP_EINVAL);
  ASSERT_STR_CONTAINS(vp_last_error(), "overlaps");
  /* Nothing was touched by the refused loads. */
  ASSERT_EQ_STR(test_map(v), "..");
  ASSERT_RC(vp_st_load(st, 1, idx, (vp_vbar_t){999}, off, 0), VP_EHANDLE);
  /* The empty tensor may sit anywhere in the VBAR, even at its end. */
  size_t empty = 3;
  uint64_t end = 2 * ps;
  ASSERT_OK(vp_st_load(st, 1, &empty, v, &end, 0));
  ASSERT_EQ_STR(test_map(v), "..");
  ASSERT_OK(vp_device_close(dev));
  free(data);
  test_rm_dir(dir);
}

TEST(st_load_other_device, TEST_SIM_ONLY) {
  vp_device_t a = test_open(ctx, NULL), b = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  char dir[64], path[128];
  test_make_dir(dir, sizeof dir, "st");
  unsigned char *data;
  vp_st_t st = open_valid(a, dir, "m.safetensors", &data, path, sizeof path);
  vp_vbar_t vb = test_vbar(b, ps);
  size_t idx = 0;
  uint64_t off = 0;
  ASSERT_RC(vp_st_load(st, 1, &idx, vb, &off, 0), VP_EINVAL);
  ASSERT_STR_CONTAINS(vp_last_error(), "different devices");
  ASSERT_OK(vp_st_close(st));
  ASSERT_RC(vp_st_load(st, 1, &idx, vb, &off, 0), VP_EHANDLE);
  ASSERT_OK(vp_device_close(a));
  ASSERT_OK(vp_device_close(b));
  free(data);
  test_rm_dir(dir);
}

TEST(st_load_miss, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open_cap(ctx, NULL, 2);
  uint64_t ps = test_page_size(ctx);
  char dir[64], path[128];
  test_make_dir(dir, sizeof dir, "st");
  unsigned char *data;
  vp_st_t st = open_valid(dev, dir, "m.safetensors", &data, path, sizeof path);
  vp_vbar_t v = test_vbar(dev, 4 * ps);
  /* a.bias in page 0, "big" across pages 1 and 2: three pages at once on
   * a device of two. */
  size_t idx[2] = {1, NVALID - 1};
  uint64_t off[2] = {0, 2 * ps - 100};
  vp_stats_t before = test_dev_stats(dev);
  ASSERT_RC(vp_st_load(st, 2, idx, v, off, 0), VP_MISS);
  ASSERT_EQ_U64(test_dev_stats(dev).file_bytes_read, before.file_bytes_read);
  ASSERT_EQ_U64(test_vbar_stats(v).pinned_bytes, 0);
  /* Two pages fit. */
  off[1] = ps - 35000;
  ASSERT_OK(vp_st_load(st, 2, idx, v, off, 0));
  ASSERT_EQ_U64(test_vbar_stats(v).pinned_bytes, 0);
  ASSERT_OK(vp_device_close(dev));
  free(data);
  test_rm_dir(dir);
}

/* The file changes between open and load: the load fails naming it, and
 * nothing of it reaches the VBAR. */
static void check_untouched(vp_vbar_t v) {
  uint64_t pages = 0;
  ASSERT_OK(vp_vbar_page_count(v, &pages));
  for (uint64_t p = 0; p < pages; p++) ASSERT_EQ_INT(test_resid(v, p), 0);
}

TEST(st_changed_append, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  char dir[64], path[128];
  test_make_dir(dir, sizeof dir, "st");
  unsigned char *data;
  vp_st_t st = open_valid(dev, dir, "m.safetensors", &data, path, sizeof path);
  int fd = open(path, O_WRONLY | O_APPEND | O_CLOEXEC);
  ASSERT_GE_INT(fd, 0);
  ASSERT_EQ_INT(write(fd, "more", 4), 4);
  close(fd);
  vp_vbar_t v = test_vbar(dev, 4 * ps);
  size_t all[NVALID];
  uint64_t off[NVALID];
  for (size_t i = 0; i < NVALID; i++) all[i] = i;
  valid_offsets(ps, off);
  ASSERT_RC(vp_st_load(st, NVALID, all, v, off, 0), VP_EINVAL);
  ASSERT_STR_CONTAINS(vp_last_error(), "changed since it was opened");
  ASSERT_STR_CONTAINS(vp_last_error(), path);
  check_untouched(v);
  ASSERT_EQ_U64(test_vbar_stats(v).file_bytes_read, 0);
  /* Truncated: the same. */
  ASSERT_EQ_INT(truncate(path, 100), 0);
  ASSERT_RC(vp_st_load(st, 1, all, v, off, 0), VP_EINVAL);
  ASSERT_STR_CONTAINS(vp_last_error(), "changed since it was opened");
  check_untouched(v);
  /* A new open sees the new file (which is now malformed). */
  expect_bad(dev, path, VP_EINVAL, "runs past the end of the file", NULL);
  ASSERT_OK(vp_st_close(st));
  ASSERT_OK(vp_device_close(dev));
  free(data);
  test_rm_dir(dir);
}

TEST(st_changed_rewrite, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t ps = test_page_size(ctx);
  char dir[64], path[128];
  test_make_dir(dir, sizeof dir, "st");
  unsigned char *data;
  vp_st_t st = open_valid(dev, dir, "m.safetensors", &data, path, sizeof path);
  size_t all[NVALID];
  uint64_t off[NVALID];
  for (size_t i = 0; i < NVALID; i++) all[i] = i;
  valid_offsets(ps, off);
  vp_vbar_t v = test_vbar(dev, 4 * ps), w = test_vbar(dev, 4 * ps);
  ASSERT_OK(vp_st_load(st, NVALID, all, v, off, 0));
  uint32_t gens[4], after[4];
  ASSERT_OK(vp_fault(v, 0, 2 * ps, gens, 4));
  ASSERT_OK(vp_unpin(v, 0, 2 * ps, 0));
  /* Rewrite the data in place: same size, new bytes, new mtime. */
  struct stat before;
  ASSERT_EQ_INT(stat(path, &before), 0);
  int fd = open(path, O_WRONLY | O_CLOEXEC);
  ASSERT_GE_INT(fd, 0);
  unsigned char junk[4096];
  memset(junk, 0xab, sizeof junk);
  ASSERT_EQ_INT(pwrite(fd, junk, sizeof junk, (off_t)(8 + valid_header_len())),
                (long long)sizeof junk);
  struct stat now;
  ASSERT_EQ_INT(fstat(fd, &now), 0);
#ifdef _WIN32
  /* stat has whole seconds here: move the mtime on by hand, always. */
  struct _utimbuf ut = {now.st_atime, now.st_mtime + 1};
  ASSERT_EQ_INT(_futime(fd, &ut), 0);
#else
  if (now.st_mtim.tv_sec == before.st_mtim.tv_sec &&
      now.st_mtim.tv_nsec == before.st_mtim.tv_nsec) {
    /* A coarse file system clock: move the mtime on by hand. */
    struct timespec ts[2] = {now.st_atim, now.st_mtim};
    ts[1].tv_sec += 1;
    ASSERT_EQ_INT(futimens(fd, ts), 0);
  }
#endif
  close(fd);
  ASSERT_EQ_INT(stat(path, &now), 0);
  ASSERT_EQ_U64(now.st_size, before.st_size);
  ASSERT_RC(vp_st_load(st, NVALID, all, w, off, 0), VP_EINVAL);
  ASSERT_STR_CONTAINS(vp_last_error(), "changed since it was opened");
  ASSERT_STR_CONTAINS(vp_last_error(), path);
  check_untouched(w);
  /* The earlier load is intact: same generations, same bytes. */
  ASSERT_RC(vp_st_load(st, NVALID, all, v, off, 0), VP_EINVAL);
  ASSERT_OK(vp_fault(v, 0, 2 * ps, after, 4));
  ASSERT_MEM_EQ(after, gens, 2 * sizeof gens[0]);
  ASSERT_OK(vp_unpin(v, 0, 2 * ps, 0));
  check_loaded(dev, v, off, data, 0);
  ASSERT_OK(vp_st_close(st));
  ASSERT_OK(vp_device_close(dev));
  free(data);
  test_rm_dir(dir);
}

/* Every injected failure (the Nth backend call or allocation) during a
 * load: it either succeeds with the right bytes, or fails leaving nothing
 * pinned and no page holding part of a load: each target page is either
 * evicted or keeps its generation and its old bytes. */
TEST(st_load_all_or_nothing, TEST_SIM_ONLY) {
  uint64_t ps = test_page_size(ctx);
  char dir[64], path[128];
  test_make_dir(dir, sizeof dir, "st");
  snprintf(path, sizeof path, "%s/m.safetensors", dir);
  unsigned char *data = make_valid(path);
  unsigned char *page = malloc(ps + VALID_DATA), *fill = malloc(ps);
  ASSERT_NOT_NULL(page);
  ASSERT_NOT_NULL(fill);
  memset(fill, 0xee, ps);
  size_t all[NVALID];
  uint64_t off[NVALID];
  for (size_t i = 0; i < NVALID; i++) all[i] = i;
  valid_offsets(ps, off);
  int failed_loads = 0, evicting_failures = 0, broken_failures = 0,
      clean_runs = 0;
  for (int64_t nth = 1; nth < 1000 && clean_runs < 10; nth++) {
    test_note("sim_fail_nth %" PRId64, nth);
    vp_options_t o;
    test_options(ctx, &o);
    o.file_slots = 3;
    o.file_slot_size = 8192;
    o.sim_fail_nth = nth;
    vp_device_t dev;
    if (vp_device_open(&o, &dev) != VP_OK) continue;
    vp_vbar_t v;
    vp_st_t st;
    uint32_t gens[4];
    int rc = vp_vbar_create(dev, 4 * ps, &v);
    if (rc == VP_OK) rc = vp_st_open(dev, path, &st);
    if (rc == VP_OK) rc = vp_fault(v, 0, 4 * ps, gens, 4);
    if (rc == VP_OK) {
      for (uint64_t p = 0; p < 4; p++)
        ASSERT_OK(vp_copy_to_device(dev, test_vbar_base(v) + p * ps, fill,
                                    ps, 0));
      rc = vp_unpin(v, 0, 4 * ps, 0);
      if (rc) {
        vp_device_close(dev);
        continue;
      }
    }
    if (rc) {
      ASSERT_TRUE(rc < 0 || rc == VP_MISS);
      vp_device_close(dev);
      continue;
    }
    rc = vp_st_load(st, NVALID, all, v, off, 0);
    if (rc == VP_OK) {
      /* The injection may still be ahead: stop checking at the first
       * failing call, but any data read must be right. */
      bool clean = true;
      for (size_t i = 0; i < NVALID && clean; i++) {
        uint64_t size = valid_tensors[i].end - valid_tensors[i].begin;
        if (!size) continue;
        if (vp_fault(v, off[i], size, NULL, 0) != VP_OK) {
          clean = false;
          break;
        }
        clean = vp_copy_to_host(dev, page, test_vbar_base(v) + off[i], size,
                                0) == VP_OK;
        if (clean) ASSERT_MEM_EQ(page, data + valid_tensors[i].begin, size);
        if (vp_unpin(v, off[i], size, 0) != VP_OK) clean = false;
      }
      clean_runs += clean;
      vp_device_close(dev);
      continue;
    }
    /* The load failed: the injection fired inside it, so every call from
     * here on succeeds, unless it broke the device (an injected event
     * failure does): then only the pins can be checked. */
    clean_runs = 0;
    failed_loads++;
    ASSERT_TRUE(rc < 0);
    ASSERT_EQ_U64(test_vbar_stats(v).pinned_bytes, 0);
    bool evicted = false, broken = rc == VP_EDEVICE;
    for (uint64_t p = 0; p < 4 && !broken; p++) {
      if (!(test_resid(v, p) & VP_PAGE_RESIDENT)) {
        evicted = true;
        continue;
      }
      uint32_t g = 0;
      if ((rc = vp_fault(v, p * ps, ps, &g, 1)) == VP_EDEVICE) {
        broken = true;
        break;
      }
      ASSERT_OK(rc);
      if (g == gens[p]) {
        ASSERT_OK(vp_copy_to_host(dev, page, test_vbar_base(v) + p * ps, ps,
                                  0));
        test_note("sim_fail_nth %" PRId64 ": page %" PRIu64 " kept its "
                  "generation", nth, p);
        ASSERT_MEM_EQ(page, fill, ps);
      }
      ASSERT_OK(vp_unpin(v, p * ps, ps, 0));
    }
    evicting_failures += evicted && !broken;
    broken_failures += broken;
    ASSERT_OK(vp_st_close(st));
    ASSERT_OK(vp_device_close(dev));
  }
  test_log("%d failed loads: %d evicted pages, %d broke the device",
           failed_loads, evicting_failures, broken_failures);
  ASSERT_EQ_INT(clean_runs, 10);
  ASSERT_GT_INT(failed_loads, 3);
  ASSERT_GT_INT(evicting_failures, 0);
  free(page);
  free(fill);
  free(data);
  test_rm_dir(dir);
}

/* Many threads open, list, load and close the same file on one device. */
typedef struct st_worker {
  vp_device_t dev;
  vp_vbar_t v;
  const char *path;
  const unsigned char *data;
  uint64_t base_off, ps;
} st_worker_t;

static void *st_worker_main(void *arg) {
  st_worker_t *w = arg;
  vp_stream_t s;
  ASSERT_OK(vp_stream_create(w->dev, &s));
  unsigned char buf[64];
  for (uint64_t r = 0; r < test_scale(20); r++) {
    vp_st_t st;
    ASSERT_OK(vp_st_open(w->dev, w->path, &st));
    size_t idx;
    ASSERT_OK(vp_st_find(st, "b.weight", &idx));
    uint64_t off = w->base_off;
    ASSERT_OK(vp_st_load(st, 1, &idx, w->v, &off, s));
    ASSERT_OK(vp_fault(w->v, off, 60, NULL, 0));
    ASSERT_OK(vp_copy_to_host(w->dev, buf, test_vbar_base(w->v) + off, 60, s));
    ASSERT_OK(vp_stream_synchronize(w->dev, s));
    ASSERT_MEM_EQ(buf, w->data, 60);
    ASSERT_OK(vp_unpin(w->v, off, 60, s));
    ASSERT_OK(vp_st_close(st));
  }
  ASSERT_OK(vp_stream_destroy(w->dev, s));
  return NULL;
}

TEST(st_threads, TEST_ALL_BACKENDS) {
  vp_options_t o;
  test_options(ctx, &o);
  o.sim_streams = VP_SIM_WORKER;
  o.file_slots = 2;
  o.file_slot_size = 4096;
  vp_device_t dev = test_open(ctx, &o);
  uint64_t ps = test_page_size(ctx);
  char dir[64], path[128];
  test_make_dir(dir, sizeof dir, "st");
  snprintf(path, sizeof path, "%s/m.safetensors", dir);
  unsigned char *data = make_valid(path);
  enum { N = 4 };
  vp_vbar_t v = test_vbar(dev, N * ps);
  st_worker_t w[N];
  pthread_t t[N];
  for (int i = 0; i < N; i++) {
    w[i] = (st_worker_t){dev, v, path, data, (uint64_t)i * ps + 17, ps};
    ASSERT_EQ_INT(pthread_create(&t[i], NULL, st_worker_main, &w[i]), 0);
  }
  for (int i = 0; i < N; i++) pthread_join(t[i], NULL);
  ASSERT_OK(vp_device_close(dev));
  free(data);
  test_rm_dir(dir);
}
