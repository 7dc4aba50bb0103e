/* The CUDA backend's two-device and context paths on the stand-in driver
 * of make check-cuda-fake (tests/fakecuda/: two devices, strict about
 * contexts), where test_gpu.c's tests, which load kernels, cannot run. On
 * a real driver this test has nothing to add to gpu_two_devices and
 * gpu_foreign_context and returns at once. */
#include "test.h"

#include "compat.h" /* dlopen, on Windows too */
#include "cuda_abi.h"

typedef struct fake_driver {
  vp_cu_init_fn init;
  vp_cu_primary_ctx_retain_fn primary_ctx_retain;
  vp_cu_primary_ctx_release_fn primary_ctx_release;
  vp_cu_ctx_push_current_fn ctx_push_current;
  vp_cu_ctx_pop_current_fn ctx_pop_current;
  vp_cu_mem_get_info_fn mem_get_info;
  /* cuDevicePrimaryCtxGetState (the stand-in's, for the test) */
  vp_cu_result_t (*primary_ctx_get_state)(vp_cu_device_t dev,
                                          unsigned int *flags, int *active);
} fake_driver_t;

/* The stand-in's entry points; false on any other driver. */
static bool fake_driver(fake_driver_t *d) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib || !dlsym(lib, "vp_fake_cuda_driver")) return false;
  void *sym = dlsym(lib, "cuGetProcAddress_v2");
  ASSERT_NOT_NULL(sym);
  vp_cu_get_proc_address_fn gpa;
  memcpy(&gpa, &sym, sizeof gpa);
  static const struct {
    const char *name;
    size_t offset;
  } want[] = {
      {"cuInit", offsetof(fake_driver_t, init)},
      {"cuDevicePrimaryCtxRetain", offsetof(fake_driver_t, primary_ctx_retain)},
      {"cuDevicePrimaryCtxRelease",
       offsetof(fake_driver_t, primary_ctx_release)},
      {"cuCtxPushCurrent", offsetof(fake_driver_t, ctx_push_current)},
      {"cuCtxPopCurrent", offsetof(fake_driver_t, ctx_pop_current)},
      {"cuMemGetInfo", offsetof(fake_driver_t, mem_get_info)},
      {"cuDevicePrimaryCtxGetState",
       offsetof(fake_driver_t, primary_ctx_get_state)},
  };
  for (size_t i = 0; i < sizeof want / sizeof *want; i++) {
    void *fn = NULL;
    vp_cu_proc_query_result_t status = 1;
    ASSERT_EQ_INT(gpa(want[i].name, &fn, VP_CU_ABI_VERSION,
                      VP_CU_GET_PROC_ADDRESS_LEGACY_STREAM, &status), 0);
    ASSERT_TRUE(fn && status == VP_CU_GET_PROC_ADDRESS_SUCCESS);
    memcpy((char *)d + want[i].offset, &fn, sizeof fn);
  }
  ASSERT_EQ_INT(d->init(0), 0);
  return true;
}

/* Device memory in use on GPU `ordinal`, seen from its primary context
 * (pushed over the caller's and popped). */
static uint64_t used_on(const fake_driver_t *d, int ordinal) {
  vp_cu_context_t pc = NULL, popped = NULL;
  ASSERT_EQ_INT(d->primary_ctx_retain(&pc, ordinal), 0);
  ASSERT_EQ_INT(d->ctx_push_current(pc), 0);
  size_t free_bytes = 0, total = 0;
  ASSERT_EQ_INT(d->mem_get_info(&free_bytes, &total), 0);
  ASSERT_EQ_INT(d->ctx_pop_current(&popped), 0);
  ASSERT_EQ_PTR(popped, pc);
  ASSERT_EQ_INT(d->primary_ctx_release(ordinal), 0);
  return total - free_bytes;
}

/* Whether GPU `ordinal`'s primary context is retained by anyone. */
static bool retained(const fake_driver_t *d, int ordinal) {
  unsigned int flags = 0;
  int active = -1;
  ASSERT_EQ_INT(d->primary_ctx_get_state(ordinal, &flags, &active), 0);
  return active != 0;
}

/* The context on top of the thread's stack is `want` (popped and pushed
 * back). */
#define ASSERT_CALLER_CURRENT(d, want)                                         \
  do {                                                                         \
    vp_cu_context_t top_ = NULL;                                               \
    ASSERT_EQ_INT((d)->ctx_pop_current(&top_), 0);                            \
    ASSERT_EQ_PTR(top_, (want));                                               \
    ASSERT_EQ_INT((d)->ctx_push_current(top_), 0);                             \
  } while (0)

/* Device 1 and device 0 used together while the caller has device 0's
 * primary context current: each GPU's pages go to that GPU, data goes
 * both ways, the caller's context is current after every call, and
 * closing gives every byte and every primary context retain back. */
TEST(cuda_two_devices_stand_in, TEST_GPU_ONLY) {
  fake_driver_t d;
  if (ctx->backend != VP_BACKEND_CUDA || !fake_driver(&d)) return;
  vp_cu_context_t caller = NULL;
  ASSERT_EQ_INT(d.primary_ctx_retain(&caller, 0), 0);
  ASSERT_EQ_INT(d.ctx_push_current(caller), 0);
  uint64_t start[2] = {used_on(&d, 0), used_on(&d, 1)};
  vp_device_t dev[2];
  vp_vbar_t v[2];
  uint64_t ps = 0;
  for (int i = 0; i < 2; i++) {
    vp_options_t o;
    test_options(ctx, &o);
    o.device_index = 1 - i; /* device 1 first: not the caller's */
    dev[i] = test_open(ctx, &o);
    ASSERT_CALLER_CURRENT(&d, caller);
    ps = test_info(dev[i]).page_size;
    v[i] = test_vbar(dev[i], (uint64_t)(3 - i) * ps);
    ASSERT_OK(vp_fault(v[i], 0, (uint64_t)(3 - i) * ps, NULL, 0));
    ASSERT_CALLER_CURRENT(&d, caller);
  }
  /* dev[0] is GPU 1 with 3 pages, dev[1] GPU 0 with 2. */
  ASSERT_GE_U64(used_on(&d, 1), start[1] + 3 * ps);
  ASSERT_GE_U64(used_on(&d, 0), start[0] + 2 * ps);
  for (int i = 0; i < 2; i++) {
    uint64_t base = test_vbar_base(v[i]);
    test_write_pattern(dev[i], base + ps, ps, (uint64_t)(7 + i));
    ASSERT_TRUE(test_check_pattern(dev[i], base + ps, ps, (uint64_t)(7 + i)));
    ASSERT_CALLER_CURRENT(&d, caller);
  }
  vp_stream_t s = 0;
  ASSERT_OK(vp_stream_create(dev[0], &s));
  ASSERT_OK(vp_unpin(v[0], 0, 3 * ps, s));
  ASSERT_OK(vp_unpin(v[1], 0, 2 * ps, 0));
  uint64_t freed = 0;
  ASSERT_OK(vp_vbar_free_memory(v[0], 3 * ps, &freed));
  ASSERT_EQ_U64(freed, 3 * ps);
  ASSERT_OK(vp_stream_synchronize(dev[0], s));
  ASSERT_OK(vp_stream_destroy(dev[0], s));
  ASSERT_CALLER_CURRENT(&d, caller);
  for (int i = 0; i < 2; i++) {
    ASSERT_OK(vp_vbar_destroy(v[i]));
    ASSERT_OK(vp_device_close(dev[i]));
    ASSERT_CALLER_CURRENT(&d, caller);
  }
  ASSERT_EQ_U64(used_on(&d, 0), start[0]);
  ASSERT_EQ_U64(used_on(&d, 1), start[1]);
  ASSERT_TRUE(!retained(&d, 1)); /* close let go of it */
  vp_cu_context_t popped = NULL;
  ASSERT_EQ_INT(d.ctx_pop_current(&popped), 0);
  ASSERT_EQ_PTR(popped, caller);
  ASSERT_EQ_INT(d.ctx_pop_current(&popped), VP_CU_ERROR_INVALID_CONTEXT);
  ASSERT_EQ_INT(d.primary_ctx_release(0), 0);
  ASSERT_TRUE(!retained(&d, 0));
}
