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
 * host; the demo checks the host copy instead. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vpager.h"

#define MiB (1024ull * 1024)
#define LAYER (16 * MiB)
#define BUDGET (512 * MiB)
#define MAX_GENS 4

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
  uint64_t hits, fills, misses, verified;
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
    t->misses++;
    t->verified += LAYER; /* streamed from the host copy */
    return;
  }
  if (!l->filled || memcmp(gens, l->gens, sizeof gens) != 0) {
    check(vp_copy_to_device(dev, m->base + off, l->host, LAYER, s), "fill");
    memcpy(l->gens, gens, sizeof gens);
    l->filled = 1;
    t->fills++;
  } else {
    t->hits++;
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
  printf("device memory %llu MiB, vpager budget %llu MiB, page %llu MiB\n",
         (unsigned long long)(info.total_memory / MiB),
         (unsigned long long)(BUDGET / MiB),
         (unsigned long long)(info.page_size / MiB));

  model_t models[2];
  model_init(dev, &models[0], "unet", 48, 1);
  model_init(dev, &models[1], "vae", 12, 2);
  printf("models: unet %d x %llu MiB layers, vae %d x %llu MiB layers: "
         "%llu MiB of weights\n\n", models[0].nlayers,
         (unsigned long long)(LAYER / MiB), models[1].nlayers,
         (unsigned long long)(LAYER / MiB),
         (unsigned long long)((models[0].nlayers + models[1].nlayers) *
                              LAYER / MiB));
  vp_stream_t s;
  check(vp_stream_create(dev, &s), "stream");
  uint8_t *scratch = malloc(LAYER);
  if (!scratch) return 1;

  static const int schedule[] = {0, 0, 0, 1, 0, 0};
  uint64_t total_verified = 0;
  int bad = 0;
  printf("pass  model    hits  fills  misses  evicted  residency (# resident, "
         ". not, P pinned)\n");
  for (size_t pass = 0; pass < sizeof schedule / sizeof *schedule; pass++) {
    model_t *m = &models[schedule[pass]];
    check(vp_vbar_prioritize(m->vbar), "prioritize"); /* it runs next */
    vp_stats_t before = {.size = sizeof before}, after = {.size = sizeof after};
    check(vp_device_stats(dev, &before), "stats");
    tally_t t = {0};
    for (int i = 0; i < m->nlayers; i++) run_layer(dev, s, m, i, scratch, &t);
    check(vp_device_stats(dev, &after), "stats");
    printf("%4zu  %-7s %5llu  %5llu  %6llu  %7llu\n", pass + 1, m->name,
           (unsigned long long)t.hits, (unsigned long long)t.fills,
           (unsigned long long)t.misses,
           (unsigned long long)(after.pages_evicted - before.pages_evicted));
    print_map(&models[0]);
    print_map(&models[1]);
    total_verified += t.verified;
    bad |= t.bad;
  }
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
  printf("\nverified %llu MiB read from the device and streamed layers "
         "against the expected weights: all bytes match\n",
         (unsigned long long)(total_verified / MiB));
  return 0;
}
