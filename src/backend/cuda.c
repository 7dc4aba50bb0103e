/* The CUDA backend: NVIDIA GPUs through the driver's virtual memory API.
 *
 * The driver is loaded at run time (libcuda.so.1, nvcuda.dll) and every entry
 * point is resolved with cuGetProcAddress at VP_CU_ABI_VERSION, so vpager
 * builds and runs with no CUDA anywhere; src/cuda_abi.h declares the part
 * of the ABI we use. Without a usable GPU, open returns VP_ENODEV quietly
 * (that is how VP_BACKEND_AUTO falls back to the simulated device) and
 * vp__vmm_open_reason() says why.
 *
 * The backend operations are vmm.c's, shared with the HIP backend: this
 * file loads the driver and fills vmm.c's table, describes CUDA's results,
 * owns the context, and asks NVML.
 *
 * Each device owns its GPU's primary context: retained at open, pushed
 * around every driver call and popped after it (vmm.c's enter and leave),
 * released at close. So a thread that has another device (or another
 * context) current still talks to the right GPU, and the caller's current
 * context is left as it was. Nothing here synchronises a context or the
 * device.
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cuda_abi.h"
#include "os.h"
#include "vmm.h"

/* The driver's and NVML's file names (docs/windows.md: Windows loads them
 * from System32 by these names). */
#ifdef _WIN32
#define CUDA_LIBRARY "nvcuda.dll"
#define NVML_LIBRARY "nvml.dll"
#else
#define CUDA_LIBRARY "libcuda.so.1"
#define NVML_LIBRARY "libnvidia-ml.so.1"
#endif

_Static_assert(sizeof(size_t) == sizeof(uint64_t), "LP64 only");
_Static_assert(sizeof(void *) == sizeof(vp_cu_init_fn),
               "function pointers are stored from cuGetProcAddress's void *");

typedef struct cu_api {
#define VP__CU_MEMBER(field, symbol, version, params) vp_cu_##field##_fn field;
  VP_CU_ENTRY_POINTS(VP__CU_MEMBER)
#undef VP__CU_MEMBER
} cu_api_t;

/* NVML, loaded on first use (nvmlInit costs ~10 ms) and only if present. */
typedef struct nvml {
  vp__os_mutex_t lock; /* guards everything below */
  bool tried;
  void *lib; /* non-NULL: loaded, initialised, device found */
  vp_nvml_device_t dev;
  vp_nvml_shutdown_fn shutdown;
  vp_nvml_get_memory_info_fn memory_info;
  vp_nvml_get_compute_procs_fn compute_procs; /* may be NULL */
  vp_nvml_get_memory_limits_fn memory_limits; /* may be NULL */
} nvml_t;

/* The copies by SMs (copy_htod_sm): the optional entry points, and the
 * kernel, loaded at the first such copy. */
typedef struct pull {
  struct {
#define VP__CU_MEMBER(field, symbol, version, params) vp_cu_##field##_fn field;
    VP_CU_PULL_ENTRY_POINTS(VP__CU_MEMBER)
#undef VP__CU_MEMBER
  } cu;                     /* all NULL if the driver lacks one */
  vp__os_mutex_t lock;      /* guards the four below */
  bool tried;
  vp_cu_module_t module;    /* non-NULL: loaded, fn found */
  vp_cu_function_t fn;
  bool refused;             /* a launch failed: the copy engine's since */
} pull_t;

typedef struct cuda {
  vp__vmm_t vmm; /* first: the ctx of vmm.c's operations */
  cu_api_t cu;   /* read-only after open */
  void *lib;
  vp_cu_context_t pctx; /* the retained primary context */
  nvml_t nvml;
  pull_t pull;
} cuda_t;

static cuda_t *as_cuda(const vp__vmm_t *g) {
  return (cuda_t *)g; /* vmm is cuda_t's first member */
}

/* ---------------------------------------------------------- results */

/* What each CUresult means to the pager (vmm.c: any other is a broken
 * device: ILLEGAL_ADDRESS, LAUNCH_FAILED, ECC_UNCORRECTABLE, ASSERT,
 * CONTEXT_IS_DESTROYED, DEINITIALIZED, MPS client loss, UNKNOWN, codes
 * newer than us, ...). */
#define ONE VP_VMM_CODE
static const vp__vmm_code_t cu_codes[] = {
    ONE(VP_CU_SUCCESS, VP_OK),
    ONE(VP_CU_ERROR_OUT_OF_MEMORY, VP_EOOM),
    /* Worth a bounded retry: work still running, a timed-out wait, an MPS
     * server that is starting or full. */
    ONE(VP_CU_ERROR_NOT_READY, VP_EAGAIN),
    ONE(VP_CU_ERROR_TIMEOUT, VP_EAGAIN),
    ONE(VP_CU_ERROR_MPS_SERVER_NOT_READY, VP_EAGAIN),
    ONE(VP_CU_ERROR_MPS_MAX_CLIENTS_REACHED, VP_EAGAIN),
    ONE(VP_CU_ERROR_MPS_MAX_CONNECTIONS_REACHED, VP_EAGAIN),
    /* The caller's arguments or call order; the context is still fine. */
    ONE(VP_CU_ERROR_INVALID_VALUE, VP_EINVAL),
    ONE(VP_CU_ERROR_INVALID_HANDLE, VP_EINVAL),
    ONE(VP_CU_ERROR_INVALID_DEVICE, VP_EINVAL),
    ONE(VP_CU_ERROR_ALREADY_MAPPED, VP_EINVAL),
    ONE(VP_CU_ERROR_NOT_MAPPED, VP_EINVAL),
    ONE(VP_CU_ERROR_NOT_FOUND, VP_EINVAL),
    ONE(VP_CU_ERROR_ILLEGAL_STATE, VP_EINVAL),
    ONE(VP_CU_ERROR_NOT_PERMITTED, VP_EINVAL),
    ONE(VP_CU_ERROR_NOT_SUPPORTED, VP_EINVAL),
    ONE(VP_CU_ERROR_HOST_MEMORY_ALREADY_REGISTERED, VP_EINVAL),
    ONE(VP_CU_ERROR_HOST_MEMORY_NOT_REGISTERED, VP_EINVAL),
    /* Stream capture misuse (900-908) is the caller's too. */
    {VP_CU_ERROR_STREAM_CAPTURE_UNSUPPORTED,
     VP_CU_ERROR_STREAM_CAPTURE_WRONG_THREAD, VP_EINVAL},
};
#undef ONE

static const char *cu_error_name(const vp__vmm_t *g, vp_cu_result_t r) {
  const cuda_t *c = as_cuda(g);
  const char *name = NULL;
  if (!c->cu.get_error_name || c->cu.get_error_name(r, &name) || !name)
    return "unknown CUresult";
  return name;
}

/* --------------------------------------------------------- contexts */

/* Make our context current on this thread for one driver call. */
static vp_cu_result_t push_context(vp__vmm_t *g) {
  cuda_t *c = as_cuda(g);
  return c->cu.ctx_push_current(c->pctx);
}

/* Undo push_context(); keeps the call's result r unless only the pop
 * failed. */
static vp_cu_result_t pop_context(vp__vmm_t *g, vp_cu_result_t r) {
  vp_cu_context_t popped;
  vp_cu_result_t p = as_cuda(g)->cu.ctx_pop_current(&popped);
  return r != VP_CU_SUCCESS ? r : p;
}

static const vp__vmm_driver_t cu_driver = {
    .name = "cuda", .what = "CUDA", .error_name = cu_error_name,
    .enter = push_context, .leave = pop_context,
    VP_VMM_CODES(cu_codes), .not_ready = VP_CU_ERROR_NOT_READY,
    .attr_vmm = VP_CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
    .attr_integrated = VP_CU_DEVICE_ATTRIBUTE_INTEGRATED,
    /* DEVICEMAP: the copies by SMs read registered memory. */
    .host_register_flags = VP_CU_MEMHOSTREGISTER_PORTABLE |
                           VP_CU_MEMHOSTREGISTER_DEVICEMAP,
    /* cuMemMap maps one allocation at several addresses. */
    .map_twice = true,
    .calls = {"cuInit", "cuDeviceGetCount", "cuDeviceGet",
              "cuDeviceGetAttribute", "cuMemCreate/cuMemMap"}};

/* ------------------------------------------------------------- open */

static const vp__vmm_symbol_t entry_points[] = {
#define VP__CU_ENTRY(field, symbol, version, params)                           \
  {#symbol, offsetof(cu_api_t, field)},
    VP_CU_ENTRY_POINTS(VP__CU_ENTRY)
#undef VP__CU_ENTRY
};

/* Base names plus our ABI version: the driver picks the variant (e.g.
 * cuMemGetInfo_v2), and LEGACY_STREAM the non-_ptsz one, so stream 0 is
 * the legacy default stream as in any program built without
 * --default-stream per-thread. */
static int resolve(cuda_t *c, vp_cu_get_proc_address_fn gpa) {
  for (size_t i = 0; i < sizeof entry_points / sizeof *entry_points; i++) {
    const vp__vmm_symbol_t *e = &entry_points[i];
    void *fn = NULL;
    vp_cu_proc_query_result_t status = VP_CU_GET_PROC_ADDRESS_SUCCESS;
    vp_cu_result_t r = gpa(e->name, &fn, VP_CU_ABI_VERSION,
                           VP_CU_GET_PROC_ADDRESS_LEGACY_STREAM, &status);
    if (r == VP_CU_ERROR_STUB_LIBRARY)
      return vp__vmm_open_fail(VP_ENODEV, CUDA_LIBRARY " is the toolkit's "
                               "stub library, not a driver");
    if (r != VP_CU_SUCCESS || !fn ||
        status != VP_CU_GET_PROC_ADDRESS_SUCCESS)
      return vp__vmm_open_fail(VP_ENODEV, "driver has no %s for CUDA %d "
                               "(CUresult %u, status %u)", e->name,
                               VP_CU_ABI_VERSION, r, status);
    memcpy((char *)&c->cu + e->offset, &fn, sizeof fn);
  }
  /* The copies by SMs' entry points: all or none. */
  static const vp__vmm_symbol_t pull_points[] = {
#define VP__CU_PULL(field, symbol, version, params)                            \
  {#symbol, offsetof(pull_t, cu.field)},
      VP_CU_PULL_ENTRY_POINTS(VP__CU_PULL)
#undef VP__CU_PULL
  };
  bool all = true;
  for (size_t i = 0; i < sizeof pull_points / sizeof *pull_points; i++) {
    void *fn = NULL;
    vp_cu_proc_query_result_t status = VP_CU_GET_PROC_ADDRESS_SUCCESS;
    vp_cu_result_t r = gpa(pull_points[i].name, &fn, VP_CU_ABI_VERSION,
                           VP_CU_GET_PROC_ADDRESS_LEGACY_STREAM, &status);
    all = all && r == VP_CU_SUCCESS && fn &&
          status == VP_CU_GET_PROC_ADDRESS_SUCCESS;
    memcpy((char *)&c->pull + pull_points[i].offset, &fn, sizeof fn);
  }
  if (!all) memset(&c->pull.cu, 0, sizeof c->pull.cu);
  c->vmm.drv = &cu_driver;
#define VP__CU_SHARE(field) c->vmm.api.field = c->cu.field;
  VP_VMM_CALLS(VP__CU_SHARE)
#undef VP__CU_SHARE
  return VP_OK;
}

/* Load and resolve; undoes itself on failure. The driver starts threads at
 * cuInit and must never be unmapped under them: vp__os_dl_open's library
 * is never unloaded for good. */
static int load_driver(cuda_t *c) {
  char why[192];
  c->lib = vp__os_dl_open(CUDA_LIBRARY, why, sizeof why);
  if (!c->lib) return vp__vmm_open_fail(VP_ENODEV, "%s", why);
  void *sym = vp__os_dl_sym(c->lib, "cuGetProcAddress_v2");
  int rc;
  if (!sym) {
    rc = vp__vmm_open_fail(VP_ENODEV, CUDA_LIBRARY " has no "
                           "cuGetProcAddress_v2 (driver older than CUDA "
                           "12.0)");
  } else {
    vp_cu_get_proc_address_fn gpa;
    memcpy(&gpa, &sym, sizeof gpa);
    rc = resolve(c, gpa);
  }
  if (rc != VP_OK) vp__os_dl_close(c->lib);
  return rc;
}

/* A GPU taken by another process (exclusive mode) or unlicensed is not
 * usable: VP_ENODEV, so AUTO moves on. */
static int retain_context(cuda_t *c) {
  vp_cu_result_t r = c->cu.primary_ctx_retain(&c->pctx, c->vmm.dev);
  if (r == VP_CU_SUCCESS) return VP_OK;
  int rc = vp__vmm_result(&c->vmm, r);
  if (r == VP_CU_ERROR_DEVICE_UNAVAILABLE || r == VP_CU_ERROR_NO_DEVICE ||
      r == VP_CU_ERROR_DEVICE_NOT_LICENSED)
    rc = VP_ENODEV;
  return vp__vmm_open_fail(rc, "cuDevicePrimaryCtxRetain(%d): %s",
                           c->vmm.ordinal, cu_error_name(&c->vmm, r));
}

static int cuda_open(const vp_options_t *opts, vp__inject_t *inj, void **ctx,
                     vp__caps_t *caps) {
  int rc;
  cuda_t *c = as_cuda(vp__vmm_open_begin(opts, inj, ctx, caps, sizeof *c, &rc));
  if (!c) return rc;
  rc = load_driver(c);
  if (rc != VP_OK) goto fail_free;
  rc = vp__vmm_find_device(&c->vmm, opts->device_index);
  if (rc != VP_OK) goto fail_unload;
  if (vp__inject_fail(inj)) {
    rc = vp__vmm_open_fail(VP_ENOMEM, "injected failure");
    goto fail_unload;
  }
  rc = retain_context(c);
  if (rc != VP_OK) goto fail_unload;
  if (vp__inject_fail(inj)) {
    rc = vp__vmm_open_fail(VP_ENOMEM, "injected failure");
    goto fail_release;
  }
  rc = vp__vmm_query_caps(&c->vmm, caps);
  if (rc != VP_OK) goto fail_release;
  if (vp__os_mutex_init(&c->nvml.lock) != 0) {
    rc = vp__vmm_open_fail(VP_ENOMEM, "cannot make the NVML lock");
    goto fail_release;
  }
  if (vp__os_mutex_init(&c->pull.lock) != 0) {
    vp__os_mutex_destroy(&c->nvml.lock);
    rc = vp__vmm_open_fail(VP_ENOMEM, "cannot make the pull lock");
    goto fail_release;
  }
  *ctx = c;
  return VP_OK;

fail_release:
  c->cu.primary_ctx_release(c->vmm.dev);
fail_unload:
  vp__os_dl_close(c->lib);
fail_free:
  free(c);
  return rc;
}

static void nvml_unload(cuda_t *c);

static void cuda_close(void *ctx) {
  cuda_t *c = ctx;
  if (!c) return;
  nvml_unload(c);
  vp__os_mutex_destroy(&c->nvml.lock);
  if (c->pull.module && push_context(&c->vmm) == VP_CU_SUCCESS)
    pop_context(&c->vmm, c->pull.cu.module_unload(c->pull.module));
  vp__os_mutex_destroy(&c->pull.lock);
  c->cu.primary_ctx_release(c->vmm.dev);
  vp__os_dl_close(c->lib);
  free(c);
}

/* ------------------------------------------------------------- NVML */

/* By UUID, not index: NVML and CUDA may number GPUs differently
 * (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER). A MIG instance is "MIG-". */
static bool nvml_find(cuda_t *c, vp_nvml_get_handle_by_uuid_fn by_uuid) {
  static const char *const prefixes[] = {"GPU-", "MIG-"};
  for (size_t i = 0; i < 2; i++) {
    char text[48];
    vp__vmm_uuid_text(&c->vmm, prefixes[i], text);
    if (by_uuid(text, &c->nvml.dev) == VP_NVML_SUCCESS) return true;
  }
  return false;
}

/* Called once, with nvml.lock held. Leaves nvml.lib NULL on any failure:
 * NVML is optional. */
static void nvml_load(cuda_t *c) {
  nvml_t *n = &c->nvml;
  n->tried = true;
  void *lib = vp__os_dl_open(NVML_LIBRARY, NULL, 0);
  if (!lib) return;
  vp_nvml_init_fn init;
  vp_nvml_get_handle_by_uuid_fn by_uuid;
  void *s_init = vp__os_dl_sym(lib, "nvmlInit_v2");
  void *s_shut = vp__os_dl_sym(lib, "nvmlShutdown");
  void *s_uuid = vp__os_dl_sym(lib, "nvmlDeviceGetHandleByUUID");
  void *s_mem = vp__os_dl_sym(lib, "nvmlDeviceGetMemoryInfo");
  void *s_procs = vp__os_dl_sym(lib, "nvmlDeviceGetComputeRunningProcesses_v3");
  if (!s_init || !s_shut || !s_uuid || !s_mem) goto fail_close;
  memcpy(&init, &s_init, sizeof init);
  memcpy(&n->shutdown, &s_shut, sizeof n->shutdown);
  memcpy(&by_uuid, &s_uuid, sizeof by_uuid);
  memcpy(&n->memory_info, &s_mem, sizeof n->memory_info);
  memcpy(&n->compute_procs, &s_procs, sizeof n->compute_procs);
  void *s_limits = vp__os_dl_sym(lib, "nvmlDeviceGetMemoryLimits_v1");
  memcpy(&n->memory_limits, &s_limits, sizeof n->memory_limits);
  if (init() != VP_NVML_SUCCESS) goto fail_close;
  if (!nvml_find(c, by_uuid)) goto fail_shutdown;
  n->lib = lib;
  return;

fail_shutdown:
  n->shutdown();
fail_close:
  vp__os_dl_close(lib);
}

static void nvml_unload(cuda_t *c) {
  if (!c->nvml.lib) return;
  c->nvml.shutdown();
  vp__os_dl_close(c->nvml.lib);
  c->nvml.lib = NULL;
}

/* Sum of this process's entries; UINT64_MAX when unknown (no _v3 entry
 * point, or our pid is not listed, e.g. from inside a PID namespace). */
static uint64_t nvml_proc_used(cuda_t *c) {
  if (!c->nvml.compute_procs) return UINT64_MAX;
  vp_nvml_process_info_t small[32], *infos = small;
  unsigned int count = 32;
  vp_nvml_return_t r = c->nvml.compute_procs(c->nvml.dev, &count, infos);
  if (r == VP_NVML_ERROR_INSUFFICIENT_SIZE) {
    count += 16; /* room for processes starting meanwhile */
    infos = calloc(count, sizeof *infos);
    if (!infos) return UINT64_MAX;
    r = c->nvml.compute_procs(c->nvml.dev, &count, infos);
  }
  uint64_t used = UINT64_MAX;
  unsigned int pid = (unsigned int)vp__os_pid();
  for (unsigned int i = 0; r == VP_NVML_SUCCESS && i < count; i++)
    if (infos[i].pid == pid && infos[i].used_gpu_memory != UINT64_MAX)
      used = (used == UINT64_MAX ? 0 : used) + infos[i].used_gpu_memory;
  if (infos != small) free(infos);
  return used;
}

/* The soft limit NVML reports for this process's cgroup on this GPU
 * (bytes); 0 when there is none: no NVML, a driver without
 * nvmlDeviceGetMemoryLimits_v1, no cgroup v2, no MPS v3 / dmem limit. */
int vp__cuda_soft_limit(void *ctx, uint64_t *bytes) {
  cuda_t *c = ctx;
  *bytes = 0;
  char cg[600];
  if (!vp__os_cgroup_path(cg, sizeof cg)) return VP_OK;
  vp__os_mutex_lock(&c->nvml.lock);
  if (!c->nvml.tried) nvml_load(c);
  vp_nvml_memory_limits_t lim;
  memset(&lim, 0, sizeof lim);
  lim.name_space = cg;
  if (c->nvml.lib && c->nvml.memory_limits &&
      c->nvml.memory_limits(c->nvml.dev, &lim) == VP_NVML_SUCCESS)
    *bytes = lim.soft_limit;
  vp__os_mutex_unlock(&c->nvml.lock);
  return VP_OK;
}

/* Device memory as NVML sees it (used, total) and this process's own use
 * (UINT64_MAX: unknown). VP_EUNSUPPORTED without NVML. The first call loads
 * NVML (~10 ms); later ones cost a few µs. Thread-safe. */
int vp__cuda_nvml_info(void *ctx, uint64_t *dev_used, uint64_t *dev_total,
                       uint64_t *proc_used) {
  cuda_t *c = ctx;
  int rc = VP_EUNSUPPORTED;
  vp__os_mutex_lock(&c->nvml.lock);
  if (!c->nvml.tried) nvml_load(c);
  vp_nvml_memory_t mem;
  if (c->nvml.lib &&
      c->nvml.memory_info(c->nvml.dev, &mem) == VP_NVML_SUCCESS) {
    *dev_used = mem.used;
    *dev_total = mem.total;
    *proc_used = nvml_proc_used(c);
    rc = VP_OK;
  }
  vp__os_mutex_unlock(&c->nvml.lock);
  return rc;
}

/* ----------------------------------------------------- copies by SMs */

#include "pull_ptx.h"

#define PULL_THREADS 256
#define PULL_BLOCKS_MAX 1024

/* The kernel, loaded once (the driver JIT-compiles its PTX, a few ms);
 * false if it cannot be (a driver without the entry points, or older
 * than the PTX). */
static bool pull_ready(cuda_t *c) {
  pull_t *p = &c->pull;
  vp__os_mutex_lock(&p->lock);
  if (!p->tried && p->cu.module_load_data) {
    p->tried = true;
    vp_cu_module_t mod = NULL;
    vp_cu_result_t r = push_context(&c->vmm);
    if (r == VP_CU_SUCCESS) {
      r = p->cu.module_load_data(&mod, vp__pull_ptx);
      if (r == VP_CU_SUCCESS &&
          (r = p->cu.module_get_function(&p->fn, mod, "vp_pull")) !=
              VP_CU_SUCCESS)
        p->cu.module_unload(mod);
      r = pop_context(&c->vmm, r);
    }
    if (r == VP_CU_SUCCESS) p->module = mod; /* else the copy engine's */
  }
  bool ok = p->module != NULL && !p->refused;
  vp__os_mutex_unlock(&p->lock);
  return ok;
}

/* src's bytes read by `programs` blocks of vp_pull (pull.cu) on `stream`
 * instead of the copy engine. VP_EUNSUPPORTED, nothing queued, where it
 * cannot: no kernel, an address not 16-byte aligned, host memory the
 * device cannot read (not registered: cuMemHostGetDevicePointer says so).
 * Called without the pager's lock, as the other copies. */
static int cuda_copy_htod_sm(void *ctx, uint64_t dst, const void *src,
                             uint64_t size, vp_stream_t stream,
                             uint32_t programs) {
  cuda_t *c = ctx;
  if (!programs || ((dst | (uint64_t)(uintptr_t)src) & 15) || !pull_ready(c))
    return VP_EUNSUPPORTED;
  vp_cu_result_t r = push_context(&c->vmm);
  if (r != VP_CU_SUCCESS) return vp__vmm_result(&c->vmm, r);
  vp_cu_deviceptr_t from = 0, to = dst;
  unsigned long long n = size;
  if (c->pull.cu.mem_host_get_device_pointer(&from, (void *)(uintptr_t)src,
                                             0) != VP_CU_SUCCESS) {
    pop_context(&c->vmm, VP_CU_SUCCESS);
    return VP_EUNSUPPORTED;
  }
  void *params[] = {&to, &from, &n};
  unsigned int blocks = programs < PULL_BLOCKS_MAX ? programs : PULL_BLOCKS_MAX;
  r = c->pull.cu.launch_kernel(c->pull.fn, blocks, 1, 1, PULL_THREADS, 1, 1,
                               0, (vp_cu_stream_t)(uintptr_t)stream, params,
                               NULL);
  r = pop_context(&c->vmm, r);
  if (r == VP_CU_SUCCESS) return VP_OK;
  /* A launch refused (resources, an image the GPU cannot run) is no
   * broken device: the copy engine copies, from now on. A context that is
   * broken fails that copy as well, and says so there. */
  vp__os_mutex_lock(&c->pull.lock);
  c->pull.refused = true;
  vp__os_mutex_unlock(&c->pull.lock);
  return VP_EUNSUPPORTED;
}

/* ---------------------------------------------------------- helpers */

int vp__cuda_device_count(int *count) {
  *count = 0;
  vp__vmm_open_reset();
  cuda_t *c = calloc(1, sizeof *c);
  if (!c) return vp__vmm_open_fail(VP_ENOMEM, "out of host memory");
  int rc = load_driver(c);
  if (rc == VP_OK) {
    vp__vmm_count_devices(&c->vmm, count); /* on failure 0, and why */
    vp__os_dl_close(c->lib);
  }
  free(c);
  return VP_OK; /* no driver, or no device: 0, and the reason says why */
}

const vp__backend_t vp__backend_cuda =
    VP_VMM_BACKEND("cuda", cuda_open, cuda_close, cuda_copy_htod_sm);
