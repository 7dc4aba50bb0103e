/* Microbenchmarks of vpager on a real GPU, through the public API, each
 * against a baseline measured in the same run:
 *   1. commit and evict cost per page for 2, 8, 32 and 64 MiB pages
 *      (one fault of 1 GiB, one vp_vbar_free_memory of 1 GiB); baseline:
 *      the bare VMM calls (cuMemCreate+cuMemMap+cuMemSetAccess,
 *      cuMemUnmap+cuMemRelease) of the same pages;
 *   2. fault+unpin of a resident page, ns per pair; baselines: two
 *      uncontended mutex pairs, and a bare cuEventRecord (what unpin's
 *      fence costs the driver);
 *   3. cuMemGetInfo, vpager's budget poll (vp_device_info, poll interval
 *      0) and the NVML query (vp__cuda_nvml_info); baseline: the cheapest
 *      driver call (cuCtxGetCurrent);
 *   4. eviction of 1 GiB (32 MiB pages) with no device synchronize, the
 *      pages' fences on a kernel-free stream: complete (target <= 3 ms), and
 *      with the stream's copies still in flight (it waits for them only);
 *   5. steady state: 8 layers of 64 MiB faulted/unpinned in order for 20
 *      passes: pages committed and evicted per pass (0 after the first);
 *   6. fill: commit 32 MiB pages and copy pinned host data into them,
 *      against plain cuMemcpyHtoDAsync of the same bytes into a cuMemAlloc
 *      buffer (target >= 0.95);
 *   7. what freeing a 1 GiB run of pages costs the driver, for 2 and 32 MiB
 *      pages: unmap+release per page (what eviction does), release at
 *      commit then unmap per page, release at commit then one unmap of the
 *      whole run (whether the driver takes a range over many mappings);
 *      device free memory checked after each.
 *
 *   make build/bench/bench_cuda && build/bench/bench_cuda [7]
 *
 * Links build/libvpager.a; reaches one internal helper (the device's
 * backend context, for the NVML query). The baselines go through our own
 * dlopen of libcuda.so.1. Exits 0 with a message when there is no GPU. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#include "cuda_abi.h"
#include "internal.h"
#include "vpager.h"

/* Defined in src/backend_cuda.c. */
int vp__cuda_nvml_info(void *ctx, uint64_t *dev_used, uint64_t *dev_total,
                       uint64_t *proc_used);

#define MiB ((uint64_t)1 << 20)
#define GiB ((uint64_t)1 << 30)
#define ROUNDS 5

/* ------------------------------------------------------------- driver */

typedef vp_cu_result_t (*ctx_get_current_fn)(vp_cu_context_t *ctx);
typedef vp_cu_result_t (*device_get_name_fn)(char *name, int len,
                                             vp_cu_device_t dev);
typedef vp_cu_result_t (*mem_alloc_fn)(vp_cu_deviceptr_t *ptr, size_t size);
typedef vp_cu_result_t (*mem_free_fn)(vp_cu_deviceptr_t ptr);
typedef vp_cu_result_t (*mem_host_alloc_fn)(void **p, size_t size,
                                            unsigned int flags);
typedef vp_cu_result_t (*mem_free_host_fn)(void *p);

static struct {
  vp_cu_init_fn init;
  vp_cu_driver_get_version_fn driver_get_version;
  vp_cu_device_get_fn device_get;
  device_get_name_fn device_get_name;
  vp_cu_device_total_mem_fn device_total_mem;
  vp_cu_primary_ctx_retain_fn primary_ctx_retain;
  vp_cu_primary_ctx_release_fn primary_ctx_release;
  vp_cu_ctx_push_current_fn ctx_push_current;
  ctx_get_current_fn ctx_get_current;
  vp_cu_get_error_name_fn get_error_name;
  vp_cu_mem_get_info_fn mem_get_info;
  vp_cu_mem_get_allocation_granularity_fn granularity;
  vp_cu_mem_address_reserve_fn address_reserve;
  vp_cu_mem_address_free_fn address_free;
  vp_cu_mem_create_fn create;
  vp_cu_mem_release_fn release;
  vp_cu_mem_map_fn map;
  vp_cu_mem_unmap_fn unmap;
  vp_cu_mem_set_access_fn set_access;
  mem_alloc_fn mem_alloc;
  mem_free_fn mem_free;
  mem_host_alloc_fn mem_host_alloc;
  mem_free_host_fn mem_free_host;
  vp_cu_memcpy_htod_async_fn memcpy_htod_async;
  vp_cu_stream_create_fn stream_create;
  vp_cu_stream_destroy_fn stream_destroy;
  vp_cu_stream_synchronize_fn stream_synchronize;
  vp_cu_event_create_fn event_create;
  vp_cu_event_destroy_fn event_destroy;
  vp_cu_event_record_fn event_record;
} cu;

static vp_cu_device_t g_dev;
static vp_cu_mem_alloc_prop_t g_prop;
static vp_cu_mem_access_desc_t g_access;

static void die(const char *what) {
  fprintf(stderr, "bench_cuda: %s: %s\n", what, vp_last_error());
  exit(1);
}

static void cu_check(vp_cu_result_t r, const char *what) {
  if (r == VP_CU_SUCCESS) return;
  const char *name = "?";
  if (cu.get_error_name) cu.get_error_name(r, &name);
  fprintf(stderr, "bench_cuda: %s: CUresult %u (%s)\n", what, r, name);
  exit(1);
}
#define CU(call) cu_check((call), #call)

static void vp_check(int rc, const char *what) {
  if (rc != VP_OK) {
    fprintf(stderr, "bench_cuda: %s returned %s: %s\n", what,
            vp_err_name(rc), vp_last_error());
    exit(1);
  }
}
#define VP(call) vp_check((call), #call)

/* false (with a message) when there is no usable driver or GPU. */
static bool load_driver(void) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
  if (!lib) {
    printf("bench_cuda: no CUDA driver: %s\n", dlerror());
    return false;
  }
  void *sym = dlsym(lib, "cuGetProcAddress_v2");
  if (!sym) {
    printf("bench_cuda: the driver has no cuGetProcAddress_v2\n");
    return false;
  }
  vp_cu_get_proc_address_fn gpa;
  memcpy(&gpa, &sym, sizeof gpa);
  static const struct {
    const char *name;
    void *field;
  } eps[] = {
      {"cuInit", &cu.init},
      {"cuDriverGetVersion", &cu.driver_get_version},
      {"cuDeviceGet", &cu.device_get},
      {"cuDeviceGetName", &cu.device_get_name},
      {"cuDeviceTotalMem", &cu.device_total_mem},
      {"cuDevicePrimaryCtxRetain", &cu.primary_ctx_retain},
      {"cuDevicePrimaryCtxRelease", &cu.primary_ctx_release},
      {"cuCtxPushCurrent", &cu.ctx_push_current},
      {"cuCtxGetCurrent", &cu.ctx_get_current},
      {"cuGetErrorName", &cu.get_error_name},
      {"cuMemGetInfo", &cu.mem_get_info},
      {"cuMemGetAllocationGranularity", &cu.granularity},
      {"cuMemAddressReserve", &cu.address_reserve},
      {"cuMemAddressFree", &cu.address_free},
      {"cuMemCreate", &cu.create},
      {"cuMemRelease", &cu.release},
      {"cuMemMap", &cu.map},
      {"cuMemUnmap", &cu.unmap},
      {"cuMemSetAccess", &cu.set_access},
      {"cuMemAlloc", &cu.mem_alloc},
      {"cuMemFree", &cu.mem_free},
      {"cuMemHostAlloc", &cu.mem_host_alloc},
      {"cuMemFreeHost", &cu.mem_free_host},
      {"cuMemcpyHtoDAsync", &cu.memcpy_htod_async},
      {"cuStreamCreate", &cu.stream_create},
      {"cuStreamDestroy", &cu.stream_destroy},
      {"cuStreamSynchronize", &cu.stream_synchronize},
      {"cuEventCreate", &cu.event_create},
      {"cuEventDestroy", &cu.event_destroy},
      {"cuEventRecord", &cu.event_record},
  };
  for (size_t i = 0; i < sizeof eps / sizeof *eps; i++) {
    void *fn = NULL;
    vp_cu_proc_query_result_t st = 0;
    vp_cu_result_t r = gpa(eps[i].name, &fn, VP_CU_ABI_VERSION,
                           VP_CU_GET_PROC_ADDRESS_LEGACY_STREAM, &st);
    if (r != VP_CU_SUCCESS || !fn || st != 0) {
      printf("bench_cuda: driver has no %s (CUresult %u)\n", eps[i].name, r);
      return false;
    }
    memcpy(eps[i].field, &fn, sizeof fn);
  }
  vp_cu_result_t r = cu.init(0);
  if (r != VP_CU_SUCCESS) {
    printf("bench_cuda: cuInit: CUresult %u\n", r);
    return false;
  }
  if (cu.device_get(&g_dev, 0) != VP_CU_SUCCESS) {
    printf("bench_cuda: no CUDA device 0\n");
    return false;
  }
  /* The primary context (vpager's too) stays current on this thread for
   * the baselines; vpager pushes and pops its own around its calls. */
  vp_cu_context_t pctx;
  CU(cu.primary_ctx_retain(&pctx, g_dev));
  CU(cu.ctx_push_current(pctx));
  g_prop.type = VP_CU_MEM_ALLOCATION_TYPE_PINNED;
  g_prop.location.type = VP_CU_MEM_LOCATION_TYPE_DEVICE;
  g_prop.location.id = 0;
  g_access.location = g_prop.location;
  g_access.flags = VP_CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return true;
}

/* ------------------------------------------------------------ helpers */

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* The median of v[0, n); v is left as it was. */
static double median(const double *v, int n) {
  double *s = malloc((size_t)n * sizeof *s);
  if (!s) die("malloc");
  memcpy(s, v, (size_t)n * sizeof *v);
  qsort(s, (size_t)n, sizeof *s, cmp_double);
  double m = s[n / 2];
  free(s);
  return m;
}

static vp_device_t open_dev(uint64_t page_size, uint32_t poll_us) {
  vp_options_t o;
  VP(vp_options_init(&o));
  o.backend = VP_BACKEND_CUDA;
  o.device_index = 0;
  o.page_size = page_size;
  o.poll_interval_us = poll_us;
  vp_device_t dev;
  VP(vp_device_open(&o, &dev));
  return dev;
}

static vp_stats_t dev_stats(vp_device_t dev) {
  vp_stats_t s;
  memset(&s, 0, sizeof s);
  s.size = sizeof s;
  VP(vp_device_stats(dev, &s));
  return s;
}

static void *pinned_alloc(uint64_t size) {
  void *p = NULL;
  CU(cu.mem_host_alloc(&p, size, 1 /* CU_MEMHOSTALLOC_PORTABLE */));
  memset(p, 0x5a, size);
  return p;
}

static void print_machine(void) {
  char name[256] = "?";
  size_t total = 0;
  int ver = 0;
  CU(cu.device_get_name(name, sizeof name, g_dev));
  CU(cu.device_total_mem(&total, g_dev));
  CU(cu.driver_get_version(&ver));
  char drv[256] = "?";
  FILE *f = fopen("/proc/driver/nvidia/version", "r");
  if (f) {
    if (fgets(drv, sizeof drv, f)) drv[strcspn(drv, "\n")] = '\0';
    fclose(f);
  }
  char cpu[256] = "?", line[512];
  f = fopen("/proc/cpuinfo", "r");
  while (f && fgets(line, sizeof line, f))
    if (strncmp(line, "model name", 10) == 0) {
      char *c = strchr(line, ':');
      if (c) snprintf(cpu, sizeof cpu, "%s", c + 2);
      cpu[strcspn(cpu, "\n")] = '\0';
      break;
    }
  if (f) fclose(f);
  struct utsname u;
  uname(&u);
  time_t t = time(NULL);
  char date[32];
  strftime(date, sizeof date, "%Y-%m-%d %H:%M", gmtime(&t));
  printf("gpu: %s, %.1f GiB; CUDA driver API %d.%d; %s\n", name,
         (double)total / (double)GiB, ver / 1000, ver % 1000 / 10, drv);
  printf("host: %s, %ld cpus, %s %s; %s UTC\n", cpu,
         sysconf(_SC_NPROCESSORS_ONLN), u.sysname, u.release, date);
}

/* ------------------------------------------------ 1. commit and evict */

/* Bare VMM calls for 1 GiB of pages: us per page for commit and evict. */
static void raw_vmm(uint64_t ps, double *commit_us, double *evict_us) {
  uint64_t n = GiB / ps;
  vp_cu_deviceptr_t va = 0;
  CU(cu.address_reserve(&va, GiB, ps, 0, 0));
  vp_cu_mem_handle_t *h = calloc(n, sizeof *h);
  if (!h) die("calloc");
  double t0 = now_us();
  for (uint64_t p = 0; p < n; p++) {
    CU(cu.create(&h[p], ps, &g_prop, 0));
    CU(cu.map(va + p * ps, ps, 0, h[p], 0));
    CU(cu.set_access(va + p * ps, ps, &g_access, 1));
  }
  double t1 = now_us();
  for (uint64_t p = 0; p < n; p++) {
    CU(cu.unmap(va + p * ps, ps));
    CU(cu.release(h[p]));
  }
  double t2 = now_us();
  CU(cu.address_free(va, GiB));
  free(h);
  *commit_us = (t1 - t0) / (double)n;
  *evict_us = (t2 - t1) / (double)n;
}

/* One fault of 1 GiB (commits every page), one free of 1 GiB. */
static void vp_vmm(vp_vbar_t v, uint64_t ps, double *commit_us,
                   double *evict_us) {
  uint64_t n = GiB / ps, freed = 0;
  VP(vp_vbar_prioritize(v)); /* lift the watermark the last free lowered */
  double t0 = now_us();
  VP(vp_fault(v, 0, GiB, NULL, 0));
  double t1 = now_us();
  VP(vp_unpin(v, 0, GiB, 0));
  double t2 = now_us();
  VP(vp_vbar_free_memory(v, GiB, &freed));
  double t3 = now_us();
  if (freed != GiB) die("free 1 GiB");
  *commit_us = (t1 - t0) / (double)n;
  *evict_us = (t3 - t2) / (double)n;
}

static void bench_commit_evict(void) {
  static const uint64_t sizes[] = {2 * MiB, 8 * MiB, 32 * MiB, 64 * MiB};
  printf("\n1. commit / evict per page: 1 GiB per round (one vp_fault of "
         "the range, one vp_vbar_free_memory), median of %d rounds after "
         "a warm-up; baseline: bare cuMemCreate+cuMemMap+cuMemSetAccess / "
         "cuMemUnmap+cuMemRelease of the same pages\n", ROUNDS);
  printf("   %-6s | %-27s | %-27s | %-27s | %-27s | ratio\n", "page",
         "vpager commit", "bare commit", "vpager evict", "bare evict");
  for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
    uint64_t ps = sizes[i], per_gib = GiB / ps;
    vp_device_t dev = open_dev(ps, 5000);
    vp_vbar_t v;
    VP(vp_vbar_create(dev, GiB, &v));
    double vc[ROUNDS], ve[ROUNDS], rc[ROUNDS], re[ROUNDS], a, b;
    vp_vmm(v, ps, &a, &b); /* warm-up */
    raw_vmm(ps, &a, &b);
    for (int r = 0; r < ROUNDS; r++) {
      vp_vmm(v, ps, &vc[r], &ve[r]);
      raw_vmm(ps, &rc[r], &re[r]);
    }
    double mvc = median(vc, ROUNDS), mve = median(ve, ROUNDS),
           mrc = median(rc, ROUNDS), mre = median(re, ROUNDS);
    printf("   %3llu MiB | %7.1f us/page %6.2f ms/GiB | %7.1f us/page "
           "%6.2f ms/GiB | %7.1f us/page %6.2f ms/GiB | %7.1f us/page "
           "%6.2f ms/GiB | commit %.2f, evict %.2f\n",
           (unsigned long long)(ps / MiB), mvc, mvc * per_gib / 1e3, mrc,
           mrc * per_gib / 1e3, mve, mve * per_gib / 1e3, mre,
           mre * per_gib / 1e3, mvc / mrc, mve / mre);
    VP(vp_vbar_destroy(v));
    VP(vp_device_close(dev));
  }
}

/* ----------------------------------------------------- 2. hit path */

static double hit_ns(vp_vbar_t v, long iters) {
  double t0 = now_us();
  for (long i = 0; i < iters; i++) {
    if (vp_fault(v, 0, 4096, NULL, 0) != VP_OK) die("fault");
    if (vp_unpin(v, 0, 4096, 0) != VP_OK) die("unpin");
  }
  return (now_us() - t0) * 1e3 / (double)iters;
}

static double mutex_ns(long iters) {
  pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
  volatile long sink = 0;
  double t0 = now_us();
  for (long i = 0; i < iters; i++) {
    pthread_mutex_lock(&m), sink++, pthread_mutex_unlock(&m);
    pthread_mutex_lock(&m), sink++, pthread_mutex_unlock(&m);
  }
  return (now_us() - t0) * 1e3 / (double)iters;
}

static double event_record_ns(long iters) {
  vp_cu_event_t ev;
  CU(cu.event_create(&ev, VP_CU_EVENT_DISABLE_TIMING));
  double t0 = now_us();
  for (long i = 0; i < iters; i++) CU(cu.event_record(ev, NULL));
  double ns = (now_us() - t0) * 1e3 / (double)iters;
  CU(cu.event_destroy(ev));
  return ns;
}

static void bench_hit(void) {
  long iters = 200000;
  vp_device_t dev = open_dev(32 * MiB, 5000);
  vp_vbar_t v;
  VP(vp_vbar_create(dev, 32 * MiB, &v));
  VP(vp_fault(v, 0, 4096, NULL, 0));
  VP(vp_unpin(v, 0, 4096, 0));
  hit_ns(v, iters / 10); /* warm-up */
  double h[ROUNDS], m[ROUNDS], e[ROUNDS];
  for (int r = 0; r < ROUNDS; r++) {
    h[r] = hit_ns(v, iters);
    m[r] = mutex_ns(iters);
    e[r] = event_record_ns(iters);
  }
  vp_stats_t s = dev_stats(dev);
  double mh = median(h, ROUNDS), mm = median(m, ROUNDS),
         me = median(e, ROUNDS);
  printf("\n2. fault+unpin hit path (resident 32 MiB page, stream 0): %ld "
         "pairs per round, median of %d\n", iters, ROUNDS);
  printf("   vpager %.1f ns/pair | baseline 2 uncontended mutex pairs %.1f "
         "ns, ratio %.1f | bare cuEventRecord (unpin's fence) %.1f ns, "
         "ratio %.2f | hits %llu, pages committed %llu\n",
         mh, mm, mh / mm, me, mh / me, (unsigned long long)s.hits,
         (unsigned long long)s.pages_committed);
  VP(vp_vbar_destroy(v));
  VP(vp_device_close(dev));
}

/* ------------------------------------------ 3. memory queries */

static void bench_queries(void) {
  enum { N = 2000 };
  vp_device_t dev = open_dev(32 * MiB, 0); /* every info call polls */
  void *bctx = vp__registry_get(dev.id)->ctx;
  double t[N];
  size_t f, tot;
  vp_cu_context_t c;
  for (int i = 0; i < N; i++) {
    double t0 = now_us();
    CU(cu.ctx_get_current(&c));
    t[i] = now_us() - t0;
  }
  double floor_us = median(t, N);
  for (int i = 0; i < N; i++) {
    double t0 = now_us();
    CU(cu.mem_get_info(&f, &tot));
    t[i] = now_us() - t0;
  }
  double info_us = median(t, N);
  vp_device_info_t di;
  vp_stats_t s0 = dev_stats(dev);
  for (int i = 0; i < N; i++) {
    double t0 = now_us();
    VP(vp_device_info(dev, &di));
    t[i] = now_us() - t0;
  }
  double poll_us = median(t, N);
  vp_stats_t s1 = dev_stats(dev);
  uint64_t used, total, proc;
  double t0 = now_us();
  int rc = vp__cuda_nvml_info(bctx, &used, &total, &proc);
  double first_us = now_us() - t0;
  printf("\n3. memory queries: median of %d calls\n", N);
  printf("   cuMemGetInfo %.2f us | vpager budget poll (vp_device_info, "
         "%llu polls in %d calls) %.2f us | baseline cuCtxGetCurrent %.3f "
         "us; ratios %.0f, %.0f\n",
         info_us, (unsigned long long)(s1.budget_polls - s0.budget_polls), N,
         poll_us, floor_us, info_us / floor_us, poll_us / floor_us);
  if (rc != VP_OK) {
    printf("   NVML: not available (%s)\n", vp_err_name(rc));
  } else {
    for (int i = 0; i < N; i++) {
      t0 = now_us();
      VP(vp__cuda_nvml_info(bctx, &used, &total, &proc));
      t[i] = now_us() - t0;
    }
    double nvml_us = median(t, N);
    printf("   NVML query (vp__cuda_nvml_info: memory info + process list) "
           "%.2f us, first call (dlopen + nvmlInit) %.1f ms | baseline "
           "cuMemGetInfo %.2f us, ratio %.2f | device used %llu MiB of %llu, "
           "this process ",
           nvml_us, first_us / 1e3, info_us, nvml_us / info_us,
           (unsigned long long)(used / MiB),
           (unsigned long long)(total / MiB));
    if (proc == UINT64_MAX) printf("unknown\n");
    else printf("%llu MiB\n", (unsigned long long)(proc / MiB));
  }
  VP(vp_device_close(dev));
}

/* ------------------------------------------------ 4. evict 1 GiB */

static void bench_evict(void) {
  uint64_t ps = 32 * MiB, n = GiB / ps;
  vp_device_t dev = open_dev(ps, 5000);
  vp_vbar_t v;
  VP(vp_vbar_create(dev, GiB, &v));
  uint64_t base;
  VP(vp_vbar_base(v, &base));
  vp_stream_t s;
  VP(vp_stream_create(dev, &s));
  unsigned char *host = pinned_alloc(ps);
  double done[ROUNDS], busy[ROUNDS], raw[ROUNDS], copy[ROUNDS], x;
  uint64_t waits_done = 0, waits_busy = 0;
  for (int r = -1; r < ROUNDS; r++) {
    for (int pending = 0; pending < 2; pending++) {
      VP(vp_vbar_prioritize(v));
      VP(vp_fault(v, 0, GiB, NULL, 0));
      double c0 = now_us();
      for (uint64_t p = 0; p < n; p++)
        VP(vp_copy_to_device(dev, base + p * ps, host, ps, s));
      VP(vp_unpin(v, 0, GiB, s));
      if (!pending) {
        VP(vp_stream_synchronize(dev, s)); /* this stream only */
        if (r >= 0) copy[r] = now_us() - c0;
      }
      vp_stats_t s0 = dev_stats(dev);
      uint64_t freed = 0;
      double t0 = now_us();
      VP(vp_vbar_free_memory(v, GiB, &freed));
      double ms = (now_us() - t0) / 1e3;
      if (freed != GiB) die("free 1 GiB");
      vp_stats_t s1 = dev_stats(dev);
      if (r < 0) continue;
      if (pending) busy[r] = ms, waits_busy += s1.evict_waits - s0.evict_waits;
      else done[r] = ms, waits_done += s1.evict_waits - s0.evict_waits;
    }
    if (r >= 0) raw_vmm(ps, &x, &raw[r]);
  }
  double md = median(done, ROUNDS), mb = median(busy, ROUNDS),
         mr = median(raw, ROUNDS) * (double)n / 1e3,
         mc = median(copy, ROUNDS) / 1e3;
  printf("\n4. evict 1 GiB (32 pages of 32 MiB), no device synchronize, "
         "fences on a kernel-free stream; median of %d\n", ROUNDS);
  printf("   fences complete: %.2f ms (target <= 3 ms), evict_waits %llu "
         "in %d rounds | baseline bare cuMemUnmap+cuMemRelease of the same "
         "pages %.2f ms, ratio %.2f\n",
         md, (unsigned long long)waits_done, ROUNDS, mr, md / mr);
  printf("   copies of the 1 GiB still in flight: %.2f ms, evict_waits "
         "%llu in %d rounds (waits for those copies only) | baseline the "
         "copies alone %.2f ms\n",
         mb, (unsigned long long)waits_busy, ROUNDS, mc);
  CU(cu.mem_free_host(host));
  VP(vp_stream_destroy(dev, s));
  VP(vp_vbar_destroy(v));
  VP(vp_device_close(dev));
}

/* ------------------------------------------------ 5. steady state */

static void bench_steady(void) {
  enum { LAYERS = 8, PASSES = 20 };
  uint64_t ps = 32 * MiB, layer = 64 * MiB;
  vp_device_t dev = open_dev(ps, 5000);
  vp_vbar_t v;
  VP(vp_vbar_create(dev, LAYERS * layer, &v));
  uint64_t base;
  VP(vp_vbar_base(v, &base));
  vp_stream_t s;
  VP(vp_stream_create(dev, &s));
  unsigned char *host = pinned_alloc(layer);
  uint32_t gens[LAYERS][2] = {{0}};
  printf("\n5. steady state: %d layers of %llu MiB (%llu MiB pages) "
         "faulted, filled when their generations changed, unpinned on a "
         "stream, in order, %d passes; counts per pass from "
         "vp_device_stats\n", LAYERS, (unsigned long long)(layer / MiB),
         (unsigned long long)(ps / MiB), PASSES);
  uint64_t later_commits = 0, later_evicts = 0;
  for (int pass = 1; pass <= PASSES; pass++) {
    vp_stats_t s0 = dev_stats(dev);
    double t0 = now_us();
    int refills = 0;
    for (int l = 0; l < LAYERS; l++) {
      uint32_t g[2];
      VP(vp_fault(v, (uint64_t)l * layer, layer, g, 2));
      if (g[0] != gens[l][0] || g[1] != gens[l][1]) {
        VP(vp_copy_to_device(dev, base + (uint64_t)l * layer, host, layer,
                             s));
        gens[l][0] = g[0], gens[l][1] = g[1];
        refills++;
      }
      VP(vp_unpin(v, (uint64_t)l * layer, layer, s));
    }
    VP(vp_stream_synchronize(dev, s));
    double ms = (now_us() - t0) / 1e3;
    vp_stats_t s1 = dev_stats(dev);
    uint64_t c = s1.pages_committed - s0.pages_committed,
             e = s1.pages_evicted - s0.pages_evicted;
    if (pass > 1) later_commits += c, later_evicts += e;
    printf("   pass %2d: pages committed %2llu, evicted %llu, VMM calls "
           "%2llu, faults %llu (hits %llu, fills %llu, misses %llu), "
           "refills %d, budget polls %llu, %.2f ms\n",
           pass, (unsigned long long)c, (unsigned long long)e,
           (unsigned long long)(3 * c + 2 * e),
           (unsigned long long)(s1.faults - s0.faults),
           (unsigned long long)(s1.hits - s0.hits),
           (unsigned long long)(s1.fills - s0.fills),
           (unsigned long long)(s1.misses - s0.misses), refills,
           (unsigned long long)(s1.budget_polls - s0.budget_polls), ms);
  }
  printf("   passes 2-%d: %llu pages committed, %llu evicted, %llu VMM "
         "calls (baseline: pass 1)\n", PASSES,
         (unsigned long long)later_commits, (unsigned long long)later_evicts,
         (unsigned long long)(3 * later_commits + 2 * later_evicts));
  CU(cu.mem_free_host(host));
  VP(vp_stream_destroy(dev, s));
  VP(vp_vbar_destroy(v));
  VP(vp_device_close(dev));
}

/* ------------------------------------------------------- 6. fill */

static void bench_fill(void) {
  uint64_t ps = 32 * MiB, total = 2 * GiB, n = total / ps;
  vp_device_t dev = open_dev(ps, 5000);
  vp_vbar_t v;
  VP(vp_vbar_create(dev, total, &v));
  uint64_t base;
  VP(vp_vbar_base(v, &base));
  vp_stream_t s;
  VP(vp_stream_create(dev, &s));
  vp_cu_stream_t s2;
  CU(cu.stream_create(&s2, VP_CU_STREAM_NON_BLOCKING));
  double h0 = now_us();
  unsigned char *host = pinned_alloc(total);
  double host_ms = (now_us() - h0) / 1e3;
  vp_cu_deviceptr_t buf;
  CU(cu.mem_alloc(&buf, total));
  double fill[ROUNDS], resident[ROUNDS], plain[ROUNDS], one[ROUNDS];
  for (int r = -1; r < ROUNDS; r++) {
    /* vpager: commit each page, copy into it, unpin on the stream. */
    VP(vp_vbar_free_memory(v, total, NULL));
    VP(vp_vbar_prioritize(v));
    double t0 = now_us();
    for (uint64_t p = 0; p < n; p++) {
      VP(vp_fault(v, p * ps, ps, NULL, 0));
      VP(vp_copy_to_device(dev, base + p * ps, host + p * ps, ps, s));
      VP(vp_unpin(v, p * ps, ps, s));
    }
    VP(vp_stream_synchronize(dev, s));
    double t1 = now_us();
    /* The same copies into pages already resident (no commits). */
    for (uint64_t p = 0; p < n; p++) {
      VP(vp_fault(v, p * ps, ps, NULL, 0));
      VP(vp_copy_to_device(dev, base + p * ps, host + p * ps, ps, s));
      VP(vp_unpin(v, p * ps, ps, s));
    }
    VP(vp_stream_synchronize(dev, s));
    double t2 = now_us();
    /* Plain: the same 32 MiB copies into a cuMemAlloc buffer. */
    for (uint64_t p = 0; p < n; p++)
      CU(cu.memcpy_htod_async(buf + p * ps, host + p * ps, ps, s2));
    CU(cu.stream_synchronize(s2));
    double t3 = now_us();
    CU(cu.memcpy_htod_async(buf, host, total, s2));
    CU(cu.stream_synchronize(s2));
    double t4 = now_us();
    if (r < 0) continue;
    fill[r] = (double)total / (t1 - t0) / 1e3; /* GB/s */
    resident[r] = (double)total / (t2 - t1) / 1e3;
    plain[r] = (double)total / (t3 - t2) / 1e3;
    one[r] = (double)total / (t4 - t3) / 1e3;
  }
  double mf = median(fill, ROUNDS), mres = median(resident, ROUNDS),
         mp = median(plain, ROUNDS), mo = median(one, ROUNDS);
  printf("\n6. fill: %llu MiB from pinned host memory (cuMemHostAlloc, "
         "%.0f ms), %llu pages of %llu MiB, median of %d rounds\n",
         (unsigned long long)(total / MiB), host_ms, (unsigned long long)n,
         (unsigned long long)(ps / MiB), ROUNDS);
  printf("   vpager commit+copy %.2f GB/s | baseline plain "
         "cuMemcpyHtoDAsync of the same 32 MiB chunks into cuMemAlloc "
         "memory %.2f GB/s | ratio %.3f (target >= 0.95)\n", mf, mp, mf / mp);
  printf("   also: vpager copy into resident pages %.2f GB/s (ratio %.3f); "
         "one plain %llu MiB copy %.2f GB/s\n", mres, mres / mp,
         (unsigned long long)(total / MiB), mo);
  CU(cu.mem_free(buf));
  CU(cu.mem_free_host(host));
  CU(cu.stream_destroy(s2));
  VP(vp_stream_destroy(dev, s));
  VP(vp_vbar_destroy(v));
  VP(vp_device_close(dev));
}

/* ------------------------------------------------ 7. release paths */

enum free_way { PER_PAGE, EARLY_RELEASE, ONE_UNMAP };

/* Commit 1 GiB of ps pages at a fresh reservation and free it the given
 * way: us for the free, and whether device free memory came back. */
static double free_run(uint64_t ps, enum free_way way, bool *returned,
                       bool *accepted) {
  uint64_t n = GiB / ps;
  size_t free0, free1, free2, total;
  vp_cu_deviceptr_t va = 0;
  CU(cu.address_reserve(&va, GiB, ps, 0, 0));
  vp_cu_mem_handle_t *h = calloc(n, sizeof *h);
  if (!h) die("calloc");
  CU(cu.mem_get_info(&free0, &total));
  for (uint64_t p = 0; p < n; p++) {
    CU(cu.create(&h[p], ps, &g_prop, 0));
    CU(cu.map(va + p * ps, ps, 0, h[p], 0));
    CU(cu.set_access(va + p * ps, ps, &g_access, 1));
    if (way != PER_PAGE) CU(cu.release(h[p]));
  }
  CU(cu.mem_get_info(&free1, &total));
  *accepted = true;
  double t0 = now_us();
  if (way == ONE_UNMAP) {
    if (cu.unmap(va, GiB) != VP_CU_SUCCESS) { /* fall back per page */
      *accepted = false;
      for (uint64_t p = 0; p < n; p++) CU(cu.unmap(va + p * ps, ps));
    }
  } else {
    for (uint64_t p = 0; p < n; p++) {
      CU(cu.unmap(va + p * ps, ps));
      if (way == PER_PAGE) CU(cu.release(h[p]));
    }
  }
  double t1 = now_us();
  CU(cu.mem_get_info(&free2, &total));
  *returned = free2 + (32 * MiB) >= free0 && free1 + GiB <= free0 + 64 * MiB;
  CU(cu.address_free(va, GiB));
  free(h);
  return t1 - t0;
}

static void bench_release_paths(void) {
  static const uint64_t sizes[] = {2 * MiB, 32 * MiB};
  static const char *names[] = {"unmap+release per page",
                                "release at commit, unmap per page",
                                "release at commit, one unmap of 1 GiB"};
  printf("\n7. freeing 1 GiB of pages, median of %d rounds after a warm-up "
         "(baseline: unmap+release per page, what eviction does)\n", ROUNDS);
  for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
    double base = 0;
    for (int w = PER_PAGE; w <= ONE_UNMAP; w++) {
      double t[ROUNDS];
      bool ret = true, acc = true, r1, a1;
      free_run(sizes[i], (enum free_way)w, &r1, &a1);
      for (int r = 0; r < ROUNDS; r++) {
        t[r] = free_run(sizes[i], (enum free_way)w, &r1, &a1);
        ret = ret && r1;
        acc = acc && a1;
      }
      double m = median(t, ROUNDS) / 1e3;
      if (w == PER_PAGE) base = m;
      printf("   %2llu MiB | %-38s | %7.2f ms/GiB | ratio %.2f | memory "
             "returned: %s%s\n", (unsigned long long)(sizes[i] / MiB),
             names[w], m, m / base, ret ? "yes" : "NO",
             acc ? "" : " (one unmap refused: per page instead)");
    }
  }
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (!load_driver()) return 0;
  print_machine();
  printf("inputs: backend cuda (device 0, its primary context), default "
         "headroom, poll interval 5000 us unless noted; times from "
         "CLOCK_MONOTONIC around the calls\n");
  if (argc > 1 && strcmp(argv[1], "7") == 0) { /* one section */
    bench_release_paths();
    return 0;
  }
  bench_commit_evict();
  bench_hit();
  bench_queries();
  bench_evict();
  bench_steady();
  bench_fill();
  bench_release_paths();
  return 0;
}
