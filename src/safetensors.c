/* safetensors files: an 8-byte little-endian header length N, N bytes of
 * JSON header, then the data. The header is validated strictly on open
 * (JSON syntax, known dtypes, shape x dtype size == data size, offsets in
 * the file, no overlaps, no duplicate names, no unknown fields); tensors
 * are then listed in the order of their data offsets. Loads go through the
 * file reader and are all or nothing: on a failure after the first byte
 * was written, the pages written so far are evicted, so no weight is left
 * half loaded (its pages' generations change).
 *
 * Parsing runs without the device lock; the handle table (dev->sts) and
 * everything after open are used with it held. */
#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "json.h"

#define ULL(x) ((unsigned long long)(x))
#define MAX_HEADER (100ull << 20)
#define MAX_NAME 1024
#define MAX_DIMS 8

typedef struct st_tensor {
  vp_st_tensor_t t;     /* t.name is ours (malloc'd); t.offset absolute */
  uint64_t begin, end;  /* data_offsets, relative to the data start */
} st_tensor_t;

typedef struct vp__st {
  uint64_t id;
  vp__device_t *dev;
  int fd;
  char *path;
  uint64_t file_size;   /* at open */
  uint64_t mtime_ns;
  uint64_t data_start;  /* 8 + N */
  size_t n;
  st_tensor_t *t;       /* by data offset */
  st_tensor_t **by_name;
  const void *map;      /* vp_st_mmap's mapping, or NULL */
} vp__st_t;

/* --------------------------------------------------------------- dtypes */

static const struct {
  const char *name;
  uint32_t bits;
} dtypes[] = {
    {"BOOL", 8},         {"F4", 4},           {"F6_E2M3", 6},
    {"F6_E3M2", 6},      {"U8", 8},           {"I8", 8},
    {"F8_E5M2", 8},      {"F8_E4M3", 8},      {"F8_E8M0", 8},
    {"F8_E4M3FNUZ", 8},  {"F8_E5M2FNUZ", 8},  {"I16", 16},
    {"U16", 16},         {"F16", 16},         {"BF16", 16},
    {"I32", 32},         {"U32", 32},         {"F32", 32},
    {"C64", 64},         {"F64", 64},         {"I64", 64},
    {"U64", 64},
};

static uint32_t dtype_bits(const char *name) {
  for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++)
    if (strcmp(dtypes[i].name, name) == 0) return dtypes[i].bits;
  return 0;
}

/* ------------------------------------------------------------- freeing */

static void st_free(vp__st_t *st) {
  if (!st) return;
  if (st->map) vp__os_file_unmap(st->map, st->file_size);
  if (st->fd >= 0) vp__os_file_close(st->fd);
  for (size_t i = 0; i < st->n; i++) free((char *)st->t[i].t.name);
  free(st->t);
  free(st->by_name);
  free(st->path);
  free(st);
}

/* -------------------------------------------------------------- parsing */

typedef struct parse {
  vp__json_t j;
  const char *path;
  const char *tensor;  /* the tensor being parsed, for messages */
  vp__st_t *st;
  size_t cap;
  uint64_t data_size; /* bytes after the header */
} parse_t;

/* "path: tensor "name": message" (after the entry's name) */
VP__PRINTF(3, 4) static int perr(parse_t *ps, int code, const char *fmt,
                                  ...) {
  char msg[320];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (ps->tensor)
    return vp__err(code, "%s: tensor \"%.200s\": %s", ps->path, ps->tensor,
                   msg);
  return vp__err(code, "%s: %s", ps->path, msg);
}

static int json_err(parse_t *ps) {
  if (ps->j.nomem) return perr(ps, VP_ENOMEM, "out of memory parsing the "
                               "header");
  return perr(ps, VP_EINVAL, "bad JSON in the header at byte %zu: %s",
              ps->j.err_pos, ps->j.err);
}

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* "__metadata__": an object of string -> string, keys unique. */
static int parse_metadata(parse_t *ps) {
  vp__json_t *j = &ps->j;
  if (vp__json_peek(j) != '{')
    return perr(ps, VP_EINVAL, "\"__metadata__\" is not an object");
  vp__json_expect(j, '{', "");
  char **keys = NULL;
  size_t nkeys = 0, cap = 0;
  int rc = VP_OK;
  bool first = true;
  for (;;) {
    char *key = NULL;
    int m = vp__json_member(j, &first, &key, NULL);
    if (m < 0) {
      rc = json_err(ps);
      break;
    }
    if (m == 0) break;
    if (nkeys == cap) {
      size_t nc = cap ? 2 * cap : 16;
      char **g = realloc(keys, nc * sizeof *g);
      if (!g) {
        free(key);
        rc = perr(ps, VP_ENOMEM, "out of memory parsing the header");
        break;
      }
      keys = g;
      cap = nc;
    }
    keys[nkeys++] = key;
    if (vp__json_peek(j) != '"') {
      rc = perr(ps, VP_EINVAL, "\"__metadata__\" value of \"%.100s\" is not "
                "a string", key);
      break;
    }
    char *val = NULL;
    if (vp__json_string(j, &val, NULL)) {
      rc = json_err(ps);
      break;
    }
    free(val);
  }
  if (rc == VP_OK && nkeys > 1) {
    qsort(keys, nkeys, sizeof *keys, cmp_str);
    for (size_t i = 1; i < nkeys && rc == VP_OK; i++)
      if (strcmp(keys[i - 1], keys[i]) == 0)
        rc = perr(ps, VP_EINVAL, "\"__metadata__\" has the key \"%.100s\" "
                  "twice", keys[i]);
  }
  for (size_t i = 0; i < nkeys; i++) free(keys[i]);
  free(keys);
  return rc;
}

/* A JSON array of at most `max` non-negative integers; *n gets the count. */
static int parse_uints(parse_t *ps, const char *field, uint64_t *v,
                       uint32_t max, uint32_t *n) {
  vp__json_t *j = &ps->j;
  if (vp__json_peek(j) != '[')
    return perr(ps, VP_EINVAL, "\"%s\" is not an array", field);
  vp__json_expect(j, '[', "");
  bool first = true;
  *n = 0;
  for (;;) {
    int e = vp__json_element(j, &first);
    if (e < 0) return json_err(ps);
    if (e == 0) return VP_OK;
    if (*n == max)
      return perr(ps, VP_EINVAL, "\"%s\" has more than %u entries", field,
                  max);
    if (vp__json_uint(j, &v[(*n)++])) {
      int rc = json_err(ps);
      return rc;
    }
  }
}

static void shape_text(const st_tensor_t *t, char *buf, size_t len) {
  size_t at = 0;
  at += (size_t)snprintf(buf, len, "[");
  for (uint32_t d = 0; d < t->t.ndim && at < len; d++)
    at += (size_t)snprintf(buf + at, len - at, "%s%llu", d ? ", " : "",
                           ULL(t->t.shape[d]));
  if (at < len) snprintf(buf + at, len - at, "]");
}

/* Check one parsed tensor: sizes agree and the data lies in the file. */
static int check_tensor(parse_t *ps, st_tensor_t *t, uint32_t bits) {
  if (t->begin > t->end)
    return perr(ps, VP_EINVAL, "data_offsets [%llu, %llu]: begin is after "
                "end", ULL(t->begin), ULL(t->end));
  uint64_t elems = 1;
  bool zero = false, overflow = false;
  for (uint32_t d = 0; d < t->t.ndim; d++) {
    uint64_t x = t->t.shape[d];
    if (x == 0) zero = true;
    else if (elems > UINT64_MAX / x) overflow = true;
    else elems *= x;
  }
  char shape[200];
  shape_text(t, shape, sizeof shape);
  if (zero) elems = 0;
  else if (overflow || elems > UINT64_MAX / bits)
    return perr(ps, VP_EINVAL, "shape %s of %s overflows 64 bits", shape,
                t->t.dtype);
  uint64_t nbits = elems * bits;
  if (nbits % 8)
    return perr(ps, VP_EINVAL, "shape %s of %s is %llu bits, not a whole "
                "number of bytes", shape, t->t.dtype, ULL(nbits));
  if (nbits / 8 != t->end - t->begin)
    return perr(ps, VP_EINVAL, "shape %s of %s is %llu bytes but "
                "data_offsets [%llu, %llu] hold %llu", shape, t->t.dtype,
                ULL(nbits / 8), ULL(t->begin), ULL(t->end),
                ULL(t->end - t->begin));
  if (t->end > ps->data_size)
    return perr(ps, VP_EINVAL, "data_offsets [%llu, %llu] run past the end "
                "of the file (%llu bytes of data after the header)",
                ULL(t->begin), ULL(t->end), ULL(ps->data_size));
  t->t.offset = ps->st->data_start + t->begin;
  t->t.size = t->end - t->begin;
  return VP_OK;
}

/* A tensor's object: exactly "dtype", "shape" and "data_offsets". */
static int parse_tensor(parse_t *ps, st_tensor_t *t) {
  vp__json_t *j = &ps->j;
  if (vp__json_peek(j) != '{')
    return perr(ps, VP_EINVAL, "its value is not an object");
  vp__json_expect(j, '{', "");
  bool first = true, have_dtype = false, have_shape = false, have_off = false;
  uint32_t bits = 0;
  for (;;) {
    char *key = NULL;
    int m = vp__json_member(j, &first, &key, NULL);
    if (m < 0) return json_err(ps);
    if (m == 0) break;
    int rc = VP_OK;
    if (strcmp(key, "dtype") == 0) {
      char *dt = NULL;
      if (have_dtype) rc = perr(ps, VP_EINVAL, "\"dtype\" appears twice");
      else if (vp__json_peek(j) != '"')
        rc = perr(ps, VP_EINVAL, "\"dtype\" is not a string");
      else if (vp__json_string(j, &dt, NULL)) rc = json_err(ps);
      else if (!(bits = dtype_bits(dt)))
        rc = perr(ps, VP_EINVAL, "unknown dtype \"%.40s\"", dt);
      else snprintf(t->t.dtype, sizeof t->t.dtype, "%s", dt);
      free(dt);
      have_dtype = true;
    } else if (strcmp(key, "shape") == 0) {
      if (have_shape) rc = perr(ps, VP_EINVAL, "\"shape\" appears twice");
      else rc = parse_uints(ps, "shape", t->t.shape, MAX_DIMS, &t->t.ndim);
      have_shape = true;
    } else if (strcmp(key, "data_offsets") == 0) {
      uint64_t v[2] = {0, 0};
      uint32_t n = 0;
      if (have_off) rc = perr(ps, VP_EINVAL, "\"data_offsets\" appears twice");
      else rc = parse_uints(ps, "data_offsets", v, 2, &n);
      if (rc == VP_OK && n != 2)
        rc = perr(ps, VP_EINVAL, "\"data_offsets\" has %u entries, not "
                  "[begin, end]", n);
      t->begin = v[0];
      t->end = v[1];
      have_off = true;
    } else {
      rc = perr(ps, VP_EINVAL, "unknown field \"%.100s\"", key);
    }
    free(key);
    if (rc) return rc;
  }
  if (!have_dtype || !have_shape || !have_off)
    return perr(ps, VP_EINVAL, "missing \"%s\"",
                !have_dtype ? "dtype" : !have_shape ? "shape" : "data_offsets");
  return check_tensor(ps, t, bits);
}

static int cmp_offset(const void *a, const void *b) {
  const st_tensor_t *x = a, *y = b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  if (x->end != y->end) return x->end < y->end ? -1 : 1;
  return strcmp(x->t.name, y->t.name);
}

static int cmp_name(const void *a, const void *b) {
  const st_tensor_t *x = *(st_tensor_t *const *)a,
                    *y = *(st_tensor_t *const *)b;
  return strcmp(x->t.name, y->t.name);
}

/* After parsing: order, the name index, duplicates and overlaps. */
static int index_tensors(parse_t *ps) {
  vp__st_t *st = ps->st;
  if (st->n == 0) return VP_OK;
  qsort(st->t, st->n, sizeof *st->t, cmp_offset);
  for (size_t i = 0; i < st->n; i++)
    st->t[i].t.offset = st->data_start + st->t[i].begin;
  st->by_name = malloc(st->n * sizeof *st->by_name);
  if (!st->by_name)
    return perr(ps, VP_ENOMEM, "no memory for an index of %zu tensors",
                st->n);
  for (size_t i = 0; i < st->n; i++) st->by_name[i] = &st->t[i];
  qsort(st->by_name, st->n, sizeof *st->by_name, cmp_name);
  for (size_t i = 1; i < st->n; i++)
    if (strcmp(st->by_name[i - 1]->t.name, st->by_name[i]->t.name) == 0) {
      ps->tensor = st->by_name[i]->t.name;
      return perr(ps, VP_EINVAL, "the name appears twice in the header");
    }
  /* Sorted by begin: a non-empty tensor overlaps an earlier one exactly
   * when it begins before the furthest end seen so far. */
  const st_tensor_t *far = NULL;
  for (size_t i = 0; i < st->n; i++) {
    const st_tensor_t *t = &st->t[i];
    if (t->begin == t->end) continue;
    if (far && t->begin < far->end) {
      ps->tensor = t->t.name;
      return perr(ps, VP_EINVAL, "data_offsets [%llu, %llu] overlap those "
                  "of tensor \"%.200s\" [%llu, %llu]", ULL(t->begin),
                  ULL(t->end), far->t.name, ULL(far->begin), ULL(far->end));
    }
    if (!far || t->end > far->end) far = t;
  }
  return VP_OK;
}

static int parse_header(parse_t *ps, const char *hdr, size_t len) {
  vp__json_t *j = &ps->j;
  vp__st_t *st = ps->st;
  vp__json_init(j, hdr, len);
  int c = vp__json_peek(j);
  if (c != '{')
    return perr(ps, VP_EINVAL, "the header is not a JSON object%s",
                c < 0 ? " (it is empty)" : "");
  vp__json_expect(j, '{', "");
  bool first = true, seen_meta = false;
  for (;;) {
    char *key = NULL;
    size_t klen = 0;
    int m = vp__json_member(j, &first, &key, &klen);
    if (m < 0) return json_err(ps);
    if (m == 0) break;
    int rc = VP_OK;
    if (strcmp(key, "__metadata__") == 0) {
      rc = seen_meta ? perr(ps, VP_EINVAL, "\"__metadata__\" appears twice")
                     : parse_metadata(ps);
      seen_meta = true;
      free(key);
      if (rc) return rc;
      continue;
    }
    ps->tensor = key;
    if (klen == 0) rc = perr(ps, VP_EINVAL, "a tensor name is empty");
    else if (klen > MAX_NAME)
      rc = perr(ps, VP_EINVAL, "the name is %zu bytes; at most %d", klen,
                MAX_NAME);
    if (rc == VP_OK && st->n == ps->cap) {
      size_t nc = ps->cap ? 2 * ps->cap : 16;
      st_tensor_t *g = realloc(st->t, nc * sizeof *g);
      if (!g) rc = perr(ps, VP_ENOMEM, "out of memory parsing the header");
      else st->t = g, ps->cap = nc;
    }
    if (rc) {
      ps->tensor = NULL;
      free(key);
      return rc;
    }
    st_tensor_t *t = &st->t[st->n++];
    memset(t, 0, sizeof *t);
    t->t.name = key; /* freed with st from now on */
    rc = parse_tensor(ps, t);
    ps->tensor = NULL;
    if (rc) return rc;
  }
  if (vp__json_end(j)) return json_err(ps);
  return index_tensors(ps);
}

/* -------------------------------------------------------------- opening */

/* Read exactly n bytes at off; a short read is an error naming path. */
static int read_exact(const char *path, int fd, void *buf,
                      uint64_t n, uint64_t off, const char *what) {
  uint64_t got;
  int e = vp__pread_exact(fd, buf, n, off, &got);
  if (e > 0)
    return vp__err(e == ENOMEM ? VP_ENOMEM : VP_EINVAL, "%s: reading %s "
                   "failed: %s", path, what, strerror(e));
  if (e < 0)
    return vp__err(VP_EINVAL, "%s: the file ended while reading %s (it changed "
                   "while being opened?)", path, what);
  return VP_OK;
}

static int st_read(vp__st_t *st) {
  const char *path = st->path;
  int e = vp__os_file_open_read(path, &st->fd);
  if (e) {
    return vp__err(e == ENOMEM ? VP_ENOMEM : VP_EINVAL, "%s: cannot open: %s",
                   path, strerror(e));
  }
  vp__os_file_info_t sb;
  if ((e = vp__os_file_stat(st->fd, &sb)))
    return vp__err(VP_EINVAL, "%s: fstat failed: %s", path, strerror(e));
  if (!sb.regular)
    return vp__err(VP_EINVAL, "%s: not a regular file", path);
  st->file_size = sb.size;
  st->mtime_ns = sb.mtime_ns;
  if (st->file_size < 8)
    return vp__err(VP_EINVAL, "%s: the file is %llu bytes, too short for the "
                   "8-byte header length", path, ULL(st->file_size));
  unsigned char lb[8];
  int rc = read_exact(path, st->fd, lb, 8, 0, "the header length");
  if (rc) return rc;
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | lb[i];
  if (hlen > MAX_HEADER)
    return vp__err(VP_EINVAL, "%s: the header length %llu is over the limit of "
                   "%llu bytes (100 MiB); not a safetensors file?", path,
                   ULL(hlen), ULL(MAX_HEADER));
  if (hlen > st->file_size - 8)
    return vp__err(VP_EINVAL, "%s: the header length %llu runs past the end of "
                   "the file (%llu bytes)", path, ULL(hlen),
                   ULL(st->file_size));
  st->data_start = 8 + hlen;
  char *hdr = malloc(hlen + 1);
  if (!hdr)
    return vp__err(VP_ENOMEM, "%s: no memory for a header of %llu bytes", path,
                   ULL(hlen));
  rc = read_exact(path, st->fd, hdr, hlen, 8, "the header");
  if (rc == VP_OK) {
    parse_t ps = {.path = path, .st = st,
                  .data_size = st->file_size - st->data_start};
    rc = parse_header(&ps, hdr, hlen);
  }
  free(hdr);
  return rc;
}

int vp_st_open(vp_device_t h, const char *path, vp_st_t *out) {
  VP__ENTER();
  if (!path) return vp__err(VP_EINVAL, "path is NULL");
  if (!out) return vp__err(VP_EINVAL, "out is NULL");
  vp__device_t *dev = NULL;
  int rc = vp__dev_enter(h, &dev);
  if (rc) return rc;
  vp__unlock(dev, VP_OK); /* the file is read and parsed unlocked */
  vp__st_t *st = calloc(1, sizeof *st);
  if (!st) return vp__err(VP_ENOMEM, "%s: no memory", path);
  st->fd = -1;
  st->path = strdup(path);
  if (!st->path) rc = vp__err(VP_ENOMEM, "%s: no memory", path);
  if (rc == VP_OK) rc = st_read(st);
  if (rc == VP_OK) rc = vp__dev_enter(h, &dev);
  if (rc) {
    st_free(st);
    return rc;
  }
  st->dev = dev;
  rc = vp__table_add(dev, &dev->sts, st, &st->id);
  vp__unlock(dev, rc);
  if (rc) {
    st_free(st);
    return rc;
  }
  vp__log(VP_LOG_DEBUG, dev->caps.name,
          "vp_st_open: %s: %zu tensors, data at %llu", path, st->n,
          ULL(st->data_start));
  out->id = st->id;
  return VP_OK;
}

/* ------------------------------------------------------------- handles */

/* Look up st and lock its device. */
static int st_enter(vp_st_t h, vp__st_t **out) {
  vp__device_t *dev;
  return vp__handle_lock(h.id, offsetof(vp__device_t, sts),
                         "safetensors", &dev, (void **)out);
}

#define ST_ENTER(h, st)                                                        \
  do {                                                                         \
    int rc_ = st_enter(h, &st);                                                \
    if (rc_) return rc_;                                                       \
  } while (0)

int vp_st_close(vp_st_t h) {
  VP__ENTER();
  vp__st_t *st = NULL;
  ST_ENTER(h, st);
  vp__device_t *dev = st->dev;
  vp__table_remove(&dev->sts, st->id);
  vp__unlock(dev, VP_OK);
  st_free(st);
  return VP_OK;
}

void vp__st_close_all(vp__device_t *dev) {
  for (uint32_t s = 0; s < dev->sts.n; s++) st_free(dev->sts.slots[s]);
  vp__table_free(&dev->sts);
}

int vp_st_count(vp_st_t h, size_t *n) {
  VP__ENTER();
  if (!n) return vp__err(VP_EINVAL, "n is NULL");
  vp__st_t *st = NULL;
  ST_ENTER(h, st);
  *n = st->n;
  return vp__unlock(st->dev, VP_OK);
}

int vp_st_tensor(vp_st_t h, size_t index, vp_st_tensor_t *t) {
  VP__ENTER();
  if (!t) return vp__err(VP_EINVAL, "t is NULL");
  vp__st_t *st = NULL;
  ST_ENTER(h, st);
  if (index >= st->n)
    return vp__unlock(st->dev, vp__err(VP_ERANGE, "%s: index %zu is past its "
                                       "%zu tensors", st->path, index, st->n));
  *t = st->t[index].t;
  return vp__unlock(st->dev, VP_OK);
}

int vp_st_find(vp_st_t h, const char *name, size_t *index) {
  VP__ENTER();
  if (!name || !index)
    return vp__err(VP_EINVAL, "%s is NULL", !name ? "name" : "index");
  vp__st_t *st = NULL;
  ST_ENTER(h, st);
  size_t lo = 0, hi = st->n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int c = strcmp(st->by_name[mid]->t.name, name);
    if (c == 0) {
      *index = (size_t)(st->by_name[mid] - st->t);
      return vp__unlock(st->dev, VP_OK);
    }
    if (c < 0) lo = mid + 1;
    else hi = mid;
  }
  return vp__unlock(st->dev, vp__err(VP_EINVAL, "%s: no tensor \"%.200s\"",
                                     st->path, name));
}

int vp_st_source(vp_st_t h, size_t index, vp_source_t *src) {
  VP__ENTER();
  if (!src) return vp__err(VP_EINVAL, "src is NULL");
  vp__st_t *st = NULL;
  ST_ENTER(h, st);
  if (index >= st->n)
    return vp__unlock(st->dev, vp__err(VP_ERANGE, "%s: index %zu is past its "
                                       "%zu tensors", st->path, index, st->n));
  *src = (vp_source_t){.kind = VP_SOURCE_FILE,
                       .fd = st->fd,
                       .file_offset = st->t[index].t.offset};
  return vp__unlock(st->dev, VP_OK);
}

int vp_st_mmap(vp_st_t h, const void **base, uint64_t *size) {
  VP__ENTER();
  if (!base || !size)
    return vp__err(VP_EINVAL, "%s is NULL", !base ? "base" : "size");
  vp__st_t *st = NULL;
  ST_ENTER(h, st);
  if (!st->map) {
    const void *p = NULL;
    int e = vp__os_file_map(st->fd, st->file_size, &p);
    if (e) {
      int code = e == ENOMEM ? VP_ENOMEM : VP_EINVAL;
      return vp__unlock(st->dev, vp__err(code, "%s: mmap of %llu bytes "
                                         "failed: %s", st->path,
                                         ULL(st->file_size), strerror(e)));
    }
    st->map = p;
  }
  *base = st->map;
  *size = st->file_size;
  return vp__unlock(st->dev, VP_OK);
}

int vp_st_drop_pages(vp_st_t h) {
  VP__ENTER();
  vp__st_t *st = NULL;
  ST_ENTER(h, st);
  int rc = VP_OK;
  int e = st->map ? vp__os_file_map_drop(st->map, st->file_size) : 0;
  if (e)
    rc = vp__err(VP_EINVAL, "%s: madvise failed: %s", st->path, strerror(e));
  e = vp__os_file_drop_cache(st->fd);
  if (rc == VP_OK && e != 0)
    rc = vp__err(VP_EINVAL, "%s: posix_fadvise failed: %s", st->path,
                 strerror(e));
  return vp__unlock(st->dev, rc);
}

/* ---------------------------------------------------------------- load */

typedef struct load_range {
  const st_tensor_t *t;
  uint64_t off;       /* in the VBAR */
  uint32_t p0, p1;    /* its pages */
  bool pinned;
} load_range_t;

/* VP_OK while the file has the size and mtime it had at open. */
static int check_unchanged(vp__st_t *st) {
  vp__os_file_info_t sb;
  int e = vp__os_file_stat(st->fd, &sb);
  if (e)
    return vp__err(VP_EINVAL, "%s: fstat failed: %s", st->path, strerror(e));
  if (sb.size != st->file_size || sb.mtime_ns != st->mtime_ns)
    return vp__err(VP_EINVAL, "%s: the file changed since it was opened (%llu "
                   "bytes then, %llu now%s); open it again", st->path,
                   ULL(st->file_size), ULL(sb.size),
                   sb.size == st->file_size ? ", modified" : "");
  return VP_OK;
}

static int cmp_range(const void *a, const void *b) {
  const load_range_t *x = *(load_range_t *const *)a,
                     *y = *(load_range_t *const *)b;
  return x->off < y->off ? -1 : x->off > y->off;
}

/* Arguments: indices in range, each range inside the VBAR, none
 * overlapping another. */
static int load_check(vp__st_t *st, vp__vbar_t *vb, size_t n,
                      const size_t *indices, const uint64_t *offsets,
                      load_range_t *r) {
  int shift = vb->dev->page_shift;
  for (size_t i = 0; i < n; i++) {
    if (indices[i] >= st->n)
      return vp__err(VP_EINVAL, "%s: indices[%zu] = %zu is past its %zu "
                     "tensors", st->path, i, indices[i], st->n);
    const st_tensor_t *t = &st->t[indices[i]];
    uint64_t off = offsets[i], size = t->t.size;
    if (off > vb->size || size > vb->size - off)
      return vp__err(VP_ERANGE, "%s: tensor \"%.200s\": [%llu, +%llu) is "
                     "outside the VBAR of %llu bytes", st->path, t->t.name,
                     ULL(off), ULL(size), ULL(vb->size));
    r[i] = (load_range_t){.t = t, .off = off};
    if (size) {
      r[i].p0 = (uint32_t)(off >> shift);
      r[i].p1 = (uint32_t)(((off + size - 1) >> shift) + 1);
    }
  }
  load_range_t **by_off = malloc(n * sizeof *by_off);
  if (!by_off) return vp__err(VP_ENOMEM, "no memory");
  for (size_t i = 0; i < n; i++) by_off[i] = &r[i];
  qsort(by_off, n, sizeof *by_off, cmp_range);
  const load_range_t *far = NULL;
  int rc = VP_OK;
  for (size_t i = 0; i < n && rc == VP_OK; i++) {
    const load_range_t *x = by_off[i];
    uint64_t xend = x->off + x->t->t.size;
    if (x->t->t.size == 0) continue;
    if (far && x->off < far->off + far->t->t.size)
      rc = vp__err(VP_EINVAL, "%s: tensor \"%.150s\" at VBAR offset %llu "
                   "overlaps tensor \"%.150s\" at %llu", st->path,
                   x->t->t.name, ULL(x->off), far->t->t.name, ULL(far->off));
    if (!far || xend > far->off + far->t->t.size) far = x;
  }
  free(by_off);
  return rc;
}

/* Evict the (unpinned) pages of [p0, p1): their data is not to be trusted
 * and their next commit gives them a new generation. */
static int evict_pages(vp__vbar_t *vb, uint32_t p0, uint32_t p1) {
  int ret = VP_OK;
  for (uint32_t p = p0; p < p1; p++) {
    vp__page_t *pg = &vb->pages[p];
    if (!pg->resident || pg->pins) continue;
    int rc = vp__page_evict(vb, p);
    if (rc && ret == VP_OK) ret = rc;
  }
  return ret;
}

/* Unpin every pinned range on `stream`; the first failure's code. */
static int unpin_all(vp__vbar_t *vb, load_range_t *r, size_t n,
                     vp_stream_t stream) {
  vp__device_t *dev = vb->dev;
  int ret = VP_OK;
  bool synced = false;
  for (size_t i = 0; i < n; i++) {
    if (!r[i].pinned) continue;
    int rc = vp__unpin(vb, r[i].p0, r[i].p1, stream);
    if (rc) {
      if (!synced) vp__be_stream_synchronize(dev, stream);
      synced = true;
      vp__unpin_nofence(vb, r[i].p0, r[i].p1); /* the stream drained */
      if (ret == VP_OK) ret = rc;
    }
    r[i].pinned = false;
  }
  return ret;
}

static int load_locked(vp__st_t *st, vp__vbar_t *vb, size_t n,
                       const size_t *indices, const uint64_t *offsets,
                       vp_stream_t stream) {
  vp__device_t *dev = vb->dev;
  load_range_t *r = calloc(n, sizeof *r);
  if (!r) return vp__err(VP_ENOMEM, "no memory for %zu ranges", n);
  int rc = load_check(st, vb, n, indices, offsets, r);
  if (rc == VP_OK) rc = check_unchanged(st);
  /* Pin every range first: all of them must be resident at once, and none
   * can be evicted by making room for the next. Nothing is written yet, so
   * a miss or an error only unpins. */
  for (size_t i = 0; i < n && rc == VP_OK; i++) {
    if (r[i].p0 == r[i].p1) continue;
    rc = vp__fault(vb, r[i].p0, r[i].p1, NULL);
    if (rc == VP_OK) r[i].pinned = true;
  }
  if (rc) {
    unpin_all(vb, r, n, stream);
    free(r);
    return rc;
  }
  size_t written = 0;
  char what[512];
  for (size_t i = 0; i < n && rc == VP_OK; i++) {
    const st_tensor_t *t = r[i].t;
    if (!t->t.size) continue;
    written = i + 1;
    snprintf(what, sizeof what, "%s: tensor \"%.200s\"", st->path,
             t->t.name);
    rc = vp__file_read(dev, st->fd, t->t.offset, t->t.size,
                       vb->va + r[i].off, stream, what);
  }
  /* A change during the reads would leave a mix of old and new bytes. */
  if (rc == VP_OK && (rc = check_unchanged(st))) written = n;
  int urc = unpin_all(vb, r, n, stream);
  if (rc == VP_OK && urc) rc = urc, written = n;
  if (rc) {
    /* Waits for the copies queued so far (the unpin fences). */
    for (size_t i = 0; i < written; i++)
      if (r[i].p0 != r[i].p1) evict_pages(vb, r[i].p0, r[i].p1);
  }
  free(r);
  return rc;
}

/* st is not on vb's device: VP_EINVAL if it is open elsewhere, else
 * VP_EHANDLE. No lock is held. */
static int st_elsewhere(vp_st_t h, vp__device_t *dev) {
  vp__device_t *other = vp__registry_get(h.id);
  bool live = false;
  if (other && other != dev) {
    vp__os_mutex_lock(&other->lock);
    live = vp__table_get(&other->sts, h.id) != NULL;
    vp__os_mutex_unlock(&other->lock);
  }
  if (live)
    return vp__err(VP_EINVAL, "the safetensors file and the VBAR belong to "
                   "different devices");
  return vp__err(VP_EHANDLE, "safetensors handle 0x%llx is not open",
                 ULL(h.id));
}

int vp_st_load(vp_st_t h, size_t n, const size_t *indices, vp_vbar_t vbar,
               const uint64_t *offsets, vp_stream_t stream) {
  VP__ENTER();
  if (n && (!indices || !offsets))
    return vp__err(VP_EINVAL, "%s is NULL", !indices ? "indices" : "offsets");
  vp__vbar_t *vb = NULL;
  int rc = vp__vbar_enter(vbar, &vb);
  if (rc) return rc;
  vp__device_t *dev = vb->dev;
  vp__st_t *st = vp__table_get(&dev->sts, h.id);
  if (!st) {
    vp__unlock(dev, VP_OK);
    return st_elsewhere(h, dev);
  }
  if (n == 0) return vp__unlock(dev, VP_OK);
  rc = load_locked(st, vb, n, indices, offsets, stream);
  vp__ledger_used(dev, vb);
  return vp__unlock(dev, rc);
}
