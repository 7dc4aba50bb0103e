/* Smoke test of the CUDA backend on a real GPU, through the backend vtable
 * alone: open a device, reserve 1 GiB of address space, commit one 32 MiB
 * page, copy data in and back and check it, evict, free; time every VMM
 * call (one cold pass, then the mean of repeated commit/evict cycles).
 * Prints "no CUDA device: <reason>" and exits 0 when there is none.
 *
 *   make && gcc -std=c11 -D_GNU_SOURCE -O2 -Wall -Wextra -Werror -Iinclude \
 *       -Isrc -Isrc/backend -pthread tools/cuda_smoke.c build/libvpager.a \
 *       -ldl -lrt -o build/cuda_smoke
 *   build/cuda_smoke [device_index]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"

/* Defined in src/backend/cuda.c. */
int vp__cuda_nvml_info(void *ctx, uint64_t *dev_used, uint64_t *dev_total,
                       uint64_t *proc_used);

#define MiB (1024ull * 1024)
#define GiB (1024 * MiB)
#define PAGE (32 * MiB)
#define CYCLES 16

static const vp__backend_t *be = &vp__backend_cuda;
static void *ctx;
static int failures;

/* err_name() lives in src/error.c; this build links only the backend. */
static const char *err_name(int code) {
  switch (code) {
  case VP_OK: return "VP_OK";
#define SMOKE_ERR_NAME(name, value, text) case VP_##name: return "VP_" #name;
    VP_ERRNO_MAP(SMOKE_ERR_NAME)
#undef SMOKE_ERR_NAME
  }
  return "VP_?";
}

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

/* Report a call's result and time; count a failure when rc != want. */
static int check(const char *what, int rc, int want, double us) {
  const char *cu = rc != VP_OK ? vp__vmm_error_name(ctx) : "";
  printf("  %-34s %9.1f us  %s %s%s\n", what, us, err_name(rc), cu,
         rc == want ? "" : "   <-- UNEXPECTED");
  if (rc != want) failures++;
  return rc;
}

/* Time one expression, then check its result. */
#define CALL(what, want, expr)                                                 \
  do {                                                                         \
    double t0_ = now_us();                                                     \
    int rc_ = (expr);                                                          \
    check((what), rc_, (want), now_us() - t0_);                                \
  } while (0)

static void show_memory(const char *when) {
  uint64_t free_b = 0, total = 0;
  double t0 = now_us();
  int rc = be->mem_info(ctx, &free_b, &total);
  double us = now_us() - t0;
  if (check("mem_info", rc, VP_OK, us) == VP_OK)
    printf("    %s: %.1f MiB free of %.1f MiB\n", when,
           (double)free_b / (double)MiB, (double)total / (double)MiB);
}

static void show_nvml(void) {
  uint64_t used = 0, total = 0, ours = 0;
  double t0 = now_us();
  int rc = vp__cuda_nvml_info(ctx, &used, &total, &ours);
  double us = now_us() - t0;
  if (rc != VP_OK) {
    printf("  nvml: not available (%s)\n", err_name(rc));
    return;
  }
  printf("  nvml: device %.1f / %.1f MiB used; this process ",
         (double)used / (double)MiB, (double)total / (double)MiB);
  if (ours == UINT64_MAX) printf("unknown");
  else printf("%.1f MiB", (double)ours / (double)MiB);
  printf(" (%.1f us)\n", us);
}

/* Commit page p of the range at va: create, map, set access. */
static int commit(uint64_t va, vp__phys_t *phys) {
  CALL("phys_create (cuMemCreate)", VP_OK, be->phys_create(ctx, PAGE, phys));
  CALL("map (cuMemMap)", VP_OK, be->map(ctx, va, PAGE, *phys));
  CALL("set_access (cuMemSetAccess)", VP_OK, be->set_access(ctx, va, PAGE));
  return failures;
}

static void evict(uint64_t va, vp__phys_t phys) {
  CALL("unmap (cuMemUnmap)", VP_OK, be->unmap(ctx, va, PAGE));
  CALL("phys_release (cuMemRelease)", VP_OK,
       be->phys_release(ctx, phys, PAGE));
}

/* Copy a pattern in, copy it back on a second stream ordered after the
 * first by an event, and compare. */
static void round_trip(uint64_t va) {
  unsigned char *src = malloc(PAGE), *dst = calloc(1, PAGE);
  if (!src || !dst) {
    printf("  out of host memory\n");
    failures++;
    free(src);
    free(dst);
    return;
  }
  for (size_t i = 0; i < PAGE; i++) src[i] = (unsigned char)(i * 131 + 7);
  int reg_src = be->host_register(ctx, src, PAGE);
  int reg_dst = be->host_register(ctx, dst, PAGE);
  printf("  host_register: src %s, dst %s\n", err_name(reg_src),
         err_name(reg_dst));
  vp_stream_t s1 = 0, s2 = 0;
  vp__event_t ev = 0;
  CALL("stream_create", VP_OK, be->stream_create(ctx, &s1));
  CALL("stream_create", VP_OK, be->stream_create(ctx, &s2));
  CALL("event_create", VP_OK, be->event_create(ctx, &ev));
  double t0 = now_us();
  CALL("copy_htod 32 MiB (enqueue)", VP_OK,
       be->copy_htod(ctx, va, src, PAGE, s1));
  CALL("event_record", VP_OK, be->event_record(ctx, ev, s1));
  CALL("stream_wait_event", VP_OK, be->stream_wait_event(ctx, s2, ev));
  CALL("copy_dtoh 32 MiB (enqueue)", VP_OK,
       be->copy_dtoh(ctx, dst, va, PAGE, s2));
  CALL("event_record", VP_OK, be->event_record(ctx, ev, s2));
  CALL("event_synchronize", VP_OK, be->event_synchronize(ctx, ev));
  double us = now_us() - t0;
  CALL("event_query (complete)", VP_OK, be->event_query(ctx, ev));
  CALL("stream_synchronize", VP_OK, be->stream_synchronize(ctx, s1));
  bool same = memcmp(src, dst, PAGE) == 0;
  printf("  round trip of 32 MiB: %.1f us (%.1f GB/s each way), data %s\n",
         us, 2.0 * PAGE / us / 1e3, same ? "intact" : "CORRUPTED");
  if (!same) failures++;
  CALL("event_destroy", VP_OK, be->event_destroy(ctx, ev));
  CALL("stream_destroy", VP_OK, be->stream_destroy(ctx, s1));
  CALL("stream_destroy", VP_OK, be->stream_destroy(ctx, s2));
  if (reg_src == VP_OK) be->host_unregister(ctx, src);
  if (reg_dst == VP_OK) be->host_unregister(ctx, dst);
  free(src);
  free(dst);
}

/* Mean time of each VMM call over CYCLES commit/evict cycles. */
static void cycles(uint64_t va) {
  double t[5] = {0};
  for (int i = 0; i < CYCLES && !failures; i++) {
    vp__phys_t phys = 0;
    double t0 = now_us();
    int rc = be->phys_create(ctx, PAGE, &phys);
    double t1 = now_us();
    if (!rc) rc = be->map(ctx, va, PAGE, phys);
    double t2 = now_us();
    if (!rc) rc = be->set_access(ctx, va, PAGE);
    double t3 = now_us();
    if (!rc) rc = be->unmap(ctx, va, PAGE);
    double t4 = now_us();
    if (!rc) rc = be->phys_release(ctx, phys, PAGE);
    double t5 = now_us();
    if (rc) {
      check("commit/evict cycle", rc, VP_OK, 0);
      return;
    }
    t[0] += t1 - t0, t[1] += t2 - t1, t[2] += t3 - t2, t[3] += t4 - t3,
        t[4] += t5 - t4;
  }
  printf("  mean of %d cycles, 32 MiB page (us): create %.1f  map %.1f  "
         "set_access %.1f  unmap %.1f  release %.1f\n", CYCLES,
         t[0] / CYCLES, t[1] / CYCLES, t[2] / CYCLES, t[3] / CYCLES,
         t[4] / CYCLES);
}

/* The error mapping on real failures: an impossible allocation is out of
 * memory, a misaligned mapping is the caller's bug. */
static void errors(uint64_t va, uint64_t granularity, uint64_t total) {
  vp__phys_t phys = 0;
  uint64_t huge = (2 * total + granularity - 1) / granularity * granularity;
  CALL("phys_create 2x device memory", VP_EOOM,
       be->phys_create(ctx, huge, &phys));
  if (be->phys_create(ctx, granularity, &phys) != VP_OK) {
    check("phys_create", VP_EDEVICE, VP_OK, 0);
    return;
  }
  CALL("map at a misaligned address", VP_EINVAL,
       be->map(ctx, va + 4096, granularity, phys));
  be->phys_release(ctx, phys, granularity);
}

int main(int argc, char **argv) {
  vp_options_t opts;
  memset(&opts, 0, sizeof opts);
  opts.size = sizeof opts;
  opts.backend = VP_BACKEND_CUDA;
  opts.device_index = argc > 1 ? atoi(argv[1]) : 0;
  opts.headroom = -1;
  vp__inject_t inj = {0};
  vp__caps_t caps;
  double t0 = now_us();
  int rc = be->open(&opts, &inj, &ctx, &caps);
  double open_us = now_us() - t0;
  if (rc == VP_ENODEV) {
    printf("no CUDA device: %s\n", vp__vmm_open_reason());
    return 0;
  }
  if (rc != VP_OK) {
    printf("open failed: %s: %s\n", err_name(rc), vp__vmm_open_reason());
    return 1;
  }
  printf("cuda smoke: device %d, granularity %llu KiB, %.1f GiB, default "
         "headroom %.0f MiB, open %.0f us\n", opts.device_index,
         (unsigned long long)(caps.granularity / 1024),
         (double)caps.total_memory / (double)GiB,
         (double)caps.default_headroom / (double)MiB, open_us);
  show_memory("at open");
  show_nvml();

  uint64_t va = 0;
  CALL("va_reserve 1 GiB", VP_OK, be->va_reserve(ctx, GiB, &va));
  if (failures) goto out_close;
  printf("  range at 0x%llx\n", (unsigned long long)va);
  uint64_t page_va = va + PAGE; /* the second page: not the range's base */
  vp__phys_t phys = 0;
  printf("first commit:\n");
  if (commit(page_va, &phys) == 0) {
    show_memory("one page committed");
    round_trip(page_va);
    printf("evict:\n");
    evict(page_va, phys);
    show_memory("evicted");
  }
  if (!failures) cycles(page_va);
  if (!failures) errors(va, caps.granularity, caps.total_memory);
  CALL("va_free 1 GiB", VP_OK, be->va_free(ctx, va, GiB));
  show_nvml();
out_close:
  t0 = now_us();
  be->close(ctx);
  printf("  close: %.1f us\n", now_us() - t0);
  printf("cuda smoke: %s (%d failure%s)\n", failures ? "FAILED" : "OK",
         failures, failures == 1 ? "" : "s");
  return failures ? 1 : 0;
}
