/* The ledger as JSON: a device's own (vp_ledger_snapshot, which publishes
 * the device first), any ledger by name, read only (vp_ledger_read, for
 * `vpager top`), and the list of this machine's ledgers. What comes from
 * the segment is bounded and escaped: a hostile segment gives odd numbers,
 * never a crash or broken JSON. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ledger.h"

#define ULL(x) ((unsigned long long)(x))
#define LD(field) ULL(atomic_load_explicit(&(field), memory_order_relaxed))


/* s is printable ASCII (vp__ltext_get): only quotes and backslashes need
 * escapes. */
static void put_str(vp__out_t *o, const char *s) {
  vp__put(o, "\"");
  for (; *s; s++) vp__put(o, "%s%c", *s == '"' || *s == '\\' ? "\\" : "", *s);
  vp__put(o, "\"");
}

static uint64_t ms_ago(uint64_t now, uint64_t t) {
  return t && t <= now ? (now - t) / 1000000u : 0;
}

static void view_vbars(vp__out_t *o, const ledger_part_t *p, uint64_t now) {
  const char *sep = "";
  vp__put(o, "\"vbars\":[");
  for (int v = 0; v < LEDGER_VBARS; v++) {
    ledger_vbar_view_t e;
    if (!vp__lvbar_read(&p->vbar[v], &e)) continue;
    vp__put(o, "%s{\"id\":%llu,\"label\":", sep, ULL(e.id));
    put_str(o, e.label);
    vp__put(o, ",\"size\":%llu,\"resident\":%llu,\"pinned\":%llu,"
        "\"reclaimable\":%llu,\"priority\":%u,\"last_use_ms_ago\":%llu,"
        "\"hits\":%llu,\"misses\":%llu}", ULL(e.size), ULL(e.resident),
        ULL(e.pinned), ULL(e.reclaimable), e.rank, ULL(ms_ago(now, e.last_use)),
        ULL(e.hits), ULL(e.misses));
    sep = ",";
  }
  vp__put(o, "]");
}

static void view_part(vp__out_t *o, const ledger_part_t *p, int i, bool self,
                      uint64_t now) {
  char cmd[64];
  vp__ltext_get(p->command, LEDGER_WORDS(64), cmd);
  vp__put(o, "{\"slot\":%d,\"pid\":%d,\"serial\":%llu,\"command\":", i,
      (int)atomic_load(&p->pid), LD(p->serial));
  put_str(o, cmd);
  vp__put(o, ",\"self\":%s,\"alive\":%s,\"joined_ms_ago\":%llu,\"page_size\":%llu,"
      "\"committed\":%llu,\"external_reserved\":%llu,\"external_floor\":%llu,"
      "\"headroom\":%llu,\"served\":%llu,"
      "\"released\":%llu,", self ? "true" : "false",
      vp__lpart_alive(p) ? "true" : "false",
      ULL(ms_ago(now, atomic_load(&p->joined))), LD(p->page_size),
      LD(p->committed), LD(p->external_reserved), LD(p->external_floor),
      LD(p->headroom), LD(p->served),
      LD(p->released));
  view_vbars(o, p, now);
  vp__put(o, "}");
}

static const char *req_state(uint32_t s) {
  static const char *const names[] = {"free", "claimed", "posted", "taken",
                                      "done", "abandoned"};
  return s < sizeof names / sizeof *names ? names[s] : "corrupt";
}

static int req_pid(const ledger_seg_t *seg, uint32_t slot) {
  return slot < LEDGER_PARTS ? (int)atomic_load(&seg->part[slot].pid) : -1;
}

static void view_requests(vp__out_t *o, const ledger_seg_t *seg, uint64_t now) {
  const char *sep = "";
  vp__put(o, "\"requests\":[");
  for (int i = 0; i < LEDGER_REQS; i++) {
    const ledger_req_t *r = &seg->req[i];
    uint32_t s = atomic_load(&r->state);
    if (s == REQ_FREE) continue;
    uint32_t from = atomic_load(&r->from), to = atomic_load(&r->to);
    vp__put(o, "%s{\"slot\":%d,\"state\":\"%s\",\"from\":%u,\"to\":%u,"
        "\"from_pid\":%d,\"to_pid\":%d,\"bytes\":%llu,\"freed\":%llu,"
        "\"age_ms\":%llu}", sep, i, req_state(s), from, to,
        req_pid(seg, from), req_pid(seg, to), LD(r->bytes), LD(r->freed),
        ULL(ms_ago(now, atomic_load(&r->posted))));
    sep = ",";
  }
  vp__put(o, "]");
}

/* The whole segment; self: our slot, or -1. */
static void view(vp__out_t *o, const ledger_seg_t *seg, int self) {
  char name[80];
  uint64_t now = vp__os_coarse_ns();
  vp__ltext_get(seg->name, LEDGER_WORDS(80), name);
  vp__put(o, "{\"ledger\":");
  put_str(o, name);
  uint64_t measured = atomic_load(&seg->measured);
  vp__put(o, ",\"joined\":%s,\"version\":%u,\"device\":{\"total\":%llu,"
      "\"free\":%llu,\"measured_ms_ago\":", self >= 0 ? "true" : "false",
      atomic_load(&seg->version), LD(seg->total), LD(seg->free));
  if (measured) vp__put(o, "%llu", ULL(ms_ago(now, measured)));
  else vp__put(o, "null");
  vp__put(o, "},\"processes\":[");
  const char *sep = "";
  for (int i = 0; i < LEDGER_PARTS; i++) {
    const ledger_part_t *p = &seg->part[i];
    if (atomic_load(&p->state) != PART_LIVE) continue;
    vp__put(o, "%s", sep);
    view_part(o, p, i, i == self, now);
    sep = ",";
  }
  vp__put(o, "],");
  view_requests(o, seg, now);
  vp__put(o, "}");
}

static int finish(vp__out_t *o, size_t *needed) {
  if (needed) *needed = o->pos;
  if (o->pos < o->len) return VP_OK;
  if (o->len) o->buf[o->len - 1] = '\0';
  return vp__err(VP_ERANGE, "the snapshot needs %zu bytes, the buffer has "
                 "%zu", o->pos + 1, o->len);
}

int vp_ledger_snapshot(vp_device_t h, char *buf, size_t len, size_t *needed) {
  VP__ENTER();
  VP__NEED(buf || len == 0, "buf is NULL");
  vp__device_t *dev = NULL;
  int rc = vp__dev_lock(h, &dev);
  if (rc) return rc;
  vp__out_t o = {buf, len, 0};
  vp__ledger_t *l = dev->ledger;
  if (l) {
    vp__ledger_sync(dev);
    view(&o, l->seg, l->part);
  } else {
    vp__put(&o, "{\"ledger\":null,\"joined\":false,\"reason\":");
    char why[sizeof dev->ledger_why];
    snprintf(why, sizeof why, "%s", dev->ledger_why);
    for (char *c = why; *c; c++)
      if (*c < 0x20 || *c > 0x7e) *c = '?';
    put_str(&o, why);
    vp__put(&o, "}");
  }
  return vp__unlock(dev, finish(&o, needed));
}

static bool name_ok(const char *s) {
  size_t n = strnlen(s, 80);
  if (n == 0 || n == 80) return false;
  for (size_t i = 0; i < n; i++)
    if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z') ||
          (s[i] >= '0' && s[i] <= '9') || s[i] == '-' || s[i] == '_'))
      return false;
  return true;
}

int vp_ledger_read(const char *name, char *buf, size_t len, size_t *needed) {
  VP__ENTER();
  VP__NEED(name, "name is NULL");
  VP__NEED(buf || len == 0, "buf is NULL");
  if (!name_ok(name))
    return vp__err(VP_EINVAL, "\"%.80s\" is not a ledger name (letters, "
                   "digits, - and _, under 80 bytes)", name);
  char shm[112], why[192] = "";
  snprintf(shm, sizeof shm, LEDGER_PREFIX "%s", name);
  ledger_seg_t *seg = NULL;
  int rc = vp__lseg_map(shm, false, &seg, why, sizeof why);
  if (rc == VP_ENODEV)
    return vp__err(rc, "no ledger named %s (no /dev/shm%s)", name, shm);
  if (rc) return vp__err(rc, "%s", why);
  vp__out_t o = {buf, len, 0};
  view(&o, seg, -1);
  vp__lseg_unmap(seg);
  return finish(&o, needed);
}

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The names found so far; after a failed allocation, no more. */
typedef struct name_list {
  char **names;
  size_t n, cap;
  bool failed;
} name_list_t;

static void add_name(const char *seg, void *arg) {
  name_list_t *l = arg;
  const char *name = seg + strlen(LEDGER_PREFIX) - 1; /* no slash in seg */
  if (l->failed || !name_ok(name)) return;
  if (l->n == l->cap) {
    size_t ncap = l->cap ? l->cap * 2 : 16;
    char **g = realloc(l->names, ncap * sizeof *g);
    if (!g) {
      l->failed = true;
      return;
    }
    l->names = g;
    l->cap = ncap;
  }
  if (!(l->names[l->n] = strdup(name))) l->failed = true;
  else l->n++;
}

int vp_ledger_list(char *buf, size_t len, size_t *needed) {
  VP__ENTER();
  VP__NEED(buf || len == 0, "buf is NULL");
  name_list_t l = {NULL, 0, 0, false};
  (void)vp__os_shm_list(&LEDGER_PREFIX[1], add_name, &l); /* none: [] */
  char **names = l.names;
  size_t n = l.n;
  if (n) qsort(names, n, sizeof *names, cmp_str);
  vp__out_t o = {buf, len, 0};
  vp__put(&o, "[");
  for (size_t i = 0; i < n; i++) {
    vp__put(&o, "%s", i ? "," : "");
    put_str(&o, names[i]);
    free(names[i]);
  }
  vp__put(&o, "]");
  free(names);
  return finish(&o, needed);
}
