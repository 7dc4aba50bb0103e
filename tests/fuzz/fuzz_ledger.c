/* fuzz_ledger: a hostile ledger segment never crashes a joining process.
 *
 * Each input builds /dev/shm/vpager-ledger-v3-fzl-<pid> by hand, then a
 * device joins it (vp_options_t.ledger), pages through a small simulated
 * device (its faults walk the segment's entries and post release requests
 * to whatever "participants" it lists), serves the requests it finds
 * addressed to itself, prints the segment (vp_ledger_snapshot, and
 * vp_ledger_read as `vpager top` does), frees memory over it and leaves.
 *
 * Input: a flags byte, then patches until the input ends. Flags:
 *   bit 0  the header left as the library writes it (magic, version, size);
 *          else the patches may break it (a refused segment: run alone)
 *   bit 1  a fresh robust mutex; else its bytes come from the input too
 *   bit 2  a simulated device with worker streams
 *   bit 3  the patches build the machine's pin ledger of that name
 *          (/dev/shm/vpager-pins-v2-fzl-<pid>, pins.h: header, request k or
 *          participant k) instead; the GPU ledger is left as written
 *   bits 4-5  the segment's length: exact, truncated, one page more, empty
 * A patch: a region byte (header, request k, participant k, or entry j of
 * participant k), an offset in it, a length byte and that many bytes.
 *
 * The device also pins host buffers against the pin ledger (its takes sum
 * the hostile counts and ask the hostile "participants" to give back),
 * reads the machine's total and sets the budget.
 *
 * Checks: every call keeps the error-code rule; vp_ledger_snapshot and
 * vp_ledger_read give NUL-terminated text; the device works alone or
 * joined (a page faults in when the device has room); nothing crashes,
 * leaks or trips a sanitizer. */
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fuzz_common.h"
#include "pins.h"

#define CHECK(cond, ...)                                                       \
  do {                                                                         \
    if (!(cond)) fz_fail(__VA_ARGS__);                                         \
  } while (0)

#define PAGE (64u << 10)
#define SNAP (1u << 20)

static char name[64], shm[128], pshm[128];
static ledger_seg_t *model; /* the segment as built, before writing */
static pins_seg_t *pmodel;  /* the pin ledger as built (flags bit 3) */
static char *snap;

/* Where a patch goes: its region's start and length in the segment. */
static void region(fz_reader_t *r, size_t *start, size_t *len) {
  uint8_t kind = fz_u8(r) % 4;
  switch (kind) {
  case 0:
    *start = 0;
    *len = offsetof(ledger_seg_t, req);
    break;
  case 1: {
    size_t k = fz_below(r, LEDGER_REQS);
    *start = offsetof(ledger_seg_t, req) + k * sizeof(ledger_req_t);
    *len = sizeof(ledger_req_t);
    break;
  }
  case 2: {
    size_t k = fz_below(r, LEDGER_PARTS);
    *start = offsetof(ledger_seg_t, part) + k * sizeof(ledger_part_t);
    *len = offsetof(ledger_part_t, vbar);
    break;
  }
  default: {
    size_t k = fz_below(r, LEDGER_PARTS), j = fz_below(r, LEDGER_VBARS);
    *start = offsetof(ledger_seg_t, part) + k * sizeof(ledger_part_t) +
             offsetof(ledger_part_t, vbar) + j * sizeof(ledger_vbar_t);
    *len = sizeof(ledger_vbar_t);
  }
  }
}

/* The same for the pin ledger: header, request k or participant k. */
static void pin_region(fz_reader_t *r, size_t *start, size_t *len) {
  uint8_t kind = fz_u8(r) % 3;
  if (kind == 0) {
    *start = 0;
    *len = offsetof(pins_seg_t, req);
  } else if (kind == 1) {
    size_t k = fz_below(r, PINS_REQS);
    *start = offsetof(pins_seg_t, req) + k * sizeof(ledger_req_t);
    *len = sizeof(ledger_req_t);
  } else {
    size_t k = fz_below(r, PINS_PARTS);
    *start = offsetof(pins_seg_t, part) + k * sizeof(pins_part_t);
    *len = sizeof(pins_part_t);
  }
}

static void init_lock(vp__os_plock_shared_t *m) { vp__os_plock_init(m); }

/* `total` bytes of `seg` (zero past it) as the shared-memory file `path`. */
static void put_segment(const char *path, const void *seg, size_t seg_size,
                        size_t total) {
  shm_unlink(path);
  int fd = shm_open(path, O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0 || ftruncate(fd, (off_t)total)) abort();
  size_t w = total < seg_size ? total : seg_size;
  if (w && pwrite(fd, seg, w, 0) != (ssize_t)w) abort();
  close(fd);
}

/* The pin ledger of this input (flags bit 3), written to /dev/shm. */
static void build_pins(const uint8_t *data, size_t size, uint8_t flags) {
  memset(pmodel, 0, sizeof *pmodel);
  atomic_store(&pmodel->magic, PINS_MAGIC);
  atomic_store(&pmodel->version, PINS_VERSION);
  atomic_store(&pmodel->size, sizeof(pins_seg_t));
  atomic_store(&pmodel->budget, 8 * PAGE);
  if (flags & 2) init_lock(&pmodel->lock);
  fz_reader_t r = {data, size, 0};
  while (fz_more(&r)) {
    size_t start, len;
    pin_region(&r, &start, &len);
    size_t off = fz_below(&r, len), n = fz_u8(&r);
    if (n > len - off) n = len - off;
    for (size_t i = 0; i < n; i++) ((uint8_t *)pmodel)[start + off + i] =
        fz_u8(&r);
  }
  if (flags & 1) {
    atomic_store(&pmodel->magic, PINS_MAGIC);
    atomic_store(&pmodel->version, PINS_VERSION);
    atomic_store(&pmodel->size, sizeof(pins_seg_t));
  }
  if (flags & 2) init_lock(&pmodel->lock);
  static const size_t lens[4] = {sizeof(pins_seg_t), sizeof(pins_seg_t) / 2,
                                 sizeof(pins_seg_t) + 4096, 0};
  put_segment(pshm, pmodel, sizeof *pmodel, lens[(flags >> 4) & 3]);
}

/* The segment of this input, written to /dev/shm. */
static void build(const uint8_t *data, size_t size, uint8_t flags) {
  memset(model, 0, sizeof *model);
  atomic_store(&model->magic, LEDGER_MAGIC);
  atomic_store(&model->version, LEDGER_VERSION);
  atomic_store(&model->size, sizeof(ledger_seg_t));
  if (flags & 2) init_lock(&model->lock);
  shm_unlink(pshm);
  if (flags & 8) { /* the patches are the pin ledger's */
    build_pins(data, size, flags);
    init_lock(&model->lock);
    size = 0;
    flags &= 0x0f;
  }
  fz_reader_t r = {data, size, 0};
  while (fz_more(&r)) {
    size_t start, len;
    region(&r, &start, &len);
    size_t off = fz_below(&r, len), n = fz_u8(&r);
    if (n > len - off) n = len - off;
    for (size_t i = 0; i < n; i++) ((uint8_t *)model)[start + off + i] =
        fz_u8(&r);
  }
  if (flags & 1) {
    atomic_store(&model->magic, LEDGER_MAGIC);
    atomic_store(&model->version, LEDGER_VERSION);
    atomic_store(&model->size, sizeof(ledger_seg_t));
  }
  if (flags & 2) init_lock(&model->lock);
  static const size_t lens[4] = {sizeof(ledger_seg_t),
                                 sizeof(ledger_seg_t) / 2,
                                 sizeof(ledger_seg_t) + 4096, 0};
  put_segment(shm, model, sizeof *model, lens[(flags >> 4) & 3]);
}

/* Host buffers against the pin ledger: within its budget or pageable,
 * never an error; the machine's total read; the budget set. */
static void pin_some(vp_device_t dev) {
  vp_hostbuf_t hb[2];
  bool have[2] = {false, false};
  for (int i = 0; i < 2; i++)
    have[i] = FZ_CALL(false, vp_hostbuf_alloc(dev, 2 * PAGE, 4 * PAGE,
                                              &hb[i]), "") == VP_OK;
  CHECK(have[0] && have[1], "vp_hostbuf_alloc failed against a pin ledger");
  FZ_CALL(false, vp_hostbuf_grow(hb[0], 4 * PAGE), "");
  vp_stats_t st = {.size = sizeof st};
  CHECK(FZ_CALL(false, vp_device_stats(dev, &st), "") == VP_OK,
        "vp_device_stats");
  FZ_CALL(false, vp_device_set_pin_budget(dev, 3 * PAGE), "");
  for (int i = 0; i < 2; i++)
    if (have[i]) FZ_CALL(false, vp_hostbuf_free(hb[i]), "");
}

static void check_text(const char *what, int rc, size_t need) {
  if (rc) return;
  CHECK(memchr(snap, '\0', SNAP) && strlen(snap) == need,
        "%s: the text is not %zu bytes, NUL-terminated", what, need);
  CHECK(snap[0] == '{', "%s: not a JSON object: %.40s", what, snap);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  vp_set_log_level(VP_LOG_NONE);
  fz_trace_live = getenv("FUZZ_TRACE") != NULL;
  fz_dump_on_death();
  snprintf(name, sizeof name, "fzl-%d", (int)getpid());
  snprintf(shm, sizeof shm, LEDGER_PREFIX "%s", name);
  snprintf(pshm, sizeof pshm, PINS_PREFIX "%s", name);
  model = malloc(sizeof *model);
  pmodel = malloc(sizeof *pmodel);
  snap = malloc(SNAP);
  if (!model || !pmodel || !snap) abort();
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  uint8_t flags = data[0];
  fz_trace_reset();
  build(data + 1, size - 1, flags);
  vp_options_t o;
  vp_options_init(&o);
  o.backend = VP_BACKEND_SIM;
  o.page_size = PAGE;
  o.sim_granularity = PAGE;
  o.sim_capacity = 4 * PAGE;
  o.sim_streams = (flags & 4) ? VP_SIM_WORKER : VP_SIM_SYNC;
  o.staging_size = PAGE;
  o.lookahead = 0;
  o.ledger_timeout_us = 200; /* hostile "peers" never answer */
  snprintf(o.ledger, sizeof o.ledger, "%s", name);
  vp_device_t dev;
  int rc = FZ_CALL(false, vp_device_open(&o, &dev), "ledger %s", name);
  CHECK(rc == VP_OK, "vp_device_open: %s", fz_name(rc));
  size_t need = 0;
  rc = FZ_CALL(false, vp_ledger_snapshot(dev, snap, SNAP, &need), "");
  check_text("vp_ledger_snapshot", rc, need);
  vp_vbar_t a, b;
  CHECK(FZ_CALL(false, vp_vbar_create(dev, 3 * PAGE, &a), "") == VP_OK,
        "vp_vbar_create");
  CHECK(FZ_CALL(false, vp_vbar_create(dev, 3 * PAGE, &b), "") == VP_OK,
        "vp_vbar_create");
  FZ_CALL(false, vp_vbar_set_label(a, "fuzz-a"), "");
  /* Six pages on a four-page device: faults that ask the "peers". */
  for (int round = 0; round < 2; round++)
    for (uint64_t p = 0; p < 3; p++) {
      vp_vbar_t v = round ? b : a;
      rc = FZ_CALL(true, vp_fault(v, p * PAGE, PAGE, NULL, 0), "page %llu",
                   (unsigned long long)p);
      if (rc == VP_OK)
        CHECK(FZ_CALL(false, vp_unpin(v, p * PAGE, PAGE, 0), "") == VP_OK,
              "vp_unpin after a fault");
    }
  uint64_t freed = 0;
  FZ_CALL(false, vp_ledger_free_memory_keep(dev, 2 * PAGE, &a, 1, &freed),
          "");
  FZ_CALL(false, vp_device_set_external_reserved(dev, 1), "");
  pin_some(dev);
  rc = FZ_CALL(false, vp_ledger_snapshot(dev, snap, SNAP, &need), "");
  check_text("vp_ledger_snapshot", rc, need);
  char ledger[96];
  snprintf(ledger, sizeof ledger, "%s", name);
  rc = FZ_CALL(false, vp_ledger_read(ledger, snap, SNAP, &need), "");
  check_text("vp_ledger_read", rc, need);
  CHECK(FZ_CALL(false, vp_device_close(dev), "") == VP_OK, "close");
  shm_unlink(shm);
  shm_unlink(pshm);
  return 0;
}
