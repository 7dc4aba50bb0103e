/* Choosing the HIP backend, and how it fails where it cannot run: no ROCm
 * runtime, or a runtime and no AMD GPU (this machine's case: Debian's
 * libamdhip64 without a GPU). On a machine with an AMD GPU the runner
 * also runs every test on hip/ (tests/runner.c). */
#include "test.h"

#include "backend.h"
#include "internal.h" /* vp__be_ledger_key */
#include "compat.h" /* dlopen, on Windows too */

/* Open backend `kind` with VPAGER_BACKEND=word as well: the word selects
 * it as the field does. */
static int open_kind(int kind, vp_device_t *dev) {
  vp_options_t o;
  ASSERT_OK(vp_options_init(&o));
  o.backend = kind;
  o.page_size = 2u << 20;
  o.sim_capacity = 64u << 20;
  return vp_device_open(&o, dev);
}

TEST(hip_without_runtime, TEST_SIM_ONLY) {
  vp__hip_use_library("libamdhip64-vpager-test-absent.so");
  vp_device_t dev;
  ASSERT_RC(open_kind(VP_BACKEND_HIP, &dev), VP_ENODEV);
  /* The reason names the backend and the library it looked for. */
  ASSERT_STR_CONTAINS(vp_last_error(), "no HIP device could be opened");
  ASSERT_STR_CONTAINS(vp_last_error(), "libamdhip64-vpager-test-absent.so");
  int n = -1;
  ASSERT_OK(vp_device_count(VP_BACKEND_HIP, &n));
  ASSERT_EQ_INT(n, 0);
  /* AUTO moves on past both GPU backends. */
  ASSERT_OK(open_kind(VP_BACKEND_AUTO, &dev));
  int cuda = 0;
  ASSERT_OK(vp_device_count(VP_BACKEND_CUDA, &cuda));
  if (cuda == 0) ASSERT_EQ_STR(vp_device_backend(dev), "sim");
  ASSERT_OK(vp_device_close(dev));
}

/* Whatever this machine has: an AMD GPU opens and closes; a runtime
 * without a GPU (hipInit fails) or no runtime is VP_ENODEV with the
 * driver's reason, and nothing aborts. */
TEST(hip_open_here, TEST_SIM_ONLY) {
  vp_options_t o;
  setenv("VPAGER_BACKEND", "HIP", 1);
  ASSERT_OK(vp_options_init(&o));
  ASSERT_EQ_INT(o.backend, VP_BACKEND_HIP);
  setenv("VPAGER_BACKEND", "hip", 1);
  ASSERT_OK(vp_options_init(&o));
  unsetenv("VPAGER_BACKEND");
  ASSERT_EQ_INT(o.backend, VP_BACKEND_HIP);
  int n = -1;
  ASSERT_OK(vp_device_count(VP_BACKEND_HIP, &n));
  ASSERT_GE_INT(n, 0);
  vp_device_t dev;
  int rc = open_kind(VP_BACKEND_HIP, &dev);
  if (rc == VP_OK) {
    ASSERT_EQ_STR(vp_device_backend(dev), "hip");
    ASSERT_OK(vp_device_close(dev));
    return;
  }
  ASSERT_RC(rc, VP_ENODEV);
  ASSERT_STR_CONTAINS(vp_last_error(), "no HIP device could be opened: ");
  test_log("here: %s", vp_last_error());
  /* A second open says the same (the runtime is loaded once). */
  ASSERT_RC(open_kind(VP_BACKEND_HIP, &dev), VP_ENODEV);
}

/* Without any GPU, AUTO is the simulated device (with one, the GPU's). */
TEST(auto_without_gpu_is_sim, TEST_SIM_ONLY) {
  int cuda = 0, hip = 0;
  ASSERT_OK(vp_device_count(VP_BACKEND_CUDA, &cuda));
  ASSERT_OK(vp_device_count(VP_BACKEND_HIP, &hip));
  vp_device_t dev;
  ASSERT_OK(open_kind(VP_BACKEND_AUTO, &dev));
  const char *name = vp_device_backend(dev);
  if (cuda == 0 && hip == 0) ASSERT_EQ_STR(name, "sim");
  else ASSERT_TRUE(strcmp(name, "sim") != 0);
  ASSERT_OK(vp_device_close(dev));
}

/* The device each call needs is set for the call and the caller's given
 * back (hip.c: hipSetDevice, not the deprecated hipCtx*). Runs on the
 * stand-in runtime of make check-hip (TEST_HIP_LIBRARY, two devices: its
 * allocations fail unless made with their device current); elsewhere it
 * has nothing to look through. */
TEST(hip_device_given_back, TEST_GPU_ONLY) {
  const char *path = getenv("TEST_HIP_LIBRARY");
  int n = 0;
  ASSERT_OK(vp_device_count(VP_BACKEND_HIP, &n));
  if (ctx->backend != VP_BACKEND_HIP || !path || !*path || n < 2) return;
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  ASSERT_NOT_NULL(lib);
  int (*get)(int *), (*set)(int);
  void *g = dlsym(lib, "hipGetDevice"), *s = dlsym(lib, "hipSetDevice");
  ASSERT_TRUE(g && s);
  memcpy(&get, &g, sizeof get);
  memcpy(&set, &s, sizeof set);
  ASSERT_EQ_INT(set(0), 0);
  vp_options_t o;
  test_options(ctx, &o);
  o.device_index = 1;
  vp_device_t dev = test_open(ctx, &o);
  uint64_t ps = test_info(dev).page_size;
  vp_vbar_t v = test_vbar(dev, 2 * ps);
  ASSERT_OK(vp_fault(v, 0, 2 * ps, NULL, 0));
  int now = -1;
  ASSERT_EQ_INT(get(&now), 0);
  ASSERT_EQ_INT(now, 0);
  ASSERT_OK(vp_unpin(v, 0, 2 * ps, 0));
  ASSERT_OK(vp_vbar_destroy(v));
  ASSERT_OK(vp_device_close(dev));
  ASSERT_EQ_INT(get(&now), 0);
  ASSERT_EQ_INT(now, 0);
}

/* A runtime whose virtual memory API does not page (before ROCm 6.3:
 * hip_abi.h) is refused at open, saying which is needed. On the stand-in
 * runtime of make check-hip (TEST_HIP_LIBRARY, FAKEHIP_VERSION). */
TEST(hip_runtime_too_old_refused, TEST_GPU_ONLY) {
  const char *path = getenv("TEST_HIP_LIBRARY");
  if (ctx->backend != VP_BACKEND_HIP || !path || !*path) return;
  const char *old[] = {"60200000", "60100000", "50300000"};
  for (size_t i = 0; i < sizeof old / sizeof *old; i++) {
    setenv("FAKEHIP_VERSION", old[i], 1);
    vp_device_t dev;
    ASSERT_RC(open_kind(VP_BACKEND_HIP, &dev), VP_ENODEV);
    ASSERT_STR_CONTAINS(vp_last_error(), "ROCm 6.3 or later is needed");
  }
  unsetenv("FAKEHIP_VERSION");
  vp_device_t dev;
  ASSERT_OK(open_kind(VP_BACKEND_HIP, &dev));
  ASSERT_OK(vp_device_close(dev));
}

/* A GPU whose runtime has no UUID for it ("XX", then zeros: consumer
 * Radeons) is keyed by its PCI bus id instead: two such GPUs get two
 * ledgers, not one. On the stand-in runtime of make check-hip (two
 * devices; FAKEHIP_NO_UUID). */
TEST(hip_gpus_without_uuid_keep_their_own_ledgers, TEST_GPU_ONLY) {
  const char *path = getenv("TEST_HIP_LIBRARY");
  int n = 0;
  ASSERT_OK(vp_device_count(VP_BACKEND_HIP, &n));
  if (ctx->backend != VP_BACKEND_HIP || !path || !*path || n < 2) return;
  setenv("FAKEHIP_NO_UUID", "1", 1);
  char key[2][80];
  for (int i = 0; i < 2; i++) {
    vp_options_t o;
    test_options(ctx, &o);
    o.device_index = i;
    vp_device_t dev = test_open(ctx, &o);
    vp__device_t *d = vp__registry_get(dev.id);
    ASSERT_NOT_NULL(d);
    ASSERT_OK(vp__be_ledger_key(d, key[i], sizeof key[i]));
    ASSERT_TRUE(strncmp(key[i], "GPU-", 4) == 0);
    ASSERT_OK(vp_device_close(dev));
  }
  unsetenv("FAKEHIP_NO_UUID");
  ASSERT_TRUE(strcmp(key[0], key[1]) != 0);
}
