/* What callers used to ask the driver themselves (issue 27): the device
 * count of a backend, and dropping a host registration another library
 * made (vp_device_count, vp_host_unregister), on both backends. */
#include "test.h"
#include "compat.h"

TEST(device_count, TEST_ALL_BACKENDS) {
  int n = -1;
  ASSERT_OK(vp_device_count(VP_BACKEND_SIM, &n));
  ASSERT_EQ_INT(n, 1);
  n = -1;
  ASSERT_OK(vp_device_count(VP_BACKEND_CUDA, &n));
  /* Here under the CUDA backend a device opened: the driver sees it. */
  if (strcmp(ctx->backend_name, "cuda") == 0) ASSERT_GE_INT(n, 1);
  else ASSERT_GE_INT(n, 0);
  n = -1;
  ASSERT_OK(vp_device_count(VP_BACKEND_HIP, &n));
  if (strcmp(ctx->backend_name, "hip") == 0) ASSERT_GE_INT(n, 1);
  else ASSERT_GE_INT(n, 0);
  ASSERT_RC(vp_device_count(VP_BACKEND_AUTO, &n), VP_EINVAL);
  ASSERT_EQ_INT(n, 0);
  ASSERT_NOT_NULL(strstr(vp_last_error(), "vp_device_count"));
  ASSERT_RC(vp_device_count(7, &n), VP_EINVAL);
  ASSERT_RC(vp_device_count(VP_BACKEND_SIM, NULL), VP_EINVAL);
}

TEST(host_unregister, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  size_t len = 1 << 20;
  void *p = mmap(NULL, len, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_TRUE(p != MAP_FAILED);
  memset(p, 1, len);
  bool gpu = strcmp(vp_device_backend(dev), "sim") != 0;
  /* Memory nobody registered: the driver says so; the simulated device
   * registers nothing and has nothing to refuse. */
  if (gpu) ASSERT_RC(vp_host_unregister(dev, p), VP_EINVAL);
  else ASSERT_OK(vp_host_unregister(dev, p));
  /* vpager's own registration (a host buffer's, registered or allocated)
   * is vp_hostbuf_free's: refused anywhere inside it, naming that call;
   * once freed, the memory is nobody's again. (A client's own
   * cuMemHostRegister dropped here: gpu_host_unregister_client.) */
  vp_hostbuf_t hb;
  ASSERT_OK(vp_hostbuf_register(dev, p, len, &hb));
  ASSERT_RC(vp_host_unregister(dev, p), VP_EBUSY);
  ASSERT_NOT_NULL(strstr(vp_last_error(), "vp_hostbuf_free"));
  ASSERT_RC(vp_host_unregister(dev, (char *)p + len - 1), VP_EBUSY);
  ASSERT_OK(vp_hostbuf_free(hb));
  if (gpu) ASSERT_RC(vp_host_unregister(dev, p), VP_EINVAL);
  else ASSERT_OK(vp_host_unregister(dev, p));
  vp_hostbuf_info_t hi;
  ASSERT_OK(vp_hostbuf_alloc(dev, len, len, &hb));
  ASSERT_OK(vp_hostbuf_info(hb, &hi));
  ASSERT_RC(vp_host_unregister(dev, hi.ptr), VP_EBUSY);
  ASSERT_OK(vp_hostbuf_free(hb));
  ASSERT_RC(vp_host_unregister(dev, NULL), VP_EINVAL);
  ASSERT_OK(vp_device_close(dev));
  ASSERT_RC(vp_host_unregister(dev, p), VP_EHANDLE);
  munmap(p, len);
}

/* The platform's soft limit: on the simulated device what the test sets
 * (0 = none); on CUDA whatever NVML says for our cgroup (0 on most
 * machines: no MPS v3 / dmem limit), never an error. */
TEST(device_soft_limit, TEST_ALL_BACKENDS) {
  vp_device_t dev = test_open(ctx, NULL);
  uint64_t soft = 12345;
  ASSERT_OK(vp_device_soft_limit(dev, &soft));
  if (strcmp(vp_device_backend(dev), "sim") == 0) {
    ASSERT_EQ_U64(soft, 0);
    ASSERT_OK(vp_sim_inject(dev, VP_SIM_SET_SOFT_LIMIT, 7ull << 30));
    ASSERT_OK(vp_device_soft_limit(dev, &soft));
    ASSERT_EQ_U64(soft, 7ull << 30);
    ASSERT_OK(vp_sim_inject(dev, VP_SIM_SET_SOFT_LIMIT, 0));
    ASSERT_OK(vp_device_soft_limit(dev, &soft));
    ASSERT_EQ_U64(soft, 0);
  } else {
    test_note("soft limit %" PRIu64, soft);
  }
  ASSERT_RC(vp_device_soft_limit(dev, NULL), VP_EINVAL);
  ASSERT_OK(vp_device_close(dev));
  ASSERT_RC(vp_device_soft_limit(dev, &soft), VP_EHANDLE);
  ASSERT_EQ_U64(soft, 0);
}
