/* Options: defaults and VPAGER_* environment variables, from one table. */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define MiB (1024ull * 1024)

static int parse_size(const char *text, uint64_t *out) {
  const char *s = text;
  while (*s == ' ') s++;
  if (*s < '0' || *s > '9')
    return vp__err(VP_EINVAL, "'%s' is not a size", text);
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno == ERANGE)
    return vp__err(VP_EINVAL, "'%s' is too large", text);
  /* K/M/G/T and KiB/MiB/...: powers of 1024; KB/MB/GB/TB: powers of 1000
   * (accelerate's max_memory spelling: "20GB" is 20e9, "20GiB" 20 << 30). */
  unsigned power = 0;
  switch (*end) {
  case 'k': case 'K': power = 1; break;
  case 'm': case 'M': power = 2; break;
  case 'g': case 'G': power = 3; break;
  case 't': case 'T': power = 4; break;
  default: break;
  }
  uint64_t unit = 1;
  if (power) {
    bool binary = true;
    end++;
    if (*end == 'i' || *end == 'I') { /* "Ki" needs its B */
      end++;
      if (*end == 'b' || *end == 'B') end++; else end = "?";
    } else if (*end == 'b' || *end == 'B') {
      end++;
      binary = false;
    }
    for (unsigned i = 0; i < power; i++) unit *= binary ? 1024 : 1000;
  }
  if (*end != '\0' || v > UINT64_MAX / unit)
    return vp__err(VP_EINVAL, "'%s' is not a size (digits with an optional "
                   "K/M/G/T, KiB/MiB/GiB/TiB or KB/MB/GB/TB suffix)", text);
  *out = (uint64_t)v * unit;
  return VP_OK;
}

int vp_parse_size(const char *text, uint64_t *out) {
  VP__ENTER();
  if (!text || !out) return vp__err(VP_EINVAL, "NULL argument");
  return parse_size(text, out);
}

/* Parsers from text to the field at `field`; 0 on success. */
typedef int (*parse_fn)(const char *text, void *field);

static int parse_u64(const char *t, void *f) {
  return parse_size(t, (uint64_t *)f);
}

/* A size above zero (sim_capacity: an empty device opens nothing). */
static int parse_nonzero(const char *t, void *f) {
  uint64_t v;
  if (parse_size(t, &v) || v == 0) return -1;
  *(uint64_t *)f = v;
  return 0;
}

static bool is_pow2(uint64_t v) { return v && !(v & (v - 1)); }

/* A power of two of at least 4 KiB (page_size, sim_granularity). */
static int parse_pow2(const char *t, void *f) {
  uint64_t v;
  if (parse_size(t, &v) || v < 4096 || !is_pow2(v)) return -1;
  *(uint64_t *)f = v;
  return 0;
}

static int parse_i64(const char *t, void *f) {
  uint64_t v;
  if (parse_size(t, &v) || v > INT64_MAX) return -1;
  *(int64_t *)f = (int64_t)v;
  return 0;
}

static int parse_u32(const char *t, void *f) {
  uint64_t v;
  if (parse_size(t, &v) || v > UINT32_MAX) return -1;
  *(uint32_t *)f = (uint32_t)v;
  return 0;
}

static int parse_int(const char *t, void *f) {
  char *end;
  long v = strtol(t, &end, 10);
  if (!*t || *end || v < 0 || v > 1024) return -1;
  *(int *)f = (int)v;
  return 0;
}

static int parse_word(const char *t, int *f, const char *const *words, int n) {
  for (int i = 0; i < n; i++)
    if (words[i] && vp__os_strcasecmp(t, words[i]) == 0) return *f = i, 0;
  return -1;
}

static int parse_backend(const char *t, void *f) {
  /* In vp_backend_kind_t's order: a word's index is its value. */
  static const char *const w[] = {"auto", "cuda", "sim", "hip"};
  return parse_word(t, f, w, 4);
}

static int parse_order(const char *t, void *f) {
  static const char *const w[] = {"tail", "interleaved"};
  return parse_word(t, f, w, 2);
}

static int parse_streams(const char *t, void *f) {
  static const char *const w[] = {"sync", "worker"};
  return parse_word(t, f, w, 2);
}

static int parse_flag(const char *t, void *f) {
  static const char *const w[] = {"0", "1"};
  return parse_word(t, f, w, 2);
}

static int parse_name(const char *t, void *f) {
  size_t n = strlen(t);
  if (n == 0 || n >= sizeof(((vp_options_t *)0)->sim_shared)) return -1;
  for (size_t i = 0; i < n; i++)
    if (!((t[i] >= 'a' && t[i] <= 'z') || (t[i] >= 'A' && t[i] <= 'Z') ||
          (t[i] >= '0' && t[i] <= '9') || t[i] == '-' || t[i] == '_'))
      return -1;
  memcpy(f, t, n + 1);
  return 0;
}

static const struct option_entry {
  const char *env;
  size_t offset;
  parse_fn parse;
  const char *accepts;
} option_table[] = {
    {"VPAGER_BACKEND", offsetof(vp_options_t, backend), parse_backend,
     "auto, cuda, hip or sim"},
    {"VPAGER_DEVICE", offsetof(vp_options_t, device_index), parse_int,
     "a device ordinal"},
    {"VPAGER_PAGE_SIZE", offsetof(vp_options_t, page_size), parse_pow2,
     "a power-of-two size such as 32M"},
    {"VPAGER_HEADROOM", offsetof(vp_options_t, headroom), parse_i64,
     "a size such as 512M"},
    {"VPAGER_POLL_US", offsetof(vp_options_t, poll_interval_us), parse_u32,
     "microseconds"},
    {"VPAGER_ORDER", offsetof(vp_options_t, evict_order), parse_order,
     "tail or interleaved"},
    {"VPAGER_SIM_CAPACITY", offsetof(vp_options_t, sim_capacity),
     parse_nonzero, "a size above zero such as 4G"},
    {"VPAGER_SIM_GRANULARITY", offsetof(vp_options_t, sim_granularity),
     parse_pow2, "a power-of-two size such as 2M"},
    {"VPAGER_SIM_STREAMS", offsetof(vp_options_t, sim_streams), parse_streams,
     "sync or worker"},
    {"VPAGER_SIM_SHARED", offsetof(vp_options_t, sim_shared), parse_name,
     "a name of letters, digits, - and _"},
    {"VPAGER_STAGING", offsetof(vp_options_t, staging_size), parse_u64,
     "a size such as 512M"},
    {"VPAGER_STAGING_WRAP", offsetof(vp_options_t, staging_wrap), parse_flag,
     "0 or 1"},
    {"VPAGER_LOOKAHEAD", offsetof(vp_options_t, lookahead), parse_u64,
     "a size such as 256M"},
    {"VPAGER_PIN_BUDGET", offsetof(vp_options_t, pin_budget), parse_u64,
     "a size such as 16G"},
    {"VPAGER_FILE_SLOTS", offsetof(vp_options_t, file_slots), parse_u32,
     "a count such as 3"},
    {"VPAGER_FILE_SLOT_SIZE", offsetof(vp_options_t, file_slot_size),
     parse_u64, "a size such as 64M"},
    {"VPAGER_LEDGER", offsetof(vp_options_t, ledger), parse_name,
     "off, or a name of letters, digits, - and _"},
    {"VPAGER_LEDGER_TIMEOUT_US", offsetof(vp_options_t, ledger_timeout_us),
     parse_u32, "microseconds"},
};

/* A bad value warns once per process (vp_options_init runs at every open,
 * and the Python layer asks for the defaults several times an offload):
 * warned[i] holds a hash of the text last warned about, plus one. */
#define N_OPTIONS (sizeof option_table / sizeof *option_table)
static _Atomic uint64_t warned[N_OPTIONS];

static bool first_warning(size_t i, const char *text) {
  uint64_t h = 1469598103934665603ull;
  for (const char *c = text; *c; c++)
    h = (h ^ (unsigned char)*c) * 1099511628211ull;
  h |= 1;
  return atomic_exchange(&warned[i], h) != h;
}

int vp_options_init(vp_options_t *opts) {
  VP__ENTER();
  if (!opts) return vp__err(VP_EINVAL, "opts is NULL");
  vp__options_defaults(opts);
  return VP_OK;
}

void vp__options_defaults(vp_options_t *opts) {
  *opts = (vp_options_t){
      .size = sizeof(vp_options_t),
      .backend = VP_BACKEND_AUTO,
      .page_size = 32 * MiB,
      .headroom = -1,
      .poll_interval_us = 5000,
      .evict_order = VP_ORDER_TAIL_FIRST,
      .sim_capacity = 4096 * MiB,
      .sim_granularity = 2 * MiB,
      .sim_streams = VP_SIM_SYNC,
      .staging_size = 512 * MiB,
      .staging_wrap = 1,
      .lookahead = 256 * MiB,
      .pin_budget = 0,
      .file_slots = 3,
      .file_slot_size = 64 * MiB,
  };
  for (size_t i = 0; i < sizeof option_table / sizeof *option_table; i++) {
    const struct option_entry *e = &option_table[i];
    const char *text = getenv(e->env);
    if (!text) continue;
    char scratch[sizeof(vp_options_t)];
    memcpy(scratch, opts, sizeof scratch);
    if (e->parse(text, scratch + e->offset) == 0) {
      memcpy(opts, scratch, sizeof scratch);
      vp__log(VP_LOG_DEBUG, NULL, "%s=%s", e->env, text);
    } else if (first_warning(i, text)) {
      vp__log(VP_LOG_WARN, NULL, "%s=%s is not %s; keeping the default",
              e->env, text, e->accepts);
    }
  }
  vp__clear_error();
}

/* Device memory a GPU's backend keeps free when the user gives no headroom:
 * room for the display and for other programs, which fail or stall when a
 * pager fills the card to the brim. The evidence:
 *   - a desktop compositor holds a few hundred MB (its framebuffers and
 *     window textures; more with several or 4K monitors, and browsers and
 *     video players take GPU memory too);
 *   - ComfyUI 0.33 reserves 400 MB on Linux and 600 MB on Windows (700 MB
 *     on cards of 16 GB and more) unless --reserve-vram says otherwise,
 *     and its loader keeps 0.8 GB more for inference on top;
 *   - its dynamic-VRAM peer keeps 512 MB free on Windows;
 *   - under Windows' WDDM (WSL2's GPU too: /dev/dxg) a full card does not
 *     fail an allocation: it spills to shared system memory, and every
 *     program on the card, the desktop included, slows to PCIe speed.
 * So 512 MiB at least (above ComfyUI's Linux reserve, the peer's Windows
 * figure), 768 MiB under WDDM (above ComfyUI's 700 MB there), or a share
 * of the card when that is larger: 2% (4% under WDDM) grows with the
 * framework's workspaces on big cards (2.8 GB of a 141 GB H200); at most
 * a quarter of the card, for small ones. */
uint64_t vp__default_headroom(uint64_t total, bool wddm) {
  uint64_t floor = wddm ? 768 * MiB : 512 * MiB;
  uint64_t share = wddm ? total / 25 : total / 50;
  uint64_t head = share > floor ? share : floor;
  return head < total / 4 ? head : total / 4;
}

/* Checks that need no backend (granularity is checked after open). */
int vp__options_check(const vp_options_t *o) {
  if (o->size != sizeof(vp_options_t))
    return vp__err(VP_EINVAL, "options.size is %u, expected %zu (call "
                   "vp_options_init)", o->size, sizeof(vp_options_t));
  if (o->backend < VP_BACKEND_AUTO || o->backend > VP_BACKEND_HIP)
    return vp__err(VP_EINVAL, "backend %d is unknown", o->backend);
  if (!is_pow2(o->page_size))
    return vp__err(VP_EINVAL, "page size %llu is not a power of two",
                   (unsigned long long)o->page_size);
  if (o->page_size > (1ull << 40))
    return vp__err(VP_EINVAL, "page size %llu is over 1 TiB",
                   (unsigned long long)o->page_size);
  if (o->evict_order != VP_ORDER_TAIL_FIRST &&
      o->evict_order != VP_ORDER_INTERLEAVED)
    return vp__err(VP_EINVAL, "eviction order %d is unknown", o->evict_order);
  if (o->sim_streams != VP_SIM_SYNC && o->sim_streams != VP_SIM_WORKER)
    return vp__err(VP_EINVAL, "sim_streams %d is unknown", o->sim_streams);
  if (o->backend == VP_BACKEND_SIM && o->sim_capacity == 0)
    return vp__err(VP_EINVAL, "option sim_capacity (VPAGER_SIM_CAPACITY): "
                   "0 bytes; the simulated device needs some memory");
  if (o->backend == VP_BACKEND_SIM &&
      (o->sim_granularity < 4096 || !is_pow2(o->sim_granularity)))
    return vp__err(VP_EINVAL, "option sim_granularity "
                   "(VPAGER_SIM_GRANULARITY): %llu is not a power of two of "
                   "at least 4 KiB", (unsigned long long)o->sim_granularity);
  if (o->device_index < 0)
    return vp__err(VP_EINVAL, "device index %d is negative", o->device_index);
  if (o->staging_wrap != 0 && o->staging_wrap != 1)
    return vp__err(VP_EINVAL, "option staging_wrap (VPAGER_STAGING_WRAP): %d "
                   "is not 0 or 1", o->staging_wrap);
  if (o->file_slots < 2 || o->file_slots > 64 || o->file_slot_size < 4096)
    return vp__err(VP_EINVAL, "the file reader needs 2-64 slots of at least 4 "
                   "KiB (have %u of %llu bytes)", o->file_slots,
                   (unsigned long long)o->file_slot_size);
  if (memchr(o->sim_shared, '\0', sizeof o->sim_shared) == NULL)
    return vp__err(VP_EINVAL, "sim_shared is not terminated");
  if (memchr(o->ledger, '\0', sizeof o->ledger) == NULL)
    return vp__err(VP_EINVAL, "ledger is not terminated");
  char name[sizeof o->ledger];
  if (o->ledger[0] && parse_name(o->ledger, name))
    return vp__err(VP_EINVAL, "ledger \"%s\" is not a name of letters, "
                   "digits, - and _", o->ledger);
  return VP_OK;
}
