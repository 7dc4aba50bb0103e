/* The vpager demo: two synthetic models whose weights together are bigger
 * than the memory vpager may use are paged through the device, pass after
 * pass. Every layer's bytes are read back from the device and compared with
 * the expected weights. Uses the GPU when there is one, else the simulated
 * device; says which.
 *
 * Per layer: fault its range (pins the pages). If the pages' generations
 * changed since the layer was last written, the data is gone: fill it from
 * the host copy. Read it back, check it, unpin with a fence on the stream.
 * A miss (the pager declined) is a layer that would be streamed from the
 * host; the demo checks the host copy instead.
 *
 * The table counts what the report beneath it counts: one fault per layer,
 * each a hit, a fill or a miss (vp_stats_t), and pages evicted; `copied`
 * is the demo's own count of layers it wrote from the host (a hit can need
 * one too: the other layer of a page that was just committed). Sizes read
 * in one rule, as the report's do ("32 MiB", "1 GiB"). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vpager.h"

#define MiB (1024ull * 1024)
#define LAYER (16 * MiB)
#define BUDGET (512 * MiB)
/* A layer spans at most this many pages: the smallest page is 4 KiB
 * (VPAGER_PAGE_SIZE=2M gives 8 a layer). */
#define MAX_GENS (LAYER / 4096)

typedef struct layer {
  uint8_t *host;            /* the expected weights */
  uint32_t gens[MAX_GENS];  /* page generations when last filled */
  int filled;
} layer_t;

typedef struct model {
  const char *name;
  int nlayers;
  vp_vbar_t vbar;
  uint64_t base;
  layer_t *layers;
} model_t;

typedef struct tally {
  uint64_t copied, verified;
  int bad;
} tally_t;

static int check(int rc, const char *what) {
  if (rc < 0) {
    fprintf(stderr, "demo: %s failed: %s\n", what, vp_last_error());
    exit(1);
  }
  return rc;
}

static void make_weights(uint8_t *p, uint64_t n, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (uint64_t i = 0; i < n; i += 8) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    memcpy(p + i, &x, 8);
  }
}

static void model_init(vp_device_t dev, model_t *m, const char *name,
                       int nlayers, int seed) {
  m->name = name;
  m->nlayers = nlayers;
  m->layers = calloc((size_t)nlayers, sizeof *m->layers);
  if (!m->layers) exit(1);
  for (int i = 0; i < nlayers; i++) {
    m->layers[i].host = malloc(LAYER);
    if (!m->layers[i].host) exit(1);
    make_weights(m->layers[i].host, LAYER, (uint64_t)seed * 1000 + i);
  }
  check(vp_vbar_create(dev, (uint64_t)nlayers * LAYER, &m->vbar), "vbar");
  check(vp_vbar_base(m->vbar, &m->base), "vbar base");
}

static void run_layer(vp_device_t dev, vp_stream_t s, model_t *m, int i,
                      uint8_t *scratch, tally_t *t) {
  layer_t *l = &m->layers[i];
  uint64_t off = (uint64_t)i * LAYER;
  uint32_t gens[MAX_GENS] = {0};
  if (check(vp_fault(m->vbar, off, LAYER, gens, MAX_GENS), "fault") ==
      VP_MISS) {
    t->verified += LAYER; /* streamed from the host copy */
    return;
  }
  if (!l->filled || memcmp(gens, l->gens, sizeof gens) != 0) {
    check(vp_copy_to_device(dev, m->base + off, l->host, LAYER, s), "copy");
    memcpy(l->gens, gens, sizeof gens);
    l->filled = 1;
    t->copied++;
  }
  check(vp_copy_to_host(dev, scratch, m->base + off, LAYER, s), "read");
  check(vp_stream_synchronize(dev, s), "sync");
  if (memcmp(scratch, l->host, LAYER) != 0) {
    fprintf(stderr, "demo: %s layer %d: device bytes differ!\n", m->name, i);
    t->bad = 1;
  }
  t->verified += LAYER;
  check(vp_unpin(m->vbar, off, LAYER, s), "unpin");
}

/* A size as the report prints it: the largest binary unit it reaches, one
 * decimal when not whole. */
static const char *size_text(uint64_t bytes, char buf[24]) {
  static const char *const unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (u < 4 && bytes >> (10 * (u + 1))) u++;
  uint64_t one = 1ull << (10 * u);
  double v = (double)bytes / (double)one;
  if (bytes % one == 0)
    snprintf(buf, 24, "%llu %s", (unsigned long long)(bytes / one), unit[u]);
  else if (u < 4 && v >= 1023.95)
    snprintf(buf, 24, "%.1f %s", v / 1024, unit[u + 1]);
  else
    snprintf(buf, 24, "%.1f %s", v, unit[u]);
  return buf;
}

static void print_map(const model_t *m) {
  uint64_t n;
  check(vp_vbar_page_count(m->vbar, &n), "page count");
  uint8_t flags[256];
  if (n > sizeof flags) n = sizeof flags;
  check(vp_vbar_residency(m->vbar, flags, n), "residency");
  printf("    %-7s [", m->name);
  for (uint64_t p = 0; p < n; p++)
    putchar(flags[p] & VP_PAGE_PINNED ? 'P'
            : flags[p] & VP_PAGE_RESIDENT ? '#' : '.');
  printf("]\n");
}

int main(void) {
  vp_options_t opts;
  vp_options_init(&opts);
  if (!getenv("VPAGER_SIM_CAPACITY")) opts.sim_capacity = 1024 * MiB;
  vp_device_t dev;
  check(vp_device_open(&opts, &dev), "opening the device");
  vp_device_info_t info;
  check(vp_device_info(dev, &info), "device info");
  /* Whatever the device's size, let vpager use only BUDGET of it. */
  check(vp_device_set_limit(dev, BUDGET), "limit");
  const char *backend = vp_device_backend(dev);
  printf("vpager demo on the %s device (%s)\n", backend,
         strcmp(backend, "cuda") == 0 ? "a GPU"
                                      : "simulated in host memory: no GPU");
  char b1[24], b2[24], b3[24];
  printf("device memory %s, vpager budget %s, page %s\n",
         size_text(info.total_memory, b1), size_text(BUDGET, b2),
         size_text(info.page_size, b3));

  model_t models[2];
  model_init(dev, &models[0], "unet", 48, 1);
  model_init(dev, &models[1], "vae", 12, 2);
  printf("models: unet %d x %s layers, vae %d x %s layers: %s of weights\n\n",
         models[0].nlayers, size_text(LAYER, b1), models[1].nlayers,
         size_text(LAYER, b2),
         size_text((uint64_t)(models[0].nlayers + models[1].nlayers) * LAYER,
                   b3));
  vp_stream_t s;
  check(vp_stream_create(dev, &s), "stream");
  uint8_t *scratch = malloc(LAYER);
  if (!scratch) return 1;

  static const int schedule[] = {0, 0, 0, 1, 0, 0};
  uint64_t total_verified = 0;
  int bad = 0;
  printf("Each pass faults every %s layer of one model once; the columns "
         "are per pass.\n"
         "  hits fills misses  layer faults, counted as the report's "
         "counters below\n"
         "                     count them: pages resident / pages committed /"
         "\n"
         "                     declined (the layer is streamed from the host)"
         "\n"
         "  copied             layers the demo wrote from the host (a hit can "
         "need one:\n"
         "                     the other layer of a page just committed)\n"
         "  evicted            %s pages evicted to make room\n"
         "Residency maps: one character a page, # resident, . not, P pinned."
         "\n\n", size_text(LAYER, b1), size_text(info.page_size, b2));
  printf("                 layer faults        layers   pages\n");
  printf("pass  model    hits  fills  misses   copied  evicted\n");
  vp_stats_t first = {.size = sizeof first};
  check(vp_device_stats(dev, &first), "stats");
  uint64_t total_copied = 0;
  for (size_t pass = 0; pass < sizeof schedule / sizeof *schedule; pass++) {
    model_t *m = &models[schedule[pass]];
    check(vp_vbar_prioritize(m->vbar), "prioritize"); /* it runs next */
    vp_stats_t before = {.size = sizeof before}, after = {.size = sizeof after};
    check(vp_device_stats(dev, &before), "stats");
    tally_t t = {0};
    for (int i = 0; i < m->nlayers; i++) run_layer(dev, s, m, i, scratch, &t);
    check(vp_device_stats(dev, &after), "stats");
    printf("%4zu  %-7s %5llu  %5llu  %6llu  %7llu  %7llu\n", pass + 1, m->name,
           (unsigned long long)(after.hits - before.hits),
           (unsigned long long)(after.fills - before.fills),
           (unsigned long long)(after.misses - before.misses),
           (unsigned long long)t.copied,
           (unsigned long long)(after.pages_evicted - before.pages_evicted));
    print_map(&models[0]);
    print_map(&models[1]);
    total_verified += t.verified;
    total_copied += t.copied;
    bad |= t.bad;
  }
  vp_stats_t last = {.size = sizeof last};
  check(vp_device_stats(dev, &last), "stats");
  printf("total         %5llu  %5llu  %6llu  %7llu  %7llu\n",
         (unsigned long long)(last.hits - first.hits),
         (unsigned long long)(last.fills - first.fills),
         (unsigned long long)(last.misses - first.misses),
         (unsigned long long)total_copied,
         (unsigned long long)(last.pages_evicted - first.pages_evicted));
  char report[8192];
  check(vp_device_report(dev, 0, report, sizeof report, NULL), "report");
  printf("\n%s", report);
  free(scratch);
  check(vp_stream_destroy(dev, s), "stream destroy");
  check(vp_device_close(dev), "close");
  for (int k = 0; k < 2; k++) {
    for (int i = 0; i < models[k].nlayers; i++) free(models[k].layers[i].host);
    free(models[k].layers);
  }
  if (bad) {
    printf("\nFAILED: some layers read back wrong bytes\n");
    return 1;
  }
  printf("\nverified %s read from the device and streamed layers "
         "against the expected weights: all bytes match\n",
         size_text(total_verified, b1));
  return 0;
}
