/* fuzz_options: VPAGER_* environment variables, vp_options_init, the
 * option checks of vp_device_open, and vp_parse_size, each against a
 * reference written from include/vpager.h and README.md (not from
 * src/options.c).
 *
 * Input: "NAME=value" lines (names outside the option table are ignored),
 * a NUL, size strings one per line, optionally a second NUL and raw bytes
 * that overwrite option fields after vp_options_init (so vp_device_open
 * also sees values no variable can give). Checks:
 *   - vp_parse_size agrees with the reference on every string, leaves
 *     *out alone on failure, and fails with a message;
 *   - vp_options_init gives the defaults with each variable the reference
 *     accepts applied, and ignores the others;
 *   - vp_device_open (simulated device) succeeds exactly when the
 *     reference says the options are valid, else VP_EINVAL with a message;
 *     an open device reports its page size, granularity, memory and
 *     headroom, and can commit a page when one fits. */
#include <ctype.h>
#include <strings.h>
#include <unistd.h>

#include "fuzz_common.h"

#define MiB (1024ull * 1024)

#define CHECK(cond, ...)                                                       \
  do {                                                                         \
    if (!(cond)) fz_fail(__VA_ARGS__);                                         \
  } while (0)

/* ------------------------------------------------------------ reference */

/* Digits, then nothing, K/M/G/T (1024^n), KiB.. (1024^n) or KB.. (1000^n),
 * in any case. Leading spaces are accepted (as the library does). */
static bool ref_size(const char *t, uint64_t *out) {
  const char *p = t;
  while (*p == ' ') p++;
  if (!isdigit((unsigned char)*p)) return false;
  uint64_t v = 0;
  for (; isdigit((unsigned char)*p); p++) {
    unsigned d = (unsigned)(*p - '0');
    if (v > (UINT64_MAX - d) / 10) return false;
    v = v * 10 + d;
  }
  int power = 0;
  switch (tolower((unsigned char)*p)) {
  case 'k': power = 1; break;
  case 'm': power = 2; break;
  case 'g': power = 3; break;
  case 't': power = 4; break;
  }
  uint64_t base = 1024;
  if (power) {
    p++;
    if (tolower((unsigned char)*p) == 'i') {
      p++;
      if (tolower((unsigned char)*p) != 'b') return false;
      p++;
    } else if (tolower((unsigned char)*p) == 'b') {
      p++;
      base = 1000;
    }
  }
  if (*p) return false;
  uint64_t unit = 1;
  for (int i = 0; i < power; i++) unit *= base;
  if (v > UINT64_MAX / unit) return false;
  *out = v * unit;
  return true;
}

static bool ref_word(const char *t, const char *const *w, int n, int *out) {
  for (int i = 0; i < n; i++)
    if (strcasecmp(t, w[i]) == 0) return *out = i, true;
  return false;
}

/* T_POW2: a size, a power of two of at least 4 KiB (page size,
 * granularity); T_NONZERO: a size above zero (sim_capacity). */
enum { T_SIZE, T_POW2, T_NONZERO, T_I64, T_U32, T_INT, T_BACKEND, T_ORDER,
       T_STREAMS, T_FLAG, T_NAME };

static const struct var {
  const char *name;
  int type;
  size_t off;
} vars[] = {
    {"VPAGER_BACKEND", T_BACKEND, offsetof(vp_options_t, backend)},
    {"VPAGER_DEVICE", T_INT, offsetof(vp_options_t, device_index)},
    {"VPAGER_PAGE_SIZE", T_POW2, offsetof(vp_options_t, page_size)},
    {"VPAGER_HEADROOM", T_I64, offsetof(vp_options_t, headroom)},
    {"VPAGER_POLL_US", T_U32, offsetof(vp_options_t, poll_interval_us)},
    {"VPAGER_ORDER", T_ORDER, offsetof(vp_options_t, evict_order)},
    {"VPAGER_SIM_CAPACITY", T_NONZERO, offsetof(vp_options_t, sim_capacity)},
    {"VPAGER_SIM_GRANULARITY", T_POW2,
     offsetof(vp_options_t, sim_granularity)},
    {"VPAGER_SIM_STREAMS", T_STREAMS, offsetof(vp_options_t, sim_streams)},
    {"VPAGER_SIM_SHARED", T_NAME, offsetof(vp_options_t, sim_shared)},
    {"VPAGER_STAGING", T_SIZE, offsetof(vp_options_t, staging_size)},
    {"VPAGER_STAGING_WRAP", T_FLAG, offsetof(vp_options_t, staging_wrap)},
    {"VPAGER_LOOKAHEAD", T_SIZE, offsetof(vp_options_t, lookahead)},
    {"VPAGER_PIN_BUDGET", T_SIZE, offsetof(vp_options_t, pin_budget)},
    {"VPAGER_FILE_SLOTS", T_U32, offsetof(vp_options_t, file_slots)},
    {"VPAGER_FILE_SLOT_SIZE", T_SIZE, offsetof(vp_options_t, file_slot_size)},
};
#define NVARS (sizeof vars / sizeof *vars)

/* Apply text to the field; false when the value is not acceptable. */
static bool ref_apply(const struct var *v, const char *t, vp_options_t *o) {
  char *f = (char *)o + v->off;
  uint64_t x;
  static const char *const backends[] = {"auto", "cuda", "sim", "hip"};
  static const char *const orders[] = {"tail", "interleaved"};
  static const char *const streams[] = {"sync", "worker"};
  static const char *const flag[] = {"0", "1"};
  switch (v->type) {
  case T_SIZE:
    if (!ref_size(t, &x)) return false;
    return memcpy(f, &x, 8), true;
  case T_POW2:
    if (!ref_size(t, &x) || x < 4096 || (x & (x - 1))) return false;
    return memcpy(f, &x, 8), true;
  case T_NONZERO:
    if (!ref_size(t, &x) || x == 0) return false;
    return memcpy(f, &x, 8), true;
  case T_I64:
    if (!ref_size(t, &x) || x > INT64_MAX) return false;
    return memcpy(f, &x, 8), true;
  case T_U32: {
    if (!ref_size(t, &x) || x > UINT32_MAX) return false;
    uint32_t y = (uint32_t)x;
    return memcpy(f, &y, 4), true;
  }
  case T_INT: { /* an ordinal 0..1024, as strtol reads it */
    char *end;
    long l = strtol(t, &end, 10);
    if (!*t || *end || l < 0 || l > 1024) return false;
    int y = (int)l;
    return memcpy(f, &y, sizeof y), true;
  }
  case T_BACKEND: return ref_word(t, backends, 4, (int *)f);
  case T_ORDER: return ref_word(t, orders, 2, (int *)f);
  case T_STREAMS: return ref_word(t, streams, 2, (int *)f);
  case T_FLAG: return ref_word(t, flag, 2, (int *)f);
  default: {
    size_t n = strlen(t);
    if (n == 0 || n >= sizeof o->sim_shared) return false;
    for (size_t i = 0; i < n; i++)
      if (!isalnum((unsigned char)t[i]) && t[i] != '-' && t[i] != '_')
        return false;
    memcpy(f, t, n + 1);
    return true;
  }
  }
}

static void ref_defaults(vp_options_t *o) {
  memset(o, 0, sizeof *o);
  o->size = sizeof *o;
  o->backend = VP_BACKEND_AUTO;
  o->page_size = 32 * MiB;
  o->headroom = -1;
  o->poll_interval_us = 5000;
  o->evict_order = VP_ORDER_TAIL_FIRST;
  o->sim_capacity = 4096 * MiB;
  o->sim_granularity = 2 * MiB;
  o->sim_streams = VP_SIM_SYNC;
  o->staging_size = 512 * MiB;
  o->staging_wrap = 1;
  o->lookahead = 256 * MiB;
  o->file_slots = 3;
  o->file_slot_size = 64 * MiB;
}

static bool pow2(uint64_t v) { return v && !(v & (v - 1)); }

/* The options vp_device_open must accept on any backend (generic) and
 * then on the simulated device. */
static bool ref_valid(const vp_options_t *o, bool generic, const char **why) {
  uint64_t hp = (uint64_t)sysconf(_SC_PAGESIZE);
#define BAD(cond, text) if (cond) return *why = text, false
  BAD(o->size != sizeof *o, "size");
  BAD(o->backend < 0 || o->backend > 3, "backend");
  BAD(!pow2(o->page_size) || o->page_size > (1ull << 40), "page size");
  BAD(o->evict_order != 0 && o->evict_order != 1, "order");
  BAD(o->sim_streams != 0 && o->sim_streams != 1, "streams");
  BAD(o->device_index < 0, "device index");
  BAD(o->staging_wrap != 0 && o->staging_wrap != 1, "staging wrap");
  BAD(o->file_slots < 2 || o->file_slots > 64 || o->file_slot_size < 4096,
      "file slots");
  BAD(!memchr(o->sim_shared, 0, sizeof o->sim_shared), "shared name");
  if (generic) return *why = "valid", true;
  BAD(strchr(o->sim_shared, '/'), "shared name /");
  BAD(o->sim_granularity < 4096 || o->sim_granularity < hp ||
      !pow2(o->sim_granularity), "granularity");
  BAD(o->sim_capacity == 0, "capacity");
  BAD(o->page_size % o->sim_granularity, "page vs granularity");
  BAD(o->page_size > o->sim_capacity, "page over capacity");
  BAD(o->headroom < -1, "headroom");
  BAD(o->headroom >= 0 &&
      (uint64_t)o->headroom + o->page_size > o->sim_capacity,
      "headroom over capacity");
#undef BAD
  return *why = "valid", true;
}

/* ------------------------------------------------------------- harness */

static void check_sizes(const char *s, const char *end) {
  char buf[256];
  while (s < end) {
    const char *nl = memchr(s, '\n', (size_t)(end - s));
    size_t n = (size_t)((nl ? nl : end) - s);
    if (n >= sizeof buf) n = sizeof buf - 1;
    memcpy(buf, s, n);
    buf[n] = '\0';
    s = nl ? nl + 1 : end;
    uint64_t want = 0, got = 0x5a5a5a5a5a5a5a5aull;
    bool ok = ref_size(buf, &want);
    int rc = FZ_CALL(false, vp_parse_size(buf, &got), "\"%.60s\"", buf);
    if (ok)
      CHECK(rc == VP_OK && got == want, "vp_parse_size(\"%s\") = %s, %llu; "
            "the reference reads %llu", buf, fz_name(rc),
            (unsigned long long)got, (unsigned long long)want);
    else
      CHECK(rc == VP_EINVAL && got == 0x5a5a5a5a5a5a5a5aull,
            "vp_parse_size(\"%s\") = %s, %llu; the reference refuses it", buf,
            fz_name(rc), (unsigned long long)got);
  }
}

static void check_open(const vp_options_t *o) {
  const char *why;
  bool gpu_only = o->backend == VP_BACKEND_CUDA || o->backend == VP_BACKEND_HIP;
  bool valid = ref_valid(o, gpu_only, &why);
  vp_options_t use = *o;
  /* A shared name is this process's own, not another run's segment. */
  if (use.sim_shared[0] && memchr(o->sim_shared, 0, sizeof o->sim_shared))
    snprintf(use.sim_shared, sizeof use.sim_shared, "vpfuzz-%d", getpid());
  bool gpu = valid && gpu_only;
  if (valid && o->backend == VP_BACKEND_AUTO) use.backend = VP_BACKEND_SIM;
  vp_device_t dev;
  int rc = FZ_CALL(false, vp_device_open(&use, &dev), "page %llu gran %llu "
                   "cap %llu (%s)", (unsigned long long)o->page_size,
                   (unsigned long long)o->sim_granularity,
                   (unsigned long long)o->sim_capacity, why);
  if (gpu) {
    CHECK(rc == VP_OK || rc == VP_ENODEV, "GPU open: %s", fz_name(rc));
    if (rc == VP_OK) vp_device_close(dev);
    return;
  }
  if (!valid) {
    CHECK(rc == VP_EINVAL, "vp_device_open accepted options the reference "
          "refuses (%s): %s", why, fz_name(rc));
    return;
  }
  CHECK(rc == VP_OK, "vp_device_open refused valid options: %s",
        fz_name(rc));
  vp_device_info_t info;
  rc = FZ_CALL(false, vp_device_info(dev, &info), "dev");
  CHECK(rc == VP_OK && info.page_size == o->page_size &&
        info.granularity == o->sim_granularity &&
        info.total_memory == o->sim_capacity &&
        info.headroom == (o->headroom < 0 ? 0 : o->headroom),
        "vp_device_info: %s page %llu gran %llu total %llu headroom %lld",
        fz_name(rc), (unsigned long long)info.page_size,
        (unsigned long long)info.granularity,
        (unsigned long long)info.total_memory, (long long)info.headroom);
  /* One page, when it is small enough to commit here. */
  if (o->page_size <= 4 * MiB) {
    vp_vbar_t v;
    rc = FZ_CALL(false, vp_vbar_create(dev, o->page_size * 2, &v), "2 pages");
    CHECK(rc == VP_OK, "vp_vbar_create: %s", fz_name(rc));
    bool fits = o->sim_capacity >= o->page_size &&
                (o->headroom < 0 ||
                 (uint64_t)o->headroom <= o->sim_capacity - o->page_size);
    rc = FZ_CALL(true, vp_fault(v, 0, 1, NULL, 0), "1 byte");
    CHECK(rc == (fits ? VP_OK : VP_MISS), "vp_fault: %s, fits %d",
          fz_name(rc), fits);
    if (rc == VP_OK) {
      uint64_t base;
      uint8_t byte = 0x5a;
      vp_vbar_base(v, &base);
      rc = FZ_CALL(false, vp_copy_to_device(dev, base, &byte, 1, 0), "1");
      CHECK(rc == VP_OK, "vp_copy_to_device: %s", fz_name(rc));
      vp_stream_synchronize(dev, 0);
      rc = FZ_CALL(false, vp_unpin(v, 0, 1, 0), "");
      CHECK(rc == VP_OK, "vp_unpin: %s", fz_name(rc));
    }
  }
  rc = FZ_CALL(false, vp_device_close(dev), "dev");
  CHECK(rc == VP_OK, "vp_device_close: %s", fz_name(rc));
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  vp_set_log_level(VP_LOG_NONE);
  fz_trace_live = getenv("FUZZ_TRACE") != NULL;
  fz_dump_on_death();
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fz_trace_reset();
  const char *s = (const char *)data, *end = s + size;
  const char *nul = memchr(s, '\0', size);
  const char *env_end = nul ? nul : end;
  for (size_t i = 0; i < NVARS; i++) unsetenv(vars[i].name);
  vp_options_t want;
  ref_defaults(&want);
  /* The variables, applied in table order (a later line of the same name
   * replaces an earlier one, as setenv does). */
  char line[300];
  for (const char *p = s; p < env_end;) {
    const char *nl = memchr(p, '\n', (size_t)(env_end - p));
    size_t n = (size_t)((nl ? nl : env_end) - p);
    if (n >= sizeof line) n = sizeof line - 1;
    memcpy(line, p, n);
    line[n] = '\0';
    p = nl ? nl + 1 : env_end;
    char *eq = strchr(line, '=');
    if (!eq) continue;
    *eq = '\0';
    for (size_t i = 0; i < NVARS; i++)
      if (strcmp(line, vars[i].name) == 0) {
        setenv(line, eq + 1, 1);
        fz_trace("setenv %s=\"%.80s\"", line, eq + 1);
      }
  }
  for (size_t i = 0; i < NVARS; i++) {
    const char *v = getenv(vars[i].name);
    if (v) ref_apply(&vars[i], v, &want);
  }
  vp_options_t o;
  memset(&o, 0xa5, sizeof o);
  int rc = FZ_CALL(false, vp_options_init(&o), "env");
  CHECK(rc == VP_OK, "vp_options_init: %s", fz_name(rc));
  for (size_t i = 0; i < NVARS; i++) {
    const struct var *v = &vars[i];
    size_t w = v->type == T_NAME ? sizeof o.sim_shared
               : v->type == T_SIZE || v->type == T_I64 ? 8 : 4;
    const char *got = (const char *)&o + v->off;
    const char *exp = (const char *)&want + v->off;
    bool same = v->type == T_NAME ? strcmp(got, exp) == 0
                                  : memcmp(got, exp, w) == 0;
    CHECK(same, "vp_options_init: %s=\"%s\" gave a field other than the "
          "reference's", v->name, getenv(v->name) ? getenv(v->name) : "");
  }
  CHECK(o.size == sizeof o && o.sim_fail_nth == 0, "vp_options_init: size "
        "%u, sim_fail_nth %lld", o.size, (long long)o.sim_fail_nth);
  CHECK(strlen(vp_last_error()) == 0 || !vp__clear_error,
        "vp_options_init left an error message: %s", vp_last_error());
  if (nul) {
    const char *raw = memchr(nul + 1, '\0', (size_t)(end - nul - 1));
    check_sizes(nul + 1, raw ? raw : end);
    if (raw) {
      /* Raw field values: 8 bytes each, in this order. */
      fz_reader_t r = {(const uint8_t *)raw + 1, (size_t)(end - raw - 1), 0};
      uint8_t which = fz_u8(&r);
      if (which & 1) o.page_size = 1ull << (fz_u8(&r) % 64);
      if (which & 2) o.sim_granularity = 1ull << (fz_u8(&r) % 64);
      if (which & 4) o.sim_capacity = fz_u64(&r);
      if (which & 8) o.headroom = (int64_t)fz_u64(&r);
      if (which & 16) o.file_slots = fz_u32(&r), o.file_slot_size = fz_u64(&r);
      if (which & 32) o.backend = (int)(int8_t)fz_u8(&r),
                      o.evict_order = (int)(int8_t)fz_u8(&r),
                      o.sim_streams = (int)(int8_t)fz_u8(&r);
      if (which & 64) o.device_index = (int)fz_u32(&r);
      if (which & 128) o.size = fz_u32(&r);
      uint8_t more = fz_u8(&r);
      if (more & 1) memset(o.sim_shared, 'x', sizeof o.sim_shared);
      if (more & 2) o.page_size = fz_u64(&r);
      if (more & 4) o.sim_granularity = fz_u64(&r);
      if (more & 8) o.staging_wrap = (int)(int8_t)fz_u8(&r);
    }
  }
  check_open(&o);
  /* Log levels: 0-5 are taken, others refused. */
  if (size) {
    int level = (int)(int8_t)data[size - 1] % 8;
    rc = FZ_CALL(false, vp_set_log_level(level), "%d", level);
    CHECK((level >= 0 && level <= 5) ? rc == VP_OK && vp_get_log_level() ==
                                                          level
                                     : rc == VP_EINVAL,
          "vp_set_log_level(%d): %s", level, fz_name(rc));
    vp_set_log_level(VP_LOG_NONE);
  }
  return 0;
}
