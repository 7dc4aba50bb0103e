/* Microbenchmark of the pager's hot path on the simulated device (or the
 * device VPAGER_BACKEND names):
 *   1. fault+unpin of a resident page, ns per pair; baseline: two
 *      uncontended mutex lock/unlock pairs (the floor of two locked calls);
 *   2. eviction of 1 GiB of touched pages, ms; baseline (sim): madvise +
 *      mprotect of the same bytes done directly;
 *   3. vp_acquire+vp_release of one weight at a time over a VBAR of 2000
 *      resident, filled weights with prefetch on (256 MiB lookahead), ns
 *      per pair; baseline: the same with prefetch off (lookahead 0): what
 *      prefetch's scan costs once nothing is left to copy.
 * Prints the machine, the inputs and each ratio against its baseline. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#include "vpager.h"

#define MiB (1024ull * 1024)
#define GiB (1024 * MiB)
#define REPEATS 5

static double now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e9 + ts.tv_nsec;
}

static void die(const char *what) {
  fprintf(stderr, "bench: %s: %s\n", what, vp_last_error());
  exit(1);
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return v[n / 2];
}

static void print_machine(void) {
  struct utsname u;
  uname(&u);
  char model[256] = "unknown";
  FILE *f = fopen("/proc/cpuinfo", "r");
  char line[512];
  while (f && fgets(line, sizeof line, f))
    if (strncmp(line, "model name", 10) == 0) {
      char *c = strchr(line, ':');
      if (c) snprintf(model, sizeof model, "%s", c + 2);
      model[strcspn(model, "\n")] = 0;
      break;
    }
  if (f) fclose(f);
  time_t t = time(NULL);
  char date[32];
  strftime(date, sizeof date, "%Y-%m-%d %H:%M", gmtime(&t));
  printf("machine: %s, %ld cpus, %s %s, %s UTC\n", model,
         sysconf(_SC_NPROCESSORS_ONLN), u.sysname, u.release, date);
}

static double bench_hit(vp_vbar_t vb, long iters) {
  uint32_t gen;
  double t0 = now_ns();
  for (long i = 0; i < iters; i++) {
    if (vp_fault(vb, 0, 4096, &gen, 1) != VP_OK) die("fault");
    if (vp_unpin(vb, 0, 4096, 0) != VP_OK) die("unpin");
  }
  return (now_ns() - t0) / iters;
}

static double bench_mutex(long iters) {
  pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
  volatile long sink = 0;
  double t0 = now_ns();
  for (long i = 0; i < iters; i++) {
    pthread_mutex_lock(&m), sink++, pthread_mutex_unlock(&m);
    pthread_mutex_lock(&m), sink++, pthread_mutex_unlock(&m);
  }
  return (now_ns() - t0) / iters;
}

/* Commit and touch 1 GiB of pages, then time freeing it. */
static double bench_evict(vp_device_t dev, vp_vbar_t vb, uint64_t page) {
  uint64_t base;
  vp_vbar_base(vb, &base);
  uint8_t *chunk = malloc(page);
  if (!chunk) die("malloc");
  memset(chunk, 1, page);
  for (uint64_t off = 0; off < GiB; off += page) {
    if (vp_fault(vb, off, page, NULL, 0) != VP_OK) die("fault (evict)");
    if (vp_copy_to_device(dev, base + off, chunk, page, 0)) die("copy");
    if (vp_unpin(vb, off, page, 0)) die("unpin");
  }
  free(chunk);
  vp_stream_synchronize(dev, 0);
  uint64_t freed = 0;
  double t0 = now_ns();
  if (vp_vbar_free_memory(vb, GiB, &freed) || freed != GiB) die("free");
  double ms = (now_ns() - t0) / 1e6;
  vp_vbar_prioritize(vb); /* lift the watermark for the next round */
  return ms;
}

static double bench_raw_evict(uint64_t page) {
  uint8_t *p = mmap(NULL, GiB, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) die("mmap");
  memset(p, 1, GiB);
  double t0 = now_ns();
  for (uint64_t off = 0; off < GiB; off += page) {
    madvise(p + off, page, MADV_DONTNEED);
    mprotect(p + off, page, PROT_NONE);
  }
  double ms = (now_ns() - t0) / 1e6;
  munmap(p, GiB);
  return ms;
}

/* Acquire and release each of n resident weights in turn, ns per pair. */
static double bench_acquire(vp_device_t dev, const vp_weight_t *w, size_t n,
                            int rounds) {
  uint64_t ptr;
  double t0 = now_ns();
  for (int r = 0; r < rounds; r++)
    for (size_t i = 0; i < n; i++)
      if (vp_acquire(dev, &w[i], 1, 0, &ptr, NULL) ||
          vp_release(dev, &w[i], 1, 0))
        die("acquire/release");
  return (now_ns() - t0) / ((double)rounds * n);
}

#define NWEIGHTS 2000
#define WEIGHT_SIZE (64 * 1024ull)

static void bench_prefetch_scan(vp_device_t dev) {
  static vp_weight_t w[NWEIGHTS];
  static uint64_t off[NWEIGHTS], size[NWEIGHTS];
  static vp_source_t src[NWEIGHTS];
  uint8_t *host = calloc(NWEIGHTS, WEIGHT_SIZE);
  vp_vbar_t vb;
  if (!host || vp_vbar_create(dev, NWEIGHTS * WEIGHT_SIZE, &vb)) die("vbar");
  for (size_t i = 0; i < NWEIGHTS; i++) {
    off[i] = i * WEIGHT_SIZE, size[i] = WEIGHT_SIZE;
    src[i] = (vp_source_t){.kind = VP_SOURCE_HOST,
                           .host = host + i * WEIGHT_SIZE};
  }
  if (vp_weights_create(vb, NWEIGHTS, off, size, src, w)) die("weights");
  bench_acquire(dev, w, NWEIGHTS, 1); /* fill them all */
  double on[REPEATS], off0[REPEATS];
  for (int r = 0; r < REPEATS; r++) {
    vp_device_set_lookahead(dev, 256 * MiB);
    on[r] = bench_acquire(dev, w, NWEIGHTS, 20);
    vp_device_set_lookahead(dev, 0);
    off0[r] = bench_acquire(dev, w, NWEIGHTS, 20);
  }
  double a = median(on, REPEATS), b = median(off0, REPEATS);
  printf("acquire+release, %d resident weights of %llu KiB, one a call: "
         "%.1f ns/pair with prefetch (256 MiB lookahead)   baseline "
         "prefetch off %.1f ns   ratio %.2f\n", NWEIGHTS,
         WEIGHT_SIZE / 1024, a, b, a / b);
  for (size_t i = 0; i < NWEIGHTS; i++) vp_weight_destroy(w[i]);
  vp_vbar_destroy(vb);
  free(host);
}

int main(int argc, char **argv) {
  long iters = argc > 1 ? atol(argv[1]) : 2000000;
  vp_options_t opts;
  vp_options_init(&opts);
  if (!getenv("VPAGER_SIM_CAPACITY")) opts.sim_capacity = 2 * GiB;
  vp_device_t dev;
  if (vp_device_open(&opts, &dev)) die("open");
  vp_vbar_t vb;
  if (vp_vbar_create(dev, 2 * GiB, &vb)) die("vbar");
  print_machine();
  printf("inputs: backend %s, page %llu MiB, %ld fault+unpin pairs, "
         "evict 1 GiB, best and median of %d\n", vp_device_backend(dev),
         (unsigned long long)(opts.page_size / MiB), iters, REPEATS);

  double hit[REPEATS], lock[REPEATS], ev[REPEATS], raw[REPEATS];
  if (vp_fault(vb, 0, 4096, NULL, 0) || vp_unpin(vb, 0, 4096, 0))
    die("warm-up");
  for (int r = 0; r < REPEATS; r++) {
    hit[r] = bench_hit(vb, iters);
    lock[r] = bench_mutex(iters);
  }
  vp_vbar_free_memory(vb, UINT64_MAX, NULL);
  vp_vbar_prioritize(vb);
  for (int r = 0; r < REPEATS; r++) {
    ev[r] = bench_evict(dev, vb, opts.page_size);
    raw[r] = strcmp(vp_device_backend(dev), "sim") == 0
                 ? bench_raw_evict(opts.page_size) : 0;
  }
  double h = median(hit, REPEATS), l = median(lock, REPEATS);
  printf("fault+unpin hit:  %7.1f ns/pair (best %.1f)   baseline 2x mutex "
         "lock/unlock %.1f ns   ratio %.2f\n", h, hit[0], l, h / l);
  double e = median(ev, REPEATS), w = median(raw, REPEATS);
  printf("evict 1 GiB:      %7.2f ms (best %.2f)        ", e, ev[0]);
  if (w > 0)
    printf("baseline madvise+mprotect %.2f ms   ratio %.2f\n", w, e / w);
  else
    printf("(no raw baseline on this backend)\n");
  vp_vbar_destroy(vb);
  bench_prefetch_scan(dev);
  vp_device_close(dev);
  return 0;
}
