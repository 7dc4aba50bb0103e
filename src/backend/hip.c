/* The HIP backend: AMD GPUs through ROCm's virtual memory API.
 *
 * HIP's VMM calls (hipMemAddressReserve, hipMemCreate, hipMemMap,
 * hipMemSetAccess, ...) have the shape of CUDA's, so the backend operations
 * are vmm.c's, shared with the CUDA backend; this file is the driver
 * adapter. The runtime is loaded at run time (libamdhip64.so, once per
 * process) and each entry point found with dlsym, so vpager builds and runs
 * with no ROCm anywhere; src/backend/hip_abi.h declares the part we use.
 * Without a usable GPU, open returns VP_ENODEV quietly (VP_BACKEND_AUTO
 * moves on) and vp__vmm_open_reason() says why.
 *
 * HIP deprecates its context API (hipCtx*), so where cuda.c pushes the
 * device's primary context around each call, this file makes the device
 * current with hipSetDevice for the call and gives the calling thread its
 * own device back afterwards (hipGetDevice before, hipSetDevice after):
 * hipSetDevice binds the thread to the device's primary context, the same
 * one the framework's HIP calls use.
 *
 * Read in ROCm's sources, not yet met on a GPU (the closing notes of issue
 * 30 list them): hipMemMap and hipMemUnmap queue their work on the
 * device's null stream and wait for it, so a commit or an eviction waits
 * for the compute queued there (PyTorch's default stream) where CUDA's
 * does not; hipMemMap reports success when its mapping failed, and
 * hipMemUnmap of a range nothing maps dereferences a null pointer; some
 * releases (6.4.0-6.4.1, and on consumer GPUs under Linux 7.x) give a
 * released allocation's memory back only when its whole reservation is
 * freed.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "hip_abi.h"
#include "os.h"
#include "vmm.h"

_Static_assert(sizeof(void *) == sizeof(vp_hip_init_fn),
               "function pointers are stored from dlsym's void *");

typedef struct hip_api {
#define VP__HIP_MEMBER(field, symbol, params) vp_hip_##field##_fn field;
  VP_HIP_ENTRY_POINTS(VP__HIP_MEMBER)
#undef VP__HIP_MEMBER
  vp_hip_get_error_name_fn get_error_name;
} hip_api_t;

/* ------------------------------------------------------ the runtime */

/* The runtime's file names, newest first; the bare name is the
 * development link (/opt/rocm/lib, Debian's libamdhip64-dev). The loader
 * finds a runtime already loaded (torch's ROCm build) by its soname, so
 * the process's own is taken, unless a newer soname of this list is
 * installed as well: then two runtimes would meet (not guarded against). */
#ifdef _WIN32
static const char *const libraries[] = {"amdhip64_7.dll", "amdhip64_6.dll",
                                        "amdhip64.dll"};
#else
static const char *const libraries[] = {"libamdhip64.so.7",
                                        "libamdhip64.so.6", "libamdhip64.so",
                                        "libamdhip64.so.5"};
#endif

/* The runtime is one per process and its entry points the same for every
 * device: loaded once (load_once), read-only after. */
static vp__os_once_t load_once = VP__OS_ONCE_INIT;
static void *hip_lib;   /* non-NULL: loaded and every symbol found */
static hip_api_t hip;
static char load_error[256]; /* why not, when hip_lib is NULL */

static const vp__vmm_symbol_t entry_points[] = {
#define VP__HIP_ENTRY(field, symbol, params)                                   \
  {#symbol, offsetof(hip_api_t, field)},
    VP_HIP_ENTRY_POINTS(VP__HIP_ENTRY)
#undef VP__HIP_ENTRY
    {"hipGetErrorName", offsetof(hip_api_t, get_error_name)},
};

/* Tests: the one file to load instead (vp__hip_use_library). */
static const char *test_library;

void vp__hip_use_library(const char *name) { test_library = name; }

static void *open_runtime(void) {
  const char *const *names = libraries;
  size_t n = sizeof libraries / sizeof *libraries;
  if (test_library) {
    names = &test_library;
    n = 1;
  }
  char why[160] = "";
  for (size_t i = 0; i < n; i++) {
    void *lib = vp__os_dl_open(names[i], i == 0 ? why : NULL,
                               i == 0 ? sizeof why : 0);
    if (lib) return lib;
  }
  snprintf(load_error, sizeof load_error, "no HIP runtime (%s): %s",
           names[0], why);
  return NULL;
}

static void load_runtime(void) {
  void *lib = open_runtime();
  if (!lib) return;
  for (size_t i = 0; i < sizeof entry_points / sizeof *entry_points; i++) {
    void *fn = vp__os_dl_sym(lib, entry_points[i].name);
    if (!fn) {
      snprintf(load_error, sizeof load_error, "the HIP runtime has no %s "
               "(ROCm before 5.1 had no virtual memory API)",
               entry_points[i].name);
      vp__os_dl_close(lib);
      return;
    }
    memcpy((char *)&hip + entry_points[i].offset, &fn, sizeof fn);
  }
  hip_lib = lib;
}

/* --------------------------------------------- vmm.c's table, in CUDA's
 * shape: HIP's own entry points where the C types agree, and these
 * conversions where HIP passes pointers for CUDA's integers. */

static void *as_ptr(vp_cu_deviceptr_t p) { return (void *)(uintptr_t)p; }

static vp_hip_mem_handle_t as_handle(vp_cu_mem_handle_t h) {
  return (vp_hip_mem_handle_t)(uintptr_t)h;
}

static vp_cu_result_t reserve(vp_cu_deviceptr_t *ptr, size_t size,
                              size_t alignment, vp_cu_deviceptr_t addr,
                              unsigned long long flags) {
  void *p = NULL;
  vp_cu_result_t r =
      hip.mem_address_reserve(&p, size, alignment, as_ptr(addr), flags);
  *ptr = (uintptr_t)p;
  return r;
}

static vp_cu_result_t address_free(vp_cu_deviceptr_t ptr, size_t size) {
  return hip.mem_address_free(as_ptr(ptr), size);
}

static vp_cu_result_t create(vp_cu_mem_handle_t *handle, size_t size,
                             const vp_cu_mem_alloc_prop_t *prop,
                             unsigned long long flags) {
  vp_hip_mem_handle_t h = NULL;
  vp_cu_result_t r = hip.mem_create(&h, size, prop, flags);
  *handle = (uintptr_t)h;
  return r;
}

static vp_cu_result_t release(vp_cu_mem_handle_t handle) {
  return hip.mem_release(as_handle(handle));
}

static vp_cu_result_t map(vp_cu_deviceptr_t ptr, size_t size, size_t offset,
                          vp_cu_mem_handle_t handle, unsigned long long flags) {
  return hip.mem_map(as_ptr(ptr), size, offset, as_handle(handle), flags);
}

static vp_cu_result_t unmap(vp_cu_deviceptr_t ptr, size_t size) {
  return hip.mem_unmap(as_ptr(ptr), size);
}

static vp_cu_result_t set_access(vp_cu_deviceptr_t ptr, size_t size,
                                 const vp_cu_mem_access_desc_t *desc,
                                 size_t count) {
  return hip.mem_set_access(as_ptr(ptr), size, desc, count);
}

/* HIP's source is not const but is only read. */
static vp_cu_result_t copy_htod(vp_cu_deviceptr_t dst, const void *src,
                                size_t size, vp_cu_stream_t stream) {
  return hip.memcpy_htod_async(as_ptr(dst), (void *)src, size, stream);
}

static vp_cu_result_t copy_dtoh(void *dst, vp_cu_deviceptr_t src, size_t size,
                                vp_cu_stream_t stream) {
  return hip.memcpy_dtoh_async(dst, as_ptr(src), size, stream);
}

/* hipDeviceGetUuid gives the bytes of the ASCII UUID the HSA runtime
 * reports after its "GPU-", and "XX" (then zeros) for a GPU that has none
 * (consumer Radeons): every such GPU the same, so their processes would
 * share one ledger. Those get bytes of their PCI bus id's instead (two
 * FNV-1a hashes of it), which no other GPU in the machine has. */
static bool uuid_unknown(const vp_cu_uuid_t *u) {
  const unsigned char *b = (const unsigned char *)u->bytes;
  int from = b[0] == 'X' && b[1] == 'X' ? 2 : 0;
  for (int i = from; i < 16; i++)
    if (b[i]) return false;
  return true;
}

static vp_cu_result_t uuid(vp_cu_uuid_t *u, vp_cu_device_t dev) {
  vp_cu_result_t r = hip.device_get_uuid(u, dev);
  if (r != VP_CU_SUCCESS || !uuid_unknown(u)) return r;
  char bus[64] = "";
  r = hip.device_get_pci_bus_id(bus, (int)sizeof bus, (int)dev);
  if (r != VP_CU_SUCCESS) return r;
  uint64_t h[2] = {0xcbf29ce484222325ull, 0x84222325cbf29ce4ull};
  for (int k = 0; k < 2; k++)
    for (const char *c = bus; *c; c++)
      h[k] = (h[k] ^ (unsigned char)*c) * 0x100000001b3ull;
  memcpy(u->bytes, h, sizeof h);
  return VP_CU_SUCCESS;
}

/* The entry points whose types are CUDA's already (a mismatch here is a
 * compile error). */
#define VP__HIP_SAME_AS_CUDA(X)                                                \
  X(init) X(device_get_count) X(device_get) X(device_get_attribute)            \
  X(device_total_mem) X(mem_get_info)                                          \
  X(mem_get_allocation_granularity) X(stream_create) X(stream_destroy)         \
  X(stream_synchronize) X(stream_wait_event) X(event_create)                   \
  X(event_destroy) X(event_record) X(event_query) X(event_synchronize)         \
  X(mem_host_register) X(mem_host_unregister) X(synchronize)

static void fill_api(vp__vmm_api_t *api) {
#define VP__HIP_SAME(field) api->field = hip.field;
  VP__HIP_SAME_AS_CUDA(VP__HIP_SAME)
#undef VP__HIP_SAME
  api->device_get_uuid = uuid;
  api->mem_address_reserve = reserve;
  api->mem_address_free = address_free;
  api->mem_create = create;
  api->mem_release = release;
  api->mem_map = map;
  api->mem_unmap = unmap;
  api->mem_set_access = set_access;
  api->memcpy_htod_async = copy_htod;
  api->memcpy_dtoh_async = copy_dtoh;
}

/* ----------------------------------------------------------- driver */

/* What each hipError_t means to the pager (vmm.c: any other is a broken
 * device). HIP numbers these as CUDA does (hip_abi.h), and has none of
 * CUDA's retry-worthy MPS or timeout results: only work still running is
 * worth another try. */
static const vp__vmm_code_t hip_codes[] = {
    VP_VMM_CODE(VP_CU_SUCCESS, VP_OK),
    VP_VMM_CODE(VP_CU_ERROR_OUT_OF_MEMORY, VP_EOOM),
    VP_VMM_CODE(VP_CU_ERROR_NOT_READY, VP_EAGAIN),
    /* The caller's arguments or call order; the device is still fine. */
    VP_VMM_CODE(VP_CU_ERROR_INVALID_VALUE, VP_EINVAL),
    VP_VMM_CODE(VP_HIP_ERROR_INVALID_DEVICE_POINTER, VP_EINVAL),
    VP_VMM_CODE(VP_CU_ERROR_INVALID_HANDLE, VP_EINVAL),
    VP_VMM_CODE(VP_CU_ERROR_INVALID_DEVICE, VP_EINVAL),
    VP_VMM_CODE(VP_CU_ERROR_ALREADY_MAPPED, VP_EINVAL),
    VP_VMM_CODE(VP_CU_ERROR_NOT_MAPPED, VP_EINVAL),
    VP_VMM_CODE(VP_CU_ERROR_NOT_FOUND, VP_EINVAL),
    VP_VMM_CODE(VP_CU_ERROR_ILLEGAL_STATE, VP_EINVAL),
    VP_VMM_CODE(VP_CU_ERROR_NOT_SUPPORTED, VP_EINVAL),
    VP_VMM_CODE(VP_CU_ERROR_HOST_MEMORY_ALREADY_REGISTERED, VP_EINVAL),
    VP_VMM_CODE(VP_CU_ERROR_HOST_MEMORY_NOT_REGISTERED, VP_EINVAL),
    {VP_CU_ERROR_STREAM_CAPTURE_UNSUPPORTED,
     VP_CU_ERROR_STREAM_CAPTURE_WRONG_THREAD, VP_EINVAL},
};

static const char *hip_error_name(const vp__vmm_t *g, vp_cu_result_t r) {
  (void)g;
  const char *name = hip_lib ? hip.get_error_name(r) : NULL;
  return name ? name : "unknown hipError_t";
}

/* The calling thread's device, saved by set_device for give_device_back. */
static _Thread_local int caller_device;

static vp_cu_result_t set_device(vp__vmm_t *g) {
  vp_cu_result_t r = hip.get_device(&caller_device);
  if (r != VP_CU_SUCCESS || caller_device == g->ordinal) return r;
  return hip.set_device(g->ordinal);
}

/* Keeps the call's result r unless only giving the device back failed. */
static vp_cu_result_t give_device_back(vp__vmm_t *g, vp_cu_result_t r) {
  vp_cu_result_t s = caller_device == g->ordinal
                         ? VP_CU_SUCCESS
                         : hip.set_device(caller_device);
  return r != VP_CU_SUCCESS ? r : s;
}

/* Read-only memory (a file mapping) stays pageable, as on CUDA (vmm.c
 * says why); HIP's flag 8 was hipExtHostRegisterCoarseGrained before
 * ROCm 6 besides. */
static const vp__vmm_driver_t hip_driver = {
    .name = "hip", .what = "HIP", VP_VMM_CODES(hip_codes),
    .not_ready = VP_CU_ERROR_NOT_READY, .error_name = hip_error_name,
    .enter = set_device, .leave = give_device_back,
    .attr_vmm = VP_HIP_ATTR_VMM, .attr_integrated = VP_HIP_ATTR_INTEGRATED,
    .host_register_flags = 1, /* hipHostRegisterPortable */
    /* Not tried on a ROCm device: the ring maps each page once there. */
    .map_twice = false,
    .calls = {"hipInit", "hipGetDeviceCount", "hipDeviceGet",
              "hipDeviceGetAttribute", "hipMemCreate/hipMemMap"}};

/* ------------------------------------------------------------- open */

/* The runtime, loaded (once), into g's table. */
static int load(vp__vmm_t *g) {
  vp__os_once(&load_once, load_runtime);
  if (!hip_lib) return vp__vmm_open_fail(VP_ENODEV, "%s", load_error);
  g->drv = &hip_driver;
  fill_api(&g->api);
  return VP_OK;
}

/* ROCm 5.2 and older lay hipMemAllocationProp out otherwise, and before
 * 6.3 the virtual memory API does not page (hip_abi.h). Asked after the
 * devices are counted, so a machine without a GPU says that first. */
static int check_version(void) {
  int v = 0;
  vp_cu_result_t r = hip.runtime_get_version(&v);
  if (r != VP_CU_SUCCESS)
    return vp__vmm_open_fail(VP_ENODEV, "hipRuntimeGetVersion: %s",
                             hip_error_name(NULL, r));
  if (v < VP_HIP_PAGING_VERSION)
    return vp__vmm_open_fail(VP_ENODEV, "HIP runtime %d.%d is older than "
                             "6.3 (ROCm 6.3 or later is needed: before it "
                             "hipMemMap maps whole reservations or "
                             "hipMemRelease frees nothing)",
                             v / 10000000, v / 100000 % 100);
  return VP_OK;
}

/* The device's state is vmm.c's alone: HIP keeps no context of ours. */
static int hip_open(const vp_options_t *opts, vp__inject_t *inj, void **ctx,
                    vp__caps_t *caps) {
  int rc, n = 0;
  vp__vmm_t *g = vp__vmm_open_begin(opts, inj, ctx, caps, sizeof *g, &rc);
  if (!g) return rc;
  rc = load(g);
  if (rc == VP_OK) rc = vp__vmm_count_devices(g, &n);
  if (rc == VP_OK) rc = check_version();
  if (rc == VP_OK) rc = vp__vmm_find_device(g, opts->device_index);
  if (rc == VP_OK && vp__inject_fail(inj))
    rc = vp__vmm_open_fail(VP_ENOMEM, "injected failure");
  if (rc == VP_OK) rc = vp__vmm_query_caps(g, caps);
  if (rc != VP_OK) {
    free(g);
    return rc;
  }
  *ctx = g;
  return VP_OK;
}

/* The runtime stays loaded (RTLD_NODELETE: it runs threads of its own). */
static void hip_close(void *ctx) { free(ctx); }

int vp__hip_device_count(int *count) {
  *count = 0;
  vp__vmm_open_reset();
  vp__vmm_t g;
  memset(&g, 0, sizeof g);
  if (load(&g) == VP_OK)
    vp__vmm_count_devices(&g, count); /* on failure 0, and why */
  return VP_OK; /* no runtime, or no device: 0, and the reason says why */
}

const vp__backend_t vp__backend_hip =
    VP_VMM_BACKEND("hip", hip_open, hip_close, NULL);
